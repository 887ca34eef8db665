/* FP8 e4m3 (OCP float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN,
 * largest finite 448) scalar conversions shared by every backend: the CPU
 * code, the SIMD tables and the CUDA kernels call these same functions, so
 * a value quantized anywhere has the same byte. */
#ifndef MLENS_FP8_H
#define MLENS_FP8_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define MLENS_FP8_FN static inline __host__ __device__
#else
#define MLENS_FP8_FN static inline
#endif

#define MLENS_E4M3_MAX 448.0f
#define MLENS_E4M3_NAN 0x7f	/* the canonical NaN code this code writes */

/* e4m3 code -> float, exact (every e4m3 value is a float). */
MLENS_FP8_FN float mlens_e4m3_to_f32(uint8_t c)
{
	uint32_t sign = (uint32_t)(c & 0x80) << 24;
	uint32_t e = (c >> 3) & 0xf, m = c & 7, u;
	float f;
	if (e == 0xf && m == 7) {
		u = sign | 0x7fc00000u;
	} else if (e == 0) {	/* subnormal: m * 2^-9 */
		f = (float)m * 0x1p-9f;
		return sign ? -f : f;
	} else {
		u = sign | ((e - 7 + 127) << 23) | (m << 20);
	}
	memcpy(&f, &u, 4);
	return f;
}

/* float -> e4m3 code: round to nearest, ties to even; saturating, so a
 * magnitude above 448 (infinity included) becomes +-448; NaN becomes 0x7f. */
MLENS_FP8_FN uint8_t mlens_f32_to_e4m3(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	uint8_t sign = (uint8_t)((u >> 24) & 0x80);
	uint32_t a = u & 0x7fffffffu;
	if (a > 0x7f800000u)
		return MLENS_E4M3_NAN;
	if (a >= 0x43e00000u)	/* >= 448.0f */
		return (uint8_t)(sign | 0x7e);
	int e = (int)(a >> 23) - 127;
	uint32_t m = a & 0x7fffffu;
	uint32_t r, rem, half;
	if (e >= -6) {		/* normal: keep 3 of 23 mantissa bits */
		r = ((uint32_t)(e + 7) << 3) | (m >> 20);
		rem = m & 0xfffffu;
		half = 0x80000u;
	} else {		/* subnormal (or zero): round(|f| * 2^9) */
		if (e < -10)	/* below 2^-10: under half the smallest step */
			return sign;
		uint32_t full = m | 0x800000u;
		uint32_t shift = (uint32_t)(14 - e);	/* 21..24 */
		r = full >> shift;
		rem = full & ((1u << shift) - 1);
		half = 1u << (shift - 1);
	}
	if (rem > half || (rem == half && (r & 1)))
		r++;	/* a carry into the exponent is correct rounding */
	return (uint8_t)(sign | r);
}

/* The scale of a row whose largest magnitude is amax: amax / 448, which
 * maps the row's largest value onto e4m3's largest. */
MLENS_FP8_FN float mlens_e4m3_scale(float amax)
{
	return amax / MLENS_E4M3_MAX;
}

/* x's code under scale: x / scale rounded (a division, not a multiply by
 * the inverse, so that every backend gets the same byte); scale 0 (an
 * all-zero row) gives code 0. */
MLENS_FP8_FN uint8_t mlens_e4m3_quantize(float x, float scale)
{
	return scale > 0.0f ? mlens_f32_to_e4m3(x / scale) : 0;
}

/* The largest magnitude of a and b, NaN ignored (as a > b ? a : b does);
 * the one reduction step every backend uses for a row's amax. */
MLENS_FP8_FN float mlens_e4m3_amax(float m, float x)
{
	float a = x < 0.0f ? -x : x;
	return a > m ? a : m;
}

/* dst[0..n) = src quantized with one scale for the row, which it returns:
 * value i is mlens_e4m3_to_f32(dst[i]) * scale. */
MLENS_FP8_FN float mlens_e4m3_quantize_row(uint8_t *dst, const float *src, int n)
{
	float amax = 0.0f, scale;
	for (int i = 0; i < n; i++)
		amax = mlens_e4m3_amax(amax, src[i]);
	scale = mlens_e4m3_scale(amax);
	for (int i = 0; i < n; i++)
		dst[i] = mlens_e4m3_quantize(src[i], scale);
	return scale;
}

#endif
