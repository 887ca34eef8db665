/* Decode attention dispatch: picks the kernel variant from CPUID (or the
 * config / MLENS_ATTN_KERNEL), splits the batch into tasks of at most
 * MLENS_ATTN_CHUNK_TOKENS (tunable) positions of one (sequence, KV head), and merges
 * the partial results of split sequences in chunk order. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/cpu/attn.h"
#include "kernels/cpu/attn_int.h"
#include "kernels/cpu/cpu.h"

struct mlens_attn_tuning mlens_attn_tune = {
	.prefetch_tiles = 4, .prefetch_bytes = 0, .prefetch_spread = 1, .prefetch_hint = 1,
	.prefetch_every = 1, .chunk_tokens = MLENS_ATTN_CHUNK_TOKENS, .heads_per_task = 0,
};

/* ==== variants ==== */

struct attn_variant {
	const char *name;
	mlens_attn_span_fn span;	/* NULL: the scalar reference */
	mlens_bf16_cvt_fn cvt;		/* NULL: mlens_f32_to_bf16 per element */
	mlens_e4m3_row_fn e4m3_row;	/* NULL: mlens_e4m3_quantize_row */
	int width;			/* head_dim must be a multiple (2 vectors) */
};

static const struct attn_variant variants[] = {
	{ "scalar", NULL, NULL, NULL, 1 },
	{ "avx2", mlens_attn_span_avx2, mlens_bf16_cvt_avx2, mlens_e4m3_row_avx2, 16 },
	{ "avx512", mlens_attn_span_avx512, mlens_bf16_cvt_avx512, mlens_e4m3_row_avx2, 32 },
};
#define N_VARIANTS (int)(sizeof(variants) / sizeof(variants[0]))

static _Atomic(const struct attn_variant *) active;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static bool cpu_has(int i)
{
	__builtin_cpu_init();
	switch (i) {
	case 0:
		return true;
	case 1:
		return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
		       __builtin_cpu_supports("f16c");
	case 2:
		return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
		       __builtin_cpu_supports("avx512vl");
	}
	return false;
}

static int find_variant(const char *name)
{
	for (int i = 0; i < N_VARIANTS; i++)
		if (!strcmp(name, variants[i].name))
			return i;
	return -1;
}

static int best_variant(void)
{
	int i = N_VARIANTS - 1;
	while (i > 0 && !cpu_has(i))
		i--;
	return i;
}

/* An integer tuning knob from the environment, clamped to [lo, hi]. */
static void env_knob(const char *name, int *dst, int lo, int hi)
{
	const char *e = getenv(name);
	long v;
	if (!e || !*e)
		return;
	v = strtol(e, NULL, 0);
	*dst = v < lo ? lo : v > hi ? hi : (int)v;
}

static void init_variant(void)
{
	const char *env = getenv("MLENS_ATTN_KERNEL");
	int i = env ? find_variant(env) : -1;

	if (env && (i < 0 || !cpu_has(i))) {
		/* a setting that cannot be honoured is said once, not ignored */
		fprintf(stderr, "mlens: MLENS_ATTN_KERNEL=%s is not a kernel this CPU can run "
			"(scalar, avx2, avx512); using %s\n", env, variants[best_variant()].name);
		i = -1;
	}
	if (i < 0)
		i = best_variant();
	env_knob("MLENS_ATTN_PREFETCH", &mlens_attn_tune.prefetch_tiles, 0, 1 << 16);
	env_knob("MLENS_ATTN_PREFETCH_BYTES", &mlens_attn_tune.prefetch_bytes, 0, 1 << 30);
	env_knob("MLENS_ATTN_PREFETCH_SPREAD", &mlens_attn_tune.prefetch_spread, 0, 1);
	env_knob("MLENS_ATTN_PREFETCH_HINT", &mlens_attn_tune.prefetch_hint, 0, 3);
	env_knob("MLENS_ATTN_PREFETCH_EVERY", &mlens_attn_tune.prefetch_every, 1, 1 << 16);
	env_knob("MLENS_ATTN_CHUNK", &mlens_attn_tune.chunk_tokens, 1, 1 << 20);
	env_knob("MLENS_ATTN_HEADS_PER_TASK", &mlens_attn_tune.heads_per_task, 0, 1 << 16);
	/* relaxed: the variants are constant tables; the pointer is the only datum */
	atomic_store_explicit(&active, &variants[i], memory_order_relaxed);
}

static const struct attn_variant *get_variant(void)
{
	pthread_once(&init_once, init_variant);
	return atomic_load_explicit(&active, memory_order_relaxed);
}

int mlens_cpu_attn_set_variant(const char *name)
{
	int i;
	pthread_once(&init_once, init_variant);
	if (!name)
		return -EINVAL;
	i = strcmp(name, "auto") ? find_variant(name) : best_variant();
	if (i < 0)
		return -EINVAL;
	if (!cpu_has(i))
		return -ENOTSUP;
	atomic_store_explicit(&active, &variants[i], memory_order_relaxed);
	return 0;
}

const char *mlens_cpu_attn_variant(void)
{
	return get_variant()->name;
}

bool mlens_cpu_attn_variant_supported(const char *name)
{
	int i = name ? find_variant(name) : -1;
	return i >= 0 && cpu_has(i);
}

/* ==== workspace ==== */

/* Grow *p to at least bytes (contents are not kept), 64-byte aligned. */
static int ws_reserve(void **p, size_t *have, size_t bytes)
{
	void *n = NULL;
	if (bytes <= *have)
		return 0;
	bytes += bytes / 4;	/* batches grow a little from step to step */
	if (posix_memalign(&n, 64, bytes))
		return -ENOMEM;
	free(*p);
	*p = n;
	*have = bytes;
	return 0;
}

void mlens_cpu_attn_ws_fini(struct mlens_cpu_attn_ws *ws)
{
	free(ws->tasks);
	free(ws->part);
	free(ws->scratch);
	memset(ws, 0, sizeof(*ws));
}

/* ==== decode ==== */

/* One task: positions [t0, t1) of query i for the KV heads [g, g + heads
 * per task), into partial record rec, or straight into the output when
 * rec < 0 (the query is not split). A merge entry: the n = t1 chunks of
 * (i, g) whose records start at rec. */
struct attn_task {
	int32_t i;
	int32_t g;
	int32_t t0, t1;
	int32_t rec;
};

/* The chunks a context of ctx positions is split into: about ctx / chunk
 * of them (at least one), of equal length rounded up to whole blocks, so
 * that no chunk is a short remainder (a 528-token context is one task,
 * not 512 + 16 and a merge). *len: positions per chunk, the last shorter. */
static int32_t ctx_chunks(int32_t ctx, int chunk, int bs, int32_t *len)
{
	int32_t n = (int32_t)(((int64_t)ctx + chunk / 2) / chunk), l;
	if (n < 1)
		n = 1;
	l = (ctx + n - 1) / n;
	l = (l + bs - 1) / bs * bs;
	*len = l;
	return (ctx + l - 1) / l;	/* block rounding can leave fewer */
}

struct decode_job {
	float *out;
	/* set: the output goes here rounded to half_dt (round_into), and the
	 * vector tasks keep their fp32 output in their thread's scratch */
	void *half;
	enum mlens_dtype half_dt;
	const float *q;
	const struct mlens_kv_cache *kv;
	int layer, nh, group, chunk;
	int hpt;		/* KV heads per task */
	const struct mlens_attn_query *qs;
	float scale;
	const struct attn_variant *var;
	const struct attn_task *tasks;
	float *part;
	size_t rec_floats;	/* one partial: acc[H][hd], m[H], l[H]; H = hpt*group */
	float *scratch;
	size_t scratch_floats;	/* per thread: the kernel's, then (half) a task's output */
	size_t kern_floats;	/* the kernel's part of it */
};

/* dst[0..n) = src[0..n) rounded to dt (bf16 or f16) as mlens_store rounds
 * it, bf16 through the variant's vector code (the same bits) */
static void round_into(const struct attn_variant *var, void *dst, enum mlens_dtype dt,
		       const float *src, size_t n)
{
	if (dt == MLENS_DTYPE_BF16 && var->cvt) {
		var->cvt((uint16_t *)dst, src, n);
		return;
	}
	for (size_t i = 0; i < n; i++)
		mlens_store(dst, dt, i, src[i]);
}

/* With j->half: the H heads' fp32 output at src into the half output at
 * element offset off. */
static void put_half(const struct decode_job *j, size_t off, const float *src, int H)
{
	round_into(j->var, (char *)j->half + off * mlens_dtype_size(j->half_dt), j->half_dt, src,
		   (size_t)H * (size_t)j->kv->head_dim);
}

static size_t head_off(const struct decode_job *j, int i, int g)
{
	return ((size_t)i * j->nh + (size_t)g * j->group) * (size_t)j->kv->head_dim;
}

/* scalar variant: task = (query, kv head), the reference over the whole context */
static void ref_task(void *arg, int task, int thread)
{
	struct decode_job *j = arg;
	int nkv = j->kv->n_kv_heads;
	int i = task / nkv, g = task % nkv;
	size_t off = head_off(j, i, g);
	mlens_cpu_attn_decode_group_ref(j->out + off, j->q + off, j->kv, j->layer, g,
					&j->qs[i], j->group, j->scale);
	if (j->half)	/* from out, which is the caller's room for it */
		put_half(j, off, j->out + off, j->group);
}

static void span_task(void *arg, int task, int thread)
{
	struct decode_job *j = arg;
	const struct attn_task *t = &j->tasks[task];
	size_t off = head_off(j, t->i, t->g);
	float *scratch = j->scratch + (size_t)thread * j->scratch_floats;
	struct mlens_attn_span s = {
		.kv = j->kv, .layer = j->layer, .g = t->g, .n_g = j->hpt, .group = j->group,
		.q = j->q + off, .block_table = j->qs[t->i].block_table,
		.t0 = t->t0, .t1 = t->t1, .scale = j->scale,
	};

	if (t->rec < 0) {
		s.out = j->half ? scratch + j->kern_floats : j->out + off;
	} else {
		float *rec = j->part + (size_t)t->rec * j->rec_floats;
		int H = j->hpt * j->group;
		size_t gh = (size_t)H * j->kv->head_dim;
		s.acc = rec;
		s.m = rec + gh;
		s.l = rec + gh + H;
	}
	j->var->span(&s, scratch);
	if (j->half && t->rec < 0)
		put_half(j, off, s.out, j->hpt * j->group);
}

/* Merge the chunks of one split (query, KV heads) in chunk order: the task
 * list holds chunk 0 of each split pair at merge index task. */
static void merge_task(void *arg, int task, int thread)
{
	struct decode_job *j = arg;
	const struct attn_task *t = &j->tasks[task];
	int hd = j->kv->head_dim, G = j->hpt * j->group, nch = t->t1;
	size_t gh = (size_t)G * hd;
	float *out = j->half ? j->scratch + (size_t)thread * j->scratch_floats + j->kern_floats
			     : j->out + head_off(j, t->i, t->g);

	for (int h = 0; h < G; h++) {
		float M = -INFINITY, L = 0.0f;
		float *o = out + (size_t)h * hd;
		for (int c = 0; c < nch; c++) {
			const float *rec = j->part + (size_t)(t->rec + c) * j->rec_floats;
			M = rec[gh + h] > M ? rec[gh + h] : M;
		}
		for (int d = 0; d < hd; d++)
			o[d] = 0.0f;
		for (int c = 0; c < nch; c++) {
			const float *rec = j->part + (size_t)(t->rec + c) * j->rec_floats;
			float w = expf(rec[gh + h] - M);
			const float *a = rec + (size_t)h * hd;
			L += rec[gh + G + h] * w;
			for (int d = 0; d < hd; d++)
				o[d] += a[d] * w;
		}
		for (int d = 0; d < hd; d++)
			o[d] /= L;
	}
	if (j->half)
		put_half(j, head_off(j, t->i, t->g), out, G);
}

static int decode(struct mlens_pool *pool, struct mlens_cpu_attn_ws *ws, float *out, void *half,
		  enum mlens_dtype half_dt, const float *q, const struct mlens_kv_cache *kv,
		  int layer, const struct mlens_attn_query *queries, int n, int n_heads,
		  float scale)
{
	struct decode_job j = {
		.out = out, .half = half, .half_dt = half_dt, .q = q, .kv = kv, .layer = layer,
		.nh = n_heads, .qs = queries, .scale = scale, .var = get_variant(),
	};
	int nkv = kv->n_kv_heads, hd = kv->head_dim, nt = mlens_pool_size(pool);
	size_t n_tasks = 0, n_recs = 0, n_merge = 0, n_chunks = 0;
	int n_hb;
	struct attn_task *tasks;

	if (nkv <= 0 || n_heads <= 0 || n_heads % nkv || hd <= 0 || kv->block_size <= 0)
		return -EINVAL;
	if (layer < 0 || layer >= kv->n_layers)
		return -ERANGE;
	for (int i = 0; i < n; i++)
		if (queries[i].ctx_len <= 0 ||
		    (int64_t)queries[i].n_blocks * kv->block_size < queries[i].ctx_len)
			return -ERANGE;
	j.group = n_heads / nkv;
	if (n <= 0)
		return 0;
	if (!j.var->span || hd % j.var->width || hd > 256 ||
	    (kv->dtype != MLENS_DTYPE_BF16 && kv->dtype != MLENS_DTYPE_F32 &&
	     kv->dtype != MLENS_DTYPE_E4M3)) {
		/* scalar chosen, or a shape the vector kernels do not cover */
		mlens_pool_run(pool, n * nkv, ref_task, &j);
		return 0;
	}

	j.chunk = mlens_attn_tune.chunk_tokens > 0 ? mlens_attn_tune.chunk_tokens
						    : MLENS_ATTN_CHUNK_TOKENS;
	j.chunk = (j.chunk + kv->block_size - 1) / kv->block_size * kv->block_size;
	/* chunks in all, and those of split queries (partial records) and
	 * how many such queries (merges), per head block */
	for (int i = 0; i < n; i++) {
		int32_t len;
		size_t nch = (size_t)ctx_chunks(queries[i].ctx_len, j.chunk, kv->block_size, &len);
		n_chunks += nch;
		if (nch > 1) {
			n_recs += nch;
			n_merge++;
		}
	}
	/* All KV heads in one task read each block as one run (better for the
	 * prefetchers and DRAM pages than one 4 KB piece per head); fewer heads
	 * per task only when the batch would otherwise not feed every thread.
	 * Heads never interact, so this choice does not change any result. */
	j.hpt = nkv;
	if (mlens_attn_tune.heads_per_task > 0 && mlens_attn_tune.heads_per_task < nkv) {
		j.hpt = mlens_attn_tune.heads_per_task;
		while (nkv % j.hpt)
			j.hpt--;
	}
	while (j.hpt > 1 && n_chunks * (size_t)(nkv / j.hpt) < 4 * (size_t)nt) {
		int d = j.hpt - 1;
		while (nkv % d)
			d--;
		j.hpt = d;
	}
	n_hb = nkv / j.hpt;
	n_tasks = n_chunks * (size_t)n_hb;
	n_recs *= (size_t)n_hb;
	n_merge *= (size_t)n_hb;
	j.rec_floats = (size_t)j.hpt * j.group * (hd + 2);
	j.kern_floats = (mlens_attn_scratch_floats(j.hpt * j.group, hd) + 15) & ~(size_t)15;
	j.scratch_floats = j.kern_floats;
	if (half)	/* a task's fp32 output, rounded from there */
		j.scratch_floats += ((size_t)j.hpt * j.group * hd + 15) & ~(size_t)15;
	if (n_tasks + n_merge > (size_t)INT32_MAX || n_recs > (size_t)INT32_MAX ||
	    ws_reserve(&ws->tasks, &ws->tasks_bytes, (n_tasks + n_merge) * sizeof(*tasks)) ||
	    ws_reserve((void **)&ws->part, &ws->part_bytes, n_recs * j.rec_floats * sizeof(float)) ||
	    ws_reserve((void **)&ws->scratch, &ws->scratch_bytes,
		       (size_t)nt * j.scratch_floats * sizeof(float)))
		return -ENOMEM;
	tasks = ws->tasks;
	j.tasks = tasks;
	j.part = ws->part;
	j.scratch = ws->scratch;

	/* Attention tasks first, in (query, head block, chunk) order; then one
	 * merge entry per split pair. Tasks are at most one chunk, so the last
	 * task to finish is short whatever the lengths in the batch. */
	{
		size_t k = 0, m = n_tasks;
		int32_t rec = 0;
		for (int i = 0; i < n; i++) {
			int32_t ctx = queries[i].ctx_len, len;
			int32_t nch = ctx_chunks(ctx, j.chunk, kv->block_size, &len);
			for (int g = 0; g < nkv; g += j.hpt) {
				for (int32_t c = 0; c < nch; c++) {
					int32_t t0 = c * len, t1 = t0 + len < ctx ? t0 + len : ctx;
					tasks[k++] = (struct attn_task){ i, g, t0, t1, nch > 1 ? rec + c : -1 };
				}
				if (nch > 1) {
					tasks[m++] = (struct attn_task){ i, g, 0, nch, rec };
					rec += nch;
				}
			}
		}
	}
	mlens_pool_run(pool, (int)n_tasks, span_task, &j);
	if (n_merge) {
		j.tasks = tasks + n_tasks;
		mlens_pool_run(pool, (int)n_merge, merge_task, &j);
	}
	return 0;
}

int mlens_cpu_attn_decode(struct mlens_pool *pool, struct mlens_cpu_attn_ws *ws,
			  float *out, const float *q, const struct mlens_kv_cache *kv,
			  int layer, const struct mlens_attn_query *queries, int n,
			  int n_heads, float scale)
{
	return decode(pool, ws, out, NULL, MLENS_DTYPE_F32, q, kv, layer, queries, n, n_heads,
		      scale);
}

int mlens_cpu_attn_decode_half(struct mlens_pool *pool, struct mlens_cpu_attn_ws *ws,
			       void *half, enum mlens_dtype dt, float *out, const float *q,
			       const struct mlens_kv_cache *kv, int layer,
			       const struct mlens_attn_query *queries, int n, int n_heads,
			       float scale)
{
	if (!half || !out || (dt != MLENS_DTYPE_BF16 && dt != MLENS_DTYPE_F16))
		return -EINVAL;
	return decode(pool, ws, out, half, dt, q, kv, layer, queries, n, n_heads, scale);
}

/* ==== append ==== */

/* Rows a task of the pooled append converts: 32 rows of Mixtral's 8 KV
 * heads x 128 read 256 KiB of fp32 K and V. */
#define APPEND_ROWS 32

struct append_job {
	struct mlens_kv_cache *kv;
	const struct attn_variant *var;
	const float *k, *v;
	const int64_t *slots;
	int layer, n;
};

static void append_rows(const struct append_job *j, int i0, int i1)
{
	struct mlens_kv_cache *kv = j->kv;
	size_t es = mlens_dtype_size(kv->dtype);
	int hd = kv->head_dim;
	for (int i = i0; i < i1; i++) {
		uint32_t block = (uint32_t)(j->slots[i] / kv->block_size);
		int off = (int)(j->slots[i] % kv->block_size);
		for (int g = 0; g < kv->n_kv_heads; g++) {
			size_t idx = mlens_kv_index(kv, j->layer, block, g, off);
			const float *ks = j->k + ((size_t)i * kv->n_kv_heads + g) * hd;
			const float *vs = j->v + ((size_t)i * kv->n_kv_heads + g) * hd;
			char *kd = (char *)kv->k + idx * es, *vd = (char *)kv->v + idx * es;
			if (kv->dtype == MLENS_DTYPE_E4M3) {
				size_t r = idx / (size_t)hd;
				mlens_e4m3_row_fn q = j->var->e4m3_row ? j->var->e4m3_row
								       : mlens_e4m3_quantize_row;
				mlens_kv_scales(kv, kv->k)[r] = q((uint8_t *)kd, ks, hd);
				mlens_kv_scales(kv, kv->v)[r] = q((uint8_t *)vd, vs, hd);
				continue;
			}
			if (kv->dtype == MLENS_DTYPE_BF16 && j->var->cvt) {
				j->var->cvt((uint16_t *)(void *)kd, ks, (size_t)hd);
				j->var->cvt((uint16_t *)(void *)vd, vs, (size_t)hd);
				continue;
			}
			for (int d = 0; d < hd; d++) {
				mlens_store(kd, kv->dtype, (size_t)d, ks[d]);
				mlens_store(vd, kv->dtype, (size_t)d, vs[d]);
			}
		}
	}
}

static void append_task(void *arg, int task, int thread)
{
	const struct append_job *j = arg;
	int i0 = task * APPEND_ROWS, i1 = i0 + APPEND_ROWS < j->n ? i0 + APPEND_ROWS : j->n;
	(void)thread;
	append_rows(j, i0, i1);
}

/* ==== round ==== */

/* Values a task of the pooled round converts: 64 Ki fp32 (256 KiB in). */
#define ROUND_VALUES (64 * 1024)

struct round_job {
	const struct attn_variant *var;
	void *dst;
	enum mlens_dtype dt;
	const float *src;
	size_t n;
};

static void round_span(const struct round_job *j, size_t i0, size_t i1)
{
	round_into(j->var, (char *)j->dst + i0 * mlens_dtype_size(j->dt), j->dt, j->src + i0,
		   i1 - i0);
}

static void round_task(void *arg, int task, int thread)
{
	const struct round_job *j = arg;
	size_t i0 = (size_t)task * ROUND_VALUES, i1 = i0 + ROUND_VALUES < j->n ? i0 + ROUND_VALUES : j->n;
	(void)thread;
	round_span(j, i0, i1);
}

int mlens_cpu_round(struct mlens_pool *pool, void *dst, enum mlens_dtype dt, const float *src,
		    int rows, int cols)
{
	struct round_job j = { get_variant(), dst, dt, src, (size_t)rows * (size_t)cols };

	if (rows < 0 || cols < 0 || (dt != MLENS_DTYPE_BF16 && dt != MLENS_DTYPE_F16))
		return -EINVAL;
	/* one attention output of a token group (hundreds of rows of 4096)
	 * is milliseconds of one thread's work: the pool shares it */
	if (pool && j.n > ROUND_VALUES && mlens_pool_size(pool) > 1)
		mlens_pool_run(pool, (int)((j.n + ROUND_VALUES - 1) / ROUND_VALUES), round_task, &j);
	else
		round_span(&j, 0, j.n);
	return 0;
}

int mlens_cpu_kv_append(struct mlens_pool *pool, struct mlens_kv_cache *kv, int layer,
			const float *k, const float *v, const int64_t *slots, int n)
{
	struct append_job j = { kv, get_variant(), k, v, slots, layer, n };

	if (layer < 0 || layer >= kv->n_layers || kv->block_size <= 0)
		return -ERANGE;
	for (int i = 0; i < n; i++)
		if (slots[i] < 0 || slots[i] / kv->block_size >= kv->n_blocks)
			return -ERANGE;
	/* Each row goes to its own slot, so the rows split freely over the
	 * pool. One thread converting a prefill group of 4096 rows (48 MiB of
	 * fp32 in, 16 MiB of bf16 out, Mixtral) took about half of the CPU side
	 * of each group in traces, with the pool idle meanwhile. */
	if (pool && n > APPEND_ROWS && mlens_pool_size(pool) > 1)
		mlens_pool_run(pool, (n + APPEND_ROWS - 1) / APPEND_ROWS, append_task, &j);
	else
		append_rows(&j, 0, n);
	return 0;
}
