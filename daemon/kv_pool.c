/* KV block pool: a stack of free block ids; every block is either on the
 * stack or in exactly one sequence's table. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/kv_pool.h"

int mlens_kv_pool_init(struct mlens_kv_pool *p, struct mlens_backend *be,
		       const struct mlens_kv_cache *layout, void *mem_k, void *mem_v)
{
	size_t bytes;
	memset(p, 0, sizeof(*p));
	p->cache = *layout;
	if (layout->n_blocks == 0 || layout->block_size <= 0 || layout->head_dim <= 0 ||
	    layout->n_kv_heads <= 0 || layout->n_layers <= 0)
		return -EINVAL;
	/* n_layers * n_blocks * n_kv * block * hd * es must fit: check in steps */
	bytes = mlens_kv_head_elems(layout) * mlens_dtype_size(layout->dtype);
	if (__builtin_mul_overflow(bytes, (size_t)layout->n_kv_heads, &bytes) ||
	    __builtin_mul_overflow(bytes, (size_t)layout->n_blocks, &bytes) ||
	    __builtin_mul_overflow(bytes, (size_t)layout->n_layers, &bytes))
		return -EOVERFLOW;
	p->free_stack = malloc((size_t)layout->n_blocks * sizeof(uint32_t));
	if (!p->free_stack)
		return -ENOMEM;
	if (mem_k && mem_v) {
		p->cache.k = mem_k;
		p->cache.v = mem_v;
	} else {
		p->be = be;
		p->cache.k = be->ops->alloc(be->ctx, bytes);
		p->cache.v = p->cache.k ? be->ops->alloc(be->ctx, bytes) : NULL;
		if (!p->cache.v) {
			if (p->cache.k)
				be->ops->free(be->ctx, p->cache.k);
			free(p->free_stack);
			p->free_stack = NULL;
			return -ENOMEM;
		}
	}
	/* hand out low ids first: pop from the top */
	for (uint32_t i = 0; i < layout->n_blocks; i++)
		p->free_stack[i] = layout->n_blocks - 1 - i;
	p->n_free = layout->n_blocks;
	return 0;
}

void mlens_kv_pool_fini(struct mlens_kv_pool *p)
{
	if (p->be) {
		p->be->ops->free(p->be->ctx, p->cache.k);
		p->be->ops->free(p->be->ctx, p->cache.v);
	}
	free(p->free_stack);
	memset(p, 0, sizeof(*p));
}

uint32_t mlens_seq_blocks_needed(const struct mlens_kv_pool *p, const struct mlens_seq *s,
				 int64_t new_len)
{
	uint32_t want = mlens_kv_blocks_for(p, new_len);
	return want > s->n_blocks ? want - s->n_blocks : 0;
}

int mlens_seq_reserve(struct mlens_kv_pool *p, struct mlens_seq *s, int64_t new_len)
{
	uint32_t want = mlens_kv_blocks_for(p, new_len);
	if (want <= s->n_blocks)
		return 0;
	if (want - s->n_blocks > p->n_free)
		return -ENOSPC;
	if (want > s->cap) {
		uint32_t cap = s->cap ? s->cap : 8;
		while (cap < want)
			cap *= 2;
		uint32_t *nb = realloc(s->blocks, (size_t)cap * sizeof(*nb));
		if (!nb)
			return -ENOMEM;
		s->blocks = nb;
		s->cap = cap;
	}
	while (s->n_blocks < want)
		s->blocks[s->n_blocks++] = p->free_stack[--p->n_free];
	return 0;
}

void mlens_seq_release(struct mlens_kv_pool *p, struct mlens_seq *s)
{
	/* push back in reverse so a release + re-reserve returns the same ids */
	while (s->n_blocks > 0)
		p->free_stack[p->n_free++] = s->blocks[--s->n_blocks];
	s->len = 0;
}

void mlens_seq_fini(struct mlens_kv_pool *p, struct mlens_seq *s)
{
	mlens_seq_release(p, s);
	free(s->blocks);
	memset(s, 0, sizeof(*s));
}
