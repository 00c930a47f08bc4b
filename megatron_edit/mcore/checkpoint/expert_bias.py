"""Each worker's MoE router expert biases in the checkpoint (``--moe-router-enable-expert-bias``).

Between syncs every worker's routers carry their own ``expert_bias`` buffers (counted inside the
worker, averaged over the workers at each sync: :mod:`megatron_edit.mcore.expert_bias`). They are
buffers, not parameters, so neither the worker's main parameters nor Megatron's model keys
(worker 0's copy) hold another worker's. So the dense optimizer's EDiT part carries, for every
worker, the biases of its tensor / pipeline slice:

==========================================================  ================================  ==================
key                                                         content                           written by
==========================================================  ================================  ==================
``local_sgd.expert_bias.worker_<k>.dp_group_idx_<g>``        worker k's biases of slice g,     one rank of worker k
                                                            in module order
==========================================================  ================================  ==================

(Megatron-FSDP's ``fsdp_dtensor`` checkpoints hold the same key, one byte entry per worker:
:mod:`.fsdp_dtensor`.) A resume with the saved number of workers gives each worker its own
biases (an exact resume, also between syncs); another number of workers gives every worker
their mean over the saved workers (the rule of a sync, as the load-time outer step takes the
mean of the parameters). A
checkpoint without them (synchronous training, written before they were saved) leaves the
biases Megatron's model load put there: worker 0's, the only copy.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from .keys import PREFIX


def bias_key(worker: int, dp_group_idx: int) -> str:
    return f"{PREFIX}expert_bias.worker_{worker}.dp_group_idx_{dp_group_idx}"


def save_entry(controller):
    """This rank's ShardedObject of its worker's biases (None without expert biases)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    biases = controller.expert_biases
    if biases is None:
        return None
    layout = controller.layout
    return ShardedObject(bias_key(layout.worker, layout.dp_group_idx),
                         [b.detach().clone() for b in biases.biases], (1,), (0,),
                         replica_id=(0, 0, layout.intra_rank))


def saved_keys(controller, saved: dict, outer: str, same_workers: bool, saved_workers: int) -> Optional[Dict[int, str]]:
    """The keys to read: ``{saved worker: key}`` (its own with the saved number of workers,
    every saved worker's otherwise), or None when the checkpoint holds no biases of workers.
    ``saved``: the checkpoint's metadata; ``outer``: the prefix Megatron added to this
    optimizer's keys (``chained_<i>.``)."""
    if controller.expert_biases is None:
        return None
    layout = controller.layout
    wanted = [layout.worker] if same_workers else list(range(saved_workers))
    keys = {w: outer + bias_key(w, layout.dp_group_idx) for w in wanted}
    if not all(any(k == key or k.startswith(key + "/") for k in saved) for key in keys.values()):
        return None
    return keys


def fit_requests(controller, saved: dict, outer: str, same_workers: bool, saved_workers: int) -> Optional[Dict]:
    """The ``torch_dist`` load requests, ``{saved worker: ShardedObject}`` (:func:`saved_keys`)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    keys = saved_keys(controller, saved, outer, same_workers, saved_workers)
    if keys is None:
        return None
    return {w: ShardedObject(key, None, (1,), (0,), replica_id=(0, 0, controller.layout.intra_rank))
            for w, key in keys.items()}


def values(controller) -> Optional[list]:
    """This rank's worker's biases (copies, on the CPU), or None without expert biases."""
    biases = controller.expert_biases
    return None if biases is None else [b.detach().cpu().clone() for b in biases.biases]


@torch.no_grad()
def restore(controller, loaded: Optional[Dict]) -> None:
    """Write the loaded biases (one worker's, or the mean of several) into the routers."""
    if not loaded or controller.expert_biases is None:
        return
    values = list(loaded.values())
    biases = controller.expert_biases.biases
    if any(len(v) != len(biases) for v in values):
        raise ValueError(f"megatron_edit: the checkpoint holds {len(values[0])} router expert biases for "
                         f"this slice, the model has {len(biases)}.")
    for i, bias in enumerate(biases):
        mean = sum(v[i].to(bias.device, torch.float64) for v in values) / len(values)
        bias.copy_(mean.to(bias.dtype))
