/* mlens-gateway's text side over libmlens's tokenizer and chat template.
 * (Placeholder until the tokenizer is in: every call says it is missing,
 * so the gateway serves token-id prompts only.) */
#include <errno.h>
#include <stdio.h>
#include "client/gateway_text.h"

int gw_text_open(const char *dir, struct gw_text **out, char *why, size_t why_len)
{
	*out = NULL;
	snprintf(why, why_len, "this mlens-gateway was built without a tokenizer");
	return -ENOTSUP;
}

void gw_text_close(struct gw_text *tx)
{
}

int gw_text_encode(struct gw_text *tx, const char *s, size_t len, bool add_special,
		   int32_t **ids, size_t *n)
{
	return -ENOTSUP;
}

int gw_text_decode(struct gw_text *tx, const int32_t *ids, size_t n, bool skip_special,
		   char **s, size_t *len)
{
	return -ENOTSUP;
}

int gw_text_chat(struct gw_text *tx, const json_t *messages, bool add_generation_prompt,
		 char **prompt, char *why, size_t why_len)
{
	snprintf(why, why_len, "no chat template");
	return -ENOENT;
}

bool gw_text_chat_has_bos(const struct gw_text *tx)
{
	return false;
}

struct gw_detok *gw_detok_new(struct gw_text *tx)
{
	return NULL;
}

void gw_detok_free(struct gw_detok *d)
{
}

int gw_detok_push(struct gw_detok *d, int32_t id, char **buf, size_t *len, size_t *cap)
{
	return -ENOTSUP;
}

int gw_detok_flush(struct gw_detok *d, char **buf, size_t *len, size_t *cap)
{
	return -ENOTSUP;
}
