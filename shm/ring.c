/* SPSC ring operations over struct mlens_ring_shm: index arithmetic, copies
 * with wrap-around, the needs-wake-up handshake and eventfd doorbells, and
 * the byte ring's record discipline. Each side trusts only its private
 * handle and checks every index it reads from the peer. */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "shm/barrier.h"
#include "shm/ring.h"

static bool is_pow2(uint32_t x)
{
	return x && !(x & (x - 1));
}

/* ==== Making and attaching ==== */

ssize_t mlens_ring_memsize(uint32_t entries, uint32_t esize)
{
	size_t bytes;

	if (!is_pow2(entries) || entries > MLENS_RING_MAX_ENTRIES)
		return -EINVAL;
	if (esize == 0 || esize > MLENS_RING_MAX_ESIZE)
		return -EINVAL;
	if (__builtin_mul_overflow((size_t)entries, (size_t)esize, &bytes) ||
	    __builtin_add_overflow(bytes, sizeof(struct mlens_ring_shm), &bytes) ||
	    bytes > (size_t)SSIZE_MAX - MLENS_CACHELINE)
		return -EINVAL;
	/* Round up so that rings can be laid end to end on cache lines. */
	return (ssize_t)((bytes + MLENS_CACHELINE - 1) & ~(size_t)(MLENS_CACHELINE - 1));
}

static void handle_fill(struct mlens_ring *r, void *mem, uint32_t entries, uint32_t esize,
			uint32_t head, uint32_t tail)
{
	r->shm = mem;
	r->data = (unsigned char *)mem + sizeof(struct mlens_ring_shm);
	r->entries = entries;
	r->mask = entries - 1;
	r->esize = esize;
	r->prod_tail = tail;
	r->prod_head = head;
	r->cons_head = head;
	r->cons_tail = tail;
}

static int ring_format(struct mlens_ring *r, void *mem, size_t memsize, uint32_t entries,
		       uint32_t esize, uint32_t magic)
{
	struct mlens_ring_shm *s = mem;
	ssize_t need = mlens_ring_memsize(entries, esize);

	if (need < 0)
		return (int)need;
	if (!mem || (uintptr_t)mem % MLENS_CACHELINE || memsize < (size_t)need)
		return -EINVAL;
	memset(s, 0, sizeof(*s));
	s->magic = magic;
	s->entries = entries;
	s->esize = esize;
	handle_fill(r, mem, entries, esize, 0, 0);
	return 0;
}

int mlens_ring_init(struct mlens_ring *r, void *mem, size_t memsize, uint32_t entries,
		    uint32_t esize)
{
	return ring_format(r, mem, memsize, entries, esize, MLENS_RING_MAGIC);
}

static int ring_attach(struct mlens_ring *r, void *mem, size_t memsize, uint32_t magic)
{
	struct mlens_ring_shm *s = mem;
	uint32_t entries, esize, head, tail;
	ssize_t need;

	if (!mem || (uintptr_t)mem % MLENS_CACHELINE || memsize < sizeof(*s))
		return -EINVAL;
	/* Relaxed: the geometry was published before the memory was handed
	 * over (fd passing or fork); each word is read once, then checked. */
	if (mlens_load_relaxed(&s->magic) != magic)
		return -EPROTO;
	entries = mlens_load_relaxed(&s->entries);
	esize = mlens_load_relaxed(&s->esize);
	need = mlens_ring_memsize(entries, esize);
	if (need < 0 || memsize < (size_t)need)
		return -EINVAL;
	/* Acquire: pairs with the store-release of each index by whoever last
	 * moved it, so entries already published are visible. */
	head = mlens_load_acquire(&s->head);
	tail = mlens_load_acquire(&s->tail);
	if (tail - head > entries)
		return -EINVAL;
	handle_fill(r, mem, entries, esize, head, tail);
	return 0;
}

int mlens_ring_attach(struct mlens_ring *r, void *mem, size_t memsize)
{
	return ring_attach(r, mem, memsize, MLENS_RING_MAGIC);
}

/* ==== Index arithmetic ==== */

/* Free slots for the producer, re-reading the consumer's head only when the
 * cached one shows fewer than `want`. */
static int prod_free(struct mlens_ring *r, uint32_t want)
{
	uint32_t free_ = r->entries - (r->prod_tail - r->prod_head);

	if (free_ < want) {
		/* Acquire: pairs with the store-release of head in
		 * cons_advance(): the consumer has finished reading the slots
		 * it freed before we overwrite them. */
		uint32_t head = mlens_load_acquire(&r->shm->head);
		uint32_t used = r->prod_tail - head;

		if (used > r->entries)
			return -EPROTO;
		r->prod_head = head;
		free_ = r->entries - used;
	}
	return (int)free_;
}

/* Entries ready for the consumer, re-reading the producer's tail only when
 * the cached one shows fewer than `want`. */
static int cons_ready(struct mlens_ring *r, uint32_t want)
{
	uint32_t ready = r->cons_tail - r->cons_head;

	if (ready < want) {
		/* Acquire: pairs with the store-release of tail in
		 * prod_publish(): the entries up to tail are written. */
		uint32_t tail = mlens_load_acquire(&r->shm->tail);

		ready = tail - r->cons_head;
		if (ready > r->entries)
			return -EPROTO;
		r->cons_tail = tail;
	}
	return (int)ready;
}

static void prod_publish(struct mlens_ring *r)
{
	/* Release: pairs with the load-acquire of tail in cons_ready() (and
	 * in attach); the entries we copied in are visible before the new
	 * tail is. */
	mlens_store_release(&r->shm->tail, r->prod_tail);
}

static void cons_advance(struct mlens_ring *r, uint32_t n)
{
	r->cons_head += n;
	/* Release: pairs with the load-acquire of head in prod_free(); our
	 * reads of the freed slots are done before the producer may reuse
	 * them. */
	mlens_store_release(&r->shm->head, r->cons_head);
}

static void copy_in(struct mlens_ring *r, uint32_t idx, const void *src, uint32_t n)
{
	uint32_t i = idx & r->mask;
	uint32_t first = r->entries - i < n ? r->entries - i : n;
	size_t es = r->esize;

	memcpy(r->data + i * es, src, first * es);
	if (n > first)
		memcpy(r->data, (const unsigned char *)src + first * es, (n - first) * es);
}

static void copy_out(struct mlens_ring *r, uint32_t idx, void *dst, uint32_t n)
{
	uint32_t i = idx & r->mask;
	uint32_t first = r->entries - i < n ? r->entries - i : n;
	size_t es = r->esize;

	memcpy(dst, r->data + i * es, first * es);
	if (n > first)
		memcpy((unsigned char *)dst + first * es, r->data, (n - first) * es);
}

/* ==== Producer ==== */

static int enqueue(struct mlens_ring *r, const void *src, uint32_t n, bool all)
{
	int free_;

	if (n == 0)
		return 0;
	free_ = prod_free(r, n);
	if (free_ < 0)
		return free_;
	if ((uint32_t)free_ < n) {
		if (all)
			return 0;
		n = (uint32_t)free_;
		if (n == 0)
			return 0;
	}
	copy_in(r, r->prod_tail, src, n);
	r->prod_tail += n;
	prod_publish(r);
	return (int)n;
}

int mlens_ring_enqueue_bulk(struct mlens_ring *r, const void *src, uint32_t n)
{
	if (n > r->entries)
		return 0;
	return enqueue(r, src, n, true);
}

int mlens_ring_enqueue_burst(struct mlens_ring *r, const void *src, uint32_t n)
{
	return enqueue(r, src, n, false);
}

int mlens_ring_free_count(struct mlens_ring *r)
{
	return prod_free(r, r->entries);
}

/* ==== Consumer ==== */

static int dequeue(struct mlens_ring *r, void *dst, uint32_t n, bool all, bool advance)
{
	int ready;

	if (n == 0)
		return 0;
	ready = cons_ready(r, n);
	if (ready < 0)
		return ready;
	if ((uint32_t)ready < n) {
		if (all)
			return 0;
		n = (uint32_t)ready;
		if (n == 0)
			return 0;
	}
	copy_out(r, r->cons_head, dst, n);
	if (advance)
		cons_advance(r, n);
	return (int)n;
}

int mlens_ring_dequeue_bulk(struct mlens_ring *r, void *dst, uint32_t n)
{
	if (n > r->entries)
		return 0;
	return dequeue(r, dst, n, true, true);
}

int mlens_ring_dequeue_burst(struct mlens_ring *r, void *dst, uint32_t n)
{
	return dequeue(r, dst, n, false, true);
}

int mlens_ring_peek(struct mlens_ring *r, void *dst, uint32_t n)
{
	return dequeue(r, dst, n, false, false);
}

int mlens_ring_consume(struct mlens_ring *r, uint32_t n)
{
	int ready = cons_ready(r, n);

	if (ready < 0)
		return ready;
	if ((uint32_t)ready < n)
		return -EINVAL;
	if (n)
		cons_advance(r, n);
	return 0;
}

int mlens_ring_count(struct mlens_ring *r)
{
	return cons_ready(r, r->entries);
}

/* ==== Needs-wake-up handshake ==== */

void mlens_ring_cons_arm(struct mlens_ring *r)
{
	mlens_store_relaxed(&r->shm->cons_wakeup, 1u);
	/* Full barrier: pairs with the one in mlens_ring_cons_needs_wakeup().
	 * Our flag store is ordered before our next load of tail, and the
	 * producer's tail store before its load of the flag: at least one
	 * side sees the other's store, so a sleep never misses an entry. */
	mlens_smp_mb();
}

void mlens_ring_cons_disarm(struct mlens_ring *r)
{
	/* Relaxed: a late clear costs at most one stale doorbell, which
	 * waiters tolerate. */
	mlens_store_relaxed(&r->shm->cons_wakeup, 0u);
}

bool mlens_ring_cons_needs_wakeup(struct mlens_ring *r)
{
	/* Full barrier: pairs with the one in mlens_ring_cons_arm(); orders
	 * the tail store in prod_publish() before the flag load below. */
	mlens_smp_mb();
	return mlens_load_relaxed(&r->shm->cons_wakeup) != 0;
}

void mlens_ring_prod_arm(struct mlens_ring *r)
{
	mlens_store_relaxed(&r->shm->prod_wakeup, 1u);
	/* Full barrier: pairs with the one in mlens_ring_prod_needs_wakeup();
	 * orders the flag store before our next load of head. */
	mlens_smp_mb();
}

void mlens_ring_prod_disarm(struct mlens_ring *r)
{
	/* Relaxed: as in mlens_ring_cons_disarm(). */
	mlens_store_relaxed(&r->shm->prod_wakeup, 0u);
}

bool mlens_ring_prod_needs_wakeup(struct mlens_ring *r)
{
	/* Full barrier: pairs with the one in mlens_ring_prod_arm(); orders
	 * the head store in cons_advance() before the flag load below. */
	mlens_smp_mb();
	return mlens_load_relaxed(&r->shm->prod_wakeup) != 0;
}

static int doorbell_ring(int efd)
{
	uint64_t one = 1;

	for (;;) {
		if (write(efd, &one, sizeof(one)) == (ssize_t)sizeof(one))
			return 1;
		if (errno == EINTR)
			continue;
		/* EAGAIN: the counter is saturated, so the peer has a wake-up
		 * pending already. */
		return errno == EAGAIN ? 1 : -errno;
	}
}

int mlens_ring_wake_cons(struct mlens_ring *r, int efd)
{
	return mlens_ring_cons_needs_wakeup(r) ? doorbell_ring(efd) : 0;
}

int mlens_ring_wake_prod(struct mlens_ring *r, int efd)
{
	return mlens_ring_prod_needs_wakeup(r) ? doorbell_ring(efd) : 0;
}

/* ==== Waiting ==== */

static int64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Sleep on efd until it is readable or the deadline passes, then drain it.
 * Returns 0 (woken or timed out: the caller looks again), -errno. */
static int doorbell_sleep(int efd, int64_t deadline)
{
	struct pollfd pfd = { .fd = efd, .events = POLLIN };
	int timeout = -1, rc;
	uint64_t v;

	if (deadline >= 0) {
		int64_t left = deadline - now_ms();

		timeout = left <= 0 ? 0 : left > INT32_MAX ? INT32_MAX : (int)left;
	}
	rc = poll(&pfd, 1, timeout);
	if (rc < 0)
		return errno == EINTR ? 0 : -errno;
	if (rc > 0) {
		if (pfd.revents & (POLLERR | POLLNVAL))
			return -EBADF;
		/* Drain; EAGAIN means another reader got there first. */
		if (read(efd, &v, sizeof(v)) < 0 && errno != EAGAIN && errno != EINTR)
			return -errno;
	}
	return 0;
}

/* The waiting loop shared by both sides: `ready` reports the work (> 0),
 * none (0) or -errno; arm/disarm are the sleeping side's flag. */
static int ring_wait(struct mlens_ring *r, int efd, int timeout_ms,
		     int (*ready)(struct mlens_ring *, uint32_t), uint32_t arg,
		     void (*arm)(struct mlens_ring *), void (*disarm)(struct mlens_ring *))
{
	int64_t deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
	int n, err;

	for (;;) {
		n = ready(r, arg);
		if (n != 0)
			return n;
		arm(r);
		n = ready(r, arg);	/* after the barrier in arm() */
		if (n != 0) {
			disarm(r);
			return n;
		}
		if (deadline >= 0 && now_ms() >= deadline) {
			disarm(r);
			return 0;
		}
		err = doorbell_sleep(efd, deadline);
		disarm(r);
		if (err < 0)
			return err;
	}
}

static int cons_has(struct mlens_ring *r, uint32_t unused)
{
	return cons_ready(r, 1);
}

static int prod_has(struct mlens_ring *r, uint32_t need)
{
	int f = prod_free(r, need);

	return f < 0 || (uint32_t)f >= need ? f : 0;
}

int mlens_ring_wait_cons(struct mlens_ring *r, int efd, int timeout_ms)
{
	return ring_wait(r, efd, timeout_ms, cons_has, 1, mlens_ring_cons_arm,
			 mlens_ring_cons_disarm);
}

int mlens_ring_wait_prod(struct mlens_ring *r, int efd, uint32_t need, int timeout_ms)
{
	if (need == 0 || need > r->entries)
		return -EINVAL;
	return ring_wait(r, efd, timeout_ms, prod_has, need, mlens_ring_prod_arm,
			 mlens_ring_prod_disarm);
}

/* ==== Byte ring ==== */

static uint32_t align_up(uint32_t len)
{
	return (len + MLENS_BYTERING_ALIGN - 1) & ~(MLENS_BYTERING_ALIGN - 1);
}

ssize_t mlens_bytering_memsize(uint32_t size)
{
	if (size < MLENS_BYTERING_MIN_SIZE)
		return -EINVAL;
	return mlens_ring_memsize(size, 1);
}

int mlens_bytering_init(struct mlens_bytering *b, void *mem, size_t memsize, uint32_t size)
{
	int err;

	if (size < MLENS_BYTERING_MIN_SIZE)
		return -EINVAL;
	err = ring_format(&b->ring, mem, memsize, size, 1, MLENS_BYTERING_MAGIC);
	if (err)
		return err;
	b->committed = 0;
	return 0;
}

int mlens_bytering_attach(struct mlens_bytering *b, void *mem, size_t memsize)
{
	int err = ring_attach(&b->ring, mem, memsize, MLENS_BYTERING_MAGIC);

	if (err)
		return err;
	if (b->ring.esize != 1 || b->ring.entries < MLENS_BYTERING_MIN_SIZE ||
	    b->ring.prod_tail % MLENS_BYTERING_ALIGN || b->ring.cons_head % MLENS_BYTERING_ALIGN)
		return -EINVAL;
	b->committed = b->ring.prod_tail;
	return 0;
}

/* Bytes a record of len needs at the producer's tail (padding included),
 * and where it would start. */
static uint32_t record_place(const struct mlens_ring *r, uint32_t len, uint32_t *off)
{
	uint32_t alen = align_up(len);
	uint32_t pos = r->prod_tail & r->mask;

	if (alen > r->entries - pos) {
		*off = 0;
		return r->entries - pos + alen;
	}
	*off = pos;
	return alen;
}

int mlens_bytering_reserve(struct mlens_bytering *b, uint32_t len, uint32_t *off, void **ptr)
{
	struct mlens_ring *r = &b->ring;
	uint32_t need, at;
	int free_;

	if (len == 0 || len > mlens_bytering_max_record(b))
		return -EMSGSIZE;
	need = record_place(r, len, &at);
	free_ = prod_free(r, need);
	if (free_ < 0)
		return free_;
	if ((uint32_t)free_ < need)
		return -EAGAIN;
	r->prod_tail += need;
	*off = at;
	*ptr = r->data + at;
	return 0;
}

void mlens_bytering_commit(struct mlens_bytering *b)
{
	b->committed = b->ring.prod_tail;
	prod_publish(&b->ring);
}

void mlens_bytering_abort(struct mlens_bytering *b)
{
	b->ring.prod_tail = b->committed;
}

static int reserve_has(struct mlens_ring *r, uint32_t len)
{
	uint32_t at, need = record_place(r, len, &at);

	return prod_has(r, need);
}

int mlens_bytering_wait_reserve(struct mlens_bytering *b, int efd, uint32_t len, int timeout_ms)
{
	int n;

	if (len == 0 || len > mlens_bytering_max_record(b))
		return -EMSGSIZE;
	n = ring_wait(&b->ring, efd, timeout_ms, reserve_has, len, mlens_ring_prod_arm,
		      mlens_ring_prod_disarm);
	return n > 0 ? 1 : n;
}

/* Where the consumer's head must move to free record (off, len): checks
 * that the record lies in the ring and within the committed bytes. */
static int record_extent(struct mlens_ring *r, uint32_t off, uint32_t len, uint32_t *adv)
{
	uint32_t skip;
	uint64_t total;
	int ready;

	if (len == 0 || off % MLENS_BYTERING_ALIGN || off >= r->entries || len > r->entries - off)
		return -EFAULT;
	/* Bytes from head to the record's start: the gap left at the end of
	 * the ring when the record wrapped, or 0 for the next record. */
	skip = (off - r->cons_head) & r->mask;
	total = (uint64_t)skip + align_up(len);
	ready = cons_ready(r, (uint32_t)(total > r->entries ? r->entries : total));
	if (ready < 0)
		return ready;
	if (total > (uint32_t)ready)
		return -EFAULT;
	*adv = (uint32_t)total;
	return 0;
}

int mlens_bytering_read(struct mlens_bytering *b, uint32_t off, uint32_t len, void *dst)
{
	uint32_t adv;
	int err = record_extent(&b->ring, off, len, &adv);

	if (err)
		return err;
	memcpy(dst, b->ring.data + off, len);
	return 0;
}

int mlens_bytering_release(struct mlens_bytering *b, uint32_t off, uint32_t len)
{
	uint32_t adv;
	int err = record_extent(&b->ring, off, len, &adv);

	if (err)
		return err;
	cons_advance(&b->ring, adv);
	return 0;
}
