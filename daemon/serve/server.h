/* The main thread's sockets (libevent): the tenant socket, where clients
 * attach (SO_PEERCRED, access rules, the region and eventfds handed over by
 * SCM_RIGHTS) and whose hang-up detaches them. The control and stats
 * sockets hang off the same event base (daemon/ops/control.c, daemon/ops/stats.c). */
#ifndef MLENS_SERVER_H
#define MLENS_SERVER_H

#include <event2/event.h>
#include <stdbool.h>
#include <sys/types.h>
#include "daemon/config.h"
#include "daemon/serve/worker.h"
#include "shm/proto.h"
#include "shm/region.h"

struct mlens_server;

struct mlens_server_opts {
	const char *allow_users;	/* "" = the daemon's own uid; "*" = anyone */
	const char *allow_groups;
	int max_tenants;
	struct mlens_quota quota;	/* for new tenants */
	struct mlens_region_params region;
	struct mlens_region_limits limits;
};

/* Bind the tenant socket at path (before the model loads: a bad path or a
 * live daemon there is refused at once). 0 or -errno with err set. */
int mlens_server_bind(struct mlens_server **out, const char *path, char *err, size_t errlen);
/* Listen and attach tenants under o. */
int mlens_server_start(struct mlens_server *s, struct event_base *base, struct mlens_worker *w,
		       const struct mlens_server_opts *o, char *err, size_t errlen);
/* Stop accepting tenants (drain); attached ones stay. */
void mlens_server_stop_listening(struct mlens_server *s);
/* Disconnect a tenant (after mlens_worker_evict). -ENOENT if unknown. */
int mlens_server_disconnect(struct mlens_server *s, uint32_t tenant_id);
void mlens_server_destroy(struct mlens_server *s);

#endif
