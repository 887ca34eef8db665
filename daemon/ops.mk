# daemon/ops.mk: operating mlensd: the control socket (mlensctl) and the
# stats socket with the loopback /metrics listener.
daemon_libmlens_core_la_SOURCES += daemon/stats.h daemon/stats.c daemon/control.h daemon/control.c
# one listen / peer-credential helper for the tenant, control and stats sockets
daemon_libmlens_core_la_SOURCES += daemon/listen.h daemon/listen.c
