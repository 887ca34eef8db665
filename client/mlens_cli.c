/* mlens: the batch client. `mlens generate` reads requests as JSON lines,
 * keeps up to --max-inflight of them running in mlensd through libmlens,
 * and writes one result line per input line, in input order, with a
 * progress bar and a closing summary on stderr. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
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

#define DEFAULT_SOCKET "/run/mlens/mlensd.sock"
#define DEFAULT_MAX_INFLIGHT 64
#define EVENT_BATCH 256

enum job_state { JOB_PARSED, JOB_RUNNING, JOB_DONE };

struct job {
	enum job_state state;
	struct mlens_cli_req req;
	int32_t *tokens;
	float *logprobs;
	size_t n_tokens, cap;
	uint32_t finish;
	char *error;
	double t_submit;
	double ttft;		/* seconds to the first token; < 0 when none came */
};

struct run {
	struct mlens *m;
	struct mlens_limits lim;
	FILE *in, *out;
	const char *out_name;
	struct job *jobs;
	size_t n_jobs, cap_jobs;
	size_t next_submit, next_write;
	size_t *line_of_id;	/* by id - 1: ids are issued 1, 2, 3, ... */
	size_t cap_ids;
	uint64_t n_ids;
	size_t inflight, max_inflight;
	bool eof, lost, progress, write_failed;
	size_t total_lines;	/* for the progress bar; 0 when unknown */
	double t_start, t_last_bar;
	uint64_t prompt_tokens, generated;
	size_t ok, failed;
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
		"usage: mlens generate [-s SOCKET] -i IN.jsonl -o OUT.jsonl [--max-inflight N] [--quiet]\n"
		"       mlens tokenize --model DIR [--add-special] [-i IN.jsonl] [-o OUT.jsonl]\n"
		"       mlens detokenize --model DIR [--skip-special] [-i IN.jsonl] [-o OUT.jsonl]\n"
		"       mlens --help | --version\n"
		"\n"
		"  -s, --socket PATH       mlensd's tenant socket (default $MLENS_SOCKET, else %s)\n"
		"  -i, --input FILE        requests, one JSON object a line ('-': stdin)\n"
		"  -o, --output FILE       results, one a line, in input order ('-': stdout)\n"
		"  -n, --max-inflight N    requests running at once (default %d)\n"
		"  -q, --quiet             no progress bar and no summary\n"
		"\n"
		"A request line: {\"prompt\": [ids], \"max_tokens\": 16, \"temperature\": 0, \"top_k\": 0,\n"
		"  \"top_p\": 1, \"seed\": 0, \"stop\": [ids], \"logprobs\": false} (all but prompt optional).\n"
		"Exit status: 0 all requests completed, 1 some failed, 2 usage, file or daemon trouble.\n",
		DEFAULT_SOCKET, DEFAULT_MAX_INFLIGHT);
}

/* ==== Jobs ==== */

static void job_fail(struct run *rn, struct job *j, const char *why)
{
	if (j->state == JOB_RUNNING)
		rn->inflight--;
	j->state = JOB_DONE;
	j->finish = MLENS_REASON_ERROR;
	free(j->error);
	j->error = strdup(why);
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

/* Read the next input line into a new job. Returns 1, 0 at end of input,
 * -errno. */
static int read_job(struct run *rn)
{
	char err[256];
	struct job *j;
	ssize_t len;

	errno = 0;
	len = getline(&rn->line, &rn->line_cap, rn->in);
	if (len < 0) {
		if (errno)
			return -errno;
		rn->eof = true;
		return 0;
	}
	if (rn->n_jobs == rn->cap_jobs) {
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
	if (mlens_cli_request_parse(rn->line, (size_t)len, &j->req, err, sizeof(err))) {
		j->state = JOB_DONE;
		j->finish = MLENS_REASON_ERROR;
		j->error = strdup(err);
	} else {
		j->state = JOB_PARSED;
	}
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

	if (over_limits(rn, &j->req, why, sizeof(why))) {
		job_fail(rn, j, why);
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
		job_fail(rn, j, mlens_strerror(rc));
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
	j->t_submit = now_s();
	rn->inflight++;
	rn->prompt_tokens += j->req.n_prompt;
	return 1;
}

static int handle_event(struct run *rn, const struct mlens_event *e)
{
	struct job *j;

	if (e->id == 0 || e->id > rn->n_ids)
		return 0;	/* not ours: nothing to attach it to */
	j = &rn->jobs[rn->line_of_id[e->id - 1]];
	if (j->state != JOB_RUNNING)
		return 0;
	if (e->flags & MLENS_EV_TOKEN) {
		if (j->ttft < 0)
			j->ttft = now_s() - j->t_submit;
		if (job_add_token(j, e->token, e->logprob))
			return -ENOMEM;
		rn->generated++;
	}
	if (e->flags & MLENS_EV_LAST) {
		if (e->finish == MLENS_REASON_ERROR) {
			job_fail(rn, j, mlens_strerror(e->status));
		} else {
			j->state = JOB_DONE;
			j->finish = e->finish;
			rn->inflight--;
		}
	}
	return 0;
}

/* Write the results that are next in input order. */
static int flush_results(struct run *rn)
{
	while (rn->next_write < rn->n_jobs && rn->jobs[rn->next_write].state == JOB_DONE) {
		struct job *j = &rn->jobs[rn->next_write];
		struct mlens_cli_result r = {
			.index = rn->next_write, .tokens = j->tokens, .n_tokens = j->n_tokens,
			.logprobs = j->req.logprobs ? j->logprobs : NULL, .finish = j->finish,
			.error = j->error,
		};
		char *s = mlens_cli_result_format(&r);

		if (!s)
			return -ENOMEM;
		if (fprintf(rn->out, "%s\n", s) < 0 && !rn->write_failed) {
			rn->write_failed = true;
			fprintf(stderr, "mlens: cannot write %s: %s\n", rn->out_name, strerror(errno));
		}
		free(s);
		if (j->finish == MLENS_REASON_LENGTH || j->finish == MLENS_REASON_STOP)
			rn->ok++;
		else
			rn->failed++;
		mlens_cli_request_free(&j->req);
		free(j->tokens);
		free(j->logprobs);
		free(j->error);
		j->tokens = NULL;
		j->logprobs = NULL;
		j->error = NULL;
		rn->next_write++;
	}
	return 0;
}

/* ==== Progress and summary ==== */

static void progress(struct run *rn, bool final)
{
	double t = now_s(), el = t - rn->t_start;
	size_t done = rn->next_write;
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
		"%llu generated tokens in %.2f s: %.1f tokens/s\n", rn->next_write, rn->ok,
		rn->failed, (unsigned long long)rn->prompt_tokens,
		(unsigned long long)rn->generated, el, el > 0 ? rn->generated / el : 0.0);
	if (n_ttft)
		fprintf(stderr, "mlens: time to first token: p50 %.1f ms, p99 %.1f ms (%zu requests)\n",
			percentile(ttft, n_ttft, 50) * 1e3, percentile(ttft, n_ttft, 99) * 1e3,
			n_ttft);
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

/* After the daemon left: every request not yet finished, and every line
 * not yet read, gets an error result, so that the output still has one
 * line per input line. */
static int settle_lost(struct run *rn)
{
	const char *why = mlens_strerror(-ECONNRESET);
	int rc;

	for (;;) {
		for (size_t i = rn->next_write; i < rn->n_jobs; i++)
			if (rn->jobs[i].state != JOB_DONE)
				job_fail(rn, &rn->jobs[i], why);
		rn->next_submit = rn->n_jobs;
		if ((rc = flush_results(rn)))
			return rc;
		if (rn->eof)
			return 0;
		rc = read_job(rn);
		if (rc < 0)
			return rc;
	}
}

static int cmd_generate(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "input", required_argument, NULL, 'i' },
		{ "output", required_argument, NULL, 'o' },
		{ "max-inflight", required_argument, NULL, 'n' },
		{ "quiet", no_argument, NULL, 'q' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *sock = getenv("MLENS_SOCKET"), *in_name = NULL, *out_name = NULL;
	struct run rn;
	bool quiet = false;
	double *ttft = NULL;
	size_t n_ttft = 0;
	long v;
	char *end;
	int c, rc, status = EXIT_TROUBLE;

	memset(&rn, 0, sizeof(rn));
	rn.max_inflight = DEFAULT_MAX_INFLIGHT;
	if (!sock || !*sock)
		sock = DEFAULT_SOCKET;
	while ((c = getopt_long(argc, argv, "s:i:o:n:qh", opts, NULL)) != -1) {
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
			if (errno || *end || v < 1 || v > 1000000) {
				fprintf(stderr, "mlens: --max-inflight %s: want a number from 1 to "
					"1000000\n", optarg);
				return EXIT_TROUBLE;
			}
			rn.max_inflight = (size_t)v;
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

	rn.in = strcmp(in_name, "-") ? fopen(in_name, "r") : stdin;
	if (!rn.in) {
		fprintf(stderr, "mlens: cannot read %s: %s\n", in_name, strerror(errno));
		return EXIT_TROUBLE;
	}
	rn.out_name = out_name;
	rn.out = strcmp(out_name, "-") ? fopen(out_name, "w") : stdout;
	if (!rn.out) {
		fprintf(stderr, "mlens: cannot write %s: %s\n", out_name, strerror(errno));
		goto close_in;
	}
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

	rn.t_start = now_s();
	rc = generate_loop(&rn);
	if (rc == -ECONNRESET) {
		fprintf(stderr, "\nmlens: %s; unfinished requests are reported as errors\n",
			mlens_strerror(rc));
		rc = settle_lost(&rn);
		if (!rc)
			rc = -ECONNRESET;
	}
	progress(&rn, true);
	if (rc && rc != -ECONNRESET)
		fprintf(stderr, "mlens: stopped after %zu results: %s\n", rn.next_write,
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
		status = rn.failed ? EXIT_SOME_FAILED : EXIT_ALL_OK;
	free(ttft);
close_m:
	mlens_close(rn.m);
close_out:
	if (rn.out != stdout ? fclose(rn.out) : fflush(rn.out)) {
		fprintf(stderr, "mlens: cannot write %s: %s\n", out_name, strerror(errno));
		status = EXIT_TROUBLE;
	}
close_in:
	if (rn.in != stdin)
		fclose(rn.in);
	for (size_t i = rn.next_write; i < rn.n_jobs; i++) {
		mlens_cli_request_free(&rn.jobs[i].req);
		free(rn.jobs[i].tokens);
		free(rn.jobs[i].logprobs);
		free(rn.jobs[i].error);
	}
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
