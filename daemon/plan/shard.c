/* The partitioning arithmetic of daemon/plan/shard.h: the plan of a model over
 * G GPUs, resident and streamed bytes per GPU, routed rows and collective
 * volumes. Formulas are in the design note of shard.h. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include "daemon/errf.h"
#include "daemon/plan/shard.h"

const char *mlens_shard_scheme_name(enum mlens_shard_scheme s)
{
	return s == MLENS_SHARD_EP ? "expert-parallel" : "tensor-parallel";
}

int mlens_shard_split(int n, int g, int i, int *start)
{
	int base = n / g, extra = n % g;
	*start = i * base + (i < extra ? i : extra);
	return base + (i < extra);
}

static bool fits_int(int64_t v)
{
	return v > 0 && v <= INT32_MAX;
}

int mlens_shard_plan(struct mlens_shard_plan *p, const struct mlens_model_config *c, int gpus,
		     enum mlens_shard_scheme scheme, char *err, size_t errlen)
{
	memset(p, 0, sizeof(*p));
	if (gpus < 1 || gpus > MLENS_SHARD_MAX_GPUS) {
		mlens_errf(err, errlen, "gpus: %d GPUs asked; list between 1 and %d", gpus,
		       MLENS_SHARD_MAX_GPUS);
		return -EINVAL;
	}
	if (!fits_int(c->hidden_size) || !fits_int(c->num_attention_heads) ||
	    !fits_int(c->num_key_value_heads) || !fits_int(c->head_dim) ||
	    !fits_int(c->intermediate_size) || !fits_int(c->num_local_experts) ||
	    !fits_int(c->num_experts_per_tok) || !fits_int(c->vocab_size) ||
	    c->num_experts_per_tok > c->num_local_experts ||
	    c->num_attention_heads % c->num_key_value_heads) {
		mlens_errf(err, errlen, "model: a dimension is not positive or heads/kv heads/experts do not agree");
		return -EINVAL;
	}
	p->gpus = gpus;
	p->scheme = scheme;
	p->hidden = (int)c->hidden_size;
	p->heads = (int)c->num_attention_heads;
	p->kv_heads = (int)c->num_key_value_heads;
	p->head_dim = (int)c->head_dim;
	p->inter = (int)c->intermediate_size;
	p->experts = (int)c->num_local_experts;
	p->top_k = (int)c->num_experts_per_tok;
	p->vocab = (int)c->vocab_size;
	if (p->heads % gpus) {
		mlens_errf(err, errlen,
		       "gpus: the model has %d attention heads, which %d GPUs cannot share evenly "
		       "(tensor-parallel attention splits by heads); list a number of GPUs that divides %d",
		       p->heads, gpus, p->heads);
		return -EINVAL;
	}
	if (p->kv_heads % gpus == 0) {
		p->kv_replicas = 1;
	} else if (gpus % p->kv_heads == 0) {
		p->kv_replicas = gpus / p->kv_heads;
	} else {
		mlens_errf(err, errlen,
		       "gpus: the model has %d key/value heads; %d GPUs must divide them or be a "
		       "multiple of them (then each kv head is replicated); list another number of GPUs",
		       p->kv_heads, gpus);
		return -EINVAL;
	}
	if (scheme == MLENS_SHARD_EP && gpus > p->experts) {
		mlens_errf(err, errlen,
		       "gpus: expert parallel over %d GPUs needs at least %d experts per layer, the "
		       "model has %d; use tensor parallel or fewer GPUs", gpus, gpus, p->experts);
		return -EINVAL;
	}
	for (int r = 0; r < gpus; r++) {
		struct mlens_shard_rank *k = &p->rank[r];
		k->q_heads = p->heads / gpus;
		k->q_head0 = r * k->q_heads;
		if (p->kv_replicas == 1) {
			k->kv_heads = p->kv_heads / gpus;
			k->kv_head0 = r * k->kv_heads;
		} else {
			k->kv_heads = 1;
			k->kv_head0 = r / p->kv_replicas;
		}
		if (scheme == MLENS_SHARD_TP) {
			k->inter = mlens_shard_split(p->inter, gpus, r, &k->inter0);
			k->experts = p->experts;
			k->expert0 = 0;
		} else {
			k->inter = p->inter;
			k->inter0 = 0;
			k->experts = mlens_shard_split(p->experts, gpus, r, &k->expert0);
		}
		k->vocab = mlens_shard_split(p->vocab, gpus, r, &k->vocab0);
	}
	return 0;
}

int mlens_shard_expert_owner(const struct mlens_shard_plan *p, int e)
{
	if (p->scheme != MLENS_SHARD_EP)
		return -1;
	for (int r = 0; r < p->gpus; r++)
		if (e >= p->rank[r].expert0 && e < p->rank[r].expert0 + p->rank[r].experts)
			return r;
	return -1;
}

uint64_t mlens_shard_attn_bytes(const struct mlens_shard_plan *p, int r, int wbytes)
{
	const struct mlens_shard_rank *k = &p->rank[r];
	return 2ull * (uint64_t)p->hidden * (uint64_t)(k->q_heads + k->kv_heads) *
	       (uint64_t)p->head_dim * (uint64_t)wbytes;
}

uint64_t mlens_shard_expert_unit_bytes(const struct mlens_shard_plan *p, int r, int wbytes)
{
	return 3ull * (uint64_t)p->hidden * (uint64_t)p->rank[r].inter * (uint64_t)wbytes;
}

int mlens_shard_expert_units(const struct mlens_shard_plan *p, int r)
{
	return p->rank[r].experts;
}

uint64_t mlens_shard_stream_bytes(const struct mlens_shard_plan *p, int r, int wbytes, int res)
{
	int units = mlens_shard_expert_units(p, r);
	res = res < 0 ? 0 : res > units ? units : res;
	return (uint64_t)(units - res) * mlens_shard_expert_unit_bytes(p, r, wbytes);
}

double mlens_shard_p_hit(int E, int k, int es)
{
	/* C(E-es, k)/C(E, k) = prod_{i<k} (E-es-i)/(E-i): all k miss the set */
	double miss = 1.0;
	if (es <= 0)
		return 0.0;
	for (int i = 0; i < k; i++)
		miss *= E - es - i > 0 ? (double)(E - es - i) / (double)(E - i) : 0.0;
	return 1.0 - miss;
}

double mlens_shard_routed_rows(const struct mlens_shard_plan *p, int r, double n)
{
	if (p->scheme != MLENS_SHARD_EP)
		return n * p->top_k;
	return n * p->top_k * (double)p->rank[r].experts / (double)p->experts;
}

void mlens_shard_count_rows(const struct mlens_shard_plan *p, const int32_t *ids, int n,
			    int64_t *rows)
{
	for (int r = 0; r < p->gpus; r++)
		rows[r] = p->scheme == MLENS_SHARD_EP ? 0 : (int64_t)n * p->top_k;
	if (p->scheme != MLENS_SHARD_EP)
		return;
	for (int i = 0; i < n * p->top_k; i++) {
		int o = mlens_shard_expert_owner(p, ids[i]);
		if (o >= 0)
			rows[o]++;
	}
}

void mlens_shard_layer_coll(const struct mlens_shard_plan *p, double n, int abytes,
			    struct mlens_shard_coll *out)
{
	int G = p->gpus;
	double X = n * p->hidden * abytes, row = (double)p->hidden * abytes;
	memset(out, 0, sizeof(*out));
	if (G == 1)
		return;
	if (p->scheme == MLENS_SHARD_TP) {
		out->all_reduce = 2 * (2.0 * (G - 1) / G * X);
		out->total = out->all_reduce;
		out->steps = 2 * 2 * (G - 1);
		return;
	}
	for (int r = 0; r < G; r++) {
		/* token shares differ by at most one row: n/G each */
		double nr = n / G, ns = n / G;
		double disp = 0, comb = 0, tot;
		for (int s = 0; s < G; s++) {
			if (s == r)
				continue;
			disp += nr * row * mlens_shard_p_hit(p->experts, p->top_k, p->rank[s].experts);
			comb += ns * row * mlens_shard_p_hit(p->experts, p->top_k, p->rank[r].experts);
		}
		tot = 2.0 * (G - 1) / G * X + disp + comb;
		if (tot > out->total) {
			out->reduce_scatter = out->all_gather = (G - 1.0) / G * X;
			out->dispatch = disp;
			out->combine = comb;
			out->total = tot;
		}
	}
	/* reduce-scatter, all-gather: G-1 ring steps each; two all-to-alls:
	 * G-1 peers each */
	out->steps = 4 * (G - 1);
}
