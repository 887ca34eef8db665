/* mlens-bench: dispatches to the subcommand named by argv[1] and holds the
 * helpers subcommands share. */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "tests/bench/bench.h"
#include "tests/bench/bench_attention.h"

static const struct mlens_bench_cmd cmds[] = {
	{ "ring", mlens_bench_ring,
	  "[--json] [--entries N] [--batch B] [--repeat K] [--round-trips R]: SPSC "
	  "ring entries/s "
	  "between two processes, and eventfd doorbell round-trip latency" },
	{ "serve", mlens_bench_serve,
	  "--model DIR [--mlensd PATH] [--backend B] [--kv-cache SIZE] [--gpu-memory SIZE] "
	  "[--prompt-len P|LO:HI] [--gen-len G|LO:HI] [--lengths FILE] [--seed S] [--requests N] "
	  "[--concurrency C] [--threads T] [--json]: "
	  "a real mlensd through libmlens: tokens/s, time to first token, engine busy; with "
	  "CUDA the GEMM rate, HBM bandwidth and the bound they set" },
	{ "ops", mlens_bench_ops,
	  "--model DIR [--backend B] [--prompt-len P] [--prompts K] [--decode D] [--context C] "
	  "[--steps N] [--waits] [--json]: one engine step op by op (GEMMs by shape and their TFLOP/s, MoE, "
	  "norms, RoPE, attention, K/V stores, lm_head, sampling, the rest as launch gaps)" },
	{ "attention", mlens_bench_attention,
	  "[--json] [--threads LIST] [--seqs N] [--min-ctx A --max-ctx B] [--variant V]: CPU decode "
	  "attention KV GB/s per variant and thread count, next to the measured read bandwidth" },
	{ "predict", mlens_bench_predict,
	  "--config FILE --profile FILE [--gpu-memory SIZE] [--kv-cache SIZE] [--group-tokens N] "
	  "[--prompt-len P] [--gen-len G] [--cap N] [--in-flight S] [--no-shared-io] [--gpu-copy-out compute|down|side] [--kv-append gpu|cpu] [--attn-up half|fp32] [--pipeline-sets 2|3] "
	  "[--json]: the daemon's "
	  "performance model replayed on a recorded profile cache (no GPU, no weights)" },
	{ "tokenizer", mlens_bench_tokenizer,
	  "--model DIR [--input FILE] [--bytes N] [--chunk N] [--json]: the tokenizer on one "
	  "thread: encode and decode MB/s and tokens/s over a file or generated English-like text" },
	{ "client", mlens_bench_client,
	  "[--json] [--requests N] [--max-tokens T] [--inflight I]: libmlens tokens/s and "
	  "request round trip against a fake daemon" },
};

static void usage(FILE *f)
{
	fprintf(f, "usage: mlens-bench COMMAND [ARGS]\n\ncommands:\n");
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
		fprintf(f, "  %-10s %s\n", cmds[i].name, cmds[i].help);
}

uint64_t mlens_bench_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

long long mlens_bench_parse_count(const char *s)
{
	char *end;
	long long v;

	errno = 0;
	v = strtoll(s, &end, 10);
	if (errno || end == s || v < 0)
		return -1;
	switch (*end) {
	case 'k': case 'K': v *= 1000; end++; break;
	case 'm': case 'M': v *= 1000000; end++; break;
	case 'g': case 'G': v *= 1000000000; end++; break;
	default: break;
	}
	return *end ? -1 : v;
}

int mlens_bench_pin(int cpu)
{
	cpu_set_t set;

	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	return sched_setaffinity(0, sizeof(set), &set) ? -errno : 0;
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		usage(stderr);
		return 2;
	}
	if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
		usage(stdout);
		return 0;
	}
	for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
		if (!strcmp(argv[1], cmds[i].name))
			return cmds[i].fn(argc - 1, argv + 1);
	fprintf(stderr, "mlens-bench: unknown command '%s'; run mlens-bench --help for the list\n",
		argv[1]);
	return 2;
}
