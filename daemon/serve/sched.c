/* Scheduler: request lifecycle, the waiting queue with fair share across
 * tenants, the two modes, and the step that feeds the engine. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "daemon/exec/pipeline.h"
#include "daemon/serve/sched.h"

enum req_state { REQ_WAITING, REQ_RUNNING, REQ_FINISHED };

struct mlens_req {
	struct mlens_req *tnext, *tprev;	/* tenant's list */
	struct mlens_req *qnext, *qprev;	/* waiting queue or running list */
	struct mlens_sched_tenant *t;
	enum req_state state;
	uint64_t id;
	uint64_t admit_serial;	/* larger = younger; eviction picks the youngest */
	int32_t *tokens;	/* prompt then generated */
	int32_t n_prompt, n_gen, cap;
	int32_t max_tokens;
	struct mlens_sampling samp;
	int32_t stop[MLENS_MAX_STOP];
	int n_stop;
	bool logprobs;
	bool ignore_eos;
	struct mlens_seq seq;
	bool has_pending;	/* an event the tenant's ring had no room for */
	struct mlens_event pending;
	bool preempted;		/* waiting to re-prefill (or to come back from swap) */
	uint32_t *swap_slots;	/* its KV in the swap file (n_swap slots), or NULL */
	uint32_t n_swap;
	int32_t swap_len;	/* tokens of KV there */
	uint64_t readmit_step;	/* the step it came back in after an eviction (0: never evicted) */
	uint64_t skip_step;	/* the step whose admission passed it over last */
	uint32_t passed_over;	/* steps whose admission passed it over since it started waiting */
	struct mlens_req *wnext, *wprev;	/* the tenant's waiting requests */
	int64_t wseq;		/* place in the waiting queue: smaller is nearer the head */
	struct mlens_req *hnext;	/* the tenant's id hash chain */
	double arrival;		/* submit time, CLOCK_MONOTONIC */
	double last_token;	/* when the previous token was emitted */
};

/* Steps after its return from an eviction that a request is evicted
 * again only when no other running one can go: otherwise the youngest is
 * the one just brought back, which re-prefills only to lose its KV again
 * (and the pool thrashes). */
#define READMIT_GRACE 8

const double mlens_latency_buckets[MLENS_LAT_BUCKETS] = {
	0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, INFINITY
};

static void hist_add(struct mlens_hist *h, double v)
{
	int i = 0;
	while (i < MLENS_LAT_BUCKETS - 1 && v > mlens_latency_buckets[i])
		i++;
	h->bucket[i]++;
	h->count++;
	h->sum += v;
}

struct list {
	struct mlens_req *head, *tail;
	uint32_t n;
};

struct mlens_sched {
	struct mlens_engine *e;
	struct mlens_kv_pool *kv;
	int cap;
	int max_pos;
	uint32_t reserve;
	int horizon;		/* steps the admission reserve looks ahead */
	bool keep_room;		/* opts admit_keeps_room */
	struct mlens_kv_swap *swap;	/* opts swap */
	/* step scratch, [1..horizon]: the demand over the horizon of the
	 * running sequences and the prompts admitted so far, as differences */
	int64_t demand[MLENS_SCHED_HORIZON_MAX + 1];
	bool admission;
	bool preempt_mode;
	struct mlens_sched_tenant *wt_head;	/* tenants with waiting requests */
	int64_t wseq_head, wseq_tail;	/* the last wseq given at each end */
	/* the fair-share clock of the tenant admitted last, before that
	 * admission: the smallest among the tenants that could go then. A
	 * tenant that starts waiting (new, back after a reconnect, or idle
	 * for a while) starts from here, so it neither starves the others
	 * while it catches up nor cashes in time it did not wait. */
	double vnow;
	/* a KV quota was lowered or a request requeued: look for waiting
	 * requests that can no longer fit their tenant's quota */
	bool quota_check;
	uint64_t serial;
	uint64_t step_no;	/* steps begun, for skip_step and readmit_step */
	struct list waiting;	/* arrival order; preempted requests at the head */
	struct list running;
	struct list finished;	/* done, last event not yet delivered */
	struct mlens_sched_stats st;
	/* step scratch */
	struct mlens_engine_req *ereq;
	struct mlens_req **sreq;
	uint32_t *blocks_before;
	int scratch_n;
};

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ==== lists ==== */

static void q_remove(struct list *l, struct mlens_req *r)
{
	if (r->qprev)
		r->qprev->qnext = r->qnext;
	else
		l->head = r->qnext;
	if (r->qnext)
		r->qnext->qprev = r->qprev;
	else
		l->tail = r->qprev;
	r->qnext = r->qprev = NULL;
	l->n--;
}

static void q_push_tail(struct list *l, struct mlens_req *r)
{
	r->qnext = NULL;
	r->qprev = l->tail;
	if (l->tail)
		l->tail->qnext = r;
	else
		l->head = r;
	l->tail = r;
	l->n++;
}

static void q_push_head(struct list *l, struct mlens_req *r)
{
	r->qprev = NULL;
	r->qnext = l->head;
	if (l->head)
		l->head->qprev = r;
	else
		l->tail = r;
	l->head = r;
	l->n++;
}

/* The waiting queue: s->waiting, and each tenant's waiting requests in
 * the same order (an entry goes in at either end of both). */
static void wait_push(struct mlens_sched *s, struct mlens_req *r, bool head)
{
	struct mlens_sched_tenant *t = r->t;
	if (!t->wait_head) {	/* its first: the tenant joins the list */
		if (t->vtime < s->vnow)
			t->vtime = s->vnow;
		t->wt_prev = NULL;
		t->wt_next = s->wt_head;
		if (s->wt_head)
			s->wt_head->wt_prev = t;
		s->wt_head = t;
	}
	if (head) {
		q_push_head(&s->waiting, r);
		r->wseq = --s->wseq_head;
		r->wprev = NULL;
		r->wnext = t->wait_head;
		if (t->wait_head)
			t->wait_head->wprev = r;
		else
			t->wait_tail = r;
		t->wait_head = r;
	} else {
		q_push_tail(&s->waiting, r);
		r->wseq = ++s->wseq_tail;
		r->wnext = NULL;
		r->wprev = t->wait_tail;
		if (t->wait_tail)
			t->wait_tail->wnext = r;
		else
			t->wait_head = r;
		t->wait_tail = r;
	}
}

static void wait_remove(struct mlens_sched *s, struct mlens_req *r)
{
	struct mlens_sched_tenant *t = r->t;
	q_remove(&s->waiting, r);
	if (r->wprev)
		r->wprev->wnext = r->wnext;
	else
		t->wait_head = r->wnext;
	if (r->wnext)
		r->wnext->wprev = r->wprev;
	else
		t->wait_tail = r->wprev;
	r->wnext = r->wprev = NULL;
	if (!t->wait_head) {	/* its last: the tenant leaves the list */
		if (t->wt_prev)
			t->wt_prev->wt_next = t->wt_next;
		else
			s->wt_head = t->wt_next;
		if (t->wt_next)
			t->wt_next->wt_prev = t->wt_prev;
		t->wt_next = t->wt_prev = NULL;
	}
}

/* ==== a tenant's live requests by id ==== */

static uint32_t id_bucket(const struct mlens_sched_tenant *t, uint64_t id)
{
	/* splitmix64's finaliser: client ids are often sequential */
	id ^= id >> 30;
	id *= 0xbf58476d1ce4e5b9ull;
	id ^= id >> 27;
	id *= 0x94d049bb133111ebull;
	id ^= id >> 31;
	return (uint32_t)id & (t->n_ids_buckets - 1);
}

/* Add r (the table grows at two entries a bucket). -ENOMEM. */
static int ids_add(struct mlens_sched_tenant *t, struct mlens_req *r)
{
	if (t->n_ids >= 2 * t->n_ids_buckets) {
		uint32_t nb = t->n_ids_buckets ? 2 * t->n_ids_buckets : 64;
		struct mlens_req **old = t->ids, **nt = calloc(nb, sizeof(*nt));
		uint32_t ob = t->n_ids_buckets;
		if (!nt)
			return -ENOMEM;
		t->ids = nt;
		t->n_ids_buckets = nb;
		for (uint32_t b = 0; b < ob; b++)
			for (struct mlens_req *q = old[b], *next; q; q = next) {
				uint32_t k = id_bucket(t, q->id);
				next = q->hnext;
				q->hnext = nt[k];
				nt[k] = q;
			}
		free(old);
	}
	uint32_t k = id_bucket(t, r->id);
	r->hnext = t->ids[k];
	t->ids[k] = r;
	t->n_ids++;
	return 0;
}

static void ids_remove(struct mlens_sched_tenant *t, struct mlens_req *r)
{
	struct mlens_req **pp = &t->ids[id_bucket(t, r->id)];
	while (*pp != r)
		pp = &(*pp)->hnext;
	*pp = r->hnext;
	r->hnext = NULL;
	if (!--t->n_ids) {	/* no live request: no table */
		free(t->ids);
		t->ids = NULL;
		t->n_ids_buckets = 0;
	}
}

/* The tenant's request id that has not finished, or NULL. */
static struct mlens_req *ids_live(const struct mlens_sched_tenant *t, uint64_t id)
{
	if (!t->n_ids)
		return NULL;
	for (struct mlens_req *r = t->ids[id_bucket(t, id)]; r; r = r->hnext)
		if (r->id == id && r->state != REQ_FINISHED)
			return r;
	return NULL;
}

static struct list *state_list(struct mlens_sched *s, struct mlens_req *r)
{
	switch (r->state) {
	case REQ_WAITING: return &s->waiting;
	case REQ_RUNNING: return &s->running;
	default: return &s->finished;
	}
}

/* ==== create ==== */

int mlens_sched_create(struct mlens_sched **out, struct mlens_engine *e,
		       const struct mlens_sched_opts *o)
{
	struct mlens_sched *s = calloc(1, sizeof(*s));
	int max = mlens_engine_max_step_tokens(e);
	if (!s)
		return -ENOMEM;
	s->e = e;
	s->kv = mlens_engine_kv(e);
	s->cap = o && o->token_cap > 0 && o->token_cap < max ? o->token_cap : max;
	s->max_pos = (int)mlens_engine_config(e)->max_position_embeddings;
	s->reserve = o ? o->reserve_blocks : 0;
	s->horizon = o && o->reserve_horizon > 0 ? o->reserve_horizon : MLENS_SCHED_HORIZON_MAX;
	s->keep_room = o && o->admit_keeps_room;
	s->swap = o ? o->swap : NULL;
	if (s->horizon > MLENS_SCHED_HORIZON_MAX)
		s->horizon = MLENS_SCHED_HORIZON_MAX;
	s->admission = true;
	*out = s;
	return 0;
}

/* Free r's slots in the swap file, if it has any. */
static void swap_drop(struct mlens_sched *s, struct mlens_req *r)
{
	if (r->swap_slots)
		mlens_kv_swap_drop(s->swap, r->swap_slots, r->n_swap);
	free(r->swap_slots);
	r->swap_slots = NULL;
	r->n_swap = 0;
}

static void req_free(struct mlens_sched *s, struct mlens_req *r)
{
	struct mlens_sched_tenant *t = r->t;
	if (r->tprev)
		r->tprev->tnext = r->tnext;
	else
		t->reqs = r->tnext;
	if (r->tnext)
		r->tnext->tprev = r->tprev;
	ids_remove(t, r);
	t->kv_blocks -= r->seq.n_blocks;
	swap_drop(s, r);
	mlens_seq_fini(s->kv, &r->seq);
	free(r->tokens);
	free(r);
}

void mlens_sched_destroy(struct mlens_sched *s)
{
	struct list *ls[] = { &s->waiting, &s->running, &s->finished };
	if (!s)
		return;
	for (int i = 0; i < 3; i++)
		while (ls[i]->head) {
			struct mlens_req *r = ls[i]->head;
			if (i == 0)
				wait_remove(s, r);	/* out of its tenant's list too */
			else
				q_remove(ls[i], r);
			req_free(s, r);
		}
	free(s->ereq);
	free(s->sreq);
	free(s->blocks_before);
	free(s);
}

static void quota_set(struct mlens_sched_tenant *t, const struct mlens_quota *q)
{
	t->quota = *q;
	if (!(t->quota.weight > 0.0))
		t->quota.weight = 1.0;
}

void mlens_sched_tenant_init(struct mlens_sched_tenant *t, const struct mlens_quota *q,
			     mlens_emit_fn emit)
{
	memset(t, 0, sizeof(*t));
	quota_set(t, q);
	t->emit = emit;
	t->attached = true;
}

void mlens_sched_set_quota(struct mlens_sched *s, struct mlens_sched_tenant *t,
			   const struct mlens_quota *q)
{
	quota_set(t, q);
	s->quota_check = true;
}

/* KV blocks a request of n_prompt tokens needs by its end: prompt +
 * max_tokens, as many as the model's positions hold. */
static uint32_t blocks_by_end(const struct mlens_sched *s, int32_t n_prompt, int32_t max_tokens)
{
	int64_t total = (int64_t)n_prompt + max_tokens;
	return mlens_kv_blocks_for(s->kv, total < s->max_pos ? total : s->max_pos);
}

/* ==== events ==== */

/* Deliver ev or keep it pending on r. Returns true when delivered. */
static bool emit(struct mlens_req *r, const struct mlens_event *ev)
{
	if (r->t->attached && r->t->emit(r->t, ev) == -EAGAIN) {
		r->pending = *ev;
		r->has_pending = true;
		return false;
	}
	r->has_pending = false;
	return true;
}

static void finish(struct mlens_sched *s, struct mlens_req *r, const struct mlens_event *ev)
{
	if (r->state == REQ_WAITING)
		wait_remove(s, r);
	else
		q_remove(state_list(s, r), r);
	if (r->state == REQ_RUNNING)
		r->t->running--;
	else if (r->state == REQ_WAITING)
		r->t->queued--;
	r->t->kv_blocks -= r->seq.n_blocks;
	mlens_seq_release(s->kv, &r->seq);
	swap_drop(s, r);
	if (ev->finish == MLENS_FINISH_ERROR) {
		r->t->requests_failed++;
		s->st.requests_failed++;
	} else {
		r->t->requests_done++;
		s->st.requests_done++;
		s->st.done_prompt_tokens += (uint64_t)r->n_prompt;
		s->st.done_generated_tokens += (uint64_t)r->n_gen;
	}
	r->state = REQ_FINISHED;
	if (emit(r, ev))
		req_free(s, r);
	else
		q_push_tail(&s->finished, r);
}

static void fail(struct mlens_sched *s, struct mlens_req *r, int status, enum mlens_finish why)
{
	struct mlens_event ev = { .id = r->id, .token = -1, .first = r->n_gen == 0, .last = true,
				  .finish = why, .status = status };
	finish(s, r, &ev);
}

void mlens_sched_flush(struct mlens_sched *s)
{
	struct mlens_req *r, *next;
	for (r = s->running.head; r; r = r->qnext)
		if (r->has_pending)
			emit(r, &r->pending);
	/* evicted while its token waited for room in the ring */
	for (r = s->waiting.head; r; r = r->qnext)
		if (r->has_pending)
			emit(r, &r->pending);
	for (r = s->finished.head; r; r = next) {
		next = r->qnext;
		if (emit(r, &r->pending)) {
			q_remove(&s->finished, r);
			req_free(s, r);
		}
	}
}

/* ==== submit / cancel / remove ==== */

int mlens_sched_submit(struct mlens_sched *s, struct mlens_sched_tenant *t,
		       const struct mlens_request_params *p, char *why, size_t whylen)
{
	const struct mlens_model_config *c = mlens_engine_config(s->e);
	struct mlens_req *r;
	int64_t total;
	uint32_t blocks;

	t->refused = (struct mlens_detail){ 0 };
#define REFUSE(err, ...) do { snprintf(why, whylen, __VA_ARGS__); return (err); } while (0)
#define REFUSE_OVER(err, what_, need_, have_, ...) do { \
		t->refused = (struct mlens_detail){ (what_), (uint32_t)(need_), (uint32_t)(have_) }; \
		REFUSE(err, __VA_ARGS__); \
	} while (0)
	if (!s->admission)
		REFUSE(-ESHUTDOWN, "the daemon is draining and admits no new requests");
	if (p->n_prompt <= 0)
		REFUSE(-EINVAL, "empty prompt");
	if (p->max_tokens <= 0)
		REFUSE(-EINVAL, "max_tokens must be at least 1 (got %d)", p->max_tokens);
	if (p->n_stop < 0 || p->n_stop > MLENS_MAX_STOP)
		REFUSE(-EINVAL, "at most %d stop tokens", MLENS_MAX_STOP);
	for (int i = 0; i < p->n_prompt; i++)
		if (p->prompt[i] < 0 || p->prompt[i] >= c->vocab_size)
			REFUSE(-EINVAL, "prompt token %d at index %d is outside the vocabulary [0, %lld)",
			       p->prompt[i], i, (long long)c->vocab_size);
	if (!isfinite(p->samp.temperature) || p->samp.temperature < 0 ||
	    !isfinite(p->samp.top_p) || p->samp.top_p <= 0 || p->samp.top_p > 1)
		REFUSE(-EINVAL, "bad sampling parameters (temperature >= 0, 0 < top_p <= 1)");
	if (p->n_prompt > s->cap)
		REFUSE_OVER(-E2BIG, MLENS_DETAIL_STEP_CAP, p->n_prompt, s->cap, "prompt of %d tokens exceeds the per-step token cap of %d",
		       p->n_prompt, s->cap);
	if (p->n_prompt >= s->max_pos)
		REFUSE_OVER(-E2BIG, MLENS_DETAIL_CONTEXT, p->n_prompt, s->max_pos, "prompt of %d tokens leaves no room in the context of %d positions",
		       p->n_prompt, s->max_pos);
	total = (int64_t)p->n_prompt + p->max_tokens;
	if (total > s->max_pos)
		total = s->max_pos;
	blocks = blocks_by_end(s, p->n_prompt, p->max_tokens);
	if (blocks > s->kv->cache.n_blocks)
		REFUSE_OVER(-E2BIG, MLENS_DETAIL_KV_POOL, blocks, s->kv->cache.n_blocks, "prompt + max_tokens = %lld tokens need %u KV blocks; the pool has %u",
		       (long long)total, blocks, s->kv->cache.n_blocks);
	if (t->quota.max_kv_blocks && blocks > t->quota.max_kv_blocks)
		REFUSE_OVER(-EDQUOT, MLENS_DETAIL_KV_QUOTA, blocks, t->quota.max_kv_blocks, "prompt + max_tokens need %u KV blocks; the tenant's quota is %u",
		       blocks, t->quota.max_kv_blocks);
	if (t->queued >= t->quota.max_queued)
		REFUSE_OVER(-EDQUOT, MLENS_DETAIL_QUEUED, t->queued + 1, t->quota.max_queued, "the tenant already has %u requests queued (quota %u)",
		       t->queued, t->quota.max_queued);
#undef REFUSE_OVER
#undef REFUSE

	r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	r->cap = p->n_prompt + (p->max_tokens < 64 ? p->max_tokens : 64);
	r->tokens = malloc((size_t)r->cap * sizeof(int32_t));
	if (!r->tokens) {
		free(r);
		return -ENOMEM;
	}
	memcpy(r->tokens, p->prompt, (size_t)p->n_prompt * sizeof(int32_t));
	r->t = t;
	r->id = p->id;
	r->n_prompt = p->n_prompt;
	r->max_tokens = p->max_tokens;
	r->samp = p->samp;
	memcpy(r->stop, p->stop, sizeof(r->stop));
	r->n_stop = p->n_stop;
	r->logprobs = p->logprobs;
	r->ignore_eos = p->ignore_eos;
	r->state = REQ_WAITING;
	r->arrival = now();
	if (ids_add(t, r)) {
		free(r->tokens);
		free(r);
		return -ENOMEM;
	}
	r->tnext = t->reqs;
	if (t->reqs)
		t->reqs->tprev = r;
	t->reqs = r;
	t->queued++;
	wait_push(s, r, false);
	return 0;
}

bool mlens_sched_live(const struct mlens_sched *s, const struct mlens_sched_tenant *t, uint64_t id)
{
	(void)s;
	return ids_live(t, id) != NULL;
}

int mlens_sched_cancel(struct mlens_sched *s, struct mlens_sched_tenant *t, uint64_t id)
{
	struct mlens_req *r = ids_live(t, id);
	if (!r)
		return -ENOENT;
	fail(s, r, -ECANCELED, MLENS_FINISH_CANCELLED);
	return 0;
}

void mlens_sched_tenant_remove(struct mlens_sched *s, struct mlens_sched_tenant *t,
			       int status, bool tenant_gone)
{
	if (tenant_gone)
		t->attached = false;
	while (t->reqs) {
		struct mlens_req *r = t->reqs;
		if (r->state == REQ_FINISHED) {
			/* its last event never got through: drop it */
			q_remove(&s->finished, r);
			req_free(s, r);
		} else {
			fail(s, r, status, status == -ECANCELED ? MLENS_FINISH_CANCELLED : MLENS_FINISH_ERROR);
		}
	}
}

/* ==== the step ==== */

/* Write r's KV to the swap file when the choice says so (the sequence
 * then comes back without a re-prefill); on no room or an error it is
 * left to re-prefill, counted. Its cached tokens are those of its prompt
 * and generated tokens but the last, which the next decode step feeds. */
static void swap_out(struct mlens_sched *s, struct mlens_req *r)
{
	int32_t len = r->seq.len;
	uint32_t n = mlens_kv_blocks_for(s->kv, len);
	int rc;

	if (!s->swap || len <= 0 || len != r->n_prompt + r->n_gen - 1 || n > r->seq.n_blocks)
		return;
	if (!mlens_kv_swap_choose(s->swap, n, len)) {
		mlens_kv_swap_note_recompute(s->swap, false);
		return;
	}
	r->swap_slots = malloc((size_t)n * sizeof(uint32_t));
	rc = r->swap_slots ? mlens_kv_swap_out(s->swap, &s->kv->cache, r->seq.blocks, n, r->swap_slots) : -ENOMEM;
	if (rc) {
		free(r->swap_slots);
		r->swap_slots = NULL;
		mlens_kv_swap_note_recompute(s->swap, rc == -ENOSPC);
		return;
	}
	r->n_swap = n;
	r->swap_len = len;
}

/* Read r's KV back from the swap file into blocks for len tokens, taken
 * with growth room up to final_len: 0 with seq.len set (a decode
 * sequence now); -errno when the blocks cannot be taken (nothing
 * changed, it stays swapped); 1 when the read failed: its slots and
 * blocks are freed and it re-prefills. */
static int swap_in(struct mlens_sched *s, struct mlens_req *r, int64_t len, int64_t final_len)
{
	int rc = mlens_seq_reserve_grow(s->kv, &r->seq, len, final_len);
	if (rc)
		return rc;
	rc = mlens_kv_swap_in(s->swap, &s->kv->cache, r->seq.blocks, r->n_swap, r->swap_slots);
	free(r->swap_slots);
	r->swap_slots = NULL;
	r->n_swap = 0;
	if (rc) {
		mlens_seq_release(s->kv, &r->seq);
		mlens_kv_swap_note_recompute(s->swap, false);
		return 1;
	}
	r->seq.len = r->swap_len;
	return 0;
}

static void evict(struct mlens_sched *s, struct mlens_req *r)
{
	swap_out(s, r);
	q_remove(&s->running, r);
	r->t->running--;
	r->t->kv_blocks -= r->seq.n_blocks;
	mlens_seq_release(s->kv, &r->seq);
	r->state = REQ_WAITING;
	r->preempted = true;
	r->t->queued++;
	r->t->preemptions++;
	s->st.preemptions++;
	if (r->readmit_step && s->step_no - r->readmit_step < READMIT_GRACE)
		s->st.repreemptions++;
	wait_push(s, r, true);
	if (r->t->quota.max_kv_blocks)
		s->quota_check = true;	/* it may have been lowered while it ran */
}

/* Fail the waiting requests that can never fit their tenant's KV quota as
 * it now stands (lowered after they came): they would wait for ever. One
 * whose token still waits for room in its tenant's ring goes once that is
 * delivered. */
static void fail_over_quota(struct mlens_sched *s)
{
	struct mlens_req *r, *next;
	s->quota_check = false;
	for (r = s->waiting.head; r; r = next) {
		uint32_t need = blocks_by_end(s, r->n_prompt, r->max_tokens), have = r->t->quota.max_kv_blocks;
		next = r->qnext;
		if (!have || need <= have)
			continue;
		if (r->has_pending) {
			s->quota_check = true;
			continue;
		}
		struct mlens_event ev = { .id = r->id, .token = -1, .first = r->n_gen == 0, .last = true,
					  .finish = MLENS_FINISH_ERROR, .status = -EDQUOT,
					  .detail = { MLENS_DETAIL_KV_QUOTA, need, have } };
		finish(s, r, &ev);
	}
}

/* Admission (mlens_sched_step): steps a waiting request may be passed
 * over for smaller ones behind it before the step waits for it, and the
 * most requests one step passes over (its cost stays bounded). */
#define MAX_PASSED_OVER 16
#define MAX_PASSES 64

/* The youngest running request, outside its grace if any is. */
static struct mlens_req *youngest(struct mlens_sched *s)
{
	struct mlens_req *best = NULL;
	bool best_grace = true;
	for (struct mlens_req *r = s->running.head; r; r = r->qnext) {
		bool grace = r->readmit_step && s->step_no - r->readmit_step < READMIT_GRACE;
		if (!best || (best_grace && !grace) ||
		    (grace == best_grace && r->admit_serial > best->admit_serial)) {
			best = r;
			best_grace = grace;
		}
	}
	return best;
}

/* A tenant's first waiting request that may go this step, if any. */
static struct mlens_req *tenant_first(const struct mlens_sched *s, const struct mlens_sched_tenant *t,
				      bool preempted_only)
{
	struct mlens_req *r;
	for (r = t->wait_head; r; r = r->wnext) {
		if (preempted_only && !r->preempted)
			continue;
		if (r->has_pending)
			continue;	/* its last token must reach the tenant first */
		if (r->skip_step == s->step_no)
			continue;	/* this step's admission passed it over */
		if (t->quota.max_kv_blocks &&
		    t->kv_blocks + mlens_kv_blocks_for(s->kv, r->n_prompt + r->n_gen) > t->quota.max_kv_blocks)
			continue;
		break;
	}
	return r;
}

/* The waiting request to admit next: one passed over MAX_PASSED_OVER
 * steps first (whatever its tenant's clock: it goes before the step
 * fills); else among tenants under their quotas, the one with the
 * smallest fair-share clock (equal clocks: the one whose request is
 * nearer the queue's head); within it, queue order. Each tenant with
 * waiting requests is asked for its first that may go. */
static struct mlens_req *pick(struct mlens_sched *s, bool preempted_only)
{
	struct mlens_req *best = NULL;
	for (struct mlens_sched_tenant *t = s->wt_head; t; t = t->wt_next) {
		struct mlens_req *r;
		if (t->quota.max_running && t->running >= t->quota.max_running)
			continue;
		r = tenant_first(s, t, preempted_only);
		if (r && r->passed_over >= MAX_PASSED_OVER)
			return r;
	}
	for (struct mlens_sched_tenant *t = s->wt_head; t; t = t->wt_next) {
		struct mlens_req *r;
		/* a tenant at one of its quotas waits; the others go on */
		if (t->quota.max_running && t->running >= t->quota.max_running)
			continue;
		if (best && (t->vtime > best->t->vtime ||
			     (t->vtime == best->t->vtime && t->wait_head->wseq > best->wseq)))
			continue;	/* its first could not win */
		r = tenant_first(s, t, preempted_only);
		if (r && (!best || t->vtime < best->t->vtime ||
			  (t->vtime == best->t->vtime && r->wseq < best->wseq)))
			best = r;
	}
	return best;
}

static bool any_preempted(const struct mlens_sched *s)
{
	for (struct mlens_req *r = s->waiting.head; r; r = r->qnext)
		if (r->preempted)
			return true;
	return false;
}

static int ensure_scratch(struct mlens_sched *s, int n)
{
	if (n <= s->scratch_n)
		return 0;
	struct mlens_engine_req *e = realloc(s->ereq, (size_t)n * sizeof(*e));
	if (!e)
		return -ENOMEM;
	s->ereq = e;
	struct mlens_req **q = realloc(s->sreq, (size_t)n * sizeof(*q));
	if (!q)
		return -ENOMEM;
	s->sreq = q;
	uint32_t *b = realloc(s->blocks_before, (size_t)n * sizeof(*b));
	if (!b)
		return -ENOMEM;
	s->blocks_before = b;
	s->scratch_n = n;
	return 0;
}

static int append_token(struct mlens_req *r, int32_t tok)
{
	int32_t len = r->n_prompt + r->n_gen;
	if (len >= r->cap) {
		int32_t cap = r->cap * 2;
		int32_t *nt = realloc(r->tokens, (size_t)cap * sizeof(int32_t));
		if (!nt)
			return -ENOMEM;
		r->tokens = nt;
		r->cap = cap;
	}
	r->tokens[len] = tok;
	r->n_gen++;
	return 0;
}

/* The admission reserve (sched.h): a sequence that holds len0 tokens of
 * KV after this step and will still generate rem tokens needs, at step h
 * after this one, blocks for len0 + h while h <= rem (the h-th token
 * appended), and none once it has finished (its blocks are freed after its
 * last step): x(h) = its blocks then - the blocks it holds after this
 * step, h = 1..horizon. It goes into d as differences, d[h] += sign
 * (x(h) - x(h-1)): +1 where len0 + h first passes a block (every
 * block_size steps from the first), -blocks(len0 + rem) at rem + 1; so a
 * sequence costs a step a block of growth, not one a step of the horizon.
 * demand_peak sums them. */
static void demand_add(const struct mlens_sched *s, int64_t *d, int32_t len0, int32_t rem,
		       int sign)
{
	const int64_t B = s->kv->cache.block_size, H = s->horizon;
	const int64_t b0 = mlens_kv_blocks_for(s->kv, len0), end = rem < H ? rem : H;
	for (int64_t h = b0 * B + 1 - len0; h <= end; h += B)
		d[h] += sign;
	if ((int64_t)rem + 1 <= H)
		d[rem + 1] -= sign * (int64_t)mlens_kv_blocks_for(s->kv, (int64_t)len0 + rem);
}

/* The largest demand over the horizon (0 when none is positive). */
static int64_t demand_peak(const struct mlens_sched *s, const int64_t *d)
{
	int64_t m = 0, x = 0;
	for (int h = 1; h <= s->horizon; h++) {
		x += d[h];
		if (x > m)
			m = x;
	}
	return m;
}

bool mlens_sched_demand_agree(const struct mlens_sched *s, int32_t len0, int32_t rem)
{
	int64_t d[MLENS_SCHED_HORIZON_MAX + 1] = { 0 }, sum = 0;
	const int64_t b0 = mlens_kv_blocks_for(s->kv, len0);
	demand_add(s, d, len0, rem, +1);
	for (int h = 1; h <= s->horizon; h++) {
		/* the definition, a division a step */
		int64_t x = h <= rem ? (int64_t)mlens_kv_blocks_for(s->kv, (int64_t)len0 + h) - b0 : -b0;
		sum += d[h];
		if (sum != x)
			return false;
	}
	/* and the peak as the admission takes it */
	demand_add(s, d, len0, rem, -1);
	for (int h = 1; h <= s->horizon; h++)
		if (d[h])
			return false;
	return true;
}

/* Tokens r generates after one that it has n_gen generated with: by
 * max_tokens and the model's positions (stop tokens may end it sooner,
 * which only frees blocks sooner). */
static int32_t remaining(const struct mlens_sched *s, const struct mlens_req *r, int32_t n_gen)
{
	int32_t by_max = r->max_tokens - n_gen, by_pos = s->max_pos - (r->n_prompt + n_gen);
	int32_t rem = by_max < by_pos ? by_max : by_pos;
	return rem > 0 ? rem : 0;
}

/* Whether a prefill of want tokens fits the step's token cap beside the
 * tokens already in it. One that has waited MAX_PASSED_OVER steps, or
 * one the step takes because it would otherwise carry under half the cap
 * (force), may also take the place of up to n_dec of the step's decode
 * tokens (they go in the next step, their KV kept): otherwise it would
 * wait for the running batch to drain below cap - want, every step of
 * the drain small while the queue holds work. */
static bool cap_fits(const struct mlens_req *r, int over, int n_dec, bool force)
{
	return over <= 0 || ((force || r->passed_over >= MAX_PASSED_OVER) && over <= n_dec);
}

/* The admission reserve's demand (sign +1) with the step's decode entries
 * [i0, i1) put off a step: counted as they stand, a step later than
 * it had them; sign -1 undoes it. */
static void demand_defer(struct mlens_sched *s, int i0, int i1, int sign)
{
	for (int i = i0; i < i1 && !s->reserve; i++) {
		const struct mlens_req *r = s->sreq[i];
		demand_add(s, s->demand, r->seq.len + 1, remaining(s, r, r->n_gen + 1), -sign);
		demand_add(s, s->demand, r->seq.len, remaining(s, r, r->n_gen), sign);
	}
}

/* Take the last k of the step's n_dec decode entries (its first ones) out
 * of the step (demand_defer counted them); the entries after them move
 * up. */
static void defer_decodes(struct mlens_sched *s, int k, int *n, int *n_dec)
{
	int from = *n_dec, to = *n_dec - k, tail = *n - *n_dec;
	for (int i = to; i < from; i++) {
		/* first in the next step's decodes */
		q_remove(&s->running, s->sreq[i]);
		q_push_head(&s->running, s->sreq[i]);
	}
	memmove(&s->ereq[to], &s->ereq[from], (size_t)tail * sizeof(*s->ereq));
	memmove(&s->sreq[to], &s->sreq[from], (size_t)tail * sizeof(*s->sreq));
	memmove(&s->blocks_before[to], &s->blocks_before[from], (size_t)tail * sizeof(*s->blocks_before));
	*n -= k;
	*n_dec -= k;
	s->st.decodes_deferred += (uint64_t)k;
}

int mlens_sched_step(struct mlens_sched *s)
{
	struct mlens_req *r;
	uint32_t need = 0, free_blocks;
	int n = 0, n_dec, tokens = 0, rc;
	double t0, pre_flops;

	s->step_no++;
	mlens_sched_flush(s);
	if (s->quota_check)
		fail_over_quota(s);
	if (ensure_scratch(s, (int)(s->running.n + s->waiting.n) + 1))
		return -ENOMEM;

	/* decode: every running sequence whose tenant can take its next event */
	for (r = s->running.head; r; r = r->qnext)
		if (!r->has_pending)
			need += mlens_seq_blocks_needed(s->kv, &r->seq, r->seq.len + 1);
	free_blocks = mlens_kv_pool_free_blocks(s->kv);
	if (need > free_blocks) {
		/* preemption mode: evict the youngest until the rest fit */
		while (need > mlens_kv_pool_free_blocks(s->kv) && (r = youngest(s))) {
			if (!r->has_pending)
				need -= mlens_seq_blocks_needed(s->kv, &r->seq, r->seq.len + 1);
			evict(s, r);
		}
	}
	s->preempt_mode = any_preempted(s);
	for (struct mlens_req *next = NULL, *r0 = s->running.head; (r = r0); r0 = next) {
		next = r->qnext;
		if (r->has_pending)
			continue;
		if (tokens >= s->cap) {
			/* more running than the cap (prefills took decodes'
			 * places): the rest go first next step */
			q_remove(&s->running, r);
			q_push_head(&s->running, r);
			s->st.decodes_deferred++;
			continue;
		}
		s->sreq[n] = r;
		s->blocks_before[n] = r->seq.n_blocks;
		s->ereq[n] = (struct mlens_engine_req){
			.seq = &r->seq, .tokens = &r->tokens[r->seq.len], .n_tokens = 1,
			.samp = r->samp,
		};
		s->ereq[n].samp.counter = (uint64_t)r->n_gen;
		n++;
		tokens++;
	}
	n_dec = n;
	free_blocks = mlens_kv_pool_free_blocks(s->kv) - need;
	/* the running sequences' demand over the horizon: the ones in this
	 * step after their token, the ones waiting for their tenant as they
	 * stand (counted as if they went on) */
	if (!s->reserve && s->waiting.n) {
		memset(s->demand, 0, sizeof(s->demand));
		for (r = s->running.head; r; r = r->qnext) {
			if (r->has_pending)
				demand_add(s, s->demand, r->seq.len, remaining(s, r, r->n_gen), +1);
			else
				demand_add(s, s->demand, r->seq.len + 1, remaining(s, r, r->n_gen + 1), +1);
		}
	}

	/* prefill: admit while the token cap, KV blocks (with a reserve for
	 * growth) and quotas allow. In preemption mode only evicted requests
	 * come back (their re-prefill overlaps the others' decode), and only
	 * when their growth to their end fits too (so the next steps do not
	 * evict them again); new ones wait for normal mode. A request that
	 * does not fit is passed over for the ones behind it that do, so the
	 * step stays full while long prompts wait for room (from the first
	 * step, sized by the token cap, to the last prefills of the queue),
	 * until it has been passed over MAX_PASSED_OVER steps: then nothing
	 * behind it goes before it (none starves). Where the token cap is
	 * what holds a request back, it goes in place of some of the step's
	 * decode tokens once it has waited so long, or at once when the step
	 * would otherwise carry under half the cap (cap_fits). */
	{
		uint32_t running_after = s->running.n;
		int passes = 0;
		/* the first request passed over for the cap this step, taken
		 * at the end (force) if the step is still under half the cap */
		struct mlens_req *held = NULL;
		bool force = false;
		for (;;) {
			if (!(r = pick(s, s->preempt_mode)) && held && !force && 2 * tokens < s->cap)
				r = held, force = true;
			if (!r)
				break;
			int32_t len = r->n_prompt + r->n_gen, rem = remaining(s, r, r->n_gen + 1);
			uint32_t blocks = mlens_kv_blocks_for(s->kv, len);
			int64_t reserve, own = 0;
			/* back from the swap file: one decode token, its KV read in */
			bool swapped = r->swap_slots != NULL;
			/* the decode tokens it takes the place of, if any */
			int over = tokens + (swapped ? 1 : len) - s->cap;
			bool fits = cap_fits(r, over, n_dec, force);
			if (!fits && !held)
				held = r;
			if (fits) {
				if (over > 0)
					demand_defer(s, n_dec - over, n_dec, +1);
				if (!s->reserve)
					demand_add(s, s->demand, len, rem, +1);
				reserve = s->reserve ? (int64_t)s->reserve : demand_peak(s, s->demand);
				if (r->preempted)	/* the blocks its growth to its end takes */
					own = (int64_t)mlens_kv_blocks_for(s->kv, (int64_t)len + rem) - blocks;
				fits = (int64_t)blocks + (running_after ? (reserve > own ? reserve : own) : own) <=
					       (int64_t)free_blocks &&
				       !(s->keep_room && blocks > mlens_kv_pool_unroomed_blocks(s->kv));
				if (fits && swapped) {
					int rc2 = swap_in(s, r, len, (int64_t)len + rem);
					if (rc2 < 0)
						fits = false;
					else if (rc2)	/* the read failed: a re-prefill, if the cap allows
							 * without putting off more decodes */
						swapped = false, fits = tokens + len - s->cap <= (over > 0 ? over : 0);
				}
				if (fits && !swapped)
					fits = !mlens_seq_reserve_grow(s->kv, &r->seq, len, (int64_t)len + rem);
				if (!fits && !s->reserve)
					demand_add(s, s->demand, len, rem, -1);
				if (!fits && over > 0)
					demand_defer(s, n_dec - over, n_dec, -1);
			}
			if (!fits) {
				if (force || r->passed_over >= MAX_PASSED_OVER || ++passes > MAX_PASSES)
					break;
				r->passed_over++;
				r->skip_step = s->step_no;
				continue;
			}
			if (over > 0) {
				defer_decodes(s, over, &n, &n_dec);
				tokens -= over;
			}
			r->passed_over = 0;
			if (r->preempted)
				r->readmit_step = s->step_no;
			free_blocks -= blocks;
			r->t->kv_blocks += blocks;
			wait_remove(s, r);
			r->t->queued--;
			r->t->running++;
			r->state = REQ_RUNNING;
			r->admit_serial = ++s->serial;
			r->preempted = false;
			s->vnow = r->t->vtime;
			r->t->vtime += len / r->t->quota.weight;
			q_push_tail(&s->running, r);
			running_after++;
			s->sreq[n] = r;
			s->blocks_before[n] = r->seq.n_blocks;
			s->ereq[n] = (struct mlens_engine_req){
				.seq = &r->seq, .tokens = &r->tokens[r->seq.len], .n_tokens = len - r->seq.len,
				.samp = r->samp,
			};
			s->ereq[n].samp.counter = (uint64_t)r->n_gen;
			if (!swapped) {
				s->st.prompt_tokens += (uint64_t)len;
				r->t->prompt_tokens += (uint64_t)len;
			}
			n++;
			tokens += len - r->seq.len;
			if (s->preempt_mode)
				s->preempt_mode = any_preempted(s);
		}
	}
	if (n == 0)
		return 0;

	/* the FLOPs of the step's prefill parts (a decode feeds one token)
	 * over its seconds: the KV swap's prefill rate as observed (a mixed
	 * step's decodes are charged to it: that rate errs low) */
	pre_flops = 0;
	if (s->swap) {
		struct mlens_kv_swap_rates rates = mlens_kv_swap_get_rates(s->swap);
		for (int i = 0; i < n; i++)
			if (s->ereq[i].n_tokens > 1)
				pre_flops += mlens_kv_swap_prefill_flops(&rates, s->ereq[i].seq->len,
									 (int64_t)s->ereq[i].seq->len + s->ereq[i].n_tokens);
	}
	t0 = now();
	rc = mlens_engine_step(s->e, s->ereq, n);
	s->st.last_step_seconds = now() - t0;
	s->st.step_seconds_sum += s->st.last_step_seconds;
	if (!rc && pre_flops > 0)
		mlens_kv_swap_observe_prefill(s->swap, pre_flops, s->st.last_step_seconds);
	t0 = now();
	s->st.steps++;
	s->st.last_step_tokens = (uint32_t)tokens;
	s->st.last_step_seqs = (uint32_t)n;
	if (s->waiting.n && 2 * (int64_t)tokens < s->cap)
		s->st.steps_short++;
	if (rc) {
		for (int i = 0; i < n; i++) {
			s->sreq[i]->t->kv_blocks += s->sreq[i]->seq.n_blocks - s->blocks_before[i];
			fail(s, s->sreq[i], rc, MLENS_FINISH_ERROR);
		}
		return rc;
	}
	for (int i = 0; i < n; i++) {
		struct mlens_event ev = { 0 };
		int32_t tok = s->ereq[i].next_token;
		r = s->sreq[i];
		/* the engine grew decode sequences by a block where needed */
		r->t->kv_blocks += r->seq.n_blocks - s->blocks_before[i];
		if (append_token(r, tok)) {
			fail(s, r, -ENOMEM, MLENS_FINISH_ERROR);
			continue;
		}
		s->st.generated_tokens++;
		r->t->generated_tokens++;
		ev.id = r->id;
		ev.token = tok;
		ev.logprob = r->logprobs ? s->ereq[i].logprob : 0.0f;
		ev.has_logprob = r->logprobs;
		ev.first = r->n_gen == 1;
		if (ev.first)
			hist_add(&s->st.ttft, t0 - r->arrival);
		else
			hist_add(&s->st.tpot, t0 - r->last_token);
		r->last_token = t0;
		if (mlens_sched_is_stop(mlens_engine_config(s->e), r->stop, r->n_stop, r->ignore_eos, tok))
			ev.finish = MLENS_FINISH_STOP;
		if (!ev.finish && (r->n_gen >= r->max_tokens || r->n_prompt + r->n_gen >= s->max_pos))
			ev.finish = MLENS_FINISH_LENGTH;
		ev.last = ev.finish != MLENS_FINISH_NONE;
		if (ev.last)
			finish(s, r, &ev);
		else
			emit(r, &ev);
	}
	return 1;
}

bool mlens_sched_is_stop(const struct mlens_model_config *c, const int32_t *stop, int n_stop,
			 bool ignore_eos, int32_t token)
{
	for (int k = 0; k < n_stop; k++)
		if (stop[k] == token)
			return true;
	for (int k = 0; !ignore_eos && k < c->n_eos; k++)
		if (c->eos[k] == token)
			return true;
	return false;
}

uint32_t mlens_sched_max_running(const struct mlens_sched *s)
{
	uint32_t cap = (uint32_t)mlens_sched_cap_for(s, 0);

	return cap < s->kv->cache.n_blocks ? cap : s->kv->cache.n_blocks;
}

bool mlens_sched_idle(const struct mlens_sched *s)
{
	return s->running.n == 0 && s->waiting.n == 0 && s->finished.n == 0;
}

void mlens_sched_set_admission(struct mlens_sched *s, bool open)
{
	s->admission = open;
}

bool mlens_sched_admission(const struct mlens_sched *s)
{
	return s->admission;
}

/* The resident sets into st, as much as its arrays hold. */
static void res_stats(const struct mlens_residency *rs, struct mlens_sched_stats *st)
{
	st->residency_routing = rs->routing;
	st->expert_rows = rs->routed_rows;
	st->expert_resident_rows = rs->resident_rows;
	st->expert_swaps = rs->swaps;
	st->res_layers = rs->layers < MLENS_SCHED_RES_LAYERS ? rs->layers : MLENS_SCHED_RES_LAYERS;
	st->res_experts = rs->experts < MLENS_SCHED_RES_EXPERTS ? rs->experts : MLENS_SCHED_RES_EXPERTS;
	memset(st->res_set, 0, sizeof(st->res_set));
	for (int l = 0; l < st->res_layers; l++) {
		st->res_swaps[l] = rs->layer_swaps[l];
		for (int x = 0; x < st->res_experts; x++)
			if (mlens_residency_is_resident(rs, l, x))
				st->res_set[l][x / 64] |= 1ull << (x % 64);
	}
}

void mlens_sched_get_stats(const struct mlens_sched *s, struct mlens_sched_stats *st)
{
	*st = s->st;
	st->running = s->running.n;
	st->waiting = s->waiting.n;
	st->preempt_mode = s->preempt_mode;
	if (s->swap) {
		st->kv_swap = true;
		mlens_kv_swap_get_stats(s->swap, &st->swap);
	}
	if (mlens_engine_op_time(s->e)) {
		st->op_timing = true;
		mlens_op_time_get(mlens_engine_op_time(s->e), &st->ops);
	}
	if (mlens_engine_pipeline(s->e)) {
		const struct mlens_pipeline_stats *ps = mlens_pipeline_stats(mlens_engine_pipeline(s->e));
		st->hybrid = true;
		st->pcie_h2d_bytes = ps->h2d_bytes_total;
		st->pcie_d2h_bytes = ps->d2h_bytes_total;
		st->last_step_weight_bytes = ps->h2d_weight_bytes;
		st->cpu_attn_seconds = ps->cpu_attn_s_total;
		st->cpu_append_seconds = ps->cpu_append_s_total;
		st->host_wait_seconds = ps->host_wait_s_total;
		st->gpu_busy_seconds = ps->gpu_busy_s_total;
		st->h2d_busy_seconds = ps->h2d_busy_s_total;
		st->last_step_gpu_busy_seconds = ps->gpu_busy_s;
		st->last_step_h2d_busy_seconds = ps->h2d_busy_s;
		st->kv_read_bytes = ps->kv_read_bytes_total;
		st->kv_read_blocks = ps->kv_read_blocks_total;
		st->kv_read_runs = ps->kv_read_runs_total;
		res_stats(mlens_pipeline_residency(mlens_engine_pipeline(s->e)), st);
	}
}

int mlens_sched_token_cap(const struct mlens_sched *s)
{
	return s->cap;
}

int mlens_sched_cap_for(const struct mlens_sched *s, int cap)
{
	int max = mlens_engine_max_step_tokens(s->e);
	return cap > 0 && cap < max ? cap : max;
}

void mlens_sched_set_token_cap(struct mlens_sched *s, int cap)
{
	s->cap = mlens_sched_cap_for(s, cap);
}

struct mlens_kv_pool *mlens_sched_kv(struct mlens_sched *s)
{
	return s->kv;
}

struct mlens_engine *mlens_sched_engine(struct mlens_sched *s)
{
	return s->e;
}
