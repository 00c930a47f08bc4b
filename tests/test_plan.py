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


def test_the_auto_flags_start_from_the_choice_and_are_a_valid_config(capsys):
    """The printed --local-sgd-auto-overlap line starts where the plan chose (2 fragments, delay
    3) and is a configuration the package accepts (the fragments allowed include the start)."""
    from megatron_edit.config import LocalSGDConfig

    assert plan_cli.main(["--params", "137250", "--workers", "2", "--link-mbit", "27", "--step-ms", "43",
                          "--sync-interval", "8", "--formats", "fp32,int8"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if "--local-sgd-auto-overlap" in l)
    flags = line.split(": ", 1)[1].split()
    values = dict(zip(flags[1::2], flags[2::2]))
    assert flags[0] == "--local-sgd-auto-overlap" and values["--local-sgd-auto-fragments"] == "1,2"
    assert (values["--local-sgd-outer-step-delay"], values["--local-sgd-fragments"]) == ("3", "2")
    config = LocalSGDConfig(local_sgd_sync_interval=8, auto_overlap=True,
                            auto_formats=values["--local-sgd-auto-formats"],
                            auto_fragments=values["--local-sgd-auto-fragments"],
                            exchange_dtype=values["--local-sgd-exchange-dtype"],
                            outer_step_delay=int(values["--local-sgd-outer-step-delay"]),
                            fragments=int(values["--local-sgd-fragments"]))
    assert config.allowed_fragments == (1, 2) and config.outer_step_delay == 3


def test_no_auto_line_that_would_fail_when_pasted(capsys):
    """H = 1 leaves no room for a delay: before, the line printed an empty
    --local-sgd-auto-fragments, which fails when pasted."""
    assert plan_cli.main(["--params", "1.3e9", "--workers", "4", "--link-mbit", "100", "--step-ms", "500",
                          "--sync-interval", "1"]) == 0
    out = capsys.readouterr().out
    assert "--local-sgd-auto-fragments  " not in out and "--local-sgd-auto-overlap --local-sgd-auto-formats" not in out
    assert "not chosen while the job runs: --local-sgd-auto-overlap needs" in out


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
