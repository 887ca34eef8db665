/* Description: the hybrid pipeline's GPU memory plan (daemon/plan/gpuplan.c):
 * parts add up to its total, the total never exceeds the budget,
 * residency grows with the budget, a budget below the minimum is refused
 * with the minimum in the message, and the minimum itself runs; the
 * activation and op scratch bytes by hand, and the performance model sized
 * with the plan's activations. Pure arithmetic: runs without a GPU. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/plan/gpuplan.h"
#include "daemon/exec/pipeprog.h"
#include "tests/check_common.h"
#include "tests/testmodel.h"

static void check_sum(const struct mlens_gpuplan *p)
{
	ck_assert_uint_eq(p->total, p->resident + p->slots + p->act + p->workspace);
	ck_assert_uint_le(p->total, p->budget);
	ck_assert_uint_eq(p->slots, 2 * p->slot);
}

/* The benchmark's shape: Mixtral-8x7B, 8 layers, 8 GiB. */
START_TEST(plan_mixtral_8gib)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_gpuplan_in in = { .budget = 8 * GIB, .max_tokens = 4096, .min_tokens = 512 };
	struct mlens_gpuplan p;
	char err[512];
	uint64_t expert = 3ull * 4096 * 14336 * 2;

	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), 0);
	ck_assert_str_eq(err, "");
	check_sum(&p);
	ck_assert_int_eq(p.tokens, 4096);
	/* 8 GiB cannot keep a whole expert per layer beside two slots of 7:
	 * 8 layers x 1 expert = 2.6 GiB more resident, slots shrink by 0.66 GiB */
	ck_assert_int_eq(p.resident_experts, 0);
	ck_assert_uint_eq(p.slot, 8 * expert);
	ck_assert_uint_eq(p.resident, mlens_perf_resident_bytes(&pm, 0));
	ck_assert_uint_gt(p.gpu_only, 23 * GIB);
	ck_assert_uint_lt(p.minimum, p.budget);

	/* plenty of memory: everything resident, no slots */
	in.budget = 40 * GIB;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), 0);
	check_sum(&p);
	ck_assert_int_eq(p.resident_experts, 8);
	ck_assert_uint_eq(p.slots, 0);
	ck_assert_uint_le(p.gpu_only, 40 * GIB);
}
END_TEST

/* group = MLENS_GPUPLAN_GROUP_AUTO: the largest of 4096, 2048, 1024 whose
 * plan holds the cap, else the one that holds the most tokens; refused as
 * the default group is when none fits. MoE calls of 1024 tokens (the
 * default chunk is 2048: see the end). */
START_TEST(plan_auto_group)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_gpuplan_in in = { .budget = 8 * GIB, .max_tokens = 65536, .min_tokens = 512,
				       .chunk = 1024 };
	struct mlens_gpuplan p, g[3];	/* groups of 4096, 2048, 1024 */
	char err[512];

	for (int i = 0; i < 3; i++) {
		in.group = 4096 >> i;
		ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &g[i], NULL, 0), 0);
		ck_assert_int_eq(g[i].group, 4096 >> i);
	}
	/* at 8 GiB each halving frees activation memory for more tokens, none
	 * reaching 65536: the smallest group, never below the MoE chunk */
	ck_assert_int_lt(g[0].tokens, g[1].tokens);
	ck_assert_int_lt(g[1].tokens, g[2].tokens);
	ck_assert_int_lt(g[2].tokens, 65536);
	in.group = MLENS_GPUPLAN_GROUP_AUTO;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), 0);
	ck_assert_str_eq(err, "");
	check_sum(&p);
	ck_assert_int_eq(p.group, 1024);
	ck_assert_int_eq(p.tokens, g[2].tokens);
	ck_assert_uint_eq(p.act, g[2].act);
	/* a cap that groups of 2048 hold but 4096 do not */
	in.max_tokens = (g[0].tokens + g[1].tokens) / 2;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_eq(p.group, 2048);
	ck_assert_int_eq(p.tokens, in.max_tokens);
	/* a cap the default group holds: the default */
	in.max_tokens = g[0].tokens;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_eq(p.group, 4096);
	ck_assert_int_eq(p.tokens, g[0].tokens);
	/* MoE calls of 2048 tokens: groups stop at 2048 (1024 would hold more) */
	in.max_tokens = 65536;
	in.chunk = 2048;
	in.budget = 8 * GIB;
	for (int i = 0; i < 3; i++) {
		in.group = 4096 >> i;
		ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &g[i], NULL, 0), 0);
	}
	ck_assert_int_lt(g[1].tokens, g[2].tokens);
	in.group = MLENS_GPUPLAN_GROUP_AUTO;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, NULL, 0), 0);
	ck_assert_int_eq(p.tokens, g[0].tokens > g[1].tokens ? g[0].tokens : g[1].tokens);
	ck_assert_int_eq(p.group, g[0].tokens > g[1].tokens ? g[0].group : g[1].group);
	/* the default chunk (a group's MoE in one call, the auto groups not
	 * below 2048): the same choice */
	in.chunk = 0;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &g[2], NULL, 0), 0);
	ck_assert_int_eq(g[2].group, p.group);
	ck_assert_int_eq(g[2].tokens, p.tokens);
	/* too small for any group: the default group's refusal */
	in.budget = GIB;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
	ck_assert_ptr_nonnull(strstr(err, "at least"));
	in.group = -2;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), -EINVAL);
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
				    .gpu_workspace = MLENS_GPUPLAN_WORKSPACE,
				    .chunk = MLENS_GPUPLAN_CHUNK };
	struct mlens_perf_workload w = { .p = 512, .g = 32, .kv_tokens = 1310720 };
	struct mlens_perf_prediction pr;
	static const int64_t groups[] = { 4096, 2048, MLENS_GPUPLAN_GROUP_AUTO };
	double own;

	mlens_perf_hw_roofline_lines(&hw, &pm);
	ck_assert_int_eq(mlens_perf_predict(&pm, &hw, &w, 0, &pr, NULL, 0), 0);
	own = pr.n_act;
	for (int i = 0; i < 3; i++) {
		struct mlens_gpuplan_in in = { .budget = 8 * GIB, .max_tokens = 1 << 20,
					       .min_tokens = 512, .group = groups[i] };
		struct mlens_gpuplan p;
		ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, NULL, 0), 0);
		ck_assert_int_eq(p.resident_experts, 0);
		hw.act_bytes = mlens_gpuplan_act_bytes_hw;
		hw.act_arg = &in;
		ck_assert_int_eq(mlens_perf_predict(&pm, &hw, &w, 0, &pr, NULL, 0), 0);
		ck_assert_msg(pr.n_act == (double)p.tokens, "group %lld: model n_act %.0f, plan %lld",
			      (long long)groups[i], pr.n_act, (long long)p.tokens);
		ck_assert_uint_eq(pr.gpu_act, mlens_gpuplan_act_bytes_hw(&pm, (int64_t)ceil(pr.tokens),
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
	struct mlens_gpuplan p;
	int last_r = -1;
	int64_t last_t = 0;

	for (uint64_t b = 5 * GIB; b <= 40 * GIB; b += GIB / 4) {
		struct mlens_gpuplan_in in = { .budget = b, .max_tokens = 8192, .min_tokens = 128 };
		int rc = mlens_gpuplan_make(&pm, &in, &p, NULL, 0);
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
	struct mlens_gpuplan_in in = { .budget = 2 * GIB, .max_tokens = 4096, .min_tokens = 512 };
	struct mlens_gpuplan p;
	char err[512], want[64];

	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
	snprintf(want, sizeof(want), "at least %.2f GiB", (double)p.minimum / (double)GIB);
	ck_assert_msg(strstr(err, want), "message lacks '%s': %s", want, err);
	ck_assert_ptr_nonnull(strstr(err, "gpu_memory"));
	ck_assert_ptr_nonnull(strstr(err, "2.00 GiB"));
	/* the minimum itself runs, with exactly min_tokens; one byte less does not */
	in.budget = p.minimum;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), 0);
	check_sum(&p);
	ck_assert_int_eq(p.tokens, 512);
	ck_assert_uint_eq(p.total, p.minimum);
	in.budget = p.minimum - 1;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
	ck_assert_msg(!strstr(err, "pipeline_sets"), "two sets, nothing fewer to offer: %s", err);
	/* three sets (mlensd's default) need one group's q, k, v more: a
	 * budget between the two minima names pipeline_sets = 2 and what it
	 * needs, which then runs */
	{
		uint64_t min2 = p.minimum, min3;
		in.sets = 3;
		in.budget = min2;
		ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
		min3 = p.minimum;
		ck_assert_uint_gt(min3, min2);
		snprintf(want, sizeof(want), "pipeline_sets = 2, which needs %.2f GiB",
			 (double)min2 / (double)GIB);
		ck_assert_msg(strstr(err, want), "message lacks '%s': %s", want, err);
		ck_assert_ptr_nonnull(strstr(err, "with 3 groups' sets"));
		/* below both minima: only gpu_memory helps */
		in.budget = min2 - 1;
		ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), -ENOSPC);
		ck_assert_msg(!strstr(err, "pipeline_sets"), "%s", err);
		in.budget = min3;
		ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), 0);
		in.sets = 2;
		in.budget = min2;
		ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, err, sizeof(err)), 0);
		in.sets = 0;
	}
	/* bad inputs */
	in.budget = 8 * GIB;
	in.max_tokens = 0;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, NULL, 0), -EINVAL);
	in.max_tokens = 100;
	in.min_tokens = 101;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &p, NULL, 0), -EINVAL);
}
END_TEST

/* The activation formula: per-token buffers by hand for a tiny model. */
/* act_bytes of n tokens in groups of group rows, MoE chunks of 8, fast
 * GEMMs, sets sets, att_half */
static uint64_t act8(const struct mlens_perf_model *pm, int64_t n, int64_t group, int sets,
		     bool att_half)
{
	struct mlens_gpuplan_in in = { .group = group, .chunk = 8, .gemm = MLENS_GEMM_FAST,
				       .sets = sets, .att_half = att_half };
	return mlens_gpuplan_act_bytes(pm, n, &in);
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
	ck_assert_int_eq(mlens_gpuplan_group_rows(10, 4), 4);
	ck_assert_int_eq(mlens_gpuplan_group_rows(3, 4), 3);
	ck_assert_int_eq(mlens_gpuplan_group_rows(1 << 20, 16),
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
	struct mlens_gpuplan_in in = { .budget = 8 * GIB, .max_tokens = 65536, .min_tokens = 512,
				       .group = 2048, .chunk = 1024 };
	struct mlens_gpuplan fast, exact;

	ck_assert_uint_eq(mlens_gpuplan_scratch_bytes(&pm, 33547, 2048, 1024, MLENS_GEMM_FAST),
			  169869312ull);
	ck_assert_uint_eq(mlens_gpuplan_scratch_bytes(&pm, 33547, 2048, 1024, MLENS_GEMM_EXACT),
			  497025024ull);
	/* the default chunk, the group's 2048 tokens (4096 routed rows):
	 * counts 256 B, perm and inv 16 KiB each, x 32 MiB, gate and up still
	 * 56 MiB + 1 KiB each (MLENS_CUDA_MOE_GU_ROWS), expert out 64 MiB:
	 * 218,138,880 B, 220,200,960 rounded */
	ck_assert_uint_eq(mlens_gpuplan_scratch_bytes(&pm, 33547, 2048, 0, MLENS_GEMM_FAST),
			  220200960ull);
	/* a step of 3 tokens: the MoE chunk is the 3 rows' */
	ck_assert_uint_eq(mlens_gpuplan_scratch_bytes(&pm, 3, 2048, 1024, MLENS_GEMM_FAST),
			  MLENS_GPUPLAN_SCRATCH_ALIGN);
	ck_assert_uint_eq(mlens_gpuplan_scratch_bytes(&pm, 0, 2048, 1024, MLENS_GEMM_FAST), 0);
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &fast, NULL, 0), 0);
	in.gemm = MLENS_GEMM_EXACT;
	ck_assert_int_eq(mlens_gpuplan_make(&pm, &in, &exact, NULL, 0), 0);
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
	suite_add_tcase(s, t);
	return mlens_check_run(s);
}
