/* The experts' GEMMs of one MoE chunk as grouped batched GEMMs
 * (cublasGemmGroupedBatchedEx): one call for every expert's gate and up,
 * one silu(g) * u over all rows, one call for down, where the per-expert
 * path (backend_cuda.cu, moe_spread) launches three GEMMs an expert. Owns
 * the rule that picks it. */
#include "kernels/cuda/cuda_int.h"

#include <stdint.h>
#include <stdlib.h>

bool mlens_cuda_moe_grouped_use(const struct mlens_cuda_ctx *c, const struct mlens_moe_weights *w,
				const int32_t *counts)
{
	int active = 0;

	/* the grouped call takes bf16/f16 in and out (no fp32 output), so
	 * only the path whose gate and up are in the weight dtype anyway */
	if (c->moe_grouped == MLENS_MOE_GROUPED_OFF || c->gemm_exact ||
	    (w->dtype != MLENS_DTYPE_BF16 && w->dtype != MLENS_DTYPE_F16) ||
	    !mlens_moe_half_gu(MLENS_GEMM_FAST, mlens_dtype_size(w->dtype)))
		return false;
	/* every matrix pointer 16-byte aligned, as the grouped call wants:
	 * rows of H and I elements keep the row pointers so */
	if (w->hidden % 8 || w->inter % 8)
		return false;
	for (int e = 0; e < w->n_experts; e++) {
		if (!counts[e])
			continue;
		if (((uintptr_t)w->w1[e] | (uintptr_t)w->w2[e] | (uintptr_t)w->w3[e]) % 16)
			return false;
		active++;
	}
	return c->moe_grouped == MLENS_MOE_GROUPED_ON || active >= MLENS_MOE_GROUPED_MIN_EXPERTS;
}

/* A slice of one expert's rows inside one wave. */
struct grouped_seg {
	int e;
	int n;
	size_t r;	/* its first row (of the chunk) */
};

/* The host arrays of the grouped calls: one value a group (a gate or up
 * or down product of one segment), constants but n. */
struct grouped_args {
	cublasOperation_t *op_t, *op_n;
	int *inter, *hidden, *n, *one;
	float *alpha, *beta;
};

static cublasStatus_t grouped_call(struct mlens_cuda_ctx *c, const struct grouped_args *a,
				   cublasOperation_t *opa, int *m, int *n, int *k, int *lda, int *ldb,
				   int *ldc, const void *const *A, const void *const *B, void *const *C,
				   cudaDataType_t t, int groups)
{
	return cublasGemmGroupedBatchedEx(c->blas, opa, a->op_n, m, n, k, a->alpha, A, t, lda, B, t,
					  ldb, a->beta, C, t, ldc, groups, a->one, CUBLAS_COMPUTE_32F);
}

/* A grouped call's status as -errno; the first wave's refusal (nothing it
 * wrote is read yet) as -ENOTSUP, and the context off the grouped path. */
static int grouped_rc(struct mlens_cuda_ctx *c, cublasStatus_t st, bool first, enum mlens_dtype dt)
{
	if (st == CUBLAS_STATUS_SUCCESS)
		return 0;
	if (first && st == CUBLAS_STATUS_NOT_SUPPORTED) {
		fprintf(stderr, "mlens cuda: moe: cuBLAS has no grouped GEMM for %s experts here; "
				"running them one by one\n", mlens_dtype_name(dt));
		c->moe_grouped = MLENS_MOE_GROUPED_OFF;
		return -ENOTSUP;
	}
	return mlens_cublas_rc(st, "cublasGemmGroupedBatchedEx (MoE experts)", __FILE__, __LINE__);
}

/* The end of the wave (of cap rows) that segment s0 starts. */
static size_t wave_end(const struct grouped_seg *seg, size_t nseg, size_t s0, size_t cap)
{
	size_t s1 = s0;
	while (s1 < nseg && seg[s1].r / cap == seg[s0].r / cap)
		s1++;
	return s1;
}

int mlens_cuda_moe_grouped(struct mlens_cuda_ctx *c, const struct mlens_moe_weights *w,
			   const int32_t *counts, size_t rows, char *xe, char *gu, size_t gu_bytes,
			   float *y)
{
	/* a wave's gate rows, then its up rows (I a multiple of 8: aligned) */
	const size_t cap = gu_bytes / (2 * (size_t)w->inter * 2);
	char *const g = gu, *const u = gu + cap * (size_t)w->inter * 2;
	const int E = w->n_experts, H = w->hidden, I = w->inter;
	const enum mlens_dtype dt = w->dtype;
	const cudaDataType_t t = dt == MLENS_DTYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
	const size_t es = 2, waves = cap ? (rows + cap - 1) / cap : 0;
	/* each wave boundary splits at most one expert in two */
	size_t max_seg = (size_t)E + waves, nseg = 0, most = 0, per, bytes;
	struct grouped_seg *seg;
	struct grouped_args a;
	char *hbuf, *host, *dev;
	int rc = 0;

	if (!cap || !rows || cap > INT_MAX)
		return -EINVAL;
	seg = (struct grouped_seg *)malloc(max_seg * sizeof(*seg));
	if (!seg)
		return -ENOMEM;
	/* the segments in row order, so that a wave's are consecutive */
	for (size_t e = 0, r = 0, in_wave = 0, wave = 0; e < (size_t)E; r += (size_t)counts[e], e++) {
		for (size_t off = 0; off < (size_t)counts[e];) {
			size_t at = r + off, end = (at / cap + 1) * cap;
			size_t take = end - at < (size_t)counts[e] - off ? end - at : (size_t)counts[e] - off;
			if (at / cap != wave) {
				wave = at / cap;
				in_wave = 0;
			}
			seg[nseg].e = (int)e;
			seg[nseg].n = (int)take;
			seg[nseg].r = at;
			nseg++;
			if (++in_wave > most)
				most = in_wave;
			off += take;
		}
	}

	/* host arguments: 2 * most groups (gate and up) of each array */
	per = 2 * most;
	hbuf = (char *)malloc(per * (2 * sizeof(cublasOperation_t) + 3 * sizeof(int) +
				     2 * sizeof(float)) +
			      2 * nseg * sizeof(int));
	if (!hbuf) {
		free(seg);
		return -ENOMEM;
	}
	a.op_t = (cublasOperation_t *)hbuf;
	a.op_n = a.op_t + per;
	a.inter = (int *)(a.op_n + per);
	a.hidden = a.inter + per;
	a.one = a.hidden + per;
	a.n = a.one + per;	/* 2 * nseg: every wave's own */
	a.alpha = (float *)(a.n + 2 * nseg);
	a.beta = a.alpha + per;
	for (size_t i = 0; i < per; i++) {
		a.op_t[i] = CUBLAS_OP_T;
		a.op_n[i] = CUBLAS_OP_N;
		a.inter[i] = I;
		a.hidden[i] = H;
		a.one[i] = 1;
		a.alpha[i] = 1.0f;
		a.beta[i] = 0.0f;
	}

	/* device pointer arrays, one staging copy for the chunk: for the
	 * segments [s0, s1) of a wave, gate and up at [2 s0, 2 s1) of A, B
	 * and C (the gate's first), down's weights at [s0, s1) of D; down
	 * reads the gate's C (silu(g) * u is written over g) and writes
	 * over the gate's B (its rows of xe, read by then) */
	bytes = 7 * nseg * sizeof(void *);
	if ((rc = mlens_cuda_stage_begin(c, bytes, &host, &dev)))
		goto out;
	{
		const void **hA = (const void **)host, **hB = hA + 2 * nseg;
		void **hC = (void **)(hB + 2 * nseg);
		const void **hD = (const void **)(hC + 2 * nseg);
		size_t s0 = 0;
		while (s0 < nseg) {
			size_t q0 = seg[s0].r / cap * cap, s1 = wave_end(seg, nseg, s0, cap);
			size_t cnt = s1 - s0;
			for (size_t i = 0; i < cnt; i++) {
				const struct grouped_seg *sg = &seg[s0 + i];
				size_t gi = 2 * s0 + i, ui = 2 * s0 + cnt + i;
				char *x = xe + sg->r * (size_t)H * es;
				hA[gi] = w->w1[sg->e];
				hA[ui] = w->w3[sg->e];
				hB[gi] = hB[ui] = x;
				hC[gi] = g + (sg->r - q0) * (size_t)I * es;
				hC[ui] = u + (sg->r - q0) * (size_t)I * es;
				hD[s0 + i] = w->w2[sg->e];
				a.n[gi] = a.n[ui] = sg->n;
			}
			s0 = s1;
		}
	}
	if ((rc = mlens_cuda_stage_commit(c, bytes)))
		goto out;
	{
		const void *const *dA = (const void *const *)dev, *const *dB = dA + 2 * nseg;
		void *const *dC = (void *const *)(dB + 2 * nseg);
		const void *const *dD = (const void *const *)(dC + 2 * nseg);
		/* DBRX's w2 is stored [I][H]: column-major [H][I], no transpose */
		cublasOperation_t *op2 = w->w2_transposed ? a.op_n : a.op_t;
		int *lda2 = w->w2_transposed ? a.hidden : a.inter;
		size_t s0 = 0;
		while (s0 < nseg) {
			size_t q0 = seg[s0].r / cap * cap, s1 = wave_end(seg, nseg, s0, cap);
			size_t q1 = rows < q0 + cap ? rows : q0 + cap, cnt = s1 - s0;
			/* gate and up: out[n][I] = x[n][H] . W[I][H]^T, column-major
			 * [I][n] = W^T (op T on the [H][I] view) . x */
			if ((rc = grouped_rc(c, grouped_call(c, &a, a.op_t, a.inter, a.n + 2 * s0, a.hidden,
							     a.hidden, a.hidden, a.inter, dA + 2 * s0,
							     dB + 2 * s0, dC + 2 * s0, t, (int)(2 * cnt)),
					     !s0, dt)) ||
			    (rc = mlens_cuda_silu_mul(c, g, dt, g, u, dt, (q1 - q0) * (size_t)I)) ||
			    (rc = grouped_rc(c, grouped_call(c, &a, op2, a.hidden, a.n + 2 * s0, a.inter,
							     lda2, a.inter, a.hidden, dD + s0,
							     (const void *const *)(dC + 2 * s0),
							     (void *const *)(dB + 2 * s0), t, (int)cnt),
					     !s0, dt)))
				goto out;
			s0 = s1;
		}
	}
	rc = mlens_cuda_widen(c, y, xe, dt, rows * (size_t)H);
out:
	free(hbuf);
	free(seg);
	return rc;
}
