/* The GPU memory plan of the hybrid pipeline (DESIGN §5.2): a GPU
 * byte budget split into resident weights, two expert slots, activations
 * for the step's token cap and workspace. Pure arithmetic over the
 * performance model's byte counts (daemon/plan/perfmodel.h) and the buffers the
 * pipeline (daemon/exec/pipeline.c) allocates, so that the plan is exactly what
 * the executor asks the GPU for.
 *
 * Rule (simple for now): embeddings, lm_head, final norm and per
 * layer the attention, norms and router are always resident; then as many
 * whole experts per layer (the same count r in every layer, experts 0..r-1)
 * as the budget holds next to two slots of the E - r streamed experts and
 * activations for the token cap. With r = E nothing streams and the slots
 * are empty (the GPU-only case). When even r = 0 cannot hold activations
 * for the cap, the cap shrinks to what fits, never below min_tokens; below
 * that the budget is refused with the minimum that would work. */
#ifndef MLENS_GPUPLAN_H
#define MLENS_GPUPLAN_H

#include <stddef.h>
#include <stdint.h>
#include "daemon/plan/perfmodel.h"
#include "kernels/backend.h"

/* Workspace when the caller gives none: cuBLAS' 32 MiB workspaces plus
 * what the GPU gives away outside the backend's byte count: kernel code
 * loaded on first use, cuBLAS' own state and the allocator's rounding of
 * small allocations (tests/check_hybrid_cuda.c shows it growing once steps
 * run in groups of several sizes, each GEMM shape loading cuBLAS kernels
 * of its own). */
#define MLENS_GPUPLAN_WORKSPACE mlens_gpuplan_workspace(MLENS_MOE_STREAMS_DEFAULT)
/* ... with moe_streams MoE streams, a cuBLAS workspace each. */
static inline uint64_t mlens_gpuplan_workspace(int moe_streams)
{
	return (256ull << 20) + (uint64_t)(moe_streams > 0 ? moe_streams : 1) * MLENS_CUDA_BLAS_WS;
}
/* Tokens per MoE call of the pipeline when chunk is 0, the plan's chunk
 * being at most the group: a group's MoE is one call. The backend's MoE
 * scratch grows with the chunk's rows but its gate/up pieces do not
 * (MLENS_CUDA_MOE_GU_ROWS). Larger calls cost less a token
 * (tests/bench/bench_cuda.c). */
#define MLENS_GPUPLAN_CHUNK MLENS_CUDA_MOE_CHUNK_TOKENS
/* The smallest group MLENS_GPUPLAN_GROUP_AUTO tries (or the chunk, when
 * a smaller one is given). */
#define MLENS_GPUPLAN_AUTO_GROUP_MIN 2048
/* Rows per lm_head call at most (the logits buffer: rows x vocab fp32). */
#define MLENS_GPUPLAN_TAIL_ROWS 1024
static inline int64_t mlens_gpuplan_tail_rows(int64_t chunk)
{
	return chunk < MLENS_GPUPLAN_TAIL_ROWS ? chunk : MLENS_GPUPLAN_TAIL_ROWS;
}
/* Rows of a token group when group is 0: a step of n tokens runs as
 * ceil(n / group) groups (at least two), and only two or three groups'
 * activations live at once (pipeprog.h, the pipeline's sets), so the
 * residual stream is the only per-token buffer of the whole step. */
#define MLENS_GPUPLAN_GROUP 4096
/* group of mlens_gpuplan_in: let the plan choose. The largest of
 * MLENS_GPUPLAN_GROUP, half of it, and so on down to
 * MLENS_GPUPLAN_AUTO_GROUP_MIN (or a smaller chunk), whose plan holds
 * max_tokens; failing that the one that holds the most tokens (a group's
 * activation sets and MoE call are what the per-token residual competes
 * with: at 8 GiB the 8-layer 8x7B with fast GEMMs holds 34,443 tokens in
 * groups of 4096, 43,662 in 3072 and 52,881 in 2048, each group's MoE one
 * call). */
#define MLENS_GPUPLAN_GROUP_AUTO (-1)
/* The backend's op scratch is reserved once at the plan's size, rounded
 * to the device allocator's granule. */
#define MLENS_GPUPLAN_SCRATCH_ALIGN (2ull << 20)

struct mlens_gpuplan_in {
	uint64_t budget;	/* bytes the pipeline may hold on the GPU */
	int64_t max_tokens;	/* token cap wanted per step */
	int64_t min_tokens;	/* smallest cap that still runs (a whole prompt); 0 = 1 */
	uint64_t workspace;	/* 0 = MLENS_GPUPLAN_WORKSPACE */
	int64_t chunk;		/* tokens per MoE call (lm_head: at most
				 * MLENS_GPUPLAN_TAIL_ROWS); 0 = MLENS_GPUPLAN_CHUNK */
	int64_t group;		/* rows per token group; 0 = MLENS_GPUPLAN_GROUP,
				 * MLENS_GPUPLAN_GROUP_AUTO: chosen (above) */
	enum mlens_gemm_mode gemm;	/* the GPU backend's: EXACT GEMMs on half-precision
					 * weights take MLENS_GEMM_EXACT_PARTS times the
					 * scratch for their split activations */
	int sets;		/* the pipeline's activation sets; 0 = MLENS_PIPE_SETS */
	/* the pipeline's attention output goes up in the weights' dtype
	 * (pipeline att_up_half): a set holds no fp32 attention output */
	bool att_half;
};

struct mlens_gpuplan {
	int resident_experts;	/* per layer: experts 0..r-1 stay on the GPU */
	int64_t tokens;		/* token cap per step that fits */
	int64_t chunk;		/* <= group */
	int64_t group;		/* rows of a token group (<= tokens) */
	uint64_t resident;	/* bytes: always-resident weights + resident experts */
	uint64_t slot;		/* bytes of one expert slot (one layer's streamed experts) */
	uint64_t slots;		/* both slots */
	uint64_t act;		/* activations and backend scratch for tokens */
	uint64_t scratch;	/* of act: the backend's op scratch, reserved at start */
	uint64_t workspace;
	uint64_t total;		/* resident + slots + act + workspace <= budget */
	uint64_t budget;
	uint64_t minimum;	/* smallest budget that runs min_tokens */
	uint64_t gpu_only;	/* budget that holds every expert with max_tokens */
};

/* The expert width a MoE scratch is sized for when a layer also runs a
 * shared or dense SwiGLU of width mlp as a one-expert MoE (a row each):
 * I, or mlp / K rounded up when that SwiGLU needs more. */
static inline uint64_t mlens_gpuplan_moe_width(uint64_t I, uint64_t K, uint64_t mlp)
{
	return K && mlp > K * I ? (mlp + K - 1) / K : I;
}

/* Activation and scratch bytes of a step of n tokens on the GPU, shaped by
 * the plan input in: groups of at most in->group rows (0:
 * MLENS_GPUPLAN_GROUP; not MLENS_GPUPLAN_GROUP_AUTO), in->chunk tokens per
 * MoE call (0: MLENS_GPUPLAN_CHUNK), in->gemm, in->sets activation sets
 * (0: MLENS_PIPE_SETS), in->att_half: the residual stream of every token;
 * per activation set a
 * group's q, k, v and attention out; once for all sets a group's norm,
 * router logits, ids and weights (GA's and GB's own, on the in-order
 * compute queue); logits of an lm_head call (mlens_gpuplan_tail_rows of
 * the chunk); the backend's op scratch (below); and its staging of small
 * tables. Saturates at UINT64_MAX. */
uint64_t mlens_gpuplan_act_bytes(const struct mlens_perf_model *pm, int64_t n,
				 const struct mlens_gpuplan_in *in);
/* Parts each activation of a GEMM on weights of weight_bytes per element
 * is split into: MLENS_GEMM_EXACT_PARTS for EXACT on half-precision
 * weights, else 1. */
uint64_t mlens_gpuplan_gemm_parts(enum mlens_gemm_mode gemm, uint64_t weight_bytes);
/* Scratch of one MoE call of rows routed rows (tokens x top-k) as the CUDA
 * backend lays it out (kernels/cuda/backend_cuda.cu, moe_chunk) for
 * weights of es bytes and GEMM mode gemm: expert counts, permutation and
 * inverse, the gathered rows in the weight dtype (split into
 * mlens_gpuplan_gemm_parts parts), gate and up for MLENS_CUDA_MOE_GU_ROWS
 * rows at most (in the weight dtype with silu(g)u over g where
 * mlens_moe_half_gu, else fp32 and silu(g)u of its own in the weight
 * dtype, in parts; sliced between the MoE streams, each slice aligned),
 * the experts' outputs in fp32; each area 256-byte aligned. An upper
 * bound for any number of MoE streams. */
uint64_t mlens_gpuplan_moe_scratch(uint64_t rows, uint64_t H, uint64_t I, uint64_t E, uint64_t es,
				   enum mlens_gemm_mode gemm);
/* The backend's op scratch for such a step, which the pipeline reserves
 * (backend op scratch_reserve): the largest one op takes (a group's rows
 * rounded to the weight dtype for a GEMM, a MoE chunk's gathered rows and
 * intermediates; with EXACT GEMMs the split parts of both), rounded up to
 * MLENS_GPUPLAN_SCRATCH_ALIGN. */
uint64_t mlens_gpuplan_scratch_bytes(const struct mlens_perf_model *pm, int64_t n, int64_t group,
				     int64_t chunk, enum mlens_gemm_mode gemm);
/* mlens_perf_hw's act_bytes: the bytes above for n tokens with the group,
 * GEMM mode and sets of the plan input arg (a const struct mlens_gpuplan_in *;
 * NULL: the default group, fast GEMMs). With the group
 * MLENS_GPUPLAN_GROUP_AUTO: the fewest bytes of the groups the plan may
 * choose, so that the model's n_act is the most tokens any of them holds. */
uint64_t mlens_gpuplan_act_bytes_hw(const struct mlens_perf_model *pm, int64_t n, int64_t chunk,
				    const void *arg);
/* Rows of a group for a step cap of n tokens: group (0: the default),
 * never above n. */
int64_t mlens_gpuplan_group_rows(int64_t n, int64_t group);

/* Make the plan. -ENOSPC with a message naming the budget, the minimum and
 * the parts when the budget cannot run min_tokens; -EINVAL for a bad input.
 * On success the message (when err is given) is empty. */
int mlens_gpuplan_make(const struct mlens_perf_model *pm, const struct mlens_gpuplan_in *in,
		       struct mlens_gpuplan *out, char *err, size_t errlen);

/* The plan in one line for the start-up log. */
int mlens_gpuplan_format(const struct mlens_gpuplan *p, const struct mlens_perf_model *pm,
			 char *buf, size_t len);

#endif
