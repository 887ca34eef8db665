/* The GPU memory plan (DESIGN §5.2): a GPU byte budget split into
 * resident weights, two expert slots, the KV pool where it lives on the
 * GPU, activations for the step's token cap and workspace. One plan for
 * both executors: mlensd makes it once at start-up and hands it to the
 * engine and the hybrid pipeline (const struct mlens_gpu_plan *); the
 * performance model (perfmodel.h) sizes a residency with the functions
 * below. Pure arithmetic over the model's byte counts and the buffers the
 * executors allocate (daemon/exec/engine.c, daemon/exec/pipeline.c,
 * kernels/cuda), so that the plan is exactly what they ask the GPU for.
 *
 * Rule (simple for now): embeddings, lm_head, final norm and per layer
 * the attention, norms and router are always resident; then as many whole
 * experts per layer (the same count r in every layer; which r is the
 * pipeline's choice, daemon/exec/residency.h) as
 * the budget holds next to two slots of the E - r streamed experts and
 * activations for the token cap, at most the input's max_resident when
 * capped. GPU-only mode is the plan with every
 * expert resident (r = E, no slots): the engine runs it with the KV pool
 * and attention on the GPU, so its activations and workspace are the
 * engine's (plan input gpu_only). Otherwise the hybrid pipeline runs it:
 * when even r = 0 cannot hold activations for the cap, the cap shrinks to
 * what fits, never below min_tokens; below that the budget is refused with
 * the minimum that would work. */
#ifndef MLENS_GPU_PLAN_H
#define MLENS_GPU_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"
#include "daemon/plan/perfmodel.h"
#include "kernels/backend.h"

/* gpu_memory = 0: the budget is the device's free memory at start-up
 * minus this margin, room for what the CUDA runtime and cuBLAS allocate
 * outside the backend's account (module images, kernel arguments, library
 * handles); mlensd --help (daemon/config.c), mlensd.conf(5) and mlensd(8)
 * say the same. */
#define MLENS_GPU_SAFETY_MARGIN (768ull << 20)

/* The budget a plan works with: gpu_memory when set, else dev_free minus
 * MLENS_GPU_SAFETY_MARGIN (0 when the device has less free). */
uint64_t mlens_gpu_plan_budget(uint64_t gpu_memory, uint64_t dev_free);

/* Workspace when the caller gives none: cuBLAS' 32 MiB workspaces plus
 * what the GPU gives away outside the backend's byte count: kernel code
 * loaded on first use, cuBLAS' own state and the allocator's rounding of
 * small allocations (tests/check_hybrid_cuda.c shows it growing once steps
 * run in groups of several sizes, each GEMM shape loading cuBLAS kernels
 * of its own). */
#define MLENS_GPU_PLAN_WORKSPACE mlens_gpu_plan_workspace(MLENS_MOE_STREAMS_DEFAULT)
/* ... with moe_streams MoE streams, a cuBLAS workspace each. */
static inline uint64_t mlens_gpu_plan_workspace(int moe_streams)
{
	return (256ull << 20) + (uint64_t)(moe_streams > 0 ? moe_streams : 1) * MLENS_CUDA_BLAS_WS;
}
/* Tokens per MoE call of the pipeline when chunk is 0, the plan's chunk
 * being at most the group: a group's MoE is one call. The backend's MoE
 * scratch grows with the chunk's rows but its gate/up pieces do not
 * (MLENS_CUDA_MOE_GU_ROWS). Larger calls cost less a token
 * (tests/bench/bench_cuda.c). */
#define MLENS_GPU_PLAN_CHUNK MLENS_CUDA_MOE_CHUNK_TOKENS
/* The smallest group MLENS_GPU_PLAN_GROUP_AUTO tries (or the chunk, when
 * a smaller one is given). */
#define MLENS_GPU_PLAN_AUTO_GROUP_MIN 2048
/* Rows per lm_head call at most (the logits buffer: rows x vocab fp32). */
#define MLENS_GPU_PLAN_TAIL_ROWS 1024
static inline int64_t mlens_gpu_plan_tail_rows(int64_t chunk)
{
	return chunk < MLENS_GPU_PLAN_TAIL_ROWS ? chunk : MLENS_GPU_PLAN_TAIL_ROWS;
}
/* Rows of a token group when group is 0: a step of n tokens runs as
 * ceil(n / group) groups (at least two), and only two or three groups'
 * activations live at once (pipeprog.h, the pipeline's sets), so the
 * residual stream is the only per-token buffer of the whole step. */
#define MLENS_GPU_PLAN_GROUP 4096
/* group of mlens_gpu_plan_in: let the plan choose. The largest of
 * MLENS_GPU_PLAN_GROUP, half of it, and so on down to
 * MLENS_GPU_PLAN_AUTO_GROUP_MIN (or a smaller chunk), whose plan holds
 * max_tokens; failing that the one that holds the most tokens (a group's
 * activation sets and MoE call are what the per-token residual competes
 * with: at 8 GiB the 8-layer 8x7B with fast GEMMs holds 34,443 tokens in
 * groups of 4096, 43,662 in 3072 and 52,881 in 2048, each group's MoE one
 * call). */
#define MLENS_GPU_PLAN_GROUP_AUTO (-1)
/* The backend's op scratch is reserved once at the plan's size, rounded
 * to the device allocator's granule. */
#define MLENS_GPU_PLAN_SCRATCH_ALIGN (2ull << 20)

struct mlens_gpu_plan_in {
	/* gpu_memory: bytes the daemon may hold on the GPU; 0 = the device's
	 * free memory (dev_free) minus MLENS_GPU_SAFETY_MARGIN */
	uint64_t budget;
	uint64_t dev_free, dev_total;	/* the device as found (0 when unknown) */
	int64_t max_tokens;	/* token cap wanted per step (GPU-only: 0 = 4096) */
	int64_t min_tokens;	/* smallest cap that still runs (a whole prompt); 0 = 1 */
	uint64_t workspace;	/* 0 = MLENS_GPU_PLAN_WORKSPACE */
	int64_t chunk;		/* tokens per MoE call (lm_head: at most
				 * MLENS_GPU_PLAN_TAIL_ROWS); 0 = MLENS_GPU_PLAN_CHUNK */
	int64_t group;		/* rows per token group; 0 = MLENS_GPU_PLAN_GROUP,
				 * MLENS_GPU_PLAN_GROUP_AUTO: chosen (above) */
	enum mlens_gemm_mode gemm;	/* the GPU backend's: EXACT GEMMs on half-precision
					 * weights take MLENS_GEMM_EXACT_PARTS times the
					 * scratch for their split activations */
	int sets;		/* the pipeline's activation sets; 0 = MLENS_PIPE_SETS */
	/* the pipeline's attention output goes up in the weights' dtype
	 * (pipeline att_up_half): a set holds no fp32 attention output */
	bool att_half;
	/* GPU-only mode: every expert resident, the KV pool and attention on
	 * the GPU, the engine's activations and workspace for max_tokens.
	 * model is then required: its context bounds the decode attention's
	 * partials and its KV layout the pool's tokens. */
	bool gpu_only;
	/* hybrid: cap_resident keeps at most max_resident (0..E) experts a
	 * layer resident (config resident_experts), fewer when the budget
	 * needs; without it, as many as the budget holds beside the cap */
	bool cap_resident;
	int max_resident;
	const struct mlens_model_config *model;
	uint64_t weight_bytes;	/* every tensor as loaded; 0 = the model's count at r = E */
	uint64_t kv_bytes;	/* the K and V block pools (on the GPU) */
};

struct mlens_gpu_plan {
	bool gpu_only;		/* the input's: every expert resident, the engine runs it */
	int resident_experts;	/* per layer: r experts stay on the GPU (which: residency.h) */
	bool capped;		/* r is the input's max_resident, below what the budget holds */
	int64_t tokens;		/* token cap per step that fits */
	int64_t chunk;		/* <= group (hybrid) */
	int64_t group;		/* rows of a token group (<= tokens; hybrid) */
	int sets;		/* the pipeline's activation sets the plan holds (hybrid) */
	bool att_half;		/* ... without an fp32 attention output (hybrid) */
	enum mlens_gemm_mode gemm;	/* the GEMM mode the scratch is sized for */
	uint64_t resident;	/* bytes: always-resident weights + resident experts */
	uint64_t slot;		/* bytes of one expert slot (one layer's streamed experts) */
	uint64_t slots;		/* both slots */
	uint64_t kv;		/* the KV pool on the GPU (GPU-only; 0 in hybrid) */
	uint64_t act;		/* activations and backend scratch for tokens */
	uint64_t scratch;	/* of act: the backend's op scratch, reserved at start (hybrid) */
	uint64_t workspace;
	uint64_t total;		/* resident + slots + kv + act + workspace */
	uint64_t budget;	/* the effective budget (mlens_gpu_plan_budget) */
	bool budget_given;	/* gpu_memory set, not derived from free memory */
	uint64_t dev_free, dev_total;	/* the device as found (0 when unknown) */
	bool fits;		/* total <= budget, and a given budget <= dev_free when known */
	uint64_t minimum;	/* hybrid: smallest budget that runs min_tokens */
	uint64_t all_resident;	/* hybrid: budget that holds every expert with max_tokens */
	char summary[384];	/* GPU-only: "weights 23.7 GiB + KV 40.0 GiB + ... fit the 139.0 GiB budget" */
};

/* ==== a residency's bytes: the plan's terms, which the performance model
 * uses too (one formula each) ==== */
/* Per layer: expert bytes streamed each step with r experts resident. */
uint64_t mlens_gpu_plan_streamed_bytes(const struct mlens_perf_model *pm, int r);
/* Whole model: bytes resident on the GPU with r experts per layer resident. */
uint64_t mlens_gpu_plan_resident_bytes(const struct mlens_perf_model *pm, int r);
/* Two streaming slots, each one layer's non-resident experts; 0 when r = E. */
uint64_t mlens_gpu_plan_slot_bytes(const struct mlens_perf_model *pm, int r);
/* GPU bytes of residency r before activations: the resident weights, both
 * expert slots and the workspace ws (saturating). */
uint64_t mlens_gpu_plan_fixed_bytes(const struct mlens_perf_model *pm, int r, uint64_t ws);
/* The residency of at most max_r experts a layer (< 0: any) whose fixed
 * bytes are the fewest (the lowest r on a tie); *bytes gets them. */
int mlens_gpu_plan_min_fixed(const struct mlens_perf_model *pm, int max_r, uint64_t ws, uint64_t *bytes);
/* The smallest budget that runs at all: the fewest fixed bytes (above)
 * with workspace ws plus act, the activation bytes of the smallest step
 * (the plan's minimum; the performance model's mlens_perf_min_budget). */
uint64_t mlens_gpu_plan_minimum(const struct mlens_perf_model *pm, uint64_t ws, uint64_t act);
/* Most tokens n in [0, cap] with act(arg, n) <= room, act growing with n. */
int64_t mlens_gpu_plan_tokens_fit(uint64_t (*act)(const void *arg, int64_t n), const void *arg,
				  uint64_t room, int64_t cap);
/* GPU activation bytes of a step of n tokens when no executor's count is
 * given (the performance model's own two-group estimate, formula in
 * gpu_plan.c). */
uint64_t mlens_gpu_plan_act_estimate(const struct mlens_perf_model *pm, int64_t n, int64_t chunk);

/* Activation and scratch bytes of a step of n tokens on the GPU, shaped by
 * the plan input in: groups of at most in->group rows (0:
 * MLENS_GPU_PLAN_GROUP; not MLENS_GPU_PLAN_GROUP_AUTO), in->chunk tokens per
 * MoE call (0: MLENS_GPU_PLAN_CHUNK), in->gemm, in->sets activation sets
 * (0: MLENS_PIPE_SETS), in->att_half: the residual stream of every token;
 * per activation set a
 * group's q, k, v and attention out; once for all sets a group's norm,
 * router logits, ids and weights (GA's and GB's own, on the in-order
 * compute queue); logits of an lm_head call (mlens_gpu_plan_tail_rows of
 * the chunk); the backend's op scratch (below); and its staging of small
 * tables. Saturates at UINT64_MAX. */
uint64_t mlens_gpu_plan_act_bytes(const struct mlens_perf_model *pm, int64_t n,
				 const struct mlens_gpu_plan_in *in);
/* Parts each activation of a GEMM on weights of weight_bytes per element
 * is split into: MLENS_GEMM_EXACT_PARTS for EXACT on half-precision
 * weights, else 1. */
uint64_t mlens_gpu_plan_gemm_parts(enum mlens_gemm_mode gemm, uint64_t weight_bytes);
/* The expert width a MoE scratch is sized for when a layer also runs a
 * shared or dense SwiGLU of width mlp as a one-expert MoE (a row each):
 * I, or mlp / K rounded up when that SwiGLU needs more. */
static inline uint64_t mlens_gpu_plan_moe_width(uint64_t I, uint64_t K, uint64_t mlp)
{
	return K && mlp > K * I ? (mlp + K - 1) / K : I;
}

/* How a MoE call's fp8 experts multiply, for its scratch: none (16/32-bit
 * experts), through a dequantized copy per MoE stream, or on fp8 tensor
 * cores (the rows quantized, no copy). */
enum mlens_gpu_plan_fp8 {
	MLENS_GPU_PLAN_FP8_NONE = 0,
	MLENS_GPU_PLAN_FP8_DEQUANT,
	MLENS_GPU_PLAN_FP8_TC,
};
/* The path pm's experts take with GEMM mode gemm (the backend's choice,
 * kernels/cuda/backend_cuda.cu moe_fp8_tc). */
enum mlens_gpu_plan_fp8 mlens_gpu_plan_fp8_path(const struct mlens_perf_model *pm,
						enum mlens_gemm_mode gemm);
/* Scratch of one MoE call of rows routed rows (tokens x top-k) as the CUDA
 * backend lays it out (kernels/cuda/backend_cuda.cu, moe_chunk) for
 * weights of es bytes and GEMM mode gemm: expert counts, permutation and
 * inverse, the gathered rows in the weight dtype (split into
 * mlens_gpu_plan_gemm_parts parts), gate and up for MLENS_CUDA_MOE_GU_ROWS
 * rows at most (in the weight dtype with silu(g)u over g where
 * mlens_moe_half_gu, else fp32 and silu(g)u of its own in the weight
 * dtype, in parts; sliced between the MoE streams, each slice aligned),
 * the experts' outputs in fp32; each area 256-byte aligned; with fp8
 * experts through the dequantize path each MoE stream's expert
 * dequantized (mlens_moe_fp8_dequant_bytes); on fp8 tensor cores the
 * larger of that layout without the copy (a shared SwiGLU of width I in
 * the model dtype takes it) and the fp8 one (the rows quantized, pieces of
 * mlens_moe_fp8_tc_piece_bytes). An upper bound for any number of MoE
 * streams. */
uint64_t mlens_gpu_plan_moe_scratch(uint64_t rows, uint64_t H, uint64_t I, uint64_t E, uint64_t es,
				   enum mlens_gemm_mode gemm, enum mlens_gpu_plan_fp8 fp8);
/* The backend's op scratch for such a step, which the pipeline reserves
 * (backend op scratch_reserve): the largest one op takes (a group's rows
 * rounded to the weight dtype for a GEMM, a MoE chunk's gathered rows and
 * intermediates; with EXACT GEMMs the split parts of both), rounded up to
 * MLENS_GPU_PLAN_SCRATCH_ALIGN. */
uint64_t mlens_gpu_plan_scratch_bytes(const struct mlens_perf_model *pm, int64_t n, int64_t group,
				     int64_t chunk, enum mlens_gemm_mode gemm);
/* mlens_perf_hw's act_bytes: the bytes above for n tokens with the group,
 * GEMM mode and sets of the plan input arg (a const struct mlens_gpu_plan_in *;
 * NULL: the default group, fast GEMMs). With the group
 * MLENS_GPU_PLAN_GROUP_AUTO: the fewest bytes of the groups the plan may
 * choose, so that the model's n_act is the most tokens any of them holds. */
uint64_t mlens_gpu_plan_act_bytes_hw(const struct mlens_perf_model *pm, int64_t n, int64_t chunk,
				    const void *arg);
/* Rows of a group for a step cap of n tokens: group (0: the default),
 * never above n. */
int64_t mlens_gpu_plan_group_rows(int64_t n, int64_t group);

/* Make the plan for in (in->gpu_only: the plan with every expert
 * resident, else the hybrid pipeline's). 0 when it fits; -ENOSPC with a
 * message naming the budget, the minimum and the parts when it does not
 * (GPU-only: out filled all the same, its summary saying by how much);
 * -EINVAL for a bad input. On success the message (when err is given) is
 * empty. */
int mlens_gpu_plan_make(const struct mlens_perf_model *pm, const struct mlens_gpu_plan_in *in,
		       struct mlens_gpu_plan *out, char *err, size_t errlen);

/* The device's free and total memory for in (dev_free, dev_total).
 * -ENOTSUP for a backend whose memory is host memory (no GPU plan), or
 * -errno when the device cannot be asked. */
int mlens_gpu_plan_device(const struct mlens_backend *be, struct mlens_gpu_plan_in *in);

/* The hybrid plan in one line for the start-up log. */
int mlens_gpu_plan_format(const struct mlens_gpu_plan *p, const struct mlens_perf_model *pm,
			 char *buf, size_t len);

#endif
