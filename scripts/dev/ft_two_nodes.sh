#!/usr/bin/env bash
# The torchft backend on two "nodes": two Linux network namespaces joined by a veth pair
# (10.201.0.1 and 10.201.0.2), each with only that link and its own loopback, so nothing a
# worker advertises as localhost or as this machine's host name reaches the other.
#
#   bash scripts/dev/ft_two_nodes.sh [--steps 16] [--python PY] [--out DIR] [--kill-after S] [--compute-ms MS]
#                                    [--slow-ms MS] [--rate 20mbit] [-- MORE MAIN JOB FLAGS]
#
# Node a runs `python -m megatron_edit.supervise --workers 2 --bind 10.201.0.1:29510 --serve
# --env-file DIR/run.env` (the Lighthouse and the start gate, as on a cluster's head node) and
# worker 0's job; node b runs worker 1's job. Each job is `torchrun --standalone` of the main job
# (scripts/train_gpt_edit.py --local-sgd-sync-backend torchft, 1 rank) after `source run.env`.
# --kill-after S: every process on node b is SIGKILLed S seconds after the jobs start (the node
# died) and worker 1's job is started again there, fresh (it heals from worker 0 over the link).
# --compute-ms MS: each step also sleeps MS ms (the main job's --compute-sleep-ms), so that worker
# 0 is still training when the relaunched job comes (it must not end the run first).
# --slow-ms MS: worker 1 sleeps MS ms more per step (a straggler: a slower device).
# --rate R: tc's token-bucket filter (tbf) at R on the egress of both ends of the link (a slow
# link between sites; the burst as scripts/bench/netns_cluster.sh's); default: none (veth speed).
# Flags after -- go to both jobs, after this script's (they win: e.g. --local-sgd-async).
# Logs in DIR (serve.log, w0.log, w1.log); exit status 0 when both jobs ended with 0. Needs root
# and iproute2; everything is removed on exit. A cluster's scheduler does what this script does
# with the jobs.
set -uo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=$HERE/.venv/bin/python
OUT=$(mktemp -d)
STEPS=16
KILL_AFTER=
COMPUTE_MS=0
SLOW_MS=0
RATE=none
MORE=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --steps) STEPS=$2; shift 2 ;;
        --python) PYTHON=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --kill-after) KILL_AFTER=$2; shift 2 ;;
        --compute-ms) COMPUTE_MS=$2; shift 2 ;;
        --slow-ms) SLOW_MS=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --) shift; MORE=("$@"); break ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) echo "ft_two_nodes.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ $(id -u) -ne 0 ]]; then echo "ft_two_nodes.sh: needs root (network namespaces)" >&2; exit 2; fi
mkdir -p "$OUT"
A="ft2n$$-a"; B="ft2n$$-b"

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    for ns in "$A" "$B"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
    done
    exit "$status"
}
trap cleanup EXIT INT TERM

ip netns add "$A" && ip netns add "$B" || exit 2
for ns in "$A" "$B"; do ip netns exec "$ns" ip link set lo up; done
ip link add ft2n netns "$A" type veth peer name ft2n netns "$B"
ip netns exec "$A" ip addr add 10.201.0.1/24 dev ft2n && ip netns exec "$A" ip link set ft2n up
ip netns exec "$B" ip addr add 10.201.0.2/24 dev ft2n && ip netns exec "$B" ip link set ft2n up
if [[ $RATE != none ]]; then
    BITS=$("$PYTHON" -c "import re, sys; m = re.fullmatch(r'(\d+(?:\.\d+)?)([kmg]?)bit', sys.argv[1].lower()) or \
sys.exit(f'ft_two_nodes.sh: bad --rate {sys.argv[1]}: use e.g. 20mbit, 1gbit'); \
print(int(float(m.group(1)) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9}[m.group(2)]))" "$RATE") || exit 2
    BURST=$(( BITS / 8 / 1000 )); (( BURST < 66000 )) && BURST=66000
    for ns in "$A" "$B"; do
        ip netns exec "$ns" tc qdisc add dev ft2n root tbf rate "$RATE" burst "$BURST" latency 100ms || exit 2
    done
fi

cd "$HERE"
ip netns exec "$A" env RUST_LOG=warn "$PYTHON" -m megatron_edit.supervise --workers 2 \
    --bind 10.201.0.1:29510 --serve --env-file "$OUT/run.env" > "$OUT/serve.log" 2>&1 &
for _ in $(seq 300); do [[ -s $OUT/run.env ]] && break; sleep 0.2; done
if [[ ! -s $OUT/run.env ]]; then
    echo "ft_two_nodes.sh: the supervisor wrote no run.env:" >&2; cat "$OUT/serve.log" >&2; exit 1
fi

job() {  # job NAMESPACE WORKER: one worker's job on that node, its output appended to w<WORKER>.log
    local sleep_ms=$COMPUTE_MS
    (( $2 == 1 )) && sleep_ms=$("$PYTHON" -c "print($COMPUTE_MS + $SLOW_MS)")
    ip netns exec "$1" bash -c "source '$OUT/run.env'; export RUST_LOG=warn GLOO_SOCKET_IFNAME=ft2n; \
        exec '$PYTHON' -m torch.distributed.run --standalone --nproc_per_node 1 scripts/train_gpt_edit.py \
        --local-sgd-sync-backend torchft --workers 2 --local-sgd-replica-id $2 --steps $STEPS \
        --local-sgd-sync-interval 4 --compute-sleep-ms $sleep_ms ${MORE[*]@Q}" >> "$OUT/w$2.log" 2>&1
}
job "$A" 0 & W0=$!
if [[ -n $KILL_AFTER ]]; then  # node b dies: every process in it, at once
    job "$B" 1 & W1=$!
    sleep "$KILL_AFTER"
    for pid in $(ip netns pids "$B"); do kill -9 "$pid" 2>/dev/null || true; done
    wait "$W1" 2>/dev/null
    echo "=== ft_two_nodes.sh: every process of node b SIGKILLed after $KILL_AFTER s; worker 1 started again" \
        >> "$OUT/w1.log"
fi
job "$B" 1 & W1=$!
wait "$W0"; RC0=$?
wait "$W1"; RC1=$?
echo "ft_two_nodes.sh: worker 0 exited $RC0, worker 1 exited $RC1; logs in $OUT"
(( RC0 == 0 && RC1 == 0 ))
