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

static int parse_fields(json_t *o, struct mlens_cli_req *r, char *err, size_t errlen)
{
	const char *key;
	json_t *v;
	json_int_t x;
	double d;
	int rc;

	json_object_foreach(o, key, v) {
		if (!strcmp(key, "prompt")) {
			size_t n = json_is_array(v) ? json_array_size(v) : 0;

			if (!json_is_array(v))
				return bad(err, errlen, "prompt is not an array of token ids");
			if (n == 0)
				return bad(err, errlen, "prompt is empty: a request needs a token");
			if (n > UINT32_MAX)
				return bad(err, errlen, "prompt has %zu tokens, too many", n);
			r->prompt = malloc(n * sizeof(*r->prompt));
			if (!r->prompt)
				return bad(err, errlen, "out of memory for a %zu-token prompt", n);
			for (size_t i = 0; i < n; i++) {
				rc = token_of(json_array_get(v, i), "prompt", i, &r->prompt[i], err,
					      errlen);
				if (rc)
					return rc;
			}
			r->n_prompt = (uint32_t)n;
		} else if (!strcmp(key, "max_tokens")) {
			rc = uint_field(v, key, 1, UINT32_MAX, &x, err, errlen);
			if (rc)
				return rc;
			r->max_tokens = (uint32_t)x;
		} else if (!strcmp(key, "temperature")) {
			rc = number_field(v, key, &d, err, errlen);
			if (rc)
				return rc;
			if (d < 0)
				return bad(err, errlen, "temperature is %g, want 0 (greedy) or more", d);
			r->temperature = (float)d;
		} else if (!strcmp(key, "top_k")) {
			rc = uint_field(v, key, 0, INT32_MAX, &x, err, errlen);
			if (rc)
				return rc;
			r->top_k = (int32_t)x;
		} else if (!strcmp(key, "top_p")) {
			rc = number_field(v, key, &d, err, errlen);
			if (rc)
				return rc;
			if (!(d > 0 && d <= 1))
				return bad(err, errlen, "top_p is %g, want more than 0 and at most 1",
					   d);
			r->top_p = (float)d;
		} else if (!strcmp(key, "seed")) {
			rc = uint_field(v, key, 0, LLONG_MAX, &x, err, errlen);
			if (rc)
				return rc;
			r->seed = (uint64_t)x;
		} else if (!strcmp(key, "stop")) {
			size_t n = json_is_array(v) ? json_array_size(v) : 0;

			if (!json_is_array(v))
				return bad(err, errlen, "stop is not an array of token ids");
			if (n > MLENS_REQ_MAX_STOP)
				return bad(err, errlen, "stop has %zu tokens, at most %d allowed", n,
					   MLENS_REQ_MAX_STOP);
			for (size_t i = 0; i < n; i++) {
				rc = token_of(json_array_get(v, i), "stop", i, &r->stop[i], err,
					      errlen);
				if (rc)
					return rc;
			}
			r->n_stop = (uint32_t)n;
		} else if (!strcmp(key, "logprobs") || !strcmp(key, "ignore_eos")) {
			bool *flag = !strcmp(key, "logprobs") ? &r->logprobs : &r->ignore_eos;

			if (!json_is_boolean(v))
				return bad(err, errlen, "%s is not true or false", key);
			*flag = json_is_true(v);
		} else {
			return bad(err, errlen, "unknown field \"%.64s\"", key);
		}
	}
	if (!r->prompt)
		return bad(err, errlen, "no prompt: a request needs \"prompt\": [token ids]");
	return 0;
}

int mlens_cli_request_parse(const char *line, size_t len, struct mlens_cli_req *r, char *err,
			    size_t errlen)
{
	json_error_t je;
	json_t *o;
	int rc;

	memset(r, 0, sizeof(*r));
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
	rc = parse_fields(o, r, err, errlen);
	json_decref(o);
	if (rc)
		mlens_cli_request_free(r);
	return rc;
}

void mlens_cli_request_free(struct mlens_cli_req *r)
{
	free(r->prompt);
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

char *mlens_cli_result_format(const struct mlens_cli_result *r)
{
	json_t *o = json_object(), *toks = json_array(), *lps = NULL;
	const char *fin = mlens_cli_finish_name(r->finish);
	char *s = NULL;
	int fail = !o || !toks;

	for (size_t i = 0; !fail && i < r->n_tokens; i++)
		fail |= json_array_append_new(toks, json_integer(r->tokens[i]));
	if (!fail && r->logprobs) {
		lps = json_array();
		fail |= !lps;
		for (size_t i = 0; !fail && i < r->n_tokens; i++)
			fail |= json_array_append_new(lps, json_real(r->logprobs[i]));
	}
	if (!fail) {
		fail |= json_object_set_new(o, "index", json_integer((json_int_t)r->index));
		fail |= json_object_set(o, "tokens", toks);
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
	if (!fail)
		s = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(7));
	json_decref(lps);
	json_decref(toks);
	json_decref(o);
	return s;
}
