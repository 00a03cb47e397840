#!/usr/bin/env bash
# This machine's limits and OpenMPI's all-reduce, to quote weftcc's figures against (as ratios
# measured in the same run: figures drift on shared machines):
#   benches/baseline.sh [ranks] [minbytes] [maxbytes]      (default 2 8 128M)
# Prints, in the format `weft baseline-json` reads:
#   == memory limit          memcpy and a += b bandwidth of one thread (benches/baseline/memcpy_bw.c)
#   == TCP loopback limit    iperf3, one stream, 3 s, on 127.0.0.1
#   == OpenMPI MPI_Allreduce float sum on N ranks, nccl-tests columns (benches/mpi_collectives.c:
#                            size, count, time(us), algbw, busbw, #wrong; time the maximum over ranks)
# Needs a C compiler, OpenMPI (mpicc, mpirun) and iperf3: see benches/need.sh for what happens
# when one is missing. Builds into target/perf/bin (WEFT_PERF_OUT/bin).
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/need.sh
n=${1:-2}
minb=${2:-8}
maxb=${3:-128M}
need cc build-essential "a C compiler"
need mpicc "openmpi-bin libopenmpi-dev" "OpenMPI"
need mpirun "openmpi-bin" "OpenMPI's mpirun"
need iperf3 iperf3 "iperf3"
bin=${WEFT_PERF_OUT:-target/perf}/bin
mkdir -p "$bin"
cc -O3 -march=native -o "$bin/memcpy_bw" benches/baseline/memcpy_bw.c
mpicc -O3 -o "$bin/mpi_collectives" benches/mpi_collectives.c
echo "== memory limit"
"$bin/memcpy_bw" 256
echo "== TCP loopback limit (iperf3, 1 stream, 3 s)"
port=${IPERF_PORT:-5599}
iperf3 -s -1 -p "$port" >/dev/null 2>&1 &
server=$!
sleep 0.5
iperf3 -c 127.0.0.1 -p "$port" -t 3 -f G 2>&1 | grep receiver ||
  echo "baseline.sh: iperf3 gave no figure (port $port taken? IPERF_PORT=... picks another)" >&2
wait "$server" 2>/dev/null || true
echo "== OpenMPI MPI_Allreduce, $n ranks (shared memory)"
mpirun --allow-run-as-root --oversubscribe -n "$n" "$bin/mpi_collectives" all-reduce float "$minb" "$maxb"
