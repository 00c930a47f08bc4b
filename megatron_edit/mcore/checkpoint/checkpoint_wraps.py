"""The checkpoint wraps (registry patches of the distributed optimizer and ``dist_checkpointing``):
EDiT state in and out of Megatron's distributed-optimizer checkpoints.

Wraps ``DistributedOptimizer.state_dict`` / ``sharded_state_dict`` / ``load_state_dict`` /
``_set_main_param_and_optimizer_states`` and ``dist_checkpointing.load``: a pending sync is
completed before anything is read, worker k >= 1's optimizer part is renamed
(:mod:`.keys`), the EDiT part is added (:mod:`.state`); before a load the
checkpoint's record is read and the requests fitted to it (:mod:`.resume`: another
worker count, a synchronous checkpoint, clear errors for what is missing); after it the EDiT
state is restored. megatron-core's own load defects (:mod:`.load_fixes`) are fixed in the same
wraps for every distributed optimizer, EDiT or not, on the releases that have them. On releases
that cannot carry EDiT state yet, saving or loading an EDiT optimizer is refused; the legacy
``torch`` format is refused everywhere.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Callable, Optional

from ...config import NotSupportedYet
from .. import compat
from .state import (
    NOT_YET,
    SUPPORTED,
    SUPPORTED_SHARDING_TYPES,
    load_local_sgd_state,
    local_sgd_sharded_state_dict,
)
from .guard import damaged_message, prepare_load
from .keys import (
    CheckpointStateError,
    drop_worker_model_entries,
    rename_for_worker,
    sharding_type_of,
    unalias_from_model,
)
from .after_load import capture_of
from .fsdp_dtensor import fsdp_save_state_dict
from .fsdp_load import fsdp_load_requests, load_fsdp_state, prepare_fsdp_load
from ..process_state import PROCESS
from ..releases import FSDP_SUPPORTED
from .load_fixes import (
    FSDP_EMPTY_SHARD_BUG,
    FSDP_LOAD_FIXES,
    METADATA_FIX,
    refuse_broken_fully_reshardable,
    fix_load_state_dict,
    fix_set_main_param_state,
    fix_state_dict,
)
from ..wrap_registry import Patch, PatchRegistry

_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_CHAINED = "megatron.core.optimizer.optimizer:ChainedOptimizer"


def _bind(original, self, args, kwargs) -> inspect.BoundArguments:
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    return bound


def _wrap_state_dict(controller_of, original):
    fixed = fix_state_dict(original)  # megatron-core's own load defects, for every optimizer

    def wrapper(self, *args, **kwargs):
        controller = controller_of(self)
        if controller is not None:
            controller.flush()
        return fixed(self, *args, **kwargs)

    return wrapper


def _wrap_sharded_state_dict(controller_of, original):
    def wrapper(self, *args, **kwargs):
        controller = controller_of(self)
        if controller is None:
            return original(self, *args, **kwargs)
        bound = _bind(original, self, args, kwargs)
        is_loading = bound.arguments["is_loading"]
        if controller.in_step:
            raise RuntimeError("megatron_edit: a checkpoint cannot be taken inside an optimizer step.")
        controller.flush()  # a due layer-wise sync completes now, with the same numbers
        if not is_loading and controller.auto is not None:
            controller.auto.before_save()  # A-EDiT: a decision taken at this sync, in force from now
        if controller.fsdp is not None:  # Megatron-FSDP: its own format (Megatron refuses others)
            state = original(*bound.args, **bound.kwargs)
            if is_loading:
                return fsdp_load_requests(self, controller, state)
            return fsdp_save_state_dict(self, controller, state, bound.arguments["model_sharded_state_dict"])
        if not is_loading and self.ddp_config.overlap_param_gather:
            controller.gather_params_in_worker()
        state = original(*bound.args, **bound.kwargs)
        sharding_type = sharding_type_of(state, bound.arguments)
        if sharding_type not in SUPPORTED_SHARDING_TYPES:
            raise NotSupportedYet(
                f"megatron_edit: the distributed optimizer checkpoint format {sharding_type!r} "
                f"cannot hold each EDiT worker's state; use 'dp_reshardable' (Megatron-LM's "
                f"default) or 'fully_reshardable' (--dist-ckpt-optim-fully-reshardable)."
            )
        refuse_broken_fully_reshardable(self, sharding_type)
        layout = controller.layout
        model_state = bound.arguments["model_sharded_state_dict"]
        if layout.worker > 0:
            rename_for_worker(state, sharding_type, layout)
            if is_loading:
                unalias_from_model(state, self)
        # Built before worker k's model entries are dropped: EDiT's per-parameter entries
        # take their keys from them.
        state["local_sgd"] = local_sgd_sharded_state_dict(self, controller, state, model_state,
                                                          sharding_type, is_loading)
        if layout.worker > 0 and not is_loading:
            drop_worker_model_entries(model_state, self)
        return state

    return wrapper


def _wrap_load_state_dict(controller_of, original):
    fixed = fix_load_state_dict(original)

    def wrapper(self, state_dict, *args, **kwargs):
        controller = controller_of(self)
        if controller is None:
            return fixed(self, state_dict, *args, **kwargs)
        if controller.fsdp is not None:
            return load_fsdp_state(self, controller, lambda inner: fixed(self, inner, *args, **kwargs))
        part = state_dict.get("local_sgd") if isinstance(state_dict, dict) else None
        is_checkpoint = isinstance(state_dict, dict) and "param_state" in state_dict
        if is_checkpoint and part is None:
            raise CheckpointStateError(
                "megatron_edit: the optimizer state being loaded has no EDiT (local SGD) part: it "
                "was not loaded through this EDiT optimizer's sharded_state_dict(is_loading=True)."
            )
        if part is not None:
            state_dict = {k: v for k, v in state_dict.items() if k != "local_sgd"}
        result = fixed(self, state_dict, *args, **kwargs)
        if part is not None:
            load_local_sgd_state(self, controller, part, state_dict)
        return result

    return wrapper


def _wrap_set_main_param_state(original):
    fixed = fix_set_main_param_state(original)

    def wrapper(self, model_param, tensors, *args, **kwargs):
        captured = capture_of(self)
        if captured is not None:  # decoding another saved worker's main params
            captured[model_param] = tensors
            return None
        return fixed(self, model_param, tensors, *args, **kwargs)

    return wrapper


def _wrap_dist_load(runtime_ref, original):
    def wrapper(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        runtime = runtime_ref()
        if runtime is None or len(runtime.controllers) == 0:
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        prepare_load(sharded_state_dict, checkpoint_dir, original)
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - named and re-raised
            raise CheckpointStateError(damaged_message(checkpoint_dir, e)) from e

    return wrapper


def _wrap_dcp_load(runtime_ref, original):
    def wrapper(state_dict, *args, **kwargs):
        runtime = runtime_ref()
        if runtime is not None and len(runtime.controllers) and PROCESS.checkpoint_plans:
            bound = inspect.signature(original).bind(state_dict, *args, **kwargs).arguments
            reader = bound.get("storage_reader")
            path = getattr(reader, "path", None) or bound.get("checkpoint_id")
            if path is None:
                raise CheckpointStateError(
                    "megatron_edit: an EDiT optimizer on Megatron-FSDP reads fsdp_dtensor checkpoints "
                    "from a folder: give torch.distributed.checkpoint.load a checkpoint_id or a "
                    "FileSystemReader.")
            prepare_fsdp_load(state_dict, path)
        return original(state_dict, *args, **kwargs)

    return wrapper


def _refuse_legacy(controller_of, what):
    def wrap(original):
        def wrapper(self, *args, **kwargs):
            if any(controller_of(o) is not None for o in getattr(self, "chained_optimizers", [self])):
                raise NotSupportedYet(
                    f"megatron_edit: {what} with local SGD is not supported: the legacy "
                    f"'torch' checkpoint format gathers the optimizer state of one EDiT "
                    f"worker only, so the other workers' local state would be lost. Use "
                    f"--ckpt-format torch_dist (megatron.core.dist_checkpointing)."
                )
            return original(self, *args, **kwargs)

        return wrapper

    return wrap


def _refuse_before_support(controller_of, what):
    def wrap(original):
        def wrapper(self, *args, **kwargs):
            if controller_of(self) is not None:
                from ..compat import megatron_core_version

                raise NotSupportedYet(
                    f"megatron_edit: {what} of a local-SGD optimizer needs megatron-core "
                    f"{SUPPORTED} (EDiT state in torch_dist checkpoints); megatron-core "
                    f"{megatron_core_version()} is installed. Checkpointing EDiT on it is not "
                    f"supported yet: upgrade megatron-core, or train without saving the optimizer."
                )
            return original(self, *args, **kwargs)

        return wrapper

    return wrap


def add_checkpoint_patches(registry: PatchRegistry, runtime_ref: Callable[[], Optional[object]]) -> PatchRegistry:
    """Declare the checkpoint patches on ``registry`` (after :func:`build_registry`'s)."""

    def controller_of(optimizer):
        runtime = runtime_ref()
        return runtime.controllers.get(optimizer) if runtime is not None else None

    for method, what in (("state_dict", "saving the state"), ("sharded_state_dict", "saving or loading the state"),
                         ("load_state_dict", "loading the state")):
        target = f"{_DISTOPT}.{method}"
        registry.add(Patch(f"ckpt-not-yet-{method.replace('_', '-')}", target,
                           _refuse_before_support(controller_of, what), NOT_YET, compat.params(target),
                           "before 0.16: refuse to checkpoint EDiT (its state would be missing)"))

    v = SUPPORTED
    registry.add(Patch("ckpt-distopt-state-dict", f"{_DISTOPT}.state_dict", partial(_wrap_state_dict, controller_of),
                       v, ("self",),
                       "complete a pending sync; 0.16-0.19 w/o apex/TE, every optimizer: zero Adam state "
                       "before 'step' is read"))
    registry.add(Patch("ckpt-distopt-sharded-state-dict", f"{_DISTOPT}.sharded_state_dict",
                       partial(_wrap_sharded_state_dict, controller_of), v,
                       ("self", "model_sharded_state_dict", "is_loading", "sharding_type", "metadata"),
                       "EDiT state (per-parameter anchor, outer state, residuals; counters) + each "
                       "worker's optimizer state under its own keys in torch_dist checkpoints"))
    registry.add(Patch("ckpt-distopt-load-state-dict", f"{_DISTOPT}.load_state_dict",
                       partial(_wrap_load_state_dict, controller_of), v, ("self", "state_dict"),
                       "restore EDiT state (with an outer step at load after a worker-count change) "
                       "and each worker's model; 0.16-0.19 w/o apex/TE, every optimizer: load under "
                       "no_grad, one Adam step tensor per param with the checkpoint's value"))
    registry.add(Patch("ckpt-distopt-set-main-param-state", f"{_DISTOPT}._set_main_param_and_optimizer_states",
                       _wrap_set_main_param_state, v, ("self", "model_param", "tensors"),
                       "decode other saved workers' main params; 0.16-0.19 w/o apex/TE, every "
                       "optimizer: copy under no_grad, tolerate a missing per-param Adam step"))
    # Megatron-FSDP's fsdp_dtensor checkpoints are read by torch.distributed.checkpoint itself
    # (Megatron-LM 0.16 calls the deprecated load_state_dict; megatron-core users call load).
    for name, params in (("load", ("state_dict",)), ("load_state_dict", ("state_dict", "storage_reader"))):
        registry.add(Patch(f"ckpt-dcp-{name.replace('_', '-')}", f"torch.distributed.checkpoint:{name}",
                           partial(_wrap_dcp_load, runtime_ref), FSDP_SUPPORTED, params,
                           "EDiT on Megatron-FSDP: read the EDiT record first and fit the fsdp_dtensor "
                           "load to the checkpoint; clear errors for what is missing"))
    registry.add(Patch(*METADATA_FIX))  # any torch_dist checkpoint on torch 2.15+, EDiT or not
    for patch_id, method, wrap, params, description in FSDP_LOAD_FIXES:  # plain Megatron-FSDP too
        registry.add(Patch(patch_id, f"{_DISTOPT}.{method}", wrap, FSDP_EMPTY_SHARD_BUG, params, description))
    dist_load = "megatron.core.dist_checkpointing:load"
    registry.add(Patch("ckpt-dist-checkpointing-load", dist_load, partial(_wrap_dist_load, runtime_ref), v,
                       compat.params(dist_load),
                       "read the EDiT record first and fit the load to the checkpoint; clear errors "
                       "for what is missing or cannot reshard"))
    # The legacy format: a ChainedOptimizer of several optimizers bypasses the
    # DistributedOptimizer methods, so both are refused.
    for owner, name in ((_DISTOPT, "distopt"), (_CHAINED, "chained")):
        for method in ("save_parameter_state", "load_parameter_state"):
            registry.add(Patch(f"ckpt-refuse-legacy-{name}-{method.split('_')[0]}", f"{owner}.{method}",
                               _refuse_legacy(controller_of, f"--ckpt-format torch ({method})"), compat.SUPPORTED,
                               ("self", "filename"),
                               "refuse the legacy torch checkpoint format with local SGD"))
    return registry
