#!/usr/bin/env bash
# The GPU lane in one command: megatron_edit's @pytest.mark.cuda tests on real megatron-core with
# CUDA (tests/cuda), then a table of the results. Needs a CUDA GPU, torch with CUDA and
# megatron-core installed (pip install megatron-core; transformer-engine / apex optional).
#   bash scripts/gpu_check.sh            (PYTHON=... to choose the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: this machine has no CUDA GPU (torch.cuda.is_available() is False for $PY)."
    echo "gpu_check: run it on a machine with one; the CPU suite is 'python -m pytest -q tests'."
    exit 2
fi
report=$(mktemp --suffix=.xml)
"$PY" -m pytest -q -p no:cacheprovider -m cuda tests/cuda --junitxml="$report" "$@"
rc=$?
"$PY" - "$report" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

import torch

root = ET.parse(sys.argv[1]).getroot()
rows = []
for case in root.iter("testcase"):
    status = "passed"
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            status = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
    rows.append((case.get("name"), status, float(case.get("time", 0))))
print(f"\nGPU lane on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})")
width = max(len(r[0]) for r in rows) if rows else 10
print(f"| {'test'.ljust(width)} | result  | seconds |")
print(f"|{'-' * (width + 2)}|---------|---------|")
for name, status, seconds in rows:
    print(f"| {name.ljust(width)} | {status.ljust(7)} | {seconds:7.1f} |")
PYEOF
rm -f "$report"
exit $rc
