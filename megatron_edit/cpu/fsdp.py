"""The CPU adapter's Megatron-FSDP patches (megatron-core's ``megatron/core/distributed/fsdp``).

Megatron-FSDP hard-codes CUDA in two places the rest of the adapter does not cover; both are
declared here for the releases of :data:`~megatron_edit.mcore.releases.FSDP_SUPPORTED` only
(0.16.1-0.19.x), where they were checked (on another release they are not applied, and EDiT on
Megatron-FSDP is refused there with a message naming the supported releases):

* S1, ``MegatronFSDP.__init__`` builds ``torch.device(f"cuda:{torch.cuda.current_device()}")``
  even when a device is given. The adapter makes ``current_device()`` the CPU device, which gives
  the invalid string ``"cuda:cpu"``. Inside that constructor only, ``current_device()`` returns
  the ordinal 0: the string parses, and ``device=0`` allocations still land on the CPU through
  the adapter's factory wraps. Megatron-FSDP's warning on every rank that it uses the CPU device
  it was given "instead of the current device cuda:0" is dropped there (it is what the adapter
  asks for).
* S3, ``FullyShardedDataParallel.__init__`` without a device (Megatron-LM's ``get_model`` gives
  none) takes ``cuda:{current_device()}``; the CPU device is given instead, and
  ``gradient_reduce_div_fusion`` is turned off (gloo has no ``PREMUL_SUM``).
* S2, ``mcore_fsdp_adapter`` builds its device meshes with ``DeviceMesh.from_group(...,
  device_type="cuda")``; ``DTensor.from_local`` then moves every main-weight shard to CUDA. The
  name ``DeviceMesh`` in that module is replaced by a stand-in whose ``from_group`` builds a CPU
  mesh.

Not a patch: gloo has no ``PREMUL_SUM`` and no ``AVG``, so a CPU run sets
``DistributedDataParallelConfig(gradient_reduce_div_fusion=False, average_in_collective=False)``
(the buffer is multiplied by the scale, then SUM-reduced: the same numbers), and passes
``device=torch.device("cpu")`` to ``FullyShardedDataParallel``.

Applied and reverted with the rest of :mod:`megatron_edit.cpu.adapter`.
"""

from __future__ import annotations

import logging

import torch

from ..mcore.releases import FSDP_SUPPORTED
from ..mcore.wrap_registry import Patch, PatchRegistry

_MEGATRON_FSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp:MegatronFSDP"
_ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"


def _ordinal_device_while_building(original):
    """S1: inside ``MegatronFSDP.__init__``, ``torch.cuda.current_device()`` is the ordinal 0 (a
    ``"cuda:0"`` string parses; allocations on device 0 are CPU ones under the adapter)."""

    def __init__(self, *args, **kwargs):
        current = torch.cuda.current_device
        torch.cuda.current_device = _ordinal_zero
        log = logging.getLogger(original.__module__)
        log.addFilter(_not_the_cpu_device_note)
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current
            log.removeFilter(_not_the_cpu_device_note)

    return __init__


def _not_the_cpu_device_note(record: logging.LogRecord) -> bool:
    """Drops Megatron-FSDP's note that it uses the CPU device instead of ``cuda:0`` (S1)."""
    return "using device cpu instead of the current device" not in record.getMessage()


def _ordinal_zero():
    return 0


class CpuDeviceMesh:
    """S2: stands for ``torch.distributed.DeviceMesh`` inside ``mcore_fsdp_adapter``; a mesh asked
    for on ``"cuda"`` is built on the CPU (DTensors of a CUDA mesh move their shards to CUDA)."""

    @staticmethod
    def from_group(*args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh

        if kwargs.get("device_type") == "cuda":
            kwargs["device_type"] = "cpu"
        return DeviceMesh.from_group(*args, **kwargs)


def _cpu_device_and_no_div_fusion(original):
    """S3: ``FullyShardedDataParallel`` built without a device (Megatron-LM's ``get_model``)
    takes ``cuda:{current_device()}``, the invalid ``"cuda:cpu"`` under the adapter: the CPU
    device is given instead. And gloo has no ``PREMUL_SUM``: the gradient scale is applied to the
    buffer before a SUM (``gradient_reduce_div_fusion=False``, the same numbers)."""

    def __init__(self, config, ddp_config, module, *args, **kwargs):
        if len(args) < 3 and kwargs.get("device") is None:
            kwargs["device"] = torch.device("cpu")
        if getattr(ddp_config, "gradient_reduce_div_fusion", False):
            ddp_config.gradient_reduce_div_fusion = False
        return original(self, config, ddp_config, module, *args, **kwargs)

    return __init__


def declare_fsdp(registry: PatchRegistry) -> None:
    """Add the Megatron-FSDP patches to ``registry`` (the adapter's); they apply on the releases
    of :data:`FSDP_SUPPORTED` only."""
    registry.add(Patch(
        "cpu-fsdp-device-string", f"{_MEGATRON_FSDP}.__init__", _ordinal_device_while_building,
        FSDP_SUPPORTED, ("self", "module", "dist_index", "ddp_config"),
        "Megatron-FSDP on CPU: current_device() is the ordinal 0 while MegatronFSDP is built"))
    registry.add(Patch(
        "cpu-fsdp-adapter-device", f"{_ADAPTER}:FullyShardedDataParallel.__init__", _cpu_device_and_no_div_fusion,
        FSDP_SUPPORTED, ("self", "config", "ddp_config", "module"),
        "Megatron-FSDP on CPU: built on the CPU device when none is given; no PREMUL_SUM (gloo)"))
    registry.add(Patch.replacing(
        "cpu-fsdp-device-mesh", f"{_ADAPTER}:DeviceMesh", CpuDeviceMesh, FSDP_SUPPORTED,
        "Megatron-FSDP on CPU: its device meshes are CPU meshes"))
