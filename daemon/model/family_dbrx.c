/* DBRX (DbrxForCausalLM): its nested config.json (attn_config, ffn_config)
 * into the model config, and its tensors (transformer.*) into the layers:
 * Wqkv as three row views of the fused tensor, the experts' fused w1, v1,
 * w2 as per-expert views, w2 read in its stored [ffn][d_model] layout. The
 * layer itself is the one every family shares (daemon/exec/layer.c). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/errf.h"
#include "daemon/model/model_int.h"

/* ==== config.json ==== */

/* A sub-object (attn_config, ffn_config): absent or null reads as {} (the
 * defaults transformers takes), anything else but an object is refused. */
static int sub_object(const struct mlens_cfg_ctx *c, json_t *root, const char *key, json_t **out)
{
	json_t *v = json_object_get(root, key);

	if (!v || json_is_null(v)) {
		*out = NULL;
		return 0;
	}
	if (!json_is_object(v)) {
		mlens_errf(c->err, c->errlen, "%s: '%s' must be an object", c->path, key);
		return -EINVAL;
	}
	*out = v;
	return 0;
}

/* ffn_config.ffn_act_fn: absent, null or {"name": "silu"}. */
static int check_act(const struct mlens_cfg_ctx *c, json_t *ffn)
{
	json_t *a = ffn ? json_object_get(ffn, "ffn_act_fn") : NULL, *n;
	char *text;

	if (!a || json_is_null(a))
		return 0;
	n = json_is_object(a) ? json_object_get(a, "name") : NULL;
	if (json_is_string(n) && !strcmp(json_string_value(n), "silu") && json_object_size(a) == 1)
		return 0;
	text = json_dumps(a, JSON_COMPACT | JSON_ENCODE_ANY);
	mlens_errf(c->err, c->errlen, "%s: ffn_config.ffn_act_fn is %.80s; mlens implements only {\"name\": \"silu\"}",
		   c->path, text ? text : "(unprintable)");
	free(text);
	return -ENOTSUP;
}

/* ffn_config.moe_normalize_expert_weights: the p of the p-norm the top-k
 * weights are divided by. 1 (DBRX's) is the renormalisation the router op
 * does; null or another p is refused with the value named. */
static int check_normalize(const struct mlens_cfg_ctx *c, json_t *ffn)
{
	json_t *v = ffn ? json_object_get(ffn, "moe_normalize_expert_weights") : NULL;

	if (!v)
		return 0;	/* transformers' default, 1 */
	if (json_is_number(v) && json_number_value(v) == 1.0)
		return 0;
	if (json_is_null(v))
		mlens_errf(c->err, c->errlen, "%s: ffn_config.moe_normalize_expert_weights is null; mlens implements only 1 (the top-k weights divided by their sum)",
			   c->path);
	else if (json_is_number(v))
		mlens_errf(c->err, c->errlen, "%s: ffn_config.moe_normalize_expert_weights is %g; mlens implements only 1 (the top-k weights divided by their sum)",
			   c->path, json_number_value(v));
	else
		mlens_errf(c->err, c->errlen, "%s: ffn_config.moe_normalize_expert_weights must be a number",
			   c->path);
	return json_is_null(v) || json_is_number(v) ? -ENOTSUP : -EINVAL;
}

/* attn_config.clip_qkv: absent or null (no clip), or a positive number. */
static int parse_clip(const struct mlens_cfg_ctx *c, json_t *attn, double *out)
{
	json_t *v = attn ? json_object_get(attn, "clip_qkv") : NULL;

	*out = 0;
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_number(v) || !isfinite(json_number_value(v)) || !(json_number_value(v) > 0)) {
		mlens_errf(c->err, c->errlen, "%s: attn_config.clip_qkv must be null or a number above 0",
			   c->path);
		return -EINVAL;
	}
	*out = json_number_value(v);
	return 0;
}

int mlens_family_dbrx_parse_config(const struct mlens_cfg_ctx *c, json_t *root,
				   struct mlens_model_config *cfg)
{
	char apath[600], fpath[600];
	struct mlens_cfg_ctx ac = *c, fc = *c;
	json_t *attn, *ffn, *v;
	int64_t fh;
	int rc;

	/* messages about a sub-object's key name it: "config.json: attn_config: ..." */
	snprintf(apath, sizeof(apath), "%s: attn_config", c->path);
	snprintf(fpath, sizeof(fpath), "%s: ffn_config", c->path);
	ac.path = apath;
	fc.path = fpath;
	if ((rc = sub_object(c, root, "attn_config", &attn)) ||
	    (rc = sub_object(c, root, "ffn_config", &ffn)))
		return rc;
	if (json_object_get(root, "quantization_config")) {
		mlens_errf(c->err, c->errlen, "%s: quantization_config is set; mlens reads unquantized bf16, fp16 or fp32 weights",
			   c->path);
		return -ENOTSUP;
	}
	/* bounds as for Mixtral's keys: every product of dimensions stays far
	 * inside int64_t */
	if ((rc = mlens_cfg_int(c, root, "vocab_size", true, 0, 1, 1 << 24, &cfg->vocab_size)) ||
	    (rc = mlens_cfg_int(c, root, "d_model", true, 0, 1, 1 << 16, &cfg->hidden_size)) ||
	    (rc = mlens_cfg_int(c, root, "n_layers", true, 0, 1, 1024, &cfg->num_hidden_layers)) ||
	    (rc = mlens_cfg_int(c, root, "n_heads", true, 0, 1, 1024, &cfg->num_attention_heads)) ||
	    (rc = mlens_cfg_int(c, root, "max_seq_len", false, 2048, 2, 1 << 24,
				&cfg->max_position_embeddings)) ||
	    (rc = mlens_cfg_int(&ac, attn, "kv_n_heads", false, 1, 1, cfg->num_attention_heads,
				&cfg->num_key_value_heads)) ||
	    (rc = mlens_cfg_int(&fc, ffn, "ffn_hidden_size", false, 3584, 1, 1 << 20,
				&cfg->intermediate_size)) ||
	    (rc = mlens_cfg_int(&fc, ffn, "moe_num_experts", false, 4, 1, 256,
				&cfg->num_local_experts)) ||
	    (rc = mlens_cfg_int(&fc, ffn, "moe_top_k", false, 1, 1, cfg->num_local_experts,
				&cfg->num_experts_per_tok)) ||
	    (rc = mlens_cfg_int(&fc, ffn, "hidden_size", false, cfg->hidden_size, cfg->hidden_size,
				cfg->hidden_size, &fh)) ||
	    (rc = check_act(c, ffn)) || (rc = check_normalize(c, ffn)) ||
	    (rc = parse_clip(c, attn, &cfg->clip_qkv)))
		return rc;
	if (cfg->num_attention_heads % cfg->num_key_value_heads) {
		mlens_errf(c->err, c->errlen, "%s: n_heads %" PRId64 " is not a multiple of attn_config.kv_n_heads %" PRId64,
			   c->path, cfg->num_attention_heads, cfg->num_key_value_heads);
		return -EINVAL;
	}
	if (cfg->hidden_size % cfg->num_attention_heads ||
	    (cfg->hidden_size / cfg->num_attention_heads) % 2) {
		mlens_errf(c->err, c->errlen, "%s: d_model %" PRId64 " over n_heads %" PRId64 " is not an even head dimension; RoPE rotates pairs of dimensions",
			   c->path, cfg->hidden_size, cfg->num_attention_heads);
		return -EINVAL;
	}
	cfg->head_dim = cfg->hidden_size / cfg->num_attention_heads;
	/* rope_theta: attn_config's (DBRX's own files, 10000 by default),
	 * over which transformers 5's top-level rope_parameters win */
	if ((rc = mlens_cfg_real(&ac, attn, "rope_theta", 1e4, 0.0, 1e30, &cfg->rope_theta)) ||
	    (rc = mlens_cfg_rope(c, root, cfg->rope_theta, cfg)) ||
	    (rc = mlens_cfg_dtype_eos(c, root, cfg)))
		return rc;
	v = json_object_get(root, "tie_word_embeddings");
	if (v && !json_is_boolean(v)) {
		mlens_errf(c->err, c->errlen, "%s: 'tie_word_embeddings' must be true or false", c->path);
		return -EINVAL;
	}
	cfg->tie_word_embeddings = json_is_true(v);
	/* nn.LayerNorm(d_model, bias=False): its default eps. moe_jitter_eps
	 * only acts in training. */
	cfg->rms_norm_eps = 1e-5;
	cfg->norm_kind = MLENS_NORM_LAYER;
	cfg->w2_transposed = true;
	return 0;
}

/* ==== tensors ==== */

/* rows [r0, r0 + rows) of the 2-D tensor t as a tensor of its own. */
static void row_view(struct mlens_tensor *v, const struct mlens_tensor *t, int64_t r0,
		     int64_t rows)
{
	size_t row_bytes = (size_t)t->shape[1] * mlens_dtype_size(t->dtype);

	*v = *t;
	v->shape[0] = rows;
	v->nbytes = (size_t)rows * row_bytes;
	v->offset = t->offset + (uint64_t)r0 * row_bytes;
	v->data = (const char *)t->data + (size_t)r0 * row_bytes;
}

void mlens_family_dbrx_bind_layer(struct mlens_binder *b, int64_t i)
{
	struct mlens_model *m = b->m;
	const struct mlens_model_config *c = &m->cfg;
	const int64_t H = c->hidden_size, I = c->intermediate_size, E = c->num_local_experts;
	const int64_t Q = c->num_attention_heads * c->head_dim;
	const int64_t KV = c->num_key_value_heads * c->head_dim;
	const size_t es = mlens_dtype_size(c->dtype);
	struct mlens_layer_weights *l = &m->layers[i];
	const struct mlens_tensor *qkv, *w1, *v1, *w2;
	char n[160];

#define T(fmt) (snprintf(n, sizeof(n), "transformer.blocks.%" PRId64 "." fmt, i), n)
	l->attn_norm = mlens_binder_need(b, T("norm_attn_norm.norm_1.weight"), 1, H, 0, 0);
	qkv = mlens_binder_need(b, T("norm_attn_norm.attn.Wqkv.weight"), 2, Q + 2 * KV, H, 0);
	l->wo = mlens_binder_need(b, T("norm_attn_norm.attn.out_proj.weight"), 2, H, Q, 0);
	l->ffn_norm = mlens_binder_need(b, T("norm_attn_norm.norm_2.weight"), 1, H, 0, 0);
	l->router = mlens_binder_need(b, T("ffn.router.layer.weight"), 2, E, H, 0);
	/* fused over experts: expert j is rows [j*I, (j+1)*I); w2's block is
	 * [I][H] as stored (w2_transposed) */
	w1 = mlens_binder_need(b, T("ffn.experts.mlp.w1"), 2, E * I, H, 0);
	v1 = mlens_binder_need(b, T("ffn.experts.mlp.v1"), 2, E * I, H, 0);
	w2 = mlens_binder_need(b, T("ffn.experts.mlp.w2"), 2, E * I, H, 0);
#undef T
	if (qkv) {
		/* q, k, v rows one after another: views, no copy */
		struct mlens_tensor *v = &m->views[3 * i];
		row_view(&v[0], qkv, 0, Q);
		row_view(&v[1], qkv, Q, KV);
		row_view(&v[2], qkv, Q + KV, KV);
		l->wq = &v[0];
		l->wk = &v[1];
		l->wv = &v[2];
	}
	for (int64_t j = 0; w1 && v1 && w2 && j < E; j++) {
		size_t off = (size_t)(j * I * H) * es;
		l->w1[j] = (const char *)w1->data + off;
		l->w3[j] = (const char *)v1->data + off;
		l->w2[j] = (const char *)w2->data + off;
	}
}
