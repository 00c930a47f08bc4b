"""One worker thread per gloo process group under the CPU adapter: the way around torch's race on a
group's status (megatron_edit.cpu.gloo_threads, issue 62)."""

import datetime
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dist import run_ranks
from megatron_edit.cpu.gloo_threads import OneThreadGloo, threads_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _groups_and_threads(rank, world):
    """Threads of the default group, of Megatron's groups and of a group of the package's, then
    two coalesced all-gathers in flight on Megatron's data-parallel group (the pattern of the
    crash) and their numbers; then the adapter deactivated: a new group has torch's default."""
    from megatron.core import parallel_state as ps
    from megatron_edit.cpu import adapter as cpu_adapter

    ps.initialize_model_parallel()
    dp = ps.get_data_parallel_group()
    seen = {"default": threads_of(), "data-parallel": threads_of(dp),
            "model-parallel": threads_of(ps.get_model_parallel_group()),
            "new_group": threads_of(dist.new_group(timeout=datetime.timedelta(seconds=60)))}
    every = {threads_of(group) for group in list(c10d._world.pg_map)}  # every group of the process
    seen["every group"] = every.pop() if len(every) == 1 else sorted(every)
    assert isinstance(dp._get_backend(torch.device("cpu")), c10d.ProcessGroupGloo)
    outs = [torch.empty(2 * world) for _ in range(2)]
    handles = []
    for i, out in enumerate(outs):
        with dist._coalescing_manager(group=dp, async_ops=True) as cm:
            dist.all_gather_into_tensor(out, torch.full((2,), float(rank + 10 * i)), group=dp, async_op=True)
        handles.append(cm)
    for handle in handles:
        handle.wait()
    gathered = [out.tolist() for out in outs]
    cpu_adapter.deactivate()
    try:
        seen["after deactivate"] = threads_of(dist.new_group())
    finally:
        cpu_adapter.activate()
    ps.destroy_model_parallel()
    return seen, gathered


@pytest.mark.timeout(120)
def test_every_gloo_group_under_the_adapter_has_one_worker_thread_and_torch_s_default_comes_back():
    for seen, gathered in run_ranks(_groups_and_threads, 2, timeout=100):
        assert seen == {"default": 1, "data-parallel": 1, "model-parallel": 1, "new_group": 1,
                        "every group": 1, "after deactivate": 2}
        assert gathered == [[0.0, 0.0, 1.0, 1.0], [10.0, 10.0, 11.0, 11.0]]


def test_the_stand_in_builds_torch_s_group_with_its_devices_and_one_thread(monkeypatch):
    gloo = OneThreadGloo(c10d.ProcessGroupGloo)
    timeout = datetime.timedelta(seconds=7)
    pg = gloo(dist.HashStore(), 0, 1, timeout=timeout)
    assert isinstance(pg, c10d.ProcessGroupGloo) and isinstance(pg, gloo)
    assert (pg.options._threads, len(pg.options._devices), pg.options._timeout) == (1, 1, timeout)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")  # torch's constructor: one device per name
    assert len(gloo(dist.HashStore(), 0, 1, timeout=timeout).options._devices) == 2
    options = gloo._Options()  # explicit options are kept, with one thread
    options._devices, options._threads, options._timeout = [gloo.create_default_device()], 4, timeout
    assert gloo(dist.HashStore(), 0, 1, options).options._threads == 1
    assert gloo.create_default_device is c10d.ProcessGroupGloo.create_default_device
    if hasattr(options, "enable_reconfigure"):  # torch 2.15 builds its groups with it
        assert gloo(dist.HashStore(), 0, 1, timeout=timeout, enable_reconfigure=True).options.enable_reconfigure
    with pytest.raises(TypeError, match="no_such_setting="):
        gloo(dist.HashStore(), 0, 1, timeout=timeout, no_such_setting=1)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_reproducer_runs_clean_with_one_worker_thread_under_glibc_s_malloc_check():
    """scripts/dev/repro_gloo_crash.py with the way around: 3,000 iterations of 8 coalesced
    all-gathers in flight (torch's two threads crash there within seconds: results/native_crash.md)."""
    env = dict(os.environ, LD_PRELOAD="libc_malloc_debug.so.0", MALLOC_CHECK_="3", PYTHONFAULTHANDLER="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.join(REPO, "scripts", "dev", "repro_gloo_crash.py"), "--iters", "3000", "--one-thread"],
        env=env, capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 gloo worker thread(s): 0 wrong results" in out.stdout
