/* Description: shm/ unit tests: SPSC rings (empty, full, 32-bit index
 * wrap-around, bulk/burst, peek, corrupt peer indexes, wake-up handshake),
 * the byte ring, region layout and attach on corrupted headers, protocol
 * validation of hostile entries, and a two-process stress test through a
 * memfd with eventfd doorbells. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "shm/barrier.h"
#include "shm/proto.h"
#include "shm/region.h"
#include "shm/ring.h"

/* ==== Helpers ==== */

struct item {
	uint64_t seq;
	uint64_t check;		/* seq ^ ITEM_KEY: catches a torn or stale entry */
};
#define ITEM_KEY 0x9e3779b97f4a7c15ull

static struct item item_of(uint64_t seq)
{
	return (struct item){ .seq = seq, .check = seq ^ ITEM_KEY };
}

static void *xalloc(size_t size)
{
	void *p = aligned_alloc(MLENS_REGION_PAGE, (size + MLENS_REGION_PAGE - 1) &
				~(size_t)(MLENS_REGION_PAGE - 1));

	ck_assert_ptr_nonnull(p);
	memset(p, 0xa5, size);	/* init must not rely on zeroed memory */
	return p;
}

/* A ring of `entries` items in fresh memory, its indexes at `start`. */
static struct mlens_ring *ring_at(uint32_t entries, uint32_t start, void **mem)
{
	static struct mlens_ring r;
	ssize_t sz = mlens_ring_memsize(entries, sizeof(struct item));

	ck_assert_int_gt(sz, 0);
	*mem = xalloc((size_t)sz);
	ck_assert_int_eq(mlens_ring_init(&r, *mem, (size_t)sz, entries, sizeof(struct item)), 0);
	r.shm->head = start;
	r.shm->tail = start;
	ck_assert_int_eq(mlens_ring_attach(&r, *mem, (size_t)sz), 0);
	return &r;
}

static int64_t mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ==== Ring ==== */

START_TEST(test_ring_memsize)
{
	ck_assert_int_eq(mlens_ring_memsize(0, 16), -EINVAL);
	ck_assert_int_eq(mlens_ring_memsize(3, 16), -EINVAL);
	ck_assert_int_eq(mlens_ring_memsize(MLENS_RING_MAX_ENTRIES * 2u, 1), -EINVAL);
	ck_assert_int_eq(mlens_ring_memsize(8, 0), -EINVAL);
	ck_assert_int_eq(mlens_ring_memsize(8, MLENS_RING_MAX_ESIZE + 1), -EINVAL);
	ck_assert_int_eq(mlens_ring_memsize(1, 16), 256 + 64);
	ck_assert_int_eq(mlens_ring_memsize(1024, 16), 256 + 16384);
	ck_assert_int_eq(mlens_ring_memsize(4, 3), 256 + 64);	/* 12 rounded to a line */
}
END_TEST

START_TEST(test_ring_init_rejects)
{
	struct mlens_ring r;
	void *mem = xalloc(4096);

	ck_assert_int_eq(mlens_ring_init(&r, mem, 4096, 6, 16), -EINVAL);
	ck_assert_int_eq(mlens_ring_init(&r, mem, 256 + 16 * 15, 16, 16), -EINVAL);
	ck_assert_int_eq(mlens_ring_init(&r, (char *)mem + 8, 4000, 16, 16), -EINVAL);
	ck_assert_int_eq(mlens_ring_init(&r, mem, 4096, 16, 16), 0);
	ck_assert_uint_eq(r.entries, 16);
	ck_assert_uint_eq(r.mask, 15);
	ck_assert_uint_eq(r.shm->head, 0);
	ck_assert_uint_eq(r.shm->tail, 0);
	ck_assert_uint_eq(r.shm->cons_wakeup, 0);
	free(mem);
}
END_TEST

START_TEST(test_ring_empty_full)
{
	void *mem;
	struct mlens_ring *r = ring_at(8, 0, &mem);
	struct item it;

	ck_assert_int_eq(mlens_ring_count(r), 0);
	ck_assert_int_eq(mlens_ring_free_count(r), 8);
	ck_assert_int_eq(mlens_ring_dequeue_burst(r, &it, 1), 0);
	ck_assert_int_eq(mlens_ring_dequeue_bulk(r, &it, 1), 0);
	for (uint64_t i = 0; i < 8; i++) {
		it = item_of(i);
		ck_assert_int_eq(mlens_ring_enqueue_bulk(r, &it, 1), 1);
	}
	ck_assert_int_eq(mlens_ring_count(r), 8);
	ck_assert_int_eq(mlens_ring_free_count(r), 0);
	it = item_of(99);
	ck_assert_int_eq(mlens_ring_enqueue_bulk(r, &it, 1), 0);
	ck_assert_int_eq(mlens_ring_enqueue_burst(r, &it, 1), 0);
	ck_assert_uint_eq(r->shm->tail - r->shm->head, 8);	/* full: tail - head == entries */
	for (uint64_t i = 0; i < 8; i++) {
		ck_assert_int_eq(mlens_ring_dequeue_bulk(r, &it, 1), 1);
		ck_assert_uint_eq(it.seq, i);
		ck_assert_uint_eq(it.check, i ^ ITEM_KEY);
	}
	ck_assert_int_eq(mlens_ring_count(r), 0);
	ck_assert_int_eq(mlens_ring_free_count(r), 8);
	free(mem);
}
END_TEST

/* The indexes start just below UINT32_MAX, so they wrap to 0 mid-test while
 * the masked slots wrap many times; odd batch sizes make copies straddle the
 * end of the entry array. */
START_TEST(test_ring_wrap32)
{
	void *mem;
	const uint32_t start = UINT32_MAX - 20;
	struct mlens_ring *r = ring_at(16, start, &mem);
	struct item in[16], out[16];
	uint64_t next_in = 0, next_out = 0;
	int n;

	for (int round = 0; round < 200; round++) {
		uint32_t k = 1 + (uint32_t)(round * 7) % 13;

		for (uint32_t i = 0; i < k; i++)
			in[i] = item_of(next_in + i);
		n = mlens_ring_enqueue_burst(r, in, k);
		ck_assert_int_ge(n, 0);
		next_in += (uint64_t)n;
		ck_assert_int_eq(mlens_ring_count(r), (int)(next_in - next_out));
		n = mlens_ring_dequeue_burst(r, out, 1 + (uint32_t)(round * 5) % 11);
		ck_assert_int_ge(n, 0);
		for (int i = 0; i < n; i++) {
			ck_assert_uint_eq(out[i].seq, next_out + (uint64_t)i);
			ck_assert_uint_eq(out[i].check, (next_out + (uint64_t)i) ^ ITEM_KEY);
		}
		next_out += (uint64_t)n;
	}
	n = mlens_ring_dequeue_burst(r, out, 16);
	for (int i = 0; i < n; i++)
		ck_assert_uint_eq(out[i].seq, next_out + (uint64_t)i);
	next_out += (uint64_t)n;
	ck_assert_uint_eq(next_out, next_in);
	ck_assert_uint_gt(next_in, 1000);
	/* The free-running indexes really did wrap past zero. */
	ck_assert_uint_eq(r->shm->tail, (uint32_t)(start + next_in));
	ck_assert_uint_lt(r->shm->tail, start);
	ck_assert_uint_eq(r->shm->head, r->shm->tail);
	free(mem);
}
END_TEST

START_TEST(test_ring_bulk_burst)
{
	void *mem;
	struct mlens_ring *r = ring_at(8, UINT32_MAX - 2, &mem);
	struct item in[12], out[12];

	for (int i = 0; i < 12; i++)
		in[i] = item_of((uint64_t)i);
	ck_assert_int_eq(mlens_ring_enqueue_bulk(r, in, 9), 0);	/* more than entries */
	ck_assert_int_eq(mlens_ring_enqueue_bulk(r, in, 5), 5);
	ck_assert_int_eq(mlens_ring_enqueue_bulk(r, in + 5, 4), 0);	/* 3 free: none */
	ck_assert_int_eq(mlens_ring_count(r), 5);
	ck_assert_int_eq(mlens_ring_enqueue_burst(r, in + 5, 4), 3);	/* as many as fit */
	ck_assert_int_eq(mlens_ring_dequeue_bulk(r, out, 9), 0);
	ck_assert_int_eq(mlens_ring_dequeue_bulk(r, out, 6), 6);
	ck_assert_int_eq(mlens_ring_dequeue_bulk(r, out + 6, 3), 0);	/* 2 there: none */
	ck_assert_int_eq(mlens_ring_dequeue_burst(r, out + 6, 3), 2);
	for (int i = 0; i < 8; i++)
		ck_assert_uint_eq(out[i].seq, (uint64_t)i);
	ck_assert_int_eq(mlens_ring_enqueue_burst(r, in, 0), 0);
	ck_assert_int_eq(mlens_ring_dequeue_burst(r, out, 0), 0);
	free(mem);
}
END_TEST

START_TEST(test_ring_peek_consume)
{
	void *mem;
	struct mlens_ring *r = ring_at(8, UINT32_MAX - 1, &mem);
	struct item in[6], out[8];

	for (int i = 0; i < 6; i++)
		in[i] = item_of(100 + (uint64_t)i);
	ck_assert_int_eq(mlens_ring_enqueue_bulk(r, in, 6), 6);
	ck_assert_int_eq(mlens_ring_peek(r, out, 4), 4);
	ck_assert_uint_eq(out[0].seq, 100);
	ck_assert_uint_eq(out[3].seq, 103);
	ck_assert_int_eq(mlens_ring_count(r), 6);	/* peek consumed nothing */
	ck_assert_int_eq(mlens_ring_peek(r, out, 8), 6);	/* up to what is there */
	ck_assert_uint_eq(out[5].seq, 105);
	ck_assert_int_eq(mlens_ring_consume(r, 7), -EINVAL);
	ck_assert_int_eq(mlens_ring_consume(r, 2), 0);
	ck_assert_int_eq(mlens_ring_count(r), 4);
	ck_assert_int_eq(mlens_ring_dequeue_burst(r, out, 8), 4);
	ck_assert_uint_eq(out[0].seq, 102);
	ck_assert_uint_eq(out[3].seq, 105);
	free(mem);
}
END_TEST

START_TEST(test_ring_attach_checks)
{
	struct mlens_ring r, a;
	ssize_t sz = mlens_ring_memsize(16, 16);
	void *mem = xalloc((size_t)sz);

	ck_assert_int_eq(mlens_ring_init(&r, mem, (size_t)sz, 16, 16), 0);
	ck_assert_int_eq(mlens_ring_attach(&a, mem, (size_t)sz), 0);
	ck_assert_uint_eq(a.entries, 16);
	ck_assert_uint_eq(a.esize, 16);
	ck_assert_int_eq(mlens_ring_attach(&a, mem, (size_t)sz - 1), -EINVAL);
	ck_assert_int_eq(mlens_ring_attach(&a, mem, 100), -EINVAL);
	r.shm->entries = 12;
	ck_assert_int_eq(mlens_ring_attach(&a, mem, (size_t)sz), -EINVAL);
	r.shm->entries = 32;	/* a power of two, but bigger than the memory */
	ck_assert_int_eq(mlens_ring_attach(&a, mem, (size_t)sz), -EINVAL);
	r.shm->entries = 16;
	r.shm->esize = 0;
	ck_assert_int_eq(mlens_ring_attach(&a, mem, (size_t)sz), -EINVAL);
	r.shm->esize = 16;
	r.shm->tail = 17;	/* more than entries ahead of head */
	ck_assert_int_eq(mlens_ring_attach(&a, mem, (size_t)sz), -EINVAL);
	r.shm->tail = 0;
	r.shm->magic ^= 1;
	ck_assert_int_eq(mlens_ring_attach(&a, mem, (size_t)sz), -EPROTO);
	r.shm->magic = MLENS_BYTERING_MAGIC;	/* a byte ring is not an entry ring */
	ck_assert_int_eq(mlens_ring_attach(&a, mem, (size_t)sz), -EPROTO);
	free(mem);
}
END_TEST

/* A peer that scribbles on its index is caught, not trusted. */
START_TEST(test_ring_corrupt_peer_index)
{
	void *mem;
	struct mlens_ring *r = ring_at(8, 1000, &mem);
	struct item it = item_of(1), buf[8];

	ck_assert_int_eq(mlens_ring_enqueue_bulk(r, &it, 1), 1);
	r->shm->tail = 1000 + 9;	/* claims 9 entries in an 8-entry ring */
	ck_assert_int_eq(mlens_ring_count(r), -EPROTO);
	ck_assert_int_eq(mlens_ring_dequeue_burst(r, buf, 8), -EPROTO);
	r->shm->tail = 1000 - 1;	/* behind head */
	ck_assert_int_eq(mlens_ring_peek(r, buf, 8), -EPROTO);
	r->shm->tail = 1001;
	/* The producer side: a head ahead of the true tail. */
	r->shm->head = 1002;
	ck_assert_int_eq(mlens_ring_free_count(r), -EPROTO);
	for (int i = 0; i < 8; i++)
		buf[i] = item_of((uint64_t)i);
	ck_assert_int_eq(mlens_ring_enqueue_burst(r, buf, 8), -EPROTO);
	/* A head far behind (tail - head > entries) is caught too. */
	r->shm->head = 1001 - 9;
	ck_assert_int_eq(mlens_ring_enqueue_bulk(r, buf, 8), -EPROTO);
	free(mem);
}
END_TEST

static uint64_t efd_take(int efd)
{
	uint64_t v = 0;

	if (read(efd, &v, sizeof(v)) != (ssize_t)sizeof(v))
		return 0;
	return v;
}

START_TEST(test_ring_wakeup_flags)
{
	void *mem;
	struct mlens_ring *r = ring_at(4, 0, &mem);
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct item it = item_of(7);

	ck_assert_int_ge(efd, 0);
	ck_assert(!mlens_ring_cons_needs_wakeup(r));
	ck_assert(!mlens_ring_prod_needs_wakeup(r));
	ck_assert_int_eq(mlens_ring_enqueue_bulk(r, &it, 1), 1);
	ck_assert_int_eq(mlens_ring_wake_cons(r, efd), 0);	/* nobody sleeps: no syscall */
	ck_assert_uint_eq(efd_take(efd), 0);
	mlens_ring_cons_arm(r);
	ck_assert(mlens_ring_cons_needs_wakeup(r));
	ck_assert(!mlens_ring_prod_needs_wakeup(r));
	ck_assert_int_eq(mlens_ring_wake_cons(r, efd), 1);
	ck_assert_uint_eq(efd_take(efd), 1);
	mlens_ring_cons_disarm(r);
	ck_assert(!mlens_ring_cons_needs_wakeup(r));
	mlens_ring_prod_arm(r);
	ck_assert(mlens_ring_prod_needs_wakeup(r));
	ck_assert_int_eq(mlens_ring_wake_prod(r, efd), 1);
	ck_assert_uint_eq(efd_take(efd), 1);
	mlens_ring_prod_disarm(r);
	ck_assert_int_eq(mlens_ring_wake_prod(r, efd), 0);
	ck_assert_int_eq(mlens_ring_wake_cons(r, -1), 0);	/* no flag: fd not touched */
	mlens_ring_cons_arm(r);
	ck_assert_int_eq(mlens_ring_wake_cons(r, -1), -EBADF);
	close(efd);
	free(mem);
}
END_TEST

START_TEST(test_ring_wait_timeout)
{
	void *mem;
	struct mlens_ring *r = ring_at(4, 0, &mem);
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	struct item it[4];
	int64_t t0;

	ck_assert_int_ge(efd, 0);
	t0 = mono_ms();
	ck_assert_int_eq(mlens_ring_wait_cons(r, efd, 50), 0);
	ck_assert_int_ge(mono_ms() - t0, 45);
	ck_assert(!mlens_ring_cons_needs_wakeup(r));	/* disarmed on the way out */
	/* A stale doorbell wakes the waiter, which looks, finds nothing and
	 * sleeps again until the timeout. */
	ck_assert_int_eq(eventfd_write(efd, 1), 0);
	t0 = mono_ms();
	ck_assert_int_eq(mlens_ring_wait_cons(r, efd, 50), 0);
	ck_assert_int_ge(mono_ms() - t0, 45);
	for (int i = 0; i < 4; i++)
		it[i] = item_of((uint64_t)i);
	ck_assert_int_eq(mlens_ring_enqueue_bulk(r, it, 3), 3);
	ck_assert_int_eq(mlens_ring_wait_cons(r, efd, -1), 3);	/* ready: no sleep */
	ck_assert_int_eq(mlens_ring_wait_prod(r, efd, 1, 0), 1);
	ck_assert_int_eq(mlens_ring_wait_prod(r, efd, 2, 30), 0);
	ck_assert(!mlens_ring_prod_needs_wakeup(r));
	ck_assert_int_eq(mlens_ring_wait_prod(r, efd, 5, 0), -EINVAL);
	ck_assert_int_eq(mlens_ring_wait_prod(r, efd, 0, 0), -EINVAL);
	ck_assert_int_eq(mlens_ring_wait_cons(r, -1, 0), 3);
	ck_assert_int_eq(mlens_ring_dequeue_burst(r, it, 4), 3);
	close(efd);
	ck_assert_int_eq(mlens_ring_wait_cons(r, efd, 10), -EBADF);	/* poll: POLLNVAL */
	free(mem);
}
END_TEST

/* Two rings and a byte ring in MAP_SHARED memory, one eventfd: a child
 * makes one condition true after a delay; the parent, asleep on all of them,
 * wakes with exactly that one met. */
START_TEST(test_ring_wait_any)
{
	ssize_t rsz = mlens_ring_memsize(4, sizeof(struct item));
	ssize_t bsz = mlens_bytering_memsize(256);
	size_t total = 2 * (size_t)rsz + (size_t)bsz;
	unsigned char *mem = mmap(NULL, total, PROT_READ | PROT_WRITE,
				  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	struct mlens_ring a, b;
	struct mlens_bytering br;
	struct item it[4];
	int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), st, met;
	int64_t t0;
	uint32_t off;
	void *p;
	pid_t pid;

	ck_assert_ptr_ne(mem, MAP_FAILED);
	ck_assert_int_ge(efd, 0);
	ck_assert_int_eq(mlens_ring_init(&a, mem, (size_t)rsz, 4, sizeof(struct item)), 0);
	ck_assert_int_eq(mlens_ring_init(&b, mem + rsz, (size_t)rsz, 4, sizeof(struct item)), 0);
	ck_assert_int_eq(mlens_bytering_init(&br, mem + 2 * rsz, (size_t)bsz, 256), 0);
	for (int i = 0; i < 4; i++)
		it[i] = item_of((uint64_t)i);
	ck_assert_int_eq(mlens_ring_enqueue_bulk(&a, it, 4), 4);	/* a: full */
	ck_assert_int_eq(mlens_bytering_reserve(&br, 120, &off, &p), 0);
	ck_assert_int_eq(mlens_bytering_reserve(&br, 120, &off, &p), 0);
	mlens_bytering_commit(&br);	/* 240 of 256 bytes used */

	{
		struct mlens_ring_cond c[3] = {
			{ .ring = &a, .kind = MLENS_RING_WRITABLE, .need = 1 },
			{ .ring = &b, .kind = MLENS_RING_READABLE },
			{ .ring = &br.ring, .kind = MLENS_RING_RESERVABLE, .need = 100 },
		};

		t0 = mono_ms();
		ck_assert_int_eq(mlens_ring_wait_any(c, 3, efd, 30), 0);	/* none: timeout */
		ck_assert_int_ge(mono_ms() - t0, 25);
		ck_assert(!mlens_ring_cons_needs_wakeup(&b));
		ck_assert(!mlens_ring_prod_needs_wakeup(&a));

		for (int round = 0; round < 3; round++) {
			pid = fork();
			ck_assert_int_ge(pid, 0);
			if (pid == 0) {
				struct item x = item_of(9);
				struct timespec ts = { 0, 30 * 1000000 };

				nanosleep(&ts, NULL);
				if (round == 0 && mlens_ring_enqueue_bulk(&b, &x, 1) == 1)
					_exit(mlens_ring_wake_cons(&b, efd) == 1 ? 0 : 1);
				if (round == 1 && mlens_ring_dequeue_bulk(&a, &x, 1) == 1)
					_exit(mlens_ring_wake_prod(&a, efd) == 1 ? 0 : 2);
				if (round == 2 && mlens_bytering_release(&br, 0, 120) == 0)
					_exit(mlens_ring_wake_prod(&br.ring, efd) == 1 ? 0 : 3);
				_exit(4);
			}
			t0 = mono_ms();
			ck_assert_int_eq(mlens_ring_wait_any(c, 3, efd, 5000), 1);
			ck_assert_int_ge(mono_ms() - t0, 20);	/* it did sleep */
			ck_assert_int_eq(waitpid(pid, &st, 0), pid);
			ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "round %d: 0x%x",
				      round, st);
			/* round 0 fills b (c[1]), 1 frees a slot of a (c[0]), 2 frees
			 * bytes of the byte ring (c[2]): 136 free, a 100-byte record
			 * needs 104 plus 16 of padding at the end. */
			met = round == 0 ? 1 : round == 1 ? 0 : 2;
			ck_assert_int_eq(c[met].ready, round == 2 ? 136 : 1);
			for (int i = 0; i < 3; i++)
				if (i != met)
					ck_assert_int_eq(c[i].ready, 0);
			/* Undo, so the next round starts with nothing met. */
			if (round == 0)
				ck_assert_int_eq(mlens_ring_dequeue_bulk(&b, it, 1), 1);
			if (round == 1)
				ck_assert_int_eq(mlens_ring_enqueue_bulk(&a, it, 1), 1);
		}
		ck_assert(!mlens_ring_cons_needs_wakeup(&b));
		ck_assert(!mlens_ring_prod_needs_wakeup(&a));
		ck_assert(!mlens_ring_prod_needs_wakeup(&br.ring));
		c[0].need = 5;	/* more than the ring holds */
		ck_assert_int_eq(mlens_ring_wait_any(c, 3, efd, 0), -EINVAL);
		c[0].need = 1;
		c[2].need = 129;	/* above the byte ring's largest record */
		ck_assert_int_eq(mlens_ring_wait_any(c, 3, efd, 0), -EINVAL);
	}
	close(efd);
	munmap(mem, total);
}
END_TEST

/* ==== Byte ring ==== */

static struct mlens_bytering *bring_at(uint32_t size, uint32_t start, void **mem)
{
	static struct mlens_bytering b;
	ssize_t sz = mlens_bytering_memsize(size);

	ck_assert_int_gt(sz, 0);
	*mem = xalloc((size_t)sz);
	ck_assert_int_eq(mlens_bytering_init(&b, *mem, (size_t)sz, size), 0);
	b.ring.shm->head = start;
	b.ring.shm->tail = start;
	ck_assert_int_eq(mlens_bytering_attach(&b, *mem, (size_t)sz), 0);
	return &b;
}

static void fill_pattern(void *p, uint32_t len, uint32_t seed)
{
	unsigned char *c = p;

	for (uint32_t i = 0; i < len; i++)
		c[i] = (unsigned char)(seed * 31 + i * 7);
}

static int check_pattern(const void *p, uint32_t len, uint32_t seed)
{
	const unsigned char *c = p;

	for (uint32_t i = 0; i < len; i++)
		if (c[i] != (unsigned char)(seed * 31 + i * 7))
			return 0;
	return 1;
}

START_TEST(test_bytering_basic)
{
	void *mem;
	struct mlens_bytering *b = bring_at(256, 0, &mem);
	unsigned char buf[256];
	uint32_t off, off2;
	void *p;

	ck_assert_int_eq(mlens_bytering_memsize(32), -EINVAL);
	ck_assert_uint_eq(mlens_bytering_max_record(b), 128);
	ck_assert_int_eq(mlens_bytering_reserve(b, 0, &off, &p), -EMSGSIZE);
	ck_assert_int_eq(mlens_bytering_reserve(b, 129, &off, &p), -EMSGSIZE);
	ck_assert_int_eq(mlens_bytering_reserve(b, 13, &off, &p), 0);
	ck_assert_uint_eq(off, 0);
	fill_pattern(p, 13, 1);
	/* Not yet committed: the consumer cannot see it. */
	ck_assert_int_eq(mlens_bytering_read(b, off, 13, buf), -EFAULT);
	mlens_bytering_commit(b);
	ck_assert_int_eq(mlens_bytering_reserve(b, 8, &off2, &p), 0);
	ck_assert_uint_eq(off2, 16);	/* 13 rounded up to the 8-byte alignment */
	mlens_bytering_abort(b);
	ck_assert_uint_eq(b->ring.shm->tail, 16);
	ck_assert_int_eq(mlens_bytering_reserve(b, 8, &off2, &p), 0);
	ck_assert_uint_eq(off2, 16);	/* the aborted space is reused */
	mlens_bytering_abort(b);
	ck_assert_int_eq(mlens_bytering_read(b, off, 13, buf), 0);
	ck_assert(check_pattern(buf, 13, 1));
	ck_assert_int_eq(mlens_bytering_read(b, off, 17, buf), -EFAULT);	/* past committed */
	ck_assert_int_eq(mlens_bytering_release(b, off, 13), 0);
	ck_assert_uint_eq(b->ring.shm->head, 16);
	ck_assert_int_eq(mlens_bytering_release(b, off, 13), -EFAULT);	/* already freed */
	free(mem);
}
END_TEST

/* Records of assorted lengths go round a 256-byte ring many times, from
 * indexes just below UINT32_MAX: every record reads back intact, a record
 * that would straddle the end starts at 0, and a full ring says -EAGAIN. */
START_TEST(test_bytering_wrap)
{
	void *mem;
	const uint32_t start = UINT32_MAX - 255;	/* 8-aligned, wraps soon */
	struct mlens_bytering *b = bring_at(256, start, &mem);
	struct rec { uint32_t off, len, seed; } q[64];
	unsigned qh = 0, qt = 0, wrapped = 0, fulls = 0;
	unsigned char buf[256];

	for (uint32_t seed = 0; seed < 3000; seed++) {
		uint32_t len = 1 + (seed * 37) % 128, off;
		void *p;
		int err = mlens_bytering_reserve(b, len, &off, &p);

		if (err == -EAGAIN) {
			fulls++;
			ck_assert_uint_gt(qt - qh, 0);	/* full only with records held */
			ck_assert_int_eq(mlens_bytering_read(b, q[qh % 64].off, q[qh % 64].len, buf), 0);
			ck_assert(check_pattern(buf, q[qh % 64].len, q[qh % 64].seed));
			ck_assert_int_eq(mlens_bytering_release(b, q[qh % 64].off, q[qh % 64].len), 0);
			qh++;
			seed--;	/* retry this record */
			continue;
		}
		ck_assert_int_eq(err, 0);
		ck_assert_uint_eq(off % MLENS_BYTERING_ALIGN, 0);
		ck_assert_uint_le(off + len, 256);
		if (off == 0)
			wrapped++;
		fill_pattern(p, len, seed);
		mlens_bytering_commit(b);
		q[qt % 64] = (struct rec){ off, len, seed };
		qt++;
		ck_assert_uint_lt(qt - qh, 64);
	}
	while (qh != qt) {
		ck_assert_int_eq(mlens_bytering_read(b, q[qh % 64].off, q[qh % 64].len, buf), 0);
		ck_assert(check_pattern(buf, q[qh % 64].len, q[qh % 64].seed));
		ck_assert_int_eq(mlens_bytering_release(b, q[qh % 64].off, q[qh % 64].len), 0);
		qh++;
	}
	ck_assert_uint_gt(wrapped, 100);
	ck_assert_uint_gt(fulls, 100);
	ck_assert_uint_eq(b->ring.shm->head, b->ring.shm->tail);
	ck_assert_uint_lt(b->ring.shm->tail, start);	/* indexes wrapped past 0 */
	free(mem);
}
END_TEST

/* Whatever a hostile producer names, the consumer copies nothing from
 * outside the ring nor beyond what was committed. */
START_TEST(test_bytering_hostile)
{
	void *mem;
	struct mlens_bytering *b = bring_at(256, 64, &mem);
	unsigned char buf[256];
	uint32_t off;
	void *p;

	ck_assert_int_eq(mlens_bytering_reserve(b, 40, &off, &p), 0);
	ck_assert_uint_eq(off, 64);
	mlens_bytering_commit(b);
	ck_assert_int_eq(mlens_bytering_read(b, 65, 8, buf), -EFAULT);	/* misaligned */
	ck_assert_int_eq(mlens_bytering_read(b, 256, 8, buf), -EFAULT);	/* past the end */
	ck_assert_int_eq(mlens_bytering_read(b, 248, 16, buf), -EFAULT);	/* runs off the end */
	ck_assert_int_eq(mlens_bytering_read(b, UINT32_MAX - 7, 16, buf), -EFAULT);
	ck_assert_int_eq(mlens_bytering_read(b, 64, 48, buf), -EFAULT);	/* beyond commit */
	ck_assert_int_eq(mlens_bytering_read(b, 0, 8, buf), -EFAULT);	/* before head */
	ck_assert_int_eq(mlens_bytering_read(b, 64, 0, buf), -EFAULT);
	ck_assert_int_eq(mlens_bytering_release(b, 72, 40), -EFAULT);
	ck_assert_int_eq(mlens_bytering_read(b, 64, 40, buf), 0);
	ck_assert_int_eq(mlens_bytering_read(b, 72, 32, buf), 0);	/* inside committed bytes */
	b->ring.shm->tail = 64 + 257;	/* corrupt: more than the ring holds */
	/* Within the tail already seen and checked, nothing is re-read... */
	ck_assert_int_eq(mlens_bytering_read(b, 64, 40, buf), 0);
	/* ...past it the producer's tail is re-read, and caught. */
	ck_assert_int_eq(mlens_bytering_read(b, 64, 48, buf), -EPROTO);
	ck_assert_int_eq(mlens_bytering_release(b, 64, 48), -EPROTO);
	b->ring.shm->tail = 64 + 40;
	ck_assert_int_eq(mlens_bytering_release(b, 64, 40), 0);
	ck_assert_uint_eq(b->ring.shm->head, 64 + 40);
	free(mem);
}
END_TEST

/* ==== Region ==== */

static const struct mlens_region_limits test_limits = {
	.max_prompt_tokens = 4096,
	.max_tokens = 1024,
	.max_context = 4096,
	.vocab_size = 32000,
};

static void *region_new(struct mlens_region *rg, size_t *size)
{
	struct mlens_region_params p = MLENS_REGION_PARAMS_DEFAULT;
	char why[256] = "";
	void *mem;

	ck_assert_int_eq(mlens_region_size(&p, size), 0);
	mem = xalloc(*size);
	ck_assert_msg(mlens_region_format(rg, mem, *size, &p, &test_limits, why, sizeof(why)) == 0,
		      "format: %s", why);
	return mem;
}

START_TEST(test_region_layout)
{
	struct mlens_region d, c;
	size_t size;
	void *mem = region_new(&d, &size);
	struct mlens_region_hdr *h = mem;
	struct mlens_sub s = { .id = 42, .op = MLENS_OP_GENERATE }, got;
	struct mlens_cmpl cm = { .id = 42, .token = 5, .flags = MLENS_CMPL_FIRST }, gotc;
	char why[256] = "";

	/* 256 header + 1024*128 + 8192*32 + 1 MiB + three 256-byte ring heads,
	 * rounded to a page. */
	ck_assert_uint_eq(size, (256 + 3 * 256 + 131072 + 262144 + 1048576 + 4095) / 4096 * 4096);
	ck_assert_uint_eq(h->magic, MLENS_REGION_MAGIC);
	ck_assert_uint_eq(h->version, MLENS_PROTO_VERSION);
	ck_assert_uint_eq(h->total_size, size);
	ck_assert_uint_eq(h->sub.offset, 256);
	ck_assert_uint_eq(h->sub.entries, 1024);
	ck_assert_uint_eq(h->sub.esize, sizeof(struct mlens_sub));
	ck_assert_uint_eq(h->cmpl.offset, h->sub.offset + h->sub.size);
	ck_assert_uint_eq(h->cmpl.entries, 8192);
	ck_assert_uint_eq(h->prompt.entries, 1u << 20);
	ck_assert_uint_eq(h->limits.prompt_bytes, 1u << 20);
	ck_assert_uint_eq(d.limits.prompt_bytes, 1u << 20);
	ck_assert_uint_eq(h->limits.vocab_size, 32000);

	ck_assert_msg(mlens_region_attach(&c, mem, size, why, sizeof(why)) == 0, "attach: %s", why);
	ck_assert_uint_eq(c.size, size);
	ck_assert_uint_eq(c.sub.entries, d.sub.entries);
	ck_assert_uint_eq(c.cmpl.entries, d.cmpl.entries);
	ck_assert_uint_eq(c.prompt.ring.entries, d.prompt.ring.entries);
	ck_assert_uint_eq(c.limits.max_context, 4096);
	/* Both handles see the same rings. */
	ck_assert_int_eq(mlens_ring_enqueue_bulk(&c.sub, &s, 1), 1);
	ck_assert_int_eq(mlens_ring_dequeue_bulk(&d.sub, &got, 1), 1);
	ck_assert_uint_eq(got.id, 42);
	ck_assert_int_eq(mlens_ring_enqueue_bulk(&d.cmpl, &cm, 1), 1);
	ck_assert_int_eq(mlens_ring_dequeue_bulk(&c.cmpl, &gotc, 1), 1);
	ck_assert_int_eq(gotc.token, 5);
	free(mem);
}
END_TEST

START_TEST(test_region_format_rejects)
{
	struct mlens_region rg;
	struct mlens_region_params p = MLENS_REGION_PARAMS_DEFAULT;
	struct mlens_region_limits l = test_limits;
	char why[256] = "";
	size_t size;
	void *mem;

	ck_assert_int_eq(mlens_region_size(&p, &size), 0);
	mem = xalloc(size);
	ck_assert_int_eq(mlens_region_format(&rg, mem, size - 4096, &p, &l, why, sizeof(why)),
			 -EINVAL);
	ck_assert_int_eq(mlens_region_format(&rg, (char *)mem + 64, size - 4096, &p, &l, NULL, 0),
			 -EINVAL);
	p.sub_entries = 1000;
	ck_assert_int_eq(mlens_region_size(&p, &size), -EINVAL);
	ck_assert_int_eq(mlens_region_format(&rg, mem, size, &p, &l, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "powers of two"));
	p.sub_entries = 1024;
	p.prompt_bytes = 32;
	ck_assert_int_eq(mlens_region_size(&p, &size), -EINVAL);
	p.prompt_bytes = 4096;	/* too small for 4096-token prompts */
	ck_assert_int_eq(mlens_region_size(&p, &size), 0);
	ck_assert_int_eq(mlens_region_format(&rg, mem, size, &p, &l, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "max_prompt_tokens"));
	l.max_prompt_tokens = 512;
	l.max_context = 4096;
	ck_assert_int_eq(mlens_region_format(&rg, mem, size, &p, &l, why, sizeof(why)), 0);
	l.vocab_size = 0;
	ck_assert_int_eq(mlens_region_format(&rg, mem, size, &p, &l, why, sizeof(why)), -EINVAL);
	free(mem);
}
END_TEST

struct corruption {
	const char *name;
	void (*mutate)(struct mlens_region_hdr *h, unsigned char *base);
	int err;
	const char *why;	/* substring of the reason */
};

#define MUT(fn, body) \
	static void fn(struct mlens_region_hdr *h, unsigned char *base) { (void)base; body; }
MUT(m_magic, h->magic = 0x12345678)
MUT(m_version, h->version = MLENS_PROTO_VERSION + 1)
MUT(m_hdr_size, h->hdr_size = 128)
MUT(m_flags, h->flags = 1)
MUT(m_reserved, h->reserved[7] = 1)
MUT(m_total_big, h->total_size += 4096)
MUT(m_total_odd, h->total_size -= 100)
MUT(m_sub_esize, h->sub.esize = 64)
MUT(m_cmpl_esize, h->cmpl.esize = 16)
MUT(m_prompt_esize, h->prompt.esize = 4)
MUT(m_sub_entries, h->sub.entries = 1000)
MUT(m_sub_entries_pow2, h->sub.entries = 2048)
MUT(m_cmpl_entries_zero, h->cmpl.entries = 0)
MUT(m_prompt_small, h->prompt.entries = 32)
MUT(m_sub_size, h->sub.size += 64)
MUT(m_sub_off_align, h->sub.offset += 8)
MUT(m_sub_off_hdr, h->sub.offset = 64)
MUT(m_cmpl_off_past, h->cmpl.offset = h->total_size)
MUT(m_prompt_off_huge, h->prompt.offset = UINT64_MAX - 63)
MUT(m_prompt_off_end, h->prompt.offset = h->total_size - h->prompt.size + 64)
MUT(m_overlap, h->cmpl.offset = h->sub.offset + 64)
MUT(m_lim_vocab, h->limits.vocab_size = 0)
MUT(m_lim_prompt, h->limits.max_prompt_tokens = 1u << 20)
MUT(m_lim_reserved, h->limits.reserved[0] = 3)
MUT(m_lim_ringsize, h->limits.prompt_bytes = 1u << 19)
MUT(m_ring_magic, ((struct mlens_ring_shm *)(base + h->cmpl.offset))->magic = 0)
MUT(m_ring_entries, ((struct mlens_ring_shm *)(base + h->sub.offset))->entries = 512)
MUT(m_ring_esize, ((struct mlens_ring_shm *)(base + h->sub.offset))->esize = 64)
MUT(m_ring_index, ((struct mlens_ring_shm *)(base + h->sub.offset))->tail = 4096)
MUT(m_bring_magic, ((struct mlens_ring_shm *)(base + h->prompt.offset))->magic = MLENS_RING_MAGIC)
MUT(m_bring_index, ((struct mlens_ring_shm *)(base + h->prompt.offset))->tail = 12)

static const struct corruption corruptions[] = {
	{ "magic", m_magic, -EPROTO, "magic" },
	{ "version", m_version, -EPROTO, "version" },
	{ "hdr_size", m_hdr_size, -EPROTO, "header of" },
	{ "flags", m_flags, -EPROTO, "flags" },
	{ "reserved", m_reserved, -EPROTO, "reserved" },
	{ "total_size too big", m_total_big, -EINVAL, "mapping has" },
	{ "total_size not pages", m_total_odd, -EINVAL, "whole number of pages" },
	{ "sub esize", m_sub_esize, -EPROTO, "submission ring entries are 64" },
	{ "cmpl esize", m_cmpl_esize, -EPROTO, "completion ring entries" },
	{ "prompt esize", m_prompt_esize, -EPROTO, "prompt ring entries" },
	{ "sub entries", m_sub_entries, -EINVAL, "submission ring has 1000" },
	{ "sub entries vs size", m_sub_entries_pow2, -EINVAL, "submission ring size" },
	{ "cmpl entries 0", m_cmpl_entries_zero, -EINVAL, "completion ring has 0" },
	{ "prompt too small", m_prompt_small, -EINVAL, "prompt ring has 32" },
	{ "sub size", m_sub_size, -EINVAL, "submission ring size" },
	{ "sub offset misaligned", m_sub_off_align, -EINVAL, "misaligned" },
	{ "sub offset in header", m_sub_off_hdr, -EINVAL, "inside the header" },
	{ "cmpl offset past end", m_cmpl_off_past, -EINVAL, "past the region" },
	{ "prompt offset huge", m_prompt_off_huge, -EINVAL, "past the region" },
	{ "prompt runs past end", m_prompt_off_end, -EINVAL, "past the region" },
	{ "overlap", m_overlap, -EINVAL, "overlap" },
	{ "limits vocab", m_lim_vocab, -EINVAL, "at least 1" },
	{ "limits prompt", m_lim_prompt, -EINVAL, "max_prompt_tokens" },
	{ "limits reserved", m_lim_reserved, -EINVAL, "reserved" },
	{ "limits ring size", m_lim_ringsize, -EINVAL, "prompt ring" },
	{ "ring magic", m_ring_magic, -EPROTO, "completion ring header has a bad magic" },
	{ "ring entries", m_ring_entries, -EINVAL, "submission ring header disagrees" },
	{ "ring esize", m_ring_esize, -EINVAL, "submission ring header disagrees" },
	{ "ring index", m_ring_index, -EINVAL, "submission ring header disagrees" },
	{ "byte ring magic", m_bring_magic, -EPROTO, "prompt ring header has a bad magic" },
	{ "byte ring index", m_bring_index, -EINVAL, "prompt ring header disagrees" },
};

START_TEST(test_region_corrupt)
{
	const struct corruption *c = &corruptions[_i];
	struct mlens_region d, a;
	size_t size;
	void *mem = region_new(&d, &size);
	char why[256] = "";
	int err;

	c->mutate(mem, mem);
	err = mlens_region_attach(&a, mem, size, why, sizeof(why));
	ck_assert_msg(err == c->err, "%s: got %d (%s), want %d", c->name, err, why, c->err);
	ck_assert_msg(strstr(why, c->why), "%s: reason \"%s\" lacks \"%s\"", c->name, why, c->why);
	free(mem);
}
END_TEST

START_TEST(test_region_attach_small)
{
	struct mlens_region d, a;
	size_t size;
	void *mem = region_new(&d, &size);
	char why[256] = "";

	ck_assert_int_eq(mlens_region_attach(&a, mem, 100, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "smaller than"));
	ck_assert_int_eq(mlens_region_attach(&a, mem, size - 4096, why, sizeof(why)), -EINVAL);
	ck_assert_int_eq(mlens_region_attach(&a, (char *)mem + 8, size - 8, why, sizeof(why)),
			 -EINVAL);
	ck_assert_int_eq(mlens_region_attach(&a, mem, size + 4096, NULL, 0), 0);
	ck_assert_uint_eq(a.size, size);
	free(mem);
}
END_TEST

/* Random headers (with a valid magic and version, so that the checks past
 * them run) never crash attach and are never accepted. */
START_TEST(test_region_random_headers)
{
	struct mlens_region d, a;
	size_t size;
	void *mem = region_new(&d, &size);
	struct mlens_region_hdr *h = mem;
	unsigned char *raw = mem;
	unsigned seed = 12345;

	for (int iter = 0; iter < 20000; iter++) {
		int err;

		for (size_t i = 0; i < sizeof(*h); i++)
			raw[i] = (unsigned char)rand_r(&seed);
		h->magic = MLENS_REGION_MAGIC;
		if (iter % 2) {
			h->version = MLENS_PROTO_VERSION;
			h->hdr_size = sizeof(*h);
			h->flags = 0;
			memset(h->reserved, 0, sizeof(h->reserved));
		}
		if (iter % 4 == 3)
			h->total_size = size;
		err = mlens_region_attach(&a, mem, size, NULL, 0);
		ck_assert_msg(err == -EPROTO || err == -EINVAL, "iter %d: %d", iter, err);
	}
	free(mem);
}
END_TEST

/* ==== Region: memfd, submit and take ==== */

START_TEST(test_region_memfd)
{
	struct mlens_region_params p = MLENS_REGION_PARAMS_DEFAULT;
	struct mlens_region d, c;
	struct mlens_sub s = { .id = 5, .op = MLENS_OP_CANCEL }, got;
	char why[256] = "";
	int fd, seals, plain;

	ck_assert_msg(mlens_region_create(&d, &fd, &p, &test_limits, why, sizeof(why)) == 0,
		      "create: %s", why);
	seals = fcntl(fd, F_GET_SEALS);
	ck_assert_int_eq(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
			 F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
	ck_assert_int_ne(ftruncate(fd, 4096), 0);	/* a tenant cannot shrink it */
	ck_assert_int_eq(errno, EPERM);
	ck_assert_msg(mlens_region_map(&c, fd, why, sizeof(why)) == 0, "map: %s", why);
	ck_assert_ptr_ne(c.base, d.base);	/* a second mapping of the same pages */
	ck_assert_uint_eq(c.size, d.size);
	ck_assert_int_eq(mlens_region_submit(&c, &s, NULL, -1), 0);
	ck_assert_int_eq(mlens_ring_dequeue_bulk(&d.sub, &got, 1), 1);
	ck_assert_uint_eq(got.id, 5);
	mlens_region_unmap(&c);
	mlens_region_unmap(&d);
	ck_assert_ptr_null(d.base);
	close(fd);

	plain = memfd_create("unsealed", MFD_CLOEXEC);
	ck_assert_int_ge(plain, 0);
	ck_assert_int_eq(ftruncate(plain, 1 << 21), 0);
	ck_assert_int_eq(mlens_region_map(&c, plain, why, sizeof(why)), -EPERM);
	ck_assert_ptr_nonnull(strstr(why, "not sealed"));
	close(plain);
}
END_TEST

/* Small rings so that the prompt ring wraps often. */
static const struct mlens_region_params small_params = { 16, 64, 4096 };
static const struct mlens_region_limits small_limits = {
	.max_prompt_tokens = 256, .max_tokens = 64, .max_context = 512, .vocab_size = 1000,
};

static int32_t prompt_token(uint64_t id, uint32_t i)
{
	return (int32_t)((id * 131 + i * 7) % 1000);
}

static uint32_t prompt_len_of(uint64_t id)
{
	return 1 + (uint32_t)(id * 37 % 256);
}

static struct mlens_sub request(uint64_t id)
{
	return (struct mlens_sub){ .id = id, .op = MLENS_OP_GENERATE,
		.prompt_len = prompt_len_of(id), .max_tokens = 16, .temperature = 0.5f,
		.top_p = 1.0f, .seed = id };
}

/* Requests go through submit and take in one process: every prompt comes
 * back intact, rejected requests release their prompt (else the ring would
 * fill and submit stall), and cancels carry no prompt. */
START_TEST(test_region_submit_take)
{
	struct mlens_region d, c;
	size_t size;
	void *mem;
	char why[256] = "";
	int32_t prompt[256], got_tokens[256];
	uint64_t next = 0, taken = 0;
	int rejected = 0, cancels = 0;

	ck_assert_int_eq(mlens_region_size(&small_params, &size), 0);
	mem = xalloc(size);
	ck_assert_msg(mlens_region_format(&d, mem, size, &small_params, &small_limits, why,
					  sizeof(why)) == 0, "%s", why);
	ck_assert_int_eq(mlens_region_attach(&c, mem, size, why, sizeof(why)), 0);
	while (taken < 3000) {
		for (;;) {
			struct mlens_sub s = request(next);
			int err;

			for (uint32_t i = 0; i < s.prompt_len; i++)
				prompt[i] = prompt_token(next, i);
			if (next % 10 == 3)
				prompt[s.prompt_len - 1] = 1000;	/* outside the vocabulary */
			if (next % 10 == 7)
				s.temperature = NAN;
			if (next % 10 == 9)
				s = (struct mlens_sub){ .id = next - 1, .op = MLENS_OP_CANCEL };
			err = mlens_region_submit(&c, &s, prompt, -1);
			if (err == -EAGAIN)
				break;
			ck_assert_int_eq(err, 0);
			next++;
		}
		ck_assert_uint_gt(next, taken);	/* room was made by the takes below */
		for (;;) {
			struct mlens_sub s;
			int status = 99, n;

			n = mlens_region_take(&d, &s, got_tokens, &status, why, sizeof(why));
			ck_assert_int_ge(n, 0);
			if (n == 0)
				break;
			ck_assert_uint_eq(s.id, taken % 10 == 9 ? taken - 1 : taken);
			if (taken % 10 == 3) {
				ck_assert_int_eq(status, -ERANGE);
				rejected++;
			} else if (taken % 10 == 7) {
				ck_assert_int_eq(status, -EINVAL);
				ck_assert_ptr_nonnull(strstr(why, "temperature"));
				rejected++;
			} else if (taken % 10 == 9) {
				ck_assert_int_eq(status, 0);
				ck_assert_int_eq(s.op, MLENS_OP_CANCEL);
				cancels++;
			} else {
				ck_assert_msg(status == 0, "request %llu: %s",
					      (unsigned long long)taken, why);
				ck_assert_uint_eq(s.prompt_len, prompt_len_of(taken));
				for (uint32_t i = 0; i < s.prompt_len; i++)
					ck_assert_int_eq(got_tokens[i], prompt_token(taken, i));
			}
			taken++;
		}
		ck_assert_uint_eq(taken, next);
	}
	ck_assert_int_eq(rejected, 600);
	ck_assert_int_eq(cancels, 300);
	/* Everything was released: the prompt ring is empty again. */
	ck_assert_uint_eq(d.prompt.ring.shm->head, d.prompt.ring.shm->tail);
	ck_assert_uint_gt(d.prompt.ring.shm->tail, 100u * 4096);	/* it wrapped many times */
	ck_assert_int_eq(mlens_region_submit(&c, &(struct mlens_sub){ .op = MLENS_OP_GENERATE,
		.prompt_len = 257 }, prompt, -1), -EMSGSIZE);
	ck_assert_int_eq(mlens_region_submit(&c, &(struct mlens_sub){ .op = MLENS_OP_GENERATE },
					     prompt, -1), -EINVAL);
	free(mem);
}
END_TEST

/* A tenant writing random bytes into its submission and prompt rings gets
 * one error status per entry; the daemon never crashes, and a corrupt
 * index is reported as -EPROTO. */
START_TEST(test_region_take_hostile)
{
	struct mlens_region d, c;
	size_t size;
	void *mem;
	char why[256];
	int32_t tokens[256];
	unsigned seed = 4242;
	int bad = 0;

	ck_assert_int_eq(mlens_region_size(&small_params, &size), 0);
	mem = xalloc(size);
	ck_assert_int_eq(mlens_region_format(&d, mem, size, &small_params, &small_limits, why,
					     sizeof(why)), 0);
	ck_assert_int_eq(mlens_region_attach(&c, mem, size, why, sizeof(why)), 0);
	for (int round = 0; round < 2000; round++) {
		unsigned char junk[sizeof(struct mlens_sub)];
		unsigned char *pb = c.prompt.ring.data;
		struct mlens_sub s;
		int status = 99, n;

		for (size_t i = 0; i < sizeof(junk); i++)
			junk[i] = (unsigned char)rand_r(&seed);
		if (round % 2) {	/* plausible enough to reach the prompt */
			struct mlens_sub *j = (struct mlens_sub *)junk;

			j->op = MLENS_OP_GENERATE;
			j->flags = 0;
			j->reserved0 = 0;
			memset(j->reserved, 0, sizeof(j->reserved));
			j->prompt_len = 1 + j->prompt_len % 256;
			j->prompt_off = (j->prompt_off % 4096) & ~7u;
			j->max_tokens = 1;
			j->temperature = 0;
			j->top_p = 1;
			j->top_k = 0;
			j->n_stop = 0;
			memset(j->stop, 0, sizeof(j->stop));
		}
		for (int i = 0; i < 64; i++)	/* and random prompt bytes */
			pb[rand_r(&seed) % 4096] = (unsigned char)rand_r(&seed);
		ck_assert_int_eq(mlens_ring_enqueue_bulk(&c.sub, junk, 1), 1);
		n = mlens_region_take(&d, &s, tokens, &status, why, sizeof(why));
		ck_assert_int_eq(n, 1);
		ck_assert_msg(status == 0 || status == -EINVAL || status == -E2BIG ||
			      status == -EFAULT || status == -ERANGE, "round %d: %d", round, status);
		if (status)
			bad++;
	}
	ck_assert_int_ge(bad, 1990);
	/* Valid requests still flow afterwards. */
	{
		struct mlens_sub s = request(1), got;
		int32_t prompt[256];
		int status = 99;

		for (uint32_t i = 0; i < s.prompt_len; i++)
			prompt[i] = prompt_token(1, i);
		ck_assert_int_eq(mlens_region_submit(&c, &s, prompt, -1), 0);
		ck_assert_int_eq(mlens_region_take(&d, &got, tokens, &status, why, sizeof(why)), 1);
		ck_assert_msg(status == 0, "%s", why);
		ck_assert_int_eq(tokens[s.prompt_len - 1], prompt_token(1, s.prompt_len - 1));
	}
	d.sub.shm->tail += 100;	/* corrupt index */
	ck_assert_int_eq(mlens_region_take(&d, &(struct mlens_sub){ 0 }, tokens, &(int){ 0 },
					   why, sizeof(why)), -EPROTO);
	free(mem);
}
END_TEST

/* Daemon (parent) and client (child) over a real memfd and two eventfds:
 * the client maps the fd itself, submits requests as fast as the rings
 * allow (sleeping on its doorbell when they are full), and checks the one
 * completion each request gets; the daemon takes, checks the prompt and
 * answers with the prompt's token sum. */
#define E2E_REQUESTS 20000u

static int e2e_client(int fd, int daemon_efd, int client_efd)
{
	struct mlens_region c;
	int32_t prompt[256];
	struct mlens_cmpl cm[64];
	uint64_t next = 0, done = 0;
	const uint64_t cap = small_params.cmpl_entries;	/* outstanding at most */

	if (mlens_region_map(&c, fd, NULL, 0))
		return 10;
	while (done < E2E_REQUESTS) {
		int n;

		while (next < E2E_REQUESTS && next - done < cap) {
			struct mlens_sub s = request(next);
			int err;

			for (uint32_t i = 0; i < s.prompt_len; i++)
				prompt[i] = prompt_token(next, i);
			err = mlens_region_submit(&c, &s, prompt, daemon_efd);
			if (err == -EAGAIN) {
				if (next > done)
					break;	/* collect completions first */
				if (mlens_region_wait_submit(&c, client_efd, s.prompt_len, 10000) <= 0)
					return 11;
				continue;
			}
			if (err)
				return 12;
			next++;
		}
		n = mlens_ring_dequeue_burst(&c.cmpl, cm, 64);
		if (n < 0)
			return 13;
		if (n == 0) {
			if (mlens_ring_wait_cons(&c.cmpl, client_efd, 10000) <= 0)
				return 14;
			continue;
		}
		for (int i = 0; i < n; i++) {
			int64_t sum = 0;

			if (mlens_cmpl_validate(&cm[i], NULL, 0))
				return 17;
			for (uint32_t k = 0; k < prompt_len_of(done); k++)
				sum += prompt_token(done, k);
			if (cm[i].id != done || cm[i].token != (int32_t)(sum % 1000) ||
			    cm[i].flags != (MLENS_CMPL_FIRST | MLENS_CMPL_LAST | MLENS_CMPL_TOKEN) ||
			    cm[i].finish != MLENS_FINISH_LENGTH || cm[i].status)
				return 15;
			done++;
		}
		if (mlens_ring_wake_prod(&c.cmpl, daemon_efd) < 0)
			return 16;
	}
	mlens_region_unmap(&c);
	return 0;
}

START_TEST(test_region_two_process)
{
	struct mlens_region d;
	char why[256] = "";
	int32_t tokens[256];
	uint64_t answered = 0;
	int fd, daemon_efd, client_efd, st;
	pid_t pid;

	ck_assert_msg(mlens_region_create(&d, &fd, &small_params, &small_limits, why,
					  sizeof(why)) == 0, "%s", why);
	daemon_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	client_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	ck_assert(daemon_efd >= 0 && client_efd >= 0);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		mlens_region_unmap(&d);	/* the client maps the fd on its own */
		_exit(e2e_client(fd, daemon_efd, client_efd));
	}
	while (answered < E2E_REQUESTS) {
		struct mlens_sub s;
		struct mlens_cmpl cm = { .flags = MLENS_CMPL_FIRST | MLENS_CMPL_LAST |
					 MLENS_CMPL_TOKEN, .finish = MLENS_FINISH_LENGTH };
		int status = 99, n;
		int64_t sum = 0;

		n = mlens_region_take(&d, &s, tokens, &status, why, sizeof(why));
		ck_assert_int_ge(n, 0);
		if (n == 0) {
			n = mlens_ring_wait_cons(&d.sub, daemon_efd, 10000);
			ck_assert_msg(n > 0, "daemon waited 10 s after %llu: %d",
				      (unsigned long long)answered, n);
			continue;
		}
		ck_assert_msg(status == 0, "request %llu: %s", (unsigned long long)s.id, why);
		ck_assert_uint_eq(s.id, answered);
		for (uint32_t i = 0; i < s.prompt_len; i++)
			sum += tokens[i];
		cm.id = s.id;
		cm.token = (int32_t)(sum % 1000);
		/* The client keeps at most cmpl_entries outstanding. */
		ck_assert_int_eq(mlens_ring_enqueue_bulk(&d.cmpl, &cm, 1), 1);
		ck_assert_int_ge(mlens_ring_wake_cons(&d.cmpl, client_efd), 0);
		ck_assert_int_ge(mlens_ring_wake_prod(&d.sub, client_efd), 0);
		ck_assert_int_ge(mlens_ring_wake_prod(&d.prompt.ring, client_efd), 0);
		answered++;
	}
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "client status 0x%x", st);
	ck_assert_int_eq(mlens_ring_count(&d.sub), 0);
	mlens_region_unmap(&d);
	close(fd);
	close(daemon_efd);
	close(client_efd);
}
END_TEST

/* ==== Protocol ==== */

static const struct mlens_region_limits plim = {
	.max_prompt_tokens = 1000,
	.max_tokens = 500,
	.max_context = 1200,
	.vocab_size = 32000,
	.prompt_bytes = 65536,
};

static struct mlens_sub good_sub(void)
{
	return (struct mlens_sub){
		.id = 7, .op = MLENS_OP_GENERATE, .n_stop = 2, .flags = MLENS_SUB_LOGPROBS,
		.prompt_off = 1024, .prompt_len = 100, .max_tokens = 64,
		.temperature = 0.8f, .top_p = 0.95f, .top_k = 40, .seed = 1234,
		.stop = { 2, 31999 },
	};
}

START_TEST(test_sub_valid)
{
	struct mlens_sub s = good_sub(), c = { .id = 7, .op = MLENS_OP_CANCEL };
	char why[256] = "";

	ck_assert_msg(mlens_sub_validate(&s, &plim, why, sizeof(why)) == 0, "%s", why);
	s.temperature = 0;	/* greedy */
	s.top_p = 1;
	s.top_k = 32000;
	s.n_stop = 8;
	for (int i = 0; i < 8; i++)
		s.stop[i] = i;
	s.prompt_len = 700;	/* 700 + 500 == max_context */
	s.max_tokens = 500;
	s.prompt_off = 65536 - 2800;	/* the record ends exactly at the ring's end */
	ck_assert_msg(mlens_sub_validate(&s, &plim, why, sizeof(why)) == 0, "%s", why);
	ck_assert_msg(mlens_sub_validate(&c, &plim, why, sizeof(why)) == 0, "%s", why);
	ck_assert_int_eq(mlens_sub_validate(&s, &plim, NULL, 0), 0);
}
END_TEST

struct bad_sub {
	void (*mutate)(struct mlens_sub *s);
	int err;
	const char *why;
};

#define SMUT(fn, body) static void fn(struct mlens_sub *s) { body; }
SMUT(b_op0, s->op = 0)
SMUT(b_op9, s->op = 9)
SMUT(b_flags, s->flags |= 0x10)
SMUT(b_res0, s->reserved0 = 1)
SMUT(b_res, s->reserved[5] = 1ull << 63)
SMUT(b_plen0, s->prompt_len = 0)
SMUT(b_plen, s->prompt_len = 1001)
SMUT(b_plen_huge, s->prompt_len = UINT32_MAX)
SMUT(b_maxtok0, s->max_tokens = 0)
SMUT(b_maxtok, s->max_tokens = 501)
SMUT(b_ctx, { s->prompt_len = 800; s->max_tokens = 401; })
SMUT(b_off_align, s->prompt_off = 1028)
SMUT(b_off_past, s->prompt_off = 65536)
SMUT(b_off_huge, s->prompt_off = UINT32_MAX - 7)
SMUT(b_off_end, s->prompt_off = 65536 - 392)
SMUT(b_temp_neg, s->temperature = -0.1f)
SMUT(b_temp_big, s->temperature = 1000.0f)
SMUT(b_temp_nan, s->temperature = NAN)
SMUT(b_temp_inf, s->temperature = INFINITY)
SMUT(b_topp0, s->top_p = 0.0f)
SMUT(b_topp_big, s->top_p = 1.01f)
SMUT(b_topp_nan, s->top_p = -NAN)
SMUT(b_topk_neg, s->top_k = -1)
SMUT(b_topk_big, s->top_k = 32001)
SMUT(b_nstop, s->n_stop = 9)
SMUT(b_stop_vocab, s->stop[1] = 32000)
SMUT(b_stop_neg, s->stop[0] = -5)
SMUT(b_stop_unused, s->stop[5] = 3)
SMUT(b_cancel_fields, s->op = MLENS_OP_CANCEL)
SMUT(b_cancel_flags, { memset(s, 0, sizeof(*s)); s->op = MLENS_OP_CANCEL; s->flags = 1; })
SMUT(b_cancel_res, { memset(s, 0, sizeof(*s)); s->op = MLENS_OP_CANCEL; s->reserved[0] = 1; })

static const struct bad_sub bad_subs[] = {
	{ b_op0, -EINVAL, "op 0" },
	{ b_op9, -EINVAL, "op 9" },
	{ b_flags, -EINVAL, "unknown bits 0x10" },
	{ b_res0, -EINVAL, "reserved" },
	{ b_res, -EINVAL, "reserved" },
	{ b_plen0, -EINVAL, "prompt_len 0" },
	{ b_plen, -E2BIG, "prompt_len 1001" },
	{ b_plen_huge, -E2BIG, "prompt_len 4294967295" },
	{ b_maxtok0, -EINVAL, "max_tokens 0" },
	{ b_maxtok, -E2BIG, "max_tokens 501" },
	{ b_ctx, -E2BIG, "context limit" },
	{ b_off_align, -EFAULT, "prompt_off 1028 not a multiple" },
	{ b_off_past, -EFAULT, "past the prompt ring" },
	{ b_off_huge, -EFAULT, "past the prompt ring" },
	{ b_off_end, -EFAULT, "past the prompt ring" },
	{ b_temp_neg, -EINVAL, "temperature" },
	{ b_temp_big, -EINVAL, "temperature" },
	{ b_temp_nan, -EINVAL, "temperature" },
	{ b_temp_inf, -EINVAL, "temperature" },
	{ b_topp0, -EINVAL, "top_p" },
	{ b_topp_big, -EINVAL, "top_p" },
	{ b_topp_nan, -EINVAL, "top_p" },
	{ b_topk_neg, -EINVAL, "top_k -1" },
	{ b_topk_big, -EINVAL, "top_k 32001" },
	{ b_nstop, -EINVAL, "n_stop 9" },
	{ b_stop_vocab, -EINVAL, "stop[1] token 32000" },
	{ b_stop_neg, -EINVAL, "stop[0] token -5" },
	{ b_stop_unused, -EINVAL, "stop[5] set beyond" },
	{ b_cancel_fields, -EINVAL, "cancel entry: flags" },
	{ b_cancel_flags, -EINVAL, "cancel entry: flags" },
	{ b_cancel_res, -EINVAL, "cancel entry: request fields" },
};

START_TEST(test_sub_bad_fields)
{
	const struct bad_sub *b = &bad_subs[_i];
	struct mlens_sub s = good_sub();
	char why[256] = "";
	int err;

	b->mutate(&s);
	err = mlens_sub_validate(&s, &plim, why, sizeof(why));
	ck_assert_msg(err == b->err, "case %d: got %d (%s), want %d", _i, err, why, b->err);
	ck_assert_msg(strstr(why, b->why), "case %d: reason \"%s\" lacks \"%s\"", _i, why, b->why);
}
END_TEST

/* Random entries never crash validation; what it accepts obeys every rule,
 * checked here independently of the validator. */
START_TEST(test_sub_random)
{
	unsigned seed = 777;
	int accepted = 0;

	for (int iter = 0; iter < 200000; iter++) {
		struct mlens_sub s;
		unsigned char *raw = (unsigned char *)&s;
		char why[128];
		int err;

		for (size_t i = 0; i < sizeof(s); i++)
			raw[i] = (unsigned char)rand_r(&seed);
		/* Steer half of them past the first checks. */
		if (iter % 2) {
			s.op = MLENS_OP_GENERATE;
			s.flags &= MLENS_SUB_FLAGS_KNOWN;
			s.reserved0 = 0;
			memset(s.reserved, 0, sizeof(s.reserved));
			s.prompt_len %= 1100;
			s.max_tokens %= 600;
			s.prompt_off = (s.prompt_off % 66000) & ~7u;
			s.n_stop %= 10;
			if (iter % 4 == 1) {
				s.temperature = (float)(rand_r(&seed) % 200) / 10.0f;
				s.top_p = (float)(rand_r(&seed) % 120) / 100.0f;
				s.top_k = rand_r(&seed) % 33000;
				for (int i = 0; i < MLENS_MAX_STOP; i++)
					s.stop[i] = i < s.n_stop ? rand_r(&seed) % 33000 : 0;
			}
		}
		err = mlens_sub_validate(&s, &plim, why, sizeof(why));
		ck_assert_msg(err == 0 || err == -EINVAL || err == -E2BIG || err == -EFAULT,
			      "iter %d: %d", iter, err);
		if (err == 0 && s.op == MLENS_OP_GENERATE) {
			accepted++;
			ck_assert_uint_ge(s.prompt_len, 1);
			ck_assert_uint_le(s.prompt_len, plim.max_prompt_tokens);
			ck_assert_uint_le((uint64_t)s.prompt_off + 4ull * s.prompt_len,
					  plim.prompt_bytes);
			ck_assert_uint_le(s.prompt_len + s.max_tokens, plim.max_context);
			ck_assert(isfinite(s.temperature) && isfinite(s.top_p));
			ck_assert(s.top_p > 0 && s.top_p <= 1);
			for (int i = 0; i < s.n_stop; i++)
				ck_assert(s.stop[i] >= 0 && s.stop[i] < 32000);
		}
	}
	ck_assert_int_gt(accepted, 100);	/* the steering does reach acceptance */
}
END_TEST

START_TEST(test_prompt_validate)
{
	int32_t t[5] = { 0, 1, 31999, 5, 6 };
	char why[128] = "";

	ck_assert_int_eq(mlens_prompt_validate(t, 5, &plim, why, sizeof(why)), 0);
	ck_assert_int_eq(mlens_prompt_validate(t, 0, &plim, why, sizeof(why)), 0);
	t[3] = 32000;
	ck_assert_int_eq(mlens_prompt_validate(t, 5, &plim, why, sizeof(why)), -ERANGE);
	ck_assert_ptr_nonnull(strstr(why, "prompt token 3 is 32000"));
	ck_assert_int_eq(mlens_prompt_validate(t, 3, &plim, why, sizeof(why)), 0);
	t[3] = 5;
	t[4] = INT32_MIN;
	ck_assert_int_eq(mlens_prompt_validate(t, 5, &plim, why, sizeof(why)), -ERANGE);
	ck_assert_ptr_nonnull(strstr(why, "prompt token 4"));
}
END_TEST

START_TEST(test_cmpl_validate)
{
	const struct mlens_cmpl ok[] = {
		{ .id = 1, .token = 5, .flags = MLENS_CMPL_FIRST | MLENS_CMPL_TOKEN },
		{ .id = 1, .token = 5, .flags = MLENS_CMPL_TOKEN | MLENS_CMPL_LOGPROB,
		  .logprob = -0.5f },
		{ .id = 1, .token = 2, .flags = MLENS_CMPL_TOKEN | MLENS_CMPL_LAST,
		  .finish = MLENS_FINISH_STOP },
		{ .id = 1, .flags = MLENS_CMPL_FIRST | MLENS_CMPL_LAST, .finish = MLENS_FINISH_ERROR,
		  .status = -EINVAL },
		{ .id = 1, .flags = MLENS_CMPL_LAST, .finish = MLENS_FINISH_CANCELLED },
		{ .id = 1, .flags = MLENS_CMPL_LAST, .finish = MLENS_FINISH_CANCELLED,
		  .status = -ECANCELED },
		{ .id = 1, .flags = MLENS_CMPL_LAST, .finish = MLENS_FINISH_ERROR, .status = -E2BIG,
		  .detail = MLENS_DETAIL_KV_POOL, .need = 251, .have = 128 },
	};
	const struct { struct mlens_cmpl c; const char *why; } bad[] = {
		{ { .flags = 0x10 }, "unknown bits" },
		{ { .flags = MLENS_CMPL_LAST }, "finish 0 with LAST set" },
		{ { .flags = MLENS_CMPL_TOKEN, .finish = MLENS_FINISH_LENGTH }, "LAST clear" },
		{ { .flags = MLENS_CMPL_LAST, .finish = 5 }, "finish 5" },
		{ { .flags = MLENS_CMPL_LAST, .finish = MLENS_FINISH_ERROR }, "status 0" },
		{ { .flags = MLENS_CMPL_LAST, .finish = MLENS_FINISH_STOP, .status = -5 }, "status -5" },
		{ { .flags = MLENS_CMPL_LAST, .finish = MLENS_FINISH_ERROR, .status = 3 }, "status 3" },
		{ { .flags = MLENS_CMPL_LAST, .finish = MLENS_FINISH_CANCELLED, .status = -EIO },
		  "status -5" },
		{ { .flags = MLENS_CMPL_TOKEN, .status = -ECANCELED }, "status" },
		{ { .flags = MLENS_CMPL_LOGPROB }, "logprob but no token" },
		{ { .flags = MLENS_CMPL_TOKEN, .detail = 1 }, "detail 1" },
		{ { .flags = MLENS_CMPL_TOKEN, .need = 1 }, "detail 0 (need 1" },
		{ { .flags = MLENS_CMPL_LAST, .finish = MLENS_FINISH_ERROR, .status = -E2BIG,
		    .detail = MLENS_DETAIL_MAX + 1 }, "detail" },
	};
	char why[128];

	for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++)
		ck_assert_msg(mlens_cmpl_validate(&ok[i], why, sizeof(why)) == 0, "ok %zu: %s", i, why);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		why[0] = 0;
		ck_assert_int_eq(mlens_cmpl_validate(&bad[i].c, why, sizeof(why)), -EPROTO);
		ck_assert_msg(strstr(why, bad[i].why), "bad %zu: \"%s\" lacks \"%s\"", i, why,
			      bad[i].why);
	}
}
END_TEST

START_TEST(test_limits_validate)
{
	struct mlens_region_limits l = plim;
	char why[256] = "";

	ck_assert_int_eq(mlens_limits_validate(&l, why, sizeof(why)), 0);
	l.max_context = 0;
	ck_assert_int_eq(mlens_limits_validate(&l, why, sizeof(why)), -EINVAL);
	l = plim;
	l.vocab_size = 0x80000000u;
	ck_assert_int_eq(mlens_limits_validate(&l, why, sizeof(why)), -EINVAL);
	l = plim;
	l.max_prompt_tokens = 8193;	/* 8193 * 4 * 2 > 65536 */
	ck_assert_int_eq(mlens_limits_validate(&l, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "at least 65544 bytes"));
	l.max_prompt_tokens = 8192;
	ck_assert_int_eq(mlens_limits_validate(&l, why, sizeof(why)), 0);
}
END_TEST

/* ==== Fuzz target, fed here without libFuzzer ==== */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern unsigned long fuzz_shm_accepted_subs, fuzz_shm_accepted_headers;

/* Near-valid inputs reach deeper than random ones: valid headers with a few
 * bytes flipped, and small tails over plausible entries with some fields
 * mutated. The target aborts on any broken invariant. */
START_TEST(test_fuzz_target)
{
	static uint8_t in[1 + 8 + 16 * sizeof(struct mlens_sub) + 4096];
	struct mlens_region d;
	size_t size;
	void *mem;
	unsigned seed = 99;

	ck_assert_int_eq(mlens_region_size(&small_params, &size), 0);
	mem = xalloc(size);
	ck_assert_int_eq(mlens_region_format(&d, mem, size, &small_params, &small_limits, NULL, 0),
			 0);
	for (int iter = 0; iter < 40000; iter++) {
		size_t n;

		if (iter % 2 == 0) {
			in[0] = 0;
			memcpy(in + 1, mem, 256);
			memcpy(in + 257, (char *)mem + 256, 256);	/* the sub ring's head */
			for (int k = rand_r(&seed) % 4; k >= 0; k--)
				in[1 + rand_r(&seed) % 512] = (uint8_t)rand_r(&seed);
			n = 1 + (size_t)(rand_r(&seed) % 513);
		} else {
			/* A consistent stream: records laid end to end as the
			 * byte ring places them, entries naming them. */
			uint32_t cur = 0, count = 0;
			uint8_t *e = in + 9, *pr = e + 16 * sizeof(struct mlens_sub);

			in[0] = 1;
			for (int k = 0; k < 16; k++) {
				struct mlens_sub s = request((uint64_t)k);
				uint32_t alen, pos = cur % 4096;

				s.prompt_len = 1 + (uint32_t)(rand_r(&seed) % 64);
				alen = (s.prompt_len * 4 + 7) & ~7u;
				if (alen > 4096 - pos) {
					cur += 4096 - pos;
					pos = 0;
				}
				if (cur + alen > 4096)
					break;
				s.prompt_off = pos;
				cur += alen;
				memcpy(e + k * sizeof(s), &s, sizeof(s));
				count++;
			}
			memcpy(in + 1, &count, 4);
			memcpy(in + 5, &cur, 4);
			for (int k = 0; k < 1024; k++) {
				int32_t t = rand_r(&seed) % 1000;

				if (rand_r(&seed) % 4000 == 0)
					t += 1000;	/* now and then, outside the vocabulary */
				memcpy(pr + 4 * k, &t, 4);
			}
			for (int k = rand_r(&seed) % 4; k > 0; k--)
				e[rand_r(&seed) % (16 * sizeof(struct mlens_sub))] = (uint8_t)rand_r(&seed);
			if (rand_r(&seed) % 8 == 0)	/* sometimes a corrupt tail */
				in[1 + rand_r(&seed) % 8] = (uint8_t)rand_r(&seed);
			n = sizeof(in) - (size_t)(rand_r(&seed) % 64);
		}
		ck_assert_int_eq(LLVMFuzzerTestOneInput(in, n), 0);
	}
	/* The inputs got past validation often enough to test what follows. */
	ck_assert_uint_gt(fuzz_shm_accepted_subs, 20000);
	ck_assert_uint_gt(fuzz_shm_accepted_headers, 200);
	fprintf(stderr, "fuzz inputs: %lu requests and %lu headers accepted\n",
		fuzz_shm_accepted_subs, fuzz_shm_accepted_headers);
	free(mem);
}
END_TEST

/* ==== Two-process stress ==== */

/* Shared between the two processes, after the ring in the memfd. */
struct stress_stats {
	uint64_t prod_rang;	/* doorbells the producer rang (consumer slept) */
	uint64_t cons_rang;	/* doorbells the consumer rang (producer slept) */
	uint64_t prod_error;
};

#define STRESS_RING 1024u
#define STRESS_BATCH 64u
#define STRESS_PAUSE_EVERY (1u << 21)

static uint64_t stress_entries(void)
{
	const char *e = getenv("MLENS_STRESS_ENTRIES");
	char *end;
	unsigned long long v;

	if (!e || !*e)
		return 20000000ull;
	v = strtoull(e, &end, 0);
	return *end || v == 0 ? 20000000ull : v;
}

static void pause_1ms(void)
{
	struct timespec ts = { 0, 1000000 };

	nanosleep(&ts, NULL);
}

/* The producer, in the child: pushes n sequence-numbered items, sleeping on
 * to_prod when the ring is full and ringing to_cons when the consumer
 * sleeps. Pauses now and then so the consumer has to sleep. */
static int stress_produce(struct mlens_ring *r, int to_cons, int to_prod, uint64_t n,
			  struct stress_stats *st)
{
	struct item buf[STRESS_BATCH];
	uint64_t seq = 0, rang = 0;

	while (seq < n) {
		uint32_t k = n - seq < STRESS_BATCH ? (uint32_t)(n - seq) : STRESS_BATCH;
		int got;

		for (uint32_t i = 0; i < k; i++)
			buf[i] = item_of(seq + i);
		got = mlens_ring_enqueue_burst(r, buf, k);
		if (got < 0)
			return 2;
		if (got == 0) {
			if (mlens_ring_wait_prod(r, to_prod, 1, 10000) <= 0)
				return 3;
			continue;
		}
		if ((seq & (STRESS_PAUSE_EVERY - 1)) + (uint64_t)got > STRESS_PAUSE_EVERY)
			pause_1ms();
		seq += (uint64_t)got;
		got = mlens_ring_wake_cons(r, to_cons);
		if (got < 0)
			return 4;
		rang += (uint64_t)got;
	}
	st->prod_rang = rang;
	return 0;
}

START_TEST(test_stress_two_process)
{
	const uint64_t n = stress_entries();
	ssize_t rsz = mlens_ring_memsize(STRESS_RING, sizeof(struct item));
	size_t total = (size_t)rsz + 4096;
	int mfd, to_cons, to_prod, status;
	struct mlens_ring r;
	struct stress_stats *st;
	struct item buf[STRESS_BATCH];
	uint64_t expect = 0, rang = 0, sleeps = 0;
	void *mem;
	pid_t pid;

	mfd = memfd_create("mlens-stress", MFD_CLOEXEC);
	ck_assert_int_ge(mfd, 0);
	ck_assert_int_eq(ftruncate(mfd, (off_t)total), 0);
	mem = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
	ck_assert_ptr_ne(mem, MAP_FAILED);
	close(mfd);
	st = (struct stress_stats *)((char *)mem + rsz);
	ck_assert_int_eq(mlens_ring_init(&r, mem, (size_t)rsz, STRESS_RING, sizeof(struct item)), 0);
	to_cons = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	to_prod = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	ck_assert(to_cons >= 0 && to_prod >= 0);

	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		/* The producer attaches as a peer process would. */
		struct mlens_ring pr;

		if (mlens_ring_attach(&pr, mem, (size_t)rsz))
			_exit(1);
		_exit(stress_produce(&pr, to_cons, to_prod, n, st));
	}

	while (expect < n) {
		int got = mlens_ring_dequeue_burst(&r, buf, STRESS_BATCH);

		ck_assert_int_ge(got, 0);
		if (got == 0) {
			sleeps++;
			got = mlens_ring_wait_cons(&r, to_cons, 10000);
			ck_assert_msg(got > 0, "consumer waited 10 s at %llu of %llu: %d",
				      (unsigned long long)expect, (unsigned long long)n, got);
			continue;
		}
		for (int i = 0; i < got; i++) {
			if (buf[i].seq != expect + (uint64_t)i || buf[i].check != (buf[i].seq ^ ITEM_KEY)) {
				kill(pid, SIGKILL);
				ck_abort_msg("entry %llu: got seq %llu check %llx",
					     (unsigned long long)(expect + (uint64_t)i),
					     (unsigned long long)buf[i].seq,
					     (unsigned long long)buf[i].check);
			}
		}
		if ((expect & (STRESS_PAUSE_EVERY - 1)) + (uint64_t)got > STRESS_PAUSE_EVERY)
			pause_1ms();
		expect += (uint64_t)got;
		got = mlens_ring_wake_prod(&r, to_prod);
		ck_assert_int_ge(got, 0);
		rang += (uint64_t)got;
	}
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "producer status 0x%x", status);
	/* Nothing duplicated: the ring is empty and the producer is done. */
	ck_assert_int_eq(mlens_ring_count(&r), 0);
	ck_assert_uint_eq(r.shm->tail, (uint32_t)n);
	/* Both sides really slept and were woken by a doorbell. */
	ck_assert_uint_gt(rang, 0);
	ck_assert_uint_gt(st->prod_rang, 0);
	fprintf(stderr, "stress: %llu entries, consumer found the ring empty %llu times, "
		"doorbells: producer %llu, consumer %llu\n", (unsigned long long)n,
		(unsigned long long)sleeps, (unsigned long long)st->prod_rang,
		(unsigned long long)rang);
	close(to_cons);
	close(to_prod);
	munmap(mem, total);
}
END_TEST

/* ==== Runner ==== */

static Suite *shm_suite(void)
{
	Suite *s = suite_create("shm");
	TCase *tc;

	tc = tcase_create("ring");
	tcase_add_test(tc, test_ring_memsize);
	tcase_add_test(tc, test_ring_init_rejects);
	tcase_add_test(tc, test_ring_empty_full);
	tcase_add_test(tc, test_ring_wrap32);
	tcase_add_test(tc, test_ring_bulk_burst);
	tcase_add_test(tc, test_ring_peek_consume);
	tcase_add_test(tc, test_ring_attach_checks);
	tcase_add_test(tc, test_ring_corrupt_peer_index);
	tcase_add_test(tc, test_ring_wakeup_flags);
	tcase_add_test(tc, test_ring_wait_timeout);
	tcase_add_test(tc, test_ring_wait_any);
	suite_add_tcase(s, tc);

	tc = tcase_create("bytering");
	tcase_add_test(tc, test_bytering_basic);
	tcase_add_test(tc, test_bytering_wrap);
	tcase_add_test(tc, test_bytering_hostile);
	suite_add_tcase(s, tc);

	tc = tcase_create("region");
	tcase_add_test(tc, test_region_layout);
	tcase_add_test(tc, test_region_format_rejects);
	tcase_add_loop_test(tc, test_region_corrupt, 0,
			    (int)(sizeof(corruptions) / sizeof(corruptions[0])));
	tcase_add_test(tc, test_region_attach_small);
	tcase_add_test(tc, test_region_random_headers);
	tcase_add_test(tc, test_region_memfd);
	tcase_add_test(tc, test_region_submit_take);
	tcase_add_test(tc, test_region_take_hostile);
	tcase_add_test(tc, test_region_two_process);
	tcase_set_timeout(tc, 60);
	suite_add_tcase(s, tc);

	tc = tcase_create("proto");
	tcase_add_test(tc, test_sub_valid);
	tcase_add_loop_test(tc, test_sub_bad_fields, 0,
			    (int)(sizeof(bad_subs) / sizeof(bad_subs[0])));
	tcase_add_test(tc, test_sub_random);
	tcase_add_test(tc, test_prompt_validate);
	tcase_add_test(tc, test_limits_validate);
	tcase_add_test(tc, test_cmpl_validate);
	tcase_set_timeout(tc, 30);
	suite_add_tcase(s, tc);

	tc = tcase_create("fuzz");
	tcase_add_test(tc, test_fuzz_target);
	tcase_set_timeout(tc, 60);
	suite_add_tcase(s, tc);

	tc = tcase_create("stress");
	tcase_add_test(tc, test_stress_two_process);
	tcase_set_timeout(tc, 120);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(shm_suite());
	int failed;

	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
