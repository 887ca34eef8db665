/* Golden fixtures: reference outputs of Hugging Face transformers for small
 * random Mixtral models (tests/golden/<name>/, made by make_golden.py), and
 * the engine runs that every backend's golden check repeats. See README.md
 * in this folder for what each reference is. */
#ifndef MLENS_GOLDEN_H
#define MLENS_GOLDEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/exec/engine.h"

/* One reference greedy run of one prompt. */
struct mlens_golden_ref {
	int32_t *greedy;	/* [n_gen] tokens */
	float *margin;		/* [n_gen] top-1 minus top-2 logit of each step */
	float *max_abs;		/* [n_gen] max |logit| of each step */
	float *gen_logits;	/* [n_gen_logits][vocab]; NULL when the fixture has none */
};

struct mlens_golden_prompt {
	int len;
	int32_t *tokens;	/* [len] */
	float *prefill_logits;	/* [len][vocab], every position of a full prefill */
	struct mlens_golden_ref main;	/* fp32 compute over the file's weights */
	/* bf16 fixtures: the same compute with the KV cache rounded to bf16 as
	 * mlens stores it; gen_logits are teacher-forced on main.greedy. */
	struct mlens_golden_ref kv_bf16;
	/* bf16 fixtures, per position of tokens + main.greedy[0..n_gen-1)
	 * (position len-1+i gives greedy step i; n_router = len + n_gen - 1),
	 * the minimum over layers of the router's relative top-k gap, and the
	 * maximum relative move of the router logits under the CUDA backend's
	 * fast GEMMs (make_golden.py, router_data); NULL when absent. */
	int n_router;
	float *router_rel_gap;
	float *router_rel_shift_fast;
};

struct mlens_golden {
	char *dir;		/* the model directory (also holds golden.json) */
	char *name;
	char *dtype;		/* "float32" or "bfloat16" */
	int vocab;
	int n_gen;		/* greedy steps per prompt */
	int n_gen_logits;	/* leading steps whose logits are stored */
	double tol_prefill;	/* max |diff| / max |ref| of prefill logits */
	double tol_decode;	/* the same for decode steps vs main */
	bool has_kv_bf16;
	double tol_kv_bf16;	/* decode steps vs kv_bf16 */
	int n_prompts;
	struct mlens_golden_prompt *prompts;
};

/* Read DIR/golden.json and the logits files it names. -errno and a message
 * naming the file and the fault on failure. */
int mlens_golden_open(const char *dir, struct mlens_golden **out, char *err, size_t errlen);
void mlens_golden_close(struct mlens_golden *g);

/* The fixture directories under root (those with a golden.json), sorted by
 * name. Free with mlens_golden_list_free. */
int mlens_golden_list(const char *root, char ***dirs, int *n, char *err, size_t errlen);
void mlens_golden_list_free(char **dirs, int n);

/* The folder of the fixtures: $MLENS_SRCDIR/tests/golden, else
 * $top_srcdir/tests/golden, else the source tree this was built from. */
const char *mlens_golden_root(char *buf, size_t len);

/* max |got - ref| / max |ref| over n values. */
double mlens_golden_rel_diff(const float *got, const float *ref, size_t n);

/* Greedy steps that a run with relative logit error tol must reproduce:
 * those before the first step whose top-2 margin is at most
 * 2 * tol * max|logit| (both top logits may move by tol * max|logit|). */
int mlens_golden_safe_steps(const struct mlens_golden *g, const struct mlens_golden_ref *r,
			    double tol);

/* The first position of prompt p (of the n_router above) where fast GEMMs
 * may pick another expert than the reference: its relative router gap is
 * at most twice the largest relative router move up to it (both the k-th
 * and the (k+1)-th logit may move that far). Comparisons of a fast-GEMM
 * run stop before it. n_router when no position is that close; -ENOENT
 * when the fixture has no router data. */
int mlens_golden_fast_cut(const struct mlens_golden_prompt *p);

/* ==== engine runs ==== */

/* A model from a fixture directory on a named backend ("cpu", "cuda", or
 * the hybrid pipeline: "hybrid" with the cuda backend on the GPU side,
 * "hybrid-cpu" with the cpu backend there; both with decode attention on
 * a cpu backend and a GPU budget that streams every expert it can). */
struct mlens_golden_engine {
	struct mlens_model *m;
	struct mlens_backend be;
	bool have_be;
	struct mlens_backend attn;	/* hybrid: the attention side */
	bool have_attn;
	struct mlens_engine *e;
};

/* The backend a golden backend name creates first ("cuda" for "hybrid",
 * "cpu" for "hybrid-cpu", else the name itself). */
const char *mlens_golden_gpu_side(const char *backend);

/* -ENOTSUP / -ENODEV (and others) when the backend cannot be created: the
 * caller skips. Other failures name the model and the fault in err. */
int mlens_golden_engine_open(struct mlens_golden_engine *ge, const char *dir,
			     const char *backend, enum mlens_gemm_mode gemm, char *err,
			     size_t errlen);
void mlens_golden_engine_close(struct mlens_golden_engine *ge);

/* One sequence: prefill tokens[0..len), then n_steps greedy steps. With
 * force, step i>0 feeds force[i-1] (teacher forcing) instead of the token
 * just sampled. out[i] is the token sampled at step i; logits (optional)
 * [n_steps][vocab] are those it was sampled from. */
int mlens_golden_generate(struct mlens_golden_engine *ge, const int32_t *tokens, int len,
			  int n_steps, const int32_t *force, int32_t *out, float *logits);

/* All prompts at once: one step prefills every prompt, then each step
 * decodes one token for each of them. out [n][n_steps], logits
 * [n][n_steps][vocab] (optional). */
int mlens_golden_generate_batch(struct mlens_golden_engine *ge, const struct mlens_golden *g,
				int n_steps, int32_t *out, float *logits);

/* Logits of every position of one prefill of tokens[0..len): [len][vocab]. */
int mlens_golden_prefill(struct mlens_golden_engine *ge, const int32_t *tokens, int len,
			 float *logits);

#endif
