/* Description: what a step does around its layers (daemon/exec/step.c): the KV
 * blocks its requests need beyond what their sequences hold; the
 * reservation refuses bad requests (-EINVAL, -EOVERFLOW), too many tokens
 * (-E2BIG) and a short pool (-ENOSPC) before it reserves anything, else
 * reserves every request's blocks; a row's token, position, K/V slot and
 * attention query from its sequence's block table, and which rows need
 * logits; the host logits grow, never shrink; delivery hands each request
 * its logits, token and log-probability and grows its sequence. */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/exec/step.h"
#include "kernels/backend.h"
#include "tests/check_common.h"

#define BS 4		/* tokens a block */
#define V 5		/* vocabulary */

static struct mlens_backend be;
static struct mlens_kv_pool pool;
static struct mlens_seq sa, sb;
static const struct mlens_model_config cfg = { .vocab_size = V, .max_position_embeddings = 32 };
static const int32_t ta[9] = { 0, 1, 2, 3, 4, 0, 1, 2, 3 }, tb[2] = { 4, 4 };
static struct mlens_engine_req reqs[2];

/* A pool of 10 blocks; a holds nothing yet and brings 9 tokens, b holds 3
 * tokens (one block) and brings 2 with all its logits. */
static void setup(void)
{
	struct mlens_kv_cache l = { MLENS_DTYPE_F32, 1, 1, 2, BS, 10, NULL, NULL };
	memset(&sa, 0, sizeof(sa));
	memset(&sb, 0, sizeof(sb));
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_int_eq(mlens_kv_pool_init(&pool, &be, &l, NULL, NULL), 0);
	ck_assert_int_eq(mlens_seq_reserve(&pool, &sb, 3), 0);
	sb.len = 3;
	memset(reqs, 0, sizeof(reqs));
	reqs[0] = (struct mlens_engine_req){ .seq = &sa, .tokens = ta, .n_tokens = 9,
					     .samp = { .temperature = 0.5f, .seed = 11 } };
	reqs[1] = (struct mlens_engine_req){ .seq = &sb, .tokens = tb, .n_tokens = 2,
					     .samp = { .temperature = 0, .seed = 22 },
					     .all_logits = true };
}

static void teardown(void)
{
	mlens_seq_fini(&pool, &sa);
	mlens_seq_fini(&pool, &sb);
	mlens_kv_pool_fini(&pool);
	mlens_backend_destroy(&be);
}

/* nothing reserved: a holds no block, b its one, 9 free */
static void untouched(void)
{
	ck_assert_uint_eq(sa.n_blocks, 0);
	ck_assert_uint_eq(sb.n_blocks, 1);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&pool), 9);
	ck_assert_int_eq(sa.len, 0);
	ck_assert_int_eq(sb.len, 3);
}

START_TEST(reserve_checks_first)
{
	int64_t total = -1;
	int32_t bad[2] = { 4, V };

	/* a needs 3 blocks (9 tokens), b one more (5 tokens) */
	ck_assert_uint_eq(mlens_step_blocks(&pool, reqs, 2), 4);
	ck_assert_uint_eq(mlens_step_blocks(&pool, reqs, 1), 3);
	ck_assert_uint_eq(mlens_step_blocks(&pool, reqs + 1, 1), 1);
	/* 11 tokens over a cap of 10 */
	ck_assert_int_eq(mlens_step_reserve(&cfg, &pool, reqs, 2, 10, &total), -E2BIG);
	ck_assert_int_eq(total, 11);
	untouched();
	/* a token outside the vocabulary, in the second request */
	reqs[1].tokens = bad;
	ck_assert_int_eq(mlens_step_reserve(&cfg, &pool, reqs, 2, 100, &total), -EINVAL);
	untouched();
	reqs[1].tokens = tb;
	/* no tokens; no sequence; no requests */
	reqs[1].n_tokens = 0;
	ck_assert_int_eq(mlens_step_reserve(&cfg, &pool, reqs, 2, 100, &total), -EINVAL);
	reqs[1].n_tokens = 2;
	reqs[0].seq = NULL;
	ck_assert_int_eq(mlens_step_reserve(&cfg, &pool, reqs, 2, 100, &total), -EINVAL);
	reqs[0].seq = &sa;
	ck_assert_int_eq(mlens_step_reserve(&cfg, &pool, reqs, 0, 100, &total), -EINVAL);
	untouched();
	/* past max_position_embeddings (32): b at 31 + 2 */
	sb.len = 31;
	ck_assert_int_eq(mlens_step_reserve(&cfg, &pool, reqs, 2, 100, &total), -EOVERFLOW);
	sb.len = 30;	/* 30 + 2 = 32 fits: 8 blocks for b, 3 for a: 10 more > 9 free */
	ck_assert_uint_eq(mlens_step_blocks(&pool, reqs, 2), 3 + 7);
	ck_assert_int_eq(mlens_step_reserve(&cfg, &pool, reqs, 2, 100, &total), -ENOSPC);
	sb.len = 3;
	untouched();
	/* the step: every block reserved, nothing more; lengths unchanged */
	ck_assert_int_eq(mlens_step_reserve(&cfg, &pool, reqs, 2, 11, &total), 0);
	ck_assert_int_eq(total, 11);
	ck_assert_uint_eq(sa.n_blocks, 3);
	ck_assert_uint_eq(sb.n_blocks, 2);
	ck_assert_uint_eq(mlens_kv_pool_free_blocks(&pool), 5);
	ck_assert_uint_eq(mlens_step_blocks(&pool, reqs, 2), 0);
	ck_assert_int_eq(sa.len, 0);
	ck_assert_int_eq(sb.len, 3);
}
END_TEST

START_TEST(rows_and_delivery)
{
	struct mlens_step_rows s;
	float la[V], lb[2][V];
	int64_t total;
	int row = 0;

	ck_assert_int_eq(mlens_step_reserve(&cfg, &pool, reqs, 2, 11, &total), 0);
	ck_assert_int_eq(mlens_step_rows_alloc(&s, 11), 0);
	reqs[0].logits = la;
	reqs[1].logits = &lb[0][0];
	for (int i = 0; i < 2; i++)
		for (int j = 0; j < reqs[i].n_tokens; j++)
			mlens_step_rows_put(&s, row++, i, &reqs[i], j, BS);
	/* a's rows: positions 0..8 in its three blocks */
	for (int r = 0; r < 9; r++) {
		ck_assert_int_eq(s.tok[r], ta[r]);
		ck_assert_int_eq(s.pos[r], r);
		ck_assert_int_eq(s.row_req[r], 0);
		ck_assert_int_eq(s.slots[r], (int64_t)sa.blocks[r / BS] * BS + r % BS);
		ck_assert_int_eq(s.qry[r].ctx_len, r + 1);
		ck_assert_int_eq(s.qry[r].n_blocks, 3);
		ck_assert_ptr_eq(s.qry[r].block_table, sa.blocks);
	}
	/* b's: positions 3 (the end of its first block) and 4 (its second) */
	ck_assert_int_eq(s.pos[9], 3);
	ck_assert_int_eq(s.pos[10], 4);
	ck_assert_int_eq(s.slots[9], (int64_t)sb.blocks[0] * BS + 3);
	ck_assert_int_eq(s.slots[10], (int64_t)sb.blocks[1] * BS);
	ck_assert_int_eq(s.qry[10].ctx_len, 5);
	ck_assert_int_eq(s.row_req[10], 1);
	/* logits: a's last row, both of b's (all_logits) */
	ck_assert_int_eq(s.nl, 3);
	ck_assert_int_eq(s.lrow[0], 8);
	ck_assert_int_eq(s.lrow[1], 9);
	ck_assert_int_eq(s.lrow[2], 10);
	mlens_step_rows_samp(&s, reqs);
	ck_assert_uint_eq(s.samp[0].seed, 11);
	ck_assert_float_eq(s.samp[0].temperature, 0.5f);
	ck_assert_uint_eq(s.samp[1].seed, 22);
	ck_assert_uint_eq(s.samp[2].seed, 22);
	/* host logits: grown to what is asked, never shrunk */
	ck_assert_int_eq(mlens_step_rows_host_logits(&s, 2, V), 0);
	ck_assert_uint_eq(s.host_logits_rows, 2);
	ck_assert_int_eq(mlens_step_rows_host_logits(&s, 1, V), 0);
	ck_assert_uint_eq(s.host_logits_rows, 2);
	ck_assert_int_eq(mlens_step_rows_host_logits(&s, 3, V), 0);
	ck_assert_uint_eq(s.host_logits_rows, 3);
	for (int i = 0; i < 3; i++) {
		for (int v = 0; v < V; v++)
			s.host_logits[i * V + v] = (float)(10 * i + v);
		s.sampled[i] = 100 + i;
		s.logp[i] = -(float)i - 0.5f;
	}
	reqs[0].next_token = reqs[1].next_token = -1;
	mlens_step_deliver(&s, reqs, 2, V);
	/* a: its last row's logits, token and log-probability */
	for (int v = 0; v < V; v++)
		ck_assert_float_eq(la[v], (float)v);
	ck_assert_int_eq(reqs[0].next_token, 100);
	ck_assert_float_eq(reqs[0].logprob, -0.5f);
	/* b: a row of logits per token, its last row's token */
	for (int v = 0; v < V; v++) {
		ck_assert_float_eq(lb[0][v], (float)(10 + v));
		ck_assert_float_eq(lb[1][v], (float)(20 + v));
	}
	ck_assert_int_eq(reqs[1].next_token, 102);
	ck_assert_float_eq(reqs[1].logprob, -2.5f);
	/* the sequences grew by their tokens */
	ck_assert_int_eq(sa.len, 9);
	ck_assert_int_eq(sb.len, 5);
	mlens_step_rows_free(&s);
	ck_assert_ptr_null(s.host_logits);
	ck_assert_ptr_null(s.tok);
	ck_assert_int_eq(s.nl, 0);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("step");
	TCase *tc = tcase_create("step");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, reserve_checks_first);
	tcase_add_test(tc, rows_and_delivery);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
