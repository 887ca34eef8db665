/* libmlens chat templates: turn a list of chat messages into the prompt
 * text a model was trained on, by rendering the model's chat_template (a
 * Jinja template from its tokenizer_config.json or chat_template.jinja) as
 * Hugging Face transformers does. Messages and extra variables go in as
 * JSON text; the prompt comes out as a string the caller frees. Errors are
 * negative errno values with a message naming the problem and its line. */
#ifndef MLENS_CHAT_H
#define MLENS_CHAT_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A parsed chat template. Opaque; immutable once made, so one template may
 * render from several threads at once. */
struct mlens_chat_template;

/* Loads the chat template of the model directory dir: chat_template.jinja
 * if present, else "chat_template" of tokenizer_config.json (a string, or a
 * list of {"name", "template"} of which "default" is taken), with bos_token
 * and eos_token from tokenizer_config.json (or special_tokens_map.json). */
int mlens_chat_template_open(const char *dir, struct mlens_chat_template **out, char **errmsg);

/* Parses template text (len bytes) with the given bos_token and eos_token
 * (either may be NULL: the variable is then undefined). */
int mlens_chat_template_parse(const char *text, size_t len, const char *bos_token,
			      const char *eos_token, struct mlens_chat_template **out,
			      char **errmsg);

/* Renders messages_json (a JSON array of message objects) into *out (a NUL-
 * terminated string of *out_len bytes, free with free(3)). extra_json is
 * NULL or a JSON object whose members become template variables (tools,
 * documents, enable_thinking, ...). -EBADMSG: the template refused the
 * messages (raise_exception), *errmsg is its own words for the sender;
 * -EINVAL: bad JSON or a render error; -E2BIG: a render limit was reached. */
int mlens_chat_template_render(const struct mlens_chat_template *tpl, const char *messages_json,
			       int add_generation_prompt, const char *extra_json, char **out,
			       size_t *out_len, char **errmsg);

void mlens_chat_template_free(struct mlens_chat_template *tpl);

#ifdef __cplusplus
}
#endif

#endif
