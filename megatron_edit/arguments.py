"""Command-line flags in Megatron's style, and the one mapping from parsed args to configs.

``local_sgd_args_provider(parser)`` adds the flags (usable as Megatron-LM's
``extra_args_provider``); ``configs_from_args(args)`` turns a parsed namespace into
``(LocalSGDConfig, OuterOptimizerConfig, GTAConfig)``, or None when ``--use-local-sgd`` is off.

The flags of :class:`LocalSGDConfig` and :class:`GTAConfig` and their mapping onto the fields are
generated from the fields' metadata (:mod:`megatron_edit.flags`); written here by hand are
``--use-local-sgd`` (no field: it decides whether there are configs at all), the outer
optimizer's flags (they map onto one dict field, with SGD's defaults), ``sync_timeout``'s
fallback on ``--distributed-timeout-minutes``, and the refusals below.

A flag that would do nothing is refused here, naming it and the flag it needs: A-EDiT's
(``--local-sgd-sync-time``, ``--local-sgd-min-total-global-steps``) without
``--local-sgd-async``, ``--local-sgd-step-weight-ratio`` without ``--local-sgd-use-step-weight``,
the EWMA flags without ``--local-sgd-skip-anomaly``, any EDiT flag without ``--use-local-sgd``
(:func:`check_flags_need_local_sgd`), SGD's ``--outer-optimizer-momentum`` /
``--[no-]outer-optimizer-nesterov`` with another outer optimizer, and a flag that
``--outer-optimizer-kwargs`` sets again. (The configs accept such settings, so programs can
switch a feature off and keep its settings; a user who typed the flag expects it to act.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, NoReturn, Optional, Tuple

from .config import (
    ConfigError,
    GTAConfig,
    LocalSGDConfig,
    OuterOptimizerConfig,
    DEFAULT_OUTER_KWARGS,
    TOPK_OUTER_KWARGS,
    OUTER_OPTIMIZERS,
    check_combination,
    check_outer_numbers,
    resolve_optimizer_class,
)
from .flags import add_flags, config_kwargs, with_default as _d

GROUP_TITLE = "local SGD (EDiT / A-EDiT)"

# The outer optimizer's flag defaults, for SGD (and its subclasses) only: another optimizer
# gets no momentum / nesterov, and must be given its learning rate (0.7 is SGD's).
SGD_DEFAULTS = dict(DEFAULT_OUTER_KWARGS)
# With the sparse exchange (--local-sgd-exchange-topk-density): SparseLoCo's (TOPK_OUTER_KWARGS).
TOPK_SGD_DEFAULTS = dict(TOPK_OUTER_KWARGS)
_OUTER_FLAGS = {"lr": "--outer-optimizer-lr", "momentum": "--outer-optimizer-momentum",
                "nesterov": "--[no-]outer-optimizer-nesterov"}


#: Seconds a rank other than 0 waits on a start-up error before it prints the error itself and
#: exits (see :func:`end_with_error`).
PEER_WAIT_S = 60.0


def end_with_error(line: str, wait_s: Optional[float] = None, first: Optional[bool] = None,
                   code: int = 2) -> NoReturn:
    """End this rank with exit code 2 after a start-up error that every rank finds: rank 0
    prints ``line`` at once; the other ranks first wait ``wait_s`` (default
    :data:`PEER_WAIT_S`) seconds.

    Why the wait: a rank that exits first makes the launcher (torchrun, or the main job's own)
    stop the others. Exiting at once let another rank be first and rank 0 be stopped before it
    printed: exit code 2 and no message at all (seen in 3 of 21 runs of the main job's
    torchrun test under load). Now rank 0 exits first and the launcher ends the waiting ranks;
    a rank still running after the wait (rank 0 found no error) prints the line itself.
    ``first``: whether this rank prints at once (default: rank 0); ``code``: the exit code,
    also of a waiting rank that the launcher stops (SIGTERM): it ends quietly with it."""
    if first is None:
        first = os.environ.get("RANK", "0") == "0"
    if not first:
        wait_for_the_launcher(PEER_WAIT_S if wait_s is None else wait_s, code)
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(code)


def end_rank(error: BaseException) -> NoReturn:
    """Ends a rank that stops on an error, with its exit code, without the interpreter's
    teardown: ``os._exit`` after its message and a flush. Every entry point that runs ranks
    calls it on the error that stops one (the main job, ``python -m megatron_edit.launch``,
    ``scripts/fault_job.py``, the benchmarks).

    Why: such a rank still holds its gloo process groups (and an exchange may be in flight)
    while the other ranks stop at the same moment. Through ``sys.exit`` the interpreter then
    tears those down, and once in the suite's repeated runs (torch 2.13.0, load 30-40) that
    teardown ended rank 1 with SIGABRT ("terminate called without an active exception"), no
    Python frame, so the launcher reported "killed by signal 6" instead of the rank's exit
    code 1. Nothing is left to save at this point: the stop itself is the result."""
    import traceback

    if getattr(error, "one_line", False):  # every rank raises it at once (RunAlreadyOver): printed by rank 0
        if os.environ.get("RANK", "0") != "0":
            wait_for_the_launcher(PEER_WAIT_S, 1)
        error = SystemExit(str(error))  # (printed below; exit code 1)
    if isinstance(error, SystemExit):
        code = error.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # what sys.exit("message") prints
            code = 1
        code = code or 0
    else:
        traceback.print_exception(error)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait_for_the_launcher(seconds: float, code: int) -> None:
    """Sleep ``seconds``; stopped meanwhile by the launcher (SIGTERM, after the first rank
    ended), end quietly with ``code``, so that every rank ends with the same exit code (not
    -15) and the line is printed once."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)
        return

    def stopped(signum, frame):
        sys.stdout.flush()
        os._exit(code)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        time.sleep(seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)


class Rank0ArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` for scripts started on every rank (torchrun): help and usage are
    printed by rank 0 only (``RANK``), and an error is one line, not the usage, printed by
    rank 0 while the other ranks wait (:func:`end_with_error`). :meth:`fail` reports a
    :class:`ConfigError` (or any message) the same way."""

    #: Seconds a rank other than 0 waits on an error (:func:`end_with_error`).
    peer_wait_s: float = PEER_WAIT_S

    def _print_message(self, message, file=None):
        if message and os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)

    def error(self, message):
        self.fail(message)

    def fail(self, message) -> NoReturn:
        end_with_error(f"{self.prog}: error: {message}", self.peer_wait_s)


def _json_object(text: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not JSON ({e.msg} at character {e.pos}): {text!r}; write a JSON object such as "
            "'{\"betas\": [0.9, 0.95]}' (keys and strings in double quotes)"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object of keyword arguments, e.g. '{{\"betas\": [0.9, 0.95]}}' "
            f"(got {type(value).__name__} {text!r})"
        )
    return value


def local_sgd_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the EDiT flags to ``parser`` (one argument group) and return it. A parser that has
    them already is returned as it is (a second call, e.g. from a chained args provider)."""
    if any("--use-local-sgd" in action.option_strings for action in parser._actions):
        return parser
    group = parser.add_argument_group(title=GROUP_TITLE)
    add = group.add_argument
    add("--use-local-sgd", action="store_true",
        help="Train data-parallel workers locally and sync them every H steps (EDiT).")
    add_flags(group, LocalSGDConfig)  # from the fields' metadata (megatron_edit.flags)
    # The outer optimizer's flags map onto one dict field (outer_optim_kwargs, with SGD's
    # defaults and refusals: _outer_kwargs), so they are declared here by hand.
    add("--outer-optimizer", default="sgd",
        help=_d("Outer optimizer: sgd, adam, adamw or a dotted class path."))
    add("--outer-optimizer-lr", type=float, default=None,
        help=f"Outer learning rate (default: {SGD_DEFAULTS['lr']} with SGD, {TOPK_SGD_DEFAULTS['lr']} with "
             "--local-sgd-exchange-topk-density; required with another outer optimizer).")
    add("--outer-optimizer-momentum", type=float, default=None,
        help=f"Momentum of the outer SGD, in [0, 1) (default: {SGD_DEFAULTS['momentum']}, "
             f"{TOPK_SGD_DEFAULTS['momentum']} with --local-sgd-exchange-topk-density; "
             "SGD only, other optimizers take theirs in --outer-optimizer-kwargs).")
    add("--outer-optimizer-nesterov", action=argparse.BooleanOptionalAction, default=None,
        help=f"Nesterov momentum for the outer SGD (default: "
             f"{'on' if SGD_DEFAULTS['nesterov'] else 'off'}, "
             f"{'on' if TOPK_SGD_DEFAULTS['nesterov'] else 'off'} with --local-sgd-exchange-topk-density; "
             "SGD only).")
    add("--outer-optimizer-kwargs", type=_json_object, default=None,
        help="More keyword arguments of the outer optimizer as a JSON object, e.g. "
             "'{\"betas\": [0.9, 0.95]}' (default: none). A key set by a flag above is refused.")
    add_flags(group, GTAConfig)
    return parser


def local_sgd_defaults() -> Dict[str, Any]:
    """dest -> default of every EDiT flag, as :func:`local_sgd_args_provider` sets them."""
    parser = local_sgd_args_provider(argparse.ArgumentParser(add_help=False))
    return {a.dest: a.default for a in parser._actions if a.option_strings}


def changed_flags(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> List[str]:
    """The EDiT flags (as typed, e.g. ``--local-sgd-sync-interval``) whose value in ``args``
    differs from its default: ``parser``'s (which may set its own) or the provider's."""
    reference = local_sgd_args_provider(argparse.ArgumentParser(add_help=False))
    out = []
    for action in reference._actions:
        if not action.option_strings or not hasattr(args, action.dest):
            continue
        default = parser.get_default(action.dest) if parser is not None else action.default
        if getattr(args, action.dest) != default:
            out.append(action.option_strings[0])
    return out


def _needs(flag: str, needed: str, why: str = "") -> ConfigError:
    return ConfigError(f"{flag} does nothing without {needed}{why}: add {needed}, or drop {flag}.")


def _check_flags_take_effect(args: argparse.Namespace) -> None:
    """Refuse a flag whose value differs from its default while the option it needs is off."""
    d = LocalSGDConfig()
    if not args.local_sgd_async:
        for dest, name, flag in (
            ("local_sgd_sync_time", "local_sgd_sync_time", "--local-sgd-sync-time"),
            ("local_sgd_min_total_global_steps", "min_total_global_steps", "--local-sgd-min-total-global-steps"),
        ):
            if getattr(args, dest) != getattr(d, name):
                raise _needs(flag, "--local-sgd-async",
                             " (synchronous EDiT syncs every --local-sgd-sync-interval steps)")
    if not args.local_sgd_use_step_weight and args.local_sgd_step_weight_ratio != d.step_weight_ratio:
        raise _needs("--local-sgd-step-weight-ratio", "--local-sgd-use-step-weight")
    topk = args.local_sgd_exchange_topk_density is not None or ",topk" in f",{args.local_sgd_auto_formats}".replace(" ", "")
    if args.local_sgd_exchange_error_feedback is False and not topk:  # (the config checks the formats' names)
        raise _needs("--no-local-sgd-exchange-error-feedback", "--local-sgd-exchange-topk-density",
                     " (or a top-k format in --local-sgd-auto-formats), on by default with either")
    if not args.local_sgd_skip_anomaly:
        for dest in ("ewma_alpha", "ewma_warmup_steps", "ewma_threshold"):
            if getattr(args, f"local_sgd_{dest}") != getattr(d, dest):
                raise _needs(f"--local-sgd-{dest.replace('_', '-')}", "--local-sgd-skip-anomaly")


def _known_class(spec: str) -> Optional[str]:
    """``torch.optim.SGD`` etc. for the short names and their dotted paths (known without
    importing torch), else None."""
    path = OUTER_OPTIMIZERS.get(str(spec).lower(), spec)
    return path if path in OUTER_OPTIMIZERS.values() else None


def _class_name(spec: str) -> str:
    known = _known_class(spec)
    return known.rpartition(".")[2] if known else resolve_optimizer_class(spec).__name__


def _is_sgd(spec: str) -> bool:
    known = _known_class(spec)
    if known:
        return known == OUTER_OPTIMIZERS["sgd"]
    import torch

    return issubclass(resolve_optimizer_class(spec), torch.optim.SGD)


def _outer_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The outer optimizer's keyword arguments from its flags (see :data:`SGD_DEFAULTS`, and
    :data:`TOPK_SGD_DEFAULTS` with the sparse exchange);
    torch is imported only for a class other than sgd / adam / adamw."""
    is_sgd = _is_sgd(args.outer_optimizer)
    extra = args.outer_optimizer_kwargs
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError("--outer-optimizer-kwargs must be a JSON object, e.g. '{\"betas\": [0.9, 0.95]}'.")
    extra = dict(extra or {})
    given = {key: getattr(args, f"outer_optimizer_{key}") for key in _OUTER_FLAGS}
    given = {key: value for key, value in given.items() if value is not None}
    for key in given:
        if key in extra:
            raise ConfigError(
                f"{_OUTER_FLAGS[key]} and --outer-optimizer-kwargs both set {key!r}; give it once."
            )
    if not is_sgd:
        for key in ("momentum", "nesterov"):
            if key in given:
                raise ConfigError(
                    f"{_OUTER_FLAGS[key]} is for the SGD outer optimizer; "
                    f"{_class_name(args.outer_optimizer)} has "
                    f"{'its own momentum terms' if key == 'momentum' else 'no Nesterov option'}: "
                    "pass them in --outer-optimizer-kwargs (e.g. '{\"betas\": [0.9, 0.95]}' for "
                    "Adam), or drop the flag."
                )
        if "lr" not in given and "lr" not in extra:
            raise ConfigError(
                f"--outer-optimizer {args.outer_optimizer} needs --outer-optimizer-lr: the default "
                f"{SGD_DEFAULTS['lr']} is the SGD outer optimizer's (a Nesterov step on the "
                "averaged pseudo-gradient); adaptive optimizers need a much smaller one."
            )
        return {**given, **extra}
    defaults = TOPK_SGD_DEFAULTS if getattr(args, "local_sgd_exchange_topk_density", None) is not None else SGD_DEFAULTS
    kwargs = {key: value for key, value in defaults.items() if key not in extra}
    kwargs.update(given)
    kwargs.update(extra)
    return kwargs


def _sync_timeout(args) -> Optional[float]:
    """--local-sgd-sync-timeout, or Megatron-LM's --distributed-timeout-minutes when it has one."""
    if args.local_sgd_sync_timeout is not None:
        return args.local_sgd_sync_timeout
    minutes = getattr(args, "distributed_timeout_minutes", None)
    return None if minutes is None else 60.0 * minutes


def _checked_namespace(args: argparse.Namespace) -> bool:
    """False when --use-local-sgd is off; raises when ``args`` cannot hold the EDiT flags."""
    if not isinstance(args, argparse.Namespace):
        raise TypeError(
            "configs_from_args(args): args must be the argparse.Namespace of parsed flags (from a "
            f"parser given to local_sgd_args_provider), got {type(args).__name__}"
            + ("; for a dict use argparse.Namespace(**d)." if isinstance(args, dict) else ".")
        )
    if not getattr(args, "use_local_sgd", False):
        return False
    missing = [dest for dest in local_sgd_defaults() if not hasattr(args, dest)]
    if missing:
        raise ConfigError(
            f"configs_from_args: the namespace has --use-local-sgd but not "
            f"{', '.join('--' + m.replace('_', '-') for m in missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''}: parse the flags with a parser given to "
            "local_sgd_args_provider."
        )
    _check_flags_take_effect(args)
    return True


def _local_and_gta(args: argparse.Namespace) -> Tuple[LocalSGDConfig, GTAConfig]:
    """Each field from its flag (megatron_edit.flags.config_kwargs), but one: ``sync_timeout``
    falls back on Megatron-LM's ``--distributed-timeout-minutes`` (:func:`_sync_timeout`)."""
    local = LocalSGDConfig(**{**config_kwargs(LocalSGDConfig, args), "sync_timeout": _sync_timeout(args)})
    gta = GTAConfig(**config_kwargs(GTAConfig, args))
    check_combination(local, gta)
    return local, gta


_PARSED: List[Tuple[str, Tuple[LocalSGDConfig, OuterOptimizerConfig, GTAConfig]]] = []
"""The last flags turned into configs in this process, and those configs (:func:`configs_from_args`)."""


def configs_from_args(
    args: argparse.Namespace,
) -> Optional[Tuple[LocalSGDConfig, OuterOptimizerConfig, GTAConfig]]:
    """Parsed flags -> configs (validated; ConfigError names the flag), None if local SGD is off.
    Once per process: Megatron-LM's start-up checks and the runtime attaching EDiT ask for the
    same flags, and get the same configs (the flags are parsed again only when they changed)."""
    if not _checked_namespace(args):
        return None
    flags = repr(sorted((dest, getattr(args, dest, None)) for dest in
                        [*local_sgd_defaults(), "distributed_timeout_minutes"]))
    if _PARSED and _PARSED[0][0] == flags:
        return _PARSED[0][1]
    local, gta = _local_and_gta(args)
    outer = OuterOptimizerConfig(outer_optim_class=args.outer_optimizer, outer_optim_kwargs=_outer_kwargs(args))
    _PARSED[:] = [(flags, (local, outer, gta))]
    return local, outer, gta


def check_flags(args: argparse.Namespace) -> None:
    """What :func:`configs_from_args` checks, before torch is imported where it can be: with
    ``--outer-optimizer`` sgd, adam or adamw and no ``--outer-optimizer-kwargs`` the outer
    optimizer's numbers are checked without its class (:func:`check_outer_numbers`); another
    class, or keyword arguments to check against its constructor, import torch (about 1.5 s).
    A launcher calls it before it starts the ranks, which then build the configs."""
    if not _checked_namespace(args):
        return
    _local_and_gta(args)
    kwargs = _outer_kwargs(args)
    known = _known_class(args.outer_optimizer)
    check_outer_numbers(kwargs, known.rpartition(".")[2] if known else "the outer optimizer")
    if not known or args.outer_optimizer_kwargs is not None:
        OuterOptimizerConfig(outer_optim_class=args.outer_optimizer, outer_optim_kwargs=kwargs)


def check_flags_need_local_sgd(args: argparse.Namespace) -> None:
    """EDiT flags given without ``--use-local-sgd`` are refused (as ``--mode baseline`` refuses
    them in the main job): they would do nothing, and the run would train synchronously after a
    warning lost in Megatron's start-up output."""
    changed = changed_flags(args)
    if changed and not getattr(args, "use_local_sgd", False):
        raise ConfigError(
            f"{', '.join(changed)} {'does' if len(changed) == 1 else 'do'} nothing without "
            "--use-local-sgd (EDiT is off: the run would train synchronously). Add --use-local-sgd, "
            f"or drop {'it' if len(changed) == 1 else 'them'} for the synchronous baseline.")
