/* One decoder layer's weights and forward pass through the backend ops
 * (layer.h). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include "daemon/exec/layer.h"

void mlens_layer_desc_init(struct mlens_layer_desc *d, const struct mlens_model_config *c)
{
	d->dtype = c->dtype;
	/* a config built by hand leaves expert_dtype 0: experts in dtype */
	d->expert_dtype = c->expert_dtype == MLENS_DTYPE_E4M3 ? MLENS_DTYPE_E4M3 : c->dtype;
	d->expert_scale = c->expert_dtype == MLENS_DTYPE_E4M3 ? c->expert_scale :
				(struct mlens_wscale){ MLENS_WSCALE_NONE, 0, 0 };
	d->hidden = (int)c->hidden_size;
	d->n_heads = (int)c->num_attention_heads;
	d->n_kv_heads = (int)c->num_key_value_heads;
	d->head_dim = (int)c->head_dim;
	d->n_experts = (int)c->num_local_experts;
	d->top_k = (int)c->num_experts_per_tok;
	d->inter = (int)c->intermediate_size;
	d->norm_eps = (float)c->rms_norm_eps;
	d->rope_theta = (float)c->rope_theta;
	d->attn_scale = 1.0f / sqrtf((float)d->head_dim);
	d->norm_kind = c->norm_kind;
	d->qk_norm = c->qk_norm;
	d->router_renorm = !c->topk_raw;
	d->clip_qkv = (float)c->clip_qkv;
	d->w2_transposed = c->w2_transposed;
}

/* ==== weights ==== */

static const void *backend_place(void *arg, const void *host, size_t bytes, int *rc)
{
	return mlens_backend_place(arg, host, bytes, rc);
}

static void backend_unplace(void *arg, const void *p, size_t bytes)
{
	(void)bytes;
	mlens_backend_unplace(arg, p);
}

const struct mlens_layer_placer mlens_layer_placer_backend_ops = {
	.place = backend_place,
	.unplace = backend_unplace,
};

static const void *put(const struct mlens_layer_placer *pl, const struct mlens_tensor *t, int *rc)
{
	return pl->place(pl->arg, t->data, t->nbytes, rc);
}

/* A family's optional tensor: NULL stays NULL. */
static const void *put_opt(const struct mlens_layer_placer *pl, const struct mlens_tensor *t,
			   int *rc)
{
	return t ? put(pl, t, rc) : NULL;
}

static void unput_opt(const struct mlens_layer_placer *pl, const void *p,
		      const struct mlens_tensor *t)
{
	if (t)
		pl->unplace(pl->arg, p, t->nbytes);
}

int mlens_layer_bind_expert(struct mlens_layer_bound *b, const struct mlens_layer_weights *w,
			    const struct mlens_layer_desc *d, int x, const struct mlens_layer_placer *pl)
{
	size_t ih = mlens_layer_expert_bytes(d);
	size_t s13 = mlens_layer_scale_bytes(d, false), s2 = mlens_layer_scale_bytes(d, true);
	int rc = 0;

	b->w1[x] = pl->place(pl->arg, w->w1[x], ih, &rc);
	b->w2[x] = pl->place(pl->arg, w->w2[x], ih, &rc);
	b->w3[x] = pl->place(pl->arg, w->w3[x], ih, &rc);
	if (s13 && !rc && (!w->s1 || !w->s1[x] || !w->s2[x] || !w->s3[x]))
		rc = -EINVAL;	/* fp8 experts without scales */
	if (s13) {
		b->s1[x] = pl->place(pl->arg, w->s1[x], s13, &rc);
		b->s2[x] = pl->place(pl->arg, w->s2[x], s2, &rc);
		b->s3[x] = pl->place(pl->arg, w->s3[x], s13, &rc);
	}
	return rc;
}

void mlens_layer_unbind_expert(struct mlens_layer_bound *b, const struct mlens_layer_weights *w,
			       const struct mlens_layer_desc *d, int x,
			       const struct mlens_layer_placer *pl)
{
	size_t ih = mlens_layer_expert_bytes(d);
	size_t s13 = mlens_layer_scale_bytes(d, false), s2 = mlens_layer_scale_bytes(d, true);

	(void)w;
	if (b->w1 && b->w2 && b->w3) {
		pl->unplace(pl->arg, b->w1[x], ih);
		pl->unplace(pl->arg, b->w2[x], ih);
		pl->unplace(pl->arg, b->w3[x], ih);
		b->w1[x] = b->w2[x] = b->w3[x] = NULL;
	}
	if (s13 && b->s1 && b->s2 && b->s3) {
		pl->unplace(pl->arg, b->s1[x], s13);
		pl->unplace(pl->arg, b->s2[x], s2);
		pl->unplace(pl->arg, b->s3[x], s13);
		b->s1[x] = b->s2[x] = b->s3[x] = NULL;
	}
}

int mlens_layer_bind(struct mlens_layer_bound *b, const struct mlens_layer_weights *w,
		     const struct mlens_layer_desc *d, int experts,
		     const struct mlens_layer_placer *pl)
{
	int rc = 0;

	b->attn_norm = put(pl, w->attn_norm, &rc);
	b->wq = put(pl, w->wq, &rc);
	b->wk = put(pl, w->wk, &rc);
	b->wv = put(pl, w->wv, &rc);
	b->wo = put(pl, w->wo, &rc);
	b->ffn_norm = put(pl, w->ffn_norm, &rc);
	b->router = put_opt(pl, w->router, &rc);
	b->q_norm = put_opt(pl, w->q_norm, &rc);
	b->k_norm = put_opt(pl, w->k_norm, &rc);
	b->bq = put_opt(pl, w->bq, &rc);
	b->bk = put_opt(pl, w->bk, &rc);
	b->bv = put_opt(pl, w->bv, &rc);
	b->bo = put_opt(pl, w->bo, &rc);
	b->mlp_w[0] = put_opt(pl, w->mlp_w1, &rc);
	b->mlp_w[1] = put_opt(pl, w->mlp_w2, &rc);
	b->mlp_w[2] = put_opt(pl, w->mlp_w3, &rc);
	b->mlp_gate = put_opt(pl, w->mlp_gate, &rc);
	b->mlp = (struct mlens_moe_weights){ .n_experts = w->mlp_w1 ? 1 : 0, .hidden = d->hidden,
		.inter = (int)w->mlp_inter, .dtype = d->dtype, .w1 = &b->mlp_w[0],
		.w2 = &b->mlp_w[1], .w3 = &b->mlp_w[2], .model_dtype = d->dtype };
	b->w1 = calloc((size_t)d->n_experts, sizeof(void *));
	b->w2 = calloc((size_t)d->n_experts, sizeof(void *));
	b->w3 = calloc((size_t)d->n_experts, sizeof(void *));
	b->s1 = calloc((size_t)d->n_experts, sizeof(void *));
	b->s2 = calloc((size_t)d->n_experts, sizeof(void *));
	b->s3 = calloc((size_t)d->n_experts, sizeof(void *));
	if (!b->w1 || !b->w2 || !b->w3 || !b->s1 || !b->s2 || !b->s3)
		return -ENOMEM;
	for (int x = 0; x < experts && w->router && !rc; x++)
		rc = mlens_layer_bind_expert(b, w, d, x, pl);
	b->moe = (struct mlens_moe_weights){ .n_experts = d->n_experts, .hidden = d->hidden,
		.inter = d->inter, .dtype = d->expert_dtype, .w1 = b->w1, .w2 = b->w2, .w3 = b->w3,
		.scale = d->expert_scale, .s1 = b->s1, .s2 = b->s2, .s3 = b->s3,
		.model_dtype = d->dtype,
		.w2_transposed = d->w2_transposed };
	return rc;
}

void mlens_layer_unbind(struct mlens_layer_bound *b, const struct mlens_layer_weights *w,
			const struct mlens_layer_desc *d, int experts,
			const struct mlens_layer_placer *pl)
{
	pl->unplace(pl->arg, b->attn_norm, w->attn_norm->nbytes);
	pl->unplace(pl->arg, b->wq, w->wq->nbytes);
	pl->unplace(pl->arg, b->wk, w->wk->nbytes);
	pl->unplace(pl->arg, b->wv, w->wv->nbytes);
	pl->unplace(pl->arg, b->wo, w->wo->nbytes);
	pl->unplace(pl->arg, b->ffn_norm, w->ffn_norm->nbytes);
	unput_opt(pl, b->router, w->router);
	unput_opt(pl, b->q_norm, w->q_norm);
	unput_opt(pl, b->k_norm, w->k_norm);
	unput_opt(pl, b->bq, w->bq);
	unput_opt(pl, b->bk, w->bk);
	unput_opt(pl, b->bv, w->bv);
	unput_opt(pl, b->bo, w->bo);
	unput_opt(pl, b->mlp_w[0], w->mlp_w1);
	unput_opt(pl, b->mlp_w[1], w->mlp_w2);
	unput_opt(pl, b->mlp_w[2], w->mlp_w3);
	unput_opt(pl, b->mlp_gate, w->mlp_gate);
	for (int x = 0; x < experts && w->router; x++)
		mlens_layer_unbind_expert(b, w, d, x, pl);
	free(b->w1);
	free(b->w2);
	free(b->w3);
	free(b->s1);
	free(b->s2);
	free(b->s3);
	b->w1 = b->w2 = b->w3 = NULL;
	b->s1 = b->s2 = b->s3 = NULL;
}

int mlens_ends_bind(struct mlens_ends_bound *b, const struct mlens_model *m,
		    const struct mlens_layer_placer *pl)
{
	int rc = 0;
	b->embed = put(pl, m->embed, &rc);
	b->final_norm = put(pl, m->final_norm, &rc);
	b->lm_head = m->lm_head == m->embed ? b->embed : put(pl, m->lm_head, &rc);
	return rc;
}

void mlens_ends_unbind(struct mlens_ends_bound *b, const struct mlens_model *m,
		       const struct mlens_layer_placer *pl)
{
	pl->unplace(pl->arg, b->embed, m->embed->nbytes);
	pl->unplace(pl->arg, b->final_norm, m->final_norm->nbytes);
	if (b->lm_head != b->embed)
		pl->unplace(pl->arg, b->lm_head, m->lm_head->nbytes);
	b->embed = b->final_norm = b->lm_head = NULL;
}

/* ==== the forward pass ==== */

#define OPS (r->be->ops)
#define CTX (r->be->ctx)
const char *mlens_layer_op_name(enum mlens_layer_op op)
{
	static const char *const names[MLENS_LAYER_OP_N] = {
		[MLENS_LAYER_OP_NORM] = "norm",
		[MLENS_LAYER_OP_QKV] = "qkv_gemm",
		[MLENS_LAYER_OP_ROPE] = "rope",
		[MLENS_LAYER_OP_KV_APPEND] = "kv_store",
		[MLENS_LAYER_OP_PREFILL] = "prefill_attention",
		[MLENS_LAYER_OP_DECODE] = "decode_attention",
		[MLENS_LAYER_OP_WO] = "o_gemm",
		[MLENS_LAYER_OP_ROUTER] = "router",
		[MLENS_LAYER_OP_MOE] = "moe",
		[MLENS_LAYER_OP_LM_HEAD] = "lm_head_gemm",
		[MLENS_LAYER_OP_SAMPLE] = "sample",
		[MLENS_LAYER_OP_EMBED] = "embed",
	};
	return (unsigned)op < MLENS_LAYER_OP_N ? names[op] : NULL;
}

/* Run op x of flops FLOPs, a probe around it when one is set. */
#define OPF(kind, flops, x)                                                             \
	do {                                                                            \
		if (r->probe)                                                           \
			r->probe->begin(r->probe->arg);                                 \
		if ((rc = (x)))                                                         \
			return rc;                                                      \
		if (r->probe && (rc = r->probe->end(r->probe->arg, kind, (flops))))    \
			return rc;                                                      \
	} while (0)
#define OP(kind, x) OPF(kind, 0.0, x)

/* FLOPs of an n x k by k x m product. */
static double gemm_flops(int n, int k, int m)
{
	return 2.0 * n * k * m;
}

/* FLOPs of attention over pairs (query, key) pairs: q.k and p.v. */
static double attn_flops(const struct mlens_layer_desc *d, double pairs)
{
	return 4.0 * mlens_layer_qdim(d) * pairs;
}

int mlens_layer_embed(const struct mlens_layer_run *r, float *x, const void *table,
		      const int32_t *tok, int n)
{
	int rc;

	OP(MLENS_LAYER_OP_EMBED, OPS->embed(CTX, x, table, r->d->dtype, r->d->hidden, tok, n));
	return 0;
}

int mlens_layer_kv_append(const struct mlens_layer_run *r, struct mlens_kv_cache *kv, int layer,
			  const float *k, const float *v, const int64_t *slots, int n)
{
	int rc;

	OP(MLENS_LAYER_OP_KV_APPEND, OPS->kv_append(CTX, kv, layer, k, v, slots, n));
	return 0;
}

/* out = the layer's norm (desc's norm_kind) of n rows of x with weight w. */
static int layer_norm_op(const struct mlens_layer_run *r, float *out, const float *x,
			 const void *w, int n)
{
	const struct mlens_layer_desc *d = r->d;

	if (d->norm_kind == MLENS_NORM_RMS)
		return OPS->rmsnorm(CTX, out, x, w, d->dtype, n, d->hidden, d->norm_eps);
	if (!MLENS_BACKEND_HAS(OPS, layernorm))
		return -ENOTSUP;
	return OPS->layernorm(CTX, out, x, w, d->dtype, n, d->hidden, d->norm_eps);
}

int mlens_layer_qkv_rope(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			 const float *xn, float *q, float *k, float *v, const int32_t *pos, int n)
{
	const struct mlens_layer_desc *d = r->d;
	/* one call: a GPU backend rounds xn once for the three */
	float *const qkv[3] = { q, k, v };
	const void *const wqkv[3] = { b->wq, b->wk, b->wv };
	const int mqkv[3] = { mlens_layer_qdim(d), mlens_layer_kvdim(d), mlens_layer_kvdim(d) };
	const void *const bqkv[3] = { b->bq, b->bk, b->bv };
	/* the q/k norm's rows: a head each, or the whole projection */
	const bool head = d->qk_norm == MLENS_QK_NORM_HEAD;
	int rc;

	OPF(MLENS_LAYER_OP_QKV, gemm_flops(n, d->hidden, mqkv[0] + mqkv[1] + mqkv[2]),
	    mlens_backend_gemm_multi(OPS, CTX, qkv, xn, wqkv, d->dtype, n, d->hidden, mqkv, 3));
	for (int i = 0; i < 3; i++)
		if (bqkv[i])
			OP(MLENS_LAYER_OP_QKV, OPS->bias_add(CTX, qkv[i], bqkv[i], d->dtype, n, mqkv[i]));
	if (d->qk_norm) {
		OP(MLENS_LAYER_OP_NORM, OPS->rmsnorm(CTX, q, q, b->q_norm, d->dtype,
						     head ? n * d->n_heads : n,
						     head ? d->head_dim : mqkv[0], d->norm_eps));
		OP(MLENS_LAYER_OP_NORM, OPS->rmsnorm(CTX, k, k, b->k_norm, d->dtype,
						     head ? n * d->n_kv_heads : n,
						     head ? d->head_dim : mqkv[1], d->norm_eps));
	}
	for (int i = 0; i < 3 && d->clip_qkv > 0.0f; i++)
		OP(MLENS_LAYER_OP_QKV, OPS->clamp(CTX, qkv[i], (size_t)n * (size_t)mqkv[i],
						  d->clip_qkv));
	OP(MLENS_LAYER_OP_ROPE, OPS->rope(CTX, q, pos, n, d->n_heads, d->head_dim, d->rope_theta));
	OP(MLENS_LAYER_OP_ROPE, OPS->rope(CTX, k, pos, n, d->n_kv_heads, d->head_dim,
					  d->rope_theta));
	return 0;
}

int mlens_layer_attn_norm(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			  const float *x, float *xn, int n)
{
	int rc;

	OP(MLENS_LAYER_OP_NORM, layer_norm_op(r, xn, x, b->attn_norm, n));
	return 0;
}

int mlens_layer_attn_in(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			const float *x, float *xn, float *q, float *k, float *v, const int32_t *pos,
			int n)
{
	int rc = mlens_layer_attn_norm(r, b, x, xn, n);
	return rc ? rc : mlens_layer_qkv_rope(r, b, xn, q, k, v, pos, n);
}

int mlens_layer_attn_prefill(const struct mlens_layer_run *r, float *out, const float *q,
			     const float *k, const float *v, const int32_t *cu, int n_pre)
{
	const struct mlens_layer_desc *d = r->d;
	double pairs = 0;	/* causal: len (len + 1) / 2 a sequence */
	int rc;

	for (int s = 0; r->probe && s < n_pre; s++)
		pairs += (double)(cu[s + 1] - cu[s]) * (cu[s + 1] - cu[s] + 1) / 2;
	OPF(MLENS_LAYER_OP_PREFILL, attn_flops(d, pairs),
	    OPS->attn_prefill(CTX, out, q, k, v, cu, n_pre, d->n_heads, d->n_kv_heads, d->head_dim,
			      d->attn_scale));
	return 0;
}

/* Decode attention's FLOPs: each query over its context (only counted
 * for a probe). */
static double decode_flops(const struct mlens_layer_run *r, const struct mlens_attn_query *qry,
			   int n)
{
	double pairs = 0;
	for (int i = 0; r->probe && i < n; i++)
		pairs += qry[i].ctx_len;
	return attn_flops(r->d, pairs);
}

int mlens_layer_attn_decode(const struct mlens_layer_run *r, float *out, const float *q,
			    const struct mlens_kv_cache *kv, int layer,
			    const struct mlens_attn_query *qry, int n)
{
	int rc;

	OPF(MLENS_LAYER_OP_DECODE, decode_flops(r, qry, n), OPS->attn_decode(CTX, out, q, kv, layer, qry, n, r->d->n_heads,
						   r->d->attn_scale));
	return 0;
}

int mlens_layer_attn_decode_half(const struct mlens_layer_run *r, void *half, float *out,
				 const float *q, const struct mlens_kv_cache *kv, int layer,
				 const struct mlens_attn_query *qry, int n)
{
	int rc;

	OPF(MLENS_LAYER_OP_DECODE, decode_flops(r, qry, n), mlens_backend_attn_decode_half(OPS, CTX, half, r->d->dtype, out,
								 q, kv, layer, qry, n,
								 r->d->n_heads,
								 r->d->attn_scale));
	return 0;
}

int mlens_layer_attend(const struct mlens_layer_run *r, struct mlens_kv_cache *kv, int layer,
		       const struct mlens_layer_act *a, const struct mlens_layer_rows *rows)
{
	size_t qd = (size_t)mlens_layer_qdim(r->d), P = (size_t)rows->P;
	int rc;

	if ((rc = mlens_layer_kv_append(r, kv, layer, a->k, a->v, rows->slots, rows->n)))
		return rc;
	if (rows->n_pre && (rc = mlens_layer_attn_prefill(r, a->att, a->q, a->k, a->v, rows->cu,
							  rows->n_pre)))
		return rc;
	if (rows->n > rows->P)
		return mlens_layer_attn_decode(r, a->att + P * qd, a->q + P * qd, kv, layer,
					       rows->qry + P, rows->n - rows->P);
	return 0;
}

int mlens_layer_out_proj(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			 float *out, const void *att, bool att_half, int n, bool accumulate)
{
	const struct mlens_layer_desc *d = r->d;
	double f = gemm_flops(n, mlens_layer_qdim(d), d->hidden);
	int rc;

	if (att_half)
		OPF(MLENS_LAYER_OP_WO, f, OPS->gemm_half_in(CTX, out, att, b->wo, d->dtype, n,
							    mlens_layer_qdim(d), d->hidden, accumulate));
	else
		OPF(MLENS_LAYER_OP_WO, f, OPS->gemm(CTX, out, att, b->wo, d->dtype, n,
						    mlens_layer_qdim(d), d->hidden, accumulate));
	if (b->bo)
		OP(MLENS_LAYER_OP_WO, OPS->bias_add(CTX, out, b->bo, d->dtype, n, d->hidden));
	return 0;
}

/* Router logits, top-k ids and weights of the normed rows xn (nothing for
 * a dense layer). */
static int route_normed(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			const float *xn, float *rlog, int32_t *rid, float *rw, int n)
{
	const struct mlens_layer_desc *d = r->d;
	int rc;

	if (!b->router)
		return 0;
	OPF(MLENS_LAYER_OP_ROUTER, gemm_flops(n, d->hidden, d->n_experts),
	    OPS->gemm(CTX, rlog, xn, b->router, d->dtype, n, d->hidden, d->n_experts, false));
	OP(MLENS_LAYER_OP_ROUTER, OPS->router(CTX, rid, rw, rlog, n, d->n_experts, d->top_k,
					      d->router_renorm));
	return 0;
}

static int ffn_norm(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
		    const float *x, float *xn, int n)
{
	int rc;

	OP(MLENS_LAYER_OP_NORM, layer_norm_op(r, xn, x, b->ffn_norm, n));
	return 0;
}

int mlens_layer_route(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
		      const float *x, float *xn, float *rlog, int32_t *rid, float *rw, int n)
{
	int rc = ffn_norm(r, b, x, xn, n);
	return rc ? rc : route_normed(r, b, xn, rlog, rid, rw, n);
}

int mlens_layer_mlp(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
		    float *out, const float *xn, float *rlog, int32_t *rid, float *rw, int n)
{
	const struct mlens_layer_desc *d = r->d;
	int rc;

	if (!b->mlp.n_experts)
		return 0;
	/* weight 1 times the SwiGLU is the SwiGLU itself, bit for bit */
	if (b->mlp_gate)
		OPF(MLENS_LAYER_OP_ROUTER, gemm_flops(n, d->hidden, 1),
		    OPS->gemm(CTX, rlog, xn, b->mlp_gate, d->dtype, n, d->hidden, 1, false));
	OP(MLENS_LAYER_OP_ROUTER, OPS->route_one(CTX, rid, rw, b->mlp_gate ? rlog : NULL, n));
	OPF(MLENS_LAYER_OP_MOE, 3 * gemm_flops(n, d->hidden, b->mlp.inter),
	    OPS->moe(CTX, out, xn, n, rid, rw, 1, &b->mlp));
	return 0;
}

int mlens_layer_experts(const struct mlens_layer_run *r, const struct mlens_moe_weights *moe,
			float *out, const float *xn, const int32_t *rid, const float *rw, int n,
			int chunk)
{
	size_t H = (size_t)r->d->hidden, K = (size_t)r->d->top_k;
	int rc;

	if (chunk <= 0 || chunk > n)
		chunk = n;
	for (int t = 0; t < n; t += chunk) {
		int cnt = n - t < chunk ? n - t : chunk;
		/* each row through K experts: gate, up and down */
		OPF(MLENS_LAYER_OP_MOE, 3 * gemm_flops(cnt * (int)K, (int)H, moe->inter),
		    OPS->moe(CTX, out + (size_t)t * H, xn + (size_t)t * H, cnt, rid + (size_t)t * K,
			     rw + (size_t)t * K, (int)K, moe));
	}
	return 0;
}

int mlens_layer_gb(const struct mlens_layer_run *r, const struct mlens_layer_bound *b, float *x,
		   const void *att, bool att_half, float *xn, float *rlog, int32_t *rid, float *rw,
		   int n, int chunk)
{
	int rc;

	/* residual: x += att . Wo^T; then the SwiGLU beside the experts first,
	 * in the routing's scratch, so that rid and rw end as the experts' */
	if ((rc = mlens_layer_out_proj(r, b, x, att, att_half, n, true)) ||
	    (rc = ffn_norm(r, b, x, xn, n)) ||
	    (rc = mlens_layer_mlp(r, b, x, xn, rlog, rid, rw, n)) ||
	    (rc = route_normed(r, b, xn, rlog, rid, rw, n)))
		return rc;
	return b->router ? mlens_layer_experts(r, &b->moe, x, xn, rid, rw, n, chunk) : 0;
}

int mlens_layer_forward(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			struct mlens_kv_cache *kv, int layer, const struct mlens_layer_act *a,
			const struct mlens_layer_rows *rows)
{
	int rc;

	if ((rc = mlens_layer_attn_in(r, b, a->x, a->xn, a->q, a->k, a->v, rows->pos, rows->n)) ||
	    (rc = mlens_layer_attend(r, kv, layer, a, rows)))
		return rc;
	return mlens_layer_gb(r, b, a->x, a->att, false, a->xn, a->rlog, a->rid, a->rw, rows->n, 0);
}

int mlens_ends_logits(const struct mlens_layer_run *r, const struct mlens_ends_bound *e, int vocab,
		      const float *x, float *xn, float *logits, const int32_t *lrow, int nl,
		      int chunk, const struct mlens_sampling *samp, int32_t *sampled, float *logp,
		      float *host_logits)
{
	const struct mlens_layer_desc *d = r->d;
	size_t V = (size_t)vocab;
	int rc;

	if (chunk <= 0 || chunk > nl)
		chunk = nl;
	for (int i0 = 0; i0 < nl; i0 += chunk) {
		int cnt = nl - i0 < chunk ? nl - i0 : chunk;
		/* the chunk's rows gathered (embed is a row gather; x is fp32),
		 * then normed in one call rather than one call a row */
		OP(MLENS_LAYER_OP_NORM, OPS->embed(CTX, xn, x, MLENS_DTYPE_F32, d->hidden, lrow + i0,
						   cnt));
		OP(MLENS_LAYER_OP_NORM, layer_norm_op(r, xn, xn, e->final_norm, cnt));
		OPF(MLENS_LAYER_OP_LM_HEAD, gemm_flops(cnt, d->hidden, vocab),
		    OPS->gemm(CTX, logits, xn, e->lm_head, d->dtype, cnt, d->hidden, vocab, false));
		OP(MLENS_LAYER_OP_SAMPLE, OPS->sample(CTX, sampled + i0, logp + i0, logits, cnt, vocab,
						      samp + i0));
		if (host_logits && (rc = OPS->download(CTX, host_logits + (size_t)i0 * V, logits,
							  (size_t)cnt * V * sizeof(float))))
			return rc;
	}
	return 0;
}
