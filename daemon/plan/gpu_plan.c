/* The GPU memory plan (see gpu_plan.h): the split of a budget into
 * resident weights, two expert slots, the KV pool, activations and
 * workspace, GPU-only mode as the plan with every expert resident, and the
 * refusal with the minimum when it cannot run. Arithmetic only. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include "daemon/errf.h"
#include "daemon/plan/gpu_plan.h"
#include "daemon/exec/kv_pool.h"
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

/* ==== a residency's bytes ==== */

static int clamp_r(const struct mlens_perf_model *pm, int r)
{
	return r < 0 ? 0 : r > pm->experts ? (int)pm->experts : r;
}

uint64_t mlens_gpu_plan_streamed_bytes(const struct mlens_perf_model *pm, int r)
{
	return (uint64_t)(pm->experts - clamp_r(pm, r)) * pm->expert_bytes;
}

uint64_t mlens_gpu_plan_resident_bytes(const struct mlens_perf_model *pm, int r)
{
	uint64_t layer = pm->attn_bytes + pm->norm_bytes + pm->router_bytes + pm->family_bytes +
			 (uint64_t)clamp_r(pm, r) * pm->expert_bytes;
	return layer * (uint64_t)pm->layers + pm->embed_bytes + pm->lm_head_bytes +
	       pm->final_norm_bytes;
}

uint64_t mlens_gpu_plan_slot_bytes(const struct mlens_perf_model *pm, int r)
{
	return 2 * mlens_gpu_plan_streamed_bytes(pm, r);
}

uint64_t mlens_gpu_plan_fixed_bytes(const struct mlens_perf_model *pm, int r, uint64_t ws)
{
	return sat_add(sat_add(mlens_gpu_plan_resident_bytes(pm, r), mlens_gpu_plan_slot_bytes(pm, r)), ws);
}

int mlens_gpu_plan_min_fixed(const struct mlens_perf_model *pm, int max_r, uint64_t ws, uint64_t *bytes)
{
	/* r = 0 for any model of more than two layers; with one layer keeping
	 * it all resident costs less than two slots, and under a cap the
	 * most resident the cap allows costs least */
	int best = 0, top = max_r < 0 ? (int)pm->experts : clamp_r(pm, max_r);
	*bytes = UINT64_MAX;
	for (int r = 0; r <= top; r++) {
		uint64_t f = mlens_gpu_plan_fixed_bytes(pm, r, ws);
		if (f < *bytes) {
			*bytes = f;
			best = r;
		}
	}
	return best;
}

uint64_t mlens_gpu_plan_minimum(const struct mlens_perf_model *pm, uint64_t ws, uint64_t act)
{
	uint64_t b;
	mlens_gpu_plan_min_fixed(pm, -1, ws, &b);
	return sat_add(b, act);
}

int64_t mlens_gpu_plan_tokens_fit(uint64_t (*act)(const void *arg, int64_t n), const void *arg,
				  uint64_t room, int64_t cap)
{
	int64_t lo = 0, hi = cap;
	while (lo < hi) {
		int64_t mid = lo + (hi - lo + 1) / 2;
		if (act(arg, mid) <= room)
			lo = mid;
		else
			hi = mid - 1;
	}
	return lo;
}

/* GPU activations of a step of n tokens (DESIGN §5.2), in activation
 * elements of abytes each, G = ceil(n x MLENS_PERF_GROUP_MAX) the larger
 * token group, c the chunk rows:
 *   n x (2H + E + 2k)          residual stream, its norm, router logits,
 *                              top-k weights and ids, for all tokens
 * + G x (2 heads*hd + 2 kv*hd)  q, attention output, k, v of one group
 * + min(n k, c) x (2H + 2I)     one MoE chunk: gathered inputs, outputs,
 *                              gate and up intermediates
 * + min(n, c) x V               logits of one chunk of rows */
uint64_t mlens_gpu_plan_act_estimate(const struct mlens_perf_model *pm, int64_t n, int64_t chunk)
{
	uint64_t un, G, rows, lrows, per, acc;
	uint64_t H = (uint64_t)pm->hidden, I = (uint64_t)pm->inter;
	uint64_t qd = (uint64_t)(pm->heads * pm->head_dim), kvd = (uint64_t)(pm->kv_heads * pm->head_dim);
	if (n <= 0)
		return 0;
	if (chunk <= 0)
		chunk = MLENS_PERF_CHUNK;
	un = (uint64_t)n;
	G = (uint64_t)ceil((double)n * MLENS_PERF_GROUP_MAX);
	rows = sat_mul(un, (uint64_t)pm->top_k);
	if (rows > (uint64_t)chunk)
		rows = (uint64_t)chunk;
	lrows = un < (uint64_t)chunk ? un : (uint64_t)chunk;
	per = 2 * H + (uint64_t)pm->experts + 2 * (uint64_t)pm->top_k;
	acc = sat_mul(un, per);
	acc = sat_add(acc, sat_mul(G, 2 * qd + 2 * kvd));
	acc = sat_add(acc, sat_mul(rows, 2 * H + 2 * I));
	acc = sat_add(acc, sat_mul(lrows, (uint64_t)pm->vocab));
	return sat_mul(acc, (uint64_t)pm->abytes);
}

/* ==== the executors' activations and scratch ==== */

uint64_t mlens_gpu_plan_gemm_parts(enum mlens_gemm_mode gemm, uint64_t weight_bytes)
{
	return gemm == MLENS_GEMM_EXACT && weight_bytes != 4 ? MLENS_GEMM_EXACT_PARTS : 1;
}

int64_t mlens_gpu_plan_group_rows(int64_t n, int64_t group)
{
	int64_t least = (n + MLENS_PIPE_MAX_GROUPS / 4 - 1) / (MLENS_PIPE_MAX_GROUPS / 4);
	if (group <= 0)
		group = MLENS_GPU_PLAN_GROUP;
	if (group < least)
		group = least;	/* a step never needs more groups than the program holds */
	return n < group ? n : group;
}

enum mlens_gpu_plan_fp8 mlens_gpu_plan_fp8_path(const struct mlens_perf_model *pm,
						enum mlens_gemm_mode gemm)
{
	if (!pm->expert_fp8)
		return MLENS_GPU_PLAN_FP8_NONE;
	return pm->expert_fp8_tc && gemm == MLENS_GEMM_FAST && pm->wbytes == 2 &&
			       !(pm->hidden % 16) && !(pm->inter % 16)
		       ? MLENS_GPU_PLAN_FP8_TC
		       : MLENS_GPU_PLAN_FP8_DEQUANT;
}

uint64_t mlens_gpu_plan_moe_scratch(uint64_t rows, uint64_t H, uint64_t I, uint64_t E, uint64_t es,
				   enum mlens_gemm_mode gemm, enum mlens_gpu_plan_fp8 fp8)
{
	uint64_t parts = mlens_gpu_plan_gemm_parts(gemm, es);
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
	moe = sat_add(moe, align256(sat_mul(sat_mul(rows, H), 4)));		/* expert out */
	if (fp8 == MLENS_GPU_PLAN_FP8_TC) {
		/* counts, perm, inv; the rows in e4m3 and their scales; a piece
		 * a stream (of any count of streams); expert out */
		uint64_t tc = align256(sat_mul(E, 4)), pieces = 0;
		tc = sat_add(tc, 2 * align256(sat_mul(rows, 4)));
		tc = sat_add(tc, align256(sat_mul(rows, H)));
		tc = sat_add(tc, align256(sat_mul(rows, 4)));
		for (int s = 1; s <= MLENS_MOE_STREAMS_MAX; s++) {
			uint64_t p = sat_mul((uint64_t)s, mlens_moe_fp8_tc_piece_bytes(
							   mlens_moe_piece_rows((size_t)rows, s), H, I));
			pieces = p > pieces ? p : pieces;
		}
		tc = sat_add(sat_add(tc, pieces), align256(sat_mul(sat_mul(rows, H), 4)));
		return tc > moe ? tc : moe;
	}
	if (fp8 == MLENS_GPU_PLAN_FP8_DEQUANT)	/* each MoE stream's expert dequantized */
		moe = sat_add(moe, mlens_moe_fp8_dequant_bytes(H, I, MLENS_MOE_STREAMS_MAX,
							       es == 4 ? MLENS_GEMM_EXACT : gemm) +
				   256 * MLENS_MOE_STREAMS_MAX);
	return moe;
}

uint64_t mlens_gpu_plan_scratch_bytes(const struct mlens_perf_model *pm, int64_t n, int64_t group,
				     int64_t chunk, enum mlens_gemm_mode gemm)
{
	uint64_t g, c, H = (uint64_t)pm->hidden, I = (uint64_t)pm->inter;
	uint64_t E = (uint64_t)pm->experts, K = (uint64_t)pm->top_k;
	uint64_t qd = (uint64_t)(pm->heads * pm->head_dim);
	uint64_t es = (uint64_t)pm->wbytes, np = mlens_gpu_plan_gemm_parts(gemm, es), rows, moe, conv, widen, s;

	if (n <= 0)
		return 0;
	if (chunk <= 0)
		chunk = MLENS_GPU_PLAN_CHUNK;
	g = (uint64_t)mlens_gpu_plan_group_rows(n, group);
	c = (uint64_t)((int64_t)g < chunk ? (int64_t)g : chunk);
	/* one buffer sized by its largest user (kernels/cuda/backend_cuda.cu):
	 * a group's rows in the weight dtype for a GEMM (np parts when exact),
	 * the router's weights widened to fp32, a MoE chunk's gathered rows and
	 * intermediates, the sampler's tokens and log-probs */
	conv = es == 4 ? 0 : sat_mul(sat_mul(sat_mul(g, H > qd ? H : qd), es), np);
	widen = es == 4 ? 0 : sat_mul(sat_mul(E, H), 4);
	rows = sat_mul(c, K);
	I = mlens_gpu_plan_moe_width(I, K, (uint64_t)pm->mlp_inter);
	moe = mlens_gpu_plan_moe_scratch(rows, H, I, E, es, gemm, mlens_gpu_plan_fp8_path(pm, gemm));
	s = conv > moe ? conv : moe;
	if (s < widen)
		s = widen;
	if (s < sat_mul((uint64_t)n, 8) + 256)
		s = sat_mul((uint64_t)n, 8) + 256;
	/* reserved once at its size, in the allocator's 2 MiB granules */
	return s > UINT64_MAX - MLENS_GPU_PLAN_SCRATCH_ALIGN
		       ? UINT64_MAX
		       : (s + MLENS_GPU_PLAN_SCRATCH_ALIGN - 1) & ~(uint64_t)(MLENS_GPU_PLAN_SCRATCH_ALIGN - 1);
}

/* The activation sets a plan input asks for (0: the pipeline's fewest). */
static int plan_sets(const struct mlens_gpu_plan_in *in)
{
	return in->sets > 0 ? in->sets : MLENS_PIPE_SETS;
}

uint64_t mlens_gpu_plan_act_bytes(const struct mlens_perf_model *pm, int64_t n,
				 const struct mlens_gpu_plan_in *in)
{
	int64_t chunk = in->chunk > 0 ? in->chunk : MLENS_GPU_PLAN_CHUNK;
	int sets = plan_sets(in);
	uint64_t T, g, c, H = (uint64_t)pm->hidden;
	uint64_t E = (uint64_t)pm->experts, K = (uint64_t)pm->top_k, V = (uint64_t)pm->vocab;
	uint64_t qd = (uint64_t)(pm->heads * pm->head_dim);
	uint64_t kvd = (uint64_t)(pm->kv_heads * pm->head_dim);
	uint64_t per, shared, acc, stage;

	if (n <= 0)
		return 0;
	T = (uint64_t)n;
	g = (uint64_t)mlens_gpu_plan_group_rows(n, in->group);
	c = (uint64_t)((int64_t)g < chunk ? (int64_t)g : chunk);
	/* fp32: the residual x of every token; per set, for a group: q, att
	 * (none with att_half: the prefill attention writes into xn), k, v
	 * (they live across the group's CPU attention); once for all sets: xn
	 * (rows of the hidden size or qdim, the larger), router logits, top-k
	 * weights and ids (GA's and GB's own, daemon/exec/pipeline.c's pl_shared);
	 * logits of the tail's rows (a chunk, at most MLENS_GPU_PLAN_TAIL_ROWS) */
	per = (in->att_half ? 1 : 2) * qd + 2 * kvd;
	shared = (qd > H ? qd : H) + E + 2 * K;
	acc = sat_mul(sat_mul(T, H), 4);
	acc = sat_add(acc, sat_mul(sat_mul(sat_mul(g, per), 4), (uint64_t)sets));
	acc = sat_add(acc, sat_mul(sat_mul(g, shared), 4));
	acc = sat_add(acc, align256(sat_mul(sat_mul((uint64_t)mlens_gpu_plan_tail_rows((int64_t)c), V), 4)));
	acc = sat_add(acc, mlens_gpu_plan_scratch_bytes(pm, n, in->group, chunk, in->gemm));
	/* metadata staging (the CUDA backend's compute stream and side
	 * queue each hold one area): at most a few int32/int64 per token or
	 * tile, 8 bytes a group row for the side K/V append's slots */
	stage = sat_mul(T, 32) + 4096;
	return sat_add(acc, grown(stage, 64ull << 10));
}

/* The smallest group plan_auto tries with MoE calls of chunk tokens (0:
 * the default): the chunk or MLENS_GPU_PLAN_AUTO_GROUP_MIN, the smaller. */
static int64_t auto_group_floor(int64_t chunk)
{
	int64_t c = chunk > 0 ? chunk : MLENS_GPU_PLAN_CHUNK;
	return c < MLENS_GPU_PLAN_AUTO_GROUP_MIN ? c : MLENS_GPU_PLAN_AUTO_GROUP_MIN;
}

uint64_t mlens_gpu_plan_act_bytes_hw(const struct mlens_perf_model *pm, int64_t n, int64_t chunk,
				    const void *arg)
{
	/* the plan input's shape (NULL: the default group, fast GEMMs) with
	 * the model's chunk */
	struct mlens_gpu_plan_in s = { 0 };
	int64_t least = auto_group_floor(chunk);
	uint64_t best;
	if (arg)
		s = *(const struct mlens_gpu_plan_in *)arg;
	s.chunk = chunk;
	if (s.group != MLENS_GPU_PLAN_GROUP_AUTO)
		return mlens_gpu_plan_act_bytes(pm, n, &s);
	/* the groups plan_auto tries: the default, halved down to the least */
	s.group = MLENS_GPU_PLAN_GROUP;
	best = mlens_gpu_plan_act_bytes(pm, n, &s);
	for (s.group = MLENS_GPU_PLAN_GROUP / 2; s.group >= least; s.group /= 2) {
		uint64_t b = mlens_gpu_plan_act_bytes(pm, n, &s);
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
	const struct mlens_gpu_plan_in *in;
};

static uint64_t act_in(const void *arg, int64_t n)
{
	const struct act_in *a = arg;
	return mlens_gpu_plan_act_bytes(a->pm, n, a->in);
}

/* The most resident experts, at most top a layer, that leave act beside
 * them in budget (*fits true); else the cheapest residency up to top
 * (*fits false; *fixed gets its fixed bytes either way). */
static int pick_resident(const struct mlens_perf_model *pm, int top, uint64_t ws, uint64_t act,
			 uint64_t budget, bool *fits, uint64_t *fixed)
{
	for (int r = top; r >= 0; r--) {
		*fixed = mlens_gpu_plan_fixed_bytes(pm, r, ws);
		if (sat_add(*fixed, act) <= budget) {
			*fits = true;
			return r;
		}
	}
	*fits = false;
	return mlens_gpu_plan_min_fixed(pm, top, ws, fixed);
}

/* The plan for in->group rows a group (0: the default). */
static int plan_group(const struct mlens_perf_model *pm, const struct mlens_gpu_plan_in *in,
		      struct mlens_gpu_plan *out, char *err, size_t errlen)
{
	int64_t nmin = in->min_tokens > 0 ? in->min_tokens : 1;
	uint64_t ws = in->workspace ? in->workspace : MLENS_GPU_PLAN_WORKSPACE;
	int64_t chunk = in->chunk > 0 ? in->chunk : MLENS_GPU_PLAN_CHUNK;
	int64_t group = in->group > 0 ? in->group : MLENS_GPU_PLAN_GROUP;
	int E = (int)pm->experts, best_r, cap;
	uint64_t act_max, best_fixed, act_min;

	memset(out, 0, sizeof(*out));
	mlens_errf(err, errlen, "%s", "");
	if (in->max_tokens <= 0 || nmin > in->max_tokens || E <= 0) {
		mlens_errf(err, errlen, "GPU memory plan: token cap %lld (minimum %lld) is out of range",
		       (long long)in->max_tokens, (long long)nmin);
		return -EINVAL;
	}
	if (in->cap_resident && (in->max_resident < 0 || in->max_resident > E)) {
		mlens_errf(err, errlen, "GPU memory plan: resident_experts %d is outside 0 to %d, the "
			   "model's experts a layer", in->max_resident, E);
		return -EINVAL;
	}
	cap = in->cap_resident ? in->max_resident : E;
	out->budget = in->budget;
	out->workspace = ws;
	out->chunk = chunk;
	act_max = mlens_gpu_plan_act_bytes(pm, in->max_tokens, in);
	out->all_resident = sat_add(mlens_gpu_plan_fixed_bytes(pm, E, ws), act_max);
	/* the cheapest residency the cap allows, and so the least budget */
	best_r = mlens_gpu_plan_min_fixed(pm, cap, ws, &best_fixed);
	act_min = mlens_gpu_plan_act_bytes(pm, nmin, in);
	out->minimum = sat_add(best_fixed, act_min);
	if (in->budget < out->minimum) {
		/* with more activation sets than the fewest, say what the
		 * fewest would need (one group's q, k, v less) */
		uint64_t act = act_min;
		char alt[160] = "", held[96] = "";
		if (plan_sets(in) > MLENS_PIPE_SETS) {
			struct mlens_gpu_plan_in two = *in;
			uint64_t min2;
			two.sets = MLENS_PIPE_SETS;
			min2 = out->minimum - act + mlens_gpu_plan_act_bytes(pm, nmin, &two);
			if (in->budget >= min2)
				snprintf(alt, sizeof(alt),
					 ", or set pipeline_sets = %d, which needs %.2f GiB",
					 MLENS_PIPE_SETS, gib(min2));
		}
		if (best_r > 0)
			snprintf(held, sizeof(held), " with %d experts a layer", best_r);
		mlens_errf(err, errlen,
		       "GPU budget %.2f GiB is too small for this model: the hybrid pipeline needs at "
		       "least %.2f GiB (attention, norms, routers, embeddings and lm_head%s %.2f GiB, two "
		       "slots of one layer's experts %.2f GiB, activations for %lld tokens with %d groups' sets "
		       "%.2f GiB, workspace %.2f GiB); raise gpu_memory%s",
		       gib(in->budget), gib(out->minimum), held, gib(mlens_gpu_plan_resident_bytes(pm, best_r)),
		       gib(mlens_gpu_plan_slot_bytes(pm, best_r)), (long long)nmin,
		       plan_sets(in), gib(act), gib(ws), alt);
		return -ENOSPC;
	}
	/* most resident experts (up to the cap) that still leave the whole
	 * token cap; if none does, the cheapest one, with fewer tokens */
	{
		bool fits, free_fits;
		uint64_t fixed, free_fixed;
		out->resident_experts = pick_resident(pm, cap, ws, act_max, in->budget, &fits, &fixed);
		/* the cap binds where the plan without it keeps more */
		out->capped = cap < E && pick_resident(pm, E, ws, act_max, in->budget, &free_fits, &free_fixed) >
						 out->resident_experts;
		if (fits) {
			out->tokens = in->max_tokens;
		} else {
			const struct act_in a = { pm, in };
			out->tokens = mlens_gpu_plan_tokens_fit(act_in, &a, in->budget - fixed, in->max_tokens);
		}
	}
	out->resident = mlens_gpu_plan_resident_bytes(pm, out->resident_experts);
	out->slot = mlens_gpu_plan_streamed_bytes(pm, out->resident_experts);
	out->slots = mlens_gpu_plan_slot_bytes(pm, out->resident_experts);
	out->group = mlens_gpu_plan_group_rows(out->tokens, group);
	if (out->chunk > out->group)
		out->chunk = out->group;
	out->act = mlens_gpu_plan_act_bytes(pm, out->tokens, in);
	out->scratch = mlens_gpu_plan_scratch_bytes(pm, out->tokens, group, chunk, in->gemm);
	out->total = sat_add(sat_add(sat_add(out->resident, out->slots), out->act), ws);
	return 0;
}

/* MLENS_GPU_PLAN_GROUP_AUTO: halve the group from the default while the
 * plan falls short of max_tokens, down to auto_group_floor; keep the plan
 * that holds the most tokens (the larger group on a tie). */
static int plan_auto(const struct mlens_perf_model *pm, const struct mlens_gpu_plan_in *in,
		     struct mlens_gpu_plan *out, char *err, size_t errlen)
{
	struct mlens_gpu_plan_in g = *in;
	struct mlens_gpu_plan p;
	int64_t least = auto_group_floor(in->chunk);
	bool have = false;
	int rc, first = 0;

	for (g.group = MLENS_GPU_PLAN_GROUP;; g.group /= 2) {
		/* the default group's refusal is the one reported */
		rc = plan_group(pm, &g, &p, have || first ? NULL : err, errlen);
		if (g.group == MLENS_GPU_PLAN_GROUP)
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

uint64_t mlens_gpu_plan_budget(uint64_t gpu_memory, uint64_t dev_free)
{
	if (gpu_memory)
		return gpu_memory;
	return dev_free > MLENS_GPU_SAFETY_MARGIN ? dev_free - MLENS_GPU_SAFETY_MARGIN : 0;
}

/* The CUDA backend's scratch grows by doubling from 1 MiB: the size it
 * really asks for when an op needs bytes. */
static uint64_t scratch_rounded(uint64_t bytes)
{
	return grown(bytes ? bytes : 1, 1ull << 20);
}

/* decode attention splits contexts into pieces of this many keys and keeps
 * fp32 partials (head_dim + 2 per piece) for each query and head, each
 * query only its own pieces, in launches of at most DEC_PART_CAP bytes
 * unless one query alone needs more (kernels/cuda/attn_cuda.cu) */
#define DEC_SPLIT 256
#define DEC_PART_CAP (256ull << 20)

/* GPU-only mode's terms: the engine's activations for the step cap
 * (daemon/exec/engine.c's buffers) and its workspace (the CUDA backend's
 * op scratch at its largest, cuBLAS and metadata staging), beside every
 * weight and the KV pool. */
static int plan_gpu_only(const struct mlens_perf_model *pm, const struct mlens_gpu_plan_in *in,
			 struct mlens_gpu_plan *p)
{
	const struct mlens_model_config *c = in->model;
	uint64_t T = in->max_tokens > 0 ? (uint64_t)in->max_tokens : 4096;
	uint64_t H = (uint64_t)c->hidden_size, I = (uint64_t)c->intermediate_size;
	uint64_t qd = (uint64_t)(c->num_attention_heads * c->head_dim);
	uint64_t kvd = (uint64_t)(c->num_key_value_heads * c->head_dim);
	uint64_t E = (uint64_t)c->num_local_experts, K = (uint64_t)c->num_experts_per_tok;
	uint64_t V = (uint64_t)c->vocab_size, es = mlens_dtype_size(c->dtype);
	uint64_t chunk = T < MLENS_CUDA_MOE_CHUNK_TOKENS ? T : MLENS_CUDA_MOE_CHUNK_TOKENS, rows = chunk * K;
	uint64_t moe, dec, one, conv, ctx, kv_tok_bytes, kv_tokens;
	struct mlens_kv_cache kv_layout;
	/* exact GEMMs on half-precision weights: three parts per activation */
	uint64_t np = mlens_gpu_plan_gemm_parts(in->gemm, es);

	p->resident_experts = (int)pm->experts;
	p->tokens = (int64_t)T;
	p->resident = in->weight_bytes ? in->weight_bytes : mlens_gpu_plan_resident_bytes(pm, (int)pm->experts);
	p->slot = mlens_gpu_plan_streamed_bytes(pm, (int)pm->experts);	/* none: r = E */
	p->slots = mlens_gpu_plan_slot_bytes(pm, (int)pm->experts);
	p->kv = in->kv_bytes;
	/* engine.c: x, xn [T][H]; q, att [T][qdim]; k, v [T][kvdim]; router
	 * logits [T][E]; ids and weights [T][K]; logits for at most T rows */
	p->act = T * (2 * H + 2 * qd + 2 * kvd + E + 2 * K) * 4 + T * V * 4;

	/* One scratch area serves every op, so it is the largest single need. */
	moe = mlens_gpu_plan_moe_scratch(rows, H, mlens_gpu_plan_moe_width(I, K, (uint64_t)pm->mlp_inter),
					 E, es, in->gemm, mlens_gpu_plan_fp8_path(pm, in->gemm));
	conv = np * T * (H > qd ? H : qd) * 2;
	/* partials: at most every query at the longest context, which the KV
	 * pool and the model's context bound, and at most one launch's area */
	/* fp8 has the fewest bytes a token: the most tokens kv_bytes holds,
	 * whichever dtype the pool has */
	mlens_kv_layout(&kv_layout, c, MLENS_DTYPE_E4M3, 0, 1, NULL, 0);
	kv_tok_bytes = 2 * (uint64_t)mlens_kv_token_bytes(&kv_layout);
	kv_tokens = kv_tok_bytes ? in->kv_bytes / kv_tok_bytes : 0;
	ctx = (uint64_t)c->max_position_embeddings;
	if (kv_tokens < ctx)
		ctx = kv_tokens;
	one = (uint64_t)c->num_attention_heads * ((ctx + DEC_SPLIT - 1) / DEC_SPLIT) *
	      ((uint64_t)c->head_dim + 2) * 4;
	dec = T * one;
	if (dec > DEC_PART_CAP)
		dec = one > DEC_PART_CAP ? one : DEC_PART_CAP;
	p->workspace = moe > dec ? moe : dec;
	if (conv > p->workspace)
		p->workspace = conv;
	p->workspace = scratch_rounded(p->workspace);
	/* cuBLAS workspace (32 MiB) and the metadata staging area */
	p->workspace += (32ull << 20) + scratch_rounded(T * 64);

	p->total = p->resident + p->slots + p->kv + p->act + p->workspace;
	p->minimum = p->all_resident = p->total;
	/* a budget above what the device has free cannot be honoured either */
	p->fits = p->total <= p->budget && !(p->budget_given && p->dev_free && p->budget > p->dev_free);
	snprintf(p->summary, sizeof(p->summary),
		 "weights %.1f GiB + KV %.1f GiB + activations %.1f GiB + workspace %.1f GiB = %.1f GiB %s "
		 "the %.1f GiB budget (%s%.1f GiB free of %.1f GiB)",
		 gib(p->resident), gib(p->kv), gib(p->act), gib(p->workspace), gib(p->total),
		 p->total <= p->budget ? "fit" : "exceed",
		 gib(p->budget), p->budget_given ? "gpu_memory; device: " : "device free memory minus a margin; ",
		 gib(p->dev_free), gib(p->dev_total));
	if (p->total <= p->budget && !p->fits)
		snprintf(p->summary + strlen(p->summary), sizeof(p->summary) - strlen(p->summary),
			 ", but gpu_memory is more than the device has free");
	return p->fits ? 0 : -ENOSPC;
}

int mlens_gpu_plan_make(const struct mlens_perf_model *pm, const struct mlens_gpu_plan_in *in,
		       struct mlens_gpu_plan *out, char *err, size_t errlen)
{
	struct mlens_gpu_plan_in b = *in;
	int rc;

	b.budget = mlens_gpu_plan_budget(in->budget, in->dev_free);
	if (in->gpu_only) {
		memset(out, 0, sizeof(*out));
		mlens_errf(err, errlen, "%s", "");
		if (!in->model || pm->experts <= 0) {
			mlens_errf(err, errlen, "GPU memory plan: GPU-only mode needs the model's config");
			return -EINVAL;
		}
		if (in->cap_resident && in->max_resident < pm->experts) {
			mlens_errf(err, errlen, "GPU memory plan: GPU-only mode holds every expert; "
				   "resident_experts %d of %lld needs the hybrid plan", in->max_resident,
				   (long long)pm->experts);
			return -EINVAL;
		}
		rc = 0;
	} else if (in->group == MLENS_GPU_PLAN_GROUP_AUTO) {
		rc = plan_auto(pm, &b, out, err, errlen);
	} else if (in->group < 0) {
		memset(out, 0, sizeof(*out));
		mlens_errf(err, errlen, "GPU memory plan: a token group of %lld rows is out of range",
		       (long long)in->group);
		return -EINVAL;
	} else {
		rc = plan_group(pm, &b, out, err, errlen);
	}
	if (rc == -EINVAL)
		return rc;
	out->gpu_only = in->gpu_only;
	out->sets = plan_sets(in);
	out->att_half = in->att_half;
	out->gemm = in->gemm;
	out->budget = b.budget;
	out->budget_given = in->budget != 0;
	out->dev_free = in->dev_free;
	out->dev_total = in->dev_total;
	if (in->gpu_only) {
		rc = plan_gpu_only(pm, in, out);
		if (rc)
			mlens_errf(err, errlen, "GPU-only mode: %s", out->summary);
		return rc;
	}
	out->fits = rc == 0;
	return rc;
}

int mlens_gpu_plan_device(const struct mlens_backend *be, struct mlens_gpu_plan_in *in)
{
	size_t fr = 0, tot = 0;
	int rc;
	if (!be->ops || be->ops->host_memory || !MLENS_BACKEND_HAS(be->ops, mem_info))
		return -ENOTSUP;
	if ((rc = be->ops->mem_info(be->ctx, &fr, &tot)))
		return rc;
	in->dev_free = fr;
	in->dev_total = tot;
	return 0;
}

int mlens_gpu_plan_format(const struct mlens_gpu_plan *p, const struct mlens_perf_model *pm,
			 char *buf, size_t len)
{
	return snprintf(buf, len,
			"GPU memory plan: budget %.2f GiB = resident weights %.2f GiB (%d of %lld "
			"experts per layer%s) + 2 expert slots %.2f GiB + activations for %lld tokens "
			"in groups of %lld %.2f GiB + workspace %.2f GiB, %.2f GiB used; minimum %.2f GiB, GPU-only "
			"needs %.2f GiB",
			gib(p->budget), gib(p->resident), p->resident_experts, (long long)pm->experts,
			p->capped ? ", capped by resident_experts" : "", gib(p->slots), (long long)p->tokens,
			(long long)p->group, gib(p->act), gib(p->workspace),
			gib(p->total), gib(p->minimum), gib(p->all_resident));
}
