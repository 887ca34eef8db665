# daemon/serve: serving tenants: the tenant socket and event loop, attached
# tenants, the worker thread and the scheduler.
daemon_libmlens_core_la_SOURCES += daemon/serve/server.h daemon/serve/server.c \
	daemon/serve/tenant.h daemon/serve/tenant.c \
	daemon/serve/worker.h daemon/serve/worker.c \
	daemon/serve/sched.h daemon/serve/sched.c
