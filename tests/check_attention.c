/* Description: CPU decode attention kernels (scalar, AVX2, AVX-512) against
 * the scalar reference on random paged caches (f32, bf16, fp8 e4m3),
 * thread-count independence, bit-exact bf16 and fp8 KV append, the vector
 * e4m3 decode of every code, variant selection and the NUMA pool. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "kernels/backend.h"
#include "kernels/cpu/attn.h"
#include "kernels/cpu/attn_int.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/pool.h"

static const char *const variant_names[] = { "scalar", "avx2", "avx512" };
#define N_VARIANTS 3

static uint64_t rng_state;

static uint32_t rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return (uint32_t)(rng_state >> 11);
}

static float rndf(float lo, float hi)
{
	return lo + (hi - lo) * (float)(rnd() & 0xffffff) / 16777216.0f;
}

/* A cache and a batch of queries whose blocks are taken from a shuffled
 * list, so that every sequence spans non-contiguous blocks. */
struct setup {
	struct mlens_kv_cache kv;
	struct mlens_attn_query *qs;
	uint32_t *tables;
	float *q;
	int n, n_heads;
};

static void setup_make(struct setup *s, enum mlens_dtype dt, int n_layers, int nkv, int group,
		       int hd, int bs, const int32_t *lens, int n)
{
	uint32_t total = 0, *perm;
	size_t elems, used = 0;

	memset(s, 0, sizeof(*s));
	for (int i = 0; i < n; i++)
		total += (uint32_t)((lens[i] + bs - 1) / bs);
	total += 3;	/* a few blocks no sequence owns */
	s->kv = (struct mlens_kv_cache){ dt, n_layers, nkv, hd, bs, total, NULL, NULL };
	elems = mlens_kv_code_bytes(&s->kv) / mlens_dtype_size(dt);
	s->kv.k = malloc(mlens_kv_bytes(&s->kv));
	s->kv.v = malloc(mlens_kv_bytes(&s->kv));
	ck_assert(s->kv.k && s->kv.v);
	for (size_t e = 0; e < elems; e++) {
		/* e4m3: codes over the whole range, scaled back to |x| <= 1 */
		float r = dt == MLENS_DTYPE_E4M3 ? MLENS_E4M3_MAX : 1.0f;
		mlens_store(s->kv.k, dt, e, rndf(-r, r));
		mlens_store(s->kv.v, dt, e, rndf(-r, r));
	}
	if (dt == MLENS_DTYPE_E4M3)
		for (size_t r = 0; r < mlens_kv_rows(&s->kv); r++) {
			mlens_kv_scales(&s->kv, s->kv.k)[r] = rndf(0.25f, 1.0f) / MLENS_E4M3_MAX;
			mlens_kv_scales(&s->kv, s->kv.v)[r] = rndf(0.25f, 1.0f) / MLENS_E4M3_MAX;
		}
	perm = malloc(total * sizeof(*perm));
	ck_assert(perm);
	for (uint32_t b = 0; b < total; b++)
		perm[b] = b;
	for (uint32_t b = total - 1; b > 0; b--) {
		uint32_t o = rnd() % (b + 1), t = perm[b];
		perm[b] = perm[o];
		perm[o] = t;
	}
	s->n = n;
	s->n_heads = nkv * group;
	s->qs = calloc((size_t)n, sizeof(*s->qs));
	s->tables = perm;
	ck_assert(s->qs);
	for (int i = 0; i < n; i++) {
		int nb = (lens[i] + bs - 1) / bs;
		s->qs[i].ctx_len = lens[i];
		s->qs[i].n_blocks = nb;
		s->qs[i].block_table = perm + used;
		used += (size_t)nb;
	}
	s->q = malloc((size_t)n * s->n_heads * hd * sizeof(float));
	ck_assert(s->q);
	/* |q| up to 3 spreads the softmax well beyond uniform */
	for (size_t e = 0; e < (size_t)n * s->n_heads * hd; e++)
		s->q[e] = rndf(-3.0f, 3.0f);
}

static void setup_free(struct setup *s)
{
	free(s->kv.k);
	free(s->kv.v);
	free(s->qs);
	free(s->tables);
	free(s->q);
}

static float *run_ref(const struct setup *s, int layer, float scale)
{
	int hd = s->kv.head_dim, nkv = s->kv.n_kv_heads, group = s->n_heads / nkv;
	float *out = malloc((size_t)s->n * s->n_heads * hd * sizeof(float));
	ck_assert(out);
	for (int i = 0; i < s->n; i++)
		for (int g = 0; g < nkv; g++) {
			size_t off = ((size_t)i * s->n_heads + (size_t)g * group) * hd;
			mlens_cpu_attn_decode_group_ref(out + off, s->q + off, &s->kv, layer, g,
							&s->qs[i], group, scale);
		}
	return out;
}

static float *run_variant(const struct setup *s, struct mlens_pool *pool, int layer, float scale)
{
	struct mlens_cpu_attn_ws ws = { 0 };
	size_t nf = (size_t)s->n * s->n_heads * s->kv.head_dim;
	float *out = malloc(nf * sizeof(float));
	ck_assert(out);
	for (size_t e = 0; e < nf; e++)
		out[e] = NAN;	/* every element must be written */
	ck_assert_int_eq(mlens_cpu_attn_decode(pool, &ws, out, s->q, &s->kv, layer, s->qs, s->n,
					       s->n_heads, scale), 0);
	mlens_cpu_attn_ws_fini(&ws);
	return out;
}

/* Tolerance. Each output is a convex combination of V rows with |v| <= 1, so
 * errors are absolute. The kernels differ from the reference in summation
 * order (q.k in vector lanes; p*v per tile of 16 positions, split sequences
 * merged per chunk of 512) and in exp (a polynomial within 2 ulp of expf);
 * each step rounds at 2^-24 relative, and the reference itself rescales its
 * accumulator at every position, so the difference grows about like
 * sqrt(context) ulps. With |q| <= 3 and |k| <= 1 a score's rounding is below
 * 1e-6. Bound: 4e-6 + 2e-7 * sqrt(ctx) (2e-5 at 8192); the measured
 * maximum is about a tenth of it (printed below), so the margin is wide
 * while an indexing or softmax error (order 1e-2 and up) cannot pass. */
static double tolerance(int ctx)
{
	return 4e-6 + 2e-7 * sqrt((double)ctx);
}

static int compare(const struct setup *s, const float *ref, const float *got, double *worst)
{
	int hd = s->kv.head_dim, bad = 0;
	for (int i = 0; i < s->n; i++) {
		double tol = tolerance(s->qs[i].ctx_len);
		for (size_t e = 0; e < (size_t)s->n_heads * hd; e++) {
			size_t x = (size_t)i * s->n_heads * hd + e;
			double d = fabs((double)ref[x] - (double)got[x]);
			if (!(d <= tol)) {	/* NaN fails too */
				if (bad++ < 5)
					fprintf(stderr, "query %d (ctx %d) elem %zu: ref %.8g got %.8g\n",
						i, s->qs[i].ctx_len, e, ref[x], got[x]);
			}
			if (d / tol > *worst)
				*worst = d / tol;
		}
	}
	return bad;
}

static const int32_t lens_mixed[] = { 1, 2, 3, 15, 16, 17, 31, 33, 100, 255, 511, 512, 513,
				      1000, 1025, 2047, 3001, 8192 };
#define N_MIXED (int)(sizeof(lens_mixed) / sizeof(lens_mixed[0]))

struct shape {
	enum mlens_dtype dt;
	int nkv, group, hd, bs;
};

static const struct shape shapes[] = {
	{ MLENS_DTYPE_BF16, 2, 1, 64, 16 },
	{ MLENS_DTYPE_BF16, 2, 4, 128, 16 },
	{ MLENS_DTYPE_BF16, 1, 8, 128, 16 },
	{ MLENS_DTYPE_BF16, 2, 4, 64, 16 },
	{ MLENS_DTYPE_BF16, 1, 8, 64, 32 },	/* block larger than a tile */
	{ MLENS_DTYPE_BF16, 2, 4, 128, 5 },	/* odd block size */
	{ MLENS_DTYPE_BF16, 1, 4, 96, 16 },	/* head_dim outside the unrolled cases */
	{ MLENS_DTYPE_F32, 2, 4, 128, 16 },
	{ MLENS_DTYPE_F32, 1, 1, 64, 16 },
	{ MLENS_DTYPE_E4M3, 2, 4, 128, 16 },
	{ MLENS_DTYPE_E4M3, 1, 8, 128, 16 },	/* Qwen3-MoE's group of 8 */
	{ MLENS_DTYPE_E4M3, 1, 8, 64, 32 },
	{ MLENS_DTYPE_E4M3, 2, 4, 128, 5 },
	{ MLENS_DTYPE_E4M3, 1, 4, 96, 16 },
	{ MLENS_DTYPE_E4M3, 2, 1, 64, 16 },
};
#define N_SHAPES (int)(sizeof(shapes) / sizeof(shapes[0]))

START_TEST(test_variant_vs_reference)
{
	const char *name = variant_names[_i];
	struct mlens_pool *pool;
	double worst = 0.0;
	int bad = 0;

	if (!mlens_cpu_attn_variant_supported(name)) {
		printf("check_attention: skipping variant %s: this CPU lacks it\n", name);
		return;
	}
	ck_assert_int_eq(mlens_cpu_attn_set_variant(name), 0);
	ck_assert_str_eq(mlens_cpu_attn_variant(), name);
	ck_assert_int_eq(mlens_pool_create(&pool, 2, NULL), 0);
	for (int k = 0; k < N_SHAPES; k++) {
		const struct shape *sh = &shapes[k];
		struct setup s;
		int32_t lens[N_MIXED + 24];
		int n = 0;
		float *ref, *got, scale = 1.0f / sqrtf((float)sh->hd);

		rng_state = 0x9e3779b97f4a7c15ull + (uint64_t)k;
		for (int i = 0; i < N_MIXED; i++)
			lens[n++] = lens_mixed[i];
		for (int i = 0; i < 24; i++)	/* plus random lengths */
			lens[n++] = 1 + (int32_t)(rnd() % 2500);
		setup_make(&s, sh->dt, 2, sh->nkv, sh->group, sh->hd, sh->bs, lens, n);
		ref = run_ref(&s, 1, scale);
		got = run_variant(&s, pool, 1, scale);
		bad += compare(&s, ref, got, &worst);
		if (bad)
			fprintf(stderr, "variant %s shape %d (%s nkv %d group %d hd %d bs %d) differs\n",
				name, k, mlens_dtype_name(sh->dt), sh->nkv, sh->group, sh->hd, sh->bs);
		free(ref);
		free(got);
		setup_free(&s);
	}
	printf("check_attention: %s: worst |diff| / tolerance = %.3f\n", name, worst);
	ck_assert_int_eq(bad, 0);
	mlens_pool_destroy(pool);
}
END_TEST

/* 1 and 2 threads give identical bits: one long sequence among short ones
 * (all KV heads in a task either way), and a single short sequence, which
 * the dispatcher splits by KV heads differently for 1 and 2 threads. */
START_TEST(test_threads_identical)
{
	const char *name = variant_names[_i];
	static const int32_t mixed[] = { 7000, 3, 600, 1, 1500, 64, 8192, 17 };
	static const int32_t single[] = { 700 };
	struct mlens_pool *p1, *p2;

	if (!mlens_cpu_attn_variant_supported(name)) {
		printf("check_attention: skipping variant %s: this CPU lacks it\n", name);
		return;
	}
	ck_assert_int_eq(mlens_cpu_attn_set_variant(name), 0);
	ck_assert_int_eq(mlens_pool_create(&p1, 1, NULL), 0);
	ck_assert_int_eq(mlens_pool_create(&p2, 2, NULL), 0);
	for (int k = 0; k < 2; k++) {
		struct setup s;
		float *a, *b, *ref;
		double worst = 0.0;

		rng_state = 12345 + (uint64_t)k;
		if (k == 0)
			setup_make(&s, MLENS_DTYPE_BF16, 1, 8, 4, 128, 16, mixed, 8);
		else
			setup_make(&s, MLENS_DTYPE_BF16, 1, 8, 4, 128, 16, single, 1);
		a = run_variant(&s, p1, 0, 0.0883883f);
		b = run_variant(&s, p2, 0, 0.0883883f);
		ref = run_ref(&s, 0, 0.0883883f);
		ck_assert(memcmp(a, b, (size_t)s.n * s.n_heads * 128 * sizeof(float)) == 0);
		ck_assert_int_eq(compare(&s, ref, a, &worst), 0);
		free(a);
		free(b);
		free(ref);
		setup_free(&s);
	}
	mlens_pool_destroy(p1);
	mlens_pool_destroy(p2);
}
END_TEST

/* The tuning knobs (attn_int.h) change speed, not results: every prefetch
 * setting and head grouping gives the default's bits; another chunk size
 * changes the merge order only, so it stays within the tolerance (chunks
 * of 100 positions and of one block, every position in exactly one). Shapes:
 * a block of 16 (tiles align with blocks) and an odd one of 5 (prefetch
 * targets cross blocks mid-tile), in bf16 and f32. */
START_TEST(test_tuning_knobs)
{
	static const struct shape kshapes[] = {
		{ MLENS_DTYPE_BF16, 8, 4, 128, 16 },
		{ MLENS_DTYPE_BF16, 2, 4, 64, 5 },
		{ MLENS_DTYPE_F32, 4, 2, 128, 16 },
	};
	static const int32_t lens[] = { 1, 17, 700, 2049, 5, 1300, 33, 4000 };
	const struct mlens_attn_tuning def = mlens_attn_tune;
	struct mlens_attn_tuning set[] = { def, def, def, def, def, def, def, def, def };
	const char *name = variant_names[_i];
	struct mlens_pool *pool;

	if (!mlens_cpu_attn_variant_supported(name)) {
		printf("check_attention: skipping variant %s: this CPU lacks it\n", name);
		return;
	}
	set[0].prefetch_tiles = 0;
	set[1].prefetch_spread = 0;
	set[2].prefetch_bytes = 20000;
	set[3].prefetch_hint = 0;
	set[4].prefetch_hint = 3;
	set[5].prefetch_every = 4;
	set[6].prefetch_tiles = 37;
	set[7].heads_per_task = 1;
	set[8].heads_per_task = 3;
	ck_assert_int_eq(mlens_cpu_attn_set_variant(name), 0);
	ck_assert_int_eq(mlens_pool_create(&pool, 2, NULL), 0);
	for (int k = 0; k < 3; k++) {
		const struct shape *sh = &kshapes[k];
		size_t bytes = sizeof(lens) / sizeof(lens[0]) * (size_t)sh->nkv * sh->group * sh->hd *
			       sizeof(float);
		float *a, *b, *ref, scale = 1.0f / sqrtf((float)sh->hd);
		double worst = 0.0;
		struct setup s;

		rng_state = 777 + (uint64_t)k;
		setup_make(&s, sh->dt, 1, sh->nkv, sh->group, sh->hd, sh->bs, lens,
			   (int)(sizeof(lens) / sizeof(lens[0])));
		a = run_variant(&s, pool, 0, scale);
		for (size_t x = 0; x < sizeof(set) / sizeof(set[0]); x++) {
			mlens_attn_tune = set[x];
			b = run_variant(&s, pool, 0, scale);
			mlens_attn_tune = def;
			if (memcmp(a, b, bytes))
				ck_abort_msg("%s shape %d: knob setting %zu changed the result", name, k, x);
			free(b);
		}
		ref = run_ref(&s, 0, scale);
		/* chunks of 100 positions, and of one block (about a chunk per
		 * block, the equal chunks' rounding to blocks leaving fewer) */
		for (int ck = 0; ck < 2; ck++) {
			mlens_attn_tune.chunk_tokens = ck ? sh->bs : 100;
			b = run_variant(&s, pool, 0, scale);
			mlens_attn_tune = def;
			ck_assert_int_eq(compare(&s, ref, b, &worst), 0);
			free(b);
		}
		ck_assert_int_eq(compare(&s, ref, a, &worst), 0);
		free(a);
		free(ref);
		setup_free(&s);
	}
	mlens_pool_destroy(pool);
}
END_TEST

/* Values that exercise bf16 rounding: ties both ways, carries into the
 * exponent, subnormals, infinities, NaNs of both signs. */
static float special(int i)
{
	static const uint32_t bits[] = {
		0x3f808000, 0x3f818000, 0x3f80ffff, 0x3f7fffff, 0x7f7fffff, 0xff7fffff,
		0x00000001, 0x80008000, 0x00018000, 0x007fffff, 0x7f800000, 0xff800000,
		0x7fc00000, 0xffc00001, 0x7f800001, 0xff800001, 0x00000000, 0x80000000,
	};
	float f;
	memcpy(&f, &bits[i % (int)(sizeof(bits) / sizeof(bits[0]))], 4);
	return f;
}

/* Row (i, g) of K or V (x) as the append must have stored it: bf16 bit for
 * bit as mlens_f32_to_bf16 rounds; e4m3 as mlens_e4m3_quantize_row, codes
 * and scale (the oracle the CUDA append is held to), the scale amax / 448
 * and every value back within e4m3's half step. */
static void check_row(const struct mlens_kv_cache *kv, const void *base, size_t idx,
		      const float *src)
{
	int hd = kv->head_dim;
	uint8_t want[256];
	float sc, amax = 0.0f;

	if (kv->dtype == MLENS_DTYPE_BF16) {
		for (int d = 0; d < hd; d++)
			ck_assert_uint_eq(((const uint16_t *)base)[idx + (size_t)d],
					  mlens_f32_to_bf16(src[d]));
		return;
	}
	sc = mlens_kv_scales(kv, base)[idx / (size_t)hd];
	ck_assert_float_eq(sc, mlens_e4m3_quantize_row(want, src, hd));
	ck_assert_mem_eq((const uint8_t *)base + idx, want, (size_t)hd);
	for (int d = 0; d < hd; d++)
		amax = fmaxf(amax, fabsf(src[d]));
	ck_assert_float_eq(sc, amax / 448.0f);
	for (int d = 0; d < hd; d++) {
		/* 3 mantissa bits: half an ulp is 1/16 of the value, or half
		 * the subnormal step */
		if (isnan(src[d]))
			continue;
		float err = fabsf(mlens_e4m3_to_f32(want[d]) * sc - src[d]);
		ck_assert(err <= fabsf(src[d]) / 16 + sc * 0x1p-10f * 1.0001f);
	}
}

/* bf16 and fp8 (e4m3) appends: by the caller alone and over a pool, every
 * row as check_row wants it; layer 0 untouched, a bad slot writes nothing.
 * bf16 gets any bit pattern and the rounding specials; fp8 rows of very
 * different magnitudes, rows reaching e4m3's subnormals, an all-zero row,
 * a row of ties between codes and a NaN (the vector quantizers must match
 * the scalar one there too). */
START_TEST(test_append_exact)
{
	const char *name = variant_names[_i];
	static const enum mlens_dtype dts[] = { MLENS_DTYPE_BF16, MLENS_DTYPE_E4M3 };
	int nkv = 4, hd = 100, bs = 16, n = 37;	/* hd not a multiple of a vector */
	size_t row = (size_t)nkv * hd;
	float *k = malloc((size_t)n * row * sizeof(float)), *v = malloc((size_t)n * row * sizeof(float));
	int64_t slots[37];
	uint32_t perm[8] = { 5, 2, 7, 0, 3, 6, 1, 4 };
	struct mlens_pool *pool = NULL;

	if (!mlens_cpu_attn_variant_supported(name)) {
		printf("check_attention: skipping variant %s: this CPU lacks it\n", name);
		free(k);
		free(v);
		return;
	}
	ck_assert_int_eq(mlens_cpu_attn_set_variant(name), 0);
	ck_assert_int_eq(mlens_pool_create(&pool, 3, NULL), 0);
	for (int t = 0; t < 2; t++) {
		struct mlens_kv_cache kv = { dts[t], 2, nkv, hd, bs, 8, NULL, NULL };
		size_t half = mlens_kv_code_bytes(&kv) / 2;	/* layer 0's codes */
		kv.k = calloc(1, mlens_kv_bytes(&kv));
		kv.v = calloc(1, mlens_kv_bytes(&kv));
		ck_assert(k && v && kv.k && kv.v);
		rng_state = 777;
		for (size_t e = 0; e < (size_t)n * row; e++) {
			if (kv.dtype == MLENS_DTYPE_BF16) {
				uint32_t u = rnd() ^ (rnd() << 21);	/* any bit pattern */
				memcpy(&k[e], &u, 4);
				v[e] = e % 5 == 0 ? special((int)(e / 5)) : rndf(-100.0f, 100.0f);
			} else {
				size_t r = e / (size_t)hd, d = e % (size_t)hd;
				float mag = ldexpf(1.0f, (int)(r % 24) - 12);
				k[e] = r == 3 ? 0.0f : rndf(-mag, mag);
				if (r % 4 == 0)	/* down to e4m3's subnormals and below */
					k[e] *= ldexpf(1.0f, -(int)(rnd() % 24));
				v[e] = rndf(-100.0f, 100.0f);
				if (r == 5)	/* scale 1: 448, then ties between codes */
					v[e] = d ? (mlens_e4m3_to_f32((uint8_t)(d - 1)) +
						    mlens_e4m3_to_f32((uint8_t)d)) / (d % 2 ? 2 : -2)
						 : 448.0f;
				if (r == 6 && d == 7)
					v[e] = NAN;	/* not in the amax; code 0x7f */
			}
		}
		for (int i = 0; i < n; i++)
			slots[i] = (int64_t)perm[i / bs] * bs + i % bs;
		/* by the caller alone, then split over a pool of 3 (37 rows: two
		 * tasks, the second short) */
		for (int pooled = 0; pooled < 2; pooled++) {
			memset(kv.k, 0, mlens_kv_bytes(&kv));
			memset(kv.v, 0, mlens_kv_bytes(&kv));
			ck_assert_int_eq(mlens_cpu_kv_append(pooled ? pool : NULL, &kv, 1, k, v, slots, n),
					 0);
			for (int i = 0; i < n; i++)
				for (int g = 0; g < nkv; g++) {
					size_t idx = mlens_kv_index(&kv, 1, perm[i / bs], g, i % bs);
					size_t e = (size_t)i * row + (size_t)g * hd;
					check_row(&kv, kv.k, idx, k + e);
					check_row(&kv, kv.v, idx, v + e);
				}
		}
		/* layer 0 untouched; a bad slot writes nothing */
		for (size_t e = 0; e < half; e++)
			ck_assert_uint_eq(((uint8_t *)kv.k)[e], 0);
		slots[n - 1] = 8 * bs;
		ck_assert_int_eq(mlens_cpu_kv_append(pool, &kv, 0, k, v, slots, n), -ERANGE);
		for (size_t e = 0; e < half; e++)
			ck_assert_uint_eq(((uint8_t *)kv.k)[e], 0);
		ck_assert_int_eq(mlens_cpu_kv_append(NULL, &kv, 2, k, v, slots, 1), -ERANGE);
		free(kv.k);
		free(kv.v);
	}
	mlens_pool_destroy(pool);
	free(k);
	free(v);
}
END_TEST


/* The vector kernels' e4m3 decode is exact for all 256 codes: one position
 * whose K codes are 0 (p = 1) and whose V row holds every code with scale 1,
 * so the output is each code's value, NaN codes NaN. Groups of 1 and 8
 * query heads: a group of 8 reads rows widened once per tile. */
START_TEST(test_fp8_every_code)
{
	const char *name = variant_names[_i];
	int32_t len = 1;
	struct mlens_pool *pool;

	if (!mlens_cpu_attn_variant_supported(name))
		return;
	ck_assert_int_eq(mlens_cpu_attn_set_variant(name), 0);
	ck_assert_int_eq(mlens_pool_create(&pool, 1, NULL), 0);
	for (int group = 1; group <= 8; group += 7) {
		struct setup s;
		float *got;

		rng_state = 99;
		/* 2 KV heads x 128: each head's row holds 128 codes, both all 256 */
		setup_make(&s, MLENS_DTYPE_E4M3, 1, 2, group, 128, 16, &len, 1);
		for (int g = 0; g < 2; g++) {
			size_t idx = mlens_kv_index(&s.kv, 0, s.qs[0].block_table[0], g, 0);
			memset((uint8_t *)s.kv.k + idx, 0, 128);
			for (int d = 0; d < 128; d++)
				((uint8_t *)s.kv.v)[idx + (size_t)d] = (uint8_t)(g * 128 + d);
			mlens_kv_scales(&s.kv, s.kv.v)[idx / 128] = 1.0f;
		}
		got = run_variant(&s, pool, 0, 0.125f);
		for (int h = 0; h < 2 * group; h++)
			for (int d = 0; d < 128; d++) {
				int c = h / group * 128 + d;
				float want = mlens_e4m3_to_f32((uint8_t)c), x = got[h * 128 + d];
				if (isnan(want))
					ck_assert_msg(isnan(x), "group %d head %d code %#x: %g",
						      group, h, c, x);
				else
					ck_assert_msg(x == want, "group %d head %d code %#x: want %a got %a",
						      group, h, c, want, x);
			}
		free(got);
		setup_free(&s);
	}
	mlens_pool_destroy(pool);
}
END_TEST

/* A NaN code (0x7f) in one K row poisons its KV head's scores and so
 * that head group's output in that sequence, as in the reference; every
 * other output stays within the tolerance. The kernels decode e4m3 without
 * a NaN fix-up and send a tile holding a NaN code through the exact
 * conversion instead: this is the K side of that path (the every-code test
 * covers V). Groups of 4 and 8 (K read from registers, K widened once). */
START_TEST(test_fp8_nan_in_k)
{
	const char *name = variant_names[_i];
	static const int32_t lens[] = { 100, 40 };
	struct mlens_pool *pool;

	if (!mlens_cpu_attn_variant_supported(name))
		return;
	ck_assert_int_eq(mlens_cpu_attn_set_variant(name), 0);
	ck_assert_int_eq(mlens_pool_create(&pool, 1, NULL), 0);
	for (int group = 4; group <= 8; group += 4) {
		struct setup s;
		float *ref, *got;
		int hd = 128, bs = 16, t = 37, nan_out = 0;
		size_t idx;

		rng_state = 7 + (uint64_t)group;
		setup_make(&s, MLENS_DTYPE_E4M3, 1, 2, group, hd, bs, lens, 2);
		idx = mlens_kv_index(&s.kv, 0, s.qs[0].block_table[t / bs], 0, t % bs);
		((uint8_t *)s.kv.k)[idx + 5] = MLENS_E4M3_NAN;
		ref = run_ref(&s, 0, 0.0883883f);
		got = run_variant(&s, pool, 0, 0.0883883f);
		for (int i = 0; i < s.n; i++)
			for (size_t e = 0; e < (size_t)s.n_heads * (size_t)hd; e++) {
				size_t x = (size_t)i * s.n_heads * hd + e;
				bool poisoned = i == 0 && e < (size_t)group * (size_t)hd;
				ck_assert_msg(isnan(ref[x]) == poisoned, "reference: seq %d elem %zu: %g", i, e,
					      ref[x]);
				if (poisoned) {
					ck_assert_msg(isnan(got[x]), "group %d elem %zu: %g, not NaN", group, e,
						      got[x]);
					nan_out++;
				} else {
					ck_assert_msg(fabs((double)ref[x] - (double)got[x]) <= tolerance(lens[i]),
						      "group %d seq %d elem %zu: ref %.8g got %.8g", group, i, e,
						      ref[x], got[x]);
				}
			}
		ck_assert_int_eq(nan_out, group * hd);
		free(ref);
		free(got);
		setup_free(&s);
	}
	mlens_pool_destroy(pool);
}
END_TEST

/* The round op (the CPU attention's output on its way up in half the
 * bytes): every value as mlens_store rounds it, bf16 through the
 * variant's vector code, by the caller alone and over a pool (a row count
 * that leaves the last task short); f16 too; other dtypes refused. */
START_TEST(test_round_exact)
{
	const char *name = variant_names[_i];
	int rows = 37, cols = 4100;	/* 151,700 values: three pool tasks, the last short */
	size_t n = (size_t)rows * cols;
	float *src = malloc(n * sizeof(float));
	uint16_t *dst = malloc(n * 2);
	struct mlens_pool *pool = NULL;

	if (!mlens_cpu_attn_variant_supported(name)) {
		printf("check_attention: skipping variant %s: this CPU lacks it\n", name);
		free(src);
		free(dst);
		return;
	}
	ck_assert_int_eq(mlens_cpu_attn_set_variant(name), 0);
	ck_assert(src && dst);
	rng_state = 4242;
	for (size_t e = 0; e < n; e++) {
		uint32_t u = rnd() ^ (rnd() << 21);	/* any bit pattern */
		if (e % 3 == 0)
			memcpy(&src[e], &u, 4);
		else
			src[e] = e % 7 == 0 ? special((int)(e / 7)) : rndf(-100.0f, 100.0f);
	}
	ck_assert_int_eq(mlens_pool_create(&pool, 3, NULL), 0);
	for (int pooled = 0; pooled < 2; pooled++) {
		memset(dst, 0xa5, n * 2);
		ck_assert_int_eq(mlens_cpu_round(pooled ? pool : NULL, dst, MLENS_DTYPE_BF16, src, rows,
						 cols), 0);
		for (size_t e = 0; e < n; e++)
			ck_assert_msg(dst[e] == mlens_f32_to_bf16(src[e]), "value %zu (%08x): %04x, not %04x",
				      e, ((uint32_t *)(void *)src)[e], dst[e], mlens_f32_to_bf16(src[e]));
		memset(dst, 0xa5, n * 2);
		ck_assert_int_eq(mlens_cpu_round(pooled ? pool : NULL, dst, MLENS_DTYPE_F16, src, rows,
						 cols), 0);
		for (size_t e = 0; e < n; e++) {
			uint16_t want;
			mlens_store(&want, MLENS_DTYPE_F16, 0, src[e]);
			ck_assert_uint_eq(dst[e], want);
		}
	}
	/* rows of 0 write nothing; fp32 and negative sizes are refused */
	memset(dst, 0xa5, 4);
	ck_assert_int_eq(mlens_cpu_round(pool, dst, MLENS_DTYPE_BF16, src, 0, cols), 0);
	ck_assert_uint_eq(dst[0], 0xa5a5);
	ck_assert_int_eq(mlens_cpu_round(pool, dst, MLENS_DTYPE_F32, src, rows, cols), -EINVAL);
	ck_assert_int_eq(mlens_cpu_round(pool, dst, MLENS_DTYPE_BF16, src, -1, cols), -EINVAL);
	ck_assert_int_eq(mlens_cpu_round(pool, dst, MLENS_DTYPE_BF16, src, rows, -1), -EINVAL);
	ck_assert_uint_eq(dst[0], 0xa5a5);
	mlens_pool_destroy(pool);
	free(src);
	free(dst);
}
END_TEST

/* The output in 16 bits from the attention's own run: bit for bit
 * mlens_cpu_round of the fp32 output, for every shape (split queries go
 * through the merge, short ones straight from the kernel), bf16 and f16,
 * one thread and two (a 700-position query alone is split by KV heads
 * differently for each), and from the backend op and its helper. */
START_TEST(test_decode_half_exact)
{
	const char *name = variant_names[_i];
	struct mlens_pool *pools[2];

	if (!mlens_cpu_attn_variant_supported(name)) {
		printf("check_attention: skipping variant %s: this CPU lacks it\n", name);
		return;
	}
	ck_assert_int_eq(mlens_cpu_attn_set_variant(name), 0);
	ck_assert_int_eq(mlens_pool_create(&pools[0], 1, NULL), 0);
	ck_assert_int_eq(mlens_pool_create(&pools[1], 2, NULL), 0);
	for (int k = 0; k <= N_SHAPES; k++) {
		static const int32_t single[] = { 700 };
		const struct shape *sh = &shapes[k < N_SHAPES ? k : 1];
		struct setup s;
		int32_t lens[N_MIXED + 8];
		int n = 0;
		float scale = 1.0f / sqrtf((float)sh->hd);

		/* the rounding of the output is what this test holds; the fp8
		 * cache's reading is test_variant_vs_reference's: one fp8 shape
		 * here (the sanitizer builds run this test near its timeout) */
		if (k < N_SHAPES && sh->dt == MLENS_DTYPE_E4M3 && k > 0 &&
		    shapes[k - 1].dt == MLENS_DTYPE_E4M3)
			continue;
		rng_state = 0x51ed27 + (uint64_t)k;
		if (k < N_SHAPES) {
			for (int i = 0; i < N_MIXED; i++)
				lens[n++] = lens_mixed[i];
			for (int i = 0; i < 8; i++)
				lens[n++] = 1 + (int32_t)(rnd() % 2500);
		} else {
			lens[n++] = single[0];
		}
		setup_make(&s, sh->dt, 2, sh->nkv, sh->group, sh->hd, sh->bs, lens, n);
		size_t nf = (size_t)s.n * s.n_heads * sh->hd;
		uint16_t *want = malloc(nf * 2), *got = malloc(nf * 2);
		float *room = malloc(nf * sizeof(float));
		ck_assert(want && got && room);
		for (int t = 0; t < 2; t++) {
			float *ref = run_variant(&s, pools[t], 1, scale);
			for (int d = 0; d < 2; d++) {
				enum mlens_dtype dt = d ? MLENS_DTYPE_F16 : MLENS_DTYPE_BF16;
				struct mlens_cpu_attn_ws ws = { 0 };
				ck_assert_int_eq(mlens_cpu_round(NULL, want, dt, ref, s.n,
								 s.n_heads * sh->hd), 0);
				memset(got, 0xa5, nf * 2);
				ck_assert_int_eq(mlens_cpu_attn_decode_half(pools[t], &ws, got, dt, room,
									    s.q, &s.kv, 1, s.qs, s.n,
									    s.n_heads, scale), 0);
				mlens_cpu_attn_ws_fini(&ws);
				for (size_t e = 0; e < nf; e++)
					ck_assert_msg(got[e] == want[e],
						      "%s shape %d %s, %d thread(s): value %zu is %04x, "
						      "not %04x (round of %.9g)", name, k,
						      mlens_dtype_name(dt), t + 1, e, got[e], want[e],
						      ref[e]);
			}
			free(ref);
		}
		free(want);
		free(got);
		free(room);
		setup_free(&s);
	}
	mlens_pool_destroy(pools[0]);
	mlens_pool_destroy(pools[1]);
}
END_TEST

/* The backend op and mlens_backend_attn_decode_half, with the op and
 * without it (attn_decode, then round): the same bits; fp32 refused. */
START_TEST(test_decode_half_backend)
{
	struct mlens_backend be;
	struct mlens_backend_opts o = { .n_threads = 2 };
	struct mlens_backend_ops bare;
	static const int32_t lens[] = { 5, 600, 1500, 33 };
	struct setup s;
	size_t nf;
	uint16_t *a, *b;
	float *room;

	ck_assert_int_eq(mlens_backend_create(&be, "cpu", &o), 0);
	ck_assert(MLENS_BACKEND_HAS(be.ops, attn_decode_half));
	bare = *be.ops;
	bare.attn_decode_half = NULL;
	rng_state = 777;
	setup_make(&s, MLENS_DTYPE_BF16, 2, 2, 4, 128, 16, lens, 4);
	nf = (size_t)s.n * s.n_heads * 128;
	a = malloc(nf * 2);
	b = malloc(nf * 2);
	room = malloc(nf * sizeof(float));
	ck_assert(a && b && room);
	memset(a, 0xa5, nf * 2);
	memset(b, 0x5a, nf * 2);
	ck_assert_int_eq(mlens_backend_attn_decode_half(be.ops, be.ctx, a, MLENS_DTYPE_BF16, room,
							s.q, &s.kv, 0, s.qs, s.n, s.n_heads,
							0.0883883f), 0);
	ck_assert_int_eq(mlens_backend_attn_decode_half(&bare, be.ctx, b, MLENS_DTYPE_BF16, room,
							s.q, &s.kv, 0, s.qs, s.n, s.n_heads,
							0.0883883f), 0);
	ck_assert(memcmp(a, b, nf * 2) == 0);
	ck_assert_int_eq(mlens_backend_attn_decode_half(be.ops, be.ctx, a, MLENS_DTYPE_F32, room,
							s.q, &s.kv, 0, s.qs, s.n, s.n_heads,
							0.0883883f), -EINVAL);
	ck_assert_int_eq(mlens_backend_attn_decode_half(&bare, be.ctx, a, MLENS_DTYPE_F32, room,
							s.q, &s.kv, 0, s.qs, s.n, s.n_heads,
							0.0883883f), -EINVAL);
	ck_assert_int_eq(mlens_cpu_attn_decode_half(NULL, NULL, NULL, MLENS_DTYPE_BF16, room, s.q,
						    &s.kv, 0, s.qs, s.n, s.n_heads, 0.1f), -EINVAL);
	ck_assert_int_eq(mlens_cpu_attn_decode_half(NULL, NULL, a, MLENS_DTYPE_BF16, NULL, s.q,
						    &s.kv, 0, s.qs, s.n, s.n_heads, 0.1f), -EINVAL);
	bare.round = NULL;
	ck_assert_int_eq(mlens_backend_attn_decode_half(&bare, be.ctx, a, MLENS_DTYPE_BF16, room,
							s.q, &s.kv, 0, s.qs, s.n, s.n_heads,
							0.0883883f), -ENOTSUP);
	free(a);
	free(b);
	free(room);
	setup_free(&s);
	mlens_backend_destroy(&be);
}
END_TEST

START_TEST(test_variant_selection)
{
	ck_assert_int_eq(mlens_cpu_attn_set_variant("sse9"), -EINVAL);
	ck_assert_int_eq(mlens_cpu_attn_set_variant(NULL), -EINVAL);
	ck_assert_int_eq(mlens_cpu_attn_set_variant("scalar"), 0);
	ck_assert_str_eq(mlens_cpu_attn_variant(), "scalar");
	ck_assert_int_eq(mlens_cpu_attn_set_variant("auto"), 0);
	ck_assert(mlens_cpu_attn_variant_supported(mlens_cpu_attn_variant()));
	if (!mlens_cpu_attn_variant_supported("avx512"))
		ck_assert_int_eq(mlens_cpu_attn_set_variant("avx512"), -ENOTSUP);
	else
		ck_assert_str_eq(mlens_cpu_attn_variant(), "avx512");
}
END_TEST

/* MLENS_ATTN_KERNEL picks the kernel at first use (each test runs in its
 * own forked process, so this one sees a fresh choice). */
START_TEST(test_env_variant)
{
	const char *fork = getenv("CK_FORK");
	if (fork && !strcmp(fork, "no")) {
		printf("check_attention: skipping the MLENS_ATTN_KERNEL test: needs CK_FORK\n");
		return;
	}
	setenv("MLENS_ATTN_KERNEL", "scalar", 1);
	ck_assert_str_eq(mlens_cpu_attn_variant(), "scalar");
}
END_TEST

/* Bad input is refused before anything runs. */
START_TEST(test_decode_errors)
{
	struct mlens_pool *pool;
	struct mlens_cpu_attn_ws ws = { 0 };
	int32_t lens[] = { 20 };
	struct setup s;
	float out[4 * 64];

	ck_assert_int_eq(mlens_pool_create(&pool, 1, NULL), 0);
	rng_state = 99;
	setup_make(&s, MLENS_DTYPE_BF16, 1, 2, 2, 64, 16, lens, 1);
	ck_assert_int_eq(mlens_cpu_attn_decode(pool, &ws, out, s.q, &s.kv, 0, s.qs, 1, 3, 0.1f), -EINVAL);
	ck_assert_int_eq(mlens_cpu_attn_decode(pool, &ws, out, s.q, &s.kv, 1, s.qs, 1, 4, 0.1f), -ERANGE);
	s.qs[0].ctx_len = 33;	/* beyond its two blocks */
	ck_assert_int_eq(mlens_cpu_attn_decode(pool, &ws, out, s.q, &s.kv, 0, s.qs, 1, 4, 0.1f), -ERANGE);
	s.qs[0].ctx_len = 0;
	ck_assert_int_eq(mlens_cpu_attn_decode(pool, &ws, out, s.q, &s.kv, 0, s.qs, 1, 4, 0.1f), -ERANGE);
	mlens_cpu_attn_ws_fini(&ws);
	setup_free(&s);
	mlens_pool_destroy(pool);
}
END_TEST

static void count_task(void *arg, int task, int thread)
{
	int *hits = arg;
	__atomic_fetch_add(&hits[task], 1, __ATOMIC_RELAXED);
}

START_TEST(test_pool_numa)
{
	struct mlens_pool *p;
	int hits[100] = { 0 };
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);

	/* default: the node's CPUs less the reserved one, never below 1 */
	ck_assert_int_eq(mlens_pool_create_numa(&p, 0, 0, 1), 0);
	ck_assert_int_ge(mlens_pool_size(p), 1);
	ck_assert_int_le(mlens_pool_size(p), ncpu > 1 ? ncpu - 1 : 1);
	mlens_pool_destroy(p);
	/* an explicit count, more threads than CPUs */
	ck_assert_int_eq(mlens_pool_create_numa(&p, 0, 3, 1), 0);
	ck_assert_int_eq(mlens_pool_size(p), 3);
	mlens_pool_run(p, 100, count_task, hits);
	for (int t = 0; t < 100; t++)
		ck_assert_int_eq(hits[t], 1);
	mlens_pool_destroy(p);
	ck_assert_int_eq(mlens_pool_create_numa(&p, 4096, 0, 0), -EINVAL);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("attention");
	TCase *tc = tcase_create("core");
	SRunner *sr;
	int failed;

	tcase_set_timeout(tc, 60);
	tcase_add_loop_test(tc, test_variant_vs_reference, 0, N_VARIANTS);
	tcase_add_loop_test(tc, test_threads_identical, 0, N_VARIANTS);
	tcase_add_loop_test(tc, test_append_exact, 0, N_VARIANTS);
	tcase_add_loop_test(tc, test_fp8_every_code, 0, N_VARIANTS);
	tcase_add_loop_test(tc, test_fp8_nan_in_k, 0, N_VARIANTS);
	tcase_add_loop_test(tc, test_round_exact, 0, N_VARIANTS);
	tcase_add_loop_test(tc, test_decode_half_exact, 0, N_VARIANTS);
	tcase_add_test(tc, test_decode_half_backend);
	tcase_add_loop_test(tc, test_tuning_knobs, 0, N_VARIANTS);
	tcase_add_test(tc, test_variant_selection);
	tcase_add_test(tc, test_env_variant);
	tcase_add_test(tc, test_decode_errors);
	tcase_add_test(tc, test_pool_numa);
	suite_add_tcase(s, tc);
	sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}
