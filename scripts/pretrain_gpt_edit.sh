#!/usr/bin/env bash
# Megatron-LM's pretrain_gpt.py with EDiT on one node (torchrun), through megatron_edit.launch.
#
#   MEGATRON_LM_DIR=/path/to/Megatron-LM SIZE=1b WORKERS=2 bash scripts/pretrain_gpt_edit.sh [extra Megatron args]
#
# One node has no slow link to save, so this is for trying EDiT out (WORKERS=2: two workers of
# half the GPUs each) and for checking a configuration before going multi-node. On a machine
# without a GPU, DEVICE=cpu SIZE=tiny NPROC=4 runs the tiny model over gloo (about 20 s).
# SYNC_BACKEND=torchft (pip install megatron_edit[ft]): each worker its own torchrun job of
# NPROC / WORKERS ranks (on its own GPUs), under python -m megatron_edit.supervise, which
# relaunches a worker that dies while the others train on.
# Environment variables and the reasoning behind the defaults: scripts/edit_flags.sh.
# Megatron-LM's checkout must be at the tag of the installed megatron-core's release line
# (core_v0.16.1 for 0.16.x, core_v0.19.0 for 0.19.x).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
: "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to a Megatron-LM checkout at the tag of the installed megatron-core (core_v0.16.1 or core_v0.19.0)}"
PYTHON=${PYTHON:-python}
if [ "${DEVICE:-gpu}" = cpu ]; then NPROC=${NPROC:-4}; else NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}; fi
WORKERS=${WORKERS:-2}
source "$HERE/edit_flags.sh"

ARGS=("$MEGATRON_LM_DIR/pretrain_gpt.py" "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}"
      "${DEVICE_ARGS[@]}" "${EDIT_ARGS[@]}" "$@")
if [ "$SYNC_BACKEND" = torch ]; then
  exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m megatron_edit.launch "${ARGS[@]}"
fi
# SYNC_BACKEND=torchft: a job per worker (NPROC / WORKERS ranks each, on its own GPUs), started,
# and relaunched when it dies, by the supervisor (docs/concepts/torchft.md).
PER_JOB=$(( NPROC / WORKERS ))
[ $(( PER_JOB * WORKERS )) -eq "$NPROC" ] || { echo "WORKERS=$WORKERS must divide NPROC=$NPROC" >&2; exit 2; }
DEVICES=""
if [ "${DEVICE:-gpu}" != cpu ]; then
  DEVICES='export CUDA_VISIBLE_DEVICES=$(seq -s, $(( {replica_id} * '"$PER_JOB"' )) $(( {replica_id} * '"$PER_JOB"' + '"$PER_JOB"' - 1 ))); '
fi
exec "$PYTHON" -m megatron_edit.supervise --workers "$WORKERS" -- bash -c "${DEVICES}"'exec "$@"' job \
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$PER_JOB" -m megatron_edit.launch "${ARGS[@]}"
