#!/usr/bin/env bash
# A bandwidth-limited "cluster" on one machine: one Linux network namespace per worker.
#
#   bash scripts/bench/netns_cluster.sh [--workers 2] [--procs-per-worker 2] [--rate 100mbit|none]
#                                 [--check] [--python PY] -- SCRIPT.py [ARGS...]
#
# Needs root and iproute2 (ip, tc). Creates, for this run only:
#   namespaces  edit<PID>-w0 .. w<W-1>, each holding the ranks of one worker (they talk to each
#               other over the namespace's own loopback, at full speed, as inside a node), and
#               for more than two workers edit<PID>-hub holding a bridge;
#   links       two workers: one veth pair w0 <-> w1; more: a veth pair from each worker to the
#               bridge. Worker w's end is called "edw" and has address 10.200.0.<w+1>/24.
#   limits      --rate R puts tc's token-bucket filter (tbf) at R on the egress of *both* ends of
#               every link, so each direction of each worker's link carries at most R (none: no
#               limit, veth speed). netem is not used (not available on these machines).
# Then it starts `torchrun --nnodes W --node_rank w --nproc_per_node N SCRIPT ARGS` inside each
# worker namespace with GLOO_SOCKET_IFNAME=edw and the rendezvous at 10.200.0.1 (worker 0), so
# gloo traffic between workers goes over the limited links and stays inside these namespaces.
# --check first measures the link with a TCP stream (python sockets) from w0 to w1 for 2 s and
# prints Mbit/s. Everything is removed on exit (trap), whatever happens; the exit status is the
# first failing worker's.
set -euo pipefail

# Wait for every pid given; return the first failing exit status (in the order given), 0 when
# all succeeded. (`if ! wait "$pid"; then rc=$?` read the status of the negation, always 0: a
# crashed worker made the run report success.)
wait_all() {
    local status=0 rc pid
    for pid in "$@"; do
        rc=0
        wait "$pid" || rc=$?
        if (( status == 0 && rc != 0 )); then status=$rc; fi
    done
    return "$status"
}
# Sourced (the tests): the functions only.
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then return 0; fi

WORKERS=2
PROCS=2
RATE=none
CHECK=0
PYTHON=${PYTHON:-}
PORT=${MASTER_PORT:-29561}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --workers) WORKERS=$2; shift 2 ;;
        --procs-per-worker) PROCS=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --check) CHECK=1; shift ;;
        --python) PYTHON=$2; shift 2 ;;
        --port) PORT=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "netns_cluster.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [[ $# -eq 0 && $CHECK -eq 0 ]]; then
    echo "netns_cluster.sh: nothing to run: give -- SCRIPT.py [ARGS] and/or --check" >&2; exit 2
fi
if [[ $(id -u) -ne 0 ]]; then echo "netns_cluster.sh: needs root (network namespaces, tc)" >&2; exit 2; fi
if (( WORKERS < 2 || WORKERS > 8 )); then echo "netns_cluster.sh: --workers must be 2..8" >&2; exit 2; fi
HERE=$(cd "$(dirname "$0")/../.." && pwd)
if [[ -z "$PYTHON" ]]; then
    for candidate in "$HERE/.venv/bin/python" /work/venv/bin/python "$(command -v python3)"; do
        if [[ -x "$candidate" ]]; then PYTHON=$candidate; break; fi
    done
fi

PREFIX="edit$$"
NAMESPACES=()
PIDS=()

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    # Any process still inside one of our namespaces was started by this script: end it by id.
    for ns in "${NAMESPACES[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill "$pid" 2>/dev/null || true; done
    done
    for ns in "${NAMESPACES[@]}"; do ip netns del "$ns" 2>/dev/null || true; done  # removes their links
    exit "$status"
}
trap cleanup EXIT INT TERM

ns_of() { echo "$PREFIX-w$1"; }
addr_of() { echo "10.200.0.$(( $1 + 1 ))"; }

limit() {  # limit NS DEV: tbf on the egress of DEV inside NS
    local ns=$1 dev=$2
    [[ "$RATE" == none ]] && return 0
    # burst: one 64 KiB GSO segment plus headers (veth passes segments that large; a smaller
    # bucket could never send them), or 1 ms of rate if larger. A full bucket lets that much
    # through at veth speed after an idle period, so keep it small.
    local bits
    bits=$("$PYTHON" - "$RATE" <<'EOF'
import re, sys
m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", sys.argv[1].lower())
if not m: sys.exit(f"bad --rate {sys.argv[1]}: use e.g. 100mbit, 1gbit")
print(int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]))
EOF
)
    local burst=$(( bits / 8 / 1000 ))
    (( burst < 66000 )) && burst=66000
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$RATE" burst "$burst" latency 100ms
}

for (( w = 0; w < WORKERS; w++ )); do
    ns=$(ns_of $w)
    ip netns add "$ns"
    NAMESPACES+=("$ns")
    ip netns exec "$ns" ip link set lo up
done
if (( WORKERS == 2 )); then
    ip link add edw netns "$(ns_of 0)" type veth peer name edw netns "$(ns_of 1)"
else
    HUB="$PREFIX-hub"
    ip netns add "$HUB"
    NAMESPACES+=("$HUB")
    ip netns exec "$HUB" ip link set lo up
    ip netns exec "$HUB" ip link add br0 type bridge
    ip netns exec "$HUB" ip link set br0 up
    for (( w = 0; w < WORKERS; w++ )); do
        ip link add edw netns "$(ns_of $w)" type veth peer name "edh$w" netns "$HUB"
        ip netns exec "$HUB" ip link set "edh$w" master br0
        ip netns exec "$HUB" ip link set "edh$w" up
        limit "$HUB" "edh$w"  # bridge -> worker w
    done
fi
for (( w = 0; w < WORKERS; w++ )); do
    ns=$(ns_of $w)
    ip netns exec "$ns" ip addr add "$(addr_of $w)/24" dev edw
    ip netns exec "$ns" ip link set edw up
    limit "$ns" edw  # worker w -> peer / bridge
done
echo "netns_cluster: $WORKERS workers x $PROCS processes, links limited to $RATE (tbf, both directions)" >&2

if (( CHECK )); then
    ip netns exec "$(ns_of 1)" "$PYTHON" - "$(addr_of 1)" <<'EOF' &
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 29599)); s.listen(1)
conn, _ = s.accept()
while conn.recv(1 << 20):
    pass
EOF
    server=$!
    PIDS+=("$server")
    sleep 1
    ip netns exec "$(ns_of 0)" "$PYTHON" - "$(addr_of 1)" "$RATE" <<'EOF'
import socket, sys, time
c = socket.create_connection((sys.argv[1], 29599))
buf = b"\0" * (1 << 16)
sent, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < 0.5:  # fill the bucket's burst before timing
    sent += c.send(buf)
sent, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < 2.0:
    sent += c.send(buf)
elapsed = time.perf_counter() - t0
c.close()
print(f"netns_cluster: link check w0 -> w1 (tbf {sys.argv[2]}): {sent * 8 / elapsed / 1e6:.1f} Mbit/s "
      "(TCP payload, python sockets, 2 s)", flush=True)
EOF
    wait "$server" 2>/dev/null || true
fi

(( $# == 0 )) && exit 0
cd "$HERE"
for (( w = 0; w < WORKERS; w++ )); do
    ip netns exec "$(ns_of $w)" env GLOO_SOCKET_IFNAME=edw MASTER_ADDR="$(addr_of 0)" MASTER_PORT="$PORT" \
        NETNS_RATE="$RATE" NETNS_WORKER="$w" \
        "$PYTHON" -m torch.distributed.run --nnodes "$WORKERS" --node_rank "$w" --nproc_per_node "$PROCS" \
        --master_addr "$(addr_of 0)" --master_port "$PORT" "$@" &
    PIDS+=("$!")
done
status=0
wait_all "${PIDS[@]}" || status=$?
PIDS=()
exit "$status"
