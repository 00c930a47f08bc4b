"""scripts/example_checkpoint.py, the README's save / resume example for megatron-core alone,
runs as written (torchrun, 4 CPU processes) and resumes exactly."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edit_runs import ON_FSDP_RELEASE
from megatron_edit.mcore import checkpoint as checkpointing, compat

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.one_lane
@pytest.mark.timeout(300)
@pytest.mark.skipif(not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
                    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
# (Megatron-FSDP's: slow, CI time, 30 s; its checkpoints are tests/mcore/checkpoint/test_checkpointing_fsdp.py's)
@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=[ON_FSDP_RELEASE, pytest.mark.slow])],
                         ids=["ddp", "megatron-fsdp"])
def test_the_save_and_resume_example_runs_and_resumes_exactly(tmp_path, fsdp):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "localhost:0", str(ROOT / "scripts" / "example_checkpoint.py"),
               "--dir", str(tmp_path / "ckpt")] + (["--megatron-fsdp"] if fsdp else [])
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the example did not end within 240 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    assert "resume exact: yes" in out and "step 10: loss" in out, out[-3000:]
    assert "FutureWarning" not in out
    # Before: the result buried in 75 lines (megatron-core's notes that TE / Apex are absent,
    # the package's own "the run's length is unknown" about its own example)
    assert out.strip().splitlines()[-1] == "resume exact: yes", out[-3000:]
    assert "not installed" not in out and "the run's length is unknown" not in out, out[-3000:]
    # (Megatron-FSDP warns of its own prefetched all-gathers still pending at the save)
    assert fsdp or "UserWarning" not in out, out[-3000:]
