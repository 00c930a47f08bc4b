"""The one active patch session of this process: the runtime the patches consult and the
registry that applied them (patching Megatron is process-global by nature).

:mod:`megatron_edit.api` opens and closes it; the layers above megatron-core's (Megatron-LM's
training integration) read it here, so nothing imports the API module back.
"""

from __future__ import annotations

from typing import Optional

from .patching import PatchRegistry
from .runtime import LocalSGDRuntime


class Session:
    runtime: Optional[LocalSGDRuntime] = None
    registry: Optional[PatchRegistry] = None
    fixes_registry: Optional[PatchRegistry] = None
    """megatron-core's load fixes alone (plain Megatron); the full registry includes them."""


SESSION = Session()


def current_runtime() -> Optional[LocalSGDRuntime]:
    return SESSION.runtime
