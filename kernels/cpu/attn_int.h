/* Decode attention kernels of the CPU backend: the contract between the
 * dispatcher (attn.c: variant choice, work split, merge, append) and the
 * per-ISA kernels (attn_avx2.c, attn_avx512.c, built from attn_simd.inc). */
#ifndef MLENS_ATTN_INT_H
#define MLENS_ATTN_INT_H

#include <stddef.h>
#include <stdint.h>
#include "kernels/kv.h"

/* Positions per tile: scores of one tile are softmaxed together. */
#define MLENS_ATTN_TILE 16

/* One task: the query heads [g*group, (g+n_g)*group) (those of KV heads
 * [g, g+n_g)) of one query token over the positions [t0, t1) of its sequence. With out set, the result is the
 * normalised attention output; otherwise the unnormalised partial
 * (acc = sum p*v, m = max score, l = sum p) for a later merge. */
struct mlens_attn_span {
	const struct mlens_kv_cache *kv;
	int layer, g, n_g, group;
	const float *q;			/* [n_g*group][head_dim] */
	const uint32_t *block_table;
	int32_t t0, t1;
	float scale;
	float *out;			/* [n_g*group][head_dim] or NULL */
	float *acc, *m, *l;		/* partial, when out is NULL: [n_g*group][..] */
};

/* scratch holds mlens_attn_scratch_floats(n_g * group, head_dim) floats. */
typedef void (*mlens_attn_span_fn)(const struct mlens_attn_span *s, float *scratch);
/* dst[i] = mlens_f32_to_bf16(src[i]) bit for bit */
typedef void (*mlens_bf16_cvt_fn)(uint16_t *dst, const float *src, size_t n);
/* returns mlens_e4m3_quantize_row(dst, src, n), dst bit for bit */
typedef float (*mlens_e4m3_row_fn)(uint8_t *dst, const float *src, int n);

static inline size_t mlens_attn_scratch_floats(int heads, int head_dim)
{
	/* q, acc: group*hd each; scores (then p) per tile; max, sum, rescale;
	 * one tile of K and one of V widened to fp32 (E4M3 caches) */
	return 2 * (size_t)heads * head_dim + (size_t)heads * MLENS_ATTN_TILE +
	       3 * (size_t)heads + 2 * (size_t)MLENS_ATTN_TILE * head_dim + 16;
}

/* Tuning knobs of the vector kernels and the work split, read at dispatch;
 * set from the environment once (attn.c) or by mlens-bench attention, for
 * measurement. None of them changes a result except chunk_tokens (the merge
 * order), and none depends on the thread count. */
struct mlens_attn_tuning {
	int prefetch_tiles;	/* distance in (tile, KV head) steps of the walk; 0 off */
	int prefetch_bytes;	/* > 0: the distance in K+V bytes instead */
	int prefetch_spread;	/* 1: one line per load, interleaved with the math;
				 * 0: the whole tile at once before it */
	int prefetch_hint;	/* 0: prefetcht0, 1: t1, 2: t2, 3: nta */
	int prefetch_every;	/* spread: prefetch one line in this many (>= 1,
				 * rounded down to a power of two),
				 * leaving the rest to the hardware streamer */
	int chunk_tokens;	/* positions per task of a split sequence */
	int heads_per_task;	/* KV heads per task at most; 0: all (fewer when
				 * the batch would not feed every thread) */
};
extern struct mlens_attn_tuning mlens_attn_tune;

/* The kernels of each ISA level (their files are built with its flags).
 * A span fn handles head_dim % (2 * vector width) == 0, head_dim <= 256. */
void mlens_attn_span_avx2(const struct mlens_attn_span *s, float *scratch);
void mlens_bf16_cvt_avx2(uint16_t *dst, const float *src, size_t n);
float mlens_e4m3_row_avx2(uint8_t *dst, const float *src, int n);	/* AVX-512 uses it too */
/* whether one of the n e4m3 codes at p (n a multiple of 16) is a NaN;
 * AVX-512 uses it too */
int mlens_e4m3_any_nan_avx2(const void *p, size_t n);
void mlens_attn_span_avx512(const struct mlens_attn_span *s, float *scratch);
void mlens_bf16_cvt_avx512(uint16_t *dst, const float *src, size_t n);

#endif
