/* Weight pages: the model files read into pinned NUMA-local memory by
 * io_uring mover threads (several large aligned reads in flight each), and
 * the model's tensor pointers moved there. mmap copy is the fallback. */
#ifndef MLENS_WEIGHTS_H
#define MLENS_WEIGHTS_H

#include <stdbool.h>
#include "daemon/mem.h"
#include "daemon/model/model.h"

struct mlens_weights_opts {
	int node;		/* NUMA node, -1 none */
	bool mlock;
	int movers;		/* threads, each with its own ring */
	bool io_uring;		/* false: copy from the mapping */
	unsigned chunk;		/* bytes per read; 0 = 8 MiB */
	unsigned depth;		/* reads in flight per mover; 0 = 8 */
};

struct mlens_weights {
	struct mlens_pinned mem;
	size_t *file_off;	/* where file i starts in mem */
	int n_files;
	double seconds;
	unsigned long long bytes;
	bool used_io_uring;
	bool direct;		/* O_DIRECT reads */
};

/* Read every file of m into pinned memory and point m's tensors there. */
int mlens_weights_load(struct mlens_model *m, const struct mlens_weights_opts *o,
		       struct mlens_weights *w, char *err, size_t errlen);
void mlens_weights_free(struct mlens_weights *w);

#endif
