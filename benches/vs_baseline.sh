#!/usr/bin/env bash
# weftcc next to the baselines in one go (the figures drift on shared machines, so quote ratios
# measured in the same run):  benches/vs_baseline.sh [ranks] [sizes...]
# Prints ../shared/peers/baseline.sh's memory, TCP and OpenMPI rows, then `weft perf all-reduce`
# over shared memory and over TCP (WEFT_SHM_DISABLE=1) at the same sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-2}
shift || true
sizes=${*:-8 1048576 134217728}
cargo build --release --bin weft -q
weft=target/release/weft
pattern="^ +($(echo "$sizes" | tr ' ' '|')) "
echo "== baseline ($n ranks)"
bash ../shared/peers/baseline.sh "$n" 2>/dev/null | grep -E "memcpy|receiver|==|$pattern|size"
for wire in shm tcp; do
  echo "== weft perf all-reduce, $n ranks, $wire"
  env $([ "$wire" = tcp ] && echo WEFT_SHM_DISABLE=1) "$weft" perf all-reduce --np "$n" -b 8 -e 128M \
    | grep -E "$pattern|#       size|Out of bounds"
done
