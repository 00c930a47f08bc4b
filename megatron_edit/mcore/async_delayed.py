"""The delayed outer step on A-EDiT's time-based schedule (``outer_step_delay`` tau > 0 with
``use_async``; arXiv 2412.07210 Sec. 3.4 with Streaming DiLoCo's overlap, arXiv 2501.18512).

A-EDiT's workers meet only at its syncs, each after its own planned number of steps; a sync is
where the schedule is agreed (one small all-reduce over every rank), so the exchange cannot be
launched before it, as synchronous EDiT does (:mod:`.delayed`). Here:

* **launch at the sync.** After the inner update of the step of this worker's sync s (the
  step-end point, in both sync modes) the schedule is agreed (:meth:`AsyncPlan.plan`: skip,
  final, the next interval), the decisions taken (the norms' all-gather) and the exchange of
  every shard launched with ``Delta_m = anchor - theta_{m, s}``. A two-phase exchange (GTA, the
  quantized exchange) waits for its first phase there and starts its second at once: every
  collective of the sync is issued at the sync, where every worker is, so no worker waits for
  another's later steps. The MoE routers' expert biases are averaged there too.
* **apply tau of its own steps later**, after the inner update of step s + tau, with the merge
  of :mod:`.delayed` (``lerp`` alpha, ``keep_local``). The fast worker applies sooner in wall
  time than the slow one; each waits only for the exchange, launched by all at the sync.
* **the constraint.** The plan gives every worker at least tau + 1 steps to its next sync
  (:func:`~megatron_edit.algorithm.asynchronous.min_interval`; a warning says when a worker's
  speed gave fewer), so an exchange is applied before the next sync launches the next; the
  config keeps tau < ``local_sgd_sync_interval`` (the first interval) as for EDiT.
* **the final sync** is never delayed: it is a blocking sync of every shard (the run ends with
  one model on every worker, nothing in flight), decided at the sync by the plan. Its interval
  may be shorter than tau + 1 (it is the budget's remainder, split by speed): an exchange still
  in flight there is applied first, then the final sync runs.
* **a skipped sync** (``min_total_global_steps``) launches nothing; steps count from the last
  real sync's launch (launch to launch: a worker's planned interval), for the skip and for the
  step weights (:meth:`LocalSGD._on_sync_done` keeps the launch step).

Over the torchft backend a sync is one round from the sync (the quorum, the plan, the launch) to
its apply (the commit, then the merge). A worker that joins or heals does so at a sync, where
every worker has applied its last exchange: it heals from a peer with nothing in flight. A peer
that dies with an exchange in flight leaves the others' round of it with all it needs (every
collective was issued at the sync) or failed (they keep their local progress for the next
sync). The final sync, blocking, is tried again where it does not commit, as without a delay.

The sync's report has the apply step as its step (launched after ``step - delay``), as for EDiT.
A checkpoint while an exchange is in flight is refused (not built for A-EDiT yet).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from .delayed import DelayedOuterStep

logger = logging.getLogger(__name__)


class AsyncDelayedOuterStep(DelayedOuterStep):
    """Launch at each A-EDiT sync and apply tau steps later (see the module)."""

    def __init__(self, controller):
        super().__init__(controller)
        self._held_said = False

    def end_step(self, steps_done: int) -> None:
        """The launch and the apply are both at the step-end point. Over torchft: where the final
        (blocking) sync did not commit, the backend tries it again (``settle_last_sync``: planned
        again among the workers still there)."""
        self.controller.backend.settle_last_sync()

    def after_inner_update(self, step: int) -> None:
        """Inner update of ``step`` done, mains not yet copied into the model: apply the exchange
        due here; at this worker's sync, launch the next (or run the final sync, blocking)."""
        c = self.controller
        if self.in_flight and step == self.apply_at:
            self._apply(step)
        if not c._sync_due(step):
            return
        if self.in_flight:  # (the final interval only: every other is longer than tau)
            self._apply(step)
        started = c.start_sync(step + self.delay, delay=self.delay)  # agreed at ``step``: skip, final, plan
        if started and c.sync.final:  # not delayed (start_sync): one model everywhere at the end
            c.complete_at_step_end()  # Megatron's main -> model copy follows
            return
        if started:
            c.sync.launch(c.sync.members)  # in group order: the forward order
            c.sync.advance()  # a two-phase exchange's second phase, at the sync too
            if c.auto is not None and c.auto.timed:  # auto overlap times this sync: its exchange now
                c.sync.wait_at_launch()
                c.auto.waited()
            self.apply_at = step + self.delay
        if c.expert_biases is not None:  # at the sync, where every worker is (start_sync: not delayed)
            c.expert_biases.average(step)
        self._say_if_held()

    def _say_if_held(self) -> None:
        """Say once (rank 0) that the plan gave a worker tau + 1 steps, more than its speed gave:
        it reaches the next sync later than the others, who wait for it there."""
        plan = self.controller.async_plan
        if plan.held and not self._held_said and dist.get_rank() == 0:
            self._held_said = True
            w = plan.held[0]
            logger.warning(
                "megatron_edit: A-EDiT planned worker %d %d steps to its next sync, more than its speed gives: "
                "with --local-sgd-outer-step-delay %d an interval is at least tau + 1 steps (the exchange is "
                "applied before the next is launched), and the others wait for it there. Lower the delay or "
                "raise --local-sgd-sync-time.", w, plan.last_sync.interval[w], self.delay)

    def _apply(self, step: int) -> None:
        sync = self.controller.sync
        if step != self.apply_at:  # at the final sync, before its planned step: reported where it ran
            sync.applied_after(step)
        sync.complete(sync.members, write_model=False, merge_alpha=self.alpha)
        self.apply_at = None

    def checkpoint_state(self):
        if self.in_flight:
            raise RuntimeError(
                "megatron_edit: a checkpoint while an A-EDiT delayed exchange is in flight (applied after step "
                f"{self.apply_at}) is not supported yet; save at another step (after the apply, or at the final "
                "sync), or drop --local-sgd-outer-step-delay.")
        return None


def delayed_outer_step(controller):
    """The delayed outer step of ``controller`` (None without a delay): on A-EDiT's schedule or
    on EDiT's grid."""
    config = controller.config
    if not config.outer_step_delay:
        return None
    return (AsyncDelayedOuterStep if config.use_async else DelayedOuterStep)(controller)
