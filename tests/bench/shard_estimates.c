/* The numbers of daemon/MULTINODE.md, computed from daemon/plan/shard.h: per
 * layer and token, the bytes one GPU (or box) sends into the collectives of
 * each scheme, against the bytes it streams over PCIe, and the seconds per
 * layer at a step of n tokens over the links of a few networks. Prints
 * JSON, one object per (model, scheme, G). Arithmetic only; runs anywhere. */
#include <stdio.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/plan/shard.h"

struct net {
	const char *name;
	double bytes_s;		/* one direction, per GPU or box */
};

static const struct net nets[] = {
	{ "25GbE", 25e9 / 8 }, { "100GbE", 100e9 / 8 }, { "IB-200G", 200e9 / 8 },
	{ "PCIe4-x16", 25e9 }, { "NVLink4", 450e9 },
};

static struct mlens_model_config model(bool big)
{
	struct mlens_model_config c;
	memset(&c, 0, sizeof(c));
	c.vocab_size = 32000 + (big ? 768 : 0);
	c.hidden_size = big ? 6144 : 4096;
	c.intermediate_size = big ? 16384 : 14336;
	c.num_hidden_layers = big ? 56 : 32;
	c.num_attention_heads = big ? 48 : 32;
	c.num_key_value_heads = 8;
	c.head_dim = 128;
	c.num_local_experts = 8;
	c.num_experts_per_tok = 2;
	c.dtype = MLENS_DTYPE_BF16;
	return c;
}

int main(int argc, char **argv)
{
	/* tokens in a step: MoE-Lens' n_real for Mixtral-8x7B on an A40 */
	double n = argc > 1 ? atof(argv[1]) : 18236;
	bool first = true;
	printf("[\n");
	for (int big = 0; big <= 1; big++) {
		struct mlens_model_config c = model(big);
		for (int s = MLENS_SHARD_TP; s <= MLENS_SHARD_EP; s++)
			for (int G = 2; G <= 8; G *= 2) {
				struct mlens_shard_plan p;
				struct mlens_shard_coll co;
				char err[256];
				double stream;
				if (mlens_shard_plan(&p, &c, G, (enum mlens_shard_scheme)s, err, sizeof(err)))
					continue;
				mlens_shard_layer_coll(&p, 1.0, 2, &co);
				stream = (double)mlens_shard_stream_bytes(&p, 0, 2, 0);
				printf("%s  {\"model\": \"%s\", \"scheme\": \"%s\", \"gpus\": %d, "
				       "\"coll_bytes_per_token_layer\": %.0f, \"latency_steps_per_layer\": %d, "
				       "\"stream_bytes_per_layer\": %.0f, \"pcie_stream_s_per_layer\": %.5f, "
				       "\"tokens\": %.0f, \"coll_s_per_layer\": {",
				       first ? "" : ",\n", big ? "mixtral-8x22b" : "mixtral-8x7b",
				       mlens_shard_scheme_name(p.scheme), G, co.total, co.steps, stream,
				       stream / 25e9, n);
				for (size_t i = 0; i < sizeof(nets) / sizeof(nets[0]); i++)
					printf("%s\"%s\": %.5f", i ? ", " : "", nets[i].name,
					       n * co.total / nets[i].bytes_s);
				printf("}}");
				first = false;
			}
	}
	printf("\n]\n");
	return 0;
}
