/* mlens generate's text side: a model directory's tokenizer and chat
 * template turn text prompts and chats into token ids, and an incremental
 * decoder turns generated ids into text, never half a UTF-8 character,
 * cut before the first stop string. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "client/cli_int.h"
#include "client/mlens_chat.h"
#include "client/mlens_tokenizer.h"

struct mlens_cli_model {
	struct mlens_tokenizer *tok;
	struct mlens_chat_template *tpl;	/* NULL: chats are refused */
	char *tpl_problem;	/* why there is no template */
};

int mlens_cli_model_open(const char *dir, struct mlens_cli_model **out, char *err,
			 size_t errlen)
{
	struct mlens_cli_model *m = calloc(1, sizeof(*m));
	int rc;

	*out = NULL;
	if (!m) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	rc = mlens_tokenizer_open(dir, &m->tok, err, errlen);
	if (rc) {
		free(m);
		return rc;
	}
	rc = mlens_chat_template_open(dir, &m->tpl, &m->tpl_problem);
	if (rc == -ENOMEM) {
		mlens_cli_model_free(m);
		snprintf(err, errlen, "out of memory");
		return rc;
	}
	if (rc && !m->tpl_problem)
		m->tpl_problem = strdup(strerror(-rc));
	*out = m;
	return 0;
}

void mlens_cli_model_free(struct mlens_cli_model *m)
{
	if (!m)
		return;
	mlens_tokenizer_free(m->tok);
	mlens_chat_template_free(m->tpl);
	free(m->tpl_problem);
	free(m);
}

/* len bytes of text as r->prompt. */
static int encode(const struct mlens_cli_model *m, const char *text, size_t len, unsigned flags,
		  struct mlens_cli_req *r, char *err, size_t errlen)
{
	size_t cap = len + 8, n = 0;
	int32_t *ids = NULL;
	int rc = -ENOMEM;

	/* a byte is at most one token, specials aside: a second try when
	 * -ENOBUFS gives the count */
	for (int i = 0; i < 2; i++) {
		int32_t *ni = realloc(ids, cap * sizeof(*ids));

		if (!ni) {
			rc = -ENOMEM;
			break;
		}
		ids = ni;
		rc = mlens_tokenizer_encode(m->tok, text, len, flags, ids, cap, &n);
		if (rc != -ENOBUFS)
			break;
		cap = n;
	}
	if (!rc && (n == 0 || n > UINT32_MAX)) {
		snprintf(err, errlen, "the prompt's text makes %zu tokens", n);
		rc = -EINVAL;
	} else if (rc) {
		snprintf(err, errlen, "cannot tokenize the prompt: %s", strerror(-rc));
	}
	if (rc) {
		free(ids);
		return rc;
	}
	r->prompt = ids;
	r->n_prompt = (uint32_t)n;
	return 0;
}

/* Does text begin with the BOS token's text (a template that writes it)? */
static bool starts_with_bos(const struct mlens_cli_model *m, const char *text)
{
	int32_t bos = mlens_tokenizer_bos(m->tok);
	size_t len = 0;
	const char *s = bos >= 0 ? mlens_tokenizer_id_token(m->tok, bos, &len) : NULL;

	return s && len && !strncmp(text, s, len);
}

int mlens_cli_model_prompt(const struct mlens_cli_model *m, struct mlens_cli_req *r, char *err,
			   size_t errlen)
{
	char *text = NULL, *why = NULL;
	size_t len = 0;
	int rc;

	if (r->prompt_text)
		return encode(m, r->prompt_text, r->prompt_text_len, MLENS_TOK_ADD_SPECIAL, r, err,
			      errlen);
	if (!r->messages)
		return 0;
	if (!m->tpl) {
		snprintf(err, errlen, "messages need the model's chat template: %s",
			 m->tpl_problem ? m->tpl_problem : "none in the model directory");
		return -EINVAL;
	}
	rc = mlens_chat_template_render(m->tpl, r->messages, 1, NULL, &text, &len, &why);
	if (rc) {
		snprintf(err, errlen, "the chat template refused the messages: %s",
			 why ? why : strerror(-rc));
		free(why);
		return rc == -ENOMEM ? rc : -EINVAL;
	}
	rc = encode(m, text, len, starts_with_bos(m, text) ? 0 : MLENS_TOK_ADD_SPECIAL, r, err,
		    errlen);
	free(text);
	return rc;
}

char *mlens_cli_model_token_text(const struct mlens_cli_model *m, int32_t id)
{
	size_t cap = 32, len = 0;
	char *buf = NULL;
	int rc = -ENOBUFS;

	for (int i = 0; i < 2 && rc == -ENOBUFS; i++) {
		char *nb = realloc(buf, cap);

		if (!nb)
			break;
		buf = nb;
		rc = mlens_tokenizer_decode(m->tok, &id, 1, 0, buf, cap, &len);
		cap = len + 1;
	}
	if (rc == -EINVAL && buf)
		buf[0] = 0;	/* a model's padding id past the tokenizer's vocabulary */
	else if (rc) {
		free(buf);
		return NULL;
	}
	return buf;
}

/* ==== Generated text and stop strings ==== */

int mlens_cli_text_init(struct mlens_cli_text *t, const struct mlens_cli_model *m)
{
	memset(t, 0, sizeof(*t));
	return mlens_detok_new(m->tok, MLENS_TOK_SKIP_SPECIAL, &t->dt);
}

void mlens_cli_text_free(struct mlens_cli_text *t)
{
	mlens_detok_free(t->dt);
	free(t->buf);
	memset(t, 0, sizeof(*t));
}

static int append(struct mlens_cli_text *t, const char *p, size_t n)
{
	if (t->len + n + 1 > t->cap) {
		size_t cap = t->cap ? t->cap : 64;
		char *nb;

		while (cap < t->len + n + 1)
			cap *= 2;
		nb = realloc(t->buf, cap);
		if (!nb)
			return -ENOMEM;
		t->buf = nb;
		t->cap = cap;
	}
	memcpy(t->buf + t->len, p, n);
	t->len += n;
	t->buf[t->len] = 0;
	return 0;
}

/* Look for r's stop strings in the text from byte from on (what was there
 * before was looked at already). Returns 1 and cuts the text at the
 * earliest match, else 0 and moves safe up to where no stop string can
 * begin any more. */
static int scan(struct mlens_cli_text *t, const struct mlens_cli_req *r, size_t from, bool end)
{
	size_t best = SIZE_MAX, hold = 0, safe;

	for (uint32_t i = 0; i < r->n_stop_text; i++) {
		size_t sl = strlen(r->stop_text[i]);
		size_t start = from >= sl - 1 ? from - (sl - 1) : 0;
		const char *hit;

		if (sl - 1 > hold)
			hold = sl - 1;
		if (t->len < start + sl)
			continue;
		hit = memmem(t->buf + start, t->len - start, r->stop_text[i], sl);
		if (hit && (size_t)(hit - t->buf) < best)
			best = (size_t)(hit - t->buf);
	}
	if (best != SIZE_MAX) {
		t->len = best;
		t->buf[best] = 0;
		t->safe = best;
		t->stopped = true;
		return 1;
	}
	/* the last hold bytes may begin a stop string; a stop string is
	 * whole characters, so safe never cuts one */
	safe = end ? t->len : t->len > hold ? t->len - hold : 0;
	while (safe > 0 && safe < t->len && ((unsigned char)t->buf[safe] & 0xC0) == 0x80)
		safe--;
	if (safe > t->safe)
		t->safe = safe;
	return 0;
}

int mlens_cli_text_push(struct mlens_cli_text *t, const struct mlens_cli_req *r, int32_t id)
{
	size_t from = t->len, n;
	const char *p;
	int rc;

	if (t->stopped || t->flushed)
		return t->stopped;
	rc = mlens_detok_push(t->dt, id, &p, &n);
	if (rc == -EINVAL)
		return 0;	/* a padding id past the tokenizer's vocabulary: no text */
	if (rc || (rc = append(t, p, n)))
		return rc;
	return scan(t, r, from, false);
}

int mlens_cli_text_finish(struct mlens_cli_text *t, const struct mlens_cli_req *r)
{
	size_t from = t->len, n;
	const char *p;
	int rc;

	if (t->flushed || !t->dt)
		return t->stopped;
	t->flushed = true;
	if (t->stopped)
		return 1;
	if ((rc = mlens_detok_flush(t->dt, &p, &n)) || (rc = append(t, p, n)))
		return rc;
	if (!t->buf && (rc = append(t, "", 0)))
		return rc;
	return scan(t, r, from, true);
}
