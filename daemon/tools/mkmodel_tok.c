/* mlens-mkmodel's tokenizer: a byte-level BPE tokenizer.json (GPT-2's byte
 * alphabet, one token a byte, no merges) and a tokenizer_config.json with a
 * ChatML chat template, so a random-weight test model takes text and chats
 * end to end. Ids 0-2 are <unk>, <s> and </s> (Mixtral's BOS 1 and EOS 2),
 * the 256 bytes follow, then <|im_start|> and <|im_end|>. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jansson.h>

#include "daemon/errf.h"
#include "daemon/model/model_int.h"
#include "daemon/tools/mkmodel.h"

#define TOK_BYTES_FIRST 3
#define TOK_IM_START (TOK_BYTES_FIRST + 256)
#define TOK_IM_END (TOK_IM_START + 1)
_Static_assert(TOK_IM_END + 1 == MLENS_MKMODEL_TOKENIZER_VOCAB, "the tokenizer's size");

static const char chatml[] =
	"{% for message in messages %}"
	"{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
	"{% endfor %}"
	"{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/* GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for
 * themselves, the others for U+0100 on in order. Writes the UTF-8 of byte
 * b's symbol into out (at least 3 bytes + NUL). */
static void byte_symbol(int b, char *out)
{
	int cp, n = 0;

	if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) {
		cp = b;
	} else {
		for (int x = 0; x < b; x++)
			if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255)))
				n++;
		cp = 256 + n;
	}
	if (cp < 0x80) {
		out[0] = (char)cp;
		out[1] = 0;
	} else {
		out[0] = (char)(0xc0 | (cp >> 6));
		out[1] = (char)(0x80 | (cp & 0x3f));
		out[2] = 0;
	}
}

static json_t *added(int id, const char *content)
{
	return json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", id, "content", content,
			 "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special", 1);
}

static json_t *byte_level(void)
{
	return json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0,
			 "trim_offsets", 1, "use_regex", 1);
}

static json_t *tokenizer_json(void)
{
	static const char *const special[] = { "<unk>", "<s>", "</s>" };
	json_t *vocab = json_object(), *adds = json_array(), *model, *root;
	char sym[4];

	for (int i = 0; i < 3; i++) {
		json_object_set_new(vocab, special[i], json_integer(i));
		json_array_append_new(adds, added(i, special[i]));
	}
	for (int b = 0; b < 256; b++) {
		byte_symbol(b, sym);
		json_object_set_new(vocab, sym, json_integer(TOK_BYTES_FIRST + b));
	}
	json_object_set_new(vocab, "<|im_start|>", json_integer(TOK_IM_START));
	json_object_set_new(vocab, "<|im_end|>", json_integer(TOK_IM_END));
	json_array_append_new(adds, added(TOK_IM_START, "<|im_start|>"));
	json_array_append_new(adds, added(TOK_IM_END, "<|im_end|>"));
	model = json_pack("{s:s, s:n, s:n, s:n, s:n, s:b, s:b, s:b, s:o, s:[]}", "type", "BPE",
			  "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
			  "fuse_unk", 0, "byte_fallback", 0, "ignore_merges", 0, "vocab", vocab, "merges");
	root = json_pack("{s:s, s:n, s:n, s:o, s:n, s:o, s:n, s:o, s:o}", "version", "1.0",
			 "truncation", "padding", "added_tokens", adds, "normalizer",
			 "pre_tokenizer", byte_level(), "post_processor", "decoder", byte_level(),
			 "model", model);
	return root;
}

static json_t *tokenizer_config_json(void)
{
	return json_pack("{s:b, s:b, s:s, s:s, s:s, s:s, s:i}", "add_bos_token", 0, "add_eos_token", 0,
			 "bos_token", "<s>", "eos_token", "</s>", "chat_template", chatml,
			 "tokenizer_class", "PreTrainedTokenizerFast", "model_max_length", 1000000);
}

int mlens_mkmodel_write_tokenizer(const char *dir, int64_t vocab_size, char *err, size_t errlen)
{
	static const char *const names[] = { "tokenizer.json", "tokenizer_config.json" };
	json_t *docs[2];
	int rc = 0;

	if (vocab_size < MLENS_MKMODEL_TOKENIZER_VOCAB) {
		mlens_errf(err, errlen, "the tokenizer needs a vocabulary of at least %d tokens; the model has %lld",
			   MLENS_MKMODEL_TOKENIZER_VOCAB, (long long)vocab_size);
		return -EINVAL;
	}
	docs[0] = tokenizer_json();
	docs[1] = tokenizer_config_json();
	for (int i = 0; i < 2 && !rc; i++) {
		char *path = mlens_model_path(dir, names[i]);

		if (!docs[i] || !path) {
			mlens_errf(err, errlen, "%s: out of memory", dir);
			rc = -ENOMEM;
		} else if (json_dump_file(docs[i], path, JSON_INDENT(2))) {
			rc = errno ? -errno : -EIO;
			mlens_errf(err, errlen, "%s: cannot write: %s", path, strerror(-rc));
		}
		free(path);
	}
	json_decref(docs[0]);
	json_decref(docs[1]);
	return rc;
}
