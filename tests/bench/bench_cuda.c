/* Benchmark of the CUDA backend's heavy ops at Mixtral-8x7B dimensions:
 * the dense bf16 GEMM (M tokens x K=4096 -> N=14336) against a bare cuBLAS
 * call on the same data, one expert's GEMMs at the row counts a MoE chunk
 * gives it, the MoE layer (12288 tokens, 8 experts, top-2) per MoE stream
 * count and tokens per call,
 * prefill flash attention and paged decode attention, and the K/V append
 * into a pool in registered host memory (bench_kv_store). Prints one JSON
 * object on stdout and a table on stderr. Not a test: it asserts nothing.
 * Also one token group's GA and GB of the hybrid pipeline op by op
 * (bench_group).
 * Usage: bench_cuda [fast|exact] [kv-store|moe-gemm|moe-fp8|moe-grouped|group]:
 * the backend's GEMM mode (default fast); kv-store runs only the K/V
 * append, moe-gemm only the experts' GEMMs looped and grouped
 * (bench_moe_gemm), moe-fp8 only bench_moe_fp8, moe-grouped only the MoE
 * op with grouped and per-expert GEMMs at many- and few-expert sizes
 * (bench_moe_grouped), group only bench_group. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include "kernels/backend.h"

static struct mlens_backend be;

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;

static float rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (float)((double)(rng >> 11) / 4503599627370496.0 - 1.0);
}

/* Device buffer of n values of dtype dt, random in [-scale, scale). */
static void *dev_random(size_t n, enum mlens_dtype dt, float scale)
{
	size_t es = mlens_dtype_size(dt);
	void *h = malloc(n * es), *d;
	if (!h)
		return NULL;
	for (size_t i = 0; i < n; i++)
		mlens_store(h, dt, i, rnd() * scale);
	d = be.ops->alloc(be.ctx, n * es);
	if (d && be.ops->upload(be.ctx, d, h, n * es)) {
		be.ops->free(be.ctx, d);
		d = NULL;
	}
	free(h);
	return d;
}

#define FAIL(what) do { fprintf(stderr, "bench_cuda: %s failed\n", what); return 1; } while (0)

static int bench_gemm(int first)
{
	static const int Ms[] = { 16, 256, 1024, 4096 };
	const int K = 4096, N = 14336, iters = 20;
	void *w = dev_random((size_t)N * K, MLENS_DTYPE_BF16, 0.02f);
	float *x = dev_random((size_t)4096 * K, MLENS_DTYPE_F32, 1.0f);
	void *xb = dev_random((size_t)4096 * K, MLENS_DTYPE_BF16, 1.0f);
	float *out = be.ops->alloc(be.ctx, (size_t)4096 * N * 4);
	void *outb = be.ops->alloc(be.ctx, (size_t)4096 * N * 2);
	cublasHandle_t h;
	const float alpha = 1.0f, beta = 0.0f;

	if (!w || !x || !xb || !out || !outb || cublasCreate(&h) != CUBLAS_STATUS_SUCCESS)
		FAIL("gemm set-up");
	for (int a = 0; a < 4; a++) {
		int M = Ms[a];
		double flop = 2.0 * M * N * K, t0, t_op, t_blas, t_blas16;
		for (int i = 0; i < 3; i++)
			if (be.ops->gemm(be.ctx, out, x, w, MLENS_DTYPE_BF16, M, K, N, false))
				FAIL("gemm");
		be.ops->sync(be.ctx);
		t0 = now();
		for (int i = 0; i < iters; i++)
			be.ops->gemm(be.ctx, out, x, w, MLENS_DTYPE_BF16, M, K, N, false);
		be.ops->sync(be.ctx);
		t_op = (now() - t0) / iters;

		/* bare cuBLAS on bf16 activations, fp32 out (what the op runs after
		 * converting x) and bf16 out (the best case) */
		for (int pass = 0; pass < 2; pass++) {
			void *o = pass ? outb : (void *)out;
			cudaDataType_t ct = pass ? CUDA_R_16BF : CUDA_R_32F;
			for (int i = 0; i < iters + 3; i++) {
				if (i == 3) {
					cudaDeviceSynchronize();
					t0 = now();
				}
				if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w,
						 CUDA_R_16BF, K, xb, CUDA_R_16BF, K, &beta, o, ct, N,
						 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) !=
				    CUBLAS_STATUS_SUCCESS)
					FAIL("cublasGemmEx");
			}
			cudaDeviceSynchronize();
			if (pass)
				t_blas16 = (now() - t0) / iters;
			else
				t_blas = (now() - t0) / iters;
		}
		printf("%s\n    {\"M\": %d, \"K\": %d, \"N\": %d, \"op_ms\": %.4f, \"op_tflops\": %.1f, "
		       "\"cublas_f32out_tflops\": %.1f, \"cublas_bf16out_tflops\": %.1f}",
		       first && !a ? "" : ",", M, K, N, t_op * 1e3, flop / t_op * 1e-12,
		       flop / t_blas * 1e-12, flop / t_blas16 * 1e-12);
		fprintf(stderr, "gemm bf16 M=%5d K=%d N=%d: op %7.3f ms %6.1f TFLOP/s | cublas fp32-out %6.1f, bf16-out %6.1f TFLOP/s\n",
			M, K, N, t_op * 1e3, flop / t_op * 1e-12, flop / t_blas * 1e-12,
			flop / t_blas16 * 1e-12);
	}
	cublasDestroy(h);
	be.ops->free(be.ctx, w);
	be.ops->free(be.ctx, x);
	be.ops->free(be.ctx, xb);
	be.ops->free(be.ctx, out);
	be.ops->free(be.ctx, outb);
	return 0;
}

/* One expert's GEMM shapes alone (rows routed rows): gate/up (K=H, N=I)
 * and down (K=I, N=H), bare cuBLAS, fp32 and bf16 outputs: what the MoE's
 * GEMMs reach at the row counts a chunk gives each expert. */
static int bench_expert_gemm(cublasHandle_t h, const void *w, const void *xb, void *out, int H,
			     int I)
{
	static const int Rs[] = { 128, 256, 512, 1024 };
	const float alpha = 1.0f, beta = 0.0f;
	const int iters = 20;
	int first = 1;

	printf(",\n  \"expert_gemm\": [");
	for (int a = 0; a < 4; a++)
		for (int down = 0; down < 2; down++)
			for (int pass = 0; pass < 2; pass++) {
				int R = Rs[a], M = down ? H : I, K = down ? I : H;
				cudaDataType_t ct = pass ? CUDA_R_16BF : CUDA_R_32F;
				double t0 = 0, t, flop = 2.0 * R * M * K;
				for (int i = 0; i < iters + 3; i++) {
					if (i == 3) {
						cudaDeviceSynchronize();
						t0 = now();
					}
					if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, M, R, K, &alpha, w,
							 CUDA_R_16BF, K, xb, CUDA_R_16BF, K, &beta, out, ct,
							 M, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) !=
					    CUBLAS_STATUS_SUCCESS)
						FAIL("cublasGemmEx");
				}
				cudaDeviceSynchronize();
				t = (now() - t0) / iters;
				printf("%s\n    {\"rows\": %d, \"shape\": \"%s\", \"out\": \"%s\", \"us\": %.1f, "
				       "\"tflops\": %.1f}", first ? "" : ",", R, down ? "down" : "gate_up",
				       pass ? "bf16" : "fp32", t * 1e6, flop / t * 1e-12);
				first = 0;
				fprintf(stderr, "expert gemm %-7s rows=%5d out=%s: %7.1f us %6.1f TFLOP/s\n",
					down ? "down" : "gate_up", R, pass ? "bf16" : "fp32", t * 1e6,
					flop / t * 1e-12);
			}
	printf("\n  ]");
	return 0;
}

/* E experts of [I][H] gate, down and up of es bytes a value (bf16: 2),
 * each a copy of the device matrix proto: generating 2.8 GB of random
 * numbers on the host would take longer than the benchmark. -1 when an
 * allocation fails. */
static int copy_experts(void **w1, void **w2, void **w3, int E, const void *proto, int H, int I,
			size_t es)
{
	size_t bytes = (size_t)I * H * es;
	for (int e = 0; e < E; e++) {
		w1[e] = be.ops->alloc(be.ctx, bytes);
		w2[e] = be.ops->alloc(be.ctx, bytes);
		w3[e] = be.ops->alloc(be.ctx, bytes);
		if (!w1[e] || !w2[e] || !w3[e])
			return -1;
		cudaMemcpy(w1[e], proto, bytes, cudaMemcpyDeviceToDevice);
		cudaMemcpy(w2[e], proto, bytes, cudaMemcpyDeviceToDevice);
		cudaMemcpy(w3[e], proto, bytes, cudaMemcpyDeviceToDevice);
	}
	return 0;
}

/* The E experts' weight matrices of the MoE benches back to the backend. */
static void free_experts(void **w1, void **w2, void **w3, int E)
{
	for (int e = 0; e < E; e++) {
		be.ops->free(be.ctx, w1[e]);
		be.ops->free(be.ctx, w2[e]);
		be.ops->free(be.ctx, w3[e]);
	}
}

/* The experts' GEMMs of one MoE call (8 experts of Mixtral's sizes, rows
 * rows each, give or take 16 so that the experts' shapes differ as routed
 * ones do): gate and up then down, (a) expert by expert on one stream,
 * as the backend's loop does, (b) the experts split over two streams, (c)
 * two cublasGemmGroupedBatchedEx calls (gate and up of every expert, then
 * every down), (d) as (a) with each expert's gate and up in one
 * strided-batched call (slower: the backend keeps two
 * calls), (e) as (a) with gate and up one GEMM over a 2I x H matrix that
 * holds w1 and w3 adjacent (rows of [g | u]; slower than (a), so the
 * slots keep w1 and w3 apart). Outputs
 * bf16 throughout: the grouped
 * call has no fp32 output for bf16 inputs. Prints "moe_gemm" records; no
 * MoE routing or silu. */
static int bench_moe_gemm(int H, int I)
{
	enum { E = 8, iters = 10 };
	static const int Rs[] = { 512, 768, 1024 };
	static const char *const vjson[] = { "loop", "loop_2_streams", "grouped", "loop_batched_gate_up",
					     "loop_one_gemm_gate_up" };
	static const char *const vtext[] = { "loop", "loop 2 streams", "grouped", "loop gu batched",
					     "loop gu one gemm" };
	const float one = 1.0f, zero = 0.0f;
	void *w1[E], *w2[E], *w3[E], *w13[E], *x, *gi, *g, *u, *y, *gu;
	void **dptr;
	cublasHandle_t h[2];
	cudaStream_t st[2];
	int first = 1;

	for (int e = 0; e < E; e++) {
		w1[e] = dev_random((size_t)I * H, MLENS_DTYPE_BF16, 0.02f);
		w2[e] = be.ops->alloc(be.ctx, (size_t)I * H * 2);
		w3[e] = be.ops->alloc(be.ctx, (size_t)I * H * 2);
		if (!w1[e] || !w2[e] || !w3[e])
			FAIL("moe_gemm weights");
		cudaMemcpy(w2[e], w1[e], (size_t)I * H * 2, cudaMemcpyDeviceToDevice);
		cudaMemcpy(w3[e], w1[e], (size_t)I * H * 2, cudaMemcpyDeviceToDevice);
		/* gate and up adjacent: one 2I x H matrix */
		if (!(w13[e] = be.ops->alloc(be.ctx, (size_t)2 * I * H * 2)))
			FAIL("moe_gemm weights");
		cudaMemcpy(w13[e], w1[e], (size_t)I * H * 2, cudaMemcpyDeviceToDevice);
		cudaMemcpy((char *)w13[e] + (size_t)I * H * 2, w1[e], (size_t)I * H * 2,
			   cudaMemcpyDeviceToDevice);
	}
	x = dev_random((size_t)E * 1040 * H, MLENS_DTYPE_BF16, 1.0f);
	gi = dev_random((size_t)E * 1040 * I, MLENS_DTYPE_BF16, 1.0f);
	g = be.ops->alloc(be.ctx, (size_t)E * 1040 * I * 2);
	u = be.ops->alloc(be.ctx, (size_t)E * 1040 * I * 2);
	y = be.ops->alloc(be.ctx, (size_t)E * 1040 * H * 2);
	gu = be.ops->alloc(be.ctx, (size_t)E * 1040 * 2 * I * 2);
	dptr = be.ops->alloc(be.ctx, 48 * sizeof(void *));
	if (!x || !gi || !g || !u || !y || !gu || !dptr)
		FAIL("moe_gemm buffers");
	for (int i = 0; i < 2; i++)
		if (cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking) != cudaSuccess ||
		    cublasCreate(&h[i]) != CUBLAS_STATUS_SUCCESS ||
		    cublasSetStream(h[i], st[i]) != CUBLAS_STATUS_SUCCESS)
			FAIL("moe_gemm streams");
	printf(",\n  \"moe_gemm\": [");
	for (int a = 0; a < 3; a++) {
		int rows[E], off[E], total = 0;
		int gm[E], gn[E], gk[E], glda[E], gldb[E], gldc[E], gsz[E];
		int dm[E], dn[E], dk[E], dlda[E], dldb[E], dldc[E], dsz[E];
		cublasOperation_t ta[E], tb[E];
		float al[E], be0[E];
		const void *hp[48];
		double flop;
		for (int e = 0; e < E; e++) {
			rows[e] = Rs[a] + (e % 3 - 1) * 16;
			off[e] = total;
			total += rows[e];
			/* gate/up group e: two problems (w1, w3) of rows[e] rows */
			gm[e] = I, gn[e] = rows[e], gk[e] = H, glda[e] = H, gldb[e] = H, gldc[e] = I;
			gsz[e] = 2;
			dm[e] = H, dn[e] = rows[e], dk[e] = I, dlda[e] = I, dldb[e] = I, dldc[e] = H;
			dsz[e] = 1;
			ta[e] = CUBLAS_OP_T, tb[e] = CUBLAS_OP_N, al[e] = 1.0f, be0[e] = 0.0f;
			hp[2 * e] = w1[e];
			hp[2 * e + 1] = w3[e];
			hp[16 + 2 * e] = (const char *)x + (size_t)off[e] * H * 2;
			hp[16 + 2 * e + 1] = hp[16 + 2 * e];
			hp[32 + 2 * e] = (const char *)g + (size_t)off[e] * I * 2;
			hp[32 + 2 * e + 1] = (const char *)u + (size_t)off[e] * I * 2;
		}
		flop = 6.0 * H * I * total;
		for (int v = 0; v < 5; v++) {	/* vjson's variants */
			double t0 = 0, t;
			for (int it = 0; it < iters + 2; it++) {
				if (it == 2) {
					cudaDeviceSynchronize();
					t0 = now();
				}
				if (v == 2) {
					/* pointer tables: gate/up A, B, C, then down A, B, C */
					const void *dp[48];
					memcpy(dp, hp, sizeof(dp));
					if (cudaMemcpyAsync(dptr, dp, 48 * sizeof(void *), cudaMemcpyHostToDevice,
							    st[0]) != cudaSuccess)
						FAIL("moe_gemm pointer upload");
					if (cublasGemmGroupedBatchedEx(h[0], ta, tb, gm, gn, gk, al,
						(const void *const *)dptr, CUDA_R_16BF, glda,
						(const void *const *)(dptr + 16), CUDA_R_16BF, gldb, be0,
						dptr + 32, CUDA_R_16BF, gldc, E, gsz, CUBLAS_COMPUTE_32F) !=
					    CUBLAS_STATUS_SUCCESS)
						FAIL("cublasGemmGroupedBatchedEx gate/up");
					continue;
				}
				for (int e = 0; e < E; e++) {
					cublasHandle_t hh = h[v == 1 && e >= E / 2];
					const char *xe = (const char *)x + (size_t)off[e] * H * 2;
					char *ge = (char *)g + (size_t)off[e] * I * 2;
					char *ue = (char *)u + (size_t)off[e] * I * 2;
					bool bad;
					if (v == 3) {
						/* lower addresses first: positive strides */
						const char *a0 = w1[e] < w3[e] ? w1[e] : w3[e];
						const char *a1 = w1[e] < w3[e] ? w3[e] : w1[e];
						char *c0 = ge < ue ? ge : ue, *c1 = ge < ue ? ue : ge;
						bad = cublasGemmStridedBatchedEx(hh, CUBLAS_OP_T, CUBLAS_OP_N, I,
							rows[e], H, &one, a0, CUDA_R_16BF, H, (a1 - a0) / 2, xe,
							CUDA_R_16BF, H, 0, &zero, c0, CUDA_R_16BF, I,
							(c1 - c0) / 2, 2, CUBLAS_COMPUTE_32F,
							CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS;
					} else if (v == 4) {
						/* [g | u] per row from w1 and w3 as one matrix */
						bad = cublasGemmEx(hh, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, rows[e], H,
								   &one, w13[e], CUDA_R_16BF, H, xe, CUDA_R_16BF,
								   H, &zero, (char *)gu + (size_t)off[e] * 2 * I * 2,
								   CUDA_R_16BF, 2 * I, CUBLAS_COMPUTE_32F,
								   CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS;
					} else {
						bad = cublasGemmEx(hh, CUBLAS_OP_T, CUBLAS_OP_N, I, rows[e], H, &one,
								   w1[e], CUDA_R_16BF, H, xe, CUDA_R_16BF, H,
								   &zero, ge, CUDA_R_16BF, I, CUBLAS_COMPUTE_32F,
								   CUBLAS_GEMM_DEFAULT) ||
						      cublasGemmEx(hh, CUBLAS_OP_T, CUBLAS_OP_N, I, rows[e], H, &one,
								   w3[e], CUDA_R_16BF, H, xe, CUDA_R_16BF, H,
								   &zero, ue, CUDA_R_16BF, I, CUBLAS_COMPUTE_32F,
								   CUBLAS_GEMM_DEFAULT);
					}
					if (bad ||
					    cublasGemmEx(hh, CUBLAS_OP_T, CUBLAS_OP_N, H, rows[e], I, &one, w2[e],
							 CUDA_R_16BF, I, (const char *)gi + (size_t)off[e] * I * 2,
							 CUDA_R_16BF, I, &zero, (char *)y + (size_t)off[e] * H * 2,
							 CUDA_R_16BF, H, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT))
						FAIL("moe_gemm cublasGemmEx");
				}
			}
			if (v == 2) {
				/* the down products as a second grouped call, timed alone
				 * after the gate/up ones: A = w2, B = gi rows, C = y rows */
				double tg, t1;
				const void *dp[24];
				cudaDeviceSynchronize();
				tg = now() - t0;
				for (int e = 0; e < E; e++) {
					dp[e] = w2[e];
					dp[8 + e] = (const char *)gi + (size_t)off[e] * I * 2;
					dp[16 + e] = (char *)y + (size_t)off[e] * H * 2;
				}
				if (cudaMemcpy(dptr, dp, sizeof(dp), cudaMemcpyHostToDevice) != cudaSuccess)
					FAIL("moe_gemm pointer upload");
				t1 = now();
				for (int it = 0; it < iters; it++)
					if (cublasGemmGroupedBatchedEx(h[0], ta, tb, dm, dn, dk, al,
						(const void *const *)dptr, CUDA_R_16BF, dlda,
						(const void *const *)(dptr + 8), CUDA_R_16BF, dldb, be0,
						dptr + 16, CUDA_R_16BF, dldc, E, dsz, CUBLAS_COMPUTE_32F) !=
					    CUBLAS_STATUS_SUCCESS)
						FAIL("cublasGemmGroupedBatchedEx down");
				cudaDeviceSynchronize();
				t = (tg + now() - t1) / iters;
				fprintf(stderr, "moe gemm grouped rows~%4d: gate/up %.1f us, down %.1f us\n",
					Rs[a], tg / iters * 1e6, (now() - t1) / iters * 1e6);
			} else {
				cudaDeviceSynchronize();
				t = (now() - t0) / iters;
			}
			printf("%s\n    {\"rows_per_expert\": %d, \"experts\": %d, \"variant\": \"%s\", "
			       "\"us\": %.1f, \"tflops\": %.1f}", first ? "" : ",", Rs[a], E, vjson[v],
			       t * 1e6, flop / t * 1e-12);
			first = 0;
			fprintf(stderr, "moe gemm %-14s rows~%4d x %d experts: %8.1f us %6.1f TFLOP/s\n",
				vtext[v], Rs[a], E, t * 1e6, flop / t * 1e-12);
		}
	}
	printf("\n  ]");
	for (int i = 0; i < 2; i++) {
		cublasDestroy(h[i]);
		cudaStreamDestroy(st[i]);
	}
	free_experts(w1, w2, w3, E);
	for (int e = 0; e < E; e++)
		be.ops->free(be.ctx, w13[e]);
	be.ops->free(be.ctx, gu);
	be.ops->free(be.ctx, x);
	be.ops->free(be.ctx, gi);
	be.ops->free(be.ctx, g);
	be.ops->free(be.ctx, u);
	be.ops->free(be.ctx, y);
	be.ops->free(be.ctx, dptr);
	return 0;
}

/* n tokens' top-2 routes: two different experts of 8 at random, weights
 * 0.6 and 0.4. */
static void random_routes(int32_t *ids, float *wts, int n)
{
	for (int i = 0; i < n; i++) {
		int a = (int)((rnd() + 1.0f) * 4.0f) & 7, b;
		do
			b = (int)((rnd() + 1.0f) * 4.0f) & 7;
		while (b == a);
		ids[i * 2] = a;
		ids[i * 2 + 1] = b;
		wts[i * 2] = 0.6f;
		wts[i * 2 + 1] = 0.4f;
	}
}

/* The MoE op (8 experts, top-2, Mixtral sizes) on backends whose experts
 * spread over 1..MLENS_MOE_STREAMS_MAX streams, 12288 tokens called with
 * 1024 to 4096 tokens at a time (the pipeline calls it with its MoE chunk,
 * a group's tokens). */
static int bench_moe(const struct mlens_backend_opts *o)
{
	const int n = 12288, E = 8, k = 2, H = 4096, I = 14336, iters = 4;
	static const int calls[] = { 1024, 1536, 2048, 3072, 4096 };
	const int ncalls = (int)(sizeof(calls) / sizeof(calls[0]));
	void *w1[8], *w2[8], *w3[8];
	int32_t *ids = malloc((size_t)n * k * 4);
	float *wts = malloc((size_t)n * k * 4);
	struct mlens_moe_weights mw = { .n_experts = E, .hidden = H, .inter = I, .dtype = MLENS_DTYPE_BF16,
					.w1 = (const void *const *)w1, .w2 = (const void *const *)w2,
					.w3 = (const void *const *)w3 };
	void *proto = dev_random((size_t)I * H, MLENS_DTYPE_BF16, 0.02f);
	float *x = dev_random((size_t)n * H, MLENS_DTYPE_F32, 1.0f);
	float *out = dev_random((size_t)n * H, MLENS_DTYPE_F32, 1.0f);
	void *xb = dev_random((size_t)1024 * I, MLENS_DTYPE_BF16, 1.0f);
	void *gout = be.ops->alloc(be.ctx, (size_t)1024 * I * 4);
	int32_t *dids;
	float *dwts;
	double flop = 2.0 * n * k * 3.0 * H * I;
	cublasHandle_t h;
	int first = 1, rc;

	if (!ids || !wts || !proto || !x || !out || !xb || !gout ||
	    cublasCreate(&h) != CUBLAS_STATUS_SUCCESS)
		FAIL("moe set-up");
	if ((rc = bench_expert_gemm(h, proto, xb, gout, H, I)))
		return rc;
	cublasDestroy(h);
	if (copy_experts(w1, w2, w3, E, proto, H, I, 2))
		FAIL("moe weights");
	random_routes(ids, wts, n);
	dids = be.ops->alloc(be.ctx, (size_t)n * k * 4);
	dwts = be.ops->alloc(be.ctx, (size_t)n * k * 4);
	if (!dids || !dwts || be.ops->upload(be.ctx, dids, ids, (size_t)n * k * 4) ||
	    be.ops->upload(be.ctx, dwts, wts, (size_t)n * k * 4))
		FAIL("moe routing");
	cudaDeviceSynchronize();
	printf(",\n  \"moe\": [");
	for (int S = 1; S <= MLENS_MOE_STREAMS_MAX; S++) {
		/* a backend of its own; the buffers above are device memory of
		 * the same device, and every pass ends in a sync */
		struct mlens_backend_opts os = *o;
		struct mlens_backend b;
		os.moe_streams = S;
		if (mlens_backend_create(&b, "cuda", &os))
			FAIL("moe backend");
		for (int c = 0; c < ncalls; c++) {
			int per = calls[c];
			double t0, t;
			for (int t1 = 0; t1 < n; t1 += per)
				if (b.ops->moe(b.ctx, out + (size_t)t1 * H, x + (size_t)t1 * H, per,
					       dids + (size_t)t1 * k, dwts + (size_t)t1 * k, k, &mw))
					FAIL("moe");
			b.ops->sync(b.ctx);
			t0 = now();
			for (int i = 0; i < iters; i++)
				for (int t1 = 0; t1 < n; t1 += per)
					b.ops->moe(b.ctx, out + (size_t)t1 * H, x + (size_t)t1 * H, per,
						   dids + (size_t)t1 * k, dwts + (size_t)t1 * k, k, &mw);
			b.ops->sync(b.ctx);
			t = (now() - t0) / iters;
			printf("%s\n    {\"streams\": %d, \"tokens_per_call\": %d, \"tokens\": %d, "
			       "\"experts\": %d, \"top_k\": %d, \"hidden\": %d, \"inter\": %d, "
			       "\"ms\": %.3f, \"us_per_token\": %.4f, \"tflops\": %.1f}",
			       first ? "" : ",", S, per, n, E, k, H, I, t * 1e3, t * 1e6 / n,
			       flop / t * 1e-12);
			first = 0;
			fprintf(stderr, "moe bf16 %d tokens in calls of %4d, %d stream(s): %.3f ms, "
				"%.3f us/token, %.1f TFLOP/s\n", n, per, S, t * 1e3, t * 1e6 / n,
				flop / t * 1e-12);
		}
		mlens_backend_destroy(&b);
	}
	printf("\n  ]");
	free_experts(w1, w2, w3, E);
	be.ops->free(be.ctx, proto);
	be.ops->free(be.ctx, x);
	be.ops->free(be.ctx, xb);
	be.ops->free(be.ctx, gout);
	be.ops->free(be.ctx, out);
	be.ops->free(be.ctx, dids);
	be.ops->free(be.ctx, dwts);
	free(ids);
	free(wts);
	return 0;
}

/* Seconds one MoE call of n tokens takes on b: one call to warm up (its
 * status returned), then the mean of iters. */
static int time_moe(struct mlens_backend *b, float *out, const float *x, int n, const int32_t *ids,
		    const float *wts, int k, const struct mlens_moe_weights *mw, int iters, double *sec)
{
	double t0;
	int rc = b->ops->moe(b->ctx, out, x, n, ids, wts, k, mw);

	if (rc)
		return rc;
	b->ops->sync(b->ctx);
	t0 = now();
	for (int i = 0; i < iters; i++)
		b->ops->moe(b->ctx, out, x, n, ids, wts, k, mw);
	b->ops->sync(b->ctx);
	*sec = (now() - t0) / iters;
	return 0;
}

/* One MoE layer of Mixtral-8x7B (H 4096, I 14336, 8 experts, top-2) with
 * 1024, 8192 and 32768 tokens a call: bf16 experts, then fp8 experts
 * (e4m3 with a scale per output channel, a bf16 model) on the fp8 tensor
 * cores (fp8_gemm auto) and dequantized (fp8_gemm dequant); TFLOP/s of
 * the three expert GEMMs (2 x tokens x top-k x 3 x H x I). */
static int bench_moe_fp8(const struct mlens_backend_opts *o)
{
	const int E = 8, k = 2, H = 4096, I = 14336, nmax = 32768, iters = 3;
	static const int ns[] = { 1024, 8192, 32768 };
	static const struct {
		const char *name;
		enum mlens_dtype dt;
		enum mlens_fp8_gemm path;
	} runs[] = { { "bf16", MLENS_DTYPE_BF16, MLENS_FP8_GEMM_AUTO },
		     { "fp8 tensor cores", MLENS_DTYPE_E4M3, MLENS_FP8_GEMM_FP8 },
		     { "fp8 dequant", MLENS_DTYPE_E4M3, MLENS_FP8_GEMM_DEQUANT } };
	void *w1[8], *w2[8], *w3[8], *f1[8], *f2[8], *f3[8];
	const float *sc[8];
	int32_t *ids = malloc((size_t)nmax * k * 4);
	float *wts = malloc((size_t)nmax * k * 4);
	void *proto = dev_random((size_t)I * H, MLENS_DTYPE_BF16, 0.02f);
	void *proto8 = dev_random((size_t)I * H, MLENS_DTYPE_E4M3, 1.0f);
	float *scales = dev_random((size_t)I, MLENS_DTYPE_F32, 0.01f);
	float *x = dev_random((size_t)nmax * H, MLENS_DTYPE_F32, 1.0f);
	float *out = be.ops->alloc(be.ctx, (size_t)nmax * H * 4);
	int32_t *dids = be.ops->alloc(be.ctx, (size_t)nmax * k * 4);
	float *dwts = be.ops->alloc(be.ctx, (size_t)nmax * k * 4);
	int first = 1;

	if (!ids || !wts || !proto || !proto8 || !scales || !x || !out || !dids || !dwts ||
	    copy_experts(w1, w2, w3, E, proto, H, I, 2) || copy_experts(f1, f2, f3, E, proto8, H, I, 1))
		FAIL("moe-fp8 set-up");
	for (int e = 0; e < E; e++)
		sc[e] = scales;	/* I >= H values: gate's, up's and down's */
	random_routes(ids, wts, nmax);
	if (be.ops->upload(be.ctx, dids, ids, (size_t)nmax * k * 4) ||
	    be.ops->upload(be.ctx, dwts, wts, (size_t)nmax * k * 4))
		FAIL("moe-fp8 routing");
	cudaDeviceSynchronize();
	printf(",\n  \"moe_fp8\": [");
	for (size_t r = 0; r < sizeof(runs) / sizeof(runs[0]); r++) {
		bool fp8 = runs[r].dt == MLENS_DTYPE_E4M3;
		struct mlens_moe_weights mw = {
			.n_experts = E, .hidden = H, .inter = I, .dtype = runs[r].dt,
			.w1 = (const void *const *)(fp8 ? f1 : w1),
			.w2 = (const void *const *)(fp8 ? f2 : w2),
			.w3 = (const void *const *)(fp8 ? f3 : w3)
		};
		struct mlens_backend_opts os = *o;
		struct mlens_backend b;
		bool tc;
		if (fp8) {
			mw.model_dtype = MLENS_DTYPE_BF16;
			mw.scale = (struct mlens_wscale){ MLENS_WSCALE_CHANNEL, 0, 0 };
			mw.s1 = mw.s2 = mw.s3 = sc;
		}
		os.fp8_gemm = runs[r].path;
		if (mlens_backend_create(&b, "cuda", &os))
			FAIL("moe-fp8 backend");
		tc = b.ops->fp8_tc && b.ops->fp8_tc(b.ctx);
		for (size_t c = 0; c < sizeof(ns) / sizeof(ns[0]); c++) {
			int n = ns[c];
			double flop = 2.0 * n * k * 3.0 * H * I, t;
			if (time_moe(&b, out, x, n, dids, dwts, k, &mw, iters, &t))
				FAIL("moe-fp8");
			printf("%s\n    {\"experts\": \"%s\", \"tensor_cores\": %s, \"tokens\": %d, "
			       "\"hidden\": %d, \"inter\": %d, \"n_experts\": %d, \"top_k\": %d, "
			       "\"ms\": %.3f, \"tflops\": %.1f}",
			       first ? "" : ",", runs[r].name, fp8 && tc ? "true" : "false", n, H, I, E, k,
			       t * 1e3, flop / t * 1e-12);
			first = 0;
			fprintf(stderr, "moe %-16s %5d tokens%s: %8.3f ms, %6.1f TFLOP/s\n", runs[r].name,
				n, fp8 && !tc ? " (dequantized: no fp8 GEMM here)" : "", t * 1e3,
				flop / t * 1e-12);
		}
		mlens_backend_destroy(&b);
	}
	printf("\n  ]");
	free_experts(w1, w2, w3, E);
	free_experts(f1, f2, f3, E);
	void *bufs[] = { proto, proto8, scales, x, out, dids, dwts };
	for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
		be.ops->free(be.ctx, bufs[i]);
	free(ids);
	free(wts);
	return 0;
}

/* The MoE op with its experts' GEMMs grouped (opts moe_grouped on) and
 * per expert (off), at Qwen3-30B-A3B's sizes (128 experts of 2048 x 768,
 * top-8) and Mixtral's (8 of 4096 x 14336, top-2), 1k, 8k and 32k tokens
 * in one call (the backend takes them in chunks), and decode's 1 and 64,
 * routed uniformly at random. Prints "moe_grouped" records. */
static int bench_moe_grouped(const struct mlens_backend_opts *o)
{
	static const struct {
		const char *name;
		int H, I, E, k;
	} shapes[] = { { "qwen3-30b-a3b", 2048, 768, 128, 8 }, { "mixtral-8x7b", 4096, 14336, 8, 2 } };
	static const int tokens[] = { 1, 64, 1024, 8192, 32768 };
	static const enum mlens_moe_grouped modes[] = { MLENS_MOE_GROUPED_OFF, MLENS_MOE_GROUPED_ON };
	const int nmax = 32768;
	int first = 1;

	printf(",\n  \"moe_grouped\": [");
	for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
		const int H = shapes[si].H, I = shapes[si].I, E = shapes[si].E, k = shapes[si].k;
		void **w = calloc(3 * (size_t)E, sizeof(void *));
		int32_t *ids = malloc((size_t)nmax * k * 4);
		float *wts = malloc((size_t)nmax * k * 4);
		void *proto = dev_random((size_t)I * H, MLENS_DTYPE_BF16, 0.02f);
		float *x = dev_random((size_t)nmax * H, MLENS_DTYPE_F32, 1.0f);
		float *out = be.ops->alloc(be.ctx, (size_t)nmax * H * 4);
		int32_t *dids = be.ops->alloc(be.ctx, (size_t)nmax * k * 4);
		float *dwts = be.ops->alloc(be.ctx, (size_t)nmax * k * 4);
		struct mlens_moe_weights mw = { .n_experts = E, .hidden = H, .inter = I,
						.dtype = MLENS_DTYPE_BF16 };

		if (!w || !ids || !wts || !proto || !x || !out || !dids || !dwts ||
		    copy_experts(w, w + E, w + 2 * E, E, proto, H, I, 2))
			FAIL("moe_grouped set-up");
		mw.w1 = (const void *const *)w;
		mw.w2 = (const void *const *)(w + E);
		mw.w3 = (const void *const *)(w + 2 * E);
		for (int i = 0; i < nmax; i++)
			for (int s = 0; s < k; s++) {
				int e, dup;
				do {
					e = (int)((rnd() + 1.0f) * 0.5f * (float)E) % E;
					dup = 0;
					for (int j = 0; j < s; j++)
						dup |= ids[i * k + j] == e;
				} while (dup);
				ids[i * k + s] = e;
				wts[i * k + s] = 1.0f / (float)k;
			}
		if (be.ops->upload(be.ctx, dids, ids, (size_t)nmax * k * 4) ||
		    be.ops->upload(be.ctx, dwts, wts, (size_t)nmax * k * 4))
			FAIL("moe_grouped routing");
		cudaDeviceSynchronize();
		for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
			struct mlens_backend_opts om = *o;
			struct mlens_backend b;
			om.moe_grouped = modes[m];
			if (mlens_backend_create(&b, "cuda", &om))
				FAIL("moe_grouped backend");
			for (size_t ti = 0; ti < sizeof(tokens) / sizeof(tokens[0]); ti++) {
				int n = tokens[ti], iters = n < 1024 ? 50 : 3;
				double flop = 2.0 * n * k * 3.0 * H * I, t;
				if (time_moe(&b, out, x, n, dids, dwts, k, &mw, iters, &t))
					FAIL("moe_grouped moe");
				printf("%s\n    {\"shape\": \"%s\", \"experts\": %d, \"top_k\": %d, "
				       "\"hidden\": %d, \"inter\": %d, \"tokens\": %d, \"moe_grouped\": \"%s\", "
				       "\"ms\": %.3f, \"tflops\": %.1f}",
				       first ? "" : ",", shapes[si].name, E, k, H, I, n,
				       mlens_moe_grouped_name(modes[m]), t * 1e3, flop / t * 1e-12);
				first = 0;
				fprintf(stderr, "moe %-14s E=%3d k=%d %5d tokens, grouped %-3s: %9.3f ms "
					"%6.1f TFLOP/s\n", shapes[si].name, E, k, n,
					mlens_moe_grouped_name(modes[m]), t * 1e3, flop / t * 1e-12);
			}
			mlens_backend_destroy(&b);
		}
		free_experts(w, w + E, w + 2 * E, E);
		be.ops->free(be.ctx, proto);
		be.ops->free(be.ctx, x);
		be.ops->free(be.ctx, out);
		be.ops->free(be.ctx, dids);
		be.ops->free(be.ctx, dwts);
		free(w);
		free(ids);
		free(wts);
	}
	printf("\n  ]");
	return 0;
}

/* Mixtral attention: 32 query heads, 8 KV heads, head_dim 128. */
static int bench_attn(void)
{
	const int nh = 32, nkv = 8, hd = 128, T = 4096, bs = 16, nq = 64, ctx = 4096, iters = 5;
	size_t qn = (size_t)T * nh * hd, kn = (size_t)T * nkv * hd;
	float *q = dev_random(qn, MLENS_DTYPE_F32, 1.0f), *k = dev_random(kn, MLENS_DTYPE_F32, 1.0f);
	float *v = dev_random(kn, MLENS_DTYPE_F32, 1.0f);
	float *out = be.ops->alloc(be.ctx, qn * 4);
	int32_t cu[2] = { 0, T };
	uint32_t n_blocks = (uint32_t)(nq * ctx / bs);
	struct mlens_kv_cache kv = { MLENS_DTYPE_BF16, 1, nkv, hd, bs, n_blocks, NULL, NULL };
	struct mlens_attn_query *qs = malloc(nq * sizeof(*qs));
	uint32_t *tab = malloc((size_t)n_blocks * 4);
	double t0, t_pf, t_dec, flop_pf = 4.0 * nh * hd * ((double)T * (T + 1) / 2), kv_bytes;

	if (!q || !k || !v || !out || !qs || !tab)
		FAIL("attention set-up");
	kv.k = dev_random(mlens_kv_bytes(&kv) / 2, MLENS_DTYPE_BF16, 1.0f);
	kv.v = dev_random(mlens_kv_bytes(&kv) / 2, MLENS_DTYPE_BF16, 1.0f);
	if (!kv.k || !kv.v)
		FAIL("kv cache");
	be.ops->attn_prefill(be.ctx, out, q, k, v, cu, 1, nh, nkv, hd, 0.088f);
	be.ops->sync(be.ctx);
	t0 = now();
	for (int i = 0; i < iters; i++)
		be.ops->attn_prefill(be.ctx, out, q, k, v, cu, 1, nh, nkv, hd, 0.088f);
	be.ops->sync(be.ctx);
	t_pf = (now() - t0) / iters;

	/* the same tokens as 8 prompts of 512 */
	{
		int32_t cu8[9];
		double t_p8, flop8 = 8 * 4.0 * nh * hd * (512.0 * 513 / 2);
		for (int s = 0; s <= 8; s++)
			cu8[s] = s * 512;
		be.ops->attn_prefill(be.ctx, out, q, k, v, cu8, 8, nh, nkv, hd, 0.088f);
		be.ops->sync(be.ctx);
		t0 = now();
		for (int i = 0; i < iters; i++)
			be.ops->attn_prefill(be.ctx, out, q, k, v, cu8, 8, nh, nkv, hd, 0.088f);
		be.ops->sync(be.ctx);
		t_p8 = (now() - t0) / iters;
		printf(",\n  \"attn_prefill_8x512\": {\"ms\": %.3f, \"tflops\": %.2f}", t_p8 * 1e3,
		       flop8 / t_p8 * 1e-12);
		fprintf(stderr, "attn_prefill 8 x 512 tokens: %.3f ms, %.2f TFLOP/s\n", t_p8 * 1e3,
			flop8 / t_p8 * 1e-12);
	}
	for (uint32_t b = 0; b < n_blocks; b++)
		tab[b] = (b * 2654435761u) % n_blocks;	/* scattered, still a permutation */
	for (int i = 0; i < nq; i++)
		qs[i] = (struct mlens_attn_query){ ctx, ctx / bs, tab + (size_t)i * (ctx / bs) };
	be.ops->attn_decode(be.ctx, out, q, &kv, 0, qs, nq, nh, 0.088f);
	be.ops->sync(be.ctx);
	t0 = now();
	for (int i = 0; i < iters; i++)
		be.ops->attn_decode(be.ctx, out, q, &kv, 0, qs, nq, nh, 0.088f);
	be.ops->sync(be.ctx);
	t_dec = (now() - t0) / iters;
	kv_bytes = 2.0 * nq * ctx * nkv * hd * 2;
	printf(",\n  \"attn_prefill\": {\"tokens\": %d, \"heads\": %d, \"kv_heads\": %d, "
	       "\"head_dim\": %d, \"ms\": %.3f, \"tflops\": %.2f},\n"
	       "  \"attn_decode\": {\"queries\": %d, \"ctx\": %d, \"kv\": \"bf16\", \"ms\": %.3f, "
	       "\"kv_gbps\": %.1f}", T, nh, nkv, hd, t_pf * 1e3, flop_pf / t_pf * 1e-12, nq, ctx,
	       t_dec * 1e3, kv_bytes / t_dec * 1e-9);
	fprintf(stderr, "attn_prefill T=%d 32/8 heads hd=128 fp32: %.3f ms, %.2f TFLOP/s\n", T,
		t_pf * 1e3, flop_pf / t_pf * 1e-12);
	fprintf(stderr, "attn_decode %d queries ctx=%d bf16 KV: %.3f ms, %.1f GB/s of KV\n", nq,
		ctx, t_dec * 1e3, kv_bytes / t_dec * 1e-9);
	be.ops->free(be.ctx, q);
	be.ops->free(be.ctx, k);
	be.ops->free(be.ctx, v);
	be.ops->free(be.ctx, out);
	be.ops->free(be.ctx, kv.k);
	be.ops->free(be.ctx, kv.v);
	free(qs);
	free(tab);
	return 0;
}

/* The K/V append into a pool in registered host memory (the hybrid
 * pipeline's kv_append = gpu): Mixtral's 8 KV heads x 128 in bf16, n rows
 * of fp32 K and V on the device stored into blocks drawn at random from a
 * 2 x 2 GiB pool. GB/s of bytes stored: on the compute queue (a block a
 * row), then on the side queue (kv_append_side) at several block counts
 * (MLENS_CUDA_APPEND_BLOCKS, a backend each), alone and beside a run of
 * bf16 GEMMs (4096 x 4096 -> 14336) on queue 0 that takes about twice as
 * long: when the append is done (what the pipeline's host side waits
 * for), and how much longer the GEMMs took than alone; then again with
 * 256 MiB of H2D copies queued on queue 1 first (the weight stream). */
#define KVS_REPS 5
static double kvs_time(struct mlens_backend *b, int queue, struct mlens_kv_cache *kv, float *k,
		       float *v, const int64_t *slots, int n)
{
	double best = 1e30;
	for (int r = 0; r < KVS_REPS + 1; r++) {
		double t0 = now(), t;
		int rc = queue ? b->ops->kv_append_side(b->ctx, kv, 0, k, v, slots, n)
			       : b->ops->kv_append(b->ctx, kv, 0, k, v, slots, n);
		if (rc || b->ops->event_record(b->ctx, queue ? 2 : 0, 15) ||
		    b->ops->event_sync(b->ctx, 15))
			return -1;
		t = now() - t0;
		if (r && t < best)
			best = t;
	}
	return best;
}

#define KVS_M 4096
#define KVS_K 4096
#define KVS_N 14336
/* As the pipeline: a GEMM, queue 2 waits for an event after it and
 * stores, reps - 1 more GEMMs go on beside; seconds until the stores are
 * done (the GEMMs may still run). */
static double kvs_beside(struct mlens_backend *b, struct mlens_kv_cache *kv, float *k, float *v,
			 const int64_t *slots, int n, int reps, float *out, float *x, void *w)
{
	double t0 = now();
	b->ops->gemm(b->ctx, out, x, w, MLENS_DTYPE_BF16, KVS_M, KVS_K, KVS_N, false);
	b->ops->event_record(b->ctx, 0, 14);
	b->ops->event_wait(b->ctx, 2, 14);
	b->ops->kv_append_side(b->ctx, kv, 0, k, v, slots, n);
	b->ops->event_record(b->ctx, 2, 15);
	for (int i = 1; i < reps; i++)
		b->ops->gemm(b->ctx, out, x, w, MLENS_DTYPE_BF16, KVS_M, KVS_K, KVS_N, false);
	b->ops->event_sync(b->ctx, 15);
	return now() - t0;
}

static int bench_kv_store(const struct mlens_backend_opts *o)
{
	static const char *const blocks[] = { "65535", "132", "66", "33", "16", "8" };
	const int n = 16384, nkv = 8, hd = 128, bs = 16, M = KVS_M, K = KVS_K, N = KVS_N;
	struct mlens_kv_cache kv = { MLENS_DTYPE_BF16, 1, nkv, hd, bs, 65536, NULL, NULL };
	size_t pool = mlens_kv_bytes(&kv), row = (size_t)nkv * hd;
	double stored = (double)n * (double)row * 2 * 2, t;
	int64_t *slots = malloc((size_t)n * 8);
	uint32_t *perm = malloc((size_t)kv.n_blocks * 4);
	void *hbuf = be.ops->host_alloc(be.ctx, 64u << 20), *dbuf = be.ops->alloc(be.ctx, 64u << 20);
	const char *env0 = getenv("MLENS_CUDA_APPEND_BLOCKS");
	char *keep = env0 ? strdup(env0) : NULL;
	float *k = dev_random((size_t)n * row, MLENS_DTYPE_F32, 1.0f);
	float *v = dev_random((size_t)n * row, MLENS_DTYPE_F32, 1.0f);
	int rc = 0;

	kv.k = aligned_alloc(2u << 20, pool);
	kv.v = aligned_alloc(2u << 20, pool);
	if (!slots || !perm || !k || !v || !kv.k || !kv.v)
		FAIL("kv store set-up");
	memset(kv.k, 0, pool);
	memset(kv.v, 0, pool);
	if (be.ops->host_register(be.ctx, kv.k, pool) || be.ops->host_register(be.ctx, kv.v, pool))
		FAIL("registering the pool");
	for (uint32_t b = 0; b < kv.n_blocks; b++)
		perm[b] = b;
	for (uint32_t b = 0; b < (uint32_t)(n / bs); b++) {	/* a partial Fisher-Yates */
		uint32_t j, x = perm[b];
		rnd();
		j = b + (uint32_t)((rng >> 11) % (kv.n_blocks - b));
		perm[b] = perm[j];
		perm[j] = x;
	}
	for (int i = 0; i < n; i++)
		slots[i] = (int64_t)perm[i / bs] * bs + i % bs;
	if ((t = kvs_time(&be, 0, &kv, k, v, slots, n)) < 0)
		FAIL("kv_append");
	printf(",\n  \"kv_store\": {\"rows\": %d, \"bytes\": %.0f, \"compute_queue_gbs\": %.2f, "
	       "\"side\": [", n, stored, stored / t * 1e-9);
	fprintf(stderr, "kv store %d rows (%.1f MB, bf16 8x128): compute queue %.2f GB/s\n", n,
		stored / 1e6, stored / t * 1e-9);
	for (size_t c = 0; c < sizeof(blocks) / sizeof(blocks[0]) && !rc; c++) {
		struct mlens_backend b;
		void *w = NULL;
		float *x = NULL, *out = NULL;
		double t_side, t_g1, t_g, t_app, t_both, t_stream = 0, t0;
		int reps;
		setenv("MLENS_CUDA_APPEND_BLOCKS", blocks[c], 1);
		if (mlens_backend_create(&b, "cuda", o)) {
			rc = 1;
			break;
		}
		w = b.ops->alloc(b.ctx, (size_t)N * K * 2);
		x = b.ops->alloc(b.ctx, (size_t)M * K * 4);
		out = b.ops->alloc(b.ctx, (size_t)M * N * 4);
		/* the pool is registered with the context already (-EEXIST) */
		b.ops->host_register(b.ctx, kv.k, pool);
		b.ops->host_register(b.ctx, kv.v, pool);
		/* k and v are be's, done (synchronised) before this backend's
		 * queues start: one device, one context */
		if (!w || !x || !out || (t_side = kvs_time(&b, 2, &kv, k, v, slots, n)) < 0) {
			rc = 1;
		} else {
			b.ops->gemm(b.ctx, out, x, w, MLENS_DTYPE_BF16, M, K, N, false);
			b.ops->sync(b.ctx);
			t0 = now();
			for (int i = 0; i < 5; i++)
				b.ops->gemm(b.ctx, out, x, w, MLENS_DTYPE_BF16, M, K, N, false);
			b.ops->sync(b.ctx);
			t_g1 = (now() - t0) / 5;
			reps = (int)(2 * t_side / t_g1) + 1;
			t0 = now();
			for (int i = 0; i < reps; i++)
				b.ops->gemm(b.ctx, out, x, w, MLENS_DTYPE_BF16, M, K, N, false);
			b.ops->sync(b.ctx);
			t_g = now() - t0;
			t0 = now();
			t_app = kvs_beside(&b, &kv, k, v, slots, n, reps, out, x, w);
			b.ops->sync(b.ctx);
			t_both = now() - t0;
			/* and with the weight stream's H2D copies queued on queue
			 * 1 first (4 x 64 MiB): what the pipeline runs beside */
			if (hbuf && dbuf) {
				for (int i = 0; i < 4; i++)
					b.ops->copy_async(b.ctx, 1, dbuf, hbuf, 64u << 20, true);
				t_stream = kvs_beside(&b, &kv, k, v, slots, n, reps, out, x, w);
				b.ops->event_record(b.ctx, 1, 13);
				b.ops->event_sync(b.ctx, 13);
				b.ops->sync(b.ctx);
			}
			printf("%s\n    {\"blocks\": %s, \"alone_gbs\": %.2f, \"gemms\": %d, "
			       "\"gemms_alone_ms\": %.3f, \"with_gemms_done_ms\": %.3f, "
			       "\"gemms_with_append_ms\": %.3f, \"gemm_slowdown\": %.3f, "
			       "\"with_gemms_and_h2d_done_ms\": %.3f}",
			       c ? "," : "", blocks[c], stored / t_side * 1e-9, reps, t_g * 1e3,
			       t_app * 1e3, t_both * 1e3, t_both / t_g, t_stream * 1e3);
			fprintf(stderr, "  side, %5s blocks: alone %6.2f GB/s (%.2f ms); beside %d GEMMs "
				"(%.2f ms alone): stores done at %.2f ms (%.2f GB/s), GEMMs %.2f ms (x%.3f); "
				"with 256 MiB of H2D queued too: done at %.2f ms\n",
				blocks[c], stored / t_side * 1e-9, t_side * 1e3, reps, t_g * 1e3,
				t_app * 1e3, stored / t_app * 1e-9, t_both * 1e3, t_both / t_g,
				t_stream * 1e3);
		}
		if (w)
			b.ops->free(b.ctx, w);
		if (x)
			b.ops->free(b.ctx, x);
		if (out)
			b.ops->free(b.ctx, out);
		mlens_backend_destroy(&b);
	}
	printf("\n  ]}");
	if (keep)
		setenv("MLENS_CUDA_APPEND_BLOCKS", keep, 1);
	else
		unsetenv("MLENS_CUDA_APPEND_BLOCKS");
	free(keep);
	be.ops->host_unregister(be.ctx, kv.k);
	be.ops->host_unregister(be.ctx, kv.v);
	free(kv.k);
	free(kv.v);
	free(slots);
	free(perm);
	if (hbuf)
		be.ops->host_free(be.ctx, hbuf);
	if (dbuf)
		be.ops->free(be.ctx, dbuf);
	be.ops->free(be.ctx, k);
	be.ops->free(be.ctx, v);
	if (rc)
		fprintf(stderr, "bench_cuda: the side append bench failed\n");
	return rc;
}

/* ==== one token group's GA and GB ====
 * The GPU work of one (layer, group) item of the hybrid pipeline
 * (daemon/exec/pipeline.c stage_ga and stage_gb, fast GEMMs, bf16 weights,
 * attn_up = half) at Mixtral-8x7B sizes, op by op on a backend made as
 * mlensd makes it (bf16 prefill attention, its MoE streams), back to back
 * on the compute queue with a timer mark between ops: each op's span is
 * the queue's time from its mark to the next, including any wait the op
 * itself makes (the MoE reads its expert counts back). Median of 15
 * passes after 3, every pass from the same hidden states (uploaded again
 * before it, outside the marks: the router's choices, and so the experts'
 * row counts, stay those of random rows). Two groups: p=512/g=32's (5
 * prompts of 512 and 150 decode rows) and p=128/g=32's (19 prompts of 128
 * and 600 decode rows), then the first again (a first-shape cost shows as
 * a difference between its two runs), each against the GEMM work it must
 * do at the GEMM rate bench_gemm measured. Then the p=512/g=32 group with
 * what runs beside it in the pipeline: its K/V stored into a registered
 * host pool on queue 2 after GA's rope (kv_append = gpu, the default),
 * and that with 256 MiB of weight-stream copies on queue 1 as well: how
 * much longer GB's ops take beside them (in the pipeline a group's GA and
 * GB take longer than these ops alone). Neither does much: the pipeline's
 * extra time is the clock: passes here have the GPU idle between them, at
 * its burst clock, while the pipeline keeps it at its power cap (the held
 * GEMM rate of mlens-bench serve's ceilings says the same; numbers in
 * tests/bench/RESULTS.md). */
enum { G_OPS = 11, G_WARM = 3, G_ITERS = 15 };
static const char *const g_op_name[G_OPS] = {
	"GA rmsnorm", "GA qkv gemm_multi", "GA rope q", "GA rope k", "GA attn_prefill",
	"GA round att", "GB o gemm_half_in", "GB rmsnorm", "GB router gemm", "GB router top-k",
	"GB moe"
};

static int cmp_dbl(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static int bench_group(const struct mlens_backend_opts *o)
{
	const int H = 4096, nh = 32, nkv = 8, hd = 128, qd = nh * hd, kvd = nkv * hd;
	const int I = 14336, E = 8, K = 2;
	const float eps = 1e-5f, theta = 1e6f;
	/* beside: 1 the K/V store on queue 2, 2 and the weight stream on queue 1 */
	static const struct { const char *name; int n_pre, p, decode, beside; } shapes[] = {
		{ "p512g32", 5, 512, 150, 0 }, { "p128g32", 19, 128, 600, 0 },
		{ "p512g32 again", 5, 512, 150, 0 }, { "p512g32 + K/V store", 5, 512, 150, 1 },
		{ "p512g32 + K/V store + stream", 5, 512, 150, 2 }
	};
	const size_t stream_bytes = (size_t)256 << 20;
	struct mlens_kv_cache kv = { MLENS_DTYPE_BF16, 1, nkv, hd, 16, 4096, NULL, NULL };
	void *hbuf = NULL, *dbuf = NULL;
	bool beside_ok;
	struct mlens_backend_opts go = *o;
	struct mlens_backend b;
	void *w1[8], *w2[8], *w3[8];
	struct mlens_moe_weights mw = { .n_experts = E, .hidden = H, .inter = I, .dtype = MLENS_DTYPE_BF16,
					.w1 = (const void *const *)w1, .w2 = (const void *const *)w2,
					.w3 = (const void *const *)w3 };
	int first = 1, rc = 0;

	go.prefill_bf16 = true;	/* mlensd's default (gpu_prefill_attention) */
	if (mlens_backend_create(&b, "cuda", &go))
		FAIL("group backend");
	if (!b.ops->timer_mark || !b.ops->timer_read || !b.ops->gemm_half_in || !b.ops->round) {
		mlens_backend_destroy(&b);
		FAIL("group: the backend's timer marks, gemm_half_in or round");
	}
	{
		void *proto = dev_random((size_t)I * H, MLENS_DTYPE_BF16, 0.02f);
		if (!proto || copy_experts(w1, w2, w3, E, proto, H, I, 2))
			FAIL("group expert weights");
		be.ops->free(be.ctx, proto);
	}
	/* what runs beside: a registered pool of 4096 blocks (65,536 tokens
	 * of one layer) and a pinned source for the stream's copies */
	beside_ok = MLENS_BACKEND_HAS(b.ops, kv_append_side) && MLENS_BACKEND_HAS(b.ops, host_alloc) &&
		    MLENS_BACKEND_HAS(b.ops, copy_async) && MLENS_BACKEND_HAS(b.ops, event_sync) &&
		    MLENS_BACKEND_HAS(b.ops, event_wait) && MLENS_BACKEND_HAS(b.ops, host_register);
	if (beside_ok) {
		size_t pool = mlens_kv_bytes(&kv);
		kv.k = aligned_alloc(2u << 20, pool);
		kv.v = aligned_alloc(2u << 20, pool);
		hbuf = b.ops->host_alloc(b.ctx, stream_bytes);
		dbuf = b.ops->alloc(b.ctx, stream_bytes);
		beside_ok = kv.k && kv.v && hbuf && dbuf;
		if (beside_ok) {
			memset(kv.k, 0, pool);
			memset(kv.v, 0, pool);
			memset(hbuf, 0, stream_bytes);
			beside_ok = !b.ops->host_register(b.ctx, kv.k, pool) &&
				    !b.ops->host_register(b.ctx, kv.v, pool);
		}
		if (!beside_ok)
			fprintf(stderr, "bench_cuda: group: no pool or stream buffers; the runs beside "
				"are left out\n");
	}
	printf(",\n  \"group\": [");
	for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]) && !rc; si++) {
		const int n_pre = shapes[si].n_pre, P = n_pre * shapes[si].p;
		const int n = P + shapes[si].decode, beside = shapes[si].beside;
		if (beside && !beside_ok)
			continue;
		int32_t *pos = malloc((size_t)n * 4), *cu = malloc((size_t)(n_pre + 1) * 4);
		int64_t *slots = malloc((size_t)n * 8);
		void *anorm = dev_random((size_t)H, MLENS_DTYPE_BF16, 1.0f);
		void *fnorm = dev_random((size_t)H, MLENS_DTYPE_BF16, 1.0f);
		void *wq = dev_random((size_t)qd * H, MLENS_DTYPE_BF16, 0.02f);
		void *wk = dev_random((size_t)kvd * H, MLENS_DTYPE_BF16, 0.02f);
		void *wv = dev_random((size_t)kvd * H, MLENS_DTYPE_BF16, 0.02f);
		void *wo = dev_random((size_t)H * qd, MLENS_DTYPE_BF16, 0.02f);
		void *wr = dev_random((size_t)E * H, MLENS_DTYPE_BF16, 0.05f);
		float *x = be.ops->alloc(be.ctx, (size_t)n * H * 4), *hx = malloc((size_t)n * H * 4);
		float *xn = be.ops->alloc(be.ctx, (size_t)n * H * 4);
		float *q = be.ops->alloc(be.ctx, (size_t)n * qd * 4);
		float *k = be.ops->alloc(be.ctx, (size_t)n * kvd * 4);
		float *v = be.ops->alloc(be.ctx, (size_t)n * kvd * 4);
		float *pout = be.ops->alloc(be.ctx, (size_t)P * qd * 4);
		void *att = dev_random((size_t)n * qd, MLENS_DTYPE_BF16, 1.0f);
		float *rlog = be.ops->alloc(be.ctx, (size_t)n * E * 4);
		int32_t *rid = be.ops->alloc(be.ctx, (size_t)n * K * 4);
		float *rw = be.ops->alloc(be.ctx, (size_t)n * K * 4);
		double t[G_OPS + 1][G_ITERS], med[G_OPS + 1], ga = 0, gb = 0;
		double gemm_flop = 2.0 * n * H * (qd + 2.0 * kvd) + 2.0 * n * qd * H +
				   2.0 * n * K * 3.0 * H * I;

		for (size_t i = 0; hx && i < (size_t)n * H; i++)
			hx[i] = rnd();
		/* the rows' slots: blocks of the pool in a scattered order */
		for (int r = 0; slots && r < n; r++)
			slots[r] = (int64_t)((uint32_t)(r / 16) * 2654435761u % kv.n_blocks) * 16 + r % 16;
		if (!pos || !cu || !slots || !anorm || !fnorm || !wq || !wk || !wv || !wo || !wr || !x || !hx || !xn ||
		    !q || !k || !v || !pout || !att || !rlog || !rid || !rw) {
			fprintf(stderr, "bench_cuda: group %s: set-up failed\n", shapes[si].name);
			rc = 1;
		}
		for (int s = 0; !rc && s < n_pre; s++) {
			cu[s] = s * shapes[si].p;
			for (int j = 0; j < shapes[si].p; j++)
				pos[s * shapes[si].p + j] = j;
		}
		cu[n_pre] = P;
		for (int r = P; !rc && r < n; r++)
			pos[r] = shapes[si].p + (r % 32);
		for (int it = 0; !rc && it < G_WARM + G_ITERS; it++) {
			float *const qkv[3] = { q, k, v };
			const void *const wqkv[3] = { wq, wk, wv };
			const int mqkv[3] = { qd, kvd, kvd };
			int op = 0;
			/* x takes the O projection and the MoE each pass: the
			 * same rows again before the next */
			rc = b.ops->upload(b.ctx, x, hx, (size_t)n * H * 4);
			if (!rc && beside == 2)
				rc = b.ops->copy_async(b.ctx, 1, dbuf, hbuf, stream_bytes, true);
#define G_MARK() (rc = rc ? rc : b.ops->timer_mark(b.ctx, 0, op++))
			G_MARK();
			rc = rc ? rc : b.ops->rmsnorm(b.ctx, xn, x, anorm, MLENS_DTYPE_BF16, n, H, eps);
			G_MARK();
			rc = rc ? rc : mlens_backend_gemm_multi(b.ops, b.ctx, qkv, xn, wqkv,
								 MLENS_DTYPE_BF16, n, H, mqkv, 3);
			G_MARK();
			rc = rc ? rc : b.ops->rope(b.ctx, q, pos, n, nh, hd, theta);
			G_MARK();
			rc = rc ? rc : b.ops->rope(b.ctx, k, pos, n, nkv, hd, theta);
			if (beside) {	/* as the pipeline: the store waits for GA's K */
				rc = rc ? rc : b.ops->event_record(b.ctx, 0, 14);
				rc = rc ? rc : b.ops->event_wait(b.ctx, 2, 14);
				rc = rc ? rc : b.ops->kv_append_side(b.ctx, &kv, 0, k, v, slots, n);
			}
			G_MARK();
			rc = rc ? rc : b.ops->attn_prefill(b.ctx, pout, q, k, v, cu, n_pre, nh, nkv, hd,
							   1.0f / sqrtf((float)hd));
			G_MARK();
			rc = rc ? rc : b.ops->round(b.ctx, att, MLENS_DTYPE_BF16, pout, P, qd);
			G_MARK();
			rc = rc ? rc : b.ops->gemm_half_in(b.ctx, x, att, wo, MLENS_DTYPE_BF16, n, qd, H, true);
			G_MARK();
			rc = rc ? rc : b.ops->rmsnorm(b.ctx, xn, x, fnorm, MLENS_DTYPE_BF16, n, H, eps);
			G_MARK();
			rc = rc ? rc : b.ops->gemm(b.ctx, rlog, xn, wr, MLENS_DTYPE_BF16, n, H, E, false);
			G_MARK();
			rc = rc ? rc : b.ops->router(b.ctx, rid, rw, rlog, n, E, K, true);
			G_MARK();
			rc = rc ? rc : b.ops->moe(b.ctx, x, xn, n, rid, rw, K, &mw);
			G_MARK();
#undef G_MARK
			rc = rc ? rc : b.ops->sync(b.ctx);
			if (!rc && beside == 2)	/* the stream's copies too */
				rc = b.ops->event_record(b.ctx, 1, 13) ? -EIO : b.ops->event_sync(b.ctx, 13);
			/* each op's span, and the pass's (their sum) */
			for (int m = 0; !rc && it >= G_WARM && m < G_OPS; m++) {
				double a, z;
				if ((rc = b.ops->timer_read(b.ctx, m, &a)) ||
				    (rc = b.ops->timer_read(b.ctx, m + 1, &z)))
					break;
				t[m][it - G_WARM] = z - a;
				t[G_OPS][it - G_WARM] = (m ? t[G_OPS][it - G_WARM] : 0) + z - a;
			}
		}
		if (rc) {
			fprintf(stderr, "bench_cuda: group %s: an op failed (%d)\n", shapes[si].name, rc);
		} else {
			for (int m = 0; m <= G_OPS; m++) {
				qsort(t[m], G_ITERS, sizeof(double), cmp_dbl);
				med[m] = t[m][G_ITERS / 2];
			}
			for (int m = 0; m < G_OPS; m++)
				*(m < 6 ? &ga : &gb) += med[m];
			printf("%s\n    {\"shape\": \"%s\", \"rows\": %d, \"prefill_rows\": %d, "
			       "\"prefill_seqs\": %d, \"ops\": {", first ? "" : ",", shapes[si].name, n, P,
			       n_pre);
			for (int m = 0; m < G_OPS; m++)
				printf("%s\"%s\": %.4f", m ? ", " : "", g_op_name[m], med[m] * 1e3);
			printf("}, \"ga_ms\": %.4f, \"gb_ms\": %.4f, \"total_ms\": %.4f, \"gemm_tflop\": %.4f, "
			       "\"gemm_tflops_equiv\": %.1f}", ga * 1e3, gb * 1e3, med[G_OPS] * 1e3,
			       gemm_flop * 1e-12, gemm_flop / med[G_OPS] * 1e-12);
			first = 0;
			fprintf(stderr, "group %s: %d rows (%d prefill in %d prompts): GA %.3f ms, GB %.3f ms, "
				"all %.3f ms (%.1f TFLOP/s of GEMM work)\n", shapes[si].name, n, P, n_pre,
				ga * 1e3, gb * 1e3, med[G_OPS] * 1e3, gemm_flop / med[G_OPS] * 1e-12);
			for (int m = 0; m < G_OPS; m++)
				fprintf(stderr, "  %-20s %8.4f ms\n", g_op_name[m], med[m] * 1e3);
		}
		free(pos);
		free(cu);
		free(hx);
		free(slots);
		void *bufs[] = { anorm, fnorm, wq, wk, wv, wo, wr, x, xn, q, k, v, pout, att, rlog, rid, rw };
		for (size_t j = 0; j < sizeof(bufs) / sizeof(bufs[0]); j++)
			if (bufs[j])
				be.ops->free(be.ctx, bufs[j]);
	}
	printf("\n  ]");
	free_experts(w1, w2, w3, E);
	if (dbuf)
		b.ops->free(b.ctx, dbuf);
	if (hbuf)
		b.ops->host_free(b.ctx, hbuf);
	if (beside_ok) {
		b.ops->host_unregister(b.ctx, kv.k);
		b.ops->host_unregister(b.ctx, kv.v);
	}
	mlens_backend_destroy(&b);
	free(kv.k);
	free(kv.v);
	return rc;
}

int main(int argc, char **argv)
{
	struct mlens_backend_opts o = { .n_threads = 0, .device = 0 };
	struct cudaDeviceProp prop;
	bool only_kv_store = false, only_moe_gemm = false, only_group = false, only_moe_fp8 = false;
	bool only_moe_grouped = false;
	int rc;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "kv-store"))
			only_kv_store = true;
		else if (!strcmp(argv[i], "moe-gemm"))
			only_moe_gemm = true;
		else if (!strcmp(argv[i], "group"))
			only_group = true;
		else if (!strcmp(argv[i], "moe-fp8"))
			only_moe_fp8 = true;
		else if (!strcmp(argv[i], "moe-grouped"))
			only_moe_grouped = true;
		else if (mlens_gemm_mode_parse(argv[i], &o.gemm)) {
			fprintf(stderr, "usage: bench_cuda [fast|exact] "
				"[kv-store|moe-gemm|moe-fp8|moe-grouped|group]  "
				"(the GEMM mode, default fast; kv-store: only the K/V append into host "
				"memory; moe-gemm: only the experts' GEMMs, looped and grouped; moe-fp8: "
				"only one MoE layer with bf16 and fp8 experts; moe-grouped: only the MoE "
				"op, grouped and per expert, Qwen3-30B-A3B and Mixtral sizes; group: only "
				"a token group's GA and GB op by op)\n");
			return 2;
		}
	}

	if (!mlens_cuda_available()) {
		fprintf(stderr, "bench_cuda: no CUDA GPU here\n");
		return 77;
	}
	if ((rc = mlens_backend_create(&be, "cuda", &o))) {
		fprintf(stderr, "bench_cuda: cannot create the CUDA backend: %s\n", strerror(-rc));
		return 1;
	}
	cudaGetDeviceProperties(&prop, 0);
	printf("{\n  \"device\": \"%s\",\n  \"gemm_mode\": \"%s\"", prop.name,
	       mlens_gemm_mode_name(o.gemm));
	if (only_moe_gemm) {
		rc = bench_moe_gemm(4096, 14336);
		goto out_json;
	}
	if (only_group) {
		rc = bench_group(&o);
		goto out_json;
	}
	if (only_moe_fp8) {
		rc = bench_moe_fp8(&o);
		goto out_json;
	}
	if (only_moe_grouped) {
		rc = bench_moe_grouped(&o);
		goto out_json;
	}
	if (!only_kv_store) {
		printf(",\n  \"gemm\": [");
		if ((rc = bench_gemm(1)))
			goto out;
		printf("\n  ]");
		if ((rc = bench_moe(&o)) || (rc = bench_moe_gemm(4096, 14336)) || (rc = bench_attn()) ||
		    (rc = bench_group(&o)))
			goto out;
	}
	if ((rc = bench_kv_store(&o)))
		goto out;
out_json:
	if (rc)
		goto out;
	printf(",\n  \"device_bytes_in_use_at_end\": %zu\n}\n", mlens_backend_cuda_mem_used(&be));
out:
	mlens_backend_destroy(&be);
	return rc;
}
