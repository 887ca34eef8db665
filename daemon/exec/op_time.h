/* The op time account (op_timing = on): where the compute queue's time
 * goes inside the steps a daemon runs, op by op (layer.h's ops: GEMMs,
 * norms, RoPE, attention, K/V stores, the MoE, lm_head, sampling), with
 * each op's FLOPs. It is a layer probe whose begin and end put a span of
 * two timing marks (kernels/backend.h, through the step's timer of
 * daemon/ops/trace.h) around each op on queue 0, so nothing waits inside
 * the step; the marks are read after the step timer's finish, when the
 * step's end already waited for the queue (sampling reads its tokens
 * back). The spans also go to a step trace while one records (track
 * "gpu-op"). The engine owns one per daemon when asked; the hybrid
 * pipeline probes its GPU side with it. On the CPU backend the marks are
 * the host clock (its ops are synchronous). Not thread-safe beyond the
 * lock given at create: one thread runs the probe and reads the totals. */
#ifndef MLENS_OP_TIME_H
#define MLENS_OP_TIME_H

#include <pthread.h>
#include <stdint.h>
#include "daemon/exec/layer.h"
#include "daemon/ops/trace.h"

/* Totals over the steps timed. An op's seconds are the queue's time
 * between its marks; span_s is, a step, from the first op's start to the
 * last op's end, so span_s less the ops' sum is the queue's time between
 * ops (launch gaps, and in hybrid mode the waits for copies). */
struct mlens_op_time_totals {
	double seconds[MLENS_LAYER_OP_N];
	double flops[MLENS_LAYER_OP_N];
	uint64_t calls[MLENS_LAYER_OP_N];
	double span_s;
	uint64_t steps;		/* steps whose ops were read */
	uint64_t dropped;	/* ops left out: past a step's share of marks, or a step whose marks failed */
};

/* Ops one step marks at most: half the step timer's spans, the rest
 * left to its own (the hybrid pipeline's commands and copies). */
#define MLENS_OP_TIME_MAX_OPS (MLENS_STEP_TIMER_SPANS / 2)

struct mlens_op_time;

/* An account over timer, whose backend must have timing marks (-ENOTSUP
 * otherwise), or -ENOMEM. */
int mlens_op_time_create(struct mlens_op_time **out, struct mlens_step_timer *timer);
void mlens_op_time_destroy(struct mlens_op_time *ot);
/* Mark on another timer of the same backend from now on (the hybrid
 * pipeline's), mu (may be NULL) held around each use of it (the pipeline's
 * copy thread marks on it too); between steps. */
void mlens_op_time_set_timer(struct mlens_op_time *ot, struct mlens_step_timer *timer,
			     pthread_mutex_t *mu);
/* The probe to run the layers with (its arg is ot). */
const struct mlens_layer_probe *mlens_op_time_probe(struct mlens_op_time *ot);
/* A step starts: after mlens_step_timer_start of the timer. */
void mlens_op_time_step_start(struct mlens_op_time *ot);
/* The step's timer finished with finish_rc (mlens_step_timer_finish):
 * its ops' times into the totals (0), or the step's ops dropped. */
void mlens_op_time_step_done(struct mlens_op_time *ot, int finish_rc);
void mlens_op_time_get(const struct mlens_op_time *ot, struct mlens_op_time_totals *out);

#endif
