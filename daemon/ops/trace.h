/* Step traces: an in-memory recorder of timed spans for the next
 * few steps, written as Chrome trace-event JSON (chrome://tracing,
 * Perfetto) when the steps are done. Spans are {track, name, t0, t1} in
 * seconds on CLOCK_MONOTONIC (mlens_now(), or a backend's timer_read);
 * each track becomes one row of the timeline. Memory is bounded: past
 * max_spans the recorder drops spans and says so in the file and the
 * result. Not thread-safe: the thread that drives the steps owns it (the
 * worker); every call takes a NULL recorder and then does nothing. */
#ifndef MLENS_TRACE_H
#define MLENS_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>
#include "kernels/backend.h"

struct mlens_trace;

#define MLENS_TRACE_MAX_STEPS 64		/* steps one trace may cover */
#define MLENS_TRACE_MAX_TRACKS 16		/* distinct track names */
#define MLENS_TRACE_NAME 48			/* span names are cut to this (with NUL) */
#define MLENS_TRACE_SPANS_DEFAULT (1u << 18)	/* about 20 MiB of spans */

/* What a finished (or cancelled) trace did. */
struct mlens_trace_result {
	int rc;			/* 0, or -errno: the file could not be written, or -ECANCELED */
	char path[4096];	/* "" when armed without a file */
	json_t *trace;		/* armed without a file: the trace; the done function owns it */
	uint32_t steps;		/* steps recorded */
	uint64_t spans;		/* spans written (step spans included) */
	uint64_t dropped;	/* spans refused past max_spans */
	char err[512];		/* the reason when rc != 0 */
};

/* Called once per arm, on the recording thread, when the trace is written,
 * fails or is cancelled; res is valid during the call only. */
typedef void (*mlens_trace_done_fn)(void *arg, const struct mlens_trace_result *res);

/* max_spans: 0 = MLENS_TRACE_SPANS_DEFAULT. Nothing is allocated until armed. */
int mlens_trace_create(struct mlens_trace **out, uint32_t max_spans);
/* Cancels an armed trace (done gets -ECANCELED) and frees it. */
void mlens_trace_destroy(struct mlens_trace *tr);

/* Record the next steps steps (1..MLENS_TRACE_MAX_STEPS) and write them to
 * path, an absolute path of a file that must not exist yet: it is created
 * now (mode 0644), so that a bad path is refused here, with err saying
 * why. With path NULL nothing is written: the done function gets the
 * trace as JSON (res->trace), to send it on. -EBUSY while armed, -EINVAL
 * bad steps or a relative path, else the -errno of creating the file.
 * done (may be NULL) runs when finished. */
int mlens_trace_arm(struct mlens_trace *tr, int steps, const char *path, mlens_trace_done_fn done,
		    void *arg, char *err, size_t errlen);
/* Stop an armed trace without writing it: the file is removed and done
 * gets -ECANCELED. Nothing happens when not armed. */
void mlens_trace_cancel(struct mlens_trace *tr);
bool mlens_trace_armed(const struct mlens_trace *tr);
/* True between step_begin and step_end of a recorded step: callers test
 * this before taking times they only need for the trace. */
bool mlens_trace_on(const struct mlens_trace *tr);

/* A step starts (t: its start on CLOCK_MONOTONIC). Does nothing unless armed. */
void mlens_trace_step_begin(struct mlens_trace *tr, double t);
/* One span of the current step; -EINVAL (not kept) for a missing track or
 * name, t1 < t0 or a time that is not finite, -ENOSPC past max_spans or
 * MLENS_TRACE_MAX_TRACKS tracks (counted as dropped), 0 when kept or when
 * no step is being recorded. */
int mlens_trace_span(struct mlens_trace *tr, const char *track, const char *name, double t0, double t1);
/* The same with a printf-formatted name ("GA l%d g%d"). */
int mlens_trace_spanf(struct mlens_trace *tr, const char *track, double t0, double t1, const char *fmt, ...)
	__attribute__((format(printf, 5, 6)));
/* The step ends at t, with what it carried (for the step span's args).
 * When it was the last armed step the file is written, done is called and
 * the recorder disarms: returns 1 then (0 otherwise), or the -errno of
 * writing (done has it too). */
int mlens_trace_step_end(struct mlens_trace *tr, double t, int tokens, int seqs);

/* ==== step timing through a backend's timing marks ====
 * Busy time of each queue of one step, and its spans for a trace: the
 * caller brackets the work it enqueues with begin/end (marks on the same
 * queue as the work), and after the step's work is done (the host waited
 * for it) finish reads the marks. Works the same on the CPU backend, whose
 * marks are the host clock. A backend without timing marks gives 0 busy
 * time and no spans. One step at a time; the thread that drives the
 * backend. */

/* A step's spans take two marks each in one half of the backend's timer
 * ids, the steps alternating halves, so that a copy still running at a
 * step's end is read in the next step (its half is not re-based then). */
#define MLENS_STEP_TIMER_SPANS (MLENS_BACKEND_TIMER_HALF / 2 - 1)
/* The trace's name of a copy carried from a step that recorded no trace. */
#define MLENS_STEP_TIMER_CARRIED "copy from the last step"

struct mlens_step_timer_span {
	int queue;
	const char *track;		/* a string that outlives the step */
	char name[MLENS_TRACE_NAME];	/* only filled while tracing */
	bool ended;
	bool pending;			/* set by finish: a copy still running then */
	int id;				/* its first timer mark (the second is id + 1) */
	double t0, t1;			/* set by finish */
};

struct mlens_step_timer {
	const struct mlens_backend *be;
	struct mlens_trace *tr;		/* the step's trace, NULL when not tracing */
	struct mlens_step_timer_span *spans;
	int n;				/* spans begun this step */
	/* the last step's copies still running at its end: read by this
	 * step's finish (pending again if still running then: left out) */
	struct mlens_step_timer_span *carry;
	int n_carry;
	int half;			/* of the timer ids this step marks in */
	int rc;				/* the first mark that failed this step */
	bool on;			/* the backend has timing marks */
	bool finished;			/* this step's spans are read */
};

int mlens_step_timer_init(struct mlens_step_timer *st, const struct mlens_backend *be);
void mlens_step_timer_fini(struct mlens_step_timer *st);
/* A step starts: mark 0 on queue 0 ties the backend's clock to the host's
 * (on CUDA it waits for queue 0 once). tr: the recorder (may be NULL or
 * not recording; names are formatted only while it records). */
int mlens_step_timer_start(struct mlens_step_timer *st, struct mlens_trace *tr);
/* Work on queue (0 compute, 1 copy) starts here: the span's index (for
 * end), or -ENOSPC past MLENS_STEP_TIMER_SPANS spans, or a mark's -errno
 * (then the step's busy time is unknown: finish returns the error). */
int mlens_step_timer_begin(struct mlens_step_timer *st, int queue, const char *track, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
int mlens_step_timer_end(struct mlens_step_timer *st, int span);
/* After the step's work is done: busy[0] and busy[1] get the seconds each
 * queue was busy (the union of its spans), and the spans go to the trace
 * (tracks as given, times on CLOCK_MONOTONIC). A span of the copy queue
 * that has not finished yet (the hybrid pipeline's prefetch of the next
 * step's first layers, which runs on past the step's end) is left out of
 * both (pending) and counts in the next step's, with the next step's
 * trace, once it is done; one still running at the next step's finish is
 * left out for good (a trace shows the part of it inside the step, if
 * any). 0; -EAGAIN when a compute-queue mark is not reached
 * yet (the caller did not wait for its queue); -EINVAL for a span begun
 * and not ended; a mark's -errno from this step. busy is 0 on error. */
int mlens_step_timer_finish(struct mlens_step_timer *st, double busy[2]);
/* After a finish that returned 0: the seconds the spans of one track were
 * busy (their union), e.g. "h2d" apart from "d2h" on the same queue. */
double mlens_step_timer_busy(const struct mlens_step_timer *st, const char *track);

#endif
