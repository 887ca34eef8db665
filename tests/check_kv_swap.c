/* Description: the KV swap (daemon/exec/kv_swap.c): the cost model's
 * choice at its boundary; the slot allocator all or nothing, every slot
 * once; blocks written to a real swap file and read back into other pool
 * blocks byte for byte, through io_uring; a directory gets an unnamed
 * file, a new file path is unlinked at once, an existing file is refused;
 * the MLENS_TEST_SWAP_FAIL hook's write, read and enospc faults return
 * their error and give the slots back; the cost model's rates: the first
 * observation replaces the initial value, later ones an EWMA, each with
 * its source; the disk rate measured at open (or set by
 * MLENS_TEST_SWAP_RATE), then observed on swaps, the prefill's observed
 * from steps; a slow disk makes auto recompute, a fast one swap. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "daemon/exec/kv_swap.h"
#include "tests/check_common.h"

/* Moving b bytes out and in at 1 byte/s takes 2b s; recomputing n tokens
 * at 1 FLOP/s with f FLOPs a token takes n f s: swap exactly when 2b < n f. */
START_TEST(cost_boundary)
{
	struct mlens_kv_swap_rates r = { .disk_bps = 1, .compute_flops = 1, .flops_per_token = 10 };
	ck_assert(mlens_kv_swap_cheaper(&r, 49, 10));	/* 98 s < 100 s */
	ck_assert(!mlens_kv_swap_cheaper(&r, 50, 10));	/* 100 s, not cheaper */
	ck_assert(!mlens_kv_swap_cheaper(&r, 51, 10));
	/* the quadratic term: 10 tokens, 1 FLOP a token pair = 100 more */
	r.flops_per_token2 = 1;
	ck_assert(mlens_kv_swap_cheaper(&r, 99, 10));	/* 198 < 200 */
	ck_assert(!mlens_kv_swap_cheaper(&r, 100, 10));
	/* a faster disk tips it; a faster prefill tips it back */
	r = (struct mlens_kv_swap_rates){ .disk_bps = 2e9, .compute_flops = 5e10, .flops_per_token = 1e6 };
	ck_assert(mlens_kv_swap_cheaper(&r, 1000000, 1000));	/* 1 ms vs 20 ms */
	r.compute_flops = 1e14;
	ck_assert(!mlens_kv_swap_cheaper(&r, 1000000, 1000));	/* 1 ms vs 10 us */
	/* no disk rate: never; no compute rate: always; no tokens: never */
	r = (struct mlens_kv_swap_rates){ .disk_bps = 0, .compute_flops = 1, .flops_per_token = 1 };
	ck_assert(!mlens_kv_swap_cheaper(&r, 1, 1000));
	r = (struct mlens_kv_swap_rates){ .disk_bps = 1, .compute_flops = 0, .flops_per_token = 1 };
	ck_assert(mlens_kv_swap_cheaper(&r, 1000, 1));
	r = (struct mlens_kv_swap_rates){ .disk_bps = 1, .compute_flops = 1, .flops_per_token = 1 };
	ck_assert(!mlens_kv_swap_cheaper(&r, 1, 0));
}
END_TEST

/* The EWMA: not-finite or non-positive samples ignored; the first
 * observation replaces the initial value whatever its source; then each
 * moves the rate a quarter of the way. */
START_TEST(rate_ewma)
{
	struct mlens_kv_swap_rate r = { .value = 2e9, .source = MLENS_KV_SWAP_DEFAULT };
	ck_assert_str_eq(mlens_kv_swap_source_name(r.source), "default");
	mlens_kv_swap_rate_observe(&r, 0);
	mlens_kv_swap_rate_observe(&r, -5);
	mlens_kv_swap_rate_observe(&r, INFINITY);
	mlens_kv_swap_rate_observe(&r, NAN);
	ck_assert(r.value == 2e9 && r.source == MLENS_KV_SWAP_DEFAULT && r.n_observed == 0);
	mlens_kv_swap_rate_observe(&r, 100);
	ck_assert(r.value == 100);
	ck_assert_str_eq(mlens_kv_swap_source_name(r.source), "observed");
	ck_assert_uint_eq(r.n_observed, 1);
	mlens_kv_swap_rate_observe(&r, 200);	/* 100 + 0.25 * 100 */
	ck_assert_double_eq_tol(r.value, 125, 1e-9);
	mlens_kv_swap_rate_observe(&r, 25);	/* 125 - 0.25 * 100 */
	ck_assert_double_eq_tol(r.value, 100, 1e-9);
	ck_assert_uint_eq(r.n_observed, 3);
	/* a measured or profiled value is replaced as well */
	r = (struct mlens_kv_swap_rate){ .value = 1e12, .source = MLENS_KV_SWAP_PROFILED };
	ck_assert_str_eq(mlens_kv_swap_source_name(r.source), "profiled");
	mlens_kv_swap_rate_observe(&r, 3e9);
	ck_assert(r.value == 3e9 && r.source == MLENS_KV_SWAP_OBSERVED);
	ck_assert_str_eq(mlens_kv_swap_source_name(MLENS_KV_SWAP_MEASURED), "measured");
}
END_TEST

/* A chunk's FLOPs are the difference of two prompts': linear part by its
 * length, quadratic by b^2 - a^2; empty or reversed ranges are 0. */
START_TEST(prefill_flops)
{
	struct mlens_kv_swap_rates r = { .flops_per_token = 10, .flops_per_token2 = 1 };
	ck_assert_double_eq(mlens_kv_swap_prefill_flops(&r, 0, 10), 200);
	ck_assert_double_eq(mlens_kv_swap_prefill_flops(&r, 10, 20), 100 + 300);
	ck_assert_double_eq(mlens_kv_swap_prefill_flops(&r, 0, 10) + mlens_kv_swap_prefill_flops(&r, 10, 20),
			    mlens_kv_swap_prefill_flops(&r, 0, 20));
	ck_assert_double_eq(mlens_kv_swap_prefill_flops(&r, 5, 5), 0);
	ck_assert_double_eq(mlens_kv_swap_prefill_flops(&r, 7, 3), 0);
}
END_TEST

START_TEST(slots_all_or_nothing)
{
	struct mlens_kv_slots a;
	uint32_t x[8], y[8];
	bool seen[8] = { false };

	ck_assert_int_eq(mlens_kv_slots_init(&a, 0), -EINVAL);
	ck_assert_int_eq(mlens_kv_slots_init(&a, 8), 0);
	ck_assert_int_eq(mlens_kv_slots_take(&a, 5, x), 0);
	ck_assert_uint_eq(x[0], 0);	/* low ids first */
	ck_assert_int_eq(mlens_kv_slots_take(&a, 4, y), -ENOSPC);
	ck_assert_uint_eq(a.n_free, 3);	/* nothing taken by the refusal */
	ck_assert_int_eq(mlens_kv_slots_take(&a, 3, y), 0);
	for (int i = 0; i < 5; i++)
		seen[x[i]] = true;
	for (int i = 0; i < 3; i++) {
		ck_assert_msg(!seen[y[i]], "slot %u handed out twice", y[i]);
		seen[y[i]] = true;
	}
	ck_assert_int_eq(mlens_kv_slots_take(&a, 1, y + 3), -ENOSPC);
	mlens_kv_slots_give(&a, x, 5);
	ck_assert_uint_eq(a.n_free, 5);
	/* given back in order, taken again in the same order */
	ck_assert_int_eq(mlens_kv_slots_take(&a, 5, y), 0);
	ck_assert_int_eq(memcmp(x, y, sizeof(uint32_t) * 5), 0);
	mlens_kv_slots_fini(&a);
}
END_TEST

/* A pool of 8 blocks of 2 layers, 2 heads, 4 tokens of head_dim values
 * of dtype (F32 or E4M3, whose scales follow the codes), every byte
 * set; its memory page-aligned as the daemon's pinned pool is. */
static struct mlens_kv_cache pool_of(int head_dim, enum mlens_dtype dtype)
{
	struct mlens_kv_cache kv = { dtype, 2, 2, head_dim, 4, 8, NULL, NULL };
	size_t bytes = mlens_kv_bytes(&kv);
	ck_assert_int_eq(posix_memalign(&kv.k, 4096, bytes), 0);
	ck_assert_int_eq(posix_memalign(&kv.v, 4096, bytes), 0);
	for (size_t i = 0; i < bytes / 4; i++) {
		((float *)kv.k)[i] = (float)i;
		((float *)kv.v)[i] = -(float)i;
	}
	return kv;
}

static struct mlens_kv_cache pool(int head_dim)
{
	return pool_of(head_dim, MLENS_DTYPE_F32);
}

/* A block's K and V of every layer (and their scales in E4M3) equal
 * another's (in pools a, b). */
static bool block_eq(const struct mlens_kv_cache *a, uint32_t ba, const struct mlens_kv_cache *b, uint32_t bb)
{
	size_t es = mlens_dtype_size(a->dtype), run = (size_t)a->n_kv_heads * mlens_kv_head_elems(a) * es;
	size_t srun = (size_t)a->n_kv_heads * (size_t)a->block_size * sizeof(float);
	for (int l = 0; l < a->n_layers; l++) {
		size_t ia = mlens_kv_index(a, l, ba, 0, 0), ib = mlens_kv_index(b, l, bb, 0, 0);
		if (memcmp((char *)a->k + ia * es, (char *)b->k + ib * es, run) ||
		    memcmp((char *)a->v + ia * es, (char *)b->v + ib * es, run))
			return false;
		if (a->dtype == MLENS_DTYPE_E4M3 &&
		    (memcmp(mlens_kv_scales(a, a->k) + ia / a->head_dim, mlens_kv_scales(b, b->k) + ib / b->head_dim, srun) ||
		     memcmp(mlens_kv_scales(a, a->v) + ia / a->head_dim, mlens_kv_scales(b, b->v) + ib / b->head_dim, srun)))
			return false;
	}
	return true;
}

/* A fresh scratch directory for a swap file (scratch_dir), removed again
 * by scratch_done, which asserts that nothing was left in it. */
static char dir[64];

static void scratch_dir(void)
{
	snprintf(dir, sizeof(dir), "/tmp/check_kv_swap.XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(dir));	/* the template mkdtemp fills in */
}

static void scratch_done(void)
{
	ck_assert_int_eq(rmdir(dir), 0);
}

static struct mlens_kv_swap *open_swap(const struct mlens_kv_cache *kv, const char *path, uint64_t budget)
{
	struct mlens_kv_swap_opts o = { .budget = budget, .path = path, .policy = MLENS_KV_SWAP_ALWAYS };
	struct mlens_kv_swap *sw;
	char err[512] = "";
	int rc = mlens_kv_swap_create(&sw, kv, &o, err, sizeof(err));
	ck_assert_msg(rc == 0, "create: %s", err);
	return sw;
}

/* Out of blocks 1, 5, 6 and back into 7, 0, 2 of the same pool (zeroed
 * first): the same bytes; the counters and slots follow. Head size 8
 * (runs of 256 bytes: buffered) and 512 (16 KiB runs: O_DIRECT where
 * /tmp allows it); an E4M3 pool's scales come back with its codes. */
static void round_trip(int head_dim, enum mlens_dtype dtype)
{
	struct mlens_kv_cache kv = pool_of(head_dim, dtype), ref = pool_of(head_dim, dtype);
	const uint32_t src[3] = { 1, 5, 6 }, dst[3] = { 7, 0, 2 };
	uint32_t slots[3];
	struct mlens_kv_swap_stats st;
	struct mlens_kv_swap *sw;
	/* K and V, 2 layers, 2 heads, 4 tokens; a row's scale in E4M3 */
	size_t slot_bytes = 2 * 2 * 2 * 4 *
			    ((size_t)head_dim * mlens_dtype_size(dtype) + (dtype == MLENS_DTYPE_E4M3 ? sizeof(float) : 0));

	scratch_dir();
	sw = open_swap(&kv, dir, 4 * slot_bytes + 100);
	ck_assert_uint_eq(mlens_kv_swap_slot_bytes(sw), slot_bytes);
	ck_assert_int_eq(mlens_kv_swap_out(sw, &kv, src, 3, slots), 0);
	mlens_kv_swap_get_stats(sw, &st);
	ck_assert_uint_eq(st.slots_total, 4);
	ck_assert_uint_eq(st.slots_used, 3);
	ck_assert_uint_eq(st.bytes_out, 3 * slot_bytes);
	ck_assert_uint_eq(st.swaps, 1);
	memset(kv.k, 0, mlens_kv_bytes(&kv));
	memset(kv.v, 0, mlens_kv_bytes(&kv));
	ck_assert_int_eq(mlens_kv_swap_in(sw, &kv, dst, 3, slots), 0);
	for (int i = 0; i < 3; i++)
		ck_assert_msg(block_eq(&kv, dst[i], &ref, src[i]), "block %u read back into %u differs (%s)", src[i],
			      dst[i], mlens_kv_swap_describe(sw));
	mlens_kv_swap_get_stats(sw, &st);
	ck_assert_uint_eq(st.slots_used, 0);
	ck_assert_uint_eq(st.bytes_in, 3 * slot_bytes);
	ck_assert_uint_eq(st.swap_ins, 1);
	ck_assert_uint_eq(st.errors, 0);
	/* a fourth slot exists, not a fifth: all or nothing */
	{
		uint32_t b5[5] = { 0, 1, 2, 3, 4 }, s5[5];
		ck_assert_int_eq(mlens_kv_swap_out(sw, &kv, b5, 5, s5), -ENOSPC);
		mlens_kv_swap_get_stats(sw, &st);
		ck_assert_uint_eq(st.slots_used, 0);
	}
	mlens_kv_swap_destroy(sw);
	scratch_done();	/* the unnamed file left nothing behind */
	free(kv.k), free(kv.v), free(ref.k), free(ref.v);
}

START_TEST(round_trip_buffered)
{
	round_trip(8, MLENS_DTYPE_F32);
}
END_TEST

START_TEST(round_trip_pages)
{
	round_trip(512, MLENS_DTYPE_F32);
}
END_TEST

START_TEST(round_trip_fp8)
{
	round_trip(8, MLENS_DTYPE_E4M3);
	round_trip(512, MLENS_DTYPE_E4M3);
}
END_TEST

START_TEST(paths)
{
	struct mlens_kv_cache kv = pool(8);
	struct mlens_kv_swap_opts o = { .budget = 1 << 20, .policy = MLENS_KV_SWAP_AUTO };
	struct mlens_kv_swap *sw;
	char path[512], err[512] = "";
	struct stat st;
	int fd;

	scratch_dir();
	/* a new file path: created, unlinked at once */
	snprintf(path, sizeof(path), "%s/swap", dir);
	o.path = path;
	ck_assert_int_eq(mlens_kv_swap_create(&sw, &kv, &o, err, sizeof(err)), 0);
	ck_assert_int_eq(stat(path, &st), -1);
	mlens_kv_swap_destroy(sw);
	/* an existing file: refused by name */
	fd = open(path, O_CREAT | O_WRONLY, 0600);
	ck_assert_int_ge(fd, 0);
	close(fd);
	ck_assert_int_eq(mlens_kv_swap_create(&sw, &kv, &o, err, sizeof(err)), -EEXIST);
	ck_assert_msg(strstr(err, path) && strstr(err, "not a directory"), "message: %s", err);
	ck_assert_int_eq(stat(path, &st), 0);	/* and left alone */
	unlink(path);
	/* a budget below one slot */
	o.path = dir;
	o.budget = 100;
	ck_assert_int_eq(mlens_kv_swap_create(&sw, &kv, &o, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "holds no KV block"), "message: %s", err);
	/* a directory that is not there */
	snprintf(path, sizeof(path), "%s/none/swap", dir);
	o.path = path;
	o.budget = 1 << 20;
	ck_assert_int_eq(mlens_kv_swap_create(&sw, &kv, &o, err, sizeof(err)), -ENOENT);
	scratch_done();
	free(kv.k), free(kv.v);
}
END_TEST

/* The test hook: each fault its error, the slots back, the error counted
 * (not for a full disk). */
START_TEST(faults)
{
	static const char *what[] = { "write", "enospc", "read" };
	struct mlens_kv_cache kv = pool(8);
	const uint32_t blocks[2] = { 3, 4 };
	uint32_t slots[2];
	struct mlens_kv_swap_stats st;

	for (int i = 0; i < 3; i++) {
		struct mlens_kv_swap *sw;
		scratch_dir();
		setenv("MLENS_TEST_SWAP_FAIL", what[i], 1);
		sw = open_swap(&kv, dir, 1 << 20);
		if (i < 2) {
			ck_assert_int_eq(mlens_kv_swap_out(sw, &kv, blocks, 2, slots), i == 0 ? -EIO : -ENOSPC);
			mlens_kv_swap_get_stats(sw, &st);
			ck_assert_uint_eq(st.errors, i == 0 ? 1 : 0);
			ck_assert_uint_eq(st.swaps, 0);
		} else {
			ck_assert_int_eq(mlens_kv_swap_out(sw, &kv, blocks, 2, slots), 0);
			ck_assert_int_eq(mlens_kv_swap_in(sw, &kv, blocks, 2, slots), -EIO);
			mlens_kv_swap_get_stats(sw, &st);
			ck_assert_uint_eq(st.errors, 1);
			ck_assert_uint_eq(st.swap_ins, 0);
		}
		ck_assert_uint_eq(st.slots_used, 0);
		mlens_kv_swap_destroy(sw);
		unsetenv("MLENS_TEST_SWAP_FAIL");
		scratch_done();
	}
	free(kv.k), free(kv.v);
}
END_TEST

/* The rates at open and as swaps and steps are observed: a real file is
 * measured (and the pool's bytes survive the measurement); the hook sets
 * the rate; a failing file keeps the caller's rate and source. Under
 * auto, a slow forced disk recomputes and a fast one swaps. */
START_TEST(rates_at_open)
{
	struct mlens_kv_cache kv = pool(8), ref = pool(8);
	struct mlens_kv_swap_opts o = { .budget = 1 << 20, .policy = MLENS_KV_SWAP_AUTO,
					.rates = { .disk_bps = 2e9, .compute_flops = 5e10, .flops_per_token = 1e6 },
					.compute_source = MLENS_KV_SWAP_PROFILED };
	const uint32_t blocks[2] = { 3, 4 };
	uint32_t slots[2];
	struct mlens_kv_swap_stats st;
	struct mlens_kv_swap *sw;
	char err[512];

	scratch_dir();
	o.path = dir;
	/* measured on the file: the pool unchanged, no I/O counted */
	ck_assert_int_eq(mlens_kv_swap_create(&sw, &kv, &o, err, sizeof(err)), 0);
	mlens_kv_swap_get_stats(sw, &st);
	ck_assert_msg(st.disk.source == MLENS_KV_SWAP_MEASURED && st.measured_bps > 0 &&
		      st.disk.value == st.measured_bps, "%s", mlens_kv_swap_describe(sw));
	ck_assert(strstr(mlens_kv_swap_describe(sw), "measured on it"));
	ck_assert(st.prefill.value == 5e10 && st.prefill.source == MLENS_KV_SWAP_PROFILED);
	ck_assert(st.io_seconds == 0 && st.bytes_out == 0 && st.slots_used == 0);
	ck_assert_int_eq(memcmp(kv.k, ref.k, mlens_kv_bytes(&kv)), 0);
	ck_assert_int_eq(memcmp(kv.v, ref.v, mlens_kv_bytes(&kv)), 0);
	/* a swap's transfers are observed; a prefill step is too */
	ck_assert_int_eq(mlens_kv_swap_out(sw, &kv, blocks, 2, slots), 0);
	mlens_kv_swap_get_stats(sw, &st);
	ck_assert(st.disk.source == MLENS_KV_SWAP_OBSERVED && st.disk.n_observed == 1 && st.disk.value > 0);
	ck_assert_int_eq(mlens_kv_swap_in(sw, &kv, blocks, 2, slots), 0);
	mlens_kv_swap_observe_prefill(sw, 0, 1);	/* no prefill in the step: nothing */
	mlens_kv_swap_get_stats(sw, &st);
	ck_assert_uint_eq(st.disk.n_observed, 2);
	ck_assert(st.prefill.source == MLENS_KV_SWAP_PROFILED);
	mlens_kv_swap_observe_prefill(sw, 3e9, 0.5);
	mlens_kv_swap_get_stats(sw, &st);
	ck_assert(st.prefill.value == 6e9 && st.prefill.source == MLENS_KV_SWAP_OBSERVED);
	ck_assert(mlens_kv_swap_get_rates(sw).compute_flops == 6e9);
	mlens_kv_swap_destroy(sw);

	/* a slow disk: 100 tokens recompute in 2 ms, one block moves in
	 * seconds; a fast one moves it in nanoseconds */
	setenv("MLENS_TEST_SWAP_RATE", "1000", 1);
	ck_assert_int_eq(mlens_kv_swap_create(&sw, &kv, &o, err, sizeof(err)), 0);
	mlens_kv_swap_get_stats(sw, &st);
	ck_assert(st.disk.value == 1000 && st.disk.source == MLENS_KV_SWAP_MEASURED);
	ck_assert(strstr(mlens_kv_swap_describe(sw), "MLENS_TEST_SWAP_RATE"));
	ck_assert(!mlens_kv_swap_choose(sw, 1, 100));
	mlens_kv_swap_destroy(sw);
	setenv("MLENS_TEST_SWAP_RATE", "1e15", 1);
	ck_assert_int_eq(mlens_kv_swap_create(&sw, &kv, &o, err, sizeof(err)), 0);
	ck_assert(mlens_kv_swap_choose(sw, 1, 100));
	mlens_kv_swap_destroy(sw);
	/* a value that is no rate: measured as without the hook */
	setenv("MLENS_TEST_SWAP_RATE", "fast", 1);
	ck_assert_int_eq(mlens_kv_swap_create(&sw, &kv, &o, err, sizeof(err)), 0);
	ck_assert_msg(strstr(mlens_kv_swap_describe(sw), "measured on it"), "%s", mlens_kv_swap_describe(sw));
	mlens_kv_swap_destroy(sw);
	unsetenv("MLENS_TEST_SWAP_RATE");

	/* a file whose writes fail: the caller's rate and source stay */
	o.disk_source = MLENS_KV_SWAP_DEFAULT;
	setenv("MLENS_TEST_SWAP_FAIL", "write", 1);
	ck_assert_int_eq(mlens_kv_swap_create(&sw, &kv, &o, err, sizeof(err)), 0);
	unsetenv("MLENS_TEST_SWAP_FAIL");
	mlens_kv_swap_get_stats(sw, &st);
	ck_assert(st.disk.value == 2e9 && st.disk.source == MLENS_KV_SWAP_DEFAULT && st.measured_bps == 0);
	ck_assert_uint_eq(st.errors, 0);
	mlens_kv_swap_destroy(sw);
	scratch_done();
	free(kv.k), free(kv.v), free(ref.k), free(ref.v);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("kv_swap");
	TCase *tc = tcase_create("kv_swap");
	tcase_add_test(tc, cost_boundary);
	tcase_add_test(tc, rate_ewma);
	tcase_add_test(tc, prefill_flops);
	tcase_add_test(tc, slots_all_or_nothing);
	tcase_add_test(tc, round_trip_buffered);
	tcase_add_test(tc, round_trip_pages);
	tcase_add_test(tc, round_trip_fp8);
	tcase_add_test(tc, paths);
	tcase_add_test(tc, faults);
	tcase_add_test(tc, rates_at_open);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
