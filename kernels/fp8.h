/* OCP fp8 e4m3 ("e4m3fn": bias 7, no infinities, 0x7f/0xff NaN, largest
 * finite 448) to and from fp32, the conversions every backend and the model
 * loader agree on: decoding is exact; encoding rounds to nearest even and
 * saturates to +-448 (infinities too), a NaN stays a NaN. */
#ifndef MLENS_FP8_H
#define MLENS_FP8_H

#include <stdint.h>
#include <string.h>

#define MLENS_E4M3_MAX 448.0f

static inline float mlens_e4m3_to_f32(uint8_t b)
{
	uint32_t sign = (uint32_t)(b & 0x80) << 24, e = (b >> 3) & 0xf, m = b & 7, u;
	float f;

	if (e == 0xf && m == 7) {
		u = sign | 0x7fc00000u;
	} else if (e == 0) {	/* subnormal: m * 2^-9, exact in fp32 */
		f = (float)m * (1.0f / 512.0f);
		return sign ? -f : f;
	} else {
		u = sign | ((e + 120) << 23) | (m << 20);
	}
	memcpy(&f, &u, 4);
	return f;
}

static inline uint8_t mlens_f32_to_e4m3(float f)
{
	uint32_t u, sign, e, man, shift, q, rem, half;

	memcpy(&u, &f, 4);
	sign = (u >> 24) & 0x80;
	u &= 0x7fffffffu;
	if (u > 0x7f800000u)
		return (uint8_t)(sign | 0x7f);
	if (u >= 0x43e00000u)	/* >= 448 (and infinity): saturate */
		return (uint8_t)(sign | 0x7e);
	if (u >= 0x3c800000u) {	/* normal in e4m3: >= 2^-6 */
		u -= (127u - 7u) << 23;
		u += 0x7ffffu + ((u >> 20) & 1);
		q = u >> 20;
		return (uint8_t)(sign | (q > 0x7e ? 0x7e : q));
	}
	/* subnormal in e4m3: round |f| / 2^-9 to an integer, nearest even */
	e = u >> 23;
	if (e == 0)
		return (uint8_t)sign;
	man = (u & 0x7fffffu) | 0x800000u;
	shift = 141 - e;	/* |f| * 2^9 = man * 2^(e - 141) */
	if (shift >= 32)
		return (uint8_t)sign;
	q = man >> shift;
	rem = man & ((1u << shift) - 1);
	half = 1u << (shift - 1);
	if (rem > half || (rem == half && (q & 1)))
		q++;
	return (uint8_t)(sign | q);
}

#endif
