"""Synchronous EDiT on Megatron's distributed optimizer (arXiv 2412.07210, Sec. 3.1-3.2).

A *worker* is one instance of Megatron's partial distributed optimizer
(``num_distributed_optimizer_instances`` workers). Inside a worker the ranks form the
model-shard group: gradients are reduce-scattered there every step and each rank owns one shard
of every bucket's fp32 main parameters. Across workers, the ranks owning the same shard form
the sync group (Megatron's inter-instance group); after warmup nothing crosses it except the
pseudo-gradient exchange every H steps.

:class:`LocalSGD` holds the EDiT state of one ``DistributedOptimizer``: per bucket, this rank's
shard of the anchor and of the outer optimizer state (so 2 x 4 bytes x params / shard size per
rank), and the schedule. It is attached to Megatron by :mod:`megatron_edit.megatron_patches`;
this module only uses the objects it is given (buckets, bucket groups, main params and the
process groups they carry), never ``parallel_state``.

Two ways to run a sync, same numbers:

* ``layerwise``: after the optimizer step of a sync step every bucket is marked pending; when
  Megatron starts a bucket group's parameter all-gather for the next forward pass
  (``overlap_param_gather``), the group's exchange is completed, its outer step applied and its
  shard written, then the all-gather runs. The next group's exchange is launched asynchronously
  first, so it is in flight while the current layers compute.
* ``step_end``: all exchanges run, blocking, right after the inner optimizer update and before
  Megatron copies main params into the model and gathers them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from . import outer
from .comm import SyncGroup
from .config import GTAConfig, LocalSGDConfig, OuterOptimizerConfig

logger = logging.getLogger(__name__)


@dataclass
class BucketShard:
    """This rank's shard of one Megatron bucket, and the EDiT state of that shard."""

    bucket: object
    """Megatron's ``_ParamAndGradBucket``."""
    numel: int
    """Shard length: the bucket's numel / model-shard group size (padding included)."""
    mains: List[torch.Tensor]
    """The fp32 main-param shards of the optimizer that fall in this shard (1-D)."""
    local_ranges: List[tuple]
    """Each main's [start, end) inside the shard."""
    bucket_ranges: List[tuple]
    """Each main's [start, end) inside ``bucket.param_data`` (where the model copy lives)."""
    main_is_model: bool
    """fp32 model params: the main params are views of ``bucket.param_data`` itself."""
    anchor: Optional[torch.Tensor] = None
    delta: Optional[torch.Tensor] = None
    handle: Optional[object] = None
    pending: bool = False

    def read_current(self, out: torch.Tensor) -> torch.Tensor:
        out.zero_()  # padding between params stays 0 in both anchor and current
        for main, (s, e) in zip(self.mains, self.local_ranges):
            out[s:e].copy_(main.view(-1))
        return out

    def write_mains(self, values: torch.Tensor) -> None:
        for main, (s, e) in zip(self.mains, self.local_ranges):
            main.view(-1).copy_(values[s:e])

    def write_model_shard(self) -> None:
        """Cast the main shards into the model's param buffer (bf16 models; no-op for fp32)."""
        if self.main_is_model:
            return
        flat = self.bucket.param_data.view(-1)
        for main, (s, e) in zip(self.mains, self.bucket_ranges):
            flat[s:e].copy_(main.view(-1))


@dataclass
class SyncReport:
    """What one outer synchronisation did on this rank."""

    step: int
    """Optimizer steps done when the sync was due."""
    mode: str
    buckets: int
    payload_bytes: int
    """Bytes this rank all-reduced across the sync group (fp32 pseudo-gradient shards)."""
    seconds: float
    """Time this rank spent in EDiT code for the sync (launch, wait, outer step, copies)."""
    workers: int
    steps_since_last: int = 0
    """Inner steps since the previous sync (H for synchronous EDiT)."""
    outer_lr: float = 0.0

    def scalars(self) -> Dict[str, float]:
        """Flat name -> value, for Megatron's console line and TensorBoard / W&B writers."""
        return {
            "local-sgd/sync-seconds": self.seconds,
            "local-sgd/sync-bytes": float(self.payload_bytes),
            "local-sgd/steps-since-last-sync": float(self.steps_since_last),
            "local-sgd/outer-lr": self.outer_lr,
            "local-sgd/workers": float(self.workers),
        }


@dataclass
class _SyncInProgress:
    step: int
    bytes_at_start: int
    seconds: float = 0.0


class LocalSGD:
    """EDiT state and schedule for one Megatron ``DistributedOptimizer``."""

    def __init__(
        self,
        optimizer,
        local_sgd_config: LocalSGDConfig,
        outer_optim_config: OuterOptimizerConfig,
        gta_config: Optional[GTAConfig] = None,
    ):
        self.config = local_sgd_config
        self.outer_config = outer_optim_config
        self.gta_config = gta_config or GTAConfig()
        self.steps_done = 0
        self.reports: List[SyncReport] = []
        self._sync: Optional[_SyncInProgress] = None
        self._last_sync_step = self.config.local_sgd_warmup_steps
        self._in_step = False
        self._synced_in_step = False

        self.shards: List[BucketShard] = []
        self.group_shards: Dict[object, List[BucketShard]] = {}
        self.group_order: List[object] = []  # bucket groups in forward (param-gather) order
        self._build_shards(optimizer)

        first_group = self.group_order[0] if self.group_order else None
        self.num_workers = optimizer.ddp_config.num_distributed_optimizer_instances
        inter = getattr(first_group, "inter_distributed_optimizer_instance_group", None)
        self.sync_group = SyncGroup(inter if self.num_workers > 1 else None)
        assert self.sync_group.size == self.num_workers, (self.sync_group.size, self.num_workers)

        self.state_device = torch.device("cpu") if self.config.cpu_offload else None
        self.outer_optimizer: Optional[torch.optim.Optimizer] = None

    # ------------------------------------------------------------------ set-up
    def _build_shards(self, optimizer) -> None:
        main_of = {}
        for model_groups, main_groups in (
            (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
            (optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
        ):
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main in zip(model_group, main_group):
                    main_of[model_param] = main
        fp32_models = {p for g in optimizer.model_fp32_groups for p in g}

        bucket_to_group = {}
        for chunk in optimizer.model_chunks:
            groups = list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)
            # Megatron gathers bucket groups in reverse order (buckets are built backward).
            self.group_order.extend(reversed(groups))
            for group in groups:
                for bucket in group.buckets:
                    bucket_to_group[id(bucket)] = group

        for gbuf_index, buffer in enumerate(optimizer.buffers):
            shard_size = buffer.data_parallel_group.size()
            for (dtype_key, bucket_maps) in optimizer.gbuf_ranges[gbuf_index].items():
                for bucket_index, bucket_map in enumerate(bucket_maps):
                    bucket = buffer.buckets[bucket_index]
                    mains, local_ranges, bucket_ranges = [], [], []
                    main_is_model = True
                    for model_param, ranges in bucket_map["param_map"].items():
                        mains.append(main_of[model_param])
                        local_ranges.append((ranges["gbuf_local"].start, ranges["gbuf_local"].end))
                        in_bucket = ranges["gbuf_world_in_bucket"]
                        bucket_ranges.append((in_bucket.start, in_bucket.end))
                        main_is_model &= model_param in fp32_models
                    shard = BucketShard(
                        bucket=bucket,
                        numel=bucket.grad_data.numel() // shard_size,
                        mains=mains,
                        local_ranges=local_ranges,
                        bucket_ranges=bucket_ranges,
                        main_is_model=main_is_model,
                    )
                    self.shards.append(shard)
                    group = bucket_to_group[id(bucket)]
                    self.group_shards.setdefault(group, []).append(shard)
        # Only groups this optimizer owns, in forward order.
        self.group_order = [g for g in self.group_order if g in self.group_shards]

    def _work_device(self, shard: BucketShard) -> torch.device:
        return shard.bucket.grad_data.device

    @torch.no_grad()
    def capture_anchor(self) -> None:
        """Anchor := the current main params (at the end of warmup); outer state starts empty."""
        anchors = []
        for shard in self.shards:
            device = self.state_device or self._work_device(shard)
            pin = device.type == "cpu" and torch.cuda.is_available()
            anchor = torch.empty(shard.numel, dtype=torch.float32, device=device, pin_memory=pin)
            if device == self._work_device(shard):
                shard.read_current(anchor)
            else:
                anchor.copy_(shard.read_current(torch.empty(shard.numel, device=self._work_device(shard))))
            shard.anchor = anchor
            anchors.append(anchor)
        cls = self.outer_config.optimizer_class
        self.outer_optimizer = cls(anchors, **self.outer_config.outer_optim_kwargs)

    # ------------------------------------------------------------ schedule
    @property
    def grads_are_local(self) -> bool:
        """Whether gradients of the step now running stay inside the worker."""
        return outer.grads_are_local(self.steps_done, self.config.local_sgd_warmup_steps)

    def _sync_due(self, steps_done: int) -> bool:
        c = self.config
        return outer.is_sync_step(steps_done, c.local_sgd_warmup_steps, c.local_sgd_sync_interval)

    def begin_step(self) -> None:
        """Before the inner optimizer update of step ``steps_done + 1``."""
        self.flush()  # a layer-wise sync must be complete before main params change again
        if self.outer_optimizer is None and self.steps_done >= self.config.local_sgd_warmup_steps:
            self.capture_anchor()
        self._in_step = True
        self._synced_in_step = False

    def after_inner_update(self) -> None:
        """Inner update done, main params not yet copied into the model (step-end sync point)."""
        if (
            self._in_step
            and self.config.sync_mode == "step_end"
            and self._sync_due(self.steps_done + 1)
        ):
            self._start_sync(self.steps_done + 1)
            self._complete(self.shards, write_model=False)
            self._synced_in_step = True

    def end_step(self, optimizer) -> None:
        """After the optimizer step: count it, and schedule the layer-wise sync if due."""
        self._in_step = False
        self.steps_done += 1
        if not self._sync_due(self.steps_done):
            return
        if self.config.sync_mode == "step_end":
            assert self._synced_in_step, "step-end sync did not run inside the optimizer step"
            return
        self._start_sync(self.steps_done)
        for shard in self.shards:
            shard.pending = True
        if self.group_order:
            self._launch(self.group_shards[self.group_order[0]])

    # ------------------------------------------------------------ the sync
    def _start_sync(self, step: int) -> None:
        assert self._sync is None
        self._sync = _SyncInProgress(step, self.sync_group.counters.payload_bytes)

    def _finish_sync_if_done(self) -> None:
        if self._sync is None or any(s.pending for s in self.shards):
            return
        sync, self._sync = self._sync, None
        report = SyncReport(
            step=sync.step,
            mode=self.config.sync_mode,
            buckets=len(self.shards),
            payload_bytes=self.sync_group.counters.payload_bytes - sync.bytes_at_start,
            seconds=sync.seconds,
            workers=self.sync_group.size,
            steps_since_last=sync.step - self._last_sync_step,
            outer_lr=float(self.outer_optimizer.param_groups[0]["lr"]),
        )
        self._last_sync_step = sync.step
        self.reports.append(report)
        if self.config.is_debug:
            logger.info("rank %d: %s", torch.distributed.get_rank(), report)

    @torch.no_grad()
    def _launch(self, shards: List[BucketShard]) -> None:
        """Compute the pseudo-gradients of ``shards`` and start their asynchronous exchange."""
        t0 = time.perf_counter()
        for shard in shards:
            if shard.handle is not None:
                continue
            device = self._work_device(shard)
            delta = shard.read_current(torch.empty(shard.numel, dtype=torch.float32, device=device))
            anchor = shard.anchor.to(device, non_blocking=True)
            outer.pseudo_gradient(anchor, delta, out=delta)
            shard.delta = delta
            shard.handle = self.sync_group.all_reduce_sum(delta, async_op=True)
        self._sync.seconds += time.perf_counter() - t0

    @torch.no_grad()
    def _complete(self, shards: List[BucketShard], write_model: bool) -> None:
        """Finish the exchange of ``shards``, step their anchors, restart their mains from them."""
        self._launch(shards)
        t0 = time.perf_counter()
        for shard in shards:
            shard.handle.wait()
            delta = outer.mean_from_sum(shard.delta, self.sync_group.size)
            grad = delta.to(shard.anchor.device, non_blocking=True)
            outer.outer_step(self.outer_optimizer, [shard.anchor], [grad])
            shard.write_mains(shard.anchor.to(delta.device, non_blocking=True))
            if write_model:
                shard.write_model_shard()
            shard.delta = shard.handle = None
            shard.pending = False
        self._sync.seconds += time.perf_counter() - t0
        self._finish_sync_if_done()

    def before_param_gather(self, bucket_group) -> None:
        """Megatron is about to all-gather ``bucket_group``: apply its pending outer step first,
        after launching the next pending group's exchange so that one is in flight."""
        shards = self.group_shards.get(bucket_group)
        if not shards or not any(s.pending for s in shards):
            return
        index = self.group_order.index(bucket_group)
        for later in self.group_order[index + 1 :]:
            later_shards = self.group_shards[later]
            if any(s.pending for s in later_shards):
                self._launch(later_shards)
                break
        self._complete([s for s in shards if s.pending], write_model=True)

    def flush(self) -> None:
        """Complete every pending exchange now (before state is read or params change)."""
        pending = [s for s in self.shards if s.pending]
        if pending:
            self._complete(pending, write_model=True)

    def drain_reports(self) -> List[SyncReport]:
        reports, self.reports = self.reports, []
        return reports

    def state_bytes(self) -> int:
        """Bytes of EDiT state on this rank: anchor + outer optimizer state."""
        total = sum(s.anchor.numel() * s.anchor.element_size() for s in self.shards if s.anchor is not None)
        if self.outer_optimizer is not None:
            for state in self.outer_optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        total += v.numel() * v.element_size()
        return total
