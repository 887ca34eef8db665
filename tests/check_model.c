/* Description: model loading. Round trips through mlens-mkmodel (every
 * dtype, sharded, fused experts, tied embeddings) and one test per kind of
 * bad input, each asserting that the message names the file, the tensor
 * and the fault. */
#include <check.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <jansson.h>

#include "daemon/tools/mkmodel.h"
#include "daemon/model/family.h"
#include "daemon/model/model.h"
#include "daemon/model/quant.h"
#include "kernels/fp8.h"
#include "daemon/model/safetensors.h"
#include "tests/model_files.h"

/* ==== helpers (tmpdir, sub, edit, make, open_err... in model_files.h) ==== */

/* A safetensors image: 8-byte LE length, the header text, data_len bytes. */
static unsigned char *st_image(const char *header, size_t data_len, size_t *len)
{
	size_t h = strlen(header);
	unsigned char *b = calloc(1, 8 + h + data_len + 1);

	for (int i = 0; i < 8; i++)
		b[i] = (unsigned char)((uint64_t)h >> (8 * i));
	memcpy(b + 8, header, h);
	for (size_t i = 0; i < data_len; i++)
		b[8 + h + i] = (unsigned char)i;
	*len = 8 + h + data_len;
	return b;
}

/* Parse header + data_len bytes; the header is padded to 8 bytes as
 * safetensors writers do, so data alignment is the tensors' own. */
static int st_parse(const char *header, size_t data_len)
{
	struct mlens_safetensors st;
	size_t len, h = strlen(header);
	char *pad = malloc(h + 8);
	unsigned char *b;

	snprintf(pad, h + 8, "%-*s", (int)((h + 7) & ~(size_t)7), header);
	b = st_image(pad, data_len, &len);
	free(pad);
	int rc = mlens_safetensors_parse(b, len, "bad.safetensors", &st, err, sizeof(err));

	if (!rc)
		mlens_safetensors_free(&st);
	free(b);
	return rc;
}

static struct mlens_mkmodel_opts tiny(const char *dir, enum mlens_dtype dt, int shards)
{
	static char dirs[4][256];	/* sub() reuses its buffers */
	static int k;
	struct mlens_mkmodel_opts o = { .seed = 42, .shards = shards };

	k = (k + 1) % 4;
	snprintf(dirs[k], sizeof(dirs[k]), "%s", dir);
	o.dir = dirs[k];

	ck_assert_int_eq(mlens_mkmodel_preset(&o, "tiny"), 0);
	o.cfg.dtype = dt;
	return o;
}

/* The tensor's data equals what the generator produced for its name. */
static void assert_generated(const void *data, enum mlens_dtype dt, uint64_t seed,
			     const char *legacy, size_t n)
{
	unsigned char want[4];

	for (size_t i = 0; i < n; i++) {
		mlens_store(want, dt, 0, mlens_mkmodel_value(seed, legacy, i));
		ck_assert_msg(!memcmp((const char *)data + i * mlens_dtype_size(dt), want,
				      mlens_dtype_size(dt)),
			      "%s element %zu differs from the generator", legacy, i);
	}
}

/* ==== round trips ==== */

static const enum mlens_dtype dtypes[] = { MLENS_DTYPE_BF16, MLENS_DTYPE_F16, MLENS_DTYPE_F32 };

START_TEST(roundtrip_dtype)
{
	const enum mlens_dtype dt = dtypes[_i];
	struct mlens_mkmodel_opts o = tiny(sub("m"), dt, 1);
	struct mlens_model *m;
	const struct mlens_model_config *c;
	struct stat sb;

	make(&o);
	m = open_ok(o.dir);
	c = &m->cfg;
	ck_assert_str_eq(c->architecture, "MixtralForCausalLM");
	ck_assert_int_eq(c->vocab_size, 512);
	ck_assert_int_eq(c->hidden_size, 64);
	ck_assert_int_eq(c->intermediate_size, 128);
	ck_assert_int_eq(c->num_hidden_layers, 2);
	ck_assert_int_eq(c->num_attention_heads, 4);
	ck_assert_int_eq(c->num_key_value_heads, 2);
	ck_assert_int_eq(c->head_dim, 16);
	ck_assert_int_eq(c->num_local_experts, 4);
	ck_assert_int_eq(c->num_experts_per_tok, 2);
	ck_assert_int_eq(c->max_position_embeddings, 4096);
	ck_assert_double_eq(c->rope_theta, 1e6);
	ck_assert_double_eq(c->rms_norm_eps, 1e-5);
	ck_assert(!c->tie_word_embeddings);
	ck_assert(c->dtype_given);
	ck_assert_int_eq(c->dtype, dt);
	ck_assert_int_eq(m->n_files, 1);
	/* 3 + 2 layers * (7 + 4 experts * 3) */
	ck_assert_int_eq(m->n_tensors, 3 + 2 * 19);

	ck_assert_ptr_nonnull(m->embed);
	ck_assert_int_eq(m->embed->ndim, 2);
	ck_assert_int_eq(m->embed->shape[0], 512);
	ck_assert_int_eq(m->embed->shape[1], 64);
	ck_assert_ptr_ne(m->lm_head, m->embed);
	assert_generated(m->embed->data, dt, 42, "model.embed_tokens.weight", 512 * 64);
	assert_generated(m->lm_head->data, dt, 42, "lm_head.weight", 512 * 64);
	assert_generated(m->final_norm->data, dt, 42, "model.norm.weight", 64);
	assert_generated(m->layers[1].wq->data, dt, 42, "model.layers.1.self_attn.q_proj.weight", 64 * 64);
	assert_generated(m->layers[1].wk->data, dt, 42, "model.layers.1.self_attn.k_proj.weight", 32 * 64);
	assert_generated(m->layers[0].w2[2], dt, 42,
			 "model.layers.0.block_sparse_moe.experts.2.w2.weight", 64 * 128);
	assert_generated(m->layers[1].w3[3], dt, 42,
			 "model.layers.1.block_sparse_moe.experts.3.w3.weight", 128 * 64);
	/* Norms sit around 1.0, matrices around 0 with std 0.02. */
	ck_assert_float_eq_tol(mlens_load(m->layers[0].attn_norm->data, dt, 5), 1.0f, 0.1f);
	ck_assert_float_eq_tol(mlens_load(m->layers[0].wq->data, dt, 5), 0.0f, 0.1f);
	ck_assert_ptr_eq(mlens_model_tensor(m, "model.layers.0.self_attn.o_proj.weight"), m->layers[0].wo);
	ck_assert_ptr_null(mlens_model_tensor(m, "model.layers.9.self_attn.o_proj.weight"));

	ck_assert_int_eq(stat(sub("m/model.safetensors"), &sb), 0);
	ck_assert_uint_lt(m->weight_bytes, (size_t)sb.st_size);
	mlens_model_close(m);
}
END_TEST

START_TEST(weight_bytes_exact)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);
	struct mlens_model *m;
	size_t want;

	make(&o);
	m = open_ok(o.dir);
	/* V*H twice, final norm, and per layer: 2 norms, q/o 64x64, k/v 32x64,
	 * router 4x64, 4 experts of 3 * 128x64; all bf16. */
	want = 2 * (2 * 512 * 64 + 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 4 * 64 + 4 * 3 * 128 * 64));
	ck_assert_uint_eq(m->weight_bytes, want);
	mlens_model_close(m);
}
END_TEST

START_TEST(sharded_equals_single)
{
	struct mlens_mkmodel_opts a = tiny(sub("one"), MLENS_DTYPE_BF16, 1);
	struct mlens_mkmodel_opts b = tiny(sub("three"), MLENS_DTYPE_BF16, 3);
	struct mlens_model *ma, *mb;

	make(&a);
	make(&b);
	ck_assert_int_eq(access(sub("three/model-00003-of-00003.safetensors"), R_OK), 0);
	ck_assert_int_ne(access(sub("three/model.safetensors"), F_OK), 0);
	ma = open_ok(a.dir);
	mb = open_ok(b.dir);
	ck_assert_int_eq(mb->n_files, 3);
	ck_assert_int_eq(ma->n_tensors, mb->n_tensors);
	ck_assert_uint_eq(ma->weight_bytes, mb->weight_bytes);
	for (int i = 0; i < ma->n_tensors; i++) {
		const struct mlens_tensor *x = &ma->tensors[i];
		const struct mlens_tensor *y = mlens_model_tensor(mb, x->name);

		ck_assert_ptr_nonnull(y);
		ck_assert_int_eq(x->ndim, y->ndim);
		ck_assert_uint_eq(x->nbytes, y->nbytes);
		ck_assert(!memcmp(x->shape, y->shape, sizeof(x->shape)));
		ck_assert_msg(!memcmp(x->data, y->data, x->nbytes), "%s differs", x->name);
	}
	/* Each shard holds some tensors. */
	for (int f = 0; f < 3; f++) {
		int n = 0;
		for (int i = 0; i < mb->n_tensors; i++)
			n += mb->tensors[i].file == f;
		ck_assert_int_gt(n, 0);
	}
	mlens_model_close(ma);
	mlens_model_close(mb);
}
END_TEST

START_TEST(fused_equals_legacy)
{
	struct mlens_mkmodel_opts a = tiny(sub("legacy"), MLENS_DTYPE_F32, 1);
	struct mlens_mkmodel_opts b = tiny(sub("fused"), MLENS_DTYPE_F32, 2);
	struct mlens_model *ma, *mb;
	const size_t mat = 128 * 64 * 4;

	b.fused_experts = true;
	make(&a);
	make(&b);
	ma = open_ok(a.dir);
	mb = open_ok(b.dir);
	ck_assert_ptr_nonnull(mlens_model_tensor(mb, "model.layers.1.mlp.experts.gate_up_proj"));
	ck_assert_ptr_null(mlens_model_tensor(mb, "model.layers.1.block_sparse_moe.gate.weight"));
	ck_assert_int_eq(mb->n_tensors, 3 + 2 * 9);
	for (int l = 0; l < 2; l++) {
		ck_assert(!memcmp(ma->layers[l].router->data, mb->layers[l].router->data, 4 * 64 * 4));
		for (int j = 0; j < 4; j++) {
			ck_assert_msg(!memcmp(ma->layers[l].w1[j], mb->layers[l].w1[j], mat), "w1 %d %d", l, j);
			ck_assert_msg(!memcmp(ma->layers[l].w2[j], mb->layers[l].w2[j], mat), "w2 %d %d", l, j);
			ck_assert_msg(!memcmp(ma->layers[l].w3[j], mb->layers[l].w3[j], mat), "w3 %d %d", l, j);
		}
	}
	mlens_model_close(ma);
	mlens_model_close(mb);
}
END_TEST

START_TEST(tied_embeddings)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_F16, 1);
	struct mlens_model *m;

	o.cfg.tie_word_embeddings = true;
	make(&o);
	m = open_ok(o.dir);
	ck_assert(m->cfg.tie_word_embeddings);
	ck_assert_ptr_eq(m->lm_head, m->embed);
	ck_assert_ptr_null(mlens_model_tensor(m, "lm_head.weight"));
	mlens_model_close(m);
}
END_TEST

START_TEST(seed_changes_weights)
{
	ck_assert_float_ne(mlens_mkmodel_value(1, "a.weight", 0), mlens_mkmodel_value(2, "a.weight", 0));
	ck_assert_float_ne(mlens_mkmodel_value(1, "a.weight", 0), mlens_mkmodel_value(1, "b.weight", 0));
	ck_assert_float_eq(mlens_mkmodel_value(1, "a.weight", 7), mlens_mkmodel_value(1, "a.weight", 7));
	/* Standard deviation near 0.02, mean near 0, over many draws. */
	double s = 0, s2 = 0;
	for (int i = 0; i < 100000; i++) {
		double v = mlens_mkmodel_value(5, "x.weight", (uint64_t)i);
		s += v;
		s2 += v * v;
	}
	ck_assert_double_eq_tol(s / 100000, 0.0, 0.001);
	ck_assert_double_eq_tol(sqrt(s2 / 100000), 0.02, 0.001);
}
END_TEST

/* ==== bad safetensors (from memory) ==== */

#define T1(dt, shape, a, b) "\"x\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":[" #a "," #b "]}"

START_TEST(st_too_short)
{
	struct mlens_safetensors st;

	ck_assert_int_eq(mlens_safetensors_parse("abc", 3, "short.safetensors", &st, err, sizeof(err)), -EINVAL);
	assert_err("short.safetensors", "3 bytes", "too short");
}
END_TEST

START_TEST(st_header_past_end)
{
	struct mlens_safetensors st;
	unsigned char b[16] = { 0xe8, 0x03 };	/* 1000 */

	memcpy(b + 8, "{}      ", 8);
	ck_assert_int_eq(mlens_safetensors_parse(b, sizeof(b), "h.safetensors", &st, err, sizeof(err)), -EINVAL);
	assert_err("h.safetensors", "header length 1000 runs past the end of the file (16 bytes)");
	/* 2^64 - 1 must not wrap around. */
	memset(b, 0xff, 8);
	ck_assert_int_eq(mlens_safetensors_parse(b, sizeof(b), "h.safetensors", &st, err, sizeof(err)), -EINVAL);
	assert_err("header length 18446744073709551615 runs past");
}
END_TEST

START_TEST(st_bad_dtype)
{
	ck_assert_int_eq(st_parse("{" T1("I64", "[2]", 0, 16) "}", 16), -EINVAL);
	assert_err("bad.safetensors: tensor 'x': dtype I64 is not supported");
	ck_assert_int_eq(st_parse("{" T1("F64", "[2]", 0, 16) "}", 16), -EINVAL);
	assert_err("tensor 'x': dtype F64");
}
END_TEST

START_TEST(st_huge_dims)
{
	ck_assert_int_eq(st_parse("{" T1("F32", "[4294967296,4294967296,16]", 0, 16) "}", 16), -EINVAL);
	assert_err("tensor 'x'", "shape [4294967296, 4294967296, 16] overflows");
	/* Elements fit, bytes do not. */
	ck_assert_int_eq(st_parse("{" T1("F32", "[4611686018427387904]", 0, 16) "}", 16), -EINVAL);
	assert_err("tensor 'x'", "overflows a 64-bit byte count");
	ck_assert_int_eq(st_parse("{" T1("F32", "[1,1,1,1,1]", 0, 4) "}", 4), -EINVAL);
	assert_err("tensor 'x'", "5 dimensions");
	ck_assert_int_eq(st_parse("{" T1("F32", "[-1]", 0, 4) "}", 4), -EINVAL);
	assert_err("tensor 'x'", "shape[0] is not a non-negative integer");
}
END_TEST

START_TEST(st_out_of_range)
{
	const char *h = "{\"model.layers.3.self_attn.q_proj.weight\":{\"dtype\":\"F32\",\"shape\":[768],\"data_offsets\":[1024,4096]}}";

	ck_assert_int_eq(st_parse(h, 2048), -EINVAL);
	assert_err("bad.safetensors: tensor 'model.layers.3.self_attn.q_proj.weight': data_offsets [1024, 4096) run past the data section (2048 bytes)");
	ck_assert_int_eq(st_parse("{" T1("F32", "[2]", 8, 0) "}", 8), -EINVAL);
	assert_err("tensor 'x'", "[8, 0) end before they begin");
	ck_assert_int_eq(st_parse("{" T1("F32", "[2]", 0, 9223372036854775807) "}", 8), -EINVAL);
	assert_err("tensor 'x'", "[0, 9223372036854775807) run past the data section (8 bytes)");
	ck_assert_int_eq(st_parse("{" T1("F32", "[2]", 0, -8) "}", 8), -EINVAL);
	assert_err("tensor 'x'", "data_offsets is not a pair");
	ck_assert_int_eq(st_parse("{" T1("F32", "[2]", 0, 18446744073709551615) "}", 8), -EINVAL);
	assert_err("bad.safetensors: header is not valid JSON", "too big integer");
}
END_TEST

START_TEST(st_size_mismatch)
{
	ck_assert_int_eq(st_parse("{" T1("F32", "[4]", 0, 8) "}", 8), -EINVAL);
	assert_err("tensor 'x'", "hold 8 bytes but shape [4] of F32 needs 16");
}
END_TEST

START_TEST(st_overlap_gap_tail)
{
	ck_assert_int_eq(st_parse("{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
				  "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 24), -EINVAL);
	assert_err("tensor 'b'", "[8, 24) overlap tensor 'a' [0, 16)");
	ck_assert_int_eq(st_parse("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
				  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]}}", 24), -EINVAL);
	assert_err("tensor 'b'", "gap of 8 bytes after tensor 'a'");
	ck_assert_int_eq(st_parse("{" T1("F32", "[2]", 8, 16) "}", 16), -EINVAL);
	assert_err("tensor 'x'", "gap of 8 bytes at the start");
	ck_assert_int_eq(st_parse("{" T1("F32", "[2]", 0, 8) "}", 12), -EINVAL);
	assert_err("tensor 'x'", "data ends at 8 but the data section holds 12 bytes");
	ck_assert_int_eq(st_parse("{}", 4), -EINVAL);
	assert_err("no tensors but 4 data bytes");
}
END_TEST

START_TEST(st_bad_json)
{
	ck_assert_int_eq(st_parse("{\"x\": {\"dtype\": \"F32\",", 0), -EINVAL);
	assert_err("bad.safetensors: header is not valid JSON (line 1, column");
	ck_assert_int_eq(st_parse("[1, 2]", 0), -EINVAL);
	assert_err("header is a JSON array, not an object");
	ck_assert_int_eq(st_parse("{" T1("F32", "[2]", 0, 8) "," T1("F32", "[2]", 8, 16) "}", 16), -EINVAL);
	assert_err("bad.safetensors", "duplicate", "x");
	ck_assert_int_eq(st_parse("{\"x\": 3}", 0), -EINVAL);
	assert_err("tensor 'x': header entry is a JSON integer");
	ck_assert_int_eq(st_parse("{\"x\": {\"dtype\": \"F32\"}}", 0), -EINVAL);
	assert_err("tensor 'x'", "needs string 'dtype'");
}
END_TEST

START_TEST(st_valid_with_metadata)
{
	struct mlens_safetensors st;
	const char *h = "{\"__metadata__\":{\"format\":\"pt\"},"
			"\"b\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[16,28]},"
			"\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
			"\"z\":{\"dtype\":\"F16\",\"shape\":[0],\"data_offsets\":[28,28]}}";
	char hdr[512];
	size_t len;
	unsigned char *b;

	/* Pad the header so the data section is 8-byte aligned. */
	snprintf(hdr, sizeof(hdr), "%-*s", (int)((strlen(h) + 7) & ~(size_t)7), h);
	b = st_image(hdr, 28, &len);
	ck_assert_int_eq(mlens_safetensors_parse(b, len, "ok.safetensors", &st, err, sizeof(err)), 0);
	ck_assert_int_eq(st.n_tensors, 3);
	ck_assert_uint_eq(st.data_start, 8 + strlen(hdr));
	ck_assert_uint_eq(st.data_len, 28);
	for (int i = 0; i < 3; i++) {
		if (!strcmp(st.tensors[i].name, "b")) {
			ck_assert_int_eq(st.tensors[i].dtype, MLENS_DTYPE_BF16);
			ck_assert_int_eq(st.tensors[i].ndim, 2);
			ck_assert_int_eq(st.tensors[i].shape[1], 3);
			ck_assert_uint_eq(st.tensors[i].begin, 16);
		}
	}
	mlens_safetensors_free(&st);
	free(b);
	/* F32 data after one BF16 element is misaligned. */
	ck_assert_int_eq(st_parse("{\"a\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[0,2]},"
				  T1("F32", "[1]", 2, 6) "}", 6), -EINVAL);
	assert_err("tensor 'x'", "not aligned to its 4-byte elements");
}
END_TEST

/* ==== bad model directories ==== */

START_TEST(file_truncated)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);
	struct stat sb;

	make(&o);
	ck_assert_int_eq(stat(sub("m/model.safetensors"), &sb), 0);
	ck_assert_int_eq(truncate(sub("m/model.safetensors"), sb.st_size - 100), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	/* lm_head is written last. */
	assert_err("m/model.safetensors: tensor 'lm_head.weight': data_offsets", "run past the data section");
	ck_assert_int_eq(truncate(sub("m/model.safetensors"), 5), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model.safetensors: file is 5 bytes");
	ck_assert_int_eq(truncate(sub("m/model.safetensors"), 0), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model.safetensors: file is 0 bytes");
}
END_TEST

START_TEST(file_header_past_end)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);
	size_t len;
	unsigned char *b = st_image("{}", 0, &len);

	make(&o);
	b[2] = 0x10;	/* header length 1 MiB + 2 */
	write_file(sub("m/model.safetensors"), b, len);
	free(b);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model.safetensors: header length 1048578 runs past the end of the file (10 bytes)");
}
END_TEST

START_TEST(file_dtype_mismatch)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);

	make(&o);
	edit(sub("m/config.json"), "\"bfloat16\"", "\"float32\"");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model.safetensors: tensor '", "dtype BF16 differs from the model's F32 (config.json)");
}
END_TEST

START_TEST(file_shape_mismatch)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 2);

	make(&o);
	edit(sub("m/config.json"), "\"intermediate_size\": 128", "\"intermediate_size\": 96");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("model-0000", "tensor 'model.layers.0.block_sparse_moe.experts.0.w1.weight': shape [128, 64] does not match config.json, which implies [96, 64]");
}
END_TEST

START_TEST(file_missing_and_extra_tensor)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);

	o.cfg.tie_word_embeddings = true;
	make(&o);
	edit(sub("m/config.json"), "\"tie_word_embeddings\": true", "\"tie_word_embeddings\": false");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("/m: tensor 'lm_head.weight' is missing (1 expected tensor is missing");
	edit(sub("m/config.json"), "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
	edit(sub("m/config.json"), "\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.2.", "is missing (19 expected tensors are missing");
	edit(sub("m/config.json"), "\"num_hidden_layers\": 3", "\"num_hidden_layers\": 1");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model.safetensors: tensor 'model.layers.1.", "is not part of the MixtralForCausalLM model");
}
END_TEST

START_TEST(file_missing_shard)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 2);

	make(&o);
	ck_assert_int_eq(unlink(sub("m/model-00002-of-00002.safetensors")), 0);
	ck_assert_int_eq(open_err(o.dir), -ENOENT);
	assert_err("m/model-00002-of-00002.safetensors: cannot open (named by model.safetensors.index.json)");
}
END_TEST

/* A FIFO (or any file that is not regular) in place of a model file is
 * refused at once, naming it; opening it for reading used to wait for a
 * writer for ever. */
START_TEST(file_fifo)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);

	make(&o);
	ck_assert_int_eq(unlink(sub("m/model.safetensors")), 0);
	ck_assert_int_eq(mkfifo(sub("m/model.safetensors"), 0600), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model.safetensors: not a regular file (a FIFO)");
	ck_assert_int_eq(unlink(sub("m/config.json")), 0);
	ck_assert_int_eq(mkfifo(sub("m/config.json"), 0600), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/config.json: not a regular file (a FIFO)");
}
END_TEST

START_TEST(file_index_disagrees)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 2);
	json_t *ix;

	make(&o);
	ix = json_load_file(sub("m/model.safetensors.index.json"), 0, NULL);
	ck_assert_ptr_nonnull(ix);
	json_object_del(json_object_get(ix, "weight_map"), "model.norm.weight");
	ck_assert_int_eq(json_dump_file(ix, sub("m/model.safetensors.index.json"), 0), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("model-00002-of-00002.safetensors: tensor 'model.norm.weight' is not listed in");
	/* Listed in the wrong shard. */
	json_object_set_new(json_object_get(ix, "weight_map"), "model.norm.weight",
			    json_string("model-00001-of-00002.safetensors"));
	ck_assert_int_eq(json_dump_file(ix, sub("m/model.safetensors.index.json"), 0), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.norm.weight' is in this shard but", "places it in model-00001-of-00002.safetensors");
	/* Listed but absent. */
	json_object_set_new(json_object_get(ix, "weight_map"), "model.norm.weight",
			    json_string("model-00002-of-00002.safetensors"));
	json_object_set_new(json_object_get(ix, "weight_map"), "model.extra.weight",
			    json_string("model-00001-of-00002.safetensors"));
	ck_assert_int_eq(json_dump_file(ix, sub("m/model.safetensors.index.json"), 0), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("model-00001-of-00002.safetensors: tensor 'model.extra.weight' is listed in");
	/* A shard outside the directory. */
	json_object_set_new(json_object_get(ix, "weight_map"), "model.extra.weight",
			    json_string("../x.safetensors"));
	ck_assert_int_eq(json_dump_file(ix, sub("m/model.safetensors.index.json"), 0), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.extra.weight': shard must be a file name");
	json_decref(ix);
	write_file(sub("m/model.safetensors.index.json"), "{\"weight_map\": ", 15);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("model.safetensors.index.json: malformed JSON at line 1");
}
END_TEST

START_TEST(file_no_weights)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);

	make(&o);
	ck_assert_int_eq(unlink(sub("m/model.safetensors")), 0);
	ck_assert_int_eq(open_err(o.dir), -ENOENT);
	assert_err("neither model.safetensors nor model.safetensors.index.json");
	ck_assert_int_eq(unlink(sub("m/config.json")), 0);
	ck_assert_int_eq(open_err(o.dir), -ENOENT);
	assert_err("m/config.json: cannot open");
}
END_TEST

START_TEST(file_config_errors)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);
	struct mlens_model *m;

	make(&o);
	edit(sub("m/config.json"), "\"sliding_window\": null", "\"sliding_window\": 1024");
	ck_assert_int_eq(open_err(o.dir), -ENOTSUP);
	assert_err("m/config.json: sliding_window is 1024 but max_position_embeddings is 4096",
		   "no sliding-window attention");
	edit(sub("m/config.json"), "\"sliding_window\": 1024", "\"sliding_window\": 4096");
	m = open_ok(o.dir);
	mlens_model_close(m);
	edit(sub("m/config.json"), "\"MixtralForCausalLM\"", "\"LlamaForCausalLM\"");
	ck_assert_int_eq(open_err(o.dir), -ENOTSUP);
	assert_err("m/config.json: architectures is [\"LlamaForCausalLM\"]", "only MixtralForCausalLM");
	edit(sub("m/config.json"), "\"LlamaForCausalLM\"", "\"MixtralForCausalLM\",");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/config.json: malformed JSON at line 4, column");
}
END_TEST

/* ==== config.json from memory ==== */

static const char base_cfg[] =
	"{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 32,"
	" \"intermediate_size\": 48, \"num_hidden_layers\": 1, \"num_attention_heads\": 4,"
	" \"num_key_value_heads\": 2, \"num_local_experts\": 4, \"num_experts_per_tok\": 2,"
	" \"max_position_embeddings\": 256 %s}";

static int cfg_parse(const char *extra, struct mlens_model_config *c)
{
	char text[2048];

	snprintf(text, sizeof(text), base_cfg, extra);
	return mlens_model_parse_config(text, strlen(text), "t/config.json", c, err, sizeof(err));
}

static int cfg_text(const char *text, struct mlens_model_config *c)
{
	return mlens_model_parse_config(text, strlen(text), "t/config.json", c, err, sizeof(err));
}

START_TEST(config_variants)
{
	struct mlens_model_config c;

	ck_assert_int_eq(cfg_parse("", &c), 0);
	ck_assert_int_eq(c.head_dim, 8);
	ck_assert_double_eq(c.rope_theta, 1e6);
	ck_assert(!c.dtype_given);
	ck_assert_int_eq(cfg_parse(", \"head_dim\": null, \"dtype\": \"float16\", \"rope_parameters\": {\"rope_theta\": 500000.0, \"rope_type\": \"default\"}", &c), 0);
	ck_assert_int_eq(c.head_dim, 8);
	ck_assert_double_eq(c.rope_theta, 5e5);
	ck_assert(c.dtype_given);
	ck_assert_int_eq(c.dtype, MLENS_DTYPE_F16);
	ck_assert_int_eq(cfg_parse(", \"head_dim\": 16, \"rope_theta\": 10000, \"torch_dtype\": \"float32\", \"tie_word_embeddings\": true", &c), 0);
	ck_assert_int_eq(c.head_dim, 16);
	ck_assert_double_eq(c.rope_theta, 1e4);
	ck_assert_int_eq(c.dtype, MLENS_DTYPE_F32);
	ck_assert(c.tie_word_embeddings);
}
END_TEST

START_TEST(config_refusals)
{
	struct mlens_model_config c;

	ck_assert_int_eq(cfg_parse(", \"rope_parameters\": {\"rope_theta\": 1e6, \"rope_type\": \"yarn\"}", &c), -ENOTSUP);
	assert_err("t/config.json: rope_parameters.rope_type is \"yarn\"");
	ck_assert_int_eq(cfg_parse(", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}", &c), -ENOTSUP);
	assert_err("'rope_scaling' is {\"type\":\"linear\",\"factor\":2.0}; mlens implements only the default RoPE");
	ck_assert_int_eq(cfg_parse(", \"num_local_experts\": 300", &c), -EINVAL);
	assert_err("duplicate");
	ck_assert_int_eq(cfg_text("{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 100}", &c), -EINVAL);
	assert_err("t/config.json: 'hidden_size' is missing");
	ck_assert_int_eq(cfg_parse(", \"sliding_window\": 128", &c), -ENOTSUP);
	assert_err("sliding_window is 128 but max_position_embeddings is 256");
	ck_assert_int_eq(cfg_parse(", \"sliding_window\": \"big\"", &c), -EINVAL);
	assert_err("'sliding_window' must be an integer or null");
	ck_assert_int_eq(cfg_parse(", \"torch_dtype\": \"int8\"", &c), -ENOTSUP);
	assert_err("torch_dtype 'int8' is not supported");
	ck_assert_int_eq(cfg_parse(", \"head_dim\": 7", &c), -EINVAL);
	assert_err("head_dim 7 is odd");
	ck_assert_int_eq(cfg_parse(", \"hidden_act\": \"gelu\"", &c), -ENOTSUP);
	assert_err("hidden_act");
	ck_assert_int_eq(cfg_parse(", \"rms_norm_eps\": -1", &c), -EINVAL);
	assert_err("'rms_norm_eps' is -1");
	ck_assert_int_eq(cfg_text("[]", &c), -EINVAL);
	assert_err("t/config.json: top level must be a JSON object");
	ck_assert_int_eq(cfg_text("{\"vocab_size\": 1}", &c), -EINVAL);
	assert_err("no 'architectures' list");
	ck_assert_int_eq(cfg_text("{\n\"a\": 1,\n\"b\": }", &c), -EINVAL);
	assert_err("t/config.json: malformed JSON at line 3, column");
}
END_TEST

/* EOS ids: one or a list in config.json; generation_config.json's win
 * where it gives one; ids outside the vocabulary or of the wrong type are
 * refused naming the file. */
START_TEST(config_eos)
{
	struct mlens_model_config c;
	const char *gen;

	ck_assert_int_eq(cfg_parse("", &c), 0);
	ck_assert_int_eq(c.n_eos, 0);
	ck_assert_int_eq(cfg_parse(", \"eos_token_id\": 2", &c), 0);
	ck_assert_int_eq(c.n_eos, 1);
	ck_assert_int_eq(c.eos[0], 2);
	ck_assert_int_eq(cfg_parse(", \"eos_token_id\": [7, 0, 99]", &c), 0);
	ck_assert_int_eq(c.n_eos, 3);
	ck_assert(c.eos[0] == 7 && c.eos[1] == 0 && c.eos[2] == 99);
	ck_assert_int_eq(cfg_parse(", \"eos_token_id\": null", &c), 0);
	ck_assert_int_eq(c.n_eos, 0);
	ck_assert_int_eq(cfg_parse(", \"eos_token_id\": 100", &c), -EINVAL);
	assert_err("t/config.json: 'eos_token_id' 100 is outside the vocabulary [0, 100)");
	ck_assert_int_eq(cfg_parse(", \"eos_token_id\": [1, \"</s>\"]", &c), -EINVAL);
	assert_err("t/config.json: 'eos_token_id' must be a token id or a list of them");
	ck_assert_int_eq(cfg_parse(", \"eos_token_id\": [1, 2, 3, 4, 5, 6, 7, 8, 9]", &c), -EINVAL);
	assert_err("'eos_token_id' lists 9 ids; mlens takes at most 8");

	/* generation_config.json over config.json's 2 */
	ck_assert_int_eq(cfg_parse(", \"eos_token_id\": 2", &c), 0);
	gen = "{\"bos_token_id\": 1, \"do_sample\": true}";
	ck_assert_int_eq(mlens_model_parse_generation_config(gen, strlen(gen), "t/generation_config.json",
							     &c, err, sizeof(err)), 0);
	ck_assert(c.n_eos == 1 && c.eos[0] == 2);
	gen = "{\"eos_token_id\": [5, 6]}";
	ck_assert_int_eq(mlens_model_parse_generation_config(gen, strlen(gen), "t/generation_config.json",
							     &c, err, sizeof(err)), 0);
	ck_assert(c.n_eos == 2 && c.eos[0] == 5 && c.eos[1] == 6);
	gen = "{\"eos_token_id\": -1}";
	ck_assert_int_eq(mlens_model_parse_generation_config(gen, strlen(gen), "t/generation_config.json",
							     &c, err, sizeof(err)), -EINVAL);
	assert_err("t/generation_config.json: 'eos_token_id' -1 is outside the vocabulary");
	gen = "[1]";
	ck_assert_int_eq(mlens_model_parse_generation_config(gen, strlen(gen), "t/generation_config.json",
							     &c, err, sizeof(err)), -EINVAL);
	assert_err("t/generation_config.json: top level must be a JSON object");
}
END_TEST

/* mlens_model_open reads generation_config.json beside config.json. */
START_TEST(file_generation_config)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);
	struct mlens_model *m;
	FILE *f;

	o.cfg.eos[0] = 3;
	o.cfg.eos[1] = 4;
	o.cfg.n_eos = 2;
	make(&o);
	m = open_ok(o.dir);
	ck_assert(m->cfg.n_eos == 2 && m->cfg.eos[0] == 3 && m->cfg.eos[1] == 4);
	mlens_model_close(m);
	f = fopen(sub("m/generation_config.json"), "w");
	ck_assert_ptr_nonnull(f);
	fputs("{\"eos_token_id\": 9}", f);
	ck_assert_int_eq(fclose(f), 0);
	m = open_ok(o.dir);
	ck_assert(m->cfg.n_eos == 1 && m->cfg.eos[0] == 9);
	mlens_model_close(m);
	f = fopen(sub("m/generation_config.json"), "w");
	ck_assert_ptr_nonnull(f);
	fputs("{\"eos_token_id\": 9,}", f);
	ck_assert_int_eq(fclose(f), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/generation_config.json: malformed JSON");
}
END_TEST

/* Each range limit on its own, from a valid base. */
static const struct {
	const char *json;
	const char *want;
} ranges[] = {
	{ "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 0}", "'vocab_size' is 0; mlens accepts 1 to" },
	{ "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 10, \"hidden_size\": 99999999}", "'hidden_size' is 99999999" },
	{ "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 10, \"hidden_size\": 8.5}", "'hidden_size' must be an integer" },
	{ "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 10, \"hidden_size\": 8, \"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_key_value_heads\": 3, \"num_local_experts\": 2, \"num_experts_per_tok\": 1}", "num_attention_heads 4 is not a multiple of num_key_value_heads 3" },
	{ "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 10, \"hidden_size\": 8, \"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_key_value_heads\": 8, \"num_local_experts\": 2, \"num_experts_per_tok\": 1}", "'num_key_value_heads' is 8; mlens accepts 1 to 4" },
	{ "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 10, \"hidden_size\": 8, \"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_local_experts\": 300, \"num_experts_per_tok\": 1}", "'num_local_experts' is 300; mlens accepts 1 to 256" },
	{ "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 10, \"hidden_size\": 8, \"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_local_experts\": 4, \"num_experts_per_tok\": 5}", "'num_experts_per_tok' is 5; mlens accepts 1 to 4" },
	{ "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 10, \"hidden_size\": 8, \"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_local_experts\": 4, \"num_experts_per_tok\": 1, \"max_position_embeddings\": 1}", "'max_position_embeddings' is 1; mlens accepts 2 to" },
	{ "{\"architectures\": [\"MixtralForCausalLM\"], \"vocab_size\": 10, \"hidden_size\": 9, \"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_local_experts\": 4, \"num_experts_per_tok\": 1}", "head_dim is absent and hidden_size 9 is not a multiple of num_attention_heads 4" },
};

START_TEST(config_ranges)
{
	struct mlens_model_config c;

	ck_assert_int_eq(mlens_model_parse_config(ranges[_i].json, strlen(ranges[_i].json),
						  "t/config.json", &c, err, sizeof(err)), -EINVAL);
	assert_err("t/config.json: ", ranges[_i].want);
}
END_TEST

/* ==== the other families ==== */

static struct mlens_mkmodel_opts family(const char *dir, const char *preset, bool fused)
{
	struct mlens_mkmodel_opts o = tiny(dir, MLENS_DTYPE_F32, 1);

	ck_assert_int_eq(mlens_mkmodel_preset(&o, preset), 0);
	o.cfg.dtype = MLENS_DTYPE_F32;
	o.fused_experts = fused;
	return o;
}

/* Replace the first `from` in a binary file by `to` of the same length
 * (a tensor's name in a safetensors header). */
static void edit_bin(const char *path, const char *from, const char *to)
{
	FILE *f = fopen(path, "rb");
	long n;
	char *buf, *at;

	ck_assert_ptr_nonnull(f);
	ck_assert_uint_eq(strlen(from), strlen(to));
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	fseek(f, 0, SEEK_SET);
	buf = malloc((size_t)n);
	ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	at = memmem(buf, (size_t)n, from, strlen(from));
	ck_assert_msg(at != NULL, "'%s' not in %s", from, path);
	memcpy(at, to, strlen(to));
	write_file(path, buf, (size_t)n);
	free(buf);
}

/* Each family's preset, per-expert and fused, opens with its extras bound
 * where its config says, and the data is what the writer drew. */
START_TEST(family_roundtrip)
{
	static const char *const presets[] = { "qwen3-tiny", "qwen2-tiny", "olmoe-tiny" };
	const char *preset = presets[_i / 2];
	struct mlens_mkmodel_opts o = family(sub("m"), preset, _i % 2);
	const struct mlens_model_config *c;
	const struct mlens_layer_weights *l0, *l1;
	struct mlens_model *m;

	make(&o);
	m = open_ok(o.dir);
	c = &m->cfg;
	l0 = &m->layers[0];
	l1 = &m->layers[1];
	ck_assert_str_eq(c->architecture, o.cfg.family->architecture);
	ck_assert_ptr_eq(c->family, o.cfg.family);
	ck_assert_int_eq(c->num_local_experts, o.cfg.num_local_experts);
	ck_assert_int_eq(c->intermediate_size, o.cfg.intermediate_size);
	ck_assert_int_eq(c->qk_norm, o.cfg.qk_norm);
	ck_assert_int_eq(c->topk_raw, o.cfg.topk_raw);
	ck_assert_int_eq(c->shared_inter, o.cfg.shared_inter);
	ck_assert_int_eq(c->qkv_bias, o.cfg.qkv_bias);
	ck_assert_ptr_nonnull(l0->router);
	ck_assert_ptr_nonnull(l0->w1[c->num_local_experts - 1]);
	if (!strcmp(preset, "qwen3-tiny")) {
		/* layer 1 is dense: its SwiGLU, no router, no experts */
		ck_assert(c->dense[1] && !c->dense[0]);
		ck_assert_int_eq(c->dense_inter, 96);
		ck_assert_ptr_null(l1->router);
		ck_assert_ptr_null(l1->w1[0]);
		ck_assert_int_eq(l1->mlp_inter, 96);
		ck_assert_int_eq(l1->mlp_w2->shape[1], 96);
		ck_assert_ptr_null(l0->mlp_w1);
		ck_assert_int_eq(l0->q_norm->shape[0], 32);	/* a head's */
		ck_assert_ptr_null(l0->bq);
		assert_generated(l1->mlp_w3->data, MLENS_DTYPE_F32, o.seed, "model.layers.1.mlp.up_proj.weight", 96 * 64);
	} else if (!strcmp(preset, "qwen2-tiny")) {
		ck_assert_ptr_nonnull(l1->mlp_gate);
		ck_assert_int_eq(l1->mlp_inter, 64);
		ck_assert_ptr_null(l0->q_norm);
		ck_assert_ptr_null(l0->bo);
		assert_generated(l0->bk->data, MLENS_DTYPE_F32, o.seed, "model.layers.0.self_attn.k_proj.bias", 32);
		assert_generated(l1->mlp_gate->data, MLENS_DTYPE_F32, o.seed, "model.layers.1.mlp.shared_expert_gate.weight", 64);
	} else {
		ck_assert_int_eq(l0->q_norm->shape[0], 64);	/* the whole projection */
		ck_assert_int_eq(l0->k_norm->shape[0], 32);
		ck_assert_ptr_null(l0->mlp_w1);
		assert_generated(l1->k_norm->data, MLENS_DTYPE_F32, o.seed, "model.layers.1.self_attn.k_norm.weight", 32);
	}
	/* the last expert's down matrix, in either layout */
	{
		char name[160];
		snprintf(name, sizeof(name), "model.layers.0.mlp.experts.%d.down_proj.weight",
			 (int)c->num_local_experts - 1);
		assert_generated(l0->w2[c->num_local_experts - 1], MLENS_DTYPE_F32, o.seed, name,
				 (size_t)(c->hidden_size * c->intermediate_size));
	}
	mlens_model_close(m);
}
END_TEST

/* A file that lacks what its family's config asks for, or has it in the
 * wrong shape, is refused naming the tensor. */
START_TEST(family_bad_files)
{
	struct mlens_mkmodel_opts o = family(sub("q3"), "qwen3-tiny", false);

	/* q_norm missing: written without, config asks for it */
	o.cfg.qk_norm = MLENS_QK_NORM_NONE;
	make(&o);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("q3: tensor 'model.layers.0.self_attn.q_norm.weight' is missing (4 expected tensors are missing");
	/* q_norm over the whole projection where Qwen3 norms a head */
	o.cfg.qk_norm = MLENS_QK_NORM_ALL;
	make(&o);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.0.self_attn.q_norm.weight': shape [128] does not match config.json, which implies [32]");
	/* an expert's matrix missing */
	o.cfg.qk_norm = MLENS_QK_NORM_HEAD;
	make(&o);
	edit_bin(sub("q3/model.safetensors"), "layers.0.mlp.experts.5.up_proj", "layers.0.mlp.experts.5.up_prox");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.0.mlp.experts.5.up_proj.weight' is missing (1 expected tensor is missing");
	/* the dense layer's MLP missing */
	make(&o);
	edit_bin(sub("q3/model.safetensors"), "layers.1.mlp.down_proj", "layers.1.mlp.down_prox");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.1.mlp.down_proj.weight' is missing");
	/* the dense layer's width disagrees with intermediate_size */
	make(&o);
	edit(sub("q3/config.json"), "\"intermediate_size\": 96", "\"intermediate_size\": 80");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.1.mlp.", "does not match config.json, which implies [80, 64]");

	/* Qwen2-MoE: shared expert gate and biases */
	o = family(sub("q2"), "qwen2-tiny", false);
	o.cfg.shared_gate = false;
	make(&o);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.0.mlp.shared_expert_gate.weight' is missing");
	/* the gate transposed: [H][1] where Qwen2-MoE's is [1][H] */
	o.cfg.shared_gate = true;
	make(&o);
	edit_bin(sub("q2/model.safetensors"), "layers.0.mlp.shared_expert_gate.weight\":{\"dtype\":\"F32\",\"shape\":[1,64]",
		 "layers.0.mlp.shared_expert_gate.weight\":{\"dtype\":\"F32\",\"shape\":[64,1]");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("q2/model.safetensors: tensor 'model.layers.0.mlp.shared_expert_gate.weight': shape [64, 1] does not match config.json, which implies [1, 64]");
	o.cfg.qkv_bias = false;
	make(&o);
	edit(sub("q2/config.json"), "\"qkv_bias\": false", "\"qkv_bias\": true");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.0.self_attn.", "_proj.bias' is missing (6 expected tensors are missing");

	/* OLMoE: k_norm missing, a wrong router shape */
	o = family(sub("ol"), "olmoe-tiny", true);
	make(&o);
	edit_bin(sub("ol/model.safetensors"), "layers.1.self_attn.k_norm", "layers.1.self_attn.k_nora");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.1.self_attn.k_norm.weight' is missing");
	make(&o);
	edit(sub("ol/config.json"), "\"num_experts\": 16", "\"num_experts\": 15");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.0.mlp.gate.weight': shape [16, 64] does not match config.json, which implies [15, 64]");
}
END_TEST

static const char qwen3_cfg[] =
	"{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 32,"
	" \"intermediate_size\": 80, \"moe_intermediate_size\": 16, \"num_hidden_layers\": 4,"
	" \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16,"
	" \"num_experts\": 8, \"num_experts_per_tok\": 2, \"max_position_embeddings\": 256 %s}";

static int qwen3_parse(const char *extra, struct mlens_model_config *c)
{
	char text[2048];

	snprintf(text, sizeof(text), qwen3_cfg, extra);
	return cfg_text(text, c);
}

START_TEST(family_configs)
{
	struct mlens_model_config c;

	ck_assert_int_eq(qwen3_parse("", &c), 0);
	ck_assert_int_eq(c.num_local_experts, 8);
	ck_assert_int_eq(c.intermediate_size, 16);
	ck_assert_int_eq(c.head_dim, 16);
	ck_assert_int_eq(c.qk_norm, MLENS_QK_NORM_HEAD);
	ck_assert(c.topk_raw && !c.qkv_bias && !c.o_bias);
	ck_assert(!c.dense[0] && !c.dense[3]);
	ck_assert_int_eq(c.dense_inter, 0);
	/* decoder_sparse_step 2: layers 0 and 2 dense; mlp_only_layers adds 3 */
	ck_assert_int_eq(qwen3_parse(", \"decoder_sparse_step\": 2, \"mlp_only_layers\": [3], \"norm_topk_prob\": true, \"attention_bias\": true, \"use_sliding_window\": false, \"sliding_window\": 4096, \"rope_scaling\": null", &c), 0);
	ck_assert(c.dense[0] && !c.dense[1] && c.dense[2] && c.dense[3]);
	ck_assert_int_eq(c.dense_inter, 80);
	ck_assert(!c.topk_raw && c.qkv_bias && c.o_bias);
	/* transformers 5 writes Qwen3-MoE's expert count as num_local_experts */
	ck_assert_int_eq(cfg_text("{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 32, \"moe_intermediate_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_local_experts\": 6, \"num_experts_per_tok\": 2}", &c), 0);
	ck_assert_int_eq(c.num_local_experts, 6);
	ck_assert_int_eq(cfg_text("{\"architectures\": [\"Qwen2MoeForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 32, \"moe_intermediate_size\": 16, \"shared_expert_intermediate_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 6, \"num_experts_per_tok\": 2, \"layer_types\": [\"full_attention\", \"full_attention\"], \"sliding_window\": 0}", &c), 0);
	ck_assert(c.qkv_bias && !c.o_bias && c.shared_gate && c.topk_raw);
	ck_assert_int_eq(c.shared_inter, 64);
	ck_assert_int_eq(c.qk_norm, MLENS_QK_NORM_NONE);
	ck_assert_int_eq(cfg_text("{\"architectures\": [\"OlmoeForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 32, \"intermediate_size\": 16, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 6, \"num_experts_per_tok\": 2, \"clip_qkv\": 8.5, \"attention_bias\": true}", &c), 0);
	ck_assert_int_eq(c.qk_norm, MLENS_QK_NORM_ALL);
	ck_assert_double_eq(c.clip_qkv, 8.5);
	ck_assert(c.qkv_bias && c.o_bias && c.topk_raw);
	ck_assert_int_eq(c.intermediate_size, 16);
}
END_TEST

/* What a family asks for and mlens does not implement is refused naming
 * the key and its value. */
START_TEST(family_refusals)
{
	struct mlens_model_config c;

	ck_assert_int_eq(qwen3_parse(", \"use_sliding_window\": true", &c), -ENOTSUP);
	assert_err("t/config.json: 'use_sliding_window' is true; mlens has no sliding-window attention");
	ck_assert_int_eq(qwen3_parse(", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}", &c), -ENOTSUP);
	assert_err("t/config.json: 'rope_scaling' is {\"rope_type\":\"yarn\",\"factor\":4.0}", "set it to null");
	ck_assert_int_eq(qwen3_parse(", \"layer_types\": [\"full_attention\", \"sliding_attention\"]", &c), -ENOTSUP);
	assert_err("'layer_types' entry 1 is sliding_attention");
	ck_assert_int_eq(qwen3_parse(", \"mlp_only_layers\": [4]", &c), -EINVAL);
	assert_err("'mlp_only_layers' entry 0 is not a layer index in [0, 4)");
	ck_assert_int_eq(qwen3_parse(", \"norm_topk_prob\": 1", &c), -EINVAL);
	assert_err("'norm_topk_prob' must be true or false");
	ck_assert_int_eq(cfg_text("{\"architectures\": [\"OlmoeForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 32, \"intermediate_size\": 16, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 300, \"num_experts_per_tok\": 2}", &c), -EINVAL);
	assert_err("'num_experts' is 300; mlens accepts 1 to 256");
	ck_assert_int_eq(cfg_text("{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 32, \"moe_intermediate_size\": 16, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 6, \"num_experts_per_tok\": 2, \"mlp_only_layers\": [0]}", &c), -EINVAL);
	assert_err("'intermediate_size' is missing");
	ck_assert_int_eq(cfg_text("{\"architectures\": [\"Qwen2MoeForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 32, \"moe_intermediate_size\": 16, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 6, \"num_experts_per_tok\": 2}", &c), -EINVAL);
	assert_err("'shared_expert_intermediate_size' is missing");
	ck_assert_int_eq(cfg_text("{\"architectures\": [\"OlmoeForCausalLM\"], \"vocab_size\": 100, \"hidden_size\": 32, \"intermediate_size\": 16, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 6, \"num_experts_per_tok\": 2, \"clip_qkv\": -1}", &c), -EINVAL);
	assert_err("'clip_qkv' is -1");
	ck_assert_int_eq(cfg_text("{\"architectures\": [\"DeepseekV3ForCausalLM\"]}", &c), -ENOTSUP);
	assert_err("architectures is [\"DeepseekV3ForCausalLM\"]; mlens serves only MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM");
}
END_TEST

START_TEST(mkmodel_refuses)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);

	ck_assert_int_eq(mlens_mkmodel_preset(&o, "nope"), -EINVAL);
	ck_assert_int_eq(mlens_mkmodel_preset(&o, "tiny"), 0);
	o.cfg.num_experts_per_tok = 9;
	ck_assert_int_eq(mlens_mkmodel_write(&o, err, sizeof(err)), -EINVAL);
	assert_err("num_experts_per_tok");
	ck_assert_int_ne(access(sub("m/config.json"), F_OK), 0);
	o.cfg.num_experts_per_tok = 2;
	o.shards = 1000;
	ck_assert_int_eq(mlens_mkmodel_write(&o, err, sizeof(err)), -EINVAL);
	assert_err("1000 shards requested but the model has only 41 tensors");
	o.shards = 1;
	o.dir = sub("no/such/dir");
	ck_assert_int_eq(mlens_mkmodel_write(&o, err, sizeof(err)), -ENOENT);
	assert_err("no/such/dir: cannot create directory");
}
END_TEST

/* ==== fp8 weights ==== */

/* Replace the text from by to in the safetensors header of a file (its
 * JSON, padded to 8 bytes again so that the data stays aligned; the data is
 * left alone). */
static void edit_header(const char *path, const char *from, const char *to)
{
	size_t len, h = 0, nh, skip;
	char *file = read_file(path, &len), *at, *out;

	ck_assert_uint_ge(len, 8);
	for (int i = 0; i < 8; i++)
		h |= (size_t)(unsigned char)file[i] << (8 * i);
	ck_assert_uint_le(h, len - 8);
	at = memmem(file + 8, h, from, strlen(from));
	ck_assert_msg(at != NULL, "'%s' not in the header of %s", from, path);
	skip = (size_t)(at - file - 8);
	nh = (h - strlen(from) + strlen(to) + 7) & ~(size_t)7;
	out = malloc(8 + nh + len - 8 - h);
	for (int i = 0; i < 8; i++)
		out[i] = (char)(nh >> (8 * i));
	memset(out + 8, ' ', nh);
	memcpy(out + 8, file + 8, skip);
	memcpy(out + 8 + skip, to, strlen(to));
	memcpy(out + 8 + skip + strlen(to), at + strlen(from), h - skip - strlen(from));
	memcpy(out + 8 + nh, file + 8 + h, len - 8 - h);
	write_file(path, out, 8 + nh + len - 8 - h);
	free(out);
	free(file);
}

static const struct mlens_wscale fp8_layouts[] = {
	{ MLENS_WSCALE_CHANNEL, 0, 0 },
	{ MLENS_WSCALE_BLOCK, 32, 48 },
};

/* Every e4m3 code decodes and encodes back to itself (the NaNs stay NaN);
 * encoding rounds to nearest even and saturates at 448. */
START_TEST(fp8_conversions)
{
	for (int b = 0; b < 256; b++) {
		float f = mlens_e4m3_to_f32((uint8_t)b);
		if ((b & 0x7f) == 0x7f) {
			ck_assert(isnan(f));
			ck_assert_uint_eq(mlens_f32_to_e4m3(f) & 0x7f, 0x7f);
			continue;
		}
		ck_assert_msg(mlens_f32_to_e4m3(f) == b || (b == 0x80 && f == 0.0f),
			      "code %#x (%g) encodes as %#x", b, f, mlens_f32_to_e4m3(f));
	}
	ck_assert_float_eq(mlens_e4m3_to_f32(0x7e), 448.0f);
	ck_assert_float_eq(mlens_e4m3_to_f32(0x01), 1.0f / 512);
	ck_assert_uint_eq(mlens_f32_to_e4m3(1.0f + 1.0f / 16), 0x38);	/* tie: to even */
	ck_assert_uint_eq(mlens_f32_to_e4m3(1.0f + 3.0f / 16), 0x3a);
	ck_assert_uint_eq(mlens_f32_to_e4m3(1.0f / 1024), 0x00);	/* half the least */
	ck_assert_uint_eq(mlens_f32_to_e4m3(3.0f / 1024), 0x02);
	ck_assert_uint_eq(mlens_f32_to_e4m3(464.0f), 0x7e);		/* saturates */
	ck_assert_uint_eq(mlens_f32_to_e4m3(1e9f), 0x7e);
	ck_assert_uint_eq(mlens_f32_to_e4m3(-INFINITY), 0xfe);
	ck_assert_uint_eq(mlens_f32_to_e4m3(-0.0f), 0x80);
}
END_TEST

/* mkmodel's fp8 checkpoints in both layouts load with fp8 experts whose
 * bytes and scales are the generator's values quantized; the modules the
 * quantization_config ignores (attention, router, lm_head) stay bf16. */
START_TEST(fp8_roundtrip)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, _i ? 3 : 1);
	const struct mlens_wscale *k = &fp8_layouts[_i];
	const int64_t I = 128, H = 64;
	struct mlens_model *m;
	float *v = malloc(sizeof(float) * (size_t)(I * H)), sc[128];
	uint8_t *q = malloc((size_t)(I * H));
	const char *name = "model.layers.1.block_sparse_moe.experts.2.w2.weight";

	o.fp8 = *k;
	make(&o);
	m = open_ok(o.dir);
	ck_assert_int_eq(m->cfg.dtype, MLENS_DTYPE_BF16);
	ck_assert_int_eq(m->cfg.expert_dtype, MLENS_DTYPE_E4M3);
	ck_assert_int_eq(m->cfg.expert_scale.kind, k->kind);
	ck_assert_int_eq(m->cfg.expert_scale.block_rows, k->block_rows);
	ck_assert_str_eq(m->cfg.quant_method, _i ? "fp8" : "compressed-tensors");
	ck_assert_int_eq(m->layers[0].wq->dtype, MLENS_DTYPE_BF16);
	ck_assert_int_eq(m->layers[1].router->dtype, MLENS_DTYPE_BF16);
	ck_assert_int_eq(m->lm_head->dtype, MLENS_DTYPE_BF16);
	for (int64_t i = 0; i < I * H; i++)	/* the bf16 model's value, quantized */
		v[i] = mlens_bf16_to_f32(mlens_f32_to_bf16(mlens_mkmodel_value(o.seed, name, (uint64_t)i)));
	mlens_fp8_quantize(v, H, I, k, q, sc);	/* w2 is [hidden][inter] */
	ck_assert(!memcmp(m->layers[1].w2[2], q, (size_t)(I * H)));
	ck_assert(!memcmp(m->layers[1].s2[2], sc, mlens_wscale_count(k, H, I) * sizeof(float)));
	/* each piece 16-byte aligned in a slot */
	ck_assert_uint_eq(mlens_model_expert_bytes(&m->cfg),
			  3 * (uint64_t)(I * H) + 2 * mlens_quant_piece(4 * mlens_wscale_count(k, I, H)) +
				  mlens_quant_piece(4 * mlens_wscale_count(k, H, I)));
	mlens_model_close(m);
	free(v);
	free(q);
}
END_TEST

/* Bad fp8 checkpoints are refused with the tensor, the module or the
 * method named. */
START_TEST(fp8_refusals)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);
	const char *st = sub("m/model.safetensors"), *cj = sub("m/config.json");
	struct mlens_model_config c;

	o.fp8 = fp8_layouts[0];
	make(&o);
	/* a scale of the wrong shape */
	edit_header(st, "layers.0.block_sparse_moe.experts.1.w1.weight_scale\":{\"dtype\":\"F32\",\"shape\":[128,1]",
		    "layers.0.block_sparse_moe.experts.1.w1.weight_scale\":{\"dtype\":\"F32\",\"shape\":[1,128]");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.0.block_sparse_moe.experts.1.w1.weight_scale': F32 [1, 128] does not fit fp8 weight 'model.layers.0.block_sparse_moe.experts.1.w1.weight' [128, 64]",
		   "expected [1] (per tensor), [128, 1] (per output channel)");
	edit_header(st, "[1,128]", "[128,1]");
	/* a scale missing */
	edit_header(st, "experts.1.w1.weight_scale\"", "experts.1.w9.weight_scale\"");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("fp8 tensor 'model.layers.0.block_sparse_moe.experts.1.w1.weight' has no scale 'model.layers.0.block_sparse_moe.experts.1.w1.weight_scale' (quant_method compressed-tensors)");
	edit_header(st, "experts.1.w9.weight_scale\"", "experts.1.w1.weight_scale\"");
	mlens_model_close(open_ok(o.dir));
	/* an fp8 tensor in a module the config ignores */
	edit(cj, "\"lm_head\",", "\"re:.*w3\",");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("tensor 'model.layers.0.block_sparse_moe.experts.0.w3.weight' is F8_E4M3 but quantization_config keeps module 'model.layers.0.block_sparse_moe.experts.0.w3' unquantized");
	edit(cj, "\"re:.*w3\",", "\"lm_head\",");
	/* fp8 tensors without a quantization_config */
	edit(cj, "\"quantization_config\"", "\"quantization_confiX\"");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("dtype F8_E4M3 differs from the model's BF16");
	/* methods mlens does not read */
	ck_assert_int_eq(cfg_parse(", \"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": 4}", &c), -ENOTSUP);
	assert_err("t/config.json: quantization_config.quant_method \"gptq\" is not supported");
	ck_assert_int_eq(cfg_parse(", \"quantization_config\": {\"quant_method\": \"bitsandbytes\"}", &c), -ENOTSUP);
	assert_err("quant_method \"bitsandbytes\" is not supported");
	ck_assert_int_eq(cfg_parse(", \"quantization_config\": {\"quant_method\": \"awq\"}", &c), -ENOTSUP);
	assert_err("quant_method \"awq\"");
	ck_assert_int_eq(cfg_parse(", \"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {\"g\": {\"weights\": {\"num_bits\": 4, \"type\": \"int\"}}}}", &c), -ENOTSUP);
	assert_err("quantization_config group 'g' quantizes weights to 4-bit int; mlens reads only fp8");
	ck_assert_int_eq(cfg_parse(", \"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128]}", &c), -EINVAL);
	assert_err("quantization_config.weight_block_size must be two block sizes");
	ck_assert_int_eq(cfg_parse(", \"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 64]}", &c), 0);
	ck_assert_int_eq(c.expert_dtype, MLENS_DTYPE_E4M3);
	ck_assert_int_eq(c.expert_scale.kind, MLENS_WSCALE_BLOCK);
	ck_assert_int_eq(c.expert_scale.block_cols, 64);
}
END_TEST

/* A scale stored as fp8 itself is refused for its dtype, naming the
 * scale and the weight it belongs to; a file cut short inside an fp8
 * matrix is refused naming that matrix. */
START_TEST(fp8_scale_dtype_truncated)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 3);
	const char *s1 = sub("m/model-00001-of-00003.safetensors");
	struct stat sb;

	o.fp8 = fp8_layouts[0];
	make(&o);
	/* the same 512 bytes as 512 fp8 codes */
	edit_header(s1, "layers.0.block_sparse_moe.experts.0.w1.weight_scale\":{\"dtype\":\"F32\",\"shape\":[128,1]",
		    "layers.0.block_sparse_moe.experts.0.w1.weight_scale\":{\"dtype\":\"F8_E4M3\",\"shape\":[512,1]");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model-00001-of-00003.safetensors: tensor 'model.layers.0.block_sparse_moe.experts.0.w1.weight_scale' is F8_E4M3; the scales of fp8 weight 'model.layers.0.block_sparse_moe.experts.0.w1.weight' must be F32, BF16 or F16");
	make(&o);
	mlens_model_close(open_ok(o.dir));
	/* this shard ends with an fp8 expert matrix */
	ck_assert_int_eq(stat(s1, &sb), 0);
	ck_assert_int_eq(truncate(s1, sb.st_size - 100), 0);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model-00001-of-00003.safetensors: tensor 'model.layers.0.block_sparse_moe.experts.1.w2.weight': data_offsets [",
		   "run past the data section");
}
END_TEST

/* An empty fp8 tensor that no family names, placed at the first byte of
 * an expert matrix (with an empty scale at the end), is refused as not
 * part of the model; it used to be taken for that expert, its scales
 * pointer moved past the expert's own. */
START_TEST(fp8_alias_of_expert)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);
	const char *path = sub("m/model.safetensors");
	const char *w3 = "model.layers.1.block_sparse_moe.experts.3.w3.weight";
	struct mlens_safetensors st;
	char *file, entry[512];
	size_t len;
	uint64_t at = UINT64_MAX, end = 0;

	o.fp8 = fp8_layouts[0];
	make(&o);
	file = read_file(path, &len);
	ck_assert_int_eq(mlens_safetensors_parse(file, len, path, &st, err, sizeof(err)), 0);
	for (int i = 0; i < st.n_tensors; i++) {
		if (!strcmp(st.tensors[i].name, w3))
			at = st.tensors[i].begin;
		end = st.tensors[i].end > end ? st.tensors[i].end : end;
	}
	mlens_safetensors_free(&st);
	free(file);
	ck_assert_uint_ne(at, UINT64_MAX);
	snprintf(entry, sizeof(entry),
		 "{\"%s.alias.weight\":{\"dtype\":\"F8_E4M3\",\"shape\":[0,64],\"data_offsets\":[%llu,%llu]},"
		 "\"%s.alias.weight_scale\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[%llu,%llu]},",
		 w3, (unsigned long long)at, (unsigned long long)at, w3, (unsigned long long)end,
		 (unsigned long long)end);
	edit_header(path, "{", entry);
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("m/model.safetensors: tensor 'model.layers.1.block_sparse_moe.experts.3.w3.weight.alias.weight",
		   "is not part of the MixtralForCausalLM model");
}
END_TEST

/* The binding of fp8 scales reads config.json's quantization_config
 * again: a file replaced since its parse is refused, naming it (one whose
 * quantization_config had lost its quant_method used to crash). */
START_TEST(fp8_config_changed)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);
	struct mlens_model *m;
	bool *used;

	o.fp8 = fp8_layouts[0];
	make(&o);
	m = open_ok(o.dir);
	used = calloc((size_t)m->n_tensors, sizeof(*used));
	for (int i = 0; i < m->n_tensors; i++)	/* bound, as after the family's binding */
		used[i] = true;
	mlens_quant_free(m);
	edit(sub("m/config.json"), "\"quant_method\": \"compressed-tensors\"", "\"quant_method\": null");
	ck_assert_int_eq(mlens_quant_bind(m, used, err, sizeof(err)), -EINVAL);
	assert_err("m/config.json changed while the model was being opened (its quantization_config is no longer quant_method compressed-tensors); open the model again");
	mlens_quant_free(m);
	edit(sub("m/config.json"), "\"quant_method\": null", "\"quant_method\": \"fp8\"");
	ck_assert_int_eq(mlens_quant_bind(m, used, err, sizeof(err)), -EINVAL);
	assert_err("is no longer quant_method compressed-tensors");
	free(used);
	mlens_model_close(m);
}
END_TEST

/* Block scales whose grid does not match weight_block_size. */
START_TEST(fp8_block_mismatch)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);

	o.fp8 = fp8_layouts[1];
	make(&o);
	edit(sub("m/config.json"), "32,", "16,");
	ck_assert_int_eq(open_err(o.dir), -EINVAL);
	assert_err("F32 [4, 2] does not fit fp8 weight 'model.layers.0.block_sparse_moe.experts.0.w1.weight' [128, 64]",
		   "or [8, 2] (blocks of 16x48)");
}
END_TEST

/* weight_dtype = fp8: every expert matrix of a bf16 model becomes e4m3
 * with a scale per row, amax / 448, each value within half an e4m3 step
 * of the original. */
START_TEST(fp8_quantize_at_load)
{
	struct mlens_mkmodel_opts o = tiny(sub("m"), MLENS_DTYPE_BF16, 1);
	struct mlens_model *m;
	const int64_t I = 128, H = 64;

	make(&o);
	m = open_ok(o.dir);
	const void *orig = m->layers[1].w1[3];
	ck_assert_int_eq(mlens_model_quantize_experts(m, err, sizeof(err)), 0);
	ck_assert_int_eq(m->cfg.expert_dtype, MLENS_DTYPE_E4M3);
	ck_assert_int_eq(m->cfg.expert_scale.kind, MLENS_WSCALE_CHANNEL);
	ck_assert_ptr_ne(m->layers[1].w1[3], orig);
	for (int64_t r = 0; r < I; r++) {
		float amax = 0, s = m->layers[1].s1[3][r];
		for (int64_t c = 0; c < H; c++)
			amax = fmaxf(amax, fabsf(mlens_load(orig, MLENS_DTYPE_BF16, (size_t)(r * H + c))));
		ck_assert_float_eq(s, amax / 448.0f);
		for (int64_t c = 0; c < H; c++) {
			float w = mlens_load(orig, MLENS_DTYPE_BF16, (size_t)(r * H + c));
			float d = mlens_e4m3_to_f32(((const uint8_t *)m->layers[1].w1[3])[r * H + c]) * s;
			ck_assert_msg(fabsf(d - w) <= fmaxf(fabsf(w) / 16, s / 1024) * 1.0001f,
				      "row %lld col %lld: %g quantized to %g", (long long)r, (long long)c, w, d);
		}
	}
	/* w2 is [hidden][inter]: a scale for each of its hidden rows */
	ck_assert_float_gt(m->layers[0].s2[0][H - 1], 0);
	mlens_model_close(m);
}
END_TEST

/* fp8 experts are Mixtral's only: the other families' shared experts and
 * dense MLPs would run without scales, so mkmodel will not write them,
 * weight_dtype fp8 will not quantize them and a checkpoint with a
 * quantization_config is refused, each naming the architecture. */
START_TEST(fp8_family_refusals)
{
	static const char *const presets[] = { "qwen3-tiny", "qwen2-tiny", "olmoe-tiny" };
	static const char *const archs[] = { "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
					     "OlmoeForCausalLM" };
	struct mlens_mkmodel_opts o = family(sub("m"), presets[_i], false);
	struct mlens_model *m;
	char want[200];

	o.fp8 = fp8_layouts[0];
	ck_assert_int_eq(mlens_mkmodel_write(&o, err, sizeof(err)), -EINVAL);
	snprintf(want, sizeof(want), "fp8 experts are written for Mixtral only; write %s in bf16, fp16 or fp32",
		 archs[_i]);
	assert_err(want);
	o.fp8 = (struct mlens_wscale){ MLENS_WSCALE_NONE, 0, 0 };
	make(&o);
	m = open_ok(o.dir);
	ck_assert_int_eq(mlens_model_quantize_experts(m, err, sizeof(err)), -ENOTSUP);
	snprintf(want, sizeof(want), "%s experts cannot be quantized to fp8 (mlens quantizes MixtralForCausalLM experts only); set weight_dtype auto",
		 archs[_i]);
	assert_err(want);
	ck_assert_int_eq(m->cfg.expert_dtype, MLENS_DTYPE_F32);
	ck_assert_uint_eq(mlens_model_quant_bytes(m), 0);
	mlens_model_close(m);
	edit(sub("m/config.json"), "\"architectures\"",
	     "\"quantization_config\": {\"quant_method\": \"fbgemm_fp8\"}, \"architectures\"");
	ck_assert_int_eq(open_err(o.dir), -ENOTSUP);
	snprintf(want, sizeof(want), "quantization_config (quant_method fbgemm_fp8) is set; mlens reads fp8 experts of MixtralForCausalLM only, %s weights must be bf16, fp16 or fp32",
		 archs[_i]);
	assert_err("m/config.json: ", want);
}
END_TEST

static Suite *model_suite(void)
{
	Suite *s = suite_create("model");
	TCase *tc = tcase_create("roundtrip");
	TCase *bad = tcase_create("bad input");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_loop_test(tc, roundtrip_dtype, 0, 3);
	tcase_add_test(tc, weight_bytes_exact);
	tcase_add_test(tc, sharded_equals_single);
	tcase_add_test(tc, fused_equals_legacy);
	tcase_add_test(tc, tied_embeddings);
	tcase_add_test(tc, seed_changes_weights);
	tcase_add_test(tc, config_variants);
	tcase_add_test(tc, config_eos);
	tcase_add_test(tc, file_generation_config);
	tcase_add_test(tc, fp8_conversions);
	tcase_add_loop_test(tc, fp8_roundtrip, 0, 2);
	tcase_add_test(tc, fp8_quantize_at_load);
	tcase_add_loop_test(tc, family_roundtrip, 0, 6);
	tcase_add_test(tc, family_configs);
	suite_add_tcase(s, tc);

	tcase_add_checked_fixture(bad, setup, teardown);
	tcase_set_timeout(bad, 60);
	tcase_add_test(bad, st_too_short);
	tcase_add_test(bad, st_header_past_end);
	tcase_add_test(bad, st_bad_dtype);
	tcase_add_test(bad, st_huge_dims);
	tcase_add_test(bad, st_out_of_range);
	tcase_add_test(bad, st_size_mismatch);
	tcase_add_test(bad, st_overlap_gap_tail);
	tcase_add_test(bad, st_bad_json);
	tcase_add_test(bad, st_valid_with_metadata);
	tcase_add_test(bad, file_truncated);
	tcase_add_test(bad, file_header_past_end);
	tcase_add_test(bad, file_dtype_mismatch);
	tcase_add_test(bad, file_shape_mismatch);
	tcase_add_test(bad, fp8_scale_dtype_truncated);
	tcase_add_test(bad, fp8_alias_of_expert);
	tcase_add_test(bad, fp8_config_changed);
	tcase_add_test(bad, file_missing_and_extra_tensor);
	tcase_add_test(bad, file_missing_shard);
	tcase_add_test(bad, file_index_disagrees);
	tcase_add_test(bad, file_fifo);
	tcase_add_test(bad, file_no_weights);
	tcase_add_test(bad, file_config_errors);
	tcase_add_test(bad, config_refusals);
	tcase_add_test(bad, fp8_refusals);
	tcase_add_test(bad, fp8_block_mismatch);
	tcase_add_loop_test(bad, config_ranges, 0, (int)(sizeof(ranges) / sizeof(ranges[0])));
	tcase_add_test(bad, mkmodel_refuses);
	tcase_add_test(bad, family_bad_files);
	tcase_add_test(bad, family_refusals);
	tcase_add_loop_test(bad, fp8_family_refusals, 0, 3);
	suite_add_tcase(s, bad);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(model_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
