/* The hybrid pipeline's resident experts and their routing counts
 * (residency.h). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/exec/residency.h"

int mlens_residency_init(struct mlens_residency *rs, int layers, int experts, int r, bool routing,
			 int period, int swaps_per_step)
{
	size_t n = (size_t)(layers > 0 ? layers : 0) * (size_t)(experts > 0 ? experts : 0);

	memset(rs, 0, sizeof(*rs));
	if (layers < 0 || experts < 0 || r < 0 || r > experts)
		return -EINVAL;
	rs->layers = layers;
	rs->experts = experts;
	rs->r = r;
	rs->routing = routing && r > 0 && r < experts;
	rs->period = period > 0 ? period : MLENS_RESIDENCY_PERIOD;
	rs->swaps_per_step = swaps_per_step > 0 ? swaps_per_step : MLENS_RESIDENCY_SWAPS;
	rs->resident = calloc(n + 1, 1);
	rs->target = calloc(n + 1, 1);
	rs->tally = calloc(n + 1, sizeof(*rs->tally));
	rs->routed = calloc(n + 1, sizeof(*rs->routed));
	rs->count = calloc(n + 1, sizeof(*rs->count));
	rs->score = calloc(n + 1, sizeof(*rs->score));
	rs->layer_swaps = calloc((size_t)layers + 1, sizeof(*rs->layer_swaps));
	if (!rs->resident || !rs->target || !rs->tally || !rs->routed || !rs->count || !rs->score ||
	    !rs->layer_swaps) {
		mlens_residency_fini(rs);
		return -ENOMEM;
	}
	for (int l = 0; l < layers; l++)
		for (int x = 0; x < r; x++)
			rs->resident[(size_t)l * (size_t)experts + (size_t)x] = 1;
	memcpy(rs->target, rs->resident, n);
	rs->swaps_left = rs->swaps_per_step;
	return 0;
}

void mlens_residency_fini(struct mlens_residency *rs)
{
	free(rs->resident);
	free(rs->target);
	free(rs->tally);
	free(rs->routed);
	free(rs->count);
	free(rs->score);
	free(rs->layer_swaps);
	memset(rs, 0, sizeof(*rs));
}

/* Layer l's target from its scores: starting from the resident set, the
 * most-routed streamed expert trades places with the least-routed
 * resident one while it passes that one by the margin. */
static void choose_layer(struct mlens_residency *rs, int l)
{
	size_t E = (size_t)rs->experts;
	uint8_t *t = rs->target + (size_t)l * E;
	const double *s = rs->score + (size_t)l * E;

	memcpy(t, rs->resident + (size_t)l * E, E);
	for (int k = 0; k < rs->r; k++) {
		int in = -1, out = -1;
		for (size_t x = 0; x < E; x++) {
			if (!t[x] && (in < 0 || s[x] > s[in]))
				in = (int)x;
			if (t[x] && (out < 0 || s[x] <= s[out]))
				out = (int)x;
		}
		if (in < 0 || out < 0 || !(s[in] > s[out] * MLENS_RESIDENCY_MARGIN) || !(s[in] > 0))
			break;
		t[in] = 1;
		t[out] = 0;
	}
}

void mlens_residency_step_done(struct mlens_residency *rs)
{
	size_t n = (size_t)rs->layers * (size_t)rs->experts;

	rs->step_routed_rows = rs->step_resident_rows = 0;
	for (size_t i = 0; i < n; i++) {
		uint64_t c = rs->tally[i];
		rs->tally[i] = 0;
		rs->routed[i] += c;
		rs->count[i] += c;
		rs->step_routed_rows += c;
		if (rs->resident[i])
			rs->step_resident_rows += c;
	}
	rs->routed_rows += rs->step_routed_rows;
	rs->resident_rows += rs->step_resident_rows;
	rs->swaps_left = rs->swaps_per_step;
	if (!rs->routing || ++rs->steps < rs->period)
		return;
	rs->steps = 0;
	for (size_t i = 0; i < n; i++) {
		rs->score[i] = rs->score[i] / 2 + (double)rs->count[i];
		rs->count[i] = 0;
	}
	for (int l = 0; l < rs->layers; l++)
		choose_layer(rs, l);
	rs->choices++;
}

void mlens_residency_step_failed(struct mlens_residency *rs)
{
	memset(rs->tally, 0, (size_t)rs->layers * (size_t)rs->experts * sizeof(*rs->tally));
}

bool mlens_residency_next_swap(struct mlens_residency *rs, int *layer, int *in, int *out)
{
	size_t E = (size_t)rs->experts;

	if (rs->swaps_left <= 0)
		return false;
	for (int l = 0; l < rs->layers; l++) {
		const uint8_t *cur = rs->resident + (size_t)l * E, *t = rs->target + (size_t)l * E;
		int i = -1, o = -1;
		for (size_t x = 0; x < E; x++) {
			if (t[x] && !cur[x] && i < 0)
				i = (int)x;
			if (!t[x] && cur[x] && o < 0)
				o = (int)x;
		}
		if (i >= 0 && o >= 0) {
			*layer = l;
			*in = i;
			*out = o;
			return true;
		}
	}
	return false;
}

void mlens_residency_swapped(struct mlens_residency *rs, int layer, int in, int out)
{
	size_t b = (size_t)layer * (size_t)rs->experts;

	rs->resident[b + (size_t)in] = 1;
	rs->resident[b + (size_t)out] = 0;
	rs->layer_swaps[layer]++;
	rs->swaps++;
	rs->swaps_left--;
}

double mlens_residency_hit_ratio(const struct mlens_residency *rs, bool last_step)
{
	uint64_t all = last_step ? rs->step_routed_rows : rs->routed_rows;
	uint64_t hit = last_step ? rs->step_resident_rows : rs->resident_rows;
	return all ? (double)hit / (double)all : 0;
}
