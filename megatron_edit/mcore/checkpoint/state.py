"""EDiT state in Megatron's distributed checkpoints (``torch_dist``): exact and elastic resume.

EDiT (arXiv 2412.07210) keeps state that ordinary data-parallel training does not have: between
syncs every worker (one distributed-optimizer instance) has its *own* parameters and Adam state,
and every rank holds its shard of the anchor and of the outer optimizer state. Megatron's
checkpoint layout assumes the opposite, that all instances are replicas: its replica ids let
only instance 0 write the model and the optimizer state, and its fully parallel save may pick any
instance to write a shard. Saved as is, worker 1's local progress would be lost (or silently
mixed into worker 0's tensors).

Everything rides inside ``DistributedOptimizer.sharded_state_dict`` / ``load_state_dict``, so
Megatron-LM's ``--save`` / ``--load --ckpt-format torch_dist`` and a megatron-core user's
``dist_checkpointing.save({'model': m, 'optimizer': opt.sharded_state_dict(m, metadata=...)})``
carry it with no extra call.

What is written (format ``megatron_edit.local_sgd/2``), per distributed optimizer (``k`` =
worker, ``<model key>`` = the key of the parameter's own model tensor, e.g.
``decoder.layers.self_attention.linear_qkv.weight``; ``g`` = Megatron's
``data_parallel_group_idx``, one per tensor / pipeline slice):

==========================================  ==========================================  =========
key                                         content                                     written by
==========================================  ==========================================  =========
model keys, ``optimizer.*`` (Megatron's)    worker 0's model and inner optimizer        worker 0
``local_sgd.worker_<k>.optimizer.*``        worker k's inner optimizer state (main       worker k
                                            params, Adam moments, param groups), k >= 1
``local_sgd.anchor.<model key>``            the anchor, per parameter                    worker 0
``local_sgd.outer.<state>.<model key>``     outer optimizer state (e.g. momentum)        worker 0
``local_sgd.residual.worker_<k>.<key>``     error feedback: what quantization dropped    worker k
                                            from worker k's pseudo-gradient
``local_sgd.result_residual.<model key>``   error feedback: what requantizing the        worker 0
                                            reduced result dropped (every worker's chunk)
``local_sgd.record``                        run record: counters, saved layout, outer    rank 0
                                            scalars (:mod:`.record`)
``local_sgd.slice.dp_group_idx_<g>``        ``LocalSGD.extra_state()`` (detector, ...)   worker 0
==========================================  ==========================================  =========

* EDiT's own tensors are stored **per parameter, in model space** (:mod:`.space`):
  each is the parameter's model tensor with another key, so ``dist_checkpointing`` reshards
  them like the model: another number of ranks per worker, another bucket size, TP or PP.
  The residuals exist only with a quantized or sparse exchange with error feedback (the
  sparse exchange reduces no chunk of the result: its result residual is all zeros).
* Worker k >= 1 renames the keys of Megatron's optimizer part to ``local_sgd.worker_<k>.`` and
  sets the instance coordinate of their replica ids to 0, so inside each worker exactly one rank
  writes each shard (Megatron's save validates this on every save). Worker k's model needs no
  copy: it is a function of its main params (fp32: they are the model; bf16: the model is
  their cast), which are in that part. At save, worker k's model entries are dropped from the
  model state dict passed to the optimizer, so a fully parallel save cannot write them under the
  shared model keys.
* Saving syncs nothing across workers: a sync that is pending (due at this step, completing
  layer by layer in the next forward pass) is completed first with the numbers it would have
  had anyway; between syncs, the workers' local state is stored as it is. (With error feedback,
  one all-reduce per bucket across workers puts the workers' chunk residuals together.) The parameters are
  all-gathered *inside* each worker (what Megatron-LM does before every save) so the model part
  is complete.

Loading (:mod:`.resume` says what each kind of resume does): the patched
``dist_checkpointing.load`` reads the run record first and fits the requests to it (another
worker count, a synchronous checkpoint, what was not saved); every worker loads the shared
model keys (worker 0's model), then its inner optimizer part and the EDiT state; finally each
worker's model is rebuilt from its main params. Load the model before the optimizer (as
Megatron-LM does).

Partial and unusual loads:

* Without the optimizer (``--no-load-optim``, ``--finetune``, or loading only ``'model'``):
  every worker gets worker 0's model and EDiT starts afresh (synchronous warmup, new anchor), so
  all replicas stay consistent.
* Part of the EDiT state missing, a corrupted record or a truncated data file
  (:mod:`.guard`): :class:`CheckpointStateError` on every
  rank, naming what is missing, before anything large is read; never a silent fresh start.
  Checkpoints of the per-bucket format 1 are refused with a message (same layout only, written
  by earlier versions).
* Megatron's ``dp_reshardable`` (Megatron-LM's default) and ``fully_reshardable`` optimizer
  formats are supported; only the latter follows a TP / PP or bucket change (a message names the
  difference otherwise). ``dp_zero_gather_scatter`` (deprecated; it keeps only instance 0's
  state) is refused. In megatron-core 0.16.x ``fully_reshardable`` misplaces the state of
  parameters that follow a padded bucket (a Megatron bug, also without EDiT): with more than one
  bucket per buffer it is refused. ``fully_sharded_model_space`` (megatron-core's default when
  no metadata is passed) fails in megatron-core 0.16.1 itself: pass
  ``metadata={'distrib_optim_sharding_type': 'dp_reshardable'}``.
* The legacy ``torch`` format (``--ckpt-format torch``: ``save_parameter_state`` /
  ``load_parameter_state``) is refused: it gathers optimizer state on data-parallel rank 0 of
  instance 0 only.
* Plain Megatron loading an EDiT checkpoint with its optimizer gets worker 0's model and inner
  state (Megatron's own keys); at a sync boundary that is every worker's.

megatron-core's own load defects (without apex / transformer-engine) are worked around in
:mod:`megatron_edit.mcore.checkpoint.load_fixes`; the Megatron mechanics of keys and replica ids are in
:mod:`megatron_edit.mcore.checkpoint.keys`.

Nothing here changes what a sync computes; :class:`~megatron_edit.mcore.controller.LocalSGD` is
only read and restored through ``state_dict()``, ``load_state_dict()`` and its resume methods.
"""

from __future__ import annotations

import logging
from typing import List

import torch

from .. import compat
from .keys import CheckpointStateError
from .record import (
    RECORD_KEY,
    identical_fragments,
    outer_state_keys,
    run_record,
    slice_key,
    slice_record,
)
from .constant import put, varying_entries
from .expert_bias import restore as restore_biases, save_entry as bias_entry
from .after_load import load_time_sync, merge_residuals, refresh_model_from_mains, restart_from_anchor
from .keys import ANCHOR, RESULT_RESIDUAL, outer_prefix, residual_prefix
from .resume import ResumePlan
from .space import ModelSpace, model_tensors_by_param
from ..fault_tolerant import backend_of
from ..sync_backend import STATE_KEY
from ..wrap_registry import VersionRange

logger = logging.getLogger(__name__)

SUPPORTED = VersionRange("0.16.0", "0.20.0")
"""megatron-core versions whose checkpoints carry the EDiT state (the patches below)."""
NOT_YET = VersionRange(compat.SUPPORTED.minimum, SUPPORTED.minimum)
"""Releases megatron_edit trains on but cannot checkpoint EDiT with yet: saving or loading the
optimizer of an EDiT run is refused there (never a checkpoint that silently lacks EDiT state)."""
SUPPORTED_SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")


# --------------------------------------------------------------------------- the sharded part
def local_sgd_sharded_state_dict(optimizer, controller, state: dict, model_sharded_state_dict,
                                 sharding_type: str, is_loading: bool) -> dict:
    """The EDiT part of one optimizer's sharded state dict ``state`` (see the module
    docstring); for loading, the requests and the :class:`ResumePlan` that fits them."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject

    layout = controller.layout
    space = ModelSpace(optimizer, controller.shards, model_tensors_by_param(model_sharded_state_dict))
    tensor_keys, _ = outer_state_keys(controller)
    residuals = controller.config.error_feedback and any(
        controller.chunk_span(s) is not None for s in controller.shards)
    delayed = getattr(controller, "delayed", None)
    flight = delayed.checkpoint_state() if delayed is not None and not is_loading else None
    record = ShardedObject(RECORD_KEY, run_record(optimizer, controller, layout, sharding_type, residuals,
                                                  flight[0] if flight else None),
                           (1,), (0,), replica_id=torch.distributed.get_rank())
    slice_ = ShardedObject(slice_key(layout.dp_group_idx), slice_record(controller), (1,), (0,),
                           replica_id=(layout.worker, 0, layout.intra_rank))
    part = dict(record=record, slice=slice_)
    if is_loading:
        main = layout.worker == 0  # the same on every worker: worker 0's requests are main
        part["anchor"] = space.load_requests(ANCHOR, main)
        part["outer"] = {k: space.load_requests(outer_prefix(k), main) for k in tensor_keys}
        if residuals:
            part["result_residual"] = space.load_requests(RESULT_RESIDUAL, main)
        part["plan"] = LocalNonpersistentObject(ResumePlan(optimizer, controller, state, space, sharding_type))
        return part
    controller.outer_state.synchronize()  # offloaded state: no copy in flight while we read it
    # Every kind, in every checkpoint of the run: placeholders where it holds nothing (.constant).
    for path, (prefix, tensors, replica_last) in varying_entries(controller, tensor_keys, flight).items():
        put(part, path, space.save_entries(prefix, tensors, replica_last))
    biases = bias_entry(controller)  # MoE router expert biases: every worker's own
    if biases is not None:
        part["expert_bias"] = biases
    if residuals:
        part["residual"] = space.save_entries(residual_prefix(layout.worker),
                                              [s.residual for s in controller.shards], 0)
        part["result_residual"] = space.save_entries(RESULT_RESIDUAL, _result_residuals(controller), layout.worker)
    return _prune(part)


def _prune(tree: dict) -> dict:
    """Without empty dicts: a rank that writes no parameter of a kind would otherwise leave an
    empty entry in the common state dict, which then differs between ranks."""
    out = {}
    for key, value in tree.items():
        value = _prune(value) if isinstance(value, dict) else value
        if not (isinstance(value, dict) and not value):
            out[key] = value
    return out


@torch.no_grad()
def _result_residuals(controller) -> List[torch.Tensor]:
    """Per shard, the residual of the reduced result: every worker's chunk residual at its
    chunk's place (one all-reduce across workers per bucket)."""
    out = []
    for shard in controller.shards:
        full = torch.zeros(shard.numel, dtype=torch.float32, device=shard.device)
        offset, length, padded = controller.chunk_span(shard)
        if not padded:  # the sparse exchange: no chunk of the result, zeros (the same on every worker)
            out.append(full)
            continue
        if shard.chunk_residual is not None:
            full[offset : offset + length].copy_(shard.chunk_residual[:length])
        controller.sync_group.all_reduce_sum(full, async_op=False)  # counted as sync traffic
        out.append(full)
    return out


# --------------------------------------------------------------------------- load
@torch.no_grad()
def load_local_sgd_state(optimizer, controller, part: dict, state_dict: dict, plan=None) -> None:
    """Restore one optimizer's EDiT state after Megatron loaded its inner state (``part``: the
    loaded EDiT part; ``state_dict``: the rest; ``plan``: the :class:`ResumePlan`, default the
    one riding in ``part``)."""
    plan = plan if plan is not None else part.get("plan")
    if not isinstance(plan, ResumePlan) or not plan.prepared:
        raise CheckpointStateError(
            "megatron_edit: this EDiT optimizer state was loaded without megatron_edit's "
            "dist_checkpointing.load patch (megatron.core.dist_checkpointing.load), which fits "
            "the load to the checkpoint; load through megatron.core.dist_checkpointing.load."
        )
    controller.flush()
    controller.outer_state.synchronize()  # offloaded state: no copy in flight while we write it
    if plan.mode == "synchronous":
        controller.resume_from_synchronous(plan.adam_step(state_dict))
        controller.mark_identical(range(controller.config.fragments), only=True)  # one model, every worker
        if backend_of(controller) is not None:  # every torchft job loads it: level, none heals
            backend_of(controller).start_from_torch_backend()
        _log_resume(controller, "a checkpoint of synchronous training", "Adam state kept, " + (
            "anchor taken there" if controller.outer_optimizer is not None else "warmup goes on"))
        refresh_model_from_mains(optimizer, controller)
        plan.release()
        return
    record = plan.saved
    # Worker 0's counters (records written before global progress was saved: the step count).
    controller.load_state_dict({"steps_done": record["steps_done"], "last_sync_step": record["last_sync_step"],
                                "global_progress": record.get("global_progress", record["steps_done"])})
    elastic = plan.mode == "elastic"
    if elastic and record["anchor_taken"]:
        controller.resume_elastic()
    if not record["anchor_taken"]:
        controller.drop_anchor()
    else:
        _restore_anchor_and_outer_state(controller, plan, part)
    if elastic and record["anchor_taken"]:
        # Fragments every saved worker held identical restart from their anchor; the others
        # (local progress since their sync, or kept by a delayed merge) take one outer step.
        identical = controller.fragment_slots(plan.identical)
        restart_from_anchor(controller, identical)
        if len(identical) < len(controller.shards):
            load_time_sync(controller, plan.decode_mains(part.get("workers")), record["num_workers"],
                           skip=identical, alone_as=plan.source if plan.torchft else None)
    merge_residuals(controller, plan, part)
    restore_biases(controller, part.get("expert_bias"))
    extra = (part.get("slice") or {}).get("extra_state") if plan.slice_loaded else None
    if plan.slice_loaded:
        _load_extra_state(controller, extra)
    elif record["anchor_taken"]:
        controller.restart_async_schedule()
    if record.get("in_flight") is not None:
        _restore_in_flight(controller, plan, part, record["in_flight"])
    # What a save right after this load records as identical: everything after an elastic load
    # (one model on every worker), else what the checkpoint said.
    saved_identical = identical_fragments(record) or []
    if elastic:
        controller.mark_identical(range(controller.config.fragments), only=True)
    else:
        same_fragments = int(record["config"].get("fragments", 1)) == controller.config.fragments
        controller.mark_identical(saved_identical if same_fragments else [], only=True)
    if not elastic:
        note = "each worker its own state"
    elif not record["anchor_taken"]:
        note = "in warmup, every worker from a saved one (all equal)"
    elif len(plan.identical) == controller.config.fragments:
        note = "saved right after a sync, every worker from the saved anchor"
    elif plan.identical:
        note = (f"fragment(s) {plan.identical} from the saved anchor (synced right before the save), "
                "one outer step over the saved workers for the others")
    else:
        note = "one outer step over the saved workers at load"
    ft = backend_of(controller)
    if ft is not None and not (isinstance(extra, dict) and STATE_KEY in extra):
        ft.start_from_torch_backend()
        note += f"; worker {controller.config.replica_id} of torchft from saved worker {plan.source}"
    _log_resume(controller, f"a checkpoint of {record['num_workers']} worker(s)"
                + (f" ({plan.difference})" if plan.difference else ""), note)
    if controller.num_workers > 1 or elastic:
        refresh_model_from_mains(optimizer, controller)
    plan.release()


def _restore_anchor_and_outer_state(controller, plan: ResumePlan, part: dict) -> None:
    record, space = plan.saved, plan.space
    if controller.outer_optimizer is None:
        controller.capture_anchor()  # allocates anchors + outer optimizer as training would
    for slot, shard in enumerate(controller.shards):
        space.assemble(part["anchor"], slot, shard.anchor)
    state = {}
    for slot, shard in enumerate(controller.shards):
        entry = {k: space.assemble(part["outer"][k], slot, torch.empty_like(shard.anchor))
                 for k in record["outer_tensor_state"]}
        entry.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in record["outer_scalar_state"].items()})
        if entry:
            state[slot] = entry
    outer = controller.outer_optimizer
    # Hyperparameters come from this run's configuration; the state from the checkpoint.
    outer.load_state_dict({"state": state, "param_groups": outer.state_dict()["param_groups"]})
    _warn_if_changed(record, controller)


def _restore_in_flight(controller, plan: ResumePlan, part: dict, meta: dict) -> None:
    """The delayed outer step that was in flight at the save, waiting for its apply again."""
    members = set(controller.delayed.members(meta))

    def shard_values(key):
        return [plan.space.assemble(part[key], slot, torch.empty(s.numel, dtype=torch.float32, device=s.device))
                if slot in members else None for slot, s in enumerate(controller.shards)]

    launch = shard_values("in_flight_launch") if meta["keep"] else [None] * len(controller.shards)
    extra = (part.get("slice") or {}).get("extra_state") or {}
    controller.delayed.resume(meta, shard_values("in_flight"), launch, extra.get("in_flight_skipped"))


def _load_extra_state(controller, saved_extra) -> None:
    hook = getattr(controller, "load_state_dict", None)
    if callable(hook):
        if saved_extra is None:
            raise CheckpointStateError(
                "megatron_edit: the checkpoint's EDiT record has no extra state (anomaly-detector "
                "statistics, counters): it was written by an older megatron_edit or is corrupted."
            )
        try:
            hook(saved_extra)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise CheckpointStateError(
                f"megatron_edit: the EDiT extra state in the checkpoint does not fit ({e!r})."
            ) from e
    elif saved_extra:
        raise CheckpointStateError(
            "megatron_edit: the checkpoint holds EDiT state this version cannot restore "
            f"(extra state {sorted(saved_extra)}); use the megatron_edit version that wrote it."
        )


def _log_resume(controller, source: str, what: str) -> None:
    if torch.distributed.get_rank() == 0:
        logger.info("megatron_edit: resumed EDiT at step %d, %d worker(s), from %s: %s", controller.steps_done,
                    controller.num_workers, source, what)


def _warn_if_changed(record: dict, controller) -> None:
    if torch.distributed.get_rank() != 0:
        return
    now = [{k: v for k, v in g.items() if k != "params"} for g in controller.outer_optimizer.param_groups]
    cls = controller.outer_config.optimizer_class
    if record.get("outer_hyperparameters") not in (None, now) or record.get("outer_class") != (
        f"{cls.__module__}.{cls.__qualname__}"
    ):
        logger.warning(
            "megatron_edit: the outer optimizer's configuration differs from the checkpoint's "
            "(%s %s); continuing with this run's configuration and the checkpoint's state.",
            record.get("outer_class"),
            record.get("outer_hyperparameters"),
        )
