/* The fake mlensd: attach handshake, intake of submissions (validated as
 * the daemon does, prompts read and released in order), completions queued
 * privately and posted as the ring has room, and sleeps only through the
 * needs-wake-up handshake, with no timeout, so a lost wake-up on either
 * side shows as a hang. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include "shm/attach.h"
#include "shm/ring.h"
#include "tests/fake_mlensd.h"

/* Completions queued beyond the ring before the fake stops taking
 * submissions (mlensd keeps room to answer what it takes): a client that
 * stops reading stalls its own submitting too. */
#define PEND_MAX 8u

int32_t mlens_fake_token(int32_t sum, uint32_t vocab, uint32_t i)
{
	return (int32_t)(((int64_t)sum + 7 * (int64_t)i) % vocab);
}

float mlens_fake_logprob(uint32_t i)
{
	return -(float)(i + 1) / 8.0f;
}

int mlens_fake_listen(struct mlens_fake *f)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };

	f->lsock = f->sock = f->memfd = f->efd_in = f->efd_out = -1;
	strcpy(f->dir, "/tmp/mlens_fake.XXXXXX");
	if (!mkdtemp(f->dir))
		return -errno;
	snprintf(f->path, sizeof(f->path), "%s/d.sock", f->dir);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f->path);
	f->lsock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (f->lsock < 0 || bind(f->lsock, (struct sockaddr *)&sa, sizeof(sa)) ||
	    listen(f->lsock, 4))
		return -errno;
	return 0;
}

void mlens_fake_release(struct mlens_fake *f)
{
	if (f->map)
		munmap(f->map, f->size);
	f->map = NULL;
	for (int *fd = &f->sock; fd <= &f->efd_out; fd++)
		if (*fd >= 0)
			close(*fd);
	f->sock = f->memfd = f->efd_in = f->efd_out = -1;
}

void mlens_fake_cleanup(struct mlens_fake *f)
{
	mlens_fake_release(f);
	if (f->lsock >= 0)
		close(f->lsock);
	f->lsock = -1;
	unlink(f->path);
	rmdir(f->dir);
}

/* The region and eventfds of a new tenant. */
static int make_region(struct mlens_fake *f)
{
	struct mlens_region_params p = MLENS_REGION_PARAMS_DEFAULT;

	if (f->params.sub_entries)
		p = f->params;
	if (mlens_region_size(&p, &f->size))
		return -EINVAL;
	f->memfd = memfd_create("fake-tenant", MFD_CLOEXEC);
	if (f->memfd < 0 || ftruncate(f->memfd, (off_t)f->size))
		return -errno;
	f->map = mmap(NULL, f->size, PROT_READ | PROT_WRITE, MAP_SHARED, f->memfd, 0);
	if (f->map == MAP_FAILED) {
		f->map = NULL;
		return -errno;
	}
	if (mlens_region_format(&f->rg, f->map, f->size, &p, &f->limits, NULL, 0))
		return -EINVAL;
	f->efd_in = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	f->efd_out = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	return f->efd_in < 0 || f->efd_out < 0 ? -errno : 0;
}

int mlens_fake_accept(struct mlens_fake *f, int32_t status, uint32_t welcome_magic)
{
	struct mlens_hello h;
	struct mlens_welcome w;
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * MLENS_ATTACH_FDS)];
	} ctl;
	struct iovec iov = { .iov_base = &w, .iov_len = sizeof(w) };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
	int err;

	f->ph = f->pt = 0;
	f->n_held = 0;
	f->posted = 0;
	f->sock = accept4(f->lsock, NULL, NULL, SOCK_CLOEXEC);
	if (f->sock < 0)
		return -errno;
	if (recv(f->sock, &h, sizeof(h), 0) != (ssize_t)sizeof(h) ||
	    h.magic != MLENS_HELLO_MAGIC || h.version != MLENS_PROTO_VERSION ||
	    memchr(h.name, 0, sizeof(h.name)) == NULL)
		return -EPROTO;
	memcpy(f->name, h.name, sizeof(f->name));

	memset(&w, 0, sizeof(w));
	w.magic = welcome_magic;
	w.version = MLENS_PROTO_VERSION;
	w.status = status;
	if (status == 0) {
		err = make_region(f);
		if (err)
			return err;
		w.tenant_id = 7;
		w.region_size = f->size;
		msg.msg_control = ctl.buf;
		msg.msg_controllen = sizeof(ctl.buf);
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);

		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * MLENS_ATTACH_FDS);
		memcpy(CMSG_DATA(c), (int[MLENS_ATTACH_FDS]){ f->memfd, f->efd_in, f->efd_out },
		       sizeof(int) * MLENS_ATTACH_FDS);
	} else {
		snprintf(w.message, sizeof(w.message), "refused by the fake daemon");
	}
	if (sendmsg(f->sock, &msg, MSG_NOSIGNAL) != (ssize_t)sizeof(w))
		return -errno;
	return 0;
}

static void push(struct mlens_fake *f, uint64_t id, int32_t token, uint16_t flags,
		 uint8_t finish, int32_t status, float lp)
{
	struct mlens_cmpl c;

	memset(&c, 0, sizeof(c));
	c.id = id;
	c.token = token;
	c.flags = flags;
	c.finish = finish;
	c.status = status;
	c.logprob = lp;
	f->pend[f->pt++ % MLENS_FAKE_PEND] = c;
}

/* Queue the completions of r: all of them, or in hold mode one. */
static void generate(struct mlens_fake *f, struct mlens_fake_req *r)
{
	while (!r->done && r->sent < r->max_tokens) {
		uint32_t i = r->sent++;
		int32_t tok = mlens_fake_token(r->sum, f->rg.limits.vocab_size, i);
		bool stop = false, last;
		uint16_t fl = MLENS_CMPL_TOKEN;

		for (uint32_t k = 0; k < r->n_stop; k++)
			stop |= r->stop[k] == tok;
		last = stop || r->sent == r->max_tokens;
		if (i == 0)
			fl |= MLENS_CMPL_FIRST;
		if (last)
			fl |= MLENS_CMPL_LAST;
		if (r->logprobs)
			fl |= MLENS_CMPL_LOGPROB;
		push(f, r->id, tok, fl, last ? (stop ? MLENS_FINISH_STOP : MLENS_FINISH_LENGTH) : 0,
		     0, r->logprobs ? mlens_fake_logprob(i) : 0.0f);
		r->done = last;
		if (f->hold) {
			if (!last && f->n_held < MLENS_FAKE_HELD)
				f->held[f->n_held++] = *r;
			return;
		}
	}
}

static void cancel(struct mlens_fake *f, uint64_t id)
{
	for (int i = 0; i < f->n_held; i++)
		if (f->held[i].id == id) {
			push(f, id, 0, MLENS_CMPL_LAST, MLENS_FINISH_CANCELLED, 0, 0);
			f->held[i] = f->held[--f->n_held];
			return;
		}
}

/* Take submissions while there is room to answer them. Returns how many. */
static int intake(struct mlens_fake *f)
{
	int32_t prompt[4096];
	struct mlens_sub s;
	int n = 0;

	while (f->pt - f->ph < PEND_MAX && mlens_ring_dequeue_bulk(&f->rg.sub, &s, 1) == 1) {
		struct mlens_fake_req r;

		n++;
		if (mlens_sub_validate(&s, &f->rg.limits, NULL, 0) ||
		    (s.op == MLENS_OP_GENERATE &&
		     (s.prompt_len > sizeof(prompt) / sizeof(prompt[0]) ||
		      s.max_tokens > MLENS_FAKE_PEND - PEND_MAX - 1))) {
			f->n_bad++;
			continue;
		}
		if (s.op == MLENS_OP_CANCEL) {
			cancel(f, s.id);
			continue;
		}
		if (mlens_bytering_read(&f->rg.prompt, s.prompt_off, s.prompt_len * 4, prompt) ||
		    mlens_bytering_release(&f->rg.prompt, s.prompt_off, s.prompt_len * 4)) {
			f->n_bad++;
			continue;
		}
		mlens_ring_wake_prod(&f->rg.prompt.ring, f->efd_out);
		f->n_reqs++;
		memset(&r, 0, sizeof(r));
		r.id = s.id;
		for (uint32_t i = 0; i < s.prompt_len; i++)
			r.sum += prompt[i];
		r.max_tokens = s.max_tokens;
		r.logprobs = s.flags & MLENS_SUB_LOGPROBS;
		r.n_stop = s.n_stop;
		memcpy(r.stop, s.stop, sizeof(r.stop));
		if (prompt[0] == MLENS_FAKE_REFUSE)
			push(f, r.id, 0, MLENS_CMPL_FIRST | MLENS_CMPL_LAST, MLENS_FINISH_ERROR,
			     -EDQUOT, 0);
		else
			generate(f, &r);
	}
	if (n)
		mlens_ring_wake_prod(&f->rg.sub, f->efd_out);
	return n;
}

/* Move queued completions into the ring. Returns how many. */
static int post(struct mlens_fake *f)
{
	int n = 0;

	while (f->ph != f->pt && (!f->post_limit || f->posted < f->post_limit)) {
		if (mlens_ring_enqueue_bulk(&f->rg.cmpl, &f->pend[f->ph % MLENS_FAKE_PEND], 1) != 1)
			break;
		f->ph++;
		f->posted++;
		n++;
	}
	if (n)
		mlens_ring_wake_cons(&f->rg.cmpl, f->efd_out);
	return n;
}

static bool client_gone(struct mlens_fake *f)
{
	struct pollfd p = { .fd = f->sock, .events = POLLRDHUP };

	return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR));
}

int mlens_fake_serve(struct mlens_fake *f)
{
	for (;;) {
		int work = intake(f) + post(f);

		if (f->post_limit && f->posted >= f->post_limit)
			return 0;
		if (work)
			continue;
		if (client_gone(f))
			return 0;
		bool can_take = f->pt - f->ph < PEND_MAX;

		if (can_take)
			mlens_ring_cons_arm(&f->rg.sub);
		if (f->ph != f->pt)
			mlens_ring_prod_arm(&f->rg.cmpl);
		/* after the barriers in the arms: sleep only if still idle */
		if ((!can_take || mlens_ring_count(&f->rg.sub) == 0) &&
		    (f->ph == f->pt || mlens_ring_free_count(&f->rg.cmpl) == 0)) {
			struct pollfd p[2] = { { .fd = f->efd_in, .events = POLLIN },
					       { .fd = f->sock, .events = POLLRDHUP } };
			uint64_t v;

			if (poll(p, 2, -1) < 0 && errno != EINTR)
				return -errno;
			if (read(f->efd_in, &v, sizeof(v)) < 0 && errno != EAGAIN)
				return -errno;
		}
		mlens_ring_cons_disarm(&f->rg.sub);
		mlens_ring_prod_disarm(&f->rg.cmpl);
	}
}
