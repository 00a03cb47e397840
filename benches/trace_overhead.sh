#!/usr/bin/env bash
# The flight recorder's cost on small collectives: `weft perf all-reduce` with the recorder off
# (WEFT_TRACE_BUFFER_SIZE=0) and on (the default), alternating rounds on the same machine;
# prints each round and the medians of the out-of-place time per size.
#   benches/trace_overhead.sh            ROUNDS=7 NP=2 SIZES="8 65536" ITERS=20000
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-7}
np=${NP:-2}
iters=${ITERS:-20000}
sizes=${SIZES:-"8 65536"}
cargo build --release --bin weft >&2
weft=target/release/weft
declare -A times
for r in $(seq 1 "$rounds"); do
  for mode in off on; do
    for s in $sizes; do
      if [ "$mode" = off ]; then buf=0; else buf=2000; fi
      t=$(WEFT_TRACE_BUFFER_SIZE=$buf "$weft" perf all-reduce -b "$s" -e "$s" --np "$np" -n "$iters" -w 500 |
        awk '!/^#/ && NF > 8 { print $6; exit }')
      echo "round $r $mode ${s}B: $t us"
      times[$mode,$s]="${times[$mode,$s]:-} $t"
    done
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
for s in $sizes; do
  off=$(echo "${times[off,$s]}" | median)
  on=$(echo "${times[on,$s]}" | median)
  echo "${s} B: median off ${off} us, on ${on} us, on/off $(awk -v a="$on" -v b="$off" 'BEGIN { printf "%.3f", a / b }')"
done
