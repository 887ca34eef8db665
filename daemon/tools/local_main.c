/* mlens-local: run the engine in-process on a model directory (no daemon):
 * a batch of deterministic pseudo-random prompts, greedy or sampled
 * generation, the tokens and the throughput. For the demo and for
 * measuring the bare engine. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "daemon/exec/engine.h"
#include "daemon/tools/toolopt.h"

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: mlens-local --model DIR [--backend cpu|cuda|auto] [--prompts N]\n"
		   "                   [--prompt-len L] [--max-tokens G] [--temperature T]\n"
		   "                   [--seed S] [--threads N] [--quiet]\n");
}

static long parse_num(const char *opt, const char *s, long lo, long hi)
{
	return mlens_tool_num("mlens-local", opt, s, lo, hi);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "backend", required_argument, NULL, 'b' },
		{ "prompts", required_argument, NULL, 'n' },
		{ "prompt-len", required_argument, NULL, 'p' },
		{ "max-tokens", required_argument, NULL, 'g' },
		{ "temperature", required_argument, NULL, 't' },
		{ "seed", required_argument, NULL, 's' },
		{ "threads", required_argument, NULL, 'j' },
		{ "quiet", no_argument, NULL, 'q' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 }
	};
	const char *dir = NULL, *backend = "cpu";
	long n = 8, plen = 16, g = 32, seed = 1, threads = 0;
	float temp = 0.0f;
	int quiet = 0, c, rc;
	char err[512];
	struct mlens_model *m = NULL;
	struct mlens_backend be = { 0 };
	struct mlens_engine *e = NULL;
	struct mlens_backend_opts bo;

	while ((c = getopt_long(argc, argv, "m:b:n:p:g:t:s:j:qh", opts, NULL)) != -1) {
		switch (c) {
		case 'm': dir = optarg; break;
		case 'b': backend = optarg; break;
		case 'n': n = parse_num("--prompts", optarg, 1, 4096); break;
		case 'p': plen = parse_num("--prompt-len", optarg, 1, 1 << 20); break;
		case 'g': g = parse_num("--max-tokens", optarg, 1, 1 << 20); break;
		case 't': temp = strtof(optarg, NULL); break;
		case 's': seed = parse_num("--seed", optarg, 0, 1L << 40); break;
		case 'j': threads = parse_num("--threads", optarg, 0, 4096); break;
		case 'q': quiet = 1; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (!dir) {
		usage(stderr);
		return 2;
	}
	rc = mlens_model_open(dir, &m, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "mlens-local: %s\n", err);
		return 1;
	}
	bo.n_threads = (int)threads;
	bo.device = 0;
	bo.numa_node = 0;
	bo.n_reserved = 0;
	rc = mlens_backend_create(&be, backend, &bo);
	if (rc) {
		fprintf(stderr, "mlens-local: cannot start the %s backend: %s\n", backend, strerror(-rc));
		return 1;
	}
	{
		struct mlens_engine_opts eo = { .kv_block_size = 16, .kv_dtype = -1 };
		int64_t per = (plen + g + 15) / 16;
		eo.kv_blocks = (uint32_t)(per * n);
		eo.max_step_tokens = (int)(n * plen > 4096 ? n * plen : 4096);
		rc = mlens_engine_create(&e, m, &be, &eo, err, sizeof(err));
		if (rc) {
			fprintf(stderr, "mlens-local: %s\n", err);
			return 1;
		}
	}
	printf("model %s: %lld layers, hidden %lld, %lld experts (top-%lld), vocab %lld, %s, %.1f MB; backend %s\n",
	       dir, (long long)m->cfg.num_hidden_layers, (long long)m->cfg.hidden_size,
	       (long long)m->cfg.num_local_experts, (long long)m->cfg.num_experts_per_tok,
	       (long long)m->cfg.vocab_size, mlens_dtype_name(m->cfg.dtype), m->weight_bytes / 1e6,
	       be.ops->name);

	struct mlens_seq *seqs = calloc((size_t)n, sizeof(*seqs));
	struct mlens_engine_req *reqs = calloc((size_t)n, sizeof(*reqs));
	int32_t *prompts = malloc((size_t)(n * plen) * sizeof(int32_t));
	int32_t *out = malloc((size_t)(n * g) * sizeof(int32_t));
	uint64_t x = (uint64_t)seed * 0x9e3779b97f4a7c15ull + 1;
	for (long i = 0; i < n * plen; i++) {
		x ^= x << 13; x ^= x >> 7; x ^= x << 17;
		prompts[i] = (int32_t)(x % (uint64_t)m->cfg.vocab_size);
	}
	for (long i = 0; i < n; i++) {
		reqs[i].seq = &seqs[i];
		reqs[i].tokens = prompts + i * plen;
		reqs[i].n_tokens = (int)plen;
		reqs[i].samp.temperature = temp;
		reqs[i].samp.seed = (uint64_t)(seed + i);
	}
	double t0 = now(), t1 = 0;
	for (long step = 0; step < g; step++) {
		for (long i = 0; i < n; i++)
			reqs[i].samp.counter = (uint64_t)step;
		rc = mlens_engine_step(e, reqs, (int)n);
		if (rc) {
			fprintf(stderr, "mlens-local: step %ld failed: %s\n", step, strerror(-rc));
			return 1;
		}
		for (long i = 0; i < n; i++) {
			out[i * g + step] = reqs[i].next_token;
			reqs[i].tokens = &out[i * g + step];
			reqs[i].n_tokens = 1;
		}
		if (step == 0)
			t1 = now();
	}
	double t2 = now();
	if (!quiet)
		for (long i = 0; i < n; i++) {
			printf("[%ld] prompt %ld tokens -> ", i, plen);
			for (long j = 0; j < g; j++)
				printf("%d%s", out[i * g + j], j + 1 < g ? " " : "\n");
		}
	printf("prefill: %ld tokens in %.3f s (%.1f tokens/s)\n", n * plen, t1 - t0, n * plen / (t1 - t0));
	if (g > 1)
		printf("decode:  %ld tokens in %.3f s (%.1f tokens/s, batch %ld)\n", n * (g - 1), t2 - t1,
		       n * (g - 1) / (t2 - t1), n);
	printf("total:   %ld generated tokens in %.3f s (%.1f tokens/s)\n", n * g, t2 - t0, n * g / (t2 - t0));
	for (long i = 0; i < n; i++)
		mlens_seq_fini(mlens_engine_kv(e), &seqs[i]);
	free(seqs);
	free(reqs);
	free(prompts);
	free(out);
	mlens_engine_destroy(e);
	mlens_backend_destroy(&be);
	mlens_model_close(m);
	return 0;
}
