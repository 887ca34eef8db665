# GPU-only mode's measurement: the `mlens-bench serve` subcommand that
# drives a real mlensd (the memory plan's unit test is tests/check_plan,
# in tests/hybrid.mk).

tests_bench_mlens_bench_SOURCES += tests/bench/bench_serve.c tests/bench/bench_ops.c
tests_bench_mlens_bench_CFLAGS += $(JANSSON_CFLAGS)
tests_bench_mlens_bench_LDADD += daemon/libmlens_core.la $(JANSSON_LIBS) -lm
if HAVE_CUDA
tests_bench_mlens_bench_CFLAGS += $(CUDA_CFLAGS)
tests_bench_mlens_bench_LDADD += $(CUDA_LIBS)
endif

EXTRA_DIST += tests/bench/serve_gpu.sh
# mlens-bench serve stopped by a signal mid-run (CPU backend)
dist_check_SCRIPTS += tests/integration/bench_stop.sh
TESTS += tests/integration/bench_stop.sh
# mlens-bench serve with mixed lengths: ranges, a lengths file, the step distribution
dist_check_SCRIPTS += tests/integration/bench_mix.sh
TESTS += tests/integration/bench_mix.sh
# the scheduler keeps steps full through a mixed job; serve's job sizing (--pool-fulls)
dist_check_SCRIPTS += tests/integration/sched_ramp.sh
TESTS += tests/integration/sched_ramp.sh
# mlens-bench ops: one engine step op by op (CPU backend)
dist_check_SCRIPTS += tests/integration/bench_ops.sh
TESTS += tests/integration/bench_ops.sh
EXTRA_DIST += tests/bench/hybrid.sh tests/bench/hf_baseline.py tests/bench/nreal_sweep.sh \
	tests/bench/gpu_session.sh tests/bench/kvpool.sh tests/bench/trace_summary.py tests/bench/ab.sh \
	tests/bench/defaults.sh tests/bench/metrics_rate.py tests/bench/jobs.py tests/bench/RESULTS.md
