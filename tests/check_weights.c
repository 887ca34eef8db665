/* Description: the weight pages (daemon/model/weights.c): a model's files read
 * into pinned memory by io_uring movers (many small chunks, several
 * movers, one read in flight or several) and by the mmap copy, each file
 * at a page-aligned offset, byte for byte the file with zeroes after it,
 * both ways the same pages; every tensor and every expert (per-expert and
 * fused layouts) pointed into the pages at the generator's values; a file
 * gone or shrunk after the model was opened is an error naming it, and
 * nothing is kept. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "daemon/tools/mkmodel.h"
#include "daemon/model/model.h"
#include "daemon/model/weights.h"
#include "tests/check_common.h"

#define PAGE 4096u
#define SEED 7

static char dir[64];
static char err[512];

static void rm_dir(void)
{
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	ck_assert_int_eq(system(cmd), 0);
}

/* The tiny preset in F32 (the generator's values exactly), in shards files. */
static struct mlens_model *open_model(int shards, bool fused)
{
	struct mlens_mkmodel_opts o = { .seed = SEED, .shards = shards, .fused_experts = fused };
	struct mlens_model *m = NULL;

	snprintf(dir, sizeof(dir), "/tmp/check_weights.XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(dir));
	ck_assert_int_eq(mlens_mkmodel_preset(&o, "tiny"), 0);
	o.cfg.dtype = MLENS_DTYPE_F32;
	o.dir = dir;
	ck_assert_msg(mlens_mkmodel_write(&o, err, sizeof(err)) == 0, "mkmodel: %s", err);
	ck_assert_msg(mlens_model_open(dir, &m, err, sizeof(err)) == 0, "open: %s", err);
	ck_assert_int_eq(m->n_files, shards);
	return m;
}

static void close_model(struct mlens_model *m)
{
	mlens_model_close(m);
	rm_dir();
}

static bool in_pages(const struct mlens_weights *w, const void *p, size_t n)
{
	const char *b = w->mem.p;
	return (const char *)p >= b && (const char *)p + n <= b + w->bytes;
}

/* The first n elements of the F32 data equal the generator's for legacy. */
static void check_values(const void *data, const char *legacy, size_t n)
{
	const float *f = data;
	for (size_t i = 0; i < n; i++)
		ck_assert_msg(f[i] == mlens_mkmodel_value(SEED, legacy, i), "%s[%zu] = %g, not %g", legacy,
			      i, (double)f[i], (double)mlens_mkmodel_value(SEED, legacy, i));
}

/* What every load gives: the layout, the bytes, the pointers, the values. */
static void check_pages(const struct mlens_model *m, const struct mlens_weights *w)
{
	const struct mlens_model_config *c = &m->cfg;
	size_t total = 0;

	ck_assert_int_eq(w->n_files, m->n_files);
	for (int i = 0; i < m->n_files; i++) {
		const char *at = (const char *)w->mem.p + w->file_off[i];
		size_t size = m->files[i].size, pad = (PAGE - size % PAGE) % PAGE;
		char *buf = malloc(size);
		FILE *f = fopen(m->files[i].path, "rb");

		ck_assert_uint_eq(w->file_off[i], total);
		ck_assert_uint_eq(w->file_off[i] % PAGE, 0);
		ck_assert_ptr_nonnull(buf);
		ck_assert_ptr_nonnull(f);
		ck_assert_uint_eq(fread(buf, 1, size, f), size);
		fclose(f);
		ck_assert_msg(!memcmp(at, buf, size), "%s differs in the weight pages", m->files[i].path);
		for (size_t k = 0; k < pad; k++)
			ck_assert_int_eq(at[size + k], 0);
		free(buf);
		total += size + pad;
	}
	ck_assert_uint_eq(w->bytes, total);
	ck_assert_uint_ge(w->mem.size, total);
	ck_assert_str_eq(w->mem.what, "weight pages");
	ck_assert(w->seconds >= 0);
	for (int t = 0; t < m->n_tensors; t++) {
		const struct mlens_tensor *x = &m->tensors[t];
		ck_assert_ptr_eq(x->data, (const char *)w->mem.p + w->file_off[x->file] + x->offset);
		ck_assert(in_pages(w, x->data, x->nbytes));
	}
	check_values(m->embed->data, "model.embed_tokens.weight", 64);
	check_values(m->final_norm->data, "model.norm.weight", (size_t)c->hidden_size);
	/* each expert's matrices: in the pages, the generator's values */
	for (int64_t l = 0; l < c->num_hidden_layers; l++)
		for (int64_t e = 0; e < c->num_local_experts; e++) {
			size_t n = (size_t)c->intermediate_size * (size_t)c->hidden_size;
			const void *mats[3] = { m->layers[l].w1[e], m->layers[l].w2[e], m->layers[l].w3[e] };
			static const char *const wn[3] = { "w1", "w2", "w3" };
			for (int k = 0; k < 3; k++) {
				char legacy[128];
				snprintf(legacy, sizeof(legacy),
					 "model.layers.%lld.block_sparse_moe.experts.%lld.%s.weight",
					 (long long)l, (long long)e, wn[k]);
				ck_assert_msg(in_pages(w, mats[k], n * sizeof(float)),
					      "%s is not in the weight pages", legacy);
				check_values(mats[k], legacy, 32);
				/* the last element too: the whole matrix moved */
				ck_assert(((const float *)mats[k])[n - 1] ==
					  mlens_mkmodel_value(SEED, legacy, n - 1));
			}
		}
}

START_TEST(io_uring_chunks_and_movers)
{
	/* 4 KiB chunks over two files: every mover and slot busy many times */
	static const struct mlens_weights_opts variants[] = {
		{ .node = -1, .movers = 3, .io_uring = true, .chunk = PAGE, .depth = 2 },
		{ .node = -1, .movers = 1, .io_uring = true, .chunk = 3 * PAGE, .depth = 1 },
		{ .node = -1, .movers = 2, .io_uring = true },	/* 8 MiB chunks: one a file */
	};
	struct mlens_model *m = open_model(2, false);
	struct mlens_weights w;

	for (size_t v = 0; v < sizeof(variants) / sizeof(variants[0]); v++) {
		int rc = mlens_weights_load(m, &variants[v], &w, err, sizeof(err));
		ck_assert_msg(rc == 0, "variant %zu: %s", v, err);
		ck_assert(w.used_io_uring);
		check_pages(m, &w);
		mlens_weights_free(&w);
		ck_assert_ptr_null(w.mem.p);
		ck_assert_ptr_null(w.file_off);
	}
	close_model(m);
}
END_TEST

/* The mmap copy fills the same pages as io_uring, byte for byte (two
 * handles on one model: a load moves its model's pointers for good). */
START_TEST(copy_equals_io_uring)
{
	struct mlens_weights_opts oc = { .node = -1, .io_uring = false };
	struct mlens_weights_opts ou = { .node = -1, .movers = 2, .io_uring = true, .chunk = PAGE };
	struct mlens_model *mc = open_model(3, false), *mu = NULL;
	struct mlens_weights wc, wu;

	ck_assert_msg(mlens_model_open(dir, &mu, err, sizeof(err)) == 0, "open: %s", err);
	ck_assert_msg(mlens_weights_load(mc, &oc, &wc, err, sizeof(err)) == 0, "%s", err);
	ck_assert(!wc.used_io_uring);
	ck_assert(!wc.direct);
	check_pages(mc, &wc);
	ck_assert_msg(mlens_weights_load(mu, &ou, &wu, err, sizeof(err)) == 0, "%s", err);
	check_pages(mu, &wu);
	ck_assert_uint_eq(wc.bytes, wu.bytes);
	ck_assert(!memcmp(wc.mem.p, wu.mem.p, wc.bytes));
	mlens_weights_free(&wc);
	mlens_weights_free(&wu);
	mlens_model_close(mu);
	close_model(mc);
}
END_TEST

/* transformers-5 fused experts: each expert's w1, w3 (halves of
 * gate_up_proj) and w2 point into the middle of a fused tensor, moved to
 * the pages with it. */
START_TEST(fused_experts_rebased)
{
	struct mlens_weights_opts o = { .node = -1, .movers = 2, .io_uring = true, .chunk = PAGE };
	struct mlens_model *m = open_model(1, true);
	struct mlens_weights w;

	ck_assert_msg(mlens_weights_load(m, &o, &w, err, sizeof(err)) == 0, "%s", err);
	check_pages(m, &w);
	mlens_weights_free(&w);
	close_model(m);
}
END_TEST

/* A file removed or cut short after mlens_model_open: refused, naming it;
 * nothing kept. */
START_TEST(file_gone_or_shrunk)
{
	struct mlens_weights_opts o = { .node = -1, .movers = 2, .io_uring = true, .chunk = PAGE };
	struct mlens_model *m = open_model(2, false);
	struct mlens_weights w;
	char want[600], path[256];

	snprintf(path, sizeof(path), "%s", m->files[1].path);
	ck_assert_int_eq(truncate(path, (off_t)(m->files[1].size / 2)), 0);
	ck_assert_int_eq(mlens_weights_load(m, &o, &w, err, sizeof(err)), -EIO);
	snprintf(want, sizeof(want), "%s: reading into the weight pages failed: %s", path,
		 strerror(EIO));
	ck_assert_str_eq(err, want);
	ck_assert_ptr_null(w.mem.p);
	ck_assert_ptr_null(w.file_off);
	ck_assert_int_eq(unlink(path), 0);
	ck_assert_int_eq(mlens_weights_load(m, &o, &w, err, sizeof(err)), -ENOENT);
	snprintf(want, sizeof(want), "%s: cannot open for reading: %s", path, strerror(ENOENT));
	ck_assert_str_eq(err, want);
	ck_assert_ptr_null(w.mem.p);
	ck_assert_ptr_null(w.file_off);
	close_model(m);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("weights");
	TCase *tc = tcase_create("weights");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, io_uring_chunks_and_movers);
	tcase_add_test(tc, copy_equals_io_uring);
	tcase_add_test(tc, fused_experts_rebased);
	tcase_add_test(tc, file_gone_or_shrunk);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
