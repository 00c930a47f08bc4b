"""The live state behind the megatron-core wraps: configs and each optimizer's EDiT object.

The wraps (:mod:`megatron_edit.mcore.core_wraps`) are process-global (they replace Megatron's
functions); :class:`LocalSGDRuntime` is what they consult when Megatron calls them: the configs
(given directly, or read from Megatron-LM's parsed arguments when the first DDP is built), and
the :class:`LocalSGD` of every distributed optimizer built while patched.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from contextlib import contextmanager
from typing import Callable, List, NamedTuple, Optional

import torch

from ..config import (GTAConfig, LocalSGDConfig, NotSupportedYet, OuterOptimizerConfig, check_combination,
                      default_outer_config)
from . import compat
from .async_plan import AsyncPlan, FollowerPlan
from .checks import check_megatron_options, check_moe_options, check_optimizer_options, check_workers
from .controller import LocalSGD
from .expert_bias import register_model
from .fsdp import check_fsdp_release
from .sync_record import SyncRecord
from .worker_layout import check_worker_holds, groups_a_step_uses

logger = logging.getLogger(__name__)



def _refuse_without_optimizer(model: str) -> None:
    """A model registered for EDiT that trains without a distributed optimizer over it."""
    raise RuntimeError(
        f"megatron_edit: {model} with --use-local-sgd, but no Megatron DistributedOptimizer was "
        "built over it (get_megatron_optimizer with use_distributed_optimizer=True); EDiT cannot "
        "run and will not silently fall back to synchronous training.")

class Configs(NamedTuple):
    """The three configs of one EDiT run, as one typed bundle (a tuple: ``local, outer, gta =
    configs`` unpacks it, and it compares equal to the plain tuple of the same configs)."""

    local: LocalSGDConfig
    outer: OuterOptimizerConfig
    gta: GTAConfig


class LocalSGDRuntime:
    """The live state behind the wraps: configs and the EDiT objects of each optimizer."""

    def __init__(
        self,
        local_sgd_config: Optional[LocalSGDConfig] = None,
        outer_optim_config: Optional[OuterOptimizerConfig] = None,
        gta_config: Optional[GTAConfig] = None,
        configs_from: Optional[Callable[[], Optional[tuple]]] = None,
    ):
        """Either the configs, or ``configs_from``: a callable returning them (or None when
        local SGD is off; a :class:`Configs` or a plain tuple of the three), called once when
        Megatron builds the first DDP (Megatron-LM parses its arguments before that)."""
        self._configs: Optional[Configs] = None
        if local_sgd_config is not None:
            self._configs = Configs(
                local_sgd_config,
                outer_optim_config or default_outer_config(local_sgd_config),
                gta_config or GTAConfig(),
            )
            check_combination(self._configs.local, self._configs.gta)
        self._configs_from = configs_from
        self._resolved = self._configs is not None
        self.train_iters: Optional[int] = None
        """The synchronous run's iterations when known (Megatron-LM: --train-iters): A-EDiT's
        budget is that many steps per worker in total, shared out by speed."""
        self.controllers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.group_owner: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.registered_groups: "weakref.WeakSet" = weakref.WeakSet()
        self.per_token_groups: "weakref.WeakSet" = weakref.WeakSet()
        """Bucket groups of a model with ``calculate_per_token_loss`` (summed, not averaged)."""
        self.tokens_counted_in_worker = False
        """Megatron-LM's training loop counts ``--calculate-per-token-loss``'s tokens over the
        worker once gradients stay inside it (its reporting regions, training.worker_local):
        set where those patches are applied; with megatron-core alone, finalize_model_grads
        counts them over every data-parallel rank."""
        self._local_ddp_configs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._reducing_locally: "weakref.WeakSet" = weakref.WeakSet()
        # optimizer -> all ranks of its worker, where gradient statistics are reduced
        self.grad_stats_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        # DDP model chunk -> (its dense controller, the worker's part of Megatron's tensor x data x
        # context-parallel group): MoE expert-bias counts between syncs (mcore.expert_bias)
        self.expert_bias_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        # Megatron-FSDP (megatron_edit.mcore.fsdp): the models built while patched, their
        # pipelines, and each pipeline's controller once an optimizer is built over it
        self.registered_fsdp: "weakref.WeakSet" = weakref.WeakSet()
        self._registered_fsdp_pipelines: "weakref.WeakSet" = weakref.WeakSet()
        self.fsdp_pipelines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.sync_record: Optional[SyncRecord] = None
        """The per-sync record of this session's controllers (``LocalSGDConfig.sync_record``), or None."""
        self.record_reader = False
        """This rank reads its worker's records as they are written (``SyncRecord.take``): set before
        the first controller is built (Megatron-LM's logging rank, :mod:`megatron_edit.training.record_log`)."""

    def close(self) -> None:
        """The session's end (:func:`~megatron_edit.unpatch_megatron_for_local_sgd`): the sync
        record writes what it still holds."""
        if self.sync_record is not None:
            self.sync_record.close()

    @property
    def configs(self) -> Optional[Configs]:
        if not self._resolved:
            found = self._configs_from() if self._configs_from else None
            self._configs = None if found is None else Configs(*found)
            self._resolved = True
        return self._configs

    # --- called from the wrappers -------------------------------------------------------
    def on_ddp_init(self, ddp) -> None:
        if self.configs is None:
            return
        check_megatron_options(self.configs.local, ddp.config, ddp.ddp_config, self.tokens_counted_in_worker)
        expert_groups = list(getattr(ddp, "expert_parallel_bucket_groups", ()))
        if getattr(ddp.config, "num_moe_experts", None):
            check_moe_options(self.configs.local, ddp.config, bool(expert_groups))
        check_workers(
            compat.data_parallel_group(ddp).size(), ddp.ddp_config.num_distributed_optimizer_instances
        )
        # MoE with expert parallelism: the experts' bucket groups (their own buffers, sharded over
        # the worker's expert data-parallel ranks) belong to a second distributed optimizer.
        for group in list(ddp.bucket_groups) + expert_groups:
            self.registered_groups.add(group)
            if getattr(ddp.config, "calculate_per_token_loss", False):
                self.per_token_groups.add(group)

    def check_fsdp(self, transformer_config, ddp_config) -> None:
        """Before Megatron-FSDP is built: the options EDiT on it refuses."""
        check_megatron_options(self.configs.local, transformer_config, ddp_config)
        if getattr(transformer_config, "num_moe_experts", None):
            ep = getattr(transformer_config, "expert_model_parallel_size", 1) or 1
            check_moe_options(self.configs.local, transformer_config, expert_parallel=ep > 1)

    def on_fsdp_init(self, wrapper) -> None:
        """A Megatron-FSDP model (``FullyShardedDataParallel``) was built while patched."""
        if self.configs is None:
            return
        fsdp = wrapper.module
        check_workers(fsdp.dist_index.get_dp_group().size(), wrapper.ddp_config.num_distributed_optimizer_instances)
        self.registered_fsdp.add(fsdp)
        self._registered_fsdp_pipelines.add(fsdp.grad_reduce_pipeline)

    def fsdp_controller(self, pipeline) -> Optional[LocalSGD]:
        """The controller of a Megatron-FSDP gradient-reduce pipeline (None when EDiT is not
        attached); refuses one registered for EDiT without a distributed optimizer over it."""
        controller = self.fsdp_pipelines.get(pipeline)
        if controller is None and pipeline in self._registered_fsdp_pipelines:
            _refuse_without_optimizer("this Megatron-FSDP model was built")
        return controller

    def on_optimizer_init(self, optimizer) -> None:
        if self.configs is None:
            return
        check_optimizer_options(optimizer.config, getattr(optimizer, "grad_scaler", None) is not None,
                                compat.uses_megatron_fsdp(optimizer.ddp_config))
        if compat.uses_megatron_fsdp(optimizer.ddp_config):
            check_fsdp_release()  # the fsdp-init patch exists (and checked the model) on these only
        unchecked = [g for chunk in optimizer.model_chunks
                     for g in (*getattr(chunk, "bucket_groups", ()), *getattr(chunk, "expert_parallel_bucket_groups", ()))
                     if g not in self.registered_groups]
        unchecked += [chunk for chunk in optimizer.model_chunks
                      if compat.uses_megatron_fsdp(optimizer.ddp_config) and chunk.module not in self.registered_fsdp]
        if unchecked:
            raise RuntimeError(
                "megatron_edit: the DDP model of this optimizer was built before "
                "patch_megatron_for_local_sgd(...) was called (its options were never checked "
                "for EDiT). Call patch_megatron_for_local_sgd(...) first, then build the DDP "
                "model and get_megatron_optimizer(...)."
            )
        controller = LocalSGD(optimizer, *self.configs)
        if controller.config.use_async:
            # MoE with expert parallelism: the expert optimizer (built after the dense one, from
            # the same model chunks) follows the dense one's A-EDiT plan, or the two halves of
            # the model would sync after different steps.
            for other_optimizer, other in list(self.controllers.items()):
                if _same_model(other_optimizer, optimizer) and isinstance(other.async_plan, AsyncPlan):
                    controller.async_plan = FollowerPlan(other.async_plan)
                    if controller.auto is not None:  # (its measurements would ride on no all-reduce)
                        raise NotSupportedYet(
                            "megatron_edit: --local-sgd-auto-overlap with --local-sgd-async on a MoE model with "
                            "expert parallelism (two optimizers on one A-EDiT plan) is not supported yet; drop "
                            "one of the two.")
                    break
        if controller.config.sync_record is not None:  # before the join: a torchft join is recorded too
            if self.sync_record is None:
                self.sync_record = SyncRecord.open(controller, reader=self.record_reader)
            controller.record = self.sync_record.feed(controller)
        controller.backend.ready()  # torchft: join the others (with its plan as it syncs with it)
        if self.train_iters is not None:
            controller.set_train_iters(self.train_iters)
        self.controllers[optimizer] = controller
        # A collective on megatron-core 0.12.x (builds the group): every rank builds optimizers.
        worker = compat.instance_group(controller.sync_group.group)
        if worker is not None:
            self.grad_stats_groups[optimizer] = worker
            if controller.fsdp is None:
                ranks = torch.distributed.get_process_group_ranks
                check_worker_holds(ranks(worker), {name: ranks(group) for name, group
                                                   in groups_a_step_uses(optimizer, controller.layout).items()})
        register_model(self, optimizer, controller, worker)  # a collective with expert biases
        for group in controller.group_shards:
            self.group_owner[group] = controller
        if controller.fsdp is not None:
            for pipeline in controller.fsdp.pipelines:
                self.fsdp_pipelines[pipeline] = controller
            if controller.config.sync_mode == "layerwise" and controller.fsdp.prefetches_everything \
                    and torch.distributed.get_rank() == 0:
                logger.warning(
                    "megatron_edit: --local-sgd-sync-mode layerwise on Megatron-FSDP: its prefetch "
                    "window (%d elements) holds the whole model, so each sync completes at the end "
                    "of the optimizer step, not overlapped with the next forward pass; set "
                    "--suggested-communication-unit-size (e.g. twice a layer's parameters) for the "
                    "overlap.", controller.fsdp.fsdp.suggested_AG_prefetch_size)
        if torch.distributed.get_rank() == 0:
            logger.info(
                "megatron_edit: EDiT on a distributed optimizer with %d buckets, %d workers, "
                "sync every %d steps after %d warmup steps (%s%s%s)",
                len(controller.shards),
                controller.num_workers,
                controller.config.local_sgd_sync_interval,
                controller.config.local_sgd_warmup_steps,
                controller.config.sync_mode,
                f", outer step delayed {controller.config.outer_step_delay} steps"
                if controller.config.outer_step_delay else "",
                f", {controller.config.fragments} fragments of "
                f"{'/'.join(str(len(f)) for f in controller.sync_shards.fragments)} buckets, one every "
                f"{controller.config.local_sgd_sync_interval // controller.config.fragments} steps"
                if controller.config.fragments > 1 else "",
            )

    @staticmethod
    def refuse_unattached(optimizer) -> None:
        """A distributed optimizer steps under the patch without EDiT state: it was built before
        :func:`~megatron_edit.patch_megatron_for_local_sgd` (or in an earlier patch session).
        Training it would be synchronous data parallelism without a word: refuse."""
        raise RuntimeError(
            f"megatron_edit: this {type(optimizer).__name__} was built before "
            "patch_megatron_for_local_sgd(...) was called, so EDiT is not attached to it and "
            "training would silently be synchronous. Call patch_megatron_for_local_sgd(...) "
            "first, then build the DDP model and get_megatron_optimizer(...)."
        )

    def controller_for_group(self, bucket_group) -> Optional[LocalSGD]:
        controller = self.group_owner.get(bucket_group)
        if controller is None and bucket_group in self.registered_groups:
            _refuse_without_optimizer("this model was wrapped in DDP")
        return controller

    @contextmanager
    def worker_local_reduction(self, bucket_group, controller: LocalSGD):
        """Run one bucket group's gradient reduction inside the worker only.

        Megatron reduce-scatters over the worker, then all-reduces the shard across workers when
        ``num_distributed_optimizer_instances > 1``. Seen through a copy of the DDP config with
        one instance, the same code does only the first part; the pre-scaling of gradients
        (1/DP size unless averaged in the collective) is raised to 1/worker size to match.
        """
        if bucket_group in self._reducing_locally:
            # finish_grad_sync calls start_grad_sync itself (first batch, or no overlap): the
            # outer call already switched this group; scaling twice would double the gradients.
            yield
            return
        ddp_config = bucket_group.ddp_config
        local_config = self._local_ddp_configs.get(bucket_group)
        if local_config is None:
            local_config = dataclasses.replace(ddp_config, num_distributed_optimizer_instances=1)
            self._local_ddp_configs[bucket_group] = local_config
        factors = [b.gradient_scaling_factor for b in bucket_group.buckets]
        # (--calculate-per-token-loss: gradients are summed, then divided by the tokens counted
        # over the same ranks: Megatron-LM's reporting region counts the worker's, training.worker_local)
        if not ddp_config.average_in_collective and bucket_group not in self.per_token_groups:
            for bucket in bucket_group.buckets:
                bucket.gradient_scaling_factor = bucket.gradient_scaling_factor * controller.num_workers
        bucket_group.ddp_config = local_config
        self._reducing_locally.add(bucket_group)
        try:
            yield
        finally:
            self._reducing_locally.discard(bucket_group)
            bucket_group.ddp_config = ddp_config
            for bucket, factor in zip(bucket_group.buckets, factors):
                bucket.gradient_scaling_factor = factor


def get_local_sgd(optimizer, runtime: Optional[LocalSGDRuntime]) -> List[LocalSGD]:
    """The EDiT objects behind a Megatron optimizer (a ChainedOptimizer holds several)."""
    if runtime is None:
        return []
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    return [runtime.controllers[o] for o in optimizers if o in runtime.controllers]


def _same_model(a, b) -> bool:
    """Two distributed optimizers of one model (MoE with expert parallelism: the dense and the
    expert one are given the same DDP model chunks)."""
    chunks_b = getattr(b, "model_chunks", None) or []
    return any(x is y for x in getattr(a, "model_chunks", None) or [] for y in chunks_b)
