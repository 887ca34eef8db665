/* Description: several GPUs without GPUs. The partitioning
 * arithmetic against hand-computed Mixtral-8x7B numbers (heads, kv
 * replication, expert splits even and uneven, streamed bytes, collective
 * volumes) and its refusals; the sharded forward pass on G fake ranks
 * (tensor and expert parallel, G = 1, 2, 4, GQA ratios 1 and 4, E % G != 0)
 * against the unsharded engine on the CPU backend; the performance model
 * over several GPUs (one GPU equals the single-GPU model, a TP shard by
 * hand, super-linear and sub-linear scaling of Mixtral-8x7B at 1, 2, 4
 * GPUs, TP against EP); the gpus key.
 *
 * Tolerance of the sharded logits: |sharded - engine| <= 1e-5 x max |engine
 * logit| of the row. Both are fp32; the sharded path adds partial sums in
 * another order (per-rank dot products of hd x heads/G or I/G terms, then
 * the all-reduce), which moves results by a few ulps per layer; the greedy
 * tokens must be identical. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/config.h"
#include "daemon/exec/engine.h"
#include "daemon/plan/perfmodel.h"
#include "daemon/plan/shard.h"
#include "daemon/tools/shard_sim.h"
#include "tests/testmodel.h"

#define SHARD_TOL 1e-5

static void assert_rel(double got, double want, double tol)
{
	ck_assert_msg(fabs(got - want) <= tol * fabs(want), "got %.10g want %.10g", got, want);
}

/* ==== arithmetic ==== */

START_TEST(split_balanced)
{
	int st, total = 0;
	ck_assert_int_eq(mlens_shard_split(8, 3, 0, &st), 3);
	ck_assert_int_eq(st, 0);
	ck_assert_int_eq(mlens_shard_split(8, 3, 1, &st), 3);
	ck_assert_int_eq(st, 3);
	ck_assert_int_eq(mlens_shard_split(8, 3, 2, &st), 2);
	ck_assert_int_eq(st, 6);
	for (int i = 0; i < 7; i++) {
		int c = mlens_shard_split(50, 7, i, &st);
		ck_assert_int_eq(st, total);
		ck_assert(c == 7 || c == 8);
		total += c;
	}
	ck_assert_int_eq(total, 50);
}
END_TEST

START_TEST(plan_mixtral)
{
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_shard_plan p;
	char err[256];

	/* TP over 4: 8 q heads, 2 kv heads, 3584 intermediate rows each */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 4, MLENS_SHARD_TP, err, sizeof(err)), 0);
	ck_assert_int_eq(p.kv_replicas, 1);
	for (int r = 0; r < 4; r++) {
		ck_assert_int_eq(p.rank[r].q_heads, 8);
		ck_assert_int_eq(p.rank[r].q_head0, 8 * r);
		ck_assert_int_eq(p.rank[r].kv_heads, 2);
		ck_assert_int_eq(p.rank[r].kv_head0, 2 * r);
		ck_assert_int_eq(p.rank[r].inter, 3584);
		ck_assert_int_eq(p.rank[r].inter0, 3584 * r);
		ck_assert_int_eq(p.rank[r].experts, 8);
		ck_assert_int_eq(p.rank[r].vocab, 8000);
		ck_assert_int_eq(mlens_shard_expert_owner(&p, r), -1);
	}
	/* 16 GPUs: 2 q heads each, each kv head on two GPUs */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 16, MLENS_SHARD_TP, err, sizeof(err)), 0);
	ck_assert_int_eq(p.kv_replicas, 2);
	for (int r = 0; r < 16; r++) {
		ck_assert_int_eq(p.rank[r].kv_heads, 1);
		ck_assert_int_eq(p.rank[r].kv_head0, r / 2);
		/* its query heads all read that kv head (group of 4) */
		ck_assert_int_eq(p.rank[r].q_head0 / 4, r / 2);
		ck_assert_int_eq((p.rank[r].q_head0 + p.rank[r].q_heads - 1) / 4, r / 2);
	}
	/* EP over 2: four whole experts each */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 2, MLENS_SHARD_EP, err, sizeof(err)), 0);
	ck_assert_int_eq(p.rank[1].expert0, 4);
	ck_assert_int_eq(p.rank[1].experts, 4);
	ck_assert_int_eq(p.rank[1].inter, 14336);
	ck_assert_int_eq(mlens_shard_expert_owner(&p, 3), 0);
	ck_assert_int_eq(mlens_shard_expert_owner(&p, 4), 1);
}
END_TEST

START_TEST(plan_refusals)
{
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_shard_plan p;
	char err[256];

	/* 32 heads over 3 GPUs */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 3, MLENS_SHARD_TP, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "32 attention heads"));
	ck_assert_ptr_nonnull(strstr(err, "gpus"));
	/* EP over more GPUs than experts */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 16, MLENS_SHARD_EP, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "use tensor parallel"));
	/* 6 kv heads over 4 GPUs: neither divides the other */
	c.num_attention_heads = 24;
	c.num_key_value_heads = 6;
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 4, MLENS_SHARD_TP, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "6 key/value heads"));
	c = mlens_test_mixtral_config(32);
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 0, MLENS_SHARD_TP, err, sizeof(err)), -EINVAL);
	ck_assert_int_eq(mlens_shard_plan(&p, &c, MLENS_SHARD_MAX_GPUS + 1, MLENS_SHARD_TP, err, sizeof(err)), -EINVAL);
	c.hidden_size = 0;
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 1, MLENS_SHARD_TP, err, sizeof(err)), -EINVAL);
}
END_TEST

START_TEST(uneven_experts)
{
	/* 6 experts over 4 GPUs: 2, 2, 1, 1; intermediate 50 rows: 13, 13, 12, 12 */
	struct mlens_test_spec sp = mlens_test_spec_tiny();
	struct mlens_model *m;
	struct mlens_shard_plan p;
	int want_e[4] = { 2, 2, 1, 1 }, want_e0[4] = { 0, 2, 4, 5 }, want_i[4] = { 13, 13, 12, 12 };
	sp.experts = 6;
	sp.inter = 50;
	m = mlens_test_model_new(&sp);
	ck_assert_int_eq(mlens_shard_plan(&p, &m->cfg, 4, MLENS_SHARD_EP, NULL, 0), 0);
	for (int r = 0; r < 4; r++) {
		ck_assert_int_eq(p.rank[r].experts, want_e[r]);
		ck_assert_int_eq(p.rank[r].expert0, want_e0[r]);
	}
	for (int e = 0; e < 6; e++)
		ck_assert_int_eq(mlens_shard_expert_owner(&p, e), e < 2 ? 0 : e < 4 ? 1 : e - 2);
	/* expected rows: n k E_r / E */
	assert_rel(mlens_shard_routed_rows(&p, 0, 300), 300.0 * 2 * 2 / 6, 1e-15);
	assert_rel(mlens_shard_routed_rows(&p, 3, 300), 300.0 * 2 * 1 / 6, 1e-15);
	ck_assert_int_eq(mlens_shard_plan(&p, &m->cfg, 4, MLENS_SHARD_TP, NULL, 0), 0);
	for (int r = 0; r < 4; r++)
		ck_assert_int_eq(p.rank[r].inter, want_i[r]);
	assert_rel(mlens_shard_routed_rows(&p, 2, 300), 600, 1e-15);
	mlens_test_model_free(m);
}
END_TEST

START_TEST(bytes_mixtral)
{
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_shard_plan p;
	uint64_t H = 4096, I = 14336, expert = 3 * H * I * 2;	/* 352321536 */

	ck_assert_int_eq(mlens_shard_plan(&p, &c, 1, MLENS_SHARD_TP, NULL, 0), 0);
	ck_assert_uint_eq(mlens_shard_stream_bytes(&p, 0, 2, 0), 2818572288ull);
	ck_assert_uint_eq(mlens_shard_attn_bytes(&p, 0, 2), 83886080ull);

	/* TP over 2: every expert's half, 8 x 176160768 */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 2, MLENS_SHARD_TP, NULL, 0), 0);
	ck_assert_uint_eq(mlens_shard_expert_unit_bytes(&p, 1, 2), expert / 2);
	ck_assert_int_eq(mlens_shard_expert_units(&p, 1), 8);
	ck_assert_uint_eq(mlens_shard_stream_bytes(&p, 1, 2, 0), 1409286144ull);
	ck_assert_uint_eq(mlens_shard_stream_bytes(&p, 1, 2, 7), expert / 2);
	ck_assert_uint_eq(mlens_shard_stream_bytes(&p, 1, 2, 99), 0);
	ck_assert_uint_eq(mlens_shard_attn_bytes(&p, 1, 2), 83886080ull / 2);
	/* EP over 2: four whole experts, the same bytes */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 2, MLENS_SHARD_EP, NULL, 0), 0);
	ck_assert_uint_eq(mlens_shard_expert_unit_bytes(&p, 0, 2), expert);
	ck_assert_uint_eq(mlens_shard_stream_bytes(&p, 0, 2, 0), 1409286144ull);
	ck_assert_uint_eq(mlens_shard_stream_bytes(&p, 0, 2, 3), expert);
	/* EP over 3 (24 heads and 3 kv heads, so that 3 GPUs can share the
	 * attention): 3, 3, 2 experts; the busiest streams 3 */
	c.num_attention_heads = 24;
	c.num_key_value_heads = 3;
	c.head_dim = 128;
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 3, MLENS_SHARD_EP, NULL, 0), 0);
	ck_assert_uint_eq(mlens_shard_stream_bytes(&p, 0, 2, 0), 3 * expert);
	ck_assert_uint_eq(mlens_shard_stream_bytes(&p, 2, 2, 0), 2 * expert);
}
END_TEST

START_TEST(collectives_mixtral)
{
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_shard_plan p;
	struct mlens_shard_coll co;
	double X = 1000.0 * 4096 * 2, row = 4096.0 * 2;

	/* P_hit by hand: 1 - C(4,2)/C(8,2) = 1 - 6/28; 1 - C(6,2)/C(8,2) = 1 - 15/28 */
	assert_rel(mlens_shard_p_hit(8, 2, 4), 22.0 / 28, 1e-15);
	assert_rel(mlens_shard_p_hit(8, 2, 2), 13.0 / 28, 1e-15);
	ck_assert(mlens_shard_p_hit(8, 2, 0) == 0);
	ck_assert(mlens_shard_p_hit(8, 2, 7) == 1);

	ck_assert_int_eq(mlens_shard_plan(&p, &c, 1, MLENS_SHARD_TP, NULL, 0), 0);
	mlens_shard_layer_coll(&p, 1000, 2, &co);
	ck_assert(co.total == 0 && co.steps == 0);
	/* TP over 2: two all-reduces of 2 (G-1)/G X each = 2X */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 2, MLENS_SHARD_TP, NULL, 0), 0);
	mlens_shard_layer_coll(&p, 1000, 2, &co);
	assert_rel(co.all_reduce, 2 * X, 1e-15);
	assert_rel(co.total, 2 * X, 1e-15);
	ck_assert_int_eq(co.steps, 4);
	/* TP over 4: 4 x 3/4 X */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 4, MLENS_SHARD_TP, NULL, 0), 0);
	mlens_shard_layer_coll(&p, 1000, 2, &co);
	assert_rel(co.total, 3 * X, 1e-15);
	/* EP over 2: RS + AG = X, dispatch = combine = 500 rows x 22/28 */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 2, MLENS_SHARD_EP, NULL, 0), 0);
	mlens_shard_layer_coll(&p, 1000, 2, &co);
	assert_rel(co.reduce_scatter + co.all_gather, X, 1e-15);
	assert_rel(co.dispatch, 500 * row * 22 / 28, 1e-12);
	assert_rel(co.combine, 500 * row * 22 / 28, 1e-12);
	assert_rel(co.total, X + 1000 * row * 22 / 28, 1e-12);
	ck_assert(co.total < 2 * X);	/* less than TP's two all-reduces */
	/* EP over 4: 1.5X + 2 x 250 rows x 3 peers x 13/28 */
	ck_assert_int_eq(mlens_shard_plan(&p, &c, 4, MLENS_SHARD_EP, NULL, 0), 0);
	mlens_shard_layer_coll(&p, 1000, 2, &co);
	assert_rel(co.total, 1.5 * X + 2 * 250 * row * 3 * 13 / 28, 1e-12);
	ck_assert_int_eq(co.steps, 12);
}
END_TEST

/* ==== the performance model over several GPUs ==== */

#define GIB (1024.0 * 1024.0 * 1024.0)

/* The A40-like GPU and host of testmodel.h (one GPU, its own PCIe 4.0
 * x16 link at 25 GB/s) for the 32-layer 8x7B, budget per GPU. */
static struct mlens_perf_hw a40(double budget_gib)
{
	struct mlens_perf_model pm = mlens_test_mixtral_pm(32);
	return mlens_test_a40_hw(&pm, budget_gib);
}

/* GPUs talk over PCIe 4.0 peer-to-peer: 25 GB/s, 10 us a step */
static struct mlens_perf_multi pcie_peers(int gpus)
{
	struct mlens_perf_multi mp = { gpus, MLENS_SHARD_TP, 25e9, 10e-6, 2, 1.0, false };
	return mp;
}

/* whole experts per layer resident in the box */
static int box_resident(const struct mlens_perf_prediction *p, int scheme, int gpus)
{
	return scheme == MLENS_SHARD_TP ? p->policy.resident_experts : p->policy.resident_experts * gpus;
}

START_TEST(multi_one_gpu_is_single)
{
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_perf_model pm;
	struct mlens_perf_hw hw = a40(24);
	struct mlens_perf_workload w = { 98, 32, 3e4, 0 };
	struct mlens_perf_prediction one, multi;
	char err[512] = "";
	ck_assert_int_eq(mlens_perf_model_from_config(&pm, &c, MLENS_DTYPE_BF16), 0);
	ck_assert_msg(mlens_perf_choose(&pm, &hw, &w, &one, err, sizeof(err)) == 0, "%s", err);
	for (int s = MLENS_SHARD_TP; s <= MLENS_SHARD_EP; s++) {
		struct mlens_perf_multi mp = pcie_peers(1);
		mp.scheme = s;
		ck_assert_msg(mlens_perf_multi_choose(&c, MLENS_DTYPE_BF16, &hw, &w, &mp, &multi, err,
						      sizeof(err)) == 0, "%s", err);
		ck_assert_int_eq(multi.policy.resident_experts, one.policy.resident_experts);
		assert_rel(multi.total_tok_s, one.total_tok_s, 1e-12);
		assert_rel(multi.tokens, one.tokens, 1e-12);
	}
}
END_TEST

START_TEST(multi_shard_by_hand)
{
	/* TP over 2: half the heads, kv heads, intermediate rows, vocab;
	 * router whole; lines: the shard's roofline + 2 all-reduces */
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_perf_model full, sh;
	struct mlens_perf_hw hw = a40(24), shw;
	struct mlens_perf_multi mp = pcie_peers(2);
	double H = 4096, I = 14336, C = 149.7e12, hbm = 696e9;
	char err[256] = "";
	ck_assert_int_eq(mlens_perf_model_from_config(&full, &c, MLENS_DTYPE_BF16), 0);
	ck_assert_msg(mlens_perf_multi_setup(&c, MLENS_DTYPE_BF16, &hw, &mp, &sh, &shw, err, sizeof(err)) == 0,
		      "%s", err);
	ck_assert_uint_eq(sh.expert_bytes, full.expert_bytes / 2);
	ck_assert_int_eq(sh.experts, 8);
	ck_assert_uint_eq(sh.attn_bytes, full.attn_bytes / 2);
	ck_assert_uint_eq(sh.router_bytes, full.router_bytes);
	ck_assert_uint_eq(sh.kv_token_bytes, full.kv_token_bytes / 2);
	ck_assert_uint_eq(sh.embed_bytes, full.embed_bytes / 2);
	assert_rel(sh.flops_gb, 2 * 2048 * H + 2 * H * 8 + 2 * 6 * H * (I / 2), 1e-15);
	assert_rel(sh.flops_experts, 2 * 6 * H * (I / 2), 1e-15);
	assert_rel(shw.b_mem, 100e9, 1e-15);
	assert_rel(shw.b_attn, 50e9, 1e-15);
	assert_rel(shw.ga.b, hw.ga.b / 2, 1e-12);
	assert_rel(shw.ga.a, hw.ga.a / 2, 1e-12);
	/* GB: O columns, router, 8 expert halves read; 2 x 2 (G-1)/G x H x 2
	 * bytes per token over 25 GB/s; 4 ring steps of 10 us */
	assert_rel(shw.gb.a, (H * 2048 * 2 + 8 * H * 2 + 8 * 3 * H * (I / 2) * 2) / hbm + 4 * 10e-6, 1e-12);
	assert_rel(shw.gb.b, sh.flops_gb / C + 2 * H * 2 / 25e9, 1e-12);
	ck_assert(shw.h2d_per_token == 0);
	/* without NVLink the same bytes also cross each GPU's PCIe link */
	mp.coll_on_pcie = true;
	ck_assert_int_eq(mlens_perf_multi_setup(&c, MLENS_DTYPE_BF16, &hw, &mp, &sh, &shw, err, sizeof(err)), 0);
	assert_rel(shw.h2d_per_token, 2 * H * 2, 1e-15);

	/* EP over 2: four whole experts, a quarter of the routed rows more
	 * on the busiest GPU when routing is 1.25 x skewed */
	mp = pcie_peers(2);
	mp.scheme = MLENS_SHARD_EP;
	mp.ep_imbalance = 1.25;
	ck_assert_int_eq(mlens_perf_multi_setup(&c, MLENS_DTYPE_BF16, &hw, &mp, &sh, &shw, err, sizeof(err)), 0);
	ck_assert_int_eq(sh.experts, 4);
	ck_assert_uint_eq(sh.expert_bytes, full.expert_bytes);
	assert_rel(sh.flops_gb, 2 * 2048 * H + 2 * H * 8 + 2 * 0.5 * 1.25 * 6 * H * I, 1e-15);
	assert_rel(sh.flops_experts, 2 * 0.5 * 1.25 * 6 * H * I, 1e-15);
	/* refusals name the key and the reason */
	mp = pcie_peers(3);
	ck_assert_int_eq(mlens_perf_multi_setup(&c, MLENS_DTYPE_BF16, &hw, &mp, &sh, &shw, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "attention heads"));
	mp = pcie_peers(2);
	mp.b_coll = 0;
	ck_assert_int_eq(mlens_perf_multi_setup(&c, MLENS_DTYPE_BF16, &hw, &mp, &sh, &shw, err, sizeof(err)), -EINVAL);
	mp = pcie_peers(2);
	mp.ep_imbalance = 0.5;
	ck_assert_int_eq(mlens_perf_multi_setup(&c, MLENS_DTYPE_BF16, &hw, &mp, &sh, &shw, err, sizeof(err)), -EINVAL);
}
END_TEST

/* Throughput at 1, 2, 4 GPUs of budget_gib each, best scheme; ratios to 1. */
static void scaling(double budget_gib, double kv_tokens, double *ratio, int *resident)
{
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_perf_hw hw = a40(budget_gib);
	struct mlens_perf_workload w = { 98, 32, kv_tokens, 0 };
	double base = 0;
	for (int i = 0, G = 1; G <= 4; G *= 2, i++) {
		struct mlens_perf_multi mp = pcie_peers(G);
		struct mlens_perf_prediction pr;
		char err[512] = "";
		int scheme = -1;
		ck_assert_msg(mlens_perf_multi_best(&c, MLENS_DTYPE_BF16, &hw, &w, &mp, &pr, &scheme, err,
						    sizeof(err)) == 0, "%s", err);
		ck_assert_uint_le(pr.gpu_total, hw.gpu_budget);
		if (G == 1)
			base = pr.total_tok_s;
		ratio[i] = pr.total_tok_s / base;
		resident[i] = box_resident(&pr, scheme, G);
		fprintf(stderr, "mixtral-8x7b %.0f GiB/GPU, KV %.0f tokens, %d GPU %s: %d experts/layer "
			"resident, %.0f tokens/step (%s), bound by %s, %.0f tok/s, x%.2f\n",
			budget_gib, kv_tokens, G, mlens_shard_scheme_name(scheme), resident[i], pr.tokens,
			mlens_perf_limit_name(pr.limit), mlens_perf_bind_name(pr.time.bind),
			pr.total_tok_s, ratio[i]);
	}
}

START_TEST(multi_superlinear)
{
	/* 24 GiB per GPU, KV for 30000 tokens: the step (PME x M = 1069
	 * tokens) is far below n_real and PCIe-bound on one GPU, which keeps 1
	 * expert of 8 resident. Two GPUs keep 3 (each a half of them), four
	 * keep all 8: each link streams less than 1/G of what one did, so
	 * throughput grows faster than G. */
	double ratio[3];
	int res[3];
	scaling(24, 3e4, ratio, res);
	ck_assert_int_eq(res[0], 1);
	ck_assert_int_gt(res[1], 2 * res[0]);
	ck_assert_int_eq(res[2], 8);
	ck_assert_msg(ratio[1] > 2, "2 GPUs x%.2f", ratio[1]);
	ck_assert_msg(ratio[2] > 4, "4 GPUs x%.2f", ratio[2]);
}
END_TEST

START_TEST(multi_not_superlinear)
{
	/* 139 GiB per GPU holds the whole model on one GPU: nothing is
	 * streamed, the GPU binds, and more GPUs only split the compute and
	 * add collectives: between 1 and G */
	double ratio[3];
	int res[3];
	scaling(139, 1e6, ratio, res);
	ck_assert_int_eq(res[0], 8);
	ck_assert_msg(ratio[1] > 1 && ratio[1] < 2, "2 GPUs x%.2f", ratio[1]);
	ck_assert_msg(ratio[2] > ratio[1] && ratio[2] < 4, "4 GPUs x%.2f", ratio[2]);
	/* 24 GiB with KV for a million tokens: one GPU already runs at n_real
	 * (PCIe time = GPU time); the split halves both, and the all-reduces
	 * over PCIe peers cost more than the extra residency gains */
	scaling(24, 1e6, ratio, res);
	ck_assert_msg(ratio[1] > 1 && ratio[1] < 2, "2 GPUs x%.2f", ratio[1]);
	ck_assert_msg(ratio[2] > ratio[1] && ratio[2] < 4, "4 GPUs x%.2f", ratio[2]);
}
END_TEST

START_TEST(multi_tp_or_ep)
{
	/* whole model resident on 4 GPUs, GPU-bound: EP sends 1.5 X + the
	 * all-to-alls (17993 bytes a token) against TP's 3 X (24576): EP wins
	 * with even routing; with the busiest GPU getting 1.5 x its share of
	 * the routed rows, TP's balance wins */
	struct mlens_model_config c = mlens_test_mixtral_config(32);
	struct mlens_perf_hw hw = a40(139);
	struct mlens_perf_workload w = { 98, 32, 1e6, 0 };
	struct mlens_perf_multi mp = pcie_peers(4);
	struct mlens_perf_prediction best, tp, ep;
	char err[512] = "";
	int scheme = -1;
	ck_assert_int_eq(mlens_perf_multi_best(&c, MLENS_DTYPE_BF16, &hw, &w, &mp, &best, &scheme, err, sizeof(err)), 0);
	ck_assert_int_eq(scheme, MLENS_SHARD_EP);
	mp.scheme = MLENS_SHARD_TP;
	ck_assert_int_eq(mlens_perf_multi_choose(&c, MLENS_DTYPE_BF16, &hw, &w, &mp, &tp, err, sizeof(err)), 0);
	mp.scheme = MLENS_SHARD_EP;
	ck_assert_int_eq(mlens_perf_multi_choose(&c, MLENS_DTYPE_BF16, &hw, &w, &mp, &ep, err, sizeof(err)), 0);
	ck_assert(ep.total_tok_s > tp.total_tok_s);
	assert_rel(best.total_tok_s, ep.total_tok_s, 1e-15);
	mp.ep_imbalance = 1.5;
	ck_assert_int_eq(mlens_perf_multi_best(&c, MLENS_DTYPE_BF16, &hw, &w, &mp, &best, &scheme, err, sizeof(err)), 0);
	ck_assert_int_eq(scheme, MLENS_SHARD_TP);
	assert_rel(best.total_tok_s, tp.total_tok_s, 1e-15);
	/* collectives without NVLink also load the links: slower */
	mp.ep_imbalance = 1;
	mp.coll_on_pcie = true;
	mp.scheme = MLENS_SHARD_TP;
	ck_assert_int_eq(mlens_perf_multi_choose(&c, MLENS_DTYPE_BF16, &hw, &w, &mp, &best, err, sizeof(err)), 0);
	ck_assert(best.total_tok_s <= tp.total_tok_s);
	/* 16 GPUs: EP is refused (8 experts), TP runs (kv heads replicated) */
	mp = pcie_peers(16);
	ck_assert_int_eq(mlens_perf_multi_best(&c, MLENS_DTYPE_BF16, &hw, &w, &mp, &best, &scheme, err, sizeof(err)), 0);
	ck_assert_int_eq(scheme, MLENS_SHARD_TP);
	/* 3 GPUs: both refused, with the plan's reason */
	mp = pcie_peers(3);
	ck_assert_int_eq(mlens_perf_multi_best(&c, MLENS_DTYPE_BF16, &hw, &w, &mp, &best, &scheme, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "attention heads"));
}
END_TEST

/* ==== the fake-collective path against the engine ==== */

struct run_case {
	int heads, kv_heads, experts, inter, gpus;
	enum mlens_shard_scheme scheme;
};

static void run_one(const struct run_case *rc)
{
	struct mlens_test_spec sp = mlens_test_spec_tiny();
	struct mlens_model *m;
	struct mlens_backend be;
	struct mlens_engine *eng;
	struct mlens_shard_sim *sim;
	struct mlens_shard_plan plan;
	struct mlens_engine_opts eo = { 0 };
	struct mlens_seq es[2] = { { 0 } }, ss[2] = { { 0 } };
	int32_t p0[5] = { 3, 14, 15, 92, 65 }, p1[3] = { 35, 89, 79 };
	int64_t rows[MLENS_SHARD_MAX_GPUS] = { 0 }, total_rows = 0, want_rows = 0;
	float *le, *ls;
	char err[256] = "";
	double worst = 0;
	int32_t next[2] = { 0, 0 };

	sp.heads = rc->heads;
	sp.kv_heads = rc->kv_heads;
	sp.experts = rc->experts;
	sp.inter = rc->inter;
	sp.seed = 7 + (unsigned long long)rc->heads * 131 + (unsigned long long)rc->experts;
	m = mlens_test_model_new(&sp);
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	eo.kv_dtype = -1;
	eo.kv_blocks = 64;
	ck_assert_msg(mlens_engine_create(&eng, m, &be, &eo, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(mlens_shard_plan(&plan, &m->cfg, rc->gpus, rc->scheme, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(mlens_shard_sim_create(&sim, m, &be, &plan, 64, 16, err, sizeof(err)) == 0, "%s", err);
	le = calloc(2 * (size_t)sp.vocab, sizeof(float));
	ls = calloc(2 * (size_t)sp.vocab, sizeof(float));

	for (int step = 0; step < 4; step++) {
		struct mlens_engine_req re[2], rs[2];
		memset(re, 0, sizeof(re));
		for (int i = 0; i < 2; i++) {
			re[i].seq = &es[i];
			re[i].logits = le + (size_t)i * sp.vocab;
			re[i].samp.temperature = 0;
		}
		if (step == 0) {
			re[0].tokens = p0;
			re[0].n_tokens = 5;
			re[1].tokens = p1;
			re[1].n_tokens = 3;
		} else {
			re[0].tokens = &next[0];
			re[1].tokens = &next[1];
			re[0].n_tokens = re[1].n_tokens = 1;
		}
		memcpy(rs, re, sizeof(rs));
		for (int i = 0; i < 2; i++) {
			rs[i].seq = &ss[i];
			rs[i].logits = ls + (size_t)i * sp.vocab;
			want_rows += (int64_t)re[i].n_tokens * sp.top_k * sp.layers;
		}
		ck_assert_int_eq(mlens_engine_step(eng, re, 2), 0);
		ck_assert_int_eq(mlens_shard_sim_step(sim, rs, 2, rows), 0);
		for (int i = 0; i < 2; i++) {
			const float *a = le + (size_t)i * sp.vocab, *b = ls + (size_t)i * sp.vocab;
			double mx = 0, d = 0;
			for (int v = 0; v < sp.vocab; v++) {
				mx = fmax(mx, fabs(a[v]));
				d = fmax(d, fabs((double)a[v] - b[v]));
			}
			ck_assert_msg(d <= SHARD_TOL * mx,
				      "G=%d %s heads %d/%d experts %d step %d seq %d: |diff| %.3g, max %.3g",
				      rc->gpus, mlens_shard_scheme_name(rc->scheme), rc->heads, rc->kv_heads,
				      rc->experts, step, i, d, mx);
			worst = fmax(worst, d / mx);
			ck_assert_int_eq(rs[i].next_token, re[i].next_token);
			ck_assert_int_eq(ss[i].len, es[i].len);
			next[i] = re[i].next_token;
		}
	}
	/* EP: every (token, expert) choice was computed exactly once, by its owner */
	if (rc->scheme == MLENS_SHARD_EP) {
		for (int r = 0; r < rc->gpus; r++) {
			ck_assert_msg(rows[r] > 0, "rank %d computed nothing", r);
			total_rows += rows[r];
		}
		ck_assert_int_eq(total_rows, want_rows);
	}
	fprintf(stderr, "shard G=%d %-15s heads %d kv %d experts %d inter %d: max rel diff %.2e\n",
		rc->gpus, mlens_shard_scheme_name(rc->scheme), rc->heads, rc->kv_heads, rc->experts,
		rc->inter, worst);
	free(le);
	free(ls);
	for (int i = 0; i < 2; i++) {
		mlens_seq_fini(mlens_engine_kv(eng), &es[i]);
		mlens_seq_fini(mlens_shard_sim_kv(sim), &ss[i]);
	}
	mlens_shard_sim_destroy(sim);
	mlens_engine_destroy(eng);
	mlens_backend_destroy(&be);
	mlens_test_model_free(m);
}

/* GQA ratio 1 (4 heads, 4 kv) and 4 (8 heads, 2 kv: kv heads replicated
 * on G = 4); 4 experts and 6 over 4 GPUs (2, 2, 1, 1), intermediate 48
 * and 50 (uneven column split). */
static const struct run_case cases[] = {
	{ 4, 4, 4, 48, 1, MLENS_SHARD_TP }, { 4, 4, 4, 48, 2, MLENS_SHARD_TP },
	{ 4, 4, 4, 48, 4, MLENS_SHARD_TP }, { 8, 2, 4, 48, 2, MLENS_SHARD_TP },
	{ 8, 2, 4, 48, 4, MLENS_SHARD_TP }, { 8, 2, 6, 50, 4, MLENS_SHARD_TP },
	{ 4, 4, 4, 48, 1, MLENS_SHARD_EP }, { 4, 4, 4, 48, 2, MLENS_SHARD_EP },
	{ 4, 4, 4, 48, 4, MLENS_SHARD_EP }, { 8, 2, 4, 48, 2, MLENS_SHARD_EP },
	{ 8, 2, 4, 48, 4, MLENS_SHARD_EP }, { 8, 2, 6, 50, 4, MLENS_SHARD_EP },
	{ 4, 4, 6, 50, 4, MLENS_SHARD_EP },
};

START_TEST(sharded_equals_engine)
{
	run_one(&cases[_i]);
}
END_TEST

START_TEST(sim_refuses_other_plan)
{
	struct mlens_test_spec sp = mlens_test_spec_tiny();
	struct mlens_model *m = mlens_test_model_new(&sp), *m2;
	struct mlens_backend be;
	struct mlens_shard_plan plan;
	struct mlens_shard_sim *sim = NULL;
	char err[256] = "";
	sp.experts = 6;
	m2 = mlens_test_model_new(&sp);
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_int_eq(mlens_shard_plan(&plan, &m2->cfg, 2, MLENS_SHARD_EP, NULL, 0), 0);
	ck_assert_int_eq(mlens_shard_sim_create(&sim, m, &be, &plan, 16, 16, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "another model"));
	/* bad requests change nothing; a step past the KV room is refused */
	ck_assert_int_eq(mlens_shard_plan(&plan, &m->cfg, 2, MLENS_SHARD_TP, NULL, 0), 0);
	ck_assert_int_eq(mlens_shard_sim_create(&sim, m, &be, &plan, 1, 4, err, sizeof(err)), 0);
	{
		struct mlens_seq seq = { 0 };
		int32_t toks[5] = { 1, 2, 3, 4, 97 };
		struct mlens_engine_req r = { .seq = &seq, .tokens = toks, .n_tokens = 5 };
		ck_assert_int_eq(mlens_shard_sim_step(sim, &r, 1, NULL), -EINVAL);	/* token 97 of 97 */
		ck_assert_int_eq(mlens_shard_sim_step(sim, &r, 0, NULL), -EINVAL);
		toks[4] = 5;
		ck_assert_int_eq(mlens_shard_sim_step(sim, &r, 1, NULL), -ENOSPC);	/* 5 tokens, 1 block of 4 */
		ck_assert_int_eq(seq.len, 0);
		r.n_tokens = 4;
		ck_assert_int_eq(mlens_shard_sim_step(sim, &r, 1, NULL), 0);
		ck_assert_int_eq(seq.len, 4);
		mlens_seq_fini(mlens_shard_sim_kv(sim), &seq);
	}
	mlens_shard_sim_destroy(sim);
	mlens_backend_destroy(&be);
	mlens_test_model_free(m);
	mlens_test_model_free(m2);
}
END_TEST

/* ==== the gpus key ==== */

START_TEST(config_gpus)
{
	struct mlens_config c;
	int ids[4];
	char why[256] = "", err[512] = "";

	ck_assert_int_eq(mlens_parse_gpus("0", ids, 4, why, sizeof(why)), 1);
	ck_assert_int_eq(ids[0], 0);
	ck_assert_int_eq(mlens_parse_gpus(" 3 , 1,2 ", ids, 4, why, sizeof(why)), 3);
	ck_assert(ids[0] == 3 && ids[1] == 1 && ids[2] == 2);
	ck_assert_int_eq(mlens_parse_gpus("0,1,0", ids, 4, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "GPU 0 is listed twice"));
	ck_assert_int_eq(mlens_parse_gpus("0,a", ids, 4, why, sizeof(why)), -EINVAL);
	ck_assert_int_eq(mlens_parse_gpus("", ids, 4, why, sizeof(why)), -EINVAL);
	ck_assert_int_eq(mlens_parse_gpus("0,", ids, 4, why, sizeof(why)), -EINVAL);
	ck_assert_int_eq(mlens_parse_gpus("-1", ids, 4, why, sizeof(why)), -EINVAL);
	ck_assert_int_eq(mlens_parse_gpus("1.5", ids, 4, why, sizeof(why)), -EINVAL);
	ck_assert_int_eq(mlens_parse_gpus("4096", ids, 4, why, sizeof(why)), -ERANGE);
	ck_assert_int_eq(mlens_parse_gpus("0,1,2,3,4", ids, 4, why, sizeof(why)), -ERANGE);

	/* default one GPU, 0; the file's value parsed; errors name the key */
	mlens_config_defaults(&c);
	ck_assert_int_eq(c.n_gpus, 1);
	ck_assert_int_eq(c.gpu_ids[0], 0);
	ck_assert_str_eq(c.gpus, "0");
	ck_assert_int_eq(mlens_config_load_text(&c, "gpus = 2,0\n", "t.conf", err, sizeof(err)), 0);
	ck_assert_int_eq(c.n_gpus, 2);
	ck_assert(c.gpu_ids[0] == 2 && c.gpu_ids[1] == 0);
	ck_assert_int_eq(mlens_config_load_text(&c, "gpus = 1,1\n", "t.conf", err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "t.conf:1: key 'gpus'"));
	ck_assert_ptr_nonnull(strstr(err, "listed twice"));
	/* a refused value leaves the last good one */
	ck_assert_int_eq(c.n_gpus, 2);
	ck_assert_int_eq(mlens_config_load_text(&c, "gpus = one\n", "t.conf", err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "key 'gpus'"));
	ck_assert_ptr_nonnull(strstr(err, "not a list of GPU numbers"));
	mlens_config_free(&c);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("shard");
	TCase *tc = tcase_create("core");
	SRunner *sr;
	int failed;
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, split_balanced);
	tcase_add_test(tc, plan_mixtral);
	tcase_add_test(tc, plan_refusals);
	tcase_add_test(tc, uneven_experts);
	tcase_add_test(tc, bytes_mixtral);
	tcase_add_test(tc, collectives_mixtral);
	tcase_add_loop_test(tc, sharded_equals_engine, 0, (int)(sizeof(cases) / sizeof(cases[0])));
	tcase_add_test(tc, sim_refuses_other_plan);
	tcase_add_test(tc, multi_one_gpu_is_single);
	tcase_add_test(tc, multi_shard_by_hand);
	tcase_add_test(tc, multi_superlinear);
	tcase_add_test(tc, multi_not_superlinear);
	tcase_add_test(tc, multi_tp_or_ep);
	tcase_add_test(tc, config_gpus);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
