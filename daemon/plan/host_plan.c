/* The host memory plan's arithmetic (host_plan.h), saturating where a
 * sum could pass 64 bits. */
#include <errno.h>
#include <stdio.h>
#include "daemon/errf.h"
#include "daemon/plan/host_plan.h"

static uint64_t add_sat(uint64_t a, uint64_t b)
{
	return a + b < a ? UINT64_MAX : a + b;
}

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
	uint64_t r;
	return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

int mlens_host_plan_split(struct mlens_host_plan *p, const struct mlens_host_plan_in *in, char *err,
			  size_t errlen)
{
	uint64_t fixed = add_sat(add_sat(in->weight_bytes, in->staging), in->disk_staging);

	p->budget = in->budget;
	p->weights = in->weight_bytes;
	p->staging = in->staging;
	p->disk = in->disk;
	p->disk_staging = in->disk_staging;
	p->kv_min = in->kv_min;
	p->need = add_sat(fixed, in->kv_min);
	p->kv = in->kv_want;
	if (!in->budget)
		return 0;
	p->kv = in->budget > fixed ? in->budget - fixed : 0;
	if (p->kv > in->kv_want)
		p->kv = in->kv_want;
	if (in->budget >= p->need && in->kv_want >= in->kv_min)
		return 0;
	if (in->kv_want < in->kv_min)
		mlens_errf(err, errlen,
			   "kv_cache of %.1f MiB is below the least KV pool that runs (%.1f MiB: one sequence as long as "
			   "the longest prompt taken); raise kv_cache",
			   in->kv_want / 1048576.0, in->kv_min / 1048576.0);
	else
		mlens_errf(err, errlen,
			   "host_memory of %.1f MiB cannot run this model: weight pages %.1f MiB + %sstaging %.1f MiB + "
			   "the least KV pool %.1f MiB (one sequence as long as the longest prompt taken) need %.1f MiB; "
			   "raise host_memory to at least that, or lower max_step_tokens",
			   in->budget / 1048576.0, (in->weight_bytes + in->disk_staging) / 1048576.0,
			   in->disk_staging ? "disk " : "", in->staging / 1048576.0,
			   in->kv_min / 1048576.0, p->need / 1048576.0);
	return -ENOSPC;
}

void mlens_host_plan_format(const struct mlens_host_plan *p, char *out, size_t n)
{
	uint64_t total = add_sat(add_sat(add_sat(p->weights, p->staging), p->kv), p->disk_staging);
	double base = p->budget ? (double)p->budget : (double)total;
	char disk[160] = "";

	if (base <= 0)
		base = 1;
	if (p->disk)
		snprintf(disk, sizeof(disk), ", disk staging %.1f MiB (%.0f%%); weights on disk %.1f MiB",
			 p->disk_staging / 1048576.0, 100.0 * (double)p->disk_staging / base, p->disk / 1048576.0);
	snprintf(out, n,
		 "host memory %s%.1f MiB: weight pages %.1f MiB (%.0f%%), KV pool %.1f MiB (%.0f%%), "
		 "staging %.1f MiB (%.0f%%)%s%s",
		 p->budget ? "budget " : "(no host_memory budget) ", (p->budget ? p->budget : total) / 1048576.0,
		 p->weights / 1048576.0, 100.0 * (double)p->weights / base, p->kv / 1048576.0,
		 100.0 * (double)p->kv / base, p->staging / 1048576.0, 100.0 * (double)p->staging / base,
		 disk, p->budget && total < p->budget ? ", the rest unused (kv_cache caps the KV pool)" : "");
}

uint64_t mlens_host_plan_staging(const struct mlens_model_config *c, bool hybrid, bool host_compute,
				 int64_t step_tokens, int64_t group_tokens, int sets)
{
	uint64_t qkv = (uint64_t)(c->num_attention_heads + 2 * c->num_key_value_heads) * (uint64_t)c->head_dim;
	uint64_t att = (uint64_t)c->num_attention_heads * (uint64_t)c->head_dim;

	if (hybrid)
		return mul_sat(mul_sat((uint64_t)(sets > 0 ? sets : 0), (uint64_t)(group_tokens > 0 ? group_tokens : 0)),
			       mul_sat(qkv + att, sizeof(float)));
	if (host_compute) {
		/* residual and norm, q k v, attention output, an expert's
		 * gate, up and down rows for each of its top-k */
		uint64_t row = 2 * (uint64_t)c->hidden_size + qkv + att +
			       3 * (uint64_t)c->num_experts_per_tok * (uint64_t)c->intermediate_size;
		return mul_sat(mul_sat((uint64_t)(step_tokens > 0 ? step_tokens : 0), row), sizeof(float));
	}
	return 0;
}

uint64_t mlens_host_plan_kv_min(const struct mlens_model_config *c, int64_t step_tokens, int block_size,
				uint64_t kv_block_bytes)
{
	int64_t len = step_tokens < c->max_position_embeddings ? step_tokens : c->max_position_embeddings;
	uint64_t blocks;

	if (len <= 0 || block_size <= 0)
		return 0;
	blocks = (uint64_t)((len + block_size - 1) / block_size);
	return mul_sat(blocks, kv_block_bytes);
}
