/* Golden fixture reader (golden.json through jansson, raw little-endian
 * float32 logits) and the engine runs the golden checks repeat on each
 * backend. */
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "daemon/plan/gpu_plan.h"
#include "tests/golden/golden.h"

/* Logits rows are at most this wide and prompts at most this long: the
 * fixtures are tiny; larger values mean a damaged golden.json. */
#define GOLDEN_MAX_VOCAB (1 << 20)
#define GOLDEN_MAX_LEN (1 << 16)

static int fail(char *err, size_t len, int rc, const char *fmt, ...)
{
	va_list ap;
	if (err && len) {
		va_start(ap, fmt);
		vsnprintf(err, len, fmt, ap);
		va_end(ap);
	}
	return rc;
}

static char *path_join(const char *dir, const char *name)
{
	size_t n = strlen(dir) + strlen(name) + 2;
	char *p = malloc(n);
	if (p)
		snprintf(p, n, "%s/%s", dir, name);
	return p;
}

/* ==== reading ==== */

struct reader {
	const char *dir;
	const char *json_path;
	char *err;
	size_t errlen;
};

static int get_int(struct reader *r, json_t *o, const char *key, int lo, int hi, int *out)
{
	json_t *v = json_object_get(o, key);
	if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
		return fail(r->err, r->errlen, -EINVAL, "%s: '%s' must be an integer in [%d, %d]",
			    r->json_path, key, lo, hi);
	*out = (int)json_integer_value(v);
	return 0;
}

static int get_real(struct reader *r, json_t *o, const char *key, double *out)
{
	json_t *v = json_object_get(o, key);
	if (!json_is_number(v) || !(json_number_value(v) > 0) || !isfinite(json_number_value(v)))
		return fail(r->err, r->errlen, -EINVAL, "%s: '%s' must be a positive number",
			    r->json_path, key);
	*out = json_number_value(v);
	return 0;
}

static int get_string(struct reader *r, json_t *o, const char *key, char **out)
{
	json_t *v = json_object_get(o, key);
	if (!json_is_string(v))
		return fail(r->err, r->errlen, -EINVAL, "%s: '%s' must be a string", r->json_path, key);
	*out = strdup(json_string_value(v));
	return *out ? 0 : -ENOMEM;
}

/* An array of exactly n numbers (n < 0: any length >= 1, returned in *nout). */
static int get_array(struct reader *r, json_t *o, const char *key, int n, int *nout,
		     int32_t **ints, float **reals, int vocab)
{
	json_t *a = json_object_get(o, key);
	size_t len;
	if (!json_is_array(a) || json_array_size(a) == 0 || json_array_size(a) > GOLDEN_MAX_LEN ||
	    (n >= 0 && json_array_size(a) != (size_t)n))
		return fail(r->err, r->errlen, -EINVAL, "%s: '%s' must be an array of %d numbers",
			    r->json_path, key, n);
	len = json_array_size(a);
	if (ints)
		*ints = malloc(len * sizeof(**ints));
	else
		*reals = malloc(len * sizeof(**reals));
	if (ints ? !*ints : !*reals)
		return -ENOMEM;
	for (size_t i = 0; i < len; i++) {
		json_t *v = json_array_get(a, i);
		if (ints) {
			if (!json_is_integer(v) || json_integer_value(v) < 0 ||
			    json_integer_value(v) >= vocab)
				return fail(r->err, r->errlen, -EINVAL,
					    "%s: '%s'[%zu] is not a token id below %d",
					    r->json_path, key, i, vocab);
			(*ints)[i] = (int32_t)json_integer_value(v);
		} else {
			if (!json_is_number(v))
				return fail(r->err, r->errlen, -EINVAL, "%s: '%s'[%zu] is not a number",
					    r->json_path, key, i);
			(*reals)[i] = (float)json_number_value(v);
		}
	}
	if (nout)
		*nout = (int)len;
	return 0;
}

/* rows x vocab little-endian float32 from the file named by o[key]. */
static int get_logits(struct reader *r, json_t *o, const char *key, int rows, int vocab,
		      float **out)
{
	char *name = NULL, *path = NULL;
	size_t n = (size_t)rows * (size_t)vocab;
	FILE *f = NULL;
	struct stat st;
	int rc = get_string(r, o, key, &name);
	if (rc)
		return rc;
	if (strchr(name, '/')) {
		rc = fail(r->err, r->errlen, -EINVAL, "%s: '%s' must name a file of the folder",
			  r->json_path, key);
		goto out;
	}
	path = path_join(r->dir, name);
	*out = malloc(n * sizeof(float));
	if (!path || !*out) {
		rc = -ENOMEM;
		goto out;
	}
	f = fopen(path, "rb");
	if (!f || fstat(fileno(f), &st)) {
		rc = fail(r->err, r->errlen, -errno, "%s: %s", path, strerror(errno));
		goto out;
	}
	if ((uint64_t)st.st_size != n * sizeof(float)) {
		rc = fail(r->err, r->errlen, -EINVAL,
			  "%s: %lld bytes, expected %d x %d float32 (%zu bytes): regenerate the fixture",
			  path, (long long)st.st_size, rows, vocab, n * sizeof(float));
		goto out;
	}
	if (fread(*out, sizeof(float), n, f) != n) {
		rc = fail(r->err, r->errlen, -EIO, "%s: short read", path);
		goto out;
	}
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
	for (size_t i = 0; i < n; i++) {
		uint32_t u;
		memcpy(&u, &(*out)[i], 4);
		u = __builtin_bswap32(u);
		memcpy(&(*out)[i], &u, 4);
	}
#endif
	for (size_t i = 0; i < n; i++)
		if (!isfinite((*out)[i])) {
			rc = fail(r->err, r->errlen, -EINVAL, "%s: value %zu is not finite", path, i);
			goto out;
		}
out:
	if (f)
		fclose(f);
	free(path);
	free(name);
	return rc;
}

static int read_ref(struct reader *r, const struct mlens_golden *g, json_t *o,
		    struct mlens_golden_ref *ref)
{
	int rc;
	if ((rc = get_array(r, o, "greedy", g->n_gen, NULL, &ref->greedy, NULL, g->vocab)) ||
	    (rc = get_array(r, o, "margin", g->n_gen, NULL, NULL, &ref->margin, 0)) ||
	    (rc = get_array(r, o, "max_abs", g->n_gen, NULL, NULL, &ref->max_abs, 0)))
		return rc;
	return get_logits(r, o, "gen_logits", g->n_gen_logits, g->vocab, &ref->gen_logits);
}

static void free_ref(struct mlens_golden_ref *r)
{
	free(r->greedy);
	free(r->margin);
	free(r->max_abs);
	free(r->gen_logits);
}

void mlens_golden_close(struct mlens_golden *g)
{
	if (!g)
		return;
	for (int i = 0; i < g->n_prompts; i++) {
		free(g->prompts[i].tokens);
		free(g->prompts[i].prefill_logits);
		free_ref(&g->prompts[i].main);
		free_ref(&g->prompts[i].kv_bf16);
		free(g->prompts[i].router_rel_gap);
		free(g->prompts[i].router_rel_shift_fast);
	}
	free(g->prompts);
	free(g->dir);
	free(g->name);
	free(g->dtype);
	free(g);
}

int mlens_golden_open(const char *dir, struct mlens_golden **out, char *err, size_t errlen)
{
	struct mlens_golden *g = calloc(1, sizeof(*g));
	char *jpath = path_join(dir, "golden.json");
	struct reader r = { dir, jpath, err, errlen };
	json_t *root = NULL, *ps, *kv, *tol;
	json_error_t je;
	int rc = -ENOMEM;

	*out = NULL;
	if (!g || !jpath || !(g->dir = strdup(dir)))
		goto fail;
	root = json_load_file(jpath, 0, &je);
	if (!root) {
		rc = fail(err, errlen, -EINVAL, "%s:%d: %s", jpath, je.line, je.text);
		goto fail;
	}
	tol = json_object_get(root, "tolerance");
	if ((rc = get_string(&r, root, "name", &g->name)) ||
	    (rc = get_string(&r, root, "dtype", &g->dtype)) ||
	    (rc = get_int(&r, root, "vocab_size", 2, GOLDEN_MAX_VOCAB, &g->vocab)) ||
	    (rc = get_int(&r, root, "n_gen", 1, GOLDEN_MAX_LEN, &g->n_gen)) ||
	    (rc = get_int(&r, root, "n_gen_logits", 1, g->n_gen, &g->n_gen_logits)))
		goto fail;
	if (!json_is_object(tol)) {
		rc = fail(err, errlen, -EINVAL, "%s: 'tolerance' must be an object", jpath);
		goto fail;
	}
	if ((rc = get_real(&r, tol, "prefill", &g->tol_prefill)) ||
	    (rc = get_real(&r, tol, "decode", &g->tol_decode)))
		goto fail;
	kv = json_object_get(root, "kv_bf16");
	g->has_kv_bf16 = kv != NULL;
	if (kv && (rc = get_real(&r, kv, "tolerance", &g->tol_kv_bf16)))
		goto fail;
	ps = json_object_get(root, "prompts");
	if (!json_is_array(ps) || json_array_size(ps) == 0 || json_array_size(ps) > 1024 ||
	    (kv && json_array_size(json_object_get(kv, "prompts")) != json_array_size(ps))) {
		rc = fail(err, errlen, -EINVAL,
			  "%s: 'prompts' (and 'kv_bf16.prompts') must be arrays of equal, non-zero length",
			  jpath);
		goto fail;
	}
	g->prompts = calloc(json_array_size(ps), sizeof(*g->prompts));
	if (!g->prompts) {
		rc = -ENOMEM;
		goto fail;
	}
	for (size_t i = 0; i < json_array_size(ps); i++) {
		struct mlens_golden_prompt *p = &g->prompts[i];
		json_t *o = json_array_get(ps, i);
		g->n_prompts++;
		if (!json_is_object(o)) {
			rc = fail(err, errlen, -EINVAL, "%s: prompts[%zu] must be an object", jpath, i);
			goto fail;
		}
		if ((rc = get_array(&r, o, "tokens", -1, &p->len, &p->tokens, NULL, g->vocab)) ||
		    (rc = get_logits(&r, o, "prefill_logits", p->len, g->vocab, &p->prefill_logits)) ||
		    (rc = read_ref(&r, g, o, &p->main)))
			goto fail;
		if (kv && (rc = read_ref(&r, g, json_array_get(json_object_get(kv, "prompts"), i),
					 &p->kv_bf16)))
			goto fail;
		if (json_object_get(o, "router_rel_gap")) {
			p->n_router = p->len + g->n_gen - 1;
			if ((rc = get_array(&r, o, "router_rel_gap", p->n_router, NULL, NULL,
					    &p->router_rel_gap, 0)) ||
			    (rc = get_array(&r, o, "router_rel_shift_fast", p->n_router, NULL, NULL,
					    &p->router_rel_shift_fast, 0)))
				goto fail;
		}
	}
	json_decref(root);
	free(jpath);
	*out = g;
	return 0;
fail:
	if (rc == -ENOMEM)
		fail(err, errlen, rc, "%s: out of memory", jpath ? jpath : dir);
	json_decref(root);
	free(jpath);
	mlens_golden_close(g);
	return rc;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

int mlens_golden_list(const char *root, char ***dirs, int *n, char *err, size_t errlen)
{
	DIR *d = opendir(root);
	struct dirent *de;
	char **v = NULL;
	int cnt = 0, cap = 0, rc = 0;

	*dirs = NULL;
	*n = 0;
	if (!d)
		return fail(err, errlen, -errno, "%s: %s (set MLENS_SRCDIR to the source tree)", root,
			    strerror(errno));
	while ((de = readdir(d))) {
		char *sub, *js;
		struct stat st;
		if (de->d_name[0] == '.')
			continue;
		sub = path_join(root, de->d_name);
		js = sub ? path_join(sub, "golden.json") : NULL;
		if (!js) {
			free(sub);
			rc = -ENOMEM;
			break;
		}
		if (stat(js, &st) == 0 && S_ISREG(st.st_mode)) {
			if (cnt == cap) {
				char **nv = realloc(v, (size_t)(cap ? 2 * cap : 8) * sizeof(*v));
				if (!nv) {
					free(sub);
					free(js);
					rc = -ENOMEM;
					break;
				}
				v = nv;
				cap = cap ? 2 * cap : 8;
			}
			v[cnt++] = sub;
			sub = NULL;
		}
		free(sub);
		free(js);
	}
	closedir(d);
	if (rc) {
		mlens_golden_list_free(v, cnt);
		return fail(err, errlen, rc, "%s: out of memory", root);
	}
	if (cnt)
		qsort(v, (size_t)cnt, sizeof(*v), cmp_str);
	*dirs = v;
	*n = cnt;
	return 0;
}

void mlens_golden_list_free(char **dirs, int n)
{
	for (int i = 0; i < n; i++)
		free(dirs[i]);
	free(dirs);
}

const char *mlens_golden_root(char *buf, size_t len)
{
	const char *s = getenv("MLENS_SRCDIR");
	if (!s || !*s)
		s = getenv("top_srcdir");
#ifdef MLENS_GOLDEN_SRCDIR
	if (!s || !*s)
		s = MLENS_GOLDEN_SRCDIR;
#endif
	if (!s || !*s)
		s = ".";
	snprintf(buf, len, "%s/tests/golden", s);
	return buf;
}

/* ==== comparing ==== */

double mlens_golden_rel_diff(const float *got, const float *ref, size_t n)
{
	double md = 0, mx = 0;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)got[i] - (double)ref[i]);
		if (!(d <= md))	/* NaN in got counts as infinitely wrong */
			md = isnan(d) ? INFINITY : d;
		mx = fmax(mx, fabs((double)ref[i]));
	}
	return mx > 0 ? md / mx : md;
}

int mlens_golden_safe_steps(const struct mlens_golden *g, const struct mlens_golden_ref *r,
			    double tol)
{
	for (int i = 0; i < g->n_gen; i++)
		if ((double)r->margin[i] <= 2.0 * tol * (double)r->max_abs[i])
			return i;
	return g->n_gen;
}

int mlens_golden_fast_cut(const struct mlens_golden_prompt *p)
{
	double most = 0;
	if (!p->router_rel_gap)
		return -ENOENT;
	for (int i = 0; i < p->n_router; i++) {
		most = fmax(most, (double)p->router_rel_shift_fast[i]);
		if ((double)p->router_rel_gap[i] <= 2.0 * most)
			return i;
	}
	return p->n_router;
}

/* ==== engine runs ==== */

const char *mlens_golden_gpu_side(const char *backend)
{
	if (!strcmp(backend, "hybrid"))
		return "cuda";
	if (!strcmp(backend, "hybrid-cpu"))
		return "cpu";
	return backend;
}

/* The hybrid plan at the least budget that runs a full step cap, which
 * streams every expert of a model of more than two layers. */
static int hybrid_plan(const struct mlens_model *m, int max_tokens, enum mlens_gemm_mode gemm,
		       struct mlens_gpu_plan *out)
{
	struct mlens_perf_model pm;
	struct mlens_gpu_plan_in in = { .budget = UINT64_MAX / 4, .max_tokens = max_tokens,
				       .min_tokens = max_tokens, .gemm = gemm };
	enum mlens_dtype kv = mlens_kv_dtype(&m->cfg, -1);
	int rc = mlens_perf_model_from_config(&pm, &m->cfg, kv);
	if (!rc)
		rc = mlens_gpu_plan_make(&pm, &in, out, NULL, 0);
	if (rc)
		return rc;
	in.budget = out->minimum;
	in.min_tokens = 0;
	return mlens_gpu_plan_make(&pm, &in, out, NULL, 0);
}

int mlens_golden_engine_open(struct mlens_golden_engine *ge, const char *dir,
			     const char *backend, enum mlens_gemm_mode gemm, char *err,
			     size_t errlen)
{
	struct mlens_backend_opts bo = { .n_threads = 2, .device = 0, .gemm = gemm };
	/* prefill through the attention op: the prefill check compares against
	 * the fp32-KV reference, where a prompt attends over its own unrounded
	 * K/V (the cache path is what the decode checks exercise) */
	struct mlens_engine_opts eo = { .kv_dtype = -1, .prefill_attn = MLENS_PREFILL_OP };
	struct mlens_gpu_plan plan;	/* the pipeline keeps a copy */
	int rc;

	memset(ge, 0, sizeof(*ge));
	rc = mlens_backend_create(&ge->be, mlens_golden_gpu_side(backend), &bo);
	if (rc)
		return fail(err, errlen, rc, "backend '%s': %s", backend, strerror(-rc));
	ge->have_be = true;
	rc = mlens_model_open(dir, &ge->m, err, errlen);
	if (rc)
		goto fail;
	if (strcmp(mlens_golden_gpu_side(backend), backend)) {
		rc = mlens_backend_cpu_create(&ge->attn, &bo);
		if (rc) {
			fail(err, errlen, rc, "attention backend: %s", strerror(-rc));
			goto fail;
		}
		ge->have_attn = true;
		eo.attn_backend = &ge->attn;
		rc = hybrid_plan(ge->m, 4096, gemm, &plan);
		eo.plan = &plan;
		if (rc) {
			fail(err, errlen, rc, "%s: no GPU memory plan for the hybrid pipeline", dir);
			goto fail;
		}
	}
	rc = mlens_engine_create(&ge->e, ge->m, &ge->be, &eo, err, errlen);
	if (rc)
		goto fail;
	return 0;
fail:
	mlens_golden_engine_close(ge);
	/* a model or engine fault must not look like a missing backend */
	return rc == -ENOTSUP || rc == -ENODEV ? -EINVAL : rc;
}

void mlens_golden_engine_close(struct mlens_golden_engine *ge)
{
	if (ge->e)
		mlens_engine_destroy(ge->e);
	if (ge->m)
		mlens_model_close(ge->m);
	if (ge->have_be)
		mlens_backend_destroy(&ge->be);
	if (ge->have_attn)
		mlens_backend_destroy(&ge->attn);
	memset(ge, 0, sizeof(*ge));
}

int mlens_golden_generate(struct mlens_golden_engine *ge, const int32_t *tokens, int len,
			  int n_steps, const int32_t *force, int32_t *out, float *logits)
{
	const struct mlens_model_config *c = mlens_engine_config(ge->e);
	struct mlens_seq s = { 0 };
	struct mlens_engine_req r = { 0 };
	int rc = 0;

	r.seq = &s;
	r.tokens = tokens;
	r.n_tokens = len;
	for (int i = 0; i < n_steps; i++) {
		r.logits = logits ? logits + (size_t)i * (size_t)c->vocab_size : NULL;
		r.samp.counter = (uint64_t)i;
		rc = mlens_engine_step(ge->e, &r, 1);
		if (rc)
			break;
		out[i] = r.next_token;
		r.tokens = force ? &force[i] : &out[i];
		r.n_tokens = 1;
	}
	mlens_seq_fini(mlens_engine_kv(ge->e), &s);
	return rc;
}

int mlens_golden_generate_batch(struct mlens_golden_engine *ge, const struct mlens_golden *g,
				int n_steps, int32_t *out, float *logits)
{
	int n = g->n_prompts, rc = 0;
	size_t V = (size_t)g->vocab;
	struct mlens_seq *s = calloc((size_t)n, sizeof(*s));
	struct mlens_engine_req *r = calloc((size_t)n, sizeof(*r));

	if (!s || !r) {
		rc = -ENOMEM;
		goto out;
	}
	for (int i = 0; i < n_steps && !rc; i++) {
		for (int p = 0; p < n; p++) {
			r[p].seq = &s[p];
			r[p].tokens = i ? &out[(size_t)p * n_steps + i - 1] : g->prompts[p].tokens;
			r[p].n_tokens = i ? 1 : g->prompts[p].len;
			r[p].samp = (struct mlens_sampling){ 0 };
			r[p].samp.counter = (uint64_t)i;
			r[p].logits = logits ? logits + ((size_t)p * n_steps + i) * V : NULL;
			r[p].all_logits = false;
		}
		rc = mlens_engine_step(ge->e, r, n);
		for (int p = 0; p < n && !rc; p++)
			out[(size_t)p * n_steps + i] = r[p].next_token;
	}
	for (int p = 0; p < n; p++)
		mlens_seq_fini(mlens_engine_kv(ge->e), &s[p]);
out:
	free(s);
	free(r);
	return rc;
}

int mlens_golden_prefill(struct mlens_golden_engine *ge, const int32_t *tokens, int len,
			 float *logits)
{
	struct mlens_seq s = { 0 };
	struct mlens_engine_req r = { 0 };
	int rc;

	r.seq = &s;
	r.tokens = tokens;
	r.n_tokens = len;
	r.logits = logits;
	r.all_logits = true;
	rc = mlens_engine_step(ge->e, &r, 1);
	mlens_seq_fini(mlens_engine_kv(ge->e), &s);
	return rc;
}
