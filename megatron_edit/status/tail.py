"""Reading record files while they grow: every file the patterns match (a path, a glob, or a
``--local-sgd-sync-record`` path with ``{worker}``), looked for again at each read, each read from
where the last read stopped. A line not ended yet (a writer in the middle of its ``write``, or a
file copied while written) is kept for the next read; a file that shrank (truncated, replaced) is
read again from its start, and that is said.

A line that is not a JSON object, or a record of a schema this reader does not know, is left
out and counted (:attr:`RecordFiles.problems`), never dropped in silence.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, List, Optional

from ..exchange.record import SCHEMA


def pattern_of(path: str) -> str:
    """The glob of ``path``: a ``--local-sgd-sync-record`` path's ``{worker}`` (and the
    supervisor's ``{replica_id}``) become ``*``, its doubled braces single ones; a path without
    braces is used as it is (its own ``*``, ``?`` and ``[...]`` are a glob's)."""
    path = os.path.expanduser(path.replace("{replica_id}", "{worker}"))
    if "{" not in path and "}" not in path:
        return path
    pieces = [piece.replace("{{", "{").replace("}}", "}") for piece in path.split("{worker}")]
    return "*".join(glob.escape(piece) for piece in pieces)


def pattern_problem(pattern: str, flag: str) -> Optional[str]:
    """Why ``pattern`` (one of ``flag``'s values) can never match a record file, in one line;
    None when it can (it may match nothing yet: a run's workers create their files at their first
    record)."""
    directory = os.path.dirname(os.path.abspath(pattern))
    if glob.has_magic(directory):
        return f"{flag} {pattern}: only the file name may hold a glob's * ? [ ] (the directory must be one)."
    if not os.path.isdir(directory):
        return f"{flag} {pattern}: the directory {directory} does not exist; give the run's record path."
    if os.path.isdir(pattern):
        return f"{flag} {pattern}: a directory; give the record file's path, or a glob such as {pattern}/*.jsonl."
    return None


class _Tail:
    """One file: where the next read starts, and the end of a line not ended yet."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self, problems: List[str]) -> List[bytes]:
        """The lines ended since the last read (without their newline)."""
        try:
            size = os.path.getsize(self.path)
        except OSError:  # (gone since the glob saw it)
            return []
        if size < self.offset:
            problems.append(f"{self.path} shrank from {self.offset} to {size} bytes: read again from its start")
            self.offset, self.partial = 0, b""
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [line for line in lines if line.strip()]


class RecordFiles:
    """The record files of ``patterns`` (see the module): :meth:`read` returns the records
    written since the last call, in each file's order."""

    def __init__(self, patterns: List[str]):
        self.patterns = list(patterns)
        self._tails: Dict[str, _Tail] = {}
        self.problems: List[str] = []
        """What was left out or read again, one line each (the page shows them)."""
        self.skipped = 0
        """Lines left out: not a JSON object, or of another schema."""

    @property
    def paths(self) -> List[str]:
        """The files read so far, in the order found."""
        return list(self._tails)

    def read(self) -> List[dict]:
        for pattern in self.patterns:
            for path in sorted(glob.glob(pattern)):
                if path not in self._tails and os.path.isfile(path):
                    self._tails[path] = _Tail(path)
        records = []
        for tail in self._tails.values():
            for line in tail.read(self.problems):
                record = self._parse(tail.path, line)
                if record is not None:
                    records.append(record)
        return records

    def _parse(self, path: str, line: bytes):
        try:
            record = json.loads(line)
        except ValueError as e:
            return self._skip(f"{path}: a line that is not JSON ({e.msg} at column {e.colno}) left out")
        if not isinstance(record, dict) or "worker" not in record or "run_id" not in record:
            return self._skip(f"{path}: a line that is not a sync record (no worker or run_id) left out")
        if record.get("schema") != SCHEMA:
            return self._skip(f"{path}: a record of schema {record.get('schema')!r} left out: this reader knows "
                              f"schema {SCHEMA} (read it with the megatron_edit that wrote it)")
        return record

    def _skip(self, problem: str) -> None:
        self.skipped += 1
        if len(self.problems) < 100:  # (the first ones say what is wrong; the count says how often)
            self.problems.append(problem)
        return None
