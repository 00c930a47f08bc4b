"""The main job: a small megatron-core GPT trained with EDiT on CPU, over gloo.

    python scripts/train_gpt_edit.py              # EDiT, 4 processes: 2 workers x 2 shards
    python scripts/train_gpt_edit.py --mode both  # then synchronous training on the same data
    python scripts/train_gpt_edit.py --num-experts 4 --expert-model-parallel-size 2  # MoE
    python scripts/train_gpt_edit.py --local-sgd-sync-backend torchft  # each worker its own job

With --local-sgd-sync-backend torchft (pip install torchft==0.2.0) each worker is its own job
of --nproc-per-node / --workers ranks: started with python, this runs torchft's Lighthouse and
the worker jobs through megatron_edit.supervise (a dead worker's job is relaunched fresh and
heals from the others at their next sync; the first sync waits for every worker). Each job
prints its own worker's lines and summary.

Started with python, it checks its flags before torch is even imported (a mistake costs one
line and exit code 2, in a fraction of a second), then starts --nproc-per-node ranks on this
machine through torch's own launcher (torch.distributed.launcher, what torchrun runs). A rank
that fails ends the job with one line naming it and its exit code. Started by torchrun
(``torchrun --nproc_per_node 4 scripts/train_gpt_edit.py``, e.g. across nodes), each rank
checks the same flags itself.

Real Megatron parts throughout: GPTModel, DistributedDataParallel with the (partial) distributed
optimizer, get_megatron_optimizer, OptimizerParamScheduler, the forward/backward schedule and
megatron-core's GPTDataset over an indexed dataset built from text that ships with Python
(megatron_edit.cpu.data). megatron_edit.cpu.adapter lets megatron-core run without CUDA.

Each worker (one distributed-optimizer instance) trains on its own slice of every global batch.
Rank 0 prints its worker's loss every --log-interval steps and each sync (bytes this rank sent
across the sync group; with the pseudo-gradient penalty on, its decisions).

Nothing crosses workers between syncs, in this script either: the per-step loss is averaged
inside the worker, and validation is worker-local (each worker evaluates its own model on the
same held-out samples over its own ranks; its first rank prints the line). The only collective
across workers outside the syncs is the summary's, after the last sync, where every worker is
at the same logical point. A collective across workers at a fixed step would hang A-EDiT
(--local-sgd-async): workers reach a step at different times, and one can sit in a sync's
all-reduce that the other never joins while it waits in that collective.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# megatron-core warns at import that transformer-engine/apex are absent and it uses torch's
# implementations; expected on CPU, so keep the demo's output readable.
warnings.filterwarnings("ignore", module=r"megatron\.")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

import megatron_edit  # noqa: E402  (light: the flags' modules import neither torch nor Megatron)
from megatron_edit import arguments  # noqa: E402
from megatron_edit.arguments import (  # noqa: E402
    PEER_WAIT_S, Rank0ArgumentParser, changed_flags, check_flags, end_with_error, wait_for_the_launcher,
)
from megatron_edit.config import ConfigError  # noqa: E402
from megatron_edit.launch import quiet_upstream_warnings  # noqa: E402

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


def build_parser() -> Rank0ArgumentParser:
    # allow_abbrev=False: a prefix of a flag (--local-sgd-fragment) is refused, not taken for
    # the flag it begins (Megatron-LM's parser does the same).
    parser = Rank0ArgumentParser(prog=os.path.basename(__file__), description=__doc__,
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
            action.help = _in_main_job_terms(action.help)
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


def _in_main_job_terms(message: str) -> str:
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
    _checkpoints().check(args, parser.fail)
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
        parser.fail(_in_main_job_terms(str(e)))
    if args.local_sgd_exchange_topk_density is not None:  # the workers are known here (imports torch)
        from megatron_edit.exchange.sparse import check_sparse_workers

        try:
            check_sparse_workers(args.workers, args.local_sgd_exchange_topk_density, args.local_sgd_exchange_topk_chunk,
                                 args.local_sgd_exchange_dtype)
        except ConfigError as e:
            parser.fail(_in_main_job_terms(str(e)))
    w, h = args.local_sgd_warmup_steps, args.local_sgd_sync_interval
    if w >= args.steps:
        parser.fail(f"--local-sgd-warmup-steps {w} >= --steps {args.steps}: every step would be "
                    "synchronous warmup and EDiT would never train locally; lower it.")
    if not args.local_sgd_async and w + h > args.steps:
        parser.fail(f"--steps {args.steps} ends before the first sync, after step {w + h} "
                    f"(--local-sgd-warmup-steps {w} + --local-sgd-sync-interval {h}): the workers "
                    "would never sync; lower either, or raise --steps.")


def _checkpoints():
    """The main job's --save / --load (scripts/main_job_checkpoint.py, beside this script)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import main_job_checkpoint

    return main_job_checkpoint


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


def supervise(argv, workers: int) -> int:
    """A torchft run on this machine: torchft's Lighthouse and one job per worker, each this
    script with the same flags and its --local-sgd-replica-id (megatron_edit.supervise: a job
    that dies is relaunched fresh; the first sync waits for every worker)."""
    from megatron_edit import supervise as supervisor

    command = [sys.executable, os.path.abspath(__file__), *argv, "--local-sgd-replica-id", supervisor.PLACEHOLDER]
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse and Managers: no INFO line per quorum
    options = supervisor._parser().parse_args(["--workers", str(workers)])  # its defaults
    options.command = command
    return supervisor.supervise(options, prog=os.path.basename(__file__))


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


def launch(argv=None) -> int:
    """Check the flags (no torch yet), then start the ranks on this machine through torch's
    launcher, each running this script with the same flags; the exit code of the job."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    apply_outer_defaults(args)
    check_args(args, parser)
    world = check_launch(args, parser)
    if supervises(args):
        return supervise(argv, args.workers)
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does; each rank uses one thread
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1)
    for name in list(logging.root.manager.loggerDict):  # its report is the one line below
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        elastic_launch(config, sys.executable)(os.path.abspath(__file__), *argv)
    except (KeyboardInterrupt, SignalException) as e:
        # Ctrl-C: the ranks got it too; rank 0 printed "stopped by the user at step N" (UserStop)
        signum = getattr(e, "sigval", signal.SIGINT)
        return 128 + int(signum)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code == 2:  # a flag refused by the ranks (rank 0 printed the line): nothing to add
            return 2
        how = f"was killed by signal {-code}" if code < 0 else f"ended with exit code {code}"
        print(f"{parser.prog}: rank {rank} {how} (its output is above); the other ranks were "
              "stopped.", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked (see :func:`check_args`); the benchmarks build on them."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    return args


# Started with python: check the flags and start the ranks, before torch is imported.
if __name__ == "__main__" and not under_torchrun():
    raise SystemExit(launch())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def log0(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


class UserStop:
    """Ctrl-C on a rank: rank 0 prints one line, ``stopped by the user at step N``, and every
    rank ends with exit code 130 at once (``os._exit`` from the signal handler: no
    KeyboardInterrupt unwinding through Megatron and gloo, which printed a traceback per rank
    and the peers' closed connections, about 180 lines). The launcher returns 130 quietly."""

    def __init__(self):
        self.step = 0
        """The step in progress (0: before the first)."""

    def install(self) -> None:
        signal.signal(signal.SIGINT, self.stop)

    def line(self) -> str:
        where = f"at step {self.step}" if self.step else "before the first step"
        return f"{os.path.basename(__file__)}: stopped by the user {where}"

    def stop(self, signum=None, frame=None) -> None:
        if os.environ.get("RANK", "0") == "0":
            print(self.line(), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)


USER_STOP = UserStop()


class _LogFormatter(logging.Formatter):
    """The package's log lines as they are, except a SyncReport argument (--local-sgd-debug's
    per-rank line) as its scalars instead of its repr (tensors over many lines)."""

    def format(self, record):
        if isinstance(record.args, tuple) and any(isinstance(a, megatron_edit.SyncReport) for a in record.args):
            record.args = tuple(_brief(a) if isinstance(a, megatron_edit.SyncReport) else a for a in record.args)
        return super().format(record)


def _brief(report) -> str:
    figures = ", ".join(f"{k.split('/', 1)[1]} {v:.4g}" for k, v in report.scalars().items())
    return f"sync after step {report.step} ({report.mode}): {figures}"


def setup_logging(debug: bool) -> None:
    """The package logs through ``logging`` (logger ``megatron_edit``): its warnings always,
    --local-sgd-auto-overlap's decisions (one line each), and with --local-sgd-debug every sync
    on every rank."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_LogFormatter("%(message)s"))
    logger = logging.getLogger("megatron_edit")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if debug else logging.WARNING)
    logger.propagate = False
    logging.getLogger("megatron_edit.mcore.auto_overlap").setLevel(logging.INFO)


def build(args, use_local_sgd):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron_edit.cpu import data

    if use_local_sgd:
        megatron_edit.patch_megatron_for_local_sgd(*megatron_edit.configs_from_args(args))
    else:
        megatron_edit.unpatch_megatron_for_local_sgd()
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    moe = {}
    if args.num_experts:  # sequential experts on CPU; 0.16.1's expert bias is added in place on a view
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                   expert_model_parallel_size=args.expert_model_parallel_size, add_bias_linear=False)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, **moe,
    )
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=data.VOCAB_SIZE, max_sequence_length=args.seq_length)
    if args.use_megatron_fsdp:  # HSDP: a worker is an instance, fully sharded inside, replicated across
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        # gloo has no PREMUL_SUM (gradient_reduce_div_fusion off); fp32 main weights. The
        # communication unit twice a layer (Megatron-FSDP's own rule, which megatron-core 0.16.1
        # then raises to 1B elements): the prefetch window holds the next layer, not the whole
        # model, so a layer-wise sync overlaps the next forward pass.
        layer = sum(p.numel() for p in model.decoder.layers[0].parameters())
        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
            num_distributed_optimizer_instances=args.workers, outer_dp_sharding_strategy="no_shard",
            overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True,
            gradient_reduce_div_fusion=False, bucket_size=args.bucket_size,
            suggested_communication_unit_size=2 * layer,
        )
        ddp = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                       device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    else:
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
            num_distributed_optimizer_instances=1 if uses_torchft(args) else args.workers,
            bucket_size=args.bucket_size,
        )
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr / 10, weight_decay=0.01, clip_grad=1.0,
                        adam_beta2=0.95, use_distributed_optimizer=True),
        [ddp],
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10, lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=args.steps, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=args.steps, wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                   labels=batch["labels"])
    mask = batch["loss_mask"].float()

    def loss_func(per_token_loss):
        loss = (per_token_loss.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return output, loss_func


def worker_group():
    """The data-parallel ranks of this worker (every megatron-core release since 0.12 has it)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)


def worker_mean(value, group):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def validation_losses(args, ddp, valid_ds, rank: int, size: int) -> list:
    """This rank's share of the held-out samples (every ``size``-th micro-batch from ``rank``):
    the loss of each of its micro-batches under the current model. No collective; completes a
    pending layer-wise sync first."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_edit.cpu import data

    ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync, gathers params
    n = args.eval_samples // (size * args.micro_batch_size)
    it = data.batch_iterator(valid_ds, args.micro_batch_size, start=rank, stride=size)
    batches = [next(it) for _ in range(n)]
    ddp.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp], num_microbatches=n,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=True,
        )
    ddp.train()
    return [d["lm loss"].item() for d in out]


def evaluate(args, ddp, valid_ds) -> float:
    """Validation loss of this worker's current model on the held-out samples, computed over this
    worker's ranks only (each takes its share, the mean is taken inside the worker): no
    collective across workers, so it is safe at any step, with A-EDiT too."""
    intra = worker_group()
    losses = validation_losses(args, ddp, valid_ds, intra.rank(), intra.size())
    return worker_mean(sum(losses) / len(losses), intra)


def gather_per_worker(value: float) -> dict:
    """{worker: value} from every worker's first rank, on every rank. A collective across
    workers: call it only where every worker is at the same logical point (after the last sync;
    with synchronous EDiT, after any step), never at a fixed step with A-EDiT."""
    size = worker_group().size()
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64))
    return {r // size: v.item() for r, v in enumerate(values) if r % size == 0}


def stop_if_not_finite(args, what: str, value, step: int, worker: int, lead: bool, use_local_sgd: bool) -> None:
    """Like Megatron-LM's --check-for-nan-in-loss-and-grad: a worker whose loss or gradient norm
    is not finite stops the job (its ranks exit 1; the launcher ends the others). The worker's
    lead prints the line and exits at once; its other ranks wait for the launcher to stop them
    (a rank that exited first had the launcher stop the leads before they printed)
    and print the line themselves if still running after the wait."""
    if value is None or math.isfinite(value) or not args.check_for_nan_in_loss_and_grad:
        return
    hint = (f" Check the outer optimizer (--outer-optimizer {args.outer_optimizer}, "
            f"--outer-optimizer-lr, --outer-optimizer-momentum) and --lr {args.lr}."
            if use_local_sgd else f" Check --lr {args.lr}.")
    end_with_error(f"train_gpt_edit.py: error: step {step}: worker {worker}'s {what} is {value}; "
                   f"stopping.{hint} (--no-check-for-nan-in-loss-and-grad trains on.)", first=lead, code=1)


def describe_edit(controller, args) -> str:
    c, outer = controller.config, controller.outer_config
    kwargs = ", ".join(f"{k} {v}" for k, v in outer.outer_optim_kwargs.items())
    if c.use_async:
        when = (f"A-EDiT: sync every {c.local_sgd_sync_time:g} s of training (the first "
                f"{c.local_sgd_sync_interval} local steps after warmup), skipped below "
                f"{c.min_total_global_steps} steps in total, a budget of {args.steps * args.workers} "
                f"worker-steps (--steps x --workers: each worker stops at its own step count, the "
                f"faster later, at a last sync)")
    else:
        when = f"sync every {c.local_sgd_sync_interval} steps"
        if c.fragments > 1:
            when += (f" in {c.fragments} fragments ({'/'.join(str(len(f)) for f in controller.sync_shards.fragments)}"
                     f" buckets), one every {c.local_sgd_sync_interval // c.fragments} steps")
        if c.outer_step_delay:
            merge = ("keep_local" if c.outer_merge_rule == "keep_local" else f"lerp alpha {c.merge_alpha:g}")
            when += f", each exchange launched {c.outer_step_delay} steps early (merge: {merge})"
    text = (f"{when}, after {c.local_sgd_warmup_steps} synchronous warmup steps, {c.sync_mode} mode; "
            f"outer {outer.optimizer_class.__name__} ({kwargs})")
    auto = getattr(controller, "auto", None)
    if auto is not None:  # what is above is where it starts: its first syncs are timed with it
        from megatron_edit.mcore.auto_overlap import MEASURE_SYNCS

        text += (f"\nauto overlap: the delay, format ({','.join(auto.formats)}) and fragments "
                 f"({','.join(map(str, auto.fragments))}) chosen from the first {MEASURE_SYNCS} syncs, timed with "
                 f"the settings above, and again every {auto.user.auto_every} syncs")
    exchange = c.exchange_dtype
    feedback = ", error feedback" if c.error_feedback else ""
    if c.exchange_topk_density is not None:  # the sparse exchange: its own layout, error feedback by default
        exchange = (f"top-k: the largest {c.exchange_topk_density:g} of each chunk of {c.exchange_topk_chunk} "
                    f"values, sent in {c.exchange_dtype}{feedback}")
    elif exchange != "fp32":
        exchange += f" (a scale per {c.exchange_block_size} values{feedback})"
    arrivals = controller.arrivals
    timeout = ("" if arrivals is None else
               f"; sync timeout {arrivals.timeout:g} s"
               + (" (torch's default; --local-sgd-sync-timeout)" if c.sync_timeout is None else ""))
    model = ("dense model" if not args.num_experts else
             f"MoE: {args.num_experts} experts per layer, top-2, expert parallelism "
             f"{args.expert_model_parallel_size}")
    text += f"\nexchange {exchange}{timeout}; {model}"
    penalty = []
    if c.skip_anomaly:
        penalty.append(f"anomaly elimination (EWMA alpha {c.ewma_alpha}, after {c.ewma_warmup_steps} "
                       f"syncs, z > {c.ewma_threshold})")
    if c.pseudo_gradnorm_reduce:
        penalty.append(f"weights softmax(-norm / {c.weight_softmax_temperature or 1.0:g})")
    if c.clip_pseudo_grad is not None:
        penalty.append(f"clip at {c.clip_pseudo_grad:g}")
    return text + (f"\npenalty: {', '.join(penalty)}" if penalty else "")


def _names(report, layers) -> str:
    total = len(report.layer_names or ()) or None
    if len(layers) == total:
        return f"all {total} layers"
    names = [report.layer_names[i] for i in layers] if report.layer_names else [str(i) for i in layers]
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more layers" if len(names) > 2 else "")


def penalty_line(report):
    """The penalty's decisions at one sync (None when it is off): who was excluded from which
    layers, the averaging weights, the clipping."""
    parts = []
    if report.excluded is not None:
        excluded = [(w, row.nonzero().flatten().tolist()) for w, row in enumerate(report.excluded)]
        excluded = [(w, layers) for w, layers in excluded if layers]
        parts.append("excluded " + "; ".join(f"worker {w} from {_names(report, l)}" for w, l in excluded)
                     if excluded else "no worker excluded")
    if report.skipped is not None and bool(report.skipped.any()):
        layers = report.skipped.nonzero().flatten().tolist()
        parts.append(f"outer step skipped (every worker excluded) for {_names(report, layers)}")
    if report.weights is not None and report.norms is not None:
        parts.append("weights " + ", ".join(
            f"worker {w} {float(row.min()):.3f}-{float(row.max()):.3f}" for w, row in enumerate(report.weights)))
    if report.clip_coef is not None:
        clipped = int((report.clip_coef < 1).sum())
        parts.append(f"clip factor min {float(report.clip_coef.min()):.3f} "
                     f"({clipped} of {len(report.clip_coef)} layers clipped)")
    return "penalty: " + " | ".join(parts) if parts else None


SYNC_LABEL = "sync"
"""How the sync lines begin: with --local-sgd-sync-backend torchft each worker's job prints its
own (``worker N sync``)."""


def log_syncs(per_controller, counts) -> None:
    """Rank 0 prints each sync (the syncs are the same on every worker). ``per_controller``:
    each EDiT controller's reports (a MoE model with expert parallelism has two, the dense and
    the experts' optimizer, which sync together: one line per sync)."""
    for r, *more in zip(*per_controller):
        if r.skipped_sync:
            counts["skipped"] += 1
            log0(f"          sync after step {r.step} skipped: the workers took "
                 f"{int(r.worker_steps.sum())} steps in total since the last exchange "
                 f"({', '.join(str(int(s)) for s in r.worker_steps)}), fewer than "
                 f"--local-sgd-min-total-global-steps")
            continue
        counts["syncs"] += 1
        sent = r.payload_bytes + sum(x.payload_bytes for x in more)
        counts["bytes"] += sent
        steps = ""
        if r.worker_steps is not None:
            steps = f"; steps per worker since the last: {', '.join(str(int(s)) for s in r.worker_steps)}"
        experts = "".join(f" + {x.buckets} expert buckets" for x in more)
        what = "" if r.fragment is None else f" (fragment {r.fragment})"
        if r.delay:
            what += f" (launched after step {r.step - r.delay}, exposed wait {r.exposed_wait_seconds * 1e3:.1f} ms)"
        if not r.committed:  # torchft: the round failed or had too few workers; nothing applied
            what += " NOT COMMITTED (the local progress is kept for the next sync)"
        log0(f"          {SYNC_LABEL} {counts['syncs']} after step {r.step}{what}: {r.buckets} buckets{experts}, "
             f"{sent / 1e3:.1f} kB sent by this rank across the sync group "
             f"({r.workers} workers{'' if r.trained in (None, r.workers) else f', {r.trained} trained since the last'}), {(r.seconds + sum(x.seconds for x in more)) * 1e3:.1f} ms in EDiT code{steps}")
        for report, what in zip((r, *more), ("", *["experts: "] * len(more))):
            line = penalty_line(report)
            if line:
                log0(f"            {what}{line}")


def train(args, use_local_sgd, datasets):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_edit.cpu import data

    train_ds, valid_ds = datasets
    ddp, optimizer, scheduler = build(args, use_local_sgd)
    controllers = megatron_edit.get_local_sgd(optimizer)
    use_async = bool(controllers) and controllers[0].config.use_async
    if controllers:
        # The run's length (as Megatron-LM's --train-iters says it). EDiT: a sync at its last
        # step even off the warmup + k H grid, so the workers end with one model. A-EDiT: the
        # budget of the synchronous run of --steps (steps x workers worker-steps), ended at a
        # final sync planned from the workers' speeds, each worker at its own step count.
        megatron_edit.set_train_iters(optimizer, args.steps)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    intra = worker_group()
    worker, lead = dp_rank // intra.size(), intra.rank() == 0
    first = 0  # steps already done: a torchft worker relaunched into a running job healed to the others' step
    ckpt, resumed, history = _checkpoints(), None, {}
    if use_local_sgd and args.load:
        resumed = ckpt.saved_record(args.load, args.ckpt_step)
        if resumed["processes"] != dist.get_world_size():
            raise ConfigError(f"--load {args.load} was saved by {resumed['processes']} processes, this job has "
                              f"{dist.get_world_size()}: resume with --nproc-per-node {resumed['processes']} "
                              "(--workers may differ: an elastic resume).")
        ckpt.load(ddp, optimizer, scheduler, args)
        first = resumed["step"]
        one_model = len(set(ckpt.all_ranks(ckpt.model_digest(ddp)))) == 1  # every rank, after the load
    if use_local_sgd and uses_torchft(args):  # this job is one worker: its slice of every global batch
        worker = args.local_sgd_replica_id
        global SYNC_LABEL
        SYNC_LABEL = f"worker {worker} sync"
        dp_rank, dp = worker * dp + dp_rank, args.workers * dp
        first = controllers[0].steps_done
        if first:
            # (its learning-rate schedule follows at its first step: patch sched-step-global-progress)
            print(f"          worker {worker} rank {dist.get_rank()} joined a running job: healed from a live "
                  f"worker to step {first}; it trains on from there", flush=True)
    it = data.batch_iterator(train_ds, args.micro_batch_size, start=dp_rank + first * args.micro_batch_size * dp,
                             stride=dp)
    name = "EDiT" if use_local_sgd else "synchronous"
    if args.use_megatron_fsdp:  # its gradient shards: each bucket's, reduced across workers per step
        fsdp_buckets = ddp.module.param_and_grad_buffer.parameter_groups
        shard_numel = sum(p.numel() for p in ddp.parameters()) // intra.size()
        buckets = len(fsdp_buckets)
    else:
        buffers = [*ddp.buffers, *ddp.expert_parallel_buffers]  # MoE, expert parallelism: the experts'
        shard_numel = sum(b.grad_data.numel() // buf.data_parallel_group.size() for buf in buffers for b in buf.buckets)
        buckets = len([b for buf in buffers for b in buf.buckets])
    log0(f"\n=== {name}: {args.steps} steps, {args.workers} workers x {intra.size()} shards, "
         f"{sum(p.numel() for p in ddp.parameters()):,} parameters on this rank, {buckets} buckets"
         f"{' (Megatron-FSDP)' if args.use_megatron_fsdp else ''} ===")
    if controllers:
        log0(describe_edit(controllers[0], args))
    if resumed is not None:
        log0(f"loaded step {first} of {args.load} ({resumed['workers']} workers saved, {args.workers} now): "
             + ("each worker's own state" if resumed["workers"] == args.workers else
                "one outer step over the saved workers, every worker from its result"))
    counts = dict(syncs=0, skipped=0, bytes=0)
    grad_bytes = 0
    valid = None
    t_start = time.perf_counter()
    # A fast A-EDiT worker takes more steps than --steps (a slow one fewer): at most all of them.
    last_step = args.steps * args.workers if use_async else args.steps
    step = first
    while step < last_step:
        step += 1
        if use_async and controllers[0].finished:
            break
        USER_STOP.step = step
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        local_grads = bool(controllers) and controllers[0].grads_are_local
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([next(it)]), model=[ddp], num_microbatches=1,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False,
        )
        if args.compute_sleep_ms:  # (benchmarks) the device compute this machine has no device for
            time.sleep(args.compute_sleep_ms / 1e3)
        _, grad_norm, _ = optimizer.step()
        scheduler.step(1)
        if uses_torchft(args) and not use_async and controllers and controllers[0].steps_done > step:
            # A heal at this step's sync (a worker behind: a partial heal before, a failed commit) put
            # it at the others' step: its loop and data go on from there (an A-EDiT worker's step
            # count is its own: its loop ends at the final sync).
            log0(f"          worker {worker} healed at its sync after step {step}: it is at the others' step "
                 f"{controllers[0].steps_done} and trains on from there")
            step = controllers[0].steps_done
            it = data.batch_iterator(train_ds, args.micro_batch_size,
                                     start=dp_rank + step * args.micro_batch_size * dp, stride=dp)
        loss = worker_mean(out[0]["lm loss"].item(), intra)  # inside the worker only
        history[step] = loss
        stop_if_not_finite(args, "training loss", loss, step, worker, lead, use_local_sgd)
        stop_if_not_finite(args, "gradient norm", grad_norm, step, worker, lead, use_local_sgd)
        if args.workers > 1 and not local_grads:
            grad_bytes += 4 * shard_numel  # Megatron all-reduces each gradient shard across workers
        ms = (time.perf_counter() - t0) * 1e3
        reports = [c.drain_reports() for c in controllers]
        if step % args.log_interval == 0 or any(reports):
            phase = "" if not controllers else ("  local" if local_grads else "  warmup (synchronous)")
            log0(f"step {step:4d} | worker {worker} loss {loss:.4f} | lr {scheduler.get_lr(optimizer.param_groups[0]):.2e} "
                 f"| {ms:6.1f} ms{phase}")
        log_syncs(reports, counts)
        if step % args.eval_interval == 0 or step == args.steps or (use_async and controllers[0].finished):
            valid = evaluate(args, ddp, valid_ds)  # worker-local
            if lead:  # each worker's first rank: this worker's model
                print(f"          validation after step {step}: worker {worker} {valid:.4f}", flush=True)
            stop_if_not_finite(args, "validation loss", valid, step, worker, lead, use_local_sgd)
            # A layer-wise sync due after this step completed inside the evaluation.
            log_syncs([c.drain_reports() for c in controllers], counts)
        if use_local_sgd and args.save and (step == args.steps or (args.save_interval and step % args.save_interval == 0)):
            ckpt.save(ddp, optimizer, scheduler, args, step, dist.get_world_size())
            log0(f"          saved step {step} to {args.save}")
    for c in controllers:
        c.flush()  # nothing should be pending after the last evaluation; never leave a sync open
    if args.use_megatron_fsdp:  # no parameter all-gather (a prefetch) left in flight inside the worker
        ddp.module.synchronize_param_gather()
    log_syncs([c.drain_reports() for c in controllers], counts)
    elapsed = time.perf_counter() - t_start
    if use_local_sgd and uses_torchft(args):  # workers in jobs of their own: each reports its own
        final = {worker: valid}
        for c in controllers:
            c.backend.close()
    else:  # every worker is past its last sync here: the one collective across workers of the script
        final = gather_per_worker(valid)
    last_line = None
    if use_local_sgd and (args.save or args.load):  # (after the last sync: every rank here)
        losses = {}
        for r, h in enumerate(ckpt.all_ranks(history if lead else None)):
            for s, v in (h or {}).items():
                losses.setdefault(s, {})[r // intra.size()] = v
        if args.save and dist.get_rank() == 0:
            ckpt.write_losses(args, losses)
        if resumed is not None:
            last_line = ckpt.resume_line(args, resumed, losses, one_model)
    return dict(name=name, final=final, cross_bytes=counts["bytes"] + grad_bytes, seconds=elapsed,
                syncs=counts["syncs"], skipped=counts["skipped"], last_line=last_line)


def summary(results) -> None:
    log0("\n=== summary (per rank; cross-worker bytes = EDiT pseudo-gradient exchange or Megatron's "
         "per-step gradient all-reduce across workers) ===")
    headers = ("run", "valid loss (per worker)", "syncs", "cross-worker MB", "wall s")
    rows = [(r["name"], ", ".join(f"{v:.4f}" for v in r["final"].values()),
             str(r["syncs"]) + (f" (+{r['skipped']} skipped)" if r["skipped"] else ""),
             f"{r['cross_bytes'] / 1e6:.3f}", f"{r['seconds']:.1f}") for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    log0(line(headers))
    for row in rows:
        log0(line(row))
    if len(results) == 2 and results[0]["cross_bytes"]:
        log0(f"EDiT sent {results[1]['cross_bytes'] / results[0]['cross_bytes']:.1f}x fewer bytes across workers")


def main(argv=None):
    """One rank of the job (started by torchrun or :func:`launch`); without torchrun's
    environment, :func:`launch` starts the ranks."""
    if not under_torchrun():
        raise SystemExit(launch(argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_outer_defaults(args)
    check_args(args, parser)  # before Megatron is imported and the process group exists
    world = check_launch(args, parser)
    setup_logging(args.local_sgd_debug)
    quiet_upstream_warnings()
    USER_STOP.install()
    from megatron_edit.exchange.job_processes import watch_launcher

    watch_launcher()  # a launcher SIGKILLed alone (or the main job) leaves no rank behind
    torch.set_num_threads(1)
    from megatron_edit.cpu import adapter as cpu_adapter

    cpu_adapter.activate()
    dist.init_process_group("gloo")
    try:
        run_rank(args, world)
    except BaseException as error:  # noqa: B036  (SystemExit and KeyboardInterrupt too)
        end_rank(error)


def end_rank(error: BaseException) -> None:
    """Ends a main-job rank that stops on an error: :func:`megatron_edit.arguments.end_rank`
    (``os._exit`` with the rank's exit code, without the interpreter's teardown of the live gloo
    groups), after the main job's own one-line reports: a refusal found when EDiT is attached
    (exit code 2, printed by rank 0 in the main job's flag names) and a sync timeout (exit code
    1, printed by the rank that reports it; the others wait for the launcher to stop them)."""
    from megatron_edit.exchange.arrival import SyncTimeout

    if isinstance(error, KeyboardInterrupt):  # raised, not signalled (UserStop handles Ctrl-C)
        USER_STOP.stop()
    if isinstance(error, ConfigError):  # found when EDiT is attached (the model is built), on every rank
        line = f"{os.path.basename(__file__)}: error: {_in_main_job_terms(str(error))}"
        if os.environ.get("RANK", "0") != "0":
            wait_for_the_launcher(PEER_WAIT_S, 2)  # rank 0 prints; the launcher stops this rank
        print(line, file=sys.stderr)
        error = SystemExit(2)
    elif isinstance(error, SyncTimeout):
        # Every waiting rank raises it with the same line: the reporter prints it at once; the
        # others wait for the launcher to stop them (end_with_error's order) and print it only
        # if still running then.
        if not error.reporter:
            wait_for_the_launcher(PEER_WAIT_S, 1)
        print(error, file=sys.stderr)
        error = SystemExit(1)
    arguments.end_rank(error)


def run_rank(args: argparse.Namespace, world: int) -> None:
    """The rank's work once the process group exists: data, the runs, the summary."""
    for stream in (sys.stdout, sys.stderr):
        # Whole lines, one write each, even under python -u (torchrun starts ranks so): a rank
        # stopped between print's text and its newline glued the next rank's line to it.
        stream.reconfigure(line_buffering=True, write_through=False)
    from megatron_edit.cpu import data
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=1 if uses_torchft(args) else args.workers,
                                 expert_model_parallel_size=args.expert_model_parallel_size)
    if args.workers == 1 and args.mode != "baseline":
        log0("note: --workers 1 is one EDiT worker: synchronous training plus an outer optimizer "
             "step every H steps; nothing is saved. Use --workers 2 or more to train locally.")

    prefix = os.path.join(args.data_dir, "stdlib_docs")
    os.makedirs(args.data_dir, exist_ok=True)
    data.prepare_indexed_dataset(prefix)
    dp = all_processes(args, ps.get_data_parallel_world_size())
    # A-EDiT: a fast worker may take up to every worker's share of steps.
    train_steps = args.steps * (args.workers if args.local_sgd_async else 1)
    train_ds, valid_ds, _ = data.build_gpt_datasets(
        prefix, args.seq_length, (train_steps * dp * args.micro_batch_size, args.eval_samples, 0), args.seed,
    )
    log0(f"data: {prefix}.bin, {len(train_ds)} training samples of {args.seq_length} tokens "
         f"({world} processes" + (f" of worker {args.local_sgd_replica_id}, {args.workers} workers)"
                                   if uses_torchft(args) else ")"))

    results = []
    if args.mode in ("edit", "both"):
        args.use_local_sgd = True
        results.append(train(args, True, (train_ds, valid_ds)))
    if args.mode in ("baseline", "both"):
        args.use_local_sgd = False
        results.append(train(args, False, (train_ds, valid_ds)))
    summary(results)
    for r in results:
        if r["last_line"]:
            log0(r["last_line"])
    dist.destroy_process_group()
    if any((r["last_line"] or "").endswith(": NO") for r in results):
        raise SystemExit(1)  # a resume that did not match what was saved is not a success


if __name__ == "__main__":
    main()
