/* AVX-512 (F, BW, VL) decode attention and f32 -> bf16 conversion; this file
 * alone is built with -mavx512f -mavx512bw -mavx512vl and is only called
 * after CPUID said yes (attn.c). */
#include "kernels/cpu/attn_avx512.h"

#define SUFFIX(name) name##_avx512
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
