/* KV block pool: a stack of free block ids and the growth rooms; every
 * block is on the stack, in the room list (free, held for one sequence's
 * growth) or in exactly one sequence's table. */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/errf.h"
#include "daemon/exec/kv_pool.h"

int mlens_kv_layout(struct mlens_kv_cache *out, const struct mlens_model_config *c, int dtype,
		    int block_size, uint32_t n_blocks, char *err, size_t errlen)
{
	memset(out, 0, sizeof(*out));
	out->dtype = mlens_kv_dtype(c, dtype);
	out->n_layers = (int)c->num_hidden_layers;
	out->n_kv_heads = (int)c->num_key_value_heads;
	out->head_dim = (int)c->head_dim;
	out->block_size = block_size > 0 ? block_size : MLENS_KV_BLOCK_SIZE;
	out->n_blocks = n_blocks ? n_blocks :
			(uint32_t)(8 * ((c->max_position_embeddings + out->block_size - 1) /
					out->block_size));
	if (out->dtype == MLENS_DTYPE_F16) {
		mlens_errf(err, errlen, "KV cache dtype F16 is not supported (use F32, BF16 or FP8)");
		return -EINVAL;
	}
	return 0;
}

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
	    __builtin_mul_overflow(bytes, (size_t)layout->n_layers, &bytes) ||
	    bytes > SIZE_MAX / 8)	/* room for E4M3 scales: 4 bytes a row of >= 1 code */
		return -EOVERFLOW;
	bytes = mlens_kv_bytes(layout);
	/* the free stack, the room list and the per-block room index and
	 * tag: four arrays of n_blocks ids in one allocation (free_stack's) */
	p->free_stack = malloc((size_t)layout->n_blocks * 4 * sizeof(uint32_t));
	if (!p->free_stack)
		return -ENOMEM;
	p->room = p->free_stack + layout->n_blocks;
	p->room_pos = p->room + layout->n_blocks;
	p->room_tag = p->room_pos + layout->n_blocks;
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
			memset(p, 0, sizeof(*p));
			return -ENOMEM;
		}
	}
	/* hand out low ids first: pop from the top */
	for (uint32_t i = 0; i < layout->n_blocks; i++) {
		p->free_stack[i] = layout->n_blocks - 1 - i;
		p->room_pos[i] = UINT32_MAX;
		p->room_tag[i] = 0;
	}
	p->n_stack = layout->n_blocks;
	p->room_max = MLENS_KV_ROOM_MAX;
	return 0;
}

void mlens_kv_pool_set_room(struct mlens_kv_pool *p, uint32_t blocks)
{
	p->room_max = blocks < MLENS_KV_ROOM_MAX ? blocks : MLENS_KV_ROOM_MAX;
}

/* Take block b out of the room list (swap with the last entry). */
static void room_remove(struct mlens_kv_pool *p, uint32_t b)
{
	uint32_t i = p->room_pos[b], last = p->room[--p->n_room];
	p->room[i] = last;
	p->room_pos[last] = i;
	p->room_pos[b] = UINT32_MAX;
}

static bool room_holds(const struct mlens_kv_pool *p, const struct mlens_seq *s, uint32_t b)
{
	return s->tag && p->room_pos[b] != UINT32_MAX && p->room_tag[b] == s->tag;
}

/* One more block for s (the caller checked the free count): its own room
 * first, then the free stack, then the room list's last entry (mostly the
 * far end of the newest room, the block its holder needs last). */
static uint32_t take_block(struct mlens_kv_pool *p, struct mlens_seq *s)
{
	uint32_t b;
	while (s->n_room > 0) {
		b = s->blocks[s->n_blocks];
		if (room_holds(p, s, b)) {
			room_remove(p, b);
			s->n_room--;
			return b;
		}
		/* taken by another sequence: drop it from the list */
		memmove(&s->blocks[s->n_blocks], &s->blocks[s->n_blocks + 1],
			(size_t)(s->n_room - 1) * sizeof(uint32_t));
		s->n_room--;
	}
	if (p->n_stack > 0) {
		b = p->free_stack[--p->n_stack];
	} else {
		b = p->room[p->n_room - 1];
		room_remove(p, b);
		p->room_taken++;
	}
	return b;
}

void mlens_kv_pool_fini(struct mlens_kv_pool *p)
{
	if (p->be) {
		p->be->ops->free(p->be->ctx, p->cache.k);
		p->be->ops->free(p->be->ctx, p->cache.v);
	}
	free(p->free_stack);	/* and the room arrays after it */
	memset(p, 0, sizeof(*p));
}

uint32_t mlens_seq_blocks_needed(const struct mlens_kv_pool *p, const struct mlens_seq *s,
				 int64_t new_len)
{
	uint32_t want = mlens_kv_blocks_for(p, new_len);
	return want > s->n_blocks ? want - s->n_blocks : 0;
}

/* The table holds want blocks and n_room + room entries after them. */
static int table_fit(struct mlens_seq *s, uint32_t want)
{
	uint32_t cap;
	if (want <= s->cap)
		return 0;
	cap = s->cap ? s->cap : 8;
	while (cap < want)
		cap *= 2;
	uint32_t *nb = realloc(s->blocks, (size_t)cap * sizeof(*nb));
	if (!nb)
		return -ENOMEM;
	s->blocks = nb;
	s->cap = cap;
	return 0;
}

int mlens_seq_reserve_grow(struct mlens_kv_pool *p, struct mlens_seq *s, int64_t new_len,
			   int64_t final_len)
{
	uint32_t want = mlens_kv_blocks_for(p, new_len), room = 0;
	if (want <= s->n_blocks)
		return 0;
	if (want - s->n_blocks > mlens_kv_pool_free_blocks(p))
		return -ENOSPC;
	if (s->n_blocks == 0 && s->n_room == 0 && final_len > new_len && p->room_max > 0) {
		uint32_t fin = mlens_kv_blocks_for(p, final_len);
		room = fin - want < p->room_max ? fin - want : p->room_max;
	}
	if (table_fit(s, (want > s->n_blocks + s->n_room ? want : s->n_blocks + s->n_room) + room))
		return -ENOMEM;
	while (s->n_blocks < want) {
		uint32_t b = take_block(p, s);	/* reads the table at n_blocks */
		s->blocks[s->n_blocks++] = b;
	}
	/* the room: the stack's next blocks (after the ones just taken),
	 * while the stack has them beyond what this reservation used */
	if (room > p->n_stack)
		room = p->n_stack;
	if (room > 0) {
		if (++p->next_tag == 0)
			p->next_tag = 1;
		s->tag = p->next_tag;
		s->n_room = 0;
		for (uint32_t i = 0; i < room; i++) {
			uint32_t b = p->free_stack[--p->n_stack];
			p->room_pos[b] = p->n_room;
			p->room_tag[b] = s->tag;
			p->room[p->n_room++] = b;
			s->blocks[s->n_blocks + s->n_room++] = b;
		}
	}
	return 0;
}

int mlens_seq_reserve(struct mlens_kv_pool *p, struct mlens_seq *s, int64_t new_len)
{
	return mlens_seq_reserve_grow(p, s, new_len, 0);
}

uint32_t mlens_seq_block_runs(const struct mlens_seq *s, uint32_t n)
{
	uint32_t runs;
	if (n > s->n_blocks)
		n = s->n_blocks;
	runs = n > 0;
	for (uint32_t i = 1; i < n; i++)
		runs += s->blocks[i] != s->blocks[i - 1] + 1;
	return runs;
}

void mlens_seq_release(struct mlens_kv_pool *p, struct mlens_seq *s)
{
	/* the room first, then the blocks, each in reverse: the next pops
	 * return the table's order (a release + re-reserve returns the same
	 * ids), its blocks before its room */
	while (s->n_room > 0) {
		uint32_t b = s->blocks[s->n_blocks + --s->n_room];
		if (room_holds(p, s, b)) {
			room_remove(p, b);
			p->free_stack[p->n_stack++] = b;
		}
	}
	s->tag = 0;
	while (s->n_blocks > 0)
		p->free_stack[p->n_stack++] = s->blocks[--s->n_blocks];
	s->len = 0;
}

void mlens_seq_fini(struct mlens_kv_pool *p, struct mlens_seq *s)
{
	mlens_seq_release(p, s);
	free(s->blocks);
	memset(s, 0, sizeof(*s));
}
