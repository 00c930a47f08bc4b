"""Faults during training on real megatron-core (CPU, gloo, 2 workers x 2 shards): what the
user sees when a worker stops arriving at a sync (nothing hangs for torch's 30 minutes, the
message names the worker, its ranks and the step)."""

import re

import pytest

from dist import RankError, run_ranks
from edit_runs import hung_worker_job


@pytest.mark.one_lane  # the arrival check (megatron_edit.exchange.arrival), not a release's hooks
@pytest.mark.timeout(240)
def test_a_hung_rank_and_the_worker_it_holds_up_are_named_within_the_sync_timeout():
    """Global rank 2 (worker 1's first rank) stops after step 2; rank 3 waits for it in worker
    1's own collectives. Warmup 1 and H 2 put a sync after step 3: worker 0's ranks wait there
    4 s (``--local-sgd-sync-timeout``), then stop with SyncTimeout naming worker 1 and both of
    its ranks, in one line (before: rank 1 named only global rank 3, which was healthy)."""
    local = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1, sync_timeout=4.0)
    with pytest.raises(RankError) as err:
        run_ranks(hung_worker_job, 4, local, 2, hung_ranks=(2,), timeout=200)
    message = str(err.value)
    assert "SyncTimeout" in message, message[-2000:]
    # raised by the sync timeout (4 s), not by the process group's (run_ranks': 200 s)
    line = re.search(r"SyncTimeout: (megatron_edit: [^\n]*)", message).group(1)
    assert line.startswith("megatron_edit: sync 1 (after step 3): worker 1 (global ranks 2, 3) did not "
                           "arrive within --local-sgd-sync-timeout (4 s; worker 0 waited "), line
