# tests: the hybrid pipeline on the CPU, one program per part: its GPU
# memory plan (daemon/plan/gpu_plan.c, GPU-only mode too), its step program (daemon/exec/pipeprog.c) and
# its executor (daemon/exec/pipeline.c)
if HAVE_CHECK
check_PROGRAMS += tests/check_plan tests/check_stepprog tests/check_pipeline
TESTS += tests/check_plan tests/check_stepprog tests/check_pipeline
tests_check_plan_SOURCES = tests/check_plan.c tests/check_common.h
tests_check_plan_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_plan_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS) -lm
tests_check_stepprog_SOURCES = tests/check_stepprog.c tests/check_common.h
tests_check_stepprog_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_stepprog_LDADD = daemon/libmlens_core.la $(CHECK_LIBS)
tests_check_pipeline_SOURCES = tests/check_pipeline.c tests/check_common.h
tests_check_pipeline_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_pipeline_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS) -lm
endif

# the golden checks through the hybrid pipeline (tests/golden/golden.c
# knows the backend names "hybrid" and "hybrid-cpu")
EXTRA_DIST += tests/golden/check_golden_hybrid.sh tests/golden/check_golden_hybrid_cpu.sh
if HAVE_CHECK
TESTS += tests/golden/check_golden_hybrid_cpu.sh
if HAVE_CUDA
TESTS += tests/golden/check_golden_hybrid.sh
endif
endif

# the pipeline on the GPU against the GPU-only engine, budget checked
# against cudaMemGetInfo (exits 77 without a GPU); its benchmark (JSON)
EXTRA_DIST += tests/check_hybrid_cuda.c tests/bench/bench_hybrid.c
if HAVE_CUDA
if HAVE_CHECK
check_PROGRAMS += tests/check_hybrid_cuda
TESTS += tests/check_hybrid_cuda
tests_check_hybrid_cuda_SOURCES = tests/check_hybrid_cuda.c tests/gpulock.h
tests_check_hybrid_cuda_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(CUDA_CFLAGS)
tests_check_hybrid_cuda_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS) $(CUDA_LIBS) -lm
# the same in groups of 16 rows, fp32 models (see MLENS_TEST_SMALL_GROUPS
# in the source: why not bf16)
check_PROGRAMS += tests/check_hybrid_cuda_groups
TESTS += tests/check_hybrid_cuda_groups
tests_check_hybrid_cuda_groups_SOURCES = tests/check_hybrid_cuda.c tests/gpulock.h
tests_check_hybrid_cuda_groups_CPPFLAGS = $(AM_CPPFLAGS) -DMLENS_TEST_SMALL_GROUPS
tests_check_hybrid_cuda_groups_CFLAGS = $(tests_check_hybrid_cuda_CFLAGS)
tests_check_hybrid_cuda_groups_LDADD = $(tests_check_hybrid_cuda_LDADD)
endif
noinst_PROGRAMS += tests/bench/bench_hybrid
tests_bench_bench_hybrid_SOURCES = tests/bench/bench_hybrid.c
tests_bench_bench_hybrid_CFLAGS = $(AM_CFLAGS) $(CUDA_CFLAGS)
tests_bench_bench_hybrid_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CUDA_LIBS) -lm
endif
