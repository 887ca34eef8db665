/* Description: the hybrid pipeline's executor (daemon/exec/pipeline.c) with
 * the CPU backend on both sides (the program run in order): greedy tokens
 * equal to the engine's and logits within 1e-5 over prefill, decode and
 * mixed steps, in one and two token groups, through the engine's hybrid
 * mode, and under the unchanged scheduler with preemption (same tokens as
 * the engine); experts left on disk streamed from their staging give the
 * same; every streamed expert byte crosses once per step; the GPU
 * side stays within the budget. A traced step driven by threads has the
 * GPU side's and the mover's host-time spans, one per command and one per
 * wait for another side. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <jansson.h>
#include "daemon/plan/gpu_plan.h"
#include "daemon/exec/op_time.h"
#include "daemon/exec/pipeline.h"
#include "daemon/exec/pipeprog.h"
#include "daemon/serve/sched.h"
#include "daemon/ops/trace.h"
#include "daemon/model/disk_tier.h"
#include "daemon/model/weights.h"
#include "daemon/tools/mkmodel.h"
#include "tests/check_common.h"
#include "tests/testmodel.h"

/* ==== the executor, CPU on both sides ==== */

#define N_SEQ 4
#define N_STEPS 6

struct side {
	struct mlens_backend be, attn;
	struct mlens_engine *e;
	struct mlens_seq seq[N_SEQ];
};

static struct mlens_test_spec spec4(void)
{
	struct mlens_test_spec s = mlens_test_spec_tiny();
	s.layers = 4;	/* more than two layers: streaming is the cheapest residency */
	return s;
}

/* A budget that holds no resident expert: the minimum for max_tokens (with
 * sets activation sets; 0: two). */
static uint64_t stream_budget(const struct mlens_model *m, int max_tokens, int64_t group, int sets)
{
	struct mlens_perf_model pm;
	struct mlens_gpu_plan_in in = { .budget = UINT64_MAX / 4, .max_tokens = max_tokens,
				       .min_tokens = max_tokens, .group = group, .sets = sets };
	struct mlens_gpu_plan p;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &m->cfg, MLENS_DTYPE_F32), 0);
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	return p.minimum;
}

/* The hybrid plan a pipeline of 64 tokens at most runs on budget bytes
 * (at least min_tokens a step; group rows, sets activation sets, the
 * attention output up in the weights' dtype where att_half). */
static int test_plan(const struct mlens_model *m, uint64_t budget, int min_tokens, int64_t group,
		     int sets, bool att_half, struct mlens_gpu_plan *out, char *err, size_t errlen)
{
	struct mlens_perf_model pm;
	struct mlens_gpu_plan_in in = { .budget = budget, .max_tokens = 64, .min_tokens = min_tokens,
				       .group = group, .sets = sets, .att_half = att_half };
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &m->cfg, MLENS_DTYPE_F32), 0);
	return mlens_gpu_plan_make(&pm, &in, out, err, errlen);
}

/* ... at stream_budget for the group and sets. */
static const struct mlens_gpu_plan *stream_plan(const struct mlens_model *m, int64_t group, int sets,
						 bool att_half, struct mlens_gpu_plan *out)
{
	ck_assert_int_eq(test_plan(m, stream_budget(m, 64, group, sets), 0, group, sets, att_half, out,
				   NULL, 0), 0);
	return out;
}

/* The CPU backend with the queue and event ops of a GPU backend, done at
 * once (copies are memcpy, events always complete): the pipeline then runs
 * its two-thread executor, host side and GPU side on threads of their own,
 * as on a GPU. */
static int fa_register(void *ctx, void *p, size_t bytes)
{
	(void)ctx, (void)p, (void)bytes;
	return 0;
}
static void fa_unregister(void *ctx, void *p)
{
	(void)ctx, (void)p;
}
static void *fa_alloc(void *ctx, size_t bytes)
{
	(void)ctx;
	return malloc(bytes);
}
static void fa_free(void *ctx, void *p)
{
	(void)ctx;
	free(p);
}
/* > 0: the copy that takes it to 0 fails (-EIO), from whichever thread */
static int fa_fail_in;

/* Queue 2 (the side copy queue) is as late as it may be: its copies are
 * held until someone waits for an event recorded on it after them, and
 * only then done, reading the source as it is by then. A pipeline that
 * read the host copy before waiting, or wrote the source before the copy
 * was waited for, gets wrong bytes. */
#define FA_Q2_MAX 4096
static pthread_mutex_t fa_mu = PTHREAD_MUTEX_INITIALIZER;
/* a copy, or (kv set) a K/V append of n rows at slots (kv_append_side) */
static struct fa_q2_op {
	void *dst;
	const void *src;
	size_t bytes;
	struct mlens_kv_cache *kv;
	const float *k, *v;
	int64_t *slots;
	int layer, n;
} fa_q2[FA_Q2_MAX];
static int fa_q2_n, fa_q2_done, fa_q2_copies, fa_q2_appends;
static int fa_q3_copies;	/* uploads on queue 3, held with queue 2's ops */
static int fa_q2_upto[MLENS_BACKEND_EVENTS];	/* the ops before a queue-2 record */
static bool fa_on_q2[MLENS_BACKEND_EVENTS];	/* the event's last record was on queue 2 */

/* The append as kv_append stores it (element by element, the pool's dtype),
 * reading k and v as they are now. */
static void fa_append_now(const struct fa_q2_op *o)
{
	const struct mlens_kv_cache *kv = o->kv;
	int hd = kv->head_dim, nkv = kv->n_kv_heads;
	for (int i = 0; i < o->n; i++) {
		uint32_t b = (uint32_t)(o->slots[i] / kv->block_size);
		int off = (int)(o->slots[i] % kv->block_size);
		for (int g = 0; g < nkv; g++) {
			size_t at = mlens_kv_index(kv, o->layer, b, g, off);
			for (int d = 0; d < hd; d++) {
				size_t src = ((size_t)i * nkv + g) * hd + d;
				mlens_store(kv->k, kv->dtype, at + d, o->k[src]);
				mlens_store(kv->v, kv->dtype, at + d, o->v[src]);
			}
		}
	}
}

/* Compute-queue writes over the source of a queue-2 op still held: a GPU
 * would overwrite what the op has yet to read (a pipeline that rewrote a
 * set's k or v before the stores from it were waited for). Counted by
 * fa_check_write, which the device's GEMMs call; a run asserts none. */
static int fa_hazards;

static bool fa_overlap(const void *a, size_t an, const void *b, size_t bn)
{
	const char *x = a, *y = b;
	return an && bn && x < y + bn && y < x + an;
}

static void fa_check_write(const void *dst, size_t bytes)
{
	pthread_mutex_lock(&fa_mu);
	for (int i = fa_q2_done; i < fa_q2_n; i++) {
		const struct fa_q2_op *o = &fa_q2[i];
		if (o->kv) {
			size_t row = (size_t)o->kv->n_kv_heads * (size_t)o->kv->head_dim * 4;
			if (fa_overlap(dst, bytes, o->k, row * (size_t)o->n) ||
			    fa_overlap(dst, bytes, o->v, row * (size_t)o->n))
				fa_hazards++;
		} else if (fa_overlap(dst, bytes, o->src, o->bytes)) {
			fa_hazards++;
		}
	}
	pthread_mutex_unlock(&fa_mu);
}

static void fa_q2_flush(int upto)	/* under fa_mu */
{
	for (; fa_q2_done < upto && fa_q2_done < fa_q2_n; fa_q2_done++) {
		struct fa_q2_op *o = &fa_q2[fa_q2_done];
		if (o->kv) {
			fa_append_now(o);
			free(o->slots);
			o->kv = NULL;
		} else {
			memcpy(o->dst, o->src, o->bytes);
		}
	}
	if (fa_q2_done == fa_q2_n) {
		fa_q2_n = fa_q2_done = 0;
		memset(fa_q2_upto, 0, sizeof(fa_q2_upto));
	}
}

/* Queue op onto queue 2 (a full queue runs first: earlier is allowed),
 * counted in *count. */
static void fa_q2_push(const struct fa_q2_op *op, int *count)
{
	pthread_mutex_lock(&fa_mu);
	if (fa_q2_n == FA_Q2_MAX)
		fa_q2_flush(fa_q2_n);
	fa_q2[fa_q2_n++] = *op;
	(*count)++;
	pthread_mutex_unlock(&fa_mu);
}

static int fa_copy(void *ctx, int queue, void *dst, const void *src, size_t bytes, bool to_device)
{
	(void)ctx, (void)to_device;
	if (__atomic_load_n(&fa_fail_in, __ATOMIC_SEQ_CST) > 0 &&
	    __atomic_sub_fetch(&fa_fail_in, 1, __ATOMIC_SEQ_CST) == 0)
		return -EIO;
	if (queue == 2 || queue == 3) {
		fa_q2_push(&(struct fa_q2_op){ .dst = dst, .src = src, .bytes = bytes },
			   queue == 2 ? &fa_q2_copies : &fa_q3_copies);
		return 0;
	}
	memcpy(dst, src, bytes);
	return 0;
}
/* kv_append_side: held on queue 2 like the copies, the slots read now */
static int fa_append_side(void *ctx, struct mlens_kv_cache *kv, int layer, const float *k,
			  const float *v, const int64_t *slots, int n)
{
	int64_t *own = malloc((size_t)(n > 0 ? n : 1) * sizeof(*own));
	(void)ctx;
	if (!own)
		return -ENOMEM;
	memcpy(own, slots, (size_t)n * sizeof(*own));
	fa_q2_push(&(struct fa_q2_op){ .kv = kv, .k = k, .v = v, .slots = own, .layer = layer, .n = n },
		   &fa_q2_appends);
	return 0;
}
static int fa_record(void *ctx, int queue, int ev)
{
	(void)ctx;
	pthread_mutex_lock(&fa_mu);
	fa_on_q2[ev] = queue >= 2;	/* queue 3's ops wait in queue 2's list */
	fa_q2_upto[ev] = fa_q2_n;
	pthread_mutex_unlock(&fa_mu);
	return 0;
}
static int fa_flush_to(int ev)
{
	pthread_mutex_lock(&fa_mu);
	if (fa_on_q2[ev])
		fa_q2_flush(fa_q2_upto[ev]);
	pthread_mutex_unlock(&fa_mu);
	return 0;
}
/* > 0: a host's wait first sleeps this long (us), so that the GPU side's
 * thread issues what it may meanwhile: a queue-0 write that only a
 * queue-0 wait keeps behind a queue-2 op then comes before the op */
static int fa_host_wait_us;
static int fa_sync(void *ctx, int ev)
{
	(void)ctx;
	if (fa_host_wait_us > 0)
		usleep((useconds_t)fa_host_wait_us);
	return fa_flush_to(ev);
}
static int fa_wait(void *ctx, int queue, int ev)
{
	(void)ctx, (void)queue;
	return fa_flush_to(ev);	/* the queues of this device run at once */
}
/* the last scratch_reserve: the pipeline holds its plan's scratch, and
 * gives the limit back (0) when it goes */
static size_t fa_reserved = SIZE_MAX;
static int fa_reserve(void *ctx, size_t bytes)
{
	(void)ctx;
	fa_reserved = bytes;
	return 0;
}
static struct mlens_backend_ops fa_ops;
/* make_async gives the device kv_append_side (with a side queue) */
static bool fa_with_append_side;
/* the backend's own gemm, under make_async's checked one */
static int (*fa_base_gemm)(void *ctx, float *out, const float *x, const void *w,
			   enum mlens_dtype dt, int n, int k, int m, bool accumulate);

static int fa_gemm(void *ctx, float *out, const float *x, const void *w, enum mlens_dtype dt,
		   int n, int k, int m, bool accumulate)
{
	fa_check_write(out, (size_t)n * (size_t)m * 4);
	return fa_base_gemm(ctx, out, x, w, dt, n, k, m, accumulate);
}

/* Set while a test opens a second async side beside a running one: that
 * side takes the same ops table as it stands (rewriting it, and zeroing
 * the counters, would race with the first side's pipeline threads). */
static bool fa_shared;

static void make_async(struct mlens_backend *be, bool side)
{
	if (fa_shared && fa_ops.size == sizeof(fa_ops) && fa_base_gemm == be->ops->gemm) {
		be->ops = &fa_ops;
		return;
	}
	fa_ops = *be->ops;
	fa_ops.size = sizeof(fa_ops);
	fa_base_gemm = be->ops->gemm;
	fa_ops.gemm = fa_gemm;
	fa_ops.host_register = fa_register;
	fa_ops.host_unregister = fa_unregister;
	fa_ops.host_alloc = fa_alloc;
	fa_ops.host_free = fa_free;
	fa_ops.copy_async = fa_copy;
	fa_ops.event_record = fa_record;
	fa_ops.event_wait = fa_wait;
	fa_ops.event_sync = fa_sync;
	fa_ops.scratch_reserve = fa_reserve;
	fa_ops.side_queue = side;
	fa_ops.kv_append_side = side && fa_with_append_side ? fa_append_side : NULL;
	fa_ops.up_queue = side;
	fa_q2_n = fa_q2_done = fa_q2_copies = fa_q2_appends = fa_q3_copies = fa_hazards = 0;
	memset(fa_on_q2, 0, sizeof(fa_on_q2));
	be->ops = &fa_ops;
}

/* A device whose gemm rounds its fp32 activations to the weights' dtype
 * first, as the CUDA backend's fast GEMMs do (fr_round set by
 * make_rounding): then it offers gemm_half_in, which takes rows so
 * rounded as they are, and the pipeline may send the CPU attention's
 * output up rounded (att_up_half). fr_gemm is the CPU backend's gemm. */
static int (*fr_gemm)(void *ctx, float *out, const float *x, const void *w, enum mlens_dtype dt,
		      int n, int k, int m, bool accumulate);
static int fr_half_in_calls;

/* the CPU's product of x as the device would see it: each value loaded
 * from x in dtype xt (after rounding to dt where xt is fp32) */
static int fr_product(void *ctx, float *out, const void *x, enum mlens_dtype xt, const void *w,
		      enum mlens_dtype dt, int n, int k, int m, bool accumulate)
{
	size_t N = (size_t)n * (size_t)k;
	float *xr = malloc(N ? N * sizeof(float) : 1);
	uint32_t h;	/* a value of dt (room for any) */
	int rc;
	if (!xr)
		return -ENOMEM;
	for (size_t i = 0; i < N; i++) {
		if (xt == MLENS_DTYPE_F32) {
			mlens_store(&h, dt, 0, ((const float *)x)[i]);
			xr[i] = mlens_load(&h, dt, 0);
		} else {
			xr[i] = mlens_load(x, xt, i);
		}
	}
	rc = fr_gemm(ctx, out, xr, w, dt, n, k, m, accumulate);
	free(xr);
	return rc;
}

static int fr_gemm_round(void *ctx, float *out, const float *x, const void *w, enum mlens_dtype dt,
			 int n, int k, int m, bool accumulate)
{
	fa_check_write(out, (size_t)n * (size_t)m * 4);
	if (dt == MLENS_DTYPE_F32)
		return fr_gemm(ctx, out, x, w, dt, n, k, m, accumulate);
	return fr_product(ctx, out, x, MLENS_DTYPE_F32, w, dt, n, k, m, accumulate);
}

static int fr_gemm_half_in(void *ctx, float *out, const void *x, const void *w, enum mlens_dtype dt,
			   int n, int k, int m, bool accumulate)
{
	fa_check_write(out, (size_t)n * (size_t)m * 4);
	if (dt == MLENS_DTYPE_F32)
		return -ENOTSUP;
	if (n)
		fr_half_in_calls++;
	return fr_product(ctx, out, x, dt, w, dt, n, k, m, accumulate);
}

/* its products of one input (the Q, K and V projections), counted */
static int fr_multi_calls;

static int fr_gemm_multi(void *ctx, float *const *out, const float *x, const void *const *w,
			 enum mlens_dtype dt, int n, int k, const int *m, int count)
{
	int rc = 0;
	if (count < 1 || count > MLENS_GEMM_MULTI_MAX)
		return -EINVAL;
	if (n)
		fr_multi_calls++;
	for (int i = 0; i < count && !rc; i++)
		rc = fr_gemm_round(ctx, out[i], x, w[i], dt, n, k, m[i], false);
	return rc;
}

/* make_async's device, with the rounding gemm */
static void make_rounding(struct mlens_backend *be, bool side)
{
	fr_gemm = be->ops->gemm;
	make_async(be, side);
	fa_ops.gemm = fr_gemm_round;
	fa_ops.gemm_half_in = fr_gemm_half_in;
	fa_ops.gemm_multi = fr_gemm_multi;
}

/* run_equal's hybrid side: the GPU side appends K/V to the pool (the
 * pipeline's gpu_kv_append) */
static bool run_gpu_append;
static bool run_op_timing;	/* engine opts op_timing */
/* ... with side copies, C's output up on queue 3 too (up_copy_in; off:
 * gpu_copy_out = down) */
static bool run_up_copy = true;
/* ... its activation sets (pipeline_sets; 0: the default) */
static int run_sets;
/* ... this many resident experts a layer (0: none, the plan at
 * stream_budget), kept as experts 0..r-1 or following the routing, re-chosen
 * every run_period steps */
static int run_resident;
static bool run_routing;
static int run_period;

/* The hybrid plan of 64 tokens with r resident experts a layer: the
 * smallest budget whose plan holds them. */
static const struct mlens_gpu_plan *resident_plan(const struct mlens_model *m, int r,
						  struct mlens_gpu_plan *out)
{
	uint64_t b = stream_budget(m, 64, 0, 0);
	uint64_t expert = 3ull * m->cfg.intermediate_size * m->cfg.hidden_size * 4;
	for (int i = 0; i < 64; i++, b += expert)
		if (!test_plan(m, b, 64, 0, 0, false, out, NULL, 0) && out->resident_experts == r)
			return out;
	ck_abort_msg("no budget holds %d resident experts a layer", r);
	return NULL;
}

static void side_open(struct side *sd, const struct mlens_model *m, bool hybrid, int groups,
		      int64_t group_tokens, bool prefill_cpu, bool async, bool side_out)
{
	struct mlens_backend_opts bo = { .n_threads = 1, .device = 0 };
	/* blocks of 4 tokens: the contexts span several, in runs and not */
	struct mlens_gpu_plan plan;
	struct mlens_engine_opts eo = { .kv_dtype = -1, .prefill_attn = MLENS_PREFILL_OP,
					.max_step_tokens = 64, .kv_blocks = 64, .kv_block_size = 4 };
	char err[512];
	memset(sd, 0, sizeof(*sd));
	ck_assert_int_eq(mlens_backend_cpu_create(&sd->be, &bo), 0);
	if (async)
		make_async(&sd->be, side_out);
	if (hybrid) {
		ck_assert_int_eq(mlens_backend_cpu_create(&sd->attn, &bo), 0);
		eo.attn_backend = &sd->attn;
		eo.plan = run_resident ? resident_plan(m, run_resident, &plan)
				       : stream_plan(m, group_tokens, run_sets, false, &plan);
		eo.hybrid_residency_routing = run_routing;
		eo.hybrid_residency_period = run_period;
		eo.hybrid_groups = groups;
		eo.hybrid_prefill_cpu = prefill_cpu;
		eo.hybrid_side_copy_out = side_out;
		eo.hybrid_up_copy_in = side_out && run_up_copy;
		eo.hybrid_gpu_kv_append = run_gpu_append;
	}
	eo.op_timing = run_op_timing;
	ck_assert_msg(mlens_engine_create(&sd->e, m, &sd->be, &eo, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(mlens_engine_pipeline(sd->e) != NULL, hybrid);
}

static void side_close(struct side *sd, bool hybrid)
{
	for (int i = 0; i < N_SEQ; i++)
		mlens_seq_fini(mlens_engine_kv(sd->e), &sd->seq[i]);
	mlens_engine_destroy(sd->e);
	mlens_backend_destroy(&sd->be);
	if (hybrid)
		mlens_backend_destroy(&sd->attn);
}

static double rel_diff(const float *a, const float *b, size_t n)
{
	double d = 0, m = 0;
	for (size_t i = 0; i < n; i++) {
		double x = fabs((double)a[i] - (double)b[i]), y = fabs((double)b[i]);
		d = x > d ? x : d;
		m = y > m ? y : m;
	}
	return m > 0 ? d / m : d;
}

/* One step of run_equal's scenario on sd: sequences 0-2 prefill in step 0,
 * sequence 3 in step 2 beside the others' decode tokens; next holds each
 * sequence's last token, logits each one's row. */
static void scenario_step(struct side *sd, int step, int32_t prompt[N_SEQ][16],
			  const int plen[N_SEQ], int32_t next[N_SEQ], float *logits, size_t V)
{
	struct mlens_engine_req r[N_SEQ];
	int n = 0;
	memset(r, 0, sizeof(r));
	for (int i = 0; i < N_SEQ; i++) {
		bool pre = (i < 3 && step == 0) || (i == 3 && step == 2);
		if (!pre && (step == 0 || (i == 3 && step < 2)))
			continue;
		r[n].seq = &sd->seq[i];
		r[n].tokens = pre ? prompt[i] : &next[i];
		r[n].n_tokens = pre ? plen[i] : 1;
		r[n].logits = logits + (size_t)i * V;
		r[n].samp.counter = (uint64_t)step;
		n++;
	}
	ck_assert_int_eq(mlens_engine_step(sd->e, r, n), 0);
	for (int k = 0; k < n; k++)
		next[r[k].seq - sd->seq] = r[k].next_token;
}

/* Steps: sequences 0-2 prefill together; then decode steps, sequence 3
 * prefilling in step 2 beside the others' decode tokens. */
static void run_equal(int groups, int64_t group_tokens, bool prefill_cpu, bool async, bool side_out)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	static const int plen[N_SEQ] = { 5, 9, 3, 7 };
	int32_t prompt[N_SEQ][16], next[2][N_SEQ];
	struct side sd[2];
	size_t V = (size_t)ts.vocab;
	float *lg[2];
	uint64_t expert = 3ull * (uint64_t)ts.inter * (uint64_t)ts.hidden * 4;

	for (int i = 0; i < N_SEQ; i++)
		for (int j = 0; j < plen[i]; j++)
			prompt[i][j] = (int32_t)((i * 31 + j * 7 + 3) % ts.vocab);
	side_open(&sd[0], m, false, 0, 0, false, false, false);
	fa_reserved = SIZE_MAX;
	side_open(&sd[1], m, true, groups, group_tokens, prefill_cpu, async, side_out);
	if (async)
		ck_assert_uint_eq(fa_reserved, mlens_pipeline_plan(mlens_engine_pipeline(sd[1].e))->scratch);
	ck_assert_int_eq(mlens_pipeline_plan(mlens_engine_pipeline(sd[1].e))->resident_experts, 0);
	lg[0] = calloc(N_SEQ * V, sizeof(float));
	lg[1] = calloc(N_SEQ * V, sizeof(float));
	for (int step = 0; step < N_STEPS; step++) {
		for (int s = 0; s < 2; s++) {
			scenario_step(&sd[s], step, prompt, plen, next[s], lg[s], V);
		}
		for (int i = 0; i < N_SEQ; i++) {
			if (i == 3 && step < 2)
				continue;
			ck_assert_msg(next[0][i] == next[1][i], "step %d seq %d: hybrid token %d, engine %d",
				      step, i, next[1][i], next[0][i]);
			ck_assert_msg(rel_diff(lg[1] + i * V, lg[0] + i * V, V) <= 1e-5,
				      "step %d seq %d: logits differ by %g", step, i,
				      rel_diff(lg[1] + i * V, lg[0] + i * V, V));
		}
		{
			struct mlens_pipeline *p = mlens_engine_pipeline(sd[1].e);
			const struct mlens_pipeline_stats *st = mlens_pipeline_stats(p);
			/* every expert of every layer crossed exactly once a step;
			 * the first step also streams its own layers 0 and 1 (later
			 * steps find them prefetched by the step before) */
			ck_assert_uint_eq(st->h2d_weight_bytes,
					  (uint64_t)(ts.layers + (step == 0 ? 2 : 0)) * ts.experts * expert);
			ck_assert_uint_le(mlens_pipeline_gpu_bytes(p), mlens_pipeline_plan(p)->budget);
			ck_assert_int_eq(st->async, async);
			ck_assert_int_eq(st->side_copy_out, async && side_out);
			ck_assert_int_eq(st->up_copy_in, async && side_out && run_up_copy);
			ck_assert_int_eq(st->prefill_cpu, prefill_cpu);
			ck_assert_int_eq(st->sets, run_sets ? run_sets : MLENS_PIPE_SETS);
			/* with the GPU side appending, the host side appends nothing */
			ck_assert_int_eq(st->gpu_kv_append, run_gpu_append);
			ck_assert_int_eq(st->kv_append_side, run_gpu_append && async && side_out &&
							      fa_with_append_side);
			if (run_gpu_append)
				ck_assert(st->cpu_append_s == 0);
			else
				ck_assert(st->cpu_append_s > 0 && st->cpu_append_s <= st->cpu_attn_s);
			/* KV bytes the decode attention read: every decode token's
			 * context, K and V, every layer (F32 cache) */
			{
				uint64_t ctx = 0, per = (uint64_t)ts.layers * 2 * ts.kv_heads *
							ts.head_dim * 4, blocks = 0, runs = 0;
				const struct mlens_kv_pool *kv = mlens_engine_kv(sd[1].e);
				static uint64_t blocks0, runs0;
				for (int i = 0; i < 4; i++) {
					int64_t c = i < 3 ? (step > 0 ? plen[i] + step : 0)
							  : (step > 2 ? plen[3] + step - 2 : 0);
					ctx += (uint64_t)c;
					blocks += mlens_kv_blocks_for(kv, c);
					runs += mlens_seq_block_runs(&sd[1].seq[i], mlens_kv_blocks_for(kv, c));
				}
				if (step == 0)
					blocks0 = runs0 = 0;
				/* (cut prompts: their later segments read the cache too) */
				if (group_tokens == 0) {
					ck_assert_uint_eq(st->kv_read_bytes, ctx * per);
					/* and the blocks they lay in, and their runs */
					ck_assert_uint_eq(st->kv_read_blocks_total - blocks0, blocks);
					ck_assert_uint_eq(st->kv_read_runs_total - runs0, runs);
				} else {
					ck_assert_uint_ge(st->kv_read_bytes, ctx * per);
				}
				blocks0 = st->kv_read_blocks_total;
				runs0 = st->kv_read_runs_total;
			}
			ck_assert(st->gpu_busy_s > 0);
			ck_assert(st->gpu_busy_s_total >= st->gpu_busy_s);
			ck_assert_msg(fa_hazards == 0, "step %d: %d compute-queue writes over rows a "
				      "held queue-2 op has yet to read", step, fa_hazards);
			/* step 0: 17 prompt tokens in groups of at most group_tokens */
			if (step == 0 && group_tokens > 0)
				ck_assert_int_ge(st->groups, (17 + group_tokens - 1) / group_tokens);
			if (step == 0 && group_tokens == 0)
				ck_assert_int_eq(st->groups, groups);
		}
	}
	free(lg[0]);
	free(lg[1]);
	side_close(&sd[0], false);
	side_close(&sd[1], true);
	if (async)
		ck_assert_uint_eq(fa_reserved, 0);
	mlens_test_model_free(m);
}

/* Experts left on disk (weights_on_disk): a model from its files, half of
 * each layer's experts read each step into staging and streamed from
 * there (on the async device's copy queue), gives the engine's tokens and
 * logits with every expert in RAM; every streamed expert still crosses
 * once a step, and the disk ones are read about once a step. */
START_TEST(exec_disk_experts)
{
	char dir[64] = "/tmp/mlens-pd.XXXXXX", err[512], cmd[128];
	struct mlens_mkmodel_opts o = { .seed = 11 };
	struct mlens_model *m[2];
	struct mlens_weights w[2];
	static const int plen[N_SEQ] = { 5, 9, 3, 7 };
	int32_t prompt[N_SEQ][16], next[2][N_SEQ];
	struct side sd[2];
	float *lg[2];
	size_t V;
	uint64_t expert, read0 = 0;

	ck_assert_ptr_nonnull(mkdtemp(dir));
	ck_assert_int_eq(mlens_mkmodel_preset(&o, "tiny"), 0);
	o.dir = dir;
	o.cfg.num_hidden_layers = 4;
	o.cfg.dtype = MLENS_DTYPE_F32;
	ck_assert_msg(mlens_mkmodel_write(&o, err, sizeof(err)) == 0, "%s", err);
	for (int k = 0; k < 2; k++) {
		struct mlens_weights_opts wo = { .node = -1, .movers = 1, .io_uring = true, .disk_experts = 2 * k };
		ck_assert_msg(mlens_model_open(dir, &m[k], err, sizeof(err)) == 0, "%s", err);
		ck_assert_msg(mlens_weights_load(m[k], &wo, &w[k], err, sizeof(err)) == 0, "%s", err);
	}
	ck_assert_ptr_null(m[0]->disk);
	ck_assert_ptr_nonnull(m[1]->disk);
	V = (size_t)m[0]->cfg.vocab_size;
	expert = 3ull * (uint64_t)m[0]->cfg.intermediate_size * (uint64_t)m[0]->cfg.hidden_size * 4;
	for (int i = 0; i < N_SEQ; i++)
		for (int j = 0; j < plen[i]; j++)
			prompt[i][j] = (int32_t)((i * 31 + j * 7 + 3) % (int)V);
	side_open(&sd[0], m[0], false, 0, 0, false, false, false);
	fa_reserved = SIZE_MAX;
	side_open(&sd[1], m[1], true, 2, 0, false, true, false);
	ck_assert_int_eq(mlens_pipeline_plan(mlens_engine_pipeline(sd[1].e))->resident_experts, 0);
	lg[0] = calloc(N_SEQ * V, sizeof(float));
	lg[1] = calloc(N_SEQ * V, sizeof(float));
	for (int step = 0; step < N_STEPS; step++) {
		struct mlens_disk_tier_stats ds;
		const struct mlens_pipeline_stats *st = mlens_pipeline_stats(mlens_engine_pipeline(sd[1].e));
		for (int s = 0; s < 2; s++)
			scenario_step(&sd[s], step, prompt, plen, next[s], lg[s], V);
		for (int i = 0; i < N_SEQ; i++) {
			if (i == 3 && step < 2)
				continue;
			ck_assert_msg(next[0][i] == next[1][i], "step %d seq %d: token %d with experts on disk, %d in RAM",
				      step, i, next[1][i], next[0][i]);
			ck_assert_msg(rel_diff(lg[1] + i * V, lg[0] + i * V, V) <= 1e-5, "step %d seq %d: logits differ by %g",
				      step, i, rel_diff(lg[1] + i * V, lg[0] + i * V, V));
		}
		ck_assert_uint_eq(st->h2d_weight_bytes, (uint64_t)(4 + (step == 0 ? 2 : 0)) * 4 * expert);
		mlens_disk_tier_get_stats(m[1]->disk, &ds);
		ck_assert_uint_eq(ds.errors_total, 0);
		if (step == 0)
			read0 = ds.read_bytes_total;
		else if (step == N_STEPS - 1)	/* reads run ahead of the steps by a layer or two */
			ck_assert_msg(ds.read_bytes_total - read0 >= (N_STEPS - 2) * ds.step_bytes &&
				      ds.read_bytes_total - read0 <= N_STEPS * ds.step_bytes,
				      "%llu bytes read in %d steps of %llu", (unsigned long long)(ds.read_bytes_total - read0),
				      N_STEPS - 1, (unsigned long long)ds.step_bytes);
	}
	free(lg[0]);
	free(lg[1]);
	side_close(&sd[0], false);
	side_close(&sd[1], true);
	ck_assert_uint_eq(fa_reserved, 0);
	for (int k = 0; k < 2; k++) {
		mlens_weights_free(&w[k]);
		mlens_model_close(m[k]);
	}
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	ck_assert_int_eq(system(cmd), 0);
}
END_TEST

START_TEST(exec_equal_one_group)
{
	run_equal(1, 0, false, false, false);
}
END_TEST

START_TEST(exec_equal_two_groups)
{
	run_equal(2, 0, false, false, false);
	run_equal(2, 0, false, true, false);
}
END_TEST

/* Groups of 4 rows: the 17 prompt tokens of step 0 run as 5 groups, the
 * 9-token prompt cut into segments whose later parts read the cache. */
START_TEST(exec_equal_small_groups)
{
	run_equal(2, 4, false, false, false);
	run_equal(1, 3, true, false, false);
	run_equal(2, 4, false, true, false);	/* two threads drive it */
	run_equal(1, 3, true, true, false);
	run_equal(2, MLENS_GPU_PLAN_GROUP_AUTO, false, true, false);	/* the plan's choice */
}
END_TEST

/* GA's copies to the host on a side queue, and C's output back on an
 * upload queue, that run them as late as they may (fa_copy: when an event
 * recorded after them is waited for; a GB that read C's output before
 * waiting would read the last item's): the tokens and logits are the
 * engine's all the same, and the copies went there. */
START_TEST(exec_equal_side_copies)
{
	run_equal(2, 0, false, true, true);
	ck_assert_int_gt(fa_q2_copies, 0);
	ck_assert_int_gt(fa_q3_copies, 0);
	run_equal(2, 4, false, true, true);
	ck_assert_int_gt(fa_q2_copies, 0);
	ck_assert_int_gt(fa_q3_copies, 0);
	run_equal(1, 3, true, true, true);	/* prefill on the CPU: every row's q too */
	ck_assert_int_gt(fa_q2_copies, 0);
	ck_assert_int_gt(fa_q3_copies, 0);
	run_up_copy = false;	/* gpu_copy_out = down: the output up on queue 0 */
	run_equal(2, 0, false, true, true);
	ck_assert_int_gt(fa_q2_copies, 0);
	ck_assert_int_eq(fa_q3_copies, 0);
	run_up_copy = true;
	run_equal(2, 0, false, false, true);	/* no queues: nothing to put there */
}
END_TEST

START_TEST(exec_equal_prefill_on_cpu)
{
	run_equal(2, 0, true, false, false);
}
END_TEST

/* The GPU side writes K/V into the pool (a backend in host memory as the
 * device): tokens and logits are the engine's, on one thread and two,
 * with prompts cut into segments whose later parts read what an earlier
 * group's GA stored, with side copies, and with prefill on the CPU (which
 * still takes the fp32 K/V copies for its attention). */
START_TEST(exec_equal_gpu_kv_append)
{
	run_gpu_append = true;
	run_equal(2, 0, false, false, false);
	run_equal(2, 0, false, true, true);
	run_equal(2, 4, false, true, false);
	run_equal(1, 3, true, true, false);
	run_gpu_append = false;
}
END_TEST

/* ... on the side queue (kv_append_side), which stores as late as it may
 * (fa_append_side: when an event recorded on queue 2 after it is waited
 * for, from the rows as they are then): a C that attended before waiting,
 * or a GA that overwrote a set's K/V before, would read or store wrong
 * values. */
START_TEST(exec_equal_gpu_kv_append_side)
{
	run_gpu_append = true;
	fa_with_append_side = true;
	run_equal(2, 0, false, true, true);
	ck_assert_int_gt(fa_q2_appends, 0);
	run_equal(2, 4, false, true, true);	/* cut prompts read earlier groups' stores */
	ck_assert_int_gt(fa_q2_appends, 0);
	/* C's waits late and its output up on the compute queue (this
	 * device's queue 3 shares queue 2's list, so GB's wait for an upload
	 * there would run the stores too): a set's next GA, issued before
	 * them, must not write its k and v under the prefill rows' stores,
	 * which follow the record that C waits for */
	fa_host_wait_us = 2000;
	run_up_copy = false;
	run_equal(2, 0, false, true, true);
	run_equal(2, 4, false, true, true);
	run_up_copy = true;
	fa_host_wait_us = 0;
	run_equal(1, 3, true, true, true);	/* prefill on the CPU */
	ck_assert_int_gt(fa_q2_appends, 0);
	run_equal(2, 0, false, true, false);	/* no side queue: the compute queue's append */
	ck_assert_int_eq(fa_q2_appends, 0);
	fa_with_append_side = false;
	run_gpu_append = false;
}
END_TEST

/* The CPU attention's output up in the weights' dtype (att_up_half) on a
 * device whose gemm rounds its activations so anyway: the same tokens and
 * the same logits to the bit as the fp32 upload on that device, with the
 * upload half the bytes, through the upload queue and the compute queue
 * (_i & 1: gpu_copy_out side or down), with the prefill rows' output
 * rounded on the device or (_i & 2: prefill on the CPU) sent up too, and
 * (_i & 4) in groups of 4 rows with three sets: prompts cut between
 * groups (their later rows attend on the CPU), GA two groups ahead. The
 * side queues hold their copies until waited for, so a GB that read the
 * rows before they arrived, a round that wrote over q rows still to be
 * copied, or rows at the wrong offset would change a logit. A bf16 model
 * and pool; the CPU appends K/V (kv_append = cpu) on one run of each, the
 * GPU side on the other. */
START_TEST(exec_half_att_same_product)
{
	bool side_out = _i & 1, prefill_cpu = _i & 2, cut = _i & 4;
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m;
	static const int plen[N_SEQ] = { 5, 9, 3, 7 };
	int32_t prompt[N_SEQ][16], next[2][N_SEQ];
	struct side sd[2];
	size_t V;
	float *lg[2];
	uint64_t up[2] = { 0, 0 };

	ts.dtype = MLENS_DTYPE_BF16;
	m = mlens_test_model_new(&ts);
	V = (size_t)ts.vocab;
	for (int i = 0; i < N_SEQ; i++)
		for (int j = 0; j < plen[i]; j++)
			prompt[i][j] = (int32_t)((i * 31 + j * 7 + 3) % ts.vocab);
	for (int s = 0; s < 2; s++) {
		struct mlens_backend_opts bo = { .n_threads = 2, .device = 0 };
		struct mlens_gpu_plan plan;
		struct mlens_engine_opts eo = { .kv_dtype = -1, .prefill_attn = MLENS_PREFILL_OP,
						.max_step_tokens = 64, .kv_blocks = 64 };
		char err[512];
		memset(&sd[s], 0, sizeof(sd[s]));
		ck_assert_int_eq(mlens_backend_cpu_create(&sd[s].be, &bo), 0);
		/* one device table for both: its threads read it, so it is
		 * written before the first engine starts them, never after */
		if (!s)
			make_rounding(&sd[s].be, side_out);
		else
			sd[s].be.ops = &fa_ops;
		ck_assert_int_eq(mlens_backend_cpu_create(&sd[s].attn, &bo), 0);
		eo.attn_backend = &sd[s].attn;
		eo.plan = stream_plan(m, cut ? 4 : 0, cut ? 3 : 0,
				      s && mlens_pipeline_half_att(&sd[s].be, &sd[s].attn, &m->cfg), &plan);
		eo.hybrid_groups = 2;
		eo.hybrid_prefill_cpu = prefill_cpu;
		eo.hybrid_side_copy_out = side_out;
		eo.hybrid_up_copy_in = side_out;
		eo.hybrid_gpu_kv_append = s;
		ck_assert_msg(mlens_engine_create(&sd[s].e, m, &sd[s].be, &eo, err, sizeof(err)) == 0,
			      "%s", err);
		ck_assert_int_eq(mlens_pipeline_stats(mlens_engine_pipeline(sd[s].e))->att_up_half, s);
	}
	lg[0] = calloc(N_SEQ * V, sizeof(float));
	lg[1] = calloc(N_SEQ * V, sizeof(float));
	fr_half_in_calls = fr_multi_calls = 0;
	for (int step = 0; step < N_STEPS; step++) {
		for (int s = 0; s < 2; s++) {
			scenario_step(&sd[s], step, prompt, plen, next[s], lg[s], V);
			up[s] = mlens_pipeline_stats(mlens_engine_pipeline(sd[s].e))->h2d_act_bytes;
		}
		for (int i = 0; i < N_SEQ; i++) {
			if (i == 3 && step < 2)
				continue;
			ck_assert_msg(next[0][i] == next[1][i], "step %d seq %d: half %d, fp32 %d", step, i,
				      next[1][i], next[0][i]);
			ck_assert_msg(!memcmp(lg[0] + i * V, lg[1] + i * V, V * sizeof(float)),
				      "step %d seq %d: logits differ by %g", step, i,
				      rel_diff(lg[1] + i * V, lg[0] + i * V, V));
		}
		/* the same rows went up, in half the bytes (step 0 prefills
		 * only: its output stays on the device unless the CPU made it) */
		if (step > 0 || prefill_cpu)
			ck_assert_uint_gt(up[0], 0);
		ck_assert_uint_eq(up[1] * 2, up[0]);
	}
	ck_assert_int_ge(fr_half_in_calls, N_STEPS * ts.layers);
	ck_assert_int_eq(fa_hazards, 0);
	/* GA's Q, K and V projections in one call of the device's op, every
	 * group of every layer of both engines; a count out of range is
	 * refused before any product */
	ck_assert_int_ge(fr_multi_calls, 2 * N_STEPS * ts.layers);
	ck_assert_int_eq(mlens_backend_gemm_multi(&fa_ops, sd[0].be.ctx, NULL, NULL, NULL,
						  MLENS_DTYPE_BF16, 1, 1, NULL, 0), -EINVAL);
	ck_assert_int_eq(mlens_backend_gemm_multi(&fa_ops, sd[0].be.ctx, NULL, NULL, NULL,
						  MLENS_DTYPE_BF16, 1, 1, NULL,
						  MLENS_GEMM_MULTI_MAX + 1), -EINVAL);
	for (int s = 0; s < 2; s++)
		side_close(&sd[s], true);
	mlens_test_model_free(m);
	free(lg[0]);
	free(lg[1]);
}
END_TEST

/* Three activation sets: GA two groups ahead where a layer has three or
 * more (groups of 4 rows here), on the device that holds its side queues'
 * copies and stores until waited for (a C that read a set before its
 * copies, or a GA that rewrote a set an earlier item still used, would
 * change a token or logit): the engine's tokens and logits, with copies on
 * the compute queue, down or both ways, the GPU side storing K/V from the
 * side queue, prefill on the CPU; two groups (nothing to look ahead into)
 * too. A fourth set is refused. */
START_TEST(exec_equal_three_sets)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	struct mlens_backend be, attn;
	struct mlens_backend_opts bo = { .n_threads = 1, .device = 0 };
	struct mlens_engine_opts eo = { .kv_dtype = -1, .max_step_tokens = 64, .kv_blocks = 64 };
	struct mlens_gpu_plan plan;
	struct mlens_engine *e;
	char err[512];

	run_sets = 3;
	run_equal(2, 4, false, false, false);
	run_equal(2, 4, false, true, false);
	run_equal(2, 4, false, true, true);
	run_up_copy = false;
	run_equal(2, 4, false, true, true);
	run_up_copy = true;
	run_gpu_append = true;
	fa_with_append_side = true;
	run_equal(2, 4, false, true, true);
	ck_assert_int_gt(fa_q2_appends, 0);
	fa_with_append_side = false;
	run_gpu_append = false;
	run_equal(1, 3, true, true, true);
	run_equal(2, 0, false, true, true);
	run_sets = 0;

	ck_assert_int_eq(mlens_backend_cpu_create(&be, &bo), 0);
	ck_assert_int_eq(mlens_backend_cpu_create(&attn, &bo), 0);
	eo.attn_backend = &attn;
	eo.plan = stream_plan(m, 0, 4, false, &plan);
	ck_assert_int_eq(mlens_engine_create(&e, m, &be, &eo, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "4 activation sets asked for; 2 or 3"), "%s", err);
	mlens_backend_destroy(&be);
	mlens_backend_destroy(&attn);
	mlens_test_model_free(m);
}
END_TEST

/* Spans of track (by its thread_name) whose name starts with prefix, and
 * whether each lies inside [t0, t1] (microseconds). */
static int count_spans(json_t *ev, const char *track, const char *prefix, double t0, double t1)
{
	json_int_t tid = -1;
	size_t i;
	json_t *e;
	int n = 0;
	json_array_foreach(ev, i, e) {
		json_t *args = json_object_get(e, "args");
		if (!strcmp(json_string_value(json_object_get(e, "name")), "thread_name") &&
		    !strcmp(json_string_value(json_object_get(args, "name")), track))
			tid = json_integer_value(json_object_get(e, "tid"));
	}
	json_array_foreach(ev, i, e) {
		const char *name = json_string_value(json_object_get(e, "name"));
		double ts, dur;
		if (strcmp(json_string_value(json_object_get(e, "ph")), "X") ||
		    json_integer_value(json_object_get(e, "tid")) != tid ||
		    strncmp(name, prefix, strlen(prefix)))
			continue;
		ts = json_number_value(json_object_get(e, "ts"));
		dur = json_number_value(json_object_get(e, "dur"));
		ck_assert_msg(dur >= 0 && ts >= t0 - 1 && ts + dur <= t1 + 1,
			      "%s span %s [%g, %g] outside its step [%g, %g]", track, name, ts,
			      ts + dur, t0, t1);
		n++;
	}
	return n;
}

/* A traced step of the two-thread executor: the GPU side queues HEAD, GA
 * and GB of each of the 4 layers (one group), waiting for each GB's CPU
 * attention and for each layer's weights; the mover streams layers 0 to 3
 * and, for the next step, 0 and 1 again, each after the slot's freed
 * record, which it waits for except for the first two. */
START_TEST(exec_trace_threads)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	struct side sd;
	char dir[] = "/tmp/check_pipeline.XXXXXX", path[64], err[256];
	int32_t prompt[6] = { 1, 2, 3, 4, 5, 6 };
	struct mlens_engine_req r = { 0 };
	json_error_t je;
	json_t *root, *ev, *e;
	double t0 = -1, t1 = -1;
	size_t i;
	const int L = ts.layers;

	side_open(&sd, m, true, 1, 0, false, true, false);
	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/t.json", dir);
	ck_assert_int_eq(mlens_trace_arm(mlens_engine_trace(sd.e), 1, path, NULL, NULL, err,
					 sizeof(err)), 0);
	r.seq = &sd.seq[0];
	r.tokens = prompt;
	r.n_tokens = 6;
	ck_assert_int_eq(mlens_engine_step(sd.e, &r, 1), 0);
	root = json_load_file(path, 0, &je);
	ck_assert_msg(root != NULL, "%s: %s", path, je.text);
	ev = json_object_get(root, "traceEvents");
	json_array_foreach(ev, i, e) {
		const char *name = json_string_value(json_object_get(e, "name"));
		if (!strcmp(name, "step 1")) {
			t0 = json_number_value(json_object_get(e, "ts"));
			t1 = t0 + json_number_value(json_object_get(e, "dur"));
		}
	}
	ck_assert(t0 >= 0);
	ck_assert_int_eq(count_spans(ev, "gpu-thread", "HEAD", t0, t1), 1);
	ck_assert_int_eq(count_spans(ev, "gpu-thread", "GA ", t0, t1), L);
	ck_assert_int_eq(count_spans(ev, "gpu-thread", "GB ", t0, t1), L);
	ck_assert_int_eq(count_spans(ev, "gpu-thread", "dep of GB ", t0, t1), L);
	ck_assert_int_eq(count_spans(ev, "gpu-thread", "dep of WAIT ", t0, t1), L);
	ck_assert_int_eq(count_spans(ev, "gpu-thread", "TAIL", t0, t1), 1);
	ck_assert_int_eq(count_spans(ev, "mover-thread", "WAIT ", t0, t1), L + 2);
	ck_assert_int_eq(count_spans(ev, "mover-thread", "dep of WAIT ", t0, t1), L);
	ck_assert_int_eq(count_spans(ev, "mover-thread", "RECORD ", t0, t1), L + 2);
	ck_assert_int_ge(count_spans(ev, "mover-thread", "COPY ", t0, t1), L + 2);
	ck_assert_int_eq(count_spans(ev, "mover-thread", "GA ", t0, t1), 0);
	/* the GPU's spans name each group's rows: the prompt's 6 */
	ck_assert_int_eq(count_spans(ev, "gpu", "GA l0 g0 n6", t0, t1), 1);
	ck_assert_int_eq(count_spans(ev, "gpu", "GB l3 g0 n6", t0, t1), 1);
	ck_assert_int_eq(count_spans(ev, "gpu", "TAIL l-1 g-1", t0, t1), 1);
	/* a prefill group reads no KV on the CPU */
	ck_assert_int_eq(count_spans(ev, "cpu-attn", "C l0 g0 kv0", t0, t1), 1);
	json_decref(root);
	ck_assert_int_eq(unlink(path), 0);

	/* a decode step: each layer's C names the KV bytes it read, 7
	 * positions x K and V x 2 KV heads x 8 x 4 bytes (fp32 cache) */
	{
		int32_t tok = r.next_token;
		char want[32];
		r.tokens = &tok;
		r.n_tokens = 1;
		ck_assert_int_eq(mlens_trace_arm(mlens_engine_trace(sd.e), 1, path, NULL, NULL, err,
						 sizeof(err)), 0);
		ck_assert_int_eq(mlens_engine_step(sd.e, &r, 1), 0);
		root = json_load_file(path, 0, &je);
		ck_assert_msg(root != NULL, "%s: %s", path, je.text);
		ev = json_object_get(root, "traceEvents");
		t0 = t1 = -1;
		json_array_foreach(ev, i, e) {
			if (!strcmp(json_string_value(json_object_get(e, "name")), "step 1")) {
				t0 = json_number_value(json_object_get(e, "ts"));
				t1 = t0 + json_number_value(json_object_get(e, "dur"));
			}
		}
		ck_assert(t0 >= 0);
		ck_assert_int_eq(ts.kv_heads * ts.head_dim, 16);
		for (int l = 0; l < L; l++) {
			snprintf(want, sizeof(want), "C l%d g0 kv896", l);
			ck_assert_msg(count_spans(ev, "cpu-attn", want, t0, t1) == 1, "no span %s", want);
		}
		json_decref(root);
		ck_assert_int_eq(unlink(path), 0);
	}
	ck_assert_int_eq(rmdir(dir), 0);
	side_close(&sd, true);
	mlens_test_model_free(m);
}
END_TEST

/* op_timing in hybrid mode, its host threads on: the GPU side's ops (and
 * only those) in the account, each step read, the FLOPs of the rows the
 * steps carried; the CPU's decode attention is not among them. */
START_TEST(exec_op_timing)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	struct side sd;
	int32_t prompt[6] = { 1, 2, 3, 4, 5, 6 }, tok;
	struct mlens_engine_req r = { 0 };
	struct mlens_op_time_totals t;
	const int L = ts.layers;
	const double qd = (double)ts.heads * ts.head_dim;

	run_op_timing = true;
	run_gpu_append = true;	/* the stores on the GPU side's queue 0 */
	side_open(&sd, m, true, 1, 0, false, true, false);
	run_op_timing = run_gpu_append = false;
	ck_assert_ptr_nonnull(mlens_engine_op_time(sd.e));
	r.seq = &sd.seq[0];
	r.tokens = prompt;
	r.n_tokens = 6;
	ck_assert_int_eq(mlens_engine_step(sd.e, &r, 1), 0);
	tok = r.next_token;
	r.tokens = &tok;
	r.n_tokens = 1;
	ck_assert_int_eq(mlens_engine_step(sd.e, &r, 1), 0);
	mlens_op_time_get(mlens_engine_op_time(sd.e), &t);
	ck_assert_uint_eq(t.steps, 2);
	ck_assert_uint_eq(t.dropped, 0);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_EMBED], 2);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_QKV], 2 * L);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_WO], 2 * L);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_KV_APPEND], 2 * L);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_PREFILL], L);	/* the prompt's step */
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_DECODE], 0);	/* on the CPU side */
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_LM_HEAD], 2);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_SAMPLE], 2);
	ck_assert_uint_ge(t.calls[MLENS_LAYER_OP_MOE], 2 * L);
	ck_assert_double_eq(t.flops[MLENS_LAYER_OP_WO], 2.0 * 7 * qd * ts.hidden * L);
	ck_assert_double_eq(t.flops[MLENS_LAYER_OP_LM_HEAD], 2.0 * 2 * ts.hidden * ts.vocab);
	/* 6 prompt rows: 21 causal pairs a layer */
	ck_assert_double_eq(t.flops[MLENS_LAYER_OP_PREFILL], 4.0 * qd * 21 * L);
	for (int i = 0; i < MLENS_LAYER_OP_N; i++)
		if (t.calls[i])
			ck_assert_msg(t.seconds[i] > 0, "%s", mlens_layer_op_name((enum mlens_layer_op)i));
	ck_assert(t.span_s > 0);
	side_close(&sd, true);
	mlens_test_model_free(m);
}
END_TEST

/* The engine runs the plan it is handed: a GPU-only plan sets its step
 * cap; a GPU-only plan with an attention backend (hybrid mode) is refused,
 * and so is hybrid mode without a plan. */
START_TEST(exec_engine_takes_the_plan)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	struct mlens_backend_opts bo = { .n_threads = 1, .device = 0 };
	struct mlens_backend be, attn;
	struct mlens_gpu_plan gpu_only = { .gpu_only = true, .fits = true, .tokens = 24 };
	struct mlens_engine_opts eo = { .kv_dtype = -1, .max_step_tokens = 64, .kv_blocks = 64,
					.plan = &gpu_only };
	struct mlens_engine *e;
	char err[512];

	ck_assert_int_eq(mlens_backend_cpu_create(&be, &bo), 0);
	ck_assert_int_eq(mlens_backend_cpu_create(&attn, &bo), 0);
	ck_assert_msg(mlens_engine_create(&e, m, &be, &eo, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(mlens_engine_max_step_tokens(e), 24);
	mlens_engine_destroy(e);
	eo.attn_backend = &attn;
	ck_assert_int_eq(mlens_engine_create(&e, m, &be, &eo, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "GPU-only memory plan"));
	eo.plan = NULL;
	ck_assert_int_eq(mlens_engine_create(&e, m, &be, &eo, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "no hybrid GPU memory plan"));
	mlens_backend_destroy(&be);
	mlens_backend_destroy(&attn);
	mlens_test_model_free(m);
}
END_TEST

/* Small pieces, a refused budget, the cap lowered by the plan. */
START_TEST(exec_pieces_and_budget)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	struct mlens_backend_opts bo = { .n_threads = 1, .device = 0 };
	struct mlens_backend g, c;
	struct mlens_pipeline *p = NULL;
	struct mlens_gpu_plan plan;
	struct mlens_pipeline_opts po = { .piece_bytes = 5000,
					  .kv_blocks = 32, .kv_dtype = -1 };
	struct mlens_seq seq = { 0 };
	struct mlens_engine_req r = { 0 };
	int32_t prompt[6] = { 1, 2, 3, 4, 5, 6 };
	static int32_t big[65];
	char err[512];
	uint64_t expert = 3ull * (uint64_t)ts.inter * (uint64_t)ts.hidden * 4;

	ck_assert_int_eq(mlens_backend_cpu_create(&g, &bo), 0);
	ck_assert_int_eq(mlens_backend_cpu_create(&c, &bo), 0);
	/* one byte short of 64 tokens */
	ck_assert_int_eq(test_plan(m, stream_budget(m, 64, 0, 0) - 1, 64, 0, 0, false, &plan, err,
				   sizeof(err)), -ENOSPC);
	ck_assert_ptr_nonnull(strstr(err, "at least"));
	/* no plan, or a GPU-only one: refused */
	ck_assert_int_eq(mlens_pipeline_create(&p, m, &g, &c, &po, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "no hybrid GPU memory plan"));
	/* at least 8 tokens: the plan lowers the cap instead */
	ck_assert_int_eq(test_plan(m, stream_budget(m, 64, 0, 0) - 1, 8, 0, 0, false, &plan, err,
				   sizeof(err)), 0);
	po.plan = &plan;
	ck_assert_msg(mlens_pipeline_create(&p, m, &g, &c, &po, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_lt(mlens_pipeline_max_step_tokens(p), 64);
	ck_assert_int_ge(mlens_pipeline_max_step_tokens(p), 8);
	ck_assert_uint_le(mlens_pipeline_gpu_bytes(p), plan.budget);
	r.seq = &seq;
	r.tokens = prompt;
	r.n_tokens = 6;
	ck_assert_int_eq(mlens_pipeline_step(p, &r, 1), 0);
	ck_assert_int_eq(seq.len, 6);
	/* the first step: its layers, and layers 0 and 1 again for the next */
	ck_assert_uint_eq(mlens_pipeline_stats(p)->h2d_weight_bytes,
			  (uint64_t)(ts.layers + 2) * ts.experts * expert);
	r.tokens = big;
	r.n_tokens = 65;
	ck_assert_int_eq(mlens_pipeline_step(p, &r, 1), -E2BIG);
	mlens_seq_fini(mlens_pipeline_kv(p), &seq);
	mlens_pipeline_destroy(p);
	mlens_backend_destroy(&g);
	mlens_backend_destroy(&c);
	mlens_test_model_free(m);
}
END_TEST

/* A pipeline on the CPU backend with the queue ops (make_async) and po. */
static struct mlens_pipeline *fa_pipeline(const struct mlens_model *m, struct mlens_backend *g,
					  struct mlens_backend *c, const struct mlens_pipeline_opts *po)
{
	struct mlens_backend_opts bo = { .n_threads = 1, .device = 0 };
	struct mlens_pipeline *p = NULL;
	char err[512];

	ck_assert_int_eq(mlens_backend_cpu_create(g, &bo), 0);
	make_async(g, false);
	ck_assert_int_eq(mlens_backend_cpu_create(c, &bo), 0);
	ck_assert_msg(mlens_pipeline_create(&p, m, g, c, po, err, sizeof(err)) == 0, "%s", err);
	ck_assert(mlens_pipeline_stats(p)->async);
	return p;
}

static void fa_pipeline_close(struct mlens_pipeline *p, struct mlens_backend *g, struct mlens_backend *c)
{
	mlens_pipeline_destroy(p);
	mlens_backend_destroy(g);
	mlens_backend_destroy(c);
}

/* A copy that fails in the middle of a step (on the mover, the host side
 * or the GPU side) fails that step with its error and stops every side;
 * the next step streams layers 0 and 1 again and computes what a fresh
 * pipeline computes. */
START_TEST(exec_failure_recovers)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	struct mlens_backend g, c;
	struct mlens_pipeline *p;
	struct mlens_gpu_plan plan;
	struct mlens_pipeline_opts po = { .piece_bytes = 5000,
					  .kv_blocks = 64, .kv_dtype = -1 };
	int32_t prompt[7] = { 3, 1, 4, 1, 5, 9, 2 };
	uint64_t expert = 3ull * (uint64_t)ts.inter * (uint64_t)ts.hidden * 4;
	size_t V = (size_t)ts.vocab;
	float *lg0 = calloc(V, sizeof(float)), *lg1 = calloc(V, sizeof(float));
	int32_t first = -1;

	po.plan = stream_plan(m, 0, 0, false, &plan);
	p = fa_pipeline(m, &g, &c, &po);
	for (int round = 0; round < 4; round++) {
		struct mlens_seq seq = { 0 };
		struct mlens_engine_req r = { 0 };
		r.seq = &seq;
		r.tokens = prompt;
		r.n_tokens = 7;
		r.logits = round ? lg1 : lg0;
		if (round == 1 || round == 2) {
			/* the 3rd / 40th copy from now: early and late in the step */
			__atomic_store_n(&fa_fail_in, round == 1 ? 3 : 40, __ATOMIC_SEQ_CST);
			ck_assert_int_eq(mlens_pipeline_step(p, &r, 1), -EIO);
			ck_assert_int_eq(seq.len, 0);
			__atomic_store_n(&fa_fail_in, 0, __ATOMIC_SEQ_CST);
		} else {
			ck_assert_int_eq(mlens_pipeline_step(p, &r, 1), 0);
			ck_assert_int_eq(seq.len, 7);
			if (round == 0)
				first = r.next_token;
			/* after a failure the step streams its own layers 0 and 1 */
			ck_assert_uint_eq(mlens_pipeline_stats(p)->h2d_weight_bytes,
					  (uint64_t)(ts.layers + 2) * ts.experts * expert);
			ck_assert_int_eq(r.next_token, first);
			ck_assert(!memcmp(lg0, lg1, V * sizeof(float)) || round == 0);
		}
		mlens_seq_fini(mlens_pipeline_kv(p), &seq);
	}
	fa_pipeline_close(p, &g, &c);
	mlens_test_model_free(m);
	free(lg0);
	free(lg1);
}
END_TEST

/* The scheduler, unchanged, drives an engine in hybrid mode: a KV pool
 * small enough to preempt; every request's tokens as with the engine. */
#define SREQ 6
#define SMAX 10

struct stenant {
	struct mlens_sched_tenant st;	/* first: the emit callback casts back */
	int32_t tok[SREQ][SMAX];
	int n[SREQ];
};

static int stenant_emit(struct mlens_sched_tenant *t, const struct mlens_event *ev)
{
	struct stenant *x = (struct stenant *)t;
	ck_assert_uint_lt(ev->id, SREQ);
	ck_assert_int_eq(ev->status, 0);
	if (ev->token >= 0) {
		ck_assert_int_lt(x->n[ev->id], SMAX);
		x->tok[ev->id][x->n[ev->id]++] = ev->token;
	}
	return 0;
}

static void sched_run(struct mlens_model *m, bool hybrid, struct stenant *t, uint64_t *preempt)
{
	struct mlens_backend_opts bo = { .n_threads = 1, .device = 0 };
	struct mlens_backend be, attn;
	struct mlens_gpu_plan plan;
	struct mlens_engine_opts eo = { .kv_block_size = 4, .kv_blocks = 14, .kv_dtype = -1,
					.max_step_tokens = 64, .prefill_attn = MLENS_PREFILL_OP };
	/* a one-step look-ahead: the small pool preempts as sequences grow */
	struct mlens_sched_opts so = { .token_cap = 0, .reserve_horizon = 1 };
	struct mlens_quota q = { 0, 0, 1000, 1.0 };
	struct mlens_engine *e;
	struct mlens_sched *s;
	char err[512];
	int steps = 0;

	ck_assert_int_eq(mlens_backend_cpu_create(&be, &bo), 0);
	if (hybrid) {
		ck_assert_int_eq(mlens_backend_cpu_create(&attn, &bo), 0);
		eo.attn_backend = &attn;
		eo.plan = stream_plan(m, 0, 0, false, &plan);
	}
	ck_assert_msg(mlens_engine_create(&e, m, &be, &eo, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(mlens_sched_create(&s, e, &so), 0);
	memset(t, 0, sizeof(*t));
	mlens_sched_tenant_init(&t->st, &q, stenant_emit);
	for (int i = 0; i < SREQ; i++) {
		int32_t p[12];
		struct mlens_request_params rp;
		char why[256] = "";
		for (int j = 0; j < 12; j++)
			p[j] = (int32_t)((i * 13 + j * 5 + 1) % 97);
		memset(&rp, 0, sizeof(rp));
		rp.id = (uint64_t)i;
		rp.prompt = p;
		rp.n_prompt = 6 + i;
		rp.max_tokens = SMAX;
		rp.samp.top_p = 1.0f;
		ck_assert_msg(mlens_sched_submit(s, &t->st, &rp, why, sizeof(why)) == 0, "%s", why);
	}
	while (!mlens_sched_idle(s) && steps++ < 500)
		ck_assert_int_ge(mlens_sched_step(s), 0);
	ck_assert(mlens_sched_idle(s));
	*preempt = t->st.preemptions;
	{
		/* the pipeline's counters reach the scheduler's statistics */
		struct mlens_sched_stats st;
		uint64_t expert = 3ull * (uint64_t)m->cfg.intermediate_size *
				  (uint64_t)m->cfg.hidden_size * 4;
		mlens_sched_get_stats(s, &st);
		ck_assert_int_eq(st.hybrid, hybrid);
		if (hybrid) {
			ck_assert_uint_ge(st.pcie_h2d_bytes, st.steps * (uint64_t)m->cfg.num_hidden_layers *
							     (uint64_t)m->cfg.num_local_experts * expert);
			ck_assert_uint_gt(st.pcie_d2h_bytes, 0);
			ck_assert(st.cpu_attn_seconds > 0);
			/* the append is a part of the host side's time */
			ck_assert(st.cpu_append_seconds > 0 && st.cpu_append_seconds < st.cpu_attn_seconds);
		} else {
			ck_assert_uint_eq(st.pcie_h2d_bytes, 0);
		}
	}
	mlens_sched_tenant_remove(s, &t->st, 0, true);
	mlens_sched_destroy(s);
	mlens_engine_destroy(e);
	mlens_backend_destroy(&be);
	if (hybrid)
		mlens_backend_destroy(&attn);
}

START_TEST(exec_under_scheduler)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	struct stenant *t = calloc(2, sizeof(*t));
	uint64_t pre[2];

	sched_run(m, false, &t[0], &pre[0]);
	sched_run(m, true, &t[1], &pre[1]);
	ck_assert_uint_gt(pre[0], 0);	/* the pool is small enough to preempt */
	ck_assert_uint_eq(pre[0], pre[1]);
	for (int i = 0; i < SREQ; i++) {
		ck_assert_int_eq(t[0].n[i], SMAX);
		ck_assert_int_eq(t[1].n[i], SMAX);
		for (int j = 0; j < SMAX; j++)
			ck_assert_msg(t[0].tok[i][j] == t[1].tok[i][j],
				      "request %d token %d: hybrid %d, engine %d", i, j, t[1].tok[i][j],
				      t[0].tok[i][j]);
	}
	free(t);
	mlens_test_model_free(m);
}
END_TEST

/* Routing that favours two experts a layer, other ones in each layer. */
static const int favoured[4][2] = { { 2, 3 }, { 1, 3 }, { 0, 1 }, { 0, 2 } };

/* Two experts of four resident a layer, experts 0 and 1 (static) or
 * following the routing: the same tokens and logits; the routing's
 * resident sets become the most-routed experts of each layer (the
 * favoured ones: 4 swaps, at most 4 a step) after the first choice (two
 * steps), every routed row hits a resident expert from then on, and the
 * stream still carries the two others of every layer. */
START_TEST(exec_residency_follows_routing)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	static const int plen[N_SEQ] = { 5, 9, 3, 7 };
	static const uint64_t swaps[4] = { 2, 1, 0, 1 };
	int32_t prompt[N_SEQ][16], next[2][N_SEQ];
	struct side sd[2];
	size_t V = (size_t)ts.vocab;
	float *lg[2];
	bool async = _i;
	uint64_t expert = 3ull * (uint64_t)ts.inter * (uint64_t)ts.hidden * 4;
	const int steps = 10;

	mlens_test_favour_experts(m, favoured);
	for (int i = 0; i < N_SEQ; i++)
		for (int j = 0; j < plen[i]; j++)
			prompt[i][j] = (int32_t)((i * 31 + j * 7 + 3) % ts.vocab);
	run_resident = 2;
	run_period = 2;
	for (int s = 0; s < 2; s++) {
		run_routing = s == 1;
		fa_shared = s == 1;
		side_open(&sd[s], m, true, 2, 0, false, async, false);
	}
	fa_shared = false;
	run_resident = 0;
	run_routing = false;
	run_period = 0;
	lg[0] = calloc(N_SEQ * V, sizeof(float));
	lg[1] = calloc(N_SEQ * V, sizeof(float));
	for (int step = 0; step < steps; step++) {
		for (int s = 0; s < 2; s++)
			scenario_step(&sd[s], step, prompt, plen, next[s], lg[s], V);
		for (int i = 0; i < N_SEQ; i++) {
			if (i == 3 && step < 2)
				continue;
			ck_assert_msg(next[0][i] == next[1][i], "step %d seq %d: routing token %d, static %d",
				      step, i, next[1][i], next[0][i]);
			ck_assert_msg(memcmp(lg[0] + i * V, lg[1] + i * V, V * sizeof(float)) == 0,
				      "step %d seq %d: the logits differ", step, i);
		}
		{
			const struct mlens_pipeline_stats *st =
				mlens_pipeline_stats(mlens_engine_pipeline(sd[1].e));
			/* the swaps' uploads in the step after the first choice */
			ck_assert_uint_eq(st->h2d_swap_bytes, step == 2 ? 4 * expert : 0);
			/* two experts of each layer stream every step (and, after a
			 * swap in layer 0 or 1, those layers again at its end) */
			ck_assert_uint_eq(st->h2d_weight_bytes, (uint64_t)(ts.layers + (step == 0 || step == 2 ? 2 : 0)) *
									 2 * expert);
			if (step >= 2)
				ck_assert_uint_eq(st->expert_resident_rows, st->expert_rows);
		}
	}
	for (int s = 0; s < 2; s++) {
		const struct mlens_pipeline *p = mlens_engine_pipeline(sd[s].e);
		const struct mlens_residency *rs = mlens_pipeline_residency(p);
		const struct mlens_pipeline_stats *st = mlens_pipeline_stats(p);
		ck_assert_int_eq(st->residency_routing, s == 1);
		ck_assert_uint_eq(st->expert_rows_total, rs->routed_rows);
		/* every row of every step, top-2, in each of the 4 layers */
		ck_assert_uint_gt(st->expert_rows_total, 0);
		ck_assert_uint_eq(st->expert_rows_total % (2 * ts.layers), 0);
		ck_assert_uint_eq(st->expert_swaps_total, s ? 4 : 0);
		for (int l = 0; l < ts.layers; l++) {
			const uint64_t *c = rs->routed + (size_t)l * ts.experts;
			int top[2] = { -1, -1 };
			for (int x = 0; x < ts.experts; x++) {
				if (top[0] < 0 || c[x] > c[top[0]]) {
					top[1] = top[0];
					top[0] = x;
				} else if (top[1] < 0 || c[x] > c[top[1]]) {
					top[1] = x;
				}
			}
			/* the routers favour what they were made to */
			ck_assert(top[0] == favoured[l][0] || top[0] == favoured[l][1]);
			ck_assert(top[1] == favoured[l][0] || top[1] == favoured[l][1]);
			for (int x = 0; x < ts.experts; x++) {
				bool want = s ? x == top[0] || x == top[1] : x < 2;
				ck_assert_msg(mlens_residency_is_resident(rs, l, x) == want,
					      "%s: layer %d expert %d resident %d", s ? "routing" : "static", l,
					      x, mlens_residency_is_resident(rs, l, x));
			}
			ck_assert_uint_eq(rs->layer_swaps[l], s ? swaps[l] : 0);
		}
	}
	{
		const struct mlens_residency *st = mlens_pipeline_residency(mlens_engine_pipeline(sd[0].e));
		const struct mlens_residency *ro = mlens_pipeline_residency(mlens_engine_pipeline(sd[1].e));
		/* static: layer 2's favoured pair, half of layers 1 and 3's */
		ck_assert_double_eq_tol(mlens_residency_hit_ratio(st, false), 0.5, 1e-9);
		ck_assert_double_eq_tol(mlens_residency_hit_ratio(st, true), 0.5, 1e-9);
		ck_assert_double_eq(mlens_residency_hit_ratio(ro, true), 1.0);
		ck_assert(mlens_residency_hit_ratio(ro, false) > 0.75);
	}
	free(lg[0]);
	free(lg[1]);
	side_close(&sd[0], true);
	side_close(&sd[1], true);
	mlens_test_model_free(m);
}
END_TEST

/* A swap whose upload fails fails its step and leaves the resident sets
 * as they were; the next step swaps and computes what the first did. */
START_TEST(exec_residency_swap_fails)
{
	struct mlens_test_spec ts = spec4();
	struct mlens_model *m = mlens_test_model_new(&ts);
	struct mlens_backend g, c;
	struct mlens_pipeline *p;
	struct mlens_gpu_plan plan;
	struct mlens_pipeline_opts po = { .kv_blocks = 64, .kv_dtype = -1, .residency_routing = true,
					  .residency_period = 1 };
	int32_t prompt[7] = { 3, 1, 4, 1, 5, 9, 2 };
	size_t V = (size_t)ts.vocab;
	float *lg0 = calloc(V, sizeof(float)), *lg1 = calloc(V, sizeof(float));
	int32_t first = -1;
	const struct mlens_residency *rs;

	mlens_test_favour_experts(m, favoured);
	po.plan = resident_plan(m, 2, &plan);
	p = fa_pipeline(m, &g, &c, &po);
	rs = mlens_pipeline_residency(p);
	for (int round = 0; round < 3; round++) {
		struct mlens_seq seq = { 0 };
		struct mlens_engine_req r = { 0 };
		r.seq = &seq;
		r.tokens = prompt;
		r.n_tokens = 7;
		r.logits = round ? lg1 : lg0;
		if (round == 1) {
			/* the second upload of the first swap */
			__atomic_store_n(&fa_fail_in, 2, __ATOMIC_SEQ_CST);
			ck_assert_int_eq(mlens_pipeline_step(p, &r, 1), -EIO);
			__atomic_store_n(&fa_fail_in, 0, __ATOMIC_SEQ_CST);
			ck_assert_uint_eq(rs->swaps, 0);
			for (int l = 0; l < ts.layers; l++)
				for (int x = 0; x < ts.experts; x++)
					ck_assert_int_eq(mlens_residency_is_resident(rs, l, x), x < 2);
		} else {
			ck_assert_int_eq(mlens_pipeline_step(p, &r, 1), 0);
			if (round == 0)
				first = r.next_token;
			ck_assert_int_eq(r.next_token, first);
			ck_assert(round == 0 || !memcmp(lg0, lg1, V * sizeof(float)));
		}
		mlens_seq_fini(mlens_pipeline_kv(p), &seq);
	}
	ck_assert_uint_eq(rs->swaps, 4);
	for (int l = 0; l < ts.layers; l++)
		for (int x = 0; x < ts.experts; x++)
			ck_assert_int_eq(mlens_residency_is_resident(rs, l, x),
					 x == favoured[l][0] || x == favoured[l][1]);
	fa_pipeline_close(p, &g, &c);
	mlens_test_model_free(m);
	free(lg0);
	free(lg1);
}
END_TEST

/* The choice alone: the margin keeps experts routed about as often in
 * place, at most the step's bound of swaps, and the counts halve at each
 * choice so that the recent routing wins. */
START_TEST(residency_choice)
{
	struct mlens_residency rs;
	int l, in, out;

	ck_assert_int_eq(mlens_residency_init(&rs, 2, 4, 5, true, 1, 1), -EINVAL);
	ck_assert_int_eq(mlens_residency_init(&rs, 2, 4, 2, true, 1, 1), 0);
	/* layer 0: expert 2 just past expert 1 (inside the margin) */
	mlens_residency_tally(&rs, 0)[0] = 100;
	mlens_residency_tally(&rs, 0)[1] = 100;
	mlens_residency_tally(&rs, 0)[2] = 110;
	/* layer 1: experts 2 and 3 far ahead */
	mlens_residency_tally(&rs, 1)[2] = 50;
	mlens_residency_tally(&rs, 1)[3] = 60;
	mlens_residency_step_done(&rs);
	ck_assert_uint_eq(rs.routed_rows, 420);
	ck_assert_uint_eq(rs.resident_rows, 200);
	ck_assert_double_eq_tol(mlens_residency_hit_ratio(&rs, true), 200.0 / 420, 1e-12);
	/* one swap a step: layer 1's best streamed one for its worst resident */
	ck_assert(mlens_residency_next_swap(&rs, &l, &in, &out));
	ck_assert_int_eq(l, 1);
	mlens_residency_swapped(&rs, l, in, out);
	ck_assert(!mlens_residency_next_swap(&rs, &l, &in, &out));
	mlens_residency_step_done(&rs);	/* nothing routed: scores halve, target stays */
	ck_assert(mlens_residency_next_swap(&rs, &l, &in, &out));
	ck_assert_int_eq(l, 1);
	mlens_residency_swapped(&rs, l, in, out);
	ck_assert(!mlens_residency_next_swap(&rs, &l, &in, &out));
	for (int x = 0; x < 4; x++) {
		ck_assert_int_eq(mlens_residency_is_resident(&rs, 0, x), x < 2);
		ck_assert_int_eq(mlens_residency_is_resident(&rs, 1, x), x >= 2);
	}
	/* layer 0's routing moves to expert 3: the halved old counts lose */
	mlens_residency_tally(&rs, 0)[3] = 200;
	mlens_residency_step_done(&rs);
	ck_assert(mlens_residency_next_swap(&rs, &l, &in, &out));
	ck_assert_int_eq(l, 0);
	ck_assert_int_eq(in, 3);
	mlens_residency_fini(&rs);
	/* static: never a swap */
	ck_assert_int_eq(mlens_residency_init(&rs, 1, 4, 2, false, 1, 1), 0);
	mlens_residency_tally(&rs, 0)[3] = 1000;
	mlens_residency_step_done(&rs);
	ck_assert(!mlens_residency_next_swap(&rs, &l, &in, &out));
	ck_assert_double_eq(mlens_residency_hit_ratio(&rs, false), 0);
	mlens_residency_fini(&rs);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("pipeline");
	TCase *t = tcase_create("executor");
	tcase_set_timeout(t, 60);
	tcase_add_test(t, exec_equal_one_group);
	tcase_add_test(t, exec_disk_experts);
	tcase_add_test(t, exec_equal_two_groups);
	tcase_add_test(t, exec_equal_small_groups);
	tcase_add_test(t, exec_failure_recovers);
	tcase_add_test(t, exec_equal_prefill_on_cpu);
	tcase_add_test(t, exec_equal_side_copies);
	tcase_add_test(t, exec_equal_gpu_kv_append);
	tcase_add_test(t, exec_equal_gpu_kv_append_side);
	tcase_add_test(t, exec_equal_three_sets);
	tcase_add_loop_test(t, exec_half_att_same_product, 0, 8);
	tcase_add_test(t, exec_pieces_and_budget);
	tcase_add_test(t, exec_engine_takes_the_plan);
	tcase_add_test(t, exec_under_scheduler);
	tcase_add_test(t, exec_trace_threads);
	tcase_add_test(t, exec_op_timing);
	tcase_add_loop_test(t, exec_residency_follows_routing, 0, 2);
	tcase_add_test(t, exec_residency_swap_fails);
	tcase_add_test(t, residency_choice);
	suite_add_tcase(s, t);
	return mlens_check_run(s);
}
