# tests of the client: check_client (library against a fake daemon, JSON
# lines, errors), every public header compiling on its own, and the man
# page linter (every page in man/, when configure found mandoc).
# The fake mlensd that check_client and mlens-bench client run libmlens
# against.
noinst_LTLIBRARIES += tests/libmlens_fake.la
tests_libmlens_fake_la_SOURCES = tests/fake_mlensd.h tests/fake_mlensd.c
tests_libmlens_fake_la_LIBADD = shm/libmlens_shm.la

if HAVE_CHECK
check_PROGRAMS += tests/check_client
TESTS += tests/check_client
tests_check_client_SOURCES = tests/check_client.c
tests_check_client_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_client_LDADD = client/libmlens_cli.la client/libmlens.la tests/libmlens_fake.la \
	$(CHECK_LIBS) $(JANSSON_LIBS) $(PTHREAD_LIBS)
endif

# mlens generate against a real mlensd: EOS, in-flight defaults, SIGINT.
dist_check_SCRIPTS += tests/integration/generate.sh
TESTS += tests/integration/generate.sh
# mlens generate --model with text: prompts, chats, stop strings, --stream,
# OpenAI batch lines (the byte-level tokenizer fixture over a tiny model).
dist_check_SCRIPTS += tests/integration/generate_text.sh
TESTS += tests/integration/generate_text.sh

# kv_dtype = fp8 through a real mlensd: capacity, status, sane generation.
dist_check_SCRIPTS += tests/integration/kv_fp8.sh
TESTS += tests/integration/kv_fp8.sh
# mlens-kvcompare's matrix: fp8 weights, fp8 KV and both against bf16.
dist_check_SCRIPTS += tests/integration/fp8_accuracy.sh
TESTS += tests/integration/fp8_accuracy.sh

# Each public header compiles alone (as libqb checks): a .c file holding
# only its #include, compiled as C99 and as C++.
dist_check_SCRIPTS += tests/headers_alone.sh
TESTS += tests/headers_alone.sh
AM_TESTS_ENVIRONMENT += MLENS_PUBLIC_HEADERS='$(include_HEADERS)'; \
	export MLENS_PUBLIC_HEADERS; CC='$(CC)'; export CC; CXX='$(CXX)'; export CXX;

if HAVE_MANDOC
AM_TESTS_ENVIRONMENT += MANDOC='$(MANDOC)'; export MANDOC;
endif

# mlens-bench client: libmlens against the fake daemon.
tests_bench_mlens_bench_SOURCES += tests/bench/bench_client.c
tests_bench_mlens_bench_LDADD += client/libmlens.la tests/libmlens_fake.la
