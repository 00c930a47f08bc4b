"""The sparse (top-k) exchange (megatron_edit.exchange.sparse) inside a sync, driven by fake
collectives: against an independent simulation of top-k + error feedback + the sum in worker
order, with the penalty's weights and clipping, non-finite pseudo-gradients, skipped layers,
the bytes sent and the refusal where a dense int4 exchange would send fewer."""

import pytest
import torch

from fake_groups import FakeWorkerGroups, FakeWorld, run_workers
from megatron_edit.algorithm import penalty, topk, wire
from megatron_edit.config import ConfigError, GTAConfig, LocalSGDConfig, OuterOptimizerConfig
from megatron_edit.exchange.groups import all_reduce_bytes
from megatron_edit.exchange.outer_state import OuterState
from megatron_edit.exchange.outer_sync import NonFinitePseudoGradient, OuterSync
from megatron_edit.exchange.shard import BucketShard
from megatron_edit.exchange.sparse import SparseExchange

# (numel, [(start, end, layer)]) per bucket; groups: [bucket 0], [buckets 1, 2]. Bucket 2 is so
# small that its payloads would send more than the fp32 all-reduce: it goes in fp32.
BUCKETS = [
    (300, [(0, 100, 0), (100, 290, 1)]),  # 290..300 padding; chunks of 64, the last one partial
    (150, [(0, 40, 1), (40, 140, 2), (140, 150, 3)]),  # layer 1 spans buckets 0 and 1
    (3, [(0, 2, 3), (2, 3, 4)]),
]
GROUPS = [[0], [1, 2]]
LAYERS = ["l0", "l1", "l2", "l3", "l4"]
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
D, C = 0.05, 64  # k = 4 of every 64 entries, indices in 6 bits
TOPK = dict(local_sgd_sync_interval=1, exchange_topk_density=D, exchange_topk_chunk=C)


def _initial():
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(e - s, generator=g) for s, e, _ in segs] for _, segs in BUCKETS]


def _deltas(seed):
    g = torch.Generator().manual_seed(100 + seed)
    return [[torch.randn(e - s, generator=g) for s, e, _ in segs] for _, segs in BUCKETS]


def _shards(params):
    return [BucketShard(numel=numel, mains=mains, local_ranges=[(s, e) for s, e, _ in segs],
                        segments=[(s, e, layer, True) for s, e, layer in segs],
                        bucket_layers={layer for _, _, layer in segs}, index=index)
            for index, ((numel, segs), mains) in enumerate(zip(BUCKETS, params))]


def _padded(per_bucket):
    return [torch.cat([torch.cat(m), torch.zeros(n - torch.cat(m).numel())]) for m, (n, _) in zip(per_bucket, BUCKETS)]


def _worker(worker, world, local, mode="layerwise", syncs=1, nan_workers=(), nan_syncs=()):
    params = _initial()
    shards = _shards(params)
    state = OuterState(OuterOptimizerConfig(**OUTER))
    state.capture(shards)
    initial = [s.anchor.clone() for s in shards]
    reports, residuals, anchors, error = [], [], [], None
    sync = OuterSync([[shards[i] for i in g] for g in GROUPS], LAYERS, world.group(worker), FakeWorkerGroups(),
                     LocalSGDConfig(**local), GTAConfig(), state, on_done=reports.append)
    for k in range(syncs):
        for mains, deltas in zip(params, _deltas(worker + 10 * k)):
            for m, d in zip(mains, deltas):
                m.add_(d)
        if worker in nan_workers and k in nan_syncs:
            params[0][0][1] = float("nan")
        try:
            sync.start(step=k + 1, steps_since_last=1)
            if mode == "layerwise":
                sync.mark_pending()
                for index in range(len(GROUPS)):
                    sync.complete_group(index)
            else:
                sync.complete(shards, write_model=False)
        except NonFinitePseudoGradient as e:
            error = str(e)
            break
        residuals.append([None if s.residual is None else s.residual.clone() for s in shards])
        anchors.append([s.anchor.clone() for s in shards])
    return dict(error=error, anchors=anchors, initial=initial, reports=reports, residuals=residuals,
                params=[torch.cat(m) for m in params], in_progress=sync.in_progress,
                bytes=[r.payload_bytes for r in reports], chunk_residuals=[s.chunk_residual for s in shards])


def _goes_sparse(numel, workers, density, chunk, dtype):
    """The rule of the exchange, written out: the payloads (W - 1 of them through each rank of
    a ring all-gather) against the fp32 all-reduce."""
    payload = topk.encoded_bytes(numel, density, max(2, min(chunk, numel)), dtype)
    return (workers - 1) * payload <= 2 * (workers - 1) * 4 * numel / workers


def _simulate(workers, density, chunk, dtype, syncs, weights_of=None, clip_tau=None, error_feedback=True):
    """Independent: every worker adds its residual to its (weighted) Delta, keeps the top-k of
    each chunk (the codec, tested on its own against an independent decoder), keeps what it did
    not send; the sent tensors are added in worker order (divided by the workers for the plain
    mean; ``weights_of[k]``: sync k's [W, L] weights, a weighted sum), clipped per layer to
    ``clip_tau``; torch's Nesterov SGD steps the anchors."""
    anchors = _padded(_initial())
    opt = torch.optim.SGD(anchors, **OUTER["outer_optim_kwargs"])
    current = [[a.clone() for a in anchors] for _ in range(workers)]
    residual = [[torch.zeros(n) for n, _ in BUCKETS] for _ in range(workers)]
    history = []
    for k in range(syncs):
        for w in range(workers):
            for b, d in enumerate(_deltas(w + 10 * k)):
                flat = torch.cat(d)
                current[w][b][: flat.numel()] += flat
        grads = []
        for b, (numel, segs) in enumerate(BUCKETS):
            total = torch.zeros(numel)
            for w in range(workers):
                x = anchors[b] - current[w][b]
                if weights_of is not None:
                    for s, e, layer in segs:
                        weight = float(weights_of[k][w, layer])
                        x[s:e] = 0.0 if weight == 0 else x[s:e] * weight  # excluded: even NaN is 0
                if not _goes_sparse(numel, workers, density, chunk, dtype):
                    total += x
                    continue
                if error_feedback:
                    x = x + residual[w][b]
                c = max(2, min(chunk, numel))
                sent = topk.decode(topk.encode(x, density, c, dtype), numel, density, c, dtype)
                if error_feedback:
                    residual[w][b] = x - sent
                total += sent
            if weights_of is None:
                total /= workers
            grads.append(total)
        if clip_tau is not None:
            norms = torch.zeros(len(LAYERS), dtype=torch.float64)
            for b, (_, segs) in enumerate(BUCKETS):
                for s, e, layer in segs:
                    norms[layer] += grads[b][s:e].double().pow(2).sum()
            coef = penalty.clip_coefficients(norms.sqrt(), clip_tau)
            for b, (_, segs) in enumerate(BUCKETS):
                for s, e, layer in segs:
                    grads[b][s:e] *= float(coef[layer])
        for a, g in zip(anchors, grads):
            a.grad = g
        opt.step()
        current = [[a.clone() for a in anchors] for _ in range(workers)]
        history.append(([a.clone() for a in anchors], [[r.clone() for r in rs] for rs in residual]))
    return history


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["int2", "int4", "fp32"])
@pytest.mark.parametrize("mode", ["layerwise", "step_end"])
def test_sparse_exchange_equals_an_independent_simulation_and_replicas_are_identical(dtype, mode):
    """3 workers, 3 syncs, error feedback on by default: after every sync the anchors equal the
    simulation's (the same fp32 operations: bit for bit) and each other's, and every worker's
    residual is exactly what it did not send. Bucket 2 (3 elements) goes in fp32 (with int
    values, whose scale makes its payload larger than fp32's)."""
    world = FakeWorld(3)
    local = dict(TOPK, sync_mode=mode, exchange_dtype=dtype)
    out = run_workers(world, _worker, world, local, mode, 3)
    expected = _simulate(3, D, C, dtype, 3)
    # fp32 values: 3 elements send one 4-byte value and one index, no scale: just as much as fp32
    assert [_goes_sparse(n, 3, D, C, dtype) for n, _ in BUCKETS] == [True, True, dtype == "fp32"]
    for w, r in enumerate(out):
        for k, (anchors, residuals) in enumerate(expected):
            for b in range(len(BUCKETS)):
                assert torch.equal(r["anchors"][k][b], out[0]["anchors"][k][b]), (k, b)  # replicas
                assert torch.equal(r["anchors"][k][b], anchors[b]), (w, k, b)
                if _goes_sparse(BUCKETS[b][0], 3, D, C, dtype):
                    assert torch.equal(r["residuals"][k][b], residuals[w][b]), (w, k, b)
                else:  # exchanged exactly: nothing to carry
                    assert r["residuals"][k][b] is None
        assert r["chunk_residuals"] == [None] * 3
        rep = r["reports"][0]
        assert rep.quantization_error is not None and float(rep.quantization_error) > 0
    # the residuals differ between workers (each keeps what it did not send)
    assert not torch.equal(out[0]["residuals"][0][0], out[1]["residuals"][0][0])


@pytest.mark.timeout(60)
def test_without_error_feedback_what_was_not_sent_is_dropped():
    world = FakeWorld(2)
    local = dict(TOPK, exchange_dtype="int2", exchange_error_feedback=False)
    out = run_workers(world, _worker, world, local, "layerwise", 2)
    expected = _simulate(2, D, C, "int2", 2, error_feedback=False)
    for r in out:
        assert all(x is None for x in r["residuals"][-1])
        for b in range(len(BUCKETS)):
            assert torch.equal(r["anchors"][-1][b], expected[-1][0][b])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["layerwise", "step_end"])
def test_penalty_weights_exclusion_and_clipping_work_on_the_sparse_pseudo_gradients(mode):
    """Norm-softmax weights and a NaN worker excluded (decided on the dense pseudo-gradients'
    norms, as for every exchange: the same decisions as the fp32 exchange), each worker's
    weighted Delta sparsified with its residual, the weighted sum (not divided again) clipped
    per layer on the sparse result: the simulation's anchors, finite, the same on every worker."""
    penalty_cfg = dict(skip_anomaly=True, ewma_warmup_steps=100, pseudo_gradnorm_reduce=True, clip_pseudo_grad=1.5)
    runs = {}
    for name, extra in (("fp32", {}), ("topk", dict(TOPK, exchange_dtype="int2"))):
        world = FakeWorld(3)
        local = dict(dict(local_sgd_sync_interval=1, sync_mode=mode, **penalty_cfg), **extra)
        runs[name] = run_workers(world, _worker, world, local, mode, 2, {2}, {0})
    ref, got = runs["fp32"][0], runs["topk"]
    # the first sync's decisions (later ones start from different anchors)
    rep_ref, rep = ref["reports"][0], got[0]["reports"][0]
    assert torch.equal(rep.weights, rep_ref.weights) and torch.equal(rep.excluded, rep_ref.excluded)
    assert got[0]["reports"][0].excluded[2, 0] and got[0]["reports"][0].excluded.sum() == 1
    weights = [got[0]["reports"][k].weights for k in range(2)]
    expected = _simulate(3, D, C, "int2", 2, weights_of=weights, clip_tau=1.5)
    for r in got:
        for k in range(2):
            for b in range(len(BUCKETS)):
                assert torch.equal(r["anchors"][k][b], got[0]["anchors"][k][b])
                assert torch.isfinite(r["anchors"][k][b]).all()
                assert torch.allclose(r["anchors"][k][b], expected[k][0][b], rtol=1e-6, atol=1e-6), (k, b)
            assert all(torch.isfinite(x).all() for x in r["residuals"][k] if x is not None)
    assert (got[0]["reports"][0].clip_coef < 1).any()


@pytest.mark.timeout(60)
def test_a_non_finite_pseudo_gradient_stops_every_worker_before_anything_is_encoded():
    """As with the other formats: without anomaly elimination a NaN stops the sync on every
    worker before the exchange (only the norms' all-gather was issued), anchors untouched."""
    world = FakeWorld(3)
    out = run_workers(world, _worker, world, dict(TOPK, exchange_dtype="int2"), "layerwise", 1, {1}, {0})
    for r in out:
        assert r["error"] is not None and "worker 1 " in r["error"] and "--local-sgd-skip-anomaly" in r["error"]
        assert r["anchors"] == [] and not r["in_progress"]
    assert [name for name, _ in world.log[0]] == ["all_gather"]


@pytest.mark.timeout(60)
def test_error_feedback_is_kept_on_layers_every_worker_is_excluded_from():
    """At sync 2 every worker is NaN in layer 0, whose outer step is skipped: the residual
    carried there from sync 1 is still carried after sync 2 (nothing sent for it), while the
    other layers' residuals move on; everything stays finite."""
    world = FakeWorld(3)
    local = dict(TOPK, exchange_dtype="int2", skip_anomaly=True, ewma_warmup_steps=100)
    out = run_workers(world, _worker, world, local, "layerwise", 2, {0, 1, 2}, {1})
    (s0, e0, _), = [seg for seg in BUCKETS[0][1] if seg[2] == 0]
    for r in out:
        assert r["error"] is None and r["reports"][1].skipped[0] and not r["reports"][1].skipped[1:].any()
        res1, res2 = r["residuals"][0][0], r["residuals"][1][0]
        assert res1[s0:e0].abs().sum() > 0 and torch.equal(res2[s0:e0], res1[s0:e0])
        assert not torch.equal(res2[e0:], res1[e0:])
        assert all(torch.isfinite(x).all() for x in r["residuals"][1] if x is not None)
        assert torch.equal(r["anchors"][1][0][s0:e0], r["anchors"][0][0][s0:e0])  # layer 0 not stepped


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [2, 4])
def test_bytes_per_sync_are_the_payloads_all_gathered(workers):
    """Every rank sends W - 1 payloads per sparse shard (indices, values, scales) and the fp32
    all-reduce of the tiny one, plus the norms' all-gather; the byte model says the same."""
    world = FakeWorld(workers)
    out = run_workers(world, _worker, world, dict(TOPK, exchange_dtype="int2"), "layerwise", 1)
    norms = (workers - 1) * 8 * len(LAYERS)
    expected = norms
    for numel, _ in BUCKETS:
        if _goes_sparse(numel, workers, D, C, "int2"):
            expected += wire.format_wire_bytes(numel, f"topk{D}-int2", workers, chunk=C)
        else:
            expected += all_reduce_bytes(4 * numel, workers)
    assert [r["bytes"][0] for r in out] == [expected] * workers
    fp32 = sum(all_reduce_bytes(4 * n, workers) for n, _ in BUCKETS)
    assert (expected - norms) / fp32 < 0.2


def test_a_setting_where_dense_int4_sends_fewer_bytes_is_refused_naming_the_workers():
    """2% of 4096 in int2: the all-gather of 29 workers' payloads sends more than the dense int4
    exchange; 28 is still cheaper. The refusal names the flags and the worker count."""
    assert wire.dense_int4_cheaper_from(0.02, 4096, "int2") == 29
    SparseExchange(FakeWorld(28).group(0), 0.02, 4096, "int2", True)
    with pytest.raises(ConfigError) as info:
        SparseExchange(FakeWorld(29).group(0), 0.02, 4096, "int2", True)
    message = str(info.value)
    for part in ("--local-sgd-exchange-topk-density", "--local-sgd-exchange-dtype int4", "from 29 workers"):
        assert part in message, message
    # and a density that never pays off against int4 (every entry with its index) is refused at 2
    with pytest.raises(ConfigError, match="from 2 workers"):
        SparseExchange(FakeWorld(2).group(0), 1.0, 4096, "fp32", True)


class _QuorumOfTwo:
    """A torchft-like group seen from worker 0 (``dynamic``: its workers change between syncs):
    worker 1 has just healed, so it sends zeros and did not train (``contributors`` 1)."""

    dynamic = True

    def __init__(self, size=2, contributors=1):
        self.size, self.rank, self.contributors = size, 0, contributors

    def all_gather_into(self, output, tensor, async_op=True):
        output.zero_()
        output[: tensor.numel()].copy_(tensor)
        return _Waited()


class _Waited:
    def wait(self):
        return True


def test_over_a_changing_group_the_mean_is_over_the_workers_that_trained_and_the_size_is_checked_each_sync():
    """The torchft backend's group: a just-healed worker's zero payload does not dilute the mean
    (the divisor is ``contributors``, not the quorum's size), and a quorum that has grown to
    where dense int4 sends fewer bytes is refused at that sync, naming the flags."""
    group = _QuorumOfTwo()
    exchange = SparseExchange(group, D, C, "int2", True)
    shard = BucketShard(numel=300, mains=[], local_ranges=[], segments=[])
    delta = torch.randn(300, generator=torch.Generator().manual_seed(3))
    sent = topk.decode(topk.encode(delta.clone(), D, C, "int2"), 300, D, C, "int2")
    stage = exchange.launch(shard, delta.clone())
    zero_payload = torch.zeros(stage.payload_bytes, dtype=torch.uint8)
    assert torch.equal(stage.gathered[stage.payload_bytes:], zero_payload)
    result = torch.empty(300)
    exchange.finish(stage, result, mean=True)
    assert torch.equal(result, sent)  # divided by 1, not by 2
    group.size = wire.dense_int4_cheaper_from(D, C, "int2")
    with pytest.raises(ConfigError, match=f"from {group.size} workers"):
        exchange.launch(shard, delta.clone())
