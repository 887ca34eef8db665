/* Private helper shared by the model loader, the safetensors parser and the
 * model writer: path building (messages: daemon/errf.h). */
#ifndef MLENS_MODEL_INT_H
#define MLENS_MODEL_INT_H

#include <stddef.h>

/* "dir/name", malloc'd; NULL when out of memory. */
char *mlens_model_path(const char *dir, const char *name);

#endif
