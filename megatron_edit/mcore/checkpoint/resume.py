"""Resuming an EDiT checkpoint with this run's layout (EDiT, arXiv 2412.07210; format in
:mod:`megatron_edit.mcore.checkpoint`): the same layout, another worker count, another shard
size / TP / PP, or a checkpoint of synchronous training.

A :class:`ResumePlan` rides, as a ``LocalNonpersistentObject``, in each distributed
optimizer's sharded state dict for loading. The patched ``dist_checkpointing.load`` reads the
checkpoint's run record first and calls :meth:`ResumePlan.prepare`, which fits the load
requests to the checkpoint *before* anything large is read; the patched ``load_state_dict``
then calls :func:`restore`. What each kind of resume does:

* **Same number of workers** (any shard size, TP, PP): every worker gets its own saved state
  back. Bit-identical to the uninterrupted run when nothing else changed.
* **N saved workers, M != N resumed** (either way): one outer step at load, the one a sync at
  the save step would have made: Delta = mean over the N saved workers of (anchor - worker's
  main params), a plain mean (no penalty weights, clipping, GTA or quantization), stepped with
  the saved outer optimizer state. Every new worker restarts from the new anchor, so all M are
  identical; the outer state is kept. Worker m takes the inner optimizer state (Adam moments,
  step) of saved worker m mod N. A checkpoint saved at a sync boundary (or in warmup), where all
  workers are equal, needs no outer step: the workers restart from the saved anchor. Error
  feedback: each new worker's residual is its share of the saved workers' sum (so the next
  sync adds what the saved workers' would have added: :func:`residual_share`), and the residual of the reduced result
  (per parameter, independent of the worker count) is cut into the new workers' chunks. The
  anomaly detector's statistics (per worker) restart, and so does A-EDiT's schedule (its first
  interval after warmup). The saved workers whose main params a worker m reads are m, m + M,
  m + 2M, ... (< N): their pseudo-gradients are summed inside the worker, then over the M
  workers (one all-reduce per bucket), so each saved worker is read once.
* **A checkpoint of synchronous training** (no EDiT state): every worker loads its model and
  inner optimizer state (Adam included); EDiT counts the checkpoint's optimizer steps (Adam's
  ``step``) as done: past ``--local-sgd-warmup-steps`` it takes its anchor at the loaded model
  and syncs on the usual grid (warmup + k H), before it finishes the (synchronous) warmup.

Megatron's own inner optimizer format limits what can change: ``dp_reshardable`` (Megatron-LM's
default) stores buckets, so TP, PP and the buckets must stay (a message names the difference);
``fully_reshardable`` follows everything.

A checkpoint saved while a delayed outer step's exchange was in flight holds its reduced
pseudo-gradient (``local_sgd.in_flight.*``); it resumes with the same workers, TP and PP only.
Every kind of resume fits its load requests in one place (:meth:`ResumePlan.prepare`), before
anything large is read; what it refuses is :mod:`.compatibility`'s, the keys it asks for are
:mod:`.keys`'s; the work after the load (the load-time outer step, residuals, the model rebuilt
from the main params) is :mod:`.after_load`'s.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch

from ...algorithm.formats import format_name
from ...config import FLAG_NAMES
from ..process_state import PROCESS
from .expert_bias import fit_requests as fit_bias_requests
from . import compatibility
from .after_load import adam_step_of, decode_mains
from .keys import (
    IN_FLIGHT,
    PREFIX,
    CheckpointStateError,
    launch_prefix,
    residual_prefix,
    retarget,
)
from .record import (
    FULLY_RESHARDABLE,
    RECORD_KEY,
    check_run_record,
    expert_sizes,
    identical_fragments,
    layout_difference,
    outer_state_keys,
    parallel_sizes,
)

logger = logging.getLogger(__name__)

_MAIN_KEYS = ("param", "fp32_param")  # the main params in Megatron's per-parameter optimizer state




class ResumePlan:
    """How one distributed optimizer reads a checkpoint (see the module docstring)."""

    def __init__(self, optimizer, controller, state: dict, space, sharding_type: str):
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedBase

        self.optimizer = optimizer
        self.controller = controller
        self.state = state  # the optimizer's sharded state dict: Megatron's part + "local_sgd"
        self.space = space
        self.sharding_type = sharding_type
        self.layout = controller.layout
        strip = len(f"{PREFIX}worker_{self.layout.worker}.") if self.layout.worker else 0
        # Megatron's entries and their keys as Megatron named them (before a worker part and
        # the prefixes a ChainedOptimizer adds later).
        self.inner = [v for k, sub in state.items() if k != "local_sgd"
                      for v in nested_values(sub if isinstance(sub, (dict, list)) else [sub])
                      if isinstance(v, ShardedBase)]
        self.megatron_keys = {id(v): v.key[strip:] for v in self.inner}
        self.prepared = False
        self.mode: Optional[str] = None  # "same-workers" | "elastic" | "synchronous"
        self.torchft = False
        """This run's controller syncs over torchft (each job one worker)."""
        self.source = 0
        """The saved worker whose inner optimizer state this worker loads."""
        self.saved: Optional[dict] = None
        self.residuals = False  # error-feedback residuals read (the same on every rank)
        self.residual_workers: List[int] = []
        self.slice_loaded = False
        self.difference: Optional[str] = None
        self.identical: List[int] = []
        """Elastic resume: this run's fragments every saved worker held identical (restarted
        from the saved anchor; the others take the load-time outer step)."""

    @property
    def part(self) -> dict:
        return self.state["local_sgd"]

    def release(self) -> None:
        """After the load: drop the references to the requests (their buffers)."""
        self.state, self.inner, self.space = {}, [], None

    def record_request(self):
        return self.part["record"]

    def _requests(self, prefix: str, main: bool) -> dict:
        """Load requests made while the load is prepared (what the checkpoint's record says is
        there), keyed as the ones of the sharded state dict: Megatron's ``ChainedOptimizer``
        (a MoE model's dense and expert optimizers) had prefixed those by then (``chained_<i>.``),
        which this optimizer's record request shows (``torch_dist``; the ``fsdp_dtensor`` format of
        Megatron-FSDP has one optimizer and keys of its own)."""
        key = getattr(self.record_request(), "key", None)  # Megatron-FSDP's DCP record: no key, no prefix
        outer = key[: -len(RECORD_KEY)] if key is not None and key.endswith(RECORD_KEY) else ""
        return self.space.load_requests(outer + prefix, main)

    def decode_mains(self, loaded: dict) -> List[Dict[int, torch.Tensor]]:
        """Per shard, {saved worker: its main params} of the extra saved workers read."""
        return decode_mains(self.optimizer, self, loaded)

    def adam_step(self, state_dict: dict) -> int:
        """The optimizer steps a synchronous checkpoint had done."""
        return adam_step_of(state_dict)

    # ------------------------------------------------------------------ before the load
    def prepare(self, record, saved: dict) -> Optional[str]:
        """Fit the load requests to the checkpoint (``record``: its run record or None;
        ``saved``: its metadata). Returns an error message, or None."""
        self.prepared = True
        part = self.part
        if record is None:
            refused = compatibility.unrecorded_state(saved)
            if refused:
                return refused
            self.mode = "synchronous"
            self._retarget_inner(0)
            for key in [k for k in part if k != "plan"]:
                del part[key]
            return None
        try:
            record = check_run_record(record, "the checkpoint")
        except CheckpointStateError as e:
            return str(e)
        self.saved = record
        c, layout = self.controller, self.layout
        if getattr(c, "auto", None) is not None:  # auto overlap: continue with the settings in force
            saved_config = record.get("config") or {}
            refused = c.auto.resume(int(saved_config.get("outer_step_delay") or 0),
                                    format_name(saved_config.get("exchange_dtype") or "fp32",
                                                saved_config.get("exchange_topk_density")),
                                    int(saved_config.get("fragments") or 1))
            if refused:
                return refused
        tp, pp = parallel_sizes(self.optimizer)
        now = dict(num_workers=layout.num_workers, worker_size=layout.worker_size, tensor_parallel=tp,
                   pipeline_parallel=pp)
        self.difference = layout_difference(record, now)
        refused = compatibility.layout_refusal(record, self.sharding_type, (tp, pp), expert_sizes(self.optimizer))
        if refused:
            return refused
        n, m, workers = record["num_workers"], layout.worker, layout.num_workers
        self.mode = "same-workers" if n == workers else "elastic"
        self.torchft = c.backend.dynamic
        self._fit_workers(n, m, workers)
        refused = self._fit_outer(record)
        if refused:
            return refused
        self._fit_residuals(record, m, n, workers)
        if self.mode == "elastic" and record["anchor_taken"]:
            refused = self._fit_identical(record, (tp, pp))
            if refused:
                return refused
        flight = record.get("in_flight")
        if flight is not None:
            refused = compatibility.in_flight_refusal(record, flight, c.config, workers, self.torchft, (tp, pp))
            if refused:
                return refused
            part["in_flight"] = self._requests(IN_FLIGHT, m == 0)
            if flight["keep"]:
                part["in_flight_launch"] = self._requests(launch_prefix(m), True)
        self.slice_loaded = (n, record["tensor_parallel"], record["pipeline_parallel"]) == (workers, tp, pp)
        refused = self._fit_fragments(record)
        if refused:
            return refused
        if not self.slice_loaded:
            del part["slice"]
        key = getattr(self.record_request(), "key", None) or ""
        self._fit_biases(saved, key[: -len(RECORD_KEY)] if key.endswith(RECORD_KEY) else "",
                         self.mode == "same-workers", n)
        return self._bucket_mismatch(saved)

    def _fit_workers(self, n: int, m: int, workers: int) -> None:
        """Which saved workers this worker ``m`` of ``workers`` reads, of the ``n`` saved: the
        inner optimizer state's and, elastically, the main params of the load-time outer step."""
        if self.torchft and self.mode == "elastic":  # a torch-backend checkpoint, one torchft worker
            self.source = self.controller.config.replica_id % n
            if self.source != m:
                self._retarget_inner(self.source)  # its inner optimizer state: saved worker replica id mod N
            # Every other saved worker's main params: the load-time outer step is computed in the
            # job alone (no collective outside a torchft round), the same in every job.
            self.part["workers"] = {k: self._mains_request(k) for k in range(n) if k != self.source}
        else:
            self.source = m % n
            if m % n != m:
                self._retarget_inner(m % n)  # worker m's inner optimizer state: saved worker m mod N
            if self.mode == "elastic":
                self.part["workers"] = {k: self._mains_request(k) for k in range(m + workers, n, workers)}

    def _fit_outer(self, record: dict) -> Optional[str]:
        """The outer optimizer's state: none before the anchor; a refusal for state the outer
        optimizer does not use."""
        c = self.controller
        tensor_keys, _ = outer_state_keys(c)
        if not record["anchor_taken"]:
            self.part["anchor"], self.part["outer"] = {}, {}
        else:
            unknown = sorted(set(record["outer_tensor_state"]) - set(tensor_keys))
            if unknown:
                return (f"megatron_edit: the checkpoint's outer optimizer state has {unknown}, which "
                        f"{c.outer_config.optimizer_class.__name__} does not use: the outer "
                        f"optimizer changed ({record.get('outer_class')} saved).")
            kept = record["outer_tensor_state"]
            self.part["outer"] = {k: v for k, v in self.part["outer"].items() if k in kept}
        return None

    def _fit_fragments(self, record: dict) -> Optional[str]:
        """Another number of streaming fragments: refused where the per-layer state is loaded
        (the same slice), else a note that the run syncs the new fragments from here."""
        c = self.controller
        saved_fragments = (record.get("config") or {}).get("fragments", 1)
        if saved_fragments != c.config.fragments:
            if self.slice_loaded:  # its per-layer state is the saved fragments' (<layer>@fragment<f>)
                return (f"megatron_edit: the checkpoint was saved with --local-sgd-fragments "
                        f"{saved_fragments}, this run has {c.config.fragments}: the anomaly detector's "
                        "per-layer statistics and the per-layer decisions follow the fragments (a layer "
                        "cut by a fragment boundary is one layer per fragment). Resume with "
                        f"--local-sgd-fragments {saved_fragments}.")
            note = (f"megatron_edit: the checkpoint was saved with --local-sgd-fragments {saved_fragments}; "
                    f"this run syncs {c.config.fragments} fragment(s) from here.")
            if torch.distributed.get_rank() == 0 and note not in PROCESS.warned:  # once, not per optimizer
                PROCESS.warned.add(note)
                logger.warning(note)
        return None

    def _fit_biases(self, saved: dict, outer: str, same_workers: bool, saved_workers: int) -> None:
        """MoE routers' expert biases: the saved workers' this load reads (:mod:`.expert_bias`)."""
        biases = fit_bias_requests(self.controller, saved, outer, same_workers, saved_workers)
        if biases is not None:
            self.part["expert_bias"] = biases

    def _fit_identical(self, record, parallel) -> Optional[str]:
        """Elastic resume: which of this run's fragments restart from the saved anchor (every
        saved worker held them identical) rather than take the load-time outer step; a message
        when the checkpoint cannot say which parameters those are."""
        c = self.controller
        saved_f = int(record["config"].get("fragments", 1))
        identical = identical_fragments(record)
        if identical is None:
            return ("megatron_edit: this checkpoint was written by an earlier megatron_edit at a sync step "
                    "without recording which fragments its workers held identical (a delayed merge keeps "
                    f"local progress); resume it with {record['num_workers']} workers, or from a checkpoint "
                    "written by this version.")
        if not identical or len(identical) == saved_f:  # none or all: the fragments do not matter
            self.identical = list(range(c.config.fragments)) if identical else []
            return None
        synced = f"saved right after fragment {'/'.join(map(str, identical))}'s sync"
        if saved_f != c.config.fragments:
            return (f"megatron_edit: the checkpoint was {synced} with {FLAG_NAMES['fragments']} {saved_f}, "
                    f"this run has {c.config.fragments}: an elastic resume there needs the saved fragments; "
                    f"resume with {FLAG_NAMES['fragments']} {saved_f}, or from a checkpoint saved at another step.")
        same_slice = (record["tensor_parallel"], record["pipeline_parallel"]) == parallel
        if not same_slice or (self.layout.dp_group_idx == 0 and record.get("fragment_sizes") is not None
                              and record["fragment_sizes"] != c.fragment_sizes):
            return (f"megatron_edit: the checkpoint was {synced} with {FLAG_NAMES['fragments']} {saved_f}, "
                    "and this run's fragments hold other buckets (another TP / PP or --ddp-bucket-size): "
                    "an elastic resume there needs the saved fragments; keep TP, PP and the bucket size, "
                    "or resume from a checkpoint saved at another step.")
        self.identical = identical
        return None

    def _fit_residuals(self, record, m: int, n: int, workers: int) -> None:
        part = self.part
        wanted = "result_residual" in part
        self.residuals = wanted and record["residuals"]
        if self.residuals and self.torchft and self.mode == "elastic":
            # As a torchft worker that heals: its error-feedback residuals start at zero.
            self.residuals = False
            part.pop("residual", None)
            part.pop("result_residual", None)
            if torch.distributed.get_rank() == 0:
                logger.warning("megatron_edit: the checkpoint's error-feedback residuals (saved by %d workers of "
                               "the torch backend) are not carried into a torchft worker: they start at zero.", n)
            return
        if self.residuals:
            self.residual_workers = list(range(m, n, workers)) if self.mode == "elastic" else [m]
            # Saved worker k is read by one worker only (k mod M): its requests are main.
            part["residual"] = {k: self._requests(residual_prefix(k), True) for k in self.residual_workers}
            return
        part.pop("residual", None)
        part.pop("result_residual", None)
        if wanted and torch.distributed.get_rank() == 0:
            logger.warning("megatron_edit: the checkpoint has no error-feedback residuals (saved "
                           "without a quantized exchange with error feedback): they start at zero.")

    def _bucket_mismatch(self, saved: dict) -> Optional[str]:
        """Megatron's bucket-space format against the checkpoint's buckets (model-space formats
        follow the model, whose own checks apply)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        if self.sharding_type in FULLY_RESHARDABLE:
            return None
        for sh in self.inner:
            if isinstance(sh, ShardedTensor) and sh.key in saved and not sh.allow_shape_mismatch:
                was = tuple(saved[sh.key].global_shape)
                if was != tuple(sh.global_shape):
                    return (f"megatron_edit: Megatron's {self.sharding_type!r} optimizer state does "
                            f"not fit this run ({sh.key}: {was} saved, {tuple(sh.global_shape)} now): "
                            f"the buckets changed (the model or --ddp-bucket-size"
                            f"{'; ' + self.difference if self.difference else ''}). EDiT's state "
                            f"reshards, Megatron's bucket-space format does not: save with "
                            f"'fully_reshardable' (--dist-ckpt-optim-fully-reshardable) or keep the "
                            f"bucket size.")
        return None

    def _retarget_inner(self, worker: int) -> None:
        """Load saved worker ``worker``'s inner optimizer state. Another worker reads it as its
        own too (worker ``worker`` itself, or worker 0 for Megatron's keys): these requests
        are not the main replica (Megatron's load checks there is one per shard). A torchft
        worker's job holds no other worker: its requests stay the main ones."""
        for sh in self.inner:
            sh.key = retarget(sh.key, self.megatron_keys[id(sh)], worker)
            if worker != self.layout.worker and not self.torchft:
                rid = sh.replica_id
                sh.replica_id = 1 if isinstance(rid, int) else (1, *tuple(rid)[1:])

    def _mains_request(self, worker: int):
        """Saved worker ``worker``'s main params, in Megatron's format (fresh buffers)."""
        import dataclasses

        from megatron.core.dist_checkpointing.mapping import (
            LocalNonpersistentObject,
            ShardedTensor,
            ShardedTensorFactory,
        )

        def copy(node):
            if isinstance(node, list):
                return [copy(v) for v in node]
            out = {}
            for key, value in node.items():
                if isinstance(value, (dict, list)):
                    out[key] = copy(value)
                elif key in _MAIN_KEYS and isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                    new_key = retarget(value.key, self.megatron_keys[id(value)], worker)
                    out[key] = dataclasses.replace(value, key=new_key, data=torch.empty_like(value.data))
                elif isinstance(value, LocalNonpersistentObject):
                    out[key] = value  # e.g. dp_reshardable's padding flags
            return out

        return copy(self.state["param_state"])


# --------------------------------------------------------------------------- after the load
