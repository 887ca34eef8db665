/* The family table (family.h): each family's config.json keys and tensor
 * names. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/errf.h"
#include "daemon/model/family.h"

/* ==== config keys shared by several families ==== */

/* A boolean field; absent or null takes def. */
static int get_bool(const struct mlens_cfg_ctx *c, json_t *root, const char *key, bool def,
		    bool *out)
{
	json_t *v = json_object_get(root, key);

	if (!v || json_is_null(v)) {
		*out = def;
		return 0;
	}
	if (!json_is_boolean(v)) {
		mlens_errf(c->err, c->errlen, "%s: '%s' must be true or false", c->path, key);
		return -EINVAL;
	}
	*out = json_is_true(v);
	return 0;
}

/* A key whose only value mlens implements is null (or absent). */
static int need_null(const struct mlens_cfg_ctx *c, json_t *root, const char *key,
		     const char *what)
{
	json_t *v = json_object_get(root, key);
	char *s;

	if (!v || json_is_null(v))
		return 0;
	s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
	mlens_errf(c->err, c->errlen, "%s: '%s' is %.120s; mlens implements only %s (set it to null)",
		   c->path, key, s ? s : "(unprintable)", what);
	free(s);
	return -ENOTSUP;
}

/* A boolean feature mlens does not implement: absent, null or false. */
static int need_false(const struct mlens_cfg_ctx *c, json_t *root, const char *key,
		      const char *what)
{
	bool on;
	int rc = get_bool(c, root, key, false, &on);

	if (rc || !on)
		return rc;
	mlens_errf(c->err, c->errlen, "%s: '%s' is true; mlens has no %s (set it to false)", c->path,
		   key, what);
	return -ENOTSUP;
}

/* Routed experts under Qwen's and OLMoE's names: num_experts experts
 * (transformers 5 writes Qwen3-MoE's as num_local_experts) of inter_key's
 * width, num_experts_per_tok of them a token. */
static int parse_experts(const struct mlens_cfg_ctx *c, json_t *root, const char *inter_key,
			 struct mlens_model_config *cfg)
{
	const char *ne = json_object_get(root, "num_experts") ? "num_experts" : "num_local_experts";
	bool renorm;
	int rc;

	if ((rc = mlens_cfg_int(c, root, ne, true, 0, 1, 256, &cfg->num_local_experts)) ||
	    (rc = mlens_cfg_int(c, root, "num_experts_per_tok", true, 0, 1, cfg->num_local_experts,
				&cfg->num_experts_per_tok)) ||
	    (rc = mlens_cfg_int(c, root, inter_key, true, 0, 1, 1 << 20, &cfg->intermediate_size)) ||
	    (rc = get_bool(c, root, "norm_topk_prob", false, &renorm)))
		return rc;
	cfg->topk_raw = !renorm;
	return need_null(c, root, "rope_scaling", "the default RoPE");
}

/* layer_types (transformers 5) may only name full attention. */
static int need_full_attention(const struct mlens_cfg_ctx *c, json_t *root)
{
	json_t *v = json_object_get(root, "layer_types"), *e;
	size_t i;

	if (!v || json_is_null(v))
		return 0;
	if (!json_is_array(v)) {
		mlens_errf(c->err, c->errlen, "%s: 'layer_types' must be a list", c->path);
		return -EINVAL;
	}
	json_array_foreach(v, i, e) {
		if (!json_is_string(e) || strcmp(json_string_value(e), "full_attention")) {
			mlens_errf(c->err, c->errlen, "%s: 'layer_types' entry %zu is %.40s; mlens implements only \"full_attention\"",
				   c->path, i, json_is_string(e) ? json_string_value(e) : "not a string");
			return -ENOTSUP;
		}
	}
	return 0;
}

/* Qwen's dense MLP layers: layer i is dense when listed in mlp_only_layers
 * or when (i + 1) is not a multiple of decoder_sparse_step; a dense layer's
 * SwiGLU is intermediate_size wide. */
static int parse_dense_layers(const struct mlens_cfg_ctx *c, json_t *root,
			      struct mlens_model_config *cfg)
{
	json_t *v = json_object_get(root, "mlp_only_layers"), *e;
	int64_t step, L = cfg->num_hidden_layers;
	bool any = false;
	size_t i;
	int rc;

	if ((rc = mlens_cfg_int(c, root, "decoder_sparse_step", false, 1, 1, L, &step)))
		return rc;
	for (int64_t l = 0; l < L; l++)
		cfg->dense[l] = (l + 1) % step != 0;
	if (v && !json_is_null(v)) {
		if (!json_is_array(v)) {
			mlens_errf(c->err, c->errlen, "%s: 'mlp_only_layers' must be a list of layer indexes",
				   c->path);
			return -EINVAL;
		}
		json_array_foreach(v, i, e) {
			if (!json_is_integer(e) || json_integer_value(e) < 0 ||
			    json_integer_value(e) >= L) {
				mlens_errf(c->err, c->errlen, "%s: 'mlp_only_layers' entry %zu is not a layer index in [0, %" PRId64 ")",
					   c->path, i, L);
				return -EINVAL;
			}
			cfg->dense[json_integer_value(e)] = true;
		}
	}
	for (int64_t l = 0; l < L; l++)
		any |= cfg->dense[l];
	if (any)
		return mlens_cfg_int(c, root, "intermediate_size", true, 0, 1, 1 << 20,
				     &cfg->dense_inter);
	return 0;
}

/* ==== the families ==== */

static int parse_mixtral(const struct mlens_cfg_ctx *c, json_t *root,
			 struct mlens_model_config *cfg)
{
	json_t *v = json_object_get(root, "sliding_window");
	int64_t sw;
	int rc;

	if ((rc = mlens_cfg_int(c, root, "intermediate_size", true, 0, 1, 1 << 20,
				&cfg->intermediate_size)) ||
	    (rc = mlens_cfg_int(c, root, "num_local_experts", true, 0, 1, 256,
				&cfg->num_local_experts)) ||
	    (rc = mlens_cfg_int(c, root, "num_experts_per_tok", true, 0, 1, cfg->num_local_experts,
				&cfg->num_experts_per_tok)))
		return rc;
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_integer(v)) {
		mlens_errf(c->err, c->errlen, "%s: 'sliding_window' must be an integer or null", c->path);
		return -EINVAL;
	}
	sw = json_integer_value(v);
	if (sw < cfg->max_position_embeddings) {
		mlens_errf(c->err, c->errlen, "%s: sliding_window is %" PRId64 " but max_position_embeddings is %" PRId64 "; mlens has no sliding-window attention (set sliding_window to null)",
			   c->path, sw, cfg->max_position_embeddings);
		return -ENOTSUP;
	}
	return 0;
}

/* Qwen3-MoE: per-head q/k RMSNorm, optional attention biases. */
static int parse_qwen3_moe(const struct mlens_cfg_ctx *c, json_t *root,
			   struct mlens_model_config *cfg)
{
	bool bias;
	int rc;

	if ((rc = parse_experts(c, root, "moe_intermediate_size", cfg)) ||
	    (rc = parse_dense_layers(c, root, cfg)) ||
	    (rc = need_false(c, root, "use_sliding_window", "sliding-window attention")) ||
	    (rc = need_full_attention(c, root)) ||
	    (rc = get_bool(c, root, "attention_bias", false, &bias)))
		return rc;
	cfg->qk_norm = MLENS_QK_NORM_HEAD;
	cfg->qkv_bias = cfg->o_bias = bias;
	return 0;
}

/* Qwen2-MoE (Qwen1.5-MoE): q/k/v biases (qkv_bias, default true), a shared expert with a sigmoid
 * gate. */
static int parse_qwen2_moe(const struct mlens_cfg_ctx *c, json_t *root,
			   struct mlens_model_config *cfg)
{
	int rc;

	if ((rc = parse_experts(c, root, "moe_intermediate_size", cfg)) ||
	    (rc = parse_dense_layers(c, root, cfg)) ||
	    (rc = need_false(c, root, "use_sliding_window", "sliding-window attention")) ||
	    (rc = need_full_attention(c, root)) ||
	    (rc = mlens_cfg_int(c, root, "shared_expert_intermediate_size", true, 0, 1, 1 << 20,
				&cfg->shared_inter)) ||
	    (rc = get_bool(c, root, "qkv_bias", true, &cfg->qkv_bias)))
		return rc;
	cfg->shared_gate = true;
	return 0;
}

/* OLMoE: q/k RMSNorm over the whole projection, optional biases and clip. */
static int parse_olmoe(const struct mlens_cfg_ctx *c, json_t *root,
		       struct mlens_model_config *cfg)
{
	bool bias;
	int rc;

	if ((rc = parse_experts(c, root, "intermediate_size", cfg)) ||
	    (rc = get_bool(c, root, "attention_bias", false, &bias)) ||
	    (rc = mlens_cfg_real(c, root, "clip_qkv", 0.0, 0.0, 1e30, &cfg->clip_qkv)))
		return rc;
	cfg->qk_norm = MLENS_QK_NORM_ALL;
	cfg->qkv_bias = cfg->o_bias = bias;
	return 0;
}

#define HF_NAMES false, "model.embed_tokens.weight", "model.norm.weight", NULL
#define QWEN_EXPERTS "mlp.gate.weight", "mlp.experts", { "gate_proj", "down_proj", "up_proj" }

static const struct mlens_family families[] = {
	{ "MixtralForCausalLM", "tiny", parse_mixtral, HF_NAMES, "block_sparse_moe.gate.weight",
	  "block_sparse_moe.experts", { "w1", "w2", "w3" } },
	{ "Qwen3MoeForCausalLM", "qwen3-tiny", parse_qwen3_moe, HF_NAMES, QWEN_EXPERTS },
	{ "Qwen2MoeForCausalLM", "qwen2-tiny", parse_qwen2_moe, HF_NAMES, QWEN_EXPERTS },
	{ "OlmoeForCausalLM", "olmoe-tiny", parse_olmoe, HF_NAMES, QWEN_EXPERTS },
	{ "DbrxForCausalLM", "dbrx-tiny", mlens_family_dbrx_parse_config, true,
	  "transformer.wte.weight", "transformer.norm_f.weight", mlens_family_dbrx_bind_layer,
	  NULL, NULL, { NULL, NULL, NULL } },
};

const struct mlens_family *mlens_family_find(const char *architecture)
{
	for (size_t i = 0; i < sizeof(families) / sizeof(families[0]); i++)
		if (!strcmp(families[i].architecture, architecture))
			return &families[i];
	return NULL;
}

const struct mlens_family *mlens_family_at(int i)
{
	if (i < 0 || (size_t)i >= sizeof(families) / sizeof(families[0]))
		return NULL;
	return &families[i];
}
