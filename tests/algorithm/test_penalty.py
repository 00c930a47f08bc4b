"""megatron_edit.algorithm.penalty on hand-computed inputs."""

import math

import torch

from megatron_edit.algorithm import penalty

F64 = torch.float64


def test_softmax_weights_by_norm_and_exclusion():
    norms = torch.tensor([[1.0, 2.0], [3.0, 2.0]], dtype=F64)
    w = penalty.averaging_weights(norms, None, weighted=True, temperature=1.0)
    a = 1 / (1 + math.exp(-2))  # softmax(-1, -3)[0]
    assert torch.allclose(w, torch.tensor([[a, 0.5], [1 - a, 0.5]], dtype=F64))
    w = penalty.averaging_weights(norms, None, weighted=True, temperature=2.0)
    a2 = 1 / (1 + math.exp(-1))
    assert torch.allclose(w[:, 0], torch.tensor([a2, 1 - a2], dtype=F64))
    excluded = torch.tensor([[False, False], [True, False]])
    w = penalty.averaging_weights(norms, excluded, weighted=True)
    assert torch.allclose(w, torch.tensor([[1.0, 0.5], [0.0, 0.5]], dtype=F64))


def test_plain_mean_over_included_workers_and_all_excluded_skip():
    norms = torch.tensor([[1.0, 1.0], [5.0, 1.0], [2.0, 1.0]], dtype=F64)
    excluded = torch.tensor([[False, True], [True, True], [False, True]])
    w = penalty.averaging_weights(norms, excluded, weighted=False)
    assert torch.equal(w, torch.tensor([[0.5, 0.0], [0.0, 0.0], [0.5, 0.0]], dtype=F64))
    w = penalty.averaging_weights(norms, excluded, weighted=True)
    assert torch.equal(w[:, 1], torch.zeros(3, dtype=F64)) and not w.isnan().any()
    assert torch.equal(penalty.skipped_layers(excluded, 2), torch.tensor([False, True]))
    assert not penalty.skipped_layers(None, 2).any()
    # Without exclusion, a NaN norm poisons its layer when weighted (the damage is visible).
    nan = torch.tensor([[1.0], [float("nan")]], dtype=F64)
    assert penalty.averaging_weights(nan, None, weighted=True).isnan().all()


def _feed(values, warmup=2, threshold=3.0, alpha=0.5):
    stats = penalty.EWMAStats.zeros(1, 1)
    flags, history = [], []
    for v in values:
        excluded, stats = penalty.detect_anomalies(torch.tensor([[v]], dtype=F64), stats, alpha, warmup, threshold)
        flags.append(bool(excluded))
        history.append((stats.mean.item(), stats.var.item(), stats.count.item()))
    return flags, history


def test_detector_flags_a_spike_and_the_next_one_and_keeps_its_statistics():
    flags, hist = _feed([1.0, 2.0, 2.0, 10.0, 10.0, 2.0])
    # 1.0 -> mean 1, var 0; 2.0 -> mean 1.5, var 0.5*(0 + 0.5*1) = 0.25; 2.0: z = 1 -> kept,
    # mean 1.75, var 0.5*(0.25 + 0.5*0.25) = 0.1875; 10.0: z = 19 -> excluded, twice.
    assert flags == [False, False, False, True, True, False]
    assert hist[1] == (1.5, 0.25, 2)
    assert hist[2] == (1.75, 0.1875, 3)
    assert hist[3] == hist[2] and hist[4] == hist[2], "an excluded value must not enter the statistics"


def test_detector_is_silent_during_warmup_but_always_excludes_non_finite():
    flags, hist = _feed([1.0, 100.0, 1.0], warmup=3)
    assert flags == [False, False, False]  # count < warmup: never excluded, always learned from
    assert hist[1][2] == 2
    flags, hist = _feed([1.0, float("nan"), float("inf"), 1.0], warmup=5)
    assert flags == [False, True, True, False]
    assert hist[1] == hist[0] and hist[2] == hist[0]


def test_detector_is_per_worker_and_per_layer():
    stats = penalty.EWMAStats.zeros(2, 2)
    for v in ([[1.0, 1.0], [1.0, 1.0]], [[2.0, 2.0], [2.0, 2.0]]):
        _, stats = penalty.detect_anomalies(torch.tensor(v, dtype=F64), stats, 0.5, 2, 3.0)
    excluded, _ = penalty.detect_anomalies(torch.tensor([[9.0, 1.5], [1.5, 1.5]], dtype=F64), stats, 0.5, 2, 3.0)
    assert excluded.tolist() == [[True, False], [False, False]]


def test_clip_coefficients():
    coef = penalty.clip_coefficients(torch.tensor([0.5, 2.0, 0.0, 4.0], dtype=F64), 1.0)
    assert torch.allclose(coef, torch.tensor([1.0, 0.5, 1.0, 0.25], dtype=F64))
    assert torch.equal(penalty.clip_coefficients(torch.tensor([7.0]), None), torch.ones(1, dtype=F64))


def _feed_workers(workers, layers, syncs, value, seed=0, warmup=20, alpha=0.02, threshold=3.0, stats=None):
    """Feed ``value(sync, noise)`` -> [W, L] norms for ``syncs`` syncs; returns per-sync exclusions."""
    g = torch.Generator().manual_seed(seed)
    stats = stats or penalty.EWMAStats.zeros(workers, layers)
    history = []
    for k in range(syncs):
        noise = 1 + 0.02 * torch.randn(workers, layers, generator=g, dtype=F64)
        excluded, stats = penalty.detect_anomalies(value(k, noise), stats, alpha, warmup, threshold)
        history.append(excluded)
    return history, stats


def _longest_exclusion(history, start=0):
    """The longest run of consecutive syncs any (worker, layer) entry stayed excluded."""
    longest, run = 0, None
    for excluded in history[start:]:
        run = excluded.to(torch.int64) if run is None else (run + 1) * excluded
        longest = max(longest, int(run.max()))
    return longest


def _rate(history, a, b):
    return sum(int(e.sum()) for e in history[a:b]) / (b - a)


def test_detector_recovers_from_a_shift_shared_by_all_workers():
    """+30% for every worker from sync 200 on (a learning-rate change, a resume with larger H):
    not any one worker's anomaly. Before the fix every worker stayed excluded from sync 200 on;
    now the exclusions after the shift are the noise's (z > 3 happens), as before it, and none
    lasts more than two syncs."""
    history, stats = _feed_workers(4, 3, 300, lambda k, noise: noise * (1.3 if k >= 200 else 1.0))
    assert not history[200].any()
    assert _rate(history, 200, 300) <= _rate(history, 100, 200) + 0.05
    assert _longest_exclusion(history, 150) <= 2


def test_detector_recovers_from_a_shift_shared_by_most_workers():
    history, _ = _feed_workers(4, 2, 300, lambda k, noise: noise * torch.tensor([[1.0], [1.5], [1.5], [1.5]], dtype=F64)
                               if k >= 200 else noise)
    # The shifted workers' share of the median changes, so their statistics adapt for a while
    # (a few extra z > 3); no entry is locked out.
    assert _longest_exclusion(history, 150) <= 2


def test_detector_still_excludes_one_workers_spike_after_a_shared_shift():
    def value(k, noise):
        out = noise * (1.3 if k >= 100 else 1.0)
        if k == 180:
            out[2, 1] *= 10  # one worker, one layer, ten times its usual norm
        return out

    history, _ = _feed_workers(4, 3, 200, value)
    assert bool(history[180][2, 1])
    assert _longest_exclusion(history, 50) <= 2


def test_detector_with_two_workers_excludes_the_one_that_spikes():
    def value(k, noise):
        out = noise.clone()
        if k == 50:
            out[1] *= 10
        if k == 70:
            out[:, 0] = float("nan")  # non-finite: always out
        return out

    history, _ = _feed_workers(2, 2, 80, value)
    assert history[50].tolist() == [[False, False], [True, True]]
    assert history[70][:, 0].tolist() == [True, True] and not history[70][:, 1].any()


def test_detector_does_not_judge_from_a_single_value():
    """warmup 0 used to exclude everything at the first sync (no statistics yet, std 0)."""
    norms = torch.tensor([[1.0, 2.0], [1.1, 2.5]], dtype=F64)
    excluded, stats = penalty.detect_anomalies(norms, penalty.EWMAStats.zeros(2, 2), 0.1, 0, 3.0)
    assert not excluded.any()
    excluded, _ = penalty.detect_anomalies(norms * 1.01, stats, 0.1, 0, 3.0)
    assert not excluded.any()


# ---------------------------------------------------------------------- workers that change (torchft)
def _norms(level, sync):
    """[W, 2] norms: each worker at its own level, with a small deterministic wiggle."""
    wiggle = torch.tensor([[1 + 0.02 * math.sin(3 * sync + w + l) for l in range(2)] for w in range(len(level))],
                          dtype=torch.float64)
    return torch.tensor(level, dtype=torch.float64).unsqueeze(1) * wiggle


def test_statistics_follow_the_worker_not_its_place_in_the_sync():
    """Workers 0, 1, 2 (norms about 1, 1.1 and 10) for 6 syncs, then worker 1 leaves and worker 2
    is second in the sync: against its own history its norm is normal (not excluded), where the
    statistics of the second place (worker 1's) would exclude it. While all three stay, the
    result is detect_anomalies' on the same rows."""
    alpha, warmup, threshold = 0.3, 2, 3.0
    ledger, static = {}, penalty.EWMAStats.zeros(3, 2)
    everyone = torch.ones(3, dtype=torch.bool)
    for sync in range(6):
        norms = _norms([1.0, 1.1, 10.0], sync)
        excluded, ledger = penalty.detect_anomalies_by_worker(norms, ledger, [0, 1, 2], everyone, alpha, warmup,
                                                              threshold)
        expected, static = penalty.detect_anomalies(norms, static, alpha, warmup, threshold)
        assert torch.equal(excluded, expected) and not excluded.any()
        for w in range(3):
            assert torch.equal(ledger[w].mean, static.mean[w : w + 1])
            assert torch.equal(ledger[w].rel_var, static.rel_var[w : w + 1])
    norms = _norms([1.0, 10.0], 6)  # workers 0 and 2
    two = torch.ones(2, dtype=torch.bool)
    excluded, after = penalty.detect_anomalies_by_worker(norms, ledger, [0, 2], two, alpha, warmup, threshold)
    assert not excluded.any()
    by_place, _ = penalty.detect_anomalies(norms, static.rows([0, 1]), alpha, warmup, threshold)
    assert by_place[1].all()  # what keeping the statistics by place would have done
    assert torch.equal(after[1].count, ledger[1].count)  # the one that left keeps its statistics
    assert bool((after[2].count == ledger[2].count + 1).all())


def test_a_worker_that_did_not_train_is_excluded_and_leaves_no_statistics():
    """A worker that has just joined (id 7, zero pseudo-gradient) is excluded from every layer,
    not counted in the others' relative norms and gets no statistics; the next sync it trains
    and starts from one update (not warm: not excluded)."""
    ledger = {}
    for sync in range(4):
        _, ledger = penalty.detect_anomalies_by_worker(_norms([1.0, 1.2], sync), ledger, [0, 1],
                                                       torch.ones(2, dtype=torch.bool), 0.3, 2, 3.0)
    norms = torch.cat([_norms([1.0, 1.2], 4), torch.zeros(1, 2, dtype=torch.float64)])
    trained = torch.tensor([True, True, False])
    excluded, after = penalty.detect_anomalies_by_worker(norms, ledger, [0, 1, 7], trained, 0.3, 2, 3.0)
    assert excluded.tolist() == [[False, False], [False, False], [True, True]]
    _, without = penalty.detect_anomalies_by_worker(norms[:2], ledger, [0, 1], trained[:2], 0.3, 2, 3.0)
    assert 7 not in after
    assert all(torch.equal(after[w].mean, without[w].mean) and torch.equal(after[w].rel_mean, without[w].rel_mean)
               for w in (0, 1))  # as if worker 7 were not there
    excluded, after = penalty.detect_anomalies_by_worker(_norms([1.0, 1.2, 30.0], 5), after, [0, 1, 7],
                                                         torch.ones(3, dtype=torch.bool), 0.3, 2, 3.0)
    assert not excluded[2].any() and after[7].count.tolist() == [[1, 1]]
    assert penalty.averaging_weights(norms, torch.tensor([[False] * 2, [False] * 2, [True] * 2]), True)[2].sum() == 0
