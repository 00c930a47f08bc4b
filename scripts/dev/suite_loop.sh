#!/usr/bin/env bash
# Runs the test suite N times in a row and counts failures per test ("the suite passes
# 5 times in a row"; per-test failure counts before/after a fix).
#   scripts/dev/suite_loop.sh OUTDIR N [PYTEST ARGS...]      (default args: -q tests)
# Each run writes OUTDIR/run<i>.xml (JUnit) and OUTDIR/run<i>.log; OUTDIR/summary.md gets one row
# per run (passed/failed/skipped, seconds, load average) and the failures per test.
set -u
out=${1:?OUTDIR}; n=${2:?N}; shift 2
[ $# -gt 0 ] || set -- -q tests
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
for i in $(seq 1 "$n"); do
    t0=$(date +%s); la0=$(cut -d' ' -f1-3 /proc/loadavg)
    "$py" -m pytest "$@" --junitxml="$out/run$i.xml" >"$out/run$i.log" 2>&1
    rc=$?; t1=$(date +%s); la1=$(cut -d' ' -f1-3 /proc/loadavg)
    echo -e "$i\t$rc\t$((t1 - t0))\t$la0\t$la1\t$(tail -n 1 "$out/run$i.log")" >>"$out/runs.tsv"
done
"$py" - "$out" <<'PY'
import collections, glob, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
fails, runs = collections.Counter(), 0
rows = [line.rstrip("\n").split("\t") for line in open(os.path.join(out, "runs.tsv"))]
for path in sorted(glob.glob(os.path.join(out, "run*.xml"))):
    runs += 1
    for case in ET.parse(path).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            fails[f"{case.get('classname')}::{case.get('name')}"] += 1
with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("| run | exit | seconds | load at start | load at end | result |\n|---|---|---|---|---|---|\n")
    for r in rows:
        f.write("| " + " | ".join(r) + " |\n")
    f.write(f"\nFailures per test over {runs} runs:\n\n")
    f.write("".join(f"- {t}: {c}\n" for t, c in fails.most_common()) or "- none\n")
print(open(os.path.join(out, "summary.md")).read())
PY
