/* libmlens: the client library of mlensd. A program attaches to the daemon
 * over its Unix socket, then submits generation requests and reads their
 * tokens through rings in shared memory. Errors are negative errno values;
 * mlens_strerror() words them. Thread safety is stated at each function. */
#ifndef MLENS_H
#define MLENS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One connection to mlensd (one tenant). Opaque. */
struct mlens;

/* Most stop tokens a request may name. */
#define MLENS_REQ_MAX_STOP 8

/* Request flags. */
#define MLENS_REQ_LOGPROBS (1u << 0)	/* events carry each token's log-probability */
#define MLENS_REQ_IGNORE_EOS (1u << 1)	/* go on past the model's EOS tokens (stop[] still ends it) */

/* A generation request. Set size to sizeof(struct mlens_request): fields
 * added later go at the end, and a library reading an older, smaller struct
 * treats them as zero. Zero-initialise the rest, then fill what you need. */
struct mlens_request {
	size_t size;			/* sizeof(struct mlens_request) */
	const int32_t *prompt;		/* n_prompt token ids, copied by mlens_submit */
	uint32_t n_prompt;		/* >= 1 */
	uint32_t max_tokens;		/* tokens to generate, >= 1 */
	float temperature;		/* 0: greedy; up to 100 */
	float top_p;			/* (0, 1]; 0 is taken as 1 (no limit) */
	int32_t top_k;			/* 0: no limit; up to the vocabulary size */
	uint32_t flags;			/* MLENS_REQ_* */
	uint64_t seed;			/* sampling seed (temperature > 0) */
	int32_t stop[MLENS_REQ_MAX_STOP];	/* generation ends after one of these */
	uint32_t n_stop;		/* entries used in stop[] */
	/* How long mlens_submit may wait for room in the rings, as poll(2):
	 * -1 as long as it takes, 0 not at all (-EAGAIN), > 0 milliseconds
	 * (-ETIMEDOUT). */
	int32_t timeout_ms;
};

/* What mlens_limits() reports: the daemon's limits for this connection. */
struct mlens_limits {
	size_t size;			/* sizeof(struct mlens_limits), set by the caller */
	uint32_t max_prompt_tokens;	/* per request */
	uint32_t max_tokens;		/* generated per request */
	uint32_t max_context;		/* prompt + generated */
	uint32_t vocab_size;		/* token ids are in [0, vocab_size) */
	uint32_t sub_entries;		/* submissions the ring holds before submit waits */
	uint32_t cmpl_entries;		/* events the ring holds before the daemon waits */
	uint32_t prompt_ring_bytes;	/* prompt tokens in flight, in bytes (4 a token) */
	/* 0 when the daemon does not say: */
	uint32_t max_running;		/* requests of this connection that can run at once */
	uint32_t max_queued;		/* requests it may have waiting beyond those */
	uint32_t reserved;
};

/* Event flags. */
#define MLENS_EV_FIRST (1u << 0)	/* the request's first event */
#define MLENS_EV_LAST (1u << 1)		/* its last: finish says why it ended */
#define MLENS_EV_TOKEN (1u << 2)	/* token holds a generated token */
#define MLENS_EV_LOGPROB (1u << 3)	/* logprob holds its log-probability */

/* Why a request ended (struct mlens_event.finish on its LAST event). */
enum mlens_finish_reason {
	MLENS_REASON_NONE = 0,		/* not the last event */
	MLENS_REASON_LENGTH = 1,	/* max_tokens generated */
	MLENS_REASON_STOP = 2,		/* a stop token or the model's EOS was generated
					 * (it is in token) */
	MLENS_REASON_ERROR = 3,		/* the request failed: status says why */
	MLENS_REASON_CANCELLED = 4,	/* mlens_cancel(), or the daemon is draining */
};

/* One event of one request: normally one generated token. */
struct mlens_event {
	uint64_t id;		/* the request, as mlens_submit returned it */
	int32_t token;		/* when flags & MLENS_EV_TOKEN */
	float logprob;		/* when flags & MLENS_EV_LOGPROB */
	uint32_t flags;		/* MLENS_EV_* */
	uint32_t finish;	/* enum mlens_finish_reason; NONE unless LAST */
	int32_t status;		/* 0, or -errno when finish is MLENS_REASON_ERROR */
	uint32_t detail;	/* 0, or (an error) the limit it ran into, for
				 * mlens_event_strerror() */
};

/* Attach to the daemon listening on socket_path; client_name (may be NULL,
 * at most 47 bytes are used) names this program in the daemon's logs.
 * Returns 0 and *out, or -errno: -ENOENT/-ECONNREFUSED no daemon there,
 * -EACCES not allowed, -EUSERS too many tenants, -EPROTO protocol mismatch,
 * -ETIMEDOUT no answer, -ENAMETOOLONG path too long, -EINVAL.
 * Thread safety: safe; the connection belongs to the caller. */
int mlens_open(const char *socket_path, const char *client_name, struct mlens **out);

/* Detach and free. Requests in flight are dropped by the daemon.
 * Thread safety: no other call on m may run during or after it. */
void mlens_close(struct mlens *m);

/* Start a request; *id gets its id (ids increase from 1). Checks the
 * request against the daemon's limits first: -EINVAL a bad field, -E2BIG
 * above a limit, -ERANGE a prompt token outside the vocabulary. Waits for
 * room in the rings as req->timeout_ms says: -EAGAIN / -ETIMEDOUT when
 * there is none. -ECONNRESET when the daemon has hung up.
 * Thread safety: may run concurrently with any function but mlens_close;
 * concurrent mlens_submit and mlens_cancel calls take turns (with
 * timeout_ms 0 it returns -EAGAIN rather than wait for its turn). */
int mlens_submit(struct mlens *m, const struct mlens_request *req, uint64_t *id);

/* Take up to max events without waiting. Returns how many (0: none now),
 * or -ECONNRESET once the daemon has hung up and every event it posted has
 * been taken, -EPROTO if the rings are corrupt, -EINVAL. After it returns
 * 0, the daemon will make mlens_fd() readable when an event arrives.
 * Thread safety: may run concurrently with any function but mlens_close;
 * concurrent mlens_poll and mlens_wait calls take turns, each event going
 * to exactly one caller, in the order the daemon posted them; mlens_poll
 * returns 0 rather than wait while another thread is in mlens_wait. */
int mlens_poll(struct mlens *m, struct mlens_event *evs, int max);

/* As mlens_poll, but waits up to timeout_ms (as poll(2): -1 forever) for at
 * least one event. Returns 0 on timeout. */
int mlens_wait(struct mlens *m, struct mlens_event *evs, int max, int timeout_ms);

/* Ask the daemon to stop request id. It ends with a LAST event, finish
 * MLENS_REASON_CANCELLED, unless it had ended already (then nothing more
 * comes). Returns 0, -EINVAL if this connection never issued id,
 * -ECONNRESET. Waits for room in the submission ring if it is full.
 * Thread safety: as mlens_submit. */
int mlens_cancel(struct mlens *m, uint64_t id);

/* Copy the daemon's limits into *lim (lim->size set by the caller).
 * Returns 0 or -EINVAL. Thread safety: safe. */
int mlens_limits(struct mlens *m, struct mlens_limits *lim);

/* Words for an error this library returned (negative or positive errno),
 * naming what to do where mlens has a reason of its own; strerror's words
 * otherwise. The string stays valid until the calling thread calls
 * mlens_strerror again. Thread safety: safe. */
const char *mlens_strerror(int err);

/* Words for why the request of error event ev failed: the limit it ran
 * into with its numbers where mlensd named one (KV blocks needed against the
 * pool or the tenant's quota, prompt tokens against the step or the
 * context), else mlens_strerror(ev->status). m is the connection ev came
 * from; the last 64 such limits are kept. The string stays valid until the
 * calling thread calls it or mlens_strerror again. Thread safety: safe. */
const char *mlens_event_strerror(struct mlens *m, const struct mlens_event *ev);

/* The eventfd the daemon writes when events arrive (or ring space frees),
 * for the caller's own poll/epoll loop: wait for POLLIN, then call
 * mlens_poll until it returns 0. Do not read or close it.
 * Thread safety: safe. */
int mlens_fd(struct mlens *m);

#ifdef __cplusplus
}
#endif

#endif
