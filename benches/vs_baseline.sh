#!/usr/bin/env bash
# weftcc next to the baselines in one go (the figures drift on shared machines, so quote ratios
# measured in the same run):  benches/vs_baseline.sh [ranks] [sizes...]
# Prints benches/baseline.sh's memory, TCP and OpenMPI rows, then `weft perf all-reduce`
# over shared memory and over TCP (WEFT_SHM_DISABLE=1) at the same sizes, then a ratio table
# (weft busbw / OpenMPI busbw, out-of-place and in-place). Leaves the baseline as JSON, weft's
# rows as JSON and an SVG plot of both in target/perf/ (WEFT_PERF_OUT overrides).
# Extra environment for the weft runs (e.g. WEFT_SHM_CMA=0) passes through. weft's time is the
# maximum over ranks (-a 3), as the OpenMPI baseline reports it. mpirun binds OpenMPI's ranks to
# cores, weft perf gives each of its own a share of the CPUs (WEFT_CPU_BIND=none: unbound).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-2}
shift || true
sizes=${*:-8 1048576 134217728}
out=${WEFT_PERF_OUT:-target/perf}
mkdir -p "$out"
cargo build --release --bin weft -q
weft=target/release/weft
pattern="^ +($(echo "$sizes" | tr ' ' '|')) "
echo "== baseline ($n ranks)"
# Its messages (a missing OpenMPI or iperf3, with how to install it) reach the terminal.
benches/baseline.sh "$n" >"$out/baseline-$n.txt"
grep -E "memcpy|receiver|==|$pattern|size" "$out/baseline-$n.txt"
"$weft" baseline-json "$out/baseline-$n.txt" -o "$out/baseline-$n.json"
for wire in shm tcp; do
  echo "== weft perf all-reduce, $n ranks, $wire"
  env $([ "$wire" = tcp ] && echo WEFT_SHM_DISABLE=1) "$weft" perf all-reduce --np "$n" -a 3 -b 8 -e 128M -n 200 -w 20 \
    --json "$out/weft-$wire-$n.json" --plot "$out/all-reduce-$wire-$n.svg" \
    --baseline "$out/baseline-$n.json" >"$out/weft-$wire-$n.txt"
  grep -E "$pattern|#       size|Out of bounds" "$out/weft-$wire-$n.txt"
done
echo "== ratio weft/OpenMPI busbw (>1: weft faster; time ratio for sizes under 4 KiB), $n ranks"
printf "%12s %12s %12s %12s %12s\n" size shm-oop shm-ip tcp-oop tcp-ip
awk -v sizes="$sizes" '
  BEGIN { split(sizes, want, " ") }
  FNR == 1 { file++ }
  file == 1 && NF == 6 && $1 ~ /^[0-9]+$/ { mpi_t[$1] = $3; mpi_b[$1] = $5 }
  file >= 2 && NF >= 13 && $1 ~ /^[0-9]+$/ { t[file, $1] = $6 " " $10; b[file, $1] = $8 " " $12 }
  END {
    for (i = 1; i in want; i++) {
      s = want[i]; line = sprintf("%12s", s)
      for (f = 2; f <= 3; f++) {
        if (s < 4096) { split(t[f, s], v, " "); line = line sprintf(" %12.2f %12.2f", mpi_t[s] / v[1], mpi_t[s] / v[2]) }
        else { split(b[f, s], v, " "); line = line sprintf(" %12.2f %12.2f", v[1] / mpi_b[s], v[2] / mpi_b[s]) }
      }
      print line
    }
  }' "$out/baseline-$n.txt" "$out/weft-shm-$n.txt" "$out/weft-tcp-$n.txt"
echo "== files: $out/baseline-$n.json $out/weft-{shm,tcp}-$n.json $out/all-reduce-{shm,tcp}-$n.svg"
