/* The messages of the tenant protocol: submission and completion entries as
 * they sit in the rings, the daemon's limits as the region header carries
 * them, and the validation the daemon applies to a private copy of each
 * submission and of each prompt before it acts on it. */
#ifndef MLENS_SHM_PROTO_H
#define MLENS_SHM_PROTO_H

#include <stddef.h>
#include <stdint.h>

#define MLENS_PROTO_VERSION 2u	/* 2: error completions carry a detail; limits carry what a tenant may keep in flight; requests may ignore EOS */

/* ==== Limits ==== */

/* What the daemon accepts, written into the region header at creation. The
 * daemon validates against its own private copy, never the header's. */
struct mlens_region_limits {
	uint32_t max_prompt_tokens;	/* per request */
	uint32_t max_tokens;		/* tokens generated per request */
	uint32_t max_context;		/* prompt + generated */
	uint32_t vocab_size;		/* token ids are in [0, vocab_size) */
	uint32_t prompt_bytes;		/* size of the prompt byte ring */
	/* What a client may keep in flight (0: not said): the most sequences
	 * this tenant can have running at once (the daemon's most, within the
	 * tenant's running quota) and the requests it may have waiting. */
	uint32_t max_running;
	uint32_t max_queued;
	uint32_t reserved[1];		/* zero */
};
_Static_assert(sizeof(struct mlens_region_limits) == 32, "limits are 32 bytes");

/* ==== Submission ==== */

enum mlens_sub_op {
	MLENS_OP_GENERATE = 1,	/* start request `id` */
	MLENS_OP_CANCEL = 2,	/* cancel request `id`; only id, op and flags=0 */
};

/* Submission flags. */
#define MLENS_SUB_LOGPROBS (1u << 0)	/* completions carry the token's logprob */
#define MLENS_SUB_IGNORE_EOS (1u << 1)	/* generate past the model's EOS tokens */
#define MLENS_SUB_FLAGS_KNOWN (MLENS_SUB_LOGPROBS | MLENS_SUB_IGNORE_EOS)

#define MLENS_MAX_STOP 8
#define MLENS_TEMPERATURE_MAX 100.0f

/* One request, 128 bytes. The prompt is prompt_len int32 token ids at byte
 * offset prompt_off of the prompt byte ring (a record of prompt_len * 4
 * bytes). A CANCEL produces no completion of its own: the cancelled request
 * ends with a LAST completion, finish MLENS_FINISH_CANCELLED, unless it had
 * ended already. */
struct mlens_sub {
	uint64_t id;		/* chosen by the client; CANCEL: the request to stop */
	uint8_t op;		/* enum mlens_sub_op */
	uint8_t n_stop;		/* entries used in stop[], <= MLENS_MAX_STOP */
	uint16_t flags;		/* MLENS_SUB_* */
	uint32_t prompt_off;	/* bytes, MLENS_BYTERING_ALIGN-aligned */
	uint32_t prompt_len;	/* tokens, >= 1 */
	uint32_t max_tokens;	/* >= 1 */
	float temperature;	/* [0, MLENS_TEMPERATURE_MAX]; 0: greedy */
	float top_p;		/* (0, 1]; 1: no limit */
	int32_t top_k;		/* [0, vocab_size]; 0: no limit */
	uint32_t reserved0;	/* zero */
	uint64_t seed;
	int32_t stop[MLENS_MAX_STOP];	/* token ids that end generation */
	uint64_t reserved[6];	/* zero */
};
_Static_assert(sizeof(struct mlens_sub) == 128, "submission entry is 128 bytes");
_Static_assert(offsetof(struct mlens_sub, op) == 8, "sub layout");
_Static_assert(offsetof(struct mlens_sub, prompt_off) == 12, "sub layout");
_Static_assert(offsetof(struct mlens_sub, temperature) == 24, "sub layout");
_Static_assert(offsetof(struct mlens_sub, seed) == 40, "sub layout");
_Static_assert(offsetof(struct mlens_sub, stop) == 48, "sub layout");
_Static_assert(offsetof(struct mlens_sub, reserved) == 80, "sub layout");

/* ==== Completion ==== */

/* Completion flags. */
#define MLENS_CMPL_FIRST (1u << 0)	/* first completion of this request */
#define MLENS_CMPL_LAST (1u << 1)	/* last one: finish says why */
#define MLENS_CMPL_TOKEN (1u << 2)	/* token (and logprob, if asked) valid */
#define MLENS_CMPL_LOGPROB (1u << 3)	/* logprob valid */
#define MLENS_CMPL_FLAGS_KNOWN 0xfu

enum mlens_finish {
	MLENS_FINISH_NONE = 0,		/* not the last completion */
	MLENS_FINISH_LENGTH = 1,	/* max_tokens reached */
	MLENS_FINISH_STOP = 2,		/* a stop token or the model's EOS was generated */
	MLENS_FINISH_ERROR = 3,		/* status says why */
	MLENS_FINISH_CANCELLED = 4,	/* a CANCEL arrived, or the daemon drained */
};

/* Which limit a failed request ran into, when the status alone does not
 * say (-E2BIG and -EDQUOT have several causes): an error completion's
 * detail, with the numbers in need and have. */
enum mlens_cmpl_detail {
	MLENS_DETAIL_NONE = 0,
	MLENS_DETAIL_KV_POOL = 1,	/* need: KV blocks for prompt + max_tokens;
					 * have: the daemon's KV pool, blocks */
	MLENS_DETAIL_KV_QUOTA = 2,	/* need: as above; have: the tenant's kv_blocks quota */
	MLENS_DETAIL_STEP_CAP = 3,	/* need: prompt tokens; have: tokens a step takes */
	MLENS_DETAIL_CONTEXT = 4,	/* need: prompt tokens; have: the model's positions */
	MLENS_DETAIL_QUEUED = 5,	/* need: requests queued with it; have: the tenant's
					 * queued quota */
	MLENS_DETAIL_MAX = 5,
};

/* One event of a request, 32 bytes: normally one generated token. */
struct mlens_cmpl {
	uint64_t id;		/* the request's id */
	int32_t token;		/* when MLENS_CMPL_TOKEN */
	int32_t status;		/* 0; -errno when finish is ERROR; 0 or -ECANCELED when
				 * finish is CANCELLED */
	uint16_t flags;		/* MLENS_CMPL_* */
	uint8_t finish;		/* enum mlens_finish; NONE unless LAST */
	uint8_t detail;		/* enum mlens_cmpl_detail; NONE unless finish is ERROR */
	float logprob;		/* when MLENS_CMPL_LOGPROB */
	uint32_t need, have;	/* the detail's numbers; zero without one */
};
_Static_assert(sizeof(struct mlens_cmpl) == 32, "completion entry is 32 bytes");
_Static_assert(offsetof(struct mlens_cmpl, status) == 12, "cmpl layout");
_Static_assert(offsetof(struct mlens_cmpl, flags) == 16, "cmpl layout");
_Static_assert(offsetof(struct mlens_cmpl, logprob) == 20, "cmpl layout");
_Static_assert(offsetof(struct mlens_cmpl, need) == 24, "cmpl layout");

/* ==== Validation ====
 *
 * Both take a PRIVATE copy (the daemon copies an entry or a prompt out of
 * shared memory once, then validates the copy and uses only it). They
 * return 0 or a negative errno, and write a one-line reason naming the
 * field into why (why may be NULL):
 *   -EINVAL  a field holds a value no request may have: unknown op or flag
 *            bits, reserved bytes not zero, n_stop above MLENS_MAX_STOP, a
 *            stop token outside the vocabulary, an empty prompt, max_tokens
 *            0, temperature/top_p not finite or out of range, top_k < 0 or
 *            above the vocabulary
 *   -E2BIG   within the protocol but above this daemon's limits:
 *            prompt_len > max_prompt_tokens, max_tokens > max_tokens,
 *            prompt_len + max_tokens > max_context
 *   -EFAULT  the prompt does not lie within the prompt ring (offset
 *            misaligned or past the end, or length running past the end)
 *   -ERANGE  (prompt check) a prompt token id outside [0, vocab_size)
 * The daemon reports the same value as the request's completion status. */
int mlens_sub_validate(const struct mlens_sub *s, const struct mlens_region_limits *lim,
		       char *why, size_t why_len);

/* Check the n tokens of a prompt copied out of the prompt ring. */
int mlens_prompt_validate(const int32_t *tokens, uint32_t n,
			  const struct mlens_region_limits *lim, char *why, size_t why_len);

/* Client: check a completion copied out of the completion ring (the client
 * trusts the daemon, but a mismatched or broken one should give an error,
 * not a misread stream): known flags, finish in range and set exactly when
 * LAST, status negative with finish ERROR, 0 or -ECANCELED with CANCELLED,
 * else 0; logprob only with a token; a detail (known) only with finish
 * ERROR, need and have zero without one. 0 or -EPROTO with a reason. */
int mlens_cmpl_validate(const struct mlens_cmpl *c, char *why, size_t why_len);

/* The limits a daemon may configure: every count at least 1, the prompt
 * ring able to hold the longest prompt as one record (prompt_bytes at
 * least 2 * 4 * max_prompt_tokens), reserved zero. 0 or -EINVAL. */
int mlens_limits_validate(const struct mlens_region_limits *lim, char *why, size_t why_len);

#endif
