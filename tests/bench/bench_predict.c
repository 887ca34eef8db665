/* mlens-bench predict: the daemon's performance model replayed on recorded
 * measurements, without the model's weights or a GPU. It reads a model's
 * config.json and a profile cache (profile_cache = FILE of a hybrid run,
 * e.g. the one tests/bench/hybrid.sh keeps), sets up the model as mlensd
 * does in hybrid mode (GPU budget, its memory plan's activation bytes, KV
 * pool capacity) and prints what mlensctl profile and mlens-bench serve
 * --predict would: n_real, the binding resource and, for a token cap and
 * sequences in flight, the scheduler's steady state (perfmodel.h,
 * mlens_perf_sched_steady) with the model's time for that step. So a change
 * to the model can be checked against runs measured before, here. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/config.h"
#include "daemon/plan/gpu_plan.h"
#include "daemon/exec/kv_pool.h"
#include "daemon/model/model.h"
#include "daemon/plan/perfmodel.h"
#include "daemon/plan/profiler.h"
#include "tests/bench/bench.h"

static int bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad(const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "predict: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return 2;
}

/* A positive count (K/M/G suffixes) into *out; 0, or -1 with the message. */
static int count_arg(const char *flag, const char *arg, long long *out)
{
	long long v = mlens_bench_parse_count(arg);
	if (v < 1) {
		bad("%s '%s' is not a positive count", flag, arg);
		return -1;
	}
	*out = v;
	return 0;
}

int mlens_bench_predict(int argc, char **argv)
{
	static const struct option lo[] = {
		{ "config", 1, 0, 'c' }, { "profile", 1, 0, 'f' }, { "gpu-memory", 1, 0, 'G' },
		{ "kv-cache", 1, 0, 'k' }, { "kv-block", 1, 0, 'b' }, { "group-tokens", 1, 0, 'r' },
		{ "gemm", 1, 0, 'e' }, { "prompt-len", 1, 0, 'p' }, { "gen-len", 1, 0, 'g' },
		{ "cap", 1, 0, 'n' }, { "in-flight", 1, 0, 's' }, { "json", 0, 0, 'j' },
		{ "no-shared-io", 0, 0, 'S' }, { "gpu-copy-out", 1, 0, 'o' },
		{ "kv-append", 1, 0, 'A' }, { "attn-up", 1, 0, 'U' },
		{ "pipeline-sets", 1, 0, 'P' }, { 0, 0, 0, 0 }
	};
	const char *config = NULL, *profile = NULL;
	uint64_t gpu = 8ull << 30, kv = 40ull << 30;
	long long block = 16, group = 3072, cap = 0, sets = 3, n;
	double in_flight = 0;
	double p = MLENS_PROFILE_PROMPT, g = MLENS_PROFILE_GEN;
	enum mlens_gemm_mode gemm = MLENS_GEMM_FAST;
	bool json = false, no_shared = false, side = true, up = false, gpu_append = true;	/* mlensd's defaults */
	bool half_up = true;	/* attn_up = half, taken with fast GEMMs of bf16/f16 weights */
	struct mlens_model_config cfg;
	struct mlens_profile_state st;
	struct mlens_perf_sched_state ss;
	char err[512];
	double kv_tokens, per_token, step_s = NAN;
	int c, rc;

	optind = 1;
	while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		switch (c) {
		case 'c': config = optarg; break;
		case 'f': profile = optarg; break;
		case 'G':
			if (mlens_parse_size(optarg, &gpu))
				return bad("--gpu-memory '%s' is not a size", optarg);
			break;
		case 'k':
			if (mlens_parse_size(optarg, &kv))
				return bad("--kv-cache '%s' is not a size", optarg);
			break;
		case 'b': if (count_arg("--kv-block", optarg, &block)) return 2; break;
		case 'r': if (count_arg("--group-tokens", optarg, &group)) return 2; break;
		case 'e':
			if (mlens_gemm_mode_parse(optarg, &gemm))
				return bad("--gemm '%s' is not fast or exact", optarg);
			break;
		case 'p': if (count_arg("--prompt-len", optarg, &n)) return 2; p = (double)n; break;
		case 'g': if (count_arg("--gen-len", optarg, &n)) return 2; g = (double)n; break;
		case 'n': if (count_arg("--cap", optarg, &cap)) return 2; break;
		case 's': if (count_arg("--in-flight", optarg, &n)) return 2; in_flight = (double)n; break;
		case 'j': json = true; break;
		case 'S': no_shared = true; break;
		case 'o':
			if (strcmp(optarg, "compute") && strcmp(optarg, "down") && strcmp(optarg, "side"))
				return bad("--gpu-copy-out '%s' is not compute, down or side", optarg);
			side = strcmp(optarg, "compute") != 0;
			up = !strcmp(optarg, "side");
			break;
		case 'A':
			if (strcmp(optarg, "gpu") && strcmp(optarg, "cpu"))
				return bad("--kv-append '%s' is not gpu or cpu", optarg);
			gpu_append = !strcmp(optarg, "gpu");
			break;
		case 'P':
			if (count_arg("--pipeline-sets", optarg, &sets))
				return 2;
			if (sets != 2 && sets != 3)
				return bad("--pipeline-sets '%s' is not 2 or 3", optarg);
			break;
		case 'U':
			if (strcmp(optarg, "half") && strcmp(optarg, "fp32"))
				return bad("--attn-up '%s' is not half or fp32", optarg);
			half_up = !strcmp(optarg, "half");
			break;
		default: return 2;
		}
	}
	if (!config || !profile)
		return bad("%s", "--config FILE (a model's config.json) and --profile FILE (a profile "
			   "cache) are needed");
	if ((rc = mlens_model_read_config(config, &cfg, err, sizeof(err)))) {
		fprintf(stderr, "predict: %s\n", err);
		return 1;
	}
	memset(&st, 0, sizeof(st));
	if (mlens_perf_model_from_config(&st.pm, &cfg, mlens_kv_dtype(&cfg, -1))) {
		fprintf(stderr, "predict: %s: the model's dimensions are out of range\n", config);
		return 1;
	}
	if ((rc = mlens_profile_load(profile, NULL, &st.prof, err, sizeof(err)))) {
		fprintf(stderr, "predict: %s\n", err);
		return 1;
	}
	/* as mlensd's profile_setup and mlens_profile_state_run set it up in
	 * hybrid mode (KV blocks as kv_blocks_for counts them) */
	per_token = (double)cfg.num_hidden_layers * (double)st.pm.kv_token_bytes;	/* K and V, all layers */
	kv_tokens = floor((double)kv / (per_token * (double)block)) * (double)block;
	st.hybrid = true;
	st.kv_tokens = kv_tokens;
	st.gpu_budget = gpu;
	st.gpu_workspace = MLENS_GPU_PLAN_WORKSPACE;
	st.chunk = MLENS_GPU_PLAN_CHUNK;
	st.plan_in.group = group;
	st.plan_in.gemm = gemm;
	st.plan_in.sets = (int)sets;
	st.side_copy_out = side;
	st.up_copy_in = up;
	st.gpu_kv_append = gpu_append;
	/* as the CUDA backend takes attn_up = half (mlens_pipeline_half_att) */
	st.att_up_half = half_up && gemm == MLENS_GEMM_FAST && mlens_dtype_size(cfg.dtype) == 2;
	mlens_profile_state_hold(&st);
	/* the model as it was before the shared-memory refinement */
	if (no_shared)
		st.hw.b_io_shared = 0;
	if ((rc = mlens_profile_state_predict(&st, p, g))) {
		fprintf(stderr, "predict: %s\n", st.err[0] ? st.err : strerror(-rc));
		return 1;
	}
	/* mlens-bench serve --predict: the steady state the scheduler reaches
	 * with the cap it ran and the sequences in flight */
	if (!cap)
		cap = (long long)mlens_perf_token_cap(&st.pred);
	if (!in_flight)	/* the sequences the KV pool holds, as mlens-bench serve counts them */
		in_flight = kv_tokens / (double)block / mlens_perf_seq_blocks(p, g, (int)block);
	rc = mlens_perf_sched_steady(p, g, (double)cap, in_flight, &ss);
	if (!rc)
		step_s = mlens_profile_state_step_seconds(&st, ss.tokens);
	if (json) {
		json_t *o = mlens_profile_state_json(&st);
		json_object_set_new(o, "cap", json_integer(cap));
		json_object_set_new(o, "in_flight", json_real(in_flight));
		if (!rc && isfinite(step_s))
			json_object_set_new(o, "steady", json_pack("{s:f,s:f,s:f,s:f}", "step_tokens", ss.tokens,
								   "step_seconds", step_s, "generated_tokens_per_s",
								   ss.generated / step_s, "total_tokens_per_s",
								   ss.prompts * (p + g) / step_s));
		json_dumpf(o, stdout, JSON_INDENT(1) | JSON_REAL_PRECISION(12));
		putchar('\n');
		json_decref(o);
		return 0;
	}
	printf("model %s, profile %s (%s)\n", config, profile, st.prof.gpu[0] ? st.prof.gpu : st.prof.backend);
	printf("workload p=%.0f g=%.0f, KV %.0f tokens, GPU budget %.2f GiB, groups of %lld\n", p, g, kv_tokens,
	       (double)gpu / 1073741824.0, group);
	printf("n_real %.0f (%s; n_eq %.0f, n_act %.0f), binds %s\n", st.pred.n_real,
	       mlens_perf_limit_name(st.pred.limit), st.pred.n_eq, st.pred.n_act,
	       mlens_perf_bind_name(st.pred.time.bind));
	if (rc || !isfinite(step_s)) {
		printf("no steady state for a cap of %lld tokens and %.0f sequences in flight\n", cap, in_flight);
		return 1;
	}
	printf("cap %lld, %.0f in flight: steps of %.0f tokens in %.4f s: %.1f generated / %.1f total tokens/s\n",
	       cap, in_flight, ss.tokens, step_s, ss.generated / step_s, ss.prompts * (p + g) / step_s);
	return 0;
}
