/* CPU decode attention and KV append with a kernel chosen at run time
 * (scalar reference, AVX2+FMA, AVX-512) and a work split over the pool by
 * (sequence, KV head, KV range); what the daemon's config and the tests see. */
#ifndef MLENS_CPU_ATTN_H
#define MLENS_CPU_ATTN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kernels/kv.h"
#include "kernels/cpu/pool.h"

/* Positions per task when a sequence is split: a context of n positions
 * goes as about n / MLENS_ATTN_CHUNK_TOKENS tasks (at least one) of equal
 * length in whole blocks, never a short remainder of its own. Independent
 * of the thread count, so that results do not depend on it
 * (MLENS_ATTN_CHUNK=N overrides it for measurements). */
#define MLENS_ATTN_CHUNK_TOKENS 512

/* Choose the kernel: "scalar", "avx2", "avx512", or "auto" (the best the CPU
 * has; also the default, unless the environment variable MLENS_ATTN_KERNEL
 * names one). Tuning knobs for measurements, read once from the environment
 * (struct mlens_attn_tuning in attn_int.h): MLENS_ATTN_PREFETCH=N prefetch
 * distance in tiles (0 off), MLENS_ATTN_PREFETCH_BYTES=B in bytes instead,
 * MLENS_ATTN_PREFETCH_SPREAD=0|1 a burst per tile or lines spread through
 * the math, MLENS_ATTN_PREFETCH_HINT=0-3 prefetcht0/t1/t2/nta,
 * MLENS_ATTN_PREFETCH_EVERY=N one line in N, MLENS_ATTN_CHUNK=N positions
 * per task, MLENS_ATTN_HEADS_PER_TASK=N KV heads per task at most.
 * scalar is the reference; avx2 and avx512 take bf16 or f32 caches with
 * head_dim a multiple of 16 (avx2) or 32 (avx512) up to 256, and fall back
 * to the reference for other shapes. Returns 0, -EINVAL for an unknown name,
 * -ENOTSUP when this CPU lacks the ISA.
 * Process-wide; call it before attention runs, not during. */
int mlens_cpu_attn_set_variant(const char *name);
/* Name of the kernel in use ("scalar", "avx2" or "avx512"). */
const char *mlens_cpu_attn_variant(void);
/* Whether this CPU (and build) can run the named kernel. */
bool mlens_cpu_attn_variant_supported(const char *name);

/* Buffers that decode attention reuses from call to call (partial results,
 * task list, per-thread scratch); zero-initialise, release with _fini. */
struct mlens_cpu_attn_ws {
	void *tasks;
	size_t tasks_bytes;
	float *part;
	size_t part_bytes;
	float *scratch;
	size_t scratch_bytes;
};
void mlens_cpu_attn_ws_fini(struct mlens_cpu_attn_ws *ws);

/* The attn_decode op of backend.h over the pool with the chosen kernel.
 * q, out: [n][n_heads][head_dim]. 0, -EINVAL (head counts), -ERANGE (a
 * query's context is empty or beyond its block table), -ENOMEM. */
int mlens_cpu_attn_decode(struct mlens_pool *pool, struct mlens_cpu_attn_ws *ws,
			  float *out, const float *q, const struct mlens_kv_cache *kv,
			  int layer, const struct mlens_attn_query *queries, int n,
			  int n_heads, float scale);

/* The attn_decode_half op of backend.h: the output rounded to dt (bf16 or
 * f16) into half [n][n_heads][head_dim], each value as mlens_cpu_round
 * rounds mlens_cpu_attn_decode's (the same kernel, split and order), in
 * the same pool run: the vector kernels round each task's output from
 * their scratch, the scalar one from out, which is room for the fp32
 * output whose content is unspecified after. Errors as
 * mlens_cpu_attn_decode's, and -EINVAL for another dt, no half or no
 * out. */
int mlens_cpu_attn_decode_half(struct mlens_pool *pool, struct mlens_cpu_attn_ws *ws,
			       void *half, enum mlens_dtype dt, float *out, const float *q,
			       const struct mlens_kv_cache *kv, int layer,
			       const struct mlens_attn_query *queries, int n, int n_heads,
			       float scale);

/* The kv_append op of backend.h: bf16 stores are mlens_f32_to_bf16 values,
 * converted with the chosen kernel's vector code, rows split over the pool
 * (NULL: the caller alone); the result does not depend on the split. 0 or
 * -ERANGE (a slot or the layer out of range; then nothing is written). */
/* The round op of backend.h: rows x cols values of src to dt (bf16 or
 * f16), each as mlens_store rounds it (bf16 through the chosen kernel's
 * vector code), spread over the pool (NULL: the caller alone). 0 or
 * -EINVAL (another dt, a negative size). */
int mlens_cpu_round(struct mlens_pool *pool, void *dst, enum mlens_dtype dt, const float *src,
		    int rows, int cols);

int mlens_cpu_kv_append(struct mlens_pool *pool, struct mlens_kv_cache *kv, int layer,
			const float *k, const float *v, const int64_t *slots, int n);

#endif
