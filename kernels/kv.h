/* The paged KV cache as kernels see it: one pool of fixed-size blocks shared
 * by all sequences, each block holding block_size tokens of every layer.
 * Layout of K (and V alike): [layer][block][kv_head][slot][head_dim], so that
 * one KV head's keys in one block are contiguous (what decode attention
 * streams through). Block accounting lives in daemon/exec/kv_pool.h.
 *
 * An E4M3 (fp8) cache stores each (layer, block, head, slot) row of K (and
 * of V) as head_dim e4m3 codes and one fp32 scale: value = code * scale,
 * scale = the row's largest magnitude / 448 (kernels/fp8.h), so every row
 * uses the whole e4m3 range. The scales, [layer][block][kv_head][slot],
 * follow the codes in the same allocation (64-byte aligned), so that one
 * buffer of mlens_kv_bytes() is the whole cache whatever its dtype. */
#ifndef MLENS_KV_H
#define MLENS_KV_H

#include <stddef.h>
#include <stdint.h>
#include "kernels/dtype.h"

struct mlens_kv_cache {
	enum mlens_dtype dtype;	/* F32, BF16 or E4M3 */
	int n_layers;
	int n_kv_heads;
	int head_dim;
	int block_size;		/* tokens per block */
	uint32_t n_blocks;
	void *k;		/* backend memory */
	void *v;
};

/* Elements in one (layer, block, head) run: block_size * head_dim. */
static inline size_t mlens_kv_head_elems(const struct mlens_kv_cache *kv)
{
	return (size_t)kv->block_size * (size_t)kv->head_dim;
}

/* Element index of (layer, block, head, slot, 0) in k or v. */
static inline size_t mlens_kv_index(const struct mlens_kv_cache *kv, int layer,
				    uint32_t block, int head, int slot)
{
	size_t b = (size_t)layer * kv->n_blocks + block;
	return ((b * (size_t)kv->n_kv_heads + (size_t)head) * (size_t)kv->block_size +
		(size_t)slot) * (size_t)kv->head_dim;
}

/* Bytes of the element codes of K (or of V) for all layers and blocks. */
static inline size_t mlens_kv_code_bytes(const struct mlens_kv_cache *kv)
{
	return (size_t)kv->n_layers * kv->n_blocks * kv->n_kv_heads *
	       mlens_kv_head_elems(kv) * mlens_dtype_size(kv->dtype);
}

/* Rows (layer, block, head, slot) of K (or of V): one scale each in E4M3. */
static inline size_t mlens_kv_rows(const struct mlens_kv_cache *kv)
{
	return (size_t)kv->n_layers * kv->n_blocks * kv->n_kv_heads * (size_t)kv->block_size;
}

/* Byte offset of the scales in k or v (E4M3 only). */
static inline size_t mlens_kv_scales_offset(const struct mlens_kv_cache *kv)
{
	return (mlens_kv_code_bytes(kv) + 63) & ~(size_t)63;
}

/* Bytes of K (or of V) for all layers and blocks, the scales included. */
static inline size_t mlens_kv_bytes(const struct mlens_kv_cache *kv)
{
	if (kv->dtype != MLENS_DTYPE_E4M3)
		return mlens_kv_code_bytes(kv);
	return mlens_kv_scales_offset(kv) + mlens_kv_rows(kv) * sizeof(float);
}

/* The scales of a cache buffer (kv->k or kv->v, or a device view of one):
 * scale of row (layer, block, head, slot) at mlens_kv_index() / head_dim. */
static inline float *mlens_kv_scales(const struct mlens_kv_cache *kv, const void *base)
{
	return (float *)(void *)((char *)(uintptr_t)base + mlens_kv_scales_offset(kv));
}

/* One query token of decode attention: it attends to positions
 * [0, ctx_len) of its sequence, found through the block table. */
struct mlens_attn_query {
	int32_t ctx_len;
	int32_t n_blocks;		/* entries in block_table */
	const uint32_t *block_table;	/* host memory */
};

#endif
