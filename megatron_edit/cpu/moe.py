"""The CPU adapter's MoE patches (megatron-core without transformer-engine, on CPU).

* megatron-core 0.16.x imports ``te_general_gemm`` only when transformer-engine is installed,
  yet ``RouterGatingLinearFunction`` always reads it: every router call fails with a
  ``NameError``. Where the module reads the name without defining it, a ``define`` patch sets
  it to None, which selects the torch path right below (0.19 defines it as None itself: no
  patch there).
* The alltoall token dispatcher moves its split sizes to the host as numpy arrays only for CUDA
  tensors; on CPU they stayed tensors, which ``all_to_all_single`` refuses. Wrapped to give the
  numpy array the GPU path gives.
* With tensor parallelism, the alltoall dispatcher all-gathers the tokens over the tensor-parallel
  group in uneven pieces (``_gather_along_first_dim`` with ``output_split_sizes``), which NCCL
  takes and gloo refuses ("invalid tensor size"). On CPU the pieces are padded to the largest,
  gathered evenly, and cut back: the same result.

Applied and reverted with the rest of :mod:`megatron_edit.cpu.adapter`.
"""

from __future__ import annotations

import torch

from ..mcore.wrap_registry import Patch, PatchRegistry, VersionRange


def _router_gemm_undefined() -> bool:
    """megatron-core 0.16.x imports ``te_general_gemm`` only with transformer-engine yet its
    router gating function always reads it (a ``NameError`` on every router call without TE);
    0.19 defines it as None. True where the module reads it without defining it."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    gating = getattr(moe_utils, "RouterGatingLinearFunction", None)
    if gating is None or hasattr(moe_utils, "te_general_gemm"):
        return False
    return any("te_general_gemm" in f.__code__.co_names for f in (gating.forward, gating.backward))


def _splits_as_numpy(original):
    """The alltoall dispatcher moves its split sizes off the GPU as numpy arrays (what
    ``all_to_all_single`` takes); a CPU tensor was left a tensor, which gloo's
    ``all_to_all_single`` refuses. On CPU: the same numpy array the CUDA path makes."""

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def _uneven_gather_padded(original):
    """gloo all-gathers equal pieces only: pad each rank's piece to the largest of
    ``output_split_sizes``, gather, and keep each piece's own rows (CPU tensors only)."""

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if (output_split_sizes is None or input_.is_cuda or group is None or group.size() == 1
                or len(set(output_split_sizes)) == 1):
            return original(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, output_split_sizes)], dim=0)

    return _gather_along_first_dim


def declare_moe(registry: PatchRegistry, versions: VersionRange) -> None:
    """Add the MoE patches this megatron-core needs on CPU to ``registry`` (the adapter's)."""
    moe = "megatron.core.transformer.moe."
    if _router_gemm_undefined():
        registry.add(Patch.defining(
            "cpu-moe-router-gemm", moe + "moe_utils:te_general_gemm", None, versions,
            "MoE without transformer-engine: te_general_gemm := None (the router's torch path)"))
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        registry.add(Patch(
            "cpu-moe-alltoall-splits", moe + "token_dispatcher:maybe_move_tensor_to_cpu", _splits_as_numpy,
            versions, ("tensor", "as_numpy", "record_stream"),
            "MoE alltoall dispatcher on CPU: split sizes as numpy, as on the GPU"))
    registry.add(Patch(
        "cpu-moe-uneven-gather", "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
        _uneven_gather_padded, versions, ("input_", "group", "output_split_sizes", "use_global_buffer"),
        "MoE alltoall dispatcher with TP on CPU: uneven all-gathers padded for gloo"))
