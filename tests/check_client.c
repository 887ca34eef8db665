/* Description: libmlens and the mlens CLI's JSON lines without mlensd:
 * argument checks, mlens_strerror, request and result lines, and the
 * library against a fake daemon played by this process with the real shm
 * code (a listening SOCK_SEQPACKET socket, a memfd region, eventfds passed
 * by SCM_RIGHTS to a forked child that runs the library): tokens and
 * flags, full rings in both directions (needs-wake-up doorbells),
 * nonblocking and timed submits, cancel, the caller's own poll loop on
 * mlens_fd, refusals at attach, and the daemon hanging up. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <jansson.h>
#include "client/cli_int.h"
#include "client/mlens.h"
#include "shm/attach.h"
#include "shm/proto.h"
#include "shm/region.h"
#include "shm/ring.h"
#include "tests/fake_mlensd.h"

/* The fake daemon's limits and ring sizes: small, so rings fill. */
#define VOCAB 1000u
#define MAX_PROMPT 64u
#define MAX_GEN 32u
#define CONTEXT 80u
#define SUB_ENTRIES 8u
#define CMPL_ENTRIES 16u
#define PROMPT_BYTES 4096u

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ==== Fake daemon (the test process) ==== */

enum scenario {
	SC_BASIC,	/* tokens, stop, logprobs, error event */
	SC_PRESSURE,	/* 40 requests through 8-entry and 16-entry rings, two threads */
	SC_NOWAIT,	/* daemon starts reading late: -EAGAIN, -ETIMEDOUT, abort */
	SC_CANCEL,	/* requests held after one token until cancelled */
	SC_HANGUP,	/* daemon posts 3 events and closes */
	SC_HANGUP_IDLE,	/* daemon closes while the client sleeps in mlens_wait */
	SC_FDLOOP,	/* the client sleeps in its own poll() on mlens_fd */
	SC_CLI,		/* the client is the mlens CLI */
};

/* The fake daemon's tokens, which the client checks. */
static int32_t gen_token(const int32_t *prompt, uint32_t n, uint32_t i)
{
	int32_t sum = 0;

	for (uint32_t k = 0; k < n; k++)
		sum += prompt[k];
	return mlens_fake_token(sum, VOCAB, i);
}

static float gen_logprob(uint32_t i)
{
	return mlens_fake_logprob(i);
}

/* A fake daemon with small rings (so that they fill) listening. */
static void fake_listen(struct mlens_fake *f, enum scenario sc)
{
	memset(f, 0, sizeof(*f));
	f->params = (struct mlens_region_params){ SUB_ENTRIES, CMPL_ENTRIES, PROMPT_BYTES };
	f->limits = (struct mlens_region_limits){ .max_prompt_tokens = MAX_PROMPT, .max_tokens = MAX_GEN,
						  .max_context = CONTEXT, .vocab_size = VOCAB,
						  .max_running = 7, .max_queued = 30 };
	f->hold = sc == SC_CANCEL;
	f->post_limit = sc == SC_HANGUP ? 3 : 0;
	ck_assert_int_eq(mlens_fake_listen(f), 0);
}

static void fake_attach(struct mlens_fake *f, int32_t status, uint32_t magic,
			const char *name)
{
	ck_assert_int_eq(mlens_fake_accept(f, status, magic), 0);
	ck_assert_str_eq(f->name, name);
}

static void fake_serve(struct mlens_fake *f)
{
	ck_assert_int_eq(mlens_fake_serve(f), 0);
}

/* ==== The client (forked child) ==== */

/* In the child: report the first failed check and exit non-zero. */
#define CHK(cond)                                                                       \
	do {                                                                            \
		if (!(cond)) {                                                          \
			fprintf(stderr, "client check failed at line %d: %s\n", __LINE__, \
				#cond);                                                 \
			_exit(1);                                                       \
		}                                                                       \
	} while (0)

struct expect {
	uint64_t id;
	int32_t prompt[MAX_PROMPT];
	uint32_t n_prompt, max_tokens, got;
	bool logprobs, ended;
	int32_t stop;		/* -1: none */
	uint32_t finish;
	int32_t status;
};

/* The request that e describes (reads e only). */
static void req_for(struct mlens_request *req, const struct expect *e)
{
	memset(req, 0, sizeof(*req));
	req->size = sizeof(*req);
	req->prompt = e->prompt;
	req->n_prompt = e->n_prompt;
	req->max_tokens = e->max_tokens;
	req->timeout_ms = -1;
}

static void req_init(struct mlens_request *req, struct expect *e, int32_t first, uint32_t n,
		     uint32_t max_tokens)
{
	memset(e, 0, sizeof(*e));
	e->stop = -1;
	e->n_prompt = n;
	e->max_tokens = max_tokens;
	for (uint32_t i = 0; i < n; i++)
		e->prompt[i] = (first + (int32_t)i * 13) % (int32_t)VOCAB;
	req_for(req, e);
}

/* Check one event against what the fake daemon must have sent. */
static void expect_event(struct expect *es, int n_es, const struct mlens_event *ev)
{
	struct expect *e = NULL;

	for (int i = 0; i < n_es; i++)
		if (es[i].id == ev->id)
			e = &es[i];
	CHK(e != NULL);
	CHK(!e->ended);
	CHK(!!(ev->flags & MLENS_EV_FIRST) == (e->got == 0));
	if (ev->flags & MLENS_EV_TOKEN) {
		CHK(ev->token == gen_token(e->prompt, e->n_prompt, e->got));
		CHK(!!(ev->flags & MLENS_EV_LOGPROB) == e->logprobs);
		if (e->logprobs)
			CHK(ev->logprob == gen_logprob(e->got));
		e->got++;
	}
	if (ev->flags & MLENS_EV_LAST) {
		e->ended = true;
		e->finish = ev->finish;
		e->status = ev->status;
	} else {
		CHK(ev->finish == MLENS_REASON_NONE);
	}
}

static void wait_all(struct mlens *m, struct expect *es, int n_es)
{
	struct mlens_event ev[8];
	int left = n_es;

	while (left) {
		int n = mlens_wait(m, ev, 8, 5000);

		CHK(n > 0);
		for (int i = 0; i < n; i++) {
			expect_event(es, n_es, &ev[i]);
			left -= !!(ev[i].flags & MLENS_EV_LAST);
		}
	}
}

static void client_basic(struct mlens *m)
{
	struct mlens_limits lim = { .size = sizeof(lim) };
	struct mlens_request req;
	struct expect es[4];

	CHK(mlens_limits(m, &lim) == 0);
	CHK(lim.max_prompt_tokens == MAX_PROMPT && lim.max_tokens == MAX_GEN);
	CHK(lim.max_context == CONTEXT && lim.vocab_size == VOCAB);
	CHK(lim.sub_entries == SUB_ENTRIES && lim.cmpl_entries == CMPL_ENTRIES);
	CHK(lim.prompt_ring_bytes == PROMPT_BYTES);
	CHK(lim.max_running == 7 && lim.max_queued == 30);
	CHK(mlens_fd(m) >= 0);

	/* plain greedy, past EOS */
	req_init(&req, &es[0], 5, 3, 4);
	req.flags = MLENS_REQ_IGNORE_EOS;
	CHK(mlens_submit(m, &req, &es[0].id) == 0 && es[0].id == 1);
	/* with logprobs */
	req_init(&req, &es[1], 100, 10, 6);
	req.flags = MLENS_REQ_LOGPROBS;
	es[1].logprobs = true;
	CHK(mlens_submit(m, &req, &es[1].id) == 0 && es[1].id == 2);
	/* a stop token: the third generated token */
	req_init(&req, &es[2], 40, 2, 20);
	es[2].stop = gen_token(es[2].prompt, 2, 2);
	req.stop[0] = es[2].stop;
	req.n_stop = 1;
	CHK(mlens_submit(m, &req, &es[2].id) == 0 && es[2].id == 3);
	/* the daemon refuses it: an error event */
	req_init(&req, &es[3], 999, 1, 1);
	CHK(mlens_submit(m, &req, &es[3].id) == 0 && es[3].id == 4);

	wait_all(m, es, 4);
	CHK(es[0].got == 4 && es[0].finish == MLENS_REASON_LENGTH && es[0].status == 0);
	CHK(es[1].got == 6 && es[1].finish == MLENS_REASON_LENGTH);
	CHK(es[2].got == 3 && es[2].finish == MLENS_REASON_STOP);
	CHK(es[3].got == 0 && es[3].finish == MLENS_REASON_ERROR && es[3].status == -EDQUOT);
	/* nothing more */
	struct mlens_event ev;

	CHK(mlens_poll(m, &ev, 1) == 0);
	CHK(mlens_wait(m, &ev, 1, 20) == 0);
}

/* Requests rejected before they reach the daemon. */
static void client_invalid(struct mlens *m)
{
	struct mlens_request req;
	struct expect e;
	uint64_t id = 77;
	unsigned char big[sizeof(req) + 16];

	req_init(&req, &e, 1, 4, 4);
	req.n_prompt = 0;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.n_prompt = MAX_PROMPT + 1;
	CHK(mlens_submit(m, &req, &id) == -E2BIG);
	req.n_prompt = 4;
	req.max_tokens = 0;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.max_tokens = MAX_GEN + 1;
	CHK(mlens_submit(m, &req, &id) == -E2BIG);
	req.max_tokens = MAX_GEN;
	req.n_prompt = CONTEXT - MAX_GEN + 1;	/* within max_prompt, over the context */
	CHK(mlens_submit(m, &req, &id) == -E2BIG);
	req.n_prompt = 4;
	e.prompt[2] = VOCAB;
	CHK(mlens_submit(m, &req, &id) == -ERANGE);
	e.prompt[2] = -1;
	CHK(mlens_submit(m, &req, &id) == -ERANGE);
	e.prompt[2] = 3;
	req.temperature = NAN;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.temperature = 101.0f;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.temperature = 0.5f;
	req.top_p = 1.5f;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.top_p = 0.0f;	/* taken as 1 */
	req.top_k = (int32_t)VOCAB + 1;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.top_k = -1;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.top_k = 0;
	req.n_stop = MLENS_REQ_MAX_STOP + 1;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.n_stop = 1;
	req.stop[0] = VOCAB;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.stop[0] = 1;
	req.flags = 0x80;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.flags = 0;
	req.prompt = NULL;
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	req.prompt = e.prompt;
	req.size = 8;	/* older than any library */
	CHK(mlens_submit(m, &req, &id) == -EINVAL);
	/* a newer caller's struct: unknown trailing bytes must be zero */
	memset(big, 0, sizeof(big));
	req.size = sizeof(big);
	memcpy(big, &req, sizeof(req));
	big[sizeof(req) + 3] = 1;
	CHK(mlens_submit(m, (struct mlens_request *)(void *)big, &id) == -EINVAL);
	CHK(id == 77);	/* untouched by failures */
	CHK(mlens_submit(NULL, &req, &id) == -EINVAL);
	CHK(mlens_submit(m, NULL, &id) == -EINVAL);
	CHK(mlens_cancel(m, 0) == -EINVAL);
	CHK(mlens_cancel(m, 1) == -EINVAL);	/* never issued */
	CHK(mlens_poll(m, NULL, 1) == -EINVAL);
	struct mlens_event ev;

	CHK(mlens_poll(m, &ev, 0) == -EINVAL);
	struct mlens_limits lim = { .size = 4 };

	CHK(mlens_limits(m, &lim) == -EINVAL);

	/* the zero-padded newer struct and top_p 0 are accepted */
	big[sizeof(req) + 3] = 0;
	req.size = sizeof(req);
	req.top_p = 0.0f;
	req.n_stop = 0;
	req.stop[0] = 0;
	e.max_tokens = req.max_tokens = 2;
	memcpy(big, &req, sizeof(req));
	((struct mlens_request *)(void *)big)->size = sizeof(big);
	CHK(mlens_submit(m, (struct mlens_request *)(void *)big, &e.id) == 0 && e.id == 1);
	wait_all(m, &e, 1);
	CHK(e.got == 2 && e.finish == MLENS_REASON_LENGTH);
}

/* Two threads: one submits 40 requests (blocking on full rings), the
 * other starts reading late, so the daemon stalls on a full completion
 * ring until the reader rings it. */
struct pressure {
	struct mlens *m;
	struct expect es[40];
	int submitted;
};

static void *pressure_reader(void *arg)
{
	struct pressure *p = arg;

	usleep(100 * 1000);
	wait_all(p->m, p->es, 40);
	return NULL;
}

static void client_pressure(struct mlens *m)
{
	static struct pressure p;
	struct mlens_request req;
	pthread_t th;

	p.m = m;
	for (int i = 0; i < 40; i++) {
		req_init(&req, &p.es[i], 3 * i, 48 + i % 16, 4);
		p.es[i].id = (uint64_t)i + 1;	/* ids are issued in order */
	}
	/* the reader reads es from now on: the submissions only read it */
	CHK(pthread_create(&th, NULL, pressure_reader, &p) == 0);
	for (int i = 0; i < 40; i++) {
		uint64_t id;

		req_for(&req, &p.es[i]);
		CHK(mlens_submit(m, &req, &id) == 0);
		CHK(id == (uint64_t)i + 1);
	}
	CHK(pthread_join(th, NULL) == 0);
	for (int i = 0; i < 40; i++)
		CHK(p.es[i].got == 4 && p.es[i].finish == MLENS_REASON_LENGTH);
}

/* The daemon reads nothing until 8 submissions wait and 300 ms passed. */
static void client_nowait(struct mlens *m)
{
	struct mlens_request req;
	struct expect es[9], extra;
	uint64_t id;
	double t0;

	for (int i = 0; i < 8; i++) {
		req_init(&req, &es[i], 10 * i, MAX_PROMPT, 2);
		req.timeout_ms = 0;
		CHK(mlens_submit(m, &req, &es[i].id) == 0);
	}
	req_init(&req, &extra, 500, MAX_PROMPT, 2);
	req.timeout_ms = 0;
	CHK(mlens_submit(m, &req, &id) == -EAGAIN);
	req.timeout_ms = 50;
	t0 = now_s();
	CHK(mlens_submit(m, &req, &id) == -ETIMEDOUT);
	CHK(now_s() - t0 >= 0.045);
	/* the same request, blocking: goes once the daemon reads */
	req_init(&req, &es[8], 500, MAX_PROMPT, 2);
	CHK(mlens_submit(m, &req, &es[8].id) == 0);
	CHK(es[8].id == 9);
	wait_all(m, es, 9);
	for (int i = 0; i < 9; i++)
		CHK(es[i].got == 2 && es[i].finish == MLENS_REASON_LENGTH);
}

static void client_cancel(struct mlens *m)
{
	struct mlens_request req;
	struct expect e[2];
	struct mlens_event ev[4];

	req_init(&req, &e[0], 1, 2, 10);
	CHK(mlens_submit(m, &req, &e[0].id) == 0);
	req_init(&req, &e[1], 2, 2, 10);
	CHK(mlens_submit(m, &req, &e[1].id) == 0);
	/* one token each, then held */
	for (int seen = 0; seen < 2;) {
		int n = mlens_wait(m, ev, 4, 5000);

		CHK(n > 0);
		for (int i = 0; i < n; i++) {
			expect_event(e, 2, &ev[i]);
			CHK(!(ev[i].flags & MLENS_EV_LAST));
			seen++;
		}
	}
	CHK(mlens_wait(m, ev, 4, 50) == 0);
	CHK(mlens_cancel(m, e[1].id) == 0);
	CHK(mlens_wait(m, ev, 4, 5000) == 1);
	CHK(ev[0].id == e[1].id && (ev[0].flags & MLENS_EV_LAST));
	CHK(!(ev[0].flags & MLENS_EV_TOKEN) && ev[0].finish == MLENS_REASON_CANCELLED);
	CHK(mlens_cancel(m, e[0].id) == 0);
	CHK(mlens_wait(m, ev, 4, 5000) == 1);
	CHK(ev[0].id == e[0].id && ev[0].finish == MLENS_REASON_CANCELLED);
	CHK(mlens_cancel(m, 3) == -EINVAL);
}

static void client_hangup(struct mlens *m)
{
	struct mlens_request req;
	struct expect e;
	struct mlens_event ev[8];
	int got = 0, n;

	req_init(&req, &e, 1, 2, 10);
	CHK(mlens_submit(m, &req, &e.id) == 0);
	/* the 3 events posted before the hang-up come first */
	while ((n = mlens_wait(m, ev, 8, 5000)) > 0) {
		for (int i = 0; i < n; i++)
			expect_event(&e, 1, &ev[i]);
		got += n;
	}
	CHK(got == 3);
	CHK(n == -ECONNRESET);
	CHK(mlens_poll(m, ev, 8) == -ECONNRESET);
	CHK(mlens_wait(m, ev, 8, -1) == -ECONNRESET);
	CHK(mlens_submit(m, &req, &e.id) == -ECONNRESET);
	CHK(mlens_cancel(m, 1) == -ECONNRESET);
}

struct idle_waiter {
	struct mlens *m;
	int rc;
};

static void *idle_wait(void *arg)
{
	struct idle_waiter *w = arg;
	struct mlens_event ev;

	w->rc = mlens_wait(w->m, &ev, 1, -1);
	return NULL;
}

/* One thread sleeps in mlens_wait until the daemon hangs up (100 ms after
 * attach); meanwhile mlens_poll in another thread does not wait for it. */
static void client_hangup_idle(struct mlens *m)
{
	struct idle_waiter w = { m, 1 };
	struct mlens_event ev;
	pthread_t th;
	double t0 = now_s(), t1;

	CHK(pthread_create(&th, NULL, idle_wait, &w) == 0);
	usleep(20 * 1000);
	t1 = now_s();
	CHK(mlens_poll(m, &ev, 1) == 0);
	CHK(now_s() - t1 < 0.04);
	CHK(pthread_join(th, NULL) == 0);
	CHK(w.rc == -ECONNRESET);
	CHK(now_s() - t0 >= 0.05);
	CHK(mlens_poll(m, &ev, 1) == -ECONNRESET);
}

static void client_fdloop(struct mlens *m)
{
	struct mlens_request req;
	struct expect e;
	struct mlens_event ev[4];
	struct pollfd p = { .fd = mlens_fd(m), .events = POLLIN };
	int n;

	CHK(mlens_poll(m, ev, 4) == 0);	/* arms: the daemon will ring */
	req_init(&req, &e, 9, 3, 3);
	CHK(mlens_submit(m, &req, &e.id) == 0);
	while (!e.ended) {
		CHK(poll(&p, 1, 5000) == 1);
		while ((n = mlens_poll(m, ev, 4)) > 0)
			for (int i = 0; i < n; i++)
				expect_event(&e, 1, &ev[i]);
		CHK(n == 0);
	}
	CHK(e.got == 3 && e.finish == MLENS_REASON_LENGTH);
	/* drained by mlens_poll: not readable until the next event */
	CHK(poll(&p, 1, 0) == 0);
}

static void client_run(const char *path, enum scenario sc)
{
	struct mlens *m;
	int rc = mlens_open(path, "check_client", &m);

	if (rc)
		fprintf(stderr, "mlens_open: %s\n", mlens_strerror(rc));
	CHK(rc == 0);
	switch (sc) {
	case SC_BASIC:
		client_invalid(m);
		mlens_close(m);
		CHK(mlens_open(path, "check_client", &m) == 0);
		client_basic(m);
		break;
	case SC_PRESSURE:
		client_pressure(m);
		break;
	case SC_NOWAIT:
		client_nowait(m);
		break;
	case SC_CANCEL:
		client_cancel(m);
		break;
	case SC_HANGUP:
		client_hangup(m);
		break;
	case SC_HANGUP_IDLE:
		client_hangup_idle(m);
		break;
	case SC_FDLOOP:
		client_fdloop(m);
		break;
	case SC_CLI:
		break;
	}
	mlens_close(m);
	_exit(0);
}

/* ==== The mlens CLI against the fake daemon ==== */

static const char *cli_input =
	"{\"prompt\": [1, 2, 3], \"max_tokens\": 4}\n"
	"{\"prompt\": [5], \"max_token\": 4}\n"
	"{\"prompt\": [7, 8], \"max_tokens\": 3, \"logprobs\": true, \"temperature\": 0.5,"
	" \"top_k\": 5, \"top_p\": 0.9, \"seed\": 3}\n"
	"not json\n"
	"{\"prompt\": [999]}\n"
	"{\"prompt\": [1000]}\n"
	"{\"prompt\": [4, 4], \"max_tokens\": 30, \"stop\": [18]}\n"
	"\n"
	"{\"prompt\": [9], \"max_tokens\": 33}\n"
	"{\"prompt\": [11, 12, 13]}";	/* no newline at the end */

static void cli_path(char *buf, size_t len)
{
	const char *b = getenv("MLENS_BUILDDIR");

	ck_assert_msg(b != NULL, "MLENS_BUILDDIR unset: run through make check");
	snprintf(buf, len, "%s/client/mlens", b);
}

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	ck_assert_ptr_nonnull(f);
	ck_assert_int_eq(fputs(text, f) >= 0, 1);
	ck_assert_int_eq(fclose(f), 0);
}

/* Run the CLI (in a child) with argv, stdout/stderr to files in dir.
 * Returns its pid. */
static pid_t cli_spawn(const char *dir, char *const argv[])
{
	char out[160];
	pid_t pid = fork();

	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		snprintf(out, sizeof(out), "%s/stderr", dir);
		if (!freopen(out, "w", stderr))
			_exit(99);
		execv(argv[0], argv);
		_exit(98);
	}
	return pid;
}

static json_t *result_line(FILE *f, size_t index)
{
	char line[4096];
	json_error_t je;
	json_t *o;

	ck_assert_ptr_nonnull(fgets(line, sizeof(line), f));
	o = json_loads(line, 0, &je);
	ck_assert_msg(o != NULL, "result line %zu not JSON: %s", index, line);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "index")), (json_int_t)index);
	return o;
}

static const char *finish_of(json_t *o)
{
	return json_string_value(json_object_get(o, "finish_reason"));
}

static void check_tokens(json_t *o, const int32_t *prompt, uint32_t n, uint32_t want)
{
	json_t *t = json_object_get(o, "tokens");

	ck_assert_uint_eq(json_array_size(t), want);
	for (uint32_t i = 0; i < want; i++)
		ck_assert_int_eq(json_integer_value(json_array_get(t, i)), gen_token(prompt, n, i));
}

START_TEST(test_cli)
{
	static struct mlens_fake f;
	char mlens[4096], in[128], out[128], errf[128], buf[4096];
	int st;
	pid_t pid;
	FILE *fo;
	json_t *o;

	cli_path(mlens, sizeof(mlens));
	fake_listen(&f, SC_CLI);
	snprintf(in, sizeof(in), "%s/in.jsonl", f.dir);
	snprintf(out, sizeof(out), "%s/out.jsonl", f.dir);
	snprintf(errf, sizeof(errf), "%s/stderr", f.dir);
	write_file(in, cli_input);
	char *argv[] = { mlens, "generate", "-s", f.path, "-i", in, "-o", out,
			 "--max-inflight", "2", NULL };

	pid = cli_spawn(f.dir, argv);
	fake_attach(&f, 0, MLENS_WELCOME_MAGIC, "mlens");
	fake_serve(&f);
	mlens_fake_release(&f);
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	/* 1: some lines failed */
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "mlens exit status 0x%x", st);
	ck_assert_int_eq(f.n_bad, 0);
	ck_assert_int_eq(f.n_reqs, 5);	/* 3 malformed lines, 2 above the limits */

	fo = fopen(out, "r");
	ck_assert_ptr_nonnull(fo);
	o = result_line(fo, 0);
	ck_assert_str_eq(finish_of(o), "length");
	check_tokens(o, (int32_t[]){ 1, 2, 3 }, 3, 4);
	ck_assert_ptr_null(json_object_get(o, "logprobs"));
	json_decref(o);
	o = result_line(fo, 1);
	ck_assert_str_eq(finish_of(o), "error");
	ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(o, "error")), "max_token"));
	json_decref(o);
	o = result_line(fo, 2);
	ck_assert_str_eq(finish_of(o), "length");
	check_tokens(o, (int32_t[]){ 7, 8 }, 2, 3);
	ck_assert_uint_eq(json_array_size(json_object_get(o, "logprobs")), 3);
	ck_assert_double_eq_tol(json_real_value(json_array_get(json_object_get(o, "logprobs"), 2)),
				gen_logprob(2), 1e-6);
	json_decref(o);
	o = result_line(fo, 3);
	ck_assert_str_eq(finish_of(o), "error");
	json_decref(o);
	o = result_line(fo, 4);	/* the fake daemon's quota error */
	ck_assert_str_eq(finish_of(o), "error");
	ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(o, "error")), "quota"));
	json_decref(o);
	o = result_line(fo, 5);	/* token 1000 is outside the vocabulary */
	ck_assert_str_eq(finish_of(o), "error");
	ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(o, "error")), "vocabulary"));
	json_decref(o);
	o = result_line(fo, 6);	/* tokens 8, 15, 22...: stop token 18 never comes */
	ck_assert_str_eq(finish_of(o), "length");
	check_tokens(o, (int32_t[]){ 4, 4 }, 2, 30);
	json_decref(o);
	o = result_line(fo, 7);
	ck_assert_str_eq(finish_of(o), "error");
	json_decref(o);
	o = result_line(fo, 8);	/* above max_tokens */
	ck_assert_str_eq(finish_of(o), "error");
	ck_assert_ptr_nonnull(strstr(json_string_value(json_object_get(o, "error")), "max_tokens"));
	json_decref(o);
	o = result_line(fo, 9);
	ck_assert_str_eq(finish_of(o), "length");
	check_tokens(o, (int32_t[]){ 11, 12, 13 }, 3, 16);
	json_decref(o);
	ck_assert_ptr_null(fgets(buf, sizeof(buf), fo));
	fclose(fo);

	/* the summary: prompt tokens of the 5 sent 3 + 2 + 1 + 2 + 3, generated
	 * 4 + 3 + 0 + 30 + 16 */
	fo = fopen(errf, "r");
	ck_assert_ptr_nonnull(fo);
	size_t n = fread(buf, 1, sizeof(buf) - 1, fo);

	buf[n] = 0;
	fclose(fo);
	ck_assert_msg(strstr(buf, "10 requests (4 completed, 6 failed), 11 prompt tokens, "
			      "53 generated tokens"), "summary: %s", buf);
	ck_assert_msg(strstr(buf, "time to first token: p50 "), "summary: %s", buf);
	unlink(in);
	unlink(out);
	unlink(errf);
	mlens_fake_cleanup(&f);
}
END_TEST

/* All requests completed: 0; no daemon: 2; usage: 2. */
START_TEST(test_cli_status)
{
	static struct mlens_fake f;
	char mlens[4096], in[128], out[128], errf[128], buf[1024];
	int st;
	pid_t pid;

	cli_path(mlens, sizeof(mlens));
	fake_listen(&f, SC_CLI);
	snprintf(in, sizeof(in), "%s/in.jsonl", f.dir);
	snprintf(out, sizeof(out), "%s/out.jsonl", f.dir);
	snprintf(errf, sizeof(errf), "%s/stderr", f.dir);
	write_file(in, "{\"prompt\": [1]}\n{\"prompt\": [2], \"max_tokens\": 2}\n");
	char *argv[] = { mlens, "generate", "-s", f.path, "-i", in, "-o", out, "-q", NULL };

	pid = cli_spawn(f.dir, argv);
	fake_attach(&f, 0, MLENS_WELCOME_MAGIC, "mlens");
	fake_serve(&f);
	mlens_fake_release(&f);
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "mlens exit status 0x%x", st);
	FILE *fe = fopen(errf, "r");

	ck_assert_ptr_nonnull(fe);
	ck_assert_ptr_null(fgets(buf, sizeof(buf), fe));	/* -q: nothing */
	fclose(fe);

	/* nobody listening */
	close(f.lsock);
	f.lsock = -1;
	unlink(f.path);
	pid = cli_spawn(f.dir, argv);
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "mlens exit status 0x%x", st);
	fe = fopen(errf, "r");
	ck_assert_ptr_nonnull(fe);
	ck_assert_ptr_nonnull(fgets(buf, sizeof(buf), fe));
	fclose(fe);
	ck_assert_msg(strstr(buf, "cannot attach to mlensd"), "stderr: %s", buf);

	/* usage */
	char *bad[] = { mlens, "generate", "-s", f.path, "-i", in, NULL };

	pid = cli_spawn(f.dir, bad);
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "mlens exit status 0x%x", st);
	unlink(in);
	unlink(out);
	unlink(errf);
	mlens_fake_cleanup(&f);
}
END_TEST

/* ==== Running a scenario ==== */

static void run_scenario(enum scenario sc)
{
	static struct mlens_fake f;
	pid_t pid;
	int st;

	fake_listen(&f, sc);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0)
		client_run(f.path, sc);

	fake_attach(&f, 0, MLENS_WELCOME_MAGIC, "check_client");
	if (sc == SC_BASIC) {
		/* the first connection: only rejected requests, then one */
		fake_serve(&f);
		ck_assert_int_eq(f.n_reqs, 1);
		mlens_fake_release(&f);
		f.n_reqs = 0;
		f.ph = f.pt = 0;
		fake_attach(&f, 0, MLENS_WELCOME_MAGIC, "check_client");
	}
	if (sc == SC_NOWAIT) {
		while (mlens_ring_count(&f.rg.sub) < (int)SUB_ENTRIES)
			usleep(1000);
		usleep(300 * 1000);
	}
	if (sc == SC_HANGUP_IDLE)
		usleep(100 * 1000);
	else
		fake_serve(&f);
	if (sc == SC_HANGUP || sc == SC_HANGUP_IDLE)
		mlens_fake_release(&f);
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the client failed (status 0x%x)",
		      st);
	ck_assert_int_eq(f.n_bad, 0);
	if (sc == SC_PRESSURE)
		ck_assert_int_eq(f.n_reqs, 40);
	mlens_fake_cleanup(&f);
}

START_TEST(test_basic) { run_scenario(SC_BASIC); } END_TEST
START_TEST(test_pressure) { run_scenario(SC_PRESSURE); } END_TEST
START_TEST(test_nowait) { run_scenario(SC_NOWAIT); } END_TEST
START_TEST(test_cancel) { run_scenario(SC_CANCEL); } END_TEST
START_TEST(test_hangup) { run_scenario(SC_HANGUP); } END_TEST
START_TEST(test_hangup_idle) { run_scenario(SC_HANGUP_IDLE); } END_TEST
START_TEST(test_fdloop) { run_scenario(SC_FDLOOP); } END_TEST

/* Attach refusals: the daemon's status, a foreign welcome, no answer. */
static int open_against(int32_t status, uint32_t magic, bool close_early)
{
	static struct mlens_fake f;
	struct mlens *m = NULL;
	pid_t pid;
	int st;

	fake_listen(&f, SC_BASIC);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		int rc = mlens_open(f.path, "check_client", &m);

		_exit(rc < 0 && rc > -256 ? -rc : rc == 0 ? 0 : 255);
	}
	if (close_early) {
		f.sock = accept(f.lsock, NULL, NULL);
		ck_assert_int_ge(f.sock, 0);
	} else {
		fake_attach(&f, status, magic, "check_client");
	}
	mlens_fake_release(&f);
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	mlens_fake_cleanup(&f);
	ck_assert(WIFEXITED(st));
	return -WEXITSTATUS(st);
}

START_TEST(test_open_refused)
{
	ck_assert_int_eq(open_against(-EUSERS, MLENS_WELCOME_MAGIC, false), -EUSERS);
	ck_assert_int_eq(open_against(-EACCES, MLENS_WELCOME_MAGIC, false), -EACCES);
	ck_assert_int_eq(open_against(0, 0x12345678u, false), -EPROTO);
	ck_assert_int_eq(open_against(0, 0, true), -ECONNRESET);
}
END_TEST

START_TEST(test_open_args)
{
	struct mlens *m = (struct mlens *)0x1;
	char longp[200];

	memset(longp, 'a', sizeof(longp) - 1);
	longp[sizeof(longp) - 1] = 0;
	ck_assert_int_eq(mlens_open(NULL, "x", &m), -EINVAL);
	ck_assert_int_eq(mlens_open("", "x", &m), -EINVAL);
	ck_assert_int_eq(mlens_open("/tmp/x", "x", NULL), -EINVAL);
	ck_assert_int_eq(mlens_open(longp, "x", &m), -ENAMETOOLONG);
	ck_assert_int_eq(mlens_open("/nonexistent/mlens/d.sock", "x", &m), -ENOENT);
	ck_assert_ptr_eq(m, (struct mlens *)0x1);	/* untouched */
	ck_assert_int_eq(mlens_fd(NULL), -EINVAL);
	ck_assert_int_eq(mlens_limits(NULL, NULL), -EINVAL);
	ck_assert_int_eq(mlens_poll(NULL, NULL, 1), -EINVAL);
	ck_assert_int_eq(mlens_cancel(NULL, 1), -EINVAL);
	mlens_close(NULL);
}
END_TEST

START_TEST(test_strerror)
{
	ck_assert_ptr_nonnull(strstr(mlens_strerror(-E2BIG), "mlens_limits"));
	ck_assert_str_eq(mlens_strerror(-E2BIG), mlens_strerror(E2BIG));
	ck_assert_ptr_nonnull(strstr(mlens_strerror(-ECONNRESET), "mlensd closed"));
	ck_assert_ptr_nonnull(strstr(mlens_strerror(-ERANGE), "vocabulary"));
	ck_assert_ptr_nonnull(strstr(mlens_strerror(-EDQUOT), "quota"));
	ck_assert_ptr_nonnull(strstr(mlens_strerror(-EUSERS), "tenants"));
	ck_assert_ptr_nonnull(strstr(mlens_strerror(-EPROTO), "update"));
	/* not mlens-specific: the C library's words */
	ck_assert_str_eq(mlens_strerror(-EIO), strerror(EIO));
	ck_assert_str_eq(mlens_strerror(0), "success");
}
END_TEST

/* ==== JSON lines ==== */

static int parse(const char *line, struct mlens_cli_req *r, char *err)
{
	return mlens_cli_request_parse(line, strlen(line), r, err, 256);
}

START_TEST(test_json_request_full)
{
	struct mlens_cli_req r;
	struct mlens_request req;
	char err[256] = "";

	ck_assert_int_eq(parse("{\"prompt\": [1, 2, 3], \"max_tokens\": 5, \"temperature\": 0.7,"
			       " \"top_k\": 40, \"top_p\": 0.9, \"seed\": 12345678901,"
			       " \"stop\": [7, 8], \"logprobs\": true, \"ignore_eos\": true}\n", &r, err), 0);
	ck_assert_str_eq(err, "");
	ck_assert_uint_eq(r.n_prompt, 3);
	ck_assert_int_eq(r.prompt[0], 1);
	ck_assert_int_eq(r.prompt[2], 3);
	ck_assert_uint_eq(r.max_tokens, 5);
	ck_assert_float_eq(r.temperature, 0.7f);
	ck_assert_int_eq(r.top_k, 40);
	ck_assert_float_eq(r.top_p, 0.9f);
	ck_assert_uint_eq(r.seed, 12345678901ull);
	ck_assert_uint_eq(r.n_stop, 2);
	ck_assert_int_eq(r.stop[1], 8);
	ck_assert(r.logprobs);
	ck_assert(r.ignore_eos);
	mlens_cli_request_to_api(&r, &req);
	ck_assert_uint_eq(req.size, sizeof(req));
	ck_assert_ptr_eq(req.prompt, r.prompt);
	ck_assert_uint_eq(req.flags, MLENS_REQ_LOGPROBS | MLENS_REQ_IGNORE_EOS);
	ck_assert_uint_eq(req.n_stop, 2);
	ck_assert_int_eq(req.stop[0], 7);
	mlens_cli_request_free(&r);
	ck_assert_ptr_null(r.prompt);
}
END_TEST

START_TEST(test_json_request_defaults)
{
	struct mlens_cli_req r;
	char err[256];

	ck_assert_int_eq(parse("{\"prompt\":[42]}", &r, err), 0);
	ck_assert_uint_eq(r.n_prompt, 1);
	ck_assert_uint_eq(r.max_tokens, 16);
	ck_assert_float_eq(r.temperature, 0.0f);
	ck_assert_int_eq(r.top_k, 0);
	ck_assert_float_eq(r.top_p, 1.0f);
	ck_assert_uint_eq(r.seed, 0);
	ck_assert_uint_eq(r.n_stop, 0);
	ck_assert(!r.logprobs);
	ck_assert(!r.ignore_eos);
	mlens_cli_request_free(&r);
	/* an integer temperature is a number too */
	ck_assert_int_eq(parse("{\"prompt\":[1],\"temperature\":1}\r\n", &r, err), 0);
	ck_assert_float_eq(r.temperature, 1.0f);
	mlens_cli_request_free(&r);
}
END_TEST

START_TEST(test_json_request_text)
{
	struct mlens_cli_req r;
	char err[256] = "";

	ck_assert_int_eq(parse("{\"prompt\": \"Hi there\", \"stop\": [\"\\n\", 5, \"end\"], "
			       "\"custom_id\": \"q1\"}", &r, err), 0);
	ck_assert_str_eq(r.prompt_text, "Hi there");
	ck_assert_uint_eq(r.prompt_text_len, 8);
	ck_assert_ptr_null(r.prompt);
	ck_assert_uint_eq(r.n_stop_text, 2);
	ck_assert_str_eq(r.stop_text[0], "\n");
	ck_assert_str_eq(r.stop_text[1], "end");
	ck_assert_uint_eq(r.n_stop, 1);
	ck_assert_int_eq(r.stop[0], 5);
	ck_assert_str_eq(r.custom_id, "q1");
	ck_assert_int_eq(r.kind, MLENS_CLI_NATIVE);
	mlens_cli_request_free(&r);
	ck_assert_int_eq(parse("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
			       "\"stop\": \"y\"}", &r, err), 0);
	ck_assert_str_eq(r.messages, "[{\"role\":\"user\",\"content\":\"x\"}]");
	ck_assert_uint_eq(r.n_stop_text, 1);
	mlens_cli_request_free(&r);
	/* OpenAI batch lines: the url picks the kind, body holds the request */
	ck_assert_int_eq(parse("{\"custom_id\": \"c\", \"method\": \"POST\", \"url\": "
			       "\"/v1/chat/completions\", \"body\": {\"model\": \"m\", \"messages\": "
			       "[{\"role\": \"user\", \"content\": \"x\"}], \"max_completion_tokens\": 7, "
			       "\"n\": 1, \"logprobs\": true, \"seed\": 3}}", &r, err), 0);
	ck_assert_int_eq(r.kind, MLENS_CLI_OAI_CHAT);
	ck_assert_str_eq(r.custom_id, "c");
	ck_assert_str_eq(r.model, "m");
	ck_assert_uint_eq(r.max_tokens, 7);
	ck_assert(r.logprobs);
	ck_assert_uint_eq(r.seed, 3);
	mlens_cli_request_free(&r);
	ck_assert_int_eq(parse("{\"custom_id\": \"d\", \"method\": \"POST\", \"url\": "
			       "\"/v1/completions\", \"body\": {\"prompt\": [\"one\"], \"logprobs\": 0, "
			       "\"stop\": null}}", &r, err), 0);
	ck_assert_int_eq(r.kind, MLENS_CLI_OAI_COMPLETION);
	ck_assert_str_eq(r.prompt_text, "one");
	ck_assert(r.logprobs);
	mlens_cli_request_free(&r);
}
END_TEST

START_TEST(test_json_request_bad)
{
	static const struct {
		const char *line, *want;
	} cases[] = {
		{ "", "empty line" },
		{ "{\"prompt\": [1,", "not JSON" },
		{ "[1, 2]", "not a JSON object" },
		{ "{}", "no prompt" },
		{ "{\"prompt\": []}", "prompt is empty" },
		{ "{\"prompt\": {}}", "prompt is not a string or an array" },
		{ "{\"prompt\": \"\"}", "prompt is an empty string" },
		{ "{\"prompt\": [1], \"messages\": [{}]}", "both prompt and messages" },
		{ "{\"messages\": []}", "messages is not a non-empty array" },
		{ "{\"prompt\": [1], \"stop\": [\"\"]}", "stop[0] is an empty string" },
		{ "{\"custom_id\": \"a\", \"method\": \"POST\", \"url\": \"/v1/embeddings\", "
		  "\"body\": {\"prompt\": \"x\"}}", "url \"/v1/embeddings\" is not served" },
		{ "{\"custom_id\": \"a\", \"method\": \"GET\", \"url\": \"/v1/completions\", "
		  "\"body\": {\"prompt\": \"x\"}}", "method is not \"POST\"" },
		{ "{\"custom_id\": \"a\", \"method\": \"POST\", \"url\": \"/v1/completions\", "
		  "\"body\": {\"prompt\": \"x\", \"n\": 0}}", "n is 0, want 1 to 128" },
		{ "{\"custom_id\": \"a\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", "
		  "\"body\": {\"prompt\": \"x\"}}", "unknown field \"prompt\" in body" },
		{ "{\"custom_id\": \"a\", \"method\": \"POST\", \"url\": \"/v1/completions\", "
		  "\"body\": {\"prompt\": \"x\", \"logprobs\": 2}}", "logprobs: only 0" },
		{ "{\"prompt\": [1, -2]}", "prompt[1] is -2" },
		{ "{\"prompt\": [1, 2.5]}", "prompt[1] is not an integer" },
		{ "{\"prompt\": [4294967296]}", "prompt[0] is 4294967296" },
		{ "{\"prompt\": [1], \"max_tokens\": 0}", "max_tokens is 0" },
		{ "{\"prompt\": [1], \"max_tokens\": \"5\"}", "max_tokens is not an integer" },
		{ "{\"prompt\": [1], \"temperature\": -1}", "temperature is -1" },
		{ "{\"prompt\": [1], \"top_p\": 0}", "top_p is 0" },
		{ "{\"prompt\": [1], \"top_p\": 1.5}", "top_p is 1.5" },
		{ "{\"prompt\": [1], \"top_k\": -3}", "top_k is -3" },
		{ "{\"prompt\": [1], \"seed\": -1}", "seed is -1" },
		{ "{\"prompt\": [1], \"stop\": [1,2,3,4,5,6,7,8,9]}", "stop has 9 tokens" },
		{ "{\"prompt\": [1], \"stop\": 5}", "stop is not a string or an array" },
		{ "{\"prompt\": [1], \"logprobs\": 1}", "logprobs is not true or false" },
		{ "{\"prompt\": [1], \"ignore_eos\": \"yes\"}", "ignore_eos is not true or false" },
		{ "{\"prompt\": [1], \"max_token\": 5}", "unknown field \"max_token\"" },
		{ "{\"prompt\": [1], \"prompt\": [2]}", "not JSON" },
	};
	struct mlens_cli_req r;
	char err[256];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		err[0] = 0;
		ck_assert_int_eq(parse(cases[i].line, &r, err), -EINVAL);
		ck_assert_msg(strstr(err, cases[i].want), "line %s: error \"%s\", want \"%s\"",
			      cases[i].line, err, cases[i].want);
		ck_assert_ptr_null(r.prompt);
		ck_assert_ptr_null(r.prompt_text);
		ck_assert_uint_eq(r.n_stop_text, 0);
		/* a batch line keeps its custom_id for the error line */
		if (strstr(cases[i].line, "custom_id"))
			ck_assert_str_eq(r.custom_id, "a");
		mlens_cli_request_free(&r);
	}
}
END_TEST

/* Generated text through the byte-level fixture's tokenizer: a text
 * prompt's ids pushed back as if generated; stop strings cut at the
 * earliest match, even one that began in an earlier token, and text
 * that may begin one is never counted safe (nor half a character). */
START_TEST(test_text_stop)
{
	const char *src = getenv("MLENS_SRCDIR"), *text = "h\xc3\xa9llo w\xc3\xb6rld, h\xc3\xa9llo";
	struct mlens_textgen *m;
	struct mlens_cli_req r;
	struct mlens_textgen_text t;
	char dir[4096], err[512] = "", line[256];
	int rc, hit = 0;

	snprintf(dir, sizeof(dir), "%s/tests/tokenizer/fixtures/bytelevel", src ? src : "..");
	ck_assert_msg(!mlens_textgen_open(dir, &m, err, sizeof(err)), "%s", err);
	snprintf(line, sizeof(line), "{\"prompt\": \"%s\", \"stop\": [\"\xc3\xb6\", \"llo w\"]}", text);
	ck_assert_int_eq(parse(line, &r, err), 0);
	ck_assert_int_eq(mlens_cli_model_prompt(m, &r, err, sizeof(err)), 0);
	ck_assert_uint_gt(r.n_prompt, 3);
	ck_assert_int_eq(mlens_textgen_text_init(&t, m), 0);
	for (uint32_t i = 0; i < r.n_prompt; i++) {
		rc = mlens_textgen_text_push(&t, r.stop_text, r.n_stop_text, r.prompt[i]);
		ck_assert_int_ge(rc, 0);
		if (rc && !hit)
			hit = (int)i + 1;
	}
	ck_assert_int_gt(hit, 0);
	ck_assert_int_eq(mlens_textgen_text_finish(&t, r.stop_text, r.n_stop_text), 1);
	ck_assert_str_eq(t.buf, "h\xc3\xa9");
	ck_assert_uint_eq(t.len, 3);
	ck_assert(t.stopped);
	mlens_textgen_text_free(&t);

	/* no match: the last byte may begin "zz"; safe stays on characters */
	r.stop_text[0][0] = 'z';
	free(r.stop_text[1]);
	r.stop_text[1] = strdup("zz");
	ck_assert_int_eq(mlens_textgen_text_init(&t, m), 0);
	for (uint32_t i = 0; i < r.n_prompt; i++) {
		ck_assert_int_eq(mlens_textgen_text_push(&t, r.stop_text, r.n_stop_text, r.prompt[i]), 0);
		ck_assert_uint_le(t.safe, t.len);
		ck_assert_uint_le(t.safe + 1, t.len > 0 ? t.len : 1);
		if (t.safe < t.len)
			ck_assert_int_ne((unsigned char)t.buf[t.safe] & 0xC0, 0x80);
	}
	ck_assert_int_eq(mlens_textgen_text_finish(&t, r.stop_text, r.n_stop_text), 0);
	ck_assert_str_eq(t.buf, text);
	ck_assert_uint_eq(t.safe, t.len);
	ck_assert(!t.stopped);
	mlens_textgen_text_free(&t);
	mlens_cli_request_free(&r);

	/* a chat without a template is refused with why */
	ck_assert_int_eq(parse("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", &r, err), 0);
	ck_assert_int_eq(mlens_cli_model_prompt(m, &r, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "messages need the model's chat template"));
	mlens_cli_request_free(&r);
	mlens_textgen_free(m);
}
END_TEST

START_TEST(test_json_result_batch)
{
	const int32_t toks[2] = { 5, 6 };
	struct mlens_cli_req q = { .kind = MLENS_CLI_OAI_CHAT, .custom_id = "c1", .model = "m" };
	struct mlens_cli_result r = { .index = 3, .req = &q, .n_prompt = 4, .tokens = toks,
				      .n_tokens = 2, .text = "Hi", .text_len = 2,
				      .finish = MLENS_REASON_STOP };
	json_error_t je;
	json_t *o, *b;
	char *s;

	s = mlens_cli_result_format(&r, 1);
	o = json_loads(s, 0, &je);
	ck_assert_ptr_nonnull(o);
	ck_assert_str_eq(json_string_value(json_object_get(o, "custom_id")), "c1");
	ck_assert(json_is_null(json_object_get(o, "error")));
	b = json_object_get(json_object_get(o, "response"), "body");
	ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(o, "response"),
							    "status_code")), 200);
	ck_assert_str_eq(json_string_value(json_object_get(b, "object")), "chat.completion");
	ck_assert_str_eq(json_string_value(json_object_get(b, "model")), "m");
	ck_assert_str_eq(s + strlen(s) - strlen("\"usage\":{\"prompt_tokens\":4,"
						"\"completion_tokens\":2,\"total_tokens\":6}}},"
						"\"error\":null}"),
			 "\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2,"
			 "\"total_tokens\":6}}},\"error\":null}");
	ck_assert_ptr_nonnull(strstr(s, "\"choices\":[{\"index\":0,\"message\":{\"role\":"
					"\"assistant\",\"content\":\"Hi\"},\"logprobs\":null,"
					"\"finish_reason\":\"stop\"}]"));
	json_decref(o);
	free(s);

	q.kind = MLENS_CLI_OAI_COMPLETION;
	r.finish = MLENS_REASON_ERROR;
	r.error = "url \"/v1/x\" is not served";
	r.bad_request = true;
	s = mlens_cli_result_format(&r, 1);
	ck_assert_ptr_nonnull(strstr(s, "\"custom_id\":\"c1\",\"response\":null,\"error\":"
					"{\"code\":\"invalid_request_error\",\"message\":"
					"\"url \\\"/v1/x\\\" is not served\"}}"));
	free(s);
}
END_TEST

START_TEST(test_json_result)
{
	const int32_t toks[3] = { 5, 6, 7 };
	const float lps[3] = { -0.5f, -1.25f, -2.0f };
	struct mlens_cli_result r = { .index = 12, .tokens = toks, .n_tokens = 3,
				      .finish = MLENS_REASON_STOP };
	json_error_t je;
	json_t *o;
	char *s;

	s = mlens_cli_result_format(&r, 1);
	ck_assert_ptr_nonnull(s);
	ck_assert_str_eq(s, "{\"index\":12,\"tokens\":[5,6,7],\"finish_reason\":\"stop\"}");
	free(s);

	r.logprobs = lps;
	r.finish = MLENS_REASON_LENGTH;
	s = mlens_cli_result_format(&r, 1);
	o = json_loads(s, 0, &je);
	ck_assert_ptr_nonnull(o);
	ck_assert_str_eq(json_string_value(json_object_get(o, "finish_reason")), "length");
	ck_assert_uint_eq(json_array_size(json_object_get(o, "logprobs")), 3);
	ck_assert_double_eq(json_real_value(json_array_get(json_object_get(o, "logprobs"), 1)),
			    -1.25);
	ck_assert_ptr_null(json_object_get(o, "error"));
	json_decref(o);
	free(s);

	r.logprobs = NULL;
	r.n_tokens = 0;
	r.finish = MLENS_REASON_ERROR;
	r.error = "prompt is empty";
	s = mlens_cli_result_format(&r, 1);
	ck_assert_str_eq(s, "{\"index\":12,\"tokens\":[],\"finish_reason\":\"error\","
			 "\"error\":\"prompt is empty\"}");
	free(s);
	r.error = "bad \xff byte";	/* not UTF-8: still a JSON line */
	s = mlens_cli_result_format(&r, 1);
	ck_assert_ptr_nonnull(s);
	ck_assert_ptr_nonnull(strstr(s, "not valid UTF-8"));
	free(s);

	ck_assert_str_eq(mlens_cli_finish_name(MLENS_REASON_CANCELLED), "cancelled");
	ck_assert_str_eq(mlens_cli_finish_name(99), "error");
}
END_TEST

static Suite *client_suite(void)
{
	Suite *s = suite_create("client");
	TCase *t = tcase_create("api");
	TCase *d = tcase_create("fake_daemon");
	TCase *j = tcase_create("jsonl");

	tcase_add_test(t, test_open_args);
	tcase_add_test(t, test_strerror);
	suite_add_tcase(s, t);

	tcase_set_timeout(d, 30);
	tcase_add_test(d, test_basic);
	tcase_add_test(d, test_pressure);
	tcase_add_test(d, test_nowait);
	tcase_add_test(d, test_cancel);
	tcase_add_test(d, test_hangup);
	tcase_add_test(d, test_hangup_idle);
	tcase_add_test(d, test_fdloop);
	tcase_add_test(d, test_open_refused);
	tcase_add_test(d, test_cli);
	tcase_add_test(d, test_cli_status);
	suite_add_tcase(s, d);

	tcase_add_test(j, test_json_request_full);
	tcase_add_test(j, test_json_request_defaults);
	tcase_add_test(j, test_json_request_text);
	tcase_add_test(j, test_json_request_bad);
	tcase_add_test(j, test_json_result_batch);
	tcase_add_test(j, test_text_stop);
	tcase_add_test(j, test_json_result);
	suite_add_tcase(s, j);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(client_suite());
	int failed;

	signal(SIGPIPE, SIG_IGN);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
