/* The model's tokenizer, on the tenant side of libmlens: text to token ids
 * and back, read from a Hugging Face model directory's tokenizer.json
 * (with tokenizer_config.json and generation_config.json for BOS and EOS),
 * and an incremental decoder that turns a stream of generated ids into
 * text without ever cutting a UTF-8 character. Errors are negative errno
 * values. A tokenizer is read-only once open: any number of threads may
 * encode and decode with one at once; a struct mlens_detok belongs to one
 * thread at a time. */
#ifndef MLENS_TOKENIZER_H
#define MLENS_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A loaded tokenizer. Opaque. */
struct mlens_tokenizer;

/* An incremental decoder of one generated sequence. Opaque. */
struct mlens_detok;

/* Flags of mlens_tokenizer_encode: add the special tokens the tokenizer
 * adds around a text (BOS, EOS) as the model directory says. */
#define MLENS_TOK_ADD_SPECIAL (1u << 0)
/* Flags of mlens_tokenizer_decode and mlens_detok_new: leave special
 * tokens (BOS, EOS, chat markers) out of the text. */
#define MLENS_TOK_SKIP_SPECIAL (1u << 1)

/* Load DIR/tokenizer.json (and DIR/tokenizer_config.json,
 * DIR/generation_config.json when present). On failure returns -errno
 * (-ENOENT no tokenizer.json, -EINVAL malformed, -ENOTSUP a component
 * this library does not implement, -ENOMEM) and, when err is not NULL,
 * writes a message naming the file and what is wrong into err. */
int mlens_tokenizer_open(const char *dir, struct mlens_tokenizer **tok, char *err,
			 size_t err_len);

/* Free a tokenizer (NULL is fine). No encode, decode or detok may be in
 * flight on it. */
void mlens_tokenizer_free(struct mlens_tokenizer *tok);

/* Encode len bytes of UTF-8 text (invalid sequences are read as U+FFFD)
 * into ids. Writes at most cap ids and sets *n to the count the text
 * needs; returns 0, -ENOBUFS when cap was too small (call again with
 * *n), -ENOMEM. */
int mlens_tokenizer_encode(const struct mlens_tokenizer *tok, const char *text, size_t len,
			   unsigned flags, int32_t *ids, size_t cap, size_t *n);

/* Decode n ids into UTF-8 text in buf, NUL-terminated when it fits. Sets
 * *len to the text's length (without the NUL); returns 0, -ENOBUFS when
 * cap < *len + 1 (call again with a larger buf), -EINVAL for an id
 * outside the vocabulary, -ENOMEM. Byte sequences that are not valid
 * UTF-8 decode as U+FFFD. */
int mlens_tokenizer_decode(const struct mlens_tokenizer *tok, const int32_t *ids, size_t n,
			   unsigned flags, char *buf, size_t cap, size_t *len);

/* Ids span [0, vocab_size); some inside may be unused. */
uint32_t mlens_tokenizer_vocab_size(const struct mlens_tokenizer *tok);

/* The id of a token given as its vocabulary string (added tokens
 * included), or -ENOENT. */
int32_t mlens_tokenizer_token_id(const struct mlens_tokenizer *tok, const char *token,
				 size_t len);

/* The vocabulary string of an id (NUL-terminated, owned by tok), or NULL
 * when the id is outside the vocabulary. *len, when len is not NULL, gets
 * its length. */
const char *mlens_tokenizer_id_token(const struct mlens_tokenizer *tok, int32_t id,
				     size_t *len);

/* 1 when id is a special token (skipped by MLENS_TOK_SKIP_SPECIAL), else 0. */
int mlens_tokenizer_is_special(const struct mlens_tokenizer *tok, int32_t id);

/* The BOS id, or -ENOENT when the model has none. */
int32_t mlens_tokenizer_bos(const struct mlens_tokenizer *tok);

/* Writes up to cap EOS ids (generation ends at any of them) and returns
 * how many the model has (0 when none). */
int mlens_tokenizer_eos(const struct mlens_tokenizer *tok, int32_t *ids, size_t cap);

/* Start decoding one sequence, id by id (flags: MLENS_TOK_SKIP_SPECIAL).
 * Returns 0, -ENOMEM. */
int mlens_detok_new(const struct mlens_tokenizer *tok, unsigned flags, struct mlens_detok **d);

/* Push one generated id. *text and *len get the text it completes, which
 * may be empty (the bytes of a UTF-8 character a token cuts are held until
 * the character is whole); the text stays valid until the next call on d.
 * Returns 0, -EINVAL for an id outside the vocabulary, -ENOMEM. */
int mlens_detok_push(struct mlens_detok *d, int32_t id, const char **text, size_t *len);

/* End of the sequence: *text and *len get what is still held (an
 * unfinished character as U+FFFD). d may then start a new sequence. */
int mlens_detok_flush(struct mlens_detok *d, const char **text, size_t *len);

/* Free an incremental decoder (NULL is fine). */
void mlens_detok_free(struct mlens_detok *d);

#ifdef __cplusplus
}
#endif

#endif
