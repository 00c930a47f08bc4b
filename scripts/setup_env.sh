#!/usr/bin/env bash
# Create a virtual environment with everything megatron_edit, its CPU main job and its tests need.
#
#   bash scripts/setup_env.sh                                   # .venv: megatron-core 0.16.1, Python 3.11
#   VENV=.venv-newest MEGATRON_CORE=0.19.2 bash scripts/setup_env.sh   # Python 3.12 (pyenv 3.12.1)
#   VENV=.venv-oldest MEGATRON_CORE=0.12.3 bash scripts/setup_env.sh
#
# torch is installed first and pinned, so nothing else pulls another build:
#  - Python 3.11: torch 2.13.0, the CPU build (a wheel on this machine's local index);
#  - Python 3.12 (megatron-core 0.17+ needs it): torch 2.15.0, the newest release the package
#    index serves (CI's newest lane: the newest megatron-core on the newest torch). There is no
#    CPU build here for 3.12, so it is the CUDA build (it runs on the CPU; about 5.5 GB with its
#    CUDA libraries). Where this machine's pip configuration caps torch at the releases on its
#    disk (/etc/xdg/pip: torch<=2.14.1), PIP_CONSTRAINT=/dev/null lifts the cap for this venv's
#    installs only. (2.8 is the oldest whose triton finds its driver lazily: with an older one,
#    importing megatron.training, shipped in megatron-core 0.17+ wheels, fails without a GPU.)
# megatron-core 0.17+ ships Megatron-LM's megatron/training, so its Python dependencies
# (scripts/requirements-megatron-lm.txt) are installed too: the training patches are then
# checked against it. PyPI's `apex` is an unrelated package and is never installed.
#
# Overrides: VENV, MEGATRON_CORE, PYTHON (the interpreter that creates the venv), TORCH.
# EXTRAS=ft: also megatron_edit's optional extras (comma-separated; ft = torchft, for
# --local-sgd-sync-backend torchft; metrics = prometheus_client, for the status server's
# /metrics), installed with megatron_edit.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
MEGATRON_CORE=${MEGATRON_CORE:-0.16.1}
minor=$(echo "$MEGATRON_CORE" | cut -d. -f2)
if [ "$minor" -ge 17 ]; then
    # megatron-core 0.17+ requires Python 3.12; pyenv has it on these machines.
    PYTHON=${PYTHON:-$(PYENV_VERSION=3.12.1 pyenv which python 2>/dev/null || echo python3.12)}
else
    PYTHON=${PYTHON:-python3}
fi
py=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$minor" -ge 17 ] && [ "$py" != 3.12 ] && [ "$py" != 3.13 ]; then
    echo "setup_env.sh: megatron-core $MEGATRON_CORE needs Python 3.12+, $PYTHON is $py;" \
         "set PYTHON (e.g. PYTHON=\$(PYENV_VERSION=3.12.1 pyenv which python))" >&2
    exit 2
fi
case "$py" in
    3.11|3.10) TORCH=${TORCH:-2.13.0} ;;
    *) TORCH=${TORCH:-2.15.0}; export PIP_CONSTRAINT=${PIP_CONSTRAINT:-/dev/null} ;;
esac
# The CUDA build of torch for Python 3.12 is several GB from the package index, and a download
# cut short there once failed CI (pip's own resume gave up at 683.7 of 706.8 MB of one wheel).
# retry CMD...: run CMD up to 4 times, pausing 30, 60, 120 s between tries; what pip installed
# already stays installed, so a retry fetches only what is missing. pip_install also lets pip
# resume a cut download 20 times within a try.
retry() {
    local attempt pause=30
    for attempt in 1 2 3 4; do
        "$@" && return 0
        if [ "$attempt" -lt 4 ]; then
            echo "setup_env.sh: '$*' failed (try $attempt of 4); again in $pause s" >&2
            sleep "$pause"
            pause=$((pause * 2))
        fi
    done
    echo "setup_env.sh: '$*' failed 4 times; see the message above" >&2
    return 1
}
pip_install() { retry "$VENV/bin/python" -m pip install -q --resume-retries 20 "$@"; }
"$PYTHON" -m venv "$VENV"
retry "$VENV/bin/python" -m pip install -q --upgrade pip
pip_install "torch==$TORCH"
EXTRAS=${EXTRAS:+,$EXTRAS}
pip_install "megatron-core==$MEGATRON_CORE" -e ".[test$EXTRAS]"
if [ "$minor" -ge 17 ]; then
    pip_install -r scripts/requirements-megatron-lm.txt
fi
"$VENV/bin/python" -W ignore -c "import torch, megatron.core, megatron_edit; print('python', '$py', '| torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| megatron_edit', megatron_edit.__version__)"
