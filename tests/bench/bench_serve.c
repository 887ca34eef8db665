/* mlens-bench serve: end-to-end serving throughput of a real mlensd. Starts
 * the daemon on a model, drives it through libmlens from several client
 * threads (each its own connection), stops it, and reports requests, tokens,
 * tokens/s (whole run and steady state), time to first token, the share of
 * wall time spent in engine steps and what the daemon's counters say it
 * achieved (PCIe, CPU attention, GPU busy). Built with CUDA, before the
 * daemon starts it measures the ceilings of the box (pinned H2D copies, CPU
 * memory reads while such a copy runs, the expert GEMM rate, HBM) and
 * prints the bound they set: the hybrid pipeline's, the HBM one
 * for GPU-only. --predict sets the daemon's performance model beside it at
 * the step size the scheduler really reaches. Lengths: one (p, g), ranges
 * drawn log-uniform, or a file of pairs; the bound follows the mix, and the
 * steps' tokens and KV occupancy are sampled for their percentiles.
 * Formulas: at the functions. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include "mlens.h"
#include "daemon/config.h"
#include "daemon/exec/layer.h"
#include "daemon/mem.h"
#include "daemon/model/model.h"
#include "daemon/model/quant.h"
#include "daemon/model/safetensors.h"
#include "daemon/plan/gpu_plan.h"
#include "daemon/plan/perfmodel.h"
#include "kernels/cpu/pool.h"
#include "tests/bench/bench.h"
#include "kernels/cpu/readbw.h"
#ifdef HAVE_CUDA
/* cuBLASLt's header declares a function without a prototype */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <cublasLt.h>
#pragma GCC diagnostic pop
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include "kernels/fp8.h"
#endif

#define MAX_DAEMON_ARGS 16

struct serve_opts {
	const char *mlensd, *model, *backend, *kv_cache, *gpu_memory;
	const char *daemon_log;		/* the daemon's log here, kept; NULL: a temporary */
	const char *daemon_args[MAX_DAEMON_ARGS];
	int n_daemon_args;
	int prompt_len, gen_len, requests, concurrency, threads, max_step_tokens;
	int pool_fulls;		/* --pool-fulls: requests = that many KV pools' worth; 0: --requests */
	/* the lengths' ranges (lo == hi: fixed) and the pairs of --lengths */
	int prompt_lo, prompt_hi, gen_lo, gen_hi;
	const char *lengths_file;
	uint64_t seed;
	double start_timeout, run_timeout;
	bool json, keep_log, predict, no_ceilings;
	bool op_timing;		/* --op-timing: the daemon's op account (gpu_ops) in a table */
	/* each request's lengths (and, from a file, its line) */
	int *req_p, *req_g, *req_line;
};

/* SIGTERM or SIGINT while serving: the clients stop with what is in
 * flight, the results so far are written (marked "stopped_by") and the
 * daemon is stopped, instead of dying with nothing said. */
static atomic_int stop_sig;	/* lock-free: safe in the handler and read by the client threads */
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "the stop flag needs lock-free int atomics");

static void on_stop_signal(int sig)
{
	atomic_store(&stop_sig, sig);
}

static const char *stop_name(void)
{
	return atomic_load(&stop_sig) == SIGINT ? "SIGINT" : "SIGTERM";
}

/* ==== the daemon ==== */

struct daemon_proc {
	pid_t pid;
	char dir[64];
	char sock[96], control[96], stats[96], log[4096];
	bool own_log;		/* log is the caller's file: never removed */
};

/* The log's last lines on stderr (its last 64 KiB at most). */
static void print_log_tail(const struct daemon_proc *d, int lines)
{
	static char buf[65536];
	FILE *f = fopen(d->log, "r");
	long end, from;
	size_t n;
	char *p;
	fprintf(stderr, "---- last lines of %s\n", d->log);
	if (!f || fseek(f, 0, SEEK_END) || (end = ftell(f)) < 0) {
		fprintf(stderr, "(cannot show the log)\n");
		if (f)
			fclose(f);
		return;
	}
	from = end > (long)sizeof(buf) - 1 ? end - (long)sizeof(buf) + 1 : 0;
	n = fseek(f, from, SEEK_SET) ? 0 : fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	p = buf + n;
	if (p > buf && p[-1] == '\n')
		p--;
	while (p > buf && lines > 0)
		if (*--p == '\n')
			lines--;
	fputs(p + (*p == '\n'), stderr);
}

static int daemon_start(struct daemon_proc *d, const struct serve_opts *o)
{
	const char *argv[64];
	char step[32], queued[32], path[512];
	const char *exe = o->mlensd;
	int n = 0;
	uint64_t deadline;

	if (!exe) {
		const char *b = getenv("MLENS_BUILDDIR");
		if (!b) {
			fprintf(stderr, "serve: give --mlensd PATH (or set MLENS_BUILDDIR)\n");
			return -EINVAL;
		}
		snprintf(path, sizeof(path), "%s/daemon/mlensd", b);
		exe = path;
	}
	snprintf(d->dir, sizeof(d->dir), "/tmp/mlens-serve.XXXXXX");
	if (!mkdtemp(d->dir))
		return -errno;
	snprintf(d->sock, sizeof(d->sock), "%s/sock", d->dir);
	snprintf(d->control, sizeof(d->control), "%s/control", d->dir);
	snprintf(d->stats, sizeof(d->stats), "%s/stats", d->dir);
	if (o->daemon_log) {
		/* relative to our directory, whatever the daemon's is */
		char cwd[2048];
		int w = o->daemon_log[0] == '/' ? snprintf(d->log, sizeof(d->log), "%s", o->daemon_log)
			: getcwd(cwd, sizeof(cwd)) ? snprintf(d->log, sizeof(d->log), "%s/%s", cwd, o->daemon_log)
			: -1;
		if (w < 0 || w >= (int)sizeof(d->log))
			return -ENAMETOOLONG;
		d->own_log = true;
	} else {
		snprintf(d->log, sizeof(d->log), "%s/mlensd.log", d->dir);
	}
	argv[n++] = exe;
	argv[n++] = "--model";
	argv[n++] = o->model;
	argv[n++] = "--socket";
	argv[n++] = d->sock;
	argv[n++] = "--control";
	argv[n++] = d->control;
	argv[n++] = "--stats";
	argv[n++] = d->stats;
	argv[n++] = "--log";
	argv[n++] = d->log;
	argv[n++] = "--foreground";
	argv[n++] = "--mlock=false";
	argv[n++] = "--backend";
	argv[n++] = o->backend;
	argv[n++] = "--kv-cache";
	argv[n++] = o->kv_cache;
	/* every client thread is one tenant: let each run and queue its
	 * whole share (a tenant's queue holds 1024 by default; the share is
	 * known only once the KV pool is when --concurrency is left to it) */
	argv[n++] = "--quota-running";
	argv[n++] = "0";
	snprintf(queued, sizeof(queued), "%d", !o->concurrency ? 1 << 20 :
		 o->concurrency / o->threads + 1 > 1024 ? o->concurrency / o->threads + 1 : 1024);
	argv[n++] = "--quota-queued";
	argv[n++] = queued;
	if (o->gpu_memory) {
		argv[n++] = "--gpu-memory";
		argv[n++] = o->gpu_memory;
	}
	if (o->max_step_tokens > 0) {
		snprintf(step, sizeof(step), "%d", o->max_step_tokens);
		argv[n++] = "--max-step-tokens";
		argv[n++] = step;
	}
	for (int i = 0; i < o->n_daemon_args; i++)
		argv[n++] = o->daemon_args[i];
	argv[n] = NULL;

	d->pid = fork();
	if (d->pid < 0)
		return -errno;
	if (d->pid == 0) {
		execv(exe, (char *const *)argv);
		fprintf(stderr, "serve: cannot run %s: %s\n", exe, strerror(errno));
		_exit(127);
	}
	/* ready once a tenant can attach (the model is loaded by then) */
	deadline = mlens_bench_now_ns() + (uint64_t)(o->start_timeout * 1e9);
	while (mlens_bench_now_ns() < deadline) {
		struct mlens *m;
		int st;
		if (atomic_load(&stop_sig)) {
			fprintf(stderr, "serve: stopped by %s while mlensd started\n", stop_name());
			return -EINTR;
		}
		if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
			fprintf(stderr, "serve: mlensd exited during start-up (status %d)\n",
				WIFEXITED(st) ? WEXITSTATUS(st) : -1);
			d->pid = 0;
			print_log_tail(d, 20);
			return -ECHILD;
		}
		if (mlens_open(d->sock, "bench-probe", &m) == 0) {
			mlens_close(m);
			return 0;
		}
		usleep(100 * 1000);
	}
	fprintf(stderr, "serve: mlensd did not start within %.0f s\n", o->start_timeout);
	print_log_tail(d, 20);
	return -ETIMEDOUT;
}

static void daemon_stop(struct daemon_proc *d, bool keep_log)
{
	if (d->pid > 0) {
		int st;
		uint64_t deadline = mlens_bench_now_ns() + 60000000000ull;
		kill(d->pid, SIGTERM);
		while (waitpid(d->pid, &st, WNOHANG) == 0) {
			if (mlens_bench_now_ns() > deadline) {
				fprintf(stderr, "serve: mlensd ignored SIGTERM for 60 s: killing it\n");
				kill(d->pid, SIGKILL);
				waitpid(d->pid, &st, 0);
				break;
			}
			usleep(50 * 1000);
		}
		d->pid = 0;
	}
	if (d->dir[0] && !keep_log) {
		if (!d->own_log)
			unlink(d->log);
		unlink(d->sock);
		unlink(d->control);
		unlink(d->stats);
		rmdir(d->dir);
	}
}

/* One JSON object from a Unix stream socket: the stats socket answers on
 * connect; the control socket answers a request line. NULL on failure. */
static json_t *socket_json(const char *path, const char *request)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	char buf[1 << 16];
	size_t len = 0;
	json_t *o;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return NULL;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	/* a stop signal (installed without SA_RESTART) must not fail a query:
	 * the caller sees stop_sig and says so */
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
		close(fd);
		return NULL;
	}
	if (request) {
		ssize_t n;
		while ((n = send(fd, request, strlen(request), MSG_NOSIGNAL)) < 0 && errno == EINTR)
			;
		if (n < 0) {
			close(fd);
			return NULL;
		}
	}
	while (len < sizeof(buf) - 1) {
		ssize_t n = read(fd, buf + len, sizeof(buf) - 1 - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		len += (size_t)n;
		if (request && memchr(buf, '\n', len))
			break;	/* the control socket keeps the connection open */
	}
	close(fd);
	buf[len] = 0;
	o = json_loads(buf, JSON_DISABLE_EOF_CHECK, NULL);
	return o;
}

static double jnum(json_t *o, const char *key)
{
	return o ? json_number_value(json_object_get(o, key)) : 0.0;
}

/* A number of a stats object, NAN when the daemon does not report it (an
 * older daemon, or a counter of another mode). */
static double jopt(json_t *o, const char *key)
{
	json_t *v = o ? json_object_get(o, key) : NULL;
	return json_is_number(v) ? json_number_value(v) : NAN;
}

/* ==== the lengths ==== */

static uint64_t mix64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	return x ^ (x >> 33);
}


/* "N" or "LO:HI" (1 <= LO <= HI): 0, or -1 with a message. */
static int parse_range(const char *flag, const char *arg, int *lo, int *hi)
{
	char buf[64], *colon;
	long long a, b;
	if (strlen(arg) >= sizeof(buf))
		goto bad;
	snprintf(buf, sizeof(buf), "%s", arg);
	colon = strchr(buf, ':');
	if (colon)
		*colon = 0;
	a = mlens_bench_parse_count(buf);
	b = colon ? mlens_bench_parse_count(colon + 1) : a;
	if (a < 1 || b < a || b > 1 << 30)
		goto bad;
	*lo = (int)a;
	*hi = (int)b;
	return 0;
bad:
	fprintf(stderr, "serve: %s '%s': give a length N or a range LO:HI with 1 <= LO <= HI\n", flag, arg);
	return -1;
}

static uint64_t rng_next(uint64_t *st)
{
	*st += 0x9e3779b97f4a7c15ull;
	return mix64(*st);
}

/* A whole number in [lo, hi], log-uniform: ln(x) uniform over
 * [ln lo, ln(hi + 1)), floored (each octave gets as many requests). */
static int log_uniform(uint64_t *st, int lo, int hi)
{
	double u = (double)(rng_next(st) >> 11) / 9007199254740992.0;
	int x = (int)floor(exp(log((double)lo) + u * (log((double)hi + 1.0) - log((double)lo))));
	return x < lo ? lo : x > hi ? hi : x;
}

/* The pairs of a --lengths file: one "P G" a line (blank lines and lines
 * that start with '#' skipped), whole numbers >= 1. Request i takes pair
 * i mod n, in the file's order. 0, or -1 with FILE:LINE and what is
 * wrong. */
static int read_lengths(const char *path, int **pp, int **gp, int **lp, int *n_out)
{
	FILE *f = fopen(path, "r");
	char line[256];
	int n = 0, cap = 0, ln = 0, rc = -1;
	int *P = NULL, *G = NULL, *Ln = NULL;
	if (!f) {
		fprintf(stderr, "serve: --lengths %s: %s\n", path, strerror(errno));
		return -1;
	}
	while (fgets(line, sizeof(line), f)) {
		long long a, b;
		char *s1 = line, *e;
		ln++;
		if (!strchr(line, '\n') && !feof(f)) {
			fprintf(stderr, "serve: %s:%d: line longer than %zu characters\n", path, ln,
				sizeof(line) - 2);
			goto out;
		}
		line[strcspn(line, "\r\n")] = 0;
		while (*s1 == ' ' || *s1 == '\t')
			s1++;
		if (!*s1 || *s1 == '#')
			continue;
		errno = 0;
		a = strtoll(s1, &e, 10);
		if (e == s1 || errno || (*e != ' ' && *e != '\t')) {
			fprintf(stderr, "serve: %s:%d: '%s': expected two whole numbers \"P G\" (prompt and "
				"generation lengths)\n", path, ln, s1);
			goto out;
		}
		s1 = e;
		b = strtoll(s1, &e, 10);
		while (*e == ' ' || *e == '\t')
			e++;
		if (e == s1 || errno || *e) {
			fprintf(stderr, "serve: %s:%d: '%s': expected two whole numbers \"P G\" (prompt and "
				"generation lengths) and nothing after them\n", path, ln, line);
			goto out;
		}
		if (a < 1 || b < 1 || a > 1 << 30 || b > 1 << 30) {
			fprintf(stderr, "serve: %s:%d: prompt %lld, generation %lld: both must be between 1 and %d\n",
				path, ln, a, b, 1 << 30);
			goto out;
		}
		if (n == cap) {
			int nc = cap ? 2 * cap : 256;
			int *np = realloc(P, (size_t)nc * sizeof(*P)), *ng, *nl;
			if (np)
				P = np;
			ng = np ? realloc(G, (size_t)nc * sizeof(*G)) : NULL;
			if (ng)
				G = ng;
			nl = ng ? realloc(Ln, (size_t)nc * sizeof(*Ln)) : NULL;
			if (!nl) {
				fprintf(stderr, "serve: %s: out of memory\n", path);
				goto out;
			}
			Ln = nl;
			cap = nc;
		}
		P[n] = (int)a;
		G[n] = (int)b;
		Ln[n++] = ln;
	}
	if (ferror(f)) {
		fprintf(stderr, "serve: --lengths %s: read error\n", path);
		goto out;
	}
	if (!n) {
		fprintf(stderr, "serve: %s: no \"P G\" line\n", path);
		goto out;
	}
	*pp = P;
	*gp = G;
	*lp = Ln;
	*n_out = n;
	P = G = Ln = NULL;
	rc = 0;
out:
	fclose(f);
	free(P);
	free(G);
	free(Ln);
	return rc;
}

/* Every request's lengths: from the file, else drawn from the ranges
 * (prompt, then generation, request by request, from --seed). 0 or -1. */
static int make_lengths(struct serve_opts *o)
{
	int *fp = NULL, *fg = NULL, *fl = NULL, nf = 0;
	uint64_t st = o->seed;
	if (o->lengths_file && read_lengths(o->lengths_file, &fp, &fg, &fl, &nf))
		return -1;
	o->req_p = malloc((size_t)o->requests * sizeof(int));
	o->req_g = malloc((size_t)o->requests * sizeof(int));
	o->req_line = calloc((size_t)o->requests, sizeof(int));
	if (!o->req_p || !o->req_g || !o->req_line) {
		free(fp);
		free(fg);
		free(fl);
		fprintf(stderr, "serve: out of memory for %d requests' lengths\n", o->requests);
		return -1;
	}
	for (int i = 0; i < o->requests; i++) {
		if (nf) {
			o->req_p[i] = fp[i % nf];
			o->req_g[i] = fg[i % nf];
			o->req_line[i] = fl[i % nf];
		} else {
			o->req_p[i] = log_uniform(&st, o->prompt_lo, o->prompt_hi);
			o->req_g[i] = log_uniform(&st, o->gen_lo, o->gen_hi);
		}
	}
	if (nf) {	/* the ranges the file's pairs span */
		o->prompt_lo = o->prompt_hi = fp[0];
		o->gen_lo = o->gen_hi = fg[0];
		for (int i = 1; i < nf; i++) {
			o->prompt_lo = fp[i] < o->prompt_lo ? fp[i] : o->prompt_lo;
			o->prompt_hi = fp[i] > o->prompt_hi ? fp[i] : o->prompt_hi;
			o->gen_lo = fg[i] < o->gen_lo ? fg[i] : o->gen_lo;
			o->gen_hi = fg[i] > o->gen_hi ? fg[i] : o->gen_hi;
		}
	}
	free(fp);
	free(fg);
	free(fl);
	return 0;
}

/* The longest request (prompt and generation) and its index, and
 * prompt_hi raised to the longest prompt (the prompt buffer's size). */
static void note_longest(struct serve_opts *o, int *max_total, int *max_i)
{
	*max_total = *max_i = 0;
	for (int i = 0; i < o->requests; i++) {
		if (o->req_p[i] > o->prompt_hi)
			o->prompt_hi = o->req_p[i];
		if (o->req_p[i] + o->req_g[i] > *max_total) {
			*max_total = o->req_p[i] + o->req_g[i];
			*max_i = i;
		}
	}
}

/* The requests' moments at blocks of block_tokens (perfmodel.h). */
static int lengths_mix(const struct serve_opts *o, int block_tokens, struct mlens_perf_mix *mix)
{
	double *P = malloc((size_t)o->requests * sizeof(double));
	double *G = malloc((size_t)o->requests * sizeof(double));
	int rc = -ENOMEM;
	if (P && G) {
		for (int i = 0; i < o->requests; i++) {
			P[i] = o->req_p[i];
			G[i] = o->req_g[i];
		}
		rc = mlens_perf_mix_of(P, G, (size_t)o->requests, block_tokens, mix);
	}
	free(P);
	free(G);
	return rc;
}

/* ==== the clients ==== */

struct req_rec {
	uint64_t t_submit, t_first, t_last;
	int tokens;
	int finish, status;
};

struct serve_run {
	const struct serve_opts *o;
	const char *sock;
	uint32_t vocab;
	atomic_int next;	/* next request index to claim */
	struct req_rec *recs;	/* one per request */
	atomic_int failed_threads;
	uint64_t t0, deadline;
	/* tokens by arrival time in bins of BIN_NS from t0: generated tokens
	 * as they arrive, a request's prompt tokens at its first token (the
	 * prefill is done then) */
	atomic_uint_fast64_t *gen_bins, *prompt_bins;
	size_t n_bins;
};

#define BIN_NS 10000000ull	/* 10 ms */

static void bin_add(struct serve_run *r, atomic_uint_fast64_t *bins, uint64_t t, uint64_t n)
{
	size_t i = t > r->t0 ? (size_t)((t - r->t0) / BIN_NS) : 0;
	atomic_fetch_add_explicit(&bins[i < r->n_bins ? i : r->n_bins - 1], n, memory_order_relaxed);
}

struct client_arg {
	struct serve_run *run;
	int idx;
	int rc;
};

static void *client_main(void *argp)
{
	struct client_arg *a = argp;
	struct serve_run *r = a->run;
	const struct serve_opts *o = r->o;
	int cap = o->concurrency / o->threads + (a->idx < o->concurrency % o->threads);
	int inflight = 0, n_ids = 0, rc;
	int32_t *prompt = malloc((size_t)o->prompt_hi * sizeof(*prompt));
	int *id_req = malloc((size_t)o->requests * sizeof(*id_req));	/* id - 1 -> request */
	struct mlens_event ev[256];
	struct mlens *m = NULL;
	char name[32];
	bool more = true;
	int held = -1;	/* a request claimed whose submit found the rings full */

	a->rc = 0;
	snprintf(name, sizeof(name), "bench-%d", a->idx);
	if (!prompt || !id_req) {
		a->rc = -ENOMEM;
		goto out;
	}
	if (cap < 1)
		cap = 1;
	rc = mlens_open(r->sock, name, &m);
	if (rc) {
		fprintf(stderr, "serve: client %d cannot attach: %s\n", a->idx, mlens_strerror(rc));
		a->rc = rc;
		goto out;
	}
	while (more || inflight) {
		while (more && inflight < cap) {
			int i = held >= 0 ? held : atomic_fetch_add(&r->next, 1);
			struct mlens_request q = { .size = sizeof(q) };
			uint64_t id;
			held = -1;
			if (i >= o->requests) {
				more = false;
				break;
			}
			for (int j = 0; j < o->req_p[i]; j++)
				prompt[j] = (int32_t)(mix64(((uint64_t)i << 24) + (uint64_t)j + 1) % r->vocab);
			q.prompt = prompt;
			q.n_prompt = (uint32_t)o->req_p[i];
			q.max_tokens = (uint32_t)o->req_g[i];
			q.flags = MLENS_REQ_IGNORE_EOS;	/* every request gen_len tokens */
			/* not waiting: the daemon takes submissions only while our
			 * completion ring has room, so with the rings full this
			 * thread must drain events before it submits again */
			q.timeout_ms = 0;
			r->recs[i].t_submit = mlens_bench_now_ns();
			rc = mlens_submit(m, &q, &id);
			if (rc == -EAGAIN && inflight) {
				held = i;	/* submitted first once events are read */
				break;
			}
			if (rc) {
				fprintf(stderr, "serve: submit: %s\n", mlens_strerror(rc));
				r->recs[i].finish = MLENS_REASON_ERROR;
				r->recs[i].status = rc;
				a->rc = rc;
				goto out;
			}
			if (id < 1 || id > (uint64_t)o->requests) {
				a->rc = -EPROTO;
				goto out;
			}
			id_req[id - 1] = i;
			n_ids = (int)id > n_ids ? (int)id : n_ids;
			inflight++;
		}
		if (!inflight)
			break;
		rc = mlens_wait(m, ev, 256, 1000);
		if (rc < 0) {
			fprintf(stderr, "serve: client %d: wait: %s\n", a->idx, mlens_strerror(rc));
			a->rc = rc;
			goto out;
		}
		if (atomic_load(&stop_sig)) {
			fprintf(stderr, "serve: client %d: stopped by %s with %d requests in flight\n",
				a->idx, stop_name(), inflight);
			a->rc = -EINTR;
			goto out;
		}
		if (mlens_bench_now_ns() > r->deadline) {
			fprintf(stderr, "serve: client %d: run timeout with %d requests in flight\n",
				a->idx, inflight);
			a->rc = -ETIMEDOUT;
			goto out;
		}
		for (int e = 0; e < rc; e++) {
			struct req_rec *rec;
			uint64_t t;
			if (ev[e].id < 1 || ev[e].id > (uint64_t)n_ids)
				continue;
			t = mlens_bench_now_ns();
			rec = &r->recs[id_req[ev[e].id - 1]];
			if (ev[e].flags & MLENS_EV_FIRST) {
				rec->t_first = t;
				bin_add(r, r->prompt_bins, t, (uint64_t)o->req_p[id_req[ev[e].id - 1]]);
			}
			if (ev[e].flags & MLENS_EV_TOKEN) {
				rec->tokens++;
				bin_add(r, r->gen_bins, t, 1);
			}
			if (ev[e].flags & MLENS_EV_LAST) {
				rec->t_last = t;
				rec->finish = (int)ev[e].finish;
				rec->status = ev[e].status;
				inflight--;
			}
		}
	}
out:
	if (a->rc)
		atomic_fetch_add(&r->failed_threads, 1);
	if (m)
		mlens_close(m);
	free(prompt);
	free(id_req);
	return NULL;
}

/* ==== the daemon's counters over time ==== */

/* The stats the steady-state window and the achieved rates need; the
 * busy and KV-read counters are newer than the others (NAN when absent). */
enum { K_GEN, K_PROMPT, K_STEPS, K_STEP_S, K_H2D, K_ATTN_S, K_KV_READ, K_GPU_BUSY, K_H2D_BUSY, K_APPEND_S,
       K_KV_BLOCKS, K_KV_RUNS, K_STEP_TOKENS, K_KV_USED, K_KV_TOTAL, K_DISK, K_N };
static const char *const sample_keys[K_N] = {
	"generation_tokens_total", "prompt_tokens_total", "steps_total", "step_seconds_sum",
	"pcie_h2d_bytes_total", "cpu_attention_seconds_total", "kv_read_bytes_total",
	"gpu_busy_seconds_total", "h2d_busy_seconds_total", "cpu_append_seconds_total",
	"kv_read_blocks_total", "kv_read_block_runs_total",
	"last_step_tokens", "kv_blocks_used", "kv_blocks_total",
	"weights_disk_read_bytes_total",	/* experts left on disk; absent without */
};

struct sample {
	uint64_t t;
	double v[K_N];
	/* op_timing: gpu_ops' seconds, FLOPs and calls by op, the ops' span
	 * and the steps timed (NAN from a daemon without the account) */
	double op[MLENS_LAYER_OP_N][3];
	double op_span, op_steps;
};

#define SAMPLE_NS 100000000ull	/* 10 stats reads a second */

struct sampler {
	const char *path;
	atomic_bool stop;
	struct sample *s;
	size_t n, cap;
	int rc;
};

static void sample_of(struct sample *x, json_t *o, uint64_t t)
{
	static const char *const op_keys[3] = { "seconds", "flops", "calls" };
	json_t *ops = json_object_get(o, "gpu_ops");
	x->t = t;
	for (int k = 0; k < K_N; k++)
		x->v[k] = jopt(o, sample_keys[k]);
	for (int i = 0; i < MLENS_LAYER_OP_N; i++)
		for (int k = 0; k < 3; k++)
			x->op[i][k] = jopt(json_object_get(ops, mlens_layer_op_name((enum mlens_layer_op)i)),
					   op_keys[k]);
	x->op_span = jopt(o, "gpu_op_span_seconds_total");
	x->op_steps = jopt(o, "gpu_op_steps_total");
}

static void *sampler_main(void *arg)
{
	struct sampler *sp = arg;
	while (!atomic_load(&sp->stop)) {
		uint64_t t = mlens_bench_now_ns(), next = t + SAMPLE_NS;
		json_t *o = socket_json(sp->path, NULL);
		if (o) {
			if (sp->n == sp->cap) {
				size_t cap = sp->cap ? 2 * sp->cap : 1024;
				struct sample *ns = realloc(sp->s, cap * sizeof(*ns));
				if (!ns) {
					sp->rc = -ENOMEM;
					json_decref(o);
					break;
				}
				sp->s = ns;
				sp->cap = cap;
			}
			sample_of(&sp->s[sp->n++], o, t);
			json_decref(o);
		}
		while (!atomic_load(&sp->stop) && (t = mlens_bench_now_ns()) < next)
			usleep((useconds_t)((next - t) / 1000 < 20000 ? (next - t) / 1000 + 1 : 20000));
	}
	return NULL;
}

/* Counter k's change from sample a to b per second of wall time, or per
 * unit of counter kd's change; NAN when either is absent. */
static double rate(const struct sample *a, const struct sample *b, int k, int kd)
{
	double d = b->v[k] - a->v[k];
	double den = kd < 0 ? (double)(b->t - a->t) / 1e9 : b->v[kd] - a->v[kd];
	return isfinite(d) && den > 0 ? d / den : NAN;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double percentile(const double *sorted, int n, double p)
{
	int i;
	if (n <= 0)
		return 0.0;
	i = (int)ceil(p / 100.0 * n) - 1;
	return sorted[i < 0 ? 0 : (i >= n ? n - 1 : i)];
}

/* ==== ceilings and the bound ==== */

struct ceilings {
	bool have;		/* GPU: HBM and GEMM */
	bool have_link;		/* host: pinned copy and memory reads */
	double hbm_gbs;		/* device-to-device copy, bytes read + written per second */
	double gemm_tflops;	/* cuBLAS bf16, fp32 accumulate, expert shape at gemm_m rows */
	double gemm_sustained_tflops;	/* the same GEMMs back to back, after 2 s of them */
	int gemm_m;
	/* fp8_measured: the daemon's experts were to be e4m3, so the e4m3
	 * GEMM (cuBLASLt, outer-vector scales, bf16 out) was measured as the
	 * bf16 one: its rates, or 0 and gemm_fp8_refused saying why not */
	bool fp8_measured;
	double gemm_fp8_tflops, gemm_fp8_sustained_tflops;
	char gemm_fp8_refused[256];
	double h2d_gbs;		/* pinned H2D copy alone */
	double read_gbs;	/* CPU streaming reads alone, all cores */
	double read_copy_gbs;	/* the same while H2D copies run */
	double copy_read_gbs;	/* those copies' rate meanwhile */
	double mem_copy_gbs;	/* CPU memory traffic then: reads + the copies' DMA reads */
	int read_threads;
	double read_huge;	/* share of the read buffer in huge pages, or NAN */
	char device[260];
};

/* The GEMM rate the bounds charge FLOPs to: the rate held under load where
 * it was measured (a run keeps the GPU busy for minutes; at its power
 * limit the clock stays below the one a lone GEMM gets), else the lone
 * GEMMs' rate. */
static double gemm_bound_tflops(const struct ceilings *c)
{
	return c->gemm_sustained_tflops > 0 ? c->gemm_sustained_tflops : c->gemm_tflops;
}

/* The rate the bounds charge the routed experts' GEMM FLOPs to: the
 * daemon's experts in e4m3 on fp8 tensor cores run them at the fp8 GEMM's
 * rate (the rest, attention projections, router, lm_head, stay at the
 * bf16 one: mlens_perf_gemm_seconds); where that rate is missing, at the
 * bf16 rate, why saying why. */
struct expert_rate {
	bool fp8;		/* the daemon's experts are e4m3 */
	bool at_fp8;		/* ... and their FLOPs go at the fp8 rate */
	char why[320];		/* fp8 experts at the bf16 rate: the reason */
};

static void expert_rate_pick(struct expert_rate *er, const struct ceilings *c, bool experts_fp8,
			     const struct mlens_model_config *mc)
{
	memset(er, 0, sizeof(*er));
	er->fp8 = experts_fp8;
	if (!experts_fp8 || !c->have)
		return;
	if (mc->expert_dtype == MLENS_DTYPE_E4M3 && mc->expert_scale.kind == MLENS_WSCALE_BLOCK)
		snprintf(er->why, sizeof(er->why), "the daemon dequantizes block-scaled fp8 experts for "
			 "their GEMMs");
	else if (!c->fp8_measured)
		snprintf(er->why, sizeof(er->why), "the fp8 GEMM was not measured: mlensd's arguments "
			 "named no fp8 experts before it started");
	else if (!(c->gemm_fp8_tflops > 0))
		snprintf(er->why, sizeof(er->why), "%s", c->gemm_fp8_refused);
	else
		er->at_fp8 = true;
}

/* The experts' rate, TFLOP/s, held under load (else the lone GEMMs'), or
 * burst: the lone GEMMs'; 0 where they go at the bf16 rate. */
static double expert_bound_tflops(const struct expert_rate *er, const struct ceilings *c, bool burst)
{
	if (!er->at_fp8)
		return 0;
	return !burst && c->gemm_fp8_sustained_tflops > 0 ? c->gemm_fp8_sustained_tflops : c->gemm_fp8_tflops;
}

#ifdef HAVE_CUDA
/* Whether mlensd is to hold the model's experts in e4m3 on fp8 tensor
 * cores, as far as the bench knows before it starts: an fp8 checkpoint of
 * per-channel scales (block scales are dequantized), or weight_dtype =
 * fp8 among the daemon's arguments or in the config file they name. */
static bool daemon_experts_fp8(const struct serve_opts *o, const struct mlens_model_config *mc)
{
	struct mlens_config c;
	char *argv[MAX_DAEMON_ARGS + 1], err[256];
	bool fp8;

	if (mc->expert_dtype == MLENS_DTYPE_E4M3)
		return mc->expert_scale.kind != MLENS_WSCALE_BLOCK;
	mlens_config_defaults(&c);
	argv[0] = "mlensd";
	for (int i = 0; i < o->n_daemon_args; i++)
		argv[i + 1] = (char *)o->daemon_args[i];
	fp8 = !mlens_config_parse_args(&c, o->n_daemon_args + 1, argv, err, sizeof(err)) &&
	      (!c.config || !mlens_config_load_file(&c, c.config, err, sizeof(err))) && c.weight_dtype &&
	      !strcmp(c.weight_dtype, "fp8");
	mlens_config_free(&c);
	return fp8;
}

static uint16_t bf16_of(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static float median_ms(float *t, int n)
{
	for (int i = 1; i < n; i++)
		for (int j = i; j > 0 && t[j - 1] > t[j]; j--) {
			float x = t[j];
			t[j] = t[j - 1];
			t[j - 1] = x;
		}
	return t[n / 2];
}

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
	fprintf(stderr, "serve: %s: %s\n", #x, cudaGetErrorString(e_)); goto out; } } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { \
	fprintf(stderr, "serve: %s: %s\n", #x, cublasGetStatusString(s_)); goto out; } } while (0)

#define CEIL_GEMM_W 4			/* weight copies, used in turn */
#define CEIL_GEMM_WS (32u << 20)	/* cuBLAS workspace bytes */

/* The expert GEMM of the ceilings, out[m][I] = x[m][H] . W1[I][H]^T over
 * CEIL_GEMM_W weight copies in turn (L2 never holds the operand), random
 * data, fp32 accumulation: bf16 in and fp32 out through cuBLAS, or (fp8)
 * e4m3 in, scaled by a per-row and a per-channel vector in the epilogue
 * (outer-vector scales) into bf16 through cuBLASLt, as the engine's fp8
 * experts run their gate and up. */
struct ceil_gemm {
	bool fp8;
	int H, I, m;
	void *w[CEIL_GEMM_W], *x, *y, *ws;
	float *w_scale, *x_scale;	/* fp8: per channel (I), per row (m) */
	cublasHandle_t blas;
	cublasLtHandle_t lt;
	cublasLtMatmulDesc_t op;
	cublasLtMatrixLayout_t la, lb, ld;
	cublasLtMatmulAlgo_t algo;
};

/* n random values of the GEMM's input dtype, uniform in [-amp/2, amp/2),
 * into device memory dst; h: host room for n of them. */
static int fill_random(void *dst, size_t n, bool fp8, float amp, uint64_t *s, void *h)
{
	for (size_t i = 0; i < n; i++) {
		float v;
		*s = mix64(*s + i);
		v = (float)((double)(*s >> 11) / 9007199254740992.0 - 0.5) * amp;
		if (fp8)
			((uint8_t *)h)[i] = mlens_f32_to_e4m3(v);
		else
			((uint16_t *)h)[i] = bf16_of(v);
	}
	return cudaMemcpy(dst, h, n * (fp8 ? 1 : 2), cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
}

/* The cuBLASLt fp8 GEMM's descriptor, layouts and algorithm. -1 with why
 * set when cuBLASLt takes no such GEMM. The heuristic is asked with B and
 * D of the same n (m rows): layouts that disagree on n are an invalid
 * problem, which reads as no algorithm. */
static int ceil_gemm_lt(struct ceil_gemm *g, char *why, size_t whylen)
{
	cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
	int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
	cublasLtMatmulPreference_t pref = NULL;
	cublasLtMatmulHeuristicResult_t hr;
	size_t ws = CEIL_GEMM_WS;
	const char *step = "cublasLtCreate";
	int found = 0, rc = -1;
	cublasStatus_t st = cublasLtCreate(&g->lt);

	if (st == CUBLAS_STATUS_SUCCESS && (step = "cublasLtMatmulDescCreate"))
		st = cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
	/* A is W (a scale a channel), B is x (a scale a row) */
	if (st == CUBLAS_STATUS_SUCCESS && (step = "the outer-vector scale mode"))
		st = cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode));
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode));
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g->w_scale,
						    sizeof(g->w_scale));
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g->x_scale,
						    sizeof(g->x_scale));
	if (st == CUBLAS_STATUS_SUCCESS && (step = "cublasLtMatrixLayoutCreate"))
		st = cublasLtMatrixLayoutCreate(&g->la, CUDA_R_8F_E4M3, (uint64_t)g->H, (uint64_t)g->I, g->H);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&g->lb, CUDA_R_8F_E4M3, (uint64_t)g->H, (uint64_t)g->m, g->H);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&g->ld, CUDA_R_16BF, (uint64_t)g->I, (uint64_t)g->m, g->I);
	if (st == CUBLAS_STATUS_SUCCESS && (step = "cublasLtMatmulPreferenceCreate"))
		st = cublasLtMatmulPreferenceCreate(&pref);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
							  sizeof(ws));
	if (st == CUBLAS_STATUS_SUCCESS && (step = "cublasLtMatmulAlgoGetHeuristic"))
		st = cublasLtMatmulAlgoGetHeuristic(g->lt, g->op, g->la, g->lb, g->ld, g->ld, pref, 1, &hr,
						    &found);
	if (st != CUBLAS_STATUS_SUCCESS || found < 1)
		snprintf(why, whylen, "cuBLASLt has no e4m3 GEMM [%d x %d] x %d rows with per-row and "
			 "per-channel scales into bf16 (%s: %s, %d algorithms)", g->I, g->H, g->m, step,
			 cublasGetStatusString(st), found);
	else
		rc = 0;
	if (!rc)
		g->algo = hr.algo;
	if (pref)
		cublasLtMatmulPreferenceDestroy(pref);
	return rc;
}

/* Set g up (g->fp8, H, I, m given). -1 with why set. */
static int ceil_gemm_setup(struct ceil_gemm *g, uint64_t *s, char *why, size_t whylen)
{
	size_t wn = (size_t)g->H * g->I, xn = (size_t)g->m * g->H, eb = g->fp8 ? 1 : 2;
	void *h = malloc((wn > xn ? wn : xn) * 4);
	float *hf = h;
	int rc = -1;

	snprintf(why, whylen, "CUDA error setting the GEMM up (on stderr)");
	if (!h)
		goto out;
	/* fp8: the values a per-channel and per-row quantization gives (its
	 * range), scales that bring them back */
	for (int k = 0; k < CEIL_GEMM_W; k++) {
		CK(cudaMalloc(&g->w[k], wn * eb));
		if (fill_random(g->w[k], wn, g->fp8, g->fp8 ? 2 * MLENS_E4M3_MAX : 0.05f, s, h))
			goto out;
	}
	CK(cudaMalloc(&g->x, xn * eb));
	if (fill_random(g->x, xn, g->fp8, g->fp8 ? 2 * MLENS_E4M3_MAX : 1.0f, s, h))
		goto out;
	CK(cudaMalloc(&g->y, (size_t)g->m * g->I * 4));
	CK(cudaMalloc(&g->ws, CEIL_GEMM_WS));
	if (g->fp8) {
		for (size_t i = 0; i < (size_t)(g->I > g->m ? g->I : g->m); i++)
			hf[i] = 1.0f / MLENS_E4M3_MAX;
		CK(cudaMalloc((void **)&g->w_scale, (size_t)g->I * 4));
		CK(cudaMalloc((void **)&g->x_scale, (size_t)g->m * 4));
		CK(cudaMemcpy(g->w_scale, hf, (size_t)g->I * 4, cudaMemcpyHostToDevice));
		CK(cudaMemcpy(g->x_scale, hf, (size_t)g->m * 4, cudaMemcpyHostToDevice));
		rc = ceil_gemm_lt(g, why, whylen);
		goto out;
	}
	CB(cublasCreate(&g->blas));
	CB(cublasSetWorkspace(g->blas, g->ws, CEIL_GEMM_WS));
	rc = 0;
out:
	free(h);
	return rc;
}

static void ceil_gemm_free(struct ceil_gemm *g)
{
	if (g->blas)
		cublasDestroy(g->blas);
	if (g->ld)
		cublasLtMatrixLayoutDestroy(g->ld);
	if (g->lb)
		cublasLtMatrixLayoutDestroy(g->lb);
	if (g->la)
		cublasLtMatrixLayoutDestroy(g->la);
	if (g->op)
		cublasLtMatmulDescDestroy(g->op);
	if (g->lt)
		cublasLtDestroy(g->lt);
	for (int k = 0; k < CEIL_GEMM_W; k++)
		cudaFree(g->w[k]);
	cudaFree(g->x);
	cudaFree(g->y);
	cudaFree(g->ws);
	cudaFree(g->w_scale);
	cudaFree(g->x_scale);
	memset(g, 0, sizeof(*g));
}

/* One GEMM queued, weight copy i % CEIL_GEMM_W. -1 (said on stderr) on error. */
static int ceil_gemm_run(struct ceil_gemm *g, int i)
{
	float alpha = 1.0f, beta = 0.0f;

	if (g->fp8)
		CB(cublasLtMatmul(g->lt, g->op, &alpha, g->w[i % CEIL_GEMM_W], g->la, g->x, g->lb, &beta, g->y,
				  g->ld, g->y, g->ld, &g->algo, g->ws, CEIL_GEMM_WS, 0));
	else
		CB(cublasGemmEx(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, g->I, g->m, g->H, &alpha,
				g->w[i % CEIL_GEMM_W], CUDA_R_16BF, g->H, g->x, CUDA_R_16BF, g->H, &beta, g->y,
				CUDA_R_32F, g->I, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
	return 0;
out:
	return -1;
}

/* g's rates, TFLOP/s: *alone the median of 20 GEMMs after 3 warm-ups,
 * each alone (the GPU idle around it, at its burst clock); *held the same
 * GEMMs queued back to back for ~4 s, timed over the last ~2 (the first 2
 * let a GPU that reaches its power limit settle its clock; the pipeline
 * keeps it busy for minutes). -1 on a CUDA or cuBLAS error. */
static int time_gemm(struct ceil_gemm *g, cudaEvent_t e0, cudaEvent_t e1, double *alone, double *held)
{
	const double flop = 2.0 * g->m * (double)g->H * g->I;	/* one GEMM's */
	float t[20], ms;
	int n;

	for (int i = 0; i < 23; i++) {
		CK(cudaEventRecord(e0, 0));
		if (ceil_gemm_run(g, i))
			goto out;
		CK(cudaEventRecord(e1, 0));
		CK(cudaEventSynchronize(e1));
		if (i >= 3)
			CK(cudaEventElapsedTime(&t[i - 3], e0, e1));
	}
	*alone = flop / (median_ms(t, 20) * 1e-3) / 1e12;
	n = (int)(2.0 * *alone * 1e12 / flop) + 1;	/* ~2 s of them */
	for (int half = 0; half < 2; half++) {
		CK(cudaEventRecord(e0, 0));
		for (int i = 0; i < n; i++)
			if (ceil_gemm_run(g, i))
				goto out;
		CK(cudaEventRecord(e1, 0));
		CK(cudaEventSynchronize(e1));
	}
	CK(cudaEventElapsedTime(&ms, e0, e1));
	*held = flop * n / (ms * 1e-3) / 1e12;
	return 0;
out:
	return -1;
}

/* HBM: median of 10 copies of 2 GiB (4 GiB moved each). GEMM: the
 * engine's expert GEMM (struct ceil_gemm) at m rows, bf16, alone and held
 * under load (time_gemm). fp8 (the daemon's experts in e4m3): the same for
 * the e4m3 GEMM, or gemm_fp8_refused saying why it has no rate (a GPU
 * without fp8 tensor cores, cuBLASLt without such a GEMM). */
static void measure_ceilings(struct ceilings *c, int H, int I, int m, bool fp8)
{
	const size_t copy_bytes = 2ull << 30;
	void *a = NULL, *b = NULL;
	struct ceil_gemm gm = { .H = H, .I = I, .m = m };
	cudaEvent_t e0 = NULL, e1 = NULL;
	struct cudaDeviceProp prop;
	float t[20];
	uint64_t s = 12345;
	char why[sizeof(c->gemm_fp8_refused)];

	memset(c, 0, sizeof(*c));
	c->gemm_m = m;
	CK(cudaGetDeviceProperties(&prop, 0));
	snprintf(c->device, sizeof(c->device), "%s", prop.name);
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	CK(cudaMalloc(&a, copy_bytes));
	CK(cudaMalloc(&b, copy_bytes));
	CK(cudaMemset(a, 1, copy_bytes));
	for (int i = 0; i < 13; i++) {
		CK(cudaEventRecord(e0, 0));
		CK(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, 0));
		CK(cudaEventRecord(e1, 0));
		CK(cudaEventSynchronize(e1));
		if (i >= 3)
			CK(cudaEventElapsedTime(&t[i - 3], e0, e1));
	}
	c->hbm_gbs = 2.0 * copy_bytes / (median_ms(t, 10) * 1e-3) / 1e9;
	cudaFree(a);
	cudaFree(b);
	a = b = NULL;

	if (ceil_gemm_setup(&gm, &s, why, sizeof(why)) ||
	    time_gemm(&gm, e0, e1, &c->gemm_tflops, &c->gemm_sustained_tflops))
		goto out;
	c->have = true;
	ceil_gemm_free(&gm);
	if (!fp8)
		goto out;
	c->fp8_measured = true;
	gm = (struct ceil_gemm){ .fp8 = true, .H = H, .I = I, .m = m };
	if (prop.major * 10 + prop.minor < 89)
		snprintf(c->gemm_fp8_refused, sizeof(c->gemm_fp8_refused),
			 "%.64s (compute capability %d.%d) has no fp8 tensor cores", prop.name, prop.major,
			 prop.minor);
	else if (!ceil_gemm_setup(&gm, &s, c->gemm_fp8_refused, sizeof(c->gemm_fp8_refused)) &&
		 time_gemm(&gm, e0, e1, &c->gemm_fp8_tflops, &c->gemm_fp8_sustained_tflops))
		snprintf(c->gemm_fp8_refused, sizeof(c->gemm_fp8_refused),
			 "the e4m3 GEMM failed to run (cuBLASLt's error on stderr)");
	if (c->gemm_fp8_refused[0]) {
		c->gemm_fp8_tflops = c->gemm_fp8_sustained_tflops = 0;
		fprintf(stderr, "serve: fp8 GEMM ceiling: %s; the bound charges the experts' GEMMs at the "
			"bf16 rate\n", c->gemm_fp8_refused);
	}
out:
	ceil_gemm_free(&gm);
	cudaFree(a);
	cudaFree(b);
	if (e0)
		cudaEventDestroy(e0);
	if (e1)
		cudaEventDestroy(e1);
}
/* The host side of the hybrid pipeline's ceilings, in this process before
 * the daemon starts. H2D: cudaMemcpyAsync of 1 GiB from cudaHostAlloc
 * memory, best of 3 after a warm-up. CPU memory under copy: 16 such copies
 * queued on a stream (events around them) while every core streams reads
 * over another 1 GiB buffer (kernels/cpu/readbw.c); only read passes that end before
 * the last copy does count, and the copies' own rate over the same time is
 * kept: the memory then serves both, and the hybrid bound charges KV reads
 * and the weight DMA to that sum (DESIGN §1: B_mem = B_KV + B_IO). */
static void measure_host_link(struct ceilings *c)
{
	const size_t bytes = 1ull << 30;
	enum { NC = 16 };
	void *h = NULL, *d = NULL;
	char *rb = NULL;
	struct mlens_pool *pool = NULL;
	cudaStream_t st = NULL;
	cudaEvent_t ev[NC + 1] = { 0 };
	float ms, best = 0;
	double rd_bytes = 0, rd_s = 0, copy_s = 0;

	CK(cudaHostAlloc(&h, bytes, cudaHostAllocDefault));
	memset(h, 1, bytes);
	CK(cudaMalloc(&d, bytes));
	CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
	for (int i = 0; i <= NC; i++)
		CK(cudaEventCreate(&ev[i]));
	for (int i = 0; i < 4; i++) {
		CK(cudaEventRecord(ev[0], st));
		CK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, st));
		CK(cudaEventRecord(ev[1], st));
		CK(cudaEventSynchronize(ev[1]));
		CK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
		if (i && (best == 0 || ms < best))
			best = ms;
	}
	c->h2d_gbs = (double)bytes / (best * 1e-3) / 1e9;

	rb = mlens_readbw_alloc(bytes);
	if (!rb || mlens_pool_create(&pool, 0, NULL)) {
		fprintf(stderr, "serve: cannot set up the memory read test (1 GiB, a thread per CPU)\n");
		goto out;
	}
	memset(rb, 1, bytes);
	{
		/* the daemon's KV pool asks for huge pages too (its log says
		 * how many it got): a read rate without them is not its ceiling */
		size_t hb;
		c->read_huge = mlens_huge_bytes(NULL, rb, bytes, &hb) ? NAN : (double)hb / (double)bytes;
	}
	c->read_threads = mlens_pool_size(pool);
	c->read_gbs = mlens_readbw_best(pool, rb, bytes);
	for (int round = 0; round < 2; round++) {
		CK(cudaEventRecord(ev[0], st));
		for (int i = 0; i < NC; i++) {
			CK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, st));
			CK(cudaEventRecord(ev[i + 1], st));
		}
		/* the copies start as soon as they are queued: read until the
		 * last one is done, counting the passes that ended before it */
		while (cudaEventQuery(ev[NC]) == cudaErrorNotReady) {
			double t = mlens_readbw_pass(pool, rb, bytes);
			if (cudaEventQuery(ev[NC]) == cudaErrorNotReady) {
				rd_bytes += (double)bytes;
				rd_s += t;
			}
		}
		CK(cudaEventSynchronize(ev[NC]));
		CK(cudaEventElapsedTime(&ms, ev[0], ev[NC]));
		copy_s += ms * 1e-3;
	}
	c->copy_read_gbs = 2.0 * NC * (double)bytes / copy_s / 1e9;
	if (rd_s > 0) {
		c->read_copy_gbs = rd_bytes / rd_s / 1e9;
		c->mem_copy_gbs = c->read_copy_gbs + c->copy_read_gbs;
		c->have_link = true;
	} else {
		fprintf(stderr, "serve: no read pass fitted inside the copies: CPU memory under copy not measured\n");
	}
out:
	if (pool)
		mlens_pool_destroy(pool);
	free(rb);
	for (int i = 0; i <= NC; i++)
		if (ev[i])
			cudaEventDestroy(ev[i]);
	if (st)
		cudaStreamDestroy(st);
	cudaFree(d);
	cudaFreeHost(h);
}
#endif

/* The bound GPU-only serving can reach on this workload, from the measured
 * HBM bandwidth BW and GEMM rate R (both for the whole device).
 *
 * Steady state: B sequences run at once, each holding on average occ tokens
 * of KV (the mix's mean occupancy over the steps its requests live,
 * perfmodel.h), so B <= M/occ for a pool of M tokens; p and g the mix's
 * mean lengths; a step carries one decode
 * token per running sequence plus, on average, B*p/g prefill tokens (a
 * sequence's prompt once per g steps), so n = B(p+g)/g <= N_cap, the step
 * token cap. B = min(M/(p+g), N_cap*g/(p+g)).
 *
 * One step of n tokens must
 *  - read every weight it uses once: W = L*(attention + norms + router +
 *    D*expert_bytes) + lm_head, with D = E*(1-(1-k/E)^n) the experts that n
 *    tokens route to in expectation (all E once n*k >> E);
 *  - do F = n*2*L*(attention params + router + k*3*H*I) GEMM FLOPs, plus
 *    attention scores: 4*nh*hd*ctx per token and layer (ctx p/2 for a
 *    prefill token on average, p+g/2 for a decode one), plus 2*H*V per
 *    sampled row (B(1+1/g) rows);
 *  - read the KV of every decode token's context: B*(p+g/2)*L*kv_token_bytes
 *    (expert_bytes and kv_token_bytes as the daemon runs: serve_perf_model);
 * Weight reads and GEMMs overlap (the GEMMs stream their weights), KV reads
 * happen in the attention kernels between them, so
 *     t_step >= max(W/BW, F/R) + KV/BW,  generated tokens/s <= B / t_step.
 * R is taken at the expert GEMM's shape with n*k/E rows, the GEMMs that
 * dominate F. fp8 experts: their n*L*k*6*H*I FLOPs at the fp8 GEMM's rate
 * and the rest at R (expert_rate > 0: mlens_perf_gemm_seconds). */
struct bound {
	double B, n_step, w_bytes, flops, kv_bytes, t_weights, t_flops, t_kv, t_step, gen_tps;
};

static void compute_bound(struct bound *bd, const struct mlens_model_config *c,
			  const struct mlens_perf_model *pm, double p, double g,
			  double occ, double kv_tokens, double n_cap, double bw, double rate,
			  double expert_rate)
{
	double L = (double)c->num_hidden_layers, H = (double)c->hidden_size;
	double I = (double)c->intermediate_size, E = (double)c->num_local_experts;
	double k = (double)c->num_experts_per_tok, V = (double)c->vocab_size;
	double nh = (double)c->num_attention_heads;
	double hd = (double)c->head_dim, es = (double)mlens_dtype_size(c->dtype);
	double attn_params = H * nh * hd * 2 + H * (double)c->num_key_value_heads * hd * 2;
	double B, n, D, pre, rows;

	memset(bd, 0, sizeof(*bd));
	B = floor(kv_tokens / occ);
	if (floor(n_cap * g / (p + g)) < B)
		B = floor(n_cap * g / (p + g));
	if (B < 1)
		B = 1;
	n = B * (p + g) / g;
	pre = B * p / g;
	D = E * (1 - pow(1 - k / E, n));
	rows = B * (1 + 1 / g);
	bd->B = B;
	bd->n_step = n;
	bd->w_bytes = L * ((attn_params + 2 * H + H * E) * es + D * (double)pm->expert_bytes) + V * H * es;
	bd->flops = n * 2 * L * (attn_params + H * E + k * 3 * H * I) +
		    L * 4 * nh * hd * (pre * p / 2 + B * (p + g / 2)) + rows * 2 * H * V;
	bd->kv_bytes = B * (p + g / 2) * L * (double)pm->kv_token_bytes;
	if (bw <= 0 || rate <= 0)
		return;
	bd->t_weights = bd->w_bytes / bw;
	bd->t_flops = mlens_perf_gemm_seconds(bd->flops, n * L * pm->flops_experts, rate, expert_rate);
	bd->t_kv = bd->kv_bytes / bw;
	bd->t_step = (bd->t_weights > bd->t_flops ? bd->t_weights : bd->t_flops) + bd->t_kv;
	bd->gen_tps = B / bd->t_step;
}

/* ==== the subcommand ==== */

static void usage(FILE *f)
{
	fprintf(f,
		"usage: mlens-bench serve --model DIR [--mlensd PATH] [--backend auto|cpu|cuda]\n"
		"       [--kv-cache SIZE] [--gpu-memory SIZE] [--max-step-tokens N] [--daemon-arg ARG]...\n"
		"       [--prompt-len P|LO:HI] [--gen-len G|LO:HI] [--lengths FILE] [--seed S]\n"
		"       [--requests N | --pool-fulls N] [--concurrency C] [--threads T]\n"
		"       [--start-timeout S] [--timeout S] [--keep-log] [--daemon-log FILE] [--predict]\n"
		"       [--no-ceilings] [--op-timing] [--json]\n"
		"  --keep-log: keep the daemon's temporary directory and log (kept anyway on failure)\n"
		"  --daemon-log FILE: the daemon logs to FILE (appended to, kept)\n"
		"  --predict: after the run, ask the daemon's performance model (mlensctl profile;\n"
		"             it measures unless the daemon profiled already) for the step the\n"
		"             scheduler reaches with its token cap and the requests in flight, and\n"
		"             print it beside the whole-run and steady-state measurements\n"
		"  --no-ceilings: skip the CUDA ceilings measured before the daemon starts\n"
		"  --op-timing: a table of the daemon's per-op GPU time over the steady window\n"
		"             (its stats' gpu_ops: start it with --daemon-arg=--op-timing)\n"
		"  --prompt-len/--gen-len LO:HI: each request's length drawn log-uniform in [LO, HI]\n"
		"             (from --seed); --lengths FILE: one \"P G\" a line, requests in turn\n"
		"  --pool-fulls N: N KV pools' worth of requests of the mix (instead of --requests)\n"
		"  --concurrency C: requests in flight (default: two KV pools' worth of the mix)\n");
}

static json_t *jnum_or_null(double x)
{
	return isfinite(x) ? json_real(x) : json_null();
}

/* A table cell: the number, or "n/a" when the daemon did not report it. */
static const char *fmt_num(char *buf, size_t len, int decimals, double x)
{
	if (!isfinite(x))
		return "n/a";
	snprintf(buf, len, "%.*f", decimals, x);
	return buf;
}

static const char *jstr(json_t *o, const char *key, const char *dflt)
{
	const char *v = o ? json_string_value(json_object_get(o, key)) : NULL;
	return v ? v : dflt;
}

/* The performance model of the bounds as the daemon runs the model: the
 * experts' dtype (fp8 when it quantized them at load) and the KV cache's
 * from its status (model.expert_dtype, budgets.kv_cache.dtype), cfg being
 * the model file's config. The daemon's bytes of one expert must be the
 * model's. 0, or -1 with err saying what disagrees. */
static int serve_perf_model(struct mlens_perf_model *pm, const struct mlens_model_config *file_cfg,
			    json_t *status, char *err, size_t errlen)
{
	struct mlens_model_config c = *file_cfg;
	json_t *m = json_object_get(status, "model");
	const char *ed = jstr(m, "expert_dtype", NULL);
	const char *kd = jstr(json_object_get(json_object_get(status, "budgets"), "kv_cache"), "dtype", NULL);
	enum mlens_dtype e, kv;

	if (!ed || mlens_safetensors_dtype(ed, &e) || !kd || mlens_safetensors_dtype(kd, &kv)) {
		snprintf(err, errlen, "the daemon's status names no expert dtype (model.expert_dtype: %s) "
			 "or KV dtype (budgets.kv_cache.dtype: %s): run the mlensd of this build",
			 ed ? ed : "none", kd ? kd : "none");
		return -1;
	}
	if (e == MLENS_DTYPE_E4M3 && c.expert_dtype != MLENS_DTYPE_E4M3)
		mlens_quant_config_at_load(&c);
	if (e != c.expert_dtype || mlens_perf_model_from_config(pm, &c, kv)) {
		snprintf(err, errlen, "the daemon's experts are %s, the model's %s: no performance model for them",
			 ed, mlens_dtype_name(c.expert_dtype));
		return -1;
	}
	if ((double)pm->expert_bytes != jnum(m, "expert_bytes")) {
		snprintf(err, errlen, "the daemon streams %.0f bytes an expert, the model's config gives %llu",
			 jnum(m, "expert_bytes"), (unsigned long long)pm->expert_bytes);
		return -1;
	}
	return 0;
}

/* The steady-state window (the rule, documented in mlens-bench(1)): from the
 * first request's last token (the first cohort has gone through: ramp-up
 * over) to the last request's first token (the last admission: after it
 * nothing new enters and the batch drains), whole 10 ms bins inside it; at
 * least 10 bins or no window. */
struct steady {
	bool have;
	double t_start, t_end, seconds;	/* from the start of the run */
	double gen_tps, total_tps;
	/* daemon counters between the stats samples inside the window */
	bool have_stats;
	double steps, step_tokens, engine_busy, pcie_gbs, gpu_busy;
	double disk_gbs;	/* experts read from the model files (NAN: none on disk) */
	/* the host side: share of the window in KV append + decode attention
	 * (cpu_busy) and in the append alone, KV GB/s over the attention's
	 * own seconds (append excluded) */
	double cpu_busy, append_busy, attn_only_gbs;
	double kv_run_blocks;	/* KV blocks the CPU attention read per run of consecutive ids */
	/* the window's steps (at the counters' rate) in generation lengths:
	 * below one, no request's lifetime fits in it, the batch has not
	 * turned over once and its rates are the ramp's, not a steady
	 * state's (too few requests) */
	double generations;
	bool short_window;
	size_t s_a, s_b;	/* with have_stats: the stats samples at its ends */
};

static void steady_window(struct steady *w, const struct serve_run *run, int n_req, int gen_len,
			  const struct sampler *sp)
{
	uint64_t ta = UINT64_MAX, tb = 0, gen = 0, pr = 0;
	size_t a, b, i, j;
	double span;
	memset(w, 0, sizeof(*w));
	for (int k = 0; k < n_req; k++) {
		const struct req_rec *r = &run->recs[k];
		if (r->t_last && r->t_last < ta)
			ta = r->t_last;
		if (r->t_first > tb)
			tb = r->t_first;
	}
	if (ta == UINT64_MAX || tb <= ta)
		return;
	a = (size_t)((ta - run->t0 + BIN_NS - 1) / BIN_NS);
	b = (size_t)((tb - run->t0) / BIN_NS);
	if (b > run->n_bins - 1)
		b = run->n_bins - 1;	/* the last bin collects what came later */
	if (b < a + 10)
		return;
	for (i = a; i < b; i++) {
		gen += atomic_load(&run->gen_bins[i]);
		pr += atomic_load(&run->prompt_bins[i]);
	}
	w->have = true;
	w->t_start = (double)(a * BIN_NS) / 1e9;
	w->t_end = (double)(b * BIN_NS) / 1e9;
	w->seconds = w->t_end - w->t_start;
	w->gen_tps = (double)gen / w->seconds;
	w->total_tps = (double)(gen + pr) / w->seconds;
	/* the counters' samples inside the window's bins (not [ta, tb]: the
	 * bins round inward), so their span never exceeds the window */
	ta = run->t0 + a * BIN_NS;
	tb = run->t0 + b * BIN_NS;
	for (i = 0; i < sp->n && sp->s[i].t < ta; i++)
		;
	for (j = sp->n; j > 0 && sp->s[j - 1].t > tb; j--)
		;
	if (j == 0 || i >= j - 1)
		return;
	j--;
	w->have_stats = true;
	w->s_a = i;
	w->s_b = j;
	w->steps = sp->s[j].v[K_STEPS] - sp->s[i].v[K_STEPS];
	w->step_tokens = w->steps > 0 ? (sp->s[j].v[K_GEN] - sp->s[i].v[K_GEN] + sp->s[j].v[K_PROMPT] -
					 sp->s[i].v[K_PROMPT]) / w->steps : NAN;
	w->engine_busy = rate(&sp->s[i], &sp->s[j], K_STEP_S, -1);
	w->pcie_gbs = rate(&sp->s[i], &sp->s[j], K_H2D, -1) / 1e9;
	w->disk_gbs = rate(&sp->s[i], &sp->s[j], K_DISK, -1) / 1e9;
	w->gpu_busy = rate(&sp->s[i], &sp->s[j], K_GPU_BUSY, -1);
	w->cpu_busy = rate(&sp->s[i], &sp->s[j], K_ATTN_S, -1);
	w->append_busy = rate(&sp->s[i], &sp->s[j], K_APPEND_S, -1);
	w->attn_only_gbs = w->cpu_busy - w->append_busy > 0
		? rate(&sp->s[i], &sp->s[j], K_KV_READ, -1) / (w->cpu_busy - w->append_busy) / 1e9 : NAN;
	{
		double nb = sp->s[j].v[K_KV_BLOCKS] - sp->s[i].v[K_KV_BLOCKS];
		double nr = sp->s[j].v[K_KV_RUNS] - sp->s[i].v[K_KV_RUNS];
		w->kv_run_blocks = nr > 0 ? nb / nr : NAN;
	}
	/* the counters cover the samples' span inside the window: their step
	 * rate times the window */
	span = (double)(sp->s[j].t - sp->s[i].t) / 1e9;
	w->generations = gen_len > 0 && span > 0 ? w->steps / span * w->seconds / gen_len : NAN;
	w->short_window = w->generations < 1.0;
}

/* --op-timing: the daemon's op time account (op_timing = on: gpu_ops in
 * its stats) between samples a and b, over steps of both: each op's
 * compute-queue time per step, its share of the step's wall time, its
 * FLOPs' rate and that rate over the held GEMM rate (held_tflops, 0: not
 * measured); the queue's time between the ops inside their span (launch
 * gaps, and in hybrid mode waits for weights and activations) and the
 * step's time outside the span. NULL when the daemon keeps no account or
 * no step was timed; printed as a table unless json. */
static json_t *op_table(const struct sample *a, const struct sample *b, const char *over,
			double held_tflops, bool json)
{
	double steps = b->op_steps - a->op_steps;
	double step_s = (b->v[K_STEP_S] - a->v[K_STEP_S]) / (b->v[K_STEPS] - a->v[K_STEPS]);
	double span = (b->op_span - a->op_span) / steps, sum = 0, between, outside;
	json_t *o, *arr;

	if (!(steps > 0) || !(step_s > 0))
		return NULL;
	arr = json_array();
	if (!json)
		printf("%-34s %10s %7s %9s %8s %10s  (%s, %.0f steps)\n", "ops (GPU queue)", "ms/step", "share",
		       "TFLOP/s", "of GEMM", "calls/step", over, steps);
	for (int i = 0; i < MLENS_LAYER_OP_N; i++) {
		double t = (b->op[i][0] - a->op[i][0]) / steps, f = (b->op[i][1] - a->op[i][1]) / steps;
		double calls = (b->op[i][2] - a->op[i][2]) / steps;
		double rate = f > 0 && t > 0 ? f / t / 1e12 : NAN;
		double of = held_tflops > 0 ? rate / held_tflops : NAN;
		const char *name = mlens_layer_op_name((enum mlens_layer_op)i);
		char r[32], g[32];
		if (!(calls > 0))
			continue;
		sum += t;
		json_array_append_new(arr, json_pack("{s:s,s:f,s:f,s:f,s:f,s:o,s:o}", "op", name,
			"seconds_per_step", t, "share", t / step_s, "calls_per_step", calls, "flops_per_step", f,
			"tflops", jnum_or_null(rate), "of_held_gemm", jnum_or_null(of)));
		if (!json)
			printf("  %-32s %10.3f %6.1f%% %9s %8s %10.1f\n", name, t * 1e3, 100 * t / step_s,
			       fmt_num(r, sizeof(r), 1, rate), fmt_num(g, sizeof(g), 2, of), calls);
	}
	between = span - sum;
	outside = step_s - span;
	if (!json) {
		printf("  %-32s %10.3f %6.1f%%\n", "between ops (launch gaps, waits)", between * 1e3,
		       100 * between / step_s);
		printf("  %-32s %10.3f %6.1f%%\n", "outside the ops' span", outside * 1e3, 100 * outside / step_s);
		printf("  %-32s %10.3f  (ops' span %.3f ms)\n", "step", step_s * 1e3, span * 1e3);
	}
	o = json_pack("{s:s,s:f,s:f,s:f,s:f,s:f,s:f,s:o,s:o}", "over", over, "steps", steps,
		      "step_seconds", step_s, "span_seconds_per_step", span, "ops_seconds_per_step", sum,
		      "between_ops_seconds_per_step", between, "outside_span_seconds_per_step", outside,
		      "held_gemm_tflops", jnum_or_null(held_tflops > 0 ? held_tflops : NAN), "by_op", arr);
	return o;
}

/* Step tokens and KV occupancy (blocks held / the pool's) over the steps
 * the stats samples saw between t_a and t_b (ns): a sample counts when
 * steps_total moved since the one before (a step it alone saw), so every
 * sampled step counts once whatever its length. */
struct step_dist {
	int n;			/* steps sampled */
	double tok[4], kv[4];	/* min, p10, p50, p90 */
};

static void step_distribution(struct step_dist *d, const struct sampler *sp, uint64_t ta, uint64_t tb)
{
	double *tok = malloc((sp->n + 1) * sizeof(double)), *kv = malloc((sp->n + 1) * sizeof(double));
	static const double pct[3] = { 10, 50, 90 };
	memset(d, 0, sizeof(*d));
	for (int k = 0; k < 4; k++)
		d->tok[k] = d->kv[k] = NAN;
	if (!tok || !kv)
		goto out;
	for (size_t i = 1; i < sp->n; i++) {
		const struct sample *x = &sp->s[i];
		if (x->t < ta || x->t > tb || !(x->v[K_STEPS] > sp->s[i - 1].v[K_STEPS]) ||
		    !isfinite(x->v[K_STEP_TOKENS]))
			continue;
		tok[d->n] = x->v[K_STEP_TOKENS];
		kv[d->n++] = x->v[K_KV_TOTAL] > 0 ? x->v[K_KV_USED] / x->v[K_KV_TOTAL] : NAN;
	}
	if (!d->n)
		goto out;
	qsort(tok, (size_t)d->n, sizeof(double), cmp_double);
	qsort(kv, (size_t)d->n, sizeof(double), cmp_double);
	d->tok[0] = tok[0];
	d->kv[0] = kv[0];
	for (int k = 0; k < 3; k++) {
		d->tok[k + 1] = percentile(tok, d->n, pct[k]);
		d->kv[k + 1] = percentile(kv, d->n, pct[k]);
	}
out:
	free(tok);
	free(kv);
}

static json_t *dist_json(const double *v)
{
	return json_pack("{s:o,s:o,s:o,s:o}", "min", jnum_or_null(v[0]), "p10", jnum_or_null(v[1]),
			 "p50", jnum_or_null(v[2]), "p90", jnum_or_null(v[3]));
}

/* The performance model's prediction at the step the scheduler reaches (perfmodel.h,
 * mlens_perf_sched_steady): the daemon's token cap as it ran, at most
 * min(KV sequences, --concurrency) in flight; the step's time from the
 * daemon's model (profile request with step_tokens), tokens/s from it. */
struct prediction {
	bool have;
	struct mlens_perf_sched_state st;
	double in_flight, step_seconds, gen_tps, total_tps;
};

int mlens_bench_serve(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "model", 1, 0, 'm' }, { "mlensd", 1, 0, 'd' }, { "backend", 1, 0, 'b' },
		{ "kv-cache", 1, 0, 'k' }, { "gpu-memory", 1, 0, 'G' }, { "max-step-tokens", 1, 0, 's' },
		{ "daemon-arg", 1, 0, 'a' }, { "prompt-len", 1, 0, 'p' }, { "gen-len", 1, 0, 'g' },
		{ "requests", 1, 0, 'n' }, { "concurrency", 1, 0, 'c' }, { "threads", 1, 0, 't' },
		{ "start-timeout", 1, 0, 'S' }, { "timeout", 1, 0, 'T' }, { "keep-log", 0, 0, 'K' },
		{ "daemon-log", 1, 0, 'L' }, { "lengths", 1, 0, 'l' }, { "seed", 1, 0, 'e' },
		{ "json", 0, 0, 'j' }, { "predict", 0, 0, 'P' }, { "no-ceilings", 0, 0, 'N' },
		{ "pool-fulls", 1, 0, 'f' }, { "op-timing", 0, 0, 'O' }, { "help", 0, 0, 'h' },
		{ 0, 0, 0, 0 }
	};
	struct serve_opts o = {
		.backend = "auto", .kv_cache = "1G", .prompt_lo = 512, .prompt_hi = 512, .gen_lo = 128,
		.gen_hi = 128, .requests = 256,
		.concurrency = 0, .threads = 4, .start_timeout = 600, .run_timeout = 3600,
	};
	struct daemon_proc d = { 0 };
	struct serve_run run = { 0 };
	struct sampler sp = { 0 };
	pthread_t sp_th;
	bool sp_on = false;
	struct client_arg *ca = NULL;
	pthread_t *th = NULL;
	struct mlens_model *model = NULL;
	struct mlens_perf_model pm;
	struct ceilings ceil_ = { 0 }, after = { 0 };	/* after: the host's, once the daemon stopped */
	struct bound bd = { 0 };
	struct mlens_perf_bound hb = { 0 }, hb_after = { 0 }, hb_burst = { 0 };
	double disk_b = NAN, disk_bps = NAN;	/* experts on disk: bytes a step, read rate */
	struct expert_rate er = { 0 };
	bool have_hb = false, have_hb_after = false, have_bd = false, hybrid;
	double w_step = 0;	/* hybrid: the weight bytes a step streams (the bound's W) */
	struct steady sw = { 0 };
	struct step_dist sd = { 0 };
	struct prediction pred = { 0 };
	json_t *st0 = NULL, *st1 = NULL, *status = NULL, *out = NULL, *prof = NULL;
	double *ttft = NULL, wall, busy, kv_tokens, kv_seqs, n_cap, block_tokens;
	double pcie_gbs, attn_s, attn_gbs, attn_only_gbs, append_s, gpu_busy, h2d_busy, attn_bytes;
	const char *attn_src = "daemon";
	uint64_t t1, gen = 0, prompt_tok = 0;
	int ok = 0, bad = 0, n_ttft = 0, rc = 1, opt;
	char err[512];
	struct mlens *probe = NULL;
	struct mlens_limits lim = { .size = sizeof(lim) };
	struct mlens_perf_mix mix, mix_b;	/* the requests' lengths, in tokens and in KV blocks */
	double p, g, L, kv_blocks = 0, pool_seqs = 0;
	bool concurrency_auto = false, requests_given = false;
	int max_total = 0, max_i = 0;

	optind = 1;
	while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		long long v = 0;
		if (strchr("nctsSTef", opt)) {
			v = mlens_bench_parse_count(optarg);
			if (v < 0 || v > 1 << 30) {
				fprintf(stderr, "serve: bad number '%s'\n", optarg);
				return 2;
			}
		}
		switch (opt) {
		case 'm': o.model = optarg; break;
		case 'd': o.mlensd = optarg; break;
		case 'b': o.backend = optarg; break;
		case 'k': o.kv_cache = optarg; break;
		case 'G': o.gpu_memory = optarg; break;
		case 's': o.max_step_tokens = (int)v; break;
		case 'a':
			if (o.n_daemon_args == MAX_DAEMON_ARGS) {
				fprintf(stderr, "serve: at most %d --daemon-arg\n", MAX_DAEMON_ARGS);
				return 2;
			}
			o.daemon_args[o.n_daemon_args++] = optarg;
			break;
		case 'p':
			if (parse_range("--prompt-len", optarg, &o.prompt_lo, &o.prompt_hi))
				return 2;
			break;
		case 'g':
			if (parse_range("--gen-len", optarg, &o.gen_lo, &o.gen_hi))
				return 2;
			break;
		case 'l': o.lengths_file = optarg; break;
		case 'e': o.seed = (uint64_t)v; break;
		case 'n': o.requests = (int)v; requests_given = true; break;
		case 'c': o.concurrency = (int)v; break;
		case 'f':
			if (v < 1) {
				fprintf(stderr, "serve: --pool-fulls '%s': give a whole number of KV pools, 1 or more\n",
					optarg);
				return 2;
			}
			o.pool_fulls = (int)v;
			break;
		case 't': o.threads = (int)v; break;
		case 'S': o.start_timeout = (double)v; break;
		case 'T': o.run_timeout = (double)v; break;
		case 'K': o.keep_log = true; break;
		case 'L': o.daemon_log = optarg; break;
		case 'j': o.json = true; break;
		case 'P': o.predict = true; break;
		case 'N': o.no_ceilings = true; break;
		case 'O': o.op_timing = true; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (!o.model || o.requests < 1 || o.concurrency < 0 || o.threads < 1 || o.run_timeout < 1) {
		usage(stderr);
		return 2;
	}
	if (o.pool_fulls && requests_given) {
		fprintf(stderr, "serve: give the job's size as --requests or as --pool-fulls, not both\n");
		return 2;
	}
	if (make_lengths(&o))
		return 2;
	note_longest(&o, &max_total, &max_i);
	if (lengths_mix(&o, 1, &mix)) {
		fprintf(stderr, "serve: out of memory\n");
		return 2;
	}
	/* the means: one (p, g) where a figure needs one (a fixed length's own) */
	o.prompt_len = (int)lround(mix.prompt);
	o.gen_len = (int)lround(mix.gen);
	if (o.concurrency && o.threads > o.concurrency)
		o.threads = o.concurrency;
	if (mlens_model_open(o.model, &model, err, sizeof(err))) {
		fprintf(stderr, "serve: %s\n", err);
		return 1;
	}
	{
		struct sigaction sa;
		memset(&sa, 0, sizeof(sa));
		sa.sa_handler = on_stop_signal;	/* no SA_RESTART: sleeps end early */
		sigemptyset(&sa.sa_mask);
		sigaction(SIGTERM, &sa, NULL);
		sigaction(SIGINT, &sa, NULL);
	}
	/* the KV pool's dtype as the daemon picks it: f32 models keep f32 KV */
	if (mlens_perf_model_from_config(&pm, &model->cfg, model->cfg.dtype == MLENS_DTYPE_F32 ?
					 MLENS_DTYPE_F32 : MLENS_DTYPE_BF16)) {
		fprintf(stderr, "serve: %s: the model's dimensions are out of range\n", o.model);
		goto out;
	}
	p = mix.prompt;
	g = mix.gen;
	L = (double)pm.layers;

#ifdef HAVE_CUDA
	/* ceilings first, while the box is idle; the CUDA context is torn
	 * down before the daemon starts so that its budget sees a bare GPU */
	if (!o.no_ceilings && strcmp(o.backend, "cpu")) {
		int ndev = 0;
		if (cudaGetDeviceCount(&ndev) == cudaSuccess && ndev > 0) {
			uint64_t kvb = 0;
			double rows = 4096;
			/* the expert GEMM at the bound's step: n k / E rows, n from
			 * the KV pool's size as configured (the daemon's exact block
			 * count is known only later; the rate is flat up there) */
			if (!mlens_parse_size(o.kv_cache, &kvb) && kvb > 0)
				rows = ceil((double)kvb / (L * (double)pm.kv_token_bytes) /
					    mlens_perf_mix_seq_blocks(&mix) * (p + g - 1) / g *
					    (double)pm.top_k / (double)pm.experts);
			rows = rows < 16 ? 16 : rows > 32768 ? 32768 : rows;
			measure_ceilings(&ceil_, (int)pm.hidden, (int)pm.inter, (int)rows,
					 daemon_experts_fp8(&o, &model->cfg));
			measure_host_link(&ceil_);
			cudaDeviceReset();
		} else {
			fprintf(stderr, "serve: no CUDA device: ceilings not measured\n");
		}
	}
#endif

	if (daemon_start(&d, &o))
		goto out;
	/* the KV pool in requests of this mix: --pool-fulls and the default
	 * concurrency count in it */
	status = socket_json(d.control, "{\"cmd\":\"status\"}\n");
	st0 = socket_json(d.stats, NULL);
	if (atomic_load(&stop_sig)) {
		fprintf(stderr, "serve: stopped by %s while mlensd started\n", stop_name());
		goto out;
	}
	if (!status || !st0) {
		fprintf(stderr, "serve: the daemon's control or stats socket did not answer\n");
		goto out;
	}
	block_tokens = jnum(json_object_get(json_object_get(status, "budgets"), "kv_cache"), "block_tokens");
	if (!(block_tokens >= 1))
		block_tokens = 16;
	if (lengths_mix(&o, (int)block_tokens, &mix_b)) {
		fprintf(stderr, "serve: out of memory\n");
		goto out;
	}
	pool_seqs = jnum(st0, "kv_blocks_total") / mlens_perf_mix_seq_blocks(&mix_b);
	if (!(pool_seqs >= 1))
		pool_seqs = 1;
	if (o.pool_fulls) {
		/* the same seed draws the same first requests, and as many more */
		double n = ceil(o.pool_fulls * pool_seqs);
		free(o.req_p);
		free(o.req_g);
		free(o.req_line);
		o.requests = n > 1 << 30 ? 1 << 30 : (int)n;
		if (make_lengths(&o) || lengths_mix(&o, 1, &mix))
			goto out;
		note_longest(&o, &max_total, &max_i);
		o.prompt_len = (int)lround(mix.prompt);
		o.gen_len = (int)lround(mix.gen);
		p = mix.prompt;
		g = mix.gen;
	}
	if (!o.concurrency) {
		/* two pools' worth in flight: a finished request's replacement
		 * is queued before its blocks are free, so the pool stays full */
		double c = ceil(2 * pool_seqs);
		o.concurrency = c < o.requests ? (int)c : o.requests;
		concurrency_auto = true;
	}
	if (o.threads > o.concurrency)
		o.threads = o.concurrency;
	if (mlens_open(d.sock, "bench-limits", &probe) || mlens_limits(probe, &lim)) {
		fprintf(stderr, "serve: cannot read the daemon's limits\n");
		goto out;
	}
	mlens_close(probe);
	for (int i = 0; i < o.requests; i++)
		if ((uint32_t)o.req_p[i] > lim.max_prompt_tokens) {
			max_i = i;
			break;
		}
	if ((uint32_t)o.req_p[max_i] > lim.max_prompt_tokens ||
	    (uint32_t)(o.req_p[max_i] + o.req_g[max_i]) > lim.max_context) {
		char where[4096 + 32] = "";
		if (o.req_line[max_i])
			snprintf(where, sizeof(where), "%s:%d: ", o.lengths_file, o.req_line[max_i]);
		fprintf(stderr, "serve: %srequest %d: p=%d g=%d is over the daemon's limits (prompt %u, "
			"context %u): shorten the lengths or raise the daemon's limits\n", where, max_i,
			o.req_p[max_i], o.req_g[max_i], lim.max_prompt_tokens, lim.max_context);
		goto out;
	}
	/* the bounds count the experts and KV the daemon runs, not the file's */
	if (!status || serve_perf_model(&pm, &model->cfg, status, err, sizeof(err))) {
		fprintf(stderr, "serve: %s\n", status ? err : "the control socket did not answer status");
		goto out;
	}
	expert_rate_pick(&er, &ceil_, pm.expert_fp8, &model->cfg);
	if (er.fp8 && ceil_.have && !er.at_fp8)
		fprintf(stderr, "serve: the bound charges the fp8 experts' GEMMs at the bf16 rate: %s\n", er.why);
	run.o = &o;
	run.sock = d.sock;
	run.vocab = lim.vocab_size;
	run.recs = calloc((size_t)o.requests, sizeof(*run.recs));
	run.n_bins = (size_t)(o.run_timeout * 1e9 / (double)BIN_NS) + 2;
	run.gen_bins = calloc(run.n_bins, sizeof(*run.gen_bins));
	run.prompt_bins = calloc(run.n_bins, sizeof(*run.prompt_bins));
	ca = calloc((size_t)o.threads, sizeof(*ca));
	th = calloc((size_t)o.threads, sizeof(*th));
	ttft = calloc((size_t)o.requests, sizeof(*ttft));
	if (!run.recs || !run.gen_bins || !run.prompt_bins || !ca || !th || !ttft || !st0) {
		fprintf(stderr, "serve: out of memory, or the stats socket did not answer\n");
		goto out;
	}
	sp.path = d.stats;
	sp_on = !pthread_create(&sp_th, NULL, sampler_main, &sp);
	run.t0 = mlens_bench_now_ns();
	run.deadline = run.t0 + (uint64_t)(o.run_timeout * 1e9);
	for (int i = 0; i < o.threads; i++) {
		ca[i].run = &run;
		ca[i].idx = i;
		if (pthread_create(&th[i], NULL, client_main, &ca[i])) {
			fprintf(stderr, "serve: cannot start client thread %d\n", i);
			o.threads = i;
			break;
		}
	}
	for (int i = 0; i < o.threads; i++)
		pthread_join(th[i], NULL);
	t1 = mlens_bench_now_ns();
	st1 = socket_json(d.stats, NULL);
	if (sp_on) {
		atomic_store(&sp.stop, true);
		pthread_join(sp_th, NULL);
	}
	wall = (double)(t1 - run.t0) / 1e9;
	for (int i = 0; i < o.requests; i++) {
		struct req_rec *r = &run.recs[i];
		if (r->finish == MLENS_REASON_LENGTH || r->finish == MLENS_REASON_STOP) {
			ok++;
			gen += (uint64_t)r->tokens;
			prompt_tok += (uint64_t)o.req_p[i];
			if (r->t_first)
				ttft[n_ttft++] = (double)(r->t_first - r->t_submit) / 1e9;
		} else if (r->t_submit) {
			bad++;
		}
	}
	if (atomic_load(&stop_sig))
		fprintf(stderr, "serve: stopped by %s after %.1f s: %d of %d requests finished; the "
			"results cover the run so far\n", stop_name(), wall, ok, o.requests);
	qsort(ttft, (size_t)n_ttft, sizeof(*ttft), cmp_double);
	steady_window(&sw, &run, o.requests, o.gen_len, &sp);
	if (sw.have)
		step_distribution(&sd, &sp, run.t0 + (uint64_t)(sw.t_start * 1e9), run.t0 + (uint64_t)(sw.t_end * 1e9));
	else
		step_distribution(&sd, &sp, run.t0, t1);
	if (sw.short_window)
		fprintf(stderr, "serve: the steady window holds about %.0f steps, less than one generation of %d: "
			"its rates are the ramp's, not a steady state's (more --requests)\n",
			sw.generations * o.gen_len, o.gen_len);
	/* engine busy: wall time the daemon's worker spent inside steps. The
	 * CUDA backend waits for the GPU at the end of every step (sampling
	 * reads tokens back), so this is the share of time the GPU had work
	 * queued or was waited for: an upper bound of the GPU's busy time. */
	busy = st1 ? (jnum(st1, "step_seconds_sum") - jnum(st0, "step_seconds_sum")) / wall : 0.0;
	hybrid = !strcmp(jstr(status, "mode", ""), "hybrid");
	kv_tokens = (st1 ? jnum(st1, "kv_blocks_total") : 0.0) * block_tokens;
	if (lengths_mix(&o, (int)block_tokens, &mix_b)) {
		fprintf(stderr, "serve: out of memory\n");
		goto out;
	}
	kv_blocks = st1 ? jnum(st1, "kv_blocks_total") : 0.0;
	kv_seqs = kv_blocks / mlens_perf_mix_seq_blocks(&mix_b);
	n_cap = st1 ? jnum(st1, "token_cap") : 4096.0;

	/* what the daemon's counters say it achieved over the whole run */
	pcie_gbs = (jopt(st1, "pcie_h2d_bytes_total") - jopt(st0, "pcie_h2d_bytes_total")) / wall / 1e9;
	gpu_busy = (jopt(st1, "gpu_busy_seconds_total") - jopt(st0, "gpu_busy_seconds_total")) / wall;
	h2d_busy = (jopt(st1, "h2d_busy_seconds_total") - jopt(st0, "h2d_busy_seconds_total")) / wall;
	attn_bytes = jopt(st1, "kv_read_bytes_total") - jopt(st0, "kv_read_bytes_total");
	if (!isfinite(attn_bytes)) {
		/* no counter: every finished request's decode tokens read its
		 * context, (g - 1)(p + g/2) rows per layer (re-prefills after a
		 * preemption read nothing on the CPU; their decodes are counted) */
		attn_src = "client-estimate";
		attn_bytes = 0;
		for (int i = 0; i < o.requests; i++)
			if (run.recs[i].finish == MLENS_REASON_LENGTH || run.recs[i].finish == MLENS_REASON_STOP)
				attn_bytes += (o.req_g[i] - 1.0) * (o.req_p[i] + o.req_g[i] / 2.0) *
					      (double)pm.kv_token_bytes * L;
	}
	attn_s = jopt(st1, "cpu_attention_seconds_total") - jopt(st0, "cpu_attention_seconds_total");
	attn_gbs = attn_bytes / attn_s / 1e9;
	/* the append's share (NAN from a daemon without the counter) */
	append_s = jopt(st1, "cpu_append_seconds_total") - jopt(st0, "cpu_append_seconds_total");
	attn_only_gbs = attn_bytes / (attn_s - append_s) / 1e9;

	if (hybrid && ceil_.have && ceil_.have_link && kv_seqs > 0) {
		/* the weights the daemon streams in a step (its counter of the
		 * last step), else every expert of every layer */
		w_step = jopt(st1, "last_step_weight_bytes");
		if (!(w_step > 0))
			w_step = L * (double)mlens_gpu_plan_streamed_bytes(&pm, 0);
		have_hb = !mlens_perf_bound_mix(&pm, &mix_b, kv_blocks, w_step, ceil_.h2d_gbs * 1e9,
					    ceil_.mem_copy_gbs * 1e9, gemm_bound_tflops(&ceil_) * 1e12,
					    expert_bound_tflops(&er, &ceil_, false) * 1e12, &hb);
		/* and with the lone GEMMs' rates, for comparison */
		if (have_hb && mlens_perf_bound_mix(&pm, &mix_b, kv_blocks, w_step, ceil_.h2d_gbs * 1e9,
						ceil_.mem_copy_gbs * 1e9, ceil_.gemm_tflops * 1e12,
						expert_bound_tflops(&er, &ceil_, true) * 1e12, &hb_burst))
			hb_burst.gen_tok_s = NAN;
		/* experts on disk: the fourth term, the daemon's bytes a step at
		 * the read rate its profiler measured at start-up */
		disk_b = jopt(st1, "weights_disk_step_bytes");
		disk_bps = jopt(st1, "weights_disk_ceiling_bytes_per_second");
		if (have_hb && disk_b > 0 && disk_bps > 0) {
			mlens_perf_bound_add_disk(&hb, disk_b, disk_bps);
			mlens_perf_bound_add_disk(&hb_burst, disk_b, disk_bps);
		}
	} else if (!hybrid && ceil_.have) {
		compute_bound(&bd, &model->cfg, &pm, p, g, mlens_perf_mix_seq_blocks(&mix), kv_tokens, n_cap,
			      ceil_.hbm_gbs * 1e9,
			      gemm_bound_tflops(&ceil_) * 1e12, expert_bound_tflops(&er, &ceil_, false) * 1e12);
		have_bd = bd.gen_tps > 0;
	}

	if (o.predict) {
		double in_flight = kv_seqs < o.concurrency ? kv_seqs : o.concurrency;
		if (mlens_perf_sched_steady(p, g, n_cap, in_flight, &pred.st)) {
			fprintf(stderr, "serve: --predict: no steady state for p=%d g=%d with a cap of %.0f tokens "
				"and %.0f sequences in flight\n", o.prompt_len, o.gen_len, n_cap, in_flight);
		} else {
			char req[256];
			snprintf(req, sizeof(req), "{\"cmd\":\"profile\",\"cached\":true,\"prompt_len\":%d,"
				 "\"gen_len\":%d,\"step_tokens\":%.3f}\n", o.prompt_len, o.gen_len,
				 pred.st.tokens >= 1 ? pred.st.tokens : 1.0);
			prof = socket_json(d.control, req);
			if (!json_is_true(json_object_get(prof, "ok"))) {
				fprintf(stderr, "serve: --predict: the daemon gave no prediction: %s\n",
					jstr(prof, "error", "no reply"));
				json_decref(prof);
				prof = NULL;
			} else {
				pred.in_flight = in_flight;
				pred.step_seconds = jnum(json_object_get(prof, "step"), "seconds");
				if (pred.step_seconds > 0) {
					pred.have = true;
					pred.gen_tps = pred.st.generated / pred.step_seconds;
					pred.total_tps = pred.st.prompts * (p + g) / pred.step_seconds;
				}
			}
		}
	}
	daemon_stop(&d, o.keep_log || bad || atomic_load(&run.failed_threads));
#ifdef HAVE_CUDA
	/* the host ceilings again, the daemon gone: a box whose memory or
	 * link ran slower during the run than before it shows here (the
	 * bound stays the one from before the run, the box idle) */
	if (have_hb) {
		measure_host_link(&after);
		cudaDeviceReset();
		if (after.have_link)
			have_hb_after = !mlens_perf_bound_mix(&pm, &mix_b, kv_blocks, w_step, after.h2d_gbs * 1e9,
							  after.mem_copy_gbs * 1e9, gemm_bound_tflops(&ceil_) * 1e12,
							  expert_bound_tflops(&er, &ceil_, false) * 1e12, &hb_after);
		if (have_hb_after && disk_b > 0 && disk_bps > 0)
			mlens_perf_bound_add_disk(&hb_after, disk_b, disk_bps);
	}
#endif

	{
		double steps = st1 ? jnum(st1, "steps_total") - jnum(st0, "steps_total") : 0;
		double held = ceil_.have ? gemm_bound_tflops(&ceil_) : 0;
		struct sample op_a, op_b;	/* --op-timing: the account's ends */
		double gen_tps = gen / wall, tot_tps = (gen + prompt_tok) / wall;
		double mean_step = steps > 0 ? (jnum(st1, "prompt_tokens_total") - jnum(st0, "prompt_tokens_total") +
						jnum(st1, "generation_tokens_total") - jnum(st0, "generation_tokens_total")) / steps : 0.0;
		out = json_pack("{s:s,s:s,s:s,s:s,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:I,s:I,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f}",
			"bench", "serve", "model", o.model, "backend", jstr(status, "backend", "?"),
			"mode", jstr(status, "mode", "?"), "mode_reason", jstr(status, "mode_reason", "?"),
			"prompt_len", o.prompt_len, "gen_len", o.gen_len, "requests", o.requests,
			"requests_ok", ok, "requests_failed", bad, "concurrency", o.concurrency,
			"threads", o.threads, "prompt_tokens", (json_int_t)prompt_tok,
			"generated_tokens", (json_int_t)gen, "wall_seconds", wall,
			"generated_tokens_per_s", gen_tps, "total_tokens_per_s", tot_tps,
			"ttft_p50_s", percentile(ttft, n_ttft, 50), "ttft_p99_s", percentile(ttft, n_ttft, 99),
			"engine_busy_ratio", busy, "steps", steps, "mean_step_tokens", mean_step);
		if (atomic_load(&stop_sig))
			json_object_set_new(out, "stopped_by", json_string(stop_name()));
		json_object_set_new(out, "lengths", json_pack("{s:s,s:i,s:i,s:i,s:i,s:I,s:f,s:f,s:f}",
			"from", o.lengths_file ? o.lengths_file : "log-uniform ranges",
			"prompt_min", o.prompt_lo, "prompt_max", o.prompt_hi, "gen_min", o.gen_lo,
			"gen_max", o.gen_hi, "seed", (json_int_t)o.seed, "prompt_mean", mix.prompt,
			"gen_mean", mix.gen, "kv_tokens_held_mean", mlens_perf_mix_seq_blocks(&mix)));
		json_object_set_new(out, "steps_sampled", json_pack("{s:s,s:i,s:o,s:o}",
			"over", sw.have ? "steady" : "run", "steps", sd.n, "step_tokens", dist_json(sd.tok),
			"kv_occupancy", dist_json(sd.kv)));
		/* the experts and KV cache the bounds (and the attention-bytes
		 * estimate) count: the daemon's, quantized or not */
		json_object_set_new(out, "bound_model", json_pack("{s:s,s:I,s:s,s:I}",
			"expert_dtype", jstr(json_object_get(status, "model"), "expert_dtype", "?"),
			"expert_bytes", (json_int_t)pm.expert_bytes,
			"kv_dtype", jstr(json_object_get(json_object_get(status, "budgets"), "kv_cache"), "dtype", "?"),
			"kv_token_bytes", (json_int_t)pm.kv_token_bytes));
		/* fp8 experts: the rate their GEMM FLOPs were charged (fp8, or
		 * bf16 and why) */
		if (er.fp8 && ceil_.have) {
			json_object_set_new(json_object_get(out, "bound_model"), "expert_gemm_rate",
					    json_string(er.at_fp8 ? "fp8" : "bf16"));
			json_object_set_new(json_object_get(out, "bound_model"), "expert_gemm_rate_reason",
					    er.at_fp8 ? json_null() : json_string(er.why));
		}
		json_object_set_new(out, "kv_tokens", json_real(kv_tokens));
		json_object_set_new(out, "kv_sequences", jnum_or_null(kv_seqs));
		json_object_set_new(out, "step_token_cap", json_real(n_cap));
		json_object_set_new(out, "preemptions", json_real(st1 ? jnum(st1, "preemptions_total") - jnum(st0, "preemptions_total") : 0));
		/* of which a sequence's again, soon after it came back: KV thrash */
		json_object_set_new(out, "repreemptions", jnum_or_null(jopt(st1, "repreemptions_total") -
								       jopt(st0, "repreemptions_total")));
		/* steps under half the cap while requests waited, and decodes put
		 * off a step for a long-waiting prompt (null from an older daemon) */
		json_object_set_new(out, "steps_short", jnum_or_null(jopt(st1, "steps_short_total") -
								     jopt(st0, "steps_short_total")));
		json_object_set_new(out, "decodes_deferred", jnum_or_null(jopt(st1, "decodes_deferred_total") -
									  jopt(st0, "decodes_deferred_total")));
		/* the job's shape: its size in KV pools, where the in-flight
		 * count came from, and the ramp before and the drain after the
		 * steady window */
		json_object_set_new(out, "pool_sequences", json_real(pool_seqs));
		json_object_set_new(out, "pool_fulls", o.pool_fulls ? json_integer(o.pool_fulls) : json_null());
		json_object_set_new(out, "concurrency_from", json_string(concurrency_auto ? "kv pool" : "flag"));
		json_object_set_new(out, "ramp_up_s", jnum_or_null(sw.have ? sw.t_start : NAN));
		json_object_set_new(out, "drain_s", jnum_or_null(sw.have ? wall - sw.t_end : NAN));
		json_object_set_new(out, "achieved", json_pack("{s:o,s:o,s:o,s:o,s:s,s:o,s:o}",
			"pcie_h2d_gb_per_s", jnum_or_null(pcie_gbs), "cpu_attention_gb_per_s", jnum_or_null(attn_gbs),
			"cpu_attention_only_gb_per_s", jnum_or_null(attn_only_gbs),
			"cpu_append_seconds", jnum_or_null(append_s),
			"cpu_attention_bytes_from", attn_src, "gpu_busy_ratio", jnum_or_null(gpu_busy),
			"h2d_busy_ratio", jnum_or_null(h2d_busy)));
		if (sw.have)
			json_object_set_new(out, "steady", json_pack("{s:s,s:f,s:f,s:f,s:f,s:f,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:o}",
				"rule", "first request finished .. last request's first token",
				"start_s", sw.t_start, "end_s", sw.t_end, "seconds", sw.seconds,
				"generated_tokens_per_s", sw.gen_tps, "total_tokens_per_s", sw.total_tps,
				"steps", sw.have_stats ? json_real(sw.steps) : json_null(),
				"mean_step_tokens", jnum_or_null(sw.have_stats ? sw.step_tokens : NAN),
				"engine_busy_ratio", jnum_or_null(sw.have_stats ? sw.engine_busy : NAN),
				"pcie_h2d_gb_per_s", jnum_or_null(sw.have_stats ? sw.pcie_gbs : NAN),
				"gpu_busy_ratio", jnum_or_null(sw.have_stats ? sw.gpu_busy : NAN),
				"cpu_busy_ratio", jnum_or_null(sw.have_stats ? sw.cpu_busy : NAN),
				"cpu_append_ratio", jnum_or_null(sw.have_stats ? sw.append_busy : NAN),
				"cpu_attention_only_gb_per_s", jnum_or_null(sw.have_stats ? sw.attn_only_gbs : NAN),
				"kv_blocks_per_run", jnum_or_null(sw.have_stats ? sw.kv_run_blocks : NAN),
				"generations", jnum_or_null(sw.have_stats ? sw.generations : NAN),
				"short", sw.have_stats ? json_boolean(sw.short_window) : json_null()));
		else
			json_object_set_new(out, "steady", json_null());
		/* experts left on disk: the read rate the steady steps got
		 * against the profiler's measured ceiling */
		if (isfinite(jopt(st1, "weights_disk_resident_bytes"))) {
			double ceil_gbs = jopt(st1, "weights_disk_ceiling_bytes_per_second") / 1e9;
			double got = sw.have && sw.have_stats ? sw.disk_gbs : NAN;
			json_object_set_new(out, "disk", json_pack("{s:I,s:I,s:o,s:o,s:o}",
				"resident_bytes", (json_int_t)jopt(st1, "weights_disk_resident_bytes"),
				"step_bytes", (json_int_t)jopt(st1, "weights_disk_step_bytes"),
				"steady_gb_per_s", jnum_or_null(got),
				"ceiling_gb_per_s", jnum_or_null(ceil_gbs > 0 ? ceil_gbs : NAN),
				"steady_over_ceiling", jnum_or_null(ceil_gbs > 0 ? got / ceil_gbs : NAN)));
		}
		if (ceil_.have || ceil_.have_link) {
			json_object_set_new(out, "ceilings", json_pack("{s:s,s:f,s:f,s:i,s:o,s:o,s:o,s:o,s:o,s:i}",
				"device", ceil_.device, "hbm_gb_per_s", ceil_.hbm_gbs, "gemm_tflops", ceil_.gemm_tflops,
				"gemm_rows", ceil_.gemm_m,
				"pcie_h2d_gb_per_s", jnum_or_null(ceil_.have_link ? ceil_.h2d_gbs : NAN),
				"cpu_read_gb_per_s", jnum_or_null(ceil_.have_link ? ceil_.read_gbs : NAN),
				"cpu_read_under_copy_gb_per_s", jnum_or_null(ceil_.have_link ? ceil_.read_copy_gbs : NAN),
				"copy_under_read_gb_per_s", jnum_or_null(ceil_.have_link ? ceil_.copy_read_gbs : NAN),
				"cpu_memory_under_copy_gb_per_s", jnum_or_null(ceil_.have_link ? ceil_.mem_copy_gbs : NAN),
				"read_threads", ceil_.read_threads));
			json_object_set_new(json_object_get(out, "ceilings"), "read_buffer_huge_ratio",
					    jnum_or_null(ceil_.have_link ? ceil_.read_huge : NAN));
			json_object_set_new(json_object_get(out, "ceilings"), "gemm_sustained_tflops",
					    jnum_or_null(ceil_.have ? ceil_.gemm_sustained_tflops : NAN));
			if (ceil_.fp8_measured) {
				json_t *cj = json_object_get(out, "ceilings");
				json_object_set_new(cj, "gemm_fp8_tflops",
						    jnum_or_null(ceil_.gemm_fp8_tflops > 0 ? ceil_.gemm_fp8_tflops : NAN));
				json_object_set_new(cj, "gemm_fp8_sustained_tflops",
						    jnum_or_null(ceil_.gemm_fp8_sustained_tflops > 0 ?
								 ceil_.gemm_fp8_sustained_tflops : NAN));
				json_object_set_new(cj, "gemm_fp8_refused", ceil_.gemm_fp8_refused[0] ?
						    json_string(ceil_.gemm_fp8_refused) : json_null());
			}
			/* earlier readers look for these at the top level */
			json_object_set_new(out, "device", json_string(ceil_.device));
			json_object_set_new(out, "hbm_gb_per_s", json_real(ceil_.hbm_gbs));
			json_object_set_new(out, "gemm_tflops", json_real(ceil_.gemm_tflops));
		} else {
			json_object_set_new(out, "ceilings", json_null());
		}
		if (have_hb) {
			json_object_set_new(out, "bound", json_pack("{s:s,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:s,s:f,s:f}",
				"kind", "hybrid", "sequences", hb.st.seqs, "step_tokens", hb.st.tokens,
				"decode_tokens", hb.st.decode, "prefill_tokens", hb.st.tokens - hb.st.decode,
				"streamed_bytes", hb.streamed, "kv_bytes", hb.kv_bytes, "flops", hb.flops,
				"t_pcie_s", hb.t_pcie, "t_cpu_memory_s", hb.t_mem, "t_gemm_s", hb.t_gemm,
				"t_step_s", hb.t_step, "binds", hb.binds,
				"generated_tokens_per_s", hb.gen_tok_s, "total_tokens_per_s", hb.total_tok_s));
			if (hb.disk_bytes > 0) {
				json_object_set_new(json_object_get(out, "bound"), "disk_bytes", json_real(hb.disk_bytes));
				json_object_set_new(json_object_get(out, "bound"), "t_disk_s", json_real(hb.t_disk));
			}
			json_object_set_new(json_object_get(out, "bound"), "gemm_tflops",
					    json_real(gemm_bound_tflops(&ceil_)));
			if (er.fp8) {
				json_object_set_new(json_object_get(out, "bound"), "expert_flops",
						    json_real(hb.expert_flops));
				json_object_set_new(json_object_get(out, "bound"), "expert_gemm_tflops",
						    json_real(er.at_fp8 ? expert_bound_tflops(&er, &ceil_, false)
								       : gemm_bound_tflops(&ceil_)));
			}
			json_object_set_new(json_object_get(out, "bound"), "burst_gemm_generated_tokens_per_s",
					    jnum_or_null(hb_burst.gen_tok_s));
			json_object_set_new(out, "measured_over_bound", json_real(gen_tps / hb.gen_tok_s));
			json_object_set_new(out, "steady_over_bound", jnum_or_null(sw.have ? sw.gen_tps / hb.gen_tok_s : NAN));
			json_object_set_new(out, "steady_over_bound_burst_gemm",
					    jnum_or_null(sw.have ? sw.gen_tps / hb_burst.gen_tok_s : NAN));
			if (have_hb_after) {
				json_object_set_new(out, "ceilings_after", json_pack("{s:f,s:f,s:f,s:f,s:f,s:o}",
					"pcie_h2d_gb_per_s", after.h2d_gbs, "cpu_read_gb_per_s", after.read_gbs,
					"cpu_read_under_copy_gb_per_s", after.read_copy_gbs,
					"copy_under_read_gb_per_s", after.copy_read_gbs,
					"cpu_memory_under_copy_gb_per_s", after.mem_copy_gbs,
					"read_buffer_huge_ratio", jnum_or_null(after.read_huge)));
				json_object_set_new(out, "bound_after", json_pack("{s:f,s:f,s:f,s:f,s:s,s:f}",
					"t_pcie_s", hb_after.t_pcie, "t_cpu_memory_s", hb_after.t_mem,
					"t_gemm_s", hb_after.t_gemm, "t_step_s", hb_after.t_step,
					"binds", hb_after.binds, "generated_tokens_per_s", hb_after.gen_tok_s));
				json_object_set_new(out, "steady_over_bound_after",
						    jnum_or_null(sw.have ? sw.gen_tps / hb_after.gen_tok_s : NAN));
			} else {
				json_object_set_new(out, "ceilings_after", json_null());
			}
		} else if (have_bd) {
			json_object_set_new(out, "gemm_rows", json_integer(ceil_.gemm_m));
			json_object_set_new(out, "bound", json_pack("{s:s,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f}",
				"kind", "gpu-only (HBM)", "batch_seqs", bd.B, "step_tokens", bd.n_step,
				"weight_bytes", bd.w_bytes, "flops", bd.flops, "kv_bytes", bd.kv_bytes,
				"t_weights_s", bd.t_weights, "t_flops_s", bd.t_flops, "t_kv_s", bd.t_kv,
				"t_step_s", bd.t_step, "generated_tokens_per_s", bd.gen_tps));
			if (er.fp8)
				json_object_set_new(json_object_get(out, "bound"), "expert_gemm_tflops",
						    json_real(er.at_fp8 ? expert_bound_tflops(&er, &ceil_, false)
								       : gemm_bound_tflops(&ceil_)));
			json_object_set_new(out, "measured_over_bound", json_real(gen_tps / bd.gen_tps));
			json_object_set_new(out, "steady_over_bound", jnum_or_null(sw.have ? sw.gen_tps / bd.gen_tps : NAN));
		} else {
			json_object_set_new(out, "bound", json_null());
		}
		if (pred.have) {
			json_t *pr = json_object_get(prof, "predicted");
			json_object_set_new(out, "predicted", json_pack(
				"{s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:b,s:f,s:s,s:s,s:i,s:b,s:{s:f,s:f,s:f,s:s}}",
				"generated_tokens_per_s", pred.gen_tps, "total_tokens_per_s", pred.total_tps,
				"step_tokens", pred.st.tokens, "step_seconds", pred.step_seconds,
				"prompts_per_step", pred.st.prompts, "in_flight", pred.st.seqs,
				"in_flight_limit", pred.in_flight, "token_cap", n_cap, "cap_binds", pred.st.cap_binds,
				"n_real", jnum(prof, "n_real"), "binding", jstr(prof, "binding", "?"),
				"limit", jstr(prof, "limit", "?"),
				"resident_experts", (int)jnum(json_object_get(prof, "policy"), "resident_experts"),
				"from_cache", json_is_true(json_object_get(prof, "from_cache")),
				"at_n_real", "tokens_per_step", jnum(pr, "tokens_per_step"),
				"total_tokens_per_s", jnum(pr, "tokens_per_s"),
				"generated_tokens_per_s", jnum(pr, "generated_tokens_per_s"),
				"note", "the daemon's own steady state, unbounded by the cap and the clients"));
			/* signed: positive when the model promises more than the box gave */
			json_object_set_new(out, "prediction_error", json_real(gen_tps > 0 ? (pred.gen_tps - gen_tps) / gen_tps : 0.0));
			json_object_set_new(out, "prediction_error_steady",
					    jnum_or_null(sw.have && sw.gen_tps > 0 ? (pred.gen_tps - sw.gen_tps) / sw.gen_tps : NAN));
		} else if (o.predict) {
			json_object_set_new(out, "predicted", json_null());
		}
		if (o.op_timing) {
			/* the steady window's ends, else the whole run's */
			json_t *ops;
			if (sw.have_stats) {
				op_a = sp.s[sw.s_a];
				op_b = sp.s[sw.s_b];
			} else {
				sample_of(&op_a, st0, run.t0);
				sample_of(&op_b, st1, t1);
			}
			ops = op_table(&op_a, &op_b, sw.have_stats ? "steady" : "run", held, true);
			if (!ops)
				fprintf(stderr, "serve: --op-timing: the daemon timed no ops (start it with "
					"--daemon-arg=--op-timing)\n");
			json_object_set_new(out, "ops", ops ? ops : json_null());
		}
		if (o.json) {
			json_dumpf(out, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
			printf("\n");
		} else {
			printf("%-26s %s, %s (%s)\n", "backend", jstr(out, "backend", "?"), jstr(out, "mode", "?"),
			       jstr(out, "mode_reason", "?"));
			if (o.prompt_lo == o.prompt_hi && o.gen_lo == o.gen_hi && !o.lengths_file)
				printf("%-26s %d ok, %d failed (p=%d g=%d, %d in flight, %d clients)\n", "requests", ok,
				       bad, o.prompt_len, o.gen_len, o.concurrency, o.threads);
			else
				printf("%-26s %d ok, %d failed (p %d..%d mean %.1f, g %d..%d mean %.1f, %s; %d in flight, "
				       "%d clients)\n", "requests", ok, bad, o.prompt_lo, o.prompt_hi, mix.prompt,
				       o.gen_lo, o.gen_hi, mix.gen, o.lengths_file ? o.lengths_file : "log-uniform",
				       o.concurrency, o.threads);
			printf("%-26s %llu prompt, %llu generated in %.2f s\n", "tokens",
			       (unsigned long long)prompt_tok, (unsigned long long)gen, wall);
			printf("%-26s %.1f generated, %.1f total\n", "tokens/s (whole run)", gen_tps, tot_tps);
			if (sw.have) {
				printf("%-26s %.1f generated, %.1f total (%.2f .. %.2f s)%s\n", "tokens/s (steady)",
				       sw.gen_tps, sw.total_tps, sw.t_start, sw.t_end,
				       sw.short_window ? ": short, less than one generation" : "");
				printf("%-26s %.2f s ramp-up, %.2f s drain of %.2f s\n", "ramp-up, drain", sw.t_start,
				       wall - sw.t_end, wall);
			}
			printf("%-26s %.2f pool-fulls of %.0f requests (%d in flight%s)\n", "job",
			       o.requests / pool_seqs, pool_seqs, o.concurrency,
			       concurrency_auto ? ": two pools' worth" : "");
			{
				char a[32], b[32];
				printf("%-26s %s short steps (under half the cap while requests waited), %s decodes "
				       "deferred\n", "admission", fmt_num(a, sizeof(a), 0, jopt(st1, "steps_short_total") -
								      jopt(st0, "steps_short_total")),
				       fmt_num(b, sizeof(b), 0, jopt(st1, "decodes_deferred_total") -
							   jopt(st0, "decodes_deferred_total")));
			}
			printf("%-26s p50 %.3f s, p99 %.3f s\n", "time to first token",
			       percentile(ttft, n_ttft, 50), percentile(ttft, n_ttft, 99));
			printf("%-26s experts %s (%llu bytes each), KV %s (%llu bytes a token and layer)\n",
			       "bound model", jstr(json_object_get(out, "bound_model"), "expert_dtype", "?"),
			       (unsigned long long)pm.expert_bytes,
			       jstr(json_object_get(out, "bound_model"), "kv_dtype", "?"),
			       (unsigned long long)pm.kv_token_bytes);
			if (er.fp8 && ceil_.have && er.at_fp8)
				printf("%-26s experts' at the fp8 rate (%.0f TFLOP/s), the rest at bf16's (%.0f)\n",
				       "bound model GEMMs", expert_bound_tflops(&er, &ceil_, false),
				       gemm_bound_tflops(&ceil_));
			else if (er.fp8 && ceil_.have)
				printf("%-26s all at the bf16 rate (%.0f TFLOP/s): %s\n", "bound model GEMMs",
				       gemm_bound_tflops(&ceil_), er.why);
			printf("%-26s %.1f %%, %.0f steps of %.1f tokens (cap %.0f)\n", "engine busy", 100 * busy,
			       steps, mean_step, n_cap);
			if (sd.n)
				printf("%-26s min %.0f, p10 %.0f, p50 %.0f, p90 %.0f; KV held min %.1f %%, p10 %.1f %%, "
				       "p50 %.1f %%, p90 %.1f %% (%d steps sampled, %s)\n", "step tokens",
				       sd.tok[0], sd.tok[1], sd.tok[2], sd.tok[3], 100 * sd.kv[0], 100 * sd.kv[1],
				       100 * sd.kv[2], 100 * sd.kv[3], sd.n, sw.have ? "steady" : "whole run");
			{
				char a[32], b[32], c[32], e[32];
				printf("%-26s PCIe %s GB/s, CPU attention %s GB/s (%s), GPU busy %s %%, H2D busy %s %%\n",
				       "achieved", fmt_num(a, sizeof(a), 2, pcie_gbs),
				       fmt_num(b, sizeof(b), 2, attn_gbs), attn_src,
				       fmt_num(c, sizeof(c), 1, 100 * gpu_busy),
				       fmt_num(e, sizeof(e), 1, 100 * h2d_busy));
			}
			if (ceil_.have_link)
				printf("%-26s H2D %.1f GB/s; CPU reads %.1f GB/s alone, %.1f under copy (+ copy %.1f = %.1f); "
				       "%.0f%% huge pages\n",
				       "host ceilings", ceil_.h2d_gbs, ceil_.read_gbs, ceil_.read_copy_gbs,
				       ceil_.copy_read_gbs, ceil_.mem_copy_gbs, 100 * ceil_.read_huge);
			if (ceil_.have)
				printf("%-26s HBM %.0f GB/s, GEMM %.0f TFLOP/s at %d rows (%.0f held over 2 s) (%s)\n",
				       "GPU ceilings", ceil_.hbm_gbs, ceil_.gemm_tflops, ceil_.gemm_m,
				       ceil_.gemm_sustained_tflops, ceil_.device);
			if (ceil_.have && ceil_.fp8_measured && !ceil_.gemm_fp8_refused[0])
				printf("%-26s fp8 e4m3 GEMM %.0f TFLOP/s at %d rows (%.0f held over 2 s)\n",
				       "GPU ceilings (fp8)", ceil_.gemm_fp8_tflops, ceil_.gemm_m,
				       ceil_.gemm_fp8_sustained_tflops);
			else if (ceil_.have && ceil_.fp8_measured)
				printf("%-26s fp8 e4m3 GEMM: none (%s)\n", "GPU ceilings (fp8)",
				       ceil_.gemm_fp8_refused);
			if (have_hb) {
				printf("%-26s %.1f generated, %.1f total tokens/s: %.0f seqs, %.0f tokens/step, "
				       "step %.1f ms = max(PCIe %.1f, memory %.1f, GEMM %.1f) (%s binds)\n", "bound",
				       hb.gen_tok_s, hb.total_tok_s, hb.st.seqs, hb.st.tokens, hb.t_step * 1e3,
				       hb.t_pcie * 1e3, hb.t_mem * 1e3, hb.t_gemm * 1e3, hb.binds);
				if (hb.disk_bytes > 0)
					printf("%-26s %.1f ms: %.2f GB from the model files a step at the measured "
					       "%.2f GB/s%s\n", "bound's disk term", hb.t_disk * 1e3, hb.disk_bytes / 1e9,
					       hb.disk_bytes / hb.t_disk / 1e9,
					       !strcmp(hb.binds, "disk") ? " (it binds)" : "");
				printf("%-26s %.2f whole run", "measured / bound", gen_tps / hb.gen_tok_s);
				if (sw.have)
					printf(", %.2f steady", sw.gen_tps / hb.gen_tok_s);
				printf("\n");
				if (ceil_.gemm_sustained_tflops > 0 && isfinite(hb_burst.gen_tok_s)) {
					printf("%-26s %.1f generated tokens/s (%s binds)", "bound at lone GEMMs' rate",
					       hb_burst.gen_tok_s, hb_burst.binds);
					if (sw.have)
						printf(", steady %.2f of it", sw.gen_tps / hb_burst.gen_tok_s);
					printf("\n");
				}
				if (have_hb_after) {
					printf("%-26s H2D %.1f GB/s; CPU reads %.1f GB/s alone, %.1f under copy (+ copy %.1f = %.1f); "
					       "%.0f%% huge pages\n",
					       "host ceilings after", after.h2d_gbs, after.read_gbs,
					       after.read_copy_gbs, after.copy_read_gbs, after.mem_copy_gbs,
					       100 * after.read_huge);
					printf("%-26s %.1f generated tokens/s (%s binds)", "bound from those",
					       hb_after.gen_tok_s, hb_after.binds);
					if (sw.have)
						printf(", steady %.2f of it", sw.gen_tps / hb_after.gen_tok_s);
					printf("\n");
				}
			} else if (have_bd) {
				printf("%-26s %.0f generated tokens/s (B=%.0f, %.0f tokens/step, step %.2f ms)\n",
				       "bound (HBM)", bd.gen_tps, bd.B, bd.n_step, bd.t_step * 1e3);
				printf("%-26s %.2f\n", "measured / bound", gen_tps / bd.gen_tps);
			}
			if (pred.have) {
				printf("%-26s %.1f generated, %.1f total tokens/s: steps of %.0f tokens (%s) in %.4g s\n",
				       "predicted", pred.gen_tps, pred.total_tps, pred.st.tokens,
				       pred.st.cap_binds ? "token cap" : "in flight", pred.step_seconds);
				printf("%-26s %+.1f %% whole run, ", "prediction error",
				       100 * (pred.gen_tps - gen_tps) / gen_tps);
				if (sw.have)
					printf("%+.1f %% steady", 100 * (pred.gen_tps - sw.gen_tps) / sw.gen_tps);
				else
					printf("no steady window");
				printf(" (n_real %.0f, %s binds)\n", jnum(prof, "n_real"), jstr(prof, "binding", "?"));
			}
			if (o.op_timing)
				json_decref(op_table(&op_a, &op_b, sw.have_stats ? "steady" : "run", held, false));
		}
	}
	rc = bad || atomic_load(&run.failed_threads) ? 1 : 0;
out:
	daemon_stop(&d, o.keep_log || rc);
	if (rc && d.dir[0] && (o.keep_log || rc))
		fprintf(stderr, "serve: daemon log kept in %s\n", d.log);
	json_decref(st0);
	json_decref(st1);
	json_decref(status);
	json_decref(out);
	json_decref(prof);
	free(run.recs);
	free(run.gen_bins);
	free(run.prompt_bins);
	free(sp.s);
	free(ca);
	free(th);
	free(ttft);
	free(o.req_p);
	free(o.req_g);
	free(o.req_line);
	if (model)
		mlens_model_close(model);
	return rc;
}
