/* A fake mlensd for tests and benchmarks of libmlens: the daemon side of
 * the tenant protocol with the real shm code (listening socket, attach
 * handshake, memfd region, eventfd doorbells, needs-wake-up sleeps), and a
 * model that answers each request with tokens computed from its prompt. */
#ifndef MLENS_FAKE_MLENSD_H
#define MLENS_FAKE_MLENSD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "shm/proto.h"
#include "shm/region.h"

#define MLENS_FAKE_PEND 4096	/* completions queued beyond the ring */
#define MLENS_FAKE_HELD 64	/* requests held for cancel */

struct mlens_fake_req {
	uint64_t id;
	int32_t sum;		/* of the prompt: what the tokens follow from */
	uint32_t max_tokens, sent;
	bool logprobs, done;
	int32_t stop[MLENS_MAX_STOP];
	uint32_t n_stop;
};

struct mlens_fake {
	/* Set before mlens_fake_accept (zero: the defaults of the region). */
	struct mlens_region_params params;
	struct mlens_region_limits limits;
	bool hold;		/* one token per request, the rest held until cancelled */
	size_t post_limit;	/* serve returns after posting this many (0: no limit) */
	/* State. */
	char dir[64], path[108];
	int lsock, sock, memfd, efd_in, efd_out;
	void *map;
	size_t size;
	struct mlens_region rg;
	struct mlens_cmpl pend[MLENS_FAKE_PEND];
	size_t ph, pt;
	struct mlens_fake_req held[MLENS_FAKE_HELD];
	int n_held;
	uint64_t n_reqs;	/* GENERATE submissions read */
	uint64_t n_bad;		/* submissions that failed validation */
	uint64_t posted;	/* completions put in the ring */
	char name[48];		/* the client's, from its hello */
};

/* Token i of a request whose prompt sums to sum (the client checks with
 * the same rule), and its log-probability. A prompt whose first token is
 * MLENS_FAKE_REFUSE gets an error event, status -EDQUOT. */
#define MLENS_FAKE_REFUSE 999
int32_t mlens_fake_token(int32_t sum, uint32_t vocab, uint32_t i);
float mlens_fake_logprob(uint32_t i);

/* Listen on a fresh socket under /tmp (f->path). 0 or -errno. */
int mlens_fake_listen(struct mlens_fake *f);
/* Accept one client and answer its hello: with status 0, a region and
 * eventfds; else a refusal. welcome_magic other than MLENS_WELCOME_MAGIC
 * makes a malformed welcome. 0 or -errno. */
int mlens_fake_accept(struct mlens_fake *f, int32_t status, uint32_t welcome_magic);
/* Serve until the client hangs up (or post_limit). 0 or -errno. */
int mlens_fake_serve(struct mlens_fake *f);
/* Drop the client: region, eventfds, socket (what a daemon exit does). */
void mlens_fake_release(struct mlens_fake *f);
/* Release, stop listening and remove the socket and its directory. */
void mlens_fake_cleanup(struct mlens_fake *f);

#endif
