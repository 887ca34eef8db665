/* Description: numerics against Hugging Face transformers. For every fixture
 * under tests/golden/ (small random Mixtral, Qwen3-MoE, Qwen2-MoE and OLMoE
 * models, references made by tests/golden/make_golden.py and
 * make_golden_families.py) the engine on the backend named by
 * MLENS_TEST_BACKEND (default cpu; exit 77 when it cannot be created) must
 * reproduce: prefill logits of every position, decode logits step by step,
 * greedy tokens (up to the first reference near-tie), and agree with itself
 * batched vs unbatched and prefill-then-decode vs all-at-once. Measured
 * errors are printed per fixture. MLENS_TEST_GEMM (fast, the default, or
 * exact) picks the GPU backend's GEMM mode: exact holds half-precision
 * fixtures to their own tolerances; fast loosens them and stops each
 * comparison where the fast GEMMs may flip an expert choice
 * (mlens_golden_fast_cut). */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tests/golden/golden.h"
#include "tests/gpulock.h"

static const char *backend = "cpu";
static enum mlens_gemm_mode gemm = MLENS_GEMM_FAST;
static char label[64] = "cpu";	/* backend, and the GEMM mode on a GPU */
static char **fixtures;
static int n_fixtures;

struct fx {
	struct mlens_golden *g;
	struct mlens_golden_engine ge;
	size_t V;
};

static void fx_open(struct fx *f, int i)
{
	char err[512];
	int rc = mlens_golden_open(fixtures[i], &f->g, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s", err);
	rc = mlens_golden_engine_open(&f->ge, fixtures[i], backend, gemm, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s", err);
	f->V = (size_t)f->g->vocab;
	ck_assert_int_eq(mlens_engine_config(f->ge.e)->vocab_size, f->g->vocab);
}

static void fx_close(struct fx *f)
{
	mlens_golden_engine_close(&f->ge);
	mlens_golden_close(f->g);
}

static void *xmalloc(size_t n)
{
	void *p = malloc(n);
	ck_assert_ptr_nonnull(p);
	return p;
}

/* The CUDA backend's fast GEMMs round activations to the weight dtype
 * before the tensor cores (kernels/cuda/backend_cuda.cu): about 2^-9
 * relative per element for bf16, compounding over layers. The fixtures'
 * tolerances were set for the CPU's fp32 activations, so a half-precision
 * fixture run that way gets at least this tolerance (measured on an H200:
 * 5.7e-3 for m2-hd32-top3-bf16). fp32 fixtures and exact GEMMs keep
 * theirs. */
#define GPU_HALF_TOL 2e-2

/* This run rounds the fixture's GEMM activations: a GPU-side backend in
 * fast mode on half-precision weights. */
static bool rounds(const struct fx *f)
{
	return strcmp(mlens_golden_gpu_side(backend), "cpu") && gemm == MLENS_GEMM_FAST &&
	       strcmp(f->g->dtype, "float32");
}

static double tol_for(const struct fx *f, double t)
{
	if (rounds(f) && t < GPU_HALF_TOL)
		return GPU_HALF_TOL;
	return t;
}

/* A GPU-side backend sums in another order than the CPU (cuBLAS picks its
 * kernels by row count, and rows group differently batched and alone), so
 * with a bf16 KV cache a few K/V elements round to the other bf16
 * neighbour, and that moves logits more than the order itself: measured on
 * an H200 with exact GEMMs, 1.13e-3 against the bf16-KV reference (the
 * CPU: 4.3e-4) and 2.7e-4 batched against alone. Such runs get twice the
 * fixture's bf16-KV tolerance for both comparisons. */
static bool kv_flips(const struct fx *f)
{
	return strcmp(mlens_golden_gpu_side(backend), "cpu") && strcmp(f->g->dtype, "float32");
}

static double kv_tol(const struct fx *f)
{
	return kv_flips(f) ? fmax(tol_for(f, f->g->tol_kv_bf16), 2 * f->g->tol_kv_bf16) :
			     tol_for(f, f->g->tol_kv_bf16);
}

static double batched_tol(const struct fx *f)
{
	return kv_flips(f) ? fmax(tol_for(f, f->g->tol_prefill), 2 * f->g->tol_kv_bf16) :
			     tol_for(f, f->g->tol_prefill);
}

/* Positions of prompt p (prompt tokens, then one per greedy step: step s
 * is position len-1+s) that this run compares: all, or when it rounds,
 * those before mlens_golden_fast_cut, said once per prompt. */
static int positions(const struct fx *f, int p, const char *what)
{
	const struct mlens_golden_prompt *pr = &f->g->prompts[p];
	int all = pr->len + f->g->n_gen - 1, cut;
	double most = 0;

	if (!rounds(f))
		return all;
	cut = mlens_golden_fast_cut(pr);
	ck_assert_msg(cut >= 0, "%s: no router_rel_gap / router_rel_shift_fast for prompt %d, which "
		      "fast GEMMs need: regenerate it with tests/golden/make_golden.py",
		      f->g->name, p);
	if (cut == all)
		return all;
	for (int i = 0; i <= cut; i++)
		most = fmax(most, (double)pr->router_rel_shift_fast[i]);
	printf("golden %s [%s] %s prompt %d: positions 0..%d of %d compared; position %d has "
	       "relative router gap %.3g <= 2 x %.3g, the most fast GEMMs move router logits up to it\n",
	       f->g->name, label, what, p, cut - 1, all, cut, pr->router_rel_gap[cut], most);
	fflush(stdout);
	return cut;
}

/* Free-running steps of prompt p (of n) whose logits come from the main
 * reference's sequence, where the router data apply: up to and including
 * the first token tok differs from it (all n when the run does not round). */
static int on_reference(const struct fx *f, int p, const int32_t *tok, int n)
{
	const int32_t *ref = f->g->prompts[p].main.greedy;
	if (!rounds(f))
		return n;
	for (int s = 0; s < n; s++)
		if (tok[s] != ref[s])
			return s + 1;
	return n;
}

/* Greedy steps of prompt p (at most n) that this run compares. */
static int steps(const struct fx *f, int p, int n, const char *what)
{
	int s = positions(f, p, what) - (f->g->prompts[p].len - 1);
	return s < 0 ? 0 : s < n ? s : n;
}

static void report(const struct fx *f, const char *what, double got, double tol)
{
	printf("golden %s [%s] %s: max rel %.3g (tolerance %.3g)\n", f->g->name, label, what,
	       got, tol);
	fflush(stdout);
}

/* (a) logits of every prompt position, one prefill per prompt. */
START_TEST(prefill_logits)
{
	struct fx f;
	double worst = 0;

	fx_open(&f, _i);
	for (int p = 0; p < f.g->n_prompts; p++) {
		const struct mlens_golden_prompt *pr = &f.g->prompts[p];
		float *lg = xmalloc((size_t)pr->len * f.V * sizeof(float));
		int L = positions(&f, p, "prefill");
		ck_assert_int_eq(mlens_golden_prefill(&f.ge, pr->tokens, pr->len, lg), 0);
		for (int t = 0; t < pr->len && t < L; t++) {
			double d = mlens_golden_rel_diff(lg + t * f.V, pr->prefill_logits + t * f.V, f.V);
			ck_assert_msg(d <= tol_for(&f, f.g->tol_prefill),
				      "%s prompt %d position %d: rel diff %.3g > %.3g", f.g->name, p, t,
				      d, tol_for(&f, f.g->tol_prefill));
			worst = d > worst ? d : worst;
		}
		free(lg);
	}
	report(&f, "prefill logits", worst, tol_for(&f, f.g->tol_prefill));
	fx_close(&f);
}
END_TEST

/* (a) decode logits: feed the reference's greedy tokens, so that every
 * stored step is compared whatever near-ties the reference has. */
START_TEST(decode_logits_teacher_forced)
{
	struct fx f;
	double worst = 0, worst_kv = 0;
	int S;

	fx_open(&f, _i);
	S = f.g->n_gen_logits;
	for (int p = 0; p < f.g->n_prompts; p++) {
		const struct mlens_golden_prompt *pr = &f.g->prompts[p];
		float *lg = xmalloc((size_t)S * f.V * sizeof(float));
		int32_t *tok = xmalloc((size_t)S * sizeof(int32_t));
		int n = steps(&f, p, S, "teacher-forced decode");
		ck_assert_int_eq(mlens_golden_generate(&f.ge, pr->tokens, pr->len, S,
						       pr->main.greedy, tok, lg), 0);
		for (int s = 0; s < n; s++) {
			double d = mlens_golden_rel_diff(lg + s * f.V, pr->main.gen_logits + s * f.V, f.V);
			ck_assert_msg(d <= tol_for(&f, f.g->tol_decode), "%s prompt %d step %d: rel diff %.3g > %.3g",
				      f.g->name, p, s, d, tol_for(&f, f.g->tol_decode));
			worst = d > worst ? d : worst;
			if (!f.g->has_kv_bf16)
				continue;
			d = mlens_golden_rel_diff(lg + s * f.V, pr->kv_bf16.gen_logits + s * f.V, f.V);
			ck_assert_msg(d <= kv_tol(&f),
				      "%s prompt %d step %d: rel diff %.3g > %.3g vs the bf16-KV reference",
				      f.g->name, p, s, d, kv_tol(&f));
			worst_kv = d > worst_kv ? d : worst_kv;
		}
		free(lg);
		free(tok);
	}
	report(&f, "decode logits (teacher-forced)", worst, tol_for(&f, f.g->tol_decode));
	if (f.g->has_kv_bf16)
		report(&f, "decode logits vs bf16-KV reference", worst_kv, kv_tol(&f));
	fx_close(&f);
}
END_TEST

/* Tokens [0, safe) of got must equal the reference's. */
static void compare_greedy(const struct fx *f, int p, const int32_t *got,
			   const struct mlens_golden_ref *ref, double tol, const char *which)
{
	int safe = mlens_golden_safe_steps(f->g, ref, tol);
	int routed = steps(f, p, f->g->n_gen, "greedy");
	bool cut = routed < safe;
	if (cut) {
		printf("golden %s [%s] greedy prompt %d vs %s: %d/%d tokens compared (fast-GEMM "
		       "router cut)\n", f->g->name, label, p, which, routed, f->g->n_gen);
		safe = routed;
	}
	for (int s = 0; s < safe; s++)
		ck_assert_msg(got[s] == ref->greedy[s],
			      "%s prompt %d: greedy token %d is %d, %s reference has %d",
			      f->g->name, p, s, got[s], which, ref->greedy[s]);
	if (cut)
		;	/* said above */
	else if (safe < f->g->n_gen)
		printf("golden %s [%s] greedy prompt %d vs %s: %d/%d tokens compared; step %d has "
		       "top-2 margin %.3g <= 2 x %.3g x max|logit| %.3g (a near-tie)\n",
		       f->g->name, label, p, which, safe, f->g->n_gen, safe, ref->margin[safe], tol,
		       ref->max_abs[safe]);
	else
		printf("golden %s [%s] greedy prompt %d vs %s: %d/%d tokens identical\n", f->g->name,
		       label, p, which, safe, f->g->n_gen);
	fflush(stdout);
}

/* (b) free-running greedy tokens. bf16 fixtures compare with the bf16-KV
 * reference (what the engine computes) at its tolerance, and with the main
 * reference up to its first near-tie at the looser decode tolerance. */
START_TEST(greedy_tokens)
{
	struct fx f;
	int N;

	fx_open(&f, _i);
	N = f.g->n_gen;
	for (int p = 0; p < f.g->n_prompts; p++) {
		const struct mlens_golden_prompt *pr = &f.g->prompts[p];
		int32_t *tok = xmalloc((size_t)N * sizeof(int32_t));
		ck_assert_int_eq(mlens_golden_generate(&f.ge, pr->tokens, pr->len, N, NULL, tok, NULL),
				 0);
		compare_greedy(&f, p, tok, &pr->main, tol_for(&f, f.g->tol_decode), "main");
		if (f.g->has_kv_bf16)
			compare_greedy(&f, p, tok, &pr->kv_bf16, kv_tol(&f), "bf16-KV");
		free(tok);
	}
	fx_close(&f);
}
END_TEST

/* (c) all prompts in one step, then decoding together, equals each prompt
 * alone: bitwise on the CPU backend (fixed reduction order per row), within
 * the prefill tolerance on others. */
START_TEST(batched_equals_unbatched)
{
	struct fx f;
	int S, n;
	int32_t *bt, *at;
	float *bl, *al;
	double worst = 0;
	bool exact;

	fx_open(&f, _i);
	S = f.g->n_gen_logits;
	n = f.g->n_prompts;
	exact = !strcmp(backend, "cpu");
	bt = xmalloc((size_t)n * S * sizeof(int32_t));
	at = xmalloc((size_t)S * sizeof(int32_t));
	bl = xmalloc((size_t)n * S * f.V * sizeof(float));
	al = xmalloc((size_t)S * f.V * sizeof(float));
	ck_assert_int_eq(mlens_golden_generate_batch(&f.ge, f.g, S, bt, bl), 0);
	for (int p = 0; p < n; p++) {
		const struct mlens_golden_prompt *pr = &f.g->prompts[p];
		const float *b = bl + (size_t)p * S * f.V;
		int ns = steps(&f, p, S, "batched");
		ck_assert_int_eq(mlens_golden_generate(&f.ge, pr->tokens, pr->len, S, NULL, at, al), 0);
		ns = on_reference(&f, p, at, ns);
		for (int s = 0; s < ns; s++) {
			double d = mlens_golden_rel_diff(b + s * f.V, al + s * f.V, f.V);
			worst = d > worst ? d : worst;
			ck_assert_msg(at[s] == bt[(size_t)p * S + s],
				      "%s prompt %d step %d: batched token %d, alone %d", f.g->name, p,
				      s, bt[(size_t)p * S + s], at[s]);
			if (exact)
				ck_assert_msg(!memcmp(b + s * f.V, al + s * f.V, f.V * sizeof(float)),
					      "%s prompt %d step %d: batched logits differ (rel %.3g)",
					      f.g->name, p, s, d);
			else
				ck_assert_msg(d <= batched_tol(&f),
					      "%s prompt %d step %d: batched rel diff %.3g", f.g->name,
					      p, s, d);
		}
	}
	report(&f, exact ? "batched vs unbatched (bitwise)" : "batched vs unbatched", worst,
	       exact ? 0.0 : batched_tol(&f));
	free(bt);
	free(at);
	free(bl);
	free(al);
	fx_close(&f);
}
END_TEST

/* (d) the logits of generation step i equal row len-1+i of one prefill of
 * prompt + generated tokens. For bf16 models decode reads the bf16 KV
 * cache while a prefill attends over fp32 K/V: the decode tolerance. */
START_TEST(prefill_then_decode_equals_all_at_once)
{
	struct fx f;
	int S;
	double worst = 0;

	fx_open(&f, _i);
	S = f.g->n_gen_logits;
	for (int p = 0; p < f.g->n_prompts; p++) {
		const struct mlens_golden_prompt *pr = &f.g->prompts[p];
		int L = pr->len + S - 1;
		int32_t *seq = xmalloc((size_t)(L + 1) * sizeof(int32_t));
		float *dl = xmalloc((size_t)S * f.V * sizeof(float));
		float *pl = xmalloc((size_t)L * f.V * sizeof(float));
		memcpy(seq, pr->tokens, (size_t)pr->len * sizeof(int32_t));
		ck_assert_int_eq(mlens_golden_generate(&f.ge, pr->tokens, pr->len, S, NULL,
						       seq + pr->len, dl), 0);
		int n = steps(&f, p, S, "prefill-then-decode");
		n = on_reference(&f, p, seq + pr->len, n);
		/* the last generated token (seq[L]) has no logits to compare */
		ck_assert_int_eq(mlens_golden_prefill(&f.ge, seq, L, pl), 0);
		for (int s = 0; s < n; s++) {
			double d = mlens_golden_rel_diff(dl + s * f.V, pl + (size_t)(pr->len - 1 + s) * f.V,
							 f.V);
			ck_assert_msg(d <= tol_for(&f, f.g->tol_decode), "%s prompt %d step %d: rel diff %.3g > %.3g",
				      f.g->name, p, s, d, tol_for(&f, f.g->tol_decode));
			worst = d > worst ? d : worst;
		}
		free(seq);
		free(dl);
		free(pl);
	}
	report(&f, "prefill-then-decode vs all-at-once", worst, tol_for(&f, f.g->tol_decode));
	fx_close(&f);
}
END_TEST

int main(void)
{
	char root[4096], err[512];
	const char *env = getenv("MLENS_TEST_BACKEND");
	struct mlens_backend be;
	Suite *s;
	TCase *tc;
	SRunner *sr;
	int failed, rc;

	if (env && *env)
		backend = env;
	env = getenv("MLENS_TEST_GEMM");
	if (env && *env && mlens_gemm_mode_parse(env, &gemm)) {
		fprintf(stderr, "check_golden: MLENS_TEST_GEMM '%s' is not one of fast, exact\n", env);
		return 1;
	}
	if (strcmp(mlens_golden_gpu_side(backend), "cpu"))
		snprintf(label, sizeof(label), "%s, %s GEMMs", backend, mlens_gemm_mode_name(gemm));
	else
		snprintf(label, sizeof(label), "%s", backend);
	rc = mlens_backend_create(&be, mlens_golden_gpu_side(backend), NULL);
	if (rc == -EINVAL || (rc && !strcmp(mlens_golden_gpu_side(backend), "cpu"))) {
		fprintf(stderr, "check_golden: backend '%s': %s\n", backend, strerror(-rc));
		return 1;
	}
	if (!rc && strcmp(mlens_golden_gpu_side(backend), "cpu"))
		mlens_test_gpu_lock("check_golden");	/* one GPU test at a time */
	if (rc) {	/* not built in, or no device: skip */
		fprintf(stderr, "check_golden: backend '%s' unavailable (%s): skipped\n", backend,
			strerror(-rc));
		return 77;
	}
	mlens_backend_destroy(&be);
	mlens_golden_root(root, sizeof(root));
	rc = mlens_golden_list(root, &fixtures, &n_fixtures, err, sizeof(err));
	if (rc || n_fixtures == 0) {
		fprintf(stderr, "check_golden: %s\n", rc ? err : "no fixture (*/golden.json) found");
		fprintf(stderr, "check_golden: looked in %s\n", root);
		return 1;
	}
	for (int i = 0; i < n_fixtures; i++)
		printf("golden fixture %d: %s\n", i, fixtures[i]);
	fflush(stdout);

	s = suite_create("golden");
	tc = tcase_create("hf");
	tcase_set_timeout(tc, 120);
	tcase_add_loop_test(tc, prefill_logits, 0, n_fixtures);
	tcase_add_loop_test(tc, decode_logits_teacher_forced, 0, n_fixtures);
	tcase_add_loop_test(tc, greedy_tokens, 0, n_fixtures);
	tcase_add_loop_test(tc, batched_equals_unbatched, 0, n_fixtures);
	tcase_add_loop_test(tc, prefill_then_decode_equals_all_at_once, 0, n_fixtures);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	/* CUDA does not survive fork(), and the probe above initialised it:
	 * a GPU backend runs the tests in this process */
	if (strcmp(backend, "cpu"))
		srunner_set_fork_status(sr, CK_NOFORK);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	mlens_golden_list_free(fixtures, n_fixtures);
	return failed ? 1 : 0;
}
