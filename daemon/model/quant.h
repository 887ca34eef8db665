/* fp8 (e4m3) weights: the quantization_config of a Hugging Face fp8
 * checkpoint (compressed-tensors with per-tensor or per-channel scales,
 * "fp8" with block scales, fbgemm_fp8), each fp8 tensor's scales checked
 * and converted to fp32, and experts quantized at load (weight_dtype =
 * fp8). Experts stay fp8 with their scales beside them (the layer's
 * struct mlens_moe_weights); any other fp8 matrix (attention) is
 * dequantized at open into the model's dtype. */
#ifndef MLENS_QUANT_H
#define MLENS_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"

/* Bytes one piece of a streamed fp8 expert (a matrix or its scales) takes
 * in an expert slot: rounded up so that every piece stays aligned. */
static inline uint64_t mlens_quant_piece(uint64_t bytes)
{
	return (bytes + 15) & ~(uint64_t)15;
}

/* config.json's quantization_config (qc, NULL or null when absent) into
 * cfg->quant_method, expert_dtype and expert_scale; called after cfg's
 * dtype is known. Refuses methods other than fp8 ones, naming the method. */
struct json_t;
int mlens_quant_parse_config(struct json_t *qc, const char *path, struct mlens_model_config *cfg,
			     char *err, size_t errlen);

/* True for a tensor that may differ from the model's dtype: an fp8 weight
 * or a scale of one, in a model with a quantization_config. */
bool mlens_quant_tensor_exempt(const struct mlens_model_config *cfg, const struct mlens_tensor *t);

/* After the weights are bound (used: the tensors the binding named; the
 * others stay unused, for the caller to refuse): check every bound fp8
 * tensor against the quantization_config (not in an ignored module, its
 * scale present, of a 16- or 32-bit float dtype and of a per-tensor,
 * per-channel or block shape), mark it and its scales used,
 * point the experts' s1/s2/s3 at fp32 copies of their scales and replace
 * other fp8 matrices by dequantized copies. Sets cfg.expert_dtype. */
int mlens_quant_bind(struct mlens_model *m, bool *used, char *err, size_t errlen);
void mlens_quant_free(struct mlens_model *m);

/* Quantize every expert matrix of a bf16/fp16/fp32 model to fp8 e4m3 with
 * one scale per output row (amax / 448), into memory of its own; the
 * experts' pointers move there. A model whose experts are fp8 already is
 * left as it is. */
int mlens_model_quantize_experts(struct mlens_model *m, char *err, size_t errlen);
/* The expert dtype and scale layout that quantizing at load gives (fp8
 * e4m3, a scale per output row), set in c: what a reader of a model's
 * config counts for a daemon that quantized its experts. */
void mlens_quant_config_at_load(struct mlens_model_config *c);

/* Host bytes the fp8 state holds beside the weight pages: expert scales,
 * experts quantized at load, dequantized copies of other fp8 matrices. */
size_t mlens_model_quant_bytes(const struct mlens_model *m);

/* Bytes of one expert (w1, w2, w3 and, for fp8, their scales) as the
 * hybrid pipeline streams it and the performance model counts it. */
uint64_t mlens_model_expert_bytes(const struct mlens_model_config *c);
/* Scale bytes of one expert matrix of rows x cols (0 unless fp8). */
size_t mlens_model_scale_bytes(const struct mlens_model_config *c, int64_t rows, int64_t cols);

#endif
