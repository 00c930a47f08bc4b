"""Tests for megatron_edit.cpu.adapter: real megatron-core training on CPU over gloo.

The multi-rank tests train megatron's GPTModel with megatron's DDP, (distributed) optimizer and
pipeline schedule on 4 processes and compare the parameters with an independent plain-PyTorch
reference (torch.optim.AdamW on the same GPTModel init, in a world-size-1 process, gradient of
the mean loss over every rank's micro-batches).
"""

import pytest
import torch

from dist import run_ranks
from reference_runs import (
    NUM_STEPS,
    TOLERANCE,
    WORLD_SIZE,
    train_megatron as _train_megatron,
    train_reference as _train_reference,
)
from megatron_edit.mcore import compat

@pytest.fixture(scope="module")
def reference():
    # Same for every configuration below, so computed once.
    return run_ranks(_train_reference, 1, timeout=150)[0]


# megatron-core 0.12.x's distributed optimizer reduces the gradient norm over all ranks: with 2
# instances it is sqrt(2) too large and clipping differs (Megatron's own defect; under EDiT the
# distopt-grad-stats-group patch fixes it, see tests/test_compat.py).
_NORM_OVER_ALL_RANKS = pytest.mark.xfail(
    not compat.grad_stats_reduced_per_instance(), strict=True,
    reason="megatron-core 0.12.x reduces the partial distributed optimizer's grad norm over all ranks",
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "use_distributed_optimizer, instances",
    [pytest.param(True, 2, marks=_NORM_OVER_ALL_RANKS), (True, 1), (False, 1)],
    ids=["distopt-2-instances", "distopt-1-instance", "plain-ddp"],
)
def test_megatron_matches_plain_pytorch(reference, use_distributed_optimizer, instances):
    results = run_ranks(
        _train_megatron, WORLD_SIZE, use_distributed_optimizer, instances, timeout=150
    )
    assert results[0]["num_buckets"] >= 3
    assert results[0]["intra_instance_size"] == WORLD_SIZE // instances
    ref = reference["params"]
    for name, param in ref.items():  # training moved every tensor far beyond the tolerance
        assert (param - reference["initial"][name]).abs().max() > 100 * TOLERANCE, name
    for rank, result in enumerate(results):
        assert result["params"].keys() == ref.keys()
        for name, param in result["params"].items():
            diff = (param - ref[name]).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank} {name}: max |diff| {diff:.2e}"
    # The logged loss is per rank; its mean over ranks is the reference's global-batch loss.
    for step in range(NUM_STEPS):
        mean_loss = sum(r["losses"][step] for r in results) / WORLD_SIZE
        assert mean_loss == pytest.approx(reference["losses"][step], abs=TOLERANCE)


# --- in-process adapter checks ---------------------------------------------------------------------


def _snapshot():
    """Every namespace the adapter may touch, as {owner: dict copy}."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.tensor_parallel.random as mc_random
    import torch.distributed.distributed_c10d as c10d

    owners = [
        torch,
        c10d,
        torch.cuda,
        torch.cuda.random,
        torch.Tensor,
        clip_grads,
        optimizer,
        mc_random,
        distrib_optimizer.DistributedOptimizer,
        optimizer.Float16OptimizerWithFloat16Params,
    ]
    return {owner: dict(vars(owner)) for owner in owners}


def _changed(before, after):
    return sorted(
        f"{getattr(owner, '__name__', owner)}.{name}"
        for owner in before
        for name in before[owner].keys() | after[owner].keys()
        if before[owner].get(name, _changed) is not after[owner].get(name, _changed)
    )


@pytest.mark.timeout(60)
def test_activate_deactivate_restores_exactly():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron_edit.cpu import adapter as cpu_adapter

    assert not cpu_adapter.is_active()
    before = _snapshot()
    try:
        cpu_adapter.activate()
        cpu_adapter.activate()  # idempotent
        assert cpu_adapter.is_active()
        patched = _changed(before, _snapshot())
        for name in ["torch.zeros", "torch.cuda.current_device", "torch.cuda.Stream",
                     "torch.cuda.get_rng_state", "torch.cuda.random.get_rng_state",
                     "torch.distributed.distributed_c10d.ProcessGroupGloo"]:
            assert name in patched
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.cuda.device_count() == 1
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.default_stream().wait_stream(torch.cuda.current_stream())
        # CUDA type names only inside the wrapped megatron calls, never globally.
        assert torch.ones(1).type() == "torch.FloatTensor"
        with cpu_adapter._cuda_type_names():
            assert torch.ones(1).type() == "torch.cuda.FloatTensor"
            assert torch.ones(1).type(torch.float64).dtype == torch.float64
        assert torch.ones(1).type() == "torch.FloatTensor"
        assert isinstance(vars(DistributedOptimizer)["_build_model_and_main_param_groups"],
                          classmethod)
    finally:
        cpu_adapter.deactivate()
    assert not cpu_adapter.is_active()
    assert _changed(before, _snapshot()) == []


@pytest.mark.timeout(60)
def test_rng_tracker_runs_on_cpu_backed_state(monkeypatch):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron_edit.cpu import adapter as cpu_adapter
    from megatron_edit.mcore.compat import call_kwargs

    try:
        cpu_adapter.activate()
        cpu_state = torch.get_rng_state()
        # Ranks given explicitly (0.13+) so that no parallel_state is needed; 0.12 only reads
        # them from parallel_state, so this test sets them there (rank 0, restored after).
        ranks = call_kwargs(model_parallel_cuda_manual_seed, tp_rank=0, ep_rank=0, etp_rank=0,
                            force_reset_rng=True)
        if not ranks:
            from megatron.core import parallel_state

            monkeypatch.setattr(parallel_state, "_MPU_TENSOR_MODEL_PARALLEL_RANK", 0)
            monkeypatch.setattr(parallel_state, "_MPU_EXPERT_MODEL_PARALLEL_RANK", 0)
            monkeypatch.setattr(parallel_state, "_MPU_EXPERT_TENSOR_PARALLEL_RANK", 0)
        model_parallel_cuda_manual_seed(7, **ranks)
        outside = torch.cuda.get_rng_state()
        tracker = get_cuda_rng_tracker()
        with tracker.fork():
            inside = torch.cuda.get_rng_state()
            assert not torch.equal(inside, outside)  # the tracker switched the "CUDA" state
        assert torch.equal(torch.cuda.get_rng_state(), outside)  # and restored it
        assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU generator is untouched
    finally:
        cpu_adapter.deactivate()


@pytest.mark.timeout(60)
def test_only_the_expected_rng_notice_is_silenced(caplog):
    import logging

    from megatron_edit.cpu import adapter as cpu_adapter

    log = logging.getLogger("megatron.core.tensor_parallel.random")
    notice = "CPU RNG state changed within GPU RNG context"
    try:
        cpu_adapter.activate()
        with caplog.at_level(logging.WARNING, logger=log.name):
            log.warning(notice)  # what fork() logs when CPU init draws inside it
            log.warning("something else went wrong")
        assert [r.getMessage() for r in caplog.records] == ["something else went wrong"]
    finally:
        cpu_adapter.deactivate()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=log.name):
        log.warning(notice)
    assert [r.getMessage() for r in caplog.records] == [notice]  # deactivate removes the filter


def test_activate_refuses_when_cuda_is_available(monkeypatch):
    from megatron_edit.cpu import adapter as cpu_adapter

    before = _snapshot()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="never"):
        cpu_adapter.activate()
    assert not cpu_adapter.is_active()
    monkeypatch.undo()
    assert _changed(before, _snapshot()) == []


def _fp8_helper_needs_fixing():
    """megatron-core 0.12.x without transformer-engine: its FP8 helper raises on no FP8 params."""
    if compat.version_at_least("0.13.0"):
        return False
    import megatron.core.fp8_utils as fp8_utils

    return not fp8_utils.HAVE_TE


@pytest.mark.skipif(not _fp8_helper_needs_fixing(), reason="only megatron-core 0.12.x without TE")
def test_fp8_helper_accepts_no_fp8_params_on_0_12():
    import megatron.core.fp8_utils as fp8_utils
    from megatron_edit.cpu import adapter as cpu_adapter

    original = vars(fp8_utils)["_quantize_param_shard_impl"]
    with pytest.raises(RuntimeError, match="Transformer Engine"):
        fp8_utils.quantize_param_shard([], [], [], None)  # the defect the adapter works around
    try:
        cpu_adapter.activate()
        assert fp8_utils.quantize_param_shard([], [], [], None) is None
        with pytest.raises(RuntimeError, match="Transformer Engine"):  # real FP8 params: still an error
            fp8_utils.quantize_param_shard([torch.zeros(1)], [torch.zeros(1)], [0], None)
    finally:
        cpu_adapter.deactivate()
    assert vars(fp8_utils)["_quantize_param_shard_impl"] is original


@pytest.mark.timeout(60)
@pytest.mark.skipif(not compat.version_at_least("0.16.0"),
                    reason="the router shim is for megatron-core 0.16+ (MoE with EDiT starts there)")
def test_moe_router_and_alltoall_splits_run_without_transformer_engine():
    """megatron-core 0.16.x reads ``te_general_gemm`` in the router without defining it when
    transformer-engine is missing (NameError): the adapter defines it as None where, and only
    where, the module lacks it, so the router takes its torch path (forward and backward); the
    alltoall dispatcher's split sizes come back as numpy arrays on CPU. Both reverted exactly."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    from megatron_edit.cpu import adapter as cpu_adapter
    from megatron_edit.cpu.moe import _router_gemm_undefined

    needs = _router_gemm_undefined()
    had = hasattr(moe_utils, "te_general_gemm")
    assert needs == (not had and moe_utils.RouterGatingLinearFunction is not None)
    original_move = token_dispatcher.maybe_move_tensor_to_cpu
    inp = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(4, 8, requires_grad=True)
    if needs:
        with pytest.raises(NameError, match="te_general_gemm"):
            moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    try:
        cpu_adapter.activate()
        out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
        assert torch.allclose(out, inp @ weight.t(), atol=1e-6)
        out.sum().backward()
        assert torch.allclose(weight.grad, inp.detach().sum(0).expand(4, 8), atol=1e-5)
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 4]), as_numpy=True)
        assert list(splits) == [3, 4] and not torch.is_tensor(splits)
        assert torch.is_tensor(token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 4])))
    finally:
        cpu_adapter.deactivate()
    assert hasattr(moe_utils, "te_general_gemm") == had
    assert token_dispatcher.maybe_move_tensor_to_cpu is original_move
