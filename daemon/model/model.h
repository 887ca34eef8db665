/* A Hugging Face model directory (config.json + *.safetensors, single file or
 * sharded with model.safetensors.index.json), mapped read-only. Owns the
 * parsed config, the mapped files and the tensor table; knows nothing of
 * backends. Every fault is reported as one message naming the file, the
 * tensor and what is wrong. */
#ifndef MLENS_MODEL_H
#define MLENS_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kernels/dtype.h"
#include "kernels/wscale.h"

#define MLENS_MODEL_MAX_DIMS 4
#define MLENS_MODEL_MAX_EOS 8	/* EOS token ids a model may name */
#define MLENS_MODEL_MAX_LAYERS 1024

struct mlens_family;
struct mlens_disk_tier;

/* Where a q/k RMSNorm sits after the projection (Mixtral: none). */
enum mlens_qk_norm {
	MLENS_QK_NORM_NONE = 0,
	MLENS_QK_NORM_HEAD,	/* over each head's head_dim (Qwen3-MoE) */
	MLENS_QK_NORM_ALL,	/* over the whole projection (OLMoE) */
};

/* The norm a family's layers use (before attention, before the experts,
 * and the final one). */
enum mlens_norm_kind {
	MLENS_NORM_RMS = 0,	/* RMSNorm (Mixtral) */
	MLENS_NORM_LAYER,	/* LayerNorm without bias (DBRX) */
};

struct mlens_model_config {
	char architecture[64];	/* "MixtralForCausalLM", "DbrxForCausalLM", ... */
	const struct mlens_family *family;	/* its entry in family.c's table */
	int64_t vocab_size;
	int64_t hidden_size;
	int64_t intermediate_size;	/* one routed expert's (Qwen: moe_intermediate_size) */
	int64_t num_hidden_layers;
	int64_t num_attention_heads;
	int64_t num_key_value_heads;
	int64_t head_dim;	/* hidden_size / num_attention_heads when absent */
	int64_t num_local_experts;
	int64_t num_experts_per_tok;
	int64_t max_position_embeddings;
	double rope_theta;
	double rms_norm_eps;	/* the norms' eps, whatever their kind */
	bool tie_word_embeddings;
	enum mlens_dtype dtype;	/* dtype of the weights (all tensors agree) */
	bool dtype_given;	/* config.json named it (torch_dtype or dtype);
				 * otherwise the loader takes the files' dtype */
	/* The expert matrices' dtype: dtype, or MLENS_DTYPE_E4M3 with scales
	 * laid out as expert_scale says (an fp8 checkpoint's
	 * quantization_config, or experts quantized at load: quant.h) */
	enum mlens_dtype expert_dtype;
	struct mlens_wscale expert_scale;
	char quant_method[32];	/* quantization_config's, "" without one */
	/* eos_token_id (an id or a list) of generation_config.json where it
	 * gives one, else of config.json: generation stops at these */
	int32_t eos[MLENS_MODEL_MAX_EOS];
	int n_eos;
	/* What a family changes in Mixtral's layer (zero/false: as Mixtral). */
	enum mlens_norm_kind norm_kind;
	bool w2_transposed;	/* the experts' down projection is stored
				 * [inter][hidden] (DBRX's w2) */
	bool topk_raw;		/* norm_topk_prob false: the top-k routing weights stay
				 * the softmax's, not renormalised to sum 1 */
	enum mlens_qk_norm qk_norm;
	bool qkv_bias;		/* q, k, v projections have biases */
	bool o_bias;		/* the output projection has a bias */
	double clip_qkv;	/* > 0: q, k, v clamped to [-clip_qkv, clip_qkv]
				 * after their projection (OLMoE, DBRX); 0: no clip */
	int64_t shared_inter;	/* shared expert's intermediate size, 0: none (Qwen2-MoE) */
	bool shared_gate;	/* the shared expert's output scaled by sigmoid(x . gate) */
	int64_t dense_inter;	/* intermediate size of the dense MLP layers */
	bool dense[MLENS_MODEL_MAX_LAYERS];	/* layer i has a dense MLP, no experts */
};

struct mlens_tensor {
	char *name;
	enum mlens_dtype dtype;
	int ndim;
	int64_t shape[MLENS_MODEL_MAX_DIMS];
	size_t nbytes;
	int file;		/* index into model->files */
	uint64_t offset;	/* absolute offset of the data in that file */
	const void *data;	/* into the file's mapping */
};

struct mlens_layer_weights {
	const struct mlens_tensor *attn_norm;	/* [H] */
	/* wq, wk, wv: tensors of their own, or views of one fused tensor */
	const struct mlens_tensor *wq;		/* [n_heads*hd][H] */
	const struct mlens_tensor *wk;		/* [n_kv*hd][H] */
	const struct mlens_tensor *wv;		/* [n_kv*hd][H] */
	const struct mlens_tensor *wo;		/* [H][n_heads*hd] */
	const struct mlens_tensor *ffn_norm;	/* [H] */
	const struct mlens_tensor *router;	/* [E][H]; NULL: a dense layer (no experts) */
	/* Family extras, NULL where the family has none: q/k norms ([hd] a
	 * head, or the whole projection), projection biases, and one SwiGLU
	 * beside the experts (a dense layer's MLP or the shared expert, its
	 * sigmoid gate [1][H] optional). */
	const struct mlens_tensor *q_norm, *k_norm;
	const struct mlens_tensor *bq, *bk, *bv, *bo;
	const struct mlens_tensor *mlp_w1, *mlp_w2, *mlp_w3, *mlp_gate;
	int64_t mlp_inter;	/* that SwiGLU's intermediate size */
	/* Per expert, HF layout: w1 (gate) and w3 (up) [I][H], w2 (down) [H][I]
	 * ([I][H] when the config's w2_transposed is set).
	 * Arrays of num_local_experts entries. Each points at one contiguous
	 * matrix, whether the file stores experts separately or fused. */
	const void **w1;
	const void **w2;
	const void **w3;
	/* fp8 experts: each matrix's fp32 scales (cfg.expert_scale), else NULL */
	const float **s1;
	const float **s2;
	const float **s3;
};

struct mlens_model_file {
	char *path;
	int fd;
	void *map;
	size_t size;
};

struct mlens_model {
	char *dir;
	struct mlens_model_config cfg;
	struct mlens_model_file *files;
	int n_files;
	struct mlens_tensor *tensors;
	int n_tensors;
	const struct mlens_tensor *embed;	/* [V][H] */
	const struct mlens_tensor *final_norm;	/* [H] */
	const struct mlens_tensor *lm_head;	/* [V][H]; == embed when tied */
	struct mlens_layer_weights *layers;	/* num_hidden_layers */
	size_t weight_bytes;			/* sum of tensor bytes */
	const void **expert_table;		/* owns every layer's w1/w2/w3 arrays */
	struct mlens_quant *quant;		/* fp8 scales and dequantized tensors */
	/* Row slices of fused tensors, bound like tensors (DBRX's Wqkv as wq,
	 * wk, wv): data, file and offset point into the fused tensor's bytes,
	 * the name is the fused tensor's (not owned). */
	struct mlens_tensor *views;
	int n_views;
	/* Experts left in the files, read into staging each step (the weight
	 * pages' disk tier, disk_tier.h; not owned); NULL: none */
	struct mlens_disk_tier *disk;
};

/* Open and validate a model directory. On failure returns -errno and writes
 * one human-readable message into err (naming file, tensor and fault).
 * The family (family.h) names the tensors; experts may be stored per
 * expert (Mixtral: block_sparse_moe.experts.J.w1/w2/w3, Qwen and OLMoE:
 * mlp.experts.J.gate_proj/down_proj/up_proj), fused as transformers 5
 * does (mlp.experts.gate_up_proj, down_proj), or fused over experts as
 * DBRX's are (transformer.blocks.N.ffn.experts.mlp.w1/v1/w2).
 * Only headers are read: tensor data is first touched by whoever uses it. */
int mlens_model_open(const char *dir, struct mlens_model **out, char *err, size_t errlen);
void mlens_model_close(struct mlens_model *m);

/* Read and parse a config.json file (mlens_model_open's first step; also
 * mlens-bench predict's, which needs no weights). */
int mlens_model_read_config(const char *path, struct mlens_model_config *cfg, char *err,
			    size_t errlen);

/* Parse config.json text (exposed for tests and the fuzzer). */
int mlens_model_parse_config(const char *json, size_t len, const char *path,
			     struct mlens_model_config *cfg, char *err, size_t errlen);

/* Parse generation_config.json text (path names it in messages) over a
 * parsed config: an eos_token_id there replaces cfg's EOS ids; its other
 * keys are not used. mlens_model_open reads the file when the directory
 * has one. */
int mlens_model_parse_generation_config(const char *json, size_t len, const char *path,
					struct mlens_model_config *cfg, char *err, size_t errlen);

/* Find a tensor by name, NULL if absent. */
const struct mlens_tensor *mlens_model_tensor(const struct mlens_model *m, const char *name);

#endif
