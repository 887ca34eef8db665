/* A hostile tenant for the integration tests, speaking the protocol by
 * hand (shm/attach.h, shm/region.h): it writes random bytes as submission
 * entries, an over-long prompt, or a corrupt ring index, then checks the
 * daemon answered each with an error completion and still serves a valid
 * request. Or it stops reading (stall) or scribbles its completion ring's
 * consumer index (corrupt-head) for the test script to watch the daemon.
 * Prints what it saw; exit 0 when the daemon behaved, 1 when not, 3 when it
 * cannot attach. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include "shm/attach.h"
#include "shm/region.h"

static int sock_fd, fd_region, efd_daemon, efd_client;
static struct mlens_region rg;

static int attach(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct mlens_hello h = { .magic = MLENS_HELLO_MAGIC, .version = MLENS_PROTO_VERSION };
	struct mlens_welcome w;
	union {
		char buf[CMSG_SPACE(sizeof(int) * MLENS_ATTACH_FDS)];
		struct cmsghdr align;
	} u;
	struct iovec iov = { &w, sizeof(w) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf) };
	char why[256];
	int fds[3];

	strcpy(h.name, "rawclient");
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	sock_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (connect(sock_fd, (struct sockaddr *)&sa, sizeof(sa)) ||
	    send(sock_fd, &h, sizeof(h), 0) != sizeof(h) || recvmsg(sock_fd, &mh, 0) != sizeof(w)) {
		printf("attach: %s\n", strerror(errno));
		return -1;
	}
	if (w.status) {
		printf("attach refused: %d %s\n", w.status, w.message);
		return -1;
	}
	memcpy(fds, CMSG_DATA(CMSG_FIRSTHDR(&mh)), sizeof(fds));
	fd_region = fds[0];
	efd_daemon = fds[1];
	efd_client = fds[2];
	if (mlens_region_map(&rg, fd_region, why, sizeof(why))) {
		printf("region: %s\n", why);
		return -1;
	}
	return 0;
}

/* Wait for the LAST completion of request id; returns its status, or
 * 1 when it ended normally with n tokens in *ntok. */
static int wait_last(uint64_t id, int *ntok)
{
	struct mlens_cmpl c;
	*ntok = 0;
	for (int tries = 0; tries < 600; tries++) {
		while (mlens_ring_dequeue_bulk(&rg.cmpl, &c, 1) == 1) {
			mlens_ring_wake_prod(&rg.cmpl, efd_daemon);
			if (c.id != id)
				continue;
			if (c.flags & MLENS_CMPL_TOKEN)
				(*ntok)++;
			if (c.flags & MLENS_CMPL_LAST)
				return c.finish == MLENS_FINISH_ERROR ? c.status : 1;
		}
		mlens_ring_wait_cons(&rg.cmpl, efd_client, 100);
	}
	return -ETIMEDOUT;
}

static int valid_request(uint64_t id)
{
	struct mlens_sub s;
	int32_t tok[4] = { 1, 2, 3, 4 };
	int n, rc;
	memset(&s, 0, sizeof(s));
	s.id = id;
	s.op = MLENS_OP_GENERATE;
	s.prompt_len = 4;
	s.max_tokens = 5;
	s.top_p = 1.0f;
	if ((rc = mlens_region_submit(&rg, &s, tok, efd_daemon))) {
		printf("valid submit: %d\n", rc);
		return 1;
	}
	rc = wait_last(id, &n);
	printf("valid request %llu: %s, %d tokens\n", (unsigned long long)id, rc == 1 ? "ok" : "FAILED", n);
	return rc == 1 && n == 5 ? 0 : 1;
}

/* Submit request id (prompt 1 2 3 4, max_tokens tokens) without waiting
 * for it; 0 or the submit's error. */
static int submit_only(uint64_t id, uint32_t max_tokens)
{
	struct mlens_sub s;
	int32_t tok[4] = { 1, 2, 3, 4 };
	memset(&s, 0, sizeof(s));
	s.id = id;
	s.op = MLENS_OP_GENERATE;
	s.prompt_len = 4;
	s.max_tokens = max_tokens;
	s.top_p = 1.0f;
	return mlens_region_submit(&rg, &s, tok, efd_daemon);
}

/* Whether the daemon hung up our connection within timeout_ms. */
static bool hung_up(int timeout_ms)
{
	struct pollfd p = { sock_fd, POLLIN, 0 };
	char b;
	return poll(&p, 1, timeout_ms) == 1 && recv(sock_fd, &b, 1, MSG_DONTWAIT) == 0;
}

int main(int argc, char **argv)
{
	const char *mode;
	int bad = 0;
	if (argc < 3) {
		fprintf(stderr, "usage: rawclient SOCKET garbage|overlong|corrupt-index|stall|corrupt-head\n");
		return 2;
	}
	mode = argv[2];
	if (attach(argv[1]))
		return 3;
	if (!strcmp(mode, "garbage")) {
		/* 200 entries of random bytes, each with a distinct id in its first 8 */
		unsigned x = 12345;
		int errors = 0, n;
		for (int i = 0; i < 200; i++) {
			struct mlens_sub s;
			unsigned char *b = (unsigned char *)&s;
			for (size_t k = 0; k < sizeof(s); k++) {
				x = x * 1103515245u + 12345u;
				b[k] = (unsigned char)(x >> 16);
			}
			s.id = 1000000 + (uint64_t)i;
			while (mlens_ring_enqueue_bulk(&rg.sub, &s, 1) != 1)
				mlens_ring_wait_prod(&rg.sub, efd_client, 1, 100);
			mlens_ring_wake_cons(&rg.sub, efd_daemon);
			int st = wait_last(s.id, &n);
			errors += st < 0 && st != -ETIMEDOUT;
		}
		printf("garbage: %d of 200 entries got an error completion\n", errors);
		bad |= errors != 200;
	} else if (!strcmp(mode, "overlong")) {
		struct mlens_sub s;
		uint32_t len = rg.limits.max_prompt_tokens + 1, off;
		void *p;
		int n, st;
		memset(&s, 0, sizeof(s));
		s.id = 77;
		s.op = MLENS_OP_GENERATE;
		s.prompt_len = len;
		s.max_tokens = 1;
		s.top_p = 1.0f;
		if (mlens_bytering_reserve(&rg.prompt, len * 4, &off, &p)) {
			printf("overlong: cannot reserve %u tokens\n", len);
			return 1;
		}
		memset(p, 0, len * 4);
		mlens_bytering_commit(&rg.prompt);
		s.prompt_off = off;
		mlens_ring_enqueue_bulk(&rg.sub, &s, 1);
		mlens_ring_wake_cons(&rg.sub, efd_daemon);
		st = wait_last(77, &n);
		printf("overlong prompt of %u tokens (limit %u): status %d (%s)\n", len,
		       rg.limits.max_prompt_tokens, st, st < 0 ? strerror(-st) : "accepted?!");
		bad |= st != -E2BIG;
	} else if (!strcmp(mode, "corrupt-index")) {
		/* scribble the producer index far past the consumer: the daemon
		 * must stop reading this tenant, and nothing else */
		rg.sub.shm->tail += 0x40000000u;
		mlens_ring_wake_cons(&rg.sub, efd_daemon);
		sleep(1);
		printf("corrupt-index: written\n");
		return 0;
	} else if (!strcmp(mode, "stall")) {
		/* requests that generate more than the completion ring holds,
		 * then, once it is full, a few more that stay in the submission
		 * ring; read nothing until killed */
		uint64_t id = 1;
		for (; id <= 64; id++)	/* many at once: few steps fill it */
			if (submit_only(id, 160)) {
				printf("stall: cannot submit\n");
				return 1;
			}
		for (int tries = 0; tries < 6000 && mlens_ring_count(&rg.cmpl) < (int)rg.cmpl.entries; tries++)
			usleep(10000);
		if (mlens_ring_count(&rg.cmpl) < (int)rg.cmpl.entries) {
			printf("stall: the completion ring never filled\n");
			return 1;
		}
		for (int k = 0; k < 4; k++)
			submit_only(id++, 160);
		usleep(200000);	/* the daemon had a look: they stay */
		printf("stalled: %d completions unread, %d submissions waiting\n", mlens_ring_count(&rg.cmpl),
		       (int)rg.sub.entries - mlens_ring_free_count(&rg.sub));
		fflush(stdout);
		for (;;)
			pause();
	} else if (!strcmp(mode, "corrupt-head")) {
		/* a long request, then the completion ring's consumer index
		 * (ours to write) set past the producer's: the daemon must cut
		 * this tenant off (hang up), not count the bad index forever */
		if (submit_only(1, 4000)) {
			printf("corrupt-head: cannot submit\n");
			return 1;
		}
		while (mlens_ring_count(&rg.cmpl) < 2)
			mlens_ring_wait_cons(&rg.cmpl, efd_client, 100);
		rg.cmpl.shm->head = rg.cmpl.shm->tail + 12345u;
		mlens_ring_wake_prod(&rg.cmpl, efd_daemon);
		{
			uint64_t one = 1;
			if (write(efd_daemon, &one, sizeof(one)) < 0)
				perror("doorbell");
		}
		if (!hung_up(10000)) {
			printf("corrupt-head: still connected after 10 s\n");
			return 1;
		}
		printf("corrupt-head: hung up\n");
		return 0;
	} else {
		fprintf(stderr, "rawclient: unknown mode %s\n", mode);
		return 2;
	}
	bad |= valid_request(42);
	return bad;
}
