/* Description: GPU-only mode's memory plan (daemon/plan/gpu_plan.c): the parts
 * add up to what the engine and the CUDA backend allocate for a
 * Mixtral-8x7B-shaped model, a budget of 0 means free memory minus the
 * margin, and a KV pool or a gpu_memory too large is refused with the
 * numbers in the message. Pure arithmetic: runs without a GPU. */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/plan/gpu_plan.h"
#include "tests/check_common.h"
#include "tests/testmodel.h"

START_TEST(plan_parts)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p;
	/* 23.7 GB of weights, 40 GiB of KV, the default 4096-token step */
	mlens_gpu_plan_compute(&p, &c, 23700000000ull, 40 * GIB, 4096, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_eq(p.weights, 23700000000ull);
	ck_assert_uint_eq(p.kv, 40 * GIB);
	/* x, xn [T][4096]; q, att [T][4096]; k, v [T][1024]; router [T][8];
	 * ids, weights [T][2]; logits [T][32000], all fp32 */
	ck_assert_uint_eq(p.activations, 4096ull * (8192 + 8192 + 2048 + 8 + 4) * 4 + 4096ull * 32000 * 4);
	/* MoE scratch for 8192 routed rows is 0.30 GiB (gathered x 64 MiB,
	 * gate and up in bf16 for 2048 rows of pieces 56 MiB each, silu(g)u
	 * over gate, out 128 MiB) and rounds up to the next power of two, as
	 * the backend's scratch does. Decode partials for 4096 queries over
	 * 32768 keys would be 8.1 GiB at once; they go through in launches of
	 * 256 MiB, below the MoE's need */
	ck_assert_uint_ge(p.workspace, GIB / 2);
	ck_assert_uint_lt(p.workspace, GIB / 2 + (64ull << 20));
	ck_assert_uint_eq(p.need, p.weights + p.kv + p.activations + p.workspace);
	ck_assert_uint_eq(p.budget, 139 * GIB - MLENS_GPU_SAFETY_MARGIN);
	ck_assert(!p.budget_given);
	ck_assert(p.fits);
	ck_assert_ptr_nonnull(strstr(p.summary, "KV 40.0 GiB"));
	ck_assert_ptr_nonnull(strstr(p.summary, " fit the "));
}
END_TEST

START_TEST(plan_small_context_small_scratch)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p;
	/* a KV pool of 1024 tokens bounds the contexts: partials are small and
	 * the MoE scratch (0.30 GiB -> 0.5 GiB) is the largest need */
	mlens_gpu_plan_compute(&p, &c, 1000, 1024ull * 2 * 8 * 1024 * 2, 4096, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_ge(p.workspace, GIB / 2);
	ck_assert_uint_lt(p.workspace, GIB / 2 + (64ull << 20));
}
END_TEST

START_TEST(plan_exact_gemm)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p, f;
	/* 3072-token steps: 6144 routed rows take 0.25 GiB of MoE scratch (512
	 * MiB rounded); exact GEMMs keep gate and up in fp32 and three bf16
	 * parts of the inputs and of silu(g)*u (2048 rows of pieces), 0.62 GiB
	 * (1 GiB rounded) */
	mlens_gpu_plan_compute(&p, &c, 1000, 1 * GIB, 3072, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_ge(p.workspace, GIB / 2);
	ck_assert_uint_lt(p.workspace, GIB / 2 + (64ull << 20));
	mlens_gpu_plan_compute(&p, &c, 1000, 1 * GIB, 3072, MLENS_GEMM_EXACT, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_ge(p.workspace, 1 * GIB);
	ck_assert_uint_lt(p.workspace, 1 * GIB + (64ull << 20));
	/* fp32 weights have nothing to split */
	c.dtype = MLENS_DTYPE_F32;
	mlens_gpu_plan_compute(&p, &c, 1000, 1 * GIB, 3072, MLENS_GEMM_EXACT, 0, 139 * GIB, 140 * GIB);
	mlens_gpu_plan_compute(&f, &c, 1000, 1 * GIB, 3072, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_eq(p.workspace, f.workspace);
}
END_TEST

/* One query at a context whose partials alone exceed a launch's area: the
 * plan holds that query's partials. */
START_TEST(plan_one_long_query)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p;
	c.max_position_embeddings = 1 << 22;
	c.num_local_experts = 1;
	c.intermediate_size = 64;
	/* 4 Mi keys: 16384 splits x 32 heads x 130 floats = 260 MiB > 256 MiB */
	mlens_gpu_plan_compute(&p, &c, 1000, 200 * GIB, 16, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert_uint_ge(p.workspace, 512ull << 20);
	ck_assert_uint_lt(p.workspace, (512ull + 64) << 20);
}
END_TEST

START_TEST(plan_refuses)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_gpu_plan p;
	mlens_gpu_plan_compute(&p, &c, 23700000000ull, 120 * GIB, 4096, MLENS_GEMM_FAST, 0, 139 * GIB, 140 * GIB);
	ck_assert(!p.fits);
	ck_assert_ptr_nonnull(strstr(p.summary, "exceed"));
	/* a budget of its own: honoured below free memory, refused above it */
	mlens_gpu_plan_compute(&p, &c, 23700000000ull, 40 * GIB, 4096, MLENS_GEMM_FAST, 60 * GIB, 139 * GIB, 140 * GIB);
	ck_assert(p.budget_given);
	ck_assert_uint_eq(p.budget, 60 * GIB);
	ck_assert(!p.fits);
	mlens_gpu_plan_compute(&p, &c, 23700000000ull, 40 * GIB, 4096, MLENS_GEMM_FAST, 200 * GIB, 139 * GIB, 140 * GIB);
	ck_assert(!p.fits);
	ck_assert_ptr_nonnull(strstr(p.summary, "more than the device has free"));
	/* free memory under the margin leaves no budget at all */
	mlens_gpu_plan_compute(&p, &c, 1, 1, 1, MLENS_GEMM_FAST, 0, MLENS_GPU_SAFETY_MARGIN / 2, 140 * GIB);
	ck_assert_uint_eq(p.budget, 0);
	ck_assert(!p.fits);
}
END_TEST

START_TEST(plan_cpu_backend)
{
	struct mlens_model_config c = mlens_test_mixtral_config(8);
	struct mlens_backend be;
	struct mlens_gpu_plan p;
	ck_assert_int_eq(mlens_backend_cpu_create(&be, NULL), 0);
	ck_assert_int_eq(mlens_gpu_plan_for(&p, &be, &c, 1, 1, 16, MLENS_GEMM_FAST, 0), -ENOTSUP);
	mlens_backend_destroy(&be);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("gpu_plan");
	TCase *tc = tcase_create("plan");
	tcase_add_test(tc, plan_parts);
	tcase_add_test(tc, plan_small_context_small_scratch);
	tcase_add_test(tc, plan_exact_gemm);
	tcase_add_test(tc, plan_one_long_query);
	tcase_add_test(tc, plan_refuses);
	tcase_add_test(tc, plan_cpu_backend);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
