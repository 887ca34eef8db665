/* A persistent pool of worker threads for data-parallel CPU work. The caller
 * of mlens_pool_run takes part in the work and returns when every task is
 * done. Tasks are claimed in index order from one atomic counter; a task's
 * result must not depend on which thread ran it. */
#ifndef MLENS_POOL_H
#define MLENS_POOL_H

struct mlens_pool;

/* task: index in [0, n_tasks); thread: in [0, mlens_pool_size()) */
typedef void (*mlens_pool_fn)(void *arg, int task, int thread);

/* n_threads counts the caller; 0 means one per online CPU. cpus, when not
 * NULL, lists n_threads CPUs to pin to (cpus[0] is the caller's, not pinned). */
int mlens_pool_create(struct mlens_pool **out, int n_threads, const int *cpus);
/* Workers pinned to the CPUs of NUMA node `node` that this process may run
 * on, skipping the first n_reserved of them (kept for the movers and the
 * main loop). n_threads <= 0: one per remaining CPU (at least 1). With more
 * threads than CPUs, CPUs are reused in turn. Without NUMA support (or node
 * < 0) the workers are not pinned. 0, -EINVAL (no such node or no CPU of it
 * allowed), -ENOMEM, or pthread's error. */
int mlens_pool_create_numa(struct mlens_pool **out, int node, int n_threads, int n_reserved);
void mlens_pool_destroy(struct mlens_pool *p);
int mlens_pool_size(const struct mlens_pool *p);
/* Not reentrant: one run at a time per pool (callers serialise). */
void mlens_pool_run(struct mlens_pool *p, int n_tasks, mlens_pool_fn fn, void *arg);

#endif
