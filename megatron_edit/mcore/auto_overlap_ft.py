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
"""

from __future__ import annotations

from typing import Optional


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


def heal_state(auto) -> dict:
    """What a worker that heals from this one receives of ``auto`` (an
    :class:`~megatron_edit.mcore.auto_overlap.AutoOverlap`): the settings in force and the
    rule's state; plain values (a copy: the transfer serves it by reference)."""
    c = auto.controller.config
    return dict(
        settings=(int(c.outer_step_delay), c.start_format, int(c.fragments)),
        timed=auto.timed, to_measure=auto._to_measure, since_decision=auto._since_decision,
        predicted=auto._predicted, decisions=list(auto.decisions),
        pending=getattr(auto, "pending", None), stage=getattr(getattr(auto, "rounds", None), "stage", None))


def load_heal_state(auto, state: dict) -> None:
    """Take a peer's :func:`heal_state` (at a heal, before the anchors are written: a change of
    format folds residuals the heal then zeroes). This worker's own measurements since its last
    sync are dropped (it trained nothing the others count)."""
    delay, dtype, fragments = state["settings"]
    auto.controller.apply_settings(delay, dtype, fragments)
    auto.timed, auto._to_measure = state["timed"], state["to_measure"]
    auto._since_decision, auto._predicted = state["since_decision"], state["predicted"]
    auto.decisions = list(state["decisions"])
    if hasattr(auto, "pending"):
        auto.pending = state["pending"]
        auto.rounds.stage = state["stage"]
    auto._report, auto._step_times, auto._last_end, auto._agreement = None, [], None, None
    auto._local_exchange = None
