/* The worker thread's loop: commands, intake, one step, delivery, sleep. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>
#include "daemon/log.h"
#include "daemon/serve/worker.h"

enum cmd_kind { CMD_ATTACH, CMD_DETACH, CMD_QUOTA, CMD_EVICT, CMD_ADMISSION, CMD_DRAIN, CMD_CALL, CMD_STOP };

struct cmd {
	enum cmd_kind kind;
	struct mlens_tenant *t;
	uint32_t id;
	struct mlens_quota q;
	bool flag;
	double deadline;
	mlens_worker_fn fn;	/* CMD_CALL */
	void *arg;
	/* synchronous commands: the caller waits for done */
	bool wait;
	bool done;
	int rc;
	struct cmd *next;
};

struct mlens_worker {
	pthread_t th;
	struct mlens_sched *s;
	int epfd;
	int cmd_efd;
	int notify_fd;
	/* lock guards: cmds, snapshot fields below, and cmd completion */
	pthread_mutex_t lock;
	pthread_cond_t cmd_done;
	struct cmd *cmds, *cmds_tail;
	/* worker-owned */
	struct mlens_tenant *tenants;
	int n_tenants;
	bool draining;
	bool drained_told;
	double deadline;
	bool stop;
	uint64_t attached_total, detached_total, bad_total_gone;
	uint64_t preemptions_logged;
	/* published under lock */
	struct mlens_worker_snapshot snap;
};

double mlens_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ==== commands (main thread side) ==== */

static int post(struct mlens_worker *w, struct cmd *c)
{
	uint64_t one = 1;
	int rc = 0;
	bool wait = c->wait;	/* an async c belongs to the worker once queued */
	pthread_mutex_lock(&w->lock);
	c->next = NULL;
	if (w->cmds_tail)
		w->cmds_tail->next = c;
	else
		w->cmds = c;
	w->cmds_tail = c;
	pthread_mutex_unlock(&w->lock);
	if (write(w->cmd_efd, &one, sizeof(one)) < 0)
		log_error("worker: cannot wake: %s", strerror(errno));
	if (wait) {
		pthread_mutex_lock(&w->lock);
		while (!c->done)
			pthread_cond_wait(&w->cmd_done, &w->lock);
		rc = c->rc;
		pthread_mutex_unlock(&w->lock);
		free(c);
	}
	return rc;
}

static struct cmd *cmd_new(enum cmd_kind k, bool wait)
{
	struct cmd *c = calloc(1, sizeof(*c));
	if (c) {
		c->kind = k;
		c->wait = wait;
	}
	return c;
}

void mlens_worker_attach(struct mlens_worker *w, struct mlens_tenant *t)
{
	struct cmd *c = cmd_new(CMD_ATTACH, false);
	if (!c) {
		mlens_tenant_destroy(t);
		return;
	}
	c->t = t;
	post(w, c);
}

void mlens_worker_detach(struct mlens_worker *w, uint32_t id)
{
	struct cmd *c = cmd_new(CMD_DETACH, false);
	if (!c)
		return;
	c->id = id;
	post(w, c);
}

int mlens_worker_set_quota(struct mlens_worker *w, uint32_t id, const struct mlens_quota *q)
{
	struct cmd *c = cmd_new(CMD_QUOTA, true);
	if (!c)
		return -ENOMEM;
	c->id = id;
	c->q = *q;
	return post(w, c);
}

int mlens_worker_evict(struct mlens_worker *w, uint32_t id)
{
	struct cmd *c = cmd_new(CMD_EVICT, true);
	if (!c)
		return -ENOMEM;
	c->id = id;
	return post(w, c);
}

void mlens_worker_set_admission(struct mlens_worker *w, bool open)
{
	struct cmd *c = cmd_new(CMD_ADMISSION, true);
	if (!c)
		return;
	c->flag = open;
	post(w, c);
}

void mlens_worker_drain(struct mlens_worker *w, double deadline)
{
	struct cmd *c = cmd_new(CMD_DRAIN, false);
	if (!c)
		return;
	c->deadline = deadline;
	post(w, c);
}

int mlens_worker_call_async(struct mlens_worker *w, mlens_worker_fn fn, void *arg)
{
	struct cmd *c = cmd_new(CMD_CALL, false);
	if (!c)
		return -ENOMEM;
	c->fn = fn;
	c->arg = arg;
	return post(w, c);
}

void mlens_worker_snapshot(struct mlens_worker *w, struct mlens_worker_snapshot *snap)
{
	pthread_mutex_lock(&w->lock);
	*snap = w->snap;
	snap->tenants = NULL;
	if (w->snap.n_tenants) {
		snap->tenants = malloc((size_t)w->snap.n_tenants * sizeof(*snap->tenants));
		if (snap->tenants)
			memcpy(snap->tenants, w->snap.tenants, (size_t)w->snap.n_tenants * sizeof(*snap->tenants));
		else
			snap->n_tenants = 0;
	}
	pthread_mutex_unlock(&w->lock);
}

/* ==== worker side ==== */

static struct mlens_tenant *find(struct mlens_worker *w, uint32_t id, struct mlens_tenant ***prevp)
{
	struct mlens_tenant **pp = &w->tenants;
	while (*pp && (*pp)->id != id)
		pp = &(*pp)->next;
	if (prevp)
		*prevp = pp;
	return *pp;
}

static void remove_tenant(struct mlens_worker *w, uint32_t id, int status, bool gone)
{
	struct mlens_tenant **pp, *t = find(w, id, &pp);
	if (!t)
		return;
	mlens_sched_tenant_remove(w->s, &t->st, status, gone);
	if (gone) {
		*pp = t->next;
		w->n_tenants--;
		w->detached_total++;
		w->bad_total_gone += t->bad_entries;
		epoll_ctl(w->epfd, EPOLL_CTL_DEL, t->efd_in, NULL);
		mlens_tenant_destroy(t);
		{
			struct mlens_kv_pool *kv = mlens_sched_kv(w->s);
			log_info("tenant %u detached; KV blocks in use %u of %u", id,
				 mlens_kv_pool_used_blocks(kv), kv->cache.n_blocks);
		}
	} else {
		mlens_tenant_kick(t);
	}
}

static void publish(struct mlens_worker *w);

/* Evict the tenants that broke a ring index: their requests fail, their
 * KV is freed, and their connection is hung up (the main thread then sees
 * the hang-up and detaches them). */
static void cut_off_broken(struct mlens_worker *w)
{
	for (struct mlens_tenant *t = w->tenants; t; t = t->next) {
		if (!t->broken || t->cut_off)
			continue;
		t->cut_off = true;
		log_warn("tenant %u (pid %d): %s corrupt (an index out of range): evicted", t->id,
			 (int)t->pid, t->broken_why);
		remove_tenant(w, t->id, -EPROTO, false);
		mlens_tenant_hang_up(t);
	}
}

static void run_cmd(struct mlens_worker *w, struct cmd *c)
{
	struct mlens_tenant *t;
	c->rc = 0;
	switch (c->kind) {
	case CMD_ATTACH: {
		struct epoll_event ev = { .events = EPOLLIN, .data.ptr = c->t };
		c->t->next = w->tenants;
		w->tenants = c->t;
		w->n_tenants++;
		w->attached_total++;
		epoll_ctl(w->epfd, EPOLL_CTL_ADD, c->t->efd_in, &ev);
		break;
	}
	case CMD_DETACH:
		remove_tenant(w, c->id, -EPIPE, true);
		break;
	case CMD_QUOTA:
		t = find(w, c->id, NULL);
		if (t)
			mlens_sched_set_quota(w->s, &t->st, &c->q);
		else
			c->rc = -ENOENT;
		break;
	case CMD_EVICT:
		if (find(w, c->id, NULL))
			remove_tenant(w, c->id, -ECONNABORTED, false);
		else
			c->rc = -ENOENT;
		break;
	case CMD_ADMISSION:
		mlens_sched_set_admission(w->s, c->flag);
		break;
	case CMD_DRAIN:
		mlens_sched_set_admission(w->s, false);
		w->draining = true;
		w->deadline = c->deadline;
		break;
	case CMD_CALL:
		c->rc = c->fn(c->arg, w->s);
		break;
	case CMD_STOP:
		w->stop = true;
		break;
	}
}

static void take_cmds(struct mlens_worker *w)
{
	struct cmd *list, *c, *next;
	uint64_t v;
	if (read(w->cmd_efd, &v, sizeof(v)) < 0 && errno != EAGAIN)
		log_warn("worker: command eventfd: %s", strerror(errno));
	pthread_mutex_lock(&w->lock);
	list = w->cmds;
	w->cmds = w->cmds_tail = NULL;
	pthread_mutex_unlock(&w->lock);
	for (c = list; c; c = c->next)
		run_cmd(w, c);
	/* a caller that waited reads what its command changed (mlensctl
	 * quota, then tenants): the snapshot goes out before it wakes */
	if (list)
		publish(w);
	for (c = list; c; c = next) {
		next = c->next;
		if (c->wait) {
			pthread_mutex_lock(&w->lock);
			c->done = true;
			pthread_cond_broadcast(&w->cmd_done);
			pthread_mutex_unlock(&w->lock);
		} else {
			free(c);
		}
	}
}

static void publish(struct mlens_worker *w)
{
	struct mlens_kv_pool *kv;
	struct mlens_tenant_info *ti = NULL;
	int i = 0;
	if (w->n_tenants)
		ti = calloc((size_t)w->n_tenants, sizeof(*ti));
	for (struct mlens_tenant *t = w->tenants; t && ti; t = t->next, i++) {
		ti[i].id = t->id;
		ti[i].uid = t->uid;
		ti[i].gid = t->gid;
		ti[i].pid = t->pid;
		memcpy(ti[i].name, t->name, sizeof(ti[i].name));
		ti[i].quota = t->st.quota;
		ti[i].running = t->st.running;
		ti[i].queued = t->st.queued;
		ti[i].kv_blocks = t->st.kv_blocks;
		ti[i].prompt_tokens = t->st.prompt_tokens;
		ti[i].generated_tokens = t->st.generated_tokens;
		ti[i].requests_done = t->st.requests_done;
		ti[i].requests_failed = t->st.requests_failed;
		ti[i].preemptions = t->st.preemptions;
		ti[i].bad_entries = t->bad_entries;
		ti[i].refused = t->refused;
	}
	pthread_mutex_lock(&w->lock);
	mlens_sched_get_stats(w->s, &w->snap.sched);
	kv = mlens_sched_kv(w->s);
	w->snap.kv_blocks_total = kv->cache.n_blocks;
	w->snap.kv_blocks_used = mlens_kv_pool_used_blocks(kv);
	w->snap.kv_room_taken = kv->room_taken;
	w->snap.token_cap = mlens_sched_token_cap(w->s);
	w->snap.admission = mlens_sched_admission(w->s);
	w->snap.draining = w->draining;
	free(w->snap.tenants);
	w->snap.tenants = ti;
	w->snap.n_tenants = ti ? w->n_tenants : 0;
	w->snap.tenants_attached_total = w->attached_total;
	w->snap.tenants_detached_total = w->detached_total;
	w->snap.bad_entries_total = w->bad_total_gone;
	for (struct mlens_tenant *t = w->tenants; t; t = t->next)
		w->snap.bad_entries_total += t->bad_entries;
	pthread_mutex_unlock(&w->lock);
}

static void *worker_main(void *arg)
{
	struct mlens_worker *w = arg;
	double last_pub = 0;
	while (!w->stop) {
		int stepped;
		take_cmds(w);
		if (w->stop)
			break;
		for (struct mlens_tenant *t = w->tenants; t; t = t->next)
			mlens_tenant_intake(t, w->s, 256);
		cut_off_broken(w);
		stepped = mlens_sched_step(w->s);
		cut_off_broken(w);
		{
			struct mlens_sched_stats st;
			mlens_sched_get_stats(w->s, &st);
			if (st.preemptions > w->preemptions_logged) {
				if (st.kv_swap)
					log_info("preemption: %llu sequences evicted so far (KV blocks short); "
						 "%llu went to the KV swap file, %llu re-prefill",
						 (unsigned long long)st.preemptions, (unsigned long long)st.swap.swaps,
						 (unsigned long long)st.swap.recomputes);
				else
					log_info("preemption: %llu sequences evicted so far (KV blocks short)",
						 (unsigned long long)st.preemptions);
				w->preemptions_logged = st.preemptions;
			}
		}
		if (stepped < 0)
			log_error("step failed: %s; its requests were failed", strerror(-stepped));
		for (struct mlens_tenant *t = w->tenants; t; t = t->next)
			mlens_tenant_kick(t);
		if (w->draining && !mlens_sched_idle(w->s) && mlens_now() >= w->deadline) {
			log_warn("drain deadline passed: cancelling what still runs");
			for (struct mlens_tenant *t = w->tenants; t; t = t->next)
				mlens_sched_tenant_remove(w->s, &t->st, -ECANCELED, false);
			for (struct mlens_tenant *t = w->tenants; t; t = t->next)
				mlens_tenant_kick(t);
		}
		if (stepped <= 0 || mlens_now() - last_pub > 0.05) {
			publish(w);
			last_pub = mlens_now();
		}
		if (w->draining && mlens_sched_idle(w->s) && !w->drained_told) {
			uint64_t one = 1;
			w->drained_told = true;
			if (write(w->notify_fd, &one, sizeof(one)) < 0)
				log_error("worker: cannot tell main it drained: %s", strerror(errno));
		}
		if (stepped > 0)
			continue;
		/* nothing ran: sleep until a doorbell or a command, unless a tenant
		 * already has work (arm, then look again: no lost wake-up) */
		bool work = false;
		for (struct mlens_tenant *t = w->tenants; t; t = t->next)
			work |= mlens_tenant_arm(t);
		if (!work) {
			struct epoll_event evs[16];
			int timeout = w->draining ? 100 : (mlens_sched_idle(w->s) ? -1 : 50);
			epoll_wait(w->epfd, evs, 16, timeout);
			for (int i = 0; i < 16; i++)
				(void)evs[i];
		}
		for (struct mlens_tenant *t = w->tenants; t; t = t->next) {
			uint64_t v;
			if (read(t->efd_in, &v, sizeof(v)) < 0 && errno != EAGAIN)
				log_warn("tenant %u: doorbell: %s", t->id, strerror(errno));
			mlens_tenant_disarm(t);
		}
	}
	publish(w);
	return NULL;
}

int mlens_worker_start(struct mlens_worker **out, struct mlens_sched *s, int notify_fd)
{
	struct mlens_worker *w = calloc(1, sizeof(*w));
	struct epoll_event ev = { .events = EPOLLIN, .data.ptr = NULL };
	int rc;
	if (!w)
		return -ENOMEM;
	w->s = s;
	w->notify_fd = notify_fd;
	pthread_mutex_init(&w->lock, NULL);
	pthread_cond_init(&w->cmd_done, NULL);
	w->epfd = epoll_create1(EPOLL_CLOEXEC);
	w->cmd_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (w->epfd < 0 || w->cmd_efd < 0) {
		rc = -errno;
		goto fail;
	}
	epoll_ctl(w->epfd, EPOLL_CTL_ADD, w->cmd_efd, &ev);
	publish(w);
	rc = -pthread_create(&w->th, NULL, worker_main, w);
	if (rc)
		goto fail;
	*out = w;
	return 0;
fail:
	if (w->epfd >= 0)
		close(w->epfd);
	if (w->cmd_efd >= 0)
		close(w->cmd_efd);
	free(w);
	return rc;
}

void mlens_worker_stop(struct mlens_worker *w)
{
	struct cmd *c;
	if (!w)
		return;
	c = cmd_new(CMD_STOP, false);
	if (c)
		post(w, c);
	pthread_join(w->th, NULL);
	while (w->tenants) {
		struct mlens_tenant *t = w->tenants;
		w->tenants = t->next;
		mlens_sched_tenant_remove(w->s, &t->st, -ESHUTDOWN, true);
		mlens_tenant_destroy(t);
	}
	/* commands that arrived after the stop */
	while (w->cmds) {
		c = w->cmds;
		w->cmds = c->next;
		if (c->kind == CMD_ATTACH)
			mlens_tenant_destroy(c->t);
		free(c);
	}
	close(w->epfd);
	close(w->cmd_efd);
	free(w->snap.tenants);
	pthread_mutex_destroy(&w->lock);
	pthread_cond_destroy(&w->cmd_done);
	free(w);
}
