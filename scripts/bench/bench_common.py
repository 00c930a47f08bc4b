"""What the benchmarks share: set-up, one training step, a traffic counter, the per-sync record's
reader, tables and plots.

The benchmarks (``scripts/bench/bench_*.py``) train the main job's model (``main_job_model.build``:
a megatron-core GPT on the shipped text, the partial distributed optimizer with one instance
per worker) and measure one thing each against a baseline measured in the same run. Every
benchmark prints its table on rank 0 and writes its plot under ``scripts/bench/results/``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, SCRIPTS)  # the main job's modules (scripts/main_job_*.py)
sys.path.insert(0, os.path.dirname(SCRIPTS))  # the repository: megatron_edit
# As in the main job: megatron-core's warnings at import (no transformer-engine/apex on CPU) kept
# out of the benchmarks' output.
warnings.filterwarnings("ignore", module=r"megatron\.")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

import main_job_flags  # noqa: E402  (the main job's flags)
import main_job_model  # noqa: E402  (the main job's model, data and step)
from megatron_edit.arguments import end_rank  # noqa: E402
from megatron_edit.cpu import adapter as cpu_adapter  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run_main(main: Callable[[], None]) -> None:
    """A benchmark's ``main`` on this rank; a rank that stops on an error ends as the main job's
    do (:func:`megatron_edit.arguments.end_rank`: ``os._exit`` after its message, not the
    interpreter's teardown of live gloo groups)."""
    try:
        main()
    except BaseException as error:  # noqa: B036  (SystemExit and KeyboardInterrupt too)
        end_rank(error)


def parse_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The benchmark's own flags, on top of the main job's (model size, data, EDiT flags)."""
    args, rest = parser.parse_known_args(argv)
    base = main_job_flags.parse_args(rest + ["--steps", "100000"])  # the scheduler's horizon, not a run length
    for key, value in vars(args).items():
        setattr(base, key, value)
    return base


def setup(args, train_samples: int = 40000, eval_samples: Optional[int] = None):
    """One thread per rank, the CPU adapter, gloo, Megatron's groups, the datasets."""
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    cpu_adapter.activate()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_world_size() % args.workers:
        raise SystemExit(f"--workers {args.workers} must divide the number of processes {dist.get_world_size()}")
    ps.initialize_model_parallel(num_distributed_optimizer_instances=args.workers)
    prefix = os.path.join(args.data_dir, "stdlib_docs")
    os.makedirs(args.data_dir, exist_ok=True)
    from megatron_edit.cpu import data

    data.prepare_indexed_dataset(prefix)
    eval_samples = eval_samples or args.eval_samples
    train_ds, valid_ds, _ = data.build_gpt_datasets(
        prefix, args.seq_length, (train_samples, eval_samples, 0), args.seed
    )
    return train_ds, valid_ds


def layout(args) -> Dict[str, int]:
    """This rank's place: worker index, rank inside the worker, worker size, data-parallel rank."""
    from megatron.core import parallel_state as ps

    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    size = dp // args.workers
    return dict(worker=dp_rank // size, rank_in_worker=dp_rank % size, worker_size=size, dp_rank=dp_rank, dp=dp)


def edit_args(args, **changes):
    """A copy of ``args`` with EDiT flags changed (``use_local_sgd`` etc., dashes as underscores)."""
    out = argparse.Namespace(**vars(args))
    for key, value in changes.items():
        setattr(out, key, value)
    return out


def build(args):
    """The main job's model and optimizer, patched for EDiT when ``args.use_local_sgd``."""
    import megatron_edit

    ddp, optimizer, scheduler = main_job_model.build(args, bool(getattr(args, "use_local_sgd", False)))
    return ddp, optimizer, scheduler, megatron_edit.get_local_sgd(optimizer)


def train_step(args, ddp, optimizer, scheduler, batch, forward_step=None) -> None:
    """One Megatron training step on one micro-batch (what the main job does, minus logging)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step or main_job_model.forward_step, data_iterator=iter([batch]), model=[ddp],
        num_microbatches=1,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False,
    )
    optimizer.step()
    scheduler.step(1)


def batches(args, dataset, start_step: int = 0):
    """This rank's micro-batches (the main job's data order), from ``start_step`` on."""
    lay = layout(args)
    from megatron_edit.cpu import data

    return data.batch_iterator(dataset, args.micro_batch_size, start=lay["dp_rank"] + start_step * lay["dp"],
                                   stride=lay["dp"])


def flush(ddp, controllers) -> list:
    """Complete a pending layer-wise sync (as evaluation would) and return every report."""
    ddp.start_param_sync(force_sync=True)
    return [r for c in controllers for r in c.drain_reports()]


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather_floats(values: Sequence[float]) -> torch.Tensor:
    """[world, len(values)] float64: every rank's ``values``."""
    t = torch.tensor(list(values), dtype=torch.float64)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.stack(parts)


def replicas_identical(args, ddp) -> bool:
    """Whether every worker holds the same parameters (checksums over all ranks)."""
    lay = layout(args)
    s = float(sum(p.detach().double().sum() for p in ddp.parameters()))
    sums = gather_floats([s])[:, 0]
    size = lay["worker_size"]
    return all(sums[r].item() == sums[r % size].item() for r in range(len(sums)))


class TrafficCounter:
    """Counts every collective whose group spans more than one worker, by wrapping
    ``torch.distributed`` and the two functions megatron-core's buckets bound at import.

    Byte convention (the one ``megatron_edit.exchange.groups.SyncGroup`` uses): what this rank
    sends with ring algorithms over a group of n ranks: an all-reduce of S bytes 2(n-1)/n S, an
    all-gather (n-1)/n of its output, a reduce-scatter and an all-to-all (n-1)/n of their input,
    a broadcast S. (Two workers: an all-reduce sends its tensor once.) Headers not included.
    """

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
             "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter", "all_to_all_single", "broadcast",
             "barrier", "all_gather_object", "broadcast_object_list")

    def __init__(self, worker_of_rank: Dict[int, int]):
        import megatron.core.distributed.param_and_grad_buffer as pgb

        self.worker_of_rank = worker_of_rank
        self.step = 0
        self.enabled = True
        self.events: List[tuple] = []  # (step, name, numel, bytes)
        self._saved = []
        self._group_spans: Dict[object, bool] = {}
        for name in self.NAMES:
            if hasattr(dist, name):
                self._wrap(dist, name)
        for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
            self._wrap(pgb, name)

    def _spans_workers(self, group) -> bool:
        key = id(group)
        if key not in self._group_spans:
            ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
            self._group_spans[key] = len({self.worker_of_rank[r] for r in ranks}) > 1
        return self._group_spans[key]

    @staticmethod
    def _bytes(name, args, kwargs, group) -> int:
        def nbytes(t):
            return t.numel() * t.element_size() if torch.is_tensor(t) else 0

        n = dist.get_world_size(group)
        if name in ("all_gather",):
            parts = args[0] if args else kwargs.get("tensor_list")
            return (n - 1) * sum(nbytes(t) for t in parts) // n
        if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "dist_all_gather_func"):
            return (n - 1) * nbytes(args[0] if args else kwargs.get("output_tensor")) // n
        if name in ("reduce_scatter_tensor", "_reduce_scatter_base", "dist_reduce_scatter_func", "all_to_all_single"):
            return (n - 1) * nbytes(args[1] if len(args) > 1 else kwargs.get("input")) // n
        if name == "reduce_scatter":
            parts = args[1] if len(args) > 1 else kwargs.get("input_list")
            return (n - 1) * sum(nbytes(t) for t in parts) // n
        if name == "all_reduce":
            return 2 * (n - 1) * nbytes(args[0] if args else kwargs.get("tensor")) // n
        if name == "broadcast":
            return nbytes(args[0] if args else kwargs.get("tensor"))
        return 0  # barrier, object collectives (not used by training steps)

    def _wrap(self, owner, name):
        original = getattr(owner, name)
        counter = self
        signature = inspect.signature(original)

        def wrapper(*args, **kwargs):
            try:
                group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            except TypeError:
                group = kwargs.get("group")
            if counter.enabled and counter._spans_workers(group):
                counter.events.append((counter.step, name, counter._bytes(name, args, kwargs, group)))
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def total(self, steps: Optional[range] = None) -> int:
        return sum(b for s, _, b in self.events if steps is None or s in steps)

    def count(self, steps: Optional[range] = None) -> int:
        return sum(1 for s, _, _ in self.events if steps is None or s in steps)

    def reset(self) -> None:
        self.events.clear()
        self.step = 0

    def close(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def worker_of_rank(args) -> Dict[int, int]:
    """Rank -> worker, from every rank's own view (robust to any rank order)."""
    lay = layout(args)
    got = gather_floats([lay["worker"]])[:, 0]
    return {r: int(w) for r, w in enumerate(got.tolist())}


def log0(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], markdown: bool = False) -> str:
    """A fixed-width (or markdown) table of already formatted cells."""
    cells = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" if i else f"{{:<{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*headers), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in cells])


def write_result(name: str, text: str) -> str:
    """Write ``scripts/bench/results/<name>`` (rank 0 only) and return its path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def plot_path(name: str) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    return os.path.join(RESULTS_DIR, name)


def pyplot():
    """matplotlib's pyplot without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_average() -> str:
    """The 1/5/15-minute load averages, to print with timed results (this machine is shared)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def exchange_alone(shard_numels: Sequence[int], group, reps: int = 7) -> float:
    """Seconds for a sync's all-reduces across the workers (one per shard, every rank's at once:
    the ranks of a worker share its link), blocking, nothing else running; the median of
    ``reps`` - 1 timings (the first warms up), each the slowest rank's."""
    import statistics

    tensors = [torch.zeros(n) for n in shard_numels]
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        handles = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
        for handle in handles:
            handle.wait()
        times.append(max_over_ranks(time.perf_counter() - t0))
    return statistics.median(times[1:])


# ---------------------------------------------------------------------- the per-sync record
# What EDiT itself says of each sync (docs/reference/sync-record.md): the benchmarks read their
# bytes, syncs, seconds and waits from it rather than counting them again; they count only what
# it does not hold (the wire's bytes of every collective, synchronous Megatron's, step times).

def record_path(tag: str) -> str:
    """A fresh file for one run's record (``--local-sgd-sync-record``), the same path on every
    rank: rank 0 names it in a new temporary folder and broadcasts it."""
    import tempfile

    name = [os.path.join(tempfile.mkdtemp(prefix="bench_records_"), f"{tag}.jsonl") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


def read_records(path: str, kind: Optional[str] = "sync") -> List[dict]:
    """The records in ``path`` (one JSON object a line), in the order written; ``kind``: only those
    (``sync``: the run's syncs; None: joins too). A missing file or a line that is not a record
    stops the benchmark with one line."""
    import json

    if not os.path.isfile(path):
        raise SystemExit(f"bench: no sync record at {path}: the run wrote none (was --local-sgd-sync-record given?)")
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                record["kind"], record["worker"]
            except (ValueError, TypeError, KeyError) as error:
                raise SystemExit(f"bench: {path}:{number} is not a sync record ({error})") from None
            if kind is None or record["kind"] == kind:
                records.append(record)
    return records


def per_worker(records: Sequence[dict], field: str) -> Dict[int, float]:
    """Worker -> the sum of ``field`` over its records (``bytes_sent``, ``exposed_wait_seconds``, ...)."""
    out: Dict[int, float] = {}
    for r in records:
        out[r["worker"]] = out.get(r["worker"], 0) + (r[field] or 0)
    return out


def by_step(records: Sequence[dict], field: str, combine: Callable = max) -> Dict[int, float]:
    """Step -> ``combine`` over the workers' records of the sync after it of ``field`` (``max``:
    the slowest worker's seconds)."""
    values: Dict[int, list] = {}
    for r in records:
        values.setdefault(r["step"], []).append(r[field])
    return {step: combine(v) for step, v in values.items()}


def close_records(path: str) -> List[dict]:
    """A run's records, once written: every rank ends the run's EDiT session
    (``unpatch_megatron_for_local_sgd``: each worker's first rank writes what it still holds, its
    worker's ranks' parts being there), then a barrier (another worker's writer is another
    process) before the file is read."""
    import megatron_edit

    megatron_edit.unpatch_megatron_for_local_sgd()
    dist.barrier()
    return read_records(path)
