#!/usr/bin/env bash
# How weftcc scales across "hosts" (issue 18's multi-host row): H network namespaces joined by a
# bridge, R ranks in each (`weft run --nnodes H --node-rank k -n R -- weft perf all-reduce`), so
# ranks of one namespace use shared memory (same WEFT_HOST_ID) and ranks of different namespaces
# TCP over the veth links. Needs root and iproute2; everything it makes carries this script's pid
# and is deleted when it exits, failed or not.
#
#   benches/scale_hosts.sh [HOSTS] [RANKS_PER_HOST]     (default: 8 64, i.e. 512 ranks)
#
# Columns as benches/scale.sh: init (launch to rank 0's header), first (first 8-byte all-reduce,
# µs), steady (8-byte all-reduce, -w 5 -n 50, µs), shm (peak /dev/shm, MiB), rss (largest
# worker RSS, MiB), fds (most open files of one worker), conns (connections per rank after the
# sweep, and of them over TCP), wrong (values wrong in an 8 B … 64 KiB sweep), left (weft
# segments left in /dev/shm).
# Environment: WEFT (the binary, default target/release/weft), WIRE=tcp (TCP inside a namespace
# too, WEFT_SHM_DISABLE=1), WEFT_CONNECT=eager, PORT (rank 0's port, default 29611).
set -euo pipefail
cd "$(dirname "$0")/.."
weft=$(realpath "${WEFT:-target/release/weft}")
[ -x "$weft" ] || { cargo build --release --bin weft >/dev/null; weft=$(realpath target/release/weft); }
hosts=${1:-8}
per=${2:-64}
n=$(( hosts * per ))
port=${PORT:-29611}
[ "$(id -u)" = 0 ] || { echo "scale_hosts: needs root (network namespaces)"; exit 2; }
if [ "${WIRE:-shm}" = tcp ]; then export WEFT_SHM_DISABLE=1; fi

tag=$(printf '%x' $(( $$ % 0xfffff )))
subnet=$(( 16 + $$ % 200 ))
switch="wsc-$tag-sw"
ns() { echo "wsc-$tag-$1"; }
ip_of() { echo "10.232.$subnet.$(( $1 + 1 ))"; }

cleanup() {
  for k in $(seq 0 $(( hosts - 1 ))); do ip netns del "$(ns "$k")" 2>/dev/null || true; done
  ip netns del "$switch" 2>/dev/null || true
}
trap cleanup EXIT
trap "exit 130" INT TERM

# The switch: a bridge in its own namespace, one veth pair per host.
ip netns add "$switch"
ip -n "$switch" link add br0 type bridge
ip -n "$switch" link set br0 up
for k in $(seq 0 $(( hosts - 1 ))); do
  h=$(ns "$k")
  ip netns add "$h"
  ip link add "ws${tag}h$k" type veth peer name "ws${tag}s$k"
  ip link set "ws${tag}h$k" netns "$h"
  ip link set "ws${tag}s$k" netns "$switch"
  ip -n "$switch" link set "ws${tag}s$k" master br0
  ip -n "$switch" link set "ws${tag}s$k" up
  ip -n "$h" addr add "$(ip_of "$k")/24" dev "ws${tag}h$k"
  ip -n "$h" link set "ws${tag}h$k" up
  ip -n "$h" link set lo up
done

. benches/scale_common.sh

# Starts the job: one `weft run` per namespace, in the background; node 0's stdout to $1, every
# node's stderr to $2. The launchers' pids go to the array `pids`.
launch() {
  local out=$1 log=$2
  shift 2
  local token="scale$$-$RANDOM"
  pids=()
  for k in $(seq 0 $(( hosts - 1 ))); do
    local dst=/dev/null
    [ "$k" = 0 ] && dst=$out
    ip netns exec "$(ns "$k")" env WEFT_HOST_ID="scale-host-$k" \
      WEFT_SOCKET_IFNAME="=ws${tag}h$k" WEFT_JOB_TOKEN="$token" WEFT_TIMEOUT=300 \
      "$weft" run --nnodes "$hosts" --node-rank "$k" --master-addr "$(ip_of 0)" \
      --master-port "$port" -n "$per" --no-prefix -- "$weft" perf all-reduce "$@" \
      >"$dst" 2>>"$log" &
    pids+=($!)
  done
}

wait_all() { local rc=0; for p in "$@"; do wait "$p" || rc=$?; done; return $rc; }

echo "# $hosts namespaces x $per ranks = $n ranks; wire: ${WIRE:-shm inside, tcp across}"
printf '%6s %8s %9s %9s %8s %8s %6s %10s %6s %5s\n' \
  ranks init-s first-us steady-us shm-MiB rss-MiB fds conns/tcp wrong left
before=$(segments)

# 1. Init and the first call.
out=$(mktemp); log=$(mktemp)
t0=$(date +%s.%N)
launch "$out" "$log" -b 8 -e 8 -w 0 -n 1 -a 3
header=""
while [ -z "$header" ]; do
  if grep -q '^# weft perf' "$out" 2>/dev/null; then header=$(date +%s.%N); break; fi
  alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ "$alive" = 1 ] || break
  sleep 0.02
done
wait_all "${pids[@]}" || { echo "scale_hosts: the first run failed"; tail -20 "$log"; exit 1; }
init=$(awk -v a="$t0" -v b="${header:-$t0}" 'BEGIN { printf "%.2f", b - a }')
first_us=$(row_time <"$out")
rm -f "$out" "$log"

# 2. Steady state.
out=$(mktemp); log=$(mktemp)
launch "$out" "$log" -b 8 -e 8 -w 5 -n 50
wait_all "${pids[@]}" || { echo "scale_hosts: the steady run failed"; tail -20 "$log"; exit 1; }
steady=$(row_time <"$out")
rm -f "$out" "$log"

# 3. A sweep with connection logs, sampled from outside.
base=$(shm_used)
out=$(mktemp); log=$(mktemp)
export WEFT_DEBUG=INFO WEFT_DEBUG_SUBSYS=INIT
launch "$out" "$log" -b 8 -e 64K -w 5 -n 20
unset WEFT_DEBUG WEFT_DEBUG_SUBSYS
read -r peak rss fds < <(sample "$base" "${pids[@]}")
wait_all "${pids[@]}" || { echo "scale_hosts: the sweep failed"; tail -20 "$log"; }
wrong=$(awk '/Out of bounds values/ { print $7; exit }' "$out")
conns=$(grep -c ' connected' "$log" || true)
tcp=$(grep ' connected' "$log" | grep -c 'transport=.\?tcp' || true)
conns=$(awk -v c="$conns" -v t="$tcp" -v n="$n" 'BEGIN { printf "%.1f/%.1f", c / n, t / n }')
rm -f "$out" "$log"
left=$(( $(segments) - before ))
printf '%6s %8s %9s %9s %8s %8s %6s %10s %6s %5s\n' "$n" "$init" "$first_us" "$steady" \
  "$(( peak / 1048576 ))" "$(( rss / 1024 ))" "$fds" "$conns" "${wrong:-?}" "$left"
