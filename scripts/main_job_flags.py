"""The main job's flags (``scripts/train_gpt_edit.py``): its parser and defaults, and every check
that needs no torch: the flags alone (:func:`check_args`), then what needs the number of processes
(:func:`check_launch`), and the launch decisions that follow from them (:func:`under_torchrun`,
:func:`uses_torchft`, :func:`supervises`).

Started with python, the main job runs all of it before torch is even imported: a mistake costs
one line and exit code 2, in a fraction of a second. This module imports neither torch nor
Megatron at module level (a check that needs one imports it inside). The benchmarks build their
flags on these (:func:`parse_args`).
"""

from __future__ import annotations

import argparse
import math
import os

import main_job_checkpoint  # beside this module: --save / --load
import megatron_edit  # light: the flags' modules import neither torch nor Megatron
from megatron_edit.arguments import Rank0ArgumentParser, changed_flags, check_flags
from megatron_edit.config import ConfigError

PROG = "train_gpt_edit.py"
"""The main job's name in its lines (``train_gpt_edit.py: error: ...``)."""

# The main job's EDiT defaults (the package's are H=1, W=0): a sync every 8 steps after 8
# synchronous steps shows both phases in a short run.
MAIN_JOB_DEFAULTS = dict(local_sgd_sync_interval=8, local_sgd_warmup_steps=8)
# With --local-sgd-sync-backend torchft the warmup's default is 0: warmup all-reduces gradients
# across workers every step, which workers in jobs of their own cannot.
MAIN_JOB_FT_WARMUP = 0
# The main job's outer SGD (the package's is Nesterov, lr 0.7, momentum 0.9, made for long runs
# with large H): lr 0.8 without momentum, a step 80% of the way to the workers' mean. On the
# job's 120 steps the package's default ends 8% above synchronous training's validation loss,
# this one 0.7% below (README, "Choosing H, W and the outer optimizer"). Used only with SGD
# and where neither its flag nor --outer-optimizer-kwargs sets the value.
MAIN_JOB_OUTER_SGD = {"lr": 0.8, "momentum": 0.0, "nesterov": False}


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum} (got {value})")
        return value

    return parse


def _positive_float(text: str, zero: bool = False) -> float:
    """A finite number > 0 (``zero``: >= 0), as an argparse type."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if zero else '>'} 0 (got {text})")
    return value


def _non_negative_float(text: str) -> float:
    return _positive_float(text, zero=True)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every default shown once: the EDiT flags write theirs into their help text."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser(description: str | None = None) -> Rank0ArgumentParser:
    """The main job's flags (``description``: --help's text, the script's docstring)."""
    # allow_abbrev=False: a prefix of a flag (--local-sgd-fragment) is refused, not taken for
    # the flag it begins (Megatron-LM's parser does the same).
    parser = Rank0ArgumentParser(prog=PROG, description=description,
                                 formatter_class=_HelpFormatter, allow_abbrev=False)
    at_least_1, at_least_0 = _int_at_least(1), _int_at_least(0)
    add = parser.add_argument
    add("--nproc-per-node", type=at_least_1, default=None,
        help="processes to start on this machine (default 4) when started with python; under "
             "torchrun, its own --nproc_per_node decides")
    add("--mode", choices=("edit", "baseline", "both"), default="edit",
        help="edit: EDiT; baseline: ordinary synchronous training; both: one, then the other")
    add("--workers", type=at_least_1, default=2,
        help="EDiT workers = distributed-optimizer instances (must divide the number of processes)")
    add("--steps", type=at_least_1, default=120, help="optimizer steps per run")
    add("--layers", type=at_least_1, default=2, help="transformer layers")
    add("--hidden", type=at_least_1, default=64, help="hidden size (a multiple of --heads)")
    add("--heads", type=at_least_1, default=4, help="attention heads")
    add("--seq-length", type=at_least_1, default=64, help="tokens per sample")
    add("--micro-batch-size", type=at_least_1, default=4, help="samples per rank per step")
    add("--lr", type=_positive_float, default=3e-3, help="peak learning rate (cosine decay to lr/10)")
    add("--lr-warmup-steps", type=at_least_0, default=10,
        help="linear learning-rate warmup (fewer than --steps)")
    add("--eval-interval", type=at_least_1, default=40,
        help="validate every this many steps, and after the last")
    add("--eval-samples", type=at_least_1, default=64,
        help="held-out samples per validation (each worker evaluates all of them)")
    add("--log-interval", type=at_least_1, default=10,
        help="print the loss every this many steps (and at every sync)")
    add("--data-dir", default=os.environ.get("MEGATRON_EDIT_DATA", "data-cache"),
        help="where the indexed dataset is built (once)")
    add("--seed", type=int, default=1234, help="random seed")
    add("--save", default=None, metavar="DIR",
        help="save megatron-core torch_dist checkpoints (EDiT's state included) here: after the last "
             "step, and every --save-interval steps")
    add("--save-interval", type=at_least_1, default=None, help="with --save: also save after every this many steps")
    add("--load", default=None, metavar="DIR",
        help="resume from the newest checkpoint --save wrote to DIR: exactly with the saved --workers, "
             "elastically (one outer step at load) with another number")
    add("--ckpt-step", type=at_least_1, default=None,
        help="with --load: the saved step to resume from (default: the newest)")
    add("--num-experts", type=_int_at_least(2), default=None,
        help="MoE: this many experts per transformer layer (top-2 routing, sequential experts, "
             "the alltoall token dispatcher); default: a dense model")
    add("--expert-model-parallel-size", type=at_least_1, default=1,
        help="MoE: expert parallelism (must divide --num-experts and the number of processes, "
             "with --workers dividing processes / this)")
    add("--bucket-size", type=at_least_1, default=20000,
        help="DDP bucket size in elements (small: several layer-wise buckets)")
    add("--use-megatron-fsdp", action="store_true",
        help="Megatron-FSDP in HSDP instead of DDP + the distributed optimizer: each worker (--workers "
             "instances) fully sharded inside, replicated across workers (outer no_shard); "
             "megatron-core 0.16.1")
    add("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
        help="stop (exit code 1) when a worker's loss or gradient norm is not finite, as "
             "Megatron-LM's flag of the same name")
    add("--compute-sleep-ms", type=_non_negative_float, default=0.0,
        help="benchmarks: sleep this long in every training step, after its backward pass (an "
             "accelerator's compute on a machine without one: jobs that share this machine's cores "
             "then train as if each worker had devices of its own; a dead worker's compute does not "
             "go to the others); default 0, off")
    megatron_edit.local_sgd_args_provider(parser)
    parser.set_defaults(**MAIN_JOB_DEFAULTS)
    actions = {a.dest: a for a in parser._actions}
    actions["use_local_sgd"].help = argparse.SUPPRESS  # Megatron-LM's switch; here --mode decides
    for action in parser._actions:  # the package's help in this job's terms
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = in_main_job_terms(action.help)
    actions["local_sgd_warmup_steps"].default = None  # resolved per backend (check_args)
    actions["local_sgd_warmup_steps"].help = (
        "W: ordinary synchronous steps before local training starts (default in this job: "
        f"{MAIN_JOB_DEFAULTS['local_sgd_warmup_steps']}; {MAIN_JOB_FT_WARMUP} with --local-sgd-sync-backend "
        "torchft, whose worker jobs cannot all-reduce gradients across workers).")
    actions["outer_optimizer_lr"].help = (
        f"Outer learning rate (default in this job: {MAIN_JOB_OUTER_SGD['lr']} with SGD; required "
        "with another outer optimizer).")
    actions["outer_optimizer_momentum"].help = (
        f"Momentum of the outer SGD, in [0, 1) (default in this job: {MAIN_JOB_OUTER_SGD['momentum']}; "
        "SGD only, other optimizers take theirs in --outer-optimizer-kwargs).")
    actions["outer_optimizer_nesterov"].help = (
        "Nesterov momentum for the outer SGD (default in this job: "
        f"{'on' if MAIN_JOB_OUTER_SGD['nesterov'] else 'off'}; SGD only).")
    return parser


def resolve_warmup(args: argparse.Namespace) -> None:
    """--local-sgd-warmup-steps left unset: the main job's default for the sync backend
    (:data:`MAIN_JOB_DEFAULTS`; :data:`MAIN_JOB_FT_WARMUP` with torchft)."""
    if args.local_sgd_warmup_steps is None:
        args.local_sgd_warmup_steps = (MAIN_JOB_FT_WARMUP if args.local_sgd_sync_backend == "torchft"
                                       else MAIN_JOB_DEFAULTS["local_sgd_warmup_steps"])


def apply_outer_defaults(args: argparse.Namespace) -> None:
    """The main job's outer SGD defaults (:data:`MAIN_JOB_OUTER_SGD`) where the user left them
    unset (and its warmup, :func:`resolve_warmup`); nothing more with another outer optimizer or
    --mode baseline (which trains without one)."""
    resolve_warmup(args)
    if args.mode == "baseline" or args.outer_optimizer not in ("sgd", "torch.optim.SGD"):
        return
    extra = args.outer_optimizer_kwargs if isinstance(args.outer_optimizer_kwargs, dict) else {}
    for key, value in MAIN_JOB_OUTER_SGD.items():
        if getattr(args, f"outer_optimizer_{key}") is None and key not in extra:
            setattr(args, f"outer_optimizer_{key}", value)


# Megatron-LM's flags that the package's messages name, and this job's counterparts.
_MAIN_JOB_TERMS = (("--global-batch-size / --micro-batch-size", "--micro-batch-size"),
                   ("--train-iters", "--steps"),
                   (" (needs --overlap-param-gather)", ""),  # this job always overlaps it
                   ("--distributed-timeout-minutes", "torch's 30 minutes"),
                   ("DistributedDataParallelConfig.bucket_size", "--bucket-size"))


def in_main_job_terms(message: str) -> str:
    """A message of the package, in this job's flag names."""
    for megatron_flag, ours in _MAIN_JOB_TERMS:
        message = message.replace(megatron_flag, ours)
    return message


def _check_data_dir(path: str, parser) -> None:
    """--data-dir must be a folder, or a path where one can be made."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            parser.fail(f"--data-dir {path} is a file, not a folder: name a folder (it is created "
                        "if missing; the dataset is built there once).")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        parser.fail(f"--data-dir {path} cannot be created ({parent} is not a writable folder).")


def check_args(args: argparse.Namespace, parser: Rank0ArgumentParser) -> None:
    """Flag combinations, before Megatron is imported and the process group exists: a bad one
    ends every rank with exit code 2 and one line on rank 0 naming the flag."""
    _check_data_dir(args.data_dir, parser)
    resolve_warmup(args)
    main_job_checkpoint.check(args, parser.fail)
    if args.hidden % args.heads:
        parser.fail(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}.")
    if args.lr_warmup_steps >= args.steps:
        parser.fail(f"--lr-warmup-steps {args.lr_warmup_steps} must be below --steps {args.steps} "
                    "(Megatron's scheduler warms up, then decays over the run).")
    ep = args.expert_model_parallel_size
    if ep > 1 and not args.num_experts:
        parser.fail(f"--expert-model-parallel-size {ep} needs a MoE model: pass --num-experts.")
    if args.num_experts and args.num_experts % ep:
        parser.fail(f"--expert-model-parallel-size {ep} must divide --num-experts {args.num_experts}.")
    if args.use_megatron_fsdp:
        _check_megatron_fsdp(args, parser)
    if args.use_local_sgd:
        parser.fail("--use-local-sgd is Megatron-LM's switch; in the main job --mode edit (the "
                    "default) or --mode both trains with EDiT.")
    if args.mode == "baseline":
        changed = changed_flags(args, parser)
        if changed:
            parser.fail(f"{', '.join(changed)} {'does' if len(changed) == 1 else 'do'} nothing with "
                        "--mode baseline (synchronous training): use --mode edit or --mode both, "
                        "or drop the EDiT flags.")
        return
    if args.local_sgd_sync_backend == "torchft" and args.mode == "both":
        parser.fail("--mode both with --local-sgd-sync-backend torchft: the synchronous run needs every "
                    "worker in one job; use --mode edit (the default) with torchft, or the torch backend.")
    if args.local_sgd_sync_backend == "torchft" and args.local_sgd_min_replicas > args.workers:
        parser.fail(f"--local-sgd-min-replicas {args.local_sgd_min_replicas} is more than --workers "
                    f"{args.workers}: no sync could ever commit; lower it.")
    checked = {**vars(args), "use_local_sgd": True}
    if supervises(args):  # the worker jobs get their ids and the Lighthouse from this process
        checked.update(local_sgd_replica_id=0, local_sgd_lighthouse="http://127.0.0.1:1")
    try:
        check_flags(argparse.Namespace(**checked))
    except ConfigError as e:
        parser.fail(in_main_job_terms(str(e)))
    if args.local_sgd_exchange_topk_density is not None:  # the workers are known here (imports torch)
        from megatron_edit.exchange.sparse import check_sparse_workers

        try:
            check_sparse_workers(args.workers, args.local_sgd_exchange_topk_density, args.local_sgd_exchange_topk_chunk,
                                 args.local_sgd_exchange_dtype)
        except ConfigError as e:
            parser.fail(in_main_job_terms(str(e)))
    w, h = args.local_sgd_warmup_steps, args.local_sgd_sync_interval
    if w >= args.steps:
        parser.fail(f"--local-sgd-warmup-steps {w} >= --steps {args.steps}: every step would be "
                    "synchronous warmup and EDiT would never train locally; lower it.")
    if not args.local_sgd_async and w + h > args.steps:
        parser.fail(f"--steps {args.steps} ends before the first sync, after step {w + h} "
                    f"(--local-sgd-warmup-steps {w} + --local-sgd-sync-interval {h}): the workers "
                    "would never sync; lower either, or raise --steps.")



def _check_megatron_fsdp(args: argparse.Namespace, parser: Rank0ArgumentParser) -> None:
    """--use-megatron-fsdp: what this job does not run with it. The EDiT settings Megatron-FSDP
    does not run are refused when its model is built (megatron_edit.mcore.fsdp, one line)."""
    from megatron_edit.mcore import compat
    from megatron_edit.mcore.releases import FSDP_EXPERT_PARALLEL, FSDP_SUPPORTED

    version = compat.megatron_core_version()
    if not FSDP_SUPPORTED.contains(version):
        parser.fail(f"--use-megatron-fsdp: this job runs Megatron-FSDP on megatron-core {FSDP_SUPPORTED} "
                    f"(installed: {version}); install megatron-core 0.16.1 (or 0.17-0.19) or drop the flag.")
    if args.num_experts and args.expert_model_parallel_size > 1 and not FSDP_EXPERT_PARALLEL.contains(version):
        parser.fail(f"--use-megatron-fsdp with --expert-model-parallel-size > 1 on megatron-core {version}: its "
                    "HSDP has no expert parallelism (0.17+ has); use --expert-model-parallel-size 1.")
    if args.local_sgd_sync_backend == "torchft" and args.mode != "baseline":
        parser.fail("--use-megatron-fsdp with --local-sgd-sync-backend torchft is not supported yet: EDiT on "
                    "Megatron-FSDP exchanges across its HSDP instances in one job; use the torch backend.")
    if args.bucket_size != parser.get_default("bucket_size"):
        parser.fail(f"--bucket-size {args.bucket_size} does nothing with --use-megatron-fsdp: Megatron-FSDP "
                    "cuts its buckets by its communication unit (here twice a layer's parameters); drop it.")
    if args.mode != "baseline":
        from megatron_edit.mcore.fsdp import check_fsdp_local_settings

        try:
            check_fsdp_local_settings(argparse.Namespace(cpu_offload=args.local_sgd_cpu_offload))
        except ConfigError as e:
            parser.fail(str(e))


DEFAULT_PROCESSES = 4


def under_torchrun() -> bool:
    """Started as a rank by torchrun or by :func:`launch` (torch's launcher sets these)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def uses_torchft(args: argparse.Namespace) -> bool:
    """EDiT over torchft: each worker is its own job."""
    return args.mode != "baseline" and args.local_sgd_sync_backend == "torchft"


def supervises(args: argparse.Namespace) -> bool:
    """Started with python for a torchft run without a worker id: this process runs the
    Lighthouse and the worker jobs (:func:`supervise`)."""
    return uses_torchft(args) and args.local_sgd_replica_id is None and not under_torchrun()


def check_launch(args: argparse.Namespace, parser: Rank0ArgumentParser) -> int:
    """What needs the number of processes (torchrun's, or --nproc-per-node): returns the
    processes of this job (with torchft, of one worker; see :func:`all_processes`)."""
    if under_torchrun() and uses_torchft(args):  # torchrun started one worker's job
        world = int(os.environ["WORLD_SIZE"]) * args.workers
        starts = "torchrun's --nproc_per_node x --nnodes x --workers"
    elif under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if args.nproc_per_node is not None and args.nproc_per_node != local:
            parser.fail(f"--nproc-per-node {args.nproc_per_node} differs from torchrun's "
                        f"--nproc_per_node {local}: under torchrun, drop --nproc-per-node.")
        starts = "torchrun's --nproc_per_node x --nnodes"
    else:
        world = args.nproc_per_node or DEFAULT_PROCESSES
        starts = "--nproc-per-node"
    if world % args.workers:
        parser.fail(f"--workers {args.workers} must divide the number of processes ({world}, "
                    f"{starts}).")
    ep = args.expert_model_parallel_size
    if world % ep or (world // ep) % args.workers:
        parser.fail(f"--expert-model-parallel-size {ep} must divide the number of processes ({world}, "
                    f"{starts}), and --workers {args.workers} the quotient (each worker holds every "
                    "expert once).")
    if args.mode != "baseline":
        check_fragments_fit_buckets(args, parser)
    per_step = world // args.workers * args.micro_batch_size
    if args.eval_samples < per_step:
        parser.fail(f"--eval-samples {args.eval_samples} is fewer than one validation batch of "
                    f"a worker ({world // args.workers} ranks x --micro-batch-size "
                    f"{args.micro_batch_size} = {per_step}).")
    return world // args.workers if uses_torchft(args) else world


def all_processes(args: argparse.Namespace, job: int) -> int:
    """Every worker's processes: the job's (``job``), times --workers with torchft."""
    return job * args.workers if uses_torchft(args) else job



# megatron_edit.cpu.data.VOCAB_SIZE (256 bytes + end of document), which imports torch to read.
VOCAB_SIZE = 257


def dense_parameters(args: argparse.Namespace):
    """(elements, tensors) of this job's dense GPT (an output layer of its own, GPTModel's
    default), known before torch is imported; the header's parameter count says the same."""
    h, ffn = args.hidden, 4 * args.hidden
    per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (ffn * h + ffn) + (h * ffn + h)
    elements = 2 * VOCAB_SIZE * h + args.seq_length * h + args.layers * per_layer + 2 * h
    return elements, 3 + 12 * args.layers + 2


def check_fragments_fit_buckets(args: argparse.Namespace, parser: Rank0ArgumentParser) -> None:
    """--local-sgd-fragments F needs at least F buckets (one bucket group each). A bucket closes
    once it holds --bucket-size elements (each parameter padded by under 64), so a dense model
    of T elements in P tensors has at most (T + 63 P) // size + 1 of them: refused here when
    even that is too few (megatron-core checks the real count when EDiT is attached). MoE: the
    experts' buckets are another optimizer's, checked there."""
    fragments = args.local_sgd_fragments
    if fragments <= 1 or args.num_experts:
        return
    elements, tensors = dense_parameters(args)
    most = (elements + 63 * tensors) // args.bucket_size + 1
    if most < fragments:
        parser.fail(f"--local-sgd-fragments {fragments} needs at least {fragments} DDP buckets, but "
                    f"--bucket-size {args.bucket_size} makes at most {most} of this model (at most "
                    f"{elements:,} parameters; a bucket closes once it holds --bucket-size of them): "
                    f"lower --bucket-size well below {elements // fragments:,}, or use fewer fragments.")


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked (see :func:`check_args`); the benchmarks build on them."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    return args

