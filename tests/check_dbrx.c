/* Description: DBRX (DbrxForCausalLM) and Mixtral-8x22B. DBRX's nested
 * config into the model config and its refusals (each naming the key and
 * the value), mlens-mkmodel's DBRX layout opened back (Wqkv bound as three
 * views of the fused tensor, the fused experts as per-expert views), the
 * loader's messages for DBRX's bad files, the ops DBRX adds (layernorm,
 * clamp, the experts' w2 read as stored) against plain references, and a
 * tiny model of Mixtral-8x22B's ratios planned and run by the hybrid
 * pipeline against the engine. */
#include <check.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <jansson.h>

#include "daemon/exec/layer.h"
#include "daemon/plan/gpu_plan.h"
#include "daemon/model/model.h"
#include "daemon/model/weights.h"
#include "daemon/plan/perfmodel.h"
#include "daemon/tools/mkmodel.h"
#include "kernels/backend.h"
#include "tests/check_common.h"
#include "tests/golden/golden.h"
#include "tests/model_files.h"

static struct mlens_mkmodel_opts dbrx_tiny(const char *dir, enum mlens_dtype dt)
{
	struct mlens_mkmodel_opts o = { .dir = dir, .seed = 7 };

	ck_assert_int_eq(mlens_mkmodel_preset(&o, "dbrx-tiny"), 0);
	o.cfg.dtype = dt;
	return o;
}

/* ==== config.json ==== */

/* DBRX's own config.json (as its published files have it), with key of
 * sub ("attn_config", "ffn_config" or "" for the top) set to the JSON text
 * value when key is given. */
static int parse_dbrx(const char *sub_obj, const char *key, const char *value,
		      struct mlens_model_config *c)
{
	static const char base[] =
		"{\"architectures\": [\"DbrxForCausalLM\"],"
		"\"attn_config\": {\"clip_qkv\": 8, \"kv_n_heads\": 8, \"rope_theta\": 500000},"
		"\"ffn_config\": {\"ffn_act_fn\": {\"name\": \"silu\"}, \"ffn_hidden_size\": 10752,"
		" \"moe_jitter_eps\": 0.01, \"moe_loss_weight\": 0.05, \"moe_num_experts\": 16,"
		" \"moe_top_k\": 4, \"moe_normalize_expert_weights\": 1},"
		"\"d_model\": 6144, \"n_heads\": 48, \"n_layers\": 40, \"max_seq_len\": 32768,"
		"\"vocab_size\": 100352, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\"}";
	json_t *root = json_loads(base, 0, NULL), *obj;
	char *text;
	int rc;

	ck_assert_ptr_nonnull(root);
	if (key) {
		obj = *sub_obj ? json_object_get(root, sub_obj) : root;
		ck_assert_ptr_nonnull(obj);
		ck_assert_int_eq(json_object_set_new(obj, key, json_loads(value, JSON_DECODE_ANY, NULL)), 0);
	}
	text = json_dumps(root, 0);
	rc = mlens_model_parse_config(text, strlen(text), "t/config.json", c, err, sizeof(err));
	free(text);
	json_decref(root);
	return rc;
}

START_TEST(config_dbrx)
{
	struct mlens_model_config c;

	ck_assert_msg(parse_dbrx("", NULL, NULL, &c) == 0, "%s", err);
	ck_assert_str_eq(c.architecture, "DbrxForCausalLM");
	ck_assert_int_eq(c.hidden_size, 6144);
	ck_assert_int_eq(c.num_attention_heads, 48);
	ck_assert_int_eq(c.num_key_value_heads, 8);
	ck_assert_int_eq(c.head_dim, 128);
	ck_assert_int_eq(c.num_hidden_layers, 40);
	ck_assert_int_eq(c.intermediate_size, 10752);
	ck_assert_int_eq(c.num_local_experts, 16);
	ck_assert_int_eq(c.num_experts_per_tok, 4);
	ck_assert_int_eq(c.vocab_size, 100352);
	ck_assert_int_eq(c.max_position_embeddings, 32768);
	ck_assert_double_eq(c.rope_theta, 5e5);
	ck_assert_double_eq(c.clip_qkv, 8);
	ck_assert_int_eq(c.norm_kind, MLENS_NORM_LAYER);
	ck_assert(c.w2_transposed);
	ck_assert_double_eq(c.rms_norm_eps, 1e-5);
	ck_assert_int_eq(c.dtype, MLENS_DTYPE_BF16);
	/* transformers 5 writes rope_parameters at the top: they win */
	ck_assert_msg(parse_dbrx("", "rope_parameters", "{\"rope_type\": \"default\", \"rope_theta\": 1234.0}",
				 &c) == 0, "%s", err);
	ck_assert_double_eq(c.rope_theta, 1234);
	/* clip_qkv null: no clip */
	ck_assert_msg(parse_dbrx("attn_config", "clip_qkv", "null", &c) == 0, "%s", err);
	ck_assert_double_eq(c.clip_qkv, 0);
	/* moe_jitter_eps only acts in training */
	ck_assert_msg(parse_dbrx("ffn_config", "moe_jitter_eps", "0.5", &c) == 0, "%s", err);
}
END_TEST

/* What mlens does not implement is refused naming the key and the value. */
START_TEST(config_dbrx_refusals)
{
	static const struct {
		const char *sub, *key, *value;
		int rc;
		const char *want;
	} bad[] = {
		{ "ffn_config", "moe_normalize_expert_weights", "2", -ENOTSUP,
		  "ffn_config.moe_normalize_expert_weights is 2; mlens implements only 1" },
		{ "ffn_config", "moe_normalize_expert_weights", "null", -ENOTSUP,
		  "ffn_config.moe_normalize_expert_weights is null; mlens implements only 1" },
		{ "ffn_config", "ffn_act_fn", "{\"name\": \"gelu\"}", -ENOTSUP,
		  "ffn_config.ffn_act_fn is {\"name\":\"gelu\"}; mlens implements only {\"name\": \"silu\"}" },
		{ "attn_config", "clip_qkv", "-1", -EINVAL,
		  "attn_config.clip_qkv must be null or a number above 0" },
		{ "attn_config", "kv_n_heads", "5", -EINVAL,
		  "n_heads 48 is not a multiple of attn_config.kv_n_heads 5" },
		{ "attn_config", "kv_n_heads", "64", -EINVAL,
		  "t/config.json: attn_config: 'kv_n_heads' is 64; mlens accepts 1 to 48" },
		{ "ffn_config", "moe_top_k", "17", -EINVAL,
		  "t/config.json: ffn_config: 'moe_top_k' is 17; mlens accepts 1 to 16" },
		{ "ffn_config", "hidden_size", "4096", -EINVAL,
		  "ffn_config: 'hidden_size' is 4096; mlens accepts 6144 to 6144" },
		{ "", "rope_scaling", "{\"type\": \"linear\", \"factor\": 2}", -ENOTSUP,
		  "'rope_scaling' is {\"type\":\"linear\",\"factor\":2}; mlens implements only the default RoPE" },
		{ "", "quantization_config", "{}", -ENOTSUP, "quantization_config is set" },
		{ "", "n_heads", "40", -EINVAL,
		  "d_model 6144 over n_heads 40 is not an even head dimension" },
		{ "", "attn_config", "[]", -EINVAL, "'attn_config' must be an object" },
	};
	struct mlens_model_config c;

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ck_assert_int_eq(parse_dbrx(bad[i].sub, bad[i].key, bad[i].value, &c), bad[i].rc);
		assert_err("t/config.json", bad[i].want);
	}
}
END_TEST

START_TEST(config_unknown_architecture)
{
	const char *j = "{\"architectures\": [\"GPT2LMHeadModel\"]}";
	struct mlens_model_config c;

	ck_assert_int_eq(mlens_model_parse_config(j, strlen(j), "t/config.json", &c, err,
						  sizeof(err)), -ENOTSUP);
	assert_err("t/config.json: architectures is [\"GPT2LMHeadModel\"]; mlens serves only MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM, DbrxForCausalLM");
}
END_TEST

/* ==== files ==== */

START_TEST(mkmodel_dbrx_roundtrip)
{
	struct mlens_mkmodel_opts o = dbrx_tiny(sub("m"), MLENS_DTYPE_BF16);
	const int64_t H = 64, I = 96, E = 8, Q = 64, KV = 32;
	struct mlens_model *m = NULL;
	const struct mlens_tensor *qkv, *w2;

	make(&o);
	ck_assert_msg(mlens_model_open(o.dir, &m, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(m->cfg.norm_kind, MLENS_NORM_LAYER);
	ck_assert_double_eq(m->cfg.clip_qkv, 8);
	qkv = mlens_model_tensor(m, "transformer.blocks.1.norm_attn_norm.attn.Wqkv.weight");
	w2 = mlens_model_tensor(m, "transformer.blocks.1.ffn.experts.mlp.w2");
	ck_assert_ptr_nonnull(qkv);
	ck_assert_ptr_nonnull(w2);
	/* views into the fused tensor, rows q, then k, then v: no copy */
	ck_assert_ptr_eq(m->layers[1].wq->data, qkv->data);
	ck_assert_ptr_eq(m->layers[1].wk->data, (const char *)qkv->data + Q * H * 2);
	ck_assert_ptr_eq(m->layers[1].wv->data, (const char *)qkv->data + (Q + KV) * H * 2);
	ck_assert_int_eq(m->layers[1].wk->shape[0], KV);
	ck_assert_uint_eq(m->layers[1].wv->nbytes, (size_t)(KV * H * 2));
	ck_assert_uint_eq(m->layers[1].wv->offset, qkv->offset + (uint64_t)((Q + KV) * H * 2));
	/* expert j of the fused w2 at rows [j*I, (j+1)*I), as stored */
	for (int64_t j = 0; j < E; j++)
		ck_assert_ptr_eq(m->layers[1].w2[j], (const char *)w2->data + j * I * H * 2);
	ck_assert_ptr_eq(m->lm_head, mlens_model_tensor(m, "lm_head.weight"));
	ck_assert_ptr_eq(m->final_norm, mlens_model_tensor(m, "transformer.norm_f.weight"));
	/* norms draw around 1, as Mixtral's */
	ck_assert_float_eq_tol(mlens_bf16_to_f32(((const uint16_t *)m->layers[0].attn_norm->data)[3]),
			       mlens_mkmodel_value(7, "transformer.blocks.0.norm_attn_norm.norm_1.weight", 3),
			       1e-2);
	ck_assert_float_gt(mlens_mkmodel_value(7, "transformer.blocks.0.norm_attn_norm.norm_1.weight", 3), 0.9);
	ck_assert_float_gt(mlens_mkmodel_value(7, "transformer.norm_f.weight", 0), 0.9);
	/* into the weight pages, the views move with the fused tensor */
	{
		struct mlens_weights_opts wo = { .node = -1, .movers = 1 };
		struct mlens_weights wp = { 0 };
		ck_assert_msg(mlens_weights_load(m, &wo, &wp, err, sizeof(err)) == 0, "%s", err);
		ck_assert_ptr_ne(qkv->data, m->files[qkv->file].map);
		ck_assert_ptr_eq(m->layers[1].wq->data, qkv->data);
		ck_assert_ptr_eq(m->layers[1].wv->data, (const char *)qkv->data + (Q + KV) * H * 2);
		ck_assert_ptr_eq(m->layers[1].w2[E - 1], (const char *)w2->data + (E - 1) * I * H * 2);
		ck_assert_mem_eq(m->layers[1].wk->data, (const char *)m->files[qkv->file].map +
				 m->layers[1].wk->offset, m->layers[1].wk->nbytes);
		mlens_weights_free(&wp);
	}
	mlens_model_close(m);
}
END_TEST

START_TEST(file_dbrx_missing_fused_expert)
{
	struct mlens_mkmodel_opts o = dbrx_tiny(sub("m"), MLENS_DTYPE_BF16);

	make(&o);
	edit(sub("m/model.safetensors"), "transformer.blocks.1.ffn.experts.mlp.v1",
	     "transformer.blocks.1.ffn.experts.mlp.u1");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("/m: tensor 'transformer.blocks.1.ffn.experts.mlp.v1' is missing (1 expected tensor is missing");
}
END_TEST

START_TEST(file_dbrx_wrong_fused_shape)
{
	struct mlens_mkmodel_opts o = dbrx_tiny(sub("m"), MLENS_DTYPE_BF16);

	make(&o);
	edit(sub("m/config.json"), "\"ffn_hidden_size\": 96", "\"ffn_hidden_size\": 80");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model.safetensors: tensor 'transformer.blocks.0.ffn.experts.mlp.",
		   "': shape [768, 64] does not match config.json, which implies [640, 64]");
}
END_TEST

START_TEST(file_dbrx_wqkv_rows)
{
	struct mlens_mkmodel_opts o = dbrx_tiny(sub("m"), MLENS_DTYPE_BF16);

	make(&o);
	edit(sub("m/config.json"), "\"kv_n_heads\": 2", "\"kv_n_heads\": 1");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model.safetensors: tensor 'transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight': shape [128, 64] does not match config.json, which implies [96, 64]");
}
END_TEST

START_TEST(file_dbrx_mixtral_names)
{
	struct mlens_mkmodel_opts o = dbrx_tiny(sub("m"), MLENS_DTYPE_BF16);

	/* a Mixtral's tensors under a DBRX config.json */
	ck_assert_int_eq(mlens_mkmodel_preset(&o, "tiny"), 0);
	make(&o);
	edit(sub("m/config.json"), "\"MixtralForCausalLM\"", "\"DbrxForCausalLM\"");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("'d_model' is missing");
}
END_TEST

/* The presets: DBRX's and 8x22B's shapes, usable with --layers (any
 * dimension set after the preset). */
START_TEST(presets)
{
	struct mlens_mkmodel_opts o = { .dir = sub("m"), .seed = 1 };
	struct mlens_model *m = NULL;

	ck_assert_int_eq(mlens_mkmodel_preset(&o, "dbrx"), 0);
	ck_assert_int_eq(o.cfg.hidden_size, 6144);
	ck_assert_int_eq(o.cfg.num_attention_heads, 48);
	ck_assert_int_eq(o.cfg.num_key_value_heads, 8);
	ck_assert_int_eq(o.cfg.num_local_experts, 16);
	ck_assert_int_eq(o.cfg.num_experts_per_tok, 4);
	ck_assert_int_eq(o.cfg.intermediate_size, 10752);
	ck_assert_int_eq(o.cfg.num_hidden_layers, 40);
	ck_assert_int_eq(o.cfg.vocab_size, 100352);
	ck_assert_double_eq(o.cfg.clip_qkv, 8);
	ck_assert_double_eq(o.cfg.rope_theta, 5e5);
	ck_assert_int_eq(mlens_mkmodel_preset(&o, "mixtral-8x22b"), 0);
	ck_assert_int_eq(o.cfg.hidden_size, 6144);
	ck_assert_int_eq(o.cfg.num_attention_heads, 48);
	ck_assert_int_eq(o.cfg.num_key_value_heads, 8);
	ck_assert_int_eq(o.cfg.num_local_experts, 8);
	ck_assert_int_eq(o.cfg.num_experts_per_tok, 2);
	ck_assert_int_eq(o.cfg.intermediate_size, 16384);
	ck_assert_int_eq(o.cfg.num_hidden_layers, 56);
	ck_assert_int_eq(o.cfg.vocab_size, 32768);
	ck_assert_double_eq(o.cfg.rope_theta, 1e6);
	/* dbrx with one layer and small dimensions written and read back */
	ck_assert_int_eq(mlens_mkmodel_preset(&o, "dbrx"), 0);
	o.cfg.num_hidden_layers = 1;
	o.cfg.hidden_size = 96;
	o.cfg.intermediate_size = 32;
	o.cfg.vocab_size = 300;
	o.cfg.num_attention_heads = 6;
	o.cfg.num_key_value_heads = 2;
	o.cfg.eos[0] = 2;	/* DBRX's is past this vocabulary */
	make(&o);
	ck_assert_msg(mlens_model_open(o.dir, &m, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(m->cfg.num_hidden_layers, 1);
	ck_assert_int_eq(m->cfg.num_local_experts, 16);
	ck_assert_int_eq(m->cfg.head_dim, 16);
	mlens_model_close(m);
	/* DBRX has no head_dim of its own */
	o.cfg.head_dim = 32;
	ck_assert_int_eq(mlens_mkmodel_write(&o, err, sizeof(err)), -EINVAL);
	assert_err("DbrxForCausalLM has no head_dim of its own; its head dimension is hidden size / heads (16), not 32");
}
END_TEST

/* The memory plan's arithmetic over the full shapes: the presets' models
 * hold the published parameter counts (Mixtral-8x22B 140.6e9, DBRX
 * 131.6e9), a layer's experts and attention as their shapes give them. */
START_TEST(plan_full_shapes)
{
	static const struct {
		const char *preset;
		uint64_t params, expert, attn;
	} want[] = {
		{ "mixtral-8x22b", 140630071296ull, 3ull * 6144 * 16384, 2ull * (6144 + 1024) * 6144 },
		{ "dbrx", 131596523520ull, 3ull * 6144 * 10752, (8192ull + 6144) * 6144 },
	};
	for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
		struct mlens_mkmodel_opts o = { 0 };
		struct mlens_perf_model pm;

		ck_assert_int_eq(mlens_mkmodel_preset(&o, want[i].preset), 0);
		o.cfg.head_dim = o.cfg.hidden_size / o.cfg.num_attention_heads;
		ck_assert_int_eq(o.cfg.head_dim, 128);
		ck_assert_int_eq(mlens_perf_model_from_config(&pm, &o.cfg, MLENS_DTYPE_BF16), 0);
		ck_assert_uint_eq(pm.model_bytes, 2 * want[i].params);
		ck_assert_uint_eq(pm.expert_bytes, 2 * want[i].expert);
		ck_assert_uint_eq(pm.attn_bytes, 2 * want[i].attn);
		/* a KV token: 8 KV heads of 128, K and V, bf16 */
		ck_assert_uint_eq(pm.kv_token_bytes, 2 * 8 * 128 * 2);
		ck_assert_uint_eq(mlens_gpu_plan_streamed_bytes(&pm, 2),
				  (uint64_t)(o.cfg.num_local_experts - 2) * pm.expert_bytes);
	}
}
END_TEST

/* ==== ops ==== */

static struct mlens_backend cpu;

static void cpu_setup(void)
{
	struct mlens_backend_opts bo = { .n_threads = 2, .numa_node = -1 };
	ck_assert_int_eq(mlens_backend_cpu_create(&cpu, &bo), 0);
}

static void cpu_teardown(void)
{
	mlens_backend_destroy(&cpu);
}

static float rnd(unsigned *s)
{
	*s = *s * 1103515245u + 12345u;
	return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

START_TEST(op_layernorm)
{
	enum { N = 3, D = 80 };
	float x[N * D], w[D], out[N * D];
	unsigned s = 1;

	ck_assert(MLENS_BACKEND_HAS(cpu.ops, layernorm));
	for (int i = 0; i < N * D; i++)
		x[i] = 3.0f + rnd(&s);	/* a mean far from 0: the centring shows */
	for (int j = 0; j < D; j++)
		w[j] = 1.0f + 0.25f * rnd(&s);
	ck_assert_int_eq(cpu.ops->layernorm(cpu.ctx, out, x, w, MLENS_DTYPE_F32, N, D, 1e-5f), 0);
	for (int i = 0; i < N; i++) {
		double mean = 0, var = 0;
		for (int j = 0; j < D; j++)
			mean += x[i * D + j];
		mean /= D;
		for (int j = 0; j < D; j++)
			var += (x[i * D + j] - mean) * (x[i * D + j] - mean);
		var /= D;
		for (int j = 0; j < D; j++)
			ck_assert_double_eq_tol(out[i * D + j],
						(x[i * D + j] - mean) / sqrt(var + 1e-5) * w[j], 1e-5);
	}
	/* in place, as the final norm runs it */
	ck_assert_int_eq(cpu.ops->layernorm(cpu.ctx, x, x, w, MLENS_DTYPE_F32, N, D, 1e-5f), 0);
	ck_assert_mem_eq(x, out, sizeof(out));
}
END_TEST

START_TEST(op_clamp)
{
	float x[6] = { -3.0f, -0.5f, 0.0f, 0.75f, 2.0f, NAN };

	ck_assert_int_eq(cpu.ops->clamp(cpu.ctx, x, 6, 1.0f), 0);
	ck_assert_float_eq(x[0], -1.0f);
	ck_assert_float_eq(x[1], -0.5f);
	ck_assert_float_eq(x[2], 0.0f);
	ck_assert_float_eq(x[3], 0.75f);
	ck_assert_float_eq(x[4], 1.0f);
	ck_assert(isnan(x[5]));	/* as torch.clamp */
	ck_assert_int_eq(cpu.ops->clamp(cpu.ctx, x, 1, -1.0f), -EINVAL);
	ck_assert_int_eq(cpu.ops->clamp(cpu.ctx, x, 1, NAN), -EINVAL);
}
END_TEST

/* The MoE with w2 stored [inter][hidden] gives what it gives with w2
 * transposed into [hidden][inter] (bf16: the same values either way). */
START_TEST(op_moe_w2_transposed)
{
	enum { E = 4, H = 72, I = 40, N = 5, K = 2 };
	static uint16_t w1[E][I * H], w3[E][I * H], w2[E][H * I], w2t[E][I * H];
	float x[N * H], a[N * H], b[N * H], rw[N * K];
	int32_t ids[N * K];
	const void *p1[E], *p2[E], *p2t[E], *p3[E];
	unsigned s = 9;

	for (int e = 0; e < E; e++) {
		for (int i = 0; i < I * H; i++) {
			w1[e][i] = mlens_f32_to_bf16(0.2f * rnd(&s));
			w3[e][i] = mlens_f32_to_bf16(0.2f * rnd(&s));
		}
		for (int h = 0; h < H; h++)
			for (int i = 0; i < I; i++) {
				w2[e][h * I + i] = mlens_f32_to_bf16(0.2f * rnd(&s));
				w2t[e][i * H + h] = w2[e][h * I + i];
			}
		p1[e] = w1[e];
		p2[e] = w2[e];
		p2t[e] = w2t[e];
		p3[e] = w3[e];
	}
	for (int i = 0; i < N * H; i++)
		x[i] = rnd(&s);
	for (int t = 0; t < N; t++) {
		ids[t * K] = t % E;
		ids[t * K + 1] = (t + 1 + t / 2) % E;
		rw[t * K] = 0.625f;
		rw[t * K + 1] = 0.375f;
	}
	memset(a, 0, sizeof(a));
	memset(b, 0, sizeof(b));
	struct mlens_moe_weights plain = { .n_experts = E, .hidden = H, .inter = I,
					   .dtype = MLENS_DTYPE_BF16, .w1 = p1, .w2 = p2, .w3 = p3 };
	struct mlens_moe_weights trans = { .n_experts = E, .hidden = H, .inter = I,
					   .dtype = MLENS_DTYPE_BF16, .w1 = p1, .w2 = p2t, .w3 = p3,
					   .w2_transposed = true };
	ck_assert_int_eq(cpu.ops->moe(cpu.ctx, a, x, N, ids, rw, K, &plain), 0);
	ck_assert_int_eq(cpu.ops->moe(cpu.ctx, b, x, N, ids, rw, K, &trans), 0);
	for (int i = 0; i < N * H; i++)
		ck_assert_msg(fabsf(a[i] - b[i]) <= 1e-5f * (1.0f + fabsf(a[i])), "row %d col %d: %g vs %g",
			      i / H, i % H, a[i], b[i]);
	ck_assert_float_ne(a[0], 0.0f);
}
END_TEST

/* ==== Mixtral-8x22B's ratios ==== */

/* A tiny model of Mixtral-8x22B's proportions (6 query heads a KV head,
 * head_dim 128, experts 8/3 of the hidden size, 8 experts top-2, vocab
 * not 32000) through the hybrid pipeline's plan (experts streamed through
 * its slots) and the engine: the same logits. Shapes that 8x7B's code
 * paths took for granted would break here first. MLENS_TEST_BACKEND
 * names the compared side (default hybrid-cpu; hybrid or cuda on a GPU
 * machine, which skip without one). */
START_TEST(mixtral_8x22b_ratios)
{
	struct mlens_mkmodel_opts o = { .dir = sub("m22"), .seed = 22 };
	struct mlens_golden_engine e = { 0 }, h = { 0 };
	const int32_t toks[7] = { 5, 77, 300, 12, 499, 3, 260 };
	const char *be = getenv("MLENS_TEST_BACKEND");
	float *le, *lh;
	int V = 512, rc;

	if (!be || !*be || !strcmp(be, "cpu"))
		be = "hybrid-cpu";

	ck_assert_int_eq(mlens_mkmodel_preset(&o, "mixtral-8x22b"), 0);
	o.cfg.num_hidden_layers = 2;
	o.cfg.hidden_size = 768;	/* 6144 / 8 */
	o.cfg.num_attention_heads = 6;	/* head_dim 128, 48:8 as 6:1 */
	o.cfg.num_key_value_heads = 1;
	o.cfg.intermediate_size = 2048;	/* 16384 / 8 */
	o.cfg.vocab_size = V;
	o.cfg.dtype = MLENS_DTYPE_F32;
	make(&o);
	le = calloc((size_t)7 * V, sizeof(float));
	lh = calloc((size_t)7 * V, sizeof(float));
	ck_assert_msg(mlens_golden_engine_open(&e, o.dir, "cpu", MLENS_GEMM_EXACT, err,
					       sizeof(err)) == 0, "%s", err);
	rc = mlens_golden_engine_open(&h, o.dir, be, MLENS_GEMM_EXACT, err, sizeof(err));
	if (rc == -ENOTSUP || rc == -ENODEV) {
		printf("mixtral_8x22b_ratios: backend %s not here; compared with hybrid-cpu\n", be);
		be = "hybrid-cpu";
		rc = mlens_golden_engine_open(&h, o.dir, be, MLENS_GEMM_EXACT, err, sizeof(err));
	}
	ck_assert_msg(rc == 0, "%s: %s", be, err);
	ck_assert_int_eq(mlens_golden_prefill(&e, toks, 7, le), 0);
	ck_assert_int_eq(mlens_golden_prefill(&h, toks, 7, lh), 0);
	/* fp32 weights: every backend multiplies exactly; only the order of
	 * the sums differs */
	printf("mixtral_8x22b_ratios: %s vs cpu: rel %.3g\n", be,
	       mlens_golden_rel_diff(lh, le, (size_t)7 * V));
	ck_assert_double_le(mlens_golden_rel_diff(lh, le, (size_t)7 * V), 1e-4);
	/* not flat: the rows differ and the values are finite */
	ck_assert(isfinite(le[0]) && isfinite(le[6 * V + V - 1]));
	ck_assert_float_ne(le[0], le[V]);
	mlens_golden_engine_close(&h);
	mlens_golden_engine_close(&e);
	free(le);
	free(lh);
}
END_TEST

static Suite *dbrx_suite(void)
{
	Suite *s = suite_create("dbrx");
	TCase *cfg = tcase_create("config");
	TCase *files = tcase_create("files");
	TCase *ops = tcase_create("ops");

	tcase_add_test(cfg, config_dbrx);
	tcase_add_test(cfg, config_dbrx_refusals);
	tcase_add_test(cfg, config_unknown_architecture);
	tcase_add_test(cfg, plan_full_shapes);
	suite_add_tcase(s, cfg);

	tcase_add_checked_fixture(files, setup, teardown);
	tcase_set_timeout(files, 120);
	tcase_add_test(files, mkmodel_dbrx_roundtrip);
	tcase_add_test(files, file_dbrx_missing_fused_expert);
	tcase_add_test(files, file_dbrx_wrong_fused_shape);
	tcase_add_test(files, file_dbrx_wqkv_rows);
	tcase_add_test(files, file_dbrx_mixtral_names);
	tcase_add_test(files, presets);
	tcase_add_test(files, mixtral_8x22b_ratios);
	suite_add_tcase(s, files);

	tcase_add_checked_fixture(ops, cpu_setup, cpu_teardown);
	tcase_add_test(ops, op_layernorm);
	tcase_add_test(ops, op_clamp);
	tcase_add_test(ops, op_moe_w2_transposed);
	suite_add_tcase(s, ops);
	return s;
}

int main(void)
{
	return mlens_check_run(dbrx_suite());
}
