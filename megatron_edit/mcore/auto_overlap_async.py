"""Settings from the measured link on A-EDiT's time-based schedule (``auto_overlap`` with
``use_async``; arXiv 2412.07210 Sec. 3.4 with Streaming DiLoCo's overlap, arXiv 2501.18512): the
delay tau and the exchange format chosen while the job runs, for one
:class:`~megatron_edit.mcore.controller.LocalSGD`. The measuring and the rule are
:mod:`.auto_overlap`'s; what differs on A-EDiT's schedule:

* **H and the inner step.** A-EDiT's workers take different numbers of steps per interval. The
  exchange launched at a sync must be hidden behind tau steps of *every* worker, so the step
  time is the fastest worker's (each rank measures its own median since the last sync, the MAX
  of the negated times agrees on the smallest, as for EDiT). H is the fewest steps the plan just
  agreed gives any worker to its next sync (the slowest worker's interval,
  ``SyncPoint.interval``, identical on every rank): with tau <= H/2 (the rule's cap) every
  worker's interval holds tau + 1 steps
  (:func:`~megatron_edit.algorithm.asynchronous.min_interval`) at the speeds measured, so no
  worker is held back for the delay and no one waits for it at the next sync. (The plan's
  interval seconds over the fastest step would count the fast worker's steps, more than the
  slow one takes: a delay from it could hold the slow one; ``--local-sgd-sync-interval`` is
  only the first interval.) A worker the plan already holds at
  tau + 1 steps makes H = tau + 1, and the rule lowers the delay.
* **The agreement rides on the schedule's all-reduce.** At each sync every rank appends its
  measurement of the previous real sync's exchange (:meth:`AsyncAutoOverlap.message`) to
  A-EDiT's schedule message, which is all-reduced with MAX over every rank of every worker
  anyway (:meth:`~megatron_edit.mcore.async_plan.AsyncPlan.plan`); no collective of its own. A
  sync is the one point where every worker is at the same logical time; an all-reduce started
  at the end of a worker's own step (EDiT's) would make a fast worker, after its apply, wait for
  the slow one's apply tau of its slower steps later.
* **When a decision is in force.** The decision is taken at the sync where the measurement is
  agreed, after the plan (every rank the same), and put in force once that sync's exchange is
  applied, at the next optimizer step with nothing in flight (:meth:`AsyncAutoOverlap.after_sync`),
  so the sync after it launches with the new delay and format, and its interval is planned
  with the new tau + 1 (the exchange launched at the sync itself keeps the settings it was
  launched with: its interval was planned for them). A measured sync's settings thus change
  two syncs later. Every worker applies its exchange before the next sync (every interval but
  the last is at least tau + 1 steps), so every worker has the new settings there. A
  checkpoint at the deciding sync puts the decision in force first (:meth:`AsyncAutoOverlap.before_save`).
* **The final sync** is never delayed (as without ``auto_overlap``), and nothing is decided at
  a sync whose next sync is the final one (its interval may be shorter than tau + 1: a worker
  could still have an exchange in flight at it), nor at the final sync.
* **Timed syncs** are :mod:`.auto_overlap`'s: without a delay a timed sync blocks; with one its
  exchange is waited for right after the launch at the sync (:mod:`.async_delayed`).
* **Fragments** (:mod:`.async_sync`: one fragment per sync, a sync every
  ``local_sgd_sync_time / F`` seconds). H is a fragment's interval, F syncs: the slowest
  worker's planned interval times the F in force, rounded down to a multiple of every F allowed
  (``auto_fragments``; the rule needs F to divide H), so the rule's tau < H/F' is at most the
  interval each worker is planned with F' (tau + 1 steps). A change of F is put in force as the
  delay is; the next sync is planned with the new F (``local_sgd_sync_time / F'``), the
  round-robin goes on (fragment k mod F', k counting the real syncs of one fragment: from one
  fragment, as a run started with F'), and the new fragments' step weights count from the last
  real sync of any fragment.
"""

from __future__ import annotations

import math

import torch

from ..algorithm import overlap_plan
from ..config import LocalSGDConfig
from .auto_overlap import AutoOverlap
from .auto_overlap_ft import RoundAutoOverlap, RoundDecisions


class AsyncAutoOverlap(RoundDecisions):
    """:class:`AutoOverlap` on A-EDiT's schedule (see the module docstring)."""

    def __init__(self, controller, user_config: LocalSGDConfig):
        # Over torchft a decision is kept only where its round commits and is in force after the
        # next round (RoundRule); on the torch backend at once, once nothing is in flight.
        super().__init__(controller, user_config, confirm=user_config.sync_backend == "torchft")

    def agreed(self, numbers: torch.Tensor, point) -> None:
        """After the schedule's all-reduce at the sync ``point`` (its next interval planned):
        the agreed measurement; count it, or decide (in force from the next sync on)."""
        report, self._report, self._step_times = self._report, None, []
        if report is None or point.final or self.controller.async_plan.final_planned:
            return  # nothing measured, or the next (final) sync is never delayed
        if self.pending is not None and self.rounds.waiting:
            return  # (torchft) the decision of the last sync is in force after this one: none now
        assert self.pending is None, "auto overlap: a decision not yet in force at the next sync"
        self._judge(report.step, bool(report.delay), overlap_plan.agreed(numbers.tolist(), self.formats))

    def _interval(self) -> int:
        """H of the rule: the fewest steps the plan gives any worker to its next sync, times the
        fragments in force (a fragment is synced every F syncs), rounded down to a multiple of
        every number of fragments allowed (see the module)."""
        c = self.controller
        h = min(c.async_plan.last_sync.interval) * c.config.fragments
        grid = math.lcm(*self.fragments)
        return max(grid, h - h % grid)

    def before_save(self) -> None:
        """A checkpoint at the sync that decided (Megatron-LM saves after the step, at a sync):
        the decision is put in force now, as it would be at the next optimizer step (nothing
        between reads the settings), so the checkpoint's settings are the ones in force from
        the next step and a resume continues with them. (Kept pending it would be in no
        checkpoint: the resume measured from scratch.) With an exchange in flight it stays
        pending (an A-EDiT save there is refused)."""
        self.after_sync()


def auto_overlap_for(controller, user_config: LocalSGDConfig) -> AutoOverlap:
    """``auto_overlap``'s object for ``controller``: on A-EDiT's schedule, or on EDiT's grid (over
    torchft: agreed on the rounds, :class:`~megatron_edit.mcore.auto_overlap_ft.RoundAutoOverlap`)."""
    if user_config.use_async:
        return AsyncAutoOverlap(controller, user_config)
    return (RoundAutoOverlap if user_config.sync_backend == "torchft" else AutoOverlap)(controller, user_config)
