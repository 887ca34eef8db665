/* mlens-bench attention: decode attention throughput of each CPU kernel
 * variant and thread count, next to the machine's read bandwidth. */
#ifndef MLENS_BENCH_ATTENTION_H
#define MLENS_BENCH_ATTENTION_H

/* argv[0] is the subcommand's name; returns the process exit status. */
int mlens_bench_attention(int argc, char **argv);

#endif
