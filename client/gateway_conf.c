/* mlens-gateway's settings: one table of keys, read from a config file
 * (key = value, as mlensd.conf) and from flags of the same names (dashes
 * for underscores); a flag wins over the file, the file over the default.
 * Also the API key file. */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "client/gateway_int.h"

#define DEFAULT_SOCKET "/run/mlens/mlensd.sock"
#define DEFAULT_LISTEN "127.0.0.1:8000"
#define DEFAULT_MAX_BODY (1u << 20)
#define DEFAULT_MAX_PENDING 256
#define DEFAULT_MAX_N 16
#define MAX_TENANT_NAME 47	/* what mlens_open keeps of a client name */

enum key_type { K_STR, K_SIZE, K_U32 };

struct key {
	const char *name;	/* config key; the flag is the same with dashes */
	enum key_type type;
	size_t off;
	uint64_t min, max;	/* K_SIZE and K_U32 */
	const char *arg, *help;
};

#define OFF(f) offsetof(struct gw_conf, f)
static const struct key keys[] = {
	{ "socket", K_STR, OFF(socket), 0, 0, "PATH",
	  "mlensd's tenant socket (default $MLENS_SOCKET, else " DEFAULT_SOCKET ")" },
	{ "listen", K_STR, OFF(listen), 0, 0, "HOST:PORT",
	  "where to serve HTTP (default " DEFAULT_LISTEN "; port 0 picks one)" },
	{ "model", K_STR, OFF(model), 0, 0, "DIR",
	  "the served model's directory: its tokenizer, template and name" },
	{ "tokenizer", K_STR, OFF(tokenizer), 0, 0, "DIR",
	  "where tokenizer.json and the chat template are (default: --model)" },
	{ "served_model_name", K_STR, OFF(served_model_name), 0, 0, "NAME",
	  "the model's id in /v1/models (default: --model's base name)" },
	{ "api_key_file", K_STR, OFF(api_key_file), 0, 0, "FILE",
	  "lines KEY TENANT_NAME: requests need a key; one tenant a key" },
	{ "max_body", K_SIZE, OFF(max_body), 64, 1ull << 30, "BYTES",
	  "largest request body (default 1M)" },
	{ "max_pending", K_U32, OFF(max_pending), 1, 1u << 20, "N",
	  "requests a tenant holds waiting for ring room before 429 (default 256)" },
	{ "max_n", K_U32, OFF(max_n), 1, 1024, "N", "most choices (n) a request may ask for (default 16)" },
};
#define N_KEYS (sizeof(keys) / sizeof(keys[0]))

static void usage(FILE *f)
{
	char flag[40];

	fprintf(f, "usage: mlens-gateway [-s SOCKET] [--listen HOST:PORT] [--model DIR] [options]\n"
		   "OpenAI-compatible HTTP server in front of mlensd.\n\n");
	for (size_t i = 0; i < N_KEYS; i++) {
		size_t j;

		for (j = 0; keys[i].name[j] && j < sizeof(flag) - 1; j++)
			flag[j] = keys[i].name[j] == '_' ? '-' : keys[i].name[j];
		flag[j] = 0;
		fprintf(f, "  --%s %-*s %s\n", flag, (int)(24 - strlen(flag)), keys[i].arg,
			keys[i].help);
	}
	fprintf(f, "  --config FILE              settings, key = value (keys as the flags, with _)\n"
		   "  -h, --help, -V, --version\n"
		   "Exit status: 0 stopped by SIGTERM or SIGINT, 1 could not serve, 2 usage.\n");
}

static void *field(struct gw_conf *c, const struct key *k)
{
	return (char *)c + k->off;
}

/* A size with an optional K, M or G suffix (powers of 1024). */
static int parse_size(const char *s, uint64_t *out)
{
	char *end;
	unsigned long long v;

	if (!isdigit((unsigned char)*s))
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno)
		return -EINVAL;
	switch (toupper((unsigned char)*end)) {
	case 'K': v <<= 10; end++; break;
	case 'M': v <<= 20; end++; break;
	case 'G': v <<= 30; end++; break;
	default: break;
	}
	if (*end == 'B' || *end == 'b')
		end++;
	if (*end)
		return -EINVAL;
	*out = v;
	return 0;
}

/* Set key k from text v; where names the place for the message. */
static int set_key(struct gw_conf *c, const struct key *k, const char *v, const char *where)
{
	uint64_t n = 0;
	char *end;

	switch (k->type) {
	case K_STR: {
		char **p = field(c, k);
		char *d = strdup(v);

		if (!d)
			return -ENOMEM;
		free(*p);
		*p = d;
		return 0;
	}
	case K_SIZE:
		if (parse_size(v, &n)) {
			fprintf(stderr, "mlens-gateway: %s: '%s' is not a size (bytes, or with K, M, G)\n",
				where, v);
			return -EINVAL;
		}
		break;
	case K_U32:
		errno = 0;
		n = strtoull(v, &end, 10);
		if (!isdigit((unsigned char)*v) || *end || errno) {
			fprintf(stderr, "mlens-gateway: %s: '%s' is not an integer\n", where, v);
			return -EINVAL;
		}
		break;
	}
	if (n < k->min || n > k->max) {
		fprintf(stderr, "mlens-gateway: %s: %llu is outside [%llu, %llu]\n", where,
			(unsigned long long)n, (unsigned long long)k->min,
			(unsigned long long)k->max);
		return -EINVAL;
	}
	if (k->type == K_SIZE)
		*(size_t *)field(c, k) = (size_t)n;
	else
		*(uint32_t *)field(c, k) = (uint32_t)n;
	return 0;
}

static char *trim(char *s)
{
	char *e;

	while (isspace((unsigned char)*s))
		s++;
	e = s + strlen(s);
	while (e > s && isspace((unsigned char)e[-1]))
		*--e = 0;
	return s;
}

static int load_file(struct gw_conf *c, const char *path)
{
	FILE *f = fopen(path, "r");
	char line[4096], where[256];
	unsigned lineno = 0;
	int rc = 0;

	if (!f) {
		fprintf(stderr, "mlens-gateway: cannot open config %s: %s\n", path, strerror(errno));
		return -EINVAL;
	}
	while (!rc && fgets(line, sizeof(line), f)) {
		char *s = trim(line), *eq, *k, *v;
		size_t i;

		lineno++;
		if (!*s || *s == '#')
			continue;
		eq = strchr(s, '=');
		if (!eq) {
			fprintf(stderr, "mlens-gateway: %s:%u: expected 'key = value'\n", path, lineno);
			rc = -EINVAL;
			break;
		}
		*eq = 0;
		k = trim(s);
		v = trim(eq + 1);
		for (i = 0; i < N_KEYS && strcmp(keys[i].name, k); i++)
			;
		if (i == N_KEYS) {
			fprintf(stderr, "mlens-gateway: %s:%u: unknown key '%s'\n", path, lineno, k);
			rc = -EINVAL;
			break;
		}
		snprintf(where, sizeof(where), "%s:%u: key '%s'", path, lineno, k);
		rc = set_key(c, &keys[i], v, where);
	}
	fclose(f);
	return rc;
}

void gw_conf_free(struct gw_conf *c)
{
	for (size_t i = 0; i < N_KEYS; i++)
		if (keys[i].type == K_STR)
			free(*(char **)field(c, &keys[i]));
	memset(c, 0, sizeof(*c));
}

int gw_conf_load(struct gw_conf *c, int argc, char **argv)
{
	struct option opts[N_KEYS + 4];
	char names[N_KEYS][40], where[512];
	const char *env = getenv("MLENS_SOCKET");
	int o, idx;

	memset(c, 0, sizeof(*c));
	c->socket = strdup(env && *env ? env : DEFAULT_SOCKET);
	c->listen = strdup(DEFAULT_LISTEN);
	c->max_body = DEFAULT_MAX_BODY;
	c->max_pending = DEFAULT_MAX_PENDING;
	c->max_n = DEFAULT_MAX_N;
	if (!c->socket || !c->listen)
		return -ENOMEM;
	for (size_t i = 0; i < N_KEYS; i++) {
		size_t j;

		for (j = 0; keys[i].name[j] && j < sizeof(names[i]) - 1; j++)
			names[i][j] = keys[i].name[j] == '_' ? '-' : keys[i].name[j];
		names[i][j] = 0;
		opts[i] = (struct option){ names[i], required_argument, NULL, 256 + (int)i };
	}
	opts[N_KEYS] = (struct option){ "config", required_argument, NULL, 'c' };
	opts[N_KEYS + 1] = (struct option){ "help", no_argument, NULL, 'h' };
	opts[N_KEYS + 2] = (struct option){ "version", no_argument, NULL, 'V' };
	opts[N_KEYS + 3] = (struct option){ 0 };

	/* the file first, whatever its place among the flags */
	opterr = 0;
	optind = 1;
	while ((o = getopt_long(argc, argv, "s:l:m:c:hV", opts, &idx)) != -1)
		if (o == 'c' && load_file(c, optarg))
			return -EINVAL;
	opterr = 1;
	optind = 1;
	while ((o = getopt_long(argc, argv, "s:l:m:c:hV", opts, &idx)) != -1) {
		const struct key *k = NULL;

		switch (o) {
		case 's': k = &keys[0]; break;
		case 'l': k = &keys[1]; break;
		case 'm': k = &keys[2]; break;
		case 'c': continue;
		case 'h': usage(stdout); return 1;
		case 'V': printf("mlens-gateway %s\n", PACKAGE_VERSION); return 1;
		default:
			if (o >= 256 && o < 256 + (int)N_KEYS) {
				k = &keys[o - 256];
				break;
			}
			usage(stderr);
			return -EINVAL;
		}
		snprintf(where, sizeof(where), "option '--%s'", names[k - keys]);
		if (set_key(c, k, optarg, where))
			return -EINVAL;
	}
	if (optind < argc) {
		fprintf(stderr, "mlens-gateway: unexpected argument '%s'\n", argv[optind]);
		usage(stderr);
		return -EINVAL;
	}
	return 0;
}

/* ==== API keys ==== */

void gw_keys_free(struct gw_key *k, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		free(k[i].key);
		free(k[i].tenant);
	}
	free(k);
}

static int key_fail(FILE *f, struct gw_key *k, size_t n, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static int key_fail(FILE *f, struct gw_key *k, size_t n, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("mlens-gateway: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	fclose(f);
	gw_keys_free(k, n);
	return -EINVAL;
}

int gw_keys_load(const char *path, struct gw_key **out, size_t *n_out)
{
	FILE *f = fopen(path, "r");
	struct gw_key *k = NULL;
	size_t n = 0;
	char line[1024];
	unsigned lineno = 0;
	struct stat st;

	if (!f) {
		fprintf(stderr, "mlens-gateway: cannot open API key file %s: %s\n", path,
			strerror(errno));
		return -EINVAL;
	}
	if (!fstat(fileno(f), &st) && (st.st_mode & 077))
		fprintf(stderr, "mlens-gateway: warning: API key file %s can be read by other "
			"users (mode %04o): chmod 600 it\n", path, (unsigned)(st.st_mode & 07777));
	while (fgets(line, sizeof(line), f)) {
		char *s = trim(line), *key, *name, *rest;
		struct gw_key *nk;

		lineno++;
		if (!*s || *s == '#')
			continue;
		key = strtok_r(s, " \t", &rest);
		name = strtok_r(NULL, " \t", &rest);
		if (!name || strtok_r(NULL, " \t", &rest))
			return key_fail(f, k, n, "%s:%u: expected 'KEY TENANT_NAME'", path, lineno);
		if (strlen(key) < 8)
			return key_fail(f, k, n, "%s:%u: a key of fewer than 8 characters is "
					"too easy to guess", path, lineno);
		if (strlen(name) > MAX_TENANT_NAME)
			return key_fail(f, k, n, "%s:%u: tenant name '%s' longer than %d bytes",
					path, lineno, name, MAX_TENANT_NAME);
		for (size_t i = 0; i < n; i++) {
			if (!strcmp(k[i].key, key))
				return key_fail(f, k, n, "%s:%u: this key is also tenant %s's; "
						"one key a tenant", path, lineno, k[i].tenant);
			if (!strcmp(k[i].tenant, name))
				return key_fail(f, k, n, "%s:%u: tenant '%s' has two keys; "
						"one key a tenant", path, lineno, name);
		}
		nk = realloc(k, (n + 1) * sizeof(*k));
		if (!nk)
			return key_fail(f, k, n, "out of memory");
		k = nk;
		k[n].key = strdup(key);
		k[n].tenant = strdup(name);
		n++;
		if (!k[n - 1].key || !k[n - 1].tenant)
			return key_fail(f, k, n, "out of memory");
	}
	fclose(f);
	if (!n) {
		fprintf(stderr, "mlens-gateway: API key file %s holds no keys\n", path);
		free(k);
		return -EINVAL;
	}
	*out = k;
	*n_out = n;
	return 0;
}
