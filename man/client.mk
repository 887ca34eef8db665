# man pages of the client: mlens(1), libmlens(3) and one page per public
# function of mlens.h.
dist_man_MANS += man/mlens.1 man/libmlens.3 man/mlens_open.3 man/mlens_close.3 \
	man/mlens_submit.3 man/mlens_wait.3 man/mlens_poll.3 man/mlens_cancel.3 \
	man/mlens_limits.3 man/mlens_strerror.3 man/mlens_event_strerror.3 man/mlens_fd.3
