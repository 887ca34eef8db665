/* KV swap: the NVMe tier of the KV cache. A preempted sequence's KV
 * blocks go to slots of a swap file through io_uring and come back into
 * fresh pool blocks before it resumes, instead of being recomputed by a
 * re-prefill; a cost model chooses per sequence. One slot holds one pool
 * block: its K for every layer, then its V (an fp8 pool's scales after each
 * layer's codes).
 *
 * The I/O is synchronous: swap_out submits one writev a block and waits
 * for all of them before the caller frees the blocks, swap_in the same
 * with readv before the blocks are used; the worker's step waits for the
 * disk for that long. Owned by the scheduler's thread (the worker). */
#ifndef MLENS_KV_SWAP_H
#define MLENS_KV_SWAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kernels/kv.h"

enum mlens_kv_swap_policy {
	MLENS_KV_SWAP_AUTO,	/* the cost model chooses */
	MLENS_KV_SWAP_ALWAYS,	/* swap every preempted sequence the file has room for */
	MLENS_KV_SWAP_NEVER,	/* recompute every one */
};

/* ==== the cost model (pure) ==== */

/* The rates the choice weighs: the disk's bytes/s, the prefill's FLOP/s
 * and the prefill FLOPs of a sequence of n tokens, per_token * n +
 * per_token2 * n^2 (the projections and experts, then causal attention). */
struct mlens_kv_swap_rates {
	double disk_bps;
	double compute_flops;
	double flops_per_token;
	double flops_per_token2;
};

/* Seconds to move bytes out and back in against seconds to recompute
 * tokens: true when moving is cheaper. A rate that is not positive makes
 * its side infinitely slow. */
bool mlens_kv_swap_cheaper(const struct mlens_kv_swap_rates *r, uint64_t bytes, int64_t tokens);
/* The prefill FLOPs of positions [from, to) of a sequence: those of a
 * prompt of to tokens less those of one of from (a chunk, a step's part). */
double mlens_kv_swap_prefill_flops(const struct mlens_kv_swap_rates *r, int64_t from, int64_t to);

/* Where a rate of the cost model comes from: a built-in default, a
 * measurement (the swap file's at open, the model files' read), the
 * profiler, or what the running daemon observed. */
enum mlens_kv_swap_source {
	MLENS_KV_SWAP_DEFAULT,
	MLENS_KV_SWAP_MEASURED,
	MLENS_KV_SWAP_PROFILED,
	MLENS_KV_SWAP_OBSERVED,
};

/* A rate and its source. Observations feed an exponentially weighted
 * moving average (weight MLENS_KV_SWAP_EWMA for the newest); the first one
 * replaces an initial value outright, which is only a guess at the rate
 * this daemon sees. */
struct mlens_kv_swap_rate {
	double value;
	enum mlens_kv_swap_source source;
	uint64_t n_observed;
};
#define MLENS_KV_SWAP_EWMA 0.25

/* Fold one observed rate into r; a sample that is not finite and positive
 * (a transfer too short to time) is ignored. */
void mlens_kv_swap_rate_observe(struct mlens_kv_swap_rate *r, double sample);
/* "default", "measured", "profiled" or "observed". */
const char *mlens_kv_swap_source_name(enum mlens_kv_swap_source s);

/* ==== the slot allocator ==== */

struct mlens_kv_slots {
	uint32_t *free;		/* stack of free slot ids */
	uint32_t n_free, n_slots;
};

int mlens_kv_slots_init(struct mlens_kv_slots *a, uint32_t n_slots);
void mlens_kv_slots_fini(struct mlens_kv_slots *a);
/* n slots into out, all or nothing: -ENOSPC when fewer are free. */
int mlens_kv_slots_take(struct mlens_kv_slots *a, uint32_t n, uint32_t *out);
void mlens_kv_slots_give(struct mlens_kv_slots *a, const uint32_t *ids, uint32_t n);

/* ==== the swap file ==== */

struct mlens_kv_swap_stats {
	uint64_t bytes_out, bytes_in;	/* written to and read from the swap file */
	uint64_t swaps;			/* preempted sequences whose KV went out */
	uint64_t swap_ins;		/* of which came back from the file */
	uint64_t recomputes;		/* preempted sequences left to re-prefill */
	uint64_t full;			/* of which because the file (or disk) had no room */
	uint64_t errors;		/* I/O errors (each one's sequence re-prefills) */
	double io_seconds;		/* the worker waited for the swap I/O, total */
	uint32_t slots_used, slots_total;
	/* the cost model's rates now: disk bytes/s, prefill FLOP/s */
	struct mlens_kv_swap_rate disk, prefill;
	double measured_bps;		/* the swap file's rate measured at open, 0: none */
};

struct mlens_kv_swap_opts {
	uint64_t budget;		/* bytes of swap file */
	const char *path;		/* a directory (an unnamed file in it) or a new file */
	enum mlens_kv_swap_policy policy;
	struct mlens_kv_swap_rates rates;	/* the initial rates, and FLOPs a token */
	enum mlens_kv_swap_source disk_source, compute_source;	/* of rates' */
};

struct mlens_kv_swap;

/* Open the swap file for a pool of layout's shape: in a directory an
 * unnamed file (O_TMPFILE; else a named one unlinked at once), else a new
 * file created exclusively and unlinked at once (so it goes with the
 * daemon); O_DIRECT where the filesystem and the block size allow, else
 * buffered (said in mlens_kv_swap_describe). Then the file's rate is
 * measured: a batch of slot-sized writes of the pool's first blocks and
 * their reads back (the pool holds no sequence yet, and the bytes come
 * back unchanged), through the same I/O path as a swap; it replaces
 * o->rates.disk_bps unless it fails. -errno with err set: a path that
 * exists and is not a directory, a budget below one slot. Test hooks:
 * MLENS_TEST_SWAP_FAIL=write|read|enospc makes every write (read) complete
 * with -EIO, or every write with -ENOSPC; MLENS_TEST_SWAP_RATE=BPS stands
 * in for the measurement (the disk looks that fast until swaps are
 * observed). */
int mlens_kv_swap_create(struct mlens_kv_swap **out, const struct mlens_kv_cache *layout,
			 const struct mlens_kv_swap_opts *o, char *err, size_t errlen);
void mlens_kv_swap_destroy(struct mlens_kv_swap *sw);
/* One line on the file: where, how (O_DIRECT or buffered, and why), its
 * slots. */
const char *mlens_kv_swap_describe(const struct mlens_kv_swap *sw);
/* Bytes one slot (one pool block, K and V) takes. */
size_t mlens_kv_swap_slot_bytes(const struct mlens_kv_swap *sw);

/* Should a preempted sequence of tokens tokens in n_blocks blocks go to
 * the file (policy, then the cost model)? */
bool mlens_kv_swap_choose(const struct mlens_kv_swap *sw, uint32_t n_blocks, int64_t tokens);
/* Write pool blocks[0..n) of kv into n slots (their ids into slots) and
 * wait. 0; -ENOSPC (no free slots, or the disk is full: nothing held);
 * another -errno on an I/O error (nothing held, counted). The blocks are
 * untouched either way: the caller may free them after it returns. */
int mlens_kv_swap_out(struct mlens_kv_swap *sw, const struct mlens_kv_cache *kv,
		      const uint32_t *blocks, uint32_t n, uint32_t *slots);
/* Read slots[0..n) into pool blocks[0..n) of kv and wait; the slots are
 * free afterwards whatever the outcome. 0 or -errno (counted; the blocks'
 * contents are then undefined). */
int mlens_kv_swap_in(struct mlens_kv_swap *sw, const struct mlens_kv_cache *kv,
		     const uint32_t *blocks, uint32_t n, const uint32_t *slots);
/* Free slots without reading them (the sequence ended while swapped). */
void mlens_kv_swap_drop(struct mlens_kv_swap *sw, const uint32_t *slots, uint32_t n);
/* A step that prefilled flops FLOPs (mlens_kv_swap_prefill_flops of its
 * prefill parts) took seconds: an observation of the prefill rate. */
void mlens_kv_swap_observe_prefill(struct mlens_kv_swap *sw, double flops, double seconds);
/* The rates the choice weighs now (observed ones once there are any) and
 * its FLOPs a token, for mlens_kv_swap_prefill_flops. */
struct mlens_kv_swap_rates mlens_kv_swap_get_rates(const struct mlens_kv_swap *sw);
/* A preempted sequence left to re-prefill; full: for want of room. */
void mlens_kv_swap_note_recompute(struct mlens_kv_swap *sw, bool full);
void mlens_kv_swap_get_stats(const struct mlens_kv_swap *sw, struct mlens_kv_swap_stats *st);

#endif
