"""megatron-core's own load defects that megatron_edit fixes (megatron_edit.mcore.checkpoint.load_fixes)
and that need no multi-rank job to show."""

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from megatron_edit.mcore.checkpoint.load_fixes import METADATA_FIX
from megatron_edit.mcore.compat import megatron_core_version
from megatron_edit.mcore.wrap_registry import Patch, PatchRegistry

HAS_STRIDES = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}


def _metadata(**properties) -> Metadata:
    entry = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.bfloat16, **properties), size=torch.Size([2, 3]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))])
    return Metadata(state_dict_metadata={"decoder.weight": entry})


def _tensors_metadata(tmp_path, metadata):
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    return TorchDistLoadShardedStrategy().load_tensors_metadata(tmp_path, metadata)


@pytest.mark.skipif(not HAS_STRIDES, reason="torch's TensorProperties has no strides before torch 2.15 "
                                              "(CI's newest lane runs torch 2.15)")
def test_tensor_metadata_with_strides_is_read(tmp_path):
    """Fix 7: torch 2.15's checkpoint metadata carries TensorProperties.strides, which
    megatron-core's load_tensors_metadata passed to torch.empty (TypeError: the metadata of
    every torch_dist checkpoint unreadable, EDiT's load guard included). With the fix the
    metadata reads, shape and dtype as saved; without it megatron-core's defect shows."""
    metadata = _metadata(strides=(3, 1))
    with pytest.raises(TypeError, match="strides"):  # the defect, so that the fix is still needed
        _tensors_metadata(tmp_path, metadata)
    registry = PatchRegistry()
    registry.add(Patch(*METADATA_FIX))
    registry.apply(megatron_core_version())
    try:
        read = _tensors_metadata(tmp_path, metadata)
    finally:
        registry.revert()
    assert read["decoder.weight"].global_shape == (2, 3)
    assert read["decoder.weight"].dtype == torch.bfloat16
    assert vars(metadata.state_dict_metadata["decoder.weight"].properties)["strides"] == (3, 1)  # not changed
    # what Megatron sets on the metadata besides its fields (0.12 reads mcore_data there) goes along
    metadata.mcore_data = {"decoder.weight": {"nd_reformulated_orig_global_shape": (2, 3)}}
    passed = METADATA_FIX[2](lambda self, path, given: given)(None, tmp_path, metadata)
    assert passed.mcore_data == metadata.mcore_data
    assert "strides" not in vars(passed.state_dict_metadata["decoder.weight"].properties)


def test_tensor_metadata_fix_is_a_no_op_where_torch_has_no_strides(tmp_path):
    """Before torch 2.15 (no strides) the patch leaves megatron-core's function as it is; with
    them, metadata without strides reads the same with and without the fix."""
    wrapped = METADATA_FIX[2](lambda *args: args)
    if not HAS_STRIDES:
        metadata = _metadata()
        assert wrapped("strategy", tmp_path, metadata) == ("strategy", tmp_path, metadata)  # as it came
    registry = PatchRegistry()
    registry.add(Patch(*METADATA_FIX))
    registry.apply(megatron_core_version())
    try:
        read = _tensors_metadata(tmp_path, _metadata())
    finally:
        registry.revert()
    assert read["decoder.weight"].global_shape == (2, 3)
