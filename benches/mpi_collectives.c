/* OpenMPI counterpart of `weft perf`: times one MPI collective the way nccl-tests does and prints
 * the 6-column table `weft baseline-json` reads (size, count, time(us), algbw, busbw, #wrong).
 *
 *   mpirun -n N ./mpi_collectives COLLECTIVE DTYPE MINBYTES MAXBYTES \
 *          [ITERS_SMALL ITERS_MID ITERS_LARGE [WARMUP]]
 *
 * COLLECTIVE: all-reduce, all-gather, reduce-scatter, broadcast, reduce, all-to-all (MPI_Allreduce,
 *   MPI_Allgather, MPI_Reduce_scatter_block, MPI_Bcast, MPI_Reduce, MPI_Alltoall); reductions use
 *   MPI_SUM, broadcast and reduce use root 0.
 * DTYPE: int8, uint8, int32, uint32, int64, uint64, float, double (OpenMPI 4 has no standard
 *   16-bit float type, so half and bfloat16 are refused).
 * Sizes double from MINBYTES to MAXBYTES (K, M, G suffixes: binary). The size column follows
 *   nccl-tests: all-reduce, broadcast, reduce: count elements; all-gather, reduce-scatter,
 *   all-to-all: the whole buffer of count x ranks elements, where count (the printed column) is
 *   the per-rank block. Sizes are rounded down to whole elements (whole blocks); a size that holds
 *   none is skipped.
 * Iterations: ITERS_SMALL below 1 MiB, ITERS_MID below 16 MiB, ITERS_LARGE from 16 MiB on
 *   (default 200, 40, 10), after WARMUP untimed calls (default 5) and a barrier.
 * time = the MAXIMUM over ranks of each rank's average time per iteration (nccl-tests' -a 3;
 *   `weft perf -a 3` reports the same). algbw = size / time (GB/s, 1e9 bytes); busbw = algbw x
 *   2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
 *   broadcast and reduce.
 * #wrong: after timing, the output buffer is filled with 0xff bytes (a value no check expects),
 *   the collective runs once more and every rank counts the elements that differ from the exact
 *   expected value (inputs are small integers, so every sum is exact in every type up to 21
 *   ranks); the counts are summed over ranks. Only out-of-place calls are timed (MPI_Bcast has
 *   one buffer). */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum coll { ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE, ALL_TO_ALL };
static const struct { const char *name, *mpi_name; enum coll c; } COLLS[] = {
    {"all-reduce", "MPI_Allreduce", ALL_REDUCE},
    {"all-gather", "MPI_Allgather", ALL_GATHER},
    {"reduce-scatter", "MPI_Reduce_scatter_block", REDUCE_SCATTER},
    {"broadcast", "MPI_Bcast", BROADCAST},
    {"reduce", "MPI_Reduce", REDUCE},
    {"all-to-all", "MPI_Alltoall", ALL_TO_ALL},
};

enum kind { K_I8, K_U8, K_I32, K_U32, K_I64, K_U64, K_F32, K_F64 };
struct dtype { const char *name; enum kind k; size_t size; MPI_Datatype mpi; };

static int pick_dtype(const char *s, struct dtype *d) {
  const struct dtype all[] = {
      {"int8", K_I8, 1, MPI_INT8_T},     {"uint8", K_U8, 1, MPI_UINT8_T},
      {"int32", K_I32, 4, MPI_INT32_T},  {"uint32", K_U32, 4, MPI_UINT32_T},
      {"int64", K_I64, 8, MPI_INT64_T},  {"uint64", K_U64, 8, MPI_UINT64_T},
      {"float", K_F32, 4, MPI_FLOAT},    {"double", K_F64, 8, MPI_DOUBLE},
  };
  /* nccl-tests' aliases */
  if (!strcmp(s, "char")) s = "int8";
  if (!strcmp(s, "int")) s = "int32";
  if (!strcmp(s, "float32")) s = "float";
  if (!strcmp(s, "float64")) s = "double";
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (!strcmp(s, all[i].name)) { *d = all[i]; return 1; }
  return 0;
}

static void put(const struct dtype *d, void *buf, size_t i, long v) {
  switch (d->k) {
    case K_I8: ((int8_t *)buf)[i] = (int8_t)v; break;
    case K_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case K_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case K_U32: ((uint32_t *)buf)[i] = (uint32_t)v; break;
    case K_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case K_U64: ((uint64_t *)buf)[i] = (uint64_t)v; break;
    case K_F32: ((float *)buf)[i] = (float)v; break;
    case K_F64: ((double *)buf)[i] = (double)v; break;
  }
}

/* The element as a double (NaN for the 0xff-filled float sentinel, which then never matches). */
static double get(const struct dtype *d, const void *buf, size_t i) {
  switch (d->k) {
    case K_I8: return ((const int8_t *)buf)[i];
    case K_U8: return ((const uint8_t *)buf)[i];
    case K_I32: return ((const int32_t *)buf)[i];
    case K_U32: return ((const uint32_t *)buf)[i];
    case K_I64: return (double)((const int64_t *)buf)[i];
    case K_U64: return (double)((const uint64_t *)buf)[i];
    case K_F32: return ((const float *)buf)[i];
    case K_F64: return ((const double *)buf)[i];
  }
  return 0;
}

/* Element i of rank r's send buffer: a small integer (0..6). */
static long value(int r, size_t i) { return (long)((3 * (size_t)r + i) % 7); }

static long sum_over_ranks(int n, size_t i) {
  long s = 0;
  for (int r = 0; r < n; r++) s += value(r, i);
  return s;
}

static long parse_size(const char *s) {
  char *end;
  long v = strtol(s, &end, 10);
  switch (*end) {
    case 'K': case 'k': v <<= 10; break;
    case 'M': case 'm': v <<= 20; break;
    case 'G': case 'g': v <<= 30; break;
  }
  return v;
}

static void run(enum coll c, const struct dtype *d, const void *send, void *recv, size_t count) {
  int cnt = (int)count;
  switch (c) {
    case ALL_REDUCE: MPI_Allreduce(send, recv, cnt, d->mpi, MPI_SUM, MPI_COMM_WORLD); break;
    case ALL_GATHER: MPI_Allgather(send, cnt, d->mpi, recv, cnt, d->mpi, MPI_COMM_WORLD); break;
    case REDUCE_SCATTER:
      MPI_Reduce_scatter_block(send, recv, cnt, d->mpi, MPI_SUM, MPI_COMM_WORLD);
      break;
    case BROADCAST: MPI_Bcast(recv, cnt, d->mpi, 0, MPI_COMM_WORLD); break;
    case REDUCE: MPI_Reduce(send, recv, cnt, d->mpi, MPI_SUM, 0, MPI_COMM_WORLD); break;
    case ALL_TO_ALL: MPI_Alltoall(send, cnt, d->mpi, recv, cnt, d->mpi, MPI_COMM_WORLD); break;
  }
}

/* Elements of this rank's output that differ from the expected values (count per rank). */
static long count_wrong(enum coll c, const struct dtype *d, const void *recv, size_t count,
                        int me, int n) {
  long wrong = 0;
  switch (c) {
    case ALL_REDUCE:
      for (size_t i = 0; i < count; i++) wrong += get(d, recv, i) != (double)sum_over_ranks(n, i);
      break;
    case REDUCE:
      if (me == 0)
        for (size_t i = 0; i < count; i++)
          wrong += get(d, recv, i) != (double)sum_over_ranks(n, i);
      break;
    case BROADCAST:
      for (size_t i = 0; i < count; i++) wrong += get(d, recv, i) != (double)value(0, i);
      break;
    case ALL_GATHER:
      for (int r = 0; r < n; r++)
        for (size_t j = 0; j < count; j++)
          wrong += get(d, recv, r * count + j) != (double)value(r, j);
      break;
    case REDUCE_SCATTER:
      for (size_t j = 0; j < count; j++)
        wrong += get(d, recv, j) != (double)sum_over_ranks(n, me * count + j);
      break;
    case ALL_TO_ALL:
      for (int s = 0; s < n; s++)
        for (size_t j = 0; j < count; j++)
          wrong += get(d, recv, s * count + j) != (double)value(s, me * count + j);
      break;
  }
  return wrong;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int me, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const char *usage =
      "usage: mpi_collectives COLLECTIVE DTYPE MINBYTES MAXBYTES [ITERS_SMALL ITERS_MID "
      "ITERS_LARGE [WARMUP]]\n";
  if (argc < 5) {
    if (me == 0) fputs(usage, stderr);
    MPI_Finalize();
    return 2;
  }
  int ci = -1;
  for (size_t i = 0; i < sizeof COLLS / sizeof COLLS[0]; i++)
    if (!strcmp(argv[1], COLLS[i].name)) ci = (int)i;
  struct dtype d;
  if (ci < 0 || !pick_dtype(argv[2], &d)) {
    if (me == 0)
      fprintf(stderr, "mpi_collectives: unknown collective or type (%s %s)\n%s", argv[1],
              argv[2], usage);
    MPI_Finalize();
    return 2;
  }
  enum coll c = COLLS[ci].c;
  long minb = parse_size(argv[3]), maxb = parse_size(argv[4]);
  int iters_band[3] = {200, 40, 10}, warmup = 5;
  for (int k = 0; k < 3 && 5 + k < argc; k++) iters_band[k] = atoi(argv[5 + k]);
  if (argc > 8) warmup = atoi(argv[8]);
  if (minb < 1 || maxb < minb || iters_band[0] < 1 || iters_band[1] < 1 || iters_band[2] < 1 ||
      warmup < 0) {
    if (me == 0) fprintf(stderr, "mpi_collectives: bad sizes or iteration counts\n%s", usage);
    MPI_Finalize();
    return 2;
  }
  int full = c == ALL_GATHER || c == REDUCE_SCATTER || c == ALL_TO_ALL;
  double bus = c == ALL_REDUCE ? 2.0 * (n - 1) / n : full ? (double)(n - 1) / n : 1.0;

  /* Both buffers hold the largest size; the send buffer's pattern depends only on the index. */
  size_t cap = (size_t)maxb / d.size + 1;
  void *send = malloc(cap * d.size), *recv = malloc(cap * d.size);
  if (!send || !recv) {
    fprintf(stderr, "mpi_collectives: cannot allocate 2 x %ld bytes\n", maxb);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  for (size_t i = 0; i < cap; i++) put(&d, send, i, value(me, i));

  if (me == 0) {
    printf("# mpi_collectives %s (%s, %s%s), %d ranks, warm-up %d, iters %d/%d/%d "
           "(<1M/<16M/>=16M)\n",
           COLLS[ci].name, COLLS[ci].mpi_name, d.name,
           c == ALL_REDUCE || c == REDUCE || c == REDUCE_SCATTER ? " sum" : "", n, warmup,
           iters_band[0], iters_band[1], iters_band[2]);
    printf("# time: maximum over ranks of the average per iteration; size and count as in "
           "nccl-tests; busbw factor %.4f\n",
           bus);
    printf("== OpenMPI %s %s, %d ranks\n", COLLS[ci].mpi_name, d.name, n);
    printf("%12s %12s %10s %10s %10s %7s\n", "size", "count", "time(us)", "algbw", "busbw",
           "#wrong");
    fflush(stdout);
  }
  for (long b = minb; b <= maxb; b *= 2) {
    size_t unit = d.size * (full ? (size_t)n : 1);
    size_t count = (size_t)b / unit, bytes = count * unit;
    if (count == 0) continue;
    if (count > 0x7fffffff) {
      if (me == 0) fprintf(stderr, "mpi_collectives: count %zu does not fit an int\n", count);
      break;
    }
    int iters = b < (1L << 20) ? iters_band[0] : b < (16L << 20) ? iters_band[1] : iters_band[2];
    if (c == BROADCAST && me == 0) memcpy(recv, send, count * d.size);
    for (int w = 0; w < warmup; w++) run(c, &d, send, recv, count);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int it = 0; it < iters; it++) run(c, &d, send, recv, count);
    double t = (MPI_Wtime() - t0) / iters, tmax;
    MPI_Reduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

    /* Check: the output starts as 0xff bytes (the broadcast root keeps its data). */
    size_t out_len = c == ALL_GATHER || c == ALL_TO_ALL ? (size_t)n * count : count;
    if (!(c == BROADCAST && me == 0)) memset(recv, 0xff, out_len * d.size);
    run(c, &d, send, recv, count);
    long wrong = count_wrong(c, &d, recv, count, me, n), wrong_all;
    MPI_Reduce(&wrong, &wrong_all, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    if (me == 0) {
      double alg = (double)bytes / tmax / 1e9;
      printf("%12zu %12zu %10.2f %10.3f %10.3f %7ld\n", bytes, count, tmax * 1e6, alg, alg * bus,
             wrong_all);
      fflush(stdout);
    }
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
