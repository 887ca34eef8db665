/* mlens-gateway's OpenAI JSON: reading completions, chat, tokenize and
 * detokenize bodies into a call's parameters and prompts (checked against
 * the daemon's limits, each refusal naming its field), and writing the
 * replies, the streamed chunks and the errors. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "client/gateway_int.h"

#define MAX_STOPS 16
#define MAX_STOP_LEN 256

/* ==== Errors ==== */

void gw_err_set(struct gw_err *e, int http, const char *param, const char *code,
		const char *fmt, ...)
{
	va_list ap;

	e->http = http;
	e->param = param;
	e->code = code;
	switch (http) {
	case 401: e->type = "authentication_error"; break;
	case 429: e->type = "rate_limit_error"; break;
	case 500: case 503: e->type = "server_error"; break;
	default: e->type = "invalid_request_error"; break;
	}
	va_start(ap, fmt);
	vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
	va_end(ap);
}

void gw_err_from_status(struct gw_err *e, int status)
{
	const char *why = mlens_strerror(status);

	switch (-status) {
	case EDQUOT:
		gw_err_set(e, 429, NULL, "quota_exceeded", "%s", why);
		break;
	case EAGAIN:
		gw_err_set(e, 429, NULL, "queue_full", "%s", why);
		break;
	case ESHUTDOWN:
		gw_err_set(e, 503, NULL, "draining", "%s", why);
		break;
	case ECONNRESET:
	case EPIPE:
	case ENOENT:
	case ECONNREFUSED:
	case EUSERS:
		gw_err_set(e, 503, NULL, "daemon_unavailable", "%s", why);
		break;
	case EINVAL:
	case E2BIG:
	case ERANGE:
		gw_err_set(e, 400, NULL, "invalid_value", "%s", why);
		break;
	default:
		gw_err_set(e, 500, NULL, "internal_error", "%s", why);
		break;
	}
}

json_t *gw_err_json(const struct gw_err *e)
{
	return json_pack("{s:{s:s, s:s, s:s?, s:s?}}", "error", "message", e->msg, "type",
			 e->type, "param", e->param, "code", e->code);
}

static int bad(struct gw_err *e, const char *param, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static int bad(struct gw_err *e, const char *param, const char *fmt, ...)
{
	va_list ap;

	gw_err_set(e, 400, param, "invalid_value", "%s", "");
	va_start(ap, fmt);
	vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
	va_end(ap);
	return -1;
}

static int no_text(struct gw_err *e, const char *param, const char *what)
{
	gw_err_set(e, 400, param, "no_tokenizer", "%s needs the model's tokenizer, which this "
		   "server has not loaded: start mlens-gateway with --model DIR (or --tokenizer "
		   "DIR) holding tokenizer.json, or send token ids", what);
	return -1;
}

/* ==== Reading fields ==== */

/* An optional field: absent and null leave *out as it is. */
static int get_bool(const json_t *b, const char *k, bool *out, struct gw_err *e)
{
	json_t *v = json_object_get(b, k);

	if (!v || json_is_null(v))
		return 0;
	if (!json_is_boolean(v))
		return bad(e, k, "'%s' must be true or false", k);
	*out = json_is_true(v);
	return 0;
}

static int get_num(const json_t *b, const char *k, double lo, double hi, double *out,
		   struct gw_err *e)
{
	json_t *v = json_object_get(b, k);

	if (!v || json_is_null(v))
		return 0;
	if (!json_is_number(v))
		return bad(e, k, "'%s' must be a number", k);
	*out = json_number_value(v);
	if (!(*out >= lo && *out <= hi))
		return bad(e, k, "'%s' is %g; it must be in [%g, %g]", k, *out, lo, hi);
	return 0;
}

static int get_int(const json_t *b, const char *k, long long lo, long long hi, long long *out,
		   struct gw_err *e)
{
	json_t *v = json_object_get(b, k);

	if (!v || json_is_null(v))
		return 0;
	if (!json_is_integer(v))
		return bad(e, k, "'%s' must be an integer", k);
	*out = json_integer_value(v);
	if (*out < lo || *out > hi)
		return bad(e, k, "'%s' is %lld; it must be in [%lld, %lld]", k, *out, lo, hi);
	return 0;
}

/* Token ids of a JSON array into a new array; param names it in errors. */
static int get_ids(const json_t *a, const struct mlens_limits *lim, const char *param,
		   int32_t **out, uint32_t *n, struct gw_err *e)
{
	size_t len = json_array_size(a);
	int32_t *ids;

	if (!len)
		return bad(e, param, "'%s' is empty", param);
	if (len > lim->max_context)
		return bad(e, param, "'%s' has %zu token ids; the model's context is %u",
			   param, len, lim->max_context);
	ids = malloc(len * sizeof(*ids));
	if (!ids)
		return bad(e, param, "out of memory");
	for (size_t i = 0; i < len; i++) {
		json_t *v = json_array_get(a, i);
		json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;

		if (!json_is_integer(v) || id < 0 || id >= lim->vocab_size) {
			free(ids);
			return bad(e, param, "'%s'[%zu] is not a token id: ids are integers in "
				   "[0, %u)", param, i, lim->vocab_size);
		}
		ids[i] = (int32_t)id;
	}
	*out = ids;
	*n = (uint32_t)len;
	return 0;
}

/* The token ids of a chat (an OpenAI messages array) rendered by the
 * model's template, ending with the assistant's turn when
 * add_generation_prompt, in a new array (*ids, free()). -ENOENT no
 * template, -EINVAL a message the template refused or a rendering that
 * does not tokenize (why says which and why), -ENOMEM. */
static int chat_ids(struct gw *gw, const json_t *messages, bool add_generation_prompt,
		    int32_t **ids, size_t *n, char *why, size_t why_len)
{
	char *msgs = json_dumps(messages, JSON_COMPACT), *text = NULL;
	bool add_special;
	size_t len;
	int rc;

	if (!msgs) {
		snprintf(why, why_len, "out of memory");
		return -ENOMEM;
	}
	rc = mlens_textgen_render(gw->text, msgs, add_generation_prompt, "no chat template",
				  &text, &len, &add_special, why, why_len);
	free(msgs);
	if (rc)
		return rc;
	rc = mlens_textgen_encode(gw->text, text, len, add_special, ids, n);
	free(text);
	if (rc)
		snprintf(why, why_len, "cannot tokenize the rendered chat: %s", strerror(-rc));
	return rc;
}

static int encode(struct gw *gw, const char *s, size_t len, bool add_special, const char *param,
		  int32_t **out, uint32_t *n, struct gw_err *e)
{
	size_t cnt;
	int rc;

	if (!gw->text)
		return no_text(e, param, "a text prompt");
	rc = mlens_textgen_encode(gw->text, s, len, add_special, out, &cnt);
	if (rc)
		return bad(e, param, "cannot tokenize '%s': %s", param, strerror(-rc));
	if (!cnt) {
		free(*out);
		*out = NULL;
		return bad(e, param, "'%s' encodes to no tokens; give at least one", param);
	}
	*n = (uint32_t)cnt;
	return 0;
}

static int add_prompt(struct gw_call *c, int32_t *ids, uint32_t n)
{
	int32_t **p = realloc(c->prompts, (c->n_prompts + 1) * sizeof(*p));
	uint32_t *l;

	if (!p) {
		free(ids);
		return -ENOMEM;
	}
	c->prompts = p;
	l = realloc(c->prompt_lens, (c->n_prompts + 1) * sizeof(*l));
	if (!l) {
		free(ids);
		return -ENOMEM;
	}
	c->prompt_lens = l;
	p[c->n_prompts] = ids;
	l[c->n_prompts++] = n;
	return 0;
}

/* A completions prompt: text, ids, a list of texts, a list of id lists. */
static int parse_prompt(struct gw *gw, struct gw_call *c, const json_t *p,
			const struct mlens_limits *lim, struct gw_err *e)
{
	int32_t *ids;
	uint32_t n;

	if (!p)
		return bad(e, "prompt", "'prompt' is required: text or token ids");
	if (json_is_string(p)) {
		if (encode(gw, json_string_value(p), json_string_length(p), true, "prompt", &ids,
			   &n, e))
			return -1;
		return add_prompt(c, ids, n) ? bad(e, "prompt", "out of memory") : 0;
	}
	if (!json_is_array(p) || !json_array_size(p))
		return bad(e, "prompt", "'prompt' must be text, token ids, or a non-empty list "
			   "of either");
	if (json_is_integer(json_array_get(p, 0))) {
		if (get_ids(p, lim, "prompt", &ids, &n, e))
			return -1;
		return add_prompt(c, ids, n) ? bad(e, "prompt", "out of memory") : 0;
	}
	if (json_array_size(p) > c->gw->conf.max_n)
		return bad(e, "prompt", "%zu prompts in one request; at most %u (max_n)",
			   json_array_size(p), c->gw->conf.max_n);
	for (size_t i = 0; i < json_array_size(p); i++) {
		json_t *v = json_array_get(p, i);
		int rc;

		if (json_is_string(v))
			rc = encode(gw, json_string_value(v), json_string_length(v), true, "prompt",
				    &ids, &n, e);
		else if (json_is_array(v))
			rc = get_ids(v, lim, "prompt", &ids, &n, e);
		else
			return bad(e, "prompt", "'prompt'[%zu] must be text or token ids", i);
		if (rc)
			return -1;
		if (add_prompt(c, ids, n))
			return bad(e, "prompt", "out of memory");
	}
	return 0;
}

static int parse_messages(struct gw *gw, struct gw_call *c, const json_t *m, struct gw_err *e)
{
	char why[256];
	int32_t *ids;
	uint32_t n;
	size_t cnt;
	int rc;

	if (!json_is_array(m) || !json_array_size(m))
		return bad(e, "messages", "'messages' must be a non-empty array of "
			   "{\"role\", \"content\"} objects");
	for (size_t i = 0; i < json_array_size(m); i++) {
		json_t *msg = json_array_get(m, i), *content;

		if (!json_is_object(msg) || !json_is_string(json_object_get(msg, "role")))
			return bad(e, "messages", "'messages'[%zu] must be an object with a "
				   "string 'role'", i);
		content = json_object_get(msg, "content");
		if (content && !json_is_string(content) && !json_is_array(content) &&
		    !json_is_null(content))
			return bad(e, "messages", "'messages'[%zu].content must be text, a list "
				   "of parts, or null", i);
	}
	if (!gw->text)
		return no_text(e, "messages", "chat");
	rc = chat_ids(gw, m, true, &ids, &cnt, why, sizeof(why));
	if (rc == -ENOENT) {
		gw_err_set(e, 400, "messages", "no_chat_template", "this server has no chat "
			   "template for the model (%s): use /v1/completions", why);
		return -1;
	}
	if (rc)
		return bad(e, "messages", "the chat template refused the messages: %s", why);
	if (!cnt) {
		free(ids);
		return bad(e, "messages", "the chat renders to no tokens");
	}
	n = (uint32_t)cnt;
	return add_prompt(c, ids, n) ? bad(e, "messages", "out of memory") : 0;
}

static int parse_stop(struct gw *gw, struct gw_call *c, const json_t *s, struct gw_err *e)
{
	size_t n = json_is_string(s) ? 1 : json_array_size(s);

	if (!s || json_is_null(s))
		return 0;
	if (!json_is_string(s) && !json_is_array(s))
		return bad(e, "stop", "'stop' must be a string or a list of strings");
	if (n > MAX_STOPS)
		return bad(e, "stop", "%zu stop strings; at most %d", n, MAX_STOPS);
	if (n && !gw->text)
		return no_text(e, "stop", "'stop'");
	c->stops = calloc(n ? n : 1, sizeof(*c->stops));
	if (!c->stops)
		return bad(e, "stop", "out of memory");
	for (size_t i = 0; i < n; i++) {
		json_t *v = json_is_string(s) ? (json_t *)s : json_array_get(s, i);
		size_t len = json_string_length(v);

		if (!json_is_string(v) || !len || len > MAX_STOP_LEN || memchr(json_string_value(v), 0, len))
			return bad(e, "stop", "'stop'[%zu] must be a string of 1 to %d bytes", i,
				   MAX_STOP_LEN);
		c->stops[i] = strdup(json_string_value(v));
		if (!c->stops[i])
			return bad(e, "stop", "out of memory");
		c->n_stops++;
	}
	return 0;
}

/* Fields this server has no way to honour: a value other than the neutral
 * one is refused rather than ignored. */
static int refuse_unsupported(const json_t *b, struct gw_err *e)
{
	static const char *const zero[] = { "presence_penalty", "frequency_penalty" };
	json_t *v;

	for (size_t i = 0; i < sizeof(zero) / sizeof(zero[0]); i++) {
		v = json_object_get(b, zero[i]);
		if (v && !json_is_null(v) && (!json_is_number(v) || json_number_value(v) != 0))
			return bad(e, zero[i], "'%s' is not supported by mlens: leave it out or 0",
				   zero[i]);
	}
	if ((v = json_object_get(b, "echo")) && json_is_true(v))
		return bad(e, "echo", "'echo' is not supported by mlens");
	if ((v = json_object_get(b, "best_of")) && !json_is_null(v) &&
	    !(json_is_integer(v) && json_integer_value(v) == 1))
		return bad(e, "best_of", "'best_of' is not supported by mlens: leave it out or 1");
	if ((v = json_object_get(b, "suffix")) && !json_is_null(v))
		return bad(e, "suffix", "'suffix' is not supported by mlens");
	if ((v = json_object_get(b, "logit_bias")) && !json_is_null(v) && json_object_size(v))
		return bad(e, "logit_bias", "'logit_bias' is not supported by mlens");
	if ((v = json_object_get(b, "tools")) && !json_is_null(v) && json_array_size(v))
		return bad(e, "tools", "'tools' is not supported by mlens");
	return 0;
}

static uint64_t random_seed(void)
{
	static uint64_t s;
	struct timespec ts;
	uint64_t z;

	clock_gettime(CLOCK_REALTIME, &ts);
	s += 0x9e3779b97f4a7c15ull + (uint64_t)ts.tv_nsec + ((uint64_t)ts.tv_sec << 30);
	z = s;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

void gw_call_clear(struct gw_call *c)
{
	for (uint32_t i = 0; c->ch && i < c->n_ch; i++) {
		free(c->ch[i].tokens);
		free(c->ch[i].logprobs);
		mlens_textgen_text_free(&c->ch[i].text);
	}
	for (uint32_t i = 0; i < c->n_prompts; i++)
		free(c->prompts[i]);
	for (size_t i = 0; i < c->n_stops; i++)
		free(c->stops[i]);
	free(c->stops);
	free(c->prompts);
	free(c->prompt_lens);
	free(c->ch);
	memset(c, 0, sizeof(*c));
}

int gw_call_parse(struct gw *gw, struct gw_call *c, const json_t *b,
		  const struct mlens_limits *lim, struct gw_err *e)
{
	json_t *v = json_object_get(b, "model");
	double temperature = 1, top_p = 1;
	long long max_tokens = c->kind == GW_CHAT ? 0 : 16, n = 1, top_k = 0, seed = 0;
	long long lp = -1, top_lp = 0;

	if (v && !json_is_null(v) && (!json_is_string(v) || strcmp(json_string_value(v), gw->model_id)))
		return bad(e, "model", "the model '%s' does not exist here: this server serves "
			   "'%s' (see /v1/models)", json_is_string(v) ? json_string_value(v) : "?",
			   gw->model_id), e->code = "model_not_found", -1;
	if (refuse_unsupported(b, e) ||
	    get_bool(b, "stream", &c->stream, e) ||
	    get_num(b, "temperature", 0, 100, &temperature, e) ||
	    get_num(b, "top_p", 0, 1, &top_p, e) ||
	    get_int(b, "top_k", -1, lim->vocab_size, &top_k, e) ||
	    get_int(b, "n", 1, gw->conf.max_n, &n, e) ||
	    get_bool(b, "return_token_ids", &c->return_token_ids, e) ||
	    get_bool(b, "ignore_eos", &c->ignore_eos, e))
		return -1;
	if ((v = json_object_get(b, "seed")) && !json_is_null(v)) {
		if (!json_is_integer(v))
			return bad(e, "seed", "'seed' must be an integer");
		seed = json_integer_value(v);
		c->has_seed = true;
	}
	if (get_int(b, "max_tokens", 1, lim->max_tokens, &max_tokens, e))
		return -1;
	if (c->kind == GW_CHAT &&
	    get_int(b, "max_completion_tokens", 1, lim->max_tokens, &max_tokens, e))
		return -1;
	if (top_p == 0)
		return bad(e, "top_p", "'top_p' is 0; it must be in (0, 1]");
	if ((v = json_object_get(b, "stream_options")) && !json_is_null(v)) {
		if (!json_is_object(v))
			return bad(e, "stream_options", "'stream_options' must be an object");
		if (!c->stream)
			return bad(e, "stream_options", "'stream_options' needs 'stream': true");
		if (get_bool(v, "include_usage", &c->include_usage, e))
			return -1;
	}
	/* log-probabilities: the daemon gives the sampled token's only */
	if (c->kind == GW_COMPLETION) {
		if (get_int(b, "logprobs", 0, 5, &lp, e))
			return -1;
		if (lp > 1)
			return bad(e, "logprobs", "'logprobs' is %lld; mlens reports the sampled "
				   "token's log-probability only, so at most 1", lp);
		c->logprobs = lp >= 0;
		c->top_logprobs = (int)lp;
	} else {
		if (get_bool(b, "logprobs", &c->logprobs, e) ||
		    get_int(b, "top_logprobs", 0, 20, &top_lp, e))
			return -1;
		if (top_lp > 1)
			return bad(e, "top_logprobs", "'top_logprobs' is %lld; mlens reports the "
				   "sampled token's log-probability only, so at most 1", top_lp);
		if (top_lp && !c->logprobs)
			return bad(e, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
		c->top_logprobs = (int)top_lp;
	}
	if (parse_stop(gw, c, json_object_get(b, "stop"), e))
		return -1;
	if ((v = json_object_get(b, "stop_token_ids")) && !json_is_null(v)) {
		if (!json_is_array(v) || json_array_size(v) > MLENS_REQ_MAX_STOP)
			return bad(e, "stop_token_ids", "'stop_token_ids' must be a list of at "
				   "most %d token ids", MLENS_REQ_MAX_STOP);
		for (size_t i = 0; i < json_array_size(v); i++) {
			json_t *id = json_array_get(v, i);

			if (!json_is_integer(id) || json_integer_value(id) < 0 ||
			    json_integer_value(id) >= lim->vocab_size)
				return bad(e, "stop_token_ids", "'stop_token_ids'[%zu] is not a "
					   "token id in [0, %u)", i, lim->vocab_size);
			c->stop_ids[c->n_stop_ids++] = (int32_t)json_integer_value(id);
		}
	}
	if (c->kind == GW_CHAT) {
		if (parse_messages(gw, c, json_object_get(b, "messages"), e))
			return -1;
	} else if (parse_prompt(gw, c, json_object_get(b, "prompt"), lim, e)) {
		return -1;
	}
	for (uint32_t i = 0; i < c->n_prompts; i++) {
		uint32_t len = c->prompt_lens[i];
		const char *param = c->kind == GW_CHAT ? "messages" : "prompt";

		if (len > lim->max_prompt_tokens)
			return bad(e, param, "the prompt has %u tokens; mlensd takes at most %u",
				   len, lim->max_prompt_tokens), e->code = "context_length_exceeded", -1;
		if (len + (uint64_t)(max_tokens ? max_tokens : 1) > lim->max_context)
			return bad(e, param, "this model's maximum context length is %u tokens; "
				   "you asked for %u in the prompt and %lld to generate", lim->max_context,
				   len, max_tokens ? max_tokens : 1), e->code = "context_length_exceeded", -1;
	}
	c->temperature = (float)temperature;
	c->top_p = (float)top_p;
	c->top_k = top_k < 0 ? 0 : (int32_t)top_k;
	c->max_tokens = (uint32_t)max_tokens;
	c->n = (uint32_t)n;
	c->seed = (uint64_t)seed;
	c->n_ch = c->n_prompts * c->n;
	c->ch = calloc(c->n_ch, sizeof(*c->ch));
	if (!c->ch)
		return bad(e, NULL, "out of memory");
	for (uint32_t i = 0; i < c->n_ch; i++) {
		struct gw_choice *ch = &c->ch[i];

		ch->call = c;
		ch->index = i;
		ch->prompt = c->prompts[i / c->n];
		ch->n_prompt = c->prompt_lens[i / c->n];
		/* n choices of one seeded request differ, and repeat */
		ch->seed = c->has_seed ? c->seed + i % c->n : random_seed();
		if (gw->text && mlens_textgen_text_init(&ch->text, gw->text))
			return bad(e, NULL, "out of memory");
	}
	return 0;
}

/* ==== Replies ==== */

char *gw_token_str(struct gw *gw, int32_t tok)
{
	char *s = NULL, buf[32];
	size_t len;

	if (gw->text && !mlens_textgen_decode(gw->text, &tok, 1, false, &s, &len))
		return s;
	snprintf(buf, sizeof(buf), "token_id:%d", tok);
	return strdup(buf);
}

static const char *finish_str(uint32_t f)
{
	switch (f) {
	case MLENS_REASON_STOP: return "stop";
	case MLENS_REASON_LENGTH: return "length";
	default: return "abort";
	}
}

static json_t *bytes_of(const char *s)
{
	json_t *a = json_array();

	for (; a && *s; s++)
		json_array_append_new(a, json_integer((unsigned char)*s));
	return a;
}

/* Log-probabilities of tokens [from, to) of ch, in the completions or
 * the chat shape. */
static json_t *logprobs_json(struct gw *gw, const struct gw_call *c, const struct gw_choice *ch,
			     size_t from, size_t to)
{
	json_t *toks = json_array(), *lps = json_array(), *tops = json_array(),
	       *offs = json_array(), *content = json_array();
	size_t off = 0;

	for (size_t i = from; i < to; i++) {
		char *s = gw_token_str(gw, ch->tokens[i]);
		double lp = ch->logprobs[i];

		if (!s)
			continue;
		if (c->kind == GW_COMPLETION) {
			json_array_append_new(toks, json_string(s));
			json_array_append_new(lps, json_real(lp));
			json_array_append_new(offs, json_integer((json_int_t)off));
			if (c->top_logprobs)
				json_array_append_new(tops, json_pack("{s:f}", s, lp));
			off += strlen(s);
		} else {
			json_t *top = json_array();

			if (c->top_logprobs)
				json_array_append_new(top, json_pack("{s:s, s:f, s:o}", "token", s,
								     "logprob", lp, "bytes", bytes_of(s)));
			json_array_append_new(content, json_pack("{s:s, s:f, s:o, s:o}", "token", s,
								 "logprob", lp, "bytes", bytes_of(s),
								 "top_logprobs", top));
		}
		free(s);
	}
	if (c->kind == GW_CHAT) {
		json_decref(toks);
		json_decref(lps);
		json_decref(tops);
		json_decref(offs);
		return json_pack("{s:o}", "content", content);
	}
	json_decref(content);
	if (!c->top_logprobs) {
		json_decref(tops);
		tops = json_null();
	}
	return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps,
			 "top_logprobs", tops, "text_offset", offs);
}

static json_t *ids_json(const int32_t *ids, size_t n)
{
	json_t *a = json_array();

	for (size_t i = 0; a && i < n; i++)
		json_array_append_new(a, json_integer(ids[i]));
	return a;
}

static json_t *usage_json(const struct gw_call *c)
{
	uint64_t p = 0, g = 0;

	for (uint32_t i = 0; i < c->n_prompts; i++)
		p += c->prompt_lens[i];
	for (uint32_t i = 0; i < c->n_ch; i++)
		g += c->ch[i].n_tokens;
	return json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)p, "completion_tokens",
			 (json_int_t)g, "total_tokens", (json_int_t)(p + g));
}

static json_t *call_head(struct gw *gw, const struct gw_call *c, const char *object)
{
	return json_pack("{s:s, s:s, s:I, s:s}", "id", c->id, "object", object, "created",
			 (json_int_t)c->created, "model", gw->model_id);
}

json_t *gw_call_result(struct gw *gw, const struct gw_call *c)
{
	json_t *r = call_head(gw, c, c->kind == GW_CHAT ? "chat.completion" : "text_completion");
	json_t *choices = json_array();

	for (uint32_t i = 0; i < c->n_ch; i++) {
		const struct gw_choice *ch = &c->ch[i];
		const char *text = ch->text.buf ? ch->text.buf : "";
		json_t *o, *lp = c->logprobs ? logprobs_json(gw, c, ch, 0, ch->n_tokens) : json_null();

		if (c->kind == GW_CHAT)
			o = json_pack("{s:I, s:{s:s, s:s%}, s:o, s:s}", "index", (json_int_t)i,
				      "message", "role", "assistant", "content", text, ch->text.len,
				      "logprobs", lp, "finish_reason", finish_str(ch->finish));
		else
			o = json_pack("{s:I, s:s%, s:o, s:s}", "index", (json_int_t)i, "text", text,
				      ch->text.len, "logprobs", lp, "finish_reason",
				      finish_str(ch->finish));
		if (o && c->return_token_ids)
			json_object_set_new(o, "token_ids", ids_json(ch->tokens, ch->n_tokens));
		json_array_append_new(choices, o);
	}
	json_object_set_new(r, "choices", choices);
	json_object_set_new(r, "usage", usage_json(c));
	return r;
}

json_t *gw_chunk(struct gw *gw, const struct gw_call *c, const struct gw_choice *ch,
		 size_t text_from, size_t text_to, bool finish)
{
	json_t *r = call_head(gw, c, c->kind == GW_CHAT ? "chat.completion.chunk" : "text_completion");
	const char *text = ch->text.buf ? ch->text.buf + text_from : "";
	size_t len = text_to - text_from;
	json_t *o, *lp = json_null();

	if (!finish && c->logprobs && ch->n_tokens > ch->n_tokens_sent) {
		json_decref(lp);
		lp = logprobs_json(gw, c, ch, ch->n_tokens_sent, ch->n_tokens);
	}
	if (c->kind == GW_CHAT) {
		json_t *delta = json_object();

		if (!finish && !ch->role_sent)
			json_object_set_new(delta, "role", json_string("assistant"));
		if (!finish)
			json_object_set_new(delta, "content", json_stringn(text, len));
		o = json_pack("{s:I, s:o, s:o, s:s?}", "index", (json_int_t)ch->index, "delta", delta,
			      "logprobs", lp, "finish_reason", finish ? finish_str(ch->finish) : NULL);
	} else {
		o = json_pack("{s:I, s:s%, s:o, s:s?}", "index", (json_int_t)ch->index, "text", text,
			      len, "logprobs", lp, "finish_reason",
			      finish ? finish_str(ch->finish) : NULL);
	}
	if (o && c->return_token_ids && !finish)
		json_object_set_new(o, "token_ids", ids_json(ch->tokens + ch->n_tokens_sent,
							     ch->n_tokens - ch->n_tokens_sent));
	json_object_set_new(r, "choices", json_pack("[o]", o));
	return r;
}

json_t *gw_usage_chunk(struct gw *gw, const struct gw_call *c)
{
	json_t *r = call_head(gw, c, c->kind == GW_CHAT ? "chat.completion.chunk" : "text_completion");

	json_object_set_new(r, "choices", json_array());
	json_object_set_new(r, "usage", usage_json(c));
	return r;
}

/* ==== /tokenize and /detokenize (as vLLM and llama.cpp's server) ==== */

json_t *gw_tokenize(struct gw *gw, const json_t *b, const struct mlens_limits *lim,
		    struct gw_err *e)
{
	json_t *p = json_object_get(b, "prompt"), *msgs = json_object_get(b, "messages");
	bool add_special = true;
	int32_t *ids = NULL;
	size_t n = 0;
	char why[256];
	json_t *r;
	int rc;

	if (!p)
		p = json_object_get(b, "content");	/* llama.cpp's name */
	if (get_bool(b, "add_special_tokens", &add_special, e))
		return NULL;
	if (!gw->text)
		return no_text(e, p ? "prompt" : "messages", "/tokenize"), NULL;
	if (msgs) {
		bool gen = true;

		if (!json_is_array(msgs))
			return bad(e, "messages", "'messages' must be an array"), NULL;
		if (get_bool(b, "add_generation_prompt", &gen, e))
			return NULL;
		rc = chat_ids(gw, msgs, gen, &ids, &n, why, sizeof(why));
		if (rc)
			return bad(e, "messages", "cannot render the chat: %s", why), NULL;
	} else if (json_is_string(p)) {
		rc = mlens_textgen_encode(gw->text, json_string_value(p), json_string_length(p),
					  add_special, &ids, &n);
		if (rc)
			return bad(e, "prompt", "cannot tokenize: %s", strerror(-rc)), NULL;
	} else {
		return bad(e, "prompt", "'prompt' (or 'content') must be text, or give "
			   "'messages'"), NULL;
	}
	r = json_pack("{s:o, s:I, s:I}", "tokens", ids_json(ids, n), "count", (json_int_t)n,
		      "max_model_len", (json_int_t)lim->max_context);
	free(ids);
	return r;
}

json_t *gw_detokenize(struct gw *gw, const json_t *b, struct gw_err *e)
{
	json_t *t = json_object_get(b, "tokens"), *r;
	int32_t *ids;
	char *s = NULL;
	size_t len, n = json_array_size(t);
	int rc;

	if (!json_is_array(t))
		return bad(e, "tokens", "'tokens' must be a list of token ids"), NULL;
	if (!gw->text)
		return no_text(e, "tokens", "/detokenize"), NULL;
	ids = malloc((n ? n : 1) * sizeof(*ids));
	if (!ids)
		return bad(e, NULL, "out of memory"), NULL;
	for (size_t i = 0; i < n; i++) {
		json_t *v = json_array_get(t, i);

		if (!json_is_integer(v) || json_integer_value(v) < 0 ||
		    json_integer_value(v) > INT32_MAX) {
			free(ids);
			return bad(e, "tokens", "'tokens'[%zu] is not a token id", i), NULL;
		}
		ids[i] = (int32_t)json_integer_value(v);
	}
	rc = mlens_textgen_decode(gw->text, ids, n, false, &s, &len);
	free(ids);
	if (rc == -EINVAL)
		return bad(e, "tokens", "a token id is outside the vocabulary"), NULL;
	if (rc)
		return bad(e, "tokens", "cannot detokenize: %s", strerror(-rc)), NULL;
	r = json_pack("{s:s%, s:s%}", "prompt", s, len, "content", s, len);
	free(s);
	return r;
}
