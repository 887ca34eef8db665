/* mlens-bench: one program, one subcommand per measurement. Each subcommand
 * is a function below, listed in the table in mlens-bench.c; it parses its
 * own arguments, prints JSON with --json (else a short table) and returns
 * an exit status. To add one: declare it here, add a line to the table. */
#ifndef MLENS_BENCH_H
#define MLENS_BENCH_H

#include <stdint.h>

/* argv[0] is the subcommand's name. */
typedef int (*mlens_bench_fn)(int argc, char **argv);

struct mlens_bench_cmd {
	const char *name;
	mlens_bench_fn fn;
	const char *help;	/* one line: arguments and what it measures */
};

/* SPSC ring throughput with polling, and doorbell round-trip latency. */
int mlens_bench_ring(int argc, char **argv);
/* libmlens against a fake daemon: tokens/s and request round trip. */
int mlens_bench_client(int argc, char **argv);

/* A real mlensd driven through libmlens by client threads: tokens/s, time
 * to first token, engine busy; with CUDA, the GEMM/HBM bound (bench_serve.c). */
int mlens_bench_serve(int argc, char **argv);
/* One engine step in this process, op by op, on the CPU or CUDA backend
 * (bench_ops.c). */
int mlens_bench_ops(int argc, char **argv);
/* The hybrid performance model on a recorded profile cache and a model's
 * config.json: n_real and the predicted steady state (bench_predict.c). */
int mlens_bench_predict(int argc, char **argv);

/* libmlens's tokenizer: encode/decode MB/s and tokens/s (bench_tokenizer.c). */
int mlens_bench_tokenizer(int argc, char **argv);

/* ==== Helpers shared by subcommands ==== */

/* Monotonic time in nanoseconds. */
uint64_t mlens_bench_now_ns(void);
/* Parse a count with an optional K/M/G suffix (powers of 1000); -1 if bad. */
long long mlens_bench_parse_count(const char *s);
/* Pin the calling thread to cpu; 0 or -errno. */
int mlens_bench_pin(int cpu);

#endif
