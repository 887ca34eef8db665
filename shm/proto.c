/* Validation of protocol messages. Every check reads the caller's private
 * copy, so a value cannot change between its check and its use. */
#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <stdarg.h>
#include <stdio.h>
#include "shm/proto.h"
#include "shm/ring.h"
#include "shm/shm_int.h"

/* Short local name: most checks below end in one. */
#define reject mlens_shm_reason

int mlens_shm_reason(int err, char *why, size_t why_len, const char *fmt, ...)
{
	va_list ap;

	if (why && why_len) {
		va_start(ap, fmt);
		vsnprintf(why, why_len, fmt, ap);
		va_end(ap);
	}
	return err;
}

static int reserved_zero(const void *p, size_t n)
{
	const unsigned char *b = p;

	for (size_t i = 0; i < n; i++)
		if (b[i])
			return 0;
	return 1;
}

static int validate_cancel(const struct mlens_sub *s, char *why, size_t why_len)
{
	/* A cancel names only its target: anything else set is a client bug
	 * (or an entry half-written as a request) better reported than run. */
	struct mlens_sub zero = { .id = s->id, .op = s->op };

	if (s->flags)
		return reject(-EINVAL, why, why_len, "cancel entry: flags 0x%x set, want 0",
			      (unsigned)s->flags);
	if (memcmp(s, &zero, sizeof(zero)))
		return reject(-EINVAL, why, why_len,
			      "cancel entry: request fields set, want only id and op");
	return 0;
}

int mlens_sub_validate(const struct mlens_sub *s, const struct mlens_region_limits *lim,
		       char *why, size_t why_len)
{
	uint64_t bytes;

	if (s->op == MLENS_OP_CANCEL)
		return validate_cancel(s, why, why_len);
	if (s->op != MLENS_OP_GENERATE)
		return reject(-EINVAL, why, why_len, "op %u unknown", (unsigned)s->op);
	if (s->flags & ~MLENS_SUB_FLAGS_KNOWN)
		return reject(-EINVAL, why, why_len, "flags 0x%x: unknown bits 0x%x",
			      (unsigned)s->flags, (unsigned)(s->flags & ~MLENS_SUB_FLAGS_KNOWN));
	if (s->reserved0 || !reserved_zero(s->reserved, sizeof(s->reserved)))
		return reject(-EINVAL, why, why_len, "reserved bytes not zero");

	if (s->prompt_len == 0)
		return reject(-EINVAL, why, why_len, "prompt_len 0: a prompt needs a token");
	if (s->prompt_len > lim->max_prompt_tokens)
		return reject(-E2BIG, why, why_len, "prompt_len %u above the limit of %u tokens",
			      s->prompt_len, lim->max_prompt_tokens);
	if (s->max_tokens == 0)
		return reject(-EINVAL, why, why_len, "max_tokens 0: nothing to generate");
	if (s->max_tokens > lim->max_tokens)
		return reject(-E2BIG, why, why_len, "max_tokens %u above the limit of %u",
			      s->max_tokens, lim->max_tokens);
	if ((uint64_t)s->prompt_len + s->max_tokens > lim->max_context)
		return reject(-E2BIG, why, why_len,
			      "prompt_len %u + max_tokens %u above the context limit of %u",
			      s->prompt_len, s->max_tokens, lim->max_context);

	bytes = (uint64_t)s->prompt_len * sizeof(int32_t);
	if (s->prompt_off % MLENS_BYTERING_ALIGN)
		return reject(-EFAULT, why, why_len, "prompt_off %u not a multiple of %u",
			      s->prompt_off, MLENS_BYTERING_ALIGN);
	if (s->prompt_off >= lim->prompt_bytes || bytes > lim->prompt_bytes - s->prompt_off)
		return reject(-EFAULT, why, why_len,
			      "prompt_off %u + %llu bytes past the prompt ring's %u bytes",
			      s->prompt_off, (unsigned long long)bytes, lim->prompt_bytes);

	/* The comparisons are written so that NaN fails them. */
	if (!(s->temperature >= 0.0f && s->temperature <= MLENS_TEMPERATURE_MAX))
		return reject(-EINVAL, why, why_len, "temperature %g not in [0, %g]",
			      (double)s->temperature, (double)MLENS_TEMPERATURE_MAX);
	if (!(s->top_p > 0.0f && s->top_p <= 1.0f))
		return reject(-EINVAL, why, why_len, "top_p %g not in (0, 1]", (double)s->top_p);
	if (s->top_k < 0 || (uint32_t)s->top_k > lim->vocab_size)
		return reject(-EINVAL, why, why_len, "top_k %d not in [0, %u]", s->top_k,
			      lim->vocab_size);

	if (s->n_stop > MLENS_MAX_STOP)
		return reject(-EINVAL, why, why_len, "n_stop %u above %d", (unsigned)s->n_stop,
			      MLENS_MAX_STOP);
	for (unsigned i = 0; i < MLENS_MAX_STOP; i++) {
		if (i >= s->n_stop) {
			if (s->stop[i])
				return reject(-EINVAL, why, why_len,
					      "stop[%u] set beyond n_stop %u", i,
					      (unsigned)s->n_stop);
		} else if (s->stop[i] < 0 || (uint32_t)s->stop[i] >= lim->vocab_size) {
			return reject(-EINVAL, why, why_len,
				      "stop[%u] token %d outside the vocabulary of %u", i,
				      s->stop[i], lim->vocab_size);
		}
	}
	return 0;
}

int mlens_prompt_validate(const int32_t *tokens, uint32_t n,
			  const struct mlens_region_limits *lim, char *why, size_t why_len)
{
	for (uint32_t i = 0; i < n; i++)
		if (tokens[i] < 0 || (uint32_t)tokens[i] >= lim->vocab_size)
			return reject(-ERANGE, why, why_len,
				      "prompt token %u is %d, outside the vocabulary of %u", i,
				      tokens[i], lim->vocab_size);
	return 0;
}

int mlens_cmpl_validate(const struct mlens_cmpl *c, char *why, size_t why_len)
{
	bool last = c->flags & MLENS_CMPL_LAST;

	if (c->flags & ~MLENS_CMPL_FLAGS_KNOWN)
		return reject(-EPROTO, why, why_len, "completion flags 0x%x: unknown bits",
			      (unsigned)c->flags);
	if (c->finish > MLENS_FINISH_CANCELLED || last != (c->finish != MLENS_FINISH_NONE))
		return reject(-EPROTO, why, why_len, "completion finish %u with LAST %s",
			      (unsigned)c->finish, last ? "set" : "clear");
	if (c->finish == MLENS_FINISH_ERROR ? c->status >= 0 :
	    c->finish == MLENS_FINISH_CANCELLED ? c->status != 0 && c->status != -ECANCELED :
	    c->status != 0)
		return reject(-EPROTO, why, why_len, "completion status %d with finish %u",
			      c->status, (unsigned)c->finish);
	if ((c->flags & MLENS_CMPL_LOGPROB) && !(c->flags & MLENS_CMPL_TOKEN))
		return reject(-EPROTO, why, why_len, "completion has a logprob but no token");
	if (c->detail > MLENS_DETAIL_MAX ||
	    (c->detail && c->finish != MLENS_FINISH_ERROR) || (!c->detail && (c->need || c->have)))
		return reject(-EPROTO, why, why_len, "completion detail %u (need %u, have %u) with finish %u",
			      (unsigned)c->detail, c->need, c->have, (unsigned)c->finish);
	return 0;
}

int mlens_limits_validate(const struct mlens_region_limits *lim, char *why, size_t why_len)
{
	if (!lim->max_prompt_tokens || !lim->max_tokens || !lim->max_context ||
	    !lim->vocab_size || !lim->prompt_bytes)
		return reject(-EINVAL, why, why_len,
			      "limits: max_prompt_tokens, max_tokens, max_context, vocab_size and "
			      "prompt_bytes must all be at least 1");
	if (lim->vocab_size > INT32_MAX)
		return reject(-EINVAL, why, why_len, "limits: vocab_size %u above %d",
			      lim->vocab_size, INT32_MAX);
	if ((uint64_t)lim->max_prompt_tokens * sizeof(int32_t) * 2 > lim->prompt_bytes)
		return reject(-EINVAL, why, why_len,
			      "limits: a prompt of max_prompt_tokens %u needs a prompt ring of "
			      "at least %llu bytes, have %u", lim->max_prompt_tokens,
			      (unsigned long long)lim->max_prompt_tokens * sizeof(int32_t) * 2,
			      lim->prompt_bytes);
	if (!reserved_zero(lim->reserved, sizeof(lim->reserved)))
		return reject(-EINVAL, why, why_len, "limits: reserved bytes not zero");
	return 0;
}
