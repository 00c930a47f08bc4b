"""Where EDiT's state goes among Megatron's checkpoint keys and replica ids (``torch_dist``).

Megatron's distributed-optimizer checkpoint assumes every distributed-optimizer instance is a
replica: replica ids let only instance 0 write the model and optimizer state. Between syncs EDiT
workers differ, so worker k >= 1 writes its optimizer part under its own keys
(``local_sgd.worker_<k>.``) with replica ids that make exactly one rank *inside* worker k the
writer; its model entries are kept out of the shared model keys; on load, tensors that alias the
model are given their own buffers. See :mod:`megatron_edit.mcore.checkpoint` for what is saved.
:func:`missing_message` checks a load's EDiT keys against the checkpoint's before anything is
read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import torch

from ..worker_layout import WorkerLayout

PREFIX = "local_sgd."
"""Every checkpoint key EDiT adds starts with this (after Megatron's own prefixes)."""
WORKER_KEY = re.compile(r"(?:^|\.)local_sgd\.worker_(\d+)\.")


class CheckpointStateError(RuntimeError):
    """The EDiT part of a checkpoint is missing, incomplete, corrupted or incompatible."""


def worker_key(key: str, worker: int) -> str:
    """Checkpoint key of worker ``worker``'s copy of Megatron's optimizer key ``key`` (worker 0
    writes Megatron's own keys)."""
    return f"{PREFIX}worker_{worker}.{key}" if worker else key


def retarget(key: str, megatron_key: str, worker: int) -> str:
    """``key`` (Megatron's optimizer key ``megatron_key``, possibly behind a worker part and
    the prefixes Megatron adds later, e.g. ``chained_0.``) as worker ``worker``'s key."""
    head = key[: len(key) - len(megatron_key)]
    head = WORKER_KEY.sub(lambda m: "." if m.group(0).startswith(".") else "", head)
    return head + worker_key(megatron_key, worker)


def is_local_sgd_key(key: str) -> bool:
    # Megatron may prepend its own prefixes (e.g. ``chained_0.``).
    return key.startswith(PREFIX) or f".{PREFIX}" in key


# --------------------------------------------------------------------------- EDiT's own keys
ANCHOR = f"{PREFIX}anchor."
RESULT_RESIDUAL = f"{PREFIX}result_residual."
IN_FLIGHT = f"{PREFIX}in_flight."
"""A delayed outer step's reduced pseudo-gradient, in flight at the save (worker 0 writes)."""


def outer_prefix(state_key: str) -> str:
    return f"{PREFIX}outer.{state_key}."


def residual_prefix(worker: int) -> str:
    return f"{PREFIX}residual.worker_{worker}."


def launch_prefix(worker: int) -> str:
    """The keep_local merge: worker k's parameters at the launch of the exchange in flight."""
    return f"{PREFIX}in_flight_launch.worker_{worker}."


# --------------------------------------------------------------------------- save layout
def sharding_type_of(state: dict, kwargs: dict) -> str:
    return state.get("param_state_sharding_type") or kwargs.get("sharding_type") or (
        (kwargs.get("metadata") or {}).get("distrib_optim_sharding_type", "fully_sharded_model_space")
    )


def _worker_replica_id(sh, sharding_type: str, layout: WorkerLayout):
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


def rename_for_worker(state: dict, sharding_type: str, layout: WorkerLayout) -> None:
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


def unalias_from_model(state: dict, optimizer) -> None:
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


def drop_worker_model_entries(model_sharded_state_dict, optimizer) -> None:
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


def missing_message(sharded_state_dict, saved: dict, checkpoint_dir) -> Optional[str]:
    """What EDiT state this load asks for and ``saved`` (the checkpoint's metadata) lacks or
    holds with another shape, as a message; None when everything is there."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    wanted = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensorFactory) and is_local_sgd_key(value.key):
            wanted.extend(v for v in nested_values(value.build()) if isinstance(v, ShardedTensor))
        elif isinstance(value, (ShardedTensor, ShardedObject)) and is_local_sgd_key(value.key):
            wanted.append(value)
    missing, mismatched = [], []
    for sh in wanted:
        key = sh.unique_key if isinstance(sh, ShardedObject) else sh.key
        if key not in saved:
            missing.append(sh.key)
        elif (not isinstance(sh, ShardedObject) and not sh.allow_shape_mismatch  # e.g. a padded vocabulary
              and tuple(saved[key].global_shape) != tuple(sh.global_shape)):
            mismatched.append(f"{sh.key}: {tuple(saved[key].global_shape)} saved, {tuple(sh.global_shape)} now")
    where = f"checkpoint {checkpoint_dir}"
    if mismatched:
        return (f"megatron_edit: the EDiT state in {where} does not fit this run's model "
                f"(different shapes): {mismatched[:3]}")
    if missing:
        workers = sorted({int(m.group(1)) for k in missing for m in [WORKER_KEY.search(k)] if m})
        which = f" (workers {workers})" if workers else ""
        return (f"megatron_edit: the EDiT state in {where} is incomplete or corrupted: "
                f"{len(missing)} entries missing{which}, e.g. {missing[:3]}.")
    return None
