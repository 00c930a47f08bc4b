"""megatron_edit.arguments: the flags, and their one mapping onto the configs."""

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from megatron_edit import arguments
from megatron_edit.arguments import configs_from_args, local_sgd_args_provider
from megatron_edit.config import (
    FLAG_NAMES,
    ConfigError,
    GTAConfig,
    LocalSGDConfig,
    OuterOptimizerConfig,
)


def _parser():
    return local_sgd_args_provider(argparse.ArgumentParser())


def _configs(*argv):
    return configs_from_args(_parser().parse_args(["--use-local-sgd", *argv]))


def test_provider_returns_the_parser_it_was_given():
    parser = argparse.ArgumentParser()
    assert local_sgd_args_provider(parser) is parser


def test_off_without_use_local_sgd():
    assert configs_from_args(_parser().parse_args([])) is None
    # Other flags (even bad ones) do nothing without --use-local-sgd.
    assert configs_from_args(_parser().parse_args(["--local-sgd-sync-interval", "0"])) is None
    assert configs_from_args(argparse.Namespace()) is None


def test_defaults_equal_the_config_defaults():
    local, outer, gta = _configs()
    assert local == LocalSGDConfig()
    assert outer.optimizer_class is torch.optim.SGD
    assert outer.outer_optim_kwargs == OuterOptimizerConfig().outer_optim_kwargs
    assert gta == GTAConfig()


def test_flags_map_onto_fields():
    local, outer, gta = _configs(
        "--local-sgd-sync-interval", "8",
        "--local-sgd-warmup-steps", "100",
        "--local-sgd-sync-mode", "step_end",
        "--local-sgd-cpu-offload",
        "--outer-optimizer-lr", "0.5",
        "--outer-optimizer-momentum", "0.8",
        "--no-outer-optimizer-nesterov",
    )
    assert local.local_sgd_sync_interval == 8
    assert local.local_sgd_warmup_steps == 100
    assert local.sync_mode == "step_end"
    assert local.cpu_offload is True
    assert outer.optimizer_class is torch.optim.SGD
    assert outer.outer_optim_kwargs == {"lr": 0.5, "momentum": 0.8, "nesterov": False}
    assert gta == GTAConfig()


@pytest.mark.parametrize("argv, fragment", [
    (["--outer-optimizer", "adam", "--outer-optimizer-lr", "0.001", "--outer-optimizer-momentum", "0.5"],
     "--outer-optimizer-momentum is for the SGD outer optimizer"),
    (["--outer-optimizer", "adamw", "--outer-optimizer-lr", "0.001", "--outer-optimizer-nesterov"],
     "--[no-]outer-optimizer-nesterov is for the SGD outer optimizer"),
    (["--outer-optimizer", "adam"], "needs --outer-optimizer-lr"),
    (["--outer-optimizer", "torch.optim.RMSprop", "--outer-optimizer-momentum", "0.5",
      "--outer-optimizer-lr", "0.01"], "--outer-optimizer-kwargs"),
])
def test_sgd_flags_with_another_optimizer_are_refused(argv, fragment):
    # Before: momentum silently dropped and Adam run at SGD's lr 0.7 (validation loss 137).
    with pytest.raises(ConfigError) as info:
        _configs(*argv)
    assert fragment in str(info.value)


def test_other_optimizers_take_their_options_in_json():
    _, outer, _ = _configs("--outer-optimizer", "torch.optim.RMSprop", "--outer-optimizer-lr", "0.01",
                           "--outer-optimizer-kwargs", '{"momentum": 0.5}')
    assert outer.optimizer_class is torch.optim.RMSprop
    assert outer.outer_optim_kwargs == {"lr": 0.01, "momentum": 0.5}
    _, outer, _ = _configs("--outer-optimizer", "adam", "--outer-optimizer-kwargs", '{"lr": 0.01}')
    assert outer.outer_optim_kwargs == {"lr": 0.01}


@pytest.mark.parametrize("argv, flag, fragment", [
    (["--outer-optimizer-lr", "inf"], "--outer-optimizer-lr", "finite"),
    (["--outer-optimizer-lr", "nan"], "--outer-optimizer-lr", "finite"),
    (["--outer-optimizer-momentum", "nan"], "--outer-optimizer-momentum", "finite"),
    (["--outer-optimizer-momentum", "1.5"], "--outer-optimizer-momentum", "[0, 1)"),
    (["--outer-optimizer-momentum", "1"], "--outer-optimizer-momentum", "[0, 1)"),
    (["--local-sgd-sync-interval", "0"], "--local-sgd-sync-interval", ">= 1"),
    (["--local-sgd-clip-pseudo-grad", "nan"], "--local-sgd-clip-pseudo-grad", "finite"),
    (["--gta-density", "inf"], "--gta-density", "finite"),
])
def test_non_finite_and_out_of_range_values_are_refused(argv, flag, fragment):
    # Before: --outer-optimizer-lr inf and --outer-optimizer-momentum nan trained to a NaN loss
    # and exited 0; momentum 1.5 reached validation loss 14.2.
    with pytest.raises(ConfigError) as info:
        _configs(*argv)
    assert flag in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("argv, flag, needed", [
    (["--local-sgd-sync-time", "30"], "--local-sgd-sync-time", "--local-sgd-async"),
    (["--local-sgd-min-total-global-steps", "5"], "--local-sgd-min-total-global-steps", "--local-sgd-async"),
    (["--local-sgd-async", "--local-sgd-step-weight-ratio", "0.3"], "--local-sgd-step-weight-ratio",
     "--local-sgd-use-step-weight"),
    (["--local-sgd-ewma-alpha", "0.5"], "--local-sgd-ewma-alpha", "--local-sgd-skip-anomaly"),
    (["--local-sgd-ewma-warmup-steps", "3"], "--local-sgd-ewma-warmup-steps", "--local-sgd-skip-anomaly"),
    (["--local-sgd-ewma-threshold", "2"], "--local-sgd-ewma-threshold", "--local-sgd-skip-anomaly"),
    (["--local-sgd-use-step-weight"], "--local-sgd-use-step-weight", "--local-sgd-async"),
    (["--local-sgd-weight-softmax-temperature", "0.5"], "--local-sgd-weight-softmax-temperature",
     "--local-sgd-pseudo-gradnorm-reduce"),
    (["--gta-density", "0.5"], "--gta-density", "gta"),
])
def test_a_flag_that_would_do_nothing_is_refused(argv, flag, needed):
    with pytest.raises(ConfigError) as info:
        _configs(*argv)
    assert flag in str(info.value) and needed in str(info.value)


def test_flags_at_their_defaults_are_not_refused():
    # Typing a default changes nothing, so it is not a flag "that does nothing".
    _configs("--local-sgd-sync-time", "600", "--local-sgd-ewma-alpha", "0.02")


def test_configs_from_args_wants_a_namespace():
    with pytest.raises(TypeError, match="argparse.Namespace.*got dict"):
        configs_from_args({"use_local_sgd": True})
    with pytest.raises(TypeError, match="got str"):
        configs_from_args("--use-local-sgd")
    with pytest.raises(ConfigError, match="local_sgd_args_provider"):
        configs_from_args(argparse.Namespace(use_local_sgd=True))


def test_help_shows_every_default():
    parser = _parser()
    text = parser.format_help()
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert action.help and "%(default)" in action.help, action.option_strings
    flat = " ".join(text.split())  # argparse wraps the lines
    assert "(default: 0.7 with SGD, 1.0 with --local-sgd-exchange-topk-density" in flat
    assert "(default: 0.9, 0.0 with --local-sgd-exchange-topk-density;" in flat
    assert "ignored by optimizers without one only if" not in text  # the old, garbled text


def test_outer_optimizer_adam_with_json_kwargs():
    _, outer, _ = _configs(
        "--outer-optimizer", "adam",
        "--outer-optimizer-lr", "0.001",
        "--outer-optimizer-kwargs", '{"betas": [0.9, 0.95], "eps": 1e-6}',
    )
    assert outer.optimizer_class is torch.optim.Adam
    # SGD's momentum / nesterov are not passed to Adam
    assert outer.outer_optim_kwargs == {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-6}


def test_the_outer_sgd_defaults_with_the_sparse_exchange_are_sparselocos():
    """With top-k: lr 1 without momentum (the convergence benchmark's choice); a flag or a JSON
    key still sets its value; without top-k the paper's Nesterov SGD."""
    topk = ("--local-sgd-exchange-topk-density", "0.03", "--local-sgd-exchange-dtype", "int2")
    _, outer, _ = _configs(*topk)
    assert outer.outer_optim_kwargs == {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    _, outer, _ = _configs(*topk, "--outer-optimizer-momentum", "0.5", "--outer-optimizer-kwargs", '{"lr": 0.9}')
    assert outer.outer_optim_kwargs == {"lr": 0.9, "momentum": 0.5, "nesterov": False}
    _, outer, _ = _configs()
    assert outer.outer_optim_kwargs == {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def test_json_kwargs_set_what_no_flag_sets():
    _, outer, _ = _configs("--outer-optimizer-kwargs", '{"lr": 1.0, "momentum": 0.0, "nesterov": false}')
    assert outer.outer_optim_kwargs == {"lr": 1.0, "momentum": 0.0, "nesterov": False}
    _, outer, _ = _configs("--outer-optimizer-kwargs", '{"dampening": 0.1}', "--no-outer-optimizer-nesterov")
    assert outer.outer_optim_kwargs == {"lr": 0.7, "momentum": 0.9, "nesterov": False, "dampening": 0.1}


@pytest.mark.parametrize("flag, value, key", [
    ("--outer-optimizer-lr", "0.5", "lr"),
    ("--outer-optimizer-momentum", "0.5", "momentum"),
    ("--no-outer-optimizer-nesterov", None, "nesterov"),
])
def test_a_flag_and_json_setting_the_same_key_is_refused(flag, value, key):
    # The JSON would override the flag: the flag would do nothing.
    argv = [flag] + ([value] if value else []) + ["--outer-optimizer-kwargs", f'{{"{key}": 0.0}}']
    with pytest.raises(ConfigError, match=f"--outer-optimizer-kwargs both set '{key}'"):
        _configs(*argv)


def test_dotted_sgd_path_gets_the_same_momentum_as_sgd():
    _, by_name, _ = _configs("--outer-optimizer", "sgd")
    _, by_path, _ = _configs("--outer-optimizer", "torch.optim.SGD")
    assert by_path.outer_optim_kwargs == by_name.outer_optim_kwargs


def test_none_means_none_for_optional_floats():
    local, _, _ = _configs("--local-sgd-clip-pseudo-grad", "None",
                           "--local-sgd-weight-softmax-temperature", "none")
    assert local.clip_pseudo_grad is None and local.weight_softmax_temperature is None


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--local-sgd-sync-interval", "0"], "--local-sgd-sync-interval"),
        (["--local-sgd-warmup-steps", "-1"], "--local-sgd-warmup-steps"),
        (["--local-sgd-gradient-accumulation-steps", "4"], "--local-sgd-gradient-accumulation-steps"),
        (["--local-sgd-sync-time", "0"], "--local-sgd-sync-time"),
        (["--local-sgd-ewma-alpha", "2"], "--local-sgd-ewma-alpha"),
        (["--outer-optimizer-lr", "-1"], "--outer-optimizer-lr"),
        (["--outer-optimizer", "no.such.Optimizer"], "--outer-optimizer"),
        (["--outer-optimizer-kwargs", '{"bogus": 1}'], "--outer-optimizer-kwargs"),
        (["--outer-optimizer-momentum", "-0.5"], "--outer-optimizer-momentum"),
        (["--gta-density", "0.5"], "--gta-density"),
        (["--gta-consensus-method", "sum"], "--gta-consensus-method"),
    ],
)
def test_bad_value_names_the_flag(argv, flag):
    with pytest.raises(ConfigError) as info:
        _configs(*argv)
    assert flag in str(info.value)


def test_outer_kwargs_must_be_a_json_object(capsys):
    for text, fragment in (("[1, 2]", "must be a JSON object"), ("{not json", "not JSON"),
                           ("{'lr': 1}", "double quotes")):
        with pytest.raises(SystemExit):
            _parser().parse_args(["--outer-optimizer-kwargs", text])
        err = capsys.readouterr().err
        assert "--outer-optimizer-kwargs" in err and fragment in err, err
        assert "invalid loads value" not in err


def test_argparse_rejects_malformed_values(capsys):
    parser = _parser()
    for argv in (["--outer-optimizer-kwargs", "{not json"],
                 ["--local-sgd-sync-mode", "sometimes"],
                 ["--local-sgd-sync-interval", "two"],
                 ["--local-sgd-reducer", "median"]):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(argv)
        assert info.value.code == 2
        assert argv[0] in capsys.readouterr().err


# Field -> (argv setting it to a non-default value, the value it must then have). A flag refused
# alone (it would do nothing) must be refused naming itself; NEEDS gives what makes it act.
_TMP_RECORD = os.path.join(tempfile.gettempdir(), "megatron_edit_record.jsonl")
LOCAL_FLAG_CASES = {
    "use_async": (["--local-sgd-async"], True),
    "local_sgd_sync_interval": (["--local-sgd-sync-interval", "7"], 7),
    "local_sgd_sync_time": (["--local-sgd-sync-time", "30"], 30.0),
    "min_total_global_steps": (["--local-sgd-min-total-global-steps", "5"], 5),
    # A wall-clock budget is A-EDiT's: alone it is refused.
    "async_time_budget": (["--local-sgd-time-budget", "60"], ConfigError),
    # Only meaningful with --local-sgd-async: alone it is refused.
    "use_step_weight": (["--local-sgd-use-step-weight"], ConfigError),
    "step_weight_ratio": (["--local-sgd-step-weight-ratio", "0.25"], 0.25),
    "local_sgd_warmup_steps": (["--local-sgd-warmup-steps", "3"], 3),
    "gradient_accumulation_steps": (["--local-sgd-gradient-accumulation-steps", "2"], ConfigError),
    "clip_pseudo_grad": (["--local-sgd-clip-pseudo-grad", "1.0"], 1.0),
    "pseudo_gradnorm_reduce": (["--local-sgd-pseudo-gradnorm-reduce"], True),
    # Only meaningful with --local-sgd-pseudo-gradnorm-reduce: alone it is refused.
    "weight_softmax_temperature": (["--local-sgd-weight-softmax-temperature", "0.5"], ConfigError),
    "skip_anomaly": (["--local-sgd-skip-anomaly"], True),
    "ewma_alpha": (["--local-sgd-ewma-alpha", "0.5"], 0.5),
    "ewma_warmup_steps": (["--local-sgd-ewma-warmup-steps", "7"], 7),
    "ewma_threshold": (["--local-sgd-ewma-threshold", "2.5"], 2.5),
    "cpu_offload": (["--local-sgd-cpu-offload"], True),
    "is_debug": (["--local-sgd-debug"], True),
    "sync_mode": (["--local-sgd-sync-mode", "step_end"], "step_end"),
    "exchange_dtype": (["--local-sgd-exchange-dtype", "int8"], "int8"),
    # Only meaningful with a scaled exchange format: alone (fp32) it is refused.
    "exchange_block_size": (["--local-sgd-exchange-block-size", "64"], ConfigError),
    # An fp32 exchange drops nothing: refused alone.
    "exchange_error_feedback": (["--local-sgd-exchange-error-feedback"], ConfigError),
    "exchange_topk_density": (["--local-sgd-exchange-topk-density", "0.02"], 0.02),
    # Only used by the top-k exchange: alone it is refused.
    "exchange_topk_chunk": (["--local-sgd-exchange-topk-chunk", "1024"], ConfigError),
    "sync_timeout": (["--local-sgd-sync-timeout", "90"], 90.0),
    # tau must be < --local-sgd-sync-interval (default 1): alone it is refused.
    "outer_step_delay": (["--local-sgd-outer-step-delay", "1"], ConfigError),
    # The merge follows a delayed outer step only: alone it is refused.
    "outer_merge_alpha": (["--local-sgd-outer-merge-alpha", "0.5"], ConfigError),
    # F must divide --local-sgd-sync-interval (default 1): alone it is refused.
    "fragments": (["--local-sgd-fragments", "2"], ConfigError),
    # The merge rule follows a delayed outer step only: alone it is refused.
    "outer_merge_rule": (["--local-sgd-outer-merge-rule", "keep_local"], ConfigError),
    # The torchft backend needs a replica id and a Lighthouse; its settings alone (the torch
    # backend) are refused (test_torchft_flags_reach_their_fields sets them together).
    "sync_backend": (["--local-sgd-sync-backend", "torchft"], ConfigError),
    "lighthouse": (["--local-sgd-lighthouse", "http://127.0.0.1:29510"], ConfigError),
    "replica_id": (["--local-sgd-replica-id", "3"], ConfigError),
    "min_replicas": (["--local-sgd-min-replicas", "2"], ConfigError),
    # (the directory must exist: a file in the temporary directory; nothing is written here)
    "sync_record": (["--local-sgd-sync-record", _TMP_RECORD], _TMP_RECORD),
    # --local-sgd-sync-interval 1 (the default) leaves no room for a delay: alone it is refused
    # (test_auto_overlap_flags_reach_their_fields sets them together).
    "auto_overlap": (["--local-sgd-auto-overlap"], ConfigError),
    "auto_formats": (["--local-sgd-auto-formats", "fp32,int8"], ConfigError),
    "auto_fragments": (["--local-sgd-auto-fragments", "1,2"], ConfigError),
    "auto_every": (["--local-sgd-auto-every", "5"], ConfigError),
}


def test_auto_overlap_flags_reach_their_fields():
    args = _parser().parse_args(["--use-local-sgd", "--local-sgd-sync-interval", "8", "--local-sgd-auto-overlap",
                                 "--local-sgd-auto-formats", "fp32,int8,int4", "--local-sgd-auto-every", "5",
                                 "--local-sgd-auto-fragments", "1,2,4"])
    local = configs_from_args(args)[0]
    assert (local.auto_overlap, local.auto_formats, local.auto_every) == (True, "fp32,int8,int4", 5)
    assert local.allowed_formats == ("fp32", "int8", "int4") and local.allowed_fragments == (1, 2, 4)
    # top-k formats (issue 60), with the run starting in one of them
    args = _parser().parse_args(["--use-local-sgd", "--local-sgd-sync-interval", "8", "--local-sgd-auto-overlap",
                                 "--local-sgd-exchange-dtype", "int2", "--local-sgd-exchange-topk-density", "0.02",
                                 "--local-sgd-auto-formats", "topk0.02-int2,int8", "--outer-optimizer-lr", "1"])
    local = configs_from_args(args)[0]
    assert local.allowed_formats == ("int8", "topk0.02-int2") and local.error_feedback


NEEDS = {
    "local_sgd_sync_time": ["--local-sgd-async"],
    "min_total_global_steps": ["--local-sgd-async"],
    "step_weight_ratio": ["--local-sgd-async", "--local-sgd-use-step-weight"],
    "ewma_alpha": ["--local-sgd-skip-anomaly"],
    "ewma_warmup_steps": ["--local-sgd-skip-anomaly"],
    "ewma_threshold": ["--local-sgd-skip-anomaly"],
}
NEEDED_FIELDS = {"--local-sgd-async": "use_async", "--local-sgd-use-step-weight": "use_step_weight",
                 "--local-sgd-skip-anomaly": "skip_anomaly"}


def test_sync_timeout_defaults_to_megatrons_distributed_timeout():
    """Without --local-sgd-sync-timeout, Megatron-LM's --distributed-timeout-minutes decides (its
    namespace has it); the flag wins when given; a bad value names the flag."""
    args = _parser().parse_args(["--use-local-sgd"])
    args.distributed_timeout_minutes = 7
    assert configs_from_args(args)[0].sync_timeout == 420.0
    args = _parser().parse_args(["--use-local-sgd", "--local-sgd-sync-timeout", "30"])
    args.distributed_timeout_minutes = 7
    assert configs_from_args(args)[0].sync_timeout == 30.0
    assert configs_from_args(_parser().parse_args(["--use-local-sgd"]))[0].sync_timeout is None
    with pytest.raises(ConfigError, match="--local-sgd-sync-timeout"):
        configs_from_args(_parser().parse_args(["--use-local-sgd", "--local-sgd-sync-timeout", "-1"]))


def _option_dests(parser):
    return {opt: action.dest for action in parser._actions for opt in action.option_strings}


def test_exactly_one_flag_per_local_sgd_field():
    fields = [f.name for f in dataclasses.fields(LocalSGDConfig)]
    assert sorted(LOCAL_FLAG_CASES) == sorted(fields)
    dests = _option_dests(_parser())
    flags = [FLAG_NAMES[name] for name in fields]
    assert len(set(flags)) == len(flags)
    for name, flag in zip(fields, flags):
        assert flag in dests, f"{name}: {flag} is not a parser option"
    # the flags of distinct fields land in distinct namespace attributes
    assert len({dests[f] for f in flags}) == len(flags)


@pytest.mark.parametrize("cls", [LocalSGDConfig, GTAConfig])
def test_every_field_declares_its_one_flag(cls):
    """flag(...) in a field's metadata is the one source of its flag: FLAG_NAMES, the parser's
    action (dest and default: the field's) and the args -> config mapping (the parsed defaults
    give the default configs: test_defaults_equal_the_config_defaults)."""
    from megatron_edit.flags import flag_of

    actions = {opt: action for action in _parser()._actions for opt in action.option_strings}
    for f in dataclasses.fields(cls):
        declared = flag_of(f)
        assert declared is not None and not declared.by_hand, f.name
        assert FLAG_NAMES[f.name] == declared.name
        action = actions[declared.name]
        assert (action.dest, action.default) == (declared.dest, f.default), f.name
    every = [flag_of(f).name for c in (LocalSGDConfig, OuterOptimizerConfig, GTAConfig)
             for f in dataclasses.fields(c)]
    assert len(every) == len(set(every)) == len(FLAG_NAMES)


@pytest.mark.parametrize("field_name", sorted(LOCAL_FLAG_CASES))
def test_each_flag_reaches_its_field(field_name):
    argv, expected = LOCAL_FLAG_CASES[field_name]
    assert argv[0] == FLAG_NAMES[field_name]
    if isinstance(expected, type) and issubclass(expected, Exception):
        with pytest.raises(expected) as info:
            _configs(*argv)
        assert FLAG_NAMES[field_name] in str(info.value)
        return
    assert getattr(LocalSGDConfig(), field_name) != expected  # really a change
    needs = NEEDS.get(field_name, [])
    if needs:
        with pytest.raises(ConfigError) as info:  # alone it would do nothing
            _configs(*argv)
        assert argv[0] in str(info.value) and needs[-1] in str(info.value)
    local, _, _ = _configs(*needs, *argv)
    changed = {
        f.name for f in dataclasses.fields(LocalSGDConfig)
        if getattr(local, f.name) != getattr(LocalSGDConfig(), f.name)
    }
    assert changed == {field_name} | {NEEDED_FIELDS[n] for n in needs}
    assert getattr(local, field_name) == expected


def test_gta_flags_reach_their_fields():
    _, _, gta = _configs("--local-sgd-reducer", "gta", "--no-gta-normalize", "--gta-int8-mask",
                         "--gta-consensus-method", "count", "--gta-sparsification-method", "random",
                         "--gta-density", "0.25")
    assert (gta.reducer, gta.normalize, gta.int8_mask) == ("gta", False, True)
    assert (gta.consensus_method, gta.sparsification_method, gta.density) == ("count", "random", 0.25)
    with pytest.raises(ConfigError, match="--gta-int8-mask"):
        _configs("--gta-int8-mask")
    with pytest.raises(ConfigError, match="--gta-sparsification-method"):
        _configs("--gta-sparsification-method", "magnitude")


# ---------------------------------------------------------------- check_flags
SOME_REFUSALS = [
    ["--outer-optimizer", "adam", "--outer-optimizer-lr", "0.001", "--outer-optimizer-momentum", "0.5"],
    ["--outer-optimizer", "adam"],
    ["--outer-optimizer-lr", "inf"],
    ["--outer-optimizer-momentum", "1.5"],
    ["--outer-optimizer-lr", "0.5", "--outer-optimizer-momentum", "0", "--outer-optimizer-nesterov"],
    ["--outer-optimizer", "adam", "--outer-optimizer-kwargs", '{"lr": 0.01, "betas": [0.9]}'],
    ["--outer-optimizer", "sgd", "--outer-optimizer-kwargs", '{"bogus": 1}'],
    ["--outer-optimizer", "torch.optim.NoSuch", "--outer-optimizer-lr", "0.1"],
    ["--local-sgd-sync-interval", "0"],
    ["--local-sgd-sync-time", "30"],
    ["--no-gta-normalize"],
]


@pytest.mark.parametrize("argv", SOME_REFUSALS, ids=[" ".join(a) for a in SOME_REFUSALS])
def test_check_flags_refuses_what_configs_from_args_refuses(argv):
    args = _parser().parse_args(["--use-local-sgd", *argv])
    with pytest.raises(ConfigError) as built:
        configs_from_args(args)
    with pytest.raises(ConfigError) as checked:
        arguments.check_flags(args)
    assert str(checked.value) == str(built.value)


def test_check_flags_passes_what_configs_from_args_builds():
    for argv in ([], ["--outer-optimizer", "adamw", "--outer-optimizer-lr", "1e-3"],
                 ["--outer-optimizer-kwargs", '{"weight_decay": 0.1}']):
        args = _parser().parse_args(["--use-local-sgd", *argv])
        arguments.check_flags(args)
        assert configs_from_args(args) is not None


def test_the_flags_modules_import_neither_torch_nor_megatron():
    # The main job checks its flags before any rank starts; torch's import alone takes ~1.5 s.
    code = ("import sys, argparse; import megatron_edit; from megatron_edit import arguments; "
            "p = arguments.local_sgd_args_provider(argparse.ArgumentParser()); "
            "arguments.check_flags(p.parse_args(['--use-local-sgd', '--outer-optimizer-lr', '0.5'])); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out


def test_validation_builds_no_optimizer(monkeypatch):
    # Checking the outer optimizer's options must not construct one (no torch objects
    # in validation); torch's own checks are covered by check_outer_numbers.
    monkeypatch.setattr(torch.optim.SGD, "__init__", lambda *a, **k: pytest.fail("an SGD was built"))
    OuterOptimizerConfig("sgd", {"lr": 0.5, "momentum": 0.5, "nesterov": True})


def test_delayed_outer_step_flags_reach_their_fields():
    local, _, _ = _configs("--local-sgd-sync-interval", "8", "--local-sgd-outer-step-delay", "3",
                           "--local-sgd-outer-merge-alpha", "0.5")
    assert (local.outer_step_delay, local.outer_merge_alpha) == (3, 0.5)
    local, _, _ = _configs("--local-sgd-sync-interval", "8", "--local-sgd-fragments", "4")
    assert local.fragments == 4
    local = _configs("--local-sgd-async", "--local-sgd-outer-step-delay", "3")[0]  # A-EDiT plans around tau
    assert local.use_async and local.outer_step_delay == 3


@pytest.mark.parametrize("argv, exc, fragments", [
    (["--local-sgd-outer-merge-alpha", "0.5"], ConfigError,
     ["--local-sgd-outer-merge-alpha", "--local-sgd-outer-step-delay"]),
    (["--local-sgd-sync-interval", "4", "--local-sgd-outer-step-delay", "4"], ConfigError,
     ["--local-sgd-outer-step-delay", "--local-sgd-sync-interval", "4 must be < "]),
    (["--local-sgd-sync-interval", "4", "--local-sgd-outer-step-delay", "-1"], ConfigError,
     ["--local-sgd-outer-step-delay", ">= 0"]),
    (["--local-sgd-sync-interval", "4", "--local-sgd-outer-step-delay", "1", "--local-sgd-outer-merge-alpha", "1.5"],
     ConfigError, ["--local-sgd-outer-merge-alpha", "[0, 1]"]),
])
def test_delayed_outer_step_refusals(argv, exc, fragments):
    with pytest.raises(exc) as info:
        _configs(*argv)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_error_feedback_flag_is_on_by_default_with_topk_and_can_be_turned_off():
    """--[no-]local-sgd-exchange-error-feedback: unset (None) means on with the top-k exchange,
    off otherwise; --no-... turns it off with top-k; the bare flag still turns it on."""
    from megatron_edit.arguments import configs_from_args

    def local(*argv):
        return configs_from_args(_parser().parse_args(["--use-local-sgd", *argv]))[0]

    topk = ["--local-sgd-exchange-topk-density", "0.02", "--local-sgd-exchange-dtype", "int2"]
    assert local(*topk).exchange_error_feedback is None and local(*topk).error_feedback
    assert not local(*topk, "--no-local-sgd-exchange-error-feedback").error_feedback
    assert local("--local-sgd-exchange-dtype", "int8", "--local-sgd-exchange-error-feedback").error_feedback
    assert not local("--local-sgd-exchange-dtype", "int8").error_feedback
    # off is the default without top-k: --no-... alone does nothing and is refused
    with pytest.raises(ConfigError, match="--no-local-sgd-exchange-error-feedback does nothing without "
                                          "--local-sgd-exchange-topk-density"):
        local("--local-sgd-exchange-dtype", "int8", "--no-local-sgd-exchange-error-feedback")
    # --local-sgd-auto-overlap that may choose a top-k format: on by default, --no-... turns it off
    auto = ["--local-sgd-sync-interval", "8", "--local-sgd-auto-overlap", "--local-sgd-exchange-dtype", "int8"]
    assert local(*auto, "--local-sgd-auto-formats", "int8,topk0.02-int2").error_feedback
    assert not local(*auto, "--local-sgd-auto-formats", "int8,topk0.02-int2",
                     "--no-local-sgd-exchange-error-feedback").error_feedback
    with pytest.raises(ConfigError, match="--no-local-sgd-exchange-error-feedback does nothing without"):
        local(*auto, "--local-sgd-auto-formats", "fp32,int8", "--no-local-sgd-exchange-error-feedback")


def test_torchft_flags_reach_their_fields(monkeypatch):
    """The torchft backend's four flags together (torchft looked up, not imported)."""
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    local, _, _ = _configs("--local-sgd-sync-backend", "torchft", "--local-sgd-replica-id", "3",
                           "--local-sgd-lighthouse", "http://127.0.0.1:29510", "--local-sgd-min-replicas", "2")
    assert (local.sync_backend, local.replica_id, local.lighthouse, local.min_replicas) == (
        "torchft", 3, "http://127.0.0.1:29510", 2)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lh:1")
    local, _, _ = _configs("--local-sgd-sync-backend", "torchft", "--local-sgd-replica-id", "0")
    assert local.lighthouse is None and local.lighthouse_address == "http://lh:1"
