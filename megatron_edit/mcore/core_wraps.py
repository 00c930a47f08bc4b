"""How EDiT attaches to megatron-core: the megatron-core wraps (registry patches of DDP, the bucket
groups and the distributed optimizer; the engine is :mod:`megatron_edit.mcore.wrap_registry`).

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
distopt-skipped-step,                  fp16 / loss scaling: a step skipped on an inf or nan
chained-skipped-step                   still counts and syncs when due (:mod:`.skipped_step`)
sched-step-global-progress             A-EDiT: the learning-rate schedule follows the workers'
                                       global progress, not this worker's step count;
                                       torchft: it follows a heal to the peer's progress
moe-expert-bias-counts                 MoE expert bias: the routers' token counts all-reduced
moe-expert-bias-group                  inside the worker between syncs (0.12-0.17: through
                                       the group getter, inside the update only)
=====================================  =====================================================

Megatron-FSDP's own attachment points (its gradient reduce and parameter gather) are declared
in :mod:`megatron_edit.mcore.fsdp_wraps` and added here; the expert-bias patches in
:mod:`megatron_edit.mcore.expert_bias` (which also averages the biases at each sync).

The wrappers consult :class:`~megatron_edit.mcore.runtime.LocalSGDRuntime`. Checkpoint patches
(EDiT state in torch_dist checkpoints, megatron-core's load fixes) are declared in
:mod:`megatron_edit.mcore.checkpoint`; Megatron-LM training patches in
:mod:`megatron_edit.training.training_wraps`.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

from . import compat
from .expert_bias import add_expert_bias_patches
from .fsdp_wraps import add_fsdp_patches
from .skipped_step import add_skipped_step_patches
from .wrap_registry import Patch, PatchRegistry
from .runtime import LocalSGDRuntime, get_local_sgd

SUPPORTED = compat.SUPPORTED

_DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
_BUCKET_GROUP = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"


# Each wrap below is ``wrap(runtime_ref, original)``: build_registry binds the runtime.
def _wrap_grad_sync(runtime_ref: Callable[[], Optional[LocalSGDRuntime]], original):
    def wrapper(self, *args, **kwargs):
        runtime = runtime_ref()
        controller = runtime.controller_for_group(self) if runtime else None
        if controller is None or not controller.grads_are_local:
            return original(self, *args, **kwargs)
        with runtime.worker_local_reduction(self, controller):
            return original(self, *args, **kwargs)

    return wrapper


def _after_init(hook: str):
    """A wrap of a constructor that then tells the runtime (its method ``hook``)."""

    def wrap(runtime_ref, original):
        def wrapper(self, *args, **kwargs):
            original(self, *args, **kwargs)
            runtime = runtime_ref()
            if runtime:
                getattr(runtime, hook)(self)

        return wrapper

    return wrap


_wrap_ddp_init = _after_init("on_ddp_init")
_wrap_optimizer_init = _after_init("on_optimizer_init")


def _wrap_start_param_sync(runtime_ref, original):
    def wrapper(self, *args, **kwargs):
        runtime = runtime_ref()
        controller = runtime.group_owner.get(self) if runtime else None
        if controller is not None:
            controller.before_param_gather(self)
        return original(self, *args, **kwargs)

    return wrapper


def _wrap_step_with_ready_grads(runtime_ref, original):
    def wrapper(self, *args, **kwargs):
        runtime = runtime_ref()
        controller = runtime.controllers.get(self) if runtime else None
        if controller is None:
            if runtime is not None and runtime.configs is not None:
                runtime.refuse_unattached(self)  # built before the patch: EDiT would be off
            return original(self, *args, **kwargs)
        controller.begin_step()
        ok = original(self, *args, **kwargs)
        controller.end_step()
        return ok

    return wrapper


def _wrap_copy_main_to_model(runtime_ref, original):
    def wrapper(self, *args, **kwargs):
        runtime = runtime_ref()
        controller = runtime.controllers.get(self) if runtime else None
        if controller is not None:
            controller.after_inner_update()
        return original(self, *args, **kwargs)

    return wrapper


def _wrap_grad_stats_group(runtime_ref, original):
    def wrapper(self, *args, **kwargs):
        group = original(self, *args, **kwargs)
        runtime = runtime_ref()
        worker = runtime.grad_stats_groups.get(self) if runtime else None
        # None means all ranks (megatron-core 0.12.x always; later releases when the
        # optimizer was not built by get_megatron_optimizer): that would cross workers.
        return worker if group is None and worker is not None else group

    return wrapper


def _wrap_scheduler_step(runtime_ref, original):
    def wrapper(self, increment, *args, **kwargs):
        runtime = runtime_ref()
        if runtime is not None:
            controllers = get_local_sgd(self.optimizer, runtime)
            scale = controllers[0].last_step_progress if controllers else 1.0
            if controllers and increment:  # torchft: a heal moved global progress (not step(0))
                scale += controllers[0].take_progress_jump()
            if scale != 1.0:
                increment = increment * scale
        return original(self, increment, *args, **kwargs)

    return wrapper


def build_registry(runtime_ref: Callable[[], Optional[LocalSGDRuntime]]) -> PatchRegistry:
    """The patches, bound to whatever runtime ``runtime_ref()`` returns when they run."""
    registry = PatchRegistry()

    def add(pid, target, wrap, description):
        # The parameters each target has on the installed release: megatron_edit.mcore.compat.
        # ``wrap(runtime_ref, original)``, bound here to this registry's runtime.
        registry.add(Patch(pid, target, partial(wrap, runtime_ref), SUPPORTED, compat.params(target), description))

    add("ddp-init", f"{_DDP}.__init__", _wrap_ddp_init,
        "register DDP bucket groups; reject options incompatible with an outer sync")
    add("distopt-init", f"{_DISTOPT}.__init__", _wrap_optimizer_init,
        "build the sharded EDiT state (anchor, outer optimizer) of each optimizer")
    add("bucket-start-grad-sync", f"{_BUCKET_GROUP}.start_grad_sync", _wrap_grad_sync,
        "after warmup: reduce-scatter inside the worker only, averaged over it")
    add("bucket-finish-grad-sync", f"{_BUCKET_GROUP}.finish_grad_sync", _wrap_grad_sync,
        "after warmup: wait for the worker-local reduction")
    add("bucket-start-param-sync", f"{_BUCKET_GROUP}.start_param_sync", _wrap_start_param_sync,
        "layer-wise sync: outer step of a bucket group just before its all-gather")
    add("distopt-step-with-ready-grads", f"{_DISTOPT}.step_with_ready_grads", _wrap_step_with_ready_grads,
        "schedule: anchor after warmup, count steps, start a due sync")
    add("distopt-copy-main-to-model", f"{_DISTOPT}._copy_main_params_to_model_params", _wrap_copy_main_to_model,
        "step-end sync between the inner update and the main->model copy")
    add("sched-step-global-progress", "megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.step",
        _wrap_scheduler_step,
        "A-EDiT: each step advances the LR schedule by its share of the workers' global progress; "
        "torchft: the step after a heal jumps to the peer's progress")
    add("distopt-grad-stats-group", f"{_DISTOPT}.get_grad_stats_parallel_group", _wrap_grad_stats_group,
        "gradient norm / zero count inside the worker, never across workers (0.12.x: all ranks)")
    add_skipped_step_patches(registry, runtime_ref)
    add_fsdp_patches(registry, runtime_ref)
    add_expert_bias_patches(registry, runtime_ref)
    return registry
