/* One step on one backend: the embedding, every layer whole
 * (daemon/exec/layer.h) and the model's head; in hybrid mode the step goes to
 * the pipeline instead. Token rows are ordered prefill sequences first (contiguous, for
 * attn_prefill), then the tokens of sequences that already have a cache
 * (decode, or a continuation), which read the paged cache. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "daemon/errf.h"
#include "daemon/exec/engine.h"
#include "daemon/exec/layer.h"
#include "daemon/exec/op_time.h"
#include "daemon/exec/pipeline.h"
#include "daemon/exec/residency.h"
#include "daemon/plan/gpu_plan.h"
#include "daemon/exec/step.h"
#include "daemon/model/disk_tier.h"
#include "daemon/ops/trace.h"

struct mlens_engine {
	const struct mlens_model *m;
	struct mlens_model_config cfg;
	struct mlens_backend *be;
	struct mlens_pipeline *pipe;	/* hybrid mode: steps run there */
	struct mlens_trace *trace;	/* step traces (mlensctl trace); idle unless armed */
	struct mlens_step_timer timer;	/* times a traced step's parts on the backend */
	bool timing;			/* this step is timed */
	struct mlens_op_time *ot;	/* op_timing: every step's ops timed (in hybrid mode, the pipeline's) */
	struct mlens_kv_pool kv;
	int max_tokens;
	int qdim, kvdim;
	bool prefill_op;	/* prefill attention through attn_prefill */

	/* the layer's shape and the weights as the backend sees them */
	struct mlens_layer_desc desc;
	struct mlens_layer_placer placer;
	struct mlens_ends_bound ends;
	struct mlens_layer_bound *layers;

	/* weights_disk_follow: which experts stay in RAM, from the routing */
	struct mlens_residency ram;
	bool follow;
	int trade_pause;	/* steps without trades after a failed one */

	/* activations, backend memory, max_tokens rows */
	float *x, *xn, *q, *k, *v, *att, *rlog, *rw;
	int32_t *rid;
	float *logits;		/* grown on demand */
	size_t logits_rows;

	/* host scratch, max_tokens entries */
	struct mlens_step_rows rows;
	int32_t *cu;

	/* MLENS_ENGINE_PROFILE=N: wait for the backend after every op, add its
	 * wall time to its kind and print the split every N steps on stderr
	 * (a measurement aid: the waits themselves slow the step) */
	int prof_every;
	long prof_steps;
	double prof_t[MLENS_LAYER_OP_N], prof_step_t, prof_t0;
	struct mlens_layer_probe probe;
	const struct mlens_layer_probe *user_probe;	/* mlens_engine_set_probe's, before probe */
};

static void prof_begin(void *arg);
static int prof_end(void *arg, enum mlens_layer_op op, double flops);

/* ==== weights ==== */

static int bind_weights(struct mlens_engine *e)
{
	const struct mlens_model *m = e->m;
	int E = e->desc.n_experts, rc;

	e->layers = calloc((size_t)e->cfg.num_hidden_layers, sizeof(*e->layers));
	if (!e->layers)
		return -ENOMEM;
	rc = mlens_ends_bind(&e->ends, m, &e->placer);
	for (int64_t l = 0; l < e->cfg.num_hidden_layers && !rc; l++) {
		/* a backend that copies the weights takes the disk experts
		 * once, from their staging; a host one reads them each step */
		if (!e->be->ops->host_memory && (rc = mlens_disk_tier_ready(m->disk, (int)l)))
			break;
		rc = mlens_layer_bind(&e->layers[l], &m->layers[l], &e->desc, E, &e->placer);
	}
	if (!rc && !e->be->ops->host_memory)
		mlens_disk_tier_keep_from(m->disk, E);	/* all placed: nothing to read each step */
	if (!rc && e->follow)
		for (int64_t l = 0; l < e->cfg.num_hidden_layers; l++)
			e->layers[l].moe.tally = mlens_residency_tally(&e->ram, (int)l);
	return rc;
}

/* Layer l's experts bound anew: a trade moved their pointers. */
static int rebind_experts(struct mlens_engine *e, int l)
{
	const struct mlens_model *m = e->m;
	int rc = 0;

	for (int x = 0; x < e->desc.n_experts && !rc; x++) {
		mlens_layer_unbind_expert(&e->layers[l], &m->layers[l], &e->desc, x, &e->placer);
		rc = mlens_layer_bind_expert(&e->layers[l], &m->layers[l], &e->desc, x, &e->placer);
	}
	return rc;
}

/* After a step (step_rc its result, returned unless the rebinding
 * fails): its routed rows counted; between steps the trade the counts'
 * last choice asks for, at most one a step (each reads a whole expert
 * from the files while no step runs). A failed trade leaves the split as
 * it was (the tier logs and counts it) and trades pause for a choice
 * period. Nothing without weights_disk_follow (nor in hybrid mode). */
static int follow_routing(struct mlens_engine *e, int step_rc)
{
	int l, in, out;

	if (!e->follow)
		return step_rc;
	if (step_rc) {
		mlens_residency_step_failed(&e->ram);
		return step_rc;
	}
	mlens_residency_step_done(&e->ram);
	if (e->trade_pause > 0) {
		e->trade_pause--;
		return 0;
	}
	if (!mlens_residency_next_swap(&e->ram, &l, &in, &out))
		return 0;
	if (mlens_disk_tier_trade(e->m->disk, l, in, out)) {
		e->trade_pause = e->ram.period;
		return 0;
	}
	mlens_residency_swapped(&e->ram, l, in, out);
	return rebind_experts(e, l);
}

static void unbind_weights(struct mlens_engine *e)
{
	if (!e->layers)
		return;
	mlens_ends_unbind(&e->ends, e->m, &e->placer);
	for (int64_t l = 0; l < e->cfg.num_hidden_layers; l++)
		mlens_layer_unbind(&e->layers[l], &e->m->layers[l], &e->desc, e->desc.n_experts,
				   &e->placer);
	free(e->layers);
	e->layers = NULL;
}

/* ==== create / destroy ==== */

static void *balloc(struct mlens_engine *e, size_t elems, size_t es, int *rc)
{
	void *p;
	if (*rc)
		return NULL;
	p = e->be->ops->alloc(e->be->ctx, elems * es);
	if (!p)
		*rc = -ENOMEM;
	return p;
}

int mlens_engine_create(struct mlens_engine **out, const struct mlens_model *m,
			struct mlens_backend *be, const struct mlens_engine_opts *o,
			char *err, size_t errlen)
{
	struct mlens_engine_opts def = { 0 };
	struct mlens_engine *e;
	struct mlens_kv_cache layout;
	size_t T, H;
	int rc = 0;

	if (!o) {
		def.kv_dtype = -1;
		o = &def;
	}
	e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->m = m;
	e->cfg = m->cfg;
	if (getenv("MLENS_ENGINE_PROFILE"))
		e->prof_every = atoi(getenv("MLENS_ENGINE_PROFILE"));
	e->be = be;
	mlens_layer_desc_init(&e->desc, &e->cfg);
	e->placer = mlens_layer_placer_backend(be);
	e->probe = (struct mlens_layer_probe){ prof_begin, prof_end, e };
	if ((rc = mlens_trace_create(&e->trace, 0)) || (rc = mlens_step_timer_init(&e->timer, be))) {
		mlens_errf(err, errlen, "cannot allocate the step trace recorder");
		goto fail;
	}
	/* a backend without timing marks has no account: op_timing is then
	 * a no-op (the daemon says so) */
	if (o->op_timing && e->timer.on && (rc = mlens_op_time_create(&e->ot, &e->timer))) {
		mlens_errf(err, errlen, "cannot allocate the op time account");
		goto fail;
	}
	e->max_tokens = o->max_step_tokens > 0 ? o->max_step_tokens : 4096;
	e->prefill_op = o->prefill_attn == MLENS_PREFILL_OP ||
			(o->prefill_attn == MLENS_PREFILL_AUTO && !be->ops->host_memory);
	e->qdim = (int)(e->cfg.num_attention_heads * e->cfg.head_dim);
	e->kvdim = (int)(e->cfg.num_key_value_heads * e->cfg.head_dim);
	if (o->plan && o->plan->gpu_only) {
		/* GPU-only mode's plan: its activations hold plan->tokens a step */
		if (o->attn_backend) {
			mlens_errf(err, errlen, "engine: a GPU-only memory plan given with an attention backend "
			       "(hybrid mode needs the hybrid plan)");
			rc = -EINVAL;
			goto fail;
		}
		e->max_tokens = (int)o->plan->tokens;
	}
	if (o->attn_backend) {
		struct mlens_pipeline_opts po = {
			.plan = o->plan,
			.groups = o->hybrid_groups,
			.piece_bytes = o->hybrid_piece_bytes,
			.prefill_cpu = o->hybrid_prefill_cpu,
			.side_copy_out = o->hybrid_side_copy_out,
			.up_copy_in = o->hybrid_up_copy_in,
			.gpu_kv_append = o->hybrid_gpu_kv_append,
			.residency_routing = o->hybrid_residency_routing,
			.residency_period = o->hybrid_residency_period,
			.kv_block_size = o->kv_block_size,
			.kv_blocks = o->kv_blocks,
			.kv_dtype = o->kv_dtype,
			.kv_mem_k = o->kv_mem_k,
			.kv_mem_v = o->kv_mem_v,
			.trace = e->trace,
			.op_time = e->ot,
		};
		rc = mlens_pipeline_create(&e->pipe, m, be, o->attn_backend, &po, err, errlen);
		if (rc)
			goto fail;
		e->max_tokens = mlens_pipeline_max_step_tokens(e->pipe);
		*out = e;
		return 0;
	}

	if ((rc = mlens_kv_layout(&layout, &e->cfg, o->kv_dtype, o->kv_block_size, o->kv_blocks, err,
				  errlen)))
		goto fail;
	rc = mlens_kv_pool_init(&e->kv, be, &layout, o->kv_mem_k, o->kv_mem_v);
	if (rc) {
		mlens_errf(err, errlen, "cannot allocate the KV cache (%u blocks of %d tokens): %s",
		       layout.n_blocks, layout.block_size, strerror(-rc));
		goto fail;
	}
	if (o->weights_disk_follow && be->ops->host_memory && mlens_disk_tier_can_trade(m->disk)) {
		struct mlens_disk_tier_stats ds;
		mlens_disk_tier_get_stats(m->disk, &ds);
		/* RAM is the resident tier: experts 0..r-1 at load */
		rc = mlens_residency_init(&e->ram, (int)e->cfg.num_hidden_layers, (int)e->cfg.num_local_experts,
					  ds.ram_experts, true, o->weights_disk_period, 1);
		if (rc) {
			mlens_errf(err, errlen, "cannot allocate the routing counts of the experts on disk");
			goto fail;
		}
		e->follow = e->ram.routing;
	}
	rc = bind_weights(e);
	if (rc) {
		mlens_errf(err, errlen, "cannot place the model weights on the %s backend: %s",
		       be->ops->name, strerror(-rc));
		goto fail;
	}

	T = (size_t)e->max_tokens;
	H = (size_t)e->cfg.hidden_size;
	e->x = balloc(e, T * H, 4, &rc);
	e->xn = balloc(e, T * H, 4, &rc);
	e->q = balloc(e, T * e->qdim, 4, &rc);
	e->k = balloc(e, T * e->kvdim, 4, &rc);
	e->v = balloc(e, T * e->kvdim, 4, &rc);
	e->att = balloc(e, T * e->qdim, 4, &rc);
	e->rlog = balloc(e, T * e->cfg.num_local_experts, 4, &rc);
	e->rw = balloc(e, T * e->cfg.num_experts_per_tok, 4, &rc);
	e->rid = balloc(e, T * e->cfg.num_experts_per_tok, 4, &rc);
	e->cu = malloc((T + 1) * sizeof(*e->cu));
	if (rc || mlens_step_rows_alloc(&e->rows, T) || !e->cu) {
		rc = -ENOMEM;
		mlens_errf(err, errlen, "cannot allocate activations for %d tokens per step", e->max_tokens);
		goto fail;
	}
	*out = e;
	return 0;
fail:
	mlens_engine_destroy(e);
	return rc;
}

void mlens_engine_set_probe(struct mlens_engine *e, const struct mlens_layer_probe *probe)
{
	e->user_probe = probe;
}

void mlens_engine_destroy(struct mlens_engine *e)
{
	void *bufs[] = { e->x, e->xn, e->q, e->k, e->v, e->att, e->rlog, e->rw, e->rid, e->logits };
	if (!e)
		return;
	mlens_pipeline_destroy(e->pipe);
	mlens_op_time_destroy(e->ot);
	mlens_trace_destroy(e->trace);
	mlens_step_timer_fini(&e->timer);
	for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
		if (bufs[i])
			e->be->ops->free(e->be->ctx, bufs[i]);
	unbind_weights(e);
	mlens_residency_fini(&e->ram);
	if (e->kv.free_stack)
		mlens_kv_pool_fini(&e->kv);
	mlens_step_rows_free(&e->rows);
	free(e->cu);
	free(e);
}

struct mlens_kv_pool *mlens_engine_kv(struct mlens_engine *e)
{
	return e->pipe ? mlens_pipeline_kv(e->pipe) : &e->kv;
}

bool mlens_engine_disk_follows(const struct mlens_engine *e)
{
	return e->follow;
}

const struct mlens_op_time *mlens_engine_op_time(const struct mlens_engine *e)
{
	return e->ot;
}

struct mlens_pipeline *mlens_engine_pipeline(struct mlens_engine *e)
{
	return e->pipe;
}

struct mlens_trace *mlens_engine_trace(struct mlens_engine *e)
{
	return e->trace;
}

const struct mlens_model_config *mlens_engine_config(const struct mlens_engine *e)
{
	return &e->cfg;
}

int mlens_engine_max_step_tokens(const struct mlens_engine *e)
{
	return e->max_tokens;
}

int mlens_engine_reqs_check(const struct mlens_model_config *c, const struct mlens_engine_req *reqs,
			    int n, int64_t *total)
{
	*total = 0;
	if (n <= 0)
		return -EINVAL;
	for (int i = 0; i < n; i++) {
		const struct mlens_engine_req *r = &reqs[i];
		if (!r->seq || r->n_tokens <= 0 || !r->tokens)
			return -EINVAL;
		for (int j = 0; j < r->n_tokens; j++)
			if (r->tokens[j] < 0 || r->tokens[j] >= c->vocab_size)
				return -EINVAL;
		if ((int64_t)r->seq->len + r->n_tokens > c->max_position_embeddings)
			return -EOVERFLOW;
		*total += r->n_tokens;
	}
	return 0;
}

uint32_t mlens_engine_step_blocks(struct mlens_engine *e, const struct mlens_engine_req *reqs,
				  int n)
{
	return mlens_step_blocks(mlens_engine_kv(e), reqs, n);
}

/* ==== the step ==== */

static int grow_logits(struct mlens_engine *e, size_t rows)
{
	size_t V = (size_t)e->cfg.vocab_size;
	if (rows > e->logits_rows) {
		if (e->logits)
			e->be->ops->free(e->be->ctx, e->logits);
		e->logits = e->be->ops->alloc(e->be->ctx, rows * V * sizeof(float));
		e->logits_rows = e->logits ? rows : 0;
		if (!e->logits)
			return -ENOMEM;
	}
	return mlens_step_rows_host_logits(&e->rows, rows, (int)V);
}

#define OPS (e->be->ops)
#define CTX (e->be->ctx)
#define TRY(x) do { if ((rc = (x))) goto out; } while (0)

static double prof_clock(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int prof_add(struct mlens_engine *e, int k, double t0)
{
	int rc = OPS->sync(CTX);
	e->prof_t[k] += prof_clock() - t0;
	return rc;
}

/* Every op timed: its wall time to the backend's sync after it (the probe
 * of layer.h). */
static void prof_begin(void *arg)
{
	((struct mlens_engine *)arg)->prof_t0 = prof_clock();
}

static int prof_end(void *arg, enum mlens_layer_op op, double flops)
{
	struct mlens_engine *e = arg;
	(void)flops;
	return prof_add(e, (int)op, e->prof_t0);
}

static void prof_step_done(struct mlens_engine *e, double t0, int tokens)
{
	double sum = 0;
	e->prof_step_t += prof_clock() - t0;
	if (++e->prof_steps % e->prof_every)
		return;
	fprintf(stderr, "engine profile, %ld steps (last %d tokens), ms per step:", e->prof_steps, tokens);
	for (int k = 0; k < MLENS_LAYER_OP_N; k++) {
		fprintf(stderr, " %s %.3f", mlens_layer_op_name((enum mlens_layer_op)k),
			1e3 * e->prof_t[k] / e->prof_steps);
		sum += e->prof_t[k];
	}
	fprintf(stderr, "; ops %.3f, step %.3f\n", 1e3 * sum / e->prof_steps, 1e3 * e->prof_step_t / e->prof_steps);
}

/* ==== step traces ==== */

static double trace_clock(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* While a step is traced, its parts (embed, each layer, lm_head and
 * sampling) are timed on the compute queue and become spans on the
 * backend's track. */
static int trace_part_begin(struct mlens_engine *e, int layer, int L)
{
	const char *track = e->be->ops->host_memory ? "cpu" : "gpu";
	if (!e->timing)
		return -1;
	if (layer < 0)
		return mlens_step_timer_begin(&e->timer, 0, track, "embed");
	if (layer < L)
		return mlens_step_timer_begin(&e->timer, 0, track, "layer %d", layer);
	return mlens_step_timer_begin(&e->timer, 0, track, "lm_head + sample");
}

static void trace_part_end(struct mlens_engine *e, int span)
{
	if (e->timing && span >= 0)
		mlens_step_timer_end(&e->timer, span);
}

static int engine_step(struct mlens_engine *e, struct mlens_engine_req *reqs, int n);

int mlens_engine_step(struct mlens_engine *e, struct mlens_engine_req *reqs, int n)
{
	int rc, tokens = 0;
	if (!mlens_trace_armed(e->trace) && (e->pipe || !e->ot)) {
		mlens_disk_tier_step_begin(e->m->disk);
		rc = e->pipe ? mlens_pipeline_step(e->pipe, reqs, n) : engine_step(e, reqs, n);
		mlens_disk_tier_step_end(e->m->disk);
		return follow_routing(e, rc);
	}
	mlens_disk_tier_step_begin(e->m->disk);
	for (int i = 0; i < n; i++)
		tokens += reqs[i].n_tokens;
	mlens_trace_step_begin(e->trace, trace_clock());
	if (e->pipe) {
		rc = mlens_pipeline_step(e->pipe, reqs, n);
	} else {
		/* a traced step's parts, and with op_timing its ops, on the timer */
		double busy[2];
		e->timing = e->timer.on && !mlens_step_timer_start(&e->timer, e->trace);
		if (e->ot)
			mlens_op_time_step_start(e->ot);
		rc = engine_step(e, reqs, n);
		if (e->timing) {
			/* sampling waited for the backend */
			int frc = mlens_step_timer_finish(&e->timer, busy);
			if (e->ot)
				mlens_op_time_step_done(e->ot, rc ? rc : frc);
		}
		e->timing = false;
	}
	mlens_trace_step_end(e->trace, trace_clock(), tokens, n);
	mlens_disk_tier_step_end(e->m->disk);
	return follow_routing(e, rc);
}

static int engine_step(struct mlens_engine *e, struct mlens_engine_req *reqs, int n)
{
	const struct mlens_model_config *c = &e->cfg;
	struct mlens_step_rows *sr = &e->rows;
	const struct mlens_layer_run run = { e->be, &e->desc,
					     e->user_probe ? e->user_probe :
					     e->ot && e->timing ? mlens_op_time_probe(e->ot) :
					     e->prof_every > 0 ? &e->probe : NULL };
	int V = (int)c->vocab_size, bs = e->kv.cache.block_size;
	int T = 0, P = 0, n_pre = 0, nl, rc = 0, row, L = (int)c->num_hidden_layers, part;
	int64_t total = 0;
	double t_step;
	/* experts left on disk: a host backend reads them from staging */
	struct mlens_disk_tier *disk = e->be->ops->host_memory ? e->m->disk : NULL;

	if ((rc = mlens_step_reserve(c, &e->kv, reqs, n, e->max_tokens, &total)))
		return rc;
	T = (int)total;
	t_step = e->prof_every > 0 ? prof_clock() : 0;

	/* rows: prefill sequences first, then the others */
	row = 0;
	sr->nl = 0;
	e->cu[0] = 0;
	for (int pass = 0; pass < 2; pass++) {
		for (int i = 0; i < n; i++) {
			struct mlens_engine_req *r = &reqs[i];
			bool pre = r->seq->len == 0;
			if (pre != (pass == 0))
				continue;
			for (int j = 0; j < r->n_tokens; j++, row++)
				mlens_step_rows_put(sr, row, i, r, j, bs);
			if (pre)
				e->cu[++n_pre] = row;
		}
		if (pass == 0)
			P = row;
	}
	nl = sr->nl;
	if (!e->prefill_op) {
		/* every row reads the cache, which holds this step's K/V by then */
		P = 0;
		n_pre = 0;
	}

	part = trace_part_begin(e, -1, L);
	TRY(mlens_layer_embed(&run, e->x, e->ends.embed, sr->tok, T));
	trace_part_end(e, part);
	{
		const struct mlens_layer_act act = { e->x, e->xn, e->q, e->k, e->v, e->att, e->rlog,
						     e->rw, e->rid };
		const struct mlens_layer_rows rows = { .n = T, .P = P, .n_pre = n_pre, .pos = sr->pos,
						       .cu = e->cu, .slots = sr->slots, .qry = sr->qry };
		for (int l = 0; l < L; l++) {
			part = trace_part_begin(e, l, L);
			if (disk)
				TRY(mlens_disk_tier_ready(disk, l));
			TRY(mlens_layer_forward(&run, &e->layers[l], &e->kv.cache, l, &act, &rows));
			mlens_disk_tier_done(disk, l);
			trace_part_end(e, part);
		}
	}

	/* logits for the rows that need them: gather, norm, lm_head, sample;
	 * logits to the host where a request asked */
	TRY(grow_logits(e, (size_t)nl));
	{
		bool any = false;
		for (int i = 0; i < n; i++)
			any |= reqs[i].logits != NULL;
		mlens_step_rows_samp(sr, reqs);
		part = trace_part_begin(e, L, L);
		TRY(mlens_ends_logits(&run, &e->ends, V, e->x, e->xn, e->logits, sr->lrow, nl, nl,
				      sr->samp, sr->sampled, sr->logp, any ? sr->host_logits : NULL));
		trace_part_end(e, part);
	}
	mlens_step_deliver(sr, reqs, n, V);
	if (e->prof_every > 0)
		prof_step_done(e, t_step, T);
out:
	return rc;
}
