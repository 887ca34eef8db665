/* mlens-gateway's private header: its settings, the tenants it holds in
 * mlensd (one libmlens connection per API key), and the HTTP calls in
 * flight, each with one or more choices (one daemon request each). One
 * thread: evhttp and every connection's mlens_fd share one event_base. */
#ifndef MLENS_GATEWAY_INT_H
#define MLENS_GATEWAY_INT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "client/mlens.h"
#include "client/textgen.h"

struct event;
struct event_base;
struct evhttp;
struct evhttp_request;

/* ==== Settings (flags and config keys, gateway_conf.c) ==== */

struct gw_conf {
	char *socket;		/* mlensd's tenant socket */
	char *listen;		/* HOST:PORT */
	char *model;		/* the served model's directory */
	char *tokenizer;	/* where tokenizer.json is, when not in model */
	char *served_model_name;	/* the id in /v1/models */
	char *api_key_file;	/* lines KEY TENANT_NAME; none: no keys */
	size_t max_body;	/* request body bytes */
	uint32_t max_pending;	/* choices a tenant holds waiting for ring room */
	uint32_t max_n;		/* choices a request may ask for */
};

/* Defaults, then --config FILE, then the other flags. 0, 1 (--help or
 * --version printed: exit 0), or -EINVAL with a message on stderr. */
int gw_conf_load(struct gw_conf *c, int argc, char **argv);
void gw_conf_free(struct gw_conf *c);

struct gw_key {
	char *key;
	char *tenant;
};
/* Read an API key file (KEY TENANT_NAME a line, # comments). 0 or -errno
 * with a message naming FILE:LINE on stderr. */
int gw_keys_load(const char *path, struct gw_key **keys, size_t *n);
void gw_keys_free(struct gw_key *keys, size_t n);

/* ==== Tenants, calls and choices (gateway.c) ==== */

#define GW_ID_BUCKETS 256	/* choices in the daemon, by request id */

struct gw_tenant {
	struct gw *gw;
	char *name;		/* the connection's name in mlensd */
	char *key;		/* NULL: no keys configured */
	struct mlens *m;	/* NULL until opened, and after the daemon left */
	struct event *ev;	/* mlens_fd readable */
	struct mlens_limits lim;
	struct gw_choice *by_id[GW_ID_BUCKETS];
	struct gw_choice *pend_head, *pend_tail;	/* waiting for ring room */
	uint32_t n_pending;
};

enum gw_kind { GW_COMPLETION, GW_CHAT };

/* One choice: one daemon request, its tokens and their text. */
struct gw_choice {
	struct gw_call *call;
	uint32_t index;
	const int32_t *prompt;
	uint32_t n_prompt;
	uint64_t seed;
	uint64_t id;		/* the daemon's id; 0 before submission */
	bool pending;		/* in the tenant's pending queue */
	bool in_daemon;		/* submitted, its LAST event not yet read */
	bool done;		/* no more output (finish set) */
	uint32_t finish;	/* enum mlens_finish_reason */
	int status;		/* -errno when finish is MLENS_REASON_ERROR */
	int32_t *tokens;
	float *logprobs;
	size_t n_tokens, cap_tokens;
	size_t n_tokens_sent;	/* streamed so far (logprobs) */
	struct mlens_textgen_text text;	/* decoded so far, a stop string cut off;
					 * text.dt NULL: no tokenizer */
	bool role_sent;		/* chat stream: the first delta went out */
	struct gw_choice *hnext;	/* by_id chain */
	struct gw_choice *qnext;	/* pending queue */
};

/* One HTTP request for completions. */
struct gw_call {
	struct gw *gw;
	struct gw_tenant *t;
	struct evhttp_request *req;	/* NULL once replied or the client left */
	struct event *closed;		/* the client's connection closed */
	enum gw_kind kind;
	char id[48];
	long long created;
	/* parameters */
	bool stream, include_usage, logprobs, return_token_ids, has_seed, ignore_eos;
	int top_logprobs;	/* completions: logprobs N; chat: top_logprobs */
	uint32_t max_tokens;	/* 0: as many as the context allows */
	float temperature, top_p;
	int32_t top_k;
	uint64_t seed;
	int32_t stop_ids[MLENS_REQ_MAX_STOP];
	uint32_t n_stop_ids;
	char **stops;		/* stop strings */
	size_t n_stops;
	/* prompts: n_prompts of them, each used by n choices */
	int32_t **prompts;
	uint32_t *prompt_lens;
	uint32_t n_prompts;
	uint32_t n;
	struct gw_choice *ch;	/* n_prompts * n */
	uint32_t n_ch, n_done;
	bool headers_sent;	/* stream: 200 and the event-stream began */
	bool gone;		/* the client left: nothing more is sent */
	bool failed;		/* an error reply went out (or is going) */
	bool starting;		/* call_start is submitting its choices */
};

struct gw {
	struct gw_conf conf;
	struct event_base *base;
	struct evhttp *http;
	struct event *retry;	/* submit pending choices again */
	struct mlens_textgen *text;	/* NULL: token-id prompts only */
	char *model_id;
	struct gw_tenant *tenants;
	size_t n_tenants;
	bool keys;		/* requests must carry a key */
	long long started;
	uint64_t n_calls;
};

/* ==== OpenAI JSON (gateway_api.c) ==== */

/* An error reply's parts: HTTP status, the OpenAI type, param and code. */
struct gw_err {
	int http;
	const char *type;
	const char *param;	/* may be NULL */
	const char *code;	/* may be NULL */
	char msg[512];
};

void gw_err_set(struct gw_err *e, int http, const char *param, const char *code,
		const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* The error a daemon status (-errno) maps to. */
void gw_err_from_status(struct gw_err *e, int status);
json_t *gw_err_json(const struct gw_err *e);

/* Fill call's parameters and prompts from a completions or chat body. The
 * tenant's limits bound them. 0, or -1 with *e set. */
int gw_call_parse(struct gw *gw, struct gw_call *c, const json_t *body,
		  const struct mlens_limits *lim, struct gw_err *e);
/* Free what call owns (prompts, stops, choices and their output), parsed
 * or not; call itself stays, zeroed. */
void gw_call_clear(struct gw_call *c);

/* The whole reply of a finished call, or a streamed chunk of choice ch
 * (finish: the closing chunk), or the closing usage chunk. */
json_t *gw_call_result(struct gw *gw, const struct gw_call *c);
json_t *gw_chunk(struct gw *gw, const struct gw_call *c, const struct gw_choice *ch,
		 size_t text_from, size_t text_to, bool finish);
json_t *gw_usage_chunk(struct gw *gw, const struct gw_call *c);

/* The text of one token for logprobs (a new string). */
char *gw_token_str(struct gw *gw, int32_t tok);

/* /tokenize and /detokenize replies. */
json_t *gw_tokenize(struct gw *gw, const json_t *body, const struct mlens_limits *lim,
		    struct gw_err *e);
json_t *gw_detokenize(struct gw *gw, const json_t *body, struct gw_err *e);

#endif
