"""The work after a checkpoint's load (EDiT, arXiv 2412.07210; format in
:mod:`megatron_edit.mcore.checkpoint`, what each resume does in :mod:`.resume`): decoding other
workers' main params with Megatron's own loaders, the load-time outer step of an elastic
resume, a restart from the anchor, error feedback's residuals carried over, and the model
rebuilt from the loaded main params.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch

from ..process_state import PROCESS


def capture_of(optimizer) -> Optional[dict]:
    """Where ``_set_main_param_and_optimizer_states`` must put its tensors instead of setting
    them (None: set them). Consulted by the checkpoint patches."""
    return PROCESS.captures.get(optimizer)


@contextlib.contextmanager
def _capturing(optimizer):
    # optimizer -> {model param: tensors} while decoding another worker's main params; kept in
    # the process's session state (megatron_edit.mcore.process_state)
    got = PROCESS.captures[optimizer] = {}
    try:
        yield got
    finally:
        del PROCESS.captures[optimizer]


def decode_mains(optimizer, plan, loaded: dict) -> List[Dict[int, torch.Tensor]]:
    """Per shard, {saved worker: its main params (shard-length)} for the extra saved workers that
    ``plan`` (a :class:`~.resume.ResumePlan`) asked for,
    decoded by Megatron's own loader of the format (its writes captured)."""
    loaders = {
        "dp_reshardable": optimizer.load_parameter_state_from_dp_reshardable,
        "fully_reshardable": optimizer.load_parameter_state_from_fully_reshardable,
        "fully_sharded_model_space": optimizer.load_parameter_state_from_fs_model_space,
    }
    out: List[Dict[int, torch.Tensor]] = [{} for _ in plan.space.shards]
    for worker, state in (loaded or {}).items():
        with _capturing(optimizer) as got:
            loaders[plan.sharding_type](state)
        for slot, pieces in enumerate(plan.space.pieces):
            shard = plan.space.shards[slot]
            flat = torch.zeros(shard.numel, dtype=torch.float32, device=shard.device)
            for piece in pieces:
                flat[piece.shard_start : piece.shard_end].copy_(got[piece.param]["param"].view(-1))
            out[slot][worker] = flat
    return out


@torch.no_grad()
def load_time_sync(controller, extra_mains: List[Dict[int, torch.Tensor]], saved_workers: int,
                   skip=(), alone_as: Optional[int] = None) -> None:
    """The outer step a sync at the save step would have made, over the saved workers: this
    worker contributes its own (loaded) main params when it was a saved worker, plus the
    ``extra_mains`` it read; the sum over workers divided by ``saved_workers``. ``skip``: slots
    of shards every saved worker held identical (restarted from their anchor instead).
    ``alone_as``: a torchft worker, which read every saved worker (its own loaded mains are saved
    worker ``alone_as``'s) and sums them in saved-worker order, with no collective: every job
    computes the same bytes."""
    own = controller.sync_group.rank < saved_workers if alone_as is None else True
    for slot, shard in enumerate(controller.shards):
        if slot in skip:
            continue
        anchor = controller.outer_state.anchor_on_device(shard)
        delta = torch.zeros(shard.numel, dtype=torch.float32, device=shard.device)
        if alone_as is not None:
            for worker in range(saved_workers):
                if worker == alone_as:
                    delta += shard.pseudo_gradient(anchor, torch.empty_like(delta))
                    continue
                theirs = anchor - extra_mains[slot][worker]
                for s, e in shard.gaps:  # as in its own: 0 where no parameter is
                    theirs[s:e].zero_()
                delta += theirs
            controller.outer_state.apply(shard, delta, [], write_model=True, divisor=saved_workers)
            continue
        if own:
            shard.pseudo_gradient(anchor, delta)
        for mains in extra_mains[slot].values():
            delta += anchor - mains
        controller.sync_group.all_reduce_sum(delta, async_op=False)  # counted as sync traffic
        controller.outer_state.apply(shard, delta, [], write_model=True, divisor=saved_workers)


@torch.no_grad()
def restart_from_anchor(controller, slots) -> None:
    """The shards at ``slots`` restart from their (loaded) anchor."""
    for slot in slots:
        shard = controller.shards[slot]
        anchor = controller.outer_state.anchor_on_device(shard)
        shard.write_mains(anchor)
        shard.write_model(anchor)


@torch.no_grad()
def merge_residuals(controller, plan, part: dict) -> None:
    """Error feedback: this worker's residual (its own; after a worker-count change the mean of
    the saved workers'), and its chunk of the result residual."""
    space, saved_workers = plan.space, plan.saved["num_workers"]
    for shard in controller.shards:
        shard.residual = shard.chunk_residual = None
    if not plan.residuals:  # the same on every rank: the collectives below line up
        return
    residuals, result = part.get("residual") or {}, part["result_residual"]  # {}: dropped by the load
    saved_summed = bool(plan.saved.get("residuals_summed", False))
    for slot, shard in enumerate(controller.shards):
        total = torch.zeros(shard.numel, dtype=torch.float32, device=shard.device)
        for worker in plan.residual_workers:  # none for a new worker m >= N
            total += space.assemble(residuals[worker], slot, torch.empty_like(total))
        if plan.mode == "elastic":
            controller.sync_group.all_reduce_sum(total, async_op=False)  # counted as sync traffic
            total *= residual_share(saved_workers, controller.num_workers, saved_summed,
                                    controller.sync.exchanges_weighted_sum)
        elif saved_summed != controller.sync.exchanges_weighted_sum:  # plain mean <-> weighted sum
            total *= residual_units(saved_workers, saved_summed)
        shard.residual = total
        offset, length, padded = controller.chunk_span(shard)
        if not padded:  # the sparse exchange requantizes no chunk of the result: nothing to restore
            continue
        full = space.assemble(result, slot, torch.empty(shard.numel, dtype=torch.float32, device=shard.device))
        shard.chunk_residual = torch.zeros(padded, dtype=torch.float32, device=shard.device)
        shard.chunk_residual[:length].copy_(full[offset : offset + length])


def residual_share(saved_workers: int, workers: int, saved_summed: bool, summed: bool) -> float:
    """Elastic resume of error feedback: the factor that turns the sum of the N saved workers'
    residuals into each of the M new workers' residual, so that the next result carries what
    the saved workers' next sync would have carried.

    A residual is in the units of what its worker sent. Plain mean: the result is the sum of the
    sent values / workers, so the saved residuals add sum / N to the next result, and each new
    worker carries sum / N (the mean; the M of them / M again give sum / N). Weighted sum
    (penalty, step weights): the result is the sum itself, the saved residuals add their sum,
    and each new worker carries sum / M (with the mean, the M workers would add M / N x sum)."""
    carried = 1.0 / saved_workers if not saved_summed else 1.0
    return carried / workers if summed else carried


def residual_units(workers: int, saved_summed: bool) -> float:
    """Same workers, the averaging switched between the plain mean and a weighted sum (penalty,
    step weights): the factor that keeps what each worker's residual adds to the next result.
    The plain mean divides the sum by the workers, a weighted sum does not: a mean's residual r
    added r / N, so it becomes r / N; a weighted sum's added r, so it becomes N r."""
    return float(workers) if saved_summed else 1.0 / workers


def adam_step_of(state_dict: dict) -> int:
    """The optimizer steps done by a synchronous checkpoint: Adam's ``step`` in the loaded
    param groups (0 when it has none)."""
    groups = (state_dict.get("optimizer") or {}).get("param_groups") or []
    steps = [int(g["step"]) for g in groups if g.get("step") is not None]
    return max(steps, default=0)


def refresh_model_from_mains(optimizer, controller) -> None:
    """Rebuild each worker's model from its (just loaded) main params: shard -> bucket, then
    all-gather inside the worker. Workers >= 1 had worker 0's model loaded into them."""
    optimizer._copy_main_params_to_model_params()
    controller.gather_params_in_worker()
