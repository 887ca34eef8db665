/* A tenant as the daemon holds it: its credentials, its shared region
 * (memfd) with the three rings, its two eventfds, and the scheduler's
 * accounting. Created on the main thread at attach, then owned by the
 * worker thread until it is destroyed there. */
#ifndef MLENS_TENANT_H
#define MLENS_TENANT_H

#include <stdint.h>
#include <sys/types.h>
#include "daemon/serve/sched.h"
#include "shm/region.h"

struct mlens_tenant {
	struct mlens_sched_tenant st;	/* first: the emit callback casts back */
	uint32_t id;
	uid_t uid;
	gid_t gid;
	pid_t pid;
	char name[48];
	int memfd;
	bool mapped;
	bool broken;		/* corrupted a ring index: no longer read */
	bool cut_off;		/* broken, and the worker has evicted it */
	const char *broken_why;	/* which ring, for the eviction's log line */
	int sock;		/* a dup of its connection: shut down to evict it */
	size_t size;
	struct mlens_region rg;
	int efd_in;		/* the client writes: work for the daemon */
	int efd_out;		/* the daemon writes: completions for the client */
	bool kick;		/* completions were posted since the last doorbell */
	bool cmpl_full;		/* a completion did not fit: wait for the client */
	uint64_t bad_entries;	/* submissions refused as malformed */
	uint64_t refused;	/* well-formed but refused (limits, quota) */
	int32_t *prompt_buf;	/* private copy of a prompt: max_prompt_tokens */
	uint32_t prompt_cap;
	struct mlens_tenant *next;
};

/* Make the region (memfd sealed against shrink and grow), map it, format
 * it, and make the two eventfds. */
int mlens_tenant_create(struct mlens_tenant **out, uint32_t id, uid_t uid, gid_t gid, pid_t pid,
			const char *name, const struct mlens_region_params *rp,
			const struct mlens_region_limits *lim, const struct mlens_quota *q,
			char *err, size_t errlen);
void mlens_tenant_destroy(struct mlens_tenant *t);
/* Main thread, before handing t over: keep a dup of its connection socket,
 * so that the worker can hang it up (shutdown) when the tenant breaks its
 * rings; the main thread then sees the hang-up and detaches it. */
void mlens_tenant_hold_conn(struct mlens_tenant *t, int sock);
/* Worker thread: hang up a broken tenant's connection (once). */
void mlens_tenant_hang_up(struct mlens_tenant *t);

/* Worker thread: read up to max submissions, validate private copies, and
 * queue or refuse them. Returns the number read. */
int mlens_tenant_intake(struct mlens_tenant *t, struct mlens_sched *s, int max);
/* Worker thread: ring the client's doorbell if completions were posted and
 * it sleeps. */
void mlens_tenant_kick(struct mlens_tenant *t);
/* Worker thread, before sleeping: arm the daemon's wake-up flags; returns
 * true when there is already work (do not sleep). A tenant whose completion
 * ring is full has none, whatever it submitted: the daemon sleeps until it
 * reads completions (its read rings the daemon's doorbell). */
bool mlens_tenant_arm(struct mlens_tenant *t);
void mlens_tenant_disarm(struct mlens_tenant *t);

/* ==== names ==== */

/* A tenant's name as its hello gave it (cap bytes from a peer): it must end
 * within them and be printable UTF-8 (no control or bidirectional-format
 * characters), since logs, terminals and JSON show it. A name that fills
 * the buffer and ends inside a character (the client cut it) loses that
 * character. 0, or -EINVAL with why saying what is wrong. */
int mlens_tenant_name_check(char *name, size_t cap, char *why, size_t whylen);
/* name with each byte that is not printable UTF-8 written as \xNN (and a
 * backslash as \\): safe to print anywhere. out is always terminated. */
void mlens_name_escape(const char *name, char *out, size_t outlen);

#endif
