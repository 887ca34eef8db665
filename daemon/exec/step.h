/* What the engine and the hybrid pipeline share around a step's layers:
 * the requests checked and their KV blocks reserved, the step's rows (one
 * a token, host memory), and the sampled tokens and logits handed back to
 * the requests. */
#ifndef MLENS_STEP_H
#define MLENS_STEP_H

#include <stddef.h>
#include <stdint.h>
#include "daemon/exec/engine.h"

/* KV blocks the requests need beyond what their sequences hold. */
uint32_t mlens_step_blocks(const struct mlens_kv_pool *kv, const struct mlens_engine_req *reqs,
			   int n);

/* mlens_engine_reqs_check, then more than max_tokens tokens: -E2BIG; more
 * blocks than the pool has free: -ENOSPC; else every request's blocks
 * reserved (-ENOMEM when a block table cannot grow: the blocks reserved
 * stay with their sequences). *total: the step's tokens. */
int mlens_step_reserve(const struct mlens_model_config *c, struct mlens_kv_pool *kv,
		       const struct mlens_engine_req *reqs, int n, int64_t max_tokens,
		       int64_t *total);

/* A step's rows, max_tokens of each array. */
struct mlens_step_rows {
	int32_t *tok, *pos;
	int32_t *row_req;	/* request index of each row */
	int64_t *slots;		/* the row's K/V slot in the pool */
	struct mlens_attn_query *qry;
	int32_t *lrow;		/* rows that need logits, nl of them */
	int nl;
	/* per row of lrow: its sampling parameters, token and log-probability */
	struct mlens_sampling *samp;
	int32_t *sampled;
	float *logp;
	float *host_logits;	/* [nl][vocab] where a request asked (grown) */
	size_t host_logits_rows;
};

int mlens_step_rows_alloc(struct mlens_step_rows *s, size_t max_tokens);
void mlens_step_rows_free(struct mlens_step_rows *s);

/* Row row is token j of request i (r = &reqs[i]); a row that needs logits
 * goes on lrow. bs: the pool's block size. */
static inline void mlens_step_rows_put(struct mlens_step_rows *s, int row, int i,
				       const struct mlens_engine_req *r, int j, int bs)
{
	int32_t p = r->seq->len + j;
	s->tok[row] = r->tokens[j];
	s->pos[row] = p;
	s->row_req[row] = i;
	s->slots[row] = (int64_t)r->seq->blocks[p / bs] * bs + p % bs;
	s->qry[row].ctx_len = p + 1;
	s->qry[row].n_blocks = (int32_t)r->seq->n_blocks;
	s->qry[row].block_table = r->seq->blocks;
	if (r->all_logits || j == r->n_tokens - 1)
		s->lrow[s->nl++] = row;
}

/* samp[i] for each row of lrow from its request. */
void mlens_step_rows_samp(struct mlens_step_rows *s, const struct mlens_engine_req *reqs);
/* Room for rows rows of host logits. */
int mlens_step_rows_host_logits(struct mlens_step_rows *s, size_t rows, int vocab);

/* The step done: each request gets its logits (where it asked), its
 * next token and log-probability; its sequence grows by its tokens. */
void mlens_step_deliver(const struct mlens_step_rows *s, struct mlens_engine_req *reqs, int n,
			int vocab);

#endif
