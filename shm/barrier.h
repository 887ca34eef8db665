/* The memory-ordering names used on memory shared between processes (the
 * rings of a tenant region), over C11 <stdatomic.h>. This is the only file
 * in shm/ that names atomics; each call site says what its barrier pairs
 * with, as liburing's barrier.h asks of its users. */
#ifndef MLENS_SHM_BARRIER_H
#define MLENS_SHM_BARRIER_H

#include <stdatomic.h>
#include <stdint.h>

/* The ring indexes and flags are plain uint32_t in the shared layout (so the
 * layout is the same for every compiler) and are accessed as _Atomic through
 * a cast, as liburing does. That is sound only if an atomic uint32_t has the
 * same representation and is lock-free: a lock-based atomic would keep its
 * lock in one process's private memory. */
_Static_assert(sizeof(_Atomic uint32_t) == sizeof(uint32_t),
	       "atomic and plain uint32_t must have the same size");
_Static_assert(_Alignof(_Atomic uint32_t) == _Alignof(uint32_t),
	       "atomic and plain uint32_t must have the same alignment");
_Static_assert(ATOMIC_INT_LOCK_FREE == 2,
	       "32-bit atomics must be lock-free to be shared between processes");

/* Read *p; later loads and stores of this thread are not moved before it.
 * Pairs with a mlens_store_release() of the same location by the peer. */
#define mlens_load_acquire(p) \
	atomic_load_explicit((_Atomic __typeof__(*(p)) *)(p), memory_order_acquire)

/* Write *p = v; earlier loads and stores of this thread are not moved after
 * it. Pairs with a mlens_load_acquire() of the same location by the peer. */
#define mlens_store_release(p, v) \
	atomic_store_explicit((_Atomic __typeof__(*(p)) *)(p), (v), memory_order_release)

/* Untorn read or write of one word, without ordering: for values whose
 * ordering is given by a nearby barrier (named at the call site), or that
 * only this side writes. */
#define mlens_load_relaxed(p) \
	atomic_load_explicit((_Atomic __typeof__(*(p)) *)(p), memory_order_relaxed)
#define mlens_store_relaxed(p, v) \
	atomic_store_explicit((_Atomic __typeof__(*(p)) *)(p), (v), memory_order_relaxed)

/* Full barrier: orders an earlier store before a later load, which
 * acquire/release cannot. Needed where each side stores one word and then
 * loads the word the other side stores (the needs-wake-up handshake). */
#define mlens_smp_mb() atomic_thread_fence(memory_order_seq_cst)

#endif
