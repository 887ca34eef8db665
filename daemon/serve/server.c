/* Tenant socket: accept, check credentials, read the hello, make the
 * tenant, send the welcome with the three fds, watch for the hang-up. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include "daemon/ops/listen.h"
#include "daemon/log.h"
#include "daemon/serve/server.h"
#include "daemon/serve/tenant.h"
#include "shm/attach.h"

#define HELLO_TIMEOUT_S 5

/* Connections that have not said hello yet hold a descriptor each and
 * cost the peer nothing: at most this many in all, and per uid. */
#define MAX_PENDING 128
#define MAX_PENDING_PER_UID 32

struct conn {
	struct mlens_server *s;
	int fd;
	struct event *ev;
	uint32_t tenant_id;	/* 0 until attached */
	uid_t uid;
	gid_t gid;
	pid_t pid;
	struct conn *next;
};

struct mlens_server {
	struct event_base *base;
	struct mlens_worker *w;
	struct mlens_server_opts o;
	struct mlens_listener l;
	struct mlens_access access;
	char *users, *groups;
	struct conn *conns;
	int n_attached;
	int n_pending;		/* accepted, no hello yet */
	uint32_t next_id;
};

/* ==== connections ==== */

static struct mlens_log_limit refusal_log = MLENS_LOG_LIMIT_INIT(20, 10.0);

static void conn_free(struct conn *c)
{
	struct conn **pp = &c->s->conns;
	while (*pp && *pp != c)
		pp = &(*pp)->next;
	if (*pp)
		*pp = c->next;
	if (!c->tenant_id)
		c->s->n_pending--;
	if (c->ev)
		event_free(c->ev);
	close(c->fd);
	free(c);
}

static void send_welcome(int fd, int status, uint32_t id, uint64_t size, const int *fds,
			 const char *msg)
{
	struct mlens_welcome wl;
	struct msghdr mh;
	struct iovec iov;
	union {
		char buf[CMSG_SPACE(sizeof(int) * MLENS_ATTACH_FDS)];
		struct cmsghdr align;
	} u;

	memset(&wl, 0, sizeof(wl));
	wl.magic = MLENS_WELCOME_MAGIC;
	wl.version = MLENS_PROTO_VERSION;
	wl.status = status;
	wl.tenant_id = id;
	wl.region_size = size;
	snprintf(wl.message, sizeof(wl.message), "%s", msg ? msg : "");
	memset(&mh, 0, sizeof(mh));
	iov.iov_base = &wl;
	iov.iov_len = sizeof(wl);
	mh.msg_iov = &iov;
	mh.msg_iovlen = 1;
	if (fds) {
		struct cmsghdr *cm;
		memset(&u, 0, sizeof(u));
		mh.msg_control = u.buf;
		mh.msg_controllen = sizeof(u.buf);
		cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int) * MLENS_ATTACH_FDS);
		memcpy(CMSG_DATA(cm), fds, sizeof(int) * MLENS_ATTACH_FDS);
	}
	if (sendmsg(fd, &mh, MSG_NOSIGNAL) < 0)
		log_debug("welcome to fd %d not sent: %s", fd, strerror(errno));
}

/* Answer with the refusal (the caller closes). What the peer sent is read first:
 * closing a Unix socket with unread data resets the peer's end, and the
 * peer would read ECONNRESET instead of the reason. */
static void refuse_fd(int fd, uid_t uid, pid_t pid, int status, const char *msg)
{
	char buf[512];
	for (int i = 0; i < 4 && recv(fd, buf, sizeof(buf), MSG_DONTWAIT) > 0; i++)
		;
	mlens_log_limited(&refusal_log, MLENS_LOG_WARN, "tenant connection from uid %u pid %d refused: %s",
			  (unsigned)uid, (int)pid, msg);
	send_welcome(fd, status, 0, 0, NULL, msg);
	/* a hello that came meanwhile (a peer refused at accept) */
	for (int i = 0; i < 4 && recv(fd, buf, sizeof(buf), MSG_DONTWAIT) > 0; i++)
		;
}

static void refuse(struct conn *c, int status, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static void refuse(struct conn *c, int status, const char *fmt, ...)
{
	char msg[176];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	refuse_fd(c->fd, c->uid, c->pid, status, msg);
	conn_free(c);
}

/* An attached tenant's socket: data is a protocol violation, EOF or an
 * error is the hang-up. Either way the tenant goes. */
static void on_tenant_sock(evutil_socket_t fd, short what, void *arg)
{
	struct conn *c = arg;
	char buf[64];
	ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
	(void)what;
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n > 0)
		log_warn("tenant %u sent data after attaching: disconnected", c->tenant_id);
	mlens_worker_detach(c->s->w, c->tenant_id);
	c->s->n_attached--;
	conn_free(c);
}

static void on_hello(evutil_socket_t fd, short what, void *arg)
{
	struct conn *c = arg;
	struct mlens_server *s = c->s;
	struct mlens_hello h;
	struct mlens_tenant *t = NULL;
	char err[256], shown[4 * sizeof(h.name)];
	ssize_t n;
	int rc;

	if (what & EV_TIMEOUT) {
		refuse(c, -ETIMEDOUT, "no hello within %d s", HELLO_TIMEOUT_S);
		return;
	}
	n = recv(fd, &h, sizeof(h), MSG_DONTWAIT | MSG_TRUNC);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n != (ssize_t)sizeof(h) || h.magic != MLENS_HELLO_MAGIC || h.flags || h.reserved) {
		refuse(c, -EPROTO, "not an mlens hello (%zd bytes)", n);
		return;
	}
	if (h.version != MLENS_PROTO_VERSION) {
		refuse(c, -EPROTO, "protocol version %u; this daemon speaks %u", h.version, MLENS_PROTO_VERSION);
		return;
	}
	if (mlens_tenant_name_check(h.name, sizeof(h.name), err, sizeof(err))) {
		refuse(c, -EINVAL, "client name refused: %s", err);
		return;
	}
	if (s->n_attached >= s->o.max_tenants) {
		refuse(c, -EUSERS, "%d tenants attached: the limit (max_tenants)", s->n_attached);
		return;
	}
	rc = mlens_tenant_create(&t, ++s->next_id, c->uid, c->gid, c->pid, h.name, &s->o.region,
				 &s->o.limits, &s->o.quota, err, sizeof(err));
	if (rc) {
		refuse(c, rc, "%s", err);
		return;
	}
	{
		int fds[MLENS_ATTACH_FDS] = { t->memfd, t->efd_in, t->efd_out };
		send_welcome(c->fd, 0, t->id, t->size, fds, "");
	}
	c->tenant_id = t->id;
	mlens_tenant_hold_conn(t, c->fd);
	s->n_pending--;
	s->n_attached++;
	mlens_name_escape(h.name, shown, sizeof(shown));
	log_info("tenant %u attached: uid %u gid %u pid %d name '%s'", t->id, (unsigned)c->uid,
		 (unsigned)c->gid, (int)c->pid, shown);
	event_free(c->ev);
	c->ev = event_new(s->base, c->fd, EV_READ | EV_PERSIST, on_tenant_sock, c);
	event_add(c->ev, NULL);
	mlens_worker_attach(s->w, t);
}

static int pending_of(const struct mlens_server *s, uid_t uid)
{
	int n = 0;
	for (const struct conn *c = s->conns; c; c = c->next)
		n += !c->tenant_id && c->uid == uid;
	return n;
}

static void on_accept(void *arg, int fd, const struct ucred *cr)
{
	struct mlens_server *s = arg;
	struct timeval tv = { HELLO_TIMEOUT_S, 0 };
	struct conn *c;
	char msg[176];

	/* refused at once: a peer the rules do not allow holds nothing here */
	if (!mlens_access_allowed(&s->access, cr->uid, cr->gid)) {
		snprintf(msg, sizeof(msg), "uid %u / gid %u is not allowed to attach (allow_users, allow_groups)",
			 (unsigned)cr->uid, (unsigned)cr->gid);
		refuse_fd(fd, cr->uid, cr->pid, -EACCES, msg);
		close(fd);
		return;
	}
	if (s->n_pending >= MAX_PENDING || pending_of(s, cr->uid) >= MAX_PENDING_PER_UID) {
		snprintf(msg, sizeof(msg), "too many connections waiting to say hello (%d of uid %u, %d in all; "
			 "limits %d and %d): try again", pending_of(s, cr->uid), (unsigned)cr->uid, s->n_pending,
			 MAX_PENDING_PER_UID, MAX_PENDING);
		refuse_fd(fd, cr->uid, cr->pid, -EAGAIN, msg);
		close(fd);
		return;
	}
	c = calloc(1, sizeof(*c));
	if (!c) {
		close(fd);
		return;
	}
	c->s = s;
	c->fd = fd;
	c->uid = cr->uid;
	c->gid = cr->gid;
	c->pid = cr->pid;
	c->next = s->conns;
	s->conns = c;
	s->n_pending++;
	c->ev = event_new(s->base, fd, EV_READ, on_hello, c);
	if (!c->ev || event_add(c->ev, &tv))
		conn_free(c);
}

int mlens_server_bind(struct mlens_server **out, const char *path, char *err, size_t errlen)
{
	struct mlens_server *s = calloc(1, sizeof(*s));
	int rc;

	if (!s) {
		snprintf(err, errlen, "tenant socket: out of memory");
		return -ENOMEM;
	}
	/* everyone may connect; SO_PEERCRED and the rules decide who attaches */
	rc = mlens_listener_bind(&s->l, path, SOCK_SEQPACKET, 0666, NULL, "tenant socket", err, errlen);
	if (rc) {
		free(s);
		return rc;
	}
	*out = s;
	return 0;
}

int mlens_server_start(struct mlens_server *s, struct event_base *base, struct mlens_worker *w,
		       const struct mlens_server_opts *o, char *err, size_t errlen)
{
	s->base = base;
	s->w = w;
	s->o = *o;
	s->users = strdup(o->allow_users ? o->allow_users : "");
	s->groups = strdup(o->allow_groups ? o->allow_groups : "");
	if (!s->users || !s->groups) {
		snprintf(err, errlen, "tenant socket: out of memory");
		return -ENOMEM;
	}
	s->access.users = s->users;
	s->access.groups = s->groups;
	return mlens_listener_start(&s->l, base, on_accept, s, err, errlen);
}

void mlens_server_stop_listening(struct mlens_server *s)
{
	mlens_listener_close(&s->l);
}

int mlens_server_disconnect(struct mlens_server *s, uint32_t id)
{
	for (struct conn *c = s->conns; c; c = c->next)
		if (c->tenant_id == id) {
			mlens_worker_detach(s->w, id);
			s->n_attached--;
			conn_free(c);
			return 0;
		}
	return -ENOENT;
}

void mlens_server_destroy(struct mlens_server *s)
{
	if (!s)
		return;
	mlens_server_stop_listening(s);
	while (s->conns)
		conn_free(s->conns);
	free(s->users);
	free(s->groups);
	free(s);
}
