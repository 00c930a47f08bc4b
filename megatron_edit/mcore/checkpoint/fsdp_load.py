"""Loading EDiT state from Megatron-FSDP's ``fsdp_dtensor`` checkpoints (format in
:mod:`.fsdp_dtensor`).

The optimizer's ``sharded_state_dict(is_loading=True)`` asks for an exact resume
(:func:`fsdp_load_requests`) and keeps a :class:`FSDPResumePlan`; megatron_edit's patch of
``torch.distributed.checkpoint.load`` (and of the deprecated ``load_state_dict`` Megatron-LM 0.16
calls) reads the record first and fits the requests to the checkpoint
(:func:`prepare_fsdp_load`), by :class:`~megatron_edit.mcore.checkpoint.resume.ResumePlan`'s rules
(the same workers; another number of workers with one outer step at load; a checkpoint of plain
Megatron-FSDP), with a missing or misshapen entry named in one line on every rank before anything
large is read. ``load_state_dict`` then restores the worker's Adam state, its parameters and
EDiT's state (:func:`load_fsdp_state`, then :func:`~.state.load_local_sgd_state`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..process_state import PROCESS
from .expert_bias import saved_keys as saved_bias_keys
from .fsdp_dtensor import (
    FSDP_DTENSOR,
    LOCAL_KEY,
    DTensorSpace,
    bias_tail,
    unblob,
    dcp_view,
    has_residuals,
    worker_param_prefix,
)
from .keys import CheckpointStateError
from .record import outer_state_keys
from .keys import ANCHOR, RESULT_RESIDUAL, outer_prefix
from .resume import ResumePlan


def fsdp_load_requests(optimizer, controller, state: dict) -> dict:
    """What the optimizer's ``sharded_state_dict(is_loading=True)`` returns (``state``: Megatron's
    requests): an exact resume's, fitted to the checkpoint by :func:`prepare_fsdp_load`."""
    space = DTensorSpace(optimizer, controller.shards)
    tensor_keys, _ = outer_state_keys(controller)
    part = dict(record=b"", slice=b"", anchor=space.load_requests(ANCHOR),
                outer={k: space.load_requests(outer_prefix(k)) for k in tensor_keys})
    if has_residuals(controller):
        part["result_residual"] = space.load_requests(RESULT_RESIDUAL)
    plan = FSDPResumePlan(optimizer, controller, state, part, space)
    PROCESS.checkpoint_plans[optimizer] = plan
    return plan.opt_dict


class FSDPResumePlan(ResumePlan):
    """:class:`ResumePlan` for a DCP load: the requests are DTensors keyed by their path, the
    record is read by the DCP load patch (:func:`prepare_fsdp_load`), Megatron's part moves
    under the key of the saved worker it is read from."""

    def __init__(self, optimizer, controller, megatron_part: dict, part: dict, space: DTensorSpace):
        self.optimizer = optimizer
        self.controller = controller
        self.space = space
        self.sharding_type = FSDP_DTENSOR
        self.layout = controller.layout
        self.state = {LOCAL_KEY: part}  # ResumePlan.part
        self.inner = megatron_part  # Megatron's {"state", "param_to_group_meta"}: in place
        self.inner_worker = 0
        self.opt_dict: dict = {}
        """What DCP loads into: Megatron's part (saved worker 0's) and the flat view of ``part``."""
        self.prepared = False
        self.mode: Optional[str] = None
        self.torchft = False
        self.source = 0
        self.saved: Optional[dict] = None
        self.residuals = False
        self.residual_workers: List[int] = []
        self.slice_loaded = False
        self.difference: Optional[str] = None
        self.identical: List[int] = []
        self.bias_tails: Dict[int, str] = {}
        self._retarget_inner(self.layout.worker)  # an exact resume, until the record says otherwise

    def sync_view(self) -> None:
        """Rebuild, in place, what DCP loads (Megatron-LM keeps a shallow copy of it)."""
        self.opt_dict.pop("state", None)
        self.opt_dict.pop("param_to_group_meta", None)
        flat = self.opt_dict.setdefault(LOCAL_KEY, {})
        flat.clear()
        part = {k: v for k, v in self.part.items() if not (self.prepared and k == "record")}
        dcp_view(part, flat)
        if self.inner_worker == 0:
            self.opt_dict.update(self.inner)
        else:
            flat[f"worker_{self.inner_worker}"] = self.inner
        if not flat:
            del self.opt_dict[LOCAL_KEY]

    def _retarget_inner(self, worker: int) -> None:
        """Read saved worker ``worker``'s Adam state and parameters (worker 0's parameters are
        the model's keys, which the model's own requests load)."""
        self.inner_worker = worker
        self.part.pop("mains", None)
        if worker:
            self.part["mains"] = self.space.load_requests(worker_param_prefix(worker))
        self.sync_view()

    def _mains_request(self, worker: int):
        return self.space.load_requests(worker_param_prefix(worker))

    def _bucket_mismatch(self, saved) -> Optional[str]:
        return None  # per-parameter DTensors: DCP reshards them

    def _fit_biases(self, saved: dict, outer: str, same_workers: bool, saved_workers: int) -> None:
        """The saved workers' expert biases: byte entries, read into ``part`` by their key."""
        keys = saved_bias_keys(self.controller, saved, outer, same_workers, saved_workers)
        self.bias_tails = {} if keys is None else {w: bias_tail(w, self.layout.dp_group_idx) for w in keys}
        for tail in self.bias_tails.values():
            self.part[tail] = b""

    def take_biases(self) -> None:
        """After the DCP load: ``part["expert_bias"]`` := {saved worker: its biases}."""
        flat = self.opt_dict.get(LOCAL_KEY) or {}
        loaded = {w: unblob(flat.get(tail)) for w, tail in self.bias_tails.items()}
        for tail in self.bias_tails.values():
            self.part.pop(tail, None)
        if loaded:
            self.part["expert_bias"] = loaded

    def decode_mains(self, loaded) -> List[Dict[int, torch.Tensor]]:
        out: List[Dict[int, torch.Tensor]] = [{} for _ in self.space.shards]
        for worker, entries in (loaded or {}).items():
            for slot, shard in enumerate(self.space.shards):
                flat = torch.zeros(shard.numel, dtype=torch.float32, device=shard.device)
                out[slot][worker] = self.space.assemble(entries, slot, flat)
        return out

    def adam_step(self, state_dict) -> int:
        steps = [int(s["step"]) for s in (self.inner.get("state") or {}).values()
                 if isinstance(s, dict) and torch.is_tensor(s.get("step"))]
        return max(steps, default=0)

    @torch.no_grad()
    def install_source_mains(self) -> None:
        """The parameters of the saved worker this worker reads (k >= 1: its own keys)."""
        mains = self.part.get("mains")
        if not mains:
            return
        for slot, shard in enumerate(self.space.shards):
            shard.write_mains(self.space.assemble(mains, slot, torch.empty(shard.numel, dtype=torch.float32,
                                                                           device=shard.device)))


def _find(node, target, path=()):
    """The key path to the object ``target`` inside nested dicts, or None."""
    if node is target:
        return path
    if isinstance(node, dict):
        for key, value in node.items():
            found = _find(value, target, path + (key,))
            if found is not None:
                return found
    return None


def _nest(path, leaf_key, value) -> dict:
    out = {leaf_key: value}
    for key in reversed(path):
        out = {key: out}
    return out


def prepare_fsdp_load(state_dict, checkpoint_dir) -> bool:
    """Inside the DCP load patch, before the load: fit every EDiT plan in ``state_dict`` to the
    checkpoint at ``checkpoint_dir`` (read its record first). A collective over the world group;
    raises :class:`CheckpointStateError` on every rank. False when ``state_dict`` holds no plan."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from .guard import _cause

    found = []
    for plan in list(PROCESS.checkpoint_plans.values()):
        path = None if plan.prepared else _find(state_dict, plan.opt_dict)
        if path is not None:
            found.append((plan, path))
    if not found:
        return False
    message = None
    try:
        metadata = FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - named below, on every rank
        metadata, message = {}, f"megatron_edit: checkpoint {checkpoint_dir} has no readable DCP metadata ({_cause(e)})."
    records = {}
    wanted = [(i, path) for i, (_, path) in enumerate(found) if ".".join(path + (LOCAL_KEY, "record")) in metadata]
    if wanted and message is None:
        request = {}
        for i, path in wanted:
            request.update(_nest(path + (LOCAL_KEY,), "record", b""))
        try:
            state_dict_loader.load(request, storage_reader=FileSystemReader(str(checkpoint_dir)))
            for i, path in wanted:
                node = request
                for key in path + (LOCAL_KEY,):
                    node = node[key]
                records[i] = unblob(node["record"])
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - garbled bytes, on every rank
            message = (f"megatron_edit: the EDiT record of checkpoint {checkpoint_dir} cannot be read "
                       f"({_cause(e)}): it is corrupted. Resume from another checkpoint.")
    for i, (plan, path) in enumerate(found):
        if message:
            plan.prepared = True
            continue
        head = ".".join(path) + "." if path else ""
        saved = {k[len(head):]: v for k, v in metadata.items() if k.startswith(head)}
        message = plan.prepare(records.get(i), saved)
        plan.sync_view()
        message = message or _missing(plan, saved, checkpoint_dir)
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, message)
    first = next(((r, m) for r, m in enumerate(messages) if m), None)
    if first:
        for plan, _ in found:
            PROCESS.checkpoint_plans.pop(plan.optimizer, None)
        raise CheckpointStateError(f"{first[1]} (found by rank {first[0]})")
    for plan, _ in found:
        _chunk_metadata(plan.opt_dict.get(LOCAL_KEY) or {})
    return True


def _missing(plan, saved: dict, checkpoint_dir) -> Optional[str]:
    """EDiT entries this load asks for that the checkpoint lacks or holds with another shape."""
    from torch.distributed.tensor import DTensor

    missing, mismatched = [], []

    def walk(node, path):
        for key, value in node.items():
            name = f"{path}.{key}" if path else str(key)
            if isinstance(value, dict):
                walk(value, name)
            elif name not in saved and not any(k.startswith(name + ".") for k in saved):
                missing.append(name)
            elif isinstance(value, DTensor) and hasattr(saved[name], "size") and \
                    tuple(saved[name].size) != tuple(value.shape):
                mismatched.append(f"{name}: {tuple(saved[name].size)} saved, {tuple(value.shape)} now")

    walk(plan.opt_dict.get(LOCAL_KEY) or {}, LOCAL_KEY)
    if mismatched:
        return (f"megatron_edit: the EDiT state in checkpoint {checkpoint_dir} does not fit this run's model "
                f"(different shapes): {mismatched[:3]}")
    if missing:
        return (f"megatron_edit: the EDiT state in checkpoint {checkpoint_dir} is incomplete or corrupted: "
                f"{len(missing)} entries missing, e.g. {missing[:3]}.")
    return None


def _chunk_metadata(flat: dict) -> None:
    """Megatron-FSDP's uneven-shard metadata for the requests the fit added (a collective inside
    the worker, in the same order on its ranks)."""
    from torch.distributed.tensor import DTensor
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        update_uneven_dtensor_chunk_metadata,
    )

    def walk(node):
        for key in sorted(node, key=str):
            value = node[key]
            if isinstance(value, dict):
                walk(value)
            elif isinstance(value, DTensor) and not hasattr(value._local_tensor, "__create_chunk_list__"):
                update_uneven_dtensor_chunk_metadata(value)

    walk(flat)


def load_fsdp_state(optimizer, controller, load) -> None:
    """``load_state_dict`` of an EDiT optimizer on Megatron-FSDP, after the DCP load: ``load``
    (Megatron's, given Megatron's part) restores the Adam state; then the parameters and EDiT's
    state."""
    from .state import load_local_sgd_state

    plan = PROCESS.checkpoint_plans.pop(optimizer, None)
    if plan is None or not plan.prepared:
        raise CheckpointStateError(
            "megatron_edit: this EDiT optimizer state (Megatron-FSDP, fsdp_dtensor) was loaded without "
            "megatron_edit's patch of torch.distributed.checkpoint.load, which fits the load to the "
            "checkpoint: call torch.distributed.checkpoint.load (or load_state_dict) after "
            "patch_megatron_for_local_sgd, as the module, not a name imported before.")
    load(dict(plan.inner))  # a copy: Megatron-FSDP's load rewrites its argument
    if plan.mode != "synchronous":
        plan.install_source_mains()
        if "slice" in plan.part:
            plan.part["slice"] = unblob((plan.opt_dict.get(LOCAL_KEY) or {}).get("slice"))
        plan.take_biases()
    load_local_sgd_state(optimizer, controller, plan.part, plan.inner, plan=plan)
