/* The model families mlens serves, one table entry each, keyed by
 * config.json's `architectures` string: the family's config keys (a parse
 * hook over the keys all families share) and its tensor names. What a
 * family changes in the layer is data in struct mlens_model_config (q/k
 * norms, biases, routing rule, shared or dense MLPs, norm kind, clip,
 * w2's layout), which the one layer
 * in daemon/exec/layer.c reads; a new family is one more entry. */
#ifndef MLENS_FAMILY_H
#define MLENS_FAMILY_H

#include <jansson.h>
#include "daemon/model/model.h"
#include "daemon/model/model_int.h"

struct mlens_family {
	const char *architecture;	/* "MixtralForCausalLM" */
	const char *preset;		/* mlens-mkmodel's small test preset */
	/* Reads the family's own keys of config.json into cfg (experts, MLP
	 * sizes, features) after the common ones, or every key when
	 * own_config is set (DBRX's nested attn_config, ffn_config); 0 or
	 * -errno with the message naming the key and its value. */
	int (*parse)(const struct mlens_cfg_ctx *c, json_t *root, struct mlens_model_config *cfg);
	bool own_config;
	/* The embedding's and the final norm's tensor names. */
	const char *embed, *final_norm;
	/* Binds layer i's tensors into b->m->layers[i] (the expert arrays
	 * are set up), with 3 row views of its own at b->m->views[3 * i];
	 * NULL: the names below, after "model.layers.i.". */
	void (*bind_layer)(struct mlens_binder *b, int64_t i);
	/* Without bind_layer, tensor names after "model.layers.N.": the
	 * router, and expert J's gate (w1), down (w2) and up (w3) weights,
	 * "<experts>.J.<w>.weight". The fused transformers 5 layout
	 * (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj)
	 * is read for every such family. */
	const char *router;
	const char *experts;
	const char *expert_w[3];
};

/* The entry for an architectures string, NULL when mlens has none. */
const struct mlens_family *mlens_family_find(const char *architecture);
/* The i-th entry, NULL past the last. */
const struct mlens_family *mlens_family_at(int i);

#endif
