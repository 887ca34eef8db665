/* safetensors header validation over an in-memory buffer (a mapped file or
 * fuzzer input). Owns the checks of DESIGN §4: every size and offset is
 * computed with overflow-checked arithmetic before it is trusted. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jansson.h>

#include "daemon/errf.h"
#include "daemon/model/model_int.h"
#include "daemon/model/safetensors.h"

int mlens_safetensors_dtype(const char *s, enum mlens_dtype *out)
{
	if (!strcmp(s, "F32"))
		*out = MLENS_DTYPE_F32;
	else if (!strcmp(s, "F16"))
		*out = MLENS_DTYPE_F16;
	else if (!strcmp(s, "BF16"))
		*out = MLENS_DTYPE_BF16;
	else if (!strcmp(s, "F8_E4M3"))
		*out = MLENS_DTYPE_E4M3;
	else
		return -1;
	return 0;
}


static void fmt_shape(char *buf, size_t n, const int64_t *shape, int ndim)
{
	size_t off = 0;

	off += (size_t)snprintf(buf, n, "[");
	for (int i = 0; i < ndim && off < n; i++)
		off += (size_t)snprintf(buf + off, n - off, "%s%" PRId64, i ? ", " : "", shape[i]);
	if (off < n)
		snprintf(buf + off, n - off, "]");
}

static const char *json_kind(const json_t *v)
{
	switch (json_typeof(v)) {
	case JSON_OBJECT: return "object";
	case JSON_ARRAY: return "array";
	case JSON_STRING: return "string";
	case JSON_INTEGER: return "integer";
	case JSON_REAL: return "number";
	case JSON_TRUE:
	case JSON_FALSE: return "boolean";
	case JSON_NULL: return "null";
	}
	return "value";
}

void mlens_safetensors_free(struct mlens_safetensors *st)
{
	if (!st)
		return;
	for (int i = 0; i < st->n_tensors; i++)
		free(st->tensors[i].name);
	free(st->tensors);
	st->tensors = NULL;
	st->n_tensors = 0;
}

/* One header entry -> *t. The caller has already set t->name. */
static int parse_entry(const char *file, const char *tname, json_t *v,
		       const struct mlens_safetensors *st, struct mlens_st_tensor *t,
		       char *err, size_t errlen)
{
	json_t *jd, *js, *jo;
	uint64_t count = 1, nbytes, abs_off;
	size_t es;
	char shp[160];

	if (!json_is_object(v)) {
		mlens_errf(err, errlen, "%s: tensor '%s': header entry is a JSON %s, not an object",
		     file, tname, json_kind(v));
		return -EINVAL;
	}
	jd = json_object_get(v, "dtype");
	js = json_object_get(v, "shape");
	jo = json_object_get(v, "data_offsets");
	if (!json_is_string(jd) || !json_is_array(js) || !json_is_array(jo)) {
		mlens_errf(err, errlen, "%s: tensor '%s': header entry needs string 'dtype', array 'shape' and array 'data_offsets'",
		     file, tname);
		return -EINVAL;
	}
	if (mlens_safetensors_dtype(json_string_value(jd), &t->dtype)) {
		mlens_errf(err, errlen, "%s: tensor '%s': dtype %.32s is not supported (mlens reads F32, F16, BF16 and F8_E4M3)",
		     file, tname, json_string_value(jd));
		return -EINVAL;
	}
	if (json_array_size(js) > MLENS_MODEL_MAX_DIMS) {
		mlens_errf(err, errlen, "%s: tensor '%s': shape has %zu dimensions; mlens supports at most %d",
		     file, tname, json_array_size(js), MLENS_MODEL_MAX_DIMS);
		return -EINVAL;
	}
	t->ndim = (int)json_array_size(js);
	for (int i = 0; i < t->ndim; i++) {
		json_t *d = json_array_get(js, (size_t)i);
		if (!json_is_integer(d) || json_integer_value(d) < 0) {
			mlens_errf(err, errlen, "%s: tensor '%s': shape[%d] is not a non-negative integer",
			     file, tname, i);
			return -EINVAL;
		}
		t->shape[i] = json_integer_value(d);
	}
	fmt_shape(shp, sizeof(shp), t->shape, t->ndim);
	for (int i = 0; i < t->ndim; i++) {
		if (__builtin_mul_overflow(count, (uint64_t)t->shape[i], &count)) {
			mlens_errf(err, errlen, "%s: tensor '%s': shape %s overflows a 64-bit element count",
			     file, tname, shp);
			return -EINVAL;
		}
	}
	es = mlens_dtype_size(t->dtype);
	if (__builtin_mul_overflow(count, (uint64_t)es, &nbytes) || nbytes > SIZE_MAX) {
		mlens_errf(err, errlen, "%s: tensor '%s': shape %s of %s overflows a 64-bit byte count",
		     file, tname, shp, mlens_dtype_name(t->dtype));
		return -EINVAL;
	}
	if (json_array_size(jo) != 2 || !json_is_integer(json_array_get(jo, 0)) ||
	    !json_is_integer(json_array_get(jo, 1)) ||
	    json_integer_value(json_array_get(jo, 0)) < 0 ||
	    json_integer_value(json_array_get(jo, 1)) < 0) {
		mlens_errf(err, errlen, "%s: tensor '%s': data_offsets is not a pair of non-negative integers",
		     file, tname);
		return -EINVAL;
	}
	t->begin = (uint64_t)json_integer_value(json_array_get(jo, 0));
	t->end = (uint64_t)json_integer_value(json_array_get(jo, 1));
	if (t->begin > t->end) {
		mlens_errf(err, errlen, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 ") end before they begin",
		     file, tname, t->begin, t->end);
		return -EINVAL;
	}
	if (t->end > st->data_len) {
		mlens_errf(err, errlen, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 ") run past the data section (%" PRIu64 " bytes)",
		     file, tname, t->begin, t->end, st->data_len);
		return -EINVAL;
	}
	if (t->end - t->begin != nbytes) {
		mlens_errf(err, errlen, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 ") hold %" PRIu64 " bytes but shape %s of %s needs %" PRIu64,
		     file, tname, t->begin, t->end, t->end - t->begin, shp,
		     mlens_dtype_name(t->dtype), nbytes);
		return -EINVAL;
	}
	/* Kernels read elements through typed pointers: misaligned data would
	 * be undefined behaviour. Files written by safetensors are aligned. */
	if (__builtin_add_overflow(st->data_start, t->begin, &abs_off) || abs_off % es) {
		mlens_errf(err, errlen, "%s: tensor '%s': data at file offset %" PRIu64 " is not aligned to its %zu-byte elements",
		     file, tname, abs_off, es);
		return -EINVAL;
	}
	return 0;
}

static int by_range(const void *a, const void *b)
{
	const struct mlens_st_tensor *x = *(const struct mlens_st_tensor *const *)a;
	const struct mlens_st_tensor *y = *(const struct mlens_st_tensor *const *)b;

	if (x->begin != y->begin)
		return x->begin < y->begin ? -1 : 1;
	if (x->end != y->end)
		return x->end < y->end ? -1 : 1;
	return 0;
}

/* The tensors must tile [0, data_len) exactly: the format has no holes. */
static int check_coverage(const char *file, const struct mlens_safetensors *st,
			  char *err, size_t errlen)
{
	const struct mlens_st_tensor **order;
	uint64_t pos = 0;
	const struct mlens_st_tensor *prev = NULL;

	if (st->n_tensors == 0) {
		if (st->data_len) {
			mlens_errf(err, errlen, "%s: header lists no tensors but %" PRIu64 " data bytes follow it",
			     file, st->data_len);
			return -EINVAL;
		}
		return 0;
	}
	order = malloc(sizeof(*order) * (size_t)st->n_tensors);
	if (!order) {
		mlens_errf(err, errlen, "%s: out of memory indexing %d tensors", file, st->n_tensors);
		return -ENOMEM;
	}
	for (int i = 0; i < st->n_tensors; i++)
		order[i] = &st->tensors[i];
	qsort(order, (size_t)st->n_tensors, sizeof(*order), by_range);
	for (int i = 0; i < st->n_tensors; i++) {
		const struct mlens_st_tensor *t = order[i];
		if (t->begin < pos) {
			mlens_errf(err, errlen, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 ") overlap tensor '%s' [%" PRIu64 ", %" PRIu64 ")",
			     file, t->name, t->begin, t->end, prev->name, prev->begin, prev->end);
			goto bad;
		}
		if (t->begin > pos) {
			if (prev)
				mlens_errf(err, errlen, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 ") leave a gap of %" PRIu64 " bytes after tensor '%s' (ends at %" PRIu64 ")",
				     file, t->name, t->begin, t->end, t->begin - pos, prev->name, pos);
			else
				mlens_errf(err, errlen, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 ") leave a gap of %" PRIu64 " bytes at the start of the data section",
				     file, t->name, t->begin, t->end, t->begin);
			goto bad;
		}
		pos = t->end;
		prev = t;
	}
	if (pos != st->data_len) {
		mlens_errf(err, errlen, "%s: tensor '%s': data ends at %" PRIu64 " but the data section holds %" PRIu64 " bytes; the rest belongs to no tensor",
		     file, prev->name, pos, st->data_len);
		goto bad;
	}
	free(order);
	return 0;
bad:
	free(order);
	return -EINVAL;
}

int mlens_safetensors_parse(const void *buf, size_t len, const char *name,
			    struct mlens_safetensors *out, char *err, size_t errlen)
{
	const unsigned char *p = buf;
	uint64_t hlen = 0, start;
	json_t *root = NULL, *v;
	json_error_t jerr;
	const char *key;
	size_t cap;
	int rc;

	memset(out, 0, sizeof(*out));
	if (len < 8) {
		mlens_errf(err, errlen, "%s: file is %zu bytes, too short for the 8-byte header length",
		     name, len);
		return -EINVAL;
	}
	for (int i = 7; i >= 0; i--)
		hlen = (hlen << 8) | p[i];
	if (hlen > len - 8) {
		mlens_errf(err, errlen, "%s: header length %" PRIu64 " runs past the end of the file (%zu bytes)",
		     name, hlen, len);
		return -EINVAL;
	}
	if (hlen > MLENS_SAFETENSORS_MAX_HEADER) {
		mlens_errf(err, errlen, "%s: header length %" PRIu64 " exceeds the %u-byte limit",
		     name, hlen, MLENS_SAFETENSORS_MAX_HEADER);
		return -EINVAL;
	}
	start = 8 + hlen;
	out->data_start = start;
	out->data_len = len - start;

	root = json_loadb((const char *)p + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
	if (!root) {
		mlens_errf(err, errlen, "%s: header is not valid JSON (line %d, column %d): %s",
		     name, jerr.line, jerr.column, jerr.text);
		return -EINVAL;
	}
	if (!json_is_object(root)) {
		mlens_errf(err, errlen, "%s: header is a JSON %s, not an object", name, json_kind(root));
		rc = -EINVAL;
		goto out;
	}
	cap = json_object_size(root);
	if (cap > (size_t)INT32_MAX) {
		mlens_errf(err, errlen, "%s: header lists too many tensors", name);
		rc = -EINVAL;
		goto out;
	}
	out->tensors = calloc(cap ? cap : 1, sizeof(*out->tensors));
	if (!out->tensors) {
		mlens_errf(err, errlen, "%s: out of memory for %zu tensors", name, cap);
		rc = -ENOMEM;
		goto out;
	}
	json_object_foreach(root, key, v) {
		struct mlens_st_tensor *t;

		if (!strcmp(key, "__metadata__"))
			continue;
		t = &out->tensors[out->n_tensors];
		rc = parse_entry(name, key, v, out, t, err, errlen);
		if (rc)
			goto out;
		t->name = strdup(key);
		if (!t->name) {
			mlens_errf(err, errlen, "%s: out of memory", name);
			rc = -ENOMEM;
			goto out;
		}
		out->n_tensors++;
	}
	rc = check_coverage(name, out, err, errlen);
out:
	json_decref(root);
	if (rc)
		mlens_safetensors_free(out);
	return rc;
}
