"""megatron_edit.config: every check names the option and its flag; unbuilt options refuse."""

import dataclasses
import math
import os

import pytest
import torch

from megatron_edit.config import (
    FLAG_NAMES,
    ConfigError,
    GTAConfig,
    LocalSGDConfig,
    NotSupportedYet,
    OuterOptimizerConfig,
    replace,
    resolve_optimizer_class,
)


# The command-line contract, written out here so a renamed flag in the package fails a test.
FLAGS = {
    "use_async": "--local-sgd-async",
    "local_sgd_sync_interval": "--local-sgd-sync-interval",
    "local_sgd_sync_time": "--local-sgd-sync-time",
    "min_total_global_steps": "--local-sgd-min-total-global-steps",
    "async_time_budget": "--local-sgd-time-budget",
    "use_step_weight": "--local-sgd-use-step-weight",
    "step_weight_ratio": "--local-sgd-step-weight-ratio",
    "local_sgd_warmup_steps": "--local-sgd-warmup-steps",
    "gradient_accumulation_steps": "--local-sgd-gradient-accumulation-steps",
    "clip_pseudo_grad": "--local-sgd-clip-pseudo-grad",
    "pseudo_gradnorm_reduce": "--local-sgd-pseudo-gradnorm-reduce",
    "weight_softmax_temperature": "--local-sgd-weight-softmax-temperature",
    "skip_anomaly": "--local-sgd-skip-anomaly",
    "ewma_alpha": "--local-sgd-ewma-alpha",
    "ewma_warmup_steps": "--local-sgd-ewma-warmup-steps",
    "ewma_threshold": "--local-sgd-ewma-threshold",
    "cpu_offload": "--local-sgd-cpu-offload",
    "is_debug": "--local-sgd-debug",
    "sync_mode": "--local-sgd-sync-mode",
    "exchange_dtype": "--local-sgd-exchange-dtype",
    "exchange_block_size": "--local-sgd-exchange-block-size",
    "exchange_error_feedback": "--local-sgd-exchange-error-feedback",
    "exchange_topk_density": "--local-sgd-exchange-topk-density",
    "exchange_topk_chunk": "--local-sgd-exchange-topk-chunk",
    "sync_timeout": "--local-sgd-sync-timeout",
    "outer_step_delay": "--local-sgd-outer-step-delay",
    "outer_merge_alpha": "--local-sgd-outer-merge-alpha",
    "fragments": "--local-sgd-fragments",
    "outer_merge_rule": "--local-sgd-outer-merge-rule",
    "sync_backend": "--local-sgd-sync-backend",
    "lighthouse": "--local-sgd-lighthouse",
    "replica_id": "--local-sgd-replica-id",
    "min_replicas": "--local-sgd-min-replicas",
    "sync_record": "--local-sgd-sync-record",
    "auto_overlap": "--local-sgd-auto-overlap",
    "auto_formats": "--local-sgd-auto-formats",
    "auto_fragments": "--local-sgd-auto-fragments",
    "auto_every": "--local-sgd-auto-every",
    "outer_optim_class": "--outer-optimizer",
    "outer_optim_kwargs": "--outer-optimizer-lr",
    "reducer": "--local-sgd-reducer",
    "consensus_method": "--gta-consensus-method",
    "sparsification_method": "--gta-sparsification-method",
    "normalize": "--gta-normalize",
    "density": "--gta-density",
    "int8_mask": "--gta-int8-mask",
}


def _raises(cls, exc, field_name, **kwargs):
    """Construct ``cls(**kwargs)``, expect ``exc`` (exactly) naming the field and its flag."""
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    assert type(info.value) is exc, f"{kwargs}: got {type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert field_name in message, message
    assert FLAGS[field_name] in message, message
    return message


# --- LocalSGDConfig -------------------------------------------------------------------------


def test_local_sgd_defaults():
    cfg = LocalSGDConfig()
    assert cfg.local_sgd_sync_interval == 1
    assert cfg.local_sgd_warmup_steps == 0
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.sync_mode == "layerwise"
    assert cfg.use_async is False and cfg.skip_anomaly is False
    assert cfg.clip_pseudo_grad is None and cfg.weight_softmax_temperature is None
    assert cfg.cpu_offload is False


@pytest.mark.parametrize(
    "field_name, value",
    [
        ("local_sgd_sync_interval", 0),
        ("local_sgd_sync_interval", -3),
        ("local_sgd_sync_interval", 2.0),
        ("local_sgd_warmup_steps", -1),
        ("local_sgd_warmup_steps", 1.5),
        ("gradient_accumulation_steps", 2),
        ("gradient_accumulation_steps", 0),
        ("local_sgd_sync_time", 0.0),
        ("local_sgd_sync_time", -5.0),
        ("local_sgd_sync_time", math.inf),
        ("local_sgd_sync_time", math.nan),
        ("min_total_global_steps", -1),
        ("step_weight_ratio", -0.1),
        ("step_weight_ratio", 1.5),
        ("clip_pseudo_grad", 0.0),
        ("clip_pseudo_grad", -1.0),
        ("clip_pseudo_grad", math.inf),
        ("weight_softmax_temperature", 0.0),
        ("weight_softmax_temperature", -2.0),
        ("ewma_alpha", 0.0),
        ("ewma_alpha", 1.5),
        ("ewma_warmup_steps", -1),
        ("ewma_threshold", 0.0),
        ("sync_mode", "bogus"),
        ("sync_mode", "LAYERWISE"),
    ],
)
def test_local_sgd_bad_value_names_option_and_flag(field_name, value):
    message = _raises(LocalSGDConfig, ConfigError, field_name, **{field_name: value})
    assert repr(value) in message  # the message shows what was given


def test_sync_mode_message_lists_choices():
    message = _raises(LocalSGDConfig, ConfigError, "sync_mode", sync_mode="async")
    assert "layerwise" in message and "step_end" in message


def test_gradient_accumulation_message_says_what_to_use_instead():
    message = _raises(LocalSGDConfig, ConfigError, "gradient_accumulation_steps",
                      gradient_accumulation_steps=4)
    assert "--global-batch-size" in message


def test_async_options_construct_and_step_weight_needs_async():
    cfg = LocalSGDConfig(use_async=True, use_step_weight=True, local_sgd_sync_time=30.0)
    assert cfg.use_async and cfg.use_step_weight
    message = _raises(LocalSGDConfig, ConfigError, "use_step_weight", use_step_weight=True)
    assert "--local-sgd-async" in message


def test_penalty_options_construct():
    cfg = LocalSGDConfig(clip_pseudo_grad=1.0, pseudo_gradnorm_reduce=True,
                         weight_softmax_temperature=0.5, skip_anomaly=True)
    assert cfg.clip_pseudo_grad == 1.0 and cfg.skip_anomaly and cfg.pseudo_gradnorm_reduce


def test_temperature_without_weighting_is_refused():
    message = _raises(LocalSGDConfig, ConfigError, "weight_softmax_temperature", weight_softmax_temperature=0.5)
    assert "--local-sgd-pseudo-gradnorm-reduce" in message


def test_not_supported_yet_is_a_config_error():
    assert issubclass(NotSupportedYet, ConfigError)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "changes",
    [
        dict(local_sgd_sync_interval=8, local_sgd_warmup_steps=100, sync_mode="step_end"),
        dict(cpu_offload=True, is_debug=True, local_sgd_sync_time=1.5, step_weight_ratio=1.0),
        dict(ewma_alpha=1.0, ewma_warmup_steps=0, ewma_threshold=0.5, min_total_global_steps=0),
    ],
)
def test_valid_local_sgd_values_are_kept(changes):
    cfg = LocalSGDConfig(**changes)
    assert {k: getattr(cfg, k) for k in changes} == changes


def test_replace_revalidates():
    cfg = LocalSGDConfig(local_sgd_sync_interval=4)
    assert replace(cfg, local_sgd_warmup_steps=3).local_sgd_warmup_steps == 3
    with pytest.raises(ConfigError, match="--local-sgd-sync-interval"):
        replace(cfg, local_sgd_sync_interval=0)


def test_every_field_has_a_flag_and_every_flag_a_field():
    fields = {
        f.name
        for cls in (LocalSGDConfig, OuterOptimizerConfig, GTAConfig)
        for f in dataclasses.fields(cls)
    }
    assert fields == set(FLAG_NAMES) == set(FLAGS)
    for name, flag in FLAGS.items():
        assert FLAG_NAMES[name].startswith(flag), name


# --- OuterOptimizerConfig -------------------------------------------------------------------


def test_outer_optimizer_default_is_nesterov_sgd():
    cfg = OuterOptimizerConfig()
    assert cfg.optimizer_class is torch.optim.SGD
    assert cfg.outer_optim_kwargs == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    # default_factory: two configs never share (and mutate) one dict
    assert OuterOptimizerConfig().outer_optim_kwargs is not cfg.outer_optim_kwargs


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("sgd", torch.optim.SGD),
        ("SGD", torch.optim.SGD),
        ("adam", torch.optim.Adam),
        ("adamw", torch.optim.AdamW),
        ("AdamW", torch.optim.AdamW),
        ("torch.optim.SGD", torch.optim.SGD),
        ("torch.optim.RMSprop", torch.optim.RMSprop),
        (torch.optim.Adam, torch.optim.Adam),
    ],
)
def test_optimizer_class_resolves(spec, expected):
    assert resolve_optimizer_class(spec) is expected
    cfg = OuterOptimizerConfig(outer_optim_class=spec, outer_optim_kwargs={"lr": 0.5})
    assert cfg.optimizer_class is expected


@pytest.mark.parametrize(
    "spec",
    ["bogus", "torch.optim.NoSuchOptimizer", "no_such_module.Optimizer", "", "torch.optim.",
     "torch.nn.Linear", "torch.zeros", torch.nn.Linear, 42],
)
def test_bad_optimizer_class(spec):
    message = _raises(OuterOptimizerConfig, ConfigError, "outer_optim_class",
                      outer_optim_class=spec, outer_optim_kwargs={"lr": 1.0})
    assert "sgd" in message or "Optimizer" in message


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"lr": -1}, "lr must be a finite number > 0"),
        ({"lr": 0}, "lr must be a finite number > 0"),
        ({"lr": "0.1"}, "lr must be a finite number > 0"),
        ({"lr": math.nan}, "lr must be a finite number > 0"),
        ({"lr": 0.7, "bogus": 1}, "bogus"),
        ({"lr": 0.7, "momentum": -0.5}, "momentum"),
        # torch: Nesterov needs a momentum
        ({"lr": 0.7, "momentum": 0.0, "nesterov": True}, "Nesterov"),
    ],
)
def test_bad_outer_kwargs(kwargs, fragment):
    message = _raises(OuterOptimizerConfig, ConfigError, "outer_optim_kwargs",
                      outer_optim_kwargs=kwargs)
    assert "--outer-optimizer-lr" in message
    assert fragment in message


def test_outer_kwargs_must_be_a_dict():
    message = _raises(OuterOptimizerConfig, ConfigError, "outer_optim_kwargs",
                      outer_optim_kwargs=[("lr", 0.1)])
    assert "dict" in message


def test_sgd_kwargs_do_not_fit_adam():
    # The default kwargs are SGD's: Adam has no momentum/nesterov, and says so at construction.
    message = _raises(OuterOptimizerConfig, ConfigError, "outer_optim_kwargs",
                      outer_optim_class="adam")
    assert "Adam" in message


def test_plain_averaging_config():
    cfg = OuterOptimizerConfig("sgd", {"lr": 1.0})
    assert cfg.optimizer_class is torch.optim.SGD and cfg.outer_optim_kwargs == {"lr": 1.0}


# --- GTAConfig ------------------------------------------------------------------------------


def test_gta_defaults():
    cfg = GTAConfig()
    assert (cfg.reducer, cfg.consensus_method, cfg.sparsification_method) == ("linear", None, None)
    assert cfg.normalize is True and cfg.density == 1.0 and cfg.int8_mask is False


@pytest.mark.parametrize(
    "field_name, value",
    [
        ("reducer", "mean"),
        ("consensus_method", "majority"),
        ("sparsification_method", "topk"),
        ("density", 0.0),
        ("density", -0.5),
        ("density", 1.5),
    ],
)
def test_gta_bad_value(field_name, value):
    message = _raises(GTAConfig, ConfigError, field_name, **{field_name: value})
    assert repr(value) in message


@pytest.mark.parametrize(
    "field_name, value",
    [("consensus_method", "sum"), ("sparsification_method", "magnitude"), ("density", 0.5)],
)
def test_gta_options_need_the_gta_reducer(field_name, value):
    message = _raises(GTAConfig, ConfigError, field_name, **{field_name: value})
    assert "gta" in message


def test_gta_reducer_constructs_with_its_options():
    cfg = GTAConfig(reducer="gta", consensus_method="count", sparsification_method="random",
                    density=0.3, int8_mask=True, normalize=False)
    assert cfg.density == 0.3 and cfg.int8_mask


def test_gta_only_options_are_refused_with_linear():
    assert "--gta-int8-mask" in _raises(GTAConfig, ConfigError, "int8_mask", int8_mask=True)
    # it did nothing with the linear reducer, silently; now it is refused too
    assert "--local-sgd-reducer gta" in _raises(GTAConfig, ConfigError, "normalize", normalize=False)


def test_density_below_one_needs_a_sparsification_method():
    message = _raises(GTAConfig, ConfigError, "density", reducer="gta", density=0.5)
    assert "--gta-sparsification-method" in message


# --- types: a string is not a boolean, a bool is not a count, numbers are finite -------------


@pytest.mark.parametrize(
    "cls, field_name, value",
    [
        (LocalSGDConfig, "use_async", "no"),  # before: truthy, so A-EDiT turned ON
        (LocalSGDConfig, "skip_anomaly", "false"),
        (LocalSGDConfig, "pseudo_gradnorm_reduce", 1),
        (LocalSGDConfig, "cpu_offload", None),
        (LocalSGDConfig, "is_debug", "yes"),
        (GTAConfig, "normalize", "no"),
        (GTAConfig, "int8_mask", 0),
    ],
)
def test_a_boolean_must_be_a_bool(cls, field_name, value):
    message = _raises(cls, ConfigError, field_name, **{field_name: value})
    assert "True or False" in message and repr(value) in message


@pytest.mark.parametrize(
    "field_name, value",
    [
        ("local_sgd_sync_interval", True),  # before: accepted as H=1
        ("local_sgd_warmup_steps", False),
        ("min_total_global_steps", "10"),
        ("ewma_warmup_steps", 2.5),
    ],
)
def test_a_count_must_be_an_int(field_name, value):
    message = _raises(LocalSGDConfig, ConfigError, field_name, **{field_name: value})
    assert "integer" in message and repr(value) in message


@pytest.mark.parametrize(
    "cls, field_name, value",
    [
        (LocalSGDConfig, "local_sgd_sync_time", "5"),  # before: a bare TypeError naming nothing
        (LocalSGDConfig, "step_weight_ratio", "0.5"),
        (LocalSGDConfig, "ewma_alpha", math.nan),
        (LocalSGDConfig, "ewma_threshold", math.inf),
        (LocalSGDConfig, "clip_pseudo_grad", "1.0"),
        (LocalSGDConfig, "weight_softmax_temperature", math.nan),
        (LocalSGDConfig, "step_weight_ratio", True),
        (GTAConfig, "density", "0.5"),
        (GTAConfig, "density", math.nan),
    ],
)
def test_a_number_must_be_a_finite_number(cls, field_name, value):
    message = _raises(cls, ConfigError, field_name, **{field_name: value})
    assert "finite number" in message and repr(value) in message


def test_numpy_numbers_are_numbers():
    np = pytest.importorskip("numpy")
    cfg = LocalSGDConfig(local_sgd_sync_interval=np.int64(4), local_sgd_sync_time=np.float64(2.5), use_async=True)
    assert cfg.local_sgd_sync_interval == 4


def test_a_program_may_keep_settings_of_a_feature_it_turns_off():
    # The flags refuse these (they would do nothing); a program toggling a feature keeps them.
    cfg = LocalSGDConfig(local_sgd_sync_time=30.0, min_total_global_steps=1, ewma_alpha=0.5)
    assert not cfg.use_async and not cfg.skip_anomaly


@pytest.mark.parametrize(
    "spec, kwargs, fragment",
    [
        ("sgd", {"lr": math.inf}, "lr must be a finite number > 0"),
        ("sgd", {"lr": 0.7, "momentum": 1.5}, "momentum must be in [0, 1)"),  # torch accepts it
        ("sgd", {"lr": 0.7, "momentum": 1.0}, "momentum must be in [0, 1)"),
        ("sgd", {"lr": 0.7, "momentum": math.nan}, "momentum must be a finite number"),
        ("sgd", {"lr": 0.7, "momentum": "0.9"}, "momentum must be a finite number"),
        ("sgd", {"lr": 0.7, "momentum": 0.9, "nesterov": "yes"}, "nesterov must be True or False"),
        ("sgd", {"momentum": 0.9}, "give lr"),
        ("adam", {"lr": 0.01, "momentum": 0.5}, "Adam has no option 'momentum'"),
        ("adam", {"lr": 0.01, "betas": [0.9, math.nan]}, "betas must hold finite numbers"),
        ("adam", {"lr": 0.01, "params": []}, "no option 'params'"),
        ("torch.optim.RMSprop", {"lr": 0.01, "momentum": 1.2}, "momentum must be in [0, 1)"),
    ],
)
def test_outer_kwargs_checked_against_the_optimizer(spec, kwargs, fragment):
    message = _raises(OuterOptimizerConfig, ConfigError, "outer_optim_kwargs",
                      outer_optim_class=spec, outer_optim_kwargs=kwargs)
    assert fragment in message


def test_unknown_outer_kwarg_lists_the_options():
    message = _raises(OuterOptimizerConfig, ConfigError, "outer_optim_kwargs",
                      outer_optim_class="adam", outer_optim_kwargs={"lr": 0.01, "nesterov": True})
    assert "betas" in message and "eps" in message


def test_valid_outer_kwargs_of_other_optimizers():
    cfg = OuterOptimizerConfig("adamw", {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.0, "amsgrad": False})
    assert cfg.optimizer_class is torch.optim.AdamW
    cfg = OuterOptimizerConfig("torch.optim.RMSprop", {"lr": 1e-2, "momentum": 0.5, "centered": True})
    assert cfg.outer_optim_kwargs["momentum"] == 0.5


# --- quantized exchange -----------------------------------------------------------------------


def test_exchange_options_are_validated_and_pointless_ones_refused():
    assert LocalSGDConfig(exchange_dtype="int4", exchange_block_size=64, exchange_error_feedback=True)
    _raises(LocalSGDConfig, ConfigError, "exchange_dtype", exchange_dtype="int2")
    _raises(LocalSGDConfig, ConfigError, "exchange_block_size", exchange_dtype="int8", exchange_block_size=7)
    _raises(LocalSGDConfig, ConfigError, "exchange_block_size", exchange_dtype="int8", exchange_block_size=True)
    _raises(LocalSGDConfig, ConfigError, "exchange_block_size", exchange_dtype="bf16", exchange_block_size=64)
    _raises(LocalSGDConfig, ConfigError, "exchange_error_feedback", exchange_error_feedback=True)


def test_topk_exchange_options_are_validated_and_pointless_ones_refused():
    """The sparse (top-k) exchange: density in (0, 1], a chunk whose indices fit 16 bits, values
    in fp32 / int8 / int4 / int2, int2 only with top-k, error feedback on by default with it."""
    cfg = LocalSGDConfig(exchange_dtype="int2", exchange_topk_density=0.02)
    assert cfg.error_feedback and cfg.exchange_topk_chunk == 4096
    assert not LocalSGDConfig(exchange_dtype="int2", exchange_topk_density=0.02,
                              exchange_error_feedback=False).error_feedback
    assert LocalSGDConfig(exchange_topk_density=1.0, exchange_topk_chunk=65536).error_feedback  # fp32 values
    assert not LocalSGDConfig(exchange_dtype="int8").error_feedback
    assert LocalSGDConfig(exchange_dtype="int8", exchange_error_feedback=True).error_feedback
    for bad in (0.0, -0.1, 1.5, float("nan"), "0.02", True):
        _raises(LocalSGDConfig, ConfigError, "exchange_topk_density", exchange_topk_density=bad)
    message = _raises(LocalSGDConfig, ConfigError, "exchange_topk_chunk", exchange_topk_density=0.02,
                      exchange_topk_chunk=65537)
    assert "17 index bits" in message
    _raises(LocalSGDConfig, ConfigError, "exchange_topk_chunk", exchange_topk_density=0.02, exchange_topk_chunk=1)
    # without top-k: its chunk does nothing, and int2 is refused
    _raises(LocalSGDConfig, ConfigError, "exchange_topk_chunk", exchange_topk_chunk=1024)
    assert "--local-sgd-exchange-topk-density" in _raises(LocalSGDConfig, ConfigError, "exchange_dtype",
                                                          exchange_dtype="int2")
    # values the top-k exchange does not send; a block size it does not use
    for dtype in ("bf16", "fp8"):
        _raises(LocalSGDConfig, ConfigError, "exchange_dtype", exchange_dtype=dtype, exchange_topk_density=0.02)
    _raises(LocalSGDConfig, ConfigError, "exchange_block_size", exchange_dtype="int4", exchange_topk_density=0.02,
            exchange_block_size=64)
    _raises(LocalSGDConfig, ConfigError, "exchange_error_feedback", exchange_error_feedback="no")


def test_gta_refuses_a_topk_exchange():
    from megatron_edit.config import check_combination

    with pytest.raises(ConfigError, match="--local-sgd-exchange-topk-density"):
        check_combination(LocalSGDConfig(exchange_topk_density=0.02), GTAConfig(reducer="gta"))


def test_gta_refuses_a_quantized_exchange():
    from megatron_edit.config import check_combination

    check_combination(LocalSGDConfig(exchange_dtype="int8"), GTAConfig())
    with pytest.raises(ConfigError, match="--local-sgd-exchange-dtype"):
        check_combination(LocalSGDConfig(exchange_dtype="int8"), GTAConfig(reducer="gta"))


@pytest.mark.parametrize("cls", [LocalSGDConfig, OuterOptimizerConfig, GTAConfig])
def test_every_field_is_documented_where_help_and_ides_see_it(cls):
    """The strings under the fields are in the class docstring (help(), IDEs),
    each with the field's default and flag."""
    import pydoc

    from megatron_edit.config import FLAG_NAMES, field_docs

    docs = field_docs(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert sorted(docs) == sorted(names)  # every field has its documentation
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    for name in names:
        assert f"{name} = " in text and docs[name].splitlines()[0] in text, name
        assert FLAG_NAMES[name].split(" ")[0] in text, name


def test_delayed_outer_step_checks():
    cfg = LocalSGDConfig(local_sgd_sync_interval=4, outer_step_delay=3, outer_merge_alpha=1.0)
    assert (cfg.outer_step_delay, cfg.outer_merge_alpha) == (3, 1.0)
    assert LocalSGDConfig().outer_step_delay == 0 and LocalSGDConfig().outer_merge_alpha is None
    # the default merge: alpha 0.5 with a delay (chosen by the convergence benchmark)
    assert LocalSGDConfig(local_sgd_sync_interval=4, outer_step_delay=1).merge_alpha == 0.5
    assert LocalSGDConfig(local_sgd_sync_interval=4, outer_step_delay=1, outer_merge_alpha=0.0).merge_alpha == 0.0
    _raises(LocalSGDConfig, ConfigError, "outer_step_delay", outer_step_delay=1.0, local_sgd_sync_interval=4)
    _raises(LocalSGDConfig, ConfigError, "outer_step_delay", outer_step_delay=True, local_sgd_sync_interval=4)
    _raises(LocalSGDConfig, ConfigError, "outer_merge_alpha", outer_merge_alpha=float("nan"))
    message = _raises(LocalSGDConfig, ConfigError, "outer_merge_alpha", outer_merge_alpha=0.5)
    assert "--local-sgd-outer-step-delay" in message
    message = _raises(LocalSGDConfig, ConfigError, "outer_step_delay", outer_step_delay=4, local_sgd_sync_interval=4)
    assert "--local-sgd-sync-interval (4)" in message and "one in flight" in message
    # A-EDiT plans every interval but the last at least tau + 1 steps: tau >= H (its first interval) too
    LocalSGDConfig(use_async=True, outer_step_delay=4, local_sgd_sync_interval=2, outer_merge_alpha=0.0)


def test_a_delay_with_a_edit_and_auto_overlap_over_torchft_are_accepted(monkeypatch):
    """A-EDiT's delayed outer step and the automatic overlap (on EDiT's grid and with A-EDiT)
    over torchft (issue 60): accepted."""
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # torchft "installed"
    ft = dict(sync_backend="torchft", replica_id=0, lighthouse="http://127.0.0.1:29510", local_sgd_sync_interval=4)
    assert LocalSGDConfig(use_async=True, outer_step_delay=1, **ft).outer_step_delay == 1
    assert LocalSGDConfig(use_async=True, auto_overlap=True, auto_formats="fp32,int8", **ft).auto_overlap
    assert LocalSGDConfig(auto_overlap=True, auto_fragments="1,2", **ft).allowed_fragments == (1, 2)
    # and A-EDiT's fragments, chosen or given (refused before: the torch backend only)
    assert LocalSGDConfig(use_async=True, auto_overlap=True, auto_fragments="1,2", **ft).allowed_fragments == (1, 2)
    assert LocalSGDConfig(use_async=True, fragments=2, **ft).fragments == 2


def test_fragments_checks():
    cfg = LocalSGDConfig(local_sgd_sync_interval=8, fragments=4, outer_step_delay=1)
    assert (cfg.fragments, LocalSGDConfig().fragments) == (4, 1)
    _raises(LocalSGDConfig, ConfigError, "fragments", fragments=0)
    _raises(LocalSGDConfig, ConfigError, "fragments", fragments=2.0, local_sgd_sync_interval=4)
    message = _raises(LocalSGDConfig, ConfigError, "fragments", fragments=3, local_sgd_sync_interval=8)
    assert "must divide --local-sgd-sync-interval (8)" in message
    # tau < H/F: one fragment in flight at a time
    message = _raises(LocalSGDConfig, ConfigError, "outer_step_delay", fragments=4, outer_step_delay=2,
                      local_sgd_sync_interval=8)
    assert "H/F = 2" in message and "--local-sgd-fragments" not in message.split(":")[0]
    # A-EDiT with fragments (issue 60): one fragment per sync, a sync every T/F seconds, the first
    # interval H/F steps; tau is not held to H/F (A-EDiT plans each interval at least tau + 1 steps)
    cfg = LocalSGDConfig(use_async=True, fragments=2, local_sgd_sync_interval=4, local_sgd_sync_time=6.0)
    assert (cfg.async_sync_time, cfg.async_first_interval) == (3.0, 2)
    assert LocalSGDConfig(use_async=True, local_sgd_sync_time=6.0).async_sync_time == 6.0
    LocalSGDConfig(use_async=True, fragments=2, local_sgd_sync_interval=4, outer_step_delay=3)
    message = _raises(LocalSGDConfig, ConfigError, "fragments", use_async=True, fragments=3, local_sgd_sync_interval=4)
    assert "must divide --local-sgd-sync-interval (4)" in message


def test_outer_merge_rule_checks():
    assert LocalSGDConfig().outer_merge_rule is None  # lerp, with a delay
    # Given without a delay it does nothing: refused, lerp too (before: lerp passed silently).
    message = _raises(LocalSGDConfig, ConfigError, "outer_merge_rule", outer_merge_rule="lerp")
    assert "--local-sgd-outer-step-delay" in message
    LocalSGDConfig(local_sgd_sync_interval=4, outer_step_delay=2, outer_merge_rule="lerp")
    cfg = LocalSGDConfig(local_sgd_sync_interval=4, outer_step_delay=2, outer_merge_rule="keep_local")
    assert cfg.outer_merge_rule == "keep_local"
    _raises(LocalSGDConfig, ConfigError, "outer_merge_rule", outer_merge_rule="keep", local_sgd_sync_interval=4,
            outer_step_delay=2)
    message = _raises(LocalSGDConfig, ConfigError, "outer_merge_rule", outer_merge_rule="keep_local")
    assert "--local-sgd-outer-step-delay" in message
    message = _raises(LocalSGDConfig, ConfigError, "outer_merge_alpha", outer_merge_rule="keep_local",
                      outer_merge_alpha=0.5, outer_step_delay=1, local_sgd_sync_interval=4)
    assert "--local-sgd-outer-merge-rule keep_local" in message


FT = dict(sync_backend="torchft", replica_id=0, lighthouse="http://127.0.0.1:29510")


def test_torchft_backend_checks(monkeypatch):
    """The torchft backend: its settings, one line for each refusal, the torch backend untouched."""
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # torchft "installed"
    assert LocalSGDConfig().sync_backend == "torch"
    cfg = LocalSGDConfig(**FT, min_replicas=2, exchange_dtype="int8", exchange_error_feedback=True)
    assert (cfg.replica_id, cfg.min_replicas, cfg.lighthouse_address) == (0, 2, "http://127.0.0.1:29510")
    LocalSGDConfig(**FT, exchange_topk_density=0.02, exchange_dtype="int2")  # the sparse exchange runs over it
    LocalSGDConfig(**FT, skip_anomaly=True, pseudo_gradnorm_reduce=True)  # and so does the penalty
    LocalSGDConfig(**FT, fragments=2, local_sgd_sync_interval=4)  # and streaming fragments
    LocalSGDConfig(**FT, outer_step_delay=1, local_sgd_sync_interval=4)  # and the delayed outer step
    _raises(LocalSGDConfig, ConfigError, "sync_backend", sync_backend="gloo")
    for field, value in (("lighthouse", "http://h:1"), ("replica_id", 1), ("min_replicas", 2)):
        message = _raises(LocalSGDConfig, ConfigError, field, **{field: value})
        assert "--local-sgd-sync-backend torchft" in message
    _raises(LocalSGDConfig, ConfigError, "replica_id", **{**FT, "replica_id": None})
    _raises(LocalSGDConfig, ConfigError, "replica_id", **{**FT, "replica_id": -1})
    _raises(LocalSGDConfig, ConfigError, "min_replicas", **{**FT, "min_replicas": 0})
    message = _raises(LocalSGDConfig, ConfigError, "lighthouse", **{**FT, "lighthouse": None})
    assert "TORCHFT_LIGHTHOUSE" in message
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://env:2")
    assert LocalSGDConfig(**{**FT, "lighthouse": None}).lighthouse_address == "http://env:2"
    LocalSGDConfig(**FT, use_async=True)  # and A-EDiT
    # refused by design (docs/concepts/torchft.md, 'Warmup'), not as a gap: a ConfigError, not NotSupportedYet
    with pytest.raises(ConfigError) as refused:
        LocalSGDConfig(**FT, local_sgd_warmup_steps=2)
    message = str(refused.value)
    assert not isinstance(refused.value, NotSupportedYet) and "local_sgd_warmup_steps" in message
    assert "does not warm up over the slow link" in message and "Warmup" in message and "\n" not in message
    from megatron_edit.config import check_combination

    check_combination(LocalSGDConfig(**FT), GTAConfig(reducer="gta"))  # GTA runs over it too


def test_torchft_backend_without_torchft_is_one_line(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "torchft" else object())
    message = _raises(LocalSGDConfig, ConfigError, "sync_backend", **FT)
    assert "pip install torchft==0.2.0" in message and "\n" not in message


# --- auto_overlap (settings from the measured link) -------------------------------------------

AUTO = dict(auto_overlap=True, local_sgd_sync_interval=8)


def test_auto_overlap_settings():
    cfg = LocalSGDConfig(**AUTO, auto_formats="int4, fp32,int8", auto_every=5)
    assert cfg.allowed_formats == ("fp32", "int8", "int4")  # most precise first
    assert LocalSGDConfig(**AUTO).allowed_formats == ("fp32",)
    assert LocalSGDConfig(**AUTO, exchange_dtype="int8").allowed_formats == ("int8",)
    # a merge for the delay it may choose; a block size for the scaled formats it may choose
    LocalSGDConfig(**AUTO, outer_merge_alpha=0.0)
    LocalSGDConfig(**AUTO, auto_formats="fp32,int8", exchange_block_size=64)
    assert LocalSGDConfig(**AUTO).allowed_fragments == (1,)
    assert LocalSGDConfig(**AUTO, fragments=2).allowed_fragments == (2,)
    assert LocalSGDConfig(**AUTO, auto_fragments="4, 1,2").allowed_fragments == (1, 2, 4)  # fewest first


@pytest.mark.parametrize("kwargs, exc, field_name, match", [
    (dict(auto_every=5, local_sgd_sync_interval=8), ConfigError, "auto_every", "only used by --local-sgd-auto-overlap"),
    (dict(auto_formats="fp32,int8", local_sgd_sync_interval=8), ConfigError, "auto_formats", "only used by"),
    (dict(AUTO, auto_every=0), ConfigError, "auto_every", ">= 1"),
    (dict(AUTO, auto_formats="fp32,int9"), ConfigError, "auto_formats", "comma-separated list"),
    (dict(AUTO, auto_formats="fp32,fp32"), ConfigError, "auto_formats", "distinct"),
    (dict(AUTO, auto_formats="int8,int4"), ConfigError, "auto_formats", "starts in --local-sgd-exchange-dtype fp32"),
    (dict(auto_fragments="1,2", local_sgd_sync_interval=8), ConfigError, "auto_fragments", "only used by"),
    (dict(AUTO, auto_fragments="1,x"), ConfigError, "auto_fragments", "distinct integers >= 1"),
    (dict(AUTO, auto_fragments="1,1"), ConfigError, "auto_fragments", "distinct integers >= 1"),
    (dict(AUTO, auto_fragments="1,0"), ConfigError, "auto_fragments", "distinct integers >= 1"),
    (dict(AUTO, auto_fragments="1,3"), ConfigError, "auto_fragments", "3 must divide --local-sgd-sync-interval 8"),
    (dict(AUTO, auto_fragments="1,8"), ConfigError, "auto_fragments", "8 must divide"),
    (dict(AUTO, auto_fragments="2,4"), ConfigError, "auto_fragments", "starts with --local-sgd-fragments 1"),
    (dict(AUTO, outer_step_delay=4, fragments=2, auto_fragments="1,2"), ConfigError, "outer_step_delay",
     "must be < H/F = 4 with 2 fragments"),
    (dict(AUTO, local_sgd_sync_interval=4, fragments=4), ConfigError, "auto_overlap", "no room for a delay"),
    # A-EDiT chooses its fragments too (issue 60), from the same list: divisors of H with H/F >= 2
    (dict(AUTO, use_async=True, auto_fragments="1,3"), ConfigError, "auto_fragments", "3 must divide"),
    # top-k formats: named as the planner names them; the one the run starts in must be allowed
    (dict(AUTO, auto_formats="fp32,topk0.02-bf16"), ConfigError, "auto_formats", "topk<density>-<values>"),
    (dict(AUTO, auto_formats="fp32,int2"), ConfigError, "auto_formats", "comma-separated list"),
    (dict(AUTO, exchange_dtype="int2", exchange_topk_density=0.02, auto_formats="int8,topk0.05-int2"), ConfigError,
     "auto_formats", "starts in --local-sgd-exchange-dtype int2 --local-sgd-exchange-topk-density 0.02 (topk0.02-int2)"),
    # error feedback where no format it may choose drops anything
    (dict(AUTO, exchange_error_feedback=True), ConfigError, "exchange_error_feedback", "an fp32 exchange drops nothing"),
    (dict(AUTO, exchange_error_feedback=True, auto_formats="fp32"), ConfigError, "exchange_error_feedback",
     "drops nothing"),
    # a top-k chunk or a block size no format it may choose uses
    (dict(AUTO, exchange_topk_chunk=1024, auto_formats="fp32,int8"), ConfigError, "exchange_topk_chunk", "only used"),
    (dict(AUTO, exchange_dtype="int2", exchange_topk_density=0.02, exchange_block_size=64,
          auto_formats="fp32,topk0.02-int2"), ConfigError, "exchange_block_size", "one scale per chunk"),
])
def test_auto_overlap_refusals(kwargs, exc, field_name, match):
    assert match in _raises(LocalSGDConfig, exc, field_name, **kwargs)


def test_auto_overlap_with_a_edit_chooses_the_delay_and_format():
    """--local-sgd-auto-overlap with --local-sgd-async (issue 60): accepted, from no delay or a
    given one; H is A-EDiT's planned interval, so a short first interval is no refusal."""
    for extra in ({}, dict(outer_step_delay=2), dict(local_sgd_sync_interval=2, auto_formats="fp32,int8")):
        cfg = LocalSGDConfig(**dict(AUTO, use_async=True, **extra))
        assert cfg.auto_overlap and cfg.allowed_fragments == (1,)
    # and the fragments (issue 60): before, refused ("A-EDiT has no fragments")
    cfg = LocalSGDConfig(**dict(AUTO, use_async=True, auto_fragments="1,2"))
    assert cfg.allowed_fragments == (1, 2)
    assert LocalSGDConfig(**dict(AUTO, use_async=True, fragments=2)).allowed_fragments == (2,)
    # over torchft too (issue 60), the chosen fragments with it
    monkey = __import__("importlib").util
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(monkey, "find_spec", lambda name, *a: object())  # torchft "installed"
        ft = dict(AUTO, use_async=True, sync_backend="torchft", replica_id=0, lighthouse="http://127.0.0.1:29510")
        assert LocalSGDConfig(**ft).auto_overlap
        assert LocalSGDConfig(**ft, auto_fragments="1,2").allowed_fragments == (1, 2)


def test_auto_overlap_with_error_feedback_and_top_k_formats():
    """--local-sgd-auto-overlap with error feedback and the top-k exchange (issue 60): top-k
    formats in --local-sgd-auto-formats, most precise first (the dense ones, then the top-k ones
    by the bits they send per element); error feedback is one setting for the run, on by default
    once a top-k format may be chosen; the top-k chunk and the block size are accepted where a
    format it may choose uses them."""
    cfg = LocalSGDConfig(**AUTO, exchange_dtype="int2", exchange_topk_density=0.02,
                         auto_formats="topk0.02-int2, int8,topk0.05-int2,topk0.02-int4")
    assert cfg.start_format == "topk0.02-int2"
    assert cfg.allowed_formats == ("int8", "topk0.05-int2", "topk0.02-int4", "topk0.02-int2")
    assert cfg.error_feedback  # the default: a top-k format may be chosen
    started_dense = LocalSGDConfig(**AUTO, exchange_dtype="int8", auto_formats="int8,topk0.02-int2")
    assert started_dense.error_feedback and started_dense.may_use("topk")
    assert not LocalSGDConfig(**AUTO, exchange_dtype="int8", auto_formats="fp32,int8").error_feedback
    # once refused (NotSupportedYet): error feedback with the automatic overlap, and the top-k exchange
    assert LocalSGDConfig(**AUTO, exchange_dtype="int8", exchange_error_feedback=True).error_feedback
    assert LocalSGDConfig(**AUTO, exchange_dtype="int2", exchange_topk_density=0.1).error_feedback
    assert LocalSGDConfig(**AUTO, exchange_error_feedback=True, auto_formats="fp32,int8").error_feedback
    assert not LocalSGDConfig(**AUTO, exchange_dtype="int2", exchange_topk_density=0.02,
                              exchange_error_feedback=False, auto_formats="int8,topk0.02-int2").error_feedback
    LocalSGDConfig(**AUTO, exchange_topk_chunk=1024, auto_formats="fp32,topk0.02-int2")
    LocalSGDConfig(**AUTO, exchange_dtype="int2", exchange_topk_density=0.02, exchange_block_size=64,
                   auto_formats="int8,topk0.02-int2")


def test_auto_overlap_starts_with_the_given_delay():
    """--local-sgd-outer-step-delay with --local-sgd-auto-overlap is the delay the run starts
    with (as the format and the fragments), until its first decision."""
    from megatron_edit.mcore.auto_overlap import AutoOverlap

    config = LocalSGDConfig(**AUTO, outer_step_delay=3)
    start = AutoOverlap(None, config).initial_config()
    assert (start.outer_step_delay, start.exchange_dtype, start.fragments, start.auto_overlap) == (3, "fp32", 1, False)
    assert start.merge_alpha == 0.5
    assert AutoOverlap(None, LocalSGDConfig(**AUTO)).initial_config().outer_step_delay == 0


def test_auto_overlap_with_gta_keeps_fp32():
    from megatron_edit.config import check_combination

    check_combination(LocalSGDConfig(**AUTO), GTAConfig(reducer="gta"))
    with pytest.raises(ConfigError, match="--local-sgd-auto-formats fp32,int8: GTA's sign consensus"):
        check_combination(LocalSGDConfig(**AUTO, auto_formats="fp32,int8"), GTAConfig(reducer="gta"))


# --- the per-sync record's path ---------------------------------------------------------------


def test_a_sync_record_path_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    """Refused when the config is built (before any work, on every route), naming the flag."""
    good = LocalSGDConfig(sync_record=str(tmp_path / "w{worker}.jsonl"))
    assert good.sync_record.endswith("w{worker}.jsonl")
    (tmp_path / "locked").mkdir(mode=0o500)
    for path, match in ((tmp_path / "absent" / "r.jsonl", "does not exist (create it first)"),
                        (tmp_path, "it is a directory"),
                        (tmp_path / "{run}.jsonl", "braces other than {worker}"),
                        ("", "must be a file's path or None")):
        message = _raises(LocalSGDConfig, ConfigError, "sync_record", sync_record=str(path))
        assert match in message and "\n" not in message, message
    if os.geteuid() != 0:  # (root writes anywhere)
        message = _raises(LocalSGDConfig, ConfigError, "sync_record", sync_record=str(tmp_path / "locked" / "r"))
        assert "is not writable" in message, message
