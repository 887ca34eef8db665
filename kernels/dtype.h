/* Element types of weights, activations and the KV cache, and the scalar
 * conversions every backend agrees on (round-to-nearest-even for bf16). */
#ifndef MLENS_DTYPE_H
#define MLENS_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "kernels/fp8.h"

enum mlens_dtype {
	MLENS_DTYPE_F32 = 0,
	MLENS_DTYPE_F16 = 1,
	MLENS_DTYPE_BF16 = 2,
	/* fp8 e4m3 (kernels/fp8.h): a weight of this dtype has scales beside it
	 * (daemon/model/quant.h); its elements alone are not the weight */
	MLENS_DT_F8_E4M3 = 3,
};

static inline size_t mlens_dtype_size(enum mlens_dtype t)
{
	return t == MLENS_DTYPE_F32 ? 4 : t == MLENS_DT_F8_E4M3 ? 1 : 2;
}

static inline const char *mlens_dtype_name(enum mlens_dtype t)
{
	switch (t) {
	case MLENS_DTYPE_F32: return "F32";
	case MLENS_DTYPE_F16: return "F16";
	case MLENS_DTYPE_BF16: return "BF16";
	case MLENS_DT_F8_E4M3: return "F8_E4M3";
	}
	return "?";
}

static inline float mlens_bf16_to_f32(uint16_t h)
{
	uint32_t u = (uint32_t)h << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static inline uint16_t mlens_f32_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u)	/* NaN: keep it a quiet NaN */
		return (uint16_t)((u >> 16) | 0x40);
	u += 0x7fffu + ((u >> 16) & 1);
	return (uint16_t)(u >> 16);
}

static inline float mlens_f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000) << 16;
	uint32_t exp = (h >> 10) & 0x1f;
	uint32_t man = h & 0x3ff;
	uint32_t u;
	if (exp == 0) {
		if (man == 0) {
			u = sign;
		} else {	/* subnormal: normalise */
			exp = 127 - 15 + 1;
			while (!(man & 0x400)) {
				man <<= 1;
				exp--;
			}
			man &= 0x3ff;
			u = sign | (exp << 23) | (man << 13);
		}
	} else if (exp == 0x1f) {
		u = sign | 0x7f800000u | (man << 13);
	} else {
		u = sign | ((exp + 127 - 15) << 23) | (man << 13);
	}
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static inline uint16_t mlens_f32_to_f16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	uint32_t sign = (u >> 16) & 0x8000;
	int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
	uint32_t man = u & 0x7fffff;
	if (((u >> 23) & 0xff) == 0xff)
		return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
	if (exp >= 0x1f)
		return (uint16_t)(sign | 0x7c00);
	if (exp <= 0) {
		if (exp < -10)
			return (uint16_t)sign;
		man |= 0x800000;
		uint32_t shift = (uint32_t)(14 - exp);
		uint32_t half = man >> shift;
		uint32_t rem = man & ((1u << shift) - 1);
		uint32_t mid = 1u << (shift - 1);
		if (rem > mid || (rem == mid && (half & 1)))
			half++;
		return (uint16_t)(sign | half);
	}
	uint32_t h = sign | ((uint32_t)exp << 10) | (man >> 13);
	uint32_t rem = man & 0x1fff;
	if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
		h++;	/* may carry into the exponent: that is correct rounding */
	return (uint16_t)h;
}

/* Element i of a row stored as dtype t, as float. */
static inline float mlens_load(const void *p, enum mlens_dtype t, size_t i)
{
	switch (t) {
	case MLENS_DTYPE_F32: return ((const float *)p)[i];
	case MLENS_DTYPE_F16: return mlens_f16_to_f32(((const uint16_t *)p)[i]);
	case MLENS_DTYPE_BF16: return mlens_bf16_to_f32(((const uint16_t *)p)[i]);
	case MLENS_DT_F8_E4M3: return mlens_e4m3_to_f32(((const uint8_t *)p)[i]);
	}
	return 0.0f;
}

static inline void mlens_store(void *p, enum mlens_dtype t, size_t i, float v)
{
	switch (t) {
	case MLENS_DTYPE_F32: ((float *)p)[i] = v; break;
	case MLENS_DTYPE_F16: ((uint16_t *)p)[i] = mlens_f32_to_f16(v); break;
	case MLENS_DTYPE_BF16: ((uint16_t *)p)[i] = mlens_f32_to_bf16(v); break;
	case MLENS_DT_F8_E4M3: ((uint8_t *)p)[i] = mlens_f32_to_e4m3(v); break;
	}
}

#endif
