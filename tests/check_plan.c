/* Description: the GPU memory plan (daemon/plan/gpu_plan.c). Hybrid:
 * parts add up to its total, the total never exceeds the budget,
 * residency grows with the budget, a budget below the minimum is refused
 * with the minimum in the message, and the minimum itself runs; the
 * activation and op scratch bytes by hand, the plans of a few inputs as
 * they were, and the performance model sized with the plan's activations
 * and its minimum. GPU-only mode: the plan with every expert resident,
 * its parts what the engine and the CUDA backend allocate for a
 * Mixtral-8x7B-shaped model, a budget of 0 the free memory minus the
 * margin, a KV pool or a gpu_memory too large refused with the numbers.
 * fp8 experts: their dequantize scratch in both modes. resident_experts
 * caps the plan's residency.
 * The profile cache's key takes the effective budget. Pure arithmetic:
 * runs without a GPU. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/plan/gpu_plan.h"
#include "daemon/plan/profiler.h"
#include "daemon/exec/pipeprog.h"
#include "tests/check_common.h"
#include "tests/testmodel.h"

static void check_sum(const struct mlens_gpu_plan *p)
{
	ck_assert_uint_eq(p->total, p->resident + p->slots + p->act + p->workspace);
	ck_assert_uint_le(p->total, p->budget);
	ck_assert_uint_eq(p->slots, 2 * p->slot);
}

/* The benchmark's shape: Mixtral-8x7B, 8 layers, 8 GiB. */
START_TEST(plan_mixtral_8gib)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_gpu_plan_in in = { .budget = 8 * GIB, .max_tokens = 4096, .min_tokens = 512 };
	struct mlens_gpu_plan p;
	char err[512];
	uint64_t expert = 3ull * 4096 * 14336 * 2;

	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), 0);
	ck_assert_str_eq(err, "");
	check_sum(&p);
	ck_assert_int_eq(p.tokens, 4096);
	/* 8 GiB cannot keep a whole expert per layer beside two slots of 7:
	 * 8 layers x 1 expert = 2.6 GiB more resident, slots shrink by 0.66 GiB */
	ck_assert_int_eq(p.resident_experts, 0);
	ck_assert_uint_eq(p.slot, 8 * expert);
	ck_assert_uint_eq(p.resident, mlens_gpu_plan_resident_bytes(&pm, 0));
	ck_assert_uint_gt(p.all_resident, 23 * GIB);
	ck_assert_uint_lt(p.minimum, p.budget);

	/* plenty of memory: everything resident, no slots */
	in.budget = 40 * GIB;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), 0);
	check_sum(&p);
	ck_assert_int_eq(p.resident_experts, 8);
	ck_assert_uint_eq(p.slots, 0);
	ck_assert_uint_le(p.all_resident, 40 * GIB);
}
END_TEST

/* group = MLENS_GPU_PLAN_GROUP_AUTO: the largest of 4096, 2048, 1024 whose
 * plan holds the cap, else the one that holds the most tokens; refused as
 * the default group is when none fits. MoE calls of 1024 tokens (the
 * default chunk is 2048: see the end). */
START_TEST(plan_auto_group)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_gpu_plan_in in = { .budget = 8 * GIB, .max_tokens = 65536, .min_tokens = 512,
				       .chunk = 1024 };
	struct mlens_gpu_plan p, g[3];	/* groups of 4096, 2048, 1024 */
	char err[512];

	for (int i = 0; i < 3; i++) {
		in.group = 4096 >> i;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &g[i], NULL, 0), 0);
		ck_assert_int_eq(g[i].group, 4096 >> i);
	}
	/* at 8 GiB each halving frees activation memory for more tokens, none
	 * reaching 65536: the smallest group, never below the MoE chunk */
	ck_assert_int_lt(g[0].tokens, g[1].tokens);
	ck_assert_int_lt(g[1].tokens, g[2].tokens);
	ck_assert_int_lt(g[2].tokens, 65536);
	in.group = MLENS_GPU_PLAN_GROUP_AUTO;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), 0);
	ck_assert_str_eq(err, "");
	check_sum(&p);
	ck_assert_int_eq(p.group, 1024);
	ck_assert_int_eq(p.tokens, g[2].tokens);
	ck_assert_uint_eq(p.act, g[2].act);
	/* a cap that groups of 2048 hold but 4096 do not */
	in.max_tokens = (g[0].tokens + g[1].tokens) / 2;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_eq(p.group, 2048);
	ck_assert_int_eq(p.tokens, in.max_tokens);
	/* a cap the default group holds: the default */
	in.max_tokens = g[0].tokens;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_eq(p.group, 4096);
	ck_assert_int_eq(p.tokens, g[0].tokens);
	/* MoE calls of 2048 tokens: groups stop at 2048 (1024 would hold more) */
	in.max_tokens = 65536;
	in.chunk = 2048;
	in.budget = 8 * GIB;
	for (int i = 0; i < 3; i++) {
		in.group = 4096 >> i;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &g[i], NULL, 0), 0);
	}
	ck_assert_int_lt(g[1].tokens, g[2].tokens);
	in.group = MLENS_GPU_PLAN_GROUP_AUTO;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_eq(p.tokens, g[0].tokens > g[1].tokens ? g[0].tokens : g[1].tokens);
	ck_assert_int_eq(p.group, g[0].tokens > g[1].tokens ? g[0].group : g[1].group);
	/* the default chunk (a group's MoE in one call, the auto groups not
	 * below 2048): the same choice */
	in.chunk = 0;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &g[2], NULL, 0), 0);
	ck_assert_int_eq(g[2].group, p.group);
	ck_assert_int_eq(g[2].tokens, p.tokens);
	/* too small for any group: the default group's refusal */
	in.budget = GIB;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
	ck_assert_ptr_nonnull(strstr(err, "at least"));
	in.group = -2;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "out of range"));
}
END_TEST

/* The performance model sized with the plan's activation bytes (what
 * mlensd gives it in hybrid mode): its n_act is the token cap the plan
 * holds, for a fixed group and for the plan's own choice; without them
 * it keeps its own estimate. */
START_TEST(plan_model_n_act)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_perf_hw hw = { .b_io = 55e9, .b_mem = 150e9, .b_attn = 110e9, .c_gpu = 750e12,
				    .b_hbm = 4.2e12, .gpu_budget = 8 * GIB,
				    .gpu_workspace = MLENS_GPU_PLAN_WORKSPACE,
				    .chunk = MLENS_GPU_PLAN_CHUNK };
	struct mlens_perf_workload w = { .p = 512, .g = 32, .kv_tokens = 1310720 };
	struct mlens_perf_prediction pr;
	static const int64_t groups[] = { 4096, 2048, MLENS_GPU_PLAN_GROUP_AUTO };
	double own;

	mlens_perf_hw_roofline_lines(&hw, &pm);
	ck_assert_int_eq(mlens_perf_predict(&pm, &hw, &w, 0, &pr, NULL, 0), 0);
	own = pr.n_act;
	for (int i = 0; i < 3; i++) {
		struct mlens_gpu_plan_in in = { .budget = 8 * GIB, .max_tokens = 1 << 20,
					       .min_tokens = 512, .group = groups[i] };
		struct mlens_gpu_plan p;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
		ck_assert_int_eq(p.resident_experts, 0);
		hw.act_bytes = mlens_gpu_plan_act_bytes_hw;
		hw.act_arg = &in;
		ck_assert_int_eq(mlens_perf_predict(&pm, &hw, &w, 0, &pr, NULL, 0), 0);
		ck_assert_msg(pr.n_act == (double)p.tokens, "group %lld: model n_act %.0f, plan %lld",
			      (long long)groups[i], pr.n_act, (long long)p.tokens);
		ck_assert_uint_eq(pr.gpu_act, mlens_gpu_plan_act_bytes_hw(&pm, (int64_t)ceil(pr.tokens),
									 hw.chunk, &in));
	}
	/* the plan's choice holds more than the default group, which is
	 * close to the model's own estimate */
	ck_assert_double_gt(pr.n_act, 2 * own);
}
END_TEST

START_TEST(plan_monotone_and_never_above_budget)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_gpu_plan p;
	int last_r = -1;
	int64_t last_t = 0;

	for (uint64_t b = 5 * GIB; b <= 40 * GIB; b += GIB / 4) {
		struct mlens_gpu_plan_in in = { .budget = b, .max_tokens = 8192, .min_tokens = 128 };
		int rc = mlens_gpu_plan_make(&pm, &in, &p, NULL, 0);
		if (rc == -ENOSPC) {
			ck_assert_int_eq(last_r, -1);	/* refusals only below the first fit */
			ck_assert_uint_gt(p.minimum, b);
			continue;
		}
		ck_assert_int_eq(rc, 0);
		check_sum(&p);
		ck_assert_int_ge(p.resident_experts, last_r);
		if (p.resident_experts == last_r)
			ck_assert_int_ge(p.tokens, last_t);
		ck_assert_int_ge(p.tokens, 128);
		last_r = p.resident_experts;
		last_t = p.tokens;
	}
	ck_assert_int_eq(last_r, 8);
}
END_TEST

START_TEST(plan_refuses_below_minimum)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_gpu_plan_in in = { .budget = 2 * GIB, .max_tokens = 4096, .min_tokens = 512 };
	struct mlens_gpu_plan p;
	char err[512], want[64];

	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
	snprintf(want, sizeof(want), "at least %.2f GiB", (double)p.minimum / (double)GIB);
	ck_assert_msg(strstr(err, want), "message lacks '%s': %s", want, err);
	ck_assert_ptr_nonnull(strstr(err, "gpu_memory"));
	ck_assert_ptr_nonnull(strstr(err, "2.00 GiB"));
	/* the minimum itself runs, with exactly min_tokens; one byte less does not */
	in.budget = p.minimum;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), 0);
	check_sum(&p);
	ck_assert_int_eq(p.tokens, 512);
	ck_assert_uint_eq(p.total, p.minimum);
	in.budget = p.minimum - 1;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
	ck_assert_msg(!strstr(err, "pipeline_sets"), "two sets, nothing fewer to offer: %s", err);
	/* three sets (mlensd's default) need one group's q, k, v more: a
	 * budget between the two minima names pipeline_sets = 2 and what it
	 * needs, which then runs */
	{
		uint64_t min2 = p.minimum, min3;
		in.sets = 3;
		in.budget = min2;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
		min3 = p.minimum;
		ck_assert_uint_gt(min3, min2);
		snprintf(want, sizeof(want), "pipeline_sets = 2, which needs %.2f GiB",
			 (double)min2 / (double)GIB);
		ck_assert_msg(strstr(err, want), "message lacks '%s': %s", want, err);
		ck_assert_ptr_nonnull(strstr(err, "with 3 groups' sets"));
		/* below both minima: only gpu_memory helps */
		in.budget = min2 - 1;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
		ck_assert_msg(!strstr(err, "pipeline_sets"), "%s", err);
		in.budget = min3;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), 0);
		in.sets = 2;
		in.budget = min2;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), 0);
		in.sets = 0;
	}
	/* bad inputs */
	in.budget = 8 * GIB;
	in.max_tokens = 0;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), -EINVAL);
	in.max_tokens = 100;
	in.min_tokens = 101;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), -EINVAL);
}
END_TEST

/* The activation formula: per-token buffers by hand for a tiny model. */
/* act_bytes of n tokens in groups of group rows, MoE chunks of 8, fast
 * GEMMs, sets sets, att_half */
static uint64_t act8(const struct mlens_perf_model *pm, int64_t n, int64_t group, int sets,
		     bool att_half)
{
	struct mlens_gpu_plan_in in = { .group = group, .chunk = 8, .gemm = MLENS_GEMM_FAST,
				       .sets = sets, .att_half = att_half };
	return mlens_gpu_plan_act_bytes(pm, n, &in);
}

START_TEST(plan_act_bytes)
{
	struct mlens_model_config c;
	struct mlens_perf_model pm;
	uint64_t per, shared, want;
	memset(&c, 0, sizeof(c));
	c.vocab_size = 100;
	c.hidden_size = 16;
	c.intermediate_size = 24;
	c.num_hidden_layers = 2;
	c.num_attention_heads = 4;
	c.num_key_value_heads = 2;
	c.head_dim = 4;
	c.num_local_experts = 4;
	c.num_experts_per_tok = 2;
	c.dtype = MLENS_DTYPE_F32;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_F32), 0);
	ck_assert_uint_eq(act8(&pm, 0, 0, 0, false), 0);
	/* 10 tokens, one group of 10 rows, chunk 8: the residual of every
	 * token (H = 16 floats); per set (two) a group's 2qd + 2kvd = 32+16 =
	 * 48 floats a row, once for both sets its H + E + 2K = 16+4+4 = 24
	 * (xn, router logits, weights, ids); logits of 8 rows = 3200 B (3328
	 * aligned); scratch: MoE chunk of 16 rows is under 2 MiB -> 2 MiB;
	 * staging 10*32+4096 -> 64 KiB */
	per = 48 * 4;
	shared = 24 * 4;
	want = 10 * 16 * 4 + 2 * 10 * per + 10 * shared + 3328 + (2u << 20) + (64u << 10);
	ck_assert_uint_eq(act8(&pm, 10, 0, 0, false), want);
	ck_assert_uint_gt(act8(&pm, 11, 0, 0, false), want);
	/* 12 tokens in groups of 4: sets hold 4 rows, lm_head chunks of 4
	 * (1600 B, 1792 aligned) */
	want = 12 * 16 * 4 + 2 * 4 * per + 4 * shared + 1792 + (2u << 20) + (64u << 10);
	ck_assert_uint_eq(act8(&pm, 12, 4, 0, false), want);
	ck_assert_uint_eq(act8(&pm, 12, 4, 2, false), want);
	/* three sets (pipeline_sets = 3): one more group of q, k, v, att */
	ck_assert_uint_eq(act8(&pm, 12, 4, 3, false), want + 4 * per);
	/* the attention output up in bf16 (att_half): no fp32 att in a set
	 * (qd = 16 floats a row), the prefill attention's rows in xn */
	ck_assert_uint_eq(act8(&pm, 12, 4, 2, true),
			  want - 2 * 4 * 16 * 4);
	ck_assert_uint_eq(act8(&pm, 12, 4, 3, true),
			  want + 4 * per - 3 * 4 * 16 * 4);
	/* qdim above the hidden size (8 heads of 4: 32 floats): xn takes
	 * the wider rows, where the prefill attention's output may go */
	c.num_attention_heads = 8;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_F32), 0);
	per = (2 * 32 + 2 * 8) * 4;
	shared = (32 + 4 + 4) * 4;
	want = 12 * 16 * 4 + 2 * 4 * per + 4 * shared + 1792 + (2u << 20) + (64u << 10);
	ck_assert_uint_eq(act8(&pm, 12, 4, 2, false), want);
	/* the group grows when a step would need more groups than a program holds */
	ck_assert_int_eq(mlens_gpu_plan_group_rows(10, 4), 4);
	ck_assert_int_eq(mlens_gpu_plan_group_rows(3, 4), 3);
	ck_assert_int_eq(mlens_gpu_plan_group_rows(1 << 20, 16),
			 (1 << 20) / (MLENS_PIPE_MAX_GROUPS / 4));
}
END_TEST

/* The op scratch the pipeline reserves, for the 8x7B shape in groups of
 * 2048 with MoE chunks of 1024 tokens (2048 routed rows), by hand: expert
 * counts 256 B, perm and inv 8 KiB each, gathered x 2048 x 4096 bf16 =
 * 16 MiB, gate and up 2048 x 14336 bf16 = 56 MiB each (silu(g)u goes over
 * gate) and 1 KiB each for the MoE streams' slices to be aligned, expert
 * out 2048 x 4096 fp32 = 32 MiB: 167,790,848 B, rounded up to 2 MiB
 * granules 169,869,312. Exact GEMMs keep gate and up in fp32 (112 MiB
 * each) and split x and silu(g)u (2048 x 14336 bf16 = 56 MiB) in three:
 * 494,947,584 B, 497,025,024 rounded. The plan counts it in its
 * activations. */
START_TEST(plan_scratch_bytes)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_gpu_plan_in in = { .budget = 8 * GIB, .max_tokens = 65536, .min_tokens = 512,
				       .group = 2048, .chunk = 1024 };
	struct mlens_gpu_plan fast, exact;

	ck_assert_uint_eq(mlens_gpu_plan_scratch_bytes(&pm, 33547, 2048, 1024, MLENS_GEMM_FAST),
			  169869312ull);
	ck_assert_uint_eq(mlens_gpu_plan_scratch_bytes(&pm, 33547, 2048, 1024, MLENS_GEMM_EXACT),
			  497025024ull);
	/* the default chunk, the group's 2048 tokens (4096 routed rows):
	 * counts 256 B, perm and inv 16 KiB each, x 32 MiB, gate and up still
	 * 56 MiB + 1 KiB each (MLENS_CUDA_MOE_GU_ROWS), expert out 64 MiB:
	 * 218,138,880 B, 220,200,960 rounded */
	ck_assert_uint_eq(mlens_gpu_plan_scratch_bytes(&pm, 33547, 2048, 0, MLENS_GEMM_FAST),
			  220200960ull);
	/* a step of 3 tokens: the MoE chunk is the 3 rows' */
	ck_assert_uint_eq(mlens_gpu_plan_scratch_bytes(&pm, 3, 2048, 1024, MLENS_GEMM_FAST),
			  MLENS_GPU_PLAN_SCRATCH_ALIGN);
	ck_assert_uint_eq(mlens_gpu_plan_scratch_bytes(&pm, 0, 2048, 1024, MLENS_GEMM_FAST), 0);
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &fast, NULL, 0), 0);
	in.gemm = MLENS_GEMM_EXACT;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &exact, NULL, 0), 0);
	check_sum(&fast);
	check_sum(&exact);
	ck_assert_uint_eq(fast.scratch, 169869312ull);
	ck_assert_uint_eq(exact.scratch, 497025024ull);
	ck_assert_uint_lt(fast.scratch, fast.act);
	/* the exact plan's larger scratch costs it tokens: 16 KiB of residual
	 * each, so about (497025024 - 169869312) / 16384 = 19968 fewer */
	ck_assert_int_lt(exact.tokens, fast.tokens);
	ck_assert_int_ge(fast.tokens - exact.tokens, 19800);
	ck_assert_int_le(fast.tokens - exact.tokens, 20100);
	ck_assert_uint_le(exact.total, exact.budget);
}
END_TEST

/* The hybrid plan's choices and bytes for a few inputs, as the plan made
 * them before it became one module with GPU-only mode's (the same
 * arithmetic: a change here is a change of behaviour). */
/* input: layers, budget, max and min tokens, group, chunk, gemm, sets,
 * att_half; out: rc, resident experts, tokens, group and chunk rows, then
 * bytes: resident, slots, act, scratch, total, minimum, all resident */
struct plan_case {
	int layers;
	uint64_t budget;
	int64_t max_tokens, min_tokens, group, chunk;
	int gemm, sets, att_half;
	int rc, resident_experts;
	int64_t tokens, group_rows, chunk_rows;
	uint64_t resident, slots, act, scratch, total, minimum, all_resident;
};

START_TEST(plan_unchanged)
{
	static const struct plan_case cs[] = {
		{ 8, 8 * GIB, 4096, 512, 0, 0, 0, 0, 0,
		  0, 0, 4096, 4096, 4096, 1196040192ull, 5637144576ull, 922157056ull, 320864256ull, 8090886144ull, 7379058688ull, 25002319872ull },
		{ 8, 8 * GIB, 65536, 512, -1, 0, 0, 2, 0,
		  0, 0, 52881, 2048, 2048, 1196040192ull, 5637144576ull, 1421197312ull, 220200960ull, 8589926400ull, 7379058688ull, 25710796800ull },
		{ 8, 8 * GIB, 65536, 512, -1, 0, 1, 3, 1,
		  0, 0, 31953, 2048, 2048, 1196040192ull, 5637144576ull, 1421197312ull, 580911104ull, 8589926400ull, 7538442240ull, 26054729728ull },
		{ 8, 12 * GIB, 65536, 512, -1, 0, 0, 2, 1,
		  0, 1, 65536, 4096, 4096, 4014612480ull, 4932501504ull, 1798504448ull, 320864256ull, 11081162752ull, 7362281472ull, 25878667264ull },
		{ 8, 20 * GIB, 16384, 128, 2048, 1024, 1, 2, 0,
		  0, 6, 16384, 2048, 1024, 18107473920ull, 1409286144ull, 1099005952ull, 497025024ull, 20951310336ull, 7262779392ull, 25179168768ull },
		{ 8, 40 * GIB, 65536, 512, -1, 0, 0, 2, 1,
		  0, 8, 65536, 4096, 4096, 23744618496ull, 0ull, 1798504448ull, 320864256ull, 25878667264ull, 7362281472ull, 25878667264ull },
		{ 32, 24 * GIB, 65536, 512, -1, 0, 0, 2, 1,
		  0, 1, 65536, 4096, 4096, 14485561344ull, 4932501504ull, 1798504448ull, 320864256ull, 21552111616ull, 9377513472ull, 95539634176ull },
		{ 32, 6 * GIB, 65536, 4096, 0, 0, 0, 3, 0,
		  -ENOSPC, 0, 0, 0, 4096, 0ull, 0ull, 0ull, 0ull, 0ull, 10273890304ull, 95841624064ull },
		{ 1, 3 * GIB, 8192, 64, 0, 0, 0, 0, 0,
		  -ENOSPC, 0, 0, 0, 4096, 0ull, 0ull, 0ull, 0ull, 0ull, 3790564352ull, 4751908864ull },
		{ 1, 5 * GIB, 8192, 64, 0, 0, 0, 0, 0,
		  0, 8, 8192, 4096, 4096, 3426836480ull, 0ull, 989528064ull, 320864256ull, 4751908864ull, 3790564352ull, 4751908864ull },
	};
	for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++) {
		const struct plan_case *c = &cs[i];
		struct mlens_perf_model pm = mlens_test_mixtral_pm(c->layers);
		struct mlens_gpu_plan_in in = { .budget = c->budget, .max_tokens = c->max_tokens,
					       .min_tokens = c->min_tokens, .group = c->group,
					       .chunk = c->chunk, .gemm = (enum mlens_gemm_mode)c->gemm,
					       .sets = c->sets, .att_half = c->att_half };
		struct mlens_gpu_plan p;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), c->rc);
		ck_assert_uint_eq(p.minimum, c->minimum);
		ck_assert_uint_eq(p.all_resident, c->all_resident);
		if (c->rc)
			continue;
		ck_assert_msg(p.resident_experts == c->resident_experts && p.tokens == c->tokens &&
			      p.group == c->group_rows && p.chunk == c->chunk_rows,
			      "case %zu: r %d tokens %lld group %lld chunk %lld", i, p.resident_experts,
			      (long long)p.tokens, (long long)p.group, (long long)p.chunk);
		ck_assert_uint_eq(p.resident, c->resident);
		ck_assert_uint_eq(p.slots, c->slots);
		ck_assert_uint_eq(p.act, c->act);
		ck_assert_uint_eq(p.scratch, c->scratch);
		ck_assert_uint_eq(p.total, c->total);
		ck_assert(!p.gpu_only && p.fits);
		ck_assert_int_eq(p.sets, c->sets ? c->sets : MLENS_PIPE_SETS);
		ck_assert_int_eq(p.att_half, c->att_half);
	}
}
END_TEST

/* The performance model's minimum budget is the plan's: with the plan's
 * activation bytes and workspace it says the plan's minimum; with its own
 * activation estimate the numbers it gave before. */
START_TEST(plan_model_min_budget)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_gpu_plan_in in = { .budget = 8 * GIB, .max_tokens = 65536, .min_tokens = 512,
				       .group = 2048, .sets = 3 };
	struct mlens_perf_hw hw = { .gpu_workspace = MLENS_GPU_PLAN_WORKSPACE, .chunk = MLENS_GPU_PLAN_CHUNK };
	static const struct { int layers; uint64_t min; } own[] = {
		{ 1, 4011442176ull }, { 4, 7081918464ull }, { 16, 8089534464ull } };
	struct mlens_gpu_plan p;

	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	hw.act_bytes = mlens_gpu_plan_act_bytes_hw;
	hw.act_arg = &in;
	ck_assert_uint_eq(p.workspace, hw.gpu_workspace);
	ck_assert_uint_eq(mlens_perf_min_budget(&pm, &hw, 512), p.minimum);
	ck_assert_uint_eq(p.minimum, mlens_gpu_plan_minimum(&pm, p.workspace,
							    mlens_gpu_plan_act_bytes(&pm, 512, &in)));
	/* one byte below it the plan refuses, at it the plan runs */
	in.budget = p.minimum - 1;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), -ENOSPC);
	in.budget = p.minimum;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_ge(p.tokens, 512);
	hw.act_bytes = NULL;
	for (size_t i = 0; i < sizeof(own) / sizeof(own[0]); i++) {
		pm = mlens_test_mixtral_pm(own[i].layers);
		ck_assert_uint_eq(mlens_perf_min_budget(&pm, &hw, 512), own[i].min);
	}
}
END_TEST

/* resident_experts (cap_resident, max_resident): r is the cap where the
 * budget holds more, the budget's choice where it holds less; cap 0
 * streams every expert and its minimum is the plan's; with one layer,
 * where fewer resident experts need more (two slots of more experts),
 * the minimum is the cheapest residency under the cap; a cap outside
 * 0..E is refused, and so is GPU-only mode with one below E. */
START_TEST(plan_resident_cap)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8), one = mlens_test_mixtral_pm(1);
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan_in in = { .budget = 40 * GIB, .max_tokens = 4096, .min_tokens = 512 };
	struct mlens_gpu_plan p, free_p;
	uint64_t expert = 3ull * 4096 * 14336 * 2, ws = MLENS_GPU_PLAN_WORKSPACE, act512;
	char err[512], line[512];
	int k = -1;

	/* the budget holds every expert: the cap sets r */
	in.cap_resident = true;
	in.max_resident = 3;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), 0);
	check_sum(&p);
	ck_assert_int_eq(p.resident_experts, 3);
	ck_assert(p.capped);
	ck_assert_int_eq(p.tokens, 4096);
	ck_assert_uint_eq(p.slot, 5 * expert);
	ck_assert_uint_eq(p.resident, mlens_gpu_plan_resident_bytes(&pm, 3));
	mlens_gpu_plan_format(&p, &pm, line, sizeof(line));
	ck_assert_msg(strstr(line, "(3 of 8 experts per layer, capped by resident_experts)"), "%s", line);
	/* a cap of E is no cap */
	in.max_resident = 8;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_eq(p.resident_experts, 8);
	ck_assert(!p.capped);
	mlens_gpu_plan_format(&p, &pm, line, sizeof(line));
	ck_assert_msg(strstr(line, "(8 of 8 experts per layer)"), "%s", line);

	/* a budget whose own choice is 0 < k < 8: a cap at or above k leaves
	 * it, a cap below sets it */
	in.cap_resident = false;
	for (uint64_t b = 8 * GIB; b <= 40 * GIB && k < 0; b += GIB / 4) {
		in.budget = b;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &free_p, NULL, 0), 0);
		if (free_p.resident_experts > 0 && free_p.resident_experts < 7)
			k = free_p.resident_experts;
	}
	ck_assert_int_gt(k, 0);
	ck_assert(!free_p.capped);
	in.cap_resident = true;
	for (int cap = k; cap <= 8; cap++) {
		in.max_resident = cap;
		ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
		ck_assert_int_eq(p.resident_experts, k);
		ck_assert(!p.capped);
		ck_assert_uint_eq(p.total, free_p.total);
		ck_assert_int_eq(p.tokens, free_p.tokens);
	}
	in.max_resident = k - 1;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	check_sum(&p);
	ck_assert_int_eq(p.resident_experts, k - 1);
	ck_assert(p.capped);
	ck_assert_uint_lt(p.total, free_p.total);

	/* cap 0: every expert streams; with eight layers the cheapest
	 * residency is 0 anyway, so the minimum is the plan's, and it runs */
	in.max_resident = 0;
	in.budget = 40 * GIB;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	check_sum(&p);
	ck_assert_int_eq(p.resident_experts, 0);
	ck_assert(p.capped);
	ck_assert_uint_eq(p.slots, 2 * 8 * expert);
	act512 = mlens_gpu_plan_act_bytes(&pm, 512, &in);
	ck_assert_uint_eq(p.minimum, mlens_gpu_plan_minimum(&pm, ws, act512));
	in.budget = p.minimum;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_eq(p.resident_experts, 0);
	ck_assert_int_eq(p.tokens, 512);
	ck_assert_uint_eq(p.total, p.minimum);
	in.budget = p.minimum - 1;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), -ENOSPC);

	/* one layer: keeping experts costs less than streaming them (each
	 * resident one saves two slots' copies), so the cap raises the
	 * minimum to its own cheapest residency: the cap itself */
	for (int cap = 0; cap <= 8; cap += 4) {
		uint64_t fixed;
		in.max_resident = cap;
		in.budget = 40 * GIB;
		act512 = mlens_gpu_plan_act_bytes(&one, 512, &in);
		ck_assert_int_eq(mlens_gpu_plan_min_fixed(&one, cap, ws, &fixed), cap);
		ck_assert_uint_eq(fixed, mlens_gpu_plan_fixed_bytes(&one, cap, ws));
		ck_assert_int_eq(mlens_gpu_plan_make(&one, &in, &p, NULL, 0), 0);
		ck_assert_uint_eq(p.minimum, fixed + act512);
		if (cap < 8)
			ck_assert_uint_gt(p.minimum, mlens_gpu_plan_minimum(&one, ws, act512));
		else
			ck_assert_uint_eq(p.minimum, mlens_gpu_plan_minimum(&one, ws, act512));
		in.budget = p.minimum;
		ck_assert_int_eq(mlens_gpu_plan_make(&one, &in, &p, err, sizeof(err)), 0);
		ck_assert_int_eq(p.resident_experts, cap);
		ck_assert_int_eq(p.tokens, 512);
		ck_assert_uint_le(p.total, p.budget);
		in.budget = p.minimum - 1;
		ck_assert_int_eq(mlens_gpu_plan_make(&one, &in, &p, err, sizeof(err)), -ENOSPC);
		if (cap == 4)
			ck_assert_msg(strstr(err, "and lm_head with 4 experts a layer"), "%s", err);
	}

	/* out of range, and GPU-only mode below E */
	in.budget = 40 * GIB;
	in.max_resident = 9;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "resident_experts 9 is outside 0 to 8"), "%s", err);
	in.max_resident = -1;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), -EINVAL);
	in.max_resident = 7;
	in.gpu_only = true;
	in.model = &c;
	in.kv_bytes = GIB;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "resident_experts 7 of 8 needs the hybrid plan"), "%s", err);
	in.max_resident = 8;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_eq(p.resident_experts, 8);
}
END_TEST

/* ==== GPU-only mode: the plan with every expert resident ==== */

/* GPU-only mode's plan for model c: weights bytes of weights (0: the
 * model's count), kv bytes of KV pool, steps of tokens, GEMM mode gemm,
 * gpu_memory budget, the device's free and total memory. 0 when it fits. */
static int gpu_only(struct mlens_gpu_plan *p, const struct mlens_model_config *c, uint64_t weights,
		    uint64_t kv, int tokens, enum mlens_gemm_mode gemm, uint64_t budget, uint64_t fr,
		    uint64_t tot)
{
	struct mlens_perf_model pm;
	struct mlens_gpu_plan_in in = { .budget = budget, .dev_free = fr, .dev_total = tot,
				       .max_tokens = tokens, .gemm = gemm, .gpu_only = true,
				       .model = c, .weight_bytes = weights, .kv_bytes = kv };
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, c, MLENS_DTYPE_BF16), 0);
	return mlens_gpu_plan_make(&pm, &in, p, NULL, 0);
}

/* GPU-only mode's plan is the hybrid plan with all experts resident: the
 * same resident weights and no slots; the engine's KV pool, activations
 * and workspace on top. A budget that holds it is GPU-only mode. */
START_TEST(plan_gpu_only_all_resident)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_perf_model pm;
	struct mlens_gpu_plan_in in = { .budget = 40 * GIB, .max_tokens = 4096, .min_tokens = 512 };
	struct mlens_gpu_plan h, g;

	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16), 0);
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &h, NULL, 0), 0);
	ck_assert_int_eq(h.resident_experts, 8);
	ck_assert(!h.gpu_only);
	ck_assert_int_eq(gpu_only(&g, &c, 0, 4 * GIB, 4096, MLENS_GEMM_FAST, 40 * GIB, 0, 0), 0);
	ck_assert(g.gpu_only && g.fits);
	ck_assert_int_eq(g.resident_experts, h.resident_experts);
	ck_assert_uint_eq(g.resident, h.resident);
	ck_assert_uint_eq(g.resident, mlens_gpu_plan_resident_bytes(&pm, 8));
	ck_assert_uint_eq(g.slot, h.slot);
	ck_assert_uint_eq(g.slots, 0);
	ck_assert_uint_eq(h.slots, 0);
	ck_assert_uint_eq(h.kv, 0);
	ck_assert_uint_eq(g.kv, 4 * GIB);
	ck_assert_uint_eq(g.total, g.resident + g.kv + g.act + g.workspace);
	ck_assert_uint_eq(g.budget, 40 * GIB);
	/* the KV pool that does not fit beside them: hybrid mode, whose plan
	 * at that budget still keeps every expert */
	ck_assert_int_eq(gpu_only(&g, &c, 0, 20 * GIB, 4096, MLENS_GEMM_FAST, 40 * GIB, 0, 0), -ENOSPC);
	ck_assert(!g.fits);
	ck_assert_uint_eq(g.resident, h.resident);
}
END_TEST

START_TEST(plan_gpu_only_parts)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p;
	/* 23.7 GB of weights, 40 GiB of KV, the default 4096-token step */
	ck_assert_int_eq(gpu_only(&p, &c, 23700000000ull, 40 * GIB, 4096, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB), 0);
	ck_assert_uint_eq(p.resident, 23700000000ull);
	ck_assert_uint_eq(p.kv, 40 * GIB);
	/* x, xn [T][4096]; q, att [T][4096]; k, v [T][1024]; router [T][8];
	 * ids, weights [T][2]; logits [T][32000], all fp32 */
	ck_assert_uint_eq(p.act, 4096ull * (8192 + 8192 + 2048 + 8 + 4) * 4 + 4096ull * 32000 * 4);
	/* MoE scratch for 8192 routed rows is 0.30 GiB (gathered x 64 MiB,
	 * gate and up in bf16 for 2048 rows of pieces 56 MiB each, silu(g)u
	 * over gate, out 128 MiB) and rounds up to the next power of two, as
	 * the backend's scratch does. Decode partials for 4096 queries over
	 * 32768 keys would be 8.1 GiB at once; they go through in launches of
	 * 256 MiB, below the MoE's need */
	ck_assert_uint_ge(p.workspace, GIB / 2);
	ck_assert_uint_lt(p.workspace, GIB / 2 + (64ull << 20));
	ck_assert_uint_eq(p.total, p.resident + p.kv + p.act + p.workspace);
	ck_assert_uint_eq(p.budget, 139 * GIB - MLENS_GPU_SAFETY_MARGIN);
	ck_assert(!p.budget_given);
	ck_assert(p.fits);
	ck_assert_ptr_nonnull(strstr(p.summary, "KV 40.0 GiB"));
	ck_assert_ptr_nonnull(strstr(p.summary, " fit the "));
}
END_TEST

/* fp8 experts: each MoE stream dequantizes its expert before the GEMMs
 * (bf16 for fast GEMMs, fp32 for exact ones), one formula for the hybrid
 * and the GPU-only plan; their streamed bytes are the fp8 experts'. */
START_TEST(plan_fp8_scratch)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_perf_model bf, f8;
	struct mlens_gpu_plan gb, g8;
	const uint64_t H = 4096, I = 14336, S = MLENS_MOE_STREAMS_MAX;
	uint64_t deq_fast = mlens_moe_fp8_dequant_bytes(H, I, (int)S, MLENS_GEMM_FAST) + 256 * S;
	uint64_t deq_exact = mlens_moe_fp8_dequant_bytes(H, I, (int)S, MLENS_GEMM_EXACT) + 256 * S;

	ck_assert_uint_eq(deq_fast, S * 3 * H * I * 2 + 256 * S);
	ck_assert_uint_eq(deq_exact, S * 3 * H * I * 4 + 256 * S);
	ck_assert_uint_eq(mlens_gpu_plan_moe_scratch(4096, H, I, 8, 2, MLENS_GEMM_FAST, MLENS_GPU_PLAN_FP8_DEQUANT),
			  mlens_gpu_plan_moe_scratch(4096, H, I, 8, 2, MLENS_GEMM_FAST, MLENS_GPU_PLAN_FP8_NONE) + deq_fast);
	ck_assert_uint_eq(mlens_gpu_plan_moe_scratch(4096, H, I, 8, 2, MLENS_GEMM_EXACT, MLENS_GPU_PLAN_FP8_DEQUANT),
			  mlens_gpu_plan_moe_scratch(4096, H, I, 8, 2, MLENS_GEMM_EXACT, MLENS_GPU_PLAN_FP8_NONE) + deq_exact);
	ck_assert_int_eq(mlens_perf_model_from_config(&bf, &c, MLENS_DTYPE_BF16), 0);
	c.expert_dtype = MLENS_DTYPE_E4M3;
	c.expert_scale = (struct mlens_wscale){ MLENS_WSCALE_CHANNEL, 0, 0 };
	ck_assert_int_eq(mlens_perf_model_from_config(&f8, &c, MLENS_DTYPE_BF16), 0);
	/* the hybrid plan's op scratch: a MoE chunk of 1024 tokens (2048
	 * routed rows) and its dequantized experts, in 2 MiB granules */
	uint64_t moe = mlens_gpu_plan_moe_scratch(2048, H, I, 8, 2, MLENS_GEMM_FAST, MLENS_GPU_PLAN_FP8_DEQUANT);
	const uint64_t A = MLENS_GPU_PLAN_SCRATCH_ALIGN;
	ck_assert_uint_eq(mlens_gpu_plan_scratch_bytes(&f8, 4096, 2048, 1024, MLENS_GEMM_FAST),
			  (moe + A - 1) / A * A);
	ck_assert_uint_gt(mlens_gpu_plan_scratch_bytes(&f8, 4096, 2048, 1024, MLENS_GEMM_FAST),
			  mlens_gpu_plan_scratch_bytes(&bf, 4096, 2048, 1024, MLENS_GEMM_FAST) + deq_fast - A);
	/* on fp8 tensor cores: no dequantized copy. counts, perm, inv, the
	 * 2048 rows in e4m3 and their scales, 4 streams' pieces of 512 rows
	 * (bf16 gate and up, silu(g)u in e4m3 and its scales, room for the
	 * scale vectors: the most of 1..4 streams), the fp32 outputs */
	ck_assert_int_eq(mlens_gpu_plan_fp8_path(&f8, MLENS_GEMM_FAST), MLENS_GPU_PLAN_FP8_DEQUANT);
	f8.expert_fp8_tc = true;
	ck_assert_int_eq(mlens_gpu_plan_fp8_path(&f8, MLENS_GEMM_FAST), MLENS_GPU_PLAN_FP8_TC);
	ck_assert_int_eq(mlens_gpu_plan_fp8_path(&f8, MLENS_GEMM_EXACT), MLENS_GPU_PLAN_FP8_DEQUANT);
	ck_assert_int_eq(mlens_gpu_plan_fp8_path(&bf, MLENS_GEMM_FAST), MLENS_GPU_PLAN_FP8_NONE);
	uint64_t tc = mlens_gpu_plan_moe_scratch(2048, H, I, 8, 2, MLENS_GEMM_FAST, MLENS_GPU_PLAN_FP8_TC);
	ck_assert_uint_eq(tc, 256 + 2 * 8192 + 2048 * H + 8192 +
				      4 * (2 * 512 * I * 2 + 512 * I + 2048 + (512 + 4 + I) * 4 + 240) +
				      2048 * H * 4);
	ck_assert_uint_lt(tc, moe - deq_fast + 32 * (1 << 20));
	ck_assert_uint_eq(mlens_gpu_plan_scratch_bytes(&f8, 4096, 2048, 1024, MLENS_GEMM_FAST),
			  (tc + A - 1) / A * A);
	f8.expert_fp8_tc = false;
	ck_assert_uint_eq(mlens_gpu_plan_streamed_bytes(&f8, 2), 6 * f8.expert_bytes);
	ck_assert_uint_lt(mlens_gpu_plan_streamed_bytes(&f8, 2), mlens_gpu_plan_streamed_bytes(&bf, 2));
	/* GPU-only mode's workspace */
	ck_assert_int_eq(gpu_only(&gb, &c, 0, 4 * GIB, 4096, MLENS_GEMM_FAST, 200 * GIB, 0, 0), 0);
	c.expert_dtype = MLENS_DTYPE_BF16;
	c.expert_scale.kind = MLENS_WSCALE_NONE;
	ck_assert_int_eq(gpu_only(&g8, &c, 0, 4 * GIB, 4096, MLENS_GEMM_FAST, 200 * GIB, 0, 0), 0);
	ck_assert_uint_ge(gb.workspace, g8.workspace + deq_fast);
	ck_assert_uint_lt(gb.resident, g8.resident);
}
END_TEST

/* The numbers of the 32-layer shape as the GPU-only plan gave them before
 * it joined the hybrid one. */
START_TEST(plan_gpu_only_unchanged)
{
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_gpu_plan p;
	static const struct { uint64_t kv; int tokens; int gemm; uint64_t act, ws, total; } cs[] = {
		{ 40 * GIB, 4096, 0, 826474496ull, 571473920ull, 68047621376ull },
		{ 40 * GIB, 4096, 1, 826474496ull, 1108344832ull, 68584492288ull },
		{ 1 * GIB, 3072, 0, 619855872ull, 571473920ull, 25965071616ull },
		{ 1 * GIB, 3072, 1, 619855872ull, 1108344832ull, 26501942528ull },
	};
	for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++) {
		ck_assert_int_eq(gpu_only(&p, &c, 23700000000ull, cs[i].kv, cs[i].tokens,
					  (enum mlens_gemm_mode)cs[i].gemm, 0, 139 * GIB, 140 * GIB), 0);
		ck_assert_uint_eq(p.act, cs[i].act);
		ck_assert_uint_eq(p.workspace, cs[i].ws);
		ck_assert_uint_eq(p.total, cs[i].total);
		ck_assert_uint_eq(p.budget, 148444807168ull);
	}
}
END_TEST

START_TEST(plan_gpu_only_small_context_small_scratch)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p;
	/* a KV pool of 1024 tokens bounds the contexts: partials are small and
	 * the MoE scratch (0.30 GiB -> 0.5 GiB) is the largest need */
	gpu_only(&p, &c, 1000, 1024ull * 2 * 8 * 1024 * 2, 4096, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_ge(p.workspace, GIB / 2);
	ck_assert_uint_lt(p.workspace, GIB / 2 + (64ull << 20));
}
END_TEST

START_TEST(plan_gpu_only_exact_gemm)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p, f;
	/* 3072-token steps: 6144 routed rows take 0.25 GiB of MoE scratch (512
	 * MiB rounded); exact GEMMs keep gate and up in fp32 and three bf16
	 * parts of the inputs and of silu(g)*u (2048 rows of pieces), 0.62 GiB
	 * (1 GiB rounded) */
	gpu_only(&p, &c, 1000, 1 * GIB, 3072, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_ge(p.workspace, GIB / 2);
	ck_assert_uint_lt(p.workspace, GIB / 2 + (64ull << 20));
	gpu_only(&p, &c, 1000, 1 * GIB, 3072, MLENS_GEMM_EXACT, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_ge(p.workspace, 1 * GIB);
	ck_assert_uint_lt(p.workspace, 1 * GIB + (64ull << 20));
	/* fp32 weights have nothing to split */
	c.dtype = MLENS_DTYPE_F32;
	gpu_only(&p, &c, 1000, 1 * GIB, 3072, MLENS_GEMM_EXACT, 0, 139 * GIB, 140 * GIB);
	gpu_only(&f, &c, 1000, 1 * GIB, 3072, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_eq(p.workspace, f.workspace);
}
END_TEST

/* One query at a context whose partials alone exceed a launch's area: the
 * plan holds that query's partials; also where only an fp8 pool holds
 * that context (nearly twice the tokens of bf16 in the same bytes). */
START_TEST(plan_gpu_only_one_long_query)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p;
	c.max_position_embeddings = 1 << 22;
	c.num_local_experts = 1;
	c.num_experts_per_tok = 1;	/* top-k of one expert */
	c.intermediate_size = 64;
	/* 4 Mi keys: 16384 splits x 32 heads x 130 floats = 260 MiB > 256 MiB */
	gpu_only(&p, &c, 1000, 200 * GIB, 16, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_ge(p.workspace, 512ull << 20);
	ck_assert_uint_lt(p.workspace, (512ull + 64) << 20);
	/* a pool of 4 Mi tokens of fp8 K and V (8 layers, 8 KV heads, 128
	 * codes and a scale a row), whose bf16 tokens (2.1 Mi) would take
	 * only 256 MiB of partials */
	gpu_only(&p, &c, 1000, (1ull << 22) * 2 * 8 * 8 * (128 + 4), 16, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_ge(p.workspace, 512ull << 20);
	ck_assert_uint_lt(p.workspace, (512ull + 64) << 20);
}
END_TEST

START_TEST(plan_gpu_only_refuses)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p;
	ck_assert_int_eq(gpu_only(&p, &c, 23700000000ull, 120 * GIB, 4096, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB), -ENOSPC);
	ck_assert(!p.fits);
	ck_assert_ptr_nonnull(strstr(p.summary, "exceed"));
	/* a budget of its own: honoured below free memory, refused above it */
	ck_assert_int_eq(gpu_only(&p, &c, 23700000000ull, 40 * GIB, 4096, MLENS_GEMM_FAST, 60 * GIB, 139 * GIB, 140 * GIB), -ENOSPC);
	ck_assert(p.budget_given);
	ck_assert_uint_eq(p.budget, 60 * GIB);
	ck_assert(!p.fits);
	ck_assert_int_eq(gpu_only(&p, &c, 23700000000ull, 40 * GIB, 4096, MLENS_GEMM_FAST, 200 * GIB, 139 * GIB, 140 * GIB), -ENOSPC);
	ck_assert(!p.fits);
	ck_assert_ptr_nonnull(strstr(p.summary, "more than the device has free"));
	/* free memory under the margin leaves no budget at all */
	ck_assert_int_eq(gpu_only(&p, &c, 1, 1, 1, MLENS_GEMM_FAST, 0, MLENS_GPU_SAFETY_MARGIN / 2, 140 * GIB), -ENOSPC);
	ck_assert_uint_eq(p.budget, 0);
	ck_assert(!p.fits);
}
END_TEST

START_TEST(plan_cpu_backend)
{
	struct mlens_backend be;
	struct mlens_gpu_plan_in in = { 0 };
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_int_eq(mlens_gpu_plan_device(&be, &in), -ENOTSUP);
	mlens_backend_destroy(&be);
}
END_TEST

/* gpu_memory = 0 is the device's free memory less the margin, for both
 * modes; the profile cache's key holds that effective budget: the same
 * bytes given by hand are the same key, other free memory another. */
START_TEST(plan_effective_budget_and_key)
{
	struct mlens_test_spec ts = mlens_test_spec_tiny();
	struct mlens_model *m = mlens_test_model_new(&ts);
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_gpu_plan_in in = { .dev_free = 40 * GIB, .dev_total = 48 * GIB,
				       .max_tokens = 4096, .min_tokens = 512 };
	struct mlens_gpu_plan derived, given, other;
	struct mlens_profile_key k0, k1, k2, kn;

	ck_assert_uint_eq(mlens_gpu_plan_budget(0, 40 * GIB), 40 * GIB - MLENS_GPU_SAFETY_MARGIN);
	ck_assert_uint_eq(mlens_gpu_plan_budget(8 * GIB, 40 * GIB), 8 * GIB);
	ck_assert_uint_eq(mlens_gpu_plan_budget(0, MLENS_GPU_SAFETY_MARGIN), 0);
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &derived, NULL, 0), 0);
	ck_assert_uint_eq(derived.budget, 40 * GIB - MLENS_GPU_SAFETY_MARGIN);
	ck_assert(!derived.budget_given);
	in.budget = 40 * GIB - MLENS_GPU_SAFETY_MARGIN;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &given, NULL, 0), 0);
	ck_assert(given.budget_given);
	ck_assert_int_eq(given.resident_experts, derived.resident_experts);
	ck_assert_int_eq(given.tokens, derived.tokens);
	in.budget = 0;
	in.dev_free = 30 * GIB;
	ck_assert_int_eq(mlens_gpu_plan_make(&pm, &in, &other, NULL, 0), 0);
	ck_assert_uint_eq(other.budget, 30 * GIB - MLENS_GPU_SAFETY_MARGIN);

	mlens_profile_key_make(&k0, m, "cuda", "10de:2335 at 0000:3b:00.0", &derived, 20);
	mlens_profile_key_make(&k1, m, "cuda", "10de:2335 at 0000:3b:00.0", &given, 20);
	mlens_profile_key_make(&k2, m, "cuda", "10de:2335 at 0000:3b:00.0", &other, 20);
	mlens_profile_key_make(&kn, m, "cpu", "", NULL, 20);
	ck_assert_uint_eq(k0.budget, derived.budget);
	ck_assert_int_eq(memcmp(&k0, &k1, sizeof(k0)), 0);
	ck_assert_uint_ne(k0.budget, k2.budget);
	ck_assert_uint_eq(kn.budget, 0);
	mlens_test_model_free(m);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("plan");
	TCase *t = tcase_create("plan");
	tcase_add_test(t, plan_mixtral_8gib);
	tcase_add_test(t, plan_monotone_and_never_above_budget);
	tcase_add_test(t, plan_auto_group);
	tcase_add_test(t, plan_model_n_act);
	tcase_add_test(t, plan_refuses_below_minimum);
	tcase_add_test(t, plan_act_bytes);
	tcase_add_test(t, plan_scratch_bytes);
	tcase_add_test(t, plan_unchanged);
	tcase_add_test(t, plan_model_min_budget);
	tcase_add_test(t, plan_resident_cap);
	tcase_add_test(t, plan_gpu_only_all_resident);
	tcase_add_test(t, plan_gpu_only_parts);
	tcase_add_test(t, plan_gpu_only_unchanged);
	tcase_add_test(t, plan_fp8_scratch);
	tcase_add_test(t, plan_gpu_only_small_context_small_scratch);
	tcase_add_test(t, plan_gpu_only_exact_gemm);
	tcase_add_test(t, plan_gpu_only_one_long_query);
	tcase_add_test(t, plan_gpu_only_refuses);
	tcase_add_test(t, plan_cpu_backend);
	tcase_add_test(t, plan_effective_budget_and_key);
	suite_add_tcase(s, t);
	return mlens_check_run(s);
}
