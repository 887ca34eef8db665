/* The disk tier of the weights: the experts that host_memory has no room
 * for stay in the model files and are read each step, through io_uring
 * (O_DIRECT where the file system allows, up to MLENS_DISK_TIER_DEPTH
 * aligned reads of at most MLENS_DISK_TIER_CHUNK bytes in flight), into
 * pinned staging of two sets, registered with the ring where the kernel
 * lets it: the MoE layers that have disk experts
 * alternate between them, so that one layer's experts are read while the
 * layer before is used. The model's pointers to those experts point into
 * their layer's set until a trade (mlens_disk_tier_trade) swaps a disk
 * expert with one in RAM; the caller reads a layer's experts only
 * between mlens_disk_tier_ready and mlens_disk_tier_done.
 *
 * One reader thread of its own does the reads; ready, done and the step
 * marks and trades are called by the one thread that runs the steps (the
 * worker); the stats getters from any thread (under the tier's lock). */
#ifndef MLENS_DISK_TIER_H
#define MLENS_DISK_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"

#define MLENS_DISK_TIER_CHUNK (4u << 20)
#define MLENS_DISK_TIER_DEPTH 64u

/* One expert matrix left in the files, and the model's pointer to it. */
struct mlens_disk_matrix {
	int layer, expert, which;	/* which: 0 w1, 1 w2, 2 w3 */
	int file;
	uint64_t off;
	size_t len;
	const void **ptr;
};

struct mlens_disk_tier_stats {
	uint64_t disk_bytes;		/* expert bytes left in the files */
	uint64_t step_bytes;		/* what one step reads: every disk layer's */
	uint64_t staging_bytes;		/* the two pinned sets */
	int experts, layers;		/* disk experts a layer; layers with them */
	int ram_experts;		/* experts a layer in RAM */
	int model_layers, model_experts;	/* the model's layers, experts a layer */
	bool direct;			/* O_DIRECT reads */
	bool registered;		/* into buffers registered with the ring */
	uint64_t read_bytes_total;
	uint64_t fills_total;		/* layers read */
	uint64_t errors_total;		/* failed layer reads */
	double busy_seconds_total;	/* the reader was reading */
	uint64_t last_step_bytes;	/* read during the last step */
	double last_step_busy;		/* share of the last step's time spent reading */
	double ceiling_bps;		/* the profiler's measured read rate, 0: none */
	uint64_t trades_total;		/* disk experts moved into RAM (one out each) */
	uint64_t trade_errors_total;	/* trades that failed (nothing moved) */
};

struct mlens_disk_tier;

/* Staging bytes (both sets) the matrices mx[0..n) need, for any choice
 * of as many disk experts a layer (trades change it). */
uint64_t mlens_disk_tier_staging_bytes(const struct mlens_model *m, const struct mlens_disk_matrix *mx, int n);

/* Open the model files, allocate the staging (NUMA node, mlock), point
 * each matrix mx[0..n) 's model pointer into it and start the reader;
 * all[0..n_all) are every expert's matrices of the MoE layers (the ones
 * in RAM for trades: in the files, with the model's pointers, which the
 * caller may move into RAM after). The test hook MLENS_TEST_DISK_FAIL=PATH
 * makes every read fail with -EIO while PATH exists (end early when PATH
 * holds "short"; only trades fail when it holds "trade"). -errno with
 * err set. */
int mlens_disk_tier_create(struct mlens_disk_tier **out, struct mlens_model *m, const struct mlens_disk_matrix *mx,
			   int n, const struct mlens_disk_matrix *all, int n_all, int node, bool mlock, char *err,
			   size_t errlen);
void mlens_disk_tier_destroy(struct mlens_disk_tier *dt);

/* Is expert e of layer l on disk? (dt may be NULL.) */
bool mlens_disk_tier_holds(const struct mlens_disk_tier *dt, int l, int e);

/* Experts below first are placed where the backend computes once and
 * for all (the GPU holds them resident): each step reads only the disk
 * experts from first on, and their pointers move within the staging
 * (the caller takes them anew). Waits for the reads under way. */
void mlens_disk_tier_keep_from(struct mlens_disk_tier *dt, int first);

/* Layer l's disk experts in their staging set: read them now unless a
 * read of them is under way or done, and wait. 0; -errno when a read
 * failed (said in the log with the file and tensor; the next call reads
 * again). dt may be NULL (0). */
int mlens_disk_tier_ready(struct mlens_disk_tier *dt, int l);
/* Layer l is done with its staging set: start reading the next layer
 * (in step order, round to the next step's first) that uses the set. */
void mlens_disk_tier_done(struct mlens_disk_tier *dt, int l);

/* Trades are possible: experts both on disk and in RAM, none placed for
 * good elsewhere (mlens_disk_tier_keep_from: the hybrid pipeline's and
 * GPU-only mode's split stays as loaded). */
bool mlens_disk_tier_can_trade(const struct mlens_disk_tier *dt);
/* Between steps (no layer's experts in use): disk expert in of layer l
 * takes the RAM page of expert out, read from the files into the staging
 * and copied there; out is read each step from then on. Layer l's model
 * pointers move (the caller takes them anew); the staging's reads start
 * over. 0; -EINVAL when in is not on disk, out not in RAM or trades are
 * not possible; -errno when the read failed (logged with the file and
 * tensor, counted): then both stay where they were. */
int mlens_disk_tier_trade(struct mlens_disk_tier *dt, int l, int in, int out);
/* Which experts of layer l are on disk (on_disk[0..E) 1) now; false when
 * none is (a dense layer, or no disk tier). Any thread. */
bool mlens_disk_tier_get_layer(struct mlens_disk_tier *dt, int l, uint8_t *on_disk);

/* A step's bounds, for the per-step stats. */
void mlens_disk_tier_step_begin(struct mlens_disk_tier *dt);
void mlens_disk_tier_step_end(struct mlens_disk_tier *dt);

/* The model files' read rate, bytes/s, as the tier reads them: its own
 * reads (O_DIRECT where it took, MLENS_DISK_TIER_DEPTH in flight) of the
 * disk experts, over again until about bytes are read (into a buffer of
 * its own; the staging is the reader's). 0 or -errno with err set. */
int mlens_disk_tier_measure(struct mlens_disk_tier *dt, uint64_t bytes, double *bps, char *err, size_t errlen);
/* The profiler's rate, for the stats. */
void mlens_disk_tier_set_ceiling(struct mlens_disk_tier *dt, double bps);
/* Bytes a step reads from the model files (every disk layer's), 0 for
 * dt NULL. */
uint64_t mlens_disk_tier_step_bytes(struct mlens_disk_tier *dt);
void mlens_disk_tier_get_stats(struct mlens_disk_tier *dt, struct mlens_disk_tier_stats *st);

#endif
