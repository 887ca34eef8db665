/* Description: the op time account (daemon/exec/op_time.h) on the CPU
 * backend's timing marks (its clock): ops bracketed by its probe come out
 * as seconds, FLOPs and calls per op after the step timer's finish, inside
 * their step's span, beside the timer's own spans; a step whose marks
 * failed, and the ops past a step's share of marks, are counted dropped;
 * a traced step shows each op by name on the "gpu-op" track; the names
 * are the one list (distinct, label-safe); a backend without marks has no
 * account. No time is compared with a speed: only > 0 and containment. */
#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <jansson.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "daemon/exec/op_time.h"
#include "kernels/backend.h"
#include "tests/check_common.h"

static double host_clock(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_s(double s)
{
	struct timespec ts = { 0, (long)(s * 1e9) };
	nanosleep(&ts, NULL);
}

/* One op through the probe, a short sleep inside it. */
static void run_op(const struct mlens_layer_probe *p, enum mlens_layer_op op, double flops)
{
	p->begin(p->arg);
	sleep_s(0.0005);
	ck_assert_int_eq(p->end(p->arg, op, flops), 0);
}

struct fixture {
	struct mlens_backend be;
	struct mlens_step_timer st;
	struct mlens_op_time *ot;
	const struct mlens_layer_probe *p;
};

static void fx_init(struct fixture *f)
{
	ck_assert_int_eq(mlens_backend_cpu_create(&f->be, NULL), 0);
	ck_assert_int_eq(mlens_step_timer_init(&f->st, &f->be), 0);
	ck_assert_int_eq(mlens_op_time_create(&f->ot, &f->st), 0);
	f->p = mlens_op_time_probe(f->ot);
}

static void fx_fini(struct fixture *f)
{
	mlens_op_time_destroy(f->ot);
	mlens_step_timer_fini(&f->st);
	mlens_backend_destroy(&f->be);
}

static void step_start(struct fixture *f, struct mlens_trace *tr)
{
	ck_assert_int_eq(mlens_step_timer_start(&f->st, tr), 0);
	mlens_op_time_step_start(f->ot);
}

static int step_finish(struct fixture *f)
{
	double busy[2];
	int rc = mlens_step_timer_finish(&f->st, busy);
	mlens_op_time_step_done(f->ot, rc);
	return rc;
}

START_TEST(marks_in_seconds_out)
{
	struct fixture f;
	struct mlens_op_time_totals t;
	double sum = 0;
	int cmd;

	fx_init(&f);
	/* step 1: a command span of the timer's own around the ops (the
	 * pipeline's GA), the ops inside */
	step_start(&f, NULL);
	cmd = mlens_step_timer_begin(&f.st, 0, "gpu", "GA");
	ck_assert_int_ge(cmd, 0);
	run_op(f.p, MLENS_LAYER_OP_NORM, 0);
	run_op(f.p, MLENS_LAYER_OP_QKV, 100);
	run_op(f.p, MLENS_LAYER_OP_QKV, 50);
	ck_assert_int_eq(mlens_step_timer_end(&f.st, cmd), 0);
	run_op(f.p, MLENS_LAYER_OP_MOE, 1000);
	ck_assert_int_eq(step_finish(&f), 0);
	/* step 2: one op */
	step_start(&f, NULL);
	run_op(f.p, MLENS_LAYER_OP_QKV, 7);
	ck_assert_int_eq(step_finish(&f), 0);

	mlens_op_time_get(f.ot, &t);
	ck_assert_uint_eq(t.steps, 2);
	ck_assert_uint_eq(t.dropped, 0);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_NORM], 1);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_QKV], 3);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_MOE], 1);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_ROPE], 0);
	ck_assert_double_eq(t.flops[MLENS_LAYER_OP_QKV], 157);
	ck_assert_double_eq(t.flops[MLENS_LAYER_OP_MOE], 1000);
	ck_assert_double_eq(t.flops[MLENS_LAYER_OP_NORM], 0);
	ck_assert(t.seconds[MLENS_LAYER_OP_NORM] > 0);
	ck_assert(t.seconds[MLENS_LAYER_OP_QKV] > 0);
	ck_assert(t.seconds[MLENS_LAYER_OP_MOE] > 0);
	ck_assert_double_eq(t.seconds[MLENS_LAYER_OP_ROPE], 0);
	for (int i = 0; i < MLENS_LAYER_OP_N; i++)
		sum += t.seconds[i];
	/* the ops lie inside their steps' spans, with time between them */
	ck_assert(sum <= t.span_s);
	ck_assert(t.span_s > 0);
	fx_fini(&f);
}
END_TEST

START_TEST(dropped_ops)
{
	struct fixture f;
	struct mlens_op_time_totals t;

	fx_init(&f);
	/* a step whose timer failed: its ops dropped, not counted */
	step_start(&f, NULL);
	run_op(f.p, MLENS_LAYER_OP_QKV, 1);
	run_op(f.p, MLENS_LAYER_OP_WO, 1);
	mlens_op_time_step_done(f.ot, -EIO);
	mlens_op_time_get(f.ot, &t);
	ck_assert_uint_eq(t.steps, 0);
	ck_assert_uint_eq(t.dropped, 2);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_QKV], 0);
	ck_assert_double_eq(t.span_s, 0);

	/* past a step's share of marks: the rest left out, the timer keeps
	 * room for its own spans */
	step_start(&f, NULL);
	for (int i = 0; i < MLENS_OP_TIME_MAX_OPS + 3; i++) {
		f.p->begin(f.p->arg);
		ck_assert_int_eq(f.p->end(f.p->arg, MLENS_LAYER_OP_ROPE, 0), 0);
	}
	ck_assert_int_ge(mlens_step_timer_begin(&f.st, 0, "gpu", "after"), 0);
	ck_assert_int_eq(mlens_step_timer_end(&f.st, MLENS_OP_TIME_MAX_OPS), 0);
	ck_assert_int_eq(step_finish(&f), 0);
	mlens_op_time_get(f.ot, &t);
	ck_assert_uint_eq(t.steps, 1);
	ck_assert_uint_eq(t.calls[MLENS_LAYER_OP_ROPE], MLENS_OP_TIME_MAX_OPS);
	ck_assert_uint_eq(t.dropped, 2 + 3);
	fx_fini(&f);
}
END_TEST

/* s equals the string value v (NULL when absent). */
static bool str_is(json_t *v, const char *s)
{
	return json_string_value(v) && !strcmp(json_string_value(v), s);
}

START_TEST(traced_op_names)
{
	struct fixture f;
	struct mlens_trace *tr;
	char path[] = "/tmp/check_op_time.XXXXXX", file[64], err[256];
	json_t *root, *ev, *e;
	size_t i;
	json_int_t tid = -1;
	int moe = 0, qkv = 0;

	fx_init(&f);
	ck_assert_ptr_nonnull(mkdtemp(path));
	snprintf(file, sizeof(file), "%s/t.json", path);
	ck_assert_int_eq(mlens_trace_create(&tr, 0), 0);
	ck_assert_int_eq(mlens_trace_arm(tr, 1, file, NULL, NULL, err, sizeof(err)), 0);
	mlens_trace_step_begin(tr, host_clock());
	step_start(&f, tr);
	run_op(f.p, MLENS_LAYER_OP_QKV, 1);
	run_op(f.p, MLENS_LAYER_OP_MOE, 1);
	ck_assert_int_eq(step_finish(&f), 0);
	ck_assert_int_eq(mlens_trace_step_end(tr, host_clock(), 1, 1), 1);
	root = json_load_file(file, 0, NULL);
	ck_assert_ptr_nonnull(root);
	ev = json_object_get(root, "traceEvents");
	json_array_foreach(ev, i, e)
		if (str_is(json_object_get(e, "ph"), "M") && str_is(json_object_get(e, "name"), "thread_name") &&
		    str_is(json_object_get(json_object_get(e, "args"), "name"), "gpu-op"))
			tid = json_integer_value(json_object_get(e, "tid"));
	ck_assert_int_ge(tid, 0);
	json_array_foreach(ev, i, e) {
		if (json_integer_value(json_object_get(e, "tid")) != tid ||
		    !str_is(json_object_get(e, "ph"), "X"))
			continue;
		moe += str_is(json_object_get(e, "name"), "moe");
		qkv += str_is(json_object_get(e, "name"), "qkv_gemm");
	}
	ck_assert_int_eq(moe, 1);
	ck_assert_int_eq(qkv, 1);
	json_decref(root);
	mlens_trace_destroy(tr);
	unlink(file);
	rmdir(path);
	fx_fini(&f);
}
END_TEST

START_TEST(one_list_of_names)
{
	for (int i = 0; i < MLENS_LAYER_OP_N; i++) {
		const char *n = mlens_layer_op_name((enum mlens_layer_op)i);
		ck_assert_ptr_nonnull(n);
		ck_assert_uint_gt(strlen(n), 0);
		/* a metric label and a JSON key as they are */
		ck_assert_uint_eq(strspn(n, "abcdefghijklmnopqrstuvwxyz_"), strlen(n));
		for (int j = 0; j < i; j++)
			ck_assert_str_ne(n, mlens_layer_op_name((enum mlens_layer_op)j));
	}
	ck_assert_ptr_null(mlens_layer_op_name(MLENS_LAYER_OP_N));
	ck_assert_str_eq(mlens_layer_op_name(MLENS_LAYER_OP_MOE), "moe");
}
END_TEST

START_TEST(no_marks_no_account)
{
	struct mlens_step_timer st = { 0 };	/* a backend without timing marks */
	struct mlens_op_time *ot = (struct mlens_op_time *)&st;
	ck_assert_int_eq(mlens_op_time_create(&ot, &st), -ENOTSUP);
	ck_assert_ptr_null(ot);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("op_time");
	TCase *tc = tcase_create("op_time");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, marks_in_seconds_out);
	tcase_add_test(tc, dropped_ops);
	tcase_add_test(tc, traced_op_names);
	tcase_add_test(tc, one_list_of_names);
	tcase_add_test(tc, no_marks_no_account);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
