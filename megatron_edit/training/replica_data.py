"""Each torchft worker reads its own data in Megatron-LM (``--local-sgd-sync-backend torchft``).

Over the torchft backend each worker is its own job, whose data-parallel group holds only its
own D ranks: Megatron's samplers would give every worker the same samples. With the run's W
workers (the supervisor's count, ``MEGATRON_EDIT_FT_START_GATE``) and this worker's id w, the
samplers become those of one data-parallel group of W x D ranks, the torch backend's (where
distributed-optimizer instance w holds data-parallel ranks w D .. w D + D - 1):

* rank d of worker w reads what data-parallel rank w D + d reads there
  (:func:`replica_slice`), from the global position W x its own consumed samples (each worker's
  ``--global-batch-size`` is its share, 1/W of the torch backend's);
* the data sets are built W times larger (``get_train_valid_test_num_samples``), for W workers'
  slices.

So with the same flags (the torch backend's ``--global-batch-size`` divided by W) the workers
train on the batches the torch backend's workers do. A worker's data position is its own: a
job that resumes from its own checkpoint goes on from its consumed samples.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, Optional, Tuple

from ..exchange.run_gate import START_GATE_ENV, supervised_workers
from ..mcore.runtime import LocalSGDRuntime


def replica_slice(rank: int, size: int, consumed: int, replica_id: int, workers: int) -> Tuple[int, int, int]:
    """(data-parallel rank, data-parallel size, consumed samples) of the samplers of rank
    ``rank`` of ``size`` in worker ``replica_id`` of ``workers``, which has consumed ``consumed``
    samples of its own (see the module)."""
    if not 0 <= replica_id < workers:
        raise ValueError(f"worker {replica_id} is not one of {workers} (0 .. {workers - 1})")
    return replica_id * size + rank, workers * size, consumed * workers


class ReplicaData:
    """The patches that give each torchft worker its own slice of Megatron-LM's data."""

    def __init__(self, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
        self.runtime_ref = runtime_ref

    def shard(self) -> Optional[Tuple[int, int]]:
        """(this worker's id, the run's workers) over the torchft backend; None otherwise."""
        runtime = self.runtime_ref()
        configs = runtime.configs if runtime is not None else None
        if configs is None or configs.local.sync_backend != "torchft":
            return None
        workers = supervised_workers(os.environ.get(START_GATE_ENV))
        if workers is None:  # validate_local_sgd_args refuses this first
            raise RuntimeError(
                "megatron_edit: --local-sgd-sync-backend torchft through Megatron-LM needs the run's number of "
                "workers for each worker's data: start the jobs with python -m megatron_edit.supervise.")
        return configs.local.replica_id, workers

    def wrap_num_samples(self, original):
        def get_train_valid_test_num_samples(*args, **kwargs):
            sizes = original(*args, **kwargs)
            shard = self.shard()
            if shard is None:
                return sizes
            return tuple(None if n is None else n * shard[1] for n in sizes)

        return get_train_valid_test_num_samples

    def wrap_sampler(self, original):
        """A subclass of the sampler class ``original`` that reads this worker's slice (the
        registry checks its parameters against megatron-core's release table first)."""
        signature = inspect.signature(original)
        data = self

        class Sampler(original):
            def __init__(self, *args, **kwargs):
                shard = data.shard()
                if shard is not None:
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    a = bound.arguments
                    a["data_parallel_rank"], a["data_parallel_size"], a["consumed_samples"] = replica_slice(
                        a["data_parallel_rank"], a["data_parallel_size"], a["consumed_samples"], *shard)
                    args, kwargs = bound.args, bound.kwargs
                super().__init__(*args, **kwargs)

        Sampler.__name__, Sampler.__qualname__ = original.__name__, original.__qualname__
        Sampler.__module__, Sampler.__doc__ = original.__module__, original.__doc__
        return Sampler
