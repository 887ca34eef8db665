/* libmlens chat templates (mlens_chat.h): finding a model's template and
 * special tokens, turning the caller's JSON into template values, and
 * rendering with the variables transformers' apply_chat_template passes. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "chat_template_int.h"
#include "mlens_chat.h"

/* Bounds of one render; a template that needs more is broken or hostile. */
#define CT_MAX_OUTPUT (64u << 20)
#define CT_MAX_MEMORY (256u << 20)
#define CT_MAX_STEPS 50000000ul
#define CT_MAX_DEPTH 256

/* Template files read from a model directory are at most this big. */
#define CT_MAX_FILE (16u << 20)

__attribute__((format(printf, 3, 4)))
static int fail(char **errmsg, int err, const char *fmt, ...)
{
	va_list ap;

	if (errmsg) {
		char buf[1200];

		va_start(ap, fmt);
		vsnprintf(buf, sizeof(buf), fmt, ap);
		va_end(ap);
		*errmsg = strdup(buf);
	}
	return err;
}

int mlens_chat_template_parse(const char *text, size_t len, const char *bos_token,
			      const char *eos_token, struct mlens_chat_template **out,
			      char **errmsg)
{
	struct mlens_chat_template *t;
	char err[1024];

	if (errmsg)
		*errmsg = NULL;
	if (!text || !out)
		return fail(errmsg, -EINVAL, "chat template: no template text or no place for the result");
	t = calloc(1, sizeof(*t));
	if (!t)
		return fail(errmsg, -ENOMEM, "chat template: out of memory");
	t->limits = (struct ct_limits){ CT_MAX_OUTPUT, CT_MAX_MEMORY, CT_MAX_STEPS, CT_MAX_DEPTH };
	t->arena.limit = CT_MAX_MEMORY;
	if ((bos_token && !(t->bos_token = strdup(bos_token))) ||
	    (eos_token && !(t->eos_token = strdup(eos_token)))) {
		mlens_chat_template_free(t);
		return fail(errmsg, -ENOMEM, "chat template: out of memory");
	}
	if (ct_parse(t, text, len, err, sizeof(err))) {
		mlens_chat_template_free(t);
		return fail(errmsg, -EINVAL, "chat template: %s", err);
	}
	*out = t;
	return 0;
}

void mlens_chat_template_free(struct mlens_chat_template *t)
{
	if (!t)
		return;
	ct_arena_free(&t->arena);
	free(t->bos_token);
	free(t->eos_token);
	free(t);
}

/* ==== Loading from a model directory ==== */

/* The whole file, NUL-terminated; NULL with errno set. */
static char *read_file(const char *path, size_t *len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	struct stat st;
	char *buf = NULL;
	size_t n = 0;

	if (fd < 0)
		return NULL;
	if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_size > (off_t)CT_MAX_FILE) {
		int e = errno;

		close(fd);
		errno = !S_ISREG(st.st_mode) ? EISDIR : st.st_size > (off_t)CT_MAX_FILE ? EFBIG : e;
		return NULL;
	}
	buf = malloc((size_t)st.st_size + 1);
	while (buf && n < (size_t)st.st_size) {
		ssize_t k = read(fd, buf + n, (size_t)st.st_size - n);

		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0) {
			free(buf);
			buf = NULL;
			if (!k)
				errno = EIO;
			break;
		}
		n += (size_t)k;
	}
	close(fd);
	if (buf) {
		buf[n] = 0;
		*len = n;
	}
	return buf;
}

/* bos_token / eos_token: a string, or an AddedToken object with "content";
 * from tokenizer_config.json, else special_tokens_map.json. */
static const char *special_token(json_t *cfg, json_t *map, const char *key)
{
	json_t *v = json_object_get(cfg, key);

	if (!v || json_is_null(v))
		v = json_object_get(map, key);
	if (json_is_object(v))
		v = json_object_get(v, "content");
	return json_string_value(v);
}

/* A JSON object file of dir, or NULL when absent; -1 with *errmsg set when
 * it is there but not a JSON object. */
static int load_object(const char *dir, const char *name, json_t **out, char **errmsg)
{
	char path[4096];
	json_error_t jerr;

	*out = NULL;
	if ((size_t)snprintf(path, sizeof(path), "%s/%s", dir, name) >= sizeof(path))
		return fail(errmsg, -ENAMETOOLONG, "chat template: %s: path too long", dir);
	*out = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
	if (!*out && access(path, F_OK) == 0)
		return fail(errmsg, -EINVAL, "chat template: %s: line %d: %s", path, jerr.line, jerr.text);
	if (*out && !json_is_object(*out)) {
		json_decref(*out);
		*out = NULL;
		return fail(errmsg, -EINVAL, "chat template: %s: not a JSON object", path);
	}
	return 0;
}

/* The template text: chat_template.jinja, else tokenizer_config.json's
 * "chat_template" (a string, or a list whose "default" entry is taken). */
static int find_template(const char *dir, json_t *cfg, char **file_text, const char **text,
			 size_t *len, char *path, size_t path_size, char **errmsg)
{
	json_t *ct;

	snprintf(path, path_size, "%s/chat_template.jinja", dir);
	*file_text = read_file(path, len);
	if (*file_text) {
		*text = *file_text;
		return 0;
	}
	if (errno != ENOENT)
		return fail(errmsg, -errno, "chat template: %s: %s", path, strerror(errno));
	snprintf(path, path_size, "%s/tokenizer_config.json (chat_template)", dir);
	ct = json_object_get(cfg, "chat_template");
	if (json_is_array(ct)) {
		size_t i;
		json_t *e;

		json_array_foreach(ct, i, e) {
			const char *name = json_string_value(json_object_get(e, "name"));

			if (name && !strcmp(name, "default"))
				*text = json_string_value(json_object_get(e, "template"));
		}
		if (!*text)
			return fail(errmsg, -ENOENT, "chat template: %s/tokenizer_config.json: "
				    "chat_template lists no template named \"default\"", dir);
		*len = strlen(*text);
		return 0;
	}
	*text = json_string_value(ct);
	*len = json_string_length(ct);
	if (!*text)
		return fail(errmsg, -ENOENT, "chat template: %s has no chat_template.jinja and no "
			    "\"chat_template\" string in tokenizer_config.json; pass a template "
			    "yourself (mlens_chat_template_parse)", dir);
	return 0;
}

int mlens_chat_template_open(const char *dir, struct mlens_chat_template **out, char **errmsg)
{
	char path[4096];
	json_t *cfg = NULL, *map = NULL;
	char *file_text = NULL;
	const char *text = NULL;
	size_t len = 0;
	int err;

	if (errmsg)
		*errmsg = NULL;
	if (!dir || !*dir || !out)
		return fail(errmsg, -EINVAL, "chat template: no model directory or no place for the result");
	err = load_object(dir, "tokenizer_config.json", &cfg, errmsg);
	if (!err)
		err = load_object(dir, "special_tokens_map.json", &map, errmsg);
	if (!err)
		err = find_template(dir, cfg, &file_text, &text, &len, path, sizeof(path), errmsg);
	if (err)
		goto out;
	err = mlens_chat_template_parse(text, len, special_token(cfg, map, "bos_token"),
					special_token(cfg, map, "eos_token"), out, errmsg);
	if (err && errmsg && *errmsg) {
		/* say which file the line number is in */
		char *m = *errmsg;

		*errmsg = NULL;
		fail(errmsg, err, "%s: %s", path, m + strlen("chat template: "));
		free(m);
	}
out:
	free(file_text);
	json_decref(cfg);
	json_decref(map);
	return err;
}

/* ==== Rendering ==== */

static struct ct_val from_json(struct ct_render *r, json_t *j)
{
	switch (json_typeof(j)) {
	case JSON_OBJECT: {
		struct ct_dict *d = ct_dict_new(r, json_object_size(j));
		const char *k;
		json_t *v;

		json_object_foreach(j, k, v) {
			d->k[d->n] = ct_cstr(r, k);
			d->v[d->n++] = from_json(r, v);
		}
		return (struct ct_val){ .type = CT_DICT, .u.d = d };
	}
	case JSON_ARRAY: {
		struct ct_list *l = ct_list_new(r, json_array_size(j));
		size_t i;
		json_t *v;

		json_array_foreach(j, i, v)
			l->v[l->n++] = from_json(r, v);
		return (struct ct_val){ .type = CT_LIST, .u.l = l };
	}
	case JSON_STRING: return ct_str_val(r, json_string_value(j), json_string_length(j));
	case JSON_INTEGER: return CT_INT_VAL(json_integer_value(j));
	case JSON_REAL: return (struct ct_val){ .type = CT_FLOAT, .u.f = json_real_value(j) };
	case JSON_TRUE: return CT_BOOL_VAL(1);
	case JSON_FALSE: return CT_BOOL_VAL(0);
	default: return CT_NONE_VAL;
	}
}

/* As transformers does before rendering: reasoning given as
 * reasoning_content, thinking or reasoning is offered under "thinking"
 * (first) and "reasoning_content" (last) too. */
static struct ct_val alias_reasoning(struct ct_render *r, struct ct_val m)
{
	static const char *const fields[] = { "reasoning_content", "thinking", "reasoning" };
	struct ct_val *reason = NULL;
	struct ct_dict *d;

	for (size_t i = 0; i < 3 && !reason; i++) {
		reason = ct_dict_getc(m.u.d, fields[i]);
		if (reason && reason->type == CT_NONE)
			reason = NULL;
	}
	if (!reason)
		return m;
	d = ct_dict_new(r, m.u.d->n + 2);
	ct_dict_set(r, d, ct_cstr(r, "thinking"), *reason);
	for (size_t i = 0; i < m.u.d->n; i++)
		ct_dict_set(r, d, m.u.d->k[i], m.u.d->v[i]);
	ct_dict_set(r, d, ct_cstr(r, "reasoning_content"), *reason);
	return (struct ct_val){ .type = CT_DICT, .u.d = d };
}

static void set_global(struct ct_render *r, const char *name, struct ct_val v)
{
	ct_dict_set(r, r->globals, ct_cstr(r, name), v);
}

/* The variables transformers' apply_chat_template passes, then the render;
 * 0, or -1 with r->err set. */
static int run(struct ct_render *r, const struct mlens_chat_template *t, json_t *msgs, json_t *extra)
{
	struct ct_val m;

	if (setjmp(r->fail))
		return -1;
	m = from_json(r, msgs);
	for (size_t i = 0; i < m.u.l->n; i++)
		m.u.l->v[i] = alias_reasoning(r, m.u.l->v[i]);
	r->globals = ct_dict_new(r, 8);
	set_global(r, "messages", m);
	set_global(r, "add_generation_prompt", CT_BOOL_VAL(r->add_generation_prompt));
	/* transformers passes tools and documents as None when not given */
	set_global(r, "tools", CT_NONE_VAL);
	set_global(r, "documents", CT_NONE_VAL);
	if (t->bos_token)
		set_global(r, "bos_token", ct_cstr(r, t->bos_token));
	if (t->eos_token)
		set_global(r, "eos_token", ct_cstr(r, t->eos_token));
	if (extra) {
		const char *k;
		json_t *v;

		json_object_foreach(extra, k, v)
			set_global(r, k, from_json(r, v));
	}
	return ct_render_run(r, t);
}

int mlens_chat_template_render(const struct mlens_chat_template *t, const char *messages_json,
			       int add_generation_prompt, const char *extra_json, char **out,
			       size_t *out_len, char **errmsg)
{
	struct ct_render *r;
	json_t *msgs = NULL, *extra = NULL;
	json_error_t jerr;
	int err = 0;

	if (errmsg)
		*errmsg = NULL;
	if (!t || !messages_json || !out)
		return fail(errmsg, -EINVAL, "chat template: no template, no messages or no place for the result");
	msgs = json_loads(messages_json, 0, &jerr);
	if (!msgs)
		return fail(errmsg, -EINVAL, "messages: not JSON (line %d: %s)", jerr.line, jerr.text);
	if (!json_is_array(msgs)) {
		json_decref(msgs);
		return fail(errmsg, -EINVAL, "messages: expected a JSON array of message objects");
	}
	for (size_t i = 0; i < json_array_size(msgs); i++)
		if (!json_is_object(json_array_get(msgs, i))) {
			json_decref(msgs);
			return fail(errmsg, -EINVAL, "messages[%zu]: expected an object "
				    "such as {\"role\": \"user\", \"content\": \"...\"}", i);
		}
	if (extra_json) {
		extra = json_loads(extra_json, 0, &jerr);
		if (!extra || !json_is_object(extra)) {
			json_decref(msgs);
			err = fail(errmsg, -EINVAL, "extra variables: %s%s", extra ? "expected a JSON object" :
				   "not JSON: ", extra ? "" : jerr.text);
			json_decref(extra);
			return err;
		}
		if (json_object_get(extra, "messages") || json_object_get(extra, "add_generation_prompt")) {
			json_decref(msgs);
			json_decref(extra);
			return fail(errmsg, -EINVAL, "extra variables: \"messages\" and \"add_generation_prompt\" "
				    "are set by their own arguments");
		}
	}
	r = calloc(1, sizeof(*r));
	if (!r) {
		json_decref(msgs);
		json_decref(extra);
		return fail(errmsg, -ENOMEM, "chat template: out of memory");
	}
	r->add_generation_prompt = !!add_generation_prompt;
	r->limits = &t->limits;
	r->arena.limit = t->limits.max_memory;
	if (run(r, t, msgs, extra)) {
		/* raise_exception: the template refused the messages */
		err = r->raised ? -EBADMSG : r->code ? r->code : -EINVAL;
		goto out;
	}
	*out = r->text.p;
	if (out_len)
		*out_len = r->text.n;
	r->text.p = NULL;
out:
	if (err)
		fail(errmsg, err, "%s%s", r->raised ? "" : "chat template: ", r->err[0] ? r->err : "out of memory");
	free(r->text.p);
	ct_arena_free(&r->arena);
	free(r);
	json_decref(msgs);
	json_decref(extra);
	return err;
}
