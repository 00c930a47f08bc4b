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
``optimizer.local_sgd.expert_bias.worker_<k>.  worker k's MoE router expert biases        worker k
dp_group_idx_<g>``                             (bytes; ``.expert_bias``'s rules at load)
``optimizer.local_sgd.record`` / ``.slice``    run record, ``LocalSGD.extra_state()``    rank 0
=============================================  =======================================  =========

``<n>`` is Megatron's name of the parameter (its ``optimizer.state`` key). Every EDiT tensor is a
DTensor with the parameter's own mesh, placements and uneven shard layout: a view of the flat
per-bucket tensor (:class:`DTensorSpace`), so DCP reshards it like the parameter (another number
of ranks per worker). At save, worker k >= 1's DTensors are dropped from the model's state dict
passed to the optimizer (Megatron-LM passes its whole state dict), so the shared model keys hold
worker 0's parameters; a save without the model's state dict is refused.

Loading is :mod:`.fsdp_load`'s. A megatron-core user calls DCP as Megatron-LM does::

    sd = {"model": model.state_dict()}
    sd["optimizer"] = opt.sharded_state_dict(sd, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    preprocess_state_dict_for_uneven_dtensor(sd)     # Megatron-FSDP's own requirement
    torch.distributed.checkpoint.save(sd, checkpoint_id=path)
    # resume, in a fresh process: the same with is_loading=True, then
    torch.distributed.checkpoint.load(sd, checkpoint_id=path)
    model.module.load_state_dict(sd["model"]); opt.load_state_dict(sd["optimizer"])
"""

from __future__ import annotations

import io
from typing import Optional

import torch

from .keys import PREFIX, CheckpointStateError
from .constant import put, varying_entries
from .expert_bias import bias_key, values as bias_values
from .record import outer_state_keys, run_record, slice_record
from .keys import RESULT_RESIDUAL, residual_prefix

FSDP_DTENSOR = "fsdp_dtensor"
"""Megatron's name of this optimizer format (``distrib_optim_sharding_type``)."""
LOCAL_KEY = PREFIX.rstrip(".")  # the optimizer state dict's key of EDiT's part


def bias_tail(worker: int, dp_group_idx: int) -> str:
    """Worker ``worker``'s expert biases: their key after ``local_sgd.`` (a byte entry)."""
    return bias_key(worker, dp_group_idx)[len(PREFIX):]


def worker_param_prefix(worker: int) -> str:
    """Saved worker ``worker``'s parameters (k >= 1; worker 0's are the model's keys)."""
    return f"{PREFIX}worker_{worker}.param."


def blob(obj) -> bytes:
    """A record as one DCP entry (DCP would split a dict into one entry per leaf)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unblob(data):
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
        """DTensors viewing one flat tensor per shard (None for a shard, or ``tensors`` None:
        zeros, placeholders of :mod:`.constant`); empty unless ``replica_last`` is 0 (only
        worker 0 writes what every worker holds)."""
        out = _Entries(self._tail(prefix))
        if replica_last != 0:
            return out
        for name, param, slot, start in self.params:
            n = param.to_local().numel()
            flat = tensors[slot] if slot is not None and tensors is not None else None
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


def dcp_view(part: dict, flat: Optional[dict] = None) -> dict:
    """The DCP-facing dict of EDiT's nested ``part``: {key after ``local_sgd.``: DTensor or bytes}."""
    flat = {} if flat is None else flat
    for key, value in part.items():
        if isinstance(value, _Entries):
            for name, tensor in value.items():
                flat[value.tail + name] = tensor
        elif isinstance(value, dict):
            dcp_view(value, flat)
        elif isinstance(value, (bytes, bytearray)):
            flat[key] = value
    return flat


# --------------------------------------------------------------------------- save
def has_residuals(controller) -> bool:
    """Error feedback's residuals are saved (a quantized or sparse exchange with it)."""
    return controller.config.error_feedback and any(controller.chunk_span(s) is not None for s in controller.shards)


def fsdp_save_state_dict(optimizer, controller, state: dict, model_state) -> dict:
    """The optimizer's ``fsdp_dtensor`` state dict for a save (``state``: Megatron's), with
    EDiT's part (see the module docstring)."""
    from .state import _result_residuals

    space = DTensorSpace(optimizer, controller.shards)
    layout = controller.layout
    tensor_keys, _ = outer_state_keys(controller)
    residuals = has_residuals(controller)
    delayed = getattr(controller, "delayed", None)
    flight = delayed.checkpoint_state() if delayed is not None else None
    part: dict = {}
    # Built on every rank (they may hold collectives), written by rank 0 alone.
    record = run_record(optimizer, controller, layout, FSDP_DTENSOR, residuals, flight[0] if flight else None)
    slice_ = slice_record(controller)
    if torch.distributed.get_rank() == 0:
        part["record"], part["slice"] = blob(record), blob(slice_)
    controller.outer_state.synchronize()  # offloaded state: no copy in flight while we read it
    # Every kind, in every checkpoint of the run: placeholders where it holds nothing (.constant).
    for path, (prefix, tensors, replica_last) in varying_entries(controller, tensor_keys, flight).items():
        put(part, path, space.save_entries(prefix, tensors, replica_last))
    if residuals:
        part["residual"] = space.save_entries(residual_prefix(layout.worker), [s.residual for s in controller.shards], 0)
        part["result_residual"] = space.save_entries(RESULT_RESIDUAL, _result_residuals(controller), layout.worker)
    biases = bias_values(controller)  # MoE router expert biases: every worker's own, by one of its ranks
    if biases is not None and layout.intra_rank == 0:
        part[bias_tail(layout.worker, layout.dp_group_idx)] = blob(biases)
    if layout.worker == 0:
        return dict(state, **{LOCAL_KEY: dcp_view(part)})
    part["mains"] = space.save_entries(worker_param_prefix(layout.worker), [s.flat_mains for s in controller.shards], 0)
    _drop_model_dtensors(model_state, layout.worker)
    flat = dcp_view(part)
    flat[f"worker_{layout.worker}"] = state  # Megatron's own part, under this worker's keys
    return {LOCAL_KEY: flat}


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


