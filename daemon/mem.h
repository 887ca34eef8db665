/* Pinned host memory on one NUMA node: the KV block pool and the weight
 * pages live here. Allocated with libnuma, locked with mlock when asked,
 * and accounted: each area is a budget the daemon reports. */
#ifndef MLENS_MEM_H
#define MLENS_MEM_H

#include <stdbool.h>
#include <stddef.h>

struct mlens_pinned {
	void *p;
	size_t size;
	int node;		/* NUMA node it is bound to, -1 without NUMA */
	bool locked;		/* mlock succeeded */
	const char *what;	/* "KV cache", "weights": for messages */
};

/* The NUMA node to use: want >= 0 as given (checked), else the node of
 * CUDA device gpu when there is one, else 0. */
int mlens_numa_pick(int want, int gpu, char *err, size_t errlen);

/* Allocate size bytes on node, touching every page; lock them if mlock_it.
 * A failed mlock is an error with a message naming RLIMIT_MEMLOCK. */
int mlens_pinned_alloc(struct mlens_pinned *m, size_t size, int node, bool mlock_it,
		       const char *what, char *err, size_t errlen);
void mlens_pinned_free(struct mlens_pinned *m);

/* Bytes of [p, p + len) that the kernel backs with transparent huge pages,
 * from an smaps file (NULL: /proc/self/smaps): each mapping's
 * AnonHugePages prorated by its overlap with the range (a mapping the
 * range covers whole counts whole; the kernel merges neighbours of the
 * same flags, such as the KV cache's K and V areas, into one). Where the
 * pool's attention reads the KV cache, 4 KiB pages cost TLB misses that
 * 2 MiB pages do not. 0, -errno when the file cannot be read, -ENOENT
 * when no mapping overlaps the range, -EINVAL for a malformed file. */
int mlens_huge_bytes(const char *smaps, const void *p, size_t len, size_t *huge);

#endif
