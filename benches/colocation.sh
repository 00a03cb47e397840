#!/usr/bin/env bash
# Whether the kernel puts weft's ranks on one CPU: runs `weft perf all-reduce --np 2` at 8 bytes
# for a few seconds and samples every 20 ms the CPU each rank last ran on (/proc/PID/stat field
# 39), then prints how many samples had both on the same CPU and the run's times.
#
#   benches/colocation.sh [WEFT]        (default target/release/weft; WEFT_CPU_BIND passes through)
#
# Meaningful on a machine where something else keeps a CPU busy (issue 44: unbound ranks shared
# one CPU in 91 of 100 samples while other programs ran, bound ranks never).
set -euo pipefail
cd "$(dirname "$0")/.."
weft=${1:-target/release/weft}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$weft" perf all-reduce --np 2 -b 8 -e 8 -n "${N:-400000}" -w 100 -a 3 >"$out" 2>&1 &
launcher=$!
sleep 0.5
read -r -a ranks <<<"$(pgrep -P "$launcher" | head -2 | tr '\n' ' ')"
same=0 total=0
for _ in $(seq 100); do
  cpus=()
  for p in "${ranks[@]}"; do
    c=$(awk '{ print $39 }' "/proc/$p/stat" 2>/dev/null) || break
    cpus+=("$c")
  done
  ((${#cpus[@]} == 2)) || break
  total=$((total + 1))
  [ "${cpus[0]}" = "${cpus[1]}" ] && same=$((same + 1))
  sleep 0.02
done
wait "$launcher"
echo "WEFT_CPU_BIND=${WEFT_CPU_BIND:-default}: both ranks on the same CPU in $same of $total samples;" \
  "$(awk '$1 == 8 { print "8 B all-reduce", $6, "us out of place,", $10, "in place" }' "$out")"
