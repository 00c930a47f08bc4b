"""Where one Megatron ``DistributedOptimizer`` sits among the EDiT workers, derived once.

A *worker* is one instance of Megatron's partial distributed optimizer
(``num_distributed_optimizer_instances``); its ranks (the optimizer's data-parallel group) each
hold a shard of every bucket's fp32 main parameters, and the ranks holding the same shard in the
other workers form the sync group (Megatron's inter-instance group). :class:`WorkerLayout` reads
all of it from the objects the optimizer carries (never ``parallel_state``), once, when the
controller is built; the controller, the checkpoint and the runtime take it from there
(``LocalSGD.layout``). Per-buffer shard geometry is :mod:`megatron_edit.mcore.shards`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

from ..config import ConfigError
from . import compat


@dataclass(frozen=True)
class WorkerLayout:
    """One distributed optimizer's place among the EDiT workers."""

    worker: int
    """This rank's worker (Megatron's ``distributed_optimizer_instance_id``)."""
    num_workers: int
    """EDiT workers: ``num_distributed_optimizer_instances``."""
    worker_size: int
    """Ranks per worker (the shard count): the optimizer's data-parallel group."""
    intra_rank: int
    """This rank's shard inside its worker."""
    dp_group_idx: int
    """Megatron's ``data_parallel_group_idx``: one per tensor / pipeline slice."""
    sync_group: Optional[Any] = field(default=None, compare=False)
    """The ranks holding this rank's shard in every worker (None with one worker)."""
    shard_group: Optional[Any] = field(default=None, compare=False)
    """The worker's ranks that share this optimizer's buckets (the first buffer's group)."""
    tp_group: Optional[Any] = field(default=None, compare=False)
    """The model's tensor-parallel group; for the expert optimizer of a MoE model (expert
    parallelism), the expert tensor x expert model-parallel group: the worker's other ranks that
    hold a piece of the same expert layers (a layer's norm sums over it and ``shard_group``)."""
    expert: bool = False
    """The optimizer of the expert-parallel parameters (Megatron's ``expert_parallel_buffers``,
    the second optimizer of its ``ChainedOptimizer``)."""

    @classmethod
    def of(cls, optimizer, first_bucket_group=None) -> "WorkerLayout":
        """``first_bucket_group``: one of the optimizer's bucket groups (its inter-instance
        group is the sync group); None: the optimizer has no buckets."""
        workers = int(optimizer.ddp_config.num_distributed_optimizer_instances)
        inter = compat.inter_instance_group(first_bucket_group) if workers > 1 else None
        chunk = optimizer.model_chunks[0]
        expert = is_expert_optimizer(optimizer)
        return cls(
            worker=int(optimizer.distributed_optimizer_instance_id),
            num_workers=workers,
            worker_size=optimizer.data_parallel_group.size(),
            intra_rank=optimizer.data_parallel_group.rank(),
            dp_group_idx=int(optimizer.data_parallel_group_idx),
            sync_group=inter,
            shard_group=optimizer.buffers[0].data_parallel_group if optimizer.buffers else None,
            tp_group=compat.expert_groups(chunk)[1] if expert else compat.tensor_parallel_group(chunk),
            expert=expert,
        )


def is_expert_optimizer(optimizer) -> bool:
    """Whether ``optimizer``'s buffers are its model chunks' expert-parallel buffers."""
    experts = {id(b) for chunk in optimizer.model_chunks for b in getattr(chunk, "expert_parallel_buffers", ())}
    return bool(optimizer.buffers) and all(id(b) in experts for b in optimizer.buffers)


def groups_a_step_uses(optimizer, layout: WorkerLayout) -> Dict[str, Any]:
    """The process groups one training step of ``optimizer``'s model communicates over (between
    syncs, every one of them must lie inside the worker): the optimizer's data-parallel group,
    the tensor-parallel group (for the expert optimizer, the expert tensor x model-parallel
    group the token dispatchers use), and the context- and pipeline-parallel groups."""
    from megatron.core import parallel_state

    chunk = optimizer.model_chunks[0]
    groups = {"data-parallel (the distributed optimizer's)": optimizer.data_parallel_group,
              "expert tensor x expert model-parallel" if layout.expert else "tensor-parallel": layout.tp_group,
              "pipeline-parallel": compat.pipeline_parallel_group(chunk)}
    if parallel_state.model_parallel_is_initialized():
        groups["context-parallel"] = parallel_state.get_context_parallel_group()
    return {name: group for name, group in groups.items() if group is not None}


def check_worker_holds(worker: Sequence[int], groups: Dict[str, Sequence[int]]) -> None:
    """Every group a step uses lies inside the worker (``worker``, ``groups``: global ranks):
    what Megatron's rank layout gives for every tensor / context / pipeline / expert parallelism
    with ``num_distributed_optimizer_instances`` (checked on real megatron-core's
    ``initialize_model_parallel`` in the tests); a layout that crosses workers would mix them
    every step, so it stops the run before the first one."""
    inside = set(worker)
    for name, ranks in groups.items():
        outside = sorted(set(ranks) - inside)
        if outside:
            raise ConfigError(
                f"megatron_edit: the {name} group (ranks {sorted(ranks)}) crosses EDiT workers: "
                f"ranks {outside} are not in this rank's worker {sorted(inside)} (one instance of "
                "--num-distributed-optimizer-instances), so workers would exchange data every step. "
                "Use a parallel layout whose tensor, context, pipeline and expert groups each lie "
                "inside one distributed-optimizer instance.")
