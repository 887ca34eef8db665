# client/mlensctl.mk: mlensctl, the control socket's command-line client.
sbin_PROGRAMS += client/mlensctl
client_mlensctl_SOURCES = client/mlensctl.c
client_mlensctl_CFLAGS = $(AM_CFLAGS) $(JANSSON_CFLAGS)
client_mlensctl_LDADD = $(JANSSON_LIBS)
