"""Patch and unpatch Megatron for local SGD: the package's entry points.

Composes the registry (:class:`~megatron_edit.mcore.wrap_registry.PatchRegistry`) from the wraps the
layers below declare (:mod:`megatron_edit.mcore.core_wraps`: the megatron-core wraps;
:mod:`megatron_edit.mcore.checkpoint`: the checkpoint wraps; :mod:`megatron_edit.training.training_wraps`:
Megatron-LM's training wraps, when it is importable) and opens the process's patch session
(:data:`megatron_edit.mcore.session.SESSION`).
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional

from .config import GTAConfig, LocalSGDConfig, OuterOptimizerConfig, default_outer_config
from .mcore.checkpoint import add_checkpoint_patches, add_load_fix_patches
from .mcore.compat import SUPPORTED, TESTED, megatron_core_version
from .mcore.controller import LocalSGD
from .mcore.core_wraps import build_registry
from .mcore.wrap_registry import PatchError, PatchRegistry, version_tuple
from .mcore.runtime import Configs, LocalSGDRuntime, get_local_sgd as _get
from .mcore.session import SESSION

logger = logging.getLogger(__name__)


class UnsupportedMegatronVersion(PatchError):
    """The installed megatron-core is outside the range megatron_edit supports."""


def build_full_registry(runtime_ref, need_training: bool = False) -> PatchRegistry:
    """The registry of every patch, in application order: the megatron-core wraps
    (:mod:`megatron_edit.mcore.core_wraps`), the checkpoint wraps
    (:mod:`megatron_edit.mcore.checkpoint`: EDiT state in torch_dist checkpoints), and
    Megatron-LM's training wraps when ``megatron.training`` is there (a Megatron-LM checkout
    on the path; since 0.17 also the copy in the megatron-core wheel). ``need_training``: it
    must import (Megatron-LM's route), otherwise a failing import only leaves them out."""
    registry = build_registry(runtime_ref)
    add_checkpoint_patches(registry, runtime_ref)
    _add_training_patches(registry, runtime_ref, need_training)
    return registry


def _configs_from_megatron_args():
    """Megatron-LM training: the configs come from its parsed arguments."""
    from .arguments import configs_from_args

    try:
        from megatron.training import get_args
    except ImportError:
        raise RuntimeError(
            "patch_megatron_for_local_sgd() was called without configs and megatron.training is "
            "not importable: with megatron-core alone pass local_sgd_config=LocalSGDConfig(...)."
        ) from None
    args = get_args()
    if SESSION.runtime is not None:
        # A-EDiT's global budget: what the synchronous run of --train-iters consumes.
        SESSION.runtime.train_iters = args.train_iters
    return configs_from_args(args)


def patch_megatron_for_local_sgd(
    local_sgd_config: Optional[LocalSGDConfig] = None,
    outer_optim_config: Optional[OuterOptimizerConfig] = None,
    gta_config: Optional[GTAConfig] = None,
) -> List[str]:
    """Apply every EDiT patch to megatron-core; returns the patch ids now active.

    With megatron-core alone, pass the configs; DDP and distributed optimizers built afterwards
    train with EDiT (call it before building them: an optimizer built before it is refused at
    its first step, never trained synchronously without a word). Without configs (Megatron-LM's
    ``pretrain``), they are read from the parsed arguments when the first DDP is built, and the
    patches pass through unless ``--use-local-sgd`` was given. Calling it again before anything
    is built replaces the configs and keeps the patches; once an optimizer trains with EDiT, a
    call with the same configs changes nothing and one with other configs is refused (unpatch,
    patch, and build again). Raises :class:`UnsupportedMegatronVersion` on a megatron-core
    outside ``SUPPORTED``.
    """
    version = megatron_core_version()
    if not SUPPORTED.contains(version):
        raise UnsupportedMegatronVersion(unsupported_message(version))
    _check_configs(local_sgd_config, outer_optim_config, gta_config)
    live = SESSION.runtime is not None and len(SESSION.runtime.controllers) > 0
    if live:
        _keep_live_runtime(local_sgd_config, outer_optim_config, gta_config)
        return [p.id for p in SESSION.registry.patches if SESSION.registry.is_applied(p.id)]
    SESSION.runtime = LocalSGDRuntime(
        local_sgd_config,
        outer_optim_config,
        gta_config,
        configs_from=None if local_sgd_config is not None else _configs_from_megatron_args,
    )
    if SESSION.registry is None:
        SESSION.registry = build_full_registry(lambda: SESSION.runtime, need_training=local_sgd_config is None)
    if SESSION.fixes_registry is not None:
        SESSION.fixes_registry.revert()  # the full registry composes the same fixes
    applied = SESSION.registry.apply(version)
    SESSION.runtime.tokens_counted_in_worker = SESSION.registry.is_applied("worker-local-dp-group")
    if applied:
        _log_rank0(f"megatron_edit: patched megatron-core {version}: {', '.join(applied)}")
    return [p.id for p in SESSION.registry.patches if SESSION.registry.is_applied(p.id)]


def _keep_live_runtime(local_sgd_config, outer_optim_config, gta_config) -> None:
    """Patching again while optimizers train with EDiT: the same configs change nothing; other
    configs would detach those optimizers (they would train synchronously): refused."""
    runtime = SESSION.runtime
    wanted = None
    if local_sgd_config is not None:
        wanted = Configs(local_sgd_config, outer_optim_config or default_outer_config(local_sgd_config),
                         gta_config or GTAConfig())
    if wanted is None or wanted == runtime.configs:
        return
    raise RuntimeError(
        f"megatron_edit: EDiT already runs on {len(runtime.controllers)} distributed optimizer(s) "
        "built with other configs; patch_megatron_for_local_sgd(...) cannot change them under "
        "those optimizers (they would silently train synchronously). Call "
        "unpatch_megatron_for_local_sgd(), patch with the new configs, and build the DDP model "
        "and the optimizer again."
    )


def unsupported_message(version: str) -> str:
    """Why ``version`` is refused, naming it, the supported releases and what to install."""
    newest = TESTED[-1]
    if version_tuple(version) >= version_tuple(SUPPORTED.below):
        why = (f"it is newer than the newest release megatron_edit was checked against "
               f"({newest}): the patches wrap Megatron internals that change between releases")
    else:
        why = "it has no partial distributed optimizer (one instance per EDiT worker)"
    return (
        f"megatron_edit supports megatron-core {SUPPORTED} (tested: {', '.join(TESTED)}); "
        f"megatron-core {version} is installed, and {why}. Install a supported release: "
        f"pip install megatron-core=={newest} (Python 3.12+), or megatron-core==0.16.1 on "
        f"Python 3.10 / 3.11."
    )


def _check_configs(local_sgd_config, outer_optim_config, gta_config) -> None:
    """Each argument of the expected class (a string, a dict or configs in the wrong order would
    otherwise fail inside Megatron, at the first step), re-validated (fields may have been
    assigned since construction)."""
    given = (("local_sgd_config", local_sgd_config, LocalSGDConfig),
             ("outer_optim_config", outer_optim_config, OuterOptimizerConfig),
             ("gta_config", gta_config, GTAConfig))
    for name, value, cls in given:
        if value is not None and not isinstance(value, cls):
            hint = ""
            if isinstance(value, (LocalSGDConfig, OuterOptimizerConfig, GTAConfig)):
                hint = " (configs in the wrong order? pass them by keyword)"
            elif isinstance(value, dict):
                hint = f" (for a dict d: {cls.__name__}(**d))"
            raise TypeError(
                f"patch_megatron_for_local_sgd: {name} must be a {cls.__name__} or None, got "
                f"{type(value).__name__}{hint}."
            )
    if local_sgd_config is None and (outer_optim_config or gta_config):
        raise ValueError("pass local_sgd_config too when passing outer_optim_config / gta_config")
    for _, value, _ in given:
        if value is not None:
            value.__post_init__()


def _add_training_patches(registry: PatchRegistry, runtime_ref, required: bool) -> None:
    """Megatron-LM's training wraps (:mod:`megatron_edit.training.training_wraps`: flags, validation,
    metrics) on ``registry``, when ``megatron.training`` is there."""
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return
    declared = PatchRegistry()
    try:
        from .training.training_wraps import add_training_patches

        add_training_patches(declared, runtime_ref)  # imports megatron.training
    except PatchError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to import Megatron-LM's training code
        problem = (
            f"megatron.training is installed but does not import ({type(e).__name__}: {e}); "
            f"Megatron-LM's own dependencies: pip install -r scripts/requirements-megatron-lm.txt "
            f"(on a machine without a GPU, importing it needs torch >= 2.8: older triton fails "
            f"there)"
        )
        if required:
            raise PatchError(f"megatron_edit: {problem}.") from e
        # megatron-core alone (configs passed) needs none of them; since 0.17 the wheel ships
        # megatron/training whether or not its dependencies are installed.
        logger.warning("megatron_edit: %s. Its training patches are left out.", problem)
        return
    for patch in declared.patches:
        registry.add(patch)


def unpatch_megatron_for_local_sgd() -> List[str]:
    """Restore every patched Megatron function (the sync record, if any, writes what it still
    holds first); returns the ids reverted."""
    if SESSION.runtime is not None:
        SESSION.runtime.close()
    reverted = SESSION.registry.revert() if SESSION.registry else []
    SESSION.runtime = None
    return reverted


def patch_megatron_load_fixes() -> List[str]:
    """Plain Megatron (no EDiT): apply only the fixes of megatron-core's own distributed-optimizer
    load defects (:mod:`megatron_edit.mcore.checkpoint.load_fixes`: megatron-core 0.16.x without apex or
    transformer-engine cannot load a checkpoint with its optimizer otherwise). Returns the patch
    ids now active for them; nothing to do while :func:`patch_megatron_for_local_sgd` is in
    effect (its checkpoint wraps include the fixes)."""
    version = megatron_core_version()
    if SESSION.registry is not None and SESSION.registry.is_applied():
        return [p.id for p in SESSION.registry.patches
                if p.id.startswith("ckpt-distopt") and SESSION.registry.is_applied(p.id)]
    if SESSION.fixes_registry is None:
        SESSION.fixes_registry = add_load_fix_patches(PatchRegistry())
    applied = SESSION.fixes_registry.apply(version)
    if applied:
        _log_rank0(f"megatron_edit: patched megatron-core {version}: {', '.join(applied)}")
    return [p.id for p in SESSION.fixes_registry.patches if SESSION.fixes_registry.is_applied(p.id)]


def unpatch_megatron_load_fixes() -> List[str]:
    """Undo :func:`patch_megatron_load_fixes`; returns the ids reverted."""
    return SESSION.fixes_registry.revert() if SESSION.fixes_registry else []


def is_patched() -> bool:
    return SESSION.registry is not None and SESSION.registry.is_applied()


def get_local_sgd(optimizer) -> List[LocalSGD]:
    """The EDiT state objects of a Megatron optimizer (one per distributed optimizer inside)."""
    return _get(optimizer, SESSION.runtime)


def set_train_iters(optimizer, train_iters: int) -> None:
    """Say how long the run of ``optimizer`` is (megatron-core alone; Megatron-LM does it from
    ``--train-iters`` / ``--train-samples``): ``train_iters`` optimizer steps in all, counted from
    the start of training, also after a resume. Synchronous EDiT then ends with a sync of every
    shard after that step, so every worker ends with the same model and no delayed exchange is
    left in flight; A-EDiT's budget is ``train_iters`` x workers worker-steps. Call it after
    building the optimizer, before training (again after loading a checkpoint is fine). Applies
    to every distributed optimizer inside (MoE: the dense and the expert one) through
    :meth:`LocalSGD.set_train_iters`; ValueError for a value that is not a step count >= 1 or
    is below the steps already taken; RuntimeError for an optimizer without EDiT."""
    controllers = get_local_sgd(optimizer)
    if not controllers:
        raise RuntimeError(
            "megatron_edit.set_train_iters: this optimizer has no EDiT state; call "
            "patch_megatron_for_local_sgd(...) before building the DDP model and the optimizer.")
    for controller in controllers:
        controller.set_train_iters(train_iters)


def _log_rank0(message: str) -> None:
    import torch.distributed as dist

    # Before init_process_group (a launcher patches first), torchrun's RANK says who is rank 0.
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        logger.info(message)
