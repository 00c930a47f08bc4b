"""The one session object of this process: all the process-global state of megatron_edit's
attachment to Megatron (patching Megatron is process-global by nature).

:data:`SESSION` holds

* ``runtime``: the :class:`~megatron_edit.mcore.runtime.LocalSGDRuntime` the megatron-core
  wraps consult (None while unpatched);
* ``registry`` / ``fixes_registry``: the :class:`~megatron_edit.mcore.wrap_registry.PatchRegistry`
  that applied every wrap (megatron-core's, the checkpoint wraps, Megatron-LM's training wraps),
  and the one of megatron-core's load fixes alone (plain Megatron);
* ``cpu_registry`` / ``cpu_training_registry``: the replacements of
  :mod:`megatron_edit.cpu.adapter` and :mod:`megatron_edit.cpu.training_adapter` (CPU only);
* ``training_log``: the console-line state of :func:`megatron_edit.training.training_wraps.native_training_log`
  (typed loosely: this layer does not import the training layer; it sets it);
* ``process``: the state that outlives a patch session (checkpoint captures, the instance
  groups built on 0.12.x, the count of controllers built that keys their arrival checks), kept
  in :mod:`megatron_edit.mcore.process_state` because :mod:`.compat`, :mod:`.controller` and
  :mod:`.checkpoint.resume` use it and this module imports them (through :mod:`.runtime`).

:mod:`megatron_edit.api` opens and closes the patch session; the layers above megatron-core's
(the CPU adapters, Megatron-LM's training integration) read and keep their state here, so
nothing imports the API module back and no layer imports one above it.
"""

from __future__ import annotations

from typing import Any, Optional

from .wrap_registry import PatchRegistry
from .process_state import PROCESS, ProcessState
from .runtime import LocalSGDRuntime


class Session:
    runtime: Optional[LocalSGDRuntime] = None
    registry: Optional[PatchRegistry] = None
    fixes_registry: Optional[PatchRegistry] = None
    """megatron-core's load fixes alone (plain Megatron); the full registry includes them."""
    cpu_registry: Optional[PatchRegistry] = None
    """:mod:`megatron_edit.cpu.adapter`'s replacements (megatron-core and torch on CPU)."""
    cpu_training_registry: Optional[PatchRegistry] = None
    """:mod:`megatron_edit.cpu.training_adapter`'s wraps (Megatron-LM's training code on CPU)."""
    training_log: Any = None
    """:mod:`megatron_edit.training.training_wraps`' state between a forked ``training_log`` and its
    console line (created there on first use)."""
    process: ProcessState = PROCESS
    """What outlives a patch session (:mod:`megatron_edit.mcore.process_state`)."""


SESSION = Session()


def current_runtime() -> Optional[LocalSGDRuntime]:
    return SESSION.runtime
