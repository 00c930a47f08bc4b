"""Running megatron-core and Megatron-LM on CPU processes over gloo, and the demo data.

Not part of the algorithm: what lets the main job, the benchmarks and the multi-rank tests run
the real Megatron code path on a machine without a GPU.

* :mod:`.adapter`: megatron-core's CUDA assumptions, redirected to the CPU (refused on a GPU);
* :mod:`.moe`: the MoE patches the adapter adds (router GEMM name, alltoall split sizes);
* :mod:`.training_adapter`: the same for Megatron-LM's ``megatron.training``;
* :mod:`.data`: a small real-text corpus (Python's own docstrings) as a megatron-core dataset.
"""
