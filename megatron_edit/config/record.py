"""The per-sync record's setting of :class:`~megatron_edit.config.LocalSGDConfig`
(``sync_record``: where each worker's records go) and its check, a part of
:mod:`megatron_edit.config`, which re-exports it. The field is declared on
:class:`~megatron_edit.config.LocalSGDConfig`; the record itself is
:mod:`megatron_edit.mcore.sync_record`'s.

A path that cannot be written is refused when the config is built, in one line naming the flag:
before any work on every route (Megatron-LM's start-up checks, the main job's flag checks,
``LocalSGDConfig(...)`` itself), not at the first sync, hours in.
"""

from __future__ import annotations

import os
from typing import Optional

from .values import ConfigError, _got, _name, _require


def record_path(path: str, worker: int) -> str:
    """The file worker ``worker`` writes its records to: ``path`` with ``{worker}`` replaced,
    ``~`` expanded, absolute."""
    return os.path.abspath(os.path.expanduser(path.format(worker=worker)))


def _unwritable(path: str) -> Optional[str]:
    """Why ``path`` cannot be appended to (None: it can)."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        return f"the directory {directory} does not exist (create it first)"
    if os.path.isdir(path):
        return "it is a directory (give a file's path)"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "the file is not writable"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"the directory {directory} is not writable"
    return None


def check_record_path(path: str, worker: int) -> str:
    """The file of worker ``worker`` (:func:`record_path`), or a :class:`ConfigError` naming the
    flag when it cannot be written."""
    try:
        resolved = record_path(path, worker)
    except (KeyError, IndexError, ValueError, AttributeError):
        raise ConfigError(
            f"{_name('sync_record')}: {path!r} holds braces other than {{worker}} (the worker's id, "
            "for a file per worker); double a literal brace ({{ or }}).") from None
    problem = _unwritable(resolved)
    if problem:
        raise ConfigError(f"{_name('sync_record')}: cannot write {resolved}: {problem}.")
    return resolved


class RecordSettings:
    """The record's check, mixed into LocalSGDConfig."""

    def _check_sync_record(self) -> None:
        """``sync_record``: None, or a path whose file can be appended to (worker 0's, where the
        path holds ``{worker}``; each worker's writer checks its own when it starts)."""
        path = self.sync_record
        if path is None:
            return
        _require(isinstance(path, str) and bool(path.strip()), "sync_record",
                 f"must be a file's path or None ({_got(path)}).")
        check_record_path(path, 0)
