/* In-memory random Mixtral models for unit tests that need no files. */
#ifndef MLENS_TESTMODEL_H
#define MLENS_TESTMODEL_H

#include "daemon/model/model.h"
#include "daemon/plan/perfmodel.h"

struct mlens_test_spec {
	int vocab, hidden, inter, layers, heads, kv_heads, head_dim, experts, top_k;
	int max_pos;
	enum mlens_dtype dtype;
	double rope_theta;
	unsigned long long seed;
};

/* Fills in a model whose tensors are malloc'd; free with mlens_test_model_free. */
struct mlens_model *mlens_test_model_new(const struct mlens_test_spec *s);
void mlens_test_model_free(struct mlens_model *m);
/* Routers that favour two experts a layer, fav[l][0] and fav[l][1] (an
 * fp32 Mixtral test model): every embedding row gets a large first
 * component, which no layer changes (the first rows of the O projection
 * and of the experts' down projection are zero), and each router reads
 * only that component, +1 for the layer's favoured experts, -1 for the
 * rest: every token routes to the favoured pair. */
void mlens_test_favour_experts(struct mlens_model *m, const int (*fav)[2]);
/* The default tiny spec (vocab 97, hidden 32, 2 layers, 4 heads, 2 kv, 4 experts top-2). */
struct mlens_test_spec mlens_test_spec_tiny(void);
/* Mixtral-8x7B's dimensions (mlens-mkmodel's "mixtral-8x7b" preset: bf16,
 * 8 experts top-2, 32 heads, 8 KV heads) with `layers` layers and its
 * head_dim (128) and architecture spelt out, for arithmetic-only tests. */
struct mlens_model_config mlens_test_mixtral_config(int layers);
/* Its performance model with a bf16 KV cache. */
struct mlens_perf_model mlens_test_mixtral_pm(int layers);
/* A40-like ceilings, stated here: bf16 dense tensor peak 149.7 TFLOP/s,
 * PCIe 4.0 x16 at 25 GB/s each way, 696 GB/s HBM, a two-socket host with
 * 200 GB/s of memory bandwidth and 100 GB/s through CPU decode attention,
 * 512 MiB of GPU workspace, budget_gib of GPU memory; GPU lines from the
 * roofline of pm. */
struct mlens_perf_hw mlens_test_a40_hw(const struct mlens_perf_model *pm, double budget_gib);

#endif
