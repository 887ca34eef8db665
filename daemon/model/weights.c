/* Loading the model files into the weight pages. The files are cut into
 * chunks; each mover thread claims chunks from a shared counter and keeps
 * `depth` reads in flight on its own io_uring. Short reads are resubmitted
 * for the rest; any error stops the load with the file named. */
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "daemon/model/weights.h"

#define ALIGN 4096u

struct chunk {
	int file;
	size_t off;	/* in the file */
	size_t len;	/* bytes to read (a multiple of ALIGN, may pass EOF) */
	size_t want;	/* bytes that exist */
};

struct load {
	struct mlens_model *m;
	struct mlens_weights *w;
	const struct mlens_weights_opts *o;
	int *fds;
	struct chunk *chunks;
	int n_chunks;
	atomic_int next;
	atomic_int err;		/* first -errno */
	atomic_int err_file;
};

struct inflight {
	int chunk;
	size_t done;
};

static void set_err(struct load *L, int e, int file)
{
	int zero = 0;
	if (atomic_compare_exchange_strong(&L->err, &zero, e))
		atomic_store(&L->err_file, file);
}

static void prep(struct load *L, struct io_uring *ring, struct inflight *f)
{
	struct chunk *c = &L->chunks[f->chunk];
	struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
	char *dst = (char *)L->w->mem.p + L->w->file_off[c->file] + c->off + f->done;
	io_uring_prep_read(sqe, L->fds[c->file], dst, (unsigned)(c->len - f->done),
			   (unsigned long long)(c->off + f->done));
	io_uring_sqe_set_data(sqe, f);
}

static void *mover(void *arg)
{
	struct load *L = arg;
	unsigned depth = L->o->depth ? L->o->depth : 8;
	struct io_uring ring;
	struct inflight *slots = calloc(depth, sizeof(*slots));
	unsigned busy = 0;
	int rc;

	if (!slots) {
		set_err(L, -ENOMEM, -1);
		return NULL;
	}
	rc = io_uring_queue_init(depth, &ring, 0);
	if (rc) {
		set_err(L, rc, -1);
		free(slots);
		return NULL;
	}
	for (unsigned i = 0; i < depth; i++)
		slots[i].chunk = -1;
	for (;;) {
		/* fill free slots with new chunks */
		for (unsigned i = 0; i < depth && !atomic_load(&L->err); i++) {
			int c;
			if (slots[i].chunk >= 0)
				continue;
			c = atomic_fetch_add(&L->next, 1);
			if (c >= L->n_chunks)
				break;
			slots[i].chunk = c;
			slots[i].done = 0;
			prep(L, &ring, &slots[i]);
			busy++;
		}
		if (!busy)
			break;
		io_uring_submit(&ring);
		struct io_uring_cqe *cqe;
		rc = io_uring_wait_cqe(&ring, &cqe);
		if (rc) {
			set_err(L, rc, -1);
			break;
		}
		struct inflight *f = io_uring_cqe_get_data(cqe);
		struct chunk *c = &L->chunks[f->chunk];
		int res = cqe->res;
		io_uring_cqe_seen(&ring, cqe);
		if (res < 0) {
			set_err(L, res, c->file);
			f->chunk = -1;
			busy--;
			continue;
		}
		f->done += (size_t)res;
		if (f->done >= c->want || res == 0) {
			if (f->done < c->want)
				set_err(L, -EIO, c->file);	/* the file shrank */
			f->chunk = -1;
			busy--;
		} else {
			prep(L, &ring, f);	/* short read: the rest */
		}
	}
	/* reap what is still in flight after an error */
	while (busy--) {
		struct io_uring_cqe *cqe;
		if (io_uring_wait_cqe(&ring, &cqe))
			break;
		io_uring_cqe_seen(&ring, cqe);
	}
	io_uring_queue_exit(&ring);
	free(slots);
	return NULL;
}

static const void *rebase(const struct mlens_model *m, const struct mlens_weights *w, const void *p)
{
	for (int i = 0; i < m->n_files; i++) {
		const char *b = m->files[i].map;
		if ((const char *)p >= b && (const char *)p < b + m->files[i].size)
			return (const char *)w->mem.p + w->file_off[i] + ((const char *)p - b);
	}
	return p;
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int mlens_weights_load(struct mlens_model *m, const struct mlens_weights_opts *o,
		       struct mlens_weights *w, char *err, size_t errlen)
{
	struct load L;
	size_t total = 0, chunk = o->chunk ? o->chunk : (8u << 20);
	double t0 = now();
	int rc = 0;

	memset(w, 0, sizeof(*w));
	memset(&L, 0, sizeof(L));
	w->n_files = m->n_files;
	w->file_off = calloc((size_t)m->n_files, sizeof(size_t));
	if (!w->file_off)
		return -ENOMEM;
	for (int i = 0; i < m->n_files; i++) {
		w->file_off[i] = total;
		total += (m->files[i].size + ALIGN - 1) & ~(size_t)(ALIGN - 1);
	}
	rc = mlens_pinned_alloc(&w->mem, total, o->node, o->mlock, "weight pages", err, errlen);
	if (rc)
		goto fail;

	if (o->io_uring) {
		int n = 0, movers = o->movers > 0 ? o->movers : 1;
		pthread_t *th;
		L.m = m;
		L.w = w;
		L.o = o;
		L.fds = calloc((size_t)m->n_files, sizeof(int));
		for (int i = 0; i < m->n_files; i++)
			n += (int)((m->files[i].size + chunk - 1) / chunk);
		L.chunks = calloc((size_t)n ? (size_t)n : 1, sizeof(*L.chunks));
		th = calloc((size_t)movers, sizeof(*th));
		if (!L.fds || !L.chunks || !th) {
			free(L.fds);
			free(L.chunks);
			free(th);
			rc = -ENOMEM;
			goto fail;
		}
		w->direct = true;
		for (int i = 0; i < m->n_files; i++) {
			L.fds[i] = open(m->files[i].path, O_RDONLY | O_CLOEXEC | O_DIRECT);
			if (L.fds[i] < 0) {
				/* tmpfs and some file systems refuse O_DIRECT */
				L.fds[i] = open(m->files[i].path, O_RDONLY | O_CLOEXEC);
				w->direct = false;
			}
			if (L.fds[i] < 0) {
				rc = -errno;
				snprintf(err, errlen, "%s: cannot open for reading: %s", m->files[i].path, strerror(errno));
				for (int j = 0; j < i; j++)
					close(L.fds[j]);
				free(L.fds);
				free(L.chunks);
				free(th);
				goto fail;
			}
			for (size_t off = 0; off < m->files[i].size; off += chunk) {
				struct chunk *c = &L.chunks[L.n_chunks++];
				size_t want = m->files[i].size - off < chunk ? m->files[i].size - off : chunk;
				c->file = i;
				c->off = off;
				c->want = want;
				c->len = (want + ALIGN - 1) & ~(size_t)(ALIGN - 1);
			}
		}
		int started = 0;
		for (int t = 0; t < movers; t++) {
			if (pthread_create(&th[t], NULL, mover, &L))
				break;
			started++;
		}
		if (!started)
			set_err(&L, -EAGAIN, -1);
		for (int t = 0; t < started; t++)
			pthread_join(th[t], NULL);
		for (int i = 0; i < m->n_files; i++)
			close(L.fds[i]);
		rc = atomic_load(&L.err);
		if (rc) {
			int f = atomic_load(&L.err_file);
			snprintf(err, errlen, "%s: reading into the weight pages failed: %s",
				 f >= 0 ? m->files[f].path : "io_uring", strerror(-rc));
		}
		free(L.fds);
		free(L.chunks);
		free(th);
		if (rc)
			goto fail;
		w->used_io_uring = true;
	} else {
		for (int i = 0; i < m->n_files; i++)
			memcpy((char *)w->mem.p + w->file_off[i], m->files[i].map, m->files[i].size);
	}

	/* the tensors now live in the weight pages */
	for (int i = 0; i < m->n_tensors; i++)
		m->tensors[i].data = (const char *)w->mem.p + w->file_off[m->tensors[i].file] +
				     m->tensors[i].offset;
	for (int i = 0; i < m->n_views; i++)
		if (m->views[i].data)
			m->views[i].data = (const char *)w->mem.p + w->file_off[m->views[i].file] +
					   m->views[i].offset;
	for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++)
		for (int64_t e = 0; e < m->cfg.num_local_experts; e++) {
			m->layers[l].w1[e] = rebase(m, w, m->layers[l].w1[e]);
			m->layers[l].w2[e] = rebase(m, w, m->layers[l].w2[e]);
			m->layers[l].w3[e] = rebase(m, w, m->layers[l].w3[e]);
		}
	w->bytes = total;
	w->seconds = now() - t0;
	return 0;
fail:
	mlens_weights_free(w);
	return rc;
}

void mlens_weights_free(struct mlens_weights *w)
{
	mlens_pinned_free(&w->mem);
	free(w->file_off);
	w->file_off = NULL;
}
