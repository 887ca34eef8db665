/* The hybrid pipeline's step program and weight pieces (see pipeprog.h for
 * the program's shape and why it is correct in program order). */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include "daemon/exec/pipeprog.h"

static int push(struct mlens_pipe_prog *p, enum mlens_pipe_kind kind, enum mlens_pipe_queue q,
		int layer, int group, int slot, int piece, int event)
{
	struct mlens_pipe_cmd *c;
	if (p->n == p->cap) {
		int ncap = p->cap ? p->cap * 2 : 64;
		c = realloc(p->cmd, (size_t)ncap * sizeof(*c));
		if (!c)
			return -ENOMEM;
		p->cmd = c;
		p->cap = ncap;
	}
	c = &p->cmd[p->n++];
	c->kind = kind;
	c->queue = q;
	c->layer = layer;
	c->group = group;
	c->slot = slot;
	c->piece = piece;
	c->event = event;
	c->set = -1;
	c->dep = -1;
	c->next_step = false;
	return 0;
}

#define PUSH(...) do { if ((rc = push(p, __VA_ARGS__))) goto fail; } while (0)

/* WAIT(COPY, freed[s]), the pieces of layer m, RECORD(COPY, ready[s]). */
static int stream_layer(struct mlens_pipe_prog *p, int m, int n_pieces, bool next)
{
	int s = m % 2, rc;
	PUSH(MLENS_PIPE_WAIT, MLENS_PIPE_Q_COPY, -1, -1, -1, -1, MLENS_PIPE_EV_FREED + s);
	for (int i = 0; i < n_pieces; i++) {
		PUSH(MLENS_PIPE_COPY, MLENS_PIPE_Q_COPY, m, -1, s, i, -1);
		p->cmd[p->n - 1].next_step = next;
	}
	PUSH(MLENS_PIPE_RECORD, MLENS_PIPE_Q_COPY, -1, -1, -1, -1, MLENS_PIPE_EV_READY + s);
	return 0;
fail:
	return rc;
}

/* GA of item i and the record its C waits for (its index in *rec). */
static int push_ga(struct mlens_pipe_prog *p, int i, int groups, int sets, int *rec)
{
	int set = i % sets, rc;
	PUSH(MLENS_PIPE_GA, MLENS_PIPE_Q_GPU, i / groups, i % groups, -1, -1, -1);
	p->cmd[p->n - 1].set = set;
	PUSH(MLENS_PIPE_RECORD, MLENS_PIPE_Q_GPU, i / groups, i % groups, -1, -1,
	     MLENS_PIPE_EV_QKV + set);
	rec[set] = p->n - 1;
	return 0;
fail:
	return rc;
}

int mlens_pipe_prog_build(struct mlens_pipe_prog *p, int layers, int groups,
			  const int *n_pieces)
{
	return mlens_pipe_prog_build_ex(p, layers, groups, n_pieces, 0);
}

int mlens_pipe_prog_build_ex(struct mlens_pipe_prog *p, int layers, int groups,
			     const int *n_pieces, unsigned flags)
{
	bool streams = false;
	int rc, items, rec[MLENS_PIPE_SETS_MAX] = { -1, -1, -1 }, c_at;
	int sets = mlens_pipe_sets(flags);
	/* items GA runs ahead of GB: at most groups - 1, so that a GA of the
	 * next layer follows the GB of its group in this one; sets in use:
	 * one more than that (one when a layer is one group) */
	int ahead = groups > 1 ? (sets - 1 < groups - 1 ? sets - 1 : groups - 1) : 0;
	sets = ahead + 1;

	p->n = 0;
	if (layers <= 0 || groups < 1 || groups > MLENS_PIPE_MAX_GROUPS)
		return -EINVAL;
	for (int l = 0; n_pieces && l < layers; l++) {
		if (n_pieces[l] < 0)
			return -EINVAL;
		streams |= n_pieces[l] > 0;
	}
	items = layers * groups;
	PUSH(MLENS_PIPE_HEAD, MLENS_PIPE_Q_GPU, -1, -1, -1, -1, -1);
	for (int m = 0; streams && !(flags & MLENS_PIPE_RESIDENT01) && m < 2 && m < layers; m++)
		if ((rc = stream_layer(p, m, n_pieces[m], false)))
			goto fail;
	for (int j = 0; j < (ahead > 1 ? ahead : 1) && j < items; j++)
		if ((rc = push_ga(p, j, groups, sets, rec)))
			goto fail;
	for (int i = 0; i < items; i++) {
		int l = i / groups, x = i % groups, set = i % sets;
		if (ahead && i + ahead < items && (rc = push_ga(p, i + ahead, groups, sets, rec)))
			goto fail;
		PUSH(MLENS_PIPE_HOST_WAIT, MLENS_PIPE_Q_HOST, l, x, -1, -1, MLENS_PIPE_EV_QKV + set);
		p->cmd[p->n - 1].dep = rec[set];
		PUSH(MLENS_PIPE_C, MLENS_PIPE_Q_HOST, l, x, -1, -1, -1);
		p->cmd[p->n - 1].set = set;
		c_at = p->n - 1;
		if (streams && x == 0)
			PUSH(MLENS_PIPE_WAIT, MLENS_PIPE_Q_GPU, l, -1, -1, -1, MLENS_PIPE_EV_READY + l % 2);
		PUSH(MLENS_PIPE_GB, MLENS_PIPE_Q_GPU, l, x, -1, -1, -1);
		p->cmd[p->n - 1].set = set;
		p->cmd[p->n - 1].dep = c_at;
		if (streams && x == groups - 1) {
			PUSH(MLENS_PIPE_RECORD, MLENS_PIPE_Q_GPU, l, -1, -1, -1,
			     MLENS_PIPE_EV_FREED + l % 2);
			rc = 0;
			if (l + 2 < layers)
				rc = stream_layer(p, l + 2, n_pieces[l + 2], false);
			else if (flags & MLENS_PIPE_PREFETCH)	/* the slot's next user: layer l % 2 */
				rc = stream_layer(p, l % 2, n_pieces[l % 2], true);
			if (rc)
				goto fail;
		}
		if (groups == 1 && i + 1 < items && (rc = push_ga(p, i + 1, groups, sets, rec)))
			goto fail;
	}
	PUSH(MLENS_PIPE_TAIL, MLENS_PIPE_Q_GPU, -1, -1, -1, -1, -1);
	/* a queue's WAIT depends on the RECORD it waits for when another
	 * queue records it (none in this program: the step before's, done) */
	{
		int last[MLENS_PIPE_EV_N];
		for (int e = 0; e < MLENS_PIPE_EV_N; e++)
			last[e] = -1;
		for (int i = 0; i < p->n; i++) {
			struct mlens_pipe_cmd *c = &p->cmd[i];
			if (c->kind == MLENS_PIPE_RECORD)
				last[c->event] = i;
			else if (c->kind == MLENS_PIPE_WAIT && last[c->event] >= 0 &&
				 p->cmd[last[c->event]].queue != c->queue)
				c->dep = last[c->event];
		}
	}
	return 0;
fail:
	p->n = 0;
	return rc;
}

void mlens_pipe_prog_free(struct mlens_pipe_prog *p)
{
	free(p->cmd);
	p->cmd = NULL;
	p->n = p->cap = 0;
}

int mlens_pipe_pieces(const struct mlens_pipe_src *src, int n, uint64_t piece,
		      struct mlens_pipe_piece *out, int cap)
{
	int count = 0;
	if (!piece)
		return -EINVAL;
	for (int i = 0; i < n;) {
		/* a run of tensors adjacent in host memory and in the slot */
		const char *h = src[i].host;
		uint64_t d = src[i].dst_off, len = src[i].bytes;
		int j = i + 1;
		while (j < n && (const char *)src[j].host == h + len && src[j].dst_off == d + len) {
			len += src[j].bytes;
			j++;
		}
		for (uint64_t off = 0; off < len; off += piece) {
			uint64_t b = len - off < piece ? len - off : piece;
			if (count < cap) {
				out[count].host = h + off;
				out[count].dst_off = d + off;
				out[count].bytes = b;
			}
			count++;
		}
		i = j;
	}
	return count;
}

const char *mlens_pipe_kind_name(enum mlens_pipe_kind k)
{
	static const char *const names[] = { "HEAD", "GA", "C", "GB", "TAIL", "COPY",
					     "RECORD", "WAIT", "HOST_WAIT" };
	return (unsigned)k < sizeof(names) / sizeof(names[0]) ? names[k] : "?";
}
