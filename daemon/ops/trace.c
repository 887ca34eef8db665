/* Step traces: the span buffer (grown by doubling up to its cap), the
 * track table, and the Chrome trace-event JSON writer (jansson). A file
 * is created when armed, so that a bad path fails at once, and filled
 * when the last armed step ends; without one the JSON goes to the done
 * function. Also the step timer: busy time per queue
 * from a backend's timing marks. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "daemon/ops/trace.h"

struct span {
	double t0, t1;
	uint8_t track;
	char name[MLENS_TRACE_NAME];
};

struct step {
	double t0, t1;
	int tokens, seqs;
};

struct mlens_trace {
	uint32_t max_spans;
	/* armed state */
	bool armed, in_step;
	int steps_want, steps_done;
	int fd;
	char path[4096];
	mlens_trace_done_fn done;
	void *done_arg;
	/* what is recorded */
	struct span *spans;
	uint32_t n_spans, cap_spans;
	uint64_t dropped;
	struct step steps[MLENS_TRACE_MAX_STEPS];
	char tracks[MLENS_TRACE_MAX_TRACKS][24];
	int n_tracks;
};

int mlens_trace_create(struct mlens_trace **out, uint32_t max_spans)
{
	struct mlens_trace *tr = calloc(1, sizeof(*tr));
	if (!tr)
		return -ENOMEM;
	tr->max_spans = max_spans ? max_spans : MLENS_TRACE_SPANS_DEFAULT;
	tr->fd = -1;
	*out = tr;
	return 0;
}

/* Back to idle: the spans' memory goes, so that an idle recorder costs nothing. */
static void reset(struct mlens_trace *tr)
{
	if (tr->fd >= 0)
		close(tr->fd);
	tr->fd = -1;
	free(tr->spans);
	tr->spans = NULL;
	tr->n_spans = tr->cap_spans = 0;
	tr->dropped = 0;
	tr->n_tracks = 0;
	tr->armed = tr->in_step = false;
	tr->steps_want = tr->steps_done = 0;
	tr->done = NULL;
	tr->done_arg = NULL;
}

/* trace: the JSON of a trace armed without a file (given to done). */
static void finish(struct mlens_trace *tr, int rc, const char *why, json_t *trace)
{
	struct mlens_trace_result res;
	mlens_trace_done_fn done = tr->done;
	void *arg = tr->done_arg;
	memset(&res, 0, sizeof(res));
	res.rc = rc;
	snprintf(res.path, sizeof(res.path), "%s", tr->path);
	res.steps = (uint32_t)tr->steps_done;
	res.spans = rc ? 0 : tr->n_spans + (uint64_t)tr->steps_done;
	res.dropped = tr->dropped;
	res.trace = trace;
	snprintf(res.err, sizeof(res.err), "%s", why ? why : "");
	if (rc && tr->path[0])
		unlink(tr->path);
	reset(tr);
	if (done)
		done(arg, &res);
	else
		json_decref(trace);
}

void mlens_trace_destroy(struct mlens_trace *tr)
{
	if (!tr)
		return;
	mlens_trace_cancel(tr);
	reset(tr);
	free(tr);
}

int mlens_trace_arm(struct mlens_trace *tr, int steps, const char *path, mlens_trace_done_fn done,
		    void *arg, char *err, size_t errlen)
{
	int fd;
	if (!tr)
		return -EINVAL;
	if (tr->armed) {
		snprintf(err, errlen, "a trace of %d steps%s%s is being recorded; wait for it", tr->steps_want,
			 tr->path[0] ? " to " : "", tr->path);
		return -EBUSY;
	}
	if (steps < 1 || steps > MLENS_TRACE_MAX_STEPS) {
		snprintf(err, errlen, "steps must be in [1, %d]", MLENS_TRACE_MAX_STEPS);
		return -EINVAL;
	}
	if (!path) {
		reset(tr);
		tr->path[0] = 0;
		goto armed;
	}
	if (path[0] != '/' || strlen(path) >= sizeof(tr->path)) {
		snprintf(err, errlen, "the trace file must be an absolute path (the daemon writes it, from its own "
			 "working directory)");
		return -EINVAL;
	}
	/* O_EXCL and O_NOFOLLOW: the daemon writes where it is told, so it
	 * writes only a new file, never over one or through a link */
	fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
	if (fd < 0) {
		int e = errno;
		snprintf(err, errlen, "cannot create the trace file %s: %s%s", path, strerror(e),
			 e == EEXIST ? " (name a new file)" : "");
		return -e;
	}
	reset(tr);
	tr->fd = fd;
	snprintf(tr->path, sizeof(tr->path), "%s", path);
armed:
	tr->armed = true;
	tr->steps_want = steps;
	tr->done = done;
	tr->done_arg = arg;
	return 0;
}

void mlens_trace_cancel(struct mlens_trace *tr)
{
	if (tr && tr->armed)
		finish(tr, -ECANCELED, "the trace was cancelled before its steps ran", NULL);
}

bool mlens_trace_armed(const struct mlens_trace *tr)
{
	return tr && tr->armed;
}

bool mlens_trace_on(const struct mlens_trace *tr)
{
	return tr && tr->in_step;
}

void mlens_trace_step_begin(struct mlens_trace *tr, double t)
{
	if (!tr || !tr->armed || tr->in_step)
		return;
	tr->in_step = true;
	tr->steps[tr->steps_done].t0 = t;
}

static int track_of(struct mlens_trace *tr, const char *track)
{
	for (int i = 0; i < tr->n_tracks; i++)
		if (!strcmp(tr->tracks[i], track))
			return i;
	if (tr->n_tracks == MLENS_TRACE_MAX_TRACKS)
		return -ENOSPC;
	snprintf(tr->tracks[tr->n_tracks], sizeof(tr->tracks[0]), "%s", track);
	return tr->n_tracks++;
}

int mlens_trace_span(struct mlens_trace *tr, const char *track, const char *name, double t0, double t1)
{
	struct span *s;
	int k;
	if (!tr || !tr->in_step)
		return 0;
	if (!track || !*track || !name || !isfinite(t0) || !isfinite(t1) || t1 < t0)
		return -EINVAL;
	if (tr->n_spans >= tr->max_spans || (k = track_of(tr, track)) < 0) {
		tr->dropped++;
		return -ENOSPC;
	}
	if (tr->n_spans == tr->cap_spans) {
		uint32_t cap = tr->cap_spans ? tr->cap_spans * 2 : 4096;
		struct span *p;
		if (cap > tr->max_spans || cap < tr->cap_spans)
			cap = tr->max_spans;
		p = realloc(tr->spans, (size_t)cap * sizeof(*p));
		if (!p) {
			tr->dropped++;
			return -ENOMEM;
		}
		tr->spans = p;
		tr->cap_spans = cap;
	}
	s = &tr->spans[tr->n_spans++];
	s->t0 = t0;
	s->t1 = t1;
	s->track = (uint8_t)k;
	snprintf(s->name, sizeof(s->name), "%s", name);
	return 0;
}

int mlens_trace_spanf(struct mlens_trace *tr, const char *track, double t0, double t1, const char *fmt, ...)
{
	char name[MLENS_TRACE_NAME];
	va_list ap;
	if (!tr || !tr->in_step)
		return 0;
	va_start(ap, fmt);
	vsnprintf(name, sizeof(name), fmt, ap);
	va_end(ap);
	return mlens_trace_span(tr, track, name, t0, t1);
}

/* ==== the JSON ==== */

static json_t *event_x(const char *name, double t0, double t1, double base, int tid)
{
	return json_pack("{s:s,s:s,s:f,s:f,s:i,s:i}", "name", name, "ph", "X", "ts", (t0 - base) * 1e6, "dur",
			 (t1 - t0) * 1e6, "pid", 1, "tid", tid);
}

static json_t *meta(const char *what, int tid, const char *key, json_t *value)
{
	return json_pack("{s:s,s:s,s:i,s:i,s:{s:o}}", "name", what, "ph", "M", "pid", 1, "tid", tid, "args", key,
			 value);
}

/* Track 0 of the timeline is the steps; recorded track i is tid i + 1. */
static json_t *trace_json(const struct mlens_trace *tr)
{
	json_t *root = json_object(), *ev = json_array();
	double base = tr->steps[0].t0;
	char name[64];
	if (!root || !ev)
		goto fail;
	json_object_set_new(root, "traceEvents", ev);
	if (json_array_append_new(ev, meta("process_name", 0, "name", json_string("mlensd"))) ||
	    json_array_append_new(ev, meta("thread_name", 0, "name", json_string("step"))) ||
	    json_array_append_new(ev, meta("thread_sort_index", 0, "sort_index", json_integer(0))))
		goto fail;
	for (int i = 0; i < tr->n_tracks; i++)
		if (json_array_append_new(ev, meta("thread_name", i + 1, "name", json_string(tr->tracks[i]))) ||
		    json_array_append_new(ev, meta("thread_sort_index", i + 1, "sort_index", json_integer(i + 1))))
			goto fail;
	for (int i = 0; i < tr->steps_done; i++) {
		const struct step *s = &tr->steps[i];
		json_t *e;
		snprintf(name, sizeof(name), "step %d", i + 1);
		e = event_x(name, s->t0, s->t1, base, 0);
		if (!e || json_object_set_new(e, "args", json_pack("{s:i,s:i}", "tokens", s->tokens, "seqs", s->seqs)) ||
		    json_array_append_new(ev, e))
			goto fail;
	}
	for (uint32_t i = 0; i < tr->n_spans; i++) {
		const struct span *s = &tr->spans[i];
		if (json_array_append_new(ev, event_x(s->name, s->t0, s->t1, base, s->track + 1)))
			goto fail;
	}
	json_object_set_new(root, "displayTimeUnit", json_string("ms"));
	json_object_set_new(root, "otherData",
			    json_pack("{s:s,s:f,s:i,s:I,s:I}", "clock", "CLOCK_MONOTONIC", "t0_seconds", base, "steps",
				      tr->steps_done, "spans", (json_int_t)tr->n_spans, "dropped_spans",
				      (json_int_t)tr->dropped));
	return root;
fail:
	json_decref(root);
	return NULL;
}

static int write_file(struct mlens_trace *tr, char *why, size_t whylen)
{
	json_t *root = trace_json(tr);
	FILE *f;
	int rc = 0;
	if (!root) {
		snprintf(why, whylen, "out of memory building the trace of %u spans", tr->n_spans);
		return -ENOMEM;
	}
	f = fdopen(tr->fd, "w");
	if (!f) {
		rc = -errno;
		snprintf(why, whylen, "cannot write the trace file %.400s: %s", tr->path, strerror(-rc));
		json_decref(root);
		return rc;
	}
	tr->fd = -1;	/* f owns it now */
	errno = 0;
	if (json_dumpf(root, f, JSON_COMPACT) || fputc('\n', f) == EOF)
		rc = errno ? -errno : -EIO;
	if (fclose(f) && !rc)
		rc = errno ? -errno : -EIO;
	if (rc)
		snprintf(why, whylen, "cannot write the trace file %.400s: %s", tr->path, strerror(-rc));
	json_decref(root);
	return rc;
}

int mlens_trace_step_end(struct mlens_trace *tr, double t, int tokens, int seqs)
{
	struct step *s;
	char why[512] = "";
	int rc;
	if (!tr || !tr->in_step)
		return 0;
	s = &tr->steps[tr->steps_done++];
	s->t1 = t >= s->t0 ? t : s->t0;
	s->tokens = tokens;
	s->seqs = seqs;
	tr->in_step = false;
	if (tr->steps_done < tr->steps_want)
		return 0;
	if (tr->fd < 0) {
		json_t *root = trace_json(tr);
		rc = root ? 0 : -ENOMEM;
		if (!root)
			snprintf(why, sizeof(why), "out of memory building the trace of %u spans", tr->n_spans);
		finish(tr, rc, why, root);
		return rc ? rc : 1;
	}
	rc = write_file(tr, why, sizeof(why));
	finish(tr, rc, why, NULL);
	return rc ? rc : 1;
}

/* ==== step timing ==== */

int mlens_step_timer_init(struct mlens_step_timer *st, const struct mlens_backend *be)
{
	memset(st, 0, sizeof(*st));
	st->be = be;
	st->on = MLENS_BACKEND_HAS(be->ops, timer_mark) && MLENS_BACKEND_HAS(be->ops, timer_read);
	if (!st->on)
		return 0;
	st->half = 1;	/* the first step marks in half 0 */
	st->spans = calloc(MLENS_STEP_TIMER_SPANS, sizeof(*st->spans));
	st->carry = calloc(MLENS_STEP_TIMER_SPANS, sizeof(*st->carry));
	if (!st->spans || !st->carry) {
		mlens_step_timer_fini(st);
		return -ENOMEM;
	}
	return 0;
}

void mlens_step_timer_fini(struct mlens_step_timer *st)
{
	free(st->spans);
	free(st->carry);
	st->spans = st->carry = NULL;
}

int mlens_step_timer_start(struct mlens_step_timer *st, struct mlens_trace *tr)
{
	/* the last step's copies that ran on past its end: their half is
	 * left alone this step, so the next finish reads them */
	st->n_carry = 0;
	for (int i = 0; st->finished && i < st->n; i++)
		if (st->spans[i].pending)
			st->carry[st->n_carry++] = st->spans[i];
	st->n = 0;
	st->finished = false;
	st->rc = 0;
	st->tr = mlens_trace_on(tr) ? tr : NULL;
	if (!st->on)
		return 0;
	st->half ^= 1;
	st->rc = st->be->ops->timer_mark(st->be->ctx, 0, st->half * MLENS_BACKEND_TIMER_HALF);
	return st->rc;
}

int mlens_step_timer_begin(struct mlens_step_timer *st, int queue, const char *track, const char *fmt, ...)
{
	struct mlens_step_timer_span *sp;
	int i, rc;
	if (!st->on)
		return 0;
	if (st->n >= MLENS_STEP_TIMER_SPANS)
		return -ENOSPC;
	i = st->n;
	sp = &st->spans[i];
	sp->queue = queue;
	sp->track = track;
	sp->name[0] = 0;
	sp->ended = false;
	sp->id = st->half * MLENS_BACKEND_TIMER_HALF + 1 + 2 * i;
	if (st->tr) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(sp->name, sizeof(sp->name), fmt, ap);
		va_end(ap);
	}
	rc = st->be->ops->timer_mark(st->be->ctx, queue, sp->id);
	if (rc) {
		if (!st->rc)
			st->rc = rc;
		return rc;
	}
	st->n++;
	return i;
}

int mlens_step_timer_end(struct mlens_step_timer *st, int span)
{
	int rc;
	if (!st->on)
		return 0;
	if (span < 0 || span >= st->n)
		return -EINVAL;
	rc = st->be->ops->timer_mark(st->be->ctx, st->spans[span].queue, st->spans[span].id + 1);
	if (rc && !st->rc)
		st->rc = rc;
	st->spans[span].ended = !rc;
	return rc;
}

struct interval {
	double t0, t1;
};

static int by_start(const void *a, const void *b)
{
	const struct interval *x = a, *y = b;
	return x->t0 < y->t0 ? -1 : x->t0 > y->t0;
}

/* Seconds covered by the union of iv[0..n) (sorted here). */
static double union_seconds(struct interval *iv, int n)
{
	double sum = 0, a, b;
	if (!n)
		return 0;
	qsort(iv, (size_t)n, sizeof(*iv), by_start);
	a = iv[0].t0;
	b = iv[0].t1;
	for (int i = 1; i < n; i++) {
		if (iv[i].t0 > b) {
			sum += b - a;
			a = iv[i].t0;
		}
		if (iv[i].t1 > b)
			b = iv[i].t1;
	}
	return sum + b - a;
}

int mlens_step_timer_finish(struct mlens_step_timer *st, double busy[2])
{
	struct interval *iv[2] = { NULL, NULL };
	int cnt[2] = { 0, 0 }, rc = st->rc;
	double t_start = 0;
	busy[0] = busy[1] = 0;
	if (!st->on || rc || !st->n)
		return rc;
	iv[0] = malloc((size_t)st->n * sizeof(*iv[0]));
	iv[1] = malloc((size_t)(st->n + st->n_carry) * sizeof(*iv[1]));
	if (!iv[0] || !iv[1]) {
		rc = -ENOMEM;
		goto out;
	}
	/* the last step's copies that ran on: this step's busy and trace
	 * from its start (the step's first mark) once done, left out when
	 * still running */
	if (st->n_carry &&
	    (rc = st->be->ops->timer_read(st->be->ctx, st->half * MLENS_BACKEND_TIMER_HALF, &t_start)))
		goto out;
	for (int i = 0; i < st->n_carry; i++) {
		struct mlens_step_timer_span *sp = &st->carry[i];
		double t0, t1;
		sp->pending = st->be->ops->timer_read(st->be->ctx, sp->id, &t0) ||
			      st->be->ops->timer_read(st->be->ctx, sp->id + 1, &t1);
		if (sp->pending)
			continue;
		sp->t0 = t0 < t_start ? t_start : t0;
		sp->t1 = t1 < sp->t0 ? sp->t0 : t1;
		iv[1][cnt[1]].t0 = sp->t0;
		iv[1][cnt[1]++].t1 = sp->t1;
		/* in the trace only the part inside this step; a copy begun
		 * while no trace recorded has no name of its own */
		if (st->tr && sp->t1 > sp->t0)
			mlens_trace_span(st->tr, sp->track, sp->name[0] ? sp->name : MLENS_STEP_TIMER_CARRIED,
					 sp->t0, sp->t1);
	}
	for (int i = 0; i < st->n; i++) {
		const struct mlens_step_timer_span *sp = &st->spans[i];
		double t0, t1;
		int q = sp->queue == 1;
		if (!sp->ended) {
			rc = -EINVAL;
			goto out;
		}
		st->spans[i].pending = false;
		if ((rc = st->be->ops->timer_read(st->be->ctx, sp->id, &t0)) ||
		    (rc = st->be->ops->timer_read(st->be->ctx, sp->id + 1, &t1))) {
			if (rc != -EAGAIN || !q)
				goto out;
			st->spans[i].pending = true;	/* runs on into the next step */
			rc = 0;
			continue;
		}
		if (t1 < t0)
			t1 = t0;
		st->spans[i].t0 = t0;
		st->spans[i].t1 = t1;
		iv[q][cnt[q]].t0 = t0;
		iv[q][cnt[q]++].t1 = t1;
		if (st->tr)
			mlens_trace_span(st->tr, sp->track, sp->name, t0, t1);
	}
	busy[0] = union_seconds(iv[0], cnt[0]);
	busy[1] = union_seconds(iv[1], cnt[1]);
	st->finished = true;
out:
	free(iv[0]);
	free(iv[1]);
	return rc;
}

double mlens_step_timer_busy(const struct mlens_step_timer *st, const char *track)
{
	struct interval *iv;
	double busy;
	int n = 0;
	if (!st->on || !st->finished || !(st->n + st->n_carry))
		return 0;
	iv = malloc((size_t)(st->n + st->n_carry) * sizeof(*iv));
	if (!iv)
		return 0;
	for (int i = 0; i < st->n; i++)
		if (!st->spans[i].pending && !strcmp(st->spans[i].track, track)) {
			iv[n].t0 = st->spans[i].t0;
			iv[n++].t1 = st->spans[i].t1;
		}
	for (int i = 0; i < st->n_carry; i++)
		if (!st->carry[i].pending && !strcmp(st->carry[i].track, track)) {
			iv[n].t0 = st->carry[i].t0;
			iv[n++].t1 = st->carry[i].t1;
		}
	busy = union_seconds(iv, n);
	free(iv);
	return busy;
}
