/* mlensd: the resident daemon. Start-up steps (config, log, sockets bound,
 * fork, model, backend, KV cache, engine and scheduler, worker, sockets
 * listening), then the libevent loop on the main thread until
 * SIGTERM/SIGINT drains it; one teardown for every way out. */
#include <errno.h>
#include <event2/event.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>
#include "daemon/config.h"
#include "daemon/ops/control.h"
#include "daemon/exec/engine.h"
#include "daemon/exec/kv_swap.h"
#include "daemon/plan/gpu_plan.h"
#include "daemon/plan/host_plan.h"
#include "daemon/model/disk_tier.h"
#include "daemon/exec/pipeline.h"
#include "daemon/plan/profiler.h"
#include "daemon/log.h"
#include "daemon/mem.h"
#include "daemon/serve/sched.h"
#include "daemon/serve/server.h"
#include "daemon/ops/stats.h"
#include "daemon/model/weights.h"
#include "daemon/model/quant.h"
#include "daemon/serve/worker.h"
#include "kernels/cpu/attn.h"

struct daemon {
	struct mlens_config cfg;
	struct event_base *base;
	struct mlens_model *model;
	struct mlens_weights weights;
	struct mlens_backend be;
	struct mlens_backend attn;	/* hybrid mode: decode attention, KV pool */
	bool weights_registered;	/* host_register'ed with the backend */
	bool hybrid;
	struct mlens_pinned kv_k, kv_v;
	struct mlens_kv_swap *swap;	/* kv_swap > 0 and a KV pool in host memory */
	struct mlens_engine *engine;
	struct mlens_sched *sched;
	struct mlens_worker *worker;
	struct mlens_server *server;
	int notify_fd;		/* the worker says: drained */
	struct event *ev_notify, *ev_term, *ev_int, *ev_hup;
	struct event *ev_follow;	/* workload_follow's timer */
	struct mlens_workload_window follow;
	bool draining;
	int ready_fd;		/* daemon mode: tell the waiting parent */
	double started;
	/* operating: control and stats sockets (daemon/ops/control.c, daemon/ops/stats.c) */
	struct mlens_daemon_info info;
	struct mlens_control *control;
	struct mlens_stats *stats;
	/* the GPU memory plan, made once at start-up and handed to the
	 * engine (daemon/plan/gpu_plan.h); none with a host-memory backend */
	struct mlens_gpu_plan plan;
	struct mlens_perf_model pm;	/* the model's byte counts the plan used */
	struct mlens_profile_state prof;	/* the profiler's last results (daemon/plan/profiler.c) */
	char mode_reason[512];
	/* what the start-up steps hand on */
	struct mlens_backend_opts bo;
	struct mlens_engine_opts eo;
	uint64_t staging;		/* the host plan's staging bytes */
	int node;			/* NUMA node of the weights and KV cache */
	enum mlens_dtype kv_dt;
	uint32_t kv_blocks;
	size_t kv_per_block;
	bool log_open, pid_written;
};

static struct daemon D;

/* ==== following the traffic (workload_follow) ==== */

/* the cap travels in the pointer: nothing to allocate or free */
static int set_cap_on_worker(void *arg, struct mlens_sched *s)
{
	mlens_sched_set_token_cap(s, (int)(intptr_t)arg);
	return 0;
}

/* Every workload_follow seconds: when the requests finished since the last
 * window moved the mean lengths by more than 10%, predict for them from
 * the profile held, and set the cap from that n_real (unless pinned). */
static void on_follow(evutil_socket_t fd, short what, void *arg)
{
	struct mlens_worker_snapshot snap;
	double p, g, old_p = D.prof.w.p, old_g = D.prof.w.g;
	int old_cap = D.prof.token_cap;
	(void)fd;
	(void)what;
	(void)arg;
	if (!D.prof.have || D.draining)
		return;
	mlens_worker_snapshot(D.worker, &snap);
	free(snap.tenants);
	if (!mlens_workload_follow(&D.follow, snap.sched.done_prompt_tokens, snap.sched.done_generated_tokens,
				   snap.sched.requests_done, old_p, old_g, &p, &g))
		return;
	if (mlens_profile_state_predict(&D.prof, p, g)) {
		/* the held prediction stays as it was */
		log_warn("workload from the traffic: p=%.0f g=%.0f: no prediction (%s); the cap stays %d",
			 p, g, D.prof.err[0] ? D.prof.err : "?", old_cap);
		return;
	}
	if (D.prof.pinned_cap <= 0) {
		int cap = mlens_sched_cap_for(D.sched, mlens_perf_token_cap(&D.prof.pred));
		if (!mlens_worker_call_async(D.worker, set_cap_on_worker, (void *)(intptr_t)cap))
			D.prof.token_cap = cap;
	}
	log_info("workload from the traffic: p=%.0f g=%.0f (was %.0f/%.0f): n_real %.0f (%s), %s binds, "
		 "predicted %.1f tokens/s; step cap %d (was %d%s)", p, g, old_p, old_g, D.prof.pred.n_real,
		 mlens_perf_limit_name(D.prof.pred.limit), mlens_perf_tier_name(&D.prof.hw, D.prof.pred.time.bind),
		 D.prof.pred.total_tok_s, D.prof.token_cap, old_cap,
		 D.prof.pinned_cap > 0 ? ", pinned by max_step_tokens" : "");
}

/* ==== start-up ==== */

/* In daemon mode the parent waits for the child's first line on a pipe:
 * "ok" or an error message, so that start-up errors reach the terminal.
 * The daemon keeps none of the terminal's descriptors: a pipe it was
 * started into (mlensd | cat) ends when the parent exits. */
static int daemonize(void)
{
	int p[2];
	pid_t pid;
	if (pipe(p))
		return -errno;
	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid > 0) {
		char buf[1024];
		ssize_t n;
		close(p[1]);
		n = read(p[0], buf, sizeof(buf) - 1);
		if (n > 0 && !strncmp(buf, "ok", 2))
			_exit(0);
		if (n > 0) {
			buf[n] = 0;
			fprintf(stderr, "mlensd: %s\n", buf);
		} else {
			fprintf(stderr, "mlensd: the daemon exited during start-up\n");
		}
		_exit(1);
	}
	close(p[0]);
	setsid();
	if (fork() > 0)
		_exit(0);	/* the grandchild cannot reacquire a terminal */
	{
		int fd = open("/dev/null", O_RDWR);
		if (fd >= 0) {
			dup2(fd, 0);
			dup2(fd, 1);
			dup2(fd, 2);
			if (fd > 2)
				close(fd);
		}
	}
	return p[1];
}

/* What a new user asks first: where generation stops, how much to send. */
static void log_eos_and_room(const struct mlens_model_config *c, const struct mlens_region_limits *l)
{
	char ids[MLENS_MODEL_MAX_EOS * 12 + 8] = "none (generation runs to max_tokens)";
	size_t n = 0;

	for (int i = 0; i < c->n_eos; i++)
		n += (size_t)snprintf(ids + n, sizeof(ids) - n, "%s%d", i ? ", " : "", c->eos[i]);
	log_info("EOS token ids: %s; a tenant runs up to %u sequences at once and queues %u more",
		 ids, l->max_running, l->max_queued);
}

/* How much of a pinned area (two: the KV cache's K and V) the kernel backs
 * with huge pages: the CPU attention reads the KV cache at a rate that
 * 4 KiB pages cost TLB misses in. Under half of an area of 64 MiB or
 * more: a warning naming the setting (a smaller one may not span a
 * 2 MiB page at all). */
#define HUGE_WARN_BYTES (64ull << 20)
static void log_huge_pages(const struct mlens_pinned *a, const struct mlens_pinned *b,
			   const char *what)
{
	size_t ha = 0, hb = 0, total = a->size + (b ? b->size : 0);
	int rc = mlens_huge_bytes(NULL, a->p, a->size, &ha);
	if (!rc && b)
		rc = mlens_huge_bytes(NULL, b->p, b->size, &hb);
	if (rc || !total) {
		log_info("%s: huge pages not known (%s)", what, rc ? strerror(-rc) : "empty");
		return;
	}
	if (2 * (ha + hb) < total && total >= HUGE_WARN_BYTES)
		log_warn("%s: %.0f of %.0f MiB (%.0f%%) in huge pages: the rest costs TLB misses "
			 "(/sys/kernel/mm/transparent_hugepage/enabled must say always or madvise, "
			 "and free memory must not be too fragmented)", what, (ha + hb) / 1048576.0,
			 total / 1048576.0, 100.0 * (ha + hb) / total);
	else
		log_info("%s: %.0f of %.0f MiB (%.0f%%) in huge pages", what, (ha + hb) / 1048576.0,
			 total / 1048576.0, 100.0 * (ha + hb) / total);
}

static int fail_start(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail_start(const char *fmt, ...)
{
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	/* in daemon mode the log is a file or syslog (stderr is /dev/null),
	 * and the waiting parent prints it on the terminal */
	log_error("%s", msg);
	if (D.ready_fd >= 0) {
		if (write(D.ready_fd, msg, strlen(msg)) < 0) {
			/* the parent is gone: nothing more to tell */
		}
	} else if (strcmp(D.cfg.log, "stderr")) {
		fprintf(stderr, "mlensd: %s\n", msg);
	}
	return 1;
}

static int write_pid_file(const char *path)
{
	char buf[32];
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	int n = snprintf(buf, sizeof(buf), "%d\n", (int)getpid());
	if (fd < 0)
		return -errno;
	if (write(fd, buf, (size_t)n) != n) {
		close(fd);
		return -EIO;
	}
	close(fd);
	return 0;
}

/* ==== signals and shutdown ==== */

static void begin_drain(const char *why)
{
	if (D.draining)
		return;
	D.draining = true;
	log_info("%s: draining (no new requests; running ones get %lld s)", why,
		 (long long)D.cfg.drain_timeout);
	mlens_server_stop_listening(D.server);
	mlens_worker_drain(D.worker, mlens_now() + (double)D.cfg.drain_timeout);
}

/* mlensctl shutdown: what SIGTERM does */
static void on_control_shutdown(void *arg)
{
	(void)arg;
	begin_drain("mlensctl shutdown");
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
	if (sig == SIGHUP) {
		int rc = mlens_log_reopen();
		log_info("SIGHUP: log reopened%s%s", rc ? ": " : "", rc ? strerror(-rc) : "");
		return;
	}
	if (D.draining) {
		log_warn("second %s: exiting now", strsignal((int)sig));
		event_base_loopbreak(D.base);
		return;
	}
	begin_drain(strsignal((int)sig));
}

static void on_drained(evutil_socket_t fd, short what, void *arg)
{
	uint64_t v;
	if (read(fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
		log_warn("notify eventfd: %s", strerror(errno));
	if (D.draining) {
		log_info("drained: exiting");
		event_base_loopbreak(D.base);
	}
}

/* ==== main ==== */

static uint32_t kv_blocks_for(const struct mlens_model_config *c, enum mlens_dtype dt, int bs,
			      uint64_t bytes, size_t *per_block)
{
	struct mlens_kv_cache one;
	mlens_kv_layout(&one, c, (int)dt, bs, 1, NULL, 0);
	*per_block = mlens_kv_bytes(&one);
	uint64_t n = bytes / (2 * *per_block);
	return n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}

/* The token cap asked for: the configured one, else 4096, or in hybrid
 * mode the most the GPU memory plan may hold (the plan lowers it to what
 * the budget fits; more tokens per pass over the streamed weights is the
 * whole point of that mode, DESIGN §1). */
#define MLENS_HYBRID_MAX_TOKENS 65536
static int step_cap_wanted(void)
{
	if (D.cfg.max_step_tokens > 0)
		return (int)D.cfg.max_step_tokens;
	return D.hybrid ? MLENS_HYBRID_MAX_TOKENS : 4096;
}

/* The hybrid pipeline's token group setting: group_tokens, or the plan's
 * choice for 0 (gpu_plan.h). */
static int64_t plan_group(void)
{
	return D.cfg.group_tokens > 0 ? D.cfg.group_tokens : MLENS_GPU_PLAN_GROUP_AUTO;
}

/* gpu_copy_out = down or side: GA's copies to the host on a queue of their
 * own (the config allows only compute, down or side). */
static bool side_copy_out(void)
{
	return strcmp(D.cfg.gpu_copy_out, "compute") != 0;
}

/* gpu_copy_out = side: the CPU attention's output up on a queue of its own too */
static bool up_copy_in(void)
{
	return !strcmp(D.cfg.gpu_copy_out, "side");
}

/* attn_up = half (the config allows only half or fp32); the pipeline takes
 * it where the GPU backend's O projection rounds its input anyway. */
static bool att_up_half(void)
{
	return !strcmp(D.cfg.attn_up, "half");
}

/* kv_append = gpu (the config allows only gpu or cpu). */
static bool gpu_kv_append(void)
{
	return !strcmp(D.cfg.kv_append, "gpu");
}

/* Whether the model's experts multiply on the GPU's fp8 tensor cores
 * (the backend's choice for per-channel scales; block scales are
 * dequantized), which the GPU memory plan sizes the MoE scratch for. */
static bool experts_fp8_tc(void)
{
	return D.model->cfg.expert_dtype == MLENS_DTYPE_E4M3 &&
	       D.model->cfg.expert_scale.kind != MLENS_WSCALE_BLOCK && D.be.ops->fp8_tc &&
	       D.be.ops->fp8_tc(D.be.ctx);
}

/* The hybrid plan's cap on resident experts (resident_experts; -1: none). */
static void resident_cap(struct mlens_gpu_plan_in *in)
{
	in->cap_resident = D.cfg.resident_experts >= 0;
	in->max_resident = (int)D.cfg.resident_experts;
}

/* The profiler's view of this daemon: its backends, the model's byte
 * counts, the GPU budget the model may plan with, the KV capacity and
 * whether the cap is pinned; the cache key. */
static void profile_setup(uint32_t blocks, size_t per_block, enum mlens_dtype kv_dt,
			  const struct mlens_backend_opts *bo)
{
	struct mlens_profile_state *st = &D.prof;
	char gpu[96], bk[128];
	st->model = D.model;
	st->opts.be = &D.be;
	st->opts.attn = D.hybrid ? &D.attn : NULL;
	st->opts.n_threads = (int)D.cfg.threads;
	st->opts.kv_dtype = kv_dt;
	st->opts.kv_block_size = (int)D.cfg.kv_block_size;
	/* the fit extrapolates: a layer with 32768 tokens of activations is
	 * enough to find the line and stays a few GiB */
	st->opts.max_tokens = step_cap_wanted() < 32768 ? step_cap_wanted() : 32768;
	st->opts.budget_s = D.be.ops->host_memory ? 0.5 : 20;
	mlens_perf_model_from_config(&st->pm, &D.model->cfg, kv_dt);
	st->pm.expert_fp8_tc = experts_fp8_tc();
	st->hybrid = D.hybrid;
	/* in hybrid mode the pipeline holds the GPU budget to the byte: the
	 * profile's scratch must not stay in its backend */
	st->own_backend = D.hybrid;
	st->own_opts = *bo;
	/* time GA and GB as the pipeline runs them: groups, MoE chunks */
	/* with the group left to the plan, the profile times the default one */
	st->opts.group = !D.hybrid ? 0 : D.cfg.group_tokens > 0 ? D.cfg.group_tokens : MLENS_GPU_PLAN_GROUP;
	st->opts.moe_chunk = D.hybrid ? MLENS_GPU_PLAN_CHUNK : 0;
	if (D.be.ops->host_memory) {
		/* the CPU backend: activations may take the host memory the KV
		 * pool leaves */
		long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
		uint64_t phys = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz : 0;
		uint64_t kv = 2ull * blocks * per_block;
		st->gpu_budget = phys > kv ? phys - kv : 0;
	} else {
		/* GPU-only mode keeps the KV pool on the GPU too */
		st->gpu_budget = D.plan.budget > D.plan.kv ? D.plan.budget - D.plan.kv : 0;
		st->gpu_workspace = mlens_gpu_plan_workspace(bo->moe_streams);
	}
	st->chunk = D.hybrid ? MLENS_GPU_PLAN_CHUNK : 0;
	st->plan_in.group = D.hybrid ? plan_group() : 0;
	st->plan_in.gemm = bo->gemm;
	st->plan_in.sets = (int)D.cfg.pipeline_sets;
	if (D.hybrid)
		resident_cap(&st->plan_in);
	st->side_copy_out = D.hybrid && side_copy_out();
	st->up_copy_in = D.hybrid && up_copy_in();
	st->gpu_kv_append = D.hybrid && gpu_kv_append();
	st->att_up_half = D.hybrid && att_up_half() && mlens_pipeline_half_att(&D.be, &D.attn, &D.model->cfg);
	st->kv_tokens = (double)blocks * (double)D.cfg.kv_block_size;
	st->pinned_cap = (int)D.cfg.max_step_tokens;
	st->cache_path = D.cfg.profile_cache;
	mlens_profile_gpu_name(&D.be, gpu, sizeof(gpu));
	/* a GPU backend's numerics change its rates: a cache measured with
	 * other GEMM or attention kernels is stale */
	if (D.be.ops->host_memory)
		snprintf(bk, sizeof(bk), "%s", D.be.ops->name);
	else
		snprintf(bk, sizeof(bk),
			 "%s gemm=%s prefill=%s moe_streams=%d moe_grouped=%s sync=%s threads=%d",
			 D.be.ops->name, mlens_gemm_mode_name(bo->gemm), bo->prefill_bf16 ? "bf16" : "fp32",
			 bo->moe_streams, mlens_moe_grouped_name(bo->moe_grouped),
			 mlens_gpu_sync_name(bo->sync), bo->n_threads);
	mlens_profile_key_make(&st->key, D.model, bk, gpu, D.be.ops->host_memory ? NULL : &D.plan,
			       st->opts.budget_s);
	st->key.group = st->opts.group;
	st->key.moe_chunk = st->opts.moe_chunk;
}

static void profile_log(const struct mlens_profile_state *st)
{
	const struct mlens_profile *p = &st->prof;
	log_info("profile%s: GA %.3g + %.3g n s, GB %.3g + %.3g n s per layer; GEMM %.1f TFLOP/s, prefill "
		 "attention %.1f TFLOP/s; H2D %.1f GB/s, D2H %.1f GB/s, on the compute queue %.1f / %.1f GB/s; "
		 "GPU K/V stores into host memory %.1f GB/s (side queue %.1f); "
		 "CPU attention %.1f GB/s (%.1f under copy), KV append %.1f GB/s, memory read %.1f GB/s, "
		 "with DMA %.1f GB/s (%.2f s)",
		 st->from_cache ? " (cached)" : "", p->ga.a, p->ga.b, p->gb.a, p->gb.b, p->gemm_flops / 1e12,
		 p->attn_prefill_flops / 1e12, p->h2d / 1e9, p->d2h / 1e9, p->act_h2d / 1e9, p->act_d2h / 1e9,
		 p->kv_store_bw / 1e9, p->kv_store_side_bw / 1e9, p->attn_bw / 1e9, p->attn_copy_bw / 1e9, p->append_bw / 1e9, p->mem_read_bw / 1e9,
		 p->mem_bw / 1e9, p->seconds);
	log_info("profile: n_real %.0f (%s), %d resident experts per layer, %s binds; predicted %.1f tokens/s "
		 "for %.0f/%.0f-token requests", st->pred.n_real, mlens_perf_limit_name(st->pred.limit),
		 st->pred.policy.resident_experts, mlens_perf_tier_name(&st->hw, st->pred.time.bind), st->pred.total_tok_s,
		 st->w.p, st->w.g);
}

/* ==== start-up steps ====
 * Each returns 0, or the exit status with the reason said (fail_start once
 * the log is open); main unwinds whatever was set up, in one place. */

/* Flags and the config file, checked before anything is opened: 0 to go
 * on, or -1 - status to exit with (0 for --help, 2 for a bad setting). */
static int step_config(int argc, char **argv)
{
	char err[1024];
	int rc;

	mlens_config_defaults(&D.cfg);
	rc = mlens_config_parse_args(&D.cfg, argc, argv, err, sizeof(err));
	if (rc == 1)
		return -1;
	if (rc) {
		fprintf(stderr, "mlensd: %s\n", err);
		return -1 - 2;
	}
	if (D.cfg.config && D.cfg.config[0]) {
		rc = mlens_config_load_file(&D.cfg, D.cfg.config, err, sizeof(err));
		if (rc) {
			fprintf(stderr, "mlensd: %s\n", err);
			return -1 - 2;
		}
	}
	if (mlens_config_finish(&D.cfg))
		return -1 - 1;
	if (!D.cfg.model || !D.cfg.model[0]) {
		fprintf(stderr, "mlensd: no model: give --model DIR (or model = DIR in the config file)\n");
		return -1 - 2;
	}
	/* the enumerated keys (log_level, backend, gpu_gemm, gpu_copy,
	 * gpu_copy_out, gpu_prefill_attention, kv_append, attn_up, gpu_sync,
	 * gpu_moe_grouped, attn_kernel) were checked against their choices when read
	 * (config.c, T_ENUM) */
	if (strcmp(D.cfg.attn_kernel, "auto") && mlens_cpu_attn_set_variant(D.cfg.attn_kernel)) {
		fprintf(stderr, "mlensd: attn_kernel '%s' is not supported by this CPU\n",
			D.cfg.attn_kernel);
		return -1 - 2;
	}
	if (D.cfg.n_gpus > 1) {
		/* the split over several GPUs is planned and modelled
		 * (daemon/plan/shard.h, perfmodel.h) but this daemon drives one GPU:
		 * say so rather than serve on the first one alone */
		fprintf(stderr, "mlensd: gpus = %s lists %d GPUs, but this mlensd serves on one GPU only; "
			"list one GPU (e.g. gpus = %d), or run one mlensd per GPU\n",
			D.cfg.gpus, D.cfg.n_gpus, D.cfg.gpu_ids[0]);
		return -1 - 2;
	}
	if (mlens_stats_check_config(&D.cfg, err, sizeof(err))) {
		fprintf(stderr, "mlensd: %s\n", err);
		return -1 - 2;
	}
	return 0;
}

/* libevent's own warnings (an accept that fails, a bad request) into the
 * daemon's log, at a bounded rate: a peer can provoke them. */
static void on_libevent_log(int severity, const char *msg)
{
	static struct mlens_log_limit lim = MLENS_LOG_LIMIT_INIT(10, 10.0);
	enum mlens_log_level level = severity >= EVENT_LOG_ERR ? MLENS_LOG_ERROR
				     : severity == EVENT_LOG_WARN ? MLENS_LOG_WARN
				     : severity == EVENT_LOG_MSG ? MLENS_LOG_INFO : MLENS_LOG_DEBUG;
	mlens_log_limited(&lim, level, "libevent: %s", msg);
}

/* The log; in daemon mode stderr goes to /dev/null at the fork, so a log
 * on stderr becomes syslog there. */
static int step_log(void)
{
	const char *target = D.cfg.log;
	int rc;
	if (!D.cfg.foreground && !strcmp(target, "stderr"))
		target = "syslog";
	rc = mlens_log_open(target, (enum mlens_log_level)mlens_log_parse_level(D.cfg.log_level));
	if (rc) {
		fprintf(stderr, "mlensd: cannot open log %s: %s\n", D.cfg.log, strerror(-rc));
		return 1;
	}
	D.log_open = true;
	event_set_log_callback(on_libevent_log);
	return 0;
}

/* The three sockets, bound before anything loads: a missing directory, a
 * daemon already there or a file in the way costs no loading time. They
 * listen once the daemon can answer. */
static int step_bind(void)
{
	char err[1024];
	if (mlens_server_bind(&D.server, D.cfg.socket, err, sizeof(err)) ||
	    mlens_stats_bind(&D.stats, &D.cfg, err, sizeof(err)) ||
	    mlens_control_bind(&D.control, &D.cfg, err, sizeof(err))) {
		/* before the fork: the terminal hears it */
		fprintf(stderr, "mlensd: %s\n", err);
		if (strcmp(D.cfg.log, "stderr"))
			log_error("%s", err);
		return 1;
	}
	return 0;
}

static int step_daemonize(void)
{
	if (D.cfg.foreground)
		return 0;
	D.ready_fd = daemonize();
	if (D.ready_fd < 0) {
		fprintf(stderr, "mlensd: cannot daemonize: %s\n", strerror(-D.ready_fd));
		D.ready_fd = -1;
		return 1;
	}
	return 0;
}

static int kv_dtype_wanted(void);

/* Experts of each MoE layer to leave in the model files so that
 * host_memory holds the weight pages, the disk tier's staging, the step's
 * staging and the least KV pool (weights_on_disk = auto), or the whole
 * kv_cache (kv-first: a larger batch for the disk reads); 0 when the
 * files fit or the key is never (the host plan refuses then). Before the
 * backend runs the mode is not known: the CPU backend's staging, else
 * the hybrid pipeline's. -ENOSPC (said) when the files do not fit and
 * even every expert on disk does not either. */
static int disk_experts_for(uint64_t files, int *out)
{
	const struct mlens_model_config *c = &D.model->cfg;
	bool host = !strcmp(D.cfg.backend, "cpu") || (!strcmp(D.cfg.backend, "auto") && !mlens_cuda_available());
	bool hybrid = D.hybrid;
	uint64_t staging, kv_min, budget = D.cfg.host_memory;
	size_t per = 0;
	struct mlens_weights_split sp = { 0 };
	char err[1024];
	int E = (int)c->num_local_experts, rc;

	*out = 0;
	D.hybrid = !host;	/* step_cap_wanted reads the mode */
	staging = mlens_host_plan_staging(c, !host, host, step_cap_wanted(), !host ? plan_group() : 0,
					  (int)D.cfg.pipeline_sets);
	uint64_t kv_blocks = kv_blocks_for(c, mlens_kv_dtype(c, kv_dtype_wanted()), (int)D.cfg.kv_block_size,
					   D.cfg.kv_cache, &per);
	kv_min = mlens_host_plan_kv_min(c, step_cap_wanted(), (int)D.cfg.kv_block_size, 2ull * per);
	D.hybrid = hybrid;
	if (!strcmp(D.cfg.weights_on_disk, "kv-first") && kv_blocks * 2ull * per > kv_min)
		kv_min = kv_blocks * 2ull * per;	/* the pool the plan then gives kv_cache */
	if (files + staging + kv_min <= budget || !strcmp(D.cfg.weights_on_disk, "never") || E <= 0)
		return 0;
	for (int d = 1; d <= E; d++) {
		if ((rc = mlens_weights_split(D.model, d, &sp, err, sizeof(err))))
			return fail_start("%s", err);
		if (sp.pages + sp.staging + staging + kv_min <= budget) {
			*out = d;
			return 0;
		}
	}
	if (files <= budget)
		return 0;	/* the disk cannot help: the host plan says what is short */
	return fail_start("host_memory of %.1f MiB cannot run this model even with every expert on disk: weight "
			  "pages %.1f MiB + disk staging %.1f MiB + staging %.1f MiB + the least KV pool %.1f MiB need "
			  "%.1f MiB; raise host_memory to at least that, or lower max_step_tokens",
			  budget / 1048576.0, sp.pages / 1048576.0, sp.staging / 1048576.0, staging / 1048576.0,
			  kv_min / 1048576.0, (sp.pages + sp.staging + staging + kv_min) / 1048576.0);
}

/* The model and its weight pages, on the NUMA node the GPU hangs off;
 * experts that host_memory has no room for stay on disk. */
static int step_model(void)
{
	char err[1024];
	int rc, disk_experts = 0;

	D.started = mlens_now();
	rc = mlens_model_open(D.cfg.model, &D.model, err, sizeof(err));
	if (rc)
		return fail_start("%s", err);
	if (D.cfg.resident_experts > D.model->cfg.num_local_experts)
		return fail_start("resident_experts = %lld is more than the %lld experts a layer of model %s; "
				  "set it to at most %lld, or -1 for as many as gpu_memory holds",
				  (long long)D.cfg.resident_experts, (long long)D.model->cfg.num_local_experts,
				  D.cfg.model, (long long)D.model->cfg.num_local_experts);
	D.node = mlens_numa_pick((int)D.cfg.numa_node, D.cfg.gpu_ids[0], err, sizeof(err));
	if (D.node < -1)
		return fail_start("%s", err);
	if (D.cfg.host_memory) {
		/* before minutes of reading: the weight pages alone must fit,
		 * or (weights_on_disk = auto) what stays of them */
		uint64_t files = 0;
		for (int i = 0; i < D.model->n_files; i++)
			files += D.model->files[i].size;
		if ((rc = disk_experts_for(files, &disk_experts)))
			return rc;
		if (!disk_experts && files > D.cfg.host_memory)
			return fail_start("host_memory of %.1f MiB is below the weight pages alone (%.1f MiB, the model "
					  "files); raise host_memory above that, with room for the KV pool and staging%s",
					  D.cfg.host_memory / 1048576.0, files / 1048576.0,
					  !strcmp(D.cfg.weights_on_disk, "never") ? ", or set weights_on_disk = auto" : "");
		if (disk_experts && !strcmp(D.cfg.weight_dtype, "fp8"))
			return fail_start("weight_dtype = fp8 quantizes the experts from the weight pages, but host_memory "
					  "of %.1f MiB leaves %d experts a layer on disk; raise host_memory or set "
					  "weight_dtype = auto", D.cfg.host_memory / 1048576.0, disk_experts);
	}
	{
		struct mlens_weights_opts wo = { D.node, D.cfg.mlock, (int)D.cfg.movers, D.cfg.io_uring, 0, 0,
						 disk_experts };
		rc = mlens_weights_load(D.model, &wo, &D.weights, err, sizeof(err));
		if (rc)
			return fail_start("%s", err);
		if (D.weights.disk) {
			struct mlens_disk_tier_stats ds;
			mlens_disk_tier_get_stats(D.weights.disk, &ds);
			log_info("weights on disk: %d of %lld experts in each of %d MoE layers (%.1f MiB) stay in the model "
				 "files, read each step (%.1f MiB) into %.1f MiB of pinned staging by io_uring (%s, %s)",
				 ds.experts, (long long)D.model->cfg.num_local_experts, ds.layers, ds.disk_bytes / 1048576.0,
				 ds.step_bytes / 1048576.0, ds.staging_bytes / 1048576.0,
				 ds.direct ? "O_DIRECT" : "buffered: the file system refused O_DIRECT",
				 ds.registered ? "registered buffers" : "unregistered buffers: the kernel refused them");
		}
		/* from the weight pages, before anything is planned on the model */
		if (!strcmp(D.cfg.weight_dtype, "fp8")) {
			double t = mlens_now();
			rc = mlens_model_quantize_experts(D.model, err, sizeof(err));
			if (rc)
				return fail_start("%s", err);
			log_info("experts quantized to fp8 e4m3 (a scale per output channel) in %.2f s",
				 mlens_now() - t);
		}
		if (D.model->cfg.expert_dtype == MLENS_DTYPE_E4M3 || mlens_model_quant_bytes(D.model))
			log_info("experts in %s%s%s%s; %.3f GB of fp8 state (scales, quantized or "
				 "dequantized copies) beside the weight pages",
				 D.model->cfg.expert_dtype == MLENS_DTYPE_E4M3 ? "fp8 e4m3 with " :
										 mlens_dtype_name(D.model->cfg.expert_dtype),
				 D.model->cfg.expert_dtype != MLENS_DTYPE_E4M3 ? "" :
				 D.model->cfg.expert_scale.kind == MLENS_WSCALE_BLOCK ? "block scales" : "per-channel scales",
				 D.model->cfg.quant_method[0] ? ", quant_method " : "",
				 D.model->cfg.quant_method, mlens_model_quant_bytes(D.model) / 1e9);
		log_info("model %s: %s, %lld layers, %lld experts (top-%lld), %s; %.2f GB read into weight pages "
			 "in %.2f s (%.2f GB/s, %s%s) on NUMA node %d%s",
			 D.cfg.model, D.model->cfg.architecture, (long long)D.model->cfg.num_hidden_layers,
			 (long long)D.model->cfg.num_local_experts, (long long)D.model->cfg.num_experts_per_tok,
			 mlens_dtype_name(D.model->cfg.dtype), D.weights.bytes / 1e9, D.weights.seconds,
			 D.weights.bytes / 1e9 / (D.weights.seconds > 0 ? D.weights.seconds : 1e-9),
			 D.weights.used_io_uring ? "io_uring" : "copy",
			 D.weights.used_io_uring ? (D.weights.direct ? ", O_DIRECT" : ", buffered") : "",
			 D.node, D.weights.mem.locked ? ", locked" : "");
		log_huge_pages(&D.weights.mem, NULL, "weight pages");
	}
	return 0;
}

/* The backend, with the weight pages registered with its device. */
static int step_backend(void)
{
	struct mlens_backend_opts *bo = &D.bo;
	int rc;

	bo->n_threads = (int)D.cfg.threads;
	bo->device = D.cfg.gpu_ids[0];
	mlens_config_backend_opts(&D.cfg, D.model->cfg.dtype == MLENS_DTYPE_F32, bo);
	/* the KV cache lives on this node; no core is kept back: the movers
	 * only run at start-up and the main loop is the pool's thread 0 */
	bo->numa_node = D.node;
	bo->n_reserved = 0;
	rc = mlens_backend_create(&D.be, D.cfg.backend, bo);
	if (rc)
		return fail_start("cannot start the %s backend: %s%s", D.cfg.backend, strerror(-rc),
				  rc == -ENOTSUP ? " (this build has no CUDA)" : "");
	/* register the weight pages with the device: uploads (GPU-only) and
	 * expert streaming (hybrid) then run at pinned-copy speed */
	if (MLENS_BACKEND_HAS(D.be.ops, host_register) && MLENS_BACKEND_HAS(D.be.ops, host_unregister)) {
		double t = mlens_now();
		rc = D.be.ops->host_register(D.be.ctx, D.weights.mem.p, D.weights.mem.size);
		if (rc && rc != -EEXIST)
			return fail_start("cannot register %.2f GB of weight pages with the %s backend: %s",
					  D.weights.mem.size / 1e9, D.be.ops->name, strerror(-rc));
		D.weights_registered = rc == 0;
		log_info("weight pages registered with the %s backend in %.2f s", D.be.ops->name, mlens_now() - t);
	}
	return 0;
}

/* kv_dtype as mlens_kv_dtype takes it: -1 for auto (the config allows
 * only auto, bf16, fp32 or fp8). */
static int kv_dtype_wanted(void)
{
	const char *k = D.cfg.kv_dtype;
	return !strcmp(k, "bf16") ? MLENS_DTYPE_BF16 : !strcmp(k, "fp32") ? MLENS_DTYPE_F32 :
	       !strcmp(k, "fp8") ? MLENS_DTYPE_E4M3 : -1;
}

/* The host memory plan (host_memory): weight pages and staging first,
 * the KV pool (in host memory on the CPU backend and in hybrid mode) the
 * rest up to kv_cache, in whole blocks; the split printed, a budget that
 * cannot run refused. */
static int host_plan(void)
{
	struct mlens_host_plan_in hi = { .budget = D.cfg.host_memory, .weight_bytes = D.weights.mem.size,
					 .disk = D.weights.disk_bytes };
	struct mlens_host_plan hp;
	bool host_kv = D.be.ops->host_memory || D.hybrid;
	char err[1024], line[512];
	uint64_t blocks;

	if (D.weights.disk) {
		struct mlens_disk_tier_stats ds;
		mlens_disk_tier_get_stats(D.weights.disk, &ds);
		hi.disk_staging = ds.staging_bytes;
	}
	hi.staging = mlens_host_plan_staging(&D.model->cfg, D.hybrid, D.be.ops->host_memory, step_cap_wanted(),
					     D.hybrid ? plan_group() : 0, (int)D.cfg.pipeline_sets);
	if (host_kv) {
		hi.kv_want = 2ull * D.kv_blocks * D.kv_per_block;
		hi.kv_min = mlens_host_plan_kv_min(&D.model->cfg, step_cap_wanted(), (int)D.cfg.kv_block_size,
						   2ull * D.kv_per_block);
	}
	if (mlens_host_plan_split(&hp, &hi, err, sizeof(err)))
		return fail_start("%s", err);
	if (host_kv && D.cfg.host_memory) {
		blocks = hp.kv / (2ull * D.kv_per_block);
		D.kv_blocks = blocks > UINT32_MAX ? UINT32_MAX : (uint32_t)blocks;
		hp.kv = 2ull * D.kv_blocks * D.kv_per_block;
	}
	D.staging = hp.staging;
	mlens_host_plan_format(&hp, line, sizeof(line));
	log_info("%s%s", line, host_kv ? "" : " (GPU-only mode: the KV cache is in GPU memory)");
	return 0;
}

/* The KV cache's size in blocks; GPU-only or hybrid mode (and then the CPU
 * attention backend); the pool in pinned memory on the same node. */
static int step_kv_cache(void)
{
	char err[1024];
	int rc;

	D.kv_dt = mlens_kv_dtype(&D.model->cfg, kv_dtype_wanted());
	D.kv_blocks = kv_blocks_for(&D.model->cfg, D.kv_dt, (int)D.cfg.kv_block_size, D.cfg.kv_cache,
				    &D.kv_per_block);
	if (D.kv_blocks == 0)
		return fail_start("kv_cache of %llu bytes holds no KV block: one block of %lld tokens needs %zu bytes",
				  (unsigned long long)D.cfg.kv_cache, (long long)D.cfg.kv_block_size,
				  2 * D.kv_per_block);
	/* the GPU memory plan, once: GPU-only mode when the plan with every
	 * expert resident (and the KV pool and activations on the GPU) fits
	 * the budget; else the hybrid plan, whose pipeline streams experts
	 * from the weight pages and keeps the KV pool in pinned host memory */
	if (D.be.ops->host_memory && D.cfg.resident_experts >= 0)
		log_warn("resident_experts: the %s backend computes every expert in host memory; the key "
			 "applies to the hybrid pipeline only", D.be.ops->name);
	if (!D.be.ops->host_memory) {
		struct mlens_gpu_plan_in in = { .budget = D.cfg.gpu_memory, .gemm = D.bo.gemm };
		bool capped = D.cfg.resident_experts >= 0 &&
			      D.cfg.resident_experts < D.model->cfg.num_local_experts;

		if ((rc = mlens_gpu_plan_device(&D.be, &in)))
			return fail_start("cannot read the GPU's free memory: %s", strerror(-rc));
		if ((rc = mlens_perf_model_from_config(&D.pm, &D.model->cfg, D.kv_dt)))
			return fail_start("model %s: its dimensions are out of range for the GPU memory plan",
					  D.cfg.model);
		D.pm.expert_fp8_tc = experts_fp8_tc();
		in.gpu_only = true;
		in.model = &D.model->cfg;
		in.weight_bytes = D.weights.bytes + D.weights.disk_bytes;	/* GPU-only: the disk experts too */
		in.kv_bytes = 2ull * D.kv_blocks * D.kv_per_block;
		in.max_tokens = D.cfg.max_step_tokens > 0 ? D.cfg.max_step_tokens : 4096;
		/* resident_experts below the model's count: GPU-only mode holds
		 * every expert, so the hybrid plan whatever the budget */
		rc = capped ? -ENOSPC : mlens_gpu_plan_make(&D.pm, &in, &D.plan, err, sizeof(err));
		if (rc && rc != -ENOSPC)
			return fail_start("%s", err);
		if (!rc) {
			snprintf(D.mode_reason, sizeof(D.mode_reason), "%s", D.plan.summary);
			log_info("GPU-only mode: %s", D.plan.summary);
		} else {
			D.hybrid = true;
			if (capped)
				snprintf(D.mode_reason, sizeof(D.mode_reason),
					 "resident_experts = %lld keeps at most %lld of %lld experts a layer on the GPU: "
					 "the others stream from pinned host memory, decode attention runs on the CPU",
					 (long long)D.cfg.resident_experts, (long long)D.cfg.resident_experts,
					 (long long)D.model->cfg.num_local_experts);
			else
				snprintf(D.mode_reason, sizeof(D.mode_reason),
					 "GPU-only mode would need %.1f GiB, above the %.1f GiB budget: experts stream "
					 "from pinned host memory, decode attention runs on the CPU",
					 D.plan.total / 1073741824.0, D.plan.budget / 1073741824.0);
			log_info("hybrid mode: %s", D.mode_reason);
			/* the worker drives the GPU side of each step and waits for
			 * the GPU spinning (CUDA's default with fewer contexts than
			 * cores) while the pool runs decode attention: with threads
			 * on auto, leave it a core rather than oversubscribe the
			 * pool, whose pinned workers cannot move away from it (a
			 * worker preempted inside a task holds up the end of the
			 * pool's run). The mover shares the rest: leaving it a core
			 * too changed neither the GPU's time per group nor the
			 * step, and slowed the CPU attention. With gpu_sync = block the worker
			 * sleeps while it waits, and the pool takes every core */
			struct mlens_backend_opts abo = D.bo;
			if (abo.n_threads <= 0 && D.bo.sync != MLENS_GPU_SYNC_BLOCK)
				abo.n_reserved = 1;
			if ((rc = mlens_backend_cpu_create(&D.attn, &abo)))
				return fail_start("hybrid mode: cannot start the cpu attention backend: %s",
						  strerror(-rc));
			in.gpu_only = false;
			in.model = NULL;
			in.max_tokens = step_cap_wanted();
			in.workspace = mlens_gpu_plan_workspace(D.bo.moe_streams);
			in.group = plan_group();
			in.sets = (int)D.cfg.pipeline_sets;
			in.att_half = att_up_half() && mlens_pipeline_half_att(&D.be, &D.attn, &D.model->cfg);
			resident_cap(&in);
			if ((rc = mlens_gpu_plan_make(&D.pm, &in, &D.plan, err, sizeof(err))))
				return fail_start("%s", err);
		}
	}
	if ((rc = host_plan()))
		return rc;
	if (D.be.ops->host_memory || D.hybrid) {
		size_t bytes = (size_t)D.kv_blocks * D.kv_per_block;
		rc = mlens_pinned_alloc(&D.kv_k, bytes, D.node, D.cfg.mlock, "KV cache (K)", err, sizeof(err));
		if (!rc)
			rc = mlens_pinned_alloc(&D.kv_v, bytes, D.node, D.cfg.mlock, "KV cache (V)", err, sizeof(err));
		if (rc)
			return fail_start("%s", err);
		log_huge_pages(&D.kv_k, &D.kv_v, "KV cache");
	}
	return 0;
}

/* Defaults of the KV swap's cost model where nothing was measured: an
 * NVMe drive's sequential rate, and a prefill rate per backend kind. */
#define SWAP_DISK_BPS 2e9
#define SWAP_CPU_FLOPS 5e10
#define SWAP_GPU_FLOPS 1e14

/* The KV swap file (kv_swap > 0), with the initial rates of its cost
 * model: the disk's measured on the file as it opens (else the model
 * files' O_DIRECT io_uring read, else a default), the prefill's from the
 * profiler's GEMM rate or a default; the running daemon's observations
 * replace both. GPU-only mode keeps its KV in GPU memory, which the file's
 * I/O cannot reach: no swap there. */
static int kv_swap_open(void)
{
	struct mlens_kv_swap_opts o = { 0 };
	struct mlens_perf_model pm;
	struct mlens_kv_swap_stats st;
	char err[1024];
	int rc;

	if (!D.cfg.kv_swap)
		return 0;
	if (!D.be.ops->host_memory && !D.hybrid) {
		log_warn("kv_swap: GPU-only mode keeps the KV cache in GPU memory; preempted sequences re-prefill");
		return 0;
	}
	o.budget = D.cfg.kv_swap;
	o.path = D.cfg.kv_swap_path;
	o.policy = !strcmp(D.cfg.kv_swap_policy, "always") ? MLENS_KV_SWAP_ALWAYS :
		   !strcmp(D.cfg.kv_swap_policy, "never") ? MLENS_KV_SWAP_NEVER : MLENS_KV_SWAP_AUTO;
	o.rates.disk_bps = SWAP_DISK_BPS;
	if (D.weights.used_io_uring && D.weights.direct && D.weights.seconds > 0) {
		o.rates.disk_bps = D.weights.bytes / D.weights.seconds;
		o.disk_source = MLENS_KV_SWAP_MEASURED;
	}
	o.rates.compute_flops = D.be.ops->host_memory ? SWAP_CPU_FLOPS : SWAP_GPU_FLOPS;
	if (D.prof.have && D.prof.prof.gemm_flops > 0) {
		o.rates.compute_flops = D.prof.prof.gemm_flops;
		o.compute_source = MLENS_KV_SWAP_PROFILED;
	}
	if (!mlens_perf_model_from_config(&pm, &D.model->cfg, D.kv_dt)) {
		o.rates.flops_per_token = (double)pm.layers * (pm.flops_ga + pm.flops_gb);
		/* causal attention: q.k and p.v over half the square, per head */
		o.rates.flops_per_token2 = 2.0 * (double)pm.layers * (double)pm.heads * (double)pm.head_dim;
	}
	rc = mlens_kv_swap_create(&D.swap, &mlens_engine_kv(D.engine)->cache, &o, err, sizeof(err));
	if (rc)
		return fail_start("%s", err);
	mlens_kv_swap_get_stats(D.swap, &st);
	log_info("%s; cost model: disk %.3g GB/s (%s), prefill %.3g FLOP/s (%s); observed rates replace them",
		 mlens_kv_swap_describe(D.swap), st.disk.value / 1e9, mlens_kv_swap_source_name(st.disk.source),
		 st.prefill.value, mlens_kv_swap_source_name(st.prefill.source));
	return 0;
}

/* The profiler (before the engine takes its memory), the engine and the
 * scheduler. */
static int step_engine(void)
{
	struct mlens_engine_opts *eo = &D.eo;
	struct mlens_sched_opts so;
	char err[1024];
	double t_engine;
	int rc;

	profile_setup(D.kv_blocks, D.kv_per_block, D.kv_dt, &D.bo);
	if (D.cfg.profile) {
		rc = mlens_profile_state_run(&D.prof, NULL, MLENS_PROFILE_PROMPT, MLENS_PROFILE_GEN, true);
		if (rc)
			log_warn("profile at start-up failed (%s); the token cap stays as configured", D.prof.err);
		else
			profile_log(&D.prof);
		if (!rc && D.prof.err[0])
			log_warn("%s", D.prof.err);
	}
	memset(eo, 0, sizeof(*eo));
	eo->kv_block_size = (int)D.cfg.kv_block_size;
	eo->kv_blocks = D.kv_blocks;
	eo->kv_dtype = (int)D.kv_dt;
	eo->max_step_tokens = step_cap_wanted();
	eo->op_timing = D.cfg.op_timing;
	eo->weights_disk_follow = D.cfg.weights_disk_follow;
	eo->weights_disk_period = (int)D.cfg.expert_residency_period;
	eo->kv_mem_k = D.kv_k.p;
	eo->kv_mem_v = D.kv_v.p;
	/* the plan made at start-up (budget: gpu_memory, or the free memory
	 * less a margin); none on a host-memory backend */
	eo->plan = D.be.ops->host_memory ? NULL : &D.plan;
	if (D.hybrid) {
		eo->attn_backend = &D.attn;
		eo->hybrid_side_copy_out = side_copy_out();
		eo->hybrid_up_copy_in = up_copy_in();
		eo->hybrid_gpu_kv_append = gpu_kv_append();
		eo->hybrid_piece_bytes = D.cfg.weight_piece;
		/* auto: routing (the plan's r is the same either way) */
		eo->hybrid_residency_routing = strcmp(D.cfg.expert_residency, "static") != 0;
		eo->hybrid_residency_period = (int)D.cfg.expert_residency_period;
	}
	t_engine = mlens_now();
	rc = mlens_engine_create(&D.engine, D.model, &D.be, eo, err, sizeof(err));
	if (rc)
		return fail_start("%s", err);
	if (D.weights.disk)
		log_info("weights on disk: the experts kept in RAM %s", mlens_engine_disk_follows(D.engine) ?
			 "follow the routing (weights_disk_follow), one trade a step at most" :
			 !D.cfg.weights_disk_follow ? "stay as loaded (weights_disk_follow = false)" :
			 D.hybrid ? "stay as loaded (hybrid mode: the pipeline's resident experts are placed once)" :
			 !D.be.ops->host_memory ? "do not matter (GPU-only mode: every expert copied to the GPU once)" :
			 "stay as loaded");
	if (D.cfg.op_timing)
		log_info(mlens_engine_op_time(D.engine) ? "op_timing: every step's ops timed on the %s backend's timing marks"
			 : "op_timing: the %s backend has no timing marks; no op times", D.be.ops->name);
	if (D.hybrid) {
		const struct mlens_pipeline_stats *ps = mlens_pipeline_stats(mlens_engine_pipeline(D.engine));
		char line[512];
		log_info("hybrid pipeline ready in %.2f s; K/V appended to the pool by the %s; the CPU attention's output goes up in %s; "
			 "resident experts %s",
			 mlens_now() - t_engine,
			 ps->gpu_kv_append ? "GPU (the pool registered with it)" : "CPU pool",
			 ps->att_up_half ? mlens_dtype_name(D.model->cfg.dtype) : "fp32",
			 ps->residency_routing ? "follow the routing (expert_residency = routing)"
					       : "stay experts 0..r-1");
		mlens_gpu_plan_format(&D.plan, &D.pm, line, sizeof(line));
		log_info("%s", line);
		eo->max_step_tokens = mlens_engine_max_step_tokens(D.engine);
	}
	log_info("backend %s%s%s%s%s%s; KV cache: %u blocks of %lld tokens (%s, %.1f MiB, %llu tokens); step cap %d tokens",
		 D.be.ops->name,
		 D.be.ops->host_memory ? "" : D.bo.gemm == MLENS_GEMM_EXACT ? " (exact GEMMs" : " (fast GEMMs",
		 D.be.ops->host_memory ? "" : D.bo.prefill_bf16 ? ", bf16 prefill attention" : ", fp32 prefill attention",
		 D.be.ops->host_memory ? "" : ", GPU waits: ",
		 D.be.ops->host_memory ? "" : mlens_gpu_sync_name(D.bo.sync), D.be.ops->host_memory ? "" : ")",
		 D.kv_blocks, (long long)D.cfg.kv_block_size, mlens_dtype_name(D.kv_dt),
		 2.0 * D.kv_blocks * D.kv_per_block / 1048576.0,
		 (unsigned long long)D.kv_blocks * (unsigned long long)D.cfg.kv_block_size, eo->max_step_tokens);

	mlens_kv_pool_set_room(mlens_engine_kv(D.engine), (uint32_t)D.cfg.kv_growth_room);
	if ((rc = kv_swap_open()))
		return rc;
	memset(&so, 0, sizeof(so));
	so.swap = D.swap;
	so.token_cap = eo->max_step_tokens;
	so.reserve_horizon = (int)D.cfg.admit_lookahead;
	so.admit_keeps_room = D.cfg.admit_keeps_room;
	rc = mlens_sched_create(&D.sched, D.engine, &so);
	if (rc)
		return fail_start("cannot create the scheduler: %s", strerror(-rc));
	if (D.prof.have) {
		mlens_profile_state_apply(&D.prof, D.sched);
		log_info("step cap %d tokens (%s)", D.prof.token_cap,
			 D.prof.pinned_cap > 0 ? "pinned by max_step_tokens" : "from n_real");
	}
	return 0;
}

/* The event loop and the worker thread. */
static int step_worker(void)
{
	int rc;
	D.base = event_base_new();
	D.notify_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (!D.base || D.notify_fd < 0)
		return fail_start("cannot set up the event loop");
	rc = mlens_worker_start(&D.worker, D.sched, D.notify_fd);
	if (rc)
		return fail_start("cannot start the worker thread: %s", strerror(-rc));
	return 0;
}

/* The sockets bound at start listen now: tenants, then control, stats
 * and /metrics (after loading: /health answers only once the model is in). */
static int step_serve(void)
{
	struct mlens_server_opts sv;
	char err[1024];
	int64_t ctx = D.model->cfg.max_position_embeddings;

	memset(&sv, 0, sizeof(sv));
	sv.allow_users = D.cfg.allow_users;
	sv.allow_groups = D.cfg.allow_groups;
	sv.max_tenants = (int)D.cfg.max_tenants;
	sv.quota.max_running = (uint32_t)D.cfg.quota_running;
	sv.quota.max_kv_blocks = (uint32_t)D.cfg.quota_kv_blocks;
	sv.quota.max_queued = (uint32_t)D.cfg.quota_queued;
	sv.quota.weight = D.cfg.quota_weight;
	sv.region = (struct mlens_region_params)MLENS_REGION_PARAMS_DEFAULT;
	{
		uint32_t most = mlens_sched_max_running(D.sched);

		/* quota_queued 0: room to queue a whole machine's worth twice */
		if (!sv.quota.max_queued)
			sv.quota.max_queued = most <= (1u << 30) ? 2 * most : most;
		sv.limits.max_running = sv.quota.max_running && sv.quota.max_running < most ?
			sv.quota.max_running : most;
		sv.limits.max_queued = sv.quota.max_queued;
		log_eos_and_room(&D.model->cfg, &sv.limits);
	}
	sv.limits.max_prompt_tokens = (uint32_t)(D.eo.max_step_tokens < ctx - 1 ? D.eo.max_step_tokens : ctx - 1);
	sv.limits.max_tokens = (uint32_t)(ctx - 1);
	sv.limits.max_context = (uint32_t)ctx;
	sv.limits.vocab_size = (uint32_t)D.model->cfg.vocab_size;
	while ((uint64_t)sv.region.prompt_bytes < 2ull * 4 * sv.limits.max_prompt_tokens)
		sv.region.prompt_bytes *= 2;
	sv.limits.prompt_bytes = sv.region.prompt_bytes;
	if (mlens_server_start(D.server, D.base, D.worker, &sv, err, sizeof(err)))
		return fail_start("%s", err);

	D.info = (struct mlens_daemon_info){
		.cfg = &D.cfg, .worker = D.worker, .server = D.server, .backend = D.hybrid ? "hybrid (cuda + cpu attention)" : D.be.ops->name,
		.model_dtype = mlens_dtype_name(D.model->cfg.dtype), .n_layers = D.model->cfg.num_hidden_layers,
		.expert_dtype = mlens_dtype_name(D.model->cfg.expert_dtype),
		.expert_bytes = mlens_model_expert_bytes(&D.model->cfg),
		.n_experts = D.model->cfg.num_local_experts, .top_k = D.model->cfg.num_experts_per_tok,
		.eos = D.model->cfg.eos, .n_eos = D.model->cfg.n_eos,
		.weight_bytes = D.weights.bytes, .kv_bytes = 2ull * D.kv_blocks * D.kv_per_block,
		.gpu_budget = D.plan.budget, .has_gpu_budget = !D.be.ops->host_memory,
		.staging_bytes = D.staging,
		.kv_block_size = (int)D.cfg.kv_block_size, .kv_dtype = mlens_dtype_name(D.kv_dt),
		.started = D.started,
		.mode = !D.mode_reason[0] ? NULL : D.hybrid ? "hybrid" : "gpu-only", .mode_reason = D.mode_reason[0] ? D.mode_reason : NULL,
		.profile = &D.prof,
		.disk = D.weights.disk,
	};
	if (mlens_stats_start(D.stats, D.base, &D.info, err, sizeof(err)) ||
	    mlens_control_start(D.control, D.base, &D.info, on_control_shutdown, NULL, err, sizeof(err)))
		return fail_start("%s", err);
	return 0;
}

/* Signals, the workload_follow timer, the pid file; then tell the waiting
 * parent. */
static int step_ready(void)
{
	int rc;
	D.ev_notify = event_new(D.base, D.notify_fd, EV_READ | EV_PERSIST, on_drained, NULL);
	D.ev_term = evsignal_new(D.base, SIGTERM, on_signal, NULL);
	D.ev_int = evsignal_new(D.base, SIGINT, on_signal, NULL);
	D.ev_hup = evsignal_new(D.base, SIGHUP, on_signal, NULL);
	if (!D.ev_notify || !D.ev_term || !D.ev_int || !D.ev_hup || event_add(D.ev_notify, NULL) ||
	    event_add(D.ev_term, NULL) || event_add(D.ev_int, NULL) || event_add(D.ev_hup, NULL))
		return fail_start("cannot set up the signal handlers");
	if (D.prof.have && D.cfg.workload_follow > 0) {
		struct timeval tv = { (time_t)D.cfg.workload_follow, 0 };
		D.follow.started = true;	/* from the first request on: counters at 0 */
		D.ev_follow = event_new(D.base, -1, EV_PERSIST, on_follow, NULL);
		if (!D.ev_follow || event_add(D.ev_follow, &tv))
			return fail_start("cannot set up the workload_follow timer");
	}
	if (D.cfg.pid_file[0]) {
		if ((rc = write_pid_file(D.cfg.pid_file)))
			return fail_start("cannot write pid file %s: %s", D.cfg.pid_file, strerror(-rc));
		D.pid_written = true;
	}
	log_info("serving on %s (pid %d), ready in %.2f s", D.cfg.socket, (int)getpid(), mlens_now() - D.started);
	if (D.ready_fd >= 0) {
		if (write(D.ready_fd, "ok", 2) != 2)
			log_warn("start-up: the waiting parent is gone");
		close(D.ready_fd);
		D.ready_fd = -1;
	}
	return 0;
}

/* Everything a step set up, in reverse; each part only if it is there. */
static void teardown(void)
{
	mlens_control_destroy(D.control);
	mlens_stats_destroy(D.stats);
	if (D.worker)
		mlens_worker_stop(D.worker);
	mlens_server_destroy(D.server);
	if (D.ev_notify)
		event_free(D.ev_notify);
	if (D.ev_term)
		event_free(D.ev_term);
	if (D.ev_int)
		event_free(D.ev_int);
	if (D.ev_hup)
		event_free(D.ev_hup);
	if (D.ev_follow)
		event_free(D.ev_follow);
	if (D.base)
		event_base_free(D.base);
	if (D.notify_fd >= 0)
		close(D.notify_fd);
	if (D.sched)
		mlens_sched_destroy(D.sched);
	mlens_kv_swap_destroy(D.swap);
	if (D.engine)
		mlens_engine_destroy(D.engine);
	mlens_pinned_free(&D.kv_k);
	mlens_pinned_free(&D.kv_v);
	if (D.weights_registered)
		D.be.ops->host_unregister(D.be.ctx, D.weights.mem.p);
	mlens_backend_destroy(&D.be);
	if (D.hybrid)
		mlens_backend_destroy(&D.attn);
	mlens_weights_free(&D.weights);
	if (D.model)
		mlens_model_close(D.model);
	if (D.pid_written)
		unlink(D.cfg.pid_file);
	if (D.ready_fd >= 0)
		close(D.ready_fd);
}

int main(int argc, char **argv)
{
	int rc;

	memset(&D, 0, sizeof(D));
	D.ready_fd = -1;
	D.notify_fd = -1;
	rc = step_config(argc, argv);
	if (rc < 0) {
		mlens_config_free(&D.cfg);
		return -1 - rc;
	}
	if ((rc = step_log()) || (rc = step_bind()) || (rc = step_daemonize()))
		goto out;
	signal(SIGPIPE, SIG_IGN);
	if ((rc = step_model()) || (rc = step_backend()) || (rc = step_kv_cache()) || (rc = step_engine()) ||
	    (rc = step_worker()) || (rc = step_serve()) || (rc = step_ready()))
		goto out;

	event_base_dispatch(D.base);
	teardown();
	log_info("exited cleanly");
	mlens_config_free(&D.cfg);
	mlens_log_close();
	return 0;
out:
	teardown();
	mlens_config_free(&D.cfg);
	if (D.log_open)
		mlens_log_close();
	return rc;
}
