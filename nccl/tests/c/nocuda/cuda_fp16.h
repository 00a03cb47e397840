/* Stand-in for CUDA's cuda_fp16.h (see cuda_runtime.h here): nccl.h uses nothing from it. */
