/* Worker pool: generation-counted start signal under one mutex, tasks
 * claimed from an atomic counter, completion counted under the mutex. */
#include <errno.h>
#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>
#include "kernels/cpu/pool.h"

struct mlens_pool {
	int n;			/* threads including the caller */
	pthread_t *threads;
	pthread_mutex_t lock;	/* guards gen, fn, arg, n_tasks, busy, stop */
	pthread_cond_t start;
	pthread_cond_t done;
	unsigned long gen;
	mlens_pool_fn fn;
	void *arg;
	int n_tasks;
	int busy;		/* workers still in the current generation */
	int stop;
	atomic_int next;	/* next task to claim */
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
	 * was published by the mutex that started this generation. */
	while ((t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed)) < p->n_tasks)
		p->fn(p->arg, t, id);
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
	pthread_mutex_lock(&p->lock);
	for (;;) {
		while (!p->stop && p->gen == seen)
			pthread_cond_wait(&p->start, &p->lock);
		if (p->stop)
			break;
		seen = p->gen;
		pthread_mutex_unlock(&p->lock);
		run_tasks(p, wa.id);
		pthread_mutex_lock(&p->lock);
		if (--p->busy == 0)
			pthread_cond_signal(&p->done);
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

int mlens_pool_create(struct mlens_pool **out, int n_threads, const int *cpus)
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
	p->threads = calloc((size_t)n_threads, sizeof(pthread_t));
	if (!p->threads) {
		free(p);
		return -ENOMEM;
	}
	pthread_mutex_init(&p->lock, NULL);
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
	rc = mlens_pool_create(out, n_threads, cpus);
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
	p->stop = 1;
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
	pthread_mutex_lock(&p->lock);
	p->fn = fn;
	p->arg = arg;
	p->n_tasks = n_tasks;
	atomic_store_explicit(&p->next, 0, memory_order_relaxed);
	p->busy = p->n - 1;
	p->gen++;
	pthread_cond_broadcast(&p->start);
	pthread_mutex_unlock(&p->lock);

	run_tasks(p, 0);

	pthread_mutex_lock(&p->lock);
	while (p->busy > 0)
		pthread_cond_wait(&p->done, &p->lock);
	pthread_mutex_unlock(&p->lock);
}
