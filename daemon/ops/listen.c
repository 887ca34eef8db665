/* Listening Unix sockets: the start-up lock of a path (a lock file beside
 * it), the checks of what is there already, bind now and listen later,
 * accept with SO_PEERCRED and a pause when descriptors run out, and the
 * access rules. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <libgen.h>
#include <limits.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include "daemon/ops/listen.h"
#include "daemon/log.h"

#define LISTEN_BACKLOG 64
#define ACCEPT_PAUSE_MS 250	/* accepting pauses this long when descriptors run out */

/* ==== access rules ==== */

int mlens_group_gid(const char *group, gid_t *gid)
{
	char *end;
	unsigned long v = strtoul(group, &end, 10);
	struct group *gr;
	if (*group && !*end) {
		*gid = (gid_t)v;
		return 0;
	}
	gr = getgrnam(group);
	if (!gr)
		return -ENOENT;
	*gid = gr->gr_gid;
	return 0;
}

bool mlens_group_member(const char *group, uid_t uid, gid_t gid)
{
	gid_t g;
	struct group *gr;
	struct passwd *pw;
	if (!group || !*group || mlens_group_gid(group, &g))
		return false;
	if (gid == g)
		return true;
	/* supplementary membership: SO_PEERCRED carries only the primary gid */
	gr = getgrgid(g);
	pw = getpwuid(uid);
	if (!gr || !pw)
		return false;
	for (char **m = gr->gr_mem; m && *m; m++)
		if (!strcmp(*m, pw->pw_name))
			return true;
	return false;
}

static bool user_in(const char *tok, uid_t uid)
{
	char *end;
	unsigned long v = strtoul(tok, &end, 10);
	struct passwd *pw;
	if (*tok && !*end)
		return v == uid;
	pw = getpwnam(tok);
	return pw && pw->pw_uid == uid;
}

/* Does a comma- or blank-separated list hold "*", or an entry matching? */
static bool list_match(const char *list, uid_t uid, gid_t gid, bool users)
{
	char *copy = strdup(list ? list : ""), *save = NULL, *tok;
	bool found = false;
	if (!copy)
		return false;
	for (tok = strtok_r(copy, ", \t", &save); tok && !found; tok = strtok_r(NULL, ", \t", &save))
		found = !strcmp(tok, "*") || (users ? user_in(tok, uid) : mlens_group_member(tok, uid, gid));
	free(copy);
	return found;
}

bool mlens_access_allowed(const struct mlens_access *a, uid_t uid, gid_t gid)
{
	if (uid == 0 || uid == geteuid())
		return true;
	return a && (list_match(a->users, uid, gid, true) || list_match(a->groups, uid, gid, false));
}

/* ==== the start-up lock ==== */

/* "the directory D does not exist ...": what a failure to create a file
 * beside the socket means. */
static void create_error(char *err, size_t errlen, const char *what, const char *path, int e)
{
	char copy[PATH_MAX];
	snprintf(copy, sizeof(copy), "%s", path);
	snprintf(err, errlen, "%s %s: cannot create it: %s%s%s%s", what, path, strerror(e),
		 e == ENOENT || e == EACCES ? " (the directory " : "", e == ENOENT || e == EACCES ? dirname(copy) : "",
		 e == ENOENT ? " does not exist: create it, writable by the daemon's user)"
		 : e == EACCES ? " is not writable by the daemon's user)" : "");
}

/* Write this process's pid into the lock file (after a fork too): it only
 * makes a second daemon's message name the one holding the path. */
static void lock_note_pid(int fd)
{
	char pid[32];
	int n = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
	if (ftruncate(fd, 0) || pwrite(fd, pid, (size_t)n, 0) != n) {
		/* the message is vaguer then, nothing more */
	}
}

/* PATH.lock beside the socket, locked (flock) from bind to close: a second
 * daemon starting on the same path finds it taken even while the first is
 * still loading (its socket is bound, not listening yet, and would look
 * stale). The kernel drops the lock when the process dies; the directory's
 * permissions keep other users from holding it. The fd, or -errno. */
static int lock_path(const char *path, char *err, size_t errlen, const char *what)
{
	char lp[PATH_MAX], pid[32];
	struct stat a, b;
	int fd, n;

	if ((size_t)snprintf(lp, sizeof(lp), "%s.lock", path) >= sizeof(lp)) {
		snprintf(err, errlen, "%s %s: the path is too long", what, path);
		return -ENAMETOOLONG;
	}
	for (;;) {
		fd = open(lp, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
		if (fd < 0) {
			int e = errno;
			if (e == ENOENT || (e == EACCES && lstat(lp, &a)))
				create_error(err, errlen, what, path, e);
			else
				snprintf(err, errlen, "%s %s: cannot open its lock %s: %s", what, path, lp, strerror(e));
			return -e;
		}
		if (flock(fd, LOCK_EX | LOCK_NB)) {
			int e = errno;
			n = e == EWOULDBLOCK ? (int)pread(fd, pid, sizeof(pid) - 1, 0) : -1;
			close(fd);
			if (e != EWOULDBLOCK) {
				snprintf(err, errlen, "%s %s: cannot lock %s: %s", what, path, lp, strerror(e));
				return -e;
			}
			pid[n > 0 ? n : 0] = 0;
			pid[strcspn(pid, "\n")] = 0;
			if (pid[0])
				snprintf(err, errlen, "%s %s: mlensd pid %s is already serving or starting on it "
					 "(stop it, or give this daemon another path)", what, path, pid);
			else
				snprintf(err, errlen, "%s %s: another mlensd is already serving or starting on it "
					 "(stop it, or give this daemon another path)", what, path);
			return -EADDRINUSE;
		}
		/* the lock of a file its last owner removed meanwhile locks nothing */
		if (!fstat(fd, &a) && !lstat(lp, &b) && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
			break;
		close(fd);
	}
	lock_note_pid(fd);
	return fd;
}

/* Remove PATH.lock if it is still the file fd locks, then unlock. */
static void unlock_path(const char *path, int fd)
{
	char lp[PATH_MAX];
	struct stat a, b;
	if (fd < 0)
		return;
	snprintf(lp, sizeof(lp), "%s.lock", path);
	if (!fstat(fd, &a) && !lstat(lp, &b) && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
		unlink(lp);
	close(fd);
}

/* ==== bind, listen, close ==== */

void mlens_listener_init(struct mlens_listener *l)
{
	memset(l, 0, sizeof(*l));
	l->fd = -1;
	l->lock_fd = -1;
}

static const char *file_kind(mode_t m)
{
	return S_ISREG(m) ? "a regular file" : S_ISDIR(m) ? "a directory" : S_ISLNK(m) ? "a symbolic link"
	       : S_ISFIFO(m) ? "a FIFO" : "a device or other special file";
}

/* What is at the path: nothing, or a stale socket (removed): 0. A live
 * socket or any other file: -EEXIST/-EADDRINUSE with err set. */
static int clear_path(const char *path, const struct sockaddr_un *sa, int type, const char *what,
		      char *err, size_t errlen)
{
	struct stat st;
	int fd, rc;
	if (lstat(path, &st)) {
		int e = errno;
		if (e == ENOENT)
			return 0;
		snprintf(err, errlen, "%s %s: %s", what, path, strerror(e));
		return -e;
	}
	if (!S_ISSOCK(st.st_mode)) {
		snprintf(err, errlen, "%s %s: %s is there, not a socket; mlensd replaces only a stale socket "
			 "file (move it away or give another path)", what, path, file_kind(st.st_mode));
		return -EEXIST;
	}
	/* non-blocking: a live listener with a full backlog answers EAGAIN */
	fd = socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0) {
		int e = errno;
		snprintf(err, errlen, "%s %s: socket: %s", what, path, strerror(e));
		return -e;
	}
	rc = connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) ? errno : 0;
	close(fd);
	if (rc == ECONNREFUSED) {
		/* left by a daemon that died */
		if (unlink(path) && errno != ENOENT) {
			int e = errno;
			snprintf(err, errlen, "%s %s: cannot remove the stale socket file: %s", what, path, strerror(e));
			return -e;
		}
		log_info("%s %s: replaced the stale socket file (nothing listened on it)", what, path);
		return 0;
	}
	if (rc == 0 || rc == EPROTOTYPE || rc == EAGAIN) {
		snprintf(err, errlen, "%s %s: another daemon is listening there (stop it, or give this one "
			 "another path)", what, path);
		return -EADDRINUSE;
	}
	snprintf(err, errlen, "%s %s: a socket file is there and cannot be probed: %s", what, path, strerror(rc));
	return -rc;
}

int mlens_listener_bind(struct mlens_listener *l, const char *path, int type, mode_t mode,
			const char *group, const char *what, char *err, size_t errlen)
{
	struct sockaddr_un sa;
	struct stat st;
	gid_t gid = 0;
	mode_t old;
	int rc;

	mlens_listener_init(l);
	l->what = what;
	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	if (strlen(path) >= sizeof(sa.sun_path)) {
		snprintf(err, errlen, "%s %s: the path is longer than %zu bytes", what, path, sizeof(sa.sun_path) - 1);
		return -ENAMETOOLONG;
	}
	strcpy(sa.sun_path, path);
	if (group && *group && mlens_group_gid(group, &gid)) {
		snprintf(err, errlen, "%s %s: group '%s' does not exist (control_group)", what, path, group);
		return -ENOENT;
	}
	if (!(l->path = strdup(path))) {
		snprintf(err, errlen, "%s: out of memory", what);
		return -ENOMEM;
	}
	l->lock_fd = lock_path(path, err, errlen, what);
	if (l->lock_fd < 0) {
		rc = l->lock_fd;
		goto fail;
	}
	rc = clear_path(path, &sa, type, what, err, errlen);
	if (rc)
		goto fail;
	l->fd = socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (l->fd < 0) {
		rc = -errno;
		snprintf(err, errlen, "%s: socket: %s", what, strerror(-rc));
		goto fail;
	}
	/* created with its final mode or a narrower one: no window in which
	 * others may connect */
	old = umask(0177);
	rc = bind(l->fd, (struct sockaddr *)&sa, sizeof(sa)) ? -errno : 0;
	umask(old);
	if (rc) {
		create_error(err, errlen, what, path, -rc);
		goto fail;
	}
	if (!lstat(path, &st)) {
		l->dev = st.st_dev;
		l->ino = st.st_ino;
		l->made = true;
	}
	if (group && *group && chown(path, (uid_t)-1, gid)) {
		rc = -errno;
		snprintf(err, errlen, "%s %s: cannot give it to group %s: %s", what, path, group, strerror(-rc));
		goto fail;
	}
	if (chmod(path, group && *group ? 0660 : mode)) {
		rc = -errno;
		snprintf(err, errlen, "%s %s: cannot set its mode: %s", what, path, strerror(-rc));
		goto fail;
	}
	return 0;
fail:
	mlens_listener_close(l);
	return rc;
}

static void on_retry(evutil_socket_t fd, short what, void *arg)
{
	struct mlens_listener *l = arg;
	(void)fd;
	(void)what;
	event_add(l->ev, NULL);
}

static void on_listen(evutil_socket_t lfd, short what, void *arg)
{
	static struct mlens_log_limit lim = MLENS_LOG_LIMIT_INIT(5, 10.0);
	struct mlens_listener *l = arg;
	struct ucred cr;
	socklen_t cl = sizeof(cr);
	int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
	(void)what;
	if (fd < 0) {
		int e = errno;
		if (e == EAGAIN || e == EINTR || e == ECONNABORTED)
			return;
		if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
			/* the pending connection stays queued: accepting again at
			 * once would fail again, as fast as the loop turns */
			struct timeval tv = { 0, ACCEPT_PAUSE_MS * 1000 };
			event_del(l->ev);
			event_add(l->retry, &tv);
		}
		mlens_log_limited(&lim, MLENS_LOG_WARN, "%s %s: accept: %s%s", l->what, l->path, strerror(e),
				  e == EMFILE || e == ENFILE ? " (out of file descriptors: accepting pauses; "
				  "raise LimitNOFILE or see who holds connections)" : "");
		return;
	}
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl)) {
		close(fd);
		return;
	}
	l->fn(l->arg, fd, &cr);
}

int mlens_listener_start(struct mlens_listener *l, struct event_base *base, mlens_accept_fn fn,
			 void *arg, char *err, size_t errlen)
{
	l->fn = fn;
	l->arg = arg;
	lock_note_pid(l->lock_fd);	/* the daemon forked since the bind */
	if (listen(l->fd, LISTEN_BACKLOG)) {
		int e = errno;
		snprintf(err, errlen, "%s %s: listen: %s", l->what, l->path, strerror(e));
		return -e;
	}
	l->ev = event_new(base, l->fd, EV_READ | EV_PERSIST, on_listen, l);
	l->retry = evtimer_new(base, on_retry, l);
	if (!l->ev || !l->retry || event_add(l->ev, NULL)) {
		snprintf(err, errlen, "%s: out of memory", l->what);
		return -ENOMEM;
	}
	return 0;
}

void mlens_listener_close(struct mlens_listener *l)
{
	struct stat st;
	if (l->ev)
		event_free(l->ev);
	if (l->retry)
		event_free(l->retry);
	l->ev = l->retry = NULL;
	if (l->fd >= 0)
		close(l->fd);
	l->fd = -1;
	/* only the file this process made: another daemon's may be there now */
	if (l->made && !lstat(l->path, &st) && S_ISSOCK(st.st_mode) && st.st_dev == l->dev && st.st_ino == l->ino)
		unlink(l->path);
	l->made = false;
	if (l->path)
		unlock_path(l->path, l->lock_fd);
	l->lock_fd = -1;
	free(l->path);
	l->path = NULL;
}
