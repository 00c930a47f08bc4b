"""EDiT state in Megatron's distributed checkpoints (``torch_dist``), with exact resume.

EDiT (arXiv 2412.07210) keeps state that ordinary data-parallel training does not have: between
syncs every worker (one distributed-optimizer instance) has its *own* parameters and Adam state,
and every rank holds its shard of the anchor and of the outer optimizer state. Megatron's
checkpoint layout assumes the opposite, that all instances are replicas: its replica ids let
only instance 0 write the model and the optimizer state, and its fully parallel save may pick any
instance to write a shard. Saved as is, worker 1's local progress would be lost (or silently
mixed into worker 0's tensors).

Everything rides inside ``DistributedOptimizer.sharded_state_dict`` / ``load_state_dict``, so
Megatron-LM's ``--save`` / ``--load --ckpt-format torch_dist`` and a megatron-core user's
``dist_checkpointing.save({'model': m, 'optimizer': opt.sharded_state_dict(m, metadata=...)})``
carry it with no extra call.

What is written, per distributed optimizer (``g`` = Megatron's ``data_parallel_group_idx``, one
per tensor/pipeline slice; ``k`` = worker; replica id ``(worker, ...)`` means only worker 0's
copy is written):

==========================================  ==========================================  =========
key                                         content                                     written by
==========================================  ==========================================  =========
model keys, ``optimizer.*`` (Megatron's)    worker 0's model and inner optimizer        worker 0
``local_sgd.worker_<k>.optimizer.*``        worker k's inner optimizer state (main       worker k
                                            params, Adam moments, param groups), k >= 1
``local_sgd.anchor.dp_group_idx_<g>.*``     this rank's anchor shard, per bucket          worker 0
``local_sgd.outer.<state>.dp_group_idx_*``  outer optimizer state (e.g. momentum)         worker 0
``local_sgd.record.dp_group_idx_<g>``       step counters, anchor taken?, outer scalars,  worker 0,
                                            ``LocalSGD.extra_state()`` (detector, ...)    rank 0
==========================================  ==========================================  =========

* Worker k >= 1 renames the keys of Megatron's optimizer part to ``local_sgd.worker_<k>.`` and
  sets the instance coordinate of their replica ids to 0, so inside each worker exactly one rank
  writes each shard (Megatron's save validates this on every save). Worker k's model needs no
  copy: it is a function of its main params (fp32: they are the model; bf16: the model is
  their cast), which are in that part. At save, worker k's model entries are dropped from the
  model state dict passed to the optimizer, so a fully parallel save cannot write them under the
  shared model keys.
* The anchor and the outer state are identical on all workers: one copy, in bucket space like
  Megatron's ``dp_reshardable`` format (one tensor per bucket of global length
  ``numel_unpadded``, each rank its contiguous shard), so a different shard size with the same
  bucket layout reshards. (Model-space keys would also survive tensor/pipeline changes, but
  megatron-core 0.16.1 refuses ``ShardedTensor.flattened_range``.)
* Loading: every worker loads the shared model keys (worker 0's model), then its own inner
  optimizer part and the EDiT state; finally each worker's model is rebuilt from its main
  params (main -> model copy, all-gather inside the worker), so the result does not depend on
  the order in which the caller loads model and optimizer.
* Saving syncs nothing across workers: a sync that is pending (due at this step, completing
  layer by layer in the next forward pass) is completed first with the numbers it would have
  had anyway; between syncs, the workers' local state is stored as it is. The parameters are
  all-gathered *inside* each worker (what Megatron-LM does before every save) so the model part
  is complete.

Partial and unusual loads:

* Without the optimizer (``--no-load-optim``, ``--finetune``, or loading only ``'model'``):
  every worker gets worker 0's model and EDiT starts afresh (synchronous warmup, new anchor), so
  all replicas stay consistent.
* A checkpoint without EDiT state, or with part of it missing, or saved with a different number
  of workers, fails with :class:`CheckpointStateError` naming what is missing (checked in
  ``dist_checkpointing.load`` before anything is read, and again when the state is applied);
  never a silent fresh start. A different shard size (ranks per worker) with the same buckets
  loads (resharding); a different number of workers is refused.
* Megatron's ``dp_reshardable`` (Megatron-LM's default) and ``fully_reshardable`` optimizer
  formats are supported; ``dp_zero_gather_scatter`` (deprecated; it keeps only instance 0's
  state) is refused. In megatron-core 0.16.x ``fully_reshardable`` misplaces the state of
  parameters that follow a padded bucket (a Megatron bug, also without EDiT): with more than
  one bucket per buffer it is refused. ``fully_sharded_model_space`` (megatron-core's default when no metadata is
  passed) fails in megatron-core 0.16.1 itself: pass
  ``metadata={'distrib_optim_sharding_type': 'dp_reshardable'}``.
* The legacy ``torch`` format (``--ckpt-format torch``: ``save_parameter_state`` /
  ``load_parameter_state``) is refused: it gathers optimizer state on data-parallel rank 0 of
  instance 0 only.

megatron-core 0.16.1 without apex / transformer-engine (torch AdamW fallback) mishandles Adam's
state when loading a distributed-optimizer checkpoint; exact resume needs three fixes, applied
by the checkpoint patches while EDiT is on (:data:`TORCH_ADAM_LOAD_BUGS` names the versions):

1. ``state_dict()`` reads Adam's ``step`` from the optimizer state, which is empty before the
   first step; ``sharded_state_dict(is_loading=True)`` calls it, so loading into a fresh run
   fails (``assert len(steps) == 1``). Fix: give each parameter the zero state torch's Adam
   would create lazily (same values), before ``state_dict()`` runs.
2. With fp32 parameters the main params are views of leaf parameters that require grad, and
   ``dp_reshardable`` loading copies into them outside ``no_grad`` (RuntimeError). Fix: load
   under ``torch.no_grad()``.
3. ``load_state_dict`` gives all parameters one shared ``step`` tensor (torch's Adam then
   increments it once per parameter per step), and ``dp_reshardable`` loading then copies the
   *pre-load* step into it. Fix: after loading, every parameter gets its own ``step`` tensor
   holding the checkpoint's value (the param groups' ``step``).

A fourth shows with ``fully_reshardable``: its checkpoint has no per-parameter ``step`` but
``_set_main_param_and_optimizer_states`` copies every key of torch Adam's state (KeyError).
Fix: the missing ``step`` is left as it is (fix 3 then sets it).

Nothing here changes what a sync computes; :mod:`megatron_edit.local_sgd` is only read and
restored through its attributes and, when present, ``extra_state()`` / ``load_extra_state()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import re
from typing import Callable, List, Optional, Tuple

import torch

from . import compat
from .config import NotSupportedYet
from .patching import Patch, PatchRegistry, VersionRange

logger = logging.getLogger(__name__)

SUPPORTED = VersionRange("0.16.0", "0.17.0")
"""megatron-core versions whose checkpoints carry the EDiT state (the patches below)."""
NOT_YET = VersionRange(compat.SUPPORTED.minimum, SUPPORTED.minimum)
"""Releases megatron_edit trains on but cannot checkpoint EDiT with yet: saving or loading the
optimizer of an EDiT run is refused there (never a checkpoint that silently lacks EDiT state)."""
TORCH_ADAM_LOAD_BUGS = VersionRange("0.16.0", "0.17.0")
"""megatron-core versions whose distributed optimizer needs the torch-Adam load fixes."""
FULLY_RESHARDABLE_PADDING_BUG = VersionRange("0.16.0", "0.17.0")
"""megatron-core versions whose ``fully_reshardable`` format misplaces state after a padded
bucket (the world tensors drop the padding between buckets, the parameter offsets do not)."""

PREFIX = "local_sgd."
"""Every checkpoint key this module adds starts with this (after Megatron's own prefixes)."""
FORMAT = "megatron_edit.local_sgd/1"
SUPPORTED_SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")

_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_CHAINED = "megatron.core.optimizer.optimizer:ChainedOptimizer"
_WORKER_KEY = re.compile(r"(?:^|\.)local_sgd\.worker_(\d+)\.")


class CheckpointStateError(RuntimeError):
    """The EDiT part of a checkpoint is missing, incomplete, corrupted or incompatible."""


def worker_key(key: str, worker: int) -> str:
    """Checkpoint key of worker ``worker``'s copy of Megatron's optimizer key ``key``."""
    return f"{PREFIX}worker_{worker}.{key}"


def _is_local_sgd_key(key: str) -> bool:
    # Megatron may prepend its own prefixes (e.g. ``chained_0.``).
    return key.startswith(PREFIX) or f".{PREFIX}" in key


# --------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where one distributed optimizer sits among the EDiT workers."""

    worker: int
    num_workers: int
    worker_size: int
    """Ranks per worker (shard size): the optimizer's data-parallel group."""
    intra_rank: int
    dp_group_idx: int

    @classmethod
    def of(cls, optimizer, controller) -> "_Layout":
        return cls(
            worker=int(optimizer.distributed_optimizer_instance_id),
            num_workers=int(controller.num_workers),
            worker_size=optimizer.data_parallel_group.size(),
            intra_rank=optimizer.data_parallel_group.rank(),
            dp_group_idx=int(optimizer.data_parallel_group_idx),
        )


@dataclasses.dataclass
class _BucketSlot:
    """This rank's shard of one bucket, as a slice of a bucket-space checkpoint tensor."""

    shard: object  # local_sgd.BucketShard
    name: str  # "gbuf_<i>.bucket_<j>"
    numel_unpadded: int
    offset: int
    length: int  # 0 when the whole shard is end-of-bucket padding


def _bucket_slots(optimizer, controller, layout: _Layout) -> List[_BucketSlot]:
    """The controller's shards, matched to Megatron's buffers and buckets (same order)."""
    slots = []
    shards = iter(controller.shards)
    for gbuf_idx, buffer in enumerate(optimizer.buffers):
        for bucket_maps in optimizer.gbuf_ranges[gbuf_idx].values():
            for bucket_idx in range(len(bucket_maps)):
                bucket = buffer.buckets[bucket_idx]
                shard = next(shards)
                assert shard.bucket is bucket, "LocalSGD shards and Megatron buckets disagree"
                offset = layout.intra_rank * shard.numel
                length = max(0, min(shard.numel, bucket.numel_unpadded - offset))
                slots.append(
                    _BucketSlot(shard, f"gbuf_{gbuf_idx}.bucket_{bucket_idx}", bucket.numel_unpadded, offset, length)
                )
    assert next(shards, None) is None, "LocalSGD has shards Megatron's optimizer does not"
    return slots


def _outer_state_keys(controller) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(per-element tensor keys, scalar keys) of the outer optimizer's per-parameter state.

    Found by one step of the configured optimizer class on a dummy tensor, so a loading run
    knows which tensors to ask for before it has any state of its own.
    """
    cfg = controller.outer_config
    probe = torch.zeros(2)
    try:
        opt = cfg.optimizer_class([probe], **cfg.outer_optim_kwargs)
        probe.grad = torch.ones(2)
        opt.step()
    except Exception as e:  # pragma: no cover - exotic optimizers
        raise NotSupportedYet(
            f"megatron_edit cannot checkpoint the outer optimizer {cfg.optimizer_class.__name__}: "
            f"a probe step failed ({e})."
        ) from e
    tensors, scalars = [], []
    for key, value in opt.state[probe].items():
        (tensors if torch.is_tensor(value) and value.shape == probe.shape else scalars).append(key)
    return tuple(sorted(tensors)), tuple(sorted(scalars))


# --------------------------------------------------------------------------- record
def _extra_state(controller) -> Optional[dict]:
    hook = getattr(controller, "extra_state", None)
    return hook() if callable(hook) else None


def _record(controller, layout: _Layout, slots: List[_BucketSlot], scalar_keys) -> dict:
    """The picklable EDiT state of one optimizer (identical on every rank of a slice)."""
    outer = controller.outer_optimizer
    present, scalars = [], []
    for slot in slots:
        state = outer.state.get(slot.shard.anchor, {}) if outer is not None else {}
        present.append(sorted(state))
        scalars.append(
            {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in state.items() if k in scalar_keys}
        )
    return dict(
        format=FORMAT,
        num_workers=layout.num_workers,
        worker_size=layout.worker_size,
        steps_done=controller.steps_done,
        last_sync_step=controller._last_sync_step,
        anchor_taken=outer is not None,
        bucket_numel_unpadded=[s.numel_unpadded for s in slots],
        config=dict(
            sync_interval=controller.config.local_sgd_sync_interval,
            warmup_steps=controller.config.local_sgd_warmup_steps,
            sync_mode=controller.config.sync_mode,
        ),
        outer_class=f"{controller.outer_config.optimizer_class.__module__}."
        f"{controller.outer_config.optimizer_class.__qualname__}",
        outer_hyperparameters=(
            [{k: v for k, v in g.items() if k != "params"} for g in outer.param_groups] if outer else None
        ),
        outer_state_present=present,
        outer_scalar_state=scalars,
        extra_state=_extra_state(controller),
    )


_RECORD_FIELDS = (
    "num_workers", "steps_done", "last_sync_step", "anchor_taken", "bucket_numel_unpadded",
    "outer_state_present", "outer_scalar_state",
)


def _check_record(record, layout: _Layout, slots: List[_BucketSlot], where: str) -> dict:
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise CheckpointStateError(
            f"megatron_edit: the EDiT record of {where} is not readable (format {found!r}, "
            f"expected {FORMAT!r}): the checkpoint is corrupted or was written by another tool."
        )
    missing = [f for f in _RECORD_FIELDS if f not in record]
    if missing:
        raise CheckpointStateError(
            f"megatron_edit: the EDiT record of {where} lacks {missing}: the checkpoint is corrupted."
        )
    if record["num_workers"] != layout.num_workers:
        raise CheckpointStateError(
            f"megatron_edit: {where} holds EDiT state of {record['num_workers']} workers, this run "
            f"has {layout.num_workers} (--num-distributed-optimizer-instances). Changing the "
            f"number of workers on resume is not supported; only the ranks per worker may change."
        )
    layout_now = [s.numel_unpadded for s in slots]
    if (
        record["bucket_numel_unpadded"] != layout_now
        or len(record["outer_state_present"]) != len(slots)
        or len(record["outer_scalar_state"]) != len(slots)
    ):
        raise CheckpointStateError(
            f"megatron_edit: {where} was saved with buckets of {record['bucket_numel_unpadded']} "
            f"elements, this run has {layout_now}: the model or --ddp-bucket-size changed, or the "
            f"record is corrupted."
        )
    if not isinstance(record["steps_done"], int) or record["steps_done"] < 0:
        raise CheckpointStateError(f"megatron_edit: {where} has a corrupted EDiT step count.")
    return record


# --------------------------------------------------------------------------- save layout
def _sharding_type(state: dict, kwargs: dict) -> str:
    return state.get("param_state_sharding_type") or kwargs.get("sharding_type") or (
        (kwargs.get("metadata") or {}).get("distrib_optim_sharding_type", "fully_sharded_model_space")
    )


def _worker_replica_id(sh, sharding_type: str, layout: _Layout):
    """Replica id of worker k's renamed copy: main on one rank *inside* worker k.

    Megatron marks the instance as a replica coordinate: ``(instance, 0, dp_rank)`` for its
    ShardedObjects and ``(instance, 0, 0)`` for ``dp_reshardable`` tensors, ``(pp, tp,
    instance)`` for ``fully_sharded_model_space``, and the model's ``(pp, tp, dp_cp_rank)`` for
    ``fully_reshardable`` (dp_cp_rank counts across instances, which are contiguous blocks).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rid = sh.replica_id
    rid = (rid,) if isinstance(rid, int) else tuple(rid)
    k = layout.worker
    if isinstance(sh, ShardedObject) or sharding_type == "dp_reshardable":
        position, expected, value = 0, k, 0
    elif sharding_type == "fully_sharded_model_space":
        position, expected, value = 2, k, 0
    else:  # fully_reshardable (the caller refuses other types)
        position = 2
        expected = rid[2] if len(rid) == 3 and 0 <= rid[2] - k * layout.worker_size < layout.worker_size else None
        value = rid[2] - k * layout.worker_size if expected is not None else 0
    if len(rid) != 3 or rid[position] != expected:
        raise CheckpointStateError(
            f"megatron_edit: unexpected replica id {sh.replica_id} for {sh.key} "
            f"({sharding_type}, worker {k}); this megatron-core lays out replica ids differently "
            f"from 0.16 and the EDiT checkpoint layout would be wrong."
        )
    return rid[:position] + (value,) + rid[position + 1 :]


def _rename_for_worker(state: dict, sharding_type: str, layout: _Layout) -> None:
    """Worker k >= 1: Megatron's optimizer entries -> ``local_sgd.worker_<k>.`` keys."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    def rename(value):
        if not isinstance(value, ShardedBase):
            return value
        return dataclasses.replace(
            value,
            key=worker_key(value.key, layout.worker),
            replica_id=_worker_replica_id(value, sharding_type, layout),
        )

    dict_list_map_inplace(rename, state)


def _model_param_storages(optimizer) -> set:
    return {
        b.param_data.untyped_storage().data_ptr() for b in optimizer.buffers if b.param_data is not None
    }


def _unalias_from_model(state: dict, optimizer) -> None:
    """Loading worker k >= 1: fresh buffers for tensors that share storage with the model.

    With fp32 parameters Megatron's main params are views of the model's parameter buffer, which
    the shared model keys (worker 0's model) are loaded into as well: without this the order of
    the two writes would decide the result. The loaded values are copied into place by
    ``load_state_dict``.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    storages = _model_param_storages(optimizer)

    def unalias(value):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and torch.is_tensor(value.data):
            if value.data.untyped_storage().data_ptr() in storages:
                return dataclasses.replace(value, data=torch.empty_like(value.data))
        return value

    dict_list_map_inplace(unalias, state)


def _drop_worker_model_entries(model_sharded_state_dict, optimizer) -> None:
    """Saving worker k >= 1: its model entries must not be written under the shared keys.

    Their replica ids already make them non-main, but Megatron's fully parallel save
    distributes each shard to *any* rank holding it. The worker's model is restored from its
    main params instead.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    if not model_sharded_state_dict:
        return
    # Every parameter of the optimizer's buffers (its param groups hold only this rank's shard).
    params = {id(p) for buffer in optimizer.buffers for p in buffer.param_index_map}

    def drop(value):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and id(value.data) in params:
            return LocalNonpersistentObject(None)
        return value

    dict_list_map_inplace(drop, model_sharded_state_dict)


def local_sgd_sharded_state_dict(optimizer, controller, is_loading: bool) -> dict:
    """The EDiT part of one optimizer's sharded state dict (see the module docstring)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    layout = _Layout.of(optimizer, controller)
    slots = _bucket_slots(optimizer, controller, layout)
    tensor_keys, scalar_keys = _outer_state_keys(controller)
    base = f"dp_group_idx_{layout.dp_group_idx}"
    replica = (layout.worker, 0, 0)  # identical on every worker: worker 0's copy is written
    outer = controller.outer_optimizer

    def sharded(key, slot, data):
        return ShardedTensor(
            key=key,
            data=data,
            dtype=data.dtype,
            local_shape=(slot.length,),
            global_shape=(slot.numel_unpadded,),
            global_offset=(slot.offset,),
            axis_fragmentations=None,
            replica_id=replica,
        )

    def piece(slot, tensor):
        """This rank's slice of a shard-sized tensor, or a buffer to load it into."""
        if is_loading or tensor is None:
            device = slot.shard.bucket.grad_data.device
            return torch.zeros(slot.length, dtype=torch.float32, device=device)
        return tensor.detach()[: slot.length]

    anchors, outer_state = {}, {k: {} for k in tensor_keys}
    for i, slot in enumerate(slots):
        if slot.length == 0:
            continue
        anchors[i] = sharded(f"{PREFIX}anchor.{base}.{slot.name}", slot, piece(slot, slot.shard.anchor))
        state = outer.state.get(slot.shard.anchor, {}) if outer is not None else {}
        for key in tensor_keys:
            outer_state[key][i] = sharded(f"{PREFIX}outer.{key}.{base}.{slot.name}", slot, piece(slot, state.get(key)))
    record = ShardedObject(
        f"{PREFIX}record.{base}",
        _record(controller, layout, slots, scalar_keys),
        (1,),
        (0,),
        replica_id=(layout.worker, 0, layout.intra_rank),
    )
    return dict(record=record, anchor=anchors, outer=outer_state)


# --------------------------------------------------------------------------- load
def _assemble(slot: _BucketSlot, loaded: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    full = torch.zeros_like(like)  # padding stays 0, as in a live anchor
    if loaded is not None and slot.length:
        full[: slot.length].copy_(loaded.view(-1))
    return full


@torch.no_grad()
def load_local_sgd_state(optimizer, controller, part: dict) -> None:
    """Restore one optimizer's EDiT state from the loaded EDiT part of its state dict."""
    layout = _Layout.of(optimizer, controller)
    slots = _bucket_slots(optimizer, controller, layout)
    record = _check_record(part.get("record"), layout, slots, "this checkpoint")
    tensor_keys, _ = _outer_state_keys(controller)
    anchors, outer_loaded = part.get("anchor", {}), part.get("outer", {})

    controller.flush()
    controller.steps_done = record["steps_done"]
    controller._last_sync_step = record["last_sync_step"]

    if not record["anchor_taken"]:
        controller.outer_optimizer = None
        for slot in slots:
            slot.shard.anchor = None
    else:
        if controller.outer_optimizer is None:
            controller.capture_anchor()  # allocates anchors + outer optimizer as training would
        for i, slot in enumerate(slots):
            slot.shard.anchor.copy_(_assemble(slot, anchors.get(i), slot.shard.anchor))
        state = {}
        for i, slot in enumerate(slots):
            entry = {}
            for key in record["outer_state_present"][i]:
                if key in tensor_keys:
                    loaded = outer_loaded.get(key, {}).get(i)
                    entry[key] = _assemble(slot, loaded, slot.shard.anchor)
                elif key in record["outer_scalar_state"][i]:
                    entry[key] = record["outer_scalar_state"][i][key]
                else:
                    raise CheckpointStateError(
                        f"megatron_edit: outer optimizer state {key!r} of bucket {slot.name} is "
                        f"missing from the checkpoint (outer optimizer changed?)."
                    )
            if entry:
                state[i] = entry
        outer = controller.outer_optimizer
        # Hyperparameters come from this run's configuration; the state from the checkpoint.
        outer.load_state_dict({"state": state, "param_groups": outer.state_dict()["param_groups"]})
        _warn_if_changed(record, controller)

    saved_extra = record.get("extra_state")
    hook = getattr(controller, "load_extra_state", None)
    if callable(hook):
        if saved_extra is None:
            raise CheckpointStateError(
                "megatron_edit: the checkpoint's EDiT record has no extra state (anomaly-detector "
                "statistics, counters): it was written by an older megatron_edit or is corrupted."
            )
        try:
            hook(saved_extra)
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointStateError(
                f"megatron_edit: the EDiT extra state in the checkpoint is corrupted ({e!r})."
            ) from e
    elif saved_extra:
        raise CheckpointStateError(
            "megatron_edit: the checkpoint holds EDiT state this version cannot restore "
            f"(extra state {sorted(saved_extra)}); use the megatron_edit version that wrote it."
        )
    if torch.distributed.get_rank() == 0:
        logger.info(
            "megatron_edit: restored EDiT state after %d steps (%s), %d workers",
            controller.steps_done,
            "anchor and outer state" if record["anchor_taken"] else "still in warmup",
            controller.num_workers,
        )


def _warn_if_changed(record: dict, controller) -> None:
    if torch.distributed.get_rank() != 0:
        return
    now = [{k: v for k, v in g.items() if k != "params"} for g in controller.outer_optimizer.param_groups]
    cls = controller.outer_config.optimizer_class
    if record.get("outer_hyperparameters") not in (None, now) or record.get("outer_class") != (
        f"{cls.__module__}.{cls.__qualname__}"
    ):
        logger.warning(
            "megatron_edit: the outer optimizer's configuration differs from the checkpoint's "
            "(%s %s); continuing with this run's configuration and the checkpoint's state.",
            record.get("outer_class"),
            record.get("outer_hyperparameters"),
        )


def _refresh_model_from_mains(optimizer, controller) -> None:
    """Rebuild each worker's model from its (just loaded) main params: shard -> bucket, then
    all-gather inside the worker. Workers >= 1 had worker 0's model loaded into them."""
    optimizer._copy_main_params_to_model_params()
    for group in controller.group_order:
        if group.param_gather_handle is not None:
            group.param_gather_handle.wait()
            group.param_gather_handle = None
        group.start_param_sync(force_sync=True)


# --------------------------------------------------------------------------- the load guard
def check_checkpoint_has_local_sgd_state(sharded_state_dict, checkpoint_dir) -> None:
    """Raise :class:`CheckpointStateError` on every rank if the EDiT entries this rank asks
    for are not in the checkpoint with the same shape (a collective over the world group)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    wanted = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory) and _is_local_sgd_key(value.key):
            wanted.extend(v for v in nested_values(value.build()) if isinstance(v, ShardedTensor))
        elif isinstance(value, (ShardedTensor, ShardedObject)) and _is_local_sgd_key(value.key):
            wanted.append(value)
    message = None
    if wanted:
        from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

        saved = load_sharded_metadata(str(checkpoint_dir))
        message = _missing_message(wanted, saved, checkpoint_dir)
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, message)
    first = next(((r, m) for r, m in enumerate(messages) if m), None)
    if first:
        rank, text = first
        raise CheckpointStateError(f"{text} (found by rank {rank})")  # the same on every rank


def _missing_message(wanted, saved: dict, checkpoint_dir) -> Optional[str]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    missing, mismatched = [], []
    for sh in wanted:
        key = sh.unique_key if isinstance(sh, ShardedObject) else sh.key
        if key not in saved:
            missing.append(sh.key)
        elif not isinstance(sh, ShardedObject) and tuple(saved[key].global_shape) != tuple(sh.global_shape):
            mismatched.append(f"{sh.key}: {tuple(saved[key].global_shape)} saved, {tuple(sh.global_shape)} now")
    if not missing and not mismatched:
        return None
    ours = [k for k in saved if _is_local_sgd_key(k)]
    where = f"checkpoint {checkpoint_dir}"
    if not ours:
        return (
            f"megatron_edit: {where} has no EDiT (local SGD) state: it was saved without local SGD "
            f"or by another tool. Resuming EDiT from it would silently restart the outer "
            f"optimization; load it without the optimizer (--no-load-optim / --finetune, or only "
            f"the 'model' part) to start EDiT from its model, or turn local SGD off."
        )
    saved_workers = {int(m.group(1)) for k in ours for m in [_WORKER_KEY.search(k)] if m}
    wanted_workers = {int(m.group(1)) for k in missing for m in [_WORKER_KEY.search(k)] if m}
    if wanted_workers - saved_workers:
        return (
            f"megatron_edit: {where} holds EDiT state of {1 + max(saved_workers, default=0)} "
            f"worker(s), this run has more (worker {max(wanted_workers)} has no state there). "
            f"Changing the number of workers (--num-distributed-optimizer-instances) on resume is "
            f"not supported."
        )
    if mismatched:
        return (
            f"megatron_edit: the EDiT state in {where} does not fit this run (bucket layout "
            f"changed: different model or --ddp-bucket-size?): {mismatched[:3]}"
        )
    return (
        f"megatron_edit: the EDiT state in {where} is incomplete or corrupted: {len(missing)} "
        f"entries missing, e.g. {missing[:3]}."
    )


# --------------------------------------------------------------------------- torch Adam fixes
def _needs_torch_adam_fixes(optimizer) -> bool:
    from megatron.core.optimizer import distrib_optimizer

    from .api import megatron_core_version

    return (
        not distrib_optimizer.HAVE_APEX_OR_TE
        and type(optimizer.optimizer) in (torch.optim.Adam, torch.optim.AdamW)
        and TORCH_ADAM_LOAD_BUGS.contains(megatron_core_version())
    )


def init_missing_adam_state(optimizer) -> None:
    """Fix 1: the zero state torch's Adam creates lazily at its first step, created now."""
    try:
        from torch.optim.optimizer import _get_scalar_dtype
    except ImportError:  # pragma: no cover
        _get_scalar_dtype = lambda is_fused=None: torch.float32  # noqa: E731
    inner = optimizer.optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            if len(state) > 0:
                continue
            if group.get("capturable") or group.get("fused"):
                state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _adam_state_of(optimizer, model_param) -> dict:
    group_index, group_order = optimizer.model_param_group_index_map[model_param]
    main = optimizer.optimizer.param_groups[group_index]["params"][group_order]
    return optimizer.optimizer.state[main]


def restore_adam_steps(optimizer, state_dict) -> None:
    """Fix 3: one ``step`` tensor per parameter, holding the checkpoint's step count."""
    groups = (state_dict.get("optimizer") or {}).get("param_groups") or []
    steps = {g["step"] for g in groups if "step" in g}
    if len(steps) != 1:
        raise CheckpointStateError(f"megatron_edit: the optimizer checkpoint has Adam steps {sorted(steps)}.")
    (step,) = steps
    for state in optimizer.optimizer.state.values():
        if "step" in state:
            old = state["step"]
            state["step"] = torch.tensor(float(step), dtype=old.dtype, device=old.device)


# --------------------------------------------------------------------------- the patches
def _bind(original, self, args, kwargs) -> inspect.BoundArguments:
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    return bound


def add_checkpoint_patches(registry: PatchRegistry, runtime_ref: Callable[[], Optional[object]]) -> PatchRegistry:
    """Declare the checkpoint patches on ``registry`` (after :func:`build_registry`'s)."""

    def controller_of(optimizer):
        runtime = runtime_ref()
        return runtime.controllers.get(optimizer) if runtime is not None else None

    def wrap_state_dict(original):
        def wrapper(self, *args, **kwargs):
            controller = controller_of(self)
            if controller is not None:
                controller.flush()
                if _needs_torch_adam_fixes(self):
                    init_missing_adam_state(self)
            return original(self, *args, **kwargs)

        return wrapper

    def wrap_sharded_state_dict(original):
        def wrapper(self, *args, **kwargs):
            controller = controller_of(self)
            if controller is None:
                return original(self, *args, **kwargs)
            bound = _bind(original, self, args, kwargs)
            is_loading = bound.arguments["is_loading"]
            if controller._in_step:
                raise RuntimeError("megatron_edit: a checkpoint cannot be taken inside an optimizer step.")
            controller.flush()  # a due layer-wise sync completes now, with the same numbers
            if _needs_torch_adam_fixes(self):
                init_missing_adam_state(self)
            if not is_loading and self.ddp_config.overlap_param_gather:
                _refresh_params_in_worker(controller)
            state = original(*bound.args, **bound.kwargs)
            sharding_type = _sharding_type(state, bound.arguments)
            if sharding_type not in SUPPORTED_SHARDING_TYPES:
                raise NotSupportedYet(
                    f"megatron_edit: the distributed optimizer checkpoint format {sharding_type!r} "
                    f"cannot hold each EDiT worker's state; use 'dp_reshardable' (Megatron-LM's "
                    f"default) or 'fully_reshardable' (--dist-ckpt-optim-fully-reshardable)."
                )
            _refuse_broken_fully_reshardable(self, sharding_type)
            layout = _Layout.of(self, controller)
            if layout.worker > 0:
                _rename_for_worker(state, sharding_type, layout)
                if is_loading:
                    _unalias_from_model(state, self)
                else:
                    _drop_worker_model_entries(bound.arguments["model_sharded_state_dict"], self)
            state["local_sgd"] = local_sgd_sharded_state_dict(self, controller, is_loading)
            return state

        return wrapper

    def wrap_load_state_dict(original):
        def wrapper(self, state_dict, *args, **kwargs):
            controller = controller_of(self)
            if controller is None:
                return original(self, state_dict, *args, **kwargs)
            part = state_dict.get("local_sgd") if isinstance(state_dict, dict) else None
            is_checkpoint = isinstance(state_dict, dict) and "param_state" in state_dict
            if is_checkpoint and part is None:
                raise CheckpointStateError(
                    "megatron_edit: the optimizer state being loaded has no EDiT (local SGD) part: "
                    "the checkpoint was saved without local SGD. Load only the model "
                    "(--no-load-optim / --finetune) to start EDiT from it."
                )
            if part is not None:
                layout = _Layout.of(self, controller)
                _check_record(part.get("record"), layout, _bucket_slots(self, controller, layout), "this checkpoint")
                state_dict = {k: v for k, v in state_dict.items() if k != "local_sgd"}
            fixes = _needs_torch_adam_fixes(self)
            with torch.no_grad() if fixes else contextlib.nullcontext():  # fix 2
                result = original(self, state_dict, *args, **kwargs)
            if fixes:
                restore_adam_steps(self, state_dict)  # fix 3
            if part is not None:
                load_local_sgd_state(self, controller, part)
                if controller.num_workers > 1:
                    _refresh_model_from_mains(self, controller)
            return result

        return wrapper

    def wrap_set_main_param_state(original):
        def wrapper(self, model_param, tensors, *args, **kwargs):
            if controller_of(self) is None or not _needs_torch_adam_fixes(self):
                return original(self, model_param, tensors, *args, **kwargs)
            if "step" not in tensors:  # fix 4: the checkpoint has no per-param step; keep ours
                tensors = dict(tensors, step=_adam_state_of(self, model_param)["step"])
            with torch.no_grad():  # fix 2
                return original(self, model_param, tensors, *args, **kwargs)

        return wrapper

    def wrap_dist_load(original):
        def wrapper(sharded_state_dict, checkpoint_dir, *args, **kwargs):
            runtime = runtime_ref()
            if runtime is not None and len(runtime.controllers) > 0:
                check_checkpoint_has_local_sgd_state(sharded_state_dict, checkpoint_dir)
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)

        return wrapper

    def refuse_legacy(what):
        def wrap(original):
            def wrapper(self, *args, **kwargs):
                if any(controller_of(o) is not None for o in getattr(self, "chained_optimizers", [self])):
                    raise NotSupportedYet(
                        f"megatron_edit: {what} with local SGD is not supported: the legacy "
                        f"'torch' checkpoint format gathers the optimizer state of one EDiT "
                        f"worker only, so the other workers' local state would be lost. Use "
                        f"--ckpt-format torch_dist (megatron.core.dist_checkpointing)."
                    )
                return original(self, *args, **kwargs)

            return wrapper

        return wrap

    def refuse_before_support(what):
        def wrap(original):
            def wrapper(self, *args, **kwargs):
                if controller_of(self) is not None:
                    from .api import megatron_core_version

                    raise NotSupportedYet(
                        f"megatron_edit: {what} of a local-SGD optimizer needs megatron-core "
                        f"{SUPPORTED} (EDiT state in torch_dist checkpoints); megatron-core "
                        f"{megatron_core_version()} is installed. Checkpointing EDiT on it is not "
                        f"supported yet: upgrade megatron-core, or train without saving the optimizer."
                    )
                return original(self, *args, **kwargs)

            return wrapper

        return wrap

    for method, what in (("state_dict", "saving the state"), ("sharded_state_dict", "saving or loading the state"),
                         ("load_state_dict", "loading the state")):
        target = f"{_DISTOPT}.{method}"
        registry.add(Patch(f"ckpt-not-yet-{method.replace('_', '-')}", target, refuse_before_support(what),
                           NOT_YET, compat.params(target),
                           "before 0.16: refuse to checkpoint EDiT (its state would be missing)"))

    v = SUPPORTED
    registry.add(Patch("ckpt-distopt-state-dict", f"{_DISTOPT}.state_dict", wrap_state_dict, v, ("self",),
                       "complete a pending sync; 0.16.1 w/o apex/TE: zero Adam state before 'step' is read"))
    registry.add(Patch("ckpt-distopt-sharded-state-dict", f"{_DISTOPT}.sharded_state_dict",
                       wrap_sharded_state_dict, v,
                       ("self", "model_sharded_state_dict", "is_loading", "sharding_type", "metadata"),
                       "EDiT state (anchor, outer state, counters) + each worker's optimizer state "
                       "under its own keys in torch_dist checkpoints"))
    registry.add(Patch("ckpt-distopt-load-state-dict", f"{_DISTOPT}.load_state_dict", wrap_load_state_dict, v,
                       ("self", "state_dict"),
                       "restore EDiT state and each worker's model; 0.16.1 w/o apex/TE: load under "
                       "no_grad, one Adam step tensor per param with the checkpoint's value"))
    registry.add(Patch("ckpt-distopt-set-main-param-state", f"{_DISTOPT}._set_main_param_and_optimizer_states",
                       wrap_set_main_param_state, v, ("self", "model_param", "tensors"),
                       "0.16.1 w/o apex/TE: copy loaded main params under no_grad; tolerate the "
                       "checkpoint's missing per-param Adam step"))
    registry.add(Patch("ckpt-dist-checkpointing-load", "megatron.core.dist_checkpointing:load", wrap_dist_load, v,
                       ("sharded_state_dict", "checkpoint_dir", "sharded_strategy", "common_strategy"),
                       "clear error when a checkpoint lacks (part of) the EDiT state"))
    # The legacy format: a ChainedOptimizer of several optimizers bypasses the
    # DistributedOptimizer methods, so both are refused.
    for owner, name in ((_DISTOPT, "distopt"), (_CHAINED, "chained")):
        for method in ("save_parameter_state", "load_parameter_state"):
            registry.add(Patch(f"ckpt-refuse-legacy-{name}-{method.split('_')[0]}", f"{owner}.{method}",
                               refuse_legacy(f"--ckpt-format torch ({method})"), compat.SUPPORTED,
                               ("self", "filename"),
                               "refuse the legacy torch checkpoint format with local SGD"))
    return registry


def _refuse_broken_fully_reshardable(optimizer, sharding_type: str) -> None:
    from .api import megatron_core_version

    if sharding_type != "fully_reshardable" or not FULLY_RESHARDABLE_PADDING_BUG.contains(megatron_core_version()):
        return
    for buffer in optimizer.buffers:
        if any(b.grad_data.numel() != b.numel_unpadded for b in buffer.buckets[:-1]):
            raise NotSupportedYet(
                f"megatron_edit: megatron-core {megatron_core_version()}'s 'fully_reshardable' "
                f"optimizer format misplaces the optimizer state of parameters that follow a "
                f"padded bucket (its warning 'param range exceeds unpadded buffer'), so a resume "
                f"cannot be exact. Use 'dp_reshardable' (Megatron-LM's default, without "
                f"--dist-ckpt-optim-fully-reshardable), or one bucket per buffer."
            )


def _refresh_params_in_worker(controller) -> None:
    """All-gather the parameters inside the worker (as Megatron-LM does before a save), so the
    model part written by worker 0 is complete even with ``overlap_param_gather``."""
    for group in controller.group_order:
        group.start_param_sync(force_sync=True)
