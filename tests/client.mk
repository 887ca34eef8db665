# tests of the client: check_client (library against a fake daemon, JSON
# lines, errors), every public header compiling on its own, and the man
# page linter (every page in man/, when configure found mandoc).
if HAVE_CHECK
check_PROGRAMS += tests/check_client
TESTS += tests/check_client
tests_check_client_SOURCES = tests/check_client.c
tests_check_client_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS) $(JANSSON_CFLAGS)
tests_check_client_LDADD = client/libmlens.la client/libmlens_cli.la shm/libmlens_shm.la \
	$(CHECK_LIBS) $(JANSSON_LIBS) $(PTHREAD_LIBS)
endif

# Each public header compiles alone (as libqb checks): one generated .c
# file per header, holding only its #include.
dist_check_SCRIPTS += tests/headers_alone.sh
TESTS += tests/headers_alone.sh
AM_TESTS_ENVIRONMENT += MLENS_PUBLIC_HEADERS='$(include_HEADERS)'; \
	export MLENS_PUBLIC_HEADERS; CC='$(CC)'; export CC; CXX='$(CXX)'; export CXX;

if HAVE_MANDOC
dist_check_SCRIPTS += tests/man_lint.sh
TESTS += tests/man_lint.sh
AM_TESTS_ENVIRONMENT += MANDOC='$(MANDOC)'; export MANDOC;
endif
