/* libFuzzer target for the model loader past the parsers: an input is a
 * config.json text, one NUL byte, then a model.safetensors file. Both go
 * into a directory of their own, which mlens_model_open binds as the
 * family of the config says (its tensor names and shapes) and, for an fp8
 * checkpoint, checks against the quantization_config (scales, block grid,
 * ignore lists). A model that opens has every expert matrix and scale
 * read, so a binding that points outside its tensor trips ASan, and a
 * small 16-bit model is quantized at load as weight_dtype fp8 does. Also
 * linked into tests/fuzz/replay_load for make check. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/model/model.h"
#include "daemon/model/quant.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char dir[64];
static char cpath[96], spath[96];

static void cleanup(void)
{
	unlink(cpath);
	unlink(spath);
	rmdir(dir);
}

static int put(const char *path, const void *buf, size_t len)
{
	FILE *f = fopen(path, "wb");
	int rc;

	if (!f)
		return -1;
	rc = len && fwrite(buf, 1, len, f) != len ? -1 : 0;
	return fclose(f) ? -1 : rc;
}

/* A binding inside a mapped file must end inside it: the fuzzer's ASan
 * does not see past a mapping's end. */
static void check_inside(const struct mlens_model *m, const void *p, size_t n)
{
	for (int i = 0; i < m->n_files; i++) {
		const char *a = m->files[i].map;

		if (a && (const char *)p >= a && (const char *)p < a + m->files[i].size &&
		    n > (size_t)(a + m->files[i].size - (const char *)p))
			abort();
	}
}

/* Every expert matrix inside its file, its first and last bytes and every
 * scale read and summed (the sum keeps the reads from being optimised
 * away). */
static unsigned touch(const struct mlens_model *m)
{
	const struct mlens_model_config *c = &m->cfg;
	const int64_t H = c->hidden_size, I = c->intermediate_size;
	const size_t es = mlens_dtype_size(c->expert_dtype);
	const size_t ns = mlens_model_scale_bytes(c, I, H) / sizeof(float);
	const size_t ns2 = c->w2_transposed ? ns : mlens_model_scale_bytes(c, H, I) / sizeof(float);
	unsigned sum = 0;
	float ssum = 0;

	for (int64_t l = 0; l < c->num_hidden_layers; l++) {
		const struct mlens_layer_weights *w = &m->layers[l];

		if (!w->router)
			continue;	/* a dense layer: no experts */
		for (int64_t e = 0; e < c->num_local_experts; e++) {
			const void *mat[3] = { w->w1[e], w->w2[e], w->w3[e] };
			const float *sc[3] = { w->s1 ? w->s1[e] : NULL, w->s2 ? w->s2[e] : NULL,
					       w->s3 ? w->s3[e] : NULL };

			for (int k = 0; k < 3; k++) {
				size_t n = (size_t)(H * I) * es;

				check_inside(m, mat[k], n);

				sum += ((const uint8_t *)mat[k])[0] + ((const uint8_t *)mat[k])[n - 1];
				for (size_t i = 0; sc[k] && i < (k == 1 ? ns2 : ns); i++)
					ssum += sc[k][i];
			}
		}
	}
	return sum + (ssum > 1.0f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const uint8_t *nul = memchr(data, 0, size);
	struct mlens_model *m;
	char err[1024];
	size_t clen = nul ? (size_t)(nul - data) : size;

	if (!dir[0]) {
		const char *t = getenv("TMPDIR");

		snprintf(dir, sizeof(dir), "%s/mlens-fuzz-load-XXXXXX", t && strlen(t) < 30 ? t : "/tmp");
		if (!mkdtemp(dir))
			abort();
		snprintf(cpath, sizeof(cpath), "%s/config.json", dir);
		snprintf(spath, sizeof(spath), "%s/model.safetensors", dir);
		atexit(cleanup);
	}
	unlink(spath);
	if (put(cpath, data, clen) || (nul && put(spath, nul + 1, size - clen - 1)))
		abort();
	if (mlens_model_open(dir, &m, err, sizeof(err))) {
		if (getenv("MLENS_FUZZ_LOAD_VERBOSE"))	/* what each seed tests, for its author */
			fprintf(stderr, "refused: %s\n", err);
		return 0;
	}
	if (getenv("MLENS_FUZZ_LOAD_VERBOSE"))
		fprintf(stderr, "opened: %s, experts %s\n", m->cfg.architecture,
			mlens_dtype_name(m->cfg.expert_dtype));
	if (touch(m) == 0x5eed)
		err[0] = '\0';
	/* weight_dtype fp8 (refused for the families it does not serve) */
	if (m->cfg.num_hidden_layers * m->cfg.num_local_experts * m->cfg.hidden_size *
		    m->cfg.intermediate_size <= (1 << 16) &&
	    !mlens_model_quantize_experts(m, err, sizeof(err)))
		touch(m);
	mlens_model_close(m);
	return 0;
}
