/* mlens-bench tokenizer: libmlens's tokenizer on one thread over a text
 * file or a generated English-like corpus: encode MB/s and tokens/s (the
 * first pass, which fills the word cache, and a second), whole decode and
 * the incremental decoder's tokens/s. */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "client/mlens_tokenizer.h"
#include "tests/bench/bench.h"

/* Common English words, most frequent first: drawn with a Zipf-like
 * weight they make text whose word statistics resemble prose. */
static const char *const words[] = {
	"the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "as", "was", "with", "be",
	"by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
	"an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has",
	"there", "been", "if", "more", "when", "will", "would", "who", "so", "no", "she", "other",
	"its", "may", "these", "what", "them", "than", "some", "him", "time", "into", "only", "do",
	"could", "new", "about", "two", "first", "then", "also", "any", "like", "our", "very",
	"people", "model", "memory", "experts", "tokens", "between", "through", "because",
	"government", "development", "information", "university", "however", "particular",
	"understanding", "performance", "throughput", "scheduling", "approximately", "language",
	"mixture", "inference", "bandwidth", "processors", "transformer", "architecture",
	"international", "responsibility", "characteristics", "Wednesday", "London", "Paris",
};

static size_t pick(uint64_t *s)
{
	size_t n = sizeof(words) / sizeof(words[0]);

	*s = *s * 6364136223846793005ull + 1442695040888963407ull;
	/* rank ~ n^u: frequent words far more often than rare ones */
	double u = (double)(*s >> 11) / (double)(1ull << 53);
	size_t r = (size_t)(u * u * u * (double)n);

	return r < n ? r : n - 1;
}

/* n bytes of sentences: capitals, commas, full stops, numbers, newlines. */
static char *make_corpus(size_t n)
{
	char *buf = malloc(n + 64);
	uint64_t s = 42;
	size_t len = 0, in_sentence = 0;

	if (!buf)
		return NULL;
	while (len < n) {
		const char *w = words[pick(&s)];
		int k;

		if (in_sentence == 0)
			k = snprintf(buf + len, 64, "%c%s", w[0] >= 'a' ? w[0] - 32 : w[0], w + 1);
		else if (s % 97 == 0)
			k = snprintf(buf + len, 64, " %u", (unsigned)(s >> 40) % 10000);
		else
			k = snprintf(buf + len, 64, " %s", w);
		len += (size_t)k;
		in_sentence++;
		if (in_sentence > 6 && s % 11 == 0) {
			len += (size_t)snprintf(buf + len, 8, "%s", s % 7 ? ". " : ".\n");
			in_sentence = 0;
		} else if (s % 13 == 0) {
			buf[len++] = ',';
		}
	}
	buf[n] = 0;
	return buf;
}

static char *read_all(const char *path, size_t *n)
{
	FILE *f = fopen(path, "rb");
	char *buf = NULL;
	long sz;

	if (!f)
		return NULL;
	if (!fseek(f, 0, SEEK_END) && (sz = ftell(f)) >= 0 && !fseek(f, 0, SEEK_SET) &&
	    (buf = malloc((size_t)sz + 1)) && fread(buf, 1, (size_t)sz, f) == (size_t)sz) {
		*n = (size_t)sz;
		buf[sz] = 0;
	} else {
		free(buf);
		buf = NULL;
	}
	fclose(f);
	return buf;
}

/* Encode text in pieces of about chunk bytes cut at spaces (prompts,
 * not one giant string); returns seconds, the ids in *ids. */
static double encode_pass(struct mlens_tokenizer *tok, const char *text, size_t n, size_t chunk,
			  int32_t *ids, size_t cap, size_t *n_ids, int *rc)
{
	uint64_t t0 = mlens_bench_now_ns();
	size_t at = 0, total = 0, got;

	*rc = 0;
	while (at < n && !*rc) {
		size_t end = at + chunk < n ? at + chunk : n;

		while (end < n && text[end] != ' ' && end - at < 2 * chunk)
			end++;
		*rc = mlens_tokenizer_encode(tok, text + at, end - at, 0, ids + total, cap - total, &got);
		total += got;
		at = end;
	}
	*n_ids = total;
	return (double)(mlens_bench_now_ns() - t0) / 1e9;
}

int mlens_bench_tokenizer(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "model", required_argument, NULL, 'm' },
		{ "input", required_argument, NULL, 'i' },
		{ "bytes", required_argument, NULL, 'b' },
		{ "chunk", required_argument, NULL, 'c' },
		{ "json", no_argument, NULL, 'j' },
		{ NULL, 0, NULL, 0 },
	};
	const char *dir = NULL, *input = NULL;
	long long bytes = 4000000, chunk = 4096;
	struct mlens_tokenizer *tok = NULL;
	struct mlens_detok *d = NULL;
	char err[512], *text = NULL, *out = NULL;
	int32_t *ids = NULL;
	size_t n = 0, n_ids = 0, cap, out_len;
	double t_cold, t_warm, t_dec, t_stream;
	bool json = false;
	int c, rc;

	optind = 1;
	while ((c = getopt_long(argc, argv, "m:i:b:c:j", opts, NULL)) != -1) {
		switch (c) {
		case 'm': dir = optarg; break;
		case 'i': input = optarg; break;
		case 'b': bytes = mlens_bench_parse_count(optarg); break;
		case 'c': chunk = mlens_bench_parse_count(optarg); break;
		case 'j': json = true; break;
		default: return 2;
		}
	}
	if (!dir || bytes <= 0 || chunk <= 0) {
		fprintf(stderr, "mlens-bench tokenizer: --model DIR (holding tokenizer.json) is required; "
			"--bytes and --chunk take counts > 0\n");
		return 2;
	}
	if ((rc = mlens_tokenizer_open(dir, &tok, err, sizeof(err)))) {
		fprintf(stderr, "mlens-bench tokenizer: %s\n", err);
		return 1;
	}
	text = input ? read_all(input, &n) : make_corpus((size_t)(n = (size_t)bytes));
	if (!text) {
		fprintf(stderr, "mlens-bench tokenizer: %s: %s\n", input ? input : "corpus",
			strerror(errno ? errno : ENOMEM));
		rc = 1;
		goto out;
	}
	cap = n + 1024;
	if (!(ids = malloc(cap * sizeof(*ids))) || !(out = malloc(4 * n + 64))) {
		rc = 1;
		goto out;
	}
	t_cold = encode_pass(tok, text, n, (size_t)chunk, ids, cap, &n_ids, &rc);
	if (!rc)
		t_warm = encode_pass(tok, text, n, (size_t)chunk, ids, cap, &n_ids, &rc);
	if (rc) {
		fprintf(stderr, "mlens-bench tokenizer: encode: %s\n", strerror(-rc));
		rc = 1;
		goto out;
	}
	uint64_t t0 = mlens_bench_now_ns();

	if ((rc = mlens_tokenizer_decode(tok, ids, n_ids, 0, out, 4 * n + 64, &out_len))) {
		fprintf(stderr, "mlens-bench tokenizer: decode: %s\n", strerror(-rc));
		rc = 1;
		goto out;
	}
	t_dec = (double)(mlens_bench_now_ns() - t0) / 1e9;
	if (mlens_detok_new(tok, 0, &d)) {
		rc = 1;
		goto out;
	}
	t0 = mlens_bench_now_ns();
	size_t streamed = 0;

	for (size_t i = 0; i < n_ids && !rc; i++) {
		const char *t;
		size_t len;

		rc = mlens_detok_push(d, ids[i], &t, &len);
		streamed += len;
	}
	t_stream = (double)(mlens_bench_now_ns() - t0) / 1e9;
	double bpt = (double)n / (double)n_ids, first = n / t_cold / 1e6, enc = n / t_warm / 1e6;
	double enc_tps = n_ids / t_warm, dec = out_len / t_dec / 1e6, dec_tps = n_ids / t_dec;
	double stream_tps = n_ids / t_stream;
	bool same = out_len == n && !memcmp(out, text, n);
	const char *src = input ? input : "generated";

	if (json)
		printf("{\"bench\":\"tokenizer\",\"model\":\"%s\",\"input\":\"%s\",\"bytes\":%zu,"
		       "\"tokens\":%zu,\"bytes_per_token\":%.3f,\"encode_first_mb_s\":%.2f,"
		       "\"encode_mb_s\":%.2f,\"encode_tokens_s\":%.0f,\"decode_mb_s\":%.2f,"
		       "\"decode_tokens_s\":%.0f,\"stream_tokens_s\":%.0f,\"roundtrip_ok\":%s}\n",
		       dir, src, n, n_ids, bpt, first, enc, enc_tps, dec, dec_tps, stream_tps,
		       same ? "true" : "false");
	else
		printf("tokenizer %s, %s text: %zu bytes, %zu tokens (%.2f bytes/token)\n"
		       "  encode, first pass   %8.2f MB/s\n"
		       "  encode               %8.2f MB/s  %10.0f tokens/s\n"
		       "  decode               %8.2f MB/s  %10.0f tokens/s\n"
		       "  incremental decode                %10.0f tokens/s\n"
		       "  round trip           %s\n",
		       dir, src, n, n_ids, bpt, first, enc, enc_tps, dec, dec_tps, stream_tps,
		       same ? "exact" : "differs (normalization)");
	rc = rc ? 1 : 0;
out:
	mlens_detok_free(d);
	mlens_tokenizer_free(tok);
	free(text);
	free(ids);
	free(out);
	return rc;
}
