/* Description: the e4m3 conversions of kernels/fp8.h that every backend
 * shares: all 256 codes decode to their OCP float8_e4m3fn values and
 * round-trip, float -> e4m3 rounds to the nearest code with ties to even
 * (checked against a brute-force search), saturates at +-448, sends NaN to
 * 0x7f, and a row quantizes with scale amax / 448. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "kernels/fp8.h"
#include "tests/check_common.h"

/* The nearest finite code to f by search (ties: the even code), saturating. */
static uint8_t nearest(float f)
{
	uint8_t sign = signbit(f) ? 0x80 : 0, best = 0;
	double a = fabs((double)f), bd = INFINITY;
	if (isnan(f))
		return 0x7f;
	if (a >= 448.0)
		return sign | 0x7e;
	for (int c = 0; c <= 0x7e; c++) {
		double d = fabs((double)mlens_e4m3_to_f32((uint8_t)c) - a);
		if (d < bd || (d == bd && !(c & 1))) {
			bd = d;
			best = (uint8_t)c;
		}
	}
	return sign | best;
}

START_TEST(test_codes)
{
	float prev = -1.0f;
	for (int c = 0; c < 256; c++) {
		float f = mlens_e4m3_to_f32((uint8_t)c);
		int e = (c >> 3) & 15, m = c & 7;
		if ((c & 0x7f) == 0x7f) {
			ck_assert_msg(isnan(f), "code %#x is NaN", c);
			continue;
		}
		/* the format's definition, in double */
		double want = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
		ck_assert_msg((double)fabsf(f) == want, "code %#x: %a", c, f);
		ck_assert_int_eq(!!signbit(f), c >> 7);
		ck_assert_msg(mlens_f32_to_e4m3(f) == c, "code %#x does not round-trip", c);
		if (c < 0x7f) {	/* codes of one sign are in order */
			ck_assert(f > prev || c == 0);
			prev = f;
		}
	}
	ck_assert_float_eq(mlens_e4m3_to_f32(0x7e), 448.0f);
	ck_assert_float_eq(mlens_e4m3_to_f32(0xfe), -448.0f);
	ck_assert_float_eq(mlens_e4m3_to_f32(0x38), 1.0f);
	ck_assert_float_eq(mlens_e4m3_to_f32(0x08), 0x1p-6f);
	ck_assert_float_eq(mlens_e4m3_to_f32(0x01), 0x1p-9f);
}
END_TEST

START_TEST(test_ties_to_even)
{
	/* midway between neighbours: the even code; a hair off: the nearer */
	for (int c = 0; c < 0x7e; c++) {
		float a = mlens_e4m3_to_f32((uint8_t)c), b = mlens_e4m3_to_f32((uint8_t)(c + 1));
		float mid = (a + b) / 2;	/* exact: few bits */
		uint8_t even = (uint8_t)(c & 1 ? c + 1 : c);
		ck_assert_msg(mlens_f32_to_e4m3(mid) == even, "tie %a -> %#x", mid,
			      mlens_f32_to_e4m3(mid));
		ck_assert_int_eq(mlens_f32_to_e4m3(-mid), 0x80 | even);
		ck_assert_int_eq(mlens_f32_to_e4m3(nextafterf(mid, 0.0f)), c);
		ck_assert_int_eq(mlens_f32_to_e4m3(nextafterf(mid, INFINITY)), c + 1);
	}
	ck_assert_int_eq(mlens_f32_to_e4m3(1.0625f), 0x38);	/* 1 | 1.125 */
	ck_assert_int_eq(mlens_f32_to_e4m3(1.1875f), 0x3a);	/* 1.125 | 1.25 */
	ck_assert_int_eq(mlens_f32_to_e4m3(0x1p-10f), 0x00);	/* 0 | 2^-9 */
	ck_assert_int_eq(mlens_f32_to_e4m3(0x3p-10f), 0x02);	/* 2^-9 | 2^-8 */
	ck_assert_int_eq(mlens_f32_to_e4m3(0x1.ep-7f), 0x08);	/* 7 * 2^-9 | 2^-6 */
}
END_TEST

START_TEST(test_saturation_nan_underflow)
{
	static const float big[] = { 448.0f, 448.5f, 463.99f, 464.0f, 480.0f, 1e6f, 3.4e38f, INFINITY };
	for (size_t i = 0; i < sizeof(big) / sizeof(big[0]); i++) {
		ck_assert_int_eq(mlens_f32_to_e4m3(big[i]), 0x7e);
		ck_assert_int_eq(mlens_f32_to_e4m3(-big[i]), 0xfe);
	}
	ck_assert_int_eq(mlens_f32_to_e4m3(NAN), MLENS_E4M3_NAN);
	ck_assert_int_eq(mlens_f32_to_e4m3(-NAN), MLENS_E4M3_NAN);
	ck_assert_int_eq(mlens_f32_to_e4m3(0.0f), 0x00);
	ck_assert_int_eq(mlens_f32_to_e4m3(-0.0f), 0x80);
	ck_assert_int_eq(mlens_f32_to_e4m3(1e-30f), 0x00);
	ck_assert_int_eq(mlens_f32_to_e4m3(-1e-30f), 0x80);
	ck_assert_int_eq(mlens_f32_to_e4m3(0x1p-149f), 0x00);	/* fp32 subnormal */
}
END_TEST

/* Every float of a pseudo-random sweep (any bit pattern, and values near
 * e4m3's range) against the search. */
START_TEST(test_against_search)
{
	uint64_t x = 0x243f6a8885a308d3ull;
	for (int i = 0; i < 60000; i++) {
		uint32_t u;
		float f;
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		u = (uint32_t)x;
		if (i & 1)	/* exponents of 2^-12 .. 2^9, any mantissa */
			u = (u & 0x807fffffu) | ((uint32_t)(115 + (x >> 40) % 22) << 23);
		memcpy(&f, &u, 4);
		ck_assert_msg(mlens_f32_to_e4m3(f) == nearest(f), "%a -> %#x, nearest %#x", f,
			      mlens_f32_to_e4m3(f), nearest(f));
	}
}
END_TEST

START_TEST(test_row)
{
	float src[5] = { 0.5f, -2.0f, NAN, 1e-6f, -0.25f }, zero[3] = { 0.0f, -0.0f, 0.0f };
	uint8_t dst[5];
	float sc = mlens_e4m3_quantize_row(dst, src, 5);
	ck_assert_float_eq(sc, 2.0f / 448.0f);	/* NaN does not count */
	ck_assert_int_eq(dst[1], 0xfe);		/* the largest maps to -448 */
	ck_assert_int_eq(dst[2], MLENS_E4M3_NAN);
	ck_assert_int_eq(dst[0], mlens_f32_to_e4m3(0.5f / sc));
	ck_assert_float_eq(mlens_e4m3_to_f32(dst[4]) * sc, -0.25f);
	ck_assert_float_eq(mlens_e4m3_quantize_row(dst, zero, 3), 0.0f);
	ck_assert_int_eq(dst[0] | dst[1] | dst[2], 0);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("fp8");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_codes);
	tcase_add_test(tc, test_ties_to_even);
	tcase_add_test(tc, test_saturation_nan_underflow);
	tcase_add_test(tc, test_against_search);
	tcase_add_test(tc, test_row);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
