/* What the drop-in's C test programs share (nccl_ranks.c, nccl_device.c): the check macros
 * (testkit/c/checks.h, as weftcc's other C tests), and the unique id handed from rank 0 to the others through a file, the "share it by your own
 * means" step of NCCL programs. Include after nccl.h. */
#ifndef WEFTCC_NCCL_TEST_COMMON_H
#define WEFTCC_NCCL_TEST_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checks.h"

/* An nccl* call that must succeed. */
#define OK(call) MUST(call, ncclResult_t, ncclSuccess, ncclGetErrorString, ncclGetLastError(NULL))

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
