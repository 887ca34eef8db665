# daemon/trace.mk: step traces (issue 7): the span recorder and its Chrome
# trace-event JSON writer, armed by mlensctl trace.
daemon_libmlens_core_la_SOURCES += daemon/trace.h daemon/trace.c
