/* The CUDA backend: context, device memory and its accounting, staging of
 * host metadata, the cuBLAS GEMMs (dense and per-expert MoE), sampling and
 * the ops table. Kernels live in ops_cuda.cu and attn_cuda.cu.
 *
 * GEMM precision: fp32 weights run fp32 x fp32 with CUBLAS_COMPUTE_32F and
 * the default math mode (no TF32). bf16/fp16 weights: the fp32 activations
 * are rounded to the weight dtype (round to nearest even) and the product
 * runs on the tensor cores with fp32 accumulation and fp32 output. Rounding
 * the activations costs about 2^-9 (bf16) or 2^-12 (fp16) relative per
 * element, far faster than converting the weights to fp32 and inside the
 * tolerances that tests/check_cuda.c states. Narrow products (at most
 * GEMM_NARROW_M outputs: the router) widen the weights instead and run in
 * fp32, so that expert choices match the CPU's.
 *
 * MLENS_GEMM_EXACT (the backend option; mlensd's gpu_gemm = exact) keeps
 * the CPU's numerics for every half-precision GEMM, dense and per expert:
 * each fp32 activation becomes three parts of the weight dtype (x = p0 +
 * p1/S + p2/S^2 exactly, mlens_cuda_split_rows) and three tensor-core GEMMs
 * with fp32 accumulation add p2, p1 and p0 into the output (alpha 1/S^2,
 * 1/S, 1; beta 1 after the first): products of two 8-bit (bf16) or 11-bit
 * (f16) significands are exact in fp32, so the only rounding left is the
 * fp32 accumulation, as on the CPU. Three GEMMs into the output rather than
 * one over a K-concatenated operand: concatenating along K would need the
 * weights three times over (cuBLAS cannot repeat an operand), and it adds
 * no accuracy; the three calls need no extra output buffer nor a summing
 * kernel. The cost is three times the tensor-core work and weight reads;
 * the silu(g)*u product of the experts stays fp32 and is split too. */
#include "kernels/cuda/cuda_int.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

extern "C" {
#include "kernels/cpu/cpu.h"
}

/* ==== errors ==== */

int mlens_cuda_rc(cudaError_t e, const char *what, const char *file, int line)
{
	int rc;
	switch (e) {
	case cudaErrorMemoryAllocation: rc = -ENOMEM; break;
	case cudaErrorInvalidValue: rc = -EINVAL; break;
	case cudaErrorNoDevice:
	case cudaErrorInvalidDevice:
	case cudaErrorInsufficientDriver: rc = -ENODEV; break;
	default: rc = -EIO; break;
	}
	fprintf(stderr, "mlens cuda: %s failed (%s:%d): %s; check the GPU with nvidia-smi\n",
		what, file, line, cudaGetErrorString(e));
	cudaGetLastError();	/* reported: do not let the next launch check see it again */
	return rc;
}

int mlens_cublas_rc(cublasStatus_t s, const char *what, const char *file, int line)
{
	int rc;
	switch (s) {
	case CUBLAS_STATUS_ALLOC_FAILED: rc = -ENOMEM; break;
	case CUBLAS_STATUS_INVALID_VALUE: rc = -EINVAL; break;
	case CUBLAS_STATUS_NOT_SUPPORTED:
	case CUBLAS_STATUS_ARCH_MISMATCH: rc = -ENOTSUP; break;
	case CUBLAS_STATUS_NOT_INITIALIZED: rc = -ENODEV; break;
	default: rc = -EIO; break;
	}
	fprintf(stderr, "mlens cuda: %s failed (%s:%d): %s\n", what, file, line,
		cublasGetStatusString(s));
	return rc;
}

/* ==== device memory and its accounting ==== */

struct cuda_alloc_slot {
	void *p;		/* NULL: empty; TOMBSTONE: deleted */
	size_t bytes;
};

static char tombstone_byte;
#define TOMBSTONE ((void *)&tombstone_byte)

static size_t ptr_hash(const void *p, size_t cap)
{
	uint64_t x = (uint64_t)(uintptr_t)p;
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	return (size_t)x & (cap - 1);
}

static int alloc_table_put(struct mlens_cuda_ctx *c, void *p, size_t bytes);

static int alloc_table_grow(struct mlens_cuda_ctx *c)
{
	size_t ncap = c->alloc_cap ? c->alloc_cap * 2 : 256;
	struct cuda_alloc_slot *old = c->allocs, *nt;
	size_t ocap = c->alloc_cap;

	nt = (struct cuda_alloc_slot *)calloc(ncap, sizeof(*nt));
	if (!nt)
		return -ENOMEM;
	c->allocs = nt;
	c->alloc_cap = ncap;
	c->alloc_count = 0;
	for (size_t i = 0; i < ocap; i++)
		if (old[i].p && old[i].p != TOMBSTONE)
			alloc_table_put(c, old[i].p, old[i].bytes);
	free(old);
	return 0;
}

static int alloc_table_put(struct mlens_cuda_ctx *c, void *p, size_t bytes)
{
	/* keep at least half the slots free (tombstones count as used) */
	if ((c->alloc_count + 1) * 2 > c->alloc_cap) {
		int rc = alloc_table_grow(c);
		if (rc)
			return rc;
	}
	for (size_t i = ptr_hash(p, c->alloc_cap);; i = (i + 1) & (c->alloc_cap - 1)) {
		if (!c->allocs[i].p) {
			c->allocs[i].p = p;
			c->allocs[i].bytes = bytes;
			c->alloc_count++;
			return 0;
		}
	}
}

/* Remove p; returns its size, or 0 when p was never allocated here. */
static size_t alloc_table_take(struct mlens_cuda_ctx *c, void *p)
{
	if (!c->alloc_cap)
		return 0;
	for (size_t i = ptr_hash(p, c->alloc_cap);; i = (i + 1) & (c->alloc_cap - 1)) {
		if (!c->allocs[i].p)
			return 0;
		if (c->allocs[i].p == p) {
			size_t b = c->allocs[i].bytes;
			c->allocs[i].p = TOMBSTONE;	/* stays counted until a grow */
			return b;
		}
	}
}

/* cudaMalloc with accounting; errno set and NULL on failure. */
static void *dev_alloc(struct mlens_cuda_ctx *c, size_t bytes)
{
	void *p = NULL;
	cudaError_t e;
	int rc;

	if (!bytes)
		bytes = 256;
	e = cudaMalloc(&p, bytes);
	if (e != cudaSuccess) {
		errno = -mlens_cuda_rc(e, "cudaMalloc", __FILE__, __LINE__);
		return NULL;
	}
	rc = alloc_table_put(c, p, bytes);
	if (rc) {
		cudaFree(p);
		errno = -rc;
		return NULL;
	}
	c->bytes_in_use += bytes;
	return p;
}

static void dev_free(struct mlens_cuda_ctx *c, void *p)
{
	size_t b;
	if (!p)
		return;
	b = alloc_table_take(c, p);
	if (!b) {
		fprintf(stderr, "mlens cuda: free of %p, which this backend never allocated; ignored\n", p);
		return;
	}
	c->bytes_in_use -= b;
	cudaFree(p);	/* synchronises the device, so no kernel still uses p */
}

static void *cuda_alloc(void *ctx, size_t bytes)
{
	return dev_alloc((struct mlens_cuda_ctx *)ctx, bytes);
}

static void cuda_free(void *ctx, void *p)
{
	dev_free((struct mlens_cuda_ctx *)ctx, p);
}

/* Copies are complete on return: callers may reuse or free their host
 * buffers at once, as with the CPU backend. */
static int cuda_upload(void *ctx, void *dst, const void *src, size_t bytes)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	if (!bytes)
		return 0;
	CUDA_RET(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
	CUDA_RET(cudaStreamSynchronize(c->stream));
	return 0;
}

static int cuda_download(void *ctx, void *dst, const void *src, size_t bytes)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	if (!bytes)
		return 0;
	CUDA_RET(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
	CUDA_RET(cudaStreamSynchronize(c->stream));
	return 0;
}

static int cuda_sync(void *ctx)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	CUDA_RET(cudaStreamSynchronize(c->stream));
	/* copies on queue 2 read what the compute stream wrote, and queue 3's
	 * write what it reads */
	if (c->side_stream)
		CUDA_RET(cudaStreamSynchronize(c->side_stream));
	if (c->up_stream)
		CUDA_RET(cudaStreamSynchronize(c->up_stream));
	return 0;
}

/* ==== compute-stream copies ==== */

int mlens_cuda_device_view(const void *p, void **dev, bool *host)
{
	cudaPointerAttributes a;
	cudaError_t e = cudaPointerGetAttributes(&a, p);
	if (e != cudaSuccess) {
		cudaGetLastError();	/* clear only the lookup's own error */
		return -EFAULT;
	}
	if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) {
		*dev = (void *)p;
		*host = false;
		return 0;
	}
	if (a.type == cudaMemoryTypeHost && a.devicePointer) {
		*dev = (char *)a.devicePointer + ((const char *)p - (const char *)a.hostPointer);
		*host = true;
		return 0;
	}
	return -EFAULT;
}

/* A copy on stream st: with sm_copy and mapped host memory by the SMs
 * (in at most max_blocks blocks, 0: as many as pay), else a copy engine. */
static int copy_on(struct mlens_cuda_ctx *c, cudaStream_t st, unsigned max_blocks, void *dst,
		   const void *src, size_t bytes, bool to_device)
{
	if (!bytes)
		return 0;
	if (c->sm_copy) {
		void *mapped;
		bool host;
		if (!mlens_cuda_device_view(to_device ? src : dst, &mapped, &host) && host)
			return to_device ? mlens_cuda_sm_copy_on(c, st, dst, mapped, bytes, max_blocks)
					 : mlens_cuda_sm_copy_on(c, st, mapped, src, bytes, max_blocks);
		/* not mapped (pageable memory): a copy engine does it */
	}
	CUDA_RET(cudaMemcpyAsync(dst, src, bytes,
				 to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, st));
	return 0;
}

int mlens_cuda_copy(struct mlens_cuda_ctx *c, void *dst, const void *src, size_t bytes,
		    bool to_device)
{
	return copy_on(c, c->stream, 0, dst, src, bytes, to_device);
}

/* ==== staging and scratch ==== */

int mlens_cuda_stager_begin(struct mlens_cuda_ctx *c, struct cuda_stager *s, size_t bytes,
			    char **host, char **dev)
{
	struct cuda_stage_slot *sl = &s->slot[s->next];

	/* the copy that last read this slot must be done */
	CUDA_RET(cudaEventSynchronize(sl->done));
	if (bytes > sl->cap) {
		size_t cap = sl->cap ? sl->cap : 64 * 1024;
		char *h = NULL;
		while (cap < bytes)
			cap *= 2;
		bool host;
		CUDA_RET(cudaHostAlloc((void **)&h, cap, cudaHostAllocDefault));
		cudaFreeHost(sl->h);
		sl->h = h;
		sl->cap = cap;
		/* where a stager off the compute stream has the SMs read it
		 * (commit); cudaHostAlloc memory is mapped wherever UVA is */
		if (mlens_cuda_device_view(h, &sl->hd, &host))
			sl->hd = NULL;
	}
	if (bytes > s->d_cap) {
		size_t cap = s->d_cap ? s->d_cap : 64 * 1024;
		char *d;
		while (cap < bytes)
			cap *= 2;
		dev_free(c, s->d);	/* cudaFree waits for its readers */
		s->d = NULL;
		s->d_cap = 0;
		d = (char *)dev_alloc(c, cap);
		if (!d)
			return -errno;
		s->d = d;
		s->d_cap = cap;
	}
	*host = sl->h;
	*dev = s->d;
	return 0;
}

int mlens_cuda_stager_commit(struct mlens_cuda_ctx *c, struct cuda_stager *s, size_t used)
{
	struct cuda_stage_slot *sl = &s->slot[s->next];

	s->next = (s->next + 1) % MLENS_CUDA_STAGE_SLOTS;
	if (used) {
		int rc;
		/* the compute stream's copies go through mlens_cuda_copy
		 * (sm_copy or an engine); others by the SMs on their stream,
		 * reading the slot through its mapping: an H2D copy engine
		 * would queue them behind the weight stream's pieces (for
		 * milliseconds a group) */
		if (s == &c->stage)
			rc = mlens_cuda_copy(c, s->d, sl->h, used, true);
		else if (sl->hd)
			rc = mlens_cuda_sm_copy_on(c, s->stream, s->d, sl->hd, used, 0);
		else
			rc = mlens_cuda_rc(cudaErrorInvalidValue, "mapping a side staging slot",
					   __FILE__, __LINE__);
		if (rc)
			return rc;
	}
	CUDA_RET(cudaEventRecord(sl->done, s->stream));
	return 0;
}

int mlens_cuda_stage_begin(struct mlens_cuda_ctx *c, size_t bytes, char **host, char **dev)
{
	return mlens_cuda_stager_begin(c, &c->stage, bytes, host, dev);
}

int mlens_cuda_stage_commit(struct mlens_cuda_ctx *c, size_t used)
{
	return mlens_cuda_stager_commit(c, &c->stage, used);
}

/* The scratch at exactly cap bytes (cap 0: none). */
static int scratch_set(struct mlens_cuda_ctx *c, size_t cap)
{
	char *d = NULL;
	dev_free(c, c->d_scratch);	/* cudaFree waits for its users */
	c->d_scratch = NULL;
	c->scratch_cap = 0;
	if (cap && !(d = (char *)dev_alloc(c, cap)))
		return -errno;
	c->d_scratch = d;
	c->scratch_cap = cap;
	return 0;
}

int mlens_cuda_scratch(struct mlens_cuda_ctx *c, size_t bytes, char **dev)
{
	if (bytes > c->scratch_cap) {
		size_t cap = c->scratch_cap ? c->scratch_cap : 1 << 20;
		int rc;
		if (c->scratch_fixed) {
			fprintf(stderr, "mlens cuda: an op needs %zu bytes of scratch, past the %zu "
				"reserved\n", bytes, c->scratch_cap);
			return -ENOSPC;
		}
		while (cap < bytes)
			cap *= 2;
		if ((rc = scratch_set(c, cap)))
			return rc;
	}
	*dev = c->d_scratch;
	return 0;
}

static int cuda_scratch_reserve(void *ctx, size_t bytes)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	int rc = 0;
	if (bytes != c->scratch_cap)
		rc = scratch_set(c, bytes);
	c->scratch_fixed = bytes && !rc;
	return rc;
}

int mlens_cuda_back(struct mlens_cuda_ctx *c, size_t bytes, void **host)
{
	if (bytes > c->back_cap) {
		size_t cap = c->back_cap ? c->back_cap : 4096;
		void *h = NULL;
		while (cap < bytes)
			cap *= 2;
		/* a read-back is always waited for, so nothing uses the old area */
		CUDA_RET(cudaHostAlloc(&h, cap, cudaHostAllocDefault));
		cudaFreeHost(c->h_back);
		c->h_back = h;
		c->back_cap = cap;
	}
	*host = c->h_back;
	return 0;
}

/* ==== GEMM ==== */

static cudaDataType_t cuda_dtype(enum mlens_dtype dt)
{
	switch (dt) {
	case MLENS_DTYPE_F16: return CUDA_R_16F;
	case MLENS_DTYPE_BF16: return CUDA_R_16BF;
	case MLENS_DTYPE_E4M3: return CUDA_R_8F_E4M3;
	case MLENS_DTYPE_F32: break;
	}
	return CUDA_R_32F;
}

/* out[n][m] (+)= x[n][k] . W[m][k]^T with x already in W's dtype. Row-major
 * out is column-major [m][n]: out = W^T(op T on the [k][m] view) . x. */
static int gemm_typed_layout(struct mlens_cuda_ctx *c, void *out, enum mlens_dtype ot,
			     const void *x, const void *w, bool w_km, enum mlens_dtype dt, int n,
			     int k, int m, float alpha, float beta)
{
	cudaDataType_t t = cuda_dtype(dt);
	int ld = k > 0 ? k : 1;	/* cuBLAS wants ld >= 1 even for k = 0 */
	/* w_km: W stored [k][m] (DBRX's w2), column-major [m][k]: no op */
	CUBLAS_RET(cublasGemmEx(c->blas, w_km ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, m, n, k,
				&alpha, w, t, w_km ? (m > 0 ? m : 1) : ld, x, t, ld, &beta, out,
				cuda_dtype(ot), m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
	return 0;
}

static int gemm_typed_to(struct mlens_cuda_ctx *c, void *out, enum mlens_dtype ot, const void *x,
			 const void *w, enum mlens_dtype dt, int n, int k, int m, float alpha,
			 float beta)
{
	return gemm_typed_layout(c, out, ot, x, w, false, dt, n, k, m, alpha, beta);
}

/* The same with an fp32 output, as every product but the experts' gate
 * and up (mlens_moe_half_gu) has. */
static int gemm_typed(struct mlens_cuda_ctx *c, float *out, const void *x, const void *w,
		      enum mlens_dtype dt, int n, int k, int m, float alpha, float beta)
{
	return gemm_typed_to(c, out, MLENS_DTYPE_F32, x, w, dt, n, k, m, alpha, beta);
}

static int valid_dtype(enum mlens_dtype dt)
{
	return dt == MLENS_DTYPE_F32 || dt == MLENS_DTYPE_F16 || dt == MLENS_DTYPE_BF16;
}

/* The exact product from split activations (see the top of the file):
 * part j of x[n][k] is at xp + j * part_bytes. */
static int gemm_parts_layout(struct mlens_cuda_ctx *c, float *out, const char *xp,
			     size_t part_bytes, const void *w, bool w_km, enum mlens_dtype dt,
			     int n, int k, int m, float beta)
{
	const float inv = 1.0f / mlens_cuda_split_scale(dt);
	float alpha = inv * inv;
	int rc;

	/* smallest part first, so that each add sees the larger sum last */
	for (int j = MLENS_CUDA_SPLIT_PARTS - 1; j >= 0; j--) {
		rc = gemm_typed_layout(c, out, MLENS_DTYPE_F32, xp + (size_t)j * part_bytes, w, w_km,
				       dt, n, k, m, alpha, beta);
		if (rc)
			return rc;
		alpha *= mlens_cuda_split_scale(dt);
		beta = 1.0f;
	}
	return 0;
}

static int gemm_parts(struct mlens_cuda_ctx *c, float *out, const char *xp, size_t part_bytes,
		      const void *w, enum mlens_dtype dt, int n, int k, int m, float beta)
{
	return gemm_parts_layout(c, out, xp, part_bytes, w, false, dt, n, k, m, beta);
}

/* Output widths up to this run fp32 x fp32 on widened weights. */
#define GEMM_NARROW_M 64

/* x[n][k] as this context's products of bf16/f16 weights take it, in the
 * scratch: rounded to dt (fast GEMMs) or split into parts (exact). */
static int gemm_prep(struct mlens_cuda_ctx *c, const float *x, enum mlens_dtype dt, int n, int k,
		     char **xs)
{
	size_t part = (size_t)n * (size_t)k;
	int rc;

	if (c->gemm_exact) {
		if ((rc = mlens_cuda_scratch(c, MLENS_CUDA_SPLIT_PARTS * part * 2, xs)))
			return rc;
		return mlens_cuda_split_rows(c, *xs, dt, x, NULL, 1, n, k, part);
	}
	if ((rc = mlens_cuda_scratch(c, part * 2, xs)))
		return rc;
	return mlens_cuda_convert_rows(c, *xs, dt, x, NULL, 1, n, k);
}

/* One product from gemm_prep's xs. */
static int gemm_prepped(struct mlens_cuda_ctx *c, float *out, const char *xs, const void *w,
			enum mlens_dtype dt, int n, int k, int m, float beta)
{
	if (c->gemm_exact)
		return gemm_parts(c, out, xs, (size_t)n * (size_t)k * 2, w, dt, n, k, m, beta);
	return gemm_typed(c, out, xs, w, dt, n, k, m, 1.0f, beta);
}

static int cuda_gemm(void *ctx, float *out, const float *x, const void *w,
		     enum mlens_dtype dt, int n, int k, int m, bool accumulate)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	float beta = accumulate ? 1.0f : 0.0f;
	char *xs;
	int rc;

	if (n < 0 || k < 0 || m < 0 || !valid_dtype(dt))
		return -EINVAL;
	if (!n || !m)
		return 0;
	if (dt == MLENS_DTYPE_F32)
		return gemm_typed(c, out, x, w, dt, n, k, m, 1.0f, beta);
	if (m <= GEMM_NARROW_M) {
		/* few output columns (the router: one per expert) decide discrete
		 * things such as the top-k experts, where rounding the activations
		 * could flip a choice: widen the weights instead (exact), as cheap
		 * as the rounding at this width */
		rc = mlens_cuda_scratch(c, (size_t)m * (size_t)k * 4, &xs);
		if (rc)
			return rc;
		rc = mlens_cuda_widen(c, (float *)xs, w, dt, (size_t)m * (size_t)k);
		if (rc)
			return rc;
		return gemm_typed(c, out, x, xs, MLENS_DTYPE_F32, n, k, m, 1.0f, beta);
	}
	if ((rc = gemm_prep(c, x, dt, n, k, &xs)))
		return rc;
	return gemm_prepped(c, out, xs, w, dt, n, k, m, beta);
}

/* The products of one input: x rounded (or split) once into the scratch,
 * then each product as cuda_gemm runs it from there. fp32 weights and
 * the narrow products take x as it is: one cuda_gemm each. */
static int cuda_gemm_multi(void *ctx, float *const *out, const float *x, const void *const *w,
			   enum mlens_dtype dt, int n, int k, const int *m, int count)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	bool each = dt == MLENS_DTYPE_F32;
	char *xs;
	int rc;

	if (n < 0 || k < 0 || count < 1 || count > MLENS_GEMM_MULTI_MAX || !valid_dtype(dt))
		return -EINVAL;
	for (int i = 0; i < count; i++) {
		if (m[i] < 0)
			return -EINVAL;
		each = each || m[i] <= GEMM_NARROW_M;
	}
	if (!n)
		return 0;
	if (each) {
		for (int i = 0; i < count; i++)
			if ((rc = cuda_gemm(ctx, out[i], x, w[i], dt, n, k, m[i], false)))
				return rc;
		return 0;
	}
	if ((rc = gemm_prep(c, x, dt, n, k, &xs)))
		return rc;
	for (int i = 0; i < count; i++)
		if ((rc = gemm_prepped(c, out[i], xs, w[i], dt, n, k, m[i], 0.0f)))
			return rc;
	return 0;
}

/* x already in dt: the product cuda_gemm gives for the fp32 rows that
 * round to x (it rounds them with mlens_cuda_convert_rows, as cuda_round
 * does), where cuda_gemm rounds at all. */
static int cuda_gemm_half_in(void *ctx, float *out, const void *x, const void *w,
			     enum mlens_dtype dt, int n, int k, int m, bool accumulate)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;

	if (n < 0 || k < 0 || m < 0 || !valid_dtype(dt))
		return -EINVAL;
	if (dt == MLENS_DTYPE_F32 || c->gemm_exact || m <= GEMM_NARROW_M)
		return -ENOTSUP;
	if (!n || !m)
		return 0;
	return gemm_typed(c, out, x, w, dt, n, k, m, 1.0f, accumulate ? 1.0f : 0.0f);
}

static int cuda_round(void *ctx, void *dst, enum mlens_dtype dt, const float *src, int rows,
		      int cols)
{
	if (dt != MLENS_DTYPE_BF16 && dt != MLENS_DTYPE_F16)
		return -EINVAL;
	return mlens_cuda_convert_rows((struct mlens_cuda_ctx *)ctx, dst, dt, src, NULL, 1, rows,
				       cols);
}

/* ==== MoE ==== */

/* The n an fp8 GEMM's algorithm is cached for: n rounded up to a power of 2. */
static int lt_bucket(int n)
{
	int nb = 1;

	while (nb < n && nb < (1 << 30))
		nb *= 2;
	return nb;
}

/* The cuBLASLt algorithm for an fp8 GEMM of that shape, from the
 * context's cache or (once a shape, n rounded up to a power of 2) from
 * the heuristic; fresh: the heuristic for this very n, not cached (after
 * the cached one failed). NULL: none (-ENOTSUP in *rc; *cached when the
 * cache already knew) or an error. */
static const cublasLtMatmulAlgo_t *lt_algo(struct mlens_cuda_ctx *c, cublasLtMatmulDesc_t op,
					   cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
					   cublasLtMatrixLayout_t ld, enum mlens_dtype ot,
					   bool scaled, int n, int k, int m, bool fresh,
					   cublasLtMatmulAlgo_t *own, int *rc, bool *cached)
{
	struct mlens_cuda_lt_algo *a = NULL;
	cublasLtMatmulPreferenceOpaque_t po;
	cublasLtMatmulPreference_t pref = &po;
	cublasLtMatmulHeuristicResult_t hr;
	cublasLtMatrixLayoutOpaque_t lbo, ldo;
	int nb = lt_bucket(n);
	size_t ws = c->lt_ws ? c->blas_ws_bytes : 0;
	int found = 0;
	cublasStatus_t st;

	if (!fresh) {
		for (int i = 0; i < c->lt_algos; i++) {
			struct mlens_cuda_lt_algo *e = &c->lt_algo[i];
			if (e->k == k && e->m == m && e->nb == nb && e->ot == (int)ot &&
			    e->scaled == scaled) {
				*rc = e->found ? 0 : -ENOTSUP;
				*cached = true;
				return e->found ? &e->algo : NULL;
			}
		}
		/* the heuristic asked for the bucket's largest n: B and D both
		 * n_b columns (a problem whose B and D disagree on n is an
		 * invalid one, not one without an algorithm) */
		st = cublasLtMatrixLayoutInit(&lbo, CUDA_R_8F_E4M3, (uint64_t)k, (uint64_t)nb, k);
		if (st == CUBLAS_STATUS_SUCCESS)
			st = cublasLtMatrixLayoutInit(&ldo, ot == MLENS_DTYPE_BF16 ? CUDA_R_16BF
										  : CUDA_R_32F,
						      (uint64_t)m, (uint64_t)nb, m);
		if (st != CUBLAS_STATUS_SUCCESS) {
			*rc = mlens_cublas_rc(st, "fp8 GEMM layout", __FILE__, __LINE__);
			return NULL;
		}
		lb = &lbo;
		ld = &ldo;
		if (c->lt_algos < MLENS_CUDA_LT_ALGOS) {
			a = &c->lt_algo[c->lt_algos++];
		} else {
			a = &c->lt_algo[c->lt_next];
			c->lt_next = (c->lt_next + 1) % MLENS_CUDA_LT_ALGOS;
		}
		a->k = -1;	/* not an entry until filled below */
	}
	memset(&hr, 0, sizeof(hr));
	st = cublasLtMatmulPreferenceInit(pref);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
							  &ws, sizeof(ws));
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulAlgoGetHeuristic(c->lt, op, la, lb, ld, ld, pref, 1, &hr, &found);
	/* a combination this cuBLASLt does not take (scale modes, output
	 * type) reads INVALID_VALUE: no algorithm, as NOT_SUPPORTED */
	if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED &&
	    st != CUBLAS_STATUS_INVALID_VALUE) {
		*rc = mlens_cublas_rc(st, "fp8 GEMM heuristic", __FILE__, __LINE__);
		return NULL;	/* a stays unfilled (k = -1): asked again next time */
	}
	found = st == CUBLAS_STATUS_SUCCESS && found > 0;
	*rc = found ? 0 : -ENOTSUP;
	if (!found)
		c->lt_last_status = st == CUBLAS_STATUS_SUCCESS ? (int)CUBLAS_STATUS_NOT_SUPPORTED : (int)st;
	if (!a) {
		*own = hr.algo;
		return found ? own : NULL;
	}
	a->m = m;
	a->nb = nb;
	a->ot = (int)ot;
	a->scaled = scaled;
	a->found = found != 0;
	a->algo = hr.algo;
	a->k = k;
	return found ? &a->algo : NULL;
}

/* The cached scaled algorithm of that shape marked as none. */
static void lt_forget(struct mlens_cuda_ctx *c, int k, int m, int n, enum mlens_dtype ot)
{
	int nb = lt_bucket(n);

	for (int i = 0; i < c->lt_algos; i++) {
		struct mlens_cuda_lt_algo *e = &c->lt_algo[i];
		if (e->k == k && e->m == m && e->nb == nb && e->ot == (int)ot && e->scaled)
			e->found = false;
	}
}

/* out[n][m] (ot: fp32 or bf16) = x[n][k] . W[m][k]^T with both in e4m3 on
 * the tensor cores (cuBLASLt; fp32 accumulation). With xs and ws the
 * product is scaled in the epilogue by the per-token xs[n] and the
 * per-channel ws[m] (outer-vector scales, cuBLASLt from 12.9 on Hopper
 * and later); without them the scales are 1 and the caller applies its
 * own. The row-major operands are column-major W^T and x: a "TN" product,
 * as fp8 needs. out NULL: only whether cuBLASLt has an algorithm for it
 * (0 or -ENOTSUP). The algorithm is cached by shape (lt_algo). */
static int lt_gemm_fp8(struct mlens_cuda_ctx *c, void *out, enum mlens_dtype ot, const uint8_t *x,
		       const float *xs, const uint8_t *w, const float *ws, int n, int k, int m)
{
	cublasLtMatmulDesc_t op = NULL;
	cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
	const cublasLtMatmulAlgo_t *algo;
	cublasLtMatmulAlgo_t own;
	bool cached = false;
	cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
	cudaDataType_t dty = ot == MLENS_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
	const bool scaled = xs && ws;
	int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
	float one = 1.0f, zero = 0.0f;
	int rc = 0;
	cublasStatus_t st;

	if (n <= 0)
		return 0;
	st = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
	if (scaled) {
		/* A is W (m scales, one a channel), B is x (n, one a token) */
		if (st == CUBLAS_STATUS_SUCCESS)
			st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode,
							    sizeof(mode));
		if (st == CUBLAS_STATUS_SUCCESS)
			st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode,
							    sizeof(mode));
		if (st == CUBLAS_STATUS_SUCCESS)
			st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws,
							    sizeof(ws));
		if (st == CUBLAS_STATUS_SUCCESS)
			st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs,
							    sizeof(xs));
	}
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, (uint64_t)k, (uint64_t)m, k);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, (uint64_t)k, (uint64_t)n, k);
	if (st == CUBLAS_STATUS_SUCCESS)
		st = cublasLtMatrixLayoutCreate(&ld, dty, (uint64_t)m, (uint64_t)n, m);
	if (st != CUBLAS_STATUS_SUCCESS) {
		rc = st == CUBLAS_STATUS_NOT_SUPPORTED
			     ? -ENOTSUP
			     : mlens_cublas_rc(st, "fp8 GEMM set-up", __FILE__, __LINE__);
		goto out;
	}
	if (!out) {
		rc = lt_algo(c, op, la, lb, ld, ot, scaled, n, k, m, true, &own, &rc, &cached) ? 0
														: rc;
		goto out;
	}
	st = CUBLAS_STATUS_NOT_SUPPORTED;
	for (int fresh = 0; fresh < 2; fresh++) {
		/* none newly found for the bucket: this n's own may exist */
		if (!(algo = lt_algo(c, op, la, lb, ld, ot, scaled, n, k, m, fresh != 0, &own, &rc,
				     &cached))) {
			if (rc != -ENOTSUP || cached)
				goto out;
			continue;
		}
		st = cublasLtMatmul(c->lt, op, &one, w, la, x, lb, &zero, out, ld, out, ld, algo,
				    c->lt_ws, c->lt_ws ? c->blas_ws_bytes : 0, c->stream);
		if (st == CUBLAS_STATUS_SUCCESS)
			goto out;
		c->lt_last_status = (int)st;
		/* the bucket's algorithm may not take this n: this n's own */
		if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)
			break;
	}
	if (scaled && (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE)) {
		/* outer-vector scales refused at run time: the shape takes the
		 * unit-scale GEMM and a scale pass from now on */
		lt_forget(c, k, m, n, ot);
		rc = -ENOTSUP;
	} else {
		rc = st == CUBLAS_STATUS_NOT_SUPPORTED
			     ? -ENOTSUP
			     : mlens_cublas_rc(st, "fp8 GEMM", __FILE__, __LINE__);
	}
out:
	if (ld)
		cublasLtMatrixLayoutDestroy(ld);
	if (lb)
		cublasLtMatrixLayoutDestroy(lb);
	if (la)
		cublasLtMatrixLayoutDestroy(la);
	if (op)
		cublasLtMatmulDescDestroy(op);
	return rc;
}

static int gemm_fp8_scaled(struct mlens_cuda_ctx *c, void *out, enum mlens_dtype ot,
			   const uint8_t *x, const float *xs, const uint8_t *w, const float *ws,
			   int n, int k, int m);

/* Whether the fp8 GEMMs the MoE runs work here: one product of each kind
 * (bf16 gate/up out, fp32 down out; per-row and per-channel scales, or
 * the scale pass where cuBLASLt has no such scales) on ones, checked on
 * the host. A library or driver that takes the descriptors but fails the
 * products leaves fp8 experts on the dequantize path instead of failing
 * steps. */
static bool lt_selftest(struct mlens_cuda_ctx *c)
{
	enum { N = 48, K = 256, M = 128 };
	size_t o_x = 0, o_w = o_x + N * K, o_xs = o_w + M * K, o_ws = o_xs + 256, o_d = o_ws + M * 4;
	size_t bytes = o_d + (size_t)N * M * 4;
	float hs[M > N ? M : N], *hd = (float *)malloc((size_t)N * M * 4);
	uint16_t *hb = (uint16_t *)hd;
	char *d = NULL;
	bool ok = hd && cudaMalloc((void **)&d, bytes) == cudaSuccess;
	int rc = 0;

	/* e4m3 0x38 is 1.0; scales 0.5 (channels) and 2 (rows): every
	 * product is K, exact in bf16 and fp32 */
	ok = ok && cudaMemset(d + o_x, 0x38, (size_t)(M + N) * K) == cudaSuccess;
	for (int i = 0; ok && i < (M > N ? M : N); i++)
		hs[i] = 2.0f;
	ok = ok && cudaMemcpy(d + o_xs, hs, N * 4, cudaMemcpyHostToDevice) == cudaSuccess;
	for (int i = 0; ok && i < M; i++)
		hs[i] = 0.5f;
	ok = ok && cudaMemcpy(d + o_ws, hs, M * 4, cudaMemcpyHostToDevice) == cudaSuccess;
	for (int t = 0; ok && t < 2; t++) {
		enum mlens_dtype ot = t ? MLENS_DTYPE_F32 : MLENS_DTYPE_BF16;
		rc = gemm_fp8_scaled(c, d + o_d, ot, (const uint8_t *)d + o_x, (const float *)(d + o_xs),
				     (const uint8_t *)d + o_w, (const float *)(d + o_ws), N, K, M);
		ok = !rc && cudaStreamSynchronize(c->stream) == cudaSuccess &&
		     cudaMemcpy(hd, d + o_d, (size_t)N * M * (t ? 4 : 2), cudaMemcpyDeviceToHost) ==
			     cudaSuccess;
		for (int i = 0; ok && i < N * M; i++) {
			float v = hd[i];
			if (!t) {
				uint32_t u = (uint32_t)hb[i] << 16;
				memcpy(&v, &u, 4);
			}
			ok = v == (float)K;
		}
	}
	if (d)
		cudaFree(d);
	free(hd);
	(void)cudaGetLastError();	/* a failed product's error is not the context's */
	if (!ok)
		fprintf(stderr, "mlens cuda: the fp8 GEMMs failed their check (%s%s%s); fp8 experts "
			"are dequantized\n", rc ? strerror(-rc) : "wrong products",
			c->lt_last_status ? ", cuBLASLt: " : "",
			c->lt_last_status ? cublasGetStatusString((cublasStatus_t)c->lt_last_status)
					  : "");
	return ok;
}

/* fp8 experts on the tensor cores (opts fp8_gemm auto or fp8, a device
 * that has them): fast GEMMs of a 16-bit model, one scale a row
 * (per-tensor scales are one a row since load; block scales take the
 * dequantize path), sizes the fp8 GEMMs take. */
static bool moe_fp8_tc(const struct mlens_cuda_ctx *c, const struct mlens_moe_weights *w)
{
	return w->dtype == MLENS_DTYPE_E4M3 && c->fp8_tc && !c->gemm_exact &&
	       w->model_dtype != MLENS_DTYPE_F32 && w->scale.kind == MLENS_WSCALE_CHANNEL &&
	       !(w->hidden % 16) && !(w->inter % 16);
}

/* The dtype fp8 experts are dequantized to for the GEMMs: bf16 for fast
 * GEMMs of a 16-bit model (activations rounded to bf16, as its other
 * GEMMs round them), fp32 for exact GEMMs or an fp32 model (the CPU's
 * numerics to fp32 rounding). */
static enum mlens_dtype moe_fp8_dtype(const struct mlens_cuda_ctx *c,
				      const struct mlens_moe_weights *w)
{
	return c->gemm_exact || w->model_dtype == MLENS_DTYPE_F32
		       ? MLENS_DTYPE_F32
		       : MLENS_DTYPE_BF16;
}

/* One expert's product out[n][m] = x[n][k] . W^T, x in W's dtype; with
 * part_bytes set, x is split (parts that far apart) and the product exact;
 * out of dtype ot (fp32 when split). */
static int expert_gemm(struct mlens_cuda_ctx *c, void *out, enum mlens_dtype ot, const char *x,
		       size_t part_bytes, const void *w, bool w_km, enum mlens_dtype dt, int n,
		       int k, int m)
{
	if (part_bytes)
		return gemm_parts_layout(c, (float *)out, x, part_bytes, w, w_km, dt, n, k, m, 0.0f);
	return gemm_typed_layout(c, out, ot, x, w, w_km, dt, n, k, m, 1.0f, 0.0f);
}

/* Make MoE stream i the one that the launchers and cuBLAS use, with its
 * own cuBLAS workspace (cublasSetStream drops the workspace we set). */
static int moe_use_stream(struct mlens_cuda_ctx *c, int i)
{
	c->stream = c->moe_stream[i];
	c->lt_ws = (char *)c->blas_ws + (size_t)i * c->blas_ws_bytes;	/* cuBLASLt's too */
	CUBLAS_RET(cublasSetStream(c->blas, c->stream));
	CUBLAS_RET(cublasSetWorkspace(c->blas, (char *)c->blas_ws + (size_t)i * c->blas_ws_bytes,
				      c->blas_ws_bytes));
	return 0;
}

/* Where one MoE stream's experts put their gate, up and silu(g) * u: a
 * piece of at most piece rows, reused expert after expert on that stream
 * (the stream's order keeps them apart). */
struct moe_piece {
	char *g, *u, *h;	/* h == g when silu(g) * u goes over g */
	size_t rows;
	char *wd;		/* fp8 experts: the stream's expert dequantized */
	/* fp8 experts on tensor cores: silu(g) * u quantized, its row scales,
	 * room for aligned copies of a GEMM's scale vectors (rows + the
	 * wider of hidden and inter floats) */
	uint8_t *hq;
	float *hs, *sc;
	const float *xs;	/* the chunk's row scales (xe its quantized rows) */
};

/* p (count scales), or where it is not 16-byte aligned (a MoE chunk's
 * row scales from an expert's first row on), its copy at dst: cuBLASLt's
 * scale vectors are read as its other operands are. */
static const float *aligned_scales(struct mlens_cuda_ctx *c, float *dst, const float *p,
				   size_t count, int *rc)
{
	cudaError_t e;

	if (*rc || !((uintptr_t)p & 15))
		return p;
	e = cudaMemcpyAsync(dst, p, count * 4, cudaMemcpyDeviceToDevice, c->stream);
	if (e != cudaSuccess)
		*rc = mlens_cuda_rc(e, "fp8 scales copy", __FILE__, __LINE__);
	return dst;
}

/* out[n][m] (ot: fp32 or bf16) = x[n][k] . W[m][k]^T scaled by xs[n] x
 * ws[m]: the scales in the fp8 GEMM's epilogue, or where cuBLASLt has no
 * such GEMM, unit scales and a scale pass over out (a bf16 out is then
 * rounded twice). */
static int gemm_fp8_scaled(struct mlens_cuda_ctx *c, void *out, enum mlens_dtype ot,
			   const uint8_t *x, const float *xs, const uint8_t *w, const float *ws,
			   int n, int k, int m)
{
	int rc = lt_gemm_fp8(c, out, ot, x, xs, w, ws, n, k, m);

	if (rc != -ENOTSUP)
		return rc;
	if (!c->lt_unscaled_said) {
		c->lt_unscaled_said = true;
		fprintf(stderr, "mlens cuda: cuBLASLt scales no %s fp8 GEMM [%d x %d] per row and "
			"channel; its scales take a pass of their own\n", mlens_dtype_name(ot), m, k);
	}
	if ((rc = lt_gemm_fp8(c, out, ot, x, NULL, w, NULL, n, k, m)))
		return rc;
	return mlens_cuda_scale_outer(c, out, ot, out, xs, ws, n, m);
}

/* The rows [r, r + n) of expert e on the fp8 tensor cores: xq/xs the
 * chunk's rows quantized per token (once for every expert), gate and up as
 * fp8 GEMMs scaled back in their epilogue (token scale x channel scale)
 * into bf16, silu(g) * u and its quantization per token in one kernel, the
 * down GEMM into y in fp32 (the combine reads it). */
static int expert_fp8(struct mlens_cuda_ctx *c, const struct mlens_moe_weights *w, int e,
		      const uint8_t *xq, const float *xs, size_t r, int n,
		      const struct moe_piece *pc, float *y)
{
	int H = w->hidden, I = w->inter, rc = 0;
	float *wsc = pc->sc + ((pc->rows + 3) & ~(size_t)3);
	const uint8_t *x = xq + r * H;
	const float *rs = aligned_scales(c, pc->sc, xs + r, (size_t)n, &rc), *cs;

	/* each weight's scales copied (where they must be) behind the GEMM
	 * before, in stream order */
	cs = aligned_scales(c, wsc, w->s1[e], (size_t)I, &rc);
	if (rc || (rc = gemm_fp8_scaled(c, pc->g, MLENS_DTYPE_BF16, x, rs, (const uint8_t *)w->w1[e],
					 cs, n, H, I)))
		return rc;
	cs = aligned_scales(c, wsc, w->s3[e], (size_t)I, &rc);
	if (rc || (rc = gemm_fp8_scaled(c, pc->u, MLENS_DTYPE_BF16, x, rs, (const uint8_t *)w->w3[e],
					 cs, n, H, I)) ||
	    (rc = mlens_cuda_silu_mul_quant_fp8(c, pc->hq, pc->hs, pc->g, pc->u, MLENS_DTYPE_BF16, n,
						I)))
		return rc;
	cs = aligned_scales(c, wsc, w->s2[e], (size_t)H, &rc);
	if (rc)
		return rc;
	return gemm_fp8_scaled(c, y + r * H, MLENS_DTYPE_F32, pc->hq, pc->hs,
			       (const uint8_t *)w->w2[e], cs, n, I, H);
}

/* The rows of the experts in [e0, e1) (r0 the first) through gate, up,
 * silu(g) * u and down, on the current stream; an expert with more rows
 * than the piece holds runs in pieces of about equal rows. */
static int moe_experts(struct mlens_cuda_ctx *c, const struct mlens_moe_weights *w,
		       const int32_t *counts, int e0, int e1, int r0, size_t rows, bool split,
		       bool half_gu, const char *xe, const struct moe_piece *pc, float *y)
{
	int H = w->hidden, I = w->inter, rc;
	const bool fp8 = w->dtype == MLENS_DTYPE_E4M3, tc = moe_fp8_tc(c, w);
	const enum mlens_dtype cdt = fp8 ? moe_fp8_dtype(c, w) : w->dtype;	/* the GEMMs' */
	size_t es = mlens_dtype_size(cdt), mat = (size_t)H * I * es;
	enum mlens_dtype gdt = half_gu ? cdt : MLENS_DTYPE_F32;
	size_t xpart = split ? rows * H * es : 0, hpart = split ? pc->rows * I * es : 0;

	for (int e = e0; e < e1; r0 += counts[e], e++) {
		size_t cnt = (size_t)counts[e], pieces = (cnt + pc->rows - 1) / pc->rows;
		size_t each = pieces ? (cnt + pieces - 1) / pieces : 0;
		const void *w1 = w->w1[e], *w2 = w->w2[e], *w3 = w->w3[e];
		if (tc) {
			for (size_t off = 0; off < cnt; off += each) {
				int n = (int)(cnt - off < each ? cnt - off : each);
				if ((rc = expert_fp8(c, w, e, (const uint8_t *)xe, pc->xs,
						     (size_t)r0 + off, n, pc, y)))
					return rc;
			}
			continue;
		}
		if (fp8 && cnt) {
			/* queued on this stream behind its previous expert's GEMMs */
			if ((rc = mlens_cuda_dequant_fp8(c, pc->wd, cdt, (const uint8_t *)w1, w->s1[e],
							 &w->scale, I, H)) ||
			    (rc = mlens_cuda_dequant_fp8(c, pc->wd + mat, cdt, (const uint8_t *)w3,
							 w->s3[e], &w->scale, I, H)) ||
			    (rc = mlens_cuda_dequant_fp8(c, pc->wd + 2 * mat, cdt, (const uint8_t *)w2,
							 w->s2[e], &w->scale, H, I)))
				return rc;
			w1 = pc->wd;
			w3 = pc->wd + mat;
			w2 = pc->wd + 2 * mat;
		}
		for (size_t off = 0; off < cnt; off += each) {
			int n = (int)(cnt - off < each ? cnt - off : each);
			size_t r = (size_t)r0 + off;
			/* gate and up as two calls: one strided-batched call of
			 * both ran slower (bench_cuda moe-gemm, "gu batched") */
			if ((rc = expert_gemm(c, pc->g, gdt, xe + r * H * es, xpart, w1, false, cdt,
					      n, H, I)) ||
			    (rc = expert_gemm(c, pc->u, gdt, xe + r * H * es, xpart, w3, false, cdt,
					      n, H, I)))
				return rc;
			if (split) {
				/* the product in fp32 over g, then split for the down GEMM */
				if ((rc = mlens_cuda_silu_mul(c, pc->g, MLENS_DTYPE_F32, pc->g, pc->u,
							      MLENS_DTYPE_F32, (size_t)n * I)) ||
				    (rc = mlens_cuda_split_rows(c, pc->h, cdt, (const float *)pc->g,
								NULL, 1, n, I, pc->rows * I)))
					return rc;
			} else if ((rc = mlens_cuda_silu_mul(c, pc->h, cdt, pc->g, pc->u, gdt,
							     (size_t)n * I))) {
				return rc;
			}
			if ((rc = expert_gemm(c, y + r * H, MLENS_DTYPE_F32, pc->h, hpart, w2,
					      w->w2_transposed, cdt, n, I, H)))
				return rc;
		}
	}
	return 0;
}

/* The experts split into moe_streams runs of about equal rows, run i on MoE
 * stream i with piece i; the compute stream waits for all of them. */
static int moe_spread(struct mlens_cuda_ctx *c, const struct mlens_moe_weights *w,
		      const int32_t *counts, size_t rows, bool split, bool half_gu, const char *xe,
		      const struct moe_piece *pc, float *y)
{
	int S = c->moe_streams, E = w->n_experts, e0 = 0, r0 = 0, used = 0, rc = 0, rc2;

	if (S <= 1)
		return moe_experts(c, w, counts, 0, E, 0, rows, split, half_gu, xe, pc, y);
	CUDA_RET(cudaEventRecord(c->moe_fork, c->moe_stream[0]));
	for (int i = 0; i < S && e0 < E && !rc; i++) {
		/* run i ends where the rows so far pass i + 1 shares of the total */
		size_t want = rows * (size_t)(i + 1) / (size_t)S;
		int e1 = e0, r1 = r0;
		while (e1 < E && (i == S - 1 || (size_t)r1 < want || e1 == e0))
			r1 += counts[e1++];
		cudaError_t ce = i ? cudaStreamWaitEvent(c->moe_stream[i], c->moe_fork, 0) : cudaSuccess;
		if (ce != cudaSuccess)
			rc = mlens_cuda_rc(ce, "MoE stream fork", __FILE__, __LINE__);
		if (!rc && !(rc = moe_use_stream(c, i)))
			rc = moe_experts(c, w, counts, e0, e1, r0, rows, split, half_gu, xe, &pc[i], y);
		used = i + 1;
		e0 = e1;
		r0 = r1;
	}
	/* back on the compute stream, after every stream that got work, even
	 * on failure: the scratch must not be reused under a running GEMM */
	rc2 = moe_use_stream(c, 0);
	for (int i = 1; i < used; i++) {
		cudaError_t e = cudaEventRecord(c->moe_join[i], c->moe_stream[i]);
		if (e == cudaSuccess)
			e = cudaStreamWaitEvent(c->moe_stream[0], c->moe_join[i], 0);
		if (e != cudaSuccess && !rc2)
			rc2 = mlens_cuda_rc(e, "MoE stream join", __FILE__, __LINE__);
	}
	return rc ? rc : rc2;
}

/* Tokens are permuted into expert order on the GPU (stable in token order,
 * as the CPU gathers them), each expert runs three GEMMs over its tokens
 * (experts spread over the MoE streams, each stream with its own piece of
 * gate/up scratch: mlens_moe_piece_rows), and the combine kernel adds the
 * experts back into each token's row in id order. Expert row counts are
 * read back (one small copy and a wait) because cuBLAS takes GEMM sizes on
 * the host. */
static int moe_chunk(struct mlens_cuda_ctx *c, float *out, const float *x, int n,
		     const int32_t *ids, const float *weights, int k,
		     const struct mlens_moe_weights *w)
{
	int E = w->n_experts, H = w->hidden, I = w->inter, S = c->moe_streams;
	const bool fp8 = w->dtype == MLENS_DTYPE_E4M3, tc = moe_fp8_tc(c, w);
	/* fp8 experts run through the GEMMs of their dequantized copy, or on
	 * fp8 tensor cores (tc: the rows quantized, no copy) */
	const enum mlens_dtype cdt = fp8 ? moe_fp8_dtype(c, w) : w->dtype;
	size_t es = mlens_dtype_size(cdt), rows = (size_t)n * (size_t)k;
	/* exact: split copies of the inputs, and the silu product in fp32 (in
	 * place of g) before it is split too */
	bool split = c->gemm_exact && cdt != MLENS_DTYPE_F32;
	bool half_gu = mlens_moe_half_gu(c->gemm_exact ? MLENS_GEMM_EXACT : MLENS_GEMM_FAST, es);
	size_t np = split ? MLENS_CUDA_SPLIT_PARTS : 1, gs = half_gu ? es : 4;
	size_t o_counts, o_perm, o_inv, o_xe, o_xs, o_g, o_u, o_h, o_y, o_wd, total, prow, gsl, hsl;
	size_t psl = 0;
	size_t wdsl = fp8 && !tc ? mlens_moe_fp8_dequant_bytes(H, I, 1, cdt == MLENS_DTYPE_F32
									? MLENS_GEMM_EXACT
									: MLENS_GEMM_FAST)
			  : 0;
	struct moe_piece pc[MLENS_MOE_STREAMS_MAX];
	int32_t *counts_h;
	char *s;
	int rc, r0;

	if (n < 0 || k <= 0 || E <= 0 || E > 1024 || H <= 0 || I <= 0 ||
	    !(valid_dtype(w->dtype) || (fp8 && w->s1 && w->s2 && w->s3)))
		return -EINVAL;
	if (fp8 && w->w2_transposed)
		return -ENOTSUP;	/* the loader refuses fp8 experts stored transposed */
	if (!n)
		return 0;
	if (S < 1 || S > MLENS_MOE_STREAMS_MAX)
		return -EINVAL;	/* checked when the context was made */
	/* the layout that mlens_gpu_plan_moe_scratch (daemon/plan/gpu_plan.c) counts:
	 * the pieces are slices of one area of MLENS_CUDA_MOE_GU_ROWS rows, each
	 * slice aligned */
	prow = mlens_moe_piece_rows(rows, S);
	gsl = mlens_cuda_align(prow * I * gs);
	hsl = mlens_cuda_align(np * prow * I * es);
	o_counts = 0;
	o_perm = mlens_cuda_align(o_counts + (size_t)E * 4);
	o_inv = mlens_cuda_align(o_perm + rows * 4);
	o_xe = mlens_cuda_align(o_inv + rows * 4);
	if (tc) {
		/* the rows in e4m3 and their scales, then one piece a stream
		 * (mlens_moe_fp8_tc_piece_bytes) */
		psl = mlens_moe_fp8_tc_piece_bytes(prow, H, I);
		o_xs = mlens_cuda_align(o_xe + rows * H);
		o_g = mlens_cuda_align(o_xs + rows * 4);
		o_u = o_h = o_g;
		o_y = o_g + (size_t)S * psl;
	} else {
		o_xs = o_xe;
		o_g = mlens_cuda_align(o_xe + np * rows * H * es);
		o_u = o_g + (size_t)S * gsl;
		o_h = o_u + (size_t)S * gsl;
		o_y = half_gu ? o_h : o_h + (size_t)S * hsl;
	}
	o_wd = mlens_cuda_align(o_y + rows * H * 4);
	total = mlens_cuda_align(o_wd + (size_t)S * wdsl);
	if ((rc = mlens_cuda_scratch(c, total, &s)))
		return rc;
	int32_t *counts = (int32_t *)(s + o_counts), *perm = (int32_t *)(s + o_perm);
	int32_t *inv = (int32_t *)(s + o_inv);
	char *xe = s + o_xe;
	float *y = (float *)(s + o_y);
	for (int i = 0; i < S; i++) {
		pc[i].g = s + o_g + (size_t)i * gsl;
		pc[i].u = s + o_u + (size_t)i * gsl;
		/* silu(g) * u over g, element by element, when it fits */
		pc[i].h = half_gu ? pc[i].g : s + o_h + (size_t)i * hsl;
		pc[i].rows = prow;
		pc[i].wd = s + o_wd + (size_t)i * wdsl;
		pc[i].hq = NULL;
		pc[i].hs = pc[i].sc = NULL;
		pc[i].xs = (const float *)(s + o_xs);
		if (tc) {
			size_t gu = mlens_cuda_align(prow * I * 2);
			char *b = s + o_g + (size_t)i * psl;
			pc[i].g = pc[i].h = b;
			pc[i].u = b + gu;
			pc[i].hq = (uint8_t *)(b + 2 * gu);
			pc[i].hs = (float *)(b + 2 * gu + mlens_cuda_align(prow * I));
			pc[i].sc = (float *)((char *)pc[i].hs + mlens_cuda_align(prow * 4));
		}
	}

	if ((rc = mlens_cuda_moe_route(c, counts, perm, inv, ids, n, k, E)))
		return rc;
	if ((rc = mlens_cuda_back(c, (size_t)E * 4, (void **)&counts_h)))
		return rc;
	if ((rc = mlens_cuda_copy(c, counts_h, counts, (size_t)E * 4, false)))
		return rc;
	CUDA_RET(cudaEventRecord(c->moe_counts, c->stream));
	/* gather x rows into expert order, already in the weights' dtype (it
	 * needs only perm): queued before the host waits for the counts, so
	 * the GPU has it to do while the host wakes and launches the GEMMs */
	/* (fp8 tensor cores: quantized, once for all the experts) */
	rc = tc	     ? mlens_cuda_quant_gather_fp8(c, (uint8_t *)xe, (float *)(s + o_xs), x, perm, k,
						   (int)rows, H)
	     : split ? mlens_cuda_split_rows(c, xe, cdt, x, perm, k, (int)rows, H, rows * H)
		     : mlens_cuda_convert_rows(c, xe, cdt, x, perm, k, (int)rows, H);
	if (rc)
		return rc;
	CUDA_RET(cudaEventSynchronize(c->moe_counts));
	r0 = 0;
	for (int e = 0; e < E; e++) {
		if (counts_h[e] && (!w->w1[e] || !w->w2[e] || !w->w3[e] ||
				    (fp8 && (!w->s1[e] || !w->s2[e] || !w->s3[e]))))
			return -EFAULT;	/* a routed expert has no weights (or scales) here */
		r0 += counts_h[e];
	}
	if (w->tally)
		for (int e = 0; e < E; e++)
			w->tally[e] += (uint64_t)counts_h[e];
	if ((size_t)r0 != rows) {
		/* the CPU skips such rows; a caller never means to send them */
		fprintf(stderr, "mlens cuda: moe: %zu of %zu routed rows name no expert below %d\n",
			rows - (size_t)r0, rows, E);
		return -EINVAL;
	}
	/* many experts: grouped GEMMs (moe_grouped.cu) in waves through the
	 * pieces' gate/up areas and y (written only at the end), one area */
	rc = mlens_cuda_moe_grouped_use(c, w, counts_h)
		     ? mlens_cuda_moe_grouped(c, w, counts_h, rows, xe, s + o_g,
					      o_y + rows * H * 4 - o_g, y)
		     : -ENOTSUP;
	if (rc == -ENOTSUP)
		rc = moe_spread(c, w, counts_h, rows, split, half_gu, xe, pc, y);
	if (rc)
		return rc;
	return mlens_cuda_moe_combine(c, out, y, ids, weights, inv, n, k, H);
}

static bool cuda_fp8_tc(void *ctx)
{
	const struct mlens_cuda_ctx *c = (const struct mlens_cuda_ctx *)ctx;
	return c->fp8_tc && !c->gemm_exact;
}

/* Tokens go through in chunks of MLENS_CUDA_MOE_CHUNK_TOKENS (backend.h). */
static int cuda_moe(void *ctx, float *out, const float *x, int n, const int32_t *ids,
		    const float *weights, int k, const struct mlens_moe_weights *w)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	if (n < 0 || k <= 0 || w->hidden <= 0)
		return -EINVAL;
	for (int t0 = 0; t0 < n; t0 += MLENS_CUDA_MOE_CHUNK_TOKENS) {
		int cnt = n - t0 < MLENS_CUDA_MOE_CHUNK_TOKENS ? n - t0 : MLENS_CUDA_MOE_CHUNK_TOKENS;
		size_t xo = (size_t)t0 * w->hidden, ro = (size_t)t0 * k;
		int rc = moe_chunk(c, out + xo, x + xo, cnt, ids + ro, weights + ro, k, w);
		if (rc)
			return rc;
	}
	return 0;
}

/* ==== sampling ==== */

/* Greedy rows are decided on the GPU; rows with a temperature download
 * their logits and go through the CPU rules, so draws match the CPU. */
static int cuda_sample(void *ctx, int32_t *tokens, float *logprobs, const float *logits,
		       int n, int vocab, const struct mlens_sampling *params)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	size_t o_lp = mlens_cuda_align((size_t)n * 4);
	char *s;
	void *back;
	int rc;

	if (n < 0 || vocab <= 0)
		return -EINVAL;
	if (!n)
		return 0;
	if ((rc = mlens_cuda_scratch(c, o_lp + (size_t)n * 4, &s)))
		return rc;
	if ((rc = mlens_cuda_argmax(c, (int32_t *)s, (float *)(s + o_lp), logits, n, vocab)))
		return rc;
	if ((rc = mlens_cuda_back(c, (size_t)n * 8, &back)))
		return rc;
	if ((rc = mlens_cuda_copy(c, back, s, (size_t)n * 4, false)) ||
	    (rc = mlens_cuda_copy(c, (char *)back + (size_t)n * 4, s + o_lp, (size_t)n * 4, false)))
		return rc;
	CUDA_RET(cudaStreamSynchronize(c->stream));
	memcpy(tokens, back, (size_t)n * 4);
	if (logprobs)
		memcpy(logprobs, (char *)back + (size_t)n * 4, (size_t)n * 4);

	for (int i = 0; i < n; i++) {
		size_t need = (size_t)vocab * 12;	/* logits + CPU scratch */
		float *row;
		if (params[i].temperature <= 0.0f)
			continue;
		if (need > c->sample_cap) {
			void *p = NULL;
			CUDA_RET(cudaHostAlloc(&p, need, cudaHostAllocDefault));
			cudaFreeHost(c->h_sample);
			c->h_sample = p;
			c->sample_cap = need;
		}
		row = (float *)c->h_sample;
		if ((rc = mlens_cuda_copy(c, row, logits + (size_t)i * vocab, (size_t)vocab * 4, false)))
			return rc;
		CUDA_RET(cudaStreamSynchronize(c->stream));
		tokens[i] = mlens_cpu_sample_row(row, vocab, &params[i],
						 logprobs ? &logprobs[i] : NULL, row + vocab);
	}
	return 0;
}

/* ==== thin op wrappers ==== */

static int cuda_embed(void *ctx, float *out, const void *table, enum mlens_dtype dt,
		      int dim, const int32_t *tokens, int n)
{
	return mlens_cuda_embed((struct mlens_cuda_ctx *)ctx, out, table, dt, dim, tokens, n);
}

static int cuda_layernorm(void *ctx, float *out, const float *x, const void *w,
			  enum mlens_dtype dt, int n, int dim, float eps)
{
	return mlens_cuda_layernorm((struct mlens_cuda_ctx *)ctx, out, x, w, dt, n, dim, eps);
}

static int cuda_rmsnorm(void *ctx, float *out, const float *x, const void *w,
			enum mlens_dtype dt, int n, int dim, float eps)
{
	return mlens_cuda_rmsnorm((struct mlens_cuda_ctx *)ctx, out, x, w, dt, n, dim, eps);
}

static int cuda_rope(void *ctx, float *x, const int32_t *pos, int n, int n_heads,
		     int head_dim, float theta)
{
	return mlens_cuda_rope((struct mlens_cuda_ctx *)ctx, x, pos, n, n_heads, head_dim, theta);
}

static int cuda_router(void *ctx, int32_t *ids, float *weights, const float *logits,
		       int n, int n_experts, int k, bool renorm)
{
	return mlens_cuda_router((struct mlens_cuda_ctx *)ctx, ids, weights, logits, n,
				 n_experts, k, renorm);
}

static int cuda_bias_add(void *ctx, float *x, const void *b, enum mlens_dtype dt, int n, int dim)
{
	return mlens_cuda_bias_add((struct mlens_cuda_ctx *)ctx, x, b, dt, n, dim);
}

static int cuda_clamp(void *ctx, float *x, size_t count, float limit)
{
	return mlens_cuda_clamp((struct mlens_cuda_ctx *)ctx, x, count, limit);
}

static int cuda_route_one(void *ctx, int32_t *ids, float *weights, const float *logits, int n)
{
	return mlens_cuda_route_one((struct mlens_cuda_ctx *)ctx, ids, weights, logits, n);
}

static int cuda_attn_prefill(void *ctx, float *out, const float *q, const float *k,
			     const float *v, const int32_t *cu_seqlens, int n_seqs,
			     int n_heads, int n_kv_heads, int head_dim, float scale)
{
	return mlens_cuda_attn_prefill((struct mlens_cuda_ctx *)ctx, out, q, k, v, cu_seqlens,
				       n_seqs, n_heads, n_kv_heads, head_dim, scale);
}

static int cuda_kv_append(void *ctx, struct mlens_kv_cache *kv, int layer,
			  const float *k, const float *v, const int64_t *slots, int n)
{
	return mlens_cuda_kv_append((struct mlens_cuda_ctx *)ctx, kv, layer, k, v, slots, n);
}

static int cuda_kv_append_side(void *ctx, struct mlens_kv_cache *kv, int layer,
			       const float *k, const float *v, const int64_t *slots, int n)
{
	return mlens_cuda_kv_append_side((struct mlens_cuda_ctx *)ctx, kv, layer, k, v, slots, n);
}

static int cuda_attn_decode(void *ctx, float *out, const float *q,
			    const struct mlens_kv_cache *kv, int layer,
			    const struct mlens_attn_query *queries, int n, int n_heads,
			    float scale)
{
	return mlens_cuda_attn_decode((struct mlens_cuda_ctx *)ctx, out, q, kv, layer, queries,
				      n, n_heads, scale);
}

/* ==== queues and events (the hybrid pipeline) ==== */

/* Queue 0 is the compute stream itself (moe_stream[0]), never c->stream:
 * the MoE points c->stream at its other streams while it launches their
 * experts, and the pipeline's host thread queues copies on queue 0 then
 * (C's output, gpu_copy_out = compute or down), which must land on the
 * compute stream ahead of the GB that reads them. */
static cudaStream_t queue_stream(struct mlens_cuda_ctx *c, int queue)
{
	return queue == 1 ? c->copy_stream : queue == 2 ? c->side_stream :
	       queue == 3 ? c->up_stream : c->moe_stream[0];
}

static int cuda_host_register(void *ctx, void *p, size_t bytes)
{
	cudaError_t e;
	(void)ctx;
	e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
	if (e != cudaSuccess) {
		cudaGetLastError();
		/* read-only file mappings pin only as read-only */
		e = cudaHostRegister(p, bytes, cudaHostRegisterReadOnly);
	}
	if (e == cudaErrorHostMemoryAlreadyRegistered) {
		cudaGetLastError();
		return -EEXIST;
	}
	CUDA_RET(e);
	return 0;
}

static void cuda_host_unregister(void *ctx, void *p)
{
	(void)ctx;
	if (cudaHostUnregister(p) != cudaSuccess)
		cudaGetLastError();
}

static void *cuda_host_alloc(void *ctx, size_t bytes)
{
	void *p = NULL;
	cudaError_t e;
	(void)ctx;
	e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault);
	if (e != cudaSuccess) {
		errno = -mlens_cuda_rc(e, "cudaHostAlloc", __FILE__, __LINE__);
		return NULL;
	}
	return p;
}

static void cuda_host_free(void *ctx, void *p)
{
	(void)ctx;
	cudaFreeHost(p);
}

static int cuda_copy_async(void *ctx, int queue, void *dst, const void *src, size_t bytes,
			   bool to_device)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	if (queue < 0 || queue > 3)
		return -EINVAL;
	if (!bytes)
		return 0;
	if (queue == 0)	/* as mlens_cuda_copy's, on the compute stream itself */
		return copy_on(c, queue_stream(c, 0), 0, dst, src, bytes, to_device);
	if (queue == 3)	/* as queue 0's, in a few blocks: an upload on a copy
			 * engine can wait behind every weight piece queued */
		return copy_on(c, c->up_stream, (unsigned)c->up_blocks, dst, src, bytes, to_device);
	/* queues 1 and 2: a copy engine each way */
	CUDA_RET(cudaMemcpyAsync(dst, src, bytes,
				 to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
				 queue_stream(c, queue)));
	return 0;
}

static int cuda_event_record(void *ctx, int queue, int ev)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	if (queue < 0 || queue > 3 || ev < 0 || ev >= MLENS_BACKEND_EVENTS)
		return -EINVAL;
	CUDA_RET(cudaEventRecord(c->events[ev], queue_stream(c, queue)));
	return 0;
}

static int cuda_event_wait(void *ctx, int queue, int ev)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	if (queue < 0 || queue > 3 || ev < 0 || ev >= MLENS_BACKEND_EVENTS)
		return -EINVAL;
	CUDA_RET(cudaStreamWaitEvent(queue_stream(c, queue), c->events[ev], 0));
	return 0;
}

static int cuda_bind_thread(void *ctx)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	CUDA_RET(cudaSetDevice(c->device));
	return 0;
}

static int cuda_event_sync(void *ctx, int ev)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	if (ev < 0 || ev >= MLENS_BACKEND_EVENTS)
		return -EINVAL;
	CUDA_RET(cudaEventSynchronize(c->events[ev]));
	return 0;
}

static size_t cuda_mem_used(void *ctx)
{
	return ((struct mlens_cuda_ctx *)ctx)->bytes_in_use;
}

/* ==== timing marks ==== */

static double host_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Wait for a base event and take the host clock as its time. A blocking
 * wait returns after the thread wakes (tens of microseconds late, and a
 * descheduled thread later still: every mark of the batch would be off by
 * that), so poll first: a queue that is idle or nearly so reaches the
 * event within the poll, and only a busy one falls back to blocking. */
static cudaError_t timer_base_wait(cudaEvent_t ev, double *host)
{
	const double poll_s = 200e-6;
	double t0 = host_now(), t;
	cudaError_t e;
	do {
		e = cudaEventQuery(ev);
		t = host_now();
		if (e != cudaErrorNotReady) {
			*host = t;
			return e;
		}
	} while (t - t0 < poll_s);
	e = cudaEventSynchronize(ev);
	*host = host_now();
	return e;
}

/* A half's first mark (or its first mark ever) records the half's base
 * event and waits for it: the host clock right after is the base's time,
 * and every later mark of the half is the base plus the GPU's elapsed
 * time, on the host's timeline. */
static int cuda_timer_mark(void *ctx, int queue, int id)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	cudaStream_t s;
	int h;
	if (queue < 0 || queue > 1 || id < 0 || id >= MLENS_BACKEND_TIMERS)
		return -EINVAL;
	s = queue_stream(c, queue);
	if (!c->timers) {
		c->timers = (cudaEvent_t *)calloc(MLENS_BACKEND_TIMERS, sizeof(*c->timers));
		c->timer_set = (unsigned char *)calloc(MLENS_BACKEND_TIMERS, 1);
		if (!c->timers || !c->timer_set) {
			free(c->timers);
			free(c->timer_set);
			c->timers = NULL;
			c->timer_set = NULL;
			fprintf(stderr, "mlens cuda: no memory for %d timing marks\n", MLENS_BACKEND_TIMERS);
			return -ENOMEM;
		}
	}
	h = id >= MLENS_BACKEND_TIMER_HALF;
	if (id % MLENS_BACKEND_TIMER_HALF == 0 || !c->timer_base_ok[h]) {
		if (!c->timer_base[h])
			CUDA_RET(cudaEventCreateWithFlags(&c->timer_base[h], cudaEventDefault));
		c->timer_base_ok[h] = false;
		CUDA_RET(cudaEventRecord(c->timer_base[h], s));
		CUDA_RET(timer_base_wait(c->timer_base[h], &c->timer_base_host[h]));
		c->timer_base_ok[h] = true;
	}
	if (!c->timers[id])
		CUDA_RET(cudaEventCreateWithFlags(&c->timers[id], cudaEventDefault));
	CUDA_RET(cudaEventRecord(c->timers[id], s));
	c->timer_set[id] = 1;
	return 0;
}

static int cuda_timer_read(void *ctx, int id, double *seconds)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	cudaError_t e;
	float ms = 0.0f;
	int h;
	if (id < 0 || id >= MLENS_BACKEND_TIMERS)
		return -EINVAL;
	h = id >= MLENS_BACKEND_TIMER_HALF;
	if (!c->timers || !c->timer_set[id] || !c->timer_base_ok[h])
		return -ENOENT;
	e = cudaEventQuery(c->timers[id]);
	if (e == cudaErrorNotReady)
		return -EAGAIN;
	CUDA_RET(e);
	CUDA_RET(cudaEventElapsedTime(&ms, c->timer_base[h], c->timers[id]));
	*seconds = c->timer_base_host[h] + ms * 1e-3;
	return 0;
}

/* ==== the table ==== */

static void cuda_destroy(void *ctx)
{
	struct mlens_cuda_ctx *c = (struct mlens_cuda_ctx *)ctx;
	if (!c)
		return;
	if (c->stream)
		cudaStreamSynchronize(c->stream);
	if (c->blas)
		cublasDestroy(c->blas);
	if (c->lt)
		cublasLtDestroy(c->lt);
	dev_free(c, c->blas_ws);
	if (c->side_stream)
		cudaStreamSynchronize(c->side_stream);
	dev_free(c, c->stage.d);
	dev_free(c, c->side_stage.d);
	dev_free(c, c->d_scratch);
	for (int i = 0; i < MLENS_CUDA_STAGE_SLOTS; i++) {
		struct cuda_stage_slot *sl[2] = { &c->stage.slot[i], &c->side_stage.slot[i] };
		for (int j = 0; j < 2; j++) {
			cudaFreeHost(sl[j]->h);
			if (sl[j]->done)
				cudaEventDestroy(sl[j]->done);
		}
	}
	cudaFreeHost(c->h_back);
	cudaFreeHost(c->h_sample);
	if (c->copy_stream) {
		cudaStreamSynchronize(c->copy_stream);
		cudaStreamDestroy(c->copy_stream);
	}
	if (c->side_stream) {
		cudaStreamSynchronize(c->side_stream);
		cudaStreamDestroy(c->side_stream);
	}
	if (c->up_stream) {
		cudaStreamSynchronize(c->up_stream);
		cudaStreamDestroy(c->up_stream);
	}
	for (int i = 0; i < MLENS_BACKEND_EVENTS; i++)
		if (c->events[i])
			cudaEventDestroy(c->events[i]);
	for (int i = 1; i < MLENS_MOE_STREAMS_MAX; i++) {
		if (c->moe_stream[i]) {
			cudaStreamSynchronize(c->moe_stream[i]);
			cudaStreamDestroy(c->moe_stream[i]);
		}
		if (c->moe_join[i])
			cudaEventDestroy(c->moe_join[i]);
	}
	if (c->moe_fork)
		cudaEventDestroy(c->moe_fork);
	if (c->moe_counts)
		cudaEventDestroy(c->moe_counts);
	for (int i = 0; c->timers && i < MLENS_BACKEND_TIMERS; i++)
		if (c->timers[i])
			cudaEventDestroy(c->timers[i]);
	free(c->timers);
	free(c->timer_set);
	for (int h = 0; h < 2; h++)
		if (c->timer_base[h])
			cudaEventDestroy(c->timer_base[h]);
	if (c->stream)
		cudaStreamDestroy(c->stream);
	free(c->allocs);
	free(c);
}

/* ==== the device ==== */

static int cuda_mem_info(void *ctx, size_t *free_bytes, size_t *total_bytes)
{
	CUDA_RET(cudaSetDevice(((const struct mlens_cuda_ctx *)ctx)->device));
	CUDA_RET(cudaMemGetInfo(free_bytes, total_bytes));
	return 0;
}

static int cuda_device_name(void *ctx, char *buf, size_t len)
{
	struct cudaDeviceProp prop;
	if (!len)
		return -EINVAL;
	CUDA_RET(cudaGetDeviceProperties(&prop, ((const struct mlens_cuda_ctx *)ctx)->device));
	snprintf(buf, len, "%s", prop.name);
	return 0;
}

static int cuda_bus_id(void *ctx, char *buf, size_t len)
{
	if (!len)
		return -EINVAL;
	return mlens_cuda_pci_bus_id(((const struct mlens_cuda_ctx *)ctx)->device, buf,
				     len > INT_MAX ? INT_MAX : (int)len);
}

static const struct mlens_backend_ops cuda_ops = {
	sizeof(struct mlens_backend_ops),
	"cuda",
	false,
	cuda_destroy,
	cuda_alloc,
	cuda_free,
	cuda_upload,
	cuda_download,
	cuda_sync,
	cuda_embed,
	cuda_rmsnorm,
	cuda_gemm,
	cuda_rope,
	cuda_router,
	cuda_moe,
	cuda_attn_prefill,
	cuda_kv_append,
	cuda_attn_decode,
	cuda_bias_add,
	cuda_clamp,
	cuda_route_one,
	cuda_sample,
	cuda_host_register,
	cuda_host_unregister,
	cuda_host_alloc,
	cuda_host_free,
	cuda_copy_async,
	cuda_event_record,
	cuda_event_wait,
	cuda_event_sync,
	cuda_mem_used,
	cuda_timer_mark,
	cuda_timer_read,
	cuda_bind_thread,
	cuda_scratch_reserve,
	true,	/* side_queue */
	cuda_kv_append_side,
	true,	/* up_queue */
	cuda_round,
	cuda_gemm_half_in,
	cuda_gemm_multi,
	NULL,	/* attn_decode_half: attn_decode, then round */
	cuda_mem_info,
	cuda_device_name,
	cuda_bus_id,
	cuda_layernorm,
	cuda_fp8_tc,
};

extern "C" bool mlens_cuda_available(void)
{
	int n = 0;
	return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

extern "C" int mlens_cuda_pci_bus_id(int device, char *buf, int len)
{
	if (cudaDeviceGetPCIBusId(buf, len, device) == cudaSuccess)
		return 0;
	/* a device that is not there is an answer, not an error for the
	 * next launch's check to find */
	cudaGetLastError();
	return -ENODEV;
}

extern "C" size_t mlens_backend_cuda_mem_used(const struct mlens_backend *be)
{
	if (!be || be->ops != &cuda_ops)
		return 0;
	return ((const struct mlens_cuda_ctx *)be->ctx)->bytes_in_use;
}


/* A block count for a kernel beside queue 0's: the environment variable
 * name when set (a tuning knob, 1 to max), else a quarter of the SMs.
 * Such kernels (the side K/V append's stores, the upload queue's copies)
 * cross PCIe and wait on the link, not on the SMs; a grid of many blocks
 * would take every SM from queue 0's kernels while it runs. */
static int side_blocks(struct mlens_cuda_ctx *c, const char *name, long max, int *out)
{
	const char *e = getenv(name);
	int sms = 0;
	if (e && *e) {
		char *end;
		long v = strtol(e, &end, 10);
		if (*end || v < 1 || v > max) {
			fprintf(stderr, "mlens cuda: %s '%s' is not a count of 1 to %ld\n", name, e, max);
			return -EINVAL;
		}
		*out = (int)v;
		return 0;
	}
	CUDA_RET(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c->device));
	*out = sms >= 8 ? sms / 4 : 2;
	return 0;
}

/* CUDA's schedule flags, in enum mlens_gpu_sync's order */
static const unsigned int sync_flag[] = { cudaDeviceScheduleAuto, cudaDeviceScheduleSpin,
					  cudaDeviceScheduleYield, cudaDeviceScheduleBlockingSync };

extern "C" int mlens_backend_cuda_create(struct mlens_backend *be,
					 const struct mlens_backend_opts *o)
{
	struct mlens_cuda_ctx *c;
	int dev = o ? o->device : 0, n = 0, rc = 0;
	int moe_streams = o && o->moe_streams ? o->moe_streams : MLENS_MOE_STREAMS_DEFAULT;
	unsigned wait_flags;	/* of the events a host thread waits on */
	cublasStatus_t bs;

	if (moe_streams < 1 || moe_streams > MLENS_MOE_STREAMS_MAX) {
		fprintf(stderr, "mlens cuda: %d MoE streams asked for; 1 to %d can be had\n",
			moe_streams, MLENS_MOE_STREAMS_MAX);
		return -EINVAL;
	}
	if (o && (unsigned)o->sync >= sizeof(sync_flag) / sizeof(sync_flag[0])) {
		fprintf(stderr, "mlens cuda: GPU sync mode %d is not one of auto, spin, yield, block\n",
			(int)o->sync);
		return -EINVAL;
	}

	if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
		cudaGetLastError();	/* clear the sticky "no device" */
		fprintf(stderr, "mlens cuda: no CUDA GPU found; use the cpu backend\n");
		return -ENODEV;
	}
	if (dev < 0 || dev >= n) {
		fprintf(stderr, "mlens cuda: device %d asked for, but only %d GPU(s) exist\n", dev, n);
		return -ENODEV;
	}
	c = (struct mlens_cuda_ctx *)calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->device = dev;
	c->gemm_exact = o && o->gemm == MLENS_GEMM_EXACT;
	c->moe_grouped = o ? o->moe_grouped : MLENS_MOE_GROUPED_AUTO;
	c->prefill_bf16 = o && o->prefill_bf16;
	c->sm_copy = o && o->sm_copy;
	CUDA_GOTO(cudaSetDevice(dev), rc, fail);
	/* the device's (primary context's) flags, for every thread of the
	 * process: the last backend created sets them */
	if (o && o->sync != MLENS_GPU_SYNC_AUTO)
		CUDA_GOTO(cudaSetDeviceFlags(sync_flag[o->sync]), rc, fail);
	CUDA_GOTO(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), rc, fail);
	CUDA_GOTO(cudaStreamCreateWithFlags(&c->copy_stream, cudaStreamNonBlocking), rc, fail);
	CUDA_GOTO(cudaStreamCreateWithFlags(&c->side_stream, cudaStreamNonBlocking), rc, fail);
	CUDA_GOTO(cudaStreamCreateWithFlags(&c->up_stream, cudaStreamNonBlocking), rc, fail);
	/* the events a host thread waits on (cudaEventSynchronize) sleep with
	 * gpu_sync = block, as stream waits do: without cudaEventBlockingSync
	 * an event wait busy-waits whatever the device's flags */
	wait_flags = cudaEventDisableTiming |
		     (o && o->sync == MLENS_GPU_SYNC_BLOCK ? cudaEventBlockingSync : 0);
	for (int i = 0; i < MLENS_BACKEND_EVENTS; i++)
		CUDA_GOTO(cudaEventCreateWithFlags(&c->events[i], wait_flags), rc, fail);
	c->stage.stream = c->stream;
	c->side_stage.stream = c->side_stream;
	for (int i = 0; i < MLENS_CUDA_STAGE_SLOTS; i++) {
		struct cuda_stager *st[2] = { &c->stage, &c->side_stage };
		for (int j = 0; j < 2; j++) {
			CUDA_GOTO(cudaEventCreateWithFlags(&st[j]->slot[i].done, wait_flags),
				  rc, fail);
			CUDA_GOTO(cudaEventRecord(st[j]->slot[i].done, st[j]->stream), rc, fail);
		}
	}
	if ((rc = side_blocks(c, "MLENS_CUDA_APPEND_BLOCKS", 65535, &c->side_append_blocks)) ||
	    (rc = side_blocks(c, "MLENS_CUDA_UP_BLOCKS", 1056, &c->up_blocks)))
		goto fail;
	bs = cublasCreate(&c->blas);
	if (bs != CUBLAS_STATUS_SUCCESS) {
		c->blas = NULL;
		rc = mlens_cublas_rc(bs, "cublasCreate", __FILE__, __LINE__);
		goto fail;
	}
	/* explicit workspaces, so that cuBLAS' memory is in our account too
	 * (32 MiB is what cuBLAS recommends for Hopper), one a MoE stream */
	c->moe_streams = moe_streams;
	c->moe_stream[0] = c->stream;
	for (int i = 1; i < c->moe_streams; i++) {
		CUDA_GOTO(cudaStreamCreateWithFlags(&c->moe_stream[i], cudaStreamNonBlocking), rc, fail);
		CUDA_GOTO(cudaEventCreateWithFlags(&c->moe_join[i], cudaEventDisableTiming), rc, fail);
	}
	CUDA_GOTO(cudaEventCreateWithFlags(&c->moe_fork, cudaEventDisableTiming), rc, fail);
	CUDA_GOTO(cudaEventCreateWithFlags(&c->moe_counts, wait_flags), rc, fail);
	c->blas_ws_bytes = MLENS_CUDA_BLAS_WS;
	c->blas_ws = dev_alloc(c, c->blas_ws_bytes * (size_t)c->moe_streams);
	if (!c->blas_ws) {
		rc = -errno;
		goto fail;
	}
	if ((rc = moe_use_stream(c, 0)))	/* the compute stream and its workspace */
		goto fail;
	if ((bs = cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS) {
		rc = mlens_cublas_rc(bs, "cuBLAS set-up", __FILE__, __LINE__);
		goto fail;
	}
	if (!o || o->fp8_gemm != MLENS_FP8_GEMM_DEQUANT) {
		/* fp8 tensor cores from compute capability 8.9; without them, or
		 * without an algorithm for a small fp8 product, experts take
		 * the dequantize path (said on stderr where fp8 was asked for) */
		struct cudaDeviceProp prop;
		CUDA_GOTO(cudaGetDeviceProperties(&prop, c->device), rc, fail);
		if (prop.major * 10 + prop.minor >= 89 && cublasLtCreate(&c->lt) == CUBLAS_STATUS_SUCCESS)
			c->fp8_tc = lt_selftest(c);
		if (!c->fp8_tc && o && o->fp8_gemm == MLENS_FP8_GEMM_FP8)
			fprintf(stderr, "mlens cuda: %s has no fp8 GEMM; fp8 experts are dequantized\n",
				prop.name);
	}
	be->ops = &cuda_ops;
	be->ctx = c;
	return 0;
fail:
	cuda_destroy(c);
	return rc;
}
