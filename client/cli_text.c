/* mlens tokenize / mlens detokenize: JSON lines of text to token ids and
 * back through the model directory's tokenizer, one output line per input
 * line, in order. A bad line gets an {"error": ...} line in its place. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "client/cli_int.h"

#define EXIT_ALL_OK 0
#define EXIT_SOME_FAILED 1
#define EXIT_TROUBLE 2

static void text_usage(FILE *f, bool detok)
{
	if (detok)
		fprintf(f,
			"usage: mlens detokenize --model DIR [--skip-special] [-i IN.jsonl] [-o OUT.jsonl]\n"
			"  reads {\"tokens\": [ids]} lines, writes {\"text\": \"...\"} lines\n");
	else
		fprintf(f,
			"usage: mlens tokenize --model DIR [--add-special] [-i IN.jsonl] [-o OUT.jsonl]\n"
			"  reads {\"text\": \"...\"} lines, writes {\"tokens\": [ids]} lines\n");
	fprintf(f, "  DIR holds tokenizer.json; IN and OUT default to stdin and stdout.\n"
		   "Exit status: 0 every line converted, 1 some lines were bad, 2 usage or file trouble.\n");
}

/* The one key a line must hold, of the type wanted; err says what is wrong. */
static json_t *line_field(const char *line, size_t len, const char *key, int type, json_t **root,
			  char *err, size_t errlen)
{
	json_error_t jerr;
	json_t *v;

	*root = json_loadb(line, len, JSON_ALLOW_NUL, &jerr);
	if (!*root) {
		snprintf(err, errlen, "not valid JSON: %s", jerr.text);
		return NULL;
	}
	if (!json_is_object(*root) || json_object_size(*root) != 1 ||
	    !(v = json_object_get(*root, key)) || (int)json_typeof(v) != type) {
		snprintf(err, errlen, "expected an object with one key \"%s\" (%s)", key,
			 type == JSON_STRING ? "a string" : "an array of token ids");
		return NULL;
	}
	return v;
}

/* special: add the tokenizer's special tokens (BOS). */
static int tokenize_line(const struct mlens_textgen *tg, bool special, const char *line,
			 size_t len, json_t **out, char *err, size_t errlen)
{
	json_t *root, *v = line_field(line, len, "text", JSON_STRING, &root, err, errlen), *a;
	size_t n = 0;
	int32_t *ids = NULL;
	int rc = -EINVAL;

	if (!v)
		goto out;
	rc = mlens_textgen_encode(tg, json_string_value(v), json_string_length(v), special, &ids,
				  &n);
	if (rc) {
		snprintf(err, errlen, "encode: %s", strerror(-rc));
		goto out;
	}
	a = json_array();
	*out = json_pack("{so}", "tokens", a);
	for (size_t i = 0; a && *out && i < n; i++)
		json_array_append_new(a, json_integer(ids[i]));
	rc = *out ? 0 : -ENOMEM;
out:
	free(ids);
	json_decref(root);
	return rc;
}

/* special: leave special tokens out of the text. */
static int detokenize_line(const struct mlens_textgen *tg, bool special, const char *line,
			   size_t len, json_t **out, char *err, size_t errlen)
{
	json_t *root, *v = line_field(line, len, "tokens", JSON_ARRAY, &root, err, errlen);
	size_t n = json_array_size(v), tlen = 0;
	int32_t *ids = NULL;
	char *text = NULL;
	int rc = -EINVAL;

	if (!v)
		goto out;
	if (!(ids = malloc((n ? n : 1) * sizeof(*ids)))) {
		rc = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < n; i++) {
		json_t *t = json_array_get(v, i);

		if (!json_is_integer(t) || json_integer_value(t) < 0 ||
		    json_integer_value(t) >= mlens_textgen_vocab_size(tg)) {
			snprintf(err, errlen, "tokens[%zu] is not a token id of this vocabulary "
				 "(0 to %u)", i, mlens_textgen_vocab_size(tg) - 1);
			goto out;
		}
		ids[i] = (int32_t)json_integer_value(t);
	}
	rc = mlens_textgen_decode(tg, ids, n, special, &text, &tlen);
	if (rc) {
		snprintf(err, errlen, rc == -EINVAL ? "a token id has no text in this vocabulary"
			 : "decode: %s", strerror(-rc));
		goto out;
	}
	*out = json_pack("{ss%}", "text", text, tlen);
	rc = *out ? 0 : -ENOMEM;
out:
	free(ids);
	free(text);
	json_decref(root);
	return rc;
}

int mlens_cli_text(int argc, char **argv, bool detok)
{
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "add-special", no_argument, NULL, 'a' },
		{ "skip-special", no_argument, NULL, 'k' },
		{ "input", required_argument, NULL, 'i' },
		{ "output", required_argument, NULL, 'o' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	const char *dir = NULL, *in_name = "-", *out_name = "-";
	struct mlens_textgen *tg = NULL;
	bool special = false;
	FILE *in = NULL, *out = NULL;
	char err[1024], *line = NULL;
	size_t cap = 0, lineno = 0, k;
	int c, rc, got, status = EXIT_TROUBLE;

	optind = 1;
	while ((c = getopt_long(argc, argv, "m:i:o:h", opts, NULL)) != -1) {
		switch (c) {
		case 'm': dir = optarg; break;
		case 'a':
		case 'k':
			if ((c == 'a') != !detok) {
				fprintf(stderr, "mlens %s: --%s belongs to mlens %s\n", argv[0],
					c == 'a' ? "add-special" : "skip-special",
					c == 'a' ? "tokenize" : "detokenize");
				return EXIT_TROUBLE;
			}
			special = true;
			break;
		case 'i': in_name = optarg; break;
		case 'o': out_name = optarg; break;
		case 'h': text_usage(stdout, detok); return EXIT_ALL_OK;
		default: text_usage(stderr, detok); return EXIT_TROUBLE;
		}
	}
	if (!dir || optind != argc) {
		fprintf(stderr, "mlens %s: %s\n", argv[0], dir ? "unexpected argument" : "--model DIR is required");
		text_usage(stderr, detok);
		return EXIT_TROUBLE;
	}
	if ((rc = mlens_textgen_open(dir, &tg, err, sizeof(err)))) {
		fprintf(stderr, "mlens %s: %s\n", argv[0], err);
		return EXIT_TROUBLE;
	}
	in = strcmp(in_name, "-") ? fopen(in_name, "r") : stdin;
	out = strcmp(out_name, "-") ? fopen(out_name, "w") : stdout;
	if (!in || !out) {
		fprintf(stderr, "mlens %s: %s: %s\n", argv[0], !in ? in_name : out_name, strerror(errno));
		goto out;
	}
	status = EXIT_ALL_OK;
	while ((got = mlens_cli_read_line(in, &line, &cap, &k)) > 0) {
		json_t *res = NULL;
		char *s;

		lineno++;
		if (!k)
			continue;	/* blank lines are skipped (generate answers each) */
		rc = (detok ? detokenize_line : tokenize_line)(tg, special, line, k, &res, err,
							       sizeof(err));
		if (rc == -ENOMEM) {
			fprintf(stderr, "mlens %s: out of memory at line %zu\n", argv[0], lineno);
			status = EXIT_TROUBLE;
			break;
		}
		if (rc) {
			fprintf(stderr, "mlens %s: %s line %zu: %s\n", argv[0], in_name, lineno, err);
			res = json_pack("{ss}", "error", err);
			status = EXIT_SOME_FAILED;
		}
		s = res ? json_dumps(res, JSON_COMPACT) : NULL;
		json_decref(res);
		if (!s || fprintf(out, "%s\n", s) < 0) {
			free(s);
			fprintf(stderr, "mlens %s: %s: write failed\n", argv[0], out_name);
			status = EXIT_TROUBLE;
			break;
		}
		free(s);
	}
	if (got < 0) {
		fprintf(stderr, "mlens %s: %s: read failed: %s\n", argv[0], in_name, strerror(-got));
		status = EXIT_TROUBLE;
	}
out:
	free(line);
	if (in && in != stdin)
		fclose(in);
	if (out && out != stdout && fclose(out)) {
		fprintf(stderr, "mlens %s: %s: %s\n", argv[0], out_name, strerror(errno));
		status = EXIT_TROUBLE;
	} else if (out == stdout && fflush(stdout)) {
		status = EXIT_TROUBLE;
	}
	mlens_textgen_free(tg);
	return status;
}
