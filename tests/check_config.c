/* Description: mlensd's configuration (daemon/config.c): mlensd.conf's
 * "key = value" lines with comments, blank lines and quotes; flags in the
 * --key value and --key=value forms, --no-KEY for booleans; unknown keys,
 * malformed lines and bad values (sizes, booleans, integers out of range,
 * choices, weights) refused naming the file, line and key with the reason;
 * a flag wins over the file, the file over the default; the sockets
 * derived beside the tenant socket; --help lists every key, and what
 * mlens_config_dump writes reads back to the same configuration. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "daemon/config.h"
#include "kernels/backend.h"
#include "tests/check_common.h"

#define MIB (1024ull * 1024ull)

static struct mlens_config c;
static char err[512];

static void setup(void)
{
	mlens_config_defaults(&c);
	err[0] = 0;
}

static void teardown(void)
{
	mlens_config_free(&c);
}

static int text(const char *t)
{
	return mlens_config_load_text(&c, t, "t.conf", err, sizeof(err));
}

/* mlens_config_parse_args over a NULL-terminated list after "mlensd" */
static int args_v(const char *const *a)
{
	char *argv[32];
	int argc = 0;
	argv[argc++] = (char *)"mlensd";
	while (*a && argc < 31)
		argv[argc++] = (char *)*a++;
	argv[argc] = NULL;
	return mlens_config_parse_args(&c, argc, argv, err, sizeof(err));
}
#define ARGS(...) args_v((const char *const[]){ __VA_ARGS__, NULL })

/* err is exactly want */
#define ERR_IS(want) ck_assert_str_eq(err, want)

/* A size key's value, or the refusal (rc) and its message */
static int size_of(const char *v, uint64_t *out)
{
	char line[128];
	snprintf(line, sizeof(line), "kv_cache = %s\n", v);
	int rc = text(line);
	*out = c.kv_cache;
	return rc;
}

/* ==== defaults ==== */

START_TEST(defaults)
{
	/* values this test relies on below, as the option table gives them */
	ck_assert_ptr_null(c.config);
	ck_assert_ptr_null(c.model);
	ck_assert_str_eq(c.socket, "/run/mlens/mlensd.sock");
	ck_assert_str_eq(c.control, "");
	ck_assert_str_eq(c.stats, "");
	ck_assert_str_eq(c.backend, "auto");
	ck_assert_str_eq(c.log_level, "info");
	ck_assert_str_eq(c.log, "stderr");
	ck_assert_uint_eq(c.kv_cache, 1ull << 30);
	ck_assert_int_eq(c.kv_block_size, 16);
	ck_assert_uint_eq(c.gpu_memory, 0);
	ck_assert_uint_eq(c.weight_piece, 100 * MIB);
	ck_assert_int_eq(c.threads, 0);
	ck_assert_int_eq(c.numa_node, -1);
	ck_assert_int_eq(c.pipeline_sets, 3);
	ck_assert_int_eq(c.resident_experts, -1);	/* auto: as many as gpu_memory holds */
	ck_assert(!c.foreground);
	ck_assert(c.mlock);
	ck_assert(c.io_uring);
	ck_assert(!c.profile);
	ck_assert_double_eq(c.quota_weight, 1.0);
	ck_assert_str_eq(c.gpus, "0");
	ck_assert_int_eq(c.n_gpus, 1);
	ck_assert_int_eq(c.gpu_ids[0], 0);
}
END_TEST

/* ==== the file's syntax ==== */

START_TEST(file_syntax)
{
	ck_assert_int_eq(text("# a comment line\n"
			      "\n"
			      "   \t\n"
			      "threads = 12\n"
			      "  socket=/tmp/m/x.sock   # trailing comment\n"
			      "log = \"/var/log/mlensd.log\"\n"
			      "\tforeground\t=\tyes\t\n"
			      "kv_cache = 2G"), 0);	/* no newline at the end */
	ck_assert_str_eq(err, "");
	ck_assert_int_eq(c.threads, 12);
	ck_assert_str_eq(c.socket, "/tmp/m/x.sock");
	ck_assert_str_eq(c.log, "/var/log/mlensd.log");
	ck_assert(c.foreground);
	ck_assert_uint_eq(c.kv_cache, 2ull << 30);
	/* the last of a key's lines wins */
	ck_assert_int_eq(text("threads = 3\nthreads = 5\n"), 0);
	ck_assert_int_eq(c.threads, 5);
	/* an empty value is an empty string; an empty text changes nothing */
	ck_assert_int_eq(text("pid_file =\n"), 0);
	ck_assert_str_eq(c.pid_file, "");
	ck_assert_int_eq(text(""), 0);
	ck_assert_int_eq(c.threads, 5);
	/* a lone quote is kept as it is */
	ck_assert_int_eq(text("log = \"\n"), 0);
	ck_assert_str_eq(c.log, "\"");
}
END_TEST

START_TEST(file_errors_name_line_and_key)
{
	ck_assert_int_eq(text("# ok\nthreads = 2\nbogus_key = 1\n"), -EINVAL);
	ERR_IS("t.conf:3: unknown key 'bogus_key'");
	/* keys in the file are spelt with underscores */
	ck_assert_int_eq(text("kv-cache = 1G\n"), -EINVAL);
	ERR_IS("t.conf:1: unknown key 'kv-cache'");
	/* a file does not name another */
	ck_assert_int_eq(text("config = /etc/other.conf\n"), -EINVAL);
	ERR_IS("t.conf:1: unknown key 'config'");
	ck_assert_int_eq(text("\n\nkv_cache 1G\n"), -EINVAL);
	ERR_IS("t.conf:3: expected 'key = value'");
	/* keys are case-sensitive */
	ck_assert_int_eq(text("Threads = 2\n"), -EINVAL);
	ERR_IS("t.conf:1: unknown key 'Threads'");
	{
		size_t n = 5000;
		char *t = malloc(n + 16);
		ck_assert_ptr_nonnull(t);
		strcpy(t, "log = ");
		memset(t + 6, 'x', n);
		strcpy(t + 6 + n, "\n");
		ck_assert_int_eq(text(t), -EINVAL);
		ERR_IS("t.conf:1: line too long");
		free(t);
	}
	/* lines before the bad one took effect, the bad one and those after did not */
	ck_assert_int_eq(text("threads = 7\nthreads = x\nthreads = 9\n"), -EINVAL);
	ERR_IS("t.conf:2: key 'threads': 'x' is not an integer");
	ck_assert_int_eq(c.threads, 7);
}
END_TEST

/* ==== values ==== */

START_TEST(sizes)
{
	static const struct {
		const char *v;
		uint64_t want;
	} ok[] = {
		{ "8G", 8ull << 30 },	 { "512M", 512 * MIB },	     { "64K", 64 << 10 },
		{ "64k", 64 << 10 },	 { "1.5GiB", 3ull << 29 },   { "2T", 2ull << 40 },
		{ "4096", 4096 },	 { "1048576", 1 << 20 },    { "100MB", 100 * MIB },
		{ "7mib", 7 * MIB },	 { " 9M ", 9 * MIB },
	};
	uint64_t v;

	for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
		ck_assert_msg(size_of(ok[i].v, &v) == 0, "%s: %s", ok[i].v, err);
		ck_assert_msg(v == ok[i].want, "%s: %llu, not %llu", ok[i].v, (unsigned long long)v,
			      (unsigned long long)ok[i].want);
	}
	/* 0 and anything below a page: the KV cache's minimum */
	ck_assert_int_eq(size_of("0", &v), -ERANGE);
	ERR_IS("t.conf:1: key 'kv_cache': 0 is below the minimum of 4096 bytes");
	ck_assert_int_eq(size_of("4095", &v), -ERANGE);
	ERR_IS("t.conf:1: key 'kv_cache': 4095 is below the minimum of 4096 bytes");
	ck_assert_uint_eq(v, 9 * MIB);	/* the last good value stays */
	static const char *const bad[] = { "8X", "-1G", "G", "1G2", "1.5.5G", "", "3 G", "12Q" };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char want[200];
		ck_assert_msg(size_of(bad[i], &v) == -EINVAL, "'%s' taken as %llu", bad[i],
			      (unsigned long long)v);
		snprintf(want, sizeof(want),
			 "t.conf:1: key 'kv_cache': '%s' is not a size (a number with an optional "
			 "K, M, G or T suffix)", bad[i]);
		ERR_IS(want);
	}
	/* gpu_memory = 0 means the device's free memory: allowed */
	ck_assert_int_eq(text("gpu_memory = 0\n"), 0);
	ck_assert_uint_eq(c.gpu_memory, 0);
	ck_assert_int_eq(text("gpu_memory = 40G\n"), 0);
	ck_assert_uint_eq(c.gpu_memory, 40ull << 30);
	/* weight_piece: at least 1 MiB */
	ck_assert_int_eq(text("weight_piece = 1M\n"), 0);
	ck_assert_uint_eq(c.weight_piece, MIB);
	ck_assert_int_eq(text("weight_piece = 512K\n"), -ERANGE);
	ERR_IS("t.conf:1: key 'weight_piece': 512K is below the minimum of 1048576 bytes");
	/* the parser itself: too large for 64 bits */
	ck_assert_int_eq(mlens_parse_size("17179869184G", &v), -ERANGE);
	ck_assert_int_eq(mlens_parse_size(" 1K ", &v), 0);
	ck_assert_uint_eq(v, 1024);
}
END_TEST

START_TEST(booleans)
{
	static const char *const yes[] = { "true", "yes", "on", "1" };
	static const char *const no[] = { "false", "no", "off", "0" };
	char line[64];
	for (int i = 0; i < 4; i++) {
		snprintf(line, sizeof(line), "mlock = %s\n", no[i]);
		ck_assert_int_eq(text(line), 0);
		ck_assert_msg(!c.mlock, "%s", no[i]);
		snprintf(line, sizeof(line), "mlock = %s\n", yes[i]);
		ck_assert_int_eq(text(line), 0);
		ck_assert_msg(c.mlock, "%s", yes[i]);
	}
	ck_assert_int_eq(text("mlock = maybe\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'mlock': 'maybe' is not a boolean (true/false, yes/no, on/off, 1/0)");
	ck_assert_int_eq(text("io_uring = TRUE\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'io_uring': 'TRUE' is not a boolean (true/false, yes/no, on/off, 1/0)");
	ck_assert_int_eq(text("profile = 2\n"), -EINVAL);
	ck_assert(c.mlock);
	ck_assert(c.io_uring);
	ck_assert(!c.profile);
}
END_TEST

START_TEST(integers)
{
	/* the bounds themselves are taken */
	ck_assert_int_eq(text("kv_block_size = 1\nnuma_node = -1\nmovers = 64\n"
			      "pipeline_sets = 2\nquota_kv_blocks = 4294967296\n"), 0);
	ck_assert_int_eq(c.kv_block_size, 1);
	ck_assert_int_eq(c.numa_node, -1);
	ck_assert_int_eq(c.movers, 64);
	ck_assert_int_eq(c.pipeline_sets, 2);
	ck_assert_int_eq(c.quota_kv_blocks, 4294967296ll);
	ck_assert_int_eq(text("kv_block_size = 4096\n"), 0);
	ck_assert_int_eq(c.kv_block_size, 4096);
	/* one past them is not */
	ck_assert_int_eq(text("kv_block_size = 0\n"), -ERANGE);
	ERR_IS("t.conf:1: key 'kv_block_size': 0 is outside [1, 4096]");
	ck_assert_int_eq(text("kv_block_size = 4097\n"), -ERANGE);
	ERR_IS("t.conf:1: key 'kv_block_size': 4097 is outside [1, 4096]");
	ck_assert_int_eq(text("numa_node = -2\n"), -ERANGE);
	ERR_IS("t.conf:1: key 'numa_node': -2 is outside [-1, 1023]");
	ck_assert_int_eq(text("pipeline_sets = 4\n"), -ERANGE);
	ERR_IS("t.conf:1: key 'pipeline_sets': 4 is outside [2, 3]");
	ck_assert_int_eq(text("gpu_moe_streams = 5\n"), -ERANGE);
	ERR_IS("t.conf:1: key 'gpu_moe_streams': 5 is outside [1, 4]");
	ck_assert_int_eq(text("quota_kv_blocks = 4294967297\n"), -ERANGE);
	ERR_IS("t.conf:1: key 'quota_kv_blocks': 4294967297 is outside [0, 4294967296]");
	/* resident_experts: -1 (auto), 0 (every expert streams) and up; the
	 * model's count bounds it at start-up (startup_refusals.sh) */
	ck_assert_int_eq(text("resident_experts = 0\n"), 0);
	ck_assert_int_eq(c.resident_experts, 0);
	ck_assert_int_eq(text("resident_experts = -1\n"), 0);
	ck_assert_int_eq(c.resident_experts, -1);
	ck_assert_int_eq(text("resident_experts = -2\n"), -ERANGE);
	ERR_IS("t.conf:1: key 'resident_experts': -2 is outside [-1, 1048576]");
	ck_assert_int_eq(text("resident_experts = auto\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'resident_experts': 'auto' is not an integer");
	ck_assert_int_eq(c.resident_experts, -1);
	ck_assert_int_eq(c.kv_block_size, 4096);
	/* not integers */
	ck_assert_int_eq(text("threads = two\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'threads': 'two' is not an integer");
	ck_assert_int_eq(text("threads = 12abc\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'threads': '12abc' is not an integer");
	ck_assert_int_eq(text("threads = 1.5\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'threads': '1.5' is not an integer");
	ck_assert_int_eq(text("threads = 99999999999999999999\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'threads': '99999999999999999999' is not an integer");
	ck_assert_int_eq(text("threads =\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'threads': '' is not an integer");
	ck_assert_int_eq(c.threads, 0);
}
END_TEST

START_TEST(choices_and_weights)
{
	ck_assert_int_eq(text("backend = cpu\ngpu_gemm = exact\nlog_level = warning\n"), 0);
	ck_assert_str_eq(c.backend, "cpu");
	ck_assert_str_eq(c.gpu_gemm, "exact");
	ck_assert_str_eq(c.log_level, "warning");
	ck_assert_int_eq(text("backend = tpu\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'backend': 'tpu' is not one of auto, cpu, cuda");
	/* a word's prefix or a longer word is not the word */
	ck_assert_int_eq(text("backend = cu\n"), -EINVAL);
	ck_assert_int_eq(text("backend = cudax\n"), -EINVAL);
	ck_assert_int_eq(text("attn_kernel = AVX2\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'attn_kernel': 'AVX2' is not one of auto, scalar, avx2, avx512");
	ck_assert_str_eq(c.backend, "cpu");
	/* gpu_moe_grouped: auto by default, and the backend's names */
	ck_assert_str_eq(c.gpu_moe_grouped, "auto");
	ck_assert_int_eq(text("gpu_moe_grouped = off\n"), 0);
	ck_assert_str_eq(c.gpu_moe_grouped, "off");
	{
		enum mlens_moe_grouped g = MLENS_MOE_GROUPED_AUTO;
		ck_assert_int_eq(mlens_moe_grouped_parse(c.gpu_moe_grouped, &g), 0);
		ck_assert_int_eq(g, MLENS_MOE_GROUPED_OFF);
		ck_assert_str_eq(mlens_moe_grouped_name(g), "off");
		ck_assert_int_eq(mlens_moe_grouped_parse("On", &g), -EINVAL);
	}
	ck_assert_int_eq(text("gpu_moe_grouped = yes\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'gpu_moe_grouped': 'yes' is not one of auto, on, off");
	/* quota_weight: a positive finite number */
	ck_assert_int_eq(text("quota_weight = 2.5\n"), 0);
	ck_assert_double_eq(c.quota_weight, 2.5);
	static const char *const bad[] = { "0", "-1", "inf", "nan", "x", "1e999", "2w" };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char line[64], want[128];
		snprintf(line, sizeof(line), "quota_weight = %s\n", bad[i]);
		ck_assert_msg(text(line) == -EINVAL, "'%s' taken", bad[i]);
		snprintf(want, sizeof(want), "t.conf:1: key 'quota_weight': '%s' is not a positive number",
			 bad[i]);
		ERR_IS(want);
	}
	ck_assert_double_eq(c.quota_weight, 2.5);
	/* gpus: spaces around the commas; refusals leave the last good list */
	ck_assert_int_eq(text("gpus = 3 , 1,2\n"), 0);
	ck_assert_int_eq(c.n_gpus, 3);
	ck_assert(c.gpu_ids[0] == 3 && c.gpu_ids[1] == 1 && c.gpu_ids[2] == 2);
	ck_assert_str_eq(c.gpus, "3 , 1,2");
	ck_assert_int_eq(text("gpus = 1024\n"), -ERANGE);
	ERR_IS("t.conf:1: key 'gpus': GPU 1024 is out of range (0 to 1023)");
	ck_assert_int_eq(text("gpus =\n"), -EINVAL);
	ERR_IS("t.conf:1: key 'gpus': '' is not a list of GPU numbers like 0,1");
	ck_assert_int_eq(c.n_gpus, 3);
}
END_TEST

/* ==== flags ==== */

START_TEST(flag_forms)
{
	ck_assert_int_eq(ARGS("--model", "/m/a", "--kv-cache=8G", "--threads", "4",
			      "--socket=/tmp/s/t.sock", "--log-level", "debug", "--foreground",
			      "--no-mlock", "--io-uring=off", "--quota-weight", "0.5",
			      "--gpus", "1,0"), 0);
	ck_assert_str_eq(err, "");
	ck_assert_str_eq(c.model, "/m/a");
	ck_assert_uint_eq(c.kv_cache, 8ull << 30);
	ck_assert_int_eq(c.threads, 4);
	ck_assert_str_eq(c.socket, "/tmp/s/t.sock");
	ck_assert_str_eq(c.log_level, "debug");
	ck_assert(c.foreground);
	ck_assert(!c.mlock);
	ck_assert(!c.io_uring);
	ck_assert_double_eq(c.quota_weight, 0.5);
	ck_assert_int_eq(c.n_gpus, 2);
	ck_assert(c.gpu_ids[0] == 1 && c.gpu_ids[1] == 0);
	/* a boolean's value only after '=': the next word is not taken */
	ck_assert_int_eq(ARGS("--profile", "--threads=2"), 0);
	ck_assert(c.profile);
	ck_assert_int_eq(c.threads, 2);
	ck_assert_int_eq(ARGS("--profile=no", "--mlock=yes"), 0);
	ck_assert(!c.profile);
	ck_assert(c.mlock);
	/* the value of the spaced form may start with dashes; '=' may be empty */
	ck_assert_int_eq(ARGS("--pid-file", "--x", "--log="), 0);
	ck_assert_str_eq(c.pid_file, "--x");
	ck_assert_str_eq(c.log, "");
	/* no arguments: nothing changes */
	ck_assert_int_eq(ARGS(NULL), 0);
	ck_assert_int_eq(c.threads, 2);
}
END_TEST

START_TEST(flag_errors)
{
	ck_assert_int_eq(ARGS("--bogus"), -EINVAL);
	ERR_IS("unknown option '--bogus' (see --help)");
	ck_assert_int_eq(ARGS("--bogus=1"), -EINVAL);
	ERR_IS("unknown option '--bogus' (see --help)");
	/* flags are spelt with dashes only */
	ck_assert_int_eq(ARGS("--kv_cache", "1G"), -EINVAL);
	ERR_IS("unknown option '--kv_cache' (see --help)");
	/* --no- only for booleans: not taken as the key itself */
	ck_assert_int_eq(ARGS("--no-threads", "5"), -EINVAL);
	ERR_IS("unknown option '--no-threads' (see --help)");
	ck_assert_int_eq(c.threads, 0);
	ck_assert_int_eq(ARGS("--no-log-level"), -EINVAL);
	ERR_IS("unknown option '--no-log-level' (see --help)");
	/* and never with a value */
	ck_assert_int_eq(ARGS("--no-mlock=true"), -EINVAL);
	ERR_IS("unknown option '--no-mlock' (see --help)");
	ck_assert_int_eq(ARGS("model"), -EINVAL);
	ERR_IS("unexpected argument 'model' (options start with --; see --help)");
	ck_assert_int_eq(ARGS("-m", "x"), -EINVAL);
	ERR_IS("unexpected argument '-m' (options start with --; see --help)");
	ck_assert_int_eq(ARGS("--threads", "2", "--kv-cache"), -EINVAL);
	ERR_IS("option '--kv-cache' needs a value");
	ck_assert_int_eq(c.threads, 2);
	ck_assert_int_eq(ARGS("--kv-cache", "8X"), -EINVAL);
	ERR_IS("option '--kv-cache': '8X' is not a size (a number with an optional K, M, G or T "
	       "suffix)");
	ck_assert_int_eq(ARGS("--kv-cache=1K"), -ERANGE);
	ERR_IS("option '--kv-cache': 1K is below the minimum of 4096 bytes");
	ck_assert_int_eq(ARGS("--max-tenants=0"), -ERANGE);
	ERR_IS("option '--max-tenants': 0 is outside [1, 4096]");
	ck_assert_int_eq(ARGS("--foreground=maybe"), -EINVAL);
	ERR_IS("option '--foreground': 'maybe' is not a boolean (true/false, yes/no, on/off, 1/0)");
	ck_assert_int_eq(ARGS("--gpu-sync", "sleep"), -EINVAL);
	ERR_IS("option '--gpu-sync': 'sleep' is not one of auto, spin, yield, block");
	ck_assert_int_eq(ARGS("--resident-experts=-2"), -ERANGE);
	ERR_IS("option '--resident-experts': -2 is outside [-1, 1048576]");
	ck_assert_int_eq(c.resident_experts, -1);
	ck_assert_int_eq(ARGS("--resident-experts", "2"), 0);
	ck_assert_int_eq(c.resident_experts, 2);
	ck_assert_uint_eq(c.kv_cache, 1ull << 30);
}
END_TEST

/* ==== precedence: flag > file > default ==== */

START_TEST(flag_over_file_over_default)
{
	ck_assert_int_eq(ARGS("--kv-cache", "2G", "--no-mlock", "--backend=cpu"), 0);
	ck_assert_int_eq(text("kv_cache = 4G\n"
			      "mlock = true\n"
			      "backend = cuda\n"
			      "threads = 3\n"), 0);
	ck_assert_uint_eq(c.kv_cache, 2ull << 30);	/* the flags' */
	ck_assert(!c.mlock);
	ck_assert_str_eq(c.backend, "cpu");
	ck_assert_int_eq(c.threads, 3);			/* the file's */
	ck_assert_int_eq(c.kv_block_size, 16);		/* the default */
	ck_assert_str_eq(c.log_level, "info");
	/* a key the flags set is not checked in the file either */
	ck_assert_int_eq(text("kv_cache = 12Q\n"), 0);
	ck_assert_uint_eq(c.kv_cache, 2ull << 30);
	/* the last flag of a key wins */
	ck_assert_int_eq(ARGS("--threads=5", "--threads", "6"), 0);
	ck_assert_int_eq(c.threads, 6);
	/* a fresh configuration forgets which keys the flags set */
	mlens_config_free(&c);
	mlens_config_defaults(&c);
	ck_assert_uint_eq(c.kv_cache, 1ull << 30);
	ck_assert_int_eq(text("kv_cache = 4G\n"), 0);
	ck_assert_uint_eq(c.kv_cache, 4ull << 30);
}
END_TEST

/* ==== the file on disk ==== */

static void write_file(const char *path, const void *data, size_t n)
{
	FILE *f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	ck_assert_uint_eq(fwrite(data, 1, n, f), n);
	ck_assert_int_eq(fclose(f), 0);
}

START_TEST(load_file)
{
	char dir[] = "/tmp/check_config.XXXXXX", path[64], missing[64];
	static const char good[] = "# mlensd.conf\nkv_cache = 512M\nthreads = 8\nbogus = 1\n";
	static const char bin[] = "threads = 2\n\0\n";
	char *big;

	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/mlensd.conf", dir);
	snprintf(missing, sizeof(missing), "%s/none.conf", dir);
	write_file(path, good, sizeof(good) - 1);
	/* the error names the file by its path and the line */
	ck_assert_int_eq(mlens_config_load_file(&c, path, err, sizeof(err)), -EINVAL);
	{
		char want[128];
		snprintf(want, sizeof(want), "%s:4: unknown key 'bogus'", path);
		ERR_IS(want);
	}
	ck_assert_uint_eq(c.kv_cache, 512 * MIB);
	ck_assert_int_eq(c.threads, 8);
	ck_assert_int_eq(mlens_config_load_file(&c, missing, err, sizeof(err)), -ENOENT);
	ck_assert_msg(strstr(err, missing) && strstr(err, strerror(ENOENT)), "%s", err);
	write_file(path, bin, sizeof(bin) - 1);
	ck_assert_int_eq(mlens_config_load_file(&c, path, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, path) && strstr(err, "binary data"), "%s", err);
	ck_assert_int_eq(c.threads, 8);
	/* more than 1 MiB of comments */
	big = malloc((1 << 20) + 2);
	ck_assert_ptr_nonnull(big);
	memset(big, '#', (1 << 20) + 1);
	big[(1 << 20) + 1] = '\n';
	write_file(path, big, (1 << 20) + 2);
	free(big);
	ck_assert_int_eq(mlens_config_load_file(&c, path, err, sizeof(err)), -EFBIG);
	ck_assert_msg(strstr(err, path) && strstr(err, "1 MiB"), "%s", err);
	ck_assert_int_eq(unlink(path), 0);
	ck_assert_int_eq(rmdir(dir), 0);
}
END_TEST

/* ==== what is derived ==== */

START_TEST(finish_sockets_beside)
{
	ck_assert_int_eq(ARGS("--socket", "/srv/ml/t.sock"), 0);
	ck_assert_int_eq(mlens_config_finish(&c), 0);
	ck_assert_str_eq(c.control, "/srv/ml/control.sock");
	ck_assert_str_eq(c.stats, "/srv/ml/stats.sock");
	/* given ones are kept; a bare name's directory is "." */
	mlens_config_free(&c);
	mlens_config_defaults(&c);
	ck_assert_int_eq(text("socket = t.sock\ncontrol = /c/ctl\n"), 0);
	ck_assert_int_eq(mlens_config_finish(&c), 0);
	ck_assert_str_eq(c.control, "/c/ctl");
	ck_assert_str_eq(c.stats, "./stats.sock");
	/* the default socket */
	mlens_config_free(&c);
	mlens_config_defaults(&c);
	ck_assert_int_eq(mlens_config_finish(&c), 0);
	ck_assert_str_eq(c.control, "/run/mlens/control.sock");
	ck_assert_str_eq(c.stats, "/run/mlens/stats.sock");
}
END_TEST

/* ==== --help, --version and the dump ==== */

/* What fn writes to stdout, into a new string; *rc its return. */
static char *capture(int (*fn)(void *), void *arg, int *rc)
{
	char path[] = "/tmp/check_config_out.XXXXXX";
	int fd = mkstemp(path), saved;
	FILE *f;
	char *buf;
	long n;

	ck_assert_int_ge(fd, 0);
	fflush(stdout);
	saved = dup(STDOUT_FILENO);
	ck_assert_int_ge(saved, 0);
	ck_assert_int_ge(dup2(fd, STDOUT_FILENO), 0);
	*rc = fn(arg);
	fflush(stdout);
	ck_assert_int_ge(dup2(saved, STDOUT_FILENO), 0);
	close(saved);
	close(fd);
	f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	fseek(f, 0, SEEK_SET);
	buf = calloc(1, (size_t)n + 1);
	ck_assert_ptr_nonnull(buf);
	ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	unlink(path);
	return buf;
}

static int run_args(void *a)
{
	return args_v(a);
}

static int run_dump(void *a)
{
	mlens_config_dump(a, stdout);
	return 0;
}

START_TEST(help_lists_every_key)
{
	const char *const help[] = { "--threads", "3", "--help", "--threads", "x", NULL };
	const char *const version[] = { "-V", NULL };
	int rc;
	char *h = capture(run_args, (void *)help, &rc), *d, *line, *save;
	int keys = 0;

	/* handled at once: what follows is not parsed */
	ck_assert_int_eq(rc, 1);
	ck_assert_int_eq(c.threads, 3);
	ck_assert_ptr_nonnull(strstr(h, "usage: mlensd --model DIR [options]"));
	ck_assert_ptr_nonnull(strstr(h, "-V, --version"));
	/* every key the dump writes is in the help, as a flag with dashes */
	d = capture(run_dump, &c, &rc);
	for (line = strtok_r(d, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char flag[64] = "  --";
		size_t k = strcspn(line, " ");
		ck_assert_uint_lt(k, sizeof(flag) - 6);
		for (size_t j = 0; j < k; j++)
			flag[4 + j] = line[j] == '_' ? '-' : line[j];
		strcpy(flag + 4 + k, " ");
		ck_assert_msg(strstr(h, flag), "--help lacks %s", flag);
		keys++;
	}
	ck_assert_int_ge(keys, 45);
	free(d);
	free(h);
	h = capture(run_args, (void *)version, &rc);
	ck_assert_int_eq(rc, 1);
	ck_assert_str_eq(h, "mlensd " PACKAGE_VERSION "\n");
	free(h);
}
END_TEST

/* The dump, less its "config" line (a file names no other), read back into
 * a fresh configuration gives the same dump. */
START_TEST(dump_reads_back)
{
	int rc;
	char *d1, *d2, *orig, *cfg, *nl;

	ck_assert_int_eq(ARGS("--model=/m", "--kv-cache=3G", "--gpus=2,1", "--quota-weight=0.25",
			      "--no-io-uring", "--numa-node=1", "--backend=cpu"), 0);
	d1 = capture(run_dump, &c, &rc);
	ck_assert_ptr_nonnull(strstr(d1, "kv_cache = 3221225472\n"));
	ck_assert_ptr_nonnull(strstr(d1, "gpus = 2,1\n"));
	ck_assert_ptr_nonnull(strstr(d1, "quota_weight = 0.25\n"));
	ck_assert_ptr_nonnull(strstr(d1, "io_uring = false\n"));
	ck_assert_ptr_nonnull(strstr(d1, "model = /m\n"));
	ck_assert_ptr_nonnull(strstr(d1, "config = \n"));
	orig = strdup(d1);
	ck_assert_ptr_nonnull(orig);
	mlens_config_free(&c);
	mlens_config_defaults(&c);
	cfg = strstr(d1, "config = \n");
	nl = strchr(cfg, '\n');
	memmove(cfg, nl + 1, strlen(nl + 1) + 1);
	ck_assert_msg(text(d1) == 0, "%s", err);
	ck_assert_uint_eq(c.kv_cache, 3ull << 30);
	ck_assert_int_eq(c.n_gpus, 2);
	ck_assert_int_eq(c.numa_node, 1);
	d2 = capture(run_dump, &c, &rc);
	ck_assert_str_eq(d2, orig);
	free(orig);
	free(d1);
	free(d2);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("config");
	TCase *t = tcase_create("config");
	tcase_add_checked_fixture(t, setup, teardown);
	tcase_add_test(t, defaults);
	tcase_add_test(t, file_syntax);
	tcase_add_test(t, file_errors_name_line_and_key);
	tcase_add_test(t, sizes);
	tcase_add_test(t, booleans);
	tcase_add_test(t, integers);
	tcase_add_test(t, choices_and_weights);
	tcase_add_test(t, flag_forms);
	tcase_add_test(t, flag_errors);
	tcase_add_test(t, flag_over_file_over_default);
	tcase_add_test(t, load_file);
	tcase_add_test(t, finish_sockets_beside);
	tcase_add_test(t, help_lists_every_key);
	tcase_add_test(t, dump_reads_back);
	suite_add_tcase(s, t);
	return mlens_check_run(s);
}
