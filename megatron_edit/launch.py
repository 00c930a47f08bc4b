"""Run an unmodified Megatron-LM training script with EDiT's runtime patches.

::

    python -m megatron_edit.launch [launcher options] pretrain_gpt.py <Megatron args> --use-local-sgd ...
    torchrun --nproc_per_node 8 -m megatron_edit.launch pretrain_gpt.py ...

Per process: activate the CPU adapters when there is no GPU, apply the start-up patches on every
device and route (``lm-compile-helpers``: no ``make`` when the compiled dataset helpers are
importable, see :mod:`megatron_edit.training.training_wraps`), patch Megatron
(``patch_megatron_for_local_sgd()``: megatron-core for the algorithm, ``megatron.training`` for
the flags, their validation and the metrics in the log), then run the script as ``__main__``
with ``sys.argv`` set to the script and its arguments. The same thing by hand, at the top of a
script (that one applies ``lm-compile-helpers`` too)::

    from megatron_edit import patch_megatron_for_local_sgd
    patch_megatron_for_local_sgd()

The EDiT flags among the script's arguments are checked before Megatron is imported (EDiT flags
without ``--use-local-sgd`` are refused), and a bad flag (then, or in Megatron's
``validate_args``, whose own output is held back until EDiT's checks pass) ends every rank with
exit code 2 and one line on rank 0 naming the flag, not a traceback per rank. Ctrl-C ends every
rank at once with exit code 130 and one line on rank 0 (``stopped by the user at iteration N``).

Which ``megatron``: ``megatron.core`` is always the installed megatron-core (the release
megatron_edit checks its patches against): it is imported before the script's directory goes on
``sys.path``. The directory then goes *first* on ``sys.path``, as ``python pretrain_gpt.py``
would put it, so everything else under ``megatron/`` (``megatron.training``,
``megatron.post_training``, ...) and the script's own modules come from the script's Megatron-LM
checkout. That matters since megatron-core 0.17, whose wheels ship ``megatron/training`` too
(the matching tag's copy): a fork with ``patches/`` applied must run its own copy, not the
wheel's. The checkout and the installed megatron-core must be the same release line (same
major.minor, as its ``megatron/core/package_info.py`` says: tag core_v0.19.0 says 0.19.1 and runs
on megatron-core 0.19.2, whose wheel ships that tag's ``megatron/training`` byte for byte);
another release is refused.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import runpy
import signal
import sys
import warnings
from typing import List, NoReturn, Optional

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_edit.launch",
        description="Run a Megatron-LM training script (e.g. pretrain_gpt.py) with EDiT's "
        "runtime patches. Options after the script go to the script; the EDiT flags "
        "(--use-local-sgd, --local-sgd-sync-interval, ...) are among them.",
    )
    device = parser.add_mutually_exclusive_group()
    device.add_argument(
        "--cpu", action="store_true",
        help="Run on CPU over gloo (megatron_edit.cpu.adapter + megatron_edit.cpu.training_adapter). Default "
             "when CUDA is not available; refused when it is.",
    )
    device.add_argument("--gpu", action="store_true", help="Require CUDA (no CPU fallback).")
    parser.add_argument(
        "--no-runtime-patches", action="store_true",
        help="Do not patch Megatron (a fork with patches/ applied integrates EDiT itself); "
             "only the device set-up and the start-up patches (lm-compile-helpers) are done.",
    )
    parser.add_argument(
        "--threads", type=int, default=None,
        help="CPU only: torch threads per process (default: cores / local processes, at least 1).",
    )
    parser.add_argument("script", help="The training script, e.g. <Megatron-LM>/pretrain_gpt.py.")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="Arguments of the script.")
    return parser


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _use_cpu(opts) -> bool:
    import torch

    if opts.cpu and torch.cuda.is_available():
        raise SystemExit("megatron_edit.launch: --cpu given but CUDA is available; drop --cpu.")
    if opts.gpu and not torch.cuda.is_available():
        raise SystemExit("megatron_edit.launch: --gpu given but CUDA is not available.")
    return opts.cpu or not torch.cuda.is_available()


def _check_backend(script_args: List[str]) -> None:
    backend = "nccl"  # Megatron's default
    for i, arg in enumerate(script_args):
        if arg == "--distributed-backend" and i + 1 < len(script_args):
            backend = script_args[i + 1]
        elif arg.startswith("--distributed-backend="):
            backend = arg.split("=", 1)[1]
    if backend != "gloo":
        raise SystemExit(
            "megatron_edit.launch: on CPU pass --distributed-backend gloo to the script "
            "(NCCL needs GPUs)."
        )


def _checkout_version(script_dir: str) -> Optional[str]:
    path = os.path.join(script_dir, "megatron", "core", "package_info.py")
    try:
        text = open(path).read()
    except OSError:
        return None
    parts = [re.search(rf"^{name}\s*=\s*(\d+)", text, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(p.group(1) for p in parts) if all(parts) else None


def _release_line(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _set_up_path(script: str) -> None:
    """``megatron.core`` from the installed release, the rest of ``megatron`` and the script's
    modules from the script's checkout (first on ``sys.path``); refuse a checkout of another
    release line."""
    from .mcore.compat import MEGATRON_LM_TAGS

    script_dir = os.path.dirname(os.path.abspath(script))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != script_dir]
    import megatron.core  # the installed release, before the checkout can shadow it

    installed = megatron.core.__version__
    checkout = _checkout_version(script_dir)
    if checkout is not None and _release_line(checkout) != _release_line(installed):
        tag = MEGATRON_LM_TAGS.get(_release_line(installed), f"core_v{_release_line(installed)}.x")
        raise SystemExit(
            f"megatron_edit.launch: {script_dir} is Megatron-LM for megatron-core {checkout} (its "
            f"megatron/core/package_info.py), but megatron-core {installed} is installed: its "
            f"training code would run on another release's megatron.core. Check out Megatron-LM "
            f"tag {tag} (the {_release_line(installed)} release line), or install the matching "
            f"megatron-core: pip install 'megatron-core=={_release_line(checkout)}.*'."
        )
    training = sys.modules.get("megatron.training")
    if training is not None and checkout is not None and not os.path.abspath(
            training.__file__).startswith(os.path.join(script_dir, "")):
        raise SystemExit(
            f"megatron_edit.launch: megatron.training was imported from {training.__file__} "
            f"before the launcher could put {script_dir} first; start the script through "
            f"the launcher before importing megatron.training."
        )
    sys.path.insert(0, script_dir)
    if checkout is not None and checkout != installed and _rank0():
        print(f"megatron_edit.launch: Megatron-LM {script_dir} (megatron-core {checkout}) with "
              f"the installed megatron-core {installed}: same release line", flush=True)


def quiet_upstream_warnings(cpu: bool = False) -> None:
    """Hide torch's FutureWarnings about the deprecated ``torch.distributed`` functions
    megatron-core calls (``all_gather_into_tensor``, ``reduce_scatter_tensor``): two lines per
    call site per rank, nothing for the user to act on. ``cpu``: also megatron-core's notes at
    import that Transformer Engine / Apex are absent (never there on CPU; 12 lines per rank).
    Other warnings stay."""
    warnings.filterwarnings(
        "ignore", category=FutureWarning, message=r"`torch\.distributed\.\w+` is deprecated"
    )
    if cpu:
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r".*(Transformer Engine and Apex|Apex) (are|is) not installed")


def _refuse(message: str) -> NoReturn:
    """End this rank with exit code 2; rank 0 prints the one line, the others wait for the
    launcher to stop them (:func:`megatron_edit.arguments.end_with_error`)."""
    from .arguments import end_with_error
    from .exchange.run_gate import record_refusal

    line = f"megatron_edit: error: {message}"
    record_refusal(line)  # a job of the supervisor under torchrun (exit code 1): it stops the run
    end_with_error(line)


def _stopped_by_the_user(signum=None, frame=None) -> NoReturn:
    """Ctrl-C: rank 0 prints one line, every rank ends at once with exit code 130 (no
    KeyboardInterrupt unwinding through Megatron and gloo: a traceback per rank, and the peers'
    closed connections)."""
    if _rank0():
        args = getattr(sys.modules.get("megatron.training.global_vars"), "_GLOBAL_ARGS", None)
        iteration = getattr(args, "curr_iteration", None)
        where = f" at iteration {iteration}" if iteration else ""
        print(f"megatron_edit: stopped by the user{where}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


#: megatron-core's names in the package's messages, and Megatron-LM's flags for them.
MEGATRON_LM_TERMS = (("DistributedDataParallelConfig.bucket_size", "--ddp-bucket-size"),)


def _in_megatron_lm_terms(message: str) -> str:
    for core, flag in MEGATRON_LM_TERMS:
        message = message.replace(core, flag)
    return message


class _FlagError(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    def error(self, message):
        raise _FlagError(message)


def check_edit_flags(script_args: List[str]) -> None:
    """The EDiT flags among ``script_args`` on their own (Megatron's are left to Megatron), before
    Megatron is imported. Raises :class:`~megatron_edit.config.ConfigError` naming the flag."""
    from .arguments import check_flags_need_local_sgd, configs_from_args, local_sgd_args_provider
    from .config import ConfigError

    parser = local_sgd_args_provider(_QuietParser(add_help=False, allow_abbrev=False))
    try:
        known, _ = parser.parse_known_args(script_args)
    except _FlagError as e:
        raise ConfigError(str(e)) from None
    if configs_from_args(known) is None:
        check_flags_need_local_sgd(known)


def main(argv: Optional[List[str]] = None) -> None:
    from .config import ConfigError

    opts = build_parser().parse_args(argv)
    quiet_upstream_warnings()
    try:
        check_edit_flags(opts.script_args)
    except ConfigError as e:
        _refuse(str(e))
    if not os.path.isfile(opts.script):
        raise SystemExit(f"megatron_edit.launch: no such script: {opts.script}")
    if "LOCAL_RANK" in os.environ:  # a rank of torchrun: it ends with its launcher
        from .exchange.job_processes import watch_launcher

        watch_launcher()
    cpu = _use_cpu(opts)
    if cpu:
        quiet_upstream_warnings(cpu=True)
        _check_backend(opts.script_args)
        from .cpu import training_adapter as cpu_training_adapter

        cpu_training_adapter.prepare_environment()  # before megatron is imported
        import torch

        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(opts.threads or max(1, (os.cpu_count() or 1) // local))
    _set_up_path(opts.script)
    if cpu:
        cpu_training_adapter.activate()
    from .training.training_wraps import apply_startup_patches

    startup = apply_startup_patches()
    if not opts.no_runtime_patches:
        from .api import patch_megatron_for_local_sgd

        patch_megatron_for_local_sgd()
    if _rank0():
        print(
            f"megatron_edit.launch: {opts.script} on {'CPU (gloo)' if cpu else 'GPU'}"
            f"{'' if opts.no_runtime_patches else ', EDiT runtime patches applied'}"
            f"{''.join(f', {p.id}' for p in startup.patches if startup.is_applied(p.id))}",
            flush=True,
        )
    sys.argv = [opts.script, *opts.script_args]
    previous = signal.signal(signal.SIGINT, _stopped_by_the_user)
    try:
        runpy.run_path(opts.script, run_name="__main__")
    except ConfigError as e:  # EDiT's checks in Megatron's validate_args, or at model build
        _refuse(_in_megatron_lm_terms(str(e)))
    except BaseException as error:  # noqa: B036  (an error, SystemExit with a code)
        if isinstance(error, SystemExit) and not error.code:
            raise  # a clean exit (Megatron's --exit-interval): the interpreter's own ending
        from .arguments import end_rank

        end_rank(error)  # without the teardown of the live gloo groups, as the main job
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    main()
