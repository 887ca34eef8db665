/* The option table and the two parsers (flags and file) over it. */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "daemon/config.h"
#include "kernels/backend.h"
#include "daemon/infile.h"

/* T_ENUM: a string that must be one of the words of arg ("a|b|c"). */
enum opt_type { T_STR, T_ENUM, T_INT, T_SIZE, T_BOOL, T_DOUBLE, T_GPUS };

struct opt {
	const char *key;
	enum opt_type type;
	size_t off;
	const char *def;
	int64_t min, max;	/* T_INT, T_SIZE (0,0 = unbounded) */
	const char *arg;	/* metavariable for --help */
	const char *help;
};

#define O(field) offsetof(struct mlens_config, field)
static const struct opt opts[] = {
	{ "config", T_STR, O(config), NULL, 0, 0, "FILE", "read settings from FILE (flags win)" },
	{ "model", T_STR, O(model), NULL, 0, 0, "DIR", "Hugging Face model directory (required)" },
	{ "socket", T_STR, O(socket), "/run/mlens/mlensd.sock", 0, 0, "PATH", "tenant socket" },
	{ "control", T_STR, O(control), "", 0, 0, "PATH", "control socket for mlensctl, mode 0600 (empty: control.sock beside the tenant socket)" },
	{ "control_group", T_STR, O(control_group), "", 0, 0, "GROUP", "group allowed on the control socket (mode 0660)" },
	{ "stats", T_STR, O(stats), "", 0, 0, "PATH", "stats socket, JSON (empty: stats.sock beside the tenant socket)" },
	{ "stats_http", T_STR, O(stats_http), "", 0, 0, "127.0.0.1:PORT", "Prometheus /metrics and /health over HTTP (empty: off)" },
	{ "backend", T_ENUM, O(backend), "auto", 0, 0, "auto|cpu|cuda", "compute backend" },
	{ "weight_dtype", T_ENUM, O(weight_dtype), "auto", 0, 0, "auto|fp8", "expert weights as the files hold them (auto), or quantized to fp8 e4m3 at load with a scale per output channel (a bf16/fp16/fp32 model's experts in half or a quarter of the bytes)" },
	{ "gpu_gemm", T_ENUM, O(gpu_gemm), "fast", 0, 0, "fast|exact", "GEMMs of bf16/f16 weights on the GPU: fast rounds activations to the weight dtype, exact matches the CPU at 3x the tensor-core work" },
	{ "gpu_fp8_gemm", T_ENUM, O(gpu_fp8_gemm), "auto", 0, 0, "auto|fp8|dequant", "fp8 experts on the GPU: auto and fp8 multiply on fp8 tensor cores through cuBLASLt (activations quantized per token, both scales in the GEMM's epilogue) where the scales are per channel, the GEMMs fast, the model 16-bit and the device has them (fp8 says on stderr when it has not), else dequantize; dequant widens each expert to bf16 (fp32 with exact GEMMs or an fp32 model) for the usual GEMMs" },
	{ "gpu_prefill_attention", T_ENUM, O(gpu_prefill_attention), "auto", 0, 0, "auto|fp32|bf16", "prefill attention on the GPU: bf16 runs both products on tensor cores (Q, K, V and the softmax weights rounded to bf16, fp32 sums), fp32 is exact to the CPU's rounding; auto takes bf16 when gpu_gemm is fast and the weights are bf16 or f16" },
	{ "gpu_copy", T_ENUM, O(gpu_copy), "sm", 0, 0, "engine|sm", "who moves activations and small tables between host and GPU on the compute stream: the copy engines, or the GPU's cores through mapped pinned memory (never queued behind the weight stream)" },
	{ "gpu_copy_out", T_ENUM, O(gpu_copy_out), "down", 0, 0, "compute|down|side", "hybrid mode: GA's K/V/q copies to the host and the CPU attention's output back between the compute stream's kernels (compute), the copies to the host on a stream of their own (down), or both directions on streams of their own (side) that overlap the next kernels" },
	{ "kv_append", T_ENUM, O(kv_append), "gpu", 0, 0, "gpu|cpu", "hybrid mode: who writes each token's K and V into the KV pool in host memory: the GPU, through the pool's mapping (registered with the device), or the CPU pool after the K/V come down as fp32 copies" },
	{ "attn_up", T_ENUM, O(attn_up), "half", 0, 0, "half|fp32", "hybrid mode: the CPU attention's output goes up to the GPU in the weights' dtype (half: bf16/f16, half the bytes, where gpu_gemm = fast rounds the O projection's input to that dtype anyway: the same product) or as fp32 (the upload twice the size)" },
	{ "gpu_moe_streams", T_INT, O(gpu_moe_streams), "2", 1, 4, "N", "CUDA streams that the experts of a MoE layer spread over (each with a 32 MiB cuBLAS workspace), so that one expert's GEMM fills the SMs another leaves idle" },
	{ "gpu_moe_grouped", T_ENUM, O(gpu_moe_grouped), "auto", 0, 0, "auto|on|off", "the GEMMs of a MoE layer's experts on the GPU as grouped batched GEMMs (one cuBLAS call for every expert's gate and up, one for down) rather than three GEMMs an expert: auto where at least 16 experts of a chunk have tokens; fast GEMMs on bf16/f16 experts only" },
	{ "gpu_sync", T_ENUM, O(gpu_sync), "auto", 0, 0, "auto|spin|yield|block", "how host threads wait for the GPU: CUDA's heuristic (auto: spin on a machine with more cores than contexts), busy-wait (spin), busy-wait giving way (yield) or sleep (block); hybrid mode with threads = 0 leaves the GPU side a core unless block" },
	{ "host_memory", T_SIZE, O(host_memory), "0", 0, 0, "SIZE", "host memory budget: weight pages and staging first (experts left on disk when the pages do not fit, weights_on_disk), the KV pool the rest up to kv_cache; start-up prints the split and refuses a budget below what the model needs to run (0: no budget, the KV pool is kv_cache)" },
	{ "weights_on_disk", T_ENUM, O(weights_on_disk), "auto", 0, 0, "auto|kv-first|never", "where host_memory cannot hold the weight pages beside staging and the KV pool: leave the last experts of each MoE layer in the model files and read them each step into pinned staging, as few as make the least KV pool fit (auto) or as many as give the KV pool all of kv_cache (kv-first: a larger batch to carry the disk reads), or refuse to start (never)" },
	{ "weights_disk_follow", T_BOOL, O(weights_disk_follow), "true", 0, 0, NULL, "weights on disk: the experts kept in RAM follow the routing, the most-routed of each MoE layer chosen every expert_residency_period steps from halving counts, at most one trade a step between steps (a disk expert read into the page of the RAM expert it replaces); false keeps the last experts of each layer on disk; on the CPU backend only (hybrid mode keeps the split as loaded, GPU-only mode copies every expert to the GPU)" },
	{ "kv_cache", T_SIZE, O(kv_cache), "1G", 4096, 0, "SIZE", "bytes of pinned memory for the KV cache" },
	{ "kv_dtype", T_ENUM, O(kv_dtype), "auto", 0, 0, "auto|bf16|fp32|fp8", "element type of the KV cache: auto (fp32 for an fp32 model, else bf16), or fp8 (e4m3 with a scale per token and KV head), which nearly doubles the tokens kv_cache holds at a small cost in accuracy" },
	{ "kv_block_size", T_INT, O(kv_block_size), "16", 1, 4096, "N", "tokens per KV block" },
	{ "kv_growth_room", T_INT, O(kv_growth_room), "64", 0, 64, "N", "KV blocks of growth room a sequence takes beside its prompt's at admission, up to the length its max_tokens allows: free blocks its own growth takes first (anyone's when nothing else is free), so that its table stays runs of consecutive blocks, which CPU decode attention reads faster (0: none)" },
	{ "kv_swap", T_SIZE, O(kv_swap), "0", 0, 0, "SIZE", "bytes of swap file on disk for the KV of preempted sequences, written out and read back instead of recomputed by a re-prefill where that is cheaper (0: off, every preempted sequence re-prefills)" },
	{ "kv_swap_path", T_STR, O(kv_swap_path), "/var/tmp", 0, 0, "PATH", "where the KV swap file goes: a directory (an unnamed file in it) or a file path that does not exist (created, then unlinked at once); best on NVMe, O_DIRECT where the filesystem allows" },
	{ "kv_swap_policy", T_ENUM, O(kv_swap_policy), "auto", 0, 0, "auto|always|never", "which preempted sequences go to the KV swap file: those for which writing and reading their KV at the disk's rate beats recomputing their tokens at the prefill's (auto), every one the file has room for (always), none (never)" },
	{ "admit_keeps_room", T_BOOL, O(admit_keeps_room), "false", 0, 0, NULL, "admit a prompt only when the free blocks outside the running sequences' growth room hold it, so that no admission takes their room (whole runs of consecutive blocks, at the cost of later admissions)" },
	{ "admit_lookahead", T_INT, O(admit_lookahead), "256", 1, 256, "N", "steps the scheduler looks ahead when it admits a prompt: the running sequences and it must fit the KV pool at each of them, less the blocks of those finished by then (shorter: more admitted at once, and growth past it may preempt)" },
	{ "gpu_memory", T_SIZE, O(gpu_memory), "0", 0, 0, "SIZE", "GPU memory budget of either mode (0: the device's free memory at start-up minus 768 MiB left to the CUDA runtime and cuBLAS)" },
	{ "threads", T_INT, O(threads), "0", 0, 4096, "N", "CPU worker threads (0: all cores of the NUMA node)" },
	{ "numa_node", T_INT, O(numa_node), "-1", -1, 1023, "N", "NUMA node of the pinned pools (-1: the GPU's, else 0)" },
	{ "movers", T_INT, O(movers), "2", 1, 64, "N", "io_uring mover threads that read the model files" },
	{ "max_step_tokens", T_INT, O(max_step_tokens), "0", 0, 1 << 24, "N", "tokens per step, the scheduler's cap (0: 4096; hybrid mode: what the GPU plan holds, up to 65536)" },
	{ "group_tokens", T_INT, O(group_tokens), "3072", 0, 1 << 20, "N", "hybrid mode: rows of a token group (a step runs as groups; activations live for pipeline_sets of them); 0: the plan chooses" },
	{ "pipeline_sets", T_INT, O(pipeline_sets), "3", 2, 3, "N", "hybrid mode: token groups whose activations live at once on the GPU: with 3 the GPU computes a group's q, k and v two groups ahead of the rest of its layer, so the copies down, the CPU attention and its upload hide behind two groups of GPU work rather than one (one more group of activations in the GPU budget)" },
	{ "expert_residency", T_ENUM, O(expert_residency), "auto", 0, 0, "auto|static|routing", "hybrid mode: which experts of a layer stay on the GPU (the plan's count a layer): experts 0..r-1 for good (static), or the most-routed ones by the counts of the steps run, re-chosen every expert_residency_period steps, a few uploads a step (routing; auto: routing)" },
	{ "expert_residency_period", T_INT, O(expert_residency_period), "64", 1, 1 << 20, "STEPS", "hybrid mode: steps between two choices of the resident experts (expert_residency = routing); the counts behind a choice halve at each; also the steps between two choices of the experts kept in RAM (weights_disk_follow)" },
	{ "resident_experts", T_INT, O(resident_experts), "-1", -1, 1 << 20, "N", "hybrid mode: at most N experts of each MoE layer stay on the GPU, the others stream over PCIe every step (fewer when gpu_memory needs); below the model's count it selects hybrid mode where GPU-only would fit; -1: as many as gpu_memory holds beside the step's tokens" },
	{ "weight_piece", T_SIZE, O(weight_piece), "100M", 1 << 20, 0, "SIZE", "hybrid mode: bytes per copy of the streamed experts" },
	{ "foreground", T_BOOL, O(foreground), "false", 0, 0, NULL, "stay in the foreground (no fork)" },
	{ "log_level", T_ENUM, O(log_level), "info", 0, 0, "error|warn|warning|info|debug", "least severe message logged (warning: warn)" },
	{ "log", T_STR, O(log), "stderr", 0, 0, "TARGET", "stderr, syslog or a file path" },
	{ "pid_file", T_STR, O(pid_file), "", 0, 0, "PATH", "write the daemon's pid here" },
	{ "allow_users", T_STR, O(allow_users), "", 0, 0, "LIST", "uids or user names allowed to attach (empty: the daemon's own uid; *: anyone)" },
	{ "allow_groups", T_STR, O(allow_groups), "", 0, 0, "LIST", "gids or group names allowed to attach" },
	{ "max_tenants", T_INT, O(max_tenants), "64", 1, 4096, "N", "tenants attached at once" },
	{ "quota_running", T_INT, O(quota_running), "0", 0, 1 << 20, "N", "default per-tenant running sequences (0: no limit; fair share by weight divides the machine)" },
	{ "quota_kv_blocks", T_INT, O(quota_kv_blocks), "0", 0, 1LL << 32, "N", "default per-tenant KV blocks (0: no limit)" },
	{ "quota_queued", T_INT, O(quota_queued), "0", 0, 1 << 20, "N", "default per-tenant queued requests (0: twice the most sequences the daemon can run at once)" },
	{ "quota_weight", T_DOUBLE, O(quota_weight), "1", 0, 0, "W", "default per-tenant share weight (> 0)" },
	{ "drain_timeout", T_INT, O(drain_timeout), "30", 0, 86400, "SECONDS", "on SIGTERM, time running requests get before they are cancelled" },
	{ "attn_kernel", T_ENUM, O(attn_kernel), "auto", 0, 0, "auto|scalar|avx2|avx512", "CPU decode attention kernel" },
	{ "mlock", T_BOOL, O(mlock), "true", 0, 0, NULL, "lock the pinned pools in memory (fail if it cannot)" },
	{ "io_uring", T_BOOL, O(io_uring), "true", 0, 0, NULL, "read model files with io_uring (false: mmap copy)" },
	{ "gpus", T_GPUS, O(gpus), "0", 0, 0, "LIST", "CUDA devices to serve on, comma-separated (this mlensd serves on one)" },
	{ "op_timing", T_BOOL, O(op_timing), "false", 0, 0, NULL, "time each op of every step on the compute queue with the backend's timing marks, read after the step with no wait inside it; the stats' gpu_ops and the metrics' mlens_gpu_op_seconds_total" },
	{ "profile", T_BOOL, O(profile), "false", 0, 0, NULL, "profile the machine at start-up and set the token cap from n_real" },
	{ "profile_cache", T_STR, O(profile_cache), "", 0, 0, "PATH", "JSON file of profile results, reused while model, backend, GPU and budget match (empty: none)" },
	{ "workload_follow", T_INT, O(workload_follow), "30", 0, 86400, "SECONDS", "with a profile: every this often, predict for the mean lengths of the requests finished since and set the cap from that n_real when they moved by more than 10% (0: keep the workload the profile was made for)" },
};
#undef O
#define N_OPTS (sizeof(opts) / sizeof(opts[0]))

/* keys set on the command line (bit i = opts[i]) */
static uint64_t set_by_flag;
_Static_assert(N_OPTS <= 64, "set_by_flag holds one bit per key");

int mlens_parse_size(const char *s, uint64_t *out)
{
	char *end;
	double v;
	uint64_t mul = 1;
	while (isspace((unsigned char)*s))
		s++;
	if (!isdigit((unsigned char)*s))
		return -EINVAL;
	errno = 0;
	v = strtod(s, &end);
	if (errno || end == s)
		return -EINVAL;
	switch (toupper((unsigned char)*end)) {
	case 'K': mul = 1ull << 10; end++; break;
	case 'M': mul = 1ull << 20; end++; break;
	case 'G': mul = 1ull << 30; end++; break;
	case 'T': mul = 1ull << 40; end++; break;
	default: break;
	}
	if (mul > 1 && (*end == 'i' || *end == 'I'))
		end++;
	if (*end == 'B' || *end == 'b')
		end++;
	while (isspace((unsigned char)*end))
		end++;
	if (*end)
		return -EINVAL;
	v *= (double)mul;
	if (!(v >= 0) || v >= 18446744073709551615.0)
		return -ERANGE;
	*out = (uint64_t)v;
	return 0;
}

int mlens_parse_gpus(const char *s, int *ids, int max, char *why, size_t whylen)
{
	const char *p = s;
	int n = 0;
	for (;;) {
		char *end;
		long v;
		while (isspace((unsigned char)*p))
			p++;
		if (!isdigit((unsigned char)*p)) {
			snprintf(why, whylen, "'%s' is not a list of GPU numbers like 0,1", s);
			return -EINVAL;
		}
		errno = 0;
		v = strtol(p, &end, 10);
		if (errno || v > 1023) {
			snprintf(why, whylen, "GPU %.*s is out of range (0 to 1023)", (int)(end - p), p);
			return -ERANGE;
		}
		for (int i = 0; i < n; i++)
			if (ids[i] == (int)v) {
				snprintf(why, whylen, "GPU %ld is listed twice", v);
				return -EINVAL;
			}
		if (n == max) {
			snprintf(why, whylen, "more than %d GPUs listed", max);
			return -ERANGE;
		}
		ids[n++] = (int)v;
		p = end;
		while (isspace((unsigned char)*p))
			p++;
		if (!*p)
			return n;
		if (*p != ',') {
			snprintf(why, whylen, "'%s' is not a list of GPU numbers like 0,1", s);
			return -EINVAL;
		}
		p++;
	}
}

/* Whether val is one of the words of choices ("a|b|c"). */
static bool is_choice(const char *choices, const char *val)
{
	size_t n = strlen(val);
	for (const char *w = choices;; ) {
		const char *bar = strchr(w, '|');
		size_t len = bar ? (size_t)(bar - w) : strlen(w);
		if (len == n && !strncmp(w, val, n))
			return true;
		if (!bar)
			return false;
		w = bar + 1;
	}
}

static int set_value(struct mlens_config *c, const struct opt *o, const char *val,
		     char *why, size_t whylen)
{
	void *p = (char *)c + o->off;
	char *end;
	switch (o->type) {
	case T_ENUM:
		if (!is_choice(o->arg, val)) {
			char list[128];
			size_t j = 0;
			for (const char *a = o->arg; *a && j + 3 < sizeof(list); a++) {
				if (*a == '|') {
					list[j++] = ',';
					list[j++] = ' ';
				} else {
					list[j++] = *a;
				}
			}
			list[j] = 0;
			snprintf(why, whylen, "'%s' is not one of %s", val, list);
			return -EINVAL;
		}
		__attribute__((fallthrough));	/* stored as a string */
	case T_STR: {
		char *d = strdup(val);
		if (!d)
			return -ENOMEM;
		free(*(char **)p);
		*(char **)p = d;
		return 0;
	}
	case T_GPUS: {
		int ids[MLENS_CONFIG_MAX_GPUS], n = mlens_parse_gpus(val, ids, MLENS_CONFIG_MAX_GPUS, why, whylen);
		char *d;
		if (n < 0)
			return n;
		if (!(d = strdup(val)))
			return -ENOMEM;
		free(*(char **)p);
		*(char **)p = d;
		memcpy(c->gpu_ids, ids, (size_t)n * sizeof(ids[0]));
		c->n_gpus = n;
		return 0;
	}
	case T_INT: {
		long long v;
		errno = 0;
		v = strtoll(val, &end, 10);
		if (errno || end == val || *end) {
			snprintf(why, whylen, "'%s' is not an integer", val);
			return -EINVAL;
		}
		if ((o->min || o->max) && (v < o->min || v > o->max)) {
			snprintf(why, whylen, "%lld is outside [%lld, %lld]", v, (long long)o->min,
				 (long long)o->max);
			return -ERANGE;
		}
		*(int64_t *)p = v;
		return 0;
	}
	case T_SIZE: {
		uint64_t v;
		if (mlens_parse_size(val, &v)) {
			snprintf(why, whylen, "'%s' is not a size (a number with an optional K, M, G or T suffix)", val);
			return -EINVAL;
		}
		if (o->min && v < (uint64_t)o->min) {
			snprintf(why, whylen, "%s is below the minimum of %lld bytes", val, (long long)o->min);
			return -ERANGE;
		}
		*(uint64_t *)p = v;
		return 0;
	}
	case T_BOOL:
		if (!strcmp(val, "true") || !strcmp(val, "yes") || !strcmp(val, "on") || !strcmp(val, "1"))
			*(bool *)p = true;
		else if (!strcmp(val, "false") || !strcmp(val, "no") || !strcmp(val, "off") || !strcmp(val, "0"))
			*(bool *)p = false;
		else {
			snprintf(why, whylen, "'%s' is not a boolean (true/false, yes/no, on/off, 1/0)", val);
			return -EINVAL;
		}
		return 0;
	case T_DOUBLE: {
		double v;
		errno = 0;
		v = strtod(val, &end);
		if (errno || end == val || *end || !isfinite(v) || v <= 0) {
			snprintf(why, whylen, "'%s' is not a positive number", val);
			return -EINVAL;
		}
		*(double *)p = v;
		return 0;
	}
	}
	return -EINVAL;
}

void mlens_config_defaults(struct mlens_config *c)
{
	char why[128];
	memset(c, 0, sizeof(*c));
	for (size_t i = 0; i < N_OPTS; i++)
		if (opts[i].def)
			set_value(c, &opts[i], opts[i].def, why, sizeof(why));
	set_by_flag = 0;
}

void mlens_config_free(struct mlens_config *c)
{
	for (size_t i = 0; i < N_OPTS; i++)
		if (opts[i].type == T_STR || opts[i].type == T_ENUM || opts[i].type == T_GPUS) {
			char **p = (char **)((char *)c + opts[i].off);
			free(*p);
			*p = NULL;
		}
}

/* Key as written in a file: underscores; flags use dashes for the same. */
static const struct opt *find(const char *name, size_t len, bool dashes)
{
	for (size_t i = 0; i < N_OPTS; i++) {
		const char *k = opts[i].key;
		size_t j;
		if (strlen(k) != len)
			continue;
		for (j = 0; j < len; j++) {
			char a = name[j];
			if (dashes && a == '-')
				a = '_';
			else if (dashes && a == '_')
				break;	/* flags are spelled with dashes only */
			if (a != k[j])
				break;
		}
		if (j == len)
			return &opts[i];
	}
	return NULL;
}

void mlens_config_usage(FILE *f)
{
	fprintf(f, "usage: mlensd --model DIR [options]\n\noptions (each also a key in mlensd.conf, with _ for -):\n");
	for (size_t i = 0; i < N_OPTS; i++) {
		char flag[64], name[40];
		size_t j;
		for (j = 0; opts[i].key[j] && j < sizeof(name) - 1; j++)
			name[j] = opts[i].key[j] == '_' ? '-' : opts[i].key[j];
		name[j] = 0;
		snprintf(flag, sizeof(flag), "--%s%s%s", name, opts[i].arg ? " " : "",
			 opts[i].arg ? opts[i].arg : "");
		fprintf(f, "  %-36s %s", flag, opts[i].help);
		if (opts[i].def && opts[i].def[0])
			fprintf(f, " [%s]", opts[i].def);
		fputc('\n', f);
	}
	fprintf(f, "  %-36s %s\n  %-36s %s\n", "-h, --help", "this help", "-V, --version", "print the version");
}

int mlens_config_parse_args(struct mlens_config *c, int argc, char **argv, char *err, size_t errlen)
{
	char why[256];
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *val = NULL, *eq;
		const struct opt *o;
		size_t len;
		int rc;
		if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
			mlens_config_usage(stdout);
			return 1;
		}
		if (!strcmp(a, "-V") || !strcmp(a, "--version")) {
			printf("mlensd %s\n", PACKAGE_VERSION);
			return 1;
		}
		if (strncmp(a, "--", 2)) {
			snprintf(err, errlen, "unexpected argument '%s' (options start with --; see --help)", a);
			return -EINVAL;
		}
		a += 2;
		eq = strchr(a, '=');
		len = eq ? (size_t)(eq - a) : strlen(a);
		o = find(a, len, true);
		if (!o && !eq && !strncmp(a, "no-", 3)) {
			/* --no-KEY: false, for booleans only */
			const struct opt *b = find(a + 3, len - 3, true);
			if (b && b->type == T_BOOL) {
				o = b;
				val = "false";
			}
		}
		if (!o) {
			snprintf(err, errlen, "unknown option '--%.*s' (see --help)", (int)len, a);
			return -EINVAL;
		}
		if (!val) {
			if (eq)
				val = eq + 1;
			else if (o->type == T_BOOL)
				val = "true";
			else if (i + 1 < argc)
				val = argv[++i];
			else {
				snprintf(err, errlen, "option '--%.*s' needs a value", (int)len, a);
				return -EINVAL;
			}
		}
		rc = set_value(c, o, val, why, sizeof(why));
		if (rc) {
			snprintf(err, errlen, "option '--%.*s': %s", (int)len, a, why);
			return rc;
		}
		set_by_flag |= 1ull << (o - opts);
	}
	return 0;
}

int mlens_config_load_text(struct mlens_config *c, const char *text, const char *name,
			   char *err, size_t errlen)
{
	const char *line = text;
	int lineno = 0;
	char why[256];
	while (*line) {
		const char *nl = strchr(line, '\n');
		size_t len = nl ? (size_t)(nl - line) : strlen(line);
		char buf[4096], *k, *v, *e, *hash;
		const struct opt *o;
		int rc;
		lineno++;
		if (len >= sizeof(buf)) {
			snprintf(err, errlen, "%s:%d: line too long", name, lineno);
			return -EINVAL;
		}
		memcpy(buf, line, len);
		buf[len] = 0;
		line = nl ? nl + 1 : line + len;
		if ((hash = strchr(buf, '#')))
			*hash = 0;
		k = buf;
		while (isspace((unsigned char)*k))
			k++;
		if (!*k)
			continue;
		v = strchr(k, '=');
		if (!v) {
			snprintf(err, errlen, "%s:%d: expected 'key = value'", name, lineno);
			return -EINVAL;
		}
		e = v;
		while (e > k && isspace((unsigned char)e[-1]))
			e--;
		*e = 0;
		v++;
		while (isspace((unsigned char)*v))
			v++;
		e = v + strlen(v);
		while (e > v && isspace((unsigned char)e[-1]))
			*--e = 0;
		if (e - v >= 2 && v[0] == '"' && e[-1] == '"') {
			e[-1] = 0;
			v++;
		}
		o = find(k, strlen(k), false);
		if (!o || !strcmp(o->key, "config")) {
			snprintf(err, errlen, "%s:%d: unknown key '%s'", name, lineno, k);
			return -EINVAL;
		}
		if (set_by_flag & (1ull << (o - opts)))
			continue;	/* the flag wins */
		rc = set_value(c, o, v, why, sizeof(why));
		if (rc) {
			snprintf(err, errlen, "%s:%d: key '%s': %s", name, lineno, k, why);
			return rc;
		}
	}
	return 0;
}

/* PATH's directory + "/" + name, into a new string. */
static char *beside(const char *path, const char *name)
{
	const char *slash = strrchr(path, '/');
	size_t dl = slash ? (size_t)(slash - path) : 1;
	char *r = malloc(dl + strlen(name) + 2);
	if (!r)
		return NULL;
	if (slash)
		memcpy(r, path, dl);
	else
		r[0] = '.';
	r[dl] = '/';
	strcpy(r + dl + 1, name);
	return r;
}

int mlens_config_finish(struct mlens_config *c)
{
	if (!c->control[0]) {
		free(c->control);
		if (!(c->control = beside(c->socket, "control.sock")))
			return -ENOMEM;
	}
	if (!c->stats[0]) {
		free(c->stats);
		if (!(c->stats = beside(c->socket, "stats.sock")))
			return -ENOMEM;
	}
	return 0;
}

int mlens_config_load_file(struct mlens_config *c, const char *path, char *err, size_t errlen)
{
	struct stat sb;
	int fd = mlens_open_regular(path, " config file", &sb, err, errlen);
	FILE *f;
	char *text;
	long n;
	int rc;
	if (fd < 0)
		return fd;
	f = fdopen(fd, "r");
	if (!f) {
		rc = -errno;
		close(fd);
		snprintf(err, errlen, "%s: %s", path, strerror(-rc));
		return rc;
	}
	fseek(f, 0, SEEK_END);
	n = ftell(f);
	fseek(f, 0, SEEK_SET);
	if (n < 0 || n > (1 << 20)) {
		fclose(f);
		snprintf(err, errlen, "%s: not a regular file of at most 1 MiB", path);
		return -EFBIG;
	}
	text = malloc((size_t)n + 1);
	if (!text) {
		fclose(f);
		return -ENOMEM;
	}
	n = (long)fread(text, 1, (size_t)n, f);
	text[n] = 0;
	fclose(f);
	if (memchr(text, 0, (size_t)n)) {
		free(text);
		snprintf(err, errlen, "%s: binary data in a config file", path);
		return -EINVAL;
	}
	rc = mlens_config_load_text(c, text, path, err, errlen);
	free(text);
	return rc;
}

void mlens_config_dump(const struct mlens_config *c, FILE *f)
{
	for (size_t i = 0; i < N_OPTS; i++) {
		const void *p = (const char *)c + opts[i].off;
		fprintf(f, "%s = ", opts[i].key);
		switch (opts[i].type) {
		case T_STR:
		case T_ENUM:
		case T_GPUS: fprintf(f, "%s\n", *(char *const *)p ? *(char *const *)p : ""); break;
		case T_INT: fprintf(f, "%lld\n", (long long)*(const int64_t *)p); break;
		case T_SIZE: fprintf(f, "%llu\n", (unsigned long long)*(const uint64_t *)p); break;
		case T_BOOL: fprintf(f, "%s\n", *(const bool *)p ? "true" : "false"); break;
		case T_DOUBLE: fprintf(f, "%g\n", *(const double *)p); break;
		}
	}
}

void mlens_config_backend_opts(const struct mlens_config *c, bool f32_model, struct mlens_backend_opts *bo)
{
	mlens_gemm_mode_parse(c->gpu_gemm, &bo->gemm);	/* one of its names (config) */
	/* auto: tensor cores where the fast GEMMs already round activations
	 * to 16 bits; an fp32 model or exact GEMMs keep fp32 attention */
	bo->prefill_bf16 = !strcmp(c->gpu_prefill_attention, "bf16") ||
			   (!strcmp(c->gpu_prefill_attention, "auto") && bo->gemm == MLENS_GEMM_FAST && !f32_model);
	bo->sm_copy = !strcmp(c->gpu_copy, "sm");
	bo->fp8_gemm = !strcmp(c->gpu_fp8_gemm, "fp8")	    ? MLENS_FP8_GEMM_FP8
		       : !strcmp(c->gpu_fp8_gemm, "dequant") ? MLENS_FP8_GEMM_DEQUANT
							: MLENS_FP8_GEMM_AUTO;
	bo->moe_streams = (int)c->gpu_moe_streams;
	mlens_moe_grouped_parse(c->gpu_moe_grouped, &bo->moe_grouped);	/* one of its names (config) */
	mlens_gpu_sync_parse(c->gpu_sync, &bo->sync);	/* one of its names (config) */
}
