"""EDiT's view of Megatron's distributed optimizer: one :class:`BucketShard` per bucket.

Megatron's ``DistributedOptimizer`` cuts every bucket of every parameter buffer into as many
contiguous shards as the worker (distributed-optimizer instance) has ranks; ``gbuf_ranges``
says where each parameter's piece of this rank's shard lies. This module reads that layout once,
when the optimizer is built, and turns it into plain tensors and ranges for
:mod:`megatron_edit.exchange`; it also names the layer of every parameter, for the
pseudo-gradient penalty's per-layer decisions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List

import torch

from ..exchange.shard import BucketShard
from . import compat

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
_EXPERTS = re.compile(r"^(.*?\.layers\.\d+\.mlp\.experts)\.")


def layer_key(param_name: str) -> str:
    """The layer a parameter belongs to, for the pseudo-gradient penalty's per-layer decisions:
    ``...layers.N`` for transformer layers, otherwise the module that owns it
    (``embedding.word_embeddings``, ``output_layer``, ...).

    MoE: the routed experts of a transformer layer are a layer of their own,
    ``...layers.N.mlp.experts`` (all its experts together, whatever the expert implementation,
    and whether or not expert parallelism spreads them over ranks); the router and the shared
    experts stay in ``...layers.N``. So the decisions do not depend on the expert-parallel size
    (local expert numbers never enter the name), and the dense and the expert optimizers of a
    MoE model hold disjoint layers. One consequence: at one sync, a worker's router and its
    experts may be excluded or weighted differently."""
    name = param_name
    while name.startswith("module."):
        name = name[len("module.") :]
    m = _EXPERTS.match(name) or _LAYER.match(name)
    return m.group(1) if m else name.rpartition(".")[0] or name


@dataclass
class ShardLayout:
    """The shards of one distributed optimizer, grouped as Megatron gathers them."""

    shards: List[BucketShard]
    """Every bucket's shard, in Megatron's buffer / bucket order (checkpoint order)."""
    group_order: List[object]
    """Megatron's bucket groups owned by this optimizer, in forward (param-gather) order."""
    group_shards: Dict[object, List[BucketShard]]
    """Bucket group -> its shards."""
    layer_names: List[str]
    """Every layer with a parameter in this optimizer's buckets (the same list on every rank
    of the worker), sorted; shard segments refer to their index."""


def _is_view_at(main: torch.Tensor, flat: torch.Tensor, start: int) -> bool:
    """Whether ``main`` is the contiguous stretch of ``flat`` starting at ``start``."""
    return (
        main.is_contiguous()
        and main.dtype == flat.dtype
        and main.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        and main.data_ptr() == flat.data_ptr() + start * flat.element_size()
    )


def build_layout(optimizer) -> ShardLayout:
    """Read Megatron's ``DistributedOptimizer`` (``gbuf_ranges``, buffers, bucket groups)."""
    main_of = {}
    for model_groups, main_groups in (
        (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
        (optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
    ):
        for model_group, main_group in zip(model_groups, main_groups):
            for model_param, main in zip(model_group, main_group):
                main_of[model_param] = main
    fp32_models = {p for g in optimizer.model_fp32_groups for p in g}

    bucket_to_group = {}
    group_order: List[object] = []
    layer_of: Dict[torch.nn.Parameter, str] = {}
    tp_rank = {}
    for index, chunk in enumerate(optimizer.model_chunks):
        groups = list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)
        # Megatron gathers bucket groups in reverse order (buckets are built backward).
        group_order.extend(reversed(groups))
        for group in groups:
            for bucket in group.buckets:
                bucket_to_group[id(bucket)] = group
        tp = compat.tensor_parallel_group(chunk)
        expert_params = {p for b in getattr(chunk, "expert_parallel_buffers", ()) for p in b.params}
        # expert parameters are sliced over the expert tensor-parallel group
        expert_tp = compat.expert_groups(chunk)[0] if expert_params else None
        for name, param in chunk.named_parameters():
            # Virtual pipeline chunks reuse local layer numbers: keep them apart.
            prefix = f"chunk{index}." if len(optimizer.model_chunks) > 1 else ""
            layer_of[param] = prefix + layer_key(name)
            group = expert_tp if param in expert_params else tp
            tp_rank[param] = group.rank() if group is not None else 0
    # Layers of every param in this optimizer's buckets: the same list on every rank of the
    # worker (a rank's own shard may hold no element of some layer).
    layer_names = sorted(
        {layer_of[p] for buffer in optimizer.buffers for b in buffer.buckets for p in b.params_list}
    )
    index_of = {name: i for i, name in enumerate(layer_names)}

    shards: List[BucketShard] = []
    group_shards: Dict[object, List[BucketShard]] = {}
    for gbuf_index, buffer in enumerate(optimizer.buffers):
        if buffer.param_data is not None and buffer.param_data.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise RuntimeError(
                f"megatron_edit: a parameter buffer holds {buffer.param_data.dtype} (FP8 parameters?): "
                "EDiT writes the outer step's result into the model's parameter buffer and needs "
                "fp32 / bf16 / fp16 parameters (drop --fp8-param-gather)."
            )
        shard_size = buffer.data_parallel_group.size()
        shard_rank = buffer.data_parallel_group.rank()
        for bucket_maps in optimizer.gbuf_ranges[gbuf_index].values():
            for bucket_index, bucket_map in enumerate(bucket_maps):
                bucket = buffer.buckets[bucket_index]
                numel = bucket.grad_data.numel() // shard_size
                mains, local_ranges, segments, dense = [], [], [], set()
                main_is_model = True
                for model_param, ranges in bucket_map["param_map"].items():
                    mains.append(main_of[model_param])
                    start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
                    local_ranges.append((start, end))
                    in_bucket = ranges["gbuf_world_in_bucket"]
                    if in_bucket.start != shard_rank * numel + start:
                        raise RuntimeError(
                            "megatron_edit: this megatron-core places a parameter's shard in its "
                            f"bucket at {in_bucket.start}, not at shard {shard_rank} x {numel} + "
                            f"{start}: the distributed optimizer's layout changed."
                        )
                    main_is_model &= model_param in fp32_models
                    # A tensor-parallel duplicate (e.g. a layer norm) is counted once.
                    counts = bool(getattr(model_param, "tensor_model_parallel", False)) or tp_rank[model_param] == 0
                    if getattr(model_param, "shared_embedding", False):
                        dense.add(len(segments))  # tied with a copy on another pipeline stage
                    segments.append((start, end, index_of[layer_of[model_param]], counts))
                model = flat_mains = None
                slice_ = bucket.param_data.view(-1)[shard_rank * numel : (shard_rank + 1) * numel]
                if not main_is_model:
                    model = slice_
                elif all(_is_view_at(m, slice_, s) for m, (s, _) in zip(mains, local_ranges)):
                    flat_mains = slice_  # fp32: the mains are views of the shard's param slice
                shard = BucketShard(
                    numel=numel,
                    mains=mains,
                    local_ranges=local_ranges,
                    segments=segments,
                    bucket_layers={index_of[layer_of[p]] for p in bucket.params_list},
                    model=model,
                    flat_mains=flat_mains,
                    device=bucket.grad_data.device,
                    bucket=bucket,
                    index=len(shards),
                    dense=dense,
                )
                shards.append(shard)
                group_shards.setdefault(bucket_to_group[id(bucket)], []).append(shard)
    # Only groups this optimizer owns, in forward order.
    group_order = [g for g in group_order if g in group_shards]
    return ShardLayout(shards, group_order, group_shards, layer_names)
