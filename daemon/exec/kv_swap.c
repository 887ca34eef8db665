/* KV swap: the cost model, the slot allocator and the swap file's I/O
 * through io_uring (one vectored request a block, K then V of every
 * layer; an fp8 pool's scales with their codes). */
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
#include "daemon/exec/kv_pool.h"
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

double mlens_kv_swap_prefill_flops(const struct mlens_kv_swap_rates *r, int64_t from, int64_t to)
{
	double a = from > 0 ? (double)from : 0.0, b = to > 0 ? (double)to : 0.0;
	if (b <= a)
		return 0.0;
	return r->flops_per_token * (b - a) + r->flops_per_token2 * (b * b - a * a);
}

void mlens_kv_swap_rate_observe(struct mlens_kv_swap_rate *r, double sample)
{
	if (!isfinite(sample) || sample <= 0)
		return;
	if (r->source != MLENS_KV_SWAP_OBSERVED || !(r->value > 0))
		r->value = sample;
	else
		r->value += MLENS_KV_SWAP_EWMA * (sample - r->value);
	r->source = MLENS_KV_SWAP_OBSERVED;
	r->n_observed++;
}

const char *mlens_kv_swap_source_name(enum mlens_kv_swap_source s)
{
	switch (s) {
	case MLENS_KV_SWAP_MEASURED: return "measured";
	case MLENS_KV_SWAP_PROFILED: return "profiled";
	case MLENS_KV_SWAP_OBSERVED: return "observed";
	default: return "default";
	}
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
	size_t srun;		/* bytes of its scales (E4M3), else 0 */
	size_t slot_bytes;	/* a block's K and V: 2 * layers * (run + srun) */
	int n_layers;
	int n_iov;		/* iovecs a block: 2 * layers, twice with scales */
	struct iovec *iov;	/* SWAP_DEPTH * n_iov */
	struct mlens_kv_slots slots;
	enum mlens_kv_swap_policy policy;
	struct mlens_kv_swap_rates rates;	/* FLOPs a token (the rates: disk, prefill) */
	struct mlens_kv_swap_rate disk, prefill;
	double measured_bps;	/* at open, 0: not measured */
	enum swap_fault fault;
	uint64_t disk_full;	/* writes the disk refused with ENOSPC */
	bool broken;		/* see ring_broken */
	struct mlens_kv_swap_stats st;
	char path[512];
	char desc[768];
};

static double measure_disk(struct mlens_kv_swap *sw, const struct mlens_kv_cache *layout);

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
	const char *f = getenv("MLENS_TEST_SWAP_FAIL"), *forced = getenv("MLENS_TEST_SWAP_RATE");
	uint64_t n_slots;
	double forced_bps;
	bool want_direct;
	int rc;

	*out = NULL;
	sw = calloc(1, sizeof(*sw));
	if (!sw)
		return -ENOMEM;
	sw->fd = -1;
	sw->n_layers = layout->n_layers;
	sw->run = (size_t)layout->n_kv_heads * mlens_kv_head_elems(layout) * mlens_dtype_size(layout->dtype);
	if (layout->dtype == MLENS_DTYPE_E4M3)
		sw->srun = (size_t)layout->n_kv_heads * (size_t)layout->block_size * sizeof(float);
	sw->n_iov = 2 * sw->n_layers * (sw->srun ? 2 : 1);
	/* the pool's own bytes a block, the scales included */
	sw->slot_bytes = 2 * (size_t)layout->block_size * mlens_kv_token_bytes(layout);
	sw->policy = o->policy;
	sw->rates = o->rates;
	sw->disk = (struct mlens_kv_swap_rate){ .value = o->rates.disk_bps, .source = o->disk_source };
	sw->prefill = (struct mlens_kv_swap_rate){ .value = o->rates.compute_flops, .source = o->compute_source };
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
	want_direct = sw->run % SWAP_ALIGN == 0 && ((uintptr_t)layout->k | (uintptr_t)layout->v) % SWAP_ALIGN == 0 &&
		      (!sw->srun || (sw->srun % SWAP_ALIGN == 0 && mlens_kv_scales_offset(layout) % SWAP_ALIGN == 0));
	rc = open_file(o->path, want_direct, &sw->direct, err, errlen);
	if (rc < 0)
		goto fail;
	sw->fd = rc;
	if ((rc = mlens_kv_slots_init(&sw->slots, (uint32_t)n_slots)))
		goto fail_msg;
	sw->iov = calloc((size_t)SWAP_DEPTH * (size_t)sw->n_iov, sizeof(struct iovec));
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
	forced_bps = forced && *forced ? strtod(forced, NULL) : 0;
	sw->measured_bps = forced_bps > 0 ? forced_bps : measure_disk(sw, layout);
	if (sw->measured_bps > 0) {
		sw->disk.value = sw->measured_bps;
		sw->disk.source = MLENS_KV_SWAP_MEASURED;
	} else {
		sw->measured_bps = 0;
	}
	snprintf(sw->path, sizeof(sw->path), "%s", o->path);
	snprintf(sw->desc, sizeof(sw->desc), "KV swap file in %s: %u slots of %zu bytes (%.1f MiB), %s; policy %s",
		 o->path, sw->st.slots_total, sw->slot_bytes, (double)n_slots * (double)sw->slot_bytes / 1048576.0,
		 sw->direct ? "O_DIRECT" :
		 want_direct ? "buffered (the filesystem refused O_DIRECT)" :
			       "buffered (a block's runs are not whole pages, which O_DIRECT needs)",
		 o->policy == MLENS_KV_SWAP_ALWAYS ? "always" : o->policy == MLENS_KV_SWAP_NEVER ? "never" : "auto");
	{
		size_t k = strlen(sw->desc);
		if (sw->measured_bps > 0)
			snprintf(sw->desc + k, sizeof(sw->desc) - k, "; write+read %.3g GB/s %s", sw->measured_bps / 1e9,
				 forced_bps > 0 ? "(set by MLENS_TEST_SWAP_RATE)" : "measured on it");
		else
			snprintf(sw->desc + k, sizeof(sw->desc) - k, "; its rate could not be measured");
	}
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
	default: {
		struct mlens_kv_swap_rates r = mlens_kv_swap_get_rates(sw);
		return mlens_kv_swap_cheaper(&r, (uint64_t)n_blocks * sw->slot_bytes, tokens);
	}
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
			struct iovec *iov = &sw->iov[(size_t)i * (size_t)sw->n_iov];
			struct io_uring_sqe *sqe = io_uring_get_sqe(&sw->ring);
			uint32_t b = blocks[done + i];
			int v = 0;
			for (int side = 0; side < 2; side++) {
				char *base = side ? kv->v : kv->k;
				for (int l = 0; l < sw->n_layers; l++) {
					size_t idx = mlens_kv_index(kv, l, b, 0, 0);
					iov[v++] = (struct iovec){ base + idx * es, sw->run };
					if (sw->srun)
						iov[v++] = (struct iovec){ mlens_kv_scales(kv, base) + idx / (size_t)kv->head_dim,
									   sw->srun };
				}
			}
			/* the ring has SWAP_DEPTH entries and all are reaped below */
			if (write)
				io_uring_prep_writev(sqe, sw->fd, iov, (unsigned)sw->n_iov,
						     (uint64_t)slots[done + i] * sw->slot_bytes);
			else
				io_uring_prep_readv(sqe, sw->fd, iov, (unsigned)sw->n_iov,
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

/* The file's write+read rate (see kv_swap.h): up to two rings' worth of
 * the pool's first blocks, at most 64 MiB, written to the first slots and
 * read back into the same blocks. 0 when it failed or was too quick to
 * time; the swap's counters are left as they were. */
static double measure_disk(struct mlens_kv_swap *sw, const struct mlens_kv_cache *layout)
{
	uint32_t ids[2 * SWAP_DEPTH], n = 2 * SWAP_DEPTH;
	double io0 = sw->st.io_seconds, t;
	uint64_t cap = ((uint64_t)64 << 20) / sw->slot_bytes;
	int rc;

	if (n > sw->slots.n_slots)
		n = sw->slots.n_slots;
	if (n > layout->n_blocks)
		n = layout->n_blocks;
	if (n > cap)
		n = cap ? (uint32_t)cap : 1;
	if (!n || !layout->k || !layout->v)
		return 0;
	for (uint32_t i = 0; i < n; i++)
		ids[i] = i;
	t = now();
	rc = move_blocks(sw, layout, ids, n, ids, true);
	if (!rc)
		rc = move_blocks(sw, layout, ids, n, ids, false);
	t = now() - t;
	sw->st.io_seconds = io0;
	return !rc && t > 0 ? 2.0 * (double)n * (double)sw->slot_bytes / t : 0;
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

/* A swap's transfer of bytes took seconds: an observation of the disk's
 * rate (the cost model charges a swap a write and a read at it). */
static void observe_disk(struct mlens_kv_swap *sw, uint64_t bytes, double seconds)
{
	mlens_kv_swap_rate_observe(&sw->disk, seconds > 0 ? (double)bytes / seconds : 0);
}

void mlens_kv_swap_observe_prefill(struct mlens_kv_swap *sw, double flops, double seconds)
{
	if (flops <= 0)
		return;
	mlens_kv_swap_rate_observe(&sw->prefill, seconds > 0 ? flops / seconds : 0);
}

struct mlens_kv_swap_rates mlens_kv_swap_get_rates(const struct mlens_kv_swap *sw)
{
	struct mlens_kv_swap_rates r = sw->rates;
	r.disk_bps = sw->disk.value;
	r.compute_flops = sw->prefill.value;
	return r;
}

int mlens_kv_swap_out(struct mlens_kv_swap *sw, const struct mlens_kv_cache *kv, const uint32_t *blocks,
		      uint32_t n, uint32_t *slots)
{
	int rc = mlens_kv_slots_take(&sw->slots, n, slots);
	if (rc)
		return rc;
	double t = now();
	rc = move_blocks(sw, kv, blocks, n, slots, true);
	if (!rc)
		observe_disk(sw, (uint64_t)n * sw->slot_bytes, now() - t);
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
	double t = now();
	int rc = move_blocks(sw, kv, blocks, n, slots, false);
	if (!rc)
		observe_disk(sw, (uint64_t)n * sw->slot_bytes, now() - t);
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
	st->disk = sw->disk;
	st->prefill = sw->prefill;
	st->measured_bps = sw->measured_bps;
}
