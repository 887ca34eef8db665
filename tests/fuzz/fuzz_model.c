/* libFuzzer target for the model parsers: the same bytes go to the
 * safetensors header parser, the config.json parser (with the parse hook
 * of whichever family its architectures names) and (over a parsed config)
 * the generation_config.json parser, all of which work from memory. Also linked into tests/fuzz/replay for make check. */
#include <stddef.h>
#include <stdint.h>

#include "daemon/model/model.h"
#include "daemon/model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct mlens_safetensors st;
	struct mlens_model_config cfg;
	char err[512];

	if (mlens_safetensors_parse(data, size, "fuzz.safetensors", &st, err, sizeof(err)) == 0)
		mlens_safetensors_free(&st);
	if (mlens_model_parse_config((const char *)data, size, "fuzz/config.json", &cfg, err,
				     sizeof(err)))
		cfg = (struct mlens_model_config){ .vocab_size = 32000 };
	mlens_model_parse_generation_config((const char *)data, size, "fuzz/generation_config.json",
					    &cfg, err, sizeof(err));
	return 0;
}
