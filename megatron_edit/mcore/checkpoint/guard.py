"""The load guard of EDiT checkpoints (format in :mod:`megatron_edit.mcore.checkpoint`): before
``dist_checkpointing.load`` reads anything large, every rank reads the checkpoint's run records,
fits its :class:`~megatron_edit.mcore.checkpoint.resume.ResumePlan` to them, and checks that every
EDiT entry it asks for is there with its shape and that no data file is shorter than the
checkpoint's metadata says; a problem is one :class:`CheckpointStateError` on every rank (the
same message), never a raw error from deep inside the load or a silent fresh start.
"""

from __future__ import annotations

from typing import Optional

import torch

from .keys import CheckpointStateError, missing_message
from .resume import ResumePlan


def _cause(error: BaseException) -> str:
    """The innermost error line of ``error`` (torch's CheckpointException wraps every rank's)."""
    text = str(error)
    line = next((ln.strip() for ln in reversed(text.splitlines()) if "Error" in ln), "")
    return (line or f"{type(error).__name__}: {text.splitlines()[0] if text else ''}")[:200]


def damaged_message(checkpoint_dir, error: BaseException) -> str:
    """One line for a checkpoint that passed the EDiT checks but failed to read: the folder and
    the cause."""
    return (f"megatron_edit: checkpoint {checkpoint_dir} could not be read ({_cause(error)}). A file of it "
            "is damaged or incomplete: resume from another checkpoint.")


def _short_files(checkpoint_dir) -> Optional[str]:
    """Data files shorter than the checkpoint's metadata says (a truncated copy or an interrupted
    write), or missing, as a message; None when every file is whole."""
    import os

    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(checkpoint_dir)).read_metadata()
    except Exception:  # noqa: BLE001 - no readable .metadata: Megatron's own load says so
        return None
    needed = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    damaged = []
    for name, size in sorted(needed.items()):
        path = os.path.join(str(checkpoint_dir), name)
        have = os.path.getsize(path) if os.path.exists(path) else None
        if have is None or have < size:
            damaged.append(f"{name} ({'missing' if have is None else f'{have} of {size} bytes'})")
    if not damaged:
        return None
    return (f"megatron_edit: checkpoint {checkpoint_dir} is damaged: {', '.join(damaged[:3])}"
            f"{' ...' if len(damaged) > 3 else ''}: resume from another checkpoint.")


def prepare_load(sharded_state_dict, checkpoint_dir, load) -> None:
    """Before ``dist_checkpointing.load``: read the checkpoint's run records (with ``load``, the
    original function), fit every :class:`ResumePlan`'s requests to the checkpoint, then check
    that every EDiT entry still asked for is there with the same shape. Raises
    :class:`CheckpointStateError` on every rank (a collective over the world group)."""
    import dataclasses

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    plans = [v.obj for v in nested_values(sharded_state_dict)
             if isinstance(v, LocalNonpersistentObject) and isinstance(v.obj, ResumePlan)]
    message = None
    if plans:
        from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

        saved = load_sharded_metadata(str(checkpoint_dir))
        present = {i: p for i, p in enumerate(plans) if p.record_request().unique_key in saved}
        records = {}
        if present:  # every rank asks (the same plans everywhere): a collective load
            requests = {i: dataclasses.replace(p.record_request()) for i, p in present.items()}
            from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

            try:
                records = load(requests, str(checkpoint_dir))
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - garbled bytes, on every rank
                message = (f"megatron_edit: the EDiT record of checkpoint {checkpoint_dir} cannot be read "
                           f"({_cause(e)}): it is corrupted. "
                           "Resume from another checkpoint, or load only the model (--no-load-optim) to "
                           "start EDiT from it.")
        for i, plan in enumerate(plans):
            if message:
                plan.prepared = True  # refused below on every rank
                continue
            message = plan.prepare(records.get(i), saved)
        message = message or missing_message(sharded_state_dict, saved, checkpoint_dir)
        message = message or _short_files(checkpoint_dir)
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, message)
    first = next(((r, m) for r, m in enumerate(messages) if m), None)
    if first:
        rank, text = first
        raise CheckpointStateError(f"{text} (found by rank {rank})")  # the same on every rank
