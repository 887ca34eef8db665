/* Monitoring: the stats socket (one JSON object per connection) and the
 * HTTP listener on loopback (Prometheus text at /metrics, /health). Both
 * read the worker's snapshot on the main thread; neither changes anything. */
#ifndef MLENS_STATS_H
#define MLENS_STATS_H

#include <event2/event.h>
#include <jansson.h>
#include <stdint.h>
#include <sys/types.h>
#include "daemon/config.h"
#include "daemon/serve/server.h"
#include "daemon/serve/worker.h"

struct mlens_profile_state;

/* What the daemon knows of itself, for status and stats (main thread). */
struct mlens_daemon_info {
	const struct mlens_config *cfg;
	struct mlens_worker *worker;
	struct mlens_server *server;
	const char *backend;		/* the backend's name: "cpu", "cuda" */
	const char *model_dtype;
	/* the experts as the daemon holds and streams them: their dtype
	 * (F8_E4M3 when quantized at load) and one expert's bytes with
	 * its scales (mlens_model_expert_bytes) */
	const char *expert_dtype;
	uint64_t expert_bytes;
	int64_t n_layers, n_experts, top_k;
	const int32_t *eos;		/* the model's EOS token ids, n_eos of them */
	int n_eos;
	uint64_t weight_bytes;		/* pinned weight pages */
	uint64_t kv_bytes;		/* pinned KV pool (K and V) */
	uint64_t staging_bytes;		/* a step's host activations (host_plan.h) */
	int kv_block_size;
	const char *kv_dtype;		/* the KV cache's element type: "BF16", "F8_E4M3" */
	/* the GPU budget the daemon plans with (the GPU memory plan's
	 * effective one: gpu_memory, or the free memory less the margin when
	 * it is 0); has_gpu_budget false: a host-memory backend, no GPU plan */
	uint64_t gpu_budget;
	bool has_gpu_budget;
	double started;			/* mlens_now() at start-up */
	const char *mode;		/* "gpu-only", "hybrid", or NULL: the backend's name says it */
	const char *mode_reason;	/* why, with the numbers (NULL: derived from the backend) */
	char stats_http_addr[80];	/* filled by mlens_stats_start: "127.0.0.1:PORT" */
	struct mlens_profile_state *profile;	/* the profiler's results (NULL: no profiler) */
	struct mlens_disk_tier *disk;	/* experts left in the model files (NULL: none) */
};

struct mlens_stats;
struct mlens_disk_tier;

/* Bind the stats socket at cfg->stats ("" = none) and the HTTP listener's
 * port (cfg->stats_http) before the model loads: a bad path or a port in
 * use is refused at once. 0 or -errno with err set. */
int mlens_stats_bind(struct mlens_stats **out, const struct mlens_config *cfg, char *err, size_t errlen);
/* Serve the stats socket (to the daemon's user, root and control_group)
 * and cfg->stats_http ("127.0.0.1:PORT"; "" = none; port 0 picks a free
 * one, written back to info->stats_http_addr). Refuses addresses other
 * than loopback. */
int mlens_stats_start(struct mlens_stats *s, struct event_base *base, struct mlens_daemon_info *info,
		      char *err, size_t errlen);
/* Check stats_http (loopback only) and control_group (exists) before the
 * model loads, so that a typo costs no loading time. 0 or -EINVAL. */
int mlens_stats_check_config(const struct mlens_config *c, char *err, size_t errlen);
/* Close both listeners and unlink the socket file. */
void mlens_stats_destroy(struct mlens_stats *s);

/* Every counter and gauge as one JSON object (the stats socket and
 * mlensctl stats). snap from mlens_worker_snapshot. */
json_t *mlens_stats_json(const struct mlens_daemon_info *info, const struct mlens_worker_snapshot *snap);
/* Prometheus text exposition of the same, appended to buf. */
struct evbuffer;
void mlens_stats_prometheus(const struct mlens_daemon_info *info, const struct mlens_worker_snapshot *snap,
			    struct evbuffer *buf);

/* One tenant as JSON (stats and mlensctl tenants); NULL when out of memory. */
json_t *mlens_tenant_json(const struct mlens_tenant_info *t);
/* Append it to array a; a tenant that cannot be is logged, not skipped
 * silently. 0 or -ENOMEM. */
int mlens_tenant_json_append(json_t *a, const struct mlens_tenant_info *t);

#endif
