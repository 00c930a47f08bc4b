"""The automatic overlap over the torchft backend (``auto_overlap`` with ``sync_backend ==
"torchft"``; arXiv 2412.07210's A-EDiT with Streaming DiLoCo's overlap, arXiv 2501.18512): the
workers of a sync are its quorum, and they change between syncs.

* **The agreement rides on the round.** The measurements ride on a collective the round makes
  anyway: A-EDiT's schedule message (:meth:`~megatron_edit.mcore.async_plan.AsyncPlan.plan`: a
  MAX over the worker's ranks, an all-gather across the quorum, a MAX again); no collective of
  its own, none between syncs (a worker that joins or heals meets the others only at a round).
* **A decision is kept where its round commits, and is in force after the next round**
  (:class:`RoundRule`). A round that fails on one worker and not on another (a peer died inside
  it) may give them different agreed numbers: the worker that did not commit drops the decision
  and is behind the others at the next round, where it heals and receives the decision (not yet
  in force) with the rest of the state; the settings in force are the same on every worker of
  every round, so a heal never changes them under a sync in progress. The price: a decision is
  in force one sync later than on the torch backend.
* **A worker that joins or heals takes the settings in force** from its heal
  (:func:`heal_state` / :func:`load_heal_state`, in the controller's heal state): the delay, the
  format and the number of fragments, and the rule's own state (what is measured next, the
  decision waiting), so that every worker takes the same decisions from then on. A relaunched
  worker starts with the run's settings and takes the others' at its join. Its error-feedback
  residuals restart at zero, as any healed worker's (the format change before that folds nothing
  that is kept). A round a worker joins or heals in measures nothing (its rank sends no inner
  step: the agreed step is 0 on every worker, so none decides).

The double fault: a worker that misses the decision's round and whose heal at the next round is
a *partial* one (a rank's transfer failed: it loads nothing and heals again at the round after)
heals when its peers have the decision in force, in a sync it began with its old delay. On EDiT's
grid it goes on with that sync as it began it (``LocalSGD.keep_place_in_sync``: at its own step,
not the peer's, which a delay puts earlier), in the format and fragments of the heal, completes it
at once and takes the heal's delay once it is applied (:attr:`RoundDecisions.delay_after_heal`):
the next sync it launches with the others. (A-EDiT's healer takes the heal's delay at once.)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..algorithm import overlap_plan
from ..algorithm.overlap_plan import Choice, Measurement
from ..config import LocalSGDConfig
from .auto_overlap import AutoOverlap


class RoundRule:
    """When a decision is in force: at once (the torch backend: every round commits, the same
    workers at every sync), or over torchft once its round committed here and the next round has
    ended (see the module)."""

    def __init__(self, confirm: bool):
        self.confirm = confirm
        self.stage: Optional[str] = None
        """None (no decision waiting), ``agreed`` (its round in progress), ``kept`` (its round
        committed here; in force after the next) or ``due`` (in force now)."""

    def decided(self) -> None:
        self.stage = "agreed" if self.confirm else "due"

    def round_ended(self, committed: bool) -> bool:
        """A round's end (its report): False where the decision waiting is dropped (its own round
        did not commit here)."""
        if self.stage == "agreed":
            if not committed:
                self.stage = None
                return False
            self.stage = "kept"
        elif self.stage == "kept":
            self.stage = "due"
        return True

    @property
    def due(self) -> bool:
        return self.stage == "due"

    @property
    def waiting(self) -> bool:
        """A decision waits for its round or the next (no other is taken meanwhile)."""
        return self.stage in ("agreed", "kept")

    def reset(self) -> None:
        self.stage = None


class RoundDecisions(AutoOverlap):
    """A decision that waits in :attr:`pending` for :class:`RoundRule` and for nothing in
    flight, then is put in force (:meth:`after_sync`); the measurements agreed at a sync's
    collective (:meth:`message`). A-EDiT's (:class:`~megatron_edit.mcore.auto_overlap_async.AsyncAutoOverlap`,
    ``confirm`` over torchft only) and EDiT's grid over torchft (:class:`RoundAutoOverlap`)."""

    def __init__(self, controller, user_config: LocalSGDConfig, confirm: bool = True):
        super().__init__(controller, user_config)
        self.pending: Optional[Choice] = None
        """A decision taken at a sync, not yet in force."""
        self.rounds = RoundRule(confirm)
        """When :attr:`pending` is in force (over torchft: kept where its round commits, after the next)."""
        self.delay_after_heal: Optional[int] = None
        """EDiT's grid: the delay in force on the peer this worker healed from in the sync it had
        begun with another (:func:`load_heal_state`), in force once that sync is applied."""

    @property
    def completes_now(self) -> bool:
        return self.timed or self.delay_after_heal is not None

    def step_ended(self) -> None:
        self._time_step()  # (the agreement is at the next sync: message / agreed)

    def message(self) -> torch.Tensor:
        """This rank's numbers for the collective of MAX at a sync: its measurement of the last
        real (committed) sync's exchange, zeros where there is none (the first sync, a skipped
        one, a worker that joins or heals: alike on every rank)."""
        mine = Measurement(0.0, {f: 0.0 for f in self.formats}, 0.0) if self._report is None else self.measure()
        return torch.tensor(mine.pack(self.formats), dtype=torch.float64)

    def _take(self, choice: Choice) -> None:
        self.pending = choice
        self.rounds.decided()

    def sync_done(self, report) -> None:
        super().sync_done(report)
        if self.pending is not None and not self.rounds.round_ended(report.committed):
            self.pending = None  # (torchft) its round did not commit here: this worker heals at the next

    def after_sync(self) -> None:
        """Before each optimizer step: a decision whose time has come, with nothing in flight
        (its sync's exchange applied)."""
        c = self.controller
        if c.sync.in_progress or (c.delayed is not None and c.delayed.in_flight):
            return
        if self.delay_after_heal is not None:
            c.apply_settings(self.delay_after_heal, c.config.start_format, c.config.fragments)
            self.delay_after_heal = None
        if self.pending is None or not self.rounds.due:
            return
        choice, self.pending = self.pending, None
        self.rounds.reset()
        AutoOverlap._take(self, choice)

    def resume(self, delay: int, dtype: str, fragments: Optional[int] = None) -> Optional[str]:
        self.pending, self.delay_after_heal = None, None
        self.rounds.reset()
        return super().resume(delay, dtype, fragments)


def heal_state(auto) -> dict:
    """What a worker that heals from this one receives of ``auto`` (an
    :class:`~megatron_edit.mcore.auto_overlap.AutoOverlap`): the settings in force and the
    rule's state; plain values (a copy: the transfer serves it by reference)."""
    c, after_heal = auto.controller.config, getattr(auto, "delay_after_heal", None)
    return dict(
        settings=(int(c.outer_step_delay if after_heal is None else after_heal), c.start_format, int(c.fragments)),
        timed=auto.timed, to_measure=auto._to_measure, since_decision=auto._since_decision,
        predicted=auto._predicted, decisions=list(auto.decisions),
        pending=getattr(auto, "pending", None), stage=getattr(getattr(auto, "rounds", None), "stage", None))


def load_heal_state(auto, state: dict) -> None:
    """Take a peer's :func:`heal_state` (at a heal, before the anchors are written: a change of
    format folds residuals the heal then zeroes). This worker's own measurements since its last
    sync are dropped (it trained nothing the others count)."""
    delay, dtype, fragments = state["settings"]
    c, own = auto.controller, int(auto.controller.config.outer_step_delay)
    grid = not c.config.use_async  # EDiT's grid: the delay after the sync this worker began (A-EDiT: now)
    auto.delay_after_heal = delay if grid and delay != own else None
    c.apply_settings(own if grid else delay, dtype, fragments)  # the format and fragments now: the others'
    auto.timed, auto._to_measure = state["timed"], state["to_measure"]
    auto._since_decision, auto._predicted = state["since_decision"], state["predicted"]
    auto.decisions = list(state["decisions"])
    if hasattr(auto, "pending"):
        auto.pending = state["pending"]
        auto.rounds.stage = state["stage"]
    auto._report, auto._step_times, auto._last_end, auto._agreement = None, [], None, None
    auto._local_exchange = None


class RoundAutoOverlap(RoundDecisions):
    """:class:`~megatron_edit.mcore.auto_overlap.AutoOverlap` on EDiT's grid over torchft: the
    measurements of a sync ride on the next round's first collective (the all-gather of who is in
    it: :meth:`~megatron_edit.exchange.fault_tolerant.FaultTolerantSyncGroup.begin`), a decision
    follows :class:`RoundRule` (kept where that round commits, in force after the round after
    it). On the torch backend (a test's comparison) the same agreement is one all-reduce at the
    sync's start, where every worker is."""

    rides_on_rounds = True

    def agreed(self, numbers: torch.Tensor) -> None:
        """The MAX of every rank's :meth:`message` of this round (every rank of every worker in it
        the same): count it, or decide."""
        report, self._report, self._step_times = self._report, None, []
        if report is None or self.rounds.waiting:
            return
        self._judge(report.step, bool(report.delay), overlap_plan.agreed(numbers.tolist(), self.formats))

    def agree_on_torch(self) -> None:
        """The torch backend's agreement at a sync's start (every worker there): one all-reduce."""
        numbers = self.message()
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=self.controller.schedule_group)
        self.agreed(numbers)


def ride(members) -> tuple:
    """The rider of a round's first collective (the arguments after ``contributed`` of
    :meth:`~megatron_edit.exchange.fault_tolerant.FaultTolerantSyncGroup.begin`): what the
    process's controllers (``members``: their torchft backends) send there, their
    :meth:`RoundAutoOverlap.message` one after the other; none when none of them rides."""
    riders = [m.controller.auto for m in members if getattr(m.controller.auto, "rides_on_rounds", False)]
    return (lambda: torch.cat([a.message() for a in riders]),) if riders else ()


def dispatch(members, numbers: Optional[torch.Tensor]) -> None:
    """The agreed numbers of :func:`ride` to each riding controller, in order."""
    if numbers is None:
        return
    for auto in [m.controller.auto for m in members if getattr(m.controller.auto, "rides_on_rounds", False)]:
        n = 3 + len(auto.formats)  # (Measurement.pack)
        auto.agreed(numbers[:n])
        numbers = numbers[n:]
