/* 8-byte all-reduce latency through the C ABI (libweft), for the Python overhead comparison
 * (benches/python_overhead.sh): `weft run -n 2 ./c_abi_allreduce [iterations]`. Prints rank 0's
 * µs per call. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "weftcc.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 20000;
  weftComm_t comm;
  if (weftCommInitFromEnv(&comm) != weftSuccess) {
    fprintf(stderr, "init: %s\n", weftGetLastError(NULL));
    return 1;
  }
  int rank = 0;
  weftCommUserRank(comm, &rank);
  float x[2] = {1, 2};
  for (int i = 0; i < 100; i++) weftAllReduce(x, x, 2, weftFloat32, weftSum, comm, NULL);
  weftBarrier(comm);
  double start = now();
  for (int i = 0; i < iters; i++) {
    if (weftAllReduce(x, x, 2, weftFloat32, weftSum, comm, NULL) != weftSuccess) {
      fprintf(stderr, "all-reduce: %s\n", weftGetLastError(comm));
      return 1;
    }
  }
  double us = (now() - start) / iters * 1e6;
  if (rank == 0) printf("c_abi_8B_us %.2f\n", us);
  weftCommDestroy(comm);
  return 0;
}
