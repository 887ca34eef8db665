/* mlens-bench ops: where the time of one engine step goes, op by op. Opens
 * a model in this process on a backend (the whole model on it: the CUDA
 * backend's GPU-only engine, or the CPU backend), fills the KV of --decode
 * sequences to --context tokens, then times steps of --prompts prompts of
 * --prompt-len tokens plus one decode token of each of those sequences:
 * every other step with a probe around each op (layer.h's probe,
 * mlens_engine_set_probe), the others bare. On a backend with timing marks
 * (CUDA: events; the CPU backend: its clock, its ops being synchronous)
 * the probe marks the compute queue before and after each op and nothing
 * waits: an op's time is the queue's between its marks, and the time
 * between ops inside the step is the launch gaps; elsewhere the probe
 * waits for the backend after each op and the rest of the step is the
 * gaps. Prints each op kind's time per step, its FLOPs and
 * rate where it has some, the gaps and the host time outside the GPU's. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "daemon/config.h"
#include "daemon/exec/engine.h"
#include "daemon/exec/layer.h"
#include "daemon/model/model.h"
#include "tests/bench/bench.h"

static double now_s(void)
{
	return (double)mlens_bench_now_ns() * 1e-9;
}

/* Ops one step may mark: two marks each, in the first half of the ids. */
#define MAX_MARKED (MLENS_BACKEND_TIMER_HALF / 2)

/* The probe. With marks: mark 2i before op i of the step and 2i + 1 after
 * it on the compute queue, read once the step is done (op_marks_read).
 * Without: each op's wall time up to the backend's sync after it. */
struct op_clock {
	const struct mlens_backend *be;
	bool marks;
	double t0;
	double t[MLENS_LAYER_OP_N];
	int calls[MLENS_LAYER_OP_N];
	int n;			/* ops marked this step */
	bool dropped;		/* more than MAX_MARKED */
	unsigned char op[MAX_MARKED];
};

static void op_begin(void *arg)
{
	struct op_clock *c = arg;
	if (!c->marks)
		c->t0 = now_s();
	else if (c->n < MAX_MARKED)
		c->be->ops->timer_mark(c->be->ctx, 0, 2 * c->n);
}

static int op_end(void *arg, enum mlens_layer_op op, double flops)
{
	struct op_clock *c = arg;
	int rc;
	(void)flops;	/* the table's FLOPs come from the step's shape, with it */
	if (c->marks) {
		if (c->n >= MAX_MARKED) {
			c->dropped = true;
			return 0;
		}
		c->op[c->n] = (unsigned char)op;
		return c->be->ops->timer_mark(c->be->ctx, 0, 2 * c->n++ + 1);
	}
	rc = c->be->ops->sync(c->be->ctx);
	c->t[op] += now_s() - c->t0;
	c->calls[op]++;
	return rc;
}

/* A marked step done (the backend synced): its ops' times added, the GPU
 * span from the first op's start to the last one's end in *span. */
static int op_marks_read(struct op_clock *c, double *span)
{
	double first = 0, last = 0;
	for (int i = 0; i < c->n; i++) {
		double a, b;
		int rc = c->be->ops->timer_read(c->be->ctx, 2 * i, &a);
		if (!rc)
			rc = c->be->ops->timer_read(c->be->ctx, 2 * i + 1, &b);
		if (rc)
			return rc;
		c->t[c->op[i]] += b - a;
		c->calls[c->op[i]]++;
		if (i == 0)
			first = a;
		last = b;
	}
	*span = last - first;
	c->n = 0;
	return 0;
}

/* The table's rows in the step's order, named by mlens_layer_op_name;
 * FLOPs from the step's shape. */
static const enum mlens_layer_op rows[] = {
	MLENS_LAYER_OP_EMBED, MLENS_LAYER_OP_NORM, MLENS_LAYER_OP_QKV, MLENS_LAYER_OP_ROPE,
	MLENS_LAYER_OP_KV_APPEND, MLENS_LAYER_OP_PREFILL, MLENS_LAYER_OP_DECODE, MLENS_LAYER_OP_WO,
	MLENS_LAYER_OP_ROUTER, MLENS_LAYER_OP_MOE, MLENS_LAYER_OP_LM_HEAD, MLENS_LAYER_OP_SAMPLE,
};
#define N_ROWS (int)(sizeof(rows) / sizeof(rows[0]))

struct ops_shape {
	int P, K, D, C;		/* prompt length, prompts, decode sequences, their context */
	bool prefill_op;	/* prefill rows through attn_prefill (else the paged path) */
};

/* FLOPs of op in one step (0: none counted) and its shape in words. */
static double op_flops(enum mlens_layer_op op, const struct mlens_model_config *c,
		       const struct ops_shape *s, char *shape, size_t len)
{
	double L = (double)c->num_hidden_layers, H = (double)c->hidden_size;
	double qd = (double)(c->num_attention_heads * c->head_dim);
	double kvd = (double)(c->num_key_value_heads * c->head_dim);
	double I = (double)c->intermediate_size, E = (double)c->num_local_experts;
	double k = (double)c->num_experts_per_tok, V = (double)c->vocab_size;
	double T = (double)s->K * s->P + s->D, rows_out = (double)s->K + s->D;
	/* causal (query, key) pairs of the prompts, and of the decode rows */
	double pre_pairs = (double)s->K * s->P * (s->P + 1.0) / 2, dec_pairs = (double)s->D * (s->C + 1.0);
	shape[0] = 0;
	switch (op) {
	case MLENS_LAYER_OP_QKV:
		snprintf(shape, len, "%.0f x %.0f -> %.0f", T, H, qd + 2 * kvd);
		return 2 * T * H * (qd + 2 * kvd) * L;
	case MLENS_LAYER_OP_WO:
		snprintf(shape, len, "%.0f x %.0f -> %.0f", T, qd, H);
		return 2 * T * qd * H * L;
	case MLENS_LAYER_OP_ROUTER:
		snprintf(shape, len, "%.0f x %.0f -> %.0f", T, H, E);
		return 2 * T * H * E * L;
	case MLENS_LAYER_OP_MOE:
		snprintf(shape, len, "%.0f rows x %.0f experts: %.0f -> 2x%.0f -> %.0f", T, k, H, I, H);
		return 2 * T * k * 3 * H * I * L;
	case MLENS_LAYER_OP_LM_HEAD:
		snprintf(shape, len, "%.0f x %.0f -> %.0f", rows_out, H, V);
		return 2 * rows_out * H * V;
	case MLENS_LAYER_OP_PREFILL:
		if (!s->prefill_op)
			return 0;
		snprintf(shape, len, "%d prompts of %d", s->K, s->P);
		return 4 * qd * pre_pairs * L;
	case MLENS_LAYER_OP_DECODE:
		if (!s->prefill_op) {
			snprintf(shape, len, "%d rows at %d, %d prompts of %d", s->D, s->C + 1, s->K, s->P);
			return 4 * qd * (dec_pairs + pre_pairs) * L;
		}
		snprintf(shape, len, "%d rows at %d", s->D, s->C + 1);
		return 4 * qd * dec_pairs * L;
	default:
		return 0;
	}
}

static int cmp_dbl(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: mlens-bench ops --model DIR [--backend auto|cpu|cuda] [--prompt-len P]\n"
		"       [--prompts K] [--decode D] [--context C] [--steps N] [--threads T] [--waits] [--json]\n"
		"  a step of K prompts of P tokens and one token of each of D sequences holding C;\n"
		"  N steps timed op by op, N without the probe; --waits: a wait after each op\n"
		"  instead of the backend's timing marks\n");
}

int mlens_bench_ops(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "model", 1, 0, 'm' }, { "backend", 1, 0, 'b' }, { "prompt-len", 1, 0, 'p' },
		{ "prompts", 1, 0, 'k' }, { "decode", 1, 0, 'd' }, { "context", 1, 0, 'c' },
		{ "steps", 1, 0, 'n' }, { "threads", 1, 0, 't' }, { "json", 0, 0, 'j' }, { "waits", 0, 0, 'w' },
		{ "help", 0, 0, 'h' }, { 0, 0, 0, 0 }
	};
	const char *model_dir = NULL, *backend = "auto";
	struct ops_shape sh = { .P = 512, .K = 4, .D = 64, .C = 512 };
	int steps = 5, threads = 0, opt, rc = 1, T, bs = 16;
	bool json = false, have_be = false, waits = false;
	struct mlens_model *m = NULL;
	struct mlens_backend be;
	struct mlens_backend_opts bo = { 0 };
	struct mlens_engine *e = NULL;
	struct mlens_engine_opts eo = { .kv_dtype = -1, .prefill_attn = MLENS_PREFILL_AUTO };
	struct mlens_seq *seqs = NULL;
	struct mlens_engine_req *reqs = NULL;
	int32_t *tok = NULL, *next = NULL;
	double *bare = NULL, probed = 0, span = 0, ops_sum = 0, bare_med, gaps, host;
	struct op_clock clk = { 0 };
	const struct mlens_layer_probe probe = { op_begin, op_end, &clk };
	const struct mlens_model_config *c;
	char err[512];

	optind = 1;
	while ((opt = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		long long v = 0;
		if (strchr("pkdcnt", opt)) {
			v = mlens_bench_parse_count(optarg);
			if (v < 0 || v > 1 << 24) {
				fprintf(stderr, "ops: bad number '%s'\n", optarg);
				return 2;
			}
		}
		switch (opt) {
		case 'm': model_dir = optarg; break;
		case 'b': backend = optarg; break;
		case 'p': sh.P = (int)v; break;
		case 'k': sh.K = (int)v; break;
		case 'd': sh.D = (int)v; break;
		case 'c': sh.C = (int)v; break;
		case 'n': steps = (int)v; break;
		case 't': threads = (int)v; break;
		case 'j': json = true; break;
		case 'w': waits = true; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (!model_dir || steps < 1 || (sh.K < 1 && sh.D < 1) || (sh.K > 0 && sh.P < 1) ||
	    (sh.D > 0 && sh.C < 1)) {
		usage(stderr);
		return 2;
	}
	if (sh.K < 1)
		sh.P = 0;
	T = sh.K * sh.P + sh.D;
	if (mlens_model_open(model_dir, &m, err, sizeof(err))) {
		fprintf(stderr, "ops: %s\n", err);
		return 1;
	}
	c = &m->cfg;
	if ((int64_t)sh.C + 2 * steps + 2 > c->max_position_embeddings || sh.P >= c->max_position_embeddings) {
		fprintf(stderr, "ops: --context %d plus %d steps, or --prompt-len %d, is past the model's %lld "
			"positions\n", sh.C, 2 * steps + 1, sh.P, (long long)c->max_position_embeddings);
		goto out;
	}
	{
		/* the backend as mlensd starts it on this model with its defaults
		 * (prefill attention, GEMM mode, copies, streams, waits) */
		struct mlens_config cfg;
		mlens_config_defaults(&cfg);
		mlens_config_backend_opts(&cfg, c->dtype == MLENS_DTYPE_F32, &bo);
		mlens_config_free(&cfg);
	}
	bo.n_threads = threads;
	if ((rc = mlens_backend_create(&be, backend, &bo))) {
		fprintf(stderr, "ops: cannot create the %s backend: %s\n", backend, strerror(-rc));
		rc = 1;
		goto out;
	}
	have_be = true;
	rc = 1;
	eo.kv_block_size = bs;
	eo.max_step_tokens = T > sh.C ? T : sh.C;
	eo.kv_blocks = (uint32_t)(sh.D * ((sh.C + 2 * steps + 2) / bs + 2) + sh.K * (sh.P / bs + 2) + 4);
	if (mlens_engine_create(&e, m, &be, &eo, err, sizeof(err))) {
		fprintf(stderr, "ops: %s\n", err);
		goto out;
	}
	sh.prefill_op = !be.ops->host_memory;	/* MLENS_PREFILL_AUTO's choice */
	seqs = calloc((size_t)(sh.K + sh.D), sizeof(*seqs));
	reqs = calloc((size_t)(sh.K + sh.D), sizeof(*reqs));
	tok = malloc((size_t)(eo.max_step_tokens) * sizeof(*tok));
	next = calloc((size_t)(sh.D + 1), sizeof(*next));
	bare = calloc((size_t)steps, sizeof(*bare));
	if (!seqs || !reqs || !tok || !next || !bare) {
		fprintf(stderr, "ops: out of memory\n");
		goto out;
	}
	for (int i = 0; i < eo.max_step_tokens; i++)
		tok[i] = (int32_t)((i * 7919 + 13) % c->vocab_size);
	/* the decode sequences' context, one prefill each */
	for (int d = 0; d < sh.D; d++) {
		struct mlens_engine_req r = { .seq = &seqs[sh.K + d], .tokens = tok, .n_tokens = sh.C };
		r.samp.top_p = 1.0f;
		if ((rc = mlens_engine_step(e, &r, 1))) {
			fprintf(stderr, "ops: filling the context of sequence %d: %s\n", d, strerror(-rc));
			rc = 1;
			goto out;
		}
		next[d] = r.next_token;
	}
	/* step 0 warms up; then bare and probed in turn */
	for (int s = 0; s <= 2 * steps; s++) {
		bool with_probe = s > 0 && s % 2 == 0;
		double t0;
		int n = 0;
		for (int k = 0; k < sh.K; k++) {
			reqs[n] = (struct mlens_engine_req){ .seq = &seqs[k], .tokens = tok + k, .n_tokens = sh.P };
			reqs[n++].samp.top_p = 1.0f;
		}
		for (int d = 0; d < sh.D; d++) {
			reqs[n] = (struct mlens_engine_req){ .seq = &seqs[sh.K + d], .tokens = &next[d],
							     .n_tokens = 1 };
			reqs[n++].samp.top_p = 1.0f;
		}
		mlens_engine_set_probe(e, with_probe ? &probe : NULL);
		clk.be = &be;
		clk.marks = !waits && be.ops->timer_mark && be.ops->timer_read;
		t0 = now_s();
		rc = mlens_engine_step(e, reqs, n);
		if (!rc)
			rc = be.ops->sync(be.ctx);
		t0 = now_s() - t0;
		mlens_engine_set_probe(e, NULL);
		if (rc) {
			fprintf(stderr, "ops: step %d: %s\n", s, strerror(-rc));
			rc = 1;
			goto out;
		}
		for (int d = 0; d < sh.D; d++)
			next[d] = reqs[sh.K + d].next_token;
		for (int k = 0; k < sh.K; k++)
			mlens_seq_release(mlens_engine_kv(e), &seqs[k]);
		if (with_probe && clk.marks) {
			double sp;
			if ((rc = op_marks_read(&clk, &sp))) {
				fprintf(stderr, "ops: step %d: reading the timing marks: %s\n", s, strerror(-rc));
				rc = 1;
				goto out;
			}
			span += sp;
		}
		if (with_probe)
			probed += t0;
		else if (s > 0)
			bare[(s - 1) / 2] = t0;
	}
	probed /= steps;
	span /= steps;
	if (clk.dropped)
		fprintf(stderr, "ops: a step has more than %d ops: the later ones are not timed (in the gaps)\n",
			MAX_MARKED);
	for (int o = 0; o < MLENS_LAYER_OP_N; o++) {
		clk.t[o] /= steps;
		ops_sum += clk.t[o];
	}
	qsort(bare, (size_t)steps, sizeof(*bare), cmp_dbl);
	bare_med = bare[steps / 2];
	/* with marks: GPU idle between ops, and host time outside the GPU's
	 * span; with waits: the rest of the step */
	gaps = clk.marks ? span - ops_sum : probed - ops_sum;
	host = clk.marks ? probed - span : 0;

	{
		json_t *out = json_pack("{s:s,s:s,s:s,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:b,s:f,s:f,s:f,s:f,s:f}",
			"bench", "ops", "model", model_dir, "backend", be.ops->name,
			"timing", clk.marks ? "marks" : "waits",
			"tokens", T, "prompts", sh.K, "prompt_len", sh.P, "decode", sh.D, "context", sh.C,
			"steps", steps, "prefill_op", sh.prefill_op, "step_seconds", bare_med,
			"probed_step_seconds", probed, "ops_seconds", ops_sum,
			"gaps_seconds", gaps, "host_seconds", host);
		json_t *arr = json_array();
		if (!json)
			printf("%-32s %10s %7s %10s %9s  %s\n", "op", "ms/step", "share", "GFLOP", "TFLOP/s", "shape");
		for (int i = 0; i < N_ROWS; i++) {
			char shape[128];
			const char *name = mlens_layer_op_name(rows[i]);
			double f = op_flops(rows[i], c, &sh, shape, sizeof(shape)), t = clk.t[rows[i]];
			double rate = f > 0 && t > 0 ? f / t / 1e12 : NAN;
			json_array_append_new(arr, json_pack("{s:s,s:f,s:i,s:f,s:o,s:s}", "op", name,
				"seconds", t, "calls", clk.calls[rows[i]] / steps, "flops", f,
				"tflops", isfinite(rate) ? json_real(rate) : json_null(), "shape", shape));
			if (!json && clk.calls[rows[i]])
				printf("%-32s %10.3f %6.1f%% %10.3f %9s  %s\n", name, t * 1e3,
				       100 * t / probed, f / 1e9, isfinite(rate) ? (snprintf(err, sizeof(err), "%.2f", rate), err) : "",
				       shape);
		}
		json_object_set_new(out, "ops", arr);
		/* the backend options mlensd's defaults pick (CUDA ones; the
		 * CPU backend ignores them) */
		json_object_set_new(out, "backend_opts", json_pack("{s:s,s:s}", "gemm", mlens_gemm_mode_name(bo.gemm),
			"prefill_attention", bo.prefill_bf16 ? "bf16" : "fp32"));
		if (json) {
			json_dumpf(out, stdout, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
			printf("\n");
		} else {
			printf("%-32s %10.3f %6.1f%%\n", clk.marks ? "gaps between ops (launches)" : "launch gaps, host work",
			       gaps * 1e3, 100 * gaps / probed);
			if (clk.marks)
				printf("%-32s %10.3f %6.1f%%\n", "host, outside the ops' span", host * 1e3,
				       100 * host / probed);
			printf("%-32s %10.3f  (%d prompts of %d + %d decodes at %d: %d tokens, %s backend, %s)\n",
			       "step, ops timed", probed * 1e3, sh.K, sh.P, sh.D, sh.C, T, be.ops->name,
			       clk.marks ? "the backend's timing marks" : "a wait after each op");
			printf("%-32s %10.3f  (median of %d)\n", "step, bare", bare_med * 1e3, steps);
			if (!be.ops->host_memory)
				printf("%-32s %s GEMMs, %s prefill attention (mlensd's defaults)\n", "backend options",
				       mlens_gemm_mode_name(bo.gemm), bo.prefill_bf16 ? "bf16" : "fp32");
		}
		json_decref(out);
	}
	rc = 0;
out:
	if (seqs && e)
		for (int i = 0; i < sh.K + sh.D; i++)
			mlens_seq_fini(mlens_engine_kv(e), &seqs[i]);
	free(seqs);
	free(reqs);
	free(tok);
	free(next);
	free(bare);
	if (e)
		mlens_engine_destroy(e);
	if (have_be)
		mlens_backend_destroy(&be);
	if (m)
		mlens_model_close(m);
	return rc;
}
