/* The performance model: byte and FLOP accounting of a Mixtral
 * layer, n_real, the hierarchical roofline step time, throughput for a
 * workload, and the policy search (expert residency, token groups). Pure
 * arithmetic: it measures nothing; the profiler fills struct mlens_perf_hw.
 *
 * Design note: the formulas and where they come from.
 *
 * Accounting (per layer, bytes = elements x dtype size):
 *   attention  (q,o: H x heads*hd; k,v: H x kv*hd)    attn_bytes
 *   experts    E x 3 x H x I                           expert_bytes x E
 *   router     E x H;  norms 2 x H
 *   model      L x layer + embeddings + lm_head (0 when tied) + final norm
 *   KV         2 x kv*hd x kv dtype per token; a decode token of context c
 *              reads c such rows (DESIGN §1: KV and attention on the CPU).
 *   FLOPs/token: GA = 2 H (heads*hd + 2 kv*hd) (QKV projection);
 *              GB = 2 heads*hd H (O) + 2 H E (router) + k x 3 x 2 H I
 *              (top-k experts). Prefill attention on the GPU adds
 *              4 heads*hd per (query, key) pair.
 *   Streamed bytes per step and layer: the experts not resident on the GPU,
 *   (E - r) x expert_bytes, r whole experts kept resident in every layer
 *   (DESIGN §5.1: attention, norms, router, embeddings, lm_head resident).
 *
 * n at which GPU time equals weight transfer (MoE-Lens eq. 1-2):
 *   eq. 2, simple form:  n >= (C_GPU / B_IO) x (N_experts / N_active),
 *     which is n x (k x 6HI) / C_GPU = E x 3HI x 2 bytes / B_IO for bf16;
 *     mlens_perf_n_simple generalises the 2 bytes to the weight dtype.
 *   roofline form: n = C_GPU x streamed bytes / (B_IO x FLOPs per token),
 *     attention weights and FLOPs counted (mlens_perf_n_roofline).
 *   fitted form (the profiler's, MoE-Lens §Pipeline Profiler): GPU seconds
 *     per layer for n tokens split in two groups = 2a + b n, with a, b the
 *     least-squares line of GA+GB time against tokens in one group; n_eq
 *     solves 2a + b n = streamed bytes / B_IO (plus, per token, the GPU's
 *     and the link's extras below). With B_IO,shared (the stream's rate
 *     while the CPU attention reads memory) below B_IO, n_eq is instead
 *     where the step time's GPU tier meets its PCIe tier (both below) for
 *     the workload's steady step: the transfer the step really gets, so
 *     n_eq rises with the attention's share. n_real = min(n_eq, n_act),
 *     n_act the most tokens whose activations fit what the budget leaves
 *     (formula at mlens_gpu_plan_act_estimate, DESIGN §5.2, or the executor's own
 *     count when hw gives one: mlensd gives the hybrid pipeline's plan's),
 *     and never below the workload's min_tokens (a whole prompt) when
 *     memory allows it.
 *
 * KV capacity bound (MoE-Lens eq. 3-4, DESIGN §1):
 *   In steady state a sequence holds p + j KV tokens at its j-th decode
 *   step, j uniform in [0, g], so on average p + g/2; M tokens of KV hold
 *   S = M / (p + g/2) sequences. Each step gives every one a decode token;
 *   S/g finish per step and as many start, each a p-token prefill, so a
 *   step carries S + S p / g = S (p+g)/g tokens = PME x M with
 *   eq. 3: PME = 2(p+g) / ((2p+g) g).
 *   eq. 4: T_max = min(PME x M / delta, T_GPU), delta = L x streamed bytes
 *   per layer / B_IO (seconds to stream one step's weights) and T_GPU =
 *   n_real / (L x (a + b n_real)), the GPU's own rate at n_real.
 *   Of a step's n tokens, n g/(p+g) are decode tokens (the generated ones,
 *   the paper's count) and n p/(p+g) prefill tokens; decode tokens read on
 *   average p + g/2 KV rows.
 *
 * Step time (MoE-Lightning's hierarchical roofline, DESIGN §1 and §5): per
 * layer each tier needs work / rate:
 *   PCIe H2D   (streamed experts + decode attention outputs) / B_IO; with
 *              B_IO,shared (copies while the CPU attention reads memory)
 *              measured, bytes / B_IO,shared in a step whose attention
 *              reads the KV at all: between the attention's passes the
 *              pipeline's other host traffic keeps the stream below B_IO
 *              too (the pipeline's traces put a layer's rate near
 *              B_IO,shared)
 *   PCIe D2H   (decode q,k,v + prefill K/V) / B_D2H
 *              (these activation copies move abytes an element: the
 *              pipeline copies its fp32 activations as they are)
 *   CPU memory (KV read + all DMA bytes) / B_mem: DMA and KV reads share
 *              the memory bandwidth (B_mem = B_KV + B_IO)
 *   GPU        sum over the two token groups of a + b n_x + prefill
 *              attention FLOPs / C_attn (the measured rate of the prefill
 *              attention kernel; C_GPU when not measured) + the group's
 *              activation copies / their rate on the compute queue (the
 *              pipeline queues them between its kernels, which wait for
 *              them; not counted when no such rate is given)
 *   CPU attn   KV bytes read / measured attention bandwidth (the one
 *              measured while a pinned copy streams, B_attn,shared, where
 *              experts stream) + every token's KV append (fp32 K and V
 *              read, the pool's dtype written) / its measured rate
 *   disk       bytes read from the model files a layer (weights on disk)
 *              / B_disk, the read overlapping the layer before
 *   chain      max over groups x of g_x + c_x: group x's GPU work and its
 *              CPU attention cannot overlap each other, only the other
 *              group's (the VSLPipe alternation)
 * period = max of these, and it names the binding resource; a step takes
 * L x period + fill/drain, fill/drain being one layer's non-overlapped
 * chain (the first stage has no GB to hide GA behind, the last no GA to
 * hide the final GB and attention). Throughput = tokens per step / step.
 *
 * Policy search (MoE-Lightning's policy search): over r = 0..E
 * resident experts per layer, with r fixed the GPU budget must hold
 * resident weights + two expert slots (E - r experts each, none when
 * r = E) + activations for n_real + workspace; the two groups' split of
 * decode and prefill tokens is searched on a grid per step, each group at
 * most MLENS_PERF_GROUP_MAX of the step. The policy of highest predicted
 * throughput wins (ties: fewer resident experts). With linear costs the
 * two chains sum to GPU + CPU time, so a split that balances them (the
 * even one among others) is optimal and the chain never binds above
 * max(GPU, CPU); the search keeps the even split on ties and matters once
 * measured costs stop being proportional to the group's tokens. */
#ifndef MLENS_PERFMODEL_H
#define MLENS_PERFMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"

/* Token groups of the pipeline (α, β) and the largest share of a step one
 * group may take: activations budget q,k,v for a group that large. */
#define MLENS_PERF_GROUPS 2
#define MLENS_PERF_GROUP_MAX 0.75
/* Token x expert rows of one MoE (and lm_head) chunk when hw says 0. */
#define MLENS_PERF_CHUNK 4096

/* Model dimensions and the byte/FLOP counts derived from them. */
struct mlens_perf_model {
	int64_t hidden, inter, layers, heads, kv_heads, head_dim, experts, top_k, vocab;
	int64_t wbytes;		/* bytes per weight element */
	bool expert_fp8;	/* experts in fp8 e4m3 (expert_bytes counts their scales) */
	/* ... multiplied on the GPU's fp8 tensor cores (backend op fp8_tc, and
	 * per-channel scales; set by the caller, false from the config): the
	 * MoE scratch holds no dequantized expert */
	bool expert_fp8_tc;
	int64_t kvbytes;	/* bytes per KV element (pool dtype) */
	int64_t abytes;		/* bytes per activation element on the GPU (f32),
				 * also of the q,k,v and attention-output copies */
	bool tied;		/* lm_head is the embedding matrix */
	/* derived, bytes per layer unless stated */
	uint64_t attn_bytes;	/* q, k, v, o */
	uint64_t norm_bytes;	/* the two RMS norms */
	uint64_t router_bytes;
	uint64_t family_bytes;	/* a family's resident extras, the most a layer has:
				 * q/k norms, biases, a shared expert or a dense MLP */
	int64_t mlp_inter;	/* that shared or dense MLP's width (0: none) */
	uint64_t expert_bytes;	/* one expert: w1, w2, w3 */
	uint64_t layer_expert_bytes;	/* all experts of a layer */
	uint64_t layer_bytes;	/* everything of a layer */
	uint64_t embed_bytes, lm_head_bytes, final_norm_bytes;	/* once */
	uint64_t model_bytes;	/* the whole model */
	uint64_t kv_token_bytes;	/* K and V of one token in one layer */
	double flops_ga;	/* per token per layer: QKV projection */
	double flops_gb;	/* per token per layer: O, router, top-k experts */
	/* of flops_gb: the top-k routed experts' GEMMs (k x 6 H I; a shard's
	 * share on several GPUs), the ones fp8 experts run on fp8 tensor cores */
	double flops_experts;
};

/* Fill pm from a model config; kv_dtype is the KV pool's. -EINVAL for a
 * dimension that is not positive or top-k > experts, -EOVERFLOW when a
 * size does not fit 64 bits. */
int mlens_perf_model_from_config(struct mlens_perf_model *pm, const struct mlens_model_config *c,
				 enum mlens_dtype kv_dtype);

/* A residency's bytes (resident weights, expert slots, the fewest fixed
 * bytes, the minimum budget) and the activation estimate are the GPU
 * memory plan's (gpu_plan.h): the model asks it, one formula each. */

/* KV bytes one decode token with context ctx reads in one layer. */
double mlens_perf_kv_read_bytes(const struct mlens_perf_model *pm, double ctx);

/* A least-squares line: seconds = a + b x tokens. */
struct mlens_perf_line {
	double a, b;		/* intercept (s), slope (s per token) */
	double se;		/* residual standard error (s); 0 with two points */
	double se_a, se_b;	/* standard errors of a and b */
	int n;			/* points fitted */
};

/* Ordinary least squares of y on x. -EINVAL with fewer than two points,
 * x all equal or a value that is not finite. */
int mlens_perf_fit_line(const double *x, const double *y, int n, struct mlens_perf_line *out);
double mlens_perf_line_at(const struct mlens_perf_line *l, double x);

/* Measured (or stated) ceilings of a machine. */
struct mlens_perf_hw {
	double b_io;		/* H2D bytes/s, pinned memory (B_IO) */
	double b_d2h;		/* D2H bytes/s; 0 = b_io */
	double b_mem;		/* CPU memory bytes/s, shared by KV reads and DMA */
	double b_attn;		/* KV bytes/s through the CPU decode attention */
	/* the same while the weight stream's DMA reads host memory too; > 0:
	 * the attention runs at this rate where experts stream; 0: b_attn */
	double b_attn_shared;
	/* bytes/s of the KV append on the CPU (each token's fp32 K and V read,
	 * the pool's dtype written: 2 kv_heads head_dim abytes + kv_token_bytes
	 * a token and layer), which the attention's host side does before the
	 * attention; 0: not counted */
	double b_append;
	/* the GPU side writes each token's K and V into the pool (pipeline
	 * opts gpu_kv_append): no append on the CPU (b_append unused), and
	 * the D2H link carries kv_token_bytes a token and layer in the pool's
	 * dtype rather than fp32 K and V */
	bool gpu_kv_append;
	/* with gpu_kv_append: bytes/s of those stores (kv_token_bytes a token
	 * and layer); 0: they count at b_d2h like a copy. kv_store_side: they
	 * run beside the GPU's kernels (the pipeline's queue 2) and share the
	 * D2H link with the q copies; else they hold up the compute queue:
	 * the GPU tier counts them */
	double b_kv_store;
	bool kv_store_side;
	double c_gpu;		/* GPU GEMM FLOP/s (eq. 2) */
	double c_attn;		/* GPU prefill attention FLOP/s; 0 = c_gpu */
	/* bytes/s of the activation copies on the GPU's compute queue, each
	 * way; > 0: the queue's kernels wait for them, so the GPU tier counts
	 * them; 0: they overlap the kernels */
	double b_act_h2d, b_act_d2h;
	/* bytes of each value of the CPU attention's output on its way up: 2
	 * where it crosses in the weights' dtype (pipeline att_up_half); 0:
	 * the activation size (abytes) */
	double att_up_bytes;
	/* H2D bytes/s while the CPU attention reads the KV cache (the two share
	 * host memory: the profile's copies under reads); > 0: the weight
	 * stream runs at this rate for as long as the attention runs, at b_io
	 * otherwise; 0: at b_io throughout */
	double b_io_shared;
	double b_hbm;		/* GPU memory bytes/s */
	/* Experts left in the model files (weights_on_disk): bytes read each
	 * step, on average a layer, at b_disk bytes/s (the profiler's read
	 * rate of the model files); 0: no disk tier. The fourth ceiling: a
	 * tier of the step time, and n_eq balances the GPU's time against it
	 * as against the PCIe stream. */
	double disk_layer_bytes;
	double b_disk;
	struct mlens_perf_line ga, gb;	/* GPU s per layer vs tokens in one group */
	uint64_t gpu_budget;	/* bytes the daemon may use on the GPU */
	uint64_t gpu_workspace;	/* cuBLAS, flash attention */
	int64_t chunk;		/* MoE / lm_head chunk rows; 0 = MLENS_PERF_CHUNK */
	/* Extra H2D bytes per token per layer on the link (several GPUs:
	 * collective traffic that shares PCIe with the weight stream); 0 for
	 * one GPU. Counted in the PCIe and CPU-memory tiers and in n_eq. */
	double h2d_per_token;
	/* GPU activation bytes of a step of n tokens as the executor
	 * allocates them (the hybrid pipeline's memory plan: gpu_plan.h, with
	 * its token groups), so that n_act is the cap the executor can run;
	 * NULL: mlens_gpu_plan_act_estimate, the model's own two-group estimate. */
	uint64_t (*act_bytes)(const struct mlens_perf_model *pm, int64_t n, int64_t chunk,
			      const void *arg);
	const void *act_arg;
	/* The backend computes in host memory (the CPU backend): no bus, no
	 * weight stream, and its compute tier is the CPU (mlens_perf_tier_name). */
	bool host_compute;
	/* The executor's largest step, tokens; > 0: n_act is at most this
	 * (where host memory is the activation budget, nothing else bounds a
	 * step); 0: no bound. */
	double max_step;
};

/* Lines from the roofline when the profiler has not run: intercept = the
 * GPU-resident weights of GA (GB) read once from HBM, slope = FLOPs per
 * token / c_gpu. An upper bound of max(flops, bytes) time; a measured fit
 * replaces it. */
void mlens_perf_hw_roofline_lines(struct mlens_perf_hw *hw, const struct mlens_perf_model *pm);

/* eq. 2 simple form: (C_GPU / B_IO) x (E / k) x (weight bytes / 2). */
double mlens_perf_n_simple(const struct mlens_perf_model *pm, double c_gpu, double b_io);
/* eq. 1-2 with attention counted: C_GPU x streamed / (B_IO x (GA+GB FLOPs)). */
double mlens_perf_n_roofline(const struct mlens_perf_model *pm, double c_gpu, double b_io,
			     uint64_t streamed_bytes);
/* From the fitted lines: 2a + b n = (streamed + n h2d_per_token) / B_IO.
 * INFINITY when nothing is streamed or the GPU time does not grow with n
 * faster than the transfer (slope 0); 0 when the transfer hides behind any
 * step; NAN without a B_IO. */
double mlens_perf_n_fit(const struct mlens_perf_hw *hw, uint64_t streamed_bytes);

/* eq. 3 and 4. */
double mlens_perf_pme(double p, double g);
double mlens_perf_tmax(double pme, double kv_tokens, double delta, double t_gpu);

struct mlens_perf_workload {
	double p, g;		/* prompt and generation length */
	double kv_tokens;	/* M: KV capacity in tokens */
	int64_t min_tokens;	/* smallest step the daemon must run; 0 = p */
};

/* One step's shape. */
struct mlens_perf_step {
	double tokens;		/* n */
	double decode;		/* d: decode tokens */
	double context;		/* KV rows read by the decode tokens, summed */
	double prefill_pairs;	/* (query, key) pairs of prefill attention */
};

/* The steady-state step of n tokens for workload w (see the design note). */
struct mlens_perf_step mlens_perf_steady_step(const struct mlens_perf_workload *w, double n);

struct mlens_perf_policy {
	int resident_experts;	/* per layer, whole experts */
	double alpha_decode;	/* fraction of the step's decode tokens in group α */
	double alpha_prefill;	/* fraction of its prefill tokens in group α */
};

enum mlens_perf_bind {
	MLENS_PERF_BIND_PCIE = 0,	/* H2D: weight stream + activations */
	MLENS_PERF_BIND_D2H,
	MLENS_PERF_BIND_CPU_MEM,	/* KV reads + DMA on CPU memory */
	MLENS_PERF_BIND_GPU,
	MLENS_PERF_BIND_CPU_ATTN,
	MLENS_PERF_BIND_CHAIN,		/* a group's GPU work + its attention */
	MLENS_PERF_BIND_DISK,		/* experts left in the model files, read each step */
	MLENS_PERF_BIND_N
};
const char *mlens_perf_bind_name(enum mlens_perf_bind b);
/* The name of tier b on this hardware: as mlens_perf_bind_name, but on a
 * host-compute backend the compute tier is "cpu" and the chain
 * "cpu-chain". */
const char *mlens_perf_tier_name(const struct mlens_perf_hw *hw, enum mlens_perf_bind b);

struct mlens_perf_step_time {
	double tier[MLENS_PERF_BIND_N];	/* seconds per layer each resource needs */
	double group_gpu[MLENS_PERF_GROUPS], group_cpu[MLENS_PERF_GROUPS];
	double period;		/* seconds per layer: max of tier */
	double fill;		/* fill and drain, seconds per step */
	double seconds;		/* the step: layers x period + fill */
	enum mlens_perf_bind bind;
};

/* Step time for a step with the policy's residency and split. -EINVAL for
 * ceilings that are not positive or a policy out of range. */
int mlens_perf_step_time(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			 const struct mlens_perf_policy *pol, const struct mlens_perf_step *st,
			 struct mlens_perf_step_time *out);
/* The same, with the split (alpha_*) searched on a grid; pol's split is
 * replaced by the best one. */
int mlens_perf_step_time_best(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			      struct mlens_perf_policy *pol, const struct mlens_perf_step *st,
			      struct mlens_perf_step_time *out);

/* What set the step's token count. */
enum mlens_perf_limit {
	MLENS_PERF_LIMIT_KV = 0,	/* PME x M: KV capacity */
	MLENS_PERF_LIMIT_NREAL,		/* eq. 2: GPU time = transfer time */
	MLENS_PERF_LIMIT_ACT,		/* activation memory on the GPU */
	MLENS_PERF_LIMIT_STEP,		/* the executor's largest step (hw max_step) */
};
const char *mlens_perf_limit_name(enum mlens_perf_limit l);

struct mlens_perf_prediction {
	struct mlens_perf_policy policy;
	double pme;
	double n_eq;		/* eq. 2 from the fitted lines */
	double n_act;		/* most tokens whose activations fit */
	double n_real;		/* the scheduler's cap */
	enum mlens_perf_limit n_real_by;	/* what bounds n_real: NREAL, ACT or STEP */
	double n_kv;		/* PME x M */
	double tokens;		/* per step: min(n_kv, n_real) */
	enum mlens_perf_limit limit;
	struct mlens_perf_step step;
	struct mlens_perf_step_time time;
	double steps_per_s, total_tok_s, gen_tok_s;
	double delta;		/* s to stream one step's weights */
	double t_gpu;		/* tokens/s of the GPU alone at n_real */
	double t_max;		/* eq. 4 */
	uint64_t gpu_resident, gpu_slots, gpu_act, gpu_total;	/* bytes */
};

/* Predict for a fixed residency (split searched). -ENOSPC with a message
 * when the budget cannot hold it with min_tokens of activations. */
int mlens_perf_predict(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
		       const struct mlens_perf_workload *w, int resident_experts,
		       struct mlens_perf_prediction *out, char *err, size_t errlen);
/* Search residency and split for the highest throughput. -ENOSPC and a
 * plain message naming the minimum budget when nothing fits. */
int mlens_perf_choose(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
		      const struct mlens_perf_workload *w, struct mlens_perf_prediction *out,
		      char *err, size_t errlen);
/* ... over residencies of at most max_r experts a layer (< 0: any; the
 * config's resident_experts). */
int mlens_perf_choose_upto(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			   const struct mlens_perf_workload *w, int max_r,
			   struct mlens_perf_prediction *out, char *err, size_t errlen);
/* The smallest GPU budget that runs at all, the GPU memory plan's
 * (mlens_gpu_plan_minimum): resident attention, norms, routers,
 * embeddings, lm_head + two slots of one layer's experts + activations for
 * n_min tokens (hw's act_bytes) + workspace (for a model of one layer, the
 * whole model resident when that is less than two slots). */
uint64_t mlens_perf_min_budget(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			       int64_t n_min);
/* Tokens per step for mlens_sched_set_token_cap: floor(n_real), at least 1. */
int mlens_perf_token_cap(const struct mlens_perf_prediction *pred);

/* ==== the daemon's reachable steady state and the hardware bound ====
 *
 * Exact per-request accounting of the scheduler (daemon/serve/sched.c): a request
 * of p prompt tokens and g generated ones is admitted whole in one step
 * (its p prompt tokens, which also sample its first token), then decodes
 * g - 1 steps of one token; it lives g steps and its KV holds p + a tokens
 * at age a = 0..g-1, in blocks of B tokens reserved as it grows. With k
 * requests admitted per step on average:
 *   sequences alive S = k g, decode tokens per step D = k (g - 1),
 *   step tokens n = k (p + g - 1), generated per step k g = S,
 *   KV rows read by the decode tokens k (g - 1) (p + g/2).
 * KV capacity: a sequence holds on average m = (1/g) sum_{a=0}^{g-1}
 * ceil((p + a)/B) blocks, so a pool of K blocks holds S_kv = K / m at once
 * (for g >> 1 and B = 1, M / (p + g/2): DESIGN §1's averaged occupancy).
 * Token cap N (whole prompts, decodes first): step t admits
 * a_t = floor((N - D_t)/p) prompts, D_t = a_{t-1} + ... + a_{t-g+1};
 * k_cap is the mean of a_t once the recurrence has settled, found by
 * running it (g <= MLENS_PERF_SIM_MAX_GEN; beyond, its fixed point
 * D* = max((g - 1) m0, N - (m0 + 1) p), m0 = floor(N / (p + g - 1)),
 * k_cap = D* / (g - 1), exact unless admissions alternate). Mostly
 * a_t = m0 every step: n = m0 (p + g - 1), up to p + g - 2 below N; for
 * N just above m0 (p + g - 1) + p it alternates (p 7, g 6, N 45: 3, 3,
 * 3, 4, 4, 4, k = 3.5). With at most S_max sequences in flight (KV
 * capacity, the clients' concurrency), k = min(k_cap, S_max / g). */
#define MLENS_PERF_SIM_MAX_GEN 65536
struct mlens_perf_sched_state {
	double prompts;		/* k: requests admitted (and finished) per step */
	double seqs;		/* S = k g alive */
	double decode;		/* D = k (g - 1) decode tokens per step */
	double tokens;		/* n = k (p + g - 1) per step */
	double generated;	/* k g generated per step */
	double context;		/* KV rows the decode tokens read per step and layer */
	bool cap_binds;		/* the token cap, not S_max, set k */
};

/* Mean KV blocks a sequence holds over its life (formula above); block_tokens
 * < 1 counts tokens (B = 1). NAN for p < 1 or g < 1. */
double mlens_perf_seq_blocks(double p, double g, int block_tokens);
/* The steady state above for cap N >= p and S_max > 0 (lengths and cap are
 * whole tokens: fractions are dropped); -EINVAL otherwise, -ENOMEM. */
int mlens_perf_sched_steady(double p, double g, double cap, double max_seqs,
			    struct mlens_perf_sched_state *out);

/* The hybrid pipeline's bound from ceilings measured in the same run, the step's tokens
 * set by KV capacity alone (no token cap): k = S_kv / g, the accounting above,
 *   W   streamed weight bytes per step (the whole model's non-resident experts)
 *   KV  = context x kv_token_bytes x layers, bytes read by CPU attention
 *   F   = n x layers x (GA + GB FLOPs) + layers x 4 heads*hd x prefill
 *         (query, key) pairs (k p (p+1)/2, causal) + 2 H V x k g sampled rows
 *   F_e = n x layers x flops_experts, the routed experts' share of F
 *   t_gemm = (F - F_e) / C_gemm + F_e / C_expert  (mlens_perf_gemm_seconds)
 *   t_step = max(W / B_pcie, (KV + W) / B_mem, t_gemm)
 * B_mem the CPU memory bandwidth measured while a pinned copy runs (KV
 * reads and the weight DMA share it); C_expert the experts' GEMM rate
 * (fp8 experts: the fp8 GEMM's), C_gemm when <= 0. Tokens/s: generated
 * k g / t_step, total k (p + g) / t_step (the clients' count: each
 * request's p + g). A ceiling <= 0 leaves its term out. With experts
 * left on disk, mlens_perf_bound_add_disk adds the fourth term
 * t_disk = D / B_disk (D the bytes a step reads from the model files). */
struct mlens_perf_bound {
	struct mlens_perf_sched_state st;
	double streamed, kv_bytes, flops;	/* per step */
	double expert_flops;	/* of flops, the routed experts' (F_e) */
	double disk_bytes;	/* read from the model files (0: none on disk) */
	double t_pcie, t_mem, t_gemm, t_disk, t_step;	/* seconds */
	double gen_tok_s, total_tok_s;
	const char *binds;	/* "pcie-h2d", "cpu-memory", "gpu-gemm", "disk" */
};

/* Seconds of flops GEMM FLOPs of which expert_flops are the routed
 * experts': those at c_expert FLOP/s, the rest at c_gemm (c_expert <= 0:
 * all at c_gemm). 0 without a positive c_gemm. */
double mlens_perf_gemm_seconds(double flops, double expert_flops, double c_gemm, double c_expert);

/* -EINVAL for a workload out of range, S_kv <= 0 or no positive ceiling. */
int mlens_perf_bound(const struct mlens_perf_model *pm, double p, double g, double kv_seqs,
		     double streamed_bytes, double b_pcie, double b_mem, double c_gemm,
		     double c_expert, struct mlens_perf_bound *out);

/* ==== a mix of lengths ====
 *
 * The same accounting for requests of different lengths: request i of the
 * mix (p_i prompt, g_i generated tokens) lives g_i steps and holds
 * ceil((p_i + a)/B) blocks at age a. With k requests admitted per step,
 * drawn from the mix, the expected KV blocks held at a step are
 * k E[sum_{a<g} ceil((p+a)/B)] and the sequences alive k E[g], so a
 * sequence holds on average
 *   m = E[sum_{a<g} ceil((p+a)/B)] / E[g]
 * blocks: each request's mean occupancy weighted by the steps it lives
 * (a long generation counts for more of the pool's time than a short one).
 * A pool of K blocks holds S_kv = K / m; k = S_kv / E[g]; per step
 *   decode D = k E[g - 1], tokens n = k E[p + g - 1], generated k E[g],
 *   KV rows read k E[(g - 1)(p + g/2)], prefill pairs k E[p(p+1)/2];
 * the bound's times as mlens_perf_bound's, total tokens/s k E[p + g].
 * One (p, g) is a mix of one, and gives mlens_perf_bound's numbers. */
struct mlens_perf_mix {
	double requests;	/* how many the sums below are over */
	double prompt;		/* E[p] */
	double gen;		/* E[g] */
	double block_steps;	/* E[sum_{a<g} ceil((p+a)/B)] */
	double token_steps;	/* E[sum_{a<g} (p+a)]: the same in tokens */
	double context;		/* E[(g - 1)(p + g/2)]: KV rows read by its decodes, a layer */
	double prefill_pairs;	/* E[p(p+1)/2]: causal (query, key) pairs of its prefill */
	int block_tokens;	/* B the blocks are counted in (1 for tokens) */
};

/* The moments of n (p[i], g[i]) pairs at blocks of block_tokens (< 1:
 * tokens). -EINVAL for n < 1 or a length below 1 (or not finite). */
int mlens_perf_mix_of(const double *p, const double *g, size_t n, int block_tokens,
		      struct mlens_perf_mix *out);
/* m above: mean KV blocks a sequence of the mix holds over the steps it
 * lives (mlens_perf_seq_blocks for a mix of one). */
double mlens_perf_mix_seq_blocks(const struct mlens_perf_mix *mix);
/* mlens_perf_bound for a mix, S_kv = kv_blocks / m. -EINVAL as there. */
int mlens_perf_bound_mix(const struct mlens_perf_model *pm, const struct mlens_perf_mix *mix,
			 double kv_blocks, double streamed_bytes, double b_pcie, double b_mem,
			 double c_gemm, double c_expert, struct mlens_perf_bound *out);

/* The disk term of a bound made above: disk_bytes read from the model
 * files a step at b_disk bytes/s; the step takes at least t_disk, and the
 * tokens/s follow when it binds ("disk"). The step's batch stays the
 * pool's (the disk's reads are the same for any batch that routes to
 * every disk expert). -EINVAL for disk_bytes < 0, b_disk <= 0 or a bound
 * without a step. */
int mlens_perf_bound_add_disk(struct mlens_perf_bound *b, double disk_bytes, double b_disk);

/* ==== several GPUs in one box ====
 *
 * G GPUs work on the same step: attention split by heads, experts by
 * intermediate rows (TP) or whole experts (EP), as daemon/plan/shard.h plans.
 * Each GPU has its own budget (gpu_budget is per GPU) and its own PCIe
 * link (b_io, b_d2h per link); the host's memory bandwidth (b_mem) and
 * CPU attention (b_attn) are shared by all. The model of one GPU applies
 * to the busiest GPU's shard (rank 0: most heads, rows, experts, vocab):
 *   shard model   heads/G, its kv heads, inter_0 (TP) or E_0 experts (EP),
 *                 vocab_0 rows of embeddings and lm_head; router and norms
 *                 whole (replicated); KV bytes per token 1/G of the whole
 *                 (CPU attention is not replicated); EP: experts FLOPs
 *                 k x (E_0/E) x imbalance x 6 H I per token (the busiest
 *                 GPU's share of the routed rows).
 *   host tiers    b_mem / G and b_attn / G against the shard's 1/G of the
 *                 KV reads: (KV + G x DMA per link) / b_mem and KV / b_attn,
 *                 the same host work as with one GPU plus G links of DMA.
 *   GPU lines     the given lines (one GPU, whole layer) times the roofline
 *                 ratio shard / whole, intercepts by weight bytes, slopes by
 *                 FLOPs (with roofline lines: the shard's roofline), then
 *                 collectives added to GB per token group x of n_x tokens:
 *                 a += steps x lat_coll, b += coll bytes per token / b_coll
 *                 (shard.h's volumes are linear in n), so n_real, the tiers
 *                 and the policy search of one GPU apply unchanged.
 *   PCIe peers    coll_on_pcie: collectives have no NVLink and share each
 *                 GPU's link: their bytes per token go to h2d_per_token.
 * Residency r counts the shard's expert units per layer (TP: slices of all
 * E experts, EP: its E_0 whole experts); with the same per-GPU budget a
 * slice is 1/G of an expert, so G GPUs keep up to G times as many experts
 * resident in total and each streams (E - r) slices over its own link:
 * the super-linear scaling MoE-Lightning reports, until the shared host
 * (KV capacity, b_mem, b_attn) or the collectives bind. The once-a-step
 * embedding all-reduce and logits all-gather are left out (they carry
 * less than 1/(2L) of the layers' collective bytes). */
struct mlens_perf_multi {
	int gpus;
	int scheme;		/* enum mlens_shard_scheme: 0 TP, 1 EP */
	double b_coll;		/* bytes/s one GPU sends into a collective (NVLink, PCIe P2P) */
	double lat_coll;	/* seconds per ring step / all-to-all peer */
	int64_t coll_bytes;	/* bytes per activation element on the wire; 0 = 2 (bf16) */
	double ep_imbalance;	/* busiest GPU's routed rows / the mean, >= 1; 0 = 1 */
	bool coll_on_pcie;	/* collectives share the PCIe links (no NVLink) */
};

/* The busiest GPU's shard as a model of one GPU, and the hardware it sees
 * (formulas above). -EINVAL with a message for a split the plan refuses
 * or parameters out of range. */
int mlens_perf_multi_setup(const struct mlens_model_config *c, enum mlens_dtype kv_dtype,
			   const struct mlens_perf_hw *hw, const struct mlens_perf_multi *mp,
			   struct mlens_perf_model *shard, struct mlens_perf_hw *shard_hw,
			   char *err, size_t errlen);
/* Residency and split searched for G GPUs of one scheme: the prediction of
 * mlens_perf_choose on the shard (its throughput is the box's: every GPU
 * works on every step). Errors as mlens_perf_multi_setup and _choose. */
int mlens_perf_multi_choose(const struct mlens_model_config *c, enum mlens_dtype kv_dtype,
			    const struct mlens_perf_hw *hw, const struct mlens_perf_workload *w,
			    const struct mlens_perf_multi *mp, struct mlens_perf_prediction *out,
			    char *err, size_t errlen);
/* TP or EP, whichever predicts more tokens/s (TP on a tie: it has no
 * routing skew to fear); mp->scheme is ignored and *scheme set. A scheme
 * the plan refuses is skipped; -EINVAL/-ENOSPC when neither runs. */
int mlens_perf_multi_best(const struct mlens_model_config *c, enum mlens_dtype kv_dtype,
			  const struct mlens_perf_hw *hw, const struct mlens_perf_workload *w,
			  const struct mlens_perf_multi *mp, struct mlens_perf_prediction *out,
			  int *scheme, char *err, size_t errlen);

#endif
