/* What the model-file tests share (check_model, check_dbrx): a temporary
 * directory per test and paths in it, reading and byte-editing its files,
 * writing a model there with mlens-mkmodel's library and opening it, the
 * loader's message in err. Check fixtures: setup and teardown. */
#ifndef MLENS_TEST_MODEL_FILES_H
#define MLENS_TEST_MODEL_FILES_H

#include <check.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "daemon/model/model.h"
#include "daemon/tools/mkmodel.h"

static char tmpdir[64];
static char err[2048];

static inline int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb; (void)flag; (void)ftw;
	return remove(p);
}

static inline void setup(void)
{
	snprintf(tmpdir, sizeof(tmpdir), "/tmp/mlens-check-model-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(tmpdir));
	err[0] = '\0';
}

static inline void teardown(void)
{
	nftw(tmpdir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* tmpdir/name; the last four results stay valid. */
static inline char *sub(const char *name)
{
	static char p[4][256];
	static int k;

	k = (k + 1) % 4;
	snprintf(p[k], sizeof(p[k]), "%s/%s", tmpdir, name);
	return p[k];
}

static inline void write_file(const char *path, const void *buf, size_t len)
{
	FILE *f = fopen(path, "wb");

	ck_assert_ptr_nonnull(f);
	ck_assert_uint_eq(fwrite(buf, 1, len, f), len);
	ck_assert_int_eq(fclose(f), 0);
}

/* The whole file, NUL-terminated; its length in *len. */
static inline char *read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	long n;
	char *buf;

	ck_assert_ptr_nonnull(f);
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	fseek(f, 0, SEEK_SET);
	buf = calloc(1, (size_t)n + 1);
	ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	*len = (size_t)n;
	return buf;
}

static inline char *read_text(const char *path)
{
	size_t len;
	return read_file(path, &len);
}

/* Replace the first `from` in a file by `to`, byte for byte: a config's
 * text, or a tensor's name in a safetensors header (of the same length,
 * so that the offsets stay). */
static inline void edit(const char *path, const char *from, const char *to)
{
	size_t len, fl = strlen(from), tl = strlen(to), head;
	char *t = read_file(path, &len), *at = memmem(t, len, from, fl), *out;

	ck_assert_msg(at != NULL, "'%s' not in %s", from, path);
	head = (size_t)(at - t);
	out = malloc(len - fl + tl);
	memcpy(out, t, head);
	memcpy(out + head, to, tl);
	memcpy(out + head + tl, at + fl, len - head - fl);
	write_file(path, out, len - fl + tl);
	free(out);
	free(t);
}

#define assert_err(...) do { \
	const char *want_[] = { __VA_ARGS__ }; \
	for (size_t i_ = 0; i_ < sizeof(want_) / sizeof(want_[0]); i_++) \
		ck_assert_msg(strstr(err, want_[i_]), "message lacks '%s': %s", want_[i_], err); \
} while (0)

static inline void make(const struct mlens_mkmodel_opts *o)
{
	int rc = mlens_mkmodel_write(o, err, sizeof(err));

	ck_assert_msg(rc == 0, "mkmodel: %s", err);
}

/* Open dir, which must fail: the error, the message in err. */
static inline int open_err(const char *dir)
{
	struct mlens_model *m = (void *)1;
	int rc = mlens_model_open(dir, &m, err, sizeof(err));

	ck_assert_ptr_null(m);
	return rc;
}

static inline struct mlens_model *open_ok(const char *dir)
{
	struct mlens_model *m = NULL;
	int rc = mlens_model_open(dir, &m, err, sizeof(err));

	ck_assert_msg(rc == 0, "open %s: %s", dir, err);
	return m;
}

#endif
