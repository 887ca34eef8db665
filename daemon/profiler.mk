# daemon/profiler.mk: the pipeline profiler (issue 8): timings through the
# real backends, the JSON cache, the daemon's profile state.
daemon_libmlens_core_la_SOURCES += daemon/profiler.h daemon/profiler.c
