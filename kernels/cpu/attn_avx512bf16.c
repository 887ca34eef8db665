/* AVX-512 decode attention with AVX512_BF16 dot products (vdpbf16ps) for
 * bf16 caches: q.k and p*V take one dot-product instruction per 2 x 16 bf16
 * products instead of widening K and V to fp32 (two shifts/masks and two
 * FMAs per 64 bytes per head). f32 caches go to the avx512 kernel. This
 * file alone is built with -mavx512bf16 on top of the avx512 flags and is
 * only called after CPUID said yes (attn.c). */
#include "kernels/cpu/attn_avx512.h"

#define SUFFIX(name) name##_avx512bf16
typedef __m512i ivec;
#define VLOADI(p) _mm512_loadu_si512((const void *)(p))
#define VZEROI() _mm512_setzero_si512()
#define VSET1_I32(x) _mm512_set1_epi32((int)(x))
#define VUNPACKLO16(a, b) _mm512_unpacklo_epi16((a), (b))
#define VUNPACKHI16(a, b) _mm512_unpackhi_epi16((a), (b))
#define VDPBF16(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))
/* vcvtneps2bf16: nearest even; it flushes subnormal p to 0, as vdpbf16ps
 * would treat them anyway (p >= 0 here, never NaN) */
#define VSTORE_PAIRS(dst, x) \
	_mm256_storeu_si256((__m256i *)(void *)(dst), (__m256i)_mm512_cvtneps_pbh(x))
#define DOT_FALLBACK mlens_attn_span_avx512
#include "kernels/cpu/attn_simd.inc"
