/* mlensctl: operate a running mlensd through its control socket. One
 * request (a JSON line) per run; the reply is shown as a table, or as the
 * daemon's JSON with --json. Exit: 0 ok, 1 refused, 2 usage, 3 no daemon. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <libgen.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define EXIT_REFUSED 1
#define EXIT_USAGE 2
#define EXIT_CONNECT 3
#define REPLY_TIMEOUT_MS 30000	/* quota and evict wait for a step boundary */
#define PROFILE_TIMEOUT_MS 120000	/* the profiler takes under 30 s on a GPU */
#define TRACE_TIMEOUT_S 10	/* a trace waits for steps to run: --timeout */
#define MAX_REPLY (16u << 20)
#define MAX_TRACE_REPLY (512u << 20)	/* a trace of the daemon's most spans */

static const char *prog = "mlensctl";

static void usage(FILE *f)
{
	fprintf(f,
		"usage: %s [-s CONTROL] [--json] COMMAND [ARGS]\n"
		"commands:\n"
		"  status                      model, backend, mode, budgets, uptime, requests\n"
		"  tenants                     attached tenants and their use\n"
		"  quota TENANT [KEY=VALUE...] show, or set running, kv_blocks, queued, weight\n"
		"  drain | resume              close or reopen admission of new requests\n"
		"  evict TENANT                fail its requests, free its KV, disconnect it\n"
		"  stats                       counters and histograms\n"
		"  log-level [LEVEL]           show or set: error, warn, info, debug\n"
		"  shutdown                    drain, then exit\n"
		"  config                      the daemon's settings\n"
		"  profile [--prompt-len P] [--gen-len G] [--cached]\n"
		"                              measure the machine; n_real, policy, predicted throughput\n"
		"  trace [--steps N] [--timeout S] FILE | trace --cancel\n"
		"                              timeline of the next N steps (default 4) as Chrome trace JSON,\n"
		"                              written to FILE; waits S seconds for them (default %d, 0: no limit)\n"
		"options:\n"
		"  -s, --socket PATH           control socket (default $MLENS_CONTROL or /run/mlens/control.sock)\n"
		"  --json                      print the daemon's JSON reply\n"
		"  -h, --help, -V, --version\n", prog, TRACE_TIMEOUT_S);
}

static int die_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int die_usage(const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "%s: ", prog);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, " (see %s --help)\n", prog);
	return EXIT_USAGE;
}

/* ==== talking to the daemon ==== */

static int connect_to(const char *path)
{
	struct sockaddr_un sa;
	int fd;
	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	if (strlen(path) >= sizeof(sa.sun_path)) {
		fprintf(stderr, "%s: control socket path %s is too long\n", prog, path);
		return -1;
	}
	strcpy(sa.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
		int e = errno;
		if (e == EPROTOTYPE) {
			/* the tenant socket is a SOCK_SEQPACKET one */
			fprintf(stderr, "%s: %s is not mlensd's control socket but a socket of another kind "
				"(mlensd's tenant socket, perhaps); give the control socket with -s (control = in "
				"mlensd.conf; by default control.sock beside the tenant socket)\n", prog, path);
			close(fd);
			return -1;
		}
		fprintf(stderr, "%s: cannot connect to mlensd at %s: %s%s\n", prog, path, strerror(e),
			e == ENOENT || e == ECONNREFUSED ? " (is mlensd running? give its control socket with -s)"
			: e == EACCES ? " (only the daemon's user, root or control_group may use it)" : "");
		if (fd >= 0)
			close(fd);
		return -1;
	}
	return fd;
}

/* Send req, read one reply line of at most max bytes. NULL (message
 * printed) on failure; *timed_out says whether no reply came in
 * timeout_ms (-1: no limit), and then nothing is printed. */
static json_t *transact(int fd, json_t *req, int timeout_ms, size_t max, bool *timed_out)
{
	char *text = json_dumps(req, JSON_COMPACT), *buf = NULL;
	size_t len, off = 0, cap = 0, have = 0;
	json_t *rep;
	json_error_t je;
	if (!text)
		return NULL;
	len = strlen(text);
	text[len++] = '\n';	/* json_dumps' NUL becomes the line end */
	while (off < len) {
		ssize_t n = send(fd, text + off, len - off, MSG_NOSIGNAL);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;	/* refused at once: the reason may be waiting to be read */
		off += (size_t)n;
	}
	free(text);
	for (;;) {
		struct pollfd p = { fd, POLLIN, 0 };
		ssize_t n;
		char *nl;
		if (have + 4096 > cap) {
			char *nb;
			cap = cap ? cap * 2 : 65536;
			if (cap > max || !(nb = realloc(buf, cap))) {
				fprintf(stderr, "%s: the daemon's reply is too long\n", prog);
				free(buf);
				return NULL;
			}
			buf = nb;
		}
		if (poll(&p, 1, timeout_ms) == 0) {
			*timed_out = true;
			free(buf);
			return NULL;
		}
		n = recv(fd, buf + have, cap - have - 1, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			fprintf(stderr, "%s: the daemon closed the connection without a reply\n", prog);
			free(buf);
			return NULL;
		}
		have += (size_t)n;
		buf[have] = 0;
		if ((nl = memchr(buf, '\n', have))) {
			rep = json_loadb(buf, (size_t)(nl - buf), 0, &je);
			free(buf);
			if (!json_is_object(rep)) {
				fprintf(stderr, "%s: the daemon's reply is not JSON: %s\n", prog, je.text);
				json_decref(rep);
				return NULL;
			}
			return rep;
		}
	}
}

/* ==== human output ==== */

static json_int_t geti(json_t *o, const char *k)
{
	return json_integer_value(json_object_get(o, k));
}

static const char *gets_(json_t *o, const char *k)
{
	const char *s = json_string_value(json_object_get(o, k));
	return s ? s : "";
}

static double getf(json_t *o, const char *k)
{
	return json_number_value(json_object_get(o, k));
}

static void human_bytes(char *out, size_t n, double b)
{
	const char *u[] = { "B", "KiB", "MiB", "GiB", "TiB" };
	int i = 0;
	while (b >= 1024 && i < 4) {
		b /= 1024;
		i++;
	}
	snprintf(out, n, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

static void show_status(json_t *r)
{
	json_t *m = json_object_get(r, "model"), *b = json_object_get(r, "budgets");
	json_t *kv = json_object_get(b, "kv_cache"), *wp = json_object_get(b, "weight_pages");
	json_t *sk = json_object_get(r, "sockets"), *pl = json_object_get(r, "pipeline");
	char kvb[32], wpb[32];
	human_bytes(kvb, sizeof(kvb), (double)geti(kv, "bytes"));
	human_bytes(wpb, sizeof(wpb), (double)geti(wp, "bytes"));
	printf("mlensd %s, pid %lld, up %.0f s\n", gets_(r, "version"), (long long)geti(r, "pid"), getf(r, "uptime_seconds"));
	printf("%-14s %s (%s, %lld layers, %lld experts, top-%lld)\n", "model", gets_(m, "path"), gets_(m, "dtype"),
	       (long long)geti(m, "layers"), (long long)geti(m, "experts"), (long long)geti(m, "top_k"));
	{
		json_t *ids = json_object_get(m, "eos_token_ids"), *v;
		size_t i;

		printf("%-14s", "EOS token ids");
		json_array_foreach(ids, i, v)
			printf("%s%lld", i ? ", " : " ", (long long)json_integer_value(v));
		printf("%s\n", json_array_size(ids) ? " (generation ends there)" : " none");
	}
	printf("%-14s %s\n", "backend", gets_(r, "backend"));
	printf("%-14s %s: %s\n", "mode", gets_(r, "mode"), gets_(r, "mode_reason"));
	printf("%-14s %s\n", "admission", gets_(r, "admission"));
	printf("%-14s %lld running, %lld waiting; %lld tenants\n", "requests", (long long)geti(r, "requests_running"),
	       (long long)geti(r, "requests_waiting"), (long long)geti(r, "tenants"));
	printf("%-14s %lld tokens per step\n", "token cap", (long long)geti(r, "token_cap"));
	printf("%-14s %lld of %lld blocks used (%lld tokens each, %lld tokens, %s, %s pinned)\n",
	       "KV cache", (long long)geti(kv, "blocks_used"), (long long)geti(kv, "blocks_total"),
	       (long long)geti(kv, "block_tokens"), (long long)geti(kv, "tokens_total"),
	       gets_(kv, "dtype"), kvb);
	printf("%-14s %s pinned\n", "weight pages", wpb);
	{
		/* the effective budget (gpu_memory = 0 resolved); null: no GPU plan */
		json_t *gb = json_object_get(json_object_get(b, "gpu_memory"), "budget_bytes");
		char gbb[32];

		if (json_is_integer(gb)) {
			human_bytes(gbb, sizeof(gbb), (double)json_integer_value(gb));
			printf("%-14s %s\n", "GPU budget", gbb);
		} else {
			printf("%-14s none (no GPU memory plan on this backend)\n", "GPU budget");
		}
	}
	{
		json_t *hm = json_object_get(b, "host_memory");
		char hb[32], sb[32];
		human_bytes(hb, sizeof(hb), (double)geti(hm, "budget_bytes"));
		human_bytes(sb, sizeof(sb), (double)geti(hm, "staging_bytes"));
		printf("%-14s %s%s; staging %s\n", "host memory", geti(hm, "budget_bytes") ? hb : "no budget",
		       geti(hm, "budget_bytes") ? " budget" : "", sb);
	}
	if (json_is_object(json_object_get(b, "weights_on_disk"))) {
		json_t *wd = json_object_get(b, "weights_on_disk");
		char db[32], sb[32], rb[32];
		human_bytes(db, sizeof(db), (double)geti(wd, "disk_bytes"));
		human_bytes(sb, sizeof(sb), (double)geti(wd, "step_bytes"));
		human_bytes(rb, sizeof(rb), (double)geti(wd, "read_bytes_total"));
		printf("%-14s %s in the model files (%lld experts in each of %lld layers, %s), %s a step; %s read, "
		       "last step disk busy %.0f%%, %lld read errors\n", "weights on disk", db,
		       (long long)geti(wd, "experts_per_layer"), (long long)geti(wd, "layers"),
		       json_is_true(json_object_get(wd, "direct")) ? "O_DIRECT" : "buffered", sb, rb,
		       100.0 * getf(wd, "last_step_busy_ratio"), (long long)geti(wd, "errors_total"));
		printf("%-14s %lld experts of each layer in RAM, %lld on disk; %lld trades, %lld trade errors\n",
		       "disk trades", (long long)geti(wd, "ram_experts_per_layer"),
		       (long long)geti(wd, "experts_per_layer"), (long long)geti(wd, "trades_total"),
		       (long long)geti(wd, "trade_errors_total"));
	}
	if (json_is_object(json_object_get(b, "kv_swap"))) {
		json_t *sw = json_object_get(b, "kv_swap");
		char ob[32], ib[32];
		human_bytes(ob, sizeof(ob), (double)geti(sw, "bytes_out_total"));
		human_bytes(ib, sizeof(ib), (double)geti(sw, "bytes_in_total"));
		printf("%-14s %lld of %lld slots used in %s; %s out, %s in; %lld preempted sequences swapped, "
		       "%lld recomputed (%lld for want of room, %lld after an I/O error); cost model: disk %.3g GB/s "
		       "(%s), prefill %.3g FLOP/s (%s)\n", "KV swap",
		       (long long)geti(sw, "slots_used"), (long long)geti(sw, "slots_total"), gets_(sw, "path"), ob, ib,
		       (long long)geti(sw, "swaps_total"), (long long)geti(sw, "recomputes_total"),
		       (long long)geti(sw, "full_total"), (long long)geti(sw, "errors_total"),
		       getf(sw, "disk_bps") / 1e9, gets_(sw, "disk_source"), getf(sw, "prefill_flops"),
		       gets_(sw, "prefill_source"));
	}
	if (json_is_object(pl)) {
		/* busy shares of the pipeline's resources: what bounds a step */
		double st = getf(pl, "last_step_seconds"), tot = getf(pl, "step_seconds_total");
		char kvr[32];
		human_bytes(kvr, sizeof(kvr), getf(pl, "kv_read_bytes_total"));
		printf("%-14s last step %.4g s: GPU busy %.0f%%, H2D busy %.0f%%\n", "pipeline", st,
		       st > 0 ? 100 * getf(pl, "last_step_gpu_busy_seconds") / st : 0.0,
		       st > 0 ? 100 * getf(pl, "last_step_h2d_busy_seconds") / st : 0.0);
		printf("%-14s all steps %.4g s: GPU busy %.0f%%, H2D busy %.0f%%, CPU attention %.0f%% (%s of KV read)\n",
		       "", tot, tot > 0 ? 100 * getf(pl, "gpu_busy_seconds_total") / tot : 0.0,
		       tot > 0 ? 100 * getf(pl, "h2d_busy_seconds_total") / tot : 0.0,
		       tot > 0 ? 100 * getf(pl, "cpu_attention_seconds_total") / tot : 0.0, kvr);
		if (*gets_(pl, "expert_residency"))
			printf("%-14s %s residency: %.0f%% of routed rows on resident experts, %lld swapped in\n",
			       "experts", gets_(pl, "expert_residency"), 100 * getf(pl, "expert_resident_hit_ratio"),
			       (long long)geti(pl, "expert_swaps_total"));
	}
	printf("%-14s tenants %s, control %s, stats %s%s%s\n", "sockets", gets_(sk, "tenant"), gets_(sk, "control"),
	       gets_(sk, "stats"), *gets_(sk, "stats_http") ? ", http://" : "", gets_(sk, "stats_http"));
}

/* A name from the daemon, for a terminal: control bytes (escape
 * sequences, newlines) as \xNN, whatever the daemon let through. */
static const char *printable(const char *in, char *out, size_t n)
{
	size_t j = 0;
	for (const unsigned char *p = (const unsigned char *)in; *p && j + 5 < n; p++) {
		if (*p < 0x20 || *p == 0x7f || *p == '\\')
			j += (size_t)snprintf(out + j, n - j, "\\x%02x", *p);
		else
			out[j++] = (char)*p;
	}
	out[j] = 0;
	return out;
}

static void show_tenants(json_t *r)
{
	json_t *a = json_object_get(r, "tenants"), *t;
	char name[256];
	size_t i;
	printf("%6s %6s %7s %-16s %4s %6s %6s %10s %10s %7s %5s\n", "ID", "UID", "PID", "NAME", "RUN", "QUEUED",
	       "KV", "PROMPT", "GENERATED", "PREEMPT", "BAD");
	json_array_foreach(a, i, t)
		printf("%6lld %6lld %7lld %-16.16s %4lld %6lld %6lld %10lld %10lld %7lld %5lld\n",
		       (long long)geti(t, "id"), (long long)geti(t, "uid"), (long long)geti(t, "pid"),
		       printable(gets_(t, "name"), name, sizeof(name)),
		       (long long)geti(t, "running"), (long long)geti(t, "queued"), (long long)geti(t, "kv_blocks"),
		       (long long)geti(t, "prompt_tokens"), (long long)geti(t, "generation_tokens"),
		       (long long)geti(t, "preemptions"), (long long)geti(t, "bad_entries"));
}

static void show_quota(json_t *r)
{
	json_t *q = json_object_get(r, "quota"), *u = json_object_get(r, "use");
	printf("tenant %lld\n%-10s %10s %10s\n", (long long)geti(r, "tenant"), "", "QUOTA", "USE");
	printf("%-10s %10lld %10lld%s\n", "running", (long long)geti(q, "running"), (long long)geti(u, "running"),
	       geti(q, "running") ? "" : "  (0: no limit)");
	printf("%-10s %10lld %10lld%s\n", "kv_blocks", (long long)geti(q, "kv_blocks"), (long long)geti(u, "kv_blocks"),
	       geti(q, "kv_blocks") ? "" : "  (0: no limit)");
	printf("%-10s %10lld %10lld\n", "queued", (long long)geti(q, "queued"), (long long)geti(u, "queued"));
	printf("%-10s %10g\n", "weight", getf(q, "weight"));
}

static void show_stats(json_t *r)
{
	const char *k;
	json_t *v;
	json_object_foreach(r, k, v) {
		if (!strcmp(k, "ok") || !strcmp(k, "tenant"))
			continue;
		if (json_is_integer(v))
			printf("%-32s %lld\n", k, (long long)json_integer_value(v));
		else if (json_is_real(v))
			printf("%-32s %.6g\n", k, json_real_value(v));
		else if (json_is_string(v))
			printf("%-32s %s\n", k, json_string_value(v));
		else if (json_is_boolean(v))
			printf("%-32s %s\n", k, json_is_true(v) ? "yes" : "no");
		else if (json_is_array(v)) {
			char *t = json_dumps(v, JSON_COMPACT);
			printf("%-32s %s\n", k, t ? t : "[]");
			free(t);
		} else if (json_is_object(v) && json_object_get(v, "count")) {
			json_int_t n = geti(v, "count");
			printf("%-32s %lld samples, mean %.6g s\n", k, (long long)n, n ? getf(v, "sum") / (double)n : 0.0);
		}
	}
}

static void show_rate(const char *what, double v, const char *unit)
{
	if (v > 0)
		printf("%-16s %.2f %s\n", what, v / 1e9, unit);
	else
		printf("%-16s not measured (backend memory is host memory: nothing crosses a bus)\n", what);
}

static void show_flops(const char *what, double flops)
{
	if (flops >= 1e12)
		printf("%-16s %.2f TFLOP/s\n", what, flops / 1e12);
	else
		printf("%-16s %.2f GFLOP/s\n", what, flops / 1e9);
}

static void show_profile(json_t *r)
{
	json_t *m = json_object_get(r, "measured"), *ga = json_object_get(m, "ga"), *gb = json_object_get(m, "gb");
	json_t *pol = json_object_get(r, "policy"), *pr = json_object_get(r, "predicted"), *w = json_object_get(r, "workload");
	json_t *neq = json_object_get(r, "n_eq");
	printf("%-16s %s%s%s, %s in %.2f s\n", "profile", gets_(m, "backend"), *gets_(m, "gpu") ? " on " : "",
	       gets_(m, "gpu"), json_is_true(json_object_get(r, "from_cache")) ? "cached, measured" : "measured",
	       getf(m, "seconds"));
	printf("%-16s %.3g s + %.3g s per token (fit of %lld points)\n", "GA per layer", getf(ga, "a"), getf(ga, "b"),
	       (long long)geti(ga, "n"));
	printf("%-16s %.3g s + %.3g s per token\n", "GB per layer", getf(gb, "a"), getf(gb, "b"));
	show_flops("GEMM", getf(m, "gemm_flops"));
	if (getf(m, "prefill_attention_flops") > 0)
		show_flops("prefill attn", getf(m, "prefill_attention_flops"));
	show_rate("H2D (pinned)", getf(m, "h2d_bytes_per_s"), "GB/s");
	show_rate("D2H (pinned)", getf(m, "d2h_bytes_per_s"), "GB/s");
	if (getf(m, "compute_queue_d2h_bytes_per_s") > 0)
		printf("%-16s %.2f GB/s H2D, %.2f GB/s D2H (activations, between the GPU's kernels)\n",
		       "compute queue", getf(m, "compute_queue_h2d_bytes_per_s") / 1e9,
		       getf(m, "compute_queue_d2h_bytes_per_s") / 1e9);
	if (getf(m, "gpu_kv_store_bytes_per_s") > 0)
		printf("%-16s %.2f GB/s on the compute queue, %.2f GB/s on the side queue (the GPU's "
		       "K/V stores into host memory)\n", "GPU K/V stores",
		       getf(m, "gpu_kv_store_bytes_per_s") / 1e9,
		       getf(m, "gpu_kv_store_side_bytes_per_s") / 1e9);
	show_rate("CPU attention", getf(m, "cpu_attention_bytes_per_s"), "GB/s of KV");
	show_rate("KV append", getf(m, "kv_append_bytes_per_s"), "GB/s read + written (fp32 K, V into the pool)");
	if (getf(m, "cpu_attention_under_copy_bytes_per_s") > 0)
		printf("%-16s %.2f GB/s of KV while the weight stream copies (the model's)\n", "",
		       getf(m, "cpu_attention_under_copy_bytes_per_s") / 1e9);
	printf("%-16s %.2f GB/s read alone\n", "CPU memory", getf(m, "cpu_read_bytes_per_s") / 1e9);
	if (getf(m, "h2d_under_read_bytes_per_s") > 0)
		printf("%-16s %.2f GB/s read + %.2f GB/s H2D at once = %.2f GB/s (the model's)\n", "",
		       getf(m, "cpu_read_under_copy_bytes_per_s") / 1e9,
		       getf(m, "h2d_under_read_bytes_per_s") / 1e9, getf(m, "cpu_memory_bytes_per_s") / 1e9);
	{
		/* what bounds n_real, as the daemon says (older daemons: from
		 * n_eq and n_act) */
		const char *by = gets_(r, "n_real_bound");
		bool host = json_is_true(json_object_get(r, "host_compute"));
		if (!*by)
			by = json_is_number(neq) && getf(r, "n_eq") < getf(r, "n_act") ? "n_real" : "activation-memory";
		printf("%-16s %.0f tokens per step (%s)\n", "n_real", getf(r, "n_real"),
		       !strcmp(by, "n_real") ? "GPU time per layer equals the weight transfer (eq. 2)"
		       : !strcmp(by, "largest-step") ? (host ? "CPU backend: no PCIe, nothing streams; the engine's "
							       "largest step bounds it"
							     : "nothing streams: the engine's largest step bounds it")
		       : json_is_number(neq) ? "the activation memory bounds it below eq. 2"
		       : "nothing streams: the activation memory bounds it");
	}
	printf("%-16s %lld resident experts per layer (%s); group alpha takes %.0f%% of decode, %.0f%% of prefill tokens\n",
	       "policy", (long long)geti(pol, "resident_experts"),
	       strcmp(gets_(r, "mode"), "hybrid") ? "every expert resident" : "searched",
	       100 * getf(pol, "alpha_decode"), 100 * getf(pol, "alpha_prefill"));
	printf("%-16s %s\n", "binding", gets_(r, "binding"));
	{
		/* each resource's seconds a layer at that step (the largest
		 * binds), and the fill and drain once a step */
		json_t *ls = json_object_get(r, "layer_seconds"), *v;
		const char *k;
		if (json_is_object(ls)) {
			printf("%-16s", "per layer");
			json_object_foreach(ls, k, v)
				if (strcmp(k, "fill"))
					printf(" %s %.2f ms", k, json_number_value(v) * 1e3);
			printf("; fill %.2f ms a step\n", getf(ls, "fill") * 1e3);
		}
	}
	printf("%-16s %.1f tokens/s (%.1f generated/s) for %.0f-token prompts and %.0f-token generations, "
	       "KV %.0f tokens: steps of %.0f tokens (set by %s) in %.4g s\n", "predicted", getf(pr, "tokens_per_s"),
	       getf(pr, "generated_tokens_per_s"), getf(w, "prompt_len"), getf(w, "gen_len"), getf(w, "kv_tokens"),
	       getf(pr, "tokens_per_step"), gets_(r, "limit"), getf(pr, "step_seconds"));
	{
		const char *src = gets_(r, "token_cap_source");
		printf("%-16s %lld tokens per step (%s)\n", "token cap", (long long)geti(r, "token_cap"),
		       json_is_true(json_object_get(r, "token_cap_pinned")) ? "pinned by max_step_tokens"
		       : !strcmp(src, "largest-step") ? "the engine's largest step, below n_real" : "from n_real");
	}
	if (*gets_(r, "warning"))
		printf("%-16s %s\n", "warning", gets_(r, "warning"));
}

static void show_config(json_t *r)
{
	const char *k;
	json_t *v;
	json_object_foreach(json_object_get(r, "config"), k, v)
		printf("%s = %s\n", k, json_string_value(v));
}

/* ==== traces: the daemon sends one, mlensctl writes the file ==== */

/* Before asking: FILE must be new and its directory writable by us, so
 * that a recorded trace is not lost for a bad name. 0, or 1 said. */
static int trace_file_check(const char *file)
{
	char copy[4096];
	struct stat st;
	const char *dir;
	int e = 0;
	if (strlen(file) >= sizeof(copy)) {
		fprintf(stderr, "%s: trace: the file name is longer than %zu bytes\n", prog, sizeof(copy) - 1);
		return 1;
	}
	snprintf(copy, sizeof(copy), "%s", file);
	dir = dirname(copy);
	if (!lstat(file, &st))
		e = EEXIST;
	else if (errno != ENOENT)
		e = errno;
	else if (access(dir, W_OK | X_OK))
		e = errno;
	if (e) {
		fprintf(stderr, "%s: trace: cannot create the trace file %s: %s%s\n", prog, file, strerror(e),
			e == EEXIST ? " (name a new file)" : "");
		return 1;
	}
	return 0;
}

/* The trace of the reply to a new FILE. 0, or 1 said (nothing left behind). */
static int trace_file_write(const char *file, json_t *trace)
{
	int fd = open(file, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644), rc = 0;
	FILE *f;
	if (fd < 0 || !(f = fdopen(fd, "w"))) {
		fprintf(stderr, "%s: trace: cannot create the trace file %s: %s\n", prog, file, strerror(errno));
		if (fd >= 0) {
			close(fd);
			unlink(file);
		}
		return 1;
	}
	errno = 0;
	if (!json_is_object(trace))
		rc = EPROTO;
	else if (json_dumpf(trace, f, JSON_COMPACT) || fputc('\n', f) == EOF)
		rc = errno ? errno : EIO;
	if (fclose(f) && !rc)
		rc = errno ? errno : EIO;
	if (rc) {
		fprintf(stderr, "%s: trace: cannot write the trace file %s: %s\n", prog, file,
			rc == EPROTO ? "the daemon's reply holds no trace" : strerror(rc));
		unlink(file);
		return 1;
	}
	return 0;
}

static void show_trace(json_t *r, const char *file)
{
	if (!file) {
		printf("trace cancelled\n");
		return;
	}
	printf("trace of %lld steps written to %s: %lld spans", (long long)geti(r, "steps"), file,
	       (long long)geti(r, "spans"));
	if (geti(r, "dropped_spans"))
		printf(" (%lld more dropped past the daemon's cap)", (long long)geti(r, "dropped_spans"));
	printf("; open it in chrome://tracing or ui.perfetto.dev\n");
}

/* ==== main ==== */

int main(int argc, char **argv)
{
	const char *sock = getenv("MLENS_CONTROL");
	const char *args[64];
	int nargs = 0, fd, rc = 0;
	bool json = false;
	json_t *req, *rep;
	char why[320];
	const char *cmd, *file = NULL;	/* trace: the file to write */
	int trace_timeout_s = TRACE_TIMEOUT_S;
	bool timed_out = false;

	if (!sock || !*sock)
		sock = "/run/mlens/control.sock";
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
			usage(stdout);
			return 0;
		}
		if (!strcmp(a, "-V") || !strcmp(a, "--version")) {
			printf("mlensctl %s\n", PACKAGE_VERSION);
			return 0;
		}
		if (!strcmp(a, "--json")) {
			json = true;
		} else if (!strcmp(a, "-s") || !strcmp(a, "--socket")) {
			if (++i >= argc)
				return die_usage("%s needs a path", a);
			sock = argv[i];
		} else if (!strncmp(a, "--socket=", 9)) {
			sock = a + 9;
		} else if (a[0] == '-' && a[1] && nargs == 0) {
			return die_usage("unknown option '%s'", a);
		} else {
			if (nargs >= (int)(sizeof(args) / sizeof(args[0])))
				return die_usage("%s", "too many arguments");
			args[nargs++] = a;
		}
	}
	if (!nargs)
		return die_usage("%s", "no command");
	cmd = args[0];
	req = json_pack("{s:s}", "cmd", cmd);
	if (!strcmp(cmd, "status") || !strcmp(cmd, "tenants") || !strcmp(cmd, "drain") || !strcmp(cmd, "resume") ||
	    !strcmp(cmd, "stats") || !strcmp(cmd, "shutdown") || !strcmp(cmd, "config")) {
		if (nargs != 1) {
			snprintf(why, sizeof(why), "%s takes no arguments", cmd);
			goto usage;
		}
	} else if (!strcmp(cmd, "evict")) {
		if (nargs != 2) {
			snprintf(why, sizeof(why), "evict needs one TENANT id");
			goto usage;
		}
		json_object_set_new(req, "tenant", json_string(args[1]));
	} else if (!strcmp(cmd, "quota")) {
		json_t *set;
		if (nargs < 2) {
			snprintf(why, sizeof(why), "quota needs a TENANT id");
			goto usage;
		}
		json_object_set_new(req, "tenant", json_string(args[1]));
		set = json_object();
		json_object_set_new(req, "set", set);	/* req owns it from here */
		for (int i = 2; i < nargs; i++) {
			const char *eq = strchr(args[i], '=');
			char key[32];
			if (!eq || eq == args[i] || (size_t)(eq - args[i]) >= sizeof(key) || !eq[1]) {
				snprintf(why, sizeof(why),
					 "quota: '%s' is not KEY=VALUE (running, kv_blocks, queued, weight)", args[i]);
				goto usage;
			}
			memcpy(key, args[i], (size_t)(eq - args[i]));
			key[eq - args[i]] = 0;
			json_object_set_new(set, key, json_string(eq + 1));
		}
	} else if (!strcmp(cmd, "profile")) {
		for (int i = 1; i < nargs; i++) {
			const char *a = args[i];
			if (!strcmp(a, "--cached")) {
				json_object_set_new(req, "cached", json_true());
			} else if (!strcmp(a, "--prompt-len") || !strcmp(a, "--gen-len")) {
				if (i + 1 >= nargs) {
					snprintf(why, sizeof(why), "profile: %s needs a number of tokens", a);
					goto usage;
				}
				json_object_set_new(req, a[2] == 'p' ? "prompt_len" : "gen_len", json_string(args[++i]));
			} else {
				snprintf(why, sizeof(why), "profile: unknown argument '%s' (--prompt-len P, --gen-len G, --cached)", a);
				goto usage;
			}
		}
	} else if (!strcmp(cmd, "trace")) {
		for (int i = 1; i < nargs; i++) {
			const char *a = args[i];
			if (!strcmp(a, "--timeout")) {
				char *end;
				long v;
				if (i + 1 >= nargs) {
					snprintf(why, sizeof(why), "trace: --timeout needs a number of seconds");
					goto usage;
				}
				v = strtol(args[++i], &end, 10);
				if (!*args[i] || *end || v < 0 || v > 86400) {
					snprintf(why, sizeof(why), "trace: --timeout '%s' is not a number of seconds in "
						 "[0, 86400] (0: no limit)", args[i]);
					goto usage;
				}
				trace_timeout_s = (int)v;
			} else if (!strcmp(a, "--cancel")) {
				json_object_set_new(req, "cancel", json_true());
			} else if (!strcmp(a, "--steps")) {
				if (i + 1 >= nargs) {
					snprintf(why, sizeof(why), "trace: --steps needs a number of steps");
					goto usage;
				}
				json_object_set_new(req, "steps", json_string(args[++i]));
			} else if (a[0] == '-' && a[1]) {
				snprintf(why, sizeof(why), "trace: unknown argument '%s' (--steps N, --timeout S, --cancel)", a);
				goto usage;
			} else if (file) {
				snprintf(why, sizeof(why), "trace takes one FILE");
				goto usage;
			} else {
				file = a;
			}
		}
		if (!file != json_is_true(json_object_get(req, "cancel"))) {
			snprintf(why, sizeof(why), "trace needs a FILE to write (or --cancel alone)");
			goto usage;
		}
		if (file && trace_file_check(file)) {
			json_decref(req);
			return EXIT_REFUSED;
		}
	} else if (!strcmp(cmd, "log-level")) {
		if (nargs > 2) {
			snprintf(why, sizeof(why), "log-level takes at most one LEVEL");
			goto usage;
		}
		if (nargs == 2)
			json_object_set_new(req, "level", json_string(args[1]));
	} else {
		snprintf(why, sizeof(why), "unknown command '%s'", cmd);
		goto usage;
	}

	fd = connect_to(sock);
	if (fd < 0) {
		json_decref(req);
		return EXIT_CONNECT;
	}
	rep = transact(fd, req, !strcmp(cmd, "profile") ? PROFILE_TIMEOUT_MS
			   : file ? (trace_timeout_s ? trace_timeout_s * 1000 : -1) : REPLY_TIMEOUT_MS,
		       file ? MAX_TRACE_REPLY : MAX_REPLY, &timed_out);
	/* closing the connection cancels a trace still armed */
	close(fd);
	if (!rep && timed_out && file) {
		fprintf(stderr, "%s: trace: %s did not run within %d s: nothing written (a trace records "
			"the steps of running requests: is the daemon idle? --timeout S waits longer, 0 without "
			"limit)\n", prog, json_integer_value(json_object_get(req, "steps")) == 1 ? "a step" :
			"the steps", trace_timeout_s);
		json_decref(req);
		return EXIT_REFUSED;
	}
	if (!rep && timed_out)
		fprintf(stderr, "%s: no reply from the daemon in %d s\n", prog,
			(!strcmp(cmd, "profile") ? PROFILE_TIMEOUT_MS : REPLY_TIMEOUT_MS) / 1000);
	json_decref(req);
	if (!rep)
		return EXIT_CONNECT;
	if (!json_is_boolean(json_object_get(rep, "ok"))) {
		/* a JSON line that is no reply: the stats socket sends its counters to anyone who connects */
		if (json_object_get(rep, "uptime_seconds"))
			fprintf(stderr, "%s: %s is mlensd's stats socket (it sends the counters and closes); "
				"mlensctl needs the control socket: give it with -s (control = in mlensd.conf; "
				"by default control.sock beside the tenant socket)\n", prog, sock);
		else
			fprintf(stderr, "%s: %s answered, but not as mlensd's control socket does; give the "
				"control socket with -s\n", prog, sock);
		json_decref(rep);
		return EXIT_CONNECT;
	}
	if (!json_is_true(json_object_get(rep, "ok"))) {
		const char *e = gets_(rep, "error");
		size_t cl = strlen(cmd);
		/* the daemon's reasons name their command already: say it once */
		if (!strncmp(e, cmd, cl) && e[cl] == ':' && e[cl + 1] == ' ')
			fprintf(stderr, "%s: %s\n", prog, *e ? e : "refused, without a reason");
		else
			fprintf(stderr, "%s: %s: %s\n", prog, cmd, *e ? e : "refused, without a reason");
		rc = EXIT_REFUSED;
		if (json)
			json_dumpf(rep, stdout, JSON_COMPACT), putchar('\n');
	} else if (file && trace_file_write(file, json_object_get(rep, "trace"))) {
		rc = EXIT_REFUSED;
	} else if (json) {
		if (file) {
			/* the trace is in the file; the reply says where */
			json_object_del(rep, "trace");
			json_object_set_new(rep, "path", json_string(file));
		}
		json_dumpf(rep, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
		putchar('\n');
	} else if (!strcmp(cmd, "status")) {
		show_status(rep);
	} else if (!strcmp(cmd, "tenants")) {
		show_tenants(rep);
	} else if (!strcmp(cmd, "quota")) {
		show_quota(rep);
	} else if (!strcmp(cmd, "stats")) {
		show_stats(rep);
	} else if (!strcmp(cmd, "config")) {
		show_config(rep);
	} else if (!strcmp(cmd, "profile")) {
		show_profile(rep);
	} else if (!strcmp(cmd, "trace")) {
		show_trace(rep, file);
	} else if (!strcmp(cmd, "log-level")) {
		printf("%s\n", gets_(rep, "level"));
	} else if (!strcmp(cmd, "drain")) {
		printf("admission closed: running requests go on, new ones are refused (mlensctl resume reopens)\n");
	} else if (!strcmp(cmd, "resume")) {
		printf("admission open\n");
	} else if (!strcmp(cmd, "evict")) {
		printf("tenant %lld evicted\n", (long long)geti(rep, "tenant"));
	} else if (!strcmp(cmd, "shutdown")) {
		printf("shutting down: draining, then exiting\n");
	}
	json_decref(rep);
	return rc;
usage:
	json_decref(req);
	return die_usage("%s", why);
}
