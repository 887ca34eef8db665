/* Scales of an fp8 (MLENS_DTYPE_E4M3) weight matrix W[rows][cols]: the
 * weight is w[r][c] = mlens_e4m3_to_f32(q[r][c]) * scale, the scale one for
 * the tensor, one per row (output channel), or one per block of
 * block_rows x block_cols ([ceil(rows/br)][ceil(cols/bc)], row-major), all
 * fp32. Every backend and the loader read them through these helpers. */
#ifndef MLENS_WSCALE_H
#define MLENS_WSCALE_H

#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include "kernels/fp8.h"

enum mlens_wscale_kind {
	MLENS_WSCALE_NONE = 0,	/* not fp8: no scales */
	MLENS_WSCALE_TENSOR = 1,
	MLENS_WSCALE_CHANNEL = 2,
	MLENS_WSCALE_BLOCK = 3,
};

struct mlens_wscale {
	enum mlens_wscale_kind kind;
	int block_rows, block_cols;	/* BLOCK only */
};

/* Scales of one rows x cols matrix. */
static inline size_t mlens_wscale_count(const struct mlens_wscale *s, int64_t rows, int64_t cols)
{
	switch (s->kind) {
	case MLENS_WSCALE_NONE: return 0;
	case MLENS_WSCALE_TENSOR: return 1;
	case MLENS_WSCALE_CHANNEL: return (size_t)rows;
	case MLENS_WSCALE_BLOCK:
		return (size_t)((rows + s->block_rows - 1) / s->block_rows) *
		       (size_t)((cols + s->block_cols - 1) / s->block_cols);
	}
	return 0;
}

/* The scale of element [r][c] of a matrix with cols columns. */
static inline float mlens_wscale_at(const struct mlens_wscale *s, const float *sc, int64_t r,
				    int64_t c, int64_t cols)
{
	switch (s->kind) {
	case MLENS_WSCALE_NONE: return 1.0f;
	case MLENS_WSCALE_TENSOR: return sc[0];
	case MLENS_WSCALE_CHANNEL: return sc[r];
	case MLENS_WSCALE_BLOCK:
		return sc[(r / s->block_rows) * ((cols + s->block_cols - 1) / s->block_cols) +
			  c / s->block_cols];
	}
	return 1.0f;
}

/* Quantize src [rows][cols] to fp8 e4m3 into q, one scale (amax / 448) a
 * row or a block as k says (CHANNEL or BLOCK) into scales: q = e4m3(v /
 * scale), rounded to nearest even; an all-zero row or block has scale 0. */
static inline void mlens_fp8_quantize(const float *src, int64_t rows, int64_t cols,
				      const struct mlens_wscale *k, uint8_t *q, float *scales)
{
	int64_t br = k->kind == MLENS_WSCALE_BLOCK ? k->block_rows : 1;
	int64_t bc = k->kind == MLENS_WSCALE_BLOCK ? k->block_cols : cols;
	int64_t nbc = (cols + bc - 1) / bc;

	for (int64_t r0 = 0; r0 < rows; r0 += br)
		for (int64_t c0 = 0; c0 < cols; c0 += bc) {
			int64_t r1 = r0 + br < rows ? r0 + br : rows, c1 = c0 + bc < cols ? c0 + bc : cols;
			float amax = 0.0f, s, div;

			for (int64_t r = r0; r < r1; r++)
				for (int64_t c = c0; c < c1; c++)
					amax = fabsf(src[r * cols + c]) > amax ? fabsf(src[r * cols + c]) : amax;
			s = amax / MLENS_E4M3_MAX;
			div = s > 0 ? s : 1.0f;
			scales[(r0 / br) * nbc + c0 / bc] = s;
			for (int64_t r = r0; r < r1; r++)
				for (int64_t c = c0; c < c1; c++)
					q[r * cols + c] = mlens_f32_to_e4m3(src[r * cols + c] / div);
		}
}

#endif
