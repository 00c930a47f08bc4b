"""The record of an EDiT checkpoint: counters, layout and outer-optimizer scalars (EDiT, arXiv
2412.07210; format in :mod:`megatron_edit.mcore.checkpoint`).

Two picklable objects per distributed optimizer:

* the *run record* (``local_sgd.record``, written by global rank 0): what every rank needs,
  whatever the new layout: step counters, whether the anchor was taken, the layout it was saved
  with (workers, ranks per worker, tensor / pipeline parallel sizes, Megatron's optimizer
  format), the outer optimizer's class, hyperparameters and scalar state, which per-element
  outer state and residuals were written;
* the *slice record* (``local_sgd.slice.dp_group_idx_<g>``, one per tensor / pipeline slice):
  :meth:`LocalSGD.extra_state` (the anomaly detector's per-worker, per-layer statistics and
  A-EDiT's plan), which only means something for the same layers and workers.

:func:`layout_difference` names what differs between the saved layout and this run's.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ...config import NotSupportedYet
from .. import compat
from .keys import PREFIX, CheckpointStateError

FORMAT = "megatron_edit.local_sgd/2"
"""Per-parameter (model-space) EDiT state: reshards across workers, shards, TP and PP."""
OLD_FORMATS = {"megatron_edit.local_sgd/1": "per-bucket EDiT state, same layout only"}
RECORD_KEY = f"{PREFIX}record"
FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space")
"""Megatron's optimizer formats whose inner state follows a TP / PP change."""


def slice_key(dp_group_idx: int) -> str:
    return f"{PREFIX}slice.dp_group_idx_{dp_group_idx}"


def outer_state_keys(controller) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(per-element tensor keys, scalar keys) of the outer optimizer's per-parameter state.

    Found by one step of the configured optimizer class on a dummy tensor, so a loading run
    knows which tensors to ask for before it has any state of its own.
    """
    cfg = controller.outer_config
    probe = torch.zeros(2)
    try:
        opt = cfg.optimizer_class([probe], **cfg.outer_optim_kwargs)
        probe.grad = torch.ones(2)
        opt.step()
    except Exception as e:  # pragma: no cover - exotic optimizers
        raise NotSupportedYet(
            f"megatron_edit cannot checkpoint the outer optimizer {cfg.optimizer_class.__name__}: "
            f"a probe step failed ({e})."
        ) from e
    tensors, scalars = [], []
    for key, value in opt.state[probe].items():
        (tensors if torch.is_tensor(value) and value.shape == probe.shape else scalars).append(key)
    return tuple(sorted(tensors)), tuple(sorted(scalars))


def parallel_sizes(optimizer) -> Tuple[int, int]:
    """(tensor, pipeline) parallel sizes of the optimizer's model."""
    chunk = optimizer.model_chunks[0]
    return compat.tensor_parallel_group(chunk).size(), compat.pipeline_parallel_group(chunk).size()


def expert_sizes(optimizer) -> Tuple[int, int]:
    """(expert model, expert tensor) parallel sizes of the optimizer's model: (1, 1) without MoE."""
    config = getattr(optimizer.model_chunks[0], "config", None)
    if not getattr(config, "num_moe_experts", None):
        return 1, 1
    return (int(getattr(config, "expert_model_parallel_size", 1) or 1),
            int(getattr(config, "expert_tensor_parallel_size", None) or getattr(config, "tensor_model_parallel_size", 1)))


def _class_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def run_record(optimizer, controller, layout, sharding_type: str, residuals: bool,
               in_flight: Optional[dict] = None) -> dict:
    """The run record of one optimizer, as saved now (identical on every rank). ``in_flight``:
    the delayed outer step in flight (:meth:`DelayedOuterStep.checkpoint_state`'s meta)."""
    outer = controller.outer_optimizer
    tensor_keys, scalar_keys = outer_state_keys(controller)
    present, scalars = set(), {}
    if outer is not None:
        for shard in controller.shards:
            state = outer.state.get(shard.anchor, {})
            present |= {k for k in state if k in tensor_keys}
            for k, v in state.items():
                if k in scalar_keys and k not in scalars:  # stepped together: one value for all
                    scalars[k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
    tp, pp = parallel_sizes(optimizer)
    counters = controller.state_dict()
    c = controller.config
    return dict(
        format=FORMAT,
        num_workers=layout.num_workers,
        worker_size=layout.worker_size,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        expert_parallel=expert_sizes(optimizer),  # MoE: (EP, ETP); a change is refused on resume
        sharding_type=sharding_type,
        steps_done=counters["steps_done"],
        last_sync_step=counters["last_sync_step"],
        anchor_taken=outer is not None,
        config=dict(sync_backend=c.sync_backend, sync_interval=c.local_sgd_sync_interval,
                    warmup_steps=c.local_sgd_warmup_steps, sync_mode=c.sync_mode, use_async=c.use_async,
                    exchange_dtype=c.exchange_dtype, exchange_topk_density=c.exchange_topk_density,
                    fragments=c.fragments, outer_step_delay=c.outer_step_delay,
                    outer_merge_rule=c.merge_rule if c.outer_step_delay else None,
                    merge_alpha=c.merge_alpha if c.outer_step_delay and c.merge_rule == "lerp" else None),
        # The fragments whose shards every worker held identical at the save (all in warmup);
        # an elastic resume restarts those from the anchor, the others take an outer step.
        identical_fragments=controller.identical_fragments if outer is not None else list(range(c.fragments)),
        # Which buckets each fragment held (rank 0's slice): an elastic resume checks that its
        # fragments are the saved ones before it trusts identical_fragments.
        fragment_sizes=controller.fragment_sizes,
        outer_class=_class_name(controller.outer_config.optimizer_class),
        outer_hyperparameters=(
            [{k: v for k, v in g.items() if k != "params"} for g in outer.param_groups] if outer else None
        ),
        outer_tensor_state=sorted(present),
        outer_scalar_state=scalars,
        residuals=residuals,
        # Error feedback's residuals are in the units of what the workers exchange: the plain
        # mean's (the sum is divided by the workers) or a weighted sum's (penalty, step weights).
        residuals_summed=residuals and controller.sync.exchanges_weighted_sum,
        # A delayed outer step's exchange in flight at the save (None: none): applied on resume
        # at the step it was due, from the saved reduced pseudo-gradient.
        in_flight=in_flight,
        # Synchronous iterations done (A-EDiT: worker-steps / workers at the sync), which the
        # global budget, checkpoint labels and exits count; the same on every worker at a sync.
        global_progress=counters["global_progress"],
    )


def slice_record(controller) -> dict:
    """The per-slice record: the part of the controller's ``state_dict()`` beyond the counters
    (which are in the run record), its ``extra_state()``."""
    return dict(format=FORMAT, extra_state=controller.extra_state())


_FIELDS = (
    "num_workers", "worker_size", "tensor_parallel", "pipeline_parallel", "sharding_type", "steps_done",
    "last_sync_step", "anchor_taken", "outer_tensor_state", "outer_scalar_state", "residuals",
)


def format_message(found, where: str) -> str:
    """Why a record of format ``found`` cannot be read."""
    if found in OLD_FORMATS:
        return (f"megatron_edit: {where} holds EDiT state in format {found!r} "
                f"({OLD_FORMATS[found]}), written before elastic checkpoints; this version reads "
                f"{FORMAT!r}. Resume it with the megatron_edit version that wrote it, or load only "
                f"the model (--no-load-optim) to start EDiT from it.")
    return (f"megatron_edit: the EDiT record of {where} is not readable (format {found!r}, "
            f"expected {FORMAT!r}): the checkpoint is corrupted or was written by another tool.")


def check_run_record(record, where: str) -> dict:
    """The record, or :class:`CheckpointStateError` saying why it cannot be used."""
    found = record.get("format") if isinstance(record, dict) else type(record).__name__
    if found != FORMAT:
        raise CheckpointStateError(format_message(found, where))
    missing = [f for f in _FIELDS if f not in record]
    if missing:
        raise CheckpointStateError(f"megatron_edit: the EDiT record of {where} lacks {missing}: it is corrupted.")
    if not isinstance(record["steps_done"], int) or record["steps_done"] < 0:
        raise CheckpointStateError(f"megatron_edit: {where} has a corrupted EDiT step count.")
    if not isinstance(record["num_workers"], int) or record["num_workers"] < 1:
        raise CheckpointStateError(f"megatron_edit: {where} has a corrupted EDiT worker count.")
    return record


def identical_fragments(record: dict) -> Optional[List[int]]:
    """The saved fragments (0 alone without fragments) that every saved worker held identical
    (right after their sync, not a delayed merge that keeps local progress; all in warmup);
    None when a record written before this was recorded cannot tell."""
    fragments = int(record.get("config", {}).get("fragments", 1))
    if not record["anchor_taken"]:
        return list(range(fragments))
    if "identical_fragments" in record:
        return sorted(int(f) for f in record["identical_fragments"])
    if record["steps_done"] != record["last_sync_step"]:
        return []
    # An older record at a sync step: blocking syncs of the whole model only (written before
    # delayed outer steps) were sure to leave every worker equal.
    return list(range(fragments)) if fragments == 1 and "in_flight" not in record else None


def layout_difference(record: dict, now: dict) -> Optional[str]:
    """What differs between the saved layout and this run's (``now``: the same fields), in
    words, or None."""
    names = (("num_workers", "workers"), ("worker_size", "ranks per worker"), ("tensor_parallel", "TP"),
             ("pipeline_parallel", "PP"))
    diffs = [f"{label} {record[f]} -> {now[f]}" for f, label in names if record[f] != now[f]]
    return ", ".join(diffs) or None
