/* Values of the chat-template interpreter: construction in the render's
 * arena, truth, equality and order as Python has them, and the three ways
 * a value becomes text: str(), repr() and json.dumps(). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template_int.h"

void *ct_alloc(struct ct_render *r, size_t n)
{
	void *m = ct_arena_alloc(&r->arena, n);

	if (!m)
		ct_fail_limit(r, 0, "the template needs more than %zu MiB of memory to render",
			r->limits->max_memory >> 20);
	return m;
}

struct ct_val ct_str_val(struct ct_render *r, const char *s, size_t len)
{
	struct ct_str *str = ct_alloc(r, sizeof(*str) + len + 1);

	if (len)
		memcpy(str->s, s, len);
	str->s[len] = 0;
	str->len = len;
	return (struct ct_val){ .type = CT_STR, .u.s = str };
}

struct ct_val ct_cstr(struct ct_render *r, const char *s)
{
	return ct_str_val(r, s, strlen(s));
}

struct ct_list *ct_list_new(struct ct_render *r, size_t cap)
{
	struct ct_list *l = ct_alloc(r, sizeof(*l));

	l->n = 0;
	l->tuple = 0;
	l->cap = cap;
	l->v = cap ? ct_alloc(r, cap * sizeof(*l->v)) : NULL;
	return l;
}

void ct_list_push(struct ct_render *r, struct ct_list *l, struct ct_val v)
{
	if (l->n == l->cap) {
		size_t cap = l->cap ? 2 * l->cap : 4;
		struct ct_val *nv = ct_alloc(r, cap * sizeof(*nv));

		if (l->n)
			memcpy(nv, l->v, l->n * sizeof(*nv));
		l->v = nv;
		l->cap = cap;
	}
	l->v[l->n++] = v;
}

struct ct_dict *ct_dict_new(struct ct_render *r, size_t cap)
{
	struct ct_dict *d = ct_alloc(r, sizeof(*d));

	d->n = 0;
	d->cap = cap;
	d->k = cap ? ct_alloc(r, cap * sizeof(*d->k)) : NULL;
	d->v = cap ? ct_alloc(r, cap * sizeof(*d->v)) : NULL;
	return d;
}

struct ct_val *ct_dict_get(const struct ct_dict *d, struct ct_val k)
{
	for (size_t i = 0; i < d->n; i++)
		if (ct_equal(d->k[i], k))
			return &d->v[i];
	return NULL;
}

struct ct_val *ct_dict_getc(const struct ct_dict *d, const char *key)
{
	size_t n = strlen(key);

	for (size_t i = 0; i < d->n; i++)
		if (d->k[i].type == CT_STR && d->k[i].u.s->len == n && !memcmp(d->k[i].u.s->s, key, n))
			return &d->v[i];
	return NULL;
}

void ct_dict_set(struct ct_render *r, struct ct_dict *d, struct ct_val k, struct ct_val v)
{
	struct ct_val *old = ct_dict_get(d, k);

	if (old) {
		*old = v;
		return;
	}
	if (d->n == d->cap) {
		size_t cap = d->cap ? 2 * d->cap : 4;
		struct ct_val *nk = ct_alloc(r, cap * sizeof(*nk)), *nv = ct_alloc(r, cap * sizeof(*nv));

		if (d->n) {
			memcpy(nk, d->k, d->n * sizeof(*nk));
			memcpy(nv, d->v, d->n * sizeof(*nv));
		}
		d->k = nk;
		d->v = nv;
		d->cap = cap;
	}
	d->k[d->n] = k;
	d->v[d->n++] = v;
}

size_t ct_utf8_len(const char *s, size_t n)
{
	size_t c = 0;

	for (size_t i = 0; i < n; i++)
		c += ((unsigned char)s[i] & 0xc0) != 0x80;
	return c;
}

int ct_truthy(struct ct_val v)
{
	switch (v.type) {
	case CT_UNDEF:
	case CT_NONE: return 0;
	case CT_BOOL: return v.u.b;
	case CT_INT: return v.u.i != 0;
	case CT_FLOAT: return v.u.f != 0;
	case CT_STR: return v.u.s->len != 0;
	case CT_LIST: return v.u.l->n != 0;
	case CT_DICT: return v.u.d->n != 0;
	default: return 1;
	}
}

static int is_num(struct ct_val v)
{
	return v.type == CT_INT || v.type == CT_FLOAT || v.type == CT_BOOL;
}

static double num(struct ct_val v)
{
	return v.type == CT_FLOAT ? v.u.f : v.type == CT_INT ? (double)v.u.i : v.u.b;
}

/* Nesting that ct_equal follows; deeper values compare unequal rather
 * than overflow the stack (templates can build lists of lists). */
#define CT_EQUAL_DEPTH 1000
static _Thread_local int equal_depth;

static int equal(struct ct_val a, struct ct_val b);

int ct_equal(struct ct_val a, struct ct_val b)
{
	int eq;

	if (equal_depth >= CT_EQUAL_DEPTH)
		return 0;
	equal_depth++;
	eq = equal(a, b);
	equal_depth--;
	return eq;
}

static int equal(struct ct_val a, struct ct_val b)
{
	if (is_num(a) && is_num(b)) {
		if (a.type != CT_FLOAT && b.type != CT_FLOAT)
			return (a.type == CT_INT ? a.u.i : a.u.b) == (b.type == CT_INT ? b.u.i : b.u.b);
		return num(a) == num(b);
	}
	if (a.type != b.type)
		return 0;
	switch (a.type) {
	case CT_UNDEF:
	case CT_NONE: return 1;
	case CT_STR: return a.u.s->len == b.u.s->len && !memcmp(a.u.s->s, b.u.s->s, a.u.s->len);
	case CT_LIST:
		if (a.u.l->n != b.u.l->n)
			return 0;
		for (size_t i = 0; i < a.u.l->n; i++)
			if (!ct_equal(a.u.l->v[i], b.u.l->v[i]))
				return 0;
		return 1;
	case CT_DICT:
		if (a.u.d->n != b.u.d->n)
			return 0;
		for (size_t i = 0; i < a.u.d->n; i++) {
			struct ct_val *w = ct_dict_get(b.u.d, a.u.d->k[i]);

			if (!w || !ct_equal(a.u.d->v[i], *w))
				return 0;
		}
		return 1;
	case CT_NS: return a.u.d == b.u.d;
	case CT_MACRO: return a.u.m == b.u.m;
	case CT_FUNC: return a.u.fn == b.u.fn;
	case CT_LOOP: return a.u.loop == b.u.loop;
	}
	return 0;
}

const char *ct_type_name(struct ct_val v)
{
	static const char *const names[] = {
		[CT_UNDEF] = "undefined", [CT_NONE] = "none", [CT_BOOL] = "bool", [CT_INT] = "int",
		[CT_FLOAT] = "float", [CT_STR] = "str", [CT_LIST] = "list", [CT_DICT] = "dict",
		[CT_NS] = "namespace", [CT_MACRO] = "macro", [CT_FUNC] = "function", [CT_LOOP] = "loop",
	};
	if (v.type == CT_LIST && v.u.l->tuple)
		return "tuple";
	return names[v.type];
}

int ct_compare(struct ct_render *r, int line, struct ct_val a, struct ct_val b)
{
	if (is_num(a) && is_num(b)) {
		if (a.type != CT_FLOAT && b.type != CT_FLOAT) {
			long long x = a.type == CT_INT ? a.u.i : a.u.b, y = b.type == CT_INT ? b.u.i : b.u.b;

			return (x > y) - (x < y);
		}
		return (num(a) > num(b)) - (num(a) < num(b));
	}
	if (a.type == CT_STR && b.type == CT_STR) {
		size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
		int c = memcmp(a.u.s->s, b.u.s->s, n);

		if (c)
			return c;
		return (a.u.s->len > b.u.s->len) - (a.u.s->len < b.u.s->len);
	}
	if (a.type == CT_LIST && b.type == CT_LIST) {
		int c = (a.u.l->n > b.u.l->n) - (a.u.l->n < b.u.l->n);

		if (++r->depth > r->limits->max_depth)
			ct_fail_limit(r, line, "comparing values nested deeper than %d levels",
				      r->limits->max_depth);
		for (size_t i = 0; i < a.u.l->n && i < b.u.l->n; i++)
			if (!ct_equal(a.u.l->v[i], b.u.l->v[i])) {
				c = ct_compare(r, line, a.u.l->v[i], b.u.l->v[i]);
				break;
			}
		r->depth--;
		return c;
	}
	if (a.type == CT_UNDEF)
		ct_fail_undef(r, line, a);
	if (b.type == CT_UNDEF)
		ct_fail_undef(r, line, b);
	ct_fail(r, line, "cannot order %s and %s", ct_type_name(a), ct_type_name(b));
}

/* ==== Text ==== */

void ct_buf_put(struct ct_buf *b, const char *s, size_t n)
{
	if (b->n + n + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 64;
		char *p;

		while (cap < b->n + n + 1)
			cap *= 2;
		if (b->heap) {
			p = realloc(b->p, cap);
			if (!p)
				ct_fail(b->r, 0, "out of memory");
		} else {
			p = ct_alloc(b->r, cap);
			if (b->n)
				memcpy(p, b->p, b->n);
		}
		b->p = p;
		b->cap = cap;
	}
	if (n)
		memcpy(b->p + b->n, s, n);
	b->n += n;
	b->p[b->n] = 0;
}

void ct_buf_puts(struct ct_buf *b, const char *s)
{
	ct_buf_put(b, s, strlen(s));
}

struct ct_val ct_buf_val(struct ct_buf *b)
{
	return ct_str_val(b->r, b->p ? b->p : "", b->n);
}

/* Python's repr() of a float: the shortest digits that read back the same,
 * fixed notation for exponents in [-4, 16), else d.ddde+XX. */
static void float_repr(char *out, size_t size, double f)
{
	char tmp[40], digits[24];
	int exp, nd = 0;
	size_t o = 0;

	if (isnan(f)) {
		snprintf(out, size, "nan");
		return;
	}
	if (isinf(f)) {
		snprintf(out, size, f < 0 ? "-inf" : "inf");
		return;
	}
	for (int prec = 1; prec <= 17; prec++) {
		snprintf(tmp, sizeof(tmp), "%.*e", prec - 1, f);
		if (strtod(tmp, NULL) == f)
			break;
	}
	{
		const char *p = tmp;
		char *e;

		if (*p == '-') {
			out[o++] = '-';
			p++;
		}
		for (; *p && *p != 'e'; p++)
			if (*p != '.')
				digits[nd++] = *p;
		exp = (int)strtol(p + 1, &e, 10);
	}
	while (nd > 1 && digits[nd - 1] == '0')
		nd--;
	if (exp >= -4 && exp < 16) {
		if (exp >= 0) {
			for (int i = 0; i <= exp; i++)
				out[o++] = i < nd ? digits[i] : '0';
			out[o++] = '.';
			if (nd > exp + 1)
				for (int i = exp + 1; i < nd; i++)
					out[o++] = digits[i];
			else
				out[o++] = '0';
		} else {
			out[o++] = '0';
			out[o++] = '.';
			for (int i = 0; i < -exp - 1; i++)
				out[o++] = '0';
			for (int i = 0; i < nd; i++)
				out[o++] = digits[i];
		}
		out[o] = 0;
	} else {
		out[o++] = digits[0];
		if (nd > 1) {
			out[o++] = '.';
			for (int i = 1; i < nd; i++)
				out[o++] = digits[i];
		}
		snprintf(out + o, size - o, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
	}
}

static void put_num(struct ct_buf *b, struct ct_val v)
{
	char tmp[48];

	if (v.type == CT_INT)
		snprintf(tmp, sizeof(tmp), "%lld", v.u.i);
	else
		float_repr(tmp, sizeof(tmp), v.u.f);
	ct_buf_puts(b, tmp);
}

static void repr_str(struct ct_buf *b, const struct ct_str *s)
{
	char q = memchr(s->s, '\'', s->len) && !memchr(s->s, '"', s->len) ? '"' : '\'';

	ct_buf_put(b, &q, 1);
	for (size_t i = 0; i < s->len; i++) {
		unsigned char c = (unsigned char)s->s[i];
		char esc[8];

		if (c == '\\' || c == (unsigned char)q) {
			esc[0] = '\\';
			esc[1] = (char)c;
			ct_buf_put(b, esc, 2);
		} else if (c == '\n') {
			ct_buf_puts(b, "\\n");
		} else if (c == '\r') {
			ct_buf_puts(b, "\\r");
		} else if (c == '\t') {
			ct_buf_puts(b, "\\t");
		} else if (c < 0x20 || c == 0x7f) {
			snprintf(esc, sizeof(esc), "\\x%02x", c);
			ct_buf_puts(b, esc);
		} else {
			ct_buf_put(b, (const char *)&c, 1);
		}
	}
	ct_buf_put(b, &q, 1);
}

void ct_repr(struct ct_buf *b, int line, struct ct_val v)
{
	struct ct_render *r = b->r;

	if (r->depth > r->limits->max_depth)
		ct_fail_limit(r, line, "printing a value nested deeper than %d levels", r->limits->max_depth);
	switch (v.type) {
	case CT_STR:
		repr_str(b, v.u.s);
		return;
	case CT_LIST:
		ct_buf_puts(b, v.u.l->tuple ? "(" : "[");
		for (size_t i = 0; i < v.u.l->n; i++) {
			if (i)
				ct_buf_puts(b, ", ");
			r->depth++;
			ct_repr(b, line, v.u.l->v[i]);
			r->depth--;
		}
		if (v.u.l->tuple && v.u.l->n == 1)
			ct_buf_puts(b, ",");
		ct_buf_puts(b, v.u.l->tuple ? ")" : "]");
		return;
	case CT_DICT:
	case CT_NS:
		ct_buf_puts(b, v.type == CT_NS ? "<Namespace {" : "{");
		for (size_t i = 0; i < v.u.d->n; i++) {
			if (i)
				ct_buf_puts(b, ", ");
			ct_repr(b, line, v.u.d->k[i]);
			ct_buf_puts(b, ": ");
			r->depth++;
			ct_repr(b, line, v.u.d->v[i]);
			r->depth--;
		}
		ct_buf_puts(b, v.type == CT_NS ? "}>" : "}");
		return;
	case CT_UNDEF:
		ct_buf_puts(b, "Undefined");
		return;
	default:
		ct_to_str(b, line, v);
	}
}

void ct_to_str(struct ct_buf *b, int line, struct ct_val v)
{
	switch (v.type) {
	case CT_UNDEF: return;
	case CT_NONE: ct_buf_puts(b, "None"); return;
	case CT_BOOL: ct_buf_puts(b, v.u.b ? "True" : "False"); return;
	case CT_INT:
	case CT_FLOAT: put_num(b, v); return;
	case CT_STR: ct_buf_put(b, v.u.s->s, v.u.s->len); return;
	case CT_LIST:
	case CT_DICT:
	case CT_NS: ct_repr(b, line, v); return;
	case CT_MACRO: ct_buf_puts(b, "<macro>"); return;
	case CT_FUNC: ct_buf_puts(b, "<function>"); return;
	case CT_LOOP: {
		char tmp[64];

		snprintf(tmp, sizeof(tmp), "<LoopContext %zu/%zu>", v.u.loop->i + 1, v.u.loop->items->n);
		ct_buf_puts(b, tmp);
		return;
	}
	}
}

struct ct_val ct_stringify(struct ct_render *r, int line, struct ct_val v)
{
	struct ct_buf b = { .r = r };

	if (v.type == CT_STR)
		return v;
	ct_to_str(&b, line, v);
	return ct_buf_val(&b);
}

/* ==== JSON, as Python's json.dumps ==== */

static void json_str(struct ct_buf *b, const char *s, size_t n, int ensure_ascii)
{
	ct_buf_puts(b, "\"");
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)s[i];
		char esc[16];

		switch (c) {
		case '"': ct_buf_puts(b, "\\\""); continue;
		case '\\': ct_buf_puts(b, "\\\\"); continue;
		case '\n': ct_buf_puts(b, "\\n"); continue;
		case '\r': ct_buf_puts(b, "\\r"); continue;
		case '\t': ct_buf_puts(b, "\\t"); continue;
		case '\b': ct_buf_puts(b, "\\b"); continue;
		case '\f': ct_buf_puts(b, "\\f"); continue;
		}
		if (c < 0x20 || (ensure_ascii && c == 0x7f)) {
			snprintf(esc, sizeof(esc), "\\u%04x", c);
			ct_buf_puts(b, esc);
		} else if (c >= 0x80 && ensure_ascii) {
			/* decode one UTF-8 sequence; \uXXXX, surrogate pairs above the BMP */
			unsigned cp;
			int more = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : c >= 0xc0 ? 1 : 0;

			cp = c & (0x3f >> more);
			for (int k = 0; k < more && i + 1 < n; k++)
				cp = (cp << 6) | ((unsigned char)s[++i] & 0x3f);
			if (cp >= 0x10000) {
				cp -= 0x10000;
				snprintf(esc, sizeof(esc), "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
			} else {
				snprintf(esc, sizeof(esc), "\\u%04x", cp);
			}
			ct_buf_puts(b, esc);
		} else {
			ct_buf_put(b, (const char *)&c, 1);
		}
	}
	ct_buf_puts(b, "\"");
}

static void json_newline(struct ct_buf *b, const struct ct_json_opts *o, int level)
{
	ct_buf_puts(b, "\n");
	for (int i = 0; i < level; i++)
		ct_buf_puts(b, o->indent);
}

static int key_cmp(const void *x, const void *y)
{
	const struct ct_str *a = *(struct ct_str *const *)x, *b = *(struct ct_str *const *)y;
	size_t n = a->len < b->len ? a->len : b->len;
	int c = memcmp(a->s, b->s, n);

	return c ? c : (a->len > b->len) - (a->len < b->len);
}

void ct_to_json(struct ct_buf *b, int line, struct ct_val v, const struct ct_json_opts *o, int level)
{
	struct ct_render *r = b->r;

	if (level > r->limits->max_depth)
		ct_fail_limit(r, line, "tojson: value nested deeper than %d levels", r->limits->max_depth);
	switch (v.type) {
	case CT_NONE: ct_buf_puts(b, "null"); return;
	case CT_BOOL: ct_buf_puts(b, v.u.b ? "true" : "false"); return;
	case CT_INT: put_num(b, v); return;
	case CT_FLOAT:
		if (isnan(v.u.f))
			ct_buf_puts(b, "NaN");
		else if (isinf(v.u.f))
			ct_buf_puts(b, v.u.f < 0 ? "-Infinity" : "Infinity");
		else
			put_num(b, v);
		return;
	case CT_STR: json_str(b, v.u.s->s, v.u.s->len, o->ensure_ascii); return;
	case CT_LIST:
		if (!v.u.l->n) {
			ct_buf_puts(b, "[]");
			return;
		}
		ct_buf_puts(b, "[");
		for (size_t i = 0; i < v.u.l->n; i++) {
			if (i)
				ct_buf_puts(b, o->item_sep);
			if (o->indent)
				json_newline(b, o, level + 1);
			ct_to_json(b, line, v.u.l->v[i], o, level + 1);
		}
		if (o->indent)
			json_newline(b, o, level);
		ct_buf_puts(b, "]");
		return;
	case CT_DICT: {
		struct ct_dict *d = v.u.d;
		size_t *order;
		struct ct_val *keys;

		if (!d->n) {
			ct_buf_puts(b, "{}");
			return;
		}
		/* keys as Python makes them: str kept, numbers and bools as text */
		keys = ct_alloc(r, d->n * sizeof(*keys));
		order = ct_alloc(r, d->n * sizeof(*order));
		for (size_t i = 0; i < d->n; i++) {
			struct ct_val k = d->k[i];

			order[i] = i;
			if (k.type == CT_BOOL)
				k = ct_cstr(r, k.u.b ? "true" : "false");
			else if (k.type == CT_NONE)
				k = ct_cstr(r, "null");
			else if (k.type == CT_INT || k.type == CT_FLOAT)
				k = ct_stringify(r, line, k);
			else if (k.type != CT_STR)
				ct_fail(r, line, "tojson: keys must be str, int, float, bool or None, not %s",
					ct_type_name(k));
			keys[i] = k;
		}
		if (o->sort_keys) {
			struct ct_str **ks = ct_alloc(r, d->n * sizeof(*ks));

			for (size_t i = 0; i < d->n; i++)
				ks[i] = keys[i].u.s;
			qsort(ks, d->n, sizeof(*ks), key_cmp);
			for (size_t i = 0; i < d->n; i++)
				for (size_t j = 0; j < d->n; j++)
					if (keys[j].u.s == ks[i])
						order[i] = j;
		}
		ct_buf_puts(b, "{");
		for (size_t i = 0; i < d->n; i++) {
			size_t j = order[i];

			if (i)
				ct_buf_puts(b, o->item_sep);
			if (o->indent)
				json_newline(b, o, level + 1);
			json_str(b, keys[j].u.s->s, keys[j].u.s->len, o->ensure_ascii);
			ct_buf_puts(b, o->key_sep);
			ct_to_json(b, line, d->v[j], o, level + 1);
		}
		if (o->indent)
			json_newline(b, o, level);
		ct_buf_puts(b, "}");
		return;
	}
	default:
		ct_fail(r, line, "tojson: a value of type %s is not JSON serializable", ct_type_name(v));
	}
}
