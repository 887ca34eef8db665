/* Stand-alone front end of the attention benchmark until mlens-bench's
 * subcommand table takes it. */
#include "tests/bench/bench_attention.h"

int main(int argc, char **argv)
{
	return mlens_bench_attention(argc, argv);
}
