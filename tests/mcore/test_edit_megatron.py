"""Synchronous EDiT on real megatron-core (CPU, gloo, 4 processes): numbers, not just runs."""

import pytest
import torch

from compare import max_difference
from dist import run_ranks
from edit_runs import ON_FSDP_RELEASE, default_spec, megatron_runs, simulate_edit

WORLD = 4
EDIT = dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=2)  # syncs after steps 5 and 8
# Megatron and the plain-PyTorch simulation reduce gradients in a different order; Adam
# amplifies that float noise to ~1e-5 after 2 steps and ~5e-5 after 8. A real difference in the
# algorithm is far larger: outer momentum 0.8 instead of 0.9 moves parameters by ~1.3e-2.
SIM_ATOL = 2e-4
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))


def _assert_params_close(a, b, atol, what):
    worst = max_difference(a, b)
    assert worst <= atol, f"{what}: max abs difference {worst:.3g} > {atol}"


def _assert_params_equal(a, b, what):
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.mark.timeout(240)
def test_edit_matches_plain_pytorch_simulation_in_both_modes():
    """2 workers x 2 shards, warmup 2, H=3, 8 steps (2 syncs), Nesterov outer SGD: layer-wise and
    step-end EDiT equal an independent plain-PyTorch simulation, and each other bit for bit."""
    specs = [
        default_spec(local_sgd=dict(EDIT, sync_mode=mode), outer=OUTER) for mode in ("layerwise", "step_end")
    ]
    results = run_ranks(megatron_runs, WORLD, specs, timeout=200)
    (sim,) = run_ranks(simulate_edit, 1, specs[0], WORLD, timeout=120)
    expected = sim["params"]
    for r in results:
        layerwise, step_end = r["runs"]
        assert [rep.step for rep in layerwise["reports"]] == [5, 8]
        assert [rep.step for rep in step_end["reports"]] == [5, 8]
        _assert_params_equal(layerwise["params"], step_end["params"], "layer-wise vs step-end")
        _assert_params_close(layerwise["params"], expected[layerwise["worker"]], SIM_ATOL, "EDiT vs simulation")
    # The last step was a sync: both workers hold the same parameters, and they moved.
    _assert_params_equal(results[0]["runs"][0]["params"], results[2]["runs"][0]["params"], "replicas")


@pytest.mark.timeout(240)
def test_one_worker_with_plain_outer_sgd_equals_ordinary_megatron():
    """Sync group of size 1, outer SGD lr 1 without momentum: EDiT is ordinary training."""
    plain = default_spec(instances=1, steps=6)
    edit = default_spec(
        instances=1,
        steps=6,
        local_sgd=dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1),
        outer=dict(outer_optim_class="sgd", outer_optim_kwargs=dict(lr=1.0)),
    )
    results = run_ranks(megatron_runs, WORLD, [plain, edit], timeout=200)
    for r in results:
        base, local = r["runs"]
        assert [rep.step for rep in local["reports"]] == [3, 5]
        assert all(rep.payload_bytes == 0 and rep.workers == 1 for rep in local["reports"])
        assert local["sync_group_ranks"] is None
        # anchor - 1.0 * (anchor - theta) rounds differently from theta by ~1e-7; Adam amplifies
        # that to ~1e-5 over the following steps.
        assert local["losses"] == pytest.approx(base["losses"], abs=1e-5)
        _assert_params_close(local["params"], base["params"], SIM_ATOL, "EDiT(1 worker) vs Megatron")


@pytest.mark.timeout(240)
def test_replicas_identical_after_each_sync_and_different_between():
    """Snapshot after every step: the two workers agree exactly after syncs (steps 4, 6) and
    differ after local steps; also the anchor is taken when warmup ends (warmup 2), the first
    outer step with momentum does not apply the warmup displacement, and cpu_offload keeps the
    sharded state (2 x 4 bytes x shard) on the CPU."""
    spec = default_spec(
        steps=7,
        local_sgd=dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=2, cpu_offload=True),
        outer=OUTER,
        snapshot_every_step=True,
        record_mains_at_step=2,
        record_anchor_at_step=3,
    )
    results = run_ranks(megatron_runs, WORLD, [spec], timeout=200)
    runs = [r["runs"][0] for r in results]
    by_worker = {0: runs[0], 1: runs[2]}
    for step in range(1, 8):
        a, b = by_worker[0]["snapshots"][step], by_worker[1]["snapshots"][step]
        same = all(torch.equal(a[k], b[k]) for k in a)
        if step <= 2 or step in (4, 6):  # warmup steps are synchronous; 4 and 6 end a sync
            assert same, f"workers differ after step {step}"
        else:
            assert not same, f"workers identical after local step {step}"
    for run in runs:
        # The anchor (read after local step 3) is this shard after warmup step 2.
        for anchor, main in zip(run["anchor"], run["mains"]):
            assert torch.equal(anchor, main)
        assert run["anchor_devices"] == ["cpu"]
        assert run["state_bytes"] == 2 * 4 * sum(run["shard_numels"])  # anchor + momentum


@pytest.mark.timeout(240)
def test_first_outer_step_excludes_warmup_displacement():
    """Warmup 3, H=2, momentum 0.9: the first outer step starts from the model after warmup.
    Compared with the simulation, which takes the anchor at step 3; an anchor taken at step 0
    would apply all three warmup updates again with momentum and land far away."""
    spec = default_spec(
        steps=5,
        local_sgd=dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=3, sync_mode="step_end"),
        outer=OUTER,
        record_mains_at_step=3,
        record_anchor_at_step=4,
    )
    results = run_ranks(megatron_runs, WORLD, [spec], timeout=200)
    expected = run_ranks(simulate_edit, 1, spec, WORLD, timeout=120)[0]["params"]
    for r in results:
        run = r["runs"][0]
        assert [rep.step for rep in run["reports"]] == [5]
        _assert_params_close(run["params"], expected[run["worker"]], SIM_ATOL, "EDiT vs simulation")
        for anchor, main in zip(run["anchor"], run["mains"]):
            assert torch.equal(anchor, main)  # anchor after step 4 == shard after step 3


@pytest.mark.timeout(240)
def test_sync_group_traffic_only_at_syncs_one_shard_per_bucket():
    """Instrumented torch.distributed: no collective spans two workers between syncs; a sync
    sends the all-gather of every worker's per-layer norms (checked before anything else is
    sent), then exactly one all-reduce of this rank's shard per bucket, every one launched at
    the end of the optimizer step (in forward order) and completed in the next forward pass."""
    spec = default_spec(
        steps=7,
        local_sgd=dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=1),  # syncs at 4 and 7
        outer=OUTER,
        traffic=True,
    )
    results = run_ranks(megatron_runs, WORLD, [spec], timeout=200)
    for r in results:
        run = r["runs"][0]
        by_phase = {}
        layers = len(run["reports"][0].layer_names)
        for phase, name, ranks, numel in run["traffic"]:
            assert len(ranks) == 2, (phase, name, ranks)
            if name == "all_gather":  # the norms: first in a sync, one float64 per layer
                assert numel == layers and phase in ("step 4", "step 7") and not by_phase.get(phase), (phase, numel)
            else:
                assert name == "all_reduce", (phase, name, ranks)
            by_phase.setdefault(phase, []).append(numel)
        assert by_phase.pop("step 1"), "warmup step 1 should reduce gradients across workers"
        # Forward order (Megatron's param-gather order), every bucket at the end of step 4.
        assert by_phase.pop("step 4") == [layers] + run["forward_numels"]
        assert sorted(run["forward_numels"]) == sorted(run["shard_numels"])
        assert sorted(by_phase.pop("step 7")[1:]) == sorted(run["shard_numels"])
        assert by_phase == {}, f"traffic across workers between syncs: {by_phase}"
        per_sync = 4 * sum(run["shard_numels"]) + 8 * layers
        assert [rep.payload_bytes for rep in run["reports"]] == [per_sync] * 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_with_two_workers(tp, pp):
    """TP=2 or PP=2, two workers: training runs, each model slice is identical across the
    workers after a sync, and the tensor/pipeline groups are Megatron's, untouched."""
    spec = default_spec(steps=4, local_sgd=dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=0), outer=OUTER)
    results = run_ranks(megatron_runs, WORLD, [spec], tp=tp, pp=pp, timeout=280)
    slices = {}
    for r in results:
        run = r["runs"][0]
        assert r["tp_group"] == r["tp_group_after"] and r["pp_group"] == r["pp_group_after"]
        assert len(r["tp_group"]) == tp and len(r["pp_group"]) == pp
        assert [rep.step for rep in run["reports"]] == [2, 4]
        if run["pp_rank"] == pp - 1:  # the loss lives on the last pipeline stage
            assert all(torch.isfinite(torch.tensor(run["losses"])))
        # The sync group links the same slice across the 2 workers, never a TP/PP peer.
        sync = set(run["sync_group_ranks"])
        assert len(sync) == 2
        assert len(sync & set(r["tp_group"])) == 1 and len(sync & set(r["pp_group"])) == 1
        slices.setdefault((run["tp_rank"], run["pp_rank"]), []).append(run)
    assert len(slices) == tp * pp
    for runs in slices.values():
        assert len(runs) == 2 and {x["worker"] for x in runs} == {0, 1}
        _assert_params_equal(runs[0]["params"], runs[1]["params"], "replicas after the last sync")


@pytest.mark.timeout(240)
def test_local_step_gradient_scaling_equals_single_worker_megatron():
    """After warmup a worker's step is a Megatron step of that worker alone: gradients are
    averaged over the worker's 2 ranks, not divided by the data-parallel size 4."""
    spec = default_spec(steps=3, local_sgd=dict(local_sgd_sync_interval=100, local_sgd_warmup_steps=0), outer=OUTER)
    edit = run_ranks(megatron_runs, WORLD, [spec], timeout=200)
    # Worker 0 alone (ranks 0-1 of a 2-rank job), fed the same micro-batches: the first half of
    # each global batch, with plain Megatron (no local SGD).
    alone = run_ranks(megatron_runs, 2, [default_spec(steps=3, instances=1, data_seed=0, data_dp=4)], timeout=200)
    for rank in (0, 1):
        _assert_params_close(edit[rank]["runs"][0]["params"], alone[rank]["runs"][0]["params"], 1e-6, "local vs alone")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp", "tp2"])
def test_quantized_exchange_keeps_replicas_identical_in_both_modes(tp):
    """int8 with error feedback on real megatron-core (2 workers x 2 shards, and TP=2 x 2
    workers): replicas identical after each sync, layer-wise and step-end bit-identical, int8
    bytes per sync about a quarter of fp32's."""
    quant = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1, exchange_dtype="int8",
                 exchange_block_size=64, exchange_error_feedback=True)
    specs = [default_spec(steps=5, local_sgd=dict(quant, sync_mode=mode), outer=OUTER) for mode in ("layerwise", "step_end")]
    specs.append(default_spec(steps=5, local_sgd=dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1), outer=OUTER))
    results = run_ranks(megatron_runs, WORLD, specs, tp=tp, timeout=280)
    slices = {}
    for r in results:
        layerwise, step_end, fp32 = r["runs"]
        _assert_params_equal(layerwise["params"], step_end["params"], "layer-wise vs step-end")
        assert [rep.step for rep in layerwise["reports"]] == [3, 5]
        ratio = layerwise["reports"][0].payload_bytes / fp32["reports"][0].payload_bytes
        assert 0.25 < ratio < 0.40, ratio  # small shards: block padding weighs more than at scale
        assert layerwise["reports"][0].quantization_error is not None
        slices.setdefault(layerwise["tp_rank"], []).append(layerwise)
    for runs in slices.values():
        _assert_params_equal(runs[0]["params"], runs[1]["params"], "replicas after the last sync")


def _sparse_payload_pays(numel, density, chunk, dtype, workers):
    """The sparse exchange's rule, written out: the W - 1 payloads a rank passes on in a ring
    all-gather against the fp32 all-reduce; a shard for which they are more goes in fp32."""
    from megatron_edit.algorithm import topk

    payload = topk.encoded_bytes(numel, density, max(2, min(chunk, numel)), dtype)
    return (workers - 1) * payload <= 2 * (workers - 1) * 4 * numel // workers


@pytest.mark.timeout(400)
# On Megatron-FSDP one lane: the same exchange as the distributed optimizer's (tested in every lane)
@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=[ON_FSDP_RELEASE, pytest.mark.one_lane])],
                         ids=["distopt", "megatron_fsdp"])
def test_sparse_exchange_keeps_replicas_identical_and_equals_a_shard_level_simulation(fsdp):
    """Top-k 2% with int2 values and error feedback (on by default) on real megatron-core, 2
    workers x 2 shards, syncs after steps 3 and 5: step-end replicas are bit-identical after
    every sync, layer-wise gives step-end's parameters bit for bit; and an independent
    simulation from each shard's recorded anchor and both workers' parameters before each sync
    (top-k + int2 of Delta + residual per worker, the mean of the two sent tensors, torch's
    Nesterov SGD) gives the residuals after the sync exactly and the new anchors. The bytes per
    sync are a few hundredths of the fp32 exchange's. On the distributed optimizer and on
    Megatron-FSDP in HSDP (its own shards)."""
    from megatron_edit.algorithm import topk

    density, dtype = 0.02, "int2"
    sparse = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1, exchange_dtype=dtype,
                  exchange_topk_density=density)
    specs = [default_spec(steps=6, local_sgd=dict(sparse, sync_mode="layerwise"), outer=OUTER,
                          record_shards_at_steps=(3, 4, 5, 6), fsdp=fsdp),
             default_spec(steps=6, local_sgd=dict(sparse, sync_mode="step_end"), outer=OUTER, snapshot_every_step=True,
                          fsdp=fsdp),
             default_spec(steps=6, local_sgd=dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1), outer=OUTER,
                          fsdp=fsdp)]
    results = run_ranks(megatron_runs, WORLD, specs, timeout=380)
    for r in results:
        layerwise, step_end, fp32 = r["runs"]
        _assert_params_equal(layerwise["params"], step_end["params"], "layer-wise vs step-end")
        assert [rep.step for rep in layerwise["reports"]] == [3, 5]
        ratio = layerwise["reports"][0].payload_bytes / fp32["reports"][0].payload_bytes
        assert ratio < 0.05, ratio
        assert layerwise["reports"][0].quantization_error is not None
    by_worker = {}
    for r in results:
        layerwise, step_end = r["runs"][0], r["runs"][1]
        by_worker.setdefault(layerwise["worker"], []).append((layerwise, step_end))
    # replicas: worker 0's ranks against worker 1's, after each sync
    for (lw0, se0), (lw1, se1) in zip(by_worker[0], by_worker[1]):
        for step in (3, 5):
            _assert_params_equal(se0["snapshots"][step], se1["snapshots"][step], f"replicas after the sync at {step}")
        # the same shard on both workers (shard rank = rank inside the worker)
        records, sparse_shards = [lw0["shard_records"], lw1["shard_records"]], 0
        # Recorded after the sync step, a layer-wise sync is still pending, except, on
        # Megatron-FSDP, in the buckets the step's prefetch gathered (the first one, and the next
        # within its prefetch window): their outer step is done there, the state before it is gone.
        pending = [all(records[w][step]["pending"][i] for w in (0, 1) for step in (3, 5))
                   for i in range(len(lw0["shard_numels"]))]
        assert all(pending) if not fsdp else (not pending[0] and any(pending)), pending
        for i, numel in enumerate(lw0["shard_numels"]):
            if not pending[i]:
                continue
            anchor = records[0][3]["anchor"][i].clone()
            assert torch.equal(anchor, records[1][3]["anchor"][i])
            opt = torch.optim.SGD([anchor], **OUTER["outer_optim_kwargs"])
            residual = [torch.zeros(numel), torch.zeros(numel)]
            pays = _sparse_payload_pays(numel, density, 4096, dtype, 2)
            sparse_shards += pays
            for before, after in ((3, 4), (5, 6)):
                start = records[0][before]["anchor"][i]
                assert torch.allclose(start, anchor, rtol=1e-6, atol=1e-7), (i, before)
                sent = []
                for w in (0, 1):
                    x = start - records[w][before]["mains"][i]
                    if pays:
                        x = x + residual[w]
                        chunk = max(2, min(4096, numel))
                        got = topk.decode(topk.encode(x, density, chunk, dtype), numel, density, chunk, dtype)
                        residual[w] = x - got
                        assert torch.equal(records[w][after]["residual"][i], residual[w]), (w, i, after)
                        x = got
                    sent.append(x)
                anchor.grad = (sent[0] + sent[1]) / 2
                opt.step()
                for w in (0, 1):
                    assert torch.allclose(records[w][after]["anchor"][i], anchor, rtol=1e-6, atol=1e-7), (w, i, after)
        assert sparse_shards > 0


@pytest.mark.timeout(240)
def test_a_layerwise_sync_due_at_the_last_step_completes_before_the_run_ends():
    """With the run's last step known (Megatron-LM: --train-iters), a layer-wise sync due there
    (no next forward pass to complete it in) completes at once and the parameters are gathered:
    the workers end with identical models without anyone forcing a parameter sync."""
    spec = default_spec(steps=6, local_sgd=dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=0), outer=OUTER,
                        last_step=6, no_final_gather=True)
    results = run_ranks(megatron_runs, WORLD, [spec], timeout=200)
    for r in results:
        run = r["runs"][0]
        assert [rep.step for rep in run["reports"]] == [3, 6] and not run["pending_at_end"]
    _assert_params_equal(results[0]["runs"][0]["params"], results[2]["runs"][0]["params"], "workers at the end")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["layerwise", "step_end"])
def test_a_run_ending_off_the_sync_grid_ends_with_a_sync(mode):
    """The last step (7) is not on the grid (syncs after 3 and 6): the run still ends
    with a sync there, so the workers end with one model (before, they ended 1 local step apart,
    with different models)."""
    spec = default_spec(steps=7, local_sgd=dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=0, sync_mode=mode),
                        outer=OUTER, last_step=7, no_final_gather=True)
    results = run_ranks(megatron_runs, WORLD, [spec], timeout=200)
    for r in results:
        run = r["runs"][0]
        assert [rep.step for rep in run["reports"]] == [3, 6, 7] and not run["pending_at_end"]
        assert run["reports"][-1].steps_since_last == 1
    _assert_params_equal(results[0]["runs"][0]["params"], results[2]["runs"][0]["params"], "workers at the end")


@pytest.mark.timeout(400)
def test_virtual_pipeline_layerwise_equals_step_end():
    """PP=2 with two virtual stages per rank (Megatron-LM's VPP set-up: one DDP per chunk, the
    interleaved schedule, and with align_param_gather the schedule gathers each chunk's
    parameters itself): layer-wise syncs, aligned or not, give step-end's parameters bit for bit,
    and the replicas are identical after the last sync."""
    from edit_runs import vpp_runs

    local = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1)
    specs = [dict(local_sgd=dict(local, sync_mode="step_end"), outer=OUTER, steps=5, align=False,
                  overlap_param_gather=False),
             dict(local_sgd=local, outer=OUTER, steps=5, align=True, overlap_param_gather=True),
             dict(local_sgd=local, outer=OUTER, steps=5, align=False, overlap_param_gather=True)]
    results = run_ranks(vpp_runs, WORLD, specs, timeout=380)
    for r in results:
        step_end, aligned, unaligned = r
        assert [rep.step for rep in aligned["reports"]] == [3, 5]
        for other in (aligned, unaligned):
            for a, b in zip(step_end["params"], other["params"]):
                _assert_params_equal(a, b, "layer-wise (VPP) vs step-end")
    by_stage = {}
    for r in results:
        by_stage.setdefault(r[1]["pp_rank"], []).append(r[1]["params"])
    for stage in by_stage.values():
        for a, b in zip(*stage):
            _assert_params_equal(a, b, "replicas after the last sync")
