/* Benchmark of the hybrid pipeline on a random bf16 Mixtral-
 * shaped test model held in host memory: every expert streamed through the
 * two slots, decode attention on the CPU. n_seq sequences prefill ctx
 * tokens each (in steps of at most the cap), then decode steps of n_seq
 * tokens; per decode step: seconds, streamed bytes and the PCIe rate they
 * reach, CPU attention and host wait time; the same steps on the GPU-only
 * engine when the model fits. Prints one JSON object on stdout.
 * Usage: bench_hybrid [hidden inter layers experts n_seq ctx groups]. Not a
 * test: it asserts nothing. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "daemon/plan/gpu_plan.h"
#include "daemon/exec/pipeline.h"
#include "tests/testmodel.h"

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define DECODE_STEPS 6

struct result {
	double step_s, cpu_attn_s, host_wait_s;
	unsigned long long weight_bytes;
};

/* Prefill then decode; the average over the decode steps but the first. */
static int run(struct mlens_engine *e, int n_seq, int ctx, int vocab, struct result *res)
{
	struct mlens_seq *seq = calloc((size_t)n_seq, sizeof(*seq));
	struct mlens_engine_req *r = calloc((size_t)n_seq, sizeof(*r));
	int32_t *prompt = calloc((size_t)ctx, sizeof(int32_t)), *next = calloc((size_t)n_seq, 4);
	int cap = mlens_engine_max_step_tokens(e), per = cap / ctx, rc = 0;
	struct mlens_pipeline *p = mlens_engine_pipeline(e);

	memset(res, 0, sizeof(*res));
	if (!seq || !r || !prompt || !next || per < 1) {
		rc = -ENOMEM;
		goto out;
	}
	for (int j = 0; j < ctx; j++)
		prompt[j] = (j * 37 + 11) % vocab;
	for (int i0 = 0; i0 < n_seq && !rc; i0 += per) {
		int n = n_seq - i0 < per ? n_seq - i0 : per;
		for (int k = 0; k < n; k++) {
			memset(&r[k], 0, sizeof(r[k]));
			r[k].seq = &seq[i0 + k];
			r[k].tokens = prompt;
			r[k].n_tokens = ctx;
		}
		rc = mlens_engine_step(e, r, n);
		for (int k = 0; k < n && !rc; k++)
			next[i0 + k] = r[k].next_token;
	}
	for (int s = 0; s < DECODE_STEPS && !rc; s++) {
		double t0;
		for (int i = 0; i < n_seq; i++) {
			memset(&r[i], 0, sizeof(r[i]));
			r[i].seq = &seq[i];
			r[i].tokens = &next[i];
			r[i].n_tokens = 1;
		}
		t0 = now();
		rc = mlens_engine_step(e, r, n_seq);
		if (rc || s == 0)
			continue;	/* the first decode step warms up */
		res->step_s += (now() - t0) / (DECODE_STEPS - 1);
		if (p) {
			const struct mlens_pipeline_stats *st = mlens_pipeline_stats(p);
			res->cpu_attn_s += st->cpu_attn_s / (DECODE_STEPS - 1);
			res->host_wait_s += st->host_wait_s / (DECODE_STEPS - 1);
			res->weight_bytes = st->h2d_weight_bytes;
		}
		for (int i = 0; i < n_seq; i++)
			next[i] = r[i].next_token;
	}
	for (int i = 0; i < n_seq; i++)
		mlens_seq_fini(mlens_engine_kv(e), &seq[i]);
out:
	free(seq);
	free(r);
	free(prompt);
	free(next);
	return rc;
}

int main(int argc, char **argv)
{
	struct mlens_test_spec ts = { 4096, 2048, 7168, 4, 16, 4, 128, 8, 2, 4096, MLENS_DTYPE_BF16,
				      1e6, 3 };
	int n_seq = 256, ctx = 64, groups = 2, cap;
	struct mlens_backend_opts bo = { .n_threads = 0, .device = 0 };
	struct mlens_backend g, c;
	struct mlens_engine *e;
	struct mlens_model *m;
	struct mlens_perf_model pm;
	struct mlens_gpu_plan plan;
	struct mlens_gpu_plan_in in = { 0 };
	struct mlens_engine_opts eo = { .kv_dtype = -1 };
	struct result hy, go;
	char err[512], line[512];
	double t0;
	int rc;

	if (argc > 1)
		ts.hidden = atoi(argv[1]);
	if (argc > 2)
		ts.inter = atoi(argv[2]);
	if (argc > 3)
		ts.layers = atoi(argv[3]);
	if (argc > 4)
		ts.experts = atoi(argv[4]);
	if (argc > 5)
		n_seq = atoi(argv[5]);
	if (argc > 6)
		ctx = atoi(argv[6]);
	if (argc > 7)
		groups = atoi(argv[7]);
	if (!mlens_cuda_available()) {
		fprintf(stderr, "bench_hybrid: no CUDA GPU here\n");
		return 77;
	}
	cap = n_seq * ctx < 16384 ? n_seq * ctx : 16384;
	if (cap < n_seq)
		cap = n_seq;
	t0 = now();
	m = mlens_test_model_new(&ts);
	if (!m) {
		fprintf(stderr, "bench_hybrid: cannot build the test model\n");
		return 1;
	}
	fprintf(stderr, "bench_hybrid: model built in %.1f s\n", now() - t0);
	mlens_perf_model_from_config(&pm, &m->cfg, MLENS_DTYPE_BF16);
	in.budget = UINT64_MAX / 4;
	in.max_tokens = cap;
	in.min_tokens = cap;
	if ((rc = mlens_gpu_plan_make(&pm, &in, &plan, err, sizeof(err)))) {
		fprintf(stderr, "bench_hybrid: %s\n", err);
		return 1;
	}
	eo.max_step_tokens = cap;
	eo.kv_blocks = (uint32_t)(n_seq * ((ctx + DECODE_STEPS + 15) / 16 + 1));
	if (mlens_backend_create(&g, "cuda", &bo) || mlens_backend_cpu_create(&c, &bo))
		return 1;
	eo.attn_backend = &c;
	/* the plan the pipeline runs: every expert streamed, at that minimum */
	in.budget = plan.minimum;
	in.min_tokens = 0;
	if ((rc = mlens_gpu_plan_make(&pm, &in, &plan, err, sizeof(err)))) {
		fprintf(stderr, "bench_hybrid: %s\n", err);
		return 1;
	}
	eo.plan = &plan;
	eo.hybrid_groups = groups;
	if ((rc = mlens_engine_create(&e, m, &g, &eo, err, sizeof(err)))) {
		fprintf(stderr, "bench_hybrid: %s\n", err);
		return 1;
	}
	mlens_gpu_plan_format(mlens_pipeline_plan(mlens_engine_pipeline(e)), &pm, line, sizeof(line));
	fprintf(stderr, "%s\n", line);
	rc = run(e, n_seq, ctx, ts.vocab, &hy);
	mlens_engine_destroy(e);
	mlens_backend_destroy(&g);
	mlens_backend_destroy(&c);
	if (rc) {
		fprintf(stderr, "bench_hybrid: hybrid run: %s\n", strerror(-rc));
		return 1;
	}
	memset(&go, 0, sizeof(go));
	eo.attn_backend = NULL;
	if (!mlens_backend_create(&g, "cuda", &bo)) {
		if (!mlens_engine_create(&e, m, &g, &eo, err, sizeof(err))) {
			if (run(e, n_seq, ctx, ts.vocab, &go))
				memset(&go, 0, sizeof(go));
			mlens_engine_destroy(e);
		}
		mlens_backend_destroy(&g);
	}
	printf("{\"model\": {\"hidden\": %d, \"inter\": %d, \"layers\": %d, \"experts\": %d, "
	       "\"expert_bytes\": %llu}, \"n_seq\": %d, \"ctx\": %d, \"groups\": %d, "
	       "\"budget\": %llu, \"hybrid\": {\"decode_step_s\": %.6f, \"weight_bytes\": %llu, "
	       "\"pcie_gb_s\": %.2f, \"cpu_attn_s\": %.6f, \"host_wait_s\": %.6f, "
	       "\"decode_tok_s\": %.1f}, \"gpu_only\": {\"decode_step_s\": %.6f, "
	       "\"decode_tok_s\": %.1f}}\n",
	       ts.hidden, ts.inter, ts.layers, ts.experts, (unsigned long long)pm.expert_bytes,
	       n_seq, ctx, groups, (unsigned long long)plan.minimum, hy.step_s, hy.weight_bytes,
	       hy.step_s > 0 ? (double)hy.weight_bytes / hy.step_s / 1e9 : 0, hy.cpu_attn_s,
	       hy.host_wait_s, hy.step_s > 0 ? n_seq / hy.step_s : 0, go.step_s,
	       go.step_s > 0 ? n_seq / go.step_s : 0);
	mlens_test_model_free(m);
	return 0;
}
