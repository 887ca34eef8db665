/* Single-producer single-consumer rings in caller-supplied memory, meant to
 * live in memory shared between two processes: a ring of fixed-size entries
 * (copy in, copy out) and a byte ring of variable-length records
 * (reserve/commit, read/release). Knows nothing of what the entries mean. */
#ifndef MLENS_SHM_RING_H
#define MLENS_SHM_RING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define MLENS_CACHELINE 64
#define MLENS_RING_MAGIC 0x676e6952u	/* "Ring" */
#define MLENS_BYTERING_MAGIC 0x52747942u	/* "ByteR" */
/* Entry counts stay at most 2^30 so that a count fits an int and
 * tail - head is never ambiguous. */
#define MLENS_RING_MAX_ENTRIES (1u << 30)
#define MLENS_RING_MAX_ESIZE 65536u
/* Records in a byte ring start and end on this many bytes. */
#define MLENS_BYTERING_ALIGN 8u
#define MLENS_BYTERING_MIN_SIZE 64u

/* ==== Shared layout ==== */

/* The head of a ring in shared memory; the entries follow it. Indexes are
 * free-running uint32 (masked with entries - 1 on use); the ring is full when
 * tail - head == entries. Each index sits alone on its cache line so the
 * producer and consumer do not write the same line. Every field is a value
 * the peer may have scribbled on: a side reads its own index only from its
 * private handle, and checks the peer's before use. */
struct mlens_ring_shm {
	/* Line 0: geometry, written once by init. */
	uint32_t magic;
	uint32_t entries;	/* power of two; bytes for a byte ring */
	uint32_t esize;		/* bytes per entry; 1 for a byte ring */
	uint32_t reserved0;
	uint8_t pad0[MLENS_CACHELINE - 16];
	/* Line 1: written by the producer only. */
	uint32_t tail;
	uint8_t pad1[MLENS_CACHELINE - 4];
	/* Line 2: written by the consumer only. */
	uint32_t head;
	uint8_t pad2[MLENS_CACHELINE - 4];
	/* Line 3: the needs-wake-up flags, written only around a sleep, so a
	 * busy pair only reads this line. */
	uint32_t cons_wakeup;	/* consumer sleeps until entries arrive */
	uint32_t prod_wakeup;	/* producer sleeps until space is freed */
	uint8_t pad3[MLENS_CACHELINE - 8];
};

_Static_assert(sizeof(struct mlens_ring_shm) == 4 * MLENS_CACHELINE, "ring head is 4 lines");
_Static_assert(offsetof(struct mlens_ring_shm, tail) == 1 * MLENS_CACHELINE, "tail on line 1");
_Static_assert(offsetof(struct mlens_ring_shm, head) == 2 * MLENS_CACHELINE, "head on line 2");
_Static_assert(offsetof(struct mlens_ring_shm, cons_wakeup) == 3 * MLENS_CACHELINE,
	       "wake-up flags on line 3");

/* ==== Process-private handle ==== */

/* One process's view of a ring. The geometry is copied here when the ring
 * is made or attached and never read from shared memory again. A handle may
 * act as producer, consumer or both (tests), but each role belongs to one
 * thread at a time. */
struct mlens_ring {
	struct mlens_ring_shm *shm;
	unsigned char *data;
	uint32_t entries;
	uint32_t mask;
	uint32_t esize;
	/* producer */
	uint32_t prod_tail;	/* next index to fill (the true tail) */
	uint32_t prod_head;	/* head as last read: free space is at least this */
	/* consumer */
	uint32_t cons_head;	/* next index to read (the true head) */
	uint32_t cons_tail;	/* tail as last read: entries up to it are ready */
};

/* ==== Making and attaching ==== */

/* Bytes of memory a ring of `entries` entries of `esize` bytes needs, or
 * -EINVAL (entries not a power of two in [1, MLENS_RING_MAX_ENTRIES], esize
 * not in [1, MLENS_RING_MAX_ESIZE]). As rte_ring_get_memsize. */
ssize_t mlens_ring_memsize(uint32_t entries, uint32_t esize);

/* Format `mem` (memsize bytes, 64-byte aligned) as an empty ring and fill
 * the handle from the arguments. -EINVAL on bad geometry or memory too small
 * or misaligned. */
int mlens_ring_init(struct mlens_ring *r, void *mem, size_t memsize, uint32_t entries,
		    uint32_t esize);

/* Fill the handle from a ring another process formatted in `mem`, checking
 * everything read: -EPROTO if the magic is wrong, -EINVAL if the geometry
 * does not fit memsize or the indexes are more than `entries` apart. The
 * caller that knows the geometry it expects compares r->entries/esize. */
int mlens_ring_attach(struct mlens_ring *r, void *mem, size_t memsize);

/* ==== Producer ==== */

/* Copy n entries in and publish them: all n (returns n) or none (returns
 * 0). -EPROTO if the consumer's index is corrupt. */
int mlens_ring_enqueue_bulk(struct mlens_ring *r, const void *src, uint32_t n);
/* As above, but as many as fit: returns 0..n. */
int mlens_ring_enqueue_burst(struct mlens_ring *r, const void *src, uint32_t n);
/* Free entries now, or -EPROTO. */
int mlens_ring_free_count(struct mlens_ring *r);

/* ==== Consumer ==== */

/* Copy n entries out and free their slots: all n or none. */
int mlens_ring_dequeue_bulk(struct mlens_ring *r, void *dst, uint32_t n);
/* As above, but as many as are there: returns 0..n. */
int mlens_ring_dequeue_burst(struct mlens_ring *r, void *dst, uint32_t n);
/* Copy up to n entries out without consuming them; returns how many. */
int mlens_ring_peek(struct mlens_ring *r, void *dst, uint32_t n);
/* Drop n entries (after a peek); -EINVAL if fewer are there. */
int mlens_ring_consume(struct mlens_ring *r, uint32_t n);
/* Entries ready now, or -EPROTO if the producer's index is corrupt. */
int mlens_ring_count(struct mlens_ring *r);

/* ==== Needs-wake-up handshake and eventfd doorbells ====
 *
 * A side about to sleep sets its flag, then looks at the ring again, and
 * sleeps only if there is still nothing to do. The other side, after it
 * publishes, rings the doorbell (writes 1 to an eventfd) only if the flag is
 * set. A full barrier on both sides between "store mine" and "load theirs"
 * makes a lost wake-up impossible; a busy peer costs no system call. A
 * doorbell can be stale (rung for work already seen): waiters loop. */

/* Consumer, before sleeping on an empty ring; re-check the ring after it. */
void mlens_ring_cons_arm(struct mlens_ring *r);
/* Consumer, after waking. */
void mlens_ring_cons_disarm(struct mlens_ring *r);
/* Producer, after publishing: must the consumer be woken? */
bool mlens_ring_cons_needs_wakeup(struct mlens_ring *r);
/* Producer side of the same three for a producer sleeping on a full ring. */
void mlens_ring_prod_arm(struct mlens_ring *r);
void mlens_ring_prod_disarm(struct mlens_ring *r);
bool mlens_ring_prod_needs_wakeup(struct mlens_ring *r);

/* Producer, after enqueue: ring `efd` if the consumer sleeps. Returns 1 if
 * it rang, 0 if not needed, -errno if the write failed. */
int mlens_ring_wake_cons(struct mlens_ring *r, int efd);
/* Consumer, after dequeue: ring `efd` if the producer sleeps. */
int mlens_ring_wake_prod(struct mlens_ring *r, int efd);

/* Consumer: wait on eventfd `efd` until the ring holds an entry. timeout_ms
 * as poll(2) (-1: forever). Returns the count (> 0), 0 on timeout, -errno
 * (-EPROTO for a corrupt ring). Drains the eventfd: when one eventfd serves
 * several rings, look at all of them after a wake-up. */
int mlens_ring_wait_cons(struct mlens_ring *r, int efd, int timeout_ms);
/* Producer: wait until at least `need` entries are free. Returns the free
 * count (>= need), 0 on timeout, -EINVAL if need > entries, -errno. */
int mlens_ring_wait_prod(struct mlens_ring *r, int efd, uint32_t need, int timeout_ms);

/* ==== Byte ring ====
 *
 * A ring of bytes (entries = size in bytes, esize = 1) holding records of
 * variable length, each contiguous and MLENS_BYTERING_ALIGN-aligned; a
 * record that would straddle the end starts again at offset 0 and the gap
 * is skipped. A record is named by (offset, length) in some other message;
 * the consumer releases records in the order they were reserved. */
struct mlens_bytering {
	struct mlens_ring ring;
	uint32_t committed;	/* producer: tail as last published */
};

ssize_t mlens_bytering_memsize(uint32_t size);
/* size: a power of two in [MLENS_BYTERING_MIN_SIZE, MLENS_RING_MAX_ENTRIES]. */
int mlens_bytering_init(struct mlens_bytering *b, void *mem, size_t memsize, uint32_t size);
int mlens_bytering_attach(struct mlens_bytering *b, void *mem, size_t memsize);
/* Largest record: half the ring, so that a record fits an empty ring
 * wherever the indexes stand. */
static inline uint32_t mlens_bytering_max_record(const struct mlens_bytering *b)
{
	return b->ring.entries / 2;
}

/* Producer: reserve len bytes; *off gets the record's offset, *ptr where
 * to write it. Not visible to the consumer before commit. Returns 0,
 * -EAGAIN (no room now), -EMSGSIZE (len is 0 or above max_record), -EPROTO. */
int mlens_bytering_reserve(struct mlens_bytering *b, uint32_t len, uint32_t *off, void **ptr);
/* Producer: publish every record reserved so far. */
void mlens_bytering_commit(struct mlens_bytering *b);
/* Producer: forget the records reserved since the last commit. */
void mlens_bytering_abort(struct mlens_bytering *b);
/* Producer: wait until a record of len bytes can be reserved. Returns 1,
 * 0 on timeout, -EMSGSIZE, -errno. */
int mlens_bytering_wait_reserve(struct mlens_bytering *b, int efd, uint32_t len, int timeout_ms);

/* Consumer: copy the record (off, len) out, checking that it is the next
 * committed record (or lies within committed bytes after it). -EFAULT when
 * it is not (bad offset, misaligned, past the end or not yet committed),
 * -EPROTO for a corrupt index. */
int mlens_bytering_read(struct mlens_bytering *b, uint32_t off, uint32_t len, void *dst);
/* Consumer: free everything up to the end of record (off, len). Same
 * checks and errors as read. */
int mlens_bytering_release(struct mlens_bytering *b, uint32_t off, uint32_t len);

#endif
