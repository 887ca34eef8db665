/* The chat-template evaluator: walks the syntax tree with a chain of
 * scopes (the caller's variables behind them all), writes text to the
 * current buffer, and keeps a hostile template within the render's limits
 * (output bytes, memory, steps, nesting). Errors unwind with longjmp; all
 * memory is in the render's arena. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chat_template_int.h"

struct ct_frame {
	struct ct_frame *parent;
	struct ct_dict *vars;
};

enum { FN_RANGE, FN_NAMESPACE, FN_DICT, FN_RAISE, FN_STRFTIME };

static const char *const FN_NAMES[] = {
	[FN_RANGE] = "range", [FN_NAMESPACE] = "namespace", [FN_DICT] = "dict",
	[FN_RAISE] = "raise_exception", [FN_STRFTIME] = "strftime_now",
};

enum { FLOW_NORMAL, FLOW_BREAK, FLOW_CONTINUE };

void ct_fail(struct ct_render *r, int line, const char *fmt, ...)
{
	va_list ap;
	int n = line > 0 ? snprintf(r->err, sizeof(r->err), "line %d: ", line) : 0;

	if (n < 0 || (size_t)n >= sizeof(r->err))
		n = 0;
	va_start(ap, fmt);
	vsnprintf(r->err + n, sizeof(r->err) - n, fmt, ap);
	va_end(ap);
	longjmp(r->fail, 1);
}

void ct_fail_limit(struct ct_render *r, int line, const char *fmt, ...)
{
	va_list ap;
	char msg[512];

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	r->code = -E2BIG;
	ct_fail(r, line, "%s", msg);
}

void ct_fail_undef(struct ct_render *r, int line, struct ct_val v)
{
	ct_fail(r, line, "%s", v.u.undef ? v.u.undef : "a value is undefined");
}

struct ct_val ct_undef(struct ct_render *r, const char *fmt, ...)
{
	struct ct_val v = CT_UNDEF_VAL;
	char tmp[256];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(tmp, sizeof(tmp), fmt, ap);
	va_end(ap);
	v.u.undef = ct_cstr(r, tmp).u.s->s;
	return v;
}

static void step(struct ct_render *r, int line)
{
	if (++r->steps > r->limits->max_steps)
		ct_fail_limit(r, line, "the template takes more than %lu steps to render (a runaway loop?)",
			r->limits->max_steps);
}

static void emit(struct ct_render *r, int line, const char *s, size_t n)
{
	if (r->out->n + n > r->limits->max_output)
		ct_fail_limit(r, line, "the rendered text exceeds %zu bytes", r->limits->max_output);
	ct_buf_put(r->out, s, n);
}

static struct ct_frame *frame_new(struct ct_render *r, struct ct_frame *parent)
{
	struct ct_frame *f = ct_alloc(r, sizeof(*f));

	f->parent = parent;
	f->vars = ct_dict_new(r, 0);
	return f;
}

static void bind(struct ct_render *r, struct ct_frame *f, const char *name, struct ct_val v)
{
	struct ct_val *old = ct_dict_getc(f->vars, name);

	if (old)
		*old = v;
	else
		ct_dict_set(r, f->vars, ct_cstr(r, name), v);
}

static struct ct_val lookup(struct ct_render *r, struct ct_frame *f, const char *name)
{
	struct ct_val *v;

	for (; f; f = f->parent)
		if ((v = ct_dict_getc(f->vars, name)))
			return *v;
	if ((v = ct_dict_getc(r->globals, name)))
		return *v;
	for (size_t i = 0; i < sizeof(FN_NAMES) / sizeof(FN_NAMES[0]); i++)
		if (!strcmp(name, FN_NAMES[i]))
			return (struct ct_val){ .type = CT_FUNC, .u.fn = (int)i };
	return ct_undef(r, "'%s' is undefined", name);
}

static struct ct_val eval(struct ct_render *r, struct ct_frame *f, const struct ct_node *n);
static int exec(struct ct_render *r, struct ct_frame *f, const struct ct_node *n);

static void enter(struct ct_render *r, int line)
{
	if (++r->depth > r->limits->max_depth)
		ct_fail_limit(r, line, "nesting deeper than %d levels (recursive macro?)", r->limits->max_depth);
}

static void eval_args(struct ct_render *r, struct ct_frame *f, const struct ct_node *n,
		      struct ct_args *a)
{
	a->n_pos = n->args.n;
	a->pos = n->args.n ? ct_alloc(r, n->args.n * sizeof(*a->pos)) : NULL;
	for (size_t i = 0; i < n->args.n; i++)
		a->pos[i] = eval(r, f, n->args.v[i]);
	a->n_kw = n->kwargs.n;
	a->kw = n->names;
	a->kwv = n->kwargs.n ? ct_alloc(r, n->kwargs.n * sizeof(*a->kwv)) : NULL;
	for (size_t i = 0; i < n->kwargs.n; i++)
		a->kwv[i] = eval(r, f, n->kwargs.v[i]);
}

/* Renders a body into a buffer of its own and returns the text. */
static struct ct_val capture(struct ct_render *r, struct ct_frame *f, const struct ct_node *body)
{
	struct ct_buf b = { .r = r }, *saved = r->out;

	r->out = &b;
	exec(r, f, body);
	r->out = saved;
	return ct_buf_val(&b);
}

static struct ct_val call_macro(struct ct_render *r, int line, const struct ct_macro *m,
				const struct ct_args *a, struct ct_val *caller)
{
	const struct ct_node *def = m->node;
	struct ct_frame *f = frame_new(r, m->closure);
	struct ct_val out;

	enter(r, line);
	if (a->n_pos > def->n_names)
		ct_fail(r, line, "macro '%s' takes %zu arguments, %zu given",
			def->name ? def->name : "caller", def->n_names, a->n_pos);
	for (size_t i = 0; i < a->n_kw; i++) {
		size_t j = 0;

		while (j < def->n_names && strcmp(def->names[j], a->kw[i]))
			j++;
		if (j == def->n_names)
			ct_fail(r, line, "macro '%s' has no parameter '%s'",
				def->name ? def->name : "caller", a->kw[i]);
	}
	for (size_t i = 0; i < def->n_names; i++) {
		struct ct_val v = ct_undef(r, "'%s' is undefined", def->names[i]);
		int set = 0;

		if (i < a->n_pos) {
			v = a->pos[i];
			set = 1;
		}
		for (size_t k = 0; k < a->n_kw; k++)
			if (!strcmp(def->names[i], a->kw[k])) {
				v = a->kwv[k];
				set = 1;
			}
		if (!set && def->kwargs.v[i])
			v = eval(r, f, def->kwargs.v[i]);
		bind(r, f, def->names[i], v);
	}
	if (caller)
		bind(r, f, "caller", *caller);
	out = capture(r, f, def->a);
	r->depth--;
	return out;
}

static const struct ct_val *arg(const struct ct_args *a, size_t i, const char *kw)
{
	for (size_t k = 0; k < a->n_kw; k++)
		if (!strcmp(a->kw[k], kw))
			return &a->kwv[k];
	return i < a->n_pos ? &a->pos[i] : NULL;
}

static long long int_arg(struct ct_render *r, int line, const char *fn, struct ct_val v)
{
	if (v.type == CT_INT)
		return v.u.i;
	if (v.type == CT_BOOL)
		return v.u.b;
	ct_fail(r, line, "%s: expected an integer, got %s", fn, ct_type_name(v));
}

static struct ct_val call_func(struct ct_render *r, int line, int fn, const struct ct_args *a)
{
	switch (fn) {
	case FN_RANGE: {
		long long start = 0, stop, stepv = 1, count;
		struct ct_list *l;

		if (a->n_pos < 1 || a->n_pos > 3 || a->n_kw)
			ct_fail(r, line, "range() takes 1 to 3 positional arguments");
		stop = int_arg(r, line, "range", a->pos[0]);
		if (a->n_pos > 1) {
			start = stop;
			stop = int_arg(r, line, "range", a->pos[1]);
		}
		if (a->n_pos > 2)
			stepv = int_arg(r, line, "range", a->pos[2]);
		if (!stepv)
			ct_fail(r, line, "range() step must not be zero");
		{
			/* in 128 bits: range(-2**62, 2**62) must not overflow */
			__int128 span = stepv > 0 ? (__int128)stop - start : (__int128)start - stop;
			__int128 st = stepv > 0 ? stepv : -(__int128)stepv, k;

			k = span > 0 ? (span + st - 1) / st : 0;
			count = k > (__int128)r->limits->max_steps ? (long long)r->limits->max_steps + 1 :
				(long long)k;
		}
		/* its items are charged as steps up front: iterating them costs that anyway */
		if (r->steps >= r->limits->max_steps ||
		    count > (long long)(r->limits->max_steps - r->steps))
			ct_fail_limit(r, line, "the template takes more than %lu steps to render "
				      "(range() of %lld items)", r->limits->max_steps, count);
		r->steps += (unsigned long)count;
		l = ct_list_new(r, (size_t)count);
		for (long long i = 0; i < count; i++)
			l->v[l->n++] = CT_INT_VAL(start + i * stepv);
		return (struct ct_val){ .type = CT_LIST, .u.l = l };
	}
	case FN_NAMESPACE:
	case FN_DICT: {
		struct ct_dict *d = ct_dict_new(r, a->n_kw);

		for (size_t i = 0; i < a->n_pos; i++) {
			struct ct_val v = a->pos[i];

			if (v.type != CT_DICT && v.type != CT_NS)
				ct_fail(r, line, "%s() takes keyword arguments or a dict, not %s",
					FN_NAMES[fn], ct_type_name(v));
			for (size_t k = 0; k < v.u.d->n; k++)
				ct_dict_set(r, d, v.u.d->k[k], v.u.d->v[k]);
		}
		for (size_t i = 0; i < a->n_kw; i++)
			ct_dict_set(r, d, ct_cstr(r, a->kw[i]), a->kwv[i]);
		return (struct ct_val){ .type = fn == FN_DICT ? CT_DICT : CT_NS, .u.d = d };
	}
	case FN_RAISE: {
		const struct ct_val *m = arg(a, 0, "message");
		struct ct_val s = m ? ct_stringify(r, line, *m) : ct_cstr(r, "raise_exception()");

		r->raised = 1;
		snprintf(r->err, sizeof(r->err), "%s", s.u.s->s);
		longjmp(r->fail, 1);
	}
	case FN_STRFTIME: {
		const struct ct_val *fmt = arg(a, 0, "format");
		char buf[512];
		time_t now = time(NULL);
		struct tm tm;
		size_t n;

		if (!fmt || fmt->type != CT_STR)
			ct_fail(r, line, "strftime_now() needs a format string");
		localtime_r(&now, &tm);
		/* the template's own format, as transformers' datetime.strftime */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
		n = fmt->u.s->len ? strftime(buf, sizeof(buf), fmt->u.s->s, &tm) : 0;
#pragma GCC diagnostic pop
		if (fmt->u.s->len && !n)
			ct_fail(r, line, "strftime_now(): the formatted time is empty or too long");
		return ct_str_val(r, buf, n);
	}
	}
	ct_fail(r, line, "unknown function");
}

static struct ct_val call(struct ct_render *r, struct ct_frame *f, const struct ct_node *n)
{
	const struct ct_node *callee = n->a;
	struct ct_args a;
	struct ct_val v;

	if (callee->kind == E_ATTR) {
		struct ct_val obj = eval(r, f, callee->a);

		if (ct_has_method(obj, callee->name)) {
			eval_args(r, f, n, &a);
			return ct_method(r, n->line, obj, callee->name, &a);
		}
		v = ct_getattr(r, callee->line, obj, callee->name);
		if (v.type == CT_UNDEF && (obj.type == CT_STR || obj.type == CT_LIST))
			ct_fail(r, n->line, "unsupported method '%s' of a %s", callee->name, ct_type_name(obj));
		if (v.type == CT_UNDEF && obj.type == CT_DICT)
			ct_fail(r, n->line, "unsupported method '%s' of a dict (and no such key)", callee->name);
	} else {
		v = eval(r, f, callee);
	}
	eval_args(r, f, n, &a);
	if (v.type == CT_MACRO)
		return call_macro(r, n->line, v.u.m, &a, NULL);
	if (v.type == CT_FUNC)
		return call_func(r, n->line, v.u.fn, &a);
	if (v.type == CT_UNDEF)
		ct_fail_undef(r, n->line, v);
	ct_fail(r, n->line, "a %s is not callable", ct_type_name(v));
}

static struct ct_val eval_node(struct ct_render *r, struct ct_frame *f, const struct ct_node *n)
{
	struct ct_val v, w;

	switch (n->kind) {
	case E_LIT:
		return n->lit;
	case E_NAME:
		return lookup(r, f, n->name);
	case E_ATTR:
		return ct_getattr(r, n->line, eval(r, f, n->a), n->name);
	case E_ITEM:
		v = eval(r, f, n->a);
		return ct_getitem(r, n->line, v, eval(r, f, n->b));
	case E_SLICE: {
		struct ct_val s[3], *p[3] = { NULL, NULL, NULL };
		const struct ct_node *parts[3] = { n->b, n->c, n->d };

		v = eval(r, f, n->a);
		for (int i = 0; i < 3; i++)
			if (parts[i]) {
				s[i] = eval(r, f, parts[i]);
				p[i] = &s[i];
			}
		return ct_slice(r, n->line, v, p[0], p[1], p[2]);
	}
	case E_CALL:
		v = call(r, f, n);
		return v;
	case E_FILTER: {
		struct ct_args a;

		v = eval(r, f, n->a);
		eval_args(r, f, n, &a);
		v = ct_filter(r, n->line, n->id, v, &a);
		return v;
	}
	case E_TEST: {
		struct ct_args a;
		int t;

		v = eval(r, f, n->a);
		eval_args(r, f, n, &a);
		t = ct_test(r, n->line, n->id, v, &a);
		return CT_BOOL_VAL(n->op ? !t : t);
	}
	case E_NEG:
	case E_POS:
		v = eval(r, f, n->a);
		if (v.type == CT_BOOL)
			v = CT_INT_VAL(v.u.b);
		if (v.type == CT_INT && n->kind == E_NEG)
			v.u.i = -v.u.i;
		else if (v.type == CT_FLOAT && n->kind == E_NEG)
			v.u.f = -v.u.f;
		else if (v.type == CT_UNDEF)
			ct_fail_undef(r, n->line, v);
		else if (v.type != CT_INT && v.type != CT_FLOAT)
			ct_fail(r, n->line, "bad operand type for unary %c: %s", n->kind == E_NEG ? '-' : '+',
				ct_type_name(v));
		return v;
	case E_NOT:
		return CT_BOOL_VAL(!ct_truthy(eval(r, f, n->a)));
	case E_AND:
		v = eval(r, f, n->a);
		if (ct_truthy(v))
			v = eval(r, f, n->b);
		return v;
	case E_OR:
		v = eval(r, f, n->a);
		if (!ct_truthy(v))
			v = eval(r, f, n->b);
		return v;
	case E_BIN:
	case E_CMP:
		v = eval(r, f, n->a);
		w = eval(r, f, n->b);
		v = ct_binop(r, n->line, n->op, v, w);
		return v;
	case E_COND:
		if (ct_truthy(eval(r, f, n->a)))
			v = eval(r, f, n->b);
		else if (n->c)
			v = eval(r, f, n->c);
		else
			v = ct_undef(r, "the conditional expression on line %d has no else", n->line);
		return v;
	case E_LIST:
	case E_TUPLE: {
		struct ct_list *l = ct_list_new(r, n->args.n);

		l->tuple = n->kind == E_TUPLE;
		for (size_t i = 0; i < n->args.n; i++)
			l->v[l->n++] = eval(r, f, n->args.v[i]);
		return (struct ct_val){ .type = CT_LIST, .u.l = l };
	}
	case E_DICT: {
		struct ct_dict *d = ct_dict_new(r, n->args.n);

		for (size_t i = 0; i < n->args.n; i++) {
			v = eval(r, f, n->args.v[i]);
			if (v.type != CT_STR && v.type != CT_INT && v.type != CT_FLOAT && v.type != CT_BOOL &&
			    v.type != CT_NONE)
				ct_fail(r, n->line, "a %s cannot be a dict key", ct_type_name(v));
			ct_dict_set(r, d, v, eval(r, f, n->kwargs.v[i]));
		}
		return (struct ct_val){ .type = CT_DICT, .u.d = d };
	}
	}
	ct_fail(r, n->line, "internal error: a statement where an expression belongs");
}

static struct ct_val eval(struct ct_render *r, struct ct_frame *f, const struct ct_node *n)
{
	struct ct_val v;

	step(r, n->line);
	enter(r, n->line);
	v = eval_node(r, f, n);
	r->depth--;
	return v;
}

/* for a, b in ...: binds the targets of one item */
static void bind_targets(struct ct_render *r, struct ct_frame *f, const struct ct_node *n,
			 struct ct_val item)
{
	if (n->n_names == 1) {
		bind(r, f, n->names[0], item);
		return;
	}
	if (item.type != CT_LIST)
		ct_fail(r, n->line, "cannot unpack a %s into %zu names", ct_type_name(item), n->n_names);
	if (item.u.l->n != n->n_names)
		ct_fail(r, n->line, "cannot unpack %zu values into %zu names", item.u.l->n, n->n_names);
	for (size_t i = 0; i < n->n_names; i++)
		bind(r, f, n->names[i], item.u.l->v[i]);
}

static void exec_for(struct ct_render *r, struct ct_frame *f, const struct ct_node *n)
{
	struct ct_list *items = ct_iterate(r, n->line, eval(r, f, n->a));
	struct ct_frame *lf = frame_new(r, f);
	struct ct_loop *loop = ct_alloc(r, sizeof(*loop));

	if (n->b) {
		/* the loop's if filters first: loop.length and friends count what is kept */
		struct ct_list *kept = ct_list_new(r, items->n);

		for (size_t i = 0; i < items->n; i++) {
			step(r, n->line);
			lf->vars->n = 0;
			bind_targets(r, lf, n, items->v[i]);
			if (ct_truthy(eval(r, lf, n->b)))
				kept->v[kept->n++] = items->v[i];
		}
		items = kept;
	}
	if (!items->n) {
		if (n->d)
			exec(r, frame_new(r, f), n->d);
		return;
	}
	loop->items = items;
	for (size_t i = 0; i < items->n; i++) {
		int flow;

		step(r, n->line);
		lf->vars->n = 0;
		loop->i = i;
		bind_targets(r, lf, n, items->v[i]);
		bind(r, lf, "loop", (struct ct_val){ .type = CT_LOOP, .u.loop = loop });
		flow = exec(r, lf, n->c);
		if (flow == FLOW_BREAK)
			break;
	}
}

static void exec_set(struct ct_render *r, struct ct_frame *f, const struct ct_node *n)
{
	struct ct_val v = eval(r, f, n->a);

	if (n->op) {
		struct ct_val ns = lookup(r, f, n->names[0]);

		if (ns.type != CT_NS)
			ct_fail(r, n->line, "cannot set attribute '%s' of '%s', a %s: only namespace() "
				"objects take attributes", n->names[1], n->names[0], ct_type_name(ns));
		ct_dict_set(r, ns.u.d, ct_cstr(r, n->names[1]), v);
		return;
	}
	if (n->n_names > 1) {
		struct ct_list *l = ct_iterate(r, n->line, v);

		if (l->n != n->n_names)
			ct_fail(r, n->line, "cannot unpack %zu values into %zu names", l->n, n->n_names);
		for (size_t i = 0; i < n->n_names; i++)
			bind(r, f, n->names[i], l->v[i]);
		return;
	}
	bind(r, f, n->names[0], v);
}

static int exec(struct ct_render *r, struct ct_frame *f, const struct ct_node *n)
{
	step(r, n->line);
	switch (n->kind) {
	case N_BODY: {
		int flow = FLOW_NORMAL;

		enter(r, n->line);
		for (size_t i = 0; i < n->args.n && flow == FLOW_NORMAL; i++)
			flow = exec(r, f, n->args.v[i]);
		r->depth--;
		return flow;
	}
	case N_TEXT:
		emit(r, n->line, n->lit.u.s->s, n->lit.u.s->len);
		return FLOW_NORMAL;
	case N_OUTPUT: {
		struct ct_val v = eval(r, f, n->a);

		if (v.type == CT_STR) {
			emit(r, n->line, v.u.s->s, v.u.s->len);
		} else {
			struct ct_buf b = { .r = r };

			ct_to_str(&b, n->line, v);
			emit(r, n->line, b.p ? b.p : "", b.n);
		}
		return FLOW_NORMAL;
	}
	case N_IF:
		if (ct_truthy(eval(r, f, n->a)))
			return exec(r, f, n->b);
		return n->c ? exec(r, f, n->c) : FLOW_NORMAL;
	case N_FOR:
		exec_for(r, f, n);
		return FLOW_NORMAL;
	case N_SET:
		exec_set(r, f, n);
		return FLOW_NORMAL;
	case N_SETBLOCK:
		bind(r, f, n->name, capture(r, f, n->a));
		return FLOW_NORMAL;
	case N_MACRO: {
		struct ct_macro *m = ct_alloc(r, sizeof(*m));

		m->node = n;
		m->closure = f;
		bind(r, f, n->name, (struct ct_val){ .type = CT_MACRO, .u.m = m });
		return FLOW_NORMAL;
	}
	case N_CALLBLOCK: {
		struct ct_macro *m = ct_alloc(r, sizeof(*m));
		struct ct_val callee = eval(r, f, n->b->a), caller, out;
		struct ct_args a;

		if (callee.type != CT_MACRO)
			ct_fail(r, n->line, "{%% call %%} needs a macro, not a %s", ct_type_name(callee));
		m->node = n;
		m->closure = f;
		caller = (struct ct_val){ .type = CT_MACRO, .u.m = m };
		eval_args(r, f, n->b, &a);
		out = call_macro(r, n->line, callee.u.m, &a, &caller);
		emit(r, n->line, out.u.s->s, out.u.s->len);
		return FLOW_NORMAL;
	}
	case N_BREAK:
		return FLOW_BREAK;
	case N_CONTINUE:
		return FLOW_CONTINUE;
	}
	ct_fail(r, n->line, "internal error: an expression where a statement belongs");
}

int ct_render_run(struct ct_render *r, const struct mlens_chat_template *t)
{
	if (setjmp(r->fail))
		return -1;
	r->text = (struct ct_buf){ .r = r, .heap = 1 };
	r->out = &r->text;
	exec(r, frame_new(r, NULL), t->root);
	if (!r->text.p)
		ct_buf_put(&r->text, "", 0);
	return 0;
}
