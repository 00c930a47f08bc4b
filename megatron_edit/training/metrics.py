"""EDiT's sync metrics on Megatron-LM's console line and in TensorBoard / W&B.

Every key of ``SyncReport.scalars()`` (so new ones flow through) is accumulated between
Megatron's log points and written through Megatron's own writers, from the rank that logs
(Megatron's last rank): bytes and seconds are that rank's share of the sync. With the per-sync
record on, that rank's worker's records go to the same writers at the same points
(:mod:`megatron_edit.training.record_log`: the worker's figures, at each record's step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from .record_log import write_records

SUMMED_KEYS = frozenset({"local-sgd/sync-seconds", "local-sgd/sync-bytes", "local-sgd/exposed-wait-seconds"})
"""Keys of ``SyncReport.scalars()`` that add up over syncs; every other key is a level (the
latest sync's value is reported)."""


_ACROSS_OPTIMIZERS = {
    "local-sgd/pseudo-grad-norm": lambda a, b: math.hypot(a, b),  # disjoint layers (MoE: experts)
    "local-sgd/pseudo-grad-norm-max-layer": max,
    "local-sgd/weight-min": min,
    "local-sgd/clip-coef-min": min,
    "local-sgd/excluded": lambda a, b: a + b,
    "local-sgd/excluded-workers": max,
    "local-sgd/skipped-layers": lambda a, b: a + b,
    "local-sgd/clipped-layers": lambda a, b: a + b,
}
"""How one sync's reports of several optimizers combine (they hold disjoint layers)."""


def merge_reports(reports: Iterable) -> List[Tuple[int, Dict[str, float]]]:
    """One (step, scalars) per sync, in step order.

    A rank with several distributed optimizers (a chained optimizer: a MoE model with expert
    parallelism has a dense and an expert one) has one report per optimizer for the same sync:
    their summed keys add up, the per-layer figures combine over the layers of both (the
    pseudo-gradient norm over the whole model, the largest layer, the smallest weight and clip
    factor, the layer counts added), other keys take the last optimizer's value.
    """
    by_step: Dict[int, Dict[str, float]] = {}
    for report in reports:
        merged = by_step.setdefault(report.step, {})
        for key, value in report.scalars().items():
            if key in merged and (key in SUMMED_KEYS or key in _ACROSS_OPTIMIZERS):
                combine = _ACROSS_OPTIMIZERS.get(key, lambda a, b: a + b)
                merged[key] = float(combine(merged[key], value))
            else:
                merged[key] = value
    return sorted(by_step.items())


@dataclass
class _Window:
    """Syncs completed since a log point."""

    syncs: int = 0
    last_step: Optional[int] = None
    values: Dict[str, float] = field(default_factory=dict)

    def add(self, step: int, scalars: Dict[str, float]) -> None:
        self.syncs += 1
        self.last_step = step
        for key, value in scalars.items():
            self.values[key] = self.values.get(key, 0.0) + value if key in SUMMED_KEYS else value

    def scalars(self) -> Dict[str, float]:
        out = {"local-sgd/syncs": float(self.syncs)}
        if self.syncs:
            out["local-sgd/last-sync-step"] = float(self.last_step)
            out.update(self.values)
        return out


class SyncMetrics:
    """The sync reports of one rank, accumulated between Megatron's log points.

    Two windows, because Megatron has two intervals: the console line (``--log-interval``) and
    TensorBoard / W&B (``--tensorboard-log-interval``). Each window reports, when it is emitted:
    ``local-sgd/syncs`` (syncs completed since the window's previous emission),
    ``local-sgd/last-sync-step`` (the optimizer step the latest of them was due after), the sum
    over those syncs of the :data:`SUMMED_KEYS` (time, bytes), and the latest sync's value of
    every other key. No report is lost between emissions.
    """

    def __init__(self):
        self.total_syncs = 0
        self._console = _Window()
        self._writers = _Window()

    def collect(self, controllers: Iterable) -> None:
        """Take the new reports of this rank's EDiT objects (``LocalSGD.drain_reports``)."""
        reports = [r for c in controllers for r in c.drain_reports()]
        for step, scalars in merge_reports(reports):
            self.total_syncs += 1
            self._console.add(step, scalars)
            self._writers.add(step, scalars)

    def console(self, reset: bool = True) -> str:
        """Fields to append to Megatron's console line (`` name: value |`` like Megatron's)."""
        text = "".join(f" {_short(k)}: {_fmt(v)} |" for k, v in self._console.scalars().items())
        if reset:
            self._console = _Window()
        return text

    def write(self, writer, wandb_writer, iteration: int) -> Dict[str, float]:
        """Write the window to Megatron's TensorBoard writer and W&B writer (either may be
        None) at ``iteration``; returns what was written."""
        scalars = self._writers.scalars()
        self._writers = _Window()
        if writer is not None:
            for key, value in scalars.items():
                writer.add_scalar(key, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log(scalars, iteration)
        return scalars


def _short(key: str) -> str:
    return key.replace("local-sgd/", "local-sgd ").replace("-", " ")


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def training_log_fields(
    metrics: SyncMetrics,
    controllers: Iterable,
    args,
    iteration: int,
    writer,
    wandb_writer,
    is_first_iteration: bool = False,
    sync_record=None,
) -> str:
    """What Megatron-LM's ``training_log`` does for EDiT at ``iteration``; returns the console
    fields (empty when this is not a console iteration).

    Same conditions as Megatron's: TensorBoard / W&B when the TensorBoard writer exists (the
    last rank) and ``iteration % tensorboard_log_interval == 0``; the console line when
    ``iteration % log_interval == 0`` or on the first iteration (which, like Megatron, does not
    reset the console window). ``sync_record``: the session's per-sync record (``SyncRecord``),
    whose records a reader writes at the TensorBoard points (:mod:`.record_log`), or None.
    """
    controllers = list(controllers)
    if not controllers:
        return ""
    metrics.collect(controllers)
    if writer and iteration % args.tensorboard_log_interval == 0:
        metrics.write(writer, wandb_writer, iteration)
        if sync_record is not None and sync_record.reader:
            write_records(sync_record.take(), writer, wandb_writer, iteration)
    if iteration % args.log_interval == 0 or is_first_iteration:
        return metrics.console(reset=not is_first_iteration) + global_progress_field(controllers[0])
    return ""


def global_progress_field(controller) -> str:
    """A-EDiT: the console field with global progress (synchronous iterations, the same on every
    worker at a sync) over the run's length; Megatron's ``iteration n/m`` on the same line is
    this worker's own step count over the loop's cap. Empty otherwise."""
    budget = getattr(controller, "budget_steps", None)
    if not controller.config.use_async or budget is None:
        return ""
    return f" global iteration: {controller.global_progress:.2f}/{budget // controller.budget_workers} |"
