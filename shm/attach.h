/* The attach handshake on the daemon's tenant socket (SOCK_SEQPACKET):
 * the client sends one mlens_hello; the daemon answers with one
 * mlens_welcome. On success (status 0) the welcome carries three file
 * descriptors by SCM_RIGHTS, in this order: the region memfd (sealed
 * against shrink and grow), the eventfd the client writes to wake the
 * daemon, the eventfd the daemon writes to wake the client. On refusal
 * status is -errno (-EACCES: uid/gid not allowed; -EUSERS: tenant limit;
 * -EPROTO: bad hello) and message says why; the daemon then closes. The
 * socket stays open while attached: its hang-up tells the daemon the
 * tenant is gone. */
#ifndef MLENS_SHM_ATTACH_H
#define MLENS_SHM_ATTACH_H

#include <stdint.h>

#define MLENS_HELLO_MAGIC 0x4c4c4548u	/* "HELL" */
#define MLENS_WELCOME_MAGIC 0x434c4557u	/* "WELC" */
#define MLENS_ATTACH_FDS 3

struct mlens_hello {
	uint32_t magic;		/* MLENS_HELLO_MAGIC */
	uint32_t version;	/* MLENS_PROTO_VERSION */
	uint32_t flags;		/* zero */
	uint32_t reserved;	/* zero */
	char name[48];		/* the client's name for logs; NUL-terminated */
};
_Static_assert(sizeof(struct mlens_hello) == 64, "hello is 64 bytes");

struct mlens_welcome {
	uint32_t magic;		/* MLENS_WELCOME_MAGIC */
	uint32_t version;	/* MLENS_PROTO_VERSION */
	int32_t status;		/* 0 or -errno */
	uint32_t tenant_id;	/* the daemon's number for this tenant */
	uint64_t region_size;	/* bytes to map from the memfd */
	char message[176];	/* why, when status != 0; NUL-terminated */
};
_Static_assert(sizeof(struct mlens_welcome) == 200, "welcome is 200 bytes");

#endif
