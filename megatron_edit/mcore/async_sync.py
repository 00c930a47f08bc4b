"""A-EDiT's part of a sync of one controller (arXiv 2412.07210 Sec. 3.4), with streaming
fragments (Streaming DiLoCo, arXiv 2501.18512): what
:meth:`~megatron_edit.mcore.controller.LocalSGD.start_sync` asks of the time-based schedule.

* **The schedule** (:func:`begin`): at each sync it is agreed (:meth:`AsyncPlan.plan`: one small
  all-reduce over every rank gives every worker's figures, skip, final and the next interval,
  identical everywhere). A delayed sync (``outer_step_delay``, :mod:`.async_delayed`) is agreed at
  its launch; one that is final or skipped is not delayed (the final sync ends the run with one
  model, a skipped one launches nothing). Steps count from the last real sync's launch (launch
  to launch).
* **Fragments** (``fragments`` F > 1, :class:`AsyncFragments`). Every worker takes part in every
  A-EDiT sync, so the fragments go round-robin over the syncs that exchange: the k-th real sync
  (k = 1, 2, ...) exchanges fragment k mod F
  (:func:`~megatron_edit.algorithm.fragments.fragment_of_sync`, EDiT's order counted in syncs:
  fragment 1 first, fragment 0 at the F-th), the same on every rank because the skip is agreed.
  A skipped sync moves no fragment on (the fragment due goes at the next real sync, none is
  starved). The plan's intervals are ``local_sgd_sync_time / F`` seconds (the first
  ``local_sgd_sync_interval / F`` steps; ``LocalSGDConfig.async_sync_time``), so each fragment is
  synced every ``local_sgd_sync_time``, as Streaming DiLoCo syncs each fragment every H steps and
  one every H/F. Each fragment's pseudo-gradient is taken against its own anchor (its shards',
  stepped only at its syncs); its step weights count every worker's steps since that fragment's
  last real sync (launch to launch), from every worker's step counts in the agreed schedule, so
  every rank has the same numbers with no collective of its own. The final sync exchanges every
  fragment (the run ends with one model); its step weights are per layer, each layer's
  fragment's (a layer cut by a fragment boundary is one layer per fragment,
  :func:`~.fragments.split_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..algorithm import fragments as math_fragments


@dataclass
class AsyncStart:
    """What the agreed schedule says of the sync begun (:func:`begin`)."""

    step: int
    """The step after which the sync is applied (the launch's when it is not delayed)."""
    delay: int
    """Steps between the launch and the apply (0: not delayed)."""
    schedule: object
    """Every worker's figures, as the all-reduce gave them (:class:`~megatron_edit.algorithm.asynchronous.Schedule`)."""
    skip: bool
    final: bool
    steps_since: int
    """This worker's steps since the last sync of what it exchanges (launch to launch)."""
    worker_steps: torch.Tensor
    """Every worker's steps since the last sync of what it exchanges ([W]; the final sync with
    fragments: [W, layers]): the step weights."""
    fragment: Optional[int] = None
    members: Optional[list] = None
    """The shards exchanged (None: every shard, no fragments)."""

    @property
    def where(self) -> tuple:
        """(step, delay, steps_since, fragment, members)."""
        return self.step, self.delay, self.steps_since, self.fragment, self.members

    @property
    def sync_args(self) -> dict:
        """A-EDiT's arguments of :meth:`OuterSync.start`."""
        s = self.schedule
        return dict(worker_steps=self.worker_steps, worker_seconds=s.interval_seconds, skip=self.skip,
                    worker_idle=s.idle, final=self.final)


class AsyncFragments:
    """Which fragment each A-EDiT sync exchanges, and every worker's step count at each
    fragment's last real sync, by worker id (see the module docstring)."""

    def __init__(self):
        self.exchanges = 0
        """Real syncs of single fragments since the anchor was taken (the round-robin's count)."""
        self.last: Optional[List[Dict[int, int]]] = None
        """Per fragment, each worker's step count (by worker id: the torchft backend's replica id,
        else its place) at the fragment's last real sync's launch; None: every fragment at the
        last real sync of any (after the anchor is taken, or an elastic resume)."""
        self._before: Optional[dict] = None
        """The counts before the latest :meth:`at_sync` (:meth:`settled` goes back to them)."""

    def restart(self) -> None:
        """The anchor was taken: every fragment starts here."""
        self.exchanges, self.last = 0, None

    def at_sync(self, shards, layers: int, schedule, skip: bool, final: bool, ids: Optional[List[int]] = None):
        """(fragment, members, every worker's steps) of the sync whose agreed schedule is
        ``schedule``; ``shards``: the controller's :class:`~.fragments.SyncShards`, ``layers``:
        its number of layers; ``ids``: the worker ids of the schedule's entries (the torchft
        backend's quorum; default: 0 .. W-1). Counts the sync when it exchanges.

        A worker that brings no steps (``steps_since_exchange`` 0: over torchft it joins, or heals
        from a peer, and holds the anchor) weighs 0 in every fragment, whose count then starts at
        its step; one the counts do not know (it was not in the fragment's last sync) counts from
        its own last exchange."""
        count = len(shards.fragments)
        self._before = None
        if count == 1 or skip:
            return None, None, schedule.steps_since_exchange
        self._before = self.state_dict()
        steps = [int(n) for n in schedule.steps]
        ids = list(range(len(steps))) if ids is None else [int(w) for w in ids]
        since_any = [int(k) for k in schedule.steps_since_exchange]
        if self.last is None or len(self.last) != count:
            self.last = [{} for _ in range(count)]
        for w, n, k in zip(ids, steps, since_any):
            for last in self.last:
                if k == 0 or w not in last:  # (the joiner's and healer's parameters are the anchor)
                    last[w] = n - k
        since = torch.tensor([[n - last[w] for w, n in zip(ids, steps)] for last in self.last], dtype=torch.float64)
        if final:  # every fragment: each layer weighs its own fragment's steps
            of_layer = torch.zeros(layers, dtype=torch.int64)
            for f, fragment in enumerate(shards.fragments):
                for shard in fragment:
                    of_layer[list(shard.bucket_layers)] = f
            self.last = [dict(zip(ids, steps)) for _ in range(count)]
            return None, shards.all, since[of_layer].T.contiguous()
        self.exchanges += 1
        f = math_fragments.fragment_of_sync(self.exchanges, count)
        self.last[f] = dict(zip(ids, steps))
        for last in self.last:  # (a worker gone from the sync is counted again if it comes back)
            for w in [w for w in last if w not in ids]:
                del last[w]
        return f, shards.fragments[f], since[f]

    def settled(self, committed: bool) -> None:
        """The latest sync ended; where it did not commit (torchft: its round failed on this
        worker) the counts go back to before it, as the workers keep their progress for the next
        sync (the same fragment is then due again, its steps counted from its last committed sync)."""
        if self._before is not None and not committed:
            self.load_state_dict(self._before)
        self._before = None

    def state_dict(self) -> dict:
        return {"exchanges": self.exchanges, "last": None if self.last is None else [dict(x) for x in self.last]}

    def load_state_dict(self, state: dict, workers: Optional[int] = None) -> None:
        """Restore :meth:`state_dict`; ``workers``: this run's number of workers where they are
        0 .. W-1 (the torch backend; None: by replica id, torchft). Saved with other workers (an
        elastic resume, where every worker restarts its interval), every fragment counts from the
        resume."""
        self.exchanges = int(state["exchanges"])
        last = state["last"]
        last = None if last is None else [{int(w): int(n) for w, n in x.items()} for x in last]
        if last is not None and workers is not None and any(set(x) != set(range(workers)) for x in last):
            last = None
        self.last = last


def begin(controller, step: int, delay: int, arrived: Optional[float]) -> AsyncStart:
    """Agree on the schedule at the sync after ``step`` (launched ``delay`` steps before its
    apply) and say what it exchanges; ``arrived``: the clock when this worker reached the sync."""
    c = controller
    device = c.shards[0].device if c.shards else torch.device("cpu")
    # torchft: the learning-rate schedule's position after this step (step-end: its own step's
    # progress is counted after the sync)
    progress = (c.global_progress + (c.last_step_progress if c.in_step else 0.0)
                if c.backend.dynamic else None)
    launch = step - delay
    schedule, skip, final = c.async_plan.plan(launch, c.last_sync_step, device, arrived, progress=progress)
    if delay and (final or skip):  # not delayed: the final one ends the run with one model
        step, delay = launch, 0
    fragment, members, worker_steps = exchanged(c, schedule, skip, final)
    me = c.sync_group.rank
    steps_since = launch - c.last_sync_step if fragment is None else int(worker_steps[me])
    return AsyncStart(step, delay, schedule, skip, final, steps_since, worker_steps, fragment, members)


def exchanged(c, schedule, skip: bool, final: bool):
    """(fragment, members, every worker's steps) of controller ``c``'s sync whose agreed schedule
    is ``schedule`` (:meth:`AsyncFragments.at_sync`, by the sync's worker ids)."""
    return c.async_fragments.at_sync(c.sync_shards, len(c.layer_names), schedule, skip, final,
                                     c.async_plan.last_sync.replica_ids)
