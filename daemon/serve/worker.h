/* The worker thread: owns the scheduler, the engine and every attached
 * tenant. Between steps it takes commands from the main thread, reads the
 * tenants' submission rings and delivers completions; with nothing to do it
 * sleeps on the tenants' doorbells (needs-wake-up protocol) and its command
 * eventfd. The main thread never touches a tenant after handing it over;
 * it reads a snapshot of the statistics under the snapshot lock. */
#ifndef MLENS_WORKER_H
#define MLENS_WORKER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include "daemon/serve/sched.h"
#include "daemon/serve/tenant.h"

struct mlens_worker;

struct mlens_tenant_info {
	uint32_t id;
	uid_t uid;
	gid_t gid;
	pid_t pid;
	char name[48];
	struct mlens_quota quota;
	uint32_t running, queued, kv_blocks;
	uint64_t prompt_tokens, generated_tokens, requests_done, requests_failed;
	uint64_t preemptions, bad_entries, refused;
};

struct mlens_worker_snapshot {
	struct mlens_sched_stats sched;
	uint32_t kv_blocks_total, kv_blocks_used;
	uint64_t kv_room_taken;		/* growth-room blocks others took, total */
	int token_cap;
	bool admission;
	bool draining;
	int n_tenants;
	struct mlens_tenant_info *tenants;	/* malloc'd copy; caller frees */
	uint64_t tenants_attached_total, tenants_detached_total;
	uint64_t bad_entries_total;
};

int mlens_worker_start(struct mlens_worker **out, struct mlens_sched *s, int notify_fd);
/* Stop and join; tenants still attached are destroyed. */
void mlens_worker_stop(struct mlens_worker *w);

/* Main thread. Each takes effect at the next step boundary; the calls that
 * answer wait for the worker to get there, and once they return the
 * snapshot shows what they changed. */
void mlens_worker_attach(struct mlens_worker *w, struct mlens_tenant *t);
void mlens_worker_detach(struct mlens_worker *w, uint32_t tenant_id);
int mlens_worker_set_quota(struct mlens_worker *w, uint32_t tenant_id, const struct mlens_quota *q);
int mlens_worker_evict(struct mlens_worker *w, uint32_t tenant_id);
void mlens_worker_set_admission(struct mlens_worker *w, bool open);
/* Begin draining: no new requests; running ones get until deadline
 * (CLOCK_MONOTONIC seconds), then are cancelled. The worker writes to
 * notify_fd when it is drained (idle with admission closed). */
void mlens_worker_drain(struct mlens_worker *w, double deadline);
void mlens_worker_snapshot(struct mlens_worker *w, struct mlens_worker_snapshot *snap);
/* Run fn(arg, scheduler) on the worker thread between two steps (it owns
 * the scheduler and drives the engine's backend); steps pause while fn
 * runs (the profiler). The caller does not wait: fn tells it itself when
 * it is done (its return value is dropped). -ENOMEM when it cannot be
 * queued. A call queued before mlens_worker_stop runs before the worker
 * exits. */
typedef int (*mlens_worker_fn)(void *arg, struct mlens_sched *s);
int mlens_worker_call_async(struct mlens_worker *w, mlens_worker_fn fn, void *arg);

double mlens_now(void);

#endif
