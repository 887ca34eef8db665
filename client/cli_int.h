/* The mlens CLI's JSON lines: one request per input line parsed into a
 * private struct, one result per output line written from one. Kept apart
 * from the CLI's main loop so that tests/check_client can test them. */
#ifndef MLENS_CLI_INT_H
#define MLENS_CLI_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "client/mlens.h"

/* Defaults for fields an input line leaves out. */
#define MLENS_CLI_MAX_TOKENS_DEFAULT 16u

/* One parsed request line. */
struct mlens_cli_req {
	int32_t *prompt;	/* malloc'd */
	uint32_t n_prompt;
	uint32_t max_tokens;
	float temperature;
	float top_p;
	int32_t top_k;
	uint64_t seed;
	int32_t stop[MLENS_REQ_MAX_STOP];
	uint32_t n_stop;
	bool logprobs;
};

/* Parse one line (len bytes, no newline needed). Returns 0, or -EINVAL
 * with a sentence naming the field in err; r is then empty. Fields: prompt
 * (required: a non-empty array of token ids), max_tokens, temperature,
 * top_k, top_p, seed, stop (at most MLENS_REQ_MAX_STOP ids), logprobs; any
 * other key is an error (a misspelt field would otherwise be ignored). */
int mlens_cli_request_parse(const char *line, size_t len, struct mlens_cli_req *r, char *err,
			    size_t errlen);
void mlens_cli_request_free(struct mlens_cli_req *r);
/* The library's request for r (r keeps the prompt). */
void mlens_cli_request_to_api(const struct mlens_cli_req *r, struct mlens_request *req);

/* One result line. */
struct mlens_cli_result {
	size_t index;		/* the input line, from 0 */
	const int32_t *tokens;
	size_t n_tokens;
	const float *logprobs;	/* n_tokens of them, or NULL when not asked */
	uint32_t finish;	/* enum mlens_finish_reason */
	const char *error;	/* when finish is MLENS_REASON_ERROR */
};

/* "length", "stop", "error", "cancelled" (anything else: "error"). */
const char *mlens_cli_finish_name(uint32_t finish);
/* The result as one line of JSON (no newline), malloc'd; NULL if out of
 * memory. */
char *mlens_cli_result_format(const struct mlens_cli_result *r);

/* mlens tokenize (detok false) and mlens detokenize: argv[0] is the
 * subcommand; returns the exit status (client/cli_text.c). */
int mlens_cli_text(int argc, char **argv, bool detok);

#endif
