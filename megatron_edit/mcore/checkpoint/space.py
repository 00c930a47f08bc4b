"""EDiT's per-shard tensors in model space: one checkpoint tensor per parameter (EDiT, arXiv
2412.07210; checkpoints of :mod:`megatron_edit.mcore.checkpoint`).

The anchor, the outer optimizer's state and the error-feedback residuals live, like Megatron's
main parameters, as one flat tensor per bucket shard: their layout depends on the number of
ranks per worker, on the buckets (``--ddp-bucket-size``, the model) and on tensor / pipeline
parallelism. To reshard them like Megatron's fully reshardable optimizer state, each is stored
per *parameter*, under the key of the parameter's own model tensor: Megatron's
``fully_reshardable`` mechanism, reused as it is: the model's ``ShardedTensor`` (or
``ShardedTensorFactory``) of the parameter is copied with ``dataclasses.replace`` and given a
new key, the EDiT values and a replica id. Its global shape, offsets (tensor parallelism, the
layer axis of pipeline stages) and factory transforms are the model's, so
``dist_checkpointing`` reshards EDiT's state exactly as it reshards the model. (megatron-core
0.16 refuses ``ShardedTensor.flattened_range``, which would let each rank write only its piece
of a parameter.)

Save: the shards of one bucket are all-gathered inside the worker (one bucket at a time), and
the rank holding a parameter's first element writes the whole parameter: per state, about
1 / (ranks per worker) of the model's parameters per rank, plus one bucket in flight. Load:
each rank reads the parameters that intersect its shard and keeps its piece of them.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import torch

from .keys import CheckpointStateError


@dataclasses.dataclass(frozen=True)
class _Piece:
    """The part of one parameter that lies in this rank's shard of a bucket."""

    param: torch.nn.Parameter
    slot: int  # index of the shard among the optimizer's (LocalSGD.shards order)
    shard_start: int
    shard_end: int
    param_start: int  # in the flattened parameter
    param_end: int


@dataclasses.dataclass(frozen=True)
class _Owned:
    """A parameter whose first element lies in this rank's shard: this rank writes it."""

    param: torch.nn.Parameter
    slot: int
    bucket_start: int  # where the parameter starts in its bucket


def model_tensors_by_param(model_sharded_state_dict) -> Dict[int, object]:
    """id(parameter) -> the model's ShardedTensor / ShardedTensorFactory of that parameter."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for value in nested_values(model_sharded_state_dict or {}):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and torch.is_tensor(value.data):
            out[id(value.data)] = value
    return out


class ModelSpace:
    """One optimizer's shards seen per parameter, for writing and reading checkpoint tensors.

    ``shards``: the optimizer's :class:`~megatron_edit.exchange.shard.BucketShard` s in Megatron's
    buffer / bucket order; ``model_tensors``: :func:`model_tensors_by_param` of the model's
    sharded state dict the optimizer was given.
    """

    def __init__(self, optimizer, shards: Sequence, model_tensors: Dict[int, object]):
        self.shards = list(shards)
        self.group = optimizer.data_parallel_group
        self.intra_rank = self.group.rank()
        self.worker_size = self.group.size()
        self.model_tensors = model_tensors
        self.pieces: List[List[_Piece]] = []
        self.owned: List[List[_Owned]] = []
        shards_iter = iter(self.shards)
        for gbuf_idx, buffer in enumerate(optimizer.buffers):
            for bucket_maps in optimizer.gbuf_ranges[gbuf_idx].values():
                for bucket_idx, bucket_map in enumerate(bucket_maps):
                    bucket = buffer.buckets[bucket_idx]
                    shard = next(shards_iter)
                    assert shard.bucket is bucket, "LocalSGD shards and Megatron buckets disagree"
                    slot = len(self.pieces)
                    self.pieces.append([
                        _Piece(p, slot, r["gbuf_local"].start, r["gbuf_local"].end, r["param"].start, r["param"].end)
                        for p, r in bucket_map["param_map"].items()
                    ])
                    owned = []
                    for p in bucket.params_list:
                        start = buffer.param_index_map[p][0] - bucket.offset
                        if p.numel() and start // shard.numel == self.intra_rank:
                            owned.append(_Owned(p, slot, start))
                    self.owned.append(owned)
        for param in {id(o.param): o.param for owned in self.owned for o in owned}.values():
            self._metadata(param)  # every parameter this rank writes has a model tensor
        # A name per parameter for the dicts of entries (model keys repeat across layers: the
        # layers of a pipeline stage are one key with a layer axis).
        self.names = {id(p): f"param_{i}" for i, p in enumerate(
            p for buffer in optimizer.buffers for p in buffer.param_index_map)}

    def _metadata(self, param):
        sh = self.model_tensors.get(id(param))
        if sh is None:
            raise CheckpointStateError(
                f"megatron_edit: a parameter of shape {tuple(param.shape)} has no tensor in the "
                f"model's sharded state dict passed to the optimizer's sharded_state_dict, so its "
                f"EDiT state has no checkpoint key (build the model's sharded state dict with "
                f"keep_vars, as Megatron does, and pass it)."
            )
        return sh

    def entry(self, prefix: str, param, data: torch.Tensor, replica_last: int):
        """The checkpoint entry of ``data`` (a tensor shaped like ``param``): the model tensor
        of ``param`` with key ``prefix + its key`` and the last replica coordinate (data
        parallel in Megatron's ``(pp, tp, dp)``) set to ``replica_last``."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        sh = self._metadata(param)
        rid = sh.replica_id
        rid = (rid,) if isinstance(rid, int) else tuple(rid)
        if len(rid) != 3:
            raise CheckpointStateError(
                f"megatron_edit: the model tensor {sh.key} has replica id {sh.replica_id}, not "
                f"Megatron's (pipeline, tensor, data); its EDiT state cannot be placed."
            )
        changes = dict(key=f"{prefix}{sh.key}", data=data, replica_id=(*rid[:2], replica_last))
        if isinstance(sh, ShardedTensor):
            changes["dtype"] = data.dtype
        return dataclasses.replace(sh, **changes)

    # ------------------------------------------------------------------ save
    @torch.no_grad()
    def _gather(self, slot: int, tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """The whole bucket of ``tensor`` (this rank's shard-length piece; None: zeros)."""
        shard = self.shards[slot]
        local = torch.zeros(shard.numel, dtype=torch.float32, device=shard.device)
        if tensor is not None:
            local.copy_(tensor.view(-1)[: shard.numel])
        if self.worker_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.worker_size)]
        torch.distributed.all_gather(parts, local, group=self.group)
        return torch.cat(parts)

    def save_entries(self, prefix: str, tensors: Optional[Sequence[Optional[torch.Tensor]]],
                     replica_last: int) -> dict:
        """Checkpoint entries of one shard-length tensor per shard (a collective inside the
        worker), for the parameters this rank writes. ``tensors`` None: placeholders
        (:mod:`.constant`), zeros without a collective (every rank of the worker passes None)."""
        out = {}
        for slot, owned in enumerate(self.owned):
            if tensors is None:
                for o in owned:
                    data = torch.zeros(o.param.shape, dtype=torch.float32, device=self.shards[slot].device)
                    out[self.names[id(o.param)]] = self.entry(prefix, o.param, data, replica_last)
                continue
            bucket = self._gather(slot, tensors[slot])
            for o in owned:
                data = bucket[o.bucket_start : o.bucket_start + o.param.numel()].view(o.param.shape).clone()
                out[self.names[id(o.param)]] = self.entry(prefix, o.param, data, replica_last)
        return out

    # ------------------------------------------------------------------ load
    def load_requests(self, prefix: str, main: bool) -> dict:
        """Entries asking for every parameter that intersects this rank's shards. Megatron's
        load checks that one request per parameter is the main replica: with ``main`` (one
        worker passes True), the rank that would write the parameter."""
        owned = {id(o.param) for owned in self.owned for o in owned}
        out = {}
        for pieces in self.pieces:
            for piece in pieces:
                p = piece.param
                data = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                out[self.names[id(p)]] = self.entry(prefix, p, data, 0 if main and id(p) in owned else 1)
        return out

    @torch.no_grad()
    def assemble(self, loaded: dict, slot: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` (shard-length) := this rank's piece of each parameter in ``loaded`` (what
        :meth:`load_requests` asked for, loaded), 0 elsewhere (bucket padding)."""
        out.zero_()
        for piece in self.pieces[slot]:
            value = loaded[self.names[id(piece.param)]]
            out[piece.shard_start : piece.shard_end].copy_(value.reshape(-1)[piece.param_start : piece.param_end])
        return out
