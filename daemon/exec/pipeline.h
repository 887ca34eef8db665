/* The hybrid pipeline executor (DESIGN §5, §5.1): one step of a
 * Mixtral model whose experts do not all fit the GPU budget. Two backends:
 * the GPU one (embeddings, norms, QKV, RoPE, prefill attention, O
 * projection, router, experts, lm_head, sampling; with gpu_kv_append also
 * the KV append, stored into the pool through its mapping) and the CPU one
 * (the KV append otherwise, and decode attention on the pinned host KV
 * pool). Resident on the
 * GPU: embeddings, lm_head, norms, routers, attention and the plan's
 * resident experts; the other experts stream through two slots in pieces,
 * in the order of the step program (daemon/exec/pipeprog.h). The GPU memory
 * split is the plan it is given (daemon/plan/gpu_plan.h); the executor never holds more than the
 * budget and fails loudly if the backend's count says otherwise.
 *
 * With a GPU backend that has queues and events (the optional ops of
 * kernels/backend.h) copies and compute overlap as the program says; with
 * one that has none (the CPU backend, as in CI) the same program runs in
 * program order, with the same numerics. Same step contract as the engine
 * (daemon/exec/engine.h), which hands its steps here when created in hybrid
 * mode. Not thread-safe: one thread drives a pipeline. */
#ifndef MLENS_PIPELINE_H
#define MLENS_PIPELINE_H

#include <stdbool.h>
#include <stdint.h>
#include "daemon/exec/engine.h"
#include "daemon/exec/residency.h"
#include "daemon/plan/gpu_plan.h"

struct mlens_pipeline;

struct mlens_pipeline_opts {
	/* The GPU memory plan (daemon/plan/gpu_plan.h, the hybrid one: not
	 * gpu_only), made by the caller with mlens_gpu_plan_make: the budget,
	 * the resident experts, the token cap, the group and MoE chunk, the
	 * activation sets and the op scratch. The pipeline keeps a copy;
	 * NULL is refused. */
	const struct mlens_gpu_plan *plan;
	int groups;		/* token groups at least (when there are requests enough), 1 or 2; 0 = 2 */
	uint64_t piece_bytes;	/* weight pieces; 0 = MLENS_PIPE_PIECE */
	/* GA's K/V/q copies to the host on the backend's second copy queue
	 * (ops side_queue) rather than between the compute queue's kernels,
	 * so that the next kernels need not wait for them; ignored without
	 * such a queue */
	bool side_copy_out;
	/* With side_copy_out, the CPU attention's output back on the backend's
	 * upload queue (ops up_queue), which GB waits for by an event, rather
	 * than on the compute queue behind the kernels issued before it;
	 * ignored without such a queue */
	bool up_copy_in;
	/* Prefill attention on the CPU backend too (it is on the GPU unless
	 * this is set or the GPU backend refuses the model's head_dim). */
	bool prefill_cpu;
	/* The GPU side writes each row's K and V into the KV pool (the GPU
	 * backend's kv_append, through the pool's mapping on a device: the
	 * pool is registered with it), so the host side only attends and K/V
	 * do not come down as fp32 copies. Refused (-ENOTSUP, said in err)
	 * where the GPU backend cannot reach host memory. With side_copy_out
	 * and the backend's kv_append_side the stores run on queue 2, after
	 * GA's kernels and beside the compute queue's next ones. */
	bool gpu_kv_append;
	/* the KV pool, as in struct mlens_engine_opts */
	int kv_block_size;
	uint32_t kv_blocks;
	int kv_dtype;
	void *kv_mem_k;
	void *kv_mem_v;
	struct mlens_trace *trace;	/* step traces (daemon/ops/trace.h), may be NULL */
	/* the op time account (daemon/exec/op_time.h) whose probe times the
	 * GPU side's ops on the pipeline's step timer, or NULL; the caller's */
	struct mlens_op_time *op_time;
	/* Which experts of a layer are the plan's r resident ones: experts
	 * 0..r-1 for good (false), or re-chosen every residency_period steps
	 * (0: MLENS_RESIDENCY_PERIOD) from the routing counts, the most-routed
	 * resident, at most residency_swaps (0: MLENS_RESIDENCY_SWAPS)
	 * experts swapped in a step (daemon/exec/residency.h). The stream
	 * carries the rest either way. */
	bool residency_routing;
	int residency_period;
	int residency_swaps;
};

/* Busy time of the last step and totals (seconds, bytes). */
struct mlens_pipeline_stats {
	double step_s;		/* wall time of the last step */
	double cpu_attn_s;	/* host time in KV append + decode attention */
	double cpu_append_s;	/* of which in the KV append */
	double host_wait_s;	/* host time blocked on the GPU */
	uint64_t h2d_weight_bytes;	/* streamed expert bytes, last step */
	uint64_t h2d_act_bytes, d2h_act_bytes;	/* activation copies, last step */
	uint64_t kv_read_tokens;	/* last step: context positions read per layer */
	int groups;			/* last step: token groups */
	uint64_t steps;
	uint64_t h2d_bytes_total, d2h_bytes_total;
	double cpu_attn_s_total, cpu_append_s_total, host_wait_s_total;
	/* busy time (union of the queue's timed spans) from the backend's
	 * timing marks: GPU compute queue and H2D copies, last step and totals */
	double gpu_busy_s, h2d_busy_s;
	double gpu_busy_s_total, h2d_busy_s_total;
	/* KV bytes the CPU decode attention read, last step and total */
	uint64_t kv_read_bytes, kv_read_bytes_total;
	/* KV blocks it read (per layer) and the runs of consecutive block
	 * ids they lay in, totals: blocks / runs is how far it streamed
	 * unbroken (kv_pool.h, growth room) */
	uint64_t kv_read_blocks_total, kv_read_runs_total;
	bool async;		/* queues and events in use */
	bool side_copy_out;	/* GA's copies to the host on queue 2 */
	bool up_copy_in;	/* C's output up on queue 3 */
	bool att_up_half;	/* ... in the weights' dtype (the plan's att_half) */
	int sets;		/* activation sets (opts sets) */
	bool prefill_cpu;	/* prefill attention runs on the CPU */
	bool gpu_kv_append;	/* the GPU side appends K/V to the pool */
	bool kv_append_side;	/* ... on queue 2, beside the compute queue */
	/* routed rows (tokens x top-k, every MoE layer) and of them the rows
	 * whose expert was resident: last step and totals; experts swapped
	 * into the resident sets, total, and the last step's bytes uploaded
	 * for them (in h2d_bytes_total too) */
	uint64_t expert_rows, expert_resident_rows;
	uint64_t expert_rows_total, expert_resident_rows_total;
	uint64_t expert_swaps_total, h2d_swap_bytes;
	bool residency_routing;	/* the resident sets follow the routing */
};

/* Whether a pipeline of these backends and model may send the CPU
 * attention's output up in the weights' dtype (bf16/f16, half the bytes of
 * fp32): the GPU backend's O projection rounds its input to that dtype
 * anyway (ops round and gemm_half_in; fast GEMMs), and both round: the
 * same product for half the upload. The plan's att_half (gpu_plan.h) may
 * be set only where this holds. */
bool mlens_pipeline_half_att(const struct mlens_backend *gpu, const struct mlens_backend *cpu,
			     const struct mlens_model_config *c);

int mlens_pipeline_create(struct mlens_pipeline **out, const struct mlens_model *m,
			  struct mlens_backend *gpu, struct mlens_backend *cpu,
			  const struct mlens_pipeline_opts *o, char *err, size_t errlen);
void mlens_pipeline_destroy(struct mlens_pipeline *p);

struct mlens_kv_pool *mlens_pipeline_kv(struct mlens_pipeline *p);
const struct mlens_gpu_plan *mlens_pipeline_plan(const struct mlens_pipeline *p);
int mlens_pipeline_max_step_tokens(const struct mlens_pipeline *p);
const struct mlens_pipeline_stats *mlens_pipeline_stats(const struct mlens_pipeline *p);
/* The resident sets and their routing counts (read between steps, on the
 * thread that drives the pipeline). */
const struct mlens_residency *mlens_pipeline_residency(const struct mlens_pipeline *p);
/* Bytes the pipeline holds on the GPU backend (its own allocations, plus
 * the backend's scratch where the backend counts it). */
uint64_t mlens_pipeline_gpu_bytes(const struct mlens_pipeline *p);

/* As mlens_engine_step; -ENOSPC also when the GPU backend went past the
 * budget (with a message on stderr naming both). */
int mlens_pipeline_step(struct mlens_pipeline *p, struct mlens_engine_req *reqs, int n);

#endif
