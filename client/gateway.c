/* mlens-gateway: an OpenAI-compatible HTTP server that is a tenant of
 * mlensd. One thread and one event_base carry evhttp and the mlens_fd of
 * every libmlens connection (one a tenant: one per API key, or one in
 * all); a call is an HTTP request for completions, split into choices,
 * each one daemon request. Text is turned into ids and back through
 * client/textgen.h, as mlens generate does; the OpenAI JSON is built in
 * gateway_api.c. */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "client/gateway_int.h"

#define EVENT_BATCH 256
#define RETRY_MS 5		/* pending submissions try again this soon */
#define IDLE_TIMEOUT_S 120	/* an HTTP connection with nothing to read or write */

static void gw_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void gw_log(const char *fmt, ...)
{
	va_list ap;
	char ts[32];
	time_t now = time(NULL);
	struct tm tm;

	gmtime_r(&now, &tm);
	strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%SZ", &tm);
	fprintf(stderr, "%s mlens-gateway: ", ts);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

/* ==== Replies ==== */

static const char *reason_phrase(int code)
{
	switch (code) {
	case 200: return "OK";
	case 400: return "Bad Request";
	case 401: return "Unauthorized";
	case 404: return "Not Found";
	case 405: return "Method Not Allowed";
	case 413: return "Payload Too Large";
	case 429: return "Too Many Requests";
	case 503: return "Service Unavailable";
	default: return "Internal Server Error";
	}
}

/* Send j (taken) as the reply with status code. */
static void reply_json(struct evhttp_request *req, int code, json_t *j)
{
	struct evbuffer *buf = evbuffer_new();
	char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;

	json_decref(j);
	if (!buf || !s) {
		free(s);
		if (buf)
			evbuffer_free(buf);
		evhttp_send_error(req, 500, "out of memory");
		return;
	}
	evbuffer_add(buf, s, strlen(s));
	evbuffer_add(buf, "\n", 1);
	free(s);
	evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
			  "application/json");
	evhttp_send_reply(req, code, reason_phrase(code), buf);
	evbuffer_free(buf);
}

static void reply_err(struct evhttp_request *req, const struct gw_err *e)
{
	reply_json(req, e->http, gw_err_json(e));
}

/* One server-sent event: data: JSON. */
static void sse_send(struct evhttp_request *req, json_t *j)
{
	struct evbuffer *buf = evbuffer_new();
	char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;

	json_decref(j);
	if (buf && s) {
		evbuffer_add(buf, "data: ", 6);
		evbuffer_add(buf, s, strlen(s));
		evbuffer_add(buf, "\n\n", 2);
		evhttp_send_reply_chunk(req, buf);
	}
	free(s);
	if (buf)
		evbuffer_free(buf);
}

static void sse_done(struct evhttp_request *req)
{
	struct evbuffer *buf = evbuffer_new();

	if (buf) {
		evbuffer_add_printf(buf, "data: [DONE]\n\n");
		evhttp_send_reply_chunk(req, buf);
		evbuffer_free(buf);
	}
	evhttp_send_reply_end(req);
}

/* ==== Calls: lifetime ==== */

static void call_progress(struct gw_call *c);
static void tenant_submit_pending(struct gw_tenant *t);

static void on_conn_close(struct evhttp_connection *evcon, void *arg);

/* Stop watching the client's connection (before replying, or once gone). */
static void call_unwatch(struct gw_call *c)
{
	if (c->closed) {
		event_free(c->closed);
		c->closed = NULL;
	}
	if (c->req) {
		struct evhttp_connection *evcon = evhttp_request_get_connection(c->req);

		if (evcon)
			evhttp_connection_set_closecb(evcon, NULL, NULL);
	}
}

static void choice_unlink(struct gw_choice *ch)
{
	struct gw_tenant *t = ch->call->t;

	if (ch->in_daemon) {
		struct gw_choice **pp = &t->by_id[ch->id & (GW_ID_BUCKETS - 1)];

		while (*pp && *pp != ch)
			pp = &(*pp)->hnext;
		if (*pp)
			*pp = ch->hnext;
		ch->in_daemon = false;
	}
	if (ch->pending) {
		struct gw_choice **pp = &t->pend_head, *prev = NULL;

		while (*pp && *pp != ch) {
			prev = *pp;
			pp = &(*pp)->qnext;
		}
		if (*pp) {
			*pp = ch->qnext;
			if (t->pend_tail == ch)
				t->pend_tail = prev;
			t->n_pending--;
		}
		ch->pending = false;
	}
}

static void call_free(struct gw_call *c)
{
	gw_call_clear(c);
	free(c);
}

/* Free c once it has replied (or its client left) and the daemon holds
 * none of its requests (their ids must find it until their LAST event). */
static void call_maybe_free(struct gw_call *c)
{
	if (c->req || c->closed || c->starting)
		return;
	for (uint32_t i = 0; i < c->n_ch; i++)
		if (c->ch[i].in_daemon || c->ch[i].pending)
			return;
	call_free(c);
}

/* Stop c's choices still running: cancel them in the daemon (their LAST
 * events come later), drop those not yet submitted. */
static void call_abandon(struct gw_call *c)
{
	for (uint32_t i = 0; i < c->n_ch; i++) {
		struct gw_choice *ch = &c->ch[i];

		if (ch->pending)
			choice_unlink(ch);
		if (!ch->done) {
			ch->done = true;
			ch->finish = MLENS_REASON_CANCELLED;
			c->n_done++;
			if (ch->in_daemon && c->t->m)
				mlens_cancel(c->t->m, ch->id);
		}
	}
}

/* The client's connection closed under a running call. */
static void call_gone(struct gw_call *c)
{
	c->gone = true;
	call_abandon(c);
}

static void on_client_closed(evutil_socket_t fd, short what, void *arg)
{
	struct gw_call *c = arg;
	struct evhttp_connection *evcon = evhttp_request_get_connection(c->req);

	call_unwatch(c);
	c->req = NULL;
	call_gone(c);
	if (evcon)
		evhttp_connection_free(evcon);	/* frees the request too */
	call_maybe_free(c);
}

/* evhttp closes the connection (a write failed, or the server stops). */
static void on_conn_close(struct evhttp_connection *evcon, void *arg)
{
	struct gw_call *c = arg;

	if (c->closed) {
		event_free(c->closed);
		c->closed = NULL;
	}
	/* a request evhttp let go of is ours to free; one still on the
	 * connection goes with it */
	if (c->req && !evhttp_request_get_connection(c->req))
		evhttp_request_free(c->req);
	c->req = NULL;
	call_gone(c);
	call_maybe_free(c);
}

static int call_watch(struct gw_call *c)
{
	struct evhttp_connection *evcon = evhttp_request_get_connection(c->req);
	struct bufferevent *bev = evcon ? evhttp_connection_get_bufferevent(evcon) : NULL;

	if (!bev)
		return -EINVAL;
	c->closed = event_new(c->gw->base, bufferevent_getfd(bev), EV_CLOSED, on_client_closed, c);
	if (!c->closed || event_add(c->closed, NULL))
		return -ENOMEM;
	evhttp_connection_set_closecb(evcon, on_conn_close, c);
	return 0;
}

/* ==== Calls: output ==== */

static void stream_start(struct gw_call *c)
{
	struct evkeyvalq *h = evhttp_request_get_output_headers(c->req);

	evhttp_add_header(h, "Content-Type", "text/event-stream");
	evhttp_add_header(h, "Cache-Control", "no-cache");
	evhttp_send_reply_start(c->req, 200, "OK");
	c->headers_sent = true;
}

/* Fail the whole call with e: its other choices are cancelled. */
static void call_fail(struct gw_call *c, const struct gw_err *e)
{
	struct evhttp_request *req = c->req;

	if (c->failed)
		return;
	c->failed = true;
	call_abandon(c);
	if (!req || c->gone)
		return;
	call_unwatch(c);
	c->req = NULL;
	if (!c->headers_sent) {
		reply_err(req, e);
	} else {
		sse_send(req, gw_err_json(e));
		sse_done(req);
	}
}

/* Stream what choice ch has that the client has not seen. */
static void choice_stream(struct gw_call *c, struct gw_choice *ch)
{
	size_t upto = ch->done ? ch->text.len : ch->text.safe;

	/* an error before anything was sent is an HTTP status (call_fail) */
	if (!c->stream || !c->req || c->failed || ch->finish == MLENS_REASON_ERROR)
		return;
	if (!c->headers_sent)
		stream_start(c);
	if (upto > ch->text.sent || ch->n_tokens > ch->n_tokens_sent ||
	    (c->kind == GW_CHAT && !ch->role_sent)) {
		sse_send(c->req, gw_chunk(c->gw, c, ch, ch->text.sent, upto, false));
		ch->text.sent = upto;
		ch->n_tokens_sent = ch->n_tokens;
		ch->role_sent = true;
	}
	if (ch->done && ch->finish != MLENS_REASON_ERROR)
		sse_send(c->req, gw_chunk(c->gw, c, ch, upto, upto, true));
}

/* After a choice changed: stream it, and finish the call when every
 * choice is done. */
static void call_progress(struct gw_call *c)
{
	struct gw_err e;

	for (uint32_t i = 0; i < c->n_ch && !c->failed; i++)
		if (c->ch[i].done && c->ch[i].finish == MLENS_REASON_ERROR) {
			gw_err_from_status(&e, c->ch[i].status);
			call_fail(c, &e);
		}
	if (c->n_done == c->n_ch && !c->failed && c->req) {
		struct evhttp_request *req = c->req;

		call_unwatch(c);
		c->req = NULL;
		if (c->stream) {
			if (!c->headers_sent) {
				c->req = req;
				stream_start(c);
				c->req = NULL;
			}
			if (c->include_usage)
				sse_send(req, gw_usage_chunk(c->gw, c));
			sse_done(req);
		} else {
			reply_json(req, 200, gw_call_result(c->gw, c));
		}
	}
	call_maybe_free(c);
}

/* ==== Choices: the daemon's events ==== */

static int choice_add_token(struct gw_choice *ch, int32_t tok, float lp)
{
	if (ch->n_tokens == ch->cap_tokens) {
		size_t cap = ch->cap_tokens ? ch->cap_tokens * 2 : 32;
		int32_t *t = realloc(ch->tokens, cap * sizeof(*t));
		float *l;

		if (!t)
			return -ENOMEM;
		ch->tokens = t;
		l = realloc(ch->logprobs, cap * sizeof(*l));
		if (!l)
			return -ENOMEM;
		ch->logprobs = l;
		ch->cap_tokens = cap;
	}
	ch->tokens[ch->n_tokens] = tok;
	ch->logprobs[ch->n_tokens] = lp;
	ch->n_tokens++;
	return 0;
}

/* rc is what the text's push or finish returned: 1, a stop string met,
 * ends the choice there and becomes 0; 0 and -errno come back as they
 * are. */
static int choice_text_grew(struct gw_choice *ch, int rc)
{
	struct gw_call *c = ch->call;

	if (rc != 1)
		return rc;
	ch->done = true;
	ch->finish = MLENS_REASON_STOP;
	c->n_done++;
	if (ch->in_daemon && c->t->m)
		mlens_cancel(c->t->m, ch->id);
	return 0;
}

static void choice_event(struct gw_choice *ch, const struct mlens_event *e)
{
	struct gw_call *c = ch->call;
	bool last = e->flags & MLENS_EV_LAST;
	struct mlens_event ev;
	int rc = 0;

	if (last)
		choice_unlink(ch);
	if (last && e->finish == MLENS_REASON_CANCELLED && !ch->done) {
		/* cancelled without our asking: the daemon is draining */
		ev = *e;
		ev.finish = MLENS_REASON_ERROR;
		ev.status = -ESHUTDOWN;
		e = &ev;
	}
	if (ch->done) {		/* cut off by a stop string, or abandoned */
		call_maybe_free(c);
		return;
	}
	if (e->flags & MLENS_EV_TOKEN) {
		/* the stop token itself is counted, never shown */
		bool stop_tok = last && e->finish == MLENS_REASON_STOP;

		rc = choice_add_token(ch, e->token, e->flags & MLENS_EV_LOGPROB ? e->logprob : 0);
		if (!rc && ch->text.dt && !stop_tok)
			rc = choice_text_grew(ch, mlens_textgen_text_push(&ch->text, c->stops,
									  c->n_stops, e->token));
	}
	if (!ch->done && (last || rc)) {
		if (!rc && ch->text.dt)
			rc = choice_text_grew(ch, mlens_textgen_text_finish(&ch->text, c->stops,
									    c->n_stops));
		if (!ch->done) {
			ch->done = true;
			ch->finish = rc ? MLENS_REASON_ERROR : e->finish;
			ch->status = rc ? rc : e->status;
			c->n_done++;
		}
		if (rc && ch->in_daemon && c->t->m)
			mlens_cancel(c->t->m, ch->id);
	}
	choice_stream(c, ch);
	call_progress(c);
}

/* ==== Tenants ==== */

static void tenant_pump(evutil_socket_t fd, short what, void *arg);

static void tenant_close(struct gw_tenant *t)
{
	if (t->ev) {
		event_free(t->ev);
		t->ev = NULL;
	}
	if (t->m) {
		mlens_close(t->m);
		t->m = NULL;
	}
}

/* The daemon left (or the gateway stops): every choice it held, or that
 * waited for it, fails. */
static void tenant_drop(struct gw_tenant *t)
{
	tenant_close(t);
	for (;;) {
		struct gw_choice *ch = t->pend_head;

		for (size_t b = 0; !ch && b < GW_ID_BUCKETS; b++)
			ch = t->by_id[b];
		if (!ch)
			break;
		choice_unlink(ch);
		if (!ch->done) {
			ch->done = true;
			ch->finish = MLENS_REASON_ERROR;
			ch->status = -ECONNRESET;
			ch->call->n_done++;
		}
		call_progress(ch->call);
	}
}

static void tenant_lost(struct gw_tenant *t)
{
	gw_log("mlensd closed tenant %s's connection; reconnecting on the next request",
	       t->name);
	tenant_drop(t);
}

/* Attach t to mlensd if it is not. 0 or -errno. */
static int tenant_ready(struct gw_tenant *t)
{
	struct gw *gw = t->gw;
	int rc;

	if (t->m)
		return 0;
	rc = mlens_open(gw->conf.socket, t->name, &t->m);
	if (rc) {
		t->m = NULL;
		return rc;
	}
	t->lim.size = sizeof(t->lim);
	mlens_limits(t->m, &t->lim);
	t->ev = event_new(gw->base, mlens_fd(t->m), EV_READ | EV_PERSIST, tenant_pump, t);
	if (!t->ev || event_add(t->ev, NULL)) {
		tenant_close(t);
		return -ENOMEM;
	}
	memset(t->by_id, 0, sizeof(t->by_id));
	tenant_pump(-1, 0, t);
	gw_log("attached to mlensd at %s as tenant %s", gw->conf.socket, t->name);
	return 0;
}

static void tenant_pump(evutil_socket_t fd, short what, void *arg)
{
	struct gw_tenant *t = arg;
	struct mlens_event evs[EVENT_BATCH];
	int n;

	while (t->m && (n = mlens_poll(t->m, evs, EVENT_BATCH)) != 0) {
		if (n < 0) {
			if (n != -ECONNRESET)
				gw_log("tenant %s: %s", t->name, mlens_strerror(n));
			tenant_lost(t);
			return;
		}
		for (int i = 0; i < n; i++) {
			struct gw_choice *ch = t->by_id[evs[i].id & (GW_ID_BUCKETS - 1)];

			while (ch && ch->id != evs[i].id)
				ch = ch->hnext;
			if (ch)
				choice_event(ch, &evs[i]);
			if (!t->m)	/* a cancel found the daemon gone */
				break;
		}
	}
	tenant_submit_pending(t);
}

/* Submit ch. 0 submitted, -EAGAIN no ring room, -errno (the choice failed). */
static int choice_submit(struct gw_choice *ch)
{
	struct gw_call *c = ch->call;
	struct gw_tenant *t = c->t;
	struct mlens_request r = { .size = sizeof(r) };
	uint64_t id;
	int rc;

	if (!t->m)
		return -ECONNRESET;
	r.prompt = ch->prompt;
	r.n_prompt = ch->n_prompt;
	r.max_tokens = c->max_tokens;
	if (!r.max_tokens) {
		uint32_t room = t->lim.max_context - ch->n_prompt;

		r.max_tokens = room < t->lim.max_tokens ? room : t->lim.max_tokens;
	}
	r.temperature = c->temperature;
	r.top_p = c->top_p;
	r.top_k = c->top_k;
	r.flags = c->logprobs ? MLENS_REQ_LOGPROBS : 0;
	if (c->ignore_eos)
		r.flags |= MLENS_REQ_IGNORE_EOS;
	r.seed = ch->seed;
	memcpy(r.stop, c->stop_ids, sizeof(r.stop));
	r.n_stop = c->n_stop_ids;
	r.timeout_ms = 0;
	rc = mlens_submit(t->m, &r, &id);
	if (rc)
		return rc;
	ch->id = id;
	ch->in_daemon = true;
	ch->hnext = t->by_id[id & (GW_ID_BUCKETS - 1)];
	t->by_id[id & (GW_ID_BUCKETS - 1)] = ch;
	return 0;
}

static void choice_fail(struct gw_choice *ch, int status)
{
	if (!ch->done) {
		ch->done = true;
		ch->finish = MLENS_REASON_ERROR;
		ch->status = status;
		ch->call->n_done++;
	}
	call_progress(ch->call);
}

static void tenant_submit_pending(struct gw_tenant *t)
{
	while (t->pend_head) {
		struct gw_choice *ch = t->pend_head;
		int rc = choice_submit(ch);

		if (rc == -EAGAIN)
			break;
		t->pend_head = ch->qnext;
		if (!t->pend_head)
			t->pend_tail = NULL;
		t->n_pending--;
		ch->pending = false;
		if (rc == -ECONNRESET) {
			choice_fail(ch, rc);
			tenant_lost(t);
			return;
		}
		if (rc)
			choice_fail(ch, rc);
	}
	if (t->pend_head) {
		struct timeval tv = { 0, RETRY_MS * 1000 };

		evtimer_add(t->gw->retry, &tv);
	}
}

/* Every second: a daemon that died rings no doorbell; polling finds its
 * hang-up. */
static void on_heartbeat(evutil_socket_t fd, short what, void *arg)
{
	struct gw *gw = arg;

	for (size_t i = 0; i < gw->n_tenants; i++)
		if (gw->tenants[i].m)
			tenant_pump(-1, 0, &gw->tenants[i]);
}

static void on_retry(evutil_socket_t fd, short what, void *arg)
{
	struct gw *gw = arg;

	for (size_t i = 0; i < gw->n_tenants; i++)
		if (gw->tenants[i].pend_head)
			tenant_submit_pending(&gw->tenants[i]);
}

/* Submit every choice of a new call: those the rings cannot take now wait
 * in the tenant's queue, up to max_pending of them. */
static void call_start(struct gw_call *c)
{
	struct gw_tenant *t = c->t;

	/* a choice failing here may finish the call: free it only at the end */
	c->starting = true;
	for (uint32_t i = 0; i < c->n_ch && !c->failed; i++) {
		struct gw_choice *ch = &c->ch[i];
		int rc = t->pend_head ? -EAGAIN : choice_submit(ch);

		if (rc == -EAGAIN) {
			if (t->n_pending >= t->gw->conf.max_pending) {
				struct gw_err e;

				gw_err_set(&e, 429, NULL, "queue_full", "mlens-gateway holds %u requests "
					   "of this tenant waiting for mlensd already: try again later",
					   t->n_pending);
				call_fail(c, &e);
				break;
			}
			ch->pending = true;
			ch->qnext = NULL;
			if (t->pend_tail)
				t->pend_tail->qnext = ch;
			else
				t->pend_head = ch;
			t->pend_tail = ch;
			t->n_pending++;
			continue;
		}
		if (rc) {
			choice_fail(ch, rc);
			if (rc == -ECONNRESET) {
				tenant_lost(t);
				break;
			}
		}
	}
	if (t->pend_head) {
		struct timeval tv = { 0, RETRY_MS * 1000 };

		evtimer_add(t->gw->retry, &tv);
	}
	c->starting = false;
	call_maybe_free(c);
}

/* ==== HTTP ==== */

static struct gw_tenant *authorize(struct gw *gw, struct evhttp_request *req, struct gw_err *e)
{
	const char *h;
	size_t len;

	if (!gw->keys)
		return &gw->tenants[0];
	h = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
	if (!h || strncasecmp(h, "Bearer ", 7)) {
		gw_err_set(e, 401, NULL, "invalid_api_key", "this server needs an API key: send "
			   "the header 'Authorization: Bearer KEY'");
		return NULL;
	}
	h += 7;
	while (*h == ' ')
		h++;
	len = strlen(h);
	for (size_t i = 0; i < gw->n_tenants; i++) {
		const char *k = gw->tenants[i].key;
		size_t kl = strlen(k);
		unsigned char diff = kl != len;

		/* compare every byte whatever the first difference */
		for (size_t j = 0; j < kl; j++)
			diff |= (unsigned char)(k[j] ^ (j < len ? h[j] : 0));
		if (!diff)
			return &gw->tenants[i];
	}
	gw_err_set(e, 401, NULL, "invalid_api_key", "incorrect API key provided");
	return NULL;
}

/* The body as a JSON object. NULL with e set: too large or not JSON. */
static json_t *read_body(struct gw *gw, struct evhttp_request *req, struct gw_err *e)
{
	struct evbuffer *in = evhttp_request_get_input_buffer(req);
	size_t len = evbuffer_get_length(in);
	json_error_t je;
	json_t *j;
	unsigned char *p;

	if (len > gw->conf.max_body) {
		gw_err_set(e, 413, NULL, "request_too_large", "the request body has %zu bytes; "
			   "this server takes at most %zu (max_body)", len, gw->conf.max_body);
		return NULL;
	}
	p = evbuffer_pullup(in, -1);
	j = json_loadb(p ? (const char *)p : "", len, JSON_REJECT_DUPLICATES, &je);
	if (!j) {
		gw_err_set(e, 400, NULL, "invalid_json", "the body is not valid JSON: %s "
			   "(line %d, column %d)", je.text, je.line, je.column);
		return NULL;
	}
	if (!json_is_object(j)) {
		json_decref(j);
		gw_err_set(e, 400, NULL, "invalid_json", "the body must be a JSON object");
		return NULL;
	}
	return j;
}

static bool tenant_err(struct gw_tenant *t, struct gw_err *e)
{
	int rc = tenant_ready(t);

	if (!rc)
		return false;
	if (rc == -ENOENT || rc == -ECONNREFUSED)
		gw_err_set(e, 503, NULL, "daemon_unavailable", "mlensd is not running at %s: %s",
			   t->gw->conf.socket, mlens_strerror(rc));
	else
		gw_err_set(e, 503, NULL, "daemon_unavailable", "cannot attach to mlensd at %s: %s",
			   t->gw->conf.socket, mlens_strerror(rc));
	return true;
}

static void handle_generate(struct gw *gw, struct evhttp_request *req, struct gw_tenant *t,
			    json_t *body, enum gw_kind kind)
{
	struct gw_call *c;
	struct gw_err e;

	if (tenant_err(t, &e)) {
		reply_err(req, &e);
		return;
	}
	c = calloc(1, sizeof(*c));
	if (!c) {
		evhttp_send_error(req, 500, "out of memory");
		return;
	}
	c->gw = gw;
	c->t = t;
	c->kind = kind;
	c->created = (long long)time(NULL);
	snprintf(c->id, sizeof(c->id), "%s-%llx%06" PRIx64, kind == GW_CHAT ? "chatcmpl" : "cmpl",
		 (long long)gw->started, ++gw->n_calls);
	if (gw_call_parse(gw, c, body, &t->lim, &e)) {
		reply_err(req, &e);
		call_free(c);
		return;
	}
	c->req = req;
	if (call_watch(c)) {
		c->req = NULL;
		call_unwatch(c);
		evhttp_send_error(req, 500, "out of memory");
		call_free(c);
		return;
	}
	call_start(c);
	/* arm the doorbell: mlens_fd turns readable only after a poll found
	 * nothing */
	tenant_pump(-1, 0, t);
}

static json_t *model_json(struct gw *gw, struct gw_tenant *t)
{
	json_t *m = json_pack("{s:s, s:s, s:I, s:s}", "id", gw->model_id, "object", "model",
			      "created", (json_int_t)gw->started, "owned_by", "mlens");

	if (m && t && !tenant_ready(t))
		json_object_set_new(m, "max_model_len", json_integer(t->lim.max_context));
	return m;
}

static void handle_models(struct gw *gw, struct evhttp_request *req, struct gw_tenant *t)
{
	reply_json(req, 200, json_pack("{s:s, s:[o]}", "object", "list", "data",
				       model_json(gw, t)));
}

/* GET /v1/models/ID: the model when ID is ours. */
static void handle_model(struct gw *gw, struct evhttp_request *req, struct gw_tenant *t,
			 const char *path, size_t plen)
{
	size_t skip = strlen("/v1/models/");
	char *raw = strndup(path + skip, plen - skip);
	char *id = raw ? evhttp_uridecode(raw, 0, NULL) : NULL;
	struct gw_err e;

	if (id && !strcmp(id, gw->model_id)) {
		reply_json(req, 200, model_json(gw, t));
	} else {
		gw_err_set(&e, 404, "model", "model_not_found", "the model '%.200s' does not exist "
			   "here: this server serves '%s'", id ? id : "?", gw->model_id);
		reply_err(req, &e);
	}
	free(id);
	free(raw);
}

enum route_id { R_MODELS, R_MODEL, R_HEALTH, R_TOKENIZE, R_DETOKENIZE, R_COMPLETIONS, R_CHAT };

static const struct route {
	const char *path;
	enum evhttp_cmd_type method;
	enum route_id id;
} routes[] = {
	{ "/v1/models", EVHTTP_REQ_GET, R_MODELS },
	{ "/health", EVHTTP_REQ_GET, R_HEALTH },
	{ "/tokenize", EVHTTP_REQ_POST, R_TOKENIZE },
	{ "/detokenize", EVHTTP_REQ_POST, R_DETOKENIZE },
	{ "/v1/completions", EVHTTP_REQ_POST, R_COMPLETIONS },
	{ "/v1/chat/completions", EVHTTP_REQ_POST, R_CHAT },
}, model_route = { "/v1/models/ID", EVHTTP_REQ_GET, R_MODEL };

static const char *method_name(enum evhttp_cmd_type m)
{
	switch (m) {
	case EVHTTP_REQ_GET: return "GET";
	case EVHTTP_REQ_POST: return "POST";
	case EVHTTP_REQ_HEAD: return "HEAD";
	case EVHTTP_REQ_PUT: return "PUT";
	case EVHTTP_REQ_DELETE: return "DELETE";
	case EVHTTP_REQ_OPTIONS: return "OPTIONS";
	case EVHTTP_REQ_TRACE: return "TRACE";
	case EVHTTP_REQ_CONNECT: return "CONNECT";
	case EVHTTP_REQ_PATCH: return "PATCH";
	default: return "?";
	}
}

static void on_request(struct evhttp_request *req, void *arg)
{
	struct gw *gw = arg;
	const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
	const char *path = uri ? evhttp_uri_get_path(uri) : NULL;
	enum evhttp_cmd_type method = evhttp_request_get_command(req);
	const struct route *r = NULL;
	struct gw_tenant *t;
	struct gw_err e;
	json_t *body = NULL, *out;
	size_t plen;

	if (!path)
		path = "/";
	plen = strlen(path);
	while (plen > 1 && path[plen - 1] == '/')
		plen--;
	for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++)
		if (strlen(routes[i].path) == plen && !strncmp(routes[i].path, path, plen))
			r = &routes[i];
	if (!r && plen > strlen("/v1/models/") && !strncmp(path, "/v1/models/", strlen("/v1/models/")))
		r = &model_route;
	if (!r) {
		gw_err_set(&e, 404, NULL, "unknown_url", "Invalid URL (%s %s)", method_name(method),
			   path);
		reply_err(req, &e);
		return;
	}
	if (r->method != method) {
		evhttp_add_header(evhttp_request_get_output_headers(req), "Allow",
				  method_name(r->method));
		gw_err_set(&e, 405, NULL, "method_not_allowed", "%s takes %s, not %s", r->path,
			   method_name(r->method), method_name(method));
		reply_err(req, &e);
		return;
	}
	if (r->id == R_HEALTH) {
		reply_json(req, 200, json_object());
		return;
	}
	t = authorize(gw, req, &e);
	if (!t) {
		reply_err(req, &e);
		return;
	}
	if (method == EVHTTP_REQ_POST && !(body = read_body(gw, req, &e))) {
		reply_err(req, &e);
		return;
	}
	switch (r->id) {
	case R_MODELS:
		handle_models(gw, req, t);
		break;
	case R_MODEL:
		handle_model(gw, req, t, path, plen);
		break;
	case R_TOKENIZE:
		if (tenant_err(t, &e) || !(out = gw_tokenize(gw, body, &t->lim, &e)))
			reply_err(req, &e);
		else
			reply_json(req, 200, out);
		break;
	case R_DETOKENIZE:
		if (!(out = gw_detokenize(gw, body, &e)))
			reply_err(req, &e);
		else
			reply_json(req, 200, out);
		break;
	case R_COMPLETIONS:
		handle_generate(gw, req, t, body, GW_COMPLETION);
		break;
	case R_CHAT:
		handle_generate(gw, req, t, body, GW_CHAT);
		break;
	default:
		break;
	}
	json_decref(body);
}

/* ==== Start-up ==== */

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
	struct gw *gw = arg;

	gw_log("signal %d: stopping", (int)sig);
	event_base_loopbreak(gw->base);
}

static int setup_tenants(struct gw *gw)
{
	struct gw_key *keys = NULL;
	size_t n = 0;

	if (gw->conf.api_key_file) {
		if (gw_keys_load(gw->conf.api_key_file, &keys, &n))
			return -EINVAL;
		gw->keys = true;
	}
	gw->tenants = calloc(n ? n : 1, sizeof(*gw->tenants));
	if (!gw->tenants)
		return -ENOMEM;
	gw->n_tenants = n ? n : 1;
	for (size_t i = 0; i < gw->n_tenants; i++) {
		struct gw_tenant *t = &gw->tenants[i];

		t->gw = gw;
		t->name = strdup(n ? keys[i].tenant : "mlens-gateway");
		t->key = n ? keys[i].key : NULL;
		if (n)
			keys[i].key = NULL;
		if (!t->name)
			return -ENOMEM;
	}
	gw_keys_free(keys, n);
	return 0;
}

/* The model's name and text files: --served-model-name, else the base
 * name of --model; the tokenizer from --tokenizer, else --model. */
static int setup_model(struct gw *gw)
{
	const char *dir = gw->conf.tokenizer ? gw->conf.tokenizer : gw->conf.model;
	const char *name = gw->conf.served_model_name;
	char why[256];
	int rc;

	if (!name && gw->conf.model) {
		size_t l = strlen(gw->conf.model);

		while (l > 1 && gw->conf.model[l - 1] == '/')
			l--;
		name = gw->conf.model;
		for (size_t i = 0; i < l; i++)
			if (gw->conf.model[i] == '/' && i + 1 < l)
				name = gw->conf.model + i + 1;
		gw->model_id = strndup(name, l - (size_t)(name - gw->conf.model));
	} else {
		gw->model_id = strdup(name ? name : "mlens");
	}
	if (!gw->model_id)
		return -ENOMEM;
	if (!dir) {
		gw_log("no --model or --tokenizer: serving token-id prompts only");
		return 0;
	}
	rc = mlens_textgen_open(dir, &gw->text, why, sizeof(why));
	if (rc == -ENOENT && !gw->conf.tokenizer) {
		gw_log("%s holds no tokenizer.json: serving token-id prompts only", dir);
		return 0;
	}
	if (rc == -ENOTSUP) {
		gw_log("%s: serving token-id prompts only", why);
		return 0;
	}
	if (rc) {
		fprintf(stderr, "mlens-gateway: tokenizer in %s: %s\n", dir, why);
		return rc;
	}
	if (mlens_textgen_chat_problem(gw->text, "no chat template"))
		gw_log("%s: chat requests are refused: %s", dir,
		       mlens_textgen_chat_problem(gw->text, "no chat template"));
	return 0;
}

static int setup_http(struct gw *gw)
{
	char host[256];
	const char *colon = strrchr(gw->conf.listen, ':');
	char *end;
	long port;
	struct evhttp_bound_socket *bs;
	struct sockaddr_storage ss;
	ev_socklen_t sl = sizeof(ss);
	size_t hl;

	if (!colon || colon == gw->conf.listen) {
		fprintf(stderr, "mlens-gateway: listen '%s': expected HOST:PORT\n", gw->conf.listen);
		return -EINVAL;
	}
	port = strtol(colon + 1, &end, 10);
	hl = (size_t)(colon - gw->conf.listen);
	if (*end || port < 0 || port > 65535 || colon[1] == 0 || hl >= sizeof(host)) {
		fprintf(stderr, "mlens-gateway: listen '%s': expected HOST:PORT\n", gw->conf.listen);
		return -EINVAL;
	}
	memcpy(host, gw->conf.listen, hl);
	host[hl] = 0;
	if (host[0] == '[' && hl > 2 && host[hl - 1] == ']') {	/* [::1]:8000 */
		memmove(host, host + 1, hl - 2);
		host[hl - 2] = 0;
	}
	gw->http = evhttp_new(gw->base);
	if (!gw->http)
		return -ENOMEM;
	/* bodies a little over max_body still get a JSON 413; far larger
	 * ones are cut off by evhttp with its own 413 */
	evhttp_set_max_body_size(gw->http, (ev_ssize_t)(gw->conf.max_body * 2 + 65536));
	evhttp_set_max_headers_size(gw->http, 65536);
	evhttp_set_timeout(gw->http, IDLE_TIMEOUT_S);
	evhttp_set_allowed_methods(gw->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
				   EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE | EVHTTP_REQ_OPTIONS |
				   EVHTTP_REQ_TRACE | EVHTTP_REQ_CONNECT | EVHTTP_REQ_PATCH);
	evhttp_set_gencb(gw->http, on_request, gw);
	bs = evhttp_bind_socket_with_handle(gw->http, host, (uint16_t)port);
	if (!bs) {
		fprintf(stderr, "mlens-gateway: cannot listen on %s: %s\n", gw->conf.listen,
			strerror(errno));
		return -EADDRINUSE;
	}
	if (!getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl)) {
		if (ss.ss_family == AF_INET)
			port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
		else if (ss.ss_family == AF_INET6)
			port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
	}
	gw_log("serving %s on http://%s%s%s:%ld (mlensd at %s%s)", gw->model_id,
	       strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "", port,
	       gw->conf.socket, gw->keys ? ", API keys required" : "");
	return 0;
}

int main(int argc, char **argv)
{
	struct gw gw = { 0 };
	struct event *sig_term = NULL, *sig_int = NULL, *heartbeat = NULL;
	struct timeval one_s = { 1, 0 };
	int rc, status = 1;

	rc = gw_conf_load(&gw.conf, argc, argv);
	if (rc) {
		gw_conf_free(&gw.conf);
		return rc > 0 ? 0 : 2;
	}
	signal(SIGPIPE, SIG_IGN);
	setvbuf(stderr, NULL, _IOLBF, 0);
	gw.started = (long long)time(NULL);
	{
		struct event_config *cfg = event_config_new();

		/* the client's hang-up is watched with EV_CLOSED */
		if (cfg)
			event_config_require_features(cfg, EV_FEATURE_EARLY_CLOSE);
		gw.base = cfg ? event_base_new_with_config(cfg) : NULL;
		if (cfg)
			event_config_free(cfg);
	}
	if (!gw.base) {
		fprintf(stderr, "mlens-gateway: no event loop with EV_CLOSED (epoll) here\n");
		goto out;
	}
	gw.retry = evtimer_new(gw.base, on_retry, &gw);
	heartbeat = event_new(gw.base, -1, EV_PERSIST, on_heartbeat, &gw);
	sig_term = evsignal_new(gw.base, SIGTERM, on_signal, &gw);
	sig_int = evsignal_new(gw.base, SIGINT, on_signal, &gw);
	if (!gw.retry || !heartbeat || event_add(heartbeat, &one_s) || !sig_term || !sig_int || evsignal_add(sig_term, NULL) ||
	    evsignal_add(sig_int, NULL))
		goto out;
	if (setup_tenants(&gw) || setup_model(&gw) || setup_http(&gw))
		goto out;
	/* attach now so that mlensctl tenants lists us; a daemon not up yet
	 * is attached to on the first request */
	for (size_t i = 0; i < gw.n_tenants; i++) {
		rc = tenant_ready(&gw.tenants[i]);
		if (rc)
			gw_log("cannot attach to mlensd at %s yet: %s", gw.conf.socket,
			       mlens_strerror(rc));
	}
	event_base_dispatch(gw.base);
	status = 0;
out:
	if (gw.http)
		evhttp_free(gw.http);	/* calls still open see their clients go */
	for (size_t i = 0; i < gw.n_tenants; i++) {
		tenant_drop(&gw.tenants[i]);
		free(gw.tenants[i].name);
		free(gw.tenants[i].key);
	}
	free(gw.tenants);
	mlens_textgen_free(gw.text);
	free(gw.model_id);
	if (sig_term)
		event_free(sig_term);
	if (sig_int)
		event_free(sig_int);
	if (gw.retry)
		event_free(gw.retry);
	if (heartbeat)
		event_free(heartbeat);
	if (gw.base)
		event_base_free(gw.base);
	gw_conf_free(&gw.conf);
	return status;
}
