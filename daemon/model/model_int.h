/* Private helpers shared by the model loader, the family table, the
 * safetensors parser and the model writer: path building and config.json
 * field readers (messages: daemon/errf.h). */
#ifndef MLENS_MODEL_INT_H
#define MLENS_MODEL_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>

/* "dir/name", malloc'd; NULL when out of memory. */
char *mlens_model_path(const char *dir, const char *name);

/* Where a config.json reader reports (the file's path names it). */
struct mlens_cfg_ctx {
	const char *path;
	char *err;
	size_t errlen;
};

/* An integer field in [lo, hi]; absent or null takes def unless required. */
int mlens_cfg_int(const struct mlens_cfg_ctx *c, json_t *root, const char *key, bool required,
		  int64_t def, int64_t lo, int64_t hi, int64_t *out);
/* A number in (lo, hi); absent or null takes def. */
int mlens_cfg_real(const struct mlens_cfg_ctx *c, json_t *obj, const char *key, double def,
		   double lo, double hi, double *out);

#endif
