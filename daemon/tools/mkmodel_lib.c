/* Random-weight Mixtral writer behind mlens-mkmodel and the tests. Values
 * are a counter-based hash of (seed, tensor name, index), so any element can
 * be recomputed on its own and the data is streamed, never held whole. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <jansson.h>

#include "daemon/errf.h"
#include "daemon/tools/mkmodel.h"
#include "daemon/model/family.h"
#include "daemon/model/model_int.h"
#include "daemon/model/quant.h"
#include "kernels/cpu/pool.h"

#define CHUNK_ELEMS 65536
/* Values are a pure function of (stream, index) (draw), so chunks of a
 * batch are filled by several threads and written in order: the file is
 * the same bytes whatever the thread count. */
#define BATCH_PER_THREAD 4
#define MAX_FILL_THREADS 32


/* Qwen's and OLMoE's common choices. */
static void qwen_common(struct mlens_model_config *c, const char *arch)
{
	c->family = mlens_family_find(arch);
	c->rms_norm_eps = 1e-6;
	c->eos[0] = 151643;	/* <|endoftext|> */
}

int mlens_mkmodel_preset(struct mlens_mkmodel_opts *o, const char *name)
{
	struct mlens_model_config *c = &o->cfg;

	memset(c, 0, sizeof(*c));
	c->family = mlens_family_find("MixtralForCausalLM");
	c->rope_theta = 1e6;
	c->rms_norm_eps = 1e-5;
	c->dtype = MLENS_DTYPE_BF16;
	c->dtype_given = true;
	c->eos[0] = 2;		/* Mixtral's </s> */
	c->n_eos = 1;
	if (!strcmp(name, "tiny")) {
		c->vocab_size = 512;
		c->hidden_size = 64;
		c->intermediate_size = 128;
		c->num_hidden_layers = 2;
		c->num_attention_heads = 4;
		c->num_key_value_heads = 2;
		c->num_local_experts = 4;
		c->num_experts_per_tok = 2;
		c->max_position_embeddings = 4096;
	} else if (!strcmp(name, "mixtral-8x7b")) {
		c->vocab_size = 32000;
		c->hidden_size = 4096;
		c->intermediate_size = 14336;
		c->num_hidden_layers = 32;
		c->num_attention_heads = 32;
		c->num_key_value_heads = 8;
		c->num_local_experts = 8;
		c->num_experts_per_tok = 2;
		c->max_position_embeddings = 32768;
	} else if (!strcmp(name, "mixtral-8x22b")) {
		c->vocab_size = 32768;
		c->hidden_size = 6144;
		c->intermediate_size = 16384;
		c->num_hidden_layers = 56;
		c->num_attention_heads = 48;
		c->num_key_value_heads = 8;
		c->num_local_experts = 8;
		c->num_experts_per_tok = 2;
		c->max_position_embeddings = 65536;
	} else if (!strcmp(name, "dbrx") || !strcmp(name, "dbrx-tiny")) {
		bool full = !strcmp(name, "dbrx");

		c->family = mlens_family_find("DbrxForCausalLM");
		c->norm_kind = MLENS_NORM_LAYER;
		c->w2_transposed = true;
		c->clip_qkv = 8;
		c->rope_theta = 5e5;
		c->vocab_size = full ? 100352 : 512;
		c->hidden_size = full ? 6144 : 64;
		c->intermediate_size = full ? 10752 : 96;	/* != hidden: w2's layout shows */
		c->num_hidden_layers = full ? 40 : 2;
		c->num_attention_heads = full ? 48 : 4;
		c->num_key_value_heads = full ? 8 : 2;
		c->num_local_experts = full ? 16 : 8;
		c->num_experts_per_tok = 4;
		c->max_position_embeddings = full ? 32768 : 4096;
		if (full)
			c->eos[0] = 100257;	/* <|endoftext|> of DBRX's tokenizer */
	} else if (!strcmp(name, "qwen3-tiny") || !strcmp(name, "qwen3-30b-a3b")) {
		bool tiny = !strcmp(name, "qwen3-tiny");

		qwen_common(c, "Qwen3MoeForCausalLM");
		c->qk_norm = MLENS_QK_NORM_HEAD;
		c->vocab_size = tiny ? 512 : 151936;
		c->hidden_size = tiny ? 64 : 2048;
		c->num_hidden_layers = tiny ? 2 : 48;
		c->num_attention_heads = tiny ? 4 : 32;
		c->num_key_value_heads = tiny ? 2 : 4;
		c->head_dim = tiny ? 32 : 128;	/* q dim != hidden */
		c->num_local_experts = tiny ? 8 : 128;
		c->num_experts_per_tok = tiny ? 2 : 8;
		c->intermediate_size = tiny ? 32 : 768;
		c->dense_inter = tiny ? 96 : 6144;
		c->dense[1] = tiny;	/* the tiny one has a dense layer (mlp_only_layers) */
		c->max_position_embeddings = tiny ? 4096 : 40960;
		c->eos[0] = tiny ? 2 : 151645;	/* <|im_end|> */
	} else if (!strcmp(name, "qwen2-tiny") || !strcmp(name, "qwen1.5-moe-a2.7b") ||
		   !strcmp(name, "qwen2-57b-a14b")) {
		bool tiny = !strcmp(name, "qwen2-tiny"), big = !strcmp(name, "qwen2-57b-a14b");

		qwen_common(c, "Qwen2MoeForCausalLM");
		c->qkv_bias = true;
		c->shared_gate = true;
		c->topk_raw = true;
		c->vocab_size = tiny ? 512 : 151936;
		c->hidden_size = tiny ? 64 : big ? 3584 : 2048;
		c->num_hidden_layers = tiny ? 2 : big ? 28 : 24;
		c->num_attention_heads = tiny ? 4 : big ? 28 : 16;
		c->num_key_value_heads = tiny ? 2 : big ? 4 : 16;
		c->num_local_experts = tiny ? 8 : big ? 64 : 60;
		c->num_experts_per_tok = tiny ? 2 : big ? 8 : 4;
		c->intermediate_size = tiny ? 32 : big ? 2560 : 1408;
		c->shared_inter = tiny ? 64 : big ? 20480 : 5632;
		c->dense_inter = tiny ? 96 : big ? 18944 : 5632;
		c->max_position_embeddings = tiny ? 4096 : big ? 32768 : 8192;
		if (tiny)
			c->eos[0] = 2;
	} else if (!strcmp(name, "olmoe-tiny") || !strcmp(name, "olmoe-1b-7b")) {
		bool tiny = !strcmp(name, "olmoe-tiny");

		c->family = mlens_family_find("OlmoeForCausalLM");
		c->qk_norm = MLENS_QK_NORM_ALL;
		c->topk_raw = true;
		c->rope_theta = 1e4;
		c->vocab_size = tiny ? 512 : 50304;
		c->hidden_size = tiny ? 64 : 2048;
		c->num_hidden_layers = tiny ? 2 : 16;
		c->num_attention_heads = tiny ? 4 : 16;
		c->num_key_value_heads = tiny ? 2 : 16;
		c->num_local_experts = tiny ? 16 : 64;
		c->num_experts_per_tok = tiny ? 4 : 8;
		c->intermediate_size = tiny ? 32 : 1024;
		c->max_position_embeddings = 4096;
		c->eos[0] = tiny ? 2 : 50279;
	} else {
		return -EINVAL;
	}
	return 0;
}

/* The writer's layout: DBRX's (transformer.*) or the others' (model.*). */
static bool is_dbrx(const struct mlens_model_config *c)
{
	return !strcmp(c->family->architecture, "DbrxForCausalLM");
}

/* ==== the generator ==== */

static uint64_t mix64(uint64_t z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t stream_key(uint64_t seed, const char *name)
{
	uint64_t h = 0xcbf29ce484222325ull;	/* FNV-1a */

	for (const unsigned char *p = (const unsigned char *)name; *p; p++)
		h = (h ^ *p) * 0x100000001b3ull;
	return mix64(h ^ mix64(seed + 0x9e3779b97f4a7c15ull));
}

/* A norm's weight: its last name part ends in "norm" (Mixtral's
 * input_layernorm, norm) or starts with it (DBRX's norm_1, norm_f). */
static bool is_norm(const char *name)
{
	size_t n = strlen(name);
	const char *end, *p;

	if (n < 7 || strcmp(name + n - 7, ".weight"))
		return false;
	end = name + n - 7;
	for (p = end; p > name && p[-1] != '.'; p--)
		;
	return (end - p >= 4 && !strncmp(end - 4, "norm", 4)) || !strncmp(p, "norm", 4);
}

/* Sum of four 16-bit uniforms (Irwin-Hall), centred and scaled to unit
 * variance: close enough to a normal for initialisation, and bounded. */
static float draw(uint64_t key, uint64_t i, bool norm)
{
	uint64_t x = mix64(key + (i + 1) * 0x9e3779b97f4a7c15ull);
	double s = 0;

	for (int k = 0; k < 4; k++)
		s += ((double)((x >> (16 * k)) & 0xffff) + 0.5) / 65536.0;
	s = (s - 2.0) * 1.7320508075688772;	/* sqrt(12 / 4) */
	return (float)((norm ? 1.0 : 0.0) + 0.02 * s);
}

float mlens_mkmodel_value(uint64_t seed, const char *name, uint64_t i)
{
	return draw(stream_key(seed, name), i, is_norm(name));
}

/* ==== the tensor list ==== */

/* PART_FP8: an expert matrix quantized; PART_SCALE: its scales (qshape). */
enum part_kind { PART_PLAIN, PART_GATE_UP, PART_DOWN, PART_FP8, PART_SCALE };

struct spec {
	char name[160];		/* name in the file */
	enum part_kind kind;
	enum mlens_dtype dt;
	int64_t layer;
	int ndim;
	int64_t shape[3];
	int64_t qshape[2];	/* PART_SCALE: the fp8 matrix's */
	uint64_t nbytes;
	int shard;
};

struct writer {
	const struct mlens_mkmodel_opts *o;
	struct mlens_model_config cfg;	/* head_dim resolved */
	struct spec *specs;
	int n;
	char *err;
	size_t errlen;
	void *buf;		/* a batch: threads x BATCH_PER_THREAD chunks */
	int threads;
	struct mlens_pool *pool;	/* fills a batch's chunks */
};

static void add(struct writer *w, enum part_kind kind, int64_t layer, int ndim,
		int64_t d0, int64_t d1, int64_t d2, const char *fmt, ...)
	__attribute__((format(printf, 8, 9)));

static void add(struct writer *w, enum part_kind kind, int64_t layer, int ndim,
		int64_t d0, int64_t d1, int64_t d2, const char *fmt, ...)
{
	struct spec *s = &w->specs[w->n++];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(s->name, sizeof(s->name), fmt, ap);
	va_end(ap);
	s->kind = kind;
	s->layer = layer;
	s->ndim = ndim;
	s->shape[0] = d0;
	s->shape[1] = d1;
	s->shape[2] = d2;
	s->dt = w->cfg.dtype;
	s->nbytes = mlens_dtype_size(w->cfg.dtype);
	for (int i = 0; i < ndim; i++)
		s->nbytes *= (uint64_t)s->shape[i];	/* bounded by the config checks */
}

/* The expert matrix just added as fp8, and its scales after it. */
static void add_fp8(struct writer *w)
{
	struct spec *m = &w->specs[w->n - 1], *s = &w->specs[w->n++];
	const struct mlens_wscale *k = &w->o->fp8;
	const char *suffix = k->kind == MLENS_WSCALE_BLOCK ? "_scale_inv" : "_scale";

	m->kind = PART_FP8;
	m->dt = MLENS_DTYPE_E4M3;
	m->nbytes = (uint64_t)(m->shape[0] * m->shape[1]);
	char base[sizeof(m->name)];

	memcpy(base, m->name, sizeof(base));
	*s = *m;
	snprintf(s->name, sizeof(s->name), "%.148s%s", base, suffix);
	s->kind = PART_SCALE;
	s->dt = MLENS_DTYPE_F32;
	s->qshape[0] = m->shape[0];
	s->qshape[1] = m->shape[1];
	s->shape[0] = k->kind == MLENS_WSCALE_BLOCK ? (m->shape[0] + k->block_rows - 1) / k->block_rows
						    : m->shape[0];
	s->shape[1] = k->kind == MLENS_WSCALE_BLOCK ? (m->shape[1] + k->block_cols - 1) / k->block_cols
						    : 1;
	s->nbytes = (uint64_t)(s->shape[0] * s->shape[1]) * 4;
}

static int build_specs(struct writer *w)
{
	const struct mlens_model_config *c = &w->cfg;
	const struct mlens_family *f = c->family;
	const int64_t V = c->vocab_size, H = c->hidden_size, I = c->intermediate_size;
	const int64_t E = c->num_local_experts, L = c->num_hidden_layers;
	const int64_t Q = c->num_attention_heads * c->head_dim;
	const int64_t KV = c->num_key_value_heads * c->head_dim;
	const int64_t qn = c->qk_norm == MLENS_QK_NORM_HEAD ? c->head_dim : Q;
	const int64_t kn = c->qk_norm == MLENS_QK_NORM_HEAD ? c->head_dim : KV;
	/* the most a layer has: attention with norms and biases, a shared
	 * expert with its gate, the experts (and their fp8 scales) */
	bool fp8 = w->o->fp8.kind != MLENS_WSCALE_NONE;
	size_t per_layer = 16 + (w->o->fused_experts ? 3 : 1 + (fp8 ? 6 : 3) * (size_t)E);
	const char *p = "model.layers.";	/* DBRX: "transformer.blocks." */

	w->specs = calloc(3 + (size_t)L * per_layer, sizeof(*w->specs));
	if (!w->specs)
		return -ENOMEM;
	if (is_dbrx(c)) {
		/* DBRX's own layout: fused Wqkv, experts fused over E along the
		 * rows, w2 [E*I][H] as stored in DBRX's files */
		p = "transformer.blocks.";
		add(w, PART_PLAIN, -1, 2, V, H, 0, "transformer.wte.weight");
		for (int64_t i = 0; i < L; i++) {
			add(w, PART_PLAIN, i, 1, H, 0, 0, "%s%" PRId64 ".norm_attn_norm.norm_1.weight", p, i);
			add(w, PART_PLAIN, i, 2, Q + 2 * KV, H, 0, "%s%" PRId64 ".norm_attn_norm.attn.Wqkv.weight", p, i);
			add(w, PART_PLAIN, i, 2, H, Q, 0, "%s%" PRId64 ".norm_attn_norm.attn.out_proj.weight", p, i);
			add(w, PART_PLAIN, i, 1, H, 0, 0, "%s%" PRId64 ".norm_attn_norm.norm_2.weight", p, i);
			add(w, PART_PLAIN, i, 2, E, H, 0, "%s%" PRId64 ".ffn.router.layer.weight", p, i);
			add(w, PART_PLAIN, i, 2, E * I, H, 0, "%s%" PRId64 ".ffn.experts.mlp.w1", p, i);
			add(w, PART_PLAIN, i, 2, E * I, H, 0, "%s%" PRId64 ".ffn.experts.mlp.v1", p, i);
			add(w, PART_PLAIN, i, 2, E * I, H, 0, "%s%" PRId64 ".ffn.experts.mlp.w2", p, i);
		}
		add(w, PART_PLAIN, -1, 1, H, 0, 0, "transformer.norm_f.weight");
		if (!c->tie_word_embeddings)
			add(w, PART_PLAIN, -1, 2, V, H, 0, "lm_head.weight");
		return 0;
	}
	add(w, PART_PLAIN, -1, 2, V, H, 0, "model.embed_tokens.weight");
	for (int64_t i = 0; i < L; i++) {
		add(w, PART_PLAIN, i, 1, H, 0, 0, "%s%" PRId64 ".input_layernorm.weight", p, i);
		add(w, PART_PLAIN, i, 2, Q, H, 0, "%s%" PRId64 ".self_attn.q_proj.weight", p, i);
		add(w, PART_PLAIN, i, 2, KV, H, 0, "%s%" PRId64 ".self_attn.k_proj.weight", p, i);
		add(w, PART_PLAIN, i, 2, KV, H, 0, "%s%" PRId64 ".self_attn.v_proj.weight", p, i);
		add(w, PART_PLAIN, i, 2, H, Q, 0, "%s%" PRId64 ".self_attn.o_proj.weight", p, i);
		if (c->qkv_bias) {
			add(w, PART_PLAIN, i, 1, Q, 0, 0, "%s%" PRId64 ".self_attn.q_proj.bias", p, i);
			add(w, PART_PLAIN, i, 1, KV, 0, 0, "%s%" PRId64 ".self_attn.k_proj.bias", p, i);
			add(w, PART_PLAIN, i, 1, KV, 0, 0, "%s%" PRId64 ".self_attn.v_proj.bias", p, i);
		}
		if (c->o_bias)
			add(w, PART_PLAIN, i, 1, H, 0, 0, "%s%" PRId64 ".self_attn.o_proj.bias", p, i);
		if (c->qk_norm) {
			add(w, PART_PLAIN, i, 1, qn, 0, 0, "%s%" PRId64 ".self_attn.q_norm.weight", p, i);
			add(w, PART_PLAIN, i, 1, kn, 0, 0, "%s%" PRId64 ".self_attn.k_norm.weight", p, i);
		}
		add(w, PART_PLAIN, i, 1, H, 0, 0, "%s%" PRId64 ".post_attention_layernorm.weight", p, i);
		if (c->dense[i]) {
			const int64_t D = c->dense_inter;
			add(w, PART_PLAIN, i, 2, D, H, 0, "%s%" PRId64 ".mlp.gate_proj.weight", p, i);
			add(w, PART_PLAIN, i, 2, D, H, 0, "%s%" PRId64 ".mlp.up_proj.weight", p, i);
			add(w, PART_PLAIN, i, 2, H, D, 0, "%s%" PRId64 ".mlp.down_proj.weight", p, i);
			continue;
		}
		if (c->shared_inter) {
			const int64_t S = c->shared_inter;
			add(w, PART_PLAIN, i, 2, S, H, 0, "%s%" PRId64 ".mlp.shared_expert.gate_proj.weight", p, i);
			add(w, PART_PLAIN, i, 2, S, H, 0, "%s%" PRId64 ".mlp.shared_expert.up_proj.weight", p, i);
			add(w, PART_PLAIN, i, 2, H, S, 0, "%s%" PRId64 ".mlp.shared_expert.down_proj.weight", p, i);
			if (c->shared_gate)
				add(w, PART_PLAIN, i, 2, 1, H, 0, "%s%" PRId64 ".mlp.shared_expert_gate.weight", p, i);
		}
		if (w->o->fused_experts) {
			add(w, PART_PLAIN, i, 2, E, H, 0, "%s%" PRId64 ".mlp.gate.weight", p, i);
			add(w, PART_GATE_UP, i, 3, E, 2 * I, H, "%s%" PRId64 ".mlp.experts.gate_up_proj", p, i);
			add(w, PART_DOWN, i, 3, E, H, I, "%s%" PRId64 ".mlp.experts.down_proj", p, i);
			continue;
		}
		add(w, PART_PLAIN, i, 2, E, H, 0, "%s%" PRId64 ".%s", p, i, f->router);
		for (int64_t j = 0; j < E; j++) {
			add(w, PART_PLAIN, i, 2, I, H, 0, "%s%" PRId64 ".%s.%" PRId64 ".%s.weight", p, i, f->experts, j, f->expert_w[0]);
			if (fp8)
				add_fp8(w);
			add(w, PART_PLAIN, i, 2, H, I, 0, "%s%" PRId64 ".%s.%" PRId64 ".%s.weight", p, i, f->experts, j, f->expert_w[1]);
			if (fp8)
				add_fp8(w);
			add(w, PART_PLAIN, i, 2, I, H, 0, "%s%" PRId64 ".%s.%" PRId64 ".%s.weight", p, i, f->experts, j, f->expert_w[2]);
			if (fp8)
				add_fp8(w);
		}
	}
	add(w, PART_PLAIN, -1, 1, H, 0, 0, "model.norm.weight");
	if (!c->tie_word_embeddings)
		add(w, PART_PLAIN, -1, 2, V, H, 0, "lm_head.weight");
	return 0;
}

/* Consecutive tensors, split at byte boundaries total*k/N, every shard
 * holding at least one tensor. */
static void assign_shards(struct writer *w, int shards)
{
	uint64_t total = 0, cum = 0;
	int s = 0;

	for (int i = 0; i < w->n; i++)
		total += w->specs[i].nbytes;
	for (int i = 0; i < w->n; i++) {
		bool nonempty = i > 0 && w->specs[i - 1].shard == s;
		bool must = w->n - i <= shards - 1 - s;
		double boundary = (double)total * (s + 1) / shards;

		if (s < shards - 1 && nonempty && (must || (double)cum >= boundary))
			s++;
		w->specs[i].shard = s;
		cum += w->specs[i].nbytes;
	}
}

/* ==== writing ==== */

static const char *dtype_st(enum mlens_dtype t)
{
	return mlens_dtype_name(t);
}

static const char *dtype_hf(enum mlens_dtype t)
{
	switch (t) {
	case MLENS_DTYPE_F32: return "float32";
	case MLENS_DTYPE_F16: return "float16";
	case MLENS_DTYPE_BF16: return "bfloat16";
	case MLENS_DTYPE_E4M3: return "float8_e4m3fn";
	}
	return "?";
}

struct fill_job {
	void *buf;
	enum mlens_dtype dt;
	uint64_t key, first;	/* stream and index of buf's element 0 */
	size_t n;		/* elements in the batch */
	bool norm;
};

/* Task c of the pool: chunk c of the batch. */
static void fill_chunk(void *arg, int c, int thread)
{
	const struct fill_job *j = arg;
	size_t k0 = (size_t)c * CHUNK_ELEMS, end = j->n - k0 < CHUNK_ELEMS ? j->n : k0 + CHUNK_ELEMS;
	(void)thread;
	for (size_t k = k0; k < end; k++)
		mlens_store(j->buf, j->dt, k, draw(j->key, j->first + k, j->norm));
}

/* Stream count values of stream `legacy` starting at element 0. */
/* With router_favor, what legacy's first column becomes: 1 the
 * embedding (0.2: ten times the noise, so that the rest of the hidden state
 * still weighs in the tokens), 2 a router (+2 for favored experts'
 * rows, -2 for the others), 0 nothing. */
static int favor_kind(const struct writer *w, const char *legacy)
{
	const struct mlens_family *f = w->cfg.family;
	const char *r = f->router ? f->router : "ffn.router.layer.weight";
	size_t nl = strlen(legacy), nr = strlen(r);

	if (w->o->router_favor <= 0)
		return 0;
	if (f->embed && !strcmp(legacy, f->embed))
		return 1;
	if (nl > nr && legacy[nl - nr - 1] == '.' && !strcmp(legacy + nl - nr, r))
		return 2;
	return 0;
}

static int emit(struct writer *w, FILE *f, const char *path, const char *legacy, uint64_t count)
{
	const size_t es = mlens_dtype_size(w->cfg.dtype);
	const size_t batch = (size_t)w->threads * BATCH_PER_THREAD * CHUNK_ELEMS;
	const uint64_t H = (uint64_t)w->cfg.hidden_size;
	uint64_t key = stream_key(w->o->seed, legacy);
	bool norm = is_norm(legacy);
	int favor = favor_kind(w, legacy);

	for (uint64_t i = 0; i < count;) {
		size_t n = count - i < batch ? (size_t)(count - i) : batch;

		struct fill_job job = { w->buf, w->cfg.dtype, key, i, n, norm };

		mlens_pool_run(w->pool, (int)((n + CHUNK_ELEMS - 1) / CHUNK_ELEMS), fill_chunk, &job);
		for (size_t j = favor ? (size_t)((H - i % H) % H) : n; j < n; j += H) {
			uint64_t row = (i + j) / H;
			float v = favor == 1 ? 0.2f : row >= (uint64_t)w->o->router_favor ? 2.0f : -2.0f;
			mlens_store(w->buf, w->cfg.dtype, j, v);
		}
		if (fwrite(w->buf, es, n, f) != n) {
			mlens_errf(w->err, w->errlen, "%s: write failed: %s", path, strerror(errno));
			return -EIO;
		}
		i += n;
	}
	return 0;
}

/* An fp8 expert matrix (PART_FP8) or its scales (PART_SCALE): the values
 * its legacy name draws, quantized as o->fp8 says. */
static int emit_fp8(struct writer *w, FILE *f, const char *path, const struct spec *s)
{
	const int64_t R = s->kind == PART_FP8 ? s->shape[0] : s->qshape[0];
	const int64_t C = s->kind == PART_FP8 ? s->shape[1] : s->qshape[1];
	size_t n = (size_t)(R * C), ns = mlens_wscale_count(&w->o->fp8, R, C);
	char name[160];
	float *v = malloc(n * sizeof(float)), *sc = malloc(ns * sizeof(float));
	uint8_t *q = malloc(n);
	int rc = 0;

	snprintf(name, sizeof(name), "%s", s->name);
	if (s->kind == PART_SCALE)	/* the matrix's name: drop _scale[_inv] */
		name[strlen(name) - (w->o->fp8.kind == MLENS_WSCALE_BLOCK ? 10 : 6)] = '\0';
	if (!v || !sc || !q) {
		mlens_errf(w->err, w->errlen, "%s: out of memory quantizing '%s'", path, name);
		rc = -ENOMEM;
		goto out;
	}
	{
		struct fill_job job = { v, MLENS_DTYPE_F32, stream_key(w->o->seed, name), 0, n, false };
		mlens_pool_run(w->pool, (int)((n + CHUNK_ELEMS - 1) / CHUNK_ELEMS), fill_chunk, &job);
	}
	/* as a checkpoint in the model's dtype quantized: weight_dtype = fp8
	 * over the same model in that dtype gives these very bytes */
	for (size_t i = 0; i < n; i++) {
		unsigned char t[4];
		mlens_store(t, w->cfg.dtype, 0, v[i]);
		v[i] = mlens_load(t, w->cfg.dtype, 0);
	}
	mlens_fp8_quantize(v, R, C, &w->o->fp8, q, sc);
	if (s->kind == PART_FP8 ? fwrite(q, 1, n, f) != n : fwrite(sc, sizeof(float), ns, f) != ns) {
		mlens_errf(w->err, w->errlen, "%s: write failed: %s", path, strerror(errno));
		rc = -EIO;
	}
out:
	free(v);
	free(sc);
	free(q);
	return rc;
}

/* Expert j's matrix k (0 gate, 1 down, 2 up) of layer l under its
 * per-expert name: the stream its values come from in either layout. */
static const char *expert_name(const struct writer *w, char *buf, size_t len, int64_t l,
			       int64_t j, int k)
{
	const struct mlens_family *f = w->cfg.family;

	snprintf(buf, len, "model.layers.%" PRId64 ".%s.%" PRId64 ".%s.weight", l, f->experts, j,
		 f->expert_w[k]);
	return buf;
}

static int emit_tensor(struct writer *w, FILE *f, const char *path, const struct spec *s)
{
	const int64_t E = w->cfg.num_local_experts;
	const uint64_t IH = (uint64_t)w->cfg.intermediate_size * (uint64_t)w->cfg.hidden_size;
	char name[160];
	int rc = 0;

	switch (s->kind) {
	case PART_PLAIN:
		if (w->o->fused_experts && strstr(s->name, ".mlp.gate.weight")) {
			snprintf(name, sizeof(name), "model.layers.%" PRId64 ".%s", s->layer,
				 w->cfg.family->router);
			return emit(w, f, path, name, s->nbytes / mlens_dtype_size(w->cfg.dtype));
		}
		return emit(w, f, path, s->name, s->nbytes / mlens_dtype_size(w->cfg.dtype));
	case PART_GATE_UP:
		for (int64_t j = 0; j < E && !rc; j++) {
			rc = emit(w, f, path, expert_name(w, name, sizeof(name), s->layer, j, 0), IH);
			if (!rc)
				rc = emit(w, f, path, expert_name(w, name, sizeof(name), s->layer, j, 2), IH);
		}
		return rc;
	case PART_DOWN:
		for (int64_t j = 0; j < E && !rc; j++)
			rc = emit(w, f, path, expert_name(w, name, sizeof(name), s->layer, j, 1), IH);
		return rc;
	case PART_FP8:
	case PART_SCALE:
		return emit_fp8(w, f, path, s);
	}
	return -EINVAL;
}

static int write_shard(struct writer *w, int shard, const char *fname)
{
	json_t *hdr = json_object(), *meta = json_object();
	char *text = NULL, *path = mlens_model_path(w->o->dir, fname);
	FILE *f = NULL;
	uint64_t off = 0, hlen;
	unsigned char le[8];
	int rc = -ENOMEM;

	if (!hdr || !meta || !path) {
		mlens_errf(w->err, w->errlen, "%s: out of memory", w->o->dir);
		goto out;
	}
	json_object_set_new(meta, "format", json_string("pt"));
	json_object_set_new(hdr, "__metadata__", meta);
	meta = NULL;
	for (int i = 0; i < w->n; i++) {
		const struct spec *s = &w->specs[i];
		json_t *shape;

		if (s->shard != shard)
			continue;
		shape = json_array();
		for (int d = 0; d < s->ndim; d++)
			json_array_append_new(shape, json_integer(s->shape[d]));
		json_object_set_new(hdr, s->name,
				    json_pack("{s:s, s:o, s:[I, I]}", "dtype", dtype_st(s->dt),
					      "shape", shape, "data_offsets",
					      (json_int_t)off, (json_int_t)(off + s->nbytes)));
		off += s->nbytes;
	}
	text = json_dumps(hdr, JSON_COMPACT);
	if (!text) {
		mlens_errf(w->err, w->errlen, "%s: out of memory", path);
		goto out;
	}
	/* Pad with spaces so the data starts 8-byte aligned, as safetensors does. */
	hlen = (strlen(text) + 7) & ~(uint64_t)7;
	f = fopen(path, "wb");
	if (!f) {
		rc = -errno;
		mlens_errf(w->err, w->errlen, "%s: cannot create: %s", path, strerror(-rc));
		goto out;
	}
	setvbuf(f, NULL, _IOFBF, 1 << 20);
	for (int i = 0; i < 8; i++)
		le[i] = (unsigned char)(hlen >> (8 * i));
	rc = -EIO;
	if (fwrite(le, 1, 8, f) != 8 || fputs(text, f) < 0) {
		mlens_errf(w->err, w->errlen, "%s: write failed: %s", path, strerror(errno));
		goto out;
	}
	for (size_t i = strlen(text); i < hlen; i++)
		fputc(' ', f);
	for (int i = 0; i < w->n; i++) {
		if (w->specs[i].shard != shard)
			continue;
		rc = emit_tensor(w, f, path, &w->specs[i]);
		if (rc)
			goto out;
	}
	rc = fclose(f) ? -errno : 0;
	f = NULL;
	if (rc)
		mlens_errf(w->err, w->errlen, "%s: write failed: %s", path, strerror(-rc));
out:
	if (f)
		fclose(f);
	json_decref(meta);
	json_decref(hdr);
	free(text);
	free(path);
	return rc;
}

static int write_json(struct writer *w, const char *fname, json_t *obj)
{
	char *path = mlens_model_path(w->o->dir, fname);
	int rc = 0;

	if (!path || !obj) {
		mlens_errf(w->err, w->errlen, "%s: out of memory", w->o->dir);
		rc = -ENOMEM;
	} else if (json_dump_file(obj, path, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(17))) {
		rc = -EIO;
		mlens_errf(w->err, w->errlen, "%s: cannot write: %s", path, strerror(errno));
	}
	free(path);
	return rc;
}

/* eos_token_id as Hugging Face writes it: one id, a list, or null. */
static json_t *eos_json(const struct mlens_model_config *c)
{
	json_t *a;

	if (c->n_eos == 1)
		return json_integer(c->eos[0]);
	if (c->n_eos <= 0)
		return json_null();
	a = json_array();
	for (int i = 0; a && i < c->n_eos; i++)
		json_array_append_new(a, json_integer(c->eos[i]));
	return a;
}

/* DBRX's nested config.json, as its published files have it. */
static json_t *config_json_dbrx(const struct mlens_model_config *c)
{
	json_t *clip = c->clip_qkv > 0 ? json_real(c->clip_qkv) : json_null();

	/* rope_theta in attn_config as DBRX's files have it, and in
	 * rope_parameters, which transformers 5 reads instead */
	return json_pack("{s:[s], s:{s:f, s:o, s:I, s:f}, s:I, s:o, s:{s:{s:s}, s:I, s:f, s:f, s:I, s:f, s:I}, s:f, s:I, s:s, s:I, s:I, s:{s:s, s:f}, s:b, s:s, s:s, s:b, s:I}",
			 "architectures", "DbrxForCausalLM",
			 "attn_config", "attn_pdrop", 0.0, "clip_qkv", clip,
			 "kv_n_heads", (json_int_t)c->num_key_value_heads,
			 "rope_theta", c->rope_theta,
			 "d_model", (json_int_t)c->hidden_size,
			 "eos_token_id", eos_json(c),
			 "ffn_config", "ffn_act_fn", "name", "silu",
			 "ffn_hidden_size", (json_int_t)c->intermediate_size,
			 "moe_jitter_eps", 0.0, "moe_loss_weight", 0.0,
			 "moe_num_experts", (json_int_t)c->num_local_experts,
			 "moe_normalize_expert_weights", 1.0,
			 "moe_top_k", (json_int_t)c->num_experts_per_tok,
			 "initializer_range", 0.02,
			 "max_seq_len", (json_int_t)c->max_position_embeddings,
			 "model_type", "dbrx",
			 "n_heads", (json_int_t)c->num_attention_heads,
			 "n_layers", (json_int_t)c->num_hidden_layers,
			 "rope_parameters", "rope_type", "default", "rope_theta", c->rope_theta,
			 "tie_word_embeddings", (int)c->tie_word_embeddings,
			 "torch_dtype", dtype_hf(c->dtype),
			 "transformers_version", "4.46.0",
			 "use_cache", 1,
			 "vocab_size", (json_int_t)c->vocab_size);
}

/* mlp_only_layers: the dense layers' indexes. */
static json_t *dense_json(const struct mlens_model_config *c)
{
	json_t *a = json_array();

	for (int64_t l = 0; a && l < c->num_hidden_layers; l++)
		if (c->dense[l])
			json_array_append_new(a, json_integer(l));
	return a;
}

/* config.json as the family's transformers configuration writes it. */
static json_t *config_json(const struct mlens_model_config *c)
{
	const char *arch = c->family->architecture;
	json_t *j;

	if (is_dbrx(c))
		return config_json_dbrx(c);
	j = json_pack("{s:[s], s:f, s:o, s:s, s:I, s:f, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:b, s:s, s:s, s:b, s:I}",
			      "architectures", arch,
			      "attention_dropout", 0.0,
			      "eos_token_id", eos_json(c),
			      "hidden_act", "silu",
			      "hidden_size", (json_int_t)c->hidden_size,
			      "initializer_range", 0.02,
			      "max_position_embeddings", (json_int_t)c->max_position_embeddings,
			      "num_attention_heads", (json_int_t)c->num_attention_heads,
			      "num_experts_per_tok", (json_int_t)c->num_experts_per_tok,
			      "num_hidden_layers", (json_int_t)c->num_hidden_layers,
			      "num_key_value_heads", (json_int_t)c->num_key_value_heads,
			      "rms_norm_eps", c->rms_norm_eps,
			      "rope_theta", c->rope_theta,
			      "tie_word_embeddings", (int)c->tie_word_embeddings,
			      "torch_dtype", dtype_hf(c->dtype),
			      "transformers_version", "4.46.0",
			      "use_cache", 1,
			      "vocab_size", (json_int_t)c->vocab_size);
#define SET(k, v) json_object_set_new(j, k, v)
	if (!j)
		return NULL;
	if (!strcmp(arch, "MixtralForCausalLM")) {
		SET("bos_token_id", json_integer(1));
		SET("head_dim", json_integer(c->head_dim));
		SET("intermediate_size", json_integer(c->intermediate_size));
		SET("model_type", json_string("mixtral"));
		SET("num_local_experts", json_integer(c->num_local_experts));
		SET("output_router_logits", json_false());
		SET("router_aux_loss_coef", json_real(0.02));
		SET("sliding_window", json_null());
		return j;
	}
	SET("num_experts", json_integer(c->num_local_experts));
	SET("norm_topk_prob", json_boolean(!c->topk_raw));
	SET("rope_scaling", json_null());
	SET("output_router_logits", json_false());
	if (!strcmp(arch, "OlmoeForCausalLM")) {
		SET("model_type", json_string("olmoe"));
		SET("intermediate_size", json_integer(c->intermediate_size));
		SET("attention_bias", json_boolean(c->qkv_bias));
		SET("clip_qkv", c->clip_qkv > 0 ? json_real(c->clip_qkv) : json_null());
		return j;
	}
	/* Qwen3-MoE and Qwen2-MoE */
	SET("moe_intermediate_size", json_integer(c->intermediate_size));
	SET("intermediate_size", json_integer(c->dense_inter));
	SET("decoder_sparse_step", json_integer(1));
	SET("mlp_only_layers", dense_json(c));
	SET("use_sliding_window", json_false());
	SET("sliding_window", json_null());
	SET("bos_token_id", json_integer(151643));
	if (!strcmp(arch, "Qwen3MoeForCausalLM")) {
		SET("model_type", json_string("qwen3_moe"));
		SET("head_dim", json_integer(c->head_dim));
		SET("attention_bias", json_boolean(c->qkv_bias));
	} else {
		SET("model_type", json_string("qwen2_moe"));
		SET("shared_expert_intermediate_size", json_integer(c->shared_inter));
		SET("qkv_bias", json_boolean(c->qkv_bias));
	}
#undef SET
	return j;
}

/* quantization_config of fp8 experts, as llm-compressor (compressed-tensors,
 * per-channel) or the block-scaled "fp8" checkpoints write it; attention,
 * router and lm_head stay in the model's dtype. */
static json_t *quant_json(const struct mlens_wscale *k)
{
	if (k->kind == MLENS_WSCALE_BLOCK)
		return json_pack("{s:s, s:s, s:s, s:[i, i], s:[s, s, s]}", "quant_method", "fp8",
				 "activation_scheme", "dynamic", "fmt", "e4m3", "weight_block_size",
				 k->block_rows, k->block_cols, "modules_to_not_convert", "lm_head",
				 "block_sparse_moe.gate", "self_attn");
	return json_pack("{s:s, s:s, s:s, s:{s:{s:[s], s:{s:i, s:s, s:s, s:b, s:b}, s:{s:i, s:s, s:s, s:b, s:b}}}, s:[s, s, s]}",
			 "quant_method", "compressed-tensors", "format", "float-quantized",
			 "quantization_status", "compressed", "config_groups", "group_0", "targets",
			 "Linear", "weights", "num_bits", 8, "type", "float", "strategy", "channel",
			 "symmetric", 1, "dynamic", 0, "input_activations", "num_bits", 8, "type",
			 "float", "strategy", "token", "symmetric", 1, "dynamic", 1, "ignore", "lm_head",
			 "re:.*block_sparse_moe[.]gate$", "re:.*self_attn.*");
}

int mlens_mkmodel_write(const struct mlens_mkmodel_opts *o, char *err, size_t errlen)
{
	struct writer w = { .o = o, .cfg = o->cfg, .err = err, .errlen = errlen };
	json_t *cj = NULL, *index = NULL, *wm;
	char *text = NULL, *stale = NULL;
	struct mlens_model_config check;
	int shards = o->shards > 1 ? o->shards : 1;
	uint64_t total = 0;
	struct stat sb;
	int rc;

	if (!o->dir || !*o->dir) {
		mlens_errf(err, errlen, "no output directory given");
		return -EINVAL;
	}
	if (!w.cfg.family)
		w.cfg.family = mlens_family_find("MixtralForCausalLM");
	if (w.cfg.head_dim == 0 && w.cfg.num_attention_heads > 0) {
		if (w.cfg.hidden_size % w.cfg.num_attention_heads) {
			mlens_errf(err, errlen, "model settings: hidden size %" PRId64 " is not a multiple of %" PRId64 " heads; give the head dimension explicitly",
					 w.cfg.hidden_size, w.cfg.num_attention_heads);
			return -EINVAL;
		}
		w.cfg.head_dim = w.cfg.hidden_size / w.cfg.num_attention_heads;
	}
	/* Validate through the loader's own config parser: what mkmodel writes
	 * is by construction what mlens accepts. */
	cj = config_json(&w.cfg);
	if (cj && o->fp8.kind != MLENS_WSCALE_NONE) {
		if (o->fused_experts) {
			mlens_errf(err, errlen, "fp8 experts are written per expert only (no fused layout)");
			rc = -EINVAL;
			goto out;
		}
		if (strcmp(w.cfg.family->architecture, "MixtralForCausalLM")) {
			/* mlens reads fp8 experts of Mixtral only (mlens_quant_bind) */
			mlens_errf(err, errlen, "fp8 experts are written for Mixtral only; write %s in bf16, fp16 or fp32",
				   w.cfg.family->architecture);
			rc = -EINVAL;
			goto out;
		}
		json_object_set_new(cj, "quantization_config", quant_json(&o->fp8));
	}
	text = cj ? json_dumps(cj, JSON_REAL_PRECISION(17)) : NULL;
	if (!text) {
		mlens_errf(err, errlen, "out of memory");
		rc = -ENOMEM;
		goto out;
	}
	rc = mlens_model_parse_config(text, strlen(text), "model settings", &check, err, errlen);
	if (rc)
		goto out;
	if (check.head_dim != w.cfg.head_dim) {
		/* Qwen2-MoE's, OLMoE's and DBRX's configs have no head_dim:
		 * theirs is hidden size / heads */
		mlens_errf(err, errlen, "model settings: %s has no head_dim of its own; its head dimension is hidden size / heads (%" PRId64 "), not %" PRId64,
			   w.cfg.family->architecture, check.head_dim, w.cfg.head_dim);
		rc = -EINVAL;
		goto out;
	}
	rc = build_specs(&w);
	{
		/* MLENS_MKMODEL_THREADS: for tests (the bytes must not depend on it) */
		const char *env = getenv("MLENS_MKMODEL_THREADS");
		long cpus = env && atoi(env) > 0 ? atoi(env) : sysconf(_SC_NPROCESSORS_ONLN);
		w.threads = cpus < 1 ? 1 : cpus > MAX_FILL_THREADS ? MAX_FILL_THREADS : (int)cpus;
	}
	w.buf = malloc((size_t)w.threads * BATCH_PER_THREAD * CHUNK_ELEMS * sizeof(float));
	if (!rc && w.buf && (rc = mlens_pool_create(&w.pool, w.threads, NULL))) {
		mlens_errf(err, errlen, "cannot start %d threads to draw the values: %s", w.threads,
				 strerror(-rc));
		w.pool = NULL;
		goto out;
	}
	if (rc || !w.buf) {
		mlens_errf(err, errlen, "out of memory");
		rc = -ENOMEM;
		goto out;
	}
	if (shards > w.n) {
		mlens_errf(err, errlen, "%d shards requested but the model has only %d tensors", shards, w.n);
		rc = -EINVAL;
		goto out;
	}
	if (o->tokenizer && w.cfg.vocab_size < MLENS_MKMODEL_TOKENIZER_VOCAB) {
		mlens_errf(err, errlen, "the tokenizer needs a vocabulary of at least %d tokens; the model has %" PRId64,
			   MLENS_MKMODEL_TOKENIZER_VOCAB, w.cfg.vocab_size);
		rc = -EINVAL;
		goto out;
	}
	if (mkdir(o->dir, 0755) < 0 && !(errno == EEXIST && !stat(o->dir, &sb) && S_ISDIR(sb.st_mode))) {
		rc = errno == EEXIST ? -ENOTDIR : -errno;
		mlens_errf(err, errlen, "%s: cannot create directory: %s", o->dir, strerror(-rc));
		goto out;
	}
	rc = write_json(&w, "config.json", cj);
	if (rc)
		goto out;
	if (o->tokenizer && (rc = mlens_mkmodel_write_tokenizer(o->dir, w.cfg.vocab_size, err, errlen)))
		goto out;
	assign_shards(&w, shards);
	/* The loader prefers model.safetensors over an index, as transformers
	 * does: remove the other form left by an earlier run. */
	stale = mlens_model_path(o->dir, shards > 1 ? "model.safetensors" : "model.safetensors.index.json");
	if (stale && unlink(stale) < 0 && errno != ENOENT) {
		rc = -errno;
		mlens_errf(err, errlen, "%s: cannot remove stale file: %s", stale, strerror(-rc));
		goto out;
	}
	if (shards == 1) {
		rc = write_shard(&w, 0, "model.safetensors");
		goto out;
	}
	index = json_object();
	wm = json_object();
	if (!index || !wm) {
		json_decref(wm);
		rc = -ENOMEM;
		mlens_errf(err, errlen, "out of memory");
		goto out;
	}
	json_object_set_new(index, "weight_map", wm);
	for (int s = 0; s < shards && !rc; s++) {
		char fname[64];

		snprintf(fname, sizeof(fname), "model-%05d-of-%05d.safetensors", s + 1, shards);
		for (int i = 0; i < w.n; i++) {
			if (w.specs[i].shard == s) {
				json_object_set_new(wm, w.specs[i].name, json_string(fname));
				total += w.specs[i].nbytes;
			}
		}
		rc = write_shard(&w, s, fname);
	}
	if (rc)
		goto out;
	json_object_set_new(index, "metadata", json_pack("{s:I}", "total_size", (json_int_t)total));
	rc = write_json(&w, "model.safetensors.index.json", index);
out:
	json_decref(index);
	json_decref(cj);
	free(text);
	free(stale);
	free(w.specs);
	free(w.buf);
	if (w.pool)
		mlens_pool_destroy(w.pool);
	return rc;
}
