"""Faults during training on real megatron-core (CPU, gloo, 2 workers x 2 shards): what the
user sees when a worker stops arriving at a sync (nothing hangs for torch's 30
minutes, the message names the worker and the step)."""

import re

import pytest

from dist import RankError, run_ranks
from edit_runs import hung_worker_job


@pytest.mark.timeout(240)
def test_a_hung_worker_is_named_within_the_sync_timeout():
    """Worker 1 stops after step 2; warmup 1 and H 2 put a sync after step 3: worker 0 waits
    there 4 s (``--local-sgd-sync-timeout``), then stops with SyncTimeout naming worker 1."""
    local = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1, sync_timeout=4.0)
    with pytest.raises(RankError) as err:
        run_ranks(hung_worker_job, 4, local, 2, timeout=200)
    message = str(err.value)
    assert "SyncTimeout" in message, message[-2000:]
    # raised by the sync timeout (4 s), not by the process group's (run_ranks': 200 s)
    assert re.search(r"worker 0 waited \d+ s at the sync after its step 3", message), message[-2000:]
    assert "for worker 1 (global rank" in message and "--local-sgd-sync-timeout (4 s)" in message
