/* Description: the step trace recorder: spans of two steps go in, the
 * Chrome trace-event JSON that comes out (parsed back with jansson) holds
 * them with their tracks, microsecond times and step events; spans outside
 * an armed step are ignored; the span cap drops and reports; bad spans,
 * relative, missing and existing paths are refused with a clear message;
 * cancel removes the file; armed without a file, the JSON goes to the
 * done function. The CPU backend's timing marks are the host
 * clock, and unknown marks are refused; the step timer's busy time is the
 * union of each queue's spans, which go to the trace. The hybrid pipeline's busy
 * times and KV bytes reach the stats JSON and /metrics. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <event2/buffer.h>
#include "daemon/ops/stats.h"
#include "daemon/ops/trace.h"
#include "kernels/backend.h"

static char dir[] = "/tmp/check_trace.XXXXXX";

static void setup(void)
{
	ck_assert_ptr_nonnull(mkdtemp(dir));
}

static void teardown(void)
{
	char cmd[64];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	ck_assert_int_eq(system(cmd), 0);
	strcpy(dir, "/tmp/check_trace.XXXXXX");
}

struct done_rec {
	int calls;
	struct mlens_trace_result res;
};

static void on_done(void *arg, const struct mlens_trace_result *res)
{
	struct done_rec *d = arg;
	d->calls++;
	d->res = *res;
}

/* The X event named name on the track named track, or NULL. */
static json_t *find_event(json_t *ev, const char *track, const char *name)
{
	size_t i;
	json_t *e;
	json_int_t tid = -1;
	json_array_foreach(ev, i, e) {
		if (!strcmp(json_string_value(json_object_get(e, "ph")), "M") &&
		    !strcmp(json_string_value(json_object_get(e, "name")), "thread_name") &&
		    !strcmp(json_string_value(json_object_get(json_object_get(e, "args"), "name")), track))
			tid = json_integer_value(json_object_get(e, "tid"));
	}
	if (tid < 0)
		return NULL;
	json_array_foreach(ev, i, e) {
		if (!strcmp(json_string_value(json_object_get(e, "ph")), "X") &&
		    json_integer_value(json_object_get(e, "tid")) == tid &&
		    !strcmp(json_string_value(json_object_get(e, "name")), name))
			return e;
	}
	return NULL;
}

static int count_ph(json_t *ev, const char *ph)
{
	size_t i;
	json_t *e;
	int n = 0;
	json_array_foreach(ev, i, e)
		n += !strcmp(json_string_value(json_object_get(e, "ph")), ph);
	return n;
}

START_TEST(spans_to_json)
{
	struct mlens_trace *tr;
	struct done_rec d = { 0 };
	char path[128], err[256];
	json_t *root, *ev, *e;
	json_error_t je;
	snprintf(path, sizeof(path), "%s/t.json", dir);
	ck_assert_int_eq(mlens_trace_create(&tr, 0), 0);
	ck_assert(!mlens_trace_armed(tr));
	/* not armed: spans are ignored, steps do nothing */
	mlens_trace_step_begin(tr, 1.0);
	ck_assert(!mlens_trace_on(tr));
	ck_assert_int_eq(mlens_trace_span(tr, "gpu", "ignored", 1.0, 2.0), 0);
	ck_assert_int_eq(mlens_trace_step_end(tr, 2.0, 1, 1), 0);

	ck_assert_int_eq(mlens_trace_arm(tr, 2, path, on_done, &d, err, sizeof(err)), 0);
	ck_assert(mlens_trace_armed(tr));
	ck_assert_int_eq(access(path, F_OK), 0);	/* created when armed */
	ck_assert_int_eq(mlens_trace_arm(tr, 1, path, NULL, NULL, err, sizeof(err)), -EBUSY);
	/* armed but between steps: still ignored */
	ck_assert(!mlens_trace_on(tr));
	ck_assert_int_eq(mlens_trace_span(tr, "gpu", "between", 99.0, 100.0), 0);

	mlens_trace_step_begin(tr, 100.0);
	ck_assert(mlens_trace_on(tr));
	ck_assert_int_eq(mlens_trace_span(tr, "gpu", "GA l0 g0", 100.001, 100.003), 0);
	ck_assert_int_eq(mlens_trace_span(tr, "h2d", "COPY l1 p0", 100.0015, 100.0045), 0);
	ck_assert_int_eq(mlens_trace_spanf(tr, "cpu-attn", 100.003, 100.004, "C l%d g%d", 0, 1), 0);
	ck_assert_int_eq(mlens_trace_span(tr, "gpu", "backwards", 100.5, 100.4), -EINVAL);
	ck_assert_int_eq(mlens_trace_span(tr, "gpu", "nan", NAN, 100.4), -EINVAL);
	ck_assert_int_eq(mlens_trace_span(tr, "", "no track", 100.0, 100.1), -EINVAL);
	ck_assert_int_eq(mlens_trace_step_end(tr, 100.005, 40, 3), 0);
	ck_assert_int_eq(d.calls, 0);
	mlens_trace_step_begin(tr, 100.010);
	ck_assert_int_eq(mlens_trace_span(tr, "gpu", "GA l0 g0", 100.011, 100.012), 0);
	ck_assert_int_eq(mlens_trace_step_end(tr, 100.020, 3, 3), 1);
	ck_assert(!mlens_trace_armed(tr));
	ck_assert_int_eq(d.calls, 1);
	ck_assert_int_eq(d.res.rc, 0);
	ck_assert_str_eq(d.res.path, path);
	ck_assert_int_eq(d.res.steps, 2);
	ck_assert_int_eq(d.res.spans, 4 + 2);
	ck_assert_int_eq(d.res.dropped, 0);

	root = json_load_file(path, 0, &je);
	ck_assert_msg(root != NULL, "%s: %s", path, je.text);
	ev = json_object_get(root, "traceEvents");
	ck_assert(json_is_array(ev));
	ck_assert_int_eq(count_ph(ev, "X"), 6);
	/* the first step's GPU span: times in microseconds from the first step */
	e = find_event(ev, "gpu", "GA l0 g0");
	ck_assert_ptr_nonnull(e);
	ck_assert_double_eq_tol(json_real_value(json_object_get(e, "ts")), 1000.0, 0.01);
	ck_assert_double_eq_tol(json_real_value(json_object_get(e, "dur")), 2000.0, 0.01);
	ck_assert_int_eq(json_integer_value(json_object_get(e, "pid")), 1);
	e = find_event(ev, "h2d", "COPY l1 p0");
	ck_assert_ptr_nonnull(e);
	ck_assert_double_eq_tol(json_real_value(json_object_get(e, "ts")), 1500.0, 0.01);
	ck_assert_double_eq_tol(json_real_value(json_object_get(e, "dur")), 3000.0, 0.01);
	ck_assert_ptr_nonnull(find_event(ev, "cpu-attn", "C l0 g1"));
	ck_assert_ptr_null(find_event(ev, "gpu", "between"));
	ck_assert_ptr_null(find_event(ev, "gpu", "ignored"));
	ck_assert_ptr_null(find_event(ev, "gpu", "backwards"));
	/* steps are events of their own track, with what they carried */
	e = find_event(ev, "step", "step 2");
	ck_assert_ptr_nonnull(e);
	ck_assert_double_eq_tol(json_real_value(json_object_get(e, "ts")), 10000.0, 0.01);
	ck_assert_double_eq_tol(json_real_value(json_object_get(e, "dur")), 10000.0, 0.01);
	ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(e, "args"), "tokens")), 3);
	e = find_event(ev, "step", "step 1");
	ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(e, "args"), "tokens")), 40);
	ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(e, "args"), "seqs")), 3);
	e = json_object_get(root, "otherData");
	ck_assert_double_eq_tol(json_real_value(json_object_get(e, "t0_seconds")), 100.0, 1e-9);
	ck_assert_int_eq(json_integer_value(json_object_get(e, "dropped_spans")), 0);
	json_decref(root);

	/* it re-arms; a second file needs a new name */
	ck_assert_int_eq(mlens_trace_arm(tr, 1, path, NULL, NULL, err, sizeof(err)), -EEXIST);
	ck_assert_msg(strstr(err, path) && strstr(err, "name a new file"), "%s", err);
	mlens_trace_destroy(tr);
}
END_TEST

START_TEST(cap_drops)
{
	struct mlens_trace *tr;
	struct done_rec d = { 0 };
	char path[128], err[256];
	json_t *root;
	int kept = 0, refused = 0;
	snprintf(path, sizeof(path), "%s/cap.json", dir);
	ck_assert_int_eq(mlens_trace_create(&tr, 5), 0);
	ck_assert_int_eq(mlens_trace_arm(tr, 1, path, on_done, &d, err, sizeof(err)), 0);
	mlens_trace_step_begin(tr, 10.0);
	for (int i = 0; i < 8; i++) {
		int rc = mlens_trace_spanf(tr, "gpu", 10.0 + i * 0.001, 10.0 + i * 0.001 + 0.0005, "s%d", i);
		if (rc == 0)
			kept++;
		else if (rc == -ENOSPC)
			refused++;
	}
	ck_assert_int_eq(kept, 5);
	ck_assert_int_eq(refused, 3);
	ck_assert_int_eq(mlens_trace_step_end(tr, 10.01, 1, 1), 1);
	ck_assert_int_eq(d.res.rc, 0);
	ck_assert_int_eq(d.res.dropped, 3);
	ck_assert_int_eq(d.res.spans, 5 + 1);
	root = json_load_file(path, 0, NULL);
	ck_assert_ptr_nonnull(root);
	ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(root, "otherData"), "dropped_spans")), 3);
	ck_assert_int_eq(count_ph(json_object_get(root, "traceEvents"), "X"), 6);
	json_decref(root);

	/* more tracks than the table holds: the extra ones are dropped */
	snprintf(path, sizeof(path), "%s/tracks.json", dir);
	mlens_trace_destroy(tr);
	ck_assert_int_eq(mlens_trace_create(&tr, 0), 0);
	ck_assert_int_eq(mlens_trace_arm(tr, 1, path, NULL, NULL, err, sizeof(err)), 0);
	mlens_trace_step_begin(tr, 1.0);
	for (int i = 0; i < MLENS_TRACE_MAX_TRACKS; i++) {
		char t[16];
		snprintf(t, sizeof(t), "t%d", i);
		ck_assert_int_eq(mlens_trace_span(tr, t, "x", 1.0, 1.5), 0);
	}
	ck_assert_int_eq(mlens_trace_span(tr, "one-too-many", "x", 1.0, 1.5), -ENOSPC);
	ck_assert_int_eq(mlens_trace_span(tr, "t0", "again", 1.0, 1.5), 0);
	ck_assert_int_eq(mlens_trace_step_end(tr, 2.0, 1, 1), 1);
	mlens_trace_destroy(tr);
}
END_TEST

START_TEST(bad_paths)
{
	struct mlens_trace *tr;
	struct done_rec d = { 0 };
	char path[128], err[256];
	ck_assert_int_eq(mlens_trace_create(&tr, 0), 0);
	ck_assert_int_eq(mlens_trace_arm(tr, 2, "trace.json", NULL, NULL, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "absolute"), "%s", err);
	snprintf(path, sizeof(path), "%s/no/such/dir/t.json", dir);
	ck_assert_int_eq(mlens_trace_arm(tr, 2, path, NULL, NULL, err, sizeof(err)), -ENOENT);
	ck_assert_msg(strstr(err, path) && strstr(err, "No such file"), "%s", err);
	snprintf(path, sizeof(path), "%s/t.json", dir);
	ck_assert_int_eq(mlens_trace_arm(tr, 0, path, NULL, NULL, err, sizeof(err)), -EINVAL);
	ck_assert_int_eq(mlens_trace_arm(tr, MLENS_TRACE_MAX_STEPS + 1, path, NULL, NULL, err, sizeof(err)), -EINVAL);
	ck_assert(!mlens_trace_armed(tr));
	/* cancel: the half-made file goes, done hears -ECANCELED */
	ck_assert_int_eq(mlens_trace_arm(tr, 3, path, on_done, &d, err, sizeof(err)), 0);
	mlens_trace_step_begin(tr, 1.0);
	mlens_trace_span(tr, "gpu", "x", 1.0, 1.1);
	mlens_trace_step_end(tr, 1.2, 1, 1);
	mlens_trace_cancel(tr);
	ck_assert_int_eq(d.calls, 1);
	ck_assert_int_eq(d.res.rc, -ECANCELED);
	ck_assert_int_eq(access(path, F_OK), -1);
	/* destroy of an armed recorder cancels too */
	ck_assert_int_eq(mlens_trace_arm(tr, 3, path, on_done, &d, err, sizeof(err)), 0);
	mlens_trace_destroy(tr);
	ck_assert_int_eq(d.calls, 2);
	ck_assert_int_eq(access(path, F_OK), -1);
	/* NULL recorder: every call is harmless */
	mlens_trace_step_begin(NULL, 1.0);
	ck_assert_int_eq(mlens_trace_span(NULL, "gpu", "x", 1.0, 2.0), 0);
	ck_assert_int_eq(mlens_trace_step_end(NULL, 2.0, 1, 1), 0);
	ck_assert(!mlens_trace_on(NULL));
}
END_TEST

static double host_clock(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

START_TEST(cpu_timer_marks)
{
	struct mlens_backend be;
	double a, b, t0, t1, t2;
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert(MLENS_BACKEND_HAS(be.ops, timer_mark));
	ck_assert(MLENS_BACKEND_HAS(be.ops, timer_read));
	ck_assert_int_eq(be.ops->timer_read(be.ctx, 5, &a), -ENOENT);
	t0 = host_clock();
	ck_assert_int_eq(be.ops->timer_mark(be.ctx, 0, 0), 0);
	t1 = host_clock();
	ck_assert_int_eq(be.ops->timer_mark(be.ctx, 1, MLENS_BACKEND_TIMERS - 1), 0);
	t2 = host_clock();
	ck_assert_int_eq(be.ops->timer_read(be.ctx, 0, &a), 0);
	ck_assert_int_eq(be.ops->timer_read(be.ctx, MLENS_BACKEND_TIMERS - 1, &b), 0);
	/* the host's CLOCK_MONOTONIC at the mark */
	ck_assert(a >= t0 && a <= t1);
	ck_assert(b >= t1 && b <= t2);
	ck_assert_int_eq(be.ops->timer_read(be.ctx, 5, &a), -ENOENT);
	ck_assert_int_eq(be.ops->timer_mark(be.ctx, 0, MLENS_BACKEND_TIMERS), -EINVAL);
	ck_assert_int_eq(be.ops->timer_mark(be.ctx, 2, 1), -EINVAL);
	ck_assert_int_eq(be.ops->timer_read(be.ctx, -1, &a), -EINVAL);
	mlens_backend_destroy(&be);
}
END_TEST

static void sleep_s(double s)
{
	struct timespec ts = { 0, (long)(s * 1e9) };
	while (nanosleep(&ts, &ts))
		;
}

/* A span of secs on queue, begun and ended; its index. */
static int timed_span(struct mlens_step_timer *st, int queue, const char *track, const char *name,
		      double secs)
{
	int i = mlens_step_timer_begin(st, queue, track, "%s", name);
	sleep_s(secs);
	ck_assert_int_eq(mlens_step_timer_end(st, i), 0);
	return i;
}

/* timer_read of the CPU backend, except that the marks of span pend_span
 * are not reached yet (a copy still running when the step ends) */
static struct mlens_backend_ops pend_ops;
static int (*cpu_timer_read)(void *ctx, int id, double *seconds);
static int pend_span;
static int pend_read(void *ctx, int id, double *seconds)
{
	if (id == 1 + 2 * pend_span || id == 2 + 2 * pend_span)
		return -EAGAIN;
	return cpu_timer_read(ctx, id, seconds);
}

START_TEST(step_timer_busy)
{
	struct mlens_backend be, bare;
	struct mlens_backend_ops small;
	struct mlens_step_timer st;
	struct mlens_trace *tr;
	char path[128], err[256];
	double busy[2], t_start, t_end;
	int a, b, c;
	json_t *root, *ev, *e;
	snprintf(path, sizeof(path), "%s/timer.json", dir);
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_int_eq(mlens_trace_create(&tr, 0), 0);
	ck_assert_int_eq(mlens_trace_arm(tr, 1, path, NULL, NULL, err, sizeof(err)), 0);
	ck_assert_int_eq(mlens_step_timer_init(&st, &be), 0);
	t_start = host_clock();
	mlens_trace_step_begin(tr, t_start);
	ck_assert_int_eq(mlens_step_timer_start(&st, tr), 0);
	/* queue 0: a 20 ms span with a 10 ms span inside it, then 10 ms apart
	 * another of 10 ms: busy 30 ms; queue 1: one span of 10 ms */
	a = mlens_step_timer_begin(&st, 0, "gpu", "GA l%d g%d", 3, 1);
	ck_assert_int_eq(a, 0);
	sleep_s(0.005);
	b = mlens_step_timer_begin(&st, 0, "gpu", "inner");
	c = mlens_step_timer_begin(&st, 1, "h2d", "COPY l%d", 4);
	sleep_s(0.010);
	ck_assert_int_eq(mlens_step_timer_end(&st, b), 0);
	ck_assert_int_eq(mlens_step_timer_end(&st, c), 0);
	sleep_s(0.005);
	ck_assert_int_eq(mlens_step_timer_end(&st, a), 0);
	sleep_s(0.010);
	a = mlens_step_timer_begin(&st, 0, "gpu", "GB l%d", 3);
	sleep_s(0.010);
	ck_assert_int_eq(mlens_step_timer_end(&st, a), 0);
	ck_assert_int_eq(mlens_step_timer_end(&st, 7), -EINVAL);
	ck_assert_int_eq(mlens_step_timer_finish(&st, busy), 0);
	printf("step timer: queue 0 busy %.4f s (30 ms asked), queue 1 %.4f s (10 ms)\n", busy[0], busy[1]);
	/* sleeps overrun, never underrun: bounds from below tight, from above loose */
	ck_assert(busy[0] >= 0.030 && busy[0] < 0.030 + 0.025);
	ck_assert(busy[1] >= 0.010 && busy[1] < 0.010 + 0.010);
	/* per track: the same here, one track per queue */
	ck_assert_double_eq(mlens_step_timer_busy(&st, "gpu"), busy[0]);
	ck_assert_double_eq(mlens_step_timer_busy(&st, "h2d"), busy[1]);
	ck_assert_double_eq(mlens_step_timer_busy(&st, "d2h"), 0.0);
	t_end = host_clock();
	ck_assert_int_eq(mlens_trace_step_end(tr, t_end, 1, 1), 1);
	root = json_load_file(path, 0, NULL);
	ck_assert_ptr_nonnull(root);
	ev = json_object_get(root, "traceEvents");
	ck_assert_int_eq(count_ph(ev, "X"), 5);
	e = find_event(ev, "gpu", "GA l3 g1");
	ck_assert_ptr_nonnull(e);
	ck_assert(json_real_value(json_object_get(e, "dur")) >= 20000.0);
	ck_assert(json_real_value(json_object_get(e, "ts")) >= 0.0);
	ck_assert_ptr_nonnull(find_event(ev, "h2d", "COPY l4"));
	ck_assert_ptr_nonnull(find_event(ev, "gpu", "GB l3"));
	json_decref(root);

	/* not tracing: busy time all the same; a span left open is an error */
	ck_assert_int_eq(mlens_step_timer_start(&st, tr), 0);
	timed_span(&st, 1, "h2d", "x", 0.002);
	timed_span(&st, 1, "d2h", "y", 0.003);
	ck_assert_int_eq(mlens_step_timer_finish(&st, busy), 0);
	ck_assert(busy[1] >= 0.005 && busy[0] == 0);
	/* one after the other on queue 1: the tracks split its busy time */
	ck_assert(mlens_step_timer_busy(&st, "h2d") >= 0.002);
	ck_assert(mlens_step_timer_busy(&st, "d2h") >= 0.003);
	ck_assert_double_eq_tol(mlens_step_timer_busy(&st, "h2d") + mlens_step_timer_busy(&st, "d2h"), busy[1], 1e-9);
	ck_assert_int_eq(mlens_step_timer_start(&st, NULL), 0);
	mlens_step_timer_begin(&st, 0, "gpu", "open");
	ck_assert_int_eq(mlens_step_timer_finish(&st, busy), -EINVAL);
	ck_assert(busy[0] == 0 && busy[1] == 0);
	ck_assert_double_eq(mlens_step_timer_busy(&st, "gpu"), 0.0);
	mlens_step_timer_fini(&st);

	/* a backend whose table ends before the timing marks: no busy time */
	small = *be.ops;
	small.size = offsetof(struct mlens_backend_ops, timer_mark);
	bare.ops = &small;
	bare.ctx = be.ctx;
	ck_assert_int_eq(mlens_step_timer_init(&st, &bare), 0);
	ck_assert_int_eq(mlens_step_timer_start(&st, NULL), 0);
	ck_assert_int_eq(mlens_step_timer_begin(&st, 0, "gpu", "x"), 0);
	ck_assert_int_eq(mlens_step_timer_end(&st, 0), 0);
	ck_assert_int_eq(mlens_step_timer_finish(&st, busy), 0);
	ck_assert(busy[0] == 0 && busy[1] == 0);
	mlens_step_timer_fini(&st);

	/* a copy still running at the step's end (the pipeline's prefetch of
	 * the next step's layers) counts in no busy time; the rest does. The
	 * same on the compute queue is an error: its work is done by then */
	pend_ops = *be.ops;
	cpu_timer_read = be.ops->timer_read;
	pend_ops.timer_read = pend_read;
	bare.ops = &pend_ops;
	bare.ctx = be.ctx;
	ck_assert_int_eq(mlens_step_timer_init(&st, &bare), 0);
	ck_assert_int_eq(mlens_step_timer_start(&st, NULL), 0);
	a = timed_span(&st, 1, "h2d", "x", 0.002);
	b = timed_span(&st, 1, "h2d", "prefetch", 0.100);
	c = timed_span(&st, 0, "gpu", "GB", 0.002);
	pend_span = b;
	ck_assert_int_eq(mlens_step_timer_finish(&st, busy), 0);
	ck_assert_msg(busy[1] >= 0.002 && busy[1] < 0.015, "copy queue busy %g s", busy[1]);
	ck_assert(busy[0] >= 0.002);
	ck_assert_double_eq(mlens_step_timer_busy(&st, "h2d"), busy[1]);
	ck_assert(st.spans[b].pending && !st.spans[a].pending);
	/* the next step (the other half of the marks) reads it once done,
	 * from its own start on (not its 100 ms before): the copy ends 10 ms
	 * in (its end mark taken again then), then a 2 ms copy of its own */
	pend_span = -1;
	ck_assert_int_eq(mlens_step_timer_start(&st, NULL), 0);
	ck_assert_int_eq(st.n_carry, 1);
	ck_assert_int_eq(st.carry[0].id, 1 + 2 * b);
	sleep_s(0.010);
	ck_assert_int_eq(be.ops->timer_mark(be.ctx, 1, st.carry[0].id + 1), 0);
	a = timed_span(&st, 1, "h2d", "y", 0.002);
	ck_assert_int_eq(st.spans[a].id, MLENS_BACKEND_TIMER_HALF + 1 + 2 * a);
	ck_assert_int_eq(mlens_step_timer_finish(&st, busy), 0);
	ck_assert_msg(busy[1] >= 0.012 && busy[1] < 0.08, "copy queue busy %g s", busy[1]);
	ck_assert_double_eq(mlens_step_timer_busy(&st, "h2d"), busy[1]);
	/* one still running at that next finish is left out for good */
	ck_assert_int_eq(mlens_step_timer_start(&st, NULL), 0);
	a = timed_span(&st, 1, "h2d", "x", 0.002);
	b = timed_span(&st, 1, "h2d", "prefetch", 0.002);
	pend_span = b;
	ck_assert_int_eq(mlens_step_timer_finish(&st, busy), 0);
	ck_assert_int_eq(mlens_step_timer_start(&st, NULL), 0);
	ck_assert_int_eq(st.n_carry, 1);
	c = timed_span(&st, 1, "h2d", "z", 0.002);
	ck_assert_int_eq(mlens_step_timer_finish(&st, busy), 0);
	ck_assert(st.carry[0].pending);
	ck_assert_double_eq(mlens_step_timer_busy(&st, "h2d"), busy[1]);
	ck_assert_int_eq(mlens_step_timer_start(&st, NULL), 0);
	ck_assert_int_eq(st.n_carry, 0);
	c = timed_span(&st, 0, "gpu", "GB", 0.002);
	pend_span = c;
	ck_assert_int_eq(mlens_step_timer_finish(&st, busy), -EAGAIN);
	ck_assert(busy[0] == 0 && busy[1] == 0);
	mlens_step_timer_fini(&st);

	/* a traced step after an untraced one whose copy ran on: the copy
	 * shows in the trace, under a name of its own, when it ends inside the
	 * traced step, and not at all (no empty, zero-length span: the trace
	 * of the H200 once had 24) when it ended before the step began */
	for (int inside = 0; inside < 2; inside++) {
		char p2[160];
		snprintf(p2, sizeof(p2), "%s/carry%d.json", dir, inside);
		ck_assert_int_eq(mlens_step_timer_init(&st, &bare), 0);
		ck_assert_int_eq(mlens_step_timer_start(&st, NULL), 0);	/* half 0, not traced */
		a = timed_span(&st, 1, "h2d", "x", 0.001);
		b = timed_span(&st, 1, "h2d", "prefetch", 0.001);
		pend_span = b;
		ck_assert_int_eq(mlens_step_timer_finish(&st, busy), 0);
		pend_span = -1;
		ck_assert_int_eq(mlens_trace_arm(tr, 1, p2, NULL, NULL, err, sizeof(err)), 0);
		mlens_trace_step_begin(tr, host_clock());
		ck_assert_int_eq(mlens_step_timer_start(&st, tr), 0);
		ck_assert_int_eq(st.n_carry, 1);
		if (inside) {
			sleep_s(0.005);
			ck_assert_int_eq(be.ops->timer_mark(be.ctx, 1, st.carry[0].id + 1), 0);
		}
		c = timed_span(&st, 1, "h2d", "y", 0.001);
		ck_assert_int_eq(mlens_step_timer_finish(&st, busy), 0);
		ck_assert_int_eq(mlens_trace_step_end(tr, host_clock(), 1, 1), 1);
		root = json_load_file(p2, 0, NULL);
		ck_assert_ptr_nonnull(root);
		ev = json_object_get(root, "traceEvents");
		ck_assert_ptr_nonnull(find_event(ev, "h2d", "y"));
		ck_assert_ptr_null(find_event(ev, "h2d", ""));
		e = find_event(ev, "h2d", MLENS_STEP_TIMER_CARRIED);
		if (inside) {
			ck_assert_ptr_nonnull(e);
			ck_assert(json_real_value(json_object_get(e, "dur")) >= 5000.0);
			ck_assert_int_eq(count_ph(ev, "X"), 3);	/* step, carried, y */
		} else {
			ck_assert_ptr_null(e);
			ck_assert_int_eq(count_ph(ev, "X"), 2);
		}
		json_decref(root);
		mlens_step_timer_fini(&st);
	}
	mlens_trace_destroy(tr);
	mlens_backend_destroy(&be);
}
END_TEST

START_TEST(pipeline_stats_exposed)
{
	struct mlens_daemon_info info;
	struct mlens_worker_snapshot snap;
	struct evbuffer *b = evbuffer_new();
	json_t *o;
	char *text;
	memset(&info, 0, sizeof(info));
	memset(&snap, 0, sizeof(snap));
	info.started = mlens_now();
	snap.sched.hybrid = true;
	snap.sched.gpu_busy_seconds = 12.5;
	snap.sched.h2d_busy_seconds = 7.25;
	snap.sched.last_step_gpu_busy_seconds = 0.125;
	snap.sched.last_step_h2d_busy_seconds = 0.0625;
	snap.sched.kv_read_bytes = 123456789012ull;
	snap.sched.kv_read_blocks = 987654;
	snap.sched.kv_read_runs = 4321;
	snap.kv_room_taken = 77;
	o = mlens_stats_json(&info, &snap);
	ck_assert_double_eq(json_real_value(json_object_get(o, "gpu_busy_seconds_total")), 12.5);
	ck_assert_double_eq(json_real_value(json_object_get(o, "h2d_busy_seconds_total")), 7.25);
	ck_assert_double_eq(json_real_value(json_object_get(o, "last_step_gpu_busy_seconds")), 0.125);
	ck_assert_double_eq(json_real_value(json_object_get(o, "last_step_h2d_busy_seconds")), 0.0625);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "kv_read_bytes_total")), 123456789012ll);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "kv_read_blocks_total")), 987654);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "kv_read_block_runs_total")), 4321);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "kv_room_taken_total")), 77);
	json_decref(o);
	mlens_stats_prometheus(&info, &snap, b);
	ck_assert_int_eq(evbuffer_add(b, "", 1), 0);
	text = (char *)evbuffer_pullup(b, -1);
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_gpu_busy_seconds_total 12.5\n"));
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_h2d_busy_seconds_total 7.25\n"));
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_kv_read_bytes_total 123456789012\n"));
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_kv_read_blocks_total 987654\n"));
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_kv_read_block_runs_total 4321\n"));
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_kv_room_taken_total 77\n"));
	ck_assert_ptr_nonnull(strstr(text, "# TYPE mlens_gpu_busy_seconds_total counter\n"));
	evbuffer_free(b);
	/* not hybrid: none of them */
	b = evbuffer_new();
	snap.sched.hybrid = false;
	o = mlens_stats_json(&info, &snap);
	ck_assert_ptr_null(json_object_get(o, "gpu_busy_seconds_total"));
	json_decref(o);
	mlens_stats_prometheus(&info, &snap, b);
	ck_assert_int_eq(evbuffer_add(b, "", 1), 0);
	ck_assert_ptr_null(strstr((char *)evbuffer_pullup(b, -1), "mlens_gpu_busy_seconds_total"));
	evbuffer_free(b);
}
END_TEST

/* The resident experts in the stats: the rule, the hit counts and ratio,
 * each layer's set and swaps, in JSON and Prometheus text. */
START_TEST(residency_stats_exposed)
{
	struct mlens_daemon_info info;
	struct mlens_worker_snapshot snap;
	struct evbuffer *b = evbuffer_new();
	json_t *o, *sets;
	char *text;
	memset(&info, 0, sizeof(info));
	memset(&snap, 0, sizeof(snap));
	info.started = mlens_now();
	snap.sched.hybrid = true;
	snap.sched.residency_routing = true;
	snap.sched.expert_rows = 400;
	snap.sched.expert_resident_rows = 300;
	snap.sched.expert_swaps = 3;
	snap.sched.res_layers = 2;
	snap.sched.res_experts = 130;
	snap.sched.res_set[0][0] = 1ull << 2 | 1ull << 5;
	snap.sched.res_set[1][2] = 1ull << 1;	/* expert 129 */
	snap.sched.res_swaps[0] = 1;
	snap.sched.res_swaps[1] = 2;
	o = mlens_stats_json(&info, &snap);
	ck_assert_str_eq(json_string_value(json_object_get(o, "expert_residency")), "routing");
	ck_assert_int_eq(json_integer_value(json_object_get(o, "expert_routed_rows_total")), 400);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "expert_resident_rows_total")), 300);
	ck_assert_double_eq(json_real_value(json_object_get(o, "expert_resident_hit_ratio")), 0.75);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "expert_swaps_total")), 3);
	sets = json_object_get(o, "expert_resident_sets");
	ck_assert_int_eq(json_array_size(sets), 2);
	ck_assert_int_eq(json_array_size(json_array_get(sets, 0)), 2);
	ck_assert_int_eq(json_integer_value(json_array_get(json_array_get(sets, 0), 0)), 2);
	ck_assert_int_eq(json_integer_value(json_array_get(json_array_get(sets, 0), 1)), 5);
	ck_assert_int_eq(json_array_size(json_array_get(sets, 1)), 1);
	ck_assert_int_eq(json_integer_value(json_array_get(json_array_get(sets, 1), 0)), 129);
	ck_assert_int_eq(json_integer_value(json_array_get(json_object_get(o, "expert_swaps_by_layer"), 1)), 2);
	json_decref(o);
	mlens_stats_prometheus(&info, &snap, b);
	ck_assert_int_eq(evbuffer_add(b, "", 1), 0);
	text = (char *)evbuffer_pullup(b, -1);
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_expert_routed_rows_total 400\n"));
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_expert_resident_rows_total 300\n"));
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_expert_resident_hit_ratio 0.75\n"));
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_expert_swaps_total{layer=\"0\"} 1\n"));
	ck_assert_ptr_nonnull(strstr(text, "\nmlens_expert_swaps_total{layer=\"1\"} 2\n"));
	ck_assert_ptr_nonnull(strstr(text, "# TYPE mlens_expert_resident_hit_ratio gauge\n"));
	evbuffer_free(b);
	/* before any routed row: ratio 0, static rule */
	snap.sched.residency_routing = false;
	snap.sched.expert_rows = snap.sched.expert_resident_rows = 0;
	o = mlens_stats_json(&info, &snap);
	ck_assert_str_eq(json_string_value(json_object_get(o, "expert_residency")), "static");
	ck_assert_double_eq(json_real_value(json_object_get(o, "expert_resident_hit_ratio")), 0);
	json_decref(o);
}
END_TEST

/* Armed without a file: nothing is written, done gets the JSON; a
 * cancel gives none. */
START_TEST(trace_to_caller)
{
	struct mlens_trace *tr;
	struct done_rec d = { 0 };
	char err[256];
	json_t *ev;
	ck_assert_int_eq(mlens_trace_create(&tr, 0), 0);
	ck_assert_int_eq(mlens_trace_arm(tr, 1, NULL, on_done, &d, err, sizeof(err)), 0);
	ck_assert_int_eq(mlens_trace_arm(tr, 1, NULL, NULL, NULL, err, sizeof(err)), -EBUSY);
	ck_assert_ptr_nonnull(strstr(err, "a trace of 1 steps is being recorded"));
	mlens_trace_step_begin(tr, 5.0);
	ck_assert_int_eq(mlens_trace_span(tr, "cpu", "layer 0", 5.001, 5.002), 0);
	ck_assert_int_eq(mlens_trace_step_end(tr, 5.003, 7, 1), 1);
	ck_assert_int_eq(d.calls, 1);
	ck_assert_int_eq(d.res.rc, 0);
	ck_assert_str_eq(d.res.path, "");
	ck_assert_int_eq(d.res.spans, 2);
	ck_assert_ptr_nonnull(d.res.trace);
	ev = json_object_get(d.res.trace, "traceEvents");
	ck_assert_int_eq(count_ph(ev, "X"), 2);
	ck_assert_ptr_nonnull(find_event(ev, "cpu", "layer 0"));
	ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(d.res.trace, "otherData"), "steps")), 1);
	json_decref(d.res.trace);

	ck_assert_int_eq(mlens_trace_arm(tr, 2, NULL, on_done, &d, err, sizeof(err)), 0);
	mlens_trace_cancel(tr);
	ck_assert_int_eq(d.calls, 2);
	ck_assert_int_eq(d.res.rc, -ECANCELED);
	ck_assert_ptr_null(d.res.trace);
	/* no done function: the trace is freed (ASan/valgrind see a leak otherwise) */
	ck_assert_int_eq(mlens_trace_arm(tr, 1, NULL, NULL, NULL, err, sizeof(err)), 0);
	mlens_trace_step_begin(tr, 6.0);
	ck_assert_int_eq(mlens_trace_step_end(tr, 6.1, 1, 1), 1);
	mlens_trace_destroy(tr);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("trace");
	TCase *tc = tcase_create("trace");
	SRunner *sr;
	int failed;
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, spans_to_json);
	tcase_add_test(tc, trace_to_caller);
	tcase_add_test(tc, cap_drops);
	tcase_add_test(tc, bad_paths);
	tcase_add_test(tc, cpu_timer_marks);
	tcase_add_test(tc, step_timer_busy);
	tcase_add_test(tc, pipeline_stats_exposed);
	tcase_add_test(tc, residency_stats_exposed);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
