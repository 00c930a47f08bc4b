"""The debug check of asynchronous collectives (megatron_edit.cpu.collective_guard, issue 62).

In one gloo process (a world of one: every collective completes at once, so what trips is the
order of calls, never timing): a storage resized, or an input written, before the collective's
wait trips; after the wait nothing does; coalesced collectives are followed to their manager's
wait; the adapter takes the guard out on deactivate. The guard's finds in Megatron-FSDP's step
(EDiT wrote the model weights while the step's prefetch still read them) are held by the
Megatron-FSDP tests, which the harness runs with the guard on.
"""

import pytest
import torch

from dist import run_ranks


def _guarded(rank, world_size):
    import os

    import torch.distributed as dist
    from torch.distributed import _coalescing_manager

    from megatron_edit.cpu import adapter, collective_guard as guard

    assert os.environ.get(guard.ENV) == "1"  # the harness runs every rank under the guard
    seen = {}

    def trips(action):
        try:
            action()
        except guard.CollectiveHazard as e:
            return str(e).splitlines()[0]
        return None

    out = torch.zeros(8)
    work = dist.all_gather_into_tensor(out, torch.ones(8), async_op=True)
    seen["in_flight"] = guard.in_flight()
    seen["resize"] = trips(lambda: out.untyped_storage().resize_(0))
    work.wait()
    seen["after_wait"] = guard.in_flight()
    seen["resize_after_wait"] = trips(lambda: out.untyped_storage().resize_(0))

    source, out = torch.ones(8), torch.zeros(8)
    work = dist.all_gather_into_tensor(out, source, async_op=True)
    source.add_(1)
    seen["written"] = trips(work.wait)

    # an in-place gather (the input a view of the output, as Megatron's buckets): not a write
    out = torch.zeros(8)
    dist.all_gather_into_tensor(out, out[:8], async_op=True).wait()
    seen["in_place"] = guard.in_flight()

    a, b = torch.zeros(4), torch.zeros(4)
    with _coalescing_manager(None, async_ops=True) as cm:
        dist.all_gather_into_tensor(a, torch.ones(4))
        dist.all_gather_into_tensor(b, torch.ones(4))
    seen["coalesced"] = trips(lambda: b.untyped_storage().resize_(0))
    cm.wait()
    seen["coalesced_after_wait"] = guard.in_flight()

    synchronous = torch.ones(4)
    dist.all_reduce(synchronous)  # waited inside the call
    seen["synchronous"] = guard.in_flight()

    adapter.deactivate()
    seen["patched_after_deactivate"] = dist.ProcessGroup.allreduce.__name__ == "collective"
    return seen


@pytest.mark.timeout(120)
def test_a_buffer_freed_or_written_before_the_wait_trips_at_once():
    seen = run_ranks(_guarded, 1, timeout=100)[0]
    assert seen["in_flight"] == 1
    assert "resized to 0 while all_gather" in seen["resize"]
    assert seen["after_wait"] == 0 and seen["resize_after_wait"] is None
    assert "an input was written while the collective was in flight" in seen["written"]
    assert seen["in_place"] == 0
    assert "resized to 0 while all_gather_single_coalesced" in seen["coalesced"]
    assert seen["coalesced_after_wait"] == 0
    assert seen["synchronous"] == 0
    assert seen["patched_after_deactivate"] is False
