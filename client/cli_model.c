/* mlens generate's text side: a request's text prompt or chat as token
 * ids through the model's tokenizer and chat template (client/textgen.h),
 * with the CLI's error sentences. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "client/cli_int.h"

/* len bytes of text as r->prompt. */
static int encode(const struct mlens_textgen *tg, const char *text, size_t len,
		  bool add_special, struct mlens_cli_req *r, char *err, size_t errlen)
{
	int32_t *ids = NULL;
	size_t n = 0;
	int rc = mlens_textgen_encode(tg, text, len, add_special, &ids, &n);

	if (!rc && (n == 0 || n > UINT32_MAX)) {
		snprintf(err, errlen, "the prompt's text makes %zu tokens", n);
		free(ids);
		return -EINVAL;
	}
	if (rc) {
		snprintf(err, errlen, "cannot tokenize the prompt: %s", strerror(-rc));
		return rc;
	}
	r->prompt = ids;
	r->n_prompt = (uint32_t)n;
	return 0;
}

int mlens_cli_model_prompt(const struct mlens_textgen *tg, struct mlens_cli_req *r, char *err,
			   size_t errlen)
{
	char *text = NULL, why[512];
	bool add_special;
	size_t len = 0;
	int rc;

	if (r->prompt_text)
		return encode(tg, r->prompt_text, r->prompt_text_len, true, r, err, errlen);
	if (!r->messages)
		return 0;
	rc = mlens_textgen_render(tg, r->messages, true, "none in the model directory", &text,
				  &len, &add_special, why, sizeof(why));
	if (rc == -ENOENT) {
		snprintf(err, errlen, "messages need the model's chat template: %s", why);
		return -EINVAL;
	}
	if (rc) {
		snprintf(err, errlen, "the chat template refused the messages: %s", why);
		return rc;
	}
	rc = encode(tg, text, len, add_special, r, err, errlen);
	free(text);
	return rc;
}

char *mlens_cli_model_token_text(const struct mlens_textgen *tg, int32_t id)
{
	char *s = NULL;
	size_t len;
	int rc = mlens_textgen_decode(tg, &id, 1, false, &s, &len);

	if (rc == -EINVAL)
		return strdup("");	/* a model's padding id past the tokenizer's vocabulary */
	return rc ? NULL : s;
}
