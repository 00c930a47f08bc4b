"""One outer synchronisation of EDiT (arXiv 2412.07210, Sec. 3), bucket group by bucket group.

Per shard: Delta_i = anchor - current; reduced across the sync group to one Delta (the mean, or
with the pseudo-gradient penalty a per-layer weighted mean over the workers not excluded, then
clipped per layer; or the GTA reducer; or the quantized or the sparse (top-k) exchange:
:mod:`.reducers`); the outer
optimizer steps the anchor with Delta as its gradient; the main params (and the model's 16-bit
copy) restart from the anchor.

Every worker's per-layer pseudo-gradient norms are exchanged once per sync (one small
all-gather for all layers) before any bucket, so every rank of every worker takes the same
decisions (:mod:`.decisions`): the penalty's, and whether a non-finite pseudo-gradient stops
the run (:class:`~.decisions.NonFinitePseudoGradient`; with anomaly elimination on, its worker is
excluded instead). No NaN or Inf reaches the exchange's encoders or the anchor.

A sync runs in phases that a caller can spread over time:

* :meth:`OuterSync.start` takes the decisions (and is where A-EDiT's skip lands);
* :meth:`OuterSync.launch` starts the asynchronous exchange of some shards;
* :meth:`OuterSync.complete` waits for their exchange, applies the outer step, writes the
  parameters; the sync ends when no shard is pending.

Layer-wise mode (:mod:`.layerwise`): the outer step of each bucket group is completed just
before the next forward pass gathers its parameters. Step-end mode: :meth:`complete` of every
shard at once.

What a sync holds while it runs is in :mod:`.in_flight`, not in the shards; which reducer a
shard gets (GTA, quantized, sparse, the mean) is chosen once per sync and shard
(:func:`.reducers.choose`). This module is long because the phases share one sync's state.
The collectives go through ``sync_group`` and ``worker_groups``
(:mod:`megatron_edit.exchange.groups`, or fakes with the same methods); the math is in
:mod:`megatron_edit.algorithm`.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence

import torch

from ..algorithm import penalty
from ..config import GTAConfig, LocalSGDConfig
from .decisions import NonFinitePseudoGradient, SyncDecisions  # noqa: F401 (NonFinitePseudoGradient: its callers')
from . import link_probe, reducers
from .groups import mean_divisor
from .in_flight import SyncInProgress
from .layerwise import LayerwisePhases
from .outer_state import OuterState
from .quantized import QuantizedExchange
from .report import SyncReport, report_of
from .shard import BucketShard
from .sparse import SparseExchange


class OuterSync(LayerwisePhases):
    """The outer syncs of one optimizer's shards, with the penalty's running statistics.

    ``groups``: the shards in bucket groups, in the order the forward pass gathers them.
    ``on_done``: called with each sync's :class:`SyncReport` when it ends.
    """

    def __init__(
        self,
        groups: Sequence[Sequence[BucketShard]],
        layer_names: Sequence[str],
        sync_group,
        worker_groups,
        config: LocalSGDConfig,
        gta_config: GTAConfig,
        outer_state: OuterState,
        on_done: Optional[Callable[[SyncReport], None]] = None,
    ):
        self.groups: List[List[BucketShard]] = [list(g) for g in groups]
        self.shards: List[BucketShard] = [s for g in self.groups for s in g]
        self.layer_names = list(layer_names)
        self.sync_group = sync_group
        self.worker_groups = worker_groups
        self.config = config
        self.gta_config = gta_config
        self.outer = outer_state
        self.on_done = on_done
        self._index_layers()
        self._gta = gta_config.reducer == "gta"
        self.quantized: Optional[QuantizedExchange] = None
        """The quantized exchange's protocol (None: fp32 exchange)."""
        self.sparse: Optional[SparseExchange] = None
        """The sparse (top-k) exchange's protocol (None: dense)."""
        self.use_config(config)
        self.decisions = SyncDecisions(config, self._gta, self.num_workers, len(self.layer_names))
        """The penalty's running statistics and decisions (:mod:`.decisions`)."""
        self._sync: Optional[SyncInProgress] = None
        self.commit_gate: Optional[Callable[[], bool]] = None
        """Asked once per sync, after every exchange of it is in and before any outer step:
        whether to apply it (the torchft backend's commit); None: always. A sync not applied
        leaves the main params with the worker's local progress."""

    def relabel_layers(self, layer_names: Sequence[str]) -> None:
        """The shards' layers were cut anew (``auto_overlap`` changed the number of fragments,
        between syncs): per-layer lists and the penalty's statistics follow the new names (a
        layer cut differently starts its statistics afresh)."""
        assert self._sync is None, "an exchange is in flight"
        self.decisions.relabel(self.layer_names, layer_names)
        self.layer_names = list(layer_names)
        self._index_layers()

    def _index_layers(self) -> None:
        self.layer_shards: List[List[BucketShard]] = [[] for _ in self.layer_names]
        """Layer index -> the shards holding a parameter of it."""
        for shard in self.shards:
            for layer in shard.bucket_layers:
                self.layer_shards[layer].append(shard)

    def use_config(self, config: LocalSGDConfig) -> None:
        """Exchange by ``config`` from the next sync on (its format; ``auto_overlap`` changes it
        between syncs): the quantized or sparse exchange's protocol, or none for fp32. A quantized
        format that gives way to another folds its chunk residuals into the workers' residuals
        (:mod:`megatron_edit.algorithm.residual`)."""
        assert getattr(self, "_sync", None) is None, "an exchange is in flight"
        self.config = config
        before = getattr(self, "quantized", None)
        protocol = reducers.exchange_protocol(config, self.sync_group, self.num_workers)
        self.quantized = protocol if isinstance(protocol, QuantizedExchange) else None
        self.sparse = protocol if isinstance(protocol, SparseExchange) else None
        now = self.quantized
        if before is not None and (now is None or (now.dtype, now.block) != (before.dtype, before.block)):
            before.fold_chunk_residuals(self.shards, 1 if self.exchanges_weighted_sum else mean_divisor(self.sync_group))

    @property
    def num_workers(self) -> int:
        """Workers in the sync group (over torchft: in the current sync)."""
        return self.sync_group.size

    @property
    def exchanges_weighted_sum(self) -> bool:
        """Whether each worker sends its weighted pseudo-gradient and the result is their sum
        (penalty or step weights), rather than the sum divided by the workers (plain mean)."""
        return self.decisions.penalty or self.config.use_step_weight

    @property
    def in_progress(self) -> bool:
        return self._sync is not None

    @property
    def final(self) -> bool:
        """The sync in progress is the run's last (A-EDiT's final sync; EDiT's is known by its step)."""
        return self._sync is not None and self._sync.final

    @property
    def pending(self) -> bool:
        return self._sync is not None and self._sync.pending

    @property
    def members(self) -> List[BucketShard]:
        """The shards the sync in progress exchanges (all, or a streaming fragment's)."""
        return self._sync.members

    # ------------------------------------------------------------------ start
    def start(self, step: int, steps_since_last: int, worker_steps: Optional[torch.Tensor] = None,
              worker_seconds: Optional[torch.Tensor] = None, skip: bool = False,
              bytes_at_start: Optional[int] = None, worker_idle: Optional[torch.Tensor] = None,
              final: bool = False, delay: int = 0, fragment: Optional[int] = None,
              members: Optional[Sequence[BucketShard]] = None, began: Optional[float] = None,
              probe_link: bool = False) -> bool:
        """Begin the sync due after ``step``: the penalty's decisions. ``skip`` (A-EDiT: too few
        steps in total) ends it at once without any exchange; returns whether it goes on.
        ``bytes_at_start``: the sync group's byte count where the sync's traffic began (A-EDiT's
        schedule message comes first). ``delay``: the sync is launched now and applied ``delay``
        steps later (a delayed outer step; ``step`` is the apply step). ``members``: the shards
        this sync exchanges (streaming fragment ``fragment``; default: every shard). ``began``: the
        ``time.perf_counter()`` at which the caller began the sync (its schedule and bookkeeping
        count in the sync's seconds; default: now). ``probe_link`` (every worker of the sync
        must ask it alike: the automatic overlap's timed syncs): a blocking all-reduce of one
        element over the sync group before the exchange's first launch (the workers' skew is
        waited out there, not in the exchange's time) and, once the whole exchange is in, two
        timed ones (:mod:`.link_probe`: the link's latency and rate)."""
        assert self._sync is None, "a sync is already in progress"
        t0 = time.perf_counter() if began is None else began
        if bytes_at_start is None:
            bytes_at_start = self.sync_group.counters.payload_bytes
        self._sync = SyncInProgress(step, steps_since_last, bytes_at_start)
        self._sync.worker_steps, self._sync.worker_seconds = worker_steps, worker_seconds
        self._sync.worker_idle, self._sync.final, self._sync.delay = worker_idle, final, delay
        self._sync.members = list(self.shards if members is None else members)
        self._sync.probe_link = probe_link
        if members is not None:
            self._sync.fragment = fragment
            layers = torch.zeros(len(self.layer_names), dtype=torch.bool)
            layers[[layer for s in self._sync.members for layer in s.bucket_layers]] = True
            self._sync.layers = layers
        if skip:
            self._sync.skipped_sync = True
            self._finish_if_done()
            return False
        self._decide()
        self._plan()
        self._sync.seconds += time.perf_counter() - t0
        return True

    @torch.no_grad()
    def _delta(self, shard: BucketShard) -> torch.Tensor:
        """Delta = anchor - current, into a new buffer (released when the shard's step is done)."""
        delta = torch.empty(shard.numel, dtype=torch.float32, device=shard.device)
        return shard.pseudo_gradient(self.outer.anchor_on_device(shard), delta)

    def _layer_norms(self, shards: List[BucketShard]) -> torch.Tensor:
        """[L] float64 on the shards' device: this worker's norm of each layer over ``shards``
        (their Delta at this sync), summed over the model-shard and tensor-parallel groups
        (worker-local collectives). Layers not wholly in ``shards`` get partial values."""
        device = shards[0].device if shards else torch.device("cpu")
        partial = torch.zeros(len(self.layer_names), dtype=torch.float64, device=device)
        for shard in shards:
            shard.layer_sq_norms(self._sync.of(shard).delta, partial)
        return self.worker_groups.sum(partial).sqrt()

    @torch.no_grad()
    def _decide(self) -> None:
        """Per-layer norms of every worker (one all-gather), then the decisions: the penalty's,
        and the stop for a non-finite pseudo-gradient that is not excluded."""
        c, sync = self.config, self._sync
        keep = sync.delay and c.keeps_launch_params
        for shard in sync.members:
            sync.of(shard).delta = self._delta(shard)
            if keep:  # the merge adds the progress made since: keep where the worker was
                sync.of(shard).launch_params = shard.read_current(torch.empty_like(sync.of(shard).delta))
        own = self._layer_norms(sync.members)
        norms = self.sync_group.all_gather(own).cpu()  # the decisions are taken on the host
        try:
            decision = self.decisions.take(c, norms, self.sync_group, sync.layers, sync.worker_steps,
                                           self.layer_names, sync.step)
        except NonFinitePseudoGradient:
            self._sync = None  # every shard's Delta goes with it
            raise
        sync.weights = decision.weights
        sync.own_weights = None if decision.weights is None else decision.weights[self.sync_group.rank]
        sync.norms, sync.excluded, sync.skipped = norms, decision.excluded, decision.skipped

    def _plan(self) -> None:
        """The reducers of this sync, one per shard (:func:`.reducers.choose`)."""
        sync = self._sync
        sync.divisor, chosen = reducers.choose(
            sync.members, sync_group=self.sync_group, protocol=self.quantized or self.sparse,
            gta_config=self.gta_config, weights=sync.weights, own_weights=sync.own_weights, step=sync.step,
            shard_rank=self.worker_groups.shard_rank, defer=self._defers_mean())
        for shard, reducer in zip(sync.members, chosen):
            sync.of(shard).reducer = reducer

    # ------------------------------------------------------------------ exchange
    @torch.no_grad()
    def launch(self, shards: Sequence[BucketShard]) -> None:
        """Start the asynchronous exchange of ``shards`` (each worker's weighted Delta)."""
        if self._sync.probe_link and not self._sync.met and shards:  # (not the sync's time)
            link_probe.all_reduce_seconds(self.sync_group, shards[0].device)
            self._sync.met = True
        t0 = time.perf_counter()
        for shard in shards:
            state = self._sync.of(shard)
            if state.flight is not None or state.exchanged:
                continue
            if state.delta is None:
                state.delta = self._delta(shard)
            t1 = time.perf_counter()
            state.flight = state.reducer.launch(shard, state.delta, self._sync.skipped_ranges(shard))
            self._sync.exchange_seconds += time.perf_counter() - t1
        self._sync.seconds += time.perf_counter() - t0

    def _defers_mean(self) -> bool:
        """Whether the plain mean's division is left to the fused outer step (one pass less).
        With clipping only where the step is compiled (the clip factors go into its kernel too:
        the norms are then taken of the sum and divided); eagerly, clipping scales the mean.
        Not with a quantized or sparse exchange (its result is the mean already; a tiny shard
        exchanged in fp32 beside it divides at once)."""
        if not self.outer.fused or self.quantized is not None or self.sparse is not None:
            return False
        return self.config.clip_pseudo_grad is None or self._clip_in_kernel()

    def _clip_in_kernel(self) -> bool:
        return bool(self.shards) and self.outer.compiles(self.shards[0].device)

    @torch.no_grad()
    def _finish_exchange(self, shards: Sequence[BucketShard], exposed: bool = True) -> None:
        """Wait for the exchanges: each shard's Delta becomes the reduced pseudo-gradient (for
        the plain mean, possibly still the sum: ``divisor``). ``exposed``: a delayed sync's wait
        counts as its exposed wait (not the timed wait at its launch, :meth:`wait_at_launch`)."""
        self.launch(shards)
        t0 = time.perf_counter()
        for state in map(self._sync.of, shards):
            if not state.exchanged:
                state.delta = state.reducer.finish(state.flight)
                state.flight, state.exchanged = None, True
        self._sync.seconds += time.perf_counter() - t0
        self._sync.exchange_seconds += time.perf_counter() - t0
        if self._sync.delay and exposed:
            self._sync.exposed_wait += time.perf_counter() - t0
        self._probe_link()

    def _probe_link(self) -> None:
        """The link's probes a sync asked for (:meth:`start`, :mod:`.link_probe`), once its whole
        exchange is in: the workers have just met there, so their times are the link's."""
        sync = self._sync
        if not sync.probe_link or sync.latency is not None:
            return
        if not all(sync.of(s).exchanged for s in sync.members):
            return
        device = sync.members[0].device if sync.members else torch.device("cpu")
        sync.latency, sync.rate_probe = link_probe.probe(self.sync_group, device, sum(s.numel for s in self.shards))

    def wait_at_launch(self) -> None:
        """A delayed sync that ``auto_overlap`` times: wait for its whole exchange right after
        the launch and keep the result for the apply, ``delay`` steps later as always. The
        numbers are the untimed sync's (the result does not depend on when it is waited for;
        applying early would), only the wait is exposed: the time from the sync's start to the
        exchange's end is the exchange's (``SyncReport.launch_wait_seconds``)."""
        self._finish_exchange(self._sync.members, exposed=False)
        self._sync.launch_wait = self._sync.seconds

    # ------------------------------------------------------------------ complete
    @torch.no_grad()
    def _ensure_clip_coefficients(self, shards: Sequence[BucketShard]) -> None:
        """Clip factors of the layers in ``shards``; a layer's norm needs every bucket it spans,
        so those exchanges are completed first (the same buckets on every rank of the worker)."""
        tau = self.config.clip_pseudo_grad
        if tau is None:
            return
        coef = self._sync.clip_coef
        needed = {layer for shard in shards for layer in shard.bucket_layers} - coef.keys()
        if not needed:
            return
        spanned = {id(s): s for layer in needed for s in self.layer_shards[layer]}
        self._finish_exchange(list(spanned.values()))
        ready = [
            layer
            for layer in range(len(self.layer_names))
            if layer not in coef and all(self._sync.of(s).exchanged for s in self.layer_shards[layer])
        ]
        involved = {id(s): s for layer in ready for s in self.layer_shards[layer]}
        # On the device: the factors are never read on the host here (no wait in a pre-hook).
        norms = self._layer_norms(list(involved.values()))
        divisor = self._sync.divisor
        if divisor != 1:  # Delta still holds the sum: the mean's norm is the sum's / divisor
            norms = norms / divisor
        factors = penalty.clip_coefficients(norms, tau)
        for layer in ready:
            coef[layer] = factors[layer]

    @torch.no_grad()
    def _apply(self, shard: BucketShard, write_model: bool, merge_alpha: Optional[float] = None) -> None:
        """Outer step of one shard with its reduced Delta; mains restart from the anchor."""
        sync = self._sync
        delta, scales = sync.of(shard).delta, None
        if sync.clip_coef:
            if self._clip_in_kernel():
                scales = sync.clip_coef
            else:
                shard.scale_layers(delta, sync.clip_coef)
        self.outer.apply(shard, delta, sync.skipped_ranges(shard), write_model, sync.divisor, layer_scales=scales,
                         merge_alpha=merge_alpha, keep_from=sync.of(shard).launch_params)
        sync.done(shard)

    @torch.no_grad()
    def complete(self, shards: Sequence[BucketShard], write_model: bool, merge_alpha: Optional[float] = None) -> None:
        """Finish the exchange of ``shards``, step their anchors, restart their mains (and the
        model's 16-bit copy when ``write_model``), or merge them (``merge_alpha``: delayed)."""
        self._finish_exchange(shards)
        t0 = time.perf_counter()
        if not self._committed():
            for shard in shards:  # not applied: the mains keep the local progress
                self._sync.done(shard)
            self._sync.seconds += time.perf_counter() - t0
            return self._finish_if_done()
        self._ensure_clip_coefficients(shards)
        for shard in shards:
            self._apply(shard, write_model, merge_alpha)
        self._sync.seconds += time.perf_counter() - t0
        self._finish_if_done()

    def _committed(self) -> bool:
        """Whether the sync in progress is applied (:attr:`commit_gate`, asked once, when every
        exchange of the sync is in)."""
        sync = self._sync
        if self.commit_gate is None:
            return True
        if sync.committed is None:
            self._finish_exchange(sync.members)
            sync.committed = bool(self.commit_gate())
        return sync.committed

    def finish_exchange(self) -> None:
        """Wait for every exchange of the sync in progress (nothing without one): a commit gate
        shared with other optimizers' syncs (torchft: one round per sync for a MoE model's
        dense and expert optimizers) needs them all in before it decides."""
        if self._sync is not None and not self._sync.skipped_sync:
            self._finish_exchange(self._sync.members)

    def decide(self, applied: bool) -> None:
        """The commit gate's answer for the sync in progress, decided elsewhere (a shared round's
        commit): asked again, the gate is not (nothing without a sync in progress)."""
        if self._sync is not None and self._sync.committed is None:
            self._sync.committed = bool(applied)

    def advance(self) -> None:
        """A delayed sync: start the second phase of every exchange in flight (GTA, the quantized
        exchange) once its first is in, in the shards' order (the same on every worker)."""
        for state in map(self._sync.of, self._sync.members):
            if state.flight is not None:
                state.reducer.advance(state.flight)

    def applied_after(self, step: int) -> None:
        """The delayed sync in progress is applied after ``step``, before its planned step (A-EDiT:
        the final sync came first): its report says where (launched after ``step - delay`` still)."""
        self._sync.delay -= self._sync.step - step
        self._sync.step = step

    # ------------------------------------------------------------------ checkpoints
    def finish_in_flight(self):
        """A delayed sync in flight, for a checkpoint: wait for its exchange (the result does not
        depend on when; applying early would) and return what its apply needs, ``(meta,
        {id(shard): (reduced Delta, launch params or None)})``, for :meth:`resume_in_flight`."""
        sync = self._sync
        self._finish_exchange(sync.members)
        meta = sync.saved_meta(committed=self.settle_commit())
        return meta, {id(s): (sync.of(s).delta, sync.of(s).launch_params) for s in sync.members}

    def settle_commit(self) -> Optional[bool]:
        """A sync in flight (delayed) and a commit gate (torchft): finish its exchange and ask the
        gate now. A checkpoint does so, where every rank of the worker saves: the resumed run
        applies the sync or not as this one does (it has no round to commit), and the counters
        saved with it (the Manager's step) count the sync. None: no gate or no sync in flight."""
        if self.commit_gate is None or self._sync is None:
            return None
        return self._committed()

    def resume_in_flight(self, meta: dict, members: Sequence[BucketShard], deltas, launch) -> None:
        """The sync of :meth:`finish_in_flight` again, exchanged, waiting for its apply."""
        self._sync = SyncInProgress.from_saved(meta, members, deltas, launch, self.sync_group.counters.payload_bytes)

    # ------------------------------------------------------------------ end
    def _exchange_error(self) -> Optional[torch.Tensor]:
        """The norm of what the quantized or sparse exchange changed in this sync (None: exact)."""
        exchange = self.quantized or self.sparse
        return exchange.take_error_norm() if exchange is not None else None

    def _finish_if_done(self) -> None:
        if self._sync is None or self.pending:
            return
        sync, self._sync = self._sync, None
        report = report_of(sync, self.config, self.sync_group, self.layer_names, self.outer.lr,
                           self._exchange_error())
        if self.on_done is not None:
            self.on_done(report)
