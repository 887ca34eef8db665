/* Encoding: added tokens matched on the raw text, the normalizer on what
 * lies between them, normalized added tokens, the pre-tokenizer splitting
 * into words, and BPE on each word (a cache of words already seen, a
 * merge-rank hash table and a heap of candidate merges), in the order
 * Hugging Face tokenizers applies them. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>
#include "client/tokenizer_int.h"

/* One encode call's scratch. */
struct enc {
	const struct mlens_tokenizer *tok;
	pcre2_match_data *md;
	struct tok_buf norm, tmp, mapped;
	struct tok_list pa, pb;		/* pre-tokenizer pieces, in and out */
	bool bytes_mapped;		/* pieces hold raw bytes ByteLevel will map */
	int32_t *ids;
	size_t n, cap;
	/* BPE scratch */
	struct sym {
		int32_t id;
		int32_t prev, next;
		uint32_t len;
	} *sym;
	size_t sym_cap;
	struct cand {
		uint32_t rank, pos;
		int32_t id;
	} *heap;
	size_t heap_n, heap_cap;
};

static int push_id(struct enc *e, int32_t id)
{
	if (TOK_GROW(e->ids, e->cap, e->n + 1))
		return -ENOMEM;
	e->ids[e->n++] = id;
	return 0;
}

/* Rust's char::is_whitespace: the White_Space property. */
static bool is_space(uint32_t c)
{
	return (c >= 9 && c <= 13) || c == ' ' || c == 0x85 || c == 0xA0 || c == 0x1680 ||
	       (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
	       c == 0x205F || c == 0x3000;
}

/* The character ending at s[n) (valid UTF-8). */
static uint32_t last_char(const char *s, size_t n, size_t *len)
{
	size_t i = n;
	uint32_t cp;

	while (i > 0 && ((uint8_t)s[i - 1] & 0xC0) == 0x80)
		i--;
	if (i > 0)
		i--;
	*len = tok_utf8_decode((const uint8_t *)s + i, &cp);
	return cp;
}

/* A word character as HF's single_word check has it: Unicode \\w
 * (Alphabetic, marks, decimal digits, connector punctuation, the joiners),
 * with Alphabetic as the letters plus the letter-like numbers and the
 * circled and squared letters. */
static bool is_word_char(uint32_t c)
{
	const char *cat = utf8proc_category_string((utf8proc_int32_t)c);

	if (cat[0] == 'L' || cat[0] == 'M' || !strcmp(cat, "Nd") || !strcmp(cat, "Nl") ||
	    !strcmp(cat, "Pc"))
		return true;
	return c == 0x200C || c == 0x200D || (c >= 0x24B6 && c <= 0x24E9) ||
	       (c >= 0x1F130 && c <= 0x1F149) || (c >= 0x1F150 && c <= 0x1F169) ||
	       (c >= 0x1F170 && c <= 0x1F189);
}

/* ==== Normalizers ==== */

/* Apply nm to e->norm in place (e->tmp is scratch). */
static int normalize(struct enc *e, const struct tok_norm *nm)
{
	struct tok_buf *b = &e->norm;
	size_t i;
	int rc;

	switch (nm->kind) {
	case TN_NFC: case TN_NFD: case TN_NFKC: case TN_NFKD: {
		utf8proc_uint8_t *dst = NULL;
		utf8proc_ssize_t k;
		int opt = UTF8PROC_STABLE;

		for (i = 0; i < b->len && (uint8_t)b->p[i] < 0x80; i++)
			;
		if (i == b->len)	/* ASCII is already in every form */
			return 0;
		opt |= nm->kind == TN_NFC || nm->kind == TN_NFKC ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE;
		if (nm->kind == TN_NFKC || nm->kind == TN_NFKD)
			opt |= UTF8PROC_COMPAT;
		k = utf8proc_map((const utf8proc_uint8_t *)b->p, (utf8proc_ssize_t)b->len, &dst, opt);
		if (k < 0)
			return k == UTF8PROC_ERROR_NOMEM ? -ENOMEM : 0;
		b->len = 0;
		rc = tok_buf_add(b, dst, (size_t)k);
		free(dst);
		return rc;
	}
	case TN_REPLACE:
		e->tmp.len = 0;
		if ((rc = tok_replace_all(&nm->pat, e->md, b->p, b->len, nm->content, nm->content_len, &e->tmp)))
			return rc;
		break;
	case TN_PREPEND:
		if (!b->len)
			return 0;
		e->tmp.len = 0;
		if (tok_buf_add(&e->tmp, nm->content, nm->content_len) ||
		    tok_buf_add(&e->tmp, b->p, b->len))
			return -ENOMEM;
		break;
	case TN_STRIP: {
		size_t s = 0, end = b->len, k;
		uint32_t cp;

		while (nm->left && s < end) {
			k = tok_utf8_decode((const uint8_t *)b->p + s, &cp);
			if (!is_space(cp))
				break;
			s += k;
		}
		while (nm->right && end > s) {
			cp = last_char(b->p + s, end - s, &k);
			if (!is_space(cp))
				break;
			end -= k;
		}
		memmove(b->p, b->p + s, end - s);
		b->len = end - s;
		return 0;
	}
	case TN_SEQ:
		for (i = 0; i < nm->n_sub; i++)
			if ((rc = normalize(e, &nm->sub[i])))
				return rc;
		return 0;
	}
	/* swap tmp in as the result */
	{
		struct tok_buf t = *b;

		*b = e->tmp;
		e->tmp = t;
	}
	return 0;
}

/* ==== Pre-tokenizers ==== */

/* Matches of a pattern over one piece, as [start, end, is_match) runs
 * covering it. */
struct runs {
	size_t *v;	/* triples: start, end, match */
	size_t n, cap;
	size_t at;
};

static int runs_add(struct runs *r, size_t s, size_t e, size_t m)
{
	if (TOK_GROW(r->v, r->cap, r->n + 3))
		return -ENOMEM;
	r->v[r->n++] = s;
	r->v[r->n++] = e;
	r->v[r->n++] = m;
	return 0;
}

static int runs_fn(void *arg, size_t s, size_t e)
{
	struct runs *r = arg;
	int rc = 0;

	if (r->at != s)
		rc = runs_add(r, r->at, s, 0);
	if (!rc)
		rc = runs_add(r, s, e, 1);
	r->at = e;
	return rc;
}

/* Split each piece of in by p into out as behavior says (HF's
 * NormalizedString::split). */
static int split_pieces(struct enc *e, const struct tok_pattern *p, enum tok_split_behavior how,
			bool invert, struct tok_list *in, struct tok_list *out)
{
	struct runs r = { 0 };
	int rc = 0;

	for (size_t k = 0; k < in->n && !rc; k++) {
		const char *s = in->bytes.p + in->v[k].off;
		size_t n = in->v[k].len, i, w = 0;
		bool prev = false;

		r.n = 0;
		r.at = 0;
		rc = tok_pattern_each(p, e->md, s, n, runs_fn, &r);
		if (rc == -EINVAL)
			rc = 0;
		if (!rc && r.at != n)
			rc = runs_add(&r, r.at, n, 0);
		if (rc)
			break;
		for (i = 0; i < r.n; i += 3)
			r.v[i + 2] ^= invert;
		/* fold the runs into pieces in place: w counts the output triples */
		if (how == TS_MERGED_NEXT) {
			/* as HF: walk backwards, a match joins the run after it */
			size_t m = r.n / 3, j;

			w = 0;
			for (j = m; j-- > 0;) {
				size_t s0 = r.v[j * 3], e0 = r.v[j * 3 + 1];
				bool mt = r.v[j * 3 + 2];

				if (mt && !prev && w) {
					r.v[(m - w) * 3] = s0;
				} else {
					w++;	/* the slot written is at or after j */
					r.v[(m - w) * 3] = s0;
					r.v[(m - w) * 3 + 1] = e0;
					r.v[(m - w) * 3 + 2] = 0;
				}
				prev = mt;
			}
			memmove(r.v, &r.v[(m - w) * 3], 3 * w * sizeof(size_t));
			w *= 3;
		} else {
			for (i = 0; i < r.n; i += 3) {
				size_t s0 = r.v[i], e0 = r.v[i + 1], m = r.v[i + 2];
				bool join = (how == TS_MERGED_PREV && m && !prev) ||
					    (how == TS_CONTIGUOUS && (bool)m == prev);

				if (join && w) {
					r.v[w - 2] = e0;
				} else {
					r.v[w] = s0;
					r.v[w + 1] = e0;
					r.v[w + 2] = how == TS_REMOVED ? m : 0;
					w += 3;
				}
				prev = m;
			}
		}
		for (i = 0; i < w && !rc; i += 3)
			if (!r.v[i + 2] && r.v[i + 1] > r.v[i])
				rc = tok_list_add(out, s + r.v[i], r.v[i + 1] - r.v[i],
						  in->v[k].first && r.v[i] == 0);
	}
	free(r.v);
	return rc;
}

/* Replace the raw bytes of every piece with ByteLevel's characters, for a
 * component that must see them (ByteLevel not last). */
static int map_bytes(struct enc *e, struct tok_list *in, struct tok_list *out)
{
	char c[4];
	int rc = 0;

	for (size_t k = 0; k < in->n && !rc; k++) {
		size_t off = out->bytes.len;

		rc = tok_list_add(out, "", 0, in->v[k].first);
		for (size_t i = 0; i < in->v[k].len && !rc; i++)
			rc = tok_buf_add(&out->bytes, c,
					 tok_utf8_encode(tok_byte_char((uint8_t)in->bytes.p[in->v[k].off + i]), c));
		if (!rc)
			out->v[out->n - 1].len = out->bytes.len - off;
	}
	e->bytes_mapped = false;
	return rc;
}

static void swap_lists(struct enc *e)
{
	struct tok_list t = e->pa;

	e->pa = e->pb;
	e->pb = t;
	tok_list_clear(&e->pb);
}

/* Apply pt to e->pa (result in e->pa). */
static int pretokenize(struct enc *e, const struct tok_pre *pt)
{
	int rc = 0;

	if (e->bytes_mapped && pt->kind != TPT_SEQ) {
		if ((rc = map_bytes(e, &e->pa, &e->pb)))
			return rc;
		swap_lists(e);
	}
	switch (pt->kind) {
	case TPT_SEQ:
		for (size_t i = 0; i < pt->n_sub && !rc; i++)
			rc = pretokenize(e, &pt->sub[i]);
		return rc;
	case TPT_SPLIT:
	case TPT_DIGITS:
		rc = split_pieces(e, &pt->pat, pt->behavior, pt->invert, &e->pa, &e->pb);
		break;
	case TPT_BYTELEVEL:
		if (pt->add_prefix_space) {
			for (size_t k = 0; k < e->pa.n && !rc; k++) {
				const char *s = e->pa.bytes.p + e->pa.v[k].off;

				if (e->pa.v[k].len && s[0] == ' ')
					rc = tok_list_add(&e->pb, s, e->pa.v[k].len, e->pa.v[k].first);
				else if (!(rc = tok_list_add(&e->pb, " ", 1, e->pa.v[k].first)))
					rc = tok_buf_add(&e->pb.bytes, s, e->pa.v[k].len);
				if (!rc)
					e->pb.v[e->pb.n - 1].len = e->pb.bytes.len - e->pb.v[e->pb.n - 1].off;
			}
			if (rc)
				return rc;
			swap_lists(e);
		}
		if (pt->use_regex && (rc = split_pieces(e, &pt->pat, TS_ISOLATED, false, &e->pa, &e->pb)))
			return rc;
		if (pt->use_regex)
			swap_lists(e);
		e->bytes_mapped = true;
		return 0;
	case TPT_METASPACE: {
		char rep[4];
		size_t rl = tok_utf8_encode(pt->replacement, rep);

		for (size_t k = 0; k < e->pa.n && !rc; k++) {
			const char *s = e->pa.bytes.p + e->pa.v[k].off;
			size_t n = e->pa.v[k].len, off = e->pb.bytes.len;
			bool starts = n >= rl && !memcmp(s, rep, rl);

			if ((rc = tok_list_add(&e->pb, "", 0, e->pa.v[k].first)))
				break;
			/* after spaces become the replacement, a piece starting
			 * with a space starts with it too */
			if (!starts && !(n && s[0] == ' ') &&
			    (pt->prepend == TP_ALWAYS || (pt->prepend == TP_FIRST && e->pa.v[k].first)))
				rc = tok_buf_add(&e->pb.bytes, rep, rl);
			for (size_t i = 0; i < n && !rc; i++)
				rc = s[i] == ' ' ? tok_buf_add(&e->pb.bytes, rep, rl)
						 : tok_buf_add(&e->pb.bytes, s + i, 1);
			e->pb.v[e->pb.n - 1].len = e->pb.bytes.len - off;
		}
		if (rc)
			return rc;
		swap_lists(e);
		if (pt->split) {
			struct tok_pattern p = { .lit = rep, .lit_len = rl };

			rc = split_pieces(e, &p, TS_MERGED_NEXT, false, &e->pa, &e->pb);
			break;
		}
		return 0;
	}
	}
	if (!rc)
		swap_lists(e);
	return rc;
}

/* ==== BPE ==== */

static bool cand_less(const struct cand *a, const struct cand *b)
{
	return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static int heap_push(struct enc *e, uint32_t rank, uint32_t pos, int32_t id)
{
	size_t i;

	if (TOK_GROW(e->heap, e->heap_cap, e->heap_n + 1))
		return -ENOMEM;
	i = e->heap_n++;
	e->heap[i] = (struct cand){ rank, pos, id };
	while (i > 0 && cand_less(&e->heap[i], &e->heap[(i - 1) / 2])) {
		struct cand t = e->heap[i];

		e->heap[i] = e->heap[(i - 1) / 2];
		e->heap[(i - 1) / 2] = t;
		i = (i - 1) / 2;
	}
	return 0;
}

static struct cand heap_pop(struct enc *e)
{
	struct cand top = e->heap[0];
	size_t i = 0;

	e->heap[0] = e->heap[--e->heap_n];
	for (;;) {
		size_t l = 2 * i + 1, r = l + 1, m = i;

		if (l < e->heap_n && cand_less(&e->heap[l], &e->heap[m]))
			m = l;
		if (r < e->heap_n && cand_less(&e->heap[r], &e->heap[m]))
			m = r;
		if (m == i)
			break;
		struct cand t = e->heap[i];

		e->heap[i] = e->heap[m];
		e->heap[m] = t;
		i = m;
	}
	return top;
}

static int sym_add(struct enc *e, size_t *n, int32_t id, uint32_t len)
{
	if (TOK_GROW(e->sym, e->sym_cap, *n + 1))
		return -ENOMEM;
	e->sym[*n] = (struct sym){ id, (int32_t)*n - 1, (int32_t)*n + 1, len };
	(*n)++;
	return 0;
}

/* The word's characters as symbols (HF's BPE::merge_word before merging):
 * each character's vocabulary id, its <0xNN> bytes under byte_fallback,
 * or the unknown token (consecutive ones fused under fuse_unk). */
static int word_symbols(struct enc *e, const char *w, size_t n, size_t *ns)
{
	const struct mlens_tokenizer *tok = e->tok;
	int32_t unk_pending = -1;
	uint32_t unk_len = 0;
	size_t i = 0, k, bad;
	int rc;

	*ns = 0;
	while (i < n) {
		int32_t id;
		const char *s = w + i;
		size_t sl;

		k = tok_utf8_char((const uint8_t *)w + i, n - i, &bad);
		if (!k)
			k = bad;
		sl = k;
		if ((i > 0 && tok->prefix_len) || (i + k == n && tok->suffix_len)) {
			e->tmp.len = 0;
			if ((i > 0 && tok_buf_add(&e->tmp, tok->prefix, tok->prefix_len)) ||
			    tok_buf_add(&e->tmp, w + i, k) ||
			    (i + k == n && tok_buf_add(&e->tmp, tok->suffix, tok->suffix_len)))
				return -ENOMEM;
			s = e->tmp.p;
			sl = e->tmp.len;
		}
		id = tok_vocab_get(tok, &tok->vocab, s, sl);
		if (id >= 0) {
			if (unk_pending >= 0 && (rc = sym_add(e, ns, unk_pending, unk_len)))
				return rc;
			unk_pending = -1;
			if ((rc = sym_add(e, ns, id, (uint32_t)k)))
				return rc;
		} else {
			bool fell_back = false;

			if (tok->byte_fallback) {
				size_t j;

				for (j = 0; j < k && tok->fallback_id[(uint8_t)w[i + j]] >= 0; j++)
					;
				if (j == k) {
					for (j = 0; j < k; j++)
						if ((rc = sym_add(e, ns, tok->fallback_id[(uint8_t)w[i + j]], 1)))
							return rc;
					fell_back = true;
				}
			}
			if (!fell_back && tok->unk_id >= 0) {
				if (unk_pending >= 0 && tok->fuse_unk) {
					unk_len += (uint32_t)k;
				} else {
					if (unk_pending >= 0 && (rc = sym_add(e, ns, unk_pending, unk_len)))
						return rc;
					unk_pending = tok->unk_id;
					unk_len = (uint32_t)k;
				}
			}
		}
		i += k;
	}
	if (unk_pending >= 0 && (rc = sym_add(e, ns, unk_pending, unk_len)))
		return rc;
	return 0;
}

/* Merge the symbols as HF's Word::merge_all does: lowest rank first, the
 * leftmost among equals. */
static int merge_symbols(struct enc *e, size_t ns)
{
	const struct mlens_tokenizer *tok = e->tok;
	uint32_t rank;
	int32_t id;
	int rc;

	e->heap_n = 0;
	if (ns)
		e->sym[ns - 1].next = -1;
	for (size_t i = 0; i + 1 < ns; i++)
		if (tok_merge_get(&tok->merges, e->sym[i].id, e->sym[i + 1].id, &rank, &id) &&
		    (rc = heap_push(e, rank, (uint32_t)i, id)))
			return rc;
	while (e->heap_n) {
		struct cand c = heap_pop(e);
		struct sym *s = &e->sym[c.pos], *r;
		int32_t nx;

		if (!s->len || s->next < 0)
			continue;
		nx = s->next;
		r = &e->sym[nx];
		if (!tok_merge_get(&tok->merges, s->id, r->id, &rank, &id) || id != c.id)
			continue;
		s->id = c.id;
		s->len += r->len;
		s->next = r->next;
		r->len = 0;
		if (s->next >= 0)
			e->sym[s->next].prev = (int32_t)c.pos;
		if (s->prev >= 0 &&
		    tok_merge_get(&tok->merges, e->sym[s->prev].id, s->id, &rank, &id) &&
		    (rc = heap_push(e, rank, (uint32_t)s->prev, id)))
			return rc;
		if (s->next >= 0 &&
		    tok_merge_get(&tok->merges, s->id, e->sym[s->next].id, &rank, &id) &&
		    (rc = heap_push(e, rank, c.pos, id)))
			return rc;
	}
	return 0;
}

/* ==== Word cache ==== */

#define CACHE_SLOTS (1u << 17)
#define CACHE_MAX_WORD 128
#define CACHE_MAX_BYTES (16u << 20)

static bool cache_get(const struct mlens_tokenizer *tok, const char *w, size_t n, uint64_t h,
		      struct enc *e, int *rc)
{
	struct tok_cache *c = tok->cache;
	bool hit = false;

	*rc = 0;
	pthread_mutex_lock(&c->lock);
	if (c->slot) {
		for (size_t i = h & c->mask; c->slot[i].key_len; i = (i + 1) & c->mask) {
			struct tok_cache_ent *t = &c->slot[i];

			if (t->hash == h && t->key_len == n && !memcmp(c->store.p + t->key_off, w, n)) {
				const int32_t *ids = (const int32_t *)(void *)(c->store.p + t->ids_off);

				for (uint32_t j = 0; j < t->n_ids && !*rc; j++)
					*rc = push_id(e, ids[j]);
				hit = true;
				break;
			}
		}
	}
	pthread_mutex_unlock(&c->lock);
	return hit;
}

static void cache_put(const struct mlens_tokenizer *tok, const char *w, size_t n, uint64_t h,
		      const int32_t *ids, size_t n_ids)
{
	struct tok_cache *c = tok->cache;
	size_t i, pad;

	pthread_mutex_lock(&c->lock);
	if (!c->slot && !(c->slot = calloc(CACHE_SLOTS, sizeof(*c->slot))))
		goto out;
	c->mask = CACHE_SLOTS - 1;
	if (c->used >= CACHE_SLOTS / 2 || c->store.len > CACHE_MAX_BYTES) {
		/* full: start over, the words of this text fill it again */
		memset(c->slot, 0, CACHE_SLOTS * sizeof(*c->slot));
		c->used = 0;
		c->store.len = 0;
	}
	for (i = h & c->mask; c->slot[i].key_len; i = (i + 1) & c->mask)
		if (c->slot[i].hash == h && c->slot[i].key_len == n &&
		    !memcmp(c->store.p + c->slot[i].key_off, w, n))
			goto out;
	pad = (4 - (c->store.len + n) % 4) % 4;
	if (tok_buf_reserve(&c->store, n + pad + n_ids * sizeof(int32_t)))
		goto out;
	c->slot[i].hash = h;
	c->slot[i].key_off = (uint32_t)c->store.len;
	c->slot[i].key_len = (uint32_t)n;
	memcpy(c->store.p + c->store.len, w, n);
	c->store.len += n + pad;
	c->slot[i].ids_off = (uint32_t)c->store.len;
	c->slot[i].n_ids = (uint32_t)n_ids;
	if (n_ids)
		memcpy(c->store.p + c->store.len, ids, n_ids * sizeof(int32_t));
	c->store.len += n_ids * sizeof(int32_t);
	c->used++;
out:
	pthread_mutex_unlock(&c->lock);
}

/* One word (a pre-token) to ids, appended to e->ids. */
static int bpe_word(struct enc *e, const char *w, size_t n)
{
	const struct mlens_tokenizer *tok = e->tok;
	size_t ns = 0, first = e->n;
	uint64_t h = 0;
	bool cacheable = n <= CACHE_MAX_WORD;
	int rc;

	if (cacheable) {
		h = tok_hash(w, n) | 1;
		if (cache_get(tok, w, n, h, e, &rc))
			return rc;
	}
	if (e->bytes_mapped) {
		size_t i;

		for (i = 0; i < n && tok->byte_id[(uint8_t)w[i]] >= 0; i++)
			;
		if (i < n || tok->ignore_merges || tok->prefix_len || tok->suffix_len) {
			char c[4];

			e->mapped.len = 0;
			for (i = 0; i < n; i++)
				if (tok_buf_add(&e->mapped, c, tok_utf8_encode(tok_byte_char((uint8_t)w[i]), c)))
					return -ENOMEM;
		}
		if (tok->ignore_merges) {
			int32_t id = tok_vocab_get(tok, &tok->vocab, e->mapped.p, e->mapped.len);

			if (id >= 0) {
				rc = push_id(e, id);
				goto done;
			}
		}
		if (i == n && !tok->prefix_len && !tok->suffix_len) {
			for (i = 0; i < n; i++)
				if ((rc = sym_add(e, &ns, tok->byte_id[(uint8_t)w[i]], 1)))
					return rc;
		} else if ((rc = word_symbols(e, e->mapped.p, e->mapped.len, &ns))) {
			return rc;
		}
	} else {
		if (tok->ignore_merges) {
			int32_t id = tok_vocab_get(tok, &tok->vocab, w, n);

			if (id >= 0) {
				rc = push_id(e, id);
				goto done;
			}
		}
		if ((rc = word_symbols(e, w, n, &ns)))
			return rc;
	}
	if ((rc = merge_symbols(e, ns)))
		return rc;
	for (int32_t i = ns ? 0 : -1; i >= 0; i = e->sym[i].next)
		if ((rc = push_id(e, e->sym[i].id)))
			return rc;
done:
	if (!rc && cacheable)
		cache_put(tok, w, n, h, e->n > first ? e->ids + first : NULL, e->n - first);
	return rc;
}

/* ==== Added tokens ==== */

/* The split of text by the added tokens of set: HF's find_matches
 * (leftmost-longest, single_word, lstrip, rstrip). Calls piece for the
 * text between them and pushes the added tokens' ids. */
typedef int (*piece_fn)(struct enc *e, const char *s, size_t n, bool first);

static int split_added(struct enc *e, const struct tok_added_set *set, const char *t, size_t n,
		       bool first, piece_fn piece)
{
	const struct mlens_tokenizer *tok = e->tok;
	size_t i = 0, start_off = 0;
	int rc;

	while (set->n && i < n) {
		uint8_t b = (uint8_t)t[i];
		const struct tok_added *hit = NULL;
		size_t start, stop, k;
		uint32_t cp;

		for (uint32_t j = set->start[b]; j < set->start[b + 1]; j++) {
			const struct tok_added *a = &tok->added[set->idx[j]];

			if (a->len <= n - i && !memcmp(t + i, a->content, a->len)) {
				hit = a;
				break;
			}
		}
		if (!hit) {
			i++;
			continue;
		}
		start = i;
		stop = i + hit->len;
		i = stop;
		if (hit->single_word &&
		    ((start > 0 && is_word_char(last_char(t, start, &k))) ||
		     (stop < n && (tok_utf8_decode((const uint8_t *)t + stop, &cp), is_word_char(cp)))))
			continue;
		if (hit->lstrip) {
			size_t s = start;

			while (s > 0) {
				uint32_t c = last_char(t, s, &k);

				if (!is_space(c))
					break;
				s -= k;
			}
			start = s > start_off ? s : start_off;
		}
		if (hit->rstrip) {
			while (stop < n) {
				k = tok_utf8_decode((const uint8_t *)t + stop, &cp);
				if (!is_space(cp))
					break;
				stop += k;
			}
			i = stop;
		}
		if (start_off < start && (rc = piece(e, t + start_off, start - start_off,
						     first && start_off == 0)))
			return rc;
		if ((rc = push_id(e, hit->id)))
			return rc;
		start_off = stop;
	}
	if (start_off < n)
		return piece(e, t + start_off, n - start_off, first && start_off == 0);
	return 0;
}

/* A normalized piece between added tokens: pre-tokenize, then BPE. */
static int model_piece(struct enc *e, const char *s, size_t n, bool first)
{
	int rc = 0;

	tok_list_clear(&e->pa);
	tok_list_clear(&e->pb);
	e->bytes_mapped = false;
	if ((rc = tok_list_add(&e->pa, s, n, first)))
		return rc;
	if (e->tok->pre && (rc = pretokenize(e, e->tok->pre)))
		return rc;
	for (size_t k = 0; k < e->pa.n && !rc; k++) {
		const char *w = e->pa.bytes.p + e->pa.v[k].off, *r = e->tok->ws_rep;
		size_t wn = e->pa.v[k].len, rl = e->tok->ws_rep_len, start = 0;

		if (!e->tok->ws_split || e->bytes_mapped) {
			if (wn)
				rc = bpe_word(e, w, wn);
			continue;
		}
		/* cut before each ▁ that follows another character */
		for (size_t i = 1; i + rl <= wn && !rc; i++)
			if (!memcmp(w + i, r, rl) && (i < rl || memcmp(w + i - rl, r, rl)) &&
			    i > start) {
				rc = bpe_word(e, w + start, i - start);
				start = i;
			}
		if (!rc && start < wn)
			rc = bpe_word(e, w + start, wn - start);
	}
	return rc;
}

/* A raw piece between unnormalized added tokens: normalize, then split by
 * the normalized added tokens. */
static int raw_piece(struct enc *e, const char *s, size_t n, bool first)
{
	struct tok_buf norm;
	int rc;

	e->norm.len = 0;
	if ((rc = tok_buf_add(&e->norm, s, n)))
		return rc;
	if (e->tok->norm && (rc = normalize(e, e->tok->norm)))
		return rc;
	/* model_piece reuses the scratch: hand it a buffer of its own */
	norm = e->norm;
	memset(&e->norm, 0, sizeof(e->norm));
	rc = split_added(e, &e->tok->norm_set, norm.p, norm.len, first, model_piece);
	tok_buf_free(&e->norm);
	e->norm = norm;
	return rc;
}

int mlens_tokenizer_encode(const struct mlens_tokenizer *tok, const char *text, size_t len,
			   unsigned flags, int32_t *ids, size_t cap, size_t *n)
{
	struct enc e = { .tok = tok };
	struct tok_buf fixed = { 0 };
	int rc = 0;

	*n = 0;
	if (!tok_utf8_valid(text, len)) {
		if ((rc = tok_utf8_lossy(&fixed, text, len)))
			return rc;
		text = fixed.p;
		len = fixed.len;
	}
	if (!(e.md = pcre2_match_data_create(4, NULL))) {
		rc = -ENOMEM;
		goto out;
	}
	if (flags & MLENS_TOK_ADD_SPECIAL)
		for (size_t i = 0; i < tok->n_pre_ids && !rc; i++)
			rc = push_id(&e, tok->pre_ids[i]);
	if (!rc)
		rc = split_added(&e, &tok->raw_set, text, len, true, raw_piece);
	if (flags & MLENS_TOK_ADD_SPECIAL)
		for (size_t i = 0; i < tok->n_post_ids && !rc; i++)
			rc = push_id(&e, tok->post_ids[i]);
	if (!rc) {
		*n = e.n;
		if (e.n > cap)
			rc = -ENOBUFS;
		else if (e.n)
			memcpy(ids, e.ids, e.n * sizeof(*ids));
	}
out:
	pcre2_match_data_free(e.md);
	tok_buf_free(&fixed);
	tok_buf_free(&e.norm);
	tok_buf_free(&e.tmp);
	tok_buf_free(&e.mapped);
	tok_list_free(&e.pa);
	tok_list_free(&e.pb);
	free(e.ids);
	free(e.sym);
	free(e.heap);
	return rc;
}
