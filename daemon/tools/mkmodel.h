/* mlens-mkmodel as a library: writes a deterministic random-weight model
 * directory of one of the families (family.h) in Hugging Face format
 * (config.json + safetensors, the family's tensor names), so
 * tests and demos never download anything. */
#ifndef MLENS_MKMODEL_H
#define MLENS_MKMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"

struct mlens_mkmodel_opts {
	const char *dir;		/* created if missing (one level) */
	struct mlens_model_config cfg;	/* head_dim 0: hidden / heads; family NULL: Mixtral */
	uint64_t seed;
	int shards;			/* <= 1: one model.safetensors */
	bool fused_experts;		/* transformers-5 fused gate_up_proj/down_proj */
	bool tokenizer;			/* also a byte-level tokenizer and a chat template */
	/* fp8 experts (cfg.dtype for the rest): kind NONE none; CHANNEL the
	 * compressed-tensors layout (weight_scale [rows, 1]); BLOCK the "fp8"
	 * method's (weight_scale_inv per block_rows x block_cols block) */
	struct mlens_wscale fp8;
	/* > 0: experts router_favor.. of every MoE layer take the routing
	 * (the embedding's first column 0.2, the routers' first column +2
	 * for them and -2 for the others: every token's first hidden
	 * component, larger than the rest, picks them); 0: plain random
	 * routers */
	int router_favor;
};

/* Tokens the test tokenizer uses (ids 0 .. this - 1); the model's
 * vocabulary must hold them. */
#define MLENS_MKMODEL_TOKENIZER_VOCAB 261

/* Fill o->cfg from a preset ("tiny", "mixtral-8x7b", "mixtral-8x22b",
 * "qwen3-tiny", "qwen3-30b-a3b", "qwen2-tiny", "qwen1.5-moe-a2.7b",
 * "qwen2-57b-a14b", "olmoe-tiny", "olmoe-1b-7b", "dbrx", "dbrx-tiny"; the
 * family with it); leaves dir, seed,
 * shards alone. Returns 0 or -EINVAL for an unknown name. */
int mlens_mkmodel_preset(struct mlens_mkmodel_opts *o, const char *name);

/* Write the model. Streams tensor data through a small buffer, so memory use
 * does not grow with the model. Returns 0 or -errno with a message in err. */
int mlens_mkmodel_write(const struct mlens_mkmodel_opts *o, char *err, size_t errlen);

/* Write DIR/tokenizer.json (byte-level BPE, one token a byte: ids 0-2
 * <unk> <s> </s>, 3-258 the bytes, 259-260 <|im_start|> <|im_end|>) and
 * DIR/tokenizer_config.json (a ChatML chat template). Returns 0 or -errno
 * with a message in err. */
int mlens_mkmodel_write_tokenizer(const char *dir, int64_t vocab_size, char *err, size_t errlen);

/* Element i (row-major) of the tensor the legacy per-expert layout names
 * `name`, before conversion to the file dtype: N(0, 0.02^2)-like noise, plus
 * 1.0 for norm weights. A pure function of (seed, name, i). In the fused
 * layout, expert j of gate_up_proj holds w1 then w3 of expert j, and
 * down_proj holds w2, each generated under its legacy name. */
float mlens_mkmodel_value(uint64_t seed, const char *name, uint64_t i);

#endif
