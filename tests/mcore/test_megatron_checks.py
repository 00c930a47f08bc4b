"""megatron_edit.mcore.checks: start-up checks, on real megatron-core config objects."""

import dataclasses

import pytest

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

from megatron_edit.config import ConfigError, LocalSGDConfig, NotSupportedYet
from megatron_edit.mcore.checks import (
    check_megatron_options,
    check_optimizer_options,
    check_workers,
)

LAYERWISE = LocalSGDConfig(local_sgd_sync_interval=4)
STEP_END = LocalSGDConfig(local_sgd_sync_interval=4, sync_mode="step_end")


def _has(config_class, field):
    """Whether the installed megatron-core's config has ``field`` (see megatron_edit.mcore.compat)."""
    return field in {f.name for f in dataclasses.fields(config_class)}


def _model(**kwargs):
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, **kwargs)


def _ddp(**kwargs):
    base = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                num_distributed_optimizer_instances=2)
    base.update(kwargs)
    return DistributedDataParallelConfig(**base)


def _fails(exc, local_cfg, model, ddp):
    with pytest.raises(ConfigError) as info:
        check_megatron_options(local_cfg, model, ddp)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    return str(info.value)


def test_good_configs_pass():
    assert check_megatron_options(LAYERWISE, _model(), _ddp()) is None
    # step_end needs no overlap at all
    assert check_megatron_options(
        STEP_END, _model(), _ddp(overlap_grad_reduce=False, overlap_param_gather=False)
    ) is None


def test_needs_the_distributed_optimizer():
    message = _fails(ConfigError, STEP_END, _model(),
                     _ddp(use_distributed_optimizer=False, overlap_param_gather=False))
    assert "--use-distributed-optimizer" in message
    assert "--num-distributed-optimizer-instances" in message


@pytest.mark.skipif(not _has(DistributedDataParallelConfig, "use_megatron_fsdp"),
                    reason="use_megatron_fsdp is new in megatron-core 0.14 (use_custom_fsdp before)")
def test_megatron_fsdp_goes_through_its_own_checks():
    """Megatron-FSDP does not need DDP's use_distributed_optimizer (it shards the optimizer
    itself); its checks (megatron_edit.mcore.fsdp) refuse what EDiT on it does not do: here the
    default sharding strategy, or, on a release other than 0.16.1, Megatron-FSDP at all."""
    from megatron_edit.mcore import compat
    from megatron_edit.mcore.releases import FSDP_SUPPORTED

    ddp = _ddp(use_megatron_fsdp=True, use_distributed_optimizer=False)
    assert ddp.use_megatron_fsdp  # the real config accepts it (no other field needed on 0.16)
    checked = FSDP_SUPPORTED.contains(compat.megatron_core_version())
    message = _fails(NotSupportedYet if checked else ConfigError, LAYERWISE, _model(), ddp)
    assert "FSDP" in message and "--use-megatron-fsdp" in message
    if checked:
        assert "--data-parallel-sharding-strategy" in message
        good = _ddp(use_megatron_fsdp=True, use_distributed_optimizer=False, overlap_param_gather=False,
                    data_parallel_sharding_strategy="optim_grads_params")
        assert check_megatron_options(LAYERWISE, _model(), good) is None


def test_refuses_legacy_custom_fsdp_with_the_default_strategy():
    with pytest.raises(ConfigError, match="FSDP"):  # NotSupportedYet on 0.16.1, the release elsewhere
        check_megatron_options(LAYERWISE, _model(), _ddp(use_custom_fsdp=True))


_NO_IMPL = pytest.mark.skipif(not _has(TransformerConfig, "cuda_graph_impl"),
                              reason="cuda_graph_impl is new in megatron-core 0.15")


@pytest.mark.parametrize(
    "model_kwargs",
    [
        pytest.param(dict(cuda_graph_impl="local"), marks=_NO_IMPL),
        pytest.param(dict(cuda_graph_impl="transformer_engine"), marks=_NO_IMPL),
        # deprecated spelling; TransformerConfig turns it into cuda_graph_impl='local'
        dict(enable_cuda_graph=True),
        dict(external_cuda_graph=True),
    ],
)
def test_refuses_cuda_graphs(model_kwargs):
    # megatron-core 0.16 builds these configs on CPU; nothing set after construction.
    message = _fails(ConfigError, LAYERWISE, _model(**model_kwargs), _ddp())
    assert "CUDA graphs" in message and "--cuda-graph-impl" in message


def test_per_token_loss_only_where_the_tokens_are_counted_over_the_worker():
    # megatron-core alone: finalize_model_grads counts the tokens over every data-parallel rank
    # (refused); Megatron-LM's patched loop counts them over the worker (accepted).
    with pytest.raises(NotSupportedYet) as info:
        check_megatron_options(LAYERWISE, _model(calculate_per_token_loss=True), _ddp(), tokens_counted_in_worker=False)
    assert "calculate_per_token_loss" in str(info.value) and "megatron_edit.launch" in str(info.value)
    check_megatron_options(LAYERWISE, _model(calculate_per_token_loss=True), _ddp(), tokens_counted_in_worker=True)


@pytest.mark.skipif(not _has(DistributedDataParallelConfig, "fp8_param_gather"),
                    reason="this megatron-core has no fp8_param_gather")
def test_refuses_fp8_param_gather():
    """FP8 parameter buffers hold FP8 bytes: EDiT's fp32 outer step cannot be written there."""
    message = _fails(ConfigError, LAYERWISE, _model(), _ddp(fp8_param_gather=True))
    assert "--fp8-param-gather" in message


def test_layerwise_needs_overlap_param_gather():
    message = _fails(ConfigError, LAYERWISE, _model(), _ddp(overlap_param_gather=False))
    assert "--overlap-param-gather" in message
    assert "step_end" in message


@pytest.mark.parametrize("dp, workers", [(4, 2), (4, 4), (4, 1), (6, 3), (1, 1)])
def test_workers_dividing_dp_pass(dp, workers):
    assert check_workers(dp, workers) is None


@pytest.mark.parametrize("dp, workers", [(4, 3), (4, 8), (4, 0), (6, 4)])
def test_workers_not_dividing_dp_fail(dp, workers):
    with pytest.raises(ConfigError) as info:
        check_workers(dp, workers)
    message = str(info.value)
    assert f"--num-distributed-optimizer-instances={workers}" in message
    assert f"data-parallel size {dp}" in message


def _opt(**kwargs):
    return OptimizerConfig(bf16=True, use_distributed_optimizer=True, **kwargs)


def test_good_optimizer_config_passes():
    assert check_optimizer_options(_opt(), has_grad_scaler=False) is None


def test_refuses_precision_aware_optimizer():
    # OptimizerConfig.__post_init__ needs Transformer Engine's version to accept this flag, and
    # TE is not installed on CPU: set it after construction.
    config = _opt()
    config.use_precision_aware_optimizer = True
    with pytest.raises(ConfigError, match="--use-precision-aware-optimizer") as info:
        check_optimizer_options(config, has_grad_scaler=False)
    assert type(info.value) is ConfigError


def test_refuses_overlap_param_gather_with_optimizer_step():
    config = _opt(overlap_param_gather_with_optimizer_step=True)
    with pytest.raises(ConfigError, match="--overlap-param-gather-with-optimizer-step") as info:
        check_optimizer_options(config, has_grad_scaler=False)
    assert type(info.value) is ConfigError


def test_refuses_optimizer_cpu_offload():
    config = _opt(optimizer_cpu_offload=True)
    with pytest.raises(NotSupportedYet, match="--optimizer-cpu-offload.*not supported yet"):
        check_optimizer_options(config, has_grad_scaler=False)


def test_fp16_loss_scaling_is_accepted_except_on_megatron_fsdp():
    """A step the loss scaler skips is the worker's own (tests/mcore/test_skipped_step.py); on
    Megatron-FSDP it was not checked."""
    config = OptimizerConfig(fp16=True, use_distributed_optimizer=True)
    assert check_optimizer_options(config, has_grad_scaler=True) is None
    with pytest.raises(NotSupportedYet, match="--fp16 .*--use-megatron-fsdp.*not supported yet") as info:
        check_optimizer_options(config, has_grad_scaler=True, megatron_fsdp=True)
    assert "--bf16" in str(info.value)


@pytest.mark.parametrize(
    "field, value, exc, match",
    [
        ("optimizer_cuda_graph", True, ConfigError, "--optimizer-cuda-graph"),  # 0.17+
        ("grad_norm_skip_threshold", 10.0, ConfigError, "grad_norm_skip_threshold=10.0"),  # 0.18+
        ("optimizer", "lion", NotSupportedYet, "--optimizer lion"),
    ],
    ids=["optimizer-cuda-graph", "grad-norm-skip", "other-optimizer"],
)
def test_refuses_newer_optimizer_options(field, value, exc, match):
    """Options of newer releases that would desynchronise or bypass EDiT's step; on releases
    without the field the config cannot carry it (set after construction: __post_init__ of
    some releases checks it against transformer-engine)."""
    config = _opt()
    if not _has(OptimizerConfig, field):
        pytest.skip(f"OptimizerConfig has no {field} in this megatron-core (see compat)")
    setattr(config, field, value)
    with pytest.raises(exc, match=match) as info:
        check_optimizer_options(config, has_grad_scaler=False)
    if exc is ConfigError:
        assert type(info.value) is ConfigError
    assert check_optimizer_options(_opt(optimizer="sgd"), has_grad_scaler=False) is None
