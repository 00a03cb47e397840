/* The check macros weftcc's C test programs share (the C ABI's bindings/tests/c/ranks.c, the NCCL
 * drop-in's nccl/tests/c/): CHECK counts a failed check in `failures`, MUST exits on a failed
 * call. Messages name the rank: set `me` once it is known. The compilers of these programs add
 * this directory to the include path. */
#ifndef WEFTCC_TEST_CHECKS_H
#define WEFTCC_TEST_CHECKS_H

#include <stdio.h>
#include <stdlib.h>

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

/* A call returning a RESULT_T that must be SUCCESS: otherwise prints its code, ERRSTR(code) and
 * the library's LAST error message, and exits 2. */
#define MUST(call, RESULT_T, SUCCESS, ERRSTR, LAST)                                 \
  do {                                                                              \
    RESULT_T r_ = (call);                                                           \
    if (r_ != SUCCESS) {                                                            \
      fprintf(stderr, "rank %d: line %d: %s -> %d (%s): %s\n", me, __LINE__, #call, \
              (int)r_, ERRSTR(r_), LAST);                                           \
      exit(2);                                                                      \
    }                                                                               \
  } while (0)

#endif
