/* OpenAI batch files in mlens generate: an input line {"custom_id",
 * "method", "url", "body"} becomes an mlens request, and its result the
 * output line OpenAI's Batch API and vllm run-batch write: the response's
 * body a completion or chat.completion object with usage, or an error. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <jansson.h>
#include "client/cli_int.h"

int mlens_cli_batch_parse(json_t *o, struct mlens_cli_req *r, char *err, size_t errlen)
{
	json_t *id = json_object_get(o, "custom_id"), *method = json_object_get(o, "method");
	json_t *url = json_object_get(o, "url"), *body = json_object_get(o, "body");
	const char *key, *u;
	json_t *v;

	/* an error line has OpenAI's shape whatever the url said */
	r->kind = MLENS_CLI_OAI_COMPLETION;
	if (json_is_string(id))
		r->custom_id = strdup(json_string_value(id));
	json_object_foreach(o, key, v)
		if (strcmp(key, "custom_id") && strcmp(key, "method") && strcmp(key, "url") &&
		    strcmp(key, "body")) {
			snprintf(err, errlen, "unknown field \"%.64s\" in a batch line (custom_id, "
				 "method, url, body)", key);
			return -EINVAL;
		}
	if (!json_is_string(id)) {
		snprintf(err, errlen, "custom_id is %s: a batch line needs a string naming it",
			 id ? "not a string" : "missing");
		return -EINVAL;
	}
	if (!json_is_string(method) || strcmp(json_string_value(method), "POST")) {
		snprintf(err, errlen, "method is %s: want \"POST\"",
			 method ? "not \"POST\"" : "missing");
		return -EINVAL;
	}
	u = json_is_string(url) ? json_string_value(url) : NULL;
	if (u && !strcmp(u, "/v1/completions")) {
		r->kind = MLENS_CLI_OAI_COMPLETION;
	} else if (u && !strcmp(u, "/v1/chat/completions")) {
		r->kind = MLENS_CLI_OAI_CHAT;
	} else {
		snprintf(err, errlen, "url %s%.64s%s is not served: want /v1/completions or "
			 "/v1/chat/completions", u ? "\"" : "", u ? u : "missing", u ? "\"" : "");
		return -EINVAL;
	}
	if (!json_is_object(body)) {
		snprintf(err, errlen, "body is %s: want the request's JSON object",
			 body ? "not an object" : "missing");
		return -EINVAL;
	}
	return mlens_cli_fields_parse(body, r, err, errlen);
}

/* A tag of this run for the ids of its lines (OpenAI's are random too). */
static const char *run_tag(void)
{
	static char tag[17];
	unsigned long long x;

	if (!tag[0]) {
		if (getrandom(&x, sizeof(x), GRND_NONBLOCK) != sizeof(x))
			x = (unsigned long long)time(NULL) * 2654435761u;
		snprintf(tag, sizeof(tag), "%016llx", x);
	}
	return tag;
}

/* The code of an error line: what was wrong with the request, the run
 * interrupted, or trouble on the daemon's side. */
static const char *error_code(const struct mlens_cli_result *r)
{
	if (r->finish == MLENS_REASON_CANCELLED)
		return "cancelled";
	return r->bad_request ? "invalid_request_error" : "server_error";
}

/* OpenAI's logprobs of a choice: the sampled tokens' own, no alternatives. */
static json_t *logprobs_json(const struct mlens_cli_result *r, bool chat)
{
	json_t *toks = json_array(), *lps = json_array(), *offs = json_array(), *o;
	size_t off = 0;

	for (size_t i = 0; toks && lps && offs && i < r->n_tokens; i++) {
		const char *t = r->token_text && r->token_text[i] ? r->token_text[i] : "";
		json_t *bytes = json_array();

		for (const char *p = t; bytes && *p; p++)
			json_array_append_new(bytes, json_integer((unsigned char)*p));
		if (chat)
			json_array_append_new(toks, json_pack("{s:s,s:f,s:o*,s:[]}", "token", t,
							     "logprob", (double)r->logprobs[i],
							     "bytes", bytes, "top_logprobs"));
		else
			json_decref(bytes);
		json_array_append_new(offs, json_integer((json_int_t)off));
		json_array_append_new(lps, json_real(r->logprobs[i]));
		if (!chat)
			json_array_append_new(toks, json_string(t));
		off += strlen(t);
	}
	if (chat) {
		json_decref(lps);
		json_decref(offs);
		return json_pack("{s:o*}", "content", toks);
	}
	o = json_pack("{s:o*,s:o*,s:n,s:o*}", "tokens", toks, "token_logprobs", lps,
		      "top_logprobs", "text_offset", offs);
	return o;
}

/* One choice of a completion or chat.completion. */
static json_t *choice_json(const struct mlens_cli_result *r, size_t i, bool chat)
{
	json_t *text = json_stringn(r->text ? r->text : "", r->text ? r->text_len : 0);

	if (!text)
		text = json_string("");
	if (chat)
		return json_pack("{s:I,s:{s:s,s:o*},s:o*,s:s}", "index", (json_int_t)i, "message",
				 "role", "assistant", "content", text, "logprobs",
				 r->logprobs ? logprobs_json(r, true) : json_null(),
				 "finish_reason", mlens_cli_finish_name(r->finish));
	return json_pack("{s:I,s:o*,s:o*,s:s}", "index", (json_int_t)i, "text", text, "logprobs",
			 r->logprobs ? logprobs_json(r, false) : json_null(), "finish_reason",
			 mlens_cli_finish_name(r->finish));
}

json_t *mlens_cli_batch_result(const struct mlens_cli_result *rs, size_t n)
{
	const struct mlens_cli_req *q = rs->req;
	bool chat = q->kind == MLENS_CLI_OAI_CHAT;
	const char *model = q->model ? q->model : "";
	const struct mlens_cli_result *r = rs;
	json_t *choices, *body, *msg;
	char id[64], rid[64], cid[64];
	json_int_t generated = 0;

	/* the line fails with its first choice that failed */
	for (size_t i = 0; i < n; i++)
		if (rs[i].finish != MLENS_REASON_LENGTH && rs[i].finish != MLENS_REASON_STOP) {
			r = &rs[i];
			break;
		}
	snprintf(id, sizeof(id), "batch_req_%s%08zx", run_tag(), rs->index);
	snprintf(rid, sizeof(rid), "req_%s%08zx", run_tag(), rs->index);
	if (r->finish != MLENS_REASON_LENGTH && r->finish != MLENS_REASON_STOP) {
		msg = json_string(r->error ? r->error : r->finish == MLENS_REASON_CANCELLED ?
				  "cancelled before it finished (mlens generate was interrupted)"
				  : "unknown error");
		/* a message quoting a malformed line may not be UTF-8 */
		if (!msg)
			msg = json_string("the error message is not valid UTF-8");
		return json_pack("{s:s,s:s?,s:n,s:{s:s,s:o}}", "id", id, "custom_id",
				 q->custom_id, "response", "error", "code", error_code(r),
				 "message", msg);
	}
	snprintf(cid, sizeof(cid), "%s-%s%08zx", chat ? "chatcmpl" : "cmpl", run_tag(), rs->index);
	choices = json_array();
	for (size_t i = 0; choices && i < n; i++) {
		if (json_array_append_new(choices, choice_json(&rs[i], i, chat))) {
			json_decref(choices);
			return NULL;
		}
		generated += (json_int_t)rs[i].n_tokens;
	}
	/* the prompt counts once, as OpenAI counts it */
	body = json_pack("{s:s,s:s,s:I,s:s,s:o*,s:{s:I,s:I,s:I}}", "id", cid, "object",
			 chat ? "chat.completion" : "text_completion", "created",
			 (json_int_t)time(NULL), "model", model, "choices", choices, "usage",
			 "prompt_tokens", (json_int_t)rs->n_prompt, "completion_tokens", generated,
			 "total_tokens", (json_int_t)rs->n_prompt + generated);
	return json_pack("{s:s,s:s?,s:{s:i,s:s,s:o*},s:n}", "id", id, "custom_id", q->custom_id,
			 "response", "status_code", 200, "request_id", rid, "body", body, "error");
}
