/* The memory limit of this machine for one thread: memcpy bandwidth (bytes copied per second)
 * and an a += b pass over floats (the floor of a reduction: read two, write one).
 *
 *   memcpy_bw [MiB]      (default 256)
 *
 * Prints one line, which `weft baseline-json` reads:
 *   memcpy 256 MiB: 11.36 GB/s copied; reduce a+=b: 5.79 GB/s of a
 * Each figure is the best of 8 passes (GB: 1e9 bytes). */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  long mib = argc > 1 ? atol(argv[1]) : 256;
  if (mib <= 0) {
    fprintf(stderr, "memcpy_bw: give a size in MiB (at least 1), not %s\n", argv[1]);
    return 2;
  }
  size_t bytes = (size_t)mib << 20, count = bytes / sizeof(float);
  float *a = malloc(bytes), *b = malloc(bytes);
  if (!a || !b) {
    fprintf(stderr, "memcpy_bw: cannot allocate 2 x %ld MiB\n", mib);
    return 1;
  }
  for (size_t i = 0; i < count; i++) {
    a[i] = 1.0f;
    b[i] = (float)(i % 7);
  }
  double copy = 1e30, add = 1e30;
  for (int pass = 0; pass < 8; pass++) {
    double t = seconds();
    memcpy(a, b, bytes);
    t = seconds() - t;
    if (t < copy) copy = t;
  }
  for (int pass = 0; pass < 8; pass++) {
    double t = seconds();
    for (size_t i = 0; i < count; i++) a[i] += b[i];
    t = seconds() - t;
    if (t < add) add = t;
  }
  printf("memcpy %ld MiB: %.2f GB/s copied; reduce a+=b: %.2f GB/s of a\n", mib,
         (double)bytes / copy / 1e9, (double)bytes / add / 1e9);
  /* Uses the result, so the compiler keeps the passes. */
  return a[count - 1] < 0.0f;
}
