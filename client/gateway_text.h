/* mlens-gateway's text side: the model's tokenizer (encode, decode, an
 * incremental detokenizer that only ever hands out whole UTF-8 characters)
 * and its chat template. The daemon sees token ids only; everything that
 * turns text into ids and back goes through these few calls. */
#ifndef MLENS_GATEWAY_TEXT_H
#define MLENS_GATEWAY_TEXT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gw_text;
struct gw_detok;

/* Open the tokenizer (tokenizer.json) and the chat template of model
 * directory dir. Returns 0 and *out, -ENOENT when dir holds no
 * tokenizer.json, another -errno with why filled otherwise. A directory
 * without a chat template (or with one that does not load) still opens:
 * chat requests are then refused. */
int gw_text_open(const char *dir, struct gw_text **out, char *why, size_t why_len);
void gw_text_close(struct gw_text *tx);

/* Token ids of len bytes of UTF-8 text in a new array (*ids, free()), with
 * the tokenizer's special tokens (BOS) when add_special. 0 or -errno. */
int gw_text_encode(struct gw_text *tx, const char *s, size_t len, bool add_special,
		   int32_t **ids, size_t *n);

/* The text of n ids in a new NUL-terminated string (*s, free()), special
 * tokens left out when skip_special. 0 or -errno (-ERANGE: an id outside
 * the vocabulary). */
int gw_text_decode(struct gw_text *tx, const int32_t *ids, size_t n, bool skip_special,
		   char **s, size_t *len);

/* The token ids of a chat (an OpenAI messages array) rendered by the
 * model's template, ending with the assistant's turn when
 * add_generation_prompt, in a new array (*ids, free()); the BOS is added
 * only when the template did not write it. -ENOENT no template, -EINVAL a
 * message the template refused (why says which and why). */
int gw_text_chat(struct gw_text *tx, const json_t *messages, bool add_generation_prompt,
		 int32_t **ids, size_t *n, char *why, size_t why_len);

/* Why chat is unavailable (no template, or one that did not load), or
 * NULL when it is. */
const char *gw_text_chat_problem(const struct gw_text *tx);

/* An incremental detokenizer over tx: each pushed id appends the text that
 * became certain (never half a UTF-8 character) to out, which grows. */
struct gw_detok *gw_detok_new(struct gw_text *tx);
void gw_detok_free(struct gw_detok *d);
/* Append the text id completes to *buf (*len bytes used, *cap allocated,
 * kept NUL-terminated). 0 or -errno. */
int gw_detok_push(struct gw_detok *d, int32_t id, char **buf, size_t *len, size_t *cap);
/* At the end of a generation: append what is still held back. */
int gw_detok_flush(struct gw_detok *d, char **buf, size_t *len, size_t *cap);

#endif
