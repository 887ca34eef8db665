/* mlens-gateway's text side over libmlens's tokenizer (mlens_tokenizer.h)
 * and chat templates (mlens_chat.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "client/gateway_text.h"
#include "client/mlens_chat.h"
#include "client/mlens_tokenizer.h"

struct gw_text {
	struct mlens_tokenizer *tok;
	struct mlens_chat_template *tpl;	/* NULL: no template */
	char *tpl_problem;	/* why there is none */
};

struct gw_detok {
	struct mlens_detok *d;
};

int gw_text_open(const char *dir, struct gw_text **out, char *why, size_t why_len)
{
	struct gw_text *tx = calloc(1, sizeof(*tx));
	int rc;

	*out = NULL;
	if (!tx) {
		snprintf(why, why_len, "out of memory");
		return -ENOMEM;
	}
	rc = mlens_tokenizer_open(dir, &tx->tok, why, why_len);
	if (rc) {
		free(tx);
		return rc;
	}
	/* a template that will not load leaves completions working */
	rc = mlens_chat_template_open(dir, &tx->tpl, &tx->tpl_problem);
	if (rc && !tx->tpl_problem)
		tx->tpl_problem = strdup(strerror(-rc));
	if (rc == -ENOMEM) {
		gw_text_close(tx);
		snprintf(why, why_len, "out of memory");
		return rc;
	}
	*out = tx;
	return 0;
}

const char *gw_text_chat_problem(const struct gw_text *tx)
{
	return tx->tpl ? NULL : tx->tpl_problem ? tx->tpl_problem : "no chat template";
}

void gw_text_close(struct gw_text *tx)
{
	if (!tx)
		return;
	mlens_tokenizer_free(tx->tok);
	mlens_chat_template_free(tx->tpl);
	free(tx->tpl_problem);
	free(tx);
}

int gw_text_encode(struct gw_text *tx, const char *s, size_t len, bool add_special,
		   int32_t **ids, size_t *n)
{
	unsigned flags = add_special ? MLENS_TOK_ADD_SPECIAL : 0;
	size_t cap = len + 8;
	int32_t *buf = NULL;
	int rc;

	/* a byte is at most one token, the special ones aside: one try
	 * nearly always, a second when -ENOBUFS gives the real count */
	for (int i = 0; i < 2; i++) {
		int32_t *nb = realloc(buf, cap * sizeof(*buf));

		if (!nb) {
			free(buf);
			return -ENOMEM;
		}
		buf = nb;
		rc = mlens_tokenizer_encode(tx->tok, s, len, flags, buf, cap, n);
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

int gw_text_decode(struct gw_text *tx, const int32_t *ids, size_t n, bool skip_special,
		   char **s, size_t *len)
{
	unsigned flags = skip_special ? MLENS_TOK_SKIP_SPECIAL : 0;
	size_t cap = n * 8 + 16;
	char *buf = NULL;
	int rc;

	for (int i = 0; i < 2; i++) {
		char *nb = realloc(buf, cap);

		if (!nb) {
			free(buf);
			return -ENOMEM;
		}
		buf = nb;
		rc = mlens_tokenizer_decode(tx->tok, ids, n, flags, buf, cap, len);
		if (rc != -ENOBUFS)
			break;
		cap = *len + 1;
	}
	if (rc) {
		free(buf);
		return rc == -EINVAL ? -ERANGE : rc;
	}
	*s = buf;
	return 0;
}

/* Does text begin with the BOS token's text (a template that writes it)? */
static bool starts_with_bos(const struct gw_text *tx, const char *text)
{
	int32_t bos = mlens_tokenizer_bos(tx->tok);
	size_t len;
	const char *s = bos >= 0 ? mlens_tokenizer_id_token(tx->tok, bos, &len) : NULL;

	return s && len && !strncmp(text, s, len);
}

int gw_text_chat(struct gw_text *tx, const json_t *messages, bool add_generation_prompt,
		 int32_t **ids, size_t *n, char *why, size_t why_len)
{
	char *msgs, *text = NULL, *err = NULL;
	size_t len;
	int rc;

	if (!tx->tpl) {
		snprintf(why, why_len, "%s", gw_text_chat_problem(tx));
		return -ENOENT;
	}
	msgs = json_dumps(messages, JSON_COMPACT);
	if (!msgs) {
		snprintf(why, why_len, "out of memory");
		return -ENOMEM;
	}
	rc = mlens_chat_template_render(tx->tpl, msgs, add_generation_prompt, NULL, &text, &len,
					&err);
	free(msgs);
	if (rc) {
		snprintf(why, why_len, "%s", err ? err : strerror(-rc));
		free(err);
		return rc == -ENOMEM ? rc : -EINVAL;
	}
	rc = gw_text_encode(tx, text, len, !starts_with_bos(tx, text), ids, n);
	free(text);
	if (rc)
		snprintf(why, why_len, "cannot tokenize the rendered chat: %s", strerror(-rc));
	return rc;
}

struct gw_detok *gw_detok_new(struct gw_text *tx)
{
	struct gw_detok *d = calloc(1, sizeof(*d));

	if (d && mlens_detok_new(tx->tok, MLENS_TOK_SKIP_SPECIAL, &d->d)) {
		free(d);
		d = NULL;
	}
	return d;
}

void gw_detok_free(struct gw_detok *d)
{
	if (!d)
		return;
	mlens_detok_free(d->d);
	free(d);
}

static int append(const char *p, size_t pl, char **buf, size_t *len, size_t *cap)
{
	if (*len + pl + 1 > *cap) {
		size_t nc = *cap ? *cap : 64;
		char *nb;

		while (nc < *len + pl + 1)
			nc *= 2;
		nb = realloc(*buf, nc);
		if (!nb)
			return -ENOMEM;
		*buf = nb;
		*cap = nc;
	}
	memcpy(*buf + *len, p, pl);
	*len += pl;
	(*buf)[*len] = 0;
	return 0;
}

int gw_detok_push(struct gw_detok *d, int32_t id, char **buf, size_t *len, size_t *cap)
{
	const char *p;
	size_t pl;
	int rc = mlens_detok_push(d->d, id, &p, &pl);

	/* models pad their vocabulary past the tokenizer's: such an id has
	 * no text */
	if (rc == -EINVAL)
		return 0;
	return rc ? rc : append(p, pl, buf, len, cap);
}

int gw_detok_flush(struct gw_detok *d, char **buf, size_t *len, size_t *cap)
{
	const char *p;
	size_t pl;
	int rc = mlens_detok_flush(d->d, &p, &pl);

	return rc ? rc : append(p, pl, buf, len, cap);
}
