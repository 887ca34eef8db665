/* The mlens CLI's JSON lines: one request per input line parsed into a
 * private struct, one result per output line written from one. Kept apart
 * from the CLI's main loop so that tests/check_client can test them. */
#ifndef MLENS_CLI_INT_H
#define MLENS_CLI_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "client/mlens.h"
#include "client/textgen.h"

/* Defaults for fields an input line leaves out. */
#define MLENS_CLI_MAX_TOKENS_DEFAULT 16u
/* Most choices an OpenAI line may ask for (its n), as OpenAI allows. */
#define MLENS_CLI_MAX_CHOICES 128
/* Most stop strings a request may name (matched on the decoded text). */
#define MLENS_CLI_MAX_STOP_TEXT 16

/* What a line is: an mlens request, or one of an OpenAI batch file (its
 * url says which endpoint). */
enum mlens_cli_kind {
	MLENS_CLI_NATIVE = 0,
	MLENS_CLI_OAI_COMPLETION,	/* /v1/completions */
	MLENS_CLI_OAI_CHAT,		/* /v1/chat/completions */
};

/* One parsed request line. */
struct mlens_cli_req {
	int32_t *prompt;	/* malloc'd */
	uint32_t n_prompt;
	uint32_t max_tokens;
	bool max_tokens_given;	/* the line set max_tokens */
	float temperature;
	float top_p;
	int32_t top_k;
	uint64_t seed;
	int32_t stop[MLENS_REQ_MAX_STOP];
	uint32_t n_stop;
	bool logprobs;
	bool ignore_eos;	/* generate past the model's EOS ids */
	uint32_t n;		/* choices: an OpenAI line's n, else 1 */
	/* text the model's tokenizer turns into prompt (NULL when the
	 * prompt came as ids); malloc'd */
	char *prompt_text;	/* "prompt" as a string */
	size_t prompt_text_len;
	char *messages;		/* "messages" as compact JSON */
	char *stop_text[MLENS_CLI_MAX_STOP_TEXT];	/* stop strings, not empty */
	uint32_t n_stop_text;
	/* kept when parsing fails, for the error line */
	enum mlens_cli_kind kind;
	char *custom_id;	/* the line's custom_id, or NULL */
	char *model;		/* an OpenAI body's model, echoed in its result */
};

/* The next line of in into *line (grown with getline), its length in *len
 * without the line end (\n, \r\n). 1, 0 at the end of input, -errno when
 * reading failed. */
int mlens_cli_read_line(FILE *in, char **line, size_t *cap, size_t *len);

/* Parse one line (len bytes, no newline needed). Returns 0, or -EINVAL
 * with a sentence naming the field in err; r then holds only kind,
 * custom_id and model (free it all the same). An mlens line's fields:
 * prompt (a non-empty array of token ids or a string) or messages (a chat),
 * max_tokens, temperature, top_k, top_p, seed, stop (at most
 * MLENS_REQ_MAX_STOP ids and MLENS_CLI_MAX_STOP_TEXT strings), logprobs,
 * ignore_eos, custom_id; any other key is an error (a misspelt field would
 * otherwise be ignored). A line with "body" is one of an OpenAI batch file
 * (client/cli_batch.c). */
int mlens_cli_request_parse(const char *line, size_t len, struct mlens_cli_req *r, char *err,
			    size_t errlen);
void mlens_cli_request_free(struct mlens_cli_req *r);
/* The library's request for r (r keeps the prompt). */
void mlens_cli_request_to_api(const struct mlens_cli_req *r, struct mlens_request *req);

/* One result line. */
struct mlens_cli_result {
	size_t index;		/* the input line, from 0 */
	const struct mlens_cli_req *req;	/* kind, custom_id, model; may be NULL */
	uint32_t n_prompt;	/* for an OpenAI result's usage */
	const char *text;	/* decoded, or NULL without a tokenizer */
	size_t text_len;
	const char *const *token_text;	/* each token's text, for OpenAI logprobs */
	const int32_t *tokens;
	size_t n_tokens;
	const float *logprobs;	/* n_tokens of them, or NULL when not asked */
	uint32_t finish;	/* enum mlens_finish_reason */
	const char *error;	/* when finish is MLENS_REASON_ERROR */
	bool bad_request;	/* the error is the request's, not the daemon's */
};

/* "length", "stop", "error", "cancelled" (anything else: "error"). */
const char *mlens_cli_finish_name(uint32_t finish);
/* The result as one line of JSON (no newline), malloc'd; NULL if out of
 * memory. An OpenAI batch line's result is OpenAI's batch output line,
 * with the n choices r[0..n-1] (n is 1 for an mlens line). */
char *mlens_cli_result_format(const struct mlens_cli_result *r, size_t n);
/* A streamed piece of the output of line index (its choice when the line
 * asked for several): tokens and text (text NULL: none), one line of
 * JSON, malloc'd. */
char *mlens_cli_delta_format(size_t index, uint32_t choice, const struct mlens_cli_req *req,
			     const int32_t *tokens, size_t n_tokens, const char *text,
			     size_t text_len);

/* ==== OpenAI batch lines (client/cli_batch.c) ==== */

struct json_t;
/* The request fields of object o (a line, or an OpenAI body: r->kind set
 * says which) into r. 0 or -EINVAL with err. */
int mlens_cli_fields_parse(struct json_t *o, struct mlens_cli_req *r, char *err, size_t errlen);
/* Parse an OpenAI batch input line's object o into r (kind, custom_id,
 * model set even when it fails). 0 or -EINVAL with err. */
int mlens_cli_batch_parse(struct json_t *o, struct mlens_cli_req *r, char *err, size_t errlen);
/* OpenAI's batch output line of the n choices r[0..n-1] of one line. */
struct json_t *mlens_cli_batch_result(const struct mlens_cli_result *r, size_t n);

/* ==== Text through the model's tokenizer (client/cli_model.c) ==== */

/* r's prompt text (BOS added as the tokenizer's config says) or messages
 * (rendered by tg's chat template with the assistant's turn begun; BOS
 * added only when the template did not write it) as r->prompt. 0, -EINVAL
 * with err, -ENOMEM. */
int mlens_cli_model_prompt(const struct mlens_textgen *tg, struct mlens_cli_req *r, char *err,
			   size_t errlen);
/* The text of one token, special or not (malloc'd; NULL out of memory). */
char *mlens_cli_model_token_text(const struct mlens_textgen *tg, int32_t id);

/* mlens tokenize (detok false) and mlens detokenize: argv[0] is the
 * subcommand; returns the exit status (client/cli_text.c). */
int mlens_cli_text(int argc, char **argv, bool detok);

#endif
