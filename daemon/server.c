/* Tenant socket: accept, check credentials, read the hello, make the
 * tenant, send the welcome with the three fds, watch for the hang-up. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdarg.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include "daemon/log.h"
#include "daemon/server.h"
#include "shm/attach.h"

#define HELLO_TIMEOUT_S 5

struct conn {
	struct mlens_server *s;
	int fd;
	struct event *ev;
	uint32_t tenant_id;	/* 0 until attached */
	uid_t uid;
	gid_t gid;
	pid_t pid;
	bool denied;		/* answer the hello with -EACCES */
	struct conn *next;
};

struct mlens_server {
	struct event_base *base;
	struct mlens_worker *w;
	struct mlens_server_opts o;
	char *path;
	char *users, *groups;
	int lfd;
	struct event *lev;
	struct conn *conns;
	int n_attached;
	uint32_t next_id;
};

/* ==== access rules ==== */

static bool in_list(const char *list, unsigned long id, bool user)
{
	char *copy = strdup(list ? list : ""), *save = NULL, *tok;
	bool found = false;
	if (!copy)
		return false;
	for (tok = strtok_r(copy, ", \t", &save); tok && !found; tok = strtok_r(NULL, ", \t", &save)) {
		char *end;
		unsigned long v = strtoul(tok, &end, 10);
		if (!strcmp(tok, "*"))
			found = true;
		else if (*end == 0 && end != tok)
			found = v == id;
		else if (user) {
			struct passwd *pw = getpwnam(tok);
			found = pw && pw->pw_uid == id;
		} else {
			struct group *gr = getgrnam(tok);
			found = gr && gr->gr_gid == id;
		}
	}
	free(copy);
	return found;
}

bool mlens_access_allowed(const char *users, const char *groups, uid_t own_uid, uid_t uid, gid_t gid)
{
	if (uid == 0 || uid == own_uid)
		return true;
	return in_list(users, uid, true) || in_list(groups, gid, false);
}

/* ==== connections ==== */

static void conn_free(struct conn *c)
{
	struct conn **pp = &c->s->conns;
	while (*pp && *pp != c)
		pp = &(*pp)->next;
	if (*pp)
		*pp = c->next;
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

static void refuse(struct conn *c, int status, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static void refuse(struct conn *c, int status, const char *fmt, ...)
{
	char msg[176];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	log_warn("tenant connection from uid %u pid %d refused: %s", (unsigned)c->uid, (int)c->pid, msg);
	send_welcome(c->fd, status, 0, 0, NULL, msg);
	conn_free(c);
}

/* An attached tenant's socket: data is a protocol violation, EOF or an
 * error is the hang-up. Either way the tenant goes. */
static void on_tenant_sock(evutil_socket_t fd, short what, void *arg)
{
	struct conn *c = arg;
	char buf[64];
	ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
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
	char err[256];
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
	h.name[sizeof(h.name) - 1] = 0;
	if (c->denied) {
		refuse(c, -EACCES, "uid %u / gid %u is not allowed to attach (allow_users, allow_groups)",
		       (unsigned)c->uid, (unsigned)c->gid);
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
	s->n_attached++;
	log_info("tenant %u attached: uid %u gid %u pid %d name '%s'", t->id, (unsigned)c->uid,
		 (unsigned)c->gid, (int)c->pid, h.name);
	event_free(c->ev);
	c->ev = event_new(s->base, c->fd, EV_READ | EV_PERSIST, on_tenant_sock, c);
	event_add(c->ev, NULL);
	mlens_worker_attach(s->w, t);
}

static void on_accept(evutil_socket_t lfd, short what, void *arg)
{
	struct mlens_server *s = arg;
	struct ucred cr;
	socklen_t len = sizeof(cr);
	struct timeval tv = { HELLO_TIMEOUT_S, 0 };
	struct conn *c;
	int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);

	if (fd < 0) {
		if (errno != EAGAIN && errno != EINTR)
			log_warn("accept on %s: %s", s->path, strerror(errno));
		return;
	}
	c = calloc(1, sizeof(*c));
	if (!c) {
		close(fd);
		return;
	}
	c->s = s;
	c->fd = fd;
	c->next = s->conns;
	s->conns = c;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len)) {
		refuse(c, -EACCES, "cannot read peer credentials");
		return;
	}
	c->uid = cr.uid;
	c->gid = cr.gid;
	c->pid = cr.pid;
	/* a refusal waits for the hello, so that the client reads it as the
	 * answer rather than meeting a closed socket */
	c->denied = !mlens_access_allowed(s->users, s->groups, geteuid(), cr.uid, cr.gid);
	c->ev = event_new(s->base, fd, EV_READ, on_hello, c);
	event_add(c->ev, &tv);
}

int mlens_server_start(struct mlens_server **out, struct event_base *base,
		       struct mlens_worker *w, const struct mlens_server_opts *o,
		       char *err, size_t errlen)
{
	struct mlens_server *s = calloc(1, sizeof(*s));
	struct sockaddr_un sa;
	int rc;

	if (!s)
		return -ENOMEM;
	s->base = base;
	s->w = w;
	s->o = *o;
	s->lfd = -1;
	s->path = strdup(o->path);
	s->users = strdup(o->allow_users ? o->allow_users : "");
	s->groups = strdup(o->allow_groups ? o->allow_groups : "");
	if (!s->path || !s->users || !s->groups) {
		rc = -ENOMEM;
		goto fail;
	}
	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	if (strlen(o->path) >= sizeof(sa.sun_path)) {
		snprintf(err, errlen, "socket path %s is longer than %zu bytes", o->path, sizeof(sa.sun_path) - 1);
		rc = -ENAMETOOLONG;
		goto fail;
	}
	strcpy(sa.sun_path, o->path);
	s->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (s->lfd < 0) {
		rc = -errno;
		snprintf(err, errlen, "socket: %s", strerror(errno));
		goto fail;
	}
	/* a socket file left by a daemon that died: replace it unless someone listens */
	if (connect(s->lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
		snprintf(err, errlen, "%s: another daemon is listening there", o->path);
		rc = -EADDRINUSE;
		goto fail;
	}
	close(s->lfd);
	s->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	unlink(o->path);
	if (bind(s->lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(s->lfd, 64)) {
		rc = -errno;
		snprintf(err, errlen, "cannot listen on %s: %s", o->path, strerror(errno));
		goto fail;
	}
	/* everyone may connect; SO_PEERCRED and the rules decide who attaches */
	chmod(o->path, 0666);
	s->lev = event_new(base, s->lfd, EV_READ | EV_PERSIST, on_accept, s);
	event_add(s->lev, NULL);
	*out = s;
	return 0;
fail:
	mlens_server_destroy(s);
	return rc;
}

void mlens_server_stop_listening(struct mlens_server *s)
{
	if (s->lev) {
		event_free(s->lev);
		s->lev = NULL;
	}
	if (s->lfd >= 0) {
		close(s->lfd);
		unlink(s->path);
		s->lfd = -1;
	}
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
	free(s->path);
	free(s->users);
	free(s->groups);
	free(s);
}
