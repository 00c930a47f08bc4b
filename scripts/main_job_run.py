"""One training run of the main job (``scripts/train_gpt_edit.py``), EDiT's or synchronous: what
the script's ``train`` loop keeps track of around Megatron's training step.

:class:`Run` holds the rank's place (its worker, the worker's ranks, its data) and EDiT's
controllers; it resumes from --load (or a torchft worker relaunched into a running job joins at
the others' step), records each step (its loss line and syncs, the byte count, the stop on a
value that is not finite, as Megatron-LM's --check-for-nan-in-loss-and-grad), validates and
saves when due, and ends the run: the last syncs, each worker's validation loss, and a resumed
run's verdict on what it repeated.
"""

from __future__ import annotations

import math
import time

import torch.distributed as dist

import main_job_checkpoint as ckpt
import megatron_edit
from main_job_flags import uses_torchft
from main_job_model import evaluate, gather_per_worker, gradient_shards, worker_group
from main_job_report import describe_edit, log0, log_syncs
from megatron_edit.arguments import end_with_error
from megatron_edit.config import ConfigError


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


class Run:
    """One run (EDiT or synchronous) on this rank: the model's parts, where the rank is, what was
    counted. :attr:`first`: the steps already done (a resume, or a torchft worker that joined a
    running job at the others' step)."""

    def __init__(self, args, use_local_sgd: bool, ddp, optimizer, scheduler):
        from megatron.core import parallel_state as ps

        self.args, self.use_local_sgd = args, use_local_sgd
        self.ddp, self.optimizer, self.scheduler = ddp, optimizer, scheduler
        self.name = "EDiT" if use_local_sgd else "synchronous"
        self.controllers = megatron_edit.get_local_sgd(optimizer)
        self.use_async = bool(self.controllers) and self.controllers[0].config.use_async
        if self.controllers:
            # The run's length (as Megatron-LM's --train-iters says it). EDiT: a sync at its last
            # step even off the warmup + k H grid, so the workers end with one model. A-EDiT: the
            # budget of the synchronous run of --steps (steps x workers worker-steps), ended at a
            # final sync planned from the workers' speeds, each worker at its own step count.
            megatron_edit.set_train_iters(optimizer, args.steps)
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.intra = worker_group()
        self.worker, self.lead = self.dp_rank // self.intra.size(), self.intra.rank() == 0
        self.first = 0  # steps already done: a torchft worker relaunched into a running job healed to the others' step
        self.resumed, self.one_model, self.history = None, None, {}
        self.sync_label = "sync"  # with torchft, each worker's job prints its own ("worker N sync")
        self.shard_numel, self.buckets = gradient_shards(args, ddp, self.intra)
        self.counts = dict(syncs=0, skipped=0, bytes=0)
        self.grad_bytes = 0
        self.valid = None
        # A fast A-EDiT worker takes more steps than --steps (a slow one fewer): at most all of them.
        self.last_step = args.steps * args.workers if self.use_async else args.steps

    def resume(self) -> None:
        """--load: the saved step (each worker's own state, or elastically: one outer step over
        the saved workers); with torchft, this job is one worker, and a worker relaunched into a
        running job goes on from the step it healed to."""
        args = self.args
        if self.use_local_sgd and args.load:
            self.resumed = ckpt.saved_record(args.load, args.ckpt_step)
            if self.resumed["processes"] != dist.get_world_size():
                raise ConfigError(f"--load {args.load} was saved by {self.resumed['processes']} processes, this job "
                                  f"has {dist.get_world_size()}: resume with --nproc-per-node "
                                  f"{self.resumed['processes']} (--workers may differ: an elastic resume).")
            ckpt.load(self.ddp, self.optimizer, self.scheduler, args)
            self.first = self.resumed["step"]
            self.one_model = len(set(ckpt.all_ranks(ckpt.model_digest(self.ddp)))) == 1  # every rank, after the load
        if self.use_local_sgd and uses_torchft(args):  # this job is one worker: its slice of every global batch
            self.worker = args.local_sgd_replica_id
            self.sync_label = f"worker {self.worker} sync"
            self.dp_rank, self.dp = self.worker * self.dp + self.dp_rank, args.workers * self.dp
            self.first = self.controllers[0].steps_done
            if self.first:
                # (its learning-rate schedule follows at its first step: patch sched-step-global-progress)
                print(f"          worker {self.worker} rank {dist.get_rank()} joined a running job: healed from a "
                      f"live worker to step {self.first}; it trains on from there", flush=True)

    def batches(self, dataset, step: int):
        """This rank's micro-batches from after ``step`` on: its slice of every global batch."""
        from megatron_edit.cpu import data

        mbs = self.args.micro_batch_size
        return data.batch_iterator(dataset, mbs, start=self.dp_rank + step * mbs * self.dp, stride=self.dp)

    def log_header(self) -> None:
        args = self.args
        log0(f"\n=== {self.name}: {args.steps} steps, {args.workers} workers x {self.intra.size()} shards, "
             f"{sum(p.numel() for p in self.ddp.parameters()):,} parameters on this rank, {self.buckets} buckets"
             f"{' (Megatron-FSDP)' if args.use_megatron_fsdp else ''} ===")
        if self.controllers:
            log0(describe_edit(self.controllers[0], args))
        if self.resumed is not None:
            log0(f"loaded step {self.first} of {args.load} ({self.resumed['workers']} workers saved, {args.workers} "
                 "now): " + ("each worker's own state" if self.resumed["workers"] == args.workers else
                             "one outer step over the saved workers, every worker from its result"))

    def finished(self) -> bool:
        """An A-EDiT worker past the final sync (its own step count)."""
        return self.use_async and self.controllers[0].finished

    def grads_are_local(self) -> bool:
        """This step's gradients stay in the worker (EDiT after its warmup)."""
        return bool(self.controllers) and self.controllers[0].grads_are_local

    def healed_ahead(self, step: int) -> bool:
        """A heal at this step's torchft sync (a worker behind: a partial heal before, a failed
        commit) put the worker at the others' step (``controllers[0].steps_done``): its loop and
        data go on from there. An A-EDiT worker's step count is its own: its loop ends at the
        final sync."""
        c = self.controllers
        if not (uses_torchft(self.args) and not self.use_async and c and c[0].steps_done > step):
            return False
        log0(f"          worker {self.worker} healed at its sync after step {step}: it is at the others' step "
             f"{c[0].steps_done} and trains on from there")
        return True

    def record_step(self, step: int, loss: float, grad_norm, local_grads: bool, t0: float) -> None:
        """After the step: its loss (a value that is not finite stops the job), the gradient bytes
        Megatron sent across workers, the step's line (every --log-interval steps and at a sync)
        and its syncs."""
        args = self.args
        self.history[step] = loss
        stop_if_not_finite(args, "training loss", loss, step, self.worker, self.lead, self.use_local_sgd)
        stop_if_not_finite(args, "gradient norm", grad_norm, step, self.worker, self.lead, self.use_local_sgd)
        if args.workers > 1 and not local_grads:
            self.grad_bytes += 4 * self.shard_numel  # Megatron all-reduces each gradient shard across workers
        ms = (time.perf_counter() - t0) * 1e3
        reports = [c.drain_reports() for c in self.controllers]
        if step % args.log_interval == 0 or any(reports):
            phase = "" if not self.controllers else ("  local" if local_grads else "  warmup (synchronous)")
            log0(f"step {step:4d} | worker {self.worker} loss {loss:.4f} | "
                 f"lr {self.scheduler.get_lr(self.optimizer.param_groups[0]):.2e} | {ms:6.1f} ms{phase}")
        log_syncs(reports, self.counts, self.sync_label)

    def validation_due(self, step: int) -> bool:
        return step % self.args.eval_interval == 0 or step == self.args.steps or self.finished()

    def validate(self, step: int, valid_ds) -> None:
        """This worker's validation loss (worker-local), printed by its first rank."""
        self.valid = evaluate(self.args, self.ddp, valid_ds)  # worker-local
        if self.lead:  # each worker's first rank: this worker's model
            print(f"          validation after step {step}: worker {self.worker} {self.valid:.4f}", flush=True)
        stop_if_not_finite(self.args, "validation loss", self.valid, step, self.worker, self.lead, self.use_local_sgd)
        # A layer-wise sync due after this step completed inside the evaluation.
        log_syncs([c.drain_reports() for c in self.controllers], self.counts, self.sync_label)

    def save_due(self, step: int) -> bool:
        args = self.args
        return bool(self.use_local_sgd and args.save
                    and (step == args.steps or (args.save_interval and step % args.save_interval == 0)))

    def save(self, step: int) -> None:
        ckpt.save(self.ddp, self.optimizer, self.scheduler, self.args, step, dist.get_world_size())
        log0(f"          saved step {step} to {self.args.save}")

    def finish(self, t_start: float) -> dict:
        """The run's end: no sync left open, each worker's last validation loss, the resume's
        verdict; what the summary shows (``seconds``: since ``t_start``)."""
        for c in self.controllers:
            c.flush()  # nothing should be pending after the last evaluation; never leave a sync open
        if self.args.use_megatron_fsdp:  # no parameter all-gather (a prefetch) left in flight inside the worker
            self.ddp.module.synchronize_param_gather()
        log_syncs([c.drain_reports() for c in self.controllers], self.counts, self.sync_label)
        elapsed = time.perf_counter() - t_start
        if self.use_local_sgd and uses_torchft(self.args):  # workers in jobs of their own: each reports its own
            final = {self.worker: self.valid}
            for c in self.controllers:
                c.backend.close()
        else:  # every worker is past its last sync here: the one collective across workers of the script
            final = gather_per_worker(self.valid)
        return dict(name=self.name, final=final, cross_bytes=self.counts["bytes"] + self.grad_bytes, seconds=elapsed,
                    syncs=self.counts["syncs"], skipped=self.counts["skipped"], last_line=self._checkpoint_losses())

    def _checkpoint_losses(self):
        """With --save or --load (after the last sync: every rank here): every worker's loss at
        every step, written by a saving run; a resumed run's last line (None without one)."""
        args = self.args
        if not (self.use_local_sgd and (args.save or args.load)):
            return None
        losses = {}
        for r, h in enumerate(ckpt.all_ranks(self.history if self.lead else None)):
            for s, v in (h or {}).items():
                losses.setdefault(s, {})[r // self.intra.size()] = v
        if args.save and dist.get_rank() == 0:
            ckpt.write_losses(args, losses)
        if self.resumed is not None:
            return ckpt.resume_line(args, self.resumed, losses, self.one_model)
        return None
