"""EDiT's exchange: the collectives of one outer sync, run bucket group by bucket group.

* :mod:`.groups`: the only place that calls ``torch.distributed`` for EDiT, over process groups
  passed in (the sync group across workers, the groups inside a worker); a test can pass objects
  with the same methods instead (``tests/exchange/fake_groups.py`` runs several workers as
  threads of one process).
* :mod:`.shard`: one rank's shard of one bucket of parameters, and the tensors EDiT keeps for it.
* :mod:`.outer_state`: the anchor and the outer optimizer over the shards.
* :mod:`.outer_sync`: one sync from start to end (penalty decisions, launch, complete, outer
  step), bucket group by bucket group so that a layer-wise sync overlaps the forward pass.
* :mod:`.reducers`: how a shard's pseudo-gradients are reduced (the mean, GTA, the quantized
  exchange of :mod:`.quantized`), each as launch / advance / finish.
* :mod:`.in_flight`: what one sync holds while it runs (decisions, each shard's exchange).
* :mod:`.report`: what one sync did, for logs and metrics.

Nothing here imports Megatron: :mod:`megatron_edit.mcore` builds the shards from Megatron's
distributed optimizer and decides when a sync is due.
"""
