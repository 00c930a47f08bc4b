"""The fault matrix: what a user of EDiT sees when a rank dies, hangs, writes a bad
number, or a checkpoint is damaged, and whether anything is lost.

    python scripts/fault_matrix.py [--rows kill-between,nan-fp32,...] [--out scripts/bench/results/fault_matrix.md]

Each row starts fresh processes (``torchrun --nproc_per_node 4 scripts/fault_job.py``: EDiT on
megatron-core, 2 workers x 2 shards, CPU over gloo, 12 steps, syncs after steps 5, 8, 11 and 12)
with a hard time limit, and checks the outcome against an uninterrupted reference run of the same
job: a killed job is resumed from its last complete checkpoint and must then give the reference's
losses exactly. Prints a Markdown table (fault, what the user sees, seconds from the fault until
the job ended, whether anything was lost) and exits 1 when a row does not hold. About 8-10
minutes on 2 loaded cores.
"""

import argparse
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "scripts" / "fault_job.py"
LIMIT = 240  # seconds a run may take before it is killed (a hang the job did not end itself)


RUN_MARK = "MEGATRON_EDIT_FAULT_MATRIX_RUN"
"""Environment variable every process of a run inherits (its value: the run's own), so that
whatever the run leaves behind can be found and ended (:func:`end_the_run`)."""


def end_the_run(mark: str) -> None:
    """SIGKILL every process whose environment carries ``RUN_MARK=mark``. torchrun starts each
    rank in a session of its own, and a SIGKILLed rank leaves its multiprocessing children (the
    manager dist_checkpointing's save starts with spawn, about 330 MB, and the resource tracker)
    reparented away from torchrun: neither torchrun's exit nor a kill of its process group
    reaches them (before: two processes left per kill row). Linux (/proc)."""
    kill_marked(mark)


def marked_processes(mark: str, cmdline: bytes = b""):
    """(pid, its environment's entries) of every live process whose environment carries
    ``RUN_MARK=mark`` and whose command line holds ``cmdline`` (its arguments joined by NUL
    bytes, and one after the last)."""
    needle = f"{RUN_MARK}={mark}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if needle not in env:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read() + b"\0"
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:  # gone, or another user's
            continue
        if cmdline in line and not zombie:
            found.append((int(pid), env))
    return found


def kill_marked(mark: str, cmdline: bytes = b"") -> int:
    """SIGKILL every process of :func:`marked_processes`; returns how many."""
    killed = 0
    for pid, _ in marked_processes(mark, cmdline):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def run(dir_, *argv, limit=LIMIT):
    """(exit code, output, seconds from the fault to the end or None, RESULT dict or None)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "localhost:0", str(JOB), "--dir", str(dir_), *argv]
    # Output to a file, not a pipe: helper processes of a killed rank (the checkpoint writer's)
    # can outlive torchrun and keep a pipe open; what ends the run is torchrun's exit.
    log = Path(dir_) / "output.log"
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, **{RUN_MARK: mark})
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
        try:
            proc.wait(timeout=limit)
            note = ""
        except subprocess.TimeoutExpired:
            note = f"\n[fault_matrix: killed after {limit} s]"
        end = time.time()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the run is left in its session
        except ProcessLookupError:
            pass
        proc.wait()
        end_the_run(mark)  # and what left it (the ranks' own sessions, orphaned helpers)
    out = log.read_text() + note
    fault_at = Path(dir_) / "fault_at"
    seconds = end - float(fault_at.read_text()) if fault_at.exists() else None
    if fault_at.exists():
        fault_at.unlink()
    result = None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    return proc.returncode, out, seconds, result


MAIN_JOB = ROOT / "scripts" / "train_gpt_edit.py"


def kill_worker(mark: str, worker: int) -> int:
    """SIGKILL every process of the run ``mark`` that belongs to torchft worker ``worker``'s job
    (its launcher and its ranks: their command lines carry ``--local-sgd-replica-id worker``),
    as when its node dies. Returns how many were killed."""
    return kill_marked(mark, f"--local-sgd-replica-id\0{worker}\0".encode())


def run_torchft(dir_, *argv, kill=None, limit=LIMIT):
    """The main job with ``--local-sgd-sync-backend torchft`` (its supervisor, a Lighthouse and
    one job per worker). ``kill``: (worker, regex): SIGKILL that worker's job once the output
    matches. Returns (exit code, output, time of the kill or None, {line: the time it was first
    seen}) (the output is polled every 0.1 s)."""
    command = [sys.executable, str(MAIN_JOB), "--local-sgd-sync-backend", "torchft",
               "--data-dir", str(Path(dir_).parent / "data"), *argv]
    log = Path(dir_) / "output.log"
    mark = f"{os.getpid()}-{time.monotonic_ns()}"
    seen, killed_at = {}, None
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, **{RUN_MARK: mark}))
        deadline = time.monotonic() + limit
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            now, text = time.time(), log.read_text()
            for line in text.splitlines():
                seen.setdefault(line.strip(), now)
            if kill and killed_at is None and re.search(kill[1], text):
                if kill_worker(mark, kill[0]):
                    killed_at = time.time()
        note = "" if proc.poll() is not None else f"\n[fault_matrix: stopped after {limit} s]"
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the supervisor stops its worker jobs
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        end_the_run(mark)
        proc.wait()
    return proc.returncode, log.read_text() + note, killed_at, seen


def first_error(out: str) -> str:
    """The line a user reads first: the package's message, or torchrun's about a dead rank."""
    for pattern in (r"(megatron_edit: sync \d+ \(after step \d+\): [^\n]+)", r"(SyncTimeout: [^\n]+)", r"(megatron_edit\.\w+(?:\.\w+)*\.\w+: megatron_edit: [^\n]+)",
                    r"(\w+Error: megatron_edit: [^\n]+)", r"(megatron_edit: [^\n]+)", r"(exitcode\s*:\s*-9[^\n]*)",
                    r"(Signal 9 \(SIGKILL\)[^\n]*)", r"(\w+Error: [^\n]+)"):
        m = re.search(pattern, out)
        if m:
            return m.group(1).strip()[:220]
    return out.strip().splitlines()[-1][:160] if out.strip() else ""


def dead_rank(out: str):
    m = re.search(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*-9", out)
    return int(m.group(1)) if m else None


def same_losses(a: dict, b: dict, steps) -> bool:
    return all(a.get(str(s)) == b.get(str(s)) for s in steps)


def garble_record(path: Path) -> None:
    """Overwrite the stored bytes of the EDiT run record (``local_sgd.record``)."""
    meta = pickle.loads((path / ".metadata").read_bytes())
    (index,) = [k for k in meta.storage_data if k.fqn.startswith("local_sgd.record")]
    info = meta.storage_data[index]
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00garbage" * (info.length // 8) + b"\x00" * (info.length % 8))


def truncate_data(path: Path) -> str:
    """Cut the largest data file of a checkpoint in half; returns its name."""
    target = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size // 2)
    return target.name


ROWS = ("kill-between", "kill-exchange", "kill-save", "hang",
        *(f"nan-{dtype}{excluded}" for dtype in ("fp32", "int8", "int4") for excluded in ("", "-excluded")),
        "elastic-2-to-4-int8-penalty", "elastic-2-to-1-int8-penalty", "garbled-record", "truncated-file",
        "torchft-kill-between", "torchft-node-dies")
"""Every row's name, in the order the matrix runs them."""


class Matrix:
    """The rows run so far (each printed as it ends), the folder their runs go under, the rows
    asked for (None: all), and the uninterrupted reference run, run once when a row first needs
    it."""

    def __init__(self, root: Path, wanted):
        self.root, self.wanted = root, wanted
        self.rows, self.failed = [], 0
        self.ref_dir = root / "reference"
        self._reference = None

    def wants(self, name: str) -> bool:
        return not self.wanted or name in self.wanted

    def row(self, name, fault, seen, seconds, lost, ok) -> None:
        self.failed += not ok
        self.rows.append((name, fault, seen, "-" if seconds is None else f"{seconds:.1f}", lost,
                          "yes" if ok else "**NO**"))
        print(f"[{name}] {'holds' if ok else 'DOES NOT HOLD'}: {seen}", flush=True)

    def reference(self) -> dict:
        """The uninterrupted run (saving at 4, 8, 12), run once when a row first needs it."""
        if self._reference is None:
            self.ref_dir.mkdir()
            code, out, _, result = run(self.ref_dir, "--save-interval", "4")
            if code != 0 or result is None:
                raise SystemExit(f"the reference run failed:\n{out[-3000:]}")
            self._reference = result
        return self._reference


def kill_rows(m: Matrix) -> None:
    """A rank SIGKILLed between syncs, during an exchange, inside a save: the resume is exact."""
    for kind, step, what in (("kill-between", 6, "rank 1 SIGKILLed between syncs (after step 6)"),
                             ("kill-exchange", 5, "rank 1 SIGKILLed while the layer-wise exchange of the sync after step 5 is in flight"),
                             ("kill-save", 8, "rank 1 SIGKILLed inside the save of step 8 (data written, not finalized)")):
        if not m.wants(kind):
            continue
        d = m.root / kind
        d.mkdir()
        code, out, seconds, _ = run(d, "--save-interval", "4", "--fault", kind, "--fault-step", str(step))
        latest = int((d / "latest").read_text()) if (d / "latest").exists() else None
        code2, out2, _, res = run(d, "--save-interval", "4", "--load")
        exact = (code2 == 0 and res is not None and latest is not None
                 and same_losses(res["losses"], m.reference()["losses"], range(latest + 1, 13)))
        ok = code != 0 and dead_rank(out) == 1 and latest == 4 and exact and seconds is not None and seconds < 120
        seen = (f"torchrun: rank {dead_rank(out)} exitcode -9; latest checkpoint: iteration {latest}"
                + ("" if kind != "kill-save" else " (iter_8 not finalized, never picked)"))
        lost = f"nothing: resumed from {latest}, steps {latest + 1}-12 equal the uninterrupted run" if exact else "resume NOT exact"
        m.row(kind, what, seen, seconds, lost, ok)


def hang_row(m: Matrix) -> None:
    """A rank that stops arriving: the sync timeout ends the job with one line."""
    if not m.wants("hang"):
        return
    d = m.root / "hang"
    d.mkdir()
    code, out, seconds, _ = run(d, "--fault", "hang", "--fault-rank", "2", "--sync-timeout", "10")
    msg = first_error(out)
    ok = (code != 0 and "worker 1 (global rank" in out and "did not arrive within --local-sgd-sync-timeout" in out
          and seconds is not None and seconds < 200)
    m.row("hang", "rank 2 (worker 1) stops arriving before its step 6; --local-sgd-sync-timeout 10",
          msg, seconds, "nothing trained after the last checkpoint is lost beyond what a restart costs", ok)


def nan_rows(m: Matrix) -> None:
    """NaN in a worker's parameters, each exchange format: stopped at the sync, or excluded."""
    for dtype in ("fp32", "int8", "int4"):
        for skip in (False, True):
            name = f"nan-{dtype}" + ("-excluded" if skip else "")
            if not m.wants(name):
                continue
            d = m.root / name
            d.mkdir()
            flags = ["--fault", "nan", "--fault-rank", "2", "--exchange-dtype", dtype] + (["--skip-anomaly"] if skip else [])
            code, out, seconds, res = run(d, *flags)
            if skip:
                excluded = res and any(ex and any(ex[1]) for step, ex in res["reports"] if step == 8)
                ok = code == 0 and res is not None and res["finite"] and bool(excluded)
                m.row(name, f"NaN in worker 1's parameters after step 6, {dtype} exchange, anomaly elimination on",
                      "worker 1 excluded at the sync after step 8; training goes on" if ok else first_error(out),
                      None, "nothing: finite parameters on every worker", ok)
            else:
                ok = code != 0 and "of worker 1 is not finite" in out and "after step 8" in out
                m.row(name, f"NaN in worker 1's parameters after step 6, {dtype} exchange, anomaly elimination off",
                      first_error(out), None, "nothing reached the anchor; resume from the last checkpoint", ok)


def elastic_rows(m: Matrix) -> None:
    """Elastic resume of a run with the int8 exchange (error feedback) and the penalty on:
    saved by 2 workers at the sync after step 8, resumed by another number of workers."""
    for workers in (4, 1):
        name = f"elastic-2-to-{workers}-int8-penalty"
        if not m.wants(name):
            continue
        d = m.root / name
        d.mkdir()
        flags = ["--exchange-dtype", "int8", "--penalty"]
        code, out, _, saved = run(d, "--save-interval", "8", "--steps", "8", *flags)
        code2, out2, _, res = run(d, "--load", "--workers", str(workers), "--edit-log-lines", *flags)
        resumed = re.search(r"resumed EDiT at step 8, (\d) worker\(s\), from a checkpoint of 2 worker\(s\)[^:]*: (.*)", out2)
        finite = res is not None and res["finite"] and all(v == v and abs(v) < 1e3 for v in res["losses"].values())
        ok = (code == 0 and code2 == 0 and resumed is not None and int(resumed.group(1)) == workers
              and finite and sorted(int(k) for k in res["losses"]) == list(range(9, 13)))
        m.row(name, f"saved by 2 workers (int8 exchange with error feedback, penalty on) at the sync after "
              f"step 8, resumed by {workers}", (resumed.group(0).strip() if resumed else first_error(out2 or out)),
              None, "nothing: the saved anchor, outer state and error-feedback residuals carried (their sum "
              "shared out), steps 9-12 train with finite losses" if ok else "resume FAILED", ok)


def damage_rows(m: Matrix) -> None:
    """A damaged checkpoint (its EDiT record garbled, a data file cut short) is refused."""
    for name, damage, expect in (("garbled-record", garble_record, "EDiT record of checkpoint"),
                                 ("truncated-file", truncate_data, "is damaged: __")):
        if not m.wants(name):
            continue
        d = m.root / name
        m.reference()
        shutil.copytree(m.ref_dir, d)
        (d / "fault_at").unlink(missing_ok=True)
        what = damage(d / "iter_12")
        code, out, _, _ = run(d, "--load")
        msg = first_error(out)
        ok = code != 0 and expect in msg
        m.row(name, f"checkpoint damaged ({name}{': ' + what if isinstance(what, str) else ''}), then resumed", msg,
              None, "the damaged checkpoint is refused; earlier ones load", ok)


def torchft_kill_row(m: Matrix) -> None:
    """--local-sgd-sync-backend torchft: each worker its own job. Worker 1's job is SIGKILLed
    (every process of it, as when its node dies) after its step 16; nothing else restarts. The
    run is long enough (600 steps) for the relaunched job to start and heal before the survivor
    ends it on a loaded machine (a relaunch took 62 s at load 9)."""
    if not m.wants("torchft-kill-between"):
        return
    d = m.root / "torchft-kill-between"
    d.mkdir()
    steps, h = 600, 8
    code, out, killed_at, seen = run_torchft(
        d, "--steps", str(steps), "--local-sgd-sync-interval", str(h), "--log-interval", str(h),
        "--eval-interval", str(steps), kill=(1, r"step\s+16 \| worker 1 loss"), limit=3 * LIMIT)
    healed = re.search(r"worker 1 rank 0 joined a running job: healed from a live worker to step (\d+)", out)
    survivor = [int(s) for s in re.findall(r"step\s+(\d+) \| worker 0 loss", out)]
    alone = [(line, t) for line, t in seen.items()
             if re.match(r"worker 0 sync \d+ after step \d+: .*\(1 workers\)", line)]
    first_alone = min((t for _, t in alone), default=None)
    back = healed and min((t for line, t in seen.items()
                           if re.match(rf"worker 1 sync \d+ after step {int(healed.group(1)) + h}:", line)),
                          default=None)
    valid = dict(re.findall(r"validation after step \d+: worker (\d) ([\d.]+)", out))
    checks = dict(exit_0=code == 0, killed=killed_at is not None, healed=healed is not None,
                  relaunched_once=out.count("relaunching it") == 1,
                  survivor_every_step_once=survivor == list(range(h, steps + 1, h)),
                  survivor_synced_alone=bool(alone), all_committed="NOT COMMITTED" not in out,
                  same_final_model=len(valid) == 2 and valid.get("0") == valid.get("1"), back=bool(back))
    ok = all(checks.values())
    seen_line = (f"the survivor's next sync committed with 1 worker {first_alone - killed_at:.1f} s after the kill; "
                 f"the supervisor relaunched worker 1, which healed at step {healed.group(1)} "
                 f"{back - killed_at:.1f} s after the kill; final validation loss {valid.get('0')} on both"
                 if ok else f"failed: {[k for k, v in checks.items() if not v]}; {first_error(out)}")
    if not ok:
        print(out[-6000:], flush=True)
    m.row("torchft-kill-between", "--local-sgd-sync-backend torchft (each worker its own job, "
          "megatron_edit.supervise): worker 1's job SIGKILLed after its step 16 of 600", seen_line,
          None if killed_at is None else seen.get(
              "train_gpt_edit.py: every worker's job ended with code 0", time.time()) - killed_at,
          "worker 0: nothing (no restart, every step once); worker 1: what it trained since its last sync "
          "(at most H = 8 steps), then identical to worker 0" if ok else "NOT as expected", ok)


def torchft_node_row(m: Matrix) -> None:
    """Two "nodes" (network namespaces joined by one link, scripts/dev/ft_two_nodes.sh): the
    supervisor's --serve and worker 0 on node a, worker 1 on node b; every process of node b
    SIGKILLed 35 s after the jobs start, worker 1 started again there. Needs root and iproute2."""
    if not m.wants("torchft-node-dies"):
        return
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("[torchft-node-dies] not run: it needs root and iproute2 (two network namespaces as nodes)", flush=True)
        return
    d = m.root / "torchft-node-dies"
    d.mkdir()
    steps, start = 1500, time.time()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "dev" / "ft_two_nodes.sh"), "--out", str(d), "--steps",
                           str(steps), "--kill-after", "35", "--python", sys.executable],
                          capture_output=True, text=True, timeout=3 * LIMIT)
    logs = [(d / f"w{w}.log").read_text() if (d / f"w{w}.log").exists() else "" for w in (0, 1)]
    alone = re.search(r"worker 0 sync \d+ after step (\d+): .*\(1 workers\)", logs[0])
    healed = re.search(r"worker 1 rank 0 joined a running job: healed from a live worker to step (\d+)", logs[1])
    valid = [re.findall(rf"validation after step {steps}: worker \d ([\d.]+)", log)[-1:] for log in logs]
    checks = dict(exit_0=proc.returncode == 0, survivor_synced_alone=alone is not None, healed=healed is not None,
                  same_final_model=valid[0] == valid[1] != [])
    ok = all(checks.values())
    seen_line = (f"worker 0 synced alone from its sync after step {alone.group(1)} on; worker 1's new job on "
                 f"node b healed from it over the link at step {healed.group(1)}; final validation loss "
                 f"{valid[0][0]} on both" if ok else f"failed: {[k for k, v in checks.items() if not v]}; "
                 f"{first_error(proc.stdout + proc.stderr + logs[1])}")
    if not ok:
        print((proc.stdout + proc.stderr + logs[0][-3000:] + logs[1][-3000:])[-8000:], flush=True)
    m.row("torchft-node-dies", "--local-sgd-sync-backend torchft on two nodes (network namespaces, "
          "supervise --serve): every process of worker 1's node SIGKILLed 35 s into 1500 steps", seen_line,
          time.time() - start - 35, "worker 0: nothing; worker 1: what it trained since its last sync (at most "
          "H = 4 steps), then identical to worker 0" if ok else "NOT as expected", ok)


def report(m: Matrix, out=None) -> int:
    """The Markdown table (printed, and written to ``out``); the exit code: 1 when a row does not hold."""
    table = ["| fault | what the user sees | s to end | lost | holds |", "|---|---|---|---|---|"]
    table += [f"| {fault} | {seen.replace('|', '/')} | {sec} | {lost} | {ok} |"
              for _, fault, seen, sec, lost, ok in m.rows]
    text = "\n".join(table)
    print("\n" + text)
    if out:
        Path(out).write_text(text + "\n")
    shutil.rmtree(m.root, ignore_errors=True)
    print(f"\n{len(m.rows) - m.failed} of {len(m.rows)} rows hold")
    return 1 if m.failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None,
                        help=f"comma-separated row names (default: all): {', '.join(ROWS)}")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    unknown = [] if args.rows is None else [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        parser.error(f"--rows: no row named {', '.join(unknown)}; the rows are {', '.join(ROWS)}.")
    matrix = Matrix(Path(tempfile.mkdtemp(prefix="fault_matrix_")),
                    None if args.rows is None else set(args.rows.split(",")))
    for rows in (kill_rows, hang_row, nan_rows, elastic_rows, damage_rows, torchft_kill_row, torchft_node_row):
        rows(matrix)
    return report(matrix, args.out)


if __name__ == "__main__":
    sys.exit(main())
