/* The performance model's arithmetic: accounting, the line fit, n_real,
 * the roofline step time, throughput and the policy search. Formulas and
 * their sources are in the design note at the top of perfmodel.h. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/errf.h"
#include "daemon/model/quant.h"
#include "daemon/plan/gpu_plan.h"
#include "daemon/plan/perfmodel.h"
#include "daemon/plan/shard.h"

/* ==== accounting ==== */

static bool mul_ok(uint64_t a, uint64_t b, uint64_t *out)
{
	return !__builtin_mul_overflow(a, b, out);
}

static bool add_ok(uint64_t a, uint64_t b, uint64_t *out)
{
	return !__builtin_add_overflow(a, b, out);
}

/* a*b*c with overflow check */
static bool mul3(uint64_t a, uint64_t b, uint64_t c, uint64_t *out)
{
	uint64_t t;
	return mul_ok(a, b, &t) && mul_ok(t, c, out);
}

static uint64_t sat_add(uint64_t a, uint64_t b)
{
	uint64_t r;
	return add_ok(a, b, &r) ? r : UINT64_MAX;
}

int mlens_perf_model_from_config(struct mlens_perf_model *pm, const struct mlens_model_config *c,
				 enum mlens_dtype kv_dtype)
{
	uint64_t H, I, L, E, V, qd, kvd, wb, t, u;
	memset(pm, 0, sizeof(*pm));
	if (c->hidden_size <= 0 || c->intermediate_size <= 0 || c->num_hidden_layers <= 0 ||
	    c->num_attention_heads <= 0 || c->num_key_value_heads <= 0 || c->head_dim <= 0 ||
	    c->num_local_experts <= 0 || c->num_experts_per_tok <= 0 || c->vocab_size <= 0 ||
	    c->num_experts_per_tok > c->num_local_experts || c->num_local_experts > INT_MAX)
		return -EINVAL;
	pm->hidden = c->hidden_size;
	pm->inter = c->intermediate_size;
	pm->layers = c->num_hidden_layers;
	pm->heads = c->num_attention_heads;
	pm->kv_heads = c->num_key_value_heads;
	pm->head_dim = c->head_dim;
	pm->experts = c->num_local_experts;
	pm->top_k = c->num_experts_per_tok;
	pm->vocab = c->vocab_size;
	pm->wbytes = (int64_t)mlens_dtype_size(c->dtype);
	pm->expert_fp8 = c->expert_dtype == MLENS_DTYPE_E4M3;
	pm->kvbytes = (int64_t)mlens_dtype_size(kv_dtype);
	pm->abytes = 4;	/* the engine keeps activations in f32 */
	pm->tied = c->tie_word_embeddings;

	H = (uint64_t)pm->hidden;
	I = (uint64_t)pm->inter;
	L = (uint64_t)pm->layers;
	E = (uint64_t)pm->experts;
	V = (uint64_t)pm->vocab;
	wb = (uint64_t)pm->wbytes;
	if (!mul_ok((uint64_t)pm->heads, (uint64_t)pm->head_dim, &qd) ||
	    !mul_ok((uint64_t)pm->kv_heads, (uint64_t)pm->head_dim, &kvd))
		return -EOVERFLOW;
	/* attention: q and o are H x qd, k and v are H x kvd */
	if (!add_ok(qd, kvd, &t) || !mul_ok(t, 2, &t) || !mul3(t, H, wb, &pm->attn_bytes))
		return -EOVERFLOW;
	if (!mul3(2, H, wb, &pm->norm_bytes) || !mul3(E, H, wb, &pm->router_bytes) ||
	    !mul3(3, H, I, &t) || !mul_ok(t, wb, &pm->expert_bytes) ||
	    /* fp8 experts: a byte an element and their scales */
	    !(pm->expert_bytes = mlens_model_expert_bytes(c)) ||
	    !mul_ok(pm->expert_bytes, E, &pm->layer_expert_bytes))
		return -EOVERFLOW;
	/* family extras: q/k norms, biases, the wider of a shared expert (and
	 * its gate) and a dense layer's MLP, all held with the attention */
	pm->mlp_inter = c->shared_inter > c->dense_inter ? c->shared_inter : c->dense_inter;
	u = (uint64_t)(c->qk_norm ? qd + kvd : 0) + (c->qkv_bias ? qd + 2 * kvd : 0) +
	    (c->o_bias ? H : 0) + (c->shared_gate ? H : 0);
	if (!mul3(3, H, (uint64_t)pm->mlp_inter, &t) || !add_ok(t, u, &t) ||
	    !mul_ok(t, wb, &pm->family_bytes))
		return -EOVERFLOW;
	if (!add_ok(pm->attn_bytes, pm->norm_bytes, &t) || !add_ok(t, pm->router_bytes, &t) ||
	    !add_ok(t, pm->family_bytes, &t) || !add_ok(t, pm->layer_expert_bytes, &pm->layer_bytes))
		return -EOVERFLOW;
	if (!mul3(V, H, wb, &pm->embed_bytes) || !mul_ok(H, wb, &pm->final_norm_bytes))
		return -EOVERFLOW;
	pm->lm_head_bytes = pm->tied ? 0 : pm->embed_bytes;
	if (!mul_ok(pm->layer_bytes, L, &t) || !add_ok(t, pm->embed_bytes, &t) ||
	    !add_ok(t, pm->lm_head_bytes, &t) || !add_ok(t, pm->final_norm_bytes, &pm->model_bytes))
		return -EOVERFLOW;
	if (!mul3(2, kvd, (uint64_t)pm->kvbytes, &pm->kv_token_bytes))
		return -EOVERFLOW;
	if (kv_dtype == MLENS_DTYPE_E4M3)	/* a scale a row of K and of V */
		pm->kv_token_bytes += 2 * (uint64_t)c->num_key_value_heads * sizeof(float);
	/* activations of one token, checked here so that act_bytes only
	 * saturates on absurd token counts */
	if (!mul3(2, qd + kvd, 4, &u) || !mul3(2, H + I, 4, &u))
		return -EOVERFLOW;
	pm->flops_ga = 2.0 * (double)H * (double)(qd + 2 * kvd);
	pm->flops_experts = (double)pm->top_k * 3.0 * 2.0 * (double)H * (double)I;
	pm->flops_gb = 2.0 * (double)qd * (double)H + 2.0 * (double)H * (double)E + pm->flops_experts +
		       3.0 * 2.0 * (double)H * (double)pm->mlp_inter;	/* shared expert */
	return 0;
}

double mlens_perf_kv_read_bytes(const struct mlens_perf_model *pm, double ctx)
{
	return ctx * (double)pm->kv_token_bytes;
}

/* ==== the line fit ==== */

int mlens_perf_fit_line(const double *x, const double *y, int n, struct mlens_perf_line *out)
{
	double mx = 0, my = 0, sxx = 0, sxy = 0, ssr = 0;
	if (n < 2)
		return -EINVAL;
	for (int i = 0; i < n; i++) {
		if (!isfinite(x[i]) || !isfinite(y[i]))
			return -EINVAL;
		mx += x[i];
		my += y[i];
	}
	mx /= n;
	my /= n;
	/* centred sums: no cancellation when x is large (token counts) */
	for (int i = 0; i < n; i++) {
		sxx += (x[i] - mx) * (x[i] - mx);
		sxy += (x[i] - mx) * (y[i] - my);
	}
	if (!(sxx > 0))
		return -EINVAL;
	memset(out, 0, sizeof(*out));
	out->n = n;
	out->b = sxy / sxx;
	out->a = my - out->b * mx;
	for (int i = 0; i < n; i++) {
		double r = y[i] - (out->a + out->b * x[i]);
		ssr += r * r;
	}
	if (n > 2) {
		out->se = sqrt(ssr / (n - 2));
		out->se_b = out->se / sqrt(sxx);
		out->se_a = out->se * sqrt(1.0 / n + mx * mx / sxx);
	}
	return 0;
}

double mlens_perf_line_at(const struct mlens_perf_line *l, double x)
{
	return l->a + l->b * x;
}

void mlens_perf_hw_roofline_lines(struct mlens_perf_hw *hw, const struct mlens_perf_model *pm)
{
	double qkv;
	double qd = (double)(pm->heads * pm->head_dim), kvd = (double)(pm->kv_heads * pm->head_dim);
	double H = (double)pm->hidden, wb = (double)pm->wbytes;
	/* without a rate the term is left out (and a zero slope makes the
	 * model refuse the hardware until one is given) */
	double hbm = hw->b_hbm > 0 ? hw->b_hbm : INFINITY, gemm = hw->c_gpu > 0 ? hw->c_gpu : INFINITY;
	/* GA reads q, k, v; GB reads o, the router and every expert (at the
	 * token counts the pipeline runs, every expert is routed to) */
	qkv = H * (qd + 2 * kvd) * wb;
	memset(&hw->ga, 0, sizeof(hw->ga));
	memset(&hw->gb, 0, sizeof(hw->gb));
	hw->ga.a = qkv / hbm;
	hw->ga.b = pm->flops_ga / gemm;
	hw->gb.a = (H * qd * wb + (double)pm->router_bytes + (double)pm->layer_expert_bytes) / hbm;
	hw->gb.b = pm->flops_gb / gemm;
}

/* ==== n_real (eq. 1-2) ==== */

double mlens_perf_n_simple(const struct mlens_perf_model *pm, double c_gpu, double b_io)
{
	return c_gpu / b_io * ((double)pm->experts / (double)pm->top_k) * ((double)pm->wbytes / 2.0);
}

double mlens_perf_n_roofline(const struct mlens_perf_model *pm, double c_gpu, double b_io,
			     uint64_t streamed_bytes)
{
	return c_gpu * (double)streamed_bytes / (b_io * (pm->flops_ga + pm->flops_gb));
}

static double gpu_a(const struct mlens_perf_hw *hw)
{
	return hw->ga.a + hw->gb.a;
}

static double gpu_b(const struct mlens_perf_hw *hw)
{
	return hw->ga.b + hw->gb.b;
}

/* n at which GPU time 2a + (b + gpu_extra) n equals a layer's transfer
 * of bytes at rate bytes/s + link_extra n; the extras are seconds per
 * token. The weight stream over PCIe and the read of the experts left on
 * disk are each such a transfer. */
static double n_balance_at(const struct mlens_perf_hw *hw, double bytes, double rate, double gpu_extra,
			   double link_extra)
{
	double t_io, slope, fixed = MLENS_PERF_GROUPS * gpu_a(hw);
	if (!(rate > 0))
		return NAN;
	t_io = bytes / rate;
	if (!(bytes > 0))
		return INFINITY;	/* nothing to balance: memory and KV bound the step */
	if (t_io <= fixed)
		return 0;
	/* per-token link traffic (collectives on PCIe) grows the transfer too */
	slope = gpu_b(hw) + gpu_extra - link_extra;
	if (!(slope > 0))
		return INFINITY;
	return (t_io - fixed) / slope;
}

static double n_balance(const struct mlens_perf_hw *hw, uint64_t streamed_bytes, double gpu_extra,
			double link_extra)
{
	return n_balance_at(hw, (double)streamed_bytes, hw->b_io, gpu_extra, link_extra);
}

double mlens_perf_n_fit(const struct mlens_perf_hw *hw, uint64_t streamed_bytes)
{
	return n_balance(hw, streamed_bytes, 0, hw->b_io > 0 ? hw->h2d_per_token / hw->b_io : 0);
}

/* ==== eq. 3-4 ==== */

double mlens_perf_pme(double p, double g)
{
	return 2.0 * (p + g) / ((2.0 * p + g) * g);
}

double mlens_perf_tmax(double pme, double kv_tokens, double delta, double t_gpu)
{
	double kv = delta > 0 ? pme * kv_tokens / delta : INFINITY;
	return kv < t_gpu ? kv : t_gpu;
}

struct mlens_perf_step mlens_perf_steady_step(const struct mlens_perf_workload *w, double n)
{
	struct mlens_perf_step st;
	double prefill;
	st.tokens = n;
	st.decode = n * w->g / (w->p + w->g);
	prefill = n - st.decode;
	st.context = st.decode * (w->p + w->g / 2.0);
	/* prefill / p prompts of p(p+1)/2 causal pairs each */
	st.prefill_pairs = prefill * (w->p + 1.0) / 2.0;
	return st;
}

/* ==== the roofline step time ==== */

const char *mlens_perf_bind_name(enum mlens_perf_bind b)
{
	switch (b) {
	case MLENS_PERF_BIND_PCIE: return "pcie-h2d";
	case MLENS_PERF_BIND_D2H: return "pcie-d2h";
	case MLENS_PERF_BIND_CPU_MEM: return "cpu-memory";
	case MLENS_PERF_BIND_GPU: return "gpu";
	case MLENS_PERF_BIND_CPU_ATTN: return "cpu-attention";
	case MLENS_PERF_BIND_CHAIN: return "gpu-cpu-chain";
	case MLENS_PERF_BIND_DISK: return "disk";
	case MLENS_PERF_BIND_N: break;
	}
	return "?";
}

const char *mlens_perf_tier_name(const struct mlens_perf_hw *hw, enum mlens_perf_bind b)
{
	if (hw->host_compute && b == MLENS_PERF_BIND_GPU)
		return "cpu";
	if (hw->host_compute && b == MLENS_PERF_BIND_CHAIN)
		return "cpu-chain";	/* compute, then attention, on one CPU */
	return mlens_perf_bind_name(b);
}

const char *mlens_perf_limit_name(enum mlens_perf_limit l)
{
	switch (l) {
	case MLENS_PERF_LIMIT_KV: return "kv-capacity";
	case MLENS_PERF_LIMIT_NREAL: return "n_real";
	case MLENS_PERF_LIMIT_ACT: return "activation-memory";
	case MLENS_PERF_LIMIT_STEP: return "largest-step";
	}
	return "?";
}

static bool hw_ok(const struct mlens_perf_hw *hw)
{
	return hw->b_io > 0 && hw->b_d2h >= 0 && hw->b_kv_store >= 0 && hw->b_mem > 0 && hw->b_attn > 0 &&
	       hw->h2d_per_token >= 0 && hw->c_attn >= 0 && hw->b_act_h2d >= 0 &&
	       hw->att_up_bytes >= 0 &&
	       hw->b_act_d2h >= 0 && hw->b_io_shared >= 0 && hw->b_attn_shared >= 0 && hw->b_append >= 0 &&
	       hw->c_gpu >= 0 && hw->b_disk >= 0 && hw->disk_layer_bytes >= 0 &&
	       gpu_b(hw) > 0 && isfinite(gpu_a(hw)) && isfinite(gpu_b(hw));
}

static bool step_ok(const struct mlens_perf_step *st)
{
	return st->tokens >= 0 && st->decode >= 0 && st->decode <= st->tokens &&
	       st->context >= 0 && st->prefill_pairs >= 0 && isfinite(st->tokens) &&
	       isfinite(st->context) && isfinite(st->prefill_pairs);
}

/* GPU seconds beyond the fitted lines for a group holding fractions fd of
 * the step's decode tokens and fp of its prefill tokens: prefill attention
 * at its rate, and the group's activation copies where they hold up the
 * compute queue. */
static double step_gpu_extra(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			     const struct mlens_perf_step *st, double fd, double fp)
{
	double qd = (double)(pm->heads * pm->head_dim), kvd = (double)(pm->kv_heads * pm->head_dim);
	double ab = (double)pm->abytes, d = st->decode, P = st->tokens - st->decode, t = 0;
	double c_attn = hw->c_attn > 0 ? hw->c_attn : hw->c_gpu;
	if (c_attn > 0)
		t += 4.0 * qd * fp * st->prefill_pairs / c_attn;
	if (hw->b_act_d2h > 0)
		t += (fd * d * (qd + 2 * kvd) + fp * P * 2 * kvd) * ab / hw->b_act_d2h;
	if (hw->b_act_h2d > 0)
		t += fd * d * qd * (hw->att_up_bytes > 0 ? hw->att_up_bytes : ab) / hw->b_act_h2d;
	/* the GPU's K/V stores into the pool, on the compute queue */
	if (hw->gpu_kv_append && !hw->kv_store_side && hw->b_kv_store > 0)
		t += (fd * d + fp * P) * (double)pm->kv_token_bytes / hw->b_kv_store;
	return t;
}

int mlens_perf_step_time(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			 const struct mlens_perf_policy *pol, const struct mlens_perf_step *st,
			 struct mlens_perf_step_time *out)
{
	double qd = (double)(pm->heads * pm->head_dim), kvd = (double)(pm->kv_heads * pm->head_dim);
	double ab = (double)pm->abytes, d = st->decode, P = st->tokens - st->decode;
	double kv_read, streamed, h2d, d2h, b_d2h, t_d2h, b_att, t_app;
	double frac_d[MLENS_PERF_GROUPS], frac_p[MLENS_PERF_GROUPS];
	if (!hw_ok(hw) || !step_ok(st) || pol->resident_experts < 0 ||
	    pol->resident_experts > pm->experts || !(pol->alpha_decode >= 0 && pol->alpha_decode <= 1) ||
	    !(pol->alpha_prefill >= 0 && pol->alpha_prefill <= 1))
		return -EINVAL;
	memset(out, 0, sizeof(*out));
	kv_read = st->context * (double)pm->kv_token_bytes;
	/* H2D: streamed experts + attention outputs of decode tokens;
	 * D2H: q, k, v of decode tokens + K/V of prefill tokens into the pool.
	 * The pipeline streams every non-resident expert of a layer each step,
	 * routed to or not (its copy runs before the layer's router), so the
	 * bytes depend on r alone, not on which experts are resident or how
	 * skewed the routing is: the resident hit ratio (routing residency)
	 * does not enter here. A stream of only the routed experts would
	 * scale this by the measured miss share. */
	streamed = (double)mlens_gpu_plan_streamed_bytes(pm, pol->resident_experts);
	h2d = streamed + d * qd * (hw->att_up_bytes > 0 ? hw->att_up_bytes : ab) +
	      st->tokens * hw->h2d_per_token;
	d2h = hw->gpu_kv_append ? d * qd * ab + st->tokens * (double)pm->kv_token_bytes
				: d * (qd + 2 * kvd) * ab + P * 2 * kvd * ab;
	b_d2h = hw->b_d2h > 0 ? hw->b_d2h : hw->b_io;
	t_d2h = d2h / b_d2h;
	/* the GPU's K/V stores at their measured rate: beside the kernels
	 * they share the D2H link's time with the q copies; on the compute
	 * queue the GPU tier has them (step_gpu_extra) */
	if (hw->gpu_kv_append && hw->b_kv_store > 0) {
		double kvb = st->tokens * (double)pm->kv_token_bytes;
		t_d2h = (d2h - kvb) / b_d2h + (hw->kv_store_side ? kvb / hw->b_kv_store : 0);
	}
	/* where experts stream, the attention's reads share memory with the
	 * weight DMA: the attention at its rate under copy */
	b_att = hw->b_attn_shared > 0 && hw->b_attn_shared < hw->b_attn && streamed > 0
		? hw->b_attn_shared : hw->b_attn;
	/* the host side appends every token's K and V to the pool first */
	t_app = hw->b_append > 0 && !hw->gpu_kv_append
		? (2 * kvd * ab + (double)pm->kv_token_bytes) / hw->b_append : 0;
	/* the stream at its rate beside the CPU's reads for the whole layer
	 * once the attention reads the KV at all: between the attention's
	 * passes the pipeline's other host traffic (the GPU's K/V stores and
	 * activation copies through mapped memory, the attention outputs)
	 * keeps it below its rate alone (traces put it near the rate beside
	 * a read; at its lone rate outside the attention's time the model
	 * over-predicted PCIe-bound steps: tests/bench/RESULTS.md) */
	out->tier[MLENS_PERF_BIND_PCIE] = h2d / hw->b_io;
	if (hw->b_io_shared > 0 && hw->b_io_shared < hw->b_io && kv_read > 0)
		out->tier[MLENS_PERF_BIND_PCIE] = h2d / hw->b_io_shared;
	out->tier[MLENS_PERF_BIND_D2H] = t_d2h;
	out->tier[MLENS_PERF_BIND_DISK] = hw->b_disk > 0 ? hw->disk_layer_bytes / hw->b_disk : 0;
	out->tier[MLENS_PERF_BIND_CPU_MEM] = (kv_read + h2d + d2h) / hw->b_mem;
	frac_d[0] = pol->alpha_decode;
	frac_d[1] = 1 - pol->alpha_decode;
	frac_p[0] = pol->alpha_prefill;
	frac_p[1] = 1 - pol->alpha_prefill;
	for (int x = 0; x < MLENS_PERF_GROUPS; x++) {
		double n_x = frac_d[x] * d + frac_p[x] * P, g = 0;
		if (n_x > 0) {
			/* an empty group launches nothing; a fitted intercept may
			 * come out slightly negative: time is never negative */
			g = gpu_a(hw) + gpu_b(hw) * n_x + step_gpu_extra(pm, hw, st, frac_d[x], frac_p[x]);
			if (g < 0)
				g = 0;
		}
		out->group_gpu[x] = g;
		out->group_cpu[x] = frac_d[x] * kv_read / b_att + n_x * t_app;
		out->tier[MLENS_PERF_BIND_GPU] += g;
		out->tier[MLENS_PERF_BIND_CPU_ATTN] += out->group_cpu[x];
		if (g + out->group_cpu[x] > out->tier[MLENS_PERF_BIND_CHAIN])
			out->tier[MLENS_PERF_BIND_CHAIN] = g + out->group_cpu[x];
	}
	out->bind = MLENS_PERF_BIND_PCIE;
	for (int t = 1; t < MLENS_PERF_BIND_N; t++)
		if (out->tier[t] > out->tier[out->bind])
			out->bind = (enum mlens_perf_bind)t;
	out->period = out->tier[out->bind];
	out->fill = out->tier[MLENS_PERF_BIND_CHAIN];
	out->seconds = (double)pm->layers * out->period + out->fill;
	return 0;
}

#define SPLIT_GRID 32

int mlens_perf_step_time_best(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			      struct mlens_perf_policy *pol, const struct mlens_perf_step *st,
			      struct mlens_perf_step_time *out)
{
	struct mlens_perf_policy p = *pol, best;
	struct mlens_perf_step_time t;
	double n = st->tokens, d = st->decode, P = st->tokens - st->decode;
	int rc;
	/* start from the even split so that ties keep it */
	p.alpha_decode = 0.5;
	p.alpha_prefill = 0.5;
	rc = mlens_perf_step_time(pm, hw, &p, st, out);
	if (rc)
		return rc;
	best = p;
	for (int i = 0; i <= SPLIT_GRID; i++)
		for (int j = 0; j <= SPLIT_GRID; j++) {
			double n_a;
			p.alpha_decode = (double)i / SPLIT_GRID;
			p.alpha_prefill = (double)j / SPLIT_GRID;
			n_a = p.alpha_decode * d + p.alpha_prefill * P;
			/* activations budget q,k,v for a group of GROUP_MAX x n */
			if (n_a > MLENS_PERF_GROUP_MAX * n + 1e-9 ||
			    n - n_a > MLENS_PERF_GROUP_MAX * n + 1e-9)
				continue;
			if (mlens_perf_step_time(pm, hw, &p, st, &t))
				continue;
			if (t.seconds < out->seconds * (1 - 1e-12)) {
				*out = t;
				best = p;
			}
		}
	*pol = best;
	return 0;
}

/* ==== prediction and the policy search ==== */

static double gib(uint64_t b)
{
	return (double)b / (1024.0 * 1024.0 * 1024.0);
}

static int64_t min_tokens(const struct mlens_perf_workload *w)
{
	if (w->min_tokens > 0)
		return w->min_tokens;
	return w->p >= 1 ? (int64_t)ceil(w->p) : 1;
}

/* Activation bytes of n tokens: the executor's count when hw has one. */
static uint64_t act_of(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw, int64_t n)
{
	return hw->act_bytes ? hw->act_bytes(pm, n, hw->chunk, hw->act_arg)
			     : mlens_gpu_plan_act_estimate(pm, n, hw->chunk);
}

struct act_at {
	const struct mlens_perf_model *pm;
	const struct mlens_perf_hw *hw;
};

static uint64_t act_at(const void *arg, int64_t n)
{
	const struct act_at *a = arg;
	return act_of(a->pm, a->hw, n);
}

/* Most tokens whose activations fit in room bytes (0 when not even one). */
static int64_t act_fit(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
		       uint64_t room)
{
	const struct act_at a = { pm, hw };
	return mlens_gpu_plan_tokens_fit(act_at, &a, room, (int64_t)1 << 40);
}

uint64_t mlens_perf_min_budget(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			       int64_t n_min)
{
	return mlens_gpu_plan_minimum(pm, hw->gpu_workspace, act_of(pm, hw, n_min > 0 ? n_min : 1));
}

/* GPU tier minus PCIe tier of the workload's steady step of n tokens,
 * split evenly (seconds per layer). */
static double tier_gap(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
		       const struct mlens_perf_workload *w, int resident, double n)
{
	struct mlens_perf_policy pol = { resident, 0.5, 0.5 };
	struct mlens_perf_step st = mlens_perf_steady_step(w, n);
	struct mlens_perf_step_time t;
	if (mlens_perf_step_time(pm, hw, &pol, &st, &t))
		return NAN;
	return t.tier[MLENS_PERF_BIND_GPU] - t.tier[MLENS_PERF_BIND_PCIE];
}

/* n_eq with the weight stream as the step time counts it: at B_IO,shared
 * while the CPU attention reads memory. That transfer is never faster
 * than eq. 2's at B_IO, so the balance lies at or above n0 (the B_IO
 * one); INFINITY when the GPU's time never catches up with the stream
 * (the attention's reads grow with n as fast as the GPU's work). */
static double n_balance_shared(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			       const struct mlens_perf_workload *w, int resident, double n0)
{
	double lo = n0 > 1 ? n0 : 1, hi, f = tier_gap(pm, hw, w, resident, lo);
	if (!(f < 0))
		return isnan(f) ? n0 : lo;
	for (hi = 2 * lo;; hi *= 2) {
		f = tier_gap(pm, hw, w, resident, hi);
		if (isnan(f))
			return n0;
		if (f >= 0)
			break;
		if (hi > 1e12)
			return INFINITY;
		lo = hi;
	}
	while (hi - lo > 0.25) {
		double mid = lo + (hi - lo) / 2;
		if (tier_gap(pm, hw, w, resident, mid) < 0)
			lo = mid;
		else
			hi = mid;
	}
	return hi;
}

int mlens_perf_predict(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
		       const struct mlens_perf_workload *w, int resident_experts,
		       struct mlens_perf_prediction *out, char *err, size_t errlen)
{
	uint64_t fixed, room, streamed;
	int64_t nmin = min_tokens(w);
	double n_a, gpu_x;
	int rc;
	if (!hw_ok(hw) || !(w->p >= 0) || !(w->g > 0) || !(w->kv_tokens > 0) ||
	    resident_experts < 0 || resident_experts > pm->experts) {
		mlens_errf(err, errlen, "performance model: a ceiling, the workload or the residency is out of range");
		return -EINVAL;
	}
	memset(out, 0, sizeof(*out));
	out->policy.resident_experts = resident_experts;
	out->gpu_resident = mlens_gpu_plan_resident_bytes(pm, resident_experts);
	out->gpu_slots = mlens_gpu_plan_slot_bytes(pm, resident_experts);
	fixed = mlens_gpu_plan_fixed_bytes(pm, resident_experts, hw->gpu_workspace);
	room = hw->gpu_budget > fixed ? hw->gpu_budget - fixed : 0;
	n_a = (double)act_fit(pm, hw, room);
	if (n_a < (double)nmin) {
		mlens_errf(err, errlen,
		       "GPU budget %.2f GiB cannot hold %d resident experts per layer: weights %.2f GiB, "
		       "streaming slots %.2f GiB and workspace %.2f GiB leave room for %.0f tokens of "
		       "activations, fewer than the %lld a step needs",
		       gib(hw->gpu_budget), resident_experts, gib(out->gpu_resident),
		       gib(out->gpu_slots), gib(hw->gpu_workspace), n_a, (long long)nmin);
		return -ENOSPC;
	}
	out->n_real_by = MLENS_PERF_LIMIT_ACT;
	if (hw->max_step > 0 && n_a > hw->max_step) {
		n_a = hw->max_step;
		out->n_real_by = MLENS_PERF_LIMIT_STEP;
	}
	streamed = mlens_gpu_plan_streamed_bytes(pm, resident_experts);
	out->pme = mlens_perf_pme(w->p, w->g);
	{
		/* the workload's steady steps add, per token, prefill attention
		 * and activation copies to the GPU's time and the attention
		 * outputs to the link (linear in n: measured at any n) */
		const double n1 = 1e4;
		struct mlens_perf_step s1 = mlens_perf_steady_step(w, n1);
		double qd = (double)(pm->heads * pm->head_dim), link_x;
		gpu_x = step_gpu_extra(pm, hw, &s1, 1, 1) / n1;
		/* eq. 2's balance with the transfer at B_IO; then, where the
		 * stream slows while the CPU attention reads memory, the balance
		 * with the transfer the step really gets (a sweep's best cap
		 * lies well above the B_IO balance, where the model's own
		 * throughput peaks too: tests/bench/nreal_sweep.sh) */
		link_x = (hw->h2d_per_token + s1.decode * qd * (double)pm->abytes / n1) / hw->b_io;
		out->n_eq = n_balance(hw, streamed, gpu_x, link_x);
		if (hw->b_io_shared > 0 && hw->b_io_shared < hw->b_io && isfinite(out->n_eq) &&
		    streamed > 0)
			out->n_eq = n_balance_shared(pm, hw, w, resident_experts, out->n_eq);
		/* experts read from disk each step: tokens enough that the
		 * GPU's (CPU's) time covers their read too */
		if (hw->b_disk > 0 && hw->disk_layer_bytes > 0) {
			out->n_eq = fmax(out->n_eq, n_balance_at(hw, hw->disk_layer_bytes, hw->b_disk, gpu_x, 0));
		}
	}
	out->n_act = n_a;
	out->n_real = out->n_eq < n_a ? floor(out->n_eq) : n_a;
	if (out->n_eq < n_a)
		out->n_real_by = MLENS_PERF_LIMIT_NREAL;
	if (out->n_real < (double)nmin)
		out->n_real = (double)nmin;	/* a whole prompt must fit a step */
	out->n_kv = out->pme * w->kv_tokens;
	if (out->n_kv <= out->n_real) {
		out->tokens = out->n_kv;
		out->limit = MLENS_PERF_LIMIT_KV;
	} else {
		out->tokens = out->n_real;
		out->limit = out->n_real_by;
	}
	out->gpu_act = act_of(pm, hw, (int64_t)ceil(out->tokens));
	out->gpu_total = sat_add(fixed, out->gpu_act);
	out->step = mlens_perf_steady_step(w, out->tokens);
	rc = mlens_perf_step_time_best(pm, hw, &out->policy, &out->step, &out->time);
	if (rc) {
		mlens_errf(err, errlen, "performance model: the step is out of range");
		return rc;
	}
	out->steps_per_s = 1.0 / out->time.seconds;
	out->total_tok_s = out->tokens * out->steps_per_s;
	out->gen_tok_s = out->step.decode * out->steps_per_s;
	out->delta = (double)pm->layers * (double)streamed / hw->b_io;
	if (hw->b_disk > 0 && (double)pm->layers * hw->disk_layer_bytes / hw->b_disk > out->delta)
		out->delta = (double)pm->layers * hw->disk_layer_bytes / hw->b_disk;
	{
		double g1 = gpu_a(hw) + (gpu_b(hw) + gpu_x) * out->n_real;
		out->t_gpu = g1 > 0 ? out->n_real / ((double)pm->layers * g1) : INFINITY;
	}
	out->t_max = mlens_perf_tmax(out->pme, w->kv_tokens, out->delta, out->t_gpu);
	return 0;
}

int mlens_perf_choose(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
		      const struct mlens_perf_workload *w, struct mlens_perf_prediction *out,
		      char *err, size_t errlen)
{
	return mlens_perf_choose_upto(pm, hw, w, -1, out, err, errlen);
}

int mlens_perf_choose_upto(const struct mlens_perf_model *pm, const struct mlens_perf_hw *hw,
			   const struct mlens_perf_workload *w, int max_r,
			   struct mlens_perf_prediction *out, char *err, size_t errlen)
{
	struct mlens_perf_prediction p;
	bool found = false;
	int rc, top = max_r < 0 || max_r > pm->experts ? (int)pm->experts : max_r;
	for (int r = 0; r <= top; r++) {
		rc = mlens_perf_predict(pm, hw, w, r, &p, NULL, 0);
		if (rc == -ENOSPC)
			continue;	/* with few layers, more residency can need less */
		if (rc) {
			mlens_errf(err, errlen, "performance model: a ceiling or the workload is out of range");
			return rc;
		}
		if (!found || p.total_tok_s > out->total_tok_s * (1 + 1e-12)) {
			*out = p;
			found = true;
		}
	}
	if (!found) {
		uint64_t need = mlens_perf_min_budget(pm, hw, min_tokens(w));
		mlens_errf(err, errlen,
		       "GPU budget %.2f GiB is too small for this model: it needs at least %.2f GiB "
		       "(attention, norms, routers, embeddings and lm_head %.2f GiB, two slots of one "
		       "layer's experts %.2f GiB, activations for %lld tokens %.2f GiB, workspace "
		       "%.2f GiB); raise gpu_memory",
		       gib(hw->gpu_budget), gib(need), gib(mlens_gpu_plan_resident_bytes(pm, 0)),
		       gib(mlens_gpu_plan_slot_bytes(pm, 0)), (long long)min_tokens(w),
		       gib(act_of(pm, hw, min_tokens(w))), gib(hw->gpu_workspace));
		return -ENOSPC;
	}
	return 0;
}

int mlens_perf_token_cap(const struct mlens_perf_prediction *pred)
{
	double n = floor(pred->n_real);
	if (!(n >= 1))
		return 1;
	return n >= (double)INT_MAX ? INT_MAX : (int)n;
}

/* ==== the daemon's steady state and the hardware bound (perfmodel.h) ==== */

double mlens_perf_seq_blocks(double p, double g, int block_tokens)
{
	double B = block_tokens > 1 ? (double)block_tokens : 1.0, sum = 0;
	int64_t gi;
	if (!(p >= 1) || !(g >= 1) || !isfinite(p) || !isfinite(g) || g > 1e9)
		return NAN;
	gi = (int64_t)floor(g);
	/* a sum of g terms: g is a generation length, at most millions */
	for (int64_t a = 0; a < gi; a++)
		sum += ceil((p + (double)a) / B);
	return sum / (double)gi;
}

/* Admissions per step of the scheduler under cap N with every request p
 * prompt and g generated tokens: a_t = floor((N - D_t) / p), D_t the
 * admissions of the last g - 1 steps (still decoding), run from an empty
 * batch past its transient and averaged over many periods. */
static double sched_admissions(double p, double g, double cap)
{
	int64_t gi = (int64_t)g, w = gi - 1, warm, meas, D = 0, idx = 0, N = (int64_t)cap;
	int64_t P = (int64_t)p, *ring;
	double total = 0;
	if (w < 1)
		return floor(cap / p);
	if (gi > MLENS_PERF_SIM_MAX_GEN) {
		/* the fixed point of the recurrence, exact unless admissions
		 * alternate (then within a few per cent) */
		double m0 = floor(cap / (p + g - 1)), d0 = (g - 1) * m0, d1 = cap - (m0 + 1) * p;
		return (d0 > d1 ? d0 : d1) / (g - 1);
	}
	ring = calloc((size_t)w, sizeof(*ring));
	if (!ring)
		return NAN;
	warm = 200 * gi > 1000 ? 200 * gi : 1000;
	meas = 1000 * gi > 10000 ? 1000 * gi : 10000;
	for (int64_t t = 0; t < warm + meas; t++) {
		int64_t a = (N - D) / P;
		if (t >= warm)
			total += (double)a;
		D += a - ring[idx];
		ring[idx] = a;
		idx = idx + 1 == w ? 0 : idx + 1;
	}
	free(ring);
	return total / (double)meas;
}

int mlens_perf_sched_steady(double p, double g, double cap, double max_seqs,
			    struct mlens_perf_sched_state *out)
{
	double k_cap, k_seq;
	if (!(p >= 1) || !(g >= 1) || !(cap >= p) || !(max_seqs > 0) || !(cap <= 1e12) ||
	    !(p <= 1e12) || !(g <= 1e12))
		return -EINVAL;
	memset(out, 0, sizeof(*out));
	p = floor(p);
	g = floor(g);
	cap = floor(cap);
	k_cap = sched_admissions(p, g, cap);
	if (!isfinite(k_cap))
		return -ENOMEM;
	k_seq = max_seqs / g;
	out->cap_binds = k_cap <= k_seq;
	out->prompts = out->cap_binds ? k_cap : k_seq;
	out->seqs = out->prompts * g;
	out->decode = out->prompts * (g - 1);
	out->tokens = out->prompts * (p + g - 1);
	out->generated = out->seqs;
	out->context = out->decode * (p + g / 2);
	return 0;
}

/* The bound's times from its per-step work (out's streamed, kv_bytes,
 * flops, st.generated) and the ceilings; total: tokens the clients count
 * per step. */
double mlens_perf_gemm_seconds(double flops, double expert_flops, double c_gemm, double c_expert)
{
	if (!(c_gemm > 0))
		return 0;
	if (!(c_expert > 0))
		return flops / c_gemm;
	return (flops - expert_flops) / c_gemm + expert_flops / c_expert;
}

static int bound_times(struct mlens_perf_bound *out, double b_pcie, double b_mem, double c_gemm,
		       double c_expert, double total)
{
	out->t_pcie = b_pcie > 0 ? out->streamed / b_pcie : 0;
	out->t_mem = b_mem > 0 ? (out->kv_bytes + out->streamed) / b_mem : 0;
	out->t_gemm = mlens_perf_gemm_seconds(out->flops, out->expert_flops, c_gemm, c_expert);
	out->t_step = out->t_pcie;
	out->binds = "pcie-h2d";
	if (out->t_mem > out->t_step) {
		out->t_step = out->t_mem;
		out->binds = "cpu-memory";
	}
	if (out->t_gemm > out->t_step) {
		out->t_step = out->t_gemm;
		out->binds = "gpu-gemm";
	}
	if (!(out->t_step > 0))
		return -EINVAL;
	out->gen_tok_s = out->st.generated / out->t_step;
	out->total_tok_s = total / out->t_step;
	return 0;
}

int mlens_perf_bound(const struct mlens_perf_model *pm, double p, double g, double kv_seqs,
		     double streamed_bytes, double b_pcie, double b_mem, double c_gemm,
		     double c_expert, struct mlens_perf_bound *out)
{
	struct mlens_perf_sched_state *st = &out->st;
	double L = (double)pm->layers, qd = (double)(pm->heads * pm->head_dim);
	double k;
	memset(out, 0, sizeof(*out));
	if (!(p >= 1) || !(g >= 1) || !(kv_seqs > 0) || !isfinite(kv_seqs) || !(streamed_bytes >= 0) ||
	    !(b_pcie > 0 || b_mem > 0 || c_gemm > 0))
		return -EINVAL;
	k = kv_seqs / g;
	st->prompts = k;
	st->seqs = kv_seqs;
	st->decode = k * (g - 1);
	st->tokens = k * (p + g - 1);
	st->generated = kv_seqs;
	st->context = st->decode * (p + g / 2);
	out->streamed = streamed_bytes;
	out->kv_bytes = st->context * (double)pm->kv_token_bytes * L;
	out->flops = st->tokens * L * (pm->flops_ga + pm->flops_gb) +
		     L * 4.0 * qd * k * p * (p + 1) / 2 +
		     2.0 * (double)pm->hidden * (double)pm->vocab * st->generated;
	out->expert_flops = st->tokens * L * pm->flops_experts;
	return bound_times(out, b_pcie, b_mem, c_gemm, c_expert, k * (p + g));
}

int mlens_perf_mix_of(const double *p, const double *g, size_t n, int block_tokens,
		      struct mlens_perf_mix *out)
{
	double B = block_tokens > 1 ? (double)block_tokens : 1.0;
	memset(out, 0, sizeof(*out));
	if (n < 1)
		return -EINVAL;
	for (size_t i = 0; i < n; i++) {
		double bs = mlens_perf_seq_blocks(p[i], g[i], block_tokens), gi = floor(g[i]);
		if (!isfinite(bs) || !isfinite(p[i]))
			return -EINVAL;
		out->prompt += p[i];
		out->gen += gi;
		out->block_steps += bs * gi;
		/* sum_{a<g} (p + a) = g p + g (g - 1) / 2 */
		out->token_steps += gi * p[i] + gi * (gi - 1) / 2;
		out->context += (gi - 1) * (p[i] + gi / 2);
		out->prefill_pairs += p[i] * (p[i] + 1) / 2;
	}
	out->requests = (double)n;
	out->prompt /= (double)n;
	out->gen /= (double)n;
	out->block_steps /= (double)n;
	out->token_steps /= (double)n;
	out->context /= (double)n;
	out->prefill_pairs /= (double)n;
	out->block_tokens = (int)B;
	return 0;
}

double mlens_perf_mix_seq_blocks(const struct mlens_perf_mix *mix)
{
	return mix->gen >= 1 ? mix->block_steps / mix->gen : NAN;
}

int mlens_perf_bound_mix(const struct mlens_perf_model *pm, const struct mlens_perf_mix *mix,
			 double kv_blocks, double streamed_bytes, double b_pcie, double b_mem,
			 double c_gemm, double c_expert, struct mlens_perf_bound *out)
{
	struct mlens_perf_sched_state *st = &out->st;
	double L = (double)pm->layers, qd = (double)(pm->heads * pm->head_dim);
	double m = mlens_perf_mix_seq_blocks(mix), k;
	memset(out, 0, sizeof(*out));
	if (!(mix->prompt >= 1) || !(mix->gen >= 1) || !(m > 0) || !(kv_blocks > 0) ||
	    !isfinite(kv_blocks) || !(streamed_bytes >= 0) || !(b_pcie > 0 || b_mem > 0 || c_gemm > 0))
		return -EINVAL;
	st->seqs = kv_blocks / m;
	k = st->seqs / mix->gen;
	st->prompts = k;
	st->decode = k * (mix->gen - 1);
	st->tokens = k * (mix->prompt + mix->gen - 1);
	st->generated = st->seqs;
	st->context = k * mix->context;
	out->streamed = streamed_bytes;
	out->kv_bytes = st->context * (double)pm->kv_token_bytes * L;
	out->flops = st->tokens * L * (pm->flops_ga + pm->flops_gb) +
		     L * 4.0 * qd * k * mix->prefill_pairs +
		     2.0 * (double)pm->hidden * (double)pm->vocab * st->generated;
	out->expert_flops = st->tokens * L * pm->flops_experts;
	return bound_times(out, b_pcie, b_mem, c_gemm, c_expert, k * (mix->prompt + mix->gen));
}

int mlens_perf_bound_add_disk(struct mlens_perf_bound *b, double disk_bytes, double b_disk)
{
	double total;
	if (!(disk_bytes >= 0) || !isfinite(disk_bytes) || !(b_disk > 0) || !isfinite(b_disk) || !(b->t_step > 0))
		return -EINVAL;
	total = b->total_tok_s * b->t_step;
	b->disk_bytes = disk_bytes;
	b->t_disk = disk_bytes / b_disk;
	if (b->t_disk > b->t_step) {
		b->t_step = b->t_disk;
		b->binds = "disk";
	}
	b->gen_tok_s = b->st.generated / b->t_step;
	b->total_tok_s = total / b->t_step;
	return 0;
}

/* ==== several GPUs (formulas in perfmodel.h) ==== */

/* x scaled by shard/whole, or by 1/G when the roofline term is absent */
static double line_scale(double x, double shard, double whole, int gpus)
{
	return whole > 0 ? x * shard / whole : x / gpus;
}

int mlens_perf_multi_setup(const struct mlens_model_config *c, enum mlens_dtype kv_dtype,
			   const struct mlens_perf_hw *hw, const struct mlens_perf_multi *mp,
			   struct mlens_perf_model *shard, struct mlens_perf_hw *shard_hw,
			   char *err, size_t errlen)
{
	struct mlens_shard_plan plan;
	struct mlens_model_config sc = *c;
	struct mlens_perf_model full;
	struct mlens_perf_hw rf_full, rf_shard;
	struct mlens_shard_coll co;
	const struct mlens_shard_rank *k;
	double imb = mp->ep_imbalance > 0 ? mp->ep_imbalance : 1.0, H, E;
	int ab = mp->coll_bytes > 0 ? (int)mp->coll_bytes : 2, G = mp->gpus, rc;

	if ((mp->scheme != MLENS_SHARD_TP && mp->scheme != MLENS_SHARD_EP) || !(imb >= 1) ||
	    !isfinite(imb) || !(mp->lat_coll >= 0) || mp->coll_bytes < 0 || mp->coll_bytes > 8 ||
	    (G > 1 && !(mp->b_coll > 0))) {
		mlens_errf(err, errlen, "performance model: a multi-GPU parameter is out of range "
		       "(scheme, collective bandwidth and latency, imbalance >= 1)");
		return -EINVAL;
	}
	rc = mlens_shard_plan(&plan, c, G, (enum mlens_shard_scheme)mp->scheme, err, errlen);
	if (rc)
		return rc;
	rc = mlens_perf_model_from_config(&full, c, kv_dtype);
	if (rc) {
		mlens_errf(err, errlen, "performance model: the model's dimensions are out of range");
		return rc;
	}
	k = &plan.rank[0];
	sc.num_attention_heads = k->q_heads;
	sc.num_key_value_heads = k->kv_heads;
	sc.intermediate_size = k->inter;
	sc.vocab_size = k->vocab;
	sc.num_local_experts = k->experts;
	if (sc.num_experts_per_tok > k->experts)
		sc.num_experts_per_tok = k->experts;
	rc = mlens_perf_model_from_config(shard, &sc, kv_dtype);
	if (rc) {
		mlens_errf(err, errlen, "performance model: the shard's dimensions are out of range");
		return rc;
	}
	/* the router is whole on every GPU; CPU attention reads each kv head
	 * once, shared by the G shards; EP: the busiest GPU's share of the
	 * routed rows */
	H = (double)full.hidden;
	E = (double)full.experts;
	shard->router_bytes = full.router_bytes;
	shard->layer_bytes = shard->attn_bytes + shard->norm_bytes + shard->router_bytes +
			     shard->family_bytes + shard->layer_expert_bytes;
	shard->model_bytes = shard->layer_bytes * (uint64_t)shard->layers + shard->embed_bytes +
			     shard->lm_head_bytes + shard->final_norm_bytes;
	shard->kv_token_bytes = (full.kv_token_bytes + (uint64_t)G - 1) / (uint64_t)G;
	if (mp->scheme == MLENS_SHARD_TP)
		shard->flops_experts = (double)full.top_k * 6.0 * H * (double)k->inter;
	else
		shard->flops_experts = (double)full.top_k * ((double)k->experts / E) * imb * 6.0 * H *
				       (double)full.inter;
	shard->flops_gb = 2.0 * (double)(shard->heads * shard->head_dim) * H + 2.0 * H * E +
			  shard->flops_experts;

	*shard_hw = *hw;
	shard_hw->b_mem = hw->b_mem / G;
	shard_hw->b_attn = hw->b_attn / G;
	shard_hw->b_attn_shared = hw->b_attn_shared / G;
	shard_hw->b_append = hw->b_append / G;
	rf_full = *hw;
	rf_shard = *hw;
	mlens_perf_hw_roofline_lines(&rf_full, &full);
	mlens_perf_hw_roofline_lines(&rf_shard, shard);
	shard_hw->ga.a = line_scale(hw->ga.a, rf_shard.ga.a, rf_full.ga.a, G);
	shard_hw->ga.b = line_scale(hw->ga.b, rf_shard.ga.b, rf_full.ga.b, G);
	shard_hw->gb.a = line_scale(hw->gb.a, rf_shard.gb.a, rf_full.gb.a, G);
	shard_hw->gb.b = line_scale(hw->gb.b, rf_shard.gb.b, rf_full.gb.b, G);
	/* collectives of one token group: linear in its tokens */
	mlens_shard_layer_coll(&plan, 1.0, ab, &co);
	shard_hw->gb.a += co.steps * mp->lat_coll;
	if (G > 1)
		shard_hw->gb.b += co.total / mp->b_coll;
	if (mp->coll_on_pcie)
		shard_hw->h2d_per_token += co.total;
	return 0;
}

int mlens_perf_multi_choose(const struct mlens_model_config *c, enum mlens_dtype kv_dtype,
			    const struct mlens_perf_hw *hw, const struct mlens_perf_workload *w,
			    const struct mlens_perf_multi *mp, struct mlens_perf_prediction *out,
			    char *err, size_t errlen)
{
	struct mlens_perf_model shard;
	struct mlens_perf_hw shw;
	int rc = mlens_perf_multi_setup(c, kv_dtype, hw, mp, &shard, &shw, err, errlen);
	if (rc)
		return rc;
	return mlens_perf_choose(&shard, &shw, w, out, err, errlen);
}

int mlens_perf_multi_best(const struct mlens_model_config *c, enum mlens_dtype kv_dtype,
			  const struct mlens_perf_hw *hw, const struct mlens_perf_workload *w,
			  const struct mlens_perf_multi *mp, struct mlens_perf_prediction *out,
			  int *scheme, char *err, size_t errlen)
{
	struct mlens_perf_prediction p;
	struct mlens_perf_multi m = *mp;
	char first[512] = "";
	int rc, first_rc = 0;
	bool found = false;
	for (int s = MLENS_SHARD_TP; s <= MLENS_SHARD_EP; s++) {
		m.scheme = s;
		rc = mlens_perf_multi_choose(c, kv_dtype, hw, w, &m, &p, first_rc ? NULL : first,
					     first_rc ? 0 : sizeof(first));
		if (rc) {
			if (!first_rc)
				first_rc = rc;
			continue;
		}
		if (!found || p.total_tok_s > out->total_tok_s * (1 + 1e-12)) {
			*out = p;
			*scheme = s;
			found = true;
		}
	}
	if (!found) {
		mlens_errf(err, errlen, "%s", first);
		return first_rc;
	}
	return 0;
}
