/* The backend interface: an ops table and a context, reached through thin
 * inline wrappers (as in ggml and Redis' connection.h). The CPU backend is
 * the reference; every other backend is tested against it.
 *
 * Memory rules: float tensors (activations, logits, router outputs) and
 * weights live in backend memory (host memory for the CPU backend, device
 * memory for CUDA). Small index arrays that the engine builds (token ids,
 * positions, slots, cu_seqlens, attention queries, sampling parameters,
 * sampled tokens) are host memory; a backend copies them as it needs.
 * Activations are fp32; weights are stored in their file dtype.
 * Every op returns 0 or -errno. */
#ifndef MLENS_BACKEND_H
#define MLENS_BACKEND_H

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kernels/dtype.h"
#include "kernels/kv.h"
#include "kernels/wscale.h"

/* Sampling parameters of one sequence for one token. temperature <= 0 means
 * greedy. The random draw is a pure function of (seed, counter), so a token
 * never depends on what else is in the batch, nor on preemption. */
struct mlens_sampling {
	float temperature;
	int32_t top_k;		/* <= 0: no limit */
	float top_p;		/* >= 1: no limit */
	uint64_t seed;
	uint64_t counter;	/* index of the token being generated */
};

/* Expert weights of one MoE layer, row-major as in HF: w1,w3 [inter][hidden],
 * w2 [hidden][inter], or [inter][hidden] with w2_transposed (DBRX stores its
 * down projection so, and the ops read it in place rather than have the
 * loader transpose a third of the model). Pointers are backend memory. With
 * dtype MLENS_DTYPE_E4M3 each matrix has its fp32 scales in s1, s2, s3 laid
 * out as scale says (kernels/wscale.h); otherwise scale.kind is NONE and
 * the scale arrays are unused. */
struct mlens_moe_weights {
	int n_experts;
	int hidden;
	int inter;
	enum mlens_dtype dtype;
	const void *const *w1;
	const void *const *w2;
	const void *const *w3;
	struct mlens_wscale scale;
	const float *const *s1;
	const float *const *s2;
	const float *const *s3;
	/* fp8: the model's other weights' dtype; a GPU backend's fast GEMMs
	 * round activations to it where it is 16-bit (fp32: exact GEMMs) */
	enum mlens_dtype model_dtype;
	bool w2_transposed;
	/* Optional, host memory [n_experts]: each moe call adds the rows it
	 * routed to each expert (the counts it finds on the host anyway), so
	 * that a caller learns the routing without reading ids back. */
	uint64_t *tally;
};

struct mlens_backend_ops {
	size_t size;		/* sizeof(struct mlens_backend_ops), so it can grow */
	const char *name;
	bool host_memory;	/* backend memory is ordinary host memory */

	void (*destroy)(void *ctx);

	/* ---- memory ---- */
	void *(*alloc)(void *ctx, size_t bytes);	/* NULL + errno on failure */
	void (*free)(void *ctx, void *p);
	int (*upload)(void *ctx, void *dst, const void *src, size_t bytes);
	int (*download)(void *ctx, void *dst, const void *src, size_t bytes);
	int (*sync)(void *ctx);

	/* ---- ops ---- */
	/* out[i][:] = table[tokens[i]][:] for i < n. */
	int (*embed)(void *ctx, float *out, const void *table, enum mlens_dtype dt,
		     int dim, const int32_t *tokens, int n);
	/* out[i] = x[i] / rms(x[i]) * w, eps inside the root; out may be x. */
	int (*rmsnorm)(void *ctx, float *out, const float *x, const void *w,
		       enum mlens_dtype dt, int n, int dim, float eps);
	/* out[n][m] = x[n][k] . W[m][k]^T; accumulate: out += instead of =. */
	int (*gemm)(void *ctx, float *out, const float *x, const void *w,
		    enum mlens_dtype dt, int n, int k, int m, bool accumulate);
	/* In place, HF rotate-half convention: x[n][n_heads*head_dim],
	 * token i at position pos[i]. */
	int (*rope)(void *ctx, float *x, const int32_t *pos, int n, int n_heads,
		    int head_dim, float theta);
	/* softmax over logits[n][n_experts], top-k (lower index wins ties),
	 * renormalised to sum 1 when renorm (else the softmax's own values):
	 * ids[n][k], weights[n][k] (backend memory). */
	int (*router)(void *ctx, int32_t *ids, float *weights, const float *logits,
		      int n, int n_experts, int k, bool renorm);
	/* out += sum over the k chosen experts e of weight * w2_e(silu(w1_e x) * w3_e x),
	 * x[n][hidden] already normalised. Experts are added in id order. */
	int (*moe)(void *ctx, float *out, const float *x, int n, const int32_t *ids,
		   const float *weights, int k, const struct mlens_moe_weights *w);
	/* Causal GQA attention within each prefill sequence: tokens of sequence s
	 * are rows [cu_seqlens[s], cu_seqlens[s+1]) at positions 0.. of it.
	 * q,out [T][n_heads*hd], k,v [T][n_kv*hd]. */
	int (*attn_prefill)(void *ctx, float *out, const float *q, const float *k,
			    const float *v, const int32_t *cu_seqlens, int n_seqs,
			    int n_heads, int n_kv_heads, int head_dim, float scale);
	/* Write k,v rows [n][n_kv*hd] of layer into the cache at slots
	 * (slot = block * block_size + offset). CUDA: the cache in device
	 * memory, or in host memory registered with the device (stored
	 * through its mapping; -EFAULT for host memory it cannot reach). */
	int (*kv_append)(void *ctx, struct mlens_kv_cache *kv, int layer,
			 const float *k, const float *v, const int64_t *slots, int n);
	/* Decode attention over the paged cache: query token i attends to
	 * positions [0, queries[i].ctx_len) of its sequence. */
	int (*attn_decode)(void *ctx, float *out, const float *q,
			   const struct mlens_kv_cache *kv, int layer,
			   const struct mlens_attn_query *queries, int n,
			   int n_heads, float scale);
	/* x[i][j] += b[j] for i < n, j < dim; b in dtype dt (a projection's
	 * bias). */
	int (*bias_add)(void *ctx, float *x, const void *b, enum mlens_dtype dt, int n, int dim);
	/* In place: each of x[count] clamped to [-limit, limit] (clip_qkv of
	 * q, k and v: OLMoE, DBRX); NaN stays NaN, as torch.clamp; a limit
	 * below 0 or NaN: -EINVAL. */
	int (*clamp)(void *ctx, float *x, size_t count, float limit);
	/* One expert chosen by every row, for moe with k = 1: ids[i] = 0 and
	 * weights[i] = 1, or sigmoid(logits[i]) when logits ([n][1]) is set. */
	int (*route_one)(void *ctx, int32_t *ids, float *weights, const float *logits, int n);
	/* Sample one token per row of logits[n][vocab]; logprobs (host, may be
	 * NULL) gets log-softmax of the chosen token at temperature 1. */
	int (*sample)(void *ctx, int32_t *tokens, float *logprobs, const float *logits,
		      int n, int vocab, const struct mlens_sampling *params);

	/* ---- optional: queues and events for the hybrid pipeline ----
	 * Present when ops->size covers them and the pointer is set (see
	 * MLENS_BACKEND_HAS). Queue 0 is where the ops above run, queue 1 a
	 * copy queue of its own; events are small integers below
	 * MLENS_BACKEND_EVENTS. Copies with these are asynchronous: the host
	 * memory must stay valid until an event recorded after them is done. */
	/* Make host memory usable by asynchronous copies (pin it in place). */
	int (*host_register)(void *ctx, void *p, size_t bytes);
	void (*host_unregister)(void *ctx, void *p);
	/* Pinned host memory that asynchronous copies may use. */
	void *(*host_alloc)(void *ctx, size_t bytes);
	void (*host_free)(void *ctx, void *p);
	/* Copy on queue: to_device ? host src -> backend dst : backend src -> host dst. */
	int (*copy_async)(void *ctx, int queue, void *dst, const void *src, size_t bytes,
			  bool to_device);
	int (*event_record)(void *ctx, int queue, int ev);
	/* queue waits (without the host waiting) for the last record of ev. */
	int (*event_wait)(void *ctx, int queue, int ev);
	/* The host waits for the last record of ev. */
	int (*event_sync)(void *ctx, int ev);
	/* Backend-memory bytes held now (allocations, scratch, workspace). */
	size_t (*mem_used)(void *ctx);

	/* ---- optional: timing marks (busy time, traces) ----
	 * Record mark id (below MLENS_BACKEND_TIMERS) on queue (0 compute,
	 * 1 copy): it takes the time at which the queue reaches it. The ids
	 * form two halves, below MLENS_BACKEND_TIMER_HALF and from it on.
	 * Marking a half's first id (0 or MLENS_BACKEND_TIMER_HALF) starts a
	 * batch in that half: the backend ties its clock to the host's there
	 * (it may wait for the queue once to do so), so that timer_read gives
	 * seconds on the host's CLOCK_MONOTONIC timeline, comparable with
	 * host-side times. A mark is read against its own half's batch, so
	 * that a new batch in one half leaves the other half's marks readable
	 * (a copy that runs on past its step). Marking an id again replaces
	 * the earlier mark. */
	int (*timer_mark)(void *ctx, int queue, int id);
	/* The time of mark id: 0, -EAGAIN while the queue has not reached it,
	 * -ENOENT for a mark never recorded, -EINVAL for an id out of range. */
	int (*timer_read)(void *ctx, int id, double *seconds);
	/* Make the calling thread ready to use copy_async and the events (the
	 * hybrid pipeline's host thread copies and waits from its own thread;
	 * those three are the only ops a second thread may call). */
	int (*bind_thread)(void *ctx);

	/* ---- optional: a fixed op scratch ----
	 * Allocate the scratch that ops take for their intermediates at bytes
	 * now, and from then on never grow it: an op that would need more
	 * fails with -ENOSPC. A caller that holds the device to a byte budget
	 * sizes it from its memory plan, so that no step waits on a
	 * reallocation and the budget holds. 0 lifts the limit (the scratch
	 * grows on demand again). */
	int (*scratch_reserve)(void *ctx, size_t bytes);

	/* ---- optional: a second copy queue ----
	 * true: queue 2 exists for copy_async, event_record and event_wait: a
	 * copy queue of its own beside queue 1, for copies that should
	 * overlap queue 0's kernels (the hybrid pipeline's activations out,
	 * ordered after their kernels by an event). */
	bool side_queue;

	/* ---- optional: the K/V append on queue 2 ----
	 * kv_append's work, queued on queue 2 (side_queue) behind what queue 2
	 * was made to wait for (an event recorded on queue 0 after the kernels
	 * that write k and v), so that the stores into a pool in registered
	 * host memory run while queue 0's next kernels do. k and v must stay
	 * as they are, and the slots written must not be read, until an event
	 * recorded on queue 2 after it is done; slots is read before it
	 * returns. Errors as kv_append's. */
	int (*kv_append_side)(void *ctx, struct mlens_kv_cache *kv, int layer,
			      const float *k, const float *v, const int64_t *slots, int n);

	/* ---- optional: an upload queue ----
	 * true: queue 3 exists for copy_async, event_record and event_wait: a
	 * copy queue of its own beside queues 1 and 2, for host-to-device
	 * copies that should run while queue 0 works on what was queued before
	 * them (the hybrid pipeline's CPU attention output, which queue 0 waits
	 * for by an event only when it needs it). */
	bool up_queue;

	/* ---- optional: activations that cross in the weights' dtype ----
	 * round: dst[r][c] = src[r][c] rounded to dt (bf16 or f16, to nearest
	 * even, bit for bit as mlens_store and the GPU backends' gemm round
	 * their activations; a NaN stays a NaN, its payload aside), rows x
	 * cols values, on queue 0. -EINVAL for a dt other than bf16/f16 or
	 * negative sizes. */
	int (*round)(void *ctx, void *dst, enum mlens_dtype dt, const float *src, int rows,
		     int cols);
	/* gemm with x[n][k] already in the weights' dtype dt: the product
	 * gemm gives for any fp32 x that rounds to it. Offered where gemm
	 * rounds its activations to the weights' dtype (a tensor-core
	 * backend), so that an activation bound for such a product can cross
	 * to the device in half the bytes; -ENOTSUP where this context's gemm
	 * of that dt and width does not round them (exact GEMMs, fp32 weights,
	 * the narrow products that widen the weights instead), so a caller
	 * may ask with n = 0 first. */
	int (*gemm_half_in)(void *ctx, float *out, const void *x, const void *w,
			    enum mlens_dtype dt, int n, int k, int m, bool accumulate);

	/* ---- optional: several products of one input ----
	 * out[i][n][m[i]] = x[n][k] . W_i[m[i]][k]^T for i < count (1 to
	 * MLENS_GEMM_MULTI_MAX): bit for bit what count gemm calls without
	 * accumulate give, but a backend whose gemm first rounds or splits x
	 * for its tensor cores does that once (the attention's Q, K and V
	 * projections). Errors as gemm's; -EINVAL for count out of range.
	 * Callers go through mlens_backend_gemm_multi. */
	int (*gemm_multi)(void *ctx, float *const *out, const float *x, const void *const *w,
			  enum mlens_dtype dt, int n, int k, const int *m, int count);

	/* ---- optional: decode attention's output in 16 bits ----
	 * half[n][n_heads][head_dim] = attn_decode's output rounded to dt
	 * (bf16 or f16) as round rounds it, bit for bit, without the fp32
	 * output crossing memory twice (the hybrid pipeline's attention
	 * output goes up to the GPU in the weights' dtype); out is room for
	 * the fp32 output, its content unspecified after. -EINVAL for another
	 * dt. Callers go through mlens_backend_attn_decode_half. */
	int (*attn_decode_half)(void *ctx, void *half, enum mlens_dtype dt, float *out,
				const float *q, const struct mlens_kv_cache *kv, int layer,
				const struct mlens_attn_query *queries, int n, int n_heads,
				float scale);

	/* ---- optional: the device a backend other than host memory runs on ----
	 * 0 or -errno; buffers get a NUL-terminated string cut to len. */
	/* Its free and total memory now. */
	int (*mem_info)(void *ctx, size_t *free_bytes, size_t *total_bytes);
	/* Its name ("NVIDIA H200"). */
	int (*device_name)(void *ctx, char *buf, size_t len);
	/* Its PCI bus id ("0000:3b:00.0"). */
	int (*bus_id)(void *ctx, char *buf, size_t len);

	/* ---- optional: what families other than Mixtral's need ----
	 * Callers go through MLENS_BACKEND_HAS; a layer that needs one the
	 * backend lacks fails with -ENOTSUP. */
	/* out[i] = (x[i] - mean(x[i])) / sqrt(var(x[i]) + eps) * w, the
	 * variance biased, no bias term (LayerNorm(bias=False), DBRX); out
	 * may be x. */
	int (*layernorm)(void *ctx, float *out, const float *x, const void *w,
			 enum mlens_dtype dt, int n, int dim, float eps);

	/* ---- optional: how fp8 experts multiply ----
	 * Whether fp8 experts of a 16-bit model with per-channel scales, fast
	 * GEMMs and dimensions that are multiples of 16 run on fp8 tensor
	 * cores, with no dequantized copy (opts fp8_gemm and the device);
	 * NULL: never. */
	bool (*fp8_tc)(void *ctx);
};

#define MLENS_GEMM_MULTI_MAX 4

#define MLENS_BACKEND_EVENTS 20
#define MLENS_BACKEND_TIMERS 16384
#define MLENS_BACKEND_TIMER_HALF (MLENS_BACKEND_TIMERS / 2)

/* True when ops has the optional member m set. */
#define MLENS_BACKEND_HAS(ops, m)                                                   \
	((ops)->size >= offsetof(struct mlens_backend_ops, m) + sizeof((ops)->m) && (ops)->m)

struct mlens_backend {
	const struct mlens_backend_ops *ops;
	void *ctx;
};

/* How a GPU backend multiplies fp32 activations by bf16/f16 weights.
 * FAST rounds the activations to the weight dtype and runs one tensor-core
 * GEMM (about 2^-9 relative per element for bf16). EXACT splits each
 * activation into three parts of the weight dtype whose sum is the fp32
 * value and runs three GEMMs with fp32 accumulation: the CPU's result to
 * fp32 rounding, at three times the tensor-core work. fp32 weights and the
 * CPU backend are exact either way. */
enum mlens_gemm_mode {
	MLENS_GEMM_FAST = 0,
	MLENS_GEMM_EXACT = 1,
};
/* The parts an EXACT GEMM splits each activation into. */
#define MLENS_GEMM_EXACT_PARTS 3

/* The CUDA backend's MoE (kernels/cuda/backend_cuda.cu). Its experts'
 * GEMMs spread over this many streams (the compute stream and helpers, one
 * cuBLAS workspace of MLENS_CUDA_BLAS_WS each), so that one expert's small
 * GEMM does not leave SMs idle while the next waits behind it. */
#define MLENS_MOE_STREAMS_DEFAULT 2
#define MLENS_MOE_STREAMS_MAX 4
#define MLENS_CUDA_BLAS_WS (32ull << 20)
/* Tokens of one MoE call at most: larger calls go through in chunks of
 * this many, so that the scratch (a few tens of KB a routed row at
 * Mixtral sizes, twice that with exact GEMMs) stays bounded; a chunk this large is GEMM-bound, so reading the experts once a
 * chunk costs little. */
#define MLENS_CUDA_MOE_CHUNK_TOKENS 4096
/* Rows of gate/up scratch a MoE call holds at most (CUDA backend): split
 * evenly between the MoE streams, each stream's experts go through their
 * piece one after another (an expert with more rows in pieces of about
 * equal size), so that the scratch does not grow with the call's tokens;
 * the pieces are slices of one area, each aligned to 256 bytes. */
#define MLENS_CUDA_MOE_GU_ROWS 2048
static inline size_t mlens_moe_piece_rows(size_t rows, int streams)
{
	size_t gu = rows < MLENS_CUDA_MOE_GU_ROWS ? rows : MLENS_CUDA_MOE_GU_ROWS;
	size_t p = streams > 1 ? gu / (size_t)streams : gu;
	return p ? p : 1;
}
/* Fast GEMMs on 16-bit weights write the experts' gate and up outputs in
 * the weight dtype (as the reference's 16-bit model does) and silu(g) * u
 * in place over g; else they are fp32 and silu(g) * u has its own buffer
 * (exact: in parts). weight_bytes: 2 or 4. */
static inline bool mlens_moe_half_gu(enum mlens_gemm_mode gemm, size_t weight_bytes)
{
	return gemm == MLENS_GEMM_FAST && weight_bytes == 2;
}

/* Bytes of MoE scratch the CUDA backend holds for fp8 experts: each of
 * streams MoE streams dequantizes its current expert's three matrices
 * (bf16 for fast GEMMs of a 16-bit model, else fp32) before their GEMMs;
 * counted at fp32 for exact GEMMs. */
static inline size_t mlens_moe_fp8_dequant_bytes(size_t hidden, size_t inter, int streams,
						 enum mlens_gemm_mode gemm)
{
	size_t one = 3 * hidden * inter * (gemm == MLENS_GEMM_EXACT ? 4 : 2);
	return (size_t)streams * ((one + 255) & ~(size_t)255);
}

/* fp8 experts on fp8 tensor cores (CUDA backend): no dequantized copy;
 * a MoE chunk's rows are quantized once (rows x hidden bytes and a scale
 * a row), and each MoE stream's piece of prow rows holds gate and up (bf16),
 * silu(g) * u quantized (a byte a value and a scale a row) and
 * room for 16-byte aligned copies of a GEMM's two scale vectors; each
 * area 256-byte aligned. */
static inline size_t mlens_moe_fp8_tc_piece_bytes(size_t prow, size_t hidden, size_t inter)
{
#define MLENS_A256(x) (((x) + 255) & ~(size_t)255)
	size_t wide = hidden > inter ? hidden : inter;
	return 2 * MLENS_A256(prow * inter * 2) + MLENS_A256(prow * inter) + MLENS_A256(prow * 4) +
	       MLENS_A256((prow + 4 + wide) * 4);
#undef MLENS_A256
}

/* Whether the CUDA backend runs a MoE call's expert GEMMs as grouped
 * batched GEMMs (one cuBLAS call for every expert's gate and up, one for
 * down) or three GEMMs an expert spread over the MoE streams: auto takes
 * the grouped call where many experts have rows; fast GEMMs on bf16/f16
 * experts only (else always per expert). */
enum mlens_moe_grouped {
	MLENS_MOE_GROUPED_AUTO = 0,
	MLENS_MOE_GROUPED_ON,
	MLENS_MOE_GROUPED_OFF,
};
/* Experts with rows in a MoE chunk from which auto groups. */
#define MLENS_MOE_GROUPED_MIN_EXPERTS 32

/* How a host thread waits for the GPU (CUDA's device schedule flags): auto
 * is CUDA's heuristic (spin when the process has fewer contexts than the
 * machine has cores), spin busy-waits, yield busy-waits giving way to
 * other runnable threads, block sleeps until the GPU interrupts. */
enum mlens_gpu_sync {
	MLENS_GPU_SYNC_AUTO = 0,
	MLENS_GPU_SYNC_SPIN,
	MLENS_GPU_SYNC_YIELD,
	MLENS_GPU_SYNC_BLOCK,
};

/* How the CUDA backend multiplies fp8 experts. AUTO and FP8: those of a
 * 16-bit model with per-channel (or per-tensor) scales and fast GEMMs on
 * fp8 tensor cores through cuBLASLt (compute capability 8.9 on),
 * activations quantized per token, fp32 accumulation, both scales applied
 * to the product (outer product); other experts, and all where the device
 * has no fp8 GEMM, take the dequantize path (FP8 says so on stderr).
 * DEQUANT: every expert widened to bf16 (fp32 for exact GEMMs or an fp32
 * model) for the usual GEMMs. */
enum mlens_fp8_gemm {
	MLENS_FP8_GEMM_AUTO = 0,
	MLENS_FP8_GEMM_FP8,
	MLENS_FP8_GEMM_DEQUANT,
};

struct mlens_backend_opts {
	int n_threads;		/* CPU: worker threads, 0 = all cores of numa_node
				 * less n_reserved (at least 1) */
	int device;		/* CUDA: device ordinal */
	enum mlens_gemm_mode gemm;	/* CUDA: half-precision GEMMs (0: FAST) */
	bool prefill_bf16;	/* CUDA: prefill attention (head_dim 64, 128) on
				 * tensor cores: Q, K, V and the softmax weights
				 * rounded to bf16, fp32 accumulation, max and
				 * sums (about 2^-9 relative, as FAST GEMMs);
				 * false: fp32 throughout */
	bool sm_copy;		/* CUDA: the compute stream's copies to and from
				 * pinned host memory by the SMs (mapped memory),
				 * not a copy engine */
	int moe_streams;	/* CUDA: streams a MoE call's experts spread over,
				 * 1..MLENS_MOE_STREAMS_MAX; 0 = the default */
	enum mlens_gpu_sync sync;	/* CUDA: how host threads wait for the
					 * device (its schedule flags, for the
					 * whole process); 0: CUDA's auto */
	enum mlens_fp8_gemm fp8_gemm;	/* CUDA: how fp8 experts multiply */
	enum mlens_moe_grouped moe_grouped;	/* CUDA: the experts' GEMMs grouped
						 * (0: auto) */
	int numa_node;		/* CPU: the node whose cores run the workers (the
				 * KV pool's); < 0 unpinned; 0 when zeroed */
	int n_reserved;		/* CPU: cores of that node left out of the pool */
};

/* "fast" or "exact" -> *out; -EINVAL for anything else. */
int mlens_gemm_mode_parse(const char *s, enum mlens_gemm_mode *out);
const char *mlens_gemm_mode_name(enum mlens_gemm_mode m);
/* "auto", "spin", "yield" or "block" -> *out; -EINVAL for anything else. */
int mlens_gpu_sync_parse(const char *s, enum mlens_gpu_sync *out);
const char *mlens_gpu_sync_name(enum mlens_gpu_sync m);
/* "auto", "on" or "off" -> *out; -EINVAL for anything else. */
int mlens_moe_grouped_parse(const char *s, enum mlens_moe_grouped *out);
const char *mlens_moe_grouped_name(enum mlens_moe_grouped m);

int mlens_backend_cpu_create(struct mlens_backend *be, const struct mlens_backend_opts *o);
#ifdef HAVE_CUDA
int mlens_backend_cuda_create(struct mlens_backend *be, const struct mlens_backend_opts *o);
/* Device bytes the CUDA backend holds through cudaMalloc: the caller's
 * allocations plus its own staging, scratch and cuBLAS workspace (0 for a
 * backend that is not CUDA). */
size_t mlens_backend_cuda_mem_used(const struct mlens_backend *be);
#endif
/* True when the CUDA backend is built and a GPU is present. */
bool mlens_cuda_available(void);
/* The PCI bus id of GPU ordinal device ("0000:3b:00.0") before any
 * backend runs on it (its NUMA node at start-up); -ENODEV without one. A
 * backend's own device: ops->bus_id. */
int mlens_gpu_bus_id(int device, char *buf, size_t len);
/* name: "cpu", "cuda" or "auto" (CUDA when a GPU is present). */
int mlens_backend_create(struct mlens_backend *be, const char *name,
			 const struct mlens_backend_opts *o);

/* Place bytes of host data where the backend's ops read them: the host
 * pointer itself on a host-memory backend, else a new backend buffer holding
 * a copy. Chains on *rc: does nothing once *rc is set, sets it on failure. */
static inline const void *mlens_backend_place(const struct mlens_backend *be, const void *host,
					      size_t bytes, int *rc)
{
	void *d;
	if (*rc)
		return NULL;
	if (be->ops->host_memory)
		return host;
	d = be->ops->alloc(be->ctx, bytes);
	if (!d) {
		*rc = -ENOMEM;
		return NULL;
	}
	*rc = be->ops->upload(be->ctx, d, host, bytes);
	return d;
}

/* Undo mlens_backend_place (p may be NULL). */
static inline void mlens_backend_unplace(const struct mlens_backend *be, const void *p)
{
	if (!be->ops->host_memory && p)
		be->ops->free(be->ctx, (void *)p);
}

/* ops->gemm_multi where the backend has it, else count gemm calls (the
 * same products). */
static inline int mlens_backend_gemm_multi(const struct mlens_backend_ops *ops, void *ctx,
					   float *const *out, const float *x,
					   const void *const *w, enum mlens_dtype dt, int n, int k,
					   const int *m, int count)
{
	if (count < 1 || count > MLENS_GEMM_MULTI_MAX)
		return -EINVAL;
	if (MLENS_BACKEND_HAS(ops, gemm_multi))
		return ops->gemm_multi(ctx, out, x, w, dt, n, k, m, count);
	for (int i = 0; i < count; i++) {
		int rc = ops->gemm(ctx, out[i], x, w[i], dt, n, k, m[i], false);
		if (rc)
			return rc;
	}
	return 0;
}

/* ops->attn_decode_half where the backend has it, else attn_decode into
 * out and round into half (the same bits); -ENOTSUP without round. */
static inline int mlens_backend_attn_decode_half(const struct mlens_backend_ops *ops, void *ctx,
						 void *half, enum mlens_dtype dt, float *out,
						 const float *q, const struct mlens_kv_cache *kv,
						 int layer, const struct mlens_attn_query *queries,
						 int n, int n_heads, float scale)
{
	int rc;
	if (MLENS_BACKEND_HAS(ops, attn_decode_half))
		return ops->attn_decode_half(ctx, half, dt, out, q, kv, layer, queries, n, n_heads,
					     scale);
	if (!MLENS_BACKEND_HAS(ops, round))
		return -ENOTSUP;
	if (dt != MLENS_DTYPE_BF16 && dt != MLENS_DTYPE_F16)
		return -EINVAL;
	rc = ops->attn_decode(ctx, out, q, kv, layer, queries, n, n_heads, scale);
	if (rc || n <= 0)
		return rc;
	return ops->round(ctx, half, dt, out, n, n_heads * kv->head_dim);
}

static inline void mlens_backend_destroy(struct mlens_backend *be)
{
	if (be->ops)
		be->ops->destroy(be->ctx);
	be->ops = NULL;
	be->ctx = NULL;
}

#endif
