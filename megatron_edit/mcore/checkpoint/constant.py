"""A constant checkpoint structure: every EDiT entry a run can write is in each checkpoint it
writes (EDiT, arXiv 2412.07210; the format is :mod:`megatron_edit.mcore.checkpoint`'s).

Megatron-LM's ``--ckpt-assume-constant-structure`` (megatron-core: ``use_cached_ckpt_structure``
on the ``torch_dist`` save strategy, ``do_cache_distribution`` of its fully parallel wrapper)
plans a save once: after two saves with the same plan it reuses that plan and its global
metadata as they are, so an entry that is not in the plan is silently not written (and its load
refused as incomplete), and shapes or dtypes that changed are described wrongly. A resumed run
also reuses the loaded checkpoint's metadata when its own plans are the loaded ones.

EDiT's state would change in structure within a run: the anchor and the outer state appear at
the end of the warmup, the outer optimizer's per-element state (momentum) at its first step, a
delayed outer step's reduced pseudo-gradient (and, for the ``keep_local`` merge, each worker's
launch parameters) only while its exchange is in flight. So each of those kinds is written in
every checkpoint of a run whose configuration can produce it (the outer state: every key the
configured outer optimizer has, :func:`~.record.outer_state_keys`), with the same key, shape,
dtype (fp32), replica id and sharding: a *placeholder* of zeros while it holds nothing.

The validity marker is the run record (:mod:`.record`), which a load reads before anything else:
``anchor_taken``, ``outer_tensor_state`` (the outer keys that hold state), ``in_flight`` (None:
nothing in flight; its ``keep``: the launch parameters are real). :class:`~.resume.ResumePlan`
asks only for what it marks, so a placeholder is never read and a resume is what it was; a
checkpoint written before placeholders (without them) loads the same way.

Error feedback's residuals need nothing here: with it they are written from the first save on.
What stays variable is what ``auto_overlap`` changes between syncs (the delay, the exchange
format): that combination is refused (:mod:`megatron_edit.training.validation`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .keys import ANCHOR, IN_FLIGHT, launch_prefix, outer_prefix

Tensors = Optional[List[Optional[object]]]
"""One shard-length tensor per shard (None for a shard: zeros), or None: all placeholders."""


def keeps_launch_params(controller) -> bool:
    """Whether this configuration's delayed exchanges keep the launch parameters (the
    ``keep_local`` merge: :meth:`OuterSync._decide`)."""
    return controller.config.keeps_launch_params


def varying_entries(controller, tensor_keys, flight) -> Dict[Tuple[str, ...], Tuple[str, Tensors, int]]:
    """The kinds of EDiT tensors whose presence used to change within a run, each always present:
    ``{path in the EDiT part: (key prefix, tensors, replica_last)}``, ``replica_last`` as
    :meth:`~.space.ModelSpace.save_entries` takes it (worker 0 writes what every worker holds,
    each worker its launch parameters). ``tensor_keys``: the outer optimizer's per-element keys;
    ``flight``: :meth:`DelayedOuterStep.checkpoint_state` (None: nothing in flight)."""
    worker = controller.layout.worker
    shards = controller.shards
    outer = controller.outer_optimizer
    out: Dict[Tuple[str, ...], Tuple[str, Tensors, int]] = {
        ("anchor",): (ANCHOR, [s.anchor for s in shards] if outer is not None else None, worker)}
    for key in tensor_keys:
        values = [outer.state.get(s.anchor, {}).get(key) for s in shards] if outer is not None else None
        out[("outer", key)] = (outer_prefix(key), values if values and any(v is not None for v in values) else None,
                               worker)
    if getattr(controller, "delayed", None) is not None:
        out[("in_flight",)] = (IN_FLIGHT, [d for d, _ in flight[1]] if flight else None, worker)
        if keeps_launch_params(controller):
            launch = [p for _, p in flight[1]] if flight and flight[0]["keep"] else None
            out[("in_flight_launch",)] = (launch_prefix(worker), launch, 0)
    return out


def put(part: dict, path: Tuple[str, ...], value) -> None:
    """``part[path[0]][path[1]]... = value``."""
    for key in path[:-1]:
        part = part.setdefault(key, {})
    part[path[-1]] = value
