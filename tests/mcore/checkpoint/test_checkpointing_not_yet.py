"""Before megatron-core 0.16, checkpointing an EDiT optimizer is refused with a clear message
(megatron_edit.mcore.checkpoint.NOT_YET), never written without the EDiT state."""

import pytest

from dist import run_ranks
from megatron_edit.mcore import checkpoint as checkpointing, compat


def _save_attempts(rank, world_size):
    import megatron_edit as me
    from edit_runs import _build, default_spec
    from gpt_utils import init_parallel_state
    from megatron_edit.config import NotSupportedYet

    init_parallel_state(num_distributed_optimizer_instances=2)
    me.patch_megatron_for_local_sgd(me.LocalSGDConfig(local_sgd_sync_interval=2))
    ddp, opt = _build(default_spec(instances=2), 1, 1)
    messages = []
    for attempt in (lambda: opt.state_dict(), lambda: opt.sharded_state_dict(ddp.module.sharded_state_dict())):
        try:
            attempt()
        except NotSupportedYet as e:
            messages.append(str(e))
    me.unpatch_megatron_for_local_sgd()
    return messages


@pytest.mark.skipif(not checkpointing.NOT_YET.contains(compat.megatron_core_version()),
                    reason=f"EDiT checkpoints are supported on megatron-core {checkpointing.SUPPORTED}")
@pytest.mark.timeout(120)
def test_checkpointing_edit_is_refused_before_0_16():
    for messages in run_ranks(_save_attempts, 4, timeout=100):
        assert len(messages) == 2
        assert all(f"needs megatron-core {checkpointing.SUPPORTED}" in m for m in messages)
        assert all(compat.megatron_core_version() in m for m in messages)
