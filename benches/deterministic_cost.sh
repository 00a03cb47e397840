#!/usr/bin/env bash
# What deterministic reductions cost: `weft perf all-reduce` (float sum) with WEFT_DETERMINISTIC
# unset (the tuner's algorithm) and =1 (the rank-order fold), alternating rounds on the same
# machine; prints each round and the medians of the out-of-place time per rank count and size.
#   benches/deterministic_cost.sh     ROUNDS=5 NPS="2 4" SIZES="8 1048576 134217728"
# Iterations per run shrink with the size (ITERS_SMALL, ITERS_LARGE).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-5}
nps=${NPS:-"2 4"}
sizes=${SIZES:-"8 1048576 134217728"}
cargo build --release --bin weft >&2
weft=target/release/weft
declare -A times
for r in $(seq 1 "$rounds"); do
  for np in $nps; do
    for s in $sizes; do
      if [ "$s" -ge 16777216 ]; then iters=${ITERS_LARGE:-5}; warm=1;
      elif [ "$s" -ge 65536 ]; then iters=200; warm=20;
      else iters=${ITERS_SMALL:-5000}; warm=200; fi
      for mode in default deterministic; do
        if [ "$mode" = default ]; then det=0; else det=1; fi
        t=$(WEFT_DETERMINISTIC=$det "$weft" perf all-reduce -b "$s" -e "$s" --np "$np" -n "$iters" -w "$warm" |
          awk '!/^#/ && NF > 8 { print $6; exit }')
        echo "round $r np $np $mode ${s}B: $t us"
        times[$mode,$np,$s]="${times[$mode,$np,$s]:-} $t"
      done
    done
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
for np in $nps; do
  for s in $sizes; do
    d=$(echo "${times[default,$np,$s]}" | median)
    o=$(echo "${times[deterministic,$np,$s]}" | median)
    echo "np $np ${s} B: median default ${d} us, deterministic ${o} us, deterministic/default $(awk -v a="$o" -v b="$d" 'BEGIN { printf "%.2f", a / b }')"
  done
done
