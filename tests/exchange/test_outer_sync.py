"""megatron_edit.exchange.outer_sync driven by fake collectives: several workers as threads of one
process, no Megatron, no torch.distributed.

Each worker holds the same shards (plain tensors: two bucket groups, three buckets, five layers,
padding between parameters); a sync is run layer-wise (groups completed in forward order, as
Megatron's pre-hooks would) or step-end, and its result is checked against an independent
computation of EDiT's outer step on the flat parameters."""


import pytest
import torch

from fake_groups import CollectiveMismatch, FakeWorkerGroups, FakeWorld, run_workers
from megatron_edit.algorithm import penalty
from megatron_edit.config import GTAConfig, LocalSGDConfig, OuterOptimizerConfig
from megatron_edit.exchange.groups import all_reduce_bytes
from megatron_edit.exchange.outer_state import OuterState
from megatron_edit.exchange.outer_sync import OuterSync
from megatron_edit.exchange.shard import BucketShard

# (numel, [(start, end, layer)]) per bucket; groups: [bucket 0], [buckets 1, 2]
BUCKETS = [
    (8, [(0, 3, 0), (3, 6, 1)]),  # 6..8 padding
    (6, [(0, 2, 1), (2, 5, 2)]),  # layer 1 spans buckets 0 and 1 (two groups)
    (5, [(0, 4, 3), (4, 5, 4)]),
]
GROUPS = [[0], [1, 2]]
LAYERS = ["l0", "l1", "l2", "l3", "l4"]
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))


def _initial(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(e - s, generator=g) for s, e, _ in segs] for _, segs in BUCKETS]


def _deltas(worker, scale=1.0):
    """Worker-specific update of each parameter (what its local steps did)."""
    g = torch.Generator().manual_seed(100 + worker)
    return [[scale * torch.randn(e - s, generator=g) for s, e, _ in segs] for _, segs in BUCKETS]


def _shards(params):
    shards = []
    for index, ((numel, segs), mains) in enumerate(zip(BUCKETS, params)):
        shards.append(BucketShard(
            numel=numel, mains=mains, local_ranges=[(s, e) for s, e, _ in segs],
            segments=[(s, e, layer, True) for s, e, layer in segs],
            bucket_layers={layer for _, _, layer in segs}, index=index,
        ))
    return shards


def _worker(worker, world, local, gta=None, mode="layerwise", syncs=1, faults=None, state_kwargs=None):
    params = _initial()
    shards = _shards(params)
    state = OuterState(OuterOptimizerConfig(**OUTER), **(state_kwargs or {}))
    state.capture(shards)
    reports = []
    sync = OuterSync([[shards[i] for i in g] for g in GROUPS], LAYERS, world.group(worker),
                     FakeWorkerGroups(), LocalSGDConfig(**local), gta or GTAConfig(), state,
                     on_done=reports.append)
    for k in range(syncs):
        for mains, deltas in zip(params, _deltas(worker + 10 * k)):
            for m, d in zip(mains, deltas):
                m.add_(d)
        if faults and worker in faults:
            params[0][0].mul_(faults[worker])
        assert sync.start(step=k + 1, steps_since_last=1)
        if mode == "layerwise":
            sync.mark_pending()
            for index in range(len(GROUPS)):
                sync.complete_group(index)
        else:
            sync.complete(shards, write_model=False)
    assert not sync.in_progress
    return dict(params=[[m.clone() for m in mains] for mains in params],
                anchors=[s.anchor.clone() for s in shards], reports=reports,
                bytes=sync.sync_group.counters.payload_bytes, log=world.log[worker])


def _flat(per_bucket):
    return [torch.cat(mains) for mains in per_bucket]


def _reference(workers, syncs=1, weights_fn=None, clip=None):
    """EDiT's outer step on the flat parameters of each bucket, computed independently (with
    ``clip``: the mean's per-layer norm clipped to it)."""
    init = _flat(_initial())
    anchors = [a.clone() for a in init]
    opt = torch.optim.SGD(anchors, **OUTER["outer_optim_kwargs"])
    current = [[a.clone() for a in init] for _ in range(workers)]
    for k in range(syncs):
        for w in range(workers):
            for b, d in enumerate(_flat(_deltas(w + 10 * k))):
                current[w][b] += d
        deltas = [[anchors[b] - current[w][b] for b in range(len(BUCKETS))] for w in range(workers)]
        mean = []
        for b in range(len(BUCKETS)):
            total = deltas[0][b].clone()
            for w in range(1, workers):
                total += deltas[w][b]
            mean.append(total / workers)
        if clip is not None:
            norms = torch.zeros(len(LAYERS), dtype=torch.float64)
            for b, (_, segs) in enumerate(BUCKETS):
                for s, e, layer in segs:
                    norms[layer] += mean[b][s:e].double().pow(2).sum()
            coef = torch.clamp(clip / (norms.sqrt() + 1e-12), max=1.0)
            for b, (_, segs) in enumerate(BUCKETS):
                for s, e, layer in segs:
                    mean[b][s:e] *= float(coef[layer])
        for a, g in zip(anchors, mean):
            a.grad = g
        opt.step()
        current = [[a.clone() for a in anchors] for _ in range(workers)]
    return anchors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["layerwise", "step_end"])
def test_plain_mean_equals_the_reference_bitwise_and_replicas_are_identical(mode):
    world = FakeWorld(3)
    out = run_workers(world, _worker, world, dict(local_sgd_sync_interval=1, sync_mode=mode), None, mode, 2)
    expected = _reference(3, syncs=2)
    for r in out:
        for b, (numel, segs) in enumerate(BUCKETS):
            flat = torch.cat(r["params"][b])
            assert torch.equal(flat, expected[b][: flat.numel()])
            assert torch.equal(r["anchors"][b][: flat.numel()], flat)
            assert torch.equal(r["anchors"][b][flat.numel():], torch.zeros(numel - flat.numel()))
        # one fp32 all-reduce of every shard per sync (bytes a ring sends), and the all-gather
        # of every worker's per-layer norms (float64) that checks them before the exchange
        per_sync = sum(all_reduce_bytes(4 * n, 3) for n, _ in BUCKETS) + 2 * 8 * len(LAYERS)
        assert r["bytes"] == 2 * per_sync
        assert [rep.payload_bytes for rep in r["reports"]] == [per_sync] * 2
        assert r["log"] == out[0]["log"]


@pytest.mark.timeout(60)
def test_layerwise_keeps_the_next_group_in_flight():
    """Launch order: the first group at mark_pending, the second before the first completes."""
    world = FakeWorld(2)
    out = run_workers(world, _worker, world, dict(local_sgd_sync_interval=1), None, "layerwise", 1)
    # the per-layer norms' all-gather (5 layers), then the shards' exchanges in forward order
    assert out[0]["log"] == [("all_gather", 5), ("all_reduce_sum", 8), ("all_reduce_sum", 6), ("all_reduce_sum", 5)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["layerwise", "step_end"])
def test_penalty_weights_exclusion_and_clipping_equal_the_reference(mode):
    """Norm-softmax weights, a NaN worker excluded everywhere it is NaN, and per-layer clipping
    (layer 1 spans two bucket groups: its norm needs both) against a hand computation."""
    world = FakeWorld(3)
    local = dict(local_sgd_sync_interval=1, sync_mode=mode, skip_anomaly=True, ewma_warmup_steps=100,
                 pseudo_gradnorm_reduce=True, clip_pseudo_grad=1.5)
    out = run_workers(world, _worker, world, local, None, mode, 1, {2: float("nan")})
    # Reference: per-layer norms of each worker's Delta; worker 2 is NaN in layer 0 only.
    init = _flat(_initial())
    deltas = []
    for w in range(3):
        cur = [i + d for i, d in zip(init, _flat(_deltas(w)))]
        if w == 2:
            cur[0][0:3] *= float("nan")
        deltas.append([i - c for i, c in zip(init, cur)])
    def layer_values(delta, layer):
        return torch.cat([delta[b][s:e] for b, (_, segs) in enumerate(BUCKETS) for s, e, l in segs if l == layer])
    norms = torch.tensor([[layer_values(deltas[w], l).double().norm().item() for l in range(5)] for w in range(3)])
    excluded = ~torch.isfinite(norms)
    weights = penalty.averaging_weights(norms, excluded, weighted=True)
    assert out[0]["reports"][0].excluded.tolist() == excluded.tolist()
    assert torch.allclose(out[0]["reports"][0].weights, weights)
    avg = []
    for b, (numel, segs) in enumerate(BUCKETS):
        total = torch.zeros(numel)
        for w in range(3):
            d = torch.cat([deltas[w][b], torch.zeros(numel - deltas[w][b].numel())])
            for s, e, l in segs:
                f = float(weights[w, l])
                d[s:e] = 0.0 if f == 0.0 else d[s:e] * f
            total += d
        avg.append(total)
    avg_norms = torch.tensor([layer_values(avg, l).double().norm().item() for l in range(5)])
    coef = penalty.clip_coefficients(avg_norms, 1.5)
    assert (coef < 1).any() and torch.allclose(out[0]["reports"][0].clip_coef.double(), coef)
    for b, (_, segs) in enumerate(BUCKETS):
        for s, e, l in segs:
            avg[b][s:e] *= float(coef[l])
    anchors = [torch.cat([i, torch.zeros(n - i.numel())]) for i, (n, _) in zip(init, BUCKETS)]
    opt = torch.optim.SGD(anchors, **OUTER["outer_optim_kwargs"])
    for a, g in zip(anchors, avg):
        a.grad = g
    opt.step()
    for r in out:
        for b in range(len(BUCKETS)):
            assert torch.allclose(r["anchors"][b], anchors[b], atol=1e-6, rtol=1e-6)
            assert torch.equal(r["anchors"][b], out[0]["anchors"][b])  # replicas identical


@pytest.mark.timeout(600)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["layerwise", "step_end"])
def test_clipped_plain_mean_equals_the_reference(mode, compiled):
    """Clipping of the plain mean. Compiled (the GPU's path, built here by inductor for the CPU):
    the exchanged sum goes to the kernel undivided, the norms are the sum's / workers and each
    layer's clip factor / workers is the kernel's scale (no pass of its own)."""
    if compiled:
        pytest.importorskip("torch._inductor")
    world = FakeWorld(3)
    local = dict(local_sgd_sync_interval=1, sync_mode=mode, clip_pseudo_grad=2.0)
    out = run_workers(world, _worker, world, local, None, mode, 2, None, dict(compile=compiled))
    expected = _reference(3, syncs=2, clip=2.0)
    assert (out[0]["reports"][0].clip_coef < 1).any() and (out[0]["reports"][0].clip_coef == 1).any()
    for r in out:
        for b, (numel, _) in enumerate(BUCKETS):
            flat = torch.cat(r["params"][b])
            assert torch.allclose(flat, expected[b][: flat.numel()], atol=1e-6, rtol=1e-6)
            assert torch.equal(r["anchors"][b][flat.numel():], torch.zeros(numel - flat.numel()))
            assert torch.equal(r["anchors"][b], out[0]["anchors"][b])  # replicas identical


@pytest.mark.timeout(60)
def test_gta_sparsified_replicas_are_identical_and_follow_the_consensus():
    world = FakeWorld(3)
    gta = GTAConfig(reducer="gta", consensus_method="count", sparsification_method="magnitude",
                    density=0.5, int8_mask=True)
    out = run_workers(world, _worker, world, dict(local_sgd_sync_interval=1), gta, "layerwise", 2)
    for r in out[1:]:
        for a, b in zip(r["anchors"], out[0]["anchors"]):
            assert torch.equal(a, b)
    # phase 1 (int8 signs) then phase 2 (entries + one-byte masks) per bucket, per sync
    names = [n for n, _ in out[0]["log"]]
    assert names.count("all_reduce_sum") == 2 * 3 * 3


def test_a_worker_issuing_another_collective_is_caught_not_deadlocked():
    world = FakeWorld(2, timeout=5)

    def fn(worker):
        g = world.group(worker)
        g.all_reduce_sum(torch.zeros(3 if worker == 0 else 4), async_op=False)

    with pytest.raises(CollectiveMismatch):
        run_workers(world, fn)


# ---------------------------------------------------------------- quantized exchange
from megatron_edit.algorithm import quantize  # noqa: E402


def _quantized_reference(workers, dtype, block=4, syncs=1, error_feedback=False):
    """Independent: each worker quantizes its chunk-wise Delta (+ residual), the owner of a chunk
    adds the decoded versions in worker order, divides by the workers, requantizes (+ its
    residual); everyone applies the decoded result."""
    init = _flat(_initial())
    anchors = [torch.cat([a, torch.zeros(n - a.numel())]) for a, (n, _) in zip(init, BUCKETS)]
    opt = torch.optim.SGD(anchors, **OUTER["outer_optim_kwargs"])
    current = [[a.clone() for a in anchors] for _ in range(workers)]
    residual = [[torch.zeros(n) for n, _ in BUCKETS] for _ in range(workers)]
    chunk_residual = [[None for _ in BUCKETS] for _ in range(workers)]
    applied_total = [torch.zeros(n) for n, _ in BUCKETS]
    true_total = [torch.zeros(n) for n, _ in BUCKETS]
    for k in range(syncs):
        for w in range(workers):
            for b, d in enumerate(_flat(_deltas(w + 10 * k))):
                current[w][b][: d.numel()] += d
        grads = []
        for b, (numel, _) in enumerate(BUCKETS):
            # a worker's chunk cut into as many equal blocks as blocks of ``block`` it needs,
            # each even (int4: two per byte)
            per_worker = -(-numel // workers)
            block_b = -(-per_worker // -(-per_worker // block))
            block_b += block_b % 2
            sizes = quantize.split_sizes(numel, workers, dtype, block_b)
            offsets = [sum(sizes[:c]) for c in range(workers)]
            per = max(sizes)
            result = torch.zeros(numel)
            true = sum((anchors[b] - current[w][b] for w in range(workers)), torch.zeros(numel)) / workers
            true_total[b] += true
            # a shard whose quantized chunks (all-to-all + all-gather) would send more than the
            # fp32 all-reduce goes in fp32: its exact sum over workers, divided
            fp32_bytes = 2 * (workers - 1) * 4 * numel // workers
            if 2 * (workers - 1) * quantize.encoded_bytes(per, dtype, block_b) > fp32_bytes:
                total = torch.zeros(numel)
                for w in range(workers):
                    total += anchors[b] - current[w][b]
                result = total / workers
                applied_total[b] += result
                grads.append(result)
                continue
            for c, (o, n) in enumerate(zip(offsets, sizes)):
                total = torch.zeros(n)
                for w in range(workers):
                    x = (anchors[b] - current[w][b])[o:o + n] + (residual[w][b][o:o + n] if error_feedback else 0)
                    padded = torch.cat([x, torch.zeros(per - n)])
                    got = quantize.decode(quantize.encode(padded, dtype, block_b), per, dtype, block_b)[:n]
                    if error_feedback:
                        residual[w][b][o:o + n] = x - got
                    total += got
                total /= workers
                if error_feedback:
                    if chunk_residual[c][b] is None:
                        chunk_residual[c][b] = torch.zeros(n)
                    total += chunk_residual[c][b]
                padded = torch.cat([total, torch.zeros(per - n)])
                got = quantize.decode(quantize.encode(padded, dtype, block_b), per, dtype, block_b)[:n]
                if error_feedback:
                    chunk_residual[c][b] = total - got
                result[o:o + n] = got
            applied_total[b] += result
            grads.append(result)
        for a, g in zip(anchors, grads):
            a.grad = g
        opt.step()
        current = [[a.clone() for a in anchors] for _ in range(workers)]
    return anchors, applied_total, true_total


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("error_feedback", [False, True], ids=["no-ef", "ef"])
def test_quantized_exchange_equals_an_independent_quantize_sum_dequantize(dtype, error_feedback):
    world = FakeWorld(3)
    local = dict(local_sgd_sync_interval=1, exchange_dtype=dtype, exchange_error_feedback=error_feedback)
    if dtype != "bf16":
        local["exchange_block_size"] = 4  # several blocks per chunk
    out = run_workers(world, _worker, world, local, None, "layerwise", 2)
    expected, _, _ = _quantized_reference(3, dtype, syncs=2, error_feedback=error_feedback)
    for r in out:
        for b in range(len(BUCKETS)):
            assert torch.equal(r["anchors"][b], out[0]["anchors"][b])  # the same bytes everywhere
            assert torch.allclose(r["anchors"][b], expected[b], rtol=1e-6, atol=1e-6), (dtype, b)
    assert out[0]["reports"][0].exchange_dtype == dtype
    assert out[0]["reports"][0].quantization_error is not None


def test_error_feedback_keeps_the_sum_of_applied_updates_within_one_quantum():
    """Over many syncs the sum of what was applied follows the sum of the true means: the
    difference is the residuals (at most half a quantum of each stage), it does not grow."""
    _, applied, true = _quantized_reference(3, "int4", block=4, syncs=12, error_feedback=True)
    _, applied_no, true_no = _quantized_reference(3, "int4", block=4, syncs=12, error_feedback=False)
    for b in range(len(BUCKETS)):
        with_ef = (applied[b] - true[b]).abs().max()
        without = (applied_no[b] - true_no[b]).abs().max()
        # int4: scale = amax / 7; per stage at most half a quantum; the deltas are O(1)
        bound = 2 * (true[b].abs().max() + 3) / 7
        assert with_ef <= bound, (b, float(with_ef), float(bound))
        # bucket 2 (5 elements over 3 workers) goes in fp32: exact either way
        assert with_ef < without or (b == 2 and with_ef == without == 0), (b, float(with_ef), float(without))


def _bytes_worker(worker, world, dtype, numel, local=None):
    g = torch.Generator().manual_seed(worker)
    main = torch.randn(numel, generator=g)
    shard = BucketShard(numel=numel, mains=[main], local_ranges=[(0, numel)], segments=[(0, numel, 0, True)],
                        bucket_layers={0})
    state = OuterState(OuterOptimizerConfig(**OUTER))
    state.capture([shard])
    reports = []
    sync = OuterSync([[shard]], ["l0"], world.group(worker), FakeWorkerGroups(),
                     LocalSGDConfig(local_sgd_sync_interval=1, exchange_dtype=dtype, **(local or {})), GTAConfig(), state,
                     on_done=reports.append)
    main.add_(torch.randn(numel, generator=g))
    sync.start(step=1, steps_since_last=1)
    sync.complete([shard], write_model=False)
    return reports[0].payload_bytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [2, 4])
def test_quantized_bytes_per_sync(workers):
    """Bytes a rank sends per sync (a ring's bytes on the wire), scales included: int8 at most
    0.30x and int4 at most 0.16x those of the fp32 all-reduce, for any number of workers."""
    numel = 64 * 1024
    sent = {}
    for dtype in ("fp32", "int8", "int4"):
        world = FakeWorld(workers)
        sent[dtype] = run_workers(world, _bytes_worker, world, dtype, numel)[0]
    assert sent["fp32"] == all_reduce_bytes(4 * numel, workers) + (workers - 1) * 8  # + the norms' all-gather
    assert sent["int8"] / sent["fp32"] <= 0.30 and sent["int4"] / sent["fp32"] <= 0.16
    assert sent["int8"] / sent["fp32"] == pytest.approx((1 + 4 / 256) / 4, rel=1e-3)
