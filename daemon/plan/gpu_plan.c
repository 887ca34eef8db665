/* GPU-only mode's memory plan (see gpu_plan.h). The sizes mirror what
 * daemon/exec/engine.c allocates per step cap and what kernels/cuda asks for as
 * scratch, so that a plan that fits means the step never runs out of
 * device memory mid-way. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "daemon/plan/gpu_plan.h"
#include "daemon/plan/gpuplan.h"
#include "daemon/exec/kv_pool.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

/* The CUDA backend's scratch grows by doubling from 1 MiB: the size it
 * really asks for when an op needs bytes. */
static uint64_t scratch_rounded(uint64_t bytes)
{
	uint64_t cap = 1ull << 20;
	while (cap < bytes)
		cap *= 2;
	return cap;
}

/* decode attention splits contexts into pieces of this many keys and keeps
 * fp32 partials (head_dim + 2 per piece) for each query and head, each
 * query only its own pieces, in launches of at most DEC_PART_CAP bytes
 * unless one query alone needs more (kernels/cuda/attn_cuda.cu) */
#define DEC_SPLIT 256
#define DEC_PART_CAP (256ull << 20)

void mlens_gpu_plan_compute(struct mlens_gpu_plan *p, const struct mlens_model_config *c,
			    uint64_t weight_bytes, uint64_t kv_bytes, int step_tokens,
			    enum mlens_gemm_mode gemm, uint64_t budget, uint64_t dev_free,
			    uint64_t dev_total)
{
	uint64_t T = step_tokens > 0 ? (uint64_t)step_tokens : 4096;
	uint64_t H = (uint64_t)c->hidden_size, I = (uint64_t)c->intermediate_size;
	uint64_t qd = (uint64_t)(c->num_attention_heads * c->head_dim);
	uint64_t kvd = (uint64_t)(c->num_key_value_heads * c->head_dim);
	uint64_t E = (uint64_t)c->num_local_experts, K = (uint64_t)c->num_experts_per_tok;
	uint64_t V = (uint64_t)c->vocab_size, es = mlens_dtype_size(c->dtype);
	uint64_t chunk = T < MLENS_CUDA_MOE_CHUNK_TOKENS ? T : MLENS_CUDA_MOE_CHUNK_TOKENS, rows = chunk * K;
	uint64_t moe, dec, one, conv, ctx, kv_tok_bytes, kv_tokens;
	struct mlens_kv_cache kv_layout;
	/* exact GEMMs on half-precision weights: three parts per activation */
	uint64_t np = mlens_gpuplan_gemm_parts(gemm, es);

	memset(p, 0, sizeof(*p));
	p->weights = weight_bytes;
	p->kv = kv_bytes;
	/* engine.c: x, xn [T][H]; q, att [T][qdim]; k, v [T][kvdim]; router
	 * logits [T][E]; ids and weights [T][K]; logits for at most T rows */
	p->activations = T * (2 * H + 2 * qd + 2 * kvd + E + 2 * K) * 4 + T * V * 4;

	/* One scratch area serves every op, so it is the largest single need. */
	moe = mlens_gpuplan_moe_scratch(rows, H, I, E, es, gemm);
	if (c->expert_dtype == MLENS_DT_F8_E4M3)	/* each MoE stream's expert dequantized */
		moe += mlens_moe_fp8_dequant_bytes(H, I, MLENS_MOE_STREAMS_MAX,
						   es == 4 ? MLENS_GEMM_EXACT : gemm) +
		       256 * MLENS_MOE_STREAMS_MAX;
	conv = np * T * (H > qd ? H : qd) * 2;
	/* partials: at most every query at the longest context, which the KV
	 * pool and the model's context bound, and at most one launch's area */
	mlens_kv_layout(&kv_layout, c, -1, 0, 1, NULL, 0);	/* the auto dtype: cannot fail */
	kv_tok_bytes = 2 * (uint64_t)mlens_kv_token_bytes(&kv_layout);
	kv_tokens = kv_tok_bytes ? kv_bytes / kv_tok_bytes : 0;
	ctx = (uint64_t)c->max_position_embeddings;
	if (kv_tokens < ctx)
		ctx = kv_tokens;
	one = (uint64_t)c->num_attention_heads * ((ctx + DEC_SPLIT - 1) / DEC_SPLIT) *
	      ((uint64_t)c->head_dim + 2) * 4;
	dec = T * one;
	if (dec > DEC_PART_CAP)
		dec = one > DEC_PART_CAP ? one : DEC_PART_CAP;
	p->workspace = moe > dec ? moe : dec;
	if (conv > p->workspace)
		p->workspace = conv;
	p->workspace = scratch_rounded(p->workspace);
	/* cuBLAS workspace (32 MiB) and the metadata staging area */
	p->workspace += (32ull << 20) + scratch_rounded(T * 64);

	p->need = p->weights + p->kv + p->activations + p->workspace;
	p->dev_free = dev_free;
	p->dev_total = dev_total;
	p->budget_given = budget != 0;
	if (budget)
		p->budget = budget;
	else
		p->budget = dev_free > MLENS_GPU_SAFETY_MARGIN ? dev_free - MLENS_GPU_SAFETY_MARGIN : 0;
	/* a budget above what the device has free cannot be honoured either */
	if (p->budget_given && dev_free && p->budget > dev_free)
		p->fits = false;
	else
		p->fits = p->need <= p->budget;
	snprintf(p->summary, sizeof(p->summary),
		 "weights %.1f GiB + KV %.1f GiB + activations %.1f GiB + workspace %.1f GiB = %.1f GiB %s "
		 "the %.1f GiB budget (%s%.1f GiB free of %.1f GiB)",
		 p->weights / GIB, p->kv / GIB, p->activations / GIB, p->workspace / GIB, p->need / GIB,
		 p->need <= p->budget ? "fit" : "exceed",
		 p->budget / GIB, p->budget_given ? "gpu_memory; device: " : "device free memory minus a margin; ",
		 dev_free / GIB, dev_total / GIB);
	if (p->need <= p->budget && !p->fits)
		snprintf(p->summary + strlen(p->summary), sizeof(p->summary) - strlen(p->summary),
			 ", but gpu_memory is more than the device has free");
}

int mlens_gpu_plan_for(struct mlens_gpu_plan *p, const struct mlens_backend *be,
		       const struct mlens_model_config *c, uint64_t weight_bytes,
		       uint64_t kv_bytes, int step_tokens, enum mlens_gemm_mode gemm,
		       uint64_t budget)
{
	size_t fr = 0, tot = 0;
	int rc;
	if (!be->ops || be->ops->host_memory || !MLENS_BACKEND_HAS(be->ops, mem_info))
		return -ENOTSUP;
	if ((rc = be->ops->mem_info(be->ctx, &fr, &tot)))
		return rc;
	mlens_gpu_plan_compute(p, c, weight_bytes, kv_bytes, step_tokens, gemm, budget, fr, tot);
	return 0;
}
