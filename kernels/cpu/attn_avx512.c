/* AVX-512 (F, BW, VL) decode attention and f32 -> bf16 conversion; this file
 * alone is built with -mavx512f -mavx512bw -mavx512vl and is only called
 * after CPUID said yes (attn.c). */
#include <immintrin.h>
#include "kernels/cpu/attn_int.h"

typedef __m512 vec;
#define W 16
#define SUFFIX(name) name##_avx512
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps((p), (x))
#define VSET1(x) _mm512_set1_ps(x)
#define VZERO() _mm512_setzero_ps()
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VDIV(a, b) _mm512_div_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VHSUM(x) _mm512_reduce_add_ps(x)
#define VHMAX(x) _mm512_reduce_max_ps(x)
#define VLOAD_BF16X2(p, e, o) do { \
	__m512i x_ = _mm512_loadu_si512((const void *)(p)); \
	(e) = _mm512_castsi512_ps(_mm512_slli_epi32(x_, 16)); \
	(o) = _mm512_castsi512_ps(_mm512_and_si512(x_, _mm512_set1_epi32((int)0xffff0000u))); \
} while (0)
#define VLOAD_E4M3X2(p, e, o) \
	e4m3x32_avx512(_mm256_loadu_si256((const __m256i *)(const void *)(p)), &(e), &(o), 0)
#define VLOAD_E4M3X2_FINITE(p, e, o) \
	e4m3x32_avx512(_mm256_loadu_si256((const __m256i *)(const void *)(p)), &(e), &(o), 1)
#define E4M3_ANY_NAN(p, n) mlens_e4m3_any_nan_avx2((p), (n))
#define VHSUM4(a, b, c, d, s) hsum4_avx512((a), (b), (c), (d), (s))
/* 2W values in a, b (in order) -> the even ones in ev, the odd ones in od */
#define VDEINT(a, b, ev, od) do { \
	(ev) = _mm512_permutex2var_ps((a), _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, \
					20, 22, 24, 26, 28, 30), (b)); \
	(od) = _mm512_permutex2var_ps((a), _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, \
					21, 23, 25, 27, 29, 31), (b)); \
} while (0)
/* the inverse: ev, od -> a, b in order */
#define VINTER(ev, od, a, b) do { \
	(a) = _mm512_permutex2var_ps((ev), _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, \
					5, 21, 6, 22, 7, 23), (od)); \
	(b) = _mm512_permutex2var_ps((ev), _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, \
					28, 13, 29, 14, 30, 15, 31), (od)); \
} while (0)
/* 4x4 score accumulators, 4 heads x 2 pairs of p*V accumulators (24 of 32 registers) */
#define SC_HB 4
#define SC_TB 4
#define PV_HB 4
#define PV_CP 2
#define VEXP(x) exp_avx512(x)

/* The 32 e4m3 codes at b as fp32 times 2^-8, as e4m3x16_avx2 in
 * attn_avx2.c does it (finite: as there). */
static inline __attribute__((always_inline)) void
e4m3x32_avx512(__m256i b, __m512 *e, __m512 *o, const int finite)
{
	__m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
				     _mm512_set1_epi16((short)0xbf80));
	if (!finite) {
		__mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_and_si512(h,
							_mm512_set1_epi16(0x3f80)),
							_mm512_set1_epi16(0x3f80));
		h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7fff));
	}
	*e = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
	*o = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

/* exp(x) for x <= 0 (Cephes expf: range reduction by ln 2 in two parts and
 * a degree-5 polynomial, within 2 ulp of expf); 0 where expf is subnormal
 * or zero, so padding scores of -inf give p = 0. */
static inline __m512 exp_avx512(__m512 x)
{
	__mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
	__m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
					 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
	__m512 z, y;
	__m512i e;
	r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
	z = _mm512_mul_ps(r, r);
	y = _mm512_set1_ps(1.9875691500e-4f);
	y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
	y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
	y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
	y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
	y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
	y = _mm512_fmadd_ps(y, z, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
	e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
	y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
	return _mm512_maskz_mov_ps((__mmask16)~tiny, y);
}

/* s[0..3] = the sums of a, b, c, d: a transpose-and-add tree, cheaper
 * than four separate reductions. */
static inline void hsum4_avx512(__m512 a, __m512 b, __m512 c, __m512 d, float *s)
{
	__m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
	__m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
	/* per 128-bit lane: ab = [a02 b02 a13 b13], cd alike */
	__m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
				 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
	/* per lane: [a b c d]; now add the four lanes */
	__m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
				 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
	__m128 z = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
	_mm_storeu_ps(s, z);
}

#include "kernels/cpu/attn_simd.inc"

/* Round to nearest even on the bit pattern, NaN kept quiet: the same
 * integer recipe as mlens_f32_to_bf16 (vcvtneps2bf16 would flush
 * subnormals, so it is not used). */
static inline __m256i bf16_round_avx512(__m512i u)
{
	__m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
	__mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
	__m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
	__m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb,
					_mm512_set1_epi32(0x7fff))), 16);
	__m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
	return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, q));
}

void mlens_bf16_cvt_avx512(uint16_t *dst, const float *src, size_t n)
{
	size_t i = 0;
	for (; i + 16 <= n; i += 16)
		_mm256_storeu_si256((__m256i *)(void *)(dst + i),
				    bf16_round_avx512(_mm512_castps_si512(_mm512_loadu_ps(src + i))));
	if (i < n) {
		__mmask16 k = (__mmask16)((1u << (n - i)) - 1);
		__m256i h = bf16_round_avx512(_mm512_castps_si512(_mm512_maskz_loadu_ps(k, src + i)));
		_mm256_mask_storeu_epi16(dst + i, k, h);
	}
}
