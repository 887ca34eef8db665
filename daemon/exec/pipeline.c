/* The hybrid pipeline executor: weights placed by the GPU memory plan,
 * experts streamed through two slots, decode attention on the CPU pool, a
 * step run as the step program says (pipeprog.h). Rows of a step: its
 * token groups one after another, each with its prefill sequences first
 * (contiguous, for attn_prefill) and then the tokens that read the paged
 * cache. A group holds at most the plan's group rows; a request too long
 * for one group is cut into segments, and the segments after its first
 * read the cache like decode tokens (the earlier segment's K/V is in the
 * pool by then: C of a layer runs group after group on the host). Only the
 * residual stream is kept for every row; the rest of a group's
 * activations live in one of its sets (pipeline_sets: two or three). */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "daemon/errf.h"
#include "daemon/exec/layer.h"
#include "daemon/exec/op_time.h"
#include "daemon/exec/pipeline.h"
#include "daemon/exec/pipeprog.h"
#include "daemon/exec/residency.h"
#include "daemon/exec/step.h"
#include "daemon/model/disk_tier.h"
#include "daemon/model/quant.h"
#include "daemon/ops/trace.h"

struct pl_layer {
	struct mlens_layer_bound w;	/* GPU: experts resident or in the layer's slot */
	struct mlens_pipe_piece *pieces;
	int n_pieces;
};

struct pl_group {
	int r0, r1;		/* rows [r0, r1) */
	int P;			/* prefill rows, [r0, r0 + P) */
	int n_pre;		/* prefill sequences */
	int32_t *cu;		/* [n_pre + 1], relative to r0 (into the step's cu array) */
	int s0, s1;		/* segments [s0, s1) of the step's segment list */
	int64_t kv_tokens;	/* positions its decode rows' attention reads, a layer */
	uint64_t kv_blocks;	/* blocks they read, a layer */
	uint64_t kv_runs;	/* ... in runs of consecutive block ids */
};

/* Tokens [j0, j1) of request req, in one group. */
struct pl_seg {
	int req, j0, j1;
	int grp;
};

/* The activations of a group that live across its CPU attention (C): GPU
 * and host (pinned when the GPU backend can) buffers for the plan's group
 * rows, one set a group in flight. */
struct pl_set {
	float *q, *k, *v, *att;
	float *hq, *hk, *hv, *hatt;
	void *hatt_half;	/* with half_att: C's output rounded, for the upload */
	/* With side_append, the K/V stores of the GA's prefill rows (its
	 * group's first P), which its C does not read, queued after the qkv
	 * record that C waits for (kv_late): the group and layer still to
	 * queue (NULL: none); late_wait: queued, so the set's next GA waits
	 * for PL_EV_KV_LATE before it writes k and v. GA, the record and the
	 * next GA run on the GPU side's thread, in that order. */
	const struct pl_group *late;
	int late_layer;
	bool late_wait;
};

/* What GA and GB use only inside their own run on the compute queue,
 * which runs them in order: the normed rows (xn), the router's logits,
 * weights and expert ids; one area for every set (the TAIL's rows too).
 * With half_att a set has no fp32 att on the device: GA's prefill
 * attention writes into xn (free once the QKV GEMMs read it; rows of
 * max(hidden, qdim)), and GA rounds it from there into att_in. */
struct pl_shared {
	float *xn, *rlog, *rw;
	int32_t *rid;
};

struct pl_region {
	void *p;
	size_t bytes;
};

struct mlens_pipeline {
	const struct mlens_model *m;
	struct mlens_model_config cfg;
	struct mlens_gpu_plan plan;
	struct mlens_backend *g, *c;	/* GPU side, CPU side */
	bool async;
	/* GA's copies to the host on the backend's queue 2, after an event on
	 * queue 0, rather than between queue 0's kernels (opts side_copy_out) */
	bool side;
	/* ... and C's output back on queue 3 (opts up_copy_in), which GB waits
	 * for by an event: it no longer queues behind the kernels issued
	 * before it (GA of the next item), so queue 0 goes from those straight
	 * on to GB */
	bool up;
	bool prefill_cpu;	/* prefill attention on c (q of every row goes down) */
	bool gpu_append;	/* GA appends K/V to the pool (opts gpu_kv_append) */
	/* ... on queue 2 after GA's kernels (with side and the backend's
	 * kv_append_side), so that the stores overlap queue 0's next kernels */
	bool side_append;
	/* C's output goes up in the weights' dtype (the plan's att_half, where
	 * both backends round and the GPU's GEMM takes such rows) */
	bool half_att;
	void *kv_reg[2];	/* the pool's K and V as registered with g, or NULL */
	struct mlens_kv_pool kv;
	int max_tokens, groups, qdim, kvdim;
	int group_rows;		/* rows of a group at most (the plan's) */
	int64_t chunk;		/* tokens per MoE call */
	int64_t tail_rows;	/* rows per lm_head call (the logits buffer's) */
	uint64_t own;		/* bytes we allocated on g */

	struct mlens_layer_desc desc;
	struct mlens_layer_run grun, crun;	/* the layer on the GPU side, on the CPU side */
	struct mlens_layer_placer placer;	/* weights through galloc */
	struct mlens_ends_bound ends;
	struct pl_layer *layers;
	void *slot[2];
	struct mlens_pipe_prog prog;	/* this step's */
	int *n_pieces;			/* per layer */
	bool streams;			/* some experts stream */
	bool prefetched;		/* the last step left layers 0 and 1 in their slots */
	/* which experts of each layer are resident (the plan's r a layer) and
	 * their routing counts; the rest stream, in pieces of piece bytes */
	struct mlens_residency res;
	uint64_t piece;
	struct pl_region *reg;	/* host ranges we registered */
	int n_reg;

	/* GPU activations: the residual stream of every row, the sets and
	 * their shared area */
	float *x, *logits;
	struct pl_set set[MLENS_PIPE_SETS_MAX];
	int sets;		/* of them in use (opts sets) */
	struct pl_shared sh;
	bool host_pinned;

	/* host scratch */
	struct mlens_step_rows rows;
	struct pl_group grp[MLENS_PIPE_MAX_GROUPS];
	int n_grp;
	int32_t *cu;		/* every group's cu, [max_tokens + MLENS_PIPE_MAX_GROUPS] */
	struct pl_seg *seg;	/* [max_tokens] at most one per row, in group order */
	struct pl_seg *tmp;	/* [max_tokens] the same while they are made */
	int n_seg;

	struct mlens_pipeline_stats st;

	/* busy time of the queues (timing marks around each GPU command and
	 * weight copy) and, when armed, the step's trace; the host side's
	 * spans wait in hs until the step ends (one thread adds to a trace) */
	struct mlens_trace *trace;
	struct mlens_step_timer timer;
	struct mlens_op_time *ot;	/* opts op_time: the GPU side's ops on the timer */
	struct pl_hspan { double t0, t1; int layer, group; bool wait; } *hs;
	int n_hs, cap_hs;
	/* when a trace records: the GPU side's [0] and the mover's [1] host
	 * time issuing each command and waiting for its dep (a side that
	 * stalls shows here, not on the GPU's own timeline); cmd indexes prog */
	struct pl_ispan { double t0, t1; int cmd; bool dep; } *is[2];
	int n_is[2], cap_is;

	/* With queues and events each queue of the step program has a thread:
	 * the caller issues the GPU side, a host thread runs HOST_WAIT and C,
	 * the mover issues the weight copies. An op that waits for the GPU (the
	 * MoE reads its routing counts back) then holds up only the GPU side.
	 * Each side takes its commands in program order and waits only for
	 * their deps (pipeprog.h). */
	struct {
		pthread_t th[MLENS_PIPE_Q_N];	/* [Q_COPY], [Q_HOST]; Q_GPU is the caller */
		bool on, quit;
		pthread_mutex_t mu;
		pthread_cond_t cv;
		pthread_mutex_t timer_mu;	/* the step timer: the GPU side and the mover */
		uint64_t job;			/* steps handed over */
		uint64_t done[MLENS_PIPE_Q_N];	/* steps each side finished */
		int pos[MLENS_PIPE_Q_N];	/* every command of that side below this ran */
		int rc;				/* the first failure of any side */
		bool want_logits;
	} hx;
	struct hx_arg {
		struct mlens_pipeline *p;
		int side;
	} hx_arg[MLENS_PIPE_Q_N];
};

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ==== GPU memory under the budget ==== */

uint64_t mlens_pipeline_gpu_bytes(const struct mlens_pipeline *p)
{
	if (MLENS_BACKEND_HAS(p->g->ops, mem_used))
		return p->g->ops->mem_used(p->g->ctx);
	return p->own;
}

/* Every GPU allocation of the pipeline comes here: one that would take
 * the GPU past the budget fails, loudly. */
static void *galloc(struct mlens_pipeline *p, size_t bytes, int *rc)
{
	void *d;
	if (*rc)
		return NULL;
	if (mlens_pipeline_gpu_bytes(p) + bytes > p->plan.budget) {
		fprintf(stderr, "mlens pipeline: %zu bytes more on the %s backend would pass the GPU "
			"budget of %llu bytes (%llu in use); the memory plan is wrong\n", bytes,
			p->g->ops->name, (unsigned long long)p->plan.budget,
			(unsigned long long)mlens_pipeline_gpu_bytes(p));
		*rc = -ENOSPC;
		return NULL;
	}
	d = p->g->ops->alloc(p->g->ctx, bytes);
	if (!d) {
		*rc = -ENOMEM;
		return NULL;
	}
	p->own += bytes;
	return d;
}

static void gfree(struct mlens_pipeline *p, const void *d, size_t bytes)
{
	if (!d)
		return;
	p->g->ops->free(p->g->ctx, (void *)d);
	p->own -= bytes;
}

static const void *place(void *arg, const void *host, size_t bytes, int *rc)
{
	struct mlens_pipeline *p = arg;
	void *d = galloc(p, bytes, rc);
	if (!d)
		return NULL;
	*rc = p->g->ops->upload(p->g->ctx, d, host, bytes);
	return d;
}

static void unplace(void *arg, const void *d, size_t bytes)
{
	gfree(arg, d, bytes);
}

/* ==== host memory ==== */

static void *halloc(struct mlens_pipeline *p, size_t bytes)
{
	if (p->host_pinned)
		return p->g->ops->host_alloc(p->g->ctx, bytes);
	return malloc(bytes);
}

static void hfree(struct mlens_pipeline *p, void *h)
{
	if (!h)
		return;
	if (p->host_pinned)
		p->g->ops->host_free(p->g->ctx, h);
	else
		free(h);
}

static int cmp_region(const void *a, const void *b)
{
	const struct pl_region *x = a, *y = b;
	return (uintptr_t)x->p < (uintptr_t)y->p ? -1 : (uintptr_t)x->p > (uintptr_t)y->p;
}

static void add_region(struct pl_region *r, int *k, const void *host, size_t bytes, uintptr_t mask)
{
	uintptr_t a = (uintptr_t)host & ~mask;
	uintptr_t e = ((uintptr_t)host + bytes + mask) & ~mask;
	if (!host)
		return;
	r[*k].p = (void *)a;
	r[*k].bytes = e - a;
	(*k)++;
}

/* Pin the host ranges the weight stream reads, page-aligned and merged, so
 * that its copies are asynchronous DMA: the pieces, and with routing
 * residency every expert (a swap streams the experts it sends back and
 * uploads the ones it takes in). */
static int register_stream(struct mlens_pipeline *p)
{
	long pg = sysconf(_SC_PAGESIZE);
	uintptr_t mask = (uintptr_t)(pg > 0 ? pg : 4096) - 1;
	size_t ih = mlens_layer_expert_bytes(&p->desc);
	size_t s13 = mlens_layer_scale_bytes(&p->desc, false), s2 = mlens_layer_scale_bytes(&p->desc, true);
	struct pl_region *r;
	int n = 0, k = 0;

	for (int64_t l = 0; l < p->cfg.num_hidden_layers; l++)
		n += p->layers[l].n_pieces + (p->res.routing ? 6 * p->res.experts : 0);
	if (!n)
		return 0;
	r = calloc((size_t)n, sizeof(*r));
	if (!r)
		return -ENOMEM;
	for (int64_t l = 0; l < p->cfg.num_hidden_layers; l++) {
		const struct mlens_layer_weights *w = &p->m->layers[l];
		for (int i = 0; i < p->layers[l].n_pieces; i++)
			add_region(r, &k, p->layers[l].pieces[i].host, p->layers[l].pieces[i].bytes, mask);
		for (int x = 0; p->res.routing && w->router && x < p->res.experts; x++) {
			add_region(r, &k, w->w1[x], ih, mask);
			add_region(r, &k, w->w2[x], ih, mask);
			add_region(r, &k, w->w3[x], ih, mask);
			if (!s13 || !w->s1)
				continue;
			add_region(r, &k, w->s1[x], s13, mask);
			add_region(r, &k, w->s2[x], s2, mask);
			add_region(r, &k, w->s3[x], s13, mask);
		}
	}
	qsort(r, (size_t)k, sizeof(*r), cmp_region);
	n = 0;
	for (int i = 0; i < k; i++) {
		if (n && (uintptr_t)r[n - 1].p + r[n - 1].bytes >= (uintptr_t)r[i].p) {
			uintptr_t e = (uintptr_t)r[i].p + r[i].bytes;
			if (e > (uintptr_t)r[n - 1].p + r[n - 1].bytes)
				r[n - 1].bytes = e - (uintptr_t)r[n - 1].p;
		} else {
			r[n++] = r[i];
		}
	}
	p->reg = r;
	p->n_reg = 0;
	for (int i = 0; i < n; i++) {
		int rc = p->g->ops->host_register(p->g->ctx, r[i].p, r[i].bytes);
		if (rc == -EEXIST)
			continue;	/* pinned already (the daemon's weight pages) */
		if (rc)
			return rc;
		r[p->n_reg++] = r[i];
	}
	return 0;
}

/* ==== weights ==== */

struct stream_src {
	const void *host;
	const void **dst;	/* the layer's pointer to fill */
	size_t bytes;
};

static int cmp_src(const void *a, const void *b)
{
	const struct stream_src *x = a, *y = b;
	return (uintptr_t)x->host < (uintptr_t)y->host ? -1 : (uintptr_t)x->host > (uintptr_t)y->host;
}

/* Streamed experts of layer l (those not in its resident set): placed in
 * its slot in host-address order, so that a layer stored contiguously
 * moves as few large pieces. fp8 experts bring their scales, every piece
 * at an aligned offset (mlens_model_expert_bytes counts the slot so).
 * Made again when the resident set changes. */
static int plan_layer_stream(struct mlens_pipeline *p, int64_t l, uint64_t piece)
{
	const struct mlens_layer_weights *w = &p->m->layers[l];
	struct pl_layer *b = &p->layers[l];
	const bool fp8 = p->desc.expert_dtype == MLENS_DTYPE_E4M3;
	int E = (int)p->cfg.num_local_experts, r = p->plan.resident_experts;
	int n = (fp8 ? 6 : 3) * (E - r);
	size_t ih = mlens_layer_expert_bytes(&p->desc);
	size_t s13 = mlens_layer_scale_bytes(&p->desc, false), s2 = mlens_layer_scale_bytes(&p->desc, true);
	uint64_t off = 0;
	struct stream_src *s;
	struct mlens_pipe_src *src;
	char *base = p->slot[l % 2];
	int rc = 0;

	free(b->pieces);
	b->pieces = NULL;
	b->n_pieces = 0;
	if (n <= 0 || !w->router)
		return 0;	/* all resident, or a dense layer: nothing streams */
	if (fp8 && (!w->s1 || !w->s2 || !w->s3))
		return -EINVAL;	/* fp8 experts without scales */
	s = calloc((size_t)n, sizeof(*s));
	src = calloc((size_t)n, sizeof(*src));
	if (!s || !src) {
		rc = -ENOMEM;
		goto out;
	}
	for (int x = 0, k = 0; x < E; x++) {
		if (mlens_residency_is_resident(&p->res, (int)l, x))
			continue;
		s[k++] = (struct stream_src){ w->w1[x], &b->w.w1[x], ih };
		s[k++] = (struct stream_src){ w->w2[x], &b->w.w2[x], ih };
		s[k++] = (struct stream_src){ w->w3[x], &b->w.w3[x], ih };
		if (!fp8)
			continue;
		s[k++] = (struct stream_src){ w->s1[x], (const void **)&b->w.s1[x], s13 };
		s[k++] = (struct stream_src){ w->s2[x], (const void **)&b->w.s2[x], s2 };
		s[k++] = (struct stream_src){ w->s3[x], (const void **)&b->w.s3[x], s13 };
	}
	qsort(s, (size_t)n, sizeof(*s), cmp_src);
	for (int k = 0; k < n; k++) {
		src[k].host = s[k].host;
		src[k].dst_off = off;
		src[k].bytes = s[k].bytes;
		*s[k].dst = base + off;
		off += fp8 ? mlens_quant_piece(s[k].bytes) : s[k].bytes;
	}
	b->n_pieces = mlens_pipe_pieces(src, n, piece, NULL, 0);
	b->pieces = calloc((size_t)b->n_pieces, sizeof(*b->pieces));
	if (!b->pieces) {
		rc = -ENOMEM;
		goto out;
	}
	mlens_pipe_pieces(src, n, piece, b->pieces, b->n_pieces);
out:
	free(s);
	free(src);
	return rc;
}

static int place_weights(struct mlens_pipeline *p, uint64_t piece)
{
	const struct mlens_model *m = p->m;
	int rc;

	p->layers = calloc((size_t)p->cfg.num_hidden_layers, sizeof(*p->layers));
	if (!p->layers)
		return -ENOMEM;
	rc = mlens_ends_bind(&p->ends, m, &p->placer);
	if (p->plan.slot) {
		p->slot[0] = galloc(p, p->plan.slot, &rc);
		p->slot[1] = galloc(p, p->plan.slot, &rc);
	}
	p->piece = piece;
	for (int64_t l = 0; l < p->cfg.num_hidden_layers && !rc; l++) {
		struct mlens_layer_bound *b = &p->layers[l].w;
		/* resident experts left on disk are copied once, from staging */
		if ((rc = mlens_disk_tier_ready(m->disk, (int)l)))
			break;
		rc = mlens_layer_bind(b, &m->layers[l], &p->desc, 0, &p->placer);
		for (int x = 0; x < p->res.experts && m->layers[l].router && !rc; x++)
			if (mlens_residency_is_resident(&p->res, (int)l, x))
				rc = mlens_layer_bind_expert(b, &m->layers[l], &p->desc, x, &p->placer);
		b->moe.tally = mlens_residency_tally(&p->res, (int)l);
	}
	/* each step reads only the streamed ones (their staging pointers
	 * move: the stream is planned after) */
	mlens_disk_tier_keep_from(m->disk, p->plan.resident_experts);
	for (int64_t l = 0; l < p->cfg.num_hidden_layers && !rc; l++)
		rc = plan_layer_stream(p, l, piece);
	return rc;
}

static void free_weights(struct mlens_pipeline *p)
{
	if (!p->layers)
		return;
	mlens_ends_unbind(&p->ends, p->m, &p->placer);
	for (int64_t l = 0; l < p->cfg.num_hidden_layers; l++) {
		struct mlens_layer_bound *b = &p->layers[l].w;
		for (int x = 0; x < p->res.experts && b->w1 && p->m->layers[l].router; x++)
			if (mlens_residency_is_resident(&p->res, (int)l, x))
				mlens_layer_unbind_expert(b, &p->m->layers[l], &p->desc, x, &p->placer);
		mlens_layer_unbind(b, &p->m->layers[l], &p->desc, 0, &p->placer);
		free(p->layers[l].pieces);
	}
	free(p->layers);
	p->layers = NULL;
	for (int s = 0; s < 2; s++)
		gfree(p, p->slot[s], p->plan.slot);
}

static int hx_start(struct mlens_pipeline *p);
static void hx_stop(struct mlens_pipeline *p);

/* ==== activation sets ==== */

static size_t set_floats(const struct mlens_pipeline *p, int which)
{
	size_t g = (size_t)p->group_rows;
	switch (which) {
	case 0: return g * (size_t)(p->qdim > (int)p->cfg.hidden_size ? p->qdim	/* xn */
								       : (int)p->cfg.hidden_size);
	case 1: return g * (size_t)p->qdim;			/* q, att */
	case 2: return g * (size_t)p->kvdim;			/* k, v */
	case 3: return g * (size_t)p->cfg.num_local_experts;	/* router logits */
	default: return g * (size_t)p->cfg.num_experts_per_tok;	/* weights, ids */
	}
}

/* Where GA's prefill attention writes its fp32 rows (see pl_shared). */
static float *prefill_out(const struct mlens_pipeline *p, const struct pl_set *S)
{
	return p->half_att ? p->sh.xn : S->att;
}

/* The O projection's input on the GPU: att, or with half_att the rows in
 * the weights' dtype, which live in q's buffer (a row there takes half of
 * a q row): GA rounds the prefill rows into it after the prefill
 * attention, the last reader of those q rows, and below the decode rows'
 * q (row d0 of q starts past row d0 of the half rows), which queue 2 may
 * still be copying; C's upload of the decode rows comes after C waited
 * for those copies; the GA of the set's next item, its next writer of q,
 * runs after GB(i), which read them. */
static void *att_in(const struct mlens_pipeline *p, const struct pl_set *S)
{
	return p->half_att ? (void *)S->q : (void *)S->att;
}

static void shared_alloc(struct mlens_pipeline *p, struct pl_shared *S, int *rc)
{
	S->xn = galloc(p, set_floats(p, 0) * 4, rc);
	S->rlog = galloc(p, set_floats(p, 3) * 4, rc);
	S->rw = galloc(p, set_floats(p, 4) * 4, rc);
	S->rid = galloc(p, set_floats(p, 4) * 4, rc);
}

static void shared_free(struct mlens_pipeline *p, struct pl_shared *S)
{
	gfree(p, S->xn, set_floats(p, 0) * 4);
	gfree(p, S->rlog, set_floats(p, 3) * 4);
	gfree(p, S->rw, set_floats(p, 4) * 4);
	gfree(p, S->rid, set_floats(p, 4) * 4);
}

static void set_alloc(struct mlens_pipeline *p, struct pl_set *S, int *rc)
{
	S->q = galloc(p, set_floats(p, 1) * 4, rc);
	S->att = p->half_att ? NULL : galloc(p, set_floats(p, 1) * 4, rc);	/* see pl_shared */
	S->k = galloc(p, set_floats(p, 2) * 4, rc);
	S->v = galloc(p, set_floats(p, 2) * 4, rc);
	if (*rc)
		return;
	S->hq = halloc(p, set_floats(p, 1) * 4);
	S->hatt = halloc(p, set_floats(p, 1) * 4);
	S->hk = halloc(p, set_floats(p, 2) * 4);
	S->hv = halloc(p, set_floats(p, 2) * 4);
	S->hatt_half = p->half_att ? halloc(p, set_floats(p, 1) * 2) : NULL;
	if (!S->hq || !S->hatt || !S->hk || !S->hv || (p->half_att && !S->hatt_half))
		*rc = -ENOMEM;
}

static void set_free(struct mlens_pipeline *p, struct pl_set *S)
{
	gfree(p, S->q, set_floats(p, 1) * 4);
	gfree(p, S->att, set_floats(p, 1) * 4);
	gfree(p, S->k, set_floats(p, 2) * 4);
	gfree(p, S->v, set_floats(p, 2) * 4);
	hfree(p, S->hq);
	hfree(p, S->hatt);
	hfree(p, S->hk);
	hfree(p, S->hv);
	hfree(p, S->hatt_half);
}

/* ==== create / destroy ==== */

static int kv_init(struct mlens_pipeline *p, const struct mlens_pipeline_opts *o, char *err,
		   size_t errlen)
{
	struct mlens_kv_cache layout;
	int rc;
	if ((rc = mlens_kv_layout(&layout, &p->cfg, o->kv_dtype, o->kv_block_size, o->kv_blocks, err,
				  errlen)))
		return rc;
	rc = mlens_kv_pool_init(&p->kv, p->c, &layout, o->kv_mem_k, o->kv_mem_v);
	if (rc)
		mlens_errf(err, errlen, "cannot allocate the KV cache (%u blocks of %d tokens) on the %s "
		       "backend: %s", layout.n_blocks, layout.block_size, p->c->ops->name,
		       strerror(-rc));
	return rc;
}

/* opts gpu_kv_append: a backend in host memory writes the pool as it is;
 * a device needs the pool's K and V registered (pinned and mapped) with
 * it, whole pages, for its kv_append to store through the mapping. */
static int kv_register(struct mlens_pipeline *p, char *err, size_t errlen)
{
	long pg = sysconf(_SC_PAGESIZE);
	size_t bytes = mlens_kv_bytes(&p->kv.cache);
	void *half[2] = { p->kv.cache.k, p->kv.cache.v };
	int rc;

	if (p->g->ops->host_memory) {
		p->gpu_append = true;
		return 0;
	}
	if (!p->async) {
		mlens_errf(err, errlen, "hybrid pipeline: the %s backend cannot write the KV pool in "
			   "host memory (no host registration); set kv_append = cpu", p->g->ops->name);
		return -ENOTSUP;
	}
	for (int i = 0; i < 2; i++) {
		if ((uintptr_t)half[i] % (uintptr_t)(pg > 0 ? pg : 4096)) {
			mlens_errf(err, errlen, "hybrid pipeline: the KV pool's %s is not page-aligned, "
				   "so the %s backend cannot map it; set kv_append = cpu", i ? "V" : "K",
				   p->g->ops->name);
			return -EINVAL;
		}
		rc = p->g->ops->host_register(p->g->ctx, half[i], bytes);
		if (rc == -EEXIST)
			continue;	/* registered by its owner already */
		if (rc) {
			mlens_errf(err, errlen, "hybrid pipeline: cannot register the KV pool's %s (%.2f GB) "
				   "with the %s backend for its K/V append: %s; set kv_append = cpu",
				   i ? "V" : "K", bytes / 1e9, p->g->ops->name, strerror(-rc));
			return rc;
		}
		p->kv_reg[i] = half[i];
	}
	p->gpu_append = true;
	return 0;
}

static bool has_async(const struct mlens_backend_ops *o)
{
	return MLENS_BACKEND_HAS(o, host_register) && MLENS_BACKEND_HAS(o, host_unregister) &&
	       MLENS_BACKEND_HAS(o, host_alloc) && MLENS_BACKEND_HAS(o, host_free) &&
	       MLENS_BACKEND_HAS(o, copy_async) && MLENS_BACKEND_HAS(o, event_record) &&
	       MLENS_BACKEND_HAS(o, event_wait) && MLENS_BACKEND_HAS(o, event_sync);
}

bool mlens_pipeline_half_att(const struct mlens_backend *gpu, const struct mlens_backend *cpu,
			     const struct mlens_model_config *c)
{
	/* the GPU backend says (n = 0) whether its O projection rounds its
	 * input to the weights' dtype: then C's output may go up so rounded */
	return MLENS_BACKEND_HAS(gpu->ops, round) && MLENS_BACKEND_HAS(gpu->ops, gemm_half_in) &&
	       MLENS_BACKEND_HAS(cpu->ops, round) &&
	       !gpu->ops->gemm_half_in(gpu->ctx, NULL, NULL, NULL, c->dtype, 0,
				       (int)(c->num_attention_heads * c->head_dim),
				       (int)c->hidden_size, true);
}

int mlens_pipeline_create(struct mlens_pipeline **out, const struct mlens_model *m,
			  struct mlens_backend *gpu, struct mlens_backend *cpu,
			  const struct mlens_pipeline_opts *o, char *err, size_t errlen)
{
	struct mlens_pipeline *p;
	size_t T, H;
	int rc = 0;

	if (!o->plan || o->plan->gpu_only || !o->plan->fits) {
		mlens_errf(err, errlen, "hybrid pipeline: no hybrid GPU memory plan given (make one with "
		       "mlens_gpu_plan_make)");
		return -EINVAL;
	}
	if (o->plan->att_half && !mlens_pipeline_half_att(gpu, cpu, &m->cfg)) {
		mlens_errf(err, errlen, "hybrid pipeline: the GPU memory plan sends the attention output up "
		       "in the weights' dtype, which the '%s' backend's O projection does not round to",
		       gpu->ops->name);
		return -EINVAL;
	}
	if (!cpu->ops->host_memory) {
		mlens_errf(err, errlen, "hybrid pipeline: the attention backend '%s' must use host "
		       "memory (the cpu backend)", cpu->ops->name);
		return -EINVAL;
	}
	p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->m = m;
	p->cfg = m->cfg;
	p->g = gpu;
	p->c = cpu;
	mlens_layer_desc_init(&p->desc, &p->cfg);
	p->grun = (struct mlens_layer_run){ gpu, &p->desc, NULL };
	p->crun = (struct mlens_layer_run){ cpu, &p->desc, NULL };
	p->placer = (struct mlens_layer_placer){ place, unplace, p };
	p->async = has_async(gpu->ops);
	p->side = p->async && o->side_copy_out && MLENS_BACKEND_HAS(gpu->ops, side_queue);
	p->up = p->side && o->up_copy_in && MLENS_BACKEND_HAS(gpu->ops, up_queue);
	p->host_pinned = p->async;
	p->groups = o->groups > 0 ? o->groups : 2;
	p->plan = *o->plan;
	p->sets = p->plan.sets;
	p->qdim = (int)(p->cfg.num_attention_heads * p->cfg.head_dim);
	p->kvdim = (int)(p->cfg.num_key_value_heads * p->cfg.head_dim);
	p->half_att = p->plan.att_half;
	if (p->groups > MLENS_PIPE_MAX_GROUPS) {
		mlens_errf(err, errlen, "hybrid pipeline: %d token groups asked for, at most %d",
		       p->groups, MLENS_PIPE_MAX_GROUPS);
		rc = -EINVAL;
		goto fail;
	}
	if (p->sets < MLENS_PIPE_SETS || p->sets > MLENS_PIPE_SETS_MAX) {
		mlens_errf(err, errlen, "hybrid pipeline: %d activation sets asked for; %d or %d",
			   p->sets, MLENS_PIPE_SETS, MLENS_PIPE_SETS_MAX);
		p->sets = 0;	/* none allocated */
		rc = -EINVAL;
		goto fail;
	}
	rc = kv_init(p, o, err, errlen);
	if (rc)
		goto fail;
	p->max_tokens = (int)p->plan.tokens;
	p->group_rows = (int)p->plan.group;
	p->chunk = p->plan.chunk;
	p->tail_rows = mlens_gpu_plan_tail_rows(p->chunk);
	/* the op scratch at the plan's size, held from here on: no step waits
	 * for it to grow, and an op that would need more fails */
	if (MLENS_BACKEND_HAS(gpu->ops, scratch_reserve) &&
	    (rc = gpu->ops->scratch_reserve(gpu->ctx, p->plan.scratch))) {
		mlens_errf(err, errlen, "hybrid pipeline: cannot reserve %.1f MiB of op scratch on the "
		       "%s backend: %s", p->plan.scratch / 1048576.0, gpu->ops->name, strerror(-rc));
		goto fail;
	}
	/* experts on disk have no fixed host copy to swap in from (the disk
	 * tier keeps experts 0..r-1 resident): the resident set stays put */
	if ((rc = mlens_residency_init(&p->res, (int)p->cfg.num_hidden_layers,
				       (int)p->cfg.num_local_experts, p->plan.resident_experts,
				       o->residency_routing && !m->disk, o->residency_period,
				       o->residency_swaps))) {
		mlens_errf(err, errlen, "hybrid pipeline: cannot keep the resident experts' routing "
			   "counts: %s", strerror(-rc));
		goto fail;
	}
	/* the backend's own memory (workspace, staging) counts as it stands */
	rc = place_weights(p, o->piece_bytes ? o->piece_bytes : MLENS_PIPE_PIECE);
	if (rc) {
		mlens_errf(err, errlen, "hybrid pipeline: cannot place the resident weights and the "
		       "expert slots on the %s backend: %s", gpu->ops->name, strerror(-rc));
		goto fail;
	}
	p->n_pieces = calloc((size_t)p->cfg.num_hidden_layers, sizeof(*p->n_pieces));
	if (!p->n_pieces) {
		rc = -ENOMEM;
		goto fail;
	}
	for (int64_t l = 0; l < p->cfg.num_hidden_layers; l++) {
		p->n_pieces[l] = p->layers[l].n_pieces;
		p->streams |= p->n_pieces[l] > 0;
	}
	if (p->async && (rc = register_stream(p))) {
		mlens_errf(err, errlen, "hybrid pipeline: cannot pin the weight pages for the expert "
		       "stream: %s", strerror(-rc));
		goto fail;
	}

	T = (size_t)p->max_tokens;
	H = (size_t)p->cfg.hidden_size;
	p->x = galloc(p, T * H * 4, &rc);
	p->logits = galloc(p, (size_t)p->tail_rows * (size_t)p->cfg.vocab_size * 4, &rc);
	for (int s = 0; s < p->sets; s++)
		set_alloc(p, &p->set[s], &rc);
	shared_alloc(p, &p->sh, &rc);
	if (rc) {
		mlens_errf(err, errlen, "hybrid pipeline: cannot allocate GPU activations for %d tokens "
		       "(groups of %d): %s", p->max_tokens, p->group_rows, strerror(-rc));
		goto fail;
	}
	if (mlens_step_rows_alloc(&p->rows, T))
		rc = -ENOMEM;
	p->cu = malloc((T + MLENS_PIPE_MAX_GROUPS) * sizeof(*p->cu));
	p->seg = malloc(T * sizeof(*p->seg));
	p->tmp = malloc(T * sizeof(*p->tmp));
	if (!p->cu || !p->seg || !p->tmp || rc) {
		rc = rc ? rc : -ENOMEM;
		mlens_errf(err, errlen, "hybrid pipeline: cannot allocate host buffers for %d tokens",
		       p->max_tokens);
		goto fail;
	}
	if (mlens_pipeline_gpu_bytes(p) > p->plan.budget) {
		mlens_errf(err, errlen, "hybrid pipeline: the %s backend holds %llu bytes, past the GPU "
		       "budget of %llu", gpu->ops->name,
		       (unsigned long long)mlens_pipeline_gpu_bytes(p),
		       (unsigned long long)p->plan.budget);
		rc = -ENOSPC;
		goto fail;
	}
	p->prefill_cpu = o->prefill_cpu;
	if (!p->prefill_cpu && !gpu->ops->host_memory) {
		/* a GPU kernel may cover only some head sizes: ask with no sequence */
		int32_t cu0 = 0;
		rc = mlens_layer_attn_prefill(&p->grun, prefill_out(p, &p->set[0]), p->set[0].q,
					      p->set[0].k, p->set[0].v, &cu0, 0);
		if (rc == -ENOTSUP)
			p->prefill_cpu = true;
		else if (rc)
			goto fail;
		rc = 0;
	}
	if (o->gpu_kv_append && (rc = kv_register(p, err, errlen)))
		goto fail;
	if (p->async && (rc = hx_start(p))) {
		mlens_errf(err, errlen, "hybrid pipeline: cannot start its host thread: %s",
		       strerror(-rc));
		goto fail;
	}
	p->trace = o->trace;
	p->cap_hs = 2 * (int)p->cfg.num_hidden_layers * MLENS_PIPE_MAX_GROUPS;
	p->hs = malloc((size_t)p->cap_hs * sizeof(*p->hs));
	if (!p->hs || (rc = mlens_step_timer_init(&p->timer, gpu))) {
		rc = rc ? rc : -ENOMEM;
		mlens_errf(err, errlen, "hybrid pipeline: cannot allocate its step timer");
		goto fail;
	}
	if ((p->ot = o->op_time)) {
		mlens_op_time_set_timer(p->ot, &p->timer, p->hx.on ? &p->hx.timer_mu : NULL);
		p->grun.probe = mlens_op_time_probe(p->ot);
	}
	p->st.async = p->async;
	p->st.side_copy_out = p->side;
	p->st.up_copy_in = p->up;
	p->st.att_up_half = p->half_att;
	p->st.sets = p->sets;
	p->st.prefill_cpu = p->prefill_cpu;
	p->st.gpu_kv_append = p->gpu_append;
	p->side_append = p->gpu_append && p->side && MLENS_BACKEND_HAS(gpu->ops, kv_append_side);
	p->st.kv_append_side = p->side_append;
	p->st.residency_routing = p->res.routing;
	*out = p;
	return 0;
fail:
	mlens_pipeline_destroy(p);
	return rc;
}

void mlens_pipeline_destroy(struct mlens_pipeline *p)
{
	size_t T, H;
	if (!p)
		return;
	hx_stop(p);
	p->g->ops->sync(p->g->ctx);
	mlens_step_timer_fini(&p->timer);
	free(p->hs);
	free(p->is[0]);
	free(p->is[1]);
	if (p->async && !p->g->ops->event_record(p->g->ctx, 1, MLENS_BACKEND_EVENTS - 1))
		p->g->ops->event_sync(p->g->ctx, MLENS_BACKEND_EVENTS - 1);	/* the weight stream, before unpinning */
	T = (size_t)p->max_tokens;
	H = (size_t)p->cfg.hidden_size;
	gfree(p, p->x, T * H * 4);
	gfree(p, p->logits, (size_t)p->tail_rows * (size_t)p->cfg.vocab_size * 4);
	for (int s = 0; s < p->sets; s++)
		set_free(p, &p->set[s]);
	shared_free(p, &p->sh);
	for (int i = 0; i < p->n_reg; i++)
		p->g->ops->host_unregister(p->g->ctx, p->reg[i].p);
	free(p->reg);
	for (int i = 0; i < 2; i++)
		if (p->kv_reg[i])
			p->g->ops->host_unregister(p->g->ctx, p->kv_reg[i]);
	free_weights(p);
	mlens_residency_fini(&p->res);
	if (MLENS_BACKEND_HAS(p->g->ops, scratch_reserve))
		p->g->ops->scratch_reserve(p->g->ctx, 0);	/* the backend outlives the pipeline */
	mlens_pipe_prog_free(&p->prog);
	free(p->n_pieces);
	if (p->kv.free_stack)
		mlens_kv_pool_fini(&p->kv);
	mlens_step_rows_free(&p->rows);
	free(p->cu);
	free(p->seg);
	free(p->tmp);
	free(p);
}

struct mlens_kv_pool *mlens_pipeline_kv(struct mlens_pipeline *p)
{
	return &p->kv;
}

const struct mlens_gpu_plan *mlens_pipeline_plan(const struct mlens_pipeline *p)
{
	return &p->plan;
}

int mlens_pipeline_max_step_tokens(const struct mlens_pipeline *p)
{
	return p->max_tokens;
}

const struct mlens_pipeline_stats *mlens_pipeline_stats(const struct mlens_pipeline *p)
{
	return &p->st;
}

const struct mlens_residency *mlens_pipeline_residency(const struct mlens_pipeline *p)
{
	return &p->res;
}

/* Backend events past the program's, per set: q, k and v final in GA (queue 2
 * starts the set's copies to the host after it), C's output uploaded (on
 * queue 3, with p->up; GB waits for it) and the prefill rows' K/V stored
 * (on queue 2 after the qkv record, with side_append; the set's next GA
 * waits for it). */
#define PL_EV_GA_DONE MLENS_PIPE_EV_N
#define PL_EV_ATT_UP (PL_EV_GA_DONE + MLENS_PIPE_SETS_MAX)
#define PL_EV_KV_LATE (PL_EV_ATT_UP + MLENS_PIPE_SETS_MAX)
/* a layer's weight copies done, before its disk staging is read into again */
#define PL_EV_DISK (PL_EV_KV_LATE + MLENS_PIPE_SETS_MAX)
_Static_assert(PL_EV_DISK < MLENS_BACKEND_EVENTS - 1,
	       "the pipeline's events and the last one (kept for waits of its own) fit the backend's");

/* ==== the stages ==== */

#define G (p->g->ops)
#define GC (p->g->ctx)
#define TRY(x) do { if ((rc = (x))) return rc; } while (0)

/* Activation copies: on the compute queue when asynchronous (GA's to the
 * host on queue 2 with p->side, C's back on queue 3 with p->up). */
static int to_host(struct mlens_pipeline *p, void *dst, const void *src, size_t bytes)
{
	p->st.d2h_act_bytes += bytes;
	if (p->async)
		return G->copy_async(GC, p->side ? 2 : 0, dst, src, bytes, false);
	return G->download(GC, dst, src, bytes);
}

static int to_gpu(struct mlens_pipeline *p, void *dst, const void *src, size_t bytes)
{
	p->st.h2d_act_bytes += bytes;
	if (p->async)
		return G->copy_async(GC, p->up ? 3 : 0, dst, src, bytes, true);
	return G->upload(GC, dst, src, bytes);
}

/* GA: norm, QKV, RoPE, prefill attention; K/V of every row and q of the
 * cache-reading rows out to the host. */
/* K and V bytes of tokens positions of one layer in the pool (an fp8
 * row's scale included). */
static uint64_t kv_bytes(const struct mlens_pipeline *p, uint64_t tokens)
{
	return tokens * 2 * (mlens_kv_token_bytes(&p->kv.cache) / (uint64_t)p->kv.cache.n_layers);
}

static int stage_ga(struct mlens_pipeline *p, int l, const struct pl_group *gr,
		    struct pl_set *S)
{
	const struct mlens_model_config *c = &p->cfg;
	const struct pl_layer *b = &p->layers[l];
	int H = (int)c->hidden_size, n = gr->r1 - gr->r0, rc;
	size_t r0 = (size_t)gr->r0, qd = (size_t)p->qdim, kvd = (size_t)p->kvdim;
	/* first row (of the group) whose q the CPU needs */
	size_t d0 = p->prefill_cpu ? 0 : (size_t)gr->P;

	if (!n)
		return 0;
	if (S->late_wait) {	/* k and v are rewritten below */
		TRY(G->event_wait(GC, 0, PL_EV_KV_LATE + (int)(S - p->set)));
		S->late_wait = false;
	}
	TRY(mlens_layer_attn_in(&p->grun, &b->w, p->x + r0 * H, p->sh.xn, S->q, S->k, S->v,
				p->rows.pos + r0, n));
	if (p->gpu_append) {
		/* every row's K and V into its slot of the pool, stored over
		 * the link in the pool's dtype; C(l, x) waits for this group's
		 * qkv record, which follows on the same queue (queue 2 with
		 * side_append: queued below) */
		if (!p->side_append)
			TRY(mlens_layer_kv_append(&p->grun, &p->kv.cache, l, S->k, S->v,
						  p->rows.slots + r0, n));
		p->st.d2h_act_bytes += kv_bytes(p, (uint64_t)n);
	}
	if (p->side) {
		/* queue 2 copies once q, k and v are final (RoPE done), beside
		 * the prefill attention below, which only reads them: C(i)
		 * waits for these copies, and a prefill attention before them
		 * lengthened that wait. The set's next writer, GA(i+2), is
		 * issued only after C(i) waited for the copies (its qkv record
		 * is on queue 2, run_cmd) */
		int ev = PL_EV_GA_DONE + (int)(S - p->set);
		TRY(G->event_record(GC, 0, ev));
		TRY(G->event_wait(GC, 2, ev));
		/* the stores beside queue 0's next kernels; S->k and S->v stay
		 * as they are until C(i) has waited (above). Only the rows C
		 * reads (decode rows, later parts of cut prompts: [P, n)) go
		 * before the q copy and the qkv record that C waits for; the
		 * prefill rows' follow the record (kv_late): later groups' and
		 * steps' C wait for records after them on this queue */
		if (p->side_append) {
			TRY(G->kv_append_side(GC, &p->kv.cache, l, S->k + d0 * kvd, S->v + d0 * kvd,
					      p->rows.slots + r0 + d0, n - (int)d0));
			S->late = d0 ? gr : NULL;
			S->late_layer = l;
		}
	}
	if (gr->n_pre && !p->prefill_cpu)
		TRY(mlens_layer_attn_prefill(&p->grun, prefill_out(p, S), S->q, S->k, S->v, gr->cu,
					     gr->n_pre));
	if (p->half_att && d0)	/* the prefill rows' output, as GB takes it */
		TRY(G->round(GC, att_in(p, S), c->dtype, prefill_out(p, S), (int)d0, (int)qd));
	if (!p->gpu_append || p->prefill_cpu) {	/* the host appends, or attends prefill rows */
		TRY(to_host(p, S->hk, S->k, (size_t)n * kvd * 4));
		TRY(to_host(p, S->hv, S->v, (size_t)n * kvd * 4));
	}
	if ((size_t)n > d0)
		TRY(to_host(p, S->hq + d0 * qd, S->q + d0 * qd, ((size_t)n - d0) * qd * 4));
	return 0;
}

/* After GA's qkv record on queue 2: its prefill rows' K/V stores (stage_ga),
 * and the record that the set's next GA waits for before it rewrites k and
 * v. */
static int kv_late(struct mlens_pipeline *p, struct pl_set *S)
{
	int rc;

	if (!S->late)
		return 0;
	TRY(G->kv_append_side(GC, &p->kv.cache, S->late_layer, S->k, S->v,
			      p->rows.slots + S->late->r0, S->late->P));
	S->late = NULL;
	TRY(G->event_record(GC, 2, PL_EV_KV_LATE + (int)(S - p->set)));
	S->late_wait = true;
	return 0;
}

/* C: this step's K/V into the CPU pool, decode attention there, its
 * output back to the GPU. */
static int stage_c(struct mlens_pipeline *p, int l, const struct pl_group *gr,
		   const struct pl_set *S)
{
	const struct mlens_model_config *c = &p->cfg;
	size_t r0 = (size_t)gr->r0, qd = (size_t)p->qdim;
	size_t d0 = (size_t)gr->P;
	int n = gr->r1 - gr->r0, nd = n - gr->P, rc;
	double t0 = now();

	if (!n)
		return 0;
	if (p->prefill_cpu && gr->n_pre)
		TRY(mlens_layer_attn_prefill(&p->crun, S->hatt, S->hq, S->hk, S->hv, gr->cu,
					     gr->n_pre));
	if (!p->gpu_append) {
		double ta = now();
		TRY(p->c->ops->kv_append(p->c->ctx, &p->kv.cache, l, S->hk, S->hv, p->rows.slots + r0, n));
		p->st.cpu_append_s += now() - ta;
	}
	/* the decode rows' output rounded here as GB's GEMM would round it
	 * there, in the attention's own pool run (with prefill_cpu the prefill
	 * rows' output is rounded too, all rows in one round below) */
	if (nd > 0 && p->half_att && !p->prefill_cpu)
		TRY(mlens_layer_attn_decode_half(&p->crun, (char *)S->hatt_half + d0 * qd * 2,
						 S->hatt + d0 * qd, S->hq + d0 * qd, &p->kv.cache, l,
						 p->rows.qry + r0 + d0, nd));
	else if (nd > 0)
		TRY(mlens_layer_attn_decode(&p->crun, S->hatt + d0 * qd, S->hq + d0 * qd, &p->kv.cache,
					    l, p->rows.qry + r0 + d0, nd));
	if (p->prefill_cpu) {
		d0 = 0;	/* the prefill rows' output comes back too */
		if (p->half_att)
			TRY(p->c->ops->round(p->c->ctx, S->hatt_half, c->dtype, S->hatt, n,
					     (int)qd));
	}
	p->st.cpu_attn_s += now() - t0;
	if ((size_t)n > d0) {
		size_t es = p->half_att ? 2 : 4, off = d0 * qd * es;
		TRY(to_gpu(p, (char *)att_in(p, S) + off,
			   (const char *)(p->half_att ? S->hatt_half : (void *)S->hatt) + off,
			   ((size_t)n - d0) * qd * es));
	}
	/* GB (its dep is this C) waits for it on queue 0 */
	if (p->up)
		TRY(G->event_record(GC, 3, PL_EV_ATT_UP + (int)(S - p->set)));
	return 0;
}

/* GB: O projection into the residual, norm, router, experts. */
static int stage_gb(struct mlens_pipeline *p, int l, const struct pl_group *gr,
		    const struct pl_set *S)
{
	int H = (int)p->cfg.hidden_size, n = gr->r1 - gr->r0, rc;
	size_t r0 = (size_t)gr->r0;

	if (!n)
		return 0;
	if (p->up)	/* C's output, uploaded on queue 3 */
		TRY(G->event_wait(GC, 0, PL_EV_ATT_UP + (int)(S - p->set)));
	return mlens_layer_gb(&p->grun, &p->layers[l].w, p->x + r0 * H, att_in(p, S), p->half_att,
			      p->sh.xn, p->sh.rlog, p->sh.rid, p->sh.rw, n, (int)p->chunk);
}

/* TAIL: final norm and lm_head of the rows that need logits, in chunks;
 * sampling; logits to the host where a request asked. */
static int stage_tail(struct mlens_pipeline *p, bool want_logits)
{
	struct mlens_step_rows *sr = &p->rows;
	int V = (int)p->cfg.vocab_size, nl = sr->nl, rc;

	if (want_logits)
		TRY(mlens_step_rows_host_logits(sr, (size_t)nl, V));
	/* the tail runs after every GB (queue order): the shared xn is free
	 * for a chunk's rows */
	return mlens_ends_logits(&p->grun, &p->ends, V, p->x, p->sh.xn, p->logits, sr->lrow, nl,
				 (int)p->tail_rows, sr->samp, sr->sampled, sr->logp,
				 want_logits ? sr->host_logits : NULL);
}

/* ==== the two sides of a step ==== */

static int run_cmd(struct mlens_pipeline *p, const struct mlens_pipe_cmd *cmd, bool want_logits);

/* Wait until the side that owns command dep has run it (or a side
 * failed); 0 or the failure. */
static int hx_wait(struct mlens_pipeline *p, int dep)
{
	int side = p->prog.cmd[dep].queue, rc;
	pthread_mutex_lock(&p->hx.mu);
	while (!p->hx.rc && p->hx.pos[side] <= dep)
		pthread_cond_wait(&p->hx.cv, &p->hx.mu);
	rc = p->hx.rc;
	pthread_mutex_unlock(&p->hx.mu);
	return rc;
}

static void hx_post(struct mlens_pipeline *p, int side, int v, int rc)
{
	pthread_mutex_lock(&p->hx.mu);
	p->hx.pos[side] = v;
	if (rc && !p->hx.rc)
		p->hx.rc = rc;
	pthread_cond_broadcast(&p->hx.cv);
	pthread_mutex_unlock(&p->hx.mu);
}

/* A GPU-side or mover span of a traced step (the host side has its own). */
static void issue_span(struct mlens_pipeline *p, int side, double t0, int k, bool dep)
{
	int q = side == MLENS_PIPE_Q_GPU ? 0 : side == MLENS_PIPE_Q_COPY ? 1 : -1;
	if (q < 0 || p->n_is[q] >= p->cap_is)
		return;
	p->is[q][p->n_is[q]++] = (struct pl_ispan){ t0, now(), k, dep };
}

/* One side's commands of this step, in program order; the first failure
 * stops every side. */
static int run_side(struct mlens_pipeline *p, int side, bool want_logits)
{
	int rc = 0;
	for (int k = 0; k < p->prog.n && !rc; k++) {
		const struct mlens_pipe_cmd *c = &p->prog.cmd[k];
		if ((int)c->queue != side)
			continue;
		bool traced = mlens_trace_on(p->trace);
		double t0 = traced ? now() : 0;
		if (c->dep >= 0 && (int)p->prog.cmd[c->dep].queue != side) {
			rc = hx_wait(p, c->dep);
			if (traced) {
				issue_span(p, side, t0, k, true);
				t0 = now();
			}
		}
		if (!rc)
			rc = run_cmd(p, c, want_logits);
		if (traced)
			issue_span(p, side, t0, k, false);
		hx_post(p, side, k + 1, rc);
	}
	hx_post(p, side, p->prog.n, rc);
	return rc;
}

static void *side_thread(void *arg)
{
	struct mlens_pipeline *p = ((struct hx_arg *)arg)->p;
	int side = ((struct hx_arg *)arg)->side;
	uint64_t seen = 0;
	int brc = MLENS_BACKEND_HAS(p->g->ops, bind_thread) ? p->g->ops->bind_thread(p->g->ctx) : 0;

	for (;;) {
		pthread_mutex_lock(&p->hx.mu);
		while (!p->hx.quit && p->hx.job == seen)
			pthread_cond_wait(&p->hx.cv, &p->hx.mu);
		if (p->hx.quit) {
			pthread_mutex_unlock(&p->hx.mu);
			return NULL;
		}
		seen = p->hx.job;
		pthread_mutex_unlock(&p->hx.mu);
		if (brc)
			hx_post(p, side, p->prog.n, brc);
		else
			run_side(p, side, p->hx.want_logits);
		pthread_mutex_lock(&p->hx.mu);
		p->hx.done[side] = seen;
		pthread_cond_broadcast(&p->hx.cv);
		pthread_mutex_unlock(&p->hx.mu);
	}
}

static int hx_start(struct mlens_pipeline *p)
{
	static const int sides[2] = { MLENS_PIPE_Q_COPY, MLENS_PIPE_Q_HOST };
	int started = 0;

	if (pthread_mutex_init(&p->hx.mu, NULL))
		return -ENOMEM;
	if (pthread_mutex_init(&p->hx.timer_mu, NULL)) {
		pthread_mutex_destroy(&p->hx.mu);
		return -ENOMEM;
	}
	if (pthread_cond_init(&p->hx.cv, NULL)) {
		pthread_mutex_destroy(&p->hx.timer_mu);
		pthread_mutex_destroy(&p->hx.mu);
		return -ENOMEM;
	}
	p->hx.on = true;
	for (; started < 2; started++) {
		struct hx_arg *a = &p->hx_arg[sides[started]];
		a->p = p;
		a->side = sides[started];
		if (pthread_create(&p->hx.th[a->side], NULL, side_thread, a))
			break;
	}
	if (started < 2) {
		pthread_mutex_lock(&p->hx.mu);
		p->hx.quit = true;
		pthread_cond_broadcast(&p->hx.cv);
		pthread_mutex_unlock(&p->hx.mu);
		for (int i = 0; i < started; i++)
			pthread_join(p->hx.th[sides[i]], NULL);
		pthread_cond_destroy(&p->hx.cv);
		pthread_mutex_destroy(&p->hx.timer_mu);
		pthread_mutex_destroy(&p->hx.mu);
		p->hx.on = false;
		return -EAGAIN;
	}
	return 0;
}

static void hx_stop(struct mlens_pipeline *p)
{
	if (!p->hx.on)
		return;
	pthread_mutex_lock(&p->hx.mu);
	p->hx.quit = true;
	pthread_cond_broadcast(&p->hx.cv);
	pthread_mutex_unlock(&p->hx.mu);
	pthread_join(p->hx.th[MLENS_PIPE_Q_COPY], NULL);
	pthread_join(p->hx.th[MLENS_PIPE_Q_HOST], NULL);
	pthread_cond_destroy(&p->hx.cv);
	pthread_mutex_destroy(&p->hx.timer_mu);
	pthread_mutex_destroy(&p->hx.mu);
	p->hx.on = false;
}

/* Run the step's program: on one thread in program order, or a thread
 * per queue (the caller takes the GPU side). */
static int run_prog(struct mlens_pipeline *p, bool want_logits)
{
	int rc = 0, rc2;

	if (!p->hx.on) {
		for (int i = 0; i < p->prog.n && !rc; i++)
			rc = run_cmd(p, &p->prog.cmd[i], want_logits);
		return rc;
	}
	pthread_mutex_lock(&p->hx.mu);
	for (int q = 0; q < MLENS_PIPE_Q_N; q++)
		p->hx.pos[q] = 0;
	p->hx.rc = 0;
	p->hx.want_logits = want_logits;
	p->hx.job++;
	pthread_cond_broadcast(&p->hx.cv);
	pthread_mutex_unlock(&p->hx.mu);
	rc = run_side(p, MLENS_PIPE_Q_GPU, want_logits);
	pthread_mutex_lock(&p->hx.mu);
	while (p->hx.done[MLENS_PIPE_Q_HOST] != p->hx.job || p->hx.done[MLENS_PIPE_Q_COPY] != p->hx.job)
		pthread_cond_wait(&p->hx.cv, &p->hx.mu);
	rc2 = p->hx.rc;
	pthread_mutex_unlock(&p->hx.mu);
	if (rc || rc2)
		(void)p->g->ops->sync(p->g->ctx);	/* nothing of this step still runs */
	return rc ? rc : rc2;
}

/* The step's busy times and KV reads into the stats, its ops' times into
 * the op account (step_rc: the step's outcome); its spans into the trace
 * when one records. */
static void step_times(struct mlens_pipeline *p, int step_rc)
{
	const struct mlens_model_config *c = &p->cfg;
	double busy[2];
	int frc = mlens_step_timer_finish(&p->timer, busy);

	if (p->ot)
		mlens_op_time_step_done(p->ot, step_rc ? step_rc : frc);
	if (!frc) {
		p->st.gpu_busy_s = busy[0];
		p->st.h2d_busy_s = mlens_step_timer_busy(&p->timer, "h2d");
	} else {
		p->st.gpu_busy_s = p->st.h2d_busy_s = 0;
	}
	p->st.gpu_busy_s_total += p->st.gpu_busy_s;
	p->st.h2d_busy_s_total += p->st.h2d_busy_s;
	p->st.kv_read_bytes = kv_bytes(p, p->st.kv_read_tokens) * (uint64_t)c->num_hidden_layers;
	p->st.kv_read_bytes_total += p->st.kv_read_bytes;
	/* a C span says the KV bytes it read (its group's decode rows, one
	 * layer): trace_summary.py takes C's rate from it */
	for (int i = 0; i < p->n_hs && mlens_trace_on(p->trace); i++) {
		const struct pl_hspan *h = &p->hs[i];
		if (h->wait)
			mlens_trace_spanf(p->trace, "host-wait", h->t0, h->t1, "WAIT l%d g%d",
					  h->layer, h->group);
		else	/* a C command always has its group */
			mlens_trace_spanf(p->trace, "cpu-attn", h->t0, h->t1, "C l%d g%d kv%llu",
					  h->layer, h->group,
					  (unsigned long long)kv_bytes(p, (uint64_t)p->grp[h->group].kv_tokens));
	}
	for (int q = 0; q < 2 && mlens_trace_on(p->trace); q++)
		for (int i = 0; i < p->n_is[q]; i++) {
			const struct pl_ispan *sp = &p->is[q][i];
			const struct mlens_pipe_cmd *cmd = &p->prog.cmd[sp->cmd];
			mlens_trace_spanf(p->trace, q ? "mover-thread" : "gpu-thread", sp->t0, sp->t1,
					  "%s%s l%d g%d p%d", sp->dep ? "dep of " : "",
					  mlens_pipe_kind_name(cmd->kind), cmd->layer, cmd->group,
					  cmd->piece);
		}
}

/* ==== resident experts ==== */

static int weight_up(struct mlens_pipeline *p, const void *dst, const void *src, size_t bytes)
{
	p->st.h2d_swap_bytes += bytes;
	if (p->async)
		return G->copy_async(GC, 1, (void *)dst, src, bytes, true);
	return G->upload(GC, (void *)dst, src, bytes);
}

/* Expert x of layer l from the host into the GPU memory of resident
 * expert at (whose pointers x takes when take). */
static int expert_up(struct mlens_pipeline *p, int l, int x, int at, bool take)
{
	struct mlens_layer_bound *b = &p->layers[l].w;
	const struct mlens_layer_weights *w = &p->m->layers[l];
	size_t ih = mlens_layer_expert_bytes(&p->desc);
	size_t s13 = mlens_layer_scale_bytes(&p->desc, false), s2 = mlens_layer_scale_bytes(&p->desc, true);
	int rc;

	if (take) {
		b->w1[x] = b->w1[at];
		b->w2[x] = b->w2[at];
		b->w3[x] = b->w3[at];
		b->s1[x] = b->s1[at];
		b->s2[x] = b->s2[at];
		b->s3[x] = b->s3[at];
	}
	TRY(weight_up(p, b->w1[at], w->w1[x], ih));
	TRY(weight_up(p, b->w2[at], w->w2[x], ih));
	TRY(weight_up(p, b->w3[at], w->w3[x], ih));
	if (s13) {
		TRY(weight_up(p, b->s1[at], w->s1[x], s13));
		TRY(weight_up(p, b->s2[at], w->s2[x], s2));
		TRY(weight_up(p, b->s3[at], w->s3[x], s13));
	}
	return 0;
}

/* Between steps: the experts the residency's choice takes in (a bounded
 * number a step) uploaded over the GPU memory of the ones it sends back to
 * the stream, whose layers' pieces are made again. The uploads go on the
 * weight stream's queue after everything the compute queue holds (the
 * last step's readers of that memory), and the compute queue waits for
 * them before this step's kernels. A swap in layer 0 or 1 voids their
 * prefetch (their slot's layout changed). An upload that fails leaves
 * the sets as they were (the expert sent back uploaded again). */
static int swap_experts(struct mlens_pipeline *p)
{
	const int ev = MLENS_BACKEND_EVENTS - 1;
	int l, in, out, n = 0, rc = 0, rc2 = 0;

	p->st.h2d_swap_bytes = 0;
	while (!rc && mlens_residency_next_swap(&p->res, &l, &in, &out)) {
		if (!n++ && p->async &&
		    ((rc = G->event_record(GC, 0, ev)) || (rc = G->event_wait(GC, 1, ev))))
			break;
		if ((rc = expert_up(p, l, in, out, true)))
			(void)expert_up(p, l, out, out, false);
		else
			mlens_residency_swapped(&p->res, l, in, out);
		/* the streamed experts' pointers into the slot (in's back, on
		 * a failure) */
		rc2 = plan_layer_stream(p, l, p->piece);
		rc = rc ? rc : rc2;
		p->n_pieces[l] = p->layers[l].n_pieces;
		if (l < 2)
			p->prefetched = false;
	}
	/* the compute queue after the uploads, a failed swap's too */
	if (n && p->async && (rc2 = G->event_record(GC, 1, ev)) == 0)
		rc2 = G->event_wait(GC, 0, ev);
	p->st.expert_swaps_total = p->res.swaps;
	return rc ? rc : n && p->async ? rc2 : 0;
}

/* ==== the step ==== */

static int add_seg(struct mlens_pipeline *p, int req, int j0, int j1, int x)
{
	if (x >= MLENS_PIPE_MAX_GROUPS)
		return -E2BIG;
	p->tmp[p->n_seg].req = req;
	p->tmp[p->n_seg].j0 = j0;
	p->tmp[p->n_seg].j1 = j1;
	p->tmp[p->n_seg].grp = x;
	p->n_seg++;
	return 0;
}

/* The n tokens of request req from group *x on: what the group has room
 * for, the rest in the next groups as further segments. */
static int place_rows(struct mlens_pipeline *p, int64_t *rows, int req, int n, int *x)
{
	int64_t gr = p->group_rows;
	int rc;
	for (int j = 0; j < n;) {
		int take = n - j;
		while (rows[*x] >= gr)
			if (++*x >= MLENS_PIPE_MAX_GROUPS)
				return -E2BIG;
		if (rows[*x] + take > gr)
			take = (int)(gr - rows[*x]);
		if ((rc = add_seg(p, req, j, j + take, *x)))
			return rc;
		rows[*x] += take;
		j += take;
	}
	return 0;
}

/* Cut the step's requests into groups of at most group_rows rows so that
 * both sides of the pipe stay busy: G groups (enough for the rows, at
 * least the configured count when there are requests enough); the
 * requests that read the cache (decode) spread over the groups by the KV
 * bytes their attention reads (the CPU's work), then the prefill requests
 * fill the groups towards equal rows (the GPU's work): one moves on to the
 * next group when its middle would pass the group's share. A prefill request is
 * never cut unless it is longer than a group (its later segments would
 * read the cache on the CPU); one that does not fit what a group has left
 * goes to the next group, a new one past G if need be. */
static int split_groups(struct mlens_pipeline *p, const struct mlens_engine_req *reqs, int n,
			int64_t total)
{
	int64_t gr = p->group_rows, want, target, kv_tot = 0, kv_cum = 0;
	int64_t rows[MLENS_PIPE_MAX_GROUPS];
	int x = 0, ng, rc;

	want = (total + gr - 1) / gr;
	if (want < p->groups && n >= p->groups)
		want = p->groups;
	if (want < 1)
		want = 1;
	if (want > MLENS_PIPE_MAX_GROUPS)
		return -E2BIG;
	ng = (int)want;
	target = (total + want - 1) / want;
	memset(rows, 0, sizeof(rows));
	p->n_seg = 0;
	for (int i = 0; i < n; i++)
		if (reqs[i].seq->len > 0)
			kv_tot += (int64_t)reqs[i].n_tokens * (reqs[i].seq->len + 1);
	/* decode: contiguous runs of the list, cut by the middle of each
	 * request's KV reads */
	for (int i = 0; i < n && kv_tot > 0; i++) {
		const struct mlens_engine_req *r = &reqs[i];
		int64_t kv = (int64_t)r->n_tokens * (r->seq->len + 1);
		int want_x;
		if (r->seq->len == 0)
			continue;
		want_x = (int)((2 * kv_cum + kv) * ng / (2 * kv_tot));
		kv_cum += kv;
		if (want_x > x)
			x = want_x < ng ? want_x : ng - 1;
		if ((rc = place_rows(p, rows, i, r->n_tokens, &x)))
			return rc;
		if (x + 1 > ng)
			ng = x + 1;
	}
	/* prefill: towards target rows a group, by the middle of each prompt */
	x = 0;
	for (int i = 0; i < n; i++) {
		const struct mlens_engine_req *r = &reqs[i];
		int nt = r->n_tokens;
		if (r->seq->len > 0)
			continue;
		while (x + 1 < MLENS_PIPE_MAX_GROUPS && rows[x] > 0 &&
		       ((x + 1 < ng && 2 * rows[x] + nt > 2 * target) ||
			(nt <= gr && rows[x] + nt > gr)))
			x++;
		if ((rc = place_rows(p, rows, i, nt, &x)))
			return rc;
		if (x + 1 > ng)
			ng = x + 1;
	}
	/* segments in group order (stable counting sort), empty groups dropped */
	{
		int start[MLENS_PIPE_MAX_GROUPS + 1] = { 0 };
		for (int t = 0; t < p->n_seg; t++)
			start[p->tmp[t].grp + 1]++;
		for (int g = 0; g < ng; g++)
			start[g + 1] += start[g];
		p->n_grp = 0;
		for (int g = 0; g < ng; g++) {
			if (start[g + 1] > start[g]) {
				p->grp[p->n_grp].s0 = start[g];
				p->grp[p->n_grp].s1 = start[g + 1];
				p->n_grp++;
			}
		}
		for (int t = 0; t < p->n_seg; t++)
			p->seg[start[p->tmp[t].grp]++] = p->tmp[t];
	}
	return 0;
}

/* Rows of a group: its segments, prefill ones (the first segment of a
 * request with nothing cached) first. */
static void layout_group(struct mlens_pipeline *p, struct mlens_engine_req *reqs, int *row,
			 int32_t **cu, struct pl_group *gr)
{
	int bs = p->kv.cache.block_size;
	gr->r0 = *row;
	gr->n_pre = 0;
	gr->kv_tokens = 0;
	gr->kv_blocks = gr->kv_runs = 0;
	gr->cu = *cu;
	gr->cu[0] = 0;
	for (int pass = 0; pass < 2; pass++) {
		for (int k = gr->s0; k < gr->s1; k++) {
			const struct pl_seg *sg = &p->seg[k];
			struct mlens_engine_req *r = &reqs[sg->req];
			bool pre = r->seq->len == 0 && sg->j0 == 0;
			if (pre != (pass == 0))
				continue;
			for (int j = sg->j0; j < sg->j1; j++, (*row)++) {
				int32_t ps = r->seq->len + j;
				mlens_step_rows_put(&p->rows, *row, sg->req, r, j, bs);
				if (!pre) {
					uint32_t nb = mlens_kv_blocks_for(&p->kv, (int64_t)ps + 1);
					gr->kv_tokens += (int64_t)ps + 1;
					gr->kv_blocks += nb;
					gr->kv_runs += mlens_seq_block_runs(r->seq, nb);
				}
			}
			if (pre)
				gr->cu[++gr->n_pre] = *row - gr->r0;
		}
		if (pass == 0)
			gr->P = *row - gr->r0;
	}
	gr->r1 = *row;
	*cu += gr->n_pre + 1;
}

static void host_span(struct mlens_pipeline *p, double t0, double t1,
		      const struct mlens_pipe_cmd *cmd, bool wait)
{
	if (!mlens_trace_on(p->trace) || p->n_hs >= p->cap_hs)
		return;
	p->hs[p->n_hs].t0 = t0;
	p->hs[p->n_hs].t1 = t1;
	p->hs[p->n_hs].layer = cmd->layer;
	p->hs[p->n_hs].group = cmd->group;
	p->hs[p->n_hs].wait = wait;
	p->n_hs++;
}

static int run_cmd_untimed(struct mlens_pipeline *p, const struct mlens_pipe_cmd *cmd,
			   bool want_logits);

/* GPU work and weight copies between timing marks on their queue. */
static int run_cmd(struct mlens_pipeline *p, const struct mlens_pipe_cmd *cmd, bool want_logits)
{
	static const char *const kind[] = { "HEAD", "GA", "C", "GB", "TAIL" };
	int sp = -1, rc;

	bool timed = cmd->kind == MLENS_PIPE_HEAD || cmd->kind == MLENS_PIPE_GA ||
		     cmd->kind == MLENS_PIPE_GB || cmd->kind == MLENS_PIPE_TAIL ||
		     cmd->kind == MLENS_PIPE_COPY;

	/* the GPU side and the mover share the step timer */
	if (timed && p->hx.on)
		pthread_mutex_lock(&p->hx.timer_mu);
	if (cmd->kind == MLENS_PIPE_COPY)
		sp = mlens_step_timer_begin(&p->timer, 1, "h2d", "%s l%d p%d",
					    cmd->next_step ? "PREFETCH" : "COPY", cmd->layer, cmd->piece);
	else if (timed && (cmd->kind == MLENS_PIPE_GA || cmd->kind == MLENS_PIPE_GB))
		/* with the group's rows: how full the groups run shows in a trace */
		sp = mlens_step_timer_begin(&p->timer, 0, "gpu", "%s l%d g%d n%d", kind[cmd->kind],
					    cmd->layer, cmd->group,
					    p->grp[cmd->group].r1 - p->grp[cmd->group].r0);
	else if (timed)
		sp = mlens_step_timer_begin(&p->timer, 0, "gpu", "%s l%d g%d", kind[cmd->kind],
					    cmd->layer, cmd->group);
	if (timed && p->hx.on)
		pthread_mutex_unlock(&p->hx.timer_mu);
	rc = run_cmd_untimed(p, cmd, want_logits);
	if (sp >= 0) {
		if (p->hx.on)
			pthread_mutex_lock(&p->hx.timer_mu);
		mlens_step_timer_end(&p->timer, sp);
		if (p->hx.on)
			pthread_mutex_unlock(&p->hx.timer_mu);
	}
	return rc;
}

static int run_cmd_untimed(struct mlens_pipeline *p, const struct mlens_pipe_cmd *cmd,
			   bool want_logits)
{
	const struct mlens_model_config *c = &p->cfg;
	int rc = 0;
	double t0;

	switch (cmd->kind) {
	case MLENS_PIPE_HEAD:
		return mlens_layer_embed(&p->grun, p->x, p->ends.embed, p->rows.tok,
					 p->grp[p->n_grp - 1].r1);
	case MLENS_PIPE_GA:
		return stage_ga(p, cmd->layer, &p->grp[cmd->group], &p->set[cmd->set]);
	case MLENS_PIPE_C:
		t0 = now();
		rc = stage_c(p, cmd->layer, &p->grp[cmd->group], &p->set[cmd->set]);
		host_span(p, t0, now(), cmd, false);
		return rc;
	case MLENS_PIPE_GB:
		return stage_gb(p, cmd->layer, &p->grp[cmd->group], &p->set[cmd->set]);
	case MLENS_PIPE_TAIL:
		return stage_tail(p, want_logits);
	case MLENS_PIPE_COPY: {
		const struct mlens_pipe_piece *pc = &p->layers[cmd->layer].pieces[cmd->piece];
		char *dst = (char *)p->slot[cmd->slot] + pc->dst_off;
		struct mlens_disk_tier *dt = p->m->disk;
		bool disk = mlens_disk_tier_holds(dt, cmd->layer, (int)c->num_local_experts - 1);
		/* experts left on disk: in their staging before the first piece */
		if (disk && cmd->piece == 0)
			TRY(mlens_disk_tier_ready(dt, cmd->layer));
		p->st.h2d_weight_bytes += pc->bytes;
		if (p->async)
			rc = G->copy_async(GC, 1, dst, pc->host, pc->bytes, true);
		else
			rc = G->upload(GC, dst, pc->host, pc->bytes);
		if (!rc && disk && cmd->piece == p->layers[cmd->layer].n_pieces - 1) {
			/* the staging may take the next layer once the copies
			 * out of it are done (the copy queue's thread waits) */
			if (p->async && !(rc = G->event_record(GC, 1, PL_EV_DISK)))
				rc = G->event_sync(GC, PL_EV_DISK);
			if (!rc)
				mlens_disk_tier_done(dt, cmd->layer);
		}
		return rc;
	}
	case MLENS_PIPE_RECORD:
		if (!p->async)
			return 0;
		/* with GA's copies on queue 2, C waits for them there */
		if (p->side && cmd->event >= MLENS_PIPE_EV_QKV && cmd->event < MLENS_PIPE_EV_N) {
			if ((rc = G->event_record(GC, 2, cmd->event)))
				return rc;
			return kv_late(p, &p->set[cmd->event - MLENS_PIPE_EV_QKV]);
		}
		return G->event_record(GC, cmd->queue == MLENS_PIPE_Q_COPY, cmd->event);
	case MLENS_PIPE_WAIT:
		return p->async ? G->event_wait(GC, cmd->queue == MLENS_PIPE_Q_COPY, cmd->event) : 0;
	case MLENS_PIPE_HOST_WAIT:
		if (!p->async)
			return 0;
		t0 = now();
		rc = G->event_sync(GC, cmd->event);
		p->st.host_wait_s += now() - t0;
		host_span(p, t0, now(), cmd, true);
		return rc;
	}
	return -EINVAL;
}

int mlens_pipeline_step(struct mlens_pipeline *p, struct mlens_engine_req *reqs, int n)
{
	const struct mlens_model_config *c = &p->cfg;
	int V = (int)c->vocab_size, row = 0, rc = 0;
	int64_t total = 0;
	int32_t *cu;
	bool want_logits = false;
	double t0 = now();

	if ((rc = mlens_step_reserve(c, &p->kv, reqs, n, p->max_tokens, &total)))
		return rc;
	for (int i = 0; i < n; i++)
		want_logits |= reqs[i].logits != NULL;

	if ((rc = split_groups(p, reqs, n, total)))
		return rc;
	p->rows.nl = 0;
	p->st.kv_read_tokens = 0;
	cu = p->cu;
	for (int x = 0; x < p->n_grp; x++) {
		layout_group(p, reqs, &row, &cu, &p->grp[x]);
		p->st.kv_read_tokens += (uint64_t)p->grp[x].kv_tokens;
		p->st.kv_read_blocks_total += p->grp[x].kv_blocks;
		p->st.kv_read_runs_total += p->grp[x].kv_runs;
	}
	mlens_step_rows_samp(&p->rows, reqs);
	if ((rc = swap_experts(p)))
		return rc;
	/* the next step's first two layers stream at the end of this one */
	if ((rc = mlens_pipe_prog_build_ex(&p->prog, (int)c->num_hidden_layers, p->n_grp,
					   p->n_pieces, MLENS_PIPE_PREFETCH |
					   (p->sets == 3 ? MLENS_PIPE_THREE_SETS : 0) |
					   (p->prefetched ? MLENS_PIPE_RESIDENT01 : 0))))
		return rc;
	p->st.groups = p->n_grp;

	p->st.h2d_weight_bytes = p->st.h2d_act_bytes = p->st.d2h_act_bytes = 0;
	p->st.cpu_attn_s = p->st.cpu_append_s = p->st.host_wait_s = 0;
	p->n_hs = p->n_is[0] = p->n_is[1] = 0;
	if (mlens_trace_on(p->trace) && p->cap_is < 2 * p->prog.n) {
		for (int q = 0; q < 2; q++) {
			struct pl_ispan *v = realloc(p->is[q], 2 * (size_t)p->prog.n * sizeof(*v));
			if (!v)
				return -ENOMEM;
			p->is[q] = v;
		}
		p->cap_is = 2 * p->prog.n;
	}
	/* a failed step's GA may have left prefill rows' stores unqueued:
	 * they are not this step's to make */
	for (int x = 0; x < MLENS_PIPE_SETS_MAX; x++)
		p->set[x].late = NULL;
	mlens_step_timer_start(&p->timer, p->trace);
	if (p->ot)
		mlens_op_time_step_start(p->ot);
	rc = run_prog(p, want_logits);
	step_times(p, rc);
	p->prefetched = !rc && p->streams;	/* after a failure, stream them again */
	if (rc) {
		mlens_residency_step_failed(&p->res);
		return rc;
	}
	mlens_residency_step_done(&p->res);
	p->st.expert_rows = p->res.step_routed_rows;
	p->st.expert_resident_rows = p->res.step_resident_rows;
	p->st.expert_rows_total = p->res.routed_rows;
	p->st.expert_resident_rows_total = p->res.resident_rows;
	if (mlens_pipeline_gpu_bytes(p) > p->plan.budget) {
		fprintf(stderr, "mlens pipeline: the %s backend holds %llu bytes after a step, past the "
			"GPU budget of %llu; the memory plan is wrong\n", p->g->ops->name,
			(unsigned long long)mlens_pipeline_gpu_bytes(p),
			(unsigned long long)p->plan.budget);
		return -ENOSPC;
	}

	mlens_step_deliver(&p->rows, reqs, n, V);
	p->st.steps++;
	p->st.h2d_bytes_total += p->st.h2d_weight_bytes + p->st.h2d_swap_bytes + p->st.h2d_act_bytes;
	p->st.d2h_bytes_total += p->st.d2h_act_bytes;
	p->st.cpu_attn_s_total += p->st.cpu_attn_s;
	p->st.cpu_append_s_total += p->st.cpu_append_s;
	p->st.host_wait_s_total += p->st.host_wait_s;
	p->st.step_s = now() - t0;
	return 0;
}
