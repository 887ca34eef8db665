/* mlens-kvcompare: the accuracy of fp8 weights and of the fp8 KV cache.
 * The same prompts run through the engine in-process twice or more: a
 * reference run (the model as its files hold it, a bf16 or fp32 KV
 * cache) and test runs with fp8 experts (the reference model's quantized
 * at load as weight_dtype = fp8 does, or a second model directory such as
 * an fp8 checkpoint), an fp8 (or other) KV cache, or both. Every test run
 * is fed the reference run's greedy tokens (teacher forcing), so every
 * position compares the two on the same context. Prints a table and a
 * JSON object: greedy agreement (per token, first token, whole sequences)
 * and the mean and largest absolute difference of the log-probabilities
 * the runs give the reference's greedy tokens. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/config.h"
#include "daemon/exec/engine.h"
#include "daemon/model/quant.h"
#include "daemon/tools/toolopt.h"
#include "daemon/serve/worker.h"

struct kvc_opts {
	const char *dir, *test_dir, *backend, *json, *prompt_file, *fp8_gemm;
	long n, plen, gen, batch, seed, threads;
	int ref_dtype, test_dtype;	/* test_dtype < 0: not given */
	bool test_fp8, matrix;
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
 * log-probability of the token the reference chose there; and what the
 * run ran with. */
struct kvc_run {
	int32_t *greedy;
	float *lp;
	double seconds;
	size_t token_bytes;	/* KV bytes a token, K and V, all layers */
	size_t weight_bytes;	/* the model's tensor bytes (experts at their dtype) */
	uint32_t blocks;
	int kv_dtype;
	char weights[32];	/* the experts' dtype, and fp8 scales' layout */
};

/* A test run against the reference: greedy agreement and |dlogprob|. */
struct kvc_score {
	double tokens, first, seqs, mean, max;
};

/* One configuration of a test run: on the test weights or the reference's,
 * with KV dtype kv_dtype. */
struct kvc_config {
	const char *name;
	bool test_weights;
	int kv_dtype;
	struct kvc_run run;
	struct kvc_score score;
};

static void usage(FILE *f)
{
	fprintf(f, "usage: mlens-kvcompare --model DIR [--backend cpu|cuda|auto] [--prompts N]\n"
		   "                       [--prompt-len L] [--prompt-file FILE] [--gen G] [--batch B]\n"
		   "                       [--reference bf16|fp32] [--test fp8|bf16|fp32]\n"
		   "                       [--test-weights auto|fp8] [--test-model DIR] [--matrix]\n"
		   "                       [--gpu-fp8-gemm auto|fp8|dequant] [--seed S] [--threads N]\n"
		   "                       [--json FILE]\n"
		   "Runs the model as its files hold it with a bf16 (or fp32) KV cache (the\n"
		   "reference), then the test run on the same prompts, fed the reference's greedy\n"
		   "tokens, and prints greedy agreement and the mean and largest |log-probability\n"
		   "difference|, as a table and as JSON.\n"
		   "--test: the test run's KV dtype; default fp8, or the reference's when the test\n"
		   "  run's weights differ (--test-weights fp8 alone measures the weights alone).\n"
		   "--test-weights fp8: the test run's experts quantized to fp8 at load (a scale\n"
		   "  per output channel), as mlensd's weight_dtype = fp8 does.\n"
		   "--test-model DIR: the test run's weights from DIR, a model of the same shape\n"
		   "  (an fp8 checkpoint of the reference model, say).\n"
		   "--matrix: one reference run against four test runs, one table and JSON with a\n"
		   "  row each: control (the reference's weights and KV dtype: agreement 1,\n"
		   "  difference 0), fp8 weights, the --test KV dtype (fp8), and both. The fp8\n"
		   "  weights are the reference's quantized at load, or --test-model's. The JSON\n"
		   "  has a \"configs\" list, one object a row (name control, weights, kv or\n"
		   "  weights+kv); a single test run's JSON has its keys at the top.\n"
		   "Test weights are a second load of the model: its file pages are shared, the\n"
		   "quantized experts take memory of their own (about half of bf16 experts).\n"
		   "The backend runs with mlensd's default gpu_* settings; --gpu-fp8-gemm: how\n"
		   "  the CUDA backend multiplies fp8 experts (mlensd's gpu_fp8_gemm).\n"
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

/* One of two words named on the command line: true for the second. */
static bool parse_pick(const char *opt, const char *s, const char *no, const char *yes)
{
	if (!strcmp(s, no) || !strcmp(s, yes))
		return !strcmp(s, yes);
	fprintf(stderr, "mlens-kvcompare: %s wants %s or %s, got '%s'\n", opt, no, yes, s);
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

/* The experts' dtype, and for fp8 the layout of their scales. */
static void weights_name(const struct mlens_model *m, char *buf, size_t len)
{
	const struct mlens_model_config *c = &m->cfg;
	static const char *const scales[] = { "", "/tensor", "/channel", "/block" };
	unsigned k = (unsigned)c->expert_scale.kind;
	snprintf(buf, len, "%s%s", mlens_dtype_name(c->expert_dtype),
		 c->expert_dtype == MLENS_DTYPE_E4M3 && k < 4 ? scales[k] : "");
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
	r->weight_bytes = m->weight_bytes;
	r->kv_dtype = kv_dtype;
	weights_name(m, r->weights, sizeof(r->weights));
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

/* How test run t scores against the reference run ref. */
static void score(const struct kvc_run *ref, const struct kvc_run *t, long N, long G,
		  struct kvc_score *sc)
{
	long agree = 0, first = 0, seqs = 0;
	double sum = 0.0, mx = 0.0;
	for (long i = 0; i < N; i++) {
		int all = 1;
		for (long s = 0; s < G; s++) {
			size_t x = (size_t)(i * G + s);
			double d = fabs((double)ref->lp[x] - (double)t->lp[x]);
			int same = ref->greedy[x] == t->greedy[x];
			agree += same;
			first += same && !s;
			all &= same;
			sum += d;
			mx = d > mx ? d : mx;
		}
		seqs += all;
	}
	sc->tokens = (double)agree / (double)(N * G);
	sc->first = (double)first / (double)N;
	sc->seqs = (double)seqs / (double)N;
	sc->mean = sum / (double)(N * G);
	sc->max = mx;
}

/* A table row: the run's weights and KV, against the reference (sc NULL
 * for the reference's own row). */
static void table_row(const char *name, const struct kvc_run *ref, const struct kvc_run *r,
		      const struct kvc_score *sc)
{
	printf("%-12s %-16s %-8s %8zu %8.4f %8.4f %7.2f", name, r->weights,
	       mlens_dtype_name((enum mlens_dtype)r->kv_dtype), r->token_bytes,
	       (double)r->weight_bytes / (double)ref->weight_bytes,
	       (double)ref->token_bytes / (double)r->token_bytes, r->seconds);
	if (sc)
		printf(" %8.4f %8.4f %8.4f %10.6f %10.6f\n", sc->tokens, sc->first, sc->seqs, sc->mean,
		       sc->max);
	else
		printf(" %8s %8s %8s %10s %10s\n", "-", "-", "-", "-", "-");
}

static void json_scores(FILE *f, const struct kvc_score *sc)
{
	fprintf(f, "\"greedy_agreement_tokens\": %.6f, \"greedy_agreement_first\": %.6f, "
		   "\"greedy_agreement_sequences\": %.6f, \"mean_abs_logprob_diff\": %.8f, "
		   "\"max_abs_logprob_diff\": %.8f",
		sc->tokens, sc->first, sc->seqs, sc->mean, sc->max);
}

/* The table on stdout and the JSON object on o->json (or stdout). */
static int report(const struct kvc_opts *o, const struct mlens_model *m, const char *backend,
		  const struct kvc_prompts *pr, const struct kvc_run *ref,
		  const struct kvc_config *cf, int nc)
{
	const char *rn = mlens_dtype_name((enum mlens_dtype)ref->kv_dtype);
	FILE *jf;

	printf("model %s (%lld layers, %s weights), backend %s; %ld prompts (max %d tokens), %ld "
	       "greedy tokens each, teacher-forced on the reference run\n",
	       o->dir, (long long)m->cfg.num_hidden_layers, mlens_dtype_name(m->cfg.dtype), backend,
	       pr->n, pr->max_len, o->gen);
	if (o->test_dir)
		printf("test weights from %s\n", o->test_dir);
	printf("%-12s %-16s %-8s %8s %8s %8s %7s %8s %8s %8s %10s %10s\n", "run", "experts", "KV",
	       "KV B/tok", "weight x", "KV tok x", "seconds", "tokens", "first", "seqs", "mean|dlp|",
	       "max|dlp|");
	table_row("reference", ref, ref, NULL);
	for (int i = 0; i < nc; i++)
		table_row(cf[i].name, ref, &cf[i].run, &cf[i].score);
	printf("(weight x: the test model's tensor bytes / the reference's; KV tok x: KV tokens\n"
	       " a pool holds / the reference's; tokens, first, seqs: greedy agreement per token,\n"
	       " on the first token, on whole sequences; |dlp|: |log-probability difference|)\n");

	jf = o->json ? fopen(o->json, "w") : stdout;
	if (!jf) {
		fprintf(stderr, "mlens-kvcompare: cannot write %s: %s\n", o->json, strerror(errno));
		return -errno;
	}
	fprintf(jf, "{\"model\": \"%s\", \"layers\": %lld, \"weights\": \"%s\", \"backend\": \"%s\", "
		    "\"prompts\": %ld, \"max_prompt_tokens\": %d, \"gen_tokens\": %ld, "
		    "\"reference\": \"%s\", \"reference_weights\": \"%s\", ",
		o->dir, (long long)m->cfg.num_hidden_layers, mlens_dtype_name(m->cfg.dtype), backend,
		pr->n, pr->max_len, o->gen, rn, ref->weights);
	if (!o->matrix) {
		const struct kvc_run *t = &cf[0].run;
		fprintf(jf, "\"test\": \"%s\", \"test_weights\": \"%s\", "
			    "\"kv_token_bytes\": {\"reference\": %zu, \"test\": %zu}, "
			    "\"weight_bytes\": {\"reference\": %zu, \"test\": %zu}, "
			    "\"seconds\": {\"reference\": %.3f, \"test\": %.3f}, "
			    "\"kv_tokens_ratio\": %.6f, ",
			mlens_dtype_name((enum mlens_dtype)t->kv_dtype), t->weights, ref->token_bytes,
			t->token_bytes, ref->weight_bytes, t->weight_bytes, ref->seconds, t->seconds,
			(double)ref->token_bytes / (double)t->token_bytes);
		json_scores(jf, &cf[0].score);
	} else {
		fprintf(jf, "\"reference_kv_token_bytes\": %zu, \"reference_weight_bytes\": %zu, "
			    "\"reference_seconds\": %.3f, \"configs\": [",
			ref->token_bytes, ref->weight_bytes, ref->seconds);
		for (int i = 0; i < nc; i++) {
			const struct kvc_run *t = &cf[i].run;
			fprintf(jf, "%s{\"name\": \"%s\", \"weights\": \"%s\", \"kv\": \"%s\", "
				    "\"kv_token_bytes\": %zu, \"weight_bytes\": %zu, \"kv_tokens_ratio\": %.6f, "
				    "\"seconds\": %.3f, ",
				i ? ", " : "", cf[i].name, t->weights,
				mlens_dtype_name((enum mlens_dtype)t->kv_dtype), t->token_bytes,
				t->weight_bytes, (double)ref->token_bytes / (double)t->token_bytes,
				t->seconds);
			json_scores(jf, &cf[i].score);
			fputc('}', jf);
		}
		fputc(']', jf);
	}
	fputs("}\n", jf);
	if (o->json)
		fclose(jf);
	return 0;
}

/* The test model (--test-model) must be the reference model in other
 * weights: the same vocabulary and shape. */
static int same_shape(const struct mlens_model *m, const struct mlens_model *t, const char *dir)
{
	const struct mlens_model_config *a = &m->cfg, *b = &t->cfg;
	const struct {
		const char *key;
		long long x, y;
	} k[] = {
		{ "vocab_size", (long long)a->vocab_size, (long long)b->vocab_size },
		{ "hidden_size", (long long)a->hidden_size, (long long)b->hidden_size },
		{ "intermediate_size", (long long)a->intermediate_size, (long long)b->intermediate_size },
		{ "num_hidden_layers", (long long)a->num_hidden_layers, (long long)b->num_hidden_layers },
		{ "num_local_experts", (long long)a->num_local_experts, (long long)b->num_local_experts },
	};
	for (size_t i = 0; i < sizeof(k) / sizeof(k[0]); i++)
		if (k[i].x != k[i].y) {
			fprintf(stderr, "mlens-kvcompare: --test-model %s has %s %lld, the reference model "
				"%s %lld; give a model of the reference's shape\n", dir, k[i].key, k[i].y,
				m->dir, k[i].x);
			return -EINVAL;
		}
	return 0;
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
		{ "test-weights", required_argument, NULL, 'w' },
		{ "test-model", required_argument, NULL, 'M' },
		{ "matrix", no_argument, NULL, 'x' },
		{ "gpu-fp8-gemm", required_argument, NULL, 'G' },
		{ "seed", required_argument, NULL, 's' },
		{ "threads", required_argument, NULL, 'j' },
		{ "json", required_argument, NULL, 'J' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 }
	};
	struct kvc_opts o = { .backend = "cpu", .n = 256, .plen = 32, .gen = 16, .batch = 32,
			      .seed = 1, .ref_dtype = MLENS_DTYPE_BF16, .test_dtype = -1 };
	struct mlens_model *m = NULL, *tm = NULL;
	struct mlens_backend be = { 0 };
	struct mlens_backend_opts bo;
	struct mlens_config cfg;
	struct kvc_prompts pr = { 0 };
	struct kvc_run ref = { 0 };
	struct kvc_config cf[4];
	char err[512];
	int c, rc, nc, status = 1;

	while ((c = getopt_long(argc, argv, "m:b:n:p:f:g:B:r:t:w:M:xG:s:j:J:h", lopts, NULL)) != -1) {
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
		case 'w': o.test_fp8 = parse_pick("--test-weights", optarg, "auto", "fp8"); break;
		case 'M': o.test_dir = optarg; break;
		case 'x': o.matrix = true; break;
		case 'G': o.fp8_gemm = optarg; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (!o.dir || optind < argc) {
		usage(stderr);
		return 2;
	}
	/* the matrix's weight rows are fp8: the test model's experts as they
	 * are when fp8 already, else quantized at load */
	o.test_fp8 |= o.matrix;
	if (o.test_dtype < 0)
		o.test_dtype = o.matrix || !(o.test_fp8 || o.test_dir) ? MLENS_DTYPE_E4M3 : o.ref_dtype;
	memset(cf, 0, sizeof(cf));
	if (o.matrix) {
		cf[0] = (struct kvc_config){ .name = "control", .test_weights = false, .kv_dtype = o.ref_dtype };
		cf[1] = (struct kvc_config){ .name = "weights", .test_weights = true, .kv_dtype = o.ref_dtype };
		cf[2] = (struct kvc_config){ .name = "kv", .test_weights = false, .kv_dtype = o.test_dtype };
		cf[3] = (struct kvc_config){ .name = "weights+kv", .test_weights = true, .kv_dtype = o.test_dtype };
		nc = 4;
	} else {
		cf[0] = (struct kvc_config){ .name = "test", .test_weights = o.test_fp8 || o.test_dir,
					     .kv_dtype = o.test_dtype };
		nc = 1;
	}

	/* the GPU settings mlensd starts with by default (prefill attention,
	 * GEMM modes, fp8 GEMMs), gpu_fp8_gemm as given */
	mlens_config_defaults(&cfg);
	if (o.fp8_gemm) {
		char line[128];
		snprintf(line, sizeof(line), "gpu_fp8_gemm = %.64s\n", o.fp8_gemm);
		if ((rc = mlens_config_load_text(&cfg, line, "--gpu-fp8-gemm", err, sizeof(err)))) {
			fprintf(stderr, "mlens-kvcompare: %s\n", err);
			goto out;
		}
	}
	if ((rc = mlens_model_open(o.dir, &m, err, sizeof(err)))) {
		fprintf(stderr, "mlens-kvcompare: %s\n", err);
		goto out;
	}
	/* the test weights: a second load of the reference model (its file
	 * pages shared, the experts quantized into memory of their own, as
	 * weight_dtype = fp8 does at load) or --test-model's; quantized before
	 * any run, so that a model that cannot take fp8 fails at once */
	if (o.test_fp8 || o.test_dir) {
		const char *td = o.test_dir ? o.test_dir : o.dir;
		if ((rc = mlens_model_open(td, &tm, err, sizeof(err)))) {
			fprintf(stderr, "mlens-kvcompare: %s\n", err);
			goto out;
		}
		if (same_shape(m, tm, td))
			goto out;
		if (o.test_fp8 && (rc = mlens_model_quantize_experts(tm, err, sizeof(err)))) {
			fprintf(stderr, "mlens-kvcompare: --test-weights fp8: %s\n", err);
			goto out;
		}
	}
	if (make_prompts(&pr, &o, m->cfg.vocab_size))
		goto out;
	memset(&bo, 0, sizeof(bo));
	mlens_config_backend_opts(&cfg, m->cfg.dtype == MLENS_DTYPE_F32, &bo);
	bo.n_threads = (int)o.threads;
	if ((rc = mlens_backend_create(&be, o.backend, &bo))) {
		fprintf(stderr, "mlens-kvcompare: cannot start the %s backend: %s\n", o.backend,
			strerror(-rc));
		goto out;
	}
	if (run(m, &be, o.ref_dtype, &o, &pr, NULL, &ref))
		goto out;
	for (int i = 0; i < nc; i++)
		if (run(cf[i].test_weights ? tm : m, &be, cf[i].kv_dtype, &o, &pr, ref.greedy, &cf[i].run))
			goto out;
	for (int i = 0; i < nc; i++)
		score(&ref, &cf[i].run, pr.n, o.gen, &cf[i].score);
	if (!report(&o, m, be.ops->name, &pr, &ref, cf, nc))
		status = 0;
out:
	for (int i = 0; i < nc; i++) {
		free(cf[i].run.greedy);
		free(cf[i].run.lp);
	}
	free(ref.greedy);
	free(ref.lp);
	free(pr.tok);
	free(pr.off);
	free(pr.len);
	mlens_backend_destroy(&be);
	mlens_config_free(&cfg);
	mlens_model_close(tm);
	mlens_model_close(m);
	return status;
}
