"""EDiT on Megatron-FSDP in fsdp_dtensor checkpoints (megatron_edit.mcore.checkpoint.fsdp_dtensor):
real megatron-core on CPU/gloo, 4 ranks = 2 workers x 2 shards, saved and loaded with
torch.distributed.checkpoint as Megatron-LM's --ckpt-format fsdp_dtensor does."""

import pickle

import pytest
import torch

from checkpoint_runs import DP_RESHARDABLE, EDIT, STEPS, _equal, fsdp_train_job, train_job
from compare import max_difference
from dist import run_ranks
from edit_runs import FSDP_MOE, ON_EXPERT_PARALLEL_FSDP, ON_FSDP_RELEASE

WORLD = 4
_STATE = ("params", "adam", "anchors", "outer", "mains", "steps_done", "last_sync_step", "residuals", "extra")
# Saved after step 3, while the exchange of the sync after step 4 is in flight (launched after
# step 2); keep_local with int8 and error feedback: launch parameters and residuals are saved too.
DELAYED = dict(local_sgd_sync_interval=4, local_sgd_warmup_steps=0, outer_step_delay=2, sync_mode="layerwise",
               outer_merge_rule="keep_local", exchange_dtype="int8", exchange_error_feedback=True,
               exchange_block_size=64)


@ON_FSDP_RELEASE
@pytest.mark.timeout(600)
@pytest.mark.parametrize("local, saves, steps", [
    # layer-wise, warmup 2, H=3: step 5's sync is pending at its save (completed there, as the
    # next forward would); step 6 is between syncs, each worker with its own parameters
    (EDIT, (5, 6), STEPS),
    pytest.param(DELAYED, (3,), 8, marks=pytest.mark.one_lane),  # (a variant: CI time; see conftest)
], ids=["layerwise", "in-flight-int8-ef"])
def test_exact_resume_on_megatron_fsdp(tmp_path, local, saves, steps):
    """A run stopped at a save and resumed in fresh processes ends with every rank's parameters,
    Adam state, anchor, outer state, error-feedback residuals and counters bit for bit those of
    the run without the stop; right after the load each worker holds its own saved state (the
    two workers' parameters differ there: worker 1 did not get worker 0's)."""
    path = str(tmp_path / "ckpt")
    whole = run_ranks(fsdp_train_job, WORLD, local_sgd=local, steps=steps, saves=saves, path=path,
                           snapshots=saves, timeout=400)
    for step in saves:
        resumed = run_ranks(fsdp_train_job, WORLD, local_sgd=local, steps=steps, load=step, path=path,
                                 timeout=400)
        for a, b in zip(whole, resumed):
            for key in _STATE:
                _equal(a["snapshots"][step][key], b["loaded"][key], f"loaded at {step}: {key}")
                _equal(a["final"][key], b["final"][key], f"resumed from {step}: {key}")
        if step != 5:  # between syncs: the workers' own parameters
            assert max_difference(whole[0]["snapshots"][step]["params"], whole[2]["snapshots"][step]["params"]) > 1e-4
    if local is DELAYED:
        # (the run's last step is known: its sync after step 8 is not delayed, so it ends with one model)
        assert [(r.step, r.delay) for r in whole[0]["reports"]] == [(4, 2), (8, 0)]
        assert any(r is not None for r in whole[0]["final"]["residuals"])


@ON_FSDP_RELEASE
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ep", [pytest.param(1, marks=pytest.mark.one_lane),
                                pytest.param(2, marks=ON_EXPERT_PARALLEL_FSDP)])
def test_moe_exact_resume_on_megatron_fsdp(tmp_path, ep):
    """A MoE GPT (4 experts; expert parallelism 1, and 2 where Megatron-FSDP's HSDP has it)
    saved between syncs (step 6) and resumed in fresh processes: every rank's parameters, Adam
    state, anchor, outer state and counters bit for bit those of the run without the stop."""
    path = str(tmp_path / "ckpt")
    whole = run_ranks(fsdp_train_job, WORLD, steps=STEPS, saves=(6,), path=path, snapshots=(6,),
                           model=FSDP_MOE, ep=ep, timeout=400)
    resumed = run_ranks(fsdp_train_job, WORLD, steps=STEPS, load=6, path=path, model=FSDP_MOE, ep=ep, timeout=400)
    for a, b in zip(whole, resumed):
        assert any(".experts." in k for k in a["final"]["params"])
        for key in _STATE:
            _equal(a["snapshots"][6][key], b["loaded"][key], f"loaded at 6: {key}")
            _equal(a["final"][key], b["final"][key], f"resumed from 6: {key}")
    assert max_difference(whole[0]["snapshots"][6]["params"], whole[2]["snapshots"][6]["params"]) > 1e-4


@pytest.mark.one_lane  # the checkpoint path the exact-resume test checks in every lane
@ON_FSDP_RELEASE
@pytest.mark.timeout(600)
def test_elastic_resume_on_megatron_fsdp_takes_the_distributed_optimizers_outer_step(tmp_path):
    """2 workers saved between syncs (after step 6), resumed as 1 worker of 4 shards: the load
    takes one outer step over the two saved workers, and the loaded parameters and anchor equal
    the distributed optimizer's elastic resume of the same run to 1e-6 (bit for bit here); the
    run goes on from there. (The two paths' later steps differ by megatron-core's own reduction
    order with 4 shards: plain Megatron-FSDP and DDP differ as much.)"""
    fsdp_path, ddp_path = str(tmp_path / "fsdp"), str(tmp_path / "ddp")
    run_ranks(fsdp_train_job, WORLD, saves=(6,), path=fsdp_path, train_iters=False, timeout=400)
    fsdp = run_ranks(fsdp_train_job, WORLD, instances=1, load=6, path=fsdp_path, train_iters=False,
                          timeout=400)
    run_ranks(train_job, WORLD, saves={6: [(ddp_path, DP_RESHARDABLE)]}, timeout=400)
    ddp = run_ranks(train_job, WORLD, instances=1, load=(ddp_path, DP_RESHARDABLE, 6), timeout=400)
    for f, d in zip(fsdp, ddp):
        assert max_difference(f["loaded"]["params"], d["loaded"]["params"]) <= 1e-6
        assert f["loaded"]["steps_done"] == d["loaded"]["steps_done"] == 6
        assert all(torch.isfinite(torch.tensor(list(f["losses"].values()))))


@pytest.mark.one_lane  # the checkpoint path the exact-resume test checks in every lane
@ON_FSDP_RELEASE
@pytest.mark.timeout(600)
def test_edit_resumes_a_plain_megatron_fsdp_checkpoint_as_the_distributed_optimizer_does(tmp_path):
    """A checkpoint of plain Megatron-FSDP (synchronous, no EDiT state), resumed with EDiT: Adam's
    state kept, the anchor taken at the loaded model, syncs on the usual grid; the run equals the
    distributed optimizer's resume of its own synchronous checkpoint to 1e-6."""
    fsdp_path, ddp_path = str(tmp_path / "fsdp"), str(tmp_path / "ddp")
    run_ranks(fsdp_train_job, WORLD, local_sgd=None, saves=(4,), path=fsdp_path, timeout=400)
    fsdp = run_ranks(fsdp_train_job, WORLD, load=4, path=fsdp_path, train_iters=False, timeout=400)
    run_ranks(train_job, WORLD, local_sgd=None, saves={4: [(ddp_path, DP_RESHARDABLE)]}, timeout=400)
    ddp = run_ranks(train_job, WORLD, load=(ddp_path, DP_RESHARDABLE, 4), timeout=400)
    for f, d in zip(fsdp, ddp):
        assert f["loaded"]["steps_done"] == 4
        assert [r.step for r in f["reports"]] == [r.step for r in d["reports"]] == [5, 8]
        assert max_difference(f["final"]["params"], d["final"]["params"]) <= 1e-6


def _drop_anchor_entries(path):
    """Damage a checkpoint: its metadata forgets EDiT's anchor."""
    import os

    name = os.path.join(path, ".metadata")
    with open(name, "rb") as f:
        metadata = pickle.load(f)
    for key in [k for k in metadata.state_dict_metadata if ".local_sgd.anchor." in k]:
        del metadata.state_dict_metadata[key]
    with open(name, "wb") as f:
        pickle.dump(metadata, f)


def _refusal_job(rank, world, path, case):
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from checkpoint_runs import OUTER, _fsdp_state_dict, fsdp_load
    from edit_runs import _build, default_spec

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**EDIT), me.OuterOptimizerConfig(**OUTER))
    ddp, opt = _build(default_spec(instances=2, fsdp=True), 1, 1)
    try:
        if case == "save-without-model":
            from checkpoint_runs import FSDP_DTENSOR

            opt.sharded_state_dict({}, metadata=FSDP_DTENSOR)
        elif case == "load-without-patch":
            from torch.distributed.checkpoint import state_dict_loader

            state = _fsdp_state_dict(ddp, opt, is_loading=True)
            state_dict_loader.load(state, checkpoint_id=path)  # the module's function: not patched
            opt.load_state_dict(state["optimizer"])
        else:
            fsdp_load(ddp, opt, path)
    except Exception as e:  # noqa: BLE001 - the message is the test's
        return f"{type(e).__name__}: {e}"
    finally:
        me.unpatch_megatron_for_local_sgd()
    return None


@pytest.mark.one_lane  # the checkpoint path the exact-resume test checks in every lane
@ON_FSDP_RELEASE
@pytest.mark.timeout(600)
def test_refusals_of_fsdp_dtensor_checkpoints(tmp_path):
    """One line on every rank, naming what is wrong: a save of worker 1's optimizer without the
    model's state dict; a load that bypassed the DCP patch; a checkpoint that lost EDiT entries."""
    import os

    path = str(tmp_path / "ckpt")
    run_ranks(fsdp_train_job, WORLD, saves=(6,), path=path, steps=6, timeout=400)
    saved = os.path.join(path, "step_6")
    no_model = run_ranks(_refusal_job, WORLD, saved, "save-without-model", timeout=300)
    assert no_model[0] is None and no_model[2] is not None  # worker 0 writes the model's keys itself
    assert "CheckpointStateError" in no_model[2] and "'model': model.state_dict()" in no_model[2]
    unpatched = run_ranks(_refusal_job, WORLD, saved, "load-without-patch", timeout=300)
    assert all(m and "without megatron_edit's patch of torch.distributed.checkpoint.load" in m for m in unpatched)
    _drop_anchor_entries(saved)
    damaged = run_ranks(_refusal_job, WORLD, saved, "damaged", timeout=300)
    assert all(m and "CheckpointStateError" in m and "incomplete or corrupted" in m and "local_sgd.anchor." in m
               for m in damaged)
    assert len(set(damaged)) == 1  # the same line on every rank


@pytest.mark.one_lane  # the checkpoint path the exact-resume test checks in every lane
@ON_FSDP_RELEASE
@pytest.mark.timeout(600)
def test_model_only_load_on_megatron_fsdp_restarts_edit_from_worker_0(tmp_path):
    """``--no-load-optim`` / ``--finetune``-style load (the model alone) of a checkpoint taken
    between syncs (step 6): every worker gets worker 0's model, its fp32 main weights included,
    and EDiT starts afresh (no anchor, the warmup again), so after the two synchronous steps the
    workers are identical."""
    path = str(tmp_path / "ckpt")
    whole = run_ranks(fsdp_train_job, WORLD, steps=8, saves=(6,), path=path, snapshots=(6,), timeout=400)
    resumed = run_ranks(fsdp_train_job, WORLD, steps=8, load=6, path=path, load_optimizer=False, timeout=400)
    worker0 = whole[0]["snapshots"][6]
    assert max_difference(worker0["params"], whole[2]["snapshots"][6]["params"]) > 1e-4  # between syncs
    for rank, r in enumerate(resumed):
        loaded = r["loaded"]
        _equal(loaded["params"], worker0["params"], "model-only load: worker 0's model")
        # the main weights follow the loaded model: those of worker 0's rank with the same shard
        _equal(loaded["mains"], whole[rank % 2]["snapshots"][6]["mains"], "main weights")
        assert loaded["steps_done"] == 0 and loaded["anchors"] == [None] * len(loaded["anchors"])
    _equal(resumed[0]["final"]["params"], resumed[2]["final"]["params"], "after the warmup again")
