"""EDiT state in torch_dist checkpoints (megatron_edit.mcore.checkpoint) on real megatron-core
(CPU, gloo, 4 processes = 2 workers x 2 shards): exact resume, detector statistics, partial
loads, resharding, clear errors, the refused legacy format.

Checkpoints are written the way a megatron-core user (and Megatron-LM's ``--save``) writes them:
``dist_checkpointing.save({'model': m, 'optimizer': opt.sharded_state_dict(m, metadata=...)})``.
"""

import shutil

import pytest
import torch

from checkpoint_runs import (
    DP_RESHARDABLE,
    EDIT,
    FULLY_RESHARDABLE,
    PENALTY,
    WORLD,
    _drop_from_checkpoint,
    _equal,
    _garble_object,
    corrupt_save_job,
    load_errors_job,
    model_only_and_legacy_job,
    train_job,
)
from compare import all_equal
from dist import run_ranks
from megatron_edit.mcore import checkpoint as checkpointing, compat

# EDiT state in checkpoints needs megatron-core 0.16.x; before, saving it is refused
# (tests/mcore/checkpoint/test_checkpointing_not_yet.py).
pytestmark = pytest.mark.skipif(
    not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}",
)


# ----------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run to step 10, and the same run saving at the sync boundary (step 5,
    sync pending in layer-wise mode) and between syncs (step 7, with Megatron-LM's fully
    parallel save strategy, which may pick any data-parallel rank to write a shard)."""
    root = tmp_path_factory.mktemp("edit_ckpt")
    ckpt = {5: str(root / "step5"), 7: str(root / "step7")}
    saves = {5: [(ckpt[5], DP_RESHARDABLE)], 7: [(ckpt[7], DP_RESHARDABLE, True)]}
    reference = run_ranks(train_job, WORLD, timeout=200)  # no snapshot: nothing but training
    saver = run_ranks(train_job, WORLD, saves=saves, snapshots=(5, 7), timeout=200)
    return dict(reference=reference, saver=saver, ckpt=ckpt, root=root)


@pytest.mark.timeout(420)
def test_saving_neither_syncs_nor_changes_training(runs):
    """Saving twice changes nothing: same final state, same number of collectives and bytes
    across workers as the run that never saved (no extra or off-schedule sync), and the step-7
    checkpoint really holds two different workers."""
    for ref, saved in zip(runs["reference"], runs["saver"]):
        _equal(saved["final"], ref["final"], "saver vs uninterrupted")
        assert [r.step for r in saved["reports"]] == [5, 8]
    saver = runs["saver"]
    assert not all_equal(saver[0]["snapshots"][7]["params"], saver[2]["snapshots"][7]["params"])
    assert all_equal(saver[0]["snapshots"][5]["params"], saver[2]["snapshots"][5]["params"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("step", [5, 7], ids=["sync-boundary", "mid-interval"])
def test_exact_resume(runs, step):
    """Restart from the checkpoint in fresh processes and continue to step 10: parameters of
    both workers, inner Adam state, main params, anchor, outer momentum, counters and detector
    state are bit-identical to the uninterrupted run; the restored state equals the saved one."""
    resumed = run_ranks(train_job, WORLD, load=(runs["ckpt"][step], DP_RESHARDABLE, step), timeout=200)
    _assert_exact(runs["reference"], runs["saver"], resumed, step)


@pytest.mark.timeout(300)
def test_exact_resume_fully_reshardable_format(tmp_path):
    """The same between syncs with Megatron's 'fully_reshardable' optimizer format (one bucket:
    with several, megatron-core 0.16's format itself misplaces state and is refused)."""
    path = str(tmp_path / "fully")
    kwargs = dict(bucket_size=10**8)
    saver = run_ranks(train_job, WORLD, saves={7: [(path, FULLY_RESHARDABLE)]}, snapshots=(7,), **kwargs, timeout=200)
    resumed = run_ranks(train_job, WORLD, load=(path, FULLY_RESHARDABLE, 7), **kwargs, timeout=200)
    _assert_exact(saver, saver, resumed, 7)


def _assert_exact(reference, savers, resumed, step):
    """Per rank: the restored state is the saved one, the final state the uninterrupted one
    (sync traffic counters aside: the resumed process counts from its start)."""
    for ref, saved_run, res in zip(reference, savers, resumed):
        loaded = {k: v for k, v in res["loaded"].items() if k not in ("collectives", "payload")}
        saved = {k: v for k, v in saved_run["snapshots"][step].items() if k not in ("collectives", "payload")}
        _equal(loaded, saved, f"restored state after step {step}")
        final = {k: v for k, v in res["final"].items() if k not in ("collectives", "payload")}
        expected = {k: v for k, v in ref["final"].items() if k not in ("collectives", "payload")}
        _equal(final, expected, "resumed vs uninterrupted")
        assert [r.step for r in res["reports"]] == [8]


@pytest.mark.timeout(420)
def test_exact_resume_with_quantized_exchange_and_error_feedback(tmp_path):
    """int4 exchange with error feedback, saved between syncs: the residuals (each worker's
    own and the chunk each one requantizes) are restored, and the run continues bit-identical
    to the uninterrupted one."""
    quantized = dict(EDIT, exchange_dtype="int4", exchange_block_size=64, exchange_error_feedback=True)
    path = str(tmp_path / "int4")
    reference = run_ranks(train_job, WORLD, local_sgd=quantized, timeout=200)
    saver = run_ranks(train_job, WORLD, local_sgd=quantized, steps=7, saves={7: [(path, DP_RESHARDABLE)]},
                      snapshots=(7,), timeout=200)
    resumed = run_ranks(train_job, WORLD, local_sgd=quantized, load=(path, DP_RESHARDABLE, 7), timeout=200)
    _assert_exact(reference, saver, resumed, 7)
    residuals = reference[0]["final"]["residuals"]
    assert all(r is not None and c is not None for r, c in residuals)
    assert any(r.abs().sum() > 0 for r, _ in residuals)  # something was dropped and kept


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(420)
def test_exact_resume_with_sparse_exchange_and_error_feedback(tmp_path):
    """Top-k 2% int2 exchange, error feedback on by default, saved between syncs: each worker's
    residual (what it did not send) is restored, and the run continues bit-identical to the
    uninterrupted one."""
    sparse = dict(EDIT, exchange_dtype="int2", exchange_topk_density=0.02)
    path = str(tmp_path / "topk")
    reference = run_ranks(train_job, WORLD, local_sgd=sparse, timeout=200)
    saver = run_ranks(train_job, WORLD, local_sgd=sparse, steps=7, saves={7: [(path, DP_RESHARDABLE)]},
                      snapshots=(7,), timeout=200)
    resumed = run_ranks(train_job, WORLD, local_sgd=sparse, load=(path, DP_RESHARDABLE, 7), timeout=200)
    _assert_exact(reference, saver, resumed, 7)
    residuals = reference[0]["final"]["residuals"]
    assert all(r is not None and c is None for r, c in residuals)
    assert all(r.abs().sum() > 0 for r, _ in residuals)  # most of each pseudo-gradient was kept back


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(300)
def test_penalty_detector_statistics_are_restored(tmp_path):
    """Penalty on (weights, clipping, anomaly detector): resumed between syncs, the syncs after
    the restart make the decisions of the uninterrupted run (norms, exclusions, weights, clip
    factors) and the detector statistics and parameters stay bit-identical."""
    from megatron_edit.mcore.controller import LocalSGD

    if not hasattr(LocalSGD, "extra_state"):
        pytest.skip("LocalSGD.extra_state() (detector statistics) does not exist yet")
    path = str(tmp_path / "penalty")
    # Syncs after steps 3, 5, 7, 9. Worker 1's parameters go wrong after step 6 (in the
    # checkpoint): only statistics restored from the checkpoint can flag it at the sync after 7.
    faults = [dict(workers=[1], steps=[6], kind="scale", factor=1.5)]
    kwargs = dict(local_sgd=PENALTY, steps=9, faults=faults)
    reference = run_ranks(train_job, WORLD, snapshots=(6,), **kwargs, timeout=200)
    run_ranks(train_job, WORLD, steps=6, local_sgd=PENALTY, faults=faults, saves={6: [(path, DP_RESHARDABLE)]},
              timeout=200)
    resumed = run_ranks(train_job, WORLD, load=(path, DP_RESHARDABLE, 6), **kwargs, timeout=200)
    for ref, res in zip(reference, resumed):
        ewma = ref["snapshots"][6]["extra"]["ewma"]
        assert int(ewma["count"].min()) >= 1, "the detector had no statistics to restore"
        _equal(res["loaded"]["extra"], ref["snapshots"][6]["extra"], "detector statistics after load")
        after = [r for r in ref["reports"] if r.step > 6]
        assert [r.step for r in res["reports"]] == [r.step for r in after] == [7, 9]
        for mine, theirs in zip(res["reports"], after):
            for field in ("norms", "excluded", "weights", "clip_coef", "skipped"):
                _equal(getattr(mine, field), getattr(theirs, field), f"sync {mine.step} {field}")
        _equal(res["final"]["params"], ref["final"]["params"], "parameters")
        _equal(res["final"]["extra"], ref["final"]["extra"], "detector statistics at the end")
    first_after = resumed[0]["reports"][0]
    assert first_after.excluded[1].any() and not first_after.excluded[0].any(), first_after.excluded


@pytest.mark.timeout(300)
def test_resume_with_a_different_shard_size(runs):
    """The 2 workers x 2 shards checkpoint taken between syncs loads into 2 workers x 1 shard
    (2 processes): each worker's parameters and the anchor are restored exactly; training
    continues and the workers agree after the next sync."""
    resumed = run_ranks(train_job, 2, load=(runs["ckpt"][7], DP_RESHARDABLE, 7), snapshots=(8,), timeout=200)
    ref = runs["saver"]
    for res in resumed:
        w = res["worker"]
        saved = ref[2 * w]["snapshots"][7]
        _equal(res["loaded"]["params"], saved["params"], f"worker {w} parameters")
        assert res["loaded"]["steps_done"] == 7
        for i, anchor in enumerate(res["loaded"]["anchors"]):
            halves = torch.cat([ref[2 * w]["snapshots"][7]["anchors"][i], ref[2 * w + 1]["snapshots"][7]["anchors"][i]])
            assert torch.equal(anchor, halves[: anchor.numel()]), f"anchor of bucket {i}"
        assert [r.step for r in res["reports"]] == [8]
    assert all_equal(resumed[0]["snapshots"][8]["params"], resumed[1]["snapshots"][8]["params"])
    # Different reduction order inside a worker: close to the 4-process run, not bit-equal. The
    # losses are compared, not the parameters: the key part of the QKV bias has a mathematically
    # zero gradient (softmax ignores it), so Adam turns reduction-order noise there into steps of
    # about the learning rate, and a tolerance on those parameters passes or fails by chance
    # (run to run). The loss does not depend on them; it depends on everything that is determined.
    for res in resumed:
        # one rank of 2 reads the samples of ranks 2w and 2w + 1 of the 4-rank run: its loss is
        # the mean of theirs
        pair = [ref[2 * res["worker"] + i]["losses"] for i in (0, 1)]
        for step, loss in res["losses"].items():
            theirs = (pair[0][step] + pair[1][step]) / 2
            assert loss == pytest.approx(theirs, rel=1e-5, abs=1e-6), (step, loss, theirs)
        assert sorted(res["losses"]) == [8, 9, 10]


@pytest.mark.timeout(300)
def test_model_only_load_restarts_edit_from_worker_0_and_legacy_format_is_refused(runs, tmp_path):
    """``--no-load-optim``-style load of a checkpoint taken between syncs: every worker gets
    worker 0's model and EDiT starts afresh (no anchor, warmup again), so the workers stay
    consistent. The legacy ``torch`` format (save/load_parameter_state) is refused clearly."""
    results = run_ranks(model_only_and_legacy_job, WORLD, runs["ckpt"][7], str(tmp_path), timeout=200)
    worker0_params = runs["saver"][0]["snapshots"][7]["params"]
    for r in results:
        _equal(r["loaded"]["params"], worker0_params, "model-only load")
        assert r["loaded"]["steps_done"] == 0 and r["loaded"]["anchors"] == [None] * len(r["loaded"]["anchors"])
        for name, message in r["refused"].items():
            assert message and message.startswith("NotSupportedYet") and "torch_dist" in message, (name, message)
    # Two synchronous warmup steps from the same model: the workers are still identical.
    assert all_equal(results[0]["after"]["params"], results[2]["after"]["params"])


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(400)
def test_missing_or_corrupted_edit_state_is_a_clear_error(runs, tmp_path):
    """Loading with EDiT on fails on every rank, never a silent fresh start: CheckpointStateError
    naming the problem for a checkpoint whose anchor, worker-1 part or record was removed, and
    for a record with an impossible step count; NotSupportedYet for the optimizer format
    megatron-core 0.16 corrupts; for garbled record bytes too (torch.distributed.checkpoint's own
    unpickling error was raised before). (A checkpoint without any EDiT state is one of synchronous training: it
    loads, test_checkpoint_resume.)"""
    src = runs["ckpt"][7]
    cases = {}
    for name, prefix in (("no-anchor", "local_sgd.anchor"), ("no-worker-1", "local_sgd.worker_1."),
                         ("no-record", "local_sgd.record")):
        cases[name] = str(tmp_path / name)
        shutil.copytree(src, cases[name])
        _drop_from_checkpoint(cases[name], prefix)
    cases["garbled-record"] = str(tmp_path / "garbled")
    shutil.copytree(src, cases["garbled-record"])
    _garble_object(cases["garbled-record"], "local_sgd.record")
    cases["bad-step-count"] = str(tmp_path / "bad_record")
    run_ranks(corrupt_save_job, WORLD, cases["bad-step-count"], timeout=200)
    cases = [(name, path) for name, path in cases.items()]
    # 7 buckets: megatron-core 0.16's fully_reshardable format would misplace state.
    cases.insert(0, ("fully-reshardable-padded-buckets", src, FULLY_RESHARDABLE))
    results = run_ranks(load_errors_job, WORLD, cases, timeout=250)
    expected = {
        "fully-reshardable-padded-buckets": "misplaces the optimizer state",
        "no-anchor": "is incomplete or corrupted",
        "no-worker-1": "entries missing (workers [1])",
        "no-record": "has EDiT state but no EDiT record",
        "garbled-record": "CheckpointStateError: megatron_edit: the EDiT record of checkpoint",
        "bad-step-count": "corrupted EDiT step count",
    }
    for r in results:
        for name, fragment in expected.items():
            message = r[name]
            assert message is not None, f"{name}: loaded without error"
            assert fragment in message, (name, message)
            if name not in ("garbled-record", "fully-reshardable-padded-buckets"):
                assert message.startswith("CheckpointStateError"), (name, message)


def test_record_of_another_format_is_refused_with_what_to_do():
    """A format-1 record (per-bucket EDiT state, before elastic checkpoints) or an unknown one."""
    from megatron_edit.mcore.checkpoint import CheckpointStateError
    from megatron_edit.mcore.checkpoint import check_run_record

    with pytest.raises(CheckpointStateError, match="format 'megatron_edit.local_sgd/1'.*--no-load-optim"):
        check_run_record({"format": "megatron_edit.local_sgd/1"}, "the checkpoint")
    with pytest.raises(CheckpointStateError, match="not readable"):
        check_run_record({"format": "something else"}, "the checkpoint")
