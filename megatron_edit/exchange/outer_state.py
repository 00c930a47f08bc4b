"""The anchor of every shard and the outer optimizer that steps it (arXiv 2412.07210, Sec. 3).

The anchor is the shard's value at the last sync; the outer optimizer (any ``torch.optim``
class, by default Nesterov SGD) steps it with the reduced pseudo-gradient as its gradient, and
every worker restarts from it. Both are sharded like the main parameters: this rank keeps its
shard of each bucket, 2 x 4 bytes x params / shard size with momentum SGD.

Two ways to step, same math:

* the default outer optimizer (``torch.optim.SGD`` with momentum, no weight decay) is stepped by
  :func:`~megatron_edit.algorithm.outer.fused_momentum_sgd_step_`, which also writes the main
  params and the model's 16-bit copy; on a GPU it is compiled into one kernel (one read of
  anchor, momentum and pseudo-gradient, one write of each output), elsewhere it runs eagerly;
* any other optimizer goes through ``torch.optim``'s own ``step`` (the generic path), then the
  writes.

The torch optimizer object exists on both paths: it holds the state (``momentum_buffer``) and
the hyperparameters, so checkpoints and logs do not depend on the path.

``cpu_offload``: the state lives in (pinned) host memory; at a sync each shard's anchor and
outer state are paged onto the shard's device, stepped there with the same kernels as without
offload (so the numbers are the same), and copied back asynchronously, in stream order.
:meth:`OuterState.synchronize` waits for those copies before the host reads or writes the
state (checkpoints).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..algorithm import outer
from ..config import OuterOptimizerConfig
from .shard import BucketShard

logger = logging.getLogger(__name__)


_COMPILED_STEP = None
_COMPILE_LOCK = threading.Lock()


def _compiled_step():
    """The compiled fused step, one for the process: dynamo keeps its compiled variants (first
    step or not, a length of 1 or more, ...) per compiled callable, so one callable per
    :class:`OuterState` would compile them again for each and soon hit dynamo's recompile
    limit. Built once under a lock (``functools.lru_cache`` runs the factory once per thread
    that misses its cache at the same time). Calls are serialized: dynamo is not thread-safe,
    and two threads missing its cache at once (workers as threads, as in the tests) would each
    add a variant."""
    global _COMPILED_STEP
    with _COMPILE_LOCK:
        if _COMPILED_STEP is None:
            compiled = torch.compile(outer.fused_momentum_sgd_step_, dynamic=True, fullgraph=True)
            lock = threading.Lock()

            def step(*args):
                with lock:
                    compiled(*args)

            _COMPILED_STEP = step
        return _COMPILED_STEP


class OuterState:
    """Anchors and outer-optimizer state of one optimizer's shards.

    ``state_device``: where the state lives (None: with the shard; ``cpu`` for
    ``cpu_offload``, pinned when CUDA is present). ``fused``: use the fused momentum-SGD step
    when the outer optimizer allows it. ``compile``: compile it (None: on CUDA devices only).
    ``paged``: force paging even when the state already lives on the shard's device (tests).
    """

    def __init__(
        self,
        config: OuterOptimizerConfig,
        state_device: Optional[torch.device] = None,
        fused: bool = True,
        compile: Optional[bool] = None,
        paged: bool = False,
    ):
        self.config = config
        self.state_device = state_device
        self.optimizer: Optional[torch.optim.Optimizer] = None
        kwargs = config.outer_optim_kwargs
        self.fused = fused and outer.is_plain_momentum_sgd(config.optimizer_class, kwargs)
        self._compile = compile
        self._force_paged = paged
        self._scales = {}
        self._host_copies_pending = False

    @property
    def captured(self) -> bool:
        return self.optimizer is not None

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0

    def _paged(self, shard: BucketShard) -> bool:
        return self._force_paged or (shard.anchor is not None and shard.anchor.device != shard.device)

    # ------------------------------------------------------------------ anchor
    @torch.no_grad()
    def capture(self, shards: Sequence[BucketShard]) -> None:
        """Anchor := the current main params; the outer optimizer starts with empty state."""
        anchors = []
        for shard in shards:
            device = self.state_device or shard.device
            pin = device.type == "cpu" and torch.cuda.is_available()
            anchor = torch.empty(shard.numel, dtype=torch.float32, device=device, pin_memory=pin)
            if device == shard.device:
                shard.read_current(anchor)
            else:
                anchor.copy_(shard.read_current(torch.empty(shard.numel, device=shard.device)))
            shard.anchor = anchor
            anchors.append(anchor)
        self.optimizer = self.config.optimizer_class(anchors, **self.config.outer_optim_kwargs)

    def anchor_on_device(self, shard: BucketShard) -> torch.Tensor:
        """The anchor on the shard's device (a copy in stream order when offloaded)."""
        if shard.anchor.device == shard.device:
            return shard.anchor
        self._host_copies_pending = True
        return shard.anchor.to(shard.device, non_blocking=True)

    def synchronize(self) -> None:
        """Wait for the asynchronous copies between host state and device (offload) before the
        host reads or writes the state."""
        if self._host_copies_pending and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._host_copies_pending = False

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def apply(
        self,
        shard: BucketShard,
        delta: torch.Tensor,
        skipped: List[Tuple[int, int]],
        write_model: bool,
        divisor: int = 1,
        layer_scales: Optional[Dict[int, torch.Tensor]] = None,
        merge_alpha: Optional[float] = None,
        keep_from: Optional[torch.Tensor] = None,
    ) -> None:
        """Outer step of one shard with the pseudo-gradient ``delta / divisor`` (``delta`` is
        scratch: it is overwritten), then the main params (and, with ``write_model``, the
        model's 16-bit copy) restart from the new anchor. The ranges in ``skipped`` (layers every
        worker was excluded from) keep their anchor and outer state. ``layer_scales``: a factor
        per layer (0-dim tensors on the device, e.g. clip factors; a 0 factor zeroes the layer's
        pseudo-gradient, even NaN/Inf), folded into the compiled kernel (no pass of its own) and
        otherwise applied to ``delta`` first. ``merge_alpha`` (a delayed outer step): the mains
        are merged with the new anchor instead, ``theta <- alpha theta + (1 - alpha) anchor'``
        (0: the anchor itself), one elementwise pass after the step; with ``keep_from`` (the
        mains at the launch; scratch) ``theta <- theta + (anchor' - keep_from)`` instead."""
        restart = merge_alpha is None
        with self._on_device(shard):
            if self.fused and not skipped:
                self._fused_step(shard, delta, write_model and restart, divisor, layer_scales, restart)
            else:
                if layer_scales:
                    shard.scale_layers(delta, layer_scales)
                outer.mean_from_sum(delta, divisor)
                saved = self._save_segments(shard, skipped)
                outer.outer_step(self.optimizer, [shard.anchor], [delta])
                self._restore_segments(shard, saved)
                if restart:
                    shard.write_mains(shard.anchor)
                    if write_model:
                        shard.write_model(shard.anchor)
            if keep_from is not None:
                self._keep_local(shard, keep_from, write_model)
            elif not restart:
                self._merge(shard, float(merge_alpha), write_model)

    @staticmethod
    def _merge(shard: BucketShard, alpha: float, write_model: bool) -> None:
        """Mains := alpha * mains + (1 - alpha) * anchor (``lerp`` towards the anchor; padding
        stays 0, where both are 0)."""
        if alpha == 0.0:
            shard.write_mains(shard.anchor)
        elif shard.flat_mains is not None:
            shard.flat_mains.lerp_(shard.anchor, 1.0 - alpha)
        elif shard.mains:
            torch._foreach_lerp_([m.view(-1) for m in shard.mains], shard.main_views(shard.anchor), 1.0 - alpha)
        if write_model:
            shard.write_model(shard.read_current(torch.empty_like(shard.anchor)))

    @staticmethod
    def _keep_local(shard: BucketShard, launch: torch.Tensor, write_model: bool) -> None:
        """Mains += anchor' - mains at the launch (the new anchor plus the progress since; the
        padding stays 0, where all three are 0). ``launch`` is overwritten."""
        correction = torch.sub(shard.anchor, launch, out=launch)
        if shard.flat_mains is not None:
            shard.flat_mains.add_(correction)
        elif shard.mains:
            torch._foreach_add_([m.view(-1) for m in shard.mains], shard.main_views(correction))
        if write_model:
            shard.write_model(shard.read_current(torch.empty_like(shard.anchor)))

    def _fused_step(self, shard: BucketShard, delta: torch.Tensor, write_model: bool, divisor: int,
                    layer_scales: Optional[Dict[int, torch.Tensor]] = None, restart: bool = True) -> None:
        """Compiled: one kernel call for the shard, or with ``layer_scales`` one per piece of one
        layer (:attr:`BucketShard.layer_spans`) with the layer's factor / ``divisor`` as its
        scale (the factors cost no pass). Eager: the factors scale ``delta`` first."""
        group = self.optimizer.param_groups[0]
        state = self.optimizer.state[shard.anchor]
        first = "momentum_buffer" not in state or state["momentum_buffer"] is None
        momentum = torch.empty_like(shard.anchor) if first else state["momentum_buffer"]
        mains = shard.flat_mains if restart else None  # a merge follows: leave the mains
        model = shard.model if write_model else None
        lr, mu, nesterov = float(group["lr"]), float(group["momentum"]), bool(group["nesterov"])
        if self.compiles(shard.device):
            inverse = self._scale(divisor, shard.device)
            pieces, scales = [(0, shard.numel, None)], {}
            if layer_scales:
                pieces = shard.layer_spans
                # factor / divisor in the factor's precision (fp64 clip factors), used in fp32
                scales = {layer: (layer_scales[layer] / divisor).to(torch.float32)
                          for layer in {layer for _, _, layer in pieces if layer is not None}}
            kernel = _compiled_step()
            for s, e, layer in pieces:
                kernel(shard.anchor[s:e], momentum[s:e], delta[s:e], inverse if layer is None else scales[layer],
                       lr, mu, nesterov, first, None if mains is None else mains[s:e],
                       None if model is None else model[s:e])
        else:
            if layer_scales:
                shard.scale_layers(delta, layer_scales)
            outer.mean_from_sum(delta, divisor)
            outer.momentum_sgd_step_(shard.anchor, momentum, delta, lr, mu, nesterov, first)
            if mains is not None:
                mains.copy_(shard.anchor)
            if model is not None:
                model.copy_(shard.anchor)
        state["momentum_buffer"] = momentum
        if mains is None and restart:
            shard.write_mains(shard.anchor)

    def compiles(self, device: torch.device) -> bool:
        """Whether the fused step runs as a compiled kernel on ``device``."""
        return self._compile if self._compile is not None else device.type == "cuda"

    def _scale(self, divisor: int, device: torch.device) -> torch.Tensor:
        """1 / divisor as a 0-dim fp32 tensor on ``device``, made once per (divisor, device): a
        host -> device copy at every sync would wait for the device."""
        key = (divisor, device)
        cached = self._scales.get(key)
        if cached is None:
            cached = self._scales[key] = torch.full((), 1.0 / divisor, dtype=torch.float32, device=device)
        return cached

    @contextlib.contextmanager
    def _on_device(self, shard: BucketShard):
        """Inside: the shard's anchor and outer state are on the shard's device (paged in and,
        on exit, out again when offloaded). The tensor objects stay the same (their ``.data``
        moves), so the optimizer's state keeps its keys."""
        if not self._paged(shard):
            yield
            return
        host_device = shard.anchor.device
        state = self.optimizer.state[shard.anchor]
        tensors = [shard.anchor] + [v for v in state.values() if torch.is_tensor(v) and v.shape == shard.anchor.shape]
        homes = [t.data for t in tensors]
        for t in tensors:
            t.data = t.data.to(shard.device, non_blocking=True)
        try:
            yield
        finally:
            pin = host_device.type == "cpu" and torch.cuda.is_available()
            for key, value in list(state.items()):  # state created by this step: a host home
                if torch.is_tensor(value) and value.shape == shard.anchor.shape and all(value is not t for t in tensors):
                    home = torch.empty(value.shape, dtype=value.dtype, device=host_device, pin_memory=pin)
                    home.copy_(value, non_blocking=True)
                    state[key] = home
            for t, home in zip(tensors, homes):
                home.copy_(t.data, non_blocking=True)
                t.data = home
            self._host_copies_pending = True

    def _state_tensors(self, shard: BucketShard) -> List[torch.Tensor]:
        return [
            v for v in self.optimizer.state.get(shard.anchor, {}).values()
            if torch.is_tensor(v) and v.shape == shard.anchor.shape
        ]

    def _save_segments(self, shard: BucketShard, ranges) -> list:
        """Anchor and outer-state values of skipped layers, to undo the outer step there."""
        if not ranges:
            return []
        tensors = [shard.anchor] + self._state_tensors(shard)
        return [(t, s, e, t[s:e].clone()) for t in tensors for s, e in ranges]

    def _restore_segments(self, shard: BucketShard, saved: list) -> None:
        for t, s, e, values in saved:
            t[s:e].copy_(values)
        # State created by this very step (e.g. the first momentum buffer) starts at zero there.
        if saved:
            saved_ids = {id(t) for t, *_ in saved}
            for v in self._state_tensors(shard):
                if id(v) not in saved_ids:
                    for _, s, e, _ in saved:
                        v[s:e].zero_()

    def state_bytes(self, shards: Sequence[BucketShard]) -> int:
        """Bytes of anchors, outer-optimizer state and error-feedback residuals on this rank."""
        total = 0
        for shard in shards:
            for t in (shard.anchor, shard.residual, shard.chunk_residual):
                if t is not None:
                    total += t.numel() * t.element_size()
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        total += v.numel() * v.element_size()
        return total
