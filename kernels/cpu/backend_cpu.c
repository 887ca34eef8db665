/* The CPU backend: plain, readable reference code for every op of the
 * Mixtral forward pass. It is the oracle the SIMD and CUDA kernels are
 * tested against. Work is split over the pool by output row (or by
 * sequence and head); every reduction runs in a fixed order within its row,
 * so a row's result never depends on the batch it is in. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "kernels/cpu/cpu.h"

/* ==== memory ==== */

static void *cpu_alloc(void *ctx, size_t bytes)
{
	void *p = NULL;
	int rc = posix_memalign(&p, 64, bytes ? bytes : 64);
	if (rc) {
		errno = rc;
		return NULL;
	}
	return p;
}

static void cpu_free(void *ctx, void *p)
{
	free(p);
}

static int cpu_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
	if (bytes)
		memmove(dst, src, bytes);
	return 0;
}

static int cpu_sync(void *ctx)
{
	return 0;
}

/* ==== helpers ==== */

/* Row r of a [rows][dim] weight matrix stored as dt, converted to fp32. */
static void load_row(float *dst, const void *w, enum mlens_dtype dt, size_t r, int dim)
{
	size_t base = r * (size_t)dim;
	int i;
	switch (dt) {
	case MLENS_DTYPE_F32:
		memcpy(dst, (const float *)w + base, (size_t)dim * 4);
		break;
	case MLENS_DTYPE_BF16: {
		const uint16_t *s = (const uint16_t *)w + base;
		for (i = 0; i < dim; i++)
			dst[i] = mlens_bf16_to_f32(s[i]);
		break;
	}
	case MLENS_DTYPE_F16: {
		const uint16_t *s = (const uint16_t *)w + base;
		for (i = 0; i < dim; i++)
			dst[i] = mlens_f16_to_f32(s[i]);
		break;
	}
	case MLENS_DTYPE_E4M3: {
		const uint8_t *s = (const uint8_t *)w + base;
		for (i = 0; i < dim; i++)
			dst[i] = mlens_e4m3_to_f32(s[i]);
		break;
	}
	}
}

/* Row r of an fp8 matrix [rows][dim] dequantized: e4m3 value times its
 * scale, one fp32 product an element (the oracle the GPU paths match). */
static void load_row_scaled(float *dst, const void *w, const struct mlens_wscale *ws,
			    const float *sc, size_t r, int dim)
{
	load_row(dst, w, MLENS_DTYPE_E4M3, r, dim);
	for (int i = 0; i < dim; i++)
		dst[i] *= mlens_wscale_at(ws, sc, (int64_t)r, i, dim);
}

/* Dot product with eight interleaved partial sums added in a fixed order:
 * deterministic, and a shape the compiler vectorises without fast-math. */
static float dot(const float *a, const float *b, int n)
{
	float acc[8] = { 0 };
	int i = 0, j;
	for (; i + 8 <= n; i += 8)
		for (j = 0; j < 8; j++)
			acc[j] += a[i + j] * b[i + j];
	for (; i < n; i++)
		acc[0] += a[i] * b[i];
	return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* Per-thread fp32 scratch, allocated before the work starts so that a task
 * never meets an allocation failure. */
struct scratch {
	float *buf;
	size_t per_thread;
};

static int scratch_init(struct scratch *s, int n_threads, size_t floats)
{
	s->per_thread = (floats + 15) & ~(size_t)15;
	s->buf = malloc((size_t)n_threads * s->per_thread * sizeof(float));
	return s->buf ? 0 : -ENOMEM;
}

static float *scratch_get(struct scratch *s, int thread)
{
	return s->buf + (size_t)thread * s->per_thread;
}

static void scratch_fini(struct scratch *s)
{
	free(s->buf);
}

/* ==== embedding, norm, rope ==== */

static int cpu_embed(void *ctx, float *out, const void *table, enum mlens_dtype dt,
		     int dim, const int32_t *tokens, int n)
{
	for (int i = 0; i < n; i++)
		load_row(out + (size_t)i * dim, table, dt, (size_t)tokens[i], dim);
	return 0;
}

static int cpu_rmsnorm(void *ctx, float *out, const float *x, const void *w,
		       enum mlens_dtype dt, int n, int dim, float eps)
{
	for (int i = 0; i < n; i++) {
		const float *xi = x + (size_t)i * dim;
		float *oi = out + (size_t)i * dim;
		double ss = 0.0;
		for (int j = 0; j < dim; j++)
			ss += (double)xi[j] * xi[j];
		float r = (float)(1.0 / sqrt(ss / dim + (double)eps));
		for (int j = 0; j < dim; j++)
			oi[j] = (xi[j] * r) * mlens_load(w, dt, (size_t)j);
	}
	return 0;
}

static int cpu_layernorm(void *ctx, float *out, const float *x, const void *w,
			 enum mlens_dtype dt, int n, int dim, float eps)
{
	for (int i = 0; i < n; i++) {
		const float *xi = x + (size_t)i * dim;
		float *oi = out + (size_t)i * dim;
		double s = 0.0, ss = 0.0;
		for (int j = 0; j < dim; j++)
			s += xi[j];
		float mean = (float)(s / dim);
		/* two passes: the variance of the centred values, as torch's */
		for (int j = 0; j < dim; j++)
			ss += ((double)xi[j] - mean) * ((double)xi[j] - mean);
		float r = (float)(1.0 / sqrt(ss / dim + (double)eps));
		for (int j = 0; j < dim; j++)
			oi[j] = ((xi[j] - mean) * r) * mlens_load(w, dt, (size_t)j);
	}
	return 0;
}

static int cpu_rope(void *ctx, float *x, const int32_t *pos, int n, int n_heads,
		    int head_dim, float theta)
{
	int half = head_dim / 2;
	for (int i = 0; i < n; i++) {
		for (int j = 0; j < half; j++) {
			/* HF: inv_freq = 1 / theta^(2j/d), computed in fp32 */
			float inv = 1.0f / powf(theta, (float)(2 * j) / (float)head_dim);
			float ang = (float)pos[i] * inv;
			float c = cosf(ang), s = sinf(ang);
			for (int h = 0; h < n_heads; h++) {
				float *xh = x + ((size_t)i * n_heads + h) * head_dim;
				float a = xh[j], b = xh[j + half];
				xh[j] = a * c - b * s;
				xh[j + half] = b * c + a * s;
			}
		}
	}
	return 0;
}

/* ==== GEMM ==== */

struct gemm_job {
	float *out;
	const float *x;
	const void *w;
	enum mlens_dtype dt;
	int n, k, m;
	bool acc;
	int rows_per_task;
	struct scratch sc;
	const struct mlens_wscale *ws;	/* fp8 weights: their scales */
	const float *scales;
};

static void gemm_task(void *arg, int task, int thread)
{
	struct gemm_job *j = arg;
	int r0 = task * j->rows_per_task;
	int r1 = r0 + j->rows_per_task < j->m ? r0 + j->rows_per_task : j->m;
	const float *wrow;
	float *buf = NULL;

	if (j->dt != MLENS_DTYPE_F32)
		buf = scratch_get(&j->sc, thread);
	for (int r = r0; r < r1; r++) {
		if (buf && j->ws) {
			load_row_scaled(buf, j->w, j->ws, j->scales, (size_t)r, j->k);
			wrow = buf;
		} else if (buf) {
			load_row(buf, j->w, j->dt, (size_t)r, j->k);
			wrow = buf;
		} else {
			wrow = (const float *)j->w + (size_t)r * j->k;
		}
		for (int i = 0; i < j->n; i++) {
			float v = dot(j->x + (size_t)i * j->k, wrow, j->k);
			float *o = j->out + (size_t)i * j->m + r;
			*o = j->acc ? *o + v : v;
		}
	}
}

/* cpu_gemm over weights with scales (ws NULL: none). */
static int gemm_scaled(void *ctx, float *out, const float *x, const void *w,
		       enum mlens_dtype dt, const struct mlens_wscale *ws, const float *scales,
		       int n, int k, int m, bool accumulate)
{
	struct mlens_cpu_ctx *c = ctx;
	struct gemm_job j = { out, x, w, dt, n, k, m, accumulate, 16, { 0 }, ws, scales };
	int nt = mlens_pool_size(c->pool);
	if (n <= 0 || m <= 0)
		return 0;
	/* fp8 elements mean nothing without their scales */
	if ((dt == MLENS_DTYPE_E4M3) != (ws && ws->kind != MLENS_WSCALE_NONE && scales))
		return -EINVAL;
	if (scratch_init(&j.sc, nt, (size_t)k))
		return -ENOMEM;
	mlens_pool_run(c->pool, (m + j.rows_per_task - 1) / j.rows_per_task, gemm_task, &j);
	scratch_fini(&j.sc);
	return 0;
}

static int cpu_gemm(void *ctx, float *out, const float *x, const void *w,
		    enum mlens_dtype dt, int n, int k, int m, bool accumulate)
{
	return gemm_scaled(ctx, out, x, w, dt, NULL, NULL, n, k, m, accumulate);
}

/* out[n][m] = x[n][k] . W[k][m], W stored with its output dimension last
 * (DBRX's w2). A task owns a band of output columns and adds W's rows into
 * it in order: deterministic, and no row's result depends on the others. */
struct gemm_kn_job {
	float *out;
	const float *x;
	const void *w;
	enum mlens_dtype dt;
	int n, k, m;
	int cols_per_task;
	struct scratch sc;
};

static void gemm_kn_task(void *arg, int task, int thread)
{
	struct gemm_kn_job *j = arg;
	int c0 = task * j->cols_per_task;
	int cw = c0 + j->cols_per_task < j->m ? j->cols_per_task : j->m - c0;
	size_t es = mlens_dtype_size(j->dt);
	float *buf = scratch_get(&j->sc, thread);

	for (int i = 0; i < j->n; i++)
		memset(j->out + (size_t)i * j->m + c0, 0, (size_t)cw * sizeof(float));
	for (int r = 0; r < j->k; r++) {
		const char *wr = (const char *)j->w + ((size_t)r * j->m + c0) * es;
		const float *row = (const float *)wr;
		if (j->dt != MLENS_DTYPE_F32) {
			load_row(buf, wr, j->dt, 0, cw);
			row = buf;
		}
		for (int i = 0; i < j->n; i++) {
			float a = j->x[(size_t)i * j->k + r];
			float *o = j->out + (size_t)i * j->m + c0;
			for (int c = 0; c < cw; c++)
				o[c] += a * row[c];
		}
	}
}

static int cpu_gemm_kn(void *ctx, float *out, const float *x, const void *w,
		       enum mlens_dtype dt, int n, int k, int m)
{
	struct mlens_cpu_ctx *c = ctx;
	struct gemm_kn_job j = { out, x, w, dt, n, k, m, 64, { 0 } };
	if (n <= 0 || m <= 0)
		return 0;
	if (scratch_init(&j.sc, mlens_pool_size(c->pool), (size_t)j.cols_per_task))
		return -ENOMEM;
	mlens_pool_run(c->pool, (m + j.cols_per_task - 1) / j.cols_per_task, gemm_kn_task, &j);
	scratch_fini(&j.sc);
	return 0;
}

/* ==== router and experts ==== */

static int cpu_router(void *ctx, int32_t *ids, float *weights, const float *logits,
		      int n, int n_experts, int k, bool renorm)
{
	float p[256];
	bool used[256];
	if (n_experts > 256 || k > n_experts || k <= 0)
		return -EINVAL;
	for (int i = 0; i < n; i++) {
		const float *l = logits + (size_t)i * n_experts;
		float mx = l[0], sum = 0.0f, ksum = 0.0f;
		for (int e = 1; e < n_experts; e++)
			mx = l[e] > mx ? l[e] : mx;
		for (int e = 0; e < n_experts; e++) {
			p[e] = expf(l[e] - mx);
			sum += p[e];
			used[e] = false;
		}
		for (int e = 0; e < n_experts; e++)
			p[e] /= sum;
		for (int s = 0; s < k; s++) {
			int best = -1;
			for (int e = 0; e < n_experts; e++)
				if (!used[e] && (best < 0 || p[e] > p[best]))
					best = e;
			used[best] = true;
			ids[(size_t)i * k + s] = best;
			weights[(size_t)i * k + s] = p[best];
			ksum += p[best];
		}
		for (int s = 0; s < k && renorm; s++)
			weights[(size_t)i * k + s] /= ksum;
	}
	return 0;
}

static int cpu_route_one(void *ctx, int32_t *ids, float *weights, const float *logits, int n)
{
	for (int i = 0; i < n; i++) {
		ids[i] = 0;
		weights[i] = logits ? 1.0f / (1.0f + expf(-logits[i])) : 1.0f;
	}
	return 0;
}

static int cpu_bias_add(void *ctx, float *x, const void *b, enum mlens_dtype dt, int n, int dim)
{
	for (int i = 0; i < n; i++)
		for (int j = 0; j < dim; j++)
			x[(size_t)i * dim + j] += mlens_load(b, dt, (size_t)j);
	return 0;
}

static int cpu_clamp(void *ctx, float *x, size_t count, float limit)
{
	if (!(limit >= 0))
		return -EINVAL;
	for (size_t i = 0; i < count; i++)
		x[i] = x[i] < -limit ? -limit : x[i] > limit ? limit : x[i];
	return 0;
}

static int cpu_moe(void *ctx, float *out, const float *x, int n, const int32_t *ids,
		   const float *weights, int k, const struct mlens_moe_weights *w)
{
	int H = w->hidden, I = w->inter;
	int32_t *rows = malloc((size_t)n * sizeof(*rows));
	float *scale = malloc((size_t)n * sizeof(*scale));
	float *xe = malloc((size_t)n * H * sizeof(float));
	float *g = malloc((size_t)n * I * sizeof(float));
	float *u = malloc((size_t)n * I * sizeof(float));
	float *y = malloc((size_t)n * H * sizeof(float));
	bool fp8 = w->dtype == MLENS_DTYPE_E4M3;
	const struct mlens_wscale *ws = fp8 ? &w->scale : NULL;
	int rc = 0;

	if (!rows || !scale || !xe || !g || !u || !y) {
		rc = -ENOMEM;
		goto out;
	}
	if (fp8 && w->w2_transposed) {
		rc = -ENOTSUP;	/* the loader refuses fp8 experts stored transposed */
		goto out;
	}
	for (int e = 0; e < w->n_experts; e++) {
		int cnt = 0;
		/* token permutation: gather the rows routed to expert e */
		for (int i = 0; i < n; i++)
			for (int s = 0; s < k; s++)
				if (ids[(size_t)i * k + s] == e) {
					rows[cnt] = i;
					scale[cnt] = weights[(size_t)i * k + s];
					memcpy(xe + (size_t)cnt * H, x + (size_t)i * H, (size_t)H * 4);
					cnt++;
				}
		if (w->tally)
			w->tally[e] += (uint64_t)cnt;
		if (!cnt)
			continue;
		if (!w->w1[e] || !w->w2[e] || !w->w3[e]) {
			rc = -EFAULT;	/* a routed expert has no weights here */
			goto out;
		}
		if (fp8 && (!w->s1 || !w->s2 || !w->s3 || !w->s1[e] || !w->s2[e] || !w->s3[e])) {
			rc = -EFAULT;	/* fp8 experts without their scales */
			goto out;
		}
		if ((rc = gemm_scaled(ctx, g, xe, w->w1[e], w->dtype, ws, fp8 ? w->s1[e] : NULL, cnt,
				      H, I, false)) ||
		    (rc = gemm_scaled(ctx, u, xe, w->w3[e], w->dtype, ws, fp8 ? w->s3[e] : NULL, cnt,
				      H, I, false)))
			goto out;
		for (size_t t = 0; t < (size_t)cnt * I; t++)
			g[t] = g[t] / (1.0f + expf(-g[t])) * u[t];
		rc = w->w2_transposed ? cpu_gemm_kn(ctx, y, g, w->w2[e], w->dtype, cnt, I, H)
				      : gemm_scaled(ctx, y, g, w->w2[e], w->dtype, ws, fp8 ? w->s2[e] : NULL,
						    cnt, I, H, false);
		if (rc)
			goto out;
		/* and back: scale and add into each token's row */
		for (int r = 0; r < cnt; r++) {
			float *o = out + (size_t)rows[r] * H;
			const float *yr = y + (size_t)r * H;
			for (int j = 0; j < H; j++)
				o[j] += scale[r] * yr[j];
		}
	}
out:
	free(rows);
	free(scale);
	free(xe);
	free(g);
	free(u);
	free(y);
	return rc;
}

/* ==== attention ==== */

struct prefill_job {
	float *out;
	const float *q, *k, *v;
	const int32_t *cu;
	int n_seqs, nh, nkv, hd;
	float scale;
	struct scratch sc;
};

/* task = (sequence, query head) */
static void prefill_task(void *arg, int task, int thread)
{
	struct prefill_job *j = arg;
	int s = task / j->nh, h = task % j->nh;
	int g = h / (j->nh / j->nkv);
	int t0 = j->cu[s], len = j->cu[s + 1] - t0;
	size_t qs = (size_t)j->nh * j->hd, ks = (size_t)j->nkv * j->hd;
	float *p = scratch_get(&j->sc, thread);

	for (int i = 0; i < len; i++) {
		const float *qi = j->q + (size_t)(t0 + i) * qs + (size_t)h * j->hd;
		float *oi = j->out + (size_t)(t0 + i) * qs + (size_t)h * j->hd;
		float mx = -INFINITY, sum = 0.0f;
		for (int t = 0; t <= i; t++) {
			p[t] = dot(qi, j->k + (size_t)(t0 + t) * ks + (size_t)g * j->hd, j->hd) * j->scale;
			mx = p[t] > mx ? p[t] : mx;
		}
		for (int t = 0; t <= i; t++) {
			p[t] = expf(p[t] - mx);
			sum += p[t];
		}
		for (int d = 0; d < j->hd; d++)
			oi[d] = 0.0f;
		for (int t = 0; t <= i; t++) {
			const float *vt = j->v + (size_t)(t0 + t) * ks + (size_t)g * j->hd;
			float wgt = p[t] / sum;
			for (int d = 0; d < j->hd; d++)
				oi[d] += wgt * vt[d];
		}
	}
}

static int cpu_attn_prefill(void *ctx, float *out, const float *q, const float *k,
			    const float *v, const int32_t *cu_seqlens, int n_seqs,
			    int n_heads, int n_kv_heads, int head_dim, float scale)
{
	struct mlens_cpu_ctx *c = ctx;
	struct prefill_job j = { out, q, k, v, cu_seqlens, n_seqs, n_heads, n_kv_heads,
				 head_dim, scale, { 0 } };
	int maxlen = 0;
	if (n_kv_heads <= 0 || n_heads % n_kv_heads)
		return -EINVAL;
	for (int s = 0; s < n_seqs; s++)
		if (cu_seqlens[s + 1] - cu_seqlens[s] > maxlen)
			maxlen = cu_seqlens[s + 1] - cu_seqlens[s];
	if (scratch_init(&j.sc, mlens_pool_size(c->pool), (size_t)maxlen))
		return -ENOMEM;
	mlens_pool_run(c->pool, n_seqs * n_heads, prefill_task, &j);
	scratch_fini(&j.sc);
	return 0;
}

static int cpu_round(void *ctx, void *dst, enum mlens_dtype dt, const float *src, int rows,
		     int cols)
{
	return mlens_cpu_round(((struct mlens_cpu_ctx *)ctx)->pool, dst, dt, src, rows, cols);
}

static int cpu_kv_append(void *ctx, struct mlens_kv_cache *kv, int layer,
			 const float *k, const float *v, const int64_t *slots, int n)
{
	return mlens_cpu_kv_append(((struct mlens_cpu_ctx *)ctx)->pool, kv, layer, k, v, slots, n);
}

void mlens_cpu_attn_decode_group_ref(float *out, const float *q,
				     const struct mlens_kv_cache *kv, int layer, int g,
				     const struct mlens_attn_query *qr, int group,
				     float scale)
{
	int hd = kv->head_dim, bs = kv->block_size;
	size_t es = mlens_dtype_size(kv->dtype);
	const bool fp8 = kv->dtype == MLENS_DTYPE_E4M3;
	for (int h = 0; h < group; h++) {
		const float *qh = q + (size_t)h * hd;
		float *oh = out + (size_t)h * hd;
		float mx = -INFINITY, sum = 0.0f;
		for (int d = 0; d < hd; d++)
			oh[d] = 0.0f;
		for (int t = 0; t < qr->ctx_len; t++) {
			uint32_t block = qr->block_table[t / bs];
			size_t idx = mlens_kv_index(kv, layer, block, g, t % bs);
			const char *kp = (const char *)kv->k + idx * es;
			const char *vp = (const char *)kv->v + idx * es;
			float s = 0.0f;
			for (int d = 0; d < hd; d++)
				s += qh[d] * mlens_load(kp, kv->dtype, (size_t)d);
			s *= scale;
			if (fp8)	/* the row's scales: q.k = (q.codes) * ks */
				s *= mlens_kv_scales(kv, kv->k)[idx / (size_t)hd];
			/* online softmax: rescale what was summed when the max grows */
			float nmx = s > mx ? s : mx;
			float corr = expf(mx - nmx), p = expf(s - nmx);
			float pv = fp8 ? p * mlens_kv_scales(kv, kv->v)[idx / (size_t)hd] : p;
			sum = sum * corr + p;
			for (int d = 0; d < hd; d++)
				oh[d] = oh[d] * corr + pv * mlens_load(vp, kv->dtype, (size_t)d);
			mx = nmx;
		}
		for (int d = 0; d < hd; d++)
			oh[d] /= sum;
	}
}

static int cpu_attn_decode(void *ctx, float *out, const float *q,
			   const struct mlens_kv_cache *kv, int layer,
			   const struct mlens_attn_query *queries, int n,
			   int n_heads, float scale)
{
	struct mlens_cpu_ctx *c = ctx;
	return mlens_cpu_attn_decode(c->pool, &c->attn_ws, out, q, kv, layer, queries, n,
				     n_heads, scale);
}

static int cpu_attn_decode_half(void *ctx, void *half, enum mlens_dtype dt, float *out,
				const float *q, const struct mlens_kv_cache *kv, int layer,
				const struct mlens_attn_query *queries, int n, int n_heads,
				float scale)
{
	struct mlens_cpu_ctx *c = ctx;
	return mlens_cpu_attn_decode_half(c->pool, &c->attn_ws, half, dt, out, q, kv, layer,
					  queries, n, n_heads, scale);
}

/* ==== sampling ==== */

static uint64_t splitmix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ull;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

double mlens_sample_uniform(uint64_t seed, uint64_t counter)
{
	uint64_t r = splitmix64(seed ^ splitmix64(counter));
	return (double)(r >> 11) * (1.0 / 9007199254740992.0);
}

static int cmp_desc(const void *a, const void *b, void *arg)
{
	const float *sort_logits = arg;
	int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
	if (sort_logits[i] != sort_logits[j])
		return sort_logits[i] > sort_logits[j] ? -1 : 1;
	return i < j ? -1 : (i > j);
}

int32_t mlens_cpu_sample_row(const float *l, int vocab, const struct mlens_sampling *sp,
			     float *logprob, void *scratch)
{
	int32_t best = 0;
	double mx, lse = 0.0;

	for (int v = 1; v < vocab; v++)
		if (l[v] > l[best])
			best = v;
	mx = l[best];

	if (sp->temperature > 0.0f) {
		int32_t *idx = scratch;
		float *p = (float *)(idx + vocab);
		int kept = vocab;
		double sum = 0.0, cum = 0.0, u;

		for (int v = 0; v < vocab; v++)
			idx[v] = v;
		qsort_r(idx, (size_t)vocab, sizeof(*idx), cmp_desc, (void *)l);
		if (sp->top_k > 0 && sp->top_k < kept)
			kept = sp->top_k;
		for (int r = 0; r < kept; r++) {
			p[r] = (float)exp(((double)l[idx[r]] - mx) / sp->temperature);
			sum += p[r];
		}
		if (sp->top_p > 0.0f && sp->top_p < 1.0f) {
			int r;
			for (r = 0; r < kept; r++) {
				cum += p[r] / sum;
				if (cum >= sp->top_p)
					break;
			}
			kept = r < kept ? r + 1 : kept;
			sum = 0.0;
			for (r = 0; r < kept; r++)
				sum += p[r];
		}
		u = mlens_sample_uniform(sp->seed, sp->counter) * sum;
		cum = 0.0;
		best = idx[kept - 1];
		for (int r = 0; r < kept; r++) {
			cum += p[r];
			if (u < cum) {
				best = idx[r];
				break;
			}
		}
	}
	if (logprob) {
		for (int v = 0; v < vocab; v++)
			lse += exp((double)l[v] - mx);
		*logprob = (float)((double)l[best] - mx - log(lse));
	}
	return best;
}

static int cpu_sample(void *ctx, int32_t *tokens, float *logprobs, const float *logits,
		      int n, int vocab, const struct mlens_sampling *params)
{
	void *scratch = malloc((size_t)vocab * (sizeof(int32_t) + sizeof(float)));
	if (!scratch)
		return -ENOMEM;
	for (int i = 0; i < n; i++)
		tokens[i] = mlens_cpu_sample_row(logits + (size_t)i * vocab, vocab, &params[i],
						  logprobs ? &logprobs[i] : NULL, scratch);
	free(scratch);
	return 0;
}

/* ==== timing marks ==== */

/* Ops are done when they return, so a mark is the host clock now: the
 * hybrid pipeline's CPU-only runs go through the same timing code as a GPU. */
static int cpu_timer_mark(void *ctx, int queue, int id)
{
	struct mlens_cpu_ctx *c = ctx;
	struct timespec ts;
	if (queue < 0 || queue > 1 || id < 0 || id >= MLENS_BACKEND_TIMERS)
		return -EINVAL;
	if (!c->timers) {
		c->timers = malloc(MLENS_BACKEND_TIMERS * sizeof(*c->timers));
		if (!c->timers)
			return -ENOMEM;
		for (int i = 0; i < MLENS_BACKEND_TIMERS; i++)
			c->timers[i] = NAN;
	}
	clock_gettime(CLOCK_MONOTONIC, &ts);
	c->timers[id] = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
	return 0;
}

static int cpu_timer_read(void *ctx, int id, double *seconds)
{
	struct mlens_cpu_ctx *c = ctx;
	if (id < 0 || id >= MLENS_BACKEND_TIMERS)
		return -EINVAL;
	if (!c->timers || isnan(c->timers[id]))
		return -ENOENT;
	*seconds = c->timers[id];
	return 0;
}

/* ==== the table ==== */

static void cpu_destroy(void *ctx)
{
	struct mlens_cpu_ctx *c = ctx;
	free(c->timers);
	mlens_pool_destroy(c->pool);
	mlens_cpu_attn_ws_fini(&c->attn_ws);
	free(c);
}

static const struct mlens_backend_ops cpu_ops = {
	.size = sizeof(struct mlens_backend_ops),
	.name = "cpu",
	.host_memory = true,
	.destroy = cpu_destroy,
	.alloc = cpu_alloc,
	.free = cpu_free,
	.upload = cpu_copy,
	.download = cpu_copy,
	.sync = cpu_sync,
	.embed = cpu_embed,
	.rmsnorm = cpu_rmsnorm,
	.gemm = cpu_gemm,
	.rope = cpu_rope,
	.router = cpu_router,
	.bias_add = cpu_bias_add,
	.clamp = cpu_clamp,
	.route_one = cpu_route_one,
	.moe = cpu_moe,
	.attn_prefill = cpu_attn_prefill,
	.kv_append = cpu_kv_append,
	.attn_decode = cpu_attn_decode,
	.sample = cpu_sample,
	.timer_mark = cpu_timer_mark,
	.timer_read = cpu_timer_read,
	/* no gemm_half_in: this gemm multiplies the fp32 activations as they
	 * are, so a rounded x would change its product */
	.round = cpu_round,
	.attn_decode_half = cpu_attn_decode_half,
	.layernorm = cpu_layernorm,
};

int mlens_backend_cpu_create(struct mlens_backend *be, const struct mlens_backend_opts *o)
{
	struct mlens_cpu_ctx *c = calloc(1, sizeof(*c));
	int rc;
	if (!c)
		return -ENOMEM;
	/* workers pinned to the KV pool's node: attention streams the KV cache
	 * from that node's memory, so its cores see it at local bandwidth */
	rc = mlens_pool_create_numa(&c->pool, o ? o->numa_node : 0, o ? o->n_threads : 0,
				    o ? o->n_reserved : 0);
	if (rc == -EINVAL)	/* no CPU of that node is ours (a cpuset): unpinned */
		rc = mlens_pool_create_numa(&c->pool, -1, o ? o->n_threads : 0,
					    o ? o->n_reserved : 0);
	if (rc) {
		free(c);
		return rc;
	}
	be->ops = &cpu_ops;
	be->ctx = c;
	return 0;
}
