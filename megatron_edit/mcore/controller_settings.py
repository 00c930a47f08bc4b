"""The settings in force of a :class:`~megatron_edit.mcore.controller.LocalSGD`, which
``auto_overlap`` changes between syncs (:mod:`.auto_overlap`): the delay, the exchange format and
the streaming fragments. A part of the controller (it inherits this class; it uses the
controller's fields).
"""

from __future__ import annotations

from typing import Optional

from ..config import FLAG_NAMES
from .async_delayed import delayed_outer_step
from .fragments import SyncShards, partition_sizes, recut


class ControllerSettings:
    """``auto_overlap``'s changes of the settings in force (mixed into :class:`LocalSGD`)."""

    def apply_settings(self, delay: int, exchange_dtype: str, fragments: Optional[int] = None) -> None:
        """``auto_overlap``: put this delay, exchange format (its name: dense, or
        ``topk<density>-<values>``) and number of fragments (None: the one in force) in force
        from the next sync on; only between syncs, with nothing in flight (every worker at the
        same step). At a change of format error feedback's residuals follow
        :mod:`megatron_edit.algorithm.residual` (:meth:`OuterSync.use_config`)."""
        if self.sync.in_progress or (self.delayed is not None and self.delayed.in_flight):
            raise RuntimeError("megatron_edit: the delay and format change only with no exchange in flight")
        c = self.config
        fragments = c.fragments if fragments is None else fragments
        if (delay, exchange_dtype, fragments) == (c.outer_step_delay, c.start_format, c.fragments):
            return
        self.config = self.auto.config_for(delay, exchange_dtype, fragments)
        self.sync.use_config(self.config)
        if fragments != c.fragments:
            self._use_fragments(fragments)
        self.sync_shards.config = self.config
        self.async_plan.config = self.config  # A-EDiT: the next intervals at least tau + 1 steps
        if delay != c.outer_step_delay:  # (kept otherwise: a heal's format comes inside a delayed launch)
            self.delayed = delayed_outer_step(self)  # on EDiT's grid or A-EDiT's syncs

    def _use_fragments(self, count: int) -> None:
        """Cut the shards into ``count`` fragments from now on (``auto_overlap``; between syncs):
        the fragments' schedule is a run's with ``count`` from the start (fragment f after
        W + kH + f H/F). Each shard keeps its anchor and outer state; a layer cut differently
        starts the penalty's statistics afresh. A fragment is identical on every worker when
        every old one was (right after a sync of the whole model)."""
        unsplit, sizes = self._recut
        parts = None if count == 1 else partition_sizes(sizes, count, FLAG_NAMES["auto_fragments"])
        self.layer_names = recut(self.shards, unsplit, parts)
        self.sync.relabel_layers(self.layer_names)
        old = self.sync_shards
        self.sync_shards = SyncShards(self.sync.groups, self.config, parts)
        all_identical = len(self.identical_fragments) == len(old.fragments)
        self.mark_identical(range(count) if all_identical else (), only=True)

