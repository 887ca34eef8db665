/* The chat-template parser: the lexer (text, tags, whitespace control as
 * transformers sets Jinja up: trim_blocks, lstrip_blocks, one trailing
 * newline dropped) and a recursive-descent parser into the syntax tree of
 * chat_template_int.h. Everything lives in the template's arena. */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_template_int.h"

/* ==== Arena ==== */

struct ct_chunk {
	struct ct_chunk *next;
	size_t size, used;
	_Alignas(16) unsigned char mem[];
};

#define CT_CHUNK_MIN (64u * 1024)

void *ct_arena_alloc(struct ct_arena *a, size_t n)
{
	struct ct_chunk *c = a->head;
	size_t need = (n + 15) & ~(size_t)15;

	if (need < n)
		return NULL;
	if (!c || c->size - c->used < need) {
		size_t size = need > CT_CHUNK_MIN ? need : CT_CHUNK_MIN;

		if (size > SIZE_MAX - sizeof(*c) ||
		    (a->limit && a->used + size > a->limit))
			return NULL;
		c = malloc(sizeof(*c) + size);
		if (!c)
			return NULL;
		c->size = size;
		c->used = 0;
		c->next = a->head;
		a->head = c;
		a->used += size;
	}
	c->used += need;
	return c->mem + c->used - need;
}

void ct_arena_free(struct ct_arena *a)
{
	struct ct_chunk *c = a->head, *next;

	for (; c; c = next) {
		next = c->next;
		free(c);
	}
	a->head = NULL;
	a->used = 0;
}

/* ==== Lexer ==== */

enum tok_type {
	T_EOF, T_TEXT, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END,
	T_NAME, T_INT, T_FLOAT, T_STR, T_OP,
};

struct tok {
	int type;
	int line;
	const char *p;		/* T_NAME, T_OP: the source text */
	size_t len;
	struct ct_val v;	/* T_TEXT, T_STR, T_INT, T_FLOAT */
};

struct parser {
	jmp_buf fail;
	struct mlens_chat_template *t;
	char *err;
	size_t errlen;
	const char *src;	/* normalised copy */
	size_t len;
	struct tok *toks;
	size_t n_toks, cap_toks, pos;
	int depth;
	size_t line_pos;	/* line_of(): line is the line of src[line_pos] */
	int line;
};

/* Nesting of blocks and expressions the parser accepts. */
#define CT_PARSE_DEPTH 128

__attribute__((format(printf, 3, 4)))
_Noreturn static void perr(struct parser *p, int line, const char *fmt, ...)
{
	va_list ap;
	int n = snprintf(p->err, p->errlen, "line %d: ", line);

	if (n < 0 || (size_t)n >= p->errlen)
		n = 0;
	va_start(ap, fmt);
	vsnprintf(p->err + n, p->errlen - n, fmt, ap);
	va_end(ap);
	longjmp(p->fail, 1);
}

static void *palloc(struct parser *p, size_t n)
{
	void *m = ct_arena_alloc(&p->t->arena, n);

	if (!m) {
		snprintf(p->err, p->errlen, "out of memory parsing the template");
		longjmp(p->fail, 2);
	}
	memset(m, 0, n);
	return m;
}

static struct ct_val pstr(struct parser *p, const char *s, size_t n)
{
	struct ct_str *str = palloc(p, sizeof(*str) + n + 1);

	memcpy(str->s, s, n);
	str->s[n] = 0;
	str->len = n;
	return (struct ct_val){ .type = CT_STR, .u.s = str };
}

static struct tok *push_tok(struct parser *p, int type, int line)
{
	struct tok *t;

	if (p->n_toks == p->cap_toks) {
		/* on the heap, not in the arena: only the parse needs them */
		size_t cap = p->cap_toks ? 2 * p->cap_toks : 256;
		struct tok *n = cap <= SIZE_MAX / sizeof(*n) ? realloc(p->toks, cap * sizeof(*n)) : NULL;

		if (!n) {
			snprintf(p->err, p->errlen, "out of memory parsing the template");
			longjmp(p->fail, 2);
		}
		p->toks = n;
		p->cap_toks = cap;
	}
	t = &p->toks[p->n_toks++];
	memset(t, 0, sizeof(*t));
	t->type = type;
	t->line = line;
	return t;
}

static int is_space(char c)
{
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static int is_name_start(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static int is_digit(char c)
{
	return c >= '0' && c <= '9';
}

/* The line of a source position; the lexer asks in increasing order, so
 * counting goes on from the last answer. */
static int line_of(struct parser *p, size_t pos)
{
	if (pos < p->line_pos) {
		p->line_pos = 0;
		p->line = 1;
	}
	for (; p->line_pos < pos && p->line_pos < p->len; p->line_pos++)
		p->line += p->src[p->line_pos] == '\n';
	return p->line;
}

void ct_utf8_put(char *out, size_t *n, uint32_t c)
{
	if (c < 0x80) {
		out[(*n)++] = (char)c;
	} else if (c < 0x800) {
		out[(*n)++] = (char)(0xc0 | (c >> 6));
		out[(*n)++] = (char)(0x80 | (c & 0x3f));
	} else if (c < 0x10000) {
		out[(*n)++] = (char)(0xe0 | (c >> 12));
		out[(*n)++] = (char)(0x80 | ((c >> 6) & 0x3f));
		out[(*n)++] = (char)(0x80 | (c & 0x3f));
	} else {
		out[(*n)++] = (char)(0xf0 | (c >> 18));
		out[(*n)++] = (char)(0x80 | ((c >> 12) & 0x3f));
		out[(*n)++] = (char)(0x80 | ((c >> 6) & 0x3f));
		out[(*n)++] = (char)(0x80 | (c & 0x3f));
	}
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* A string literal's body with Python's escapes decoded. */
static struct ct_val unescape(struct parser *p, const char *s, size_t n, int line)
{
	char *out = palloc(p, n + 1);
	size_t o = 0;

	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		int digits = 0;

		if (c != '\\' || i + 1 == n) {
			out[o++] = c;
			continue;
		}
		c = s[++i];
		switch (c) {
		case '\n': break;
		case '\\': out[o++] = '\\'; break;
		case '\'': out[o++] = '\''; break;
		case '"': out[o++] = '"'; break;
		case 'a': out[o++] = '\a'; break;
		case 'b': out[o++] = '\b'; break;
		case 'f': out[o++] = '\f'; break;
		case 'n': out[o++] = '\n'; break;
		case 'r': out[o++] = '\r'; break;
		case 't': out[o++] = '\t'; break;
		case 'v': out[o++] = '\v'; break;
		case 'x': digits = 2; break;
		case 'u': digits = 4; break;
		case 'U': digits = 8; break;
		default:
			if (c >= '0' && c <= '7') {
				uint32_t v = 0;
				int k = 0;

				while (k < 3 && i < n && s[i] >= '0' && s[i] <= '7')
					v = v * 8 + (uint32_t)(s[i++] - '0'), k++;
				i--;
				ct_utf8_put(out, &o, v);
			} else {
				out[o++] = '\\';
				out[o++] = c;
			}
		}
		if (digits) {
			uint32_t v = 0;

			for (int k = 0; k < digits; k++) {
				int h = i + 1 + k < n ? hexval(s[i + 1 + k]) : -1;

				if (h < 0)
					perr(p, line, "truncated \\%c escape in a string literal", c);
				v = v * 16 + (uint32_t)h;
			}
			if (v > 0x10ffff)
				perr(p, line, "escape \\%c beyond Unicode in a string literal", c);
			i += (size_t)digits;
			ct_utf8_put(out, &o, v);
		}
	}
	return pstr(p, out, o);
}

/* The tokens inside one tag, up to its end ("}}" or "%}" outside brackets). */
static size_t lex_tag(struct parser *p, size_t pos, int block, int *strip_after, int *keep_after)
{
	const char *s = p->src;
	int depth = 0;
	int line = line_of(p, pos);

	for (;;) {
		struct tok *t;
		char c;

		while (pos < p->len && is_space(s[pos])) {
			line += s[pos] == '\n';
			pos++;
		}
		if (pos >= p->len)
			perr(p, line, "unterminated %s: no closing %s", block ? "{% tag" : "{{ expression",
			     block ? "%}" : "}}");
		c = s[pos];
		if (depth == 0) {
			const char *end = block ? "%}" : "}}";

			if ((c == '-' || (block && c == '+')) && pos + 2 < p->len &&
			    !strncmp(s + pos + 1, end, 2)) {
				*strip_after = c == '-';
				*keep_after = c == '+';
				push_tok(p, block ? T_BLOCK_END : T_VAR_END, line);
				return pos + 3;
			}
			if (!strncmp(s + pos, end, 2)) {
				push_tok(p, block ? T_BLOCK_END : T_VAR_END, line);
				return pos + 2;
			}
		}
		if (is_name_start(c)) {
			size_t b = pos;

			while (pos < p->len && (is_name_start(s[pos]) || is_digit(s[pos])))
				pos++;
			t = push_tok(p, T_NAME, line);
			t->p = s + b;
			t->len = pos - b;
			continue;
		}
		if (is_digit(c)) {
			size_t b = pos;
			int is_float = 0;
			char buf[128];
			size_t k = 0;

			while (pos < p->len && (is_digit(s[pos]) || s[pos] == '_'))
				pos++;
			if (pos + 1 < p->len && s[pos] == '.' && is_digit(s[pos + 1])) {
				is_float = 1;
				pos++;
				while (pos < p->len && (is_digit(s[pos]) || s[pos] == '_'))
					pos++;
			}
			if (pos + 1 < p->len && (s[pos] == 'e' || s[pos] == 'E')) {
				size_t e = pos + 1;

				if (e < p->len && (s[e] == '+' || s[e] == '-'))
					e++;
				if (e < p->len && is_digit(s[e])) {
					is_float = 1;
					pos = e;
					while (pos < p->len && is_digit(s[pos]))
						pos++;
				}
			}
			for (size_t i = b; i < pos && k + 1 < sizeof(buf); i++)
				if (s[i] != '_')
					buf[k++] = s[i];
			buf[k] = 0;
			if (pos - b >= sizeof(buf) - 1)
				perr(p, line, "number literal too long");
			if (is_float) {
				t = push_tok(p, T_FLOAT, line);
				t->v = (struct ct_val){ .type = CT_FLOAT, .u.f = strtod(buf, NULL) };
			} else {
				long long v;

				errno = 0;
				v = strtoll(buf, NULL, 10);
				if (errno)
					perr(p, line, "integer literal %s out of range", buf);
				t = push_tok(p, T_INT, line);
				t->v = CT_INT_VAL(v);
			}
			continue;
		}
		if (c == '\'' || c == '"') {
			size_t b = ++pos;
			int sline = line;

			while (pos < p->len && s[pos] != c) {
				if (s[pos] == '\\' && pos + 1 < p->len)
					line += s[++pos] == '\n';
				else
					line += s[pos] == '\n';
				pos++;
			}
			if (pos >= p->len)
				perr(p, sline, "unterminated string literal");
			t = push_tok(p, T_STR, sline);
			t->v = unescape(p, s + b, pos - b, sline);
			pos++;
			continue;
		}
		{
			static const char *const two[] = { "//", "**", "==", "!=", "<=", ">=" };
			size_t n = 0;

			for (size_t i = 0; i < sizeof(two) / sizeof(two[0]); i++)
				if (pos + 1 < p->len && !strncmp(s + pos, two[i], 2))
					n = 2;
			if (!n && c && strchr("+-*/%~<>=()[]{},.:|", c))
				n = 1;
			if (!n && c > ' ' && c < 0x7f)
				perr(p, line, "unexpected character '%c' in a tag", c);
			if (!n)
				perr(p, line, "unexpected byte 0x%02x in a tag", (unsigned char)c);
			if (c == '(' || c == '[' || c == '{')
				depth++;
			else if ((c == ')' || c == ']' || c == '}') && depth > 0)
				depth--;
			t = push_tok(p, T_OP, line);
			t->p = s + pos;
			t->len = n;
			pos += n;
		}
	}
}

/* {% raw %}: returns the position after its tag's end, or 0 if the tag
 * at pos (after "{%") is not raw. */
static size_t raw_tag(struct parser *p, size_t pos, const char *word)
{
	const char *s = p->src;
	size_t n = strlen(word);

	if (pos < p->len && (s[pos] == '-' || s[pos] == '+'))
		pos++;
	while (pos < p->len && is_space(s[pos]))
		pos++;
	if (pos + n > p->len || strncmp(s + pos, word, n))
		return 0;
	pos += n;
	while (pos < p->len && is_space(s[pos]))
		pos++;
	if (pos < p->len && (s[pos] == '-' || s[pos] == '+'))
		pos++;
	if (pos + 2 > p->len || strncmp(s + pos, "%}", 2))
		return 0;
	return pos + 2;
}

static void push_text(struct parser *p, const char *s, size_t n, int line)
{
	struct tok *t;

	if (!n)
		return;
	t = push_tok(p, T_TEXT, line);
	t->v = pstr(p, s, n);
}

static void lex(struct parser *p)
{
	const char *s = p->src;
	size_t pos = 0;
	int strip_next = 0, line_starting = 1;

	while (pos <= p->len) {
		size_t k = pos, tb, te;
		int kind = 0, strip_before, keep_before, strip_after = 0, keep_after = 0;
		int line, text_line;

		while (k + 1 < p->len && !(s[k] == '{' && (s[k + 1] == '{' || s[k + 1] == '%' ||
							  s[k + 1] == '#')))
			k++;
		if (k + 1 >= p->len)
			k = p->len;
		else
			kind = s[k + 1];
		tb = pos;
		te = k;
		if (strip_next)
			while (tb < te && is_space(s[tb]))
				tb++;
		strip_next = 0;
		if (!kind) {
			push_text(p, s + tb, te - tb, line_of(p, tb));
			break;
		}
		strip_before = k + 2 < p->len && s[k + 2] == '-';
		keep_before = k + 2 < p->len && s[k + 2] == '+' && kind != '{';
		if (strip_before) {
			while (te > tb && is_space(s[te - 1]))
				te--;
		} else if (!keep_before && kind != '{') {
			/* lstrip_blocks: only blanks between the line start and the tag */
			size_t l = te;

			while (l > tb && s[l - 1] != '\n')
				l--;
			if (l > tb || line_starting) {
				size_t i = l;

				while (i < te && (s[i] == ' ' || s[i] == '\t' || s[i] == '\f' || s[i] == '\v'))
					i++;
				if (i == te)
					te = l;
			}
		}
		text_line = line_of(p, tb);
		line = line_of(p, k);
		if (kind == '%') {
			size_t end = raw_tag(p, k + 2, "raw");

			if (end) {
				size_t q = end, close = 0;

				push_text(p, s + tb, te - tb, text_line);
				while (q + 1 < p->len) {
					if (s[q] == '{' && s[q + 1] == '%' && (close = raw_tag(p, q + 2, "endraw")))
						break;
					q++;
				}
				if (!close)
					perr(p, line, "unterminated {%% raw %%} block: no {%% endraw %%}");
				{
					size_t rb = end, re = q;

					if (end >= 3 && s[end - 3] == '-')
						while (rb < re && is_space(s[rb]))
							rb++;
					if (q + 2 < p->len && s[q + 2] == '-')
						while (re > rb && is_space(s[re - 1]))
							re--;
					push_text(p, s + rb, re - rb, line_of(p, rb));
				}
				pos = close;
				strip_next = s[close - 3] == '-';
				line_starting = 0;
				if (!strip_next && s[close - 3] != '+' && pos < p->len && s[pos] == '\n') {
					pos++;
					line_starting = 1;
				}
				continue;
			}
		}
		push_text(p, s + tb, te - tb, text_line);
		if (kind == '#') {
			size_t q = k + 2;

			while (q + 1 < p->len && !(s[q] == '#' && s[q + 1] == '}'))
				q++;
			if (q + 1 >= p->len)
				perr(p, line, "unterminated comment: no closing #}");
			strip_after = q > k + 2 && s[q - 1] == '-';
			keep_after = q > k + 2 && s[q - 1] == '+';
			pos = q + 2;
		} else {
			push_tok(p, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN, line);
			pos = lex_tag(p, k + 2 + (strip_before || keep_before), kind == '%',
				      &strip_after, &keep_after);
		}
		line_starting = 0;
		if (strip_after) {
			strip_next = 1;
		} else if (kind != '{' && !keep_after && pos < p->len && s[pos] == '\n') {
			pos++;	/* trim_blocks */
			line_starting = 1;
		}
	}
	push_tok(p, T_EOF, line_of(p, p->len));
}

/* ==== Parser ==== */

static struct tok *cur(struct parser *p)
{
	return &p->toks[p->pos];
}

static int is_op(struct tok *t, const char *op)
{
	return t->type == T_OP && t->len == strlen(op) && !memcmp(t->p, op, t->len);
}

static int is_name(struct tok *t, const char *name)
{
	return t->type == T_NAME && t->len == strlen(name) && !memcmp(t->p, name, t->len);
}

static const char *tok_desc(struct parser *p, struct tok *t)
{
	static const char *const names[] = {
		[T_EOF] = "end of template", [T_TEXT] = "text", [T_VAR_END] = "'}}'",
		[T_BLOCK_END] = "'%}'", [T_VAR_BEGIN] = "'{{'", [T_BLOCK_BEGIN] = "'{%'",
		[T_INT] = "a number", [T_FLOAT] = "a number", [T_STR] = "a string",
	};
	char *d;

	if (t->type != T_NAME && t->type != T_OP)
		return names[t->type];
	d = palloc(p, t->len + 3);
	d[0] = '\'';
	memcpy(d + 1, t->p, t->len);
	d[t->len + 1] = '\'';
	return d;
}

static int accept_op(struct parser *p, const char *op)
{
	if (!is_op(cur(p), op))
		return 0;
	p->pos++;
	return 1;
}

static int accept_name(struct parser *p, const char *name)
{
	if (!is_name(cur(p), name))
		return 0;
	p->pos++;
	return 1;
}

static void expect_op(struct parser *p, const char *op)
{
	if (!accept_op(p, op))
		perr(p, cur(p)->line, "expected '%s', found %s", op, tok_desc(p, cur(p)));
}

static const char *tok_str(struct parser *p, struct tok *t)
{
	return pstr(p, t->p, t->len).u.s->s;
}

static const char *expect_name(struct parser *p, const char *what)
{
	struct tok *t = cur(p);

	if (t->type != T_NAME)
		perr(p, t->line, "expected %s, found %s", what, tok_desc(p, t));
	p->pos++;
	return tok_str(p, t);
}

static void expect_block_end(struct parser *p, const char *tag)
{
	struct tok *t = cur(p);

	if (t->type != T_BLOCK_END)
		perr(p, t->line, "expected '%%}' to end {%% %s %%}, found %s", tag, tok_desc(p, t));
	p->pos++;
}

static struct ct_node *node(struct parser *p, int kind, int line)
{
	struct ct_node *n = palloc(p, sizeof(*n));

	n->kind = kind;
	n->line = line;
	return n;
}

static void add(struct parser *p, struct ct_nodes *l, struct ct_node *n)
{
	if (l->n == l->cap) {
		size_t cap = l->cap ? 2 * l->cap : 4;
		struct ct_node **v = palloc(p, cap * sizeof(*v));

		if (l->n)
			memcpy(v, l->v, l->n * sizeof(*v));
		l->v = v;
		l->cap = cap;
	}
	l->v[l->n++] = n;
}

static void add_name(struct parser *p, struct ct_node *n, const char *name)
{
	const char **v = palloc(p, (n->n_names + 1) * sizeof(*v));

	if (n->n_names)
		memcpy(v, n->names, n->n_names * sizeof(*v));
	v[n->n_names++] = name;
	n->names = v;
}

static void enter(struct parser *p)
{
	if (++p->depth > CT_PARSE_DEPTH)
		perr(p, cur(p)->line, "nesting deeper than %d levels", CT_PARSE_DEPTH);
}

static struct ct_node *parse_expr(struct parser *p);
static struct ct_node *parse_unary(struct parser *p, int with_filter);

/* (args, name=value) after the '(' */
static void parse_call_args(struct parser *p, struct ct_node *n)
{
	while (!accept_op(p, ")")) {
		if (cur(p)->type == T_NAME && is_op(&p->toks[p->pos + 1], "=")) {
			add_name(p, n, expect_name(p, "a keyword"));
			p->pos++;
			add(p, &n->kwargs, parse_expr(p));
		} else {
			if (is_op(cur(p), "*") || is_op(cur(p), "**"))
				perr(p, cur(p)->line, "*args and **kwargs in calls are not supported");
			if (n->n_names)
				perr(p, cur(p)->line, "a positional argument after a keyword argument");
			add(p, &n->args, parse_expr(p));
		}
		if (!accept_op(p, ",")) {
			expect_op(p, ")");
			break;
		}
	}
}

static struct ct_node *parse_primary(struct parser *p)
{
	struct tok *t = cur(p);
	struct ct_node *n;

	enter(p);
	if (t->type == T_NAME) {
		static const struct {
			const char *name;
			struct ct_val v;
		} lits[] = {
			{ "true", { .type = CT_BOOL, .u.b = 1 } }, { "True", { .type = CT_BOOL, .u.b = 1 } },
			{ "false", { .type = CT_BOOL, .u.b = 0 } }, { "False", { .type = CT_BOOL, .u.b = 0 } },
			{ "none", { .type = CT_NONE } }, { "None", { .type = CT_NONE } },
		};
		p->pos++;
		for (size_t i = 0; i < sizeof(lits) / sizeof(lits[0]); i++)
			if (is_name(t, lits[i].name)) {
				n = node(p, E_LIT, t->line);
				n->lit = lits[i].v;
				goto out;
			}
		n = node(p, E_NAME, t->line);
		n->name = tok_str(p, t);
	} else if (t->type == T_STR) {
		/* adjacent literals join, as in Python */
		struct ct_val v = t->v;

		p->pos++;
		while (cur(p)->type == T_STR) {
			struct ct_val w = cur(p)->v;
			char *buf = palloc(p, v.u.s->len + w.u.s->len + 1);

			memcpy(buf, v.u.s->s, v.u.s->len);
			memcpy(buf + v.u.s->len, w.u.s->s, w.u.s->len);
			v = pstr(p, buf, v.u.s->len + w.u.s->len);
			p->pos++;
		}
		n = node(p, E_LIT, t->line);
		n->lit = v;
	} else if (t->type == T_INT || t->type == T_FLOAT) {
		p->pos++;
		n = node(p, E_LIT, t->line);
		n->lit = t->v;
	} else if (accept_op(p, "(")) {
		if (accept_op(p, ")")) {
			n = node(p, E_TUPLE, t->line);
			goto out;
		}
		n = parse_expr(p);
		if (is_op(cur(p), ",")) {
			struct ct_node *tu = node(p, E_TUPLE, t->line);

			add(p, &tu->args, n);
			while (accept_op(p, ",") && !is_op(cur(p), ")"))
				add(p, &tu->args, parse_expr(p));
			n = tu;
		}
		expect_op(p, ")");
	} else if (accept_op(p, "[")) {
		n = node(p, E_LIST, t->line);
		while (!accept_op(p, "]")) {
			add(p, &n->args, parse_expr(p));
			if (!accept_op(p, ",")) {
				expect_op(p, "]");
				break;
			}
		}
	} else if (accept_op(p, "{")) {
		n = node(p, E_DICT, t->line);
		while (!accept_op(p, "}")) {
			add(p, &n->args, parse_expr(p));
			expect_op(p, ":");
			add(p, &n->kwargs, parse_expr(p));
			if (!accept_op(p, ",")) {
				expect_op(p, "}");
				break;
			}
		}
	} else {
		perr(p, t->line, "expected an expression, found %s", tok_desc(p, t));
	}
out:
	p->depth--;
	return n;
}

/* callee(args), after the '(' */
static struct ct_node *call_of(struct parser *p, struct ct_node *callee, int line)
{
	struct ct_node *c = node(p, E_CALL, line);

	c->a = callee;
	parse_call_args(p, c);
	return c;
}

static struct ct_node *parse_postfix(struct parser *p, struct ct_node *n)
{
	for (;;) {
		struct tok *t = cur(p);

		if (accept_op(p, ".")) {
			struct ct_node *a;

			if (cur(p)->type == T_INT) {
				a = node(p, E_ITEM, t->line);
				a->a = n;
				a->b = node(p, E_LIT, t->line);
				a->b->lit = cur(p)->v;
				p->pos++;
			} else {
				a = node(p, E_ATTR, t->line);
				a->a = n;
				a->name = expect_name(p, "an attribute name after '.'");
			}
			n = a;
		} else if (accept_op(p, "[")) {
			struct ct_node *start = NULL, *s;

			if (!is_op(cur(p), ":"))
				start = parse_expr(p);
			if (accept_op(p, "]")) {
				s = node(p, E_ITEM, t->line);
				s->a = n;
				s->b = start;
				n = s;
				continue;
			}
			expect_op(p, ":");
			s = node(p, E_SLICE, t->line);
			s->a = n;
			s->b = start;
			if (!is_op(cur(p), "]") && !is_op(cur(p), ":"))
				s->c = parse_expr(p);
			if (accept_op(p, ":") && !is_op(cur(p), "]"))
				s->d = parse_expr(p);
			expect_op(p, "]");
			n = s;
		} else if (accept_op(p, "(")) {
			n = call_of(p, n, t->line);
		} else {
			return n;
		}
	}
}

static struct ct_node *parse_filter_expr(struct parser *p, struct ct_node *n)
{
	for (;;) {
		struct tok *t = cur(p);

		if (accept_op(p, "|")) {
			struct ct_node *f = node(p, E_FILTER, t->line);

			f->a = n;
			f->name = expect_name(p, "a filter name after '|'");
			f->id = ct_filter_id(f->name);
			if (f->id < 0)
				perr(p, t->line, "unknown filter '%s'", f->name);
			if (accept_op(p, "("))
				parse_call_args(p, f);
			n = f;
		} else if (accept_name(p, "is")) {
			struct ct_node *x = node(p, E_TEST, t->line);
			struct tok *a;

			x->a = n;
			x->op = accept_name(p, "not");
			x->name = expect_name(p, "a test name after 'is'");
			x->id = ct_test_id(x->name);
			if (x->id < 0)
				perr(p, t->line, "unknown test '%s'", x->name);
			a = cur(p);
			if (accept_op(p, "(")) {
				parse_call_args(p, x);
			} else if ((a->type == T_NAME || a->type == T_STR || a->type == T_INT ||
				    a->type == T_FLOAT || is_op(a, "(") || is_op(a, "[") || is_op(a, "{")) &&
				   !is_name(a, "else") && !is_name(a, "or") && !is_name(a, "and")) {
				if (is_name(a, "is"))
					perr(p, a->line, "tests cannot be chained with 'is'");
				add(p, &x->args, parse_postfix(p, parse_primary(p)));
			}
			n = x;
		} else if (accept_op(p, "(")) {
			n = call_of(p, n, t->line);
		} else {
			return n;
		}
	}
}

static struct ct_node *parse_unary(struct parser *p, int with_filter)
{
	struct tok *t = cur(p);
	struct ct_node *n;

	enter(p);
	if (accept_op(p, "-") || accept_op(p, "+")) {
		n = node(p, t->p[0] == '-' ? E_NEG : E_POS, t->line);
		n->a = parse_unary(p, 0);
	} else {
		n = parse_primary(p);
	}
	n = parse_postfix(p, n);
	if (with_filter)
		n = parse_filter_expr(p, n);
	p->depth--;
	return n;
}

/* The left-associative binary levels, loosest first: "or" and "and", then
 * (after not and the comparisons) + -, ~, * / // %, and **. */
static const struct bin_level {
	const char *ops[4];
	int codes[4];
	int kind;
} LEVELS[] = {
	{ { "or" }, { 0 }, E_OR },
	{ { "and" }, { 0 }, E_AND },
	{ { "+", "-" }, { OP_ADD, OP_SUB }, E_BIN },
	{ { "~" }, { OP_CONCAT }, E_BIN },
	{ { "*", "/", "//", "%" }, { OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD }, E_BIN },
	{ { "**" }, { OP_POW }, E_BIN },
};
enum { LEVEL_OR, LEVEL_AND, LEVEL_MATH1, LEVEL_POW = 5 };

static struct ct_node *parse_not(struct parser *p);
static struct ct_node *parse_level(struct parser *p, int level);

/* what binds tighter than level */
static struct ct_node *parse_operand(struct parser *p, int level)
{
	if (level == LEVEL_AND)
		return parse_not(p);
	if (level == LEVEL_POW)
		return parse_unary(p, 1);
	return parse_level(p, level + 1);
}

static struct ct_node *parse_level(struct parser *p, int level)
{
	const struct bin_level *l = &LEVELS[level];
	struct ct_node *n = parse_operand(p, level);

	for (;;) {
		struct tok *t = cur(p);
		size_t i = 0;
		struct ct_node *b;

		while (i < 4 && l->ops[i] && !(l->kind == E_BIN ? is_op(t, l->ops[i]) : is_name(t, l->ops[i])))
			i++;
		if (i == 4 || !l->ops[i])
			return n;
		p->pos++;
		b = node(p, l->kind, t->line);
		b->op = l->codes[i];
		b->a = n;
		b->b = parse_operand(p, level);
		n = b;
	}
}

static struct ct_node *parse_compare(struct parser *p)
{
	struct ct_node *n = parse_level(p, LEVEL_MATH1), *prev = n, *chain = NULL;

	for (;;) {
		struct tok *t = cur(p);
		int op = is_op(t, "==") ? OP_EQ : is_op(t, "!=") ? OP_NE : is_op(t, "<") ? OP_LT :
			 is_op(t, "<=") ? OP_LE : is_op(t, ">") ? OP_GT : is_op(t, ">=") ? OP_GE :
			 is_name(t, "in") ? OP_IN : 0;
		struct ct_node *rhs, *c;

		if (!op && is_name(t, "not") && is_name(&p->toks[p->pos + 1], "in")) {
			op = OP_NOTIN;
			p->pos++;
		}
		if (!op)
			return chain ? chain : n;
		p->pos++;
		rhs = parse_level(p, LEVEL_MATH1);
		c = node(p, E_CMP, t->line);
		c->op = op;
		c->a = prev;
		c->b = rhs;
		if (chain) {
			/* a < b < c is a < b and b < c */
			struct ct_node *and = node(p, E_AND, t->line);

			and->a = chain;
			and->b = c;
			chain = and;
		} else {
			chain = c;
		}
		prev = rhs;
	}
}

static struct ct_node *parse_not(struct parser *p)
{
	struct tok *t = cur(p);

	if (accept_name(p, "not")) {
		struct ct_node *n = node(p, E_NOT, t->line);

		enter(p);
		n->a = parse_not(p);
		p->depth--;
		return n;
	}
	return parse_compare(p);
}

static struct ct_node *parse_expr(struct parser *p)
{
	struct ct_node *n;

	enter(p);
	n = parse_level(p, LEVEL_OR);
	while (is_name(cur(p), "if")) {
		struct ct_node *c = node(p, E_COND, cur(p)->line);

		p->pos++;
		c->a = parse_level(p, LEVEL_OR);	/* the condition */
		c->b = n;
		if (accept_name(p, "else"))
			c->c = parse_expr(p);
		n = c;
	}
	p->depth--;
	return n;
}

/* ==== Statements ==== */

static struct ct_node *parse_body(struct parser *p, const char *const *ends, const char *opener,
				  int opener_line);

static const char *const END_IF[] = { "elif", "else", "endif", NULL };
static const char *const END_FOR[] = { "else", "endfor", NULL };

/* Consumes "{% name" of the closing tag the body stopped at. */
static const char *end_tag(struct parser *p)
{
	return tok_str(p, &p->toks[p->pos - 1]);
}

static struct ct_node *parse_if(struct parser *p, int line)
{
	struct ct_node *n = node(p, N_IF, line);
	const char *end;

	n->a = parse_expr(p);
	expect_block_end(p, "if");
	n->b = parse_body(p, END_IF, "if", line);
	end = end_tag(p);
	if (!strcmp(end, "elif")) {
		n->c = parse_if(p, p->toks[p->pos - 1].line);
		return n;
	}
	if (!strcmp(end, "else")) {
		expect_block_end(p, "else");
		n->c = parse_body(p, END_IF + 2, "if", line);
	}
	expect_block_end(p, "endif");
	return n;
}

static struct ct_node *parse_for(struct parser *p, int line)
{
	static const char *const end_else[] = { "endfor", NULL };
	struct ct_node *n = node(p, N_FOR, line);
	int paren = accept_op(p, "(");

	do
		add_name(p, n, expect_name(p, "a loop variable"));
	while (accept_op(p, ","));
	if (paren)
		expect_op(p, ")");
	if (!accept_name(p, "in"))
		perr(p, cur(p)->line, "expected 'in' in {%% for %%}, found %s", tok_desc(p, cur(p)));
	n->a = parse_level(p, LEVEL_OR);
	if (accept_name(p, "if"))
		n->b = parse_expr(p);
	if (is_name(cur(p), "recursive"))
		perr(p, cur(p)->line, "recursive loops are not supported");
	expect_block_end(p, "for");
	n->c = parse_body(p, END_FOR, "for", line);
	if (!strcmp(end_tag(p), "else")) {
		expect_block_end(p, "else");
		n->d = parse_body(p, end_else, "for", line);
	}
	expect_block_end(p, "endfor");
	return n;
}

/* "%}" ending the tag, the body, and {% endTAG %}: the shape of set, macro,
 * call and generation blocks. */
static struct ct_node *block_body(struct parser *p, const char *tag, int line)
{
	size_t n = strlen(tag);
	char *end = palloc(p, n + 4);
	const char *ends[2] = { end, NULL };
	struct ct_node *body;

	memcpy(end, "end", 3);
	memcpy(end + 3, tag, n + 1);
	expect_block_end(p, tag);
	body = parse_body(p, ends, tag, line);
	expect_block_end(p, end);
	return body;
}

static struct ct_node *parse_set(struct parser *p, int line)
{
	struct ct_node *n = node(p, N_SET, line);

	add_name(p, n, expect_name(p, "a variable name"));
	if (accept_op(p, ".")) {
		/* namespace attribute: names = { ns, attr }, op marks it */
		add_name(p, n, expect_name(p, "an attribute name"));
		n->op = 1;
	} else {
		while (accept_op(p, ","))
			add_name(p, n, expect_name(p, "a variable name"));
	}
	if (cur(p)->type == T_BLOCK_END && n->n_names == 1) {
		n->kind = N_SETBLOCK;
		n->name = n->names[0];
		n->a = block_body(p, "set", line);
		return n;
	}
	expect_op(p, "=");
	n->a = parse_expr(p);
	if (is_op(cur(p), ",")) {
		struct ct_node *tu = node(p, E_TUPLE, line);

		add(p, &tu->args, n->a);
		while (accept_op(p, ",") && cur(p)->type != T_BLOCK_END)
			add(p, &tu->args, parse_expr(p));
		n->a = tu;
	}
	expect_block_end(p, "set");
	return n;
}

/* (a, b='x'): names and default values (NULL: required) */
static void parse_params(struct parser *p, struct ct_node *n)
{
	expect_op(p, "(");
	while (!accept_op(p, ")")) {
		add_name(p, n, expect_name(p, "a parameter name"));
		add(p, &n->kwargs, accept_op(p, "=") ? parse_expr(p) : NULL);
		if (!accept_op(p, ",")) {
			expect_op(p, ")");
			break;
		}
	}
}

static struct ct_node *parse_macro(struct parser *p, int line)
{
	struct ct_node *n = node(p, N_MACRO, line);

	n->name = expect_name(p, "a macro name");
	parse_params(p, n);
	n->a = block_body(p, "macro", line);
	return n;
}

static struct ct_node *parse_call(struct parser *p, int line)
{
	struct ct_node *n = node(p, N_CALLBLOCK, line);

	if (is_op(cur(p), "("))
		parse_params(p, n);
	n->b = parse_expr(p);
	if (n->b->kind != E_CALL)
		perr(p, line, "{%% call %%} needs a macro call");
	n->a = block_body(p, "call", line);
	return n;
}

static struct ct_node *parse_statement(struct parser *p)
{
	struct tok *t = cur(p);
	int line = t->line;
	struct ct_node *n;

	if (t->type != T_NAME)
		perr(p, line, "expected a tag name after '{%%', found %s", tok_desc(p, t));
	p->pos++;
	if (is_name(t, "if"))
		return parse_if(p, line);
	if (is_name(t, "for"))
		return parse_for(p, line);
	if (is_name(t, "set"))
		return parse_set(p, line);
	if (is_name(t, "macro"))
		return parse_macro(p, line);
	if (is_name(t, "call"))
		return parse_call(p, line);
	if (is_name(t, "break") || is_name(t, "continue")) {
		n = node(p, is_name(t, "break") ? N_BREAK : N_CONTINUE, line);
		expect_block_end(p, tok_str(p, t));
		return n;
	}
	if (is_name(t, "generation"))	/* transformers' assistant-mask marker: renders its body */
		return block_body(p, "generation", line);
	perr(p, line, "unknown or unsupported tag '%s'", tok_str(p, t));
}

static struct ct_node *parse_body(struct parser *p, const char *const *ends, const char *opener,
				  int opener_line)
{
	struct ct_node *body = node(p, N_BODY, cur(p)->line);

	enter(p);
	for (;;) {
		struct tok *t = cur(p);

		if (t->type == T_EOF) {
			if (!ends)
				break;
			size_t last = 0;

			while (ends[last + 1])
				last++;
			perr(p, opener_line, "unterminated {%% %s %%}: no {%% %s %%} before the end of the template",
			     opener, ends[last]);
		}
		if (t->type == T_TEXT) {
			struct ct_node *n = node(p, N_TEXT, t->line);

			n->lit = t->v;
			add(p, &body->args, n);
			p->pos++;
		} else if (t->type == T_VAR_BEGIN) {
			struct ct_node *n = node(p, N_OUTPUT, t->line);

			p->pos++;
			n->a = parse_expr(p);
			if (cur(p)->type != T_VAR_END)
				perr(p, cur(p)->line, "expected '}}', found %s", tok_desc(p, cur(p)));
			p->pos++;
			add(p, &body->args, n);
		} else if (t->type == T_BLOCK_BEGIN) {
			struct tok *name = &p->toks[p->pos + 1];

			for (size_t i = 0; ends && ends[i]; i++)
				if (is_name(name, ends[i])) {
					p->pos += 2;
					p->depth--;
					return body;
				}
			if (name->type == T_NAME && name->len > 3 && !memcmp(name->p, "end", 3))
				perr(p, name->line, "unexpected {%% %s %%}%s%s%s", tok_str(p, name),
				     ends ? " inside {% " : "", ends ? opener : "", ends ? " %}" : "");
			if (is_name(name, "elif") || is_name(name, "else"))
				perr(p, name->line, "unexpected {%% %s %%}", tok_str(p, name));
			p->pos++;
			add(p, &body->args, parse_statement(p));
		} else {
			perr(p, t->line, "unexpected %s", tok_desc(p, t));
		}
	}
	p->depth--;
	return body;
}

static void parse_all(struct parser *p, const char *text, size_t len)
{
	char *src = palloc(p, len + 1);
	size_t n = 0;

	/* newlines normalised to \n, and one trailing newline dropped
	 * (Jinja's keep_trailing_newline=False) */
	for (size_t i = 0; i < len; i++) {
		if (text[i] == '\r') {
			src[n++] = '\n';
			if (i + 1 < len && text[i + 1] == '\n')
				i++;
		} else {
			src[n++] = text[i];
		}
	}
	if (n && src[n - 1] == '\n')
		n--;
	src[n] = 0;
	p->src = src;
	p->len = n;
	lex(p);
	p->t->root = parse_body(p, NULL, NULL, 0);
}

int ct_parse(struct mlens_chat_template *t, const char *text, size_t len, char *err, size_t errlen)
{
	/* on the heap, so that its token array is there to free after a longjmp */
	struct parser *p = calloc(1, sizeof(*p));
	int rc = -1;

	if (!p) {
		snprintf(err, errlen, "out of memory parsing the template");
		return -1;
	}
	*p = (struct parser){ .t = t, .err = err, .errlen = errlen, .line = 1 };
	if (!setjmp(p->fail)) {
		parse_all(p, text, len);
		rc = 0;
	}
	free(p->toks);
	free(p);
	return rc;
}
