/* Stand-in for CUDA's cuda_runtime.h, so that NVIDIA's nccl.h compiles on a machine without
 * the CUDA toolkit: nccl.h needs only cudaStream_t from it. Host-buffer programs pass NULL
 * streams. Programs with device buffers compile against the real CUDA headers instead. */
#ifndef WEFTCC_NOCUDA_RUNTIME_H
#define WEFTCC_NOCUDA_RUNTIME_H
#include <stddef.h> /* the real header brings size_t, which nccl.h uses */
typedef struct CUstream_st *cudaStream_t;
#endif
