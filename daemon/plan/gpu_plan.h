/* GPU-only mode: the GPU memory plan of mlensd when its backend keeps
 * weights, KV blocks and activations in device memory. Computes what the
 * engine and the CUDA backend will ask for at most, compares it with the
 * budget and words the verdict for the log, the start-up error and status. */
#ifndef MLENS_GPU_PLAN_H
#define MLENS_GPU_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"
#include "kernels/backend.h"

/* gpu_memory = 0: the budget of either mode is the device's free memory
 * at start-up minus this, room for what the CUDA runtime and cuBLAS
 * allocate outside the backend's account (module images, kernel
 * arguments, library handles); config.c's help and mlensd.conf(5) say
 * the same. */
#define MLENS_GPU_SAFETY_MARGIN (768ull << 20)

struct mlens_gpu_plan {
	uint64_t weights;	/* every tensor, resident */
	uint64_t kv;		/* K and V block pools */
	uint64_t activations;	/* engine buffers for the step cap + logits */
	uint64_t workspace;	/* backend scratch (MoE, attention partials), cuBLAS, staging */
	uint64_t need;		/* the sum */
	uint64_t budget;	/* what may be used */
	uint64_t dev_free, dev_total;	/* the device as found (0 when unknown) */
	bool budget_given;	/* gpu_memory set, not derived from free memory */
	bool fits;
	char summary[384];	/* "weights 23.7 GiB + KV 40.0 GiB + ... fit the 139.0 GiB budget" */
};

/* Fill plan for model config c with weight_bytes of weights, kv_bytes of KV
 * pool, steps of at most step_tokens tokens and the backend's GEMM mode
 * (exact GEMMs hold split copies of the activations). budget 0: dev_free
 * minus MLENS_GPU_SAFETY_MARGIN. Pure arithmetic (tests call it without a
 * GPU). */
void mlens_gpu_plan_compute(struct mlens_gpu_plan *plan, const struct mlens_model_config *c,
			    uint64_t weight_bytes, uint64_t kv_bytes, int step_tokens,
			    enum mlens_gemm_mode gemm, uint64_t budget, uint64_t dev_free,
			    uint64_t dev_total);

/* The same for a live backend: reads the device's free and total memory
 * first. Returns 0, -ENOTSUP for a backend whose memory is host memory,
 * or -errno when the device cannot be asked. */
int mlens_gpu_plan_for(struct mlens_gpu_plan *plan, const struct mlens_backend *be,
		       const struct mlens_model_config *c, uint64_t weight_bytes,
		       uint64_t kv_bytes, int step_tokens, enum mlens_gemm_mode gemm,
		       uint64_t budget);

#endif
