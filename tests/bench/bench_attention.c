/* The attention benchmark: a decode batch like the daemon's (many sequences
 * over shuffled KV blocks of one layer) run by each kernel variant at each
 * thread count, reported as KV bytes read per second next to the read
 * bandwidth that a plain streaming-read loop reaches in the same run; and
 * the KV append of a prefill group (4096 rows of fp32 K and V into the
 * bf16 cache) at each thread count, as bytes read and written per second. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "kernels/cpu/attn.h"
#include "kernels/cpu/attn_int.h"
#include "kernels/cpu/pool.h"
#include "tests/bench/bench_attention.h"
#include "kernels/cpu/readbw.h"

#define MAX_THREAD_COUNTS 32

struct opts {
	bool json;
	int threads[MAX_THREAD_COUNTS], n_threads;
	int seqs, min_ctx, max_ctx, heads, kv_heads, head_dim, block;
	const char *variant;	/* NULL: every one the CPU has */
	double min_time;
	size_t bw_bytes;
	/* kernel tuning (attn_int.h); < 0: the kernels' default */
	int prefetch, prefetch_bytes, prefetch_spread, prefetch_hint, prefetch_every, chunk;
	int heads_per_task;
	/* the block tables: runs of this many consecutive block ids, the runs
	 * in shuffled order (1: every block at a random place, as a churned
	 * pool's; 0: each sequence's blocks in one run) */
	int block_runs;
	/* the output: fp32 (0), or bf16 as the hybrid pipeline uploads it,
	 * rounded by a second pool run (1) or in the attention's own (2) */
	int output;
	bool fp8;	/* an fp8 (e4m3) cache instead of bf16 */
};

static const char *const output_names[] = { "fp32", "round", "fused" };

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;

static uint32_t rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (uint32_t)(rng >> 16);
}

/* ==== the batch ==== */

struct batch {
	struct mlens_kv_cache kv;
	struct mlens_attn_query *qs;
	uint32_t *tables;
	float *q, *out;
	uint16_t *half;
	int n, n_heads;
	double kv_bytes;	/* K and V bytes one pass reads */
};

struct fill_job {
	uint16_t *k, *v;
	size_t elems;
};

#define FILL_SLICE ((size_t)1 << 22)

static void fill_task(void *arg, int task, int thread)
{
	struct fill_job *j = arg;
	size_t e0 = (size_t)task * FILL_SLICE, e1 = e0 + FILL_SLICE;
	uint32_t x = 0x9e3779b9u * (uint32_t)(task + 1);
	if (e1 > j->elems)
		e1 = j->elems;
	for (size_t e = e0; e < e1; e++) {
		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		/* bf16 in [-1, 1): sign, exponent 120..126, random mantissa */
		uint16_t h = (uint16_t)((x & 0x8000) | ((120u + (x >> 16) % 7) << 7) | (x & 0x7f));
		j->k[e] = h;
		j->v[e] = (uint16_t)(h ^ 0x8000);
	}
}

static int batch_make(struct batch *b, const struct opts *o, struct mlens_pool *pool)
{
	uint64_t total = 0;
	size_t used = 0;
	struct fill_job fj;
	int hd = o->head_dim;

	memset(b, 0, sizeof(*b));
	b->n = o->seqs;
	b->n_heads = o->heads;
	b->qs = calloc((size_t)b->n, sizeof(*b->qs));
	if (!b->qs)
		return -ENOMEM;
	for (int i = 0; i < b->n; i++) {
		int span = o->max_ctx - o->min_ctx + 1;
		b->qs[i].ctx_len = o->min_ctx + (int)(rnd() % (uint32_t)span);
		b->qs[i].n_blocks = (b->qs[i].ctx_len + o->block - 1) / o->block;
		total += (uint64_t)b->qs[i].n_blocks;
		/* fp8: a byte a value and a 4-byte scale a row */
		b->kv_bytes += 2.0 * b->qs[i].ctx_len * o->kv_heads * (o->fp8 ? hd + 4 : hd * 2);
	}
	if (total > UINT32_MAX)
		return -EOVERFLOW;
	b->kv = (struct mlens_kv_cache){ o->fp8 ? MLENS_DTYPE_E4M3 : MLENS_DTYPE_BF16, 1, o->kv_heads, hd, o->block,
					 (uint32_t)total, NULL, NULL };
	b->tables = malloc(total * sizeof(*b->tables));
	b->kv.k = mlens_readbw_alloc(mlens_kv_bytes(&b->kv));
	b->kv.v = mlens_readbw_alloc(mlens_kv_bytes(&b->kv));
	b->q = malloc((size_t)b->n * o->heads * hd * sizeof(float));
	b->out = malloc((size_t)b->n * o->heads * hd * sizeof(float));
	b->half = malloc((size_t)b->n * o->heads * hd * 2);
	if (!b->tables || !b->kv.k || !b->kv.v || !b->q || !b->out || !b->half)
		return -ENOMEM;
	/* blocks handed out in runs of o->block_runs consecutive ids, the runs
	 * in shuffled order (runs of one: every block at a random place, as
	 * a long-running pool's can be; 0: every sequence one run) */
	for (uint32_t x = 0; x < total; x++)
		b->tables[x] = x;
	if (o->block_runs > 0) {
		uint32_t r = (uint32_t)o->block_runs, nr = (uint32_t)((total + r - 1) / r);
		uint32_t *order = malloc((size_t)nr * sizeof(*order)), x = 0;
		if (!order)
			return -ENOMEM;
		for (uint32_t i = 0; i < nr; i++)
			order[i] = i;
		for (uint32_t i = nr - 1; i > 0; i--) {
			uint32_t y = rnd() % (i + 1), t = order[i];
			order[i] = order[y];
			order[y] = t;
		}
		for (uint32_t i = 0; i < nr; i++)
			for (uint32_t id = order[i] * r; id < (order[i] + 1) * r && id < total; id++)
				b->tables[x++] = id;
		free(order);
	}
	for (int i = 0; i < b->n; i++) {
		b->qs[i].block_table = b->tables + used;
		used += (size_t)b->qs[i].n_blocks;
	}
	for (size_t e = 0; e < (size_t)b->n * o->heads * hd; e++)
		b->q[e] = (float)(rnd() % 2001) / 1000.0f - 1.0f;
	fj = (struct fill_job){ b->kv.k, b->kv.v, mlens_kv_code_bytes(&b->kv) / 2 };
	mlens_pool_run(pool, (int)((fj.elems + FILL_SLICE - 1) / FILL_SLICE), fill_task, &fj);
	if (o->fp8) {	/* the bf16 patterns' bytes as codes, no NaN; scales 1/448 */
		uint8_t *k = b->kv.k, *v = b->kv.v;
		for (size_t e = 0; e < mlens_kv_code_bytes(&b->kv); e++) {
			k[e] = (k[e] & 0x7f) == 0x7f ? k[e] ^ 1 : k[e];
			v[e] = (v[e] & 0x7f) == 0x7f ? v[e] ^ 1 : v[e];
		}
		for (size_t r = 0; r < mlens_kv_rows(&b->kv); r++)
			mlens_kv_scales(&b->kv, b->kv.k)[r] = mlens_kv_scales(&b->kv, b->kv.v)[r] =
				1.0f / MLENS_E4M3_MAX;
	}
	return 0;
}

static void batch_free(struct batch *b)
{
	free(b->qs);
	free(b->tables);
	free(b->kv.k);
	free(b->kv.v);
	free(b->q);
	free(b->out);
	free(b->half);
}

/* ==== runs ==== */

struct result {
	const char *variant;
	int threads;
	double best_gbs, median_gbs, read_bw;
	int reps;
};

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static int run_one(const struct opts *o, struct batch *b, struct mlens_pool *pool,
		   struct result *r)
{
	struct mlens_cpu_attn_ws ws = { 0 };
	double times[64], start = now();
	float scale = 1.0f / sqrtf((float)o->head_dim);
	int n = 0, rc = 0;

	/* the first pass warms the workspace and is not counted; then passes
	 * until min_time, at least one */
	while (n < 64 && (n < 2 || now() - start < o->min_time)) {
		double t0 = now();
		if (o->output == 2)
			rc = mlens_cpu_attn_decode_half(pool, &ws, b->half, MLENS_DTYPE_BF16, b->out,
							b->q, &b->kv, 0, b->qs, b->n, o->heads,
							scale);
		else
			rc = mlens_cpu_attn_decode(pool, &ws, b->out, b->q, &b->kv, 0, b->qs, b->n,
						   o->heads, scale);
		if (!rc && o->output == 1)
			rc = mlens_cpu_round(pool, b->half, MLENS_DTYPE_BF16, b->out, b->n,
					     o->heads * o->head_dim);
		if (rc)
			break;
		times[n++] = now() - t0;
	}
	mlens_cpu_attn_ws_fini(&ws);
	if (rc)
		return rc;
	qsort(times + 1, (size_t)(n - 1), sizeof(double), cmp_double);
	r->best_gbs = b->kv_bytes / times[1] / 1e9;
	r->median_gbs = b->kv_bytes / times[1 + (n - 1) / 2] / 1e9;
	r->reps = n - 1;
	return 0;
}

/* The append of APPEND_ROWS rows (a hybrid prefill group) into the batch's
 * cache through the pool: best bytes/s (fp32 K, V read; bf16 written). */
#define APPEND_ROWS 4096

static int run_append(const struct opts *o, struct batch *b, struct mlens_pool *pool, double *gbs)
{
	size_t row = (size_t)o->kv_heads * (size_t)o->head_dim;
	size_t slots_n = (size_t)b->kv.n_blocks * (size_t)b->kv.block_size;
	int rows = slots_n < APPEND_ROWS ? (int)slots_n : APPEND_ROWS, n = 0, rc = 0;
	float *k = malloc((size_t)rows * row * sizeof(float));
	float *v = malloc((size_t)rows * row * sizeof(float));
	int64_t *slots = malloc((size_t)rows * sizeof(int64_t));
	double best = INFINITY, start;

	if (!k || !v || !slots) {
		rc = -ENOMEM;
		goto out;
	}
	for (size_t e = 0; e < (size_t)rows * row; e++)
		k[e] = v[e] = (float)(e % 97) * 0.01f;
	for (int i = 0; i < rows; i++)	/* spread over the cache, as the pool's blocks are */
		slots[i] = (int64_t)(((uint64_t)i * 2654435761u) % slots_n);
	start = now();
	while (n < 64 && (n < 3 || now() - start < o->min_time / 4)) {
		double t0 = now(), t;
		if ((rc = mlens_cpu_kv_append(pool, &b->kv, 0, k, v, slots, rows)))
			goto out;
		t = now() - t0;
		if (n++ && t < best)	/* the first pass is not counted */
			best = t;
	}
	*gbs = (double)rows * (double)row * (2 * 4 + 2 * 2) / best / 1e9;
out:
	free(k);
	free(v);
	free(slots);
	return rc;
}

static int parse_threads(struct opts *o, const char *s)
{
	char *end;
	o->n_threads = 0;
	while (*s) {
		long t = strtol(s, &end, 10);
		if (end == s || t < 1 || t > 4096 || o->n_threads == MAX_THREAD_COUNTS)
			return -EINVAL;
		o->threads[o->n_threads++] = (int)t;
		s = *end == ',' ? end + 1 : end;
		if (*end && *end != ',')
			return -EINVAL;
	}
	return o->n_threads ? 0 : -EINVAL;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: mlens-bench attention [--json] [--threads LIST] [--seqs N]\n"
		"         [--min-ctx A --max-ctx B] [--variant scalar|avx2|avx512]\n"
		"         [--heads H] [--kv-heads K] [--head-dim D] [--block S]\n"
		"         [--min-time SECONDS] [--bw-mb MB] [--prefetch TILES]\n"
		"         [--prefetch-bytes B] [--prefetch-spread 0|1]\n"
		"         [--prefetch-hint t0|t1|t2|nta] [--prefetch-every LINES]\n"
		"         [--chunk TOKENS] [--heads-per-task N] [--output fp32|round|fused]\n"
		"         [--block-runs N] [--kv-dtype bf16|fp8]\n"
		"Decode attention over a one-layer bf16 (or fp8) paged KV cache: KV bytes read\n"
		"per second for each kernel variant and thread count, next to the\n"
		"streaming read bandwidth measured in the same run. --output round and\n"
		"fused time a bf16 output as well (a second pool run, or the attention's).\n");
}

static int parse(struct opts *o, int argc, char **argv)
{
	static const struct option longs[] = {
		{ "json", no_argument, NULL, 'j' },
		{ "threads", required_argument, NULL, 't' },
		{ "seqs", required_argument, NULL, 'n' },
		{ "min-ctx", required_argument, NULL, 'a' },
		{ "max-ctx", required_argument, NULL, 'b' },
		{ "variant", required_argument, NULL, 'v' },
		{ "heads", required_argument, NULL, 'H' },
		{ "kv-heads", required_argument, NULL, 'K' },
		{ "head-dim", required_argument, NULL, 'D' },
		{ "block", required_argument, NULL, 'S' },
		{ "min-time", required_argument, NULL, 'T' },
		{ "bw-mb", required_argument, NULL, 'B' },
		{ "prefetch", required_argument, NULL, 'P' },
		{ "prefetch-bytes", required_argument, NULL, 'Q' },
		{ "prefetch-spread", required_argument, NULL, 'R' },
		{ "prefetch-hint", required_argument, NULL, 'I' },
		{ "prefetch-every", required_argument, NULL, 'E' },
		{ "chunk", required_argument, NULL, 'C' },
		{ "heads-per-task", required_argument, NULL, 'G' },
		{ "output", required_argument, NULL, 'O' },
		{ "block-runs", required_argument, NULL, 'U' },
		{ "kv-dtype", required_argument, NULL, 'X' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	int c;

	*o = (struct opts){ .seqs = 1000, .min_ctx = 512, .max_ctx = 2048, .heads = 32,
			    .kv_heads = 8, .head_dim = 128, .block = 16, .min_time = 1.0,
			    .bw_bytes = (size_t)2048 << 20, .prefetch = -1,
			    .prefetch_bytes = -1, .prefetch_spread = -1, .prefetch_hint = -1,
			    .prefetch_every = -1, .chunk = -1, .heads_per_task = -1,
			    .block_runs = 1 };
	for (int t = 1; t < ncpu && o->n_threads < MAX_THREAD_COUNTS - 1; t *= 2)
		o->threads[o->n_threads++] = t;
	o->threads[o->n_threads++] = ncpu > 0 ? (int)ncpu : 1;
	optind = 1;
	while ((c = getopt_long(argc, argv, "", longs, NULL)) != -1) {
		switch (c) {
		case 'j': o->json = true; break;
		case 't':
			if (parse_threads(o, optarg)) {
				fprintf(stderr, "attention: --threads takes a list like 1,2,4 (1 to 4096)\n");
				return -EINVAL;
			}
			break;
		case 'n': o->seqs = atoi(optarg); break;
		case 'a': o->min_ctx = atoi(optarg); break;
		case 'b': o->max_ctx = atoi(optarg); break;
		case 'v': o->variant = optarg; break;
		case 'H': o->heads = atoi(optarg); break;
		case 'K': o->kv_heads = atoi(optarg); break;
		case 'D': o->head_dim = atoi(optarg); break;
		case 'S': o->block = atoi(optarg); break;
		case 'T': o->min_time = atof(optarg); break;
		case 'B': o->bw_bytes = (size_t)atol(optarg) << 20; break;
		case 'P': o->prefetch = atoi(optarg); break;
		case 'Q': o->prefetch_bytes = atoi(optarg); break;
		case 'R': o->prefetch_spread = atoi(optarg) != 0; break;
		case 'I':
			o->prefetch_hint = !strcmp(optarg, "t0") ? 0 : !strcmp(optarg, "t1") ? 1 :
					   !strcmp(optarg, "t2") ? 2 : !strcmp(optarg, "nta") ? 3 : -2;
			if (o->prefetch_hint == -2) {
				fprintf(stderr, "attention: --prefetch-hint takes t0, t1, t2 or nta\n");
				return -EINVAL;
			}
			break;
		case 'E': o->prefetch_every = atoi(optarg); break;
		case 'C': o->chunk = atoi(optarg); break;
		case 'G': o->heads_per_task = atoi(optarg); break;
		case 'U': o->block_runs = atoi(optarg); break;
		case 'X':
			if (strcmp(optarg, "bf16") && strcmp(optarg, "fp8")) {
				fprintf(stderr, "mlens-bench attention: --kv-dtype wants bf16 or fp8, got '%s'\n",
					optarg);
				return -EINVAL;
			}
			o->fp8 = !strcmp(optarg, "fp8");
			break;
		case 'O':
			o->output = -1;
			for (int i = 0; i < 3; i++)
				if (!strcmp(optarg, output_names[i]))
					o->output = i;
			if (o->output < 0) {
				fprintf(stderr, "attention: --output takes fp32, round or fused\n");
				return -EINVAL;
			}
			break;
		case 'h': usage(stdout); return 1;
		default: usage(stderr); return -EINVAL;
		}
	}
	if (o->seqs < 1 || o->min_ctx < 1 || o->max_ctx < o->min_ctx || o->kv_heads < 1 ||
	    o->heads < o->kv_heads || o->heads % o->kv_heads || o->head_dim < 1 ||
	    o->head_dim > 256 || o->block < 1 || o->bw_bytes < MLENS_READBW_SLICE || o->min_time < 0 ||
	    o->chunk == 0 || o->chunk > (1 << 20) || o->prefetch > (1 << 16) ||
	    o->prefetch_every == 0 || o->prefetch_every > (1 << 16) || o->heads_per_task > (1 << 16) ||
	    o->prefetch_bytes > (1 << 30) || o->block_runs < 0) {
		fprintf(stderr, "attention: inconsistent sizes (need seqs >= 1, 1 <= min-ctx <= max-ctx, "
			"heads a multiple of kv-heads, head-dim <= 256, bw-mb >= 1, "
			"1 <= chunk <= 1048576, prefetch <= 65536 tiles or 1 GB, "
			"1 <= prefetch-every <= 65536, block-runs >= 0)\n");
		return -EINVAL;
	}
	if (o->variant && !mlens_cpu_attn_variant_supported(o->variant)) {
		fprintf(stderr, "attention: variant '%s' is unknown or not supported by this CPU\n",
			o->variant);
		return -EINVAL;
	}
	return 0;
}

int mlens_bench_attention(int argc, char **argv)
{
	static const char *const all[] = { "scalar", "avx2", "avx512" };
	struct opts o;
	struct batch b;
	struct mlens_pool *fill = NULL;
	struct result res[3 * MAX_THREAD_COUNTS];
	double bw_by_t[MAX_THREAD_COUNTS], bw_all = 0.0, scalar_1t = 0.0;
	double append_gbs[MAX_THREAD_COUNTS];
	const char *dflt;
	char *bwbuf = NULL;
	int n_res = 0, max_t = 1, rc;

	rc = parse(&o, argc, argv);
	if (rc)
		return rc > 0 ? 0 : 2;
	/* after the first variant query, so that these win over the environment;
	 * the variant this process would use, for the append */
	dflt = mlens_cpu_attn_variant();
	if (o.prefetch >= 0)
		mlens_attn_tune.prefetch_tiles = o.prefetch;
	if (o.prefetch_bytes >= 0)
		mlens_attn_tune.prefetch_bytes = o.prefetch_bytes;
	if (o.prefetch_spread >= 0)
		mlens_attn_tune.prefetch_spread = o.prefetch_spread;
	if (o.prefetch_hint >= 0)
		mlens_attn_tune.prefetch_hint = o.prefetch_hint;
	if (o.prefetch_every > 0)
		mlens_attn_tune.prefetch_every = o.prefetch_every;
	if (o.chunk > 0)
		mlens_attn_tune.chunk_tokens = o.chunk;
	if (o.heads_per_task >= 0)
		mlens_attn_tune.heads_per_task = o.heads_per_task;
	__builtin_cpu_init();
	for (int t = 0; t < o.n_threads; t++)
		max_t = o.threads[t] > max_t ? o.threads[t] : max_t;
	if ((rc = mlens_pool_create_numa(&fill, 0, max_t, 0)) ||
	    (rc = batch_make(&b, &o, fill))) {
		fprintf(stderr, "attention: cannot set up the batch (%s); try fewer --seqs\n",
			strerror(-rc));
		mlens_pool_destroy(fill);
		batch_free(&b);
		return 1;
	}
	mlens_pool_destroy(fill);

	/* read bandwidth at each thread count, from a buffer far beyond the LLC */
	bwbuf = mlens_readbw_alloc(o.bw_bytes);
	if (!bwbuf) {
		fprintf(stderr, "attention: cannot allocate %zu MB for the bandwidth test; lower --bw-mb\n",
			o.bw_bytes >> 20);
		batch_free(&b);
		return 1;
	}
	memset(bwbuf, 1, o.bw_bytes);
	for (int t = 0; t < o.n_threads; t++) {
		struct mlens_pool *p;
		if ((rc = mlens_pool_create_numa(&p, 0, o.threads[t], 0)))
			goto fail;
		bw_by_t[t] = mlens_readbw_best(p, bwbuf, o.bw_bytes / MLENS_READBW_SLICE * MLENS_READBW_SLICE);
		if (o.threads[t] == max_t && bw_by_t[t] > bw_all)
			bw_all = bw_by_t[t];
		mlens_pool_destroy(p);
	}
	free(bwbuf);
	bwbuf = NULL;

	for (int v = 0; v < 3; v++) {
		if (!mlens_cpu_attn_variant_supported(all[v]) ||
		    (o.variant && strcmp(o.variant, all[v])))
			continue;
		mlens_cpu_attn_set_variant(all[v]);
		for (int t = 0; t < o.n_threads; t++) {
			struct mlens_pool *p;
			struct result *r = &res[n_res];
			if ((rc = mlens_pool_create_numa(&p, 0, o.threads[t], 0)))
				goto fail;
			rc = run_one(&o, &b, p, r);
			mlens_pool_destroy(p);
			if (rc)
				goto fail;
			r->variant = all[v];
			r->threads = o.threads[t];
			r->read_bw = bw_by_t[t];
			if (v == 0 && r->threads == 1)
				scalar_1t = r->best_gbs;
			n_res++;
			if (!o.json)
				fprintf(stderr, "  %-7s %3d threads: %7.2f GB/s\n", r->variant,
					r->threads, r->best_gbs);
		}
	}

	/* the append, with the variant the daemon would use */
	mlens_cpu_attn_set_variant(o.variant ? o.variant : dflt);
	for (int t = 0; t < o.n_threads; t++) {
		struct mlens_pool *p;
		if ((rc = mlens_pool_create_numa(&p, 0, o.threads[t], 0)))
			goto fail;
		rc = run_append(&o, &b, p, &append_gbs[t]);
		mlens_pool_destroy(p);
		if (rc)
			goto fail;
	}

	if (o.json) {
		printf("{\"read_bw_gbs\": %.2f, \"read_bw_by_threads\": [", bw_all);
		for (int t = 0; t < o.n_threads; t++)
			printf("%s{\"threads\": %d, \"gbs\": %.2f}", t ? ", " : "", o.threads[t],
			       bw_by_t[t]);
		printf("],\n \"config\": {\"seqs\": %d, \"min_ctx\": %d, \"max_ctx\": %d, \"heads\": %d, "
		       "\"kv_heads\": %d, \"head_dim\": %d, \"block\": %d, \"dtype\": \"%s\", "
		       "\"kv_bytes_per_pass\": %.0f, \"chunk_tokens\": %d, \"prefetch_tiles\": %d, "
		       "\"prefetch_bytes\": %d, \"prefetch_spread\": %d, \"prefetch_hint\": %d, "
		       "\"prefetch_every\": %d, \"heads_per_task\": %d, \"output\": \"%s\", \"block_runs\": %d},\n"
		       " \"results\": [",
		       o.seqs, o.min_ctx, o.max_ctx, o.heads, o.kv_heads, o.head_dim, o.block,
		       o.fp8 ? "fp8" : "bf16", b.kv_bytes, mlens_attn_tune.chunk_tokens, mlens_attn_tune.prefetch_tiles,
		       mlens_attn_tune.prefetch_bytes, mlens_attn_tune.prefetch_spread,
		       mlens_attn_tune.prefetch_hint, mlens_attn_tune.prefetch_every,
		       mlens_attn_tune.heads_per_task, output_names[o.output], o.block_runs);
		for (int i = 0; i < n_res; i++)
			printf("%s\n  {\"variant\": \"%s\", \"threads\": %d, \"kv_gbs\": %.2f, "
			       "\"kv_gbs_median\": %.2f, \"passes\": %d, \"read_bw_gbs\": %.2f, "
			       "\"fraction_of_read_bw\": %.3f}",
			       i ? "," : "", res[i].variant, res[i].threads, res[i].best_gbs,
			       res[i].median_gbs, res[i].reps, res[i].read_bw,
			       res[i].best_gbs / res[i].read_bw);
		printf("],\n \"speedup_vs_scalar_1thread\": {");
		for (int i = 0, k = 0; i < n_res; i++)
			if (res[i].threads == 1 && scalar_1t > 0)
				printf("%s\"%s\": %.2f", k++ ? ", " : "", res[i].variant,
				       res[i].best_gbs / scalar_1t);
		printf("},\n \"append\": [");
		for (int t = 0; t < o.n_threads; t++)
			printf("%s{\"threads\": %d, \"rows\": %d, \"gbs\": %.2f}", t ? ", " : "",
			       o.threads[t], APPEND_ROWS, append_gbs[t]);
		printf("]}\n");
	} else {
		printf("read bandwidth (streaming loads, %d threads): %.1f GB/s; output %s\n", max_t,
		       bw_all, output_names[o.output]);
		printf("%-8s %7s %10s %10s %9s\n", "variant", "threads", "KV GB/s", "read GB/s", "of read");
		for (int i = 0; i < n_res; i++)
			printf("%-8s %7d %10.2f %10.2f %8.0f%%\n", res[i].variant, res[i].threads,
			       res[i].best_gbs, res[i].read_bw, 100.0 * res[i].best_gbs / res[i].read_bw);
		for (int i = 0; i < n_res; i++)
			if (res[i].threads == 1 && scalar_1t > 0 && strcmp(res[i].variant, "scalar"))
				printf("%s / scalar (-O3) at 1 thread: %.2fx\n", res[i].variant,
				       res[i].best_gbs / scalar_1t);
		for (int t = 0; t < o.n_threads; t++)
			printf("KV append of %d rows, %d threads: %.2f GB/s read and written\n",
			       APPEND_ROWS, o.threads[t], append_gbs[t]);
	}
	batch_free(&b);
	return 0;
fail:
	fprintf(stderr, "attention: run failed: %s\n", strerror(-rc));
	free(bwbuf);
	batch_free(&b);
	return 1;
}
