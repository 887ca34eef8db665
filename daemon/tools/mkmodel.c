/* mlens-mkmodel: command line over mlens_mkmodel_write(). Parses flags,
 * applies the preset first and then every dimension flag over it. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/tools/mkmodel.h"

enum {
	OPT_LAYERS = 256, OPT_DTYPE, OPT_SEED, OPT_SHARDS, OPT_VOCAB, OPT_HIDDEN,
	OPT_INTER, OPT_HEADS, OPT_KV, OPT_HEAD_DIM, OPT_EXPERTS, OPT_TOPK,
	OPT_THETA, OPT_MAXPOS, OPT_TIE, OPT_FUSED, OPT_EOS, OPT_TOKENIZER, OPT_FP8_SCALES,
	OPT_ROUTER_FAVOR,
};

static const struct option longopts[] = {
	{ "output", required_argument, NULL, 'o' },
	{ "preset", required_argument, NULL, 'p' },
	{ "layers", required_argument, NULL, OPT_LAYERS },
	{ "dtype", required_argument, NULL, OPT_DTYPE },
	{ "seed", required_argument, NULL, OPT_SEED },
	{ "shards", required_argument, NULL, OPT_SHARDS },
	{ "vocab", required_argument, NULL, OPT_VOCAB },
	{ "hidden", required_argument, NULL, OPT_HIDDEN },
	{ "intermediate", required_argument, NULL, OPT_INTER },
	{ "heads", required_argument, NULL, OPT_HEADS },
	{ "kv-heads", required_argument, NULL, OPT_KV },
	{ "head-dim", required_argument, NULL, OPT_HEAD_DIM },
	{ "experts", required_argument, NULL, OPT_EXPERTS },
	{ "top-k", required_argument, NULL, OPT_TOPK },
	{ "rope-theta", required_argument, NULL, OPT_THETA },
	{ "max-pos", required_argument, NULL, OPT_MAXPOS },
	{ "tie", no_argument, NULL, OPT_TIE },
	{ "fused-experts", no_argument, NULL, OPT_FUSED },
	{ "eos-token-id", required_argument, NULL, OPT_EOS },
	{ "tokenizer", no_argument, NULL, OPT_TOKENIZER },
	{ "fp8-scales", required_argument, NULL, OPT_FP8_SCALES },
	{ "router-favor", required_argument, NULL, OPT_ROUTER_FAVOR },
	{ "help", no_argument, NULL, 'h' },
	{ NULL, 0, NULL, 0 },
};

static void usage(FILE *f)
{
	fputs("usage: mlens-mkmodel -o DIR [--preset NAME] [--layers N]\n"
	      "                     [--dtype bf16|fp16|fp32|fp8] [--fp8-scales channel|block[:RxC]]\n"
	      "                     [--seed N] [--shards N]\n"
	      "                     [--vocab N] [--hidden N] [--intermediate N] [--heads N]\n"
	      "                     [--kv-heads N] [--head-dim N] [--experts N] [--top-k N]\n"
	      "                     [--rope-theta X] [--max-pos N] [--tie] [--fused-experts]\n"
	      "                     [--eos-token-id ID[,ID...]|none] [--tokenizer]\n"
	      "                     [--router-favor N]\n"
	      "Presets: tiny, mixtral-8x7b, mixtral-8x22b (Mixtral); qwen3-tiny,\n"
	      "qwen3-30b-a3b (Qwen3-MoE); qwen2-tiny, qwen1.5-moe-a2.7b, qwen2-57b-a14b\n"
	      "(Qwen2-MoE); olmoe-tiny, olmoe-1b-7b (OLMoE); dbrx-tiny, dbrx (DBRX).\n"
	      "Writes a random-weight model directory in Hugging Face format.\n"
	      "See mlens-mkmodel(1).\n", f);
}

static int bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int bad(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "mlens-mkmodel: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\n", stderr);
	usage(stderr);
	return 2;
}

/* A whole decimal number in [lo, hi]. */
static int num(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
	char *end;
	long long v;

	errno = 0;
	v = strtoll(s, &end, 10);
	if (errno || end == s || *end || v < lo || v > hi) {
		fprintf(stderr, "mlens-mkmodel: --%s '%s' is not a whole number from %" PRId64 " to %" PRId64 "\n",
			flag, s, lo, hi);
		return -1;
	}
	*out = v;
	return 0;
}

/* --eos-token-id: ids separated by commas, or "none" (no EOS). The
 * vocabulary bound is checked when the config is validated. */
static int parse_eos(const char *s, struct mlens_model_config *cfg)
{
	char buf[256], *tok, *save = NULL;
	int64_t v;
	int n = 0;

	if (!strcmp(s, "none")) {
		cfg->n_eos = 0;
		return 0;
	}
	snprintf(buf, sizeof(buf), "%s", s);
	for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		if (n == MLENS_MODEL_MAX_EOS) {
			fprintf(stderr, "mlens-mkmodel: --eos-token-id '%s': at most %d ids\n", s,
				MLENS_MODEL_MAX_EOS);
			return -1;
		}
		if (num("eos-token-id", tok, 0, INT32_MAX, &v))
			return -1;
		cfg->eos[n++] = (int32_t)v;
	}
	if (n == 0) {
		fprintf(stderr, "mlens-mkmodel: --eos-token-id '%s': give token ids or none\n", s);
		return -1;
	}
	cfg->n_eos = n;
	return 0;
}

int main(int argc, char **argv)
{
	/* Dimension flags are kept until the preset is applied. */
	int64_t dims[OPT_FUSED + 1];
	bool set[OPT_FUSED + 1] = { false };
	struct mlens_mkmodel_opts o = { .seed = 0, .shards = 1 };
	const char *preset = "tiny", *dtype = NULL, *theta = NULL, *eos = NULL, *scales = NULL;
	char err[1024];
	int c, rc;

	while ((c = getopt_long(argc, argv, "o:p:h", longopts, NULL)) != -1) {
		int64_t v = 0;

		switch (c) {
		case 'o':
			o.dir = optarg;
			break;
		case 'p':
			preset = optarg;
			break;
		case 'h':
			usage(stdout);
			return 0;
		case OPT_DTYPE:
			dtype = optarg;
			break;
		case OPT_THETA:
			theta = optarg;
			break;
		case OPT_EOS:
			eos = optarg;
			break;
		case OPT_TOKENIZER:
			o.tokenizer = true;
			break;
		case OPT_FP8_SCALES:
			scales = optarg;
			break;
		case OPT_TIE:
		case OPT_FUSED:
			set[c] = true;
			break;
		case OPT_SEED:
			if (num("seed", optarg, 0, INT64_MAX, &v))
				return 2;
			o.seed = (uint64_t)v;
			break;
		case OPT_ROUTER_FAVOR:
			if (num("router-favor", optarg, 1, INT32_MAX, &v))
				return 2;
			o.router_favor = (int)v;
			break;
		case OPT_SHARDS:
			if (num("shards", optarg, 1, 99999, &v))
				return 2;
			o.shards = (int)v;
			break;
		case '?':
			usage(stderr);
			return 2;
		default:
			if (c < OPT_LAYERS || c > OPT_MAXPOS)
				return bad("unexpected option");
			for (const struct option *lo = longopts; lo->name; lo++)
				if (lo->val == c && num(lo->name, optarg, 1, INT32_MAX, &v))
					return 2;
			dims[c] = v;
			set[c] = true;
			break;
		}
	}
	if (optind < argc)
		return bad("unexpected argument '%s'", argv[optind]);
	if (!o.dir)
		return bad("no output directory: give -o DIR");
	if (mlens_mkmodel_preset(&o, preset))
		return bad("unknown preset '%s' (see --help for the presets)", preset);
	if (dtype) {
		if (!strcmp(dtype, "bf16"))
			o.cfg.dtype = MLENS_DTYPE_BF16;
		else if (!strcmp(dtype, "fp16"))
			o.cfg.dtype = MLENS_DTYPE_F16;
		else if (!strcmp(dtype, "fp32"))
			o.cfg.dtype = MLENS_DTYPE_F32;
		else if (!strcmp(dtype, "fp8"))
			o.fp8.kind = MLENS_WSCALE_CHANNEL;	/* experts; the rest bf16 */
		else
			return bad("unknown --dtype '%s' (choose bf16, fp16, fp32 or fp8)", dtype);
	}
	if (scales) {
		int br = 128, bc = 128, end = 0;

		if (o.fp8.kind == MLENS_WSCALE_NONE)
			return bad("--fp8-scales needs --dtype fp8");
		if (!strcmp(scales, "block") ||
		    (sscanf(scales, "block:%dx%d%n", &br, &bc, &end) == 2 && !scales[end] && br > 0 &&
		     bc > 0 && br <= 65536 && bc <= 65536))
			o.fp8 = (struct mlens_wscale){ MLENS_WSCALE_BLOCK, br, bc };
		else if (strcmp(scales, "channel"))
			return bad("unknown --fp8-scales '%s' (choose channel, block or block:RxC)", scales);
	}
	if (theta) {
		char *end;

		errno = 0;
		o.cfg.rope_theta = strtod(theta, &end);
		if (errno || end == theta || *end || !isfinite(o.cfg.rope_theta) || o.cfg.rope_theta <= 0)
			return bad("--rope-theta '%s' is not a positive number", theta);
	}
	if (eos && parse_eos(eos, &o.cfg))
		return 2;
#define APPLY(opt, field) do { if (set[opt]) o.cfg.field = dims[opt]; } while (0)
	APPLY(OPT_LAYERS, num_hidden_layers);
	APPLY(OPT_VOCAB, vocab_size);
	APPLY(OPT_HIDDEN, hidden_size);
	APPLY(OPT_INTER, intermediate_size);
	APPLY(OPT_HEADS, num_attention_heads);
	APPLY(OPT_KV, num_key_value_heads);
	APPLY(OPT_HEAD_DIM, head_dim);
	APPLY(OPT_EXPERTS, num_local_experts);
	APPLY(OPT_TOPK, num_experts_per_tok);
	APPLY(OPT_MAXPOS, max_position_embeddings);
#undef APPLY
	o.cfg.tie_word_embeddings = set[OPT_TIE];
	o.fused_experts = set[OPT_FUSED];
	if (o.router_favor >= o.cfg.num_local_experts)
		return bad("--router-favor %d leaves no expert favored (the model has %" PRId64 " a layer)",
			   o.router_favor, o.cfg.num_local_experts);

	rc = mlens_mkmodel_write(&o, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "mlens-mkmodel: %s\n", err);
		return 1;
	}
	printf("mlens-mkmodel: wrote %s (%s preset, %" PRId64 " layers, %s, seed %" PRIu64 ", %d file%s%s)\n",
	       o.dir, preset, o.cfg.num_hidden_layers, mlens_dtype_name(o.cfg.dtype), o.seed,
	       o.shards, o.shards == 1 ? "" : "s", o.tokenizer ? ", tokenizer and chat template" : "");
	return 0;
}
