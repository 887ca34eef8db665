/* Description: the host memory plan (daemon/plan/host_plan.c): weight
 * pages and staging first, the KV pool the rest up to kv_cache; a budget
 * below weights + staging + the least KV pool refused with the budget to
 * ask for; no budget takes kv_cache as is; staging per mode; the least KV
 * pool in whole blocks of the longest prompt taken. */
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include "daemon/plan/host_plan.h"
#include "tests/check_common.h"

#define MIB (1024ull * 1024ull)

START_TEST(split_rest_to_kv)
{
	struct mlens_host_plan_in in = { .budget = 100 * MIB, .weight_bytes = 40 * MIB, .kv_want = 1 * GIB,
					 .kv_min = 10 * MIB, .staging = 20 * MIB };
	struct mlens_host_plan p;
	char err[512] = "", line[512];

	ck_assert_int_eq(mlens_host_plan_split(&p, &in, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.kv, 40 * MIB);	/* 100 - 40 - 20 */
	ck_assert_uint_eq(p.need, 70 * MIB);
	mlens_host_plan_format(&p, line, sizeof(line));
	ck_assert_msg(strstr(line, "budget 100.0 MiB") && strstr(line, "weight pages 40.0 MiB (40%)") &&
			      strstr(line, "KV pool 40.0 MiB (40%)") && strstr(line, "staging 20.0 MiB (20%)"),
		      "%s", line);
	/* kv_cache caps the pool; the rest is said to be unused */
	in.kv_want = 16 * MIB;
	ck_assert_int_eq(mlens_host_plan_split(&p, &in, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.kv, 16 * MIB);
	mlens_host_plan_format(&p, line, sizeof(line));
	ck_assert_msg(strstr(line, "the rest unused"), "%s", line);
	/* exactly the need runs */
	in.kv_want = 1 * GIB;
	in.budget = 70 * MIB;
	ck_assert_int_eq(mlens_host_plan_split(&p, &in, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.kv, 10 * MIB);
}
END_TEST

START_TEST(refusals)
{
	struct mlens_host_plan_in in = { .budget = 70 * MIB - 1, .weight_bytes = 40 * MIB, .kv_want = 1 * GIB,
					 .kv_min = 10 * MIB, .staging = 20 * MIB };
	struct mlens_host_plan p;
	char err[512] = "";

	ck_assert_int_eq(mlens_host_plan_split(&p, &in, err, sizeof(err)), -ENOSPC);
	ck_assert_msg(strstr(err, "host_memory of 70.0 MiB cannot run") && strstr(err, "need 70.0 MiB") &&
			      strstr(err, "raise host_memory"),
		      "%s", err);
	/* below the weight pages: no KV at all */
	in.budget = 30 * MIB;
	ck_assert_int_eq(mlens_host_plan_split(&p, &in, err, sizeof(err)), -ENOSPC);
	ck_assert_uint_eq(p.kv, 0);
	/* kv_cache itself below the least pool */
	in.budget = 1 * GIB;
	in.kv_want = 5 * MIB;
	ck_assert_int_eq(mlens_host_plan_split(&p, &in, err, sizeof(err)), -ENOSPC);
	ck_assert_msg(strstr(err, "kv_cache of 5.0 MiB is below the least KV pool"), "%s", err);
	/* no budget: kv_cache as is, nothing refused */
	in.budget = 0;
	ck_assert_int_eq(mlens_host_plan_split(&p, &in, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.kv, 5 * MIB);
	/* sums that would pass 64 bits saturate */
	in = (struct mlens_host_plan_in){ .budget = 1, .weight_bytes = UINT64_MAX, .staging = UINT64_MAX };
	ck_assert_int_eq(mlens_host_plan_split(&p, &in, err, sizeof(err)), -ENOSPC);
	ck_assert_uint_eq(p.need, UINT64_MAX);
}
END_TEST

START_TEST(staging_and_kv_min)
{
	struct mlens_model_config c = { .hidden_size = 64, .intermediate_size = 128, .num_attention_heads = 4,
					.num_key_value_heads = 2, .head_dim = 16, .num_experts_per_tok = 2,
					.max_position_embeddings = 1000 };
	/* q,k,v = (4 + 4) * 16 = 128, attention output 64 */
	ck_assert_uint_eq(mlens_host_plan_staging(&c, true, false, 4096, 100, 3), 3ull * 100 * (128 + 64) * 4);
	/* residual and norm 128, q k v 128, output 64, experts 3 * 2 * 128 */
	ck_assert_uint_eq(mlens_host_plan_staging(&c, false, true, 10, 0, 0), 10ull * (128 + 128 + 64 + 768) * 4);
	ck_assert_uint_eq(mlens_host_plan_staging(&c, false, false, 4096, 0, 0), 0);
	/* the step cap, at most the context, in whole blocks */
	ck_assert_uint_eq(mlens_host_plan_kv_min(&c, 100, 16, 1000), 7 * 1000);
	ck_assert_uint_eq(mlens_host_plan_kv_min(&c, 4096, 16, 1000), 63 * 1000);
	ck_assert_uint_eq(mlens_host_plan_kv_min(&c, 0, 16, 1000), 0);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("host_plan");
	TCase *tc = tcase_create("host_plan");
	tcase_add_test(tc, split_rest_to_kv);
	tcase_add_test(tc, refusals);
	tcase_add_test(tc, staging_and_kv_min);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
