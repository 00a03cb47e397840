#!/usr/bin/env bash
# The measurements of issue 44 (steady speed, small messages against OpenMPI), in one command:
#
#   benches/issue44.sh [OUTDIR]        (default docs/perf/issue44)
#
# 1. all-reduce, 2 ranks, the issue's sizes, 7 alternating rounds (each side's min/median/max
#    per size: the steadiness goal, and the medians: the small-message goal for all-reduce);
# 2. every collective, 2 ranks, 8 B to 4 KiB, 7 rounds (the small-message goal);
# 3. every collective, 4 ranks on this host, 8 B to 4 KiB, 7 rounds, both sides unbound;
# 4. benches/episodes.sh: OpenMPI and weft side by side per round with the machine's state;
# 5. with OLD=path/to/an/older/weft: that build against this one, alternating, at 8 B, 64 KiB,
#    1 MiB, 16 MiB and 128 MiB all-reduce (benches/ab_weft.sh; no large-message median slower).
# Each part's full output goes to OUTDIR/<part>.txt. Takes about 15 minutes on the 2-core VM;
# run it on a quiet machine (`uptime`), nothing else building. REPEAT (default 7) changes the
# number of rounds of every part.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-docs/perf/issue44}
mkdir -p "$dir"
stamp() { echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD), $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1-3 /proc/loadavg)"; }
small="8 16 32 64 128 256 512 1K 2K 4K"
rounds=${REPEAT:-7}

{
  stamp
  echo "# REPEAT=$rounds COLLECTIVES=all-reduce SIZES=\"8 1K 64K 1M 16M 128M\" benches/vs_mpi_collectives.sh 2"
  REPEAT=$rounds COLLECTIVES=all-reduce SIZES="8 1K 64K 1M 16M 128M" WEFT_PERF_OUT=target/perf/issue44-a \
    benches/vs_mpi_collectives.sh 2 2>/dev/null
} | tee "$dir/all-reduce-2.txt"

{
  stamp
  echo "# REPEAT=$rounds SIZES=\"$small\" ITERS=\"20000 200 20\" WARMUP=200 benches/vs_mpi_collectives.sh 2"
  REPEAT=$rounds SIZES="$small" ITERS="20000 200 20" WARMUP=200 WEFT_PERF_OUT=target/perf/issue44-b \
    benches/vs_mpi_collectives.sh 2 2>/dev/null
} | tee "$dir/small-2.txt"

{
  stamp
  echo "# REPEAT=$rounds SIZES=\"$small\" ITERS=\"5000 200 20\" WARMUP=100 MPIRUN_ARGS=\"--bind-to none\" benches/vs_mpi_collectives.sh 4"
  REPEAT=$rounds SIZES="$small" ITERS="5000 200 20" WARMUP=100 MPIRUN_ARGS="--bind-to none" \
    WEFT_PERF_OUT=target/perf/issue44-c benches/vs_mpi_collectives.sh 4 2>/dev/null
} | tee "$dir/small-4.txt"

{
  stamp
  echo "# REPEAT=$rounds benches/episodes.sh 64K 1M 16M"
  REPEAT=$rounds OUT=target/perf/issue44-d benches/episodes.sh 64K 1M 16M
} | tee "$dir/episodes.txt"

if [ -n "${OLD:-}" ]; then
  cp target/release/weft target/perf/issue44-new-weft
  {
    stamp
    echo "# OLD=$OLD: benches/ab_weft.sh ROUNDS all-reduce SIZE OLD NEW, alternating runs"
    N=50000 benches/ab_weft.sh "$rounds" all-reduce 8 "$OLD" target/perf/issue44-new-weft
    N=2000 W=200 benches/ab_weft.sh "$rounds" all-reduce 65536 "$OLD" target/perf/issue44-new-weft
    N=200 W=20 benches/ab_weft.sh "$rounds" all-reduce 1048576 "$OLD" target/perf/issue44-new-weft
    N=20 W=3 benches/ab_weft.sh "$rounds" all-reduce 16777216 "$OLD" target/perf/issue44-new-weft
    N=5 W=2 benches/ab_weft.sh "$rounds" all-reduce 134217728 "$OLD" target/perf/issue44-new-weft
  } | tee "$dir/ab-old-new.txt"
fi
