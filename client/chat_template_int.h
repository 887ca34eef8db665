/* The chat-template interpreter's insides: values, the syntax tree, the
 * arena both live in, and the entry points the public API and the fuzz
 * target use. The template language is the subset of Jinja that model chat
 * templates use, with the settings transformers renders them under
 * (trim_blocks, lstrip_blocks, loop controls, no autoescape). */
#ifndef MLENS_CHAT_TEMPLATE_INT_H
#define MLENS_CHAT_TEMPLATE_INT_H

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

/* ==== Arena ==== */

/* Bump allocation in chunks; everything is freed at once. A limit makes a
 * runaway template fail instead of eating the machine. */
struct ct_arena {
	struct ct_chunk *head;
	size_t used;		/* bytes in all chunks */
	size_t limit;		/* 0: none */
};

void *ct_arena_alloc(struct ct_arena *a, size_t n);	/* NULL: out of memory or over limit */
void ct_arena_free(struct ct_arena *a);

/* ==== Values ==== */

enum ct_type {
	CT_UNDEF,	/* Jinja's Undefined: "", falsy, iterates as empty */
	CT_NONE,
	CT_BOOL,
	CT_INT,
	CT_FLOAT,
	CT_STR,
	CT_LIST,	/* also tuples (flag in the list) */
	CT_DICT,
	CT_NS,		/* namespace(): a dict whose attributes may be set */
	CT_MACRO,
	CT_FUNC,	/* a global function (range, namespace, ...) */
	CT_LOOP,	/* a for loop's `loop` */
};

struct ct_str {
	size_t len;
	char s[];	/* NUL-terminated, UTF-8 */
};

struct ct_val {
	int type;
	union {
		int b;
		long long i;
		double f;
		struct ct_str *s;
		struct ct_list *l;
		struct ct_dict *d;	/* CT_DICT and CT_NS */
		struct ct_macro *m;
		int fn;
		struct ct_loop *loop;
		const char *undef;	/* CT_UNDEF: the message when it is used (may be NULL) */
	} u;
};

struct ct_list {
	size_t n, cap;
	int tuple;
	struct ct_val *v;
};

struct ct_dict {
	size_t n, cap;
	struct ct_val *k, *v;	/* insertion order, as Python dicts */
};

struct ct_node;
struct ct_frame;

struct ct_macro {
	const struct ct_node *node;	/* N_MACRO, or N_CALLBLOCK for caller() */
	struct ct_frame *closure;
};

struct ct_loop {
	const struct ct_list *items;
	size_t i;
};

/* ==== Syntax tree ==== */

enum ct_kind {
	/* statements */
	N_BODY, N_TEXT, N_OUTPUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_MACRO,
	N_CALLBLOCK, N_BREAK, N_CONTINUE,
	/* expressions */
	E_LIT, E_NAME, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST,
	E_BIN, E_NEG, E_POS, E_NOT, E_AND, E_OR, E_CMP, E_COND, E_LIST, E_TUPLE,
	E_DICT,
};

enum ct_op {
	OP_ADD = 1, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT,
	OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN,
};

struct ct_nodes {
	struct ct_node **v;
	size_t n, cap;
};

/* One node of the tree. The children by kind:
 *   N_BODY: args (its statements)     N_OUTPUT: a
 *   N_IF: a test, b then, c else      N_FOR: a iterable, b filter, c body, d else
 *   N_SET: a value                    N_SETBLOCK, N_MACRO: a body
 *   N_CALLBLOCK: a body, b the call   E_ATTR, E_FILTER, E_TEST: a the object
 *   E_ITEM: a[b]  E_SLICE: a[b:c:d]   E_CALL: a callee
 *   E_BIN, E_CMP, E_AND, E_OR: a b    E_COND: b if a else c
 *   E_LIST, E_TUPLE: args             E_DICT: args keys, kwargs values */
struct ct_node {
	int kind;
	int line;
	int op;			/* ct_op; E_TEST: negated; N_SET: 1 for ns.attr */
	int id;			/* filter or test number */
	const char *name;	/* E_NAME, E_ATTR, E_FILTER, E_TEST, N_MACRO, N_SETBLOCK */
	struct ct_val lit;	/* E_LIT; N_TEXT's text */
	struct ct_node *a, *b, *c, *d;
	struct ct_nodes args;	/* positional arguments, items, statements */
	struct ct_nodes kwargs;	/* keyword argument values, dict values, parameter defaults */
	const char **names;	/* keyword names, for/set targets, macro parameters */
	size_t n_names;
};

/* ==== Filters, tests and limits ==== */

int ct_filter_id(const char *name);	/* -1: unknown */
int ct_test_id(const char *name);	/* -1: unknown */

/* Bounds that keep a hostile template finite. */
struct ct_limits {
	size_t max_output;	/* bytes of rendered text */
	size_t max_memory;	/* bytes of the render's arena */
	unsigned long max_steps;	/* evaluated nodes and loop turns */
	int max_depth;		/* nesting of expressions, blocks and macro calls */
};

/* A parsed template. */
struct mlens_chat_template {
	struct ct_arena arena;
	struct ct_node *root;
	char *bos_token, *eos_token;	/* NULL: not set */
	struct ct_limits limits;
};

/* The parser: 0, or -1 with a message ("line N: ...") in err. */
int ct_parse(struct mlens_chat_template *t, const char *text, size_t len,
	     char *err, size_t errlen);

/* ==== Rendering ==== */

struct ct_render;
struct ct_buf {
	struct ct_render *r;
	char *p;
	size_t n, cap;
	int heap;	/* malloc'd (the rendered text), not in the arena */
};


struct ct_render {
	jmp_buf fail;
	struct ct_arena arena;
	const struct ct_limits *limits;
	struct ct_buf *out;	/* where text goes now (a macro's or set block's own) */
	struct ct_buf text;	/* the rendered text (heap) */
	struct ct_dict *globals;	/* the variables the caller passed */
	unsigned long steps;
	int depth;
	int raised;		/* raise_exception() ended the render */
	int code;		/* -E2BIG when a limit ended it, else 0 */
	int add_generation_prompt;
	char err[1024];
};

/* Renders t into r->out with r->globals as the variables; 0, or -1 with
 * r->err set. */
int ct_render_run(struct ct_render *r, const struct mlens_chat_template *t);

_Noreturn void ct_fail(struct ct_render *r, int line, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* Using an undefined value where Jinja raises: its message says what is
 * undefined ("'x' is undefined", "'dict object' has no attribute 'y'"). */
/* A limit of struct ct_limits ended the render. */
_Noreturn void ct_fail_limit(struct ct_render *r, int line, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
_Noreturn void ct_fail_undef(struct ct_render *r, int line, struct ct_val v);
struct ct_val ct_undef(struct ct_render *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* values (chat_template_value.c) */
struct ct_val ct_str_val(struct ct_render *r, const char *s, size_t len);
struct ct_val ct_cstr(struct ct_render *r, const char *s);
struct ct_list *ct_list_new(struct ct_render *r, size_t cap);
void ct_list_push(struct ct_render *r, struct ct_list *l, struct ct_val v);
struct ct_dict *ct_dict_new(struct ct_render *r, size_t cap);
void ct_dict_set(struct ct_render *r, struct ct_dict *d, struct ct_val k, struct ct_val v);
struct ct_val *ct_dict_get(const struct ct_dict *d, struct ct_val k);
struct ct_val *ct_dict_getc(const struct ct_dict *d, const char *key);
void *ct_alloc(struct ct_render *r, size_t n);
int ct_truthy(struct ct_val v);
int ct_equal(struct ct_val a, struct ct_val b);
int ct_compare(struct ct_render *r, int line, struct ct_val a, struct ct_val b);
const char *ct_type_name(struct ct_val v);
size_t ct_utf8_len(const char *s, size_t n);
void ct_utf8_put(char *out, size_t *n, uint32_t c);	/* c as UTF-8 at out + *n (4 bytes room) */

/* Python's str() and repr() of a value, and json.dumps() as transformers'
 * tojson calls it. */
void ct_buf_put(struct ct_buf *b, const char *s, size_t n);
void ct_buf_puts(struct ct_buf *b, const char *s);
struct ct_val ct_buf_val(struct ct_buf *b);
void ct_to_str(struct ct_buf *b, int line, struct ct_val v);
void ct_repr(struct ct_buf *b, int line, struct ct_val v);
struct ct_json_opts {
	const char *indent;	/* NULL: one line */
	const char *item_sep, *key_sep;
	int ensure_ascii, sort_keys;
};
void ct_to_json(struct ct_buf *b, int line, struct ct_val v, const struct ct_json_opts *o, int level);
struct ct_val ct_stringify(struct ct_render *r, int line, struct ct_val v);

/* filters, tests and methods (chat_template_lib.c) */
struct ct_args {
	struct ct_val *pos;
	size_t n_pos;
	const char **kw;
	struct ct_val *kwv;
	size_t n_kw;
};
struct ct_val ct_filter(struct ct_render *r, int line, int id, struct ct_val v, const struct ct_args *a);
int ct_test(struct ct_render *r, int line, int id, struct ct_val v, const struct ct_args *a);
struct ct_val ct_method(struct ct_render *r, int line, struct ct_val obj, const char *name,
			const struct ct_args *a);
int ct_has_method(struct ct_val obj, const char *name);
struct ct_val ct_getattr(struct ct_render *r, int line, struct ct_val obj, const char *name);
struct ct_val ct_getitem(struct ct_render *r, int line, struct ct_val obj, struct ct_val key);
struct ct_val ct_slice(struct ct_render *r, int line, struct ct_val obj, struct ct_val *start,
		       struct ct_val *stop, struct ct_val *step);
struct ct_list *ct_iterate(struct ct_render *r, int line, struct ct_val v);
struct ct_val ct_binop(struct ct_render *r, int line, int op, struct ct_val a, struct ct_val b);

/* a test or filter that takes another one's name (select, map) calls back */
struct ct_val ct_filter_by_name(struct ct_render *r, int line, const char *name, struct ct_val v,
				const struct ct_args *a);
int ct_test_by_name(struct ct_render *r, int line, const char *name, struct ct_val v,
		    const struct ct_args *a);

#define CT_NONE_VAL ((struct ct_val){ .type = CT_NONE })
#define CT_UNDEF_VAL ((struct ct_val){ .type = CT_UNDEF })
#define CT_BOOL_VAL(x) ((struct ct_val){ .type = CT_BOOL, .u.b = !!(x) })
#define CT_INT_VAL(x) ((struct ct_val){ .type = CT_INT, .u.i = (x) })

#endif
