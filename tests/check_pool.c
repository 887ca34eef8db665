/* Description: the CPU worker pool (kernels/cpu/pool.c): every task of a run
 * runs exactly once and its results are visible to the caller when
 * mlens_pool_run returns, over many back-to-back runs and runs far apart
 * (workers asleep), for 1 to 7 threads, unpinned and pinned to a NUMA
 * node's cores, and destroy with workers just done or asleep. */
#include <check.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "kernels/cpu/pool.h"

#define MAX_TASKS 97

struct job {
	int run;			/* the run's number, written into every slot */
	int slot[MAX_TASKS];		/* plain writes: the pool must publish them */
	atomic_int hits[MAX_TASKS];	/* how often each task ran */
	atomic_int bad_thread;		/* a thread index out of range */
	int n_threads;
};

static void task(void *arg, int t, int thread)
{
	struct job *j = arg;
	if (t % 7 == 3) {	/* some tasks take a while: the caller must wait for them */
		struct timespec t0, t1;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		do
			clock_gettime(CLOCK_MONOTONIC, &t1);
		while ((t1.tv_sec - t0.tv_sec) * 1000000000L + t1.tv_nsec - t0.tv_nsec < 20000);
	}
	j->slot[t] = j->run * 1000 + t;
	atomic_fetch_add_explicit(&j->hits[t], 1, memory_order_relaxed);
	if (thread < 0 || thread >= j->n_threads)
		atomic_store(&j->bad_thread, 1);
}

static void sleep_us(long us)
{
	struct timespec ts = { us / 1000000, (us % 1000000) * 1000 };
	nanosleep(&ts, NULL);
}

/* runs back to back (gap_us 0) or apart; each checked in full */
static void check_runs(struct mlens_pool *p, int runs, long gap_us)
{
	struct job *j = calloc(1, sizeof(*j));
	ck_assert_ptr_nonnull(j);
	j->n_threads = mlens_pool_size(p);
	for (int r = 0; r < runs; r++) {
		int n = 1 + (r * 37) % MAX_TASKS;
		j->run = r + 1;
		for (int t = 0; t < MAX_TASKS; t++)
			atomic_store_explicit(&j->hits[t], 0, memory_order_relaxed);
		mlens_pool_run(p, n, task, j);
		for (int t = 0; t < MAX_TASKS; t++) {
			int h = atomic_load_explicit(&j->hits[t], memory_order_relaxed);
			ck_assert_msg(h == (t < n), "run %d (%d tasks): task %d ran %d times", r, n, t, h);
			if (t < n)
				ck_assert_int_eq(j->slot[t], (r + 1) * 1000 + t);
		}
		if (gap_us)
			sleep_us(gap_us);
	}
	ck_assert_int_eq(atomic_load(&j->bad_thread), 0);
	free(j);
}

START_TEST(test_unpinned)
{
	for (int n = 1; n <= 7; n += 2) {
		struct mlens_pool *p;
		ck_assert_int_eq(mlens_pool_create(&p, n, NULL), 0);
		ck_assert_int_eq(mlens_pool_size(p), n);
		check_runs(p, 2000, 0);
		check_runs(p, 20, 2000);
		mlens_pool_destroy(p);
	}
}
END_TEST

/* Pinned to the cores of NUMA node 0 (where this process may run there) */
START_TEST(test_numa)
{
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	int n = ncpu >= 2 ? 2 : 1;
	struct mlens_pool *p;
	int rc = mlens_pool_create_numa(&p, 0, n, 0);

	if (rc == -EINVAL)	/* no NUMA node 0 this process may use */
		ck_assert_int_eq(mlens_pool_create(&p, n, NULL), 0);
	else
		ck_assert_int_eq(rc, 0);
	check_runs(p, 5000, 0);
	check_runs(p, 10, 2000);
	/* destroy straight after a run */
	mlens_pool_run(p, 3, task, &(struct job){ .n_threads = n });
	mlens_pool_destroy(p);
}
END_TEST

/* destroy with every worker asleep, and a pool that never ran */
START_TEST(test_destroy)
{
	struct mlens_pool *p;
	ck_assert_int_eq(mlens_pool_create(&p, 4, NULL), 0);
	mlens_pool_destroy(p);
	ck_assert_int_eq(mlens_pool_create(&p, 4, NULL), 0);
	mlens_pool_run(p, 8, task, &(struct job){ .n_threads = 4 });
	sleep_us(5000);
	mlens_pool_destroy(p);
	mlens_pool_destroy(NULL);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("pool");
	TCase *tc = tcase_create("pool");
	SRunner *sr;
	int failed;

	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_unpinned);
	tcase_add_test(tc, test_numa);
	tcase_add_test(tc, test_destroy);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}
