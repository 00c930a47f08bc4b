"""Megatron's checkpoint writers on CPU (megatron_edit.cpu.async_writer): the results queue of
every torch_dist save lives in a Manager forked from the rank, which ends with its rank."""

import os
import signal

import pytest

from dist import RankError, run_ranks


def _writer_queue(rank, world_size, folder, killed):
    """Megatron's torch_dist writer's results queue, as a save takes it (the adapter is active in
    the ranks); the pid of the process that holds it, and whether that is a fork of the rank."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    take = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
    config = multiprocessing.current_process()._config
    config["daemon"] = False  # a run_ranks rank is daemonic (a Megatron-LM rank is not)
    queue = take()
    queue.put(rank)
    assert queue.get() == rank
    (manager,) = multiprocessing.active_children()
    with open(os.path.join(folder, f"manager-{rank}"), "w") as f:
        f.write(str(manager.pid))
    if killed:
        os.kill(os.getpid(), signal.SIGKILL)
    return manager.pid, type(manager).__name__


def _ended(pid, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # ended, not yet reaped
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
@pytest.mark.timeout(120)
def test_the_writers_results_queue_is_a_fork_of_the_rank_and_ends_with_it_even_killed(tmp_path):
    """megatron-core spawns the Manager of its writer's results queue (a fresh interpreter that
    imports torch: 6-7 s a rank on 2 cores); on the CPU the adapter forks it from the rank. It
    ends when its rank returns, and when its rank is SIGKILLed (its parent-death signal), where
    a spawned one was left behind."""
    results = run_ranks(_writer_queue, 2, str(tmp_path), False, timeout=60)
    assert [kind for _, kind in results] == ["ForkProcess", "ForkProcess"]
    pids = [pid for pid, _ in results]
    assert len(set(pids)) == 2 and all(_ended(pid) for pid in pids)
    with pytest.raises(RankError, match="exited with code -9"):
        run_ranks(_writer_queue, 2, str(tmp_path), True, timeout=60)
    pids = [int((tmp_path / f"manager-{rank}").read_text()) for rank in range(2)]
    assert all(_ended(pid) for pid in pids)
