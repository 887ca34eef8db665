/* Tenant regions and the trust boundary: every submission is copied out of
 * shared memory once, validated, and only the copy is used. */
#include <errno.h>
#include <stdbool.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>
#include "daemon/log.h"
#include "daemon/serve/tenant.h"

/* The tenant scribbled an impossible index into one of its rings: nothing
 * more is read from it or written to it, and the worker evicts it. Counted
 * once, however often the ring is looked at before that. */
static void tenant_break(struct mlens_tenant *t, const char *ring)
{
	if (t->broken)
		return;
	t->broken = true;
	t->broken_why = ring;
	t->bad_entries++;
}

static int tenant_emit(struct mlens_sched_tenant *st, const struct mlens_event *ev)
{
	struct mlens_tenant *t = (struct mlens_tenant *)st;
	struct mlens_cmpl c;
	int rc;

	if (t->broken)
		return 0;	/* cut off: its events are dropped */
	memset(&c, 0, sizeof(c));
	c.id = ev->id;
	c.status = ev->status;
	c.finish = (uint8_t)(ev->last ? ev->finish : MLENS_FINISH_NONE);
	if (c.finish == MLENS_FINISH_ERROR && ev->detail.what) {
		c.detail = ev->detail.what;
		c.need = ev->detail.need;
		c.have = ev->detail.have;
	}
	if (ev->first)
		c.flags |= MLENS_CMPL_FIRST;
	if (ev->last)
		c.flags |= MLENS_CMPL_LAST;
	if (ev->token >= 0) {
		c.flags |= MLENS_CMPL_TOKEN;
		c.token = ev->token;
		c.logprob = ev->logprob;
		if (ev->has_logprob)
			c.flags |= MLENS_CMPL_LOGPROB;
	}
	rc = mlens_ring_enqueue_bulk(&t->rg.cmpl, &c, 1);
	if (rc == 1) {
		t->kick = true;
		return 0;
	}
	if (rc == 0) {
		/* full: ask the client to ring us when it has read some */
		t->cmpl_full = true;
		mlens_ring_prod_arm(&t->rg.cmpl);
		if (mlens_ring_free_count(&t->rg.cmpl) > 0) {
			mlens_ring_prod_disarm(&t->rg.cmpl);
			if (mlens_ring_enqueue_bulk(&t->rg.cmpl, &c, 1) == 1) {
				t->kick = true;
				return 0;
			}
		}
		return -EAGAIN;
	}
	/* a corrupt consumer index (head past tail, or more than the ring
	 * apart): the tenant broke its own ring */
	tenant_break(t, "completion ring");
	return 0;
}

int mlens_tenant_create(struct mlens_tenant **out, uint32_t id, uid_t uid, gid_t gid, pid_t pid,
			const char *name, const struct mlens_region_params *rp,
			const struct mlens_region_limits *lim, const struct mlens_quota *q,
			char *err, size_t errlen)
{
	struct mlens_tenant *t = calloc(1, sizeof(*t));
	int rc;

	if (!t)
		return -ENOMEM;
	t->memfd = t->efd_in = t->efd_out = t->sock = -1;
	t->id = id;
	t->uid = uid;
	t->gid = gid;
	t->pid = pid;
	snprintf(t->name, sizeof(t->name), "%s", name ? name : "");
	mlens_sched_tenant_init(&t->st, q, tenant_emit);
	t->prompt_cap = lim->max_prompt_tokens;
	t->prompt_buf = malloc((size_t)t->prompt_cap * sizeof(int32_t));
	if (!t->prompt_buf) {
		rc = -ENOMEM;
		goto fail;
	}
	rc = mlens_region_create(&t->rg, &t->memfd, rp, lim, err, errlen);
	if (rc)
		goto fail;
	t->mapped = true;
	t->size = t->rg.size;
	t->efd_in = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	t->efd_out = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (t->efd_in < 0 || t->efd_out < 0) {
		rc = -errno;
		snprintf(err, errlen, "cannot make eventfds: %s", strerror(errno));
		goto fail;
	}
	*out = t;
	return 0;
fail:
	mlens_tenant_destroy(t);
	return rc ? rc : -EINVAL;
}

void mlens_tenant_destroy(struct mlens_tenant *t)
{
	if (!t)
		return;
	if (t->mapped)
		mlens_region_unmap(&t->rg);
	if (t->memfd >= 0)
		close(t->memfd);
	if (t->efd_in >= 0)
		close(t->efd_in);
	if (t->efd_out >= 0)
		close(t->efd_out);
	if (t->sock >= 0)
		close(t->sock);
	free(t->prompt_buf);
	free(t);
}

void mlens_tenant_hold_conn(struct mlens_tenant *t, int sock)
{
	t->sock = fcntl(sock, F_DUPFD_CLOEXEC, 0);
	if (t->sock < 0)
		log_warn("tenant %u: cannot keep its connection (%s): a broken ring will only stop "
			 "its reads", t->id, strerror(errno));
}

void mlens_tenant_hang_up(struct mlens_tenant *t)
{
	if (t->sock >= 0 && shutdown(t->sock, SHUT_RDWR) && errno != ENOTCONN)
		log_warn("tenant %u: cannot hang up: %s", t->id, strerror(errno));
}

/* Tell the client that a request failed before it was queued; detail
 * (may be NULL) names the limit it ran into. */
static void refuse(struct mlens_tenant *t, uint64_t id, int status, const char *why,
		   const struct mlens_detail *detail)
{
	struct mlens_event ev = { .id = id, .token = -1, .first = true, .last = true,
				  .finish = MLENS_FINISH_ERROR, .status = status };
	if (detail)
		ev.detail = *detail;
	log_debug("tenant %u (pid %d): request %llu refused: %s", t->id, (int)t->pid,
		  (unsigned long long)id, why);
	if (tenant_emit(&t->st, &ev))
		log_warn("tenant %u: completion ring full, error for request %llu dropped", t->id,
			 (unsigned long long)id);
}

int mlens_tenant_intake(struct mlens_tenant *t, struct mlens_sched *s, int max)
{
	struct mlens_sub sub;
	char why[256];
	int n = 0, status, rc = 0;

	if (t->broken)
		return 0;
	/* keep room to report an error for what we take */
	while (n < max) {
		int room = mlens_ring_free_count(&t->rg.cmpl);
		if (room < 0)
			tenant_break(t, "completion ring");
		if (room <= 0)
			break;
		rc = mlens_region_take(&t->rg, &sub, t->prompt_buf, &status, why, sizeof(why));
		if (rc <= 0)
			break;
		n++;
		if (status) {
			t->bad_entries++;	/* a malformed entry: an error completion */
			refuse(t, sub.id, status, why, NULL);
			continue;
		}
		if (sub.op == MLENS_OP_CANCEL) {
			mlens_sched_cancel(s, &t->st, sub.id);	/* unknown: it ended already */
			continue;
		}
		if (mlens_sched_live(s, &t->st, sub.id)) {
			t->refused++;
			refuse(t, sub.id, -EEXIST, "a request with this id is still running", NULL);
			continue;
		}
		struct mlens_request_params p;
		memset(&p, 0, sizeof(p));
		p.id = sub.id;
		p.prompt = t->prompt_buf;
		p.n_prompt = (int32_t)sub.prompt_len;
		p.max_tokens = (int32_t)sub.max_tokens;
		p.samp.temperature = sub.temperature;
		p.samp.top_k = sub.top_k;
		p.samp.top_p = sub.top_p;
		p.samp.seed = sub.seed;
		memcpy(p.stop, sub.stop, sizeof(p.stop));
		p.n_stop = sub.n_stop;
		p.logprobs = (sub.flags & MLENS_SUB_LOGPROBS) != 0;
		p.ignore_eos = (sub.flags & MLENS_SUB_IGNORE_EOS) != 0;
		status = mlens_sched_submit(s, &t->st, &p, why, sizeof(why));
		if (status) {
			t->refused++;
			refuse(t, sub.id, status, why, &t->st.refused);
		}
	}
	if (rc < 0)	/* a corrupt index: nothing more can be read from it */
		tenant_break(t, "submission ring");
	if (n && !t->broken) {
		mlens_ring_wake_prod(&t->rg.sub, t->efd_out);
		mlens_ring_wake_prod(&t->rg.prompt.ring, t->efd_out);
	}
	return n;
}

void mlens_tenant_kick(struct mlens_tenant *t)
{
	if (t->kick) {
		t->kick = false;
		mlens_ring_wake_cons(&t->rg.cmpl, t->efd_out);
	}
}

bool mlens_tenant_arm(struct mlens_tenant *t)
{
	int room;

	if (t->broken)
		return false;	/* nothing more is read from it */
	/* Completion room first: without it intake takes nothing, so what
	 * waits in the submission ring is no work. Ask the client to ring
	 * when it frees some (arm, then look again: a read in between is not
	 * missed); its read then wakes us. */
	room = mlens_ring_free_count(&t->rg.cmpl);
	if (room == 0) {
		t->cmpl_full = true;	/* disarm clears the flag with it */
		mlens_ring_prod_arm(&t->rg.cmpl);
		room = mlens_ring_free_count(&t->rg.cmpl);
		if (room == 0)
			return false;
	}
	if (room < 0)
		return true;	/* a corrupt index: intake sees it and cuts it off */
	if (t->cmpl_full)
		return true;	/* room came back: deliver what waited */
	mlens_ring_cons_arm(&t->rg.sub);
	/* entries, or a corrupt index that intake must see and cut off */
	return mlens_ring_count(&t->rg.sub) != 0;
}

void mlens_tenant_disarm(struct mlens_tenant *t)
{
	mlens_ring_cons_disarm(&t->rg.sub);
	if (t->cmpl_full && mlens_ring_free_count(&t->rg.cmpl) > 0) {
		t->cmpl_full = false;
		mlens_ring_prod_disarm(&t->rg.cmpl);
	}
}

/* ==== names ==== */

/* The code point of the UTF-8 sequence at s (n bytes left) and its length,
 * or 0 for an invalid, overlong or cut sequence. */
static int utf8_next(const unsigned char *s, size_t n, uint32_t *cp)
{
	int len = s[0] < 0x80 ? 1 : (s[0] & 0xe0) == 0xc0 ? 2 : (s[0] & 0xf0) == 0xe0 ? 3
		  : (s[0] & 0xf8) == 0xf0 ? 4 : 0;
	uint32_t c;
	if (!len || (size_t)len > n)
		return 0;
	c = len == 1 ? s[0] : s[0] & (0x7f >> len);
	for (int i = 1; i < len; i++) {
		if ((s[i] & 0xc0) != 0x80)
			return 0;
		c = c << 6 | (s[i] & 0x3f);
	}
	if ((len == 2 && c < 0x80) || (len == 3 && c < 0x800) || (len == 4 && c < 0x10000) || c > 0x10ffff ||
	    (c >= 0xd800 && c <= 0xdfff))
		return 0;
	*cp = c;
	return len;
}

/* Control characters (C0, DEL, C1) and the bidirectional formatting ones
 * that reorder what a terminal shows. */
static bool cp_printable(uint32_t c)
{
	return !(c < 0x20 || (c >= 0x7f && c <= 0x9f) || (c >= 0x202a && c <= 0x202e) ||
		 (c >= 0x2066 && c <= 0x2069) || c == 0x2028 || c == 0x2029 || c == 0x200e || c == 0x200f);
}

int mlens_tenant_name_check(char *name, size_t cap, char *why, size_t whylen)
{
	size_t len = strnlen(name, cap), i = 0;
	if (len == cap) {
		snprintf(why, whylen, "the name does not end within %zu bytes", cap);
		return -EINVAL;
	}
	while (i < len) {
		uint32_t c;
		int n = utf8_next((const unsigned char *)name + i, len - i, &c);
		if (!n) {
			bool cut = len == cap - 1 && len - i < 4 && (name[i] & 0xc0) == 0xc0;
			for (size_t j = i + 1; cut && j < len; j++)
				cut = (name[j] & 0xc0) == 0x80;
			if (cut) {
				name[i] = 0;	/* cut by the client inside a character */
				return 0;
			}
			snprintf(why, whylen, "the name is not valid UTF-8 (byte %zu is 0x%02x)", i,
				 (unsigned char)name[i]);
			return -EINVAL;
		}
		if (!cp_printable(c)) {
			snprintf(why, whylen, "the name holds a control character (U+%04X at byte %zu): "
				 "give a printable name", (unsigned)c, i);
			return -EINVAL;
		}
		i += (size_t)n;
	}
	return 0;
}

void mlens_name_escape(const char *name, char *out, size_t outlen)
{
	const unsigned char *s = (const unsigned char *)name;
	size_t len = strlen(name), i = 0, j = 0;
	if (!outlen)
		return;
	while (i < len) {
		uint32_t c;
		int n = utf8_next(s + i, len - i, &c);
		if (n && cp_printable(c) && c != '\\') {
			if (j + (size_t)n >= outlen)
				break;
			memcpy(out + j, s + i, (size_t)n);
			j += (size_t)n;
			i += (size_t)n;
		} else {
			if (j + 4 >= outlen)
				break;
			if (s[i] == '\\') {
				out[j++] = '\\';
				out[j++] = '\\';
			} else {
				j += (size_t)snprintf(out + j, outlen - j, "\\x%02x", s[i]);
			}
			i++;
		}
	}
	out[j] = 0;
}
