/* An NCCL program on device buffers (started by tests/nccl_dropin.rs under `weft run`; needs
 * a GPU): compiled against NVIDIA's nccl.h and linked with weftcc's libnccl.so.2. The CUDA
 * runtime is opened at run time (libcudart.so.13, .12 or libcudart.so), so the program builds
 * on machines without the CUDA toolkit. Each rank uses device LOCAL_RANK % count (ranks may
 * share one GPU); rank 0 shares the unique id through a file in DIR.
 *
 *   nccl_device DIR
 *
 * Every collective, a grouped send/recv ring and stream order (operations enqueued behind a
 * copy on the same stream, results copied back on it) are checked against exact values. */
#define _POSIX_C_SOURCE 200809L
#include <nccl.h>

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"

/* The few CUDA runtime calls used, looked up at run time. */
static int (*cudaGetDeviceCount_)(int *);
static int (*cudaSetDevice_)(int);
static int (*cudaMalloc_)(void **, size_t);
static int (*cudaFree_)(void *);
static int (*cudaStreamCreate_)(cudaStream_t *);
static int (*cudaStreamDestroy_)(cudaStream_t);
static int (*cudaStreamSynchronize_)(cudaStream_t);
static int (*cudaMemcpyAsync_)(void *, const void *, size_t, int, cudaStream_t);
enum { H2D = 1, D2H = 2 };

#define CUDA(call)                                                            \
  do {                                                                        \
    int e_ = (call);                                                          \
    if (e_ != 0) {                                                            \
      fprintf(stderr, "rank %d: line %d: %s -> CUDA error %d\n", me, __LINE__, #call, e_); \
      exit(2);                                                                \
    }                                                                         \
  } while (0)

static void *sym(void *lib, const char *name) {
  void *p = dlsym(lib, name);
  if (!p) {
    fprintf(stderr, "no %s in the CUDA runtime\n", name);
    exit(2);
  }
  return p;
}

static void load_cudart(void) {
  const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  void *lib = NULL;
  for (size_t i = 0; i < sizeof names / sizeof *names && !lib; i++) lib = dlopen(names[i], RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "no CUDA runtime (libcudart.so.13/.12) on the library path\n");
    exit(2);
  }
  *(void **)&cudaGetDeviceCount_ = sym(lib, "cudaGetDeviceCount");
  *(void **)&cudaSetDevice_ = sym(lib, "cudaSetDevice");
  *(void **)&cudaMalloc_ = sym(lib, "cudaMalloc");
  *(void **)&cudaFree_ = sym(lib, "cudaFree");
  *(void **)&cudaStreamCreate_ = sym(lib, "cudaStreamCreate");
  *(void **)&cudaStreamDestroy_ = sym(lib, "cudaStreamDestroy");
  *(void **)&cudaStreamSynchronize_ = sym(lib, "cudaStreamSynchronize");
  *(void **)&cudaMemcpyAsync_ = sym(lib, "cudaMemcpyAsync");
}

int main(int argc, char **argv) {
  const char *r = getenv("RANK"), *w = getenv("WORLD_SIZE"), *l = getenv("LOCAL_RANK");
  if (argc != 2 || !r || !w) {
    fprintf(stderr, "usage (under weft run): %s DIR\n", argv[0]);
    return 2;
  }
  int rank = atoi(r), n = atoi(w), local = l ? atoi(l) : rank;
  me = rank;
  load_cudart();
  int devices = 0;
  CUDA(cudaGetDeviceCount_(&devices));
  if (devices < 1) {
    fprintf(stderr, "no CUDA device\n");
    return 2;
  }
  CUDA(cudaSetDevice_(local % devices));
  cudaStream_t s;
  CUDA(cudaStreamCreate_(&s));

  ncclUniqueId id;
  share_id(argv[1], "device-id", rank, &id);
  ncclComm_t comm;
  OK(ncclCommInitRank(&comm, n, id, rank));

  size_t count = 1 << 18; /* 1 MiB of floats */
  float *host = malloc(count * n * sizeof(float));
  float *dsend, *drecv;
  CUDA(cudaMalloc_((void **)&dsend, count * n * sizeof(float)));
  CUDA(cudaMalloc_((void **)&drecv, count * n * sizeof(float)));

  /* all-reduce behind the upload on the same stream, result downloaded on it. */
  for (size_t i = 0; i < count; i++) host[i] = (float)(rank + 1 + (int)(i % 3));
  CUDA(cudaMemcpyAsync_(dsend, host, count * sizeof(float), H2D, s));
  OK(ncclAllReduce(dsend, drecv, count, ncclFloat, ncclSum, comm, s));
  CUDA(cudaMemcpyAsync_(host, drecv, count * sizeof(float), D2H, s));
  CUDA(cudaStreamSynchronize_(s));
  for (size_t i = 0; i < count; i++) {
    float want = (float)(n * (n + 1) / 2 + n * (int)(i % 3));
    CHECK(host[i] == want, "all-reduce[%zu] = %g, want %g", i, host[i], want);
  }

  /* in-place broadcast from the last rank. */
  for (size_t i = 0; i < count; i++) host[i] = (float)(rank * 10);
  CUDA(cudaMemcpyAsync_(drecv, host, count * sizeof(float), H2D, s));
  OK(ncclBroadcast(drecv, drecv, count, ncclFloat, n - 1, comm, s));
  CUDA(cudaMemcpyAsync_(host, drecv, count * sizeof(float), D2H, s));
  CUDA(cudaStreamSynchronize_(s));
  for (size_t i = 0; i < count; i++) CHECK(host[i] == (float)((n - 1) * 10), "broadcast[%zu]", i);

  /* all-gather, then reduce-scatter of what was gathered. */
  for (size_t i = 0; i < count; i++) host[i] = (float)rank;
  CUDA(cudaMemcpyAsync_(dsend, host, count * sizeof(float), H2D, s));
  OK(ncclAllGather(dsend, drecv, count, ncclFloat, comm, s));
  OK(ncclReduceScatter(drecv, dsend, count, ncclFloat, ncclSum, comm, s));
  CUDA(cudaMemcpyAsync_(host, dsend, count * sizeof(float), D2H, s));
  CUDA(cudaStreamSynchronize_(s));
  for (size_t i = 0; i < count; i++)
    CHECK(host[i] == (float)(n * rank), "all-gather + reduce-scatter[%zu] = %g", i, host[i]);

  /* a ring of sends and receives in one group (after a collective made the device
   * communicator). */
  if (n > 1) {
    for (size_t i = 0; i < count; i++) host[i] = (float)(100 + rank);
    CUDA(cudaMemcpyAsync_(dsend, host, count * sizeof(float), H2D, s));
    OK(ncclGroupStart());
    OK(ncclSend(dsend, count, ncclFloat, (rank + 1) % n, comm, s));
    OK(ncclRecv(drecv, count, ncclFloat, (rank + n - 1) % n, comm, s));
    OK(ncclGroupEnd());
    CUDA(cudaMemcpyAsync_(host, drecv, count * sizeof(float), D2H, s));
    CUDA(cudaStreamSynchronize_(s));
    for (size_t i = 0; i < count; i++)
      CHECK(host[i] == (float)(100 + (rank + n - 1) % n), "ring[%zu] = %g", i, host[i]);
  }

  ncclResult_t state = ncclInternalError;
  OK(ncclCommGetAsyncError(comm, &state));
  CHECK(state == ncclSuccess, "async error %d", (int)state);
  OK(ncclCommFinalize(comm));
  OK(ncclCommDestroy(comm));
  CUDA(cudaFree_(dsend));
  CUDA(cudaFree_(drecv));
  CUDA(cudaStreamDestroy_(s));
  free(host);
  if (failures) fprintf(stderr, "rank %d: %d checks failed\n", rank, failures);
  return failures ? 1 : 0;
}
