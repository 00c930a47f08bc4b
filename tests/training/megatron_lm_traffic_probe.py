"""Run by tests/test_megatron_lm_collectives.py on every rank: megatron_edit's launcher, with
every ``torch.distributed`` collective recorded.

Usage (under torchrun)::

    python tests/training/megatron_lm_traffic_probe.py <out dir> <launcher args: --cpu pretrain_gpt.py ...>

Wraps the collectives of ``torch.distributed`` *before* Megatron is imported, so the names
Megatron binds at import (``dist_all_gather_func`` in ``megatron.core.timers`` and in the
bucket code) are the recording wrappers too. Each call made outside another recorded call
(``all_gather_object`` calls ``all_gather`` itself) is recorded with: the training iteration it
belongs to (Megatron's 1-based number as logged: ``args.curr_iteration + 1`` inside the training
loop, None before it), the ranks of its group (world when None; for point-to-point ops this rank
and its peer) and the Megatron / megatron_edit / script frames of its stack, innermost last
(``training/training.py:train_step:2547``, ``megatron_edit/exchange/groups.py:all_reduce_sum:65``).
``MEGATRON_EDIT_PROBE_SLOW=2,3:0.3`` makes ranks 2 and 3 sleep 0.3 s per optimizer step;
``MEGATRON_EDIT_PROBE_CLOCK_JUMP=3:120`` moves the wall clock 120 s ahead after iteration 3;
``MEGATRON_EDIT_PROBE_NO_WORKER_LOCAL=1`` leaves out the ``worker-local-*`` patches (Megatron's
collectives as they are, for comparison).
At exit each rank writes ``rank<r>.json`` with the records and the ranks of its EDiT worker
(Megatron's intra distributed-optimizer instance group: all ranks of one instance, TP/PP
included), so a test can tell which collectives cross workers. Test-only: nothing here ships.
"""

import atexit
import faulthandler
import functools
import inspect
import json
import os
import signal
import sys
import threading
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "gather", "scatter",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "barrier", "monitored_barrier",
)
P2P = ("send", "recv", "isend", "irecv")
_KEEP = ("/megatron/", "pretrain_gpt.py", "/megatron_edit/")


class Recorder:
    def __init__(self, stream_dir=None):
        self.records = []
        self.stream_dir = stream_dir
        self._stream = None
        self._local = threading.local()
        self._saved = []

    @property
    def stream(self):
        if self._stream is None and self.stream_dir is not None and dist.is_initialized():
            self._stream = open(os.path.join(self.stream_dir, f"rank{dist.get_rank()}.jsonl"), "w")
        return self._stream

    # ---------------------------------------------------------------- what a call is
    @staticmethod
    def _iteration():
        globals_ = sys.modules.get("megatron.training.global_vars")
        args = getattr(globals_, "_GLOBAL_ARGS", None) if globals_ else None
        current = getattr(args, "curr_iteration", None) if args is not None else None
        return None if current is None else current + 1

    @staticmethod
    def _stack():
        frames = []
        for info in inspect.stack(context=0)[3:]:
            path = info.filename.replace(os.sep, "/")
            if any(k in path for k in _KEEP):
                if "/megatron_edit/" in path:  # e.g. megatron_edit/exchange/groups.py
                    short = "megatron_edit/" + path.rsplit("/megatron_edit/", 1)[-1]
                elif "/megatron/" in path:
                    short = path.rsplit("/megatron/", 1)[-1]
                else:
                    short = path.rsplit("/", 1)[-1]
                frames.append(f"{short}:{info.function}:{info.lineno}")
        return frames[::-1]  # outermost first

    @staticmethod
    def _ranks(group):
        if group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(group))

    def _record(self, op, ranks, numel):
        record = {"op": op, "ranks": ranks, "numel": numel, "iteration": self._iteration(),
                  "time": time.time(), "stack": self._stack()}
        self.records.append(record)
        if self.stream is not None:  # as it happens: a hung run still leaves its records
            self.stream.write(json.dumps(record) + "\n")
            self.stream.flush()

    # ---------------------------------------------------------------- wrapping
    def _wrap(self, name, p2p=False):
        original = getattr(c10d, name)
        signature = inspect.signature(original)
        recorder = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            depth = getattr(recorder._local, "depth", 0)
            if depth == 0 and dist.is_initialized():
                try:
                    bound = signature.bind(*args, **kwargs)
                    group = bound.arguments.get("group")
                    if p2p:
                        peer = bound.arguments.get("dst", bound.arguments.get("src"))
                        if peer is None:
                            peer = bound.arguments.get("group_dst", bound.arguments.get("group_src"))
                        ranks = sorted({dist.get_rank(), int(peer)})
                    else:
                        ranks = recorder._ranks(group)
                    first = next(iter(bound.arguments.values()), None)
                    numel = first.numel() if hasattr(first, "numel") else -1
                    recorder._record(name, ranks, numel)
                except Exception as e:  # noqa: BLE001 - never break the run being observed
                    recorder._record(name, [], -2)
                    recorder.records[-1]["error"] = repr(e)
            recorder._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                recorder._local.depth = depth

        for owner in (c10d, dist):
            if getattr(owner, name, None) is original:
                self._saved.append((owner, name, original))
                setattr(owner, name, wrapper)

    def _wrap_batch_p2p(self):
        original = c10d.batch_isend_irecv
        recorder = self

        @functools.wraps(original)
        def wrapper(p2p_op_list):
            if getattr(recorder._local, "depth", 0) == 0 and dist.is_initialized():
                for p2p_op in p2p_op_list:
                    recorder._record("batch_isend_irecv", sorted({dist.get_rank(), int(p2p_op.peer)}),
                                     p2p_op.tensor.numel())
            recorder._local.depth = getattr(recorder._local, "depth", 0) + 1
            try:
                return original(p2p_op_list)
            finally:
                recorder._local.depth -= 1

        for owner in (c10d, dist):
            if getattr(owner, "batch_isend_irecv", None) is original:
                setattr(owner, "batch_isend_irecv", wrapper)

    def install(self):
        for name in COLLECTIVES:
            if hasattr(c10d, name):  # all_gather_single: newer torch (the quantized exchange's)
                self._wrap(name)
        for name in P2P:
            self._wrap(name, p2p=True)
        self._wrap_batch_p2p()

    # ---------------------------------------------------------------- results
    def dump(self, out_dir):
        if not dist.is_initialized():
            return
        worker = None
        try:
            from megatron.core import parallel_state

            group = parallel_state.get_intra_distributed_optimizer_instance_group(check_initialized=False)
            if group is not None:
                worker = sorted(dist.get_process_group_ranks(group))
        except Exception:  # noqa: BLE001
            pass
        path = os.path.join(out_dir, f"rank{dist.get_rank()}.json")
        with open(path, "w") as f:
            json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(),
                       "worker_ranks": worker, "records": self.records}, f)


def slow_down(spec):
    """``"2,3:0.3"``: the listed ranks sleep 0.3 s in every optimizer step (a straggling worker).
    Megatron on CPU steps with torch's AdamW (no apex)."""
    import torch

    ranks, seconds = spec.split(":")
    if os.environ.get("RANK") not in ranks.split(","):
        return
    original = torch.optim.AdamW.step

    @functools.wraps(original)
    def step(self, *args, **kwargs):
        time.sleep(float(seconds))
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step


def clock_jump(spec):
    """``"3:120"``: ``time.time()`` jumps 120 s ahead once Megatron's training loop is past
    iteration 3 (on every rank at its own iteration 3; ``"3:120:1"``: on rank 1 only): a time
    limit such as ``--exit-duration-in-mins 1`` is then up from a known iteration on, whatever
    the machine's speed. Only the wall clock moves (A-EDiT's schedule reads the monotonic clock)."""
    after, seconds, *ranks = spec.split(":")
    if ranks and os.environ.get("RANK") not in ranks[0].split(","):
        return
    after, seconds = float(after), float(seconds)
    real = time.time

    def jumped():
        return real() + (seconds if (Recorder._iteration() or 0) > after else 0.0)

    time.time = jumped


def main():
    out_dir, launcher_args = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    recorder = Recorder(stream_dir=out_dir)
    recorder.install()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: where it hangs
    if os.environ.get("MEGATRON_EDIT_PROBE_CLOCK_JUMP"):
        clock_jump(os.environ["MEGATRON_EDIT_PROBE_CLOCK_JUMP"])
    if os.environ.get("MEGATRON_EDIT_PROBE_SLOW"):
        slow_down(os.environ["MEGATRON_EDIT_PROBE_SLOW"])
    if os.environ.get("MEGATRON_EDIT_PROBE_NO_WORKER_LOCAL") == "1":
        from megatron_edit.training import training_wraps

        training_wraps.add_worker_local_patches = lambda registry, runtime_ref: []  # "before"
    atexit.register(recorder.dump, out_dir)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    from megatron_edit import launch

    launch.main(launcher_args)


if __name__ == "__main__":
    main()
