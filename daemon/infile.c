/* Opening the daemon's input files: regular files only, never blocking. */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
#include "daemon/errf.h"
#include "daemon/infile.h"

static const char *file_kind(mode_t m)
{
	return S_ISFIFO(m) ? "a FIFO" : S_ISDIR(m) ? "a directory" : S_ISCHR(m) ? "a character device" :
	       S_ISBLK(m) ? "a block device" : S_ISSOCK(m) ? "a socket" : "not a plain file";
}

int mlens_open_regular(const char *path, const char *why, struct stat *sb, char *err,
		       size_t errlen)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK), rc;
	if (fd < 0) {
		rc = -errno;
		mlens_errf(err, errlen, "%s: cannot open%s: %s", path, why, strerror(-rc));
		return rc;
	}
	if (fstat(fd, sb) < 0) {
		rc = -errno;
		mlens_errf(err, errlen, "%s: cannot stat: %s", path, strerror(-rc));
		close(fd);
		return rc;
	}
	if (!S_ISREG(sb->st_mode)) {
		mlens_errf(err, errlen, "%s: not a regular file (%s): give the path of a file", path,
			 file_kind(sb->st_mode));
		close(fd);
		return -EINVAL;
	}
	if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) < 0) {
		rc = -errno;
		mlens_errf(err, errlen, "%s: fcntl: %s", path, strerror(-rc));
		close(fd);
		return rc;
	}
	return fd;
}
