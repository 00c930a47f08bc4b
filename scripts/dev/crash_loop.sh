#!/usr/bin/env bash
# Loop short 4-process torchrun jobs of the main job (scripts/train_gpt_edit.py) under glibc's
# malloc checking, faulthandler and kept core dumps, to reproduce a rare native crash.
#
#   scripts/dev/crash_loop.sh OUTDIR DEADLINE_EPOCH CONFIG [CONFIG...]
#
# CONFIG is NAME or NAME@NPROC (processes, default 4; the committed convergence benchmark ran
# with 2: one rank per worker), NAME one of these, optionally prefixed big_ (the convergence
# benchmark's model: 4 layers, hidden 192, 128-token sequences, 1.9M parameters, ~95 buckets):
#   edit_int8      EDiT layer-wise sync with the quantized exchange (int8 + error feedback)
#   edit_fp32      EDiT layer-wise sync, fp32 exchange (no quantization)
#   edit_stepend   EDiT, --local-sgd-sync-mode step_end (no exchange overlapped with compute)
#   baseline       --mode baseline (plain synchronous training: megatron-core without megatron_edit's wraps)
#   edit_nosync    EDiT attached, syncing once, at the run's last step (the main job refuses a run without a sync) (issue 62's arm b)
#   edit_delayed   EDiT layer-wise with a delayed outer step (tau = 1)
#   fsdp_baseline / fsdp_nosync / fsdp_edit   the same three arms on Megatron-FSDP (--use-megatron-fsdp)
# MEGATRON_EDIT_COLLECTIVE_GUARD=1 in the environment runs every rank with the check of
# asynchronous collectives (megatron_edit.cpu.collective_guard); unset: as a user runs.
#   bench_multi    scripts/bench/bench_convergence.py itself (its model), four short runs in one process:
#                  sync, edit:H=$H, edit:H=$H,dtype=int8,ef=1, diloco:H=$H ($BENCH_STEPS steps each;
#                  STUB=a folder with a no-op matplotlib where matplotlib is not installed)
#   bench_aedit_int4  scripts/bench/bench_convergence.py with the two run kinds bench_multi leaves out:
#                  aedit:H=$H,slow=2 (A-EDiT, worker 1 at half speed) and edit:H=$H,dtype=int4,ef=1
#   gloo_stress    scripts/dev/repro_gloo_crash.py (no Megatron): the smallest reproducer of the crash
#                  (torch's gloo status race, issue 62), $STRESS_ITERS iterations, torch's two threads
#   gloo_one_thread  the same with one worker thread per gloo group (megatron_edit.cpu.gloo_threads)
# The configurations are run round-robin until DEADLINE_EPOCH (date +%s); one job at a time,
# under nice -n 19. Every run gets its own folder OUTDIR/runs/NNNN-CONFIG (its working directory:
# core_pattern "core" writes cores there) with its log; OUTDIR/results.tsv has one line per run:
# index, config, exit status, seconds, classification, signals/messages found in the log.
set -u
OUT=${1:?outdir}; DEADLINE=${2:?deadline epoch}; shift 2
CONFIGS=("$@")
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
STEPS=${STEPS:-96}   # steps per run
H=${H:-2}; W=${W:-4}  # EDiT: a sync every H steps after W synchronous steps (many syncs per short run)
HW=(--local-sgd-sync-interval "$H" --local-sgd-warmup-steps "$W" --log-interval 1000)
mkdir -p "$OUT/runs" "$OUT/data-cache"
ulimit -c unlimited
export PYTHONFAULTHANDLER=1
# glibc >= 2.34: MALLOC_CHECK_ / glibc.malloc.check only act with libc_malloc_debug preloaded.
export LD_PRELOAD=libc_malloc_debug.so.0
export MALLOC_CHECK_=3 GLIBC_TUNABLES=glibc.malloc.check=3
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
[ -f "$OUT/results.tsv" ] || printf 'run\tconfig\trc\tseconds\tclass\tdetail\n' > "$OUT/results.tsv"
i=$(($(wc -l < "$OUT/results.tsv") - 1))
while [ "$(date +%s)" -lt "$DEADLINE" ]; do
  for spec in "${CONFIGS[@]}"; do
    [ "$(date +%s)" -lt "$DEADLINE" ] || break
    cfg=${spec%@*}; np=4; [ "$spec" != "$cfg" ] && np=${spec#*@}
    i=$((i + 1)); dir=$(printf '%s/runs/%04d-%s-np%d' "$OUT" "$i" "$cfg" "$np"); mkdir -p "$dir"
    model=()
    case $cfg in big_*) cfg=${cfg#big_}; model=(--layers 4 --hidden 192 --seq-length 128 --lr-warmup-steps 8) ;; esac
    case $cfg in
      edit_int8) extra=(--mode edit "${HW[@]}" --local-sgd-exchange-dtype int8 --local-sgd-exchange-error-feedback) ;;
      edit_fp32) extra=(--mode edit "${HW[@]}") ;;
      edit_stepend) extra=(--mode edit "${HW[@]}" --local-sgd-sync-mode step_end) ;;
      baseline) extra=(--mode baseline) ;;
      edit_nosync) extra=(--mode edit --local-sgd-sync-interval $((STEPS - W)) --local-sgd-warmup-steps "$W" --log-interval 1000) ;;
      edit_delayed) extra=(--mode edit "${HW[@]}" --local-sgd-outer-step-delay 1) ;;
      fsdp_baseline) extra=(--mode baseline --use-megatron-fsdp) ;;
      fsdp_nosync) extra=(--mode edit --use-megatron-fsdp --local-sgd-sync-interval $((STEPS - W)) --local-sgd-warmup-steps "$W" --log-interval 1000) ;;
      fsdp_edit) extra=(--mode edit --use-megatron-fsdp "${HW[@]}") ;;
      bench_multi|bench_aedit_int4) extra=() ;;
      gloo_stress) extra=() ;;
      gloo_one_thread) extra=(--one-thread) ;;
      *) echo "unknown config $cfg"; exit 2 ;;
    esac
    t0=$(date +%s)
    if [ "$cfg" = gloo_stress ] || [ "$cfg" = gloo_one_thread ]; then
      (cd "$dir" && exec nice -n 19 timeout -s KILL 900 "$PY" -m torch.distributed.run --standalone \
          --nproc_per_node "$np" "$REPO/scripts/dev/repro_gloo_crash.py" --iters "${STRESS_ITERS:-300}" "${extra[@]}") > "$dir/log" 2>&1 </dev/null
    elif [ "$cfg" = bench_multi ] || [ "$cfg" = bench_aedit_int4 ]; then  # the convergence benchmark itself
      runs=(sync "edit:H=$H" "edit:H=$H,dtype=int8,ef=1" "diloco:H=$H")  # several runs in one process
      [ "$cfg" = bench_aedit_int4 ] && runs=("aedit:H=$H,slow=2" "edit:H=$H,dtype=int4,ef=1")
      (cd "$dir" && export PYTHONPATH=${STUB:-}; exec nice -n 19 timeout -s KILL 900 "$PY" -m torch.distributed.run \
          --standalone --nproc_per_node "$np" "$REPO/scripts/bench/bench_convergence.py" --runs "${runs[@]}" --seeds $((1000 + i)) --bench-steps "${BENCH_STEPS:-48}" \
          --edit-warmup "$W" --lr-warmup-steps 8 --eval-every 16 --eval-samples 32 --out "$dir/convergence" --fresh \
          --data-dir "$OUT/data-cache") > "$dir/log" 2>&1 </dev/null
    else
      (cd "$dir" && exec nice -n 19 timeout -s KILL 900 "$PY" -m torch.distributed.run --standalone \
          --nproc_per_node "$np" "$REPO/scripts/train_gpt_edit.py" --steps "$STEPS" \
          --data-dir "$OUT/data-cache" --seed $((1000 + i)) "${model[@]}" "${extra[@]}") > "$dir/log" 2>&1 </dev/null
    fi
    rc=$?
    t1=$(date +%s)
    detail=$(grep -aoE 'Signal [0-9]+ \([A-Z]+\)|exitcode *: *-?[0-9]+|Fatal Python error: [A-Za-z ]+|malloc[_a-z]*\(\)[^\r\n]*|free\(\)[^\r\n]*|double free[^\r\n]*|corrupted[^\r\n]*|Segmentation fault|Aborted|munmap_chunk[^\r\n]*|realloc\(\)[^\r\n]*' "$dir/log" | sort | uniq -c | tr -s ' \n' ' ' | cut -c1-300)
    cores=$(find "$dir" -maxdepth 1 -name 'core*' | wc -l)
    if [ "$rc" -eq 0 ]; then cls=ok
    elif grep -aq 'CollectiveHazard' "$dir/log"; then cls=hazard  # the guard tripped (a Python error, not a crash)
    elif grep -aqE 'Fatal Python error|Signal (11|6|7) |SIGSEGV|SIGABRT|SIGBUS|malloc|free\(\)|corrupted' "$dir/log"; then cls=native
    elif [ "$rc" -eq 137 ]; then cls=timeout
    else cls=other; fi
    [ "$cls" = ok ] && rm -rf "$dir/tr"
    printf '%d\t%s\t%d\t%d\t%s\t%s cores=%d\n' "$i" "$spec" "$rc" $((t1 - t0)) "$cls" "$detail" "$cores" >> "$OUT/results.tsv"
  done
done
