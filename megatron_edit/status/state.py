"""A run's state from its per-sync records (issue 59; the records: docs/reference/sync-record.md),
for the status page and ``/metrics``: pure, records in (in any order: files are read one after
the other), a JSON-ready view out.

**Runs.** Records carry their ``run_id``; a file appended by several runs holds them all. Each
run is kept apart; the page shows one, the newest (the run of the latest record) unless another
is chosen, and ``/metrics`` every run, labelled.

**A worker's state** (:data:`STATES`), from the records of every worker in time order (each
record's ``time``, when its sync ended), then the clock:

* ``training``: from its first record; again after a heal or a committed sync.
* ``dead``: another worker's record says it left the quorum (a ``left`` event; the workers that
  stay all say it at their next sync), or, under the supervisor, its job exited; until a record of
  its own comes after that.
* ``healing``: a ``join`` record (a relaunched or new worker's join round) without a heal when
  the worker was seen before or the run is past the step it joins at: it has come back behind the
  others and heals from them at its next sync (a heal event then, ``training`` again). A join with
  a heal is ``training`` at once; the first round of a fresh run (every worker at step 0) too.
* ``finished``: its record of the run's last sync (``last_sync``; A-EDiT's ``final``).
* ``waiting``: ``training`` or ``healing``, but no record for longer than :data:`WAIT_INTERVALS`
  times the run's median time between a worker's syncs (at least :data:`WAIT_FLOOR_S`): it waits
  for the others (a quorum, a slow or dead peer not yet noticed) or it is stuck. A record ends it.
"""

from __future__ import annotations

import bisect
import statistics
from typing import Dict, Iterable, List, Optional, Tuple

STATES = ("training", "waiting", "healing", "dead", "finished")
WAIT_INTERVALS = 3.0
"""A worker silent this many times the run's median time between syncs is ``waiting``..."""
WAIT_FLOOR_S = 30.0
"""... and at least this many seconds (a run's first syncs, a slow start)."""
SYNCS_SHOWN = 200
"""The run's latest syncs the view holds (the plots and the quorum table)."""

_TOTALS = ("bytes_sent", "bytes_received", "exchange_seconds", "exposed_wait_seconds", "arrival_wait_seconds")


class _Worker:
    """One worker's figures in one run: totals over its records and its newest record."""

    def __init__(self, worker: int):
        self.worker = worker
        self.syncs = self.joins = self.not_committed = self.heals = self.heal_bytes = 0
        self.excluded = self.missing_ranks = 0
        self.totals = dict.fromkeys(_TOTALS, 0.0)
        self.latest: Optional[dict] = None
        self.sync_times: List[float] = []

    def add(self, record: dict, heals: List[dict]) -> None:
        if record["kind"] == "sync":
            self.syncs += 1
            self.not_committed += not record["committed"]
            bisect.insort(self.sync_times, record["time"])
        else:  # (a join round: a fresh run's first never commits, nothing to apply yet)
            self.joins += 1
        for name in _TOTALS:
            self.totals[name] += record.get(name) or 0
        self.heals += len(heals)
        self.heal_bytes += sum(h.get("bytes") or 0 for h in heals)
        self.excluded += any(e.get("worker") == self.worker for e in record.get("excluded") or ())
        self.missing_ranks += len(record.get("missing_ranks") or ())
        if self.latest is None or record["time"] >= self.latest["time"]:
            self.latest = record


class RunState:
    """One run (see the module): :meth:`add` its records, :meth:`view` it."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.workers: Dict[int, _Worker] = {}
        self.syncs: Dict[int, dict] = {}
        """Step -> the run's sync at that step: its quorum and each worker's figures."""
        self.items: List[tuple] = []
        """What moves a worker's state, in time order: (time, order, kind, worker, detail)."""
        self.records = 0
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self._machine: Optional[Tuple[int, dict, dict]] = None

    def add(self, record: dict) -> None:
        """One record of this run (any order)."""
        when, worker = float(record["time"]), int(record["worker"])
        record = dict(record, time=when, worker=worker)
        events = record.get("events") or []
        heals = [e for e in events if e.get("event") == "heal"]
        self.workers.setdefault(worker, _Worker(worker)).add(record, heals)
        self.records += 1
        self.first = when if self.first is None else min(self.first, when)
        self.last = when if self.last is None else max(self.last, when)
        step = record.get("step")
        detail = dict(step=step, committed=record["committed"], last=record.get("last_sync") or record.get("final"),
                      heal=heals[0] if heals else None)
        self._item(when, 1, record["kind"], worker, detail)
        for event in events:
            if event.get("event") == "left":
                for other in event.get("workers") or ():
                    self._item(when, 2, "left", int(other), dict(step=step, seen_by=worker))
        if record["kind"] == "sync" and step is not None:
            self._add_sync(record)

    def add_exit(self, worker: int, when: float, code: Optional[int]) -> None:
        """The supervisor saw worker ``worker``'s job exit with ``code`` at ``when``."""
        self._item(float(when), 0, "exited", int(worker), dict(code=code))

    def _item(self, when: float, order: int, kind: str, worker: int, detail: dict) -> None:
        bisect.insort(self.items, (when, order, kind, worker, detail), key=lambda item: item[:2])
        self._machine = None

    def _add_sync(self, record: dict) -> None:
        sync = self.syncs.setdefault(record["step"], dict(step=record["step"], time=record["time"], participants=None,
                                                          trained=None, committed=True, excluded=[], workers={}))
        sync["time"] = min(sync["time"], record["time"])
        for name in ("participants", "trained"):
            if record.get(name) is not None and (sync[name] is None or record["committed"]):
                sync[name] = record[name]
        sync["committed"] = sync["committed"] and bool(record["committed"])
        sync["excluded"] = sorted({e["worker"] for e in record.get("excluded") or ()} | set(sync["excluded"]))
        sync["workers"][str(record["worker"])] = {
            name: record.get(name) for name in ("bytes_sent", "exchange_seconds", "exposed_wait_seconds",
                                                "arrival_wait_seconds", "committed")}

    # ------------------------------------------------------------------ the states
    def _states(self) -> Tuple[dict, dict]:
        """Each worker's state and history from :attr:`items` (see the module), before the clock."""
        if self._machine is not None and self._machine[0] == len(self.items):
            return self._machine[1], self._machine[2]
        state: Dict[int, str] = {}
        history: Dict[int, List[dict]] = {}
        furthest = -1  # the highest step of any record so far

        def move(worker, to, when, event, why, step=None, always=False):
            if always or state.get(worker) != to:
                history.setdefault(worker, []).append(dict(time=when, state=to, event=event, why=why, step=step))
            state[worker] = to

        for when, _, kind, worker, d in self.items:
            step, before = d.get("step"), state.get(worker)
            if kind == "exited":
                move(worker, "dead", when, "exited", f"its job exited (code {d['code']}; the supervisor saw it)")
            elif kind == "left":
                if before not in ("dead", "finished", None):
                    move(worker, "dead", when, "left", f"left the quorum: worker {d['seen_by']}'s sync at step "
                                                       f"{step} went on without it", step)
            elif d["heal"] is not None:
                move(worker, "training", when, "healed", f"healed from worker(s) {d['heal'].get('from_workers')} "
                                                         f"at step {step}", step, always=True)
            elif kind == "join" and (before is not None or (step or 0) < furthest):
                move(worker, "healing", when, "joined", f"joined behind the run (at step {step}, the run at "
                                                        f"{furthest}): heals from the others at its next sync", step,
                     always=True)
            elif before is None:
                move(worker, "training", when, "started", f"first record (step {step})", step)
            elif before == "dead" or (before == "healing" and d["committed"]):
                move(worker, "training", when, "synced", f"back in the run: a sync at step {step}", step)
            if d.get("last"):
                move(worker, "finished", when, "finished", f"its record of the run's last sync (step {step})", step)
            if step is not None and kind != "left":
                furthest = max(furthest, step)
        self._machine = (len(self.items), state, history)
        return state, history

    def interval(self) -> Optional[float]:
        """The median time between a worker's consecutive syncs (its latest 50), over the workers."""
        latest = [w.sync_times[-51:] for w in self.workers.values()]
        gaps = [b - a for times in latest for a, b in zip(times, times[1:])]
        return statistics.median(gaps) if gaps else None

    def view(self, now: float) -> dict:
        """The run at ``now`` (seconds since the epoch, as the records' ``time``): JSON-ready."""
        state, history = self._states()
        interval = self.interval()
        wait_after = max(WAIT_FLOOR_S, WAIT_INTERVALS * interval) if interval else WAIT_FLOOR_S
        rows = [self._row(w, state.get(w.worker, "training"), history.get(w.worker, []), now, wait_after)
                for _, w in sorted(self.workers.items())]
        syncs = [self.syncs[s] for s in sorted(self.syncs)[-SYNCS_SHOWN:]]
        timeline = sorted((dict(item, worker=w) for w, items in history.items() for item in items),
                          key=lambda item: (item["time"], item["worker"]))
        return dict(run_id=self.run_id, now=now, first=self.first, last=self.last, records=self.records,
                    syncs_recorded=sum(w.syncs for w in self.workers.values()), interval=interval,
                    wait_after=wait_after, workers=rows, syncs=syncs, timeline=timeline)

    def _row(self, w: _Worker, current: str, history: List[dict], now: float, wait_after: float) -> dict:
        latest = w.latest
        since = history[-1]["time"] if history else latest["time"]
        why = history[-1]["why"] if history else ""
        silent = now - latest["time"]
        if current in ("training", "healing") and silent > wait_after:
            current, since = "waiting", latest["time"]
            why = f"no record for {silent:.0f} s (the run syncs every {self.interval() or 0:.1f} s)"
        return dict(worker=w.worker, state=current, since=since, why=why, step=latest["step"],
                    kind=latest["kind"], sync=latest.get("sync"), last_time=latest["time"], silent=silent,
                    committed=latest["committed"], participants=latest.get("participants"),
                    trained=latest.get("trained"), arrival_wait_seconds=latest.get("arrival_wait_seconds"),
                    excluded_workers=[e.get("worker") for e in latest.get("excluded") or ()],
                    residual_ratio=latest.get("residual_ratio"), pseudo_grad_norm=latest.get("pseudo_grad_norm"),
                    syncs=w.syncs, joins=w.joins, not_committed=w.not_committed, heals=w.heals,
                    heal_bytes=w.heal_bytes, excluded=w.excluded, missing_ranks=w.missing_ranks,
                    totals={name: round(value, 6) for name, value in w.totals.items()},
                    history=history)


def _problem(record: dict) -> Optional[str]:
    """What makes ``record`` unreadable here (None: nothing): a field this module reads missing
    or of another type than the schema's."""
    expected = dict(run_id=(str,), worker=(int,), time=(int, float), kind=(str,), committed=(bool,),
                    step=(int, type(None)))
    for name, types in expected.items():
        if name not in record:
            return f"no {name} field"
        if not isinstance(record[name], types) or (name == "worker" and isinstance(record[name], bool)):
            return f"{name} is {record[name]!r}, not {' or '.join(t.__name__ for t in types)}"
    if record["kind"] not in ("sync", "join"):
        return f"kind {record['kind']!r} is neither sync nor join"
    if not isinstance(record.get("events") or [], list):
        return "events is not a list"
    return None


class Status:
    """Every run of the records read (see the module)."""

    def __init__(self):
        self.runs: Dict[str, RunState] = {}
        self.rejected: List[str] = []
        """Records left out: a field missing or of the wrong type (one line each, the first 100)."""

    def add(self, records: Iterable[dict]) -> None:
        for record in records:
            problem = _problem(record)
            if problem:
                if len(self.rejected) < 100:
                    self.rejected.append(f"a record of worker {record.get('worker')!r} left out: {problem}")
                continue
            run_id = str(record["run_id"])
            self.runs.setdefault(run_id, RunState(run_id)).add(record)

    def add_exit(self, run_id: str, worker: int, when: float, code: Optional[int]) -> None:
        """The supervisor's word: worker ``worker``'s job of run ``run_id`` exited."""
        self.runs.setdefault(run_id, RunState(run_id)).add_exit(worker, when, code)

    def newest(self) -> Optional[str]:
        """The run of the latest record (None: no record yet)."""
        runs = [r for r in self.runs.values() if r.last is not None]
        return max(runs, key=lambda r: r.last).run_id if runs else None

    def view(self, now: float, run_id: Optional[str] = None) -> dict:
        """Every run's summary, and the view of ``run_id`` (None or unknown: the newest)."""
        chosen = run_id if run_id in self.runs and self.runs[run_id].last is not None else self.newest()
        runs = sorted((r for r in self.runs.values() if r.last is not None), key=lambda r: r.last, reverse=True)
        return dict(now=now, runs=[dict(run_id=r.run_id, first=r.first, last=r.last, records=r.records,
                                        workers=sorted(r.workers)) for r in runs],
                    run=self.runs[chosen].view(now) if chosen else None, rejected=list(self.rejected))
