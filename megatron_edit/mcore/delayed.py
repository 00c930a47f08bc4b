"""The delayed outer step (``LocalSGDConfig.outer_step_delay`` tau > 0): when a sync's exchange
is launched and when it is applied, for one :class:`~megatron_edit.mcore.controller.LocalSGD`.

The sync steps stay where they are without a delay: s = W + kH (torchft's schedule: the launch
moves, not the apply). After the optimizer step of s - tau (``end_step``) the decisions are
taken (the per-layer norms' all-gather, blocking, as for every sync) and the exchange of every
shard is launched, in the forward order, with the pseudo-gradient ``anchor - theta_{s-tau}``;
training goes on. After the inner update of step s (``after_inner_update``, before Megatron
copies the main params into the model, in both sync modes) the exchange is completed, the outer
step applied to the anchor and the mains merged with the new anchor::

    anchor', u' = OuterOpt(anchor, u; reduce(anchor - theta_{m, s-tau}))
    theta_m    <- alpha * theta_{m, s} + (1 - alpha) * anchor'     (alpha = 0: theta_m <- anchor')

The run's last step (``LocalSGD.last_step``) is never the apply of a delayed exchange: no
exchange is launched whose apply would be at or after it, and the last sync is the blocking one
of tau = 0 there, so every worker ends with the same model and nothing is left in flight.

Between launch and apply the :class:`~megatron_edit.exchange.in_flight.SyncInProgress` owns
every tensor the collectives read or write (each shard's Delta, the reducers' flights and
their stage buffers); nothing else holds or frees them until :meth:`OuterSync.complete` waits
for them. A two-phase exchange (GTA, the quantized exchange) starts its second phase one step
after the launch (a blocking wait for the first, small one), so with tau >= 2 both run behind
inner steps. A checkpoint in that window waits for the exchange and saves its result (and, for
the ``keep_local`` merge, the launch's parameters) for the apply (:meth:`checkpoint_state`,
:meth:`resume`; ``mcore.checkpoint``): the resumed run applies it at the same step.
"""

from __future__ import annotations

from typing import Optional


class DelayedOuterStep:
    """Launch and apply of the delayed syncs of one controller (tau = ``outer_step_delay``)."""

    def __init__(self, controller):
        self.controller = controller
        c = controller.config
        self.delay = c.outer_step_delay
        self.alpha = 0.0 if c.outer_merge_rule == "keep_local" else c.merge_alpha
        self.apply_at: Optional[int] = None
        """The step after whose inner update the exchange in flight is applied (None: none)."""
        self.saved_skipped: Optional[list] = None
        """A checkpoint mid-flight: the exchange's skipped layers, for the slice record."""

    @property
    def in_flight(self) -> bool:
        return self.apply_at is not None

    def _is_last(self, step: int) -> bool:
        c = self.controller
        return step == c.last_step and step > c.config.local_sgd_warmup_steps

    def end_step(self, steps_done: int) -> None:
        """After the optimizer step ``steps_done``: launch the exchange of the sync due after
        step ``steps_done + tau`` (unless that is the run's last step or later)."""
        c, target = self.controller, steps_done + self.delay
        if self.in_flight and steps_done == self.apply_at - self.delay + 1:
            c.sync.advance()  # one step after the launch: a two-phase exchange starts its second
        fragment = c.sync_shards.fragment_due(target)
        if self.in_flight or fragment is None:
            return
        if c.last_step is not None and target >= c.last_step:
            return  # the run's last sync is blocking: nothing may be left in flight at the end
        c.start_sync(target, c.sync_shards.due(target, None), delay=self.delay)
        c.sync.launch(c.sync.members)  # in group order: the forward order
        if c.auto is not None and c.auto.timed:  # auto overlap times this sync: its exchange now
            c.sync.wait_at_launch()
            c.auto.waited()
        self.apply_at = c.steps_done + self.delay  # target (a torchft worker that healed: the others')

    def after_inner_update(self, step: int) -> None:
        """Inner update of ``step`` done, mains not yet copied into the model: apply the
        exchange due here; at the run's last step, a blocking sync of every shard."""
        c = self.controller
        if self.in_flight and (step == self.apply_at or self._is_last(step)):
            c.sync.complete(c.sync.members, write_model=False, merge_alpha=self.alpha)
            self.apply_at = None
            if c.expert_biases is not None and not self._is_last(step):  # (the last: its own sync)
                c.expert_biases.average(step)
        if self._is_last(step) and c.start_sync(step):
            c.complete_at_step_end()  # Megatron's main -> model copy follows

    def checkpoint_state(self):
        """For a checkpoint while an exchange is in flight: ``(meta, per shard (reduced Delta,
        launch params))`` in the controller's shard order (see :meth:`OuterSync.finish_in_flight`);
        None when nothing is in flight."""
        if not self.in_flight:
            return None
        c = self.controller
        meta, by_shard = c.sync.finish_in_flight()
        meta["apply_at"] = self.apply_at
        # Layers every worker was excluded from: this optimizer's own (each pipeline stage has its
        # layers), so they go with its slice record (ControllerState.extra_state), not the run's.
        self.saved_skipped = meta.pop("skipped")
        return meta, [by_shard.get(id(s), (None, None)) for s in c.shards]

    def members(self, meta: dict) -> list:
        """Indices (into the controller's shards) of what the saved exchange holds on this rank:
        its fragment's shards (this rank's fragments: each pipeline stage has its own), or all."""
        c = self.controller
        fragment = meta["fragment"]
        shards = c.sync_shards.all if fragment is None else c.sync_shards.fragments[fragment]
        ids = {id(s) for s in shards}
        return [i for i, s in enumerate(c.shards) if id(s) in ids]

    def resume(self, meta: dict, deltas, launch, skipped=None) -> None:
        """Restore a checkpoint's exchange in flight (``deltas`` / ``launch``: per shard of the
        controller, None for shards not in it; ``skipped``: this optimizer's layers every worker
        was excluded from, from its slice record): applied after step ``meta["apply_at"]``."""
        c = self.controller
        members = self.members(meta)
        meta = dict(meta, skipped=skipped)
        self.saved_skipped = skipped  # as the run that saved it holds it (its extra_state)
        c.sync.resume_in_flight(meta, [c.shards[i] for i in members], [deltas[i] for i in members],
                                [launch[i] for i in members])
        self.apply_at = meta["apply_at"]
