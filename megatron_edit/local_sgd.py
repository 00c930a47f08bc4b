"""Synchronous EDiT on Megatron's distributed optimizer (arXiv 2412.07210, Sec. 3).

A *worker* is one instance of Megatron's partial distributed optimizer
(``num_distributed_optimizer_instances`` workers). Inside a worker the ranks form the
model-shard group: gradients are reduce-scattered there every step and each rank owns one shard
of every bucket's fp32 main parameters. Across workers, the ranks owning the same shard form
the sync group (Megatron's inter-instance group); after warmup nothing crosses it except the
pseudo-gradient exchange every H steps.

:class:`LocalSGD` holds the EDiT state of one ``DistributedOptimizer``: per bucket, this rank's
shard of the anchor and of the outer optimizer state (so 2 x 4 bytes x params / shard size per
rank), the penalty's statistics, and the schedule. It is attached to Megatron by
:mod:`megatron_edit.megatron_patches`; this module only uses the objects it is given (buckets,
bucket groups, main params and the process groups they carry), never ``parallel_state``.

One sync, per bucket shard: Delta_i = anchor - current; reduced across the sync group to one
Delta (the mean, or with the penalty a per-layer weighted mean over the workers not excluded,
then clipped per layer); the outer optimizer steps the anchor with Delta as its gradient; the
main params restart from the anchor. The penalty's per-layer norms of every worker are
exchanged once per sync (one small all-gather for all layers) before the buckets, so every rank
of every worker takes the same decisions (:mod:`megatron_edit.penalty`).

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
import re
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from . import asynchronous, compat, gta, outer, penalty
from .comm import SyncGroup, WorkerGroups
from .config import GTAConfig, LocalSGDConfig, OuterOptimizerConfig

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_key(param_name: str) -> str:
    """The layer a parameter belongs to: ``...layers.N`` for transformer layers, otherwise the
    module that owns it (``embedding.word_embeddings``, ``output_layer``, ...)."""
    name = param_name
    while name.startswith("module."):
        name = name[len("module.") :]
    m = _LAYER.match(name)
    return m.group(1) if m else name.rpartition(".")[0] or name


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
    segments: List[Tuple[int, int, int, bool]] = field(default_factory=list)
    """(start, end, layer, counts_in_norm) per main: its layer, and whether it counts in that
    layer's norm (False for a tensor-parallel duplicate on tensor-parallel rank > 0)."""
    bucket_layers: Set[int] = field(default_factory=set)
    """Layers of every param in the whole bucket (the same on every rank of the worker)."""
    anchor: Optional[torch.Tensor] = None
    delta: Optional[torch.Tensor] = None
    handle: Optional[object] = None
    consensus: Optional[torch.Tensor] = None  # GTA: the consensus message being all-reduced
    exchanged: bool = False
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

    def scale_layers(self, tensor: torch.Tensor, factors: torch.Tensor) -> None:
        """In place: each layer's segment times its factor (0 zeroes, even NaN/Inf)."""
        for s, e, layer, _ in self.segments:
            f = float(factors[layer])
            if f == 0.0:
                tensor[s:e].zero_()
            elif f != 1.0:
                tensor[s:e].mul_(f)


@dataclass
class SyncReport:
    """What one outer synchronisation did on this rank."""

    step: int
    """Optimizer steps done when the sync was due."""
    mode: str
    buckets: int
    payload_bytes: int
    """Bytes this rank all-reduced across the sync group (pseudo-gradients and norms)."""
    seconds: float
    """Time this rank spent in EDiT code for the sync (launch, wait, outer step, copies)."""
    workers: int
    steps_since_last: int = 0
    """Inner steps since the previous sync (H for synchronous EDiT)."""
    outer_lr: float = 0.0
    worker: int = 0
    """This rank's worker (its index in the sync group)."""
    layer_names: Optional[List[str]] = None
    norms: Optional[torch.Tensor] = None
    """[workers, layers]: each worker's pseudo-gradient norm per layer (penalty on)."""
    weights: Optional[torch.Tensor] = None
    """[workers, layers]: averaging weights (0 = excluded)."""
    excluded: Optional[torch.Tensor] = None
    """[workers, layers] bool: excluded as anomalous."""
    skipped: Optional[torch.Tensor] = None
    """[layers] bool: every worker excluded, outer step skipped."""
    clip_coef: Optional[torch.Tensor] = None
    """[layers]: clipping factor applied to the averaged pseudo-gradient."""
    skipped_sync: bool = False
    """A-EDiT: all workers together took fewer than min_total_global_steps: no exchange."""
    worker_steps: Optional[torch.Tensor] = None
    """A-EDiT: [workers] steps each worker took since the last real exchange."""
    worker_seconds: Optional[torch.Tensor] = None
    """A-EDiT: [workers] seconds of the latest interval (since the previous planned sync)."""

    def scalars(self) -> Dict[str, float]:
        """Flat name -> value, for Megatron's console line and TensorBoard / W&B writers."""
        out = {
            "local-sgd/sync-seconds": self.seconds,
            "local-sgd/sync-bytes": float(self.payload_bytes),
            "local-sgd/steps-since-last-sync": float(self.steps_since_last),
            "local-sgd/outer-lr": self.outer_lr,
            "local-sgd/workers": float(self.workers),
        }
        if self.norms is not None:
            own = self.norms[self.worker]
            out["local-sgd/pseudo-grad-norm"] = float(own.pow(2).sum().sqrt())
            out["local-sgd/pseudo-grad-norm-max-layer"] = float(own.max())
        if self.weights is not None:
            out["local-sgd/weight-min"] = float(self.weights.min())
            out["local-sgd/weight-own-mean"] = float(self.weights[self.worker].mean())
        if self.excluded is not None:
            out["local-sgd/excluded"] = float(self.excluded.sum())
            out["local-sgd/excluded-workers"] = float(self.excluded.any(dim=1).sum())
        if self.skipped is not None:
            out["local-sgd/skipped-layers"] = float(self.skipped.sum())
        if self.clip_coef is not None:
            out["local-sgd/clip-coef-min"] = float(self.clip_coef.min())
            out["local-sgd/clipped-layers"] = float((self.clip_coef < 1).sum())
        if self.worker_steps is not None:
            out["local-sgd/skipped-sync"] = float(self.skipped_sync)
            out["local-sgd/worker-steps-min"] = float(self.worker_steps.min())
            out["local-sgd/worker-steps-max"] = float(self.worker_steps.max())
        return out


@dataclass
class _SyncInProgress:
    step: int
    bytes_at_start: int
    seconds: float = 0.0
    weights: Optional[torch.Tensor] = None  # [W, L] float64 CPU, None: plain mean
    own_weights: Optional[torch.Tensor] = None  # [L]
    norms: Optional[torch.Tensor] = None
    excluded: Optional[torch.Tensor] = None
    skipped: Optional[torch.Tensor] = None  # [L] bool
    clip_coef: Dict[int, float] = field(default_factory=dict)
    worker_steps: Optional[torch.Tensor] = None  # A-EDiT: [W]
    worker_seconds: Optional[torch.Tensor] = None
    skipped_sync: bool = False


class LocalSGD:
    """EDiT state and schedule for one Megatron ``DistributedOptimizer``."""

    def __init__(
        self,
        optimizer,
        local_sgd_config: LocalSGDConfig,
        outer_optim_config: OuterOptimizerConfig,
        gta_config: Optional[GTAConfig] = None,
        schedule_group: Optional[dist.ProcessGroup] = None,
    ):
        """``schedule_group``: every rank of every worker (default: the world group); A-EDiT
        agrees on its schedule over it once per sync."""
        self.config = local_sgd_config
        self.schedule_group = schedule_group
        self.clock = time.monotonic  # A-EDiT's float64 clock; injectable for tests
        # The run's last optimizer step when known (Megatron-LM: --train-iters): A-EDiT then
        # ends with a sync there on every worker.
        self.final_step: Optional[int] = None
        self._next_sync_at: Optional[int] = None
        self._interval_start: Optional[float] = None
        self._interval_start_step = 0
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
        self.layer_names: List[str] = []
        self._build_shards(optimizer)
        self.layer_shards: List[List[BucketShard]] = [[] for _ in self.layer_names]
        for shard in self.shards:
            for layer in shard.bucket_layers:
                self.layer_shards[layer].append(shard)

        first_group = self.group_order[0] if self.group_order else None
        self.num_workers = optimizer.ddp_config.num_distributed_optimizer_instances
        inter = compat.inter_instance_group(first_group)
        self.sync_group = SyncGroup(inter if self.num_workers > 1 else None)
        assert self.sync_group.size == self.num_workers, (self.sync_group.size, self.num_workers)
        chunk = optimizer.model_chunks[0]
        self.worker_groups = WorkerGroups(
            shard_group=optimizer.buffers[0].data_parallel_group if optimizer.buffers else None,
            tp_group=compat.tensor_parallel_group(chunk),
        )

        self.state_device = torch.device("cpu") if self.config.cpu_offload else None
        self.outer_optimizer: Optional[torch.optim.Optimizer] = None
        c = self.config
        self._needs_norms = c.skip_anomaly or c.pseudo_gradnorm_reduce
        self._gta = self.gta_config.reducer == "gta"
        self.ewma = penalty.EWMAStats.zeros(self.num_workers, len(self.layer_names))

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
        layer_of: Dict[torch.nn.Parameter, str] = {}
        tp_rank = {}
        for index, chunk in enumerate(optimizer.model_chunks):
            groups = list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)
            # Megatron gathers bucket groups in reverse order (buckets are built backward).
            self.group_order.extend(reversed(groups))
            for group in groups:
                for bucket in group.buckets:
                    bucket_to_group[id(bucket)] = group
            tp = compat.tensor_parallel_group(chunk)
            for name, param in chunk.named_parameters():
                # Virtual pipeline chunks reuse local layer numbers: keep them apart.
                prefix = f"chunk{index}." if len(optimizer.model_chunks) > 1 else ""
                layer_of[param] = prefix + layer_key(name)
                tp_rank[param] = tp.rank() if tp is not None else 0
        # Layers of every param in this optimizer's buckets: the same list on every rank of the
        # worker (a rank's own shard may hold no element of some layer).
        self.layer_names = sorted(
            {layer_of[p] for buffer in optimizer.buffers for b in buffer.buckets for p in b.params_list}
        )
        index_of = {name: i for i, name in enumerate(self.layer_names)}

        for gbuf_index, buffer in enumerate(optimizer.buffers):
            shard_size = buffer.data_parallel_group.size()
            for (dtype_key, bucket_maps) in optimizer.gbuf_ranges[gbuf_index].items():
                for bucket_index, bucket_map in enumerate(bucket_maps):
                    bucket = buffer.buckets[bucket_index]
                    mains, local_ranges, bucket_ranges, segments = [], [], [], []
                    main_is_model = True
                    for model_param, ranges in bucket_map["param_map"].items():
                        mains.append(main_of[model_param])
                        start, end = ranges["gbuf_local"].start, ranges["gbuf_local"].end
                        local_ranges.append((start, end))
                        in_bucket = ranges["gbuf_world_in_bucket"]
                        bucket_ranges.append((in_bucket.start, in_bucket.end))
                        main_is_model &= model_param in fp32_models
                        # A tensor-parallel duplicate (e.g. a layer norm) is counted once.
                        counts = bool(getattr(model_param, "tensor_model_parallel", False)) or tp_rank[model_param] == 0
                        segments.append((start, end, index_of[layer_of[model_param]], counts))
                    shard = BucketShard(
                        bucket=bucket,
                        numel=bucket.grad_data.numel() // shard_size,
                        mains=mains,
                        local_ranges=local_ranges,
                        bucket_ranges=bucket_ranges,
                        main_is_model=main_is_model,
                        segments=segments,
                        bucket_layers={index_of[layer_of[p]] for p in bucket.params_list},
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
        if self.config.use_async:
            first = self.steps_done + asynchronous.first_interval(self.config.local_sgd_sync_interval)
            self._next_sync_at = first if self.final_step is None else min(first, self.final_step)

    # ------------------------------------------------------------ schedule
    @property
    def grads_are_local(self) -> bool:
        """Whether gradients of the step now running stay inside the worker."""
        return outer.grads_are_local(self.steps_done, self.config.local_sgd_warmup_steps)

    def _sync_due(self, steps_done: int) -> bool:
        c = self.config
        if c.use_async:
            return self._next_sync_at is not None and steps_done == self._next_sync_at
        return outer.is_sync_step(steps_done, c.local_sgd_warmup_steps, c.local_sgd_sync_interval)

    def begin_step(self) -> None:
        """Before the inner optimizer update of step ``steps_done + 1``."""
        self.flush()  # a layer-wise sync must be complete before main params change again
        if self.outer_optimizer is None and self.steps_done >= self.config.local_sgd_warmup_steps:
            self.capture_anchor()
        if self.config.use_async and self._interval_start is None and self.steps_done >= self.config.local_sgd_warmup_steps:
            # Without warmup the first interval's clock starts inside step 1 (its forward and
            # backward are not timed): only the first plan is slightly optimistic.
            self._interval_start, self._interval_start_step = self.clock(), self.steps_done
        self._in_step = True
        self._synced_in_step = False

    def after_inner_update(self) -> None:
        """Inner update done, main params not yet copied into the model (step-end sync point)."""
        if (
            self._in_step
            and self.config.sync_mode == "step_end"
            and self._sync_due(self.steps_done + 1)
        ):
            if self._start_sync(self.steps_done + 1):
                self._complete(self.shards, write_model=False)
            self._synced_in_step = True

    def end_step(self) -> None:
        """After the optimizer step: count it, and schedule the layer-wise sync if due."""
        self._in_step = False
        self.steps_done += 1
        if self.config.use_async and self.steps_done == self.config.local_sgd_warmup_steps:
            self._interval_start, self._interval_start_step = self.clock(), self.steps_done
        if not self._sync_due(self.steps_done):
            return
        if self.config.sync_mode == "step_end":
            assert self._synced_in_step, "step-end sync did not run inside the optimizer step"
            return
        if not self._start_sync(self.steps_done):
            return
        for shard in self.shards:
            shard.pending = True
        if self.group_order:
            self._launch(self.group_shards[self.group_order[0]])

    # ------------------------------------------------------------ the sync
    def _start_sync(self, step: int) -> bool:
        """Begin the sync due after ``step``; False when A-EDiT skips it (no exchange)."""
        assert self._sync is None
        self._sync = _SyncInProgress(step, self.sync_group.counters.payload_bytes)
        if self.config.use_async:
            self._plan_async(step)
            if self._sync.skipped_sync:
                self._finish_sync_if_done()
                return False
        if self._needs_norms:
            t0 = time.perf_counter()
            self._decide()
            self._sync.seconds += time.perf_counter() - t0
        elif self._gta or self.config.use_step_weight:  # explicit weights: start from the mean
            W, L = self.sync_group.size, len(self.layer_names)
            self._set_weights(torch.full((W, L), 1.0 / W, dtype=torch.float64), None)
        return True

    def _set_weights(self, weights: torch.Tensor, excluded: Optional[torch.Tensor]) -> None:
        c = self.config
        if c.use_step_weight:
            if excluded is None:
                excluded = torch.zeros_like(weights, dtype=torch.bool)
            weights = asynchronous.blend_step_weights(weights, self._sync.worker_steps, excluded, c.step_weight_ratio)
        self._sync.weights = weights
        self._sync.own_weights = weights[self.sync_group.rank]

    def _plan_async(self, step: int) -> None:
        """A-EDiT: one small all-reduce over every rank -> identical schedule everywhere."""
        c, sync = self.config, self._sync
        message = asynchronous.schedule_message(
            self.sync_group.size,
            self.sync_group.rank,
            step - self._last_sync_step,
            step - self._interval_start_step,
            self.clock() - self._interval_start,
            step,
        )
        device = self._work_device(self.shards[0]) if self.shards else torch.device("cpu")
        message = self.sync_group.all_reduce_max_everywhere(message.to(device), self.schedule_group).cpu()
        steps, interval_steps, interval_seconds, step_counts = asynchronous.read_schedule(message)
        sync.worker_steps, sync.worker_seconds = steps, interval_seconds
        final = self.final_step is not None and step >= self.final_step
        # The run's last sync is never skipped: the workers end with identical models.
        sync.skipped_sync = not final and asynchronous.skip_sync(steps, c.min_total_global_steps)
        plan = asynchronous.plan_next_interval(interval_steps, interval_seconds, c.local_sgd_sync_time)
        nxt = asynchronous.next_sync_steps(step_counts, plan, self.final_step)
        self._next_sync_at = None if final else int(nxt[self.sync_group.rank])
        self._interval_start, self._interval_start_step = self.clock(), step

    @torch.no_grad()
    def _delta(self, shard: BucketShard) -> torch.Tensor:
        device = self._work_device(shard)
        delta = shard.read_current(torch.empty(shard.numel, dtype=torch.float32, device=device))
        return outer.pseudo_gradient(shard.anchor.to(device, non_blocking=True), delta, out=delta)

    def _layer_norms(self, shards: List[BucketShard], layers: Optional[Set[int]] = None) -> torch.Tensor:
        """[L] float64: this worker's norm of each layer over ``shards`` (``shard.delta``),
        summed over the model-shard and tensor-parallel groups (worker-local collectives)."""
        device = self._work_device(shards[0]) if shards else torch.device("cpu")
        partial = torch.zeros(len(self.layer_names), dtype=torch.float64, device=device)
        for shard in shards:
            for s, e, layer, counts in shard.segments:
                if counts and (layers is None or layer in layers):
                    partial[layer] += shard.delta[s:e].double().pow(2).sum()
        return self.worker_groups.sum(partial).sqrt().cpu()

    @torch.no_grad()
    def _decide(self) -> None:
        """Per-layer norms of every worker (one all-gather), then the penalty's decisions."""
        c, sync = self.config, self._sync
        for shard in self.shards:
            shard.delta = self._delta(shard)
        own = self._layer_norms(self.shards)
        norms = self.sync_group.all_gather(own.to(self._work_device(self.shards[0]))).cpu()
        excluded = None
        if c.skip_anomaly:
            excluded, self.ewma = penalty.detect_anomalies(
                norms, self.ewma, c.ewma_alpha, c.ewma_warmup_steps, c.ewma_threshold
            )
        temperature = c.weight_softmax_temperature if c.weight_softmax_temperature is not None else 1.0
        self._set_weights(penalty.averaging_weights(norms, excluded, c.pseudo_gradnorm_reduce, temperature), excluded)
        sync.norms, sync.excluded = norms, excluded
        sync.skipped = penalty.skipped_layers(excluded, len(self.layer_names))

    def _finish_sync_if_done(self) -> None:
        if self._sync is None or any(s.pending for s in self.shards):
            return
        sync, self._sync = self._sync, None
        clip = None
        if self.config.clip_pseudo_grad is not None:
            clip = torch.tensor([sync.clip_coef.get(i, 1.0) for i in range(len(self.layer_names))])
        report = SyncReport(
            step=sync.step,
            mode=self.config.sync_mode,
            buckets=len(self.shards),
            payload_bytes=self.sync_group.counters.payload_bytes - sync.bytes_at_start,
            seconds=sync.seconds,
            workers=self.sync_group.size,
            steps_since_last=sync.step - self._last_sync_step,
            outer_lr=float(self.outer_optimizer.param_groups[0]["lr"]),
            worker=self.sync_group.rank,
            layer_names=self.layer_names,
            norms=sync.norms,
            weights=sync.weights,
            excluded=sync.excluded,
            skipped=sync.skipped,
            clip_coef=clip,
            skipped_sync=sync.skipped_sync,
            worker_steps=sync.worker_steps,
            worker_seconds=sync.worker_seconds,
        )
        if not sync.skipped_sync:  # a skipped sync exchanged nothing: keep counting from the last one
            self._last_sync_step = sync.step
        self.reports.append(report)
        if self.config.is_debug:
            logger.info("rank %d: %s", dist.get_rank(), report)

    @torch.no_grad()
    def _launch(self, shards: List[BucketShard]) -> None:
        """Start the asynchronous exchange of ``shards`` (each worker's weighted Delta)."""
        t0 = time.perf_counter()
        for shard in shards:
            if shard.handle is not None or shard.exchanged:
                continue
            if shard.delta is None:
                shard.delta = self._delta(shard)
            if self._gta:
                self._gta_launch(shard)
                continue
            if self._sync.own_weights is not None:
                shard.scale_layers(shard.delta, self._sync.own_weights)
            shard.handle = self.sync_group.all_reduce_sum(shard.delta, async_op=True)
        self._sync.seconds += time.perf_counter() - t0

    def _gta_launch(self, shard: BucketShard) -> None:
        """GTA phase 1: sparsify, weight, start the consensus all-reduce (if any)."""
        g = self.gta_config
        generator = None
        if g.sparsification_method in ("random", "rescaled_random"):
            # Deterministic per (sync, worker, shard): reproducible and resumable.
            seed = (self._sync.step * 1_000_003 + self.sync_group.rank * 10_007
                    + self.worker_groups.shard_rank * 101 + self.shards.index(shard))
            generator = torch.Generator().manual_seed(seed)
        gta.sparsify(shard.delta, shard.segments, g.density, g.sparsification_method, generator)
        shard.scale_layers(shard.delta, self._sync.own_weights)
        if g.consensus_method is None:
            self._gta_merge_launch(shard, None)
            return
        shard.consensus = gta.consensus_message(shard.delta, g.consensus_method, g.int8_mask)
        shard.handle = self.sync_group.all_reduce_sum(shard.consensus, async_op=True)

    def _gta_merge_launch(self, shard: BucketShard, consensus: Optional[torch.Tensor]) -> None:
        """GTA phase 2: keep the agreeing entries; all-reduce them and who kept them."""
        g = self.gta_config
        gta.agree(shard.delta, consensus)
        shard.consensus = None
        if g.normalize:
            # The mask must be read before the in-place all-reduce of the entries starts.
            if g.int8_mask:
                mask = gta.encode_mask_bits(shard.delta, self.sync_group.rank, self.sync_group.size)
            else:
                mask = (shard.delta != 0).to(torch.float32)
                shard.scale_layers(mask, self._sync.own_weights)
            shard.consensus = mask  # reused slot: the mask travelling with phase 2
        handles = [self.sync_group.all_reduce_sum(shard.delta, async_op=True)]
        if shard.consensus is not None:
            handles.append(self.sync_group.all_reduce_sum(shard.consensus, async_op=True))
        shard.handle = handles

    @torch.no_grad()
    def _finish_exchange(self, shards: List[BucketShard]) -> None:
        """Wait for the exchanges: shard.delta becomes the reduced pseudo-gradient."""
        self._launch(shards)
        t0 = time.perf_counter()
        for shard in shards:
            if shard.exchanged:
                continue
            if self._gta:
                self._gta_finish(shard)
            else:
                shard.handle.wait()
                shard.handle = None
                if self._sync.weights is None:
                    outer.mean_from_sum(shard.delta, self.sync_group.size)
            shard.exchanged = True
        self._sync.seconds += time.perf_counter() - t0

    def _gta_finish(self, shard: BucketShard) -> None:
        if not isinstance(shard.handle, list):  # phase 1 (consensus) still to finish
            shard.handle.wait()
            self._gta_merge_launch(shard, shard.consensus)
        for handle in shard.handle:
            handle.wait()
        shard.handle = None
        denominator = None
        if self.gta_config.normalize:
            denominator = shard.consensus
            if self.gta_config.int8_mask:
                denominator = gta.decode_denominator(
                    shard.consensus, shard.segments, self._sync.weights, torch.empty_like(shard.delta)
                )
        gta.merge(shard.delta, denominator)
        shard.consensus = None

    @torch.no_grad()
    def _ensure_clip_coefficients(self, shards: List[BucketShard]) -> None:
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
        ready = {
            layer
            for layer in range(len(self.layer_names))
            if layer not in coef and all(s.exchanged for s in self.layer_shards[layer])
        }
        involved = {id(s): s for layer in ready for s in self.layer_shards[layer]}
        norms = self._layer_norms(list(involved.values()), ready)
        factors = penalty.clip_coefficients(norms, tau)
        for layer in ready:
            coef[layer] = float(factors[layer])

    @torch.no_grad()
    def _apply(self, shard: BucketShard, write_model: bool) -> None:
        """Outer step of one shard with its reduced Delta; mains restart from the anchor."""
        sync = self._sync
        delta = shard.delta
        if sync.clip_coef:
            shard.scale_layers(delta, torch.tensor([sync.clip_coef.get(i, 1.0) for i in range(len(self.layer_names))]))
        skipped = []
        if sync.skipped is not None:
            skipped = [(s, e) for s, e, layer, _ in shard.segments if sync.skipped[layer]]
        saved = self._save_segments(shard, skipped)
        grad = delta.to(shard.anchor.device, non_blocking=True)
        outer.outer_step(self.outer_optimizer, [shard.anchor], [grad])
        self._restore_segments(shard, saved)
        shard.write_mains(shard.anchor.to(delta.device, non_blocking=True))
        if write_model:
            shard.write_model_shard()
        shard.delta = None
        shard.exchanged = False
        shard.pending = False

    def _save_segments(self, shard: BucketShard, ranges) -> list:
        """Anchor and outer-state values of skipped layers, to undo the outer step there."""
        if not ranges:
            return []
        tensors = [shard.anchor] + [
            v for v in self.outer_optimizer.state.get(shard.anchor, {}).values()
            if torch.is_tensor(v) and v.shape == shard.anchor.shape
        ]
        return [(t, s, e, t[s:e].clone()) for t in tensors for s, e in ranges]

    def _restore_segments(self, shard: BucketShard, saved: list) -> None:
        state = self.outer_optimizer.state.get(shard.anchor, {})
        for t, s, e, values in saved:
            t[s:e].copy_(values)
        # State created by this very step (e.g. the first momentum buffer) starts at zero there.
        if saved:
            saved_ids = {id(t) for t, *_ in saved}
            for v in state.values():
                if torch.is_tensor(v) and v.shape == shard.anchor.shape and id(v) not in saved_ids:
                    for _, s, e, _ in saved:
                        v[s:e].zero_()

    @torch.no_grad()
    def _complete(self, shards: List[BucketShard], write_model: bool) -> None:
        """Finish the exchange of ``shards``, step their anchors, restart their mains."""
        self._finish_exchange(shards)
        t0 = time.perf_counter()
        self._ensure_clip_coefficients(shards)
        for shard in shards:
            self._apply(shard, write_model)
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
            later_shards = [s for s in self.group_shards[later] if s.pending]
            if later_shards:
                self._launch(later_shards)
                break
        self._complete([s for s in shards if s.pending], write_model=True)

    def flush(self) -> None:
        """Complete every pending exchange now (before state is read or params change)."""
        pending = [s for s in self.shards if s.pending]
        if pending:
            self._complete(pending, write_model=True)

    @property
    def sync_in_progress(self) -> bool:
        """A layer-wise sync is pending: it completes in the next forward pass (or a flush)."""
        return self._sync is not None

    def drain_reports(self) -> List[SyncReport]:
        reports, self.reports = self.reports, []
        return reports

    # ------------------------------------------------------------ state
    def extra_state(self) -> dict:
        """Picklable state identical on every rank (for checkpoints): counters and the anomaly
        detector's statistics."""
        return {
            "steps_done": self.steps_done,
            "last_sync_step": self._last_sync_step,
            "layer_names": list(self.layer_names),
            "ewma": self.ewma.state_dict(),
            # A-EDiT: the planned next sync; the clock restarts on resume (elapsed time while
            # the job was down is not training time).
            "next_sync_at": self._next_sync_at,
        }

    def load_extra_state(self, state: dict) -> None:
        if list(state["layer_names"]) != self.layer_names:
            raise ValueError(
                "EDiT checkpoint state was saved for different layers: "
                f"{state['layer_names'][:3]}... vs {self.layer_names[:3]}..."
            )
        self.steps_done = int(state["steps_done"])
        self._last_sync_step = int(state["last_sync_step"])
        self.ewma = penalty.EWMAStats.from_state_dict(state["ewma"])
        self._next_sync_at = state.get("next_sync_at")
        if self._next_sync_at is not None:
            self._interval_start = self.clock()

    def state_bytes(self) -> int:
        """Bytes of EDiT state on this rank: anchor + outer optimizer state."""
        total = sum(s.anchor.numel() * s.anchor.element_size() for s in self.shards if s.anchor is not None)
        if self.outer_optimizer is not None:
            for state in self.outer_optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        total += v.numel() * v.element_size()
        return total
