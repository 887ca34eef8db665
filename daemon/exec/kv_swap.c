/* KV swap: the cost model, the slot allocator and the swap file's I/O
 * through io_uring (one vectored request a block, K then V of every
 * layer). */
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include "daemon/errf.h"
#include "daemon/log.h"
#include "daemon/exec/kv_swap.h"

/* ==== the cost model ==== */

bool mlens_kv_swap_cheaper(const struct mlens_kv_swap_rates *r, uint64_t bytes, int64_t tokens)
{
	double n = tokens > 0 ? (double)tokens : 0.0;
	double flops = r->flops_per_token * n + r->flops_per_token2 * n * n;
	double t_move = r->disk_bps > 0 ? 2.0 * (double)bytes / r->disk_bps : INFINITY;
	double t_comp = r->compute_flops > 0 ? flops / r->compute_flops : INFINITY;
	return t_move < t_comp;
}

/* ==== the slot allocator ==== */

int mlens_kv_slots_init(struct mlens_kv_slots *a, uint32_t n_slots)
{
	memset(a, 0, sizeof(*a));
	if (n_slots == 0)
		return -EINVAL;
	a->free = malloc((size_t)n_slots * sizeof(uint32_t));
	if (!a->free)
		return -ENOMEM;
	/* low ids first: pop from the top */
	for (uint32_t i = 0; i < n_slots; i++)
		a->free[i] = n_slots - 1 - i;
	a->n_free = a->n_slots = n_slots;
	return 0;
}

void mlens_kv_slots_fini(struct mlens_kv_slots *a)
{
	free(a->free);
	memset(a, 0, sizeof(*a));
}

int mlens_kv_slots_take(struct mlens_kv_slots *a, uint32_t n, uint32_t *out)
{
	if (n > a->n_free)
		return -ENOSPC;
	for (uint32_t i = 0; i < n; i++)
		out[i] = a->free[--a->n_free];
	return 0;
}

void mlens_kv_slots_give(struct mlens_kv_slots *a, const uint32_t *ids, uint32_t n)
{
	/* in reverse: the next take returns them in the same order */
	for (uint32_t i = n; i-- > 0;)
		a->free[a->n_free++] = ids[i];
}

/* ==== the swap file ==== */

/* Blocks in flight at once (one SQE each). */
#define SWAP_DEPTH 32
/* O_DIRECT needs offsets, lengths and addresses aligned to the device's
 * logical block; a page covers every device in use. */
#define SWAP_ALIGN 4096

enum swap_fault { FAULT_NONE, FAULT_WRITE, FAULT_READ, FAULT_ENOSPC };

struct mlens_kv_swap {
	int fd;
	struct io_uring ring;
	bool ring_ok;
	bool direct;
	size_t run;		/* bytes of one (layer, block) run of K (or V) */
	size_t slot_bytes;	/* 2 * layers * run */
	int n_layers;
	struct iovec *iov;	/* SWAP_DEPTH * 2 * n_layers */
	struct mlens_kv_slots slots;
	enum mlens_kv_swap_policy policy;
	struct mlens_kv_swap_rates rates;
	enum swap_fault fault;
	uint64_t disk_full;	/* writes the disk refused with ENOSPC */
	bool broken;		/* see ring_broken */
	struct mlens_kv_swap_stats st;
	char path[512];
	char desc[768];
};

/* Open the swap file under path (see kv_swap.h); *direct says whether
 * O_DIRECT took. -errno with err set. */
static int open_file(const char *path, bool want_direct, bool *direct, char *err, size_t errlen)
{
	struct stat st;
	int fd = -1, dflag = want_direct ? O_DIRECT : 0;
	bool is_dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);

	if (is_dir) {
		fd = open(path, O_TMPFILE | O_RDWR | O_CLOEXEC | dflag, 0600);
		if (fd < 0 && errno == EINVAL && dflag) {
			dflag = 0;
			fd = open(path, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
		}
		if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
			/* no O_TMPFILE here: a named file, unlinked at once */
			char tmpl[4096];
			if (snprintf(tmpl, sizeof(tmpl), "%s/mlensd-kvswap.XXXXXX", path) >= (int)sizeof(tmpl))
			{
				mlens_errf(err, errlen, "kv_swap_path %s: path too long", path);
				return -ENAMETOOLONG;
			}
			fd = mkostemp(tmpl, O_CLOEXEC);
			if (fd >= 0) {
				unlink(tmpl);
				if (dflag && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_DIRECT) < 0)
					dflag = 0;
			}
		}
	} else if (stat(path, &st) == 0) {
		mlens_errf(err, errlen,
			   "kv_swap_path %s exists and is not a directory: name a directory, or a file path "
			   "that does not exist (the daemon creates the file and removes it at once)", path);
		return -EEXIST;
	} else {
		int fl = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
		fd = open(path, fl | dflag, 0600);
		if (fd < 0 && errno == EINVAL && dflag) {
			dflag = 0;
			fd = open(path, fl, 0600);
		}
		if (fd >= 0)
			unlink(path);	/* nothing outlives the daemon */
	}
	if (fd < 0) {
		int e = errno;
		mlens_errf(err, errlen, "cannot create the KV swap file in %s: %s", path, strerror(e));
		return -e;
	}
	*direct = dflag != 0;
	return fd;
}

int mlens_kv_swap_create(struct mlens_kv_swap **out, const struct mlens_kv_cache *layout,
			 const struct mlens_kv_swap_opts *o, char *err, size_t errlen)
{
	struct mlens_kv_swap *sw;
	const char *f = getenv("MLENS_TEST_SWAP_FAIL");
	uint64_t n_slots;
	bool want_direct;
	int rc;

	*out = NULL;
	sw = calloc(1, sizeof(*sw));
	if (!sw)
		return -ENOMEM;
	sw->fd = -1;
	sw->n_layers = layout->n_layers;
	sw->run = (size_t)layout->n_kv_heads * mlens_kv_head_elems(layout) * mlens_dtype_size(layout->dtype);
	sw->slot_bytes = 2 * (size_t)layout->n_layers * sw->run;
	sw->policy = o->policy;
	sw->rates = o->rates;
	if (f && *f)
		sw->fault = !strcmp(f, "write") ? FAULT_WRITE : !strcmp(f, "read") ? FAULT_READ :
			    !strcmp(f, "enospc") ? FAULT_ENOSPC : FAULT_NONE;
	n_slots = sw->slot_bytes ? o->budget / sw->slot_bytes : 0;
	if (n_slots == 0) {
		mlens_errf(err, errlen, "kv_swap of %llu bytes holds no KV block: one block (K and V) needs %zu bytes",
			   (unsigned long long)o->budget, sw->slot_bytes);
		rc = -EINVAL;
		goto fail;
	}
	if (n_slots > UINT32_MAX)
		n_slots = UINT32_MAX;
	/* O_DIRECT only when every run is a whole number of pages (the pool
	 * itself is page-aligned): buffered I/O otherwise */
	want_direct = sw->run % SWAP_ALIGN == 0 && ((uintptr_t)layout->k | (uintptr_t)layout->v) % SWAP_ALIGN == 0;
	rc = open_file(o->path, want_direct, &sw->direct, err, errlen);
	if (rc < 0)
		goto fail;
	sw->fd = rc;
	if ((rc = mlens_kv_slots_init(&sw->slots, (uint32_t)n_slots)))
		goto fail_msg;
	sw->iov = calloc((size_t)SWAP_DEPTH * 2 * (size_t)sw->n_layers, sizeof(struct iovec));
	if (!sw->iov) {
		rc = -ENOMEM;
		goto fail_msg;
	}
	if ((rc = io_uring_queue_init(SWAP_DEPTH, &sw->ring, 0))) {
		mlens_errf(err, errlen, "KV swap: cannot set up io_uring: %s", strerror(-rc));
		goto fail;
	}
	sw->ring_ok = true;
	sw->st.slots_total = (uint32_t)n_slots;
	snprintf(sw->path, sizeof(sw->path), "%s", o->path);
	snprintf(sw->desc, sizeof(sw->desc), "KV swap file in %s: %u slots of %zu bytes (%.1f MiB), %s; policy %s",
		 o->path, sw->st.slots_total, sw->slot_bytes, (double)n_slots * (double)sw->slot_bytes / 1048576.0,
		 sw->direct ? "O_DIRECT" :
		 want_direct ? "buffered (the filesystem refused O_DIRECT)" :
			       "buffered (a block's runs are not whole pages, which O_DIRECT needs)",
		 o->policy == MLENS_KV_SWAP_ALWAYS ? "always" : o->policy == MLENS_KV_SWAP_NEVER ? "never" : "auto");
	*out = sw;
	return 0;
fail_msg:
	mlens_errf(err, errlen, "KV swap: %s", strerror(-rc));
fail:
	mlens_kv_swap_destroy(sw);
	return rc;
}

void mlens_kv_swap_destroy(struct mlens_kv_swap *sw)
{
	if (!sw)
		return;
	if (sw->ring_ok)
		io_uring_queue_exit(&sw->ring);
	if (sw->fd >= 0)
		close(sw->fd);
	mlens_kv_slots_fini(&sw->slots);
	free(sw->iov);
	free(sw);
}

const char *mlens_kv_swap_describe(const struct mlens_kv_swap *sw)
{
	return sw->desc;
}

size_t mlens_kv_swap_slot_bytes(const struct mlens_kv_swap *sw)
{
	return sw->slot_bytes;
}

bool mlens_kv_swap_choose(const struct mlens_kv_swap *sw, uint32_t n_blocks, int64_t tokens)
{
	if (sw->broken)
		return false;
	switch (sw->policy) {
	case MLENS_KV_SWAP_ALWAYS: return true;
	case MLENS_KV_SWAP_NEVER: return false;
	default: return mlens_kv_swap_cheaper(&sw->rates, (uint64_t)n_blocks * sw->slot_bytes, tokens);
	}
}

/* Move blocks[0..n) of kv to (write) or from slots[0..n), SWAP_DEPTH
 * blocks at a time, and wait for all. 0 or the first error (-EIO for a
 * short transfer). */
/* The ring cannot be trusted (a submission or a wait failed: requests may
 * still sit in it, pointing at pool blocks): no more swap I/O, said once;
 * every later choice is a re-prefill. */
static void ring_broken(struct mlens_kv_swap *sw, int rc, int *first_err)
{
	if (!sw->broken)
		log_error("KV swap: io_uring failed on %s (%s); the swap is off from now on, preempted sequences "
			  "re-prefill", sw->path, strerror(-rc));
	sw->broken = true;
	if (!*first_err)
		*first_err = rc;
}

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int move_blocks(struct mlens_kv_swap *sw, const struct mlens_kv_cache *kv, const uint32_t *blocks,
		       uint32_t n, const uint32_t *slots, bool write)
{
	const size_t es = mlens_dtype_size(kv->dtype);
	const double t0 = now();
	int first_err = 0;

	if (sw->broken)
		return -EIO;

	for (uint32_t done = 0; done < n;) {
		uint32_t batch = n - done < SWAP_DEPTH ? n - done : SWAP_DEPTH;
		for (uint32_t i = 0; i < batch; i++) {
			struct iovec *iov = &sw->iov[(size_t)i * 2 * (size_t)sw->n_layers];
			struct io_uring_sqe *sqe = io_uring_get_sqe(&sw->ring);
			uint32_t b = blocks[done + i];
			for (int l = 0; l < sw->n_layers; l++) {
				size_t off = mlens_kv_index(kv, l, b, 0, 0) * es;
				iov[l] = (struct iovec){ (char *)kv->k + off, sw->run };
				iov[sw->n_layers + l] = (struct iovec){ (char *)kv->v + off, sw->run };
			}
			/* the ring has SWAP_DEPTH entries and all are reaped below */
			if (write)
				io_uring_prep_writev(sqe, sw->fd, iov, (unsigned)(2 * sw->n_layers),
						     (uint64_t)slots[done + i] * sw->slot_bytes);
			else
				io_uring_prep_readv(sqe, sw->fd, iov, (unsigned)(2 * sw->n_layers),
						    (uint64_t)slots[done + i] * sw->slot_bytes);
		}
		uint32_t submitted = 0;
		int rc = 0;
		while (submitted < batch) {
			rc = io_uring_submit(&sw->ring);
			if (rc == -EINTR)
				continue;
			if (rc <= 0)
				break;
			submitted += (uint32_t)rc;
		}
		if (submitted < batch)
			ring_broken(sw, rc < 0 ? rc : -EIO, &first_err);
		for (uint32_t i = 0; i < submitted; i++) {
			struct io_uring_cqe *cqe;
			int res;
			while ((rc = io_uring_wait_cqe(&sw->ring, &cqe)) == -EINTR)
				;
			if (rc < 0) {
				ring_broken(sw, rc, &first_err);
				break;
			}
			res = cqe->res;
			io_uring_cqe_seen(&sw->ring, cqe);
			if (write && sw->fault == FAULT_WRITE)
				res = -EIO;
			else if (write && sw->fault == FAULT_ENOSPC)
				res = -ENOSPC;
			else if (!write && sw->fault == FAULT_READ)
				res = -EIO;
			if (res >= 0 && (size_t)res != sw->slot_bytes)
				res = -EIO;	/* short: the file ended or the disk did */
			if (res < 0 && !first_err)
				first_err = res;
		}
		if (sw->broken)
			break;
		done += batch;
	}
	sw->st.io_seconds += now() - t0;
	return first_err;
}

/* A failed transfer, said at the 1st, 2nd, 4th, 8th... of its kind (a
 * failing disk does not flood the log). */
static void io_warn(const struct mlens_kv_swap *sw, uint64_t nth, const char *doing, uint32_t n, int rc)
{
	if (nth & (nth - 1))
		return;
	log_warn("KV swap: %s %u blocks of a preempted sequence in %s failed: %s; it re-prefills "
		 "(%llu such failure%s so far)", doing, n, sw->path, strerror(-rc), (unsigned long long)nth,
		 nth == 1 ? "" : "s");
}

int mlens_kv_swap_out(struct mlens_kv_swap *sw, const struct mlens_kv_cache *kv, const uint32_t *blocks,
		      uint32_t n, uint32_t *slots)
{
	int rc = mlens_kv_slots_take(&sw->slots, n, slots);
	if (rc)
		return rc;
	rc = move_blocks(sw, kv, blocks, n, slots, true);
	if (rc) {
		mlens_kv_slots_give(&sw->slots, slots, n);
		if (rc != -ENOSPC)
			sw->st.errors++;
		io_warn(sw, rc == -ENOSPC ? ++sw->disk_full : sw->st.errors, "writing", n, rc);
		return rc;
	}
	sw->st.swaps++;
	sw->st.bytes_out += (uint64_t)n * sw->slot_bytes;
	return 0;
}

int mlens_kv_swap_in(struct mlens_kv_swap *sw, const struct mlens_kv_cache *kv, const uint32_t *blocks,
		     uint32_t n, const uint32_t *slots)
{
	int rc = move_blocks(sw, kv, blocks, n, slots, false);
	mlens_kv_slots_give(&sw->slots, slots, n);
	if (rc) {
		sw->st.errors++;
		io_warn(sw, sw->st.errors, "reading", n, rc);
		return rc;
	}
	sw->st.swap_ins++;
	sw->st.bytes_in += (uint64_t)n * sw->slot_bytes;
	return 0;
}

void mlens_kv_swap_drop(struct mlens_kv_swap *sw, const uint32_t *slots, uint32_t n)
{
	mlens_kv_slots_give(&sw->slots, slots, n);
}

void mlens_kv_swap_note_recompute(struct mlens_kv_swap *sw, bool full)
{
	sw->st.recomputes++;
	if (full)
		sw->st.full++;
}

void mlens_kv_swap_get_stats(const struct mlens_kv_swap *sw, struct mlens_kv_swap_stats *st)
{
	*st = sw->st;
	st->slots_used = sw->slots.n_slots - sw->slots.n_free;
}
