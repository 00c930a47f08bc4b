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

megatron-core's own load defects (without apex / transformer-engine) are worked around in
:mod:`megatron_edit.mcore.load_fixes`; the Megatron mechanics of keys and replica ids are in
:mod:`megatron_edit.mcore.checkpoint_layout`.

Nothing here changes what a sync computes; :class:`~megatron_edit.mcore.controller.LocalSGD` is only read and
restored through its attributes, ``extra_state()`` and ``load_extra_state()``.

This module is long because this docstring is the reference of the on-disk format; the code is
the record, the sharded state dict and its load, and the load guard (the patches that call them
are in :mod:`.checkpoint_patches`).
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import torch

from ..config import NotSupportedYet
from . import compat
from .checkpoint_layout import (
    PREFIX,
    _WORKER_KEY,
    CheckpointStateError,
    _BucketSlot,
    _bucket_slots,
    _is_local_sgd_key,
    _Layout,
)
from .patching import VersionRange

logger = logging.getLogger(__name__)

SUPPORTED = VersionRange("0.16.0", "0.20.0")
"""megatron-core versions whose checkpoints carry the EDiT state (the patches below)."""
NOT_YET = VersionRange(compat.SUPPORTED.minimum, SUPPORTED.minimum)
"""Releases megatron_edit trains on but cannot checkpoint EDiT with yet: saving or loading the
optimizer of an EDiT run is refused there (never a checkpoint that silently lacks EDiT state)."""
FORMAT = "megatron_edit.local_sgd/1"
SUPPORTED_SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")

_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_CHAINED = "megatron.core.optimizer.optimizer:ChainedOptimizer"


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
    part = dict(record=record, anchor=anchors, outer=outer_state)
    if controller.config.exchange_error_feedback:
        part.update(_residual_entries(controller, layout, slots, base, is_loading))
    return part


def _residual_entries(controller, layout: _Layout, slots, base: str, is_loading: bool) -> dict:
    """Error feedback's residuals: this worker's own (``residual``, one per bucket like the
    anchor) and the chunk of the reduced result it requantizes (``chunk_residual``, ``per``
    elements per rank). Every worker writes its own, under its own keys."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def tensor(key, data, local, total, offset):
        return ShardedTensor(key=key, data=data, dtype=data.dtype, local_shape=(local,), global_shape=(total,),
                             global_offset=(offset,), axis_fragmentations=None, replica_id=(0, 0, 0))

    worker = f"worker_{layout.worker}"
    residual, chunk_residual = {}, {}
    for i, slot in enumerate(slots):
        shard = slot.shard
        device = shard.device
        if slot.length:
            data = (torch.zeros(slot.length, device=device) if is_loading or shard.residual is None
                    else shard.residual.detach()[: slot.length])
            residual[i] = tensor(f"{PREFIX}residual.{worker}.{base}.{slot.name}", data, slot.length,
                                 slot.numel_unpadded, slot.offset)
        per = controller.chunk_length(shard)
        if per:
            data = (torch.zeros(per, device=device) if is_loading or shard.chunk_residual is None
                    else shard.chunk_residual.detach())
            chunk_residual[i] = tensor(f"{PREFIX}chunk_residual.{worker}.{base}.{slot.name}", data, per,
                                       layout.worker_size * per, layout.intra_rank * per)
    return dict(residual=residual, chunk_residual=chunk_residual)


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
    controller.outer_state.synchronize()  # offloaded state: no copy in flight while we write it
    controller.steps_done = record["steps_done"]
    controller._last_sync_step = record["last_sync_step"]

    if not record["anchor_taken"]:
        controller.drop_anchor()
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
    _load_residuals(controller, slots, part)

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


def _load_residuals(controller, slots, part: dict) -> None:
    """Error-feedback residuals (a checkpoint saved without them: they restart at zero, said by
    the load guard)."""
    if not controller.config.exchange_error_feedback:
        return
    residual, chunk = part.get("residual") or {}, part.get("chunk_residual") or {}
    for i, slot in enumerate(slots):
        shard = slot.shard
        if torch.is_tensor(residual.get(i)):
            shard.residual = _assemble(slot, residual[i], torch.empty(shard.numel, device=shard.device))
        else:
            shard.residual = None
        loaded = chunk.get(i)
        shard.chunk_residual = loaded.to(shard.device).clone() if torch.is_tensor(loaded) else None


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
    controller.gather_params_in_worker()


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
        wanted = _drop_missing_residuals(sharded_state_dict, wanted, saved)
        message = _missing_message(wanted, saved, checkpoint_dir)
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, message)
    first = next(((r, m) for r, m in enumerate(messages) if m), None)
    if first:
        rank, text = first
        raise CheckpointStateError(f"{text} (found by rank {rank})")  # the same on every rank


_OPTIONAL = (f"{PREFIX}residual.", f"{PREFIX}chunk_residual.")


def _drop_missing_residuals(sharded_state_dict, wanted: list, saved: dict) -> list:
    """Error-feedback residuals the checkpoint does not have (saved without
    ``--local-sgd-exchange-error-feedback``, or by another number of workers) are not asked
    for: they restart at zero, with a warning. Returns the entries still wanted."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    absent = {id(sh) for sh in wanted if any(p in sh.key for p in _OPTIONAL) and sh.key not in saved}
    if not absent:
        return wanted
    dict_list_map_inplace(lambda v: LocalNonpersistentObject(None) if id(v) in absent else v, sharded_state_dict)
    if torch.distributed.get_rank() == 0:
        logger.warning(
            "megatron_edit: the checkpoint has no error-feedback residual for this run's workers "
            "(saved without --local-sgd-exchange-error-feedback or with another number of workers): "
            "the residuals start at zero."
        )
    return [sh for sh in wanted if id(sh) not in absent]


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
