/* Partitioning of a Mixtral layer over G GPUs of one box: which
 * heads, expert rows and experts each GPU owns, what it streams over its own
 * PCIe link per layer, and how many bytes the collectives move per layer.
 * Pure arithmetic; daemon/tools/shard_sim.h runs the sharded math on the CPU and
 * daemon/plan/perfmodel.h turns these counts into time.
 *
 * Design note: the two schemes and their formulas.
 *
 * Attention is tensor parallel in both schemes (Megatron-style, split by
 * heads). GPU r holds q heads [q_head0, q_head0 + heads/G) (so heads % G
 * must be 0) and the K/V heads those query heads read:
 *   n_kv % G == 0:  n_kv/G kv heads each, a split like the query heads;
 *   G % n_kv == 0:  one kv head each, replicated on G/n_kv GPUs: GPU r
 *                   holds kv head r / (G/n_kv), which every one of its
 *                   query heads reads (GQA group heads/n_kv is a multiple
 *                   of heads/G);
 *   otherwise:      refused (a GPU's query heads would need a fraction of
 *                   a kv head).
 * wq, wk, wv rows and wo columns of those heads; the O projection gives a
 * partial sum on every GPU, which a collective adds up.
 *
 * Experts:
 *   TP (column split): every GPU holds rows [inter0, inter0 + inter_r) of
 *     w1 and w3 of every expert and the same columns of w2; silu(w1 x)*w3 x
 *     is elementwise in the intermediate dimension, so the partial down
 *     projections add up to the expert's output exactly. inter_r is the
 *     balanced split (the first I % G GPUs get one row more).
 *   EP (expert parallel): GPU r owns whole experts [expert0, expert0 +
 *     experts_r), a balanced contiguous split (the first E % G GPUs own one
 *     more: E % G != 0 is handled, the busiest GPU owns ceil(E/G)); G > E is
 *     refused (a GPU would own nothing).
 *
 * Streamed bytes per layer over GPU r's own link, with res experts (TP: expert
 * slices) resident on it, w = weight element bytes:
 *   TP:  (E - res) x 3 H inter_r x w
 *   EP:  (experts_r - res) x 3 H I x w
 * Attention bytes resident on GPU r: 2 H (q_heads + kv_heads_r) hd x w.
 *
 * Collectives per layer for a step of n tokens, bytes ONE GPU sends, a =
 * bytes per activation element on the wire, X = n H a (the residual stream):
 *   ring all-reduce           2 (G-1)/G X
 *   reduce-scatter, all-gather  (G-1)/G X each
 *   TP:  all-reduce after the O projection + all-reduce after the MoE:
 *        4 (G-1)/G X.
 *   EP:  reduce-scatter after the O projection (each GPU keeps n_r = n/G
 *        tokens, its balanced share within one row), router on its own
 *        tokens, all-to-all dispatch of each token row to every other GPU
 *        owning at least one of its top-k experts, experts, all-to-all
 *        combine back (same rows),
 *        all-gather of the residual stream for the next layer's attention:
 *        2 (G-1)/G X + n_r H a x sum over s != r of P_hit(s) (dispatch)
 *        + H a x sum over s != r of n_s P_hit(r) (combine),
 *        P_hit(s) = 1 - C(E - E_s, k) / C(E, k), the chance that a token's k
 *        distinct experts (uniform routing) include one of GPU s's E_s.
 *        Expected rows; a real router is skewed, which the perf model's
 *        imbalance factor covers.
 * A real ring also has 2(G-1) (all-reduce) or G-1 (the others) latency
 * steps; perfmodel.h adds them. */
#ifndef MLENS_SHARD_H
#define MLENS_SHARD_H

#include <stddef.h>
#include <stdint.h>
#include "daemon/model/model.h"

#define MLENS_SHARD_MAX_GPUS 64

enum mlens_shard_scheme {
	MLENS_SHARD_TP = 0,	/* experts split by intermediate rows/columns */
	MLENS_SHARD_EP = 1,	/* whole experts split across GPUs */
};

const char *mlens_shard_scheme_name(enum mlens_shard_scheme s);

/* What one GPU (rank) owns. Ranges are [start, start + count). */
struct mlens_shard_rank {
	int q_head0, q_heads;
	int kv_head0, kv_heads;
	int inter0, inter;	/* TP: rows of w1/w3, columns of w2; EP: 0, I */
	int expert0, experts;	/* EP: owned experts; TP: 0, E (slices of all) */
	int vocab0, vocab;	/* lm_head rows (vocab parallel) */
};

struct mlens_shard_plan {
	int gpus;
	enum mlens_shard_scheme scheme;
	int kv_replicas;	/* GPUs holding each kv head: 1, or G / n_kv */
	int hidden, heads, kv_heads, head_dim, inter, experts, top_k, vocab;
	struct mlens_shard_rank rank[MLENS_SHARD_MAX_GPUS];
};

/* Balanced split of n items over g parts: part i gets n/g, plus one for
 * the first n % g parts; returns its count and sets *start. */
int mlens_shard_split(int n, int g, int i, int *start);

/* Plan the split of model c over gpus GPUs. -EINVAL with a message naming
 * the dimension and what to do: gpus outside 1..MLENS_SHARD_MAX_GPUS,
 * heads % gpus != 0, kv heads neither divisible by nor dividing gpus, EP
 * with more GPUs than experts, or a model dimension that is not positive. */
int mlens_shard_plan(struct mlens_shard_plan *p, const struct mlens_model_config *c, int gpus,
		     enum mlens_shard_scheme scheme, char *err, size_t errlen);

/* The rank that computes expert e (EP: its owner; TP: -1, every rank). */
int mlens_shard_expert_owner(const struct mlens_shard_plan *p, int e);

/* Per layer, bytes of the attention weights (q, k, v, o) on rank r. */
uint64_t mlens_shard_attn_bytes(const struct mlens_shard_plan *p, int r, int wbytes);
/* Per layer, bytes of one expert's shard on rank r (TP: one slice, EP: one
 * whole expert), and how many such units rank r holds (TP: E, EP: owned). */
uint64_t mlens_shard_expert_unit_bytes(const struct mlens_shard_plan *p, int r, int wbytes);
int mlens_shard_expert_units(const struct mlens_shard_plan *p, int r);
/* Per layer, bytes rank r streams over its link with res units resident
 * (clamped to 0..units). */
uint64_t mlens_shard_stream_bytes(const struct mlens_shard_plan *p, int r, int wbytes, int res);

/* P_hit: chance that k distinct experts drawn uniformly from E include at
 * least one of a set of es experts: 1 - C(E-es, k)/C(E, k). */
double mlens_shard_p_hit(int E, int k, int es);
/* EP: expected expert rows (token x expert pairs) rank r computes for n
 * tokens: n k E_r / E. TP: n k (every rank, its slices). */
double mlens_shard_routed_rows(const struct mlens_shard_plan *p, int r, double n);
/* Actual rows per rank for a routing ids[n][k]: rows[r] for each rank. */
void mlens_shard_count_rows(const struct mlens_shard_plan *p, const int32_t *ids, int n,
			    int64_t *rows);

/* Collective bytes one rank sends per layer (formulas above). */
struct mlens_shard_coll {
	double all_reduce;	/* TP: both all-reduces; EP: 0 */
	double reduce_scatter;	/* EP */
	double all_gather;	/* EP */
	double dispatch;	/* EP: all-to-all, token rows out */
	double combine;		/* EP: all-to-all, expert outputs back */
	double total;
	int steps;		/* latency steps (ring hops, all-to-all peers) */
};

/* For the rank that sends the most (the maximum over ranks of total) in a
 * step of n tokens with abytes bytes per element on the wire. EP: rank r
 * dispatches n_r H a sum_{s!=r} P_hit(E_s) and combines (sends back)
 * sum_{s!=r} n_s H a P_hit(E_r), n_r = n/G its share of the tokens. */
void mlens_shard_layer_coll(const struct mlens_shard_plan *p, double n, int abytes,
			    struct mlens_shard_coll *out);

#endif
