/* Control socket: accept (SO_PEERCRED against the owner, root and
 * control_group), read JSON lines through a bufferevent, answer each, and
 * close connections that send garbage, HTTP, over-long or stalled lines. */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>
#include "daemon/ops/control.h"
#include "daemon/ops/listen.h"
#include "daemon/log.h"
#include "daemon/model/disk_tier.h"
#include "daemon/plan/profiler.h"
#include "daemon/ops/trace.h"

struct conn {
	struct mlens_control *c;
	struct bufferevent *bev;
	uid_t uid;
	pid_t pid;
	bool closing;		/* free once the output is written */
	bool shutdown_after;	/* the shutdown command: act once the reply is out */
	struct profile_job *job;	/* a profile measuring for it: reading waits */
	struct trace_job *tjob;		/* a trace recording for it: reading waits */
	struct conn *next, **prevp;
};

/* A profile measuring on the worker thread while the main loop goes on
 * serving (it takes up to 30 s on a GPU). The worker fills its own copy of
 * the profile state, so that the stats and /metrics the main thread serves
 * meanwhile read the last results untouched; the copy replaces them when
 * the job is done. One at a time. */
/* What a job the worker runs for a control connection has in common: the
 * worker writes efd when done (from then on the main thread may free the
 * job at any moment); the main thread answers the connection, if it is
 * still there, and reads its next lines. */
struct wjob;
/* What differs between the kinds of job: finish (main thread, the worker
 * done) publishes the results, logs, clears the slots that name the job and
 * returns the answer; free frees the job. */
struct wjob_kind {
	const char *name;
	json_t *(*finish)(struct wjob *w);
	void (*free)(struct wjob *w);
};

struct wjob {
	const struct wjob_kind *kind;
	struct mlens_control *c;
	struct conn *k;		/* NULL once the connection is gone */
	int efd;
	struct event *ev;
};

struct profile_job {
	struct wjob w;		/* first */
	struct mlens_profile_state st;
	double p, g;
	json_t *req;
	int rc;
};

/* A step trace armed on the worker's engine: the worker fills res (the
 * trace's JSON with it) when the steps ran, the trace failed or was
 * cancelled, and then writes efd; the main thread sends the trace to the
 * requester, who writes the file (as its own user, where it may). One at
 * a time. */
struct trace_job {
	struct wjob w;		/* first */
	int steps;
	struct mlens_trace_result res;
};

struct mlens_control {
	struct event_base *base;
	struct mlens_daemon_info *info;
	void (*shutdown)(void *arg);
	void *shutdown_arg;
	struct mlens_listener l;
	struct mlens_access access;
	struct conn *conns;
	int n_conns;
	bool drained_by_ctl;	/* admission closed by mlensctl drain */
	struct profile_job *job;	/* the profile in flight, if any */
	struct trace_job *tjob;		/* the trace armed, if any */
};

/* ==== replies ==== */

static json_t *fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static json_t *fail(const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	return json_pack("{s:b,s:s}", "ok", 0, "error", msg);
}

static json_t *ok(void)
{
	return json_pack("{s:b}", "ok", 1);
}

static const char *mode_why(const struct mlens_daemon_info *in, const char **mode)
{
	*mode = in->backend;
	if (in->mode && in->mode_reason) {
		*mode = in->mode;
		return in->mode_reason;
	}
	if (!strcmp(in->backend, "cpu"))
		return strcmp(in->cfg->backend, "cpu") ? "no usable CUDA device (backend = auto): the CPU runs every layer"
						       : "backend = cpu in the configuration: the CPU runs every layer";
	return "the GPU backend runs every layer";
}

static const char *admission_word(const struct mlens_control *c, const struct mlens_worker_snapshot *s)
{
	if (s->draining)
		return "shutting down";
	if (!s->admission)
		return c->drained_by_ctl ? "draining" : "closed";
	return "open";
}

static json_t *cmd_status(struct mlens_control *c)
{
	const struct mlens_daemon_info *in = c->info;
	struct mlens_worker_snapshot s;
	const char *mode, *why = mode_why(in, &mode);
	json_t *o;
	mlens_worker_snapshot(in->worker, &s);
	o = json_pack("{s:b,s:s,s:I,s:{s:s,s:s,s:I,s:I,s:I},s:s,s:s,s:s,s:f,s:I,s:I,s:s,s:I,s:I}",
		"ok", 1, "version", PACKAGE_VERSION, "pid", (json_int_t)getpid(),
		"model", "path", in->cfg->model, "dtype", in->model_dtype, "layers", (json_int_t)in->n_layers,
		"experts", (json_int_t)in->n_experts, "top_k", (json_int_t)in->top_k,
		"backend", in->backend, "mode", mode, "mode_reason", why,
		"uptime_seconds", mlens_now() - in->started,
		"requests_running", (json_int_t)s.sched.running, "requests_waiting", (json_int_t)s.sched.waiting,
		"admission", admission_word(c, &s), "token_cap", (json_int_t)s.token_cap,
		"tenants", (json_int_t)s.n_tenants);
	{
		json_t *ids = json_array();

		for (int i = 0; i < in->n_eos; i++)
			json_array_append_new(ids, json_integer(in->eos[i]));
		json_object_set_new(json_object_get(o, "model"), "eos_token_ids", ids);
		json_object_set_new(json_object_get(o, "model"), "expert_dtype",
				    json_string(in->expert_dtype ? in->expert_dtype : "?"));
		json_object_set_new(json_object_get(o, "model"), "expert_bytes",
				    json_integer((json_int_t)in->expert_bytes));
	}
	/* gpu_memory: the plan's effective budget (gpu_memory = 0 resolved to
	 * the free memory less the margin); null where no GPU plan exists */
	json_object_set_new(o, "budgets", json_pack("{s:{s:I,s:I,s:I,s:I,s:I,s:s,s:I},s:{s:I},s:{s:o}}",
		"kv_cache", "bytes", (json_int_t)in->kv_bytes, "blocks_total", (json_int_t)s.kv_blocks_total,
		"blocks_used", (json_int_t)s.kv_blocks_used, "block_tokens", (json_int_t)in->kv_block_size,
		"budget_bytes", (json_int_t)in->cfg->kv_cache,
		"dtype", in->kv_dtype ? in->kv_dtype : "?",
		"tokens_total", (json_int_t)s.kv_blocks_total * in->kv_block_size,
		"weight_pages", "bytes", (json_int_t)in->weight_bytes,
		"gpu_memory", "budget_bytes",
		in->has_gpu_budget ? json_integer((json_int_t)in->gpu_budget) : json_null()));
	json_object_set_new(json_object_get(o, "budgets"), "host_memory", json_pack("{s:I,s:I}",
		"budget_bytes", (json_int_t)in->cfg->host_memory, "staging_bytes", (json_int_t)in->staging_bytes));
	if (in->disk) {
		struct mlens_disk_tier_stats d;
		mlens_disk_tier_get_stats(in->disk, &d);
		json_object_set_new(json_object_get(o, "budgets"), "weights_on_disk",
				    json_pack("{s:I,s:i,s:i,s:I,s:I,s:b,s:I,s:I,s:I,s:f,s:f,s:i,s:I,s:I}",
			"disk_bytes", (json_int_t)d.disk_bytes, "experts_per_layer", d.experts, "layers", d.layers,
			"step_bytes", (json_int_t)d.step_bytes, "staging_bytes", (json_int_t)d.staging_bytes,
			"direct", d.direct, "read_bytes_total", (json_int_t)d.read_bytes_total,
			"errors_total", (json_int_t)d.errors_total, "last_step_bytes", (json_int_t)d.last_step_bytes,
			"last_step_busy_ratio", d.last_step_busy, "ceiling_bytes_per_second", d.ceiling_bps,
			"ram_experts_per_layer", d.ram_experts, "trades_total", (json_int_t)d.trades_total,
			"trade_errors_total", (json_int_t)d.trade_errors_total));
	}
	if (s.sched.kv_swap)
		json_object_set_new(json_object_get(o, "budgets"), "kv_swap", json_pack("{s:I,s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:s,s:f,s:s}",
			"budget_bytes", (json_int_t)in->cfg->kv_swap, "path", in->cfg->kv_swap_path,
			"slots_total", (json_int_t)s.sched.swap.slots_total,
			"slots_used", (json_int_t)s.sched.swap.slots_used,
			"bytes_out_total", (json_int_t)s.sched.swap.bytes_out,
			"bytes_in_total", (json_int_t)s.sched.swap.bytes_in,
			"swaps_total", (json_int_t)s.sched.swap.swaps,
			"recomputes_total", (json_int_t)s.sched.swap.recomputes,
			"full_total", (json_int_t)s.sched.swap.full,
			"errors_total", (json_int_t)s.sched.swap.errors,
			"disk_bps", s.sched.swap.disk.value,
			"disk_source", mlens_kv_swap_source_name(s.sched.swap.disk.source),
			"prefill_flops", s.sched.swap.prefill.value,
			"prefill_source", mlens_kv_swap_source_name(s.sched.swap.prefill.source)));
	if (s.sched.hybrid)
		json_object_set_new(o, "pipeline", json_pack("{s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:I}",
			"last_step_seconds", s.sched.last_step_seconds,
			"last_step_gpu_busy_seconds", s.sched.last_step_gpu_busy_seconds,
			"last_step_h2d_busy_seconds", s.sched.last_step_h2d_busy_seconds,
			"gpu_busy_seconds_total", s.sched.gpu_busy_seconds,
			"h2d_busy_seconds_total", s.sched.h2d_busy_seconds,
			"cpu_attention_seconds_total", s.sched.cpu_attn_seconds,
			"cpu_append_seconds_total", s.sched.cpu_append_seconds,
			"step_seconds_total", s.sched.step_seconds_sum,
			"kv_read_bytes_total", (json_int_t)s.sched.kv_read_bytes));
	if (s.sched.hybrid) {
		json_t *pl = json_object_get(o, "pipeline");
		json_object_set_new(pl, "expert_residency",
				    json_string(s.sched.residency_routing ? "routing" : "static"));
		json_object_set_new(pl, "expert_resident_hit_ratio",
				    json_real(mlens_sched_resident_hit_ratio(&s.sched)));
		json_object_set_new(pl, "expert_swaps_total", json_integer((json_int_t)s.sched.expert_swaps));
	}
	json_object_set_new(o, "sockets", json_pack("{s:s,s:s,s:s,s:s}", "tenant", in->cfg->socket,
		"control", in->cfg->control, "stats", in->cfg->stats, "stats_http", in->stats_http_addr));
	free(s.tenants);
	return o;
}

static json_t *cmd_tenants(struct mlens_control *c)
{
	struct mlens_worker_snapshot s;
	json_t *a = json_array();
	mlens_worker_snapshot(c->info->worker, &s);
	for (int i = 0; i < s.n_tenants; i++)
		mlens_tenant_json_append(a, &s.tenants[i]);
	free(s.tenants);
	return json_pack("{s:b,s:o}", "ok", 1, "tenants", a);
}

/* The tenant id of a request: "tenant" as a number or a decimal string. */
static int req_tenant(json_t *req, uint32_t *id)
{
	json_t *t = json_object_get(req, "tenant");
	json_int_t v;
	if (json_is_integer(t))
		v = json_integer_value(t);
	else if (json_is_string(t)) {
		char *end;
		const char *s = json_string_value(t);
		v = strtoll(s, &end, 10);
		if (!*s || *end)
			return -EINVAL;
	} else
		return -EINVAL;
	if (v <= 0 || v > UINT32_MAX)
		return -EINVAL;
	*id = (uint32_t)v;
	return 0;
}

static bool find_tenant(struct mlens_control *c, uint32_t id, struct mlens_tenant_info *out)
{
	struct mlens_worker_snapshot s;
	bool found = false;
	mlens_worker_snapshot(c->info->worker, &s);
	for (int i = 0; i < s.n_tenants && !found; i++)
		if (s.tenants[i].id == id) {
			*out = s.tenants[i];
			found = true;
		}
	free(s.tenants);
	return found;
}

/* A quota value: an integer (or a decimal string, as mlensctl KEY=VALUE
 * sends it) within [lo, hi]. */
static int quota_int(json_t *v, long long lo, long long hi, uint32_t *out)
{
	long long x;
	if (json_is_integer(v))
		x = json_integer_value(v);
	else if (json_is_string(v)) {
		char *end;
		const char *s = json_string_value(v);
		errno = 0;
		x = strtoll(s, &end, 10);
		if (!*s || *end || errno)
			return -EINVAL;
	} else
		return -EINVAL;
	if (x < lo || x > hi)
		return -ERANGE;
	*out = (uint32_t)x;
	return 0;
}

static json_t *cmd_quota(struct mlens_control *c, json_t *req)
{
	struct mlens_tenant_info t;
	struct mlens_quota q;
	json_t *set = json_object_get(req, "set"), *v;
	const char *key;
	uint32_t id;
	int rc;
	if (req_tenant(req, &id))
		return fail("quota: the tenant must be given by its id, a positive number (see mlensctl tenants)");
	if (!find_tenant(c, id, &t))
		return fail("quota: no tenant with id %u is attached (see mlensctl tenants)", id);
	if (set && !json_is_object(set))
		return fail("quota: 'set' must be an object of running, kv_blocks, queued, weight");
	if (set && json_object_size(set)) {
		q = t.quota;
		json_object_foreach(set, key, v) {
			const char *range = "";
			if (!strcmp(key, "running")) {
				rc = quota_int(v, 0, 1 << 20, &q.max_running);
				range = "a whole number in [0, 1048576]; 0 = no limit";
			} else if (!strcmp(key, "kv_blocks")) {
				rc = quota_int(v, 0, UINT32_MAX, &q.max_kv_blocks);
				range = "a whole number in [0, 4294967295]; 0 = no limit";
			} else if (!strcmp(key, "queued")) {
				rc = quota_int(v, 1, 1 << 20, &q.max_queued);
				range = "a whole number in [1, 1048576]";
			} else if (!strcmp(key, "weight")) {
				double w = -1;
				range = "a number above 0, at most 1000000";
				if (json_is_number(v))
					w = json_number_value(v);
				else if (json_is_string(v)) {
					char *end;
					w = strtod(json_string_value(v), &end);
					if (end == json_string_value(v) || *end)
						w = -1;
				}
				rc = isfinite(w) && w > 0 && w <= 1e6 ? 0 : -EINVAL;
				if (!rc)
					q.weight = w;
			} else
				return fail("quota: unknown key '%s' (running, kv_blocks, queued, weight)", key);
			if (rc) {
				char *shown = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
				json_t *bad = fail("quota: %s = %.40s%s: must be %s", key, shown ? shown : "?",
						   shown && strlen(shown) > 40 ? "..." : "", range);
				free(shown);
				return bad;
			}
		}
		rc = mlens_worker_set_quota(c->info->worker, id, &q);
		if (rc == -ENOENT)
			return fail("quota: tenant %u detached while its quota was being set", id);
		if (rc)
			return fail("quota: tenant %u: cannot set it: %s", id, strerror(-rc));
		log_info("control: tenant %u quota: running %u, kv_blocks %u, queued %u, weight %g", id,
			 q.max_running, q.max_kv_blocks, q.max_queued, q.weight);
		t.quota = q;
	}
	return json_pack("{s:b,s:I,s:{s:I,s:I,s:I,s:f},s:{s:I,s:I,s:I}}", "ok", 1, "tenant", (json_int_t)id,
		"quota", "running", (json_int_t)t.quota.max_running, "kv_blocks", (json_int_t)t.quota.max_kv_blocks,
		"queued", (json_int_t)t.quota.max_queued, "weight", t.quota.weight,
		"use", "running", (json_int_t)t.running, "kv_blocks", (json_int_t)t.kv_blocks,
		"queued", (json_int_t)t.queued);
}

static json_t *cmd_evict(struct mlens_control *c, json_t *req)
{
	uint32_t id;
	int rc;
	if (req_tenant(req, &id))
		return fail("evict: the tenant must be given by its id, a positive number (see mlensctl tenants)");
	rc = mlens_worker_evict(c->info->worker, id);
	if (rc == -ENOENT)
		return fail("evict: no tenant with id %u is attached (see mlensctl tenants)", id);
	if (rc)
		return fail("evict: tenant %u: %s", id, strerror(-rc));
	/* its requests failed with -ECONNABORTED and its KV is free; now the hang-up */
	rc = mlens_server_disconnect(c->info->server, id);
	log_info("control: tenant %u evicted%s", id, rc ? " (its connection was already gone)" : "");
	return json_pack("{s:b,s:I}", "ok", 1, "tenant", (json_int_t)id);
}

static json_t *cmd_log_level(json_t *req)
{
	json_t *l = json_object_get(req, "level");
	if (l) {
		int level = json_is_string(l) ? mlens_log_parse_level(json_string_value(l)) : -1;
		if (level < 0)
			return fail("log-level: not one of error, warn, info, debug");
		mlens_log_set_level((enum mlens_log_level)level);
		log_info("control: log level set to %s", mlens_log_level_name((enum mlens_log_level)level));
	}
	return json_pack("{s:b,s:s}", "ok", 1, "level", mlens_log_level_name(mlens_log_get_level()));
}

/* mlens_config_dump's "key = value" lines as an object of strings. */
static json_t *cmd_config(struct mlens_control *c)
{
	char *text = NULL, *line, *save = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&text, &len);
	json_t *o;
	if (!f)
		return fail("config: out of memory");
	mlens_config_dump(c->info->cfg, f);
	fclose(f);
	o = json_object();
	for (line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char *eq = strstr(line, " = ");
		if (!eq)
			continue;
		*eq = 0;
		json_object_set_new(o, line, json_string(eq + 3));
	}
	free(text);
	return json_pack("{s:b,s:o}", "ok", 1, "config", o);
}

/* A workload length: a number in [lo, 1e7], the default when absent. */
static int length_arg(json_t *req, const char *key, double def, double lo, double *out)
{
	json_t *v = json_object_get(req, key);
	double x;
	if (!v) {
		*out = def;
		return 0;
	}
	if (json_is_number(v))
		x = json_number_value(v);
	else if (json_is_string(v)) {
		char *end;
		x = strtod(json_string_value(v), &end);
		if (end == json_string_value(v) || *end)
			return -EINVAL;
	} else
		return -EINVAL;
	if (!isfinite(x) || x < lo || x > 1e7)
		return -ERANGE;
	*out = x;
	return 0;
}

/* The reply to a profile request from the held state (measured or not). */
static json_t *profile_reply(struct mlens_profile_state *st, json_t *req)
{
	json_t *o = mlens_profile_state_json(st);
	json_object_set_new(o, "ok", json_true());
	if (json_object_get(req, "step_tokens")) {
		/* the model's time for a step of the size a run actually had */
		double n, t;
		if (length_arg(req, "step_tokens", 1, 1, &n)) {
			json_decref(o);
			return fail("profile: step_tokens must be a number of tokens in [1, 10000000]");
		}
		t = mlens_profile_state_step_seconds(st, n);
		json_object_set_new(o, "step", json_pack("{s:f,s:f,s:f}", "tokens", n, "seconds", isfinite(t) ? t : -1.0,
							 "tokens_per_s", isfinite(t) && t > 0 ? n / t : -1.0));
	}
	return o;
}

/* Workload lengths of a profile request; NULL or the refusal. A length not
 * given is the held prediction's (workload_follow may have moved it from
 * the start-up 512/128), so that a bare request does not move it back. */
static json_t *profile_args(const struct mlens_profile_state *st, json_t *req, double *p, double *g)
{
	bool held = st && st->have;
	if (length_arg(req, "prompt_len", held ? st->w.p : MLENS_PROFILE_PROMPT, 0, p))
		return fail("profile: prompt_len must be a number of tokens in [0, 10000000]");
	if (length_arg(req, "gen_len", held ? st->w.g : MLENS_PROFILE_GEN, 1, g))
		return fail("profile: gen_len must be a number of tokens in [1, 10000000]");
	return NULL;
}

/* Whether a profile request measures (else it predicts from what is held). */
static bool profile_measures(struct mlens_control *c, json_t *req)
{
	const char *cmd = json_string_value(json_object_get(req, "cmd"));
	return cmd && !strcmp(cmd, "profile") && c->info->profile && c->info->profile->model &&
	       !(json_is_true(json_object_get(req, "cached")) && c->info->profile->have);
}

/* --cached with results held: arithmetic on the main thread, a what-if:
 * the held prediction (the cap's, the one stats show and workload_follow
 * compares the traffic with) stays as it is. */
static json_t *cmd_profile(struct mlens_control *c, json_t *req)
{
	struct mlens_profile_state *st = c->info->profile, what_if;
	json_t *bad;
	double p, g;
	int rc;
	if (!st || !st->model)
		return fail("profile: this daemon has no profiler");
	if ((bad = profile_args(st, req, &p, &g)))
		return bad;
	what_if = *st;
	rc = mlens_profile_state_predict(&what_if, p, g);
	if (rc)
		return fail("profile: %s", what_if.err[0] ? what_if.err : strerror(-rc));
	return profile_reply(&what_if, req);
}

static json_t *cmd_trace_cancel(struct mlens_control *c);

/* Answer one request (a parsed JSON object): a new reference to the reply. */
static json_t *handle(struct mlens_control *c, json_t *req)
{
	json_t *cmdj = json_object_get(req, "cmd");
	const char *cmd = json_string_value(cmdj);
	if (!cmd)
		return fail("a request is an object with \"cmd\": a string");
	if (!strcmp(cmd, "status"))
		return cmd_status(c);
	if (!strcmp(cmd, "tenants"))
		return cmd_tenants(c);
	if (!strcmp(cmd, "quota"))
		return cmd_quota(c, req);
	if (!strcmp(cmd, "evict"))
		return cmd_evict(c, req);
	if (!strcmp(cmd, "log-level"))
		return cmd_log_level(req);
	if (!strcmp(cmd, "config"))
		return cmd_config(c);
	if (!strcmp(cmd, "profile"))
		return cmd_profile(c, req);
	if (!strcmp(cmd, "trace"))
		return cmd_trace_cancel(c);	/* arming ones went to trace_start */
	if (!strcmp(cmd, "stats")) {
		struct mlens_worker_snapshot s;
		json_t *o;
		mlens_worker_snapshot(c->info->worker, &s);
		o = mlens_stats_json(c->info, &s);
		free(s.tenants);
		json_object_set_new(o, "ok", json_true());
		return o;
	}
	if (!strcmp(cmd, "drain")) {
		mlens_worker_set_admission(c->info->worker, false);
		c->drained_by_ctl = true;
		log_info("control: drain: admission closed (running requests go on; new ones are refused)");
		return ok();
	}
	if (!strcmp(cmd, "resume")) {
		struct mlens_worker_snapshot s;
		mlens_worker_snapshot(c->info->worker, &s);
		free(s.tenants);
		if (s.draining)
			return fail("resume: the daemon is shutting down");
		mlens_worker_set_admission(c->info->worker, true);
		c->drained_by_ctl = false;
		log_info("control: resume: admission open");
		return ok();
	}
	if (!strcmp(cmd, "shutdown"))
		return ok();	/* the caller begins the drain once this is written */
	return fail("unknown command '%s' (status, tenants, quota, drain, resume, evict, stats, log-level, "
		    "shutdown, config, profile, trace)", cmd);
}

/* ==== connections ==== */

static int trace_cancel_on_worker(void *arg, struct mlens_sched *s);

static void conn_free(struct conn *k)
{
	struct mlens_control *c = k->c;
	if (k->job)
		k->job->w.k = NULL;	/* it finishes; nobody hears the answer */
	if (k->tjob) {
		/* nobody is left to send the trace to */
		k->tjob->w.k = NULL;
		if (mlens_worker_call_async(c->info->worker, trace_cancel_on_worker, NULL))
			log_warn("control: cannot cancel the trace of a closed connection: out of memory");
	}
	*k->prevp = k->next;
	if (k->next)
		k->next->prevp = k->prevp;
	c->n_conns--;
	bufferevent_free(k->bev);
	free(k);
}

static void send_json(struct conn *k, json_t *o)
{
	char *text = json_dumps(o, JSON_COMPACT);
	if (text) {
		bufferevent_write(k->bev, text, strlen(text));
		bufferevent_write(k->bev, "\n", 1);
		free(text);
	}
}

/* Say why, then close once that is written; nothing more is read. */
static void close_with(struct conn *k, const char *why)
{
	json_t *o = fail("%s", why);
	send_json(k, o);
	json_decref(o);
	k->closing = true;
	bufferevent_disable(k->bev, EV_READ);
	log_debug("control: closing the connection of pid %d: %s", (int)k->pid, why);
}

static bool looks_like_http(const char *line)
{
	static const char *const methods[] = { "GET ", "POST ", "HEAD ", "PUT ", "DELETE ", "OPTIONS ",
					       "CONNECT ", "PATCH ", "TRACE " };
	for (size_t i = 0; i < sizeof(methods) / sizeof(methods[0]); i++)
		if (!strncmp(line, methods[i], strlen(methods[i])))
			return true;
	return strstr(line, " HTTP/1.") != NULL;
}

/* ==== the profile on the worker thread ==== */

static void on_read(struct bufferevent *bev, void *arg);

/* ==== jobs on the worker thread ==== */

/* The worker thread: the job is done (after this the main thread may free
 * it at any moment). */
static void wjob_notify(struct wjob *w, const char *what)
{
	uint64_t one = 1;
	if (write(w->efd, &one, sizeof(one)) < 0)
		log_error("control: cannot tell the main loop that the %s is done: %s", what, strerror(errno));
}

static void on_wjob(evutil_socket_t fd, short what, void *arg);

/* Hand job arg (whose first member is w) to the worker for k; k reads no
 * more lines until the answer, which the kind's finish gives when the
 * worker notified. 0, or -1: nothing started, k told so, the job freed. */
static int wjob_start(struct wjob *w, const struct wjob_kind *kind, struct conn *k, mlens_worker_fn fn, void *arg)
{
	struct mlens_control *c = k->c;
	w->kind = kind;
	w->c = c;
	w->k = k;
	w->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	w->ev = w->efd >= 0 ? event_new(c->base, w->efd, EV_READ | EV_PERSIST, on_wjob, w) : NULL;
	if (!w->ev || event_add(w->ev, NULL) || mlens_worker_call_async(c->info->worker, fn, arg)) {
		json_t *bad = fail("%s: cannot start it: out of memory or file descriptors", kind->name);
		kind->free(w);
		send_json(k, bad);
		json_decref(bad);
		return -1;
	}
	/* reading goes on, so that a hang-up is seen (a trace nobody waits
	 * for is cancelled), but no line is taken until the answer; the job
	 * may take longer than the idle timeout */
	bufferevent_set_timeouts(k->bev, NULL, NULL);
	return 0;
}

static void wjob_fini(struct wjob *w)
{
	if (w->ev)
		event_free(w->ev);
	if (w->efd >= 0)
		close(w->efd);
}

/* The eventfd has the worker's notice (else a spurious wake-up). */
static bool wjob_fired(evutil_socket_t fd)
{
	uint64_t v;
	return read(fd, &v, sizeof(v)) == (ssize_t)sizeof(v);
}

/* At shutdown: wait for the worker's notice (the worker stops after the
 * control socket, and must not write into freed memory). */
static void wjob_wait(struct wjob *w, const char *what)
{
	struct pollfd pfd = { w->efd, POLLIN, 0 };
	uint64_t v;
	while (poll(&pfd, 1, -1) < 0 && errno == EINTR)
		;
	if (read(w->efd, &v, sizeof(v)) < 0)
		log_warn("control: %s at shutdown: %s", what, strerror(errno));
}

/* Answer the job's connection, if it is still there, and read its next
 * lines (those that came meanwhile first). Takes rep. */
static void wjob_answer(struct wjob *w, json_t *rep)
{
	struct conn *k = w->k;
	if (k) {
		send_json(k, rep);
		if (!k->closing)
			on_read(k->bev, k);
	}
	json_decref(rep);
}

/* Main thread, the worker done: the answer, then the job is freed. */
static void wjob_done(struct wjob *w)
{
	wjob_answer(w, w->kind->finish(w));
	w->kind->free(w);
}

static void on_wjob(evutil_socket_t fd, short what, void *arg)
{
	(void)what;
	if (wjob_fired(fd))
		wjob_done(arg);
}

static int profile_on_worker(void *arg, struct mlens_sched *s)
{
	struct profile_job *j = arg;
	int rc = mlens_profile_state_run(&j->st, s, j->p, j->g, false);
	j->rc = rc;
	wjob_notify(&j->w, "profile");
	return rc;
}

static void job_free(struct wjob *w)
{
	struct profile_job *j = (struct profile_job *)w;
	wjob_fini(w);
	json_decref(j->req);
	free(j);
}

/* The worker done: publish the results. */
static json_t *job_finish(struct wjob *w)
{
	struct profile_job *j = (struct profile_job *)w;
	struct mlens_control *c = w->c;
	struct mlens_profile_state *st = c->info->profile;
	json_t *rep;
	if (j->rc == 0) {
		*st = j->st;
		log_info("control: profile done in %.2f s: n_real %.0f, %s binds, token cap %d", st->prof.seconds,
			 st->pred.n_real, mlens_perf_tier_name(&st->hw, st->pred.time.bind), st->token_cap);
		rep = profile_reply(st, j->req);
	} else {
		log_warn("control: profile failed: %s", j->st.err[0] ? j->st.err : strerror(-j->rc));
		rep = fail("profile: %s", j->st.err[0] ? j->st.err : strerror(-j->rc));
	}
	c->job = NULL;
	if (w->k)
		w->k->job = NULL;
	return rep;
}

static const struct wjob_kind profile_kind = { "profile", job_finish, job_free };

/* Queue a measuring profile for k; k reads no more lines until it is done. */
static void profile_start(struct conn *k, json_t *req)
{
	struct mlens_control *c = k->c;
	struct profile_job *j;
	json_t *bad;
	double p, g;
	if ((bad = profile_args(c->info->profile, req, &p, &g)) ||
	    (c->job && (bad = fail("profile: one is measuring already; ask again when it is done")))) {
		send_json(k, bad);
		json_decref(bad);
		return;
	}
	j = calloc(1, sizeof(*j));
	if (!j) {
		bad = fail("profile: out of memory");
		send_json(k, bad);
		json_decref(bad);
		return;
	}
	j->st = *c->info->profile;
	j->p = p;
	j->g = g;
	j->req = json_incref(req);
	if (wjob_start(&j->w, &profile_kind, k, profile_on_worker, j))
		return;
	c->job = j;
	k->job = j;
	log_info("control: profiling the machine on the worker thread (steps pause until it is done)");
}

/* ==== step traces on the worker thread ==== */

static void trace_done_cb(void *arg, const struct mlens_trace_result *res)
{
	struct trace_job *j = arg;
	j->res = *res;
	wjob_notify(&j->w, "trace");
}

static int trace_on_worker(void *arg, struct mlens_sched *s)
{
	struct trace_job *j = arg;
	struct mlens_trace_result res;
	int rc;
	memset(&res, 0, sizeof(res));
	rc = mlens_trace_arm(mlens_engine_trace(mlens_sched_engine(s)), j->steps, NULL, trace_done_cb, j,
			     res.err, sizeof(res.err));
	if (rc) {
		res.rc = rc;
		trace_done_cb(j, &res);
	}
	return rc;
}

/* Cancels whatever trace is armed (the arg is not read: the job it served
 * may be gone by the time this runs). */
static int trace_cancel_on_worker(void *arg, struct mlens_sched *s)
{
	(void)arg;
	mlens_trace_cancel(mlens_engine_trace(mlens_sched_engine(s)));
	return 0;
}

static void tjob_free(struct wjob *w)
{
	struct trace_job *j = (struct trace_job *)w;
	wjob_fini(w);
	json_decref(j->res.trace);
	free(j);
}

/* The reply: the counts and the trace itself (taken from r). */
static json_t *trace_reply(struct mlens_trace_result *r)
{
	json_t *o;
	if (r->rc)
		return fail("trace: %s", r->err[0] ? r->err : strerror(-r->rc));
	o = json_pack("{s:b,s:I,s:I,s:I,s:o}", "ok", 1, "steps", (json_int_t)r->steps, "spans",
		      (json_int_t)r->spans, "dropped_spans", (json_int_t)r->dropped, "trace", r->trace);
	r->trace = NULL;	/* json_pack's "o" took it, or freed it on failure */
	return o ? o : fail("trace: out of memory sending the trace of %llu spans", (unsigned long long)r->spans);
}

static json_t *tjob_finish(struct wjob *w)
{
	struct trace_job *j = (struct trace_job *)w;
	struct mlens_control *c = w->c;
	json_t *rep;
	if (j->res.rc)
		log_warn("control: trace: %s", j->res.err[0] ? j->res.err : strerror(-j->res.rc));
	else
		log_info("control: trace of %u steps recorded (%llu spans, %llu dropped)%s", j->res.steps,
			 (unsigned long long)j->res.spans, (unsigned long long)j->res.dropped,
			 j->w.k ? ": sent to mlensctl" : "; its requester is gone");
	rep = trace_reply(&j->res);
	c->tjob = NULL;
	if (w->k)
		w->k->tjob = NULL;
	return rep;
}

static const struct wjob_kind trace_kind = { "trace", tjob_finish, tjob_free };

/* A trace request that arms (the others, cancel and refusals, are answered
 * by handle()). */
static bool trace_arms(json_t *req)
{
	const char *cmd = json_string_value(json_object_get(req, "cmd"));
	return cmd && !strcmp(cmd, "trace") && !json_is_true(json_object_get(req, "cancel"));
}

/* Steps of a trace request: a number or a string of one, default 4. */
static int trace_steps_arg(json_t *req, int *steps)
{
	json_t *v = json_object_get(req, "steps");
	long long n;
	char *end;
	if (!v) {
		*steps = 4;
		return 0;
	}
	if (json_is_integer(v)) {
		n = json_integer_value(v);
	} else if (json_is_string(v)) {
		n = strtoll(json_string_value(v), &end, 10);
		if (end == json_string_value(v) || *end)
			return -EINVAL;
	} else {
		return -EINVAL;
	}
	if (n < 1 || n > MLENS_TRACE_MAX_STEPS)
		return -ERANGE;
	*steps = (int)n;
	return 0;
}

/* Arm a trace for k on the worker; k reads no more lines until it is written. */
static void trace_start(struct conn *k, json_t *req)
{
	struct mlens_control *c = k->c;
	struct trace_job *j = NULL;
	json_t *bad = NULL;
	int steps;
	if (trace_steps_arg(req, &steps))
		bad = fail("trace: steps must be a number in [1, %d]", MLENS_TRACE_MAX_STEPS);
	else if (json_object_get(req, "path"))
		bad = fail("trace: the daemon writes no file: it sends the trace, and mlensctl writes it");
	else if (c->tjob)
		bad = fail("trace: one is recording already (for pid %d); wait for it or cancel it",
			   c->tjob->w.k ? (int)c->tjob->w.k->pid : 0);
	else if (!(j = calloc(1, sizeof(*j))))
		bad = fail("trace: out of memory");
	if (bad) {
		send_json(k, bad);
		json_decref(bad);
		return;
	}
	j->steps = steps;
	if (wjob_start(&j->w, &trace_kind, k, trace_on_worker, j))
		return;
	c->tjob = j;
	k->tjob = j;
	log_info("control: tracing the next %d steps for pid %d", steps, (int)k->pid);
}

/* trace with cancel: stop the armed trace; its requester hears -ECANCELED. */
static json_t *cmd_trace_cancel(struct mlens_control *c)
{
	if (!c->tjob)
		return fail("trace: none is recording");
	if (mlens_worker_call_async(c->info->worker, trace_cancel_on_worker, NULL))
		return fail("trace: cannot cancel: out of memory");
	log_info("control: trace cancelled");
	return ok();
}

static void on_read(struct bufferevent *bev, void *arg)
{
	struct conn *k = arg;
	struct evbuffer *in = bufferevent_get_input(bev);
	while (!k->closing && !k->job && !k->tjob) {
		size_t eol_len = 0, n;
		struct evbuffer_ptr p = evbuffer_search_eol(in, NULL, &eol_len, EVBUFFER_EOL_LF);
		char *line;
		json_t *req, *rep;
		json_error_t je;
		if (p.pos < 0)
			break;
		if ((size_t)p.pos > MLENS_CONTROL_MAX_LINE) {
			close_with(k, "request longer than 64 KiB");
			return;
		}
		line = evbuffer_readln(in, &n, EVBUFFER_EOL_LF);
		if (!line)
			break;
		if (n && line[n - 1] == '\r')
			line[--n] = 0;
		if (looks_like_http(line)) {
			static const char resp[] = "HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain\r\n"
				"Connection: close\r\n\r\nthis is mlensd's control socket: use mlensctl(8); "
				"Prometheus metrics are at stats_http\r\n";
			free(line);
			bufferevent_write(bev, resp, sizeof(resp) - 1);
			k->closing = true;
			bufferevent_disable(bev, EV_READ);
			log_debug("control: HTTP on the control socket from pid %d: closed", (int)k->pid);
			return;
		}
		if (!n) {
			free(line);
			continue;	/* blank lines are harmless */
		}
		req = json_loadb(line, n, JSON_REJECT_DUPLICATES, &je);
		free(line);
		if (!json_is_object(req)) {
			json_decref(req);
			close_with(k, "not a JSON object: each request is one object on one line, "
				      "e.g. {\"cmd\":\"status\"}");
			return;
		}
		if (profile_measures(k->c, req)) {
			profile_start(k, req);
			json_decref(req);
			continue;	/* the loop stops while it measures */
		}
		if (trace_arms(req)) {
			trace_start(k, req);
			json_decref(req);
			continue;	/* the loop stops while it records */
		}
		rep = handle(k->c, req);
		if (json_is_true(json_object_get(rep, "ok")) &&
		    !strcmp(json_string_value(json_object_get(req, "cmd")), "shutdown")) {
			log_info("control: shutdown asked by uid %u pid %d", (unsigned)k->uid, (int)k->pid);
			k->shutdown_after = true;
			k->closing = true;
			bufferevent_disable(bev, EV_READ);
		}
		json_decref(req);
		send_json(k, rep);
		json_decref(rep);
	}
	if (k->closing)
		return;
	if (evbuffer_get_length(in) > MLENS_CONTROL_MAX_LINE) {
		close_with(k, "request longer than 64 KiB");
		return;
	}
	if (k->job || k->tjob)
		return;	/* lines wait for the job's answer */
	/* a partial line must complete soon; an idle connection may wait longer */
	{
		struct timeval tv = { evbuffer_get_length(in) ? MLENS_CONTROL_STALL_S : MLENS_CONTROL_IDLE_S, 0 };
		bufferevent_set_timeouts(bev, &tv, NULL);
	}
}

/* Free k; a shutdown it asked for starts once it is gone. */
static void conn_end(struct conn *k)
{
	void (*fn)(void *) = k->shutdown_after ? k->c->shutdown : NULL;
	void *fa = k->c->shutdown_arg;
	conn_free(k);
	if (fn)
		fn(fa);
}

static void on_write(struct bufferevent *bev, void *arg)
{
	struct conn *k = arg;
	if (!k->closing || evbuffer_get_length(bufferevent_get_output(bev)))
		return;
	conn_end(k);
}

static void on_event(struct bufferevent *bev, short what, void *arg)
{
	struct conn *k = arg;
	(void)bev;
	if (what & BEV_EVENT_TIMEOUT)
		log_debug("control: pid %d stalled: connection closed", (int)k->pid);
	conn_end(k);
}

static void refuse(int fd, const char *why)
{
	char line[256];
	int n = snprintf(line, sizeof(line), "{\"ok\":false,\"error\":\"%s\"}\n", why);
	if (send(fd, line, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
		/* the peer is gone: nothing to tell */
	}
	close(fd);
}

static void on_accept(void *arg, int fd, const struct ucred *cr)
{
	static struct mlens_log_limit lim = MLENS_LOG_LIMIT_INIT(10, 10.0);
	struct mlens_control *c = arg;
	struct conn *k;
	struct timeval tv = { MLENS_CONTROL_IDLE_S, 0 };
	if (!mlens_access_allowed(&c->access, cr->uid, cr->gid)) {
		mlens_log_limited(&lim, MLENS_LOG_WARN, "control: refused uid %u (pid %d): only the daemon's user, "
				  "root%s%s may control it", (unsigned)cr->uid, (int)cr->pid,
				  c->access.groups[0] ? " and group " : "", c->access.groups);
		refuse(fd, "permission denied: only the daemon's user, root or control_group may use the control socket");
		return;
	}
	if (c->n_conns >= MLENS_CONTROL_MAX_CONNS) {
		mlens_log_limited(&lim, MLENS_LOG_WARN, "control: refused pid %d: %d connections already open",
				  (int)cr->pid, c->n_conns);
		refuse(fd, "too many control connections: try again later");
		return;
	}
	k = calloc(1, sizeof(*k));
	if (!k) {
		close(fd);
		return;
	}
	k->bev = bufferevent_socket_new(c->base, fd, BEV_OPT_CLOSE_ON_FREE);
	if (!k->bev) {
		close(fd);
		free(k);
		return;
	}
	k->c = c;
	k->uid = cr->uid;
	k->pid = cr->pid;
	k->next = c->conns;
	if (c->conns)
		c->conns->prevp = &k->next;
	k->prevp = &c->conns;
	c->conns = k;
	c->n_conns++;
	bufferevent_setcb(k->bev, on_read, on_write, on_event, k);
	bufferevent_set_timeouts(k->bev, &tv, NULL);
	bufferevent_enable(k->bev, EV_READ | EV_WRITE);
}

int mlens_control_bind(struct mlens_control **out, const struct mlens_config *cfg, char *err, size_t errlen)
{
	struct mlens_control *c = calloc(1, sizeof(*c));
	int rc;
	if (!c) {
		snprintf(err, errlen, "control: out of memory");
		return -ENOMEM;
	}
	mlens_listener_init(&c->l);
	if (cfg->control && cfg->control[0]) {
		rc = mlens_listener_bind(&c->l, cfg->control, SOCK_STREAM, 0600, cfg->control_group,
					 "control socket", err, errlen);
		if (rc) {
			free(c);
			return rc;
		}
	}
	*out = c;
	return 0;
}

int mlens_control_start(struct mlens_control *c, struct event_base *base, struct mlens_daemon_info *info,
			void (*shutdown)(void *arg), void *arg, char *err, size_t errlen)
{
	c->base = base;
	c->info = info;
	c->shutdown = shutdown;
	c->shutdown_arg = arg;
	c->access.users = "";
	c->access.groups = info->cfg->control_group ? info->cfg->control_group : "";
	if (c->l.fd < 0)
		return 0;
	return mlens_listener_start(&c->l, base, on_accept, c, err, errlen);
}

void mlens_control_destroy(struct mlens_control *c)
{
	if (!c)
		return;
	while (c->conns)
		conn_free(c->conns);
	if (c->job) {
		/* the worker still runs it (it stops after the control socket):
		 * wait, so that it does not write into freed memory */
		wjob_wait(&c->job->w, "profile");
		wjob_done(&c->job->w);
	}
	if (c->tjob) {
		/* armed on the worker (it stops after the control socket): cancel
		 * it unless it is done already, and wait for its answer */
		if (mlens_worker_call_async(c->info->worker, trace_cancel_on_worker, NULL))
			log_warn("control: cannot cancel the trace at shutdown: out of memory");
		wjob_wait(&c->tjob->w, "trace");
		wjob_done(&c->tjob->w);
	}
	mlens_listener_close(&c->l);
	free(c);
}
