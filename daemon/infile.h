/* Opening the files the daemon reads at start-up (mlensd.conf, a model's
 * config.json and safetensors) so that what is not a regular file is
 * refused, named, instead of blocking start-up. */
#ifndef MLENS_INFILE_H
#define MLENS_INFILE_H

#include <stddef.h>
#include <sys/stat.h>

/* Open path for reading without blocking (a FIFO or a device cannot hang
 * the caller), then fstat: only a regular file is kept (*sb gets its
 * stat). Returns the descriptor (close-on-exec, blocking again), or -errno
 * with a message naming the file in err: why follows "cannot open" there
 * (may be ""). */
int mlens_open_regular(const char *path, const char *why, struct stat *sb, char *err,
		       size_t errlen);

#endif
