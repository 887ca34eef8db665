/* Description: the scheduler over a real engine (CPU backend, random tiny
 * model) with in-process tenants: every request completes with the tokens
 * a lone run gives, under preemption too; quotas, fair share, cancel,
 * a full completion ring, tenant removal and refusals; the worker thread
 * publishes what a command changed before its caller returns; admissions
 * that keep the growth room leave every table whole; through a KV swap
 * file, preempted sequences come back without a re-prefill, same tokens,
 * and their slots come free with them. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include "daemon/serve/sched.h"
#include "daemon/serve/worker.h"
#include "tests/testmodel.h"

#define MAXEV 4096

struct tenant {
	struct mlens_sched_tenant st;	/* first: the emit callback casts back */
	struct mlens_event ev[MAXEV];
	int n_ev;
	int room;		/* events it accepts before "ring full"; <0 = unlimited */
};

static int tenant_emit(struct mlens_sched_tenant *t, const struct mlens_event *ev)
{
	struct tenant *x = (struct tenant *)t;
	if (x->room == 0)
		return -EAGAIN;
	if (x->room > 0)
		x->room--;
	ck_assert_int_lt(x->n_ev, MAXEV);
	x->ev[x->n_ev++] = *ev;
	return 0;
}

struct fx {
	struct mlens_model *m;
	struct mlens_backend be;
	struct mlens_engine *e;
	struct mlens_sched *s;
	struct mlens_kv_swap *swap;
};

/* Set: the next fixture's scheduler gets a KV swap file of this many
 * bytes in /tmp, policy always. */
static uint64_t fx_swap_bytes;

/* horizon: the admission reserve's look-ahead (0: the scheduler's); the
 * model's EOS ids eos[0..n_eos) */
static void fx_open_eos(struct fx *f, uint32_t kv_blocks, int cap, int horizon, bool keep_room,
			const int32_t *eos, int n_eos)
{
	struct mlens_test_spec sp = mlens_test_spec_tiny();
	struct mlens_engine_opts eo = { .kv_block_size = 4, .kv_blocks = kv_blocks, .kv_dtype = -1,
					.max_step_tokens = 256, .prefill_attn = MLENS_PREFILL_AUTO };
	struct mlens_sched_opts so = { .token_cap = cap, .reserve_horizon = horizon,
				       .admit_keeps_room = keep_room };
	char err[256];
	f->m = mlens_test_model_new(&sp);
	ck_assert_int_le(n_eos, MLENS_MODEL_MAX_EOS);
	if (n_eos)	/* memcpy's source may not be NULL, even for 0 bytes */
		memcpy(f->m->cfg.eos, eos, (size_t)n_eos * sizeof(*eos));
	f->m->cfg.n_eos = n_eos;
	ck_assert_int_eq(mlens_backend_cpu_create(&f->be, NULL), 0);
	ck_assert_msg(mlens_engine_create(&f->e, f->m, &f->be, &eo, err, sizeof(err)) == 0, "%s", err);
	f->swap = NULL;
	if (fx_swap_bytes) {
		struct mlens_kv_swap_opts wo = { .budget = fx_swap_bytes, .path = "/tmp",
						 .policy = MLENS_KV_SWAP_ALWAYS };
		ck_assert_msg(mlens_kv_swap_create(&f->swap, &mlens_engine_kv(f->e)->cache, &wo, err, sizeof(err)) == 0,
			      "%s", err);
		so.swap = f->swap;
	}
	ck_assert_int_eq(mlens_sched_create(&f->s, f->e, &so), 0);
}

static void fx_open_o(struct fx *f, uint32_t kv_blocks, int cap, int horizon, bool keep_room)
{
	fx_open_eos(f, kv_blocks, cap, horizon, keep_room, NULL, 0);
}

static void fx_open_h(struct fx *f, uint32_t kv_blocks, int cap, int horizon)
{
	fx_open_o(f, kv_blocks, cap, horizon, false);
}

static void fx_open(struct fx *f, uint32_t kv_blocks, int cap)
{
	fx_open_h(f, kv_blocks, cap, 0);
}

static void fx_close(struct fx *f)
{
	mlens_sched_destroy(f->s);
	mlens_kv_swap_destroy(f->swap);
	mlens_engine_destroy(f->e);
	mlens_backend_destroy(&f->be);
	mlens_test_model_free(f->m);
}

static struct mlens_quota q_default(void)
{
	struct mlens_quota q = { 0, 0, 1000, 1.0 };
	return q;
}

static void tenant_init(struct tenant *t, struct mlens_quota q)
{
	memset(t, 0, sizeof(*t));
	t->room = -1;
	mlens_sched_tenant_init(&t->st, &q, tenant_emit);
}

static struct mlens_request_params params(uint64_t id, const int32_t *p, int n, int max_tokens)
{
	struct mlens_request_params rp;
	memset(&rp, 0, sizeof(rp));
	rp.id = id;
	rp.prompt = p;
	rp.n_prompt = n;
	rp.max_tokens = max_tokens;
	rp.samp.top_p = 1.0f;
	return rp;
}

static void submit_ok(struct fx *f, struct tenant *t, const struct mlens_request_params *rp)
{
	char why[256] = "";
	int rc = mlens_sched_submit(f->s, &t->st, rp, why, sizeof(why));
	ck_assert_msg(rc == 0, "submit: %d %s", rc, why);
}

static int run_until_idle(struct fx *f, int max_steps)
{
	int steps = 0, rc;
	while (!mlens_sched_idle(f->s) && steps < max_steps) {
		rc = mlens_sched_step(f->s);
		ck_assert_int_ge(rc, 0);
		if (rc == 0)
			break;
		steps++;
	}
	return steps;
}

/* Tokens tenant t received for request id, in order; returns count. */
static int tokens_of(const struct tenant *t, uint64_t id, int32_t *out, enum mlens_finish *fin)
{
	int n = 0;
	for (int i = 0; i < t->n_ev; i++)
		if (t->ev[i].id == id) {
			if (t->ev[i].token >= 0)
				out[n++] = t->ev[i].token;
			if (t->ev[i].last && fin)
				*fin = t->ev[i].finish;
		}
	return n;
}

static void prompt(int32_t *t, int n, unsigned seed)
{
	for (int i = 0; i < n; i++)
		t[i] = (int32_t)((seed * 2654435761u + (unsigned)i * 40503u) % 97u);
}

/* Submit requests 0..n-1 of len prompt tokens (prompt seed seed0 + i) and
 * max_tokens each. */
static void submit_n(struct fx *f, struct tenant *t, int n, int len, int max_tokens, unsigned seed0)
{
	int32_t p[64];
	ck_assert_int_le(len, 64);
	for (int i = 0; i < n; i++) {
		struct mlens_request_params rp;
		prompt(p, len, seed0 + (unsigned)i);
		rp = params((uint64_t)i, p, len, max_tokens);
		submit_ok(f, t, &rp);
	}
}

/* Reference: each request alone in a roomy scheduler. */
static void reference(int nreq, const int *lens, int g, int32_t ref[][64], struct mlens_sampling *samp)
{
	for (int i = 0; i < nreq; i++) {
		struct fx f;
		struct tenant t;
		int32_t p[64];
		struct mlens_request_params rp;
		fx_open(&f, 512, 0);
		tenant_init(&t, q_default());
		prompt(p, lens[i], (unsigned)i + 1);
		rp = params((uint64_t)i, p, lens[i], g);
		if (samp)
			rp.samp = samp[i];
		submit_ok(&f, &t, &rp);
		run_until_idle(&f, 1000);
		ck_assert_int_eq(tokens_of(&t, (uint64_t)i, ref[i], NULL), g);
		fx_close(&f);
	}
}

static int finished_of(const struct tenant *t)
{
	int n = 0;
	for (int i = 0; i < t->n_ev; i++)
		n += t->ev[i].last;
	return n;
}

/* Steady churn through the real scheduler: 3 tenants keep 30 requests
 * each outstanding, prompts of 32 tokens (8 blocks of 4) that generate 8
 * (10 blocks at the end, 2 of them room), in a pool of 300 blocks where
 * the step's token cap admits the finished ones' successors in waves.
 * Steps to the end in *steps; returns the room blocks admissions took. */
static uint64_t churn_room_taken(bool keep_room, int *steps, int32_t first[3][8])
{
	enum { NT = 3, PER = 150, P = 32, G = 8, WINDOW = 30 };
	struct fx f;
	struct tenant *t = calloc(NT, sizeof(*t));
	struct mlens_sched_stats st;
	int sent[NT] = { 0 };
	uint64_t taken;

	ck_assert_ptr_nonnull(t);
	*steps = 0;
	fx_open_o(&f, 300, 0, 0, keep_room);
	for (int i = 0; i < NT; i++)
		tenant_init(&t[i], q_default());
	for (;;) {
		bool more = false;
		for (int i = 0; i < NT; i++) {
			while (sent[i] < PER && sent[i] - finished_of(&t[i]) < WINDOW) {
				int32_t p[P];
				struct mlens_request_params rp;
				prompt(p, P, (unsigned)(i * 1000 + sent[i]));
				rp = params((uint64_t)sent[i], p, P, G);
				submit_ok(&f, &t[i], &rp);
				sent[i]++;
			}
			more |= sent[i] < PER;
		}
		if (mlens_sched_idle(f.s) && !more)
			break;
		ck_assert_int_ge(mlens_sched_step(f.s), 0);
		ck_assert_int_lt(++*steps, 5000);
	}
	mlens_sched_get_stats(f.s, &st);
	ck_assert_uint_eq(st.requests_done, NT * PER);
	ck_assert_uint_eq(st.preemptions, 0);
	for (int i = 0; i < NT; i++)
		ck_assert_int_eq(tokens_of(&t[i], 0, first[i], NULL), G);
	taken = mlens_sched_kv(f.s)->room_taken;
	ck_assert_uint_eq(mlens_kv_pool_used_blocks(mlens_sched_kv(f.s)), 0);
	fx_close(&f);
	free(t);
	return taken;
}

START_TEST(admissions_keep_room)
{
	int32_t a[3][8], b[3][8];
	int steps_lent, steps_kept;
	uint64_t lent = churn_room_taken(false, &steps_lent, a);
	uint64_t kept = churn_room_taken(true, &steps_kept, b);
	/* the look-ahead counts room as free: admissions take some */
	ck_assert_msg(lent > 0, "no room taken without admit_keeps_room");
	/* kept: none, the same tokens, a few steps more at most */
	ck_assert_msg(kept == 0, "%llu room blocks taken with admit_keeps_room",
		      (unsigned long long)kept);
	ck_assert_int_eq(memcmp(a, b, sizeof(a)), 0);
	ck_assert_int_le(steps_kept, steps_lent + steps_lent / 10);
}
END_TEST

/* 12 requests, a pool of 40 blocks of 4 tokens: they cannot all grow to
 * prompt + 24 tokens at once, and the admission looks one step ahead
 * only, so the scheduler must preempt; with swap_bytes, to a KV swap file
 * (policy always) of that size. Tokens equal lone runs' (greedy and
 * seeded sampling alike). */
static void preempt_run(uint64_t swap_bytes, struct mlens_sched_stats *st_out, size_t *slot_bytes)
{
	enum { N = 12, G = 24 };
	int lens[N];
	int32_t ref[N][64], got[64];
	struct mlens_sampling samp[N];
	struct fx f;
	struct tenant t;
	struct mlens_sched_stats st;

	for (int i = 0; i < N; i++) {
		lens[i] = 3 + (i * 5) % 11;
		samp[i] = (struct mlens_sampling){ i % 2 ? 0.8f : 0.0f, 0, 1.0f, (uint64_t)i * 7 + 1, 0 };
	}
	reference(N, lens, G, ref, samp);

	fx_swap_bytes = swap_bytes;
	fx_open_h(&f, 40, 0, 1);
	fx_swap_bytes = 0;
	tenant_init(&t, q_default());
	for (int i = 0; i < N; i++) {
		int32_t p[64];
		struct mlens_request_params rp;
		prompt(p, lens[i], (unsigned)i + 1);
		rp = params((uint64_t)i, p, lens[i], G);
		rp.samp = samp[i];
		submit_ok(&f, &t, &rp);
	}
	run_until_idle(&f, 10000);
	ck_assert(mlens_sched_idle(f.s));
	mlens_sched_get_stats(f.s, &st);
	ck_assert_uint_gt(st.preemptions, 0);
	ck_assert_uint_eq(st.requests_done, N);
	for (int i = 0; i < N; i++) {
		enum mlens_finish fin = MLENS_FINISH_NONE;
		ck_assert_int_eq(tokens_of(&t, (uint64_t)i, got, &fin), G);
		ck_assert_int_eq(fin, MLENS_FINISH_LENGTH);
		for (int j = 0; j < G; j++)
			ck_assert_msg(got[j] == ref[i][j], "request %d token %d: %d != %d", i, j, got[j], ref[i][j]);
	}
	ck_assert_uint_eq(mlens_kv_pool_used_blocks(mlens_engine_kv(f.e)), 0);
	ck_assert_uint_eq(t.st.kv_blocks, 0);
	*st_out = st;
	if (slot_bytes)
		*slot_bytes = f.swap ? mlens_kv_swap_slot_bytes(f.swap) : 0;
	fx_close(&f);
}

START_TEST(preemption_keeps_tokens)
{
	struct mlens_sched_stats st;
	preempt_run(0, &st, NULL);
	ck_assert(!st.kv_swap);
}
END_TEST

/* The same through a KV swap file: every preempted sequence comes back
 * from it, its KV read in, and is not prefilled again (the prefill
 * tokens are the prompts' alone); every slot free at the end. A file of
 * 3 blocks holds fewer than some victims need: those re-prefill, counted
 * as full, with the same tokens. */
START_TEST(preemption_swap_keeps_tokens)
{
	struct mlens_sched_stats st;
	uint64_t prompts = 0;
	size_t slot = 0;

	for (int i = 0; i < 12; i++)
		prompts += (uint64_t)(3 + (i * 5) % 11);
	preempt_run(1 << 20, &st, &slot);
	ck_assert(st.kv_swap);
	ck_assert_uint_gt(st.swap.swaps, 0);
	ck_assert_uint_eq(st.swap.swaps, st.preemptions);
	ck_assert_uint_eq(st.swap.swap_ins, st.swap.swaps);
	ck_assert_uint_eq(st.swap.recomputes, 0);
	ck_assert_uint_eq(st.swap.bytes_in, st.swap.bytes_out);
	ck_assert_uint_eq(st.swap.slots_used, 0);
	ck_assert_uint_eq(st.prompt_tokens, prompts);
	preempt_run(3 * slot, &st, NULL);
	ck_assert_uint_gt(st.swap.full, 0);
	ck_assert_uint_eq(st.swap.slots_used, 0);
	ck_assert_uint_gt(st.prompt_tokens, prompts);
}
END_TEST

/* A tenant removed while its preempted sequences sit in the swap file:
 * their slots come free with them. */
START_TEST(swapped_requests_removed)
{
	struct fx f;
	struct tenant t;
	struct mlens_sched_stats st;
	int steps = 0;

	fx_swap_bytes = 1 << 20;
	fx_open_h(&f, 40, 0, 1);
	fx_swap_bytes = 0;
	tenant_init(&t, q_default());
	submit_n(&f, &t, 12, 10, 24, 1);
	do {
		ck_assert_int_ge(mlens_sched_step(f.s), 0);
		mlens_sched_get_stats(f.s, &st);
	} while (st.swap.slots_used == 0 && ++steps < 1000);
	ck_assert_uint_gt(st.swap.slots_used, 0);
	mlens_sched_tenant_remove(f.s, &t.st, -ECANCELED, true);
	mlens_sched_get_stats(f.s, &st);
	ck_assert_uint_eq(st.swap.slots_used, 0);
	ck_assert_uint_eq(mlens_kv_pool_used_blocks(mlens_engine_kv(f.e)), 0);
	ck_assert(mlens_sched_idle(f.s));
	fx_close(&f);
}
END_TEST

/* Admission looks ahead (sched.h, reserve_horizon): sequences that finish
 * now leave their blocks to the next ones, growing ones keep room for
 * their growth. A pool of 10 blocks of 4 tokens. */
START_TEST(admission_reserve_horizon)
{
	struct fx f;
	struct tenant t;
	struct mlens_sched_stats st;

	/* 10 requests of one block that end with the token of their prefill:
	 * the reserve credits their blocks, so all run in one step (one block
	 * kept per running sequence would have let 5 in) */
	fx_open(&f, 10, 0);
	tenant_init(&t, q_default());
	submit_n(&f, &t, 10, 3, 1, 1);
	ck_assert_int_eq(mlens_sched_step(f.s), 1);
	mlens_sched_get_stats(f.s, &st);
	ck_assert_uint_eq(st.last_step_seqs, 10);
	ck_assert_uint_eq(st.requests_done, 10);
	ck_assert_uint_eq(mlens_kv_pool_used_blocks(mlens_engine_kv(f.e)), 0);
	fx_close(&f);

	/* 10 requests of a full block that go on for 3 more tokens: each needs
	 * a second block at its next step, so 5 are admitted (5 + 5 grown),
	 * the rest as blocks come free, and none is ever preempted */
	fx_open(&f, 10, 0);
	tenant_init(&t, q_default());
	submit_n(&f, &t, 10, 4, 4, 1);
	ck_assert_int_eq(mlens_sched_step(f.s), 1);
	mlens_sched_get_stats(f.s, &st);
	ck_assert_uint_eq(st.last_step_seqs, 5);
	ck_assert_uint_eq(st.running, 5);
	ck_assert_uint_eq(st.waiting, 5);
	run_until_idle(&f, 1000);
	mlens_sched_get_stats(f.s, &st);
	ck_assert_uint_eq(st.requests_done, 10);
	ck_assert_uint_eq(st.preemptions, 0);
	/* what workload_follow reads: the lengths of the requests done */
	ck_assert_uint_eq(st.done_prompt_tokens, 10 * 4);
	ck_assert_uint_eq(st.done_generated_tokens, 10 * 4);
	for (int i = 0; i < 10; i++) {
		int32_t got[64];
		enum mlens_finish fin = MLENS_FINISH_NONE;
		ck_assert_int_eq(tokens_of(&t, (uint64_t)i, got, &fin), 4);
		ck_assert_int_eq(fin, MLENS_FINISH_LENGTH);
	}
	fx_close(&f);

	/* a pool-full that starts together and grows together past many
	 * blocks (the ramp of a benchmark, a burst of arrivals): 10 prompts
	 * of one block that grow to four (12 tokens more) in a pool of 30.
	 * The reserve looks far enough ahead to see the growth to the end, so
	 * 7 are admitted (1 + 3 blocks each over their life: 28; the others
	 * as the first ones near their end) and none is preempted; a
	 * look-ahead of a block's steps (4) saw two blocks each, let all 10
	 * in, and preempted when they grew past the pool. */
	fx_open(&f, 30, 0);
	tenant_init(&t, q_default());
	submit_n(&f, &t, 10, 4, 12, 1);
	ck_assert_int_eq(mlens_sched_step(f.s), 1);
	mlens_sched_get_stats(f.s, &st);
	ck_assert_uint_eq(st.last_step_seqs, 7);
	run_until_idle(&f, 1000);
	ck_assert(mlens_sched_idle(f.s));
	mlens_sched_get_stats(f.s, &st);
	ck_assert_uint_eq(st.requests_done, 10);
	ck_assert_uint_eq(st.preemptions, 0);
	fx_close(&f);
}
END_TEST

/* The reserve's demand of one sequence (sched.h), kept as differences,
 * against its definition, over lengths around block edges and generations
 * shorter and longer than the horizon (the default, 256 steps, and 37, no
 * multiple of the fixture's block of 4). */
START_TEST(reserve_demand_forms_agree)
{
	struct fx f;
	fx_open(&f, 64, 0);
	for (int32_t len0 = 0; len0 <= 70; len0++)
		for (int32_t rem = 0; rem <= MLENS_SCHED_HORIZON_MAX + 40; rem += rem < 40 ? 1 : 7)
			ck_assert_msg(mlens_sched_demand_agree(f.s, len0, rem), "len0 %d rem %d", len0, rem);
	fx_close(&f);
	fx_open_h(&f, 64, 0, 37);	/* a horizon that is no multiple of the block */
	for (int32_t len0 = 0; len0 <= 70; len0++)
		for (int32_t rem = 0; rem <= 80; rem++)
			ck_assert_msg(mlens_sched_demand_agree(f.s, len0, rem), "h 37: len0 %d rem %d", len0,
				      rem);
	fx_close(&f);
}
END_TEST

START_TEST(token_cap_respected)
{
	struct fx f;
	struct tenant t;
	struct mlens_sched_stats st;
	int32_t p[64];
	fx_open(&f, 512, 20);
	tenant_init(&t, q_default());
	submit_n(&f, &t, 10, 7, 5, 0);
	while (!mlens_sched_idle(f.s)) {
		ck_assert_int_eq(mlens_sched_step(f.s), 1);
		mlens_sched_get_stats(f.s, &st);
		ck_assert_uint_le(st.last_step_tokens, 20);
	}
	/* a prompt longer than the cap can never run: refused at submit */
	{
		char why[200];
		struct mlens_request_params rp;
		prompt(p, 21, 99);
		rp = params(99, p, 21, 5);
		ck_assert_int_eq(mlens_sched_submit(f.s, &t.st, &rp, why, sizeof(why)), -E2BIG);
		ck_assert_ptr_nonnull(strstr(why, "token cap"));
	}
	fx_close(&f);
}
END_TEST

START_TEST(refusals)
{
	struct fx f;
	struct tenant t;
	int32_t p[600];
	char why[200];
	struct mlens_request_params rp;
	struct mlens_quota q = q_default();
	q.max_queued = 2;
	fx_open(&f, 16, 0);
	tenant_init(&t, q);
	prompt(p, 600, 1);
	rp = params(1, p, 5, 0);
	ck_assert_int_eq(mlens_sched_submit(f.s, &t.st, &rp, why, sizeof(why)), -EINVAL);
	rp = params(1, p, 0, 5);
	ck_assert_int_eq(mlens_sched_submit(f.s, &t.st, &rp, why, sizeof(why)), -EINVAL);
	p[2] = 97;
	rp = params(1, p, 5, 5);
	ck_assert_int_eq(mlens_sched_submit(f.s, &t.st, &rp, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "vocabulary"));
	p[2] = 3;
	rp = params(1, p, 5, 100);	/* 105 tokens = 27 blocks > 16 */
	ck_assert_int_eq(mlens_sched_submit(f.s, &t.st, &rp, why, sizeof(why)), -E2BIG);
	ck_assert_ptr_nonnull(strstr(why, "KV blocks"));
	rp = params(1, p, 5, 5);
	rp.samp.top_p = 0.0f;
	ck_assert_int_eq(mlens_sched_submit(f.s, &t.st, &rp, why, sizeof(why)), -EINVAL);
	rp = params(1, p, 5, 5);
	submit_ok(&f, &t, &rp);
	rp.id = 2;
	submit_ok(&f, &t, &rp);
	rp.id = 3;
	ck_assert_int_eq(mlens_sched_submit(f.s, &t.st, &rp, why, sizeof(why)), -EDQUOT);
	mlens_sched_set_admission(f.s, false);
	ck_assert_int_eq(mlens_sched_submit(f.s, &t.st, &rp, why, sizeof(why)), -ESHUTDOWN);
	/* what was queued before the drain still runs */
	run_until_idle(&f, 100);
	ck_assert_uint_eq(t.st.requests_done, 2);
	fx_close(&f);
}
END_TEST

START_TEST(full_ring_stalls_only_its_tenant)
{
	struct fx f;
	struct tenant a, b;
	int32_t p[16], got[64], ref[2][64];
	int lens[2] = { 6, 6 };
	reference(2, lens, 10, ref, NULL);
	fx_open(&f, 512, 0);
	tenant_init(&a, q_default());
	tenant_init(&b, q_default());
	a.room = 3;	/* a reads three events, then stops reading */
	prompt(p, 6, 1);
	struct mlens_request_params rp = params(0, p, 6, 10);
	submit_ok(&f, &a, &rp);
	prompt(p, 6, 2);
	rp = params(1, p, 6, 10);
	submit_ok(&f, &b, &rp);
	for (int i = 0; i < 30; i++)
		mlens_sched_step(f.s);
	ck_assert_int_eq(tokens_of(&b, 1, got, NULL), 10);	/* b finished */
	ck_assert_int_eq(tokens_of(&a, 0, got, NULL), 3);	/* a stalled */
	ck_assert_uint_eq(a.st.running, 1);			/* holding its KV */
	ck_assert_uint_gt(a.st.kv_blocks, 0);
	a.room = -1;	/* a drains its ring */
	run_until_idle(&f, 100);
	ck_assert_int_eq(tokens_of(&a, 0, got, NULL), 10);
	for (int j = 0; j < 10; j++)
		ck_assert_int_eq(got[j], ref[0][j]);
	fx_close(&f);
}
END_TEST

START_TEST(tenant_removal_frees_kv)
{
	struct fx f;
	struct tenant a, b;
	int32_t p[16], got[64];
	fx_open(&f, 512, 0);
	tenant_init(&a, q_default());
	tenant_init(&b, q_default());
	prompt(p, 9, 3);
	for (int i = 0; i < 4; i++) {
		struct mlens_request_params rp = params((uint64_t)i, p, 9, 50);
		submit_ok(&f, &a, &rp);
	}
	struct mlens_request_params rp = params(7, p, 9, 8);
	submit_ok(&f, &b, &rp);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(mlens_sched_step(f.s), 1);
	ck_assert_uint_gt(a.st.kv_blocks, 0);
	mlens_sched_tenant_remove(f.s, &a.st, -EPIPE, true);
	ck_assert_uint_eq(a.st.kv_blocks, 0);
	ck_assert_uint_eq(a.st.running, 0);
	ck_assert_ptr_null(a.st.reqs);
	ck_assert_uint_eq(mlens_kv_pool_used_blocks(mlens_engine_kv(f.e)), b.st.kv_blocks);
	run_until_idle(&f, 100);
	ck_assert_int_eq(tokens_of(&b, 7, got, NULL), 8);
	ck_assert_uint_eq(mlens_kv_pool_used_blocks(mlens_engine_kv(f.e)), 0);
	fx_close(&f);
}
END_TEST

START_TEST(cancel_and_stop_tokens)
{
	struct fx f;
	struct tenant a;
	int32_t p[16], got[64], ref[1][64];
	int lens[1] = { 5 };
	enum mlens_finish fin = MLENS_FINISH_NONE;
	reference(1, lens, 12, ref, NULL);
	fx_open(&f, 512, 0);
	tenant_init(&a, q_default());
	prompt(p, 5, 1);
	struct mlens_request_params rp = params(0, p, 5, 12);
	rp.stop[0] = ref[0][4];	/* the 5th generated token stops it */
	rp.n_stop = 1;
	submit_ok(&f, &a, &rp);
	rp = params(1, p, 5, 40);
	submit_ok(&f, &a, &rp);
	run_until_idle(&f, 2);
	ck_assert_int_eq(mlens_sched_cancel(f.s, &a.st, 1), 0);
	ck_assert_int_eq(mlens_sched_cancel(f.s, &a.st, 1), -ENOENT);
	ck_assert_int_eq(tokens_of(&a, 1, got, &fin), 2);
	ck_assert_int_eq(fin, MLENS_FINISH_CANCELLED);
	run_until_idle(&f, 100);
	int n = tokens_of(&a, 0, got, &fin);
	int first = 0;
	while (ref[0][first] != ref[0][4])
		first++;	/* the stop token may occur earlier */
	ck_assert_int_eq(n, first + 1);
	ck_assert_int_eq(fin, MLENS_FINISH_STOP);
	fx_close(&f);
}
END_TEST

/* The model's EOS ids end a request like a stop token (the EOS token
 * delivered last, finish STOP) unless it asks to ignore them; its own stop
 * tokens end it either way. */
START_TEST(eos_ends_unless_ignored)
{
	struct mlens_model_config c = { .eos = { 7, 9 }, .n_eos = 2 };
	const int32_t stop[1] = { 8 };
	struct fx f;
	struct tenant a;
	int32_t p[16], got[64], ref[1][64], eos;
	int lens[1] = { 5 }, k = 2;
	enum mlens_finish fin = MLENS_FINISH_NONE;

	ck_assert(mlens_sched_is_stop(&c, NULL, 0, false, 7));
	ck_assert(mlens_sched_is_stop(&c, NULL, 0, false, 9));
	ck_assert(!mlens_sched_is_stop(&c, NULL, 0, false, 8));
	ck_assert(!mlens_sched_is_stop(&c, NULL, 0, true, 7));
	ck_assert(mlens_sched_is_stop(&c, stop, 1, true, 8));
	ck_assert(mlens_sched_is_stop(&c, stop, 1, false, 9));

	/* EOS: the first generated token from the 3rd on not seen before it */
	reference(1, lens, 16, ref, NULL);
	for (;; k++) {
		int seen = 0;
		ck_assert_int_lt(k, 16);
		for (int i = 0; i < k; i++)
			seen |= ref[0][i] == ref[0][k];
		if (!seen)
			break;
	}
	eos = ref[0][k];
	fx_open_eos(&f, 512, 0, 0, false, &eos, 1);
	tenant_init(&a, q_default());
	prompt(p, 5, 1);
	struct mlens_request_params rp = params(0, p, 5, 16);
	submit_ok(&f, &a, &rp);
	rp = params(1, p, 5, 16);
	rp.ignore_eos = true;
	submit_ok(&f, &a, &rp);
	run_until_idle(&f, 100);
	ck_assert_int_eq(tokens_of(&a, 0, got, &fin), k + 1);
	ck_assert_int_eq(memcmp(got, ref[0], (size_t)(k + 1) * sizeof(*got)), 0);
	ck_assert_int_eq(got[k], eos);
	ck_assert_int_eq(fin, MLENS_FINISH_STOP);
	ck_assert_int_eq(tokens_of(&a, 1, got, &fin), 16);
	ck_assert_int_eq(memcmp(got, ref[0], 16 * sizeof(*got)), 0);
	ck_assert_int_eq(fin, MLENS_FINISH_LENGTH);
	fx_close(&f);
}
END_TEST

START_TEST(running_quota)
{
	struct fx f;
	struct tenant a, b;
	struct mlens_quota qa = q_default();
	int32_t p[16];
	qa.max_running = 1;	/* a: one sequence at a time */
	fx_open(&f, 512, 0);
	tenant_init(&a, qa);
	tenant_init(&b, q_default());
	prompt(p, 8, 1);
	for (int i = 0; i < 4; i++) {
		struct mlens_request_params rp = params((uint64_t)i, p, 8, 3);
		submit_ok(&f, &a, &rp);
		submit_ok(&f, &b, &rp);
	}
	ck_assert_int_eq(mlens_sched_step(f.s), 1);
	ck_assert_uint_eq(a.st.running, 1);
	ck_assert_uint_eq(b.st.running, 4);	/* b is not held back by a's quota */
	for (int i = 0; i < 200 && !mlens_sched_idle(f.s); i++) {
		mlens_sched_step(f.s);
		ck_assert_uint_le(a.st.running, 1);
	}
	ck_assert(mlens_sched_idle(f.s));
	ck_assert_uint_eq(a.st.requests_done, 4);
	ck_assert_uint_eq(b.st.requests_done, 4);
	fx_close(&f);
}
END_TEST

START_TEST(fair_share_by_weight)
{
	/* two prefills of 8 fit a step of 16 tokens; b has three times a's
	 * weight, so of the first 16 admissions b gets about 12 */
	struct fx f;
	struct tenant a, b;
	struct mlens_quota qa = q_default(), qb = q_default();
	int32_t p[16];
	qb.weight = 3.0;
	fx_open(&f, 512, 16);
	tenant_init(&a, qa);
	tenant_init(&b, qb);
	prompt(p, 8, 1);
	for (int i = 0; i < 20; i++) {
		struct mlens_request_params rp = params((uint64_t)i, p, 8, 1);
		submit_ok(&f, &a, &rp);
		submit_ok(&f, &b, &rp);
	}
	for (int i = 0; i < 8; i++)
		ck_assert_int_eq(mlens_sched_step(f.s), 1);
	ck_assert_uint_eq(a.st.requests_done + b.st.requests_done, 16);
	ck_assert_uint_ge(b.st.requests_done, 11);
	ck_assert_uint_le(b.st.requests_done, 13);
	run_until_idle(&f, 100);
	ck_assert_uint_eq(a.st.requests_done, 20);
	ck_assert_uint_eq(b.st.requests_done, 20);
	fx_close(&f);
}
END_TEST

/* A tenant that starts waiting late (attached, or reconnected, after a has
 * run a while) starts its fair-share clock where a's stands, not at 0: of
 * the next 16 admissions (two prefills of 8 a step) each gets about half.
 * From 0 it took all 16 while its clock caught up with a's 240. */
START_TEST(late_tenant_shares_at_once)
{
	struct fx f;
	struct tenant a, b;
	int32_t p[8];
	uint64_t a0;
	fx_open(&f, 512, 16);
	tenant_init(&a, q_default());
	prompt(p, 8, 1);
	for (int i = 0; i < 30; i++) {
		struct mlens_request_params rp = params((uint64_t)i, p, 8, 1);
		submit_ok(&f, &a, &rp);
	}
	run_until_idle(&f, 100);
	ck_assert_uint_eq(a.st.requests_done, 30);
	a0 = a.st.requests_done;
	tenant_init(&b, q_default());
	for (int i = 0; i < 20; i++) {
		struct mlens_request_params rp = params(100 + (uint64_t)i, p, 8, 1);
		submit_ok(&f, &a, &rp);
		submit_ok(&f, &b, &rp);
	}
	for (int i = 0; i < 8; i++)
		ck_assert_int_eq(mlens_sched_step(f.s), 1);
	ck_assert_uint_eq(a.st.requests_done - a0 + b.st.requests_done, 16);
	ck_assert_msg(a.st.requests_done - a0 >= 7 && b.st.requests_done >= 7,
		      "of 16 admissions the old tenant got %llu, the new one %llu",
		      (unsigned long long)(a.st.requests_done - a0), (unsigned long long)b.st.requests_done);
	run_until_idle(&f, 100);
	ck_assert_uint_eq(b.st.requests_done, 20);
	fx_close(&f);
}
END_TEST

/* Equal fair-share clocks go by queue order across tenants: b's request
 * came first, then a's, then b's, then a's; one 8-token prompt fits a
 * step. Admission asks each tenant for its first request, so a tie broken
 * by the tenants' own order (a, the last to have one waiting, first)
 * would run a's first. */
START_TEST(equal_clocks_go_by_queue_order)
{
	static const uint64_t want[4] = { 100, 200, 101, 201 };
	struct fx f;
	struct tenant a, b;
	int32_t p[8];
	fx_open(&f, 512, 8);
	tenant_init(&a, q_default());
	tenant_init(&b, q_default());
	prompt(p, 8, 1);
	for (int i = 0; i < 2; i++) {
		struct mlens_request_params rp = params(100 + (uint64_t)i, p, 8, 1);
		submit_ok(&f, &b, &rp);
		rp = params(200 + (uint64_t)i, p, 8, 1);
		submit_ok(&f, &a, &rp);
	}
	for (int k = 0; k < 4; k++) {
		int na = a.n_ev, nb = b.n_ev;
		ck_assert_int_eq(mlens_sched_step(f.s), 1);
		ck_assert_int_eq((a.n_ev - na) + (b.n_ev - nb), 1);
		const struct mlens_event *ev = a.n_ev > na ? &a.ev[na] : &b.ev[nb];
		ck_assert_msg(ev->id == want[k], "step %d ran request %llu, not %llu", k,
			      (unsigned long long)ev->id, (unsigned long long)want[k]);
	}
	ck_assert(mlens_sched_idle(f.s));
	fx_close(&f);
}
END_TEST

/* A tenant's live ids (the duplicate check at submission, cancel) over
 * enough requests that the id table grows several times: each submitted
 * one is live, cancelled ones and finished ones are not, an id may come
 * back once its request is done. */
START_TEST(live_ids)
{
	struct fx f;
	struct tenant a, b;
	int32_t p[4];
	fx_open(&f, 4096, 0);
	tenant_init(&a, q_default());
	tenant_init(&b, q_default());
	prompt(p, 4, 1);
	for (uint64_t id = 1000; id < 1300; id++) {
		struct mlens_request_params rp = params(id, p, 4, 2);
		submit_ok(&f, &a, &rp);
	}
	for (uint64_t id = 1000; id < 1300; id++) {
		ck_assert_msg(mlens_sched_live(f.s, &a.st, id), "id %llu", (unsigned long long)id);
		ck_assert(!mlens_sched_live(f.s, &b.st, id));	/* ids are per tenant */
	}
	ck_assert(!mlens_sched_live(f.s, &a.st, 999));
	ck_assert(!mlens_sched_live(f.s, &a.st, 1300));
	for (uint64_t id = 1000; id < 1300; id += 3)
		ck_assert_int_eq(mlens_sched_cancel(f.s, &a.st, id), 0);
	for (uint64_t id = 1000; id < 1300; id++)
		ck_assert_int_eq(mlens_sched_live(f.s, &a.st, id), (id - 1000) % 3 != 0);
	ck_assert_int_eq(mlens_sched_cancel(f.s, &a.st, 1000), -ENOENT);
	ck_assert_int_eq(mlens_sched_cancel(f.s, &b.st, 1001), -ENOENT);
	run_until_idle(&f, 1000);
	ck_assert_uint_eq(a.st.requests_done, 300);	/* cancelled ones count as done */
	for (uint64_t id = 1000; id < 1300; id++)
		ck_assert(!mlens_sched_live(f.s, &a.st, id));
	ck_assert_ptr_null(a.st.ids);	/* no live request, no table */
	struct mlens_request_params rp = params(1001, p, 4, 2);
	submit_ok(&f, &a, &rp);
	ck_assert(mlens_sched_live(f.s, &a.st, 1001));
	run_until_idle(&f, 100);
	ck_assert(!mlens_sched_live(f.s, &a.st, 1001));
	fx_close(&f);
}
END_TEST

START_TEST(eviction_while_a_token_waits)
{
	/* tenant a stops reading after 2 events, so its requests hold pending
	 * tokens; the pool is so small (and the admission's look-ahead one
	 * step) that they get evicted in that state. Once a reads again,
	 * every token arrives once, in order, unchanged. */
	enum { N = 6, G = 30 };
	int lens[N];
	int32_t ref[N][64], got[64];
	struct fx f;
	struct tenant a, b;
	struct mlens_sched_stats st;
	for (int i = 0; i < N; i++)
		lens[i] = 4 + i;
	reference(N, lens, G, ref, NULL);
	fx_open_h(&f, 24, 0, 1);
	tenant_init(&a, q_default());
	tenant_init(&b, q_default());
	a.room = 2;
	/* b's requests are admitted a step before a's, so that a's are the
	 * youngest: the victims when the pool runs short */
	for (int pass = 1; pass >= 0; pass--) {
		for (int i = 0; i < N; i++) {
			int32_t p[64];
			struct mlens_request_params rp;
			if (i % 2 != pass)
				continue;
			prompt(p, lens[i], (unsigned)i + 1);
			rp = params((uint64_t)i, p, lens[i], G);
			submit_ok(&f, i % 2 ? &b : &a, &rp);
		}
		ck_assert_int_eq(mlens_sched_step(f.s), 1);
	}
	for (int i = 0; i < 400; i++)
		mlens_sched_step(f.s);
	mlens_sched_get_stats(f.s, &st);
	ck_assert_uint_gt(a.st.preemptions, 0);	/* evicted while holding a pending token */
	a.room = -1;
	run_until_idle(&f, 4000);
	for (int i = 0; i < N; i++) {
		struct tenant *t = i % 2 ? &b : &a;
		ck_assert_int_eq(tokens_of(t, (uint64_t)i, got, NULL), G);
		for (int j = 0; j < G; j++)
			ck_assert_msg(got[j] == ref[i][j], "request %d token %d", i, j);
	}
	ck_assert_uint_eq(mlens_kv_pool_used_blocks(mlens_engine_kv(f.e)), 0);
	fx_close(&f);
}
END_TEST

START_TEST(kv_quota_holds_back_only_its_tenant)
{
	struct fx f;
	struct tenant a, b;
	struct mlens_quota qa = q_default();
	int32_t p[16];
	/* blocks of 4 tokens: a prompt of 8 takes 2, so 2 of a's requests are
	 * admitted under 4 blocks (the quota limits admission, not growth);
	 * 8 + 6 tokens need 4 blocks, so each one alone is acceptable */
	qa.max_kv_blocks = 4;
	fx_open(&f, 512, 0);
	tenant_init(&a, qa);
	tenant_init(&b, q_default());
	prompt(p, 8, 1);
	for (int i = 0; i < 3; i++) {
		struct mlens_request_params rp = params((uint64_t)i, p, 8, 6);
		submit_ok(&f, &a, &rp);
	}
	for (int i = 0; i < 3; i++) {
		struct mlens_request_params rp = params((uint64_t)(10 + i), p, 8, 6);
		submit_ok(&f, &b, &rp);
	}
	ck_assert_int_eq(mlens_sched_step(f.s), 1);
	ck_assert_uint_eq(a.st.running, 2);
	ck_assert_uint_eq(a.st.queued, 1);
	ck_assert_uint_eq(b.st.running, 3);	/* not queued behind a's quota */
	run_until_idle(&f, 200);
	ck_assert_uint_eq(a.st.requests_done, 3);
	ck_assert_uint_eq(b.st.requests_done, 3);
	fx_close(&f);
}
END_TEST

/* A KV quota lowered below what waiting requests need by their end fails
 * them at the next step, with the quota's numbers, instead of leaving them
 * waiting for ever (their 12-token prompts alone hold 3 blocks of 4
 * tokens: they could never be admitted); the running one goes on to its
 * end. 12 + 2 tokens need 4 blocks, the quota is lowered to 2. */
START_TEST(lowered_kv_quota_fails_waiting)
{
	struct fx f;
	struct tenant a;
	struct mlens_quota q = q_default();
	int32_t p[12];
	int errors = 0;
	q.max_running = 1;
	fx_open(&f, 512, 0);
	tenant_init(&a, q);
	prompt(p, 12, 1);
	for (int i = 0; i < 3; i++) {
		struct mlens_request_params rp = params((uint64_t)i, p, 12, 2);
		submit_ok(&f, &a, &rp);
	}
	ck_assert_int_eq(mlens_sched_step(f.s), 1);
	ck_assert_uint_eq(a.st.running, 1);
	ck_assert_uint_eq(a.st.queued, 2);
	q.max_kv_blocks = 2;
	mlens_sched_set_quota(f.s, &a.st, &q);
	run_until_idle(&f, 50);
	ck_assert(mlens_sched_idle(f.s));
	ck_assert_uint_eq(a.st.requests_done, 1);
	ck_assert_uint_eq(a.st.requests_failed, 2);
	for (int i = 0; i < a.n_ev; i++) {
		const struct mlens_event *ev = &a.ev[i];
		if (ev->finish != MLENS_FINISH_ERROR)
			continue;
		errors++;
		ck_assert_int_eq(ev->status, -EDQUOT);
		ck_assert_int_eq(ev->detail.what, MLENS_DETAIL_KV_QUOTA);
		ck_assert_uint_eq(ev->detail.need, 4);
		ck_assert_uint_eq(ev->detail.have, 2);
	}
	ck_assert_int_eq(errors, 2);
	fx_close(&f);
}
END_TEST

/* A command the main thread waits for (mlensctl quota, drain, resume) is
 * seen in the worker's snapshot as soon as the call returns: a control
 * request that sets and one that reads right after must agree. The snapshot
 * used to go out after the worker's next step or command; here that next
 * command (a 100 ms call queued behind the admission change, in the same
 * batch) would hold it back. */
static int call_wait_fd(void *arg, struct mlens_sched *s)
{
	uint64_t v;
	(void)s;
	for (int i = 0; i < 5000 && read(*(int *)arg, &v, sizeof(v)) != sizeof(v); i++)
		usleep(1000);	/* the test releases it; give up after 5 s */
	return 0;
}

static int call_sleep(void *arg, struct mlens_sched *s)
{
	(void)arg;
	(void)s;
	usleep(100000);
	return 0;
}

struct setter {
	struct mlens_worker *w;
	bool seen;
};

static void *set_and_read(void *arg)
{
	struct setter *x = arg;
	struct mlens_worker_snapshot snap;
	mlens_worker_set_admission(x->w, true);
	mlens_worker_snapshot(x->w, &snap);
	free(snap.tenants);
	x->seen = snap.admission;
	return NULL;
}

START_TEST(worker_snapshot_after_command)
{
	struct fx f;
	struct mlens_worker *w;
	struct mlens_worker_snapshot snap;
	struct setter x;
	pthread_t th;
	uint64_t one = 1;
	int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK), hold = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	ck_assert_int_ge(efd, 0);
	ck_assert_int_ge(hold, 0);
	fx_open(&f, 64, 0);
	ck_assert_int_eq(mlens_worker_start(&w, f.s, efd), 0);
	mlens_worker_set_admission(w, false);
	mlens_worker_snapshot(w, &snap);
	free(snap.tenants);
	ck_assert(!snap.admission);
	/* the worker held in a call while the admission change and a slow
	 * call queue up behind it, in that order */
	ck_assert_int_eq(mlens_worker_call_async(w, call_wait_fd, &hold), 0);
	x.w = w;
	x.seen = false;
	ck_assert_int_eq(pthread_create(&th, NULL, set_and_read, &x), 0);
	usleep(50000);
	ck_assert_int_eq(mlens_worker_call_async(w, call_sleep, NULL), 0);
		ck_assert_int_eq(write(hold, &one, sizeof(one)), (ssize_t)sizeof(one));
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_msg(x.seen, "the snapshot read right after opening admission still says closed");
	mlens_worker_stop(w);
	fx_close(&f);
	close(hold);
	close(efd);
}
END_TEST

/* ==== a mix of lengths ==== */

/* What a mixed workload did, step by step. */
struct mix_run {
	int steps;
	int first_step_tokens;
	double steady_fill;	/* mean step tokens / cap over steps that began with requests waiting */
	int steady_steps;
	int max_small_run;	/* longest run of such steps under half the cap */
	uint64_t preemptions;
	int repreempted;	/* evictions of a request within 2 steps of its re-admission */
	int done;
	int max_wait_steps;	/* most steps a request waited for its first token */
};

/* Log-uniform integer in [lo, hi] from a 64-bit LCG. */
static int mix_len(uint64_t *st, int lo, int hi)
{
	double u;
	*st = *st * 6364136223846793005ull + 1442695040888963407ull;
	u = (double)(*st >> 11) / 9007199254740992.0;
	return (int)floor(exp(log(lo) + u * (log(hi + 1.0) - log(lo))));
}

/* n requests of log-uniform lengths (prompts plo..phi, generations
 * glo..ghi, ignoring EOS) all queued at once, run to the end. */
static void mix_run(struct mix_run *mr, uint32_t kv_blocks, int cap, int horizon, int n, int plo,
		    int phi, int glo, int ghi)
{
	static struct tenant t;
	struct fx f;
	uint64_t st = 12345, pre_before;
	int32_t p[64];
	int first_tok[256], admitted_at[256], last_evict[256];
	int small = 0;
	ck_assert_int_le(n, 256);
	ck_assert_int_le(phi, 64);
	memset(mr, 0, sizeof(*mr));
	fx_open_h(&f, kv_blocks, cap, horizon);
	tenant_init(&t, q_default());
	for (int i = 0; i < n; i++) {
		int len = mix_len(&st, plo, phi), g = mix_len(&st, glo, ghi);
		struct mlens_request_params rp;
		prompt(p, len, (unsigned)i + 1);
		rp = params((uint64_t)i, p, len, g);
		submit_ok(&f, &t, &rp);
		first_tok[i] = -1;
		admitted_at[i] = last_evict[i] = -100;
	}
	while (!mlens_sched_idle(f.s) && mr->steps < 100000) {
		struct mlens_sched_stats ss;
		int ev0 = t.n_ev;
		bool waiting;
		mlens_sched_get_stats(f.s, &ss);
		waiting = ss.waiting > 0;
		pre_before = ss.preemptions;
		ck_assert_int_eq(mlens_sched_step(f.s), 1);
		mlens_sched_get_stats(f.s, &ss);
		if (mr->steps == 0)
			mr->first_step_tokens = (int)ss.last_step_tokens;
		if (waiting && ss.waiting > 0) {
			mr->steady_fill += (double)ss.last_step_tokens;
			mr->steady_steps++;
			small = 2 * (int)ss.last_step_tokens < cap ? small + 1 : 0;
			if (small > mr->max_small_run)
				mr->max_small_run = small;
		}
		mr->preemptions += ss.preemptions - pre_before;
		mr->repreempted = (int)ss.repreemptions;
		for (int e = ev0; e < t.n_ev; e++) {
			int id = (int)t.ev[e].id;
			if (t.ev[e].first && first_tok[id] < 0)
				first_tok[id] = mr->steps;
			if (t.ev[e].last)
				mr->done++;
		}
		mr->steps++;
	}
	(void)admitted_at;
	(void)last_evict;
	mr->steady_fill = mr->steady_steps ? mr->steady_fill / mr->steady_steps / cap : 0;
	for (int i = 0; i < n; i++)
		if (first_tok[i] > mr->max_wait_steps)
			mr->max_wait_steps = first_tok[i];
	fprintf(stderr, "mix: %d steps, first %d tokens, steady fill %.3f over %d steps, longest small run %d, "
		"%llu preemptions (%d soon after a return), %d done, longest wait %d steps\n", mr->steps, mr->first_step_tokens,
		mr->steady_fill, mr->steady_steps, mr->max_small_run, (unsigned long long)mr->preemptions,
		mr->repreempted, mr->done, mr->max_wait_steps);
	fx_close(&f);
}

/* KV ample, the token cap binds: prompts up to two thirds of the cap
 * wait at the head of the queue for room while shorter ones behind them
 * could fill the step. The first step (prefills only) and every step
 * while requests wait are nearly full; all finish. */
START_TEST(mix_keeps_steps_full)
{
	struct mix_run mr;
	mix_run(&mr, 2000, 96, 0, 200, 2, 64, 1, 48);
	ck_assert_int_eq(mr.done, 200);
	ck_assert_int_ge(mr.first_step_tokens, 91);
	ck_assert_msg(mr.steady_fill >= 0.9, "steady fill %.3f", mr.steady_fill);
	ck_assert_int_eq(mr.max_small_run, 0);
	ck_assert_int_eq(mr.preemptions, 0);
}
END_TEST

/* KV ample, prompts up to nearly the cap: one that waited its turn goes
 * in place of some decode tokens (put off a step) instead of waiting for
 * the batch to drain below cap - prompt, so no run of small steps while
 * requests wait; all finish, none evicted. */
START_TEST(mix_long_prompts_take_decodes_place)
{
	struct mix_run mr;
	mix_run(&mr, 2000, 68, 0, 200, 2, 64, 1, 48);
	ck_assert_int_eq(mr.done, 200);
	ck_assert_msg(mr.steady_fill >= 0.9, "steady fill %.3f", mr.steady_fill);
	ck_assert_int_le(mr.max_small_run, 1);
	ck_assert_int_eq(mr.preemptions, 0);
}
END_TEST

/* A tight pool with a one-step reserve: growth evicts sequences, but one
 * brought back is not evicted again within a few steps, and evictions
 * stay few; all finish. */
START_TEST(mix_preemption_no_thrash)
{
	struct mix_run mr;
	mix_run(&mr, 60, 128, 1, 200, 2, 32, 1, 64);
	ck_assert_int_eq(mr.done, 200);
	ck_assert_int_eq(mr.repreempted, 0);
	ck_assert_int_le(mr.preemptions, 200 / 3);
}
END_TEST

/* A long prompt behind a stream of short requests that keeps the step
 * nearly full is passed over only for a while: then the short ones wait
 * until it fits. */
START_TEST(mix_long_prompt_not_starved)
{
	static struct tenant t;
	struct fx f;
	int32_t p[64];
	struct mlens_request_params rp;
	int first = -1, step;
	fx_open(&f, 2000, 72);
	tenant_init(&t, q_default());
	prompt(p, 64, 7);
	for (step = 0; step < 200 && first < 0; step++) {
		/* 3 new prompts of 8 a step, 4 tokens each: ~36 tokens a step */
		for (int k = 0; k < 3; k++) {
			uint64_t id = 1000 + (uint64_t)step * 3 + (uint64_t)k;
			prompt(p, 8, (unsigned)id);
			rp = params(id, p, 8, 4);
			submit_ok(&f, &t, &rp);
		}
		if (step == 2) {
			prompt(p, 64, 7);
			rp = params(1, p, 64, 4);
			submit_ok(&f, &t, &rp);
		}
		ck_assert_int_eq(mlens_sched_step(f.s), 1);
		for (int e = 0; e < t.n_ev; e++)
			if (t.ev[e].id == 1 && t.ev[e].first)
				first = step;
		t.n_ev = 0;
	}
	ck_assert_msg(first >= 0 && first <= 2 + 16 + 8, "the long prompt's first token at step %d", first);
	fx_close(&f);
}
END_TEST

static Suite *sched_suite(void)
{
	Suite *s = suite_create("sched");
	TCase *tc = tcase_create("sched");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, preemption_keeps_tokens);
	tcase_add_test(tc, preemption_swap_keeps_tokens);
	tcase_add_test(tc, swapped_requests_removed);
	tcase_add_test(tc, admissions_keep_room);
	tcase_add_test(tc, admission_reserve_horizon);
	tcase_add_test(tc, reserve_demand_forms_agree);
	tcase_add_test(tc, token_cap_respected);
	tcase_add_test(tc, refusals);
	tcase_add_test(tc, full_ring_stalls_only_its_tenant);
	tcase_add_test(tc, tenant_removal_frees_kv);
	tcase_add_test(tc, cancel_and_stop_tokens);
	tcase_add_test(tc, eos_ends_unless_ignored);
	tcase_add_test(tc, running_quota);
	tcase_add_test(tc, fair_share_by_weight);
	tcase_add_test(tc, equal_clocks_go_by_queue_order);
	tcase_add_test(tc, late_tenant_shares_at_once);
	tcase_add_test(tc, live_ids);
	tcase_add_test(tc, eviction_while_a_token_waits);
	tcase_add_test(tc, kv_quota_holds_back_only_its_tenant);
	tcase_add_test(tc, lowered_kv_quota_fails_waiting);
	tcase_add_test(tc, worker_snapshot_after_command);
	tcase_add_test(tc, mix_keeps_steps_full);
	tcase_add_test(tc, mix_long_prompts_take_decodes_place);
	tcase_add_test(tc, mix_preemption_no_thrash);
	tcase_add_test(tc, mix_long_prompt_not_starved);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(sched_suite());
	int failed;
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}
