"""How EDiT attaches to megatron-core: the runtime state and the declared wrap patches.

Every patch wraps a Megatron function and calls the original; while local SGD is not
configured (``--use-local-sgd`` absent), each wrapper passes straight through.

=====================================  =====================================================
patch                                  why
=====================================  =====================================================
ddp-init                               register each DDP's bucket groups; reject options
                                       that cannot work with an outer sync
distopt-init                           build the EDiT state (:class:`LocalSGD`) of each
                                       distributed optimizer
bucket-start-grad-sync                 after warmup, reduce gradients inside the worker only,
bucket-finish-grad-sync                averaged over the worker (not over all of DP)
bucket-start-param-sync                layer-wise sync: apply a bucket group's pending outer
                                       step just before its all-gather in the forward pass
distopt-step-with-ready-grads          the schedule: anchor at the end of warmup, step count,
                                       sync due
distopt-copy-main-to-model             step-end sync: between the inner update and the copy
                                       of main params into the model
distopt-grad-stats-group               gradient norm and zero count reduced inside the worker
                                       (megatron-core 0.12.x reduces them over all ranks)
=====================================  =====================================================

Checkpoint patches (EDiT state in torch_dist checkpoints, 0.16.1 load fixes) are declared in
:mod:`megatron_edit.checkpointing`; Megatron-LM training patches in
:mod:`megatron_edit.training_patches`.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from contextlib import contextmanager
from typing import Callable, List, Optional

import torch

from . import compat
from .config import ConfigError, GTAConfig, LocalSGDConfig, NotSupportedYet, OuterOptimizerConfig
from .local_sgd import LocalSGD
from .patching import Patch, PatchRegistry, VersionRange

logger = logging.getLogger(__name__)

SUPPORTED = compat.SUPPORTED

_DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
_BUCKET_GROUP = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"


def check_megatron_options(local_cfg: LocalSGDConfig, transformer_config, ddp_config) -> None:
    """Reject model / DDP options that cannot work with EDiT (clear message, at start-up)."""
    if not ddp_config.use_distributed_optimizer:
        raise ConfigError(
            "--use-local-sgd needs Megatron's distributed optimizer: pass "
            "--use-distributed-optimizer (DistributedDataParallelConfig.use_distributed_optimizer"
            "=True). Each worker is one distributed-optimizer instance: set "
            "--num-distributed-optimizer-instances to the number of workers (the data-parallel "
            "size gives one rank per worker, shard size 1)."
        )
    if compat.uses_megatron_fsdp(ddp_config):
        raise ConfigError("--use-local-sgd does not work with Megatron-FSDP (--use-megatron-fsdp).")
    if compat.uses_cuda_graphs(transformer_config):
        raise ConfigError(
            "--use-local-sgd does not work with CUDA graphs (--cuda-graph-impl / "
            "--enable-cuda-graph): a captured step cannot run the outer sync."
        )
    if getattr(transformer_config, "calculate_per_token_loss", False):
        raise NotSupportedYet(
            "--calculate-per-token-loss with --use-local-sgd is not supported yet: it all-reduces "
            "token counts across every data-parallel rank each step."
        )
    if local_cfg.sync_mode == "layerwise" and not ddp_config.overlap_param_gather:
        raise ConfigError(
            "--local-sgd-sync-mode layerwise syncs each bucket just before its parameters are "
            "gathered in the forward pass, which needs --overlap-param-gather (and "
            "--overlap-grad-reduce); pass them, or use --local-sgd-sync-mode step_end."
        )


def check_workers(data_parallel_size: int, num_workers: int) -> None:
    """The workers (distributed-optimizer instances) must split data parallelism evenly."""
    if num_workers < 1 or data_parallel_size % num_workers != 0:
        raise ConfigError(
            f"--num-distributed-optimizer-instances={num_workers} (the number of EDiT workers) "
            f"must divide the data-parallel size {data_parallel_size}."
        )


def check_optimizer_options(config, has_grad_scaler: bool) -> None:
    """Reject optimizer options (megatron.core OptimizerConfig) that cannot work with EDiT."""
    if getattr(config, "use_precision_aware_optimizer", False):
        raise ConfigError(
            "--use-local-sgd does not work with --use-precision-aware-optimizer: that optimizer "
            "keeps main params inside itself and skips the main->model copy the sync relies on."
        )
    if getattr(config, "overlap_param_gather_with_optimizer_step", False):
        raise ConfigError(
            "--use-local-sgd does not work with --overlap-param-gather-with-optimizer-step: the "
            "all-gather would start before the outer step has run."
        )
    if getattr(config, "optimizer_cpu_offload", False):
        raise NotSupportedYet("--optimizer-cpu-offload with --use-local-sgd is not supported yet.")
    if has_grad_scaler:
        raise NotSupportedYet(
            "fp16 with loss scaling and --use-local-sgd is not supported yet: a skipped step on "
            "one worker would desynchronise the workers' schedules; use --bf16."
        )


class LocalSGDRuntime:
    """The live state behind the patches: configs and the EDiT objects of each optimizer."""

    def __init__(
        self,
        local_sgd_config: Optional[LocalSGDConfig] = None,
        outer_optim_config: Optional[OuterOptimizerConfig] = None,
        gta_config: Optional[GTAConfig] = None,
        configs_from: Optional[Callable[[], Optional[tuple]]] = None,
    ):
        """Either the configs, or ``configs_from``: a callable returning them (or None when
        local SGD is off), called once when Megatron builds the first DDP (Megatron-LM parses
        its arguments before that)."""
        self._configs = None
        if local_sgd_config is not None:
            self._configs = (
                local_sgd_config,
                outer_optim_config or OuterOptimizerConfig(),
                gta_config or GTAConfig(),
            )
        self._configs_from = configs_from
        self._resolved = self._configs is not None
        self.final_step: Optional[int] = None  # the run's last step, when known (A-EDiT)
        self.controllers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.group_owner: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.registered_groups: "weakref.WeakSet" = weakref.WeakSet()
        self._local_ddp_configs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._reducing_locally: "weakref.WeakSet" = weakref.WeakSet()
        # optimizer -> all ranks of its worker, where gradient statistics are reduced
        self.grad_stats_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    @property
    def configs(self) -> Optional[tuple]:
        if not self._resolved:
            self._configs = self._configs_from() if self._configs_from else None
            self._resolved = True
        return self._configs

    # --- called from the wrappers -------------------------------------------------------
    def on_ddp_init(self, ddp) -> None:
        if self.configs is None:
            return
        check_megatron_options(self.configs[0], ddp.config, ddp.ddp_config)
        if ddp.expert_parallel_bucket_groups:
            raise NotSupportedYet("--use-local-sgd with MoE expert parameters is not supported yet.")
        check_workers(
            compat.data_parallel_group(ddp).size(), ddp.ddp_config.num_distributed_optimizer_instances
        )
        for group in ddp.bucket_groups:
            self.registered_groups.add(group)

    def on_optimizer_init(self, optimizer) -> None:
        if self.configs is None:
            return
        check_optimizer_options(optimizer.config, getattr(optimizer, "grad_scaler", None) is not None)
        controller = LocalSGD(optimizer, *self.configs)
        controller.final_step = self.final_step
        self.controllers[optimizer] = controller
        # A collective on megatron-core 0.12.x (builds the group): every rank builds optimizers.
        worker = compat.instance_group(controller.sync_group.group)
        if worker is not None:
            self.grad_stats_groups[optimizer] = worker
        for group in controller.group_shards:
            self.group_owner[group] = controller
        if torch.distributed.get_rank() == 0:
            logger.info(
                "megatron_edit: EDiT on a distributed optimizer with %d buckets, %d workers, "
                "sync every %d steps after %d warmup steps (%s)",
                len(controller.shards),
                controller.num_workers,
                controller.config.local_sgd_sync_interval,
                controller.config.local_sgd_warmup_steps,
                controller.config.sync_mode,
            )

    def controller_for_group(self, bucket_group) -> Optional[LocalSGD]:
        controller = self.group_owner.get(bucket_group)
        if controller is None and bucket_group in self.registered_groups:
            raise RuntimeError(
                "megatron_edit: this model was wrapped in DDP with --use-local-sgd, but no "
                "Megatron DistributedOptimizer was built over it (get_megatron_optimizer with "
                "use_distributed_optimizer=True); EDiT cannot run and will not silently fall "
                "back to synchronous training."
            )
        return controller

    @contextmanager
    def worker_local_reduction(self, bucket_group, controller: LocalSGD):
        """Run one bucket group's gradient reduction inside the worker only.

        Megatron reduce-scatters over the worker, then all-reduces the shard across workers when
        ``num_distributed_optimizer_instances > 1``. Seen through a copy of the DDP config with
        one instance, the same code does only the first part; the pre-scaling of gradients
        (1/DP size unless averaged in the collective) is raised to 1/worker size to match.
        """
        if bucket_group in self._reducing_locally:
            # finish_grad_sync calls start_grad_sync itself (first batch, or no overlap): the
            # outer call already switched this group; scaling twice would double the gradients.
            yield
            return
        ddp_config = bucket_group.ddp_config
        local_config = self._local_ddp_configs.get(bucket_group)
        if local_config is None:
            local_config = dataclasses.replace(ddp_config, num_distributed_optimizer_instances=1)
            self._local_ddp_configs[bucket_group] = local_config
        factors = [b.gradient_scaling_factor for b in bucket_group.buckets]
        if not ddp_config.average_in_collective:
            for bucket in bucket_group.buckets:
                bucket.gradient_scaling_factor = bucket.gradient_scaling_factor * controller.num_workers
        bucket_group.ddp_config = local_config
        self._reducing_locally.add(bucket_group)
        try:
            yield
        finally:
            self._reducing_locally.discard(bucket_group)
            bucket_group.ddp_config = ddp_config
            for bucket, factor in zip(bucket_group.buckets, factors):
                bucket.gradient_scaling_factor = factor


def _grad_sync_wrap(runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
    def wrap(original):
        def wrapper(self, *args, **kwargs):
            runtime = runtime_ref()
            controller = runtime.controller_for_group(self) if runtime else None
            if controller is None or not controller.grads_are_local:
                return original(self, *args, **kwargs)
            with runtime.worker_local_reduction(self, controller):
                return original(self, *args, **kwargs)

        return wrapper

    return wrap


def build_registry(runtime_ref: Callable[[], Optional[LocalSGDRuntime]]) -> PatchRegistry:
    """The patches, bound to whatever runtime ``runtime_ref()`` returns when they run."""
    registry = PatchRegistry()

    def wrap_ddp_init(original):
        def wrapper(self, *args, **kwargs):
            original(self, *args, **kwargs)
            runtime = runtime_ref()
            if runtime:
                runtime.on_ddp_init(self)

        return wrapper

    def wrap_optimizer_init(original):
        def wrapper(self, *args, **kwargs):
            original(self, *args, **kwargs)
            runtime = runtime_ref()
            if runtime:
                runtime.on_optimizer_init(self)

        return wrapper

    def wrap_start_param_sync(original):
        def wrapper(self, *args, **kwargs):
            runtime = runtime_ref()
            controller = runtime.group_owner.get(self) if runtime else None
            if controller is not None:
                controller.before_param_gather(self)
            return original(self, *args, **kwargs)

        return wrapper

    def wrap_step_with_ready_grads(original):
        def wrapper(self, *args, **kwargs):
            runtime = runtime_ref()
            controller = runtime.controllers.get(self) if runtime else None
            if controller is None:
                return original(self, *args, **kwargs)
            controller.begin_step()
            ok = original(self, *args, **kwargs)
            controller.end_step()
            return ok

        return wrapper

    def wrap_copy_main_to_model(original):
        def wrapper(self, *args, **kwargs):
            runtime = runtime_ref()
            controller = runtime.controllers.get(self) if runtime else None
            if controller is not None:
                controller.after_inner_update()
            return original(self, *args, **kwargs)

        return wrapper

    def wrap_grad_stats_group(original):
        def wrapper(self, *args, **kwargs):
            group = original(self, *args, **kwargs)
            runtime = runtime_ref()
            worker = runtime.grad_stats_groups.get(self) if runtime else None
            # None means all ranks (megatron-core 0.12.x always; later releases when the
            # optimizer was not built by get_megatron_optimizer): that would cross workers.
            return worker if group is None and worker is not None else group

        return wrapper

    v = SUPPORTED

    def add(pid, target, wrap, description):
        # The parameters each target has on the installed release: megatron_edit.compat.
        registry.add(Patch(pid, target, wrap, v, compat.params(target), description))

    add("ddp-init", f"{_DDP}.__init__", wrap_ddp_init,
        "register DDP bucket groups; reject options incompatible with an outer sync")
    add("distopt-init", f"{_DISTOPT}.__init__", wrap_optimizer_init,
        "build the sharded EDiT state (anchor, outer optimizer) of each optimizer")
    add("bucket-start-grad-sync", f"{_BUCKET_GROUP}.start_grad_sync", _grad_sync_wrap(runtime_ref),
        "after warmup: reduce-scatter inside the worker only, averaged over it")
    add("bucket-finish-grad-sync", f"{_BUCKET_GROUP}.finish_grad_sync", _grad_sync_wrap(runtime_ref),
        "after warmup: wait for the worker-local reduction")
    add("bucket-start-param-sync", f"{_BUCKET_GROUP}.start_param_sync", wrap_start_param_sync,
        "layer-wise sync: outer step of a bucket group just before its all-gather")
    add("distopt-step-with-ready-grads", f"{_DISTOPT}.step_with_ready_grads", wrap_step_with_ready_grads,
        "schedule: anchor after warmup, count steps, start a due sync")
    add("distopt-copy-main-to-model", f"{_DISTOPT}._copy_main_params_to_model_params", wrap_copy_main_to_model,
        "step-end sync between the inner update and the main->model copy")
    add("distopt-grad-stats-group", f"{_DISTOPT}.get_grad_stats_parallel_group", wrap_grad_stats_group,
        "gradient norm / zero count inside the worker, never across workers (0.12.x: all ranks)")
    return registry


def get_local_sgd(optimizer, runtime: Optional[LocalSGDRuntime]) -> List[LocalSGD]:
    """The EDiT objects behind a Megatron optimizer (a ChainedOptimizer holds several)."""
    if runtime is None:
        return []
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    return [runtime.controllers[o] for o in optimizers if o in runtime.controllers]
