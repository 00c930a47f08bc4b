#!/usr/bin/env bash
# Create .venv with everything megatron_edit, its CPU main job and its tests need.
# torch is installed first and pinned to the CPU build (2.13.0) so nothing pulls CUDA wheels;
# PyPI's `apex` is an unrelated package and is never installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
MEGATRON_CORE=${MEGATRON_CORE:-0.16.1}
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q "megatron-core==$MEGATRON_CORE" -e ".[test]"
"$VENV/bin/python" -W ignore -c "import torch, megatron.core, megatron_edit; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| megatron_edit', megatron_edit.__version__)"
