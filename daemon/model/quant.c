/* fp8 weights (quant.h): which tensors of a checkpoint are fp8 follows its
 * quantization_config, each one's scales are checked against its shape and
 * kept as fp32; experts can also be quantized here at load. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <jansson.h>

#include "daemon/errf.h"
#include "daemon/model/model_int.h"
#include "daemon/model/quant.h"
#include "kernels/fp8.h"

struct mlens_quant {
	void *area;			/* expert scales (and experts quantized at load) */
	size_t area_bytes;
	const float **scale_table;	/* every layer's s1/s2/s3 arrays */
	struct mlens_tensor *deq;	/* dequantized copies of other fp8 matrices */
	int n_deq;
};

static const char *const SCALE_SUFFIX[] = { ".weight_scale", ".weight_scale_inv", ".input_scale" };

/* ==== quantization_config ==== */

static bool is_fp8_method(const char *m)
{
	return !strcmp(m, "compressed-tensors") || !strcmp(m, "fp8") || !strcmp(m, "fbgemm_fp8");
}

/* An array of two positive integers (a block size). */
static int get_block(json_t *v, const char *path, const char *key, int *r, int *c, char *err,
		     size_t errlen)
{
	json_t *a = json_array_get(v, 0), *b = json_array_get(v, 1);

	if (!json_is_array(v) || json_array_size(v) != 2 || !json_is_integer(a) ||
	    !json_is_integer(b) || json_integer_value(a) < 1 || json_integer_value(a) > 65536 ||
	    json_integer_value(b) < 1 || json_integer_value(b) > 65536) {
		mlens_errf(err, errlen, "%s: quantization_config.%s must be two block sizes such as [128, 128]",
			   path, key);
		return -EINVAL;
	}
	*r = (int)json_integer_value(a);
	*c = (int)json_integer_value(b);
	return 0;
}

/* One config group of compressed-tensors: fp8 weights, their strategy. */
static int ct_group(json_t *g, const char *gname, const char *path, struct mlens_model_config *cfg,
		    char *err, size_t errlen)
{
	json_t *w = json_object_get(g, "weights"), *v;
	const char *st;

	if (!json_is_object(w)) {
		mlens_errf(err, errlen, "%s: quantization_config group '%s' has no 'weights' object",
			   path, gname);
		return -EINVAL;
	}
	v = json_object_get(w, "type");
	if (!json_is_string(v) || strcmp(json_string_value(v), "float") ||
	    json_integer_value(json_object_get(w, "num_bits")) != 8) {
		mlens_errf(err, errlen, "%s: quantization_config group '%s' quantizes weights to %" JSON_INTEGER_FORMAT "-bit %s; mlens reads only fp8 (8-bit float) weights",
			   path, gname, json_integer_value(json_object_get(w, "num_bits")),
			   json_is_string(v) ? json_string_value(v) : "(no type)");
		return -ENOTSUP;
	}
	v = json_object_get(w, "strategy");
	st = json_is_string(v) ? json_string_value(v) : "tensor";
	if (!strcmp(st, "block")) {
		cfg->expert_scale.kind = MLENS_WSCALE_BLOCK;
		return get_block(json_object_get(w, "block_structure"), path,
				 "config_groups.weights.block_structure",
				 &cfg->expert_scale.block_rows, &cfg->expert_scale.block_cols, err,
				 errlen);
	}
	if (strcmp(st, "tensor") && strcmp(st, "channel")) {
		mlens_errf(err, errlen, "%s: quantization_config group '%s' has weight strategy \"%.32s\"; mlens reads tensor, channel and block scales",
			   path, gname, st);
		return -ENOTSUP;
	}
	/* experts keep one scale a row (a per-tensor scale repeated) */
	if (cfg->expert_scale.kind == MLENS_WSCALE_NONE)
		cfg->expert_scale.kind = MLENS_WSCALE_CHANNEL;
	return 0;
}

int mlens_quant_parse_config(json_t *qc, const char *path, struct mlens_model_config *cfg,
			     char *err, size_t errlen)
{
	json_t *v;
	const char *m, *key;
	int rc;

	cfg->expert_dtype = cfg->dtype;
	cfg->expert_scale = (struct mlens_wscale){ MLENS_WSCALE_NONE, 0, 0 };
	cfg->quant_method[0] = '\0';
	if (!qc || json_is_null(qc))
		return 0;
	v = json_object_get(qc, "quant_method");
	if (!json_is_object(qc) || !json_is_string(v)) {
		mlens_errf(err, errlen, "%s: quantization_config must be an object naming its quant_method",
			   path);
		return -EINVAL;
	}
	m = json_string_value(v);
	if (!is_fp8_method(m)) {
		mlens_errf(err, errlen, "%s: quantization_config.quant_method \"%.40s\" is not supported; mlens reads fp8 checkpoints (compressed-tensors, fp8, fbgemm_fp8) and bf16, fp16 or fp32 weights",
			   path, m);
		return -ENOTSUP;
	}
	snprintf(cfg->quant_method, sizeof(cfg->quant_method), "%s", m);
	cfg->expert_dtype = MLENS_DTYPE_E4M3;
	if (!strcmp(m, "compressed-tensors")) {
		json_t *groups = json_object_get(qc, "config_groups"), *g;

		v = json_object_get(qc, "format");
		if (v && !(json_is_string(v) && (!strcmp(json_string_value(v), "float-quantized") ||
						 !strcmp(json_string_value(v), "naive-quantized")))) {
			mlens_errf(err, errlen, "%s: quantization_config.format %s%.40s%s is not supported; mlens reads \"float-quantized\" fp8 checkpoints",
				   path, json_is_string(v) ? "\"" : "",
				   json_is_string(v) ? json_string_value(v) : "(not a string)",
				   json_is_string(v) ? "\"" : "");
			return -ENOTSUP;
		}
		if (!json_is_object(groups) || !json_object_size(groups)) {
			mlens_errf(err, errlen, "%s: quantization_config has no config_groups", path);
			return -EINVAL;
		}
		json_object_foreach(groups, key, g)
			if ((rc = ct_group(g, key, path, cfg, err, errlen)))
				return rc;
		return 0;
	}
	v = json_object_get(qc, "fmt");
	if (v && !(json_is_string(v) && !strcmp(json_string_value(v), "e4m3"))) {
		mlens_errf(err, errlen, "%s: quantization_config.fmt is not \"e4m3\"; mlens reads e4m3 fp8 weights",
			   path);
		return -ENOTSUP;
	}
	v = json_object_get(qc, "weight_block_size");
	if (v && !json_is_null(v)) {
		cfg->expert_scale.kind = MLENS_WSCALE_BLOCK;
		return get_block(v, path, "weight_block_size", &cfg->expert_scale.block_rows,
				 &cfg->expert_scale.block_cols, err, errlen);
	}
	cfg->expert_scale.kind = MLENS_WSCALE_CHANNEL;
	return 0;
}

static bool has_suffix(const char *s, const char *suf)
{
	size_t a = strlen(s), b = strlen(suf);
	return a >= b && !strcmp(s + a - b, suf);
}

static bool is_scale_name(const char *name)
{
	for (size_t i = 0; i < sizeof(SCALE_SUFFIX) / sizeof(SCALE_SUFFIX[0]); i++)
		if (has_suffix(name, SCALE_SUFFIX[i]))
			return true;
	return false;
}

bool mlens_quant_tensor_exempt(const struct mlens_model_config *cfg, const struct mlens_tensor *t)
{
	return cfg->quant_method[0] && (t->dtype == MLENS_DTYPE_E4M3 || is_scale_name(t->name));
}

/* ==== binding ==== */

/* Modules the config keeps in the model's dtype. compressed-tensors:
 * "ignore", names or "re:" patterns matched from the start; the others:
 * modules_to_not_convert / ignored_layers, matched as substrings. */
static bool ignored(json_t *qc, const char *module)
{
	bool ct = !strcmp(json_string_value(json_object_get(qc, "quant_method")),
			  "compressed-tensors");
	const char *keys[] = { "ignore", "modules_to_not_convert", "ignored_layers" };
	json_t *list, *e;
	size_t i;

	for (size_t k = 0; k < 3; k++) {
		list = json_object_get(qc, keys[k]);
		json_array_foreach(list, i, e) {
			const char *p = json_string_value(e);
			regex_t re;
			regmatch_t mt;
			bool hit;

			if (!p)
				continue;
			if (!ct) {
				if (*p && strstr(module, p))
					return true;
				continue;
			}
			if (strncmp(p, "re:", 3)) {
				if (!strcmp(module, p))
					return true;
				continue;
			}
			if (regcomp(&re, p + 3, REG_EXTENDED))
				continue;
			hit = !regexec(&re, module, 1, &mt, 0) && mt.rm_so == 0;
			regfree(&re);
			if (hit)
				return true;
		}
	}
	return false;
}

/* config.json's quantization_config, read again: the one parsed into
 * m->cfg, unless the file was replaced since (then NULL, message set). */
static json_t *load_qc(const struct mlens_model *m, char *err, size_t errlen)
{
	char *path = mlens_model_path(m->dir, "config.json");
	json_error_t je;
	json_t *root = path ? json_load_file(path, JSON_REJECT_DUPLICATES, &je) : NULL, *qc, *v;

	if (!root) {
		mlens_errf(err, errlen, "%s: cannot read config.json again", m->dir);
		free(path);
		return NULL;
	}
	qc = json_incref(json_object_get(root, "quantization_config"));
	json_decref(root);
	v = json_object_get(qc, "quant_method");
	if (!json_is_object(qc) || !json_is_string(v) ||
	    strcmp(json_string_value(v), m->cfg.quant_method)) {
		mlens_errf(err, errlen, "%s changed while the model was being opened (its quantization_config is no longer quant_method %s); open the model again",
			   path, m->cfg.quant_method);
		json_decref(qc);
		qc = NULL;
	}
	free(path);
	return qc;
}

static void fmt_shape(char *buf, size_t n, const struct mlens_tensor *t)
{
	size_t off = (size_t)snprintf(buf, n, "[");
	for (int i = 0; i < t->ndim && off < n; i++)
		off += (size_t)snprintf(buf + off, n - off, "%s%" PRId64, i ? ", " : "", t->shape[i]);
	if (off < n)
		snprintf(buf + off, n - off, "]");
}

/* What the scale tensor s of fp8 weight w [rows][cols] is. */
static int scale_kind(const struct mlens_model_config *c, const struct mlens_tensor *w,
		      const struct mlens_tensor *s, struct mlens_wscale *k)
{
	int64_t rows = w->shape[0], cols = w->shape[1], n = 1;

	for (int i = 0; i < s->ndim; i++)
		n *= s->shape[i];
	if (s->ndim > 2)
		return -EINVAL;
	if (c->expert_scale.kind == MLENS_WSCALE_BLOCK) {
		int br = c->expert_scale.block_rows, bc = c->expert_scale.block_cols;
		if (s->ndim == 2 && s->shape[0] == (rows + br - 1) / br &&
		    s->shape[1] == (cols + bc - 1) / bc) {
			*k = c->expert_scale;
			return 0;
		}
	}
	if (n == 1) {
		*k = (struct mlens_wscale){ MLENS_WSCALE_TENSOR, 0, 0 };
		return 0;
	}
	if ((s->ndim == 1 && s->shape[0] == rows) ||
	    (s->ndim == 2 && s->shape[0] == rows && s->shape[1] == 1)) {
		*k = (struct mlens_wscale){ MLENS_WSCALE_CHANNEL, 0, 0 };
		return 0;
	}
	return -EINVAL;
}

/* One fp8 weight's scale tensor, found and checked (NULL: message set). */
static const struct mlens_tensor *find_scale(const struct mlens_model *m, json_t *qc,
					     const struct mlens_tensor *t, struct mlens_wscale *k,
					     char *err, size_t errlen)
{
	const char *suffix = !strcmp(m->cfg.quant_method, "fp8") ? "_scale_inv" : "_scale";
	const struct mlens_tensor *s;
	char name[512], have[96], mod[480];
	size_t len = strlen(t->name);

	if (t->ndim != 2 || !has_suffix(t->name, ".weight") || len - 7 >= sizeof(mod)) {
		mlens_errf(err, errlen, "%s: tensor '%s' is F8_E4M3; mlens reads fp8 only for 2-D '.weight' matrices",
			   m->files[t->file].path, t->name);
		return NULL;
	}
	memcpy(mod, t->name, len - 7);
	mod[len - 7] = '\0';
	if (ignored(qc, mod)) {
		mlens_errf(err, errlen, "%s: tensor '%s' is F8_E4M3 but quantization_config keeps module '%s' unquantized (it is in its ignore list)",
			   m->files[t->file].path, t->name, mod);
		return NULL;
	}
	snprintf(name, sizeof(name), "%s%s", t->name, suffix);
	s = mlens_model_tensor(m, name);
	if (!s) {
		mlens_errf(err, errlen, "%s: fp8 tensor '%s' has no scale '%s' (quant_method %s)",
			   m->files[t->file].path, t->name, name, m->cfg.quant_method);
		return NULL;
	}
	if (s->dtype == MLENS_DTYPE_E4M3) {
		mlens_errf(err, errlen, "%s: tensor '%s' is F8_E4M3; the scales of fp8 weight '%s' must be F32, BF16 or F16",
			   m->files[s->file].path, s->name, t->name);
		return NULL;
	}
	if (scale_kind(&m->cfg, t, s, k)) {
		char blk[64] = "";
		fmt_shape(have, sizeof(have), s);
		if (m->cfg.expert_scale.kind == MLENS_WSCALE_BLOCK)
			snprintf(blk, sizeof(blk), " or [%" PRId64 ", %" PRId64 "] (blocks of %dx%d)",
				 (t->shape[0] + m->cfg.expert_scale.block_rows - 1) /
					 m->cfg.expert_scale.block_rows,
				 (t->shape[1] + m->cfg.expert_scale.block_cols - 1) /
					 m->cfg.expert_scale.block_cols,
				 m->cfg.expert_scale.block_rows, m->cfg.expert_scale.block_cols);
		mlens_errf(err, errlen, "%s: tensor '%s': %s %s does not fit fp8 weight '%s' [%" PRId64 ", %" PRId64 "]; expected [1] (per tensor), [%" PRId64 ", 1] (per output channel)%s",
			   m->files[s->file].path, s->name, mlens_dtype_name(s->dtype), have, t->name,
			   t->shape[0], t->shape[1], t->shape[0], blk);
		return NULL;
	}
	return s;
}

/* Scales of s as fp32 into dst (count values as kind k; a per-tensor
 * scale written once per row when rows > 0); each finite and >= 0. */
static int copy_scales(const struct mlens_model *m, const struct mlens_tensor *s,
		       const struct mlens_wscale *k, int64_t rows, float *dst, char *err,
		       size_t errlen)
{
	size_t n = mlens_wscale_count(k, rows, 1 << 30);

	if (k->kind == MLENS_WSCALE_BLOCK)
		n = (size_t)s->shape[0] * (size_t)s->shape[1];
	for (size_t i = 0; i < n; i++) {
		float v = mlens_load(s->data, s->dtype, i);
		if (!isfinite(v) || v < 0) {
			mlens_errf(err, errlen, "%s: tensor '%s': scale %zu is %g; fp8 scales must be finite and not negative",
				   m->files[s->file].path, s->name, i, v);
			return -EINVAL;
		}
		dst[i] = v;
	}
	return 0;
}

/* Where expert matrices point: (data, slot) sorted by data. */
struct expert_ref {
	const void *data;
	size_t slot;	/* index into expert_table / scale_table */
};

static int by_data(const void *a, const void *b)
{
	const struct expert_ref *x = a, *y = b;
	return (uintptr_t)x->data < (uintptr_t)y->data ? -1 : (uintptr_t)x->data > (uintptr_t)y->data;
}

size_t mlens_model_scale_bytes(const struct mlens_model_config *c, int64_t rows, int64_t cols)
{
	if (c->expert_dtype != MLENS_DTYPE_E4M3)
		return 0;
	return mlens_wscale_count(&c->expert_scale, rows, cols) * sizeof(float);
}

uint64_t mlens_model_expert_bytes(const struct mlens_model_config *c)
{
	uint64_t H = (uint64_t)c->hidden_size, I = (uint64_t)c->intermediate_size;

	if (c->expert_dtype != MLENS_DTYPE_E4M3)
		return 3 * H * I * mlens_dtype_size(c->dtype);
	return 3 * mlens_quant_piece(H * I) +
	       2 * mlens_quant_piece(mlens_model_scale_bytes(c, (int64_t)I, (int64_t)H)) +
	       mlens_quant_piece(mlens_model_scale_bytes(c, (int64_t)H, (int64_t)I));
}

/* The scale tables and one page-aligned area for expert scales (and, with
 * wbytes, the experts themselves first). */
static int alloc_area(struct mlens_model *m, uint64_t wbytes, char *err, size_t errlen)
{
	const struct mlens_model_config *c = &m->cfg;
	uint64_t L = (uint64_t)c->num_hidden_layers, E = (uint64_t)c->num_local_experts;
	size_t bytes = (size_t)(L * E * mlens_model_expert_bytes(c) - (wbytes ? 0 : L * E * 3 *
			mlens_quant_piece((uint64_t)c->hidden_size * (uint64_t)c->intermediate_size)));
	struct mlens_quant *q = m->quant;

	bytes = (bytes + 4095) & ~(size_t)4095;	/* whole pages: the pipeline pins them */
	if (!q->scale_table)
		q->scale_table = calloc((size_t)(3 * L * E), sizeof(*q->scale_table));
	if (!q->scale_table || posix_memalign(&q->area, 4096, bytes ? bytes : 1)) {
		q->area = NULL;
		mlens_errf(err, errlen, "%s: out of memory for %zu bytes of fp8 experts and scales",
			   m->dir, bytes);
		return -ENOMEM;
	}
	q->area_bytes = bytes;
	for (int64_t l = 0; l < (int64_t)L; l++) {
		m->layers[l].s1 = q->scale_table + 3 * l * (int64_t)E;
		m->layers[l].s2 = m->layers[l].s1 + E;
		m->layers[l].s3 = m->layers[l].s2 + E;
	}
	return 0;
}

/* The tensor fields of the model that may point at t. */
static int repoint(struct mlens_model *m, const struct mlens_tensor *t, const struct mlens_tensor *nt)
{
	int n = 0;
#define RP(f) do { if ((f) == t) { (f) = nt; n++; } } while (0)
	RP(m->embed);
	RP(m->final_norm);
	RP(m->lm_head);
	for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++) {
		struct mlens_layer_weights *w = &m->layers[l];
		RP(w->attn_norm);
		RP(w->wq);
		RP(w->wk);
		RP(w->wv);
		RP(w->wo);
		RP(w->ffn_norm);
		RP(w->router);
	}
#undef RP
	return n;
}

/* A dequantized copy of fp8 matrix t (scales s as k) in the model's dtype. */
static int dequantize(struct mlens_model *m, const struct mlens_tensor *t,
		      const struct mlens_tensor *s, const struct mlens_wscale *k, char *err,
		      size_t errlen)
{
	struct mlens_quant *q = m->quant;
	struct mlens_tensor *nt = &q->deq[q->n_deq];
	int64_t R = t->shape[0], C = t->shape[1];
	size_t ns = k->kind == MLENS_WSCALE_BLOCK ? (size_t)(s->shape[0] * s->shape[1])
						 : mlens_wscale_count(k, R, C);
	float *sc = malloc(ns * sizeof(float));
	void *data = malloc((size_t)(R * C) * mlens_dtype_size(m->cfg.dtype));
	int rc;

	if (!sc || !data) {
		free(sc);
		free(data);
		mlens_errf(err, errlen, "%s: out of memory dequantizing '%s'", m->dir, t->name);
		return -ENOMEM;
	}
	rc = copy_scales(m, s, k, R, sc, err, errlen);
	for (int64_t r = 0; !rc && r < R; r++)
		for (int64_t c = 0; c < C; c++)
			mlens_store(data, m->cfg.dtype, (size_t)(r * C + c),
				    mlens_e4m3_to_f32(((const uint8_t *)t->data)[r * C + c]) *
					    mlens_wscale_at(k, sc, r, c, C));
	free(sc);
	if (rc) {
		free(data);
		return rc;
	}
	*nt = *t;
	nt->dtype = m->cfg.dtype;
	nt->nbytes = (size_t)(R * C) * mlens_dtype_size(m->cfg.dtype);
	nt->data = data;
	nt->file = t->file;
	q->n_deq++;
	if (!repoint(m, t, nt)) {
		mlens_errf(err, errlen, "%s: tensor '%s' is F8_E4M3; mlens reads fp8 for expert and attention matrices only",
			   m->files[t->file].path, t->name);
		return -ENOTSUP;
	}
	return 0;
}

int mlens_quant_bind(struct mlens_model *m, bool *used, char *err, size_t errlen)
{
	struct mlens_model_config *c = &m->cfg;
	const int64_t L = c->num_hidden_layers, E = c->num_local_experts;
	const size_t nref = (size_t)(3 * L * E);
	struct expert_ref *refs = NULL;
	const struct mlens_tensor *a16 = NULL, *a8 = NULL;
	size_t n8 = 0, nother = 0;
	json_t *qc = NULL;
	int rc = 0;

	if (!c->quant_method[0]) {
		c->expert_dtype = c->dtype;
		return 0;
	}
	qc = load_qc(m, err, errlen);
	m->quant = calloc(1, sizeof(*m->quant));
	refs = calloc(nref, sizeof(*refs));
	if (!qc || !m->quant || !refs) {
		if (qc)
			mlens_errf(err, errlen, "%s: out of memory", m->dir);
		rc = qc ? -ENOMEM : -EINVAL;
		goto out;
	}
	for (size_t i = 0; i < nref; i++) {
		refs[i].data = m->expert_table[i];
		refs[i].slot = i;
	}
	qsort(refs, nref, sizeof(*refs), by_data);

	/* pass 1: check every fp8 tensor; experts all fp8 or none. A tensor
	 * the binding did not name is left unused for bind_weights to refuse:
	 * an empty one can start at an expert's first byte and is no expert. */
	for (int i = 0; i < m->n_tensors; i++) {
		const struct mlens_tensor *t = &m->tensors[i];
		struct expert_ref key = { t->data, 0 };
		bool expert = bsearch(&key, refs, nref, sizeof(key), by_data) != NULL;
		struct mlens_wscale k;

		if (!used[i])
			continue;
		if (t->dtype != MLENS_DTYPE_E4M3) {
			if (expert && !a16)
				a16 = t;
			continue;
		}
		if (!find_scale(m, qc, t, &k, err, errlen)) {
			rc = -EINVAL;
			goto out;
		}
		if (expert) {
			if (!a8)
				a8 = t;
			if (k.kind == MLENS_WSCALE_CHANNEL && c->expert_scale.kind == MLENS_WSCALE_BLOCK) {
				mlens_errf(err, errlen, "%s: expert tensor '%s' has per-channel scales but quantization_config asks for %dx%d blocks; mlens needs one scale layout for all experts",
					   m->files[t->file].path, t->name, c->expert_scale.block_rows,
					   c->expert_scale.block_cols);
				rc = -EINVAL;
				goto out;
			}
			n8++;
		} else {
			nother++;
		}
	}
	if (a8 && a16) {
		mlens_errf(err, errlen, "%s: expert tensor '%s' is %s while expert '%s' is F8_E4M3; mlens needs every expert in one dtype",
			   m->files[a16->file].path, a16->name, mlens_dtype_name(a16->dtype), a8->name);
		rc = -EINVAL;
		goto out;
	}
	if (!n8) {
		c->expert_dtype = c->dtype;
		c->expert_scale = (struct mlens_wscale){ MLENS_WSCALE_NONE, 0, 0 };
	} else {
		c->expert_dtype = MLENS_DTYPE_E4M3;
		if (c->expert_scale.kind != MLENS_WSCALE_BLOCK)
			c->expert_scale = (struct mlens_wscale){ MLENS_WSCALE_CHANNEL, 0, 0 };
		if ((rc = alloc_area(m, 0, err, errlen)))
			goto out;
	}
	m->quant->deq = calloc(nother + 1, sizeof(*m->quant->deq));
	if (!m->quant->deq) {
		mlens_errf(err, errlen, "%s: out of memory", m->dir);
		rc = -ENOMEM;
		goto out;
	}

	/* pass 2: scales into place, other fp8 matrices dequantized */
	{
		char *next = m->quant->area;
		for (int i = 0; i < m->n_tensors; i++) {
			const struct mlens_tensor *t = &m->tensors[i], *s, *in;
			struct expert_ref key = { t->data, 0 }, *e;
			struct mlens_wscale k;
			char name[512];

			if (t->dtype != MLENS_DTYPE_E4M3 || !used[i])
				continue;
			s = find_scale(m, qc, t, &k, err, errlen);
			used[t - m->tensors] = true;
			used[s - m->tensors] = true;
			snprintf(name, sizeof(name), "%.*s.input_scale", (int)strlen(t->name) - 7, t->name);
			in = mlens_model_tensor(m, name);
			if (in) {
				if (in->nbytes != mlens_dtype_size(in->dtype)) {
					mlens_errf(err, errlen, "%s: tensor '%s' must hold one scale",
						   m->files[in->file].path, in->name);
					rc = -EINVAL;
					goto out;
				}
				used[in - m->tensors] = true;
			}
			e = bsearch(&key, refs, nref, sizeof(key), by_data);
			if (!e) {
				if ((rc = dequantize(m, t, s, &k, err, errlen)))
					goto out;
				continue;
			}
			/* every expert matrix with this data (one tensor each) */
			while (e > refs && e[-1].data == t->data)
				e--;
			for (; e < refs + nref && e->data == t->data; e++) {
				float *dst = (float *)next;
				size_t bytes = mlens_model_scale_bytes(c, t->shape[0], t->shape[1]);

				if ((rc = copy_scales(m, s, &k, t->shape[0], dst, err, errlen)))
					goto out;
				if (k.kind == MLENS_WSCALE_TENSOR)	/* repeated: a row's, a block's */
					for (size_t r = 1; r < bytes / sizeof(float); r++)
						dst[r] = dst[0];
				m->quant->scale_table[e->slot] = dst;
				next += mlens_quant_piece(bytes);
			}
		}
	}
	rc = 0;
out:
	free(refs);
	json_decref(qc);
	return rc;
}

size_t mlens_model_quant_bytes(const struct mlens_model *m)
{
	size_t n = m->quant ? m->quant->area_bytes : 0;

	for (int i = 0; m->quant && i < m->quant->n_deq; i++)
		n += m->quant->deq[i].nbytes;
	return n;
}

void mlens_quant_free(struct mlens_model *m)
{
	struct mlens_quant *q = m->quant;

	if (!q)
		return;
	for (int i = 0; i < q->n_deq; i++)
		free((void *)q->deq[i].data);
	free(q->deq);
	free(q->scale_table);
	free(q->area);
	free(q);
	m->quant = NULL;
}

/* ==== quantize at load ==== */


struct qjob {
	struct mlens_model *m;
	char *base;		/* the area */
	size_t n;		/* matrices */
	size_t next;
	pthread_mutex_t lock;
	float *row[17];		/* a row's values, one buffer a worker */
	int nrow;		/* taken under lock by each worker */
};

/* Matrix i (layer l, expert e, w1/w2/w3): rows x cols, and where its fp8
 * copy and scales go in the area (all experts first, then all scales). */
static void qslot(const struct mlens_model *m, size_t i, int64_t *rows, int64_t *cols,
		  size_t *qoff, size_t *soff)
{
	const struct mlens_model_config *c = &m->cfg;
	int64_t H = c->hidden_size, I = c->intermediate_size, E = c->num_local_experts;
	size_t mat = (size_t)mlens_quant_piece((uint64_t)(H * I)), nall = (size_t)(3 * c->num_hidden_layers * E);
	size_t s13 = (size_t)mlens_quant_piece((uint64_t)I * 4), s2 = (size_t)mlens_quant_piece((uint64_t)H * 4);
	int which = (int)((i / (size_t)E) % 3);	/* table order: w1 [E], w2 [E], w3 [E] a layer */

	*rows = which == 1 ? H : I;
	*cols = which == 1 ? I : H;
	*qoff = i * mat;
	/* scales: per layer and expert in table order */
	*soff = nall * mat + (i / (3 * (size_t)E)) * (size_t)E * (2 * s13 + s2) +
		(which == 0 ? 0 : which == 1 ? (size_t)E * s13 : (size_t)E * (s13 + s2)) +
		(i % (size_t)E) * (which == 1 ? s2 : s13);
}

static void *quant_worker(void *arg)
{
	struct qjob *j = arg;
	const enum mlens_dtype dt = j->m->cfg.dtype;
	const struct mlens_wscale k = { MLENS_WSCALE_CHANNEL, 0, 0 };
	float *row;

	pthread_mutex_lock(&j->lock);
	row = j->row[j->nrow++];
	pthread_mutex_unlock(&j->lock);

	for (;;) {
		size_t i, qoff, soff;
		int64_t R, C;
		const void *src;
		uint8_t *q;
		float *s;

		pthread_mutex_lock(&j->lock);
		i = j->next++;
		pthread_mutex_unlock(&j->lock);
		if (i >= j->n)
			return NULL;
		qslot(j->m, i, &R, &C, &qoff, &soff);
		src = j->m->expert_table[i];
		q = (uint8_t *)j->base + qoff;
		s = (float *)(j->base + soff);
		for (int64_t r = 0; r < R; r++) {
			for (int64_t c = 0; c < C; c++)
				row[c] = mlens_load(src, dt, (size_t)(r * C + c));
			mlens_fp8_quantize(row, 1, C, &k, q + r * C, s + r);
		}
	}
}

void mlens_quant_config_at_load(struct mlens_model_config *c)
{
	c->expert_dtype = MLENS_DTYPE_E4M3;
	c->expert_scale = (struct mlens_wscale){ MLENS_WSCALE_CHANNEL, 0, 0 };
}

int mlens_model_quantize_experts(struct mlens_model *m, char *err, size_t errlen)
{
	struct mlens_model_config *c = &m->cfg;
	size_t n = (size_t)(3 * c->num_hidden_layers * c->num_local_experts);
	struct qjob j = { .m = m, .n = n, .lock = PTHREAD_MUTEX_INITIALIZER };
	long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
	int nt = ncpu > 16 ? 16 : ncpu < 1 ? 1 : (int)ncpu, started = 0;
	pthread_t th[16];
	int rc;

	if (c->expert_dtype == MLENS_DTYPE_E4M3)
		return 0;
	if (c->w2_transposed) {
		/* its down projections are [inter][hidden]: a row is no output channel */
		mlens_errf(err, errlen, "%s: %s experts (down projection stored transposed) cannot be quantized to fp8; set weight_dtype auto",
			   m->dir, c->architecture);
		return -ENOTSUP;
	}
	if (strcmp(c->architecture, "MixtralForCausalLM")) {
		/* the fp8 scales are bound for Mixtral's experts only; a shared
		 * expert or dense MLP would run without them */
		mlens_errf(err, errlen, "%s: %s experts cannot be quantized to fp8 (mlens quantizes MixtralForCausalLM experts only); set weight_dtype auto",
			   m->dir, c->architecture);
		return -ENOTSUP;
	}
	if (c->expert_dtype != c->dtype || c->dtype == MLENS_DTYPE_E4M3) {
		mlens_errf(err, errlen, "%s: experts in %s cannot be quantized to fp8", m->dir,
			   mlens_dtype_name(c->expert_dtype));
		return -EINVAL;
	}
	if (!m->quant && !(m->quant = calloc(1, sizeof(*m->quant)))) {
		mlens_errf(err, errlen, "%s: out of memory", m->dir);
		return -ENOMEM;
	}
	mlens_quant_config_at_load(c);
	if ((rc = alloc_area(m, 1, err, errlen))) {
		c->expert_dtype = c->dtype;
		c->expert_scale.kind = MLENS_WSCALE_NONE;
		return rc;
	}
	j.base = m->quant->area;
	for (int t = 0; t <= nt; t++) {
		size_t w = (size_t)(c->hidden_size > c->intermediate_size ? c->hidden_size
									   : c->intermediate_size);
		if (!(j.row[t] = malloc(w * sizeof(float))))
			rc = -ENOMEM;
	}
	for (int t = 0; !rc && t < nt; t++)
		if (!pthread_create(&th[t], NULL, quant_worker, &j))
			started++;
	if (!rc && !started)
		quant_worker(&j);
	for (int t = 0; t < started; t++)
		pthread_join(th[t], NULL);
	for (int t = 0; t <= nt; t++)
		free(j.row[t]);
	if (rc) {
		mlens_errf(err, errlen, "%s: out of memory quantizing the experts", m->dir);
		c->expert_dtype = c->dtype;
		c->expert_scale.kind = MLENS_WSCALE_NONE;
		return rc;
	}
	/* the experts now count at their fp8 size (GPU-only plans use it) */
	m->weight_bytes -= (size_t)n * (size_t)(c->hidden_size * c->intermediate_size) *
			   mlens_dtype_size(c->dtype);
	m->weight_bytes += (size_t)(n / 3) * (size_t)mlens_model_expert_bytes(c);
	for (size_t i = 0; i < n; i++) {
		int64_t R, C;
		size_t qoff, soff;
		qslot(m, i, &R, &C, &qoff, &soff);
		m->expert_table[i] = j.base + qoff;
		m->quant->scale_table[i] = (const float *)(j.base + soff);
	}
	return 0;
}
