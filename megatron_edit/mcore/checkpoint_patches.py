"""The checkpoint patches: EDiT state in and out of Megatron's distributed-optimizer checkpoints.

Wraps ``DistributedOptimizer.state_dict`` / ``sharded_state_dict`` / ``load_state_dict`` (and
``dist_checkpointing.load`` for a clear error when the EDiT part is missing): a pending sync is
completed before anything is read, worker k >= 1's optimizer part is renamed
(:mod:`.checkpoint_layout`), the EDiT part is added (:mod:`.checkpoint`), and megatron-core's own
load defects are fixed on the releases that have them (:mod:`.load_fixes`). On releases that
cannot carry EDiT state yet, saving or loading an EDiT optimizer is refused; the legacy ``torch``
format is refused everywhere.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Optional

import torch

from ..config import NotSupportedYet
from . import compat
from .checkpoint import (
    NOT_YET,
    SUPPORTED,
    SUPPORTED_SHARDING_TYPES,
    _check_record,
    check_checkpoint_has_local_sgd_state,
    load_local_sgd_state,
    local_sgd_sharded_state_dict,
    _refresh_model_from_mains,
)
from .checkpoint_layout import (
    CheckpointStateError,
    _bucket_slots,
    _drop_worker_model_entries,
    _Layout,
    _rename_for_worker,
    _sharding_type,
    _unalias_from_model,
)
from .load_fixes import (
    _adam_state_of,
    _needs_torch_adam_fixes,
    _refuse_broken_fully_reshardable,
    init_missing_adam_state,
    restore_adam_steps,
)
from .patching import Patch, PatchRegistry

_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_CHAINED = "megatron.core.optimizer.optimizer:ChainedOptimizer"


def _bind(original, self, args, kwargs) -> inspect.BoundArguments:
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    return bound


def add_checkpoint_patches(registry: PatchRegistry, runtime_ref: Callable[[], Optional[object]]) -> PatchRegistry:
    """Declare the checkpoint patches on ``registry`` (after :func:`build_registry`'s)."""

    def controller_of(optimizer):
        runtime = runtime_ref()
        return runtime.controllers.get(optimizer) if runtime is not None else None

    def wrap_state_dict(original):
        def wrapper(self, *args, **kwargs):
            controller = controller_of(self)
            if controller is not None:
                controller.flush()
                if _needs_torch_adam_fixes(self):
                    init_missing_adam_state(self)
            return original(self, *args, **kwargs)

        return wrapper

    def wrap_sharded_state_dict(original):
        def wrapper(self, *args, **kwargs):
            controller = controller_of(self)
            if controller is None:
                return original(self, *args, **kwargs)
            bound = _bind(original, self, args, kwargs)
            is_loading = bound.arguments["is_loading"]
            if controller._in_step:
                raise RuntimeError("megatron_edit: a checkpoint cannot be taken inside an optimizer step.")
            controller.flush()  # a due layer-wise sync completes now, with the same numbers
            if _needs_torch_adam_fixes(self):
                init_missing_adam_state(self)
            if not is_loading and self.ddp_config.overlap_param_gather:
                controller.gather_params_in_worker()
            state = original(*bound.args, **bound.kwargs)
            sharding_type = _sharding_type(state, bound.arguments)
            if sharding_type not in SUPPORTED_SHARDING_TYPES:
                raise NotSupportedYet(
                    f"megatron_edit: the distributed optimizer checkpoint format {sharding_type!r} "
                    f"cannot hold each EDiT worker's state; use 'dp_reshardable' (Megatron-LM's "
                    f"default) or 'fully_reshardable' (--dist-ckpt-optim-fully-reshardable)."
                )
            _refuse_broken_fully_reshardable(self, sharding_type)
            layout = _Layout.of(self, controller)
            if layout.worker > 0:
                _rename_for_worker(state, sharding_type, layout)
                if is_loading:
                    _unalias_from_model(state, self)
                else:
                    _drop_worker_model_entries(bound.arguments["model_sharded_state_dict"], self)
            state["local_sgd"] = local_sgd_sharded_state_dict(self, controller, is_loading)
            return state

        return wrapper

    def wrap_load_state_dict(original):
        def wrapper(self, state_dict, *args, **kwargs):
            controller = controller_of(self)
            if controller is None:
                return original(self, state_dict, *args, **kwargs)
            part = state_dict.get("local_sgd") if isinstance(state_dict, dict) else None
            is_checkpoint = isinstance(state_dict, dict) and "param_state" in state_dict
            if is_checkpoint and part is None:
                raise CheckpointStateError(
                    "megatron_edit: the optimizer state being loaded has no EDiT (local SGD) part: "
                    "the checkpoint was saved without local SGD. Load only the model "
                    "(--no-load-optim / --finetune) to start EDiT from it."
                )
            if part is not None:
                layout = _Layout.of(self, controller)
                _check_record(part.get("record"), layout, _bucket_slots(self, controller, layout), "this checkpoint")
                state_dict = {k: v for k, v in state_dict.items() if k != "local_sgd"}
            fixes = _needs_torch_adam_fixes(self)
            with torch.no_grad() if fixes else contextlib.nullcontext():  # fix 2
                result = original(self, state_dict, *args, **kwargs)
            if fixes:
                restore_adam_steps(self, state_dict)  # fix 3
            if part is not None:
                load_local_sgd_state(self, controller, part)
                if controller.num_workers > 1:
                    _refresh_model_from_mains(self, controller)
            return result

        return wrapper

    def wrap_set_main_param_state(original):
        def wrapper(self, model_param, tensors, *args, **kwargs):
            if controller_of(self) is None or not _needs_torch_adam_fixes(self):
                return original(self, model_param, tensors, *args, **kwargs)
            if "step" not in tensors:  # fix 4: the checkpoint has no per-param step; keep ours
                tensors = dict(tensors, step=_adam_state_of(self, model_param)["step"])
            with torch.no_grad():  # fix 2
                return original(self, model_param, tensors, *args, **kwargs)

        return wrapper

    def wrap_dist_load(original):
        def wrapper(sharded_state_dict, checkpoint_dir, *args, **kwargs):
            runtime = runtime_ref()
            if runtime is not None and len(runtime.controllers) > 0:
                check_checkpoint_has_local_sgd_state(sharded_state_dict, checkpoint_dir)
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)

        return wrapper

    def refuse_legacy(what):
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

    def refuse_before_support(what):
        def wrap(original):
            def wrapper(self, *args, **kwargs):
                if controller_of(self) is not None:
                    from .compat import megatron_core_version

                    raise NotSupportedYet(
                        f"megatron_edit: {what} of a local-SGD optimizer needs megatron-core "
                        f"{SUPPORTED} (EDiT state in torch_dist checkpoints); megatron-core "
                        f"{megatron_core_version()} is installed. Checkpointing EDiT on it is not "
                        f"supported yet: upgrade megatron-core, or train without saving the optimizer."
                    )
                return original(self, *args, **kwargs)

            return wrapper

        return wrap

    for method, what in (("state_dict", "saving the state"), ("sharded_state_dict", "saving or loading the state"),
                         ("load_state_dict", "loading the state")):
        target = f"{_DISTOPT}.{method}"
        registry.add(Patch(f"ckpt-not-yet-{method.replace('_', '-')}", target, refuse_before_support(what),
                           NOT_YET, compat.params(target),
                           "before 0.16: refuse to checkpoint EDiT (its state would be missing)"))

    v = SUPPORTED
    registry.add(Patch("ckpt-distopt-state-dict", f"{_DISTOPT}.state_dict", wrap_state_dict, v, ("self",),
                       "complete a pending sync; 0.16-0.19 w/o apex/TE: zero Adam state before 'step' is read"))
    registry.add(Patch("ckpt-distopt-sharded-state-dict", f"{_DISTOPT}.sharded_state_dict",
                       wrap_sharded_state_dict, v,
                       ("self", "model_sharded_state_dict", "is_loading", "sharding_type", "metadata"),
                       "EDiT state (anchor, outer state, counters) + each worker's optimizer state "
                       "under its own keys in torch_dist checkpoints"))
    registry.add(Patch("ckpt-distopt-load-state-dict", f"{_DISTOPT}.load_state_dict", wrap_load_state_dict, v,
                       ("self", "state_dict"),
                       "restore EDiT state and each worker's model; 0.16-0.19 w/o apex/TE: load under "
                       "no_grad, one Adam step tensor per param with the checkpoint's value"))
    registry.add(Patch("ckpt-distopt-set-main-param-state", f"{_DISTOPT}._set_main_param_and_optimizer_states",
                       wrap_set_main_param_state, v, ("self", "model_param", "tensors"),
                       "0.16-0.19 w/o apex/TE: copy loaded main params under no_grad; tolerate the "
                       "checkpoint's missing per-param Adam step"))
    dist_load = "megatron.core.dist_checkpointing:load"
    registry.add(Patch("ckpt-dist-checkpointing-load", dist_load, wrap_dist_load, v, compat.params(dist_load),
                       "clear error when a checkpoint lacks (part of) the EDiT state"))
    # The legacy format: a ChainedOptimizer of several optimizers bypasses the
    # DistributedOptimizer methods, so both are refused.
    for owner, name in ((_DISTOPT, "distopt"), (_CHAINED, "chained")):
        for method in ("save_parameter_state", "load_parameter_state"):
            registry.add(Patch(f"ckpt-refuse-legacy-{name}-{method.split('_')[0]}", f"{owner}.{method}",
                               refuse_legacy(f"--ckpt-format torch ({method})"), compat.SUPPORTED,
                               ("self", "filename"),
                               "refuse the legacy torch checkpoint format with local SGD"))
    return registry
