/* Loading the model files into the weight pages. The bytes to load are
 * cut into chunks; each mover thread claims chunks from a shared counter
 * and keeps `depth` reads in flight on its own io_uring. Short reads are
 * resubmitted for the rest; any error stops the load with the file named.
 * With a disk tier, the load skips the page-aligned insides of the
 * experts left in the files: the weight pages are the files' segments
 * around them, each at an aligned place. */
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
#include "daemon/errf.h"
#include "daemon/model/disk_tier.h"
#include "daemon/model/weights.h"

#define ALIGN 4096u

static uint64_t align_up(uint64_t x)
{
	return (x + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
}

static uint64_t align_down(uint64_t x)
{
	return x & ~(uint64_t)(ALIGN - 1);
}

/* ==== aligned reads ==== */

struct inflight {
	int range;
	size_t done;
};

static void set_err(struct mlens_read_batch *b, int e, int at)
{
	int zero = 0;
	if (atomic_compare_exchange_strong(&b->err, &zero, e))
		atomic_store(&b->err_at, at);
}

static void prep(struct mlens_read_batch *b, struct io_uring *ring, struct inflight *f)
{
	const struct mlens_read_range *r = &b->r[f->range];
	struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
	if (r->fixed > 0)
		io_uring_prep_read_fixed(sqe, r->fd, (char *)r->dst + f->done, (unsigned)(r->len - f->done),
					 (unsigned long long)(r->off + f->done), r->fixed - 1);
	else
		io_uring_prep_read(sqe, r->fd, (char *)r->dst + f->done, (unsigned)(r->len - f->done),
				   (unsigned long long)(r->off + f->done));
	io_uring_sqe_set_data(sqe, f);
}

void mlens_read_batch_run(struct mlens_read_batch *b, struct io_uring *ring, unsigned depth)
{
	struct inflight *slots = calloc(depth, sizeof(*slots));
	unsigned busy = 0;
	int rc;

	if (!slots) {
		set_err(b, -ENOMEM, -1);
		return;
	}
	for (unsigned i = 0; i < depth; i++)
		slots[i].range = -1;
	for (;;) {
		/* fill free slots with new ranges */
		for (unsigned i = 0; i < depth && !atomic_load(&b->err); i++) {
			int c;
			if (slots[i].range >= 0)
				continue;
			c = atomic_fetch_add(&b->next, 1);
			if (c >= b->n)
				break;
			slots[i].range = c;
			slots[i].done = 0;
			prep(b, ring, &slots[i]);
			busy++;
		}
		if (!busy)
			break;
		io_uring_submit(ring);
		struct io_uring_cqe *cqe;
		rc = io_uring_wait_cqe(ring, &cqe);
		if (rc == -EINTR)
			continue;
		if (rc) {
			set_err(b, rc, -1);
			break;
		}
		struct inflight *f = io_uring_cqe_get_data(cqe);
		const struct mlens_read_range *r = &b->r[f->range];
		int res = cqe->res;
		io_uring_cqe_seen(ring, cqe);
		if (b->fault == 1 && res >= 0)
			res = -EIO;
		else if (b->fault == 2 && res > 0)
			res = 0;	/* as if the file ended here */
		if (res < 0) {
			set_err(b, res, f->range);
			f->range = -1;
			busy--;
			continue;
		}
		f->done += (size_t)res;
		if (f->done >= r->want || res == 0) {
			if (f->done < r->want)
				set_err(b, -ENODATA, f->range);	/* the file ended early */
			f->range = -1;
			busy--;
		} else {
			prep(b, ring, f);	/* short read: the rest */
		}
	}
	/* reap what is still in flight after an error */
	while (busy--) {
		struct io_uring_cqe *cqe;
		if (io_uring_wait_cqe(ring, &cqe))
			break;
		io_uring_cqe_seen(ring, cqe);
	}
	free(slots);
}

struct mover_arg {
	struct mlens_read_batch *b;
	unsigned depth;
};

static void *mover(void *arg)
{
	struct mover_arg *a = arg;
	struct io_uring ring;
	int rc = io_uring_queue_init(a->depth, &ring, 0);

	if (rc) {
		set_err(a->b, rc, -1);
		return NULL;
	}
	mlens_read_batch_run(a->b, &ring, a->depth);
	io_uring_queue_exit(&ring);
	return NULL;
}

/* ==== the layout: which bytes of the files the weight pages hold ==== */

/* The file of m whose mapping holds p, -1 for none. */
static int file_of(const struct mlens_model *m, const void *p)
{
	for (int i = 0; i < m->n_files; i++) {
		const char *b = m->files[i].map;
		if ((const char *)p >= b && (const char *)p < b + m->files[i].size)
			return i;
	}
	return -1;
}

/* Experts [E - d, E) of every MoE layer, three matrices each, where the
 * model's pointers (into the mappings) place them. */
static int disk_matrices(const struct mlens_model *m, int d, struct mlens_disk_matrix **out, int *n_out,
			 char *err, size_t errlen)
{
	const struct mlens_model_config *c = &m->cfg;
	int E = (int)c->num_local_experts, n = 0;
	size_t es = c->expert_dtype == MLENS_DTYPE_E4M3 ? 1 : mlens_dtype_size(c->dtype);
	size_t len = (size_t)c->intermediate_size * (size_t)c->hidden_size * es;
	struct mlens_disk_matrix *mx;

	*out = NULL;
	*n_out = 0;
	if (d <= 0)
		return 0;
	if (d > E)
		d = E;
	mx = calloc((size_t)c->num_hidden_layers * (size_t)d * 3 + 1, sizeof(*mx));
	if (!mx)
		return -ENOMEM;
	for (int64_t l = 0; l < c->num_hidden_layers; l++) {
		struct mlens_layer_weights *w = &m->layers[l];
		if (!w->router)
			continue;	/* a dense layer */
		for (int e = E - d; e < E; e++) {
			const void **ptr[3] = { &w->w1[e], &w->w2[e], &w->w3[e] };
			for (int k = 0; k < 3; k++) {
				int f = file_of(m, *ptr[k]);
				if (f < 0) {
					mlens_errf(err, errlen,
						   "model %s: layer %lld expert %d is not in the model files (quantized "
						   "at load?): it cannot stay on disk; set weights_on_disk = never or "
						   "raise host_memory", m->dir, (long long)l, e);
					free(mx);
					return -EINVAL;
				}
				mx[n++] = (struct mlens_disk_matrix){ .layer = (int)l, .expert = e, .which = k,
					.file = f, .off = (uint64_t)((const char *)*ptr[k] - (const char *)m->files[f].map),
					.len = len, .ptr = ptr[k] };
			}
		}
	}
	*out = mx;
	*n_out = n;
	return 0;
}

/* A run of file bytes in the weight pages: [a, b) of file at mem. */
struct segment {
	int file;
	uint64_t a, b;
	uint64_t mem;
};

static int cmp_hole(const void *x, const void *y)
{
	const struct mlens_disk_matrix *p = x, *q = y;
	if (p->file != q->file)
		return p->file - q->file;
	return p->off < q->off ? -1 : p->off > q->off;
}

/* The segments of the files around the page-aligned insides of the
 * matrices mx (sorted here), laid out one after another at aligned
 * places; *total the bytes they take. */
static int layout(const struct mlens_model *m, struct mlens_disk_matrix *mx, int n, struct segment **out,
		  int *n_out, uint64_t *total)
{
	struct segment *s = calloc((size_t)m->n_files + (size_t)n + 1, sizeof(*s));
	int k = 0, i = 0;
	uint64_t mem = 0;

	if (!s)
		return -ENOMEM;
	if (n > 0)
		qsort(mx, (size_t)n, sizeof(*mx), cmp_hole);
	for (int f = 0; f < m->n_files; f++) {
		uint64_t at = 0, size = m->files[f].size;
		while (i < n && mx[i].file == f) {
			/* a hole: matrices that touch, merged, shrunk to whole pages */
			uint64_t a = mx[i].off, b = mx[i].off + mx[i].len;
			for (i++; i < n && mx[i].file == f && mx[i].off <= b; i++)
				if (mx[i].off + mx[i].len > b)
					b = mx[i].off + mx[i].len;
			a = align_up(a);
			b = align_down(b);
			if (b <= a || a < at)
				continue;
			if (a > at) {
				s[k++] = (struct segment){ f, at, a, mem };
				mem += a - at;
			}
			at = b;
		}
		if (at < size) {
			s[k++] = (struct segment){ f, at, size, mem };
			mem += align_up(size - at);
		}
	}
	*out = s;
	*n_out = k;
	*total = mem;
	return 0;
}

int mlens_weights_split(const struct mlens_model *m, int disk_experts, struct mlens_weights_split *sp,
			char *err, size_t errlen)
{
	struct mlens_disk_matrix *mx;
	struct segment *s;
	int n, k, rc;

	memset(sp, 0, sizeof(*sp));
	if ((rc = disk_matrices(m, disk_experts, &mx, &n, err, errlen)))
		return rc;
	if ((rc = layout(m, mx, n, &s, &k, &sp->pages))) {
		free(mx);
		return rc;
	}
	for (int i = 0; i < n; i++)
		sp->disk += mx[i].len;
	sp->staging = mlens_disk_tier_staging_bytes(m, mx, n);
	free(mx);
	free(s);
	return 0;
}

/* Where p (into file f's mapping) lives in the weight pages, NULL where
 * the pages do not hold it. */
static const void *rebase(const struct mlens_model *m, const struct mlens_weights *w, const struct segment *s,
			  int n, int f, uint64_t off)
{
	(void)m;
	for (int i = 0; i < n; i++)
		if (s[i].file == f && off >= s[i].a && off < s[i].b)
			return (const char *)w->mem.p + s[i].mem + (off - s[i].a);
	return NULL;
}

static const void *rebase_ptr(const struct mlens_model *m, const struct mlens_weights *w, const struct segment *s,
			      int n, const void *p)
{
	int f = file_of(m, p);
	if (f < 0)
		return p;	/* not in the files: quantized at load */
	return rebase(m, w, s, n, f, (uint64_t)((const char *)p - (const char *)m->files[f].map));
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Open file i of m for reading, O_DIRECT where the file system allows
 * (*direct cleared where it does not). -errno with err set. */
int mlens_weights_open_file(const struct mlens_model *m, int i, bool *direct, char *err, size_t errlen)
{
	int fd = open(m->files[i].path, O_RDONLY | O_CLOEXEC | O_DIRECT);
	if (fd < 0) {
		/* tmpfs and some file systems refuse O_DIRECT */
		fd = open(m->files[i].path, O_RDONLY | O_CLOEXEC);
		*direct = false;
	}
	if (fd < 0) {
		int e = errno;
		mlens_errf(err, errlen, "%s: cannot open for reading: %s", m->files[i].path, strerror(e));
		return -e;
	}
	return fd;
}

int mlens_weights_load(struct mlens_model *m, const struct mlens_weights_opts *o,
		       struct mlens_weights *w, char *err, size_t errlen)
{
	size_t chunk = o->chunk ? o->chunk : (8u << 20);
	struct mlens_disk_matrix *mx = NULL;
	struct segment *s = NULL;
	uint64_t total = 0;
	double t0 = now();
	int rc = 0, n_mx = 0, n_seg = 0;

	memset(w, 0, sizeof(*w));
	w->n_files = m->n_files;
	w->file_off = calloc((size_t)m->n_files, sizeof(size_t));
	if (!w->file_off)
		return -ENOMEM;
	if ((rc = disk_matrices(m, o->disk_experts, &mx, &n_mx, err, errlen)))
		goto fail;
	if ((rc = layout(m, mx, n_mx, &s, &n_seg, &total)))
		goto fail;
	for (int i = 0; i < n_seg; i++)
		if (s[i].a == 0)
			w->file_off[s[i].file] = s[i].mem;
	for (int i = 0; i < n_mx; i++)
		w->disk_bytes += mx[i].len;
	rc = mlens_pinned_alloc(&w->mem, total, o->node, o->mlock, "weight pages", err, errlen);
	if (rc)
		goto fail;

	if (o->io_uring) {
		int n = 0, movers = o->movers > 0 ? o->movers : 1, *fds;
		struct mlens_read_range *r;
		struct mlens_read_batch b = { 0 };
		struct mover_arg ma = { &b, o->depth ? o->depth : 8 };
		pthread_t *th;
		for (int i = 0; i < n_seg; i++)
			n += (int)((s[i].b - s[i].a + chunk - 1) / chunk);
		fds = calloc((size_t)m->n_files, sizeof(int));
		r = calloc((size_t)n ? (size_t)n : 1, sizeof(*r));
		th = calloc((size_t)movers, sizeof(*th));
		if (!fds || !r || !th) {
			free(fds);
			free(r);
			free(th);
			rc = -ENOMEM;
			goto fail;
		}
		w->direct = true;
		for (int i = 0; i < m->n_files; i++) {
			fds[i] = mlens_weights_open_file(m, i, &w->direct, err, errlen);
			if (fds[i] < 0) {
				rc = fds[i];
				for (int j = 0; j < i; j++)
					close(fds[j]);
				free(fds);
				free(r);
				free(th);
				goto fail;
			}
		}
		for (int i = 0; i < n_seg; i++)
			for (uint64_t off = s[i].a; off < s[i].b; off += chunk) {
				size_t want = s[i].b - off < chunk ? (size_t)(s[i].b - off) : chunk;
				r[b.n++] = (struct mlens_read_range){ fds[s[i].file], off, align_up(want), want,
					(char *)w->mem.p + s[i].mem + (off - s[i].a), 0 };
			}
		b.r = r;
		int started = 0;
		for (int t = 0; t < movers; t++) {
			if (pthread_create(&th[t], NULL, mover, &ma))
				break;
			started++;
		}
		if (!started)
			set_err(&b, -EAGAIN, -1);
		for (int t = 0; t < started; t++)
			pthread_join(th[t], NULL);
		rc = atomic_load(&b.err);
		if (rc == -ENODATA)
			rc = -EIO;	/* the file shrank since it was opened */
		if (rc) {
			int at = atomic_load(&b.err_at), f = -1;
			for (int i = 0; at >= 0 && i < m->n_files; i++)
				if (fds[i] == r[at].fd)
					f = i;
			snprintf(err, errlen, "%s: reading into the weight pages failed: %s",
				 f >= 0 ? m->files[f].path : "io_uring", strerror(-rc));
		}
		for (int i = 0; i < m->n_files; i++)
			close(fds[i]);
		free(fds);
		free(r);
		free(th);
		if (rc)
			goto fail;
		w->used_io_uring = true;
	} else {
		for (int i = 0; i < n_seg; i++)
			memcpy((char *)w->mem.p + s[i].mem, (const char *)m->files[s[i].file].map + s[i].a,
			       s[i].b - s[i].a);
	}

	/* the tensors now live in the weight pages (a disk expert's: NULL,
	 * its matrices are reached through the layers' pointers) */
	for (int i = 0; i < m->n_tensors; i++)
		m->tensors[i].data = rebase(m, w, s, n_seg, m->tensors[i].file, m->tensors[i].offset);
	for (int i = 0; i < m->n_views; i++)
		if (m->views[i].data)
			m->views[i].data = rebase(m, w, s, n_seg, m->views[i].file, m->views[i].offset);
	if (n_mx) {
		/* every expert where the files hold it: trades take RAM ones to disk */
		struct mlens_disk_matrix *all;
		int n_all;
		if ((rc = disk_matrices(m, (int)m->cfg.num_local_experts, &all, &n_all, err, errlen)))
			goto fail;
		rc = mlens_disk_tier_create(&w->disk, m, mx, n_mx, all, n_all, o->node, o->mlock, err, errlen);
		free(all);
		if (rc)
			goto fail;
	}
	for (int64_t l = 0; l < m->cfg.num_hidden_layers; l++)
		for (int64_t e = 0; e < m->cfg.num_local_experts; e++) {
			if (mlens_disk_tier_holds(w->disk, (int)l, (int)e))
				continue;	/* pointed into the staging */
			m->layers[l].w1[e] = rebase_ptr(m, w, s, n_seg, m->layers[l].w1[e]);
			m->layers[l].w2[e] = rebase_ptr(m, w, s, n_seg, m->layers[l].w2[e]);
			m->layers[l].w3[e] = rebase_ptr(m, w, s, n_seg, m->layers[l].w3[e]);
		}
	m->disk = w->disk;
	w->bytes = total;
	w->seconds = now() - t0;
	free(mx);
	free(s);
	return 0;
fail:
	free(mx);
	free(s);
	mlens_weights_free(w);
	return rc;
}

void mlens_weights_free(struct mlens_weights *w)
{
	mlens_disk_tier_destroy(w->disk);
	w->disk = NULL;
	mlens_pinned_free(&w->mem);
	free(w->file_off);
	w->file_off = NULL;
}
