/* Model directory loader: config.json (the keys every family shares;
 * family.c reads the rest), the safetensors files (single or sharded through
 * the index), read-only mappings, and the binding of every expected weight
 * by name and shape (names: the family table).
 * Nothing here reads tensor data: opening a 6 GB model touches headers only. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <jansson.h>

#include "daemon/errf.h"
#include "daemon/infile.h"
#include "daemon/model/family.h"
#include "daemon/model/model.h"
#include "daemon/model/model_int.h"
#include "daemon/model/quant.h"
#include "daemon/model/safetensors.h"

#define CONFIG_MAX_BYTES (16u << 20)
#define INDEX_MAX_BYTES (64u << 20)
#define MAX_SHARDS 4096

char *mlens_model_path(const char *dir, const char *name)
{
	size_t a = strlen(dir), b = strlen(name);
	char *p = malloc(a + b + 2);

	if (!p)
		return NULL;
	memcpy(p, dir, a);
	p[a] = '/';
	memcpy(p + a + 1, name, b + 1);
	return p;
}

/* Read a small JSON file whole. */
static int read_small(const char *path, size_t max, char **out, size_t *len,
		      char *err, size_t errlen)
{
	struct stat sb;
	char *buf = NULL;
	size_t got = 0;
	int fd, rc;

	fd = mlens_open_regular(path, "", &sb, err, errlen);
	if (fd < 0)
		return fd;
	if ((uint64_t)sb.st_size > max) {
		mlens_errf(err, errlen, "%s: %jd bytes is larger than the %zu-byte limit for this file",
		     path, (intmax_t)sb.st_size, max);
		rc = -EFBIG;
		goto out;
	}
	buf = malloc((size_t)sb.st_size + 1);
	if (!buf) {
		rc = -ENOMEM;
		mlens_errf(err, errlen, "%s: out of memory", path);
		goto out;
	}
	while (got < (size_t)sb.st_size) {
		ssize_t n = read(fd, buf + got, (size_t)sb.st_size - got);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			rc = n < 0 ? -errno : -EIO;
			mlens_errf(err, errlen, "%s: read failed: %s", path, n < 0 ? strerror(errno) : "file shrank");
			goto out;
		}
		got += (size_t)n;
	}
	buf[got] = '\0';
	*out = buf;
	*len = got;
	buf = NULL;
	rc = 0;
out:
	free(buf);
	close(fd);
	return rc;
}

/* ==== config.json ==== */

/* An integer field; absent or null takes def unless required. */
int mlens_cfg_int(const struct mlens_cfg_ctx *c, json_t *root, const char *key, bool required,
		  int64_t def, int64_t lo, int64_t hi, int64_t *out)
{
	json_t *v = json_object_get(root, key);

	if (!v || json_is_null(v)) {
		if (required) {
			mlens_errf(c->err, c->errlen, "%s: '%s' is missing", c->path, key);
			return -EINVAL;
		}
		*out = def;
		return 0;
	}
	if (!json_is_integer(v)) {
		mlens_errf(c->err, c->errlen, "%s: '%s' must be an integer", c->path, key);
		return -EINVAL;
	}
	*out = json_integer_value(v);
	if (*out < lo || *out > hi) {
		mlens_errf(c->err, c->errlen, "%s: '%s' is %" PRId64 "; mlens accepts %" PRId64 " to %" PRId64,
		     c->path, key, *out, lo, hi);
		return -EINVAL;
	}
	return 0;
}

int mlens_cfg_real(const struct mlens_cfg_ctx *c, json_t *obj, const char *key, double def,
		   double lo, double hi, double *out)
{
	json_t *v = json_object_get(obj, key);

	if (!v || json_is_null(v)) {
		*out = def;
		return 0;
	}
	if (!json_is_number(v)) {
		mlens_errf(c->err, c->errlen, "%s: '%s' must be a number", c->path, key);
		return -EINVAL;
	}
	*out = json_number_value(v);
	if (!isfinite(*out) || !(*out > lo) || !(*out < hi)) {
		mlens_errf(c->err, c->errlen, "%s: '%s' is %g; mlens accepts values above %g and below %g",
		     c->path, key, *out, lo, hi);
		return -EINVAL;
	}
	return 0;
}

/* The families mlens serves, for messages ("A, B and C"). */
static void family_names(char *buf, size_t len)
{
	const struct mlens_family *f;
	size_t off = 0;

	buf[0] = '\0';
	for (int i = 0; (f = mlens_family_at(i)) && off < len; i++)
		off += (size_t)snprintf(buf + off, len - off, "%s%s", i ? ", " : "", f->architecture);
}

static int check_arch(const struct mlens_cfg_ctx *c, json_t *root, struct mlens_model_config *cfg)
{
	json_t *a = json_object_get(root, "architectures"), *e;
	char names[256];
	size_t i;
	char *found;

	family_names(names, sizeof(names));
	if (!json_is_array(a)) {
		mlens_errf(c->err, c->errlen, "%s: no 'architectures' list; mlens serves %s models",
		     c->path, names);
		return -EINVAL;
	}
	json_array_foreach(a, i, e) {
		const struct mlens_family *f = json_is_string(e) ? mlens_family_find(json_string_value(e)) : NULL;
		if (f) {
			snprintf(cfg->architecture, sizeof(cfg->architecture), "%s", f->architecture);
			cfg->family = f;
			return 0;
		}
	}
	found = json_dumps(a, JSON_COMPACT);
	mlens_errf(c->err, c->errlen, "%s: architectures is %.200s; mlens serves only %s",
	     c->path, found ? found : "(unprintable)", names);
	free(found);
	return -ENOTSUP;
}

int mlens_cfg_rope(const struct mlens_cfg_ctx *c, json_t *root, double def,
		   struct mlens_model_config *cfg)
{
	json_t *rp = json_object_get(root, "rope_parameters");
	json_t *rs = json_object_get(root, "rope_scaling");
	int rc;

	/* transformers < 5 puts scaling in rope_scaling; Mixtral has none. */
	if (rs && !json_is_null(rs)) {
		json_t *t = json_object_get(rs, "rope_type");
		if (!t)
			t = json_object_get(rs, "type");
		if (!json_is_string(t) || strcmp(json_string_value(t), "default")) {
			char *v = json_dumps(rs, JSON_COMPACT | JSON_ENCODE_ANY);
			mlens_errf(c->err, c->errlen, "%s: 'rope_scaling' is %.120s; mlens implements only the default RoPE (set it to null)",
			     c->path, v ? v : "(unprintable)");
			free(v);
			return -ENOTSUP;
		}
	}
	rc = mlens_cfg_real(c, root, "rope_theta", def, 0.0, 1e30, &cfg->rope_theta);
	if (rc)
		return rc;
	if (rp && !json_is_null(rp)) {
		json_t *t;

		if (!json_is_object(rp)) {
			mlens_errf(c->err, c->errlen, "%s: 'rope_parameters' must be an object", c->path);
			return -EINVAL;
		}
		t = json_object_get(rp, "rope_type");
		if (t && !(json_is_string(t) && !strcmp(json_string_value(t), "default"))) {
			mlens_errf(c->err, c->errlen, "%s: rope_parameters.rope_type is %s%.40s%s; mlens implements only \"default\" RoPE",
			     c->path, json_is_string(t) ? "\"" : "",
			     json_is_string(t) ? json_string_value(t) : "not a string",
			     json_is_string(t) ? "\"" : "");
			return -ENOTSUP;
		}
		rc = mlens_cfg_real(c, rp, "rope_theta", cfg->rope_theta, 0.0, 1e30, &cfg->rope_theta);
		if (rc)
			return rc;
	}
	return 0;
}

static int parse_dtype(const struct mlens_cfg_ctx *c, json_t *root, struct mlens_model_config *cfg)
{
	const char *key = "dtype";
	json_t *v = json_object_get(root, key);
	const char *s;

	if (!v || json_is_null(v)) {
		key = "torch_dtype";
		v = json_object_get(root, key);
	}
	cfg->dtype_given = false;
	cfg->dtype = MLENS_DTYPE_BF16;
	if (!v || json_is_null(v))
		return 0;
	s = json_is_string(v) ? json_string_value(v) : "";
	if (!strcmp(s, "bfloat16"))
		cfg->dtype = MLENS_DTYPE_BF16;
	else if (!strcmp(s, "float16"))
		cfg->dtype = MLENS_DTYPE_F16;
	else if (!strcmp(s, "float32"))
		cfg->dtype = MLENS_DTYPE_F32;
	else {
		mlens_errf(c->err, c->errlen, "%s: %s '%.40s' is not supported (mlens reads bfloat16, float16 and float32)",
		     c->path, key, s);
		return -ENOTSUP;
	}
	cfg->dtype_given = true;
	return 0;
}

/* eos_token_id: absent or null leaves cfg's ids alone; an id or a list of
 * ids (each inside the vocabulary) replaces them. */
static int parse_eos(const struct mlens_cfg_ctx *c, json_t *root, struct mlens_model_config *cfg)
{
	json_t *v = json_object_get(root, "eos_token_id"), *e;
	int32_t ids[MLENS_MODEL_MAX_EOS];
	size_t i, n;

	if (!v || json_is_null(v))
		return 0;
	if (json_is_array(v) && json_array_size(v) > MLENS_MODEL_MAX_EOS) {
		mlens_errf(c->err, c->errlen, "%s: 'eos_token_id' lists %zu ids; mlens takes at most %d",
			   c->path, json_array_size(v), MLENS_MODEL_MAX_EOS);
		return -EINVAL;
	}
	n = json_is_array(v) ? json_array_size(v) : 1;
	for (i = 0; i < n; i++) {
		e = json_is_array(v) ? json_array_get(v, i) : v;
		if (!json_is_integer(e)) {
			mlens_errf(c->err, c->errlen, "%s: 'eos_token_id' must be a token id or a list of them",
				   c->path);
			return -EINVAL;
		}
		if (json_integer_value(e) < 0 || json_integer_value(e) >= cfg->vocab_size) {
			mlens_errf(c->err, c->errlen, "%s: 'eos_token_id' %" JSON_INTEGER_FORMAT " is outside the vocabulary [0, %" PRId64 ")",
				   c->path, json_integer_value(e), cfg->vocab_size);
			return -EINVAL;
		}
		ids[i] = (int32_t)json_integer_value(e);
	}
	memcpy(cfg->eos, ids, n * sizeof(ids[0]));
	cfg->n_eos = (int)n;
	return 0;
}

int mlens_cfg_dtype_eos(const struct mlens_cfg_ctx *c, json_t *root,
			struct mlens_model_config *cfg)
{
	int rc = parse_dtype(c, root, cfg);
	return rc ? rc : parse_eos(c, root, cfg);
}

/* A config file's text as a JSON object, or NULL with the message. */
static json_t *load_object(const char *json, size_t len, const char *path, char *err,
			   size_t errlen)
{
	json_error_t jerr;
	json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);

	if (!root) {
		mlens_errf(err, errlen, "%s: malformed JSON at line %d, column %d: %s",
		     path, jerr.line, jerr.column, jerr.text);
		return NULL;
	}
	if (!json_is_object(root)) {
		mlens_errf(err, errlen, "%s: top level must be a JSON object", path);
		json_decref(root);
		return NULL;
	}
	return root;
}

int mlens_model_parse_generation_config(const char *json, size_t len, const char *path,
					struct mlens_model_config *cfg, char *err, size_t errlen)
{
	struct mlens_cfg_ctx c = { path, err, errlen };
	json_t *root = load_object(json, len, path, err, errlen);
	int rc;

	if (!root)
		return -EINVAL;
	rc = parse_eos(&c, root, cfg);
	json_decref(root);
	return rc;
}

int mlens_model_parse_config(const char *json, size_t len, const char *path,
			     struct mlens_model_config *cfg, char *err, size_t errlen)
{
	struct mlens_cfg_ctx c = { path, err, errlen };
	json_t *root, *v;
	int rc;

	memset(cfg, 0, sizeof(*cfg));
	root = load_object(json, len, path, err, errlen);
	if (!root)
		return -EINVAL;
	rc = check_arch(&c, root, cfg);
	if (rc)
		goto out;
	if (cfg->family->own_config) {
		rc = cfg->family->parse(&c, root, cfg);
		goto out;
	}
	v = json_object_get(root, "hidden_act");
	if (v && !(json_is_string(v) && !strcmp(json_string_value(v), "silu"))) {
		mlens_errf(err, errlen, "%s: hidden_act must be \"silu\" for %s", path, cfg->architecture);
		rc = -ENOTSUP;
		goto out;
	}
	/* The bounds keep every product of dimensions (e.g. E * 2I * H)
	 * far inside int64_t, so shape arithmetic below cannot overflow. */
	if ((rc = mlens_cfg_int(&c, root, "vocab_size", true, 0, 1, 1 << 24, &cfg->vocab_size)) ||
	    (rc = mlens_cfg_int(&c, root, "hidden_size", true, 0, 1, 1 << 16, &cfg->hidden_size)) ||
	    (rc = mlens_cfg_int(&c, root, "num_hidden_layers", true, 0, 1, MLENS_MODEL_MAX_LAYERS, &cfg->num_hidden_layers)) ||
	    (rc = mlens_cfg_int(&c, root, "num_attention_heads", true, 0, 1, 1024, &cfg->num_attention_heads)) ||
	    (rc = mlens_cfg_int(&c, root, "num_key_value_heads", false, cfg->num_attention_heads, 1,
			  cfg->num_attention_heads, &cfg->num_key_value_heads)) ||
	    /* at least a one-token prompt and the token generated after it */
	    (rc = mlens_cfg_int(&c, root, "max_position_embeddings", false, 4096 * 32, 2, 1 << 24,
			  &cfg->max_position_embeddings)))
		goto out;
	if (cfg->num_attention_heads % cfg->num_key_value_heads) {
		mlens_errf(err, errlen, "%s: num_attention_heads %" PRId64 " is not a multiple of num_key_value_heads %" PRId64,
		     path, cfg->num_attention_heads, cfg->num_key_value_heads);
		rc = -EINVAL;
		goto out;
	}
	v = json_object_get(root, "head_dim");
	if (!v || json_is_null(v)) {
		if (cfg->hidden_size % cfg->num_attention_heads) {
			mlens_errf(err, errlen, "%s: head_dim is absent and hidden_size %" PRId64 " is not a multiple of num_attention_heads %" PRId64,
			     path, cfg->hidden_size, cfg->num_attention_heads);
			rc = -EINVAL;
			goto out;
		}
		cfg->head_dim = cfg->hidden_size / cfg->num_attention_heads;
	} else if ((rc = mlens_cfg_int(&c, root, "head_dim", true, 0, 1, 1024, &cfg->head_dim))) {
		goto out;
	}
	if (cfg->head_dim % 2) {
		mlens_errf(err, errlen, "%s: head_dim %" PRId64 " is odd; RoPE rotates pairs of dimensions",
		     path, cfg->head_dim);
		rc = -EINVAL;
		goto out;
	}
	if ((rc = mlens_cfg_rope(&c, root, 1e6, cfg)) ||
	    (rc = mlens_cfg_real(&c, root, "rms_norm_eps", 1e-5, 0.0, 1.0, &cfg->rms_norm_eps)) ||
	    (rc = mlens_cfg_dtype_eos(&c, root, cfg)) ||
	    (rc = mlens_quant_parse_config(json_object_get(root, "quantization_config"), path, cfg,
					   err, errlen)))
		goto out;
	v = json_object_get(root, "tie_word_embeddings");
	if (v && !json_is_boolean(v)) {
		mlens_errf(err, errlen, "%s: 'tie_word_embeddings' must be true or false", path);
		rc = -EINVAL;
		goto out;
	}
	cfg->tie_word_embeddings = json_is_true(v);
	/* the family's own keys: experts, MLP sizes, q/k norms, biases */
	if ((rc = cfg->family->parse(&c, root, cfg)))
		goto out;
	if (cfg->quant_method[0] && strcmp(cfg->architecture, "MixtralForCausalLM")) {
		/* fp8 scales are bound for Mixtral's expert names only, and a
		 * shared expert or dense MLP would have none */
		mlens_errf(err, errlen, "%s: quantization_config (quant_method %s) is set; mlens reads fp8 experts of MixtralForCausalLM only, %s weights must be bf16, fp16 or fp32",
			   path, cfg->quant_method, cfg->architecture);
		rc = -ENOTSUP;
		goto out;
	}
	rc = 0;
out:
	json_decref(root);
	return rc;
}

/* ==== model.safetensors.index.json ==== */

struct index_entry {
	const char *name;	/* key in the index JSON (owned by it) */
	int shard;
	bool seen;
};

struct shard_index {
	json_t *root;
	char **shards;
	int n_shards;
	struct index_entry *entries;
	size_t n_entries;
};

static int by_entry_name(const void *a, const void *b)
{
	return strcmp(((const struct index_entry *)a)->name, ((const struct index_entry *)b)->name);
}

static void index_free(struct shard_index *ix)
{
	for (int i = 0; i < ix->n_shards; i++)
		free(ix->shards[i]);
	free(ix->shards);
	free(ix->entries);
	json_decref(ix->root);
}

static int index_load(const char *path, struct shard_index *ix, char *err, size_t errlen)
{
	json_error_t jerr;
	json_t *wm, *v;
	const char *key;
	char *text = NULL;
	size_t len;
	int rc;

	memset(ix, 0, sizeof(*ix));
	rc = read_small(path, INDEX_MAX_BYTES, &text, &len, err, errlen);
	if (rc)
		return rc;
	ix->root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
	free(text);
	if (!ix->root) {
		mlens_errf(err, errlen, "%s: malformed JSON at line %d, column %d: %s",
		     path, jerr.line, jerr.column, jerr.text);
		return -EINVAL;
	}
	wm = json_object_get(ix->root, "weight_map");
	if (!json_is_object(wm) || json_object_size(wm) == 0) {
		mlens_errf(err, errlen, "%s: no 'weight_map' object naming each tensor's shard", path);
		return -EINVAL;
	}
	ix->entries = calloc(json_object_size(wm), sizeof(*ix->entries));
	ix->shards = calloc(MAX_SHARDS, sizeof(*ix->shards));
	if (!ix->entries || !ix->shards) {
		mlens_errf(err, errlen, "%s: out of memory", path);
		return -ENOMEM;
	}
	json_object_foreach(wm, key, v) {
		const char *s = json_is_string(v) ? json_string_value(v) : NULL;
		int k;

		if (!s || !*s || strchr(s, '/') || !strcmp(s, ".") || !strcmp(s, "..")) {
			mlens_errf(err, errlen, "%s: tensor '%s': shard must be a file name in the model directory",
			     path, key);
			return -EINVAL;
		}
		for (k = 0; k < ix->n_shards; k++)
			if (!strcmp(ix->shards[k], s))
				break;
		if (k == ix->n_shards) {
			if (k == MAX_SHARDS) {
				mlens_errf(err, errlen, "%s: more than %d shards", path, MAX_SHARDS);
				return -EINVAL;
			}
			ix->shards[k] = strdup(s);
			if (!ix->shards[k]) {
				mlens_errf(err, errlen, "%s: out of memory", path);
				return -ENOMEM;
			}
			ix->n_shards++;
		}
		ix->entries[ix->n_entries].name = key;
		ix->entries[ix->n_entries].shard = k;
		ix->n_entries++;
	}
	qsort(ix->entries, ix->n_entries, sizeof(*ix->entries), by_entry_name);
	return 0;
}

/* ==== files and the tensor table ==== */

static int map_file(struct mlens_model *m, const char *name, char *err, size_t errlen,
		    const char *why)
{
	struct mlens_model_file *f = &m->files[m->n_files];
	struct stat sb;
	int rc;

	f->fd = -1;
	f->path = mlens_model_path(m->dir, name);
	if (!f->path) {
		mlens_errf(err, errlen, "%s: out of memory", m->dir);
		return -ENOMEM;
	}
	m->n_files++;
	f->fd = mlens_open_regular(f->path, why, &sb, err, errlen);
	if (f->fd < 0) {
		rc = f->fd;
		f->fd = -1;
		return rc;
	}
	if ((uint64_t)sb.st_size > SIZE_MAX) {
		mlens_errf(err, errlen, "%s: too large to map", f->path);
		return -EFBIG;
	}
	f->size = (size_t)sb.st_size;
	if (f->size == 0)
		return 0;	/* nothing to map; the parser reports the empty file */
	f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, f->fd, 0);
	if (f->map == MAP_FAILED) {
		rc = -errno;
		f->map = NULL;
		mlens_errf(err, errlen, "%s: mmap failed: %s", f->path, strerror(-rc));
		return rc;
	}
	return 0;
}

/* Parse the last mapped file's header and append its tensors to the table. */
static int add_tensors(struct mlens_model *m, int *cap, char *err, size_t errlen)
{
	int fi = m->n_files - 1;
	struct mlens_model_file *f = &m->files[fi];
	struct mlens_safetensors st;
	int rc;

	rc = mlens_safetensors_parse(f->map, f->size, f->path, &st, err, errlen);
	if (rc)
		return rc;
	if (st.n_tensors > INT32_MAX - m->n_tensors) {
		mlens_errf(err, errlen, "%s: too many tensors in the model", f->path);
		rc = -EINVAL;
		goto out;
	}
	if (m->n_tensors + st.n_tensors > *cap) {
		int ncap = m->n_tensors + st.n_tensors;
		struct mlens_tensor *nt;

		if (ncap < INT32_MAX / 2)
			ncap *= 2;
		nt = realloc(m->tensors, sizeof(*nt) * (size_t)ncap);
		if (!nt) {
			mlens_errf(err, errlen, "%s: out of memory", f->path);
			rc = -ENOMEM;
			goto out;
		}
		m->tensors = nt;
		*cap = ncap;
	}
	for (int i = 0; i < st.n_tensors; i++) {
		struct mlens_tensor *t = &m->tensors[m->n_tensors++];
		struct mlens_st_tensor *s = &st.tensors[i];

		t->name = s->name;
		s->name = NULL;		/* moved into the model */
		t->dtype = s->dtype;
		t->ndim = s->ndim;
		memcpy(t->shape, s->shape, sizeof(t->shape));
		t->nbytes = (size_t)(s->end - s->begin);
		t->file = fi;
		t->offset = st.data_start + s->begin;
		t->data = (const char *)f->map + t->offset;
	}
	rc = 0;
out:
	mlens_safetensors_free(&st);
	return rc;
}

static int by_tensor_name(const void *a, const void *b)
{
	return strcmp(((const struct mlens_tensor *)a)->name, ((const struct mlens_tensor *)b)->name);
}

const struct mlens_tensor *mlens_model_tensor(const struct mlens_model *m, const char *name)
{
	struct mlens_tensor key = { .name = (char *)name };

	if (!m->n_tensors)
		return NULL;
	return bsearch(&key, m->tensors, (size_t)m->n_tensors, sizeof(key), by_tensor_name);
}

/* Every tensor in a shard must be in the index, in that shard, and every
 * index entry must have been found. */
static int check_index(struct mlens_model *m, struct shard_index *ix, const char *ixpath,
		       char *err, size_t errlen)
{
	for (int i = 0; i < m->n_tensors; i++) {
		const struct mlens_tensor *t = &m->tensors[i];
		struct index_entry key = { .name = t->name }, *e;

		e = bsearch(&key, ix->entries, ix->n_entries, sizeof(key), by_entry_name);
		if (!e) {
			mlens_errf(err, errlen, "%s: tensor '%s' is not listed in %s",
			     m->files[t->file].path, t->name, ixpath);
			return -EINVAL;
		}
		if (e->shard != t->file) {
			mlens_errf(err, errlen, "%s: tensor '%s' is in this shard but %s places it in %s",
			     m->files[t->file].path, t->name, ixpath, ix->shards[e->shard]);
			return -EINVAL;
		}
		e->seen = true;
	}
	for (size_t i = 0; i < ix->n_entries; i++) {
		if (!ix->entries[i].seen) {
			mlens_errf(err, errlen, "%s: tensor '%s' is listed in %s but its shard has no such tensor",
			     m->files[ix->entries[i].shard].path, ix->entries[i].name, ixpath);
			return -EINVAL;
		}
	}
	return 0;
}

/* ==== binding the weights (names: the family table) ==== */

const struct mlens_tensor *mlens_binder_need(struct mlens_binder *b, const char *name, int ndim,
					     int64_t d0, int64_t d1, int64_t d2)
{
	const int64_t want[3] = { d0, d1, d2 };
	const struct mlens_tensor *t;
	char have[96], exp[96];
	size_t off;

	if (b->rc)
		return NULL;
	t = mlens_model_tensor(b->m, name);
	if (!t) {
		if (!b->missing++)
			snprintf(b->first_missing, sizeof(b->first_missing), "%s", name);
		return NULL;
	}
	b->used[t - b->m->tensors] = true;
	if (t->ndim == ndim && !memcmp(t->shape, want, sizeof(want[0]) * (size_t)ndim))
		return t;
	off = (size_t)snprintf(have, sizeof(have), "[");
	for (int i = 0; i < t->ndim; i++)
		off += (size_t)snprintf(have + off, sizeof(have) - off, "%s%" PRId64, i ? ", " : "", t->shape[i]);
	snprintf(have + off, sizeof(have) - off, "]");
	off = (size_t)snprintf(exp, sizeof(exp), "[");
	for (int i = 0; i < ndim; i++)
		off += (size_t)snprintf(exp + off, sizeof(exp) - off, "%s%" PRId64, i ? ", " : "", want[i]);
	snprintf(exp + off, sizeof(exp) - off, "]");
	mlens_errf(b->err, b->errlen, "%s: tensor '%s': shape %s does not match config.json, which implies %s",
	     b->m->files[t->file].path, name, have, exp);
	b->rc = -EINVAL;
	return NULL;
}

static int bind_weights(struct mlens_model *m, char *err, size_t errlen)
{
	const struct mlens_model_config *c = &m->cfg;
	const int64_t V = c->vocab_size, H = c->hidden_size, I = c->intermediate_size;
	const int64_t E = c->num_local_experts, L = c->num_hidden_layers;
	const int64_t Q = c->num_attention_heads * c->head_dim;
	const int64_t KV = c->num_key_value_heads * c->head_dim;
	const size_t es = mlens_dtype_size(c->dtype);
	const struct mlens_family *f = c->family;
	struct mlens_binder b = { .m = m, .err = err, .errlen = errlen };
	char n[160];
	int rc;

	b.used = calloc((size_t)m->n_tensors + 1, sizeof(*b.used));
	m->layers = calloc((size_t)L, sizeof(*m->layers));
	m->expert_table = calloc((size_t)(3 * L * E), sizeof(*m->expert_table));
	if (f->bind_layer) {
		/* a family binding its own layers gets three row views a layer
		 * (DBRX: its fused Wqkv as wq, wk, wv) */
		m->views = calloc((size_t)(3 * L), sizeof(*m->views));
		m->n_views = (int)(3 * L);	/* L is bounded by MLENS_MODEL_MAX_LAYERS */
	}
	if (!b.used || !m->layers || !m->expert_table || (f->bind_layer && !m->views)) {
		mlens_errf(err, errlen, "%s: out of memory", m->dir);
		rc = -ENOMEM;
		goto out;
	}
	m->embed = mlens_binder_need(&b, f->embed, 2, V, H, 0);
	m->final_norm = mlens_binder_need(&b, f->final_norm, 1, H, 0, 0);
	if (c->tie_word_embeddings) {
		const struct mlens_tensor *lm = mlens_model_tensor(m, "lm_head.weight");
		/* transformers drops a tied head when saving; tolerate one that
		 * was kept, but compute with the embedding as transformers does. */
		if (lm)
			b.used[lm - m->tensors] = true;
		m->lm_head = m->embed;
	} else {
		m->lm_head = mlens_binder_need(&b, "lm_head.weight", 2, V, H, 0);
	}
	for (int64_t i = 0; i < L && !b.rc; i++) {
		struct mlens_layer_weights *l = &m->layers[i];
		const struct mlens_tensor *gu, *dn;
		const int64_t qn = c->qk_norm == MLENS_QK_NORM_HEAD ? c->head_dim : Q;
		const int64_t kn = c->qk_norm == MLENS_QK_NORM_HEAD ? c->head_dim : KV;

		l->w1 = m->expert_table + 3 * i * E;
		l->w2 = l->w1 + E;
		l->w3 = l->w2 + E;
		if (f->bind_layer) {
			f->bind_layer(&b, i);
			continue;
		}
#define T(fmt, ...) (snprintf(n, sizeof(n), "model.layers.%" PRId64 "." fmt, i, ##__VA_ARGS__), n)
		l->attn_norm = mlens_binder_need(&b, T("input_layernorm.weight"), 1, H, 0, 0);
		l->wq = mlens_binder_need(&b, T("self_attn.q_proj.weight"), 2, Q, H, 0);
		l->wk = mlens_binder_need(&b, T("self_attn.k_proj.weight"), 2, KV, H, 0);
		l->wv = mlens_binder_need(&b, T("self_attn.v_proj.weight"), 2, KV, H, 0);
		l->wo = mlens_binder_need(&b, T("self_attn.o_proj.weight"), 2, H, Q, 0);
		l->ffn_norm = mlens_binder_need(&b, T("post_attention_layernorm.weight"), 1, H, 0, 0);
		if (c->qk_norm) {
			l->q_norm = mlens_binder_need(&b, T("self_attn.q_norm.weight"), 1, qn, 0, 0);
			l->k_norm = mlens_binder_need(&b, T("self_attn.k_norm.weight"), 1, kn, 0, 0);
		}
		if (c->qkv_bias) {
			l->bq = mlens_binder_need(&b, T("self_attn.q_proj.bias"), 1, Q, 0, 0);
			l->bk = mlens_binder_need(&b, T("self_attn.k_proj.bias"), 1, KV, 0, 0);
			l->bv = mlens_binder_need(&b, T("self_attn.v_proj.bias"), 1, KV, 0, 0);
		}
		if (c->o_bias)
			l->bo = mlens_binder_need(&b, T("self_attn.o_proj.bias"), 1, H, 0, 0);
		if (c->dense[i]) {
			/* a dense layer: its MLP is the one SwiGLU, no experts */
			const int64_t D = l->mlp_inter = c->dense_inter;
			l->mlp_w1 = mlens_binder_need(&b, T("mlp.gate_proj.weight"), 2, D, H, 0);
			l->mlp_w2 = mlens_binder_need(&b, T("mlp.down_proj.weight"), 2, H, D, 0);
			l->mlp_w3 = mlens_binder_need(&b, T("mlp.up_proj.weight"), 2, D, H, 0);
			continue;
		}
		if (c->shared_inter) {
			const int64_t S = l->mlp_inter = c->shared_inter;
			l->mlp_w1 = mlens_binder_need(&b, T("mlp.shared_expert.gate_proj.weight"), 2, S, H, 0);
			l->mlp_w2 = mlens_binder_need(&b, T("mlp.shared_expert.down_proj.weight"), 2, H, S, 0);
			l->mlp_w3 = mlens_binder_need(&b, T("mlp.shared_expert.up_proj.weight"), 2, S, H, 0);
			if (c->shared_gate)
				l->mlp_gate = mlens_binder_need(&b, T("mlp.shared_expert_gate.weight"), 2, 1, H, 0);
		}
		if (mlens_model_tensor(m, T("mlp.experts.gate_up_proj"))) {
			/* transformers 5 fused layout: gate rows then up rows. */
			l->router = mlens_binder_need(&b, T("mlp.gate.weight"), 2, E, H, 0);
			gu = mlens_binder_need(&b, T("mlp.experts.gate_up_proj"), 3, E, 2 * I, H);
			dn = mlens_binder_need(&b, T("mlp.experts.down_proj"), 3, E, H, I);
			for (int64_t j = 0; gu && dn && j < E; j++) {
				const char *g = gu->data, *d = dn->data;
				l->w1[j] = g + (size_t)(j * 2 * I * H) * es;
				l->w3[j] = g + (size_t)((j * 2 + 1) * I * H) * es;
				l->w2[j] = d + (size_t)(j * H * I) * es;
			}
			continue;
		}
		l->router = mlens_binder_need(&b, T("%s", f->router), 2, E, H, 0);
		for (int64_t j = 0; j < E; j++) {
			const struct mlens_tensor *w1, *w2, *w3;

#define X(k) T("%s.%" PRId64 ".%s.weight", f->experts, j, f->expert_w[k])
			w1 = mlens_binder_need(&b, X(0), 2, I, H, 0);
			w2 = mlens_binder_need(&b, X(1), 2, H, I, 0);
			w3 = mlens_binder_need(&b, X(2), 2, I, H, 0);
#undef X
			l->w1[j] = w1 ? w1->data : NULL;
			l->w2[j] = w2 ? w2->data : NULL;
			l->w3[j] = w3 ? w3->data : NULL;
		}
#undef T
	}
	rc = b.rc;
	if (rc)
		goto out;
	if (!b.missing && (rc = mlens_quant_bind(m, b.used, err, errlen)))
		goto out;
	if (b.missing) {
		mlens_errf(err, errlen, "%s: tensor '%s' is missing (%d expected tensor%s missing in all; config.json: %" PRId64 " layers, %" PRId64 " experts%s)",
		     m->dir, b.first_missing, b.missing, b.missing == 1 ? " is" : "s are", L, E,
		     c->tie_word_embeddings ? ", tied embeddings" : "");
		rc = -EINVAL;
		goto out;
	}
	for (int i = 0; i < m->n_tensors; i++) {
		if (!b.used[i]) {
			mlens_errf(err, errlen, "%s: tensor '%s' is not part of the %s model config.json describes (%" PRId64 " layers, %" PRId64 " experts)",
			     m->files[m->tensors[i].file].path, m->tensors[i].name, c->architecture, L, E);
			rc = -EINVAL;
			goto out;
		}
	}
	rc = 0;
out:
	free(b.used);
	return rc;
}

/* ==== open/close ==== */

void mlens_model_close(struct mlens_model *m)
{
	if (!m)
		return;
	for (int i = 0; i < m->n_files; i++) {
		if (m->files[i].map)
			munmap(m->files[i].map, m->files[i].size);
		if (m->files[i].fd >= 0)
			close(m->files[i].fd);
		free(m->files[i].path);
	}
	for (int i = 0; i < m->n_tensors; i++)
		free(m->tensors[i].name);
	free(m->files);
	free(m->tensors);
	mlens_quant_free(m);
	free(m->layers);
	free(m->expert_table);
	free(m->views);
	free(m->dir);
	free(m);
}

int mlens_model_read_config(const char *path, struct mlens_model_config *cfg, char *err,
			    size_t errlen)
{
	char *text = NULL;
	size_t len;
	int rc = read_small(path, CONFIG_MAX_BYTES, &text, &len, err, errlen);
	if (!rc)
		rc = mlens_model_parse_config(text, len, path, cfg, err, errlen);
	free(text);
	return rc;
}

/* generation_config.json, when the directory has one (its EOS ids win). */
static int read_generation_config(const char *dir, struct mlens_model_config *cfg, char *err,
				  size_t errlen)
{
	char *path = mlens_model_path(dir, "generation_config.json"), *text = NULL;
	size_t len;
	int rc;

	if (!path) {
		mlens_errf(err, errlen, "%s: out of memory", dir);
		return -ENOMEM;
	}
	rc = access(path, F_OK) ? 0 : read_small(path, CONFIG_MAX_BYTES, &text, &len, err, errlen);
	if (!rc && text)
		rc = mlens_model_parse_generation_config(text, len, path, cfg, err, errlen);
	free(text);
	free(path);
	return rc;
}

int mlens_model_open(const char *dir, struct mlens_model **out, char *err, size_t errlen)
{
	struct mlens_model *m;
	struct shard_index ix = { 0 };
	char *cpath = NULL, *spath = NULL, *ipath = NULL;
	int cap = 0, rc;
	bool sharded;

	*out = NULL;
	m = calloc(1, sizeof(*m));
	if (!m || !(m->dir = strdup(dir)) || !(cpath = mlens_model_path(dir, "config.json")) ||
	    !(spath = mlens_model_path(dir, "model.safetensors")) ||
	    !(ipath = mlens_model_path(dir, "model.safetensors.index.json"))) {
		mlens_errf(err, errlen, "%s: out of memory", dir);
		rc = -ENOMEM;
		goto out;
	}
	rc = mlens_model_read_config(cpath, &m->cfg, err, errlen);
	if (!rc)
		rc = read_generation_config(dir, &m->cfg, err, errlen);
	if (rc)
		goto out;

	/* As transformers does: a single model.safetensors wins over an index. */
	sharded = access(spath, F_OK) != 0;
	if (sharded && access(ipath, F_OK) != 0) {
		mlens_errf(err, errlen, "%s: neither model.safetensors nor model.safetensors.index.json is present",
		     dir);
		rc = -ENOENT;
		goto out;
	}
	if (sharded) {
		rc = index_load(ipath, &ix, err, errlen);
		if (rc)
			goto out;
		m->files = calloc((size_t)ix.n_shards, sizeof(*m->files));
		if (!m->files) {
			rc = -ENOMEM;
			mlens_errf(err, errlen, "%s: out of memory", dir);
			goto out;
		}
		for (int i = 0; i < ix.n_shards && !rc; i++) {
			rc = map_file(m, ix.shards[i], err, errlen,
				      " (named by model.safetensors.index.json)");
			if (!rc)
				rc = add_tensors(m, &cap, err, errlen);
		}
	} else {
		m->files = calloc(1, sizeof(*m->files));
		rc = m->files ? map_file(m, "model.safetensors", err, errlen, "") : -ENOMEM;
		if (!rc)
			rc = add_tensors(m, &cap, err, errlen);
		else if (rc == -ENOMEM)
			mlens_errf(err, errlen, "%s: out of memory", dir);
	}
	if (rc)
		goto out;
	if (m->n_tensors)
		qsort(m->tensors, (size_t)m->n_tensors, sizeof(*m->tensors), by_tensor_name);
	for (int i = 1; i < m->n_tensors; i++) {
		if (!strcmp(m->tensors[i - 1].name, m->tensors[i].name)) {
			mlens_errf(err, errlen, "%s: tensor '%s' is also in %s", m->files[m->tensors[i].file].path,
			     m->tensors[i].name, m->files[m->tensors[i - 1].file].path);
			rc = -EINVAL;
			goto out;
		}
	}
	if (sharded && (rc = check_index(m, &ix, ipath, err, errlen)))
		goto out;
	for (int i = 0; !m->cfg.dtype_given && i < m->n_tensors; i++)
		if (!mlens_quant_tensor_exempt(&m->cfg, &m->tensors[i])) {
			m->cfg.dtype = m->tensors[i].dtype;
			break;
		}
	if (!m->cfg.quant_method[0])
		m->cfg.expert_dtype = m->cfg.dtype;
	for (int i = 0; i < m->n_tensors; i++) {
		const struct mlens_tensor *t = &m->tensors[i];

		if (t->dtype != m->cfg.dtype && !mlens_quant_tensor_exempt(&m->cfg, t)) {
			mlens_errf(err, errlen, "%s: tensor '%s': dtype %s differs from the model's %s (%s)",
			     m->files[t->file].path, t->name, mlens_dtype_name(t->dtype),
			     mlens_dtype_name(m->cfg.dtype),
			     m->cfg.dtype_given ? "config.json" : "the first tensor's");
			rc = -EINVAL;
			goto out;
		}
		if (__builtin_add_overflow(m->weight_bytes, t->nbytes, &m->weight_bytes)) {
			mlens_errf(err, errlen, "%s: total weight size overflows", dir);
			rc = -EOVERFLOW;
			goto out;
		}
	}
	rc = bind_weights(m, err, errlen);
out:
	index_free(&ix);
	free(cpath);
	free(spath);
	free(ipath);
	if (rc) {
		mlens_model_close(m);
		return rc;
	}
	*out = m;
	return 0;
}
