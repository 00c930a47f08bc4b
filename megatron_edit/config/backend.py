"""The sync backend's settings of :class:`~megatron_edit.config.LocalSGDConfig` (``torch`` or
``torchft``: the Lighthouse, this worker's replica id, the quorum's size) and their checks, a part
of :mod:`megatron_edit.config`, which re-exports it. The fields are declared on
:class:`~megatron_edit.config.LocalSGDConfig`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

from .values import FLAG_NAMES, ConfigError, _is_int, _name, _require

SYNC_BACKENDS = ("torch", "torchft")


class BackendSettings:
    """The sync backend's derived values and checks, mixed into LocalSGDConfig."""

    @property
    def lighthouse_address(self) -> Optional[str]:
        """The torchft Lighthouse's address: ``lighthouse``, else ``$TORCHFT_LIGHTHOUSE``."""
        return self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE") or None

    def _check_sync_backend(self) -> None:
        """``sync_backend`` and the torchft backend's settings (``lighthouse``, ``replica_id``,
        ``min_replicas``); what the torchft backend does not run yet is refused."""
        backend = self.sync_backend
        _require(isinstance(backend, str) and backend in SYNC_BACKENDS, "sync_backend",
                 f"must be one of {SYNC_BACKENDS} (got {backend!r}).")
        _require(_is_int(self.min_replicas) and self.min_replicas >= 1, "min_replicas",
                 f"must be an integer >= 1 (got {self.min_replicas!r}).")
        _require(self.replica_id is None or (_is_int(self.replica_id) and self.replica_id >= 0), "replica_id",
                 f"must be an integer >= 0 or None (got {self.replica_id!r}).")
        _require(self.lighthouse is None or (isinstance(self.lighthouse, str) and self.lighthouse), "lighthouse",
                 f"must be an address such as http://host:29510, or None (got {self.lighthouse!r}).")
        ft_only = [f for f, default in (("lighthouse", None), ("replica_id", None), ("min_replicas", 1))
                   if getattr(self, f) != default]
        if backend == "torch":
            if ft_only:
                raise ConfigError(
                    f"{_name(ft_only[0])}: only used by the torchft backend; add "
                    f"{FLAG_NAMES['sync_backend']} torchft or drop the flag.")
            return
        if importlib.util.find_spec("torchft") is None:
            raise ConfigError(
                f"{_name('sync_backend')} torchft: torchft is not installed; pip install torchft==0.2.0 "
                "(in a checkout: pip install -e '.[ft]').")
        if self.replica_id is None:
            raise ConfigError(
                f"{_name('replica_id')}: {FLAG_NAMES['sync_backend']} torchft needs this worker's id (an integer >= 0, "
                "the same on all its ranks, different for every worker).")
        if self.lighthouse_address is None:
            raise ConfigError(
                f"{_name('lighthouse')}: {FLAG_NAMES['sync_backend']} torchft needs the Lighthouse's address "
                "(http://host:port); give the flag or set TORCHFT_LIGHTHOUSE.")
        if self.local_sgd_warmup_steps > 0:
            raise ConfigError(  # (a decision, not a gap: docs/concepts/torchft.md, 'Warmup')
                f"{_name('local_sgd_warmup_steps')} with {FLAG_NAMES['sync_backend']} torchft: a cross-site run does "
                "not warm up over the slow link (warmup all-reduces every step's gradients across the "
                "workers and waits for the slowest and a quorum every step). Warm up in one job with the "
                "torch backend, save, and start the torchft run from that checkpoint (docs/concepts/torchft.md, 'Warmup'), or drop the flag.")
