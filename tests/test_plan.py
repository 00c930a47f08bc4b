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
      "--formats", "fp32,int2"], "write topk<density>-int2, e.g. topk0.02-int2"),
    (["--params", "1e6", "--workers", "2", "--link-mbit", "10", "--step-ms", "10", "--formats", "topk1.5-int2"],
     "density in (0, 1]"),
    (["--params", "1e6", "--workers", "2", "--link-mbit", "10", "--step-ms", "10", "--formats", "topk0.02-bf16"],
     "values one of fp32, int8, int4, int2"),
    (["--params", "1e6", "--workers", "40", "--link-mbit", "10", "--step-ms", "10", "--formats", "topk0.02-int2"],
     "--formats topk0.02-int2 with --workers 40: the top-k all-gather"),
    (["--params", "1e6", "--workers", "2", "--link-mbit", "10", "--step-ms", "10", "--sync-interv", "8"],
     "unrecognized arguments: --sync-interv"),  # no prefix matching
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


def _flags(line):
    flags = line.split(": ", 1)[1].split()
    return dict(zip(flags[0::2], flags[1::2]))


def test_the_top_k_exchange_is_a_format_and_its_flags_are_a_valid_config(capsys):
    """1.3B parameters, 4 workers, 100 Mbit/s, 500 ms steps, H = 32: before, the answer was int4 at
    0.29 of the bound (not hidden); with the top-k exchange allowed it is hidden, and the printed
    flags are a configuration the package accepts. Its time is the all-gather of the W - 1 other
    workers' payloads (megatron_edit.exchange.sparse), against 2 (W - 1) / W of fp32's bytes."""
    from megatron_edit.algorithm import topk
    from megatron_edit.config import LocalSGDConfig

    assert plan_cli.main(["--params", "1.3e9", "--workers", "4", "--link-mbit", "100", "--step-ms", "500",
                          "--sync-interval", "32", "--formats", "fp32,int4,topk0.02-int2"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in
            ("fp32", "int4", "topk0.02-int2")}
    payload = topk.encoded_bytes(1_300_000_000, 0.02, 4096, "int2")
    assert float(rows["topk0.02-int2"][1]) == pytest.approx(3 * payload / (100e6 / 8) * 1e3, abs=0.1)
    assert float(rows["fp32"][1]) == pytest.approx(2 * 3 / 4 * 4 * 1.3e9 / (100e6 / 8) * 1e3, abs=0.1)
    choice = next(line for line in out.splitlines() if line.startswith("choice:"))
    assert "topk0.02-int2" in choice and "(not hidden)" not in choice
    values = _flags(next(line for line in out.splitlines() if line.startswith("flags:")))
    config = LocalSGDConfig(local_sgd_sync_interval=int(values["--local-sgd-sync-interval"]),
                            exchange_dtype=values["--local-sgd-exchange-dtype"],
                            exchange_topk_density=float(values["--local-sgd-exchange-topk-density"]),
                            outer_step_delay=int(values["--local-sgd-outer-step-delay"]),
                            fragments=int(values["--local-sgd-fragments"]))
    assert config.exchange_dtype == "int2" and config.error_feedback
    # chosen while the job runs too (issue 60): the line's flags are a configuration the package accepts
    auto = next(line for line in out.splitlines() if line.startswith("or chosen while the job runs"))
    values = _flags(auto.replace("--local-sgd-auto-overlap ", ""))
    assert values["--local-sgd-auto-formats"] == "fp32,int4,topk0.02-int2"
    config = LocalSGDConfig(local_sgd_sync_interval=config.local_sgd_sync_interval, auto_overlap=True,
                            auto_formats=values["--local-sgd-auto-formats"],
                            auto_fragments=values["--local-sgd-auto-fragments"],
                            exchange_dtype=values["--local-sgd-exchange-dtype"],
                            exchange_topk_density=float(values["--local-sgd-exchange-topk-density"]),
                            outer_step_delay=int(values["--local-sgd-outer-step-delay"]),
                            fragments=int(values["--local-sgd-fragments"]))
    assert config.start_format == "topk0.02-int2" and config.error_feedback


def test_without_an_interval_it_answers_the_smallest_that_hides_the_exchange(capsys):
    """The H printed hides the exchange and H - 1 does not (the same model, asked directly), and
    each format's row says from which H it alone is hidden; the loss line gives what the
    convergence benchmark measured nearest to it."""
    from megatron_edit.algorithm.overlap_plan import choose, format_seconds

    formats = ["fp32", "int4", "topk0.03-int2"]
    assert plan_cli.main(["--params", "1.3e9", "--workers", "4", "--link-mbit", "100", "--step-ms", "500",
                          "--formats", ",".join(formats)]) == 0
    out = capsys.readouterr().out
    h = int(out.splitlines()[0].split("H = ")[1].split()[0])
    assert "(the smallest that hides it)" in out.splitlines()[0]
    times = format_seconds(1_300_000_000, 4, 100e6, formats)
    assert choose(0.5, times, h, formats).hidden and not choose(0.5, times, h - 1, formats).hidden
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.split() and line.split()[0] in formats}
    for fmt, first in rows.items():
        first = int(first)
        assert choose(0.5, times, first, [fmt]).hidden and not choose(0.5, times, first - 1, [fmt]).hidden, fmt
    assert int(rows["topk0.03-int2"]) == h
    assert f"--local-sgd-sync-interval {h} " in out
    assert "loss: not measured at H = 44 with topk0.03-int2; at H = 32 it ended +9.54%" in out


def test_a_format_no_interval_hides_says_so_in_one_line(capsys):
    assert plan_cli.main(["--params", "7e9", "--workers", "4", "--link-mbit", "1", "--step-ms", "100"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("no H up to 4096 hides the exchange") and out.count("\n") == 0


def test_the_issues_example_dense_only_answers_the_smallest_larger_h_with_its_measured_loss(capsys):
    """1.3B parameters at 100 Mbit/s, 500 ms steps, H = 32 in the dense formats: not hidden (int4
    needs H >= 196); the planner names the smallest larger H that hides it, its flags and the
    loss measured nearest to it; with the top-k exchange allowed H = 32 itself is hidden."""
    argv = ["--params", "1.3e9", "--workers", "4", "--link-mbit", "100", "--step-ms", "500", "--sync-interval", "32"]
    assert plan_cli.main(argv + ["--formats", "fp32,int8,int4"]) == 0
    out = capsys.readouterr().out
    assert "(not hidden)" in next(line for line in out.splitlines() if line.startswith("choice:"))
    assert ("the smallest larger H that hides it: --local-sgd-sync-interval 196 --local-sgd-exchange-dtype int4 "
            "--local-sgd-outer-step-delay 97 --local-sgd-fragments 2") in out
    assert "loss: not measured at H = 196 with int4; at H = 8 it ended +4.93%" in out
    assert plan_cli.main(argv + ["--formats", "fp32,int8,int4,topk0.02-int2"]) == 0
    out = capsys.readouterr().out
    choice = next(line for line in out.splitlines() if line.startswith("choice:"))
    assert "topk0.02-int2" in choice and "(not hidden)" not in choice and "smallest larger H" not in out
    # 2% was not measured: the densities measured with int2 values, at the H nearest to 32
    assert "loss: not measured for topk0.02-int2; at H = 32 topk0.03-int2 ended +9.54% and topk0.01-int2 +10.98%" in out
    assert "delay: not measured at tau = 14 with 2 fragment(s) (H = 32); measured at H = 8" in out


def test_the_latency_is_paid_per_message_of_each_buckets_collective(capsys):
    """--latency-ms: 1.3B parameters are 33 of Megatron's 40M buckets (or --buckets); each
    bucket's ring all-reduce waits for 2 (W - 1) = 6 messages in a row, the top-k all-gather
    for W - 1 = 3; the smallest H grows with it."""
    argv = ["--params", "1.3e9", "--workers", "4", "--link-mbit", "100", "--step-ms", "500",
            "--formats", "fp32,topk0.02-int2"]

    def rows(extra):
        assert plan_cli.main(argv + extra) == 0
        out = capsys.readouterr().out
        return out, {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
                     if line.split() and line.split()[0] in ("fp32", "topk0.02-int2")}

    plain_out, plain = rows([])
    slow_out, slow = rows(["--latency-ms", "20"])
    assert slow["fp32"] - plain["fp32"] == pytest.approx(33 * 6 * 20, abs=0.2)
    assert slow["topk0.02-int2"] - plain["topk0.02-int2"] == pytest.approx(33 * 3 * 20, abs=0.2)
    assert "100 Mbit/s (20 ms latency)" in slow_out
    h = [int(out.splitlines()[0].split("H = ")[1].split()[0]) for out in (plain_out, slow_out)]
    assert h[1] > h[0]
    _, one = rows(["--latency-ms", "20", "--buckets", "1"])
    assert one["fp32"] - plain["fp32"] == pytest.approx(6 * 20, abs=0.2)


def test_the_search_stops_at_the_largest_h_allowed(capsys):
    assert plan_cli.main(["--params", "1.3e9", "--workers", "4", "--link-mbit", "100", "--step-ms", "500",
                          "--formats", "int4", "--max-sync-interval", "100"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("no H up to 100 hides the exchange") and "raise --max-sync-interval" in out
    assert plan_cli.main(["--params", "1.3e9", "--workers", "4", "--link-mbit", "100", "--step-ms", "500",
                          "--formats", "int4", "--sync-interval", "64", "--max-sync-interval", "150"]) == 0
    assert "no H from 64 up to 150 hides it in these formats" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--latency-ms", "-1"], "argument --latency-ms: must be >= 0, got -1"),
    (["--buckets", "0"], "argument --buckets: must be > 0, got 0"),
    (["--max-sync-interval", "2.5"], "argument --max-sync-interval: '2.5' is not a whole number"),
    (["--sync-interval", "64", "--max-sync-interval", "32"],
     "--sync-interval 64 is above --max-sync-interval 32: raise --max-sync-interval"),
])
def test_the_new_options_refuse_bad_input_in_one_line(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        plan_cli.main(["--params", "1e6", "--workers", "2", "--link-mbit", "10", "--step-ms", "10", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and fragment in err and err.count("\n") == 1, err


def test_the_answer_on_the_hiding_page_is_what_the_planner_prints(capsys):
    """docs/benchmarks/hiding.md, "What the planner answers": its runnable command's printed
    output is the one pasted under it."""
    import re
    import shlex
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "hiding.md").read_text()
    section = page.split("## What the planner answers", 1)[1]
    command, printed = re.search(r"```bash\n# runnable\n(.+?)\n```\n\n```text\n(.*?)```", section, re.S).groups()
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "megatron_edit.plan"]
    assert plan_cli.main(argv[3:]) == 0
    assert capsys.readouterr().out == printed
