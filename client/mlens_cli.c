/* mlens: the batch client. `mlens generate` reads requests as JSON lines
 * (token ids, or text and chats through the model directory's tokenizer
 * and chat template; mlens lines or OpenAI batch lines), keeps as many of
 * them running in mlensd through libmlens as the daemon can take (or
 * --max-inflight), and writes one result line per input line, in input
 * order (with --stream, delta lines as tokens come), with a progress bar
 * and a closing summary on stderr. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "client/cli_int.h"
#include "client/mlens.h"

/* Exit statuses (documented in mlens(1)). */
#define EXIT_ALL_OK 0
#define EXIT_SOME_FAILED 1
#define EXIT_TROUBLE 2
/* interrupted: 128 + the signal (130 SIGINT, 143 SIGTERM) */

#define DEFAULT_SOCKET "/run/mlens/mlensd.sock"
#define MAX_INFLIGHT 1000000
/* in flight when the daemon does not say what it can run (an older one) */
#define FALLBACK_INFLIGHT 64
#define EVENT_BATCH 256
/* after an interrupt, how long cancelled requests get to report their end */
#define CANCEL_WAIT_S 5.0

enum job_state { JOB_PARSED, JOB_RUNNING, JOB_DONE };

struct job {
	enum job_state state;
	size_t line;		/* the input line, from 0 */
	uint32_t choice, n_choices;	/* an OpenAI line's n: one job a choice */
	struct mlens_cli_req req;
	int32_t *tokens;
	float *logprobs;
	size_t n_tokens, cap;
	uint32_t finish;
	char *error;
	bool bad_request;	/* the error is the line's, not the daemon's */
	bool has_text;		/* text holds the decoded tokens (--model) */
	struct mlens_textgen_text text;
	size_t tokens_sent;	/* streamed so far */
	uint64_t id;		/* libmlens's, once submitted */
	double t_submit;
	double ttft;		/* seconds to the first token; < 0 when none came */
};

struct run {
	struct mlens *m;
	struct mlens_limits lim;
	FILE *in;
	int out_fd;
	bool out_regular;	/* a failed write can be cut back to a whole line */
	off_t out_off;		/* bytes of whole lines written */
	const char *out_name;
	struct job *jobs;
	size_t n_jobs, cap_jobs;
	size_t next_submit, next_write;
	size_t n_lines, lines_written;
	size_t *line_of_id;	/* by id - 1: ids are issued 1, 2, 3, ... */
	size_t cap_ids;
	uint64_t n_ids;
	size_t inflight, max_inflight, most_inflight;
	bool eof, lost, progress, write_failed;
	size_t total_lines;	/* for the progress bar; 0 when unknown */
	double t_start, t_last_bar;
	uint64_t prompt_tokens, generated;
	size_t ok, failed;
	struct mlens_textgen *model;	/* --model: text prompts and results */
	bool stream;		/* --stream: delta lines as tokens come */
	char *line;
	size_t line_cap;
};

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: mlens generate [-s SOCKET] [-m DIR] -i IN.jsonl -o OUT.jsonl [--stream]\n"
		"                      [--max-inflight N] [--quiet]\n"
		"       mlens tokenize --model DIR [--add-special] [-i IN.jsonl] [-o OUT.jsonl]\n"
		"       mlens detokenize --model DIR [--skip-special] [-i IN.jsonl] [-o OUT.jsonl]\n"
		"       mlens --help | --version\n"
		"\n"
		"  -s, --socket PATH       mlensd's tenant socket (default $MLENS_SOCKET, else %s)\n"
		"  -i, --input FILE        requests, one JSON object a line ('-': stdin)\n"
		"  -o, --output FILE       results, one a line, in input order ('-': stdout)\n"
		"  -m, --model DIR         the model directory's tokenizer.json and chat template:\n"
		"                          text prompts, chats, stop strings, \"text\" in results\n"
		"      --stream            also write {\"index\", \"delta\": {tokens, text}} lines as\n"
		"                          tokens come\n"
		"  -n, --max-inflight N    requests in flight at once (default: as many as mlensd\n"
		"                          can run for this tenant, twice over, within its queue quota)\n"
		"  -q, --quiet             no progress bar and no summary\n"
		"\n"
		"A request line: {\"prompt\": [ids] or \"text\" (or \"messages\": [chat]), \"max_tokens\": 16,\n"
		"  \"temperature\": 0, \"top_k\": 0, \"top_p\": 1, \"seed\": 0, \"stop\": [ids, \"text\"],\n"
		"  \"logprobs\": false, \"ignore_eos\": false, \"custom_id\": \"...\"} (all but the prompt\n"
		"  optional), or an OpenAI batch line {\"custom_id\", \"method\": \"POST\", \"url\":\n"
		"  \"/v1/completions\" or \"/v1/chat/completions\", \"body\"}.\n"
		"  Generation ends at the model's EOS unless ignore_eos.\n"
		"Exit status: 0 all requests completed, 1 some failed, 2 usage, file or daemon trouble,\n"
		"130 interrupted (SIGINT; 143 SIGTERM): unfinished requests are reported \"cancelled\".\n",
		DEFAULT_SOCKET);
}

/* ==== Signals ==== */

/* The signal that asked mlens to stop (0: none). The first lets the run
 * cancel what is in flight and still write every result; a second exits at
 * once (the output holds whole lines only: each is one write). */
static volatile sig_atomic_t stop_signal;

static void on_stop_signal(int sig)
{
	if (stop_signal)
		_exit(128 + sig);
	stop_signal = sig;
}

/* Without SA_RESTART, so that a wait returns early to notice it. A SIGINT
 * ignored from the start stays ignored: a shell's background job is not
 * meant to hear the terminal's Ctrl-C. */
static void catch_stop_signals(void)
{
	struct sigaction sa, old;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_stop_signal;
	sigemptyset(&sa.sa_mask);
	if (!sigaction(SIGINT, NULL, &old) && old.sa_handler != SIG_IGN)
		sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
}

/* ==== Jobs ==== */

static int write_line(struct run *rn, char *s);

/* Settle job j with finish (an error or a cancel); why for errors. */
static void job_end(struct run *rn, struct job *j, uint32_t finish, const char *why)
{
	if (j->state == JOB_RUNNING)
		rn->inflight--;
	j->state = JOB_DONE;
	j->finish = finish;
	free(j->error);
	j->error = why ? strdup(why) : NULL;
}

static void job_fail(struct run *rn, struct job *j, const char *why)
{
	job_end(rn, j, MLENS_REASON_ERROR, why);
}

/* The line asked for something wrong: an error of the request. */
static void job_refuse(struct run *rn, struct job *j, const char *why)
{
	job_fail(rn, j, why);
	j->bad_request = true;
}

static void job_release(struct job *j)
{
	mlens_cli_request_free(&j->req);
	mlens_textgen_text_free(&j->text);
	free(j->tokens);
	free(j->logprobs);
	free(j->error);
	j->tokens = NULL;
	j->logprobs = NULL;
	j->error = NULL;
}

/* Turn job j's text prompt or chat into token ids, and start decoding
 * its tokens when there is a tokenizer. 0, or the job is refused with
 * why; -ENOMEM. */
static int job_prepare(struct run *rn, struct job *j, char *why, size_t len)
{
	struct mlens_cli_req *r = &j->req;
	int rc;

	if (!rn->model) {
		if (r->prompt_text || r->messages || r->n_stop_text) {
			snprintf(why, len, "%s is text: mlens generate needs --model DIR (the model "
				 "directory with tokenizer.json) for it", r->messages ? "messages" :
				 r->prompt_text ? "prompt" : "stop");
			return -EINVAL;
		}
		return 0;
	}
	rc = mlens_cli_model_prompt(rn->model, r, why, len);
	if (rc)
		return rc;
	if (mlens_textgen_text_init(&j->text, rn->model))
		return -ENOMEM;
	j->has_text = true;
	return 0;
}

static int job_add_token(struct job *j, int32_t tok, float lp)
{
	if (j->n_tokens == j->cap) {
		size_t cap = j->cap ? j->cap * 2 : 16;
		int32_t *t = realloc(j->tokens, cap * sizeof(*t));

		if (!t)
			return -ENOMEM;
		j->tokens = t;
		if (j->req.logprobs) {
			float *l = realloc(j->logprobs, cap * sizeof(*l));

			if (!l)
				return -ENOMEM;
			j->logprobs = l;
		}
		j->cap = cap;
	}
	j->tokens[j->n_tokens] = tok;
	if (j->req.logprobs)
		j->logprobs[j->n_tokens] = lp;
	j->n_tokens++;
	return 0;
}

/* A copy of request r's generation fields for another choice of its line
 * (the line's names stay with the first). 0 or -ENOMEM. */
static int request_copy(struct mlens_cli_req *c, const struct mlens_cli_req *r)
{
	*c = *r;
	c->prompt_text = c->messages = c->custom_id = c->model = NULL;
	c->n_stop_text = 0;
	c->prompt = malloc(r->n_prompt * sizeof(*r->prompt));
	if (!c->prompt)
		return -ENOMEM;
	memcpy(c->prompt, r->prompt, r->n_prompt * sizeof(*r->prompt));
	for (uint32_t i = 0; i < r->n_stop_text; i++) {
		if (!(c->stop_text[i] = strdup(r->stop_text[i])))
			return -ENOMEM;
		c->n_stop_text++;
	}
	return 0;
}

/* Read the next input line into a new job (one a choice). Returns 1, 0 at
 * end of input, -errno. */
static int read_job(struct run *rn)
{
	char err[512];
	struct job *j;
	size_t len;
	int rc;

	rc = mlens_cli_read_line(rn->in, &rn->line, &rn->line_cap, &len);
	if (rc <= 0) {
		rn->eof = !rc;
		return rc;
	}
	/* room for the most choices a line may ask for */
	if (rn->n_jobs + MLENS_CLI_MAX_CHOICES > rn->cap_jobs) {
		size_t cap = rn->cap_jobs ? rn->cap_jobs * 2 : 256;
		struct job *nj = realloc(rn->jobs, cap * sizeof(*nj));

		if (!nj)
			return -ENOMEM;
		rn->jobs = nj;
		rn->cap_jobs = cap;
	}
	j = &rn->jobs[rn->n_jobs++];
	memset(j, 0, sizeof(*j));
	j->ttft = -1;
	j->state = JOB_PARSED;
	j->line = rn->n_lines++;
	j->n_choices = 1;
	rc = mlens_cli_request_parse(rn->line, len, &j->req, err, sizeof(err));
	if (!rc)
		rc = job_prepare(rn, j, err, sizeof(err));
	if (rc == -ENOMEM)
		return rc;
	if (rc) {
		job_refuse(rn, j, err);
		return 1;
	}
	/* the other choices: the same request, seeded apart */
	for (uint32_t k = 1; k < j->req.n; k++) {
		struct job *c = &rn->jobs[rn->n_jobs++];

		memset(c, 0, sizeof(*c));
		c->ttft = -1;
		c->state = JOB_PARSED;
		c->line = j->line;
		c->choice = k;
		if (request_copy(&c->req, &j->req) ||
		    (j->has_text && mlens_textgen_text_init(&c->text, rn->model)))
			return -ENOMEM;
		c->has_text = j->has_text;
		c->req.seed += k;
	}
	for (uint32_t k = 0; k < j->req.n; k++)
		j[k].n_choices = j->req.n;
	return 1;
}

/* Is r above the daemon's limits? why gets words a person can act on. */
static bool over_limits(const struct run *rn, const struct mlens_cli_req *r, char *why,
			size_t len)
{
	const struct mlens_limits *l = &rn->lim;

	if (r->n_prompt > l->max_prompt_tokens)
		snprintf(why, len, "prompt has %u tokens; mlensd accepts at most %u", r->n_prompt,
			 l->max_prompt_tokens);
	else if (r->max_tokens > l->max_tokens)
		snprintf(why, len, "max_tokens %u above mlensd's limit of %u", r->max_tokens,
			 l->max_tokens);
	else if ((uint64_t)r->n_prompt + r->max_tokens > l->max_context)
		snprintf(why, len, "prompt (%u tokens) + max_tokens (%u) above the context of %u",
			 r->n_prompt, r->max_tokens, l->max_context);
	else if (r->top_k > 0 && (uint32_t)r->top_k > l->vocab_size)
		snprintf(why, len, "top_k %d above the vocabulary size %u", r->top_k, l->vocab_size);
	else if (r->temperature > 100.0f)
		snprintf(why, len, "temperature %g above 100", (double)r->temperature);
	else {
		for (uint32_t i = 0; i < r->n_prompt; i++)
			if ((uint32_t)r->prompt[i] >= l->vocab_size) {
				snprintf(why, len, "prompt[%u] is %d, outside the vocabulary of %u", i,
					 r->prompt[i], l->vocab_size);
				return true;
			}
		for (uint32_t i = 0; i < r->n_stop; i++)
			if ((uint32_t)r->stop[i] >= l->vocab_size) {
				snprintf(why, len, "stop[%u] is %d, outside the vocabulary of %u", i,
					 r->stop[i], l->vocab_size);
				return true;
			}
		return false;
	}
	return true;
}

/* Submit job j. Returns 1 submitted or settled (an error result), 0 when
 * the rings are full (try again later), -ECONNRESET when the daemon left,
 * -errno. */
static int submit_job(struct run *rn, struct job *j)
{
	struct mlens_request req;
	char why[256];
	uint64_t id;
	int rc;

	/* an OpenAI line without a limit generates up to the context's end
	 * (or the EOS), as OpenAI and vLLM do */
	if (j->req.kind != MLENS_CLI_NATIVE && !j->req.max_tokens_given &&
	    j->req.n_prompt < rn->lim.max_context) {
		uint32_t room = rn->lim.max_context - j->req.n_prompt;

		j->req.max_tokens = room < rn->lim.max_tokens ? room : rn->lim.max_tokens;
	}
	if (over_limits(rn, &j->req, why, sizeof(why))) {
		job_refuse(rn, j, why);
		return 1;
	}
	mlens_cli_request_to_api(&j->req, &req);
	req.timeout_ms = 0;
	rc = mlens_submit(rn->m, &req, &id);
	if (rc == -EAGAIN)
		return 0;
	if (rc == -ECONNRESET || rc == -ENOMEM)
		return rc;
	if (rc < 0) {
		job_refuse(rn, j, mlens_strerror(rc));
		return 1;
	}
	if (id != rn->n_ids + 1) {
		/* the library issues ids 1, 2, 3...; anything else is a bug */
		fprintf(stderr, "mlens: libmlens returned request id %llu, expected %llu\n",
			(unsigned long long)id, (unsigned long long)rn->n_ids + 1);
		return -EPROTO;
	}
	if (rn->n_ids == rn->cap_ids) {
		size_t cap = rn->cap_ids ? rn->cap_ids * 2 : 256;
		size_t *nl = realloc(rn->line_of_id, cap * sizeof(*nl));

		if (!nl)
			return -ENOMEM;
		rn->line_of_id = nl;
		rn->cap_ids = cap;
	}
	rn->line_of_id[rn->n_ids++] = (size_t)(j - rn->jobs);
	j->state = JOB_RUNNING;
	j->id = id;
	j->t_submit = now_s();
	if (++rn->inflight > rn->most_inflight)
		rn->most_inflight = rn->inflight;
	rn->prompt_tokens += j->req.n_prompt;
	return 1;
}

/* --stream: the tokens and the stop-safe text of job j not yet written,
 * as one delta line (none when there is nothing new). */
static int stream_delta(struct run *rn, struct job *j)
{
	size_t t0 = j->tokens_sent, x0 = j->text.sent, x1 = j->has_text ? j->text.safe : 0;
	char *s;

	if (!rn->stream || (t0 == j->n_tokens && x1 <= x0))
		return 0;
	if (x1 < x0)
		x1 = x0;
	/* the line's first choice holds its names */
	s = mlens_cli_delta_format(j->line, j->choice, &(j - j->choice)->req, j->tokens + t0,
				   j->n_tokens - t0,
				   j->has_text ? j->text.buf + x0 : NULL, x1 - x0);
	if (!s || write_line(rn, s))
		return -ENOMEM;
	j->tokens_sent = j->n_tokens;
	j->text.sent = x1;
	return 0;
}

/* A token of job j: into its tokens and text; a stop string met cancels
 * the request in the daemon, so that no step is spent past it. */
static int job_token(struct run *rn, struct job *j, const struct mlens_event *e)
{
	int rc;

	if (j->text.stopped)
		return 0;	/* generated before the cancel arrived */
	if (j->ttft < 0)
		j->ttft = now_s() - j->t_submit;
	if (job_add_token(j, e->token, e->logprob))
		return -ENOMEM;
	rn->generated++;
	if (!j->has_text)
		return 0;
	rc = mlens_textgen_text_push(&j->text, j->req.stop_text, j->req.n_stop_text, e->token);
	if (rc < 0)
		return rc;
	if (rc == 1 && !(e->flags & MLENS_EV_LAST) && mlens_cancel(rn->m, j->id) == -ECONNRESET)
		rn->lost = true;
	return 0;
}

/* Job j has ended: its text is complete, a stop string met makes it a
 * "stop" however the daemon ended it, and a stream gets the rest. */
static int job_settle_text(struct run *rn, struct job *j)
{
	int rc;

	if (!j->has_text)
		return stream_delta(rn, j);
	rc = mlens_textgen_text_finish(&j->text, j->req.stop_text, j->req.n_stop_text);
	if (rc < 0)
		return rc;
	if (j->text.stopped && j->finish != MLENS_REASON_ERROR)
		j->finish = MLENS_REASON_STOP;
	return stream_delta(rn, j);
}

static int handle_event(struct run *rn, const struct mlens_event *e)
{
	struct job *j;
	int rc;

	if (e->id == 0 || e->id > rn->n_ids)
		return 0;	/* not ours: nothing to attach it to */
	j = &rn->jobs[rn->line_of_id[e->id - 1]];
	if (j->state != JOB_RUNNING)
		return 0;
	if ((e->flags & MLENS_EV_TOKEN) && (rc = job_token(rn, j, e)))
		return rc;
	if (e->flags & MLENS_EV_LAST) {
		if (e->finish == MLENS_REASON_ERROR) {
			job_fail(rn, j, mlens_event_strerror(rn->m, e));
		} else {
			j->state = JOB_DONE;
			j->finish = e->finish;
			rn->inflight--;
		}
		return job_settle_text(rn, j);
	}
	return stream_delta(rn, j);
}

/* Write one result line (s, malloc'd, taken) with one write: a reader, a
 * crash or a second interrupt never leaves part of a line. A failed write
 * is cut back to the last whole line where the output is a file. */
static int write_line(struct run *rn, char *s)
{
	size_t len = strlen(s), done = 0;
	char *line = realloc(s, len + 2);
	ssize_t n;

	if (!line) {
		free(s);
		return -ENOMEM;
	}
	line[len++] = '\n';
	while (!rn->write_failed && done < len) {
		n = write(rn->out_fd, line + done, len - done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			rn->write_failed = true;
			fprintf(stderr, "mlens: cannot write %s: %s\n", rn->out_name,
				n < 0 ? strerror(errno) : "nothing written");
			if (rn->out_regular && (ftruncate(rn->out_fd, rn->out_off) ||
						lseek(rn->out_fd, rn->out_off, SEEK_SET) < 0))
				fprintf(stderr, "mlens: %s may end in part of a line: %s\n",
					rn->out_name, strerror(errno));
			break;
		}
		done += (size_t)n;
	}
	if (!rn->write_failed)
		rn->out_off += (off_t)len;
	free(line);
	return 0;
}

/* Each token's own text (for OpenAI logprobs), or NULL out of memory. */
static char **token_texts(const struct mlens_textgen *m, const int32_t *tokens, size_t n)
{
	char **tt = calloc(n ? n : 1, sizeof(*tt));

	for (size_t i = 0; tt && i < n; i++)
		if (!(tt[i] = mlens_cli_model_token_text(m, tokens[i]))) {
			while (i--)
				free(tt[i]);
			free(tt);
			return NULL;
		}
	return tt;
}

/* Fill r with job j's result: its text complete, token texts for OpenAI
 * logprobs in *tt (free with free_token_texts). 0 or -errno. */
static int job_result(struct run *rn, struct job *j, struct mlens_cli_result *r, char ***tt)
{
	int rc;

	*tt = NULL;
	/* a request that ended without its LAST event (cancelled at an
	 * interrupt, or the daemon gone) has its text completed here */
	if ((rc = job_settle_text(rn, j)))
		return rc;
	memset(r, 0, sizeof(*r));
	r->index = j->line;
	r->req = &j->req;
	r->n_prompt = j->req.n_prompt;
	r->tokens = j->tokens;
	r->n_tokens = j->n_tokens;
	r->logprobs = j->req.logprobs ? j->logprobs : NULL;
	r->finish = j->finish;
	r->error = j->error;
	r->bad_request = j->bad_request;
	if (j->has_text && j->finish != MLENS_REASON_ERROR) {
		r->text = j->text.buf;
		r->text_len = j->text.len;
	}
	if (r->logprobs && rn->model && j->req.kind != MLENS_CLI_NATIVE &&
	    !(*tt = token_texts(rn->model, j->tokens, j->n_tokens)))
		return -ENOMEM;
	r->token_text = (const char *const *)*tt;
	return 0;
}

static void free_token_texts(char **tt, size_t n)
{
	for (size_t i = 0; tt && i < n; i++)
		free(tt[i]);
	free(tt);
}

/* Write the results that are next in input order: a line's once all its
 * choices are done. */
static int flush_results(struct run *rn)
{
	struct mlens_cli_result rs[MLENS_CLI_MAX_CHOICES];
	char **tts[MLENS_CLI_MAX_CHOICES];

	while (rn->next_write < rn->n_jobs) {
		struct job *j = &rn->jobs[rn->next_write];
		size_t n = j->n_choices, k;
		bool ok = true;
		char *s;
		int rc = 0;

		for (k = 0; k < n; k++)
			if (j[k].state != JOB_DONE)
				return 0;
		memset(tts, 0, n * sizeof(*tts));
		for (k = 0; k < n && !rc; k++)
			rc = job_result(rn, &j[k], &rs[k], &tts[k]);
		s = rc ? NULL : mlens_cli_result_format(rs, n);
		for (k = 0; k < n; k++)
			free_token_texts(tts[k], j[k].n_tokens);
		if (rc)
			return rc;
		if (!s || write_line(rn, s))
			return -ENOMEM;
		for (k = 0; k < n; k++) {
			ok &= j[k].finish == MLENS_REASON_LENGTH || j[k].finish == MLENS_REASON_STOP;
			job_release(&j[k]);
		}
		if (ok)
			rn->ok++;
		else
			rn->failed++;
		rn->lines_written++;
		rn->next_write += n;
	}
	return 0;
}

/* ==== Progress and summary ==== */

static void progress(struct run *rn, bool final)
{
	double t = now_s(), el = t - rn->t_start;
	size_t done = rn->lines_written;
	char bar[41];

	if (!rn->progress || (!final && t - rn->t_last_bar < 0.2))
		return;
	rn->t_last_bar = t;
	if (rn->total_lines) {
		size_t fill = done >= rn->total_lines ? 40 : done * 40 / rn->total_lines;

		memset(bar, '#', fill);
		memset(bar + fill, '.', 40 - fill);
		bar[40] = 0;
		fprintf(stderr, "\r[%s] %zu/%zu  %zu running  %.0f tok/s ", bar, done,
			rn->total_lines, rn->inflight, el > 0 ? rn->generated / el : 0.0);
	} else {
		fprintf(stderr, "\r%zu done  %zu running  %.0f tok/s ", done, rn->inflight,
			el > 0 ? rn->generated / el : 0.0);
	}
	if (final)
		fputc('\n', stderr);
	fflush(stderr);
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of n sorted values. */
static double percentile(const double *v, size_t n, double p)
{
	size_t k = (size_t)ceil(p / 100.0 * (double)n);

	return v[k ? k - 1 : 0];
}

static void summary(struct run *rn, const double *ttft, size_t n_ttft)
{
	double el = now_s() - rn->t_start;

	fprintf(stderr, "mlens: %zu requests (%zu completed, %zu failed), %llu prompt tokens, "
		"%llu generated tokens in %.2f s: %.1f tokens/s\n", rn->lines_written, rn->ok,
		rn->failed, (unsigned long long)rn->prompt_tokens,
		(unsigned long long)rn->generated, el, el > 0 ? rn->generated / el : 0.0);
	if (n_ttft)
		fprintf(stderr, "mlens: time to first token: p50 %.1f ms, p99 %.1f ms (%zu requests)\n",
			percentile(ttft, n_ttft, 50) * 1e3, percentile(ttft, n_ttft, 99) * 1e3,
			n_ttft);
	fprintf(stderr, "mlens: up to %zu requests in flight (limit %zu)\n", rn->most_inflight,
		rn->max_inflight);
}

/* Lines in a regular file (the progress bar's total), then rewind. */
static size_t count_lines(FILE *f)
{
	struct stat st;
	size_t n = 0, len;
	char buf[65536];
	bool partial = false;

	if (fstat(fileno(f), &st) || !S_ISREG(st.st_mode))
		return 0;
	while ((len = fread(buf, 1, sizeof(buf), f)) > 0) {
		for (size_t i = 0; i < len; i++)
			n += buf[i] == '\n';
		partial = buf[len - 1] != '\n';
	}
	rewind(f);
	return n + partial;
}

/* ==== Main loop ==== */

/* Keep max_inflight requests running, read events, write results. */
static int generate_loop(struct run *rn)
{
	struct mlens_event evs[EVENT_BATCH];
	int rc, n;

	for (;;) {
		bool ring_full = false;

		if (stop_signal)
			return -EINTR;
		while (!rn->lost && rn->inflight < rn->max_inflight) {
			if (rn->next_submit == rn->n_jobs) {
				if (rn->eof)
					break;
				rc = read_job(rn);
				if (rc < 0)
					return rc;
				if (rc == 0)
					break;
			}
			struct job *j = &rn->jobs[rn->next_submit];

			if (j->state == JOB_PARSED) {
				rc = submit_job(rn, j);
				if (rc == -ECONNRESET) {
					rn->lost = true;
					break;
				}
				if (rc < 0)
					return rc;
				if (rc == 0) {
					ring_full = true;
					break;
				}
			}
			rn->next_submit++;
		}
		if ((rc = flush_results(rn)))
			return rc;
		progress(rn, false);
		if (rn->lost)
			return -ECONNRESET;
		if (rn->eof && rn->next_submit == rn->n_jobs && rn->inflight == 0)
			return 0;
		/* A full ring frees as the daemon takes entries, which rings
		 * no event: look again soon. */
		n = mlens_wait(rn->m, evs, EVENT_BATCH, ring_full ? 5 : rn->inflight ? 200 : 0);
		if (n == -ECONNRESET) {
			rn->lost = true;
			continue;
		}
		if (n < 0)
			return n;
		for (int i = 0; i < n; i++)
			if ((rc = handle_event(rn, &evs[i])))
				return rc;
	}
}

/* Every request not yet finished, and every line not yet read (up to
 * max_lines more), ends with finish (why for errors), so that the output
 * still has one line per input line. */
static int settle_rest(struct run *rn, uint32_t finish, const char *why, size_t max_lines)
{
	int rc;

	for (;;) {
		for (size_t i = rn->next_write; i < rn->n_jobs; i++)
			if (rn->jobs[i].state != JOB_DONE)
				job_end(rn, &rn->jobs[i], finish, why);
		rn->next_submit = rn->n_jobs;
		if ((rc = flush_results(rn)))
			return rc;
		if (rn->eof || !max_lines--)
			return 0;
		rc = read_job(rn);
		if (rc < 0)
			return rc;
	}
}

/* After the daemon left: every unfinished request is an error. */
static int settle_lost(struct run *rn)
{
	return settle_rest(rn, MLENS_REASON_ERROR, mlens_strerror(-ECONNRESET), SIZE_MAX);
}

/* After SIGINT or SIGTERM: cancel what runs and let the daemon say how each
 * ended (for a while); what never ran, and the rest of an input file, is
 * "cancelled". A pipe or terminal is not read further: it may never end. */
static int settle_interrupted(struct run *rn)
{
	struct mlens_event evs[EVENT_BATCH];
	struct stat st;
	double until = now_s() + CANCEL_WAIT_S;
	int rc = 0, n;

	fprintf(stderr, "\nmlens: %s: cancelling %zu running requests (again to quit at once)\n",
		strsignal(stop_signal), rn->inflight);
	for (size_t i = rn->next_write; i < rn->n_jobs && !rn->lost; i++) {
		struct job *j = &rn->jobs[i];

		if (j->state == JOB_RUNNING && mlens_cancel(rn->m, j->id) == -ECONNRESET)
			rn->lost = true;
	}
	while (!rn->lost && rn->inflight && now_s() < until) {
		n = mlens_wait(rn->m, evs, EVENT_BATCH, 100);
		if (n < 0) {
			rn->lost = n == -ECONNRESET;
			break;
		}
		for (int i = 0; i < n && !rc; i++)
			rc = handle_event(rn, &evs[i]);
		if (rc)
			return rc;
	}
	return settle_rest(rn, MLENS_REASON_CANCELLED, NULL,
			   !fstat(fileno(rn->in), &st) && S_ISREG(st.st_mode) ? SIZE_MAX : 0);
}

/* How many requests to keep in flight unless -n says: every sequence the
 * daemon can run for this tenant, and as many again waiting to take a
 * finished one's place; never more than its queue quota, since all may
 * arrive before any is admitted. */
static size_t inflight_from_limits(const struct mlens_limits *l)
{
	uint64_t n = 2ull * l->max_running;

	if (!l->max_running)
		return FALLBACK_INFLIGHT;
	if (l->max_queued && n > l->max_queued)
		n = l->max_queued;
	return n > MAX_INFLIGHT ? MAX_INFLIGHT : n ? (size_t)n : 1;
}

static int cmd_generate(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "input", required_argument, NULL, 'i' },
		{ "output", required_argument, NULL, 'o' },
		{ "max-inflight", required_argument, NULL, 'n' },
		{ "model", required_argument, NULL, 'm' },
		{ "stream", no_argument, NULL, 'S' },
		{ "quiet", no_argument, NULL, 'q' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *sock = getenv("MLENS_SOCKET"), *in_name = NULL, *out_name = NULL, *dir = NULL;
	struct stat st;
	struct run rn;
	bool quiet = false, interrupted = false;
	double *ttft = NULL;
	size_t n_ttft = 0;
	long v;
	char *end, err[1024];
	int c, rc, status = EXIT_TROUBLE;

	memset(&rn, 0, sizeof(rn));
	rn.out_fd = -1;
	if (!sock || !*sock)
		sock = DEFAULT_SOCKET;
	while ((c = getopt_long(argc, argv, "s:i:o:n:m:qh", opts, NULL)) != -1) {
		switch (c) {
		case 's':
			sock = optarg;
			break;
		case 'i':
			in_name = optarg;
			break;
		case 'o':
			out_name = optarg;
			break;
		case 'n':
			errno = 0;
			v = strtol(optarg, &end, 10);
			if (errno || *end || v < 1 || v > MAX_INFLIGHT) {
				fprintf(stderr, "mlens: --max-inflight %s: want a number from 1 to "
					"%d\n", optarg, MAX_INFLIGHT);
				return EXIT_TROUBLE;
			}
			rn.max_inflight = (size_t)v;
			break;
		case 'm':
			dir = optarg;
			break;
		case 'S':
			rn.stream = true;
			break;
		case 'q':
			quiet = true;
			break;
		case 'h':
			usage(stdout);
			return EXIT_ALL_OK;
		default:
			usage(stderr);
			return EXIT_TROUBLE;
		}
	}
	if (optind != argc || !in_name || !out_name) {
		fprintf(stderr, "mlens generate: %s\n", optind != argc ?
			"unexpected argument" : "-i IN.jsonl and -o OUT.jsonl are required");
		usage(stderr);
		return EXIT_TROUBLE;
	}

	if (dir && mlens_textgen_open(dir, &rn.model, err, sizeof(err))) {
		fprintf(stderr, "mlens generate: --model %s: %s\n", dir, err);
		return EXIT_TROUBLE;
	}

	/* from here on an interrupt still gives every line read a result */
	catch_stop_signals();
	rn.in = strcmp(in_name, "-") ? fopen(in_name, "r") : stdin;
	if (!rn.in) {
		fprintf(stderr, "mlens: cannot read %s: %s\n", in_name, strerror(errno));
		mlens_textgen_free(rn.model);
		return EXIT_TROUBLE;
	}
	rn.out_name = out_name;
	rn.out_fd = strcmp(out_name, "-") ? open(out_name, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
						 0666) : STDOUT_FILENO;
	if (rn.out_fd < 0) {
		fprintf(stderr, "mlens: cannot write %s: %s\n", out_name, strerror(errno));
		goto close_in;
	}
	rn.out_regular = !fstat(rn.out_fd, &st) && S_ISREG(st.st_mode);
	rn.out_off = rn.out_regular ? lseek(rn.out_fd, 0, SEEK_CUR) : 0;
	if (rn.out_off < 0)
		rn.out_off = 0;
	rn.progress = !quiet && isatty(STDERR_FILENO);
	if (rn.progress)
		rn.total_lines = count_lines(rn.in);

	rc = mlens_open(sock, "mlens", &rn.m);
	if (rc) {
		fprintf(stderr, "mlens: cannot attach to mlensd at %s: %s\n", sock,
			mlens_strerror(rc));
		goto close_out;
	}
	rn.lim.size = sizeof(rn.lim);
	rc = mlens_limits(rn.m, &rn.lim);
	if (rc) {
		fprintf(stderr, "mlens: cannot read mlensd's limits: %s\n", mlens_strerror(rc));
		goto close_m;
	}
	if (!rn.max_inflight)
		rn.max_inflight = inflight_from_limits(&rn.lim);

	rn.t_start = now_s();
	rc = generate_loop(&rn);
	interrupted = rc == -EINTR;
	if (interrupted)
		rc = settle_interrupted(&rn);
	if (rc == -ECONNRESET) {
		fprintf(stderr, "\nmlens: %s; unfinished requests are reported as errors\n",
			mlens_strerror(rc));
		rc = settle_lost(&rn);
		if (!rc)
			rc = -ECONNRESET;
	}
	progress(&rn, true);
	if (rc && rc != -ECONNRESET)
		fprintf(stderr, "mlens: stopped after %zu results: %s\n", rn.lines_written,
			mlens_strerror(rc));

	ttft = malloc((rn.n_jobs ? rn.n_jobs : 1) * sizeof(*ttft));
	for (size_t i = 0; ttft && i < rn.n_jobs; i++)
		if (rn.jobs[i].ttft >= 0)
			ttft[n_ttft++] = rn.jobs[i].ttft;
	if (ttft)
		qsort(ttft, n_ttft, sizeof(*ttft), cmp_double);
	if (!quiet)
		summary(&rn, ttft, n_ttft);
	if (!rc && !rn.write_failed)
		status = interrupted ? 128 + stop_signal :
			 rn.failed ? EXIT_SOME_FAILED : EXIT_ALL_OK;
	free(ttft);
close_m:
	mlens_close(rn.m);
close_out:
	if (rn.out_fd != STDOUT_FILENO && close(rn.out_fd)) {
		fprintf(stderr, "mlens: cannot write %s: %s\n", out_name, strerror(errno));
		status = EXIT_TROUBLE;
	}
close_in:
	if (rn.in != stdin)
		fclose(rn.in);
	for (size_t i = rn.next_write; i < rn.n_jobs; i++)
		job_release(&rn.jobs[i]);
	mlens_textgen_free(rn.model);
	free(rn.jobs);
	free(rn.line_of_id);
	free(rn.line);
	return status;
}

int main(int argc, char **argv)
{
	if (argc >= 2 && !strcmp(argv[1], "generate"))
		return cmd_generate(argc - 1, argv + 1);
	if (argc >= 2 && (!strcmp(argv[1], "tokenize") || !strcmp(argv[1], "detokenize")))
		return mlens_cli_text(argc - 1, argv + 1, argv[1][0] == 'd');
	if (argc == 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
		usage(stdout);
		return EXIT_ALL_OK;
	}
	if (argc == 2 && !strcmp(argv[1], "--version")) {
		printf("mlens %s\n", PACKAGE_VERSION);
		return EXIT_ALL_OK;
	}
	usage(stderr);
	return EXIT_TROUBLE;
}
