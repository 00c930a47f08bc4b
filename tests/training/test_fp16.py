"""fp16 with Megatron's dynamic loss scaling through pretrain_gpt.py (needs MEGATRON_LM_DIR, see
tests/training/test_megatron_lm.py; skipped with that message otherwise). The first steps
overflow at Megatron's initial loss scale and are skipped (``number of skipped iterations``);
each worker's skipped step still counts, the syncs come at the configured iterations and
(the replicas' equality after a sync: tests/mcore/test_skipped_step.py, which also puts an inf
into one rank of one worker only). Megatron's replica-hash check
(``--check-weight-hash-across-dp-replicas-interval``) is left out: with ``--fp16`` and
``--overlap-param-gather`` plain Megatron-LM core_v0.16.1 fails in it on its second check
(``KeyError: Float16Module`` in ``DistributedDataParallel.disable_forward_pre_hook``), without
megatron_edit's EDiT too."""

import re

import pytest

from test_megatron_lm import CHECKOUT, HAVE_CHECKOUT, HOW_TO_RUN, TINY, _lines, _synced_steps, _torchrun

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_CHECKOUT, reason=HOW_TO_RUN)]
H = 4


@pytest.mark.timeout(600)
def test_fp16_skipped_steps_count_and_the_workers_sync_on_the_grid(tmp_path):
    log = _torchrun(CHECKOUT / "pretrain_gpt.py", TINY + [
        "--fp16", "--no-masked-softmax-fusion", "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
        "--overlap-grad-reduce", "--overlap-param-gather", "--use-local-sgd", "--local-sgd-sync-interval",
        str(H), "--local-sgd-warmup-steps", "0", "--train-iters", "12",
        ], tmp_path)
    lines = _lines(log)
    assert sorted(lines) == list(range(1, 13)), sorted(lines)
    skipped = [i for i, line in lines.items()
               if int(re.search(r"number of skipped iterations:\s+(\d+)", line).group(1))]
    assert skipped, "the initial loss scale overflowed no step: nothing was tested"
    assert _synced_steps(log) == [4, 8, 12]
