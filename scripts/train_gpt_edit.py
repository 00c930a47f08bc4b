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

import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository: megatron_edit
if HERE not in sys.path:  # the main job's modules beside this script (loaded by path, as the tests do)
    sys.path.insert(1, HERE)
# megatron-core warns at import that transformer-engine/apex are absent and it uses torch's
# implementations; expected on CPU, so keep the demo's output readable.
warnings.filterwarnings("ignore", module=r"megatron\.")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

# The flags and the launcher: light, neither imports torch nor Megatron.
from main_job_flags import (  # noqa: E402
    apply_outer_defaults, build_parser, check_args, check_launch, under_torchrun, uses_torchft,
)
from main_job_launch import USER_STOP, end_rank, launch  # noqa: E402
from megatron_edit.launch import quiet_upstream_warnings  # noqa: E402

# Started with python: check the flags and start the ranks, before torch is imported.
if __name__ == "__main__" and not under_torchrun():
    raise SystemExit(launch(build_parser(__doc__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from main_job_model import build, build_datasets, forward_step, worker_mean  # noqa: E402
from main_job_report import log0, setup_logging, summary  # noqa: E402
from main_job_run import Run  # noqa: E402


def main(argv=None):
    """One rank of the job (started by torchrun or by :func:`launch`); without torchrun's
    environment, :func:`launch` starts the ranks."""
    parser = build_parser(__doc__)
    if not under_torchrun():
        raise SystemExit(launch(parser, argv))
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


def run_rank(args, world: int) -> None:
    """The rank's work once the process group exists: data, the runs, the summary."""
    for stream in (sys.stdout, sys.stderr):
        # Whole lines, one write each, even under python -u (torchrun starts ranks so): a rank
        # stopped between print's text and its newline glued the next rank's line to it.
        stream.reconfigure(line_buffering=True, write_through=False)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=1 if uses_torchft(args) else args.workers,
                                 expert_model_parallel_size=args.expert_model_parallel_size)
    if args.workers == 1 and args.mode != "baseline":
        log0("note: --workers 1 is one EDiT worker: synchronous training plus an outer optimizer "
             "step every H steps; nothing is saved. Use --workers 2 or more to train locally.")
    datasets = build_datasets(args, world)

    results = []
    if args.mode in ("edit", "both"):
        args.use_local_sgd = True
        results.append(train(args, True, datasets))
    if args.mode in ("baseline", "both"):
        args.use_local_sgd = False
        results.append(train(args, False, datasets))
    summary(results)
    for r in results:
        if r["last_line"]:
            log0(r["last_line"])
    dist.destroy_process_group()
    if any((r["last_line"] or "").endswith(": NO") for r in results):
        raise SystemExit(1)  # a resume that did not match what was saved is not a success


def train(args, use_local_sgd: bool, datasets) -> dict:
    """One run of --steps steps, EDiT's or synchronous training's, on this rank: Megatron's
    training step, with :class:`main_job_run.Run` keeping track around it; what the summary shows."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    train_ds, valid_ds = datasets
    ddp, optimizer, scheduler = build(args, use_local_sgd)
    run = Run(args, use_local_sgd, ddp, optimizer, scheduler)  # the rank's place, EDiT's controllers
    run.resume()  # --load DIR, or a torchft worker relaunched into a running job: on from its step
    batches = run.batches(train_ds, run.first)
    run.log_header()
    t_start = time.perf_counter()
    step = run.first
    while step < run.last_step:
        step += 1
        if run.finished():  # A-EDiT: this worker is past the final sync
            break
        USER_STOP.step = step
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        local_grads = run.grads_are_local()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([next(batches)]), model=[ddp], num_microbatches=1,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False,
        )
        if args.compute_sleep_ms:  # (benchmarks) the device compute this machine has no device for
            time.sleep(args.compute_sleep_ms / 1e3)
        _, grad_norm, _ = optimizer.step()
        scheduler.step(1)
        if run.healed_ahead(step):  # torchft: a heal at this step's sync put it at the others' step
            step = run.controllers[0].steps_done
            batches = run.batches(train_ds, step)
        loss = worker_mean(out[0]["lm loss"].item(), run.intra)  # inside the worker only
        run.record_step(step, loss, grad_norm, local_grads, t0)  # its line and syncs; not finite: stop
        if run.validation_due(step):
            run.validate(step, valid_ds)  # worker-local
        if run.save_due(step):
            run.save(step)
    if run.finished() and run.valid is None:  # A-EDiT over torchft: a relaunch healed at the final sync
        run.validate(run.controllers[0].steps_done, valid_ds)  # (it trained no step: its loop ended at once)
    return run.finish(t_start)


if __name__ == "__main__":
    main()
