/* One decoder layer of a Mixture-of-Experts model, once: what a layer is
 * (struct mlens_layer_desc), its weights as a backend sees them (struct
 * mlens_layer_bound) and its forward pass through the backend ops. The
 * engine runs a layer whole (mlens_layer_forward); the hybrid pipeline runs
 * the same parts apart, GA (mlens_layer_attn_in) on the GPU, attention on
 * the CPU, GB (mlens_layer_gb) on the GPU; the profiler times GA and GB;
 * the shard simulation runs the parts with a rank's heads and slices.
 *
 * A family differs from Mixtral's in data here (the desc, the bound
 * tensors) and in small steps of these functions, never in a copy of the
 * layer: the kind of norm (attn_norm, route), a q/k norm or a clip of q,
 * k, v after their projection (qkv_rope), projection biases (bound
 * tensors), the routing rule (route) and shared experts (experts). Op
 * order, dtypes and rounding are the golden outputs' contract. */
#ifndef MLENS_LAYER_H
#define MLENS_LAYER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"
#include "kernels/backend.h"

/* The shape and constants of a layer (Mixtral: RMS norms before attention
 * and experts, GQA with rotate-half RoPE, softmax top-k routing, SwiGLU
 * experts). A shard's desc has its own head counts. */
struct mlens_layer_desc {
	enum mlens_dtype dtype;	/* the weights' */
	enum mlens_dtype expert_dtype;	/* the experts' (fp8: scales as expert_scale) */
	struct mlens_wscale expert_scale;
	int hidden;
	int n_heads, n_kv_heads, head_dim;
	int n_experts, top_k, inter;
	float norm_eps;
	float rope_theta;
	float attn_scale;	/* 1 / sqrt(head_dim) */
	/* A family's differences (zero for Mixtral: RMSNorm, no q/k norm,
	 * renormalised top-k, no clip): */
	enum mlens_norm_kind norm_kind;	/* RMSNorm or LayerNorm, every norm but q/k's */
	enum mlens_qk_norm qk_norm;	/* RMSNorm of q and k before RoPE */
	bool router_renorm;		/* top-k weights renormalised to sum 1 */
	float clip_qkv;		/* > 0: q, k, v clamped to [-clip_qkv, clip_qkv]
				 * after their projection (and q/k norm), before RoPE */
	bool w2_transposed;	/* experts' w2 stored [inter][hidden] (DBRX) */
};

void mlens_layer_desc_init(struct mlens_layer_desc *d, const struct mlens_model_config *c);

static inline int mlens_layer_qdim(const struct mlens_layer_desc *d)
{
	return d->n_heads * d->head_dim;
}

static inline int mlens_layer_kvdim(const struct mlens_layer_desc *d)
{
	return d->n_kv_heads * d->head_dim;
}

/* Bytes of one expert matrix (w1, w2 or w3). */
static inline size_t mlens_layer_expert_bytes(const struct mlens_layer_desc *d)
{
	return (size_t)d->inter * (size_t)d->hidden * mlens_dtype_size(d->expert_dtype);
}

/* Bytes of the fp32 scales of an fp8 expert matrix: w2 (down) has hidden
 * rows, w1 and w3 inter; 0 for experts that are not fp8. */
static inline size_t mlens_layer_scale_bytes(const struct mlens_layer_desc *d, bool down)
{
	if (d->expert_dtype != MLENS_DTYPE_E4M3)
		return 0;
	return mlens_wscale_count(&d->expert_scale, down ? d->hidden : d->inter,
				  down ? d->inter : d->hidden) * sizeof(float);
}

/* ==== weights as the backend sees them ==== */

struct mlens_layer_bound {
	const void *attn_norm, *wq, *wk, *wv, *wo, *ffn_norm;
	const void *router;		/* NULL: a dense layer, no routed experts */
	const void **w1, **w2, **w3;	/* [n_experts] */
	const float **s1, **s2, **s3;	/* [n_experts]: fp8 experts' scales */
	struct mlens_moe_weights moe;	/* over w1, w2, w3 (and s1, s2, s3) */
	/* family extras, NULL where absent (struct mlens_layer_weights) */
	const void *q_norm, *k_norm, *bq, *bk, *bv, *bo;
	/* the one SwiGLU beside the experts (a dense layer's MLP, a shared
	 * expert) as a one-expert MoE chosen by every row, weight 1 or
	 * sigmoid(x . mlp_gate); mlp.n_experts 0: none */
	const void *mlp_w[3], *mlp_gate;
	struct mlens_moe_weights mlp;	/* over mlp_w */
};

/* How a caller puts host weights where its backend reads them: place
 * returns the backend copy (chaining on *rc as mlens_backend_place does),
 * unplace gives it back (p may be NULL). */
struct mlens_layer_placer {
	const void *(*place)(void *arg, const void *host, size_t bytes, int *rc);
	void (*unplace)(void *arg, const void *p, size_t bytes);
	void *arg;
};

/* A placer over mlens_backend_place / mlens_backend_unplace (arg: the
 * struct mlens_backend). */
extern const struct mlens_layer_placer mlens_layer_placer_backend_ops;
static inline struct mlens_layer_placer mlens_layer_placer_backend(struct mlens_backend *be)
{
	struct mlens_layer_placer p = mlens_layer_placer_backend_ops;
	p.arg = be;
	return p;
}

/* Place w's norms, attention and router, and experts [0, experts) with
 * their scales when fp8 (the rest stay NULL for the caller to point at, a
 * streamed slot); b->moe set.
 * 0 or -errno; a half-bound b is undone by mlens_layer_unbind with the same
 * arguments. */
int mlens_layer_bind(struct mlens_layer_bound *b, const struct mlens_layer_weights *w,
		     const struct mlens_layer_desc *d, int experts,
		     const struct mlens_layer_placer *pl);
void mlens_layer_unbind(struct mlens_layer_bound *b, const struct mlens_layer_weights *w,
			const struct mlens_layer_desc *d, int experts,
			const struct mlens_layer_placer *pl);
/* Place expert x of a bound layer (its scales too when fp8), or give it
 * back (its pointers NULL again): the hybrid pipeline keeps a resident set
 * that is not experts [0, experts). */
int mlens_layer_bind_expert(struct mlens_layer_bound *b, const struct mlens_layer_weights *w,
			    const struct mlens_layer_desc *d, int x, const struct mlens_layer_placer *pl);
void mlens_layer_unbind_expert(struct mlens_layer_bound *b, const struct mlens_layer_weights *w,
			       const struct mlens_layer_desc *d, int x,
			       const struct mlens_layer_placer *pl);

/* The model's ends (embedding, final norm, lm_head; a tied lm_head is the
 * embedding's copy). */
struct mlens_ends_bound {
	const void *embed, *final_norm, *lm_head;
};

int mlens_ends_bind(struct mlens_ends_bound *b, const struct mlens_model *m,
		    const struct mlens_layer_placer *pl);
void mlens_ends_unbind(struct mlens_ends_bound *b, const struct mlens_model *m,
		       const struct mlens_layer_placer *pl);

/* ==== the forward pass ==== */

/* The ops of a layer, for a caller that times them (the engine's
 * MLENS_ENGINE_PROFILE, mlens-bench ops, the op time account of
 * daemon/exec/op_time.h). */
enum mlens_layer_op {
	MLENS_LAYER_OP_NORM,
	MLENS_LAYER_OP_QKV,
	MLENS_LAYER_OP_ROPE,
	MLENS_LAYER_OP_KV_APPEND,
	MLENS_LAYER_OP_PREFILL,
	MLENS_LAYER_OP_DECODE,
	MLENS_LAYER_OP_WO,
	MLENS_LAYER_OP_ROUTER,
	MLENS_LAYER_OP_MOE,
	MLENS_LAYER_OP_LM_HEAD,	/* of mlens_ends_logits */
	MLENS_LAYER_OP_SAMPLE,
	MLENS_LAYER_OP_EMBED,	/* the engine's token embedding */
	MLENS_LAYER_OP_N
};

/* The op's name ("qkv_gemm", "moe"): the one list that the stats, the
 * metrics and the benches name ops by; NULL past MLENS_LAYER_OP_N. */
const char *mlens_layer_op_name(enum mlens_layer_op op);

/* Called around every op when set: begin before it, end after it with
 * the op's arithmetic (FLOPs of its products: GEMMs 2 m n k, attention
 * 4 head dims a (query, key) pair; 0 for the ops that only move or scale
 * values); end's failure fails the layer. */
struct mlens_layer_probe {
	void (*begin)(void *arg);
	int (*end)(void *arg, enum mlens_layer_op op, double flops);
	void *arg;
};

/* Where a layer runs: the backend, the layer's shape, an optional probe. */
struct mlens_layer_run {
	const struct mlens_backend *be;
	const struct mlens_layer_desc *d;
	const struct mlens_layer_probe *probe;
};

/* Activations of n rows, backend memory: the residual x [n][hidden], the
 * normed rows xn, q and att [n][qdim], k and v [n][kvdim], router logits
 * [n][n_experts], weights and ids [n][top_k]. */
struct mlens_layer_act {
	float *x, *xn, *q, *k, *v, *att, *rlog, *rw;
	int32_t *rid;
};

/* The rows of one forward: n rows at positions pos (host), each K/V into
 * its slot of the cache; rows [0, P) are n_pre prefill sequences split by
 * cu (attended through attn_prefill over this call's k, v), rows [P, n)
 * read the paged cache through qry. */
struct mlens_layer_rows {
	int n, P, n_pre;
	const int32_t *pos, *cu;
	const int64_t *slots;
	const struct mlens_attn_query *qry;
};

/* x = the embedding rows of n tokens (host ids). */
int mlens_layer_embed(const struct mlens_layer_run *r, float *x, const void *table,
		      const int32_t *tok, int n);
/* Every row's K and V of one layer into its slot of the cache. */
int mlens_layer_kv_append(const struct mlens_layer_run *r, struct mlens_kv_cache *kv, int layer,
			  const float *k, const float *v, const int64_t *slots, int n);
/* xn = the attention's norm of x. */
int mlens_layer_attn_norm(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			  const float *x, float *xn, int n);
/* GA's arithmetic: mlens_layer_attn_norm, then mlens_layer_qkv_rope. */
int mlens_layer_attn_in(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			const float *x, float *xn, float *q, float *k, float *v, const int32_t *pos,
			int n);
/* q, k, v of the normed rows xn (one call for the three), RoPE on q, k. */
int mlens_layer_qkv_rope(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			 const float *xn, float *q, float *k, float *v, const int32_t *pos, int n);
/* Causal attention of n_pre prefill sequences over their own q, k, v. */
int mlens_layer_attn_prefill(const struct mlens_layer_run *r, float *out, const float *q,
			     const float *k, const float *v, const int32_t *cu, int n_pre);
/* Decode attention of n rows over the paged cache. */
int mlens_layer_attn_decode(const struct mlens_layer_run *r, float *out, const float *q,
			    const struct mlens_kv_cache *kv, int layer,
			    const struct mlens_attn_query *qry, int n);
/* The same, its output also rounded to the weights' dtype into half. */
int mlens_layer_attn_decode_half(const struct mlens_layer_run *r, void *half, float *out,
				 const float *q, const struct mlens_kv_cache *kv, int layer,
				 const struct mlens_attn_query *qry, int n);
/* The attention of one forward on one backend: every row's K/V into the
 * cache, prefill rows through attn_prefill, the others through the cache. */
int mlens_layer_attend(const struct mlens_layer_run *r, struct mlens_kv_cache *kv, int layer,
		       const struct mlens_layer_act *a, const struct mlens_layer_rows *rows);
/* out (+)= att . Wo^T; att_half: att is in the weights' dtype
 * (gemm_half_in). */
int mlens_layer_out_proj(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			 float *out, const void *att, bool att_half, int n, bool accumulate);
/* xn = norm(x), router logits, top-k ids and weights (a dense layer: the
 * norm only). */
int mlens_layer_route(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
		      const float *x, float *xn, float *rlog, int32_t *rid, float *rw, int n);
/* out += the chosen experts of the normed rows xn, chunk rows a call
 * (<= 0: all in one). */
int mlens_layer_experts(const struct mlens_layer_run *r, const struct mlens_moe_weights *moe,
			float *out, const float *xn, const int32_t *rid, const float *rw, int n,
			int chunk);
/* out += the layer's one SwiGLU of the normed rows xn (nothing when it has
 * none); rlog, rid, rw are its scratch ([n] each), overwritten. */
int mlens_layer_mlp(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
		    float *out, const float *xn, float *rlog, int32_t *rid, float *rw, int n);
/* GB's arithmetic: x += att . Wo^T, the norm, the SwiGLU beside the
 * experts, then route and experts into x (rid and rw end as the routed
 * experts' ids and weights). */
int mlens_layer_gb(const struct mlens_layer_run *r, const struct mlens_layer_bound *b, float *x,
		   const void *att, bool att_half, float *xn, float *rlog, int32_t *rid, float *rw,
		   int n, int chunk);
/* A whole layer on one backend: GA, attention, GB back to back. */
int mlens_layer_forward(const struct mlens_layer_run *r, const struct mlens_layer_bound *b,
			struct mlens_kv_cache *kv, int layer, const struct mlens_layer_act *a,
			const struct mlens_layer_rows *rows);

/* The model's head for the nl rows listed in lrow (host), chunk rows a
 * call (<= 0: all in one): a chunk's residual rows gathered from x into
 * xn, normed there, lm_head into logits [chunk][vocab], one token each
 * sampled with samp[i] into sampled[i] and logp[i] (host); with
 * host_logits, the logits copied there too ([nl][vocab]). */
int mlens_ends_logits(const struct mlens_layer_run *r, const struct mlens_ends_bound *e, int vocab,
		      const float *x, float *xn, float *logits, const int32_t *lrow, int nl,
		      int chunk, const struct mlens_sampling *samp, int32_t *sampled, float *logp,
		      float *host_logits);

#endif
