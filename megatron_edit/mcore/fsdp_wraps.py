"""Where EDiT attaches to Megatron-FSDP: registry patches of megatron-core's
``megatron/core/distributed/fsdp`` (megatron-core 0.16.1-0.19.x only; see :mod:`megatron_edit.mcore.fsdp`).

=====================================  =====================================================
patch                                  why
=====================================  =====================================================
fsdp-init                              check the options before Megatron-FSDP is built;
                                       register the model (an optimizer over an unregistered
                                       one is refused)
fsdp-grad-reduce                       after warmup: reduce-scatter gradients inside the
                                       worker only (no all-reduce across instances), scaled
                                       by 1 / the worker's size
fsdp-param-gather                      layer-wise sync: a bucket's pending outer step is
                                       applied just before its all-gather
=====================================  =====================================================

The optimizer side (schedule, step-end sync, EDiT state) is the distributed optimizer's, whose
patches (:mod:`megatron_edit.mcore.core_wraps`) run for a ``DistributedOptimizer`` built over
Megatron-FSDP too. Every wrapper passes straight through while local SGD is not configured.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional

from . import compat
from .releases import FSDP_SUPPORTED
from .wrap_registry import Patch, PatchRegistry

_ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter:FullyShardedDataParallel"
_BUFFERS = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"


@contextmanager
def _worker_scale(pipeline, bucket_group, num_workers: int):
    """The buckets' gradient scale from 1 / (all data-parallel ranks) to 1 / (the worker's
    ranks) while they are reduced inside the worker only (applied to the buffer before the
    reduce-scatter, inside the call); averaging in the collective needs no change."""
    saved = []
    for bucket_id in bucket_group:
        gbuf = pipeline.get_fsdp_buffer(bucket_id)
        if gbuf.gradient_scaling_factor is not None and not gbuf.ddp_config.average_in_collective:
            saved.append((gbuf, gbuf.gradient_scaling_factor))
            gbuf.gradient_scaling_factor = gbuf.gradient_scaling_factor * num_workers
    try:
        yield
    finally:
        for gbuf, factor in saved:
            gbuf.gradient_scaling_factor = factor


def _params(target: str):
    """The target's parameters on the installed release (:mod:`megatron_edit.mcore.releases`);
    none on a release outside :data:`FSDP_SUPPORTED`, where the patch is not applied."""
    try:
        return compat.params(target)
    except LookupError:
        return ()


def add_fsdp_patches(registry: PatchRegistry, runtime_ref: Callable[[], Optional[object]]) -> None:
    """Declare the Megatron-FSDP patches on ``registry``, bound to ``runtime_ref()``."""

    def wrap_init(original):
        def wrapper(self, config, ddp_config, *args, **kwargs):
            runtime = runtime_ref()
            if runtime is not None and runtime.configs is not None:
                runtime.check_fsdp(config, ddp_config)  # before any work
            original(self, config, ddp_config, *args, **kwargs)
            if runtime is not None:
                runtime.on_fsdp_init(self)

        return wrapper

    def wrap_grad_reduce(original):
        def wrapper(self, bucket_group, async_op=False, outer_fsdp_group_grad_reduce=False):
            runtime = runtime_ref()
            controller = runtime.fsdp_controller(self) if runtime else None
            if controller is None or not controller.grads_are_local:
                return original(self, bucket_group, async_op=async_op,
                                outer_fsdp_group_grad_reduce=outer_fsdp_group_grad_reduce)
            with _worker_scale(self, bucket_group, controller.num_workers):
                return original(self, bucket_group, async_op=async_op, outer_fsdp_group_grad_reduce=False)

        return wrapper

    def wrap_bucket_gather(original):
        def wrapper(self, bucket_id, bwd):
            runtime = runtime_ref()
            controller = runtime.fsdp_pipelines.get(self) if runtime else None
            if controller is not None:
                group = controller.fsdp.group_of(bucket_id)
                if group is not None:
                    controller.before_param_gather(group)
            return original(self, bucket_id, bwd)

        return wrapper

    registry.add(Patch(
        "fsdp-init", f"{_ADAPTER}.__init__", wrap_init, FSDP_SUPPORTED, _params(f"{_ADAPTER}.__init__"),
        "Megatron-FSDP: check the options for EDiT before building; register the model"))
    reduce = f"{_BUFFERS}:GradReducePipeline._bucket_group_gradient_reduce"
    gather = f"{_BUFFERS}:AllGatherPipeline.async_bucket_gather"
    registry.add(Patch(
        "fsdp-grad-reduce", reduce, wrap_grad_reduce, FSDP_SUPPORTED, _params(reduce),
        "Megatron-FSDP after warmup: no gradient all-reduce across workers, scale 1 / worker size"))
    registry.add(Patch(
        "fsdp-param-gather", gather, wrap_bucket_gather, FSDP_SUPPORTED, _params(gather),
        "Megatron-FSDP layer-wise sync: a bucket's outer step just before its all-gather"))
