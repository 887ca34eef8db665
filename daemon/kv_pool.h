/* The KV block pool: exact accounting of fixed-size blocks shared by all
 * sequences, and the per-sequence block table. The memory itself is a
 * struct mlens_kv_cache (kernels/kv.h). Not thread-safe: the scheduler's
 * thread owns the pool. */
#ifndef MLENS_KV_POOL_H
#define MLENS_KV_POOL_H

#include <stdint.h>
#include "kernels/backend.h"

struct mlens_kv_pool {
	struct mlens_kv_cache cache;
	uint32_t *free_stack;	/* ids of free blocks */
	uint32_t n_free;
	struct mlens_backend *be;	/* owner of cache memory, NULL if external */
};

/* A sequence's place in the pool: tokens [0, len) are cached in blocks. */
struct mlens_seq {
	uint32_t *blocks;
	uint32_t n_blocks;
	uint32_t cap;
	int32_t len;
};

/* Allocate the cache through be (be->ops->alloc) unless mem_k/mem_v are given
 * (caller-owned memory of mlens_kv_bytes() each, e.g. pinned NUMA pages). */
int mlens_kv_pool_init(struct mlens_kv_pool *p, struct mlens_backend *be,
		       const struct mlens_kv_cache *layout, void *mem_k, void *mem_v);
void mlens_kv_pool_fini(struct mlens_kv_pool *p);

static inline uint32_t mlens_kv_pool_free_blocks(const struct mlens_kv_pool *p)
{
	return p->n_free;
}

static inline uint32_t mlens_kv_pool_used_blocks(const struct mlens_kv_pool *p)
{
	return p->cache.n_blocks - p->n_free;
}

/* Blocks a sequence needs to hold len tokens. */
static inline uint32_t mlens_kv_blocks_for(const struct mlens_kv_pool *p, int64_t len)
{
	return (uint32_t)((len + p->cache.block_size - 1) / p->cache.block_size);
}

/* Extra blocks seq needs to grow to new_len tokens. */
uint32_t mlens_seq_blocks_needed(const struct mlens_kv_pool *p, const struct mlens_seq *s,
				 int64_t new_len);
/* Make room for new_len tokens: all or nothing; -ENOSPC when the pool is
 * short, -ENOMEM when the block table cannot grow. len is not changed. */
int mlens_seq_reserve(struct mlens_kv_pool *p, struct mlens_seq *s, int64_t new_len);
/* Return every block to the pool and reset len; the table memory stays. */
void mlens_seq_release(struct mlens_kv_pool *p, struct mlens_seq *s);
/* Release and free the table. */
void mlens_seq_fini(struct mlens_kv_pool *p, struct mlens_seq *s);

#endif
