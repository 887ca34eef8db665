/* Description: every op of the CUDA backend against the CPU backend (the
 * oracle) on random inputs of many shapes. Prints a table of the worst
 * relative error per op (max |cuda - cpu| / max |cpu|) and asserts the
 * tolerance stated beside each op. Exits 77 without a GPU.
 *
 * Tolerances: fp32 paths differ only in summation order and libm ulps
 * (1e-5); bf16/fp16 weights round the activations to the weight dtype
 * before the tensor-core GEMM (kernels/cuda/backend_cuda.cu), which costs
 * about 2^-9 (bf16) or 2^-12 (fp16) per element: 1e-2 and 2e-3. Exact
 * GEMMs (MLENS_GEMM_EXACT, a second backend) split the activations instead
 * and must meet the fp32 tolerance for every weight dtype. Integer
 * results (expert ids, tokens) and stored KV must be identical. Prefill
 * attention on tensor cores (opts prefill_bf16, a backend of its own)
 * rounds q, k, v and the softmax weights to bf16: 2e-2, and it must differ
 * from the fp32 result (else the fp32 kernel ran).
 * LayerNorm as RMSNorm (1e-5: a second reduction); the clamp identical.
 * The MoE runs its experts on 1, 2 and 4 streams (three of the backends)
 * and, with fast GEMMs on 16-bit weights, keeps gate and up in the weight
 * dtype (mlens_moe_half_gu): one more rounding of 2^-9 or 2^-12, inside
 * the same tolerances. Many experts (64, top-8) go through grouped GEMMs
 * (opts moe_grouped: auto from MLENS_MOE_GROUPED_MIN_EXPERTS experts with rows, on in gpu_grp, off in
 * gpu_sm), which round each expert's down output to the weight dtype
 * too: the same tolerances, and with one expert a token and weight 1 every
 * output is a value of that dtype exactly when the grouped path ran.
 * Timing marks read on the host's CLOCK_MONOTONIC timeline. The second
 * copy queue (queue 2) copies after the event it waits for. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kernels/backend.h"
#include "tests/gpulock.h"

static struct mlens_backend cpu, gpu, gpu_exact, gpu_sm, gpu_tc, gpu_grp;
/* the CUDA backend under test: gpu (fast GEMMs), gpu_exact, gpu_sm or
 * gpu_tc (every buffer of a test is allocated, filled and read back on it:
 * backends do not order their streams against each other) */
static struct mlens_backend *dev = &gpu;

/* ==== helpers ==== */

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd_u32(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (uint32_t)(rng >> 16);
}

/* uniform in [-1, 1) */
static float rnd(void)
{
	return (float)((double)rnd_u32() / 2147483648.0 - 1.0);
}

static float *rnd_floats(size_t n, float scale)
{
	float *p = malloc(n * sizeof(float));
	ck_assert_ptr_nonnull(p);
	for (size_t i = 0; i < n; i++)
		p[i] = rnd() * scale;
	return p;
}

/* n random values stored as dtype dt */
static void *rnd_weights(size_t n, enum mlens_dtype dt, float scale)
{
	void *p = malloc(n * mlens_dtype_size(dt));
	ck_assert_ptr_nonnull(p);
	for (size_t i = 0; i < n; i++)
		mlens_store(p, dt, i, rnd() * scale);
	return p;
}

static void *to_gpu(const void *h, size_t bytes)
{
	void *d = dev->ops->alloc(dev->ctx, bytes);
	ck_assert_ptr_nonnull(d);
	ck_assert_int_eq(dev->ops->upload(dev->ctx, d, h, bytes), 0);
	return d;
}

static void *gpu_zeros(size_t bytes)
{
	void *z = calloc(1, bytes ? bytes : 1);
	void *d;
	ck_assert_ptr_nonnull(z);
	d = to_gpu(z, bytes);
	free(z);
	return d;
}

/* A KV cache in host memory (kc, zeroed) and the same layout on the GPU
 * (kg, zeroed); the bytes of each of K and V. */
static size_t kv_pair(struct mlens_kv_cache *kc, struct mlens_kv_cache *kg)
{
	size_t b = mlens_kv_bytes(kc);
	kc->k = calloc(1, b);
	kc->v = calloc(1, b);
	*kg = *kc;
	kg->k = gpu_zeros(b);
	kg->v = gpu_zeros(b);
	return b;
}

static void *from_gpu(const void *d, size_t bytes)
{
	void *h = malloc(bytes ? bytes : 1);
	ck_assert_ptr_nonnull(h);
	ck_assert_int_eq(dev->ops->download(dev->ctx, h, d, bytes), 0);
	return h;
}

static void gfree(void *d)
{
	dev->ops->free(dev->ctx, d);
}

static double rel_err(const float *ref, const float *got, size_t n)
{
	double md = 0.0, mr = 0.0;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)ref[i] - (double)got[i]);
		if (isnan(got[i]) != isnan(ref[i]))
			return INFINITY;
		md = d > md ? d : md;
		mr = fabs(ref[i]) > mr ? fabs(ref[i]) : mr;
	}
	return mr > 0.0 ? md / mr : md;
}

/* The per-op table: worst error seen for each (op, tolerance) row. */
struct err_row {
	char op[64];
	int cases;
	double worst;
	double tol;
	char worst_shape[80];
};
static struct err_row table[64];
static int n_rows;

static void record(const char *op, double tol, double err, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static void record(const char *op, double tol, double err, const char *fmt, ...)
{
	struct err_row *r = NULL;
	char shape[80];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(shape, sizeof(shape), fmt, ap);
	va_end(ap);
	for (int i = 0; i < n_rows; i++)
		if (!strcmp(table[i].op, op))
			r = &table[i];
	if (!r && n_rows < (int)(sizeof(table) / sizeof(table[0]))) {
		r = &table[n_rows++];
		snprintf(r->op, sizeof(r->op), "%s", op);
		r->tol = tol;
		r->worst = -1.0;
	}
	if (r) {
		r->cases++;
		if (err > r->worst || isnan(err)) {
			r->worst = err;
			snprintf(r->worst_shape, sizeof(r->worst_shape), "%s", shape);
		}
	}
	ck_assert_msg(err <= tol, "%s %s: relative error %.3g above tolerance %.3g", op, shape,
		      err, tol);
}

static const enum mlens_dtype dtypes[3] = { MLENS_DTYPE_F32, MLENS_DTYPE_F16, MLENS_DTYPE_BF16 };

/* GEMM-bound ops' tolerance by weight dtype */
static double wtol(enum mlens_dtype dt)
{
	if (dev == &gpu_exact)
		return 1e-5;
	return dt == MLENS_DTYPE_F32 ? 1e-5 : dt == MLENS_DTYPE_F16 ? 2e-3 : 1e-2;
}

/* ==== the device ==== */

/* The device ops say what the CUDA runtime says of the backend's device:
 * its memory, a name, and the bus id mlens_gpu_bus_id gives for it. */
START_TEST(test_device_ops)
{
	size_t fr = 0, tot = 0;
	char name[128] = "", bus[64] = "", bus0[64] = "";

	ck_assert(MLENS_BACKEND_HAS(dev->ops, mem_info));
	ck_assert(MLENS_BACKEND_HAS(dev->ops, device_name));
	ck_assert(MLENS_BACKEND_HAS(dev->ops, bus_id));
	ck_assert_int_eq(dev->ops->mem_info(dev->ctx, &fr, &tot), 0);
	ck_assert_uint_gt(tot, 0);
	ck_assert_uint_le(fr, tot);
	ck_assert_int_eq(dev->ops->device_name(dev->ctx, name, sizeof(name)), 0);
	ck_assert_uint_gt(strlen(name), 0);
	ck_assert_int_eq(dev->ops->bus_id(dev->ctx, bus, sizeof(bus)), 0);
	ck_assert_int_eq(mlens_gpu_bus_id(0, bus0, sizeof(bus0)), 0);
	ck_assert_str_eq(bus, bus0);	/* the tests' backends run on device 0 */
	ck_assert_int_eq(mlens_gpu_bus_id(1 << 20, bus0, sizeof(bus0)), -ENODEV);
	/* the CPU backend has no device */
	ck_assert(!MLENS_BACKEND_HAS(cpu.ops, mem_info));
	ck_assert(!MLENS_BACKEND_HAS(cpu.ops, bus_id));
}
END_TEST

/* ==== memory ==== */

START_TEST(test_memory)
{
	size_t base = mlens_backend_cuda_mem_used(dev);
	size_t n = (1u << 20) + 3;
	unsigned char *h = malloc(n), *back;
	void *d;

	ck_assert_ptr_nonnull(h);
	for (size_t i = 0; i < n; i++)
		h[i] = (unsigned char)rnd_u32();
	d = to_gpu(h, n);
	ck_assert_uint_eq(mlens_backend_cuda_mem_used(dev), base + n);
	ck_assert_int_eq(dev->ops->sync(dev->ctx), 0);
	back = from_gpu(d, n);
	ck_assert_mem_eq(h, back, n);
	gfree(d);
	ck_assert_uint_eq(mlens_backend_cuda_mem_used(dev), base);
	/* an impossible size fails cleanly and costs nothing */
	errno = 0;
	ck_assert_ptr_null(dev->ops->alloc(dev->ctx, (size_t)1 << 60));
	ck_assert_int_eq(errno, ENOMEM);
	ck_assert_uint_eq(mlens_backend_cuda_mem_used(dev), base);
	ck_assert_str_eq(dev->ops->name, "cuda");
	ck_assert(!dev->ops->host_memory);
	{
		/* with a GPU present, auto picks CUDA */
		struct mlens_backend a = { 0 };
		struct mlens_backend_opts o = { .n_threads = 0, .device = 0 };
		ck_assert_int_eq(mlens_backend_create(&a, "auto", &o), 0);
		ck_assert_str_eq(a.ops->name, "cuda");
		mlens_backend_destroy(&a);
	}
	free(h);
	free(back);
}
END_TEST

/* Compute-queue copies (copy_async queue 0) both ways: pinned buffers at
 * odd offsets and lengths (the SM copy's byte path) and aligned ones (its
 * 16-byte path), and pageable memory, which has no mapping (a copy engine
 * takes it even with sm_copy); every byte comes back. */
START_TEST(test_copy_queue)
{
	static const size_t lens[] = { 1, 15, 4096, (1u << 20) + 3, 24u << 20 };
	size_t cap = (24u << 20) + 64;
	unsigned char *h = dev->ops->host_alloc(dev->ctx, cap);
	unsigned char *back = dev->ops->host_alloc(dev->ctx, cap);
	unsigned char *pg = malloc(cap), *pg_back = malloc(cap);
	char *d = dev->ops->alloc(dev->ctx, cap);

	ck_assert_ptr_nonnull(h);
	ck_assert_ptr_nonnull(back);
	ck_assert_ptr_nonnull(pg);
	ck_assert_ptr_nonnull(pg_back);
	ck_assert_ptr_nonnull(d);
	for (size_t i = 0; i < cap; i++)
		pg[i] = h[i] = (unsigned char)rnd_u32();
	for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
		for (size_t off = 0; off < 2; off++) {
			size_t n = lens[li], ho = off ? 3 : 0, doff = off ? 5 : 0;
			memset(back, 0, n + 8);
			ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, d + doff, h + ho, n, true), 0);
			ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, back + 1, d + doff, n, false), 0);
			ck_assert_int_eq(dev->ops->sync(dev->ctx), 0);
			ck_assert_mem_eq(back + 1, h + ho, n);
			ck_assert_int_eq(back[0], 0);	/* nothing written outside */
			ck_assert_int_eq(back[n + 1], 0);
		}
	}
	ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, d, pg + 7, 1u << 20, true), 0);
	ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, pg_back, d, 1u << 20, false), 0);
	ck_assert_int_eq(dev->ops->sync(dev->ctx), 0);
	ck_assert_mem_eq(pg_back, pg + 7, 1u << 20);
	gfree(d);
	dev->ops->host_free(dev->ctx, h);
	dev->ops->host_free(dev->ctx, back);
	free(pg);
	free(pg_back);
}
END_TEST

/* Pinned host buffers of n bytes for the queue tests: h random and never
 * 0, zero and back all zeros; d a device buffer of dn bytes. */
struct qbufs {
	unsigned char *h, *zero, *back;
	char *d;
};

static void qbufs_open(struct qbufs *b, size_t n, size_t dn)
{
	b->h = dev->ops->host_alloc(dev->ctx, n);
	b->zero = dev->ops->host_alloc(dev->ctx, n);
	b->back = dev->ops->host_alloc(dev->ctx, n);
	b->d = dev->ops->alloc(dev->ctx, dn);
	ck_assert_ptr_nonnull(b->h);
	ck_assert_ptr_nonnull(b->zero);
	ck_assert_ptr_nonnull(b->back);
	ck_assert_ptr_nonnull(b->d);
	for (size_t i = 0; i < n; i++)
		b->h[i] = (unsigned char)(rnd_u32() | 1);
	memset(b->zero, 0, n);
	memset(b->back, 0, n);
}

static void qbufs_close(struct qbufs *b)
{
	gfree(b->d);
	dev->ops->host_free(dev->ctx, b->h);
	dev->ops->host_free(dev->ctx, b->zero);
	dev->ops->host_free(dev->ctx, b->back);
}

/* Queue 2 (side_queue): a copy to the host there, ordered after queue 0's
 * work by an event, sees that work's bytes; the host sees the copy after
 * an event recorded on queue 2 after it. Queue 0 first clears the area,
 * then fills it through a 24 MB upload that takes a few ms: a queue 2 that
 * did not wait would read zeros. */
START_TEST(test_side_queue)
{
	size_t n = 24u << 20;
	struct qbufs b;

	ck_assert(MLENS_BACKEND_HAS(dev->ops, side_queue));
	qbufs_open(&b, n, n);
	for (int round = 0; round < 3; round++) {
		ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, b.d, b.zero, n, true), 0);
		ck_assert_int_eq(dev->ops->sync(dev->ctx), 0);
		ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, b.d, b.h, n, true), 0);
		ck_assert_int_eq(dev->ops->event_record(dev->ctx, 0, 8), 0);
		ck_assert_int_eq(dev->ops->event_wait(dev->ctx, 2, 8), 0);
		ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 2, b.back, b.d, n, false), 0);
		ck_assert_int_eq(dev->ops->event_record(dev->ctx, 2, 9), 0);
		ck_assert_int_eq(dev->ops->event_sync(dev->ctx, 9), 0);
		ck_assert_mem_eq(b.back, b.h, n);
		memset(b.back, 0, n);
	}
	ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 4, b.back, b.d, 16, false), -EINVAL);
	ck_assert_int_eq(dev->ops->event_record(dev->ctx, 4, 9), -EINVAL);
	ck_assert_int_eq(dev->ops->event_wait(dev->ctx, 4, 9), -EINVAL);
	ck_assert_int_eq(dev->ops->copy_async(dev->ctx, -1, b.back, b.d, 16, false), -EINVAL);
	qbufs_close(&b);
}
END_TEST

/* Queue 3 (up_queue): an upload there, which queue 0 waits for by an
 * event, is what queue 0's next copy reads. Queue 3 is first held busy by
 * eight 24 MB uploads elsewhere (a few ms): a queue 0 that did not wait
 * would read the zeros the area held before. */
START_TEST(test_up_queue)
{
	size_t n = 24u << 20;
	struct qbufs b;

	ck_assert(MLENS_BACKEND_HAS(dev->ops, up_queue));
	qbufs_open(&b, n, 9 * n);
	for (int round = 0; round < 3; round++) {
		ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, b.d, b.zero, n, true), 0);
		ck_assert_int_eq(dev->ops->sync(dev->ctx), 0);
		for (size_t i = 1; i < 9; i++)
			ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 3, b.d + i * n, b.zero, n, true), 0);
		ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 3, b.d, b.h, n, true), 0);
		ck_assert_int_eq(dev->ops->event_record(dev->ctx, 3, 10), 0);
		ck_assert_int_eq(dev->ops->event_wait(dev->ctx, 0, 10), 0);
		ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, b.back, b.d, n, false), 0);
		ck_assert_int_eq(dev->ops->sync(dev->ctx), 0);
		ck_assert_mem_eq(b.back, b.h, n);
		memset(b.back, 0, n);
	}
	qbufs_close(&b);
}
END_TEST

/* ==== embed, rmsnorm, rope ==== */

START_TEST(test_embed)
{
	const int vocab = 100, dim = 67, n = 13;
	int32_t tok[13];
	for (int i = 0; i < n; i++)
		tok[i] = (int32_t)(rnd_u32() % vocab);
	for (int t = 0; t < 3; t++) {
		enum mlens_dtype dt = dtypes[t];
		void *tab = rnd_weights((size_t)vocab * dim, dt, 1.0f);
		void *dtab = to_gpu(tab, (size_t)vocab * dim * mlens_dtype_size(dt));
		float *ref = malloc((size_t)n * dim * 4), *got;
		float *dout = gpu_zeros((size_t)n * dim * 4);
		ck_assert_int_eq(cpu.ops->embed(cpu.ctx, ref, tab, dt, dim, tok, n), 0);
		ck_assert_int_eq(dev->ops->embed(dev->ctx, dout, dtab, dt, dim, tok, n), 0);
		got = from_gpu(dout, (size_t)n * dim * 4);
		record("embed", 0.0, rel_err(ref, got, (size_t)n * dim), "%s n=%d dim=%d",
		       mlens_dtype_name(dt), n, dim);
		free(tab); free(ref); free(got);
		gfree(dtab); gfree(dout);
	}
}
END_TEST

/* A norm op (rmsnorm, or layernorm when layer) on both backends over
 * every dtype and a few shapes; shift moves the rows' mean away from 0. */
static void norm_cases(bool layer, const int dims[3], float shift, double tol)
{
	static const int ns[] = { 1, 5, 33 };
	for (int t = 0; t < 3; t++)
		for (int a = 0; a < 3; a++)
			for (int b = 0; b < 3; b++) {
				enum mlens_dtype dt = dtypes[t];
				int dim = dims[a], n = ns[b];
				size_t cnt = (size_t)n * dim;
				float *x = rnd_floats(cnt, 3.0f), *ref = malloc(cnt * 4), *got;
				void *w = rnd_weights((size_t)dim, dt, 1.0f);
				float *dx, *dout = gpu_zeros(cnt * 4);
				void *dw = to_gpu(w, (size_t)dim * mlens_dtype_size(dt));
				for (size_t i = 0; i < cnt; i++)
					x[i] += shift;
				dx = to_gpu(x, cnt * 4);
				if (layer) {
					ck_assert_int_eq(cpu.ops->layernorm(cpu.ctx, ref, x, w, dt, n, dim, 1e-5f), 0);
					ck_assert_int_eq(dev->ops->layernorm(dev->ctx, dout, dx, dw, dt, n, dim,
									     1e-5f), 0);
				} else {
					ck_assert_int_eq(cpu.ops->rmsnorm(cpu.ctx, ref, x, w, dt, n, dim, 1e-5f), 0);
					ck_assert_int_eq(dev->ops->rmsnorm(dev->ctx, dout, dx, dw, dt, n, dim,
									   1e-5f), 0);
				}
				got = from_gpu(dout, cnt * 4);
				record(layer ? "layernorm" : "rmsnorm", tol, rel_err(ref, got, cnt),
				       "%s n=%d dim=%d", mlens_dtype_name(dt), n, dim);
				free(x); free(ref); free(got); free(w);
				gfree(dx); gfree(dout); gfree(dw);
			}
}

START_TEST(test_rmsnorm)
{
	static const int dims[] = { 64, 100, 4096 };
	norm_cases(false, dims, 0.0f, 1e-6);
}
END_TEST

/* LayerNorm without bias (DBRX): rows whose mean is far from 0, so that
 * the centring shows. */
START_TEST(test_layernorm)
{
	static const int dims[] = { 64, 100, 6144 };
	norm_cases(true, dims, 5.0f, 1e-5);
}
END_TEST

/* clip_qkv's clamp: identical values, NaN kept. */
START_TEST(test_clamp)
{
	const int rows = 37, cols = 160;
	size_t cnt = (size_t)rows * cols;
	float *x = rnd_floats(cnt, 4.0f), *ref = malloc(cnt * 4), *dx, *got;

	x[7] = NAN;
	memcpy(ref, x, cnt * 4);
	dx = to_gpu(x, cnt * 4);
	ck_assert_int_eq(cpu.ops->clamp(cpu.ctx, ref, cnt, 1.5f), 0);
	ck_assert_int_eq(dev->ops->clamp(dev->ctx, dx, cnt, 1.5f), 0);
	got = from_gpu(dx, cnt * 4);
	ck_assert(isnan(got[7]));
	got[7] = ref[7] = 0;
	ck_assert_mem_eq(got, ref, cnt * 4);
	ck_assert_int_eq(dev->ops->clamp(dev->ctx, dx, cnt, -1.0f), -EINVAL);
	free(x); free(ref); free(got);
	gfree(dx);
}
END_TEST

START_TEST(test_rope)
{
	static const int hds[] = { 64, 128 };
	static const float thetas[] = { 10000.0f, 1000000.0f };
	const int n = 40, nh = 6;
	int32_t pos[40];
	for (int i = 0; i < n; i++)
		pos[i] = i < 4 ? i : (int32_t)(rnd_u32() % 4096);
	for (int a = 0; a < 2; a++)
		for (int b = 0; b < 2; b++) {
			int hd = hds[a];
			size_t cnt = (size_t)n * nh * hd;
			float *x = rnd_floats(cnt, 2.0f), *got;
			float *dx = to_gpu(x, cnt * 4);
			ck_assert_int_eq(dev->ops->rope(dev->ctx, dx, pos, n, nh, hd, thetas[b]), 0);
			ck_assert_int_eq(cpu.ops->rope(cpu.ctx, x, pos, n, nh, hd, thetas[b]), 0);
			got = from_gpu(dx, cnt * 4);
			record("rope", 1e-5, rel_err(x, got, cnt), "hd=%d theta=%g", hd,
			       (double)thetas[b]);
			free(x); free(got);
			gfree(dx);
		}
}
END_TEST

/* ==== gemm ==== */

/* " exact" for the exact backend, for the op names of the table */
static const char *mode_name(void)
{
	return dev == &gpu_exact ? " exact" : "";
}

/* Whether dev multiplies fp8 experts on fp8 tensor cores. */
static bool dev_fp8_tc(void)
{
	return dev->ops->fp8_tc && dev->ops->fp8_tc(dev->ctx);
}

START_TEST(test_gemm)
{
	static const int ns[] = { 1, 7, 64, 300 };
	static const int km[][2] = { { 64, 64 }, { 100, 37 }, { 513, 129 }, { 4096, 256 } };
	for (int t = 0; t < 3; t++)
		for (int a = 0; a < 4; a++)
			for (int b = 0; b < 4; b++) {
				enum mlens_dtype dt = dtypes[t];
				int n = ns[a], k = km[b][0], m = km[b][1];
				bool acc = (a + b) % 2;
				size_t xs = (size_t)n * k, os = (size_t)n * m;
				float *x = rnd_floats(xs, 1.0f), *ref = rnd_floats(os, 1.0f), *got;
				void *w = rnd_weights((size_t)m * k, dt, 1.0f / sqrtf((float)k));
				float *dx = to_gpu(x, xs * 4), *dout = to_gpu(ref, os * 4);
				void *dw = to_gpu(w, (size_t)m * k * mlens_dtype_size(dt));
				char op[32];
				ck_assert_int_eq(cpu.ops->gemm(cpu.ctx, ref, x, w, dt, n, k, m, acc), 0);
				ck_assert_int_eq(dev->ops->gemm(dev->ctx, dout, dx, dw, dt, n, k, m, acc), 0);
				got = from_gpu(dout, os * 4);
				snprintf(op, sizeof(op), "gemm %s%s", mlens_dtype_name(dt), mode_name());
				record(op, wtol(dt), rel_err(ref, got, os), "n=%d k=%d m=%d acc=%d",
				       n, k, m, acc);
				free(x); free(ref); free(got); free(w);
				gfree(dx); gfree(dout); gfree(dw);
			}
}
END_TEST

/* round and gemm_half_in (the hybrid pipeline's attention output going up
 * in the weights' dtype): round gives the CPU's values bit for bit, and
 * gemm_half_in on rows so rounded gives gemm's product of the fp32 rows
 * bit for bit, where gemm rounds (fast GEMMs of bf16/f16 weights wider
 * than the narrow products); elsewhere it refuses, n = 0 included. */
START_TEST(test_round_gemm_half_in)
{
	for (int t = 1; t < 3; t++) {
		enum mlens_dtype dt = dtypes[t];
		int n = 300, k = 4096, m = 256;
		size_t xs = (size_t)n * k, os = (size_t)n * m;
		float *x = rnd_floats(xs, 3.0f);
		uint16_t *hc = malloc(xs * 2), *hg;
		void *w = rnd_weights((size_t)m * k, dt, 1.0f / sqrtf((float)k));
		float *dx = to_gpu(x, xs * 4), *da = gpu_zeros(os * 4), *db = gpu_zeros(os * 4);
		void *dh = gpu_zeros(xs * 2), *dw = to_gpu(w, (size_t)m * k * 2);
		float *a, *b;

		/* a few values that round differently: ties, carries, specials */
		x[0] = 1.00390625f;	/* bf16 tie: to even */
		x[1] = 1.01171875f;	/* bf16 tie: up */
		x[2] = 65520.0f;	/* f16: rounds to infinity */
		x[3] = -0.0f;
		ck_assert_int_eq(dev->ops->upload(dev->ctx, dx, x, 16), 0);
		ck_assert_int_eq(cpu.ops->round(cpu.ctx, hc, dt, x, n, k), 0);
		ck_assert_int_eq(dev->ops->round(dev->ctx, dh, dt, dx, n, k), 0);
		hg = from_gpu(dh, xs * 2);
		for (size_t i = 0; i < xs; i++)
			ck_assert_msg(hc[i] == hg[i], "%s round of value %zu (%a): CPU %04x, GPU %04x",
				      mlens_dtype_name(dt), i, x[i], hc[i], hg[i]);
		ck_assert_int_eq(dev->ops->round(dev->ctx, dh, MLENS_DTYPE_F32, dx, n, k), -EINVAL);
		ck_assert_int_eq(dev->ops->round(dev->ctx, dh, dt, dx, -1, k), -EINVAL);
		if (dev == &gpu_exact) {
			/* exact GEMMs do not round: no half input at all */
			ck_assert_int_eq(dev->ops->gemm_half_in(dev->ctx, NULL, NULL, NULL, dt, 0, k, m,
								 true), -ENOTSUP);
		} else {
			ck_assert_int_eq(dev->ops->gemm_half_in(dev->ctx, NULL, NULL, NULL, dt, 0, k, m,
								 true), 0);
			for (int acc = 0; acc < 2; acc++) {
				ck_assert_int_eq(dev->ops->gemm(dev->ctx, da, dx, dw, dt, n, k, m, acc), 0);
				ck_assert_int_eq(dev->ops->gemm_half_in(dev->ctx, db, dh, dw, dt, n, k, m,
									 acc), 0);
				a = from_gpu(da, os * 4);
				b = from_gpu(db, os * 4);
				ck_assert_msg(!memcmp(a, b, os * 4), "%s gemm_half_in acc=%d: differs from "
					      "gemm by %g", mlens_dtype_name(dt), acc, rel_err(a, b, os));
				free(a);
				free(b);
			}
			/* the narrow products widen the weights instead: refused */
			ck_assert_int_eq(dev->ops->gemm_half_in(dev->ctx, db, dh, dw, dt, n, k, 64, false),
					 -ENOTSUP);
		}
		ck_assert_int_eq(dev->ops->gemm_half_in(dev->ctx, db, dh, dw, MLENS_DTYPE_F32, 0, k, m,
							 false), -ENOTSUP);
		ck_assert_int_eq(dev->ops->gemm_half_in(dev->ctx, db, dh, dw, dt, -1, k, m, false),
				 -EINVAL);
		free(x); free(hc); free(hg); free(w);
		gfree(dx); gfree(da); gfree(db); gfree(dh); gfree(dw);
	}
}
END_TEST

/* gemm_multi (the Q, K and V projections from one rounding or split of
 * x): each product bit for bit gemm's, in fast and exact mode, for bf16,
 * f16 and fp32 weights, a narrow product among them (which widens its
 * weights instead), and n = 0; bad counts and sizes refused. */
START_TEST(test_gemm_multi)
{
	static const int ms[][3] = { { 256, 64, 64 }, { 256, 100, 100 }, { 37, 129, 256 } };
	const int n = 300, k = 513;
	for (int t = 0; t < 3; t++)
		for (int c = 0; c < 3; c++) {
			enum mlens_dtype dt = dtypes[t];
			size_t es = mlens_dtype_size(dt), xs = (size_t)n * k;
			float *x = rnd_floats(xs, 2.0f), *dx = to_gpu(x, xs * 4);
			float *da[3], *db[3];
			void *w[3], *dw[3];
			for (int i = 0; i < 3; i++) {
				size_t os = (size_t)n * ms[c][i];
				w[i] = rnd_weights((size_t)ms[c][i] * k, dt, 1.0f / sqrtf((float)k));
				dw[i] = to_gpu(w[i], (size_t)ms[c][i] * k * es);
				da[i] = gpu_zeros(os * 4);
				db[i] = gpu_zeros(os * 4);
				ck_assert_int_eq(dev->ops->gemm(dev->ctx, da[i], dx, dw[i], dt, n, k,
								ms[c][i], false), 0);
			}
			ck_assert_int_eq(dev->ops->gemm_multi(dev->ctx, db, dx, (const void *const *)dw,
							      dt, n, k, ms[c], 3), 0);
			for (int i = 0; i < 3; i++) {
				size_t os = (size_t)n * ms[c][i];
				float *a = from_gpu(da[i], os * 4), *b = from_gpu(db[i], os * 4);
				ck_assert_msg(!memcmp(a, b, os * 4), "%s%s gemm_multi product %d of m=%d: "
					      "differs from gemm by %g", mlens_dtype_name(dt),
					      mode_name(), i, ms[c][i], rel_err(a, b, os));
				free(a);
				free(b);
			}
			ck_assert_int_eq(dev->ops->gemm_multi(dev->ctx, db, dx, (const void *const *)dw,
							      dt, 0, k, ms[c], 3), 0);
			ck_assert_int_eq(dev->ops->gemm_multi(dev->ctx, db, dx, (const void *const *)dw,
							      dt, n, k, ms[c], 0), -EINVAL);
			ck_assert_int_eq(dev->ops->gemm_multi(dev->ctx, db, dx, (const void *const *)dw,
							      dt, n, k, ms[c],
							      MLENS_GEMM_MULTI_MAX + 1), -EINVAL);
			ck_assert_int_eq(dev->ops->gemm_multi(dev->ctx, db, dx, (const void *const *)dw,
							      dt, -1, k, ms[c], 3), -EINVAL);
			free(x);
			gfree(dx);
			for (int i = 0; i < 3; i++) {
				free(w[i]);
				gfree(dw[i]);
				gfree(da[i]);
				gfree(db[i]);
			}
		}
}
END_TEST

/* ==== router, moe ==== */

START_TEST(test_router)
{
	const int n = 300, E = 8, k = 2;
	float *l = rnd_floats((size_t)n * E, 4.0f), wref[600], *wgot;
	int32_t idref[600], *idgot;
	float *dl = to_gpu(l, (size_t)n * E * 4);
	int32_t *dids = gpu_zeros((size_t)n * k * 4);
	float *dw = gpu_zeros((size_t)n * k * 4);

	l[0] = l[1];	/* a tie: the lower index must win */
	ck_assert_int_eq(dev->ops->upload(dev->ctx, dl, l, (size_t)n * E * 4), 0);
	ck_assert_int_eq(cpu.ops->router(cpu.ctx, idref, wref, l, n, E, k, true), 0);
	ck_assert_int_eq(dev->ops->router(dev->ctx, dids, dw, dl, n, E, k, true), 0);
	idgot = from_gpu(dids, (size_t)n * k * 4);
	wgot = from_gpu(dw, (size_t)n * k * 4);
	ck_assert_mem_eq(idref, idgot, (size_t)n * k * 4);
	record("router", 1e-6, rel_err(wref, wgot, (size_t)n * k), "n=%d E=%d k=%d", n, E, k);
	free(l); free(idgot); free(wgot);
	gfree(dl); gfree(dids); gfree(dw);
}
END_TEST

/* The families' small ops against the CPU: top-k weights left as the
 * softmax gives them (no renormalisation), a projection's bias, the clip
 * of q, k, v and the one-expert route (weight 1, or a sigmoid gate). */
START_TEST(test_family_ops)
{
	const int n = 300, E = 16, k = 4, dim = 96;
	float *l = rnd_floats((size_t)n * E, 4.0f), *wref = malloc((size_t)n * k * 4), *wgot;
	int32_t *idref = malloc((size_t)n * k * 4), *idgot;
	float *dl = to_gpu(l, (size_t)n * E * 4);
	int32_t *dids = gpu_zeros((size_t)n * k * 4);
	float *dw = gpu_zeros((size_t)n * k * 4);
	float *x = rnd_floats((size_t)n * dim, 3.0f), *xr = malloc((size_t)n * dim * 4), *got;
	float *dx;
	void *b;

	ck_assert_int_eq(cpu.ops->router(cpu.ctx, idref, wref, l, n, E, k, false), 0);
	ck_assert_int_eq(dev->ops->router(dev->ctx, dids, dw, dl, n, E, k, false), 0);
	idgot = from_gpu(dids, (size_t)n * k * 4);
	wgot = from_gpu(dw, (size_t)n * k * 4);
	ck_assert_mem_eq(idref, idgot, (size_t)n * k * 4);
	record("router raw top-k", 1e-6, rel_err(wref, wgot, (size_t)n * k), "n=%d E=%d k=%d", n, E, k);
	free(idgot); free(wgot);

	/* route_one: ids 0; weights 1, or sigmoid of the first n logits */
	ck_assert_int_eq(cpu.ops->route_one(cpu.ctx, idref, wref, l, n), 0);
	ck_assert_int_eq(dev->ops->route_one(dev->ctx, dids, dw, dl, n), 0);
	idgot = from_gpu(dids, (size_t)n * 4);
	wgot = from_gpu(dw, (size_t)n * 4);
	ck_assert_mem_eq(idref, idgot, (size_t)n * 4);
	record("route_one sigmoid", 1e-6, rel_err(wref, wgot, (size_t)n), "n=%d", n);
	free(idgot); free(wgot);
	ck_assert_int_eq(dev->ops->route_one(dev->ctx, dids, dw, NULL, n), 0);
	wgot = from_gpu(dw, (size_t)n * 4);
	for (int i = 0; i < n; i++)
		ck_assert_float_eq(wgot[i], 1.0f);
	free(wgot);

	/* bias_add in each weight dtype, then the clip: exact */
	for (int t = 0; t < 3; t++) {
		enum mlens_dtype dt = t == 0 ? MLENS_DTYPE_F32 : t == 1 ? MLENS_DTYPE_BF16 : MLENS_DTYPE_F16;
		void *db;

		b = rnd_weights((size_t)dim, dt, 1.0f);
		db = to_gpu(b, (size_t)dim * mlens_dtype_size(dt));
		memcpy(xr, x, (size_t)n * dim * 4);
		dx = to_gpu(x, (size_t)n * dim * 4);
		ck_assert_int_eq(cpu.ops->bias_add(cpu.ctx, xr, b, dt, n, dim), 0);
		ck_assert_int_eq(dev->ops->bias_add(dev->ctx, dx, db, dt, n, dim), 0);
		ck_assert_int_eq(cpu.ops->clamp(cpu.ctx, xr, (size_t)n * dim, 2.5f), 0);
		ck_assert_int_eq(dev->ops->clamp(dev->ctx, dx, (size_t)n * dim, 2.5f), 0);
		got = from_gpu(dx, (size_t)n * dim * 4);
		ck_assert_mem_eq(xr, got, (size_t)n * dim * 4);
		free(got); free(b);
		gfree(dx); gfree(db);
	}
	ck_assert_int_eq(dev->ops->bias_add(dev->ctx, dl, dl, MLENS_DTYPE_F32, -1, 4), -EINVAL);
	free(l); free(wref); free(idref); free(x); free(xr);
	gfree(dl); gfree(dids); gfree(dw);
}
END_TEST

/* Token counts per expert are uneven on purpose: expert 0 gets most rows,
 * expert 3 none (and has no weights at all on either backend). skew:
 * every token's first expert is expert 0, so that it holds more rows than
 * a MoE stream's gate/up piece once the call has more routed rows than
 * MLENS_CUDA_MOE_GU_ROWS: it runs in pieces. */
/* fp8 experts (fk set): random fp32 weights quantized with scales laid out
 * as fk says; their dequantized GEMMs run in bf16 or fp32 as mdt, the
 * model's dtype, and the GEMM mode choose. */
static void *fp8_matrix(int rows, int cols, const struct mlens_wscale *fk, float **scales)
{
	float *v = rnd_weights((size_t)rows * cols, MLENS_DTYPE_F32, 1.0f / sqrtf((float)cols));
	uint8_t *q = malloc((size_t)rows * cols);

	*scales = malloc(mlens_wscale_count(fk, rows, cols) * sizeof(float));
	mlens_fp8_quantize(v, rows, cols, fk, q, *scales);
	free(v);
	return q;
}

/* moe_case's experts store w2 as [I][H] (DBRX's layout, w2_transposed) */
static bool moe_w2t;

static void moe_case_fp8(enum mlens_dtype dt, int n, int H, int I, bool skew,
			 const struct mlens_wscale *fk, enum mlens_dtype mdt)
{
	const int E = 8, k = 2;
	size_t es = mlens_dtype_size(dt);
	float *hs1[8], *hs2[8], *hs3[8], *ds1[8], *ds2[8], *ds3[8];
	size_t s13 = fk ? mlens_wscale_count(fk, I, H) * 4 : 0, s2 = fk ? mlens_wscale_count(fk, H, I) * 4 : 0;
	int32_t *ids = malloc((size_t)n * k * 4);
	float *wts = malloc((size_t)n * k * 4);
	float *x = rnd_floats((size_t)n * H, 1.0f), *ref = rnd_floats((size_t)n * H, 1.0f), *got;
	void *hw1[8], *hw2[8], *hw3[8], *dw1[8], *dw2[8], *dw3[8];
	static const int pick[] = { 0, 0, 0, 0, 1, 2, 4, 5, 6, 7, 7 };
	struct mlens_moe_weights wc = { .n_experts = E, .hidden = H, .inter = I, .dtype = dt,
					.w1 = (const void *const *)hw1, .w2 = (const void *const *)hw2,
					.w3 = (const void *const *)hw3, .w2_transposed = moe_w2t };
	struct mlens_moe_weights wg = { .n_experts = E, .hidden = H, .inter = I, .dtype = dt,
					.w1 = (const void *const *)dw1, .w2 = (const void *const *)dw2,
					.w3 = (const void *const *)dw3, .w2_transposed = moe_w2t };
	float *dx, *dout, *dwts;
	int32_t *dids;
	char op[64];

	if (fk) {
		wc.scale = wg.scale = *fk;
		wc.model_dtype = wg.model_dtype = mdt;
		wc.s1 = (const float *const *)hs1;
		wc.s2 = (const float *const *)hs2;
		wc.s3 = (const float *const *)hs3;
		wg.s1 = (const float *const *)ds1;
		wg.s2 = (const float *const *)ds2;
		wg.s3 = (const float *const *)ds3;
	}

	for (int i = 0; i < n; i++) {
		int a = pick[rnd_u32() % 11], b;
		do
			b = pick[rnd_u32() % 11];
		while (b == a);
		if (skew && b == 0)
			b = a;
		if (skew)
			a = 0;
		ids[i * k] = a;
		ids[i * k + 1] = b;
		float p = 0.5f + 0.5f * fabsf(rnd());
		wts[i * k] = p;
		wts[i * k + 1] = 1.0f - p;
	}
	for (int e = 0; e < E; e++) {
		hs1[e] = hs2[e] = hs3[e] = ds1[e] = ds2[e] = ds3[e] = NULL;
		if (e == 3) {
			hw1[e] = hw2[e] = hw3[e] = dw1[e] = dw2[e] = dw3[e] = NULL;
			continue;
		}
		if (fk) {
			hw1[e] = fp8_matrix(I, H, fk, &hs1[e]);
			hw3[e] = fp8_matrix(I, H, fk, &hs3[e]);
			hw2[e] = fp8_matrix(H, I, fk, &hs2[e]);
			ds1[e] = to_gpu(hs1[e], s13);
			ds3[e] = to_gpu(hs3[e], s13);
			ds2[e] = to_gpu(hs2[e], s2);
			dw1[e] = to_gpu(hw1[e], (size_t)I * H);
			dw3[e] = to_gpu(hw3[e], (size_t)I * H);
			dw2[e] = to_gpu(hw2[e], (size_t)H * I);
			continue;
		}
		hw1[e] = rnd_weights((size_t)I * H, dt, 1.0f / sqrtf((float)H));
		hw3[e] = rnd_weights((size_t)I * H, dt, 1.0f / sqrtf((float)H));
		hw2[e] = rnd_weights((size_t)H * I, dt, 1.0f / sqrtf((float)I));
		dw1[e] = to_gpu(hw1[e], (size_t)I * H * es);
		dw3[e] = to_gpu(hw3[e], (size_t)I * H * es);
		dw2[e] = to_gpu(hw2[e], (size_t)H * I * es);
	}
	dx = to_gpu(x, (size_t)n * H * 4);
	dout = to_gpu(ref, (size_t)n * H * 4);
	dids = to_gpu(ids, (size_t)n * k * 4);
	dwts = to_gpu(wts, (size_t)n * k * 4);
	ck_assert_int_eq(cpu.ops->moe(cpu.ctx, ref, x, n, ids, wts, k, &wc), 0);
	ck_assert_int_eq(dev->ops->moe(dev->ctx, dout, dx, n, dids, dwts, k, &wg), 0);
	got = from_gpu(dout, (size_t)n * H * 4);
	snprintf(op, sizeof(op), "moe%s %s%s%s%s", moe_w2t ? " w2t" : "", mlens_dtype_name(dt),
		 fk ? (fk->kind == MLENS_WSCALE_BLOCK ? " block" : " channel") : "",
		 fk ? (mdt == MLENS_DTYPE_F32 ? " (f32 model)" : " (bf16 model)") : "", mode_name());
	/* fp8: the CPU multiplies the dequantized weights exactly; the GPU
	 * rounds them (and the activations) to bf16 for a bf16 model's fast
	 * GEMMs, else works in fp32 */
	/* gpu (fp8_gemm auto) and gpu_tc multiply a bf16 model's per-channel
	 * fp8 experts on fp8 tensor cores where the device has them:
	 * activations rounded to e4m3 (2^-4 relative) too, gate and up to
	 * bf16 */
	if (fk && dev_fp8_tc() && mdt != MLENS_DTYPE_F32 && fk->kind == MLENS_WSCALE_CHANNEL &&
	    !(H % 16) && !(I % 16))
		strcat(op, " fp8-gemm");
	record(op, strstr(op, "fp8-gemm") ? 6e-2 : wtol(fk ? mdt : dt),
	       rel_err(ref, got, (size_t)n * H), "n=%d H=%d I=%d E=8 k=2%s", n, H, I,
	       skew ? " skewed" : "");
	for (int e = 0; e < E; e++) {
		free(hw1[e]); free(hw2[e]); free(hw3[e]);
		gfree(dw1[e]); gfree(dw2[e]); gfree(dw3[e]);
		free(hs1[e]); free(hs2[e]); free(hs3[e]);
		gfree(ds1[e]); gfree(ds2[e]); gfree(ds3[e]);
	}
	free(ids); free(wts); free(x); free(ref); free(got);
	gfree(dx); gfree(dout); gfree(dids); gfree(dwts);
}

static void moe_case(enum mlens_dtype dt, int n, int H, int I, bool skew)
{
	moe_case_fp8(dt, n, H, I, skew, NULL, dt);
}

START_TEST(test_moe)
{
	for (int t = 0; t < 3; t++) {
		moe_case(dtypes[t], 1, 64, 96, false);
		moe_case(dtypes[t], 7, 256, 320, false);
		moe_case(dtypes[t], 300, 512, 1000, false);
		/* sizes that are no multiple of 4 or 8: the conversion, SiLU
		 * product and combine take their one-value-a-thread kernels */
		moe_case(dtypes[t], 5, 62, 97, false);
		/* 3000 routed rows, expert 0 with 1500 of them: pieces */
		moe_case(dtypes[t], 1500, 64, 96, true);
	}
	/* more tokens than one chunk of the CUDA MoE (4096) */
	moe_case(MLENS_DTYPE_BF16, 4100, 64, 96, false);
}
END_TEST

/* fp8 experts, per-channel and block scales (blocks that do not divide
 * the matrices), in an fp32 and a bf16 model: the dequantize path, and
 * (per-channel scales of the bf16 model on gpu and gpu_tc, where the
 * device has fp8 tensor cores) the tensor-core path, whose error is
 * within 6e-2 of the output's norm (two e4m3 roundings of the
 * activations). Block scales of 128x128 stay blocks after load and take
 * the dequantize path. */
START_TEST(test_moe_fp8)
{
	static const struct mlens_wscale fks[] = { { MLENS_WSCALE_CHANNEL, 0, 0 },
						   { MLENS_WSCALE_BLOCK, 128, 128 },
						   { MLENS_WSCALE_BLOCK, 32, 48 } };
	static const enum mlens_dtype mdts[] = { MLENS_DTYPE_F32, MLENS_DTYPE_BF16 };

	for (int f = 0; f < 3; f++)
		for (int m = 0; m < 2; m++) {
			moe_case_fp8(MLENS_DTYPE_E4M3, 7, 256, 320, false, &fks[f], mdts[m]);
			moe_case_fp8(MLENS_DTYPE_E4M3, 300, 512, 1000, false, &fks[f], mdts[m]);
			moe_case_fp8(MLENS_DTYPE_E4M3, 5, 62, 97, false, &fks[f], mdts[m]);
			moe_case_fp8(MLENS_DTYPE_E4M3, 1500, 64, 96, true, &fks[f], mdts[m]);
		}
	/* more tokens than a chunk (4096), and experts of many pieces: the
	 * fp8 GEMMs of many sizes, through the cached algorithms */
	moe_case_fp8(MLENS_DTYPE_E4M3, 4100, 64, 96, false, &fks[0], MLENS_DTYPE_BF16);
	moe_case_fp8(MLENS_DTYPE_E4M3, 2500, 256, 512, true, &fks[0], MLENS_DTYPE_BF16);
}
END_TEST

/* Which backends take the fp8 tensor-core path: auto (gpu) and fp8
 * (gpu_tc) alike, never dequant (gpu_sm) nor exact GEMMs. */
START_TEST(test_fp8_path)
{
	ck_assert(gpu.ops->fp8_tc != NULL);
	ck_assert(gpu.ops->fp8_tc(gpu.ctx) == gpu_tc.ops->fp8_tc(gpu_tc.ctx));
	ck_assert(!gpu_sm.ops->fp8_tc(gpu_sm.ctx));
	ck_assert(!gpu_exact.ops->fp8_tc(gpu_exact.ctx));
	ck_assert(cpu.ops->fp8_tc == NULL);
}
END_TEST

/* The same MoE with w2 stored [I][H] (DBRX): the down GEMM reads it
 * without the transpose. */
START_TEST(test_moe_w2_transposed)
{
	moe_w2t = true;
	for (int t = 0; t < 3; t++) {
		moe_case(dtypes[t], 7, 256, 320, false);
		moe_case(dtypes[t], 5, 62, 97, false);
		moe_case(dtypes[t], 1500, 64, 96, true);
	}
	moe_w2t = false;
}
END_TEST

/* Whether dev runs a 16-bit MoE with active experts through the grouped
 * GEMMs (kernels/cuda/moe_grouped.cu's rule). */
static bool moe_grouped_expected(enum mlens_dtype dt, int H, int I, int active)
{
	if (dt == MLENS_DTYPE_F32 || dev == &gpu_exact || dev == &gpu_sm || H % 8 || I % 8)
		return false;
	return dev == &gpu_grp || active >= MLENS_MOE_GROUPED_MIN_EXPERTS;
}

/* E experts (every fourth one, 1, 5, ..., never routed and without
 * weights), top-k, H x I of dtype dt; hot >= 0: expert hot is every
 * token's first pick (all n of its rows). With k = 1 the weight is 1 and
 * the output starts at zero, so it is the expert's down output itself:
 * bf16/f16 values exactly when the grouped path (which rounds it) ran. */
static void moe_many_case(enum mlens_dtype dt, int n, int H, int I, int E, int k, int hot)
{
	size_t es = mlens_dtype_size(dt), out_bytes = (size_t)n * H * 4;
	int32_t *ids = malloc((size_t)n * k * 4);
	float *wts = malloc((size_t)n * k * 4);
	float *x = rnd_floats((size_t)n * H, 1.0f), *ref = calloc((size_t)n * H, 4), *got;
	void **hw = calloc(6 * (size_t)E, sizeof(void *));
	void **hw1 = hw, **hw2 = hw + E, **hw3 = hw + 2 * E, **dw1 = hw + 3 * E, **dw2 = hw + 4 * E,
	     **dw3 = hw + 5 * E;
	struct mlens_moe_weights wc = { .n_experts = E, .hidden = H, .inter = I, .dtype = dt,
					.w1 = (const void *const *)hw1, .w2 = (const void *const *)hw2,
					.w3 = (const void *const *)hw3, .w2_transposed = moe_w2t };
	struct mlens_moe_weights wg = wc;
	bool *used = calloc((size_t)E, 1);
	int active = 0, off_dtype = 0;
	float *dx, *dout, *dwts;
	int32_t *dids;
	char op[64];

	ck_assert(ids && wts && ref && hw && used && E >= 8 && k < E - E / 4 && hot % 4 != 1);
	wg.w1 = (const void *const *)dw1;
	wg.w2 = (const void *const *)dw2;
	wg.w3 = (const void *const *)dw3;
	for (int i = 0; i < n; i++) {
		float sum = 0.0f;
		for (int s = 0; s < k; s++) {
			int e, dup;
			do {
				e = s == 0 && hot >= 0 ? hot : (int)(rnd_u32() % (uint32_t)E);
				dup = e % 4 == 1;
				for (int j = 0; j < s; j++)
					dup |= ids[i * k + j] == e;
			} while (dup);
			ids[i * k + s] = e;
			wts[i * k + s] = 0.1f + fabsf(rnd());
			sum += wts[i * k + s];
			active += !used[e];
			used[e] = true;
		}
		for (int s = 0; s < k; s++)
			wts[i * k + s] = k == 1 ? 1.0f : wts[i * k + s] / sum;
	}
	for (int e = 0; e < E; e++) {
		if (e % 4 == 1)
			continue;	/* never routed: no weights */
		hw1[e] = rnd_weights((size_t)I * H, dt, 1.0f / sqrtf((float)H));
		hw3[e] = rnd_weights((size_t)I * H, dt, 1.0f / sqrtf((float)H));
		hw2[e] = rnd_weights((size_t)H * I, dt, 1.0f / sqrtf((float)I));
		dw1[e] = to_gpu(hw1[e], (size_t)I * H * es);
		dw3[e] = to_gpu(hw3[e], (size_t)I * H * es);
		dw2[e] = to_gpu(hw2[e], (size_t)H * I * es);
	}
	dx = to_gpu(x, out_bytes);
	dout = to_gpu(ref, out_bytes);
	dids = to_gpu(ids, (size_t)n * k * 4);
	dwts = to_gpu(wts, (size_t)n * k * 4);
	ck_assert_int_eq(cpu.ops->moe(cpu.ctx, ref, x, n, ids, wts, k, &wc), 0);
	ck_assert_int_eq(dev->ops->moe(dev->ctx, dout, dx, n, dids, dwts, k, &wg), 0);
	got = from_gpu(dout, out_bytes);
	snprintf(op, sizeof(op), "moe many %s%s%s", mlens_dtype_name(dt), mode_name(),
		 moe_grouped_expected(dt, H, I, active) ? " grouped" : "");
	record(op, wtol(dt), rel_err(ref, got, (size_t)n * H), "n=%d H=%d I=%d E=%d k=%d%s", n, H,
	       I, E, k, hot >= 0 ? " hot" : "");
	if (k == 1 && dt != MLENS_DTYPE_F32) {
		void *one = malloc(es);
		for (size_t i = 0; i < (size_t)n * H; i++) {
			mlens_store(one, dt, 0, got[i]);
			off_dtype += mlens_load(one, dt, 0) != got[i];
		}
		free(one);
		if (moe_grouped_expected(dt, H, I, active))
			ck_assert_msg(!off_dtype, "%s: %d outputs are no %s value: not grouped", op,
				      off_dtype, mlens_dtype_name(dt));
		else
			ck_assert_msg(off_dtype, "%s: every output a %s value: grouped", op,
				      mlens_dtype_name(dt));
	}
	for (int e = 0; e < E; e++) {
		free(hw1[e]); free(hw2[e]); free(hw3[e]);
		if (dw1[e]) {
			gfree(dw1[e]); gfree(dw2[e]); gfree(dw3[e]);
		}
	}
	free(hw); free(used); free(ids); free(wts); free(x); free(ref); free(got);
	gfree(dx); gfree(dout); gfree(dids); gfree(dwts);
}

/* Many experts: decode (8 experts with rows: per expert unless grouped
 * is on), prefill with some experts idle, one expert in every token's
 * picks, rows past one wave (an expert split between waves), w2 stored transposed, sizes that are no multiple of 8 (never
 * grouped), and the one-expert check of which path ran. */
START_TEST(test_moe_many)
{
	for (int t = 0; t < 3; t++) {
		moe_many_case(dtypes[t], 1, 128, 192, 64, 8, -1);
		moe_many_case(dtypes[t], 37, 128, 192, 64, 8, -1);
		moe_many_case(dtypes[t], 300, 256, 96, 64, 8, 6);
		/* waves of about 3100 rows (kernels/cuda/moe_grouped.cu: the
		 * chunk's gate/up and expert output areas over 2 x I x 2
		 * bytes a row): expert 22's 1100 rows cross the first end */
		moe_many_case(dtypes[t], 1100, 64, 512, 64, 8, 22);
		moe_many_case(dtypes[t], 40, 62, 97, 64, 8, -1);
		moe_many_case(dtypes[t], 600, 128, 192, 64, 1, -1);
	}
	moe_w2t = true;
	moe_many_case(MLENS_DTYPE_BF16, 300, 256, 96, 64, 8, 6);
	moe_w2t = false;
}
END_TEST

/* Exact GEMMs: the same cases on the exact backend, plus activations
 * spread over many binades (where a bf16 rounding of x would show most)
 * and an accumulate; every dtype within the fp32 tolerance. */
static void use_exact(void)
{
	dev = &gpu_exact;
}

static void use_fast(void)
{
	dev = &gpu;
}

/* Prefill attention on the tensor-core backend (prefill_bf16). */
static void use_tc(void)
{
	dev = &gpu_tc;
}

/* The ops that stage tables or read values back, on the backend whose
 * compute-stream copies the SMs move (sm_copy). */
static void use_sm(void)
{
	dev = &gpu_sm;
}

/* The MoE on the backend that groups every 16-bit call (moe_grouped on). */
static void use_grp(void)
{
	dev = &gpu_grp;
}

START_TEST(test_gemm_exact_wide)
{
	const int n = 33, k = 1000, m = 300;
	for (int t = 1; t < 3; t++) {
		enum mlens_dtype dt = dtypes[t];
		size_t xs = (size_t)n * k, os = (size_t)n * m;
		float *x = rnd_floats(xs, 1.0f), *ref = rnd_floats(os, 1.0f), *got;
		void *w = rnd_weights((size_t)m * k, dt, 1.0f / sqrtf((float)k));
		float *dx, *dout;
		void *dw;
		char op[40];
		/* magnitudes from 2^-12 to 2^12 (inside f16's range) */
		for (size_t i = 0; i < xs; i++)
			x[i] *= ldexpf(1.0f, (int)(rnd_u32() % 25) - 12);
		dx = to_gpu(x, xs * 4);
		dout = to_gpu(ref, os * 4);
		dw = to_gpu(w, (size_t)m * k * mlens_dtype_size(dt));
		ck_assert_int_eq(cpu.ops->gemm(cpu.ctx, ref, x, w, dt, n, k, m, true), 0);
		ck_assert_int_eq(dev->ops->gemm(dev->ctx, dout, dx, dw, dt, n, k, m, true), 0);
		got = from_gpu(dout, os * 4);
		snprintf(op, sizeof(op), "gemm %s exact, wide x", mlens_dtype_name(dt));
		record(op, 1e-5, rel_err(ref, got, os), "n=%d k=%d m=%d acc=1", n, k, m);
		free(x); free(ref); free(got); free(w);
		gfree(dx); gfree(dout); gfree(dw);
	}
}
END_TEST

/* ==== attention ==== */

/* One prefill attention case on the backend under test against the CPU:
 * ns sequences of the given lengths, nh heads over nkv, head dim hd, q of
 * magnitude qscale, K and V starting kshift floats into their buffers.
 * The relative error (rel_err). */
static double prefill_case(const int *lens, int ns, int nh, int nkv, int hd, float qscale,
			   int kshift)
{
	int32_t cu[33];
	size_t qn, kn;
	float *q, *k, *v, *ref, *got, *dq, *dk, *dv, *dout;
	float scale = 1.0f / sqrtf((float)hd);
	double err;

	ck_assert_int_le(ns, 32);
	cu[0] = 0;
	for (int s = 0; s < ns; s++)
		cu[s + 1] = cu[s] + lens[s];
	qn = (size_t)cu[ns] * nh * hd;
	kn = (size_t)cu[ns] * nkv * hd + (size_t)kshift;
	q = rnd_floats(qn, qscale);
	k = rnd_floats(kn, 1.0f);
	v = rnd_floats(kn, 1.0f);
	ref = malloc(qn * 4);
	ck_assert_ptr_nonnull(ref);
	dq = to_gpu(q, qn * 4);
	dk = to_gpu(k, kn * 4);
	dv = to_gpu(v, kn * 4);
	dout = gpu_zeros(qn * 4);
	ck_assert_int_eq(cpu.ops->attn_prefill(cpu.ctx, ref, q, k + kshift, v + kshift, cu, ns, nh,
					       nkv, hd, scale), 0);
	ck_assert_int_eq(dev->ops->attn_prefill(dev->ctx, dout, dq, dk + kshift, dv + kshift, cu, ns,
					       nh, nkv, hd, scale), 0);
	got = from_gpu(dout, qn * 4);
	err = rel_err(ref, got, qn);
	free(q); free(k); free(v); free(ref); free(got);
	gfree(dq); gfree(dk); gfree(dv); gfree(dout);
	return err;
}

START_TEST(test_attn_prefill)
{
	static const int lens[] = { 1, 2, 15, 16, 17, 33, 100, 300 };
	static const int cfg[][2] = { { 8, 8 }, { 8, 2 }, { 16, 2 } };	/* heads, kv heads */
	/* 64 and 128 take the tuned kernel, 16 and 32 the generic one */
	static const int hds[] = { 64, 128, 16, 32 };
	for (int c = 0; c < 3; c++)
		for (int hdi = 0; hdi < 4; hdi++)
			record("attn_prefill", 1e-5,
			       prefill_case(lens, 8, cfg[c][0], cfg[c][1], hds[hdi], 1.0f, 0),
			       "lens 1..300 heads=%d kv=%d hd=%d", cfg[c][0], cfg[c][1], hds[hdi]);
}
END_TEST

/* Prefill attention on tensor cores: lengths around the 64-row and
 * 64-key tiles, GQA 1, 4 and 8, head dims 64 and 128; against the CPU
 * with the bf16 tolerance. K/V one float off 16-byte alignment take the
 * fp32 kernel instead (the tensor-core kernel's loads need it): exact. */
START_TEST(test_attn_prefill_bf16)
{
	static const int lens[] = { 1, 63, 64, 65, 128, 130, 300, 777 };
	static const int cfg[][2] = { { 8, 8 }, { 8, 2 }, { 32, 4 } };	/* heads, kv heads */
	for (int c = 0; c < 3; c++)
		for (int hd = 64; hd <= 128; hd += 64) {
			int nh = cfg[c][0], nkv = cfg[c][1];
			/* q at 3x: scores of about unit spread, a softmax far
			 * from uniform */
			double err = prefill_case(lens, 8, nh, nkv, hd, 3.0f, 0);
			record("attn_prefill bf16", 2e-2, err, "lens 1..777 heads=%d kv=%d hd=%d", nh,
			       nkv, hd);
			ck_assert_msg(err > 1e-6, "bf16 prefill attention equals fp32 (%g): "
				      "the tensor-core kernel did not run", err);
			record("attn_prefill bf16, K/V unaligned", 1e-5,
			       prefill_case(lens, 8, nh, nkv, hd, 3.0f, 1),
			       "lens 1..777 heads=%d kv=%d hd=%d", nh, nkv, hd);
		}
}
END_TEST

/* Sequences get blocks from a shuffled pool; K/V go in with kv_append
 * (layer 1 of 2) on both backends, and from the device into a third cache
 * in registered host memory (the hybrid pipeline's pool, kv_append = gpu)
 * and, with kv_append_side on queue 2 behind an event on queue 0, into a
 * fourth (K/V made on queue 0 just before: a queue 2 that did not wait
 * would store what was there before); the caches must be identical, then
 * decode attention reads them. The same host cache unregistered is
 * refused (-EFAULT), nothing written. */
static void decode_case(enum mlens_dtype kdt, int nkv, int group, int hd)
{
	static const int ctxs[] = { 1, 17, 300, 1000, 4096 };
	const int nq = 5, bs = 16, layer = 1, nh = nkv * group;
	uint32_t n_blocks = 0, *perm, *tables[5], at = 0;
	struct mlens_attn_query qs[5];
	struct mlens_kv_cache kc, kg, kh, ks;
	size_t kvb, khb, row = (size_t)nkv * hd;
	float scale = 1.0f / sqrtf((float)hd);
	char op[32];

	for (int i = 0; i < nq; i++)
		n_blocks += (uint32_t)((ctxs[i] + bs - 1) / bs);
	n_blocks += 7;	/* spare blocks nobody uses */
	perm = malloc(n_blocks * 4);
	for (uint32_t b = 0; b < n_blocks; b++)
		perm[b] = b;
	for (uint32_t b = n_blocks - 1; b > 0; b--) {
		uint32_t j = rnd_u32() % (b + 1), t = perm[b];
		perm[b] = perm[j];
		perm[j] = t;
	}
	kc = (struct mlens_kv_cache){ kdt, 2, nkv, hd, bs, n_blocks, NULL, NULL };
	kvb = kv_pair(&kc, &kg);
	kh = kc;
	khb = (kvb + 4095) & ~(size_t)4095;
	kh.k = aligned_alloc(4096, khb);
	kh.v = aligned_alloc(4096, khb);
	ck_assert(kh.k && kh.v);
	memset(kh.k, 0, khb);
	memset(kh.v, 0, khb);
	ks = kh;
	ks.k = aligned_alloc(4096, khb);
	ks.v = aligned_alloc(4096, khb);
	ck_assert(ks.k && ks.v);
	memset(ks.k, 0, khb);
	memset(ks.v, 0, khb);
	{
		int64_t slot0 = 0;
		float *d1 = gpu_zeros(row * 4);
		ck_assert_int_eq(dev->ops->kv_append(dev->ctx, &kh, layer, d1, d1, &slot0, 1), -EFAULT);
		ck_assert_int_eq(dev->ops->kv_append_side(dev->ctx, &ks, layer, d1, d1, &slot0, 1),
				 -EFAULT);
		gfree(d1);
	}
	ck_assert_int_eq(dev->ops->host_register(dev->ctx, kh.k, khb), 0);
	ck_assert_int_eq(dev->ops->host_register(dev->ctx, kh.v, khb), 0);
	ck_assert_int_eq(dev->ops->host_register(dev->ctx, ks.k, khb), 0);
	ck_assert_int_eq(dev->ops->host_register(dev->ctx, ks.v, khb), 0);
	for (int i = 0; i < nq; i++) {
		int nb = (ctxs[i] + bs - 1) / bs, len = ctxs[i];
		int64_t *slots = malloc((size_t)len * 8);
		float *k = rnd_floats((size_t)len * row, 1.0f), *v = rnd_floats((size_t)len * row, 1.0f);
		float *dk = to_gpu(k, (size_t)len * row * 4), *dv = to_gpu(v, (size_t)len * row * 4);
		tables[i] = perm + at;
		at += (uint32_t)nb;
		for (int t = 0; t < len; t++)
			slots[t] = (int64_t)tables[i][t / bs] * bs + t % bs;
		ck_assert_int_eq(cpu.ops->kv_append(cpu.ctx, &kc, layer, k, v, slots, len), 0);
		ck_assert_int_eq(dev->ops->kv_append(dev->ctx, &kg, layer, dk, dv, slots, len), 0);
		ck_assert_int_eq(dev->ops->kv_append(dev->ctx, &kh, layer, dk, dv, slots, len), 0);
		{
			/* K/V zeroed, then copied in on queue 0 from pinned
			 * memory right before queue 2 stores them */
			size_t kb = (size_t)len * row * 4;
			float *sk = gpu_zeros(kb), *sv = gpu_zeros(kb);
			float *hk = dev->ops->host_alloc(dev->ctx, kb), *hv = dev->ops->host_alloc(dev->ctx, kb);
			ck_assert(hk && hv);
			memcpy(hk, k, kb);
			memcpy(hv, v, kb);
			ck_assert_int_eq(dev->ops->sync(dev->ctx), 0);
			ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, sk, hk, kb, true), 0);
			ck_assert_int_eq(dev->ops->copy_async(dev->ctx, 0, sv, hv, kb, true), 0);
			ck_assert_int_eq(dev->ops->event_record(dev->ctx, 0, 10), 0);
			ck_assert_int_eq(dev->ops->event_wait(dev->ctx, 2, 10), 0);
			ck_assert_int_eq(dev->ops->kv_append_side(dev->ctx, &ks, layer, sk, sv, slots, len),
					 0);
			memset(slots, 0xff, (size_t)len * 8);	/* read before it returned */
			ck_assert_int_eq(dev->ops->event_record(dev->ctx, 2, 11), 0);
			ck_assert_int_eq(dev->ops->event_sync(dev->ctx, 11), 0);
			gfree(sk); gfree(sv);
			dev->ops->host_free(dev->ctx, hk);
			dev->ops->host_free(dev->ctx, hv);
		}
		qs[i] = (struct mlens_attn_query){ len, nb, tables[i] };
		free(slots); free(k); free(v);
		gfree(dk); gfree(dv);
	}
	{
		void *gk = from_gpu(kg.k, kvb), *gv = from_gpu(kg.v, kvb);
		ck_assert_msg(!memcmp(gk, kc.k, kvb) && !memcmp(gv, kc.v, kvb),
			      "kv_append: GPU cache differs from CPU cache (%s)", mlens_dtype_name(kdt));
		ck_assert_int_eq(dev->ops->sync(dev->ctx), 0);
		ck_assert_msg(!memcmp(kh.k, kc.k, kvb) && !memcmp(kh.v, kc.v, kvb),
			      "kv_append: the device's stores into registered host memory differ from "
			      "the CPU cache (%s)", mlens_dtype_name(kdt));
		ck_assert_msg(!memcmp(ks.k, kc.k, kvb) && !memcmp(ks.v, kc.v, kvb),
			      "kv_append_side: the side queue's stores into registered host memory "
			      "differ from the CPU cache (%s)", mlens_dtype_name(kdt));
		record("kv_append", 0.0, 0.0, "%s kv=%d hd=%d", mlens_dtype_name(kdt), nkv, hd);
		free(gk);
		free(gv);
	}
	{
		size_t qn = (size_t)nq * nh * hd;
		float *q = rnd_floats(qn, 1.0f), *ref = malloc(qn * 4), *got;
		float *dq = to_gpu(q, qn * 4), *dout = gpu_zeros(qn * 4);
		ck_assert_int_eq(cpu.ops->attn_decode(cpu.ctx, ref, q, &kc, layer, qs, nq, nh, scale), 0);
		ck_assert_int_eq(dev->ops->attn_decode(dev->ctx, dout, dq, &kg, layer, qs, nq, nh, scale), 0);
		got = from_gpu(dout, qn * 4);
		snprintf(op, sizeof(op), "attn_decode %s", mlens_dtype_name(kdt));
		record(op, 1e-5, rel_err(ref, got, qn), "ctx 1..4096 kv=%d group=%d hd=%d", nkv,
		       group, hd);
		free(q); free(ref); free(got);
		gfree(dq); gfree(dout);
	}
	free(kc.k); free(kc.v); free(perm);
	gfree(kg.k); gfree(kg.v);
	dev->ops->host_unregister(dev->ctx, kh.k);
	dev->ops->host_unregister(dev->ctx, kh.v);
	dev->ops->host_unregister(dev->ctx, ks.k);
	dev->ops->host_unregister(dev->ctx, ks.v);
	free(kh.k); free(kh.v);
	free(ks.k); free(ks.v);
}

/* Enough queries that their partials exceed one launch's area (256 MiB,
 * DEC_PART_CAP in kernels/cuda/attn_cuda.cu): each query gets only its own
 * splits and the queries go through in groups. Every query's output must
 * be bitwise the one it gets alone, and a sample must match the CPU. */
START_TEST(test_attn_decode_groups)
{
	const int nkv = 8, group = 4, hd = 128, nh = nkv * group, bs = 16, layer = 0;
	const int max_ctx = 8192, nq = 1100, nb = max_ctx / bs;
	size_t row = (size_t)nkv * hd, qrow = (size_t)nh * hd;
	uint32_t *bt = malloc((size_t)nb * 4);
	struct mlens_attn_query *qs = malloc((size_t)nq * sizeof(*qs));
	struct mlens_kv_cache kc = { MLENS_DTYPE_BF16, 1, nkv, hd, bs, (uint32_t)nb, NULL, NULL }, kg;
	float scale = 1.0f / sqrtf((float)hd), *k, *v, *q, *dk, *dv, *dq, *dout, *dalone;
	float *all, *alone, *ref;
	int64_t *slots = malloc((size_t)max_ctx * 8);
	double worst = 0;

	for (int b = 0; b < nb; b++)
		bt[b] = (uint32_t)(nb - 1 - b);
	for (int t = 0; t < max_ctx; t++)
		slots[t] = (int64_t)bt[t / bs] * bs + t % bs;
	kv_pair(&kc, &kg);
	k = rnd_floats((size_t)max_ctx * row, 1.0f);
	v = rnd_floats((size_t)max_ctx * row, 1.0f);
	dk = to_gpu(k, (size_t)max_ctx * row * 4);
	dv = to_gpu(v, (size_t)max_ctx * row * 4);
	ck_assert_int_eq(cpu.ops->kv_append(cpu.ctx, &kc, layer, k, v, slots, max_ctx), 0);
	ck_assert_int_eq(dev->ops->kv_append(dev->ctx, &kg, layer, dk, dv, slots, max_ctx), 0);
	/* contexts of every length class, the longest ones throughout */
	for (int i = 0; i < nq; i++) {
		int len = i % 3 ? 1 + (int)(((uint64_t)i * 7919) % max_ctx) : max_ctx;
		qs[i] = (struct mlens_attn_query){ len, (len + bs - 1) / bs, bt };
	}
	q = rnd_floats((size_t)nq * qrow, 1.0f);
	dq = to_gpu(q, (size_t)nq * qrow * 4);
	dout = gpu_zeros((size_t)nq * qrow * 4);
	dalone = gpu_zeros(qrow * 4);
	ck_assert_int_eq(dev->ops->attn_decode(dev->ctx, dout, dq, &kg, layer, qs, nq, nh, scale), 0);
	all = from_gpu(dout, (size_t)nq * qrow * 4);
	for (int i = 0; i < nq; i++) {
		ck_assert_int_eq(dev->ops->attn_decode(dev->ctx, dalone, dq + (size_t)i * qrow, &kg,
						       layer, &qs[i], 1, nh, scale), 0);
		alone = from_gpu(dalone, qrow * 4);
		ck_assert_msg(!memcmp(alone, all + (size_t)i * qrow, qrow * 4),
			      "attn_decode: query %d (ctx %d) of %d differs from it alone", i,
			      qs[i].ctx_len, nq);
		free(alone);
	}
	ref = malloc(qrow * 4);
	for (int i = 0; i < nq; i += 97) {
		ck_assert_int_eq(cpu.ops->attn_decode(cpu.ctx, ref, q + (size_t)i * qrow, &kc, layer,
						      &qs[i], 1, nh, scale), 0);
		double e = rel_err(ref, all + (size_t)i * qrow, qrow);
		worst = e > worst ? e : worst;
	}
	record("attn_decode groups", 1e-5, worst, "%d queries, ctx 1..%d, bf16 kv=%d group=%d",
	       nq, max_ctx, nkv, group);
	free(bt); free(qs); free(slots); free(k); free(v); free(q); free(all); free(ref);
	free(kc.k); free(kc.v);
	gfree(kg.k); gfree(kg.v); gfree(dk); gfree(dv); gfree(dq); gfree(dout); gfree(dalone);
}
END_TEST

START_TEST(test_attn_decode)
{
	decode_case(MLENS_DTYPE_F32, 8, 1, 128);
	decode_case(MLENS_DTYPE_F32, 2, 4, 64);
	decode_case(MLENS_DTYPE_BF16, 8, 4, 128);
	decode_case(MLENS_DTYPE_BF16, 1, 8, 64);
	decode_case(MLENS_DTYPE_F32, 4, 8, 128);
	/* the generic kernel: small head dims, groups above the tuned limit */
	decode_case(MLENS_DTYPE_F32, 2, 2, 16);
	decode_case(MLENS_DTYPE_BF16, 2, 4, 32);
	decode_case(MLENS_DTYPE_BF16, 1, 12, 64);
	/* fp8: bytes identical to the CPU append's, decode against the CPU */
	decode_case(MLENS_DTYPE_E4M3, 8, 4, 128);
	decode_case(MLENS_DTYPE_E4M3, 2, 4, 64);
	decode_case(MLENS_DTYPE_E4M3, 2, 2, 16);
}
END_TEST

/* ==== sampling ==== */

START_TEST(test_sample)
{
	const int n = 24, vocab = 5000;
	float *l = rnd_floats((size_t)n * vocab, 5.0f), lpc[24], *lpg = malloc(n * 4);
	struct mlens_sampling sp[24];
	int32_t tc[24], tg[24];
	float *dl;

	l[7] = l[4000] = 9.0f;	/* row 0: a tie for greedy; the lower index wins */
	for (int i = 0; i < n; i++) {
		bool greedy = i % 3 == 0;
		sp[i] = (struct mlens_sampling){ greedy ? 0.0f : 0.5f + 0.1f * (float)(i % 5),
						 i % 4 == 1 ? 0 : 40, i % 5 == 2 ? 1.0f : 0.9f,
						 1234u + (uint64_t)i, (uint64_t)(i * 7) };
	}
	dl = to_gpu(l, (size_t)n * vocab * 4);
	ck_assert_int_eq(cpu.ops->sample(cpu.ctx, tc, lpc, l, n, vocab, sp), 0);
	ck_assert_int_eq(dev->ops->sample(dev->ctx, tg, lpg, dl, n, vocab, sp), 0);
	ck_assert_int_eq(tc[0], 7);
	for (int i = 0; i < n; i++)
		ck_assert_msg(tc[i] == tg[i], "row %d (temperature %g): cpu token %d, cuda token %d",
			      i, (double)sp[i].temperature, tc[i], tg[i]);
	record("sample (logprob)", 1e-5, rel_err(lpc, lpg, (size_t)n), "n=%d vocab=%d", n, vocab);
	/* without logprobs too */
	ck_assert_int_eq(dev->ops->sample(dev->ctx, tg, NULL, dl, n, vocab, sp), 0);
	ck_assert_mem_eq(tc, tg, sizeof(tc));
	free(l); free(lpg);
	gfree(dl);
}
END_TEST

/* ==== bad input: -errno, never a crash ==== */

START_TEST(test_errors)
{
	struct mlens_kv_cache kv = { MLENS_DTYPE_F32, 1, 1, 64, 16, 2, NULL, NULL };
	uint32_t bad_table[1] = { 5 };
	struct mlens_attn_query q = { 10, 1, bad_table };
	int64_t slot = 32;
	int32_t cu[2] = { 0, 4 };
	float *buf = gpu_zeros(64 * 64 * 4);

	kv.k = gpu_zeros(mlens_kv_bytes(&kv));
	kv.v = gpu_zeros(mlens_kv_bytes(&kv));
	ck_assert_int_eq(dev->ops->gemm(dev->ctx, buf, buf, buf, MLENS_DTYPE_F32, -1, 4, 4, false),
			 -EINVAL);
	ck_assert_int_eq(dev->ops->kv_append(dev->ctx, &kv, 0, buf, buf, &slot, 1), -ERANGE);
	ck_assert_int_eq(dev->ops->kv_append_side(dev->ctx, &kv, 0, buf, buf, &slot, 1), -ERANGE);
	ck_assert_int_eq(dev->ops->kv_append_side(dev->ctx, &kv, 1, buf, buf, &slot, 1), -EINVAL);
	ck_assert_int_eq(dev->ops->attn_decode(dev->ctx, buf, buf, &kv, 0, &q, 1, 1, 1.0f), -ERANGE);
	ck_assert_int_eq(dev->ops->attn_prefill(dev->ctx, buf, buf, buf, buf, cu, 1, 2, 2, 300, 1.0f),
			 -ENOTSUP);
	ck_assert_int_eq(dev->ops->router(dev->ctx, (int32_t *)buf, buf, buf, 4, 8, 9, true), -EINVAL);
	{
		/* MoE streams out of range: refused at creation, by name */
		struct mlens_backend_opts bad = { .n_threads = 0, .device = 0,
						  .moe_streams = MLENS_MOE_STREAMS_MAX + 1 };
		struct mlens_backend b;
		ck_assert_int_eq(mlens_backend_create(&b, "cuda", &bad), -EINVAL);
		bad.moe_streams = -1;
		ck_assert_int_eq(mlens_backend_create(&b, "cuda", &bad), -EINVAL);
		/* a sync mode that is none of auto, spin, yield, block */
		bad.moe_streams = 0;
		bad.sync = (enum mlens_gpu_sync)(MLENS_GPU_SYNC_BLOCK + 1);
		ck_assert_int_eq(mlens_backend_create(&b, "cuda", &bad), -EINVAL);
		/* a side append block count that is not 1..65535 */
		bad.sync = MLENS_GPU_SYNC_AUTO;
		setenv("MLENS_CUDA_APPEND_BLOCKS", "0", 1);
		ck_assert_int_eq(mlens_backend_create(&b, "cuda", &bad), -EINVAL);
		setenv("MLENS_CUDA_APPEND_BLOCKS", "12x", 1);
		ck_assert_int_eq(mlens_backend_create(&b, "cuda", &bad), -EINVAL);
		unsetenv("MLENS_CUDA_APPEND_BLOCKS");
		/* nor an upload block count that is not 1..1056 */
		setenv("MLENS_CUDA_UP_BLOCKS", "0", 1);
		ck_assert_int_eq(mlens_backend_create(&b, "cuda", &bad), -EINVAL);
		setenv("MLENS_CUDA_UP_BLOCKS", "1057", 1);
		ck_assert_int_eq(mlens_backend_create(&b, "cuda", &bad), -EINVAL);
		unsetenv("MLENS_CUDA_UP_BLOCKS");
	}
	/* the backend still works afterwards */
	ck_assert_int_eq(dev->ops->sync(dev->ctx), 0);
	gfree(kv.k);
	gfree(kv.v);
	gfree(buf);
}
END_TEST

/* ==== runner ==== */

static void print_table(void)
{
	printf("\n%-20s %6s %12s %10s  %s\n", "op", "cases", "max rel err", "tolerance",
	       "worst case");
	for (int i = 0; i < n_rows; i++)
		printf("%-20s %6d %12.3e %10.1e  %s\n", table[i].op, table[i].cases,
		       table[i].worst, table[i].tol, table[i].worst_shape);
	fflush(stdout);
}

/* ==== timing marks ==== */

static double host_clock(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

START_TEST(test_timer_marks)
{
	const int n = 1024, k = 2048;
	size_t copy_bytes = 64u << 20;
	float *x = gpu_zeros((size_t)n * k * 4), *w = gpu_zeros((size_t)k * k * 4), *y = gpu_zeros((size_t)n * k * 4);
	void *h = gpu.ops->host_alloc(gpu.ctx, copy_bytes), *d = gpu_zeros(copy_bytes);
	double t_before, t_after, t_done, m0, m1, m2, m3;
	int rc;
	ck_assert(MLENS_BACKEND_HAS(gpu.ops, timer_mark) && MLENS_BACKEND_HAS(gpu.ops, timer_read));
	ck_assert_ptr_nonnull(h);
	memset(h, 0, copy_bytes);
	ck_assert_int_eq(gpu.ops->timer_read(gpu.ctx, 77, &m0), -ENOENT);
	ck_assert_int_eq(gpu.ops->timer_mark(gpu.ctx, 0, MLENS_BACKEND_TIMERS), -EINVAL);
	ck_assert_int_eq(gpu.ops->timer_mark(gpu.ctx, 2, 1), -EINVAL);
	ck_assert_int_eq(gpu.ops->sync(gpu.ctx), 0);
	t_before = host_clock();
	ck_assert_int_eq(gpu.ops->timer_mark(gpu.ctx, 0, 0), 0);	/* ties the clocks: waits */
	t_after = host_clock();
	for (int i = 0; i < 20; i++)
		ck_assert_int_eq(gpu.ops->gemm(gpu.ctx, y, x, w, MLENS_DTYPE_F32, n, k, k, false), 0);
	ck_assert_int_eq(gpu.ops->timer_mark(gpu.ctx, 0, 1), 0);
	rc = gpu.ops->timer_read(gpu.ctx, 1, &m1);
	ck_assert(rc == 0 || rc == -EAGAIN);
	ck_assert_int_eq(gpu.ops->timer_mark(gpu.ctx, 1, 2), 0);
	ck_assert_int_eq(gpu.ops->copy_async(gpu.ctx, 1, d, h, copy_bytes, true), 0);
	ck_assert_int_eq(gpu.ops->timer_mark(gpu.ctx, 1, 3), 0);
	ck_assert_int_eq(gpu.ops->sync(gpu.ctx), 0);
	ck_assert_int_eq(gpu.ops->event_record(gpu.ctx, 1, 0), 0);
	ck_assert_int_eq(gpu.ops->event_sync(gpu.ctx, 0), 0);
	t_done = host_clock();
	ck_assert_int_eq(gpu.ops->timer_read(gpu.ctx, 0, &m0), 0);
	ck_assert_int_eq(gpu.ops->timer_read(gpu.ctx, 1, &m1), 0);
	ck_assert_int_eq(gpu.ops->timer_read(gpu.ctx, 2, &m2), 0);
	ck_assert_int_eq(gpu.ops->timer_read(gpu.ctx, 3, &m3), 0);
	printf("timer marks: 20 GEMMs %.3f ms, 64 MiB H2D %.3f ms (%.1f GB/s), mark 0 %.1f us after the call\n",
	       (m1 - m0) * 1e3, (m3 - m2) * 1e3, copy_bytes / (m3 - m2) / 1e9, (m0 - t_before) * 1e6);
	/* on the host's timeline: mark 0 inside the call that waited for it */
	ck_assert(m0 >= t_before - 1e-4 && m0 <= t_after + 1e-4);
	ck_assert(m1 > m0 && m1 <= t_done + 1e-4);
	ck_assert(m3 > m2 && m3 <= t_done + 1e-4);
	ck_assert(m2 >= m0 - 1e-4);
	/* a copy of 64 MiB takes between 1 GB/s and 1 TB/s */
	ck_assert(m3 - m2 > copy_bytes / 1e12 && m3 - m2 < copy_bytes / 1e9);
	/* a batch in the other half of the ids leaves this half's marks as
	 * they were (read against their own base), and its own marks come
	 * after its base */
	{
		double h0, h1, again, now;
		const int H = MLENS_BACKEND_TIMER_HALF;
		ck_assert_int_eq(gpu.ops->timer_mark(gpu.ctx, 0, H), 0);
		ck_assert_int_eq(gpu.ops->timer_mark(gpu.ctx, 1, H + 1), 0);
		ck_assert_int_eq(gpu.ops->sync(gpu.ctx), 0);
		ck_assert_int_eq(gpu.ops->event_record(gpu.ctx, 1, 0), 0);
		ck_assert_int_eq(gpu.ops->event_sync(gpu.ctx, 0), 0);
		ck_assert_int_eq(gpu.ops->timer_read(gpu.ctx, 3, &again), 0);
		ck_assert_msg(fabs(again - m3) < 1e-6, "mark 3 moved by %g s", again - m3);
		ck_assert_int_eq(gpu.ops->timer_read(gpu.ctx, H, &h0), 0);
		ck_assert_int_eq(gpu.ops->timer_read(gpu.ctx, H + 1, &h1), 0);
		now = host_clock();
		/* the base's host time is taken when the poll sees it: a few
		 * microseconds late (a blocking wait's wake-up was once 100+) */
		ck_assert_msg(h0 >= t_done - 1e-4 && h1 >= h0 - 1e-4 && h1 <= now + 1e-4,
			      "second half: t_done %.6f, h0 %+.1f us, h1 %+.1f us, now %+.1f us (from t_done)",
			      t_done, (h0 - t_done) * 1e6, (h1 - t_done) * 1e6, (now - t_done) * 1e6);
	}
	gfree(x);
	gfree(w);
	gfree(y);
	gfree(d);
	gpu.ops->host_free(gpu.ctx, h);
}
END_TEST

/* A test case of suite s run on the backend that setup selects (use_fast
 * after each test), added to s. */
static TCase *backend_tcase(Suite *s, const char *name, void (*setup)(void))
{
	TCase *tc = tcase_create(name);
	tcase_set_timeout(tc, 120);
	tcase_add_checked_fixture(tc, setup, use_fast);
	suite_add_tcase(s, tc);
	return tc;
}

int main(void)
{
	struct mlens_backend_opts o = { .n_threads = 0, .device = 0 };
	struct mlens_backend_opts ox = { .n_threads = 0, .device = 0, .gemm = MLENS_GEMM_EXACT };
	/* gpu_sm's side K/V append runs in 3 blocks (each takes many tokens),
	 * its upload queue's copies in 2; the others' in a quarter of the SMs
	 * (and their uploads on a copy engine: no sm_copy).
	 * the MoE's experts: on 2 streams (the default) in gpu and gpu_exact,
	 * one after another in gpu_sm (never grouped), over 4 streams in
	 * gpu_tc. gpu_tc,
	 * created last, sets the device's sync mode to block for the whole
	 * process: every test below waits for the GPU asleep */
	struct mlens_backend_opts osm = { .n_threads = 0, .device = 0, .sm_copy = true,
					  .moe_streams = 1, .fp8_gemm = MLENS_FP8_GEMM_DEQUANT,
					  .moe_grouped = MLENS_MOE_GROUPED_OFF };
	/* gpu_grp: every 16-bit MoE through the grouped GEMMs */
	struct mlens_backend_opts ogrp = { .n_threads = 0, .device = 0,
					   .moe_grouped = MLENS_MOE_GROUPED_ON };
	struct mlens_backend_opts otc = { .n_threads = 0, .device = 0, .prefill_bf16 = true,
					  .moe_streams = 4, .sync = MLENS_GPU_SYNC_BLOCK,
					  .fp8_gemm = MLENS_FP8_GEMM_FP8 };
	TCase *tx, *tsm, *ttc, *tg;
	Suite *s;
	TCase *tc;
	SRunner *sr;
	int failed;

	if (!mlens_cuda_available()) {
		fprintf(stderr, "check_cuda: no CUDA GPU here; skipped\n");
		return 77;
	}
	mlens_test_gpu_lock("check_cuda");	/* its timing marks, its memory counts */
	/* CUDA does not survive fork(): run the tests in this process */
	if (mlens_backend_create(&cpu, "cpu", &o) || mlens_backend_create(&gpu, "cuda", &o) ||
	    mlens_backend_create(&gpu_exact, "cuda", &ox) || mlens_backend_create(&gpu_grp, "cuda", &ogrp) ||
	    (setenv("MLENS_CUDA_APPEND_BLOCKS", "3", 1), setenv("MLENS_CUDA_UP_BLOCKS", "2", 1),
	     mlens_backend_create(&gpu_sm, "cuda", &osm)) ||
	    (unsetenv("MLENS_CUDA_APPEND_BLOCKS"), unsetenv("MLENS_CUDA_UP_BLOCKS"),
	     mlens_backend_create(&gpu_tc, "cuda", &otc))) {
		fprintf(stderr, "check_cuda: cannot create the backends\n");
		return 1;
	}
	s = suite_create("cuda");
	tc = backend_tcase(s, "ops", use_fast);
	tcase_add_test(tc, test_memory);
	tcase_add_test(tc, test_device_ops);
	tcase_add_test(tc, test_copy_queue);
	tcase_add_test(tc, test_side_queue);
	tcase_add_test(tc, test_up_queue);
	tcase_add_test(tc, test_embed);
	tcase_add_test(tc, test_rmsnorm);
	tcase_add_test(tc, test_layernorm);
	tcase_add_test(tc, test_clamp);
	tcase_add_test(tc, test_rope);
	tcase_add_test(tc, test_gemm);
	tcase_add_test(tc, test_round_gemm_half_in);
	tcase_add_test(tc, test_gemm_multi);
	tcase_add_test(tc, test_router);
	tcase_add_test(tc, test_family_ops);
	tcase_add_test(tc, test_moe);
	tcase_add_test(tc, test_moe_fp8);
	tcase_add_test(tc, test_moe_w2_transposed);
	tcase_add_test(tc, test_moe_many);
	tcase_add_test(tc, test_attn_prefill);
	tcase_add_test(tc, test_attn_decode);
	tcase_add_test(tc, test_attn_decode_groups);
	tcase_add_test(tc, test_sample);
	tcase_add_test(tc, test_errors);
	tcase_add_test(tc, test_timer_marks);
	tx = backend_tcase(s, "exact gemm", use_exact);
	tcase_add_test(tx, test_gemm);
	tcase_add_test(tx, test_round_gemm_half_in);
	tcase_add_test(tx, test_gemm_multi);
	tcase_add_test(tx, test_moe);
	tcase_add_test(tx, test_moe_fp8);
	tcase_add_test(tx, test_moe_w2_transposed);
	tcase_add_test(tx, test_moe_many);
	tcase_add_test(tx, test_gemm_exact_wide);
	/* the ops that stage tables or read values back, with SM copies */
	tsm = backend_tcase(s, "sm copies", use_sm);
	tcase_add_test(tsm, test_copy_queue);
	tcase_add_test(tsm, test_side_queue);
	tcase_add_test(tsm, test_up_queue);
	tcase_add_test(tsm, test_embed);
	tcase_add_test(tsm, test_rope);
	tcase_add_test(tsm, test_moe);
	tcase_add_test(tsm, test_moe_fp8);	/* fp8_gemm dequant */
	tcase_add_test(tsm, test_fp8_path);
	tcase_add_test(tsm, test_moe_many);
	tcase_add_test(tsm, test_attn_prefill);
	tcase_add_test(tsm, test_attn_decode);
	tcase_add_test(tsm, test_sample);
	ttc = backend_tcase(s, "tensor-core prefill", use_tc);
	tcase_add_test(ttc, test_attn_prefill_bf16);
	tcase_add_test(ttc, test_moe);
	tcase_add_test(ttc, test_moe_fp8);
	/* every 16-bit MoE grouped, the 8-expert cases too */
	tg = backend_tcase(s, "grouped moe", use_grp);
	tcase_add_test(tg, test_moe);
	tcase_add_test(tg, test_moe_w2_transposed);
	tcase_add_test(tg, test_moe_many);
	sr = srunner_create(s);
	srunner_set_fork_status(sr, CK_NOFORK);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	print_table();
	mlens_backend_destroy(&gpu_tc);
	mlens_backend_destroy(&gpu_grp);
	mlens_backend_destroy(&gpu_sm);
	mlens_backend_destroy(&gpu_exact);
	mlens_backend_destroy(&gpu);
	mlens_backend_destroy(&cpu);
	return failed ? 1 : 0;
}
