"""The pure math of EDiT and A-EDiT (arXiv 2412.07210): tensors in, tensors out.

Nothing in this package talks to ``torch.distributed`` or imports Megatron:

* :mod:`.schedule`: which optimizer steps are warmup, local, or end with a sync;
* :mod:`.outer`: the pseudo-gradient and the outer step;
* :mod:`.penalty`: anomaly elimination, norm-softmax weights, clipping (Sec. 3.3);
* :mod:`.gta`: the generalized-task-arithmetic reducer;
* :mod:`.asynchronous`: A-EDiT's time-based schedule (Sec. 3.4).

The collectives that feed these functions live in :mod:`megatron_edit.exchange`.
"""
