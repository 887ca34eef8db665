/* The fake-collective path of daemon/tools/shard_sim.h: G ranks on one CPU
 * backend, each with its weight slices and KV cache; all-reduce,
 * reduce-scatter, all-to-all and all-gather as copies and adds in rank
 * order 0..G-1, so that a result never depends on timing. The residual
 * stream is kept once: every rank's replica would be identical, being made
 * by the same collective. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/errf.h"
#include "daemon/exec/layer.h"
#include "daemon/exec/step.h"
#include "daemon/tools/shard_sim.h"

#define SIM_MAX_TOKENS 4096

/* A rank's layer: wq, wk, wv row slices (pointers into the model); wo
 * its [H][q_heads*hd] columns, a copy; w1, w3 TP: row slices, EP: owned
 * experts, NULL others; w2 TP: [H][inter_r] copies, EP: owned, the
 * model's; the norms and the router the model's (replicated). */
struct rank {
	struct mlens_kv_pool kv;	/* its kv heads; block ids from rank 0's pool */
	struct mlens_layer_desc d;	/* its heads and expert slice */
	struct mlens_layer_run run;
	struct mlens_layer_bound *layers;
	/* scratch, SIM_MAX_TOKENS rows */
	float *q, *k, *v, *att, *part;	/* part: [T][H] partial sums it contributes */
	/* EP: rows received for its experts and their outputs */
	float *xin, *yout, *win;
	int32_t *idin, *src_row;
	int n_in;
};

struct mlens_shard_sim {
	const struct mlens_model *m;
	struct mlens_model_config cfg;
	struct mlens_backend *be;
	struct mlens_shard_plan plan;
	struct mlens_layer_desc d;	/* the whole layer's (replicated norms, router) */
	struct mlens_layer_run run;
	size_t es;
	struct rank *ranks;
	float *x, *xn, *sum, *rlog, *rw, *logits;
	int32_t *rid;
	struct mlens_step_rows rows;	/* the step's rows (host memory) */
	int32_t *last;			/* each request's last row */
};

/* Columns [c0, c0+nc) of a [rows][cols] matrix of es-byte elements. */
static void *copy_cols(const void *src, size_t es, int rows, int cols, int c0, int nc)
{
	char *dst = malloc((size_t)rows * nc * es);
	if (!dst)
		return NULL;
	for (int r = 0; r < rows; r++)
		memcpy(dst + (size_t)r * nc * es, (const char *)src + ((size_t)r * cols + c0) * es,
		       (size_t)nc * es);
	return dst;
}

static const void *rows_at(const void *w, size_t es, int r0, int cols)
{
	return (const char *)w + (size_t)r0 * cols * es;
}

static int bind_rank(struct mlens_shard_sim *s, int r)
{
	const struct mlens_shard_plan *p = &s->plan;
	const struct mlens_shard_rank *k = &p->rank[r];
	struct rank *rk = &s->ranks[r];
	int H = p->hidden, hd = p->head_dim, E = p->experts, L = (int)s->cfg.num_hidden_layers;

	rk->d = s->d;
	rk->d.n_heads = k->q_heads;
	rk->d.n_kv_heads = k->kv_heads;
	rk->d.inter = k->inter;
	rk->run = (struct mlens_layer_run){ s->be, &rk->d, NULL };
	rk->layers = calloc((size_t)L, sizeof(*rk->layers));
	if (!rk->layers)
		return -ENOMEM;
	for (int l = 0; l < L; l++) {
		const struct mlens_layer_weights *w = &s->m->layers[l];
		struct mlens_layer_bound *b = &rk->layers[l];
		b->attn_norm = w->attn_norm->data;
		b->ffn_norm = w->ffn_norm->data;
		b->router = w->router->data;
		b->wq = rows_at(w->wq->data, s->es, k->q_head0 * hd, H);
		b->wk = rows_at(w->wk->data, s->es, k->kv_head0 * hd, H);
		b->wv = rows_at(w->wv->data, s->es, k->kv_head0 * hd, H);
		b->wo = copy_cols(w->wo->data, s->es, H, p->heads * hd, k->q_head0 * hd, k->q_heads * hd);
		b->w1 = calloc((size_t)E, sizeof(void *));
		b->w3 = calloc((size_t)E, sizeof(void *));
		b->w2 = calloc((size_t)E, sizeof(void *));
		if (!b->wo || !b->w1 || !b->w2 || !b->w3)
			return -ENOMEM;
		for (int e = 0; e < E; e++) {
			if (p->scheme == MLENS_SHARD_TP) {
				b->w1[e] = rows_at(w->w1[e], s->es, k->inter0, H);
				b->w3[e] = rows_at(w->w3[e], s->es, k->inter0, H);
				b->w2[e] = copy_cols(w->w2[e], s->es, H, p->inter, k->inter0, k->inter);
				if (!b->w2[e])
					return -ENOMEM;
			} else if (e >= k->expert0 && e < k->expert0 + k->experts) {
				b->w1[e] = w->w1[e];
				b->w3[e] = w->w3[e];
				b->w2[e] = w->w2[e];
			}
		}
		b->moe = (struct mlens_moe_weights){ .n_experts = E, .hidden = H,
			.inter = k->inter, .dtype = s->cfg.dtype, .w1 = b->w1, .w2 = b->w2,
			.w3 = b->w3 };
	}
	return 0;
}

static void *salloc(struct mlens_shard_sim *s, size_t elems, int *rc)
{
	void *p;
	if (*rc)
		return NULL;
	p = s->be->ops->alloc(s->be->ctx, elems ? elems * 4 : 4);
	if (!p)
		*rc = -ENOMEM;
	return p;
}

int mlens_shard_sim_create(struct mlens_shard_sim **out, const struct mlens_model *m,
			   struct mlens_backend *be, const struct mlens_shard_plan *plan,
			   uint32_t kv_blocks, int block_size, char *err, size_t errlen)
{
	struct mlens_shard_sim *s;
	size_t T = SIM_MAX_TOKENS, H = (size_t)m->cfg.hidden_size;
	int rc = 0, K = (int)m->cfg.num_experts_per_tok;

	if (!be->ops->host_memory) {
		mlens_errf(err, errlen, "shard simulation: backend %s is not host memory; use cpu", be->ops->name);
		return -EINVAL;
	}
	if (plan->hidden != m->cfg.hidden_size || plan->heads != m->cfg.num_attention_heads ||
	    plan->experts != m->cfg.num_local_experts || plan->inter != m->cfg.intermediate_size) {
		mlens_errf(err, errlen, "shard simulation: the plan was made for another model");
		return -EINVAL;
	}
	if (strcmp(m->cfg.architecture, "MixtralForCausalLM")) {
		/* its ranks bind Mixtral's tensors and norms only (no q/k norms,
		 * biases, shared or dense MLPs, LayerNorm, clip or fused Wqkv) */
		mlens_errf(err, errlen, "shard simulation: %s models are not simulated; use a MixtralForCausalLM model",
			   m->cfg.architecture);
		return -ENOTSUP;
	}
	if (m->cfg.expert_dtype == MLENS_DTYPE_E4M3) {
		/* its expert slices would need their scales sliced too */
		mlens_errf(err, errlen, "shard simulation: %s has fp8 experts; the simulation takes bf16, fp16 or fp32 experts",
			   m->dir);
		return -ENOTSUP;
	}
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->m = m;
	s->cfg = m->cfg;
	s->be = be;
	s->plan = *plan;
	s->es = mlens_dtype_size(m->cfg.dtype);
	mlens_layer_desc_init(&s->d, &s->cfg);
	s->run = (struct mlens_layer_run){ be, &s->d, NULL };
	s->ranks = calloc((size_t)plan->gpus, sizeof(*s->ranks));
	if (!s->ranks) {
		rc = -ENOMEM;
		goto fail;
	}
	for (int r = 0; r < plan->gpus && !rc; r++) {
		struct rank *rk = &s->ranks[r];
		const struct mlens_shard_rank *k = &plan->rank[r];
		struct mlens_kv_cache layout;
		/* the model's KV dtype; never F16, so this cannot fail */
		mlens_kv_layout(&layout, &m->cfg, -1, block_size, kv_blocks, NULL, 0);
		layout.n_blocks = kv_blocks;
		layout.n_kv_heads = k->kv_heads;
		layout.head_dim = plan->head_dim;
		rc = mlens_kv_pool_init(&rk->kv, be, &layout, NULL, NULL);
		if (rc) {
			mlens_errf(err, errlen, "shard simulation: cannot allocate rank %d's KV cache: %s", r,
			       strerror(-rc));
			goto fail;
		}
		rc = bind_rank(s, r);
		rk->q = salloc(s, T * k->q_heads * plan->head_dim, &rc);
		rk->att = salloc(s, T * k->q_heads * plan->head_dim, &rc);
		rk->k = salloc(s, T * k->kv_heads * plan->head_dim, &rc);
		rk->v = salloc(s, T * k->kv_heads * plan->head_dim, &rc);
		rk->part = salloc(s, T * H, &rc);
		rk->xin = salloc(s, T * H, &rc);
		rk->yout = salloc(s, T * H, &rc);
		rk->win = salloc(s, T * K, &rc);
		rk->idin = salloc(s, T * K, &rc);
		rk->src_row = salloc(s, T, &rc);
	}
	s->x = salloc(s, T * H, &rc);
	s->xn = salloc(s, T * H, &rc);
	s->sum = salloc(s, T * H, &rc);
	s->rlog = salloc(s, T * plan->experts, &rc);
	s->rw = salloc(s, T * K, &rc);
	s->rid = salloc(s, T * K, &rc);
	s->logits = salloc(s, T * plan->vocab, &rc);
	s->last = salloc(s, T, &rc);
	if (rc || mlens_step_rows_alloc(&s->rows, T)) {
		rc = rc ? rc : -ENOMEM;
		mlens_errf(err, errlen, "shard simulation: out of memory for %d ranks", plan->gpus);
		goto fail;
	}
	*out = s;
	return 0;
fail:
	mlens_shard_sim_destroy(s);
	return rc;
}

static void sfree(struct mlens_shard_sim *s, void *p)
{
	if (p)
		s->be->ops->free(s->be->ctx, p);
}

void mlens_shard_sim_destroy(struct mlens_shard_sim *s)
{
	if (!s)
		return;
	for (int r = 0; s->ranks && r < s->plan.gpus; r++) {
		struct rank *rk = &s->ranks[r];
		for (int l = 0; rk->layers && l < s->cfg.num_hidden_layers; l++) {
			struct mlens_layer_bound *b = &rk->layers[l];
			free((void *)b->wo);
			for (int e = 0; b->w2 && s->plan.scheme == MLENS_SHARD_TP && e < s->plan.experts; e++)
				free((void *)b->w2[e]);
			free(b->w1);
			free(b->w2);
			free(b->w3);
		}
		free(rk->layers);
		if (rk->kv.free_stack)
			mlens_kv_pool_fini(&rk->kv);
		sfree(s, rk->q);
		sfree(s, rk->att);
		sfree(s, rk->k);
		sfree(s, rk->v);
		sfree(s, rk->part);
		sfree(s, rk->xin);
		sfree(s, rk->yout);
		sfree(s, rk->win);
		sfree(s, rk->idin);
		sfree(s, rk->src_row);
	}
	free(s->ranks);
	sfree(s, s->x);
	sfree(s, s->xn);
	sfree(s, s->sum);
	sfree(s, s->rlog);
	sfree(s, s->rw);
	sfree(s, s->rid);
	sfree(s, s->logits);
	sfree(s, s->last);
	mlens_step_rows_free(&s->rows);
	free(s);
}

struct mlens_kv_pool *mlens_shard_sim_kv(struct mlens_shard_sim *s)
{
	return &s->ranks[0].kv;
}

/* ==== the fake collectives, all in rank order ==== */

/* all-reduce of every rank's part rows [r0, r1): sum = part_0 + part_1 + ...
 * (left to right), then x += sum. An all-reduce followed by the residual
 * add that every rank does on its replica. */
static void allreduce_add(struct mlens_shard_sim *s, int r0, int r1)
{
	size_t H = (size_t)s->plan.hidden;
	for (size_t i = (size_t)r0 * H; i < (size_t)r1 * H; i++) {
		float acc = s->ranks[0].part[i];
		for (int r = 1; r < s->plan.gpus; r++)
			acc += s->ranks[r].part[i];
		s->x[i] += acc;
	}
}

/* ==== one step ==== */

#define OPS (s->be->ops)
#define CTX (s->be->ctx)
#define TRY(x) do { if ((rc = (x))) return rc; } while (0)

static int attention(struct mlens_shard_sim *s, int l, int T)
{
	const struct mlens_shard_plan *p = &s->plan;
	const struct mlens_layer_rows rows = { .n = T, .slots = s->rows.slots, .qry = s->rows.qry };
	int rc;

	/* the norm is replicated: every rank computes the same rows */
	TRY(mlens_layer_attn_norm(&s->run, &s->ranks[0].layers[l], s->x, s->xn, T));
	for (int r = 0; r < p->gpus; r++) {
		struct rank *rk = &s->ranks[r];
		const struct mlens_layer_bound *b = &rk->layers[l];
		const struct mlens_layer_act a = { .q = rk->q, .k = rk->k, .v = rk->v, .att = rk->att };
		TRY(mlens_layer_qkv_rope(&rk->run, b, s->xn, rk->q, rk->k, rk->v, s->rows.pos, T));
		TRY(mlens_layer_attend(&rk->run, &rk->kv.cache, l, &a, &rows));
		/* partial O projection over its heads' columns */
		TRY(mlens_layer_out_proj(&rk->run, b, rk->part, rk->att, false, T, false));
	}
	return 0;
}

static int moe_tp(struct mlens_shard_sim *s, int l, int T)
{
	const struct mlens_shard_plan *p = &s->plan;
	int rc;

	allreduce_add(s, 0, T);
	/* the norm and the router are replicated */
	TRY(mlens_layer_route(&s->run, &s->ranks[0].layers[l], s->x, s->xn, s->rlog, s->rid, s->rw,
			      T));
	for (int r = 0; r < p->gpus; r++) {
		struct rank *rk = &s->ranks[r];
		memset(rk->part, 0, (size_t)T * p->hidden * sizeof(float));
		TRY(mlens_layer_experts(&rk->run, &rk->layers[l].moe, rk->part, s->xn, s->rid, s->rw,
					T, 0));
	}
	allreduce_add(s, 0, T);
	return 0;
}

static int moe_ep(struct mlens_shard_sim *s, int l, int T, int64_t *rows_out)
{
	const struct mlens_shard_plan *p = &s->plan;
	int H = p->hidden, K = p->top_k, G = p->gpus, rc;
	size_t rowb = (size_t)H * sizeof(float);

	/* reduce-scatter: rank r sums the partials of its token rows */
	for (int r = 0; r < G; r++) {
		int t0, nt = mlens_shard_split(T, G, r, &t0);
		allreduce_add(s, t0, t0 + nt);
	}
	/* each rank: norm and router on its rows (the shared xn, rid, rw
	 * arrays hold every rank's rows at their own offsets) */
	for (int r = 0; r < G; r++) {
		int t0, nt = mlens_shard_split(T, G, r, &t0);
		if (!nt)
			continue;
		TRY(mlens_layer_route(&s->run, &s->ranks[r].layers[l], s->x + (size_t)t0 * H,
				      s->xn + (size_t)t0 * H, s->rlog + (size_t)t0 * p->experts,
				      s->rid + (size_t)t0 * K, s->rw + (size_t)t0 * K, nt));
	}
	/* all-to-all dispatch: destination d receives, from sources in rank
	 * order, each token row that chose one of d's experts, once, with the
	 * choices of other ranks' experts masked (-1 matches no expert) */
	for (int d = 0; d < G; d++) {
		struct rank *rk = &s->ranks[d];
		int32_t *idin = rk->idin;
		rk->n_in = 0;
		for (int t = 0; t < T; t++) {
			bool mine = false;
			for (int j = 0; j < K; j++)
				mine |= mlens_shard_expert_owner(p, s->rid[(size_t)t * K + j]) == d;
			if (!mine)
				continue;
			memcpy(rk->xin + (size_t)rk->n_in * H, s->xn + (size_t)t * H, rowb);
			for (int j = 0; j < K; j++) {
				int32_t e = s->rid[(size_t)t * K + j];
				idin[(size_t)rk->n_in * K + j] = mlens_shard_expert_owner(p, e) == d ? e : -1;
				rk->win[(size_t)rk->n_in * K + j] = s->rw[(size_t)t * K + j];
				if (rows_out && mlens_shard_expert_owner(p, e) == d)
					rows_out[d]++;
			}
			rk->src_row[rk->n_in++] = t;
		}
		memset(rk->yout, 0, (size_t)rk->n_in * rowb);
		if (rk->n_in)
			TRY(mlens_layer_experts(&rk->run, &rk->layers[l].moe, rk->yout, rk->xin, idin,
						rk->win, rk->n_in, 0));
	}
	/* all-to-all combine: each token's owner adds the outputs coming back,
	 * expert ranks in order 0..G-1, into a zeroed sum, then into x; the
	 * all-gather that follows is the shared x itself */
	memset(s->sum, 0, (size_t)T * rowb);
	for (int d = 0; d < G; d++) {
		struct rank *rk = &s->ranks[d];
		for (int i = 0; i < rk->n_in; i++) {
			float *o = s->sum + (size_t)rk->src_row[i] * H;
			const float *y = rk->yout + (size_t)i * H;
			for (int j = 0; j < H; j++)
				o[j] += y[j];
		}
	}
	for (size_t i = 0; i < (size_t)T * H; i++)
		s->x[i] += s->sum[i];
	return 0;
}

int mlens_shard_sim_step(struct mlens_shard_sim *s, struct mlens_engine_req *reqs, int n,
			 int64_t *rows_out)
{
	const struct mlens_shard_plan *p = &s->plan;
	struct mlens_kv_pool *pool = &s->ranks[0].kv;
	int H = p->hidden, V = p->vocab, bs = pool->cache.block_size;
	int T, row = 0, rc = 0;
	int64_t total;

	TRY(mlens_step_reserve(&s->cfg, pool, reqs, n, SIM_MAX_TOKENS, &total));
	T = (int)total;
	s->rows.nl = 0;
	for (int i = 0; i < n; i++) {
		for (int j = 0; j < reqs[i].n_tokens; j++, row++)
			mlens_step_rows_put(&s->rows, row, i, &reqs[i], j, bs);
		s->last[i] = row - 1;
	}

	TRY(OPS->embed(CTX, s->x, s->m->embed->data, s->cfg.dtype, H, s->rows.tok, T));
	for (int l = 0; l < (int)s->cfg.num_hidden_layers; l++) {
		TRY(attention(s, l, T));
		if (p->scheme == MLENS_SHARD_TP)
			TRY(moe_tp(s, l, T));
		else
			TRY(moe_ep(s, l, T, rows_out));
	}
	/* logits of each request's last row: norm (replicated), then each rank
	 * its vocab rows of lm_head, all-gathered into the full rows */
	for (int i = 0; i < n; i++)
		TRY(OPS->rmsnorm(CTX, s->xn + (size_t)i * H, s->x + (size_t)s->last[i] * H,
				 s->m->final_norm->data, s->cfg.dtype, 1, H, (float)s->cfg.rms_norm_eps));
	for (int r = 0; r < p->gpus; r++) {
		const struct mlens_shard_rank *k = &p->rank[r];
		float *part = s->ranks[r].part;
		TRY(OPS->gemm(CTX, part, s->xn, rows_at(s->m->lm_head->data, s->es, k->vocab0, H),
			      s->cfg.dtype, n, H, k->vocab, false));
		for (int i = 0; i < n; i++)
			memcpy(s->logits + (size_t)i * V + k->vocab0, part + (size_t)i * k->vocab,
			       (size_t)k->vocab * sizeof(float));
	}
	for (int i = 0; i < n; i++) {
		struct mlens_engine_req *r = &reqs[i];
		const float *lg = s->logits + (size_t)i * V;
		int32_t best = 0;
		for (int v = 1; v < V; v++)
			if (lg[v] > lg[best])
				best = v;
		r->next_token = best;
		if (r->logits)
			memcpy(r->logits, lg, (size_t)V * sizeof(float));
		r->seq->len += r->n_tokens;
	}
	return 0;
}
