# tests: the performance model's arithmetic and the scheduler under its cap.
if HAVE_CHECK
check_PROGRAMS += tests/check_perfmodel
TESTS += tests/check_perfmodel
tests_check_perfmodel_SOURCES = tests/check_perfmodel.c
tests_check_perfmodel_CFLAGS = $(AM_CFLAGS) $(CHECK_CFLAGS)
tests_check_perfmodel_LDADD = tests/libmlens_testutil.la daemon/tools/libmlens_tools.la daemon/libmlens_core.la $(CHECK_LIBS) -lm
endif
