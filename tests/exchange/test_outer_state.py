"""megatron_edit.exchange.outer_state: the fused momentum-SGD outer step against torch's own,
offloaded (paged) state against resident state, and the compiled kernel against eager."""

import pytest
import torch

from megatron_edit.config import OuterOptimizerConfig
from megatron_edit.exchange.outer_state import OuterState
from megatron_edit.exchange.shard import BucketShard

RANGES = [(0, 5), (7, 16), (16, 19)]  # a gap at 5..7, padding at 19..24
NUMEL = 24


def _shard(seed, flat: bool, bf16_model: bool):
    g = torch.Generator().manual_seed(seed)
    buffer = torch.zeros(NUMEL)
    for s, e in RANGES:
        buffer[s:e] = torch.randn(e - s, generator=g)
    if flat:
        mains = [buffer[s:e] for s, e in RANGES]
    else:
        mains = [buffer[s:e].clone() for s, e in RANGES]
    model = torch.zeros(NUMEL, dtype=torch.bfloat16) if bf16_model else None
    return BucketShard(numel=NUMEL, mains=mains, local_ranges=RANGES,
                       segments=[(s, e, i, True) for i, (s, e) in enumerate(RANGES)],
                       model=model, flat_mains=buffer if flat else None)


def _run(state_kwargs, flat, bf16, steps=3, kwargs=None, skipped=None):
    config = OuterOptimizerConfig("sgd", kwargs or dict(lr=0.7, momentum=0.9, nesterov=True))
    shard = _shard(0, flat, bf16)
    state = OuterState(config, **state_kwargs)
    state.capture([shard])
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for m in shard.mains:
            m.add_(torch.randn(m.shape, generator=g))
        delta = shard.pseudo_gradient(state.anchor_on_device(shard), torch.empty(NUMEL)) * 3  # a "sum" of 3
        state.apply(shard, delta, skipped or [], write_model=True, divisor=3)
    state.synchronize()
    momentum = state.optimizer.state[shard.anchor]["momentum_buffer"]
    return dict(anchor=shard.anchor.clone(), momentum=momentum.clone(),
                mains=[m.clone() for m in shard.mains], model=None if shard.model is None else shard.model.clone())


def _equal(a, b):
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list):
            assert all(torch.equal(p, q) for p, q in zip(x, y)), key
        elif x is not None:
            assert torch.equal(x, y), key


@pytest.mark.parametrize("flat", [True, False], ids=["fp32-flat-mains", "separate-mains"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_eager_fused_step_equals_torch_sgd_bitwise(flat, nesterov):
    kwargs = dict(lr=0.7, momentum=0.9, nesterov=nesterov)
    fused = _run(dict(fused=True, compile=False), flat, bf16=not flat, kwargs=kwargs)
    generic = _run(dict(fused=False), flat, bf16=not flat, kwargs=kwargs)
    _equal(fused, generic)
    assert torch.equal(fused["anchor"][5:7], torch.zeros(2)) and torch.equal(fused["anchor"][19:], torch.zeros(5))


def test_fused_path_only_for_plain_momentum_sgd():
    assert OuterState(OuterOptimizerConfig()).fused
    assert not OuterState(OuterOptimizerConfig("sgd", dict(lr=0.7, momentum=0.9, weight_decay=0.1))).fused
    assert not OuterState(OuterOptimizerConfig("sgd", dict(lr=1.0, momentum=0.0))).fused
    assert not OuterState(OuterOptimizerConfig("adam", dict(lr=0.1))).fused
    assert not OuterState(OuterOptimizerConfig(), fused=False).fused


def test_skipped_layers_keep_anchor_and_momentum_on_the_fused_path():
    fused = _run(dict(fused=True, compile=False), True, False, steps=2, skipped=[(7, 16)])
    generic = _run(dict(fused=False), True, False, steps=2, skipped=[(7, 16)])
    _equal(fused, generic)


@pytest.mark.parametrize("fused", [True, False])
def test_paged_state_computes_the_same_numbers(fused):
    """The offload path (state paged onto the shard's device and back) on the CPU: same numbers
    as resident state; a momentum buffer created by the first step gets its own host home."""
    paged = _run(dict(fused=fused, compile=False, paged=True), True, True)
    resident = _run(dict(fused=fused, compile=False), True, True)
    _equal(paged, resident)


@pytest.mark.timeout(600)
def test_compiled_fused_kernel_matches_eager():
    """The kernel torch.compile builds on a GPU, built here by inductor for the CPU: the same
    graph, so a wrong capture (dynamic shapes, first step, optional outputs) shows here too."""
    pytest.importorskip("torch._inductor")
    compiled = _run(dict(fused=True, compile=True), True, True)
    eager = _run(dict(fused=True, compile=False), True, True)
    for key in ("anchor", "momentum"):
        assert torch.allclose(compiled[key], eager[key], rtol=1e-6, atol=1e-6), key
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(compiled["mains"], eager["mains"]))
    assert torch.equal(compiled["model"], compiled["anchor"].to(torch.bfloat16))


def test_the_compiled_step_is_built_once_under_concurrent_first_calls(monkeypatch):
    """Review item 8: three threads asking for the compiled step at once compile it once and
    share one callable (``functools.lru_cache`` ran the factory once per thread)."""
    import threading
    import time

    from megatron_edit.exchange import outer_state

    built = []

    def slow_compile(fn, **kwargs):
        built.append(fn)
        time.sleep(0.2)  # widen the window in which other threads miss the cache
        return fn

    monkeypatch.setattr(outer_state, "_COMPILED_STEP", None)
    monkeypatch.setattr(outer_state.torch, "compile", slow_compile)
    got, barrier = [], threading.Barrier(3)

    def ask():
        barrier.wait()
        got.append(outer_state._compiled_step())

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(built) == 1
    assert len(got) == 3 and got[0] is got[1] is got[2]
