/* Text generation's text side, shared by mlens generate and mlens-gateway:
 * a model directory's tokenizer and chat template turn text prompts and
 * chats into token ids, and the generated ids become text through an
 * incremental decoder (never half a UTF-8 character), cut before the first
 * stop string. The daemon sees token ids only. */
#ifndef MLENS_TEXTGEN_H
#define MLENS_TEXTGEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A model directory's tokenizer and chat template. */
struct mlens_textgen;
struct mlens_detok;

/* Load dir's tokenizer.json (and tokenizer_config.json). A chat template
 * that is missing or does not load leaves text prompts working and chats
 * refused. 0, or -errno with err (-ENOENT: no tokenizer.json). */
int mlens_textgen_open(const char *dir, struct mlens_textgen **out, char *err, size_t errlen);
void mlens_textgen_free(struct mlens_textgen *tg);

/* How many ids the tokenizer knows (ids 0 to this less 1). */
uint32_t mlens_textgen_vocab_size(const struct mlens_textgen *tg);

/* NULL when chats work, else why not: the template's load error, or none
 * (the directory has no template) when it said nothing. */
const char *mlens_textgen_chat_problem(const struct mlens_textgen *tg, const char *none);

/* Token ids of len bytes of UTF-8 text in a new array (*ids, free()), with
 * the tokenizer's special tokens (BOS) when add_special. 0 or -errno. */
int mlens_textgen_encode(const struct mlens_textgen *tg, const char *s, size_t len,
			 bool add_special, int32_t **ids, size_t *n);

/* The text of n ids in a new NUL-terminated string (*s, free()), special
 * tokens left out when skip_special. 0 or -errno (-EINVAL: an id outside
 * the vocabulary). */
int mlens_textgen_decode(const struct mlens_textgen *tg, const int32_t *ids, size_t n,
			 bool skip_special, char **s, size_t *len);

/* A chat (messages: an OpenAI messages array as JSON text) rendered by the
 * template, ending with the assistant's turn when add_generation_prompt,
 * into a new string (*text, free()); *add_special says whether its
 * encoding is to add the BOS (only when the template did not write it).
 * 0; -ENOENT no template (why: mlens_textgen_chat_problem's, none the
 * fallback); -EINVAL the template refused the messages (why says which and
 * why); -ENOMEM. */
int mlens_textgen_render(const struct mlens_textgen *tg, const char *messages,
			 bool add_generation_prompt, const char *none, char **text, size_t *len,
			 bool *add_special, char *why, size_t why_len);

/* The decoded text of one generated sequence, special tokens left out,
 * cut before the first stop string. Stop strings are non-empty,
 * NUL-terminated and the same for each call on one text. */
struct mlens_textgen_text {
	struct mlens_detok *dt;	/* NULL: no tokenizer, no text */
	char *buf;		/* NUL-terminated once anything was added */
	size_t len, cap;
	size_t safe;		/* no stop string can begin before this */
	size_t sent;		/* handed out (streamed) so far; the caller's */
	bool stopped;		/* a stop string cut the text */
	bool flushed;		/* the sequence ended */
};

/* 0 or -ENOMEM. */
int mlens_textgen_text_init(struct mlens_textgen_text *t, const struct mlens_textgen *tg);
void mlens_textgen_text_free(struct mlens_textgen_text *t);
/* Add a generated token (an id past the tokenizer's vocabulary, which a
 * model's padding may be, has no text). Returns 1 when the text now meets
 * a stop string (it is cut there; later tokens are ignored), 0, or
 * -errno. */
int mlens_textgen_text_push(struct mlens_textgen_text *t, char *const *stops, size_t n_stops,
			    int32_t id);
/* The sequence ended: what the decoder held joins the text (checked for
 * stop strings), and all of it becomes safe. Once only; 1, 0, -errno as
 * push. */
int mlens_textgen_text_finish(struct mlens_textgen_text *t, char *const *stops,
			      size_t n_stops);
/* Append n bytes of decoded text and look for stop strings in it (what
 * push does after decoding; end: the last text, all of it safe). 1, 0 or
 * -ENOMEM as push. */
int mlens_textgen_text_add(struct mlens_textgen_text *t, char *const *stops, size_t n_stops,
			   const char *p, size_t n, bool end);

#endif
