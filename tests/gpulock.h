/* Serialising the GPU tests: a test process that times the device or
 * counts its free memory (cudaMemGetInfo is the whole device's) holds an
 * exclusive lock on $TMPDIR/mlens-gpu-tests.lock (or /tmp's) until it
 * exits, so that `make -j check` runs such tests one at a time instead of
 * side by side on one GPU (where another test's allocations showed as
 * this one's and its kernels delayed this one's timing marks). */
#ifndef MLENS_TESTS_GPULOCK_H
#define MLENS_TESTS_GPULOCK_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

/* 0, or -errno with the reason said (the test goes on without the lock). */
static inline int mlens_test_gpu_lock(const char *who)
{
	const char *dir = getenv("TMPDIR");
	char path[4096];
	int fd;
	snprintf(path, sizeof(path), "%s/mlens-gpu-tests.lock", dir && *dir ? dir : "/tmp");
	fd = open(path, O_CREAT | O_RDWR | O_CLOEXEC, 0666);
	if (fd < 0 || flock(fd, LOCK_EX) < 0) {
		int e = errno;
		fprintf(stderr, "%s: cannot lock %s (%s): running beside other GPU tests\n", who, path,
			strerror(e));
		if (fd >= 0)
			close(fd);
		return -e;
	}
	return 0;	/* fd stays open: the lock lasts as long as the process */
}

#endif
