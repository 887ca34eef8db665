/* CUDA backend internals shared by its .cu files: the context (stream,
 * cuBLAS handle, staging and scratch buffers, byte accounting), the one
 * macro family that turns CUDA and cuBLAS errors into -errno with a logged
 * message, and the launchers each file provides to backend_cuda.cu.
 * Ops of one backend are called from one thread at a time. */
#ifndef MLENS_CUDA_INT_H
#define MLENS_CUDA_INT_H

/* nvcc does not get the -include of config.h that the C files get */
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>

extern "C" {
#include "kernels/backend.h"
/* The PCI bus id of a device (backend_cuda.cu; kernels/backend.c's
 * mlens_gpu_bus_id and the ops' bus_id): 0 or -ENODEV. */
int mlens_cuda_pci_bus_id(int device, char *buf, int len);
}

/* Blocks of 256 threads unless a kernel says otherwise. */
#define MLENS_CUDA_THREADS 256

/* Host staging areas in flight at once. */
#define MLENS_CUDA_STAGE_SLOTS 4

struct cuda_stage_slot {
	char *h;		/* pinned */
	void *hd;		/* h through its mapping, where the device reads it */
	size_t cap;
	cudaEvent_t done;	/* the copy out of h has finished */
};

/* One stream's metadata staging. The host side is a ring, so the host can
 * fill op N+1's metadata while op N's copy still waits in the stream; one
 * device area suffices since the stream orders each copy after the
 * kernels that read the last. */
struct cuda_stager {
	struct cuda_stage_slot slot[MLENS_CUDA_STAGE_SLOTS];
	int next;
	char *d;
	size_t d_cap;
	cudaStream_t stream;	/* its copies and their readers */
};

/* fp8 GEMM shapes whose cuBLASLt algorithm a context keeps */
#define MLENS_CUDA_LT_ALGOS 128
struct mlens_cuda_lt_algo {
	int k, m, nb;		/* nb: n rounded up to a power of 2 */
	int ot;			/* the output's enum mlens_dtype */
	bool scaled, found;	/* outer-vector scales; an algorithm */
	cublasLtMatmulAlgo_t algo;
};

struct mlens_cuda_ctx {
	int device;
	cudaStream_t stream;
	cublasHandle_t blas;
	cublasLtHandle_t lt;		/* fp8 GEMMs (fp8_tc) */
	bool fp8_tc;			/* opts fp8_gemm, and the device runs one */
	/* cuBLASLt's algorithms for the fp8 GEMMs by shape (lt_gemm_fp8):
	 * found once, so that a MoE call's many GEMMs pay no heuristic */
	struct mlens_cuda_lt_algo lt_algo[MLENS_CUDA_LT_ALGOS];
	int lt_algos, lt_next;		/* entries held, the next one replaced */
	void *lt_ws;			/* the current MoE stream's workspace */
	bool lt_unscaled_said;		/* the scale-pass fallback told on stderr */
	int lt_last_status;		/* cuBLASLt's last refusal (heuristic or product) */
	bool gemm_exact;		/* MLENS_GEMM_EXACT: split activations */
	enum mlens_moe_grouped moe_grouped;	/* opts moe_grouped; off after
						 * cuBLAS refused the grouped call */
	bool prefill_bf16;		/* prefill attention on tensor cores (bf16) */
	/* the compute stream's host <-> device copies done by an SM kernel on
	 * mapped pinned memory rather than a copy engine (opts sm_copy) */
	bool sm_copy;
	void *blas_ws;			/* cuBLAS workspaces, one a MoE stream */
	size_t blas_ws_bytes;		/* of each */
	/* the MoE's expert streams: moe_stream[0] is the compute stream,
	 * the others wait for it (moe_fork) and it for them (moe_join[i]) */
	int moe_streams;
	cudaStream_t moe_stream[MLENS_MOE_STREAMS_MAX];
	cudaEvent_t moe_fork, moe_join[MLENS_MOE_STREAMS_MAX];
	/* recorded after the expert counts' copy to the host: the host waits
	 * for it, not for the whole stream, so the gather queued behind it
	 * runs while the host wakes up */
	cudaEvent_t moe_counts;

	/* host metadata goes pinned host -> device staging, one copy per op:
	 * the compute stream's ops through stage, the side K/V append (queue
	 * 2) through side_stage */
	struct cuda_stager stage, side_stage;
	/* blocks of the side K/V append kernel at most (a grid-stride loop
	 * over the tokens), so that it leaves most SMs to queue 0's kernels */
	int side_append_blocks;
	/* blocks of the SM copies on the upload stream (queue 3) at most:
	 * they run beside queue 0's kernels too */
	int up_blocks;

	/* device scratch for converted activations, permutations, partials */
	char *d_scratch;
	size_t scratch_cap;
	bool scratch_fixed;		/* scratch_reserve: never grows */

	/* small pinned area for values read back (expert counts, tokens) */
	void *h_back;
	size_t back_cap;

	/* host scratch for the CPU sampling rules */
	void *h_sample;
	size_t sample_cap;

	/* rope: inverse frequencies of the last (theta, head_dim), host side */
	float rope_theta;
	int rope_hd;
	float rope_inv[512];

	/* the hybrid pipeline's copy queue (queue 1) and events */
	cudaStream_t copy_stream;
	cudaStream_t side_stream;	/* queue 2: copies beside the compute stream */
	cudaStream_t up_stream;		/* queue 3: uploads beside the compute stream */
	cudaEvent_t events[MLENS_BACKEND_EVENTS];

	/* timing marks: events with timing, created at first use; the base
	 * event of the batch and the host clock when it was reached */
	cudaEvent_t *timers;		/* [MLENS_BACKEND_TIMERS] */
	unsigned char *timer_set;	/* recorded since created */
	cudaEvent_t timer_base[2];	/* per half of the timer ids (backend.h) */
	double timer_base_host[2];
	bool timer_base_ok[2];

	/* device bytes held through cudaMalloc (ours and the caller's) */
	size_t bytes_in_use;
	struct cuda_alloc_slot *allocs;	/* open addressing: pointer -> size */
	size_t alloc_cap;		/* power of two */
	size_t alloc_count;
};

/* ==== errors ==== */

int mlens_cuda_rc(cudaError_t e, const char *what, const char *file, int line);
int mlens_cublas_rc(cublasStatus_t s, const char *what, const char *file, int line);

/* Evaluate a CUDA runtime call; on failure log it and return -errno from
 * the calling function. */
#define CUDA_RET(expr)                                                             \
	do {                                                                       \
		cudaError_t e_ = (expr);                                           \
		if (e_ != cudaSuccess)                                             \
			return mlens_cuda_rc(e_, #expr, __FILE__, __LINE__);       \
	} while (0)

/* The same, storing the code in rc and jumping to a cleanup label. */
#define CUDA_GOTO(expr, rc, label)                                                 \
	do {                                                                       \
		cudaError_t e_ = (expr);                                           \
		if (e_ != cudaSuccess) {                                           \
			rc = mlens_cuda_rc(e_, #expr, __FILE__, __LINE__);         \
			goto label;                                                \
		}                                                                  \
	} while (0)

#define CUBLAS_RET(expr)                                                           \
	do {                                                                       \
		cublasStatus_t s_ = (expr);                                        \
		if (s_ != CUBLAS_STATUS_SUCCESS)                                   \
			return mlens_cublas_rc(s_, #expr, __FILE__, __LINE__);     \
	} while (0)

/* After a kernel launch: launch-configuration errors surface here. */
#define CUDA_LAUNCHED() CUDA_RET(cudaGetLastError())

/* ==== context services (backend_cuda.cu) ==== */

/* Staging of host metadata: begin returns the pinned host area (at least
 * bytes long, free to overwrite) and its device twin; commit copies the
 * first used bytes over on the stager's stream. Offsets inside are the
 * caller's. The stage_ pair is the compute stream's (c->stage). */
int mlens_cuda_stager_begin(struct mlens_cuda_ctx *c, struct cuda_stager *s, size_t bytes,
			    char **host, char **dev);
int mlens_cuda_stager_commit(struct mlens_cuda_ctx *c, struct cuda_stager *s, size_t used);
int mlens_cuda_stage_begin(struct mlens_cuda_ctx *c, size_t bytes, char **host, char **dev);
int mlens_cuda_stage_commit(struct mlens_cuda_ctx *c, size_t used);

/* Device scratch of at least bytes, valid until the next call. */
int mlens_cuda_scratch(struct mlens_cuda_ctx *c, size_t bytes, char **dev);

/* Pinned host area of at least bytes for values read back. */
int mlens_cuda_back(struct mlens_cuda_ctx *c, size_t bytes, void **host);

/* A copy on the compute stream between pinned host memory and the device
 * (to_device: host src), by a copy engine or, with sm_copy, by the SMs
 * through the host memory's mapping (a copy engine when it has none).
 * Every asynchronous copy of the compute stream goes through here; only
 * the synchronous upload/download ops (set-up, logits a caller asked
 * for, into the caller's memory) call cudaMemcpyAsync themselves. */
int mlens_cuda_copy(struct mlens_cuda_ctx *c, void *dst, const void *src, size_t bytes,
		    bool to_device);

/* Round a byte offset up to 256 (what cudaMalloc and cuBLAS like). */
static inline size_t mlens_cuda_align(size_t off)
{
	return (off + 255) & ~(size_t)255;
}

/* ==== launchers ==== */

/* ops_cuda.cu */
int mlens_cuda_embed(struct mlens_cuda_ctx *c, float *out, const void *table,
		     enum mlens_dtype dt, int dim, const int32_t *tokens, int n);
int mlens_cuda_rmsnorm(struct mlens_cuda_ctx *c, float *out, const float *x, const void *w,
		       enum mlens_dtype dt, int n, int dim, float eps);
int mlens_cuda_layernorm(struct mlens_cuda_ctx *c, float *out, const float *x, const void *w,
			 enum mlens_dtype dt, int n, int dim, float eps);
int mlens_cuda_rope(struct mlens_cuda_ctx *c, float *x, const int32_t *pos, int n,
		    int n_heads, int head_dim, float theta);
int mlens_cuda_router(struct mlens_cuda_ctx *c, int32_t *ids, float *weights,
		      const float *logits, int n, int n_experts, int k, bool renorm);
int mlens_cuda_route_one(struct mlens_cuda_ctx *c, int32_t *ids, float *weights,
			 const float *logits, int n);
int mlens_cuda_bias_add(struct mlens_cuda_ctx *c, float *x, const void *b, enum mlens_dtype dt,
			int n, int dim);
int mlens_cuda_clamp(struct mlens_cuda_ctx *c, float *x, size_t count, float limit);
/* Convert rows of fp32 to dtype dt (F16/BF16), optionally gathering: row r
 * of dst is src row gather[r] / gather_div (gather NULL: row r). */
int mlens_cuda_convert_rows(struct mlens_cuda_ctx *c, void *dst, enum mlens_dtype dt,
			    const float *src, const int32_t *gather, int gather_div,
			    int rows, int cols);
/* Parts of an exact product (MLENS_GEMM_EXACT): x = p0 + p1 / S + p2 / S^2
 * with each part in dtype dt (F16/BF16) and S = mlens_cuda_split_scale(dt).
 * Exact for every normal fp32 x with bf16; with f16 for 2^-20 <= |x| <=
 * 65504 (below, off by less than 2^-47; above, inf as fast mode's rounding
 * gives). Checked on 2e6 random values over 2^-40..2^40 (bf16). */
#define MLENS_CUDA_SPLIT_PARTS MLENS_GEMM_EXACT_PARTS
static inline float mlens_cuda_split_scale(enum mlens_dtype dt)
{
	/* one part holds 8 (bf16) or 11 (f16) significant bits; scaling each
	 * remainder back up keeps it clear of the narrow type's underflow */
	return dt == MLENS_DTYPE_F16 ? 2048.0f : 256.0f;
}
/* dst[rows][cols] (dt: bf16 or fp32) = e4m3(q[r][c]) * its scale (scales
 * laid out as k says): an fp8 matrix dequantized for the GEMMs of the
 * 16/32-bit paths; the product in fp32 (exact), then rounded to dt. */
int mlens_cuda_dequant_fp8(struct mlens_cuda_ctx *c, void *dst, enum mlens_dtype dt,
			   const uint8_t *q, const float *scales, const struct mlens_wscale *k,
			   int rows, int cols);
/* Each row of x [rows][cols] (dt) quantized to e4m3 with its own scale
 * (amax / 448) into q and scales: the per-token activations of an fp8
 * GEMM. */
int mlens_cuda_quant_rows_fp8(struct mlens_cuda_ctx *c, uint8_t *q, float *scales, const void *x,
			      enum mlens_dtype dt, int rows, int cols);
/* The same for the fp32 rows of src gathered as mlens_cuda_convert_rows
 * gathers them (row r is src row gather[r] / gather_div; gather NULL: row
 * r): a MoE chunk's rows in expert order, quantized once for all its
 * experts' gate and up GEMMs. */
int mlens_cuda_quant_gather_fp8(struct mlens_cuda_ctx *c, uint8_t *q, float *scales,
				const float *src, const int32_t *gather, int gather_div, int rows,
				int cols);
/* h = silu(g) * u (g and u [rows][cols] of gdt, the product in fp32) with
 * each row quantized to e4m3 as mlens_cuda_quant_rows_fp8 does, in one
 * pass: the down GEMM's input of fp8 experts. */
int mlens_cuda_silu_mul_quant_fp8(struct mlens_cuda_ctx *c, uint8_t *q, float *scales,
				  const void *g, const void *u, enum mlens_dtype gdt, int rows,
				  int cols);
/* dst[r][j] = src[r][j] * rs[r] * cs[j], both of dt (fp32 or 16-bit),
 * the product in fp32: an fp8 GEMM's product with its per-token and
 * per-channel scales applied; dst may be src. */
int mlens_cuda_scale_outer(struct mlens_cuda_ctx *c, void *dst, enum mlens_dtype dt,
			   const void *src, const float *rs, const float *cs, int rows, int cols);

/* Like mlens_cuda_convert_rows, but writes the three parts of each value:
 * part j of row r at dst + (j * part_stride + r * cols) elements. */
int mlens_cuda_split_rows(struct mlens_cuda_ctx *c, void *dst, enum mlens_dtype dt,
			  const float *src, const int32_t *gather, int gather_div,
			  int rows, int cols, size_t part_stride);
/* h = silu(g) * u, g and u of dtype gdt, written as dtype dt (h may be g
 * when the dtypes match: each element is read before it is written). */
int mlens_cuda_silu_mul(struct mlens_cuda_ctx *c, void *h, enum mlens_dtype dt,
			const void *g, const void *u, enum mlens_dtype gdt, size_t count);
/* dst[count] = src[count] of dtype dt, widened to fp32. */
int mlens_cuda_widen(struct mlens_cuda_ctx *c, float *dst, const void *src, enum mlens_dtype dt,
		     size_t count);
/* MoE routing tables from ids[n][k]: counts[e], rows in expert order
 * (perm[r] = i*k+s, stable in i), inverse inv[i*k+s] = r. */
int mlens_cuda_moe_route(struct mlens_cuda_ctx *c, int32_t *counts, int32_t *perm,
			 int32_t *inv, const int32_t *ids, int n, int k, int n_experts);
/* out[i] += sum over s in expert-id order of weights[i][s] * y[inv[i*k+s]]. */
int mlens_cuda_moe_combine(struct mlens_cuda_ctx *c, float *out, const float *y,
			   const int32_t *ids, const float *weights, const int32_t *inv,
			   int n, int k, int hidden);
/* Where the device reaches p: device (or managed) memory as it is, host
 * memory from cudaHostAlloc or registered with the device through its
 * mapping (*host set then); -EFAULT for memory it cannot reach (pageable
 * host memory), the lookup's error cleared. */
int mlens_cuda_device_view(const void *p, void **dev, bool *host);
/* dst[bytes] = src[bytes] by the SMs, on stream st, in at most max_blocks
 * blocks (0: as many as keep PCIe busy with the SMs to itself); either side may be mapped host memory (its device address). */
int mlens_cuda_sm_copy_on(struct mlens_cuda_ctx *c, cudaStream_t st, void *dst, const void *src,
			  size_t bytes, unsigned max_blocks);
/* Greedy token and log-softmax of it (temperature 1) per row, device out. */
int mlens_cuda_argmax(struct mlens_cuda_ctx *c, int32_t *tokens, float *logprobs,
		      const float *logits, int n, int vocab);

/* attn_cuda.cu */
int mlens_cuda_attn_prefill(struct mlens_cuda_ctx *c, float *out, const float *q,
			    const float *k, const float *v, const int32_t *cu_seqlens,
			    int n_seqs, int n_heads, int n_kv_heads, int head_dim, float scale);
int mlens_cuda_kv_append(struct mlens_cuda_ctx *c, struct mlens_kv_cache *kv, int layer,
			 const float *k, const float *v, const int64_t *slots, int n);
/* The same on the side stream (queue 2), in at most c->side_append_blocks
 * blocks. */
int mlens_cuda_kv_append_side(struct mlens_cuda_ctx *c, struct mlens_kv_cache *kv, int layer,
			      const float *k, const float *v, const int64_t *slots, int n);
int mlens_cuda_attn_decode(struct mlens_cuda_ctx *c, float *out, const float *q,
			   const struct mlens_kv_cache *kv, int layer,
			   const struct mlens_attn_query *queries, int n, int n_heads,
			   float scale);

/* moe_grouped.cu */
/* Whether this chunk's experts (counts[e] rows each, on the host) go
 * through mlens_cuda_moe_grouped: opts moe_grouped, fast GEMMs on
 * bf16/f16 experts of sizes and addresses the grouped call takes. */
bool mlens_cuda_moe_grouped_use(const struct mlens_cuda_ctx *c, const struct mlens_moe_weights *w,
				const int32_t *counts);
/* The rows (in expert order, counts[e] each) of xe [rows][H] (the weight
 * dtype) through gate, up, silu(g) * u and down into y [rows][H] (fp32),
 * in waves of as many rows as gu (gu_bytes) holds gate and up of (the
 * weight dtype); each wave's down output overwrites its rows of xe,
 * widened into y at the end, so gu may overlap y. -ENOTSUP (nothing
 * queued that matters) where cuBLAS refuses the grouped call: the caller
 * runs the experts one by one. */
int mlens_cuda_moe_grouped(struct mlens_cuda_ctx *c, const struct mlens_moe_weights *w,
			   const int32_t *counts, size_t rows, char *xe, char *gu, size_t gu_bytes,
			   float *y);

#endif
