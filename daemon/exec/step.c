/* The parts of a step around its layers (step.h). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/exec/step.h"

uint32_t mlens_step_blocks(const struct mlens_kv_pool *kv, const struct mlens_engine_req *reqs,
			   int n)
{
	uint32_t need = 0;
	for (int i = 0; i < n; i++)
		need += mlens_seq_blocks_needed(kv, reqs[i].seq,
						(int64_t)reqs[i].seq->len + reqs[i].n_tokens);
	return need;
}

int mlens_step_reserve(const struct mlens_model_config *c, struct mlens_kv_pool *kv,
		       const struct mlens_engine_req *reqs, int n, int64_t max_tokens,
		       int64_t *total)
{
	int rc;

	/* validate everything before touching any state */
	if ((rc = mlens_engine_reqs_check(c, reqs, n, total)))
		return rc;
	if (*total > max_tokens)
		return -E2BIG;
	if (mlens_step_blocks(kv, reqs, n) > mlens_kv_pool_free_blocks(kv))
		return -ENOSPC;
	for (int i = 0; i < n; i++)
		if ((rc = mlens_seq_reserve(kv, reqs[i].seq,
					    (int64_t)reqs[i].seq->len + reqs[i].n_tokens)))
			return rc;
	return 0;
}

int mlens_step_rows_alloc(struct mlens_step_rows *s, size_t T)
{
	memset(s, 0, sizeof(*s));
	s->tok = malloc(T * sizeof(*s->tok));
	s->pos = malloc(T * sizeof(*s->pos));
	s->row_req = malloc(T * sizeof(*s->row_req));
	s->slots = malloc(T * sizeof(*s->slots));
	s->qry = malloc(T * sizeof(*s->qry));
	s->lrow = malloc(T * sizeof(*s->lrow));
	s->samp = malloc(T * sizeof(*s->samp));
	s->sampled = malloc(T * sizeof(*s->sampled));
	s->logp = malloc(T * sizeof(*s->logp));
	if (!s->tok || !s->pos || !s->row_req || !s->slots || !s->qry || !s->lrow || !s->samp ||
	    !s->sampled || !s->logp)
		return -ENOMEM;
	return 0;
}

void mlens_step_rows_free(struct mlens_step_rows *s)
{
	free(s->tok);
	free(s->pos);
	free(s->row_req);
	free(s->slots);
	free(s->qry);
	free(s->lrow);
	free(s->samp);
	free(s->sampled);
	free(s->logp);
	free(s->host_logits);
	memset(s, 0, sizeof(*s));
}

void mlens_step_rows_samp(struct mlens_step_rows *s, const struct mlens_engine_req *reqs)
{
	for (int i = 0; i < s->nl; i++)
		s->samp[i] = reqs[s->row_req[s->lrow[i]]].samp;
}

int mlens_step_rows_host_logits(struct mlens_step_rows *s, size_t rows, int vocab)
{
	if (rows > s->host_logits_rows) {
		float *h = realloc(s->host_logits, rows * (size_t)vocab * sizeof(float));
		if (!h)
			return -ENOMEM;
		s->host_logits = h;
		s->host_logits_rows = rows;
	}
	return 0;
}

void mlens_step_deliver(const struct mlens_step_rows *s, struct mlens_engine_req *reqs, int n,
			int vocab)
{
	size_t V = (size_t)vocab;
	for (int i = 0; i < s->nl; i++) {
		struct mlens_engine_req *r = &reqs[s->row_req[s->lrow[i]]];
		int j = s->pos[s->lrow[i]] - r->seq->len;	/* token index within the request */
		if (r->logits) {
			float *dst = r->all_logits ? r->logits + (size_t)j * V : r->logits;
			memcpy(dst, s->host_logits + (size_t)i * V, V * sizeof(float));
		}
		if (j == r->n_tokens - 1) {
			r->next_token = s->sampled[i];
			r->logprob = s->logp[i];
		}
	}
	for (int i = 0; i < n; i++)
		reqs[i].seq->len += reqs[i].n_tokens;
}
