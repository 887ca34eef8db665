/* mlens-bench client: libmlens against the fake mlensd (tests/fake_mlensd.c)
 * in a forked process, so the numbers are the library's and the protocol's
 * cost with a daemon that answers at once: tokens (events) per second with
 * many requests in flight, and the round trip of a one-token request. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "client/mlens.h"
#include "shm/attach.h"
#include "tests/bench/bench.h"
#include "tests/fake_mlensd.h"

#define EVENT_BATCH 256

struct client_result {
	double tokens_per_s, requests_per_s;
	double rtt_p50_us, rtt_p99_us;
	uint64_t tokens;
};

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* Keep `inflight` requests of max_tokens tokens going until n are done. */
static int throughput(struct mlens *m, long long n, long long inflight, uint32_t prompt_len,
		      uint32_t max_tokens, struct client_result *res)
{
	struct mlens_event ev[EVENT_BATCH];
	struct mlens_request req = { .size = sizeof(req) };
	int32_t *prompt = calloc(prompt_len, sizeof(*prompt));
	long long sent = 0, done = 0, running = 0;
	uint64_t t0, tokens = 0, id;
	int rc = 0;

	if (!prompt)
		return -ENOMEM;
	for (uint32_t i = 0; i < prompt_len; i++)
		prompt[i] = (int32_t)(i * 31 % 1000);
	req.prompt = prompt;
	req.n_prompt = prompt_len;
	req.max_tokens = max_tokens;
	req.timeout_ms = 0;
	t0 = mlens_bench_now_ns();
	while (done < n) {
		while (sent < n && running < inflight) {
			rc = mlens_submit(m, &req, &id);
			if (rc == -EAGAIN)
				break;
			if (rc)
				goto out;
			sent++;
			running++;
		}
		int k = mlens_wait(m, ev, EVENT_BATCH, rc == -EAGAIN ? 1 : 1000);

		if (k < 0) {
			rc = k;
			goto out;
		}
		for (int i = 0; i < k; i++) {
			tokens += !!(ev[i].flags & MLENS_EV_TOKEN);
			if (ev[i].flags & MLENS_EV_LAST) {
				done++;
				running--;
			}
		}
		rc = 0;
	}
	double s = (mlens_bench_now_ns() - t0) / 1e9;

	res->tokens = tokens;
	res->tokens_per_s = tokens / s;
	res->requests_per_s = n / s;
out:
	free(prompt);
	return rc;
}

/* One one-token request at a time: submit to its LAST event. */
static int round_trips(struct mlens *m, long long n, struct client_result *res)
{
	struct mlens_request req = { .size = sizeof(req) };
	int32_t prompt[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
	uint64_t *lat = malloc((size_t)n * sizeof(*lat)), id;
	struct mlens_event ev[4];
	int rc = 0;

	if (!lat)
		return -ENOMEM;
	req.prompt = prompt;
	req.n_prompt = 8;
	req.max_tokens = 1;
	req.timeout_ms = -1;
	for (long long i = 0; i < n; i++) {
		uint64_t t = mlens_bench_now_ns();
		bool last = false;

		rc = mlens_submit(m, &req, &id);
		while (!rc && !last) {
			int k = mlens_wait(m, ev, 4, 1000);

			if (k <= 0)
				rc = k ? k : -ETIMEDOUT;
			for (int j = 0; j < k; j++)
				last |= ev[j].id == id && (ev[j].flags & MLENS_EV_LAST);
		}
		if (rc)
			goto out;
		lat[i] = mlens_bench_now_ns() - t;
	}
	qsort(lat, (size_t)n, sizeof(*lat), cmp_u64);
	res->rtt_p50_us = lat[(n - 1) / 2] / 1e3;
	res->rtt_p99_us = lat[(size_t)((n - 1) * 0.99)] / 1e3;
out:
	free(lat);
	return rc;
}

static void client_usage(FILE *f)
{
	fprintf(f, "usage: mlens-bench client [--json] [--requests N] [--max-tokens T] "
		"[--prompt P] [--inflight I] [--round-trips R]\n"
		"  --requests N     requests in the throughput run (default 20000)\n"
		"  --max-tokens T   tokens each generates (default 16)\n"
		"  --prompt P       prompt tokens each (default 32)\n"
		"  --inflight I     requests in flight (default 256)\n"
		"  --round-trips R  one-token requests timed one at a time (default 5000)\n"
		"  --json           print JSON instead of a table\n");
}

int mlens_bench_client(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "json", no_argument, NULL, 'j' },
		{ "requests", required_argument, NULL, 'n' },
		{ "max-tokens", required_argument, NULL, 't' },
		{ "prompt", required_argument, NULL, 'p' },
		{ "inflight", required_argument, NULL, 'i' },
		{ "round-trips", required_argument, NULL, 'r' },
		{ "help", no_argument, NULL, 'h' },
		{ 0 },
	};
	long long n = 20000, tokens = 16, plen = 32, inflight = 256, rounds = 5000, v;
	static struct mlens_fake f;
	struct client_result res = { 0 };
	struct mlens *m;
	int json = 0, c, err, st;
	pid_t pid;

	optind = 1;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'j':
			json = 1;
			break;
		case 'n': case 't': case 'p': case 'i': case 'r':
			v = mlens_bench_parse_count(optarg);
			if (v <= 0 || ((c == 't' || c == 'p') && v > 2048)) {
				fprintf(stderr, "mlens-bench client: bad value '%s' for --%s\n", optarg,
					opts[strchr("jntpir", c) - "jntpir"].name);
				return 2;
			}
			*(c == 'n' ? &n : c == 't' ? &tokens : c == 'p' ? &plen :
			  c == 'i' ? &inflight : &rounds) = v;
			break;
		case 'h':
			client_usage(stdout);
			return 0;
		default:
			client_usage(stderr);
			return 2;
		}
	}

	f.limits = (struct mlens_region_limits){ .max_prompt_tokens = 2048, .max_tokens = 2048,
						 .max_context = 4096, .vocab_size = 32000 };
	err = mlens_fake_listen(&f);
	if (err) {
		fprintf(stderr, "mlens-bench client: fake daemon socket: %s\n", strerror(-err));
		return 1;
	}
	pid = fork();
	if (pid < 0) {
		perror("mlens-bench client: fork");
		mlens_fake_cleanup(&f);
		return 1;
	}
	if (pid == 0) {
		err = mlens_fake_accept(&f, 0, MLENS_WELCOME_MAGIC);
		if (!err)
			err = mlens_fake_serve(&f);
		_exit(err ? 1 : 0);
	}
	err = mlens_open(f.path, "mlens-bench", &m);
	if (!err) {
		err = throughput(m, n, inflight, (uint32_t)plen, (uint32_t)tokens, &res);
		if (!err)
			err = round_trips(m, rounds, &res);
		mlens_close(m);
	}
	if (err)
		kill(pid, SIGTERM);
	waitpid(pid, &st, 0);
	mlens_fake_cleanup(&f);
	if (err) {
		fprintf(stderr, "mlens-bench client: %s\n", mlens_strerror(err));
		return 1;
	}
	if (json) {
		printf("{\"bench\": \"client\", \"requests\": %lld, \"prompt_tokens\": %lld, "
		       "\"max_tokens\": %lld, \"inflight\": %lld,\n", n, plen, tokens, inflight);
		printf(" \"tokens\": %llu, \"tokens_per_s\": %.0f, \"requests_per_s\": %.0f,\n",
		       (unsigned long long)res.tokens, res.tokens_per_s, res.requests_per_s);
		printf(" \"round_trip_us\": {\"requests\": %lld, \"p50\": %.2f, \"p99\": %.2f}}\n",
		       rounds, res.rtt_p50_us, res.rtt_p99_us);
	} else {
		printf("client: libmlens against a fake daemon in another process\n");
		printf("  %lld requests x %lld tokens, %lld in flight: %.2f M tokens/s, "
		       "%.0f requests/s\n", n, tokens, inflight, res.tokens_per_s / 1e6,
		       res.requests_per_s);
		printf("  one-token request round trip: p50 %.1f us, p99 %.1f us (%lld requests)\n",
		       res.rtt_p50_us, res.rtt_p99_us, rounds);
	}
	return 0;
}
