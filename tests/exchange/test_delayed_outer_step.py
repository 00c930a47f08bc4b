"""The delayed outer step (``outer_step_delay`` tau, ``outer_merge_alpha`` alpha) on fake
collectives: workers as threads, no Megatron.

Each worker moves its parameters (its local steps up to the launch), the sync is started and
every group's exchange launched, the worker moves again (the tau inner steps while the exchange
is in flight), then the exchange is completed with the merge. Two rounds, so the second
pseudo-gradient starts from the merged parameters and the outer momentum is used. Checked
against an independent computation: the mean, the penalty's weighted mean, the int8
exchange with error feedback, or the top-k exchange (error feedback on by default) of ``Delta_m = anchor - theta_{m,launch}``, a torch Nesterov SGD
step of the anchor, then ``theta_m <- alpha theta_{m,apply} + (1 - alpha) anchor'``."""

import pytest
import torch

from fake_groups import FakeWorkerGroups, FakeWorld, run_workers
from megatron_edit.algorithm import penalty, quantize, topk
from megatron_edit.config import GTAConfig, LocalSGDConfig, OuterOptimizerConfig
from megatron_edit.exchange.outer_state import OuterState
from megatron_edit.exchange.outer_sync import OuterSync
from megatron_edit.exchange.shard import BucketShard

# (numel, [(start, end, layer)]) per bucket; groups: [bucket 0], [buckets 1, 2]; padding at the end
BUCKETS = [(8, [(0, 3, 0), (3, 6, 1)]), (6, [(0, 2, 1), (2, 5, 2)]), (40, [(0, 36, 3), (36, 38, 4)])]
GROUPS = [[0], [1, 2]]
LAYERS = ["l0", "l1", "l2", "l3", "l4"]
KW = dict(lr=0.7, momentum=0.9, nesterov=True)
WORKERS, ROUNDS, TAU, H = 3, 2, 2, 4
CASES = {
    "mean": dict(),
    "penalty": dict(pseudo_gradnorm_reduce=True),
    "int8-ef": dict(exchange_dtype="int8", exchange_error_feedback=True, exchange_block_size=4),
    # the sparse exchange: 5% of chunks of 64 (k = 1 or 2 here), int2 values, error feedback by default
    "topk-ef": dict(exchange_dtype="int2", exchange_topk_density=0.05, exchange_topk_chunk=64),
}


def _randn(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [[scale * torch.randn(e - s, generator=g) for s, e, _ in segs] for _, segs in BUCKETS]


def _padded(per_param):
    """Flat shard-length tensors (0 in the padding) from per-parameter values."""
    return [torch.cat(list(p) + [torch.zeros(n - sum(x.numel() for x in p))]) for p, (n, _) in zip(per_param, BUCKETS)]


def _worker(worker, world, local, alpha, gta=None, state_kwargs=None, blocking=False):
    """``blocking``: the same syncs without a delay (launch and apply at once, no drift).
    ``alpha`` "keep": the keep_local merge rule."""
    if alpha == "keep":
        local, alpha = dict(local, outer_merge_rule="keep_local"), 0.0
    params = _randn(0)
    shards = [BucketShard(numel=n, mains=mains, local_ranges=[(s, e) for s, e, _ in segs],
                          segments=[(s, e, layer, True) for s, e, layer in segs],
                          bucket_layers={layer for _, _, layer in segs}, index=i)
              for i, ((n, segs), mains) in enumerate(zip(BUCKETS, params))]
    state = OuterState(OuterOptimizerConfig(outer_optim_kwargs=KW), **(state_kwargs or {}))
    state.capture(shards)
    reports, merged, owned = [], [], []
    sync = OuterSync([[shards[i] for i in g] for g in GROUPS], LAYERS, world.group(worker), FakeWorkerGroups(),
                     LocalSGDConfig(local_sgd_sync_interval=H, outer_step_delay=0 if blocking else TAU,
                                    outer_merge_alpha=None if blocking else alpha, **local), gta or GTAConfig(), state,
                     on_done=reports.append)
    for k in range(ROUNDS):
        for mains, moves in zip(params, _randn(100 + worker + 10 * k)):  # local steps up to the launch
            for m, d in zip(mains, moves):
                m.add_(d)
        assert sync.start(step=(k + 1) * H, steps_since_last=H, delay=0 if blocking else TAU)
        if blocking:
            sync.complete(shards, write_model=False)
            merged.append(_padded([[m.clone() for m in mains] for mains in params]))
            continue
        for group in sync.groups:
            sync.launch(group)
        # the sync owns every buffer its collectives use until complete() waits for them
        owned.append(all(sync._sync.of(s).flight is not None and sync._sync.of(s).delta is not None for s in shards))
        sync.advance()  # as the controller does one step after the launch: the second phases start
        for mains, moves in zip(params, _randn(500 + worker + 10 * k, 0.3)):  # tau inner steps meanwhile
            for m, d in zip(mains, moves):
                m.add_(d)
        sync.complete(shards, write_model=False, merge_alpha=alpha)
        merged.append(_padded([[m.clone() for m in mains] for mains in params]))
    assert not sync.in_progress
    return dict(merged=merged, anchors=[s.anchor.clone() for s in shards], reports=reports, owned=owned,
                log=world.log[worker])


def _layer_norms(delta):
    norms = torch.zeros(len(LAYERS), dtype=torch.float64)
    for b, (_, segs) in enumerate(BUCKETS):
        for s, e, layer in segs:
            norms[layer] += delta[b][s:e].double().pow(2).sum()
    return norms.sqrt()


def _int8_ef(deltas, residual, chunk_residual, b):
    """Independent int8 exchange with error feedback of bucket b (quantize per chunk, sum,
    divide, requantize), as in test_outer_sync's reference."""
    numel = BUCKETS[b][0]
    per_worker = -(-numel // WORKERS)
    block = -(-per_worker // -(-per_worker // 4))  # equal blocks of at most 4 per chunk, even
    block += block % 2
    sizes = quantize.split_sizes(numel, WORKERS, "int8", block)
    per, out, offset = max(sizes), torch.zeros(numel), 0
    if 2 * (WORKERS - 1) * quantize.encoded_bytes(per, "int8", block) > 2 * (WORKERS - 1) * 4 * numel // WORKERS:
        return sum((d[b] for d in deltas), torch.zeros(numel)) / WORKERS  # too small to pay: fp32
    for c, n in enumerate(sizes):
        total = torch.zeros(n)
        for w in range(WORKERS):
            x = deltas[w][b][offset:offset + n] + residual[w][b][offset:offset + n]
            got = quantize.decode(quantize.encode(torch.cat([x, torch.zeros(per - n)]), "int8", block), per, "int8",
                                  block)[:n]
            residual[w][b][offset:offset + n] = x - got
            total += got
        total = total / WORKERS + chunk_residual[b].get(c, torch.zeros(n))
        got = quantize.decode(quantize.encode(torch.cat([total, torch.zeros(per - n)]), "int8", block), per, "int8",
                              block)[:n]
        chunk_residual[b][c] = total - got
        out[offset:offset + n] = got
        offset += n
    return out


def _topk_ef(deltas, residual, b):
    """Independent top-k exchange with error feedback of bucket b: every worker sends the
    top-k of Delta + residual (the codec) and keeps the rest; the sum in worker order / W."""
    numel = BUCKETS[b][0]
    chunk = max(2, min(64, numel))
    payload = topk.encoded_bytes(numel, 0.05, chunk, "int2")
    if (WORKERS - 1) * payload > 2 * (WORKERS - 1) * 4 * numel // WORKERS:
        return sum((d[b] for d in deltas), torch.zeros(numel)) / WORKERS  # too small to pay: fp32
    total = torch.zeros(numel)
    for w in range(WORKERS):
        x = deltas[w][b] + residual[w][b]
        got = topk.decode(topk.encode(x, 0.05, chunk, "int2"), numel, 0.05, chunk, "int2")
        residual[w][b] = x - got
        total += got
    return total / WORKERS


def _reference(case, alpha):
    """Per round: anchors after the outer step and every worker's merged parameters."""
    anchors = _padded(_randn(0))
    opt = torch.optim.SGD(anchors, **KW)
    theta = [[a.clone() for a in anchors] for _ in range(WORKERS)]
    residual = [[torch.zeros(n) for n, _ in BUCKETS] for _ in range(WORKERS)]
    chunk_residual = [{} for _ in BUCKETS]  # per bucket: chunk -> what requantization dropped
    rounds = []
    for k in range(ROUNDS):
        for w in range(WORKERS):
            theta[w] = [t + d for t, d in zip(theta[w], _padded(_randn(100 + w + 10 * k)))]
        deltas = [[a - t for a, t in zip(anchors, theta[w])] for w in range(WORKERS)]  # at the launch
        grads = []
        if case == "penalty":
            weights = penalty.averaging_weights(torch.stack([_layer_norms(d) for d in deltas]), None, True, 1.0)
        for b, (numel, segs) in enumerate(BUCKETS):
            if case == "int8-ef":
                grads.append(_int8_ef(deltas, residual, chunk_residual, b))
                continue
            if case == "topk-ef":
                grads.append(_topk_ef(deltas, residual, b))
                continue
            total = torch.zeros(numel)
            for w in range(WORKERS):
                d = deltas[w][b].clone()
                if case == "penalty":
                    for s, e, layer in segs:
                        d[s:e] *= float(weights[w, layer])
                total += d
            grads.append(total if case == "penalty" else total / WORKERS)
        for a, g in zip(anchors, grads):
            a.grad = g
        opt.step()
        for w in range(WORKERS):  # the tau inner steps, then the merge
            moved = [t + d for t, d in zip(theta[w], _padded(_randn(500 + w + 10 * k, 0.3)))]
            if alpha == "keep":  # the new anchor plus the progress since the launch
                theta[w] = [m + (a - t) for m, a, t in zip(moved, anchors, theta[w])]
            else:
                theta[w] = [alpha * t + (1 - alpha) * a for t, a in zip(moved, anchors)]
        rounds.append(([a.detach().clone() for a in anchors], [[t.clone() for t in th] for th in theta]))
    return rounds


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, "keep"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_delayed_outer_step_and_merge_equal_the_formula(case, alpha):
    """alpha 0, 0.25 and 0.5: the lerp rule (0.25: alpha and 1 - alpha swapped would give 0.75,
    where 0.5 cannot tell them apart); "keep": keep_local, theta <- theta + anchor' - theta_launch."""
    world = FakeWorld(WORKERS)
    out = run_workers(world, _worker, world, CASES[case], alpha)
    expected = _reference(case, alpha)
    anchors, theta = expected[-1]
    # the same sums in the same order: bit for bit (lerp and the formula may differ in the last bit)
    exact = case == "mean" and alpha == 0.0
    for w, r in enumerate(out):
        assert r["owned"] == [True] * ROUNDS
        assert r["log"] == out[0]["log"]  # the same collectives in the same order on every worker
        for b in range(len(BUCKETS)):
            assert torch.equal(r["anchors"][b], out[0]["anchors"][b])  # anchors identical everywhere
            if exact:
                assert torch.equal(r["anchors"][b], anchors[b])
            else:
                assert torch.allclose(r["anchors"][b], anchors[b], rtol=1e-5, atol=1e-6), (case, b)
            for k in range(ROUNDS):
                got, want = r["merged"][k][b], expected[k][1][w][b]
                if exact:
                    assert torch.equal(got, want)
                else:
                    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (case, alpha, k, b)
                if alpha == 0.0:  # every worker takes the new anchor: replicas identical
                    assert torch.equal(got, out[0]["merged"][k][b])
                    assert torch.equal(got, expected[k][0][b] if exact else got)
        assert [(rep.step, rep.delay, rep.steps_since_last) for rep in r["reports"]] == [(H, TAU, H), (2 * H, TAU, H)]
        scalars = r["reports"][0].scalars()
        assert scalars["local-sgd/outer-step-delay"] == TAU and scalars["local-sgd/exposed-wait-seconds"] >= 0
    if alpha != 0.0:  # the merge keeps (half of) each worker's own drift: replicas differ
        assert not torch.equal(out[0]["merged"][0][0], out[1]["merged"][0][0])


@pytest.mark.timeout(60)
def test_alpha_one_keeps_the_worker_and_zero_takes_the_anchor_on_separate_mains():
    """The merge on a shard without a flat main tensor (per-main views) and with padding."""
    for alpha in (0.0, 1.0, 0.25):
        mains = [torch.randn(3), torch.randn(2)]
        before = [m.clone() for m in mains]
        shard = BucketShard(numel=6, mains=mains, local_ranges=[(0, 3), (3, 5)], segments=[(0, 3, 0, True), (3, 5, 0, True)])
        shard.anchor = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 0.0])
        OuterState._merge(shard, alpha, write_model=False)
        want = [alpha * b + (1 - alpha) * shard.anchor[s:e] for b, (s, e) in zip(before, shard.local_ranges)]
        for m, v in zip(mains, want):
            assert torch.allclose(m, v, rtol=0, atol=1e-6)
            if alpha in (0.0, 1.0):
                assert torch.equal(m, v)


@pytest.mark.timeout(60)
def test_alpha_one_keeps_the_worker_and_a_quarter_keeps_a_quarter_on_flat_mains():
    """The merge on a shard whose mains are views of one flat fp32 tensor (Megatron's fp32
    params), with a gap and padding: alpha 1 leaves the worker's parameters as they are, 0.25
    keeps a quarter of them and takes three quarters of the anchor, 0 takes the anchor; the gap
    and the padding stay 0."""
    ranges = [(0, 3), (4, 6)]  # a gap at 3, padding at 6..8
    for alpha in (0.0, 0.25, 1.0):
        flat = torch.zeros(8)
        flat[0:3], flat[4:6] = torch.randn(3), torch.randn(2)
        before = flat.clone()
        shard = BucketShard(numel=8, mains=[flat[s:e] for s, e in ranges], local_ranges=ranges,
                            segments=[(s, e, 0, True) for s, e in ranges], flat_mains=flat)
        shard.anchor = torch.tensor([1.0, 2.0, 3.0, 0.0, 5.0, 6.0, 0.0, 0.0])
        OuterState._merge(shard, alpha, write_model=False)
        want = alpha * before + (1 - alpha) * shard.anchor
        assert torch.allclose(flat, want, rtol=0, atol=1e-6), (alpha, flat, want)
        assert torch.equal(flat[3:4], torch.zeros(1)) and torch.equal(flat[6:], torch.zeros(2))
        if alpha == 1.0:
            assert torch.equal(flat, before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["gta", "cpu-offload", "clip-penalty"])
def test_delay_changes_only_when_the_exchange_is_applied(variant):
    """GTA (two phases), the paged state of cpu_offload, clipping with the penalty's weights and
    anomaly detector: the first anchor of a delayed run equals the blocking run's from the same launch
    parameters, bit for bit, and alpha = 0 gives every worker that anchor."""
    gta = local = state_kwargs = None
    if variant == "gta":
        gta = GTAConfig(reducer="gta", consensus_method="sum", sparsification_method="magnitude", density=0.5)
    elif variant == "cpu-offload":
        state_kwargs = dict(paged=True)
    else:
        local = dict(clip_pseudo_grad=0.5, skip_anomaly=True, ewma_warmup_steps=0, pseudo_gradnorm_reduce=True)
    out = {}
    for blocking in (False, True):
        world = FakeWorld(WORKERS)
        out[blocking] = run_workers(world, _worker, world, local or {}, 0.0, gta, state_kwargs, blocking)
    for w in range(WORKERS):
        delayed, blocking = out[False][w], out[True][w]
        assert [r.delay for r in delayed["reports"]] == [TAU] * ROUNDS and blocking["reports"][0].delay == 0
        assert delayed["log"] == blocking["log"]  # the same collectives, in the same order
        for b in range(len(BUCKETS)):
            assert torch.equal(delayed["merged"][0][b], blocking["merged"][0][b])  # round 1: anchor'
            assert torch.equal(delayed["merged"][1][b], out[False][0]["merged"][1][b])  # replicas
