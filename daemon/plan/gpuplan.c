/* The GPU memory plan of the hybrid pipeline: the split of a budget into
 * resident weights, two expert slots, activations and workspace, and the
 * refusal with the minimum when it cannot run. Arithmetic only. */
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include "daemon/errf.h"
#include "daemon/plan/gpuplan.h"
#include "daemon/exec/pipeprog.h"

static uint64_t sat_add(uint64_t a, uint64_t b)
{
	return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

static uint64_t sat_mul(uint64_t a, uint64_t b)
{
	return a && b > UINT64_MAX / a ? UINT64_MAX : a * b;
}

static uint64_t align256(uint64_t x)
{
	return x > UINT64_MAX - 255 ? UINT64_MAX : (x + 255) & ~(uint64_t)255;
}

/* The CUDA backend grows a buffer by doubling from a floor until it holds
 * the request (kernels/cuda/backend_cuda.cu); what it holds is that size. */
static uint64_t grown(uint64_t need, uint64_t floor)
{
	uint64_t cap = floor;
	if (!need)
		return 0;
	while (cap < need) {
		if (cap > UINT64_MAX / 2)
			return UINT64_MAX;
		cap *= 2;
	}
	return cap;
}

uint64_t mlens_gpuplan_gemm_parts(enum mlens_gemm_mode gemm, uint64_t weight_bytes)
{
	return gemm == MLENS_GEMM_EXACT && weight_bytes != 4 ? MLENS_GEMM_EXACT_PARTS : 1;
}

int64_t mlens_gpuplan_group_rows(int64_t n, int64_t group)
{
	int64_t least = (n + MLENS_PIPE_MAX_GROUPS / 4 - 1) / (MLENS_PIPE_MAX_GROUPS / 4);
	if (group <= 0)
		group = MLENS_GPUPLAN_GROUP;
	if (group < least)
		group = least;	/* a step never needs more groups than the program holds */
	return n < group ? n : group;
}

uint64_t mlens_gpuplan_moe_scratch(uint64_t rows, uint64_t H, uint64_t I, uint64_t E, uint64_t es,
				   enum mlens_gemm_mode gemm)
{
	uint64_t parts = mlens_gpuplan_gemm_parts(gemm, es);
	bool half = mlens_moe_half_gu(gemm, (size_t)es);
	uint64_t gu = rows < MLENS_CUDA_MOE_GU_ROWS ? rows : MLENS_CUDA_MOE_GU_ROWS;
	uint64_t slack = 256 * MLENS_MOE_STREAMS_MAX;
	uint64_t moe = align256(sat_mul(E, 4));					/* counts */
	moe = sat_add(moe, 2 * align256(sat_mul(rows, 4)));			/* perm, inv */
	moe = sat_add(moe, align256(sat_mul(sat_mul(sat_mul(rows, H), es), parts)));	/* gathered x */
	/* gate, up (and silu(g) u unless it goes over g): one piece a MoE
	 * stream, each slice aligned (mlens_moe_piece_rows) */
	moe = sat_add(moe, 2 * sat_add(align256(sat_mul(sat_mul(gu, I), half ? es : 4)), slack));
	if (!half)
		moe = sat_add(moe, sat_add(align256(sat_mul(sat_mul(sat_mul(gu, I), es), parts)), slack));
	return sat_add(moe, align256(sat_mul(sat_mul(rows, H), 4)));		/* expert out */
}

uint64_t mlens_gpuplan_scratch_bytes(const struct mlens_perf_model *pm, int64_t n, int64_t group,
				     int64_t chunk, enum mlens_gemm_mode gemm)
{
	uint64_t g, c, H = (uint64_t)pm->hidden, I = (uint64_t)pm->inter;
	uint64_t E = (uint64_t)pm->experts, K = (uint64_t)pm->top_k;
	uint64_t qd = (uint64_t)(pm->heads * pm->head_dim);
	uint64_t es = (uint64_t)pm->wbytes, np = mlens_gpuplan_gemm_parts(gemm, es), rows, moe, conv, widen, s;

	if (n <= 0)
		return 0;
	if (chunk <= 0)
		chunk = MLENS_GPUPLAN_CHUNK;
	g = (uint64_t)mlens_gpuplan_group_rows(n, group);
	c = (uint64_t)((int64_t)g < chunk ? (int64_t)g : chunk);
	/* one buffer sized by its largest user (kernels/cuda/backend_cuda.cu):
	 * a group's rows in the weight dtype for a GEMM (np parts when exact),
	 * the router's weights widened to fp32, a MoE chunk's gathered rows and
	 * intermediates, the sampler's tokens and log-probs */
	conv = es == 4 ? 0 : sat_mul(sat_mul(sat_mul(g, H > qd ? H : qd), es), np);
	widen = es == 4 ? 0 : sat_mul(sat_mul(E, H), 4);
	rows = sat_mul(c, K);
	moe = mlens_gpuplan_moe_scratch(rows, H, I, E, es, gemm);
	if (pm->expert_fp8)	/* each MoE stream's expert dequantized */
		moe = sat_add(moe, mlens_moe_fp8_dequant_bytes(H, I, MLENS_MOE_STREAMS_MAX,
								   es == 4 ? MLENS_GEMM_EXACT : gemm) +
					   256 * MLENS_MOE_STREAMS_MAX);
	s = conv > moe ? conv : moe;
	if (s < widen)
		s = widen;
	if (s < sat_mul((uint64_t)n, 8) + 256)
		s = sat_mul((uint64_t)n, 8) + 256;
	/* reserved once at its size, in the allocator's 2 MiB granules */
	return s > UINT64_MAX - MLENS_GPUPLAN_SCRATCH_ALIGN
		       ? UINT64_MAX
		       : (s + MLENS_GPUPLAN_SCRATCH_ALIGN - 1) & ~(uint64_t)(MLENS_GPUPLAN_SCRATCH_ALIGN - 1);
}

/* The activation sets a plan input asks for (0: the pipeline's fewest). */
static int plan_sets(const struct mlens_gpuplan_in *in)
{
	return in->sets > 0 ? in->sets : MLENS_PIPE_SETS;
}

uint64_t mlens_gpuplan_act_bytes(const struct mlens_perf_model *pm, int64_t n,
				 const struct mlens_gpuplan_in *in)
{
	int64_t chunk = in->chunk > 0 ? in->chunk : MLENS_GPUPLAN_CHUNK;
	int sets = plan_sets(in);
	uint64_t T, g, c, H = (uint64_t)pm->hidden;
	uint64_t E = (uint64_t)pm->experts, K = (uint64_t)pm->top_k, V = (uint64_t)pm->vocab;
	uint64_t qd = (uint64_t)(pm->heads * pm->head_dim);
	uint64_t kvd = (uint64_t)(pm->kv_heads * pm->head_dim);
	uint64_t per, shared, acc, stage;

	if (n <= 0)
		return 0;
	T = (uint64_t)n;
	g = (uint64_t)mlens_gpuplan_group_rows(n, in->group);
	c = (uint64_t)((int64_t)g < chunk ? (int64_t)g : chunk);
	/* fp32: the residual x of every token; per set, for a group: q, att
	 * (none with att_half: the prefill attention writes into xn), k, v
	 * (they live across the group's CPU attention); once for all sets: xn
	 * (rows of the hidden size or qdim, the larger), router logits, top-k
	 * weights and ids (GA's and GB's own, daemon/exec/pipeline.c's pl_shared);
	 * logits of the tail's rows (a chunk, at most MLENS_GPUPLAN_TAIL_ROWS) */
	per = (in->att_half ? 1 : 2) * qd + 2 * kvd;
	shared = (qd > H ? qd : H) + E + 2 * K;
	acc = sat_mul(sat_mul(T, H), 4);
	acc = sat_add(acc, sat_mul(sat_mul(sat_mul(g, per), 4), (uint64_t)sets));
	acc = sat_add(acc, sat_mul(sat_mul(g, shared), 4));
	acc = sat_add(acc, align256(sat_mul(sat_mul((uint64_t)mlens_gpuplan_tail_rows((int64_t)c), V), 4)));
	acc = sat_add(acc, mlens_gpuplan_scratch_bytes(pm, n, in->group, chunk, in->gemm));
	/* metadata staging (the CUDA backend's compute stream and side
	 * queue each hold one area): at most a few int32/int64 per token or
	 * tile, 8 bytes a group row for the side K/V append's slots */
	stage = sat_mul(T, 32) + 4096;
	return sat_add(acc, grown(stage, 64ull << 10));
}

/* The smallest group plan_auto tries with MoE calls of chunk tokens (0:
 * the default): the chunk or MLENS_GPUPLAN_AUTO_GROUP_MIN, the smaller. */
static int64_t auto_group_floor(int64_t chunk)
{
	int64_t c = chunk > 0 ? chunk : MLENS_GPUPLAN_CHUNK;
	return c < MLENS_GPUPLAN_AUTO_GROUP_MIN ? c : MLENS_GPUPLAN_AUTO_GROUP_MIN;
}

uint64_t mlens_gpuplan_act_bytes_hw(const struct mlens_perf_model *pm, int64_t n, int64_t chunk,
				    const void *arg)
{
	/* the plan input's shape (NULL: the default group, fast GEMMs) with
	 * the model's chunk */
	struct mlens_gpuplan_in s = { 0 };
	int64_t least = auto_group_floor(chunk);
	uint64_t best;
	if (arg)
		s = *(const struct mlens_gpuplan_in *)arg;
	s.chunk = chunk;
	if (s.group != MLENS_GPUPLAN_GROUP_AUTO)
		return mlens_gpuplan_act_bytes(pm, n, &s);
	/* the groups plan_auto tries: the default, halved down to the least */
	s.group = MLENS_GPUPLAN_GROUP;
	best = mlens_gpuplan_act_bytes(pm, n, &s);
	for (s.group = MLENS_GPUPLAN_GROUP / 2; s.group >= least; s.group /= 2) {
		uint64_t b = mlens_gpuplan_act_bytes(pm, n, &s);
		if (b < best)
			best = b;
	}
	return best;
}

static double gib(uint64_t b)
{
	return (double)b / (1024.0 * 1024.0 * 1024.0);
}

struct act_in {
	const struct mlens_perf_model *pm;
	const struct mlens_gpuplan_in *in;
};

static uint64_t act_in(const void *arg, int64_t n)
{
	const struct act_in *a = arg;
	return mlens_gpuplan_act_bytes(a->pm, n, a->in);
}

/* The plan for in->group rows a group (0: the default). */
static int plan_group(const struct mlens_perf_model *pm, const struct mlens_gpuplan_in *in,
		      struct mlens_gpuplan *out, char *err, size_t errlen)
{
	int64_t nmin = in->min_tokens > 0 ? in->min_tokens : 1;
	uint64_t ws = in->workspace ? in->workspace : MLENS_GPUPLAN_WORKSPACE;
	int64_t chunk = in->chunk > 0 ? in->chunk : MLENS_GPUPLAN_CHUNK;
	int64_t group = in->group > 0 ? in->group : MLENS_GPUPLAN_GROUP;
	int E = (int)pm->experts, best_r;
	uint64_t act_max, best_fixed;

	memset(out, 0, sizeof(*out));
	mlens_errf(err, errlen, "%s", "");
	if (in->max_tokens <= 0 || nmin > in->max_tokens || E <= 0) {
		mlens_errf(err, errlen, "GPU memory plan: token cap %lld (minimum %lld) is out of range",
		       (long long)in->max_tokens, (long long)nmin);
		return -EINVAL;
	}
	out->budget = in->budget;
	out->workspace = ws;
	out->chunk = chunk;
	act_max = mlens_gpuplan_act_bytes(pm, in->max_tokens, in);
	out->gpu_only = sat_add(mlens_perf_fixed_bytes(pm, E, ws), act_max);
	best_r = mlens_perf_min_fixed(pm, ws, &best_fixed);
	out->minimum = sat_add(best_fixed, mlens_gpuplan_act_bytes(pm, nmin, in));
	if (in->budget < out->minimum) {
		/* with more activation sets than the fewest, say what the
		 * fewest would need (one group's q, k, v less) */
		uint64_t act = mlens_gpuplan_act_bytes(pm, nmin, in);
		char alt[160] = "";
		if (plan_sets(in) > MLENS_PIPE_SETS) {
			struct mlens_gpuplan_in two = *in;
			uint64_t min2;
			two.sets = MLENS_PIPE_SETS;
			min2 = out->minimum - act + mlens_gpuplan_act_bytes(pm, nmin, &two);
			if (in->budget >= min2)
				snprintf(alt, sizeof(alt),
					 ", or set pipeline_sets = %d, which needs %.2f GiB",
					 MLENS_PIPE_SETS, gib(min2));
		}
		mlens_errf(err, errlen,
		       "GPU budget %.2f GiB is too small for this model: the hybrid pipeline needs at "
		       "least %.2f GiB (attention, norms, routers, embeddings and lm_head %.2f GiB, two "
		       "slots of one layer's experts %.2f GiB, activations for %lld tokens with %d groups' sets "
		       "%.2f GiB, workspace %.2f GiB); raise gpu_memory%s",
		       gib(in->budget), gib(out->minimum), gib(mlens_perf_resident_bytes(pm, 0)),
		       gib(mlens_perf_slot_bytes(pm, 0)), (long long)nmin,
		       plan_sets(in), gib(act), gib(ws), alt);
		return -ENOSPC;
	}
	/* most resident experts that still leave the whole token cap */
	for (int r = E; r >= 0; r--) {
		if (sat_add(mlens_perf_fixed_bytes(pm, r, ws), act_max) <= in->budget) {
			out->resident_experts = r;
			out->tokens = in->max_tokens;
			goto done;
		}
	}
	/* no residency holds the cap: the cheapest one, with fewer tokens */
	out->resident_experts = best_r;
	{
		const struct act_in a = { pm, in };
		out->tokens = mlens_perf_tokens_fit(act_in, &a, in->budget - best_fixed, in->max_tokens);
	}
done:
	out->resident = mlens_perf_resident_bytes(pm, out->resident_experts);
	out->slot = mlens_perf_streamed_bytes(pm, out->resident_experts);
	out->slots = mlens_perf_slot_bytes(pm, out->resident_experts);
	out->group = mlens_gpuplan_group_rows(out->tokens, group);
	if (out->chunk > out->group)
		out->chunk = out->group;
	out->act = mlens_gpuplan_act_bytes(pm, out->tokens, in);
	out->scratch = mlens_gpuplan_scratch_bytes(pm, out->tokens, group, chunk, in->gemm);
	out->total = sat_add(sat_add(sat_add(out->resident, out->slots), out->act), ws);
	return 0;
}

/* MLENS_GPUPLAN_GROUP_AUTO: halve the group from the default while the
 * plan falls short of max_tokens, down to auto_group_floor; keep the plan
 * that holds the most tokens (the larger group on a tie). */
static int plan_auto(const struct mlens_perf_model *pm, const struct mlens_gpuplan_in *in,
		     struct mlens_gpuplan *out, char *err, size_t errlen)
{
	struct mlens_gpuplan_in g = *in;
	struct mlens_gpuplan p;
	int64_t least = auto_group_floor(in->chunk);
	bool have = false;
	int rc, first = 0;

	for (g.group = MLENS_GPUPLAN_GROUP;; g.group /= 2) {
		/* the default group's refusal is the one reported */
		rc = plan_group(pm, &g, &p, have || first ? NULL : err, errlen);
		if (g.group == MLENS_GPUPLAN_GROUP)
			first = rc;
		if (!rc && (!have || p.tokens > out->tokens)) {
			*out = p;
			have = true;
		}
		if ((!rc && p.tokens >= in->max_tokens) || g.group / 2 < least)
			break;
	}
	if (!have)
		return first;
	mlens_errf(err, errlen, "%s", "");
	return 0;
}

int mlens_gpuplan_make(const struct mlens_perf_model *pm, const struct mlens_gpuplan_in *in,
		       struct mlens_gpuplan *out, char *err, size_t errlen)
{
	if (in->group == MLENS_GPUPLAN_GROUP_AUTO)
		return plan_auto(pm, in, out, err, errlen);
	if (in->group < 0) {
		memset(out, 0, sizeof(*out));
		mlens_errf(err, errlen, "GPU memory plan: a token group of %lld rows is out of range",
		       (long long)in->group);
		return -EINVAL;
	}
	return plan_group(pm, in, out, err, errlen);
}

int mlens_gpuplan_format(const struct mlens_gpuplan *p, const struct mlens_perf_model *pm,
			 char *buf, size_t len)
{
	return snprintf(buf, len,
			"GPU memory plan: budget %.2f GiB = resident weights %.2f GiB (%d of %lld "
			"experts per layer) + 2 expert slots %.2f GiB + activations for %lld tokens "
			"in groups of %lld %.2f GiB + workspace %.2f GiB, %.2f GiB used; minimum %.2f GiB, GPU-only "
			"needs %.2f GiB",
			gib(p->budget), gib(p->resident), p->resident_experts, (long long)pm->experts,
			gib(p->slots), (long long)p->tokens, (long long)p->group, gib(p->act), gib(p->workspace),
			gib(p->total), gib(p->minimum), gib(p->gpu_only));
}
