/* Loading a tokenizer: tokenizer.json (Hugging Face tokenizers format)
 * parsed through jansson into the component tree of tokenizer_int.h, the
 * vocabulary and merge-rank hash tables, and the BOS/EOS ids of
 * tokenizer_config.json and generation_config.json. Also the byte-string
 * and UTF-8 helpers every stage shares, and the id/token lookups. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "client/tokenizer_int.h"

/* ==== Byte strings ==== */

int tok_buf_reserve(struct tok_buf *b, size_t more)
{
	size_t want, cap;
	char *p;

	if (more > SIZE_MAX / 2 - b->len)
		return -ENOMEM;
	want = b->len + more;
	if (want <= b->cap)
		return 0;
	cap = b->cap ? b->cap : 64;
	while (cap < want)
		cap *= 2;
	p = realloc(b->p, cap);
	if (!p)
		return -ENOMEM;
	b->p = p;
	b->cap = cap;
	return 0;
}

int tok_grow(void **v, size_t *cap, size_t n, size_t size)
{
	size_t c = *cap ? *cap : 16;
	void *p;

	if (n <= *cap)
		return 0;
	while (c < n)
		c *= 2;
	if (c > SIZE_MAX / size || !(p = realloc(*v, c * size)))
		return -ENOMEM;
	*v = p;
	*cap = c;
	return 0;
}

int tok_buf_add(struct tok_buf *b, const void *s, size_t n)
{
	/* even an empty add leaves p pointing somewhere: offsets into it stay defined */
	if (tok_buf_reserve(b, n ? n : 1))
		return -ENOMEM;
	if (n)
		memcpy(b->p + b->len, s, n);
	b->len += n;
	return 0;
}

void tok_buf_free(struct tok_buf *b)
{
	free(b->p);
	memset(b, 0, sizeof(*b));
}

int tok_list_add(struct tok_list *l, const void *s, size_t n, bool first)
{
	size_t off = l->bytes.len;

	if (TOK_GROW(l->v, l->cap, l->n + 1))
		return -ENOMEM;
	if (tok_buf_add(&l->bytes, s, n))
		return -ENOMEM;
	l->v[l->n++] = (struct tok_piece){ off, n, first };
	return 0;
}

void tok_list_clear(struct tok_list *l)
{
	l->bytes.len = 0;
	l->n = 0;
}

void tok_list_free(struct tok_list *l)
{
	tok_buf_free(&l->bytes);
	free(l->v);
	memset(l, 0, sizeof(*l));
}

/* ==== UTF-8 ==== */

size_t tok_utf8_char(const uint8_t *s, size_t n, size_t *bad)
{
	uint8_t c = s[0], lo = 0x80, hi = 0xBF;
	size_t need, i;

	if (c < 0x80)
		return 1;
	if (c >= 0xC2 && c <= 0xDF)
		need = 1;
	else if (c >= 0xE0 && c <= 0xEF) {
		need = 2;
		if (c == 0xE0)
			lo = 0xA0;
		else if (c == 0xED)
			hi = 0x9F;
	} else if (c >= 0xF0 && c <= 0xF4) {
		need = 3;
		if (c == 0xF0)
			lo = 0x90;
		else if (c == 0xF4)
			hi = 0x8F;
	} else {
		*bad = 1;
		return 0;
	}
	for (i = 1; i <= need; i++) {
		if (i >= n || s[i] < lo || s[i] > hi) {
			*bad = i;
			return 0;
		}
		lo = 0x80;
		hi = 0xBF;
	}
	return need + 1;
}

int tok_utf8_lossy(struct tok_buf *b, const char *s, size_t n)
{
	const uint8_t *u = (const uint8_t *)s;
	size_t i = 0, run = 0, bad, k;

	if (!n)
		return 0;
	while (i < n) {
		k = tok_utf8_char(u + i, n - i, &bad);
		if (k) {
			i += k;
			continue;
		}
		if (tok_buf_add(b, s + run, i - run) || tok_buf_add(b, "\xEF\xBF\xBD", 3))
			return -ENOMEM;
		i += bad;
		run = i;
	}
	return tok_buf_add(b, s + run, n - run);
}

bool tok_utf8_valid(const char *s, size_t n)
{
	const uint8_t *u = (const uint8_t *)s;
	size_t i = 0, bad, k;

	while (i < n) {
		if (u[i] < 0x80) {
			i++;
			continue;
		}
		k = tok_utf8_char(u + i, n - i, &bad);
		if (!k)
			return false;
		i += k;
	}
	return true;
}

size_t tok_utf8_decode(const uint8_t *s, uint32_t *cp)
{
	if (s[0] < 0x80) {
		*cp = s[0];
		return 1;
	}
	if (s[0] < 0xE0) {
		*cp = (uint32_t)(s[0] & 0x1F) << 6 | (s[1] & 0x3F);
		return 2;
	}
	if (s[0] < 0xF0) {
		*cp = (uint32_t)(s[0] & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
		return 3;
	}
	*cp = (uint32_t)(s[0] & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 |
	      (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
	return 4;
}

size_t tok_utf8_encode(uint32_t cp, char *out)
{
	uint8_t *o = (uint8_t *)out;

	if (cp < 0x80) {
		o[0] = (uint8_t)cp;
		return 1;
	}
	if (cp < 0x800) {
		o[0] = (uint8_t)(0xC0 | cp >> 6);
		o[1] = (uint8_t)(0x80 | (cp & 0x3F));
		return 2;
	}
	if (cp < 0x10000) {
		o[0] = (uint8_t)(0xE0 | cp >> 12);
		o[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
		o[2] = (uint8_t)(0x80 | (cp & 0x3F));
		return 3;
	}
	o[0] = (uint8_t)(0xF0 | cp >> 18);
	o[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
	o[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
	o[3] = (uint8_t)(0x80 | (cp & 0x3F));
	return 4;
}

/* GPT-2's map: printable Latin-1 bytes stand for themselves, the rest
 * take the code points from 256 up, in byte order; both directions are
 * built once. */
static uint32_t byte_map[256];
static int16_t char_map[256 + 68];
static pthread_once_t maps_once = PTHREAD_ONCE_INIT;

static void maps_build(void)
{
	uint32_t n = 0;

	for (int i = 0; i < 256 + 68; i++)
		char_map[i] = -1;
	for (int i = 0; i < 256; i++) {
		bool keep = (i >= '!' && i <= '~') || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE;

		byte_map[i] = keep ? (uint32_t)i : 256 + n++;
		char_map[byte_map[i]] = (int16_t)i;
	}
}

uint32_t tok_byte_char(uint8_t b)
{
	pthread_once(&maps_once, maps_build);
	return byte_map[b];
}

int tok_char_byte(uint32_t cp)
{
	if (cp >= 256 + 68)
		return -1;
	pthread_once(&maps_once, maps_build);
	return char_map[cp];
}

/* ==== Hash tables ==== */

uint64_t tok_hash(const void *s, size_t n)
{
	const uint8_t *p = s;
	uint64_t h = 0xcbf29ce484222325ull;

	while (n >= 8) {
		uint64_t w;

		memcpy(&w, p, 8);
		h = (h ^ w) * 0x100000001b3ull;
		h ^= h >> 29;
		p += 8;
		n -= 8;
	}
	while (n--)
		h = (h ^ *p++) * 0x100000001b3ull;
	return h ^ (h >> 32);
}

static size_t table_size(size_t n)
{
	size_t s = 16;

	while (s < n * 2)
		s *= 2;
	return s;
}

/* The string a table's slot stands for (defined with the loader). */
static const char *vocab_text(const struct mlens_tokenizer *tok, const struct tok_vocab *v,
			      uint32_t id, size_t *len);

static int vocab_init(struct tok_vocab *v, size_t n)
{
	size_t s = table_size(n);

	v->slot = calloc(s, sizeof(*v->slot));
	v->mask = s - 1;
	return v->slot ? 0 : -ENOMEM;
}

int32_t tok_vocab_get(const struct mlens_tokenizer *tok, const struct tok_vocab *v, const char *s,
		      size_t n)
{
	size_t i = tok_hash(s, n) & v->mask, len;

	for (; v->slot[i]; i = (i + 1) & v->mask) {
		const char *t = vocab_text(tok, v, v->slot[i] - 1, &len);

		if (len == n && !memcmp(t, s, n))
			return (int32_t)(v->slot[i] - 1);
	}
	return -1;
}

/* Insert id under its string; an id already there for the string stays
 * (the first wins) unless replace is set. */
static void vocab_put(const struct mlens_tokenizer *tok, struct tok_vocab *v, const char *s,
		      size_t n, uint32_t id, bool replace)
{
	size_t i = tok_hash(s, n) & v->mask, len;

	for (; v->slot[i]; i = (i + 1) & v->mask) {
		const char *t = vocab_text(tok, v, v->slot[i] - 1, &len);

		if (len == n && !memcmp(t, s, n)) {
			if (replace)
				v->slot[i] = id + 1;
			return;
		}
	}
	v->slot[i] = id + 1;
}

bool tok_merge_get(const struct tok_merges *m, int32_t left, int32_t right, uint32_t *rank,
		   int32_t *id)
{
	uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
	size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & m->mask;

	for (; m->slot[i].key != UINT64_MAX; i = (i + 1) & m->mask)
		if (m->slot[i].key == key) {
			*rank = m->slot[i].rank;
			*id = m->slot[i].id;
			return true;
		}
	return false;
}

static void merge_put(struct tok_merges *m, int32_t left, int32_t right, uint32_t rank, int32_t id)
{
	uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
	size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & m->mask;

	/* a pair listed twice takes its later rank, as a map built in order does */
	while (m->slot[i].key != UINT64_MAX && m->slot[i].key != key)
		i = (i + 1) & m->mask;
	m->slot[i] = (struct tok_merge){ key, rank, id };
}

/* ==== Loading ==== */

/* Where parsing stands: the file named in messages, the message buffer. */
struct load {
	const char *name;
	char *err;
	size_t err_len;
	struct mlens_tokenizer *tok;
};

__attribute__((format(printf, 3, 4)))
static int fail(struct load *ld, int rc, const char *fmt, ...)
{
	va_list ap;
	int k;

	if (!ld->err || !ld->err_len)
		return rc;
	k = snprintf(ld->err, ld->err_len, "%s: ", ld->name);
	if (k < 0 || (size_t)k >= ld->err_len)
		return rc;
	va_start(ap, fmt);
	vsnprintf(ld->err + k, ld->err_len - (size_t)k, fmt, ap);
	va_end(ap);
	return rc;
}

static const char *vocab_text(const struct mlens_tokenizer *tok, const struct tok_vocab *v,
			      uint32_t id, size_t *len)
{
	/* vocab holds the model's own strings; all the text an id decodes
	 * from (an added token's content where one took the id) */
	if (v == &tok->vocab) {
		*len = tok->model_len[id];
		return tok->model_text[id];
	}
	*len = tok->id_len[id];
	return tok->id_text[id];
}

static const char *jstr(json_t *o, const char *key, size_t *len)
{
	json_t *v = json_object_get(o, key);

	if (!json_is_string(v))
		return NULL;
	if (len)
		*len = json_string_length(v);
	return json_string_value(v);
}

static bool jbool(json_t *o, const char *key, bool def)
{
	json_t *v = json_object_get(o, key);

	return json_is_boolean(v) ? json_is_true(v) : def;
}

static char *dupn(const char *s, size_t n)
{
	char *d = malloc(n + 1);

	if (d) {
		memcpy(d, s, n);
		d[n] = 0;
	}
	return d;
}

/* First code point of a one-character string field (Metaspace, Strip). */
static int jchar(struct load *ld, json_t *o, const char *key, const char *what, uint32_t *cp)
{
	size_t n;
	const char *s = jstr(o, key, &n);

	if (!s || !n || !tok_utf8_valid(s, n))
		return fail(ld, -EINVAL, "%s: \"%s\" must be a one-character string", what, key);
	tok_utf8_decode((const uint8_t *)s, cp);
	return 0;
}

static int pattern_parse(struct load *ld, json_t *o, const char *what, struct tok_pattern *p)
{
	json_t *pat = json_object_get(o, "pattern");
	const char *s;
	size_t n;
	int ec;
	PCRE2_SIZE off;

	if ((s = jstr(pat, "String", &n))) {
		p->lit = dupn(s, n);
		p->lit_len = n;
		return p->lit ? 0 : -ENOMEM;
	}
	if (!(s = jstr(pat, "Regex", &n)))
		return fail(ld, -EINVAL, "%s: \"pattern\" must be {\"String\": ...} or {\"Regex\": ...}",
			    what);
	p->re = pcre2_compile((PCRE2_SPTR)s, n, PCRE2_UTF | PCRE2_UCP, &ec, &off, NULL);
	if (!p->re) {
		PCRE2_UCHAR msg[160];

		pcre2_get_error_message(ec, msg, sizeof(msg));
		return fail(ld, -EINVAL, "%s: regex at offset %zu does not compile: %s", what,
			    (size_t)off, (const char *)msg);
	}
	/* the interpreter serves if JIT cannot */
	p->jit = pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE) == 0;
	return 0;
}

static void pattern_free(struct tok_pattern *p)
{
	free(p->lit);
	if (p->re)
		pcre2_code_free(p->re);
}

int tok_pattern_each(const struct tok_pattern *p, pcre2_match_data *md, const char *text,
		     size_t n, tok_match_fn fn, void *arg)
{
	size_t at = 0;
	int rc;

	if (!p->re) {
		if (!p->lit_len)
			return 0;
		while (at + p->lit_len <= n) {
			const char *hit = memmem(text + at, n - at, p->lit, p->lit_len);

			if (!hit)
				break;
			at = (size_t)(hit - text);
			if ((rc = fn(arg, at, at + p->lit_len)))
				return rc;
			at += p->lit_len;
		}
		return 0;
	}
	while (at <= n) {
		PCRE2_SIZE *ov;

		rc = p->jit ? pcre2_jit_match(p->re, (PCRE2_SPTR)text, n, at, 0, md, NULL)
			    : pcre2_match(p->re, (PCRE2_SPTR)text, n, at, PCRE2_NO_UTF_CHECK, md, NULL);
		if (rc == PCRE2_ERROR_NOMATCH)
			return 0;
		if (rc < 0)
			return -EINVAL;	/* match limit: the text is left unsplit there */
		ov = pcre2_get_ovector_pointer(md);
		if ((rc = fn(arg, ov[0], ov[1])))
			return rc;
		if (ov[1] > ov[0]) {
			at = ov[1];
		} else {	/* an empty match: step one character on */
			size_t bad;
			size_t k = ov[0] < n ? tok_utf8_char((const uint8_t *)text + ov[0], n - ov[0], &bad) : 1;

			at = ov[0] + (k ? k : 1);
		}
	}
	return 0;
}

struct repl {
	const char *s;
	size_t at;
	struct tok_buf *out;
	const char *with;
	size_t with_len;
};

static int repl_fn(void *arg, size_t s, size_t e)
{
	struct repl *r = arg;

	if (tok_buf_add(r->out, r->s + r->at, s - r->at) || tok_buf_add(r->out, r->with, r->with_len))
		return -ENOMEM;
	r->at = e;
	return 0;
}

int tok_replace_all(const struct tok_pattern *p, pcre2_match_data *md, const char *s, size_t n,
		    const char *with, size_t with_len, struct tok_buf *out)
{
	struct repl r = { s, 0, out, with, with_len };
	int rc = tok_pattern_each(p, md, s, n, repl_fn, &r);

	if (rc && rc != -EINVAL)
		return rc;
	return tok_buf_add(out, s + r.at, n - r.at);
}

#define MAX_DEPTH 16

/* A Sequence's members: the array under key, each parsed by parse into
 * an element of size bytes of a new array. */
typedef int (*member_parse_fn)(struct load *ld, json_t *o, void *member, int depth);

static int seq_parse(struct load *ld, json_t *o, const char *key, const char *what, size_t size,
		     member_parse_fn parse, void **sub, size_t *n_sub, int depth)
{
	json_t *a = json_object_get(o, key);
	int rc;

	if (!json_is_array(a))
		return fail(ld, -EINVAL, "%s Sequence without a \"%s\" array", what, key);
	if (!(*sub = calloc(json_array_size(a) + 1, size)))
		return -ENOMEM;
	for (size_t i = 0; i < json_array_size(a); i++) {
		*n_sub = i + 1;
		if ((rc = parse(ld, json_array_get(a, i), (char *)*sub + i * size, depth + 1)))
			return rc;
	}
	return 0;
}

static int norm_parse(struct load *ld, json_t *o, struct tok_norm *nm, int depth);
static int pre_parse(struct load *ld, json_t *o, struct tok_pre *pt, int depth);
static int dec_parse(struct load *ld, json_t *o, struct tok_dec *d, int depth);
static void norm_free(struct tok_norm *nm);

/* seq_parse's view of each parser */
static int norm_member(struct load *ld, json_t *o, void *m, int depth)
{
	return norm_parse(ld, o, m, depth);
}

static int pre_member(struct load *ld, json_t *o, void *m, int depth)
{
	return pre_parse(ld, o, m, depth);
}

static int dec_member(struct load *ld, json_t *o, void *m, int depth)
{
	return dec_parse(ld, o, m, depth);
}

static int norm_parse(struct load *ld, json_t *o, struct tok_norm *nm, int depth)
{
	const char *t = jstr(o, "type", NULL), *s;
	size_t n;

	if (!t)
		return fail(ld, -EINVAL, "normalizer without a \"type\"");
	if (depth > MAX_DEPTH)
		return fail(ld, -EINVAL, "normalizer Sequence nested deeper than %d", MAX_DEPTH);
	if (!strcmp(t, "NFC") || !strcmp(t, "NFD") || !strcmp(t, "NFKC") || !strcmp(t, "NFKD")) {
		nm->kind = !strcmp(t, "NFC") ? TN_NFC : !strcmp(t, "NFD") ? TN_NFD :
			   !strcmp(t, "NFKC") ? TN_NFKC : TN_NFKD;
		return 0;
	}
	if (!strcmp(t, "Replace")) {
		nm->kind = TN_REPLACE;
		if (!(s = jstr(o, "content", &n)))
			return fail(ld, -EINVAL, "normalizer Replace without a \"content\" string");
		if (!(nm->content = dupn(s, n)))
			return -ENOMEM;
		nm->content_len = n;
		return pattern_parse(ld, o, "normalizer Replace", &nm->pat);
	}
	if (!strcmp(t, "Prepend")) {
		nm->kind = TN_PREPEND;
		if (!(s = jstr(o, "prepend", &n)))
			return fail(ld, -EINVAL, "normalizer Prepend without a \"prepend\" string");
		nm->content_len = n;
		return (nm->content = dupn(s, n)) ? 0 : -ENOMEM;
	}
	if (!strcmp(t, "Strip")) {
		nm->kind = TN_STRIP;
		nm->left = jbool(o, "strip_left", true);
		nm->right = jbool(o, "strip_right", true);
		return 0;
	}
	if (!strcmp(t, "Sequence")) {
		nm->kind = TN_SEQ;
		return seq_parse(ld, o, "normalizers", "normalizer", sizeof(*nm->sub),
				 norm_member, (void **)&nm->sub, &nm->n_sub, depth);
	}
	return fail(ld, -ENOTSUP, "normalizer \"%s\" is not supported (this library implements NFC, "
		    "NFD, NFKC, NFKD, Replace, Prepend, Strip and Sequence)", t);
}

static void norm_free(struct tok_norm *nm)
{
	for (size_t i = 0; i < nm->n_sub; i++)
		norm_free(&nm->sub[i]);
	free(nm->sub);
	free(nm->content);
	pattern_free(&nm->pat);
}

static int prepend_parse(struct load *ld, json_t *o, const char *what, enum tok_prepend *p)
{
	const char *s = jstr(o, "prepend_scheme", NULL);

	if (!s) {	/* older files: add_prefix_space */
		*p = jbool(o, "add_prefix_space", true) ? TP_ALWAYS : TP_NEVER;
		return 0;
	}
	if (!strcmp(s, "always"))
		*p = TP_ALWAYS;
	else if (!strcmp(s, "first"))
		*p = TP_FIRST;
	else if (!strcmp(s, "never"))
		*p = TP_NEVER;
	else
		return fail(ld, -EINVAL, "%s: prepend_scheme \"%s\" is none of always, first, never",
			    what, s);
	return 0;
}

/* The GPT-2 pattern of ByteLevel's use_regex. */
static const char gpt2_re[] =
	"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int regex_fixed(struct load *ld, const char *re, struct tok_pattern *p)
{
	int ec;
	PCRE2_SIZE off;

	p->re = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &ec,
			      &off, NULL);
	if (!p->re)
		return fail(ld, -EINVAL, "built-in regex does not compile (PCRE2 without Unicode?)");
	p->jit = pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE) == 0;
	return 0;
}

static int pre_parse(struct load *ld, json_t *o, struct tok_pre *pt, int depth)
{
	const char *t = jstr(o, "type", NULL), *s;

	if (!t)
		return fail(ld, -EINVAL, "pre_tokenizer without a \"type\"");
	if (depth > MAX_DEPTH)
		return fail(ld, -EINVAL, "pre_tokenizer Sequence nested deeper than %d", MAX_DEPTH);
	if (!strcmp(t, "ByteLevel")) {
		pt->kind = TPT_BYTELEVEL;
		pt->add_prefix_space = jbool(o, "add_prefix_space", true);
		pt->use_regex = jbool(o, "use_regex", true);
		return pt->use_regex ? regex_fixed(ld, gpt2_re, &pt->pat) : 0;
	}
	if (!strcmp(t, "Split")) {
		pt->kind = TPT_SPLIT;
		pt->invert = jbool(o, "invert", false);
		s = jstr(o, "behavior", NULL);
		if (!s)
			return fail(ld, -EINVAL, "pre_tokenizer Split without a \"behavior\"");
		if (!strcmp(s, "Removed"))
			pt->behavior = TS_REMOVED;
		else if (!strcmp(s, "Isolated"))
			pt->behavior = TS_ISOLATED;
		else if (!strcmp(s, "MergedWithPrevious"))
			pt->behavior = TS_MERGED_PREV;
		else if (!strcmp(s, "MergedWithNext"))
			pt->behavior = TS_MERGED_NEXT;
		else if (!strcmp(s, "Contiguous"))
			pt->behavior = TS_CONTIGUOUS;
		else
			return fail(ld, -ENOTSUP, "pre_tokenizer Split: behavior \"%s\" is not supported", s);
		return pattern_parse(ld, o, "pre_tokenizer Split", &pt->pat);
	}
	if (!strcmp(t, "Metaspace")) {
		int rc;

		pt->kind = TPT_METASPACE;
		pt->split = jbool(o, "split", true);
		if ((rc = jchar(ld, o, "replacement", "pre_tokenizer Metaspace", &pt->replacement)))
			return rc;
		return prepend_parse(ld, o, "pre_tokenizer Metaspace", &pt->prepend);
	}
	if (!strcmp(t, "Digits")) {
		pt->kind = TPT_DIGITS;
		pt->individual_digits = jbool(o, "individual_digits", false);
		pt->behavior = TS_ISOLATED;
		return regex_fixed(ld, pt->individual_digits ? "\\p{N}" : "\\p{N}+", &pt->pat);
	}
	if (!strcmp(t, "Sequence")) {
		pt->kind = TPT_SEQ;
		return seq_parse(ld, o, "pretokenizers", "pre_tokenizer", sizeof(*pt->sub),
				 pre_member, (void **)&pt->sub, &pt->n_sub, depth);
	}
	return fail(ld, -ENOTSUP, "pre_tokenizer \"%s\" is not supported (this library implements "
		    "ByteLevel, Split, Metaspace, Digits and Sequence)", t);
}

static void pre_free(struct tok_pre *pt)
{
	for (size_t i = 0; i < pt->n_sub; i++)
		pre_free(&pt->sub[i]);
	free(pt->sub);
	pattern_free(&pt->pat);
}

static int dec_parse(struct load *ld, json_t *o, struct tok_dec *d, int depth)
{
	const char *t = jstr(o, "type", NULL), *s;
	size_t n;
	int rc;

	if (!t)
		return fail(ld, -EINVAL, "decoder without a \"type\"");
	if (depth > MAX_DEPTH)
		return fail(ld, -EINVAL, "decoder Sequence nested deeper than %d", MAX_DEPTH);
	if (!strcmp(t, "ByteLevel")) {
		d->kind = TD_BYTELEVEL;
		return 0;
	}
	if (!strcmp(t, "ByteFallback")) {
		d->kind = TD_BYTEFALLBACK;
		return 0;
	}
	if (!strcmp(t, "Fuse")) {
		d->kind = TD_FUSE;
		return 0;
	}
	if (!strcmp(t, "Replace")) {
		d->kind = TD_REPLACE;
		if (!(s = jstr(o, "content", &n)))
			return fail(ld, -EINVAL, "decoder Replace without a \"content\" string");
		if (!(d->content = dupn(s, n)))
			return -ENOMEM;
		d->content_len = n;
		return pattern_parse(ld, o, "decoder Replace", &d->pat);
	}
	if (!strcmp(t, "Strip")) {
		json_t *a = json_object_get(o, "start"), *b = json_object_get(o, "stop");

		d->kind = TD_STRIP;
		if ((rc = jchar(ld, o, "content", "decoder Strip", &d->strip_char)))
			return rc;
		if (!json_is_integer(a) || !json_is_integer(b) || json_integer_value(a) < 0 ||
		    json_integer_value(b) < 0)
			return fail(ld, -EINVAL, "decoder Strip: \"start\" and \"stop\" must be counts");
		d->start = (size_t)json_integer_value(a);
		d->stop = (size_t)json_integer_value(b);
		return 0;
	}
	if (!strcmp(t, "Metaspace")) {
		d->kind = TD_METASPACE;
		if ((rc = jchar(ld, o, "replacement", "decoder Metaspace", &d->replacement)))
			return rc;
		return prepend_parse(ld, o, "decoder Metaspace", &d->prepend);
	}
	if (!strcmp(t, "Sequence")) {
		d->kind = TD_SEQ;
		return seq_parse(ld, o, "decoders", "decoder", sizeof(*d->sub),
				 dec_member, (void **)&d->sub, &d->n_sub, depth);
	}
	return fail(ld, -ENOTSUP, "decoder \"%s\" is not supported (this library implements "
		    "ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace and Sequence)", t);
}

static void dec_free(struct tok_dec *d)
{
	for (size_t i = 0; i < d->n_sub; i++)
		dec_free(&d->sub[i]);
	free(d->sub);
	free(d->content);
	pattern_free(&d->pat);
}

static int ids_add(int32_t **v, size_t *n, int32_t id)
{
	size_t cap = *n;	/* grown one at a time: these lists hold a few ids */

	if (tok_grow((void **)v, &cap, *n + 1, sizeof(**v)))
		return -ENOMEM;
	(*v)[(*n)++] = id;
	return 0;
}

/* TemplateProcessing's single template: special tokens before and after
 * $A become pre_ids and post_ids. */
static int template_parse(struct load *ld, json_t *o)
{
	struct mlens_tokenizer *tok = ld->tok;
	json_t *single = json_object_get(o, "single"), *specials = json_object_get(o, "special_tokens");
	bool seen_seq = false;
	size_t i, j;
	int rc;

	if (!json_is_array(single))
		return fail(ld, -EINVAL, "post_processor TemplateProcessing without a \"single\" array");
	for (i = 0; i < json_array_size(single); i++) {
		json_t *it = json_array_get(single, i), *sp = json_object_get(it, "SpecialToken"), *ids;
		const char *name;

		if (json_object_get(it, "Sequence")) {
			seen_seq = true;
			continue;
		}
		if (!(name = jstr(sp, "id", NULL)))
			return fail(ld, -EINVAL, "post_processor TemplateProcessing: item %zu is neither "
				    "a Sequence nor a SpecialToken with an \"id\"", i);
		ids = json_object_get(json_object_get(specials, name), "ids");
		if (!json_is_array(ids))
			return fail(ld, -EINVAL, "post_processor TemplateProcessing: special token \"%s\" "
				    "has no \"ids\" in special_tokens", name);
		for (j = 0; j < json_array_size(ids); j++) {
			json_t *v = json_array_get(ids, j);

			if (!json_is_integer(v) || json_integer_value(v) < 0 ||
			    json_integer_value(v) >= tok->n_ids)
				return fail(ld, -EINVAL, "post_processor TemplateProcessing: special token "
					    "\"%s\" has an id outside the vocabulary", name);
			rc = seen_seq ? ids_add(&tok->post_ids, &tok->n_post_ids, (int32_t)json_integer_value(v))
				      : ids_add(&tok->pre_ids, &tok->n_pre_ids, (int32_t)json_integer_value(v));
			if (rc)
				return rc;
		}
	}
	return 0;
}

static int post_parse(struct load *ld, json_t *o, int depth)
{
	const char *t;
	int rc;

	if (json_is_null(o) || !o)
		return 0;
	if (!(t = jstr(o, "type", NULL)))
		return fail(ld, -EINVAL, "post_processor without a \"type\"");
	if (!strcmp(t, "ByteLevel"))
		return 0;	/* offsets only */
	if (!strcmp(t, "TemplateProcessing"))
		return template_parse(ld, o);
	if (!strcmp(t, "Sequence") && depth < MAX_DEPTH) {
		json_t *a = json_object_get(o, "processors");

		if (!json_is_array(a))
			return fail(ld, -EINVAL, "post_processor Sequence without a \"processors\" array");
		for (size_t i = 0; i < json_array_size(a); i++)
			if ((rc = post_parse(ld, json_array_get(a, i), depth + 1)))
				return rc;
		return 0;
	}
	return fail(ld, -ENOTSUP, "post_processor \"%s\" is not supported (this library implements "
		    "TemplateProcessing, ByteLevel and Sequence)", t);
}

static int json_id(json_t *v, uint32_t *id)
{
	if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= (1 << 30))
		return -1;
	*id = (uint32_t)json_integer_value(v);
	return 0;
}

static int added_parse(struct load *ld, json_t *a)
{
	struct mlens_tokenizer *tok = ld->tok;
	size_t i, n = json_array_size(a);

	if (!n)
		return 0;
	if (!(tok->added = calloc(n, sizeof(*tok->added))))
		return -ENOMEM;
	for (i = 0; i < n; i++) {
		json_t *o = json_array_get(a, i);
		struct tok_added *t = &tok->added[i];
		const char *s;
		size_t len;
		uint32_t id;

		if (!(s = jstr(o, "content", &len)) || json_id(json_object_get(o, "id"), &id))
			return fail(ld, -EINVAL, "added_tokens[%zu] needs a \"content\" string and an id", i);
		if (!len)
			return fail(ld, -EINVAL, "added_tokens[%zu] has empty content", i);
		if (!(t->content = dupn(s, len)))
			return -ENOMEM;
		tok->n_added = i + 1;
		t->len = len;
		t->id = (int32_t)id;
		t->single_word = jbool(o, "single_word", false);
		t->lstrip = jbool(o, "lstrip", false);
		t->rstrip = jbool(o, "rstrip", false);
		t->special = jbool(o, "special", false);
		t->normalized = jbool(o, "normalized", !t->special);
	}
	return 0;
}

static int added_cmp_len(const void *a, const void *b, void *arg)
{
	const struct tok_added *ad = arg;
	size_t la = ad[*(const uint32_t *)a].len, lb = ad[*(const uint32_t *)b].len;
	uint8_t fa = (uint8_t)ad[*(const uint32_t *)a].content[0];
	uint8_t fb = (uint8_t)ad[*(const uint32_t *)b].content[0];

	if (fa != fb)
		return fa < fb ? -1 : 1;
	if (la != lb)
		return la > lb ? -1 : 1;
	return *(const uint32_t *)a < *(const uint32_t *)b ? -1 : 1;
}

static int added_set_build(struct mlens_tokenizer *tok, struct tok_added_set *set, bool normalized)
{
	size_t i, n = 0;

	for (i = 0; i < tok->n_added; i++)
		n += tok->added[i].normalized == normalized;
	set->n = n;
	if (!n)
		return 0;
	if (!(set->idx = malloc(n * sizeof(*set->idx))))
		return -ENOMEM;
	n = 0;
	for (i = 0; i < tok->n_added; i++)
		if (tok->added[i].normalized == normalized)
			set->idx[n++] = (uint32_t)i;
	qsort_r(set->idx, n, sizeof(*set->idx), added_cmp_len, tok->added);
	for (int b = 0, k = 0; b <= 256; b++) {
		while (k < (int)n && (uint8_t)tok->added[set->idx[k]].content[0] < b)
			k++;
		set->start[b] = (uint32_t)k;
	}
	return 0;
}

static int vocab_parse(struct load *ld, json_t *model, json_t *added)
{
	struct mlens_tokenizer *tok = ld->tok;
	json_t *vocab = json_object_get(model, "vocab"), *v;
	const char *key;
	uint32_t id = 0, max = 0;
	size_t i;

	if (!json_is_object(vocab))
		return fail(ld, -EINVAL, "model has no \"vocab\" object");
	json_object_foreach(vocab, key, v) {
		if (json_id(v, &id))
			return fail(ld, -EINVAL, "model vocab: \"%s\" has no valid id", key);
		max = id > max ? id : max;
	}
	for (i = 0; i < json_array_size(added); i++)
		if (!json_id(json_object_get(json_array_get(added, i), "id"), &id))
			max = id > max ? id : max;
	tok->n_ids = json_object_size(vocab) || json_array_size(added) ? max + 1 : 0;
	if (!(tok->id_text = calloc(tok->n_ids + 1, sizeof(char *))) ||
	    !(tok->id_len = calloc(tok->n_ids + 1, sizeof(uint32_t))) ||
	    !(tok->id_special = calloc(tok->n_ids + 1, 1)) ||
	    !(tok->model_text = calloc(tok->n_ids + 1, sizeof(char *))) ||
	    !(tok->model_len = calloc(tok->n_ids + 1, sizeof(uint32_t))))
		return -ENOMEM;
	if (vocab_init(&tok->vocab, json_object_size(vocab)) ||
	    vocab_init(&tok->all, json_object_size(vocab) + json_array_size(added)))
		return -ENOMEM;
	json_object_foreach(vocab, key, v) {
		size_t len = strlen(key);	/* jansson keys hold no NUL */

		json_id(v, &id);
		if (tok->model_text[id])
			return fail(ld, -EINVAL, "model vocab: id %u is given to two tokens", id);
		if (!(tok->model_text[id] = dupn(key, len)))
			return -ENOMEM;
		tok->model_len[id] = (uint32_t)len;
		vocab_put(tok, &tok->vocab, key, len, id, true);
	}
	return 0;
}

static int merges_parse(struct load *ld, json_t *model)
{
	struct mlens_tokenizer *tok = ld->tok;
	json_t *a = json_object_get(model, "merges");
	size_t i, n = json_array_size(a), s;
	struct tok_buf joined = { 0 };
	int rc = 0;

	if (a && !json_is_array(a))
		return fail(ld, -EINVAL, "model \"merges\" is not an array");
	s = table_size(n);
	if (!(tok->merges.slot = malloc(s * sizeof(*tok->merges.slot))))
		return -ENOMEM;
	memset(tok->merges.slot, 0xff, s * sizeof(*tok->merges.slot));
	tok->merges.mask = s - 1;
	for (i = 0; i < n && !rc; i++) {
		json_t *m = json_array_get(a, i);
		const char *l, *r, *sp;
		size_t ll, rl;
		int32_t li, ri, id;

		if (json_is_string(m)) {	/* "left right" */
			l = json_string_value(m);
			sp = strchr(l, ' ');
			if (!sp || strchr(sp + 1, ' ')) {
				rc = fail(ld, -EINVAL, "merge %zu (\"%s\") is not two tokens split by one space",
					  i, l);
				break;
			}
			ll = (size_t)(sp - l);
			r = sp + 1;
			rl = strlen(r);
		} else if (json_is_array(m) && json_array_size(m) == 2 &&
			   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
			l = json_string_value(json_array_get(m, 0));
			ll = json_string_length(json_array_get(m, 0));
			r = json_string_value(json_array_get(m, 1));
			rl = json_string_length(json_array_get(m, 1));
		} else {
			rc = fail(ld, -EINVAL, "merge %zu is neither \"a b\" nor [\"a\", \"b\"]", i);
			break;
		}
		li = tok_vocab_get(tok, &tok->vocab, l, ll);
		ri = tok_vocab_get(tok, &tok->vocab, r, rl);
		if (li < 0 || ri < 0) {
			rc = fail(ld, -EINVAL, "merge %zu: \"%.*s\" is not in the vocabulary", i,
				  (int)(li < 0 ? ll : rl), li < 0 ? l : r);
			break;
		}
		joined.len = 0;
		if (rl < tok->prefix_len ||
		    tok_buf_add(&joined, l, ll) || tok_buf_add(&joined, r + tok->prefix_len, rl - tok->prefix_len)) {
			rc = rl < tok->prefix_len ? fail(ld, -EINVAL, "merge %zu: right side shorter than "
							 "continuing_subword_prefix", i) : -ENOMEM;
			break;
		}
		id = tok_vocab_get(tok, &tok->vocab, joined.p, joined.len);
		if (id < 0) {
			rc = fail(ld, -EINVAL, "merge %zu: the merged token \"%.*s\" is not in the vocabulary",
				  i, (int)joined.len, joined.p);
			break;
		}
		merge_put(&tok->merges, li, ri, (uint32_t)i, id);
	}
	tok_buf_free(&joined);
	return rc;
}

static int model_parse(struct load *ld, json_t *model, json_t *added)
{
	struct mlens_tokenizer *tok = ld->tok;
	const char *t = jstr(model, "type", NULL), *s;
	size_t n;
	int rc;

	if (!json_is_object(model))
		return fail(ld, -EINVAL, "no \"model\" object");
	if (t && strcmp(t, "BPE"))
		return fail(ld, -ENOTSUP, "model \"%s\" is not supported (this library implements BPE)", t);
	if (!t && !json_object_get(model, "merges"))
		return fail(ld, -ENOTSUP, "model without a \"type\" nor \"merges\" is not supported "
			    "(this library implements BPE)");
	if (json_is_number(json_object_get(model, "dropout")) &&
	    json_number_value(json_object_get(model, "dropout")) > 0)
		return fail(ld, -ENOTSUP, "model BPE: dropout is not supported (inference uses none)");
	tok->byte_fallback = jbool(model, "byte_fallback", false);
	tok->fuse_unk = jbool(model, "fuse_unk", false);
	tok->ignore_merges = jbool(model, "ignore_merges", false);
	if ((s = jstr(model, "continuing_subword_prefix", &n))) {
		if (!(tok->prefix = dupn(s, n)))
			return -ENOMEM;
		tok->prefix_len = n;
	}
	if ((s = jstr(model, "end_of_word_suffix", &n))) {
		if (!(tok->suffix = dupn(s, n)))
			return -ENOMEM;
		tok->suffix_len = n;
	}
	if ((rc = vocab_parse(ld, model, added)) || (rc = merges_parse(ld, model)))
		return rc;
	tok->unk_id = -1;
	if ((s = jstr(model, "unk_token", &n)) && (tok->unk_id = tok_vocab_get(tok, &tok->vocab, s, n)) < 0)
		return fail(ld, -EINVAL, "model BPE: unk_token \"%s\" is not in the vocabulary", s);
	for (int b = 0; b < 256; b++) {
		char c[8];
		size_t k = tok_utf8_encode(tok_byte_char((uint8_t)b), c);

		tok->byte_id[b] = tok_vocab_get(tok, &tok->vocab, c, k);
		snprintf(c, sizeof(c), "<0x%02X>", b);
		tok->fallback_id[b] = tok_vocab_get(tok, &tok->vocab, c, 6);
	}
	return 0;
}

/* id -> text for decoding: an added token's content wins over the model's
 * string; then the table of every string. */
static int ids_finish(struct load *ld)
{
	struct mlens_tokenizer *tok = ld->tok;
	uint32_t id;
	size_t i;

	for (id = 0; id < tok->n_ids; id++) {
		tok->id_text[id] = tok->model_text[id];
		tok->id_len[id] = tok->model_len[id];
	}
	for (i = 0; i < tok->n_added; i++) {
		struct tok_added *t = &tok->added[i];

		tok->id_text[t->id] = t->content;
		tok->id_len[t->id] = (uint32_t)t->len;
		tok->id_special[t->id] = t->special;
	}
	for (id = 0; id < tok->n_ids; id++)
		if (tok->model_text[id] && tok->id_text[id] == tok->model_text[id])
			vocab_put(tok, &tok->all, tok->model_text[id], tok->model_len[id], id, true);
	for (i = 0; i < tok->n_added; i++)
		vocab_put(tok, &tok->all, tok->added[i].content, tok->added[i].len,
			  (uint32_t)tok->added[i].id, true);
	return 0;
}

static void ws_split_detect(struct mlens_tokenizer *tok);

int tok_load_json(const char *json, size_t len, const char *name, struct mlens_tokenizer **out,
		  char *err, size_t err_len)
{
	struct load ld = { .name = name, .err = err, .err_len = err_len };
	json_error_t jerr;
	json_t *root, *o, *added;
	int rc;

	*out = NULL;
	root = json_loadb(json, len, JSON_ALLOW_NUL, &jerr);
	if (!root)
		return fail(&ld, -EINVAL, "not valid JSON: line %d column %d: %s", jerr.line,
			    jerr.column, jerr.text);
	if (!json_is_object(root)) {
		json_decref(root);
		return fail(&ld, -EINVAL, "not a JSON object");
	}
	if (!(ld.tok = calloc(1, sizeof(*ld.tok)))) {
		json_decref(root);
		return -ENOMEM;
	}
	ld.tok->bos_id = -1;
	added = json_object_get(root, "added_tokens");
	if (added && !json_is_array(added)) {
		rc = fail(&ld, -EINVAL, "\"added_tokens\" is not an array");
		goto out;
	}
	if ((rc = model_parse(&ld, json_object_get(root, "model"), added)) ||
	    (rc = added_parse(&ld, added)) || (rc = ids_finish(&ld)))
		goto out;
	for (size_t i = 0; i < ld.tok->n_added; i++)
		if ((uint32_t)ld.tok->added[i].id >= ld.tok->n_ids) {
			rc = fail(&ld, -EINVAL, "added token id out of range");
			goto out;
		}
	if ((rc = added_set_build(ld.tok, &ld.tok->raw_set, false)) ||
	    (rc = added_set_build(ld.tok, &ld.tok->norm_set, true)))
		goto out;
	if ((o = json_object_get(root, "normalizer")) && !json_is_null(o)) {
		if (!(ld.tok->norm = calloc(1, sizeof(*ld.tok->norm)))) {
			rc = -ENOMEM;
			goto out;
		}
		if ((rc = norm_parse(&ld, o, ld.tok->norm, 0)))
			goto out;
	}
	if ((o = json_object_get(root, "pre_tokenizer")) && !json_is_null(o)) {
		if (!(ld.tok->pre = calloc(1, sizeof(*ld.tok->pre)))) {
			rc = -ENOMEM;
			goto out;
		}
		if ((rc = pre_parse(&ld, o, ld.tok->pre, 0)))
			goto out;
	}
	if ((o = json_object_get(root, "decoder")) && !json_is_null(o)) {
		if (!(ld.tok->dec = calloc(1, sizeof(*ld.tok->dec)))) {
			rc = -ENOMEM;
			goto out;
		}
		if ((rc = dec_parse(&ld, o, ld.tok->dec, 0)))
			goto out;
	}
	if ((rc = post_parse(&ld, json_object_get(root, "post_processor"), 0)))
		goto out;
	ws_split_detect(ld.tok);
	if (!(ld.tok->cache = calloc(1, sizeof(*ld.tok->cache)))) {
		rc = -ENOMEM;
		goto out;
	}
	pthread_mutex_init(&ld.tok->cache->lock, NULL);
	if (ld.tok->n_pre_ids)
		ld.tok->bos_id = ld.tok->pre_ids[0];
out:
	json_decref(root);
	if (rc) {
		mlens_tokenizer_free(ld.tok);
		return rc;
	}
	*out = ld.tok;
	return 0;
}

/* Whether pieces may be cut before a replacement character (▁) that
 * follows another character: exact when no vocabulary token holds ▁ after
 * its start (bar runs of ▁ alone), since then no merge joins a word to
 * the ▁ that starts the next, and the words' merges do not interact. It
 * lets such models use the word cache. */
static void ws_split_detect(struct mlens_tokenizer *tok)
{
	uint32_t rep = 0x2581;
	char r[4];
	size_t rl;

	if (tok->pre) {
		if (tok->pre->kind != TPT_METASPACE || tok->pre->split)
			return;
		rep = tok->pre->replacement;
	}
	if (tok->prefix_len || tok->suffix_len || tok->ignore_merges)
		return;
	rl = tok_utf8_encode(rep, r);
	if (tok_vocab_get(tok, &tok->vocab, r, rl) < 0)
		return;
	for (uint32_t id = 0; id < tok->n_ids; id++) {
		const char *s = tok->model_text[id];
		size_t n = tok->model_len[id], i;
		const char *hit;

		if (!s || n <= rl || !(hit = memmem(s + 1, n - 1, r, rl)))
			continue;
		for (i = 0; i + rl <= n && !memcmp(s + i, r, rl); i += rl)
			;
		if (i != n)
			return;	/* a ▁ inside a token with other text */
	}
	tok->ws_split = true;
	memcpy(tok->ws_rep, r, rl);
	tok->ws_rep_len = rl;
}

/* ==== tokenizer_config.json, generation_config.json ==== */

static json_t *load_optional(const char *dir, const char *file, char *err, size_t err_len, int *rc)
{
	char path[4096];
	json_error_t jerr;
	json_t *j;

	*rc = 0;
	snprintf(path, sizeof(path), "%s/%s", dir, file);
	if (access(path, F_OK))
		return NULL;
	j = json_load_file(path, 0, &jerr);
	if (!j || !json_is_object(j)) {
		if (err && err_len)
			snprintf(err, err_len, "%s: not a valid JSON object: line %d: %s", path,
				 jerr.line, j ? "top level is not an object" : jerr.text);
		json_decref(j);
		*rc = -EINVAL;
	}
	return j;
}

/* A token field of tokenizer_config.json: a string, or {"content": s}. */
static int32_t config_token(const struct mlens_tokenizer *tok, json_t *cfg, const char *key)
{
	json_t *v = json_object_get(cfg, key);
	const char *s;
	size_t n;

	if (json_is_object(v))
		v = json_object_get(v, "content");
	if (!json_is_string(v))
		return -1;
	s = json_string_value(v);
	n = json_string_length(v);
	return tok_vocab_get(tok, &tok->all, s, n);
}

static int eos_add(struct mlens_tokenizer *tok, int32_t id)
{
	if (id < 0 || (uint32_t)id >= tok->n_ids)
		return 0;
	for (size_t i = 0; i < tok->n_eos; i++)
		if (tok->eos_ids[i] == id)
			return 0;
	return ids_add(&tok->eos_ids, &tok->n_eos, id);
}

static int special_ids_load(struct mlens_tokenizer *tok, const char *dir, char *err, size_t err_len)
{
	json_t *cfg, *gen, *v;
	int rc;
	int32_t bos, eos;

	cfg = load_optional(dir, "tokenizer_config.json", err, err_len, &rc);
	if (rc)
		return rc;
	gen = load_optional(dir, "generation_config.json", err, err_len, &rc);
	if (rc) {
		json_decref(cfg);
		return rc;
	}
	bos = config_token(tok, cfg, "bos_token");
	eos = config_token(tok, cfg, "eos_token");
	v = json_object_get(gen, "bos_token_id");
	if (json_is_integer(v) && json_integer_value(v) >= 0 && json_integer_value(v) < tok->n_ids)
		tok->bos_id = (int32_t)json_integer_value(v);
	else if (bos >= 0)
		tok->bos_id = bos;
	v = json_object_get(gen, "eos_token_id");
	if (json_is_integer(v))
		rc = eos_add(tok, (int32_t)json_integer_value(v));
	for (size_t i = 0; !rc && json_is_array(v) && i < json_array_size(v); i++)
		if (json_is_integer(json_array_get(v, i)))
			rc = eos_add(tok, (int32_t)json_integer_value(json_array_get(v, i)));
	if (!rc)
		rc = eos_add(tok, eos);
	/* add_bos_token / add_eos_token, when the config sets them, decide
	 * what MLENS_TOK_ADD_SPECIAL adds (as transformers' Llama tokenizers
	 * rebuild their template from them) */
	if (!rc && (json_is_boolean(json_object_get(cfg, "add_bos_token")) ||
		    json_is_boolean(json_object_get(cfg, "add_eos_token")))) {
		tok->n_pre_ids = tok->n_post_ids = 0;
		if (jbool(cfg, "add_bos_token", false) && bos >= 0)
			rc = ids_add(&tok->pre_ids, &tok->n_pre_ids, bos);
		if (!rc && jbool(cfg, "add_eos_token", false) && eos >= 0)
			rc = ids_add(&tok->post_ids, &tok->n_post_ids, eos);
	}
	json_decref(cfg);
	json_decref(gen);
	return rc;
}

static int read_file(const char *path, char **buf, size_t *len)
{
	struct stat st;
	int fd = open(path, O_RDONLY | O_CLOEXEC), rc = 0;
	size_t got = 0;

	if (fd < 0)
		return -errno;
	if (fstat(fd, &st))
		rc = -errno;
	else if (!S_ISREG(st.st_mode))
		rc = -EINVAL;	/* a directory or a device: not a tokenizer.json */
	if (rc) {
		close(fd);
		return rc;
	}
	if (!(*buf = malloc((size_t)st.st_size + 1))) {
		close(fd);
		return -ENOMEM;
	}
	while (got < (size_t)st.st_size) {
		ssize_t k = read(fd, *buf + got, (size_t)st.st_size - got);

		if (k <= 0) {
			rc = k < 0 ? -errno : -EIO;
			break;
		}
		got += (size_t)k;
	}
	close(fd);
	if (rc) {
		free(*buf);
		*buf = NULL;
	}
	*len = got;
	return rc;
}

int mlens_tokenizer_open(const char *dir, struct mlens_tokenizer **tok, char *err, size_t err_len)
{
	char path[4096];
	char *json = NULL;
	size_t len = 0;
	int rc;

	*tok = NULL;
	if (err && err_len)
		err[0] = 0;
	if ((size_t)snprintf(path, sizeof(path), "%s/tokenizer.json", dir) >= sizeof(path))
		return -ENAMETOOLONG;
	if ((rc = read_file(path, &json, &len))) {
		if (err && err_len)
			snprintf(err, err_len, "%s: %s%s", path,
				 rc == -EINVAL ? "not a regular file" : strerror(-rc),
				 rc == -ENOENT ? " (the model directory needs a tokenizer.json)" : "");
		return rc;
	}
	rc = tok_load_json(json, len, path, tok, err, err_len);
	free(json);
	if (rc)
		return rc;
	if ((rc = special_ids_load(*tok, dir, err, err_len))) {
		mlens_tokenizer_free(*tok);
		*tok = NULL;
	}
	return rc;
}

void mlens_tokenizer_free(struct mlens_tokenizer *tok)
{
	if (!tok)
		return;
	for (uint32_t id = 0; tok->model_text && id < tok->n_ids; id++)
		free(tok->model_text[id]);
	free(tok->model_text);
	free(tok->model_len);
	free(tok->id_text);
	free(tok->id_len);
	free(tok->id_special);
	free(tok->vocab.slot);
	free(tok->all.slot);
	free(tok->merges.slot);
	free(tok->prefix);
	free(tok->suffix);
	if (tok->norm)
		norm_free(tok->norm);
	free(tok->norm);
	if (tok->pre)
		pre_free(tok->pre);
	free(tok->pre);
	if (tok->dec)
		dec_free(tok->dec);
	free(tok->dec);
	for (size_t i = 0; i < tok->n_added; i++)
		free(tok->added[i].content);
	free(tok->added);
	free(tok->raw_set.idx);
	free(tok->norm_set.idx);
	free(tok->pre_ids);
	free(tok->post_ids);
	free(tok->eos_ids);
	if (tok->cache) {
		pthread_mutex_destroy(&tok->cache->lock);
		free(tok->cache->slot);
		tok_buf_free(&tok->cache->store);
		free(tok->cache);
	}
	free(tok);
}

/* ==== Lookups ==== */

uint32_t mlens_tokenizer_vocab_size(const struct mlens_tokenizer *tok)
{
	return tok->n_ids;
}

int32_t mlens_tokenizer_token_id(const struct mlens_tokenizer *tok, const char *token, size_t len)
{
	int32_t id = tok_vocab_get(tok, &tok->all, token, len);

	return id >= 0 ? id : -ENOENT;
}

const char *mlens_tokenizer_id_token(const struct mlens_tokenizer *tok, int32_t id, size_t *len)
{
	if (id < 0 || (uint32_t)id >= tok->n_ids || !tok->id_text[id])
		return NULL;
	if (len)
		*len = tok->id_len[id];
	return tok->id_text[id];
}

int mlens_tokenizer_is_special(const struct mlens_tokenizer *tok, int32_t id)
{
	return id >= 0 && (uint32_t)id < tok->n_ids && tok->id_special[id];
}

int32_t mlens_tokenizer_bos(const struct mlens_tokenizer *tok)
{
	return tok->bos_id >= 0 ? tok->bos_id : -ENOENT;
}

int mlens_tokenizer_eos(const struct mlens_tokenizer *tok, int32_t *ids, size_t cap)
{
	for (size_t i = 0; i < tok->n_eos && i < cap; i++)
		ids[i] = tok->eos_ids[i];
	return (int)tok->n_eos;
}
