/* What the drop-in's C test programs share (nccl_ranks.c, nccl_device.c): the check macros,
 * and the unique id handed from rank 0 to the others through a file, the "share it by your own
 * means" step of NCCL programs. Include after nccl.h. */
#ifndef WEFTCC_NCCL_TEST_COMMON_H
#define WEFTCC_NCCL_TEST_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int failures = 0;
static int me = -1;

/* A check: on failure prints the rank, the line and the message, and counts it. */
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "rank %d: line %d: ", me, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      failures++;                                          \
    }                                                      \
  } while (0)

/* A call that must succeed: otherwise prints its code and message and exits 2. */
#define OK(call)                                                                    \
  do {                                                                              \
    ncclResult_t r_ = (call);                                                       \
    if (r_ != ncclSuccess) {                                                        \
      fprintf(stderr, "rank %d: line %d: %s -> %d (%s): %s\n", me, __LINE__, #call, \
              (int)r_, ncclGetErrorString(r_), ncclGetLastError(NULL));             \
      exit(2);                                                                      \
    }                                                                               \
  } while (0)

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* Rank 0 makes a unique id and writes it to DIR/NAME (renamed into place); the other ranks
 * wait for the file (at most a minute). */
static void share_id(const char *dir, const char *name, int rank, ncclUniqueId *id) {
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  if (rank == 0) {
    OK(ncclGetUniqueId(id));
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f) != 0 || rename(tmp, path) != 0) {
      fprintf(stderr, "rank 0: cannot write %s\n", path);
      exit(2);
    }
    return;
  }
  for (int i = 0; i < 60000; i++) {
    FILE *f = fopen(path, "rb");
    if (f) {
      size_t got = fread(id, sizeof *id, 1, f);
      fclose(f);
      if (got == 1) return;
    }
    sleep_ms(1);
  }
  fprintf(stderr, "rank %d: no unique id in %s\n", rank, path);
  exit(2);
}

#endif
