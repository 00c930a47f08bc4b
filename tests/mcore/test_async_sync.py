"""A-EDiT with streaming fragments (``use_async`` with ``fragments``; mcore/async_sync.py) on real
megatron-core (CPU, gloo, 2 workers x 2 ranks), workers of different speeds on the fake clock of
tests/mcore/test_async.py, against the plain-PyTorch simulation (``simulate_edit`` with
``async_syncs`` and ``fragment_params``: the syncs worked out by hand below)."""

import pytest
import torch

from compare import max_difference_but_key_bias as max_difference
from dist import run_ranks
from edit_runs import async_runs, default_spec, simulate_edit
from megatron_edit.mcore.async_sync import AsyncFragments
from test_edit_megatron import OUTER

WORLD = 4
SIM_ATOL = 1e-4  # see test_async_delayed.py (the key bias is left out: Adam on reduction noise)
MAX_STEPS = 40

# Worker 0 takes 1 s per step, worker 1 0.25 s; one synchronous warmup step; a budget of 20
# synchronous iterations (40 worker-steps). Sync time 4 s with F = 2: a sync every 2 s, the first
# interval H/F = 2 steps: after 3 / 3 (fragment 1), then 2 / 8 steps each interval: 5 / 11
# (fragment 0), 7 / 19 (fragment 1); the 14 worker-steps left make the final interval (another
# 10 would leave less than half an interval), 3 / 11 by speed: the final sync at 10 / 30, of
# every fragment.
FRAG = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=4, local_sgd_warmup_steps=1,
            fragments=2, min_total_global_steps=1, use_step_weight=True, step_weight_ratio=0.5)
SYNCS = [([3, 3], False), ([5, 11], False), ([7, 19], False), ([10, 30], False)]
FRAGMENTS = [1, 0, 1, None]


def _spec(**extra):
    return default_spec(local_sgd=dict(FRAG, **extra), outer=OUTER, seconds_per_step=[1.0, 0.25], max_steps=MAX_STEPS,
                        steps=MAX_STEPS, train_iters=20, async_syncs=SYNCS, snapshot_every_step=True, bucket_size=1000)


CASES = {  # (spec, each sync's delay, the steps after which worker 0 / worker 1 apply each sync)
    "no delay": (_spec(sync_mode="step_end"), [0, 0, 0, 0], [(3, 3), (5, 11), (7, 19), (10, 30)]),
    "tau 1, alpha 0": (_spec(sync_mode="layerwise", outer_step_delay=1, outer_merge_alpha=0.0), [1, 1, 1, 0],
                       [(4, 4), (6, 12), (8, 20), (10, 30)]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.one_lane] if i else [])  # the first in every lane
                                  for i, c in enumerate(CASES)])
def test_a_edit_with_fragments_matches_the_simulation(case):
    """Each sync exchanges one fragment in turn (1, 0, 1), the final one every fragment; the
    parameters equal the simulation's on every worker (step weights per fragment: each worker's
    steps since that fragment's last sync); right after each apply exactly the synced fragment is
    identical on both workers (alpha = 0), and the run ends with one model."""
    spec, delays, applied = CASES[case]
    results = run_ranks(async_runs, WORLD, spec, timeout=240)
    frags = results[0]["fragment_params"]
    assert len(frags) == 2 and all(frags) and not set(frags[0]) & set(frags[1])
    sim = run_ranks(simulate_edit, 1, dict(spec, fragment_params=frags), WORLD, timeout=120)[0]["params"]
    for r in results:
        assert r["fragment_params"] == frags
        got = [(rep.step, rep.delay, rep.fragment, rep.final) for rep in r["reports"]]
        assert got == [(a[r["worker"]], d, f, f is None) for a, d, f in zip(applied, delays, FRAGMENTS)], got
        assert r["finished"] and r["steps"] == SYNCS[-1][0][r["worker"]] and not r["in_flight_at_end"]
        assert max_difference(r["params"], sim[r["worker"]]) <= SIM_ATOL, case
    # step weights: each worker's steps since the fragment's own last sync (launch to launch):
    # fragment 0 at 5 / 11 since the anchor (4 / 10), fragment 1 at 7 / 19 since 3 / 3 (4 / 16)
    for report, steps in ((1, [4.0, 10.0]), (2, [4.0, 16.0])):
        steps = torch.tensor(steps, dtype=torch.float64)
        weights = results[0]["reports"][report].weights[:, 0]
        assert torch.allclose(weights, 0.25 + 0.5 * steps / steps.sum()), (report, weights)
    for shard in (0, 1):  # worker 0 is ranks 0-1, worker 1 ranks 2-3
        a, b = results[shard], results[2 + shard]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), "one model at the end"
        for (s0, s1), fragment in zip(applied, FRAGMENTS):
            x, y = a["snapshots"][s0], b["snapshots"][s1]
            synced = set(x) if fragment is None else set(frags[fragment])
            for name in x:
                assert torch.equal(x[name], y[name]) == (name in synced), (case, s0, s1, name)


def test_fragments_go_round_robin_over_the_real_syncs():
    """The k-th real sync exchanges fragment k mod F; a skipped one moves none on; each fragment's
    step weights count from its own last sync; the final sync weighs each layer by its
    fragment's steps; the state round-trips (another number of workers: counted from the resume)."""
    from types import SimpleNamespace

    class Shard:
        def __init__(self, layers):
            self.bucket_layers = set(layers)

    shards = SimpleNamespace(fragments=[[Shard([0, 1])], [Shard([2])]])
    shards.all = [s for f in shards.fragments for s in f]

    def schedule(steps, since):
        return SimpleNamespace(steps=torch.tensor(steps, dtype=torch.float64),
                               steps_since_exchange=torch.tensor(since, dtype=torch.float64))

    frags = AsyncFragments()
    f, members, weights = frags.at_sync(shards, 3, schedule([3, 3], [2, 2]), skip=False, final=False)
    assert (f, members, weights.tolist()) == (1, shards.fragments[1], [2.0, 2.0])
    f, members, weights = frags.at_sync(shards, 3, schedule([4, 6], [1, 3]), skip=True, final=False)
    assert (f, members, weights.tolist()) == (None, None, [1.0, 3.0])
    f, members, weights = frags.at_sync(shards, 3, schedule([5, 11], [2, 8]), skip=False, final=False)
    assert (f, members, weights.tolist()) == (0, shards.fragments[0], [4.0, 10.0])  # since the anchor
    saved = frags.state_dict()
    f, members, weights = frags.at_sync(shards, 3, schedule([10, 30], [5, 19]), skip=False, final=True)
    assert (f, members) == (None, shards.all)
    assert weights.tolist() == [[5.0, 5.0, 7.0], [19.0, 19.0, 27.0]]  # layers 0-1: fragment 0's, 2: fragment 1's
    again = AsyncFragments()
    again.load_state_dict(saved, workers=2)
    assert again.state_dict() == saved == {"exchanges": 2, "last": [{0: 5, 1: 11}, {0: 3, 1: 3}]}
    again.load_state_dict(saved, workers=4)
    assert again.exchanges == 2 and again.last is None
    again.load_state_dict({"exchanges": 2, "last": [{"0": 5, "1": 11}, {"0": 3, "1": 3}]})  # (keys as text)
    assert again.state_dict() == saved
    one = SimpleNamespace(fragments=[shards.all], all=shards.all)
    assert frags.at_sync(one, 3, schedule([3, 3], [2, 2]), skip=False, final=False)[:2] == (None, None)


def test_fragments_count_by_worker_id_over_torchft():
    """Over torchft the sync's workers change: each fragment's counts are kept by worker id. A
    worker that brings no steps (it joins, or heals from a peer and holds the anchor) weighs 0 and
    counts every fragment from its step; a worker gone from a sync is forgotten; a round that does
    not commit on this worker counts nothing (the same fragment is due again); a heal passes the
    counts on (state_dict)."""
    from types import SimpleNamespace

    class Shard:
        def __init__(self, layers):
            self.bucket_layers = set(layers)

    shards = SimpleNamespace(fragments=[[Shard([0])], [Shard([1])]])
    shards.all = [s for f in shards.fragments for s in f]

    def schedule(steps, since):
        return SimpleNamespace(steps=torch.tensor(steps, dtype=torch.float64),
                               steps_since_exchange=torch.tensor(since, dtype=torch.float64))

    frags = AsyncFragments()
    # workers 3 and 7 at their first sync (4 steps each since the anchor): fragment 1
    f, _, weights = frags.at_sync(shards, 2, schedule([4, 4], [4, 4]), False, False, ids=[3, 7])
    assert (f, weights.tolist()) == (1, [4.0, 4.0])
    frags.settled(True)
    # worker 7 died; worker 3 alone (its quorum): fragment 0, 8 steps since the anchor
    f, _, weights = frags.at_sync(shards, 2, schedule([8], [4]), False, False, ids=[3])
    assert (f, weights.tolist()) == (0, [8.0])
    frags.settled(True)
    assert frags.last == [{3: 8}, {3: 4}]  # worker 7 forgotten
    # worker 7 relaunched joins (healed to worker 3's step 11, brings no steps); the round fails
    healed = AsyncFragments()
    healed.load_state_dict(frags.state_dict())
    for counts in (frags, healed):
        f, _, weights = counts.at_sync(shards, 2, schedule([11, 11], [3, 0]), False, False, ids=[3, 7])
        assert (f, weights.tolist()) == (1, [7.0, 0.0])  # fragment 1: worker 3's 7 steps since step 4
        counts.settled(False)
    assert frags.state_dict() == healed.state_dict() == {"exchanges": 2, "last": [{3: 8}, {3: 4}]}
    # the next round commits: fragment 1 again, worker 7 healed at this one (no steps again)
    f, _, weights = frags.at_sync(shards, 2, schedule([13, 11], [5, 0]), False, False, ids=[3, 7])
    assert (f, weights.tolist()) == (1, [9.0, 0.0])
    frags.settled(True)
    # the final sync: fragment 0 weighs worker 3's steps since 8, worker 7's since its heal at 11
    f, members, weights = frags.at_sync(shards, 2, schedule([16, 14], [3, 3]), False, True, ids=[3, 7])
    assert (f, members) == (None, shards.all)
    assert weights.tolist() == [[8.0, 3.0], [3.0, 3.0]]  # [worker, layer]: layer 0 fragment 0, layer 1 fragment 1
