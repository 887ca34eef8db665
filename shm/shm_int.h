/* Private to shm/: helpers shared by its files, not part of its interface. */
#ifndef MLENS_SHM_INT_H
#define MLENS_SHM_INT_H

#include <stddef.h>

/* Write a one-line reason into why (if why and why_len) and return err, so
 * a check can fail in one statement. */
__attribute__((format(printf, 4, 5)))
int mlens_shm_reason(int err, char *why, size_t why_len, const char *fmt, ...);

#endif
