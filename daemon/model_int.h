/* Private helpers shared by the model loader, the safetensors parser and the
 * model writer: message formatting and path building. */
#ifndef MLENS_MODEL_INT_H
#define MLENS_MODEL_INT_H

#include <stddef.h>

/* printf into err[errlen]; a NULL or empty buffer is ignored. */
void mlens_model_errf(char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* "dir/name", malloc'd; NULL when out of memory. */
char *mlens_model_path(const char *dir, const char *name);

#endif
