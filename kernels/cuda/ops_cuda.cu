/* CUDA kernels for the element-wise and small ops: embedding gather,
 * RMSNorm, RoPE, router, dtype conversion, SiLU-mul, the MoE token
 * permutation and combine, and greedy sampling. Reductions run in a fixed
 * order so that results do not change from run to run. */
#include "kernels/cuda/cuda_int.h"

#include <math.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

/* ==== element access ==== */

__device__ __forceinline__ float load_elem(const void *p, enum mlens_dtype dt, size_t i)
{
	switch (dt) {
	case MLENS_DTYPE_F16: return __half2float(((const __half *)p)[i]);
	case MLENS_DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
	case MLENS_DTYPE_E4M3:
		return __half2float(__half(__nv_cvt_fp8_to_halfraw(
			(__nv_fp8_storage_t)((const uint8_t *)p)[i], __NV_E4M3)));
	case MLENS_DTYPE_F32: break;
	}
	return ((const float *)p)[i];
}

/* Round to nearest even, as kernels/dtype.h does on the CPU. */
__device__ __forceinline__ void store_elem(void *p, enum mlens_dtype dt, size_t i, float v)
{
	switch (dt) {
	case MLENS_DTYPE_F16: ((__half *)p)[i] = __float2half_rn(v); return;
	case MLENS_DTYPE_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); return;
	case MLENS_DTYPE_E4M3:	/* saturating, nearest even: kernels/fp8.h */
		((uint8_t *)p)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
		return;
	case MLENS_DTYPE_F32: break;
	}
	((float *)p)[i] = v;
}

/* v rounded to dt (nearest even) and widened back: what store_elem keeps. */
__device__ __forceinline__ float load_rounded(enum mlens_dtype dt, float v)
{
	switch (dt) {
	case MLENS_DTYPE_F16: return __half2float(__float2half_rn(v));
	case MLENS_DTYPE_BF16: return __bfloat162float(__float2bfloat16_rn(v));
	case MLENS_DTYPE_E4M3:
		return __half2float(__half(__nv_cvt_fp8_to_halfraw(
			__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3), __NV_E4M3)));
	case MLENS_DTYPE_F32: break;
	}
	return v;
}

/* 16-bit values to and from fp32 by type, for the vectorised kernels. */
__device__ __forceinline__ float to_float(__nv_bfloat16 v)
{
	return __bfloat162float(v);
}

__device__ __forceinline__ float to_float(__half v)
{
	return __half2float(v);
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v)
{
	return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float<__half>(float v)
{
	return __float2half_rn(v);
}

static unsigned blocks_for(size_t count, unsigned threads)
{
	size_t b = (count + threads - 1) / threads;
	return (unsigned)(b > 65535u * 16u ? 65535u * 16u : b);
}

/* ==== embedding ==== */

__global__ void embed_kernel(float *out, const void *table, enum mlens_dtype dt, int dim,
			     const int32_t *tokens)
{
	size_t row = blockIdx.x;
	size_t src = (size_t)tokens[row] * (size_t)dim;
	for (int j = threadIdx.x; j < dim; j += blockDim.x)
		out[row * dim + j] = load_elem(table, dt, src + j);
}

int mlens_cuda_embed(struct mlens_cuda_ctx *c, float *out, const void *table,
		     enum mlens_dtype dt, int dim, const int32_t *tokens, int n)
{
	char *h, *d;
	int rc;
	if (n < 0 || dim <= 0)
		return -EINVAL;
	if (!n)
		return 0;
	for (int i = 0; i < n; i++)
		if (tokens[i] < 0)
			return -EINVAL;
	if ((rc = mlens_cuda_stage_begin(c, (size_t)n * 4, &h, &d)))
		return rc;
	memcpy(h, tokens, (size_t)n * 4);
	if ((rc = mlens_cuda_stage_commit(c, (size_t)n * 4)))
		return rc;
	embed_kernel<<<n, MLENS_CUDA_THREADS, 0, c->stream>>>(out, table, dt, dim,
							       (const int32_t *)d);
	CUDA_LAUNCHED();
	return 0;
}

/* ==== RMSNorm ==== */

/* Sum of v over the block, in a fixed order; every thread gets the total. */
template <typename T>
__device__ T block_sum(T v, T *sh)
{
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	__syncthreads();	/* sh may still be read by a previous call */
	if (!lane)
		sh[warp] = v;
	__syncthreads();
	T t = 0;
	for (int w = 0; w < nw; w++)
		t += sh[w];
	return t;
}

__global__ void rmsnorm_kernel(float *out, const float *x, const void *w,
			       enum mlens_dtype dt, int dim, float eps)
{
	__shared__ double sh[32];
	const float *xi = x + (size_t)blockIdx.x * dim;
	float *oi = out + (size_t)blockIdx.x * dim;
	double ss = 0.0;
	for (int j = threadIdx.x; j < dim; j += blockDim.x)
		ss += (double)xi[j] * xi[j];
	ss = block_sum(ss, sh);
	/* the CPU takes the root in double too */
	float r = (float)(1.0 / sqrt(ss / dim + (double)eps));
	for (int j = threadIdx.x; j < dim; j += blockDim.x)
		oi[j] = __fmul_rn(__fmul_rn(xi[j], r), load_elem(w, dt, (size_t)j));
}

int mlens_cuda_rmsnorm(struct mlens_cuda_ctx *c, float *out, const float *x, const void *w,
		       enum mlens_dtype dt, int n, int dim, float eps)
{
	if (n < 0 || dim <= 0)
		return -EINVAL;
	if (!n)
		return 0;
	rmsnorm_kernel<<<n, MLENS_CUDA_THREADS, 0, c->stream>>>(out, x, w, dt, dim, eps);
	CUDA_LAUNCHED();
	return 0;
}

/* ==== LayerNorm (no bias) ==== */

__global__ void layernorm_kernel(float *out, const float *x, const void *w,
				 enum mlens_dtype dt, int dim, float eps)
{
	__shared__ double sh[32];
	const float *xi = x + (size_t)blockIdx.x * dim;
	float *oi = out + (size_t)blockIdx.x * dim;
	double s = 0.0, ss = 0.0;
	for (int j = threadIdx.x; j < dim; j += blockDim.x)
		s += xi[j];
	s = block_sum(s, sh);
	float mean = (float)(s / dim);
	/* two passes over the row, in double, as the CPU */
	for (int j = threadIdx.x; j < dim; j += blockDim.x)
		ss += ((double)xi[j] - mean) * ((double)xi[j] - mean);
	ss = block_sum(ss, sh);
	float r = (float)(1.0 / sqrt(ss / dim + (double)eps));
	for (int j = threadIdx.x; j < dim; j += blockDim.x)
		oi[j] = __fmul_rn(__fmul_rn(__fsub_rn(xi[j], mean), r), load_elem(w, dt, (size_t)j));
}

int mlens_cuda_layernorm(struct mlens_cuda_ctx *c, float *out, const float *x, const void *w,
			 enum mlens_dtype dt, int n, int dim, float eps)
{
	if (n < 0 || dim <= 0)
		return -EINVAL;
	if (!n)
		return 0;
	layernorm_kernel<<<n, MLENS_CUDA_THREADS, 0, c->stream>>>(out, x, w, dt, dim, eps);
	CUDA_LAUNCHED();
	return 0;
}

/* ==== RoPE ==== */

__global__ void rope_kernel(float *x, const int32_t *pos, const float *inv, int n_heads,
			    int head_dim)
{
	int half = head_dim / 2, i = blockIdx.x;
	float p = (float)pos[i];
	for (int t = threadIdx.x; t < n_heads * half; t += blockDim.x) {
		int h = t / half, j = t % half;
		float ang = __fmul_rn(p, inv[j]);
		float cs = cosf(ang), sn = sinf(ang);
		float *xh = x + ((size_t)i * n_heads + h) * head_dim;
		float a = xh[j], b = xh[j + half];
		xh[j] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
		xh[j + half] = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
	}
}

int mlens_cuda_rope(struct mlens_cuda_ctx *c, float *x, const int32_t *pos, int n,
		    int n_heads, int head_dim, float theta)
{
	int half = head_dim / 2;
	size_t o_inv = mlens_cuda_align((size_t)n * 4);
	char *h, *d;
	int rc;

	if (n < 0 || n_heads <= 0 || head_dim <= 0 || head_dim % 2 ||
	    half > (int)(sizeof(c->rope_inv) / sizeof(c->rope_inv[0])))
		return -EINVAL;
	if (!n)
		return 0;
	/* inverse frequencies on the host with the CPU's powf, so the angles
	 * match the reference bit for bit */
	if (c->rope_theta != theta || c->rope_hd != head_dim) {
		for (int j = 0; j < half; j++)
			c->rope_inv[j] = 1.0f / powf(theta, (float)(2 * j) / (float)head_dim);
		c->rope_theta = theta;
		c->rope_hd = head_dim;
	}
	if ((rc = mlens_cuda_stage_begin(c, o_inv + (size_t)half * 4, &h, &d)))
		return rc;
	memcpy(h, pos, (size_t)n * 4);
	memcpy(h + o_inv, c->rope_inv, (size_t)half * 4);
	if ((rc = mlens_cuda_stage_commit(c, o_inv + (size_t)half * 4)))
		return rc;
	rope_kernel<<<n, MLENS_CUDA_THREADS, 0, c->stream>>>(x, (const int32_t *)d,
							      (const float *)(d + o_inv), n_heads,
							      head_dim);
	CUDA_LAUNCHED();
	return 0;
}

/* ==== router ==== */

/* One thread per token: n_experts is small (8 for Mixtral, <= 256). */
__global__ void router_kernel(int32_t *ids, float *weights, const float *logits, int n,
			      int n_experts, int k, bool renorm)
{
	float p[256];
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= n)
		return;
	const float *l = logits + (size_t)i * n_experts;
	float mx = l[0], sum = 0.0f, ksum = 0.0f;
	for (int e = 1; e < n_experts; e++)
		mx = l[e] > mx ? l[e] : mx;
	for (int e = 0; e < n_experts; e++) {
		p[e] = expf(l[e] - mx);
		sum += p[e];
	}
	for (int e = 0; e < n_experts; e++)
		p[e] /= sum;
	for (int s = 0; s < k; s++) {
		int best = -1;
		for (int e = 0; e < n_experts; e++)
			if (p[e] >= 0.0f && (best < 0 || p[e] > p[best]))
				best = e;
		ids[(size_t)i * k + s] = best;
		weights[(size_t)i * k + s] = p[best];
		ksum += p[best];
		p[best] = -1.0f;	/* taken */
	}
	for (int s = 0; s < k && renorm; s++)
		weights[(size_t)i * k + s] /= ksum;
}

int mlens_cuda_router(struct mlens_cuda_ctx *c, int32_t *ids, float *weights,
		      const float *logits, int n, int n_experts, int k, bool renorm)
{
	if (n_experts > 256 || n_experts <= 0 || k > n_experts || k <= 0 || n < 0)
		return -EINVAL;
	if (!n)
		return 0;
	router_kernel<<<(n + 127) / 128, 128, 0, c->stream>>>(ids, weights, logits, n,
								n_experts, k, renorm);
	CUDA_LAUNCHED();
	return 0;
}

__global__ void route_one_kernel(int32_t *ids, float *weights, const float *logits, int n)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= n)
		return;
	ids[i] = 0;
	/* as the CPU: 1 / (1 + e^-x), IEEE division */
	weights[i] = logits ? __fdiv_rn(1.0f, 1.0f + expf(-logits[i])) : 1.0f;
}

int mlens_cuda_route_one(struct mlens_cuda_ctx *c, int32_t *ids, float *weights,
			 const float *logits, int n)
{
	if (n < 0)
		return -EINVAL;
	if (!n)
		return 0;
	route_one_kernel<<<(n + 127) / 128, 128, 0, c->stream>>>(ids, weights, logits, n);
	CUDA_LAUNCHED();
	return 0;
}

/* ==== projection biases, clip ==== */

__global__ void bias_add_kernel(float *x, const void *b, enum mlens_dtype dt, int dim, size_t total)
{
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	if (i < total)
		x[i] = __fadd_rn(x[i], load_elem(b, dt, i % (size_t)dim));
}

int mlens_cuda_bias_add(struct mlens_cuda_ctx *c, float *x, const void *b, enum mlens_dtype dt,
			int n, int dim)
{
	size_t total = (size_t)n * (size_t)dim;
	if (n < 0 || dim <= 0)
		return -EINVAL;
	if (!total)
		return 0;
	bias_add_kernel<<<(unsigned)((total + 255) / 256), 256, 0, c->stream>>>(x, b, dt, dim, total);
	CUDA_LAUNCHED();
	return 0;
}

__global__ void clamp_kernel(float *x, size_t n, float limit)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		x[i] = x[i] < -limit ? -limit : x[i] > limit ? limit : x[i];	/* NaN stays */
}

int mlens_cuda_clamp(struct mlens_cuda_ctx *c, float *x, size_t count, float limit)
{
	size_t blocks = (count + MLENS_CUDA_THREADS - 1) / MLENS_CUDA_THREADS;
	if (!(limit >= 0))
		return -EINVAL;
	if (!count)
		return 0;
	clamp_kernel<<<blocks < 65535 ? (unsigned)blocks : 65535u, MLENS_CUDA_THREADS, 0,
		       c->stream>>>(x, count, limit);
	CUDA_LAUNCHED();
	return 0;
}

/* ==== conversion, SiLU-mul ==== */

/* The source row of output row r: gather[r] / gather_div (the MoE's
 * routed rows, k a token), or r itself without a gather. */
__device__ __forceinline__ size_t source_row(const int32_t *gather, int gather_div, size_t r)
{
	return gather ? (size_t)(gather[r] / gather_div) : r;
}

__global__ void convert_rows_kernel(void *dst, enum mlens_dtype dt, const float *src,
				    const int32_t *gather, int gather_div, int cols)
{
	size_t r = blockIdx.x;
	size_t sr = source_row(gather, gather_div, r);
	const float *s = src + sr * cols;
	for (int j = threadIdx.x; j < cols; j += blockDim.x)
		store_elem(dst, dt, r * cols + j, s[j]);
}

/* The same for 16-bit dst T and cols a multiple of 4: four values a
 * thread (one 16-byte load, one 8-byte store), rounded as store_elem does. */
template <typename T>
__global__ void convert_rows4_kernel(uint2 *dst, const float4 *src, const int32_t *gather,
				     int gather_div, int cols4)
{
	size_t r = blockIdx.x;
	size_t sr = source_row(gather, gather_div, r);
	const float4 *s = src + sr * cols4;
	for (int j = threadIdx.x; j < cols4; j += blockDim.x) {
		float4 v = s[j];
		uint2 o;
		T *oa = (T *)&o;
		oa[0] = from_float<T>(v.x);
		oa[1] = from_float<T>(v.y);
		oa[2] = from_float<T>(v.z);
		oa[3] = from_float<T>(v.w);
		dst[r * cols4 + j] = o;
	}
}

int mlens_cuda_convert_rows(struct mlens_cuda_ctx *c, void *dst, enum mlens_dtype dt,
			    const float *src, const int32_t *gather, int gather_div,
			    int rows, int cols)
{
	if (rows <= 0 || cols <= 0)
		return rows < 0 || cols < 0 ? -EINVAL : 0;
	if (dt != MLENS_DTYPE_F32 && !(cols & 3) && !((uintptr_t)src & 15) && !((uintptr_t)dst & 7)) {
		if (dt == MLENS_DTYPE_BF16)
			convert_rows4_kernel<__nv_bfloat16><<<rows, MLENS_CUDA_THREADS, 0, c->stream>>>(
				(uint2 *)dst, (const float4 *)src, gather, gather_div, cols / 4);
		else
			convert_rows4_kernel<__half><<<rows, MLENS_CUDA_THREADS, 0, c->stream>>>(
				(uint2 *)dst, (const float4 *)src, gather, gather_div, cols / 4);
	} else {
		convert_rows_kernel<<<rows, MLENS_CUDA_THREADS, 0, c->stream>>>(dst, dt, src, gather,
										 gather_div, cols);
	}
	CUDA_LAUNCHED();
	return 0;
}

/* One block a row: each element's e4m3 value (exact in fp16) times its
 * scale. */
__global__ void dequant_fp8_kernel(void *dst, enum mlens_dtype dt, const uint8_t *q,
				   const float *scales, struct mlens_wscale k, int cols)
{
	size_t r = blockIdx.x;
	int nbc = k.kind == MLENS_WSCALE_BLOCK ? (cols + k.block_cols - 1) / k.block_cols : 1;
	for (int j = threadIdx.x; j < cols; j += blockDim.x) {
		__half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q[r * cols + j], __NV_E4M3);
		float s = k.kind == MLENS_WSCALE_TENSOR ? scales[0] :
			  k.kind == MLENS_WSCALE_CHANNEL ? scales[r] :
			  scales[(r / k.block_rows) * nbc + j / k.block_cols];
		store_elem(dst, dt, r * cols + j, __half2float(__half(h)) * s);
	}
}

int mlens_cuda_dequant_fp8(struct mlens_cuda_ctx *c, void *dst, enum mlens_dtype dt,
			   const uint8_t *q, const float *scales, const struct mlens_wscale *k,
			   int rows, int cols)
{
	if (rows < 0 || cols < 0 || (dt != MLENS_DTYPE_BF16 && dt != MLENS_DTYPE_F32) ||
	    k->kind == MLENS_WSCALE_NONE || (k->kind == MLENS_WSCALE_BLOCK &&
					     (k->block_rows <= 0 || k->block_cols <= 0)))
		return -EINVAL;
	if (!rows || !cols)
		return 0;
	dequant_fp8_kernel<<<rows, MLENS_CUDA_THREADS, 0, c->stream>>>(dst, dt, q, scales, *k, cols);
	CUDA_LAUNCHED();
	return 0;
}

/* One block a row: the row's amax (a block reduction), then every value
 * over its scale rounded to e4m3 (saturating, nearest even); v(j) is the
 * row's value j (computed twice rather than held: a row may be wide). */
template <typename V>
__device__ __forceinline__ void quant_row_fp8(uint8_t *q, float *scale, V v, int cols)
{
	__shared__ float red[MLENS_CUDA_THREADS];
	float m = 0.0f, s;

	for (int j = threadIdx.x; j < cols; j += blockDim.x)
		m = fmaxf(m, fabsf(v(j)));
	red[threadIdx.x] = m;
	__syncthreads();
	for (int h = blockDim.x / 2; h > 0; h /= 2) {
		if ((int)threadIdx.x < h)
			red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + h]);
		__syncthreads();
	}
	s = red[0] / 448.0f;
	if (threadIdx.x == 0)
		*scale = s;
	s = s > 0.0f ? s : 1.0f;
	for (int j = threadIdx.x; j < cols; j += blockDim.x)
		q[j] = __nv_cvt_float_to_fp8(v(j) / s, __NV_SATFINITE, __NV_E4M3);
}

__global__ void quant_rows_fp8_kernel(uint8_t *q, float *scales, const void *x,
				      enum mlens_dtype dt, int cols)
{
	size_t r = blockIdx.x;
	quant_row_fp8(q + r * cols, scales + r,
		      [=](int j) { return load_elem(x, dt, r * cols + j); }, cols);
}

int mlens_cuda_quant_rows_fp8(struct mlens_cuda_ctx *c, uint8_t *q, float *scales, const void *x,
			      enum mlens_dtype dt, int rows, int cols)
{
	if (rows < 0 || cols < 0)
		return -EINVAL;
	if (!rows || !cols)
		return 0;
	quant_rows_fp8_kernel<<<rows, MLENS_CUDA_THREADS, 0, c->stream>>>(q, scales, x, dt, cols);
	CUDA_LAUNCHED();
	return 0;
}

__global__ void quant_gather_fp8_kernel(uint8_t *q, float *scales, const float *src,
					const int32_t *gather, int gather_div, int cols)
{
	size_t r = blockIdx.x;
	const float *x = src + source_row(gather, gather_div, r) * cols;
	quant_row_fp8(q + r * cols, scales + r, [=](int j) { return x[j]; }, cols);
}

int mlens_cuda_quant_gather_fp8(struct mlens_cuda_ctx *c, uint8_t *q, float *scales,
				const float *src, const int32_t *gather, int gather_div, int rows,
				int cols)
{
	if (rows < 0 || cols < 0 || (gather && gather_div <= 0))
		return -EINVAL;
	if (!rows || !cols)
		return 0;
	quant_gather_fp8_kernel<<<rows, MLENS_CUDA_THREADS, 0, c->stream>>>(q, scales, src, gather,
									  gather_div, cols);
	CUDA_LAUNCHED();
	return 0;
}

/* silu(g) * u as silu_mul_kernel computes it, a row a block, quantized. */
__global__ void silu_mul_quant_fp8_kernel(uint8_t *q, float *scales, const void *g,
					  const void *u, enum mlens_dtype gdt, int cols)
{
	size_t r = blockIdx.x, o = r * cols;
	quant_row_fp8(q + o, scales + r,
		      [=](int j) {
			      float gv = load_elem(g, gdt, o + j);
			      return gv / (1.0f + expf(-gv)) * load_elem(u, gdt, o + j);
		      },
		      cols);
}

int mlens_cuda_silu_mul_quant_fp8(struct mlens_cuda_ctx *c, uint8_t *q, float *scales,
				  const void *g, const void *u, enum mlens_dtype gdt, int rows,
				  int cols)
{
	if (rows < 0 || cols < 0)
		return -EINVAL;
	if (!rows || !cols)
		return 0;
	silu_mul_quant_fp8_kernel<<<rows, MLENS_CUDA_THREADS, 0, c->stream>>>(q, scales, g, u, gdt,
									    cols);
	CUDA_LAUNCHED();
	return 0;
}

__global__ void scale_outer_kernel(void *dst, enum mlens_dtype dt, const void *src,
				   const float *rs, const float *cs, int cols)
{
	size_t r = blockIdx.x;
	float a = rs[r];
	for (int j = threadIdx.x; j < cols; j += blockDim.x)
		store_elem(dst, dt, r * cols + j, load_elem(src, dt, r * cols + j) * a * cs[j]);
}

int mlens_cuda_scale_outer(struct mlens_cuda_ctx *c, void *dst, enum mlens_dtype dt,
			   const void *src, const float *rs, const float *cs, int rows, int cols)
{
	if (rows < 0 || cols < 0)
		return -EINVAL;
	if (!rows || !cols)
		return 0;
	scale_outer_kernel<<<rows, MLENS_CUDA_THREADS, 0, c->stream>>>(dst, dt, src, rs, cs, cols);
	CUDA_LAUNCHED();
	return 0;
}

__global__ void split_rows_kernel(void *dst, enum mlens_dtype dt, const float *src,
				  const int32_t *gather, int gather_div, int cols,
				  size_t part_stride, float scale)
{
	size_t r = blockIdx.x;
	size_t sr = source_row(gather, gather_div, r);
	const float *s = src + sr * cols;
	for (int j = threadIdx.x; j < cols; j += blockDim.x) {
		/* each difference is exact in fp32 (the part is x rounded to
		 * fewer bits) and so is each power-of-two scaling */
		float v = s[j];
		size_t at = r * cols + j;
		for (int part = 0; part < MLENS_CUDA_SPLIT_PARTS; part++) {
			float p = load_rounded(dt, v);
			store_elem(dst, dt, at + part * part_stride, p);
			v = (v - p) * scale;
		}
	}
}

int mlens_cuda_split_rows(struct mlens_cuda_ctx *c, void *dst, enum mlens_dtype dt,
			  const float *src, const int32_t *gather, int gather_div,
			  int rows, int cols, size_t part_stride)
{
	if (dt != MLENS_DTYPE_F16 && dt != MLENS_DTYPE_BF16)
		return -EINVAL;
	if (rows <= 0 || cols <= 0)
		return rows < 0 || cols < 0 ? -EINVAL : 0;
	split_rows_kernel<<<rows, MLENS_CUDA_THREADS, 0, c->stream>>>(
		dst, dt, src, gather, gather_div, cols, part_stride, mlens_cuda_split_scale(dt));
	CUDA_LAUNCHED();
	return 0;
}

__global__ void silu_mul_kernel(void *h, enum mlens_dtype dt, const void *g, const void *u,
				enum mlens_dtype gdt, size_t count)
{
	for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < count;
	     t += (size_t)gridDim.x * blockDim.x) {
		float gv = load_elem(g, gdt, t);
		store_elem(h, dt, t, gv / (1.0f + expf(-gv)) * load_elem(u, gdt, t));
	}
}

/* The same with g, u and h all of 16-bit T: eight values a thread (16-byte
 * loads and store), the same arithmetic and rounding. */
template <typename T>
__global__ void silu_mul8_kernel(uint4 *h, const uint4 *g, const uint4 *u, size_t count8)
{
	for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < count8;
	     t += (size_t)gridDim.x * blockDim.x) {
		uint4 gv = g[t], uv = u[t], hv;
		const T *ga = (const T *)&gv, *ua = (const T *)&uv;
		T *ha = (T *)&hv;
#pragma unroll
		for (int j = 0; j < 8; j++) {
			float a = to_float(ga[j]);
			ha[j] = from_float<T>(a / (1.0f + expf(-a)) * to_float(ua[j]));
		}
		h[t] = hv;
	}
}

int mlens_cuda_silu_mul(struct mlens_cuda_ctx *c, void *h, enum mlens_dtype dt,
			const void *g, const void *u, enum mlens_dtype gdt, size_t count)
{
	if (!count)
		return 0;
	if (dt == gdt && dt != MLENS_DTYPE_F32 && !(count & 7) &&
	    !(((uintptr_t)h | (uintptr_t)g | (uintptr_t)u) & 15)) {
		size_t n8 = count / 8;
		if (dt == MLENS_DTYPE_BF16)
			silu_mul8_kernel<__nv_bfloat16><<<blocks_for(n8, MLENS_CUDA_THREADS),
							  MLENS_CUDA_THREADS, 0, c->stream>>>(
				(uint4 *)h, (const uint4 *)g, (const uint4 *)u, n8);
		else
			silu_mul8_kernel<__half><<<blocks_for(n8, MLENS_CUDA_THREADS), MLENS_CUDA_THREADS,
						   0, c->stream>>>((uint4 *)h, (const uint4 *)g,
								   (const uint4 *)u, n8);
		CUDA_LAUNCHED();
		return 0;
	}
	silu_mul_kernel<<<blocks_for(count, MLENS_CUDA_THREADS), MLENS_CUDA_THREADS, 0,
			  c->stream>>>(h, dt, g, u, gdt, count);
	CUDA_LAUNCHED();
	return 0;
}

/* dst[i] = src[i] widened to fp32 (exact for F16 and BF16). */
__global__ void widen_kernel(float *dst, const void *src, enum mlens_dtype dt, size_t count)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count;
	     i += (size_t)gridDim.x * blockDim.x)
		dst[i] = load_elem(src, dt, i);
}

int mlens_cuda_widen(struct mlens_cuda_ctx *c, float *dst, const void *src, enum mlens_dtype dt,
		     size_t count)
{
	if (!count)
		return 0;
	widen_kernel<<<blocks_for(count, MLENS_CUDA_THREADS), MLENS_CUDA_THREADS, 0, c->stream>>>(
		dst, src, dt, count);
	CUDA_LAUNCHED();
	return 0;
}

/* ==== MoE permutation and combine ==== */

#define ROUTE_THREADS 1024

/* Block e counts the routed rows that name expert e. */
__global__ void moe_count_kernel(int32_t *counts, const int32_t *ids, int rows)
{
	__shared__ int sh[32];
	int e = blockIdx.x, cnt = 0;
	for (int a = threadIdx.x; a < rows; a += blockDim.x)
		cnt += ids[a] == e;
	cnt = block_sum(cnt, sh);
	if (!threadIdx.x)
		counts[e] = cnt;
}

/* Block e lists its rows in order of a = i*k+s (a stable compaction by
 * ballot and prefix), after the rows of experts below e. */
__global__ void moe_perm_kernel(int32_t *perm, int32_t *inv, const int32_t *counts,
				const int32_t *ids, int rows)
{
	__shared__ int warp_cnt[32];
	__shared__ int base_sh;
	int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	int nw = blockDim.x >> 5;

	if (!threadIdx.x) {
		int b = 0;
		for (int x = 0; x < e; x++)
			b += counts[x];
		base_sh = b;
	}
	__syncthreads();
	int base = base_sh;
	for (int a0 = 0; a0 < rows; a0 += blockDim.x) {
		int a = a0 + threadIdx.x;
		bool hit = a < rows && ids[a] == e;
		unsigned m = __ballot_sync(0xffffffffu, hit);
		if (!lane)
			warp_cnt[warp] = __popc(m);
		__syncthreads();
		int off = base, total = 0;
		for (int w = 0; w < nw; w++) {
			if (w < warp)
				off += warp_cnt[w];
			total += warp_cnt[w];
		}
		if (hit) {
			int r = off + __popc(m & ((1u << lane) - 1));
			perm[r] = a;
			inv[a] = r;
		}
		base += total;
		__syncthreads();	/* warp_cnt is rewritten next round */
	}
}

int mlens_cuda_moe_route(struct mlens_cuda_ctx *c, int32_t *counts, int32_t *perm,
			 int32_t *inv, const int32_t *ids, int n, int k, int n_experts)
{
	int rows = n * k;
	moe_count_kernel<<<n_experts, ROUTE_THREADS, 0, c->stream>>>(counts, ids, rows);
	CUDA_LAUNCHED();
	moe_perm_kernel<<<n_experts, ROUTE_THREADS, 0, c->stream>>>(perm, inv, counts, ids, rows);
	CUDA_LAUNCHED();
	return 0;
}

#define MOE_MAX_K 32

/* Token i adds its experts' rows in ascending expert id, each multiplied
 * and added with single roundings, as the CPU does. */
__global__ void moe_combine_kernel(float *out, const float *y, const int32_t *ids,
				   const float *weights, const int32_t *inv, int k, int hidden, bool vec)
{
	__shared__ int order[MOE_MAX_K];
	size_t i = blockIdx.x;
	const int32_t *id = ids + i * k;
	if (!threadIdx.x) {
		for (int s = 0; s < k; s++)
			order[s] = s;
		for (int s = 1; s < k; s++)	/* insertion sort, stable */
			for (int t = s; t > 0 && id[order[t - 1]] > id[order[t]]; t--) {
				int x = order[t];
				order[t] = order[t - 1];
				order[t - 1] = x;
			}
	}
	__syncthreads();
	if (vec) {
		/* four columns a thread (16-byte accesses), the same order of sums */
		float4 *o4 = (float4 *)(out + i * hidden);
		for (int j = threadIdx.x; j < hidden / 4; j += blockDim.x) {
			float4 acc = o4[j];
			for (int s = 0; s < k; s++) {
				size_t a = i * k + order[s];
				float w = weights[a];
				float4 yv = ((const float4 *)(y + (size_t)inv[a] * hidden))[j];
				acc.x = __fadd_rn(acc.x, __fmul_rn(w, yv.x));
				acc.y = __fadd_rn(acc.y, __fmul_rn(w, yv.y));
				acc.z = __fadd_rn(acc.z, __fmul_rn(w, yv.z));
				acc.w = __fadd_rn(acc.w, __fmul_rn(w, yv.w));
			}
			o4[j] = acc;
		}
		return;
	}
	for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
		float acc = out[i * hidden + j];
		for (int s = 0; s < k; s++) {
			size_t a = i * k + order[s];
			acc = __fadd_rn(acc, __fmul_rn(weights[a], y[(size_t)inv[a] * hidden + j]));
		}
		out[i * hidden + j] = acc;
	}
}

int mlens_cuda_moe_combine(struct mlens_cuda_ctx *c, float *out, const float *y,
			   const int32_t *ids, const float *weights, const int32_t *inv,
			   int n, int k, int hidden)
{
	if (k > MOE_MAX_K)
		return -EINVAL;
	bool vec = !(hidden & 3) && !(((uintptr_t)out | (uintptr_t)y) & 15);
	moe_combine_kernel<<<n, MLENS_CUDA_THREADS, 0, c->stream>>>(out, y, ids, weights, inv,
								     k, hidden, vec);
	CUDA_LAUNCHED();
	return 0;
}

/* ==== greedy sampling ==== */

__global__ void argmax_kernel(int32_t *tokens, float *logprobs, const float *logits, int vocab)
{
	__shared__ float sv[MLENS_CUDA_THREADS];
	__shared__ int si[MLENS_CUDA_THREADS];
	__shared__ double sh[32];
	const float *l = logits + (size_t)blockIdx.x * vocab;
	float bv = l[0];
	int bi = 0;
	for (int v = threadIdx.x; v < vocab; v += blockDim.x)
		if (l[v] > bv || (l[v] == bv && v < bi)) {
			bv = l[v];
			bi = v;
		}
	sv[threadIdx.x] = bv;
	si[threadIdx.x] = bi;
	__syncthreads();
	for (int o = blockDim.x / 2; o > 0; o >>= 1) {
		if (threadIdx.x < o) {
			float ov = sv[threadIdx.x + o];
			int oi = si[threadIdx.x + o];
			if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
				sv[threadIdx.x] = ov;
				si[threadIdx.x] = oi;
			}
		}
		__syncthreads();
	}
	double mx = sv[0], lse = 0.0;
	for (int v = threadIdx.x; v < vocab; v += blockDim.x)
		lse += exp((double)l[v] - mx);
	lse = block_sum(lse, sh);
	if (!threadIdx.x) {
		tokens[blockIdx.x] = si[0];
		logprobs[blockIdx.x] = (float)((double)l[si[0]] - mx - log(lse));
	}
}

int mlens_cuda_argmax(struct mlens_cuda_ctx *c, int32_t *tokens, float *logprobs,
		      const float *logits, int n, int vocab)
{
	argmax_kernel<<<n, MLENS_CUDA_THREADS, 0, c->stream>>>(tokens, logprobs, logits, vocab);
	CUDA_LAUNCHED();
	return 0;
}

/* ==== copies by the SMs ==== */

/* 16-byte words when both ends are 16-aligned, else bytes; a grid of up
 * to 1056 blocks, so that enough loads are in flight at once to cover the
 * ~1 us a read of host memory takes. */
__global__ void sm_copy_kernel(char *dst, const char *src, size_t bytes, bool wide)
{
	size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t stride = (size_t)gridDim.x * blockDim.x;
	size_t done = 0;

	if (wide) {
		const uint4 *s = (const uint4 *)src;
		uint4 *d = (uint4 *)dst;
		size_t words = bytes / 16;
		for (size_t i = t; i < words; i += stride)
			d[i] = s[i];
		done = words * 16;
	}
	for (size_t i = done + t; i < bytes; i += stride)
		dst[i] = src[i];
}

int mlens_cuda_sm_copy_on(struct mlens_cuda_ctx *c, cudaStream_t st, void *dst, const void *src,
			  size_t bytes, unsigned max_blocks)
{
	bool wide = !(((uintptr_t)dst | (uintptr_t)src) & 15);
	size_t units = wide ? (bytes + 15) / 16 : bytes;
	/* up to 8 blocks an SM of an H200 (132 SMs), enough to keep PCIe busy */
	unsigned blocks = blocks_for(units, MLENS_CUDA_THREADS);
	if (!max_blocks || max_blocks > 1056)
		max_blocks = 1056;
	if (blocks > max_blocks)
		blocks = max_blocks;
	if (!bytes)
		return 0;
	(void)c;
	sm_copy_kernel<<<blocks, MLENS_CUDA_THREADS, 0, st>>>((char *)dst, (const char *)src, bytes,
							       wide);
	CUDA_LAUNCHED();
	return 0;
}
