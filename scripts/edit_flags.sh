# Flags shared by the pretrain_gpt + EDiT launchers (sourced, not run).
#
# Sets the arrays MODEL_ARGS, TRAIN_ARGS, DATA_ARGS, EDIT_ARGS, DEVICE_ARGS from environment
# variables (defaults in brackets):
#   SIZE            tiny | 350m | 1b | 3b | 7b                              [350m]
#   WORKERS         EDiT workers = --num-distributed-optimizer-instances  [set by the launcher]
#   EDIT_H          H, steps between syncs                                 [per size, below]
#   EDIT_WARMUP     W, synchronous steps first                             [per size, below]
#   OUTER_LR, OUTER_MOMENTUM   outer Nesterov SGD                           [0.7, 0.9]
#   EDIT_PENALTY    1: pseudo-gradient penalty (anomaly elimination, weighted averaging,
#                   clipping at EDIT_CLIP)                                  [1; tiny: 0]
#   TRAIN_ITERS, GLOBAL_BATCH, MICRO_BATCH, LR, MIN_LR                     [per size]
#   LR_WARMUP       learning-rate warmup iterations                        [EDIT_WARMUP]
#   DATA_PATH       Megatron data prefix(es); unset: --mock-data            []
#   TOKENIZER       HuggingFace tokenizer name/path (with DATA_PATH)        [meta-llama/Llama-2-7b-hf]
#   CKPT_DIR        --save/--load directory                                 [none]
#   TB_DIR          --tensorboard-dir                                       [none]
#   DEVICE          gpu | cpu (cpu: gloo, fp32, for trying the flags out)   [gpu]
#   PYTHON          the interpreter; gpu: transformer-engine is looked for   [python]
#                   in it, and without it the local-layer flags are added
#   SYNC_BACKEND    torch (all workers one job) | torchft (a job per worker,  [torch]
#                   under python -m megatron_edit.supervise; each job gets
#                   GLOBAL_BATCH / WORKERS, warmup 0, and {replica_id} in
#                   its id and checkpoint folder)
#
# Why these EDiT settings (arXiv 2412.07210; starting points, not tuned on GPUs here):
# * One worker per node (WORKERS = nodes): Megatron's distributed-optimizer instances are
#   contiguous rank blocks, so each worker's per-step reduce-scatter stays on the node's
#   NVLink and only the pseudo-gradient exchange, once every H steps, crosses the network.
#   Needs TP x CP x (data-parallel ranks per worker) = GPUs per node, with PP=1 as in every
#   size below (with pipeline parallelism, check how Megatron orders ranks before relying on it).
# * Outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9 (DiLoCo's setting, which EDiT adopts;
#   the package default).
# * H: long enough that one exchange of 4 bytes x params / shard size per rank is cheap next to
#   H steps of compute, short enough that workers do not drift apart; larger models take larger
#   per-step compute, so the same H hides more communication. W: synchronous steps through the
#   unstable start (learning-rate warmup), so local training begins from a settled model.
# * The pseudo-gradient penalty (anomalous workers excluded per layer, norm-weighted averaging,
#   clipping of the averaged pseudo-gradient) is the paper's guard against loss spikes; on by
#   default for real sizes.
# * bf16, not fp16: a skipped fp16 step on one worker would desynchronise the schedule (refused).
# * --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather: the layer-wise
#   sync runs inside the forward pass's parameter all-gather.

SIZE=${SIZE:-350m}
case "$SIZE" in
  tiny) LAYERS=2;  HIDDEN=64;   HEADS=4;  FFN=256;   SEQ=64;   TP=1; H=4;   W=4;
        ITERS=20;     GBS=8;   MBS=2; LR_=1e-3;   MIN_LR_=1e-4 ;;
  350m) LAYERS=24; HIDDEN=1024; HEADS=16; FFN=2816;  SEQ=2048; TP=1; H=128; W=1000;
        ITERS=100000; GBS=512; MBS=8; LR_=3e-4;   MIN_LR_=3e-5 ;;
  1b)   LAYERS=24; HIDDEN=2048; HEADS=16; FFN=5632;  SEQ=2048; TP=1; H=128; W=1000;
        ITERS=100000; GBS=512; MBS=4; LR_=3e-4;   MIN_LR_=3e-5 ;;
  3b)   LAYERS=32; HIDDEN=2560; HEADS=32; FFN=6912;  SEQ=2048; TP=2; H=128; W=1000;
        ITERS=100000; GBS=512; MBS=2; LR_=2e-4;   MIN_LR_=2e-5 ;;
  7b)   LAYERS=32; HIDDEN=4096; HEADS=32; FFN=11008; SEQ=2048; TP=4; H=128; W=1000;
        ITERS=100000; GBS=512; MBS=1; LR_=1.5e-4; MIN_LR_=1.5e-5 ;;
  *) echo "unknown SIZE=$SIZE (tiny, 350m, 1b, 3b, 7b)" >&2; exit 2 ;;
esac

MODEL_ARGS=(
  --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
  --ffn-hidden-size "$FFN" --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --tensor-model-parallel-size "$TP"
)
if [ "$SIZE" != tiny ]; then
  # Llama-style blocks.
  MODEL_ARGS+=(--swiglu --normalization RMSNorm --position-embedding-type rope
               --untie-embeddings-and-output-weights --disable-bias-linear)
fi

SYNC_BACKEND=${SYNC_BACKEND:-torch}
case "$SYNC_BACKEND" in
  torch) JOB_BATCH=${GLOBAL_BATCH:-$GBS}; INSTANCES=${WORKERS:?set WORKERS (EDiT workers)}; JOB_CKPT=${CKPT_DIR:-} ;;
  # A job per worker: its share of the global batch, one distributed-optimizer instance, no
  # warmup (warmup all-reduces gradients across workers, which separate jobs cannot).
  torchft) JOB_BATCH=$(( ${GLOBAL_BATCH:-$GBS} / ${WORKERS:?set WORKERS (EDiT workers)} )); INSTANCES=1; W=0
           JOB_CKPT=${CKPT_DIR:+$CKPT_DIR/worker{replica_id}} ;;
  *) echo "unknown SYNC_BACKEND=$SYNC_BACKEND (torch, torchft)" >&2; exit 2 ;;
esac

TRAIN_ARGS=(
  --train-iters "${TRAIN_ITERS:-$ITERS}" --global-batch-size "$JOB_BATCH"
  --micro-batch-size "${MICRO_BATCH:-$MBS}" --lr "${LR:-$LR_}" --min-lr "${MIN_LR:-$MIN_LR_}"
  --lr-decay-style cosine --lr-warmup-iters "${LR_WARMUP:-$(( ${EDIT_WARMUP:-$W} > 1 ? ${EDIT_WARMUP:-$W} : 2 ))}"
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --log-interval "${LOG_INTERVAL:-$([ "$SIZE" = tiny ] && echo 1 || echo 10)}"
  --eval-interval 1000 --eval-iters "$([ "$SIZE" = tiny ] && echo 0 || echo 10)"
)
[ -n "$JOB_CKPT" ] && TRAIN_ARGS+=(--save "$JOB_CKPT" --load "$JOB_CKPT"
                                       --save-interval "${SAVE_INTERVAL:-1024}" --ckpt-format torch_dist)
[ -n "${TB_DIR:-}" ] && TRAIN_ARGS+=(--tensorboard-dir "$TB_DIR" --log-timers-to-tensorboard)

if [ -n "${DATA_PATH:-}" ]; then
  DATA_ARGS=(--data-path $DATA_PATH --split 990,8,2 --tokenizer-type HuggingFaceTokenizer
             --tokenizer-model "${TOKENIZER:-meta-llama/Llama-2-7b-hf}")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-$([ "$SIZE" = tiny ] && echo 256 || echo 32000)}")
fi

EDIT_ARGS=(
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --num-distributed-optimizer-instances "$INSTANCES"
  --use-local-sgd --local-sgd-sync-interval "${EDIT_H:-$H}" --local-sgd-warmup-steps "${EDIT_WARMUP:-$W}"
  --outer-optimizer sgd --outer-optimizer-lr "${OUTER_LR:-0.7}"
  --outer-optimizer-momentum "${OUTER_MOMENTUM:-0.9}" --outer-optimizer-nesterov
)
[ "$SYNC_BACKEND" = torchft ] && EDIT_ARGS+=(--local-sgd-sync-backend torchft --local-sgd-replica-id "{replica_id}")
if [ "${EDIT_PENALTY:-$([ "$SIZE" = tiny ] && echo 0 || echo 1)}" = 1 ]; then
  EDIT_ARGS+=(--local-sgd-skip-anomaly --local-sgd-pseudo-gradnorm-reduce
              --local-sgd-clip-pseudo-grad "${EDIT_CLIP:-10}")
fi

# GPU: with transformer-engine, Megatron's defaults (TE layers, fused kernels). Without it,
# Megatron-LM's local layers and no fusions that need TE or apex, so pretrain_gpt.py still runs
# (slower). One line on stderr says which (stdout stays clean for callers that capture it).
if [ "${DEVICE:-gpu}" = cpu ]; then
  DEVICE_ARGS=(--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion
               --no-persist-layer-norm --attention-dropout 0 --hidden-dropout 0)
elif "${PYTHON:-python}" -c 'import transformer_engine' >/dev/null 2>&1; then
  DEVICE_ARGS=(--bf16)
  echo "edit_flags.sh: transformer-engine found: Megatron's default transformer implementation" >&2
else
  DEVICE_ARGS=(--bf16 --transformer-impl local --no-rope-fusion --no-gradient-accumulation-fusion
               --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion
               --no-bias-dropout-fusion)
  echo "edit_flags.sh: transformer-engine not importable by ${PYTHON:-python}: adding" \
       "${DEVICE_ARGS[*]:1} (Megatron-LM's local layers, no TE/apex fusions)" >&2
fi
