#!/usr/bin/env bash
# How weftcc's set-up scales with the number of local ranks (issue 18's table): for each N,
# `weft perf all-reduce --np N` is run three times and measured from outside.
#
#   benches/scale.sh [N...]            (default: 8 32 64)
#
# Columns: init (launch to the header, which rank 0 prints once every communicator exists and the
# ranks have exchanged their host names), first (the first 8-byte all-reduce, -w 0 -n 1, µs),
# steady (8-byte all-reduce, 2000 iterations after 200 of warm-up, µs), shm (peak /dev/shm used
# by the job, MiB), rss (largest worker RSS, MiB), fds (most open files of one worker), conns
# (connections per rank after the sweep, from WEFT_DEBUG=INFO's "connected" lines), wrong (values
# wrong in an 8 B … 64 KiB sweep), left (weft segments left in /dev/shm afterwards).
# Environment: WEFT (the binary, default target/release/weft), WIRE=tcp (WEFT_SHM_DISABLE=1),
# WEFT_CONNECT=eager (connect every pair at init, as before on-demand connections).
set -euo pipefail
cd "$(dirname "$0")/.."
weft=${WEFT:-target/release/weft}
[ -x "$weft" ] || cargo build --release --bin weft >/dev/null
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(8 32 64)
if [ "${WIRE:-shm}" = tcp ]; then export WEFT_SHM_DISABLE=1; fi

. benches/scale_common.sh

printf '%6s %8s %9s %9s %8s %8s %6s %6s %6s %5s\n' \
  ranks init-s first-us steady-us shm-MiB rss-MiB fds conns wrong left
for n in "${sizes[@]}"; do
  before=$(segments)
  # 1. Init and first call, with the connection log.
  log=$(mktemp)
  t0=$(date +%s.%N)
  first=$(WEFT_DEBUG=INFO WEFT_DEBUG_SUBSYS=INIT "$weft" perf all-reduce --np "$n" -b 8 -e 8 \
    -w 0 -n 1 -a 3 2>"$log" | while IFS= read -r line; do
      case $line in "# weft perf"*) echo "header $(date +%s.%N)" ;; esac
      echo "$line"
    done)
  header=$(echo "$first" | awk '$1 == "header" { print $2; exit }')
  init=$(awk -v a="$t0" -v b="$header" 'BEGIN { printf "%.2f", b - a }')
  first_us=$(echo "$first" | grep -v '^header' | row_time)
  rm -f "$log"
  # 2. Steady state.
  steady=$("$weft" perf all-reduce --np "$n" -b 8 -e 8 -w 200 -n 2000 -a 3 2>/dev/null | row_time)
  # 3. A sweep, sampled from outside.
  base=$(shm_used)
  out=$(mktemp)
  log=$(mktemp)
  WEFT_DEBUG=INFO WEFT_DEBUG_SUBSYS=INIT "$weft" perf all-reduce --np "$n" -b 8 -e 64K -w 5 \
    -n 20 >"$out" 2>"$log" &
  launcher=$!
  read -r peak rss fds < <(sample "$base" "$launcher")
  wait "$launcher" || true
  wrong=$(awk '/Out of bounds values/ { print $7; exit }' "$out")
  rm -f "$out"
  conns=$(grep -c ' connected' "$log" || true)
  conns=$(awk -v c="$conns" -v n="$n" 'BEGIN { printf "%.1f", c / n }')
  rm -f "$log"
  left=$(( $(segments) - before ))
  printf '%6s %8s %9s %9s %8s %8s %6s %6s %6s %5s\n' "$n" "$init" "$first_us" "$steady" \
    "$(( peak / 1048576 ))" "$(( rss / 1024 ))" "$fds" "$conns" "${wrong:-?}" "$left"
done
