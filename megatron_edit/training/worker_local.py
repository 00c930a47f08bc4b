"""Nothing crosses EDiT workers between syncs in Megatron-LM's training loop.

Megatron-LM reduces figures for its log over every data-parallel rank (or every rank) at each
step: each such collective is a barrier across workers, and with A-EDiT a deadlock risk.
:class:`WorkerLocalCollectives` keeps them inside the worker; what cannot be is refused by
:mod:`megatron_edit.training.validation`.

This module is long because it holds one small wrapper per such reduction of Megatron-LM's
(the loss, the MoE metrics of 0.16 and 0.19, the timers, the data-parallel group getters), all
of one rule, with the patch table that declares them.
"""

from __future__ import annotations

import copy
import inspect
import sys
import threading
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Callable, List, Optional

from ..config import NotSupportedYet
from ..mcore import compat
from ..mcore.wrap_registry import Patch, PatchRegistry, VersionRange
from ..mcore.runtime import LocalSGDRuntime
from .meetings import ChecksAtMeetings, workers_meet

_TRAINING = "megatron.training.training"


_PS = "megatron.core.parallel_state"
_TIMERS = "megatron.core.timers"
_RERUN = "megatron.core.rerun_state_machine"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_MOE_LOGGING = "megatron.core.transformer.moe.moe_logging"
_SIGNALS = "megatron.training.dist_signal_handler"
_V19 = VersionRange("0.19.0", compat.TRAINING_SUPPORTED.below)


class WorkerLocalCollectives:
    """Megatron-LM's per-step collectives across data-parallel ranks, kept inside the EDiT worker.

    Between syncs EDiT workers share nothing, but Megatron-LM's training loop still reduces
    figures over every data-parallel rank, or every rank, each step or log interval. Each such
    collective is a barrier across workers: it holds every worker to the slowest one, and with
    A-EDiT (workers reach a given iteration at different times, and their k-th sync at different
    iterations) it can deadlock. While local SGD trains (its optimizer exists):

    * **Reporting regions.** Inside Megatron-LM's ``train_step`` (the logged training loss; the
      MTP loss tracker's and QK-clip's groups are taken there too), ``evaluate`` (validation
      loss) and ``calc_params_l2_norm`` (``--log-params-norm``), ``parallel_state.
      get_data_parallel_group`` hands out the worker's data-parallel group for the full one
      (with context parallelism; without it only when the context-parallel size is 1, where
      the two are the same ranks), and ``get_expert_data_parallel_group`` the worker's expert
      one (0.19's ``calc_params_l2_norm`` reduces over it too; without MoE it spans every
      data-parallel rank). Since 0.19 ``train_step`` and ``evaluate`` take the loss group from
      the model's ``pg_collection`` instead: there ``get_attr_wrapped_model(model,
      "pg_collection")`` returns a copy whose ``dp_cp`` groups are the worker's. Those
      functions use the groups only to average figures for the log: the figures become the
      worker's own. Gradients are untouched (DDP and the distributed optimizer keep the groups
      they were built with).
    * **Timers.** The barriers of Megatron's ``Timers`` (``--timing-log-level`` >= 1 with
      ``--barrier-with-L1-time``, Megatron's default; the interval timer at every log line) and
      the gather behind their console / TensorBoard report span the worker's ranks (its
      distributed-optimizer instance, TP/PP included) instead of the world: the min / max
      reported are over the logging rank's worker.
    * **Rerun state machine** (``--rerun-mode validate_results``, Megatron's default): its
      per-step vote on re-running the step is taken inside the worker once gradients are
      worker-local (after warmup; during warmup a re-run redoes the cross-worker gradient
      reduction, so every worker must vote). An outcome that would save a checkpoint and exit
      on one worker only (a checkpoint needs every worker) raises instead of hanging the job.
    * **Signal handler** (``--exit-signal-handler``): its check, an all-gather over the world,
      runs only after steps where the workers meet anyway (synchronous warmup steps and syncs);
      a signal is acted on at the next of them.

    * **MoE metrics** (0.16.x, ``track_moe_metrics`` in ``training_log``, every iteration): the
      tracked auxiliary losses are averaged over the worker's data-parallel ranks, not all of
      them (``reduce_aux_losses_tracker_across_ranks`` gets a process-group collection whose
      ``dp`` is the worker's): the logged MoE losses are the worker's, like the logged loss.

    * **MoE metrics** (0.19, ``MoEMetricsTracker.report`` in ``training_log``, every iteration):
      the tracker's data-parallel average (over the model's ``pg_collection.dp_cp_gtp_remat``,
      or every data-parallel rank without one) is taken over the worker's data-parallel ranks.

    * **Packed sequences** (0.18+): Megatron-LM all-reduces their sequence-length statistics
      over all ranks every iteration; refused at start-up (``--sft``,
      ``--dataloader-inter-document-masking``) and, for scripts that pass ``cu_seqlens``
      otherwise, at the first such iteration.

    What cannot be kept inside the worker is refused in :func:`validate_local_sgd_args`.
    """

    def __init__(self, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
        self.runtime_ref = runtime_ref
        self._local = threading.local()
        self._crossing = {}  # process group -> whether it spans workers

    # ------------------------------------------------------------ state
    def controllers(self) -> list:
        """The EDiT objects of the running optimizer; empty while local SGD is off or the
        optimizer is not built yet (start-up collectives stay as Megatron has them)."""
        runtime = self.runtime_ref()
        return list(runtime.controllers.values()) if runtime is not None else []

    @contextmanager
    def reporting(self, whole_model: bool = False):
        """A region whose data-parallel reductions only feed the log. ``whole_model``: a
        figure of the model itself (its norm), which the worker's ranks hold whole, warmup
        included (see :meth:`in_reporting`)."""
        depth = getattr(self._local, "depth", 0)
        outer = getattr(self._local, "whole_model", False)
        self._local.depth = depth + 1
        self._local.whole_model = outer or whole_model
        try:
            yield
        finally:
            self._local.depth = depth
            self._local.whole_model = outer

    def in_reporting(self) -> bool:
        """Inside a reporting region while gradients stay inside the worker. During the
        synchronous warmup the workers step together and their gradients cross them anyway:
        the regions keep Megatron's groups, whose figures are then everyone's (and
        ``--calculate-per-token-loss`` divides the gradients summed over every data-parallel
        rank by the tokens counted over the same ranks; after it, over the worker's). The
        model's norm (``--log-params-norm``) is the exception, taken over the worker always: in
        bf16 it sums the squares of the distributed optimizer's shards of the main parameters,
        which the worker's ranks hold whole (one instance per worker), so over every
        data-parallel rank it counted the model once per worker."""
        if getattr(self._local, "depth", 0) == 0:
            return False
        return getattr(self._local, "whole_model", False) or self.grads_are_local()

    def grads_are_local(self) -> bool:
        controllers = self.controllers()
        return bool(controllers) and all(c.grads_are_local for c in controllers)

    @staticmethod
    def worker_group():
        """All ranks of this worker: Megatron's intra distributed-optimizer instance group."""
        from megatron.core import parallel_state

        return parallel_state.get_intra_distributed_optimizer_instance_group(check_initialized=False)

    def _crosses_workers(self, group) -> bool:
        """Whether ``group`` (None: no group) holds ranks of another worker (decided once per
        group)."""
        if group is None:
            return False
        known = self._crossing.get(group)
        if known is None:
            from torch.distributed import get_process_group_ranks as ranks

            known = self._crossing[group] = not set(ranks(group)) <= set(ranks(self.worker_group()))
        return known

    # ------------------------------------------------------------ wrappers
    def wrap_reporting_region(self, original, whole_model: bool = False):
        def region(*args, **kwargs):
            if not self.controllers():
                return original(*args, **kwargs)
            with self.reporting(whole_model):
                return original(*args, **kwargs)

        return region

    def wrap_model_norm_region(self, original):
        return self.wrap_reporting_region(original, whole_model=True)

    def wrap_get_data_parallel_group(self, original):
        # Keywords only: the parameters after the first differ between releases (compat:
        # independent_all_gather in 0.16-0.17, with_gtp_remat second since 0.19).
        names = tuple(inspect.signature(original).parameters)

        def get_data_parallel_group(*args, **kwargs):
            kwargs.update(zip(names, args))
            if (
                self.in_reporting()
                and not kwargs.get("partial_data_parallel", False)
                and not kwargs.get("independent_all_gather", False)
                and (kwargs.get("with_context_parallel", False) or _context_parallel_size() == 1)
            ):
                kwargs.update(with_context_parallel=True, partial_data_parallel=True)
            return original(**kwargs)

        return get_data_parallel_group

    def wrap_get_expert_data_parallel_group(self, original):
        names = tuple(inspect.signature(original).parameters)

        def get_expert_data_parallel_group(*args, **kwargs):
            kwargs.update(zip(names, args))
            if self.in_reporting() and not kwargs.get("partial_expert_data_parallel", False):
                # Without MoE (refused with local SGD) the expert data-parallel group spans
                # every data-parallel rank; its partial group is the worker's.
                kwargs["partial_expert_data_parallel"] = True
            return original(**kwargs)

        return get_expert_data_parallel_group

    def wrap_get_attr_wrapped_model(self, original):
        def get_attr_wrapped_model(model, attr, *args, **kwargs):
            found = original(model, attr, *args, **kwargs)
            if attr != "pg_collection" or found is None or not self.in_reporting():
                return found
            # train_step / evaluate (0.19+) average the logged losses over the model's
            # process-group collection: a copy whose data-parallel groups are the worker's.
            # DDP and the optimizer keep the groups they were built with.
            from megatron.core import parallel_state

            worker = parallel_state.get_data_parallel_group(
                with_context_parallel=True, partial_data_parallel=True)
            local = copy.copy(found)
            for name in ("dp_cp", "dp_cp_gtp_remat"):
                if getattr(found, name, None) is not None:
                    setattr(local, name, worker)
            return local

        return get_attr_wrapped_model

    def wrap_consume_seqlen_stats(self, original):
        def consume_seqlen_stats_in_iteration():
            training = sys.modules.get(_TRAINING)
            if self.controllers() and getattr(training, "_seqlen_stats_active", False):
                raise NotSupportedYet(
                    "megatron_edit: this run trains on packed sequences (cu_seqlens: --sft, "
                    "--dataloader-inter-document-masking, or a script that passes them), for "
                    "which Megatron-LM all-reduces sequence-length statistics over all ranks "
                    "every iteration: a barrier across EDiT workers between syncs. Packed "
                    "sequences with --use-local-sgd are not supported yet."
                )
            return original()

        return consume_seqlen_stats_in_iteration

    def wrap_reduce_aux_losses(self, original):
        def reduce_aux_losses_tracker_across_ranks(track_names=None, pg_collection=None):
            if not self.controllers():
                return original(track_names, pg_collection=pg_collection)
            # MoE logging (track_moe_metrics, every iteration): the tracked losses are averaged
            # over the data-parallel group (without CP); give it the worker's part (with CP:
            # every entry averaged over it was first summed over a group holding CP, so the CP
            # ranks' values are equal and averaging them changes nothing). Entries reduced over
            # a group spanning data parallelism (global aux loss) are refused at start-up.
            from megatron.core import parallel_state

            worker = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            if pg_collection is None:
                local = SimpleNamespace(pp=parallel_state.get_pipeline_model_parallel_group(), dp=worker)
            else:
                local = copy.copy(pg_collection)
                local.dp = worker
            return original(track_names, pg_collection=local)

        return reduce_aux_losses_tracker_across_ranks

    def wrap_moe_sync_metrics(self, original):
        def _sync_metrics(tracker, metric_names, pg_collection=None):
            if not self.controllers():
                return original(tracker, metric_names, pg_collection)
            # 0.19: the MoE metrics (every iteration) are averaged over pg_collection's
            # dp_cp_gtp_remat, or every data-parallel rank without a collection; give it the
            # worker's (GTP remat is refused: the same ranks, CP included).
            from megatron.core import parallel_state

            worker = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
            if pg_collection is None:
                local = SimpleNamespace(pp=parallel_state.get_pipeline_model_parallel_group())
            else:
                local = copy.copy(pg_collection)
            local.dp_cp_gtp_remat = worker
            # An entry averaged over a group of its own that spans the workers (the router's
            # z-loss: tensor x data x context parallel) is averaged over the whole worker
            # instead: its values are equal across the pipeline stages after the first
            # reduction, so that is the worker's part of the entry's group.
            crossing = [entry for name in (metric_names or ()) for entry in [tracker._metrics.get(name)]
                        if entry is not None and self._crosses_workers(entry.avg_group)]
            saved = [entry.avg_group for entry in crossing]
            for entry in crossing:
                entry.avg_group = self.worker_group()
            try:
                return original(tracker, metric_names, local)
            finally:
                for entry, group in zip(crossing, saved):
                    entry.avg_group = group

        return _sync_metrics

    def wrap_timers_call(self, original):
        def __call__(timers, name, log_level=None):
            timer = original(timers, name, log_level)
            if hasattr(timer, "set_barrier_group"):  # a real Timer, not the DummyTimer
                # Megatron never sets a timer's barrier group itself (None: the world).
                timer.set_barrier_group(self.worker_group() if self.controllers() else None)
            return timer

        return __call__

    def wrap_timers_all_gather(self, original):
        import torch.distributed as dist

        def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
            worker = self.worker_group() if group is None and self.controllers() else None
            if worker is None or async_op:
                return original(output_tensor, input_tensor, group, async_op)
            # Timers gather one row per rank of the world (zeros except their own). Gather the
            # worker's rows only; the others stay zero, which Timers reads as "no timing".
            ranks = dist.get_process_group_ranks(worker)
            rows = output_tensor.view(dist.get_world_size(), -1)
            gathered = rows.new_zeros((len(ranks), rows.shape[1]))
            original(gathered.view(-1), input_tensor, worker, False)
            rows[ranks] = gathered
            return None

        return all_gather_into_tensor

    def _rerun_is_local(self, machine) -> bool:
        from megatron.core.rerun_state_machine import RerunState

        return self.grads_are_local() and machine.state in (
            RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE, RerunState.WILL_RERUN_FROM_CHECKPOINT
        )

    def wrap_rerun_reduce_any(self, original):
        import torch

        def _reduce_any(machine, value):
            if not self._rerun_is_local(machine):
                return original(machine, value)
            # The same vote as Megatron's (any rank True -> True), over the worker's ranks.
            values = value if isinstance(value, list) else [value]
            flags = torch.tensor(values, dtype=torch.int32, device=torch.cuda.current_device())
            torch.distributed.all_reduce(flags, group=self.worker_group())
            votes = tuple(int(x) > 0 for x in flags.tolist())
            return votes if isinstance(value, list) else votes[0]

        return _reduce_any

    def wrap_rerun_should_checkpoint_and_exit(self, original):
        def should_checkpoint_and_exit(machine):
            local = self._rerun_is_local(machine)
            should_checkpoint, should_exit, exit_code = original(machine)
            if local and (should_checkpoint or should_exit):
                raise RuntimeError(
                    f"megatron_edit: Megatron's rerun state machine asks this worker to "
                    f"{'save a checkpoint and ' if should_checkpoint else ''}stop (exit code "
                    f"{exit_code}) after re-running iteration {machine.current_iteration}. With "
                    "--use-local-sgd the re-run vote is taken inside the worker (a vote across "
                    f"workers would be a barrier every step), but "
                    f"{'a checkpoint and ' if should_checkpoint else ''}a clean exit need every "
                    "worker, so the job stops here instead; resume from the latest checkpoint. "
                    "The log above says what failed validation."
                )
            return should_checkpoint, should_exit, exit_code

        return should_checkpoint_and_exit

    def wrap_signals_received(self, original):
        def signals_received(handler):
            controllers = self.controllers()
            if controllers and not controllers[0].config.use_async and not workers_meet(controllers):
                return []  # checked (all ranks together) after the next warmup step or sync
            return original(handler)

        return signals_received


def _context_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def add_worker_local_patches(
    registry: PatchRegistry, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]
) -> List[str]:
    """Declare the :class:`WorkerLocalCollectives` patches; returns their ids. Applied on both
    routes: the fork in ``patches/`` does not make these calls itself."""
    wl = WorkerLocalCollectives(runtime_ref)
    v = compat.TRAINING_SUPPORTED
    installed = compat.megatron_core_version()

    def tracked(pid, target, wrap, description, versions=None):
        # Releases and signature from compat (TRAINING_SIGNATURES / SIGNATURES).
        versions = versions or compat.release_range(target)
        names = compat.params(target) if versions.contains(installed) else ()
        return Patch(pid, target, wrap, versions, names, description)

    patches = [
        tracked("worker-local-train-step", f"{_TRAINING}:train_step", wl.wrap_reporting_region,
                "the logged training loss is averaged over the worker, not all data-parallel ranks"),
        tracked("worker-local-evaluate", f"{_TRAINING}:evaluate",
                lambda original: wl.wrap_reporting_region(ChecksAtMeetings(runtime_ref).wrap_evaluate(original)),
                "the validation loss is averaged over the worker; --exit-duration-in-mins asked at syncs"),
        tracked("worker-local-params-norm", f"{_TRAINING}:calc_params_l2_norm",
                wl.wrap_model_norm_region,
                "--log-params-norm: the norm of the worker's model (warmup included)"),
        tracked("worker-local-dp-group", f"{_PS}:get_data_parallel_group",
                wl.wrap_get_data_parallel_group,
                "inside those three: the worker's data-parallel group for the full one", v),
        # 0.19: calc_params_l2_norm reduces over the expert data-parallel group too, and
        # train_step / evaluate take their groups from the model's pg_collection.
        tracked("worker-local-expert-dp-group", f"{_PS}:get_expert_data_parallel_group",
                wl.wrap_get_expert_data_parallel_group,
                "inside those three: the worker's expert data-parallel group for the full one",
                _V19),
        tracked("worker-local-pg-collection", f"{_TRAINING}:get_attr_wrapped_model",
                wl.wrap_get_attr_wrapped_model,
                "inside train_step / evaluate: the model's pg_collection with the worker's "
                "data-parallel groups (the logged losses)", _V19),
        Patch("worker-local-moe-metrics", f"{_MOE_UTILS}:reduce_aux_losses_tracker_across_ranks",
              wl.wrap_reduce_aux_losses, VersionRange("0.16.0", "0.17.0"), ("track_names", "pg_collection"),
              "MoE metrics logging (track_moe_metrics): averaged over the worker's data-parallel ranks"),
        Patch("worker-local-moe-metrics-tracker", f"{_MOE_LOGGING}:MoEMetricsTracker._sync_metrics",
              wl.wrap_moe_sync_metrics, _V19, ("self", "metric_names", "pg_collection"),
              "MoE metrics logging (MoEMetricsTracker.report): averaged over the worker's data-parallel ranks"),
        tracked("worker-local-seqlen-stats", f"{_TRAINING}:consume_seqlen_stats_in_iteration",
                wl.wrap_consume_seqlen_stats,
                "packed sequences (a world all-reduce per iteration) refused with local SGD"),
        Patch("worker-local-timer-barrier", f"{_TIMERS}:Timers.__call__", wl.wrap_timers_call, v,
              ("self", "name", "log_level"), "timer barriers span the worker, not the world"),
        Patch("worker-local-timers-gather", f"{_TIMERS}:dist_all_gather_func",
              wl.wrap_timers_all_gather, v,
              ("output_tensor", "input_tensor", "group", "async_op"),
              "timer reports gather the worker's timings, not the world's"),
        Patch("worker-local-rerun-vote", f"{_RERUN}:RerunStateMachine._reduce_any",
              wl.wrap_rerun_reduce_any, v, ("self", "value"),
              "after warmup, the per-step re-run vote is taken inside the worker"),
        Patch("worker-local-rerun-exit", f"{_RERUN}:RerunStateMachine.should_checkpoint_and_exit",
              wl.wrap_rerun_should_checkpoint_and_exit, v, ("self",),
              "a worker-local re-run verdict that needs a checkpoint raises instead of hanging"),
        Patch("worker-local-signal-check", f"{_SIGNALS}:DistributedSignalHandler.signals_received",
              wl.wrap_signals_received, v, ("self",),
              "--exit-signal-handler: checked after warmup steps and syncs only"),
    ]
    for patch in patches:
        registry.add(patch)
    return [p.id for p in patches]
