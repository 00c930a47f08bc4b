"""The per-process state of the megatron-core attachment that outlives one patch session.

One :class:`ProcessState` per process (:data:`PROCESS`), reachable as
``megatron_edit.mcore.session.SESSION.process``. It sits in a module of its own, importing
nothing of ``megatron_edit``, so that :mod:`.compat`, :mod:`.controller` and
:mod:`.checkpoint.resume` can use it: :mod:`.session` imports :mod:`.runtime`, which imports
them (a cycle otherwise).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field


@dataclass
class ProcessState:
    captures: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    """optimizer -> the dict its checkpoint load puts tensors in instead of setting them, while
    :mod:`megatron_edit.mcore.checkpoint.resume` reads a checkpoint (see ``capture_of``)."""
    checkpoint_plans: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    """optimizer -> its :class:`~megatron_edit.mcore.checkpoint.fsdp_load.FSDPResumePlan` between
    ``sharded_state_dict(is_loading=True)`` and ``load_state_dict`` (Megatron-FSDP's DCP load)."""
    built_instance_groups: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    """inter-instance group -> the instance group built from it (megatron-core 0.12.x only; see
    :func:`megatron_edit.mcore.compat.instance_group`)."""
    controllers_built: int = 0
    """``LocalSGD`` objects built in this process: the keys of their arrival checks. The same
    count on every rank (they build them in the same order), so it never resets, not even
    when a session is unpatched."""

    records_opened: int = 0
    """Sync records (:mod:`megatron_edit.mcore.sync_record`) opened in this process: the key space
    of each in the job's store (the same count on every rank, as :attr:`controllers_built`)."""

    torchft_round: object = None
    """The torchft Manager of this rank and its rounds, shared by the process's EDiT controllers
    (:class:`megatron_edit.mcore.fault_tolerant.TorchftRound`), None without."""
    warned: set = field(default_factory=set)
    """Start-up warnings already given in this process (each once, not once per controller)."""

    def next_record_key(self) -> int:
        """Count one more sync record opened; its number keys its parts in the job's store."""
        self.records_opened += 1
        return self.records_opened

    def next_controller_key(self) -> int:
        """Count one more controller built; its number keys its arrival checks."""
        self.controllers_built += 1
        return self.controllers_built


PROCESS = ProcessState()
