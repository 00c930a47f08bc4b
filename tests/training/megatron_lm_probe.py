"""Run by tests/test_megatron_lm.py in a fresh interpreter: Megatron-LM's real parser and
validation with megatron_edit's patches, in one process (no torch.distributed needed).

Usage: ``python tests/training/megatron_lm_probe.py <Megatron-LM dir> <spec.json>``; prints one JSON line
(prefixed ``PROBE-RESULT``). A separate process, because importing ``megatron.training`` sets up
logging and patching is process-global: the pytest process stays clean.
"""

import contextlib
import io
import json
import os
import sys


def _parse_and_validate(init, argv, world_size, extra_args_provider=None):
    os.environ["WORLD_SIZE"] = str(world_size)
    sys.argv = ["pretrain_gpt.py", *argv]
    args = init.parse_args(extra_args_provider)
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        init.validate_args(args, {})
    return args


def main(checkout, spec_path):
    spec = json.load(open(spec_path))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4")
    from megatron_edit import launch, patch_megatron_for_local_sgd, unpatch_megatron_for_local_sgd
    from megatron_edit.cpu import training_adapter as cpu_training_adapter
    from megatron_edit.training.training_wraps import check_import_bindings

    launch._set_up_path(os.path.join(checkout, "pretrain_gpt.py"))  # the launcher's megatron
    cpu_training_adapter.activate()
    out = {"patches": patch_megatron_for_local_sgd()}
    # Where Megatron-LM's scripts parse and validate (arguments.parse_and_validate_args since
    # core_v0.18; initialize_megatron before, through the names initialize binds too).
    import megatron.training.arguments as init
    import megatron.training

    out["training_from"] = os.path.dirname(megatron.training.__file__)

    def script_provider(parser):  # what pretrain_gpt.py-style scripts pass
        parser.add_argument("--my-script-flag", type=int, default=3)
        return parser

    args = _parse_and_validate(init, spec["script_case"] + ["--my-script-flag", "5"], 4, script_provider)
    out["flags"] = {
        "use_local_sgd": args.use_local_sgd,
        "local_sgd_sync_interval": args.local_sgd_sync_interval,
        "my_script_flag": args.my_script_flag,
        "data_parallel_size": args.data_parallel_size,
    }
    out["cases"] = {}
    for name, argv in spec["cases"].items():
        try:
            _parse_and_validate(init, argv, 4)
            out["cases"][name] = None
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            out["cases"][name] = [type(e).__name__, str(e)]
    out["sizes"] = {}
    for size, (argv, world_size) in spec["sizes"].items():
        try:
            a = _parse_and_validate(init, argv, world_size)
            out["sizes"][size] = {"ok": True, "dp": a.data_parallel_size,
                                  "workers": a.num_distributed_optimizer_instances}
        except Exception as e:  # noqa: BLE001
            out["sizes"][size] = {"ok": False, "error": f"{type(e).__name__}: {e}"}

    import megatron.core.distributed as mcd
    import megatron.training.training as training

    out["bindings"] = check_import_bindings()
    out["ddp_init_patched"] = getattr(training.DDP.__init__, "_megatron_edit_patch", None)
    out["ddp_is_core_class"] = training.DDP is mcd.DistributedDataParallel
    wrapped = [init.parse_args, init.validate_args, training.training_log, training.print_rank_last]
    out["wrapped_before_unpatch"] = [hasattr(f, "_megatron_edit_patch") for f in wrapped]
    out["reverted"] = unpatch_megatron_for_local_sgd()
    wrapped = [init.parse_args, init.validate_args, training.training_log, training.print_rank_last]
    out["wrapped_after_unpatch"] = [hasattr(f, "_megatron_edit_patch") for f in wrapped]
    cpu_training_adapter.deactivate()
    out["cpu_adapter_active_after_deactivate"] = cpu_training_adapter.is_active()
    print("PROBE-RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
