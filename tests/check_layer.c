/* Description: the one decoder layer (daemon/exec/layer.h) on the CPU backend:
 * the whole forward equals its parts run apart as the hybrid pipeline
 * runs them (GA and GB in two row groups, the experts one row a call), bit
 * for bit, with every op of it seen by the probe, for Mixtral and for a
 * layer of each other family (a dense one too); the model's head gives
 * the same tokens and logits in one chunk as row by row; bind and unbind
 * place every tensor once and give each back. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "daemon/exec/kv_pool.h"
#include "daemon/exec/layer.h"
#include "daemon/tools/mkmodel.h"
#include "tests/testmodel.h"

#define N 11	/* rows: one sequence at positions 0..N-1 */
#define SPLIT 4	/* the first group's rows */

/* A placer over the backend that counts what it places and gives back. */
struct counting {
	struct mlens_backend *be;
	int placed, given_back;
	size_t bytes;
};

static const void *count_place(void *arg, const void *host, size_t bytes, int *rc)
{
	struct counting *c = arg;
	const void *p = mlens_backend_place(c->be, host, bytes, rc);
	if (!*rc) {
		c->placed++;
		c->bytes += bytes;
	}
	return p;
}

static void count_unplace(void *arg, const void *p, size_t bytes)
{
	struct counting *c = arg;
	if (p) {
		c->given_back++;
		c->bytes -= bytes;
	}
	mlens_backend_unplace(c->be, p);
}

static int op_seen[MLENS_LAYER_OP_N];

static void probe_begin(void *arg)
{
	(void)arg;
}

static int probe_end(void *arg, enum mlens_layer_op op, double flops)
{
	(void)arg;
	(void)flops;
	op_seen[op]++;
	return 0;
}

struct fx {
	struct mlens_model *m;
	char dir[64];		/* a family's model written by mlens-mkmodel, or "" */
	int layer;		/* the layer bound */
	struct mlens_backend be;
	struct mlens_layer_desc d;
	struct mlens_layer_bound b;
	struct mlens_ends_bound ends;
	struct counting cnt;
	struct mlens_layer_placer pl;
	struct mlens_kv_pool kv[2];
	int32_t pos[N];
	int64_t slots[N];
	uint32_t table[N];
	struct mlens_attn_query qry[N];
};

static void fx_bind(struct fx *f)
{
	struct mlens_backend_opts bo = { .n_threads = 2 };
	struct mlens_kv_cache layout;
	char err[128];

	ck_assert_int_eq(mlens_backend_cpu_create(&f->be, &bo), 0);
	mlens_layer_desc_init(&f->d, &f->m->cfg);
	f->cnt.be = &f->be;
	f->pl = (struct mlens_layer_placer){ count_place, count_unplace, &f->cnt };
	ck_assert_int_eq(mlens_layer_bind(&f->b, &f->m->layers[f->layer], &f->d, f->d.n_experts,
					  &f->pl), 0);
	ck_assert_int_eq(mlens_ends_bind(&f->ends, f->m, &f->pl), 0);
	ck_assert_int_eq(mlens_kv_layout(&layout, &f->m->cfg, -1, 1, N, err, sizeof(err)), 0);
	for (int i = 0; i < 2; i++)
		ck_assert_int_eq(mlens_kv_pool_init(&f->kv[i], &f->be, &layout, NULL, NULL), 0);
	for (int i = 0; i < N; i++) {
		f->pos[i] = i;
		f->slots[i] = i;	/* blocks of one token, the table in order */
		f->table[i] = (uint32_t)i;
		f->qry[i] = (struct mlens_attn_query){ i + 1, N, f->table };
	}
}

static void fx_open(struct fx *f, enum mlens_dtype dt)
{
	struct mlens_test_spec s = mlens_test_spec_tiny();

	memset(f, 0, sizeof(*f));
	s.dtype = dt;
	f->m = mlens_test_model_new(&s);
	fx_bind(f);
}

/* Layer `layer` of a family's tiny model as mlens-mkmodel writes it. */
static void fx_open_family(struct fx *f, const char *preset, int layer)
{
	struct mlens_mkmodel_opts o = { .seed = 11, .shards = 1 };
	char err[512];

	memset(f, 0, sizeof(*f));
	snprintf(f->dir, sizeof(f->dir), "/tmp/check_layer.XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(f->dir));
	ck_assert_int_eq(mlens_mkmodel_preset(&o, preset), 0);
	o.dir = f->dir;
	ck_assert_msg(mlens_mkmodel_write(&o, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(mlens_model_open(f->dir, &f->m, err, sizeof(err)) == 0, "%s", err);
	f->layer = layer;
	fx_bind(f);
}

static void fx_close(struct fx *f)
{
	for (int i = 0; i < 2; i++)
		mlens_kv_pool_fini(&f->kv[i]);
	mlens_ends_unbind(&f->ends, f->m, &f->pl);
	mlens_layer_unbind(&f->b, &f->m->layers[f->layer], &f->d, f->d.n_experts, &f->pl);
	mlens_backend_destroy(&f->be);
	if (!f->dir[0]) {
		mlens_test_model_free(f->m);
		return;
	}
	mlens_model_close(f->m);
	for (const char *const *n = (const char *const[]){ "config.json", "generation_config.json",
							  "model.safetensors", NULL }; *n; n++) {
		char p[128];
		snprintf(p, sizeof(p), "%s/%s", f->dir, *n);
		unlink(p);
	}
	ck_assert_int_eq(rmdir(f->dir), 0);
}

static float *rows(size_t n, size_t cols)
{
	float *p = calloc(n * cols, sizeof(float));
	ck_assert_ptr_nonnull(p);
	return p;
}

static struct mlens_layer_act act_new(const struct mlens_layer_desc *d)
{
	struct mlens_layer_act a = {
		rows(N, (size_t)d->hidden), rows(N, (size_t)d->hidden),
		rows(N, (size_t)mlens_layer_qdim(d)), rows(N, (size_t)mlens_layer_kvdim(d)),
		rows(N, (size_t)mlens_layer_kvdim(d)), rows(N, (size_t)mlens_layer_qdim(d)),
		rows(N, (size_t)d->n_experts), rows(N, (size_t)d->top_k), NULL
	};
	a.rid = calloc((size_t)N * (size_t)d->top_k, sizeof(int32_t));
	ck_assert_ptr_nonnull(a.rid);
	return a;
}

static void act_free(struct mlens_layer_act *a)
{
	free(a->x);
	free(a->xn);
	free(a->q);
	free(a->k);
	free(a->v);
	free(a->att);
	free(a->rlog);
	free(a->rw);
	free(a->rid);
}

/* The whole forward of f's layer (every row reading the cache, as the
 * engine's CPU default) into w and its parts apart (GA in two row groups,
 * the attention over all rows, GB per group with one row a MoE call) into
 * s, from the same x; the whole run's op counts into op_seen. */
static void whole_and_parts(struct fx *pf, struct mlens_layer_act *pw, struct mlens_layer_act *ps)
{
	const struct mlens_layer_probe probe = { probe_begin, probe_end, NULL };
	struct fx f = *pf;
	struct mlens_layer_act w, s;
	size_t H, qd, kvd;

	H = (size_t)f.d.hidden;
	qd = (size_t)mlens_layer_qdim(&f.d);
	kvd = (size_t)mlens_layer_kvdim(&f.d);
	w = act_new(&f.d);
	s = act_new(&f.d);
	for (size_t i = 0; i < N * H; i++)
		w.x[i] = s.x[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
	{
		/* whole: every row reads the cache (as the engine's CPU default) */
		const struct mlens_layer_run r = { &f.be, &f.d, &probe };
		const struct mlens_layer_rows rr = { .n = N, .pos = f.pos, .slots = f.slots,
						     .qry = f.qry };
		memset(op_seen, 0, sizeof(op_seen));
		ck_assert_int_eq(mlens_layer_forward(&r, &f.b, &f.kv[0].cache, 0, &w, &rr), 0);
	}
	{
		/* apart: GA per group, the attention over all rows, GB per group
		 * with one row a MoE call */
		const struct mlens_layer_run r = { &f.be, &f.d, NULL };
		const int g0[2] = { 0, SPLIT }, gn[2] = { SPLIT, N - SPLIT };
		for (int g = 0; g < 2; g++) {
			size_t o = (size_t)g0[g];
			ck_assert_int_eq(mlens_layer_attn_in(&r, &f.b, s.x + o * H, s.xn + o * H,
							     s.q + o * qd, s.k + o * kvd, s.v + o * kvd,
							     f.pos + o, gn[g]), 0);
		}
		ck_assert_int_eq(f.be.ops->kv_append(f.be.ctx, &f.kv[1].cache, 0, s.k, s.v, f.slots, N),
				 0);
		ck_assert_int_eq(mlens_layer_attn_decode(&r, s.att, s.q, &f.kv[1].cache, 0, f.qry, N),
				 0);
		for (int g = 0; g < 2; g++) {
			size_t o = (size_t)g0[g], K = (size_t)f.d.top_k;
			ck_assert_int_eq(mlens_layer_gb(&r, &f.b, s.x + o * H, s.att + o * qd, false,
							s.xn + o * H, s.rlog + o * (size_t)f.d.n_experts,
							s.rid + o * K, s.rw + o * K, gn[g], 1), 0);
		}
	}
	ck_assert_mem_eq(w.x, s.x, N * H * sizeof(float));
	ck_assert_mem_eq(w.att, s.att, N * qd * sizeof(float));
	ck_assert_mem_eq(w.rid, s.rid, N * (size_t)f.d.top_k * sizeof(int32_t));
	*pw = w;
	*ps = s;
}

START_TEST(forward_equals_its_parts)
{
	static const enum mlens_dtype dts[2] = { MLENS_DTYPE_F32, MLENS_DTYPE_BF16 };
	struct fx f;
	struct mlens_layer_act w, s;

	fx_open(&f, dts[_i]);
	whole_and_parts(&f, &w, &s);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_NORM], 2);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_QKV], 1);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_ROPE], 2);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_KV_APPEND], 1);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_PREFILL], 0);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_DECODE], 1);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_WO], 1);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_ROUTER], 2);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_MOE], 1);
	{
		/* the head: one chunk (the engine) and a row a chunk (the
		 * pipeline's chunks) give the same tokens and logits */
		const struct mlens_layer_run r = { &f.be, &f.d, NULL };
		int V = (int)f.m->cfg.vocab_size;
		const int32_t lrow[3] = { 1, 2, N - 1 };
		struct mlens_sampling samp[3] = { { .temperature = 0 }, { .temperature = 0.8f,
			.top_k = 5, .top_p = 1, .seed = 7, .counter = 3 }, { .temperature = 0 } };
		int32_t tok[2][3];
		float lp[2][3], *lg = rows(3, (size_t)V), *hl[2] = { rows(3, (size_t)V), rows(3, (size_t)V) };
		for (int c = 0; c < 2; c++)
			ck_assert_int_eq(mlens_ends_logits(&r, &f.ends, V, w.x, s.xn, lg, lrow, 3,
							   c ? 1 : 0, samp, tok[c], lp[c], hl[c]), 0);
		ck_assert_mem_eq(tok[0], tok[1], sizeof(tok[0]));
		ck_assert_mem_eq(lp[0], lp[1], sizeof(lp[0]));
		ck_assert_mem_eq(hl[0], hl[1], 3 * (size_t)V * sizeof(float));
		for (int i = 0; i < 3; i++)
			ck_assert(tok[0][i] >= 0 && tok[0][i] < V);
		free(lg);
		free(hl[0]);
		free(hl[1]);
	}
	act_free(&w);
	act_free(&s);
	fx_close(&f);
}
END_TEST

/* The families' layers, whole and apart, bit for bit, each family step
 * seen: q/k norms (NORM), biases and clip (QKV), the one-expert route and
 * its SwiGLU (ROUTER, MOE); a dense layer routes nothing. */
START_TEST(family_forward_equals_its_parts)
{
	static const struct {
		const char *preset;
		int layer, norm, qkv, wo, router, moe;
	} c[] = {
		{ "qwen3-tiny", 0, 4, 1, 1, 2, 1 },	/* per-head q/k norm */
		{ "qwen3-tiny", 1, 4, 1, 1, 1, 1 },	/* the dense layer */
		{ "qwen2-tiny", 1, 2, 4, 1, 4, 2 },	/* q/k/v biases, shared expert */
		{ "olmoe-tiny", 1, 4, 1, 1, 2, 1 },	/* q/k norm over the projection */
	};
	struct fx f;
	struct mlens_layer_act w, s;

	fx_open_family(&f, c[_i].preset, c[_i].layer);
	whole_and_parts(&f, &w, &s);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_NORM], c[_i].norm);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_QKV], c[_i].qkv);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_WO], c[_i].wo);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_ROUTER], c[_i].router);
	ck_assert_int_eq(op_seen[MLENS_LAYER_OP_MOE], c[_i].moe);
	act_free(&w);
	act_free(&s);
	fx_close(&f);
}
END_TEST

START_TEST(bind_places_and_gives_back)
{
	struct fx f;
	/* 7 tensors and 3 a expert; the ends 3 (lm_head not tied) */
	int want = 7 + 3 * 4 + 3;

	fx_open(&f, MLENS_DTYPE_BF16);
	ck_assert_int_eq(f.cnt.placed, want);
	ck_assert_ptr_eq(f.b.moe.w1, f.b.w1);
	ck_assert_int_eq(f.b.moe.n_experts, f.d.n_experts);
	ck_assert_int_eq(f.b.moe.inter, f.d.inter);
	ck_assert_uint_gt(f.cnt.bytes, 0);
	fx_close(&f);
	ck_assert_int_eq(f.cnt.given_back, want);
	ck_assert_uint_eq(f.cnt.bytes, 0);
}
END_TEST

START_TEST(bind_resident_experts_only)
{
	struct fx f;
	struct mlens_layer_bound b;

	fx_open(&f, MLENS_DTYPE_F32);
	f.cnt.placed = f.cnt.given_back = 0;
	ck_assert_int_eq(mlens_layer_bind(&b, &f.m->layers[1], &f.d, 1, &f.pl), 0);
	ck_assert_int_eq(f.cnt.placed, 7 + 3);
	ck_assert_ptr_nonnull(b.w2[0]);
	ck_assert_ptr_null(b.w1[1]);	/* left for a streamed slot */
	ck_assert_ptr_null(b.w3[f.d.n_experts - 1]);
	mlens_layer_unbind(&b, &f.m->layers[1], &f.d, 1, &f.pl);
	ck_assert_int_eq(f.cnt.given_back, 7 + 3);
	ck_assert_ptr_null(b.w1);
	fx_close(&f);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("layer");
	TCase *tc = tcase_create("layer");
	SRunner *sr;
	int failed;

	tcase_add_loop_test(tc, forward_equals_its_parts, 0, 2);
	tcase_add_loop_test(tc, family_forward_equals_its_parts, 0, 4);
	tcase_add_test(tc, bind_places_and_gives_back);
	tcase_add_test(tc, bind_resident_experts_only);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}
