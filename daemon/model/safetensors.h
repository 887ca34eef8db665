/* The safetensors container: an 8-byte little-endian header length, a JSON
 * header naming each tensor's dtype, shape and byte range, then the data.
 * This parser only validates and indexes a buffer (usually a mapped file);
 * it never copies or touches tensor data. */
#ifndef MLENS_SAFETENSORS_H
#define MLENS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"

/* The safetensors reference implementation refuses larger headers too. */
#define MLENS_SAFETENSORS_MAX_HEADER (100u * 1000u * 1000u)

struct mlens_st_tensor {
	char *name;
	enum mlens_dtype dtype;
	int ndim;
	int64_t shape[MLENS_MODEL_MAX_DIMS];
	uint64_t begin;		/* byte range relative to the data section */
	uint64_t end;
};

struct mlens_safetensors {
	uint64_t data_start;	/* absolute offset of the data section */
	uint64_t data_len;
	struct mlens_st_tensor *tensors;	/* in header order */
	int n_tensors;
};

/* Validate the safetensors bytes buf[0..len) (the whole file) and index its
 * tensors. name is the file name used in messages. Checks: header length
 * within the file, JSON syntax, dtype (F32/F16/BF16), ndim, every size and
 * offset (overflow-safe), byte count == product(shape) * dtype size,
 * element alignment, and that the tensors tile the data section exactly
 * (no overlap, no gap, no trailing bytes). Returns 0, or -EINVAL/-ENOMEM
 * with one message naming the file, the tensor and the fault. */
int mlens_safetensors_parse(const void *buf, size_t len, const char *name,
			    struct mlens_safetensors *out, char *err, size_t errlen);
void mlens_safetensors_free(struct mlens_safetensors *st);

/* Parse a dtype name as written in safetensors headers ("BF16"...).
 * Returns 0, or -1 if mlens cannot use it. */
int mlens_safetensors_dtype(const char *s, enum mlens_dtype *out);

#endif
