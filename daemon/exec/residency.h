/* Which experts of each MoE layer the hybrid pipeline keeps on the GPU
 * (the plan's r a layer) and which stream: the resident set, its routing
 * counts and the swaps that move it towards the most-routed experts.
 * Pure bookkeeping on the host, owned by one pipeline and used from the
 * thread that drives it; the pipeline does the uploads. The MoE op adds
 * each step's routed rows into tally (struct mlens_moe_weights' tally),
 * mlens_residency_step_done folds them in after the step, and between
 * steps the pipeline takes swaps from mlens_residency_next_swap. */
#ifndef MLENS_RESIDENCY_H
#define MLENS_RESIDENCY_H

#include <stdbool.h>
#include <stdint.h>

/* Steps between two choices of the resident sets when none is given. */
#define MLENS_RESIDENCY_PERIOD 64
/* Experts swapped in per step at most when none is given: each is an
 * upload of one expert on the weight stream's queue before the step's
 * own copies. */
#define MLENS_RESIDENCY_SWAPS 4
/* A streamed expert replaces a resident one only when its decayed count
 * passes the resident one's by this factor: experts routed about as often
 * do not trade places back and forth. */
#define MLENS_RESIDENCY_MARGIN 1.125

struct mlens_residency {
	int layers, experts;	/* MoE layers' count, experts a layer */
	int r;			/* resident experts a layer (the plan's) */
	bool routing;		/* re-chosen from the counts (else experts 0..r-1 stay) */
	int period;		/* steps between choices */
	int swaps_per_step;	/* swaps mlens_residency_next_swap hands out a step */
	uint8_t *resident;	/* [layers][experts]: on the GPU now */
	uint8_t *target;	/* [layers][experts]: the last choice */
	uint64_t *tally;	/* [layers][experts]: this step's routed rows (the MoE op adds) */
	uint64_t *routed;	/* [layers][experts]: routed rows, totals */
	uint64_t *count;	/* [layers][experts]: routed rows since the last choice */
	double *score;		/* [layers][experts]: counts, halved at every choice */
	uint64_t *layer_swaps;	/* [layers]: experts swapped in, totals */
	int steps;		/* since the last choice */
	int swaps_left;		/* this step's */
	/* totals: routed rows, of them to a resident expert, swaps, choices */
	uint64_t routed_rows, resident_rows, swaps, choices;
	/* the last step's routed rows and those to a resident expert */
	uint64_t step_routed_rows, step_resident_rows;
};

/* layers x experts, r resident a layer (experts 0..r-1 at first); routing:
 * re-chosen every period steps (0: MLENS_RESIDENCY_PERIOD), at most
 * swaps_per_step swaps a step (0: MLENS_RESIDENCY_SWAPS). 0 or -ENOMEM,
 * -EINVAL for r outside [0, experts]. */
int mlens_residency_init(struct mlens_residency *rs, int layers, int experts, int r, bool routing,
			 int period, int swaps_per_step);
void mlens_residency_fini(struct mlens_residency *rs);

static inline bool mlens_residency_is_resident(const struct mlens_residency *rs, int layer, int x)
{
	return rs->resident[(size_t)layer * (size_t)rs->experts + (size_t)x] != 0;
}

static inline uint64_t *mlens_residency_tally(struct mlens_residency *rs, int layer)
{
	return rs->tally + (size_t)layer * (size_t)rs->experts;
}

/* After a step that ran: its tally into the totals and hit counts (tally
 * zeroed); with routing, every period steps the scores halve, take the
 * period's counts and a new target is chosen. A new step's swaps may be
 * taken from here on. */
void mlens_residency_step_done(struct mlens_residency *rs);
/* After a step that failed: its tally dropped. */
void mlens_residency_step_failed(struct mlens_residency *rs);

/* The next swap towards the target, within this step's bound: in layer
 * *layer the streamed expert *in takes the place of the resident *out.
 * False when there is none (or the bound is reached). The caller moves
 * the weights, then calls mlens_residency_swapped. */
bool mlens_residency_next_swap(struct mlens_residency *rs, int *layer, int *in, int *out);
void mlens_residency_swapped(struct mlens_residency *rs, int layer, int in, int out);

/* Fraction of routed rows that found their expert resident: totals, or
 * the last step's (0 before any). */
double mlens_residency_hit_ratio(const struct mlens_residency *rs, bool last_step);

#endif
