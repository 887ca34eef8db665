/* Pinned NUMA-local allocations. */
#include <ctype.h>
#include <errno.h>
#include <numa.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>
#include "daemon/mem.h"
#include "kernels/backend.h"

/* The NUMA node a PCI device sits on (sysfs), or -1. */
static int pci_numa_node(const char *bus_id)
{
	char path[256], lower[64];
	FILE *f;
	int node = -1;
	size_t i;
	for (i = 0; bus_id[i] && i < sizeof(lower) - 1; i++)
		lower[i] = (char)tolower((unsigned char)bus_id[i]);
	lower[i] = 0;
	snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/numa_node", lower);
	f = fopen(path, "r");
	if (f) {
		if (fscanf(f, "%d", &node) != 1)
			node = -1;
		fclose(f);
	}
	return node;
}

int mlens_numa_pick(int want, int gpu, char *err, size_t errlen)
{
	if (numa_available() < 0)
		return want > 0 ? (snprintf(err, errlen, "NUMA node %d asked for, but this kernel has no NUMA support", want), -ENODEV) : -1;
	if (want >= 0) {
		if (want > numa_max_node() || !numa_bitmask_isbitset(numa_all_nodes_ptr, (unsigned)want)) {
			snprintf(err, errlen, "NUMA node %d does not exist (nodes 0..%d)", want, numa_max_node());
			return -ENODEV;
		}
		return want;
	}
	/* default: the GPU's node, so that DMA to it stays local */
	{
		char bus[64];
		int node;
		if (mlens_gpu_bus_id(gpu, bus, sizeof(bus)) == 0 && (node = pci_numa_node(bus)) >= 0 &&
		    node <= numa_max_node())
			return node;
	}
	return 0;
}

int mlens_pinned_alloc(struct mlens_pinned *m, size_t size, int node, bool mlock_it,
		       const char *what, char *err, size_t errlen)
{
	long page = sysconf(_SC_PAGESIZE);
	memset(m, 0, sizeof(*m));
	m->what = what;
	m->node = node;
	size = (size + (size_t)page - 1) & ~((size_t)page - 1);
	if (node >= 0 && numa_available() >= 0)
		m->p = numa_alloc_onnode(size, node);
	else {
		m->p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m->p == MAP_FAILED)
			m->p = NULL;
		m->node = -1;
	}
	if (!m->p) {
		snprintf(err, errlen, "cannot allocate %zu MiB for the %s on NUMA node %d", size >> 20, what, node);
		return -ENOMEM;
	}
	m->size = size;
	/* huge pages where the kernel allows: fewer TLB misses in attention */
	madvise(m->p, size, MADV_HUGEPAGE);
	if (mlock_it) {
		if (mlock(m->p, size)) {
			int e = errno;
			struct rlimit rl;
			getrlimit(RLIMIT_MEMLOCK, &rl);
			snprintf(err, errlen,
				 "cannot lock %zu MiB for the %s: %s (RLIMIT_MEMLOCK is %llu KiB; raise it, "
				 "e.g. LimitMEMLOCK=infinity, or set mlock = false)",
				 size >> 20, what, strerror(e),
				 rl.rlim_cur == RLIM_INFINITY ? 0ull : (unsigned long long)rl.rlim_cur >> 10);
			mlens_pinned_free(m);
			return -e;
		}
		m->locked = true;
	} else {
		/* touch every page so the memory is really there (and on node) */
		for (size_t o = 0; o < size; o += (size_t)page)
			((volatile char *)m->p)[o] = 0;
	}
	return 0;
}

void mlens_pinned_free(struct mlens_pinned *m)
{
	if (!m->p)
		return;
	if (m->locked)
		munlock(m->p, m->size);
	if (m->node >= 0)
		numa_free(m->p, m->size);
	else
		munmap(m->p, m->size);
	m->p = NULL;
}

int mlens_huge_bytes(const char *smaps, const void *p, size_t len, size_t *huge)
{
	uintptr_t a = (uintptr_t)p, b = a + len, start = 0, end = 0;
	double sum = 0;
	bool any = false, in = false;
	char line[512];
	FILE *f = fopen(smaps ? smaps : "/proc/self/smaps", "r");
	int rc = 0;

	*huge = 0;
	if (!f)
		return -errno;
	while (fgets(line, sizeof(line), f)) {
		uintmax_t s0, s1, kb;
		int n = 0;
		if (!strchr(line, '\n') && !feof(f)) {	/* a path longer than the buffer */
			int c;
			while ((c = fgetc(f)) != EOF && c != '\n')
				;
		}
		/* a mapping's header: "start-end perms offset dev inode [path]" */
		if (sscanf(line, "%jx-%jx %*4s %n", &s0, &s1, &n) == 2 && n > 0) {
			if (s1 < s0) {
				rc = -EINVAL;
				break;
			}
			start = (uintptr_t)s0;
			end = (uintptr_t)s1;
			in = end > a && start < b;
			any |= in;
		} else if (in && sscanf(line, "AnonHugePages: %ju kB", &kb) == 1) {
			uintptr_t lo = start > a ? start : a, hi = end < b ? end : b;
			sum += (double)kb * 1024.0 * (double)(hi - lo) / (double)(end - start);
		}
	}
	fclose(f);
	if (rc)
		return rc;
	if (!any)
		return -ENOENT;
	*huge = sum > (double)len ? len : (size_t)sum;
	return 0;
}
