/* A single-process stand-in for G GPUs: runs a step of the
 * sharded forward pass on one host-memory backend (the CPU reference),
 * each "rank" computing its shard of daemon/plan/shard.h with its own weight
 * slices and its own KV cache (its kv heads), and the collectives done as
 * memcpy and adds in a fixed rank order. It exists to prove the sharded
 * math equal to the unsharded engine before NCCL carries it; it is not a
 * serving path (the ranks run one after another). */
#ifndef MLENS_SHARD_SIM_H
#define MLENS_SHARD_SIM_H

#include <stdint.h>
#include "daemon/exec/engine.h"
#include "daemon/exec/kv_pool.h"
#include "daemon/plan/shard.h"

struct mlens_shard_sim;

/* be must be a host-memory backend (the CPU one): the fake collectives
 * touch its memory directly (-EINVAL otherwise). The plan must come from
 * mlens_shard_plan on m's config. kv_blocks blocks of block_size tokens
 * (0: 16) per rank cache; block ids are shared by all ranks and handed out
 * by mlens_shard_sim_kv(). */
int mlens_shard_sim_create(struct mlens_shard_sim **out, const struct mlens_model *m,
			   struct mlens_backend *be, const struct mlens_shard_plan *plan,
			   uint32_t kv_blocks, int block_size, char *err, size_t errlen);
void mlens_shard_sim_destroy(struct mlens_shard_sim *s);

/* The pool that hands out block ids (its cache is rank 0's). */
struct mlens_kv_pool *mlens_shard_sim_kv(struct mlens_shard_sim *s);

/* One step, as mlens_engine_step with the engine's cache path for every
 * token (tokens appended to the cache, then attention over it): for each
 * request, logits (when set) gets the last token's logits and next_token
 * the greedy choice (samp is not used); seq->len grows. Rows per rank
 * routed to experts (EP) are added to rows_out[rank] when it is not NULL.
 * -EINVAL bad request, -E2BIG past max_tokens (4096), -ENOSPC no KV room. */
int mlens_shard_sim_step(struct mlens_shard_sim *s, struct mlens_engine_req *reqs, int n,
			 int64_t *rows_out);

#endif
