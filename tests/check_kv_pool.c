/* Description: the KV block pool (daemon/exec/kv_pool.c): exact accounting of
 * fixed-size blocks, all or nothing, every block once in a table, on the
 * free stack or in a room, under random reserve and release; the growth
 * room keeps tables in runs of consecutive blocks under churn; the KV
 * layout rule. */
#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/exec/kv_pool.h"
#include "kernels/backend.h"
#include "tests/check_common.h"

static struct mlens_kv_cache small_layout(uint32_t blocks)
{
	struct mlens_kv_cache l = { MLENS_DTYPE_BF16, 2, 2, 8, 4, blocks, NULL, NULL };
	return l;
}

/* The one KV layout rule: F32 for an F32 model, else BF16; a dtype asked
 * for is kept (E4M3 with its scales counted), F16 refused by name; 16 tokens a block and eight full
 * contexts of blocks by default; a token's bytes over all layers. */
START_TEST(kv_layout_rule)
{
	struct mlens_model_config c = { .num_hidden_layers = 3, .num_key_value_heads = 2,
					.head_dim = 8, .max_position_embeddings = 100,
					.dtype = MLENS_DTYPE_BF16 };
	struct mlens_kv_cache l;
	char err[128] = "";

	ck_assert_int_eq(mlens_kv_layout(&l, &c, -1, 0, 0, err, sizeof(err)), 0);
	ck_assert_int_eq(l.dtype, MLENS_DTYPE_BF16);
	ck_assert_int_eq(l.block_size, MLENS_KV_BLOCK_SIZE);
	ck_assert_uint_eq(l.n_blocks, 8 * 7);	/* ceil(100 / 16) blocks a context */
	ck_assert_int_eq(l.n_layers, 3);
	ck_assert_int_eq(l.n_kv_heads, 2);
	ck_assert_int_eq(l.head_dim, 8);
	ck_assert_ptr_null(l.k);
	ck_assert_uint_eq(mlens_kv_token_bytes(&l), 3 * 2 * 8 * 2);
	c.dtype = MLENS_DTYPE_F16;
	ck_assert_int_eq(mlens_kv_dtype(&c, -1), MLENS_DTYPE_BF16);
	c.dtype = MLENS_DTYPE_F32;
	ck_assert_int_eq(mlens_kv_layout(&l, &c, -1, 4, 9, err, sizeof(err)), 0);
	ck_assert_int_eq(l.dtype, MLENS_DTYPE_F32);
	ck_assert_int_eq(l.block_size, 4);
	ck_assert_uint_eq(l.n_blocks, 9);
	ck_assert_uint_eq(mlens_kv_token_bytes(&l), 3 * 2 * 8 * 4);
	ck_assert_int_eq(mlens_kv_layout(&l, &c, MLENS_DTYPE_BF16, 0, 1, err, sizeof(err)), 0);
	ck_assert_int_eq(l.dtype, MLENS_DTYPE_BF16);
	ck_assert_int_eq(mlens_kv_layout(&l, &c, MLENS_DTYPE_F16, 0, 1, err, sizeof(err)), -EINVAL);
	ck_assert_str_eq(err, "KV cache dtype F16 is not supported (use F32, BF16 or FP8)");
	/* fp8: a byte a value and a 4-byte scale a row, the scales after the
	 * codes (64-byte aligned) in the same buffer */
	ck_assert_int_eq(mlens_kv_layout(&l, &c, MLENS_DTYPE_E4M3, 4, 5, err, sizeof(err)), 0);
	ck_assert_int_eq(l.dtype, MLENS_DTYPE_E4M3);
	ck_assert_uint_eq(mlens_kv_token_bytes(&l), 3 * 2 * (8 + 4));
	ck_assert_uint_eq(mlens_kv_code_bytes(&l), 3 * 5 * 2 * 4 * 8);
	ck_assert_uint_eq(mlens_kv_scales_offset(&l), 960);
	ck_assert_uint_eq(mlens_kv_bytes(&l), 960 + 3 * 5 * 2 * 4 * 4);
}
END_TEST

START_TEST(kv_pool_accounting)
{
	struct mlens_backend be;
	struct mlens_kv_pool p;
	struct mlens_kv_cache l = small_layout(10);
	struct mlens_seq a = { 0 }, b = { 0 };

	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_int_eq(mlens_kv_pool_init(&p, &be, &l, NULL, NULL), 0);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 10);
	ck_assert_uint_eq(mlens_kv_blocks_for(&p, 0), 0);
	ck_assert_uint_eq(mlens_kv_blocks_for(&p, 1), 1);
	ck_assert_uint_eq(mlens_kv_blocks_for(&p, 4), 1);
	ck_assert_uint_eq(mlens_kv_blocks_for(&p, 5), 2);

	ck_assert_int_eq(mlens_seq_reserve(&p, &a, 9), 0);	/* 3 blocks */
	ck_assert_uint_eq(a.n_blocks, 3);
	ck_assert_uint_eq(mlens_kv_pool_used_blocks(&p), 3);
	ck_assert_uint_eq(mlens_seq_blocks_needed(&p, &a, 12), 0);
	ck_assert_uint_eq(mlens_seq_blocks_needed(&p, &a, 13), 1);
	/* all or nothing: 8 more blocks do not fit in 7 */
	ck_assert_int_eq(mlens_seq_reserve(&p, &b, 32), -ENOSPC);
	ck_assert_uint_eq(b.n_blocks, 0);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 7);
	ck_assert_int_eq(mlens_seq_reserve(&p, &b, 28), 0);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 0);
	ck_assert_int_eq(mlens_seq_reserve(&p, &a, 13), -ENOSPC);

	/* every block id appears exactly once across the two tables */
	{
		int seen[10] = { 0 };
		for (uint32_t i = 0; i < a.n_blocks; i++)
			seen[a.blocks[i]]++;
		for (uint32_t i = 0; i < b.n_blocks; i++)
			seen[b.blocks[i]]++;
		for (int i = 0; i < 10; i++)
			ck_assert_int_eq(seen[i], 1);
	}
	mlens_seq_release(&p, &a);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 3);
	ck_assert_int_eq(a.len, 0);
	mlens_seq_fini(&p, &b);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 10);
	mlens_seq_fini(&p, &a);
	mlens_kv_pool_fini(&p);
	mlens_backend_destroy(&be);
}
END_TEST

/* Every block once: in a table, on the free stack or in the room list. */
static void pool_check(const struct mlens_kv_pool *p, const struct mlens_seq *s, int n)
{
	uint32_t nb = p->cache.n_blocks;
	int *seen = calloc(nb, sizeof(int));
	ck_assert_ptr_nonnull(seen);
	for (int i = 0; i < n; i++)
		for (uint32_t j = 0; j < s[i].n_blocks; j++)
			seen[s[i].blocks[j]]++;
	for (uint32_t j = 0; j < p->n_stack; j++)
		seen[p->free_stack[j]]++;
	for (uint32_t j = 0; j < p->n_room; j++) {
		seen[p->room[j]]++;
		ck_assert_uint_eq(p->room_pos[p->room[j]], j);
	}
	for (uint32_t b = 0; b < nb; b++)
		ck_assert_int_eq(seen[b], 1);
	free(seen);
}

START_TEST(kv_pool_room)
{
	struct mlens_backend be;
	struct mlens_kv_pool p;
	struct mlens_kv_cache l = small_layout(20);	/* blocks of 4 tokens */
	struct mlens_seq s[3];

	memset(s, 0, sizeof(s));
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_int_eq(mlens_kv_pool_init(&p, &be, &l, NULL, NULL), 0);
	/* 9 tokens now (3 blocks), up to 20 (5): 2 blocks of room, still free */
	ck_assert_int_eq(mlens_seq_reserve_grow(&p, &s[0], 9, 20), 0);
	ck_assert_uint_eq(s[0].n_blocks, 3);
	ck_assert_uint_eq(s[0].n_room, 2);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 17);
	/* the next sequence starts after the room */
	ck_assert_int_eq(mlens_seq_reserve_grow(&p, &s[1], 4, 8), 0);
	ck_assert_uint_eq(s[1].blocks[0], 5);
	ck_assert_uint_eq(s[1].n_room, 1);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 16);
	/* growth takes the room: blocks 0..4 in order, one run */
	ck_assert_int_eq(mlens_seq_reserve(&p, &s[0], 13), 0);
	ck_assert_int_eq(mlens_seq_reserve(&p, &s[1], 5), 0);
	ck_assert_int_eq(mlens_seq_reserve(&p, &s[0], 20), 0);
	for (uint32_t j = 0; j < 5; j++)
		ck_assert_uint_eq(s[0].blocks[j], j);
	ck_assert_uint_eq(mlens_seq_block_runs(&s[0], 5), 1);
	ck_assert_uint_eq(mlens_seq_block_runs(&s[0], 0), 0);
	ck_assert_uint_eq(s[1].blocks[1], 6);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 13);
	pool_check(&p, s, 3);
	/* past the room: the free stack */
	ck_assert_int_eq(mlens_seq_reserve(&p, &s[0], 21), 0);
	ck_assert_uint_eq(s[0].blocks[5], 7);
	ck_assert_uint_eq(mlens_seq_block_runs(&s[0], 6), 2);
	/* released, the same shape gets the same run back */
	mlens_seq_release(&p, &s[0]);
	ck_assert_int_eq(mlens_seq_reserve_grow(&p, &s[0], 9, 20), 0);
	ck_assert_uint_eq(s[0].blocks[0], 0);
	ck_assert_uint_eq(s[0].blocks[s[0].n_blocks], 3);
	pool_check(&p, s, 3);
	mlens_seq_release(&p, &s[0]);
	mlens_seq_release(&p, &s[1]);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 20);
	pool_check(&p, s, 3);

	/* room is never taken from other rooms, and others take it when
	 * nothing else is free: 16 tokens now, 80 later: room 16 of 20 */
	ck_assert_int_eq(mlens_seq_reserve_grow(&p, &s[0], 16, 80), 0);
	ck_assert_uint_eq(s[0].n_room, 16);
	/* the stack is empty: s[1]'s block comes from s[0]'s room (its far
	 * end, the newest entry), and no room is left for s[1] */
	ck_assert_int_eq(mlens_seq_reserve_grow(&p, &s[1], 4, 80), 0);
	ck_assert_uint_eq(s[1].n_room, 0);
	ck_assert_uint_eq(p.room_taken, 1);
	ck_assert_uint_eq(s[1].blocks[0], s[0].blocks[s[0].n_blocks + 15]);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 15);
	ck_assert_int_eq(mlens_seq_reserve_grow(&p, &s[2], 40, 40), 0);	/* 10 blocks */
	ck_assert_uint_eq(p.room_taken, 11);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 5);
	pool_check(&p, s, 3);
	/* s[0] grows into the 5 entries left to it, in order; the 11 taken
	 * ones stay listed until it needs them (skipped) or leaves */
	{
		uint32_t listed[5];
		memcpy(listed, &s[0].blocks[4], sizeof(listed));
		ck_assert_int_eq(mlens_seq_reserve(&p, &s[0], 36), 0);
		ck_assert_uint_eq(s[0].n_blocks, 9);
		ck_assert_int_eq(memcmp(listed, &s[0].blocks[4], sizeof(listed)), 0);
	}
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 0);
	ck_assert_int_eq(mlens_seq_reserve(&p, &s[0], 37), -ENOSPC);
	ck_assert_int_eq(mlens_seq_reserve(&p, &s[1], 5), -ENOSPC);
	pool_check(&p, s, 3);
	for (int i = 0; i < 3; i++)
		mlens_seq_fini(&p, &s[i]);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 20);
	pool_check(&p, s, 0);

	/* no room when it is off */
	mlens_kv_pool_set_room(&p, 0);
	ck_assert_int_eq(mlens_seq_reserve_grow(&p, &s[0], 4, 80), 0);
	ck_assert_uint_eq(s[0].n_room, 0);
	mlens_seq_fini(&p, &s[0]);
	mlens_kv_pool_fini(&p);
	mlens_backend_destroy(&be);
}
END_TEST

/* Steady churn of one request shape, as a KV-bound scheduler runs it:
 * every step the running sequences grow a token (in admission order),
 * the finished ones leave and as many new ones come in. With growth room
 * the decode tables stay whole runs; without it they fall apart into
 * single blocks (the layout CPU decode attention reads slowest). */
static double churn_blocks_per_run(uint32_t room)
{
	enum { P = 128, G = 32, BS = 16, SEQS = 96, STEPS = 200 };
	struct mlens_backend be;
	struct mlens_kv_pool p;
	/* exactly what SEQS sequences need at their longest */
	struct mlens_kv_cache l = { MLENS_DTYPE_BF16, 1, 1, 8, BS, SEQS * ((P + G + BS - 1) / BS), NULL, NULL };
	struct mlens_seq s[SEQS];
	int order[SEQS];
	double blocks = 0, runs = 0;

	memset(s, 0, sizeof(s));
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_int_eq(mlens_kv_pool_init(&p, &be, &l, NULL, NULL), 0);
	mlens_kv_pool_set_room(&p, room);
	/* staggered ages: sequence i has generated i * G / SEQS tokens */
	for (int i = 0; i < SEQS; i++) {
		order[i] = i;
		ck_assert_int_eq(mlens_seq_reserve_grow(&p, &s[i], P, P + G), 0);
		s[i].len = P;
	}
	for (int step = 0; step < STEPS; step++) {
		for (int k = 0; k < SEQS; k++) {
			struct mlens_seq *q = &s[order[k]];
			if (step == 0 && q->len < P + order[k] * G / SEQS) {
				int32_t to = P + order[k] * G / SEQS;
				ck_assert_int_eq(mlens_seq_reserve(&p, q, to), 0);
				q->len = to;
			}
			ck_assert_int_eq(mlens_seq_reserve(&p, q, q->len + 1), 0);
			q->len++;
			if (step >= STEPS / 2) {
				uint32_t nb = mlens_kv_blocks_for(&p, q->len);
				blocks += nb;
				runs += mlens_seq_block_runs(q, nb);
			}
		}
		/* the finished leave (oldest first) and new ones take their place */
		for (int k = 0; k < SEQS; k++) {
			struct mlens_seq *q = &s[order[k]];
			if (q->len < P + G)
				continue;
			mlens_seq_release(&p, q);
		}
		{
			/* running order: the survivors, then the newly admitted */
			bool in[SEQS] = { false };
			int w = 0;
			for (int k = 0; k < SEQS; k++)
				if (s[order[k]].len > 0) {
					in[order[k]] = true;
					order[w++] = order[k];
				}
			for (int k = 0; k < SEQS; k++) {
				if (in[k])
					continue;
				ck_assert_int_eq(mlens_seq_reserve_grow(&p, &s[k], P, P + G), 0);
				s[k].len = P;
				order[w++] = k;
			}
		}
		pool_check(&p, s, SEQS);
	}
	for (int i = 0; i < SEQS; i++)
		mlens_seq_fini(&p, &s[i]);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), l.n_blocks);
	mlens_kv_pool_fini(&p);
	mlens_backend_destroy(&be);
	return blocks / runs;
}

START_TEST(kv_pool_room_keeps_runs)
{
	double with = churn_blocks_per_run(MLENS_KV_ROOM_MAX), without = churn_blocks_per_run(0);
	/* a decode table is 9-10 blocks: with room, one run */
	ck_assert_msg(with > 8.5, "with room: %.2f blocks per run", with);
	ck_assert_msg(without < 3.0, "without room: %.2f blocks per run", without);
}
END_TEST

START_TEST(kv_pool_random_no_leak)
{
	struct mlens_backend be;
	struct mlens_kv_pool p;
	struct mlens_kv_cache l = small_layout(64);
	struct mlens_seq s[8];
	unsigned seed = 12345;

	memset(s, 0, sizeof(s));
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_int_eq(mlens_kv_pool_init(&p, &be, &l, NULL, NULL), 0);
	for (int it = 0; it < 20000; it++) {
		int i = rand_r(&seed) % 8;
		if (rand_r(&seed) % 4 == 0) {
			mlens_seq_release(&p, &s[i]);
		} else {
			int64_t want = s[i].len + 1 + rand_r(&seed) % 20;
			uint32_t before = mlens_kv_pool_free_blocks(&p);
			uint32_t need = mlens_seq_blocks_needed(&p, &s[i], want);
			/* a third of them say how far they may grow (room) */
			int rc = rand_r(&seed) % 3 == 0
				? mlens_seq_reserve_grow(&p, &s[i], want, want + rand_r(&seed) % 60)
				: mlens_seq_reserve(&p, &s[i], want);
			if (need > before) {
				ck_assert_int_eq(rc, -ENOSPC);
				ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), before);
			} else {
				ck_assert_int_eq(rc, 0);
				s[i].len = (int32_t)want;
				ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), before - need);
			}
		}
		uint32_t held = 0;
		for (int j = 0; j < 8; j++)
			held += s[j].n_blocks;
		ck_assert_uint_eq(held + mlens_kv_pool_free_blocks(&p), 64);
		if (it % 16 == 0)
			pool_check(&p, s, 8);
	}
	for (int j = 0; j < 8; j++)
		mlens_seq_fini(&p, &s[j]);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&p), 64);
	mlens_kv_pool_fini(&p);
	mlens_backend_destroy(&be);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("kv_pool");
	TCase *tc = tcase_create("kv_pool");
	tcase_set_timeout(tc, 30);	/* cheap, but CI machines are busy */
	tcase_add_test(tc, kv_layout_rule);
	tcase_add_test(tc, kv_pool_accounting);
	tcase_add_test(tc, kv_pool_random_no_leak);
	tcase_add_test(tc, kv_pool_room);
	tcase_add_test(tc, kv_pool_room_keeps_runs);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
