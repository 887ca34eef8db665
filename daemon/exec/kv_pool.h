/* The KV block pool: exact accounting of fixed-size blocks shared by all
 * sequences, and the per-sequence block table. The memory itself is a
 * struct mlens_kv_cache (kernels/kv.h). Not thread-safe: the scheduler's
 * thread owns the pool.
 *
 * Growth room: a sequence admitted with the length it may reach takes the
 * blocks it needs now and, beside them, up to MLENS_KV_ROOM_MAX more from
 * the top of the free stack as its room: free blocks (counted free, taken
 * by anyone when nothing else is left) that its own growth takes first.
 * A sequence's blocks then lie in the order the free stack held them, and
 * a released sequence pushes its room and blocks back so that the next
 * admission pops them in table order: with requests of one shape the
 * tables stay runs of consecutive blocks, which CPU decode attention
 * streams faster than blocks scattered one by one (mlens-bench attention
 * --block-runs); without room, decode growth interleaves the sequences' blocks and a
 * churned pool's tables become single blocks. */
#ifndef MLENS_KV_POOL_H
#define MLENS_KV_POOL_H

#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"
#include "kernels/backend.h"

/* Most blocks of growth room a sequence holds (1024 tokens of 16). */
#define MLENS_KV_ROOM_MAX 64

/* Tokens a KV block holds unless configured. */
#define MLENS_KV_BLOCK_SIZE 16

/* ==== the layout: one rule for the pool, the engine, the pipeline, the
 * memory plans and the start-up ==== */

/* The KV cache's dtype for model c: want (an enum mlens_dtype) when >= 0,
 * else F32 for an F32 model and BF16 for any other. */
static inline enum mlens_dtype mlens_kv_dtype(const struct mlens_model_config *c, int want)
{
	if (want >= 0)
		return (enum mlens_dtype)want;
	return c->dtype == MLENS_DTYPE_F32 ? MLENS_DTYPE_F32 : MLENS_DTYPE_BF16;
}

/* The layout of model c's KV cache, without memory: dtype as
 * mlens_kv_dtype, block_size tokens a block (<= 0: MLENS_KV_BLOCK_SIZE),
 * n_blocks blocks (0: enough for eight contexts of
 * max_position_embeddings), the model's layers, KV heads and head size (a
 * shard or a one-layer test pool sets its own after). The layout is
 * filled either way; 0, or -EINVAL for F16 (said in err), which the
 * kernels' cache does not hold. dtype E4M3 is the fp8 cache. */
int mlens_kv_layout(struct mlens_kv_cache *out, const struct mlens_model_config *c, int dtype,
		    int block_size, uint32_t n_blocks, char *err, size_t errlen);

/* Bytes of K (or of V) one token takes over all layers, an E4M3 row's
 * scale included. */
static inline size_t mlens_kv_token_bytes(const struct mlens_kv_cache *kv)
{
	size_t row = (size_t)kv->head_dim * mlens_dtype_size(kv->dtype) +
		     (kv->dtype == MLENS_DTYPE_E4M3 ? sizeof(float) : 0);
	return (size_t)kv->n_layers * (size_t)kv->n_kv_heads * row;
}

struct mlens_kv_pool {
	struct mlens_kv_cache cache;
	uint32_t *free_stack;	/* ids of free blocks outside any room */
	uint32_t n_stack;
	uint32_t *room;		/* ids of free blocks held as some sequence's room
				 * (this and the two below live in free_stack's
				 * allocation) */
	uint32_t n_room;
	uint32_t *room_pos;	/* per block: its index in room[], or UINT32_MAX */
	uint32_t *room_tag;	/* per block in room[]: the holder's tag */
	uint32_t next_tag;
	uint32_t room_max;	/* room a sequence may take (<= MLENS_KV_ROOM_MAX) */
	uint64_t room_taken;	/* room blocks taken by other sequences, total
				 * (stats kv_room_taken_total) */
	struct mlens_backend *be;	/* owner of cache memory, NULL if external */
};

/* A sequence's place in the pool: tokens [0, len) are cached in blocks;
 * blocks[n_blocks, n_blocks + n_room) lists its growth room, in the order
 * its growth takes it (an entry another sequence took is skipped). */
struct mlens_seq {
	uint32_t *blocks;
	uint32_t n_blocks;
	uint32_t cap;
	int32_t len;
	uint32_t n_room;
	uint32_t tag;		/* this admission's room tag, 0: none */
};

/* Allocate the cache through be (be->ops->alloc) unless mem_k/mem_v are given
 * (caller-owned memory of mlens_kv_bytes() each, e.g. pinned NUMA pages). */
int mlens_kv_pool_init(struct mlens_kv_pool *p, struct mlens_backend *be,
		       const struct mlens_kv_cache *layout, void *mem_k, void *mem_v);
void mlens_kv_pool_fini(struct mlens_kv_pool *p);

/* Free blocks: the free stack's and the rooms'. */
static inline uint32_t mlens_kv_pool_free_blocks(const struct mlens_kv_pool *p)
{
	return p->n_stack + p->n_room;
}

/* Free blocks outside any sequence's growth room. */
static inline uint32_t mlens_kv_pool_unroomed_blocks(const struct mlens_kv_pool *p)
{
	return p->n_stack;
}

static inline uint32_t mlens_kv_pool_used_blocks(const struct mlens_kv_pool *p)
{
	return p->cache.n_blocks - mlens_kv_pool_free_blocks(p);
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
/* The same for a sequence that holds no blocks yet and may grow to
 * final_len tokens: it also takes growth room (see above) from the free
 * stack, never from other rooms; the pool's free count does not change
 * for the room. final_len <= new_len: as mlens_seq_reserve. */
int mlens_seq_reserve_grow(struct mlens_kv_pool *p, struct mlens_seq *s, int64_t new_len,
			   int64_t final_len);
/* Growth room a sequence may take from now on, in blocks (0: none; at
 * most MLENS_KV_ROOM_MAX). */
void mlens_kv_pool_set_room(struct mlens_kv_pool *p, uint32_t blocks);
/* Runs of consecutive block ids in the first n entries of s's table (0
 * for n == 0): n / runs is how far decode attention streams unbroken. */
uint32_t mlens_seq_block_runs(const struct mlens_seq *s, uint32_t n);
/* Return every block (and the room) to the pool and reset len; the table
 * memory stays. */
void mlens_seq_release(struct mlens_kv_pool *p, struct mlens_seq *s);
/* Release and free the table. */
void mlens_seq_fini(struct mlens_kv_pool *p, struct mlens_seq *s);

#endif
