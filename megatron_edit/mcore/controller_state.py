"""The state of a :class:`~megatron_edit.mcore.controller.LocalSGD` that a checkpoint carries:
its counters, the anomaly detector's statistics and A-EDiT's plan, read through
:meth:`ControllerState.state_dict` and restored through :meth:`ControllerState.load_state_dict` and
the named resume methods (an elastic resume, a resume of a synchronous run), never through the
controller's fields. A part of the controller (it inherits this class), kept apart so that
the state machine of the steps and syncs stays readable.
"""

from __future__ import annotations

import torch

from ..algorithm import asynchronous
from ..algorithm.penalty import EWMAStats
from .sync_backend import STATE_KEY


class ControllerState:
    """Checkpoint state of the controller (mixed into :class:`LocalSGD`; uses its fields)."""

    # The controller owns its state: a checkpoint reads it through state_dict() and restores
    # it through load_state_dict() and the named resume methods below, never its fields.
    COUNTERS = ("steps_done", "last_sync_step", "global_progress")

    @property
    def in_step(self) -> bool:
        """Between :meth:`begin_step` and :meth:`end_step` (no checkpoint can be taken there)."""
        return self._in_step

    @property
    def last_sync_step(self) -> int:
        """This worker's step count at its latest exchange (the warmup's end before the first)."""
        return self._last_sync_step

    @property
    def identical_fragments(self) -> list:
        """The fragments (``LocalSGDConfig.fragments``; 0 alone without) whose shards are
        identical on every worker now: a sync just made them so (after this step, not a delayed
        merge that keeps local progress), or the anchor was just taken. An elastic resume
        restarts those from the anchor and takes the load-time outer step for the others."""
        if self._in_step:
            return []
        return sorted(f for f, step in self._identical_after.items() if step == self.steps_done)

    def mark_identical(self, fragments, only: bool = False) -> None:
        """Fragments made identical on every worker at the present step (the anchor, a load);
        ``only``: and no other (a load says which are)."""
        if only:
            self._identical_after.clear()
        for f in fragments:
            self._identical_after[int(f)] = self.steps_done

    def fragment_slots(self, fragments) -> list:
        """Indices into :attr:`shards` of the shards of ``fragments``."""
        held = {id(s) for f in fragments for s in self.sync_shards.fragments[f]}
        return [i for i, s in enumerate(self.shards) if id(s) in held]

    @property
    def fragment_sizes(self) -> list:
        """Per fragment, the unpadded sizes of its buckets in order (this rank's pipeline stage and
        tensor-parallel slice): which parameters each fragment holds, whatever the number of ranks
        per worker (a checkpoint compares it before restarting fragments from their anchor)."""
        return [[int(getattr(s.bucket, "numel_unpadded", s.numel)) for s in fragment]
                for fragment in self.sync_shards.fragments]

    def state_dict(self) -> dict:
        """Everything of this controller a checkpoint carries, picklable: the counters
        (:data:`COUNTERS`) and :meth:`extra_state`. The anchor and the outer optimizer's state
        are tensors, saved per parameter by the checkpoint (:attr:`outer_state`)."""
        return {"steps_done": self.steps_done, "last_sync_step": self._last_sync_step,
                "global_progress": float(self.global_progress), **self.extra_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` gave: the counters present in ``state``, then the
        rest when present (a checkpoint's run record holds worker 0's counters, its per-slice
        record the rest). A checkpoint taken right after an A-EDiT sync gives every worker its
        own counters and plan."""
        if "steps_done" in state:
            self.steps_done = int(state["steps_done"])
        if "last_sync_step" in state:
            self._last_sync_step = int(state["last_sync_step"])
        if "global_progress" in state:
            self.global_progress = float(state["global_progress"])
        self.progress_jump = 0.0  # the learning-rate schedule is loaded with the checkpoint
        if "layer_names" in state:
            self.load_extra_state(state)

    def extra_state(self) -> dict:
        """The part of :meth:`state_dict` beyond the counters, identical on every rank: the
        anomaly detector's statistics and A-EDiT's plan (:meth:`AsyncPlan.state_dict`)."""
        out = {"layer_names": list(self.layer_names), "ewma": self.sync.decisions.ewma.state_dict(),
               "global_progress": self.global_progress, **self.async_plan.state_dict(self.at_sync)}
        if self.config.use_async and self.config.fragments > 1:  # A-EDiT's fragments (.async_sync)
            out["async_fragments"] = self.async_fragments.state_dict()
        delayed = getattr(self, "delayed", None)
        if delayed is not None and delayed.in_flight:  # a checkpoint mid-flight (DelayedOuterStep)
            out["in_flight_skipped"] = delayed.saved_skipped
        backend = self.backend.state_dict()  # torchft: its Manager's counters, every worker's statistics
        if backend is not None:
            out[STATE_KEY] = backend
        return out

    def load_extra_state(self, state: dict) -> None:
        """Restore :meth:`extra_state` (raises ValueError when it was saved for other layers);
        saved right after an A-EDiT sync, every worker takes its own counters."""
        saved = list(state["layer_names"])
        if saved != self.layer_names:
            differ = sorted(set(saved) ^ set(self.layer_names))
            raise ValueError(
                "EDiT checkpoint state was saved for different layers "
                f"({len(saved)} saved, {len(self.layer_names)} now; differing: {differ[:4]}"
                f"{' ...' if len(differ) > 4 else ''}): the model, its pipeline split or "
                "--local-sgd-fragments (a layer cut by a fragment boundary is one layer per "
                "fragment, <layer>@fragment<f>) differs from the saved run's."
            )
        self.sync.decisions.ewma = EWMAStats.from_state_dict(state["ewma"])
        if STATE_KEY in state:  # (torchft from a torch-backend checkpoint: the loader restarts it)
            self.backend.load_state_dict(state[STATE_KEY])
        self.global_progress = float(state.get("global_progress", self.steps_done))
        point = self.async_plan.load_state_dict(state, self.steps_done)
        if "async_fragments" in state:
            self.async_fragments.load_state_dict(state["async_fragments"],
                                                 None if self.backend.dynamic else self.num_workers)
        if point is not None:
            self.steps_done = point.step
            self._last_sync_step = point.last_exchange[self.async_plan.place(point)]
            self.global_progress = point.global_progress

    @torch.no_grad()
    def heal_anchor(self, anchors, outer: dict) -> None:
        """A heal (the torchft backend): a peer's anchors (each shard's, checked to fit) and its
        outer optimizer's state; the main and model parameters restart from the anchor, with no
        error-feedback residual."""
        for shard, anchor in zip(self.shards, anchors):
            shard.anchor.copy_(anchor)
            shard.write_mains(shard.anchor)
            shard.write_model(shard.anchor)
            shard.residual = None
            shard.chunk_residual = None
        self.outer_state.optimizer.load_state_dict(outer)

    def heal_to(self, step: int, last_sync_step: int, global_progress: float, last_step=None, plan=None,
                budget_steps=None, fragments=None) -> None:
        """A heal (the torchft backend): this worker takes a peer's point in the run, one peer's for
        the whole worker: its step count where it is in the sync, its last sync's step and its
        global progress (the learning-rate schedule follows at the next step); the run's length
        and A-EDiT's budget until the run tells them; A-EDiT's plan (the run's workers, the
        budget used, the speeds) and its fragments' counts (the round-robin's, every worker's
        steps at each fragment's last sync, by worker id)."""
        self.steps_done = int(step)
        self.move_progress(global_progress)
        if plan is not None:
            self.async_plan.load_dynamic_state(plan)
        if fragments is not None:
            self.async_fragments.load_state_dict(fragments)
        self._last_sync_step = int(last_sync_step)
        if self.last_step is None and last_step is not None:
            self.last_step = int(last_step)
        if self.config.use_async and self.async_plan.budget_steps is None and budget_steps is not None:
            # A fresh job joins (and plans its first interval with the others) while its optimizer
            # is built, before Megatron-LM tells it the run's length: planned without the budget
            # it would overrun it.
            self.async_plan.budget_steps = int(budget_steps)

    def keep_place_in_sync(self, steps_done: int) -> None:
        """EDiT's grid over torchft: a worker that healed into the others' sync goes on with the
        sync it began, at its place in it (``steps_done``: the others' sync step less the steps
        its own flow stands before it; the peer's count differs where its delay does, a heal's
        delay goes in force after this sync: :mod:`.auto_overlap_ft`), its progress with it."""
        shift = int(steps_done) - self.steps_done
        self.steps_done = int(steps_done)
        self.move_progress(self.global_progress + shift)

    def enter_healed_sync(self, step: int) -> None:
        """The join round healed this worker into the others' sync after ``step``: it applies that
        sync now, so it is at that step (and its progress)."""
        self.steps_done = int(step)
        self.move_progress(float(step))

    def resume_elastic(self) -> None:
        """After :meth:`load_state_dict` of another layout's counters (worker 0's), with an
        anchor: A-EDiT's new workers share the worker-steps done (global progress x workers,
        as even as possible), so that the budget left is the saved run's; every worker restarts
        its interval here (and, with fragments, every fragment's step count)."""
        if self.config.use_async:
            done = round(self.global_progress * self.num_workers)
            self.steps_done = int(asynchronous.share_steps(done, self.num_workers)[self.sync_group.rank])
            self.async_fragments.last = None
        self._last_sync_step = self.steps_done

    def resume_from_synchronous(self, steps: int) -> None:
        """Continue a synchronous run after ``steps`` optimizer steps: past warmup the anchor
        is taken from the loaded parameters now (the exchange restarts here), else warmup goes
        on; no error-feedback residual carries over."""
        self.steps_done = steps
        self.global_progress = float(steps)  # synchronous steps: one iteration each
        for shard in self.shards:
            shard.residual = shard.chunk_residual = None
        if steps >= self.config.local_sgd_warmup_steps:
            self.capture_anchor()
            self._last_sync_step = steps
        else:
            self.drop_anchor()
            self._last_sync_step = self.config.local_sgd_warmup_steps
