/* Decoding: ids to their token strings (an added token's content), the
 * decoder chain over that list as Hugging Face tokenizers runs it, and
 * the incremental decoder that emits only text whose characters are
 * whole. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include "client/tokenizer_int.h"

#define FFFD "\xEF\xBF\xBD"

/* Whether s ends inside a UTF-8 character that more bytes could still
 * complete (the incremental decoder holds such text back). */
static bool utf8_cut(const char *str, size_t n)
{
	const uint8_t *s = (const uint8_t *)str;
	size_t start = n, need;
	uint8_t lo = 0x80, hi = 0xBF;

	while (start > 0 && n - start < 3 && (s[start - 1] & 0xC0) == 0x80)
		start--;
	if (start == 0)
		return false;
	start--;
	if (s[start] >= 0xC2 && s[start] <= 0xDF)
		need = 1;
	else if (s[start] >= 0xE0 && s[start] <= 0xEF)
		need = 2;
	else if (s[start] >= 0xF0 && s[start] <= 0xF4)
		need = 3;
	else
		return false;
	if (n - start - 1 >= need)
		return false;	/* whole, or too long to be one */
	if (s[start] == 0xE0)
		lo = 0xA0;
	else if (s[start] == 0xED)
		hi = 0x9F;
	else if (s[start] == 0xF0)
		lo = 0x90;
	else if (s[start] == 0xF4)
		hi = 0x8F;
	for (size_t i = start + 1; i < n; i++, lo = 0x80, hi = 0xBF)
		if (s[i] < lo || s[i] > hi)
			return false;
	return true;
}

static const char *piece(const struct tok_list *l, size_t i)
{
	return l->bytes.p + l->v[i].off;
}

/* ByteLevel: every token's characters back to bytes (a token holding a
 * character outside the map keeps its own bytes), then one string. */
static int dec_bytelevel(const struct tok_list *in, struct tok_list *out, size_t *tail)
{
	struct tok_buf raw = { 0 };
	int rc = 0;

	for (size_t i = 0; i < in->n && !rc; i++) {
		const uint8_t *s = (const uint8_t *)piece(in, i);
		size_t n = in->v[i].len, j = 0, start = raw.len;
		bool all = true;

		while (j < n && !rc) {
			uint32_t cp;
			int b;
			uint8_t c;

			j += tok_utf8_decode(s + j, &cp);
			if ((b = tok_char_byte(cp)) < 0) {
				all = false;
				break;
			}
			c = (uint8_t)b;
			rc = tok_buf_add(&raw, &c, 1);
		}
		if (!rc && !all) {	/* a character without a byte: the token's own text */
			raw.len = start;
			rc = tok_buf_add(&raw, s, n);
		}
	}
	if (!rc) {
		struct tok_buf fixed = { 0 };

		/* a cut character is one U+FFFD at the end */
		*tail = utf8_cut(raw.p, raw.len) ? 3 : 0;

		rc = tok_utf8_lossy(&fixed, raw.p, raw.len);
		if (!rc)
			rc = tok_list_add(out, fixed.p, fixed.len, false);
		tok_buf_free(&fixed);
	}
	tok_buf_free(&raw);
	return rc;
}

/* <0xNN> as a byte, or -1. */
static int byte_token(const char *s, size_t n)
{
	int v = 0;

	if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>')
		return -1;
	for (int i = 3; i < 5; i++) {
		char c = s[i];

		v = v * 16 + (c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 :
			      c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1000);
	}
	return v >= 0 ? v : -1;
}

/* ByteFallback: a run of <0xNN> tokens becomes its bytes when they are
 * valid UTF-8, else one U+FFFD per byte token (as HF). */
static int flush_bytes(struct tok_buf *run, struct tok_list *out)
{
	int rc = 0;

	if (!run->len)
		return 0;
	if (tok_utf8_valid(run->p, run->len))
		rc = tok_list_add(out, run->p, run->len, false);
	else
		for (size_t i = 0; i < run->len && !rc; i++)
			rc = tok_list_add(out, FFFD, 3, false);
	run->len = 0;
	return rc;
}

static int dec_bytefallback(const struct tok_list *in, struct tok_list *out, size_t *tail)
{
	struct tok_buf run = { 0 };
	int rc = 0;

	for (size_t i = 0; i < in->n && !rc; i++) {
		int b = byte_token(piece(in, i), in->v[i].len);

		if (b >= 0) {
			uint8_t c = (uint8_t)b;

			rc = tok_buf_add(&run, &c, 1);
			continue;
		}
		if (!(rc = flush_bytes(&run, out)))
			rc = tok_list_add(out, piece(in, i), in->v[i].len, false);
	}
	/* a run ending inside a character is one U+FFFD per byte until whole */
	*tail = run.len && utf8_cut(run.p, run.len) ? 3 * run.len : 0;
	if (!rc)
		rc = flush_bytes(&run, out);
	tok_buf_free(&run);
	return rc;
}

static int dec_strip(const struct tok_dec *d, const struct tok_list *in, struct tok_list *out)
{
	char c[4];
	size_t cl = tok_utf8_encode(d->strip_char, c);
	int rc = 0;

	for (size_t i = 0; i < in->n && !rc; i++) {
		const char *s = piece(in, i);
		size_t a = 0, e = in->v[i].len;

		for (size_t k = 0; k < d->start && e - a >= cl && !memcmp(s + a, c, cl); k++)
			a += cl;
		for (size_t k = 0; k < d->stop && e - a >= cl && !memcmp(s + e - cl, c, cl); k++)
			e -= cl;
		rc = tok_list_add(out, s + a, e - a, false);
	}
	return rc;
}

static int dec_metaspace(const struct tok_dec *d, const struct tok_list *in, struct tok_list *out)
{
	char rep[4];
	size_t rl = tok_utf8_encode(d->replacement, rep);
	int rc = 0;

	for (size_t i = 0; i < in->n && !rc; i++) {
		const char *s = piece(in, i);
		size_t n = in->v[i].len, j = 0, off = out->bytes.len;

		if ((rc = tok_list_add(out, "", 0, false)))
			break;
		while (j < n && !rc) {
			if (n - j >= rl && !memcmp(s + j, rep, rl)) {
				/* the first token's replacement stood for the
				 * prepended space */
				if (!(i == 0 && d->prepend != TP_NEVER))
					rc = tok_buf_add(&out->bytes, " ", 1);
				j += rl;
			} else {
				rc = tok_buf_add(&out->bytes, s + j, 1);
				j++;
			}
		}
		out->v[out->n - 1].len = out->bytes.len - off;
	}
	return rc;
}

int tok_decode_chain(const struct tok_dec *d, struct tok_list *l, size_t *tail)
{
	struct tok_list out = { 0 };
	pcre2_match_data *md = NULL;
	int rc = 0;

	switch (d->kind) {
	case TD_SEQ:
		for (size_t i = 0; i < d->n_sub && !rc; i++)
			rc = tok_decode_chain(&d->sub[i], l, tail);
		return rc;
	case TD_BYTELEVEL:
		rc = dec_bytelevel(l, &out, tail);
		break;
	case TD_BYTEFALLBACK:
		rc = dec_bytefallback(l, &out, tail);
		break;
	case TD_FUSE:
		if ((rc = tok_list_add(&out, "", 0, false)))
			break;
		for (size_t i = 0; i < l->n && !rc; i++)
			rc = tok_buf_add(&out.bytes, piece(l, i), l->v[i].len);
		out.v[0].len = out.bytes.len;
		break;
	case TD_STRIP:
		rc = dec_strip(d, l, &out);
		break;
	case TD_METASPACE:
		rc = dec_metaspace(d, l, &out);
		break;
	case TD_REPLACE:
		if (d->pat.re && !(md = pcre2_match_data_create(4, NULL))) {
			rc = -ENOMEM;
			break;
		}
		for (size_t i = 0; i < l->n && !rc; i++) {
			size_t off = out.bytes.len;

			if (!(rc = tok_list_add(&out, "", 0, false)))
				rc = tok_replace_all(&d->pat, md, piece(l, i), l->v[i].len, d->content,
						     d->content_len, &out.bytes);
			if (!rc)
				out.v[out.n - 1].len = out.bytes.len - off;
		}
		pcre2_match_data_free(md);
		break;
	}
	if (rc) {
		tok_list_free(&out);
		return rc;
	}
	tok_list_free(l);
	*l = out;
	return 0;
}

/* ids -> text appended to out (valid UTF-8); *tail gets how many bytes at
 * its end stand for a character the bytes cut (more ids may change them). */
static int decode_to(const struct mlens_tokenizer *tok, const int32_t *ids, size_t n,
		     unsigned flags, struct tok_buf *out, size_t *tail)
{
	struct tok_list l = { 0 };
	int rc = 0;

	*tail = 0;
	for (size_t i = 0; i < n && !rc; i++) {
		int32_t id = ids[i];

		if (id < 0 || (uint32_t)id >= tok->n_ids || !tok->id_text[id]) {
			rc = -EINVAL;
			break;
		}
		if ((flags & MLENS_TOK_SKIP_SPECIAL) && tok->id_special[id])
			continue;
		rc = tok_list_add(&l, tok->id_text[id], tok->id_len[id], false);
	}
	if (!rc && tok->dec)
		rc = tok_decode_chain(tok->dec, &l, tail);
	for (size_t i = 0; i < l.n && !rc; i++) {
		/* without a decoder, tokens are joined by spaces (as HF) */
		if (!tok->dec && i && (rc = tok_buf_add(out, " ", 1)))
			break;
		rc = tok_utf8_lossy(out, piece(&l, i), l.v[i].len);
	}
	tok_list_free(&l);
	return rc;
}

int mlens_tokenizer_decode(const struct mlens_tokenizer *tok, const int32_t *ids, size_t n,
			   unsigned flags, char *buf, size_t cap, size_t *len)
{
	struct tok_buf out = { 0 };
	size_t tail;
	int rc = decode_to(tok, ids, n, flags, &out, &tail);

	*len = 0;
	if (!rc) {
		*len = out.len;
		if (out.len + 1 > cap) {
			rc = -ENOBUFS;
		} else {
			if (out.len)
				memcpy(buf, out.p, out.len);
			buf[out.len] = 0;
		}
	}
	tok_buf_free(&out);
	return rc;
}

/* ==== Incremental decoding ==== */

/* Text is emitted by difference: the text of the window ids[prefix, read)
 * was emitted already, and so were `extra` bytes past it; decoding
 * ids[prefix, n) and cutting off what was emitted gives the new text,
 * with the context the decoders need (a leading space is only stripped
 * at the real start). Bytes that stand for a cut character are held until
 * it is whole; the window moves on once nothing is held. */
struct mlens_detok {
	const struct mlens_tokenizer *tok;
	unsigned flags;
	int32_t *ids;
	size_t n, cap;
	size_t prefix, read, extra;
	struct tok_buf text, window;
};

int mlens_detok_new(const struct mlens_tokenizer *tok, unsigned flags, struct mlens_detok **d)
{
	*d = calloc(1, sizeof(**d));
	if (!*d)
		return -ENOMEM;
	(*d)->tok = tok;
	(*d)->flags = flags & MLENS_TOK_SKIP_SPECIAL;
	return 0;
}

/* The new text into d->text; final emits whatever there is. */
static int detok_step(struct mlens_detok *d, bool final)
{
	size_t tail, wtail, base, settled, start;
	int rc;

	d->text.len = 0;
	d->window.len = 0;
	if (!d->n)
		return 0;
	if ((rc = decode_to(d->tok, d->ids + d->prefix, d->n - d->prefix, d->flags, &d->text, &tail)) ||
	    (rc = decode_to(d->tok, d->ids + d->prefix, d->read - d->prefix, d->flags, &d->window,
			    &wtail)))
		return rc;
	base = d->window.len;
	if (d->text.len < base || (base && memcmp(d->text.p, d->window.p, base))) {
		/* the decoders rewrote what was emitted (ByteFallback turns a
		 * whole invalid byte run into U+FFFD): go on from the new ids */
		d->text.len = 0;
		d->prefix = d->read;
		base = 0;
		if ((rc = decode_to(d->tok, d->ids + d->read, d->n - d->read, d->flags, &d->text, &tail)))
			return rc;
	}
	settled = final || tail > d->text.len ? d->text.len : d->text.len - tail;
	start = base + d->extra;
	if (settled > start) {
		memmove(d->text.p, d->text.p + start, settled - start);
		d->extra = settled - base;
		d->text.len = settled - start;
	} else {
		d->text.len = 0;
	}
	if (!tail || final) {
		/* all emitted: the new ids become the window, unless they added
		 * no text (special tokens skipped), when the old one stays as
		 * the context */
		if (d->extra)
			d->prefix = d->read;
		d->read = d->n;
		d->extra = 0;
	}
	/* keep the ids array from growing without end */
	if (d->prefix > 1024) {
		memmove(d->ids, d->ids + d->prefix, (d->n - d->prefix) * sizeof(*d->ids));
		d->n -= d->prefix;
		d->read -= d->prefix;
		d->prefix = 0;
	}
	return 0;
}

int mlens_detok_push(struct mlens_detok *d, int32_t id, const char **text, size_t *len)
{
	int rc;

	*text = "";
	*len = 0;
	if (id < 0 || (uint32_t)id >= d->tok->n_ids || !d->tok->id_text[id])
		return -EINVAL;
	if (TOK_GROW(d->ids, d->cap, d->n + 1))
		return -ENOMEM;
	d->ids[d->n++] = id;
	if ((rc = detok_step(d, false)))
		return rc;
	if (tok_buf_reserve(&d->text, 1))
		return -ENOMEM;
	d->text.p[d->text.len] = 0;
	*text = d->text.p;
	*len = d->text.len;
	return 0;
}

int mlens_detok_flush(struct mlens_detok *d, const char **text, size_t *len)
{
	int rc = detok_step(d, true);

	*text = "";
	*len = 0;
	d->n = d->prefix = d->read = d->extra = 0;
	if (rc)
		return rc;
	if (tok_buf_reserve(&d->text, 1))
		return -ENOMEM;
	d->text.p[d->text.len] = 0;
	*text = d->text.p;
	*len = d->text.len;
	return 0;
}

void mlens_detok_free(struct mlens_detok *d)
{
	if (!d)
		return;
	free(d->ids);
	tok_buf_free(&d->text);
	tok_buf_free(&d->window);
	free(d);
}
