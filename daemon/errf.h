/* The daemon's one formatter for messages that explain a failure in a
 * caller's buffer (char *err, size_t errlen pairs throughout). */
#ifndef MLENS_ERRF_H
#define MLENS_ERRF_H

#include <stddef.h>

/* printf into err[errlen]; a NULL or empty buffer is ignored. */
void mlens_errf(char *err, size_t errlen, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

#endif
