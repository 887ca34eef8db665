/* Description: the performance model's arithmetic against hand-computed
 * cases (Mixtral-8x7B bytes and FLOPs, MoE-Lens eq. 2-4, PME(98, 32)),
 * the line fit on seeded noisy timings, the policy choice under tight and
 * loose GPU budgets (and under a cap on the resident experts) and the
 * refusal below the minimum, throughput monotone
 * in KV capacity, and a real scheduler that never exceeds the model's cap. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/plan/gpu_plan.h"
#include "daemon/plan/perfmodel.h"
#include "daemon/serve/sched.h"
#include "tests/testmodel.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

static void assert_rel(double got, double want, double tol)
{
	ck_assert_msg(fabs(got - want) <= tol * fabs(want), "got %.10g want %.10g (tol %g)", got, want, tol);
}

/* ==== accounting ==== */

/* fp8 experts: a byte an element plus their fp32 scales (one a row, or
 * one a 128 x 128 block), each piece 16-byte aligned as a slot holds it;
 * attention, router and norms stay bf16. */
START_TEST(fp8_expert_bytes)
{
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_perf_model bf = mlens_test_mixtral_pm(32), pm;
	uint64_t H = 4096, I = 14336;

	c.expert_dtype = MLENS_DTYPE_E4M3;
	c.expert_scale = (struct mlens_wscale){ MLENS_WSCALE_CHANNEL, 0, 0 };
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16), 0);
	ck_assert(pm.expert_fp8);
	ck_assert_uint_eq(pm.expert_bytes, 3 * H * I + 2 * I * 4 + H * 4);
	ck_assert_uint_eq(pm.attn_bytes, bf.attn_bytes);
	ck_assert_uint_eq(pm.model_bytes, bf.model_bytes - 32 * 8 * (bf.expert_bytes - pm.expert_bytes));
	c.expert_scale = (struct mlens_wscale){ MLENS_WSCALE_BLOCK, 128, 128 };
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16), 0);
	ck_assert_uint_eq(pm.expert_bytes, 3 * H * I + 3 * (112 * 32 * 4));
	/* a config without fp8 (expert_dtype left 0) keeps its dtype's bytes */
	ck_assert_uint_eq(bf.expert_bytes, 3 * H * I * 2);
	ck_assert(!bf.expert_fp8);
}
END_TEST

/* A family's resident extras: Qwen2-MoE-A14B's shared expert (and gate)
 * and q/k/v biases are held with the attention, never streamed. */
START_TEST(family_bytes)
{
	struct mlens_model_config c = { 0 };
	struct mlens_perf_model pm;
	uint64_t H = 3584, S = 20480, Q = 3584, KV = 512;

	c.hidden_size = (int64_t)H;
	c.intermediate_size = 2560;
	c.num_hidden_layers = 28;
	c.num_attention_heads = 28;
	c.num_key_value_heads = 4;
	c.head_dim = 128;
	c.num_local_experts = 64;
	c.num_experts_per_tok = 8;
	c.vocab_size = 151936;
	c.dtype = MLENS_DTYPE_BF16;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16), 0);
	ck_assert_uint_eq(pm.family_bytes, 0);
	c.shared_inter = (int64_t)S;
	c.shared_gate = true;
	c.qkv_bias = true;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16), 0);
	ck_assert_uint_eq(pm.family_bytes, (3 * H * S + H + Q + 2 * KV) * 2);
	ck_assert_uint_eq(pm.layer_bytes, pm.attn_bytes + pm.norm_bytes + pm.router_bytes +
			  pm.family_bytes + pm.layer_expert_bytes);
	ck_assert_uint_eq(mlens_gpu_plan_resident_bytes(&pm, 0),
			  (pm.layer_bytes - pm.layer_expert_bytes) * 28 + pm.embed_bytes +
			  pm.lm_head_bytes + pm.final_norm_bytes);
	/* the MoE scratch's width covers the shared expert run as one
	 * expert a row: Qwen2's top-8 of 2560 already does, a dense layer
	 * of 96 beside top-2 of 32 needs 48 */
	ck_assert_int_eq(pm.mlp_inter, (int64_t)S);
	ck_assert_uint_eq(mlens_gpu_plan_moe_width(2560, 8, S), 2560);
	ck_assert_uint_eq(mlens_gpu_plan_moe_width(32, 2, 96), 48);
	ck_assert_uint_eq(mlens_gpu_plan_moe_width(32, 2, 0), 32);
}
END_TEST

START_TEST(mixtral_bytes)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	uint64_t H = 4096, I = 14336, E = 8, V = 32000, L = 32;
	uint64_t attn = H * H * 2 + H * H * 2 + H * 1024 * 2 + H * 1024 * 2;
	uint64_t experts = 3 * H * I * 2 * E;
	uint64_t layer = experts + attn + E * H * 2 + 2 * H * 2;
	uint64_t total = L * layer + 2 * V * H * 2 + H * 2;

	ck_assert_uint_eq(experts, 2818572288ull);
	ck_assert_uint_eq(attn, 83886080ull);
	ck_assert_uint_eq(pm.layer_expert_bytes, experts);
	ck_assert_uint_eq(pm.expert_bytes, experts / E);
	ck_assert_uint_eq(pm.attn_bytes, attn);
	ck_assert_uint_eq(pm.router_bytes, E * H * 2);
	ck_assert_uint_eq(pm.norm_bytes, 2 * H * 2);
	ck_assert_uint_eq(pm.layer_bytes, layer);
	ck_assert_uint_eq(pm.model_bytes, total);
	/* ≈ 93.4 GB with embeddings and lm_head */
	ck_assert_msg(fabs((double)pm.model_bytes / 1e9 - 93.4) < 0.05, "%.3f GB",
		      (double)pm.model_bytes / 1e9);
	/* K and V, 8 kv heads of 128, bf16 */
	ck_assert_uint_eq(pm.kv_token_bytes, 2 * 8 * 128 * 2);
	assert_rel(mlens_perf_kv_read_bytes(&pm, 114), 114.0 * 4096, 1e-15);
	/* FLOPs: QKV 2·H·(4096+2·1024); O 2·4096·H, router 2·H·8, 2 experts of 3 GEMMs */
	assert_rel(pm.flops_ga, 2.0 * 4096 * (4096 + 2048), 1e-15);
	assert_rel(pm.flops_gb, 2.0 * 4096 * 4096 + 2.0 * 4096 * 8 + 2.0 * 3 * 2 * 4096 * 14336, 1e-15);
	assert_rel(pm.flops_experts, 2.0 * 3 * 2 * 4096 * 14336, 1e-15);

	/* streaming and residency with r experts resident per layer */
	ck_assert_uint_eq(mlens_gpu_plan_streamed_bytes(&pm, 0), experts);
	ck_assert_uint_eq(mlens_gpu_plan_streamed_bytes(&pm, 3), experts / 8 * 5);
	ck_assert_uint_eq(mlens_gpu_plan_streamed_bytes(&pm, 8), 0);
	ck_assert_uint_eq(mlens_gpu_plan_slot_bytes(&pm, 6), 2 * 2 * (experts / 8));
	ck_assert_uint_eq(mlens_gpu_plan_resident_bytes(&pm, 8), total);
	ck_assert_uint_eq(mlens_gpu_plan_resident_bytes(&pm, 0), total - L * experts);
}
END_TEST

START_TEST(config_errors)
{
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_perf_model pm;
	c.num_experts_per_tok = 9;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16), -EINVAL);
	c = mlens_test_mixtral_config(32);
	c.hidden_size = 0;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16), -EINVAL);
	c = mlens_test_mixtral_config(32);
	c.intermediate_size = (int64_t)1 << 40;
	c.hidden_size = (int64_t)1 << 30;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16), -EOVERFLOW);
	/* tied embeddings: no separate lm_head */
	c = mlens_test_mixtral_config(32);
	c.tie_word_embeddings = true;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_F32), 0);
	ck_assert_uint_eq(pm.lm_head_bytes, 0);
	ck_assert_uint_eq(pm.kv_token_bytes, 2 * 1024 * 4);
}
END_TEST

START_TEST(activation_bytes)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	uint64_t H = 4096, I = 14336, V = 32000;
	/* 100 tokens: all rows fit one chunk; group of ceil(75) */
	uint64_t want = 4 * (100 * (2 * H + 8 + 4) + 75 * (2 * 4096 + 2 * 1024) +
			     200 * (2 * H + 2 * I) + 100 * V);
	ck_assert_uint_eq(mlens_gpu_plan_act_estimate(&pm, 100, 4096), want);
	/* 10000 tokens: the MoE and logits chunks are capped at 4096 rows */
	want = 4 * (10000 * (2 * H + 8 + 4) + 7500 * (2 * 4096 + 2 * 1024) +
		    4096 * (2 * H + 2 * I) + 4096 * V);
	ck_assert_uint_eq(mlens_gpu_plan_act_estimate(&pm, 10000, 0), want);
	ck_assert_uint_eq(mlens_gpu_plan_act_estimate(&pm, 0, 0), 0);
}
END_TEST

/* ==== eq. 2-4 ==== */

START_TEST(eq2_mixtral_a40)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 48);
	double C = 149.7e12, B = 25e9;
	double bytes = 2818572288.0 + 83886080.0;	/* experts + attention */
	double flops = 2.0 * 4096 * 6144 + 2.0 * 4096 * 4096 + 2.0 * 4096 * 8 + 12.0 * 4096 * 14336;
	double n;

	/* simple form: (C/B)·(E/k) = 5988 · 4 */
	assert_rel(mlens_perf_n_simple(&pm, C, B), 5988.0 * 4, 1e-12);
	/* with attention counted: n·flops/C = bytes/B */
	n = mlens_perf_n_roofline(&pm, C, B, (uint64_t)bytes);
	assert_rel(n, C / B * bytes / flops, 1e-12);
	assert_rel(n * flops / C, bytes / B, 1e-12);
	ck_assert_msg(n > 21000 && n < 23000, "n %.1f", n);
	/* attention weights lower n below the experts-only simple form */
	ck_assert(n < mlens_perf_n_simple(&pm, C, B));

	/* fitted form: 2a + b n = streamed / B_IO */
	hw.ga.a = 1e-4;
	hw.gb.a = 9e-4;
	hw.ga.b = 1e-6;
	hw.gb.b = 5e-6;
	n = mlens_perf_n_fit(&hw, 2818572288ull);
	assert_rel(n, (2818572288.0 / 25e9 - 2 * 1e-3) / 6e-6, 1e-12);
	assert_rel(2 * 1e-3 + 6e-6 * n, 2818572288.0 / 25e9, 1e-12);
	ck_assert(isinf(mlens_perf_n_fit(&hw, 0)));
	ck_assert(mlens_perf_n_fit(&hw, 1000) == 0);	/* transfer hides behind any step */
}
END_TEST

START_TEST(pme_and_tmax)
{
	double pme = mlens_perf_pme(98, 32), M = 123456, p = 98, g = 32;
	/* 0.0356 to three significant figures */
	ck_assert_msg(fabs(pme - 0.0356) < 0.00005, "PME %.6f", pme);
	assert_rel(pme, 260.0 / 7296.0, 1e-15);
	/* the steady state it comes from: M/(p+g/2) sequences, (p+g)/g tokens each a step */
	assert_rel(pme * M, M / (p + g / 2) * (p + g) / g, 1e-12);
	/* eq. 4 takes the smaller bound */
	assert_rel(mlens_perf_tmax(pme, M, 3.6, 5000), pme * M / 3.6, 1e-15);
	assert_rel(mlens_perf_tmax(pme, M, 0.1, 5000), 5000, 1e-15);
	ck_assert(mlens_perf_tmax(pme, M, 0, 5000) == 5000);
}
END_TEST

/* ==== the fit ==== */

static unsigned long long rng_state;

static double uniform(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return ((double)(rng_state >> 11) + 0.5) / 9007199254740992.0;
}

static double gauss(void)
{
	return sqrt(-2.0 * log(uniform())) * cos(2.0 * M_PI * uniform());
}

START_TEST(fit_recovers_line)
{
	double x[64], y[64], a = 2e-3, b = 7.5e-6, sigma = 5e-5;
	struct mlens_perf_line l;
	rng_state = 0x9e3779b97f4a7c15ull;
	for (int i = 0; i < 64; i++) {
		x[i] = 256.0 * (1 + i % 16) * 2;	/* 512 .. 8192 tokens, 4 repeats */
		y[i] = a + b * x[i] + sigma * gauss();
	}
	ck_assert_int_eq(mlens_perf_fit_line(x, y, 64, &l), 0);
	ck_assert_int_eq(l.n, 64);
	/* within 4 standard errors, and the errors are small */
	ck_assert_msg(fabs(l.b - b) < 4 * l.se_b, "b %.4g se %.3g", l.b, l.se_b);
	ck_assert_msg(fabs(l.a - a) < 4 * l.se_a, "a %.4g se %.3g", l.a, l.se_a);
	ck_assert_msg(l.se_b / b < 0.01, "slope error %.3g", l.se_b / b);
	ck_assert_msg(fabs(l.b - b) / b < 0.01, "slope %.5g", l.b);
	ck_assert_msg(fabs(l.a - a) / a < 0.05, "intercept %.5g", l.a);
	ck_assert_msg(l.se > 0.7 * sigma && l.se < 1.3 * sigma, "se %.3g", l.se);
	assert_rel(mlens_perf_line_at(&l, 1000), l.a + 1000 * l.b, 1e-15);

	/* exact points give the exact line and no residual */
	for (int i = 0; i < 5; i++) {
		x[i] = 100.0 * (i + 1);
		y[i] = 0.5 + 0.25 * x[i];
	}
	ck_assert_int_eq(mlens_perf_fit_line(x, y, 5, &l), 0);
	assert_rel(l.a, 0.5, 1e-12);
	assert_rel(l.b, 0.25, 1e-12);
	ck_assert(l.se < 1e-9);

	/* refusals */
	ck_assert_int_eq(mlens_perf_fit_line(x, y, 1, &l), -EINVAL);
	x[1] = x[0];
	ck_assert_int_eq(mlens_perf_fit_line(x, y, 2, &l), -EINVAL);
	x[1] = 200;
	y[1] = NAN;
	ck_assert_int_eq(mlens_perf_fit_line(x, y, 2, &l), -EINVAL);
}
END_TEST

/* ==== step time ==== */

START_TEST(step_time_tiers)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 48);
	struct mlens_perf_policy pol = { 0, 0.5, 0.5 };
	struct mlens_perf_step st = { 1000, 400, 400 * 500.0, 600 * 50.0 };
	struct mlens_perf_step_time t;
	/* activation copies are fp32, as the pipeline moves them */
	double h2d = 2818572288.0 + 400 * 4096 * 4;
	double d2h = 400 * (4096 + 2048) * 4 + 600 * 2048 * 4;
	double kv = 400 * 500.0 * 4096;
	double g = hw.ga.a + hw.gb.a + (hw.ga.b + hw.gb.b) * 500 + 4.0 * 4096 * 0.5 * 600 * 50 / 149.7e12;

	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_PCIE], h2d / 25e9, 1e-12);
	assert_rel(t.tier[MLENS_PERF_BIND_D2H], d2h / 25e9, 1e-12);
	assert_rel(t.tier[MLENS_PERF_BIND_CPU_MEM], (kv + h2d + d2h) / 200e9, 1e-12);
	assert_rel(t.tier[MLENS_PERF_BIND_CPU_ATTN], kv / 100e9, 1e-12);
	assert_rel(t.tier[MLENS_PERF_BIND_GPU], 2 * g, 1e-12);
	assert_rel(t.tier[MLENS_PERF_BIND_CHAIN], g + kv / 2 / 100e9, 1e-12);
	/* 1000 tokens cannot hide 2.8 GB: PCIe binds */
	ck_assert_int_eq(t.bind, MLENS_PERF_BIND_PCIE);
	ck_assert_str_eq(mlens_perf_bind_name(t.bind), "pcie-h2d");
	assert_rel(t.seconds, 32 * h2d / 25e9 + t.tier[MLENS_PERF_BIND_CHAIN], 1e-12);

	/* the prefill attention kernel's own rate, and copies on the compute
	 * queue at 20 GB/s down and 10 GB/s up: each group's GPU time grows by
	 * its share (an even split: half of each) */
	hw.c_attn = 30e12;
	hw.b_act_d2h = 20e9;
	hw.b_act_h2d = 10e9;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	{
		double g2 = hw.ga.a + hw.gb.a + (hw.ga.b + hw.gb.b) * 500 +
			    4.0 * 4096 * 0.5 * 600 * 50 / 30e12 + d2h / 2 / 20e9 +
			    400 * 4096 * 4 / 2 / 10e9;
		assert_rel(t.group_gpu[0], g2, 1e-12);
		assert_rel(t.tier[MLENS_PERF_BIND_GPU], 2 * g2, 1e-12);
		/* the links' tiers are unchanged */
		assert_rel(t.tier[MLENS_PERF_BIND_PCIE], h2d / 25e9, 1e-12);
		assert_rel(t.tier[MLENS_PERF_BIND_D2H], d2h / 25e9, 1e-12);
		/* the CPU attention's output up in bf16 (attn_up = half): the
		 * upload's bytes halve, on the link and on the compute queue */
		hw.att_up_bytes = 2;
		ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
		assert_rel(t.group_gpu[0], g2 - 400 * 4096 * 2 / 2 / 10e9, 1e-12);
		assert_rel(t.tier[MLENS_PERF_BIND_PCIE], (h2d - 400 * 4096 * 2) / 25e9, 1e-12);
		assert_rel(t.tier[MLENS_PERF_BIND_D2H], d2h / 25e9, 1e-12);
		hw.att_up_bytes = -1;	/* not a size */
		ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), -EINVAL);
		hw.att_up_bytes = 0;
	}
	hw.c_attn = hw.b_act_d2h = hw.b_act_h2d = 0;
	/* the weight stream at its 10 GB/s beside the CPU's reads for the
	 * whole layer once the attention reads the KV, however short the
	 * attention (kv / 100 GB/s = 8.192 ms a layer) or long (1 GB/s) */
	hw.b_io_shared = 10e9;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_PCIE], h2d / 10e9, 1e-12);
	hw.b_attn = 1e9;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_PCIE], h2d / 10e9, 1e-12);
	hw.b_attn = 100e9;
	{
		/* a step of prefill only reads no KV: the stream at its rate
		 * alone (no decode rows: no attention outputs either) */
		struct mlens_perf_step pre = { 1000, 0, 0, 1000 * 50.0 };
		ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &pre, &t), 0);
		assert_rel(t.tier[MLENS_PERF_BIND_PCIE], 2818572288.0 / 25e9, 1e-12);
	}
	hw.b_io_shared = 30e9;	/* no slower than alone: no change */
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_PCIE], h2d / 25e9, 1e-12);
	hw.b_io_shared = -1;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), -EINVAL);
	hw.b_io_shared = 0;
	hw.b_act_d2h = -1;	/* a negative rate is refused */
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), -EINVAL);
	hw.b_act_d2h = 0;

	/* everything resident and slow attention: CPU attention binds, and the
	 * best split moves decode tokens out of the way of the GPU */
	pol.resident_experts = 8;
	hw.b_attn = 2e9;
	ck_assert_int_eq(mlens_perf_step_time_best(&pm, &hw, &pol, &st, &t), 0);
	ck_assert_int_eq(t.bind, MLENS_PERF_BIND_CPU_ATTN);
	hw.b_attn = 100e9;
	/* everything resident, prefill-heavy: the GPU binds */
	pol.resident_experts = 8;
	pol.alpha_decode = pol.alpha_prefill = 0.5;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	ck_assert_int_eq(t.bind, MLENS_PERF_BIND_GPU);
	/* out of range */
	pol.resident_experts = 9;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), -EINVAL);
	pol.resident_experts = 0;
	hw.b_io = 0;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), -EINVAL);
}
END_TEST

START_TEST(split_balances_groups)
{
	/* a step whose CPU attention is as long as its GPU work: each group's
	 * chain (its GPU work, then its own attention) must hide behind the
	 * other group's work. The chosen split balances the chains; putting
	 * every decode token in α and every prefill token in β serialises
	 * the attention behind α's GPU work and the chain binds. */
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 48);
	struct mlens_perf_policy best = { 8, 0.5, 0.5 }, skew = { 8, 1.0, 0.0 };
	struct mlens_perf_step st = { 4000, 2000, 2000 * 1500.0, 2000 * 300.0 };
	struct mlens_perf_step_time tb, ts;
	double chain_a, chain_b, n_a;
	hw.b_mem = 1e12;	/* keep the memory tier out of the way */
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &best, &st, &tb), 0);
	hw.b_attn = st.context * (double)pm.kv_token_bytes / tb.tier[MLENS_PERF_BIND_GPU];
	ck_assert_int_eq(mlens_perf_step_time_best(&pm, &hw, &best, &st, &tb), 0);
	assert_rel(tb.tier[MLENS_PERF_BIND_CPU_ATTN], tb.tier[MLENS_PERF_BIND_GPU], 1e-12);
	chain_a = tb.group_gpu[0] + tb.group_cpu[0];
	chain_b = tb.group_gpu[1] + tb.group_cpu[1];
	assert_rel(chain_a, chain_b, 1e-9);
	assert_rel(tb.period, tb.tier[MLENS_PERF_BIND_GPU], 1e-9);
	n_a = best.alpha_decode * 2000 + best.alpha_prefill * 2000;
	ck_assert(n_a <= MLENS_PERF_GROUP_MAX * 4000 + 1e-9);
	ck_assert(4000 - n_a <= MLENS_PERF_GROUP_MAX * 4000 + 1e-9);

	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &skew, &st, &ts), 0);
	ck_assert_int_eq(ts.bind, MLENS_PERF_BIND_CHAIN);
	ck_assert_str_eq(mlens_perf_bind_name(ts.bind), "gpu-cpu-chain");
	assert_rel(ts.period, ts.group_gpu[0] + ts.tier[MLENS_PERF_BIND_CPU_ATTN], 1e-12);
	ck_assert(ts.period > 1.2 * tb.period);
	/* the chosen split is no worse than any split on a grid */
	for (int i = 0; i <= 8; i++)
		for (int j = 0; j <= 8; j++) {
			struct mlens_perf_policy p = { 8, i / 8.0, j / 8.0 };
			struct mlens_perf_step_time t;
			ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &p, &st, &t), 0);
			ck_assert(tb.seconds <= t.seconds * (1 + 1e-12));
		}
}
END_TEST

/* ==== policy ==== */

START_TEST(policy_tight_budget)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 12);
	struct mlens_perf_workload w = { 98, 32, 1e6, 0 };
	struct mlens_perf_prediction pr;
	char err[512] = "";
	int rc = mlens_perf_choose(&pm, &hw, &w, &pr, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s", err);
	/* 12 GiB leaves no room for a whole expert in every layer: stream them all */
	ck_assert_int_le(pr.policy.resident_experts, 1);
	ck_assert_int_eq(pr.time.bind, MLENS_PERF_BIND_PCIE);
	ck_assert_uint_le(pr.gpu_total, hw.gpu_budget);
	/* the step carries n_real tokens: the GPU's time meets the transfer
	 * there. Per token of a steady p 98 / g 32 step, the GPU also runs
	 * prefill attention (98/130 prefill tokens, 99/2 causal pairs each,
	 * 4 x 4096 FLOPs a pair at c_gpu) and the link also carries the 32/130
	 * decode tokens' fp32 attention outputs: by hand
	 * n = (t_io - 2a) / (b + x_gpu - x_io / B_IO) */
	ck_assert_int_eq(pr.limit, MLENS_PERF_LIMIT_NREAL);
	{
		double t_io = (double)mlens_gpu_plan_streamed_bytes(&pm, pr.policy.resident_experts) / 25e9;
		double x_gpu = 4.0 * 4096 * (98.0 / 130) * 99 / 2 / 149.7e12;
		double x_io = 32.0 / 130 * 4096 * 4;
		double want = (t_io - 2 * (hw.ga.a + hw.gb.a)) / (hw.ga.b + hw.gb.b + x_gpu - x_io / 25e9);
		assert_rel(pr.n_eq, want, 1e-9);
	}
	ck_assert(pr.n_real == floor(pr.n_eq));
	ck_assert(pr.n_real <= pr.n_act);
	ck_assert_int_eq(mlens_perf_token_cap(&pr), (int)pr.n_real);
	/* eq. 4 bounds the prediction; the PCIe bound is within the fill of it */
	ck_assert(pr.total_tok_s <= pr.t_max * (1 + 1e-9));
	ck_assert_msg(pr.total_tok_s > 0.9 * pr.n_real / pr.delta, "%.1f vs %.1f", pr.total_tok_s,
		      pr.n_real / pr.delta);
	assert_rel(pr.gen_tok_s, pr.total_tok_s * 32 / 130, 1e-12);
	assert_rel(pr.steps_per_s * pr.time.seconds, 1, 1e-12);
}
END_TEST

/* The performance model's residency search under the cap: never above
 * it, the uncapped choice where that is at or below it. */
START_TEST(choose_resident_cap)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(8);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 40);
	struct mlens_perf_workload w = { 512, 128, 200000, 0 };
	struct mlens_perf_prediction all, capped;
	char err[512];

	ck_assert_int_eq(mlens_perf_choose(&pm, &hw, &w, &all, err, sizeof(err)), 0);
	ck_assert_int_gt(all.policy.resident_experts, 0);	/* so that a cap binds */
	ck_assert_int_eq(mlens_perf_choose_upto(&pm, &hw, &w, -1, &capped, NULL, 0), 0);
	ck_assert_int_eq(capped.policy.resident_experts, all.policy.resident_experts);
	ck_assert_int_eq(mlens_perf_choose_upto(&pm, &hw, &w, 8, &capped, NULL, 0), 0);
	ck_assert_int_eq(capped.policy.resident_experts, all.policy.resident_experts);
	for (int cap = 0; cap < 8; cap++) {
		ck_assert_int_eq(mlens_perf_choose_upto(&pm, &hw, &w, cap, &capped, NULL, 0), 0);
		ck_assert_int_le(capped.policy.resident_experts, cap);
		if (all.policy.resident_experts <= cap)
			ck_assert_int_eq(capped.policy.resident_experts, all.policy.resident_experts);
		ck_assert(capped.total_tok_s <= all.total_tok_s);
	}
}
END_TEST

/* Experts left on disk (the fourth ceiling): half of each layer's streamed
 * experts read from the model files at a tenth of the PCIe rate. The
 * step time gains a disk tier of their bytes / B_disk, which binds; n_eq
 * is where the GPU's time meets that read (by hand, the same balance as
 * the PCIe one with the disk's bytes and rate), above the PCIe balance:
 * the token cap grows to amortize the disk. A disk tier of no bytes
 * changes nothing. */
START_TEST(disk_tier_ceiling)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 12);
	struct mlens_perf_workload w = { 98, 32, 1e6, 0 };
	struct mlens_perf_prediction base, pr;
	char err[512] = "";
	double disk, x_gpu = 4.0 * 4096 * (98.0 / 130) * 99 / 2 / 149.7e12;

	hw.gpu_budget = (uint64_t)(200 * GIB);	/* room for any cap: n_eq decides */
	ck_assert_msg(mlens_perf_predict(&pm, &hw, &w, 0, &base, err, sizeof(err)) == 0, "%s", err);
	disk = (double)mlens_gpu_plan_streamed_bytes(&pm, 0) / 2;
	hw.disk_layer_bytes = disk;
	hw.b_disk = 2.5e9;
	ck_assert_msg(mlens_perf_predict(&pm, &hw, &w, 0, &pr, err, sizeof(err)) == 0, "%s", err);
	assert_rel(pr.n_eq, (disk / 2.5e9 - 2 * (hw.ga.a + hw.gb.a)) / (hw.ga.b + hw.gb.b + x_gpu), 1e-9);
	ck_assert_msg(pr.n_eq > 4 * base.n_eq, "disk n_eq %.0f, PCIe %.0f", pr.n_eq, base.n_eq);
	ck_assert_int_gt(mlens_perf_token_cap(&pr), mlens_perf_token_cap(&base));
	ck_assert_int_eq(pr.time.bind, MLENS_PERF_BIND_DISK);
	assert_rel(pr.time.tier[MLENS_PERF_BIND_DISK], disk / 2.5e9, 1e-12);
	assert_rel(pr.delta, (double)pm.layers * disk / 2.5e9, 1e-12);
	ck_assert_str_eq(mlens_perf_bind_name(MLENS_PERF_BIND_DISK), "disk");
	hw.disk_layer_bytes = 0;
	ck_assert_msg(mlens_perf_predict(&pm, &hw, &w, 0, &pr, err, sizeof(err)) == 0, "%s", err);
	assert_rel(pr.n_eq, base.n_eq, 1e-12);
	ck_assert(pr.time.tier[MLENS_PERF_BIND_DISK] == 0);
	hw.b_disk = -1;
	ck_assert_int_eq(mlens_perf_predict(&pm, &hw, &w, 0, &pr, err, sizeof(err)), -EINVAL);
}
END_TEST

/* The stream slowed while the CPU attention reads memory (B_IO,shared):
 * n_eq moves up to where the step time's GPU tier meets its PCIe tier for
 * the workload's steady step; no shared rate (or one no slower than B_IO)
 * keeps eq. 2's balance; with slow attention the balance lies beyond what
 * the activations hold, and they cap the step. */
START_TEST(policy_shared_stream)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 12);
	struct mlens_perf_workload w = { 98, 32, 1e6, 0 };
	struct mlens_perf_policy pol = { 0, 0.5, 0.5 };
	struct mlens_perf_prediction p0, pr;
	struct mlens_perf_step_time t;
	struct mlens_perf_step st;
	char err[512] = "";
	ck_assert_msg(mlens_perf_predict(&pm, &hw, &w, 0, &p0, err, sizeof(err)) == 0, "%s", err);
	hw.b_io_shared = 30e9;	/* no slower than alone: eq. 2's balance */
	ck_assert_int_eq(mlens_perf_predict(&pm, &hw, &w, 0, &pr, err, sizeof(err)), 0);
	assert_rel(pr.n_eq, p0.n_eq, 1e-12);
	hw.b_io_shared = 20e9;
	ck_assert_int_eq(mlens_perf_predict(&pm, &hw, &w, 0, &pr, err, sizeof(err)), 0);
	ck_assert_msg(pr.n_eq > p0.n_eq * 1.01, "%.1f vs %.1f", pr.n_eq, p0.n_eq);
	ck_assert_int_eq(pr.limit, MLENS_PERF_LIMIT_NREAL);
	ck_assert(pr.n_real == floor(pr.n_eq));
	/* the tiers meet at n_eq: the stream binds a token below, the GPU one
	 * above */
	st = mlens_perf_steady_step(&w, pr.n_eq);
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_GPU], t.tier[MLENS_PERF_BIND_PCIE], 1e-4);
	st = mlens_perf_steady_step(&w, pr.n_eq - 1);
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	ck_assert(t.tier[MLENS_PERF_BIND_GPU] < t.tier[MLENS_PERF_BIND_PCIE]);
	st = mlens_perf_steady_step(&w, pr.n_eq + 1);
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	ck_assert(t.tier[MLENS_PERF_BIND_GPU] > t.tier[MLENS_PERF_BIND_PCIE]);
	/* the stream outruns the GPU only at n_eq, so the prediction there
	 * beats the one at eq. 2's n (the cap it had before) */
	{
		struct mlens_perf_policy pb = pol;
		st = mlens_perf_steady_step(&w, p0.n_real);
		ck_assert_int_eq(mlens_perf_step_time_best(&pm, &hw, &pb, &st, &t), 0);
		ck_assert_msg(pr.total_tok_s > p0.n_real / t.seconds, "%.1f vs %.1f", pr.total_tok_s,
			      p0.n_real / t.seconds);
	}
	/* attention at 1 GB/s and the stream at 5 GB/s meanwhile: the
	 * stream takes its slow rate for the whole layer (h2d / 5 GB/s), a
	 * balance beyond what the activations hold, which cap the step */
	hw.b_io_shared = 5e9;
	hw.b_attn = 1e9;
	w.kv_tokens = 1e7;	/* PME x M above n_act: not the KV capacity */
	ck_assert_int_eq(mlens_perf_predict(&pm, &hw, &w, 0, &pr, err, sizeof(err)), 0);
	ck_assert_msg(pr.n_eq > pr.n_act, "n_eq %g, n_act %g", pr.n_eq, pr.n_act);
	st = mlens_perf_steady_step(&w, pr.n_eq);
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_PCIE],
		   (double)(mlens_gpu_plan_streamed_bytes(&pm, 0) + st.decode * 4096 * 4) / 5e9, 1e-12);
	assert_rel(t.tier[MLENS_PERF_BIND_GPU], t.tier[MLENS_PERF_BIND_PCIE], 1e-4);
	ck_assert(pr.n_real == pr.n_act);
	ck_assert_int_eq(pr.limit, MLENS_PERF_LIMIT_ACT);
}
END_TEST

/* The CPU attention beside the weight stream: where experts stream, its
 * tier reads the KV at b_attn_shared (the profile's attention under
 * copy); with every expert resident nothing streams and b_attn holds; a
 * shared rate above the one alone, or 0, changes nothing; a negative one
 * is refused. The KV append adds every token's bytes at b_append. */
START_TEST(attention_under_copy)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 12);
	struct mlens_perf_workload w = { 98, 32, 1e6, 0 };
	struct mlens_perf_policy pol = { 0, 0.5, 0.5 }, all = { (int)pm.experts, 0.5, 0.5 };
	struct mlens_perf_step st = mlens_perf_steady_step(&w, 20000);
	struct mlens_perf_step_time t0, t;
	double kv = st.context * (double)pm.kv_token_bytes;

	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t0), 0);
	assert_rel(t0.tier[MLENS_PERF_BIND_CPU_ATTN], kv / hw.b_attn, 1e-12);
	hw.b_attn_shared = hw.b_attn / 2;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_CPU_ATTN], 2 * kv / hw.b_attn, 1e-12);
	assert_rel(t.group_cpu[0] + t.group_cpu[1], 2 * kv / hw.b_attn, 1e-12);
	ck_assert(t.seconds > t0.seconds);
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &all, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_CPU_ATTN], kv / hw.b_attn, 1e-12);
	hw.b_attn_shared = hw.b_attn * 2;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_CPU_ATTN], kv / hw.b_attn, 1e-12);
	hw.b_attn_shared = -1;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), -EINVAL);
	hw.b_attn_shared = 0;
	/* the KV append of every token on the host side, before the
	 * attention: 8 KV heads x 128 read as fp32 (8 KiB) and written as
	 * bf16 (4 KiB) a token and layer, 12,288 bytes at b_append */
	hw.b_append = 20e9;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), 0);
	assert_rel(t.tier[MLENS_PERF_BIND_CPU_ATTN], kv / hw.b_attn + st.tokens * 12288.0 / 20e9, 1e-12);
	assert_rel(t.group_cpu[0] + t.group_cpu[1], t.tier[MLENS_PERF_BIND_CPU_ATTN], 1e-12);
	/* the GPU appends (kv_append = gpu): no append in the CPU's time, and
	 * the D2H link carries decode q (fp32) and every token's K and V in
	 * the pool's bf16 (4 KiB) instead of fp32 K and V */
	{
		struct mlens_perf_step_time tg;
		double qd = (double)pm.heads * (double)pm.head_dim;
		hw.gpu_kv_append = true;
		ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &tg), 0);
		assert_rel(tg.tier[MLENS_PERF_BIND_CPU_ATTN], kv / hw.b_attn, 1e-12);
		assert_rel(tg.tier[MLENS_PERF_BIND_D2H],
			   (st.decode * qd * 4 + st.tokens * 4096.0) / hw.b_d2h, 1e-12);
		ck_assert(tg.tier[MLENS_PERF_BIND_D2H] < t.tier[MLENS_PERF_BIND_D2H]);
		/* the stores at their measured 20 GB/s beside the kernels
		 * (queue 2): the link's time is the q copies at b_d2h plus the
		 * stores at 20 GB/s; the GPU and CPU memory tiers unchanged */
		{
			struct mlens_perf_step_time ts, tc;
			double gpu0 = tg.tier[MLENS_PERF_BIND_GPU], n0 = (1 - pol.alpha_decode) * st.decode +
					(1 - pol.alpha_prefill) * (st.tokens - st.decode);
			hw.b_kv_store = 20e9;
			hw.kv_store_side = true;
			ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &ts), 0);
			assert_rel(ts.tier[MLENS_PERF_BIND_D2H],
				   st.decode * qd * 4 / hw.b_d2h + st.tokens * 4096.0 / 20e9, 1e-12);
			assert_rel(ts.tier[MLENS_PERF_BIND_GPU], gpu0, 1e-12);
			assert_rel(ts.tier[MLENS_PERF_BIND_CPU_MEM], tg.tier[MLENS_PERF_BIND_CPU_MEM], 1e-12);
			/* on the compute queue: the link has only the q copies,
			 * each group's GPU time its tokens' stores */
			hw.kv_store_side = false;
			ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &tc), 0);
			assert_rel(tc.tier[MLENS_PERF_BIND_D2H], st.decode * qd * 4 / hw.b_d2h, 1e-12);
			assert_rel(tc.tier[MLENS_PERF_BIND_GPU], gpu0 + st.tokens * 4096.0 / 20e9, 1e-12);
			assert_rel(tc.group_gpu[1], tg.group_gpu[1] + n0 * 4096.0 / 20e9, 1e-12);
			hw.b_kv_store = -1;
			ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &tc), -EINVAL);
			hw.b_kv_store = 0;
		}
		hw.gpu_kv_append = false;
	}
	hw.b_append = -1;
	ck_assert_int_eq(mlens_perf_step_time(&pm, &hw, &pol, &st, &t), -EINVAL);
}
END_TEST

START_TEST(policy_loose_budget)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 139);
	struct mlens_perf_workload w = { 98, 32, 1e6, 0 };
	struct mlens_perf_prediction pr;
	char err[512] = "";
	ck_assert_msg(mlens_perf_choose(&pm, &hw, &w, &pr, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(pr.policy.resident_experts, 8);
	ck_assert_uint_eq(pr.gpu_slots, 0);
	ck_assert_uint_eq(pr.gpu_resident, pm.model_bytes);
	ck_assert_int_eq(pr.time.bind, MLENS_PERF_BIND_GPU);
	ck_assert_str_eq(mlens_perf_bind_name(pr.time.bind), "gpu");
	ck_assert(isinf(pr.n_eq));
	/* nothing to hide: the KV capacity sets the step (PME·M tokens) */
	ck_assert_int_eq(pr.limit, MLENS_PERF_LIMIT_KV);
	assert_rel(pr.tokens, mlens_perf_pme(98, 32) * 1e6, 1e-12);
	ck_assert_uint_le(pr.gpu_total, hw.gpu_budget);
	ck_assert(pr.total_tok_s <= pr.t_max * (1 + 1e-9));
}
END_TEST

START_TEST(minimum_budget_refused)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 1);
	struct mlens_perf_workload w = { 512, 128, 1e5, 0 };
	struct mlens_perf_prediction pr;
	char err[512] = "", want[32];
	uint64_t need = mlens_perf_min_budget(&pm, &hw, 512);
	/* by hand: resident non-expert weights, two slots of 8 experts,
	 * activations for one 512-token prompt, workspace */
	ck_assert_uint_eq(need, pm.model_bytes - 32 * pm.layer_expert_bytes + 2 * pm.layer_expert_bytes +
				mlens_gpu_plan_act_estimate(&pm, 512, 0) + hw.gpu_workspace);

	hw.gpu_budget = need - 1;
	ck_assert_int_eq(mlens_perf_choose(&pm, &hw, &w, &pr, err, sizeof(err)), -ENOSPC);
	ck_assert_ptr_nonnull(strstr(err, "too small"));
	ck_assert_ptr_nonnull(strstr(err, "raise gpu_memory"));
	snprintf(want, sizeof(want), "at least %.2f GiB", (double)need / GIB);
	ck_assert_msg(strstr(err, want) != NULL, "%s", err);

	hw.gpu_budget = need;
	ck_assert_int_eq(mlens_perf_choose(&pm, &hw, &w, &pr, err, sizeof(err)), 0);
	ck_assert_int_eq(pr.policy.resident_experts, 0);
	ck_assert_int_eq(pr.limit, MLENS_PERF_LIMIT_ACT);
	ck_assert(pr.n_real == 512);
	ck_assert_uint_le(pr.gpu_total, hw.gpu_budget);

	/* a fixed residency that does not fit is refused with its numbers */
	ck_assert_int_eq(mlens_perf_predict(&pm, &hw, &w, 4, &pr, err, sizeof(err)), -ENOSPC);
	ck_assert_ptr_nonnull(strstr(err, "4 resident experts"));

	/* one layer: its experts resident cost less than two slots of them */
	{
		struct mlens_model_config c = mlens_test_mixtral_config(32);
		struct mlens_perf_model one;
		c.num_hidden_layers = 1;
		ck_assert_int_eq(mlens_perf_model_from_config(&one, &c, MLENS_DTYPE_BF16), 0);
		need = mlens_perf_min_budget(&one, &hw, 512);
		ck_assert_uint_eq(need, one.model_bytes + mlens_gpu_plan_act_estimate(&one, 512, 0) + hw.gpu_workspace);
		hw.gpu_budget = need;
		ck_assert_int_eq(mlens_perf_choose(&one, &hw, &w, &pr, err, sizeof(err)), 0);
		ck_assert_int_eq(pr.policy.resident_experts, 8);
		hw.gpu_budget = need - 1;
		ck_assert_int_eq(mlens_perf_choose(&one, &hw, &w, &pr, err, sizeof(err)), -ENOSPC);
	}
}
END_TEST

START_TEST(throughput_monotone_in_kv)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	struct mlens_perf_hw hw = mlens_test_a40_hw(&pm, 24);
	struct mlens_perf_prediction pr, prev;
	char err[512];
	int kv_limited = 0;
	for (int i = 0; i < 40; i++) {
		struct mlens_perf_workload w = { 512, 128, 1e4 * pow(1.25, i), 0 };
		ck_assert_msg(mlens_perf_choose(&pm, &hw, &w, &pr, err, sizeof(err)) == 0, "%s", err);
		ck_assert_uint_le(pr.gpu_total, hw.gpu_budget);
		if (i > 0) {
			ck_assert_msg(pr.total_tok_s >= prev.total_tok_s * (1 - 1e-12),
				      "M %.0f: %.3f < %.3f", w.kv_tokens, pr.total_tok_s, prev.total_tok_s);
			if (pr.limit == MLENS_PERF_LIMIT_KV && prev.limit == MLENS_PERF_LIMIT_KV &&
			    pr.policy.resident_experts == prev.policy.resident_experts) {
				ck_assert(pr.total_tok_s > prev.total_tok_s);
				kv_limited++;
			}
		}
		prev = pr;
	}
	/* the sweep covers both regimes */
	ck_assert_int_gt(kv_limited, 3);
	ck_assert_int_ne(pr.limit, MLENS_PERF_LIMIT_KV);
}
END_TEST

/* ==== the scheduler under the model's cap ==== */

static int emit_count(struct mlens_sched_tenant *t, const struct mlens_event *ev)
{
	/* the scheduler's stats keep the counts this test checks */
	(void)t;
	(void)ev;
	return 0;
}

static void run_capped(uint64_t budget_extra, enum mlens_perf_limit want_limit)
{
	struct mlens_test_spec sp = mlens_test_spec_tiny();
	struct mlens_model *m = mlens_test_model_new(&sp);
	struct mlens_backend be;
	struct mlens_engine *e;
	struct mlens_sched *s;
	struct mlens_engine_opts eo = { .kv_block_size = 4, .kv_blocks = 512, .kv_dtype = -1,
					.max_step_tokens = 256, .prefill_attn = MLENS_PREFILL_AUTO };
	struct mlens_sched_opts so = { .token_cap = 0 };
	struct mlens_sched_tenant t;
	struct mlens_quota q = { 0, 0, 1000, 1.0 };
	struct mlens_sched_stats st;
	struct mlens_perf_model pm;
	struct mlens_perf_hw hw;
	struct mlens_perf_workload w = { 7, 6, 2048, 7 };
	struct mlens_perf_prediction pr;
	uint64_t streamed;
	char err[256];
	int cap, want_cap, steps = 0;
	uint32_t most = 0;

	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &m->cfg, MLENS_DTYPE_F32), 0);
	streamed = mlens_gpu_plan_streamed_bytes(&pm, 0);
	/* ceilings scaled to the tiny model: the transfer of a layer takes
	 * 26.5 µs, the GPU 2 µs a step plus 1 µs a token */
	memset(&hw, 0, sizeof(hw));
	hw.b_io = (double)streamed / 26.5e-6;
	hw.b_mem = 10 * hw.b_io;
	hw.b_attn = 1e9;
	hw.ga.a = 0.25e-6;
	hw.gb.a = 0.75e-6;
	hw.ga.b = 0.4e-6;
	hw.gb.b = 0.6e-6;
	hw.chunk = 64;
	hw.gpu_budget = mlens_gpu_plan_resident_bytes(&pm, 0) + mlens_gpu_plan_slot_bytes(&pm, 0) + budget_extra;
	ck_assert_msg(mlens_perf_predict(&pm, &hw, &w, 0, &pr, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(pr.limit, want_limit);
	cap = mlens_perf_token_cap(&pr);
	if (want_limit == MLENS_PERF_LIMIT_NREAL)
		/* 1 µs a token less the link time of the 6/13 decode tokens'
		 * fp32 attention outputs, which share the transfer */
		want_cap = (int)floor(((double)streamed / hw.b_io - 2 * 1e-6) /
				      (1e-6 - 6.0 / 13 * (double)(pm.heads * pm.head_dim) * 4 / hw.b_io));
	else	/* the most tokens whose activations fit budget_extra */
		for (want_cap = 0; mlens_gpu_plan_act_estimate(&pm, want_cap + 1, 64) <= budget_extra; want_cap++)
			;
	ck_assert_int_eq(cap, want_cap);
	ck_assert_int_gt(cap, 7);
	ck_assert_int_lt(cap, 256);

	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_msg(mlens_engine_create(&e, m, &be, &eo, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(mlens_sched_create(&s, e, &so), 0);
	mlens_sched_set_token_cap(s, cap);
	ck_assert_int_eq(mlens_sched_token_cap(s), cap);
	mlens_sched_tenant_init(&t, &q, emit_count);
	for (int i = 0; i < 60; i++) {
		int32_t p[7];
		struct mlens_request_params rp;
		char why[200];
		for (int j = 0; j < 7; j++)
			p[j] = (int32_t)((i * 31 + j * 7) % 97);
		memset(&rp, 0, sizeof(rp));
		rp.id = (uint64_t)i;
		rp.prompt = p;
		rp.n_prompt = 7;
		rp.max_tokens = 6;
		rp.samp.top_p = 1.0f;
		ck_assert_msg(mlens_sched_submit(s, &t, &rp, why, sizeof(why)) == 0, "%s", why);
	}
	while (!mlens_sched_idle(s) && steps < 10000) {
		ck_assert_int_eq(mlens_sched_step(s), 1);
		mlens_sched_get_stats(s, &st);
		ck_assert_uint_le(st.last_step_tokens, (uint32_t)cap);
		if (st.last_step_tokens > most)
			most = st.last_step_tokens;
		steps++;
	}
	mlens_sched_get_stats(s, &st);
	ck_assert(mlens_sched_idle(s));
	ck_assert_uint_eq(st.requests_done, 60);
	ck_assert_uint_eq(st.generated_tokens, 60 * 6);
	/* the cap was what limited the steps, not the work */
	ck_assert_uint_gt(most, (uint32_t)cap - 7);
	mlens_sched_destroy(s);
	mlens_engine_destroy(e);
	mlens_backend_destroy(&be);
	mlens_test_model_free(m);
}

/* mean step tokens of a real scheduler (tiny model, CPU backend) over its
 * steady steps: after the first request finished, while requests wait */
static double sched_mean_step(int cap, int p, int g, int n_req)
{
	struct mlens_test_spec sp = mlens_test_spec_tiny();
	struct mlens_model *m = mlens_test_model_new(&sp);
	struct mlens_backend be;
	struct mlens_engine *e;
	struct mlens_sched *s;
	struct mlens_engine_opts eo = { .kv_block_size = 4, .kv_blocks = 1024, .kv_dtype = -1,
					.max_step_tokens = 256, .prefill_attn = MLENS_PREFILL_AUTO };
	struct mlens_sched_opts so = { .token_cap = cap };
	struct mlens_sched_tenant t;
	struct mlens_quota q = { 0, 0, 100000, 1.0 };
	struct mlens_sched_stats st;
	char err[256];
	double sum = 0;
	int n = 0, steps = 0;

	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_msg(mlens_engine_create(&e, m, &be, &eo, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(mlens_sched_create(&s, e, &so), 0);
	ck_assert_int_eq(mlens_sched_token_cap(s), cap);
	mlens_sched_tenant_init(&t, &q, emit_count);
	for (int i = 0; i < n_req; i++) {
		int32_t pr[64];
		struct mlens_request_params rp;
		char why[200];
		for (int j = 0; j < p; j++)
			pr[j] = (int32_t)((i * 31 + j * 7) % 97);
		memset(&rp, 0, sizeof(rp));
		rp.id = (uint64_t)i;
		rp.prompt = pr;
		rp.n_prompt = p;
		rp.max_tokens = g;
		rp.samp.top_p = 1.0f;
		ck_assert_msg(mlens_sched_submit(s, &t, &rp, why, sizeof(why)) == 0, "%s", why);
	}
	while (!mlens_sched_idle(s) && steps < 100000) {
		ck_assert_int_eq(mlens_sched_step(s), 1);
		mlens_sched_get_stats(s, &st);
		if (st.requests_done > 0 && st.waiting > 0) {
			sum += st.last_step_tokens;
			n++;
		}
		steps++;
	}
	mlens_sched_get_stats(s, &st);
	ck_assert_uint_eq(st.requests_done, (uint64_t)n_req);
	ck_assert_uint_eq(st.preemptions, 0);
	ck_assert_int_gt(n, 20);
	mlens_sched_destroy(s);
	mlens_engine_destroy(e);
	mlens_backend_destroy(&be);
	mlens_test_model_free(m);
	return sum / n;
}

START_TEST(sched_steady_matches_scheduler)
{
	struct mlens_perf_sched_state ss;
	double got;
	/* p 7, g 6, cap 40: m0 = 3, D* = max(15, 12) = 15, k = 3, n = 36 */
	ck_assert_int_eq(mlens_perf_sched_steady(7, 6, 40, 1e9, &ss), 0);
	assert_rel(ss.tokens, 36, 1e-15);
	/* the model's recurrence admits whole prompts into what decodes
	 * leave; the scheduler also lets a prompt held back by the cap take
	 * decodes' places (they wait a step), so its steps are at least as
	 * full and at most the cap */
	got = sched_mean_step(40, 7, 6, 240);
	ck_assert_msg(got >= 0.99 * ss.tokens && got <= 40, "scheduler %.2f, model %.2f", got, ss.tokens);
	/* cap 45: admissions 3, 3, 3, 4, 4, 4 in turn, n = 42 */
	ck_assert_int_eq(mlens_perf_sched_steady(7, 6, 45, 1e9, &ss), 0);
	assert_rel(ss.tokens, 42, 1e-3);
	got = sched_mean_step(45, 7, 6, 240);
	ck_assert_msg(got >= 0.99 * ss.tokens && got <= 45, "scheduler %.2f, model %.2f", got, ss.tokens);
}
END_TEST

START_TEST(sched_respects_nreal_cap)
{
	run_capped(64ull << 20, MLENS_PERF_LIMIT_NREAL);
}
END_TEST

START_TEST(sched_respects_activation_cap)
{
	struct mlens_test_spec sp = mlens_test_spec_tiny();
	struct mlens_model *m = mlens_test_model_new(&sp);
	struct mlens_perf_model pm;
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &m->cfg, MLENS_DTYPE_F32), 0);
	mlens_test_model_free(m);
	/* room for activations of 15 tokens and a little: fewer than n_eq */
	run_capped(mlens_gpu_plan_act_estimate(&pm, 15, 64) + 100, MLENS_PERF_LIMIT_ACT);
}
END_TEST

/* ==== the scheduler's steady state and the hybrid bound ==== */

START_TEST(seq_blocks_occupancy)
{
	/* p = 10, g = 4, blocks of 4: ages 0..3 hold 10..13 tokens,
	 * ceil: 3, 3, 3, 4 blocks -> 13/4 */
	assert_rel(mlens_perf_seq_blocks(10, 4, 4), 3.25, 1e-15);
	/* tokens: (10 + 11 + 12 + 13) / 4 = p + (g - 1)/2 */
	assert_rel(mlens_perf_seq_blocks(10, 4, 0), 11.5, 1e-15);
	/* p = 512, g = 32, blocks of 16: 512..543 -> 32 x 16 blocks then
	 * 31 x 34 + 1 x 32 ... by hand: 512 -> 32, 513..528 -> 33 (16 ages),
	 * 529..543 -> 34 (15 ages): (32 + 16 x 33 + 15 x 34) / 32 */
	assert_rel(mlens_perf_seq_blocks(512, 32, 16), (32.0 + 16 * 33 + 15 * 34) / 32, 1e-15);
	ck_assert(isnan(mlens_perf_seq_blocks(0, 4, 16)));
	ck_assert(isnan(mlens_perf_seq_blocks(10, 0, 16)));
}
END_TEST

START_TEST(sched_steady_state)
{
	struct mlens_perf_sched_state s;
	/* a GPU run: cap 4096, p 512, g 32: m0 = floor(4096/543)
	 * = 7, D* = max(31 x 7, 4096 - 8 x 512) = 217, k = 7 */
	ck_assert_int_eq(mlens_perf_sched_steady(512, 32, 4096, 1e9, &s), 0);
	ck_assert(s.cap_binds);
	assert_rel(s.prompts, 7, 1e-15);
	assert_rel(s.tokens, 3801, 1e-15);
	assert_rel(s.decode, 217, 1e-15);
	assert_rel(s.seqs, 224, 1e-15);
	assert_rel(s.generated, 224, 1e-15);
	assert_rel(s.context, 217.0 * 528, 1e-15);
	/* admissions alternate: p 7, g 6, cap 45 settles into 3, 3, 3, 4, 4,
	 * 4: before each 3 the last five admissions sum to D = 18 (3+3+4+4+4,
	 * 3+4+4+4+3, 4+4+4+3+3), floor((45 - 18)/7) = 3; before each 4 to
	 * D = 17, floor(28/7) = 4. k = 3.5, n = 3.5 x 12 = 42 (the fixed point
	 * D* = max(15, 45 - 28) would say 3.4) */
	ck_assert_int_eq(mlens_perf_sched_steady(7, 6, 45, 1e9, &s), 0);
	assert_rel(s.prompts, 3.5, 1e-3);
	assert_rel(s.tokens, 42, 1e-3);
	/* p 7, g 6, cap 40: m0 = 3 every step, n = 36 */
	ck_assert_int_eq(mlens_perf_sched_steady(7, 6, 40, 1e9, &s), 0);
	assert_rel(s.prompts, 3, 1e-15);
	assert_rel(s.tokens, 36, 1e-15);
	/* g = 1: prompts only, floor(35 / 10) = 3 */
	ck_assert_int_eq(mlens_perf_sched_steady(10, 1, 35, 1e9, &s), 0);
	assert_rel(s.prompts, 3, 1e-15);
	assert_rel(s.tokens, 30, 1e-15);
	ck_assert(s.decode == 0);
	/* in-flight bound: 100 sequences, k = 100/32 */
	ck_assert_int_eq(mlens_perf_sched_steady(512, 32, 4096, 100, &s), 0);
	ck_assert(!s.cap_binds);
	assert_rel(s.prompts, 3.125, 1e-15);
	assert_rel(s.tokens, 3.125 * 543, 1e-15);
	assert_rel(s.generated, 100, 1e-15);
	ck_assert_int_eq(mlens_perf_sched_steady(512, 32, 511, 100, &s), -EINVAL);
	ck_assert_int_eq(mlens_perf_sched_steady(512, 32, 4096, 0, &s), -EINVAL);
}
END_TEST

/* H 4, I 8, 2 layers, 2 heads of 2 (qd 4), 1 kv head (kvd 2), 4 experts,
 * top 2, vocab 10, bf16 */
static void bound_model(struct mlens_perf_model *pm)
{
	struct mlens_model_config c;
	memset(&c, 0, sizeof(c));
	c.vocab_size = 10;
	c.hidden_size = 4;
	c.intermediate_size = 8;
	c.num_hidden_layers = 2;
	c.num_attention_heads = 2;
	c.num_key_value_heads = 1;
	c.head_dim = 2;
	c.num_local_experts = 4;
	c.num_experts_per_tok = 2;
	c.dtype = MLENS_DTYPE_BF16;
	ck_assert_int_eq(mlens_perf_model_from_config(pm, &c, MLENS_DTYPE_BF16), 0);
}

START_TEST(issue7_bound)
{
	/* the model of bound_model: GA = 2 x 4 x (4 + 4) = 64, GB = 2 x 4 x 4 +
	 * 2 x 4 x 4 + 2 x 6 x 4 x 8 = 448 FLOPs per token and layer; K and V of
	 * a token in a layer 2 x 2 x 2 = 8 bytes */
	struct mlens_perf_model pm;
	struct mlens_perf_bound b;
	bound_model(&pm);
	assert_rel(pm.flops_ga, 64, 1e-15);
	assert_rel(pm.flops_gb, 448, 1e-15);
	ck_assert_uint_eq(pm.kv_token_bytes, 8);
	/* p 10, g 4, 8 sequences: k = 2, D = 6, n = 26, 8 generated; context
	 * 6 x 12 = 72 rows, KV 72 x 8 x 2 = 1152 bytes; FLOPs 26 x 2 x 512 +
	 * 2 x 4 x 4 x 2 x 10 x 11 / 2 + 2 x 4 x 10 x 8 = 26624 + 3520 + 640 */
	ck_assert_int_eq(mlens_perf_bound(&pm, 10, 4, 8, 1000, 100, 200, 2000, 0, &b), 0);
	assert_rel(b.st.tokens, 26, 1e-15);
	assert_rel(b.st.decode, 6, 1e-15);
	assert_rel(b.kv_bytes, 1152, 1e-15);
	assert_rel(b.flops, 30784, 1e-15);
	assert_rel(b.t_pcie, 10, 1e-15);
	assert_rel(b.t_mem, 2152.0 / 200, 1e-15);
	assert_rel(b.t_gemm, 15.392, 1e-15);
	assert_rel(b.t_step, 15.392, 1e-15);
	ck_assert_str_eq(b.binds, "gpu-gemm");
	assert_rel(b.gen_tok_s, 8 / 15.392, 1e-15);
	assert_rel(b.total_tok_s, 2 * 14 / 15.392, 1e-15);
	/* a faster GPU: memory binds (10.76 s); without a memory rate, PCIe */
	ck_assert_int_eq(mlens_perf_bound(&pm, 10, 4, 8, 1000, 100, 200, 1e4, 0, &b), 0);
	ck_assert_str_eq(b.binds, "cpu-memory");
	assert_rel(b.t_step, 10.76, 1e-15);
	ck_assert_int_eq(mlens_perf_bound(&pm, 10, 4, 8, 1000, 100, 0, 1e4, 0, &b), 0);
	ck_assert_str_eq(b.binds, "pcie-h2d");
	assert_rel(b.gen_tok_s, 0.8, 1e-15);
	ck_assert_int_eq(mlens_perf_bound(&pm, 10, 4, 0, 1000, 100, 200, 1e4, 0, &b), -EINVAL);
	ck_assert_int_eq(mlens_perf_bound(&pm, 10, 4, 8, 1000, 0, 0, 0, 0, &b), -EINVAL);
	/* experts on disk: 1,000 bytes a step at 200 B/s (5 s) stay below
	 * PCIe's 10 s; at 50 B/s (20 s) the disk binds, the batch the same */
	ck_assert_int_eq(mlens_perf_bound(&pm, 10, 4, 8, 1000, 100, 0, 1e4, 0, &b), 0);
	ck_assert_int_eq(mlens_perf_bound_add_disk(&b, 1000, 200), 0);
	assert_rel(b.t_disk, 5, 1e-15);
	ck_assert_str_eq(b.binds, "pcie-h2d");
	assert_rel(b.gen_tok_s, 0.8, 1e-15);
	ck_assert_int_eq(mlens_perf_bound_add_disk(&b, 1000, 50), 0);
	assert_rel(b.t_disk, 20, 1e-15);
	assert_rel(b.t_step, 20, 1e-15);
	ck_assert_str_eq(b.binds, "disk");
	assert_rel(b.gen_tok_s, 8.0 / 20, 1e-15);
	assert_rel(b.total_tok_s, 2 * 14 / 20.0, 1e-15);
	assert_rel(b.st.tokens, 26, 1e-15);
	ck_assert_int_eq(mlens_perf_bound_add_disk(&b, 1000, 0), -EINVAL);
	ck_assert_int_eq(mlens_perf_bound_add_disk(&b, -1, 50), -EINVAL);
}
END_TEST

/* fp8 experts: the routed experts' GEMM FLOPs at their own (fp8) rate,
 * the rest (attention projections, router, lm_head, prefill attention)
 * at the bf16 one */
START_TEST(bound_expert_gemm_rate)
{
	struct mlens_perf_model pm;
	struct mlens_perf_mix mix;
	struct mlens_perf_bound b, b1;
	static const double P = 10, G = 4;

	assert_rel(mlens_perf_gemm_seconds(100, 60, 10, 20), 7, 1e-15);
	assert_rel(mlens_perf_gemm_seconds(100, 60, 10, 0), 10, 1e-15);
	assert_rel(mlens_perf_gemm_seconds(100, 60, 0, 20), 0, 1e-15);
	bound_model(&pm);
	/* k x 6 H I = 2 x 6 x 4 x 8 of GB's 448 (O 32, router 32) */
	assert_rel(pm.flops_experts, 384, 1e-15);
	/* issue7_bound's step: 26 tokens x 2 layers x 384 = 19968 of its
	 * 30784 FLOPs; the other 10816 at 1000 FLOP/s, the experts' at 4000:
	 * 10.816 + 4.992 s, above memory's 10.76 */
	ck_assert_int_eq(mlens_perf_bound(&pm, P, G, 8, 1000, 100, 200, 1000, 4000, &b), 0);
	assert_rel(b.flops, 30784, 1e-15);
	assert_rel(b.expert_flops, 19968, 1e-15);
	assert_rel(b.t_gemm, 15.808, 1e-15);
	assert_rel(b.t_step, 15.808, 1e-15);
	ck_assert_str_eq(b.binds, "gpu-gemm");
	assert_rel(b.gen_tok_s, 8 / 15.808, 1e-15);
	/* the experts twice as fast again: 10.816 + 2.496 = 13.312 s */
	ck_assert_int_eq(mlens_perf_bound(&pm, P, G, 8, 1000, 100, 200, 1000, 8000, &b), 0);
	assert_rel(b.t_gemm, 13.312, 1e-15);
	/* no expert rate: everything at the one rate, as before */
	ck_assert_int_eq(mlens_perf_bound(&pm, P, G, 8, 1000, 100, 200, 1000, 0, &b), 0);
	assert_rel(b.t_gemm, 30.784, 1e-15);
	ck_assert_int_eq(mlens_perf_bound(&pm, P, G, 8, 1000, 100, 200, 1000, 1000, &b1), 0);
	assert_rel(b1.t_gemm, b.t_gemm, 1e-15);
	/* a mix of one charges the same */
	ck_assert_int_eq(mlens_perf_mix_of(&P, &G, 1, 4, &mix), 0);
	ck_assert_int_eq(mlens_perf_bound_mix(&pm, &mix, 8 * mlens_perf_seq_blocks(P, G, 4), 1000, 100,
					      200, 1000, 4000, &b), 0);
	assert_rel(b.expert_flops, 19968, 1e-12);
	assert_rel(b.t_gemm, 15.808, 1e-12);
}
END_TEST

/* The mix's accounting against a brute-force run: one request a step,
 * the mix's pairs in turn, each living g steps and holding ceil((p+a)/B)
 * blocks at age a, its decodes (a >= 1) reading p + a rows. Over whole
 * cycles of the steady part, the per-step means are what the bound takes
 * for k = 1: blocks held (the pool that holds that many runs S_kv = the
 * sequences alive), decode and step tokens, KV rows read, prefill pairs. */
START_TEST(mix_bound_matches_simulation)
{
	static const double P[] = { 5, 12, 1, 40, 7 }, G[] = { 3, 7, 1, 2, 11 };
	enum { N = 5, B = 4, WARM = 50 * N, MEAS = 200 * N };
	struct mlens_perf_model pm;
	struct mlens_perf_mix mix;
	struct mlens_perf_bound b, b1;
	double held = 0, alive = 0, decode = 0, tokens = 0, rows = 0, pairs = 0, gen = 0;

	for (int t = 0; t < WARM + MEAS; t++) {
		/* every request admitted at step u <= t still alive at t */
		for (int u = t; u >= 0 && t - u < 16; u--) {
			int i = u % N, a = t - u;
			if (a >= G[i] || t < WARM)
				continue;
			alive += 1;
			held += ceil((P[i] + a) / B);
			gen += 1;
			if (a == 0) {
				tokens += P[i];
				pairs += P[i] * (P[i] + 1) / 2;
			} else {
				decode += 1;
				tokens += 1;
				rows += P[i] + a;
			}
		}
	}
	ck_assert_int_eq(mlens_perf_mix_of(P, G, N, B, &mix), 0);
	assert_rel(mlens_perf_mix_seq_blocks(&mix), held / alive, 1e-12);
	bound_model(&pm);
	ck_assert_int_eq(mlens_perf_bound_mix(&pm, &mix, held / MEAS, 1000, 100, 200, 2000, 0, &b), 0);
	assert_rel(b.st.prompts, 1, 1e-12);
	assert_rel(b.st.seqs, alive / MEAS, 1e-12);
	assert_rel(b.st.decode, decode / MEAS, 1e-12);
	assert_rel(b.st.tokens, tokens / MEAS, 1e-12);
	assert_rel(b.st.generated, gen / MEAS, 1e-12);
	assert_rel(b.st.context, rows / MEAS, 1e-12);
	assert_rel(b.kv_bytes, rows / MEAS * 8 * 2, 1e-12);
	assert_rel(b.flops, tokens / MEAS * 2 * 512 + 2 * 4 * 4 * pairs / MEAS + 2 * 4 * 10 * gen / MEAS,
		   1e-12);
	/* the unweighted mean of the pairs' occupancies is not it: the long
	 * generations hold the pool longer */
	{
		double plain = 0;
		for (int i = 0; i < N; i++)
			plain += mlens_perf_seq_blocks(P[i], G[i], B) / N;
		ck_assert(fabs(plain - held / alive) > 0.25);
	}
	/* a mix of one is mlens_perf_bound */
	ck_assert_int_eq(mlens_perf_mix_of(&P[1], &G[1], 1, B, &mix), 0);
	assert_rel(mlens_perf_mix_seq_blocks(&mix), mlens_perf_seq_blocks(12, 7, B), 1e-15);
	ck_assert_int_eq(mlens_perf_bound_mix(&pm, &mix, 8 * mlens_perf_seq_blocks(12, 7, B), 1000, 100,
					      200, 2000, 0, &b), 0);
	ck_assert_int_eq(mlens_perf_bound(&pm, 12, 7, 8, 1000, 100, 200, 2000, 0, &b1), 0);
	assert_rel(b.st.tokens, b1.st.tokens, 1e-12);
	assert_rel(b.kv_bytes, b1.kv_bytes, 1e-12);
	assert_rel(b.flops, b1.flops, 1e-12);
	assert_rel(b.gen_tok_s, b1.gen_tok_s, 1e-12);
	assert_rel(b.total_tok_s, b1.total_tok_s, 1e-12);
	ck_assert_str_eq(b.binds, b1.binds);
	/* bad input */
	{
		double z = 0;
		ck_assert_int_eq(mlens_perf_mix_of(&z, G, 1, B, &mix), -EINVAL);
		ck_assert_int_eq(mlens_perf_mix_of(P, G, 0, B, &mix), -EINVAL);
	}
}
END_TEST

int main(void)
{
	Suite *su = suite_create("perfmodel");
	TCase *tc = tcase_create("core");
	SRunner *sr;
	int failed;
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, mixtral_bytes);
	tcase_add_test(tc, fp8_expert_bytes);
	tcase_add_test(tc, family_bytes);
	tcase_add_test(tc, config_errors);
	tcase_add_test(tc, activation_bytes);
	tcase_add_test(tc, eq2_mixtral_a40);
	tcase_add_test(tc, pme_and_tmax);
	tcase_add_test(tc, fit_recovers_line);
	tcase_add_test(tc, step_time_tiers);
	tcase_add_test(tc, split_balances_groups);
	tcase_add_test(tc, policy_tight_budget);
	tcase_add_test(tc, policy_shared_stream);
	tcase_add_test(tc, attention_under_copy);
	tcase_add_test(tc, policy_loose_budget);
	tcase_add_test(tc, choose_resident_cap);
	tcase_add_test(tc, minimum_budget_refused);
	tcase_add_test(tc, throughput_monotone_in_kv);
	tcase_add_test(tc, sched_respects_nreal_cap);
	tcase_add_test(tc, sched_respects_activation_cap);
	tcase_add_test(tc, seq_blocks_occupancy);
	tcase_add_test(tc, sched_steady_state);
	tcase_add_test(tc, issue7_bound);
	tcase_add_test(tc, sched_steady_matches_scheduler);
	tcase_add_test(tc, mix_bound_matches_simulation);
	tcase_add_test(tc, bound_expert_gemm_rate);
	tcase_add_test(tc, disk_tier_ceiling);
	suite_add_tcase(su, tc);
	sr = srunner_create(su);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
