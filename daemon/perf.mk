# daemon: the performance model (issue 8), pure arithmetic in the core library.
daemon_libmlens_core_la_SOURCES += daemon/perfmodel.h daemon/perfmodel.c
