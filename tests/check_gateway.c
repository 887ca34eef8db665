/* Description: mlens-gateway's parts that need no daemon: stop strings cut
 * at the earliest match across token boundaries and never release text
 * that could begin one (nor half a UTF-8 character); settings from flags
 * over a file over defaults, with the errors named; the API key file; the
 * OpenAI request fields checked against the daemon's limits (each refusal
 * with its param and code); daemon statuses mapped to HTTP errors. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <jansson.h>
#include "client/gateway_int.h"

static const struct mlens_limits lim = {
	.size = sizeof(lim), .max_prompt_tokens = 100, .max_tokens = 50, .max_context = 120,
	.vocab_size = 1000,
};

/* ==== stop strings ==== */

/* Append s to t's text as a token would, and scan. */
static int grow(struct mlens_textgen_text *t, char *const *stops, size_t n, const char *s)
{
	return mlens_textgen_text_add(t, stops, n, s, strlen(s), false);
}

START_TEST(test_stop_scan)
{
	char *stops[] = { "END", "stop!" };
	struct mlens_textgen_text t = { 0 };

	ck_assert_int_eq(grow(&t, stops, 2, "hello "), 0);
	ck_assert_uint_eq(t.safe, 2);	/* "llo " could begin "stop!" */
	ck_assert_int_eq(grow(&t, stops, 2, "wor"), 0);
	ck_assert_uint_eq(t.safe, 5);
	ck_assert_int_eq(grow(&t, stops, 2, "ld E"), 0);
	ck_assert_int_eq(grow(&t, stops, 2, "N"), 0);
	/* the match spans three pieces: cut before it */
	ck_assert_int_eq(grow(&t, stops, 2, "D and stop!"), 1);
	ck_assert_str_eq(t.buf, "hello world ");
	ck_assert_uint_eq(t.len, 12);
	ck_assert_uint_eq(t.safe, 12);
	ck_assert(t.stopped);
	mlens_textgen_text_free(&t);

	/* the earliest of two matches in one piece wins */
	ck_assert_int_eq(grow(&t, stops, 2, "a stop! b END"), 1);
	ck_assert_str_eq(t.buf, "a ");
	mlens_textgen_text_free(&t);

	/* held-back text never ends inside a UTF-8 character */
	ck_assert_int_eq(grow(&t, stops, 2, "abc\xc3\xa9xyz"), 0);	/* a b c é x y z: 8 bytes */
	ck_assert_uint_eq(t.safe, 3);	/* 8 - 4 = 4 is inside the é: back to 3 */
	/* the end of the text: all of it is safe */
	ck_assert_int_eq(mlens_textgen_text_add(&t, stops, 2, "", 0, true), 0);
	ck_assert_uint_eq(t.safe, 8);
	mlens_textgen_text_free(&t);

	/* no stop strings: everything is safe */
	ck_assert_int_eq(grow(&t, stops, 0, "END"), 0);
	ck_assert_uint_eq(t.safe, 3);
	mlens_textgen_text_free(&t);
}
END_TEST

/* ==== settings and keys ==== */

static char *write_tmp(const char *text)
{
	char *path = strdup("/tmp/check_gateway.XXXXXX");
	int fd = mkstemp(path);

	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
	close(fd);
	return path;
}

START_TEST(test_conf)
{
	char *f = write_tmp("# settings\nlisten = 127.0.0.1:9000\nmax_body = 2K\nmax_n = 4\n");
	char *argv[] = { "mlens-gateway", "--max-n", "7", "--config", f, "-s", "/x.sock", NULL };
	char *bad_argv[] = { "mlens-gateway", "--max-body", "12Q", NULL };
	struct gw_conf c;

	ck_assert_int_eq(gw_conf_load(&c, 7, argv), 0);
	ck_assert_str_eq(c.listen, "127.0.0.1:9000");	/* file over default */
	ck_assert_uint_eq(c.max_body, 2048);
	ck_assert_uint_eq(c.max_n, 7);			/* flag over file */
	ck_assert_str_eq(c.socket, "/x.sock");
	ck_assert_uint_eq(c.max_pending, 256);		/* default */
	ck_assert_ptr_null(c.api_key_file);
	gw_conf_free(&c);
	ck_assert_int_eq(gw_conf_load(&c, 3, bad_argv), -EINVAL);
	gw_conf_free(&c);
	unlink(f);
	free(f);

	f = write_tmp("max_n = 0\n");
	{
		char *a[] = { "mlens-gateway", "--config", f, NULL };

		ck_assert_int_eq(gw_conf_load(&c, 3, a), -EINVAL);	/* outside [1, 1024] */
		gw_conf_free(&c);
	}
	unlink(f);
	free(f);
}
END_TEST

START_TEST(test_keys)
{
	static const char *const bad[] = {
		"key-aaaa-1 alice\nkey-aaaa-1 bob\n",		/* a key twice */
		"key-aaaa-1 alice\nkey-bbbb-2 alice\n",		/* a tenant twice */
		"short alice\n",				/* too short */
		"key-aaaa-1\n",					/* no tenant */
		"key-aaaa-1 alice extra\n",
		"key-aaaa-1 a-tenant-name-of-more-than-forty-seven-bytes-is-cut\n",
		"# nothing\n",
	};
	char *f = write_tmp("# keys\n\nkey-aaaa-1 alice\n  key-bbbb-2\tbob  \n");
	struct gw_key *k;
	size_t n;

	ck_assert_int_eq(gw_keys_load(f, &k, &n), 0);
	ck_assert_uint_eq(n, 2);
	ck_assert_str_eq(k[0].key, "key-aaaa-1");
	ck_assert_str_eq(k[0].tenant, "alice");
	ck_assert_str_eq(k[1].key, "key-bbbb-2");
	ck_assert_str_eq(k[1].tenant, "bob");
	gw_keys_free(k, n);
	unlink(f);
	free(f);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		f = write_tmp(bad[i]);
		ck_assert_msg(gw_keys_load(f, &k, &n) == -EINVAL, "accepted: %s", bad[i]);
		unlink(f);
		free(f);
	}
	ck_assert_int_eq(gw_keys_load("/nonexistent/keys", &k, &n), -EINVAL);
}
END_TEST

/* ==== request fields ==== */

static struct gw gw_for_test(void)
{
	struct gw gw = { .model_id = "tiny" };

	gw.conf.max_n = 4;
	return gw;
}

/* Parse body as kind; returns parse's result, *e filled. */
static int parse(struct gw *gw, enum gw_kind kind, const char *body, struct gw_call *c,
		 struct gw_err *e)
{
	json_t *j = json_loads(body, 0, NULL);
	int rc;

	ck_assert_ptr_nonnull(j);
	memset(c, 0, sizeof(*c));
	c->gw = gw;
	c->kind = kind;
	rc = gw_call_parse(gw, c, j, &lim, e);
	json_decref(j);
	return rc;
}

START_TEST(test_parse_ok)
{
	struct gw gw = gw_for_test();
	struct gw_call c;
	struct gw_err e;

	ck_assert_int_eq(parse(&gw, GW_COMPLETION, "{\"model\": \"tiny\", \"prompt\": [[1, 2], [3]], "
			       "\"n\": 2, \"seed\": 9, \"temperature\": 0.5, \"top_k\": -1, "
			       "\"stop_token_ids\": [7], \"logprobs\": 1}", &c, &e), 0);
	ck_assert_uint_eq(c.n_prompts, 2);
	ck_assert_uint_eq(c.n_ch, 4);
	ck_assert_uint_eq(c.max_tokens, 16);		/* completions' default */
	ck_assert_uint_eq(c.ch[2].n_prompt, 1);	/* choice 2 is prompt 1's first */
	ck_assert_int_eq(c.ch[2].prompt[0], 3);
	ck_assert_uint_eq(c.ch[0].seed, 9);
	ck_assert_uint_eq(c.ch[1].seed, 10);	/* n seeded choices differ */
	ck_assert_uint_eq(c.ch[2].seed, 9);
	ck_assert_int_eq(c.top_k, 0);
	ck_assert_uint_eq(c.n_stop_ids, 1);
	ck_assert(c.logprobs);
	gw_call_clear(&c);

	/* max_tokens up to the daemon's limit */
	ck_assert_int_eq(parse(&gw, GW_COMPLETION, "{\"prompt\": [5], \"max_tokens\": 50}", &c, &e), 0);
	ck_assert_uint_eq(c.max_tokens, 50);
	gw_call_clear(&c);
}
END_TEST

START_TEST(test_parse_refused)
{
	static const struct {
		enum gw_kind kind;
		const char *body, *param, *code;
	} t[] = {
		{ GW_COMPLETION, "{\"prompt\": [1], \"model\": \"other\"}", "model", "model_not_found" },
		{ GW_COMPLETION, "{}", "prompt", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": []}", "prompt", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1000]}", "prompt", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [-1]}", "prompt", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1, \"a\"]}", "prompt", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"max_tokens\": 51}", "max_tokens", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"max_tokens\": 0}", "max_tokens", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"n\": 5}", "n", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"top_p\": 0}", "top_p", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"temperature\": \"hot\"}", "temperature", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"logprobs\": 2}", "logprobs", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"stream\": 1}", "stream", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"stream_options\": {\"include_usage\": true}}",
		  "stream_options", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"stop\": \"x\"}", "stop", "no_tokenizer" },
		{ GW_COMPLETION, "{\"prompt\": \"text\"}", "prompt", "no_tokenizer" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"stop_token_ids\": [1000]}", "stop_token_ids",
		  "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"echo\": true}", "echo", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"best_of\": 2}", "best_of", "invalid_value" },
		{ GW_COMPLETION, "{\"prompt\": [1], \"presence_penalty\": 1}", "presence_penalty",
		  "invalid_value" },
		/* 100 prompt tokens + 21 > the context of 120 */
		{ GW_COMPLETION, "{\"prompt\": [[1], [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,"
		  "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,"
		  "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]], \"max_tokens\": 21}",
		  "prompt", "context_length_exceeded" },
		{ GW_CHAT, "{\"messages\": []}", "messages", "invalid_value" },
		{ GW_CHAT, "{\"messages\": [{\"content\": \"hi\"}]}", "messages", "invalid_value" },
		{ GW_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", "messages",
		  "no_tokenizer" },
		{ GW_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"logprobs\": true, "
		  "\"top_logprobs\": 2}", "top_logprobs", "invalid_value" },
		{ GW_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"top_logprobs\": 1}",
		  "top_logprobs", "invalid_value" },
	};
	struct gw gw = gw_for_test();

	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
		struct gw_call c;
		struct gw_err e = { 0 };
		int rc = parse(&gw, t[i].kind, t[i].body, &c, &e);

		ck_assert_msg(rc == -1, "accepted: %s", t[i].body);
		ck_assert_int_eq(e.http, 400);
		ck_assert_str_eq(e.type, "invalid_request_error");
		ck_assert_msg(e.param && !strcmp(e.param, t[i].param), "%s: param %s", t[i].body,
			      e.param ? e.param : "null");
		ck_assert_msg(!strcmp(e.code, t[i].code), "%s: code %s", t[i].body, e.code);
		ck_assert_msg(strlen(e.msg) > 10, "%s: message '%s'", t[i].body, e.msg);
		gw_call_clear(&c);
	}
}
END_TEST

START_TEST(test_err_status)
{
	static const struct {
		int status, http;
		const char *code;
	} t[] = {
		{ -EDQUOT, 429, "quota_exceeded" },
		{ -ESHUTDOWN, 503, "draining" },
		{ -ECONNRESET, 503, "daemon_unavailable" },
		{ -E2BIG, 400, "invalid_value" },
		{ -ENOMEM, 500, "internal_error" },
	};

	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
		struct gw_err e;
		json_t *j, *err;

		gw_err_from_status(&e, t[i].status);
		ck_assert_int_eq(e.http, t[i].http);
		ck_assert_str_eq(e.code, t[i].code);
		j = gw_err_json(&e);
		err = json_object_get(j, "error");
		ck_assert_uint_eq(json_object_size(j), 1);
		ck_assert_uint_eq(json_object_size(err), 4);	/* param is there, as null */
		ck_assert(json_is_null(json_object_get(err, "param")));
		ck_assert_str_eq(json_string_value(json_object_get(err, "code")), t[i].code);
		json_decref(j);
	}
}
END_TEST

static Suite *gateway_suite(void)
{
	Suite *s = suite_create("gateway");
	TCase *tc = tcase_create("gateway");

	tcase_add_test(tc, test_stop_scan);
	tcase_add_test(tc, test_conf);
	tcase_add_test(tc, test_keys);
	tcase_add_test(tc, test_parse_ok);
	tcase_add_test(tc, test_parse_refused);
	tcase_add_test(tc, test_err_status);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(gateway_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
