"""MoE routers' expert bias (``--moe-router-enable-expert-bias``, aux-loss-free load balancing,
arXiv 2408.15664) under EDiT: counted inside the worker between syncs, averaged over the workers
at each sync.

Megatron updates each router's ``expert_bias`` buffer at every step, in
``finalize_model_grads`` → ``_update_router_expert_bias`` → ``moe_utils.get_updated_expert_bias``:
the routers' token counts are all-reduced over the tensor x data x context-parallel group (every
data-parallel rank, so across EDiT workers), then ``bias += rate * sign(mean count - count)``.
Under EDiT:

* **Between syncs** (after the warmup) the counts are all-reduced over the worker's part of that
  group (its tensor x data x context-parallel ranks): each worker's biases follow its own
  tokens, as its parameters follow its own gradients. During the synchronous warmup Megatron's
  group is kept (every worker steps together and gets the same biases).
* **At each sync** every router's ``expert_bias`` becomes the mean of the workers' biases (one
  small blocking all-reduce over the sync group, at the sync point: right after the sync step's
  inner update; with the delayed outer step, at the apply; with streaming fragments, at every
  fragment's sync; with A-EDiT, at every sync of its plan, skipped exchanges included). The
  biases are buffers, not parameters: the outer step does not touch them. After the run's last
  sync every worker holds one model, biases included.
* **Checkpoints** hold every worker's biases (:mod:`megatron_edit.mcore.checkpoint.expert_bias`):
  a resume is exact also between syncs.

Which releases: ``_update_router_expert_bias(model, config)`` reads the group from
``parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)`` inside
``get_updated_expert_bias`` up to megatron-core 0.17; since 0.18 it takes ``tp_dp_cp_group``.
The patch ``moe-expert-bias-counts`` passes the worker's group there (0.18+) or, before, runs
the update in a region where ``moe-expert-bias-group`` makes that getter answer with it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, List, Optional

from ..config import ConfigError
from ..exchange.groups import average_over_workers, group_within
from . import compat
from .wrap_registry import Patch, PatchRegistry, VersionRange

_FINALIZE = "megatron.core.distributed.finalize_model_grads"
_UPDATE = f"{_FINALIZE}:_update_router_expert_bias"
_GROUP = "megatron.core.parallel_state:get_tensor_and_data_parallel_group"
GROUP_FROM_PARALLEL_STATE = VersionRange("0.12.0", "0.18.0")
"""Releases whose ``get_updated_expert_bias`` reads the counts' group from ``parallel_state``
(the patch ``moe-expert-bias-group`` applies to them only; 0.18+ pass it in)."""


def expert_biases(model_chunks) -> List:
    """The ``expert_bias`` buffers Megatron updates (routers of MoE layers; not a frozen one),
    in module order."""
    return [m.expert_bias for chunk in model_chunks for m in chunk.modules()
            if getattr(m, "expert_bias", None) is not None and not getattr(m, "frozen_expert_bias", False)]


class ExpertBiases:
    """The routers' expert biases of one model, averaged over the workers at each sync."""

    def __init__(self, biases: List, sync_group):
        self.biases = biases
        self.sync_group = sync_group

    @classmethod
    def of(cls, optimizer, expert: bool, sync_group) -> Optional["ExpertBiases"]:
        """For the optimizer of the dense parameters (the routers are dense layers; with expert
        parallelism the experts' optimizer has none); None without expert biases."""
        biases = [] if expert else expert_biases(optimizer.model_chunks)
        return cls(biases, sync_group) if biases else None

    def average(self, step: int) -> None:
        """At the sync after ``step``: every bias := its mean over the workers."""
        average_over_workers(self.biases, self.sync_group)


def worker_count_group(optimizer, worker_group):
    """The worker's part of Megatron's tensor x data x context-parallel group, where the routers'
    token counts are all-reduced between syncs. A collective (every rank, at the same point: while
    building the optimizers); ``worker_group``: every rank of the worker."""
    from megatron.core import parallel_state

    full = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if worker_group is None or full is None:
        raise ConfigError(
            "megatron_edit: --moe-router-enable-expert-bias with --use-local-sgd needs Megatron's "
            "parallel_state initialized (initialize_model_parallel with "
            "num_distributed_optimizer_instances): its tensor x data x context-parallel group is "
            "cut to each worker's ranks.")
    return group_within(full, worker_group)


class _Region(threading.local):
    group = None


def add_expert_bias_patches(registry: PatchRegistry, runtime_ref: Callable[[], Optional[object]]) -> None:
    """Declare the two patches on ``registry`` (see the module docstring)."""
    region = _Region()

    def worker_group_for(model):
        runtime = runtime_ref()
        if runtime is None:
            return None
        for chunk in model:
            found = runtime.expert_bias_groups.get(chunk)
            if found is not None:
                controller, group = found
                return group if controller.grads_are_local else None
        return None

    takes_group = "tp_dp_cp_group" in compat.params(_UPDATE)

    def wrap_update(original):
        def wrapper(model, config, *args, **kwargs):
            group = worker_group_for(model)
            if group is None:
                return original(model, config, *args, **kwargs)
            if takes_group:  # 0.18+: the group is its one other argument
                return original(model, config, tp_dp_cp_group=group)
            with _answering(region, group):
                return original(model, config, *args, **kwargs)

        return wrapper

    def wrap_group(original):
        names = compat.params(_GROUP)

        def wrapper(*args, **kwargs):
            kwargs.update(zip(names, args))
            if region.group is not None and kwargs.get("with_context_parallel", False):
                return region.group
            return original(**kwargs)

        return wrapper

    full = compat.release_range(_UPDATE)
    registry.add(Patch("moe-expert-bias-counts", _UPDATE, wrap_update, full, compat.params(_UPDATE),
                       "MoE expert bias: token counts all-reduced inside the worker between syncs"))
    registry.add(Patch("moe-expert-bias-group", _GROUP, wrap_group, GROUP_FROM_PARALLEL_STATE, compat.params(_GROUP),
                       "MoE expert bias (0.12-0.17): the count group is the worker's inside the update"))


@contextmanager
def _answering(region, group):
    saved, region.group = region.group, group
    try:
        yield
    finally:
        region.group = saved


def register_model(runtime, optimizer, controller, worker_group) -> None:
    """After the dense optimizer's controller is built: the worker's count group for its model
    chunks (a collective; only with expert biases and more than one worker)."""
    if controller.expert_biases is None or controller.num_workers == 1:
        return
    group = worker_count_group(optimizer, worker_group)
    for chunk in optimizer.model_chunks:
        runtime.expert_bias_groups[chunk] = (controller, group)

