/* Worker pool: a generation counter starts a run, tasks are claimed from an
 * atomic counter, and an atomic count of busy workers ends it. Workers
 * pinned to cores of their own spin for a short while (spin_ns) after a
 * run before they sleep on the start condition, and the caller spins as
 * long for the last worker before it sleeps on the done condition: the
 * hybrid pipeline runs two pool calls for each token group's attention
 * (hundreds a step), and waking 15 sleeping threads through a condition
 * and a mutex costs tens of microseconds each time. */
#include <errno.h>
#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include "kernels/cpu/pool.h"

/* How long an idle worker (and the waiting caller) spins, in ns, when
 * each worker has a core of its own; MLENS_POOL_SPIN_US overrides it
 * (0: sleep at once). */
#define POOL_SPIN_NS 100000

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() ((void)0)
#endif

struct mlens_pool {
	int n;			/* threads including the caller */
	pthread_t *threads;
	pthread_mutex_t lock;	/* guards the sleepers, caller_sleeps, stop */
	pthread_cond_t start;
	pthread_cond_t done;
	/* written by the caller before it publishes gen (release); read by
	 * workers after they load it (acquire) */
	mlens_pool_fn fn;
	void *arg;
	int n_tasks;
	atomic_ulong gen;	/* bumped under lock to start a run */
	atomic_int busy;	/* workers still in the current run */
	atomic_int next;	/* next task to claim */
	atomic_int stop;
	int sleepers;		/* workers waiting on start */
	bool caller_sleeps;	/* the caller waits on done */
	long spin_ns;
};

struct worker_arg {
	struct mlens_pool *p;
	int id;
	int cpu;
};

static void run_tasks(struct mlens_pool *p, int id)
{
	int t;
	/* relaxed: the counter only hands out indexes; the data the tasks read
	 * was published with the generation that started this run. */
	while ((t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed)) < p->n_tasks)
		p->fn(p->arg, t, id);
}

static long elapsed_ns(const struct timespec *t0)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (t.tv_sec - t0->tv_sec) * 1000000000L + (t.tv_nsec - t0->tv_nsec);
}

/* Spin while cond(p, v) holds, up to p->spin_ns; whether it stopped holding. */
static bool spin_until(struct mlens_pool *p, bool (*cond)(struct mlens_pool *, unsigned long),
		       unsigned long v)
{
	struct timespec t0;
	if (p->spin_ns <= 0)
		return !cond(p, v);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (int i = 0;; i++) {
		if (!cond(p, v))
			return true;
		cpu_relax();
		if ((i & 63) == 63 && elapsed_ns(&t0) > p->spin_ns)
			return !cond(p, v);
	}
}

static bool same_gen(struct mlens_pool *p, unsigned long seen)
{
	return atomic_load_explicit(&p->gen, memory_order_acquire) == seen &&
	       !atomic_load_explicit(&p->stop, memory_order_relaxed);
}

static bool workers_busy(struct mlens_pool *p, unsigned long unused)
{
	(void)unused;
	return atomic_load_explicit(&p->busy, memory_order_acquire) > 0;
}

static void *worker_main(void *a)
{
	struct worker_arg wa = *(struct worker_arg *)a;
	struct mlens_pool *p = wa.p;
	unsigned long seen = 0;
	free(a);
	if (wa.cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(wa.cpu, &set);
		pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	}
	for (;;) {
		if (!spin_until(p, same_gen, seen)) {
			pthread_mutex_lock(&p->lock);
			while (same_gen(p, seen)) {
				p->sleepers++;
				pthread_cond_wait(&p->start, &p->lock);
				p->sleepers--;
			}
			pthread_mutex_unlock(&p->lock);
		}
		if (atomic_load_explicit(&p->stop, memory_order_relaxed))
			break;
		seen = atomic_load_explicit(&p->gen, memory_order_acquire);
		run_tasks(p, wa.id);
		if (atomic_fetch_sub_explicit(&p->busy, 1, memory_order_acq_rel) == 1) {
			pthread_mutex_lock(&p->lock);
			if (p->caller_sleeps)
				pthread_cond_signal(&p->done);
			pthread_mutex_unlock(&p->lock);
		}
	}
	return NULL;
}

static int pool_create(struct mlens_pool **out, int n_threads, const int *cpus, long spin_ns)
{
	struct mlens_pool *p;
	int i, err;

	if (n_threads <= 0) {
		long c = sysconf(_SC_NPROCESSORS_ONLN);
		n_threads = c > 0 ? (int)c : 1;
	}
	p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->n = n_threads;
	p->spin_ns = spin_ns;	/* before the workers start: they read it */
	p->threads = calloc((size_t)n_threads, sizeof(pthread_t));
	if (!p->threads) {
		free(p);
		return -ENOMEM;
	}
	pthread_mutex_init(&p->lock, NULL);
	atomic_init(&p->gen, 0);
	atomic_init(&p->busy, 0);
	atomic_init(&p->next, 0);
	atomic_init(&p->stop, 0);
	pthread_cond_init(&p->start, NULL);
	pthread_cond_init(&p->done, NULL);
	for (i = 1; i < n_threads; i++) {
		struct worker_arg *wa = malloc(sizeof(*wa));
		if (!wa) {
			err = -ENOMEM;
			goto fail;
		}
		wa->p = p;
		wa->id = i;
		wa->cpu = cpus ? cpus[i] : -1;
		err = -pthread_create(&p->threads[i], NULL, worker_main, wa);
		if (err) {
			free(wa);
			goto fail;
		}
	}
	*out = p;
	return 0;
fail:
	p->n = i;	/* threads [1, i) exist */
	mlens_pool_destroy(p);
	return err;
}

int mlens_pool_create(struct mlens_pool **out, int n_threads, const int *cpus)
{
	return pool_create(out, n_threads, cpus, 0);
}

/* CPUs of node that sched_getaffinity allows, ascending; count or -errno. */
static int node_cpus(int node, int **out)
{
	struct bitmask *bm = NULL;
	cpu_set_t allowed;
	int n = 0, rc, ncpu = numa_num_possible_cpus();
	int *list = NULL;

	if (node > numa_max_node())
		return -EINVAL;
	bm = numa_allocate_cpumask();
	list = calloc((size_t)(ncpu > 0 ? ncpu : 1), sizeof(*list));
	if (!bm || !list) {
		rc = -ENOMEM;
		goto fail;
	}
	if (numa_node_to_cpus(node, bm) < 0) {
		rc = -EINVAL;
		goto fail;
	}
	if (sched_getaffinity(0, sizeof(allowed), &allowed)) {
		rc = -errno;
		goto fail;
	}
	for (int c = 0; c < ncpu && c < CPU_SETSIZE; c++)
		if (numa_bitmask_isbitset(bm, (unsigned)c) && CPU_ISSET(c, &allowed))
			list[n++] = c;
	numa_free_cpumask(bm);
	if (!n) {
		free(list);
		return -EINVAL;
	}
	*out = list;
	return n;
fail:
	if (bm)
		numa_free_cpumask(bm);
	free(list);
	return rc;
}

int mlens_pool_create_numa(struct mlens_pool **out, int node, int n_threads, int n_reserved)
{
	int *list = NULL, *cpus = NULL, n, usable, first, rc;
	long spin = 0;

	if (n_reserved < 0)
		n_reserved = 0;
	if (node < 0 || numa_available() < 0) {
		long c = sysconf(_SC_NPROCESSORS_ONLN);
		if (n_threads <= 0)
			n_threads = c - n_reserved > 1 ? (int)(c - n_reserved) : 1;
		return mlens_pool_create(out, n_threads, NULL);
	}
	n = node_cpus(node, &list);
	if (n < 0)
		return n;
	/* too few CPUs to keep any in reserve: share them all */
	first = n_reserved < n ? n_reserved : 0;
	usable = n - first;
	if (n_threads <= 0)
		n_threads = usable;
	cpus = calloc((size_t)n_threads, sizeof(*cpus));
	if (!cpus) {
		free(list);
		return -ENOMEM;
	}
	for (int i = 0; i < n_threads; i++)
		cpus[i] = list[first + i % usable];
	/* a core each: idle workers may spin a while before they sleep */
	if (n_threads <= usable) {
		const char *e = getenv("MLENS_POOL_SPIN_US");
		spin = e && *e ? atol(e) * 1000L : POOL_SPIN_NS;
	}
	rc = pool_create(out, n_threads, cpus, spin);
	free(cpus);
	free(list);
	return rc;
}

void mlens_pool_destroy(struct mlens_pool *p)
{
	int i;
	if (!p)
		return;
	pthread_mutex_lock(&p->lock);
	atomic_store(&p->stop, 1);
	pthread_cond_broadcast(&p->start);
	pthread_mutex_unlock(&p->lock);
	for (i = 1; i < p->n; i++)
		pthread_join(p->threads[i], NULL);
	pthread_mutex_destroy(&p->lock);
	pthread_cond_destroy(&p->start);
	pthread_cond_destroy(&p->done);
	free(p->threads);
	free(p);
}

int mlens_pool_size(const struct mlens_pool *p)
{
	return p->n;
}

void mlens_pool_run(struct mlens_pool *p, int n_tasks, mlens_pool_fn fn, void *arg)
{
	if (n_tasks <= 0)
		return;
	if (p->n == 1 || n_tasks == 1) {
		for (int t = 0; t < n_tasks; t++)
			fn(arg, t, 0);
		return;
	}
	p->fn = fn;
	p->arg = arg;
	p->n_tasks = n_tasks;
	atomic_store_explicit(&p->next, 0, memory_order_relaxed);
	atomic_store_explicit(&p->busy, p->n - 1, memory_order_relaxed);
	pthread_mutex_lock(&p->lock);
	/* release: fn, arg, n_tasks, next and busy before the new generation */
	atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
	if (p->sleepers)
		pthread_cond_broadcast(&p->start);
	pthread_mutex_unlock(&p->lock);

	run_tasks(p, 0);

	if (spin_until(p, workers_busy, 0))
		return;	/* acquire: the workers' results are visible */
	pthread_mutex_lock(&p->lock);
	while (workers_busy(p, 0)) {
		p->caller_sleeps = true;
		pthread_cond_wait(&p->done, &p->lock);
	}
	p->caller_sleeps = false;
	pthread_mutex_unlock(&p->lock);
}
