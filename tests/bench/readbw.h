/* Streaming read bandwidth of host memory through a thread pool, shared by
 * mlens-bench attention (next to its kernels) and mlens-bench serve (the
 * CPU memory ceiling while a pinned copy runs). */
#ifndef MLENS_BENCH_READBW_H
#define MLENS_BENCH_READBW_H

#include <stddef.h>
#include "kernels/cpu/pool.h"

/* Pool tasks read slices of this many bytes; buffers are multiples of it. */
#define MLENS_BENCH_BW_SLICE ((size_t)1 << 20)

/* A 2 MiB-aligned buffer asking for huge pages (free with free()); NULL
 * when out of memory. */
void *mlens_bench_big_alloc(size_t bytes);
/* Seconds of one pass of streaming loads over buf (bytes a multiple of
 * MLENS_BENCH_BW_SLICE, buf 64-byte aligned) by every thread of pool. */
double mlens_bench_read_pass(struct mlens_pool *pool, const char *buf, size_t bytes);
/* Best of five passes, GB/s (10^9 bytes per second). */
double mlens_bench_read_bw(struct mlens_pool *pool, const char *buf, size_t bytes);

#endif
