/* Scales of an fp8 (MLENS_DT_F8_E4M3) weight matrix W[rows][cols]: the
 * weight is w[r][c] = mlens_e4m3_to_f32(q[r][c]) * scale, the scale one for
 * the tensor, one per row (output channel), or one per block of
 * block_rows x block_cols ([ceil(rows/br)][ceil(cols/bc)], row-major), all
 * fp32. Every backend and the loader read them through these helpers. */
#ifndef MLENS_WSCALE_H
#define MLENS_WSCALE_H

#include <stddef.h>
#include <stdint.h>

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

#endif
