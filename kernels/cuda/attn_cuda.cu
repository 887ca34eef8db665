/* CUDA attention: causal GQA flash attention for prefill (tiled, online
 * softmax, never the n x n matrix), KV append into the paged cache in GPU
 * memory, and split-context decode attention over that cache with a
 * combine pass. fp32 math throughout, except prefill on tensor cores
 * (opts prefill_bf16: bf16 products, fp32 softmax and sums); KV stored f32
 * or bf16, or fp8 e4m3 with a scale per row (kernels/kv.h layout). Head dims 64 and
 * 128 take tuned kernels; any other up to 256, and
 * GQA groups above 8, a generic one (small test models). */
#include "kernels/cuda/cuda_int.h"

#include <math.h>
#include <type_traits>
#include <cuda_bf16.h>

#define ATTN_WARPS 4
#define ATTN_THREADS (ATTN_WARPS * 32)

__device__ __forceinline__ float warp_max(float v)
{
	for (int o = 16; o > 0; o >>= 1)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	return v;
}

__device__ __forceinline__ float warp_sum(float v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

/* ==== prefill ==== */

/* 8 rows a warp: each K value read from shared memory feeds 8 FMAs, which
 * keeps the kernel FMA-bound rather than shared-memory-bound */
#define PF_ROWS_PER_WARP 8
#define PF_BR (ATTN_WARPS * PF_ROWS_PER_WARP)	/* query rows per block */
#define PF_BC 32				/* keys per tile: one per lane */

/* One block: PF_BR consecutive query tokens of one sequence, one query
 * head. Keys stream through shared memory 32 at a time; each warp keeps a
 * running max, sum and output for its rows (lane owns dims lane + 32*j). */
template <int HD>
__global__ void __launch_bounds__(ATTN_THREADS)
prefill_kernel(float *out, const float *q, const float *k, const float *v, const int4 *tiles,
	       int n_heads, int n_kv, float scale)
{
	constexpr int DPL = HD / 32;
	/* Qs[PF_BR][HD], Ks[PF_BC][HD + 4], Vs[PF_BC][HD] (prefill_smem bytes).
	 * Ks +4: lanes read their own rows 16 bytes at a time; a 132-word
	 * stride spreads each 8-lane phase over all 32 banks. */
	extern __shared__ __align__(16) float pf_smem[];
	float (*Qs)[HD] = (float (*)[HD])pf_smem;
	float (*Ks)[HD + 4] = (float (*)[HD + 4])(pf_smem + PF_BR * HD);
	float (*Vs)[HD] = (float (*)[HD])(pf_smem + PF_BR * HD + PF_BC * (HD + 4));
	const int4 tile = tiles[blockIdx.x];
	const int t0 = tile.x, q0 = tile.y, len = tile.z;
	const int h = blockIdx.y, g = h / (n_heads / n_kv);
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const size_t qs = (size_t)n_heads * HD, ks = (size_t)n_kv * HD;

	for (int idx = threadIdx.x; idx < PF_BR * HD; idx += ATTN_THREADS) {
		int r = idx / HD, d = idx % HD;
		Qs[r][d] = q0 + r < len ? q[(size_t)(t0 + q0 + r) * qs + (size_t)h * HD + d] : 0.0f;
	}

	float m[PF_ROWS_PER_WARP], l[PF_ROWS_PER_WARP], o[PF_ROWS_PER_WARP][DPL];
	int qpos[PF_ROWS_PER_WARP];
#pragma unroll
	for (int r = 0; r < PF_ROWS_PER_WARP; r++) {
		m[r] = -INFINITY;
		l[r] = 0.0f;
		qpos[r] = q0 + warp * PF_ROWS_PER_WARP + r;
#pragma unroll
		for (int j = 0; j < DPL; j++)
			o[r][j] = 0.0f;
	}

	const int kend = min(len, q0 + PF_BR);	/* causal: no key after the last row */
	for (int kb = 0; kb < kend; kb += PF_BC) {
		__syncthreads();	/* the previous tile is consumed (and Qs written) */
		for (int idx = threadIdx.x; idx < PF_BC * HD; idx += ATTN_THREADS) {
			int j = idx / HD, d = idx % HD;
			bool in = kb + j < len;
			size_t a = (size_t)(t0 + kb + j) * ks + (size_t)g * HD + d;
			Ks[j][d] = in ? k[a] : 0.0f;
			Vs[j][d] = in ? v[a] : 0.0f;
		}
		__syncthreads();

		float s[PF_ROWS_PER_WARP];
#pragma unroll
		for (int r = 0; r < PF_ROWS_PER_WARP; r++)
			s[r] = 0.0f;
#pragma unroll 4
		for (int d = 0; d < HD; d += 4) {
			float4 kd = *(const float4 *)&Ks[lane][d];
#pragma unroll
			for (int r = 0; r < PF_ROWS_PER_WARP; r++) {
				float4 qd = *(const float4 *)&Qs[warp * PF_ROWS_PER_WARP + r][d];
				s[r] += qd.x * kd.x;
				s[r] += qd.y * kd.y;
				s[r] += qd.z * kd.z;
				s[r] += qd.w * kd.w;
			}
		}
		const int key = kb + lane;
		float p[PF_ROWS_PER_WARP];
#pragma unroll
		for (int r = 0; r < PF_ROWS_PER_WARP; r++) {
			bool valid = key <= qpos[r] && key < len;
			float sc = valid ? s[r] * scale : -INFINITY;
			float mnew = fmaxf(m[r], warp_max(sc));
			/* key 0 is valid for every row, so mnew is finite from the first tile */
			p[r] = valid ? expf(sc - mnew) : 0.0f;
			float corr = expf(m[r] - mnew);
			l[r] = l[r] * corr + warp_sum(p[r]);
			m[r] = mnew;
#pragma unroll
			for (int j = 0; j < DPL; j++)
				o[r][j] *= corr;
		}
		const int jmax = min(PF_BC, kend - kb);
		for (int j = 0; j < jmax; j++) {
#pragma unroll
			for (int r = 0; r < PF_ROWS_PER_WARP; r++) {
				float pj = __shfl_sync(0xffffffffu, p[r], j);
#pragma unroll
				for (int dd = 0; dd < DPL; dd++)
					o[r][dd] += pj * Vs[j][lane + 32 * dd];
			}
		}
	}
#pragma unroll
	for (int r = 0; r < PF_ROWS_PER_WARP; r++) {
		if (qpos[r] >= len)
			continue;
		float *orow = out + (size_t)(t0 + qpos[r]) * qs + (size_t)h * HD;
#pragma unroll
		for (int dd = 0; dd < DPL; dd++)
			orow[lane + 32 * dd] = o[r][dd] / l[r];
	}
}

template <int HD>
static size_t prefill_smem(void)
{
	return ((size_t)PF_BR * HD + (size_t)PF_BC * (HD + 4) + (size_t)PF_BC * HD) * sizeof(float);
}

template <int HD>
static int prefill_launch(struct mlens_cuda_ctx *c, dim3 grid, float *out, const float *q,
			  const float *k, const float *v, const int4 *tiles, int n_heads,
			  int n_kv, float scale)
{
	size_t smem = prefill_smem<HD>();
	/* over the 48 KB default for HD = 128: opt in (cheap, idempotent) */
	CUDA_RET(cudaFuncSetAttribute(prefill_kernel<HD>,
				      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
	prefill_kernel<HD><<<grid, ATTN_THREADS, smem, c->stream>>>(out, q, k, v, tiles, n_heads,
								     n_kv, scale);
	CUDA_LAUNCHED();
	return 0;
}


/* ==== prefill on tensor cores (opts prefill_bf16) ====
 * The same causal GQA flash attention with both products on tensor cores
 * (mma.sync m16n8k16, bf16 inputs, fp32 accumulation): Q, K, V and the
 * softmax weights P are rounded to bf16 (about 2^-9 relative each, as the
 * fast GEMMs round activations); scores, the running max and sums, and
 * the output stay fp32. A block is TC_BR query rows of one head, 16 a
 * warp; keys go through shared memory TC_BC at a time, converted to bf16
 * (K row-major, V transposed so that both B operands are 32-bit loads).
 * Fragment layouts are PTX's for m16n8k16: a thread (group g = lane / 4,
 * t = lane % 4) holds rows g and g + 8, columns 2t, 2t + 1 (+ 8). */
#define TC_WARPS 4
#define TC_THREADS (TC_WARPS * 32)
#define TC_BR (TC_WARPS * 16)	/* query rows a block */
#define TC_BC 64		/* keys a tile */
#define TC_PAD 8		/* bf16 of row padding: conflict-free fragment loads */

__device__ __forceinline__ uint32_t tc_pack(float lo, float hi)
{
	__nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);	/* .x, the lower half: lo */
	return *(const uint32_t *)&h;
}

/* d += a . b (16x16 by 16x8, bf16 in, fp32 accumulate) */
__device__ __forceinline__ void tc_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
				       uint32_t b1)
{
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
		     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
		     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int HD>
__global__ void __launch_bounds__(TC_THREADS)
prefill_tc_kernel(float *out, const float *q, const float *k, const float *v, const int4 *tiles,
		  int n_heads, int n_kv, float scale)
{
	constexpr int KSTEPS = HD / 16;		/* k-steps of Q K^T */
	constexpr int NB = HD / 8;		/* n-blocks of the output */
	constexpr int SB = TC_BC / 8;		/* n-blocks of the scores */
	constexpr int KLD = HD + TC_PAD;	/* Ks row (bf16) */
	constexpr int VLD = TC_BC + TC_PAD;	/* Vt row (bf16) */
	__shared__ __align__(16) __nv_bfloat16 Ks[TC_BC * KLD];
	__shared__ __align__(16) __nv_bfloat16 Vt[HD * VLD];
	const int4 tile = tiles[blockIdx.x];
	const int t0 = tile.x, q0 = tile.y, len = tile.z;
	const int h = blockIdx.y, kvh = h / (n_heads / n_kv);
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int gq = lane >> 2, tq = lane & 3;
	const size_t qs = (size_t)n_heads * HD, ks = (size_t)n_kv * HD;
	const int r0 = q0 + warp * 16 + gq, r1 = r0 + 8;	/* this thread's rows */
	/* scores in log2 units: exp2f of (s - max) is exp of the scaled score */
	const float sl2 = scale * 1.4426950408889634f;

	uint32_t qa[KSTEPS][4];
	{
		const float2 z = make_float2(0.0f, 0.0f);
		const float *p0 = q + (size_t)h * HD + (size_t)(t0 + r0) * qs;
		const float *p1 = q + (size_t)h * HD + (size_t)(t0 + r1) * qs;
#pragma unroll
		for (int kk = 0; kk < KSTEPS; kk++) {
			const int c = kk * 16 + 2 * tq;
			float2 a = r0 < len ? *(const float2 *)(p0 + c) : z;
			float2 b = r1 < len ? *(const float2 *)(p1 + c) : z;
			float2 e = r0 < len ? *(const float2 *)(p0 + c + 8) : z;
			float2 f = r1 < len ? *(const float2 *)(p1 + c + 8) : z;
			qa[kk][0] = tc_pack(a.x, a.y);
			qa[kk][1] = tc_pack(b.x, b.y);
			qa[kk][2] = tc_pack(e.x, e.y);
			qa[kk][3] = tc_pack(f.x, f.y);
		}
	}

	float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
	float o[NB][4];
#pragma unroll
	for (int nb = 0; nb < NB; nb++)
		o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.0f;

	const int kend = min(len, q0 + TC_BR);	/* causal: no key after the last row */
	for (int kb = 0; kb < kend; kb += TC_BC) {
		__syncthreads();	/* the previous tile is consumed */
		/* K: a row's 16-byte pieces on consecutive threads (coalesced) */
		for (int idx = threadIdx.x; idx < TC_BC * HD / 4; idx += TC_THREADS) {
			const int j = idx / (HD / 4), d = (idx % (HD / 4)) * 4;
			float4 f = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
			if (kb + j < len)
				f = *(const float4 *)(k + (size_t)(t0 + kb + j) * ks + (size_t)kvh * HD + d);
			*(uint2 *)&Ks[j * KLD + d] = make_uint2(tc_pack(f.x, f.y), tc_pack(f.z, f.w));
		}
		/* V transposed: keys on consecutive threads, so that the 2-byte
		 * stores of a warp fall in 16 consecutive words */
		for (int idx = threadIdx.x; idx < TC_BC * HD / 4; idx += TC_THREADS) {
			const int j = idx % TC_BC, d = (idx / TC_BC) * 4;
			float4 f = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
			if (kb + j < len)
				f = *(const float4 *)(v + (size_t)(t0 + kb + j) * ks + (size_t)kvh * HD + d);
			Vt[(d + 0) * VLD + j] = __float2bfloat16_rn(f.x);
			Vt[(d + 1) * VLD + j] = __float2bfloat16_rn(f.y);
			Vt[(d + 2) * VLD + j] = __float2bfloat16_rn(f.z);
			Vt[(d + 3) * VLD + j] = __float2bfloat16_rn(f.w);
		}
		__syncthreads();

		/* S = Q K^T for this warp's 16 rows and the tile's keys */
		float s[SB][4];
#pragma unroll
		for (int n = 0; n < SB; n++)
			s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
		for (int kk = 0; kk < KSTEPS; kk++)
#pragma unroll
			for (int n = 0; n < SB; n++) {
				const __nv_bfloat16 *kr = &Ks[(n * 8 + gq) * KLD + kk * 16 + 2 * tq];
				tc_mma(s[n], qa[kk], *(const uint32_t *)kr, *(const uint32_t *)(kr + 8));
			}

		/* mask (causal, and keys past the sequence), then the online
		 * softmax; a row's four threads share its max through shuffles.
		 * Key kb <= q0 <= the row, so every row has a valid key here and
		 * the max is finite (rows past len see keys < len: also finite). */
		float mx0 = m0, mx1 = m1;
#pragma unroll
		for (int n = 0; n < SB; n++)
#pragma unroll
			for (int e = 0; e < 2; e++) {
				const int key = kb + n * 8 + 2 * tq + e;
				const bool in = key < len;
				s[n][e] = in && key <= r0 ? s[n][e] * sl2 : -INFINITY;
				s[n][2 + e] = in && key <= r1 ? s[n][2 + e] * sl2 : -INFINITY;
				mx0 = fmaxf(mx0, s[n][e]);
				mx1 = fmaxf(mx1, s[n][2 + e]);
			}
		mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
		mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
		mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
		mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
		const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);	/* 0 on the first tile */
		m0 = mx0;
		m1 = mx1;

		/* P as the A operand of P V: score blocks 2j and 2j + 1 are the
		 * two column halves of k-step j */
		uint32_t pa[TC_BC / 16][4];
		float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
		for (int n = 0; n < SB; n++) {
			const float p0 = exp2f(s[n][0] - mx0), p1 = exp2f(s[n][1] - mx0);
			const float p2 = exp2f(s[n][2] - mx1), p3 = exp2f(s[n][3] - mx1);
			ls0 += p0 + p1;
			ls1 += p2 + p3;
			pa[n >> 1][(n & 1) * 2 + 0] = tc_pack(p0, p1);
			pa[n >> 1][(n & 1) * 2 + 1] = tc_pack(p2, p3);
		}
		/* per-thread partial sums: the factor is the same for the whole
		 * row, so the four parts are added once at the end */
		l0 = l0 * c0 + ls0;
		l1 = l1 * c1 + ls1;
#pragma unroll
		for (int nb = 0; nb < NB; nb++) {
			o[nb][0] *= c0;
			o[nb][1] *= c0;
			o[nb][2] *= c1;
			o[nb][3] *= c1;
		}
#pragma unroll
		for (int j = 0; j < TC_BC / 16; j++)
#pragma unroll
			for (int nb = 0; nb < NB; nb++) {
				const __nv_bfloat16 *vr = &Vt[(nb * 8 + gq) * VLD + j * 16 + 2 * tq];
				tc_mma(o[nb], pa[j], *(const uint32_t *)vr, *(const uint32_t *)(vr + 8));
			}
	}
	l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
	l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
	l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
	l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
	if (r0 < len) {
		float *orow = out + (size_t)(t0 + r0) * qs + (size_t)h * HD + 2 * tq;
#pragma unroll
		for (int nb = 0; nb < NB; nb++)
			*(float2 *)(orow + nb * 8) = make_float2(o[nb][0] / l0, o[nb][1] / l0);
	}
	if (r1 < len) {
		float *orow = out + (size_t)(t0 + r1) * qs + (size_t)h * HD + 2 * tq;
#pragma unroll
		for (int nb = 0; nb < NB; nb++)
			*(float2 *)(orow + nb * 8) = make_float2(o[nb][2] / l1, o[nb][3] / l1);
	}
}

/* ==== any head_dim and GQA group (the tuned kernels take 64 and 128) ====
 * Small models (tests, the tiny demo model) have head dims such as 16 or
 * 32. These kernels serve them: one block per (query row, head), threads
 * score one key each per chunk of GEN_THREADS keys, the block folds the
 * chunk into a running softmax, and thread d accumulates output dim d.
 * Plain fp32 arithmetic in the CPU's order per key; not tuned. */
#define GEN_THREADS 256
#define GEN_MAX_HD GEN_THREADS

template <typename T> __device__ __forceinline__ float gen_ld(const T *p);
template <> __device__ __forceinline__ float gen_ld<float>(const float *p) { return *p; }
template <> __device__ __forceinline__ float gen_ld<__nv_bfloat16>(const __nv_bfloat16 *p)
{
	return __bfloat162float(*p);
}
/* e4m3 codes; their row's scale comes from the rows' kscale / vscale */
template <> __device__ __forceinline__ float gen_ld<uint8_t>(const uint8_t *p)
{
	return mlens_e4m3_to_f32(*p);
}

/* Block-wide max or sum of v (every thread gets it); red holds 32 floats. */
__device__ __forceinline__ float gen_reduce(float v, float *red, bool is_max)
{
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	v = is_max ? warp_max(v) : warp_sum(v);
	if (!lane)
		red[warp] = v;
	__syncthreads();
	float r = is_max ? -INFINITY : 0.0f;
	for (int w = 0; w < GEN_THREADS / 32; w++)
		r = is_max ? fmaxf(r, red[w]) : r + red[w];
	__syncthreads();	/* red is reused by the next reduction */
	return r;
}

/* Rows of key j: contiguous prefill K/V ([T][n_kv*hd], fp32). */
struct gen_rows_contig {
	const float *k, *v;
	size_t base, stride;	/* row of key 0; floats between rows */
	__device__ const float *kr(int j) const { return k + (base + (size_t)j) * stride; }
	__device__ const float *vr(int j) const { return v + (base + (size_t)j) * stride; }
	__device__ float kscale(int) const { return 1.0f; }
	__device__ float vscale(int) const { return 1.0f; }
};

/* Rows of key j: the paged cache of one layer and KV head; an E4M3 cache's
 * row scales at ks, vs (kernels/kv.h), else NULL (scale 1: x * 1 is x). */
template <typename T> struct gen_rows_paged {
	const T *k, *v;
	const uint32_t *bt;
	size_t layer_blocks;	/* layer * n_blocks */
	int n_kv, g, bs, hd;
	const float *ks, *vs;
	__device__ size_t at(int j) const
	{
		size_t b = layer_blocks + bt[j / bs];
		return ((b * n_kv + g) * bs + (size_t)(j % bs)) * hd;
	}
	__device__ const T *kr(int j) const { return k + at(j); }
	__device__ const T *vr(int j) const { return v + at(j); }
	__device__ float kscale(int j) const { return ks ? ks[at(j) / hd] : 1.0f; }
	__device__ float vscale(int j) const { return vs ? vs[at(j) / hd] : 1.0f; }
};

/* out[0..hd) = softmax(q . K^T * scale) V over keys [0, n_keys). */
template <typename T, typename Rows>
__device__ void gen_attend(float *out, const float *q, int hd, int n_keys, float scale,
			   const Rows &rows)
{
	__shared__ float qs[GEN_MAX_HD], ps[GEN_THREADS], red[32];
	const int tid = threadIdx.x;
	float m = -INFINITY, l = 0.0f, o = 0.0f;

	for (int d = tid; d < hd; d += GEN_THREADS)
		qs[d] = q[d];
	__syncthreads();
	for (int c0 = 0; c0 < n_keys; c0 += GEN_THREADS) {
		const int j = c0 + tid, cn = min(GEN_THREADS, n_keys - c0);
		float sc = -INFINITY;
		if (j < n_keys) {
			const T *kp = rows.kr(j);
			float acc = 0.0f;
			for (int d = 0; d < hd; d++)
				acc += qs[d] * gen_ld<T>(kp + d);
			sc = acc * scale * rows.kscale(j);	/* the CPU's order */
		}
		const float mnew = fmaxf(m, gen_reduce(sc, red, true));	/* key c0 is valid */
		const float p = j < n_keys ? expf(sc - mnew) : 0.0f;
		const float corr = expf(m - mnew);
		ps[tid] = p;
		l = l * corr + gen_reduce(p, red, false);	/* its barrier publishes ps */
		if (tid < hd) {
			o *= corr;
			for (int jj = 0; jj < cn; jj++)
				o += ps[jj] * rows.vscale(c0 + jj) * gen_ld<T>(rows.vr(c0 + jj) + tid);
		}
		m = mnew;
		__syncthreads();	/* ps is rewritten by the next chunk */
	}
	if (tid < hd)
		out[tid] = o / l;
}

/* Prefill: row r (int2 {start of its sequence, position in it}) attends to
 * positions 0..pos of its sequence. grid (rows, n_heads). */
__global__ void __launch_bounds__(GEN_THREADS)
gen_prefill_kernel(float *out, const float *q, const float *k, const float *v,
		   const int2 *rows, int n_heads, int n_kv, int hd, float scale)
{
	const int r = blockIdx.x, h = blockIdx.y, g = h / (n_heads / n_kv);
	const int2 rp = rows[r];
	gen_rows_contig kr = { k + (size_t)g * hd, v + (size_t)g * hd, (size_t)rp.x,
			       (size_t)n_kv * hd };
	const size_t qo = ((size_t)r * n_heads + h) * hd;
	gen_attend<float>(out + qo, q + qo, hd, rp.y + 1, scale, kr);
}

/* Decode: query i attends to its ctx_len positions in the paged cache.
 * grid (n, n_heads). */
template <typename T>
__global__ void __launch_bounds__(GEN_THREADS)
gen_decode_kernel(float *out, const float *q, const T *kc, const T *vc, const float *ksc,
		  const float *vsc, const int32_t *ctx_len, const int32_t *bt_off, const uint32_t *bt,
		  int layer, uint32_t n_blocks, int n_heads, int n_kv, int bs, int hd, float scale)
{
	const int i = blockIdx.x, h = blockIdx.y, g = h / (n_heads / n_kv);
	gen_rows_paged<T> pr = { kc, vc, bt + bt_off[i], (size_t)layer * n_blocks, n_kv, g, bs, hd,
				 ksc, vsc };
	const size_t qo = ((size_t)i * n_heads + h) * hd;
	gen_attend<T>(out + qo, q + qo, hd, ctx_len[i], scale, pr);
}

static int gen_prefill(struct mlens_cuda_ctx *c, float *out, const float *q, const float *k,
		       const float *v, const int32_t *cu_seqlens, int n_seqs, int n_heads,
		       int n_kv_heads, int head_dim, float scale)
{
	int T = cu_seqlens[n_seqs] - cu_seqlens[0], rc;
	char *h, *d;

	if (T <= 0)
		return 0;
	if ((rc = mlens_cuda_stage_begin(c, (size_t)T * sizeof(int2), &h, &d)))
		return rc;
	int2 *rp = (int2 *)h;
	for (int s = 0; s < n_seqs; s++)
		for (int p = 0; p < cu_seqlens[s + 1] - cu_seqlens[s]; p++)
			*rp++ = make_int2(cu_seqlens[s], p);
	if ((rc = mlens_cuda_stage_commit(c, (size_t)T * sizeof(int2))))
		return rc;
	/* rows are numbered from cu_seqlens[0], as the tuned kernel does */
	size_t o0 = (size_t)cu_seqlens[0] * n_heads * head_dim;
	gen_prefill_kernel<<<dim3((unsigned)T, (unsigned)n_heads), GEN_THREADS, 0, c->stream>>>(
		out + o0, q + o0, k, v, (const int2 *)d, n_heads, n_kv_heads, head_dim, scale);
	CUDA_LAUNCHED();
	return 0;
}

int mlens_cuda_attn_prefill(struct mlens_cuda_ctx *c, float *out, const float *q,
			    const float *k, const float *v, const int32_t *cu_seqlens,
			    int n_seqs, int n_heads, int n_kv_heads, int head_dim, float scale)
{
	size_t n_tiles = 0;
	char *h, *d;
	int rc;

	if (n_kv_heads <= 0 || n_heads <= 0 || n_heads % n_kv_heads || n_seqs < 0)
		return -EINVAL;
	if (head_dim <= 0 || head_dim > GEN_MAX_HD) {
		fprintf(stderr, "mlens cuda: attention head_dim %d unsupported (1..%d)\n",
			head_dim, GEN_MAX_HD);
		return -ENOTSUP;
	}
	if (head_dim != 64 && head_dim != 128)
		return gen_prefill(c, out, q, k, v, cu_seqlens, n_seqs, n_heads, n_kv_heads,
				   head_dim, scale);
	/* tensor cores when asked for; their vector loads need 16-byte K/V
	 * rows and 8-byte Q/out rows (always so for buffers the backend
	 * allocates: the bases are aligned and head_dim is 64 or 128) */
	const bool tc = c->prefill_bf16 && !(((uintptr_t)k | (uintptr_t)v) & 15) &&
			!(((uintptr_t)q | (uintptr_t)out) & 7);
	const int br = tc ? TC_BR : PF_BR;
	for (int s = 0; s < n_seqs; s++) {
		int len = cu_seqlens[s + 1] - cu_seqlens[s];
		if (len < 0 || cu_seqlens[s] < 0)
			return -EINVAL;
		n_tiles += (size_t)(len + br - 1) / br;
	}
	if (!n_tiles)
		return 0;
	if (n_tiles > 0x7fffffff)
		return -E2BIG;
	if ((rc = mlens_cuda_stage_begin(c, n_tiles * sizeof(int4), &h, &d)))
		return rc;
	int4 *t = (int4 *)h;
	for (int s = 0; s < n_seqs; s++) {
		int len = cu_seqlens[s + 1] - cu_seqlens[s];
		for (int q0 = 0; q0 < len; q0 += br)
			*t++ = make_int4(cu_seqlens[s], q0, len, 0);
	}
	if ((rc = mlens_cuda_stage_commit(c, n_tiles * sizeof(int4))))
		return rc;
	dim3 grid((unsigned)n_tiles, (unsigned)n_heads);
	if (tc) {
		if (head_dim == 64)
			prefill_tc_kernel<64><<<grid, TC_THREADS, 0, c->stream>>>(
				out, q, k, v, (const int4 *)d, n_heads, n_kv_heads, scale);
		else
			prefill_tc_kernel<128><<<grid, TC_THREADS, 0, c->stream>>>(
				out, q, k, v, (const int4 *)d, n_heads, n_kv_heads, scale);
		CUDA_LAUNCHED();
		return 0;
	}
	if (head_dim == 64)
		return prefill_launch<64>(c, grid, out, q, k, v, (const int4 *)d, n_heads,
					  n_kv_heads, scale);
	return prefill_launch<128>(c, grid, out, q, k, v, (const int4 *)d, n_heads, n_kv_heads,
				   scale);
}

/* ==== KV append ==== */

template <typename T> __device__ __forceinline__ T to_kv(float x);
template <> __device__ __forceinline__ float to_kv<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 to_kv<__nv_bfloat16>(float x)
{
	return __float2bfloat16_rn(x);	/* round to nearest even, as the CPU */
}

/* 16 bytes of a KV row as floats: 4 f32 or 8 bf16 (rows are 16-byte aligned:
 * head_dim is 64 or 128 and cudaMalloc aligns the base). */
template <typename T> struct kv_vec;
template <> struct kv_vec<float> {
	static constexpr int N = 4;
	static __device__ __forceinline__ void load(const float *p, float *out)
	{
		float4 v = *(const float4 *)p;
		out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
	}
	/* two consecutive values */
	static __device__ __forceinline__ float2 load2(const float *p)
	{
		return *(const float2 *)p;
	}
};
template <> struct kv_vec<__nv_bfloat16> {
	static constexpr int N = 8;
	static __device__ __forceinline__ void load(const __nv_bfloat16 *p, float *out)
	{
		uint4 v = *(const uint4 *)p;
		const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
		for (int i = 0; i < 4; i++) {
			float2 f = __bfloat1622float2(h[i]);
			out[2 * i] = f.x;
			out[2 * i + 1] = f.y;
		}
	}
	static __device__ __forceinline__ float2 load2(const __nv_bfloat16 *p)
	{
		return __bfloat1622float2(*(const __nv_bfloat162 *)p);
	}
};
/* e4m3 codes (16 a load), before their row's scale */
template <> struct kv_vec<uint8_t> {
	static constexpr int N = 16;
	static __device__ __forceinline__ void load(const uint8_t *p, float *out)
	{
		uint4 v = *(const uint4 *)p;
		const uint8_t *b = (const uint8_t *)&v;
#pragma unroll
		for (int i = 0; i < 16; i++)
			out[i] = mlens_e4m3_to_f32(b[i]);
	}
	static __device__ __forceinline__ float2 load2(const uint8_t *p)
	{
		unsigned v = *(const uint16_t *)p;
		return make_float2(mlens_e4m3_to_f32((uint8_t)(v & 0xff)),
				   mlens_e4m3_to_f32((uint8_t)(v >> 8)));
	}
};

/* Token i of n at slots[i]; a block takes tokens blockIdx.x, + gridDim.x,
 * ... (one token a block on the compute stream, a grid-stride loop in the
 * side append's capped grid). */
template <typename T>
__global__ void kv_append_kernel(T *kc, T *vc, const float *k, const float *v,
				 const int64_t *slots, int n, int layer, uint32_t n_blocks,
				 int n_kv, int bs, int hd)
{
	for (int i = blockIdx.x; i < n; i += gridDim.x) {
		uint32_t block = (uint32_t)(slots[i] / bs);
		int off = (int)(slots[i] % bs);
		for (int t = threadIdx.x; t < n_kv * hd; t += blockDim.x) {
			int g = t / hd, dd = t % hd;
			size_t b = (size_t)layer * n_blocks + block;
			size_t idx = ((b * n_kv + g) * bs + off) * hd + dd;
			size_t src = (size_t)i * n_kv * hd + t;
			kc[idx] = to_kv<T>(k[src]);
			vc[idx] = to_kv<T>(v[src]);
		}
	}
}

/* bf16 caches: two elements a thread, so that a warp stores 128 contiguous
 * bytes (a pool in host memory takes them as PCIe writes); the values are
 * to_kv's, element by element, as the one-element kernel stores them. */
__global__ void kv_append_bf16x2_kernel(__nv_bfloat162 *kc, __nv_bfloat162 *vc, const float *k,
					const float *v, const int64_t *slots, int n, int layer,
					uint32_t n_blocks, int n_kv, int bs, int hd)
{
	for (int i = blockIdx.x; i < n; i += gridDim.x) {
		uint32_t block = (uint32_t)(slots[i] / bs);
		int off = (int)(slots[i] % bs);
		for (int t = threadIdx.x; t < n_kv * hd / 2; t += blockDim.x) {
			int e = 2 * t, g = e / hd, dd = e % hd;
			size_t b = (size_t)layer * n_blocks + block;
			size_t idx = ((b * n_kv + g) * bs + off) * hd + dd;
			size_t src = (size_t)i * n_kv * hd + e;
			kc[idx / 2] = __halves2bfloat162(to_kv<__nv_bfloat16>(k[src]),
							 to_kv<__nv_bfloat16>(k[src + 1]));
			vc[idx / 2] = __halves2bfloat162(to_kv<__nv_bfloat16>(v[src]),
							 to_kv<__nv_bfloat16>(v[src + 1]));
		}
	}
}

/* fp8 caches: one warp a (token, KV head) row of K or V: the row's largest
 * magnitude (the max is exact in any order, NaN ignored as the CPU ignores
 * it), its scale, the codes, each through kernels/fp8.h, so that the bytes
 * are those of the CPU append (the oracle). */
__global__ void kv_append_e4m3_kernel(uint8_t *kc, uint8_t *vc, float *ksc, float *vsc,
				      const float *k, const float *v, const int64_t *slots, int n,
				      int layer, uint32_t n_blocks, int n_kv, int bs, int hd)
{
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
	for (int i = blockIdx.x; i < n; i += gridDim.x) {
		uint32_t block = (uint32_t)(slots[i] / bs);
		int off = (int)(slots[i] % bs);
		for (int r = warp; r < 2 * n_kv; r += n_warps) {
			const int g = r >> 1, is_v = r & 1;
			const float *src = (is_v ? v : k) + ((size_t)i * n_kv + g) * hd;
			size_t row = (((size_t)layer * n_blocks + block) * n_kv + g) * bs + off;
			uint8_t *dst = (is_v ? vc : kc) + row * hd;
			float amax = 0.0f, sc;
			for (int d = lane; d < hd; d += 32)
				amax = mlens_e4m3_amax(amax, src[d]);
			for (int o = 16; o; o >>= 1) {
				float x = __shfl_xor_sync(0xffffffffu, amax, o);
				amax = x > amax ? x : amax;
			}
			sc = mlens_e4m3_scale(amax);
			for (int d = lane; d < hd; d += 32)
				dst[d] = mlens_e4m3_quantize(src[d], sc);
			if (!lane)
				(is_v ? vsc : ksc)[row] = sc;
		}
	}
}

/* The append on stream st (its metadata through stager sg), in at most
 * max_grid blocks. */
static int kv_append_on(struct mlens_cuda_ctx *c, struct cuda_stager *sg, cudaStream_t st,
			int max_grid, struct mlens_kv_cache *kv, int layer, const float *k,
			const float *v, const int64_t *slots, int n)
{
	char *h, *d;
	void *kd, *vd;
	bool host;
	int rc, grid = n < max_grid ? n : max_grid;

	if (n < 0 || layer < 0 || layer >= kv->n_layers || kv->block_size <= 0 ||
	    (kv->dtype != MLENS_DTYPE_F32 && kv->dtype != MLENS_DTYPE_BF16 &&
	     kv->dtype != MLENS_DTYPE_E4M3))
		return -EINVAL;
	if (!n)
		return 0;
	for (int i = 0; i < n; i++)
		if (slots[i] < 0 || (uint64_t)(slots[i] / kv->block_size) >= kv->n_blocks)
			return -ERANGE;
	/* the cache on the device, or in host memory registered with it (the
	 * hybrid pipeline's pool) */
	if ((rc = mlens_cuda_device_view(kv->k, &kd, &host)) ||
	    (rc = mlens_cuda_device_view(kv->v, &vd, &host)))
		return rc;
	if ((rc = mlens_cuda_stager_begin(c, sg, (size_t)n * 8, &h, &d)))
		return rc;
	memcpy(h, slots, (size_t)n * 8);
	if ((rc = mlens_cuda_stager_commit(c, sg, (size_t)n * 8)))
		return rc;
	if (kv->dtype == MLENS_DTYPE_E4M3)
		kv_append_e4m3_kernel<<<grid, MLENS_CUDA_THREADS, 0, st>>>(
			(uint8_t *)kd, (uint8_t *)vd, mlens_kv_scales(kv, kd), mlens_kv_scales(kv, vd),
			k, v, (const int64_t *)d, n, layer, kv->n_blocks, kv->n_kv_heads,
			kv->block_size, kv->head_dim);
	else if (kv->dtype == MLENS_DTYPE_F32)
		kv_append_kernel<float><<<grid, MLENS_CUDA_THREADS, 0, st>>>(
			(float *)kd, (float *)vd, k, v, (const int64_t *)d, n, layer,
			kv->n_blocks, kv->n_kv_heads, kv->block_size, kv->head_dim);
	else if (kv->head_dim % 2 == 0)
		kv_append_bf16x2_kernel<<<grid, MLENS_CUDA_THREADS, 0, st>>>(
			(__nv_bfloat162 *)kd, (__nv_bfloat162 *)vd, k, v, (const int64_t *)d, n,
			layer, kv->n_blocks, kv->n_kv_heads, kv->block_size, kv->head_dim);
	else
		kv_append_kernel<__nv_bfloat16><<<grid, MLENS_CUDA_THREADS, 0, st>>>(
			(__nv_bfloat16 *)kd, (__nv_bfloat16 *)vd, k, v, (const int64_t *)d, n,
			layer, kv->n_blocks, kv->n_kv_heads, kv->block_size, kv->head_dim);
	CUDA_LAUNCHED();
	return 0;
}

int mlens_cuda_kv_append(struct mlens_cuda_ctx *c, struct mlens_kv_cache *kv, int layer,
			 const float *k, const float *v, const int64_t *slots, int n)
{
	return kv_append_on(c, &c->stage, c->stream, n, kv, layer, k, v, slots, n);
}

int mlens_cuda_kv_append_side(struct mlens_cuda_ctx *c, struct mlens_kv_cache *kv, int layer,
			      const float *k, const float *v, const int64_t *slots, int n)
{
	return kv_append_on(c, &c->side_stage, c->side_stream, c->side_append_blocks, kv, layer,
			    k, v, slots, n);
}

/* ==== decode ==== */

#define DEC_MAX_GROUP 8		/* query heads per KV head */
#define DEC_SPLIT 256		/* keys per block; longer contexts split */
/* Partials of one launch at most (unless one query alone needs more):
 * queries go through in groups under this, so that a step's workspace is
 * bounded whatever its queries' contexts (daemon/plan/gpu_plan.c mirrors it). */
#define DEC_PART_CAP ((size_t)256 << 20)

struct dec_meta {
	const int32_t *ctx_len;		/* [n] */
	const int32_t *bt_off;		/* [n]: start of query i's table in bt */
	const uint32_t *bt;		/* all block tables, back to back */
	/* [n]: where query i's partials start (in rows of head_dim + 2 floats)
	 * in its group's area: [n_heads][its own splits][head_dim + 2] */
	const int32_t *part_off;
};

/* One block: one query token, one KV head (its `group` query heads), one
 * DEC_SPLIT-key chunk of the context. Warps take 32-key tiles in turn; a
 * lane scores its own key for every head (16-byte loads along the key's
 * row), then the warp folds the tile into its running softmax, each lane
 * owning the output dims 64p + 2*lane + {0,1} (V rows read as pairs,
 * coalesced). Warps merge in shared memory; the block writes an
 * unnormalised partial (max, sum, output) for the combine kernel. An fp8
 * cache's row scales (ksc, vsc; unused otherwise) apply as on the CPU: a
 * key's score times its K scale, its softmax weight times its V scale for
 * the output (not for the sum). */
template <int HD, typename T>
__global__ void __launch_bounds__(ATTN_THREADS)
decode_kernel(float *part, const float *q, const T *kc, const T *vc, const float *ksc,
	      const float *vsc, struct dec_meta meta, int layer, uint32_t n_blocks, int n_kv,
	      int bs, int group, float scale)
{
	constexpr int DPL = HD / 32, VEC = kv_vec<T>::N;
	constexpr bool F8 = std::is_same<T, uint8_t>::value;
	__shared__ __align__(16) float Qs[DEC_MAX_GROUP][HD];
	__shared__ float Ms[ATTN_WARPS][DEC_MAX_GROUP], Ls[ATTN_WARPS][DEC_MAX_GROUP];
	__shared__ float Os[ATTN_WARPS][DEC_MAX_GROUP][HD];
	const int i = blockIdx.x, g = blockIdx.y, sp = blockIdx.z;
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int n_heads = n_kv * group;
	const int ctx = meta.ctx_len[i];
	const uint32_t *bt = meta.bt + meta.bt_off[i];
	const int c0 = sp * DEC_SPLIT, c1 = min(ctx, c0 + DEC_SPLIT);
	const int n_split = (ctx + DEC_SPLIT - 1) / DEC_SPLIT;	/* this query's own */

	if (c0 >= ctx)
		return;	/* a split of a longer query of the launch */
	float *pp = part + ((size_t)meta.part_off[i] + (size_t)g * group * n_split + sp) * (HD + 2);
	for (int idx = threadIdx.x; idx < group * HD; idx += ATTN_THREADS)
		Qs[idx / HD][idx % HD] =
			q[(size_t)i * n_heads * HD + (size_t)g * group * HD + idx];
	__syncthreads();

	float m[DEC_MAX_GROUP], l[DEC_MAX_GROUP], o[DEC_MAX_GROUP][DPL];
#pragma unroll
	for (int hh = 0; hh < DEC_MAX_GROUP; hh++) {
		m[hh] = -INFINITY;
		l[hh] = 0.0f;
#pragma unroll
		for (int j = 0; j < DPL; j++)
			o[hh][j] = 0.0f;
	}
	const size_t head_stride = (size_t)bs * HD;
	for (int kb = c0 + warp * 32; kb < c1; kb += ATTN_WARPS * 32) {
		const int key = kb + lane;
		const bool valid = key < c1;
		size_t row = 0;
		if (valid) {
			uint32_t blk = bt[key / bs];
			row = (((size_t)layer * n_blocks + blk) * n_kv + g) * head_stride +
			      (size_t)(key % bs) * HD;
		}
		float s[DEC_MAX_GROUP], ks = 1.0f, vs = 1.0f;	/* this lane's key's scales */
		if (F8 && valid) {
			ks = ksc[row / HD];
			vs = vsc[row / HD];
		}
#pragma unroll
		for (int hh = 0; hh < DEC_MAX_GROUP; hh++)
			s[hh] = 0.0f;
		if (valid) {
			const T *kp = kc + row;
#pragma unroll 2
			for (int d0 = 0; d0 < HD; d0 += VEC) {
				float kd[VEC];
				kv_vec<T>::load(kp + d0, kd);
#pragma unroll
				for (int e = 0; e < VEC; e += 4)
#pragma unroll
					for (int hh = 0; hh < DEC_MAX_GROUP; hh++) {
						if (hh >= group)
							break;
						float4 qv = *(const float4 *)&Qs[hh][d0 + e];
						s[hh] += qv.x * kd[e];
						s[hh] += qv.y * kd[e + 1];
						s[hh] += qv.z * kd[e + 2];
						s[hh] += qv.w * kd[e + 3];
					}
			}
		}
		float p[DEC_MAX_GROUP];
#pragma unroll
		for (int hh = 0; hh < DEC_MAX_GROUP; hh++) {
			if (hh >= group)
				break;
			float sc = valid ? (F8 ? s[hh] * scale * ks : s[hh] * scale) : -INFINITY;
			float mnew = fmaxf(m[hh], warp_max(sc));	/* lane 0's key is valid */
			p[hh] = valid ? expf(sc - mnew) : 0.0f;
			float corr = expf(m[hh] - mnew);
			l[hh] = l[hh] * corr + warp_sum(p[hh]);
			m[hh] = mnew;
			if (F8)
				p[hh] *= vs;	/* the weight of its V row; l took p alone */
#pragma unroll
			for (int j = 0; j < DPL; j++)
				o[hh][j] *= corr;
		}
		const int jmax = min(32, c1 - kb);
#pragma unroll 4
		for (int j = 0; j < jmax; j++) {
			size_t vr = __shfl_sync(0xffffffffu, row, j);
			const T *vp = vc + vr + 2 * lane;
			float vv[DPL];
#pragma unroll
			for (int pr = 0; pr < DPL / 2; pr++) {
				float2 f = kv_vec<T>::load2(vp + 64 * pr);
				vv[2 * pr] = f.x;
				vv[2 * pr + 1] = f.y;
			}
#pragma unroll
			for (int hh = 0; hh < DEC_MAX_GROUP; hh++) {
				if (hh >= group)
					break;
				float pj = __shfl_sync(0xffffffffu, p[hh], j);
#pragma unroll
				for (int dd = 0; dd < DPL; dd++)
					o[hh][dd] += pj * vv[dd];
			}
		}
	}
	/* merge the warps */
#pragma unroll
	for (int hh = 0; hh < DEC_MAX_GROUP; hh++) {
		if (hh >= group)
			break;
		if (!lane) {
			Ms[warp][hh] = m[hh];
			Ls[warp][hh] = l[hh];
		}
#pragma unroll
		for (int dd = 0; dd < DPL; dd++)
			Os[warp][hh][64 * (dd / 2) + 2 * lane + (dd & 1)] = o[hh][dd];
	}
	__syncthreads();
	for (int idx = threadIdx.x; idx < group * HD; idx += ATTN_THREADS) {
		int hh = idx / HD, d = idx % HD;
		float M = -INFINITY, L = 0.0f, O = 0.0f;
		for (int w = 0; w < ATTN_WARPS; w++)
			M = fmaxf(M, Ms[w][hh]);
		for (int w = 0; w < ATTN_WARPS; w++) {
			if (Ms[w][hh] == -INFINITY)
				continue;	/* this warp saw no key */
			float f = expf(Ms[w][hh] - M);
			L += Ls[w][hh] * f;
			O += Os[w][hh][d] * f;
		}
		float *ph = pp + (size_t)hh * n_split * (HD + 2);
		ph[2 + d] = O;
		if (!d) {
			ph[0] = M;
			ph[1] = L;
		}
	}
}

/* out[i][h] = merge of the splits that hold keys of query i. */
__global__ void decode_combine_kernel(float *out, const float *part, const int32_t *ctx_len,
				      const int32_t *part_off, int n_heads, int hd)
{
	const int i = blockIdx.x, h = blockIdx.y;
	const int ns = (ctx_len[i] + DEC_SPLIT - 1) / DEC_SPLIT;
	const float *ph = part + ((size_t)part_off[i] + (size_t)h * ns) * (hd + 2);
	float M = -INFINITY;
	for (int s = 0; s < ns; s++)
		M = fmaxf(M, ph[(size_t)s * (hd + 2)]);
	for (int d = threadIdx.x; d < hd; d += blockDim.x) {
		float L = 0.0f, O = 0.0f;
		for (int s = 0; s < ns; s++) {
			const float *p = ph + (size_t)s * (hd + 2);
			float f = expf(p[0] - M);
			L += p[1] * f;
			O += p[2 + d] * f;
		}
		out[((size_t)i * n_heads + h) * hd + d] = O / L;
	}
}

int mlens_cuda_attn_decode(struct mlens_cuda_ctx *c, float *out, const float *q,
			   const struct mlens_kv_cache *kv, int layer,
			   const struct mlens_attn_query *queries, int n, int n_heads,
			   float scale)
{
	const int hd = kv->head_dim, bs = kv->block_size;
	size_t bt_total = 0, o_off, o_po, o_bt, used, row_bytes, part_max = 0, acc = 0;
	int group, rc;
	int32_t *po;
	bool tuned;
	char *h, *d, *part;

	if (n < 0 || kv->n_kv_heads <= 0 || n_heads % kv->n_kv_heads || bs <= 0 ||
	    layer < 0 || layer >= kv->n_layers ||
	    (kv->dtype != MLENS_DTYPE_F32 && kv->dtype != MLENS_DTYPE_BF16 &&
	     kv->dtype != MLENS_DTYPE_E4M3))
		return -EINVAL;
	group = n_heads / kv->n_kv_heads;
	if (hd <= 0 || hd > GEN_MAX_HD) {
		fprintf(stderr, "mlens cuda: decode attention head_dim %d unsupported (1..%d)\n", hd,
			GEN_MAX_HD);
		return -ENOTSUP;
	}
	tuned = group <= DEC_MAX_GROUP && (hd == 64 || hd == 128);
	if (!n)
		return 0;
	for (int i = 0; i < n; i++) {
		const struct mlens_attn_query *qr = &queries[i];
		if (qr->ctx_len <= 0 || (int64_t)qr->n_blocks * bs < qr->ctx_len)
			return -ERANGE;
		int need = (qr->ctx_len + bs - 1) / bs;
		for (int b = 0; b < need; b++)
			if (qr->block_table[b] >= kv->n_blocks)
				return -ERANGE;
		bt_total += (size_t)need;
	}
	row_bytes = (size_t)n_heads * (size_t)(hd + 2) * 4;
	o_off = mlens_cuda_align((size_t)n * 4);
	o_po = mlens_cuda_align(o_off + (size_t)n * 4);
	o_bt = mlens_cuda_align(o_po + (size_t)n * 4);
	used = o_bt + bt_total * 4;
	if ((rc = mlens_cuda_stage_begin(c, used, &h, &d)))
		return rc;
	/* po: partials of each query, its own splits only (not the longest
	 * query's), in groups of at most DEC_PART_CAP bytes (a query alone
	 * may need more); a group starts where po is 0 */
	po = (int32_t *)(h + o_po);
	{
		int32_t *ctx = (int32_t *)h, *off = (int32_t *)(h + o_off);
		uint32_t *bt = (uint32_t *)(h + o_bt);
		size_t at = 0;
		for (int i = 0; i < n; i++) {
			int need = (queries[i].ctx_len + bs - 1) / bs;
			size_t b = (size_t)((queries[i].ctx_len + DEC_SPLIT - 1) / DEC_SPLIT) *
				   row_bytes;
			ctx[i] = queries[i].ctx_len;
			off[i] = (int32_t)at;
			memcpy(bt + at, queries[i].block_table, (size_t)need * 4);
			at += (size_t)need;
			if (acc && acc + b > DEC_PART_CAP)
				acc = 0;
			if (acc / (size_t)((hd + 2) * 4) > INT32_MAX)
				return -ERANGE;
			po[i] = (int32_t)(acc / (size_t)((hd + 2) * 4));
			acc += b;
			part_max = acc > part_max ? acc : part_max;
		}
	}
	if ((rc = mlens_cuda_stage_commit(c, used)))
		return rc;
	if (!tuned) {
		if (kv->dtype == MLENS_DTYPE_F32)
			gen_decode_kernel<float><<<dim3((unsigned)n, (unsigned)n_heads), GEN_THREADS, 0,
						   c->stream>>>(
				out, q, (const float *)kv->k, (const float *)kv->v, NULL, NULL,
				(const int32_t *)d, (const int32_t *)(d + o_off),
				(const uint32_t *)(d + o_bt), layer, kv->n_blocks, n_heads,
				kv->n_kv_heads, bs, hd, scale);
		else if (kv->dtype == MLENS_DTYPE_E4M3)
			gen_decode_kernel<uint8_t><<<dim3((unsigned)n, (unsigned)n_heads), GEN_THREADS, 0,
						     c->stream>>>(
				out, q, (const uint8_t *)kv->k, (const uint8_t *)kv->v,
				mlens_kv_scales(kv, kv->k), mlens_kv_scales(kv, kv->v),
				(const int32_t *)d, (const int32_t *)(d + o_off),
				(const uint32_t *)(d + o_bt), layer, kv->n_blocks, n_heads,
				kv->n_kv_heads, bs, hd, scale);
		else
			gen_decode_kernel<__nv_bfloat16><<<dim3((unsigned)n, (unsigned)n_heads),
							   GEN_THREADS, 0, c->stream>>>(
				out, q, (const __nv_bfloat16 *)kv->k, (const __nv_bfloat16 *)kv->v,
				NULL, NULL, (const int32_t *)d, (const int32_t *)(d + o_off),
				(const uint32_t *)(d + o_bt), layer, kv->n_blocks, n_heads,
				kv->n_kv_heads, bs, hd, scale);
		CUDA_LAUNCHED();
		return 0;
	}
	if ((rc = mlens_cuda_scratch(c, part_max, &part)))
		return rc;
	/* each group reuses the area: the stream orders it after the last
	 * (po is still ours to read: the copy only reads it) */
	for (int a = 0, b; a < n; a = b) {
		int max_split = 0;
		for (b = a; b < n && (b == a || po[b]); b++) {
			int ns = (queries[b].ctx_len + DEC_SPLIT - 1) / DEC_SPLIT;
			max_split = ns > max_split ? ns : max_split;
		}
		struct dec_meta meta = { (const int32_t *)d + a, (const int32_t *)(d + o_off) + a,
					 (const uint32_t *)(d + o_bt),
					 (const int32_t *)(d + o_po) + a };
		dim3 grid((unsigned)(b - a), (unsigned)kv->n_kv_heads, (unsigned)max_split);
		const float *qa = q + (size_t)a * n_heads * hd;
		float *pf = (float *)part;
#define DEC_LAUNCH(HD, T)                                                                  \
	decode_kernel<HD, T><<<grid, ATTN_THREADS, 0, c->stream>>>(                        \
		pf, qa, (const T *)kv->k, (const T *)kv->v, ksc, vsc, meta, layer,         \
		kv->n_blocks, kv->n_kv_heads, bs, group, scale)
		const bool f8 = kv->dtype == MLENS_DTYPE_E4M3;
		const float *ksc = f8 ? mlens_kv_scales(kv, kv->k) : NULL;
		const float *vsc = f8 ? mlens_kv_scales(kv, kv->v) : NULL;
		if (f8) {
			if (hd == 64)
				DEC_LAUNCH(64, uint8_t);
			else
				DEC_LAUNCH(128, uint8_t);
		} else if (kv->dtype == MLENS_DTYPE_F32) {
			if (hd == 64)
				DEC_LAUNCH(64, float);
			else
				DEC_LAUNCH(128, float);
		} else {
			if (hd == 64)
				DEC_LAUNCH(64, __nv_bfloat16);
			else
				DEC_LAUNCH(128, __nv_bfloat16);
		}
#undef DEC_LAUNCH
		CUDA_LAUNCHED();
		decode_combine_kernel<<<dim3((unsigned)(b - a), (unsigned)n_heads), hd, 0,
					c->stream>>>(out + (size_t)a * n_heads * hd, pf, meta.ctx_len,
						     meta.part_off, n_heads, hd);
		CUDA_LAUNCHED();
	}
	return 0;
}
