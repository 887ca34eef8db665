/* The daemon's listening Unix sockets (tenant, control, stats) and who may
 * use them. A socket is bound before the model loads, so that a bad path
 * costs no loading time, and listens once the daemon can answer; it is
 * accepted with the peer's credentials; at exit only the file this process
 * made is removed. Main thread only. */
#ifndef MLENS_LISTEN_H
#define MLENS_LISTEN_H

#include <event2/event.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <sys/types.h>

/* Who may use a socket besides root and the daemon's own uid. */
struct mlens_access {
	const char *users;	/* user names or ids, "*" = anyone; NULL or "" = none */
	const char *groups;	/* group names or ids: their members (primary or supplementary) */
};

/* A connection accepted with its credentials; the callee owns fd. */
typedef void (*mlens_accept_fn)(void *arg, int fd, const struct ucred *cr);

struct mlens_listener {
	const char *what;	/* "tenant socket": names it in messages */
	char *path;
	int fd;			/* -1 when closed */
	int lock_fd;		/* the path's start-up lock (see listen.c) */
	dev_t dev;		/* the socket file this process made */
	ino_t ino;
	bool made;
	struct event *ev, *retry;
	mlens_accept_fn fn;
	void *arg;
};

/* Bind a socket of type (SOCK_STREAM, SOCK_SEQPACKET) at path, mode mode,
 * owned by group when group is non-empty (mode 0660 then). A stale socket
 * file is replaced; a live one, a socket another daemon is starting on,
 * or any other file refused. what names the setting in messages ("tenant
 * socket (socket)"). 0, or -errno with err set and nothing left behind. */
int mlens_listener_bind(struct mlens_listener *l, const char *path, int type, mode_t mode,
			const char *group, const char *what, char *err, size_t errlen);
/* Listen and call fn for each connection from the event loop. Running out
 * of descriptors pauses accepting for a moment instead of spinning. */
int mlens_listener_start(struct mlens_listener *l, struct event_base *base, mlens_accept_fn fn,
			 void *arg, char *err, size_t errlen);
/* Stop accepting, close, and remove the socket file if it is still the
 * one this process made. Safe on a listener never bound, and twice. */
void mlens_listener_close(struct mlens_listener *l);
/* A listener that was never bound (closing it does nothing). */
void mlens_listener_init(struct mlens_listener *l);

/* Is the peer root, the daemon's own uid, or allowed by a? */
bool mlens_access_allowed(const struct mlens_access *a, uid_t uid, gid_t gid);
/* Is gid, or the user uid, a member of group (name or number)? */
bool mlens_group_member(const char *group, uid_t uid, gid_t gid);
/* The gid of group (name or number): 0 or -ENOENT. */
int mlens_group_gid(const char *group, gid_t *gid);

#endif
