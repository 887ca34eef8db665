/* Description: weights on disk (daemon/model/disk_tier.c): a tiny model's
 * last experts of each layer left in its files; the weight pages hold the
 * rest byte for byte, each disk expert reads into its staging byte for
 * byte over two steps (fused DBRX experts too), the split's arithmetic is
 * the loader's, keeping the first experts out of the per-step reads moves
 * the rest and reads less, and an injected read error fails one layer's
 * read once (counted) and the next read succeeds. A trade moves a disk
 * expert into the RAM page of another, which is read from the files from
 * then on, every matrix still the file's bytes; a trade whose read fails
 * leaves both experts, their pointers and bytes where they were. The
 * CPU engine with weights_disk_follow trades the favored experts of a
 * skewed model into RAM as it generates, the greedy tokens those of the
 * split as loaded. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "daemon/exec/engine.h"
#include "daemon/model/disk_tier.h"
#include "daemon/model/weights.h"
#include "daemon/tools/mkmodel.h"
#include "tests/check_common.h"

struct fixture {
	char dir[64];
	struct mlens_model *m;
	struct mlens_weights w;
	const void **src;	/* [L][E][3]: each matrix in the file mapping */
	size_t mat;		/* bytes of one matrix */
	struct mlens_weights_split split, split0;	/* before the load: disk, none */
	int L, E;
};

static void fx_open_favor(struct fixture *f, const char *preset, int layers, int disk, int favor)
{
	struct mlens_mkmodel_opts o = { .seed = 3, .router_favor = favor };
	struct mlens_weights_opts wo = { .node = -1, .movers = 1, .io_uring = true, .disk_experts = disk };
	char err[512] = "";

	snprintf(f->dir, sizeof(f->dir), "/tmp/mlens-dt.XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(f->dir));
	ck_assert_int_eq(mlens_mkmodel_preset(&o, preset), 0);
	o.dir = f->dir;
	o.cfg.num_hidden_layers = layers;
	o.cfg.dtype = MLENS_DTYPE_F32;
	ck_assert_msg(mlens_mkmodel_write(&o, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(mlens_model_open(f->dir, &f->m, err, sizeof(err)) == 0, "%s", err);
	f->L = (int)f->m->cfg.num_hidden_layers;
	f->E = (int)f->m->cfg.num_local_experts;
	f->mat = (size_t)f->m->cfg.intermediate_size * (size_t)f->m->cfg.hidden_size * 4;
	f->src = calloc((size_t)f->L * (size_t)f->E * 3, sizeof(*f->src));
	ck_assert_ptr_nonnull(f->src);
	for (int l = 0; l < f->L; l++)
		for (int e = 0; e < f->E; e++) {
			f->src[(l * f->E + e) * 3 + 0] = f->m->layers[l].w1[e];
			f->src[(l * f->E + e) * 3 + 1] = f->m->layers[l].w2[e];
			f->src[(l * f->E + e) * 3 + 2] = f->m->layers[l].w3[e];
		}
	ck_assert_msg(mlens_weights_split(f->m, disk, &f->split, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(mlens_weights_split(f->m, 0, &f->split0, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(mlens_weights_load(f->m, &wo, &f->w, err, sizeof(err)) == 0, "%s", err);
}

static void fx_open(struct fixture *f, const char *preset, int layers, int disk)
{
	fx_open_favor(f, preset, layers, disk, 0);
}

static void fx_close(struct fixture *f)
{
	char cmd[128];

	mlens_weights_free(&f->w);
	mlens_model_close(f->m);
	free(f->src);
	snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
	ck_assert_int_eq(system(cmd), 0);
}

/* Experts [e0, e1) of layer l hold the file's bytes. */
static void same_experts(const struct fixture *f, int l, int e0, int e1)
{
	for (int e = e0; e < e1; e++) {
		const void *now[3] = { f->m->layers[l].w1[e], f->m->layers[l].w2[e], f->m->layers[l].w3[e] };
		for (int k = 0; k < 3; k++)
			ck_assert_msg(!memcmp(now[k], f->src[(l * f->E + e) * 3 + k], f->mat),
				      "layer %d expert %d matrix %d differs from the file", l, e, k);
	}
}

/* Two steps over every layer: each layer's disk experts ready, as in the file. */
static void steps(struct fixture *f, int e0)
{
	for (int s = 0; s < 2; s++)
		for (int l = 0; l < f->L; l++) {
			ck_assert_int_eq(mlens_disk_tier_ready(f->m->disk, l), 0);
			same_experts(f, l, e0, f->E);
			mlens_disk_tier_done(f->m->disk, l);
		}
}

static void disk_experts(const char *preset)
{
	struct fixture f;
	struct mlens_disk_tier_stats st;

	fx_open(&f, preset, 5, 2);
	ck_assert_ptr_nonnull(f.w.disk);
	ck_assert_ptr_eq(f.m->disk, f.w.disk);
	ck_assert_uint_eq(f.w.disk_bytes, (uint64_t)f.L * 2 * 3 * f.mat);
	ck_assert(mlens_disk_tier_holds(f.m->disk, 0, f.E - 1));
	ck_assert(!mlens_disk_tier_holds(f.m->disk, 0, f.E - 3));
	/* the resident experts in the weight pages, as in the file */
	for (int l = 0; l < f.L; l++) {
		for (int e = 0; e < f.E - 2; e++)
			ck_assert((const char *)f.m->layers[l].w1[e] >= (const char *)f.w.mem.p &&
				  (const char *)f.m->layers[l].w1[e] < (const char *)f.w.mem.p + f.w.mem.size);
		same_experts(&f, l, 0, f.E - 2);
	}
	steps(&f, f.E - 2);
	mlens_disk_tier_get_stats(f.m->disk, &st);
	ck_assert_uint_eq(f.split.pages, f.w.bytes);
	ck_assert_uint_eq(f.split.disk, f.w.disk_bytes);
	ck_assert_uint_eq(f.split.staging, st.staging_bytes);
	ck_assert_int_eq(st.experts, 2);
	ck_assert_int_eq(st.layers, f.L);
	ck_assert_uint_ge(st.step_bytes, st.disk_bytes);
	ck_assert_uint_ge(st.read_bytes_total, 2 * st.step_bytes);
	ck_assert_uint_eq(st.errors_total, 0);
	/* fewer experts on disk, smaller split; none: the files whole */
	ck_assert_uint_eq(f.split0.disk, 0);
	ck_assert_uint_eq(f.split0.staging, 0);
	ck_assert_uint_gt(f.split0.pages, f.w.bytes);

	/* the first of the two placed once for all: only the last is read */
	mlens_disk_tier_keep_from(f.m->disk, f.E - 1);
	mlens_disk_tier_get_stats(f.m->disk, &st);
	ck_assert_uint_lt(st.step_bytes, (uint64_t)f.L * 2 * 3 * f.mat);
	ck_assert_uint_ge(st.step_bytes, (uint64_t)f.L * 3 * f.mat);
	ck_assert(!mlens_disk_tier_holds(f.m->disk, 0, f.E - 2));
	steps(&f, f.E - 1);
	/* every one placed: nothing read, ready at once */
	mlens_disk_tier_keep_from(f.m->disk, f.E);
	mlens_disk_tier_get_stats(f.m->disk, &st);
	ck_assert_uint_eq(st.step_bytes, 0);
	ck_assert_int_eq(st.layers, 0);
	ck_assert_int_eq(mlens_disk_tier_ready(f.m->disk, 0), 0);
	fx_close(&f);
}

START_TEST(mixtral_disk_experts)
{
	disk_experts("tiny");
}
END_TEST

/* DBRX stores each layer's experts fused in one tensor a projection. */
START_TEST(dbrx_fused_disk_experts)
{
	disk_experts("dbrx-tiny");
}
END_TEST

START_TEST(read_error_once)
{
	struct fixture f;
	struct mlens_disk_tier_stats st;
	char hook[96];
	FILE *h;

	snprintf(hook, sizeof(hook), "/tmp/mlens-dt-fail.%d", (int)getpid());
	unlink(hook);
	setenv("MLENS_TEST_DISK_FAIL", hook, 1);
	fx_open(&f, "tiny", 5, 2);
	unsetenv("MLENS_TEST_DISK_FAIL");
	/* layers 0 and 1 are read at start (both waited for: the hook must
	 * not meet layer 1's read still in flight); layer 2 then fails, as
	 * does a file that ends early */
	ck_assert_int_eq(mlens_disk_tier_ready(f.m->disk, 0), 0);
	ck_assert_int_eq(mlens_disk_tier_ready(f.m->disk, 1), 0);
	h = fopen(hook, "w");
	ck_assert_ptr_nonnull(h);
	fclose(h);
	ck_assert_int_eq(mlens_disk_tier_ready(f.m->disk, 2), -EIO);
	h = fopen(hook, "w");
	fputs("short\n", h);
	fclose(h);
	ck_assert_int_eq(mlens_disk_tier_ready(f.m->disk, 2), -EIO);
	mlens_disk_tier_get_stats(f.m->disk, &st);
	ck_assert_uint_eq(st.errors_total, 2);
	/* the hook gone, the next read of the layer succeeds */
	unlink(hook);
	ck_assert_int_eq(mlens_disk_tier_ready(f.m->disk, 2), 0);
	same_experts(&f, 2, f.E - 2, f.E);
	steps(&f, f.E - 2);
	fx_close(&f);
}
END_TEST

/* Which experts of layer l are on disk, as a bit mask. */
static unsigned disk_mask(const struct fixture *f, int l)
{
	uint8_t on[64];
	unsigned m = 0;

	ck_assert_int_le(f->E, 64);
	ck_assert(mlens_disk_tier_get_layer(f->m->disk, l, on));
	for (int e = 0; e < f->E; e++) {
		if (on[e])
			m |= 1u << e;
		ck_assert_int_eq(on[e] != 0, mlens_disk_tier_holds(f->m->disk, l, e));
	}
	return m;
}

static bool in_pages(const struct fixture *f, const void *p)
{
	return (const char *)p >= (const char *)f->w.mem.p && (const char *)p < (const char *)f->w.mem.p + f->w.mem.size;
}

START_TEST(trade_moves_expert)
{
	struct fixture f;
	struct mlens_disk_tier_stats st;
	const void *page;
	unsigned last2;

	fx_open(&f, "tiny", 5, 2);
	last2 = 3u << (f.E - 2);
	ck_assert(mlens_disk_tier_can_trade(f.m->disk));
	/* a step under way: layer 0 read, the prefetch of the next ones too */
	ck_assert_int_eq(mlens_disk_tier_ready(f.m->disk, 0), 0);
	mlens_disk_tier_done(f.m->disk, 0);
	page = f.m->layers[1].w2[0];
	/* only a disk expert moves in, only in place of a RAM one */
	ck_assert_int_eq(mlens_disk_tier_trade(f.m->disk, 1, 0, 1), -EINVAL);
	ck_assert_int_eq(mlens_disk_tier_trade(f.m->disk, 1, f.E - 1, f.E - 2), -EINVAL);
	ck_assert_int_eq(mlens_disk_tier_trade(f.m->disk, 1, f.E - 1, 0), 0);
	ck_assert_uint_eq(disk_mask(&f, 1), (last2 & ~(1u << (f.E - 1))) | 1u);
	ck_assert_uint_eq(disk_mask(&f, 0), last2);
	/* the last expert now in expert 0's page, expert 0 in the staging */
	ck_assert_ptr_eq(f.m->layers[1].w2[f.E - 1], page);
	ck_assert(in_pages(&f, f.m->layers[1].w1[f.E - 1]) && in_pages(&f, f.m->layers[1].w3[f.E - 1]));
	ck_assert(!in_pages(&f, f.m->layers[1].w1[0]));
	same_experts(&f, 1, f.E - 1, f.E);
	/* every expert of every layer the file's bytes over two steps, the
	 * traded layer read with expert 0 in place of the last */
	steps(&f, 0);
	mlens_disk_tier_get_stats(f.m->disk, &st);
	ck_assert_uint_eq(st.trades_total, 1);
	ck_assert_uint_eq(st.trade_errors_total, 0);
	ck_assert_uint_eq(st.errors_total, 0);
	ck_assert_int_eq(st.experts, 2);
	ck_assert_int_eq(st.ram_experts, f.E - 2);
	/* and back: the same split as loaded */
	ck_assert_int_eq(mlens_disk_tier_trade(f.m->disk, 1, 0, f.E - 1), 0);
	ck_assert_uint_eq(disk_mask(&f, 1), last2);
	steps(&f, 0);
	/* placed for good elsewhere (hybrid, GPU-only): no trades */
	mlens_disk_tier_keep_from(f.m->disk, 1);
	ck_assert(!mlens_disk_tier_can_trade(f.m->disk));
	ck_assert_int_eq(mlens_disk_tier_trade(f.m->disk, 1, f.E - 1, 0), -EINVAL);
	fx_close(&f);
}
END_TEST

START_TEST(trade_error_keeps_both)
{
	struct fixture f;
	struct mlens_disk_tier_stats st;
	const void *before[4][3];
	char hook[96], tmp[112];
	unsigned mask;
	FILE *h;

	snprintf(hook, sizeof(hook), "/tmp/mlens-dt-trade.%d", (int)getpid());
	unlink(hook);
	setenv("MLENS_TEST_DISK_FAIL", hook, 1);
	fx_open(&f, "tiny", 5, 2);
	unsetenv("MLENS_TEST_DISK_FAIL");
	ck_assert_int_le(f.E, 4);
	for (int e = 0; e < f.E; e++) {
		before[e][0] = f.m->layers[2].w1[e];
		before[e][1] = f.m->layers[2].w2[e];
		before[e][2] = f.m->layers[2].w3[e];
	}
	mask = disk_mask(&f, 2);
	/* the reads begun at start done first (an empty hook file fails
	 * them), the hook then written whole */
	ck_assert_int_eq(mlens_disk_tier_ready(f.m->disk, 0), 0);
	ck_assert_int_eq(mlens_disk_tier_ready(f.m->disk, 1), 0);
	snprintf(tmp, sizeof(tmp), "%s.new", hook);
	h = fopen(tmp, "w");
	ck_assert_ptr_nonnull(h);
	fputs("trade\n", h);
	fclose(h);
	ck_assert_int_eq(rename(tmp, hook), 0);
	ck_assert_int_eq(mlens_disk_tier_trade(f.m->disk, 2, f.E - 1, 0), -EIO);
	ck_assert_uint_eq(disk_mask(&f, 2), mask);
	for (int e = 0; e < f.E; e++) {
		ck_assert_ptr_eq(f.m->layers[2].w1[e], before[e][0]);
		ck_assert_ptr_eq(f.m->layers[2].w2[e], before[e][1]);
		ck_assert_ptr_eq(f.m->layers[2].w3[e], before[e][2]);
	}
	same_experts(&f, 2, 0, f.E - 2);
	/* the steps' reads do not fail on "trade": every layer as in the file */
	steps(&f, f.E - 2);
	mlens_disk_tier_get_stats(f.m->disk, &st);
	ck_assert_uint_eq(st.trades_total, 0);
	ck_assert_uint_eq(st.trade_errors_total, 1);
	ck_assert_uint_eq(st.errors_total, 0);
	/* the hook gone, the same trade goes through */
	unlink(hook);
	ck_assert_int_eq(mlens_disk_tier_trade(f.m->disk, 2, f.E - 1, 0), 0);
	same_experts(&f, 2, f.E - 1, f.E);
	steps(&f, 0);
	fx_close(&f);
}
END_TEST

/* Greedy tokens of the CPU engine over f's model: g after a fixed
 * prompt; with follow, the experts kept in RAM follow the routing,
 * chosen after every step. The trades made, in *trades. */
static void generate(struct fixture *f, bool follow, int32_t *out, int g, uint64_t *trades)
{
	struct mlens_backend be;
	struct mlens_backend_opts bo = { .n_threads = 2, .device = 0 };
	struct mlens_engine_opts eo = { .kv_block_size = 4, .kv_blocks = 64, .kv_dtype = MLENS_DTYPE_F32,
					.max_step_tokens = 256, .weights_disk_follow = follow,
					.weights_disk_period = 1 };
	struct mlens_engine *e;
	struct mlens_disk_tier_stats st;
	struct mlens_seq s = { 0 };
	struct mlens_engine_req r = { 0 };
	int32_t p[12];
	char err[256];

	for (int i = 0; i < 12; i++)
		p[i] = (int32_t)((i * 40503u + 7u) % (unsigned)f->m->cfg.vocab_size);
	ck_assert_int_eq(mlens_backend_cpu_create(&be, &bo), 0);
	ck_assert_msg(mlens_engine_create(&e, f->m, &be, &eo, err, sizeof(err)) == 0, "%s", err);
	ck_assert(mlens_engine_disk_follows(e) == follow);
	r.seq = &s;
	r.tokens = p;
	r.n_tokens = 12;
	for (int i = 0; i < g; i++) {
		r.samp.counter = (uint64_t)i;
		ck_assert_int_eq(mlens_engine_step(e, &r, 1), 0);
		out[i] = r.next_token;
		r.tokens = &out[i];
		r.n_tokens = 1;
	}
	mlens_seq_fini(mlens_engine_kv(e), &s);
	mlens_engine_destroy(e);
	mlens_backend_destroy(&be);
	mlens_disk_tier_get_stats(f->m->disk, &st);
	*trades = st.trades_total;
}

START_TEST(engine_follows_routing)
{
	struct fixture a, b;
	int32_t ta[16], tb[16];
	uint64_t na, nb;

	/* every token to experts 2 and 3, which start on disk */
	fx_open_favor(&a, "tiny", 5, 2, 2);
	fx_open_favor(&b, "tiny", 5, 2, 2);
	generate(&a, false, ta, 16, &na);
	generate(&b, true, tb, 16, &nb);
	ck_assert_uint_eq(na, 0);
	ck_assert_uint_eq(nb, (uint64_t)b.L * 2);
	for (int l = 0; l < b.L; l++) {
		ck_assert_uint_eq(disk_mask(&a, l), 0xcu);
		ck_assert_uint_eq(disk_mask(&b, l), 0x3u);
		same_experts(&b, l, 2, 4);
	}
	for (int i = 0; i < 16; i++)
		ck_assert_msg(ta[i] == tb[i], "token %d: %d as loaded, %d after the trades", i, ta[i], tb[i]);
	fx_close(&a);
	fx_close(&b);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("disk_tier");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, mixtral_disk_experts);
	tcase_add_test(tc, dbrx_fused_disk_experts);
	tcase_add_test(tc, read_error_once);
	tcase_add_test(tc, trade_moves_expert);
	tcase_add_test(tc, trade_error_keeps_both);
	tcase_add_test(tc, engine_follows_routing);
	suite_add_tcase(s, tc);
	return mlens_check_run(s);
}
