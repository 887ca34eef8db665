/* mlens-kvcompare: the accuracy of the fp8 KV cache. One model and the same
 * prompts run through the engine in-process twice, with a reference KV
 * dtype (bf16, or fp32) and with fp8 (or another test dtype); the test run is fed the reference
 * run's greedy tokens (teacher forcing), so every position compares the
 * two caches on the same context. Prints a table and a JSON object: greedy
 * agreement (per token, first token, whole sequences) and the mean and
 * largest absolute difference of the log-probabilities the two runs give
 * the reference's greedy tokens. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/exec/engine.h"
#include "daemon/tools/toolopt.h"
#include "daemon/serve/worker.h"

struct kvc_opts {
	const char *dir, *backend, *json, *prompt_file;
	long n, plen, gen, batch, seed, threads;
	int ref_dtype, test_dtype;
};

/* The prompts: n of them, prompt i at tok + off[i], len[i] tokens. */
struct kvc_prompts {
	int32_t *tok;
	size_t *off;
	int *len;
	long n;
	int max_len;
};

/* One run's record per (prompt, position): the greedy token, and the
 * log-probability of the token the reference chose there. */
struct kvc_run {
	int32_t *greedy;
	float *lp;
	double seconds;
	size_t token_bytes;	/* KV bytes a token, K and V, all layers */
	uint32_t blocks;
};

static void usage(FILE *f)
{
	fprintf(f, "usage: mlens-kvcompare --model DIR [--backend cpu|cuda|auto] [--prompts N]\n"
		   "                       [--prompt-len L] [--prompt-file FILE] [--gen G] [--batch B]\n"
		   "                       [--reference bf16|fp32] [--test fp8|bf16|fp32] [--seed S]\n"
		   "                       [--threads N] [--json FILE]\n"
		   "Runs the model with a bf16 (or fp32) KV cache and with an fp8 one on the same\n"
		   "prompts (the test run follows the reference's greedy tokens) and prints greedy\n"
		   "agreement and the mean |log-probability difference|, as a table and as JSON.\n"
		   "--prompt-file: one prompt a line, token ids separated by spaces. --test bf16\n"
		   "against --reference bf16 is the control (agreement 1, difference 0).\n");
}

static long parse_num(const char *opt, const char *s, long lo, long hi)
{
	return mlens_tool_num("mlens-kvcompare", opt, s, lo, hi);
}

/* A KV dtype named on the command line. */
static int parse_kv_dtype(const char *opt, const char *s)
{
	if (!strcmp(s, "bf16"))
		return MLENS_DTYPE_BF16;
	if (!strcmp(s, "fp32"))
		return MLENS_DTYPE_F32;
	if (!strcmp(s, "fp8"))
		return MLENS_DTYPE_E4M3;
	fprintf(stderr, "mlens-kvcompare: %s wants bf16, fp32 or fp8, got '%s'\n", opt, s);
	exit(2);
}

/* n pseudo-random prompts of plen tokens (ids 3.. to keep clear of the
 * usual special ids), or the lines of o->prompt_file. */
static int make_prompts(struct kvc_prompts *p, const struct kvc_opts *o, int64_t vocab)
{
	memset(p, 0, sizeof(*p));
	if (!o->prompt_file) {
		uint64_t x = (uint64_t)o->seed * 0x9e3779b97f4a7c15ull + 1;
		p->n = o->n;
		p->max_len = (int)o->plen;
		p->tok = malloc((size_t)(o->n * o->plen) * sizeof(int32_t));
		p->off = malloc((size_t)o->n * sizeof(size_t));
		p->len = malloc((size_t)o->n * sizeof(int));
		if (!p->tok || !p->off || !p->len)
			return -ENOMEM;
		for (long i = 0; i < o->n; i++) {
			p->off[i] = (size_t)(i * o->plen);
			p->len[i] = (int)o->plen;
			for (long j = 0; j < o->plen; j++) {
				x ^= x << 13;
				x ^= x >> 7;
				x ^= x << 17;
				p->tok[i * o->plen + j] = (int32_t)(3 + x % (uint64_t)(vocab > 3 ? vocab - 3 : 1));
			}
		}
		return 0;
	}
	FILE *f = fopen(o->prompt_file, "r");
	char line[1 << 16];
	size_t cap = 0, used = 0, pcap = 0;
	if (!f) {
		fprintf(stderr, "mlens-kvcompare: cannot open %s: %s\n", o->prompt_file, strerror(errno));
		return -errno;
	}
	while (fgets(line, sizeof(line), f) && (o->n <= 0 || p->n < o->n)) {
		char *s = line, *end;
		int len = 0;
		if ((size_t)p->n == pcap) {
			pcap = pcap ? 2 * pcap : 256;
			p->off = realloc(p->off, pcap * sizeof(size_t));
			p->len = realloc(p->len, pcap * sizeof(int));
			if (!p->off || !p->len)
				return -ENOMEM;
		}
		p->off[p->n] = used;
		for (;;) {
			long v = strtol(s, &end, 10);
			if (end == s)
				break;
			if (v < 0 || v >= vocab) {
				fprintf(stderr, "mlens-kvcompare: %s line %ld: token id %ld is outside the "
					"vocabulary (0..%lld)\n", o->prompt_file, p->n + 1, v,
					(long long)vocab - 1);
				fclose(f);
				return -EINVAL;
			}
			if (used == cap) {
				cap = cap ? 2 * cap : 4096;
				p->tok = realloc(p->tok, cap * sizeof(int32_t));
				if (!p->tok)
					return -ENOMEM;
			}
			p->tok[used++] = (int32_t)v;
			len++;
			s = end;
		}
		if (!len)
			continue;	/* blank line */
		p->len[p->n++] = len;
		p->max_len = len > p->max_len ? len : p->max_len;
	}
	fclose(f);
	if (!p->n) {
		fprintf(stderr, "mlens-kvcompare: %s holds no prompt\n", o->prompt_file);
		return -EINVAL;
	}
	return 0;
}

/* The greedy token of a row of logits and log-probability of token t. */
static int32_t row_greedy(const float *l, int64_t vocab, int32_t t, float *lp_t)
{
	int32_t best = 0;
	double sum = 0.0;
	for (int64_t v = 1; v < vocab; v++)
		if (l[v] > l[best])
			best = (int32_t)v;
	for (int64_t v = 0; v < vocab; v++)
		sum += exp((double)l[v] - (double)l[best]);
	*lp_t = (float)((double)l[t < 0 ? best : t] - (double)l[best] - log(sum));
	return best;
}

/* One run with KV dtype kv_dtype. ref: the reference's greedy tokens,
 * followed and scored; NULL for the reference run, which follows its own. */
static int run(const struct mlens_model *m, struct mlens_backend *be, int kv_dtype,
	       const struct kvc_opts *o, const struct kvc_prompts *p, const int32_t *ref,
	       struct kvc_run *r)
{
	const int64_t V = m->cfg.vocab_size;
	const long G = o->gen, B = o->batch < p->n ? o->batch : p->n;
	struct mlens_engine_opts eo = { .kv_block_size = 16, .kv_dtype = kv_dtype };
	struct mlens_engine *e = NULL;
	struct mlens_seq *seqs = calloc((size_t)B, sizeof(*seqs));
	struct mlens_engine_req *reqs = calloc((size_t)B, sizeof(*reqs));
	float *logits = malloc((size_t)B * (size_t)V * sizeof(float));
	char err[512];
	int rc = -ENOMEM;
	double t0;

	r->greedy = malloc((size_t)(p->n * G) * sizeof(int32_t));
	r->lp = malloc((size_t)(p->n * G) * sizeof(float));
	if (!seqs || !reqs || !logits || !r->greedy || !r->lp)
		goto out;
	eo.kv_blocks = (uint32_t)(B * ((p->max_len + G + 15) / 16 + 1));
	eo.max_step_tokens = (int)(B * p->max_len > 4096 ? B * p->max_len : 4096);
	if ((rc = mlens_engine_create(&e, m, be, &eo, err, sizeof(err)))) {
		fprintf(stderr, "mlens-kvcompare: %s\n", err);
		goto out;
	}
	r->token_bytes = 2 * mlens_kv_token_bytes(&mlens_engine_kv(e)->cache);
	r->blocks = mlens_engine_kv(e)->cache.n_blocks;
	t0 = mlens_now();
	for (long a = 0; a < p->n; a += B) {
		long nb = p->n - a < B ? p->n - a : B;
		for (long s = 0; s < G; s++) {
			for (long i = 0; i < nb; i++) {
				long q = a + i;
				reqs[i].seq = &seqs[i];
				reqs[i].logits = logits + (size_t)i * (size_t)V;
				reqs[i].samp = (struct mlens_sampling){ 0 };
				if (!s) {
					reqs[i].tokens = p->tok + p->off[q];
					reqs[i].n_tokens = p->len[q];
				} else {	/* the reference's token, in both runs */
					reqs[i].tokens = (ref ? ref : r->greedy) + q * G + s - 1;
					reqs[i].n_tokens = 1;
				}
			}
			if ((rc = mlens_engine_step(e, reqs, (int)nb))) {
				fprintf(stderr, "mlens-kvcompare: step %ld of prompts %ld..%ld failed: %s\n",
					s, a, a + nb - 1, strerror(-rc));
				goto out;
			}
			for (long i = 0; i < nb; i++) {
				size_t x = (size_t)((a + i) * G + s);
				r->greedy[x] = row_greedy(logits + (size_t)i * (size_t)V, V,
							  ref ? ref[x] : -1, &r->lp[x]);
			}
		}
		for (long i = 0; i < nb; i++)
			mlens_seq_release(mlens_engine_kv(e), &seqs[i]);
	}
	r->seconds = mlens_now() - t0;
	rc = 0;
out:
	if (e) {
		for (long i = 0; i < B; i++)
			mlens_seq_fini(mlens_engine_kv(e), &seqs[i]);
		mlens_engine_destroy(e);
	}
	free(seqs);
	free(reqs);
	free(logits);
	return rc;
}

int main(int argc, char **argv)
{
	static const struct option lopts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "backend", required_argument, NULL, 'b' },
		{ "prompts", required_argument, NULL, 'n' },
		{ "prompt-len", required_argument, NULL, 'p' },
		{ "prompt-file", required_argument, NULL, 'f' },
		{ "gen", required_argument, NULL, 'g' },
		{ "batch", required_argument, NULL, 'B' },
		{ "reference", required_argument, NULL, 'r' },
		{ "test", required_argument, NULL, 't' },
		{ "seed", required_argument, NULL, 's' },
		{ "threads", required_argument, NULL, 'j' },
		{ "json", required_argument, NULL, 'J' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 }
	};
	struct kvc_opts o = { .backend = "cpu", .n = 256, .plen = 32, .gen = 16, .batch = 32,
			      .seed = 1, .ref_dtype = MLENS_DTYPE_BF16, .test_dtype = MLENS_DTYPE_E4M3 };
	struct mlens_model *m = NULL;
	struct mlens_backend be = { 0 };
	struct mlens_backend_opts bo;
	struct kvc_prompts pr;
	struct kvc_run ref = { 0 }, tst = { 0 };
	char err[512];
	int c, rc;

	while ((c = getopt_long(argc, argv, "m:b:n:p:f:g:B:r:t:s:j:J:h", lopts, NULL)) != -1) {
		switch (c) {
		case 'm': o.dir = optarg; break;
		case 'b': o.backend = optarg; break;
		case 'n': o.n = parse_num("--prompts", optarg, 1, 1 << 20); break;
		case 'p': o.plen = parse_num("--prompt-len", optarg, 1, 1 << 20); break;
		case 'f': o.prompt_file = optarg; break;
		case 'g': o.gen = parse_num("--gen", optarg, 1, 1 << 20); break;
		case 'B': o.batch = parse_num("--batch", optarg, 1, 4096); break;
		case 's': o.seed = parse_num("--seed", optarg, 0, 1L << 40); break;
		case 'j': o.threads = parse_num("--threads", optarg, 0, 4096); break;
		case 'J': o.json = optarg; break;
		case 'r': o.ref_dtype = parse_kv_dtype("--reference", optarg); break;
		case 't': o.test_dtype = parse_kv_dtype("--test", optarg); break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (!o.dir) {
		usage(stderr);
		return 2;
	}
	if ((rc = mlens_model_open(o.dir, &m, err, sizeof(err)))) {
		fprintf(stderr, "mlens-kvcompare: %s\n", err);
		return 1;
	}
	if (make_prompts(&pr, &o, m->cfg.vocab_size))
		return 1;
	memset(&bo, 0, sizeof(bo));
	bo.n_threads = (int)o.threads;
	if ((rc = mlens_backend_create(&be, o.backend, &bo))) {
		fprintf(stderr, "mlens-kvcompare: cannot start the %s backend: %s\n", o.backend,
			strerror(-rc));
		return 1;
	}
	if (run(m, &be, o.ref_dtype, &o, &pr, NULL, &ref) ||
	    run(m, &be, o.test_dtype, &o, &pr, ref.greedy, &tst))
		return 1;

	{
		const long N = pr.n, G = o.gen;
		long agree = 0, first = 0, seqs = 0;
		double sum = 0.0, mx = 0.0;
		for (long i = 0; i < N; i++) {
			int all = 1;
			for (long s = 0; s < G; s++) {
				size_t x = (size_t)(i * G + s);
				double d = fabs((double)ref.lp[x] - (double)tst.lp[x]);
				int same = ref.greedy[x] == tst.greedy[x];
				agree += same;
				first += same && !s;
				all &= same;
				sum += d;
				mx = d > mx ? d : mx;
			}
			seqs += all;
		}
		const char *rn = mlens_dtype_name((enum mlens_dtype)o.ref_dtype);
		const char *tn = mlens_dtype_name((enum mlens_dtype)o.test_dtype);
		double n_tok = (double)(N * G);
		printf("model %s (%lld layers, %s weights), backend %s; %ld prompts (max %d tokens), %ld "
		       "greedy tokens each, teacher-forced on the %s run\n",
		       o.dir, (long long)m->cfg.num_hidden_layers, mlens_dtype_name(m->cfg.dtype),
		       be.ops->name, N, pr.max_len, G, rn);
		printf("%-34s %12s %12s\n", "", rn, tn);
		printf("%-34s %12zu %12zu\n", "KV bytes a token (K+V, all layers)", ref.token_bytes,
		       tst.token_bytes);
		printf("%-34s %12.2f %12.2f\n", "run seconds", ref.seconds, tst.seconds);
		printf("%-34s %25.4f\n", "greedy agreement, tokens", agree / n_tok);
		printf("%-34s %25.4f\n", "greedy agreement, first token", (double)first / (double)N);
		printf("%-34s %25.4f\n", "greedy agreement, whole sequences", (double)seqs / (double)N);
		printf("%-34s %25.6f\n", "mean |logprob diff|", sum / n_tok);
		printf("%-34s %25.6f\n", "max |logprob diff|", mx);
		printf("%-34s %25.4f\n", "KV tokens a byte, test / reference",
		       (double)ref.token_bytes / (double)tst.token_bytes);

		FILE *jf = o.json ? fopen(o.json, "w") : stdout;
		if (!jf) {
			fprintf(stderr, "mlens-kvcompare: cannot write %s: %s\n", o.json, strerror(errno));
			return 1;
		}
		fprintf(jf, "{\"model\": \"%s\", \"layers\": %lld, \"weights\": \"%s\", \"backend\": \"%s\", "
			    "\"prompts\": %ld, \"max_prompt_tokens\": %d, \"gen_tokens\": %ld, "
			    "\"reference\": \"%s\", \"test\": \"%s\", "
			    "\"kv_token_bytes\": {\"reference\": %zu, \"test\": %zu}, "
			    "\"seconds\": {\"reference\": %.3f, \"test\": %.3f}, "
			    "\"greedy_agreement_tokens\": %.6f, \"greedy_agreement_first\": %.6f, "
			    "\"greedy_agreement_sequences\": %.6f, \"mean_abs_logprob_diff\": %.8f, "
			    "\"max_abs_logprob_diff\": %.8f}\n",
			o.dir, (long long)m->cfg.num_hidden_layers, mlens_dtype_name(m->cfg.dtype),
			be.ops->name, N, pr.max_len, G, rn, tn, ref.token_bytes, tst.token_bytes, ref.seconds,
			tst.seconds, agree / n_tok, (double)first / (double)N, (double)seqs / (double)N,
			sum / n_tok, mx);
		if (o.json)
			fclose(jf);
	}
	free(ref.greedy);
	free(ref.lp);
	free(tst.greedy);
	free(tst.lp);
	free(pr.tok);
	free(pr.off);
	free(pr.len);
	mlens_backend_destroy(&be);
	mlens_model_close(m);
	return 0;
}
