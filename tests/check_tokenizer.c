/* Description: the tokenizer of libmlens against Hugging Face tokenizers:
 * every golden of tests/tokenizer/fixtures (made by make_fixtures.py:
 * trained byte-level and SentencePiece-style tokenizers, Mixtral's and
 * Qwen's real ones) encodes and decodes to exactly what HF gave; the
 * incremental decoder emits the same text a whole decode gives, never a
 * cut character; BOS/EOS from the config files; bad tokenizer.json files
 * get a message naming the file and the component. */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <jansson.h>
#include "client/mlens_tokenizer.h"

static char tmp_root[256];

static const char *srcdir(void)
{
	const char *s = getenv("MLENS_SRCDIR");

	return s ? s : ".";
}

/* The fixture's directory: the committed one, or a temporary copy with
 * tokenizer.json.gz unpacked. */
static void fixture_dir(const char *name, char *out, size_t len)
{
	char src[512], cmd[4096];

	snprintf(src, sizeof(src), "%s/tests/tokenizer/fixtures/%s", srcdir(), name);
	snprintf(cmd, sizeof(cmd), "%s/tokenizer.json", src);
	if (!access(cmd, R_OK)) {
		snprintf(out, len, "%s", src);
		return;
	}
	snprintf(out, len, "%s/%s", tmp_root, name);
	snprintf(cmd, sizeof(cmd),
		 "mkdir -p '%s' && gzip -dc '%s/tokenizer.json.gz' > '%s/tokenizer.json' && "
		 "for f in tokenizer_config.json generation_config.json; do "
		 "[ ! -f '%s/'$f ] || cp '%s/'$f '%s/'; done",
		 out, src, out, src, src, out);
	ck_assert_int_eq(system(cmd), 0);
}

static struct mlens_tokenizer *open_fixture(const char *name)
{
	char dir[512], err[512];
	struct mlens_tokenizer *tok;
	int rc;

	fixture_dir(name, dir, sizeof(dir));
	rc = mlens_tokenizer_open(dir, &tok, err, sizeof(err));
	ck_assert_msg(rc == 0, "open %s: %d %s", name, rc, err);
	return tok;
}

static int hexval(char c)
{
	return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
}

static void print_ids(const char *what, const int32_t *v, size_t n)
{
	fprintf(stderr, "  %s:", what);
	for (size_t i = 0; i < n && i < 64; i++)
		fprintf(stderr, " %d", v[i]);
	fprintf(stderr, n > 64 ? " ...\n" : "\n");
}

static bool ids_match(json_t *want, const int32_t *got, size_t n)
{
	if (json_array_size(want) != n)
		return false;
	for (size_t i = 0; i < n; i++)
		if (json_integer_value(json_array_get(want, i)) != got[i])
			return false;
	return true;
}

static size_t json_ids(json_t *a, int32_t *out, size_t cap)
{
	size_t n = json_array_size(a);

	ck_assert_uint_le(n, cap);
	for (size_t i = 0; i < n; i++)
		out[i] = (int32_t)json_integer_value(json_array_get(a, i));
	return n;
}

/* s without its U+FFFD characters; returns the new length. */
static size_t strip_fffd(char *s, size_t n)
{
	size_t w = 0;

	for (size_t i = 0; i < n; i++) {
		if (i + 3 <= n && !memcmp(s + i, "\xEF\xBF\xBD", 3)) {
			i += 2;
			continue;
		}
		s[w++] = s[i];
	}
	return w;
}

/* Decode ids one at a time through mlens_detok; the pieces, joined, must
 * be what a whole decode gives, and each piece must be valid UTF-8. */
static bool stream_matches(struct mlens_tokenizer *tok, const int32_t *ids, size_t n,
			   unsigned flags, const char *want, size_t want_len)
{
	struct mlens_detok *d;
	char *acc = malloc(want_len * 4 + 64);
	size_t got = 0, len;
	const char *t;
	bool ok = true;

	ck_assert_int_eq(mlens_detok_new(tok, flags, &d), 0);
	for (size_t i = 0; i <= n; i++) {
		int rc = i < n ? mlens_detok_push(d, ids[i], &t, &len) : mlens_detok_flush(d, &t, &len);

		ck_assert_int_eq(rc, 0);
		/* a piece is whole characters: jansson checks UTF-8 */
		json_t *js = json_stringn(t, len);

		if (!js)
			ok = false;
		json_decref(js);
		if (got + len > want_len * 4 + 60) {
			ok = false;
			break;
		}
		memcpy(acc + got, t, len);
		got += len;
	}
	mlens_detok_free(d);
	if (memmem(want, want_len, "\xEF\xBF\xBD", 3)) {
		/* an invalid byte run: HF puts U+FFFD for each of its bytes, the
		 * incremental decoder for each invalid subpart as it arrives;
		 * the rest must agree */
		bool has = memmem(acc, got, "\xEF\xBF\xBD", 3) != NULL;
		char *w = malloc(want_len + 1), *a = malloc(got + 1);

		memcpy(w, want, want_len);
		memcpy(a, acc, got);
		size_t al = strip_fffd(a, got), wl = strip_fffd(w, want_len);

		ok = ok && has && al == wl && !memcmp(a, w, al);
		free(w);
		free(a);
	} else {
		ok = ok && got == want_len && !memcmp(acc, want, got);
	}
	if (!ok)
		fprintf(stderr, "  stream: \"%.*s\" want \"%.*s\"\n", (int)got, acc, (int)want_len, want);
	free(acc);
	return ok;
}

#define GOLDEN_MAX_IDS 65536
#define GOLDEN_MAX_TEXT (1 << 20)

/* Encode text as the golden line's key says; false (and a report) when
 * the ids differ. */
static bool golden_encode(struct mlens_tokenizer *tok, const char *where, json_t *g,
			  const char *text, size_t tlen, bool special)
{
	static int32_t ids[GOLDEN_MAX_IDS], want[GOLDEN_MAX_IDS];
	json_t *exp = json_object_get(g, special ? "ids_special" : "ids");
	size_t n;

	ck_assert_int_eq(mlens_tokenizer_encode(tok, text, tlen, special ? MLENS_TOK_ADD_SPECIAL : 0,
						ids, GOLDEN_MAX_IDS, &n), 0);
	if (ids_match(exp, ids, n))
		return true;
	fprintf(stderr, "%s: encode%s \"%s\"\n", where, special ? " with specials" : "",
		json_string_value(json_object_get(g, "text")));
	print_ids("got ", ids, n);
	print_ids("want", want, json_ids(exp, want, GOLDEN_MAX_IDS));
	return false;
}

/* Decode the ids under key (whole, then id by id) and compare with the
 * golden text; cut byte runs are left to the stream when stream_cut. */
static bool golden_decode(struct mlens_tokenizer *tok, const char *where, json_t *g,
			  const char *key, bool skip, bool stream_cut)
{
	static int32_t ids[GOLDEN_MAX_IDS];
	static char dec[GOLDEN_MAX_TEXT];
	json_t *exp = json_object_get(g, skip ? "decoded_skip" : "decoded");
	unsigned fl = skip ? MLENS_TOK_SKIP_SPECIAL : 0;
	size_t n = json_ids(json_object_get(g, key), ids, GOLDEN_MAX_IDS), len;
	bool ok = true;

	ck_assert_int_eq(mlens_tokenizer_decode(tok, ids, n, fl, dec, sizeof(dec), &len), 0);
	if (len != json_string_length(exp) || memcmp(dec, json_string_value(exp), len)) {
		fprintf(stderr, "%s: decode %s%s: got \"%s\" want \"%s\"\n", where, key,
			skip ? " (skip special)" : "", dec, json_string_value(exp));
		ok = false;
	}
	/* a cut byte run in a decode_only line: test_detok_* state what
	 * streaming gives there */
	if ((stream_cut || !strstr(json_string_value(exp), "\xEF\xBF\xBD")) &&
	    !stream_matches(tok, ids, n, fl, json_string_value(exp), json_string_length(exp))) {
		fprintf(stderr, "%s: streamed decode %s%s differs\n", where, key,
			skip ? " (skip special)" : "");
		ok = false;
	}
	return ok;
}

/* Check every golden line of one fixture; returns the mismatch count. */
static int check_goldens(const char *name)
{
	char path[1024], where[64];
	struct mlens_tokenizer *tok = open_fixture(name);
	json_error_t jerr;
	FILE *f;
	char *line = NULL;
	size_t cap = 0, lines = 0;
	int bad = 0;

	snprintf(path, sizeof(path), "%s/tests/tokenizer/fixtures/%s/golden.jsonl", srcdir(), name);
	f = fopen(path, "r");
	ck_assert_msg(f != NULL, "%s missing", path);
	while (getline(&line, &cap, f) > 0) {
		json_t *g = json_loads(line, JSON_ALLOW_NUL, &jerr), *hex;
		const char *text;
		char *raw = NULL;
		size_t tlen;
		bool ok;

		lines++;
		ck_assert_msg(g != NULL, "%s:%zu: %s", path, lines, jerr.text);
		snprintf(where, sizeof(where), "%s:%zu", name, lines);
		if (json_object_get(g, "decode_only")) {
			ok = golden_decode(tok, where, g, "decode_only", false, false);
			ok &= golden_decode(tok, where, g, "decode_only", true, false);
			bad += !ok;
			json_decref(g);
			continue;
		}
		text = json_string_value(json_object_get(g, "text"));
		tlen = json_string_length(json_object_get(g, "text"));
		if ((hex = json_object_get(g, "bytes"))) {	/* not UTF-8: the input is these bytes */
			tlen = json_string_length(hex) / 2;
			raw = malloc(tlen + 1);
			for (size_t i = 0; i < tlen; i++)
				raw[i] = (char)(hexval(json_string_value(hex)[2 * i]) << 4 |
						hexval(json_string_value(hex)[2 * i + 1]));
			text = raw;
		}
		ok = golden_encode(tok, where, g, text, tlen, false);
		ok &= golden_encode(tok, where, g, text, tlen, true);
		/* decode the golden ids, whatever encode gave */
		ok &= golden_decode(tok, where, g, "ids", false, true);
		ok &= golden_decode(tok, where, g, "ids_special", true, true);
		bad += !ok;
		free(raw);
		json_decref(g);
	}
	ck_assert_uint_gt(lines, 50);
	free(line);
	fclose(f);
	mlens_tokenizer_free(tok);
	return bad;
}

static const char *const fixtures[] = { "bytelevel", "gpt2", "llama3", "misc", "spm", "metaspace", "mistral_v1", "qwen" };

START_TEST(test_golden)
{
	ck_assert_int_eq(check_goldens(fixtures[_i]), 0);
}
END_TEST

/* Push ids one by one; each piece must be exactly the next of want[]
 * (the empty string for a held one), then flush gives want_flush. */
static void expect_stream(struct mlens_tokenizer *tok, unsigned flags, const int32_t *ids, size_t n,
			  const char *const *want, const char *want_flush)
{
	struct mlens_detok *d;
	const char *t;
	size_t len;

	ck_assert_int_eq(mlens_detok_new(tok, flags, &d), 0);
	for (size_t i = 0; i < n; i++) {
		ck_assert_int_eq(mlens_detok_push(d, ids[i], &t, &len), 0);
		ck_assert_uint_eq(len, strlen(t));
		ck_assert_msg(!strcmp(t, want[i]), "id %zu (%d): got \"%s\" want \"%s\"", i, ids[i], t,
			      want[i]);
	}
	ck_assert_int_eq(mlens_detok_flush(d, &t, &len), 0);
	ck_assert_str_eq(t, want_flush);
	/* flushed: the decoder starts over, as at the real start */
	ck_assert_int_eq(mlens_detok_push(d, ids[0], &t, &len), 0);
	ck_assert_str_eq(t, want[0]);
	mlens_detok_free(d);
}

/* Byte-level tokens cutting CJK characters in the middle: nothing until
 * the character is whole. */
START_TEST(test_detok_bytelevel_split)
{
	struct mlens_tokenizer *tok = open_fixture("bytelevel");
	int32_t ids[16];
	size_t n;
	static const char *const want[] = { "", "", "東", "", "", "京", "!" };

	ck_assert_int_eq(mlens_tokenizer_encode(tok, "東京!", strlen("東京!"), 0, ids, 16, &n), 0);
	ck_assert_uint_eq(n, 7);	/* one token per byte: this vocabulary has no CJK merges */
	expect_stream(tok, 0, ids, n, want, "");
	mlens_tokenizer_free(tok);
}
END_TEST

/* SentencePiece byte fallback: <0xE4><0xB8><0xAD> is 中; a run cut short
 * is U+FFFD at flush; a byte that can start nothing is U+FFFD at once. */
START_TEST(test_detok_byte_fallback)
{
	struct mlens_tokenizer *tok = open_fixture("spm");
	int32_t e4 = mlens_tokenizer_token_id(tok, "<0xE4>", 6), b8 = mlens_tokenizer_token_id(tok, "<0xB8>", 6);
	int32_t ad = mlens_tokenizer_token_id(tok, "<0xAD>", 6), ff = mlens_tokenizer_token_id(tok, "<0xFF>", 6);
	int32_t x = mlens_tokenizer_token_id(tok, "x", 1), hello[8];
	size_t n;

	ck_assert_int_ge(e4, 0);
	ck_assert_int_ge(x, 0);
	{
		int32_t ids[] = { e4, b8, ad, x };
		static const char *const want[] = { "", "", "中", "x" };

		expect_stream(tok, 0, ids, 4, want, "");
	}
	{
		int32_t ids[] = { x, e4, b8 };
		static const char *const want[] = { "x", "", "" };

		expect_stream(tok, 0, ids, 3, want, "\xEF\xBF\xBD\xEF\xBF\xBD");
	}
	{
		int32_t ids[] = { x, ff, x };
		static const char *const want[] = { "x", "\xEF\xBF\xBD", "x" };

		expect_stream(tok, 0, ids, 3, want, "");
	}
	{
		/* a whole decode turns the run E4 B8 AD FF into four U+FFFD (as
		 * HF's ByteFallback); the stream has shown 中 already and goes
		 * on with one U+FFFD for FF */
		int32_t ids[] = { e4, b8, ad, ff, x };
		static const char *const want[] = { "", "", "中", "\xEF\xBF\xBD", "x" };

		expect_stream(tok, 0, ids, 5, want, "");
	}
	/* the leading space SentencePiece strips only at the real start, and
	 * a skipped BOS changes nothing */
	ck_assert_int_eq(mlens_tokenizer_encode(tok, "Hello world", 11, MLENS_TOK_ADD_SPECIAL, hello, 8, &n), 0);
	ck_assert_int_eq(hello[0], 1);
	{
		char full[64];
		size_t len;
		struct mlens_detok *d;
		const char *t;
		char acc[64] = "";

		ck_assert_int_eq(mlens_tokenizer_decode(tok, hello, n, MLENS_TOK_SKIP_SPECIAL, full, 64, &len), 0);
		ck_assert_str_eq(full, "Hello world");
		ck_assert_int_eq(mlens_detok_new(tok, MLENS_TOK_SKIP_SPECIAL, &d), 0);
		for (size_t i = 0; i < n; i++) {
			ck_assert_int_eq(mlens_detok_push(d, hello[i], &t, &len), 0);
			strncat(acc, t, sizeof(acc) - strlen(acc) - 1);
		}
		ck_assert_str_eq(acc, "Hello world");
		ck_assert_int_eq(mlens_detok_push(d, -1, &t, &len), -EINVAL);
		mlens_detok_free(d);
	}
	mlens_tokenizer_free(tok);
}
END_TEST

/* Random id lists, id by id: the pieces join to the whole decode. Byte
 * tokens (<0xNN>) are drawn again: in random runs HF's ByteFallback
 * would turn whole runs, valid characters included, into U+FFFD, which a
 * stream that has shown them cannot follow (test_detok_byte_fallback
 * states what it does there). */
START_TEST(test_detok_random)
{
	struct mlens_tokenizer *tok = open_fixture(fixtures[_i]);
	uint32_t v = mlens_tokenizer_vocab_size(tok);
	uint64_t seed = 12345;
	static char dec[65536];
	int32_t ids[24];
	size_t len;
	int bad = 0;

	for (int r = 0; r < 300; r++) {
		size_t n = 1 + r % 24;

		for (size_t i = 0; i < n; i++) {
			const char *t;
			size_t tl;

			do {
				seed = seed * 6364136223846793005ull + 1442695040888963407ull;
				ids[i] = (int32_t)((seed >> 33) % v);
				t = mlens_tokenizer_id_token(tok, ids[i], &tl);
			} while (!t || (tl == 6 && !memcmp(t, "<0x", 3)));
		}
		for (unsigned fl = 0; fl <= MLENS_TOK_SKIP_SPECIAL; fl += MLENS_TOK_SKIP_SPECIAL) {
			ck_assert_int_eq(mlens_tokenizer_decode(tok, ids, n, fl, dec, sizeof(dec), &len), 0);
			bad += !stream_matches(tok, ids, n, fl, dec, len);
		}
	}
	ck_assert_int_eq(bad, 0);
	mlens_tokenizer_free(tok);
}
END_TEST

START_TEST(test_lookups)
{
	struct mlens_tokenizer *tok = open_fixture("spm");
	int32_t eos[4];
	size_t len;

	ck_assert_int_eq(mlens_tokenizer_token_id(tok, "<s>", 3), 1);
	ck_assert_int_eq(mlens_tokenizer_token_id(tok, "[INST]", 6) > 2, 1);
	ck_assert_int_eq(mlens_tokenizer_token_id(tok, "no such token", 13), -ENOENT);
	ck_assert_str_eq(mlens_tokenizer_id_token(tok, 2, &len), "</s>");
	ck_assert_uint_eq(len, 4);
	ck_assert_ptr_null(mlens_tokenizer_id_token(tok, -3, NULL));
	ck_assert_ptr_null(mlens_tokenizer_id_token(tok, (int32_t)mlens_tokenizer_vocab_size(tok), NULL));
	ck_assert_int_eq(mlens_tokenizer_is_special(tok, 1), 1);
	ck_assert_int_eq(mlens_tokenizer_is_special(tok, mlens_tokenizer_token_id(tok, "x", 1)), 0);
	ck_assert_int_eq(mlens_tokenizer_bos(tok), 1);
	ck_assert_int_eq(mlens_tokenizer_eos(tok, eos, 4), 1);
	ck_assert_int_eq(eos[0], 2);
	mlens_tokenizer_free(tok);

	/* Qwen: no BOS in tokenizer_config, generation_config lists two EOS */
	tok = open_fixture("qwen");
	ck_assert_int_eq(mlens_tokenizer_bos(tok), 151643);
	ck_assert_int_eq(mlens_tokenizer_eos(tok, eos, 1), 2);
	ck_assert_int_eq(eos[0], 151645);
	ck_assert_int_eq(mlens_tokenizer_eos(tok, eos, 4), 2);
	ck_assert_int_eq(eos[1], 151643);
	ck_assert_uint_eq(mlens_tokenizer_vocab_size(tok), 151646);
	mlens_tokenizer_free(tok);

	/* Llama 3 style: no tokenizer_config; BOS and EOS ids from
	 * generation_config, the template adding BOS */
	tok = open_fixture("llama3");
	ck_assert_int_eq(mlens_tokenizer_bos(tok), 0);
	ck_assert_int_eq(mlens_tokenizer_eos(tok, eos, 4), 2);
	ck_assert_int_eq(eos[0], 1);
	ck_assert_int_eq(eos[1], 2);
	mlens_tokenizer_free(tok);

	/* byte-level fixture: no BOS at all, EOS from tokenizer_config only */
	tok = open_fixture("bytelevel");
	ck_assert_int_eq(mlens_tokenizer_bos(tok), -ENOENT);
	ck_assert_int_eq(mlens_tokenizer_eos(tok, eos, 4), 1);
	ck_assert_int_eq(eos[0], mlens_tokenizer_token_id(tok, "<|im_end|>", 10));
	mlens_tokenizer_free(tok);
}
END_TEST

START_TEST(test_short_buffers)
{
	struct mlens_tokenizer *tok = open_fixture("bytelevel");
	int32_t ids[64], bad = (int32_t)mlens_tokenizer_vocab_size(tok);
	char buf[64];
	size_t n, len;

	ck_assert_int_eq(mlens_tokenizer_encode(tok, "Hello world", 11, 0, ids, 1, &n), -ENOBUFS);
	ck_assert_uint_gt(n, 1);
	ck_assert_int_eq(mlens_tokenizer_encode(tok, "Hello world", 11, 0, ids, n, &n), 0);
	ck_assert_int_eq(mlens_tokenizer_decode(tok, ids, n, 0, buf, 11, &len), -ENOBUFS);
	ck_assert_uint_eq(len, 11);
	ck_assert_int_eq(mlens_tokenizer_decode(tok, ids, n, 0, buf, 12, &len), 0);
	ck_assert_str_eq(buf, "Hello world");
	ck_assert_int_eq(mlens_tokenizer_decode(tok, &bad, 1, 0, buf, 64, &len), -EINVAL);
	ck_assert_int_eq(mlens_tokenizer_encode(tok, "", 0, 0, ids, 0, &n), 0);
	ck_assert_uint_eq(n, 0);
	mlens_tokenizer_free(tok);
}
END_TEST

struct enc_job {
	struct mlens_tokenizer *tok;
	int ok;
};

static void *enc_thread(void *arg)
{
	struct enc_job *j = arg;
	static const char *texts[] = { "The quick brown fox jumps over the lazy dog.",
				       "東京是日本的首都 and 12345 more words here",
				       "It's, I'm, we'll, they've, you'd" };
	int32_t a[256], b[256];
	size_t na, nb;

	j->ok = 1;
	for (int r = 0; r < 300; r++) {
		const char *t = texts[r % 3];

		if (mlens_tokenizer_encode(j->tok, t, strlen(t), 0, a, 256, &na) ||
		    mlens_tokenizer_encode(j->tok, t, strlen(t), 0, b, 256, &nb) || na != nb ||
		    memcmp(a, b, na * sizeof(*a)))
			j->ok = 0;
	}
	return NULL;
}

/* Several threads encode with one tokenizer (its word cache is shared). */
START_TEST(test_threads)
{
	struct enc_job j[4];
	pthread_t th[4];

	j[0].tok = open_fixture("qwen");
	for (int i = 0; i < 4; i++) {
		j[i].tok = j[0].tok;
		ck_assert_int_eq(pthread_create(&th[i], NULL, enc_thread, &j[i]), 0);
	}
	for (int i = 0; i < 4; i++) {
		pthread_join(th[i], NULL);
		ck_assert_int_eq(j[i].ok, 1);
	}
	mlens_tokenizer_free(j[0].tok);
}
END_TEST

/* A tokenizer.json of the given text in a fresh directory; returns open's
 * result, err holding its message. */
static int open_text(const char *json, char *err, size_t len)
{
	char dir[512], path[600];
	struct mlens_tokenizer *tok = NULL;
	FILE *f;
	int rc;

	snprintf(dir, sizeof(dir), "%s/bad.XXXXXX", tmp_root);
	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
	f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	fputs(json, f);
	fclose(f);
	rc = mlens_tokenizer_open(dir, &tok, err, len);
	ck_assert_ptr_null(tok);
	ck_assert_msg(strstr(err, path) != NULL, "message does not name the file: %s", err);
	return rc;
}

#define BPE_OK "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\"]}"

START_TEST(test_bad_files)
{
	struct mlens_tokenizer *tok = NULL;
	char err[512];

	ck_assert_int_eq(mlens_tokenizer_open("/nonexistent-mlens-dir", &tok, err, sizeof(err)), -ENOENT);
	ck_assert_ptr_null(tok);
	ck_assert_ptr_nonnull(strstr(err, "/nonexistent-mlens-dir/tokenizer.json"));

	{
		char dir[512], path[600];

		snprintf(dir, sizeof(dir), "%s/dir.XXXXXX", tmp_root);
		ck_assert_ptr_nonnull(mkdtemp(dir));
		snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
		ck_assert_int_eq(mkdir(path, 0700), 0);
		ck_assert_int_eq(mlens_tokenizer_open(dir, &tok, err, sizeof(err)), -EINVAL);
		ck_assert_ptr_nonnull(strstr(err, "tokenizer.json: not a regular file"));
	}
	ck_assert_int_eq(open_text("{\"model\": {", err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "not valid JSON"));
	ck_assert_int_eq(open_text("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", err, sizeof(err)), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(err, "model \"WordPiece\" is not supported"));
	ck_assert_int_eq(open_text("{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", err, sizeof(err)), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(err, "\"Unigram\""));
	ck_assert_int_eq(open_text("{\"normalizer\": {\"type\": \"Lowercase\"}, " BPE_OK "}", err, sizeof(err)), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(err, "normalizer \"Lowercase\" is not supported"));
	ck_assert_int_eq(open_text("{\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": "
				   "[{\"type\": \"Whitespace\"}]}, " BPE_OK "}", err, sizeof(err)), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(err, "pre_tokenizer \"Whitespace\" is not supported"));
	ck_assert_int_eq(open_text("{\"decoder\": {\"type\": \"WordPiece\"}, " BPE_OK "}", err, sizeof(err)), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(err, "decoder \"WordPiece\" is not supported"));
	ck_assert_int_eq(open_text("{\"post_processor\": {\"type\": \"BertProcessing\"}, " BPE_OK "}", err, sizeof(err)), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(err, "post_processor \"BertProcessing\""));
	ck_assert_int_eq(open_text("{\"pre_tokenizer\": {\"type\": \"Split\", \"behavior\": \"Isolated\", "
				   "\"pattern\": {\"Regex\": \"(\"}}, " BPE_OK "}", err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "does not compile"));
	ck_assert_int_eq(open_text("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, "
				   "\"merges\": [\"a b\"]}}", err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "merge 0: the merged token \"ab\" is not in the vocabulary"));
	ck_assert_int_eq(open_text("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, "
				   "\"merges\": [\"a c\"]}}", err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "merge 0: \"c\" is not in the vocabulary"));
	ck_assert_int_eq(open_text("[1, 2]", err, sizeof(err)), -EINVAL);
	ck_assert_int_eq(open_text("{\"added_tokens\": [{\"id\": 99}], " BPE_OK "}", err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "added_tokens[0]"));
}
END_TEST

static Suite *tokenizer_suite(void)
{
	Suite *s = suite_create("tokenizer");
	TCase *g = tcase_create("golden");

	tcase_set_timeout(g, 60);
	tcase_add_loop_test(g, test_golden, 0, sizeof(fixtures) / sizeof(fixtures[0]));
	suite_add_tcase(s, g);

	TCase *a = tcase_create("api");

	tcase_set_timeout(a, 60);
	tcase_add_test(a, test_detok_bytelevel_split);
	tcase_add_loop_test(a, test_detok_random, 0, sizeof(fixtures) / sizeof(fixtures[0]));
	tcase_add_test(a, test_detok_byte_fallback);
	tcase_add_test(a, test_lookups);
	tcase_add_test(a, test_short_buffers);
	tcase_add_test(a, test_threads);
	tcase_add_test(a, test_bad_files);
	suite_add_tcase(s, a);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(tokenizer_suite());
	int failed;

	/* made before the tests fork, so that the parent removes it */
	snprintf(tmp_root, sizeof(tmp_root), "%s/check_tokenizer.XXXXXX",
		 getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if (!mkdtemp(tmp_root)) {
		perror("check_tokenizer: mkdtemp");
		return EXIT_FAILURE;
	}
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	{
		char cmd[512];

		snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp_root);
		if (system(cmd))
			fprintf(stderr, "check_tokenizer: could not remove %s\n", tmp_root);
	}
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
