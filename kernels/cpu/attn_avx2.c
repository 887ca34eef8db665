/* AVX2 + FMA decode attention and f32 -> bf16 conversion; this file alone
 * is built with -mavx2 -mfma -mf16c and is only called after CPUID said
 * yes. */
#include <immintrin.h>
#include <string.h>
#include "kernels/cpu/attn_int.h"

typedef __m256 vec;
#define W 8
#define SUFFIX(name) name##_avx2
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps((p), (x))
#define VSET1(x) _mm256_set1_ps(x)
#define VZERO() _mm256_setzero_ps()
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VDIV(a, b) _mm256_div_ps((a), (b))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VHSUM(x) hsum_avx2(x)
#define VHMAX(x) hmax_avx2(x)
#define VLOAD_BF16X2(p, e, o) do { \
	__m256i x_ = _mm256_loadu_si256((const __m256i *)(const void *)(p)); \
	(e) = _mm256_castsi256_ps(_mm256_slli_epi32(x_, 16)); \
	(o) = _mm256_castsi256_ps(_mm256_and_si256(x_, _mm256_set1_epi32((int)0xffff0000u))); \
} while (0)
#define VLOAD_E4M3X2(p, e, o) \
	e4m3x16_avx2(_mm_loadu_si128((const __m128i *)(const void *)(p)), &(e), &(o), 0)
#define VLOAD_E4M3X2_FINITE(p, e, o) \
	e4m3x16_avx2(_mm_loadu_si128((const __m128i *)(const void *)(p)), &(e), &(o), 1)
#define E4M3_ANY_NAN(p, n) mlens_e4m3_any_nan_avx2((p), (n))
#define VHSUM4(a, b, c, d, s) hsum4_avx2((a), (b), (c), (d), (s))
/* 2W values in a, b (in order) -> the even ones in ev, the odd ones in od:
 * per 128-bit lane pick, then put the 64-bit pairs in order */
#define VDEINT(a, b, ev, od) do { \
	(ev) = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd( \
		_mm256_shuffle_ps((a), (b), _MM_SHUFFLE(2, 0, 2, 0))), 0xd8)); \
	(od) = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd( \
		_mm256_shuffle_ps((a), (b), _MM_SHUFFLE(3, 1, 3, 1))), 0xd8)); \
} while (0)
/* the inverse: ev, od -> a, b in order */
#define VINTER(ev, od, a, b) do { \
	__m256 lo_ = _mm256_unpacklo_ps((ev), (od)), hi_ = _mm256_unpackhi_ps((ev), (od)); \
	(a) = _mm256_permute2f128_ps(lo_, hi_, 0x20); \
	(b) = _mm256_permute2f128_ps(lo_, hi_, 0x31); \
} while (0)
/* 16 registers: 4x2 score accumulators, 2 heads x 2 pairs for p*V */
#define SC_HB 4
#define SC_TB 2
#define PV_HB 2
#define PV_CP 2
#define VEXP(x) exp_avx2(x)

static inline float hsum_avx2(__m256 x)
{
	__m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
	s = _mm_add_ps(s, _mm_movehl_ps(s, s));
	s = _mm_add_ss(s, _mm_movehdup_ps(s));
	return _mm_cvtss_f32(s);
}

static inline float hmax_avx2(__m256 x)
{
	__m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
	s = _mm_max_ps(s, _mm_movehl_ps(s, s));
	s = _mm_max_ss(s, _mm_movehdup_ps(s));
	return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0, as exp_avx512 in attn_avx512.c (Cephes expf). */
static inline __m256 exp_avx2(__m256 x)
{
	__m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
	__m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
				    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
	__m256 z, y;
	__m256i e;
	r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
	z = _mm256_mul_ps(r, r);
	y = _mm256_set1_ps(1.9875691500e-4f);
	y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
	y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
	y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
	y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
	y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
	y = _mm256_fmadd_ps(y, z, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
	e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
	y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
	return _mm256_andnot_ps(tiny, y);
}

/* The 16 e4m3 codes at b as fp32 times 2^-8, exactly: a code's bits in
 * an fp16 (sign to bit 15, exponent and mantissa to bits 13..7) are its
 * value times 2^-8, subnormals included, and F16C widens that to fp32.
 * Sign-extended to 16 bits and shifted by 7, the code's sign lands on bits
 * 15 and 14; the mask clears 14. The NaN codes become an fp16 NaN, or,
 * with finite set (codes known not to be NaN), are left as they come out
 * (+-1.875), which saves three operations per vector. */
static inline __attribute__((always_inline)) void
e4m3x16_avx2(__m128i b, __m256 *e, __m256 *o, const int finite)
{
	__m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
				     _mm256_set1_epi16((short)0xbf80));
	if (!finite) {
		__m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x3f80));
		__m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x3f80));
		h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7fff)));
	}
	*e = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
	*o = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* s[0..3] = the sums of a, b, c, d (transpose-and-add tree) */
static inline void hsum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d, float *s)
{
	__m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
	__m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
	__m256 x = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
				 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
	_mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
}

#include "kernels/cpu/attn_simd.inc"

/* Same integer rounding recipe as mlens_f32_to_bf16. */
static inline __m128i bf16_round_avx2(__m256i u)
{
	__m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
	/* abs and 0x7f800000 are both below 2^31: a signed compare is right */
	__m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
	__m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
	__m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb,
					_mm256_set1_epi32(0x7fff))), 16);
	__m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
	__m256i v = _mm256_blendv_epi8(r, q, nan);	/* every lane now < 2^16 */
	__m256i p = _mm256_packus_epi32(v, v);		/* per 128-bit lane */
	return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}

void mlens_bf16_cvt_avx2(uint16_t *dst, const float *src, size_t n)
{
	size_t i = 0;
	for (; i + 8 <= n; i += 8)
		_mm_storeu_si128((__m128i *)(void *)(dst + i),
				 bf16_round_avx2(_mm256_castps_si256(_mm256_loadu_ps(src + i))));
	for (; i < n; i++)
		dst[i] = mlens_f32_to_bf16(src[i]);
}

/* mlens_e4m3_quantize_row 8 values at a time, the same bytes: the amax by
 * maxps (a NaN in its first operand yields the second, so NaN is ignored
 * as the scalar compare ignores it; |x| by a mask, never -0), the scale by
 * the same division, each x / scale rounded as mlens_f32_to_e4m3 rounds:
 * normals by the add-and-shift of round-to-nearest-even on the fp32 bits,
 * values below 2^-6 as round-half-even(|y| * 2^9), +-448 from 448 up,
 * 0x7f for NaN. */
float mlens_e4m3_row_avx2(uint8_t *dst, const float *src, int n)
{
	const __m256i absm = _mm256_set1_epi32(0x7fffffff);
	__m256 m = _mm256_setzero_ps();
	float amax, scale;
	int i = 0;

	for (; i + 8 <= n; i += 8)
		m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(src + i), _mm256_castsi256_ps(absm)), m);
	amax = hmax_avx2(m);
	for (; i < n; i++)
		amax = mlens_e4m3_amax(amax, src[i]);
	scale = mlens_e4m3_scale(amax);
	if (!(scale > 0.0f)) {
		memset(dst, 0, (size_t)n);
		return scale;
	}
	const __m256 vs = _mm256_set1_ps(scale);
	for (i = 0; i + 8 <= n; i += 8) {
		__m256i u = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(src + i), vs));
		__m256i a = _mm256_and_si256(u, absm);
		__m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
		/* a < 2^31: signed compares are right */
		__m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
		__m256i sat = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x43dfffff));
		__m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), a);
		__m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
		__m256i rn = _mm256_sub_epi32(
			_mm256_srli_epi32(_mm256_add_epi32(a, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7ffff))), 20),
			_mm256_set1_epi32(120 << 3));
		__m256i rs = _mm256_cvttps_epi32(_mm256_round_ps(
			_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0f)),
			_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
		__m256i r = _mm256_blendv_epi8(rn, rs, sub);
		r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7e), sat);
		r = _mm256_or_si256(r, sign);
		r = _mm256_blendv_epi8(r, _mm256_set1_epi32(MLENS_E4M3_NAN), nan);
		/* every lane < 256: pack to bytes, each 128-bit half its 4 */
		__m256i p = _mm256_packus_epi16(_mm256_packus_epi32(r, r), _mm256_setzero_si256());
		_mm_storel_epi64((__m128i *)(void *)(dst + i),
				 _mm_unpacklo_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
	}
	for (; i < n; i++)
		dst[i] = mlens_e4m3_quantize(src[i], scale);
	return scale;
}

/* A NaN code has its low seven bits set: the bytewise minimum of
 * ~code & 0x7f reaches 0 (the zeroed bytes of the tail give 0x7f). */
int mlens_e4m3_any_nan_avx2(const void *p, size_t n)
{
	const __m256i low = _mm256_set1_epi8(0x7f);
	__m256i m = low;
	size_t i = 0;

	for (; i + 32 <= n; i += 32)
		m = _mm256_min_epu8(m, _mm256_andnot_si256(
				_mm256_loadu_si256((const __m256i *)(const void *)((const char *)p + i)),
				low));
	if (i < n)
		m = _mm256_min_epu8(m, _mm256_andnot_si256(_mm256_zextsi128_si256(
				_mm_loadu_si128((const __m128i *)(const void *)((const char *)p + i))),
				low));
	return _mm256_movemask_epi8(_mm256_cmpeq_epi8(m, _mm256_setzero_si256())) != 0;
}
