"""A constant checkpoint structure (megatron_edit.mcore.checkpoint.constant) under Megatron's cached
save plan, the one Megatron-LM's ``--ckpt-assume-constant-structure`` uses: real megatron-core on
CPU, gloo, 4 processes = 2 workers x 2 shards.

The saves go through the objects Megatron-LM's ``save_checkpoint`` builds with the flag: the
``torch_dist`` save strategy with ``use_cached_ckpt_structure``, in the fully parallel wrapper with
a cached distribution, made at the first save and reused by every later one (its
``checkpointing_context``), sharding validated at the first save only. A resumed run plugs the
load strategy's metadata into its first save strategy, as Megatron-LM does.
"""

import inspect
import re

import pytest

from checkpoint_runs import DP_RESHARDABLE, WORLD, _children_allowed, _equal, _setup, _sharded, _state, _train
from dist import run_ranks
from megatron_edit.mcore import checkpoint as checkpointing, compat

pytestmark = pytest.mark.skipif(
    not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}",
)

# Warmup 3, H = 4: syncs after steps 7 and 11; tau = 2: the exchange of the sync after step 7 is
# launched after step 5 and applied after step 7. keep_local: each worker's launch parameters are
# kept too; int8 with error feedback: residuals. Steps 1 and 2 are in the warmup (no anchor, no
# outer state): two saves with the same plan, which the cached strategy then reuses. Step 6: the
# anchor is there, the outer momentum not yet (no outer step), an exchange is in flight. Step 8:
# the momentum is there, nothing in flight.
DELAYED = dict(local_sgd_sync_interval=4, local_sgd_warmup_steps=3, outer_step_delay=2,
               outer_merge_rule="keep_local", sync_mode="layerwise", exchange_dtype="int8",
               exchange_block_size=64, exchange_error_feedback=True)
STEPS = 10


def _cached_save(ddp, opt, path, context):
    """One save as Megatron-LM's ``save_checkpoint`` makes it with
    ``--ckpt-assume-constant-structure`` (``context``: its ``checkpointing_context``)."""
    import os

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    os.makedirs(path, exist_ok=True)
    state = _sharded(ddp, opt, DP_RESHARDABLE)
    strategy = context.get("save_strategy")
    validate = strategy is None  # "Already saved once before - don't need to rerun sharding validation"
    if strategy is None:
        base = get_default_save_sharded_strategy()
        base.use_cached_ckpt_structure = True
        loaded = getattr(context.get("load_strategy"), "cached_global_metadata", None)
        if loaded is not None:  # "Plugging in the read metadata from the load strategy"
            base.cached_global_metadata = loaded
        strategy = FullyParallelSaveStrategyWrapper(base, ps.get_data_parallel_group(with_context_parallel=True), True)
        context["save_strategy"] = strategy
    with _children_allowed():
        dist_checkpointing.save(state, path, strategy, validate_access_integrity=validate)


def _cached_load(ddp, opt, path, context):
    """A load as Megatron-LM's ``_load_base_checkpoint`` makes it with the flag (its metadata cached)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    cache = "cache_metadata" in inspect.signature(TorchDistLoadShardedStrategy).parameters  # 0.19: a flag
    strategy = TorchDistLoadShardedStrategy(**(dict(cache_metadata=True) if cache else {}))
    context["load_strategy"] = strategy
    state = dist_checkpointing.load(_sharded(ddp, opt, DP_RESHARDABLE, is_loading=True), path, strategy)
    ddp.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def cached_save_job(rank, world, steps, saves=None, load=None):
    """Train to ``steps`` (from ``load=(path, step)``), saving at ``saves`` {step: path} with one
    cached save strategy; the state restored by the load and the final one."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    ddp, opt, ctl = _setup(DELAYED, 2)
    context, first, loaded = {}, 1, None
    if load is not None:
        _cached_load(ddp, opt, load[0], context)
        loaded, first = _state(ddp, opt, ctl, gather=False), load[1] + 1
    in_flight = {}
    for step in range(first, steps + 1):
        _train(ddp, opt, ctl, step, step)
        if step in (saves or {}):
            in_flight[step] = ctl.delayed.in_flight
            _cached_save(ddp, opt, saves[step], context)
    out = dict(loaded=loaded, final=_state(ddp, opt, ctl), in_flight=in_flight,
               anchor=ctl.outer_optimizer is not None, reports=[(r.step, r.delay) for r in ctl.drain_reports()])
    me.unpatch_megatron_for_local_sgd()
    me.unpatch_megatron_load_fixes()
    return out


def _without_counters(state):
    return {k: v for k, v in state.items() if k not in ("collectives", "payload")}


@pytest.mark.timeout(600)
def test_cached_save_plan_keeps_every_edit_entry_and_resumes_exactly(tmp_path):
    """Saved with the cached plan in the warmup (twice) and then while a delayed exchange is in
    flight, where the anchor, the outer state and the exchange's entries used to appear: the
    resume restores exactly the saved state; that run saves again with the loaded metadata
    plugged in (nothing in flight, the outer momentum there now), and the second resume ends
    bit-identical to the uninterrupted run."""
    ckpt = {step: str(tmp_path / f"step{step}") for step in (1, 2, 6, 8)}
    reference = run_ranks(cached_save_job, WORLD, STEPS, timeout=300)
    saver = run_ranks(cached_save_job, WORLD, 6, saves={s: ckpt[s] for s in (1, 2, 6)}, timeout=300)
    assert [r["in_flight"] for r in saver] == [{1: False, 2: False, 6: True}] * WORLD
    first = run_ranks(cached_save_job, WORLD, 8, saves={8: ckpt[8]}, load=(ckpt[6], 6), timeout=300)
    assert [r["in_flight"] for r in first] == [{8: False}] * WORLD
    second = run_ranks(cached_save_job, WORLD, STEPS, load=(ckpt[8], 8), timeout=300)
    for ref, saved, one, two in zip(reference, saver, first, second):
        _equal(_without_counters(one["loaded"]), _without_counters(saved["final"]), "restored at step 6")
        _equal(_without_counters(two["final"]), _without_counters(ref["final"]), "resumed vs uninterrupted")
        assert ref["reports"] == [(7, 2)] and one["reports"] == [(7, 2)] and two["reports"] == []
    assert reference[0]["final"]["outer"][0]  # the outer momentum exists at the end (it did not at 6)
    # The first save (the warmup, planned afresh) already holds every kind, as placeholders.
    kinds = {re.match(r"local_sgd\.((?:outer|in_flight_launch|residual)\.\w+|\w+)", k).group(1)
             for k in _saved_keys(ckpt[1]) if k.startswith("local_sgd.")}
    assert {"anchor", "outer.momentum_buffer", "in_flight", "in_flight_launch.worker_0", "in_flight_launch.worker_1",
            "residual.worker_0", "residual.worker_1", "result_residual", "record"} <= kinds, kinds


def _saved_keys(path):
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)
