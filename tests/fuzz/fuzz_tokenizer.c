/* libFuzzer target for the tokenizer: the bytes before the first NUL are
 * a tokenizer.json, those after it a text; a tokenizer that loads encodes
 * the text (with and without special tokens), decodes the ids whole and
 * id by id. Also linked into tests/tokenizer/fuzz_replay for make check. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "client/tokenizer_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const uint8_t *nul = memchr(data, 0, size);
	size_t json_len = nul ? (size_t)(nul - data) : size;
	const char *text = nul ? (const char *)nul + 1 : "Hello world, 東京 <s> 12345 \xff!";
	size_t text_len = nul ? size - json_len - 1 : strlen(text);
	struct mlens_tokenizer *tok;
	struct mlens_detok *d;
	char err[512], buf[4096];
	int32_t ids[1024];
	size_t n, len;
	const char *t;

	if (tok_load_json((const char *)data, json_len, "fuzz/tokenizer.json", &tok, err, sizeof(err)))
		return 0;
	for (unsigned fl = 0; fl < 2; fl++) {
		if (mlens_tokenizer_encode(tok, text, text_len, fl ? MLENS_TOK_ADD_SPECIAL : 0, ids,
					   1024, &n))
			continue;
		mlens_tokenizer_decode(tok, ids, n, fl ? MLENS_TOK_SKIP_SPECIAL : 0, buf, sizeof(buf), &len);
		if (mlens_detok_new(tok, fl ? MLENS_TOK_SKIP_SPECIAL : 0, &d))
			continue;
		for (size_t i = 0; i < n; i++)
			mlens_detok_push(d, ids[i], &t, &len);
		mlens_detok_flush(d, &t, &len);
		mlens_detok_free(d);
	}
	/* ids the encoder never makes: every id of a small vocabulary */
	for (uint32_t i = 0; i < mlens_tokenizer_vocab_size(tok) && i < 1024; i++)
		ids[i] = (int32_t)i;
	n = mlens_tokenizer_vocab_size(tok) < 1024 ? mlens_tokenizer_vocab_size(tok) : 1024;
	mlens_tokenizer_decode(tok, ids, n, 0, buf, sizeof(buf), &len);
	mlens_tokenizer_free(tok);
	return 0;
}
