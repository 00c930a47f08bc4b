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
