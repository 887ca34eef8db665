/* Description: send raw bytes to a daemon socket and report whether the
 * daemon closed the connection, for the operating tests (garbage, HTTP,
 * over-long and half-written requests).
 * usage: ops_raw unix:PATH|tcp:HOST:PORT WAIT_MS < BYTES
 * Writes stdin to the socket, then prints what comes back until the peer
 * closes or WAIT_MS passes. Exit 0: the daemon closed it; 1: still open
 * after WAIT_MS; 3: cannot connect. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static int connect_to(const char *spec)
{
	int fd;
	if (!strncmp(spec, "unix:", 5)) {
		struct sockaddr_un sa = { .sun_family = AF_UNIX };
		snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", spec + 5);
		fd = socket(AF_UNIX, SOCK_STREAM, 0);
		if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
			return fd;
	} else if (!strncmp(spec, "tcp:", 4)) {
		struct sockaddr_in sa = { .sin_family = AF_INET };
		char host[64];
		const char *colon = strrchr(spec + 4, ':');
		if (!colon || (size_t)(colon - spec - 4) >= sizeof(host))
			return -1;
		memcpy(host, spec + 4, (size_t)(colon - spec - 4));
		host[colon - spec - 4] = 0;
		sa.sin_port = htons((unsigned short)atoi(colon + 1));
		if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
			return -1;
		fd = socket(AF_INET, SOCK_STREAM, 0);
		if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
			return fd;
	} else {
		return -1;
	}
	if (fd >= 0)
		close(fd);
	return -1;
}

int main(int argc, char **argv)
{
	char buf[65536];
	long deadline;
	ssize_t n;
	int fd;
	if (argc != 3) {
		fprintf(stderr, "usage: ops_raw unix:PATH|tcp:HOST:PORT WAIT_MS < BYTES\n");
		return 2;
	}
	fd = connect_to(argv[1]);
	if (fd < 0) {
		fprintf(stderr, "ops_raw: cannot connect to %s: %s\n", argv[1], strerror(errno));
		return 3;
	}
	while ((n = read(0, buf, sizeof(buf))) > 0) {
		/* the daemon may close early (over-long line): stop writing then */
		if (send(fd, buf, (size_t)n, MSG_NOSIGNAL) < 0)
			break;
	}
	deadline = now_ms() + atol(argv[2]);
	for (;;) {
		struct pollfd p = { fd, POLLIN, 0 };
		long left = deadline - now_ms();
		if (left <= 0 || poll(&p, 1, (int)left) == 0) {
			fflush(stdout);
			return 1;
		}
		n = recv(fd, buf, sizeof(buf), 0);
		if (n <= 0) {
			fflush(stdout);
			return 0;	/* EOF, or reset: closed either way */
		}
		fwrite(buf, 1, (size_t)n, stdout);
	}
}
