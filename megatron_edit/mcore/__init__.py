"""megatron-core attachment: how EDiT hooks into Megatron's DDP and distributed optimizer.

* :mod:`.wrap_registry`: a registry of declared, versioned, reversible wrap patches (nothing EDiT);
* :mod:`.compat`: every difference between megatron-core releases, in one place;
* :mod:`.shards`: EDiT's view of a ``DistributedOptimizer`` (its buckets as shards, layers);
* :mod:`.controller`: :class:`LocalSGD`, one optimizer's EDiT state and schedule;
* :mod:`.checks`: Megatron options refused with EDiT;
* :mod:`.runtime`, :mod:`.session`: the live state the patches consult;
* :mod:`.core_wraps`: the DDP / bucket / optimizer patches;
* :mod:`.checkpoint`: EDiT state in ``torch_dist`` checkpoints, a sub-package with one public
  face (the format, the record, elastic resume, the checkpoint patches, and the workarounds for
  megatron-core's own checkpoint-load defects).
"""
