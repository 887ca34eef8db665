/* Description: the KV swap (daemon/exec/kv_swap.c): the cost model's
 * choice at its boundary; the slot allocator all or nothing, every slot
 * once; blocks written to a real swap file and read back into other pool
 * blocks byte for byte, through io_uring; a directory gets an unnamed
 * file, a new file path is unlinked at once, an existing file is refused;
 * the MLENS_TEST_SWAP_FAIL hook's write, read and enospc faults return
 * their error and give the slots back. */
#include <check.h>
#include <errno.h>
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

/* A pool of 8 blocks of 2 layers, 2 heads, 4 tokens of 8 floats; its
 * memory page-aligned as the daemon's pinned pool is. */
static struct mlens_kv_cache pool(int head_dim)
{
	struct mlens_kv_cache kv = { MLENS_DTYPE_F32, 2, 2, head_dim, 4, 8, NULL, NULL };
	size_t bytes = mlens_kv_bytes(&kv);
	ck_assert_int_eq(posix_memalign(&kv.k, 4096, bytes), 0);
	ck_assert_int_eq(posix_memalign(&kv.v, 4096, bytes), 0);
	for (size_t i = 0; i < bytes / 4; i++) {
		((float *)kv.k)[i] = (float)i;
		((float *)kv.v)[i] = -(float)i;
	}
	return kv;
}

/* A block's K and V of every layer equal another's (in pools a, b). */
static bool block_eq(const struct mlens_kv_cache *a, uint32_t ba, const struct mlens_kv_cache *b, uint32_t bb)
{
	size_t run = (size_t)a->n_kv_heads * mlens_kv_head_elems(a) * sizeof(float);
	for (int l = 0; l < a->n_layers; l++) {
		size_t ia = mlens_kv_index(a, l, ba, 0, 0), ib = mlens_kv_index(b, l, bb, 0, 0);
		if (memcmp((float *)a->k + ia, (float *)b->k + ib, run) ||
		    memcmp((float *)a->v + ia, (float *)b->v + ib, run))
			return false;
	}
	return true;
}

static char dir[] = "/tmp/check_kv_swap.XXXXXX";

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
 * /tmp allows it). */
static void round_trip(int head_dim)
{
	struct mlens_kv_cache kv = pool(head_dim), ref = pool(head_dim);
	const uint32_t src[3] = { 1, 5, 6 }, dst[3] = { 7, 0, 2 };
	uint32_t slots[3];
	struct mlens_kv_swap_stats st;
	struct mlens_kv_swap *sw;
	size_t slot_bytes = 2 * 2 * 2 * 4 * (size_t)head_dim * sizeof(float);

	ck_assert_ptr_nonnull(mkdtemp(dir));
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
	ck_assert_int_eq(rmdir(dir), 0);	/* the unnamed file left nothing behind */
	strcpy(dir, "/tmp/check_kv_swap.XXXXXX");
	free(kv.k), free(kv.v), free(ref.k), free(ref.v);
}

START_TEST(round_trip_buffered)
{
	round_trip(8);
}
END_TEST

START_TEST(round_trip_pages)
{
	round_trip(512);
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

	ck_assert_ptr_nonnull(mkdtemp(dir));
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
	ck_assert_int_eq(rmdir(dir), 0);
	strcpy(dir, "/tmp/check_kv_swap.XXXXXX");
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
		ck_assert_ptr_nonnull(mkdtemp(dir));
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
		ck_assert_int_eq(rmdir(dir), 0);
		strcpy(dir, "/tmp/check_kv_swap.XXXXXX");
	}
	free(kv.k), free(kv.v);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("kv_swap");
	TCase *tc = tcase_create("kv_swap");
	tcase_add_test(tc, cost_boundary);
	tcase_add_test(tc, slots_all_or_nothing);
	tcase_add_test(tc, round_trip_buffered);
	tcase_add_test(tc, round_trip_pages);
	tcase_add_test(tc, paths);
	tcase_add_test(tc, faults);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
