/* What chat templates call: Jinja's filters and tests, the methods of str
 * and dict that templates use, attribute and item access, slices and the
 * operators, each with Python's meaning. Anything not here is an error that
 * names it, never a silent guess. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template_int.h"

#define countof(a) (sizeof(a) / sizeof((a)[0]))

/* ==== Strings, by code point ==== */

/* Byte offsets of each code point, plus the end: n + 1 entries. */
static size_t *cp_offsets(struct ct_render *r, const struct ct_str *s, size_t *n)
{
	size_t *off = ct_alloc(r, (s->len + 1) * sizeof(*off)), k = 0;

	for (size_t i = 0; i < s->len; i++)
		if (((unsigned char)s->s[i] & 0xc0) != 0x80)
			off[k++] = i;
	off[k] = s->len;
	*n = k;
	return off;
}

static int is_ws(char c)
{
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static size_t cp_len(const char *s, size_t n)
{
	size_t k = 1;

	while (k < n && ((unsigned char)s[k] & 0xc0) == 0x80)
		k++;
	return k;
}

/* Is the code point at s (k bytes of UTF-8) whitespace to Python's
 * str.strip() and str.split()? ASCII blanks, U+001C-001F, U+0085, U+00A0,
 * U+1680, U+2000-200A, U+2028, U+2029, U+202F, U+205F, U+3000. */
static int is_space_cp(const char *s, size_t k)
{
	const unsigned char *u = (const unsigned char *)s;

	if (k == 1)
		return is_ws(s[0]) || (u[0] >= 0x1c && u[0] <= 0x1f);
	if (k == 2)
		return u[0] == 0xc2 && (u[1] == 0x85 || u[1] == 0xa0);
	if (k != 3)
		return 0;
	if (u[0] == 0xe1)
		return u[1] == 0x9a && u[2] == 0x80;
	if (u[0] == 0xe2 && u[1] == 0x80)
		return u[2] <= 0x8a || u[2] == 0xa8 || u[2] == 0xa9 || u[2] == 0xaf;
	if (u[0] == 0xe2 && u[1] == 0x81)
		return u[2] == 0x9f;
	return u[0] == 0xe3 && u[1] == 0x80 && u[2] == 0x80;
}

/* does the code point at s (k bytes) occur in chars (NULL: whitespace)? */
static int in_chars(const char *s, size_t k, const struct ct_str *chars)
{
	if (!chars)
		return is_space_cp(s, k);
	for (size_t i = 0; i < chars->len;) {
		size_t m = cp_len(chars->s + i, chars->len - i);

		if (m == k && !memcmp(chars->s + i, s, k))
			return 1;
		i += m;
	}
	return 0;
}

static struct ct_val strip(struct ct_render *r, const struct ct_str *s, const struct ct_str *chars,
			   int left, int right)
{
	size_t b = 0, e = s->len;

	if (left)
		while (b < e) {
			size_t k = cp_len(s->s + b, e - b);

			if (!in_chars(s->s + b, k, chars))
				break;
			b += k;
		}
	if (right)
		while (e > b) {
			size_t k = 1;

			while (k < e - b && ((unsigned char)s->s[e - k] & 0xc0) == 0x80)
				k++;
			if (!in_chars(s->s + e - k, k, chars))
				break;
			e -= k;
		}
	return ct_str_val(r, s->s + b, e - b);
}

/* ==== Case ==== */

/* Python's simple case mappings for Latin-1, Latin Extended-A, Greek and
 * Cyrillic; other code points have no case here. */
static uint32_t cp_upper(uint32_t c)
{
	if ((c >= 'a' && c <= 'z') || (c >= 0xe0 && c <= 0xfe && c != 0xf7) ||
	    (c >= 0x3b1 && c <= 0x3cb && c != 0x3c2) || (c >= 0x430 && c <= 0x44f))
		return c - 0x20;
	if (c >= 0x450 && c <= 0x45f)
		return c - 0x50;
	if ((c >= 0x100 && c <= 0x12f) || (c >= 0x132 && c <= 0x137) || (c >= 0x14a && c <= 0x177))
		return c & ~1u;
	if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e))
		return c & 1 ? c : c - 1;
	switch (c) {
	case 0xb5: return 0x39c;
	case 0xff: return 0x178;
	case 0x131: return 'I';
	case 0x17f: return 'S';
	case 0x3c2: return 0x3a3;
	case 0x3ac: return 0x386;
	case 0x3ad: case 0x3ae: case 0x3af: return c - 0x25;
	case 0x3cc: return 0x38c;
	case 0x3cd: case 0x3ce: return c - 0x3f;
	}
	return c;
}

static uint32_t cp_lower(uint32_t c)
{
	if ((c >= 'A' && c <= 'Z') || (c >= 0xc0 && c <= 0xde && c != 0xd7) ||
	    (c >= 0x391 && c <= 0x3ab && c != 0x3a2) || (c >= 0x410 && c <= 0x42f))
		return c + 0x20;
	if (c >= 0x400 && c <= 0x40f)
		return c + 0x50;
	if ((c >= 0x100 && c <= 0x12f) || (c >= 0x132 && c <= 0x137) || (c >= 0x14a && c <= 0x177))
		return c | 1;
	if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e))
		return c & 1 ? c + 1 : c;
	switch (c) {
	case 0x178: return 0xff;
	case 0x386: return 0x3ac;
	case 0x388: case 0x389: case 0x38a: return c + 0x25;
	case 0x38c: return 0x3cc;
	case 0x38e: case 0x38f: return c + 0x3f;
	}
	return c;
}

static int cp_cased(uint32_t c)
{
	return cp_upper(c) != c || cp_lower(c) != c || c == 0xdf || c == 0x138 || c == 0x149;
}

/* The code point at s (n bytes left); *k its length. */
static uint32_t cp_decode(const char *s, size_t n, size_t *k)
{
	const unsigned char *u = (const unsigned char *)s;
	int more = u[0] >= 0xf0 ? 3 : u[0] >= 0xe0 ? 2 : u[0] >= 0xc0 ? 1 : 0;
	uint32_t c = u[0] & (0x7f >> more);

	*k = 1;
	for (int i = 0; i < more && *k < n && (u[*k] & 0xc0) == 0x80; i++)
		c = (c << 6) | (u[(*k)++] & 0x3f);
	return c;
}

/* how: 'U' upper, 'L' lower, 'C' capitalize, 'T' str.title (a word starts
 * after any uncased character), 'J' Jinja's title filter (after blanks and
 * -({[<), which upper-cases a word's first letter rather than title-cases
 * it. Σ lowers to ς at a word's end and ß uppers to SS, as Python. */
static struct ct_val change_case(struct ct_render *r, const struct ct_str *s, char how)
{
	struct ct_buf b = { .r = r };
	int start = 1, prev_cased = 0;

	for (size_t i = 0; i < s->len;) {
		size_t k, k2 = 0, o = 0;
		uint32_t c = cp_decode(s->s + i, s->len - i, &k), d;
		int up = how == 'U' || ((how == 'T' || how == 'J') && start) || (how == 'C' && i == 0);
		char enc[8];

		/* the mappings to two code points */
		if (c == 0xdf && up) {
			ct_buf_puts(&b, how == 'U' || how == 'J' ? "SS" : "Ss");	/* ß */
		} else if (c == 0x149 && up) {
			ct_buf_puts(&b, "\xca\xbcN");	/* ŉ: ʼN */
		} else if (c == 0x130 && !up) {
			ct_buf_puts(&b, "i\xcc\x87");	/* İ: i and a combining dot */
		} else {
			d = up ? cp_upper(c) : cp_lower(c);
			if (c == 0x3a3 && !up && prev_cased &&
			    !(i + k < s->len && cp_cased(cp_decode(s->s + i + k, s->len - i - k, &k2))))
				d = 0x3c2;	/* final sigma */
			if (d == c) {
				ct_buf_put(&b, s->s + i, k);
			} else {
				ct_utf8_put(enc, &o, d);
				ct_buf_put(&b, enc, o);
			}
		}
		prev_cased = cp_cased(c);
		if (how == 'T')
			start = !prev_cased;
		else if (how == 'J')
			start = c < 0x80 && (is_ws((char)c) || (c && strchr("-({[<", (int)c)));
		i += k;
	}
	return ct_buf_val(&b);
}

static const char *find(const char *h, size_t hn, const char *n, size_t nn)
{
	if (!nn)
		return h;
	for (size_t i = 0; i + nn <= hn; i++)
		if (h[i] == n[0] && !memcmp(h + i, n, nn))
			return h + i;
	return NULL;
}

static struct ct_val replace(struct ct_render *r, const struct ct_str *s, const struct ct_str *old,
			     const struct ct_str *new, long long count)
{
	struct ct_buf b = { .r = r };
	size_t i = 0;

	if (!old->len) {
		/* Python puts new between every character and at both ends */
		for (;;) {
			if (count-- != 0)
				ct_buf_put(&b, new->s, new->len);
			if (i >= s->len)
				break;
			size_t k = cp_len(s->s + i, s->len - i);

			ct_buf_put(&b, s->s + i, k);
			i += k;
		}
		return ct_buf_val(&b);
	}
	while (count != 0) {
		const char *at = find(s->s + i, s->len - i, old->s, old->len);

		if (!at)
			break;
		ct_buf_put(&b, s->s + i, (size_t)(at - s->s) - i);
		ct_buf_put(&b, new->s, new->len);
		i = (size_t)(at - s->s) + old->len;
		count--;
	}
	ct_buf_put(&b, s->s + i, s->len - i);
	return ct_buf_val(&b);
}

static struct ct_val list_val(struct ct_list *l)
{
	return (struct ct_val){ .type = CT_LIST, .u.l = l };
}

static struct ct_val split(struct ct_render *r, const struct ct_str *s, const struct ct_str *sep,
			   long long maxsplit)
{
	struct ct_list *l = ct_list_new(r, 0);
	size_t i = 0;

	if (!sep) {
		/* runs of whitespace separate; none at either end */
		for (;;) {
			size_t b, k = 0;

			while (i < s->len && is_space_cp(s->s + i, k = cp_len(s->s + i, s->len - i)))
				i += k;
			if (i == s->len)
				break;
			if (maxsplit == 0) {
				struct ct_val tail = ct_str_val(r, s->s + i, s->len - i);

				ct_list_push(r, l, strip(r, tail.u.s, NULL, 0, 1));
				break;
			}
			b = i;
			while (i < s->len && !is_space_cp(s->s + i, k = cp_len(s->s + i, s->len - i)))
				i += k;
			ct_list_push(r, l, ct_str_val(r, s->s + b, i - b));
			maxsplit--;
		}
		return list_val(l);
	}
	if (!sep->len)
		ct_fail(r, 0, "split(): empty separator");
	for (;;) {
		const char *at = maxsplit != 0 ? find(s->s + i, s->len - i, sep->s, sep->len) : NULL;

		if (!at) {
			ct_list_push(r, l, ct_str_val(r, s->s + i, s->len - i));
			break;
		}
		ct_list_push(r, l, ct_str_val(r, s->s + i, (size_t)(at - s->s) - i));
		i = (size_t)(at - s->s) + sep->len;
		maxsplit--;
	}
	return list_val(l);
}

/* ==== Arguments ==== */

static const struct ct_val *arg(const struct ct_args *a, size_t i, const char *kw)
{
	for (size_t k = 0; k < a->n_kw; k++)
		if (!strcmp(a->kw[k], kw))
			return &a->kwv[k];
	return i < a->n_pos ? &a->pos[i] : NULL;
}

static int arg_bool(const struct ct_args *a, size_t i, const char *kw, int def)
{
	const struct ct_val *v = arg(a, i, kw);

	return v ? ct_truthy(*v) : def;
}

static const struct ct_str *arg_str(struct ct_render *r, int line, const struct ct_args *a, size_t i,
				    const char *kw, const char *what)
{
	const struct ct_val *v = arg(a, i, kw);

	if (!v || v->type == CT_NONE)
		return NULL;
	if (v->type != CT_STR)
		ct_fail(r, line, "%s: argument '%s' must be a string, not %s", what, kw, ct_type_name(*v));
	return v->u.s;
}

static long long arg_int(struct ct_render *r, int line, const struct ct_args *a, size_t i,
			 const char *kw, const char *what, long long def)
{
	const struct ct_val *v = arg(a, i, kw);

	if (!v || v->type == CT_NONE)
		return def;
	if (v->type == CT_INT)
		return v->u.i;
	if (v->type == CT_BOOL)
		return v->u.b;
	ct_fail(r, line, "%s: argument '%s' must be an integer, not %s", what, kw, ct_type_name(*v));
}

static const struct ct_str *need_str(struct ct_render *r, int line, struct ct_val v, const char *what)
{
	if (v.type == CT_UNDEF)
		ct_fail_undef(r, line, v);
	if (v.type != CT_STR)
		ct_fail(r, line, "%s needs a string, not %s", what, ct_type_name(v));
	return v.u.s;
}

/* ==== Access ==== */

struct ct_list *ct_iterate(struct ct_render *r, int line, struct ct_val v)
{
	struct ct_list *l;

	switch (v.type) {
	case CT_LIST:
		return v.u.l;
	case CT_UNDEF:
		return ct_list_new(r, 0);
	case CT_DICT:
	case CT_NS:
		l = ct_list_new(r, v.u.d->n);
		for (size_t i = 0; i < v.u.d->n; i++)
			l->v[l->n++] = v.u.d->k[i];
		return l;
	case CT_STR: {
		size_t n, *off = cp_offsets(r, v.u.s, &n);

		l = ct_list_new(r, n);
		for (size_t i = 0; i < n; i++)
			l->v[l->n++] = ct_str_val(r, v.u.s->s + off[i], off[i + 1] - off[i]);
		return l;
	}
	default:
		ct_fail(r, line, "a %s is not iterable", ct_type_name(v));
	}
}

static struct ct_val loop_attr(struct ct_render *r, const struct ct_loop *lp, const char *name)
{
	size_t i = lp->i, n = lp->items->n;

	if (!strcmp(name, "index"))
		return CT_INT_VAL((long long)i + 1);
	if (!strcmp(name, "index0"))
		return CT_INT_VAL((long long)i);
	if (!strcmp(name, "revindex"))
		return CT_INT_VAL((long long)(n - i));
	if (!strcmp(name, "revindex0"))
		return CT_INT_VAL((long long)(n - i - 1));
	if (!strcmp(name, "first"))
		return CT_BOOL_VAL(i == 0);
	if (!strcmp(name, "last"))
		return CT_BOOL_VAL(i + 1 == n);
	if (!strcmp(name, "length"))
		return CT_INT_VAL((long long)n);
	if (!strcmp(name, "depth"))
		return CT_INT_VAL(1);
	if (!strcmp(name, "depth0"))
		return CT_INT_VAL(0);
	if (!strcmp(name, "previtem"))
		return i ? lp->items->v[i - 1] : ct_undef(r, "there is no previous item");
	if (!strcmp(name, "nextitem"))
		return i + 1 < n ? lp->items->v[i + 1] : ct_undef(r, "there is no next item");
	return ct_undef(r, "'LoopContext' has no attribute '%s'", name);
}

struct ct_val ct_getattr(struct ct_render *r, int line, struct ct_val obj, const char *name)
{
	struct ct_val *v;

	switch (obj.type) {
	case CT_UNDEF:
		ct_fail_undef(r, line, obj);
	case CT_DICT:
	case CT_NS:
		if ((v = ct_dict_getc(obj.u.d, name)))
			return *v;
		return ct_undef(r, "'%s' has no attribute '%s'",
				obj.type == CT_DICT ? "dict object" : "namespace", name);
	case CT_LOOP:
		return loop_attr(r, obj.u.loop, name);
	case CT_NONE:
		return ct_undef(r, "'None' has no attribute '%s'", name);
	default:
		return ct_undef(r, "'%s object' has no attribute '%s'", ct_type_name(obj), name);
	}
}

struct ct_val ct_getitem(struct ct_render *r, int line, struct ct_val obj, struct ct_val key)
{
	long long i;

	if (obj.type == CT_UNDEF)
		ct_fail_undef(r, line, obj);
	if (obj.type == CT_DICT || obj.type == CT_NS) {
		struct ct_val *v = ct_dict_get(obj.u.d, key);

		if (v)
			return *v;
		if (key.type == CT_STR)
			return ct_undef(r, "'dict object' has no attribute '%s'", key.u.s->s);
		return ct_undef(r, "'dict object' has no such key");
	}
	if (key.type == CT_STR)
		return ct_getattr(r, line, obj, key.u.s->s);
	if ((obj.type != CT_LIST && obj.type != CT_STR) || (key.type != CT_INT && key.type != CT_BOOL))
		return ct_undef(r, "'%s object' has no element of that kind", ct_type_name(obj));
	i = key.type == CT_INT ? key.u.i : key.u.b;
	if (obj.type == CT_LIST) {
		long long n = (long long)obj.u.l->n;

		if (i < 0)
			i += n;
		if (i < 0 || i >= n)
			return ct_undef(r, "list object has no element %lld", key.type == CT_INT ? key.u.i : i);
		return obj.u.l->v[i];
	} else {
		size_t n, *off = cp_offsets(r, obj.u.s, &n);

		if (i < 0)
			i += (long long)n;
		if (i < 0 || i >= (long long)n)
			return ct_undef(r, "string index out of range");
		return ct_str_val(r, obj.u.s->s + off[i], off[i + 1] - off[i]);
	}
}

/* item.a.0.b as Jinja's attribute= arguments name it: dotted parts, those
 * of digits as indexes; an integer is one index. */
static struct ct_val attr_path(struct ct_render *r, int line, struct ct_val v, struct ct_val path)
{
	const char *p;

	if (path.type != CT_STR)
		return ct_getitem(r, line, v, path);
	p = path.u.s->s;
	for (;;) {
		const char *dot = strchr(p, '.');
		size_t len = dot ? (size_t)(dot - p) : strlen(p), k = 0;
		struct ct_val part = ct_str_val(r, p, len);

		while (k < len && p[k] >= '0' && p[k] <= '9')
			k++;
		if (len && k == len && len < 18)
			part = CT_INT_VAL(strtoll(part.u.s->s, NULL, 10));
		v = ct_getitem(r, line, v, part);
		if (!dot)
			return v;
		p = dot + 1;
	}
}

static long long slice_index(struct ct_render *r, int line, const struct ct_val *v)
{
	if (v->type == CT_INT)
		return v->u.i;
	if (v->type == CT_BOOL)
		return v->u.b;
	ct_fail(r, line, "slice indices must be integers or none, not %s", ct_type_name(*v));
}

/* One end of a slice of n items with step s, as PySlice_AdjustIndices:
 * negative counts from the end, then clamped; dflt when absent. */
static long long slice_bound(struct ct_render *r, int line, const struct ct_val *v, long long n,
			     long long s, long long dflt)
{
	long long i;

	if (!v || v->type == CT_NONE)
		return dflt;
	i = slice_index(r, line, v);
	if (i < 0 && (i += n) < 0)
		i = s < 0 ? -1 : 0;
	else if (i >= n)
		i = s < 0 ? n - 1 : n;
	return i;
}

struct ct_val ct_slice(struct ct_render *r, int line, struct ct_val obj, struct ct_val *start,
		       struct ct_val *stop, struct ct_val *step)
{
	long long n, b, e, s = 1;
	size_t *off = NULL, cps;
	struct ct_list *l = NULL;
	struct ct_buf buf = { .r = r };

	if (step && step->type != CT_NONE)
		s = slice_index(r, line, step);
	if (!s)
		ct_fail(r, line, "slice step cannot be zero");
	if (obj.type == CT_LIST) {
		n = (long long)obj.u.l->n;
	} else if (obj.type == CT_STR) {
		off = cp_offsets(r, obj.u.s, &cps);
		n = (long long)cps;
	} else if (obj.type == CT_UNDEF) {
		ct_fail_undef(r, line, obj);
	} else {
		/* Jinja turns a failed subscript into an undefined value */
		return ct_undef(r, "'%s object' is not subscriptable", ct_type_name(obj));
	}
	b = slice_bound(r, line, start, n, s, s < 0 ? n - 1 : 0);
	e = slice_bound(r, line, stop, n, s, s < 0 ? -1 : n);
	if (obj.type == CT_LIST) {
		l = ct_list_new(r, 0);
		l->tuple = obj.u.l->tuple;
	}
	for (long long i = b; s > 0 ? i < e : i > e; i += s) {
		if (l)
			ct_list_push(r, l, obj.u.l->v[i]);
		else
			ct_buf_put(&buf, obj.u.s->s + off[i], off[i + 1] - off[i]);
	}
	return l ? list_val(l) : ct_buf_val(&buf);
}

/* ==== Operators ==== */

static int is_num(struct ct_val v)
{
	return v.type == CT_INT || v.type == CT_FLOAT || v.type == CT_BOOL;
}

static double fnum(struct ct_val v)
{
	return v.type == CT_FLOAT ? v.u.f : v.type == CT_INT ? (double)v.u.i : v.u.b;
}

static long long inum(struct ct_val v)
{
	return v.type == CT_INT ? v.u.i : v.u.b;
}

static const char *const OP_NAMES[] = {
	[OP_ADD] = "+", [OP_SUB] = "-", [OP_MUL] = "*", [OP_DIV] = "/", [OP_FLOORDIV] = "//",
	[OP_MOD] = "%", [OP_POW] = "**", [OP_CONCAT] = "~",
};

static struct ct_val repeat(struct ct_render *r, int line, struct ct_val v, long long k)
{
	size_t unit = v.type == CT_STR ? v.u.s->len : v.u.l->n;

	if (k < 0)
		k = 0;
	if (unit && (unsigned long long)k > r->limits->max_output / unit)
		ct_fail_limit(r, line, "repeating a %s %lld times is more than the template may take",
			ct_type_name(v), k);
	if (v.type == CT_STR) {
		struct ct_buf b = { .r = r };

		for (long long i = 0; i < k; i++)
			ct_buf_put(&b, v.u.s->s, v.u.s->len);
		return ct_buf_val(&b);
	} else {
		struct ct_list *l = ct_list_new(r, unit * (size_t)k);

		for (long long i = 0; i < k; i++)
			for (size_t j = 0; j < unit; j++)
				l->v[l->n++] = v.u.l->v[j];
		return list_val(l);
	}
}

static int contains(struct ct_render *r, int line, struct ct_val item, struct ct_val c)
{
	switch (c.type) {
	case CT_STR:
		if (item.type != CT_STR)
			ct_fail(r, line, "'in <string>' requires a string on the left, not %s", ct_type_name(item));
		return find(c.u.s->s, c.u.s->len, item.u.s->s, item.u.s->len) != NULL;
	case CT_LIST:
		for (size_t i = 0; i < c.u.l->n; i++)
			if (ct_equal(item, c.u.l->v[i]))
				return 1;
		return 0;
	case CT_DICT:
	case CT_NS:
		return ct_dict_get(c.u.d, item) != NULL;
	case CT_UNDEF:
		return 0;
	default:
		ct_fail(r, line, "'in' needs a string, list or dict on the right, not %s", ct_type_name(c));
	}
}

/* 'fmt' % args with the conversions %s, %r, %d, %i and %%, as Python's */
static struct ct_val percent_format(struct ct_render *r, int line, const struct ct_str *fmt,
				    struct ct_val args)
{
	struct ct_buf b = { .r = r };
	const struct ct_val *v = &args;
	size_t n = 1, k = 0;

	if (args.type == CT_LIST && args.u.l->tuple) {
		v = args.u.l->v;
		n = args.u.l->n;
	}
	for (size_t i = 0; i < fmt->len; i++) {
		char c = fmt->s[i], conv = i + 1 < fmt->len ? fmt->s[i + 1] : 0;

		if (c != '%') {
			ct_buf_put(&b, &c, 1);
			continue;
		}
		i++;
		if (conv == '%') {
			ct_buf_put(&b, "%", 1);
			continue;
		}
		if (conv != 's' && conv != 'r' && conv != 'd' && conv != 'i')
			ct_fail(r, line, "'%%' formatting: only %%s, %%r, %%d and %%i are supported");
		if (k == n)
			ct_fail(r, line, "not enough arguments for format string");
		if (conv == 's') {
			ct_to_str(&b, line, v[k]);
		} else if (conv == 'r') {
			ct_repr(&b, line, v[k]);
		} else {
			char num[32];

			if (!is_num(v[k]))
				ct_fail(r, line, "%%%c format: a number is required, not %s", conv, ct_type_name(v[k]));
			if (v[k].type == CT_FLOAT && (v[k].u.f != v[k].u.f || fabs(v[k].u.f) >= 9.2e18))
				ct_fail(r, line, "%%%c format: %g does not fit an integer", conv, v[k].u.f);
			snprintf(num, sizeof(num), "%lld", v[k].type == CT_FLOAT ? (long long)v[k].u.f : inum(v[k]));
			ct_buf_puts(&b, num);
		}
		k++;
	}
	if (k < n)
		ct_fail(r, line, "not all arguments converted during string formatting");
	return ct_buf_val(&b);
}

struct ct_val ct_binop(struct ct_render *r, int line, int op, struct ct_val a, struct ct_val b)
{
	switch (op) {
	case OP_EQ: return CT_BOOL_VAL(ct_equal(a, b));
	case OP_NE: return CT_BOOL_VAL(!ct_equal(a, b));
	case OP_LT: return CT_BOOL_VAL(ct_compare(r, line, a, b) < 0);
	case OP_LE: return CT_BOOL_VAL(ct_compare(r, line, a, b) <= 0);
	case OP_GT: return CT_BOOL_VAL(ct_compare(r, line, a, b) > 0);
	case OP_GE: return CT_BOOL_VAL(ct_compare(r, line, a, b) >= 0);
	case OP_IN: return CT_BOOL_VAL(contains(r, line, a, b));
	case OP_NOTIN: return CT_BOOL_VAL(!contains(r, line, a, b));
	case OP_CONCAT: {
		struct ct_buf s = { .r = r };

		ct_to_str(&s, line, a);
		ct_to_str(&s, line, b);
		return ct_buf_val(&s);
	}
	}
	if (a.type == CT_UNDEF)
		ct_fail_undef(r, line, a);
	if (b.type == CT_UNDEF)
		ct_fail_undef(r, line, b);
	if (is_num(a) && is_num(b)) {
		int ints = a.type != CT_FLOAT && b.type != CT_FLOAT;
		long long x = inum(a), y = inum(b), z;
		double p = fnum(a), q = fnum(b);

		switch (op) {
		case OP_ADD:
			if (ints && __builtin_add_overflow(x, y, &z))
				break;
			return ints ? CT_INT_VAL(z) : (struct ct_val){ .type = CT_FLOAT, .u.f = p + q };
		case OP_SUB:
			if (ints && __builtin_sub_overflow(x, y, &z))
				break;
			return ints ? CT_INT_VAL(z) : (struct ct_val){ .type = CT_FLOAT, .u.f = p - q };
		case OP_MUL:
			if (ints && __builtin_mul_overflow(x, y, &z))
				break;
			return ints ? CT_INT_VAL(z) : (struct ct_val){ .type = CT_FLOAT, .u.f = p * q };
		case OP_DIV:
			if (q == 0)
				ct_fail(r, line, "division by zero");
			return (struct ct_val){ .type = CT_FLOAT, .u.f = p / q };
		case OP_FLOORDIV:
		case OP_MOD:
			if (q == 0)
				ct_fail(r, line, "%s by zero", op == OP_MOD ? "modulo" : "division");
			if (ints) {
				long long d, m;

				if (x == -__LONG_LONG_MAX__ - 1 && y == -1)
					break;
				d = x / y;
				m = x % y;
				if (m && ((m < 0) != (y < 0))) {
					d--;
					m += y;
				}
				return CT_INT_VAL(op == OP_MOD ? m : d);
			} else {
				double m = fmod(p, q);

				if (m && ((m < 0) != (q < 0)))
					m += q;
				return (struct ct_val){ .type = CT_FLOAT,
							.u.f = op == OP_MOD ? m : floor((p - m) / q + 0.5) };
			}
		case OP_POW:
			if (ints && y >= 0) {
				long long acc = 1;

				for (long long i = 0; i < y; i++) {
					if (__builtin_mul_overflow(acc, x, &acc))
						goto overflow;
					if (acc == 0 || acc == 1)
						break;
				}
				if (acc == -1 && !(y & 1))
					acc = 1;
				return CT_INT_VAL(acc);
			}
			return (struct ct_val){ .type = CT_FLOAT, .u.f = pow(p, q) };
		}
overflow:
		ct_fail(r, line, "integer overflow in '%s'", OP_NAMES[op]);
	}
	if (op == OP_ADD && a.type == CT_STR && b.type == CT_STR) {
		struct ct_buf s = { .r = r };

		ct_buf_put(&s, a.u.s->s, a.u.s->len);
		ct_buf_put(&s, b.u.s->s, b.u.s->len);
		return ct_buf_val(&s);
	}
	if (op == OP_ADD && a.type == CT_LIST && b.type == CT_LIST && a.u.l->tuple == b.u.l->tuple) {
		struct ct_list *l = ct_list_new(r, a.u.l->n + b.u.l->n);

		memcpy(l->v, a.u.l->v, a.u.l->n * sizeof(*l->v));
		memcpy(l->v + a.u.l->n, b.u.l->v, b.u.l->n * sizeof(*l->v));
		l->n = a.u.l->n + b.u.l->n;
		l->tuple = a.u.l->tuple;
		return list_val(l);
	}
	if (op == OP_MUL && (a.type == CT_STR || a.type == CT_LIST) && (b.type == CT_INT || b.type == CT_BOOL))
		return repeat(r, line, a, inum(b));
	if (op == OP_MUL && (b.type == CT_STR || b.type == CT_LIST) && (a.type == CT_INT || a.type == CT_BOOL))
		return repeat(r, line, b, inum(a));
	if (op == OP_MOD && a.type == CT_STR)
		return percent_format(r, line, a.u.s, b);
	ct_fail(r, line, "unsupported operand types for %s: %s and %s", OP_NAMES[op], ct_type_name(a),
		ct_type_name(b));
}

/* ==== Tests ==== */

enum {
	T_DEFINED, T_UNDEFINED, T_NONE, T_STRING, T_NUMBER, T_INTEGER, T_FLOAT, T_BOOLEAN,
	T_MAPPING, T_ITERABLE, T_SEQUENCE, T_CALLABLE, T_TRUE, T_FALSE, T_ODD, T_EVEN,
	T_DIVISIBLEBY, T_EQ, T_NE, T_LT, T_LE, T_GT, T_GE, T_IN, T_SAMEAS, T_LOWER, T_UPPER,
};

static const struct {
	const char *name;
	int id;
} TESTS[] = {
	{ "defined", T_DEFINED }, { "undefined", T_UNDEFINED }, { "none", T_NONE },
	{ "string", T_STRING }, { "number", T_NUMBER }, { "integer", T_INTEGER },
	{ "float", T_FLOAT }, { "boolean", T_BOOLEAN }, { "mapping", T_MAPPING },
	{ "iterable", T_ITERABLE }, { "sequence", T_SEQUENCE }, { "callable", T_CALLABLE },
	{ "true", T_TRUE }, { "false", T_FALSE }, { "odd", T_ODD }, { "even", T_EVEN },
	{ "divisibleby", T_DIVISIBLEBY }, { "eq", T_EQ }, { "equalto", T_EQ }, { "==", T_EQ },
	{ "ne", T_NE }, { "!=", T_NE }, { "lt", T_LT }, { "lessthan", T_LT }, { "<", T_LT },
	{ "le", T_LE }, { "<=", T_LE }, { "gt", T_GT }, { "greaterthan", T_GT }, { ">", T_GT },
	{ "ge", T_GE }, { ">=", T_GE }, { "in", T_IN }, { "sameas", T_SAMEAS },
	{ "lower", T_LOWER }, { "upper", T_UPPER },
};

int ct_test_id(const char *name)
{
	for (size_t i = 0; i < countof(TESTS); i++)
		if (!strcmp(TESTS[i].name, name))
			return TESTS[i].id;
	return -1;
}

int ct_test(struct ct_render *r, int line, int id, struct ct_val v, const struct ct_args *a)
{
	const struct ct_val *x = arg(a, 0, id == T_DIVISIBLEBY ? "num" : "value");

	switch (id) {
	case T_DEFINED: return v.type != CT_UNDEF;
	case T_UNDEFINED: return v.type == CT_UNDEF;
	case T_NONE: return v.type == CT_NONE;
	case T_STRING: return v.type == CT_STR;
	case T_NUMBER: return is_num(v);
	case T_INTEGER: return v.type == CT_INT;
	case T_FLOAT: return v.type == CT_FLOAT;
	case T_BOOLEAN: return v.type == CT_BOOL;
	case T_MAPPING: return v.type == CT_DICT;
	case T_ITERABLE:
		return v.type == CT_STR || v.type == CT_LIST || v.type == CT_DICT || v.type == CT_UNDEF;
	case T_SEQUENCE:
		return v.type == CT_STR || v.type == CT_LIST || v.type == CT_DICT || v.type == CT_UNDEF;
	case T_CALLABLE: return v.type == CT_MACRO || v.type == CT_FUNC;
	case T_TRUE: return v.type == CT_BOOL && v.u.b;
	case T_FALSE: return v.type == CT_BOOL && !v.u.b;
	case T_ODD:
	case T_EVEN:
	case T_DIVISIBLEBY: {
		/* Python's value % 2 == 1, value % 2 == 0, value % num == 0 */
		struct ct_val num = id == T_DIVISIBLEBY ? (x ? *x : CT_UNDEF_VAL) : CT_INT_VAL(2), m;

		if (!is_num(v) || !is_num(num))
			ct_fail(r, line, "test '%s' needs numbers, not %s",
				id == T_ODD ? "odd" : id == T_EVEN ? "even" : "divisibleby",
				ct_type_name(is_num(v) ? num : v));
		m = ct_binop(r, line, OP_MOD, v, num);
		return ct_equal(m, CT_INT_VAL(id == T_ODD));
	}
	case T_LOWER:
	case T_UPPER: {
		/* str(value).islower(): some cased letter, none of the other case */
		const struct ct_str *str = ct_stringify(r, line, v).u.s;
		int lower = 0, upper = 0;

		for (size_t i = 0, k; i < str->len; i += k) {
			uint32_t c = cp_decode(str->s + i, str->len - i, &k);

			if (cp_lower(c) != c)
				upper = 1;
			else if (cp_cased(c))
				lower = 1;
		}
		return id == T_LOWER ? lower && !upper : upper && !lower;
	}
	}
	if (!x)
		ct_fail(r, line, "this test needs a value to compare with");
	switch (id) {
	case T_EQ: return ct_equal(v, *x);
	case T_NE: return !ct_equal(v, *x);
	case T_LT: return ct_compare(r, line, v, *x) < 0;
	case T_LE: return ct_compare(r, line, v, *x) <= 0;
	case T_GT: return ct_compare(r, line, v, *x) > 0;
	case T_GE: return ct_compare(r, line, v, *x) >= 0;
	case T_IN: return contains(r, line, v, *x);
	case T_SAMEAS:
		if (v.type != x->type)
			return 0;
		if (v.type == CT_STR)
			return v.u.s == x->u.s;
		if (v.type == CT_LIST)
			return v.u.l == x->u.l;
		if (v.type == CT_DICT || v.type == CT_NS)
			return v.u.d == x->u.d;
		return ct_equal(v, *x);
	}
	ct_fail(r, line, "internal error: test %d", id);
}

int ct_test_by_name(struct ct_render *r, int line, const char *name, struct ct_val v, const struct ct_args *a)
{
	int id = ct_test_id(name);

	if (id < 0)
		ct_fail(r, line, "unknown test '%s'", name);
	return ct_test(r, line, id, v, a);
}

/* ==== Sorting (stable, as Python's) ==== */

struct sort_ctx {
	struct ct_render *r;
	int line, ci, rev;
	const struct ct_val *attr;	/* attribute= (NULL: the items themselves) */
	int by_value;	/* dictsort: items are (key, value) pairs */
};

static struct ct_val sort_key(struct sort_ctx *c, struct ct_val v)
{
	if (c->by_value >= 0 && v.type == CT_LIST && v.u.l->n == 2)
		v = v.u.l->v[c->by_value];
	if (c->attr)
		v = attr_path(c->r, c->line, v, *c->attr);
	if (c->ci && v.type == CT_STR)
		v = change_case(c->r, v.u.s, 'L');
	return v;
}

static int sort_cmp(struct sort_ctx *c, struct ct_val a, struct ct_val b)
{
	int k = ct_compare(c->r, c->line, sort_key(c, a), sort_key(c, b));

	return c->rev ? -k : k;
}

static void merge_sort(struct sort_ctx *c, struct ct_val *v, struct ct_val *tmp, size_t n)
{
	size_t h = n / 2, i = 0, j = h, k = 0;

	if (n < 2)
		return;
	merge_sort(c, v, tmp, h);
	merge_sort(c, v + h, tmp, n - h);
	while (i < h && j < n)
		tmp[k++] = sort_cmp(c, v[j], v[i]) < 0 ? v[j++] : v[i++];
	while (i < h)
		tmp[k++] = v[i++];
	while (j < n)
		tmp[k++] = v[j++];
	memcpy(v, tmp, n * sizeof(*v));
}

static struct ct_list *sorted(struct sort_ctx *c, const struct ct_list *in)
{
	struct ct_list *l = ct_list_new(c->r, in->n);
	struct ct_val *tmp = ct_alloc(c->r, (in->n + 1) * sizeof(*tmp));

	if (in->n)
		memcpy(l->v, in->v, in->n * sizeof(*l->v));
	l->n = in->n;
	c->r->steps += in->n;
	merge_sort(c, l->v, tmp, l->n);
	return l;
}

/* ==== Filters ==== */

enum {
	F_ABS, F_ATTR, F_CAPITALIZE, F_DEFAULT, F_DICTSORT, F_FIRST, F_FLOAT, F_INDENT, F_INT,
	F_ITEMS, F_JOIN, F_LAST, F_LENGTH, F_LIST, F_LOWER, F_MAP, F_MAX, F_MIN, F_REJECT,
	F_REJECTATTR, F_REPLACE, F_REVERSE, F_SAFE, F_SELECT, F_SELECTATTR, F_SORT, F_STRING,
	F_SUM, F_TITLE, F_TOJSON, F_TRIM, F_UNIQUE, F_UPPER,
};

static const struct {
	const char *name;
	int id;
} FILTERS[] = {
	{ "abs", F_ABS }, { "attr", F_ATTR }, { "capitalize", F_CAPITALIZE }, { "count", F_LENGTH },
	{ "d", F_DEFAULT }, { "default", F_DEFAULT }, { "dictsort", F_DICTSORT },
	{ "first", F_FIRST }, { "float", F_FLOAT }, { "indent", F_INDENT }, { "int", F_INT },
	{ "items", F_ITEMS }, { "join", F_JOIN }, { "last", F_LAST }, { "length", F_LENGTH },
	{ "list", F_LIST }, { "lower", F_LOWER }, { "map", F_MAP }, { "max", F_MAX },
	{ "min", F_MIN }, { "reject", F_REJECT }, { "rejectattr", F_REJECTATTR },
	{ "replace", F_REPLACE }, { "reverse", F_REVERSE }, { "safe", F_SAFE },
	{ "select", F_SELECT }, { "selectattr", F_SELECTATTR }, { "sort", F_SORT },
	{ "string", F_STRING }, { "sum", F_SUM }, { "title", F_TITLE }, { "tojson", F_TOJSON },
	{ "trim", F_TRIM }, { "unique", F_UNIQUE }, { "upper", F_UPPER },
};

int ct_filter_id(const char *name)
{
	for (size_t i = 0; i < countof(FILTERS); i++)
		if (!strcmp(FILTERS[i].name, name))
			return FILTERS[i].id;
	return -1;
}

static const char *filter_name(int id)
{
	for (size_t i = 0; i < countof(FILTERS); i++)
		if (FILTERS[i].id == id)
			return FILTERS[i].name;
	return "?";
}

struct ct_val ct_filter_by_name(struct ct_render *r, int line, const char *name, struct ct_val v,
				const struct ct_args *a)
{
	int id = ct_filter_id(name);

	if (id < 0)
		ct_fail(r, line, "unknown filter '%s'", name);
	return ct_filter(r, line, id, v, a);
}

/* The arguments after the first `skip` positional ones, for a filter or
 * test named by another (select('equalto', 3), map('upper')). */
static struct ct_args rest(const struct ct_args *a, size_t skip)
{
	struct ct_args b = *a;

	b.pos = a->n_pos > skip ? a->pos + skip : NULL;
	b.n_pos = a->n_pos > skip ? a->n_pos - skip : 0;
	return b;
}

static struct ct_val select_items(struct ct_render *r, int line, int id, struct ct_val v,
				  const struct ct_args *a)
{
	int by_attr = id == F_SELECTATTR || id == F_REJECTATTR;
	int keep_if = id == F_SELECT || id == F_SELECTATTR;
	/* as Jinja's: a false value (0, none, "") selects nothing */
	struct ct_list *in = ct_iterate(r, line, ct_truthy(v) ? v : CT_UNDEF_VAL), *out = ct_list_new(r, 0);
	const struct ct_val *attr = NULL;
	const char *test = NULL;
	struct ct_args targs = { 0 };
	size_t t = 0;

	if (by_attr) {
		if (a->n_pos < 1 || (a->pos[0].type != CT_STR && a->pos[0].type != CT_INT))
			ct_fail(r, line, "%s needs an attribute name", filter_name(id));
		attr = &a->pos[0];
		t = 1;
	}
	if (a->n_pos > t) {
		if (a->pos[t].type != CT_STR)
			ct_fail(r, line, "%s: the test must be named by a string", filter_name(id));
		test = a->pos[t].u.s->s;
		if (ct_test_id(test) < 0)
			ct_fail(r, line, "unknown test '%s'", test);
		targs = rest(a, t + 1);
	}
	for (size_t i = 0; i < in->n; i++) {
		struct ct_val x = attr ? attr_path(r, line, in->v[i], *attr) : in->v[i];
		int ok;

		r->steps++;
		ok = test ? ct_test_by_name(r, line, test, x, &targs) : ct_truthy(x);
		if (ok == keep_if)
			ct_list_push(r, out, in->v[i]);
	}
	return list_val(out);
}

static struct ct_val to_number(struct ct_render *r, int line, struct ct_val v, int want_int,
			       const struct ct_args *a)
{
	const struct ct_val *def = arg(a, 0, "default");
	struct ct_val d = def ? *def : want_int ? CT_INT_VAL(0) : (struct ct_val){ .type = CT_FLOAT };

	switch (v.type) {
	case CT_UNDEF:
		ct_fail_undef(r, line, v);	/* int(Undefined) raises in Jinja */
	case CT_INT:
	case CT_BOOL:
		return want_int ? CT_INT_VAL(inum(v)) : (struct ct_val){ .type = CT_FLOAT, .u.f = fnum(v) };
	case CT_FLOAT:
		if (want_int && (v.u.f != v.u.f || fabs(v.u.f) >= 9.2e18))
			return d;
		return want_int ? CT_INT_VAL((long long)v.u.f) : v;
	case CT_STR: {
		char *end;
		const char *s = v.u.s->s;

		if (want_int) {
			long long i = strtoll(s, &end, 10);

			while (is_ws(*end))
				end++;
			if (end != s && !*end && !memchr(s, '.', v.u.s->len))
				return CT_INT_VAL(i);
		}
		if (strpbrk(s, "xXpP"))
			return d;	/* strtod reads hex; Python's float() does not */
		{
			double f = strtod(s, &end);

			while (is_ws(*end))
				end++;
			if (end == s || *end)
				return d;
			if (want_int && (f != f || fabs(f) >= 9.2e18))
				return d;
			return want_int ? CT_INT_VAL((long long)f) : (struct ct_val){ .type = CT_FLOAT, .u.f = f };
		}
	}
	default:
		(void)r;
		(void)line;
		return d;
	}
}

static struct ct_val json_filter(struct ct_render *r, int line, struct ct_val v, const struct ct_args *a)
{
	/* transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
	struct ct_json_opts o = { 0 };
	const struct ct_val *ind = arg(a, 1, "indent"), *sep = arg(a, 2, "separators");
	struct ct_buf b = { .r = r };

	o.ensure_ascii = arg_bool(a, 0, "ensure_ascii", 0);
	o.sort_keys = arg_bool(a, 3, "sort_keys", 0);
	if (ind && ind->type != CT_NONE) {
		if (ind->type == CT_STR) {
			o.indent = ind->u.s->s;
		} else if (ind->type == CT_INT) {
			long long k = ind->u.i < 0 ? 0 : ind->u.i > 64 ? 64 : ind->u.i;
			char *s = ct_alloc(r, (size_t)k + 1);

			memset(s, ' ', (size_t)k);
			s[k] = 0;
			o.indent = s;
		} else {
			ct_fail(r, line, "tojson: indent must be an integer or a string");
		}
	}
	o.item_sep = o.indent ? "," : ", ";
	o.key_sep = ": ";
	if (sep && sep->type != CT_NONE) {
		if (sep->type != CT_LIST || sep->u.l->n != 2 || sep->u.l->v[0].type != CT_STR ||
		    sep->u.l->v[1].type != CT_STR)
			ct_fail(r, line, "tojson: separators must be a pair of strings");
		o.item_sep = sep->u.l->v[0].u.s->s;
		o.key_sep = sep->u.l->v[1].u.s->s;
	}
	ct_to_json(&b, line, v, &o, 0);
	return ct_buf_val(&b);
}

static struct ct_val indent_filter(struct ct_render *r, int line, struct ct_val v, const struct ct_args *a)
{
	const struct ct_val *w = arg(a, 0, "width");
	int first = arg_bool(a, 1, "first", 0), blank = arg_bool(a, 2, "blank", 0);
	struct ct_buf pad = { .r = r }, b = { .r = r };
	const struct ct_str *s;
	size_t i = 0;
	int at_start = 1;

	if (!w || w->type == CT_INT) {
		long long k = w ? w->u.i : 4;

		for (long long j = 0; j < k && j < 256; j++)
			ct_buf_put(&pad, " ", 1);
	} else if (w->type == CT_STR) {
		ct_buf_put(&pad, w->u.s->s, w->u.s->len);
	} else {
		ct_fail(r, line, "indent: width must be an integer or a string");
	}
	s = ct_stringify(r, line, v).u.s;
	while (i <= s->len) {
		const char *nl = memchr(s->s + i, '\n', s->len - i);
		size_t e = nl ? (size_t)(nl - s->s) : s->len;
		int empty = e == i;

		if (pad.n && ((at_start && first) || (!at_start && (blank || !empty))))
			ct_buf_put(&b, pad.p, pad.n);
		ct_buf_put(&b, s->s + i, e - i);
		if (!nl)
			break;
		ct_buf_put(&b, "\n", 1);
		i = e + 1;
		at_start = 0;
	}
	return ct_buf_val(&b);
}

struct ct_val ct_filter(struct ct_render *r, int line, int id, struct ct_val v, const struct ct_args *a)
{
	const char *name = filter_name(id);

	switch (id) {
	case F_SAFE:
		return v;
	case F_DEFAULT: {
		const struct ct_val *d = arg(a, 0, "default_value");

		if (v.type == CT_UNDEF || (arg_bool(a, 1, "boolean", 0) && !ct_truthy(v)))
			return d ? *d : ct_cstr(r, "");
		return v;
	}
	case F_LENGTH:
		switch (v.type) {
		case CT_UNDEF: return CT_INT_VAL(0);
		case CT_STR: return CT_INT_VAL((long long)ct_utf8_len(v.u.s->s, v.u.s->len));
		case CT_LIST: return CT_INT_VAL((long long)v.u.l->n);
		case CT_DICT:
		case CT_NS: return CT_INT_VAL((long long)v.u.d->n);
		default: ct_fail(r, line, "a %s has no length", ct_type_name(v));
		}
	case F_STRING:
		return ct_stringify(r, line, v);
	case F_TOJSON:
		return json_filter(r, line, v, a);
	case F_ATTR: {
		const struct ct_str *n = arg_str(r, line, a, 0, "name", "attr");

		if (!n)
			ct_fail(r, line, "attr needs a name");
		return ct_getattr(r, line, v, n->s);
	}
	case F_ITEMS: {
		struct ct_list *l;

		if (v.type == CT_UNDEF)
			return list_val(ct_list_new(r, 0));
		if (v.type != CT_DICT && v.type != CT_NS)
			ct_fail(r, line, "items needs a dict, not %s", ct_type_name(v));
		l = ct_list_new(r, v.u.d->n);
		for (size_t i = 0; i < v.u.d->n; i++) {
			struct ct_list *p = ct_list_new(r, 2);

			p->tuple = 1;
			p->v[0] = v.u.d->k[i];
			p->v[1] = v.u.d->v[i];
			p->n = 2;
			l->v[l->n++] = list_val(p);
		}
		return list_val(l);
	}
	case F_LIST: {
		struct ct_list *in = ct_iterate(r, line, v), *l = ct_list_new(r, in->n);

		if (in->n)
			memcpy(l->v, in->v, in->n * sizeof(*l->v));
		l->n = in->n;
		return list_val(l);
	}
	case F_FIRST:
	case F_LAST: {
		struct ct_list *l;

		if (id == F_LAST && v.type == CT_UNDEF)
			ct_fail_undef(r, line, v);	/* reversed(Undefined) raises in Jinja */
		l = ct_iterate(r, line, v);

		if (!l->n)
			return ct_undef(r, "%s: the sequence is empty", name);
		return l->v[id == F_FIRST ? 0 : l->n - 1];
	}
	case F_REVERSE: {
		struct ct_list *in = ct_iterate(r, line, v), *l = ct_list_new(r, in->n);

		for (size_t i = in->n; i-- > 0;)
			l->v[l->n++] = in->v[i];
		if (v.type == CT_STR) {
			struct ct_buf b = { .r = r };

			for (size_t i = 0; i < l->n; i++)
				ct_buf_put(&b, l->v[i].u.s->s, l->v[i].u.s->len);
			return ct_buf_val(&b);
		}
		return list_val(l);
	}
	case F_JOIN: {
		const struct ct_str *sep = arg_str(r, line, a, 0, "d", "join");
		const struct ct_val *attr = arg(a, 1, "attribute");
		struct ct_list *l = ct_iterate(r, line, v);
		struct ct_buf b = { .r = r };

		for (size_t i = 0; i < l->n; i++) {
			struct ct_val x = l->v[i];

			if (i && sep)
				ct_buf_put(&b, sep->s, sep->len);
			if (attr)
				x = attr_path(r, line, x, *attr);
			ct_to_str(&b, line, x);
		}
		return ct_buf_val(&b);
	}
	case F_MAP: {
		const struct ct_val *attr = arg(a, 99, "attribute"), *def = arg(a, 99, "default");
		struct ct_list *in = ct_iterate(r, line, ct_truthy(v) ? v : CT_UNDEF_VAL), *l = ct_list_new(r, in->n);
		const char *fname = NULL;
		struct ct_args fargs = rest(a, 1);

		if (!attr) {
			if (!a->n_pos || a->pos[0].type != CT_STR)
				ct_fail(r, line, "map needs attribute='name' or a filter name");
			fname = a->pos[0].u.s->s;
			if (ct_filter_id(fname) < 0)
				ct_fail(r, line, "unknown filter '%s'", fname);
		}
		for (size_t i = 0; i < in->n; i++) {
			struct ct_val x = in->v[i];

			r->steps++;
			if (fname) {
				x = ct_filter_by_name(r, line, fname, x, &fargs);
			} else {
				x = attr_path(r, line, x, *attr);
				if (x.type == CT_UNDEF && def)
					x = *def;
			}
			l->v[l->n++] = x;
		}
		return list_val(l);
	}
	case F_SELECT:
	case F_REJECT:
	case F_SELECTATTR:
	case F_REJECTATTR:
		return select_items(r, line, id, v, a);
	case F_TRIM:
		return strip(r, need_str(r, line, ct_stringify(r, line, v), "trim"),
			     arg_str(r, line, a, 0, "chars", "trim"), 1, 1);
	case F_LOWER:
	case F_UPPER:
	case F_CAPITALIZE:
	case F_TITLE:
		return change_case(r, ct_stringify(r, line, v).u.s,
				   id == F_LOWER ? 'L' : id == F_UPPER ? 'U' : id == F_TITLE ? 'J' : 'C');
	case F_REPLACE: {
		const struct ct_str *old = arg_str(r, line, a, 0, "old", "replace"),
				    *new = arg_str(r, line, a, 1, "new", "replace");

		if (!old || !new)
			ct_fail(r, line, "replace needs the old and the new string");
		return replace(r, ct_stringify(r, line, v).u.s, old, new,
			       arg_int(r, line, a, 2, "count", "replace", -1));
	}
	case F_INT:
	case F_FLOAT:
		return to_number(r, line, v, id == F_INT, a);
	case F_ABS:
		if (v.type == CT_INT && v.u.i != -__LONG_LONG_MAX__ - 1)
			return CT_INT_VAL(v.u.i < 0 ? -v.u.i : v.u.i);
		if (v.type == CT_FLOAT)
			return (struct ct_val){ .type = CT_FLOAT, .u.f = fabs(v.u.f) };
		ct_fail(r, line, "abs needs a number, not %s", ct_type_name(v));
	case F_INDENT:
		return indent_filter(r, line, v, a);
	case F_DICTSORT: {
		struct sort_ctx c = { r, line, !arg_bool(a, 0, "case_sensitive", 0),
				      arg_bool(a, 2, "reverse", 0), NULL, 0 };
		const struct ct_str *by = arg_str(r, line, a, 1, "by", "dictsort");

		if (by && !strcmp(by->s, "value"))
			c.by_value = 1;
		else if (by && strcmp(by->s, "key"))
			ct_fail(r, line, "dictsort: by must be 'key' or 'value'");
		return list_val(sorted(&c, ct_filter(r, line, F_ITEMS, v, &(struct ct_args){ 0 }).u.l));
	}
	case F_SORT: {
		struct sort_ctx c = { r, line, !arg_bool(a, 1, "case_sensitive", 0),
				      arg_bool(a, 0, "reverse", 0), arg(a, 2, "attribute"), -1 };

		return list_val(sorted(&c, ct_iterate(r, line, v)));
	}
	case F_UNIQUE:
	case F_MIN:
	case F_MAX: {
		int ci = !arg_bool(a, 0, "case_sensitive", 0);
		struct sort_ctx c = { r, line, ci, 0, arg(a, 1, "attribute"), -1 };
		struct ct_list *in = ct_iterate(r, line, v), *out = ct_list_new(r, 0);

		for (size_t i = 0; i < in->n; i++) {
			int dup = 0;

			r->steps += out->n + 1;
			if (r->steps > r->limits->max_steps)
				ct_fail_limit(r, line, "the template takes more than %lu steps to render",
					r->limits->max_steps);
			if (id != F_UNIQUE) {
				if (!out->n)
					ct_list_push(r, out, in->v[i]);
				else if ((sort_cmp(&c, in->v[i], out->v[0]) < 0) == (id == F_MIN) &&
					 sort_cmp(&c, in->v[i], out->v[0]) != 0)
					out->v[0] = in->v[i];
				continue;
			}
			for (size_t j = 0; j < out->n && !dup; j++)
				dup = ct_equal(sort_key(&c, in->v[i]), sort_key(&c, out->v[j]));
			if (!dup)
				ct_list_push(r, out, in->v[i]);
		}
		if (id == F_UNIQUE)
			return list_val(out);
		return out->n ? out->v[0] : ct_undef(r, "%s: the sequence is empty", name);
	}
	case F_SUM: {
		const struct ct_val *attr = arg(a, 0, "attribute");
		const struct ct_val *start = arg(a, 1, "start");
		struct ct_list *in = ct_iterate(r, line, v);
		struct ct_val acc = start ? *start : CT_INT_VAL(0);

		for (size_t i = 0; i < in->n; i++) {
			struct ct_val x = in->v[i];

			if (attr)
				x = attr_path(r, line, x, *attr);
			acc = ct_binop(r, line, OP_ADD, acc, x);
		}
		return acc;
	}
	}
	ct_fail(r, line, "internal error: filter %d", id);
}

/* ==== Methods ==== */

static const char *const STR_METHODS[] = {
	"strip", "lstrip", "rstrip", "startswith", "endswith", "split", "replace", "upper",
	"lower", "title", "capitalize", "format", "join", "find", "count",
};
static const char *const DICT_METHODS[] = { "items", "keys", "values", "get" };

int ct_has_method(struct ct_val obj, const char *name)
{
	if (obj.type == CT_LOOP)
		return !strcmp(name, "cycle");
	if (obj.type == CT_STR) {
		for (size_t i = 0; i < countof(STR_METHODS); i++)
			if (!strcmp(name, STR_METHODS[i]))
				return 1;
	} else if (obj.type == CT_DICT) {
		for (size_t i = 0; i < countof(DICT_METHODS); i++)
			if (!strcmp(name, DICT_METHODS[i]))
				return 1;
	}
	return 0;
}

static int affix(struct ct_render *r, int line, const struct ct_str *s, struct ct_val p, int end)
{
	if (p.type == CT_LIST) {
		for (size_t i = 0; i < p.u.l->n; i++)
			if (affix(r, line, s, p.u.l->v[i], end))
				return 1;
		return 0;
	}
	if (p.type != CT_STR)
		ct_fail(r, line, "%s needs a string or a tuple of strings, not %s",
			end ? "endswith" : "startswith", ct_type_name(p));
	if (p.u.s->len > s->len)
		return 0;
	return !memcmp(s->s + (end ? s->len - p.u.s->len : 0), p.u.s->s, p.u.s->len);
}

/* str.format with {} / {0} / {name} fields and {{ }} escapes; no format specs */
static struct ct_val format(struct ct_render *r, int line, const struct ct_str *s, const struct ct_args *a)
{
	struct ct_buf b = { .r = r };
	size_t auto_i = 0;

	for (size_t i = 0; i < s->len; i++) {
		char c = s->s[i];
		const char *close;
		size_t flen;

		if ((c == '{' || c == '}') && i + 1 < s->len && s->s[i + 1] == c) {
			ct_buf_put(&b, &c, 1);
			i++;
			continue;
		}
		if (c == '}')
			ct_fail(r, line, "format(): single '}' in the format string");
		if (c != '{') {
			ct_buf_put(&b, &c, 1);
			continue;
		}
		close = memchr(s->s + i, '}', s->len - i);
		if (!close)
			ct_fail(r, line, "format(): unclosed '{' in the format string");
		flen = (size_t)(close - s->s) - i - 1;
		{
			char field[64];
			const struct ct_val *v = NULL;

			if (flen >= sizeof(field) || memchr(s->s + i + 1, ':', flen) || memchr(s->s + i + 1, '!', flen))
				ct_fail(r, line, "format(): only {}, {N} and {name} fields are supported");
			memcpy(field, s->s + i + 1, flen);
			field[flen] = 0;
			if (!flen) {
				v = auto_i < a->n_pos ? &a->pos[auto_i] : NULL;
				auto_i++;
			} else if (field[0] >= '0' && field[0] <= '9') {
				size_t k = (size_t)strtoul(field, NULL, 10);

				v = k < a->n_pos ? &a->pos[k] : NULL;
			} else {
				for (size_t k = 0; k < a->n_kw; k++)
					if (!strcmp(a->kw[k], field))
						v = &a->kwv[k];
			}
			if (!v)
				ct_fail(r, line, "format(): no argument for field {%s}", field);
			ct_to_str(&b, line, *v);
		}
		i += flen + 1;
	}
	return ct_buf_val(&b);
}

struct ct_val ct_method(struct ct_render *r, int line, struct ct_val obj, const char *name,
			const struct ct_args *a)
{
	if (obj.type == CT_LOOP) {
		/* loop.cycle(a, b, ...): the argument for this turn */
		if (!a->n_pos)
			ct_fail(r, line, "loop.cycle() needs at least one value");
		return a->pos[obj.u.loop->i % a->n_pos];
	}
	if (obj.type == CT_DICT) {
		struct ct_dict *d = obj.u.d;
		struct ct_list *l;

		if (!strcmp(name, "get")) {
			const struct ct_val *k = arg(a, 0, "key"), *def = arg(a, 1, "default");
			struct ct_val *v;

			if (!k)
				ct_fail(r, line, "get() needs a key");
			v = ct_dict_get(d, *k);
			return v ? *v : def ? *def : CT_NONE_VAL;
		}
		if (!strcmp(name, "items"))
			return ct_filter(r, line, F_ITEMS, obj, &(struct ct_args){ 0 });
		l = ct_list_new(r, d->n);
		for (size_t i = 0; i < d->n; i++)
			l->v[l->n++] = !strcmp(name, "keys") ? d->k[i] : d->v[i];
		return list_val(l);
	}
	{
		const struct ct_str *s = obj.u.s;

		if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip"))
			return strip(r, s, arg_str(r, line, a, 0, "chars", name), name[0] != 'r',
				     name[0] != 'l');
		if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
			if (a->n_pos != 1)
				ct_fail(r, line, "%s() takes one argument", name);
			return CT_BOOL_VAL(affix(r, line, s, a->pos[0], name[0] == 'e'));
		}
		if (!strcmp(name, "split"))
			return split(r, s, arg_str(r, line, a, 0, "sep", "split"),
				     arg_int(r, line, a, 1, "maxsplit", "split", -1));
		if (!strcmp(name, "replace")) {
			const struct ct_str *old = arg_str(r, line, a, 0, "old", "replace"),
					    *new = arg_str(r, line, a, 1, "new", "replace");

			if (!old || !new)
				ct_fail(r, line, "replace() needs the old and the new string");
			return replace(r, s, old, new, arg_int(r, line, a, 2, "count", "replace", -1));
		}
		if (!strcmp(name, "upper") || !strcmp(name, "lower") || !strcmp(name, "title") ||
		    !strcmp(name, "capitalize"))
			return change_case(r, s, name[0] == 'u' ? 'U' : name[0] == 'l' ? 'L' :
						 name[0] == 't' ? 'T' : 'C');
		if (!strcmp(name, "format"))
			return format(r, line, s, a);
		if (!strcmp(name, "join")) {
			struct ct_list *l = ct_iterate(r, line, a->n_pos ? a->pos[0] : CT_UNDEF_VAL);
			struct ct_buf b = { .r = r };

			for (size_t i = 0; i < l->n; i++) {
				if (i)
					ct_buf_put(&b, s->s, s->len);
				ct_buf_put(&b, need_str(r, line, l->v[i], "join()")->s, l->v[i].u.s->len);
			}
			return ct_buf_val(&b);
		}
		if (!strcmp(name, "find") || !strcmp(name, "count")) {
			const struct ct_str *sub = arg_str(r, line, a, 0, "sub", name);
			const char *at;
			long long n = 0;
			size_t i = 0;

			if (!sub)
				ct_fail(r, line, "%s() needs a string", name);
			if (name[0] == 'f') {
				at = find(s->s, s->len, sub->s, sub->len);
				return CT_INT_VAL(at ? (long long)ct_utf8_len(s->s, (size_t)(at - s->s)) : -1);
			}
			if (!sub->len)
				return CT_INT_VAL((long long)ct_utf8_len(s->s, s->len) + 1);
			while ((at = find(s->s + i, s->len - i, sub->s, sub->len))) {
				n++;
				i = (size_t)(at - s->s) + sub->len;
			}
			return CT_INT_VAL(n);
		}
	}
	ct_fail(r, line, "unsupported method '%s' of a %s", name, ct_type_name(obj));
}
