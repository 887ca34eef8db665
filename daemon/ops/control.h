/* The control socket for mlensctl: one JSON object per line each way,
 * on the main thread's event base. Only the daemon's own uid, root and
 * members of control_group are served; commands reach the worker only
 * through the mlens_worker_* calls. */
#ifndef MLENS_CONTROL_H
#define MLENS_CONTROL_H

#include <event2/event.h>
#include "daemon/ops/stats.h"

struct mlens_control;

#define MLENS_CONTROL_MAX_LINE (64 * 1024)	/* longer requests close the connection */
#define MLENS_CONTROL_MAX_CONNS 32
#define MLENS_CONTROL_STALL_S 5			/* a half-written request gets this long */
#define MLENS_CONTROL_IDLE_S 60			/* an idle connection gets this long */

/* Bind the control socket at cfg->control ("" = none) before the model
 * loads: a bad path is refused at once. 0 or -errno with err set. */
int mlens_control_bind(struct mlens_control **out, const struct mlens_config *cfg, char *err, size_t errlen);
/* Serve it. shutdown(arg) is called for the shutdown command once the
 * reply is written: it should do what SIGTERM does. */
int mlens_control_start(struct mlens_control *c, struct event_base *base, struct mlens_daemon_info *info,
			void (*shutdown)(void *arg), void *arg, char *err, size_t errlen);
/* Close every connection and the listener; unlink the socket file. */
void mlens_control_destroy(struct mlens_control *c);

#endif
