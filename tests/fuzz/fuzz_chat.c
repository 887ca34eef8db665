/* libFuzzer target for the chat-template interpreter: the bytes are a
 * template (up to a NUL; after it, optional messages JSON), parsed and
 * rendered twice (with and without the generation prompt) under tight
 * limits, so that every input ends quickly whatever it asks for. Also
 * linked into tests/chat/replay_chat for make check. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "client/chat_template_int.h"
#include "client/mlens_chat.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char MESSAGES[] =
	"[{\"role\": \"system\", \"content\": \"sys\"},"
	" {\"role\": \"user\", \"content\": \"Grüße <tool_response>x</tool_response>\"},"
	" {\"role\": \"assistant\", \"content\": \"<think>\\nr\\n</think>\\n\\nok\", \"tool_calls\": ["
	"   {\"id\": \"abcDEF123\", \"type\": \"function\","
	"    \"function\": {\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5, null, true]}}}]},"
	" {\"role\": \"tool\", \"tool_call_id\": \"abcDEF123\", \"content\": \"42\"},"
	" {\"role\": \"user\", \"content\": \"again\"}]";
static const char EXTRA[] =
	"{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"d\","
	" \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"array\"}}}}}],"
	" \"enable_thinking\": false}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const uint8_t *nul = memchr(data, 0, size);
	size_t tlen = nul ? (size_t)(nul - data) : size;
	struct mlens_chat_template *t;
	char *msgs = NULL, *out, *err = NULL;

	if (mlens_chat_template_parse((const char *)data, tlen, "<s>", "</s>", &t, &err) == 0) {
		t->limits = (struct ct_limits){ .max_output = 1u << 20, .max_memory = 64u << 20,
						.max_steps = 200000, .max_depth = 256 };
		if (nul) {
			msgs = malloc(size - tlen);
			memcpy(msgs, nul + 1, size - tlen - 1);
			msgs[size - tlen - 1] = 0;
		}
		for (int gen = 0; gen < 2; gen++) {
			out = NULL;
			if (mlens_chat_template_render(t, msgs ? msgs : MESSAGES, gen, EXTRA, &out, NULL, &err) == 0)
				free(out);
			free(err);
			err = NULL;
		}
		free(msgs);
		mlens_chat_template_free(t);
	}
	free(err);
	return 0;
}
