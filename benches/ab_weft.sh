#!/usr/bin/env bash
# Compares two weft builds on one collective and size by alternating their runs (A, B, A, B, …),
# so that both sides see the same machine states: this VM's small-message latency moves between
# states up to 2x apart from one minute to the next.
#
#   benches/ab_weft.sh ROUNDS COLLECTIVE BYTES WEFT_A WEFT_B [NP]
#
# e.g. `cp target/release/weft /tmp/weft-old`, rebuild, then
#   benches/ab_weft.sh 8 all-reduce 8 /tmp/weft-old target/release/weft
# Prints per build and column (out of place, in place) the minimum, lower quartile and median of
# the per-run times (`weft perf -a 3`: the maximum over ranks of the mean per iteration, µs) and
# every value. Environment: N (iterations per run, default 50000), W (warm-up, default 2000),
# BIND (prefix such as `WEFT_CPU_BIND=none`, default none: the launcher's own default binding).
set -euo pipefail
if [ $# -lt 5 ]; then
  sed -n 2,13p "$0"
  exit 2
fi
rounds=$1 coll=$2 bytes=$3 a=$4 b=$5 np=${6:-2}
iters=${N:-50000}
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
for _ in $(seq "$rounds"); do
  for bin in "$a" "$b"; do
    env ${BIND:-} "$bin" perf "$coll" --np "$np" -b "$bytes" -e "$bytes" -n "$iters" -w "${W:-2000}" -a 3 2>&1 |
      awk -v who="$bin" -v size="$bytes" '$1 == size { print who, $6, $10 }'
  done
done >"$raw"
for bin in "$a" "$b"; do
  for col in 2 3; do
    awk -v who="$bin" -v c="$col" '$1 == who { print $c }' "$raw" | sort -n |
      awk -v who="$bin" -v name="$([ "$col" = 2 ] && echo oop || echo ip)" '
        { v[NR] = $1 }
        END {
          if (NR == 0) { print who, name, "no results"; exit }
          printf "%s %s min %.2f q1 %.2f median %.2f  all:", who, name, v[1], v[int((NR + 3) / 4)], v[int((NR + 1) / 2)]
          for (i = 1; i <= NR; i++) printf " %s", v[i]
          print ""
        }'
  done
done
