"""Patching at the wrong time never leaves training silently synchronous, on
real megatron-core (CPU, gloo, 2 workers)."""

import pytest

from dist import run_ranks
from edit_runs import patch_order_job


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case,expected", [
    ("after-both", "was built before patch_megatron_for_local_sgd"),
    ("after-ddp", "the DDP model of this optimizer was built before"),
    ("again-other", "EDiT already runs on 1 distributed optimizer(s) built with other configs"),
])
def test_patching_at_the_wrong_time_is_refused_on_every_rank(case, expected):
    for result in run_ranks(patch_order_job, 2, case, timeout=200):
        assert result[0] == "refused" and expected in result[1], result


@pytest.mark.timeout(240)
def test_patching_again_with_the_same_configs_keeps_edit_running():
    for result in run_ranks(patch_order_job, 2, "again-same", timeout=200):
        assert result == ("ran", 1, 1)
