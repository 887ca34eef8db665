/* Random in-memory models: every tensor gets values from a seeded
 * generator, scaled like HF's init so activations stay in a sane range. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/tools/mkmodel.h"
#include "tests/testmodel.h"

static unsigned long long rng_next(unsigned long long *s)
{
	unsigned long long x = (*s += 0x9e3779b97f4a7c15ull);
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

static float rng_uniform(unsigned long long *s)	/* [-1, 1) */
{
	return (float)((double)(rng_next(s) >> 11) / 4503599627370496.0 - 1.0);
}

static struct mlens_tensor *add(struct mlens_model *m, const char *name, int64_t r, int64_t c,
				float scale, float offset, unsigned long long *rng)
{
	struct mlens_tensor *t = &m->tensors[m->n_tensors++];
	size_t n = (size_t)r * (size_t)(c ? c : 1);
	void *data;
	t->name = strdup(name);
	t->dtype = m->cfg.dtype;
	t->ndim = c ? 2 : 1;
	t->shape[0] = r;
	t->shape[1] = c;
	t->nbytes = n * mlens_dtype_size(t->dtype);
	data = malloc(t->nbytes);
	for (size_t i = 0; i < n; i++)
		mlens_store(data, t->dtype, i, offset + scale * rng_uniform(rng));
	t->data = data;
	m->weight_bytes += t->nbytes;
	return t;
}

struct mlens_test_spec mlens_test_spec_tiny(void)
{
	struct mlens_test_spec s = { 97, 32, 48, 2, 4, 2, 8, 4, 2, 512, MLENS_DTYPE_F32, 10000.0, 1 };
	return s;
}

struct mlens_model *mlens_test_model_new(const struct mlens_test_spec *s)
{
	struct mlens_model *m = calloc(1, sizeof(*m));
	unsigned long long rng = s->seed;
	int per_layer = 7 + 3 * s->experts;
	char name[128];

	strcpy(m->cfg.architecture, "MixtralForCausalLM");
	m->cfg.vocab_size = s->vocab;
	m->cfg.hidden_size = s->hidden;
	m->cfg.intermediate_size = s->inter;
	m->cfg.num_hidden_layers = s->layers;
	m->cfg.num_attention_heads = s->heads;
	m->cfg.num_key_value_heads = s->kv_heads;
	m->cfg.head_dim = s->head_dim;
	m->cfg.num_local_experts = s->experts;
	m->cfg.num_experts_per_tok = s->top_k;
	m->cfg.max_position_embeddings = s->max_pos;
	m->cfg.rope_theta = s->rope_theta;
	m->cfg.rms_norm_eps = 1e-5;
	m->cfg.dtype = s->dtype;
	m->tensors = calloc((size_t)(3 + per_layer * s->layers), sizeof(*m->tensors));
	m->layers = calloc((size_t)s->layers, sizeof(*m->layers));

	m->embed = add(m, "model.embed_tokens.weight", s->vocab, s->hidden, 1.0f, 0, &rng);
	m->final_norm = add(m, "model.norm.weight", s->hidden, 0, 0.1f, 1.0f, &rng);
	m->lm_head = add(m, "lm_head.weight", s->vocab, s->hidden, 0.2f, 0, &rng);
	for (int l = 0; l < s->layers; l++) {
		struct mlens_layer_weights *w = &m->layers[l];
		int qd = s->heads * s->head_dim, kd = s->kv_heads * s->head_dim;
		float ws = 0.3f;
		snprintf(name, sizeof(name), "model.layers.%d.input_layernorm.weight", l);
		w->attn_norm = add(m, name, s->hidden, 0, 0.1f, 1.0f, &rng);
		snprintf(name, sizeof(name), "model.layers.%d.self_attn.q_proj.weight", l);
		w->wq = add(m, name, qd, s->hidden, ws, 0, &rng);
		snprintf(name, sizeof(name), "model.layers.%d.self_attn.k_proj.weight", l);
		w->wk = add(m, name, kd, s->hidden, ws, 0, &rng);
		snprintf(name, sizeof(name), "model.layers.%d.self_attn.v_proj.weight", l);
		w->wv = add(m, name, kd, s->hidden, ws, 0, &rng);
		snprintf(name, sizeof(name), "model.layers.%d.self_attn.o_proj.weight", l);
		w->wo = add(m, name, s->hidden, qd, ws, 0, &rng);
		snprintf(name, sizeof(name), "model.layers.%d.post_attention_layernorm.weight", l);
		w->ffn_norm = add(m, name, s->hidden, 0, 0.1f, 1.0f, &rng);
		snprintf(name, sizeof(name), "model.layers.%d.block_sparse_moe.gate.weight", l);
		w->router = add(m, name, s->experts, s->hidden, 0.5f, 0, &rng);
		w->w1 = calloc((size_t)s->experts, sizeof(void *));
		w->w2 = calloc((size_t)s->experts, sizeof(void *));
		w->w3 = calloc((size_t)s->experts, sizeof(void *));
		for (int e = 0; e < s->experts; e++) {
			snprintf(name, sizeof(name), "model.layers.%d.block_sparse_moe.experts.%d.w1.weight", l, e);
			w->w1[e] = add(m, name, s->inter, s->hidden, ws, 0, &rng)->data;
			snprintf(name, sizeof(name), "model.layers.%d.block_sparse_moe.experts.%d.w2.weight", l, e);
			w->w2[e] = add(m, name, s->hidden, s->inter, ws, 0, &rng)->data;
			snprintf(name, sizeof(name), "model.layers.%d.block_sparse_moe.experts.%d.w3.weight", l, e);
			w->w3[e] = add(m, name, s->inter, s->hidden, ws, 0, &rng)->data;
		}
	}
	return m;
}

void mlens_test_model_free(struct mlens_model *m)
{
	if (!m)
		return;
	for (int i = 0; i < m->n_tensors; i++) {
		free(m->tensors[i].name);
		free((void *)m->tensors[i].data);
	}
	for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++) {
		free(m->layers[l].w1);
		free(m->layers[l].w2);
		free(m->layers[l].w3);
	}
	free(m->layers);
	free(m->tensors);
	free(m);
}

struct mlens_model_config mlens_test_mixtral_config(int layers)
{
	struct mlens_mkmodel_opts o;
	memset(&o, 0, sizeof(o));
	if (mlens_mkmodel_preset(&o, "mixtral-8x7b")) {
		fprintf(stderr, "testmodel: mlens-mkmodel lost its mixtral-8x7b preset\n");
		abort();
	}
	o.cfg.num_hidden_layers = layers;
	o.cfg.head_dim = o.cfg.hidden_size / o.cfg.num_attention_heads;
	strcpy(o.cfg.architecture, "MixtralForCausalLM");
	return o.cfg;
}

struct mlens_perf_model mlens_test_mixtral_pm(int layers)
{
	struct mlens_model_config c = mlens_test_mixtral_config(layers);
	struct mlens_perf_model pm;
	if (mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16)) {
		fprintf(stderr, "testmodel: no performance model for Mixtral-8x7B\n");
		abort();
	}
	return pm;
}

struct mlens_perf_hw mlens_test_a40_hw(const struct mlens_perf_model *pm, double budget_gib)
{
	struct mlens_perf_hw hw;
	memset(&hw, 0, sizeof(hw));
	hw.c_gpu = 149.7e12;
	hw.b_io = 25e9;
	hw.b_d2h = 25e9;
	hw.b_hbm = 696e9;
	hw.b_mem = 200e9;
	hw.b_attn = 100e9;
	hw.gpu_workspace = 512ull << 20;
	hw.gpu_budget = (uint64_t)(budget_gib * 1024.0 * 1024.0 * 1024.0);
	mlens_perf_hw_roofline_lines(&hw, pm);
	return hw;
}

void mlens_test_favour_experts(struct mlens_model *m, const int (*fav)[2])
{
	size_t H = (size_t)m->cfg.hidden_size;
	float *e = (float *)m->embed->data;
	for (int64_t t = 0; t < m->cfg.vocab_size; t++)
		e[(size_t)t * H] += 8.0f;
	for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++) {
		const struct mlens_layer_weights *w = &m->layers[l];
		float *r = (float *)w->router->data;
		size_t qdim = (size_t)(m->cfg.num_attention_heads * m->cfg.head_dim);
		/* nothing a layer adds moves the first component */
		memset((void *)w->wo->data, 0, qdim * sizeof(float));
		for (int x = 0; x < (int)m->cfg.num_local_experts; x++)
			memset((void *)w->w2[x], 0, (size_t)m->cfg.intermediate_size * sizeof(float));
		for (int x = 0; x < (int)m->cfg.num_local_experts; x++) {
			memset(r + (size_t)x * H, 0, H * sizeof(float));
			r[(size_t)x * H] = x == fav[l][0] || x == fav[l][1] ? 1.0f : -1.0f;
		}
	}
}
