/* The pipeline profiler: timing of one layer's GA and GB ops, GEMM rate,
 * pinned copies, CPU decode attention and memory reads through the real
 * backends; the JSON cache; the daemon's profile state (prediction, n_real,
 * the scheduler's cap). What is measured and why is in profiler.h. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "daemon/errf.h"
#include "daemon/plan/gpu_plan.h"
#include "daemon/exec/layer.h"
#include "daemon/plan/profiler.h"
#include "daemon/serve/sched.h"
#include "kernels/cpu/pool.h"
#include "kernels/cpu/readbw.h"
#include "daemon/model/disk_tier.h"

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng_next(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

static float rng_f(uint64_t *s)	/* [-1, 1) */
{
	return (float)((rng_next(s) >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

/* ==== one layer on the backend ==== */

struct layer {
	struct mlens_backend *be;
	const struct mlens_model_config *c;
	const struct mlens_layer_weights *w;	/* the model's layer 0 */
	struct mlens_layer_desc d;
	struct mlens_layer_placer pl;
	struct mlens_layer_run run;
	struct mlens_layer_bound b;
	bool bound;
	float *x, *xn, *q, *k, *v, *att, *rlog, *rw, *gout;
	int32_t *rid, *pos;
	int64_t n;		/* rows allocated */
	int qd, kvd;
	int64_t group, moe_chunk;	/* struct mlens_profile_opts */
	const void *gemm_w;	/* the timed GEMM's weight: expert 0's w1, or (fp8
				 * experts) a dequantized copy of it, placed */
	bool gemm_own;		/* gemm_w is that copy */
	void *gemm_host;	/* its host copy when the backend reads it there */
};

static void *act(struct layer *L, size_t bytes, int *rc)
{
	void *p;
	if (*rc)
		return NULL;
	p = L->be->ops->alloc(L->be->ctx, bytes ? bytes : 1);
	if (!p)
		*rc = -ENOMEM;
	return p;
}

static void layer_free(struct layer *L)
{
	void *acts[] = { L->x, L->xn, L->q, L->k, L->v, L->att, L->rlog, L->rw, L->gout, L->rid };
	for (size_t i = 0; i < sizeof(acts) / sizeof(acts[0]); i++)
		if (acts[i])
			L->be->ops->free(L->be->ctx, acts[i]);
	if (L->bound)
		mlens_layer_unbind(&L->b, L->w, &L->d, L->d.n_experts, &L->pl);
	if (L->gemm_own)
		L->pl.unplace(L->pl.arg, L->gemm_w, 0);
	free(L->gemm_host);
	free(L->pos);
}

/* The timed GEMM's weight in the model's dtype: fp8 experts' w1 of
 * expert 0 dequantized (the GEMM op takes no scales). */
static const void *gemm_weight(struct layer *L, int *rc)
{
	const struct mlens_model_config *c = L->c;
	int64_t I = c->intermediate_size, H = c->hidden_size;
	size_t bytes = (size_t)(I * H) * mlens_dtype_size(c->dtype);
	const void *p;
	void *h;

	if (*rc || L->d.expert_dtype != MLENS_DTYPE_E4M3)
		return *rc ? NULL : L->b.w1[0];
	if (!(h = malloc(bytes))) {
		*rc = -ENOMEM;
		return NULL;
	}
	for (int64_t r = 0; r < I; r++)
		for (int64_t k = 0; k < H; k++)
			mlens_store(h, c->dtype, (size_t)(r * H + k),
				    mlens_load(L->w->w1[0], MLENS_DTYPE_E4M3, (size_t)(r * H + k)) *
					    mlens_wscale_at(&L->d.expert_scale, L->w->s1[0], r, k, H));
	p = L->pl.place(L->pl.arg, h, bytes, rc);
	L->gemm_own = p != NULL;
	/* a host-memory backend reads the host copy itself: keep it */
	if (p == h)
		L->gemm_host = h;
	else
		free(h);
	return p;
}

/* Random rows [n][cols] into backend memory dst. */
static int fill_random(struct layer *L, float *dst, int64_t n, int cols, uint64_t *seed)
{
	size_t cnt = (size_t)n * (size_t)cols;
	float *h = malloc(cnt * sizeof(float));
	int rc;
	if (!h)
		return -ENOMEM;
	for (size_t i = 0; i < cnt; i++)
		h[i] = rng_f(seed);
	rc = L->be->ops->upload(L->be->ctx, dst, h, cnt * sizeof(float));
	free(h);
	return rc;
}

static int layer_init(struct layer *L, const struct mlens_model *m, struct mlens_backend *be, int64_t n)
{
	const struct mlens_model_config *c = &m->cfg;
	size_t H = (size_t)c->hidden_size, E = (size_t)c->num_local_experts, K = (size_t)c->num_experts_per_tok;
	uint64_t seed = 0x9e3779b97f4a7c15ull;
	int64_t first = 0;
	int rc = 0;
	memset(L, 0, sizeof(*L));
	L->be = be;
	L->c = c;
	/* the first layer with routed experts (a family may open with dense ones) */
	while (first < c->num_hidden_layers - 1 && !m->layers[first].router)
		first++;
	L->w = &m->layers[first];
	L->n = n;
	mlens_layer_desc_init(&L->d, c);
	L->pl = mlens_layer_placer_backend(be);
	L->run = (struct mlens_layer_run){ be, &L->d, NULL };
	L->qd = mlens_layer_qdim(&L->d);
	L->kvd = mlens_layer_kvdim(&L->d);
	L->pos = malloc((size_t)n * sizeof(int32_t));
	if (!L->pos)
		return -ENOMEM;
	L->bound = true;
	rc = mlens_layer_bind(&L->b, L->w, &L->d, L->d.n_experts, &L->pl);
	L->x = act(L, (size_t)n * H * 4, &rc);
	L->xn = act(L, (size_t)n * H * 4, &rc);
	L->gout = act(L, (size_t)n * (size_t)c->intermediate_size * 4, &rc);
	L->q = act(L, (size_t)n * (size_t)L->qd * 4, &rc);
	L->att = act(L, (size_t)n * (size_t)L->qd * 4, &rc);
	L->k = act(L, (size_t)n * (size_t)L->kvd * 4, &rc);
	L->v = act(L, (size_t)n * (size_t)L->kvd * 4, &rc);
	L->rlog = act(L, (size_t)n * E * 4, &rc);
	L->rw = act(L, (size_t)n * K * 4, &rc);
	L->rid = act(L, (size_t)n * K * 4, &rc);
	L->gemm_w = gemm_weight(L, &rc);
	if (rc)
		return rc;
	for (int64_t i = 0; i < n; i++)
		L->pos[i] = (int32_t)(i % (c->max_position_embeddings > 0 ? c->max_position_embeddings : 1));
	if ((rc = fill_random(L, L->x, n, (int)H, &seed)) || (rc = fill_random(L, L->att, n, L->qd, &seed)))
		return rc;
	return 0;
}

/* GA of n tokens: what the engine runs before attention. */
static int run_ga_rows(struct layer *L, int r0, int n)
{
	size_t r = (size_t)r0, H = (size_t)L->d.hidden;
	return mlens_layer_attn_in(&L->run, &L->b, L->x + r * H, L->xn + r * H, L->q + r * L->qd,
				   L->k + r * L->kvd, L->v + r * L->kvd, L->pos + r, n);
}

/* GB of rows [r0, r0+n): after attention, through the experts, into the
 * residual x as the engine does (its norm keeps the expert inputs bounded
 * however often the profile repeats it). */
static int run_gb_rows(struct layer *L, int r0, int n)
{
	size_t r = (size_t)r0, H = (size_t)L->d.hidden, E = (size_t)L->d.n_experts;
	size_t K = (size_t)L->d.top_k;
	int chunk = L->moe_chunk > 0 && L->moe_chunk < n ? (int)L->moe_chunk : n;
	return mlens_layer_gb(&L->run, &L->b, L->x + r * H, L->att + r * L->qd, false,
			      L->xn + r * H, L->rlog + r * E, L->rid + r * K, L->rw + r * K, n, chunk);
}

/* GA or GB of n tokens, in groups as the caller asked (struct
 * mlens_profile_opts: the hybrid pipeline's groups and MoE chunks). */
static int run_grouped(struct layer *L, int n, int (*rows)(struct layer *, int, int))
{
	int g = L->group > 0 && L->group < n ? (int)L->group : n, rc;
	for (int r = 0; r < n; r += g)
		if ((rc = rows(L, r, n - r < g ? n - r : g)))
			return rc;
	return 0;
}

enum which { W_GA, W_GB, W_GEMM, W_GEMM_FP8 };

static int run_one(struct layer *L, enum which w, int n)
{
	const struct mlens_model_config *c = L->c;
	switch (w) {
	case W_GA: return run_grouped(L, n, run_ga_rows);
	case W_GB: return run_grouped(L, n, run_gb_rows);
	case W_GEMM:
		return L->be->ops->gemm(L->be->ctx, L->gout, L->x, L->gemm_w, c->dtype, n, (int)c->hidden_size,
					(int)c->intermediate_size, false);
	case W_GEMM_FP8:
		/* every token routed to expert 0 (fp8_rows): its three GEMMs
		 * through the MoE op, as the experts run */
		return L->be->ops->moe(L->be->ctx, L->xn, L->x, n, L->rid, L->rw, 1, &L->b.moe);
	}
	return -EINVAL;
}

/* Whether the experts multiply on fp8 tensor cores (backend op fp8_tc,
 * per-channel scales): then the GEMM rate is theirs, timed through the
 * MoE op, as the GEMM op takes no fp8 weights. */
static bool fp8_tc(const struct layer *L)
{
	return L->d.expert_dtype == MLENS_DTYPE_E4M3 && L->d.expert_scale.kind != MLENS_WSCALE_BLOCK &&
	       L->be->ops->fp8_tc && L->be->ops->fp8_tc(L->be->ctx);
}

/* Route n rows to expert 0 with weight 1 (ids in rid, weights in rw). */
static int fp8_rows(struct layer *L, int n)
{
	int32_t *ids = calloc((size_t)n, sizeof(*ids));
	float *w = malloc((size_t)n * sizeof(*w));
	int rc = -ENOMEM;

	if (ids && w) {
		for (int i = 0; i < n; i++)
			w[i] = 1.0f;
		rc = L->be->ops->upload(L->be->ctx, L->rid, ids, (size_t)n * sizeof(*ids));
		if (!rc)
			rc = L->be->ops->upload(L->be->ctx, L->rw, w, (size_t)n * sizeof(*w));
	}
	free(ids);
	free(w);
	return rc;
}

/* Best of reps runs (after one warm-up) in seconds. */
static int time_best(struct layer *L, enum which w, int n, int reps, double *best)
{
	int rc;
	*best = INFINITY;
	if ((rc = run_one(L, w, n)) || (rc = L->be->ops->sync(L->be->ctx)))
		return rc;
	for (int r = 0; r < reps; r++) {
		double t0 = now(), t;
		if ((rc = run_one(L, w, n)) || (rc = L->be->ops->sync(L->be->ctx)))
			return rc;
		t = now() - t0;
		if (t < *best)
			*best = t;
	}
	return 0;
}

#define REPS 3

/* FLOP/s of prefill attention over n tokens (the GA rows' q, k, v) as
 * prompts of MLENS_PROFILE_PROMPT tokens, counted as the model counts it
 * (4 q-dims per causal (query, key) pair); 0 when the backend has no
 * prefill attention for this model's heads. */
static int time_prefill_attn(struct layer *L, int64_t n, double *flops)
{
	int64_t seg = n < MLENS_PROFILE_PROMPT ? n : MLENS_PROFILE_PROMPT, nseq = n / seg;
	int rc = 0;
	int32_t *cu = malloc((size_t)(nseq + 1) * sizeof(*cu));
	double pairs = (double)nseq * (double)seg * (double)(seg + 1) / 2, best = INFINITY;

	*flops = 0;
	if (!cu)
		return -ENOMEM;
	for (int64_t i = 0; i <= nseq; i++)
		cu[i] = (int32_t)(i * seg);
	for (int r = 0; r < REPS + 1 && !rc; r++) {
		double t0 = now();
		rc = mlens_layer_attn_prefill(&L->run, L->att, L->q, L->k, L->v, cu, (int)nseq);
		if (!rc)
			rc = L->be->ops->sync(L->be->ctx);
		if (!rc && r && now() - t0 < best)
			best = now() - t0;
	}
	free(cu);
	if (rc == -ENOTSUP)
		return 0;	/* the pipeline runs it on the CPU then */
	if (!rc)
		*flops = 4.0 * (double)L->qd * pairs / best;
	return rc;
}

static void origin_line(const double *x, const double *y, int n, struct mlens_perf_line *l)
{
	double sxx = 0, sxy = 0;
	for (int i = 0; i < n; i++) {
		sxx += x[i] * x[i];
		sxy += x[i] * y[i];
	}
	l->a = 0;
	l->b = sxx > 0 ? sxy / sxx : 0;
}

static int profile_layer(const struct mlens_model *m, const struct mlens_profile_opts *o, double budget,
			 struct mlens_profile *p, char *err, size_t errlen)
{
	struct layer L;
	int64_t nmax = o->max_tokens > 0 ? o->max_tokens : 4096, n = 8, top;
	double t, per_point = budget / (2.0 * MLENS_PROFILE_POINTS * (REPS + 1));
	double xs[MLENS_PROFILE_POINTS];
	int rc;
	if (nmax < 2 * MLENS_PROFILE_POINTS)
		nmax = 2 * MLENS_PROFILE_POINTS;
	rc = layer_init(&L, m, o->be, nmax);
	L.group = o->group;
	L.moe_chunk = o->moe_chunk;
	if (rc) {
		mlens_errf(err, errlen, "profiler: cannot place one layer and %lld tokens of activations on the %s "
		       "backend: %s (profile at start-up, profile = true, before the engine takes the memory)",
		       (long long)nmax, o->be->ops->name, strerror(-rc));
		goto out;
	}
	/* the largest token count whose GA+GB fits a point's share of the budget */
	top = n;
	for (;;) {
		double ta, tb;
		if ((rc = time_best(&L, W_GA, (int)n, 1, &ta)) || (rc = time_best(&L, W_GB, (int)n, 1, &tb)))
			goto op_fail;
		top = n;
		if (n >= nmax || 2 * (ta + tb) > per_point)
			break;
		n = 2 * n < nmax ? 2 * n : nmax;
	}
	if (top < MLENS_PROFILE_POINTS)
		top = MLENS_PROFILE_POINTS;
	/* evenly spread points: the line is fitted where the pipeline runs */
	p->n_points = MLENS_PROFILE_POINTS;
	for (int i = 0; i < MLENS_PROFILE_POINTS; i++) {
		int64_t k = top * (i + 1) / MLENS_PROFILE_POINTS;
		p->tokens[i] = k;
		xs[i] = (double)k;
		if ((rc = time_best(&L, W_GA, (int)k, REPS, &p->ga_s[i])) ||
		    (rc = time_best(&L, W_GB, (int)k, REPS, &p->gb_s[i])))
			goto op_fail;
	}
	if ((rc = mlens_perf_fit_line(xs, p->ga_s, p->n_points, &p->ga)) ||
	    (rc = mlens_perf_fit_line(xs, p->gb_s, p->n_points, &p->gb))) {
		mlens_errf(err, errlen, "profiler: the GA/GB timings cannot be fitted");
		goto out;
	}
	/* timings that do not grow with the token count (a small model on a
	 * busy machine: noise above the work) fit a slope at or below zero,
	 * which predicts nothing; then that line through the origin (times
	 * are positive, so its slope is too): for GA or GB alone when its
	 * slope is, for both when their intercepts sum below zero */
	if (p->ga.a + p->gb.a < 0) {
		origin_line(xs, p->ga_s, p->n_points, &p->ga);
		origin_line(xs, p->gb_s, p->n_points, &p->gb);
	}
	if (!(p->ga.b > 0))
		origin_line(xs, p->ga_s, p->n_points, &p->ga);
	if (!(p->gb.b > 0))
		origin_line(xs, p->gb_s, p->n_points, &p->gb);
	/* the experts' GEMM rate: of their dtype (fp8 on fp8 tensor cores:
	 * gate, up and down of one expert through the MoE op) */
	if (fp8_tc(&L)) {
		if ((rc = fp8_rows(&L, (int)top)) || (rc = time_best(&L, W_GEMM_FP8, (int)top, REPS, &t)))
			goto op_fail;
		t /= 3;
	} else if ((rc = time_best(&L, W_GEMM, (int)top, REPS, &t))) {
		goto op_fail;
	}
	p->gemm_flops = 2.0 * (double)top * (double)m->cfg.hidden_size * (double)m->cfg.intermediate_size / t;
	if ((rc = time_prefill_attn(&L, top, &p->attn_prefill_flops)))
		goto op_fail;
	goto out;
op_fail:
	mlens_errf(err, errlen, "profiler: a %s backend op failed: %s", o->be->ops->name, strerror(-rc));
out:
	layer_free(&L);
	return rc;
}

/* A one-layer KV cache of the model's heads and the options' dtype and
 * block size (16 unless set), no blocks or memory yet: the tests' pools. */
static void test_kv(struct mlens_kv_cache *kv, const struct mlens_model_config *c,
		    const struct mlens_profile_opts *o)
{
	/* the daemon's dtype (never F16); the caller sizes n_blocks */
	mlens_kv_layout(kv, c, (int)o->kv_dtype, o->kv_block_size, 1, NULL, 0);
	kv->n_layers = 1;
}

/* slots[rows]: rows in the blocks they fill, the blocks drawn without
 * repeats from all of kv's (the first places of a Fisher-Yates shuffle),
 * a block's rows in order: a prompt's rows fill their blocks, a
 * long-running pool hands blocks out in no order. -ENOMEM or 0. */
static int random_slots(const struct mlens_kv_cache *kv, int rows, uint64_t seed, int64_t *slots)
{
	uint32_t nb = kv->n_blocks, need = (uint32_t)((rows + kv->block_size - 1) / kv->block_size);
	uint32_t *perm = malloc((size_t)nb * sizeof(*perm));
	if (!perm)
		return -ENOMEM;
	for (uint32_t b = 0; b < nb; b++)
		perm[b] = b;
	for (uint32_t b = 0; b < need && b < nb - 1; b++) {
		uint32_t j = b + (uint32_t)(rng_next(&seed) % (nb - b)), t = perm[b];
		perm[b] = perm[j];
		perm[j] = t;
	}
	for (int i = 0; i < rows; i++)
		slots[i] = (int64_t)perm[i / kv->block_size] * kv->block_size + i % kv->block_size;
	free(perm);
	return 0;
}

/* ==== pinned copies ==== */

/* Whether be is a device backend that can stream pinned copies beside a
 * CPU measurement, and how many bytes a copy moves there. */
static bool can_copy(const struct mlens_backend *be)
{
	const struct mlens_backend_ops *o = be->ops;
	return !o->host_memory && MLENS_BACKEND_HAS(o, host_alloc) && MLENS_BACKEND_HAS(o, copy_async) &&
	       MLENS_BACKEND_HAS(o, event_record) && MLENS_BACKEND_HAS(o, event_sync);
}

static size_t copy_bytes(double budget)
{
	return budget >= 5 ? 256u << 20 : 32u << 20;
}

static int profile_copies(struct mlens_backend *be, double budget, struct mlens_profile *p,
			  char *err, size_t errlen)
{
	const struct mlens_backend_ops *o = be->ops;
	size_t bytes = copy_bytes(budget);
	void *h = NULL, *d = NULL;
	int rc = 0;
	if (!can_copy(be))
		return 0;	/* nothing crosses a bus */
	h = o->host_alloc(be->ctx, bytes);
	d = o->alloc(be->ctx, bytes);
	if (!h || !d) {
		rc = -ENOMEM;
		mlens_errf(err, errlen, "profiler: cannot allocate %zu MiB of pinned and %s memory for the copy test",
		       bytes >> 20, o->name);
		goto out;
	}
	memset(h, 1, bytes);
	/* the copy queue (the weight stream's), then the compute queue (the
	 * pipeline's activations), each way */
	for (int k = 0; k < 4; k++) {
		int queue = k < 2 ? 1 : 0, dir = k % 2;
		double best = INFINITY, rate;
		for (int r = 0; r < REPS + 1; r++) {
			double t0 = now(), t;
			/* the last event: the pipeline records it only right before
			 * waiting on it, so no step's ordering depends on it */
			if ((rc = o->copy_async(be->ctx, queue, dir ? h : d, dir ? d : h, bytes, !dir)) ||
			    (rc = o->event_record(be->ctx, queue, MLENS_BACKEND_EVENTS - 1)) ||
			    (rc = o->event_sync(be->ctx, MLENS_BACKEND_EVENTS - 1))) {
				mlens_errf(err, errlen, "profiler: a pinned copy failed: %s", strerror(-rc));
				goto out;
			}
			t = now() - t0;
			if (r && t < best)
				best = t;
		}
		rate = (double)bytes / best;
		*(queue ? (dir ? &p->d2h : &p->h2d) : (dir ? &p->act_d2h : &p->act_h2d)) = rate;
	}
out:
	if (h)
		o->host_free(be->ctx, h);
	if (d)
		o->free(be->ctx, d);
	return rc;
}

/* The GPU's K/V stores into the KV pool in host memory (the hybrid
 * pipeline's kv_append = gpu): the backend's kv_append, and kv_append_side
 * where it has one, of `rows` rows of fp32 K and V on the device into
 * blocks drawn at random from a pinned (mapped) host pool of the model's
 * KV shape: bytes stored a second, each alone on an idle device. */
static int profile_kv_store(const struct mlens_model *m, const struct mlens_profile_opts *o,
			    double budget, struct mlens_profile *p, char *err, size_t errlen)
{
	const struct mlens_model_config *c = &m->cfg;
	struct mlens_backend *be = o->be;
	const struct mlens_backend_ops *ops = be->ops;
	struct mlens_kv_cache kv;
	size_t row = (size_t)c->num_key_value_heads * (size_t)c->head_dim, bytes;
	int rows = 8192, rc = 0;
	float *k = NULL, *v = NULL;
	int64_t *slots = NULL;

	if (!can_copy(be))
		return 0;	/* the GPU side is host memory: no stores cross a bus */
	test_kv(&kv, c, o);
	/* a pool of 2 x copy_bytes(budget), rows at most a tenth of it */
	bytes = copy_bytes(budget);
	kv.n_blocks = (uint32_t)(bytes / (row * (size_t)kv.block_size * mlens_dtype_size(kv.dtype)));
	if ((size_t)rows * 10 > (size_t)kv.n_blocks * (size_t)kv.block_size)
		rows = (int)((size_t)kv.n_blocks * (size_t)kv.block_size / 10);
	if (rows < 1)
		return 0;
	bytes = mlens_kv_bytes(&kv);
	kv.k = ops->host_alloc(be->ctx, bytes);
	kv.v = ops->host_alloc(be->ctx, bytes);
	k = ops->alloc(be->ctx, (size_t)rows * row * sizeof(float));
	v = ops->alloc(be->ctx, (size_t)rows * row * sizeof(float));
	slots = malloc((size_t)rows * sizeof(*slots));
	if (!kv.k || !kv.v || !k || !v || !slots) {
		rc = -ENOMEM;
		mlens_errf(err, errlen, "profiler: cannot allocate %zu MiB of pinned and %s memory for the "
			   "K/V store test", (2 * bytes + 2 * (size_t)rows * row * 4) >> 20, ops->name);
		goto out;
	}
	memset(kv.k, 0, bytes);
	memset(kv.v, 0, bytes);
	if ((rc = random_slots(&kv, rows, 4242, slots))) {
		mlens_errf(err, errlen, "profiler: cannot allocate the K/V store test's block list");
		goto out;
	}
	for (int side = 0; side < 1 + MLENS_BACKEND_HAS(ops, kv_append_side) && !rc; side++) {
		double best = INFINITY;
		for (int r = 0; r < REPS + 1 && !rc; r++) {
			double t0 = now(), t;
			rc = side ? ops->kv_append_side(be->ctx, &kv, 0, k, v, slots, rows)
				  : ops->kv_append(be->ctx, &kv, 0, k, v, slots, rows);
			if (!rc)
				rc = ops->event_record(be->ctx, side ? 2 : 0, MLENS_BACKEND_EVENTS - 1);
			if (!rc)
				rc = ops->event_sync(be->ctx, MLENS_BACKEND_EVENTS - 1);
			t = now() - t0;
			if (r && t < best)
				best = t;
		}
		if (rc)
			mlens_errf(err, errlen, "profiler: the %s K/V store into host memory failed: %s",
				   side ? "side queue's" : "compute queue's", strerror(-rc));
		else
			*(side ? &p->kv_store_side_bw : &p->kv_store_bw) =
				(double)rows * (double)(2 * row * mlens_dtype_size(kv.dtype)) / best;
	}
out:
	if (kv.k)
		ops->host_free(be->ctx, kv.k);
	if (kv.v)
		ops->host_free(be->ctx, kv.v);
	if (k)
		ops->free(be->ctx, k);
	if (v)
		ops->free(be->ctx, v);
	free(slots);
	return rc;
}

/* ==== CPU memory and decode attention ==== */

static size_t big_buffer(double budget)
{
	long l3 = -1;
	size_t b;
#ifdef _SC_LEVEL3_CACHE_SIZE
	l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
	b = l3 > 0 ? 4 * (size_t)l3 : 64u << 20;
	if (b < (32u << 20))
		b = 32u << 20;
	/* a short budget (the CPU backend's) trades precision for time */
	if (b > (budget >= 5 ? 1024u << 20 : 64u << 20))
		b = budget >= 5 ? 1024u << 20 : 64u << 20;
	return b / MLENS_READBW_SLICE * MLENS_READBW_SLICE;	/* whole slices */
}

/* Host-to-device copies on the copy queue, over and over, as the hybrid
 * pipeline's weight stream runs beside the CPU attention's KV reads. */
struct copier {
	struct mlens_backend *be;
	void *h, *d;
	size_t bytes;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	bool stop, done;
	int copies;		/* finished */
	uint64_t moved;		/* bytes after the first copy */
	double t0, t1;		/* the first copy's end, the last's */
	int rc;
};

static void *copier_main(void *arg)
{
	struct copier *c = arg;
	const struct mlens_backend_ops *o = c->be->ops;
	int rc = MLENS_BACKEND_HAS(o, bind_thread) ? o->bind_thread(c->be->ctx) : 0;

	while (!rc) {
		double t;
		bool stop;
		pthread_mutex_lock(&c->mu);
		stop = c->stop;
		pthread_mutex_unlock(&c->mu);
		if (stop)
			break;
		if ((rc = o->copy_async(c->be->ctx, 1, c->d, c->h, c->bytes, true)) ||
		    (rc = o->event_record(c->be->ctx, 1, MLENS_BACKEND_EVENTS - 1)) ||
		    (rc = o->event_sync(c->be->ctx, MLENS_BACKEND_EVENTS - 1)))
			break;
		t = now();
		pthread_mutex_lock(&c->mu);
		if (c->copies++)
			c->moved += c->bytes;
		else
			c->t0 = t;
		c->t1 = t;
		pthread_cond_broadcast(&c->cv);
		pthread_mutex_unlock(&c->mu);
	}
	pthread_mutex_lock(&c->mu);
	c->rc = rc;
	c->done = true;
	pthread_cond_broadcast(&c->cv);
	pthread_mutex_unlock(&c->mu);
	return NULL;
}

/* Wait until the copier has finished at least n copies or stopped. */
static void copier_wait(struct copier *c, int n)
{
	pthread_mutex_lock(&c->mu);
	while (c->copies < n && !c->done)
		pthread_cond_wait(&c->cv, &c->mu);
	pthread_mutex_unlock(&c->mu);
}

/* Start c streaming copies of bytes pinned bytes on be's copy queue and
 * wait for the first to finish. 0 or -errno with err set; on failure
 * nothing is left to stop. */
static int copier_start(struct copier *c, pthread_t *th, struct mlens_backend *be, size_t bytes,
			const char *what, char *err, size_t errlen)
{
	const struct mlens_backend_ops *o = be->ops;
	int rc;

	memset(c, 0, sizeof(*c));
	c->be = be;
	c->bytes = bytes;
	c->h = o->host_alloc(be->ctx, c->bytes);
	c->d = o->alloc(be->ctx, c->bytes);
	if (!c->h || !c->d) {
		rc = -ENOMEM;
		mlens_errf(err, errlen, "profiler: cannot allocate %zu MiB of pinned and %s memory for the "
			   "%s under copy", c->bytes >> 20, o->name, what);
		goto fail;
	}
	memset(c->h, 1, c->bytes);
	if (pthread_mutex_init(&c->mu, NULL)) {
		rc = -ENOMEM;
		goto fail_thread;
	}
	if (pthread_cond_init(&c->cv, NULL)) {
		pthread_mutex_destroy(&c->mu);
		rc = -ENOMEM;
		goto fail_thread;
	}
	if (pthread_create(th, NULL, copier_main, c)) {
		pthread_cond_destroy(&c->cv);
		pthread_mutex_destroy(&c->mu);
		rc = -EAGAIN;
		goto fail_thread;
	}
	copier_wait(c, 1);	/* streaming before the measurement starts */
	return 0;
fail_thread:
	mlens_errf(err, errlen, "profiler: cannot start the copy thread for the %s under copy", what);
fail:
	if (c->h)
		o->host_free(be->ctx, c->h);
	if (c->d)
		o->free(be->ctx, c->d);
	return rc;
}

/* After at least one more whole copy, stop the copier and free its
 * buffers; the copies' rate in *rate. 0 or the copies' -errno (err set). */
static int copier_stop(struct copier *c, pthread_t th, double *rate, const char *what, char *err,
		       size_t errlen)
{
	const struct mlens_backend_ops *o = c->be->ops;
	int rc;

	copier_wait(c, 2);	/* at least one whole copy beside the measurement */
	pthread_mutex_lock(&c->mu);
	c->stop = true;
	pthread_mutex_unlock(&c->mu);
	pthread_join(th, NULL);
	rc = c->rc;
	if (rc)
		mlens_errf(err, errlen, "profiler: a pinned copy beside the %s failed: %s", what,
			   strerror(-rc));
	else if (rate)
		*rate = (double)c->moved / (c->t1 - c->t0);
	pthread_cond_destroy(&c->cv);
	pthread_mutex_destroy(&c->mu);
	o->host_free(c->be->ctx, c->h);
	o->free(c->be->ctx, c->d);
	return rc;
}

/* The reads again while the copier streams: the CPU memory traffic of
 * KV reads and weight DMA together (the model's B_mem). 0 or -errno. */
static int mem_under_copy(struct mlens_backend *be, double budget, struct mlens_pool *pool,
			  const char *buf, size_t bytes, struct mlens_profile *p, char *err, size_t errlen)
{
	struct copier c;
	pthread_t th;
	double best, rate = 0;
	int rc = copier_start(&c, &th, be, copy_bytes(budget), "memory test", err, errlen);
	if (rc)
		return rc;
	best = mlens_readbw_best(pool, buf, bytes) * 1e9;
	if ((rc = copier_stop(&c, th, &rate, "memory reads", err, errlen)))
		return rc;
	p->mem_read_copy_bw = best;
	p->copy_read_bw = rate;
	p->mem_bw = p->mem_read_copy_bw + p->copy_read_bw;
	return 0;
}

static int profile_mem(struct mlens_backend *be, int n_threads, double budget, struct mlens_profile *p,
		       char *err, size_t errlen)
{
	struct mlens_pool *pool = NULL;
	size_t bytes = big_buffer(budget);
	char *buf = mlens_readbw_alloc(bytes);
	int rc = mlens_pool_create(&pool, n_threads, NULL);
	if (!buf || rc) {
		rc = rc ? rc : -ENOMEM;
		mlens_errf(err, errlen, "profiler: cannot set up the memory read test (%zu MiB): %s", bytes >> 20,
		       strerror(-rc));
		goto out;
	}
	memset(buf, 3, bytes);
	p->mem_read_bw = mlens_readbw_best(pool, buf, bytes) * 1e9;
	p->mem_bw = p->mem_read_bw;
	/* where weights cross a bus, they cross it from this memory */
	if (can_copy(be))
		rc = mem_under_copy(be, budget, pool, buf, bytes, p, err, errlen);
out:
	if (pool)
		mlens_pool_destroy(pool);
	free(buf);
	return rc;
}

/* The KV append of the decode step (kernels' kv_append: each row's fp32 K
 * and V converted into the pool's dtype), rows rows on be into blocks
 * drawn at random from all of kv's, a block's rows in order (a prompt's
 * rows fill their blocks; a long-running pool hands blocks out in no
 * order): bytes read and written a second into *rate. Rows into the
 * first slots instead keep the destination in a large L3 and measure
 * several times the rate of the pipeline's appends into a pool of tens of
 * GB. */
static int profile_append(struct mlens_backend *be, struct mlens_kv_cache *kv, int rows,
			  double *rate, char *err, size_t errlen)
{
	size_t kvd = (size_t)kv->n_kv_heads * (size_t)kv->head_dim, n = (size_t)rows * kvd;
	float *k = be->ops->alloc(be->ctx, n * sizeof(float));
	float *v = be->ops->alloc(be->ctx, n * sizeof(float));
	int64_t *slots = malloc((size_t)rows * sizeof(*slots));
	double best = INFINITY;
	int rc = 0;

	if (!k || !v || !slots) {
		rc = -ENOMEM;
		mlens_errf(err, errlen, "profiler: cannot allocate %zu MiB for the KV append test",
			   2 * n * sizeof(float) >> 20);
		goto out;
	}
	for (size_t i = 0; i < n; i++)
		k[i] = v[i] = 1.0f / 64;
	if ((rc = random_slots(kv, rows, 777, slots))) {
		mlens_errf(err, errlen, "profiler: cannot allocate the KV append test's block list");
		goto out;
	}
	for (int r = 0; r < REPS + 1 && !rc; r++) {
		double t0 = now(), t;
		rc = be->ops->kv_append(be->ctx, kv, 0, k, v, slots, rows);
		t = now() - t0;
		if (r && t < best)
			best = t;
	}
	if (rc)
		mlens_errf(err, errlen, "profiler: KV append failed: %s", strerror(-rc));
	else
		*rate = (double)rows * (double)(2 * kvd * (sizeof(float) + mlens_dtype_size(kv->dtype))) / best;
out:
	if (k)
		be->ops->free(be->ctx, k);
	if (v)
		be->ops->free(be->ctx, v);
	free(slots);
	return rc;
}

static int profile_attn(const struct mlens_model *m, const struct mlens_profile_opts *o, double budget,
			struct mlens_profile *p, char *err, size_t errlen)
{
	const struct mlens_model_config *c = &m->cfg;
	struct mlens_backend tmp = { 0 }, *be = o->attn;
	struct mlens_kv_cache kv;
	struct mlens_layer_desc d;
	struct mlens_layer_run run;
	struct mlens_attn_query *qr = NULL;
	uint32_t *table = NULL;
	float *q = NULL, *out = NULL;
	size_t kvbytes = big_buffer(budget) / (budget >= 5 ? 1 : 4), tok_bytes, head_elems, elems;
	int bs, qd = (int)(c->num_attention_heads * c->head_dim);
	int ctx, n_seq, bps, rc = 0;
	uint64_t seed = 12345;

	if (!be && o->be->ops->host_memory)
		be = o->be;
	if (!be) {
		struct mlens_backend_opts bo = { .n_threads = o->n_threads, .device = 0 };
		if ((rc = mlens_backend_cpu_create(&tmp, &bo))) {
			mlens_errf(err, errlen, "profiler: cannot start a cpu backend for the attention test: %s",
			       strerror(-rc));
			return rc;
		}
		be = &tmp;
	}
	mlens_layer_desc_init(&d, c);
	run = (struct mlens_layer_run){ be, &d, NULL };
	test_kv(&kv, c, o);
	bs = kv.block_size;
	tok_bytes = 2 * mlens_kv_token_bytes(&kv);	/* K and V, the one layer */
	/* sequences of up to 2048 tokens (or the model's context) filling kvbytes */
	ctx = c->max_position_embeddings > 1 && c->max_position_embeddings - 1 < 2048 ?
	      (int)c->max_position_embeddings - 1 : 2048;
	bps = (ctx + bs - 1) / bs;
	n_seq = (int)(kvbytes / (tok_bytes * (size_t)bps * (size_t)bs));
	if (n_seq < 1)
		n_seq = 1;
	kv.n_blocks = (uint32_t)n_seq * (uint32_t)bps;
	head_elems = mlens_kv_bytes(&kv);
	kv.k = be->ops->alloc(be->ctx, head_elems);
	kv.v = be->ops->alloc(be->ctx, head_elems);
	qr = calloc((size_t)n_seq, sizeof(*qr));
	table = malloc((size_t)kv.n_blocks * sizeof(*table));
	elems = (size_t)n_seq * (size_t)qd;
	q = be->ops->alloc(be->ctx, elems * sizeof(float));
	out = be->ops->alloc(be->ctx, elems * sizeof(float));
	if (!kv.k || !kv.v || !qr || !table || !q || !out) {
		rc = -ENOMEM;
		mlens_errf(err, errlen, "profiler: cannot allocate %zu MiB of KV for the attention test", 2 * head_elems >> 20);
		goto out;
	}
	/* small values of the pool's dtype: 1/128 (bf16 0x3c00, f32 0x3c000000) */
	if (kv.dtype == MLENS_DTYPE_F32) {
		for (size_t i = 0; i < head_elems / 4; i++)
			((float *)kv.k)[i] = ((float *)kv.v)[i] = 1.0f / 128;
	} else if (kv.dtype == MLENS_DTYPE_E4M3) {
		/* codes 1.5 and scales of about 0.01, alike: small values too */
		memset(kv.k, 0x3c, head_elems);
		memset(kv.v, 0x3c, head_elems);
	} else {
		for (size_t i = 0; i < head_elems / 2; i++)
			((uint16_t *)kv.k)[i] = ((uint16_t *)kv.v)[i] = 0x3c00;
	}
	for (size_t i = 0; i < elems; i++)
		q[i] = rng_f(&seed);
	for (uint32_t b = 0; b < kv.n_blocks; b++)
		table[b] = b;
	for (int s = 0; s < n_seq; s++) {
		qr[s].ctx_len = ctx;
		qr[s].n_blocks = bps;
		qr[s].block_table = table + (size_t)s * (size_t)bps;
	}
	/* alone, then (where weights stream to a device) while the copy queue
	 * streams pinned memory, as the hybrid pipeline's attention runs */
	for (int pass = 0; pass < (can_copy(o->be) ? 2 : 1); pass++) {
		struct copier cp;
		pthread_t th;
		double best = INFINITY;
		if (pass && (rc = copier_start(&cp, &th, o->be, copy_bytes(budget), "attention test",
					       err, errlen)))
			goto out;
		for (int r = 0; r < REPS + 1 && !rc; r++) {
			double t0 = now(), t;
			rc = mlens_layer_attn_decode(&run, out, q, &kv, 0, qr, n_seq);
			t = now() - t0;
			if (r && t < best)
				best = t;
		}
		if (rc)
			mlens_errf(err, errlen, "profiler: decode attention failed: %s", strerror(-rc));
		if (pass) {
			int rc2 = copier_stop(&cp, th, NULL, "attention test", rc ? NULL : err, errlen);
			rc = rc ? rc : rc2;
		}
		if (rc)
			goto out;
		if (pass)
			p->attn_copy_bw = (double)n_seq * (double)ctx * (double)tok_bytes / best;
		else
			p->attn_bw = (double)n_seq * (double)ctx * (double)tok_bytes / best;
	}
	/* the rows of a big step, at most the test's KV slots */
	rc = profile_append(be, &kv, kv.n_blocks * (uint32_t)bs < 8192 ? (int)(kv.n_blocks * (uint32_t)bs) : 8192,
			    &p->append_bw, err, errlen);
out:
	if (kv.k)
		be->ops->free(be->ctx, kv.k);
	if (kv.v)
		be->ops->free(be->ctx, kv.v);
	if (q)
		be->ops->free(be->ctx, q);
	if (out)
		be->ops->free(be->ctx, out);
	free(qr);
	free(table);
	if (be == &tmp)
		mlens_backend_destroy(&tmp);
	return rc;
}

/* Bytes the model files' read rate is measured over (experts left on
 * disk): eight times what the queue holds in flight
 * (MLENS_DISK_TIER_DEPTH reads of MLENS_DISK_TIER_CHUNK), so that the
 * first fill's latency is a small part of the time; one fill alone
 * measures the latency, well below the rate the steps then get. */
#define PROFILE_DISK_BYTES (8ull * MLENS_DISK_TIER_DEPTH * MLENS_DISK_TIER_CHUNK)

int mlens_profile_run(const struct mlens_model *m, const struct mlens_profile_opts *o,
		      struct mlens_profile *out, char *err, size_t errlen)
{
	double t0 = now(), budget;
	int rc;
	if (!m || !o || !o->be || !o->be->ops || m->cfg.num_hidden_layers < 1 ||
	    (o->kv_dtype != MLENS_DTYPE_F32 && o->kv_dtype != MLENS_DTYPE_BF16 &&
	     o->kv_dtype != MLENS_DTYPE_E4M3)) {
		mlens_errf(err, errlen, "profiler: no model, no backend or a KV dtype other than f32/bf16/fp8");
		return -EINVAL;
	}
	budget = o->budget_s > 0 ? o->budget_s : o->be->ops->host_memory ? 0.5 : 20;
	memset(out, 0, sizeof(*out));
	snprintf(out->backend, sizeof(out->backend), "%s", o->be->ops->name);
	mlens_profile_gpu_name(o->be, out->gpu, sizeof(out->gpu));
	/* shares of the budget: the layer sweep takes most */
	if ((rc = profile_layer(m, o, 0.5 * budget, out, err, errlen)) ||
	    (rc = profile_copies(o->be, budget, out, err, errlen)) ||
	    (rc = profile_kv_store(m, o, budget, out, err, errlen)) ||
	    (rc = profile_attn(m, o, budget, out, err, errlen)) ||
	    (rc = profile_mem(o->be, o->n_threads, budget, out, err, errlen)) ||
	    (rc = mlens_disk_tier_measure(m->disk, PROFILE_DISK_BYTES, &out->disk_bw, err, errlen)))
		return rc;
	out->seconds = now() - t0;
	return 0;
}

void mlens_profile_hw(const struct mlens_profile *p, struct mlens_perf_hw *hw)
{
	hw->b_io = p->h2d > 0 ? p->h2d : p->mem_read_bw > 0 ? p->mem_read_bw : p->mem_bw;
	hw->b_d2h = p->d2h;
	hw->b_mem = p->mem_bw;
	hw->b_attn = p->attn_bw;
	hw->b_attn_shared = p->attn_copy_bw;	/* 0 on host memory */
	hw->b_append = p->append_bw;
	hw->b_kv_store = p->kv_store_bw;	/* 0 on host memory; the side rate: _state_hold */
	hw->c_gpu = p->gemm_flops;
	hw->c_attn = p->attn_prefill_flops;
	hw->b_act_h2d = p->act_h2d;
	hw->b_act_d2h = p->act_d2h;
	hw->b_io_shared = p->copy_read_bw;	/* 0 on host memory */
	hw->b_disk = p->disk_bw;	/* 0 without experts on disk */
	hw->ga = p->ga;
	hw->gb = p->gb;
}

/* ==== the cache ==== */

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
	const unsigned char *b = p;
	for (size_t i = 0; i < n; i++) {
		h ^= b[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

void mlens_profile_key_make(struct mlens_profile_key *k, const struct mlens_model *m,
			    const char *backend, const char *gpu, const struct mlens_gpu_plan *plan,
			    double budget_s)
{
	const struct mlens_model_config *c = &m->cfg;
	char canon[512];
	int n;
	memset(k, 0, sizeof(*k));
	snprintf(k->model, sizeof(k->model), "%s", m->dir ? m->dir : "");
	n = snprintf(canon, sizeof(canon), "%s v%lld h%lld i%lld l%lld a%lld kv%lld hd%lld e%lld k%lld p%lld t%d d%s",
		     c->architecture, (long long)c->vocab_size, (long long)c->hidden_size,
		     (long long)c->intermediate_size, (long long)c->num_hidden_layers,
		     (long long)c->num_attention_heads, (long long)c->num_key_value_heads, (long long)c->head_dim,
		     (long long)c->num_local_experts, (long long)c->num_experts_per_tok,
		     (long long)c->max_position_embeddings, (int)c->tie_word_embeddings, mlens_dtype_name(c->dtype));
	k->config_hash = fnv(0xcbf29ce484222325ull, canon, n > 0 ? (size_t)n : 0);
	snprintf(k->backend, sizeof(k->backend), "%s", backend ? backend : "");
	snprintf(k->gpu, sizeof(k->gpu), "%s", gpu ? gpu : "");
	k->budget = plan ? plan->budget : 0;
	k->budget_s = budget_s;
}

void mlens_profile_gpu_name(const struct mlens_backend *be, char *buf, size_t len)
{
	if (len)
		buf[0] = 0;
	if (!be || !be->ops || be->ops->host_memory)
		return;
	if (!MLENS_BACKEND_HAS(be->ops, bus_id)) {
		snprintf(buf, len, "%s", be->ops->name);
		return;
	}
	{
		char bus[32], path[128], vendor[16] = "", device[16] = "";
		FILE *f;
		if (be->ops->bus_id(be->ctx, bus, sizeof(bus)))
			return;
		for (char *s = bus; *s; s++)
			if (*s >= 'A' && *s <= 'F')
				*s = (char)(*s - 'A' + 'a');
		snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/vendor", bus);
		if ((f = fopen(path, "r"))) {
			if (!fgets(vendor, sizeof(vendor), f))
				vendor[0] = 0;
			fclose(f);
		}
		snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/device", bus);
		if ((f = fopen(path, "r"))) {
			if (!fgets(device, sizeof(device), f))
				device[0] = 0;
			fclose(f);
		}
		vendor[strcspn(vendor, "\n")] = 0;
		device[strcspn(device, "\n")] = 0;
		snprintf(buf, len, "%s:%s at %s", vendor[0] ? vendor + (vendor[1] == 'x' ? 2 : 0) : "?",
			 device[0] ? device + (device[1] == 'x' ? 2 : 0) : "?", bus);
	}
}

static json_t *line_json(const struct mlens_perf_line *l)
{
	return json_pack("{s:f,s:f,s:f,s:f,s:f,s:i}", "a", l->a, "b", l->b, "se", l->se, "se_a", l->se_a,
			 "se_b", l->se_b, "n", l->n);
}

json_t *mlens_profile_json(const struct mlens_profile *p)
{
	json_t *o = json_pack("{s:s,s:s,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:o,s:o}",
			      "backend", p->backend, "gpu", p->gpu, "gemm_flops", p->gemm_flops,
			      "prefill_attention_flops", p->attn_prefill_flops, "h2d_bytes_per_s", p->h2d,
			      "d2h_bytes_per_s", p->d2h, "compute_queue_h2d_bytes_per_s", p->act_h2d,
			      "compute_queue_d2h_bytes_per_s", p->act_d2h,
			      "gpu_kv_store_bytes_per_s", p->kv_store_bw,
			      "gpu_kv_store_side_bytes_per_s", p->kv_store_side_bw,
			      "cpu_attention_bytes_per_s", p->attn_bw,
			      "cpu_attention_under_copy_bytes_per_s", p->attn_copy_bw,
			      "kv_append_bytes_per_s", p->append_bw,
			      "cpu_memory_bytes_per_s", p->mem_bw, "cpu_read_bytes_per_s", p->mem_read_bw,
			      "cpu_read_under_copy_bytes_per_s", p->mem_read_copy_bw,
			      "h2d_under_read_bytes_per_s", p->copy_read_bw, "seconds", p->seconds,
			      "ga", line_json(&p->ga), "gb", line_json(&p->gb));
	json_t *pts = json_array();
	for (int i = 0; i < p->n_points; i++)
		json_array_append_new(pts, json_pack("{s:I,s:f,s:f}", "tokens", (json_int_t)p->tokens[i],
						     "ga_seconds", p->ga_s[i], "gb_seconds", p->gb_s[i]));
	json_object_set_new(o, "points", pts);
	json_object_set_new(o, "disk_read_bytes_per_s", json_real(p->disk_bw));
	return o;
}

static json_t *key_json(const struct mlens_profile_key *k)
{
	char h[24];
	snprintf(h, sizeof(h), "%016llx", (unsigned long long)k->config_hash);
	return json_pack("{s:s,s:s,s:s,s:s,s:I,s:f,s:I,s:I}", "model", k->model, "config_hash", h,
			 "backend", k->backend, "gpu", k->gpu, "budget", (json_int_t)k->budget,
			 "budget_seconds", k->budget_s, "group", (json_int_t)k->group, "moe_chunk",
			 (json_int_t)k->moe_chunk);
}

int mlens_profile_save(const char *path, const struct mlens_profile_key *k,
		       const struct mlens_profile *p, char *err, size_t errlen)
{
	json_t *o = json_pack("{s:i,s:o,s:o}", "version", MLENS_PROFILE_VERSION, "key", key_json(k), "profile",
			      mlens_profile_json(p));
	char *tmp;
	size_t n = strlen(path) + 8;
	int rc = 0;
	if (!o || !(tmp = malloc(n))) {
		json_decref(o);
		mlens_errf(err, errlen, "profile cache %s: out of memory", path);
		return -ENOMEM;
	}
	snprintf(tmp, n, "%s.tmp", path);
	if (json_dump_file(o, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER) || rename(tmp, path)) {
		rc = errno ? -errno : -EIO;
		mlens_errf(err, errlen, "cannot write the profile cache %s: %s (check profile_cache)", path, strerror(-rc));
		unlink(tmp);
	}
	free(tmp);
	json_decref(o);
	return rc;
}

static int line_from(json_t *j, struct mlens_perf_line *l)
{
	double a, b, se, sa, sb;
	int n;
	if (json_unpack(j, "{s:F,s:F,s:F,s:F,s:F,s:i}", "a", &a, "b", &b, "se", &se, "se_a", &sa, "se_b", &sb,
			"n", &n))
		return -EINVAL;
	*l = (struct mlens_perf_line){ a, b, se, sa, sb, n };
	return isfinite(a) && isfinite(b) ? 0 : -EINVAL;
}

int mlens_profile_load(const char *path, const struct mlens_profile_key *k,
		       struct mlens_profile *p, char *err, size_t errlen)
{
	json_error_t je;
	json_t *o = json_load_file(path, JSON_REJECT_DUPLICATES, &je), *kj, *pj, *want, *pts, *pt;
	const char *be, *gpu;
	size_t i;
	int version, rc = 0;
	if (!o) {
		if (access(path, F_OK)) {
			mlens_errf(err, errlen, "no profile cache at %s", path);
			return -ENOENT;
		}
		mlens_errf(err, errlen, "profile cache %s is not JSON (line %d: %s); it is rewritten by the next profile",
		       path, je.line, je.text);
		return -EINVAL;
	}
	memset(p, 0, sizeof(*p));
	kj = json_object_get(o, "key");
	pj = json_object_get(o, "profile");
	if (json_unpack(o, "{s:i}", "version", &version) || version != MLENS_PROFILE_VERSION || !kj || !pj) {
		mlens_errf(err, errlen, "profile cache %s: not a version %d profile cache", path, MLENS_PROFILE_VERSION);
		rc = -EINVAL;
		goto out;
	}
	want = k ? key_json(k) : NULL;
	if (want && !json_equal(want, kj)) {
		mlens_errf(err, errlen, "profile cache %s was measured for another model, backend, GPU or budget", path);
		rc = -ESTALE;
	}
	json_decref(want);
	if (rc)
		goto out;
	if (json_unpack(pj, "{s:s,s:s,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:F,s:o}",
			"backend", &be,
			"gpu", &gpu, "gemm_flops", &p->gemm_flops, "prefill_attention_flops",
			&p->attn_prefill_flops, "h2d_bytes_per_s", &p->h2d, "d2h_bytes_per_s", &p->d2h,
			"compute_queue_h2d_bytes_per_s", &p->act_h2d, "compute_queue_d2h_bytes_per_s",
			&p->act_d2h, "gpu_kv_store_bytes_per_s", &p->kv_store_bw,
			"gpu_kv_store_side_bytes_per_s", &p->kv_store_side_bw,
			"cpu_attention_bytes_per_s", &p->attn_bw, "cpu_attention_under_copy_bytes_per_s",
			&p->attn_copy_bw, "kv_append_bytes_per_s", &p->append_bw, "cpu_memory_bytes_per_s", &p->mem_bw,
			"cpu_read_bytes_per_s", &p->mem_read_bw, "cpu_read_under_copy_bytes_per_s",
			&p->mem_read_copy_bw, "h2d_under_read_bytes_per_s", &p->copy_read_bw, "seconds",
			&p->seconds, "points", &pts) ||
	    line_from(json_object_get(pj, "ga"), &p->ga) || line_from(json_object_get(pj, "gb"), &p->gb) ||
	    !json_is_array(pts) || json_array_size(pts) > MLENS_PROFILE_POINTS) {
		mlens_errf(err, errlen, "profile cache %s: a field is missing or out of range", path);
		rc = -EINVAL;
		goto out;
	}
	snprintf(p->backend, sizeof(p->backend), "%s", be);
	snprintf(p->gpu, sizeof(p->gpu), "%s", gpu);
	/* absent from a profile measured without experts on disk */
	p->disk_bw = json_is_number(json_object_get(pj, "disk_read_bytes_per_s"))
		     ? json_number_value(json_object_get(pj, "disk_read_bytes_per_s")) : 0;
	if (!(p->disk_bw >= 0) || !isfinite(p->disk_bw))
		p->disk_bw = 0;
	json_array_foreach(pts, i, pt) {
		json_int_t t;
		if (json_unpack(pt, "{s:I,s:F,s:F}", "tokens", &t, "ga_seconds", &p->ga_s[i], "gb_seconds", &p->gb_s[i])) {
			mlens_errf(err, errlen, "profile cache %s: point %zu is malformed", path, i);
			rc = -EINVAL;
			goto out;
		}
		p->tokens[i] = t;
	}
	p->n_points = (int)json_array_size(pts);
	if (!(p->mem_bw > 0) || !(p->mem_read_bw > 0) || !(p->attn_bw > 0) || !(p->attn_copy_bw >= 0) ||
	    !(p->append_bw >= 0) || !(p->kv_store_bw >= 0) || !(p->kv_store_side_bw >= 0) ||
	    !(p->gemm_flops > 0) ||
	    !(p->attn_prefill_flops >= 0) || !(p->act_h2d >= 0) || !(p->act_d2h >= 0)) {
		mlens_errf(err, errlen, "profile cache %s: a rate is not positive", path);
		rc = -EINVAL;
	}
out:
	json_decref(o);
	return rc;
}

/* ==== the daemon's state ==== */

int mlens_profile_state_predict(struct mlens_profile_state *st, double p, double g)
{
	struct mlens_perf_workload w = { p, g, st->kv_tokens, 0 };
	struct mlens_perf_prediction pred;
	int rc;
	if (!st->have)
		return -ENOENT;
	/* hybrid: residency (at most resident_experts: plan_in's cap) and
	 * split searched; resident modes: every expert lives where the
	 * backend computes, only the split is searched. The held prediction
	 * changes only when the new one exists. */
	if (st->hybrid)
		rc = mlens_perf_choose_upto(&st->pm, &st->hw, &w,
					    st->plan_in.cap_resident ? st->plan_in.max_resident : -1, &pred,
					    st->err, sizeof(st->err));
	else
		rc = mlens_perf_predict(&st->pm, &st->hw, &w, (int)st->pm.experts, &pred, st->err,
					sizeof(st->err));
	if (rc)
		return rc;
	st->w = w;
	st->pred = pred;
	return 0;
}

void mlens_profile_state_hold(struct mlens_profile_state *st)
{
	memset(&st->hw, 0, sizeof(st->hw));
	mlens_profile_hw(&st->prof, &st->hw);
	st->hw.gpu_budget = st->gpu_budget;
	st->hw.gpu_workspace = st->gpu_workspace;
	st->hw.chunk = st->chunk;
	st->plan_in.att_half = st->att_up_half;	/* a set then holds no fp32 att */
	if (st->plan_in.group) {
		st->hw.act_bytes = mlens_gpu_plan_act_bytes_hw;
		st->hw.act_arg = &st->plan_in;
	}
	/* side copies: GA's to the host on queue 2 and, with up_copy_in, C's
	 * output back on queue 3 (CUDA, the one backend with a side queue, has
	 * it), beside the compute queue's kernels */
	if (st->side_copy_out)
		st->hw.b_act_d2h = 0;
	if (st->side_copy_out && st->up_copy_in)
		st->hw.b_act_h2d = 0;
	st->hw.gpu_kv_append = st->gpu_kv_append;
	/* a backend in host memory has no bus to measure (the profile's H2D
	 * rate is 0): nothing streams, its compute is the CPU, and with host
	 * memory as the activation budget only the engine's largest step
	 * bounds n_real */
	st->hw.host_compute = !(st->prof.h2d > 0);
	if (st->hw.host_compute)
		st->hw.max_step = st->max_step > 0 ? st->max_step : st->opts.max_tokens > 0 ? (double)st->opts.max_tokens
											       : 4096;
	st->hw.att_up_bytes = st->att_up_half ? 2 : 0;
	/* experts left on disk: their read, on average a layer */
	if (st->model && st->model->disk && st->pm.layers > 0) {
		st->hw.disk_layer_bytes = (double)mlens_disk_tier_step_bytes(st->model->disk) / (double)st->pm.layers;
		mlens_disk_tier_set_ceiling(st->model->disk, st->prof.disk_bw);	/* for the stats */
	}
	/* with the side copies the GPU's K/V stores run on queue 2 too
	 * (pipeline side_append, where the backend has kv_append_side) */
	if (st->gpu_kv_append && st->side_copy_out && st->prof.kv_store_side_bw > 0) {
		st->hw.kv_store_side = true;
		st->hw.b_kv_store = st->prof.kv_store_side_bw;
	}
	st->have = true;
}

int mlens_profile_state_run(struct mlens_profile_state *st, struct mlens_sched *sched,
			    double p, double g, bool use_cache)
{
	const char *cache = st->cache_path && st->cache_path[0] ? st->cache_path : NULL;
	char why[512];
	int rc = -ENOENT;
	st->err[0] = 0;
	st->from_cache = false;
	if (sched)
		st->max_step = mlens_sched_cap_for(sched, 0);
	if (cache && use_cache) {
		rc = mlens_profile_load(cache, &st->key, &st->prof, why, sizeof(why));
		st->from_cache = !rc;
		/* a profile of the same model with every expert in RAM: the
		 * files' read rate alone is measured now */
		if (!rc && st->model && st->model->disk && !(st->prof.disk_bw > 0) &&
		    mlens_disk_tier_measure(st->model->disk, PROFILE_DISK_BYTES, &st->prof.disk_bw, why, sizeof(why)))
			snprintf(st->err, sizeof(st->err), "%s", why);
	}
	if (rc && st->own_backend) {
		struct mlens_profile_opts o = st->opts;
		struct mlens_backend be;
		rc = mlens_backend_create(&be, st->opts.be->ops->name, &st->own_opts);
		if (rc) {
			snprintf(st->err, sizeof(st->err), "profiler: cannot make a %s backend of its own: %s",
				 st->opts.be->ops->name, strerror(-rc));
			st->rc = rc;
			return rc;
		}
		o.be = &be;
		rc = mlens_profile_run(st->model, &o, &st->prof, st->err, sizeof(st->err));
		mlens_backend_destroy(&be);
		if (rc) {
			st->rc = rc;
			return rc;
		}
		if (cache && mlens_profile_save(cache, &st->key, &st->prof, why, sizeof(why)))
			snprintf(st->err, sizeof(st->err), "%s", why);
	} else if (rc) {
		rc = mlens_profile_run(st->model, &st->opts, &st->prof, st->err, sizeof(st->err));
		if (rc) {
			st->rc = rc;
			return rc;
		}
		if (cache && mlens_profile_save(cache, &st->key, &st->prof, why, sizeof(why)))
			snprintf(st->err, sizeof(st->err), "%s", why);	/* measured all the same */
	}
	mlens_profile_state_hold(st);
	rc = mlens_profile_state_predict(st, p, g);
	if (rc) {
		/* measured, but this workload does not fit the budget: no prediction */
		st->have = false;
		st->rc = rc;
		return rc;
	}
	st->rc = 0;
	if (sched)
		mlens_profile_state_apply(st, sched);
	return 0;
}

int mlens_profile_state_apply(struct mlens_profile_state *st, struct mlens_sched *sched)
{
	if (st->have && st->rc == 0 && st->pinned_cap <= 0)
		mlens_sched_set_token_cap(sched, mlens_perf_token_cap(&st->pred));
	st->token_cap = mlens_sched_token_cap(sched);
	return st->token_cap;
}

double mlens_profile_state_step_seconds(const struct mlens_profile_state *st, double n)
{
	struct mlens_perf_step s;
	struct mlens_perf_step_time t;
	struct mlens_perf_policy pol;
	if (!st->have || !(n > 0) || !(st->w.g > 0))
		return NAN;
	s = mlens_perf_steady_step(&st->w, n);
	pol = st->pred.policy;
	if (mlens_perf_step_time_best(&st->pm, &st->hw, &pol, &s, &t))
		return NAN;
	return t.seconds;
}

json_t *mlens_profile_state_json(const struct mlens_profile_state *st)
{
	const struct mlens_perf_prediction *pr = &st->pred;
	json_t *o = json_object();
	json_object_set_new(o, "measured", mlens_profile_json(&st->prof));
	json_object_set_new(o, "from_cache", json_boolean(st->from_cache));
	json_object_set_new(o, "mode", json_string(st->hybrid ? "hybrid" : "resident"));
	json_object_set_new(o, "workload", json_pack("{s:f,s:f,s:f}", "prompt_len", st->w.p, "gen_len", st->w.g,
						     "kv_tokens", st->w.kv_tokens));
	json_object_set_new(o, "policy", json_pack("{s:i,s:f,s:f}", "resident_experts", pr->policy.resident_experts,
						   "alpha_decode", pr->policy.alpha_decode, "alpha_prefill",
						   pr->policy.alpha_prefill));
	/* n_eq is INFINITY when nothing streams: JSON has no infinity */
	json_object_set_new(o, "n_eq", isfinite(pr->n_eq) ? json_real(pr->n_eq) : json_null());
	json_object_set_new(o, "n_act", json_real(pr->n_act));
	json_object_set_new(o, "n_real", json_real(pr->n_real));
	json_object_set_new(o, "n_real_bound", json_string(mlens_perf_limit_name(pr->n_real_by)));
	json_object_set_new(o, "host_compute", json_boolean(st->hw.host_compute));
	json_object_set_new(o, "limit", json_string(mlens_perf_limit_name(pr->limit)));
	json_object_set_new(o, "binding", json_string(mlens_perf_tier_name(&st->hw, pr->time.bind)));
	json_object_set_new(o, "predicted", json_pack("{s:f,s:f,s:f,s:f,s:f,s:f}", "tokens_per_step", pr->tokens,
		"step_seconds", pr->time.seconds, "tokens_per_s", pr->total_tok_s, "generated_tokens_per_s",
		pr->gen_tok_s, "pme", pr->pme, "t_max", isfinite(pr->t_max) ? pr->t_max : -1.0));
	{
		/* what each resource needs a layer at the predicted step, the
		 * largest binding; fill and drain once a step */
		json_t *t = json_object();
		for (int b = 0; b < MLENS_PERF_BIND_N; b++) {
			/* no bus on a host-compute backend: no link tiers */
			if (st->hw.host_compute && (b == MLENS_PERF_BIND_PCIE || b == MLENS_PERF_BIND_D2H))
				continue;
			json_object_set_new(t, mlens_perf_tier_name(&st->hw, (enum mlens_perf_bind)b),
					    json_real(pr->time.tier[b]));
		}
		json_object_set_new(t, "fill", json_real(pr->time.fill));
		json_object_set_new(o, "layer_seconds", t);
	}
	json_object_set_new(o, "token_cap", json_integer(st->token_cap));
	json_object_set_new(o, "token_cap_pinned", json_boolean(st->pinned_cap > 0));
	/* where the scheduler's cap comes from: the configuration, n_real, or
	 * the engine's largest step where that is below n_real */
	json_object_set_new(o, "token_cap_source", json_string(st->pinned_cap > 0 ? "max_step_tokens" :
		st->token_cap < floor(pr->n_real) ? "largest-step" : "n_real"));
	if (st->err[0])
		json_object_set_new(o, "warning", json_string(st->err));
	return o;
}

/* ==== following the traffic ==== */

static bool moved(double now, double held)
{
	if (!(held > 0))
		return now >= 1;
	return fabs(now - held) > MLENS_FOLLOW_CHANGE * held;
}

int mlens_workload_follow(struct mlens_workload_window *win, uint64_t prompt_tokens,
			  uint64_t generated_tokens, uint64_t requests_done, double held_p,
			  double held_g, double *p, double *g)
{
	uint64_t n;
	if (!win->started || requests_done < win->requests_done || prompt_tokens < win->prompt_tokens ||
	    generated_tokens < win->generated_tokens) {
		/* the first call, or counters that went back: start afresh */
		win->started = true;
		win->prompt_tokens = prompt_tokens;
		win->generated_tokens = generated_tokens;
		win->requests_done = requests_done;
		return 0;
	}
	n = requests_done - win->requests_done;
	if (n < MLENS_FOLLOW_MIN_REQUESTS)
		return 0;
	*p = (double)(prompt_tokens - win->prompt_tokens) / (double)n;
	*g = (double)(generated_tokens - win->generated_tokens) / (double)n;
	win->prompt_tokens = prompt_tokens;
	win->generated_tokens = generated_tokens;
	win->requests_done = requests_done;
	if (!(*g >= 1))
		return 0;	/* a model needs a generated token a request */
	return moved(*p, held_p) || moved(*g, held_g);
}
