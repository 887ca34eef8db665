/* Description: pinned host memory (daemon/mem.c): an area rounded up to
 * whole pages, zeroed, writable, named for messages and given back; a
 * failed mlock names RLIMIT_MEMLOCK, its value and the way out; the NUMA
 * node asked for is checked by number; the share of a range in transparent
 * huge pages, from a synthetic smaps and from this process's own for a
 * pinned area. */
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>
#include "daemon/mem.h"
#include "tests/check_common.h"

/* ==== pinned areas ==== */

START_TEST(pinned_area)
{
	struct mlens_pinned m;
	char err[256] = "";
	size_t page = (size_t)sysconf(_SC_PAGESIZE);

	/* a page and one byte: two pages, zeroed, writable to the last byte */
	ck_assert_int_eq(mlens_pinned_alloc(&m, page + 1, -1, false, "test area", err, sizeof(err)), 0);
	ck_assert_str_eq(err, "");
	ck_assert_ptr_nonnull(m.p);
	ck_assert_uint_eq(m.size, 2 * page);
	ck_assert_int_eq(m.node, -1);
	ck_assert(!m.locked);
	ck_assert_str_eq(m.what, "test area");
	for (size_t i = 0; i < m.size; i++)
		ck_assert_int_eq(((const unsigned char *)m.p)[i], 0);
	memset(m.p, 0xa5, m.size);
	ck_assert_int_eq(((const unsigned char *)m.p)[m.size - 1], 0xa5);
	mlens_pinned_free(&m);
	ck_assert_ptr_null(m.p);
	mlens_pinned_free(&m);	/* twice: nothing */
	ck_assert_ptr_null(m.p);
}
END_TEST

/* Locking beyond RLIMIT_MEMLOCK (64 KiB here): refused, naming the area,
 * the limit and both ways out, nothing kept; a process allowed to lock
 * past its limit (root with CAP_IPC_LOCK) locks it. */
START_TEST(pinned_mlock_limit)
{
	struct rlimit rl = { 64 << 10, 64 << 10 };
	struct mlens_pinned m;
	char err[512] = "";
	int rc;

	ck_assert_int_eq(setrlimit(RLIMIT_MEMLOCK, &rl), 0);
	rc = mlens_pinned_alloc(&m, 1 << 20, -1, true, "KV cache", err, sizeof(err));
	if (rc == 0 && geteuid() == 0) {
		ck_assert(m.locked);
		ck_assert_uint_eq(m.size, 1 << 20);
		mlens_pinned_free(&m);
		return;
	}
	ck_assert_msg(rc == -ENOMEM || rc == -EPERM, "rc %d: %s", rc, err);
	ck_assert_ptr_null(m.p);
	ck_assert_msg(!strncmp(err, "cannot lock 1 MiB for the KV cache: ", 36), "%s", err);
	ck_assert_msg(strstr(err, " (RLIMIT_MEMLOCK is 64 KiB; raise it, e.g. LimitMEMLOCK=infinity, "
				  "or set mlock = false)"), "%s", err);
	/* without mlock the same area is fine */
	ck_assert_int_eq(mlens_pinned_alloc(&m, 1 << 20, -1, false, "KV cache", err, sizeof(err)), 0);
	ck_assert(!m.locked);
	mlens_pinned_free(&m);
}
END_TEST

/* A node asked for is that node when it exists, refused by number when
 * not; without NUMA support node 0 or none is -1 and any other refused. */
START_TEST(numa_pick)
{
	char err[256] = "", want[128];
	bool numa = mlens_numa_pick(0, 0, err, sizeof(err)) == 0;
	int r, last;

	ck_assert_str_eq(err, "");
	ck_assert_int_eq(mlens_numa_pick(1023, 0, err, sizeof(err)), -ENODEV);
	if (!numa) {
		ck_assert_str_eq(err, "NUMA node 1023 asked for, but this kernel has no NUMA support");
		ck_assert_int_eq(mlens_numa_pick(-1, 0, err, sizeof(err)), -1);
		return;
	}
	/* the refusal names the nodes there are; the last of them is taken,
	 * one past it refused */
	ck_assert_msg(sscanf(err, "NUMA node 1023 does not exist (nodes 0..%d)", &last) == 1, "%s", err);
	ck_assert_int_ge(last, 0);
	ck_assert_int_lt(last, 1023);
	ck_assert_int_eq(mlens_numa_pick(last, 0, err, sizeof(err)), last);
	ck_assert_int_eq(mlens_numa_pick(last + 1, 0, err, sizeof(err)), -ENODEV);
	snprintf(want, sizeof(want), "NUMA node %d does not exist (nodes 0..%d)", last + 1, last);
	ck_assert_str_eq(err, want);
	/* the default: the GPU's node, else 0; one of the nodes there are */
	r = mlens_numa_pick(-1, 0, err, sizeof(err));
	ck_assert_int_ge(r, 0);
	ck_assert_int_le(r, last);
}
END_TEST

/* ==== huge pages from smaps ==== */

/* A synthetic smaps in an unnamed temporary file, read back through its
 * /proc/self/fd path (path: room for it); fclose removes it. */
static FILE *write_smaps(const char *text, char *path, size_t len)
{
	FILE *f = tmpfile();
	ck_assert_ptr_nonnull(f);
	ck_assert_int_ge(fputs(text, f), 0);
	ck_assert_int_eq(fflush(f), 0);
	snprintf(path, len, "/proc/self/fd/%d", fileno(f));
	return f;
}

START_TEST(huge_bytes_from_smaps)
{
	char longpath[700];
	memset(longpath, 'x', sizeof(longpath) - 1);
	longpath[sizeof(longpath) - 1] = 0;
	char text[2048];
	snprintf(text, sizeof(text),
		 "00400000-00600000 r-xp 00000000 08:01 123   /bin/x\n"
		 "Size:               2048 kB\n"
		 "AnonHugePages:      2048 kB\n"
		 "7f0000000000-7f0000800000 rw-p 00000000 00:00 0 \n"
		 "Size:               8192 kB\n"
		 "AnonHugePages:      4096 kB\n"
		 "VmFlags: rd wr mr mw me ac hg\n"
		 "7f0000800000-7f0001000000 rw-p 00000000 00:00 0   /%s\n"
		 "Size:               8192 kB\n"
		 "AnonHugePages:      8192 kB\n"
		 "7f0002000000-7f0002200000 rw-p 00000000 00:00 0 \n"
		 "AnonHugePages:         0 kB\n", longpath);
	char path[64];
	FILE *f = write_smaps(text, path, sizeof(path));
	size_t h = 1;
	const char *base = (const char *)(uintptr_t)0x7f0000000000ull;

	/* one mapping whole: its AnonHugePages */
	ck_assert_int_eq(mlens_huge_bytes(path, base, 8u << 20, &h), 0);
	ck_assert_uint_eq(h, 4u << 20);
	/* half of each of two: half of each one's (2 + 4 MiB); the second's
	 * header line is longer than the parser's buffer */
	ck_assert_int_eq(mlens_huge_bytes(path, base + (4u << 20), 8u << 20, &h), 0);
	ck_assert_uint_eq(h, 6u << 20);
	/* across the gap to the third: 4 MiB of the second, none of the third */
	ck_assert_int_eq(mlens_huge_bytes(path, base + (12u << 20), 22u << 20, &h), 0);
	ck_assert_uint_eq(h, 4u << 20);
	/* no mapping there */
	h = 1;
	ck_assert_int_eq(mlens_huge_bytes(path, base + (16u << 20), 4u << 20, &h), -ENOENT);
	ck_assert_uint_eq(h, 0);
	fclose(f);

	f = write_smaps("7f0000002000-7f0000001000 rw-p 00000000 00:00 0 \nAnonHugePages: 0 kB\n",
			path, sizeof(path));
	ck_assert_int_eq(mlens_huge_bytes(path, base, 4096, &h), -EINVAL);
	fclose(f);
	ck_assert_int_eq(mlens_huge_bytes("/nonexistent/smaps", base, 4096, &h), -ENOENT);
}
END_TEST

/* This process's own smaps: a pinned area is found, and its huge part is
 * at most its size (how much the kernel gives depends on the machine). */
START_TEST(huge_bytes_of_pinned)
{
	struct mlens_pinned m;
	char err[256];
	size_t h = 0;
	ck_assert_int_eq(mlens_pinned_alloc(&m, 16u << 20, -1, false, "test area", err, sizeof(err)), 0);
	ck_assert_int_eq(mlens_huge_bytes(NULL, m.p, m.size, &h), 0);
	ck_assert_uint_le(h, m.size);
	mlens_pinned_free(&m);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("mem");
	TCase *tc = tcase_create("pinned");
	tcase_add_test(tc, pinned_area);
	tcase_add_test(tc, pinned_mlock_limit);
	tcase_add_test(tc, numa_pick);
	tcase_add_test(tc, huge_bytes_from_smaps);
	tcase_add_test(tc, huge_bytes_of_pinned);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
