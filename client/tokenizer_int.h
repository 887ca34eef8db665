/* Inside the tokenizer: the loaded tokenizer.json as components (a
 * normalizer, pre-tokenizer, BPE model, decoder and post-processor tree),
 * the hash tables of vocabulary, merges and words, and the byte strings
 * the stages pass along. tokenizer.c loads, tokenizer_encode.c encodes,
 * tokenizer_decode.c decodes. */
#ifndef MLENS_TOKENIZER_INT_H
#define MLENS_TOKENIZER_INT_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "mlens_tokenizer.h"

/* ==== Byte strings ==== */

/* A growable byte string. */
struct tok_buf {
	char *p;
	size_t len, cap;
};

int tok_buf_reserve(struct tok_buf *b, size_t more);
/* Room for n elements of size bytes in the array *v of capacity *cap
 * (doubling); 0 or -ENOMEM. TOK_GROW names the array once. */
int tok_grow(void **v, size_t *cap, size_t n, size_t size);
#define TOK_GROW(v, cap, n) tok_grow((void **)&(v), &(cap), (n), sizeof(*(v)))
int tok_buf_add(struct tok_buf *b, const void *s, size_t n);
void tok_buf_free(struct tok_buf *b);

/* A list of byte strings stored end to end in one buffer; a piece may
 * carry the flag "starts the original text" (Metaspace's prepend_scheme
 * first reads it). */
struct tok_piece {
	size_t off, len;
	bool first;
};
struct tok_list {
	struct tok_buf bytes;
	struct tok_piece *v;
	size_t n, cap;
};

int tok_list_add(struct tok_list *l, const void *s, size_t n, bool first);
void tok_list_clear(struct tok_list *l);
void tok_list_free(struct tok_list *l);

/* Length of the valid UTF-8 character at s (1..4), or 0 when s[0..n)
 * starts with an invalid sequence; *bad then gets its maximal subpart
 * (what one U+FFFD replaces). */
size_t tok_utf8_char(const uint8_t *s, size_t n, size_t *bad);
/* Append s to b with each invalid subpart replaced by U+FFFD. */
int tok_utf8_lossy(struct tok_buf *b, const char *s, size_t n);
/* Whether s is valid UTF-8. */
bool tok_utf8_valid(const char *s, size_t n);
/* Decode the (valid) character at s; returns its length. */
size_t tok_utf8_decode(const uint8_t *s, uint32_t *cp);
/* Encode cp into out (4 bytes room); returns the length. */
size_t tok_utf8_encode(uint32_t cp, char *out);

/* ==== Patterns: a literal string or a PCRE2 regex ==== */

struct tok_pattern {
	char *lit;		/* literal, when re is NULL */
	size_t lit_len;
	pcre2_code *re;		/* UTF + UCP */
	bool jit;		/* re is JIT-compiled: matched by pcre2_jit_match */
};

/* Calls fn for each match [s, e) of p in text[0, n), left to right, not
 * overlapping; empty matches are skipped. md is scratch match data. */
typedef int (*tok_match_fn)(void *arg, size_t s, size_t e);
int tok_pattern_each(const struct tok_pattern *p, pcre2_match_data *md, const char *text,
		     size_t n, tok_match_fn fn, void *arg);

/* Append s[0, n) to out with every match of p replaced by with. */
int tok_replace_all(const struct tok_pattern *p, pcre2_match_data *md, const char *s, size_t n,
		    const char *with, size_t with_len, struct tok_buf *out);

/* ==== Components ==== */

enum tok_norm_kind { TN_NFC, TN_NFD, TN_NFKC, TN_NFKD, TN_REPLACE, TN_PREPEND, TN_STRIP, TN_SEQ };
struct tok_norm {
	enum tok_norm_kind kind;
	struct tok_pattern pat;		/* Replace */
	char *content;			/* Replace: content; Prepend: prepend */
	size_t content_len;
	bool left, right;		/* Strip */
	struct tok_norm *sub;		/* Sequence */
	size_t n_sub;
};

enum tok_split_behavior { TS_REMOVED, TS_ISOLATED, TS_MERGED_PREV, TS_MERGED_NEXT, TS_CONTIGUOUS };
enum tok_prepend { TP_ALWAYS, TP_FIRST, TP_NEVER };
enum tok_pre_kind { TPT_BYTELEVEL, TPT_SPLIT, TPT_METASPACE, TPT_DIGITS, TPT_SEQ };
struct tok_pre {
	enum tok_pre_kind kind;
	struct tok_pattern pat;		/* Split; ByteLevel with use_regex */
	enum tok_split_behavior behavior;
	bool invert;
	bool add_prefix_space, use_regex;	/* ByteLevel */
	uint32_t replacement;		/* Metaspace */
	enum tok_prepend prepend;
	bool split;
	bool individual_digits;		/* Digits */
	struct tok_pre *sub;
	size_t n_sub;
};

enum tok_dec_kind { TD_BYTELEVEL, TD_REPLACE, TD_BYTEFALLBACK, TD_FUSE, TD_STRIP, TD_METASPACE, TD_SEQ };
struct tok_dec {
	enum tok_dec_kind kind;
	struct tok_pattern pat;		/* Replace */
	char *content;
	size_t content_len;
	uint32_t strip_char;		/* Strip */
	size_t start, stop;
	uint32_t replacement;		/* Metaspace */
	enum tok_prepend prepend;
	struct tok_dec *sub;
	size_t n_sub;
};

/* One added token of tokenizer.json's added_tokens. */
struct tok_added {
	int32_t id;
	char *content;
	size_t len;
	bool single_word, lstrip, rstrip, normalized, special;
};

/* Added tokens matched on one side of the normalizer: leftmost-longest
 * over literal strings, found through their first byte. */
struct tok_added_set {
	uint32_t *idx;			/* indexes into added[], longest first per first byte */
	uint32_t start[257];		/* idx[start[b]..start[b+1]) begin with byte b */
	size_t n;
};

/* ==== Hash tables ==== */

/* Open addressing with linear probing; slot holds id + 1 (0 empty). */
struct tok_vocab {
	uint32_t *slot;
	size_t mask;
};

struct tok_merge {
	uint64_t key;			/* left id << 32 | right id; ~0 empty */
	uint32_t rank;
	int32_t id;
};
struct tok_merges {
	struct tok_merge *slot;
	size_t mask;
};

/* Cache of word -> ids, filled as words are seen, emptied when full. */
struct tok_cache_ent {
	uint64_t hash;
	uint32_t key_off, key_len;
	uint32_t ids_off, n_ids;
};
struct tok_cache {
	pthread_mutex_t lock;
	struct tok_cache_ent *slot;
	size_t mask, used;
	struct tok_buf store;		/* keys and ids */
};

/* ==== The tokenizer ==== */

struct mlens_tokenizer {
	/* id -> token text: vocabulary and added tokens */
	char **id_text;
	uint32_t *id_len;
	uint8_t *id_special;
	uint32_t n_ids;
	char **model_text;		/* the model vocabulary's own strings */
	uint32_t *model_len;
	struct tok_vocab vocab;		/* model vocabulary */
	struct tok_vocab all;		/* model vocabulary and added tokens */

	/* BPE model */
	struct tok_merges merges;
	bool byte_fallback, fuse_unk, ignore_merges;
	int32_t unk_id;			/* -1 when none */
	char *prefix, *suffix;		/* continuing_subword_prefix, end_of_word_suffix */
	size_t prefix_len, suffix_len;
	/* SentencePiece-style models without a splitting pre-tokenizer: a
	 * piece may be cut before each word's leading replacement character
	 * (no merge can cross there, see ws_split_detect) */
	bool ws_split;
	char ws_rep[4];
	size_t ws_rep_len;
	int32_t byte_id[256];		/* ByteLevel: id of each byte's char, -1 none */
	int32_t fallback_id[256];	/* <0xNN> ids, -1 none */

	struct tok_norm *norm;		/* NULL: none */
	struct tok_pre *pre;
	struct tok_dec *dec;

	struct tok_added *added;
	size_t n_added;
	struct tok_added_set raw_set, norm_set;

	/* post-processing (MLENS_TOK_ADD_SPECIAL): ids before and after */
	int32_t *pre_ids, *post_ids;
	size_t n_pre_ids, n_post_ids;

	int32_t bos_id;
	int32_t *eos_ids;
	size_t n_eos;

	struct tok_cache *cache;
};

/* Parse a tokenizer.json held in memory (what mlens_tokenizer_open and the
 * fuzz target call); name is the file named in messages. */
int tok_load_json(const char *json, size_t len, const char *name, struct mlens_tokenizer **tok,
		  char *err, size_t err_len);

/* Hash of a byte string. */
uint64_t tok_hash(const void *s, size_t n);
/* Vocabulary id of a string, or -1. */
int32_t tok_vocab_get(const struct mlens_tokenizer *tok, const struct tok_vocab *v, const char *s,
		      size_t n);
/* The rank and result of merging left and right; false when no merge. */
bool tok_merge_get(const struct tok_merges *m, int32_t left, int32_t right, uint32_t *rank,
		   int32_t *id);

/* GPT-2's byte <-> char map of the ByteLevel components. */
uint32_t tok_byte_char(uint8_t b);
int tok_char_byte(uint32_t cp);

/* Apply a decoder tree to a list of token strings in place; *tail gets
 * how many bytes at the end the byte decoders made U+FFFD for a cut
 * UTF-8 character (0 when none). */
int tok_decode_chain(const struct tok_dec *d, struct tok_list *l, size_t *tail);

#endif
