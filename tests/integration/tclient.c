/* A tenant for the integration tests, on the public libmlens API: submits
 * deterministic requests (each runs to max-tokens, past the model's EOS:
 * the tests load the daemon by length), reads every event, prints one line per request
 * ("INDEX FINISH STATUS TOKENS...") in request order. Modes for the bad
 * cases: --no-read (never reads its completions), --die-after N (SIGKILLs
 * itself after N events); --why adds "INDEX why TEXT" after a failed
 * request's line (mlens_event_strerror). Exit: 0 all requests ended with length or stop,
 * 1 some did not, 3 cannot attach. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "mlens.h"

struct res {
	uint64_t id;
	int32_t *tok;
	int n;
	int finish;
	int status;
	int done;
	char why[256];
};

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "requests", required_argument, NULL, 'n' },
		{ "seed", required_argument, NULL, 'S' },
		{ "prompt-len", required_argument, NULL, 'p' },
		{ "max-tokens", required_argument, NULL, 'g' },
		{ "temperature", required_argument, NULL, 't' },
		{ "no-read", no_argument, NULL, 'R' },
		{ "die-after", required_argument, NULL, 'd' },
		{ "timeout", required_argument, NULL, 'T' },
		{ "why", no_argument, NULL, 'W' },
		{ NULL, 0, NULL, 0 }
	};
	const char *sock = NULL;
	int n = 4, plen = 12, g = 16, no_read = 0, die_after = -1, timeout_s = 120, why = 0, c, rc;
	unsigned seed = 1;
	float temp = 0.0f;
	struct mlens *m;
	struct mlens_limits lim = { .size = sizeof(lim) };
	struct res *r;
	int events = 0, left;

	while ((c = getopt_long(argc, argv, "s:n:S:p:g:t:Rd:T:W", opts, NULL)) != -1) {
		switch (c) {
		case 's': sock = optarg; break;
		case 'n': n = atoi(optarg); break;
		case 'S': seed = (unsigned)strtoul(optarg, NULL, 10); break;
		case 'p': plen = atoi(optarg); break;
		case 'g': g = atoi(optarg); break;
		case 't': temp = strtof(optarg, NULL); break;
		case 'R': no_read = 1; break;
		case 'd': die_after = atoi(optarg); break;
		case 'T': timeout_s = atoi(optarg); break;
		case 'W': why = 1; break;
		default: return 2;
		}
	}
	rc = mlens_open(sock, "tclient", &m);
	if (rc) {
		printf("attach: %d %s\n", rc, mlens_strerror(rc));
		return 3;
	}
	mlens_limits(m, &lim);
	r = calloc((size_t)n, sizeof(*r));
	for (int i = 0; i < n; i++) {
		int32_t *p = malloc((size_t)plen * sizeof(int32_t));
		struct mlens_request q;
		unsigned x = seed * 7919u + (unsigned)i * 104729u + 1;
		for (int j = 0; j < plen; j++) {
			x = x * 1103515245u + 12345u;
			p[j] = (int32_t)((x >> 8) % lim.vocab_size);
		}
		memset(&q, 0, sizeof(q));
		q.size = sizeof(q);
		q.prompt = p;
		q.n_prompt = (uint32_t)plen;
		q.max_tokens = (uint32_t)g;
		q.flags = MLENS_REQ_IGNORE_EOS;
		q.temperature = temp;
		q.top_p = 1.0f;
		q.seed = seed * 1000u + (unsigned)i;
		q.timeout_ms = -1;
		rc = mlens_submit(m, &q, &r[i].id);
		free(p);
		if (rc) {
			printf("%d submit-error %d %s\n", i, rc, mlens_strerror(rc));
			r[i].done = 1;
			r[i].status = rc;
		}
		r[i].tok = malloc((size_t)g * sizeof(int32_t));
	}
	if (no_read) {
		/* hold the connection open, read nothing, until killed */
		for (;;)
			pause();
	}
	left = 0;
	for (int i = 0; i < n; i++)
		left += !r[i].done;
	while (left > 0) {
		struct mlens_event ev[64];
		int k = mlens_wait(m, ev, 64, timeout_s * 1000);
		if (k <= 0) {
			printf("wait: %d %s\n", k, k ? mlens_strerror(k) : "timeout");
			break;
		}
		for (int e = 0; e < k; e++) {
			struct res *x = NULL;
			for (int i = 0; i < n; i++)
				if (r[i].id == ev[e].id)
					x = &r[i];
			if (!x) {
				printf("unknown request id %llu\n", (unsigned long long)ev[e].id);
				return 1;
			}
			if ((ev[e].flags & MLENS_EV_TOKEN) && x->n < g)
				x->tok[x->n++] = ev[e].token;
			if (ev[e].flags & MLENS_EV_LAST) {
				x->finish = (int)ev[e].finish;
				x->status = ev[e].status;
				x->done = 1;
				if (ev[e].finish == MLENS_REASON_ERROR)
					snprintf(x->why, sizeof(x->why), "%s", mlens_event_strerror(m, &ev[e]));
				left--;
			}
			if (++events == die_after)
				kill(getpid(), SIGKILL);
		}
	}
	rc = 0;
	for (int i = 0; i < n; i++) {
		printf("%d %d %d", i, r[i].finish, r[i].status);
		for (int j = 0; j < r[i].n; j++)
			printf(" %d", r[i].tok[j]);
		printf("\n");
		if (why && r[i].why[0])
			printf("%d why %s\n", i, r[i].why);
		if (r[i].finish != MLENS_REASON_LENGTH && r[i].finish != MLENS_REASON_STOP)
			rc = 1;
		free(r[i].tok);
	}
	free(r);
	mlens_close(m);
	return rc;
}
