/* In-memory random Mixtral models for unit tests that need no files. */
#ifndef MLENS_TESTMODEL_H
#define MLENS_TESTMODEL_H

#include "daemon/model.h"

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
/* The default tiny spec (vocab 97, hidden 32, 2 layers, 4 heads, 2 kv, 4 experts top-2). */
struct mlens_test_spec mlens_test_spec_tiny(void);
/* Mixtral-8x7B's dimensions (mlens-mkmodel's "mixtral-8x7b" preset: bf16,
 * 8 experts top-2, 32 heads, 8 KV heads) with `layers` layers and its
 * head_dim (128) and architecture spelt out, for arithmetic-only tests. */
struct mlens_model_config mlens_test_mixtral_config(int layers);

#endif
