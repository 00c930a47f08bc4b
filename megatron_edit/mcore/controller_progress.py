"""Where a :class:`~megatron_edit.mcore.controller.LocalSGD` stands in the run: its length
(EDiT's last step, A-EDiT's budget of worker-steps and its final sync), A-EDiT's clock, and its
global progress (the synchronous iterations the learning-rate schedule follows, and what a heal
moves it by). A part of the controller (it inherits this class; it uses the controller's fields),
kept apart from the state machine of the steps and syncs.
"""

from __future__ import annotations

from typing import Optional

from .async_plan import SyncPoint


class RunProgress:
    """The run's length and this worker's progress in it (mixed into :class:`LocalSGD`)."""

    @property
    def clock(self):
        """A-EDiT's float64 clock (seconds); injectable for tests."""
        return self.async_plan.clock

    @clock.setter
    def clock(self, clock) -> None:
        self.async_plan.clock = clock

    @property
    def budget_steps(self) -> Optional[int]:
        """A-EDiT's budget: worker-steps of the whole run (Megatron-LM: --train-iters x workers,
        what the synchronous run consumes); the run ends at a final sync planned from the
        workers' speeds, each worker at its own step count (:attr:`finished`)."""
        return self.async_plan.budget_steps

    @budget_steps.setter
    def budget_steps(self, steps: Optional[int]) -> None:
        self.async_plan.budget_steps = steps

    def set_train_iters(self, train_iters: int) -> None:
        """Say how long the run is: ``train_iters`` optimizer steps in all, counted from the
        start of training (a resumed run: the same total, not the steps left). EDiT ends the run
        with a sync of every shard after that step, on or off the warmup + k H grid, so every
        worker ends with the same model and no delayed exchange is left in flight; A-EDiT's
        budget becomes ``train_iters`` x workers worker-steps (:attr:`budget_steps`).
        Megatron-LM sets it from ``--train-iters`` / ``--train-samples``; with megatron-core
        alone call it (or :func:`megatron_edit.set_train_iters`) before training. Without it the
        run may end between syncs, each worker with its own model."""
        if isinstance(train_iters, bool) or not isinstance(train_iters, int) or train_iters < 1:
            raise ValueError(f"megatron_edit: set_train_iters needs a number of optimizer steps >= 1 "
                             f"(got {train_iters!r}).")
        if self.config.use_async:
            self.budget_steps = train_iters * self.budget_workers
            return
        if train_iters < self.steps_done:
            raise ValueError(
                f"megatron_edit: set_train_iters({train_iters}): this run has taken {self.steps_done} "
                "optimizer steps already; give the whole run's length (a resumed run counts the steps "
                "before the checkpoint too).")
        self.last_step = train_iters

    @property
    def budget_workers(self) -> int:
        """A-EDiT: the workers whose steps the budget and global progress count: the run's over
        the torchft backend (each job is one worker; the supervisor's count, or what a heal
        brought), else this world's."""
        return self.backend.budget_workers(self)

    @property
    def finished(self) -> bool:
        """A-EDiT: the run has used its budget and ended with its final sync."""
        return self.async_plan.finished

    @property
    def last_sync(self) -> Optional[SyncPoint]:
        """A-EDiT: the latest sync as every worker saw it."""
        return self.async_plan.last_sync

    def restart_async_schedule(self) -> None:
        """A-EDiT: plan the next sync as after warmup (first interval from ``steps_done``); every
        fragment starts here."""
        if self.config.use_async:
            self.async_plan.plan_first(self.steps_done, self.global_progress)
            self.async_fragments.restart()

    @property
    def progress_scale(self) -> float:
        """Synchronous steps of global progress per optimizer step of this worker: 1 for EDiT;
        with A-EDiT, N / (W n) in an interval where this worker takes n of the workers' N steps.
        The learning-rate schedule advances by this much per step
        (``mcore.core_wraps``: ``OptimizerParamScheduler.step``), so all workers' schedules agree
        at every sync and end together."""
        return self.async_plan.progress_scale if self.grads_are_local else 1.0

    def move_progress(self, progress: float) -> None:
        """A heal puts this worker at ``progress`` (the peer's global progress): the learning-rate
        schedule follows at its next step (:attr:`progress_jump`)."""
        self.progress_jump += float(progress) - self.global_progress
        self.global_progress = float(progress)

    def take_progress_jump(self) -> float:
        """What a heal moved global progress by since the learning-rate schedule's last step
        (then 0): ``mcore.core_wraps``' ``OptimizerParamScheduler.step`` adds it."""
        jump, self.progress_jump = self.progress_jump, 0.0
        return jump

    @property
    def last_step_progress(self) -> float:
        """Global progress (synchronous steps) of the optimizer step last taken: what the
        learning-rate schedule advances by for it (the sync a step triggers plans the next
        interval; the step itself still belongs to its own)."""
        return self._step_progress

    def _snap_progress(self) -> None:
        """At an A-EDiT sync every worker's global progress is worker-steps / workers: set it
        exactly (no float drift between workers). Over torchft the next interval's steps bring
        it there instead (:meth:`AsyncPlan.plan`: a lost worker's steps were counted)."""
        if self.at_sync and not self.backend.dynamic:
            self.global_progress = self.last_sync.global_progress

    @property
    def at_sync(self) -> bool:
        """A-EDiT: this worker has just taken the step of its latest sync (nothing trained since):
        every worker is at the same logical point, the only one they share between syncs."""
        return (
            self.last_sync is not None and self.last_sync.step == self.steps_done and not self._in_step
        )
