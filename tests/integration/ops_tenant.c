/* Description: a bare tenant for the operating tests (tests/integration/
 * ops.sh): attaches over the raw protocol (hello, welcome + 3 fds, region),
 * submits N greedy requests and reports how each ended, then optionally
 * stays attached, reporting the daemon's hang-up (eviction).
 * usage: ops_tenant [--gate FILE] [--stall] [--more FILE M] [--hold S]
 *                   SOCKET NAME N_REQUESTS MAX_TOKENS
 * prints "tenant ID"; --gate waits for FILE to exist before submitting;
 * then per request "req I status S finish F tokens T". --stall never reads
 * completions (the ring fills, the requests keep their KV), --more submits
 * M more once FILE exists (and frees 64 completion slots, so that the
 * daemon takes them in); both then wait for the hang-up. --hold S waits
 * up to S seconds for the daemon to hang up: "hangup" or "held". */
#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include "shm/attach.h"
#include "shm/region.h"

#define WAIT_MS 20000

static int attach(const char *path, const char *name, struct mlens_welcome *w, int fds[3])
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct mlens_hello h = { .magic = MLENS_HELLO_MAGIC, .version = MLENS_PROTO_VERSION };
	char cbuf[CMSG_SPACE(3 * sizeof(int))];
	struct iovec iov = { w, sizeof(*w) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf) };
	struct cmsghdr *cm;
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	snprintf(h.name, sizeof(h.name), "%s", name);
	if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof(sa)) || send(s, &h, sizeof(h), 0) != sizeof(h)) {
		fprintf(stderr, "ops_tenant: cannot attach to %s: %s\n", path, strerror(errno));
		return -1;
	}
	if (recvmsg(s, &mh, MSG_CMSG_CLOEXEC) != (ssize_t)sizeof(*w) || w->magic != MLENS_WELCOME_MAGIC) {
		fprintf(stderr, "ops_tenant: no welcome\n");
		return -1;
	}
	if (w->status) {
		fprintf(stderr, "ops_tenant: refused: %s\n", w->message);
		return -1;
	}
	cm = CMSG_FIRSTHDR(&mh);
	if (!cm || cm->cmsg_type != SCM_RIGHTS || cm->cmsg_len != CMSG_LEN(3 * sizeof(int))) {
		fprintf(stderr, "ops_tenant: welcome without fds\n");
		return -1;
	}
	memcpy(fds, CMSG_DATA(cm), 3 * sizeof(int));
	return s;
}

/* Wait for a completion or a hang-up; 1 entry, 0 timeout, -1 hang-up. */
static int next_cmpl(struct mlens_region *rg, int efd_out, int sock, struct mlens_cmpl *c, int ms)
{
	for (;;) {
		struct pollfd p[2] = { { efd_out, POLLIN, 0 }, { sock, POLLIN, 0 } };
		uint64_t v;
		if (mlens_ring_dequeue_burst(&rg->cmpl, c, 1) == 1)
			return 1;
		mlens_ring_cons_arm(&rg->cmpl);
		if (mlens_ring_count(&rg->cmpl) > 0) {
			mlens_ring_cons_disarm(&rg->cmpl);
			continue;
		}
		if (poll(p, 2, ms) == 0)
			return 0;
		mlens_ring_cons_disarm(&rg->cmpl);
		if (p[0].revents && read(efd_out, &v, sizeof(v)) < 0 && errno != EAGAIN)
			return -1;
		if (p[1].revents) {
			char b[8];
			if (recv(sock, b, sizeof(b), MSG_DONTWAIT) == 0)
				return mlens_ring_dequeue_burst(&rg->cmpl, c, 1) == 1 ? 1 : -1;
		}
	}
}

static bool exists_within(const char *path, int ms)
{
	struct stat st;
	for (int t = 0; t < ms; t += 20) {
		if (!stat(path, &st))
			return true;
		usleep(20000);
	}
	return false;
}

static int submit(struct mlens_region *rg, int efd_in, uint64_t id, int max_tokens)
{
	static const int32_t prompt[] = { 1, 2, 3, 4, 5, 6, 7, 8 };
	struct mlens_sub s = { .id = id, .op = MLENS_OP_GENERATE, .prompt_len = 8,
			       .max_tokens = (uint32_t)max_tokens, .top_p = 1.0f };
	uint32_t off;
	void *p;
	if (mlens_bytering_reserve(&rg->prompt, sizeof(prompt), &off, &p)) {
		fprintf(stderr, "ops_tenant: prompt ring full\n");
		return -1;
	}
	memcpy(p, prompt, sizeof(prompt));
	mlens_bytering_commit(&rg->prompt);
	s.prompt_off = off;
	if (mlens_ring_enqueue_bulk(&rg->sub, &s, 1) != 1) {
		fprintf(stderr, "ops_tenant: submission ring full\n");
		return -1;
	}
	mlens_ring_wake_cons(&rg->sub, efd_in);
	return 0;
}

/* Wait up to ms for the daemon to close the socket, reading nothing else. */
static bool hangup_within(int sock, int ms)
{
	struct pollfd p = { sock, POLLIN, 0 };
	char b[8];
	return poll(&p, 1, ms) == 1 && recv(sock, b, sizeof(b), MSG_DONTWAIT) == 0;
}

int main(int argc, char **argv)
{
	struct mlens_welcome w;
	struct mlens_region rg;
	char why[256];
	const char *gate = NULL, *more_file = NULL;
	bool stall = false;
	int fds[3], sock, n, max_tokens, hold = 0, more = 0, done = 0, *tokens, a = 1;
	void *mem;
	for (; a < argc && !strncmp(argv[a], "--", 2); a++) {
		if (!strcmp(argv[a], "--gate") && a + 1 < argc)
			gate = argv[++a];
		else if (!strcmp(argv[a], "--stall"))
			stall = true;
		else if (!strcmp(argv[a], "--more") && a + 2 < argc) {
			more_file = argv[++a];
			more = atoi(argv[++a]);
		} else if (!strcmp(argv[a], "--hold") && a + 1 < argc)
			hold = atoi(argv[++a]);
		else
			break;
	}
	if (argc - a != 4) {
		fprintf(stderr, "usage: ops_tenant [--gate FILE] [--stall] [--more FILE M] [--hold S] "
			"SOCKET NAME N_REQUESTS MAX_TOKENS\n");
		return 2;
	}
	n = atoi(argv[a + 2]);
	max_tokens = atoi(argv[a + 3]);
	sock = attach(argv[a], argv[a + 1], &w, fds);
	if (sock < 0)
		return 1;
	mem = mmap(NULL, w.region_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	if (mem == MAP_FAILED || mlens_region_attach(&rg, mem, w.region_size, why, sizeof(why))) {
		fprintf(stderr, "ops_tenant: region: %s\n", mem == MAP_FAILED ? strerror(errno) : why);
		return 1;
	}
	printf("tenant %u\n", w.tenant_id);
	fflush(stdout);
	if (gate && !exists_within(gate, WAIT_MS)) {
		fprintf(stderr, "ops_tenant: %s did not appear\n", gate);
		return 1;
	}
	for (int i = 0; i < n; i++)
		if (submit(&rg, fds[1], (uint64_t)i, max_tokens))
			return 1;
	if (stall) {
		if (more_file) {
			/* the script makes the file once the completion ring is
			 * full, which under ASan on a loaded 2-core box can take
			 * past WAIT_MS: wait as long as the tenant holds on */
			if (!exists_within(more_file, hold ? hold * 1000 : WAIT_MS)) {
				fprintf(stderr, "ops_tenant: %s did not appear\n", more_file);
				return 1;
			}
			for (int i = 0; i < more; i++)
				if (submit(&rg, fds[1], (uint64_t)(n + i), max_tokens))
					return 1;
			/* the daemon takes submissions only while it could report on
			 * them: make a little room in the full completion ring */
			for (int i = 0; i < 64; i++) {
				struct mlens_cmpl c;
				mlens_ring_dequeue_burst(&rg.cmpl, &c, 1);
			}
			mlens_ring_wake_prod(&rg.cmpl, fds[1]);
			printf("submitted %d more\n", more);
			fflush(stdout);
		}
		printf("%s\n", hangup_within(sock, (hold ? hold : 20) * 1000) ? "hangup" : "held");
		return 0;
	}
	tokens = calloc((size_t)n + 1, sizeof(int));
	while (done < n) {
		struct mlens_cmpl c;
		int rc = next_cmpl(&rg, fds[2], sock, &c, WAIT_MS);
		if (rc <= 0) {
			printf("%s\n", rc ? "hangup" : "timeout");
			return rc ? 0 : 1;
		}
		if (c.id >= (uint64_t)n)
			continue;
		if (c.flags & MLENS_CMPL_TOKEN)
			tokens[c.id]++;
		if (c.flags & MLENS_CMPL_LAST) {
			printf("req %d status %d finish %d tokens %d\n", (int)c.id, c.status, c.finish, tokens[c.id]);
			fflush(stdout);
			done++;
		}
	}
	if (hold)
		printf("%s\n", hangup_within(sock, hold * 1000) ? "hangup" : "held");
	free(tokens);
	return 0;
}
