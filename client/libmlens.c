/* libmlens: attach (the socket handshake of shm/attach.h), submissions and
 * cancels into the submission and prompt rings, events out of the
 * completion ring, and the shared doorbell the daemon rings for all three.
 * The daemon is trusted to follow the protocol, but what it writes is still
 * checked before a caller sees it. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include "client/mlens.h"
#include "shm/attach.h"
#include "shm/barrier.h"
#include "shm/proto.h"
#include "shm/region.h"
#include "shm/ring.h"

_Static_assert(MLENS_REQ_MAX_STOP == MLENS_MAX_STOP, "stop token count matches the protocol");
_Static_assert(MLENS_REQ_LOGPROBS == MLENS_SUB_LOGPROBS, "logprobs flag matches the protocol");
_Static_assert(MLENS_REQ_IGNORE_EOS == MLENS_SUB_IGNORE_EOS, "ignore-EOS flag matches the protocol");
#define REQ_FLAGS_KNOWN (MLENS_REQ_LOGPROBS | MLENS_REQ_IGNORE_EOS)

/* How long mlens_open waits for the daemon's welcome. */
#define WELCOME_TIMEOUT_MS 10000
/* Completions copied out of the ring per dequeue. */
#define CMPL_BATCH 64

/* The daemon writes one eventfd for three reasons (events posted,
 * submission slots freed, prompt bytes freed), and a submitting thread and
 * a reading thread may both sleep on it. One thread at a time (the leader)
 * sleeps in poll() and drains it; the others wait on cond until the leader
 * returns. gen counts the leader's returns and drains: a sleeper reads gen
 * before arming its wake-up flag, so a doorbell rung after the flag was set
 * is drained no earlier than that read, and the sleeper sees gen move. */
struct doorbell {
	pthread_mutex_t lock;
	pthread_cond_t cond;	/* CLOCK_MONOTONIC */
	uint64_t gen;
	bool leader;
};

#define DETAILS 64

struct mlens {
	int sock;		/* the attach socket; its hang-up is the daemon's */
	int efd_in;		/* we write: work for the daemon */
	int efd_out;		/* the daemon writes */
	void *map;
	size_t map_size;
	struct mlens_region rg;
	struct doorbell bell;
	/* Submitting side: submission and prompt rings, ids. */
	pthread_mutex_t sub_lock;
	uint64_t next_id;
	/* Reading side: the completion ring. */
	pthread_mutex_t cmpl_lock;
	/* The limits named by the last DETAILS error events (the reading
	 * side writes, mlens_event_strerror reads), under detail_lock; an
	 * event's detail is its key (ev->detail), in slot key % DETAILS. */
	pthread_mutex_t detail_lock;
	struct detail {
		uint32_t key;
		uint8_t what;
		uint32_t need, have;
	} details[DETAILS];
	uint32_t detail_key;
	/* 1 once the socket hung up; read by both sides, through
	 * is_dead()/set_dead(). */
	uint32_t dead;
};

/* ==== Time ==== */

static int64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t deadline_of(int timeout_ms)
{
	return timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
}

/* Milliseconds left before deadline, as poll(2) takes them. */
static int ms_left(int64_t deadline)
{
	int64_t left;

	if (deadline < 0)
		return -1;
	left = deadline - now_ms();
	return left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

/* ==== Hang-up ==== */

static bool is_dead(struct mlens *m)
{
	/* Acquire: pairs with the release in set_dead(); only the flag
	 * itself is published, so this orders nothing else. */
	return mlens_load_acquire(&m->dead) != 0;
}

static void set_dead(struct mlens *m)
{
	/* Release: pairs with the acquire in is_dead(). */
	mlens_store_release(&m->dead, 1u);
}

/* ==== Doorbell ==== */

static int doorbell_init(struct doorbell *b)
{
	pthread_condattr_t ca;
	int err;

	err = pthread_condattr_init(&ca);
	if (err)
		return -err;
	err = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	if (!err)
		err = pthread_cond_init(&b->cond, &ca);
	pthread_condattr_destroy(&ca);
	if (err)
		return -err;
	err = pthread_mutex_init(&b->lock, NULL);
	if (err) {
		pthread_cond_destroy(&b->cond);
		return -err;
	}
	b->gen = 0;
	b->leader = false;
	return 0;
}

static void doorbell_destroy(struct doorbell *b)
{
	pthread_cond_destroy(&b->cond);
	pthread_mutex_destroy(&b->lock);
}

/* Read before arming a wake-up flag; see struct doorbell. */
static uint64_t doorbell_gen(struct mlens *m)
{
	uint64_t g;

	pthread_mutex_lock(&m->bell.lock);
	g = m->bell.gen;
	pthread_mutex_unlock(&m->bell.lock);
	return g;
}

static void drain(int efd)
{
	uint64_t v;

	/* Nonblocking: EAGAIN when nothing is pending. */
	while (read(efd, &v, sizeof(v)) < 0 && errno == EINTR)
		;
}

/* Has the daemon hung up? Never blocks. */
static bool socket_hung_up(struct mlens *m)
{
	struct pollfd p = { .fd = m->sock, .events = POLLRDHUP };

	if (is_dead(m))
		return true;
	if (poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL))) {
		set_dead(m);
		return true;
	}
	return false;
}

/* Without sleeping: drain a pending doorbell (so that an external poll loop
 * on mlens_fd() does not spin on it), unless a leader is sleeping on it,
 * which drains it itself. Sleepers look again either way. */
static void doorbell_drain(struct mlens *m)
{
	pthread_mutex_lock(&m->bell.lock);
	if (!m->bell.leader) {
		drain(m->efd_out);
		m->bell.gen++;
		pthread_cond_broadcast(&m->bell.cond);
	}
	pthread_mutex_unlock(&m->bell.lock);
}

/* Sleep until the doorbell rings, the daemon hangs up or deadline passes;
 * g is what doorbell_gen() returned before the caller armed its flag.
 * Returns 0 (the caller looks again) or -errno. Sets m->dead on hang-up. */
static int doorbell_sleep(struct mlens *m, uint64_t g, int64_t deadline)
{
	struct pollfd p[2] = {
		{ .fd = m->efd_out, .events = POLLIN },
		{ .fd = m->sock, .events = POLLRDHUP },
	};
	int rc, err = 0;

	pthread_mutex_lock(&m->bell.lock);
	while (m->bell.leader && m->bell.gen == g) {
		if (deadline < 0) {
			pthread_cond_wait(&m->bell.cond, &m->bell.lock);
		} else {
			struct timespec ts = { .tv_sec = deadline / 1000,
					       .tv_nsec = (deadline % 1000) * 1000000 };

			if (pthread_cond_timedwait(&m->bell.cond, &m->bell.lock, &ts) == ETIMEDOUT)
				break;
		}
	}
	if (m->bell.leader || m->bell.gen != g) {
		pthread_mutex_unlock(&m->bell.lock);
		return 0;
	}
	m->bell.leader = true;
	pthread_mutex_unlock(&m->bell.lock);

	rc = poll(p, 2, ms_left(deadline));
	if (rc < 0 && errno != EINTR)
		err = -errno;
	if (rc > 0) {
		if (p[0].revents & POLLIN)
			drain(m->efd_out);
		if (p[0].revents & (POLLERR | POLLNVAL))
			err = -EBADF;
		if (p[1].revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL))
			set_dead(m);
	}

	pthread_mutex_lock(&m->bell.lock);
	m->bell.leader = false;
	m->bell.gen++;
	pthread_cond_broadcast(&m->bell.cond);
	pthread_mutex_unlock(&m->bell.lock);
	return err;
}

/* Ring the daemon's doorbell. A saturated counter means one is pending. */
static void ring_daemon(struct mlens *m)
{
	uint64_t one = 1;

	while (write(m->efd_in, &one, sizeof(one)) < 0 && errno == EINTR)
		;
}

/* ==== Attach ==== */

static int set_nonblock(int fd)
{
	int fl = fcntl(fd, F_GETFL);

	if (fl < 0)
		return -errno;
	if (!(fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
		return -errno;
	return 0;
}

/* Send the hello and take the welcome and its fds. Returns 0 with fds[]
 * open, or -errno with none open. */
static int handshake(int sock, const char *name, int fds[MLENS_ATTACH_FDS],
		     struct mlens_welcome *w)
{
	struct mlens_hello h;
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * MLENS_ATTACH_FDS)];
	} ctl;
	struct iovec iov = { .iov_base = w, .iov_len = sizeof(*w) };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
			      .msg_controllen = sizeof(ctl.buf) };
	struct pollfd p = { .fd = sock, .events = POLLIN };
	struct cmsghdr *c;
	int nfds = 0, err = 0, rc;
	ssize_t n;

	memset(&h, 0, sizeof(h));
	h.magic = MLENS_HELLO_MAGIC;
	h.version = MLENS_PROTO_VERSION;
	if (name)
		snprintf(h.name, sizeof(h.name), "%s", name);
	do {
		n = send(sock, &h, sizeof(h), MSG_NOSIGNAL);
	} while (n < 0 && errno == EINTR);
	/* a daemon that refuses a peer at once (not allowed to attach) may
	 * answer and close before the hello is sent: its answer is still
	 * there to read */
	if (n < 0 && errno != EPIPE && errno != ECONNRESET)
		return -errno;

	do {
		rc = poll(&p, 1, WELCOME_TIMEOUT_MS);
	} while (rc < 0 && errno == EINTR);
	if (rc < 0)
		return -errno;
	if (rc == 0)
		return -ETIMEDOUT;
	memset(w, 0, sizeof(*w));
	do {
		n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
	} while (n < 0 && errno == EINTR);
	/* the reset of a close that found the hello unread comes first, once;
	 * the answer queued before it comes next */
	if (n < 0 && errno == ECONNRESET)
		n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
	if (n < 0)
		return errno == EAGAIN || errno == EPIPE ? -ECONNRESET : -errno;

	for (c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		int *cfd = (int *)CMSG_DATA(c);

		for (size_t i = 0; i < k; i++) {
			if (nfds < MLENS_ATTACH_FDS)
				fds[nfds++] = cfd[i];
			else
				close(cfd[i]);
			err = nfds == MLENS_ATTACH_FDS && i + 1 < k ? -EPROTO : err;
		}
	}

	if (n == 0)
		err = -ECONNRESET;
	else if ((size_t)n != sizeof(*w) || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
		 w->magic != MLENS_WELCOME_MAGIC || w->version != MLENS_PROTO_VERSION)
		err = -EPROTO;
	else if (w->status)
		err = w->status < 0 && w->status > -4096 ? w->status : -EPROTO;
	else if (nfds != MLENS_ATTACH_FDS)
		err = -EPROTO;
	if (err) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		return err;
	}
	return 0;
}

int mlens_open(const char *socket_path, const char *client_name, struct mlens **out)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fds[MLENS_ATTACH_FDS] = { -1, -1, -1 };
	struct mlens_welcome w;
	struct mlens *m;
	struct stat st;
	int err;

	if (!socket_path || !*socket_path || !out)
		return -EINVAL;
	if (strlen(socket_path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	memcpy(sa.sun_path, socket_path, strlen(socket_path) + 1);

	m = calloc(1, sizeof(*m));
	if (!m)
		return -ENOMEM;
	m->efd_in = m->efd_out = -1;
	m->map = MAP_FAILED;
	m->next_id = 1;
	err = doorbell_init(&m->bell);
	if (err)
		goto free_m;
	err = -pthread_mutex_init(&m->sub_lock, NULL);
	if (err)
		goto free_bell;
	err = -pthread_mutex_init(&m->cmpl_lock, NULL);
	if (err)
		goto free_sub;
	err = -pthread_mutex_init(&m->detail_lock, NULL);
	if (err)
		goto free_cmpl;

	m->sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (m->sock < 0) {
		err = -errno;
		goto free_detail;
	}
	if (connect(m->sock, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		err = -errno;
		goto close_sock;
	}
	err = handshake(m->sock, client_name, fds, &w);
	if (err)
		goto close_sock;
	m->efd_in = fds[1];
	m->efd_out = fds[2];
	if ((err = set_nonblock(m->efd_in)) || (err = set_nonblock(m->efd_out)))
		goto close_fds;

	/* The memfd must hold what the welcome says; a short one would fault
	 * (SIGBUS) on first touch instead of failing here. */
	if (fstat(fds[0], &st) < 0) {
		err = -errno;
		goto close_fds;
	}
	if (w.region_size < MLENS_REGION_PAGE || w.region_size % MLENS_REGION_PAGE ||
	    w.region_size > SIZE_MAX || st.st_size < 0 || (uint64_t)st.st_size < w.region_size) {
		err = -EPROTO;
		goto close_fds;
	}
	m->map_size = (size_t)w.region_size;
	m->map = mmap(NULL, m->map_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	if (m->map == MAP_FAILED) {
		err = -errno;
		goto close_fds;
	}
	close(fds[0]);
	fds[0] = -1;
	err = mlens_region_attach(&m->rg, m->map, m->map_size, NULL, 0);
	if (err)
		goto unmap;
	*out = m;
	return 0;

unmap:
	munmap(m->map, m->map_size);
close_fds:
	for (int i = 0; i < MLENS_ATTACH_FDS; i++)
		if (fds[i] >= 0)
			close(fds[i]);
close_sock:
	close(m->sock);
free_detail:
	pthread_mutex_destroy(&m->detail_lock);
free_cmpl:
	pthread_mutex_destroy(&m->cmpl_lock);
free_sub:
	pthread_mutex_destroy(&m->sub_lock);
free_bell:
	doorbell_destroy(&m->bell);
free_m:
	free(m);
	return err;
}

void mlens_close(struct mlens *m)
{
	if (!m)
		return;
	munmap(m->map, m->map_size);
	close(m->efd_in);
	close(m->efd_out);
	close(m->sock);
	pthread_mutex_destroy(&m->detail_lock);
	pthread_mutex_destroy(&m->cmpl_lock);
	pthread_mutex_destroy(&m->sub_lock);
	doorbell_destroy(&m->bell);
	free(m);
}

int mlens_fd(struct mlens *m)
{
	return m ? m->efd_out : -EINVAL;
}

int mlens_limits(struct mlens *m, struct mlens_limits *lim)
{
	struct mlens_limits l;
	size_t n;

	if (!m || !lim || lim->size < offsetof(struct mlens_limits, sub_entries))
		return -EINVAL;
	memset(&l, 0, sizeof(l));
	l.size = sizeof(l);
	l.max_prompt_tokens = m->rg.limits.max_prompt_tokens;
	l.max_tokens = m->rg.limits.max_tokens;
	l.max_context = m->rg.limits.max_context;
	l.vocab_size = m->rg.limits.vocab_size;
	l.sub_entries = m->rg.sub.entries;
	l.cmpl_entries = m->rg.cmpl.entries;
	l.prompt_ring_bytes = m->rg.prompt.ring.entries;
	l.max_running = m->rg.limits.max_running;
	l.max_queued = m->rg.limits.max_queued;
	n = lim->size < sizeof(l) ? lim->size : sizeof(l);
	l.size = lim->size;
	memcpy(lim, &l, n);
	return 0;
}

/* ==== Submitting ==== */

/* The caller's request, whatever size it was compiled with, as this
 * library's struct: bytes past the end of an older struct read as zero;
 * bytes a newer caller set beyond ours must be zero (a field we do not
 * know would otherwise be ignored). */
static int request_copy(const struct mlens_request *req, struct mlens_request *r)
{
	size_t size = req->size;

	if (size < offsetof(struct mlens_request, timeout_ms) + sizeof(r->timeout_ms))
		return -EINVAL;
	memset(r, 0, sizeof(*r));
	memcpy(r, req, size < sizeof(*r) ? size : sizeof(*r));
	for (size_t i = sizeof(*r); i < size; i++)
		if (((const unsigned char *)req)[i])
			return -EINVAL;
	return 0;
}

/* Check a request as the daemon will (the same functions), so that the
 * caller hears of a bad request now rather than in an error event. */
static int request_to_sub(struct mlens *m, const struct mlens_request *r, struct mlens_sub *s)
{
	int err;

	if (!r->prompt || r->n_stop > MLENS_REQ_MAX_STOP || (r->flags & ~REQ_FLAGS_KNOWN))
		return -EINVAL;
	memset(s, 0, sizeof(*s));
	s->op = MLENS_OP_GENERATE;
	s->flags = (uint16_t)r->flags;
	s->n_stop = (uint8_t)r->n_stop;
	s->prompt_off = 0;
	s->prompt_len = r->n_prompt;
	s->max_tokens = r->max_tokens;
	s->temperature = r->temperature;
	s->top_p = r->top_p == 0.0f ? 1.0f : r->top_p;
	s->top_k = r->top_k;
	s->seed = r->seed;
	memcpy(s->stop, r->stop, r->n_stop * sizeof(s->stop[0]));
	err = mlens_sub_validate(s, &m->rg.limits, NULL, 0);
	if (err)
		return err;
	return mlens_prompt_validate(r->prompt, r->n_prompt, &m->rg.limits, NULL, 0);
}

/* Submitting side, sub_lock held: wait until the submission ring has a
 * free slot, or deadline. Only this side fills slots, so the slot stays
 * free until we fill it. */
static int sub_wait_slot(struct mlens *m, int64_t deadline, bool nowait)
{
	int rc;

	for (;;) {
		rc = mlens_ring_free_count(&m->rg.sub);
		if (rc != 0)
			return rc < 0 ? rc : 0;
		uint64_t g = doorbell_gen(m);

		mlens_ring_prod_arm(&m->rg.sub);
		rc = mlens_ring_free_count(&m->rg.sub);
		if (rc != 0) {
			mlens_ring_prod_disarm(&m->rg.sub);
			return rc < 0 ? rc : 0;
		}
		if (is_dead(m)) {
			mlens_ring_prod_disarm(&m->rg.sub);
			return -ECONNRESET;
		}
		if (nowait || ms_left(deadline) == 0) {
			mlens_ring_prod_disarm(&m->rg.sub);
			return nowait ? -EAGAIN : -ETIMEDOUT;
		}
		rc = doorbell_sleep(m, g, deadline);
		mlens_ring_prod_disarm(&m->rg.sub);
		if (rc < 0)
			return rc;
	}
}

/* Submitting side, sub_lock held, a slot free: publish the entry and wake
 * the daemon if it sleeps on an empty submission ring. */
static int sub_publish(struct mlens *m, const struct mlens_sub *s)
{
	int rc = mlens_ring_enqueue_bulk(&m->rg.sub, s, 1);

	if (rc != 1)
		return rc < 0 ? rc : -EPROTO;
	/* mlens_ring_cons_needs_wakeup() has the barrier that pairs with the
	 * daemon's arm: our tail store is ordered before the flag load. */
	if (mlens_ring_cons_needs_wakeup(&m->rg.sub))
		ring_daemon(m);
	return 0;
}

/* Reserve a prompt record of len bytes, waiting until deadline. */
static int prompt_reserve(struct mlens *m, uint32_t len, uint32_t *off, void **ptr,
			  int64_t deadline, bool nowait)
{
	struct mlens_bytering *b = &m->rg.prompt;
	int rc;

	for (;;) {
		rc = mlens_bytering_reserve(b, len, off, ptr);
		if (rc != -EAGAIN)
			return rc;
		uint64_t g = doorbell_gen(m);

		mlens_ring_prod_arm(&b->ring);
		rc = mlens_bytering_reserve(b, len, off, ptr);
		if (rc != -EAGAIN) {
			mlens_ring_prod_disarm(&b->ring);
			return rc;
		}
		if (is_dead(m)) {
			mlens_ring_prod_disarm(&b->ring);
			return -ECONNRESET;
		}
		if (nowait || ms_left(deadline) == 0) {
			mlens_ring_prod_disarm(&b->ring);
			return nowait ? -EAGAIN : -ETIMEDOUT;
		}
		rc = doorbell_sleep(m, g, deadline);
		mlens_ring_prod_disarm(&b->ring);
		if (rc < 0)
			return rc;
	}
}

int mlens_submit(struct mlens *m, const struct mlens_request *req, uint64_t *id)
{
	struct mlens_request r;
	struct mlens_sub s;
	uint32_t off, len;
	int64_t deadline;
	bool nowait;
	void *ptr;
	int err;

	if (!m || !req || !id)
		return -EINVAL;
	err = request_copy(req, &r);
	if (err)
		return err;
	err = request_to_sub(m, &r, &s);
	if (err)
		return err;
	if (is_dead(m))
		return -ECONNRESET;
	nowait = r.timeout_ms == 0;
	deadline = deadline_of(r.timeout_ms);
	len = r.n_prompt * (uint32_t)sizeof(int32_t);	/* <= max_prompt_tokens * 4, checked */

	/* Not waiting means not waiting for a concurrent submit either. */
	if (nowait) {
		if (pthread_mutex_trylock(&m->sub_lock))
			return -EAGAIN;
	} else {
		pthread_mutex_lock(&m->sub_lock);
	}
	/* Prompt first: a submission must name a committed record, and the
	 * daemon releases records in the order of the submissions. */
	err = prompt_reserve(m, len, &off, &ptr, deadline, nowait);
	if (err)
		goto unlock;
	memcpy(ptr, r.prompt, len);
	s.prompt_off = off;
	s.id = m->next_id;
	/* Wait for a slot before committing: a record given up on timeout
	 * can still be taken back while uncommitted. */
	err = sub_wait_slot(m, deadline, nowait);
	if (err) {
		mlens_bytering_abort(&m->rg.prompt);
		goto unlock;
	}
	mlens_bytering_commit(&m->rg.prompt);
	err = sub_publish(m, &s);
	if (err)
		goto unlock;
	*id = m->next_id++;
unlock:
	pthread_mutex_unlock(&m->sub_lock);
	return err;
}

int mlens_cancel(struct mlens *m, uint64_t id)
{
	struct mlens_sub s;
	int err;

	if (!m)
		return -EINVAL;
	memset(&s, 0, sizeof(s));
	s.op = MLENS_OP_CANCEL;
	s.id = id;
	pthread_mutex_lock(&m->sub_lock);
	if (id == 0 || id >= m->next_id)
		err = -EINVAL;	/* never issued here */
	else if (is_dead(m))
		err = -ECONNRESET;
	else if (!(err = sub_wait_slot(m, -1, false)))
		err = sub_publish(m, &s);
	pthread_mutex_unlock(&m->sub_lock);
	return err;
}

/* ==== Reading events ==== */

/* Keep the limit an error completion names; returns its key (never 0). */
static uint32_t detail_keep(struct mlens *m, const struct mlens_cmpl *c)
{
	struct detail *d;
	uint32_t key;

	pthread_mutex_lock(&m->detail_lock);
	if (++m->detail_key == 0)
		m->detail_key = 1;
	key = m->detail_key;
	d = &m->details[key % DETAILS];
	d->key = key;
	d->what = c->detail;
	d->need = c->need;
	d->have = c->have;
	pthread_mutex_unlock(&m->detail_lock);
	return key;
}

/* One completion as the caller sees it. What a conforming daemon never
 * writes (unknown finish, LAST without a reason, a positive status) ends
 * the request as an error with -EPROTO rather than reaching the caller. */
static void event_of(struct mlens *m, const struct mlens_cmpl *c, struct mlens_event *e)
{
	memset(e, 0, sizeof(*e));
	e->id = c->id;
	if (c->flags & MLENS_CMPL_FIRST)
		e->flags |= MLENS_EV_FIRST;
	if (c->flags & MLENS_CMPL_TOKEN) {
		e->flags |= MLENS_EV_TOKEN;
		e->token = c->token;
		if (c->flags & MLENS_CMPL_LOGPROB) {
			e->flags |= MLENS_EV_LOGPROB;
			e->logprob = c->logprob;
		}
	}
	if (!(c->flags & MLENS_CMPL_LAST))
		return;
	e->flags |= MLENS_EV_LAST;
	switch (c->finish) {
	case MLENS_FINISH_LENGTH:
		e->finish = MLENS_REASON_LENGTH;
		break;
	case MLENS_FINISH_STOP:
		e->finish = MLENS_REASON_STOP;
		break;
	case MLENS_FINISH_CANCELLED:
		e->finish = MLENS_REASON_CANCELLED;
		break;
	case MLENS_FINISH_ERROR:
		e->finish = MLENS_REASON_ERROR;
		e->status = c->status < 0 && c->status > -4096 ? c->status : -EPROTO;
		if (c->detail && c->detail <= MLENS_DETAIL_MAX && e->status == c->status)
			e->detail = detail_keep(m, c);
		break;
	default:
		e->finish = MLENS_REASON_ERROR;
		e->status = -EPROTO;
		break;
	}
}

/* Reading side, cmpl_lock held: take up to max events; wake the daemon if
 * it waits for room in the completion ring. */
static int take(struct mlens *m, struct mlens_event *evs, int max)
{
	struct mlens_cmpl c[CMPL_BATCH];
	int got = 0, n;

	while (got < max) {
		int want = max - got < CMPL_BATCH ? max - got : CMPL_BATCH;

		n = mlens_ring_dequeue_burst(&m->rg.cmpl, c, (uint32_t)want);
		if (n < 0)
			return got ? got : n;
		for (int i = 0; i < n; i++)
			event_of(m, &c[i], &evs[got + i]);
		got += n;
		if (n < want)
			break;
	}
	/* mlens_ring_prod_needs_wakeup() has the barrier that pairs with the
	 * daemon's arm: our head store is ordered before the flag load. */
	if (got && mlens_ring_prod_needs_wakeup(&m->rg.cmpl))
		ring_daemon(m);
	return got;
}

static int events_get(struct mlens *m, struct mlens_event *evs, int max, int timeout_ms)
{
	int64_t deadline = deadline_of(timeout_ms);
	int n, err;

	if (!m || !evs || max <= 0)
		return -EINVAL;
	/* Never wait, not even for a concurrent mlens_wait: it is taking
	 * the events itself. */
	if (timeout_ms == 0) {
		if (pthread_mutex_trylock(&m->cmpl_lock))
			return 0;
	} else {
		pthread_mutex_lock(&m->cmpl_lock);
	}
	for (;;) {
		n = take(m, evs, max);
		if (n != 0)
			break;
		uint64_t g = doorbell_gen(m);

		/* Left armed when we return 0, so that the daemon rings
		 * mlens_fd() for the next event. */
		mlens_ring_cons_arm(&m->rg.cmpl);
		n = take(m, evs, max);
		if (n != 0)
			break;
		if (timeout_ms == 0 || ms_left(deadline) == 0) {
			doorbell_drain(m);
			n = socket_hung_up(m) ? -ECONNRESET : 0;
			/* an event may have come before the hang-up */
			if (n < 0 && (err = take(m, evs, max)) != 0)
				n = err;
			goto out;
		}
		if (is_dead(m)) {
			n = -ECONNRESET;
			goto out;
		}
		err = doorbell_sleep(m, g, deadline);
		if (err < 0) {
			n = err;
			goto out;
		}
	}
	mlens_ring_cons_disarm(&m->rg.cmpl);
out:
	pthread_mutex_unlock(&m->cmpl_lock);
	return n;
}

int mlens_poll(struct mlens *m, struct mlens_event *evs, int max)
{
	return events_get(m, evs, max, 0);
}

int mlens_wait(struct mlens *m, struct mlens_event *evs, int max, int timeout_ms)
{
	return events_get(m, evs, max, timeout_ms);
}

/* ==== Errors ==== */

const char *mlens_strerror(int err)
{
	static __thread char buf[128];

	if (err < 0)
		err = -err;
	switch (err) {
	case 0:
		return "success";
	case EINVAL:
		return "invalid argument: a request field or parameter is out of range "
		       "(see mlens_submit(3))";
	case E2BIG:
		return "request above the daemon's limits (prompt length, max_tokens or "
		       "context): see mlens_limits(3)";
	case ERANGE:
		return "a prompt token id is outside the model's vocabulary";
	case ECONNRESET:
	case EPIPE:
		return "mlensd closed the connection (stopped or restarted): open a new one";
	case ECONNREFUSED:
	case ENOENT:
		return "no mlensd listening on this socket path: is the daemon running, "
		       "and is the path right?";
	case EACCES:
		return "mlensd does not allow this user or group to attach (its access rules)";
	case EUSERS:
		return "mlensd has as many tenants attached as it allows: try again later";
	case EPROTO:
		return "protocol mismatch between libmlens and mlensd: update one of them";
	case EAGAIN:
		return "no room in the request rings now: read events, then submit again";
	case ETIMEDOUT:
		return "timed out waiting for mlensd";
	case EDQUOT:
		return "this tenant's quota in mlensd is full (requests queued or KV memory): "
		       "submit fewer at a time";
	case ESHUTDOWN:
		return "mlensd is shutting down and takes no new requests";
	case ECANCELED:
		return "the request was cancelled";
	case EEXIST:
		return "a request with this id is still running in mlensd";
	case EFAULT:
		return "the prompt was not where the request said in the prompt ring "
		       "(a libmlens or mlensd bug)";
	default:
		return strerror_r(err, buf, sizeof(buf));
	}
}

/* What each detail of shm/proto.h says: words, need, words, have, words. */
static const char *const detail_words[MLENS_DETAIL_MAX + 1][3] = {
	[MLENS_DETAIL_KV_POOL] = { "prompt + max_tokens need ", " KV blocks; mlensd's KV pool has ",
				   ": shorten them, or give mlensd a larger kv_cache" },
	[MLENS_DETAIL_KV_QUOTA] = { "prompt + max_tokens need ", " KV blocks; this tenant's kv_blocks quota is ",
				    " (mlensctl quota): shorten them, or raise the quota" },
	[MLENS_DETAIL_STEP_CAP] = { "a prompt of ", " tokens exceeds mlensd's ",
				    " tokens a step (max_step_tokens): shorten it" },
	[MLENS_DETAIL_CONTEXT] = { "a prompt of ", " tokens leaves no room in the model's ",
				   " positions: shorten it" },
	[MLENS_DETAIL_QUEUED] = { "this would be the tenant's request ", " queued; its queued quota is ",
				  " (mlensctl quota): submit fewer at a time" },
};

const char *mlens_event_strerror(struct mlens *m, const struct mlens_event *ev)
{
	static __thread char buf[256];
	struct detail d = { 0 };

	if (!ev)
		return mlens_strerror(EINVAL);
	if (m && ev->detail) {
		pthread_mutex_lock(&m->detail_lock);
		if (m->details[ev->detail % DETAILS].key == ev->detail)
			d = m->details[ev->detail % DETAILS];
		pthread_mutex_unlock(&m->detail_lock);
	}
	if (d.what == MLENS_DETAIL_NONE || d.what > MLENS_DETAIL_MAX)
		return mlens_strerror(ev->status);
	snprintf(buf, sizeof(buf), "%s%u%s%u%s", detail_words[d.what][0], d.need, detail_words[d.what][1],
		 d.have, detail_words[d.what][2]);
	return buf;
}
