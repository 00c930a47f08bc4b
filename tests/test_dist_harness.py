"""The multi-rank test harness (tests/dist.py) reports the cause of a failure, not only its echo."""

import os
import signal

import pytest

from dist import RankError, run_ranks

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


def _rank_1_segfaults(rank, world_size, runs):
    import torch.distributed as dist

    with open(runs, "a") as f:
        f.write(f"{rank}\n")
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # a crash in native code
    return rank


@pytest.mark.timeout(120)
def test_a_native_crash_fails_the_job_at_once_with_its_signal(tmp_path):
    """A rank that dies in native code fails the job in its one run, named with its signal: no
    rerun hides it (the crash runs used to repeat had its cause found: issue 62)."""
    runs = tmp_path / "runs"
    with pytest.raises(RankError, match=f"rank 1 exited with code {-signal.SIGSEGV} "):
        run_ranks(_rank_1_segfaults, 2, str(runs), timeout=60)
    assert sorted(runs.read_text().split()) == ["0", "1"]  # one run of each rank
