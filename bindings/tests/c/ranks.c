/* One rank of the C ABI test (started by tests/c_abi.rs).
 *
 *   ranks id              prints a new unique id, then runs as rank 0 of NRANKS (env)
 *   ranks RANK NRANKS ID  runs as rank RANK
 *   ranks env             takes rank and size from the launcher's variables (RANK, ...)
 *
 * Every collective is checked against values computed here; each failure prints the rank and
 * the check and makes the exit status non-zero. */
#include "weftcc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checks.h"

/* A weft* call that must succeed. */
#define OK(call) MUST(call, weftResult_t, weftSuccess, weftGetErrorString, weftGetLastError(NULL))

/* Rank r's element i: small integers, exact in every type and every reduction. */
static double value(int r, size_t i) { return (double)((r + 1) * 2 + (int)(i % 5)); }

static void all_reduce(weftComm_t comm, int n, size_t count) {
  float *send = malloc((count + 1) * sizeof(float));
  float *recv = malloc((count + 1) * sizeof(float));
  int64_t *buf = malloc((count + 1) * sizeof(int64_t));
  for (size_t i = 0; i < count; i++) {
    send[i] = (float)value(me, i);
    recv[i] = -1.0f;
    buf[i] = (int64_t)value(me, i);
  }
  OK(weftAllReduce(send, recv, count, weftFloat32, weftSum, comm, NULL));
  OK(weftAllReduce(buf, buf, count, weftInt64, weftMax, comm, NULL)); /* in place */
  for (size_t i = 0; i < count; i++) {
    double sum = 0, max = 0;
    for (int r = 0; r < n; r++) {
      sum += value(r, i);
      if (value(r, i) > max) max = value(r, i);
    }
    CHECK(recv[i] == (float)sum, "all-reduce sum[%zu] = %g, want %g", i, recv[i], sum);
    CHECK(buf[i] == (int64_t)max, "in-place all-reduce max[%zu] = %lld, want %g", i,
          (long long)buf[i], max);
  }
  free(send);
  free(recv);
  free(buf);
}

static void rooted(weftComm_t comm, int n) {
  const size_t count = 1037;
  int root = n - 1;
  double *data = malloc(count * sizeof(double));
  double *out = malloc(count * sizeof(double));
  for (size_t i = 0; i < count; i++) {
    data[i] = value(me, i);
    out[i] = -1;
  }
  /* Only the root's send buffer is read: the others pass NULL, as NCCL allows. */
  OK(weftBroadcast(me == root ? data : NULL, out, count, weftFloat64, root, comm, NULL));
  for (size_t i = 0; i < count; i++)
    CHECK(out[i] == value(root, i), "broadcast[%zu] = %g", i, out[i]);
  /* Only the root's receive buffer is written: the others pass NULL. */
  int32_t *in = malloc(count * sizeof(int32_t));
  int32_t *red = malloc(count * sizeof(int32_t));
  for (size_t i = 0; i < count; i++) {
    in[i] = (int32_t)value(me, i);
    red[i] = -1;
  }
  OK(weftReduce(in, me == 0 ? red : NULL, count, weftInt32, weftProd, 0, comm, NULL));
  if (me == 0)
    for (size_t i = 0; i < count; i++) {
      double p = 1;
      for (int r = 0; r < n; r++) p *= value(r, i);
      CHECK(red[i] == (int32_t)p, "reduce prod[%zu] = %d, want %g", i, red[i], p);
    }
  free(data);
  free(out);
  free(in);
  free(red);
}

static void all_gather(weftComm_t comm, int n) {
  const size_t count = 7;
  uint8_t mine[7];
  uint8_t *all = malloc(n * count);
  for (size_t i = 0; i < count; i++) mine[i] = (uint8_t)value(me, i);
  OK(weftAllGather(mine, all, count, weftUint8, comm, NULL));
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++)
      CHECK(all[r * count + i] == (uint8_t)value(r, i), "all-gather[%d][%zu]", r, i);
  /* In place: this rank's block already sits at its place in the output. */
  memset(all, 0, n * count);
  memcpy(all + me * count, mine, count);
  OK(weftAllGather(all + me * count, all, count, weftUint8, comm, NULL));
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++)
      CHECK(all[r * count + i] == (uint8_t)value(r, i), "in-place all-gather[%d][%zu]", r, i);
  free(all);
}

static void reduce_scatter(weftComm_t comm, int n) {
  const size_t count = 7;
  int32_t *send = malloc(n * count * sizeof(int32_t));
  int32_t recv[7];
  for (size_t j = 0; j < n * count; j++) send[j] = (int32_t)value(me, j);
  OK(weftReduceScatter(send, recv, count, weftInt32, weftSum, comm, NULL));
  for (size_t i = 0; i < count; i++) {
    double sum = 0;
    for (int r = 0; r < n; r++) sum += value(r, me * count + i);
    CHECK(recv[i] == (int32_t)sum, "reduce-scatter[%zu] = %d, want %g", i, recv[i], sum);
  }
  /* In place: the result lands in this rank's block of the send buffer. */
  OK(weftReduceScatter(send, send + me * count, count, weftInt32, weftMin, comm, NULL));
  for (size_t i = 0; i < count; i++) {
    double min = 1e9;
    for (int r = 0; r < n; r++)
      if (value(r, me * count + i) < min) min = value(r, me * count + i);
    CHECK(send[me * count + i] == (int32_t)min, "in-place reduce-scatter min[%zu]", i);
  }
  free(send);
}

static void all_to_all(weftComm_t comm, int n) {
  const size_t count = 7;
  uint64_t *a2a = calloc(n * count, sizeof(uint64_t));
  uint64_t *got = malloc(n * count * sizeof(uint64_t));
  for (int p = 0; p < n; p++)
    for (size_t i = 0; i < count; i++) a2a[p * count + i] = (uint64_t)(me * 1000 + p * 10 + i);
  OK(weftAllToAll(a2a, got, count, weftUint64, comm, NULL));
  for (int p = 0; p < n; p++)
    for (size_t i = 0; i < count; i++)
      CHECK(got[p * count + i] == (uint64_t)(p * 1000 + me * 10 + i), "all-to-all[%d][%zu]", p, i);
  free(a2a);
  free(got);
}

static void point_to_point(weftComm_t comm, int n) {
  const size_t count = 100000;
  int next = (me + 1) % n, prev = (me + n - 1) % n;
  int8_t *out = malloc(count), *in = malloc(count);
  for (size_t i = 0; i < count; i++) {
    out[i] = (int8_t)(me * 7 + i);
    in[i] = 0;
  }
  /* A ring shift: every rank sends and receives, so the calls must run as one group. */
  OK(weftGroupStart());
  OK(weftSend(out, count, weftInt8, next, comm, NULL));
  OK(weftRecv(in, count, weftInt8, prev, comm, NULL));
  OK(weftGroupEnd());
  for (size_t i = 0; i < count; i++)
    CHECK(in[i] == (int8_t)(prev * 7 + i), "ring shift[%zu] = %d", i, in[i]);
  free(out);
  free(in);
}

/* With an odd count above 1, the last rank takes part in the split without joining. */
static int alone(int r, int n) { return n % 2 == 1 && n > 1 && r == n - 1; }

/* Even and odd ranks split into two communicators (ranked in reverse by key); the last rank
 * of an odd count takes part without joining one. */
static void split(weftComm_t comm, int n) {
  int last_alone = alone(me, n);
  weftComm_t sub = NULL;
  OK(weftCommSplit(comm, last_alone ? WEFT_SPLIT_NOCOLOR : me % 2, -me, &sub));
  if (last_alone) {
    CHECK(sub == NULL, "no-color rank got a communicator");
    return;
  }
  int size = 0, rank = -1, want_size = 0;
  for (int r = 0; r < n; r++)
    if (r % 2 == me % 2 && !alone(r, n)) want_size++;
  OK(weftCommCount(sub, &size));
  OK(weftCommUserRank(sub, &rank));
  CHECK(size == want_size, "split size %d, want %d", size, want_size);
  int above = 0; /* members with a smaller key (-r), i.e. a larger old rank */
  for (int r = me + 1; r < n; r++)
    if (r % 2 == me % 2 && !alone(r, n)) above++;
  CHECK(rank == above, "split rank %d, want %d", rank, above);
  int64_t v = me, sum = 0;
  OK(weftAllReduce(&v, &sum, 1, weftInt64, weftSum, sub, NULL));
  int64_t want = 0;
  for (int r = 0; r < n; r++)
    if (r % 2 == me % 2 && !alone(r, n)) want += r;
  CHECK(sum == want, "sum over the split %lld, want %lld", (long long)sum, (long long)want);
  OK(weftCommDestroy(sub));
}

/* Shrink without the last rank (which does not take part, and is refused if it asks), agree on
 * a healthy communicator (nobody failed), then revoke the shrunk one: every rank's next call
 * fails, here as invalid usage, on the others as a remote error. */
static void shrink_and_revoke(weftComm_t comm, int n) {
  int last = n - 1;
  weftComm_t s = NULL;
  if (me == last) {
    CHECK(weftCommShrink(comm, &last, 1, &s, WEFT_SHRINK_DEFAULT) == weftInvalidUsage,
          "an excluded rank was given a place");
    return;
  }
  CHECK(weftCommShrink(comm, &last, 1, &s, 7) == weftInvalidArgument, "bad shrink flags");
  OK(weftCommShrink(comm, &last, 1, &s, WEFT_SHRINK_DEFAULT));
  int size = 0, rank = -1;
  OK(weftCommCount(s, &size));
  OK(weftCommUserRank(s, &rank));
  CHECK(size == n - 1 && rank == me, "shrunk: rank %d of %d", rank, size);
  int64_t one = 1, sum = 0;
  OK(weftAllReduce(&one, &sum, 1, weftInt64, weftSum, s, NULL));
  CHECK(sum == n - 1, "sum over the shrunk communicator %lld", (long long)sum);
  int failed[4] = {-1, -1, -1, -1}, count = -1;
  uint64_t epoch = 0;
  OK(weftCommAgree(s, failed, 4, &count, &epoch));
  CHECK(count == 0 && epoch == 1, "agreement: %d failed, epoch %llu", count,
        (unsigned long long)epoch);
  weftUniqueId job;
  OK(weftCommGetUniqueId(s, &job));
  CHECK(strncmp(job.internal, "weft1@", 6) == 0, "job id %s", job.internal);
  if (me == 0) OK(weftCommRevoke(s, WEFT_REVOKE_DEFAULT));
  weftResult_t r = weftAllReduce(&one, &sum, 1, weftInt64, weftSum, s, NULL);
  CHECK(r == (me == 0 ? weftInvalidUsage : weftRemoteError), "after revoke -> %d: %s", r,
        weftGetLastError(s));
  CHECK(strstr(weftGetLastError(s), "revoked") != NULL, "message: %s", weftGetLastError(s));
  OK(weftCommDestroy(s));
}

/* Bad calls return weftInvalidArgument (or InvalidUsage) with a message, and leave the
 * communicator usable. */
static void errors(weftComm_t comm, int n) {
  float x[4] = {1, 2, 3, 4}, y[4];
  CHECK(weftAllReduce(x, y, 4, weftFloat32, weftSum, NULL, NULL) == weftInvalidArgument, "null comm");
  CHECK(weftAllReduce(x, y, 4, 42, weftSum, comm, NULL) == weftInvalidArgument, "bad type");
  CHECK(strstr(weftGetLastError(comm), "data type 42") != NULL, "message: %s",
        weftGetLastError(comm));
  /* In the core's form: the rank and the operation. */
  char want[64];
  snprintf(want, sizeof want, "rank %d: invalid argument to all-reduce", me);
  CHECK(strstr(weftGetLastError(comm), want) != NULL, "message: %s", weftGetLastError(comm));
  /* The same facts as fields. */
  weftErrorInfo_t info = WEFT_ERROR_INFO_INITIALIZER;
  OK(weftGetLastErrorInfo(&info));
  CHECK(info.result == weftInvalidArgument && info.rank == me && info.op == weftOpAllReduce &&
            info.peer == -1,
        "error info: result %d rank %d op %d peer %d", info.result, info.rank, info.op, info.peer);
  weftErrorInfo_t small = WEFT_ERROR_INFO_INITIALIZER;
  small.size -= 1;
  CHECK(weftGetLastErrorInfo(&small) == weftInvalidArgument, "a short weftErrorInfo_t accepted");
  CHECK(weftGetLastErrorInfo(NULL) == weftInvalidArgument, "a NULL weftErrorInfo_t accepted");
  /* A later header's larger struct: the known fields are written, the rest and size kept. */
  struct {
    weftErrorInfo_t info;
    int64_t later;
  } big;
  memset(&big, 0x5a, sizeof big);
  big.info.size = sizeof big;
  OK(weftGetLastErrorInfo(&big.info));
  CHECK(big.info.size == sizeof big && big.info.result == weftInvalidArgument &&
            big.info.rank == me && big.later == 0x5a5a5a5a5a5a5a5a,
        "a larger weftErrorInfo_t: size %zu result %d later %llx", big.info.size, big.info.result,
        (unsigned long long)big.later);
  CHECK(weftBroadcast(x, y, 4, weftFloat32, -1, comm, NULL) == weftInvalidArgument, "negative root");
  CHECK(strstr(weftGetLastError(comm), "root -1 is not a rank") != NULL, "message: %s",
        weftGetLastError(comm));
  CHECK(weftAllReduce(x, y, 4, weftFloat32, 17, comm, NULL) == weftInvalidArgument, "bad op");
  CHECK(weftAllReduce(x, x + 1, 3, weftFloat32, weftSum, comm, NULL) == weftInvalidArgument,
        "overlapping buffers");
  CHECK(weftBroadcast(x, y, 4, weftFloat32, n, comm, NULL) == weftInvalidArgument, "root out of range");
  CHECK(strstr(weftGetLastError(comm), "root") != NULL, "message: %s", weftGetLastError(comm));
  CHECK(weftAllReduce(NULL, y, 4, weftFloat32, weftSum, comm, NULL) == weftInvalidArgument, "null buf");
  CHECK(weftSend(x, 4, weftFloat32, me, comm, NULL) == weftInvalidArgument, "send to self");
  CHECK(weftGroupEnd() == weftInvalidUsage, "group end without start");
  int version = 0;
  OK(weftGetVersion(&version));
  CHECK(version == WEFT_API_VERSION, "library API version %d, header %d", version, WEFT_API_VERSION);
  /* A stream with host buffers: without a CUDA driver the device path says so; with one, the
   * buffer is not device memory. Either way nothing was sent. */
  weftResult_t dr = weftAllReduce(x, y, 4, weftFloat32, weftSum, comm, (weftStream_t)0x1);
  CHECK((dr == weftUnhandledCudaError && strstr(weftGetLastError(comm), "no CUDA driver")) ||
            (dr == weftInvalidArgument && strstr(weftGetLastError(comm), "not device memory")),
        "stream with host buffers: %d %s", dr, weftGetLastError(comm));
  CHECK(weftGetErrorString(weftTimeout) != NULL && weftGetErrorString(12345) != NULL,
        "error strings");
  int count = 0, rank = -1;
  OK(weftCommCount(comm, &count));
  OK(weftCommUserRank(comm, &rank));
  CHECK(count == n && rank == me, "count %d rank %d", count, rank);
  weftResult_t async = weftInternalError;
  OK(weftCommGetAsyncError(comm, &async));
  CHECK(async == weftSuccess, "async error %d after argument errors", async);
  OK(weftBarrier(comm)); /* still usable */
}

/* PreMulSum (NCCL's shape): each rank's input is scaled by its scalar, then summed; a destroyed
 * or never-made reduction is an invalid argument. */
static void premulsum(weftComm_t comm, int n) {
  double scalar = 0.5 * (me + 1);
  weftRedOp_t op = -1, op2 = -1;
  OK(weftRedOpCreatePreMulSum(&op, &scalar, weftFloat64, weftScalarHostImmediate, comm));
  CHECK(op >= weftNumOps, "premulsum code %d is a built-in's", op);
  float in[7], out[7];
  for (int i = 0; i < 7; i++) in[i] = (float)(i + 1);
  OK(weftAllReduce(in, out, 7, weftFloat32, op, comm, NULL));
  double factor = 0; /* sum over ranks of 0.5 * (r + 1) */
  for (int r = 0; r < n; r++) factor += 0.5 * (r + 1);
  for (int i = 0; i < 7; i++)
    CHECK(out[i] == (float)(factor * (i + 1)), "premulsum [%d] = %g, want %g", i, out[i],
          factor * (i + 1));
  int32_t three = 3;
  OK(weftRedOpCreatePreMulSum(&op2, &three, weftInt32, weftScalarHostImmediate, comm));
  CHECK(op2 != op, "two live reductions share code %d", op);
  CHECK(weftRedOpCreatePreMulSum(&op2, &three, weftInt32, weftScalarDevice, comm) ==
            weftInvalidArgument,
        "a device scalar without CUDA was accepted");
  OK(weftRedOpDestroy(op, comm));
  CHECK(weftAllReduce(in, out, 7, weftFloat32, op, comm, NULL) == weftInvalidArgument,
        "a destroyed reduction was accepted");
  char want[64];
  snprintf(want, sizeof want, "reduction %d is not", op);
  CHECK(strstr(weftGetLastError(comm), want) != NULL, "message: %s", weftGetLastError(comm));
  CHECK(weftRedOpDestroy(op, comm) == weftInvalidArgument, "destroyed twice");
  CHECK(weftRedOpDestroy(weftSum, comm) == weftInvalidArgument, "destroyed a built-in");
  OK(weftRedOpDestroy(op2, comm));
}

/* The last rank aborts once every other rank has finished the earlier calls (each tells it
 * with a one-byte send; aborting sooner could fail another rank's last barrier, correctly):
 * its later calls return weftAborted, and every other rank's next call fails with a remote error
 * naming it (weftAborted is for the rank that called weftCommAbort) instead of waiting. */
static void abort_last(weftComm_t comm, int n) {
  int8_t token = 1, got[8];
  if (me == n - 1) {
    OK(weftGroupStart());
    for (int r = 0; r < n - 1; r++) OK(weftRecv(&got[r], 1, weftInt8, r, comm, NULL));
    OK(weftGroupEnd());
    OK(weftCommAbort(comm));
    CHECK(weftBarrier(comm) == weftAborted, "barrier after abort: %s", weftGetLastError(comm));
  } else {
    weftResult_t s = weftSend(&token, 1, weftInt8, n - 1, comm, NULL);
    CHECK(s == weftSuccess || s == weftRemoteError, "send -> %d", s);
    weftResult_t r = weftBarrier(comm);
    CHECK(r == weftRemoteError, "barrier with an aborted rank -> %d: %s", r,
          weftGetLastError(comm));
    char want[64];
    snprintf(want, sizeof want, "rank %d failed", n - 1);
    CHECK(strstr(weftGetLastError(comm), want) != NULL, "message: %s", weftGetLastError(comm));
    weftErrorInfo_t info = WEFT_ERROR_INFO_INITIALIZER;
    OK(weftGetLastErrorInfo(&info));
    CHECK(info.result == weftRemoteError && info.rank == me && info.peer == n - 1,
          "error info after a peer's abort: result %d rank %d peer %d", info.result, info.rank,
          info.peer);
    weftResult_t async = weftSuccess;
    OK(weftCommGetAsyncError(comm, &async));
    CHECK(async == weftRemoteError, "async error %d after a peer's abort", async);
  }
}

int main(int argc, char **argv) {
  weftUniqueId id;
  weftComm_t comm = NULL;
  int n;
  if (argc == 2 && strcmp(argv[1], "env") == 0) {
    OK(weftCommInitFromEnv(&comm));
    OK(weftCommUserRank(comm, &me));
    OK(weftCommCount(comm, &n));
  } else if (argc == 2 && strcmp(argv[1], "id") == 0) {
    const char *env = getenv("NRANKS");
    n = env ? atoi(env) : 2;
    me = 0;
    OK(weftGetUniqueId(&id));
    printf("%s\n", id.internal);
    fflush(stdout);
  } else if (argc == 4) {
    me = atoi(argv[1]);
    n = atoi(argv[2]);
    memset(&id, 0, sizeof id);
    strncpy(id.internal, argv[3], sizeof id.internal - 1);
  } else {
    fprintf(stderr, "usage: ranks id | ranks RANK NRANKS ID | ranks env\n");
    return 2;
  }
  if (comm == NULL) {
    weftConfig_t config = WEFT_CONFIG_INITIALIZER;
    /* Every field the initializer sets is left to the environment. */
    CHECK(config.timeoutMs == WEFT_CONFIG_UNDEF_INT && config.splitShare == WEFT_CONFIG_UNDEF_INT &&
              config.deterministic == WEFT_CONFIG_UNDEF_INT,
          "WEFT_CONFIG_INITIALIZER sets a field");
    config.timeoutMs = 60000;
    weftConfig_t bad = config;
    bad.magic = 0;
    CHECK(weftCommInitRankConfig(&comm, n, id, me, &bad) == weftInvalidArgument,
          "a config without its magic was accepted");
    bad = config;
    bad.timeoutMs = 0;
    CHECK(weftCommInitRankConfig(&comm, n, id, me, &bad) == weftInvalidArgument,
          "timeoutMs 0 was accepted");
    OK(weftCommInitRankConfig(&comm, n, id, me, &config));
  }
  all_reduce(comm, n, 0);
  all_reduce(comm, n, 1);
  all_reduce(comm, n, 1037);
  rooted(comm, n);
  all_gather(comm, n);
  reduce_scatter(comm, n);
  all_to_all(comm, n);
  if (n > 1) point_to_point(comm, n); /* a rank cannot send to itself */
  split(comm, n);
  errors(comm, n);
  premulsum(comm, n);
  if (n > 2) shrink_and_revoke(comm, n);
  if (n > 1) abort_last(comm, n);
  OK(weftCommDestroy(comm));
  if (failures == 0) fprintf(stderr, "rank %d: ok\n", me);
  return failures == 0 ? 0 : 1;
}
