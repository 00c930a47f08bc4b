"""Workarounds for megatron-core's own defects when loading a distributed-optimizer checkpoint.

These have nothing to do with EDiT: they show whenever apex and transformer-engine are absent
(megatron-core then falls back to torch's Adam / AdamW), not only on CPU, also when plain
Megatron loads any checkpoint with its optimizer. They are applied to every
``DistributedOptimizer`` (EDiT or not):

* by :func:`megatron_edit.patch_megatron_for_local_sgd` (the checkpoint patches compose them
  into their wraps, so a Megatron-LM run launched through ``megatron_edit.launch`` has them
  with or without ``--use-local-sgd``);
* alone, for plain megatron-core, by :func:`megatron_edit.patch_megatron_load_fixes`
  (:func:`add_load_fix_patches`).

megatron-core without apex / transformer-engine (torch AdamW fallback) mishandles Adam's state
when loading a distributed-optimizer checkpoint; a load needs three fixes (:data:`TORCH_ADAM_LOAD_BUGS`
names the versions: every release megatron_edit checkpoints on, 0.16.0 - 0.19.2; each defect was
re-checked in 0.17.1, 0.18.2 and 0.19.2 by reading the code, and on 0.19.2 by the checkpoint tests
with the fix off):

1. ``state_dict()`` reads Adam's ``step`` from the optimizer state, which is empty before the
   first step; ``sharded_state_dict(is_loading=True)`` calls it, so loading into a fresh run
   fails (``assert len(steps) == 1``). Fix: give each parameter the zero state torch's Adam
   would create lazily (same values), before ``state_dict()`` runs.
2. With fp32 parameters the main params are views of leaf parameters that require grad, and
   ``dp_reshardable`` loading copies into them outside ``no_grad`` (RuntimeError). Fix: load
   under ``torch.no_grad()``.
3. ``load_state_dict`` gives all parameters one shared ``step`` tensor (torch's Adam then
   increments it once per parameter per step), and ``dp_reshardable`` loading then copies the
   *pre-load* step into it. Fix: after loading, every parameter gets its own ``step`` tensor
   holding the checkpoint's value (the param groups' ``step``).

A fourth shows with ``fully_reshardable``: its checkpoint has no per-parameter ``step`` but
``_set_main_param_and_optimizer_states`` copies every key of torch Adam's state (KeyError).
Fix: the missing ``step`` is left as it is (fix 3 then sets it).

A fifth, :data:`FULLY_RESHARDABLE_PADDING_BUG` (same releases): ``fully_reshardable`` drops the
padding between buckets in its world tensors but slices them at padded offsets, so state after
a padded bucket lands in the wrong place (megatron-core's own warning "param range exceeds
unpadded buffer"). Not fixable from outside: refused with more than one bucket per buffer.

A sixth, Megatron-FSDP's ``fsdp_dtensor`` format (:data:`FSDP_EMPTY_SHARD_BUG`, megatron-core
0.16.1-0.19.x; 0.19 sorts the DTensor keys, which does not help when a rank lacks one): torch's Adam keeps no state for a parameter whose shard on this rank is empty (it never
steps it), so the ranks of an instance list different DTensors, and Megatron-FSDP's
``preprocess_state_dict_for_uneven_dtensor`` (one all-gather inside the instance per DTensor)
hangs at the save (or pairs different parameters); and once it has state, the ``step`` of an empty
shard stays behind the others', while DCP keeps one rank's ``step`` per parameter (a resume then
read a step count 1 short). Fix: such parameters get the zero state, their ``step`` is the
others', and the state is listed in the parameters' order on every rank.

A seventh, with torch 2.15 and newer (:data:`TENSOR_STRIDES_BUG`, every release 0.12 - 0.19;
not an optimizer's: any ``torch_dist`` checkpoint): torch's checkpoint metadata gained
``TensorProperties.strides`` (pytorch/pytorch#192248), and megatron-core's
``TorchDistLoadShardedStrategy.load_tensors_metadata`` passes every field of it to
``torch.empty`` (``TypeError: empty() got an unexpected keyword argument 'strides'``), so reading
a checkpoint's metadata (``dist_checkpointing.load_sharded_metadata``: EDiT's load guard, Megatron-LM's
metadata reads) fails. Fix: the metadata it reads without the strides (the meta tensors it builds
carry a shape and a dtype only; strides were never read). Found by CI's lane on the newest torch.
"""

from __future__ import annotations

import contextlib

import torch

from ...config import NotSupportedYet
from .keys import CheckpointStateError
from ..wrap_registry import Patch, PatchRegistry, VersionRange

TORCH_ADAM_LOAD_BUGS = VersionRange("0.16.0", "0.20.0")
"""megatron-core versions whose distributed optimizer needs the torch-Adam load fixes."""
FULLY_RESHARDABLE_PADDING_BUG = VersionRange("0.16.0", "0.20.0")
"""megatron-core versions whose ``fully_reshardable`` format misplaces state after a padded
bucket (the world tensors drop the padding between buckets, the parameter offsets do not)."""
FSDP_EMPTY_SHARD_BUG = VersionRange("0.16.1", "0.20.0")
"""megatron-core versions whose Megatron-FSDP ``fsdp_dtensor`` save hangs without fix 6 (checked
where EDiT runs on Megatron-FSDP)."""


# --------------------------------------------------------------------------- torch Adam fixes
def _needs_torch_adam_fixes(optimizer) -> bool:
    from megatron.core.optimizer import distrib_optimizer

    from ..compat import megatron_core_version

    return (
        not distrib_optimizer.HAVE_APEX_OR_TE
        and not getattr(optimizer.ddp_config, "use_megatron_fsdp", False)  # torch's own load_state_dict
        and type(optimizer.optimizer) in (torch.optim.Adam, torch.optim.AdamW)
        and TORCH_ADAM_LOAD_BUGS.contains(megatron_core_version())
    )


def init_missing_adam_state(optimizer, step: float = 0.0) -> None:
    """Fix 1: the zero state torch's Adam creates lazily at its first step, created now (fix 6:
    with the ``step`` of the other parameters)."""
    try:
        from torch.optim.optimizer import _get_scalar_dtype
    except ImportError:  # pragma: no cover
        _get_scalar_dtype = lambda is_fused=None: torch.float32  # noqa: E731
    inner = optimizer.optimizer
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            if len(state) > 0:
                continue
            if group.get("capturable") or group.get("fused"):
                state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device)
            else:
                state["step"] = torch.tensor(float(step), dtype=_get_scalar_dtype(), device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _adam_state_of(optimizer, model_param) -> dict:
    group_index, group_order = optimizer.model_param_group_index_map[model_param]
    main = optimizer.optimizer.param_groups[group_index]["params"][group_order]
    return optimizer.optimizer.state[main]


def restore_adam_steps(optimizer, state_dict) -> None:
    """Fix 3: one ``step`` tensor per parameter, holding the checkpoint's step count."""
    groups = (state_dict.get("optimizer") or {}).get("param_groups") or []
    steps = {g["step"] for g in groups if "step" in g}
    if len(steps) != 1:
        raise CheckpointStateError(f"megatron_edit: the optimizer checkpoint has Adam steps {sorted(steps)}.")
    (step,) = steps
    for state in optimizer.optimizer.state.values():
        if "step" in state:
            old = state["step"]
            state["step"] = torch.tensor(float(step), dtype=old.dtype, device=old.device)


def refuse_broken_fully_reshardable(optimizer, sharding_type: str) -> None:
    from ..compat import megatron_core_version

    if sharding_type != "fully_reshardable" or not FULLY_RESHARDABLE_PADDING_BUG.contains(megatron_core_version()):
        return
    for buffer in optimizer.buffers:
        if any(b.grad_data.numel() != b.numel_unpadded for b in buffer.buckets[:-1]):
            raise NotSupportedYet(
                f"megatron_edit: megatron-core {megatron_core_version()}'s 'fully_reshardable' "
                f"optimizer format misplaces the optimizer state of parameters that follow a "
                f"padded bucket (its warning 'param range exceeds unpadded buffer'), so a resume "
                f"cannot be exact. Use 'dp_reshardable' (Megatron-LM's default, without "
                f"--dist-ckpt-optim-fully-reshardable), or one bucket per buffer."
            )


# --------------------------------------------------------------------------- the wraps
_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"


def fix_state_dict(original):
    """Fix 1 around ``DistributedOptimizer.state_dict``."""

    def wrapper(self, *args, **kwargs):
        if _needs_torch_adam_fixes(self):
            init_missing_adam_state(self)
        return original(self, *args, **kwargs)

    return wrapper


def fix_fsdp_dtensor_state(original):
    """Fix 6 around ``DistributedOptimizer.sharded_param_state_fsdp_dtensor``."""

    def wrapper(self, *args, **kwargs):
        from megatron.core.optimizer import distrib_optimizer

        if not distrib_optimizer.HAVE_APEX_OR_TE and type(self.optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            state = self.optimizer.state
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            steps = [float(state[p]["step"]) for p in params if "step" in state.get(p, {}) and _local_numel(p)]
            step = max(steps, default=0.0)
            init_missing_adam_state(self, step)
            for p in params:  # Adam never steps an empty shard: its step would lag behind (and the
                if not _local_numel(p) and "step" in state[p]:  # key is the parameter's on every rank)
                    state[p]["step"] = torch.full_like(state[p]["step"], step)
            # Megatron lists the state in the optimizer state's order: the parameters' order on
            # every rank (the state created now would come last).
            state = self.optimizer.state
            ordered = [(p, state[p]) for g in self.optimizer.param_groups for p in g["params"] if p in state]
            state.clear()
            state.update(ordered)
        return original(self, *args, **kwargs)

    return wrapper


def _local_numel(param) -> int:
    local = getattr(param, "_local_tensor", param)
    return local.numel()


def fix_load_state_dict(original):
    """Fixes 2 and 3 around ``DistributedOptimizer.load_state_dict``."""

    def wrapper(self, state_dict, *args, **kwargs):
        fixes = _needs_torch_adam_fixes(self) and isinstance(state_dict, dict)
        with torch.no_grad() if fixes else contextlib.nullcontext():
            result = original(self, state_dict, *args, **kwargs)
        if fixes:
            restore_adam_steps(self, state_dict)
        return result

    return wrapper


def fix_set_main_param_state(original):
    """Fixes 2 and 4 around ``DistributedOptimizer._set_main_param_and_optimizer_states``."""

    def wrapper(self, model_param, tensors, *args, **kwargs):
        if not _needs_torch_adam_fixes(self):
            return original(self, model_param, tensors, *args, **kwargs)
        if "step" not in tensors:  # fix 4: the checkpoint has no per-param step; keep ours
            tensors = dict(tensors, step=_adam_state_of(self, model_param)["step"])
        with torch.no_grad():  # fix 2
            return original(self, model_param, tensors, *args, **kwargs)

    return wrapper


LOAD_FIXES = (
    ("fix-distopt-state-dict", "state_dict", fix_state_dict, ("self",),
     "0.16-0.19 w/o apex/TE: zero Adam state before 'step' is read (fix 1)"),
    ("fix-distopt-load-state-dict", "load_state_dict", fix_load_state_dict, ("self", "state_dict"),
     "0.16-0.19 w/o apex/TE: load under no_grad, one Adam step tensor per param (fixes 2, 3)"),
    ("fix-distopt-set-main-param-state", "_set_main_param_and_optimizer_states", fix_set_main_param_state,
     ("self", "model_param", "tensors"),
     "0.16-0.19 w/o apex/TE: copy main params under no_grad; tolerate a missing Adam step (fixes 2, 4)"),
)
"""(patch id, DistributedOptimizer method, wrap, parameters, description) of each fix."""
FSDP_LOAD_FIXES = (
    ("fix-distopt-fsdp-dtensor-state", "sharded_param_state_fsdp_dtensor", fix_fsdp_dtensor_state,
     ("self", "is_loading"), "0.16.1-0.19 Megatron-FSDP w/o apex/TE: Adam state for parameters with an empty "
     "shard, so the ranks of an instance save the same DTensors (fix 6)"),
)
"""The same, for Megatron-FSDP's format (:data:`FSDP_EMPTY_SHARD_BUG`)."""


TENSOR_STRIDES_BUG = VersionRange("0.12.0", "0.20.0")
"""megatron-core versions whose ``load_tensors_metadata`` fails on torch 2.15's metadata (fix 7)."""
_TENSORS_METADATA = ("megatron.core.dist_checkpointing.strategies.torch:"
                     "TorchDistLoadShardedStrategy.load_tensors_metadata")


def fix_tensors_metadata(original):
    """Fix 7 around ``TorchDistLoadShardedStrategy.load_tensors_metadata``: its metadata without
    ``TensorProperties.strides`` (a no-op on a torch without them)."""
    import copy
    import dataclasses
    import sys

    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    has_strides = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}

    def wrapper(self, checkpoint_dir, metadata=None):
        if not has_strides:
            return original(self, checkpoint_dir, metadata)
        if metadata is None:  # as the original reads it (0.12: torch's FileSystemReader)
            module = sys.modules[_TENSORS_METADATA.split(":")[0]]  # imported: it defines self's class
            reader = getattr(module, "_get_filesystem_reader", None)
            if reader is None:
                from torch.distributed.checkpoint import FileSystemReader as reader
            metadata = reader(checkpoint_dir).read_metadata()
        stripped = copy.copy(metadata)  # a copy keeps what Megatron set on it besides the fields (mcore_data)
        stripped.state_dict_metadata = {}
        for key, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata) and "strides" in vars(entry.properties):
                entry = copy.copy(entry)
                entry.properties = copy.copy(entry.properties)
                del vars(entry.properties)["strides"]  # the class default (None) stays readable; **vars omits it
            stripped.state_dict_metadata[key] = entry
        return original(self, checkpoint_dir, stripped)

    return wrapper


METADATA_FIX = ("fix-dist-ckpt-tensors-metadata", _TENSORS_METADATA, fix_tensors_metadata, TENSOR_STRIDES_BUG,
                ("self", "checkpoint_dir", "metadata"),
                "torch 2.15+ with every release: read a torch_dist checkpoint's tensor metadata without "
                "TensorProperties.strides, which megatron-core passes to torch.empty (fix 7)")
"""(patch id, target, wrap, versions, parameters, description) of fix 7: a patch of its own in
both registries (EDiT's checkpoint patches and :func:`add_load_fix_patches`)."""


def add_load_fix_patches(registry: PatchRegistry) -> PatchRegistry:
    """The fixes as patches of their own, for plain Megatron (EDiT's checkpoint patches compose
    the same wraps into theirs: never apply both registries)."""
    for patch_id, method, wrap, params, description in LOAD_FIXES:
        registry.add(Patch(patch_id, f"{_DISTOPT}.{method}", wrap, TORCH_ADAM_LOAD_BUGS, params, description))
    for patch_id, method, wrap, params, description in FSDP_LOAD_FIXES:
        registry.add(Patch(patch_id, f"{_DISTOPT}.{method}", wrap, FSDP_EMPTY_SHARD_BUG, params, description))
    registry.add(Patch(*METADATA_FIX))
    return registry
