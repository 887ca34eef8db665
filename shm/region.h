/* A tenant region: one block of shared memory (a memfd the daemon creates)
 * holding a header and three rings: submissions (client -> daemon),
 * completions (daemon -> client) and prompt bytes (client -> daemon). The
 * daemon lays it out; the client attaches and checks every byte it reads. */
#ifndef MLENS_SHM_REGION_H
#define MLENS_SHM_REGION_H

#include <stddef.h>
#include <stdint.h>
#include "shm/proto.h"
#include "shm/ring.h"

#define MLENS_REGION_MAGIC 0x534e4c4du	/* "MLNS" in little-endian bytes */
/* Rings start on cache lines; the whole region is a whole number of pages. */
#define MLENS_REGION_RING_ALIGN MLENS_CACHELINE
#define MLENS_REGION_PAGE 4096u

/* ==== Shared layout ==== */

/* Where one ring lies in the region. */
struct mlens_region_ringdesc {
	uint64_t offset;	/* from the region's start, MLENS_REGION_RING_ALIGN-aligned */
	uint64_t size;		/* bytes: mlens_ring_memsize(entries, esize) */
	uint32_t entries;	/* power of two (bytes for the prompt ring) */
	uint32_t esize;		/* sizeof(struct mlens_sub), sizeof(struct mlens_cmpl), 1 */
};
_Static_assert(sizeof(struct mlens_region_ringdesc) == 24, "ring descriptor is 24 bytes");

/* The header at offset 0, 256 bytes. */
struct mlens_region_hdr {
	uint32_t magic;		/* MLENS_REGION_MAGIC */
	uint32_t version;	/* MLENS_PROTO_VERSION */
	uint32_t hdr_size;	/* sizeof(struct mlens_region_hdr) */
	uint32_t flags;		/* zero: no optional features yet */
	uint64_t total_size;	/* bytes of the region, a multiple of MLENS_REGION_PAGE */
	struct mlens_region_ringdesc sub;
	struct mlens_region_ringdesc cmpl;
	struct mlens_region_ringdesc prompt;
	struct mlens_region_limits limits;
	uint64_t reserved[16];	/* zero */
};
_Static_assert(sizeof(struct mlens_region_hdr) == 256, "region header is 256 bytes");
_Static_assert(offsetof(struct mlens_region_hdr, sub) == 24, "region header layout");
_Static_assert(offsetof(struct mlens_region_hdr, limits) == 96, "region header layout");

/* ==== Sizes ==== */

/* Ring sizes of a region, chosen by the daemon. */
struct mlens_region_params {
	uint32_t sub_entries;	/* power of two */
	uint32_t cmpl_entries;	/* power of two */
	uint32_t prompt_bytes;	/* power of two, >= MLENS_BYTERING_MIN_SIZE */
};
#define MLENS_REGION_SUB_ENTRIES_DEFAULT 1024u
#define MLENS_REGION_CMPL_ENTRIES_DEFAULT 8192u
#define MLENS_REGION_PROMPT_BYTES_DEFAULT (1u << 20)
#define MLENS_REGION_PARAMS_DEFAULT { MLENS_REGION_SUB_ENTRIES_DEFAULT, \
		MLENS_REGION_CMPL_ENTRIES_DEFAULT, MLENS_REGION_PROMPT_BYTES_DEFAULT }

/* ==== Process-private handle ==== */

struct mlens_region {
	void *base;
	size_t size;		/* the region's bytes (header's total_size) */
	size_t map_size;	/* bytes we mapped, for unmap; 0: caller's memory */
	struct mlens_ring sub;		/* client produces, daemon consumes */
	struct mlens_ring cmpl;		/* daemon produces, client consumes */
	struct mlens_bytering prompt;	/* client produces, daemon consumes */
	/* Daemon: the limits it formatted with (trusted). Client: as read
	 * from the header and checked. */
	struct mlens_region_limits limits;
};

/* Bytes a region with these ring sizes needs (a multiple of
 * MLENS_REGION_PAGE). 0 or -EINVAL. */
int mlens_region_size(const struct mlens_region_params *p, size_t *size);

/* Daemon: lay out a region in `mem` (`size` bytes, page-aligned, at least
 * mlens_region_size()): header, empty rings, limits (lim->prompt_bytes is
 * taken from p). Fills the handle from the arguments only. 0 or -EINVAL,
 * with a reason in why (may be NULL). */
int mlens_region_format(struct mlens_region *rg, void *mem, size_t size,
			const struct mlens_region_params *p,
			const struct mlens_region_limits *lim, char *why, size_t why_len);

/* Client: attach to a region another process laid out in `mem` (`size`
 * bytes as mapped), checking the header and each ring: -EPROTO if it is not
 * a region of this protocol (magic, version, header size, flags, entry
 * sizes, reserved bytes), -EINVAL if its geometry is inconsistent (total
 * size, any offset or size out of bounds, misaligned or overlapping, a ring
 * header that disagrees, limits out of range). Never reads outside
 * [mem, mem + size). */
int mlens_region_attach(struct mlens_region *rg, void *mem, size_t size, char *why,
			size_t why_len);

/* ==== memfd ==== */

/* Daemon: create a memfd of the right size (close-on-exec), seal it against
 * shrinking and growing (so a tenant can never make the daemon's accesses
 * fault), map it shared and format it. *fd is the descriptor to pass to the
 * tenant. 0 or -errno, with a reason. */
int mlens_region_create(struct mlens_region *rg, int *fd, const struct mlens_region_params *p,
			const struct mlens_region_limits *lim, char *why, size_t why_len);
/* Client: map the region in memfd `fd` and attach to it. Refuses a memfd
 * that is not sealed against shrinking (-EPERM). Errors as attach, or
 * -errno of fstat/mmap. */
int mlens_region_map(struct mlens_region *rg, int fd, char *why, size_t why_len);
/* Unmap a region mapped by create or map; no-op for caller memory. */
void mlens_region_unmap(struct mlens_region *rg);

/* ==== Submitting and taking requests ====
 *
 * Doorbells: one eventfd rings the daemon, one rings the client. The
 * client rings the daemon's after it enqueues a submission (wake_cons on
 * the submission ring) and after it frees completions (wake_prod on the
 * completion ring); the daemon rings the client's after it enqueues
 * completions (wake_cons on the completion ring) and after it takes
 * submissions (wake_prod on the submission ring and the prompt ring). */

/* Client: write the prompt (s->prompt_len tokens, ignored for CANCEL) into
 * the prompt ring, set s->prompt_off, enqueue s and ring daemon_efd (if >= 0)
 * when the daemon sleeps. Only one thread may submit at a time. Returns 0,
 * -EAGAIN (no room now in the submission or prompt ring: see
 * mlens_region_wait_submit), -EMSGSIZE (prompt longer than
 * limits.max_prompt_tokens), -EPROTO (corrupt ring), or the doorbell's
 * -errno (the request is submitted all the same). */
int mlens_region_submit(struct mlens_region *rg, struct mlens_sub *s, const int32_t *tokens,
			int daemon_efd);
/* Client: wait on client_efd until a request with a prompt of prompt_len
 * tokens (0 for a CANCEL) can be submitted. 1, 0 on timeout, -errno. */
int mlens_region_wait_submit(struct mlens_region *rg, int client_efd, uint32_t prompt_len,
			     int timeout_ms);

/* Daemon: take the next submission, reading it and its prompt out of
 * shared memory once. Returns 0 if there is none, 1 if one was taken, or
 * -EPROTO if the tenant corrupted a ring index (drop the tenant). When 1:
 * *s is the private copy and *status is 0 (valid: tokens[] holds its
 * s->prompt_len prompt tokens) or the mlens_sub_validate() /
 * mlens_prompt_validate() error, with the reason in why, to be sent back as
 * the request's error completion. tokens has room for limits.max_prompt_tokens.
 * The prompt record is released either way when it can be found. Ring the
 * client's doorbell afterwards (see above). */
int mlens_region_take(struct mlens_region *rg, struct mlens_sub *s, int32_t *tokens,
		      int *status, char *why, size_t why_len);

#endif
