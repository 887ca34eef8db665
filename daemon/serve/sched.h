/* The resource-aware scheduler (DESIGN §1): requests, their sequences and
 * the two modes. Normal: every running decode sequence, then prefills up to
 * the step's token cap while KV blocks allow, keeping a reserve for growth;
 * a prompt that does not fit lets shorter ones behind it fill the step, for
 * a bounded number of steps; one the token cap holds back then goes in
 * place of some decode tokens, which wait a step (so does one a step would
 * otherwise carry under half the cap without). Preemption: when the running sequences' next
 * tokens need more blocks than are free, admit nothing and evict the
 * youngest running sequences (their KV freed, requeued at the head of the
 * queue to re-prefill prompt + generated tokens); one comes back once its
 * growth to its end fits, and is not the first evicted again for a few
 * steps. With a KV swap file (kv_swap.h), an evicted sequence's KV may go
 * to it instead, chosen per sequence; it then comes back as a decode
 * sequence, its KV read into fresh blocks, and a swap that fails in
 * either direction leaves it to re-prefill as without one. Owns the
 * engine. Runs on one thread (the worker). */
#ifndef MLENS_SCHED_H
#define MLENS_SCHED_H

#include <stdbool.h>
#include <stdint.h>
#include "daemon/exec/engine.h"
#include "daemon/exec/kv_swap.h"
#include "daemon/exec/op_time.h"
#include "shm/proto.h"	/* enum mlens_finish, MLENS_MAX_STOP: the protocol's words */

struct mlens_quota {
	uint32_t max_running;	/* running sequences */
	uint32_t max_kv_blocks;	/* KV blocks held by its sequences */
	uint32_t max_queued;	/* requests waiting */
	double weight;		/* share of each step's prefill tokens */
};

/* What a request asks for; tokens are copied by mlens_sched_submit. */
struct mlens_request_params {
	uint64_t id;		/* the tenant's request id */
	const int32_t *prompt;
	int32_t n_prompt;
	int32_t max_tokens;
	struct mlens_sampling samp;	/* counter is ignored */
	int32_t stop[MLENS_MAX_STOP];
	int n_stop;
	bool logprobs;
	bool ignore_eos;	/* the model's EOS ids do not end it (stop[] still does) */
};

/* Which limit a refused or failed request ran into, and its numbers
 * (shm/proto.h's enum mlens_cmpl_detail); what zero is none. */
struct mlens_detail {
	uint8_t what;
	uint32_t need, have;
};

/* One generated token (or the end of a request) for a tenant. */
struct mlens_event {
	uint64_t id;
	int32_t token;		/* -1 when none (errors, cancel) */
	float logprob;
	bool has_logprob;	/* the request asked for log-probabilities */
	bool first, last;
	enum mlens_finish finish;
	int status;		/* 0 or -errno */
	struct mlens_detail detail;	/* with an error */
};

struct mlens_sched;
struct mlens_sched_tenant;

/* Delivers an event to the tenant's completion ring: 0, or -EAGAIN when the
 * ring is full (the request then waits, keeping its KV, until it drains). */
typedef int (*mlens_emit_fn)(struct mlens_sched_tenant *t, const struct mlens_event *ev);

/* The scheduler's view of a tenant; embedded in the daemon's tenant. */
struct mlens_sched_tenant {
	struct mlens_quota quota;
	mlens_emit_fn emit;
	/* accounting, owned by the scheduler */
	uint32_t running;
	uint32_t queued;
	uint32_t kv_blocks;
	uint64_t prompt_tokens;
	uint64_t generated_tokens;
	uint64_t requests_done;
	uint64_t requests_failed;
	uint64_t preemptions;
	double vtime;		/* fair-share clock: admitted tokens / weight */
	bool attached;
	struct mlens_detail refused;	/* mlens_sched_submit's last refusal */
	/* private: the scheduler's */
	struct mlens_req *reqs;	/* every live request of this tenant */
	/* its waiting requests in the waiting queue's order, and its place in
	 * the scheduler's list of tenants that have some (it is there exactly
	 * while wait_head is set; admission looks at each such tenant's
	 * first, not at every waiting request) */
	struct mlens_req *wait_head, *wait_tail;
	struct mlens_sched_tenant *wt_next, *wt_prev;
	/* its live requests by id (chained through the request), while it
	 * has any: a submission's duplicate check and a cancel find theirs
	 * without walking every request of the tenant */
	struct mlens_req **ids;
	uint32_t n_ids_buckets, n_ids;
};

struct mlens_sched_opts {
	int token_cap;		/* tokens per step (n_real); 0 = engine's max */
	/* KV blocks kept free when admitting (beside the blocks the step's
	 * own tokens need); 0 = the demand over a horizon (below) */
	uint32_t reserve_blocks;
	/* The horizon, steps (0 = MLENS_SCHED_HORIZON_MAX, its largest): a
	 * prefill is admitted only if, for each of the next h = 1..horizon
	 * steps, the blocks the running sequences and it then need beyond what
	 * they hold, less what the ones that will have finished by their
	 * max_tokens hold now, fit what is free after it. So the sequences
	 * admitted grow for that long without a preemption (a generation no
	 * longer than it: to its end, even when a pool-full of them starts and
	 * grows together), and a pool whose sequences finish keeps no blocks
	 * idle for growth that the finishing ones free first. (One block per
	 * running sequence, the rule before, is the same guarantee for one
	 * step with nothing credited for finishing.) */
	int reserve_horizon;
	/* Admit a prefill only when the free list outside the running
	 * sequences' growth room (kv_pool.h) holds its blocks: the look-ahead
	 * above may otherwise count room as free, and the admission then
	 * takes other sequences' room, which breaks their tables' runs of
	 * consecutive blocks. Later admissions, whole tables. */
	bool admit_keeps_room;
	/* the KV swap file, or NULL (the caller keeps it alive) */
	struct mlens_kv_swap *swap;
};

#define MLENS_SCHED_HORIZON_MAX 256

#define MLENS_LAT_BUCKETS 16
/* Upper bounds (seconds) of the latency histogram buckets; the last is +Inf. */
extern const double mlens_latency_buckets[MLENS_LAT_BUCKETS];

struct mlens_hist {
	uint64_t bucket[MLENS_LAT_BUCKETS];	/* not cumulative */
	uint64_t count;
	double sum;
};

#define MLENS_SCHED_RES_LAYERS 128
#define MLENS_SCHED_RES_EXPERTS 256
struct mlens_sched_stats {
	struct mlens_hist ttft;		/* submit to first token */
	struct mlens_hist tpot;		/* between two tokens of a request */
	double step_seconds_sum;
	uint64_t steps;
	uint64_t preemptions;
	/* of which evictions of a request soon (a few steps) after it came
	 * back from one: KV thrash, which admission and eviction avoid */
	uint64_t repreemptions;
	/* steps that carried under half the token cap while requests waited
	 * (KV, quotas or the admission rules held them back), and decode
	 * tokens put off a step so that a long-waiting prompt fit the cap */
	uint64_t steps_short;
	uint64_t decodes_deferred;
	uint64_t prompt_tokens;		/* prefill tokens computed, re-prefills included */
	uint64_t generated_tokens;
	uint64_t requests_done;
	uint64_t requests_failed;
	/* prompt and generated tokens of the requests done (not failed): their
	 * mean lengths, whatever is still in flight (workload_follow) */
	uint64_t done_prompt_tokens, done_generated_tokens;
	uint32_t running;
	uint32_t waiting;
	bool preempt_mode;
	uint32_t last_step_tokens;
	uint32_t last_step_seqs;
	double last_step_seconds;
	/* the hybrid pipeline's counters (all 0 when the engine is not hybrid) */
	bool hybrid;
	uint64_t pcie_h2d_bytes, pcie_d2h_bytes;	/* weights + activations, totals */
	uint64_t last_step_weight_bytes;		/* experts streamed in the last step */
	double cpu_attn_seconds;			/* KV append + decode attention, total */
	double cpu_append_seconds;			/* of which the KV append */
	double host_wait_seconds;			/* the driving thread blocked on the GPU */
	double gpu_busy_seconds, h2d_busy_seconds;	/* GPU compute / H2D copy busy, totals */
	double last_step_gpu_busy_seconds, last_step_h2d_busy_seconds;
	uint64_t kv_read_bytes;				/* KV bytes CPU decode attention read, total */
	uint64_t kv_read_blocks, kv_read_runs;		/* its blocks a layer, their runs, totals */
	/* routed rows (tokens x top-k, every MoE layer) and of them those
	 * whose expert was resident, totals; experts swapped into the resident
	 * sets; per layer (the first MLENS_SCHED_RES_LAYERS of res_layers, with
	 * at most MLENS_SCHED_RES_EXPERTS experts) the set as a bitmap and its
	 * swaps */
	bool residency_routing;
	uint64_t expert_rows, expert_resident_rows, expert_swaps;
	int res_layers, res_experts;
	uint64_t res_set[MLENS_SCHED_RES_LAYERS][MLENS_SCHED_RES_EXPERTS / 64];
	uint64_t res_swaps[MLENS_SCHED_RES_LAYERS];
	/* op_timing: the op time account's totals (daemon/exec/op_time.h) */
	bool op_timing;
	struct mlens_op_time_totals ops;
	bool kv_swap;				/* a swap file is open: swap below is kept */
	struct mlens_kv_swap_stats swap;
};

/* Fraction of routed rows whose expert was resident on the GPU (0 before
 * any). */
static inline double mlens_sched_resident_hit_ratio(const struct mlens_sched_stats *st)
{
	return st->expert_rows ? (double)st->expert_resident_rows / (double)st->expert_rows : 0;
}

int mlens_sched_create(struct mlens_sched **out, struct mlens_engine *e,
		       const struct mlens_sched_opts *o);
void mlens_sched_destroy(struct mlens_sched *s);

void mlens_sched_tenant_init(struct mlens_sched_tenant *t, const struct mlens_quota *q,
			     mlens_emit_fn emit);
/* Fail (or silently drop, when the tenant is gone) every request of t and
 * free its KV; t can then be freed. */
void mlens_sched_tenant_remove(struct mlens_sched *s, struct mlens_sched_tenant *t,
			       int status, bool tenant_gone);

/* Queue a request. Errors (the request is refused, nothing queued; the
 * caller reports them): -EINVAL bad parameters or token ids, -E2BIG a
 * prompt the daemon can never run (longer than the step cap or context, or
 * prompt + max_tokens needs more KV blocks than the pool has), -EDQUOT the
 * tenant's queue or KV quota is full, -ESHUTDOWN admission is closed. why
 * gets a sentence for the error completion's log, t->refused which limit
 * with its numbers (what 0 when no limit is to blame). */
int mlens_sched_submit(struct mlens_sched *s, struct mlens_sched_tenant *t,
		       const struct mlens_request_params *p, char *why, size_t whylen);
/* Set t's quota. Its waiting requests (queued, or preempted) that can
 * never fit the new KV quota fail at the next step with -EDQUOT (detail
 * MLENS_DETAIL_KV_QUOTA) rather than wait for ever; running ones go on
 * (a quota limits admission, not growth). */
void mlens_sched_set_quota(struct mlens_sched *s, struct mlens_sched_tenant *t,
			   const struct mlens_quota *q);
/* Is request id of t queued or running (ids must be unique while live)? */
bool mlens_sched_live(const struct mlens_sched *s, const struct mlens_sched_tenant *t, uint64_t id);
/* Cancel the tenant's request id: -ENOENT when unknown. */
int mlens_sched_cancel(struct mlens_sched *s, struct mlens_sched_tenant *t, uint64_t id);

/* Does token end a request (stop ids stop[0..n_stop), EOS ids of c unless
 * ignore_eos)? Then it is the request's last token, finish STOP. */
bool mlens_sched_is_stop(const struct mlens_model_config *c, const int32_t *stop, int n_stop,
			 bool ignore_eos, int32_t token);
/* The most sequences that can ever run at once: each takes a token of the
 * step cap's most and a KV block (what a tenant may usefully keep in
 * flight; any thread may ask). */
uint32_t mlens_sched_max_running(const struct mlens_sched *s);

/* Run one step if there is work: 1 when a step ran, 0 when idle, -errno on
 * an engine failure (the step's requests are failed, the daemon goes on). */
int mlens_sched_step(struct mlens_sched *s);
/* Try again to deliver events held back by full completion rings. */
void mlens_sched_flush(struct mlens_sched *s);
/* For check_sched: whether the admission reserve's demand of one sequence
 * over the horizon (holding len0 tokens after this step, rem more to
 * generate), kept as differences, sums to its definition (a block count a
 * step) and comes out again when taken back. */
bool mlens_sched_demand_agree(const struct mlens_sched *s, int32_t len0, int32_t rem);

bool mlens_sched_idle(const struct mlens_sched *s);
void mlens_sched_set_admission(struct mlens_sched *s, bool open);
bool mlens_sched_admission(const struct mlens_sched *s);
void mlens_sched_get_stats(const struct mlens_sched *s, struct mlens_sched_stats *st);
int mlens_sched_token_cap(const struct mlens_sched *s);
struct mlens_kv_pool *mlens_sched_kv(struct mlens_sched *s);
struct mlens_engine *mlens_sched_engine(struct mlens_sched *s);
void mlens_sched_set_token_cap(struct mlens_sched *s, int cap);
/* The cap that set_token_cap makes of cap (the engine's most when cap is
 * not above 0 or past it); reads only what is fixed at creation, so any
 * thread may ask. */
int mlens_sched_cap_for(const struct mlens_sched *s, int cap);

#endif
