"""EDiT state in Megatron's distributed checkpoints (``torch_dist``), as one sub-package.

This is its public face: everything outside the sub-package imports from here, never from its
modules (``tests/test_layout.py`` checks it), which are its own business:

* :mod:`.state`: the format (what is written per worker and per rank) and the save and load of
  one optimizer's EDiT state;
* :mod:`.fsdp_dtensor` / :mod:`.fsdp_load`: the same on Megatron-FSDP, in its ``fsdp_dtensor``
  checkpoints (torch.distributed.checkpoint), and the load fitted to them;
* :mod:`.record`: the run record (layout, counters, configuration) and its checks;
* :mod:`.space`: per-parameter tensors in model space, so another layout can read them;
* :mod:`.constant`: every EDiT entry in every checkpoint of a run (placeholders), for Megatron's
  cached save plan (``--ckpt-assume-constant-structure``);
* :mod:`.resume`: exact, elastic and synchronous → EDiT resume (fitting the load requests);
* :mod:`.after_load`: the work after the load (the load-time outer step, residuals, the model);
* :mod:`.expert_bias`: each worker's MoE router expert biases;
* :mod:`.keys`: checkpoint keys (Megatron's and EDiT's own), per-worker renaming and replica ids;
* :mod:`.guard`: a damaged or incomplete checkpoint named in one line before the load;
* :mod:`.checkpoint_wraps`: the wrap patches of ``DistributedOptimizer`` and ``dist_checkpointing``;
* :mod:`.load_fixes`: workarounds for megatron-core's own checkpoint-load defects (also usable
  alone, :func:`megatron_edit.patch_megatron_load_fixes`).

The controller (:class:`~megatron_edit.mcore.controller.LocalSGD`) owns the state that is
saved: these modules go through its ``state_dict`` / ``load_state_dict`` and its named resume
methods, never its private fields.
"""

from .keys import CheckpointStateError
from .load_fixes import FSDP_EMPTY_SHARD_BUG, FSDP_LOAD_FIXES, LOAD_FIXES, TORCH_ADAM_LOAD_BUGS, add_load_fix_patches
from .checkpoint_wraps import add_checkpoint_patches
from .record import FORMAT, check_run_record
from .after_load import residual_share
from .state import NOT_YET, SUPPORTED, SUPPORTED_SHARDING_TYPES

__all__ = [
    "CheckpointStateError",
    "FORMAT",
    "FSDP_EMPTY_SHARD_BUG",
    "FSDP_LOAD_FIXES",
    "LOAD_FIXES",
    "NOT_YET",
    "SUPPORTED",
    "SUPPORTED_SHARDING_TYPES",
    "TORCH_ADAM_LOAD_BUGS",
    "add_checkpoint_patches",
    "add_load_fix_patches",
    "check_run_record",
    "residual_share",
]
