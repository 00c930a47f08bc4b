"""A worker holds every group a step uses: Megatron's rank layout, and the check that stops a run
whose layout would cross workers (:func:`megatron_edit.mcore.worker_layout.check_worker_holds`).

The layouts are megatron-core's own: ``initialize_model_parallel`` runs for every rank of a
16-32-rank world in this one process, with ``create_group`` recording each group's ranks
instead of building it, so tensor, context, pipeline and expert parallelism with
``num_distributed_optimizer_instances`` (context parallelism with MoE included, which needs
transformer-engine's attention to train) are checked on the CPU as the runtime checks them on a
GPU at start-up.
"""

import pytest

from megatron_edit.config import ConfigError
from megatron_edit.mcore.worker_layout import check_worker_holds


class _Ranks(tuple):
    """What the recording ``create_group`` returns: the group's global ranks."""

    def size(self):
        return len(self)


def _megatron_groups(monkeypatch, world, rank, **sizes):
    """The groups of ``rank`` after megatron-core's ``initialize_model_parallel(**sizes)``, as
    global ranks: the worker (the distributed-optimizer instance) and what a step uses."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not hasattr(ps, "get_intra_distributed_optimizer_instance_group"):
        pytest.skip("megatron-core 0.12 has no instance group: megatron_edit builds it (compat.instance_group)")
    saved = {k: v for k, v in vars(ps).items() if k.startswith("_") and k[1:2].isupper()}
    monkeypatch.setattr(ps, "create_group", lambda ranks=None, **_: _Ranks(ranks))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    try:
        ps.initialize_model_parallel(**sizes)
        step = {
            "data-parallel (dense, the worker's part)": ps.get_data_parallel_group(
                with_context_parallel=True, partial_data_parallel=True),
            "tensor-parallel": ps.get_tensor_model_parallel_group(),
            "context-parallel": ps.get_context_parallel_group(),
            "pipeline-parallel": ps.get_pipeline_model_parallel_group(),
            "expert tensor x expert model-parallel": ps.get_expert_tensor_and_model_parallel_group(),
            "expert data-parallel (the worker's part)": ps.get_expert_data_parallel_group(
                partial_expert_data_parallel=True),
        }
        return ps.get_intra_distributed_optimizer_instance_group(), step
    finally:
        for k in [k for k in vars(ps) if k.startswith("_") and k[1:2].isupper()]:
            setattr(ps, k, saved.get(k))


LAYOUTS = [  # world, tp, cp, ep, etp, pp, workers
    (8, 1, 2, 2, 1, 1, 2),
    (8, 2, 2, 2, 1, 1, 2),
    (16, 1, 2, 4, 1, 1, 2),
    (16, 2, 2, 4, 1, 1, 2),
    (16, 1, 4, 2, 1, 1, 2),
    (16, 2, 2, 2, 2, 1, 2),
    (16, 1, 2, 2, 1, 2, 2),
    (16, 1, 2, 2, 1, 1, 4),
    (32, 2, 2, 8, 1, 1, 2),
    (16, 2, 1, 8, 1, 1, 2),
]


@pytest.mark.parametrize("world,tp,cp,ep,etp,pp,workers", LAYOUTS)
def test_megatron_keeps_every_group_of_a_moe_step_inside_one_worker(monkeypatch, world, tp, cp, ep, etp, pp, workers):
    """Context parallelism with MoE among them: the workers partition the world into equal
    blocks, and each rank's dense and expert groups lie inside its own."""
    blocks = set()
    for rank in range(world):
        worker, step = _megatron_groups(
            monkeypatch, world, rank, tensor_model_parallel_size=tp, context_parallel_size=cp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
            pipeline_model_parallel_size=pp, num_distributed_optimizer_instances=workers)
        assert rank in worker
        check_worker_holds(worker, step)
        blocks.add(frozenset(worker))
    assert len(blocks) == workers and sum(map(len, blocks)) == world


def test_a_group_crossing_workers_stops_the_run_naming_it():
    check_worker_holds([0, 1, 2, 3], {"tensor-parallel": [0, 1], "context-parallel": [2, 3]})
    with pytest.raises(ConfigError, match=r"the context-parallel group \(ranks \[2, 4\]\) crosses EDiT "
                                          r"workers: ranks \[4\] are not in this rank's worker \[0, 1, 2, 3\]"):
        check_worker_holds([0, 1, 2, 3], {"tensor-parallel": [0, 1], "context-parallel": [2, 4]})
