/* Streaming read bandwidth of host memory through a thread pool, shared by
 * the profiler (the model's CPU memory rate, alone and beside the weight
 * stream), mlens-bench attention (next to its kernels) and mlens-bench
 * serve (the CPU memory ceiling while a pinned copy runs). */
#ifndef MLENS_CPU_READBW_H
#define MLENS_CPU_READBW_H

#include <stddef.h>
#include "kernels/cpu/pool.h"

/* Pool tasks read slices of this many bytes; buffers are multiples of it. */
#define MLENS_READBW_SLICE ((size_t)1 << 20)

/* A 2 MiB-aligned buffer asking for huge pages (free with free()); NULL
 * when out of memory. */
void *mlens_readbw_alloc(size_t bytes);
/* Seconds of one pass of streaming loads over buf (bytes a multiple of
 * MLENS_READBW_SLICE, buf 64-byte aligned) by every thread of pool. */
double mlens_readbw_pass(struct mlens_pool *pool, const char *buf, size_t bytes);
/* Best of five passes, GB/s (10^9 bytes per second). */
double mlens_readbw_best(struct mlens_pool *pool, const char *buf, size_t bytes);

#endif
