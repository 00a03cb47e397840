#!/usr/bin/env bash
# Recovery from a lost rank (issue 41), in one command:
#
#   benches/recovery.sh [OUT]            (default docs/perf/recovery.txt)
#
# 1. Recovery time: N ranks (real processes, the store served apart as `weft run`'s launcher
#    serves it) all-reduce in a loop, one is SIGKILLed, the survivors agree and shrink; per size
#    (SIZES, default "4 16 64") and round (ROUNDS, default 3): each survivor's time from its
#    failed call to its shrunk communicator, the agreement's and the shrink's own times (median
#    and maximum over the survivors), from tests/recovery.rs's recovery_time_at_scale.
# 2. The healthy path: with OLD=path/to/a/weft built before recovery existed, that build against
#    this one on an 8-byte and a 1 MiB all-reduce, alternating runs (benches/ab_weft.sh): recovery
#    adds nothing to an operation, so the medians should match within the machine's noise.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/perf/recovery.txt}
sizes=${SIZES:-4 16 64}
rounds=${ROUNDS:-3}
cargo build --release --bin weft --test recovery >/dev/null 2>&1
{
  echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD), $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# 1. recovery: WEFT_TEST_RANKS=N cargo test --release --test recovery recovery_time_at_scale -- --ignored"
  for n in $sizes; do
    for _ in $(seq "$rounds"); do
      WEFT_TEST_RANKS=$n cargo test -q --release --test recovery recovery_time_at_scale -- --ignored --nocapture 2>/dev/null |
        grep '^RESULT' || echo "RESULT ranks=$n failed"
    done
  done
  if [ -n "${OLD:-}" ]; then
    echo "# 2. healthy path: benches/ab_weft.sh 7 all-reduce BYTES $OLD target/release/weft (µs per call)"
    for bytes in 8 1048576; do
      N=$([ "$bytes" = 8 ] && echo 20000 || echo 500) benches/ab_weft.sh 7 all-reduce "$bytes" "$OLD" target/release/weft
    done
  fi
} | tee "$out"
