# daemon/ops: operating mlensd: the control socket (mlensctl), the stats
# socket with the loopback /metrics listener, step traces, and the listen /
# peer-credential helper the tenant, control and stats sockets share.
daemon_libmlens_core_la_SOURCES += daemon/ops/control.h daemon/ops/control.c \
	daemon/ops/stats.h daemon/ops/stats.c \
	daemon/ops/trace.h daemon/ops/trace.c \
	daemon/ops/listen.h daemon/ops/listen.c
