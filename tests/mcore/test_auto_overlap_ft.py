"""When an ``auto_overlap`` decision is in force over torchft (mcore/auto_overlap_ft.py), on
stand-in controllers of two workers, the measurements injected: a round that commits on one
worker and fails on the other (the partial event: a peer died inside it) leaves their settings in
force equal at every round, and a worker that heals takes the decision waiting or the settings in
force from its peer. The runs over real torchft: tests/torchft_backend/test_torchft_overlap.py."""

from types import SimpleNamespace

import torch

from megatron_edit.algorithm.overlap_plan import Measurement
from megatron_edit.config import LocalSGDConfig
from megatron_edit.mcore.auto_overlap_async import auto_overlap_for
from megatron_edit.mcore.auto_overlap_ft import RoundAutoOverlap, RoundRule, heal_state, load_heal_state

# H = 4: a step of 0.10 s and an fp32 exchange of 0.15 s take a delay of 2.
MEASURED = Measurement(0.10, {"fp32": 0.15}, 0.0)


def _worker():
    user = LocalSGDConfig(local_sgd_sync_interval=4, auto_overlap=True, sync_backend="torch")
    ctl = SimpleNamespace(sync=SimpleNamespace(in_progress=False, num_workers=2), delayed=None, num_workers=2,
                          shards=[SimpleNamespace(numel=1024, device="cpu")], applied=[], steps_done=0,
                          last_step=None)
    auto = RoundAutoOverlap(ctl, user)
    ctl.auto, ctl.config = auto, auto.initial_config()

    def apply_settings(delay, dtype, fragments=None):
        if (delay, dtype) != (ctl.config.outer_step_delay, ctl.config.start_format):
            ctl.applied.append((delay, dtype))
        ctl.config = auto.config_for(delay, dtype, fragments)

    ctl.apply_settings = apply_settings
    auto.measure = lambda: MEASURED
    return ctl


def _round(workers, step, committed, heals=()):
    """One round of ``workers``: (heals: ``(healer, peer)`` at its quorum) the first all-gather with
    the measurements (MAX over the workers), the exchange, the round's end on each (``committed``:
    per worker), then the next optimizer step (a decision whose time has come is put in force)."""
    for healer, peer in heals:
        load_heal_state(healer.auto, heal_state(peer.auto))
    numbers = torch.stack([w.auto.message() for w in workers]).amax(dim=0)
    for w, ok in zip(workers, committed):
        w.auto.agreed(numbers.clone())
        w.auto.sync_done(SimpleNamespace(committed=ok, skipped_sync=False, step=step, delay=w.config.outer_step_delay,
                                         seconds=0.15, exposed_wait_seconds=0.0, launch_wait_seconds=None,
                                         fragment=None))
        w.auto.step_ended()
        w.auto.after_sync()


def test_the_torchft_grid_uses_the_round_rule_and_the_torch_backend_does_not():
    ft = LocalSGDConfig(local_sgd_sync_interval=4, auto_overlap=True)
    ft.sync_backend = "torchft"  # (the backend's own checks need torchft installed; the choice does not)
    assert type(auto_overlap_for(None, ft)) is RoundAutoOverlap
    assert type(auto_overlap_for(None, LocalSGDConfig(local_sgd_sync_interval=4, auto_overlap=True))) \
        is not RoundAutoOverlap
    rule = RoundRule(False)
    rule.decided()
    assert rule.due and not rule.waiting


def test_a_decision_is_in_force_after_the_round_after_its_own_on_every_worker():
    a, b = _worker(), _worker()
    _round([a, b], 4, (True, True))  # nothing measured yet (the first sync's numbers come with the next round)
    _round([a, b], 8, (True, True))  # the first timed sync's measurement
    _round([a, b], 12, (True, True))  # the second's: decided, kept (its round committed)
    assert a.auto.pending.outer_step_delay == 2 and a.auto.rounds.stage == "kept" and a.applied == []
    _round([a, b], 16, (True, True))  # the next round has ended: in force at the next optimizer step
    assert a.applied == b.applied == [(2, "fp32")] and a.auto.pending is None


def test_a_worker_whose_round_of_the_decision_failed_heals_and_takes_it_at_the_same_round():
    """The partial event: the round of the decision commits on worker A and fails on worker B
    (its first all-gather succeeded on both: the same numbers). B drops the decision; behind A at
    the next round it heals there and receives the decision waiting, so both put it in force
    after that round, and neither changed its settings under a round."""
    a, b = _worker(), _worker()
    _round([a, b], 4, (True, True))
    _round([a, b], 8, (True, True))
    _round([a, b], 12, (True, False))
    assert a.auto.rounds.stage == "kept" and b.auto.pending is None and b.auto.rounds.stage is None
    _round([a, b], 16, (True, True), heals=[(b, a)])
    assert a.applied == b.applied == [(2, "fp32")]
    assert a.auto.decisions == b.auto.decisions and (a.auto.timed, a.auto._to_measure) == (b.auto.timed, b.auto._to_measure)


def test_a_worker_that_heals_after_the_change_takes_the_settings_in_force():
    """A worker that failed the round after the decision too (or a relaunched one) heals once the
    decision is in force: it takes the delay and format from the heal."""
    a, b = _worker(), _worker()
    for step in (4, 8, 12):
        _round([a, b], step, (True, True))
    _round([a, b], 16, (True, False))  # B's next round fails: it still puts the decision in force, as A
    assert a.applied == b.applied == [(2, "fp32")]
    fresh = _worker()  # a relaunched worker: the run's starting settings
    _round([a, fresh], 20, (True, True), heals=[(fresh, a)])
    assert fresh.applied == [(2, "fp32")] and fresh.config.outer_step_delay == 2
    assert fresh.auto.decisions == a.auto.decisions


def test_a_heal_into_another_delay_takes_it_once_the_sync_the_worker_began_is_applied():
    """EDiT's grid: a worker that heals (its heal reaches it in a sync it began without a delay)
    from a peer with the delay of 2 in force keeps its sync's delay, completes that sync at once
    and takes the delay at the next optimizer step with nothing in flight; a worker that heals
    from it meanwhile is told the delay coming (the double fault over real torchft:
    tests/torchft_backend/test_torchft_overlap.py)."""
    a, b = _worker(), _worker()
    for step in (4, 8, 12, 16):
        _round([a, b], step, (True, True))
    assert a.config.outer_step_delay == 2
    healer = _worker()
    load_heal_state(healer.auto, heal_state(a.auto))
    assert healer.config.outer_step_delay == 0 and healer.applied == []
    assert healer.auto.delay_after_heal == 2 and healer.auto.completes_now
    assert heal_state(healer.auto)["settings"][0] == 2
    healer.sync.in_progress = True  # its sync is not applied yet
    healer.auto.after_sync()
    assert healer.applied == []
    healer.sync.in_progress = False
    healer.auto.after_sync()
    assert healer.applied == [(2, "fp32")] and healer.auto.delay_after_heal is None
    load_heal_state(b.auto, heal_state(a.auto))  # a heal with the delay already its own: nothing waits
    assert b.auto.delay_after_heal is None and not b.auto.completes_now
