/* Stats socket, the loopback HTTP listener (/metrics, /health), and the
 * JSON and Prometheus renderings of the worker's snapshot. Main thread only. */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/listener.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/queue.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include "daemon/ops/listen.h"
#include "daemon/log.h"
#include "daemon/model/disk_tier.h"
#include "daemon/plan/profiler.h"
#include "daemon/ops/stats.h"
#include "daemon/serve/tenant.h"

/* The HTTP listener's bounds: connections held at once, seconds a
 * connection may stay silent or half-written, bytes of request headers. */
#define HTTP_MAX_CONNS 64
#define HTTP_TIMEOUT_S 5
#define HTTP_MAX_HEADERS 8192

/* One HTTP connection, from its bufferevent's creation to its close. */
struct http_conn {
	struct mlens_stats *s;
	struct bufferevent *bev;
	struct evhttp_connection *evcon;	/* NULL until attached */
	bool asked;		/* a whole request came in */
	bool evicted;		/* shut down to make room; evhttp closes it */
	TAILQ_ENTRY(http_conn) link;
};

struct mlens_stats {
	struct mlens_daemon_info *info;
	struct event_base *base;
	struct mlens_listener l;
	struct mlens_access access;
	int http_fd;		/* bound at start-up; evhttp owns it once listening */
	struct evhttp *http;
	/* the HTTP connections, oldest first, and an event that attaches new
	 * ones to their evhttp connection once evhttp has made it */
	TAILQ_HEAD(, http_conn) conns;
	unsigned n_conns;
	struct event *attach_ev;
};

/* ==== renderings ==== */

static double bucket_bound(int i)
{
	return mlens_latency_buckets[i];
}

static json_t *hist_json(const struct mlens_hist *h)
{
	json_t *o = json_object(), *b = json_array();
	uint64_t cum = 0;
	for (int i = 0; i < MLENS_LAT_BUCKETS; i++) {
		cum += h->bucket[i];
		if (i == MLENS_LAT_BUCKETS - 1)
			json_array_append_new(b, json_pack("{s:s,s:I}", "le", "+Inf", "count", (json_int_t)cum));
		else
			json_array_append_new(b, json_pack("{s:f,s:I}", "le", bucket_bound(i), "count", (json_int_t)cum));
	}
	json_object_set_new(o, "buckets", b);
	json_object_set_new(o, "count", json_integer((json_int_t)h->count));
	json_object_set_new(o, "sum", json_real(h->sum));
	return o;
}

/* The hybrid pipeline's resident experts: the rule, the hit counts and
 * per layer its set and swaps. */
static void residency_json(json_t *o, const struct mlens_sched_stats *st)
{
	json_t *sets = json_array(), *swaps = json_array();
	json_object_set_new(o, "expert_residency", json_string(st->residency_routing ? "routing" : "static"));
	json_object_set_new(o, "expert_routed_rows_total", json_integer((json_int_t)st->expert_rows));
	json_object_set_new(o, "expert_resident_rows_total",
			    json_integer((json_int_t)st->expert_resident_rows));
	json_object_set_new(o, "expert_resident_hit_ratio", json_real(mlens_sched_resident_hit_ratio(st)));
	json_object_set_new(o, "expert_swaps_total", json_integer((json_int_t)st->expert_swaps));
	for (int l = 0; l < st->res_layers; l++) {
		json_t *a = json_array();
		for (int x = 0; x < st->res_experts; x++)
			if (st->res_set[l][x / 64] >> (x % 64) & 1)
				json_array_append_new(a, json_integer(x));
		json_array_append_new(sets, a);
		json_array_append_new(swaps, json_integer((json_int_t)st->res_swaps[l]));
	}
	json_object_set_new(o, "expert_resident_sets", sets);
	json_object_set_new(o, "expert_swaps_by_layer", swaps);
}

/* op_timing: each op's seconds on the compute queue, FLOPs and calls
 * (daemon/exec/op_time.h), by the names of mlens_layer_op_name. */
/* One array a layer of the model: the experts on disk (disk) or in RAM
 * now, [] for a dense layer. */
static json_t *disk_sets_json(struct mlens_disk_tier *dt, const struct mlens_disk_tier_stats *d, bool disk)
{
	json_t *a = json_array();
	uint8_t *on = calloc((size_t)d->model_experts + 1, 1);

	for (int l = 0; a && on && l < d->model_layers; l++) {
		json_t *set = json_array();
		if (mlens_disk_tier_get_layer(dt, l, on))
			for (int e = 0; e < d->model_experts; e++)
				if ((on[e] != 0) == disk)
					json_array_append_new(set, json_integer(e));
		json_array_append_new(a, set);
	}
	free(on);
	return a;
}

static json_t *gpu_ops_json(const struct mlens_op_time_totals *t)
{
	json_t *o = json_object();
	for (int i = 0; i < MLENS_LAYER_OP_N; i++)
		json_object_set_new(o, mlens_layer_op_name((enum mlens_layer_op)i),
				    json_pack("{s:f,s:f,s:I}", "seconds", t->seconds[i], "flops", t->flops[i],
					      "calls", (json_int_t)t->calls[i]));
	return o;
}

json_t *mlens_stats_json(const struct mlens_daemon_info *info, const struct mlens_worker_snapshot *snap)
{
	const struct mlens_sched_stats *st = &snap->sched;
	json_t *o = json_object(), *ta = json_array();
	json_object_set_new(o, "uptime_seconds", json_real(mlens_now() - info->started));
	json_object_set_new(o, "requests_running", json_integer(st->running));
	json_object_set_new(o, "requests_waiting", json_integer(st->waiting));
	json_object_set_new(o, "requests_done_total", json_integer((json_int_t)st->requests_done));
	json_object_set_new(o, "requests_failed_total", json_integer((json_int_t)st->requests_failed));
	json_object_set_new(o, "preemptions_total", json_integer((json_int_t)st->preemptions));
	json_object_set_new(o, "repreemptions_total", json_integer((json_int_t)st->repreemptions));
	json_object_set_new(o, "steps_short_total", json_integer((json_int_t)st->steps_short));
	json_object_set_new(o, "decodes_deferred_total", json_integer((json_int_t)st->decodes_deferred));
	json_object_set_new(o, "prompt_tokens_total", json_integer((json_int_t)st->prompt_tokens));
	json_object_set_new(o, "generation_tokens_total", json_integer((json_int_t)st->generated_tokens));
	json_object_set_new(o, "kv_blocks_used", json_integer(snap->kv_blocks_used));
	json_object_set_new(o, "kv_blocks_total", json_integer(snap->kv_blocks_total));
	json_object_set_new(o, "kv_room_taken_total", json_integer((json_int_t)snap->kv_room_taken));
	json_object_set_new(o, "steps_total", json_integer((json_int_t)st->steps));
	json_object_set_new(o, "step_seconds_sum", json_real(st->step_seconds_sum));
	json_object_set_new(o, "last_step_tokens", json_integer(st->last_step_tokens));
	json_object_set_new(o, "last_step_seqs", json_integer(st->last_step_seqs));
	json_object_set_new(o, "last_step_seconds", json_real(st->last_step_seconds));
	json_object_set_new(o, "preempt_mode", json_boolean(st->preempt_mode));
	if (st->hybrid) {
		json_object_set_new(o, "pcie_h2d_bytes_total", json_integer((json_int_t)st->pcie_h2d_bytes));
		json_object_set_new(o, "pcie_d2h_bytes_total", json_integer((json_int_t)st->pcie_d2h_bytes));
		json_object_set_new(o, "last_step_weight_bytes",
				    json_integer((json_int_t)st->last_step_weight_bytes));
		json_object_set_new(o, "cpu_attention_seconds_total", json_real(st->cpu_attn_seconds));
		json_object_set_new(o, "cpu_append_seconds_total", json_real(st->cpu_append_seconds));
		json_object_set_new(o, "host_wait_seconds_total", json_real(st->host_wait_seconds));
		json_object_set_new(o, "gpu_busy_seconds_total", json_real(st->gpu_busy_seconds));
		json_object_set_new(o, "h2d_busy_seconds_total", json_real(st->h2d_busy_seconds));
		json_object_set_new(o, "last_step_gpu_busy_seconds", json_real(st->last_step_gpu_busy_seconds));
		json_object_set_new(o, "last_step_h2d_busy_seconds", json_real(st->last_step_h2d_busy_seconds));
		json_object_set_new(o, "kv_read_bytes_total", json_integer((json_int_t)st->kv_read_bytes));
		json_object_set_new(o, "kv_read_blocks_total", json_integer((json_int_t)st->kv_read_blocks));
		json_object_set_new(o, "kv_read_block_runs_total", json_integer((json_int_t)st->kv_read_runs));
		residency_json(o, st);
	}
	if (st->op_timing) {
		json_object_set_new(o, "gpu_ops", gpu_ops_json(&st->ops));
		json_object_set_new(o, "gpu_op_span_seconds_total", json_real(st->ops.span_s));
		json_object_set_new(o, "gpu_op_steps_total", json_integer((json_int_t)st->ops.steps));
		json_object_set_new(o, "gpu_ops_dropped_total", json_integer((json_int_t)st->ops.dropped));
	}
	if (info->disk) {
		struct mlens_disk_tier_stats d;
		mlens_disk_tier_get_stats(info->disk, &d);
		json_object_set_new(o, "weights_disk_resident_bytes", json_integer((json_int_t)d.disk_bytes));
		json_object_set_new(o, "weights_disk_step_bytes", json_integer((json_int_t)d.step_bytes));
		json_object_set_new(o, "weights_disk_read_bytes_total", json_integer((json_int_t)d.read_bytes_total));
		json_object_set_new(o, "weights_disk_read_errors_total", json_integer((json_int_t)d.errors_total));
		json_object_set_new(o, "weights_disk_busy_seconds_total", json_real(d.busy_seconds_total));
		json_object_set_new(o, "last_step_disk_read_bytes", json_integer((json_int_t)d.last_step_bytes));
		json_object_set_new(o, "last_step_disk_busy_ratio", json_real(d.last_step_busy));
		json_object_set_new(o, "weights_disk_ceiling_bytes_per_second", json_real(d.ceiling_bps));
		json_object_set_new(o, "weights_disk_trades_total", json_integer((json_int_t)d.trades_total));
		json_object_set_new(o, "weights_disk_trade_errors_total", json_integer((json_int_t)d.trade_errors_total));
		json_object_set_new(o, "weights_disk_experts_ram", disk_sets_json(info->disk, &d, false));
		json_object_set_new(o, "weights_disk_experts_disk", disk_sets_json(info->disk, &d, true));
	}
	if (st->kv_swap) {
		const struct mlens_kv_swap_stats *w = &st->swap;
		json_object_set_new(o, "kv_swap_bytes_out_total", json_integer((json_int_t)w->bytes_out));
		json_object_set_new(o, "kv_swap_bytes_in_total", json_integer((json_int_t)w->bytes_in));
		json_object_set_new(o, "kv_swaps_total", json_integer((json_int_t)w->swaps));
		json_object_set_new(o, "kv_swap_ins_total", json_integer((json_int_t)w->swap_ins));
		json_object_set_new(o, "kv_swap_recomputes_total", json_integer((json_int_t)w->recomputes));
		json_object_set_new(o, "kv_swap_full_total", json_integer((json_int_t)w->full));
		json_object_set_new(o, "kv_swap_errors_total", json_integer((json_int_t)w->errors));
		json_object_set_new(o, "kv_swap_io_seconds_total", json_real(w->io_seconds));
		json_object_set_new(o, "kv_swap_slots_used", json_integer(w->slots_used));
		json_object_set_new(o, "kv_swap_slots_total", json_integer(w->slots_total));
		json_object_set_new(o, "kv_swap_disk_bps", json_real(w->disk.value));
		json_object_set_new(o, "kv_swap_disk_source", json_string(mlens_kv_swap_source_name(w->disk.source)));
		json_object_set_new(o, "kv_swap_disk_measured_bps", json_real(w->measured_bps));
		json_object_set_new(o, "kv_swap_prefill_flops", json_real(w->prefill.value));
		json_object_set_new(o, "kv_swap_prefill_source",
				    json_string(mlens_kv_swap_source_name(w->prefill.source)));
	}
	json_object_set_new(o, "token_cap", json_integer(snap->token_cap));
	if (info->profile && info->profile->have) {
		const struct mlens_profile_state *ps = info->profile;
		double pred = mlens_profile_state_step_seconds(ps, st->last_step_tokens);
		json_object_set_new(o, "n_real", json_real(ps->pred.n_real));
		/* the workload of the prediction (workload_follow moves it) */
		json_object_set_new(o, "profile_prompt_len", json_real(ps->w.p));
		json_object_set_new(o, "profile_gen_len", json_real(ps->w.g));
		json_object_set_new(o, "binding_resource", json_string(mlens_perf_tier_name(&ps->hw, ps->pred.time.bind)));
		json_object_set_new(o, "step_seconds_predicted", isfinite(pred) ? json_real(pred) : json_null());
		json_object_set_new(o, "step_seconds_measured", json_real(st->last_step_seconds));
	}
	json_object_set_new(o, "admission", json_string(snap->draining ? "draining" : snap->admission ? "open" : "closed"));
	json_object_set_new(o, "tenants", json_integer(snap->n_tenants));
	json_object_set_new(o, "tenants_attached_total", json_integer((json_int_t)snap->tenants_attached_total));
	json_object_set_new(o, "tenants_detached_total", json_integer((json_int_t)snap->tenants_detached_total));
	json_object_set_new(o, "bad_entries_total", json_integer((json_int_t)snap->bad_entries_total));
	json_object_set_new(o, "time_to_first_token_seconds", hist_json(&st->ttft));
	json_object_set_new(o, "time_per_output_token_seconds", hist_json(&st->tpot));
	for (int i = 0; i < snap->n_tenants; i++)
		mlens_tenant_json_append(ta, &snap->tenants[i]);
	json_object_set_new(o, "tenant", ta);
	return o;
}

json_t *mlens_tenant_json(const struct mlens_tenant_info *t)
{
	json_t *o = json_pack("{s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:{s:I,s:I,s:I,s:f}}",
		"id", (json_int_t)t->id, "uid", (json_int_t)t->uid, "gid", (json_int_t)t->gid,
		"pid", (json_int_t)t->pid, "running", (json_int_t)t->running,
		"queued", (json_int_t)t->queued, "kv_blocks", (json_int_t)t->kv_blocks,
		"prompt_tokens", (json_int_t)t->prompt_tokens, "generation_tokens", (json_int_t)t->generated_tokens,
		"requests_done", (json_int_t)t->requests_done, "requests_failed", (json_int_t)t->requests_failed,
		"preemptions", (json_int_t)t->preemptions, "bad_entries", (json_int_t)t->bad_entries,
		"refused", (json_int_t)t->refused,
		"quota", "running", (json_int_t)t->quota.max_running, "kv_blocks", (json_int_t)t->quota.max_kv_blocks,
		"queued", (json_int_t)t->quota.max_queued, "weight", t->quota.weight);
	json_t *name;
	if (!o)
		return NULL;
	/* names are checked at hello; one that is not UTF-8 still shows, escaped */
	name = json_string(t->name);
	if (!name) {
		char shown[4 * sizeof(t->name)];
		mlens_name_escape(t->name, shown, sizeof(shown));
		name = json_string(shown);
	}
	if (json_object_set_new(o, "name", name)) {
		json_decref(o);
		return NULL;
	}
	return o;
}

int mlens_tenant_json_append(json_t *a, const struct mlens_tenant_info *t)
{
	if (json_array_append_new(a, mlens_tenant_json(t))) {
		log_error("tenant %u left out of a stats reply: out of memory", t->id);
		return -ENOMEM;
	}
	return 0;
}

static void prom_head(struct evbuffer *b, const char *name, const char *type, const char *help)
{
	evbuffer_add_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void prom_hist(struct evbuffer *b, const char *name, const char *help, const struct mlens_hist *h)
{
	uint64_t cum = 0;
	prom_head(b, name, "histogram", help);
	for (int i = 0; i < MLENS_LAT_BUCKETS; i++) {
		cum += h->bucket[i];
		if (i == MLENS_LAT_BUCKETS - 1)
			evbuffer_add_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
		else
			evbuffer_add_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, bucket_bound(i), (unsigned long long)cum);
	}
	evbuffer_add_printf(b, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name, (unsigned long long)h->count);
}

static void residency_prom(struct evbuffer *b, const struct mlens_sched_stats *st)
{
	prom_head(b, "mlens_expert_routed_rows_total", "counter",
		  "Rows routed to experts (tokens x top-k, every MoE layer; hybrid pipeline).");
	evbuffer_add_printf(b, "mlens_expert_routed_rows_total %llu\n", (unsigned long long)st->expert_rows);
	prom_head(b, "mlens_expert_resident_rows_total", "counter",
		  "Of those, the rows whose expert was resident on the GPU.");
	evbuffer_add_printf(b, "mlens_expert_resident_rows_total %llu\n",
			    (unsigned long long)st->expert_resident_rows);
	prom_head(b, "mlens_expert_resident_hit_ratio", "gauge",
		  "Fraction of routed rows whose expert was resident on the GPU, since start.");
	evbuffer_add_printf(b, "mlens_expert_resident_hit_ratio %.6g\n", mlens_sched_resident_hit_ratio(st));
	prom_head(b, "mlens_expert_swaps_total", "counter",
		  "Experts swapped into a layer's resident set (expert_residency = routing).");
	for (int l = 0; l < st->res_layers; l++)
		evbuffer_add_printf(b, "mlens_expert_swaps_total{layer=\"%d\"} %llu\n", l,
				    (unsigned long long)st->res_swaps[l]);
}

/* Label values escape backslash, double quote and newline. */
static void prom_label(char *out, size_t n, const char *v)
{
	size_t j = 0;
	for (; *v && j + 2 < n; v++) {
		if (*v == '\\' || *v == '"' || *v == '\n') {
			out[j++] = '\\';
			out[j++] = *v == '\n' ? 'n' : *v;
		} else {
			out[j++] = *v;
		}
	}
	out[j] = 0;
}

/* One per-tenant series: a gauge or counter of each tenant's field. */
#define PROM_TENANT(b, snap, name, type, help, field) do {					\
	prom_head(b, name, type, help);								\
	for (int i_ = 0; i_ < (snap)->n_tenants; i_++)						\
		evbuffer_add_printf(b, "%s{tenant=\"%u\"} %llu\n", name, (snap)->tenants[i_].id,	\
				    (unsigned long long)(snap)->tenants[i_].field);		\
} while (0)

void mlens_stats_prometheus(const struct mlens_daemon_info *info, const struct mlens_worker_snapshot *snap,
			    struct evbuffer *b)
{
	const struct mlens_sched_stats *st = &snap->sched;
	prom_head(b, "mlens_requests_running", "gauge", "Requests whose sequences are in the running batch.");
	evbuffer_add_printf(b, "mlens_requests_running %u\n", st->running);
	PROM_TENANT(b, snap, "mlens_tenant_requests_running", "gauge", "Running requests of a tenant.", running);
	prom_head(b, "mlens_requests_waiting", "gauge", "Requests queued, not yet admitted (or preempted).");
	evbuffer_add_printf(b, "mlens_requests_waiting %u\n", st->waiting);
	PROM_TENANT(b, snap, "mlens_tenant_requests_waiting", "gauge", "Queued requests of a tenant.", queued);
	prom_head(b, "mlens_requests_finished_total", "counter", "Requests finished, by outcome.");
	evbuffer_add_printf(b, "mlens_requests_finished_total{outcome=\"done\"} %llu\n", (unsigned long long)st->requests_done);
	evbuffer_add_printf(b, "mlens_requests_finished_total{outcome=\"failed\"} %llu\n", (unsigned long long)st->requests_failed);
	prom_head(b, "mlens_preemptions_total", "counter", "Sequences evicted from the running batch to free KV blocks.");
	evbuffer_add_printf(b, "mlens_preemptions_total %llu\n", (unsigned long long)st->preemptions);
	prom_head(b, "mlens_repreemptions_total", "counter",
		  "Of the preemptions, those of a sequence a few steps after it came back from one.");
	evbuffer_add_printf(b, "mlens_repreemptions_total %llu\n", (unsigned long long)st->repreemptions);
	prom_head(b, "mlens_steps_short_total", "counter",
		  "Steps that carried under half the token cap while requests waited.");
	evbuffer_add_printf(b, "mlens_steps_short_total %llu\n", (unsigned long long)st->steps_short);
	prom_head(b, "mlens_decodes_deferred_total", "counter",
		  "Decode tokens put off a step so that a prompt that had waited long fit the token cap.");
	evbuffer_add_printf(b, "mlens_decodes_deferred_total %llu\n", (unsigned long long)st->decodes_deferred);
	prom_head(b, "mlens_prompt_tokens_total", "counter", "Prefill tokens computed (re-prefills after preemption included).");
	evbuffer_add_printf(b, "mlens_prompt_tokens_total %llu\n", (unsigned long long)st->prompt_tokens);
	PROM_TENANT(b, snap, "mlens_tenant_prompt_tokens_total", "counter", "Prefill tokens computed for a tenant.", prompt_tokens);
	prom_head(b, "mlens_generation_tokens_total", "counter", "Tokens generated.");
	evbuffer_add_printf(b, "mlens_generation_tokens_total %llu\n", (unsigned long long)st->generated_tokens);
	PROM_TENANT(b, snap, "mlens_tenant_generation_tokens_total", "counter", "Tokens generated for a tenant.", generated_tokens);
	prom_head(b, "mlens_kv_blocks_used", "gauge", "KV cache blocks held by sequences.");
	evbuffer_add_printf(b, "mlens_kv_blocks_used %u\n", snap->kv_blocks_used);
	PROM_TENANT(b, snap, "mlens_tenant_kv_blocks_used", "gauge", "KV cache blocks held by a tenant's sequences.", kv_blocks);
	prom_head(b, "mlens_kv_blocks_total", "gauge", "KV cache blocks in the pinned pool.");
	evbuffer_add_printf(b, "mlens_kv_blocks_total %u\n", snap->kv_blocks_total);
	prom_head(b, "mlens_kv_room_taken_total", "counter",
		  "Blocks of a sequence's growth room that other sequences took because nothing else was free.");
	evbuffer_add_printf(b, "mlens_kv_room_taken_total %llu\n", (unsigned long long)snap->kv_room_taken);
	prom_hist(b, "mlens_time_to_first_token_seconds", "Time from submission to the first token.", &st->ttft);
	prom_hist(b, "mlens_time_per_output_token_seconds", "Time between two tokens of a request.", &st->tpot);
	prom_head(b, "mlens_step_seconds", "summary", "Time spent in scheduler steps.");
	evbuffer_add_printf(b, "mlens_step_seconds_sum %.9g\nmlens_step_seconds_count %llu\n", st->step_seconds_sum,
			    (unsigned long long)st->steps);
	if (st->op_timing) {
		prom_head(b, "mlens_gpu_op_seconds_total", "counter",
			  "Seconds of the compute queue in each op of the steps (op_timing, from the backend's timing marks).");
		for (int i = 0; i < MLENS_LAYER_OP_N; i++)
			evbuffer_add_printf(b, "mlens_gpu_op_seconds_total{op=\"%s\"} %.9g\n",
					    mlens_layer_op_name((enum mlens_layer_op)i), st->ops.seconds[i]);
		prom_head(b, "mlens_gpu_op_flops_total", "counter",
			  "Floating-point operations of each op's products (op_timing).");
		for (int i = 0; i < MLENS_LAYER_OP_N; i++)
			evbuffer_add_printf(b, "mlens_gpu_op_flops_total{op=\"%s\"} %.9g\n",
					    mlens_layer_op_name((enum mlens_layer_op)i), st->ops.flops[i]);
		prom_head(b, "mlens_gpu_op_span_seconds_total", "counter",
			  "Seconds from each timed step's first op to its last on the compute queue (op_timing).");
		evbuffer_add_printf(b, "mlens_gpu_op_span_seconds_total %.9g\n", st->ops.span_s);
	}
	if (info->disk) {
		struct mlens_disk_tier_stats d;
		mlens_disk_tier_get_stats(info->disk, &d);
		prom_head(b, "mlens_weights_disk_resident_bytes", "gauge",
			  "Expert bytes left in the model files (weights_on_disk), read each step.");
		evbuffer_add_printf(b, "mlens_weights_disk_resident_bytes %llu\n", (unsigned long long)d.disk_bytes);
		prom_head(b, "mlens_weights_disk_read_bytes_total", "counter", "Bytes of experts read from the model files.");
		evbuffer_add_printf(b, "mlens_weights_disk_read_bytes_total %llu\n", (unsigned long long)d.read_bytes_total);
		prom_head(b, "mlens_weights_disk_read_errors_total", "counter",
			  "Layer reads from the model files that failed (each failed its step).");
		evbuffer_add_printf(b, "mlens_weights_disk_read_errors_total %llu\n", (unsigned long long)d.errors_total);
		prom_head(b, "mlens_last_step_disk_read_bytes", "gauge", "Expert bytes read from the model files during the last step.");
		evbuffer_add_printf(b, "mlens_last_step_disk_read_bytes %llu\n", (unsigned long long)d.last_step_bytes);
		prom_head(b, "mlens_disk_busy_ratio", "gauge", "Share of the last step's time the model files were being read.");
		evbuffer_add_printf(b, "mlens_disk_busy_ratio %.6g\n", d.last_step_busy);
		prom_head(b, "mlens_weights_disk_trades_total", "counter",
			  "Disk experts moved into RAM in place of one that went to disk (weights_disk_follow).");
		evbuffer_add_printf(b, "mlens_weights_disk_trades_total %llu\n", (unsigned long long)d.trades_total);
		prom_head(b, "mlens_weights_disk_trade_errors_total", "counter",
			  "Trades whose read failed; both experts stayed where they were.");
		evbuffer_add_printf(b, "mlens_weights_disk_trade_errors_total %llu\n",
				    (unsigned long long)d.trade_errors_total);
		prom_head(b, "mlens_weights_disk_experts", "gauge", "Experts of each MoE layer in RAM and on disk.");
		evbuffer_add_printf(b, "mlens_weights_disk_experts{tier=\"ram\"} %d\nmlens_weights_disk_experts{tier=\"disk\"} %d\n",
				    d.ram_experts, d.experts);
	}
	if (st->kv_swap) {
		const struct mlens_kv_swap_stats *w = &st->swap;
		prom_head(b, "mlens_kv_swap_bytes_total", "counter",
			  "Bytes of preempted sequences' KV written to (out) and read back from (in) the KV swap file.");
		evbuffer_add_printf(b, "mlens_kv_swap_bytes_total{dir=\"out\"} %llu\nmlens_kv_swap_bytes_total{dir=\"in\"} %llu\n",
				    (unsigned long long)w->bytes_out, (unsigned long long)w->bytes_in);
		prom_head(b, "mlens_kv_swap_preemptions_total", "counter",
			  "Preempted sequences by what kept their KV: the swap file (swap) or a re-prefill (recompute).");
		evbuffer_add_printf(b, "mlens_kv_swap_preemptions_total{how=\"swap\"} %llu\n"
				    "mlens_kv_swap_preemptions_total{how=\"recompute\"} %llu\n",
				    (unsigned long long)w->swaps, (unsigned long long)w->recomputes);
		prom_head(b, "mlens_kv_swap_fallbacks_total", "counter",
			  "Re-prefills the swap was chosen for but could not serve: no room in the file or on the disk (full), an I/O error (error).");
		evbuffer_add_printf(b, "mlens_kv_swap_fallbacks_total{why=\"full\"} %llu\n"
				    "mlens_kv_swap_fallbacks_total{why=\"error\"} %llu\n",
				    (unsigned long long)w->full, (unsigned long long)w->errors);
		prom_head(b, "mlens_kv_swap_io_seconds_total", "counter",
			  "Time the scheduler's thread waited for KV swap writes and reads (between steps).");
		evbuffer_add_printf(b, "mlens_kv_swap_io_seconds_total %.9g\n", w->io_seconds);
		prom_head(b, "mlens_kv_swap_slots_used", "gauge", "Slots of the KV swap file (one KV block each) holding a preempted sequence's KV.");
		evbuffer_add_printf(b, "mlens_kv_swap_slots_used %u\n", w->slots_used);
		prom_head(b, "mlens_kv_swap_slots_total", "gauge", "Slots of the KV swap file.");
		evbuffer_add_printf(b, "mlens_kv_swap_slots_total %u\n", w->slots_total);
		prom_head(b, "mlens_kv_swap_disk_bytes_per_second", "gauge",
			  "The KV swap cost model's disk rate; source: default, measured (on the swap file at start-up), observed (swaps).");
		evbuffer_add_printf(b, "mlens_kv_swap_disk_bytes_per_second{source=\"%s\"} %.6g\n",
				    mlens_kv_swap_source_name(w->disk.source), w->disk.value);
		prom_head(b, "mlens_kv_swap_prefill_flops_per_second", "gauge",
			  "The KV swap cost model's prefill FLOP/s; source: default, profiled, observed (prefill steps).");
		evbuffer_add_printf(b, "mlens_kv_swap_prefill_flops_per_second{source=\"%s\"} %.6g\n",
				    mlens_kv_swap_source_name(w->prefill.source), w->prefill.value);
	}
	if (st->hybrid) {
		prom_head(b, "mlens_pcie_bytes_total", "counter",
			  "Bytes the hybrid pipeline copied over PCIe (h2d: streamed experts and attention outputs).");
		evbuffer_add_printf(b, "mlens_pcie_bytes_total{dir=\"h2d\"} %llu\nmlens_pcie_bytes_total{dir=\"d2h\"} %llu\n",
				    (unsigned long long)st->pcie_h2d_bytes, (unsigned long long)st->pcie_d2h_bytes);
		prom_head(b, "mlens_cpu_attention_seconds_total", "counter",
			  "Seconds of KV append and decode attention on the CPU (hybrid pipeline).");
		evbuffer_add_printf(b, "mlens_cpu_attention_seconds_total %.9g\n", st->cpu_attn_seconds);
		prom_head(b, "mlens_cpu_append_seconds_total", "counter",
			  "Of mlens_cpu_attention_seconds_total, the seconds in the KV append (hybrid pipeline).");
		evbuffer_add_printf(b, "mlens_cpu_append_seconds_total %.9g\n", st->cpu_append_seconds);
		prom_head(b, "mlens_host_wait_seconds_total", "counter",
			  "Seconds the hybrid pipeline's thread waited for the GPU.");
		evbuffer_add_printf(b, "mlens_host_wait_seconds_total %.9g\n", st->host_wait_seconds);
		prom_head(b, "mlens_gpu_busy_seconds_total", "counter",
			  "Seconds the GPU's compute queue was busy (hybrid pipeline, from the backend's timing marks).");
		evbuffer_add_printf(b, "mlens_gpu_busy_seconds_total %.9g\n", st->gpu_busy_seconds);
		prom_head(b, "mlens_h2d_busy_seconds_total", "counter",
			  "Seconds the host-to-GPU copy queue was busy (hybrid pipeline).");
		evbuffer_add_printf(b, "mlens_h2d_busy_seconds_total %.9g\n", st->h2d_busy_seconds);
		prom_head(b, "mlens_kv_read_bytes_total", "counter",
			  "KV cache bytes the CPU decode attention read (hybrid pipeline).");
		evbuffer_add_printf(b, "mlens_kv_read_bytes_total %llu\n", (unsigned long long)st->kv_read_bytes);
		prom_head(b, "mlens_kv_read_blocks_total", "counter",
			  "KV blocks the CPU decode attention read, one layer's (hybrid pipeline).");
		evbuffer_add_printf(b, "mlens_kv_read_blocks_total %llu\n", (unsigned long long)st->kv_read_blocks);
		prom_head(b, "mlens_kv_read_block_runs_total", "counter",
			  "Runs of consecutive block ids those blocks lay in; blocks / runs is the mean run.");
		evbuffer_add_printf(b, "mlens_kv_read_block_runs_total %llu\n", (unsigned long long)st->kv_read_runs);
		residency_prom(b, st);
	}
	if (info->profile && info->profile->have) {
		const struct mlens_profile_state *ps = info->profile;
		double pred = mlens_profile_state_step_seconds(ps, st->last_step_tokens);
		prom_head(b, "mlens_n_real", "gauge",
			  "Tokens per step at which GPU time per layer equals the weight transfer (the profiler's n_real).");
		evbuffer_add_printf(b, "mlens_n_real %.0f\n", ps->pred.n_real);
		prom_head(b, "mlens_profile_workload_tokens", "gauge",
			  "Mean prompt and generated tokens of a request in the workload n_real is predicted for.");
		evbuffer_add_printf(b, "mlens_profile_workload_tokens{part=\"prompt\"} %.0f\n", ps->w.p);
		evbuffer_add_printf(b, "mlens_profile_workload_tokens{part=\"generated\"} %.0f\n", ps->w.g);
		prom_head(b, "mlens_binding_resource_info", "gauge",
			  "The resource the performance model says binds a step (always 1).");
		evbuffer_add_printf(b, "mlens_binding_resource_info{resource=\"%s\"} 1\n",
				    mlens_perf_tier_name(&ps->hw, ps->pred.time.bind));
		prom_head(b, "mlens_step_seconds_predicted", "gauge",
			  "The performance model's time for a step of the last step's token count.");
		evbuffer_add_printf(b, "mlens_step_seconds_predicted %.9g\n", isfinite(pred) ? pred : 0.0);
		prom_head(b, "mlens_step_seconds_measured", "gauge", "Seconds the last step took.");
		evbuffer_add_printf(b, "mlens_step_seconds_measured %.9g\n", st->last_step_seconds);
	}
	prom_head(b, "mlens_steps_total", "counter", "Scheduler steps run.");
	evbuffer_add_printf(b, "mlens_steps_total %llu\n", (unsigned long long)st->steps);
	prom_head(b, "mlens_tenants", "gauge", "Tenants attached.");
	evbuffer_add_printf(b, "mlens_tenants %d\n", snap->n_tenants);
	prom_head(b, "mlens_tenant_info", "gauge", "A tenant's process: uid, pid and name (always 1).");
	for (int i = 0; i < snap->n_tenants; i++) {
		char shown[4 * sizeof(snap->tenants[i].name)], name[2 * sizeof(shown)];
		mlens_name_escape(snap->tenants[i].name, shown, sizeof(shown));
		prom_label(name, sizeof(name), shown);
		evbuffer_add_printf(b, "mlens_tenant_info{tenant=\"%u\",uid=\"%u\",pid=\"%d\",name=\"%s\"} 1\n",
				    snap->tenants[i].id, (unsigned)snap->tenants[i].uid, (int)snap->tenants[i].pid, name);
	}
	prom_head(b, "mlens_bad_entries_total", "counter", "Malformed ring entries refused (tenants' bugs).");
	evbuffer_add_printf(b, "mlens_bad_entries_total %llu\n", (unsigned long long)snap->bad_entries_total);
	prom_head(b, "mlens_draining", "gauge", "1 while admission is closed (drain), else 0.");
	evbuffer_add_printf(b, "mlens_draining %d\n", snap->draining || !snap->admission);
	prom_head(b, "mlens_uptime_seconds", "gauge", "Seconds since the daemon finished loading.");
	evbuffer_add_printf(b, "mlens_uptime_seconds %.3f\n", mlens_now() - info->started);
}

/* ==== the stats socket: one object per connection ==== */

/* Send all of text (it fits the socket buffer: a few KiB), then close. */
static void send_close(int fd, const char *text, size_t len)
{
	size_t off = 0;
	while (off < len) {
		ssize_t n = send(fd, text + off, len - off, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n <= 0)
			break;
		off += (size_t)n;
	}
	close(fd);
}

static void on_stats_accept(void *arg, int fd, const struct ucred *cr)
{
	static struct mlens_log_limit lim = MLENS_LOG_LIMIT_INIT(5, 10.0);
	static const char denied[] = "{\"ok\":false,\"error\":\"permission denied: only the daemon's user, "
				     "root or control_group may read the stats socket\"}\n";
	struct mlens_stats *s = arg;
	struct mlens_worker_snapshot snap;
	json_t *o;
	char *text;
	/* tenants' uids, pids and names are not for everyone, whatever the mode */
	if (!mlens_access_allowed(&s->access, cr->uid, cr->gid)) {
		mlens_log_limited(&lim, MLENS_LOG_WARN, "stats: refused uid %u (pid %d): only the daemon's user, "
				  "root%s%s may read it", (unsigned)cr->uid, (int)cr->pid,
				  s->access.groups[0] ? " and group " : "", s->access.groups);
		send_close(fd, denied, sizeof(denied) - 1);
		return;
	}
	mlens_worker_snapshot(s->info->worker, &snap);
	o = mlens_stats_json(s->info, &snap);
	free(snap.tenants);
	text = json_dumps(o, JSON_COMPACT);
	json_decref(o);
	if (!text) {
		log_error("stats: out of memory rendering the stats object");
		close(fd);
		return;
	}
	{
		size_t len = strlen(text);
		text[len] = '\n';	/* json_dumps' NUL becomes the line end */
		send_close(fd, text, len + 1);
	}
	free(text);
}

/* ==== HTTP connections: a cap, room made by the oldest idle one ==== */

/* libevent 2.1 has no evhttp_set_max_connections, so the listener counts its
 * connections itself: evhttp asks here for each connection's bufferevent,
 * and the connection's close callback, set once evhttp has made the
 * connection, ends its count. At the cap a new connection takes the place
 * of the oldest one that has not sent a whole request: silent clients can
 * hold neither more than the cap of descriptors nor the door shut on a
 * scraper. */

static void http_conn_unlink(struct http_conn *c)
{
	TAILQ_REMOVE(&c->s->conns, c, link);
	c->s->n_conns--;
}

static void on_http_conn_closed(struct evhttp_connection *evcon, void *arg)
{
	struct http_conn *c = arg;
	(void)evcon;
	http_conn_unlink(c);
	free(c);
}

/* evhttp wraps the bufferevent in its connection after the bufferevent
 * callback returns, and that connection is the bufferevent's callback
 * argument from then on; one evhttp has freed already has no callbacks
 * left. The reference taken at creation kept the bufferevent readable
 * until here. */
static void on_http_attach(evutil_socket_t fd, short what, void *arg)
{
	struct mlens_stats *s = arg;
	struct http_conn *c, *next;
	(void)fd;
	(void)what;
	for (c = TAILQ_FIRST(&s->conns); c; c = next) {
		struct bufferevent *bev = c->bev;
		bufferevent_data_cb rd = NULL;
		void *cbarg = NULL;
		next = TAILQ_NEXT(c, link);
		if (c->evcon)
			continue;
		bufferevent_getcb(bev, &rd, NULL, NULL, &cbarg);
		if (rd && cbarg) {
			c->evcon = cbarg;
			evhttp_connection_set_closecb(c->evcon, on_http_conn_closed, c);
		} else {
			http_conn_unlink(c);
			free(c);
		}
		bufferevent_decref(bev);
	}
}

/* Shut down the oldest connection that has asked nothing (else the oldest);
 * evhttp sees the end of its stream and closes it. */
static void http_make_room(struct mlens_stats *s)
{
	static struct mlens_log_limit lim = MLENS_LOG_LIMIT_INIT(5, 10.0);
	struct http_conn *c, *victim = NULL;
	TAILQ_FOREACH(c, &s->conns, link) {
		if (c->evicted)
			continue;
		if (!c->asked) {
			victim = c;
			break;
		}
		if (!victim)
			victim = c;
	}
	if (!victim)
		return;
	victim->evicted = true;
	shutdown(bufferevent_getfd(victim->bev), SHUT_RDWR);
	mlens_log_limited(&lim, MLENS_LOG_WARN, "stats_http: %d connections held: closing the oldest %s one",
			  HTTP_MAX_CONNS, victim->asked ? "kept-alive" : "silent");
}

static struct bufferevent *http_new_bev(struct event_base *base, void *arg)
{
	struct mlens_stats *s = arg;
	struct http_conn *c;
	if (s->n_conns >= HTTP_MAX_CONNS)
		http_make_room(s);
	c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;	/* evhttp makes its own, uncounted */
	c->bev = bufferevent_socket_new(base, -1, BEV_OPT_CLOSE_ON_FREE);
	if (!c->bev) {
		free(c);
		return NULL;
	}
	bufferevent_incref(c->bev);	/* until on_http_attach */
	c->s = s;
	TAILQ_INSERT_TAIL(&s->conns, c, link);
	s->n_conns++;
	event_active(s->attach_ev, EV_TIMEOUT, 1);
	return c->bev;
}

/* The connection that carried req has asked: it is no longer the first to
 * make room. */
static void http_conn_asked(struct mlens_stats *s, struct evhttp_request *req)
{
	struct evhttp_connection *evcon = evhttp_request_get_connection(req);
	struct bufferevent *bev = evcon ? evhttp_connection_get_bufferevent(evcon) : NULL;
	struct http_conn *c;
	TAILQ_FOREACH(c, &s->conns, link)
		if (bev && c->bev == bev) {
			c->asked = true;
			break;
		}
}

/* ==== HTTP: /metrics and /health ==== */

static void on_http(struct evhttp_request *req, void *arg)
{
	struct mlens_stats *s = arg;
	const char *uri = evhttp_request_get_uri(req);
	struct evhttp_uri *u = evhttp_uri_parse(uri);
	const char *path = u ? evhttp_uri_get_path(u) : NULL;
	struct evbuffer *b = evbuffer_new();
	struct evkeyvalq *out = evhttp_request_get_output_headers(req);
	enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
	struct mlens_worker_snapshot snap;

	http_conn_asked(s, req);
	if (!b)
		goto done;
	if (cmd != EVHTTP_REQ_GET && cmd != EVHTTP_REQ_HEAD) {
		evbuffer_add_printf(b, "method not allowed: this listener answers GET and HEAD\n");
		evhttp_add_header(out, "Allow", "GET, HEAD");
		evhttp_add_header(out, "Content-Type", "text/plain; charset=utf-8");
		evhttp_send_reply(req, 405, "Method Not Allowed", b);
		goto done;
	}
	if (!path || (strcmp(path, "/metrics") && strcmp(path, "/health"))) {
		evbuffer_add_printf(b, "not found: this listener serves /metrics and /health\n");
		evhttp_add_header(out, "Content-Type", "text/plain; charset=utf-8");
		evhttp_send_reply(req, HTTP_NOTFOUND, "Not Found", b);
		goto done;
	}
	mlens_worker_snapshot(s->info->worker, &snap);
	if (!strcmp(path, "/health")) {
		bool serving = snap.admission && !snap.draining;
		evbuffer_add_printf(b, "%s\n", serving ? "ok" : "draining");
		evhttp_add_header(out, "Content-Type", "text/plain; charset=utf-8");
		evhttp_send_reply(req, serving ? HTTP_OK : 503, serving ? "OK" : "Service Unavailable", b);
	} else {
		mlens_stats_prometheus(s->info, &snap, b);
		evhttp_add_header(out, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
		evhttp_send_reply(req, HTTP_OK, "OK", b);
	}
	free(snap.tenants);
done:
	if (b)
		evbuffer_free(b);
	if (u)
		evhttp_uri_free(u);
}

static void on_http_retry(evutil_socket_t fd, short what, void *arg)
{
	(void)fd;
	(void)what;
	evconnlistener_enable(arg);
}

/* accept failed for a reason retrying at once does not mend (out of
 * descriptors): pause the listener a moment rather than spin on it */
static void on_http_accept_error(struct evconnlistener *lev, void *arg)
{
	static struct mlens_log_limit lim = MLENS_LOG_LIMIT_INIT(5, 10.0);
	struct timeval tv = { 0, 250000 };
	int e = EVUTIL_SOCKET_ERROR();
	(void)arg;
	evconnlistener_disable(lev);
	if (event_base_once(evconnlistener_get_base(lev), -1, EV_TIMEOUT, on_http_retry, lev, &tv))
		evconnlistener_enable(lev);
	mlens_log_limited(&lim, MLENS_LOG_WARN, "stats_http: accept: %s (accepting pauses)", strerror(e));
}

/* "127.0.0.1:PORT", "localhost:PORT", "[::1]:PORT": host and port, or an
 * error when the host is not loopback (the listener has no authentication). */
static int parse_http_addr(const char *spec, char *host, size_t hostlen, unsigned *port, char *err, size_t errlen)
{
	const char *colon = strrchr(spec, ':');
	char h[48], *end;
	unsigned long p;
	size_t hl;
	if (!colon || colon == spec) {
		snprintf(err, errlen, "stats_http '%s': expected 127.0.0.1:PORT", spec);
		return -EINVAL;
	}
	hl = (size_t)(colon - spec);
	if (hl >= sizeof(h)) {
		snprintf(err, errlen, "stats_http '%s': the host is too long", spec);
		return -EINVAL;
	}
	memcpy(h, spec, hl);
	h[hl] = 0;
	p = strtoul(colon + 1, &end, 10);
	if (!colon[1] || *end || p > 65535) {
		snprintf(err, errlen, "stats_http '%s': '%s' is not a port number", spec, colon + 1);
		return -EINVAL;
	}
	if (!strcmp(h, "localhost") || !strcmp(h, "127.0.0.1")) {
		snprintf(host, hostlen, "127.0.0.1");
	} else if (!strcmp(h, "[::1]") || !strcmp(h, "::1")) {
		snprintf(host, hostlen, "::1");
	} else {
		struct in_addr a;
		if (inet_pton(AF_INET, h, &a) != 1 || (ntohl(a.s_addr) >> 24) != 127) {
			snprintf(err, errlen, "stats_http '%s': %s is not a loopback address; the stats listener "
				 "has no authentication, so it binds only to 127.0.0.1 or [::1] "
				 "(put a reverse proxy in front to export it)", spec, h);
			return -EINVAL;
		}
		snprintf(host, hostlen, "%s", h);
	}
	*port = (unsigned)p;
	return 0;
}

int mlens_stats_check_config(const struct mlens_config *c, char *err, size_t errlen)
{
	char host[48];
	unsigned port;
	gid_t gid;
	if (c->stats_http && c->stats_http[0] &&
	    parse_http_addr(c->stats_http, host, sizeof(host), &port, err, errlen))
		return -EINVAL;
	if (c->control_group && c->control_group[0] && mlens_group_gid(c->control_group, &gid)) {
		snprintf(err, errlen, "control_group '%s': no such group", c->control_group);
		return -EINVAL;
	}
	return 0;
}

/* The HTTP listener's socket, bound (a port in use is refused before the
 * model loads), not listening yet. The fd or -errno with err set. */
static int http_bind(const char *spec, char *err, size_t errlen)
{
	char host[48];
	unsigned port;
	union {
		struct sockaddr_in v4;
		struct sockaddr_in6 v6;
	} sa;
	socklen_t sl;
	int fd, one = 1, rc = parse_http_addr(spec, host, sizeof(host), &port, err, errlen);
	if (rc)
		return rc;
	memset(&sa, 0, sizeof(sa));
	if (strchr(host, ':')) {
		sa.v6.sin6_family = AF_INET6;
		sa.v6.sin6_port = htons((uint16_t)port);
		inet_pton(AF_INET6, host, &sa.v6.sin6_addr);
		sl = sizeof(sa.v6);
	} else {
		sa.v4.sin_family = AF_INET;
		sa.v4.sin_port = htons((uint16_t)port);
		inet_pton(AF_INET, host, &sa.v4.sin_addr);
		sl = sizeof(sa.v4);
	}
	fd = socket(strchr(host, ':') ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0) {
		rc = -errno;
		snprintf(err, errlen, "stats_http %s: socket: %s", spec, strerror(-rc));
		return rc;
	}
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(fd, (struct sockaddr *)&sa, sl)) {
		rc = -errno;
		snprintf(err, errlen, "stats_http %s: cannot listen there (%s)%s", spec, strerror(-rc),
			 rc == -EADDRINUSE ? "; the port is taken: give another" : "");
		close(fd);
		return rc;
	}
	return fd;
}

int mlens_stats_bind(struct mlens_stats **out, const struct mlens_config *c, char *err, size_t errlen)
{
	struct mlens_stats *s = calloc(1, sizeof(*s));
	int rc;
	if (!s) {
		snprintf(err, errlen, "stats: out of memory");
		return -ENOMEM;
	}
	mlens_listener_init(&s->l);
	TAILQ_INIT(&s->conns);
	s->http_fd = -1;
	if (c->stats && c->stats[0]) {
		rc = mlens_listener_bind(&s->l, c->stats, SOCK_STREAM, 0600, c->control_group, "stats socket",
					 err, errlen);
		if (rc)
			goto fail;
	}
	if (c->stats_http && c->stats_http[0]) {
		s->http_fd = http_bind(c->stats_http, err, errlen);
		if (s->http_fd < 0) {
			rc = s->http_fd;
			goto fail;
		}
	}
	*out = s;
	return 0;
fail:
	mlens_stats_destroy(s);
	return rc;
}

int mlens_stats_start(struct mlens_stats *s, struct event_base *base, struct mlens_daemon_info *info,
		      char *err, size_t errlen)
{
	const struct mlens_config *c = info->cfg;
	int rc;
	s->info = info;
	s->base = base;
	s->access.users = "";
	s->access.groups = c->control_group ? c->control_group : "";
	if (s->l.fd >= 0) {
		rc = mlens_listener_start(&s->l, base, on_stats_accept, s, err, errlen);
		if (rc)
			return rc;
	}
	if (s->http_fd >= 0) {
		char host[48];
		unsigned port;
		struct evhttp_bound_socket *bs;
		struct sockaddr_storage ss;
		socklen_t sl = sizeof(ss);
		rc = parse_http_addr(c->stats_http, host, sizeof(host), &port, err, errlen);
		if (rc)
			return rc;
		if (listen(s->http_fd, 128)) {
			rc = -errno;
			snprintf(err, errlen, "stats_http %s: listen: %s", c->stats_http, strerror(-rc));
			return rc;
		}
		s->http = evhttp_new(base);
		if (!s->http) {
			snprintf(err, errlen, "stats_http: out of memory");
			return -ENOMEM;
		}
		s->attach_ev = event_new(base, -1, 0, on_http_attach, s);
		if (!s->attach_ev) {
			snprintf(err, errlen, "stats_http: out of memory");
			return -ENOMEM;
		}
		/* a connection silent or half-written this long is closed */
		evhttp_set_timeout(s->http, HTTP_TIMEOUT_S);
		evhttp_set_max_headers_size(s->http, HTTP_MAX_HEADERS);
		evhttp_set_max_body_size(s->http, 0);
		/* every method, unknown ones too, reaches on_http, which
		 * answers 405 to all but GET and HEAD (libevent's refusal is
		 * 501, which says the server lacks the method altogether) */
		evhttp_set_allowed_methods(s->http, 0xffff);
		evhttp_set_bevcb(s->http, http_new_bev, s);
		evhttp_set_gencb(s->http, on_http, s);
		bs = evhttp_accept_socket_with_handle(s->http, s->http_fd);
		if (!bs) {
			snprintf(err, errlen, "stats_http %s: out of memory", c->stats_http);
			return -ENOMEM;
		}
		s->http_fd = -1;	/* evhttp closes it */
		evconnlistener_set_error_cb(evhttp_bound_socket_get_listener(bs), on_http_accept_error);
		if (!getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl)) {
			if (ss.ss_family == AF_INET6)
				snprintf(info->stats_http_addr, sizeof(info->stats_http_addr), "[::1]:%u",
					 ntohs(((struct sockaddr_in6 *)&ss)->sin6_port));
			else
				snprintf(info->stats_http_addr, sizeof(info->stats_http_addr), "%s:%u", host,
					 ntohs(((struct sockaddr_in *)&ss)->sin_port));
		}
		log_info("stats: Prometheus text at http://%s/metrics", info->stats_http_addr);
	}
	return 0;
}

void mlens_stats_destroy(struct mlens_stats *s)
{
	if (!s)
		return;
	if (s->http)
		evhttp_free(s->http);	/* the close callbacks free attached ones */
	while (!TAILQ_EMPTY(&s->conns)) {
		struct http_conn *c = TAILQ_FIRST(&s->conns);
		if (!c->evcon)
			bufferevent_decref(c->bev);
		http_conn_unlink(c);
		free(c);
	}
	if (s->attach_ev)
		event_free(s->attach_ev);
	if (s->http_fd >= 0)
		close(s->http_fd);
	mlens_listener_close(&s->l);
	free(s);
}
