/* Description: open a model directory with the mlens loader and print, as
 * JSON, its config and checksums of the weights named on the command line,
 * so scripts can compare the loader's view with Hugging Face transformers.
 * A weight is a tensor name, or LAYER.EXPERT.w1|w2|w3 for an expert matrix
 * reached through the layer table (per-expert or fused layout alike).
 * Exit 1 with the loader's message on stderr if the model is refused. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/model/model.h"

static void sums(const void *p, enum mlens_dtype dt, size_t n, double *s, double *s2)
{
	*s = *s2 = 0;
	for (size_t i = 0; i < n; i++) {
		double v = mlens_load(p, dt, i);
		*s += v;
		*s2 += v * v;
	}
}

int main(int argc, char **argv)
{
	struct mlens_model *m;
	const struct mlens_model_config *c;
	char err[1024];
	int rc;

	if (argc < 2) {
		fprintf(stderr, "usage: model_info DIR [TENSOR | LAYER.EXPERT.wN]...\n");
		return 2;
	}
	rc = mlens_model_open(argv[1], &m, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "%s\n", err);
		return 1;
	}
	c = &m->cfg;
	printf("{\"vocab_size\": %" PRId64 ", \"hidden_size\": %" PRId64 ", \"intermediate_size\": %" PRId64
	       ", \"num_hidden_layers\": %" PRId64 ", \"num_attention_heads\": %" PRId64
	       ", \"num_key_value_heads\": %" PRId64 ", \"head_dim\": %" PRId64
	       ", \"num_local_experts\": %" PRId64 ", \"num_experts_per_tok\": %" PRId64
	       ", \"max_position_embeddings\": %" PRId64 ", \"rope_theta\": %.17g, \"rms_norm_eps\": %.17g"
	       ", \"tie_word_embeddings\": %s, \"dtype\": \"%s\", \"n_files\": %d, \"n_tensors\": %d"
	       ", \"weight_bytes\": %zu, \"lm_head_is_embed\": %s, \"sums\": {",
	       c->vocab_size, c->hidden_size, c->intermediate_size, c->num_hidden_layers,
	       c->num_attention_heads, c->num_key_value_heads, c->head_dim, c->num_local_experts,
	       c->num_experts_per_tok, c->max_position_embeddings, c->rope_theta, c->rms_norm_eps,
	       c->tie_word_embeddings ? "true" : "false", mlens_dtype_name(c->dtype), m->n_files,
	       m->n_tensors, m->weight_bytes, m->lm_head == m->embed ? "true" : "false");
	for (int i = 2; i < argc; i++) {
		const struct mlens_tensor *t = mlens_model_tensor(m, argv[i]);
		const void *p = NULL;
		size_t n = 0;
		double s, s2;
		long l, e;
		int w;

		if (t) {
			p = t->data;
			n = t->nbytes / mlens_dtype_size(t->dtype);
		} else if (sscanf(argv[i], "%ld.%ld.w%d", &l, &e, &w) == 3 && l >= 0 &&
			   l < c->num_hidden_layers && e >= 0 && e < c->num_local_experts &&
			   w >= 1 && w <= 3) {
			const struct mlens_layer_weights *L = &m->layers[l];
			p = w == 1 ? L->w1[e] : w == 2 ? L->w2[e] : L->w3[e];
			n = (size_t)(c->intermediate_size * c->hidden_size);
		} else {
			fprintf(stderr, "model_info: no weight '%s'\n", argv[i]);
			mlens_model_close(m);
			return 1;
		}
		sums(p, c->dtype, n, &s, &s2);
		printf("%s\"%s\": [%.17g, %.17g]", i > 2 ? ", " : "", argv[i], s, s2);
	}
	printf("}}\n");
	mlens_model_close(m);
	return 0;
}
