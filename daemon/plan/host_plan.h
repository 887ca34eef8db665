/* The host memory plan: how a host_memory budget splits among the weight
 * pages, the KV pool and staging (a step's activations on the host), and
 * whether it can run at all. Pure arithmetic; the daemon prints the split
 * at start-up and sizes the KV pool from it. */
#ifndef MLENS_HOST_PLAN_H
#define MLENS_HOST_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"

struct mlens_host_plan_in {
	uint64_t budget;	/* host_memory; 0: none (kv_want is taken as is) */
	uint64_t weight_bytes;	/* the weight pages: the model files */
	uint64_t kv_want;	/* kv_cache: the KV pool's most */
	uint64_t kv_min;	/* the least KV pool that runs (mlens_host_plan_kv_min) */
	uint64_t staging;	/* mlens_host_plan_staging */
	uint64_t disk;		/* expert bytes left in the model files (weights_on_disk) */
	uint64_t disk_staging;	/* the disk tier's pinned staging */
};

struct mlens_host_plan {
	uint64_t budget;	/* 0: none */
	uint64_t weights, kv, staging;
	uint64_t disk, disk_staging;	/* 0 without experts on disk */
	uint64_t kv_min;
	uint64_t need;		/* the least budget that runs: weights + disk_staging + staging + kv_min */
};

/* Split in->budget: weight pages and staging first, the KV pool gets the
 * rest up to kv_want. 0; -ENOSPC when the budget is below need (the plan
 * is filled either way), with err naming what is short and the budget to
 * ask for. Without a budget the KV pool is kv_want and nothing is
 * refused. */
int mlens_host_plan_split(struct mlens_host_plan *p, const struct mlens_host_plan_in *in, char *err,
			  size_t errlen);

/* One line: budget, each part's bytes and share. */
void mlens_host_plan_format(const struct mlens_host_plan *p, char *out, size_t n);

/* Host bytes of a step's activations: with hybrid, the pipeline's sets of
 * host activations (q, k, v and the attention output of group_tokens rows
 * each, fp32); on the CPU backend (host_compute) the step's activations of
 * step_tokens rows (residual, norm, q, k, v, attention output, the
 * experts' rows), fp32; GPU-only mode: none. */
uint64_t mlens_host_plan_staging(const struct mlens_model_config *c, bool hybrid, bool host_compute,
				 int64_t step_tokens, int64_t group_tokens, int sets);

/* The least KV pool that runs: K and V for one sequence as long as the
 * longest prompt the daemon takes (the step cap, at most the context),
 * in whole blocks of kv_block_bytes (K and V of one block). */
uint64_t mlens_host_plan_kv_min(const struct mlens_model_config *c, int64_t step_tokens, int block_size,
				uint64_t kv_block_bytes);

#endif
