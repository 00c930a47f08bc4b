"""EDiT state in Megatron-FSDP's ``fsdp_dtensor`` checkpoints (``torch.distributed.checkpoint``).

Megatron-FSDP saves with ``torch.distributed.checkpoint`` (DCP) a state dict of DTensors: the
model's (``model.state_dict()``: each parameter's fp32 main-weight shard) and the optimizer's
(``sharded_state_dict(..., metadata={'distrib_optim_sharding_type': 'fsdp_dtensor'})``: Adam's
state per parameter). It is the only format Megatron-LM allows with ``--use-megatron-fsdp``
(``--ckpt-format fsdp_dtensor``). In HSDP a parameter is ``[Replicate(), Shard(0)]`` over
(instances, shards): DCP writes one instance's copy of each shard, whichever its planner picks.
Between EDiT syncs the workers (instances) differ, so worker k's parameters and Adam state get
keys of their own, as in :mod:`.state` for ``torch_dist``:

=============================================  =======================================  =========
key (DCP path)                                 content                                  written by
=============================================  =======================================  =========
``model.*`` (Megatron's)                       worker 0's parameters                    worker 0
``optimizer.state.*``, ``...param_to_group_    worker 0's Adam state (Megatron's)       worker 0
meta.*``
``optimizer.local_sgd.worker_<k>.state.*``     worker k's Adam state, k >= 1             worker k
``optimizer.local_sgd.worker_<k>.param.<n>``   worker k's parameters, k >= 1             worker k
``optimizer.local_sgd.anchor.<n>``             the anchor                                worker 0
``optimizer.local_sgd.outer.<state>.<n>``      outer optimizer state (e.g. momentum)     worker 0
``optimizer.local_sgd.residual.worker_<k>.``   error feedback: worker k's residual       worker k
``optimizer.local_sgd.result_residual.<n>``    error feedback: the reduced result's      worker 0
``optimizer.local_sgd.in_flight[_launch]...``  a delayed outer step in flight            as torch_dist
``optimizer.local_sgd.record`` / ``.slice``    run record, ``LocalSGD.extra_state()``    rank 0
=============================================  =======================================  =========

``<n>`` is Megatron's name of the parameter (its ``optimizer.state`` key). Every EDiT tensor is a
DTensor with the parameter's own mesh, placements and uneven shard layout: a view of the flat
per-bucket tensor (:class:`DTensorSpace`), so DCP reshards it like the parameter (another number
of ranks per worker). At save, worker k >= 1's DTensors are dropped from the model's state dict
passed to the optimizer (Megatron-LM passes its whole state dict), so the shared model keys hold
worker 0's parameters; a save without the model's state dict is refused.

Loading: the optimizer's ``sharded_state_dict(is_loading=True)`` asks for an exact resume and
keeps a :class:`FSDPResumePlan`; megatron_edit's patch of ``torch.distributed.checkpoint.load``
(and of the deprecated ``load_state_dict`` Megatron-LM 0.16 calls) reads the record first and fits
the requests to the checkpoint: :class:`~megatron_edit.mcore.checkpoint.resume.ResumePlan`'s rules
(the same workers; another number of workers with one outer step at load; a checkpoint of
synchronous Megatron-FSDP training), with a missing or misshapen entry named in one line on every
rank before anything large is read. ``load_state_dict`` then restores the worker's Adam state,
its parameters and EDiT's state (:func:`~.state.load_local_sgd_state`). A megatron-core user calls
DCP as Megatron-LM does::

    sd = {"model": model.state_dict()}
    sd["optimizer"] = opt.sharded_state_dict(sd, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    preprocess_state_dict_for_uneven_dtensor(sd)     # Megatron-FSDP's own requirement
    torch.distributed.checkpoint.save(sd, checkpoint_id=path)
    # resume, in a fresh process: the same with is_loading=True, then
    torch.distributed.checkpoint.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"]); opt.load_state_dict(sd["optimizer"])
"""

from __future__ import annotations

import io
from typing import Dict, List, Optional

import torch

from ..process_state import PROCESS
from .keys import PREFIX, CheckpointStateError
from .record import outer_state_keys, run_record, slice_record
from .resume import ANCHOR, IN_FLIGHT, RESULT_RESIDUAL, ResumePlan, launch_prefix, outer_prefix, residual_prefix

FSDP_DTENSOR = "fsdp_dtensor"
"""Megatron's name of this optimizer format (``distrib_optim_sharding_type``)."""
_LOCAL = PREFIX.rstrip(".")  # the optimizer state dict's key of EDiT's part


def worker_param_prefix(worker: int) -> str:
    """Saved worker ``worker``'s parameters (k >= 1; worker 0's are the model's keys)."""
    return f"{PREFIX}worker_{worker}.param."


def _blob(obj) -> bytes:
    """A record as one DCP entry (DCP would split a dict into one entry per leaf)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unblob(data):
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise CheckpointStateError("megatron_edit: the checkpoint's EDiT record was not read: it is corrupted.")
    return torch.load(io.BytesIO(data), weights_only=False)


class _Entries(dict):
    """{parameter name: DTensor} of one kind of EDiT tensor, with the checkpoint-key prefix of
    that kind (the part after ``local_sgd.``)."""

    def __init__(self, tail: str, items=()):
        super().__init__(items)
        self.tail = tail


class DTensorSpace:
    """One optimizer's EDiT shards (:class:`~megatron_edit.exchange.shard.BucketShard`, flat per
    Megatron-FSDP bucket) seen per parameter as DTensors shaped like Megatron-FSDP's: the
    ``ModelSpace`` of :mod:`.space` for DCP. A parameter's local tensor is a view of its bucket's
    main-weight shard; its offset there places it in every other flat tensor of the bucket."""

    def __init__(self, optimizer, shards):
        self.shards = list(shards)
        bases = [(s.flat_mains.data_ptr(), s.flat_mains.numel(), s.flat_mains.element_size()) for s in self.shards]
        self.params = []  # (name, param, slot, start): slot None for an empty local shard
        for group in optimizer.optimizer.param_groups:
            for p in group["params"]:
                local = p.to_local()
                slot = start = None
                if local.numel():
                    ptr = local.data_ptr()
                    found = [(i, (ptr - b) // e) for i, (b, n, e) in enumerate(bases) if b <= ptr < b + n * e]
                    if len(found) != 1 or not local.is_contiguous():
                        raise RuntimeError(
                            "megatron_edit: a Megatron-FSDP optimizer parameter is not a view of its "
                            "bucket's main-weight shard: this megatron-core changed Megatron-FSDP's buffers.")
                    slot, start = found[0]
                self.params.append((optimizer._param_name(p), p, slot, start))

    @staticmethod
    def _dtensor(param, local: torch.Tensor):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.view(param.to_local().shape), device_mesh=param.device_mesh,
                                  placements=param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())

    def _tail(self, prefix: str) -> str:
        assert prefix.startswith(PREFIX)
        return prefix[len(PREFIX):]

    def save_entries(self, prefix: str, tensors, replica_last: int) -> _Entries:
        """DTensors viewing one flat tensor per shard (None: zeros); empty unless
        ``replica_last`` is 0 (only worker 0 writes what every worker holds)."""
        out = _Entries(self._tail(prefix))
        if replica_last != 0:
            return out
        for name, param, slot, start in self.params:
            n = param.to_local().numel()
            flat = tensors[slot] if slot is not None else None
            if flat is None:
                local = torch.zeros(n, dtype=torch.float32, device=param.device)
            else:
                local = flat.view(-1)[start : start + n]
            out[name] = self._dtensor(param, local)
        return out

    def load_requests(self, prefix: str, main: bool = True) -> _Entries:
        """Fresh DTensors to load one kind of EDiT tensor into (``main``: unused, every
        request is a read)."""
        return _Entries(self._tail(prefix), (
            (name, self._dtensor(param, torch.zeros(param.to_local().numel(), dtype=torch.float32,
                                                    device=param.device)))
            for name, param, _, _ in self.params))

    @torch.no_grad()
    def assemble(self, loaded: dict, slot: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` (shard-length) := the loaded parameters of shard ``slot``, 0 elsewhere."""
        out.zero_()
        for name, param, s, start in self.params:
            if s == slot:
                local = loaded[name].to_local().reshape(-1)
                out[start : start + local.numel()].copy_(local)
        return out


def _view(part: dict, flat: Optional[dict] = None) -> dict:
    """The DCP-facing dict of EDiT's nested ``part``: {key after ``local_sgd.``: DTensor or bytes}."""
    flat = {} if flat is None else flat
    for key, value in part.items():
        if isinstance(value, _Entries):
            for name, tensor in value.items():
                flat[value.tail + name] = tensor
        elif isinstance(value, dict):
            _view(value, flat)
        elif isinstance(value, (bytes, bytearray)):
            flat[key] = value
    return flat


# --------------------------------------------------------------------------- save
def fsdp_sharded_state_dict(optimizer, controller, state: dict, model_state, is_loading: bool) -> dict:
    """The optimizer's ``fsdp_dtensor`` state dict with EDiT's part (see the module docstring);
    for loading, the exact-resume requests (fitted to the checkpoint by the DCP load patch)."""
    from .state import _result_residuals

    space = DTensorSpace(optimizer, controller.shards)
    layout = controller.layout
    tensor_keys, _ = outer_state_keys(controller)
    residuals = controller.config.error_feedback and any(
        controller.chunk_span(s) is not None for s in controller.shards)
    if is_loading:
        part = dict(record=b"", slice=b"", anchor=space.load_requests(ANCHOR),
                    outer={k: space.load_requests(outer_prefix(k)) for k in tensor_keys})
        if residuals:
            part["result_residual"] = space.load_requests(RESULT_RESIDUAL)
        plan = FSDPResumePlan(optimizer, controller, state, part, space)
        PROCESS.checkpoint_plans[optimizer] = plan
        return plan.opt_dict
    delayed = getattr(controller, "delayed", None)
    flight = delayed.checkpoint_state() if delayed is not None else None
    part: dict = {}
    # Built on every rank (they may hold collectives), written by rank 0 alone.
    record = run_record(optimizer, controller, layout, FSDP_DTENSOR, residuals, flight[0] if flight else None)
    slice_ = slice_record(controller)
    if torch.distributed.get_rank() == 0:
        part["record"], part["slice"] = _blob(record), _blob(slice_)
    controller.outer_state.synchronize()  # offloaded state: no copy in flight while we read it
    outer = controller.outer_optimizer
    if outer is not None:
        part["anchor"] = space.save_entries(ANCHOR, [s.anchor for s in controller.shards], layout.worker)
        present = {k for s in controller.shards for k in outer.state.get(s.anchor, {}) if k in tensor_keys}
        part["outer"] = {k: space.save_entries(outer_prefix(k), [outer.state.get(s.anchor, {}).get(k)
                                                                 for s in controller.shards], layout.worker)
                         for k in sorted(present)}
    if flight is not None:
        part["in_flight"] = space.save_entries(IN_FLIGHT, [d for d, _ in flight[1]], layout.worker)
        if flight[0]["keep"]:
            part["in_flight_launch"] = space.save_entries(launch_prefix(layout.worker), [p for _, p in flight[1]], 0)
    if residuals:
        part["residual"] = space.save_entries(residual_prefix(layout.worker), [s.residual for s in controller.shards], 0)
        part["result_residual"] = space.save_entries(RESULT_RESIDUAL, _result_residuals(controller), layout.worker)
    if layout.worker == 0:
        return dict(state, **{_LOCAL: _view(part)})
    part["mains"] = space.save_entries(worker_param_prefix(layout.worker), [s.flat_mains for s in controller.shards], 0)
    _drop_model_dtensors(model_state, layout.worker)
    flat = _view(part)
    flat[f"worker_{layout.worker}"] = state  # Megatron's own part, under this worker's keys
    return {_LOCAL: flat}


def _drop_model_dtensors(model_state, worker: int) -> None:
    """Worker k >= 1: its parameters are saved under its own keys, not under the model's."""
    from torch.distributed.tensor import DTensor

    dropped = 0

    def walk(node):
        nonlocal dropped
        for key in list(node):
            value = node[key]
            if isinstance(value, DTensor):
                del node[key]
                dropped += 1
            elif isinstance(value, dict) and key != "optimizer":
                walk(value)

    if isinstance(model_state, dict):
        walk(model_state)
    if not dropped:
        raise CheckpointStateError(
            f"megatron_edit: saving EDiT worker {worker}'s optimizer on Megatron-FSDP needs the model's state "
            "dict: pass the dict holding 'model': model.state_dict() to the optimizer's sharded_state_dict "
            "(as Megatron-LM does), so that this worker's parameters are not written under the model's keys.")


# --------------------------------------------------------------------------- load
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
        self.state = {_LOCAL: part}  # ResumePlan.part
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
        self._retarget_inner(self.layout.worker)  # an exact resume, until the record says otherwise

    def sync_view(self) -> None:
        """Rebuild, in place, what DCP loads (Megatron-LM keeps a shallow copy of it)."""
        self.opt_dict.pop("state", None)
        self.opt_dict.pop("param_to_group_meta", None)
        flat = self.opt_dict.setdefault(_LOCAL, {})
        flat.clear()
        part = {k: v for k, v in self.part.items() if not (self.prepared and k == "record")}
        _view(part, flat)
        if self.inner_worker == 0:
            self.opt_dict.update(self.inner)
        else:
            flat[f"worker_{self.inner_worker}"] = self.inner
        if not flat:
            del self.opt_dict[_LOCAL]

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

    found = []
    for optimizer, plan in list(PROCESS.checkpoint_plans.items()):
        path = None if plan.prepared else _find(state_dict, plan.opt_dict)
        if path is not None:
            found.append((plan, path))
    if not found:
        return False
    message = None
    try:
        metadata = FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - named below, on every rank
        metadata, message = {}, f"megatron_edit: checkpoint {checkpoint_dir} has no readable DCP metadata ({e})."
    records = {}
    wanted = [(i, path) for i, (_, path) in enumerate(found) if ".".join(path + (_LOCAL, "record")) in metadata]
    if wanted and message is None:
        request = {}
        for i, path in wanted:
            request.update(_nest(path + (_LOCAL,), "record", b""))
        try:
            state_dict_loader.load(request, storage_reader=FileSystemReader(str(checkpoint_dir)))
            for i, path in wanted:
                node = request
                for key in path + (_LOCAL,):
                    node = node[key]
                records[i] = _unblob(node["record"])
        except (Exception, BaseException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            message = (f"megatron_edit: the EDiT record of checkpoint {checkpoint_dir} cannot be read ({e}): it "
                       "is corrupted. Resume from another checkpoint.")
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
        _chunk_metadata(plan.opt_dict.get(_LOCAL) or {})
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

    walk(plan.opt_dict.get(_LOCAL) or {}, _LOCAL)
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
            plan.part["slice"] = _unblob((plan.opt_dict.get(_LOCAL) or {}).get("slice"))
    load_local_sgd_state(optimizer, controller, plan.part, plan.inner, plan=plan)
