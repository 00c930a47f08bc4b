#!/usr/bin/env bash
# Megatron-LM's pretrain_gpt.py with EDiT on several nodes: torchrun with c10d rendezvous.
# Run the same command on every node (or let scripts/pretrain_gpt_edit.slurm do it):
#
#   MEGATRON_LM_DIR=/path/to/Megatron-LM NNODES=4 RDZV_ENDPOINT=node0:29500 RDZV_ID=run1 SIZE=7b \
#       bash scripts/pretrain_gpt_edit_multinode.sh [extra Megatron args]
#
# One EDiT worker per node by default (WORKERS=NNODES): each node reduces gradients over its
# own NVLink every step; nodes exchange pseudo-gradients once every H steps, layer by layer,
# overlapped with the forward pass. That needs TP x CP x (data-parallel ranks per worker) = GPUs
# per node and PP=1, which the defaults in scripts/edit_flags.sh satisfy on 8-GPU nodes.
# Environment variables and the reasoning behind the defaults: scripts/edit_flags.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
: "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to a Megatron-LM checkout at the tag of the installed megatron-core (core_v0.16.1 or core_v0.19.0)}"
: "${NNODES:?set NNODES}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of one node}"
PYTHON=${PYTHON:-python}
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
WORKERS=${WORKERS:-$NNODES}
source "$HERE/edit_flags.sh"

exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$NPROC" \
  --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "${RDZV_ID:-megatron-edit}" \
  -m megatron_edit.launch "$MEGATRON_LM_DIR/pretrain_gpt.py" \
  "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${DEVICE_ARGS[@]}" "${EDIT_ARGS[@]}" "$@"
