/* An NCCL program, compiled against NVIDIA's nccl.h and linked with weftcc's libnccl.so.2
 * (started by tests/nccl_dropin.rs), with host buffers (NULL streams: weftcc's extension).
 *
 *   nccl_ranks job DIR   one rank of a job under `weft run` (RANK, WORLD_SIZE); rank 0 makes
 *                        the unique ids and shares them through files in DIR
 *   nccl_ranks local N   one process driving N ranks (ncclCommInitAll, grouped inits, groups
 *                        across communicators, non-blocking inits)
 *
 * Every result is checked against values computed here; each failure prints the rank and the
 * check and makes the exit status non-zero. */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <nccl.h>

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"

/* A call that must fail with `want` and leave a message naming `word`. */
#define FAILS(call, want, word)                                                          \
  do {                                                                                   \
    ncclResult_t r_ = (call);                                                            \
    const char *m_ = ncclGetLastError(NULL);                                             \
    CHECK(r_ == (want), "%s -> %d, want %d (%s)", #call, (int)r_, (int)(want), m_);      \
    CHECK(m_ && strstr(m_, (word)), "%s: message %s does not name %s", #call, m_, word); \
  } while (0)

/* Rank r's element i: small integers, exact in every type and reduction. */
static double value(int r, size_t i) { return (double)((r + 1) * 2 + (int)(i % 5)); }

/* Waits until a non-blocking communicator's init ended; returns its state. */
static ncclResult_t settle(ncclComm_t comm) {
  ncclResult_t state = ncclInProgress;
  for (int i = 0; i < 60000 && state == ncclInProgress; i++) {
    OK(ncclCommGetAsyncError(comm, &state));
    if (state == ncclInProgress) sleep_ms(1);
  }
  return state;
}

/* ---- collectives on one communicator of n ranks (this process is rank `rank` of it) ---- */

static void collectives(ncclComm_t comm, int rank, int n) {
  size_t count = 1000;
  float *send = malloc(count * n * sizeof(float));
  float *recv = malloc(count * n * sizeof(float));
  int64_t *big = malloc(count * sizeof(int64_t));
  int32_t *ints = malloc(count * sizeof(int32_t));
  for (size_t i = 0; i < count * n; i++) send[i] = (float)value(rank, i), recv[i] = -1.0f;
  for (size_t i = 0; i < count; i++) big[i] = (int64_t)value(rank, i), ints[i] = 1 + rank % 2;

  OK(ncclAllReduce(send, recv, count, ncclFloat, ncclSum, comm, NULL));
  OK(ncclAllReduce(big, big, count, ncclInt64, ncclMax, comm, NULL)); /* in place */
  for (size_t i = 0; i < count; i++) {
    double sum = 0, max = 0;
    for (int r = 0; r < n; r++) sum += value(r, i), max = value(r, i) > max ? value(r, i) : max;
    CHECK(recv[i] == (float)sum, "all-reduce sum[%zu] = %g, want %g", i, recv[i], sum);
    CHECK(big[i] == (int64_t)max, "in-place all-reduce max[%zu] = %lld", i, (long long)big[i]);
  }

  /* Broadcast from the last rank (out of place), then ncclBcast from rank 0 (in place). */
  OK(ncclBroadcast(send, recv, count, ncclFloat32, n - 1, comm, NULL));
  for (size_t i = 0; i < count; i++)
    CHECK(recv[i] == (float)value(n - 1, i), "broadcast[%zu] = %g", i, recv[i]);
  for (size_t i = 0; i < count; i++) big[i] = rank == 0 ? (int64_t)(7 * i) : -1;
  OK(ncclBcast(big, count, ncclInt64, 0, comm, NULL));
  for (size_t i = 0; i < count; i++) CHECK(big[i] == (int64_t)(7 * i), "bcast[%zu]", i);

  /* Reduce (product) into rank 0. */
  int32_t *prod = malloc(count * sizeof(int32_t));
  OK(ncclReduce(ints, prod, count, ncclInt32, ncclProd, 0, comm, NULL));
  if (rank == 0) {
    int32_t want = 1;
    for (int r = 0; r < n; r++) want *= 1 + r % 2;
    for (size_t i = 0; i < count; i++) CHECK(prod[i] == want, "reduce prod[%zu] = %d", i, prod[i]);
  }

  /* All-gather, out of place then in place. */
  OK(ncclAllGather(send, recv, count, ncclFloat, comm, NULL));
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++)
      CHECK(recv[r * count + i] == (float)value(r, i), "all-gather[%d][%zu]", r, i);
  for (size_t i = 0; i < count * n; i++) recv[i] = -1.0f;
  for (size_t i = 0; i < count; i++) recv[rank * count + i] = (float)value(rank, i);
  OK(ncclAllGather(recv + rank * count, recv, count, ncclFloat, comm, NULL));
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++)
      CHECK(recv[r * count + i] == (float)value(r, i), "in-place all-gather[%d][%zu]", r, i);

  /* Reduce-scatter: block `rank` of the sum of every rank's n blocks. */
  OK(ncclReduceScatter(send, recv, count, ncclFloat, ncclSum, comm, NULL));
  for (size_t i = 0; i < count; i++) {
    double sum = 0;
    for (int r = 0; r < n; r++) sum += value(r, rank * count + i);
    CHECK(recv[i] == (float)sum, "reduce-scatter[%zu] = %g, want %g", i, recv[i], sum);
  }

  /* All-to-all: block j of rank r holds 1000 r + j. */
  for (int j = 0; j < n; j++)
    for (size_t i = 0; i < count; i++) send[j * count + i] = (float)(1000 * rank + j);
  OK(ncclAlltoAll(send, recv, count, ncclFloat, comm, NULL));
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++)
      CHECK(recv[r * count + i] == (float)(1000 * r + rank), "all-to-all[%d][%zu]", r, i);

  /* Average, and a pre-multiplied sum (each input times 2). */
  for (size_t i = 0; i < count; i++) send[i] = (float)value(rank, i);
  OK(ncclAllReduce(send, recv, count, ncclFloat, ncclAvg, comm, NULL));
  for (size_t i = 0; i < count; i++) {
    double sum = 0;
    for (int r = 0; r < n; r++) sum += value(r, i);
    CHECK(recv[i] == (float)(sum / n), "avg[%zu] = %g, want %g", i, recv[i], sum / n);
  }
  float two = 2.0f;
  ncclRedOp_t premul;
  OK(ncclRedOpCreatePreMulSum(&premul, &two, ncclFloat, ncclScalarHostImmediate, comm));
  CHECK(premul >= ncclNumOps, "pre-multiplied sum's code %d", (int)premul);
  OK(ncclAllReduce(send, recv, count, ncclFloat, premul, comm, NULL));
  for (size_t i = 0; i < count; i++) {
    double sum = 0;
    for (int r = 0; r < n; r++) sum += 2 * value(r, i);
    CHECK(recv[i] == (float)sum, "premulsum[%zu] = %g, want %g", i, recv[i], sum);
  }
  OK(ncclRedOpDestroy(premul, comm));

  /* A group: two all-reduces, and (n > 1) a ring of sends and receives. */
  for (size_t i = 0; i < count; i++) big[i] = rank, recv[i] = -1.0f;
  OK(ncclGroupStart());
  OK(ncclAllReduce(big, big, count, ncclInt64, ncclSum, comm, NULL));
  if (n > 1) {
    OK(ncclSend(send, count, ncclFloat, (rank + 1) % n, comm, NULL));
    OK(ncclRecv(recv, count, ncclFloat, (rank + n - 1) % n, comm, NULL));
  }
  OK(ncclGroupEnd());
  for (size_t i = 0; i < count; i++) {
    CHECK(big[i] == (int64_t)n * (n - 1) / 2, "grouped all-reduce[%zu] = %lld", i,
          (long long)big[i]);
    if (n > 1)
      CHECK(recv[i] == (float)value((rank + n - 1) % n, i), "ring recv[%zu] = %g", i, recv[i]);
  }

  free(send), free(recv), free(big), free(ints), free(prod);
}

/* ---- what must fail, and how ---- */

static void error_paths(ncclComm_t comm, int n) {
  float x[4] = {1, 2, 3, 4};
  FAILS(ncclAllReduce(x, x, 4, ncclFloat8e4m3, ncclSum, comm, NULL), ncclInvalidArgument,
        "type");
  FAILS(ncclAllReduce(x, x, 4, ncclFloat, (ncclRedOp_t)99, comm, NULL), ncclInvalidArgument,
        "99");
  FAILS(ncclAllReduce(x, x, 4, ncclFloat, ncclSum, NULL, NULL), ncclInvalidArgument,
        "communicator");
  FAILS(ncclBroadcast(x, x, 4, ncclFloat, n, comm, NULL), ncclInvalidArgument, "root");
  FAILS(ncclAllReduce(x, x + 1, 3, ncclFloat, ncclSum, comm, NULL), ncclInvalidArgument,
        "overlap");
  FAILS(ncclGroupEnd(), ncclInvalidUsage, "ncclGroupEnd");
  /* In a group, a call's arguments are checked when the group runs: ncclGroupEnd reports. */
  OK(ncclGroupStart());
  OK(ncclAllReduce(x, x, 4, ncclFloat8e4m3, ncclSum, comm, NULL));
  FAILS(ncclGroupEnd(), ncclInvalidArgument, "type");
  FAILS(ncclGather(x, x, 1, ncclFloat, 0, comm, NULL), ncclInvalidUsage, "ncclGather");
  void *p = NULL;
  FAILS(ncclMemAlloc(&p, 64), ncclInvalidUsage, "ncclMemAlloc");
  int dev = -1;
  FAILS(ncclCommCuDevice(comm, &dev), ncclInvalidUsage, "ncclCommCuDevice");
  FAILS(ncclCommCount(comm, NULL), ncclInvalidArgument, "null");
  CHECK(strstr(ncclGetErrorString(ncclInvalidUsage), "weftcc") != NULL, "error string %s",
        ncclGetErrorString(ncclInvalidUsage));
  ncclConfig_t bad = NCCL_CONFIG_INITIALIZER;
  bad.magic = 0;
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  ncclComm_t never = NULL;
  FAILS(ncclCommInitRankConfig(&never, n, id, 0, &bad), ncclInvalidArgument, "magic");
  ncclConfig_t blocking2 = NCCL_CONFIG_INITIALIZER;
  blocking2.blocking = 2;
  FAILS(ncclCommInitRankConfig(&never, n, id, 0, &blocking2), ncclInvalidArgument, "blocking");

  /* Registration is accepted; the communicator still works and has no error. */
  void *handle = NULL;
  OK(ncclCommRegister(comm, x, sizeof x, &handle));
  OK(ncclCommDeregister(comm, handle));
  ncclResult_t state = ncclInternalError;
  OK(ncclCommGetAsyncError(comm, &state));
  CHECK(state == ncclSuccess, "async error %d after refused calls", (int)state);
  OK(ncclAllReduce(x, x, 4, ncclFloat, ncclSum, comm, NULL));
  CHECK(x[3] == 4.0f * n, "all-reduce after refused calls: %g", x[3]);
}

/* ---- one rank of a job under `weft run` ---- */

static int job(const char *dir) {
  const char *r = getenv("RANK"), *w = getenv("WORLD_SIZE");
  if (!r || !w) {
    fprintf(stderr, "run under weft run (RANK and WORLD_SIZE unset)\n");
    return 2;
  }
  int rank = atoi(r), n = atoi(w);
  me = rank;
  int version = 0;
  OK(ncclGetVersion(&version));
  CHECK(version >= NCCL_VERSION(2, 19, 0), "ncclGetVersion: %d", version);

  ncclUniqueId id;
  share_id(dir, "world", rank, &id);
  ncclComm_t comm;
  OK(ncclCommInitRank(&comm, n, id, rank));
  int count = -1, mine = -1;
  OK(ncclCommCount(comm, &count));
  OK(ncclCommUserRank(comm, &mine));
  CHECK(count == n && mine == rank, "count %d rank %d", count, mine);

  collectives(comm, rank, n);
  error_paths(comm, n);

  /* Split: colour rank % 2, ranked in reverse; with more than 2 ranks the last takes part
   * without a colour and gets NULL. */
  int nocolor = n > 2 && rank == n - 1;
  ncclComm_t half = (ncclComm_t)&half;
  OK(ncclCommSplit(comm, nocolor ? NCCL_SPLIT_NOCOLOR : rank % 2, -rank, &half, NULL));
  if (nocolor) {
    CHECK(half == NULL, "NCCL_SPLIT_NOCOLOR gave a communicator");
  } else {
    int members = 0, above = 0;
    for (int r = 0; r < n; r++)
      if (r % 2 == rank % 2 && !(n > 2 && r == n - 1)) members++, above += r > rank;
    int hc = -1, hr = -1;
    OK(ncclCommCount(half, &hc));
    OK(ncclCommUserRank(half, &hr));
    CHECK(hc == members && hr == above, "split: %d of %d, want %d of %d", hr, hc, above, members);
    collectives(half, hr, hc);
    OK(ncclCommAbort(half));
  }

  /* Shrink without the last rank (which does not take part), then revoke the shrunk one: the
   * revoking rank's next call fails as invalid usage, the others' as a remote error. */
  if (n > 2 && rank != n - 1) {
    int last = n - 1;
    ncclComm_t small = NULL;
    OK(ncclCommShrink(comm, &last, 1, &small, NULL, NCCL_SHRINK_DEFAULT));
    int sc = -1, sr = -1;
    OK(ncclCommCount(small, &sc));
    OK(ncclCommUserRank(small, &sr));
    CHECK(sc == n - 1 && sr == rank, "shrink: %d of %d", sr, sc);
    collectives(small, sr, sc);
    CHECK(ncclCommRevoke(small, 5) == ncclInvalidArgument, "revoke flags 5 accepted");
    if (rank == 0) OK(ncclCommRevoke(small, NCCL_REVOKE_DEFAULT));
    float one = 1, sum = 0;
    ncclResult_t r = ncclAllReduce(&one, &sum, 1, ncclFloat, ncclSum, small, NULL);
    CHECK(r == (rank == 0 ? ncclInvalidUsage : ncclRemoteError), "after revoke: %d", r);
    OK(ncclCommAbort(small));
  }

  /* A non-blocking communicator: ncclInProgress (or done at once), then polled. */
  ncclUniqueId id2;
  share_id(dir, "nonblocking", rank, &id2);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.splitShare = 1;
  config.commName = "weftcc-nonblocking";
  ncclComm_t nb = NULL;
  ncclResult_t r0 = ncclCommInitRankConfig(&nb, n, id2, rank, &config);
  CHECK(r0 == ncclInProgress || r0 == ncclSuccess, "non-blocking init -> %d", (int)r0);
  CHECK(nb != NULL, "non-blocking init gave no handle");
  CHECK(settle(nb) == ncclSuccess, "non-blocking init failed: %s", ncclGetLastError(NULL));
  float y[3] = {1, 1, (float)rank};
  OK(ncclAllReduce(y, y, 3, ncclFloat, ncclSum, nb, NULL));
  CHECK(y[0] == (float)n && y[2] == (float)(n * (n - 1) / 2), "non-blocking all-reduce");
  OK(ncclCommFinalize(nb));
  OK(ncclCommDestroy(nb));

  OK(ncclCommFinalize(comm));
  OK(ncclCommDestroy(comm));
  OK(ncclCommDestroy(NULL));
  if (failures) fprintf(stderr, "rank %d: %d checks failed\n", rank, failures);
  return failures ? 1 : 0;
}

/* ---- one process, n ranks ---- */

/* All-reduce (sum of ranks) on every communicator in one group, checked. */
static void grouped_all_reduce(ncclComm_t *comms, int n, const char *what) {
  int64_t v[8][16];
  OK(ncclGroupStart());
  for (int i = 0; i < n; i++) {
    for (int k = 0; k < 16; k++) v[i][k] = i + k;
    OK(ncclAllReduce(v[i], v[i], 16, ncclInt64, ncclSum, comms[i], NULL));
  }
  OK(ncclGroupEnd());
  for (int i = 0; i < n; i++)
    for (int k = 0; k < 16; k++)
      CHECK(v[i][k] == (int64_t)n * (n - 1) / 2 + (int64_t)n * k, "%s: rank %d [%d] = %lld",
            what, i, k, (long long)v[i][k]);
}

static int local(int n) {
  me = 0;
  if (n < 1 || n > 8) return 2;
  ncclComm_t comms[8], grouped[8], nb[8], halves[8];
  int devs[8];
  for (int i = 0; i < n; i++) devs[i] = 10 + i;
  OK(ncclCommInitAll(comms, n, devs));
  for (int i = 0; i < n; i++) {
    int c = -1, r = -1, d = -1;
    OK(ncclCommCount(comms[i], &c));
    OK(ncclCommUserRank(comms[i], &r));
    OK(ncclCommCuDevice(comms[i], &d));
    CHECK(c == n && r == i && d == 10 + i, "InitAll %d: %d of %d on %d", i, r, c, d);
  }
  grouped_all_reduce(comms, n, "InitAll");

  /* A ring of sends and receives across the process's ranks, in one group. */
  if (n > 1) {
    float out[8][32], in[8][32];
    OK(ncclGroupStart());
    for (int i = 0; i < n; i++) {
      for (int k = 0; k < 32; k++) out[i][k] = (float)(100 * i + k), in[i][k] = -1;
      OK(ncclSend(out[i], 32, ncclFloat, (i + 1) % n, comms[i], NULL));
      OK(ncclRecv(in[i], 32, ncclFloat, (i + n - 1) % n, comms[i], NULL));
    }
    OK(ncclGroupEnd());
    for (int i = 0; i < n; i++)
      for (int k = 0; k < 32; k++)
        CHECK(in[i][k] == (float)(100 * ((i + n - 1) % n) + k), "ring %d [%d]", i, k);
  }

  /* Splits of every rank in one group. */
  OK(ncclGroupStart());
  for (int i = 0; i < n; i++) OK(ncclCommSplit(comms[i], 0, n - i, &halves[i], NULL));
  OK(ncclGroupEnd());
  for (int i = 0; i < n; i++) {
    int r = -1;
    OK(ncclCommUserRank(halves[i], &r));
    CHECK(r == n - 1 - i, "grouped split: rank %d is %d", i, r);
  }
  for (int i = 0; i < n; i++) OK(ncclCommDestroy(halves[i]));

  /* Inits in one group (one thread, n ranks). */
  ncclUniqueId id;
  OK(ncclGetUniqueId(&id));
  OK(ncclGroupStart());
  for (int i = 0; i < n; i++) OK(ncclCommInitRank(&grouped[i], n, id, i));
  OK(ncclGroupEnd());
  grouped_all_reduce(grouped, n, "grouped init");

  /* Non-blocking inits in one group: the group may end in progress; each is polled. */
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  OK(ncclGetUniqueId(&id));
  OK(ncclGroupStart());
  for (int i = 0; i < n; i++) {
    ncclResult_t r = ncclCommInitRankConfig(&nb[i], n, id, i, &config);
    CHECK(r == ncclSuccess || r == ncclInProgress, "grouped non-blocking init -> %d", (int)r);
  }
  ncclResult_t end = ncclGroupEnd();
  CHECK(end == ncclSuccess || end == ncclInProgress, "non-blocking group end -> %d", (int)end);
  for (int i = 0; i < n; i++)
    CHECK(settle(nb[i]) == ncclSuccess, "non-blocking rank %d: %s", i, ncclGetLastError(NULL));
  grouped_all_reduce(nb, n, "non-blocking");

  /* A communicator destroyed before the ncclGroupEnd that would make it: nothing waits. */
  ncclComm_t dropped = NULL;
  OK(ncclGetUniqueId(&id));
  OK(ncclGroupStart());
  OK(ncclCommInitRank(&dropped, 2, id, 0));
  OK(ncclCommDestroy(dropped));
  OK(ncclGroupEnd());

  for (int i = 0; i < n; i++) {
    OK(ncclCommDestroy(comms[i]));
    OK(ncclCommDestroy(grouped[i]));
    OK(ncclCommDestroy(nb[i]));
  }
  if (failures) fprintf(stderr, "local: %d checks failed\n", failures);
  return failures ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "job") == 0) return job(argv[2]);
  if (argc == 3 && strcmp(argv[1], "local") == 0) return local(atoi(argv[2]));
  fprintf(stderr, "usage: %s job DIR | local N\n", argv[0]);
  return 2;
}
