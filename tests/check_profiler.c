/* Description: the profiler on the CPU backend with the in-memory tiny
 * model gives positive, sane rates and GA/GB lines of positive slope in
 * well under a second; the cache round-trips and a changed key (budget,
 * backend, model) invalidates it; the daemon's profile state sets the
 * scheduler's cap from n_real unless max_step_tokens pins it. A device
 * made of the CPU backend (its memory declared not host memory, copies by
 * memcpy on the caller's thread) takes the profiler's device path: copy
 * rates, and the memory reads again while a second thread streams copies,
 * summed into the model's B_mem. */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "daemon/plan/profiler.h"
#include "daemon/serve/sched.h"
#include "tests/testmodel.h"

static struct mlens_model *tiny(void)
{
	struct mlens_test_spec s = mlens_test_spec_tiny();
	return mlens_test_model_new(&s);
}

static void profile_tiny(struct mlens_model *m, struct mlens_backend *be, struct mlens_profile *p)
{
	struct mlens_profile_opts o;
	char err[512];
	memset(&o, 0, sizeof(o));
	o.be = be;
	o.kv_dtype = MLENS_DTYPE_F32;
	o.max_tokens = 1024;
	ck_assert_msg(mlens_profile_run(m, &o, p, err, sizeof(err)) == 0, "%s", err);
}

START_TEST(cpu_profile_sane)
{
	struct mlens_model *m = tiny();
	struct mlens_backend be;
	struct mlens_profile p;
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	profile_tiny(m, &be, &p);
	printf("profile: %.3f s, GA %.3g + %.3g n s, GB %.3g + %.3g n s, GEMM %.3g FLOP/s, "
	       "attention %.3g B/s, memory %.3g B/s, points up to %lld tokens\n",
	       p.seconds, p.ga.a, p.ga.b, p.gb.a, p.gb.b, p.gemm_flops, p.attn_bw, p.mem_bw,
	       (long long)p.tokens[p.n_points - 1]);
	ck_assert_str_eq(p.backend, "cpu");
	ck_assert_str_eq(p.gpu, "");
	ck_assert_int_eq(p.n_points, MLENS_PROFILE_POINTS);
	for (int i = 0; i < p.n_points; i++) {
		ck_assert(p.ga_s[i] > 0 && p.gb_s[i] > 0);
		if (i)
			ck_assert_int_gt(p.tokens[i], p.tokens[i - 1]);
	}
	ck_assert(p.ga.b > 0);
	ck_assert(p.gb.b > 0);
	/* GB (experts) carries far more FLOPs per token than GA for this model:
	 * ~4x the time at the largest point, measured and on the fitted lines
	 * (not their slopes alone: a distcheck on two loaded cores once timed
	 * one GA point high enough to tip GA's slope past GB's) */
	{
		int last = p.n_points - 1;
		double N = (double)p.tokens[last];
		ck_assert_msg(p.gb_s[last] > p.ga_s[last], "GB %.3g s, GA %.3g s at %.0f tokens",
			      p.gb_s[last], p.ga_s[last], N);
		ck_assert(p.gb.a + p.gb.b * N > p.ga.a + p.ga.b * N);
	}
	ck_assert(p.gemm_flops > 1e6 && p.gemm_flops < 1e14);
	ck_assert(p.mem_bw > 1e8 && p.mem_bw < 1e13);
	ck_assert(p.attn_bw > 1e6 && p.attn_bw < 1e13);
	ck_assert(p.append_bw > 1e6 && p.append_bw < 1e13);
	ck_assert(p.attn_copy_bw == 0);	/* no copy queue to run beside */
	ck_assert(p.h2d == 0 && p.d2h == 0);	/* host memory: nothing crosses a bus */
	ck_assert(p.act_h2d == 0 && p.act_d2h == 0);
	ck_assert(p.kv_store_bw == 0 && p.kv_store_side_bw == 0);	/* no stores cross a bus */
	/* the CPU backend's prefill attention, timed over the GA rows */
	ck_assert(p.attn_prefill_flops > 1e6 && p.attn_prefill_flops < 1e14);
	/* the budget (0.5 s on host memory) is kept, not overrun by whole
	 * multiples; the bound is loose so that a loaded machine cannot fail
	 * it, while a profile that ignored its budget still would */
	ck_assert_msg(p.seconds > 0 && p.seconds < 10.0, "the tiny model's profile took %.2f s", p.seconds);
	{
		struct mlens_perf_hw hw;
		memset(&hw, 0, sizeof(hw));
		mlens_profile_hw(&p, &hw);
		ck_assert(hw.b_io == p.mem_bw && hw.b_mem == p.mem_bw && hw.b_attn == p.attn_bw);
		ck_assert(hw.c_gpu == p.gemm_flops && hw.ga.b == p.ga.b && hw.gb.a == p.gb.a);
		ck_assert(hw.c_attn == p.attn_prefill_flops);
		ck_assert(hw.b_act_h2d == 0 && hw.b_act_d2h == 0);	/* no copies to count */
		ck_assert(hw.b_io_shared == 0 && hw.b_attn_shared == 0);
		ck_assert(hw.b_append == p.append_bw);
	}
	mlens_backend_destroy(&be);
	mlens_test_model_free(m);
}
END_TEST

START_TEST(cache_roundtrip_and_key)
{
	struct mlens_model *m = tiny(), *m2;
	struct mlens_test_spec s2 = mlens_test_spec_tiny();
	struct mlens_backend be;
	struct mlens_profile p, q;
	struct mlens_profile_key k, k2;
	char path[] = "/tmp/check_profiler_XXXXXX", file[64], err[512];
	FILE *f;
	ck_assert_ptr_nonnull(mkdtemp(path));
	snprintf(file, sizeof(file), "%s/profile.json", path);
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	profile_tiny(m, &be, &p);
	mlens_profile_key_make(&k, m, "cpu", "", NULL, 0.5);
	ck_assert_int_eq(mlens_profile_load(file, &k, &q, err, sizeof(err)), -ENOENT);
	ck_assert_msg(mlens_profile_save(file, &k, &p, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(mlens_profile_load(file, &k, &q, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(q.n_points, p.n_points);
	for (int i = 0; i < p.n_points; i++) {
		ck_assert_int_eq(q.tokens[i], p.tokens[i]);
		ck_assert_double_eq_tol(q.ga_s[i], p.ga_s[i], 1e-12 + 1e-9 * p.ga_s[i]);
		ck_assert_double_eq_tol(q.gb_s[i], p.gb_s[i], 1e-12 + 1e-9 * p.gb_s[i]);
	}
	ck_assert_double_eq_tol(q.ga.b, p.ga.b, 1e-9 * fabs(p.ga.b));
	ck_assert_double_eq_tol(q.gb.a, p.gb.a, 1e-9 * fabs(p.gb.a) + 1e-15);
	ck_assert_double_eq_tol(q.mem_bw, p.mem_bw, 1e-9 * p.mem_bw);
	ck_assert_double_eq_tol(q.mem_read_bw, p.mem_read_bw, 1e-9 * p.mem_read_bw);
	ck_assert_double_eq_tol(q.attn_bw, p.attn_bw, 1e-9 * p.attn_bw);
	ck_assert_double_eq_tol(q.append_bw, p.append_bw, 1e-9 * p.append_bw);
	ck_assert_double_eq_tol(q.gemm_flops, p.gemm_flops, 1e-9 * p.gemm_flops);
	ck_assert_double_eq_tol(q.attn_prefill_flops, p.attn_prefill_flops, 1e-9 * p.attn_prefill_flops);
	ck_assert(q.act_h2d == 0 && q.act_d2h == 0);
	ck_assert_str_eq(q.backend, "cpu");

	/* each part of the key invalidates it */
	mlens_profile_key_make(&k2, m, "cpu", "", &(struct mlens_gpu_plan){ .budget = 8ull << 30 }, 0.5);
	ck_assert_int_eq(mlens_profile_load(file, &k2, &q, err, sizeof(err)), -ESTALE);
	mlens_profile_key_make(&k2, m, "cuda", "10de:2335 at 0000:3b:00.0", NULL, 0.5);
	ck_assert_int_eq(mlens_profile_load(file, &k2, &q, err, sizeof(err)), -ESTALE);
	mlens_profile_key_make(&k2, m, "cpu", "", NULL, 5);
	ck_assert_int_eq(mlens_profile_load(file, &k2, &q, err, sizeof(err)), -ESTALE);
	s2.inter = 64;
	m2 = mlens_test_model_new(&s2);
	mlens_profile_key_make(&k2, m2, "cpu", "", NULL, 0.5);
	ck_assert(k2.config_hash != k.config_hash);
	ck_assert_int_eq(mlens_profile_load(file, &k2, &q, err, sizeof(err)), -ESTALE);
	mlens_test_model_free(m2);

	/* garbage is refused with a reason, not trusted */
	f = fopen(file, "w");
	ck_assert_ptr_nonnull(f);
	fputs("{\"version\": 1, \"key\": 3", f);
	fclose(f);
	ck_assert_int_eq(mlens_profile_load(file, &k, &q, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "not JSON"));
	unlink(file);
	rmdir(path);
	mlens_backend_destroy(&be);
	mlens_test_model_free(m);
}
END_TEST

/* ==== a device made of the CPU backend ==== */

static struct mlens_backend_ops fake_ops;
static pthread_t fake_main;		/* the profiling thread */
static atomic_int fake_copies_other;	/* copies queued from another thread */
static atomic_bool fake_fail_other;	/* those fail with -EIO */
static atomic_int fake_copies_q0;	/* copies on the compute queue */

static void *fake_host_alloc(void *ctx, size_t bytes)
{
	(void)ctx;
	return malloc(bytes ? bytes : 1);
}

static void fake_host_free(void *ctx, void *p)
{
	(void)ctx;
	free(p);
}

static int fake_copy(void *ctx, int queue, void *dst, const void *src, size_t bytes, bool to_device)
{
	(void)ctx;
	(void)to_device;
	if (queue < 0 || queue > 1)
		return -EINVAL;
	if (queue == 0)
		atomic_fetch_add(&fake_copies_q0, 1);
	if (!pthread_equal(pthread_self(), fake_main)) {
		atomic_fetch_add(&fake_copies_other, 1);
		if (atomic_load(&fake_fail_other))
			return -EIO;
	}
	memcpy(dst, src, bytes);
	return 0;
}

static int fake_record(void *ctx, int queue, int ev)
{
	(void)ctx;
	return queue < 0 || queue > 2 || ev < 0 || ev >= MLENS_BACKEND_EVENTS ? -EINVAL : 0;
}

/* kv_append_side: the CPU backend's append (fake_base), done at once, counted */
static const struct mlens_backend_ops *fake_base;
static atomic_int fake_side_appends;
static int fake_append_side(void *ctx, struct mlens_kv_cache *kv, int layer, const float *k,
			    const float *v, const int64_t *slots, int n)
{
	atomic_fetch_add(&fake_side_appends, 1);
	return fake_base->kv_append(ctx, kv, layer, k, v, slots, n);
}

static int fake_sync(void *ctx, int ev)
{
	(void)ctx;
	return ev < 0 || ev >= MLENS_BACKEND_EVENTS ? -EINVAL : 0;
}

static void fake_device(struct mlens_backend *be)
{
	ck_assert_int_eq(mlens_backend_cpu_create(be, NULL), 0);
	fake_base = be->ops;
	fake_ops = *be->ops;
	fake_ops.name = "fakedev";
	fake_ops.host_memory = false;
	fake_ops.host_alloc = fake_host_alloc;
	fake_ops.host_free = fake_host_free;
	fake_ops.copy_async = fake_copy;
	fake_ops.event_record = fake_record;
	fake_ops.event_sync = fake_sync;
	fake_ops.side_queue = true;
	fake_ops.kv_append_side = fake_append_side;
	atomic_store(&fake_side_appends, 0);
	be->ops = &fake_ops;
	fake_main = pthread_self();
	atomic_store(&fake_copies_other, 0);
	atomic_store(&fake_fail_other, false);
	atomic_store(&fake_copies_q0, 0);
}

START_TEST(device_memory_under_copy)
{
	struct mlens_model *m = tiny();
	struct mlens_backend be;
	struct mlens_profile_opts o;
	struct mlens_profile p;
	struct mlens_perf_hw hw;
	char err[512];

	fake_device(&be);
	memset(&o, 0, sizeof(o));
	o.be = &be;
	o.kv_dtype = MLENS_DTYPE_F32;
	o.max_tokens = 1024;
	o.budget_s = 0.5;
	ck_assert_msg(mlens_profile_run(m, &o, &p, err, sizeof(err)) == 0, "%s", err);
	printf("fake device: copies %.3g B/s, reads alone %.3g B/s, reads %.3g + copies %.3g B/s at once, "
	       "%d copies from the copy thread\n", p.h2d, p.mem_read_bw, p.mem_read_copy_bw, p.copy_read_bw,
	       atomic_load(&fake_copies_other));
	ck_assert_str_eq(p.backend, "fakedev");
	ck_assert(p.h2d > 1e8 && p.d2h > 1e8);
	/* rates in bytes a second, whatever the build: under TSan on two
	 * cores the copy thread's memcpy beside the reads ran 0.9-1.6e8 */
	ck_assert(p.mem_read_bw > 1e7 && p.mem_read_copy_bw > 1e7 && p.copy_read_bw > 1e7);
	/* the copies ran from a thread of their own, beside the attention
	 * and beside the reads: at least the warm-up copy and one timed each */
	ck_assert_int_ge(atomic_load(&fake_copies_other), 4);
	ck_assert(p.attn_bw > 1e6 && p.attn_copy_bw > 1e6);
	ck_assert_double_eq_tol(p.mem_bw, p.mem_read_copy_bw + p.copy_read_bw, 1e-9 * p.mem_bw);
	memset(&hw, 0, sizeof(hw));
	mlens_profile_hw(&p, &hw);
	ck_assert(hw.b_mem == p.mem_bw && hw.b_io == p.h2d);
	/* the compute queue's copies were timed each way (a warm-up and three
	 * timed copies), and the model counts them in the GPU's time */
	ck_assert(p.act_h2d > 1e8 && p.act_d2h > 1e8);
	ck_assert_int_ge(atomic_load(&fake_copies_q0), 8);
	ck_assert(hw.b_act_h2d == p.act_h2d && hw.b_act_d2h == p.act_d2h);
	/* the weight stream's rate beside the reads, for the model's PCIe tier */
	ck_assert(hw.b_io_shared == p.copy_read_bw);
	/* the K/V stores into pinned host memory, each queue (a warm-up and
	 * three timed on queue 2); the model takes the compute queue's, and
	 * the side queue's where the pipeline stores from there */
	ck_assert(p.kv_store_bw > 1e6 && p.kv_store_side_bw > 1e6);
	ck_assert_int_eq(atomic_load(&fake_side_appends), 4);
	ck_assert(hw.b_kv_store == p.kv_store_bw);
	{
		struct mlens_profile_state st;
		memset(&st, 0, sizeof(st));
		st.prof = p;
		st.gpu_kv_append = true;
		mlens_profile_state_hold(&st);
		ck_assert(st.hw.gpu_kv_append && !st.hw.kv_store_side && st.hw.b_kv_store == p.kv_store_bw);
		ck_assert(st.hw.b_act_h2d == p.act_h2d && st.hw.b_act_d2h == p.act_d2h);
		st.side_copy_out = true;
		mlens_profile_state_hold(&st);
		ck_assert(st.hw.kv_store_side && st.hw.b_kv_store == p.kv_store_side_bw);
		/* gpu_copy_out = down: GA's copies go down on queue 2, C's output
		 * still up on the compute queue */
		ck_assert(st.hw.b_act_h2d == p.act_h2d && st.hw.b_act_d2h == 0);
		/* side: neither way holds up the compute queue */
		st.up_copy_in = true;
		mlens_profile_state_hold(&st);
		ck_assert(st.hw.b_act_h2d == 0 && st.hw.b_act_d2h == 0);
		/* the attention's output up in the weights' dtype: two bytes a
		 * value, else the activations' four (0) */
		ck_assert(st.hw.att_up_bytes == 0 && !st.plan_in.att_half);
		st.att_up_half = true;
		mlens_profile_state_hold(&st);
		ck_assert(st.hw.att_up_bytes == 2 && st.plan_in.att_half);
	}
	/* and the attention's beside the stream, for its tier */
	ck_assert(hw.b_attn == p.attn_bw && hw.b_attn_shared == p.attn_copy_bw);

	/* a copy of the copy thread that fails fails the profile, saying so */
	atomic_store(&fake_fail_other, true);
	ck_assert_int_eq(mlens_profile_run(m, &o, &p, err, sizeof(err)), -EIO);
	ck_assert_msg(strstr(err, "beside the attention test failed") != NULL, "%s", err);
	mlens_backend_destroy(&be);
	mlens_test_model_free(m);
}
END_TEST

/* The daemon's state over a real engine and scheduler: the cap follows n_real. */
static void state_setup(struct mlens_profile_state *st, struct mlens_model *m, struct mlens_backend *be,
			uint64_t act_room, int pinned)
{
	memset(st, 0, sizeof(*st));
	st->model = m;
	st->opts.be = be;
	st->opts.kv_dtype = MLENS_DTYPE_F32;
	st->opts.max_tokens = 512;
	ck_assert_int_eq(mlens_perf_model_from_config(&st->pm, &m->cfg, MLENS_DTYPE_F32), 0);
	st->gpu_budget = mlens_gpu_plan_resident_bytes(&st->pm, (int)st->pm.experts) + act_room;
	st->kv_tokens = 4096;
	st->pinned_cap = pinned;
}

/* workload_follow's window arithmetic: the mean lengths of the requests
 * finished in a window, and whether they moved from the held workload */
START_TEST(workload_follow_window)
{
	struct mlens_workload_window w = { 0 };
	double p = -1, g = -1;
	/* the first look only starts the window */
	ck_assert_int_eq(mlens_workload_follow(&w, 1000, 500, 10, 512, 128, &p, &g), 0);
	ck_assert(p == -1 && g == -1);
	/* 63 more requests: too few, the window goes on */
	ck_assert_int_eq(mlens_workload_follow(&w, 1000 + 63 * 128, 500 + 63 * 32, 73, 512, 128, &p, &g), 0);
	ck_assert(p == -1);
	/* 100 requests of 128/32 since the start: moved from 512/128 */
	ck_assert_int_eq(mlens_workload_follow(&w, 1000 + 100 * 128, 500 + 100 * 32, 110, 512, 128, &p, &g), 1);
	ck_assert_double_eq(p, 128.0);
	ck_assert_double_eq(g, 32.0);
	/* a new window: 64 requests of 135/33 against 128/32 held: within 10% */
	ck_assert_int_eq(mlens_workload_follow(&w, 13800 + 64 * 135, 3700 + 64 * 33, 174, 128, 32, &p, &g), 0);
	ck_assert_double_eq(p, 135.0);
	ck_assert_double_eq(g, 33.0);
	/* only the generated length moves (36 > 32 x 1.1) */
	ck_assert_int_eq(mlens_workload_follow(&w, 22440 + 64 * 128, 5812 + 64 * 36, 238, 128, 32, &p, &g), 1);
	ck_assert_double_eq(g, 36.0);
	/* no generated token a request: nothing to predict for */
	ck_assert_int_eq(mlens_workload_follow(&w, 30632 + 64 * 128, 8116, 302, 128, 36, &p, &g), 0);
	/* counters that went back (a restarted count) start a new window */
	ck_assert_int_eq(mlens_workload_follow(&w, 5, 5, 1, 128, 36, &p, &g), 0);
	ck_assert_int_eq(mlens_workload_follow(&w, 5 + 64 * 16, 5 + 64 * 4, 65, 128, 36, &p, &g), 1);
	ck_assert(p == 16 && g == 4);
	/* held_p 0 (prompts of no tokens held): any prompt moves it */
	ck_assert_int_eq(mlens_workload_follow(&w, 5 + 64 * 17, 5 + 64 * 8, 129, 0, 4, &p, &g), 1);
}
END_TEST

START_TEST(state_sets_cap)
{
	struct mlens_model *m = tiny();
	struct mlens_backend be;
	struct mlens_engine *e;
	struct mlens_sched *s;
	struct mlens_engine_opts eo = { 0 };
	struct mlens_sched_opts so = { 0 };
	struct mlens_profile_state st;
	char err[512];
	int want;
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	eo.max_step_tokens = 1024;
	ck_assert_msg(mlens_engine_create(&e, m, &be, &eo, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(mlens_sched_create(&s, e, &so), 0);
	ck_assert_int_eq(mlens_sched_token_cap(s), 1024);

	/* resident mode: n_real is what the activation room holds */
	state_setup(&st, m, &be, 40000, 0);
	ck_assert_msg(mlens_profile_state_run(&st, s, 16, 16, false) == 0, "%s", st.err);
	for (want = 0; mlens_gpu_plan_act_estimate(&st.pm, want + 1, 0) <= 40000; want++)
		;
	ck_assert_int_eq(st.pred.limit, MLENS_PERF_LIMIT_ACT);
	ck_assert_int_eq((int)st.pred.n_real, want);
	ck_assert_int_lt(want, 1024);
	ck_assert_int_eq(mlens_sched_token_cap(s), want);
	ck_assert_int_eq(st.token_cap, want);
	ck_assert(st.pred.total_tok_s > 0 && st.pred.time.seconds > 0);
	ck_assert(mlens_profile_state_step_seconds(&st, 10) > 0);
	ck_assert(mlens_profile_state_step_seconds(&st, 100) > mlens_profile_state_step_seconds(&st, 10));
	{
		json_t *j = mlens_profile_state_json(&st);
		ck_assert_int_eq(json_integer_value(json_object_get(j, "token_cap")), want);
		ck_assert_double_eq(json_real_value(json_object_get(j, "n_real")), want);
		ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(j, "policy"), "resident_experts")),
				 st.pm.experts);
		json_decref(j);
	}

	/* room for more than the engine runs: on this backend (host memory,
	 * no bus) the engine's largest step is n_real, and says so; its
	 * compute tier is the CPU, and there are no link tiers */
	state_setup(&st, m, &be, 1ull << 30, 0);
	ck_assert_msg(mlens_profile_state_run(&st, s, 16, 16, false) == 0, "%s", st.err);
	ck_assert(st.hw.host_compute);
	ck_assert_double_eq(st.pred.n_real, 1024);
	ck_assert_int_eq(st.pred.n_real_by, MLENS_PERF_LIMIT_STEP);
	ck_assert_int_eq(mlens_sched_token_cap(s), 1024);
	{
		json_t *j = mlens_profile_state_json(&st), *ls = json_object_get(j, "layer_seconds");
		const char *bind = json_string_value(json_object_get(j, "binding"));
		ck_assert_str_eq(json_string_value(json_object_get(j, "n_real_bound")), "largest-step");
		ck_assert_str_eq(json_string_value(json_object_get(j, "token_cap_source")), "n_real");
		ck_assert(json_is_true(json_object_get(j, "host_compute")));
		ck_assert_msg(!strstr(bind, "gpu") && !strstr(bind, "pcie"), "binding %s", bind);
		ck_assert_ptr_nonnull(json_object_get(ls, bind));
		ck_assert_ptr_nonnull(json_object_get(ls, "cpu"));
		ck_assert_ptr_nonnull(json_object_get(ls, "cpu-chain"));
		ck_assert_ptr_null(json_object_get(ls, "gpu"));
		ck_assert_ptr_null(json_object_get(ls, "pcie-h2d"));
		ck_assert_ptr_null(json_object_get(ls, "pcie-d2h"));
		json_decref(j);
	}

	/* pinned: measured and predicted, the cap left alone */
	mlens_sched_set_token_cap(s, 77);
	state_setup(&st, m, &be, 40000, 77);
	ck_assert_msg(mlens_profile_state_run(&st, s, 16, 16, false) == 0, "%s", st.err);
	ck_assert_int_eq((int)st.pred.n_real, want);
	ck_assert_int_eq(mlens_sched_token_cap(s), 77);
	ck_assert_int_eq(st.token_cap, 77);

	/* hybrid: residency searched, the budget decides */
	state_setup(&st, m, &be, 40000, 0);
	st.hybrid = true;
	ck_assert_msg(mlens_profile_state_run(&st, s, 16, 16, false) == 0, "%s", st.err);
	ck_assert(st.pred.policy.resident_experts >= 0 && st.pred.policy.resident_experts <= st.pm.experts);
	ck_assert_int_eq(mlens_sched_token_cap(s), mlens_perf_token_cap(&st.pred) < 1024 ?
			 mlens_perf_token_cap(&st.pred) : 1024);

	/* on a backend of its own (hybrid mode in mlensd): made, used, given
	 * back; the engine's backend holds what it held before */
	{
		size_t before = MLENS_BACKEND_HAS(be.ops, mem_used) ? be.ops->mem_used(be.ctx) : 0;
		state_setup(&st, m, &be, 40000, 0);
		st.hybrid = true;
		st.own_backend = true;
		st.own_opts.n_threads = 1;
		st.opts.group = 100;	/* GA/GB as the pipeline calls them */
		st.opts.moe_chunk = 16;
		ck_assert_msg(mlens_profile_state_run(&st, s, 16, 16, false) == 0, "%s", st.err);
		ck_assert(st.prof.ga.b + st.prof.gb.b > 0);
		ck_assert(st.pred.n_real > 0);
		ck_assert_uint_eq(MLENS_BACKEND_HAS(be.ops, mem_used) ? be.ops->mem_used(be.ctx) : 0,
				  before);
	}

	mlens_sched_destroy(s);
	mlens_engine_destroy(e);
	mlens_backend_destroy(&be);
	mlens_test_model_free(m);
}
END_TEST

int main(void)
{
	Suite *su = suite_create("profiler");
	TCase *tc = tcase_create("core");
	SRunner *sr;
	int failed;
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, cpu_profile_sane);
	tcase_add_test(tc, cache_roundtrip_and_key);
	tcase_add_test(tc, device_memory_under_copy);
	tcase_add_test(tc, state_sets_cap);
	tcase_add_test(tc, workload_follow_window);
	suite_add_tcase(su, tc);
	sr = srunner_create(su);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
