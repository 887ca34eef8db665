/* CPU backend internals shared by its source files. */
#ifndef MLENS_CPU_H
#define MLENS_CPU_H

#include "kernels/backend.h"
#include "kernels/cpu/attn.h"
#include "kernels/cpu/pool.h"

struct mlens_cpu_ctx {
	struct mlens_pool *pool;
	struct mlens_cpu_attn_ws attn_ws;
	/* timing marks: the host clock when marked (ops are synchronous);
	 * NaN until marked, allocated at the first mark */
	double *timers;
};

/* Decode attention of one query token for the query heads [g*group,
 * (g+1)*group) that share KV head g: q and out point at the first of those
 * heads ([group][head_dim] each). Scalar reference: online softmax, fp32
 * accumulation, positions in order. */
void mlens_cpu_attn_decode_group_ref(float *out, const float *q,
				     const struct mlens_kv_cache *kv, int layer, int g,
				     const struct mlens_attn_query *qr, int group,
				     float scale);

/* The counter-based random number behind sampling: uniform in [0, 1). */
double mlens_sample_uniform(uint64_t seed, uint64_t counter);

/* Sample from one row of logits (host memory) with the reference rules;
 * scratch holds 2*vocab floats' worth (vocab ints + vocab floats). */
int32_t mlens_cpu_sample_row(const float *logits, int vocab,
			     const struct mlens_sampling *sp, float *logprob,
			     void *scratch);

#endif
