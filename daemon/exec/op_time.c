/* The op time account: a layer probe that spans each op with two timing
 * marks of the step's timer, and the spans read into per-op totals once
 * the step's timer has finished. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/exec/op_time.h"

/* An op marked this step: its span of the timer, its kind and FLOPs. */
struct op_mark {
	int span;
	enum mlens_layer_op op;
	double flops;
};

struct mlens_op_time {
	struct mlens_step_timer *timer;
	pthread_mutex_t *mu;		/* around the timer's use, or NULL */
	struct mlens_layer_probe probe;
	struct op_mark *marks;		/* [MLENS_OP_TIME_MAX_OPS] */
	int n;				/* marked this step */
	int cur;			/* the open op's span, -1: none (not marked) */
	uint64_t unmarked;		/* ops of this step left out */
	pthread_mutex_t tot_mu;		/* totals: read by the stats' snapshot */
	struct mlens_op_time_totals tot;
};

static void lock(struct mlens_op_time *ot)
{
	if (ot->mu)
		pthread_mutex_lock(ot->mu);
}

static void unlock(struct mlens_op_time *ot)
{
	if (ot->mu)
		pthread_mutex_unlock(ot->mu);
}

static void op_begin(void *arg)
{
	struct mlens_op_time *ot = arg;
	int sp = -1;

	if (ot->n < MLENS_OP_TIME_MAX_OPS) {
		lock(ot);
		sp = mlens_step_timer_begin(ot->timer, 0, "gpu-op", "op");
		unlock(ot);
	}
	ot->cur = sp;
}

/* Never fails the step: a mark that fails drops the step's times (the
 * timer's finish says so), not its work. */
static int op_end(void *arg, enum mlens_layer_op op, double flops)
{
	struct mlens_op_time *ot = arg;
	int sp = ot->cur;

	ot->cur = -1;
	if (sp < 0) {
		ot->unmarked++;
		return 0;
	}
	lock(ot);
	if (!mlens_step_timer_end(ot->timer, sp) && ot->timer->tr)
		snprintf(ot->timer->spans[sp].name, sizeof(ot->timer->spans[sp].name), "%s",
			 mlens_layer_op_name(op));
	unlock(ot);
	ot->marks[ot->n++] = (struct op_mark){ sp, op, flops };
	return 0;
}

int mlens_op_time_create(struct mlens_op_time **out, struct mlens_step_timer *timer)
{
	struct mlens_op_time *ot;

	*out = NULL;
	if (!timer->on)
		return -ENOTSUP;
	ot = calloc(1, sizeof(*ot));
	if (!ot)
		return -ENOMEM;
	ot->marks = calloc(MLENS_OP_TIME_MAX_OPS, sizeof(*ot->marks));
	if (!ot->marks || pthread_mutex_init(&ot->tot_mu, NULL)) {
		free(ot->marks);
		free(ot);
		return -ENOMEM;
	}
	ot->timer = timer;
	ot->cur = -1;
	ot->probe = (struct mlens_layer_probe){ op_begin, op_end, ot };
	*out = ot;
	return 0;
}

void mlens_op_time_destroy(struct mlens_op_time *ot)
{
	if (!ot)
		return;
	pthread_mutex_destroy(&ot->tot_mu);
	free(ot->marks);
	free(ot);
}

void mlens_op_time_set_timer(struct mlens_op_time *ot, struct mlens_step_timer *timer,
			     pthread_mutex_t *mu)
{
	ot->timer = timer;
	ot->mu = mu;
}

const struct mlens_layer_probe *mlens_op_time_probe(struct mlens_op_time *ot)
{
	return &ot->probe;
}

void mlens_op_time_step_start(struct mlens_op_time *ot)
{
	ot->n = 0;
	ot->cur = -1;
	ot->unmarked = 0;
}

void mlens_op_time_step_done(struct mlens_op_time *ot, int finish_rc)
{
	struct mlens_op_time_totals *t = &ot->tot;
	double first = 0, last = 0;

	pthread_mutex_lock(&ot->tot_mu);
	t->dropped += ot->unmarked;
	if (finish_rc) {
		t->dropped += (uint64_t)ot->n;
	} else if (ot->n) {
		for (int i = 0; i < ot->n; i++) {
			const struct op_mark *m = &ot->marks[i];
			const struct mlens_step_timer_span *sp = &ot->timer->spans[m->span];
			t->seconds[m->op] += sp->t1 - sp->t0;
			t->flops[m->op] += m->flops;
			t->calls[m->op]++;
			if (!i || sp->t0 < first)
				first = sp->t0;
			if (!i || sp->t1 > last)
				last = sp->t1;
		}
		t->span_s += last - first;
		t->steps++;
	}
	pthread_mutex_unlock(&ot->tot_mu);
	mlens_op_time_step_start(ot);
}

void mlens_op_time_get(const struct mlens_op_time *ot, struct mlens_op_time_totals *out)
{
	pthread_mutex_lock((pthread_mutex_t *)&ot->tot_mu);
	*out = ot->tot;
	pthread_mutex_unlock((pthread_mutex_t *)&ot->tot_mu);
}
