"""The GPU lane: EDiT on real megatron-core on CUDA (NCCL). Skipped without a GPU (with the
command that runs it); ``bash scripts/gpu_check.sh`` runs it and prints a table.

What only a GPU shows: asynchronous host <-> device copies (the offloaded outer state), CUDA
streams behind the layer-wise hooks, host-device synchronisations hidden in EDiT's hooks, bf16
parameter buffers written by the outer step, and the compiled fused outer step.

Several processes sharing one GPU are not possible with torch here: NCCL refuses two ranks on
one device, and gloo reduces CUDA tensors only for broadcast and all-reduce (Megatron's DDP
needs reduce-scatter and all-gather). The multi-worker exchange runs when the machine has two
GPUs or more (test below); with one GPU, one worker.
"""

import pytest
import torch

from cuda_runs import cuda_train, spec
from dist import run_ranks

pytestmark = pytest.mark.cuda

OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
EDIT = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1)


def _run(s, world=1):
    return run_ranks(cuda_train, world, s, device="cuda", timeout=600)


def _rel(a, b):
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() for k in a)


@pytest.mark.timeout(900)
def test_one_worker_plain_outer_sgd_equals_unpatched_megatron():
    """One worker, outer SGD lr 1 without momentum: the outer step restores the worker's own
    parameters, so EDiT equals ordinary Megatron (fp32, relative difference <= 1e-6)."""
    plain = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=1.0, momentum=0.0))
    (edit,) = _run(spec(local_sgd=EDIT, outer=plain))
    (megatron,) = _run(spec())
    assert len(edit["reports"]) == 4
    assert _rel(edit["params"], megatron["params"]) <= 1e-6


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["layerwise", "step_end"])
def test_cpu_offload_equals_on_device_bitwise(mode):
    """The offloaded anchor and momentum (pinned host memory, paged onto the GPU for the outer
    step) give the same parameters and anchors as state kept on the GPU, bit for bit."""
    local = dict(EDIT, sync_mode=mode)
    (device,) = _run(spec(local_sgd=local, outer=OUTER, overlap_param_gather=mode == "layerwise"))
    (offload,) = _run(spec(local_sgd=dict(local, cpu_offload=True), outer=OUTER,
                           overlap_param_gather=mode == "layerwise"))
    assert device["anchor_devices"] == ["cuda:0"] and offload["anchor_devices"] == ["cpu"]
    assert offload["anchor_pinned"] and device["fused"] and offload["fused"]
    for k in device["params"]:
        assert torch.equal(device["params"][k], offload["params"][k]), k
    for a, b in zip(device["anchors"], offload["anchors"]):
        assert torch.equal(a, b)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["penalty", "gta", "int8"])
def test_bf16_model_trains_with_the_penalty_gta_and_a_quantized_exchange(variant):
    """bf16 parameters (the model copy written by the fused outer step, cast from fp32): losses
    and parameters stay finite with the penalty, GTA and the quantized exchange's settings (one
    worker: nothing is sent, the code paths run)."""
    local, gta = dict(EDIT), None
    if variant == "penalty":
        local.update(skip_anomaly=True, ewma_warmup_steps=1, pseudo_gradnorm_reduce=True, clip_pseudo_grad=1.0)
    elif variant == "gta":
        gta = dict(reducer="gta", consensus_method="sum", sparsification_method="magnitude", density=0.5)
    else:
        local.update(exchange_dtype="int8", exchange_error_feedback=True)
    (run,) = _run(spec(local_sgd=local, outer=OUTER, gta=gta, bf16=True, steps=12))
    assert all(torch.isfinite(torch.tensor(run["losses"])))
    assert all(torch.isfinite(v.float()).all() for v in run["params"].values())
    assert len(run["reports"]) >= 5


@pytest.mark.timeout(900)
def test_save_and_resume_are_bitwise_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    local = dict(EDIT, sync_mode="layerwise")
    (whole,) = _run(spec(local_sgd=local, outer=OUTER, steps=8, save_at=4, save_dir=path))
    (resumed,) = _run(spec(local_sgd=local, outer=OUTER, steps=8, load=(path, 4)))
    for k in whole["params"]:
        assert torch.equal(whole["params"][k], resumed["params"][k]), k
    for a, b in zip(whole["anchors"], resumed["anchors"]):
        assert torch.equal(a, b)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("clip", [None, 1.0])
def test_edit_hooks_make_no_host_device_synchronisation(clip):
    """torch.cuda.set_sync_debug_mode("error") around every EDiT hook (the step hooks and the
    forward pre-hooks that complete a layer-wise sync, clipping included): nothing raises."""
    local = dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=1, clip_pseudo_grad=clip)
    (run,) = _run(spec(local_sgd=local, outer=OUTER, sync_debug=True, steps=8))
    assert [r.step for r in run["reports"]] == [4, 7]


@pytest.mark.timeout(900)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (two workers, NCCL)")
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_two_workers_on_two_gpus_keep_identical_replicas(dtype):
    local = dict(EDIT, exchange_dtype=dtype)
    results = _run(spec(local_sgd=local, outer=OUTER, workers=2), world=2)
    for k in results[0]["params"]:
        assert torch.equal(results[0]["params"][k], results[1]["params"][k]), k
