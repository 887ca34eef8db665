/* The engine: one forward step of a Mixtral model through a backend for a
 * set of sequences, some in prefill and some in decode. Owns the weights as
 * the backend sees them, the activation buffers and the KV pool. It does no
 * scheduling: the caller picks the sequences and checks KV room first.
 * Not thread-safe: one thread drives an engine. */
#ifndef MLENS_ENGINE_H
#define MLENS_ENGINE_H

#include <stdbool.h>
#include <stdint.h>
#include "daemon/exec/kv_pool.h"
#include "daemon/model/model.h"
#include "kernels/backend.h"

struct mlens_engine;
struct mlens_layer_probe;
struct mlens_gpu_plan;
struct mlens_op_time;

struct mlens_engine_opts {
	int kv_block_size;	/* tokens per KV block; 0 = 16 */
	uint32_t kv_blocks;	/* blocks in the pool; 0 = enough for 8 full contexts */
	int kv_dtype;		/* -1 = auto (F32 for F32 models, else BF16) */
	int max_step_tokens;	/* tokens one step may carry; 0 = 4096 */
	void *kv_mem_k;		/* optional caller-owned KV memory (see kv_pool.h) */
	void *kv_mem_v;
	/* Attention of prefill tokens: MLENS_PREFILL_AUTO picks the cache path
	 * on host-memory backends (so that a re-prefill after preemption gives
	 * bit-identical results to the uninterrupted decode) and the prefill op
	 * (flash attention) elsewhere. */
	int prefill_attn;
	/* Hybrid mode: with attn_backend set, every step runs through
	 * the hybrid pipeline (daemon/exec/pipeline.h): be is the GPU side, held
	 * to plan (the hybrid GPU memory plan, daemon/plan/gpu_plan.h, made
	 * by the caller: budget, resident experts, token cap, groups, sets),
	 * and attn_backend (host memory: the cpu backend) holds the KV pool
	 * and runs decode attention. max_step_tokens is then the plan's. */
	struct mlens_backend *attn_backend;
	/* the GPU memory plan (made once by the caller): the hybrid one with
	 * attn_backend, else GPU-only mode's (gpu_only: every expert
	 * resident; max_step_tokens is then its tokens) or NULL (no plan: a
	 * host-memory backend, tests) */
	const struct mlens_gpu_plan *plan;
	int hybrid_groups;	/* token groups, 0 = 2 */
	uint64_t hybrid_piece_bytes;	/* bytes per weight copy; 0 = MLENS_PIPE_PIECE */
	bool hybrid_prefill_cpu;	/* prefill attention on attn_backend too */
	bool hybrid_side_copy_out;	/* GA's copies to the host on queue 2 (pipeline.h) */
	bool hybrid_up_copy_in;		/* ... and C's output up on queue 3 (pipeline.h) */
	bool hybrid_gpu_kv_append;	/* the GPU side appends K/V to the pool (pipeline.h) */
	/* the resident experts follow the routing, re-chosen every period
	 * steps (0: the default); pipeline.h's residency_* */
	bool hybrid_residency_routing;
	int hybrid_residency_period;
	/* Experts left on disk (weights_on_disk) on a host-memory backend:
	 * the ones kept in RAM follow the routing, re-chosen every
	 * weights_disk_period steps (0: the default), one trade a step
	 * (daemon/model/disk_tier.h); else the split stays as loaded */
	bool weights_disk_follow;
	int weights_disk_period;
	/* Time every step's ops on the backend's timing marks, read after the
	 * step (daemon/exec/op_time.h; the hybrid pipeline's GPU side); a
	 * backend without marks has none */
	bool op_timing;
};

enum {
	MLENS_PREFILL_AUTO = 0,
	MLENS_PREFILL_OP = 1,		/* attn_prefill over this step's k, v */
	MLENS_PREFILL_CACHE = 2,	/* attn_decode over the paged cache */
};

/* One sequence's part of a step: n_tokens tokens appended at positions
 * seq->len ..; on return seq->len has grown by n_tokens and next_token holds
 * the token sampled after the last one. */
struct mlens_engine_req {
	struct mlens_seq *seq;
	const int32_t *tokens;
	int n_tokens;
	struct mlens_sampling samp;
	float *logits;		/* optional host [vocab] (or [n_tokens][vocab] with all_logits) */
	bool all_logits;
	int32_t next_token;	/* out */
	float logprob;		/* out: log-probability of next_token */
};

int mlens_engine_create(struct mlens_engine **out, const struct mlens_model *m,
			struct mlens_backend *be, const struct mlens_engine_opts *o,
			char *err, size_t errlen);
void mlens_engine_destroy(struct mlens_engine *e);

struct mlens_kv_pool *mlens_engine_kv(struct mlens_engine *e);
/* The hybrid pipeline of an engine in hybrid mode, else NULL. */
struct mlens_pipeline *mlens_engine_pipeline(struct mlens_engine *e);
/* The experts kept in RAM follow the routing (opts weights_disk_follow
 * took: experts on disk, a host-memory backend). */
bool mlens_engine_disk_follows(const struct mlens_engine *e);

/* The op time account (engine opts op_timing), or NULL without one. */
const struct mlens_op_time *mlens_engine_op_time(const struct mlens_engine *e);
/* The engine's step trace recorder (daemon/ops/trace.h): armed by mlensctl
 * trace; each mlens_engine_step is a traced step while armed. The hybrid
 * pipeline adds its spans to it. */
struct mlens_trace *mlens_engine_trace(struct mlens_engine *e);
const struct mlens_model_config *mlens_engine_config(const struct mlens_engine *e);
int mlens_engine_max_step_tokens(const struct mlens_engine *e);

/* The checks every step makes before it touches any state (shared by the
 * engine and the hybrid pipeline): each request names a sequence and at
 * least one token, every token id is in the vocabulary, no sequence runs
 * past max_position_embeddings. 0 with *total tokens, -EINVAL or
 * -EOVERFLOW. */
int mlens_engine_reqs_check(const struct mlens_model_config *c, const struct mlens_engine_req *reqs,
			    int n, int64_t *total);

/* KV blocks the step would need beyond what its sequences hold. */
uint32_t mlens_engine_step_blocks(struct mlens_engine *e, const struct mlens_engine_req *reqs,
				  int n);

/* Call probe around every op of the next steps (the layers', the
 * embedding, lm_head and sampling), NULL to stop; the probe stays the
 * caller's. A probe that waits for the backend in its end times each op
 * (mlens-bench ops). Engines in hybrid mode do not call it. */
void mlens_engine_set_probe(struct mlens_engine *e, const struct mlens_layer_probe *probe);

/* Run one step. Errors (nothing changed): -EINVAL bad request (token id out
 * of range, empty), -E2BIG more tokens than max_step_tokens, -EOVERFLOW past
 * max_position_embeddings, -ENOSPC not enough free KV blocks; a backend
 * failure returns its -errno (the sequences' len is then unchanged but the
 * KV contents of the new positions are undefined). */
int mlens_engine_step(struct mlens_engine *e, struct mlens_engine_req *reqs, int n);

#endif
