/* Description: libmlens chat templates (mlens_chat.h). Every case of
 * tests/chat/goldens.json (real models' templates and small feature
 * templates, rendered by transformers with tests/chat/make_goldens.py)
 * renders byte for byte the same, or fails with the same raise_exception
 * message; broken templates fail at parse time naming the construct and its
 * line; hostile ones stop at the render limits; templates load from a model
 * directory the ways Hugging Face stores them; threads render one template
 * at once. */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <jansson.h>
#include "client/mlens_chat.h"

static const char *srcdir(void)
{
	const char *s = getenv("MLENS_SRCDIR");

	return s ? s : ".";
}

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "rb");
	char *buf;
	long n;

	ck_assert_msg(f != NULL, "cannot open %s", path);
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	rewind(f);
	buf = malloc((size_t)n + 1);
	ck_assert(buf && fread(buf, 1, (size_t)n, f) == (size_t)n);
	buf[n] = 0;
	fclose(f);
	return buf;
}

/* Renders text over messages; returns the error (0 on success) and sets
 * *out or *err (both malloc'd, caller frees). */
static int render(const char *text, const char *messages, int gen, const char *extra,
		  char **out, char **err)
{
	struct mlens_chat_template *t;
	int rc;

	*out = NULL;
	*err = NULL;
	rc = mlens_chat_template_parse(text, strlen(text), "<s>", "</s>", &t, err);
	if (rc)
		return rc;
	rc = mlens_chat_template_render(t, messages, gen, extra, out, NULL, err);
	mlens_chat_template_free(t);
	return rc;
}

static const char *MSGS = "[{\"role\": \"user\", \"content\": \"hi\"}]";

/* ==== Goldens ==== */

static size_t first_diff(const char *a, size_t an, const char *b, size_t bn)
{
	size_t i = 0;

	while (i < an && i < bn && a[i] == b[i])
		i++;
	return i;
}

/* Templates that print strftime_now's date have %TODAY% in their golden
 * text; *buf gets a copy with today's date there (or stays NULL). */
static const char *with_today(const char *expected, char **buf)
{
	const char *at = strstr(expected, "%TODAY%");
	char day[32];
	time_t now = time(NULL);
	struct tm tm;
	size_t n = 0;

	if (!at)
		return expected;
	localtime_r(&now, &tm);
	strftime(day, sizeof(day), "%Y-%m-%d", &tm);
	*buf = malloc(strlen(expected) * 2 + 32);
	for (const char *p = expected; *p;) {
		if (!strncmp(p, "%TODAY%", 7)) {
			memcpy(*buf + n, day, strlen(day));
			n += strlen(day);
			p += 7;
		} else {
			(*buf)[n++] = *p++;
		}
	}
	(*buf)[n] = 0;
	return *buf;
}

START_TEST(test_goldens)
{
	char path[4096];
	json_error_t jerr;
	json_t *root, *cases, *c;
	size_t i, n_ok = 0, n_bad = 0, n_err = 0;

	snprintf(path, sizeof(path), "%s/tests/chat/goldens.json", srcdir());
	root = json_load_file(path, 0, &jerr);
	ck_assert_msg(root != NULL, "%s: %s", path, jerr.text);
	cases = json_object_get(root, "cases");
	ck_assert(json_array_size(cases) > 100);
	json_array_foreach(cases, i, c) {
		const char *name = json_string_value(json_object_get(c, "name"));
		const char *tname = json_string_value(json_object_get(c, "template"));
		const char *expected = json_string_value(json_object_get(c, "expected"));
		const char *error = json_string_value(json_object_get(c, "error"));
		json_t *extra = json_object_get(c, "extra");
		char *text, *msgs, *xs = NULL, *out = NULL, *err = NULL, *today = NULL;
		struct mlens_chat_template *t;
		size_t out_len = 0;
		int rc;

		if (expected)
			expected = with_today(expected, &today);
		if (tname) {
			snprintf(path, sizeof(path), "%s/tests/chat/templates/%s.jinja", srcdir(), tname);
			text = slurp(path);
		} else {
			text = strdup(json_string_value(json_object_get(c, "template_text")));
		}
		msgs = json_dumps(json_object_get(c, "messages"), JSON_COMPACT);
		if (json_is_object(extra))
			xs = json_dumps(extra, JSON_COMPACT);
		rc = mlens_chat_template_parse(text, strlen(text),
					       json_string_value(json_object_get(c, "bos_token")),
					       json_string_value(json_object_get(c, "eos_token")), &t, &err);
		if (rc) {
			fprintf(stderr, "%s: parse failed: %s\n", name, err);
			n_bad++;
			goto next;
		}
		rc = mlens_chat_template_render(t, msgs, json_is_true(json_object_get(c, "add_generation_prompt")),
						xs, &out, &out_len, &err);
		mlens_chat_template_free(t);
		if (error) {
			/* raise_exception: the message as is; an undefined value: the
			 * same message after the template line */
			int raised = !strcmp(json_string_value(json_object_get(c, "error_type")), "raise");

			n_err++;
			if (raised ? rc != -EBADMSG || strcmp(err, error) :
				     rc != -EINVAL || !strstr(err, error)) {
				fprintf(stderr, "%s: expected the error \"%s\", got %d \"%s\"\n", name, error, rc,
					err ? err : "(rendered)");
				n_bad++;
			} else {
				n_ok++;
			}
		} else if (rc) {
			fprintf(stderr, "%s: render failed (%d): %s\n", name, rc, err);
			n_bad++;
		} else if (out_len != strlen(expected) || memcmp(out, expected, out_len)) {
			size_t d = first_diff(out, out_len, expected, strlen(expected));

			fprintf(stderr, "%s: differs at byte %zu\n  got:      \"%.60s\"\n  expected: \"%.60s\"\n",
				name, d, out + d, expected + d);
			n_bad++;
		} else {
			n_ok++;
		}
next:
		free(today);
		free(text);
		free(msgs);
		free(xs);
		free(out);
		free(err);
	}
	json_decref(root);
	fprintf(stderr, "goldens: %zu match (%zu of them errors), %zu differ\n", n_ok, n_err, n_bad);
	ck_assert_uint_eq(n_bad, 0);
	ck_assert_uint_gt(n_err, 10);
}
END_TEST

/* ==== Broken templates ==== */

static void expect_parse_error(const char *text, const char *needle, int line)
{
	struct mlens_chat_template *t = NULL;
	char *err = NULL, want[64];
	int rc = mlens_chat_template_parse(text, strlen(text), NULL, NULL, &t, &err);

	ck_assert_msg(rc == -EINVAL, "\"%s\": expected -EINVAL, got %d", text, rc);
	ck_assert(t == NULL);
	ck_assert_msg(err && strstr(err, needle), "\"%s\": message \"%s\" lacks \"%s\"", text, err, needle);
	snprintf(want, sizeof(want), "line %d:", line);
	ck_assert_msg(strstr(err, want), "\"%s\": message \"%s\" lacks \"%s\"", text, err, want);
	free(err);
}

START_TEST(test_parse_errors)
{
	expect_parse_error("a\n{{ x | frobnicate }}", "unknown filter 'frobnicate'", 2);
	expect_parse_error("{% if x %}\n\n{{ y }}", "unterminated {% if %}: no {% endif %}", 1);
	expect_parse_error("\n{% for m in messages %}{% if m %}{% endfor %}", "unexpected {% endfor %} inside {% if %}", 2);
	expect_parse_error("{% for m in messages %}x", "unterminated {% for %}: no {% endfor %}", 1);
	expect_parse_error("\n\n{% include 'x.jinja' %}", "unknown or unsupported tag 'include'", 3);
	expect_parse_error("{{ x is frob }}", "unknown test 'frob'", 1);
	expect_parse_error("x\n{{ messages[0]", "unterminated {{ expression: no closing }}", 2);
	expect_parse_error("{# open comment", "unterminated comment", 1);
	expect_parse_error("{{ 'abc }}", "unterminated string literal", 1);
	expect_parse_error("{{ 1 + }}", "expected an expression, found '}}'", 1);
	expect_parse_error("{% endif %}", "unexpected {% endif %}", 1);
	expect_parse_error("{% for x in y recursive %}{% endfor %}", "recursive loops are not supported", 1);
	expect_parse_error("{{ a ! b }}", "unexpected character '!'", 1);
	expect_parse_error("{{ f(*args) }}", "*args and **kwargs", 1);
}
END_TEST

static void expect_render_error(const char *text, int want_rc, const char *needle)
{
	char *out, *err;
	int rc = render(text, MSGS, 0, NULL, &out, &err);

	ck_assert_msg(rc == want_rc, "\"%s\": expected %d, got %d (%s)", text, want_rc, rc, err ? err : out);
	ck_assert(out == NULL);
	ck_assert_msg(err && strstr(err, needle), "\"%s\": message \"%s\" lacks \"%s\"", text, err, needle);
	free(err);
}

START_TEST(test_render_errors)
{
	expect_render_error("x\n{{ 'a'.zfill(3) }}", -EINVAL, "line 2: unsupported method 'zfill' of a str");
	expect_render_error("{{ messages[0].nope.deeper }}", -EINVAL,
			    "line 1: 'dict object' has no attribute 'nope'");
	expect_render_error("{{ nothing.attr }}", -EINVAL, "'nothing' is undefined");
	expect_render_error("{{ nothing + 1 }}", -EINVAL, "'nothing' is undefined");
	expect_render_error("{{ nothing|int }}", -EINVAL, "'nothing' is undefined");
	expect_render_error("{{ nothing|last }}", -EINVAL, "'nothing' is undefined");
	expect_render_error("{{ 'a' + 1 }}", -EINVAL, "unsupported operand types for +: str and int");
	expect_render_error("{{ 1 // 0 }}", -EINVAL, "division by zero");
	expect_render_error("{{ '%5d' % 1 }}", -EINVAL, "only %s, %r, %d and %i are supported");
	expect_render_error("{{ '%s %s' % ('a',) }}", -EINVAL, "not enough arguments for format string");
	expect_render_error("{% set x = 1 %}{% set x.a = 2 %}", -EINVAL, "only namespace() objects take attributes");
	expect_render_error("{% for a, b in [1] %}{% endfor %}", -EINVAL, "cannot unpack a int into 2 names");
	expect_render_error("{{ raise_exception('no tools here') }}", -EBADMSG, "no tools here");
	expect_render_error("{{ none | length }}", -EINVAL, "a none has no length");
	expect_render_error("{{ messages|map('frob') }}", -EINVAL, "unknown filter 'frob'");
	expect_render_error("{{ [1]|selectattr('x', 'frob') }}", -EINVAL, "unknown test 'frob'");
}
END_TEST

/* ==== Limits ==== */

START_TEST(test_limits)
{
	/* a loop without output, a loop of output, runaway recursion, a huge repeat */
	expect_render_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
			    -E2BIG, "more than");
	expect_render_error("{% for i in range(100000000) %}{% endfor %}", -E2BIG, "steps");
	expect_render_error("{% for i in range(4000000) %}xxxxxxxxxxxxxxxxxxxx{% endfor %}", -E2BIG, "exceeds");
	expect_render_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", -E2BIG, "nesting deeper");
	expect_render_error("{{ 'x' * 1000000000 }}", -E2BIG, "more than the template may take");
	expect_render_error("{% set ns = namespace(l=[]) %}{% for i in range(5000) %}{% set ns.l = [ns.l] %}"
			    "{% endfor %}{{ ns.l }}", -E2BIG, "nested deeper");
	/* a real template's runaway recursion: Hermes 3 recurses on each letter
	 * of a type name it does not know ("null"), which Python stops with a
	 * RecursionError */
	{
		char path[4096], *text, *out = NULL, *err = NULL;
		struct mlens_chat_template *t;

		snprintf(path, sizeof(path), "%s/tests/chat/templates/hermes-3-llama-3.1-tool-use.jinja", srcdir());
		text = slurp(path);
		ck_assert_int_eq(mlens_chat_template_parse(text, strlen(text), NULL, NULL, &t, NULL), 0);
		ck_assert_int_eq(mlens_chat_template_render(t, MSGS, 1,
			"{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"d\","
			" \"parameters\": {\"properties\": {\"a\": {\"type\": [\"integer\", \"null\"]}}}}}]}",
			&out, NULL, &err), -E2BIG);
		ck_assert_msg(strstr(err, "nesting deeper than 256 levels (recursive macro?)"), "%s", err);
		ck_assert(out == NULL);
		free(err);
		free(text);
		mlens_chat_template_free(t);
	}
	/* parse-time nesting */
	{
		char *deep = malloc(7000);

		memcpy(deep, "{{ ", 3);
		memset(deep + 3, '(', 3000);
		deep[3003] = '1';
		memset(deep + 3004, ')', 3000);
		strcpy(deep + 6004, " }}");
		expect_parse_error(deep, "nesting deeper than", 1);
		free(deep);
	}
}
END_TEST

/* A large template parses in linear time: lines are counted once, and the
 * token array does not stay behind in the template's memory. */
START_TEST(test_big_template)
{
	static const char block[] = "{% if true %}x{% endif %}\n";
	size_t n = 200000, len = n * (sizeof(block) - 1);
	char *text = malloc(len + 1), *out, *err;
	struct timespec t0, t1;

	for (size_t i = 0; i < n; i++)
		memcpy(text + i * (sizeof(block) - 1), block, sizeof(block) - 1);
	text[len] = 0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	ck_assert_int_eq(render(text, MSGS, 0, NULL, &out, &err), 0);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	ck_assert_uint_eq(strlen(out), n);
	ck_assert_msg(t1.tv_sec - t0.tv_sec < 20, "a %zu-byte template took %ld s", len, (long)(t1.tv_sec - t0.tv_sec));
	free(out);
	free(text);
}
END_TEST

/* ==== Arguments and messages ==== */

START_TEST(test_bad_input)
{
	struct mlens_chat_template *t;
	char *out = NULL, *err = NULL;

	ck_assert_int_eq(mlens_chat_template_parse("{{ x }}", 7, NULL, NULL, &t, NULL), 0);
	ck_assert_int_eq(mlens_chat_template_render(t, "not json", 0, NULL, &out, NULL, &err), -EINVAL);
	ck_assert(strstr(err, "messages: not JSON"));
	free(err);
	ck_assert_int_eq(mlens_chat_template_render(t, "{\"role\": \"user\"}", 0, NULL, &out, NULL, &err),
			 -EINVAL);
	ck_assert(strstr(err, "expected a JSON array"));
	free(err);
	ck_assert_int_eq(mlens_chat_template_render(t, "[{\"role\": \"user\"}, 3]", 0, NULL, &out, NULL, &err),
			 -EINVAL);
	ck_assert(strstr(err, "messages[1]: expected an object"));
	free(err);
	ck_assert_int_eq(mlens_chat_template_render(t, "[]", 0, "[1]", &out, NULL, &err), -EINVAL);
	ck_assert(strstr(err, "extra variables: expected a JSON object"));
	free(err);
	ck_assert_int_eq(mlens_chat_template_render(t, "[]", 0, "{\"messages\": []}", &out, NULL, &err), -EINVAL);
	free(err);
	ck_assert_int_eq(mlens_chat_template_render(NULL, "[]", 0, NULL, &out, NULL, NULL), -EINVAL);
	ck_assert(out == NULL);
	/* extra variables reach the template; an empty render is "" */
	ck_assert_int_eq(mlens_chat_template_render(t, "[]", 0, "{\"x\": [1, \"a\"]}", &out, NULL, NULL), 0);
	ck_assert_str_eq(out, "[1, 'a']");
	free(out);
	ck_assert_int_eq(mlens_chat_template_render(t, "[]", 0, NULL, &out, NULL, NULL), 0);
	ck_assert_str_eq(out, "");
	free(out);
	mlens_chat_template_free(t);
	mlens_chat_template_free(NULL);
	ck_assert_int_eq(mlens_chat_template_parse(NULL, 0, NULL, NULL, &t, NULL), -EINVAL);
}
END_TEST

START_TEST(test_strftime_now)
{
	char *out, *err, year[16];
	time_t now = time(NULL);
	struct tm tm;

	localtime_r(&now, &tm);
	strftime(year, sizeof(year), "%Y", &tm);
	ck_assert_int_eq(render("{{ strftime_now('%Y') }}", MSGS, 0, NULL, &out, &err), 0);
	ck_assert_str_eq(out, year);
	free(out);
}
END_TEST

/* ==== One template, several threads ==== */

struct render_job {
	const struct mlens_chat_template *t;
	const char *msgs, *extra, *want;
	int bad;
};

static void *render_many(void *arg)
{
	struct render_job *j = arg;

	for (int i = 0; i < 200; i++) {
		char *out = NULL;

		if (mlens_chat_template_render(j->t, j->msgs, i & 1, j->extra, &out, NULL, NULL) ||
		    strcmp(out, j->want + ((i & 1) ? 0 : strlen(j->want) + 1)))
			j->bad++;
		free(out);
	}
	return NULL;
}

START_TEST(test_threads)
{
	static const char msgs[] =
		"[{\"role\": \"user\", \"content\": \"Weather?\"}, {\"role\": \"assistant\", \"content\": \"\","
		" \"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"w\", \"arguments\": {\"c\": 1}}}]},"
		" {\"role\": \"tool\", \"content\": \"sunny\"}]";
	static const char extra[] = "{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"w\"}}]}";
	struct mlens_chat_template *t;
	struct render_job jobs[4];
	pthread_t th[4];
	char path[4096], *text, *gen, *nogen, *want;

	snprintf(path, sizeof(path), "%s/tests/chat/templates/qwen3.jinja", srcdir());
	text = slurp(path);
	ck_assert_int_eq(mlens_chat_template_parse(text, strlen(text), NULL, "<|im_end|>", &t, NULL), 0);
	ck_assert_int_eq(mlens_chat_template_render(t, msgs, 1, extra, &gen, NULL, NULL), 0);
	ck_assert_int_eq(mlens_chat_template_render(t, msgs, 0, extra, &nogen, NULL, NULL), 0);
	ck_assert(strstr(gen, "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": 1}}"));
	/* want: the generation-prompt text, NUL, the other */
	want = malloc(strlen(gen) + strlen(nogen) + 2);
	strcpy(want, gen);
	strcpy(want + strlen(gen) + 1, nogen);
	for (int i = 0; i < 4; i++) {
		jobs[i] = (struct render_job){ t, msgs, extra, want, 0 };
		ck_assert_int_eq(pthread_create(&th[i], NULL, render_many, &jobs[i]), 0);
	}
	for (int i = 0; i < 4; i++) {
		pthread_join(th[i], NULL);
		ck_assert_int_eq(jobs[i].bad, 0);
	}
	free(want);
	free(gen);
	free(nogen);
	free(text);
	mlens_chat_template_free(t);
}
END_TEST

/* ==== Loading from a model directory ==== */

static char dir[64];

static void write_file(const char *name, const char *text)
{
	char path[256];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(path, "w");
	ck_assert(f != NULL);
	fputs(text, f);
	fclose(f);
}

static void remove_file(const char *name)
{
	char path[256];

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	unlink(path);
}

static char *open_render(int want_rc, const char *needle)
{
	struct mlens_chat_template *t = NULL;
	char *out = NULL, *err = NULL;
	int rc = mlens_chat_template_open(dir, &t, &err);

	ck_assert_msg(rc == want_rc, "open: expected %d, got %d (%s)", want_rc, rc, err ? err : "");
	if (rc) {
		ck_assert_msg(err && strstr(err, needle), "message \"%s\" lacks \"%s\"", err, needle);
		free(err);
		return NULL;
	}
	ck_assert_int_eq(mlens_chat_template_render(t, MSGS, 1, NULL, &out, NULL, NULL), 0);
	mlens_chat_template_free(t);
	return out;
}

START_TEST(test_open)
{
	char *out;

	snprintf(dir, sizeof(dir), "/tmp/check_chat.XXXXXX");
	ck_assert(mkdtemp(dir) != NULL);

	/* no files at all, then a config without a template */
	out = open_render(-ENOENT, "has no chat_template.jinja and no \"chat_template\"");
	write_file("tokenizer_config.json", "{\"bos_token\": \"<s>\"}");
	out = open_render(-ENOENT, "pass a template yourself");

	/* a string template; tokens as a string and as an AddedToken */
	write_file("tokenizer_config.json",
		   "{\"chat_template\": \"{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
		   "{{ eos_token }}{{ add_generation_prompt }}\", \"bos_token\": \"<s>\", \"eos_token\": "
		   "{\"__type\": \"AddedToken\", \"content\": \"</s>\", \"lstrip\": false}}");
	out = open_render(0, NULL);
	ck_assert_str_eq(out, "<s>[hi]</s>True");
	free(out);

	/* tokens missing from the config come from special_tokens_map.json */
	write_file("tokenizer_config.json", "{\"chat_template\": \"{{ bos_token }}|{{ eos_token }}\", "
		   "\"bos_token\": null}");
	write_file("special_tokens_map.json", "{\"bos_token\": {\"content\": \"<B>\"}, \"eos_token\": \"<E>\"}");
	out = open_render(0, NULL);
	ck_assert_str_eq(out, "<B>|<E>");
	free(out);
	write_file("special_tokens_map.json", "[]");
	out = open_render(-EINVAL, "special_tokens_map.json: not a JSON object");
	remove_file("special_tokens_map.json");

	/* a list of named templates: "default" is taken */
	write_file("tokenizer_config.json",
		   "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"tools\"}, "
		   "{\"name\": \"default\", \"template\": \"default {{ messages|length }}\"}]}");
	out = open_render(0, NULL);
	ck_assert_str_eq(out, "default 1");
	free(out);
	write_file("tokenizer_config.json", "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"x\"}]}");
	out = open_render(-ENOENT, "no template named \"default\"");

	/* chat_template.jinja wins over the config's template */
	write_file("tokenizer_config.json", "{\"chat_template\": \"config\", \"eos_token\": \"E\"}");
	write_file("chat_template.jinja", "file {{ eos_token }}\n");
	out = open_render(0, NULL);
	ck_assert_str_eq(out, "file E");
	free(out);

	/* a broken template names its file and line */
	write_file("chat_template.jinja", "ok\n{% if %}");
	out = open_render(-EINVAL, "chat_template.jinja: line 2: expected an expression");

	/* a broken config */
	remove_file("chat_template.jinja");
	write_file("tokenizer_config.json", "{\"chat_template\": ");
	out = open_render(-EINVAL, "tokenizer_config.json: line 1");
	remove_file("tokenizer_config.json");
	rmdir(dir);
}
END_TEST

static Suite *chat_suite(void)
{
	Suite *s = suite_create("chat");
	TCase *t = tcase_create("templates");

	tcase_set_timeout(t, 60);
	tcase_add_test(t, test_goldens);
	tcase_add_test(t, test_parse_errors);
	tcase_add_test(t, test_render_errors);
	tcase_add_test(t, test_limits);
	tcase_add_test(t, test_big_template);
	tcase_add_test(t, test_bad_input);
	tcase_add_test(t, test_strftime_now);
	tcase_add_test(t, test_threads);
	tcase_add_test(t, test_open);
	suite_add_tcase(s, t);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(chat_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}
