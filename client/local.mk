# client: libmlens.so (public header mlens.h, pkg-config file mlens.pc),
# the mlens batch CLI, and an example program built by make check.
lib_LTLIBRARIES += client/libmlens.la
include_HEADERS += client/mlens.h
client_libmlens_la_SOURCES = client/libmlens.c
client_libmlens_la_CFLAGS = $(AM_CFLAGS)
client_libmlens_la_LIBADD = shm/libmlens_shm.la $(PTHREAD_LIBS)
# The tokenizer (client/mlens_tokenizer.h): tokenizer.json through jansson,
# regexes through PCRE2, Unicode normalization through utf8proc.
include_HEADERS += client/mlens_tokenizer.h
client_libmlens_la_SOURCES += client/tokenizer_int.h client/tokenizer.c \
	client/tokenizer_encode.c client/tokenizer_decode.c
client_libmlens_la_CFLAGS += $(JANSSON_CFLAGS) $(PCRE2_CFLAGS) $(UTF8PROC_CFLAGS)
client_libmlens_la_LIBADD += $(JANSSON_LIBS) $(PCRE2_LIBS) $(UTF8PROC_LIBS)
client_libmlens_la_LDFLAGS = $(AM_LDFLAGS) -no-undefined \
	-version-info @LIBMLENS_LT_VERSION@ \
	-Wl,--version-script=$(top_srcdir)/client/libmlens.map
EXTRA_client_libmlens_la_DEPENDENCIES = client/libmlens.map
EXTRA_DIST += client/libmlens.map

pkgconfigdir = $(libdir)/pkgconfig
pkgconfig_DATA = client/mlens.pc
DISTCLEANFILES += client/mlens.pc

# Text generation's text side (client/textgen.h: a model directory's
# tokenizer and chat template, generated text cut at stop strings), one
# module for mlens generate and mlens-gateway alike.
noinst_LTLIBRARIES += client/libmlens_textgen.la
client_libmlens_textgen_la_SOURCES = client/textgen.h client/textgen.c
client_libmlens_textgen_la_LIBADD = client/libmlens.la

# The CLI's JSON lines (parsing requests and OpenAI batch lines, writing
# results) and its text side (prompts and generated text through the
# model's tokenizer) live in a small library of their own so that
# tests/check_client can exercise them.
noinst_LTLIBRARIES += client/libmlens_cli.la
client_libmlens_cli_la_SOURCES = client/cli_int.h client/cli_json.c client/cli_batch.c \
	client/cli_model.c
client_libmlens_cli_la_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
client_libmlens_cli_la_LIBADD = client/libmlens_textgen.la client/libmlens.la $(JANSSON_LIBS)

bin_PROGRAMS += client/mlens
client_mlens_SOURCES = client/mlens_cli.c client/cli_text.c
client_mlens_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
client_mlens_LDADD = client/libmlens_cli.la client/libmlens.la $(JANSSON_LIBS) -lm

check_PROGRAMS += client/example
client_example_SOURCES = client/example.c
client_example_LDADD = client/libmlens.la
