"""``python -m megatron_edit.plan``: its table and choice, and its refusals in one line."""

import subprocess
import sys

import pytest

from megatron_edit import plan as plan_cli


pytestmark = pytest.mark.one_lane  # (what megatron-core's release does not change)

def test_prints_the_exchange_time_and_the_flags(capsys):
    assert plan_cli.main(["--params", "137250", "--workers", "2", "--link-mbit", "27", "--step-ms", "43",
                          "--sync-interval", "8"]) == 0
    out = capsys.readouterr().out
    assert "fp32" in out and "162.7" in out  # 549 kB at 27 Mbit/s
    assert "--local-sgd-outer-step-delay 3 --local-sgd-fragments 2" in out
    assert "of the no-communication bound" in out


def test_several_formats_and_scientific_notation(capsys):
    assert plan_cli.main(["--params", "1.3e9", "--workers", "4", "--link-mbit", "1000", "--step-ms", "900",
                          "--sync-interval", "64", "--formats", "fp32,int8,int4"]) == 0
    out = capsys.readouterr().out
    assert "1,300,000,000 parameters" in out
    assert all(f in out for f in ("fp32", "int8", "int4"))
    assert "--local-sgd-exchange-dtype int8" in out  # fp32 (62 s) cannot be hidden under H/2 = 32 steps


@pytest.mark.parametrize("argv, fragment", [
    (["--workers", "2"], "required"),
    (["--params", "1e6", "--workers", "1", "--link-mbit", "10", "--step-ms", "10", "--sync-interval", "8"],
     "--workers must be >= 2"),
    (["--params", "1e6", "--workers", "2", "--link-mbit", "-1", "--step-ms", "10", "--sync-interval", "8"],
     "must be > 0"),
    (["--params", "1e6", "--workers", "2", "--link-mbit", "10", "--step-ms", "10", "--sync-interval", "8",
      "--formats", "fp32,int2"], "comma-separated list"),
    (["--params", "1e6", "--workers", "2", "--link-mbit", "10", "--step-ms", "10", "--sync-interv", "8"],
     "required: --sync-interval"),  # no prefix matching
])
def test_bad_input_is_one_line_exit_2(argv, fragment):
    out = subprocess.run([sys.executable, "-m", "megatron_edit.plan", *argv], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert fragment in out.stderr
    assert "Traceback" not in out.stderr


def test_the_error_is_one_line():
    out = subprocess.run([sys.executable, "-m", "megatron_edit.plan", "--params", "x"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
