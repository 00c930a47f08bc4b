"""The layer-wise mode of an outer sync: its outer step spread over the next forward pass.

After the optimizer step every shard of the sync is pending and every bucket group's exchange
is launched in forward order (:meth:`LayerwisePhases.mark_pending`); just before a group's
parameters are gathered for the next forward pass its outer step is completed
(:meth:`LayerwisePhases.complete_group`), after advancing the next pending group's exchange, so
one exchange is in flight while layers compute. A part of
:class:`~megatron_edit.exchange.outer_sync.OuterSync`, which mixes it in (its ``groups``,
``shards``, ``_sync``, ``launch`` and ``complete``).
"""

from __future__ import annotations

from .shard import BucketShard


class LayerwisePhases:
    """The layer-wise phases of :class:`~megatron_edit.exchange.outer_sync.OuterSync`."""

    def mark_pending(self) -> None:
        """Layer-wise: every shard waits for its group's parameter gather; every group's
        exchange starts now, in forward order, so each is in flight while earlier layers
        compute (the backend runs them in launch order)."""
        for shard in self._sync.members:
            self._sync.of(shard).pending = True
        self.launch(self._sync.members)  # in group order: the forward order

    def complete_group(self, index: int) -> None:
        """Layer-wise: group ``index`` is about to be gathered: complete its pending outer step.
        GTA and the quantized exchange: the next group's second phase is started first, so it
        overlaps this group's."""
        shards = [s for s in self.groups[index] if self._is_pending(s)]
        if not shards:
            return
        for later in self.groups[index + 1 :]:
            # launched and not finished yet (clipping may have finished some early)
            flying = [self._sync.of(s) for s in later if self._is_pending(s)]
            for state in flying:
                if state.flight is not None:
                    state.reducer.advance(state.flight)
            if flying:
                break
        self.complete(shards, write_model=True)

    def _is_pending(self, shard: BucketShard) -> bool:
        return self._sync is not None and self._sync.of(shard).pending  # between syncs: none

    def flush(self) -> None:
        """Complete every pending exchange now (before state is read or params change)."""
        pending = [s for s in self.shards if self._is_pending(s)]
        if pending:
            self.complete(pending, write_model=True)

