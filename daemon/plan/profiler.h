/* The pipeline profiler: measures the machine through the real
 * components (the engine's backend ops on one layer, the CPU decode
 * attention kernel and its pool, pinned copies, memory reads), fits the
 * GA and GB lines, fills the performance model's hardware description,
 * and caches the measurements in a JSON file keyed by model, backend,
 * GPU and budget. Also the daemon's profile state: the last prediction,
 * n_real and the token cap it set.
 *
 * What is timed (seconds per layer, wall clock around the ops and a sync):
 *   GA(n) = rmsnorm + Q, K, V GEMMs + RoPE of q and k for n tokens
 *   GB(n) = O GEMM (into the residual) + rmsnorm + router GEMM + router
 *           + MoE for n tokens
 * on random activations with the model's layer-0 weights, at token counts
 * spread evenly up to the largest that runs within the time budget (found
 * by doubling from a few tokens), best of a few runs each; the lines are
 * the least-squares fits of the perf model. GEMM rate: x[n][H] . w1[I][H]
 * at the largest n. Copies (only where backend memory is not host memory):
 * H2D and D2H between a pinned host buffer and backend memory on the copy
 * queue; the backend's K/V stores into a pinned host pool (kv_append and
 * kv_append_side) at random blocks. CPU attention: decode attention of whole sequences through a
 * host-memory backend's attn_decode (the pooled kernel of attn.h), KV
 * bytes read / time. CPU memory: streaming SIMD reads through the pool
 * (kernels/cpu/readbw.h, the loop mlens-bench measures with) of a buffer
 * several times the last-level cache, alone, and where copies cross a bus
 * again while the copy queue streams pinned host-to-device copies (the
 * weight stream): the model's B_mem is then those reads plus that copy
 * rate, the memory traffic KV reads and weight DMA share. (Scalar reads
 * alone fall far short of what reads and copies reach together, and the
 * model then names CPU memory where the traces show PCIe binding;
 * tests/bench/RESULTS.md has the numbers.) */
#ifndef MLENS_PROFILER_H
#define MLENS_PROFILER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"
#include "daemon/plan/gpu_plan.h"
#include "daemon/plan/perfmodel.h"
#include "kernels/backend.h"

#define MLENS_PROFILE_POINTS 6		/* token counts per line */
#define MLENS_PROFILE_VERSION 6		/* of the cache file's layout */
/* The workload mlensd predicts for at start-up (mlensctl profile takes
 * others): a prompt of 512 tokens, 128 generated. */
#define MLENS_PROFILE_PROMPT 512
#define MLENS_PROFILE_GEN 128

struct mlens_profile_opts {
	struct mlens_backend *be;	/* GA, GB, GEMM, copies */
	struct mlens_backend *attn;	/* host-memory backend for decode attention;
					 * NULL: be when it is host memory, else a CPU
					 * backend made for the run */
	int n_threads;			/* temporary CPU backend and memory read; 0 = all */
	enum mlens_dtype kv_dtype;
	int kv_block_size;		/* 0 = 16 */
	int64_t max_tokens;		/* most tokens timed in one step; 0 = 4096 */
	double budget_s;		/* seconds to aim for; 0 = 0.5 on host memory, 20 else */
	/* GA and GB as the hybrid pipeline calls them: in groups of at most
	 * group rows, the MoE in calls of at most moe_chunk tokens (0: all
	 * the step's tokens in one call, as the engine does) */
	int64_t group, moe_chunk;
};

/* Measurements (rates in bytes/s or FLOP/s; 0 = not measured). */
struct mlens_profile {
	char backend[128];
	char gpu[96];			/* "10de:2335 at 0000:3b:00.0", "" on the CPU */
	int n_points;
	int64_t tokens[MLENS_PROFILE_POINTS];
	double ga_s[MLENS_PROFILE_POINTS], gb_s[MLENS_PROFILE_POINTS];
	struct mlens_perf_line ga, gb;	/* seconds per layer vs tokens */
	double gemm_flops;
	double attn_prefill_flops;	/* the backend's prefill attention over prompts
					 * of MLENS_PROFILE_PROMPT tokens; 0 when it
					 * has none for this model */
	double h2d, d2h;		/* pinned copies; 0 on host memory */
	/* pinned copies on the compute queue, as the hybrid pipeline moves
	 * activations between its kernels; 0 on host memory */
	double act_h2d, act_d2h;
	/* bytes/s of the GPU's K/V stores into a pinned host pool (kv_append
	 * through the mapping; the hybrid pipeline's kv_append = gpu): on the
	 * compute queue, and on queue 2 (kv_append_side; 0 without one); 0 on
	 * host memory */
	double kv_store_bw, kv_store_side_bw;
	double attn_bw;			/* KV bytes/s through CPU decode attention */
	double attn_copy_bw;		/* the same while the copy queue streams pinned
					 * memory to the device (the hybrid pipeline's
					 * weight stream); 0 on host memory */
	double append_bw;		/* bytes/s through the CPU KV append: each row's
					 * fp32 K and V read, the pool's dtype written */
	double mem_bw;			/* CPU memory bytes/s for KV reads and DMA
					 * together (the model's B_mem): reads +
					 * copies under copy, else mem_read_bw */
	double mem_read_bw;		/* CPU memory read alone */
	double mem_read_copy_bw;	/* the read while copies stream; 0 on host memory */
	double copy_read_bw;		/* those copies' rate; 0 on host memory */
	double disk_bw;			/* the model files' read rate as the disk tier
					 * reads them; 0 without experts on disk */
	double seconds;			/* the run took */
};

/* Measure. -errno with err set: -EINVAL (options), -ENOMEM (buffers did
 * not fit beside what the backend holds), or a backend op's error. */
int mlens_profile_run(const struct mlens_model *m, const struct mlens_profile_opts *o,
		      struct mlens_profile *out, char *err, size_t errlen);

/* Fill the ceilings and lines of hw from p (budget, workspace and chunk are
 * the caller's). Without copies (host memory) b_io is the memory read rate:
 * the CPU backend's "uploads" are memory copies. b_mem is mem_bw. */
void mlens_profile_hw(const struct mlens_profile *p, struct mlens_perf_hw *hw);

/* ==== the cache ==== */

struct mlens_profile_key {
	char model[512];	/* path ("" for an in-memory model) */
	uint64_t config_hash;	/* FNV-1a of the model's dimensions and dtype */
	char backend[128];
	char gpu[96];
	uint64_t budget;	/* the GPU memory plan's effective budget (0: no GPU plan) */
	double budget_s;	/* the profile's time budget */
	int64_t group, moe_chunk;	/* how GA/GB were called (struct mlens_profile_opts) */
};

/* The key of a profile of model m on backend and gpu with the GPU memory
 * plan plan (NULL: a host-memory backend, none) and a time budget of
 * budget_s: the plan's effective budget goes in, so that gpu_memory = 0
 * and the same bytes set by hand are one key, and a device with other
 * free memory under gpu_memory = 0 another. */
void mlens_profile_key_make(struct mlens_profile_key *k, const struct mlens_model *m,
			    const char *backend, const char *gpu, const struct mlens_gpu_plan *plan,
			    double budget_s);
/* Name of the GPU behind a backend (vendor:device at PCI bus id), "" for
 * a backend in host memory or without CUDA. */
void mlens_profile_gpu_name(const struct mlens_backend *be, char *buf, size_t len);

/* Write atomically (temporary file + rename). 0 or -errno with err set. */
int mlens_profile_save(const char *path, const struct mlens_profile_key *k,
		       const struct mlens_profile *p, char *err, size_t errlen);
/* Read: 0, -ENOENT (no file), -ESTALE (written for another key: model,
 * backend, GPU or budget changed), -EINVAL (not a profile cache; err says
 * why). k NULL takes the file's key as it is (a replay of recorded
 * measurements: mlens-bench predict). */
int mlens_profile_load(const char *path, const struct mlens_profile_key *k,
		       struct mlens_profile *p, char *err, size_t errlen);

/* The measurements as JSON (the cache's "profile" and mlensctl profile's
 * "measured"). */
json_t *mlens_profile_json(const struct mlens_profile *p);

/* ==== the daemon's profile state ==== */

struct mlens_profile_state {
	/* set up at start-up */
	const struct mlens_model *model;
	struct mlens_profile_opts opts;
	struct mlens_perf_model pm;
	bool hybrid;			/* experts stream: residency is searched */
	/* profile on a backend of the same kind made for the run, not on
	 * opts.be: what the profile grows there (scratch for its token counts)
	 * is then given back, outside the serving budget (hybrid mode) */
	bool own_backend;
	struct mlens_backend_opts own_opts;
	uint64_t gpu_budget;		/* bytes the backend may hold (model's budget) */
	uint64_t gpu_workspace;
	int64_t chunk;
	/* hybrid: the pipeline's token group setting (group: rows, or
	 * MLENS_GPU_PLAN_GROUP_AUTO), GEMM mode and sets, so that the model's
	 * activation bytes are the executor's plan's (gpu_plan.h; att_half is
	 * att_up_half's, set by mlens_profile_state_hold); group 0
	 * otherwise: the model's own */
	struct mlens_gpu_plan_in plan_in;
	/* hybrid with gpu_copy_out = down or side: GA's copies to the host
	 * overlap the compute queue, so the model does not count them in the
	 * GPU's time; with side, the CPU attention's output going up neither */
	bool side_copy_out, up_copy_in;
	/* hybrid: the CPU attention's output goes up in the weights' dtype
	 * (pipeline att_up_half, as the pipeline took it): half the bytes */
	bool att_up_half;
	/* hybrid with kv_append = gpu: the GPU writes K/V into the pool */
	bool gpu_kv_append;
	double kv_tokens;		/* KV pool capacity in tokens (M) */
	int pinned_cap;			/* max_step_tokens as configured (> 0: pinned) */
	/* the engine's largest step: set by a run with the scheduler, else
	 * opts.max_tokens; bounds n_real where host memory is the budget */
	int max_step;
	const char *cache_path;		/* "" or NULL: no cache */
	struct mlens_profile_key key;
	/* results of the last run (written on the worker thread while the main
	 * thread waits for it, read on the main thread) */
	bool have;
	bool from_cache;
	struct mlens_profile prof;
	struct mlens_perf_hw hw;
	struct mlens_perf_workload w;
	struct mlens_perf_prediction pred;
	int token_cap;			/* the scheduler's cap after the run */
	int rc;
	char err[512];
};

/* Profile (or, with use_cache, load a matching cache), predict for the
 * workload p, g and, unless the cap is pinned, set the scheduler's token
 * cap from n_real (sched may be NULL: nothing set). Runs on the thread
 * that drives the engine. 0 or -errno with st->err set. */
struct mlens_sched;
int mlens_profile_state_run(struct mlens_profile_state *st, struct mlens_sched *sched,
			    double p, double g, bool use_cache);
/* Take st->prof as the held measurements: the model's ceilings from it and
 * the state's set-up (budget, workspace, chunk, plan, gpu_copy_out). The
 * run does it after measuring or loading; mlens-bench predict after
 * loading a recorded cache. */
void mlens_profile_state_hold(struct mlens_profile_state *st);
/* Set the scheduler's cap from the held prediction unless pinned (on the
 * thread that owns sched); the cap in force afterwards. */
int mlens_profile_state_apply(struct mlens_profile_state *st, struct mlens_sched *sched);
/* Predict again for another workload from the measurements held. */
int mlens_profile_state_predict(struct mlens_profile_state *st, double p, double g);
/* Predicted seconds of a step of n tokens with the held workload's mix;
 * NAN without a profile. */
double mlens_profile_state_step_seconds(const struct mlens_profile_state *st, double n);
/* The reply of mlensctl profile (measured ceilings, lines, n_real, policy,
 * prediction, cap). */
json_t *mlens_profile_state_json(const struct mlens_profile_state *st);

/* Following the traffic (config workload_follow): the scheduler's counters
 * of the requests done and of their prompt and generated tokens (counted
 * when each is done, so that requests in flight weigh nothing: while the
 * pool fills, prefill tokens run far ahead of the requests that finish) at
 * the start of a window. */
struct mlens_workload_window {
	bool started;
	uint64_t prompt_tokens, generated_tokens, requests_done;
};
#define MLENS_FOLLOW_MIN_REQUESTS 64
#define MLENS_FOLLOW_CHANGE 0.10
/* The window ends at the counters given (cumulative, as the scheduler's
 * stats): with at least MLENS_FOLLOW_MIN_REQUESTS done in it, *p and *g
 * get their mean prompt and generated tokens, a new window starts, and 1 is returned when either differs from held_p /
 * held_g by more than MLENS_FOLLOW_CHANGE (relative; held_p 0 counts as a
 * change from any p of a token or more); else 0 (with too few requests the
 * window goes on). The first call only starts a window. */
int mlens_workload_follow(struct mlens_workload_window *win, uint64_t prompt_tokens,
			  uint64_t generated_tokens, uint64_t requests_done, double held_p,
			  double held_g, double *p, double *g);

#endif
