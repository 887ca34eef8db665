/* Private helpers shared by the model loader, the family table, the
 * safetensors parser and the model writer: path building, config.json
 * field readers and the tensor binder (messages: daemon/errf.h). */
#ifndef MLENS_MODEL_INT_H
#define MLENS_MODEL_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>
#include "daemon/model/model.h"

/* "dir/name", malloc'd; NULL when out of memory. */
char *mlens_model_path(const char *dir, const char *name);

/* ==== config.json ==== */

/* Where messages go: "<path>: ..." */
struct mlens_cfg_ctx {
	const char *path;
	char *err;
	size_t errlen;
};

/* An integer field of obj: absent or null takes def unless required;
 * outside [lo, hi] is refused naming the key and the value. */
int mlens_cfg_int(const struct mlens_cfg_ctx *c, json_t *obj, const char *key, bool required,
		  int64_t def, int64_t lo, int64_t hi, int64_t *out);
/* A number field of obj: absent or null takes def; it must lie in (lo, hi). */
int mlens_cfg_real(const struct mlens_cfg_ctx *c, json_t *obj, const char *key, double def,
		   double lo, double hi, double *out);
/* rope_theta (def when absent), rope_scaling and rope_parameters of root. */
int mlens_cfg_rope(const struct mlens_cfg_ctx *c, json_t *root, double def,
		   struct mlens_model_config *cfg);
/* torch_dtype / dtype and eos_token_id of root. */
int mlens_cfg_dtype_eos(const struct mlens_cfg_ctx *c, json_t *root,
			struct mlens_model_config *cfg);

/* ==== binding the weights ==== */

struct mlens_binder {
	struct mlens_model *m;
	bool *used;		/* per tensor of m: bound */
	char *err;
	size_t errlen;
	int rc;
	int missing;
	char first_missing[160];
};

/* The tensor name with this shape (d0..d2 for ndim dimensions), marked
 * used; NULL when absent (counted in b->missing) or of another shape (b->rc
 * set, the message names the file, the tensor and both shapes). */
const struct mlens_tensor *mlens_binder_need(struct mlens_binder *b, const char *name, int ndim,
					     int64_t d0, int64_t d1, int64_t d2);

/* ==== families ==== */

/* DBRX (DbrxForCausalLM, family_dbrx.c), for its family.c entry: its
 * nested config.json into cfg, and layer i's tensors
 * (transformer.blocks.i.*) into m->layers[i] and m->views[3 * i ...]. */
int mlens_family_dbrx_parse_config(const struct mlens_cfg_ctx *c, json_t *root,
				   struct mlens_model_config *cfg);
void mlens_family_dbrx_bind_layer(struct mlens_binder *b, int64_t i);

#endif
