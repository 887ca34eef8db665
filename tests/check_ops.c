/* Description: the operating pieces that stand between the daemon and its
 * local users. Tenant names: printable UTF-8 passes, control and bidi
 * characters, bad or overlong UTF-8 and an unterminated name are refused
 * with the byte named, a character cut by the client at the end is
 * dropped; escaping leaves nothing unprintable, and a tenant's JSON shows
 * a bad name escaped rather than leave the tenant out. The log: a line that
 * repeats is written once and then counted, a call site's rate limit
 * passes its burst and reports the suppressed count. Access rules: root
 * and the own uid always, "*", names and ids. Listening sockets: a regular
 * file or a directory in the way is refused and kept, a stale socket is
 * replaced, a second bind on the same path is refused while the first
 * holds it, and closing removes only the file this listener made. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include "daemon/ops/listen.h"
#include "daemon/log.h"
#include "daemon/ops/stats.h"
#include "daemon/serve/tenant.h"

static char dir[] = "/tmp/check_ops.XXXXXX";

static void setup(void)
{
	ck_assert_ptr_nonnull(mkdtemp(dir));
}

static void teardown(void)
{
	char cmd[64];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	ck_assert_int_eq(system(cmd), 0);
	strcpy(dir, "/tmp/check_ops.XXXXXX");
}

static int name_check(const char *in, char *why)
{
	char buf[48];
	memset(buf, 0, sizeof(buf));
	memcpy(buf, in, strnlen(in, sizeof(buf)));
	return mlens_tenant_name_check(buf, sizeof(buf), why, 256);
}

START_TEST(names)
{
	char why[256], buf[48], out[200];
	ck_assert_int_eq(name_check("batch-7", why), 0);
	ck_assert_int_eq(name_check("", why), 0);
	ck_assert_int_eq(name_check("caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x98\x80", why), 0);
	ck_assert_int_eq(name_check("x\x1b[31m", why), -EINVAL);
	ck_assert_str_eq(why, "the name holds a control character (U+001B at byte 1): give a printable name");
	ck_assert_int_eq(name_check("a\nb", why), -EINVAL);
	ck_assert_int_eq(name_check("a\x7f", why), -EINVAL);
	ck_assert_int_eq(name_check("a\xc2\x9b", why), -EINVAL);		/* C1 CSI */
	ck_assert_int_eq(name_check("ab\xe2\x80\xae" "cba", why), -EINVAL);	/* right-to-left override */
	ck_assert_str_eq(why, "the name holds a control character (U+202E at byte 2): give a printable name");
	ck_assert_int_eq(name_check("ab\xff", why), -EINVAL);
	ck_assert_str_eq(why, "the name is not valid UTF-8 (byte 2 is 0xff)");
	ck_assert_int_eq(name_check("\xc0\xaf", why), -EINVAL);		/* overlong '/' */
	ck_assert_int_eq(name_check("\xed\xa0\x80", why), -EINVAL);		/* a surrogate */
	ck_assert_int_eq(name_check("a\xc3", why), -EINVAL);			/* cut, but not at the end of the buffer */
	/* 46 bytes, then the first of a two-byte character: the client's cut */
	memset(buf, 'a', 46);
	buf[46] = (char)0xc3;
	buf[47] = 0;
	ck_assert_int_eq(mlens_tenant_name_check(buf, sizeof(buf), why, sizeof(why)), 0);
	ck_assert_uint_eq(strlen(buf), 46);
	/* no terminator within the buffer */
	memset(buf, 'a', sizeof(buf));
	ck_assert_int_eq(mlens_tenant_name_check(buf, sizeof(buf), why, sizeof(why)), -EINVAL);
	ck_assert_str_eq(why, "the name does not end within 48 bytes");

	mlens_name_escape("ok \xc3\xa9", out, sizeof(out));
	ck_assert_str_eq(out, "ok \xc3\xa9");
	mlens_name_escape("x\x1b[2J\nz\\\xff", out, sizeof(out));
	ck_assert_str_eq(out, "x\\x1b[2J\\x0az\\\\\\xff");
	mlens_name_escape("\x1b\x1b\x1b\x1b", out, 8);	/* cut at a whole escape */
	ck_assert_str_eq(out, "\\x1b");
}
END_TEST

/* A name that is not UTF-8 (one from before the check, or a bug) still
 * shows, escaped: the tenant is never left out of the JSON. */
START_TEST(tenant_json_escapes)
{
	struct mlens_tenant_info t;
	json_t *a = json_array(), *o;
	memset(&t, 0, sizeof(t));
	t.id = 7;
	t.pid = 4711;
	snprintf(t.name, sizeof(t.name), "ab\xff\x1b[2J");
	ck_assert_int_eq(mlens_tenant_json_append(a, &t), 0);
	ck_assert_uint_eq(json_array_size(a), 1);
	o = json_array_get(a, 0);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "id")), 7);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "pid")), 4711);
	ck_assert_str_eq(json_string_value(json_object_get(o, "name")), "ab\\xff\\x1b[2J");
	json_decref(a);
}
END_TEST

static int count_lines(const char *path, const char *needle)
{
	char line[4096];
	FILE *f = fopen(path, "r");
	int n = 0;
	ck_assert_ptr_nonnull(f);
	while (fgets(line, sizeof(line), f))
		n += strstr(line, needle) != NULL;
	fclose(f);
	return n;
}

START_TEST(log_limits)
{
	static struct mlens_log_limit lim = MLENS_LOG_LIMIT_INIT(3, 3600.0);
	char path[128];
	snprintf(path, sizeof(path), "%s/log", dir);
	ck_assert_int_eq(mlens_log_open(path, MLENS_LOG_INFO), 0);
	for (int i = 0; i < 1000; i++)
		log_warn("accept: Too many open files");
	log_info("something else");
	for (int i = 0; i < 50; i++)
		mlens_log_limited(&lim, MLENS_LOG_WARN, "refused pid %d", i);
	mlens_log_close();
	ck_assert_int_eq(count_lines(path, "accept: Too many open files"), 1);
	ck_assert_int_eq(count_lines(path, "last message repeated 999 times"), 1);
	ck_assert_int_eq(count_lines(path, "something else"), 1);
	ck_assert_int_eq(count_lines(path, "refused pid"), 3);
	ck_assert_int_eq(count_lines(path, "refused pid 2"), 1);
	/* a new interval reports what the last one suppressed */
	lim.start -= 7200;
	ck_assert_int_eq(mlens_log_open(path, MLENS_LOG_INFO), 0);
	mlens_log_limited(&lim, MLENS_LOG_WARN, "refused pid %d", 99);
	mlens_log_close();
	ck_assert_int_eq(count_lines(path, "refused pid 99 (47 similar messages suppressed before this one)"), 1);
}
END_TEST

START_TEST(access_rules)
{
	struct mlens_access none = { "", "" }, any = { "*", "" }, ids = { "1234, 99", "" }, grp = { "", "4321" };
	ck_assert(mlens_access_allowed(&none, 0, 0));
	ck_assert(mlens_access_allowed(&none, geteuid(), 12345));
	ck_assert(mlens_access_allowed(NULL, geteuid(), 12345));
	if (geteuid() != 54321)
		ck_assert(!mlens_access_allowed(&none, 54321, 54321));
	ck_assert(mlens_access_allowed(&any, 54321, 54321));
	ck_assert(mlens_access_allowed(&ids, 99, 54321));
	ck_assert(!mlens_access_allowed(&ids, 999, 54321));
	ck_assert(mlens_access_allowed(&grp, 54321, 4321));
	ck_assert(!mlens_access_allowed(&grp, 54321, 4322));
}
END_TEST

START_TEST(listeners)
{
	struct mlens_listener a, b;
	char path[100], other[128], err[512], expect[512];
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct stat st;
	FILE *f;
	int fd;

	snprintf(path, sizeof(path), "%s/s.sock", dir);
	/* a regular file: refused, kept */
	f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	fputs("precious\n", f);
	fclose(f);
	ck_assert_int_eq(mlens_listener_bind(&a, path, SOCK_STREAM, 0600, NULL, "stats socket", err, sizeof(err)),
			 -EEXIST);
	snprintf(expect, sizeof(expect), "stats socket %s: a regular file is there, not a socket; mlensd "
		 "replaces only a stale socket file (move it away or give another path)", path);
	ck_assert_str_eq(err, expect);
	ck_assert_int_eq(stat(path, &st), 0);
	ck_assert(S_ISREG(st.st_mode) && st.st_size == 9);
	unlink(path);
	/* a directory: refused */
	ck_assert_int_eq(mkdir(path, 0700), 0);
	ck_assert_int_eq(mlens_listener_bind(&a, path, SOCK_STREAM, 0600, NULL, "stats socket", err, sizeof(err)),
			 -EEXIST);
	ck_assert_ptr_nonnull(strstr(err, "a directory is there"));
	rmdir(path);
	/* a stale socket: replaced, created with the mode asked */
	fd = socket(AF_UNIX, SOCK_STREAM, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	close(fd);
	ck_assert_int_eq(mlens_listener_bind(&a, path, SOCK_STREAM, 0600, NULL, "stats socket", err, sizeof(err)), 0);
	ck_assert_int_eq(stat(path, &st), 0);
	ck_assert(S_ISSOCK(st.st_mode));
	ck_assert_int_eq(st.st_mode & 0777, 0600);
	/* bound, not listening yet: a second bind is refused all the same,
	 * and does not remove the first one's file */
	ck_assert_int_eq(mlens_listener_bind(&b, path, SOCK_STREAM, 0600, NULL, "stats socket", err, sizeof(err)),
			 -EADDRINUSE);
	snprintf(expect, sizeof(expect), "mlensd pid %d is already serving or starting on it", (int)getpid());
	ck_assert_ptr_nonnull(strstr(err, expect));
	ck_assert_int_eq(access(path, F_OK), 0);
	mlens_listener_close(&b);	/* harmless on a listener that failed */
	ck_assert_int_eq(access(path, F_OK), 0);
	/* another file put at the path meanwhile is not ours to remove */
	snprintf(other, sizeof(other), "%s/o.sock", dir);
	ck_assert_int_eq(rename(path, other), 0);
	f = fopen(path, "w");
	fclose(f);
	mlens_listener_close(&a);
	ck_assert_int_eq(access(path, F_OK), 0);
	ck_assert_int_eq(access(other, F_OK), 0);
	unlink(path);
	unlink(other);
	/* the lock went with the close: the path may be bound again, and the
	 * listener removes its own file */
	ck_assert_int_eq(mlens_listener_bind(&a, path, SOCK_SEQPACKET, 0666, NULL, "tenant socket", err, sizeof(err)), 0);
	ck_assert_int_eq(stat(path, &st), 0);
	ck_assert_int_eq(st.st_mode & 0777, 0666);
	mlens_listener_close(&a);
	ck_assert_int_eq(access(path, F_OK), -1);
	/* a missing directory names it */
	snprintf(other, sizeof(other), "%s/none/s.sock", dir);
	ck_assert_int_eq(mlens_listener_bind(&a, other, SOCK_STREAM, 0600, NULL, "control socket", err, sizeof(err)),
			 -ENOENT);
	snprintf(expect, sizeof(expect), "control socket %s: cannot create it: No such file or directory (the "
		 "directory %s/none does not exist: create it, writable by the daemon's user)", other, dir);
	ck_assert_str_eq(err, expect);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("ops");
	TCase *tc = tcase_create("ops");
	SRunner *r;
	int failed;
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, names);
	tcase_add_test(tc, tenant_json_escapes);
	tcase_add_test(tc, log_limits);
	tcase_add_test(tc, access_rules);
	tcase_add_test(tc, listeners);
	suite_add_tcase(s, tc);
	r = srunner_create(s);
	srunner_run_all(r, CK_NORMAL);
	failed = srunner_ntests_failed(r);
	srunner_free(r);
	return failed ? 1 : 0;
}
