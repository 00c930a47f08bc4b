"""Run Megatron-LM's training code (``megatron.training``, ``pretrain_gpt.py``) on CPU over gloo.

CPU / gloo only, for the end-to-end tests and for trying the ``pretrain_gpt.py`` route on a
machine without a GPU. It must never be active on a GPU run: :func:`activate` refuses when
``torch.cuda.is_available()``.

:mod:`megatron_edit.cpu.adapter` already makes megatron-core run on CPU (device, RNG, streams,
type names; it also reports one CUDA device, which Megatron-LM's ``initialize`` needs to set up
model parallelism and seeds). On top of that, Megatron-LM's training code needs:

* ``initialize_megatron(allow_no_cuda=True)``: otherwise it asserts "Megatron requires CUDA".
  Wrapped where it is looked up (``megatron.training.training`` and ``.initialize``); its
  parameters differ between releases (:data:`megatron_edit.mcore.compat.TRAINING_SIGNATURES`).
* ``fused_kernels.load`` (core_v0.16 only; ``megatron.legacy`` is gone since core_v0.17): builds
  CUDA kernels with nvcc; there is nothing to build on CPU.
* ``get_device_arch_version`` (called with TP or CP > 1 in ``validate_args``): there is no device
  to query; reported as 0 (pre-Blackwell), so Megatron expects ``CUDA_DEVICE_MAX_CONNECTIONS=1``,
  which :func:`prepare_environment` sets (it also turns ``torch.compile`` off, see there).

Not here: skipping ``compile_helpers``' ``make`` when the compiled dataset helpers are
importable is needed on GPUs too (the megatron-core wheel has no Makefile), so it is the
``lm-compile-helpers`` patch of :mod:`megatron_edit.training.training_wraps`, which the launcher applies
on every device.

Also needed, outside this module: ``psutil`` installed (the async checkpoint writer dies
without it and the run hangs), and Megatron-LM's own Python dependencies (see
``scripts/requirements-megatron-lm.txt``).

Every replacement is a declared :class:`~megatron_edit.mcore.wrap_registry.Patch` of the package's one
patch engine (its registry kept in :data:`megatron_edit.mcore.session.SESSION`);
:func:`deactivate` undoes them (and :func:`megatron_edit.cpu.adapter.deactivate` the
megatron-core part).
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import List

import torch

from . import adapter as cpu_adapter
from ..mcore import compat
from ..mcore.wrap_registry import Patch, PatchRegistry
from ..mcore.session import SESSION

__all__ = ["activate", "deactivate", "is_active"]

# Written against Megatron-LM core_v0.16.1 and core_v0.19.0 (their megatron-core: 0.16.1, 0.19.x);
# the releases between differ only in what compat.TRAINING_SIGNATURES lists.
SUPPORTED = compat.TRAINING_SUPPORTED

def is_active() -> bool:
    # The registry lives in the process's session object (megatron_edit.mcore.session).
    return SESSION.cpu_training_registry is not None and SESSION.cpu_training_registry.is_applied()


def _allow_no_cuda(original):
    # allow_no_cuda is the fourth parameter until 0.18, the first since (compat).
    signature = inspect.signature(original)

    def initialize_megatron(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return original(*bound.args, **bound.kwargs)

    return initialize_megatron


def _no_fused_kernels(original):
    def load(args):
        return None  # CUDA kernels; nothing to build or load on CPU

    return load


def _no_device_arch(original):
    def get_device_arch_version():
        return 0  # no GPU: behave as a pre-Blackwell device (CUDA_DEVICE_MAX_CONNECTIONS=1)

    return get_device_arch_version


def _build_registry() -> PatchRegistry:
    registry = PatchRegistry()
    installed = compat.megatron_core_version()

    def add(pid, target, wrap, description, names=None):
        versions = compat.release_range(target) if names is None else SUPPORTED
        if names is None:
            names = compat.params(target) if versions.contains(installed) else ()
        registry.add(Patch(pid, target, wrap, versions, names, description))

    for where in ("training", "initialize"):
        add(f"cpu-initialize-megatron-{where}", f"megatron.training.{where}:initialize_megatron",
            _allow_no_cuda, "CPU: initialize_megatron(allow_no_cuda=True)")
    # Gone with megatron.legacy (core_v0.17+; no wheel ships it).
    add("cpu-fused-kernels", "megatron.legacy.fused_kernels:load", _no_fused_kernels,
        "CPU: no CUDA kernels to build")
    add("cpu-device-arch", "megatron.training.arguments:get_device_arch_version", _no_device_arch,
        "CPU: no device to query; report a pre-Blackwell architecture", names=())
    return registry


def prepare_environment() -> None:
    """Environment for a CPU run; call before megatron is imported (``activate`` calls it too).

    ``CUDA_DEVICE_MAX_CONNECTIONS=1``: what Megatron expects of a pre-Blackwell device; 8 with
    ``--use-megatron-fsdp`` on the command line (Megatron-LM asserts more than one for
    Megatron-FSDP, whose side streams are inert on the CPU).
    ``TORCH_COMPILE_DISABLE=1``: Megatron's fused bias-GeLU / bias-dropout-add are
    ``torch.compile``d and warmed up at start-up; on CPU, compiling them costs each rank seconds
    of its few cores (a 4-rank tiny run: 54 s -> 23 s wall) for no gain. Both only when unset.
    """
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "8" if "--use-megatron-fsdp" in sys.argv else "1")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    dynamo_config = sys.modules.get("torch._dynamo.config")
    if dynamo_config is not None and os.environ["TORCH_COMPILE_DISABLE"] == "1":
        dynamo_config.disable = True  # already imported: the variable was read before


def activate() -> List[str]:
    """Make Megatron-LM's training code run on CPU (idempotent); returns the patch ids applied.

    Activates :mod:`megatron_edit.cpu.adapter` too. Refuses when CUDA is available.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_edit.cpu.training_adapter must never be active when CUDA is available"
        )
    prepare_environment()
    cpu_adapter.activate()
    if SESSION.cpu_training_registry is None:
        SESSION.cpu_training_registry = _build_registry()
    return SESSION.cpu_training_registry.apply(compat.megatron_core_version())


def deactivate() -> None:
    """Undo :func:`activate` (both adapters; the environment variables stay). A no-op when not
    active."""
    if SESSION.cpu_training_registry is not None:
        SESSION.cpu_training_registry.revert()
    cpu_adapter.deactivate()
