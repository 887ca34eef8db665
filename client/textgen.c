/* Text generation's text side over libmlens's tokenizer
 * (mlens_tokenizer.h) and chat templates (mlens_chat.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "client/textgen.h"
#include "client/mlens_chat.h"
#include "client/mlens_tokenizer.h"

struct mlens_textgen {
	struct mlens_tokenizer *tok;
	struct mlens_chat_template *tpl;	/* NULL: chats are refused */
	char *tpl_problem;	/* why there is no template */
};

int mlens_textgen_open(const char *dir, struct mlens_textgen **out, char *err, size_t errlen)
{
	struct mlens_textgen *tg = calloc(1, sizeof(*tg));
	int rc;

	*out = NULL;
	if (!tg) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	rc = mlens_tokenizer_open(dir, &tg->tok, err, errlen);
	if (rc) {
		free(tg);
		return rc;
	}
	/* a template that will not load leaves text prompts working */
	rc = mlens_chat_template_open(dir, &tg->tpl, &tg->tpl_problem);
	if (rc == -ENOMEM) {
		mlens_textgen_free(tg);
		snprintf(err, errlen, "out of memory");
		return rc;
	}
	if (rc && !tg->tpl_problem)
		tg->tpl_problem = strdup(strerror(-rc));
	*out = tg;
	return 0;
}

void mlens_textgen_free(struct mlens_textgen *tg)
{
	if (!tg)
		return;
	mlens_tokenizer_free(tg->tok);
	mlens_chat_template_free(tg->tpl);
	free(tg->tpl_problem);
	free(tg);
}

uint32_t mlens_textgen_vocab_size(const struct mlens_textgen *tg)
{
	return mlens_tokenizer_vocab_size(tg->tok);
}

const char *mlens_textgen_chat_problem(const struct mlens_textgen *tg, const char *none)
{
	return tg->tpl ? NULL : tg->tpl_problem ? tg->tpl_problem : none;
}

int mlens_textgen_encode(const struct mlens_textgen *tg, const char *s, size_t len,
			 bool add_special, int32_t **ids, size_t *n)
{
	unsigned flags = add_special ? MLENS_TOK_ADD_SPECIAL : 0;
	size_t cap = len + 8;
	int32_t *buf = NULL;
	int rc = -ENOMEM;

	/* a byte is at most one token, the special ones aside: one try
	 * nearly always, a second when -ENOBUFS gives the real count */
	for (int i = 0; i < 2; i++) {
		int32_t *nb = realloc(buf, cap * sizeof(*buf));

		if (!nb) {
			free(buf);
			return -ENOMEM;
		}
		buf = nb;
		rc = mlens_tokenizer_encode(tg->tok, s, len, flags, buf, cap, n);
		if (rc != -ENOBUFS)
			break;
		cap = *n;
	}
	if (rc) {
		free(buf);
		return rc;
	}
	*ids = buf;
	return 0;
}

int mlens_textgen_decode(const struct mlens_textgen *tg, const int32_t *ids, size_t n,
			 bool skip_special, char **s, size_t *len)
{
	unsigned flags = skip_special ? MLENS_TOK_SKIP_SPECIAL : 0;
	size_t cap = n * 8 + 16;
	char *buf = NULL;
	int rc = -ENOMEM;

	for (int i = 0; i < 2; i++) {
		char *nb = realloc(buf, cap);

		if (!nb) {
			free(buf);
			return -ENOMEM;
		}
		buf = nb;
		rc = mlens_tokenizer_decode(tg->tok, ids, n, flags, buf, cap, len);
		if (rc != -ENOBUFS)
			break;
		cap = *len + 1;
	}
	if (rc) {
		free(buf);
		return rc;
	}
	*s = buf;
	return 0;
}

/* Does text begin with the BOS token's text (a template that writes it)? */
static bool starts_with_bos(const struct mlens_textgen *tg, const char *text)
{
	int32_t bos = mlens_tokenizer_bos(tg->tok);
	size_t len = 0;
	const char *s = bos >= 0 ? mlens_tokenizer_id_token(tg->tok, bos, &len) : NULL;

	return s && len && !strncmp(text, s, len);
}

int mlens_textgen_render(const struct mlens_textgen *tg, const char *messages,
			 bool add_generation_prompt, const char *none, char **text, size_t *len,
			 bool *add_special, char *why, size_t why_len)
{
	char *err = NULL;
	int rc;

	if (!tg->tpl) {
		snprintf(why, why_len, "%s", mlens_textgen_chat_problem(tg, none));
		return -ENOENT;
	}
	rc = mlens_chat_template_render(tg->tpl, messages, add_generation_prompt, NULL, text, len,
					&err);
	if (rc) {
		snprintf(why, why_len, "%s", err ? err : strerror(-rc));
		free(err);
		return rc == -ENOMEM ? rc : -EINVAL;
	}
	*add_special = !starts_with_bos(tg, *text);
	return 0;
}

/* ==== Generated text and stop strings ==== */

int mlens_textgen_text_init(struct mlens_textgen_text *t, const struct mlens_textgen *tg)
{
	memset(t, 0, sizeof(*t));
	return mlens_detok_new(tg->tok, MLENS_TOK_SKIP_SPECIAL, &t->dt);
}

void mlens_textgen_text_free(struct mlens_textgen_text *t)
{
	mlens_detok_free(t->dt);
	free(t->buf);
	memset(t, 0, sizeof(*t));
}

static int append(struct mlens_textgen_text *t, const char *p, size_t n)
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

/* Look for the stop strings in the text from byte from on (what was there
 * before was looked at already). Returns 1 and cuts the text at the
 * earliest match, else 0 and moves safe up to where no stop string can
 * begin any more. */
static int scan(struct mlens_textgen_text *t, char *const *stops, size_t n_stops, size_t from,
		bool end)
{
	size_t best = SIZE_MAX, hold = 0, safe;

	for (size_t i = 0; i < n_stops; i++) {
		size_t sl = strlen(stops[i]);
		size_t start = from >= sl - 1 ? from - (sl - 1) : 0;
		const char *hit;

		if (sl - 1 > hold)
			hold = sl - 1;
		if (t->len < start + sl)
			continue;
		hit = memmem(t->buf + start, t->len - start, stops[i], sl);
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

int mlens_textgen_text_add(struct mlens_textgen_text *t, char *const *stops, size_t n_stops,
			   const char *p, size_t n, bool end)
{
	size_t from = t->len;
	int rc = append(t, p, n);

	return rc ? rc : scan(t, stops, n_stops, from, end);
}

int mlens_textgen_text_push(struct mlens_textgen_text *t, char *const *stops, size_t n_stops,
			    int32_t id)
{
	const char *p;
	size_t n;
	int rc;

	if (t->stopped || t->flushed)
		return t->stopped;
	rc = mlens_detok_push(t->dt, id, &p, &n);
	if (rc == -EINVAL)
		return 0;	/* a padding id past the tokenizer's vocabulary: no text */
	return rc ? rc : mlens_textgen_text_add(t, stops, n_stops, p, n, false);
}

int mlens_textgen_text_finish(struct mlens_textgen_text *t, char *const *stops,
			      size_t n_stops)
{
	const char *p;
	size_t n;
	int rc;

	if (t->flushed || !t->dt)
		return t->stopped;
	t->flushed = true;
	if (t->stopped)
		return 1;
	if ((rc = mlens_detok_flush(t->dt, &p, &n)))
		return rc;
	return mlens_textgen_text_add(t, stops, n_stops, p, n, true);
}
