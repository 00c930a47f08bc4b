"""The multi-rank test harness (tests/dist.py) reports the cause of a failure, not only its echo."""

import os
import signal

import pytest

from dist import RERUNS, RUNS, RankError, run_ranks

pytestmark = pytest.mark.one_lane


def _one_rank_is_killed(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies without a report, as an OOM kill or a C++ abort would
    dist.all_reduce(torch.ones(1))  # rank 0: its peer is gone (the echo)


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_is_named_with_its_exit_code_beside_the_echo():
    with pytest.raises(RankError) as info:
        run_ranks(_one_rank_is_killed, 2, timeout=60)
    message = str(info.value)
    assert f"rank 1 exited with code {-signal.SIGKILL} without reporting" in message, message


def _rank_1_segfaults(rank, world_size, marker, always):
    import torch.distributed as dist

    dist.barrier()
    if rank == 1 and (always or not os.path.exists(marker)):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)  # a crash in native code, as the known gloo defect
    return rank


@pytest.mark.timeout(200)
def test_a_native_crash_is_run_again_and_one_in_every_run_is_raised(tmp_path):
    """The known native crash (docs/status.md) fails a job now and then: run_ranks runs it again
    (up to RUNS runs), with a warning for each failure; a crash in every run, or a rank killed
    otherwise (above), is raised."""
    before = len(RERUNS)
    try:
        with pytest.warns(UserWarning, match="died in native code"):
            assert run_ranks(_rank_1_segfaults, 2, str(tmp_path / "once"), False, timeout=60) == [0, 1]
        assert len(RERUNS) == before + 1  # counted for the session's summary line (conftest)
        assert RERUNS[-1][0].endswith("test_a_native_crash_is_run_again_and_one_in_every_run_is_raised")
        assert RERUNS[-1][1] == "a rank died in native code"
        with pytest.raises(RankError, match=f"rank 1 exited with code {-signal.SIGSEGV} "):
            with pytest.warns(UserWarning, match="died in native code") as warned:
                run_ranks(_rank_1_segfaults, 2, str(tmp_path / "always"), True, timeout=60)
        assert len([w for w in warned if "died in native code" in str(w.message)]) == RUNS - 1
    finally:
        del RERUNS[before:]  # the harness's own crashes are not the suite's: left out of its count

