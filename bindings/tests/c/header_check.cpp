// The header compiles as C++ (extern "C" linkage, no C-only constructs in it).
#include "weftcc.h"

static_assert(sizeof(weftUniqueId) == WEFT_UNIQUE_ID_BYTES, "unique id size");

extern "C" weftResult_t all_reduce_in_place(float *buf, size_t n, weftComm_t comm) {
  return weftAllReduce(buf, buf, n, weftFloat32, weftSum, comm, nullptr);
}
