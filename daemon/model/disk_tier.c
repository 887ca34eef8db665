/* The disk tier of the weights (disk_tier.h): per layer its matrices
 * merged into runs of the file, each run read page-aligned into the
 * layer's staging set; a reader thread serves the sets' requests in the
 * order they came. */
#include <errno.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include "daemon/errf.h"
#include "daemon/log.h"
#include "daemon/mem.h"
#include "daemon/model/disk_tier.h"
#include "daemon/model/weights.h"

#define ALIGN 4096u

enum set_state { SET_IDLE, SET_PENDING, SET_DONE, SET_FAILED };

struct dt_layer {
	int rank;		/* among the layers with disk experts; -1: none */
	int r0, nr;		/* its reads [r0, r0 + nr) */
	int m0, nm;		/* its matrices [m0, m0 + nm) of dt->mx */
	uint64_t bytes;		/* read a fill */
};

struct dt_set {
	int layer;		/* what it holds or is being filled with, -1 */
	enum set_state state;
	uint64_t seq;		/* request order */
	int err;
	char msg[1024];
};

struct mlens_disk_tier {
	struct mlens_model *m;
	int *fds;
	int n_files;
	bool direct;
	struct mlens_pinned stage;
	uint64_t set_bytes;
	int L;
	struct dt_layer *layer;
	int *order;		/* the layers with disk experts, in step order */
	int n_order;
	int E, d;		/* experts a layer, on disk a layer */
	int first;		/* disk experts below it are not read each step */
	struct mlens_disk_matrix *mx;	/* sorted by layer, file, offset */
	int n_mx;
	/* [L][E][3]: every expert matrix of the layers with disk experts, in
	 * the files and the model's pointer to it (trades swap experts) */
	struct mlens_disk_matrix *all;
	uint8_t *on_disk;	/* [L][E]; written by the worker under mu */
	struct mlens_read_range *r;	/* room for the reads of any layout */
	int *r_mx;		/* the first matrix each read covers */
	int n_r;
	const char *fault_path;

	pthread_t th;
	bool th_on;
	struct io_uring ring;
	bool ring_on;
	int n_reg;		/* staging pieces registered with the ring, 0: none */
	pthread_mutex_t mu;
	pthread_cond_t cv;	/* a set changed state, or stop */
	struct dt_set set[2];
	uint64_t seq;
	bool stop;
	struct mlens_disk_tier_stats st;	/* under mu */
	double step_t0, step_busy0;
	uint64_t step_bytes0;
};

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t align_up(uint64_t x)
{
	return (x + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
}

/* The registered buffer (1-based; 0: none) that holds [p, p + len):
 * the staging is registered in pieces of REG_PIECE bytes, and a read
 * across two of them goes unregistered. */
#define REG_PIECE (1ull << 30)
static int fixed_of(const struct mlens_disk_tier *dt, const void *p, size_t len)
{
	uint64_t at = (uint64_t)((const char *)p - (const char *)dt->stage.p);
	if (!dt->n_reg || at / REG_PIECE != (at + len - 1) / REG_PIECE)
		return 0;
	return (int)(at / REG_PIECE) + 1;
}

static int cmp_mx(const void *x, const void *y)
{
	const struct mlens_disk_matrix *p = x, *q = y;
	if (p->layer != q->layer)
		return p->layer - q->layer;
	if (p->file != q->file)
		return p->file - q->file;
	return p->off < q->off ? -1 : p->off > q->off;
}

/* Lay out the sorted mx[0..n): per layer its runs of touching matrices,
 * each read page-aligned into the layer's set at an aligned place. With
 * dt, the reads and the model's pointers are made; returns the bytes of
 * one set (the largest layer's), *n_reads the reads. */
static uint64_t plan(struct mlens_disk_tier *dt, const struct mlens_model *m, const struct mlens_disk_matrix *mx,
		     int n, int *n_reads)
{
	uint64_t set = 0;
	int nr = 0, rank = 0;

	for (int i = 0; i < n;) {
		if (dt && mx[i].expert < dt->first) {
			i++;	/* placed once for all: not read each step */
			continue;
		}
		int l = mx[i].layer, j = i;
		uint64_t cur = 0;
		char *base = NULL;
		if (dt) {
			dt->layer[l].rank = rank;
			dt->layer[l].r0 = nr;
			dt->layer[l].m0 = i;
			dt->order[dt->n_order++] = l;
			base = (char *)dt->stage.p + (uint64_t)(rank % 2) * dt->set_bytes;
		}
		while (j < n && mx[j].layer == l) {
			/* a run: matrices of one file that touch */
			int k = j;
			uint64_t a = mx[j].off & ~(uint64_t)(ALIGN - 1), b = mx[j].off + mx[j].len, size;
			if (dt && mx[j].expert < dt->first) {
				j++;
				continue;
			}
			for (k++; k < n && mx[k].layer == l && mx[k].file == mx[j].file && mx[k].off <= b &&
				  !(dt && mx[k].expert < dt->first); k++)
				if (mx[k].off + mx[k].len > b)
					b = mx[k].off + mx[k].len;
			size = m->files[mx[j].file].size;
			for (int x = j; dt && x < k; x++)
				*mx[x].ptr = base + cur + (mx[x].off - a);
			for (uint64_t off = a; off < b; off += MLENS_DISK_TIER_CHUNK) {
				uint64_t end = b - off < MLENS_DISK_TIER_CHUNK ? b : off + MLENS_DISK_TIER_CHUNK;
				if (dt) {
					int first = j;
					while (first + 1 < k && mx[first].off + mx[first].len <= off)
						first++;
					dt->r[nr] = (struct mlens_read_range){ dt->fds[mx[j].file], off,
						align_up(end - off), (end < size ? end : size) - off,
						base + cur + (off - a), 0 };
					dt->r[nr].fixed = fixed_of(dt, dt->r[nr].dst, dt->r[nr].len);
					dt->r_mx[nr] = first;
					dt->layer[l].bytes += align_up(end - off);
				}
				nr++;
			}
			cur += align_up(b - a);
			j = k;
		}
		if (dt) {
			dt->layer[l].nr = nr - dt->layer[l].r0;
			dt->layer[l].nm = j - i;
		}
		if (cur > set)
			set = cur;
		rank++;
		i = j;
	}
	if (n_reads)
		*n_reads = nr;
	return set;
}

/* One set's bytes and the reads (*n_reads) for any choice of a layer's
 * disk experts (trades change it), over the sorted mx[0..n): each matrix
 * a run of its own takes at most a page more than its whole pages, and
 * a run of several no more than its matrices apart. */
static uint64_t worst_set(const struct mlens_disk_matrix *mx, int n, int *n_reads)
{
	uint64_t set = 0, cur = 0;
	int nr = 0;

	for (int i = 0; i < n; i++) {
		if (i > 0 && mx[i].layer != mx[i - 1].layer)
			cur = 0;
		cur += align_up(mx[i].len) + ALIGN;
		nr += (int)(mx[i].len / MLENS_DISK_TIER_CHUNK) + 2;
		if (cur > set)
			set = cur;
	}
	if (n_reads)
		*n_reads = nr;
	return set;
}

uint64_t mlens_disk_tier_staging_bytes(const struct mlens_model *m, const struct mlens_disk_matrix *mx, int n)
{
	struct mlens_disk_matrix *s;
	uint64_t set;
	int layers = 0;

	if (n <= 0)
		return 0;
	s = malloc((size_t)n * sizeof(*s));
	if (!s)
		return UINT64_MAX;
	memcpy(s, mx, (size_t)n * sizeof(*s));
	qsort(s, (size_t)n, sizeof(*s), cmp_mx);
	for (int i = 0; i < n; i++)
		layers += i == 0 || s[i].layer != s[i - 1].layer;
	set = plan(NULL, m, s, n, NULL);
	if (worst_set(s, n, NULL) > set)
		set = worst_set(s, n, NULL);
	free(s);
	return (layers > 1 ? 2 : 1) * set;
}

/* ==== the reader ==== */

/* The test hook: 0 no fault, 1 -EIO, 2 an early end, 3 trades fail
 * (-EIO) and the step reads do not. */
static int fault_now(const struct mlens_disk_tier *dt)
{
	char buf[16] = "";
	FILE *f;

	if (!dt->fault_path || access(dt->fault_path, F_OK))
		return 0;
	f = fopen(dt->fault_path, "r");
	if (f) {
		if (!fgets(buf, sizeof(buf), f))
			buf[0] = 0;
		fclose(f);
	}
	if (!strncmp(buf, "trade", 5))
		return 3;
	return strncmp(buf, "short", 5) ? 1 : 2;
}

/* The tensor of the model files that holds byte off of file f. */
static const char *tensor_at(const struct mlens_model *m, int f, uint64_t off)
{
	for (int i = 0; i < m->n_tensors; i++)
		if (m->tensors[i].file == f && off >= m->tensors[i].offset &&
		    off < m->tensors[i].offset + m->tensors[i].nbytes)
			return m->tensors[i].name;
	return "?";
}

/* Read layer l into its set; 0 or -errno with msg. */
static int fill(struct mlens_disk_tier *dt, int l, char *msg, size_t msglen)
{
	const struct dt_layer *ly = &dt->layer[l];
	struct mlens_read_batch b = { .r = dt->r + ly->r0, .n = ly->nr, .fault = fault_now(dt) };
	int rc, at;

	if (b.fault == 3)
		b.fault = 0;	/* for trades only */
	atomic_init(&b.next, 0);
	atomic_init(&b.err, 0);
	atomic_init(&b.err_at, -1);
	mlens_read_batch_run(&b, &dt->ring, MLENS_DISK_TIER_DEPTH);
	rc = atomic_load(&b.err);
	if (!rc)
		return 0;
	at = atomic_load(&b.err_at);
	if (at < 0) {
		mlens_errf(msg, msglen, "weights on disk: io_uring failed reading layer %d's experts: %s", l,
			   strerror(-rc));
	} else {
		const struct mlens_read_range *r = &b.r[at];
		const struct mlens_disk_matrix *x = &dt->mx[dt->r_mx[ly->r0 + at]];
		mlens_errf(msg, msglen,
			   "weights on disk: reading %s (layer %d expert %d) at offset %llu of %s failed: %s; the step "
			   "fails, the next one reads it again",
			   tensor_at(dt->m, x->file, r->off > x->off ? r->off : x->off), l, x->expert,
			   (unsigned long long)r->off, dt->m->files[x->file].path,
			   rc == -ENODATA ? "short read (the file ends before the tensor does)" : strerror(-rc));
	}
	return rc == -ENODATA ? -EIO : rc;
}

static void *reader(void *arg)
{
	struct mlens_disk_tier *dt = arg;

	pthread_mutex_lock(&dt->mu);
	for (;;) {
		int s = -1;
		while (!dt->stop) {
			for (int k = 0; k < 2; k++)
				if (dt->set[k].state == SET_PENDING && (s < 0 || dt->set[k].seq < dt->set[s].seq))
					s = k;
			if (s >= 0)
				break;
			pthread_cond_wait(&dt->cv, &dt->mu);
		}
		if (dt->stop)
			break;
		int l = dt->set[s].layer;
		pthread_mutex_unlock(&dt->mu);
		char msg[1024];
		double t0 = now();
		int rc = fill(dt, l, msg, sizeof(msg));
		double t1 = now();
		pthread_mutex_lock(&dt->mu);
		dt->st.busy_seconds_total += t1 - t0;
		dt->st.fills_total++;
		if (rc) {
			dt->st.errors_total++;
			dt->set[s].state = SET_FAILED;
			dt->set[s].err = rc;
			snprintf(dt->set[s].msg, sizeof(dt->set[s].msg), "%s", msg);
		} else {
			dt->st.read_bytes_total += dt->layer[l].bytes;
			dt->set[s].state = SET_DONE;
		}
		pthread_cond_broadcast(&dt->cv);
	}
	pthread_mutex_unlock(&dt->mu);
	return NULL;
}

/* Ask for layer l in its set (mu held): wait while the set is being
 * filled with another layer; nothing when it holds or gets l already. */
static void do_fetch(struct mlens_disk_tier *dt, int l)
{
	struct dt_set *s = &dt->set[dt->layer[l].rank % 2];

	while (s->state == SET_PENDING && s->layer != l)
		pthread_cond_wait(&dt->cv, &dt->mu);
	if (s->layer == l && (s->state == SET_PENDING || s->state == SET_DONE))
		return;
	s->layer = l;
	s->state = SET_PENDING;
	s->seq = ++dt->seq;
	pthread_cond_broadcast(&dt->cv);
}

int mlens_disk_tier_ready(struct mlens_disk_tier *dt, int l)
{
	struct dt_set *s;
	int rc = 0;

	if (!dt || l < 0 || l >= dt->L || dt->layer[l].rank < 0)
		return 0;
	s = &dt->set[dt->layer[l].rank % 2];
	pthread_mutex_lock(&dt->mu);
	for (;;) {
		if (s->layer != l || s->state == SET_IDLE)
			do_fetch(dt, l);
		if (s->state == SET_PENDING) {
			pthread_cond_wait(&dt->cv, &dt->mu);
			continue;
		}
		break;
	}
	if (s->state == SET_FAILED) {
		rc = s->err;
		log_error("%s", s->msg);
		s->state = SET_IDLE;	/* the next call reads again */
		s->layer = -1;
	}
	pthread_mutex_unlock(&dt->mu);
	return rc;
}

void mlens_disk_tier_done(struct mlens_disk_tier *dt, int l)
{
	int k, next;

	if (!dt || l < 0 || l >= dt->L || dt->layer[l].rank < 0)
		return;
	/* the next layer of the same parity in step order, round the end */
	k = dt->layer[l].rank;
	next = k;
	for (int i = 1; i <= dt->n_order; i++) {
		int j = (k + i) % dt->n_order;
		if (j % 2 == k % 2) {
			next = j;
			break;
		}
	}
	pthread_mutex_lock(&dt->mu);
	if (dt->set[k % 2].layer == l && dt->set[k % 2].state != SET_PENDING)
		dt->set[k % 2].state = SET_IDLE;	/* its bytes may go */
	do_fetch(dt, dt->order[next]);
	pthread_mutex_unlock(&dt->mu);
}

/* ==== create / destroy ==== */

int mlens_disk_tier_create(struct mlens_disk_tier **out, struct mlens_model *m, const struct mlens_disk_matrix *mx,
			   int n, const struct mlens_disk_matrix *all, int n_all, int node, bool mlock, char *err,
			   size_t errlen)
{
	struct mlens_disk_tier *dt;
	const char *f = getenv("MLENS_TEST_DISK_FAIL");
	int rc, nr;
	uint64_t worst;

	*out = NULL;
	dt = calloc(1, sizeof(*dt));
	if (!dt)
		return -ENOMEM;
	dt->m = m;
	dt->L = (int)m->cfg.num_hidden_layers;
	dt->E = (int)m->cfg.num_local_experts;
	dt->n_files = m->n_files;
	dt->fault_path = f && *f ? f : NULL;
	pthread_mutex_init(&dt->mu, NULL);
	pthread_cond_init(&dt->cv, NULL);
	dt->set[0].layer = dt->set[1].layer = -1;
	dt->fds = malloc((size_t)m->n_files * sizeof(int));
	dt->layer = calloc((size_t)dt->L, sizeof(*dt->layer));
	dt->order = calloc((size_t)dt->L, sizeof(int));
	dt->mx = malloc((size_t)n * sizeof(*dt->mx));
	dt->all = calloc((size_t)dt->L * (size_t)dt->E * 3 + 1, sizeof(*dt->all));
	dt->on_disk = calloc((size_t)dt->L * (size_t)dt->E + 1, 1);
	if (!dt->fds || !dt->layer || !dt->order || !dt->mx || !dt->all || !dt->on_disk) {
		rc = -ENOMEM;
		goto fail_msg;
	}
	for (int i = 0; i < m->n_files; i++)
		dt->fds[i] = -1;
	for (int l = 0; l < dt->L; l++)
		dt->layer[l].rank = -1;
	memcpy(dt->mx, mx, (size_t)n * sizeof(*dt->mx));
	dt->n_mx = n;
	qsort(dt->mx, (size_t)n, sizeof(*dt->mx), cmp_mx);
	for (int i = 0; i < n; i++) {
		if (dt->mx[i].layer == dt->mx[0].layer && dt->mx[i].which == 0)
			dt->d++;
		dt->on_disk[(size_t)dt->mx[i].layer * (size_t)dt->E + (size_t)dt->mx[i].expert] = 1;
	}
	for (int i = 0; i < n_all; i++)
		if (all[i].layer >= 0 && all[i].layer < dt->L && all[i].expert >= 0 && all[i].expert < dt->E &&
		    all[i].which >= 0 && all[i].which < 3)
			dt->all[((size_t)all[i].layer * (size_t)dt->E + (size_t)all[i].expert) * 3 +
				(size_t)all[i].which] = all[i];
	dt->direct = true;
	for (int i = 0; i < m->n_files; i++) {
		dt->fds[i] = mlens_weights_open_file(m, i, &dt->direct, err, errlen);
		if (dt->fds[i] < 0) {
			rc = dt->fds[i];
			goto fail;
		}
	}
	/* sized for any layout of the disk experts: trades change it */
	dt->set_bytes = plan(NULL, m, dt->mx, n, &nr);
	worst = worst_set(dt->mx, n, &rc);
	if (worst > dt->set_bytes)
		dt->set_bytes = worst;
	if (rc > nr)
		nr = rc;
	dt->r = calloc((size_t)nr + 1, sizeof(*dt->r));
	dt->r_mx = calloc((size_t)nr + 1, sizeof(int));
	if (!dt->r || !dt->r_mx) {
		rc = -ENOMEM;
		goto fail_msg;
	}
	if ((rc = mlens_pinned_alloc(&dt->stage, 2 * dt->set_bytes, node, mlock, "disk staging", err, errlen)))
		goto fail;
	if ((rc = io_uring_queue_init(MLENS_DISK_TIER_DEPTH, &dt->ring, 0))) {
		mlens_errf(err, errlen, "weights on disk: cannot set up io_uring: %s", strerror(-rc));
		goto fail;
	}
	dt->ring_on = true;
	{
		/* the staging as the ring's fixed buffers: no page pinning per
		 * read; where the kernel refuses (a memlock limit), plain reads */
		int k = (int)((dt->stage.size + REG_PIECE - 1) / REG_PIECE);
		struct iovec *iov = calloc((size_t)k, sizeof(*iov));
		for (int i = 0; iov && i < k; i++) {
			uint64_t at = (uint64_t)i * REG_PIECE;
			iov[i].iov_base = (char *)dt->stage.p + at;
			iov[i].iov_len = dt->stage.size - at < REG_PIECE ? dt->stage.size - at : REG_PIECE;
		}
		if (iov && k > 0 && io_uring_register_buffers(&dt->ring, iov, (unsigned)k) == 0)
			dt->n_reg = k;
		free(iov);
	}
	plan(dt, m, dt->mx, n, &dt->n_r);
	if ((rc = -pthread_create(&dt->th, NULL, reader, dt)))
		goto fail_msg;
	dt->th_on = true;
	dt->st.staging_bytes = dt->stage.size;
	dt->st.direct = dt->direct;
	dt->st.registered = dt->n_reg > 0;
	dt->st.experts = dt->d;
	dt->st.ram_experts = dt->E - dt->d;
	dt->st.model_layers = dt->L;
	dt->st.model_experts = dt->E;
	dt->st.layers = dt->n_order;
	for (int i = 0; i < n; i++)
		dt->st.disk_bytes += dt->mx[i].len;
	for (int l = 0; l < dt->L; l++)
		dt->st.step_bytes += dt->layer[l].bytes;
	/* the first step's first two layers */
	pthread_mutex_lock(&dt->mu);
	for (int i = 0; i < 2 && i < dt->n_order; i++)
		do_fetch(dt, dt->order[i]);
	pthread_mutex_unlock(&dt->mu);
	*out = dt;
	return 0;
fail_msg:
	mlens_errf(err, errlen, "weights on disk: %s", strerror(-rc));
fail:
	mlens_disk_tier_destroy(dt);
	return rc;
}

void mlens_disk_tier_destroy(struct mlens_disk_tier *dt)
{
	if (!dt)
		return;
	if (dt->th_on) {
		pthread_mutex_lock(&dt->mu);
		dt->stop = true;
		pthread_cond_broadcast(&dt->cv);
		pthread_mutex_unlock(&dt->mu);
		pthread_join(dt->th, NULL);
	}
	if (dt->ring_on)
		io_uring_queue_exit(&dt->ring);	/* unregisters the buffers too */
	for (int i = 0; dt->fds && i < dt->n_files; i++)
		if (dt->fds[i] >= 0)
			close(dt->fds[i]);
	mlens_pinned_free(&dt->stage);
	pthread_mutex_destroy(&dt->mu);
	pthread_cond_destroy(&dt->cv);
	free(dt->fds);
	free(dt->layer);
	free(dt->order);
	free(dt->mx);
	free(dt->all);
	free(dt->on_disk);
	free(dt->r);
	free(dt->r_mx);
	free(dt);
}

bool mlens_disk_tier_holds(const struct mlens_disk_tier *dt, int l, int e)
{
	return dt && l >= 0 && l < dt->L && dt->layer[l].rank >= 0 && e >= dt->first && e >= 0 && e < dt->E &&
	       dt->on_disk[(size_t)l * (size_t)dt->E + (size_t)e];
}

/* Lay the reads out anew after the disk experts changed (mu held, no
 * read under way): the staging pointers move, the sets are emptied and
 * the first two layers asked for. */
static void replan(struct mlens_disk_tier *dt)
{
	for (int l = 0; l < dt->L; l++)
		dt->layer[l] = (struct dt_layer){ .rank = -1 };
	dt->n_order = 0;
	plan(dt, dt->m, dt->mx, dt->n_mx, &dt->n_r);
	for (int k = 0; k < 2; k++)
		dt->set[k] = (struct dt_set){ .layer = -1, .state = SET_IDLE };
	dt->st.layers = dt->n_order;
	dt->st.step_bytes = 0;
	for (int l = 0; l < dt->L; l++)
		dt->st.step_bytes += dt->layer[l].bytes;
	for (int i = 0; i < 2 && i < dt->n_order; i++)
		do_fetch(dt, dt->order[i]);
}

/* Wait until no read is under way (mu held): the staging and the reads
 * may then change. */
static void do_quiesce(struct mlens_disk_tier *dt)
{
	for (int k = 0; k < 2; k++)
		while (dt->set[k].state == SET_PENDING)
			pthread_cond_wait(&dt->cv, &dt->mu);
}

void mlens_disk_tier_keep_from(struct mlens_disk_tier *dt, int first)
{
	if (!dt || first <= dt->first)
		return;
	pthread_mutex_lock(&dt->mu);
	do_quiesce(dt);
	dt->first = first;
	replan(dt);
	pthread_mutex_unlock(&dt->mu);
}

/* ==== trades: which experts stay in RAM ==== */

bool mlens_disk_tier_can_trade(const struct mlens_disk_tier *dt)
{
	return dt && dt->first == 0 && dt->d > 0 && dt->d < dt->E;
}

/* The matrices of expert e of layer l (three). */
static struct mlens_disk_matrix *expert_mx(struct mlens_disk_tier *dt, int l, int e)
{
	return &dt->all[((size_t)l * (size_t)dt->E + (size_t)e) * 3];
}

int mlens_disk_tier_trade(struct mlens_disk_tier *dt, int l, int in, int out)
{
	struct mlens_disk_matrix *xi, *xo;
	struct mlens_read_range *r;
	int *r_k, nr = 0, n = 0, rc, at;
	size_t E;
	uint64_t cur = 0, skip[3];

	if (!mlens_disk_tier_can_trade(dt) || l < 0 || l >= dt->L || dt->layer[l].rank < 0 || in < 0 ||
	    in >= dt->E || out < 0 || out >= dt->E)
		return -EINVAL;
	E = (size_t)dt->E;
	xi = expert_mx(dt, l, in);
	xo = expert_mx(dt, l, out);
	if (!dt->on_disk[(size_t)l * E + (size_t)in] || dt->on_disk[(size_t)l * E + (size_t)out] || !xi[0].ptr ||
	    !xo[0].ptr)
		return -EINVAL;
	for (int k = 0; k < 3; k++)
		n += (int)(xi[k].len / MLENS_DISK_TIER_CHUNK) + 2;
	r = calloc((size_t)n, sizeof(*r));
	r_k = calloc((size_t)n, sizeof(*r_k));
	if (!r || !r_k) {
		free(r);
		free(r_k);
		return -ENOMEM;
	}
	/* the reader idle, the sets emptied: expert in is read into the
	 * staging first, so that a failed read leaves out's page whole */
	pthread_mutex_lock(&dt->mu);
	do_quiesce(dt);
	for (int k = 0; k < 2; k++)
		dt->set[k] = (struct dt_set){ .layer = -1, .state = SET_IDLE };
	pthread_mutex_unlock(&dt->mu);
	for (int k = 0; k < 3; k++) {
		uint64_t a = xi[k].off & ~(uint64_t)(ALIGN - 1), b = xi[k].off + xi[k].len;
		uint64_t size = dt->m->files[xi[k].file].size;
		skip[k] = cur + (xi[k].off - a);
		for (uint64_t off = a; off < b; off += MLENS_DISK_TIER_CHUNK) {
			uint64_t end = b - off < MLENS_DISK_TIER_CHUNK ? b : off + MLENS_DISK_TIER_CHUNK;
			r[nr] = (struct mlens_read_range){ dt->fds[xi[k].file], off, align_up(end - off),
				(end < size ? end : size) - off, (char *)dt->stage.p + cur + (off - a), 0 };
			r[nr].fixed = fixed_of(dt, r[nr].dst, r[nr].len);
			r_k[nr++] = k;
		}
		cur += align_up(b - a);
	}
	{
		struct mlens_read_batch b = { .r = r, .n = nr, .fault = fault_now(dt) ? 1 : 0 };
		atomic_init(&b.next, 0);
		atomic_init(&b.err, 0);
		atomic_init(&b.err_at, -1);
		mlens_read_batch_run(&b, &dt->ring, MLENS_DISK_TIER_DEPTH);
		rc = atomic_load(&b.err);
		at = atomic_load(&b.err_at);
	}
	pthread_mutex_lock(&dt->mu);
	if (rc) {
		const struct mlens_disk_matrix *x = &xi[at >= 0 ? r_k[at] : 0];
		dt->st.trade_errors_total++;
		log_error("weights on disk: moving layer %d expert %d into RAM in place of expert %d failed reading "
			  "%s at offset %llu of %s: %s; both stay where they were",
			  l, in, out, tensor_at(dt->m, x->file, x->off), (unsigned long long)(at >= 0 ? r[at].off : x->off),
			  dt->m->files[x->file].path,
			  rc == -ENODATA ? "short read (the file ends before the tensor does)" : strerror(-rc));
		rc = rc == -ENODATA ? -EIO : rc;
	} else {
		/* in takes out's RAM page; out is read from the files from now on */
		for (int k = 0; k < 3; k++) {
			memcpy((void *)*xo[k].ptr, (const char *)dt->stage.p + skip[k], xi[k].len);
			*xi[k].ptr = *xo[k].ptr;
		}
		dt->on_disk[(size_t)l * E + (size_t)in] = 0;
		dt->on_disk[(size_t)l * E + (size_t)out] = 1;
		for (int i = 0; i < dt->n_mx; i++)
			if (dt->mx[i].layer == l && dt->mx[i].expert == in)
				dt->mx[i] = xo[dt->mx[i].which];
		qsort(dt->mx, (size_t)dt->n_mx, sizeof(*dt->mx), cmp_mx);
		dt->st.trades_total++;
	}
	replan(dt);
	pthread_mutex_unlock(&dt->mu);
	free(r);
	free(r_k);
	return rc;
}

bool mlens_disk_tier_get_layer(struct mlens_disk_tier *dt, int l, uint8_t *on_disk)
{
	bool any;

	if (!dt || l < 0 || l >= dt->L)
		return false;
	pthread_mutex_lock(&dt->mu);
	memcpy(on_disk, dt->on_disk + (size_t)l * (size_t)dt->E, (size_t)dt->E);
	any = memchr(on_disk, 1, (size_t)dt->E) != NULL;
	pthread_mutex_unlock(&dt->mu);
	return any;
}

/* ==== stats ==== */

void mlens_disk_tier_step_begin(struct mlens_disk_tier *dt)
{
	if (!dt)
		return;
	pthread_mutex_lock(&dt->mu);
	dt->step_t0 = now();
	dt->step_busy0 = dt->st.busy_seconds_total;
	dt->step_bytes0 = dt->st.read_bytes_total;
	pthread_mutex_unlock(&dt->mu);
}

void mlens_disk_tier_step_end(struct mlens_disk_tier *dt)
{
	double t;

	if (!dt)
		return;
	pthread_mutex_lock(&dt->mu);
	t = now() - dt->step_t0;
	dt->st.last_step_bytes = dt->st.read_bytes_total - dt->step_bytes0;
	dt->st.last_step_busy = t > 0 ? (dt->st.busy_seconds_total - dt->step_busy0) / t : 0;
	if (dt->st.last_step_busy > 1)
		dt->st.last_step_busy = 1;	/* a read that began before the step */
	pthread_mutex_unlock(&dt->mu);
}

int mlens_disk_tier_measure(struct mlens_disk_tier *dt, uint64_t bytes, double *bps, char *err, size_t errlen)
{
	struct mlens_read_range *r;
	struct io_uring ring;
	void *buf = NULL;
	uint64_t done = 0;
	double t0;
	int n = 0, rc;

	*bps = 0;
	if (!dt || !dt->n_r)
		return 0;
	/* whole passes over the disk experts' reads, at least one */
	for (uint64_t b = 0; b < bytes || !n; n++)
		b += dt->r[n % dt->n_r].len;
	r = calloc((size_t)n, sizeof(*r));
	if (!r || posix_memalign(&buf, ALIGN, (size_t)MLENS_DISK_TIER_DEPTH * MLENS_DISK_TIER_CHUNK)) {
		free(r);
		mlens_errf(err, errlen, "weights on disk: no memory to measure the read rate");
		return -ENOMEM;
	}
	for (int i = 0; i < n; i++) {
		r[i] = dt->r[i % dt->n_r];
		/* a slot of the buffer per read in flight (only the time
		 * counts, but reads into the same pages contend) */
		r[i].dst = (char *)buf + (size_t)(i % (int)MLENS_DISK_TIER_DEPTH) * MLENS_DISK_TIER_CHUNK;
		r[i].fixed = 0;
		done += r[i].want;
	}
	if ((rc = io_uring_queue_init(MLENS_DISK_TIER_DEPTH, &ring, 0))) {
		mlens_errf(err, errlen, "weights on disk: cannot set up io_uring: %s", strerror(-rc));
		goto out;
	}
	{
		struct mlens_read_batch b = { .r = r, .n = n };
		atomic_init(&b.next, 0);
		atomic_init(&b.err, 0);
		atomic_init(&b.err_at, -1);
		t0 = now();
		mlens_read_batch_run(&b, &ring, MLENS_DISK_TIER_DEPTH);
		t0 = now() - t0;
		rc = atomic_load(&b.err);
	}
	io_uring_queue_exit(&ring);
	if (rc)
		mlens_errf(err, errlen, "weights on disk: measuring the model files' read rate failed: %s",
			   strerror(-rc));
	else
		*bps = t0 > 0 ? (double)done / t0 : 0;
out:
	free(buf);
	free(r);
	return rc;
}

uint64_t mlens_disk_tier_step_bytes(struct mlens_disk_tier *dt)
{
	uint64_t b;

	if (!dt)
		return 0;
	pthread_mutex_lock(&dt->mu);
	b = dt->st.step_bytes;
	pthread_mutex_unlock(&dt->mu);
	return b;
}

void mlens_disk_tier_set_ceiling(struct mlens_disk_tier *dt, double bps)
{
	if (!dt)
		return;
	pthread_mutex_lock(&dt->mu);
	dt->st.ceiling_bps = bps;
	pthread_mutex_unlock(&dt->mu);
}

void mlens_disk_tier_get_stats(struct mlens_disk_tier *dt, struct mlens_disk_tier_stats *st)
{
	memset(st, 0, sizeof(*st));
	if (!dt)
		return;
	pthread_mutex_lock(&dt->mu);
	*st = dt->st;
	pthread_mutex_unlock(&dt->mu);
}
