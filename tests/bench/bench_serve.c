/* mlens-bench serve: end-to-end serving throughput of a real mlensd. Starts
 * the daemon on a model, drives it through libmlens from several client
 * threads (each its own connection), stops it, and reports requests, tokens,
 * tokens/s, time to first token and the share of wall time spent in engine
 * steps. Built with CUDA it also measures the GPU's GEMM rate and HBM
 * bandwidth and prints the throughput bound they set for the workload. */
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
#include "daemon/model.h"
#include "tests/bench/bench.h"
#ifdef HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

#define MAX_DAEMON_ARGS 16

struct serve_opts {
	const char *mlensd, *model, *backend, *kv_cache, *gpu_memory;
	const char *daemon_args[MAX_DAEMON_ARGS];
	int n_daemon_args;
	int prompt_len, gen_len, requests, concurrency, threads, max_step_tokens;
	double start_timeout, run_timeout;
	bool json, keep_log, predict;
};

/* ==== the daemon ==== */

struct daemon_proc {
	pid_t pid;
	char dir[64];
	char sock[96], control[96], stats[96], log[96];
};

static void print_log_tail(const struct daemon_proc *d, int lines)
{
	char cmd[160];
	fprintf(stderr, "---- last lines of %s\n", d->log);
	snprintf(cmd, sizeof(cmd), "tail -n %d '%s' >&2", lines, d->log);
	if (system(cmd) != 0)
		fprintf(stderr, "(cannot show the log)\n");
}

static int daemon_start(struct daemon_proc *d, const struct serve_opts *o)
{
	const char *argv[64];
	char step[32], path[512];
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
	snprintf(d->log, sizeof(d->log), "%s/mlensd.log", d->dir);
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
	/* every client thread is one tenant: let each run its whole share */
	argv[n++] = "--quota-running";
	argv[n++] = "0";
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
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
		close(fd);
		return NULL;
	}
	if (request && send(fd, request, strlen(request), MSG_NOSIGNAL) < 0) {
		close(fd);
		return NULL;
	}
	while (len < sizeof(buf) - 1) {
		ssize_t n = read(fd, buf + len, sizeof(buf) - 1 - len);
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

/* ==== the clients ==== */

struct req_rec {
	uint64_t t_submit, t_first;
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
	uint64_t deadline;
};

struct client_arg {
	struct serve_run *run;
	int idx;
	int rc;
};

static uint64_t mix64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	return x ^ (x >> 33);
}

static void *client_main(void *argp)
{
	struct client_arg *a = argp;
	struct serve_run *r = a->run;
	const struct serve_opts *o = r->o;
	int cap = o->concurrency / o->threads + (a->idx < o->concurrency % o->threads);
	int inflight = 0, n_ids = 0, rc;
	int32_t *prompt = malloc((size_t)o->prompt_len * sizeof(*prompt));
	int *id_req = malloc((size_t)o->requests * sizeof(*id_req));	/* id - 1 -> request */
	struct mlens_event ev[256];
	struct mlens *m = NULL;
	char name[32];
	bool more = true;

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
			int i = atomic_fetch_add(&r->next, 1);
			struct mlens_request q = { .size = sizeof(q) };
			uint64_t id;
			if (i >= o->requests) {
				more = false;
				break;
			}
			for (int j = 0; j < o->prompt_len; j++)
				prompt[j] = (int32_t)(mix64(((uint64_t)i << 24) + (uint64_t)j + 1) % r->vocab);
			q.prompt = prompt;
			q.n_prompt = (uint32_t)o->prompt_len;
			q.max_tokens = (uint32_t)o->gen_len;
			q.timeout_ms = -1;
			r->recs[i].t_submit = mlens_bench_now_ns();
			rc = mlens_submit(m, &q, &id);
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
		if (mlens_bench_now_ns() > r->deadline) {
			fprintf(stderr, "serve: client %d: run timeout with %d requests in flight\n",
				a->idx, inflight);
			a->rc = -ETIMEDOUT;
			goto out;
		}
		for (int e = 0; e < rc; e++) {
			struct req_rec *rec;
			if (ev[e].id < 1 || ev[e].id > (uint64_t)n_ids)
				continue;
			rec = &r->recs[id_req[ev[e].id - 1]];
			if (ev[e].flags & MLENS_EV_FIRST)
				rec->t_first = mlens_bench_now_ns();
			if (ev[e].flags & MLENS_EV_TOKEN)
				rec->tokens++;
			if (ev[e].flags & MLENS_EV_LAST) {
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
	bool have;
	double hbm_gbs;		/* device-to-device copy, bytes read + written per second */
	double gemm_tflops;	/* cuBLAS bf16, fp32 accumulate, expert shape at gemm_m rows */
	int gemm_m;
	char device[260];
};

#ifdef HAVE_CUDA
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

/* HBM: median of 10 copies of 2 GiB (4 GiB moved each). GEMM: the engine's
 * expert GEMM (out[m][I] = x[m][H] . W1[I][H]^T, bf16 in, fp32 out, fp32
 * accumulation) at m rows, over 4 weight copies in turn so that L2 never
 * holds the operand, random data, median of 20 after 3 warm-ups. */
static void measure_ceilings(struct ceilings *c, int H, int I, int m)
{
	const size_t copy_bytes = 2ull << 30;
	const int n_w = 4;
	void *a = NULL, *b = NULL, *w[4] = { 0 }, *x = NULL, *y = NULL, *ws = NULL;
	uint16_t *h = NULL;
	cublasHandle_t blas = NULL;
	cudaEvent_t e0 = NULL, e1 = NULL;
	struct cudaDeviceProp prop;
	float t[20], alpha = 1.0f, beta = 0.0f;
	size_t wn = (size_t)H * I, xn = (size_t)m * H;
	uint64_t s = 12345;

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

	h = malloc((wn > xn ? wn : xn) * 2);
	if (!h)
		goto out;
	for (int k = 0; k < n_w; k++) {
		for (size_t i = 0; i < wn; i++) {
			s = mix64(s + i);
			h[i] = bf16_of((float)((double)(s >> 11) / 9007199254740992.0 - 0.5) * 0.05f);
		}
		CK(cudaMalloc(&w[k], wn * 2));
		CK(cudaMemcpy(w[k], h, wn * 2, cudaMemcpyHostToDevice));
	}
	for (size_t i = 0; i < xn; i++) {
		s = mix64(s + i);
		h[i] = bf16_of((float)((double)(s >> 11) / 9007199254740992.0 - 0.5));
	}
	CK(cudaMalloc(&x, xn * 2));
	CK(cudaMemcpy(x, h, xn * 2, cudaMemcpyHostToDevice));
	CK(cudaMalloc(&y, (size_t)m * I * 4));
	CK(cudaMalloc(&ws, 32u << 20));
	CB(cublasCreate(&blas));
	CB(cublasSetWorkspace(blas, ws, 32u << 20));
	for (int i = 0; i < 23; i++) {
		CK(cudaEventRecord(e0, 0));
		CB(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, I, m, H, &alpha, w[i % n_w], CUDA_R_16BF, H,
				x, CUDA_R_16BF, H, &beta, y, CUDA_R_32F, I, CUBLAS_COMPUTE_32F,
				CUBLAS_GEMM_DEFAULT));
		CK(cudaEventRecord(e1, 0));
		CK(cudaEventSynchronize(e1));
		if (i >= 3)
			CK(cudaEventElapsedTime(&t[i - 3], e0, e1));
	}
	c->gemm_tflops = 2.0 * m * (double)H * I / (median_ms(t, 20) * 1e-3) / 1e12;
	c->have = true;
out:
	if (blas)
		cublasDestroy(blas);
	cudaFree(a);
	cudaFree(b);
	for (int k = 0; k < n_w; k++)
		cudaFree(w[k]);
	cudaFree(x);
	cudaFree(y);
	cudaFree(ws);
	if (e0)
		cudaEventDestroy(e0);
	if (e1)
		cudaEventDestroy(e1);
	free(h);
}
#endif

/* The bound GPU-only serving can reach on this workload, from the measured
 * HBM bandwidth BW and GEMM rate R (both for the whole device).
 *
 * Steady state: B sequences run at once, each holding at most p+g tokens of
 * KV, so B <= M/(p+g) for a pool of M tokens; a step carries one decode
 * token per running sequence plus, on average, B*p/g prefill tokens (a
 * sequence's prompt once per g steps), so n = B(p+g)/g <= N_cap, the step
 * token cap. B = min(M/(p+g), N_cap*g/(p+g)).
 *
 * One step of n tokens must
 *  - read every weight it uses once: W = L*(attention + norms + router +
 *    D*3*H*I*es) + lm_head, with D = E*(1-(1-k/E)^n) the experts that n
 *    tokens route to in expectation (all E once n*k >> E);
 *  - do F = n*2*L*(attention params + router + k*3*H*I) GEMM FLOPs, plus
 *    attention scores: 4*nh*hd*ctx per token and layer (ctx p/2 for a
 *    prefill token on average, p+g/2 for a decode one), plus 2*H*V per
 *    sampled row (B(1+1/g) rows);
 *  - read the KV of every decode token's context: B*(p+g/2)*L*2*nkv*hd*kv_es.
 * Weight reads and GEMMs overlap (the GEMMs stream their weights), KV reads
 * happen in the attention kernels between them, so
 *     t_step >= max(W/BW, F/R) + KV/BW,  generated tokens/s <= B / t_step.
 * R is taken at the expert GEMM's shape with n*k/E rows, the GEMMs that
 * dominate F. */
struct bound {
	double B, n_step, w_bytes, flops, kv_bytes, t_weights, t_flops, t_kv, t_step, gen_tps;
};

static void compute_bound(struct bound *bd, const struct mlens_model_config *c, double p, double g,
			  double kv_tokens, double n_cap, double bw, double rate)
{
	double L = (double)c->num_hidden_layers, H = (double)c->hidden_size;
	double I = (double)c->intermediate_size, E = (double)c->num_local_experts;
	double k = (double)c->num_experts_per_tok, V = (double)c->vocab_size;
	double nh = (double)c->num_attention_heads, nkv = (double)c->num_key_value_heads;
	double hd = (double)c->head_dim, es = (double)mlens_dtype_size(c->dtype);
	double kv_es = c->dtype == MLENS_DTYPE_F32 ? 4 : 2;
	double attn_params = H * nh * hd * 2 + H * nkv * hd * 2;
	double B, n, D, pre, rows;

	memset(bd, 0, sizeof(*bd));
	B = floor(kv_tokens / (p + g));
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
	bd->w_bytes = L * ((attn_params + 2 * H + H * E) * es + D * 3 * H * I * es) + V * H * es;
	bd->flops = n * 2 * L * (attn_params + H * E + k * 3 * H * I) +
		    L * 4 * nh * hd * (pre * p / 2 + B * (p + g / 2)) + rows * 2 * H * V;
	bd->kv_bytes = B * (p + g / 2) * L * 2 * nkv * hd * kv_es;
	if (bw <= 0 || rate <= 0)
		return;
	bd->t_weights = bd->w_bytes / bw;
	bd->t_flops = bd->flops / rate;
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
		"       [--prompt-len P] [--gen-len G] [--requests N] [--concurrency C] [--threads T]\n"
		"       [--start-timeout S] [--timeout S] [--keep-log] [--predict] [--json]\n"
		"  --predict: after the run, ask the daemon's performance model (mlensctl profile;\n"
		"             it measures unless the daemon profiled already) and print its\n"
		"             prediction beside the measurement\n");
}

int mlens_bench_serve(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "model", 1, 0, 'm' }, { "mlensd", 1, 0, 'd' }, { "backend", 1, 0, 'b' },
		{ "kv-cache", 1, 0, 'k' }, { "gpu-memory", 1, 0, 'G' }, { "max-step-tokens", 1, 0, 's' },
		{ "daemon-arg", 1, 0, 'a' }, { "prompt-len", 1, 0, 'p' }, { "gen-len", 1, 0, 'g' },
		{ "requests", 1, 0, 'n' }, { "concurrency", 1, 0, 'c' }, { "threads", 1, 0, 't' },
		{ "start-timeout", 1, 0, 'S' }, { "timeout", 1, 0, 'T' }, { "keep-log", 0, 0, 'K' },
		{ "json", 0, 0, 'j' }, { "predict", 0, 0, 'P' }, { "help", 0, 0, 'h' }, { 0, 0, 0, 0 }
	};
	struct serve_opts o = {
		.backend = "auto", .kv_cache = "1G", .prompt_len = 512, .gen_len = 128, .requests = 256,
		.concurrency = 256, .threads = 4, .start_timeout = 600, .run_timeout = 3600,
	};
	struct daemon_proc d = { 0 };
	struct serve_run run = { 0 };
	struct client_arg *ca = NULL;
	pthread_t *th = NULL;
	struct mlens_model *model = NULL;
	struct ceilings ceil_ = { 0 };
	struct bound bd = { 0 };
	json_t *st0 = NULL, *st1 = NULL, *status = NULL, *out = NULL, *prof = NULL;
	double *ttft = NULL, wall, busy, kv_tokens, n_cap;
	uint64_t t0, t1, gen = 0, prompt_tok = 0;
	int ok = 0, bad = 0, n_ttft = 0, rc = 1, opt;
	char err[512];
	struct mlens *probe = NULL;
	struct mlens_limits lim = { .size = sizeof(lim) };

	optind = 1;
	while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		long long v = 0;
		if (strchr("pgnctsST", opt)) {
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
		case 'p': o.prompt_len = (int)v; break;
		case 'g': o.gen_len = (int)v; break;
		case 'n': o.requests = (int)v; break;
		case 'c': o.concurrency = (int)v; break;
		case 't': o.threads = (int)v; break;
		case 'S': o.start_timeout = (double)v; break;
		case 'T': o.run_timeout = (double)v; break;
		case 'K': o.keep_log = true; break;
		case 'j': o.json = true; break;
		case 'P': o.predict = true; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (!o.model || o.prompt_len < 1 || o.gen_len < 1 || o.requests < 1 || o.concurrency < 1 ||
	    o.threads < 1) {
		usage(stderr);
		return 2;
	}
	if (o.threads > o.concurrency)
		o.threads = o.concurrency;
	if (mlens_model_open(o.model, &model, err, sizeof(err))) {
		fprintf(stderr, "serve: %s\n", err);
		return 1;
	}

	if (daemon_start(&d, &o))
		goto out;
	if (mlens_open(d.sock, "bench-limits", &probe) || mlens_limits(probe, &lim)) {
		fprintf(stderr, "serve: cannot read the daemon's limits\n");
		goto out;
	}
	mlens_close(probe);
	if ((uint32_t)o.prompt_len > lim.max_prompt_tokens ||
	    (uint32_t)(o.prompt_len + o.gen_len) > lim.max_context) {
		fprintf(stderr, "serve: p=%d g=%d is over the daemon's limits (prompt %u, context %u)\n",
			o.prompt_len, o.gen_len, lim.max_prompt_tokens, lim.max_context);
		goto out;
	}
	status = socket_json(d.control, "{\"cmd\":\"status\"}\n");
	st0 = socket_json(d.stats, NULL);
	run.o = &o;
	run.sock = d.sock;
	run.vocab = lim.vocab_size;
	run.recs = calloc((size_t)o.requests, sizeof(*run.recs));
	ca = calloc((size_t)o.threads, sizeof(*ca));
	th = calloc((size_t)o.threads, sizeof(*th));
	ttft = calloc((size_t)o.requests, sizeof(*ttft));
	if (!run.recs || !ca || !th || !ttft || !st0)
		goto out;
	t0 = mlens_bench_now_ns();
	run.deadline = t0 + (uint64_t)(o.run_timeout * 1e9);
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
	wall = (double)(t1 - t0) / 1e9;
	for (int i = 0; i < o.requests; i++) {
		struct req_rec *r = &run.recs[i];
		if (r->finish == MLENS_REASON_LENGTH || r->finish == MLENS_REASON_STOP) {
			ok++;
			gen += (uint64_t)r->tokens;
			prompt_tok += (uint64_t)o.prompt_len;
			if (r->t_first)
				ttft[n_ttft++] = (double)(r->t_first - r->t_submit) / 1e9;
		} else if (r->t_submit) {
			bad++;
		}
	}
	qsort(ttft, (size_t)n_ttft, sizeof(*ttft), cmp_double);
	/* engine busy: wall time the daemon's worker spent inside steps. The
	 * CUDA backend waits for the GPU at the end of every step (sampling
	 * reads tokens back), so this is the share of time the GPU had work
	 * queued or was waited for: an upper bound of the GPU's busy time. */
	busy = st1 ? (jnum(st1, "step_seconds_sum") - jnum(st0, "step_seconds_sum")) / wall : 0.0;
	if (o.predict) {
		/* the daemon's own model: its last profile (taken at start-up with
		 * --daemon-arg --profile), or one measured now; the steady state
		 * of the workload, and a step of the mean size this run had (the
		 * steady state assumes enough requests in flight to fill the KV
		 * pool or n_real; a run with fewer has smaller steps) */
		char req[256];
		double steps = st1 ? jnum(st1, "steps_total") - jnum(st0, "steps_total") : 0;
		double mean = steps > 0 ? (jnum(st1, "prompt_tokens_total") - jnum(st0, "prompt_tokens_total") +
					   jnum(st1, "generation_tokens_total") - jnum(st0, "generation_tokens_total")) / steps : 1;
		snprintf(req, sizeof(req), "{\"cmd\":\"profile\",\"cached\":true,\"prompt_len\":%d,\"gen_len\":%d,"
			 "\"step_tokens\":%.3f}\n", o.prompt_len, o.gen_len, mean >= 1 ? mean : 1.0);
		prof = socket_json(d.control, req);
		if (!json_is_true(json_object_get(prof, "ok"))) {
			fprintf(stderr, "serve: --predict: the daemon gave no prediction: %s\n",
				prof && json_string_value(json_object_get(prof, "error")) ?
				json_string_value(json_object_get(prof, "error")) : "no reply");
			json_decref(prof);
			prof = NULL;
		}
	}
	daemon_stop(&d, o.keep_log || bad || atomic_load(&run.failed_threads));

	kv_tokens = st1 ? jnum(st1, "kv_blocks_total") : 0.0;
	{
		json_t *kvb = json_object_get(json_object_get(status, "budgets"), "kv_cache");
		kv_tokens *= kvb ? jnum(kvb, "block_tokens") : 16.0;
	}
	n_cap = st1 ? jnum(st1, "token_cap") : 4096.0;
	compute_bound(&bd, &model->cfg, o.prompt_len, o.gen_len, kv_tokens, n_cap, 0, 0);
#ifdef HAVE_CUDA
	if (status && !strcmp(json_string_value(json_object_get(status, "backend")) ?
			      json_string_value(json_object_get(status, "backend")) : "", "cuda")) {
		int m_rows = (int)ceil(bd.n_step * (double)model->cfg.num_experts_per_tok /
				       (double)model->cfg.num_local_experts);
		measure_ceilings(&ceil_, (int)model->cfg.hidden_size, (int)model->cfg.intermediate_size,
				 m_rows < 1 ? 1 : m_rows);
		if (ceil_.have)
			compute_bound(&bd, &model->cfg, o.prompt_len, o.gen_len, kv_tokens, n_cap,
				      ceil_.hbm_gbs * 1e9, ceil_.gemm_tflops * 1e12);
	}
#endif

	{
		double steps = st1 ? jnum(st1, "steps_total") - jnum(st0, "steps_total") : 0;
		double gen_tps = gen / wall, tot_tps = (gen + prompt_tok) / wall;
		out = json_pack("{s:s,s:s,s:s,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:I,s:I,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f}",
			"bench", "serve", "model", o.model, "backend",
			status && json_string_value(json_object_get(status, "backend")) ?
				json_string_value(json_object_get(status, "backend")) : "?",
			"mode_reason", status && json_string_value(json_object_get(status, "mode_reason")) ?
				json_string_value(json_object_get(status, "mode_reason")) : "?",
			"prompt_len", o.prompt_len, "gen_len", o.gen_len, "requests", o.requests,
			"requests_ok", ok, "requests_failed", bad, "concurrency", o.concurrency,
			"threads", o.threads, "prompt_tokens", (json_int_t)prompt_tok,
			"generated_tokens", (json_int_t)gen, "wall_seconds", wall,
			"generated_tokens_per_s", gen_tps, "total_tokens_per_s", tot_tps,
			"ttft_p50_s", percentile(ttft, n_ttft, 50), "ttft_p99_s", percentile(ttft, n_ttft, 99),
			"engine_busy_ratio", busy, "steps", steps,
			"mean_step_tokens", steps > 0 ? (jnum(st1, "prompt_tokens_total") - jnum(st0, "prompt_tokens_total") +
							 jnum(st1, "generation_tokens_total") - jnum(st0, "generation_tokens_total")) / steps : 0.0);
		json_object_set_new(out, "kv_tokens", json_real(kv_tokens));
		json_object_set_new(out, "step_token_cap", json_real(n_cap));
		json_object_set_new(out, "preemptions", json_real(st1 ? jnum(st1, "preemptions_total") - jnum(st0, "preemptions_total") : 0));
		if (ceil_.have) {
			json_object_set_new(out, "device", json_string(ceil_.device));
			json_object_set_new(out, "hbm_gb_per_s", json_real(ceil_.hbm_gbs));
			json_object_set_new(out, "gemm_tflops", json_real(ceil_.gemm_tflops));
			json_object_set_new(out, "gemm_rows", json_integer(ceil_.gemm_m));
			json_object_set_new(out, "bound", json_pack("{s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f,s:f}",
				"batch_seqs", bd.B, "step_tokens", bd.n_step, "weight_bytes", bd.w_bytes,
				"flops", bd.flops, "kv_bytes", bd.kv_bytes, "t_weights_s", bd.t_weights,
				"t_flops_s", bd.t_flops, "t_kv_s", bd.t_kv, "t_step_s", bd.t_step,
				"generated_tokens_per_s", bd.gen_tps));
			json_object_set_new(out, "measured_over_bound", json_real(gen_tps / bd.gen_tps));
		}
		if (prof) {
			json_t *pr = json_object_get(prof, "predicted");
			double ptps = jnum(pr, "tokens_per_s");
			json_object_set_new(out, "predicted", json_pack("{s:f,s:f,s:f,s:f,s:f,s:s,s:s,s:i,s:b}",
				"total_tokens_per_s", ptps, "generated_tokens_per_s", jnum(pr, "generated_tokens_per_s"),
				"step_seconds", jnum(pr, "step_seconds"), "tokens_per_step", jnum(pr, "tokens_per_step"),
				"n_real", jnum(prof, "n_real"),
				"binding", json_string_value(json_object_get(prof, "binding")) ?
					json_string_value(json_object_get(prof, "binding")) : "?",
				"limit", json_string_value(json_object_get(prof, "limit")) ?
					json_string_value(json_object_get(prof, "limit")) : "?",
				"resident_experts", (int)jnum(json_object_get(prof, "policy"), "resident_experts"),
				"from_cache", json_is_true(json_object_get(prof, "from_cache"))));
			/* signed: positive when the model promises more than the box gave */
			json_object_set_new(out, "prediction_error", json_real(tot_tps > 0 ? (ptps - tot_tps) / tot_tps : 0.0));
			{
				json_t *sj = json_object_get(prof, "step");
				double st_s = jnum(sj, "seconds"), meas_s = steps > 0 ? busy * wall / steps : 0;
				json_object_set_new(out, "predicted_at_mean_step", json_pack("{s:f,s:f,s:f,s:f}",
					"tokens", jnum(sj, "tokens"), "step_seconds", st_s,
					"measured_step_seconds", meas_s,
					"step_error", meas_s > 0 && st_s > 0 ? (st_s - meas_s) / meas_s : 0.0));
			}
		}
		if (o.json) {
			json_dumpf(out, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
			printf("\n");
		} else {
			printf("%-26s %s (%s)\n", "backend", json_string_value(json_object_get(out, "backend")),
			       json_string_value(json_object_get(out, "mode_reason")));
			printf("%-26s %d ok, %d failed (p=%d g=%d, %d in flight, %d clients)\n", "requests", ok,
			       bad, o.prompt_len, o.gen_len, o.concurrency, o.threads);
			printf("%-26s %llu prompt, %llu generated in %.2f s\n", "tokens",
			       (unsigned long long)prompt_tok, (unsigned long long)gen, wall);
			printf("%-26s %.1f generated, %.1f total\n", "tokens/s", gen_tps, tot_tps);
			printf("%-26s p50 %.3f s, p99 %.3f s\n", "time to first token",
			       percentile(ttft, n_ttft, 50), percentile(ttft, n_ttft, 99));
			printf("%-26s %.1f %%\n", "engine busy", 100 * busy);
			if (ceil_.have) {
				printf("%-26s HBM %.0f GB/s, GEMM %.0f TFLOP/s at %d rows (%s)\n", "ceilings",
				       ceil_.hbm_gbs, ceil_.gemm_tflops, ceil_.gemm_m, ceil_.device);
				printf("%-26s %.0f generated tokens/s (B=%.0f, %.0f tokens/step, step %.2f ms)\n",
				       "bound", bd.gen_tps, bd.B, bd.n_step, bd.t_step * 1e3);
				printf("%-26s %.2f\n", "measured / bound", gen_tps / bd.gen_tps);
			}
			if (prof) {
				json_t *pr = json_object_get(prof, "predicted");
				double ptps = jnum(pr, "tokens_per_s");
				printf("%-26s %.1f total tokens/s (%.1f generated), steps of %.0f tokens in %.4g s\n",
				       "predicted", ptps, jnum(pr, "generated_tokens_per_s"), jnum(pr, "tokens_per_step"),
				       jnum(pr, "step_seconds"));
				printf("%-26s %.1f total tokens/s (%.1f generated), steps of %.1f tokens\n", "measured",
				       tot_tps, gen_tps, steps > 0 ? (jnum(st1, "prompt_tokens_total") -
				       jnum(st0, "prompt_tokens_total") + jnum(st1, "generation_tokens_total") -
				       jnum(st0, "generation_tokens_total")) / steps : 0.0);
				{
					json_t *sj = json_object_get(prof, "step");
					double meas_s = steps > 0 ? busy * wall / steps : 0;
					printf("%-26s %.4g s predicted, %.4g s measured (mean step of %.1f tokens, %+.1f %%)\n",
					       "step time", jnum(sj, "seconds"), meas_s, jnum(sj, "tokens"),
					       meas_s > 0 ? 100 * (jnum(sj, "seconds") - meas_s) / meas_s : 0.0);
				}
				printf("%-26s %+.1f %% (n_real %.0f, %s binds, %s sets the step)\n", "prediction error",
				       tot_tps > 0 ? 100 * (ptps - tot_tps) / tot_tps : 0.0, jnum(prof, "n_real"),
				       json_string_value(json_object_get(prof, "binding")),
				       json_string_value(json_object_get(prof, "limit")));
			}
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
	free(ca);
	free(th);
	free(ttft);
	if (model)
		mlens_model_close(model);
	return rc;
}
