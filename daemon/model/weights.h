/* Weight pages: the model files read into pinned NUMA-local memory by
 * io_uring mover threads (several large aligned reads in flight each), and
 * the model's tensor pointers moved there. mmap copy is the fallback.
 * With a disk tier (disk_tier.h), the last experts of each MoE layer stay
 * in the files at load: the weight pages hold the rest, and those experts
 * are read into pinned staging each step (trades may later swap which
 * experts the pages hold). */
#ifndef MLENS_WEIGHTS_H
#define MLENS_WEIGHTS_H

#include <liburing.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include "daemon/mem.h"
#include "daemon/model/model.h"

struct mlens_disk_tier;

struct mlens_weights_opts {
	int node;		/* NUMA node, -1 none */
	bool mlock;
	int movers;		/* threads, each with its own ring */
	bool io_uring;		/* false: copy from the mapping */
	unsigned chunk;		/* bytes per read; 0 = 8 MiB */
	unsigned depth;		/* reads in flight per mover; 0 = 8 */
	int disk_experts;	/* experts of each MoE layer left in the files
				 * (the last ones); 0: none, no disk tier */
};

struct mlens_weights {
	struct mlens_pinned mem;
	size_t *file_off;	/* without a disk tier: where file i starts in mem */
	int n_files;
	double seconds;
	unsigned long long bytes;
	bool used_io_uring;
	bool direct;		/* O_DIRECT reads */
	uint64_t disk_bytes;	/* expert bytes left in the files */
	struct mlens_disk_tier *disk;	/* NULL without disk_experts */
};

/* How the model's bytes split with disk_experts experts a MoE layer left
 * in the files: weight pages, bytes left on disk, the disk tier's pinned
 * staging (two layers' worth). */
struct mlens_weights_split {
	uint64_t pages, disk, staging;
};

/* The split for disk_experts (0..num_local_experts), before the load.
 * 0; -EINVAL with err set where an expert matrix is not in the model
 * files. */
int mlens_weights_split(const struct mlens_model *m, int disk_experts, struct mlens_weights_split *s,
			char *err, size_t errlen);

/* Read every file of m (without o->disk_experts' experts) into pinned
 * memory and point m's tensors there; with disk_experts, m->disk is the
 * disk tier that reads the rest each step, and its experts' pointers
 * point into its staging. */
int mlens_weights_load(struct mlens_model *m, const struct mlens_weights_opts *o,
		       struct mlens_weights *w, char *err, size_t errlen);
void mlens_weights_free(struct mlens_weights *w);

/* Open file i of m for reading, O_DIRECT where the file system allows
 * (*direct cleared where it does not). The fd, or -errno with err set. */
int mlens_weights_open_file(const struct mlens_model *m, int i, bool *direct, char *err, size_t errlen);

/* ==== aligned reads through io_uring (the loader and the disk tier) ==== */

/* len bytes (a multiple of 4096 for O_DIRECT) at off of fd into dst, of
 * which want exist before the file ends; into a buffer registered with
 * the ring (io_uring_register_buffers) where fixed says so. */
struct mlens_read_range {
	int fd;
	uint64_t off;
	size_t len, want;
	void *dst;
	int fixed;	/* > 0: dst lies in the ring's registered buffer fixed - 1 */
};

/* Ranges that reader threads share: each claims the next one. fault (a
 * test hook): 1 every read fails with -EIO, 2 every read ends early. */
struct mlens_read_batch {
	const struct mlens_read_range *r;
	int n;
	atomic_int next;
	atomic_int err;		/* first -errno; -ENODATA: the file ended early */
	atomic_int err_at;	/* its range, -1: the ring */
	int fault;
};

/* Keep up to depth reads of b in flight on ring until every range is done
 * or one fails (then what is in flight is reaped). Short reads are
 * resubmitted for the rest. */
void mlens_read_batch_run(struct mlens_read_batch *b, struct io_uring *ring, unsigned depth);

#endif
