/* Streaming read bandwidth (readbw.h): AVX-512 or AVX2 loads (plain 64-bit
 * loads on a CPU with neither) over 1 MiB slices claimed by the pool's
 * threads, xor-folded so that the loads stay. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include "kernels/cpu/readbw.h"

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void *mlens_readbw_alloc(size_t bytes)
{
	void *p = NULL;
	if (posix_memalign(&p, 2u << 20, bytes))
		return NULL;
	madvise(p, bytes, MADV_HUGEPAGE);	/* fewer TLB misses, as the daemon's pool */
	return p;
}

struct bw_job {
	const char *buf;
	uint64_t sink[64];
};

__attribute__((target("avx512f"))) static uint64_t read_avx512(const char *p, size_t n)
{
	__m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
	for (size_t i = 0; i < n; i += 256) {
		a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void *)(p + i)));
		a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void *)(p + i + 64)));
		a2 = _mm512_xor_si512(a2, _mm512_load_si512((const void *)(p + i + 128)));
		a3 = _mm512_xor_si512(a3, _mm512_load_si512((const void *)(p + i + 192)));
	}
	a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
	return (uint64_t)_mm_cvtsi128_si64(_mm512_castsi512_si128(a0));
}

__attribute__((target("avx2"))) static uint64_t read_avx2(const char *p, size_t n)
{
	__m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
	for (size_t i = 0; i < n; i += 128) {
		a0 = _mm256_xor_si256(a0, _mm256_load_si256((const void *)(p + i)));
		a1 = _mm256_xor_si256(a1, _mm256_load_si256((const void *)(p + i + 32)));
		a2 = _mm256_xor_si256(a2, _mm256_load_si256((const void *)(p + i + 64)));
		a3 = _mm256_xor_si256(a3, _mm256_load_si256((const void *)(p + i + 96)));
	}
	a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
	return (uint64_t)_mm_cvtsi128_si64(_mm256_castsi256_si128(a0));
}

static uint64_t read_plain(const char *p, size_t n)
{
	const uint64_t *w = (const uint64_t *)(const void *)p;
	uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
	for (size_t i = 0; i < n / 8; i += 4) {
		a0 ^= w[i];
		a1 ^= w[i + 1];
		a2 ^= w[i + 2];
		a3 ^= w[i + 3];
	}
	return a0 ^ a1 ^ a2 ^ a3;
}

static void bw_task(void *arg, int task, int thread)
{
	struct bw_job *j = arg;
	const char *p = j->buf + (size_t)task * MLENS_READBW_SLICE;
	uint64_t r = __builtin_cpu_supports("avx512f") ? read_avx512(p, MLENS_READBW_SLICE)
		     : __builtin_cpu_supports("avx2") ? read_avx2(p, MLENS_READBW_SLICE)
						       : read_plain(p, MLENS_READBW_SLICE);
	j->sink[thread % 64] ^= r;
}

double mlens_readbw_pass(struct mlens_pool *pool, const char *buf, size_t bytes)
{
	struct bw_job j = { buf, { 0 } };
	double t0 = now(), t;
	mlens_pool_run(pool, (int)(bytes / MLENS_READBW_SLICE), bw_task, &j);
	t = now() - t0;
	if (j.sink[0] == 42)	/* keeps the loads alive */
		fputc(' ', stderr);
	return t;
}

double mlens_readbw_best(struct mlens_pool *pool, const char *buf, size_t bytes)
{
	double best = 0.0;
	for (int r = 0; r < 5; r++) {
		double gbs = (double)bytes / mlens_readbw_pass(pool, buf, bytes) / 1e9;
		best = gbs > best ? gbs : best;
	}
	return best;
}
