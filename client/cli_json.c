/* JSON lines of the mlens CLI through jansson: strict parsing of request
 * lines (every field checked for type and range, unknown keys refused) and
 * compact result lines with keys in a fixed order. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jansson.h>
#include "client/cli_int.h"

int mlens_cli_read_line(FILE *in, char **line, size_t *cap, size_t *len)
{
	ssize_t n;
	errno = 0;
	n = getline(line, cap, in);
	if (n < 0)
		return ferror(in) ? (errno ? -errno : -EIO) : 0;
	while (n > 0 && ((*line)[n - 1] == '\n' || (*line)[n - 1] == '\r'))
		n--;
	*len = (size_t)n;
	return 1;
}

__attribute__((format(printf, 3, 4)))
static int bad(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (err && errlen) {
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return -EINVAL;
}

/* A token id: an integer in [0, INT32_MAX] (the vocabulary bound is the
 * daemon's, checked by the library). */
static int token_of(json_t *v, const char *field, size_t i, int32_t *out, char *err,
		    size_t errlen)
{
	json_int_t x;

	if (!json_is_integer(v))
		return bad(err, errlen, "%s[%zu] is not an integer token id", field, i);
	x = json_integer_value(v);
	if (x < 0 || x > INT32_MAX)
		return bad(err, errlen, "%s[%zu] is %lld, not a token id (0 to %d)", field, i,
			   (long long)x, INT32_MAX);
	*out = (int32_t)x;
	return 0;
}

static int uint_field(json_t *v, const char *field, json_int_t lo, json_int_t hi,
		      json_int_t *out, char *err, size_t errlen)
{
	if (!json_is_integer(v))
		return bad(err, errlen, "%s is not an integer", field);
	*out = json_integer_value(v);
	if (*out < lo || *out > hi)
		return bad(err, errlen, "%s is %lld, want %lld to %lld", field,
			   (long long)*out, (long long)lo, (long long)hi);
	return 0;
}

static int number_field(json_t *v, const char *field, double *out, char *err, size_t errlen)
{
	if (!json_is_number(v))
		return bad(err, errlen, "%s is not a number", field);
	*out = json_number_value(v);
	if (!isfinite(*out))
		return bad(err, errlen, "%s is not finite", field);
	return 0;
}

/* A string field copied into *out (malloc'd). */
static int string_field(json_t *v, const char *field, char **out, char *err, size_t errlen)
{
	if (!json_is_string(v))
		return bad(err, errlen, "%s is not a string", field);
	free(*out);
	*out = strndup(json_string_value(v), json_string_length(v));
	return *out ? 0 : bad(err, errlen, "out of memory for %s", field);
}

/* "prompt": an array of token ids, or text (for an OpenAI body also an
 * array holding one text). */
static int prompt_field(json_t *v, struct mlens_cli_req *r, char *err, size_t errlen)
{
	size_t n = json_is_array(v) ? json_array_size(v) : 0;
	int rc;

	if (r->kind != MLENS_CLI_NATIVE && n == 1 && json_is_string(json_array_get(v, 0)))
		v = json_array_get(v, 0);
	if (json_is_string(v)) {
		if (!json_string_length(v))
			return bad(err, errlen, "prompt is an empty string: a request needs text");
		r->prompt_text_len = json_string_length(v);
		return string_field(v, "prompt", &r->prompt_text, err, errlen);
	}
	if (!json_is_array(v))
		return bad(err, errlen, "prompt is not a string or an array of token ids");
	if (n == 0)
		return bad(err, errlen, "prompt is empty: a request needs a token");
	if (json_is_string(json_array_get(v, 0)))
		return bad(err, errlen, "prompt holds %zu texts: a line runs one prompt (write one "
			   "line each)", n);
	if (n > UINT32_MAX)
		return bad(err, errlen, "prompt has %zu tokens, too many", n);
	r->prompt = malloc(n * sizeof(*r->prompt));
	if (!r->prompt)
		return bad(err, errlen, "out of memory for a %zu-token prompt", n);
	for (size_t i = 0; i < n; i++) {
		rc = token_of(json_array_get(v, i), "prompt", i, &r->prompt[i], err, errlen);
		if (rc)
			return rc;
	}
	r->n_prompt = (uint32_t)n;
	return 0;
}

/* "stop": token ids and strings, in an array or (one string) alone. */
static int stop_field(json_t *v, struct mlens_cli_req *r, char *err, size_t errlen)
{
	size_t n = json_is_array(v) ? json_array_size(v) : 1;
	json_t *e;
	int rc;

	if (json_is_null(v) && r->kind != MLENS_CLI_NATIVE)
		return 0;
	if (!json_is_array(v) && !json_is_string(v))
		return bad(err, errlen, "stop is not a string or an array of token ids and strings");
	for (size_t i = 0; i < n; i++) {
		e = json_is_array(v) ? json_array_get(v, i) : v;
		if (json_is_string(e)) {
			if (!json_string_length(e))
				return bad(err, errlen, "stop[%zu] is an empty string", i);
			if (r->n_stop_text == MLENS_CLI_MAX_STOP_TEXT)
				return bad(err, errlen, "stop has more than %d strings",
					   MLENS_CLI_MAX_STOP_TEXT);
			rc = string_field(e, "stop", &r->stop_text[r->n_stop_text], err, errlen);
			if (rc)
				return rc;
			r->n_stop_text++;
			continue;
		}
		if (r->n_stop == MLENS_REQ_MAX_STOP)
			return bad(err, errlen, "stop has %zu tokens, at most %d allowed", n,
				   MLENS_REQ_MAX_STOP);
		rc = token_of(e, "stop", i, &r->stop[r->n_stop], err, errlen);
		if (rc)
			return rc;
		r->n_stop++;
	}
	return 0;
}

/* "messages": a non-empty array of message objects, kept as JSON for the
 * chat template. */
static int messages_field(json_t *v, struct mlens_cli_req *r, char *err, size_t errlen)
{
	size_t i;
	json_t *m;

	if (!json_is_array(v) || !json_array_size(v))
		return bad(err, errlen, "messages is not a non-empty array of messages");
	json_array_foreach(v, i, m)
		if (!json_is_object(m))
			return bad(err, errlen, "messages[%zu] is not an object", i);
	r->messages = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
	return r->messages ? 0 : bad(err, errlen, "out of memory for messages");
}

/* The logprobs field: true or false on an mlens line and in a chat body;
 * in a completions body an integer, of which only 0 (the sampled tokens'
 * own log-probabilities) is served. */
static int logprobs_field(json_t *v, struct mlens_cli_req *r, char *err, size_t errlen)
{
	if (r->kind == MLENS_CLI_OAI_COMPLETION) {
		if (json_is_null(v))
			return 0;
		if (!json_is_integer(v) || json_integer_value(v) != 0)
			return bad(err, errlen, "logprobs: only 0 is served (the sampled tokens' own "
				   "log-probabilities, no alternatives)");
		r->logprobs = true;
		return 0;
	}
	if (!json_is_boolean(v))
		return bad(err, errlen, "logprobs is not true or false");
	r->logprobs = json_is_true(v);
	return 0;
}

int mlens_cli_fields_parse(json_t *o, struct mlens_cli_req *r, char *err, size_t errlen)
{
	bool oai = r->kind != MLENS_CLI_NATIVE, chat = r->kind == MLENS_CLI_OAI_CHAT;
	const char *key;
	json_t *v;
	json_int_t x = 0;
	double d;
	int rc;

	json_object_foreach(o, key, v) {
		if (!strcmp(key, "prompt") && !chat) {
			rc = prompt_field(v, r, err, errlen);
		} else if (!strcmp(key, "messages") && (chat || !oai)) {
			rc = messages_field(v, r, err, errlen);
		} else if (!strcmp(key, "max_tokens") ||
			   (chat && !strcmp(key, "max_completion_tokens"))) {
			rc = uint_field(v, key, 1, UINT32_MAX, &x, err, errlen);
			r->max_tokens = (uint32_t)x;
			r->max_tokens_given = true;
		} else if (!strcmp(key, "temperature")) {
			if ((rc = number_field(v, key, &d, err, errlen)))
				return rc;
			if (d < 0)
				return bad(err, errlen, "temperature is %g, want 0 (greedy) or more", d);
			r->temperature = (float)d;
		} else if (!strcmp(key, "top_k")) {
			rc = uint_field(v, key, 0, INT32_MAX, &x, err, errlen);
			r->top_k = (int32_t)x;
		} else if (!strcmp(key, "top_p")) {
			if ((rc = number_field(v, key, &d, err, errlen)))
				return rc;
			if (!(d > 0 && d <= 1))
				return bad(err, errlen, "top_p is %g, want more than 0 and at most 1",
					   d);
			r->top_p = (float)d;
		} else if (!strcmp(key, "seed")) {
			rc = uint_field(v, key, 0, LLONG_MAX, &x, err, errlen);
			r->seed = (uint64_t)x;
		} else if (!strcmp(key, "stop")) {
			rc = stop_field(v, r, err, errlen);
		} else if (!strcmp(key, "logprobs")) {
			rc = logprobs_field(v, r, err, errlen);
		} else if (!strcmp(key, "ignore_eos")) {
			if (!json_is_boolean(v))
				return bad(err, errlen, "%s is not true or false", key);
			r->ignore_eos = json_is_true(v);
			rc = 0;
		} else if (!strcmp(key, "custom_id") && !oai) {
			rc = string_field(v, key, &r->custom_id, err, errlen);
		} else if (oai && !strcmp(key, "model")) {
			rc = string_field(v, key, &r->model, err, errlen);
		} else if (oai && !strcmp(key, "n")) {
			rc = uint_field(v, key, 1, MLENS_CLI_MAX_CHOICES, &x, err, errlen);
			r->n = (uint32_t)x;
		} else if (oai && (!strcmp(key, "stream") || !strcmp(key, "echo"))) {
			if (!json_is_false(v) && !json_is_null(v))
				return bad(err, errlen, "%s: only false is served in a batch file",
					   key);
			rc = 0;
		} else if (oai && (!strcmp(key, "top_logprobs") || !strcmp(key, "frequency_penalty") ||
				   !strcmp(key, "presence_penalty"))) {
			if (!json_is_null(v) && (!json_is_number(v) || json_number_value(v) != 0))
				return bad(err, errlen, "%s: only 0 is served", key);
			rc = 0;
		} else if (oai && !strcmp(key, "user")) {
			rc = 0;		/* an end user's name for OpenAI's abuse checks */
		} else {
			return bad(err, errlen, "unknown field \"%.64s\"%s", key,
				   oai ? " in body" : "");
		}
		if (rc)
			return rc;
	}
	if (r->messages && (r->prompt || r->prompt_text))
		return bad(err, errlen, "both prompt and messages: a request has one of them");
	if (!r->prompt && !r->prompt_text && !r->messages)
		return bad(err, errlen, chat ? "no messages: a chat request needs \"messages\"" :
			   "no prompt: a request needs \"prompt\": [token ids] or text, or "
			   "\"messages\"");
	return 0;
}

/* Free what r's request holds, keeping what names its line (kind,
 * custom_id, model) for an error result. */
static void request_clear(struct mlens_cli_req *r)
{
	free(r->prompt);
	r->prompt = NULL;
	r->n_prompt = 0;
	free(r->prompt_text);
	r->prompt_text = NULL;
	free(r->messages);
	r->messages = NULL;
	for (uint32_t i = 0; i < r->n_stop_text; i++)
		free(r->stop_text[i]);
	r->n_stop_text = 0;
}

int mlens_cli_request_parse(const char *line, size_t len, struct mlens_cli_req *r, char *err,
			    size_t errlen)
{
	json_error_t je;
	json_t *o;
	int rc;

	memset(r, 0, sizeof(*r));
	r->n = 1;
	r->max_tokens = MLENS_CLI_MAX_TOKENS_DEFAULT;
	r->top_p = 1.0f;
	while (len && (line[len - 1] == '\n' || line[len - 1] == '\r'))
		len--;
	if (len == 0)
		return bad(err, errlen, "empty line: want a JSON object");
	o = json_loadb(line, len, JSON_REJECT_DUPLICATES, &je);
	if (!o)
		return bad(err, errlen, "not JSON: %s at column %d", je.text, je.column);
	if (!json_is_object(o)) {
		json_decref(o);
		return bad(err, errlen, "not a JSON object");
	}
	/* an OpenAI batch line wraps the request in body, next to its url */
	if (json_object_get(o, "body") || json_object_get(o, "url"))
		rc = mlens_cli_batch_parse(o, r, err, errlen);
	else
		rc = mlens_cli_fields_parse(o, r, err, errlen);
	json_decref(o);
	if (rc)
		request_clear(r);
	return rc;
}

void mlens_cli_request_free(struct mlens_cli_req *r)
{
	request_clear(r);
	free(r->custom_id);
	free(r->model);
	memset(r, 0, sizeof(*r));
}

void mlens_cli_request_to_api(const struct mlens_cli_req *r, struct mlens_request *req)
{
	memset(req, 0, sizeof(*req));
	req->size = sizeof(*req);
	req->prompt = r->prompt;
	req->n_prompt = r->n_prompt;
	req->max_tokens = r->max_tokens;
	req->temperature = r->temperature;
	req->top_p = r->top_p;
	req->top_k = r->top_k;
	req->seed = r->seed;
	req->flags = (r->logprobs ? MLENS_REQ_LOGPROBS : 0) | (r->ignore_eos ? MLENS_REQ_IGNORE_EOS : 0);
	memcpy(req->stop, r->stop, sizeof(req->stop));
	req->n_stop = r->n_stop;
	req->timeout_ms = 0;
}

const char *mlens_cli_finish_name(uint32_t finish)
{
	switch (finish) {
	case MLENS_REASON_LENGTH:
		return "length";
	case MLENS_REASON_STOP:
		return "stop";
	case MLENS_REASON_CANCELLED:
		return "cancelled";
	default:
		return "error";
	}
}

/* A JSON string of len bytes of text; NULL only when out of memory (a
 * decoder's text is valid UTF-8). */
static json_t *text_json(const char *text, size_t len)
{
	json_t *t = json_stringn(text, len);

	return t ? t : json_string("");
}

static json_t *tokens_json(const int32_t *tokens, size_t n)
{
	json_t *a = json_array();

	for (size_t i = 0; a && i < n; i++)
		if (json_array_append_new(a, json_integer(tokens[i]))) {
			json_decref(a);
			return NULL;
		}
	return a;
}

static char *dump_line(json_t *o)
{
	char *s = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(7))
		    : NULL;

	json_decref(o);
	return s;
}

char *mlens_cli_delta_format(size_t index, uint32_t choice, const struct mlens_cli_req *req,
			     const int32_t *tokens, size_t n_tokens, const char *text,
			     size_t text_len)
{
	json_t *o = json_object(), *d = json_object();
	int fail = !o || !d;

	fail = fail || json_object_set_new(o, "index", json_integer((json_int_t)index));
	if (!fail && req && req->custom_id)
		fail = json_object_set_new(o, "custom_id", json_string(req->custom_id));
	if (!fail && req && req->n > 1)
		fail = json_object_set_new(o, "choice", json_integer(choice));
	fail = fail || json_object_set_new(d, "tokens", tokens_json(tokens, n_tokens));
	if (!fail && text)
		fail = json_object_set_new(d, "text", text_json(text, text_len));
	fail = fail || json_object_set(o, "delta", d);
	json_decref(d);
	if (fail) {
		json_decref(o);
		return NULL;
	}
	return dump_line(o);
}

char *mlens_cli_result_format(const struct mlens_cli_result *r, size_t n)
{
	json_t *o, *toks, *lps = NULL;
	const char *fin = mlens_cli_finish_name(r->finish);
	int fail;

	if (r->req && r->req->kind != MLENS_CLI_NATIVE)
		return dump_line(mlens_cli_batch_result(r, n));
	o = json_object();
	toks = tokens_json(r->tokens, r->n_tokens);
	fail = !o || !toks;
	if (!fail && r->logprobs) {
		lps = json_array();
		fail |= !lps;
		for (size_t i = 0; !fail && i < r->n_tokens; i++)
			fail |= json_array_append_new(lps, json_real(r->logprobs[i]));
	}
	if (!fail) {
		fail |= json_object_set_new(o, "index", json_integer((json_int_t)r->index));
		if (r->req && r->req->custom_id)
			fail |= json_object_set_new(o, "custom_id", json_string(r->req->custom_id));
		fail |= json_object_set(o, "tokens", toks);
		if (r->text)
			fail |= json_object_set_new(o, "text", text_json(r->text, r->text_len));
		fail |= json_object_set_new(o, "finish_reason", json_string(fin));
		if (lps)
			fail |= json_object_set(o, "logprobs", lps);
		if (!strcmp(fin, "error")) {
			json_t *e = json_string(r->error ? r->error : "unknown error");

			/* a message quoting a malformed line may not be UTF-8 */
			if (!e)
				e = json_string("the error message is not valid UTF-8");
			fail |= json_object_set_new(o, "error", e);
		}
	}
	json_decref(lps);
	json_decref(toks);
	if (fail) {
		json_decref(o);
		return NULL;
	}
	return dump_line(o);
}
