/* The hybrid pipeline's bookkeeping (DESIGN §5, §5.1): which expert slot
 * holds which layer, which events gate what, and the ~100 MB pieces a
 * layer's streamed experts move in. Pure: it builds a step's program, an
 * ordered list of commands on three queues (GPU compute, H2D copy, host),
 * that the executor (daemon/exec/pipeline.c) runs and that tests run on a
 * simulated device. Program order is itself a valid sequential order, so
 * an executor without streams runs the commands one after another.
 *
 * The program of a step (L layers, G token groups; slot(l) = l mod 2; S
 * activation sets, two or three: MLENS_PIPE_THREE_SETS). The step's
 * (layer, group) items run in the order (0,0) (0,1) .. (0,G-1) (1,0) ..;
 * GA runs a = min(S - 1, G - 1) items ahead of GB (a GA of layer l + 1
 * needs the GB of its group in layer l, a items back at most), and item i
 * uses activation set(i) = i mod (a + 1) (always 0 when G = 1), so that
 * only a + 1 <= S groups' activations live at once however many groups a
 * step has:
 *   HEAD                                    GPU: embeddings of all tokens
 *   stream layers 0 and 1 into slots 0, 1   COPY queue (see below), unless
 *                                           the last step prefetched them
 *   GA(item j), RECORD(GPU, qkv[set j]) for j < a (at least item 0)
 *                                           GPU: norm, QKV, RoPE, prefill
 *                                           attention, D2H of K/V and q
 *   for each item i = (l, x):
 *     when G > 1: GA(item i+a), RECORD(GPU, qkv[set(i+a)])
 *     HOST_WAIT(qkv[set(i)]), C(l, x)   host: KV append (unless GA stored
 *                    K/V into the pool itself) and decode attention on the
 *                    CPU pool; queues the H2D of its output
 *     WAIT(GPU, ready[slot(l)])              (before layer l's first GB)
 *     GB(l, x)       GPU: O projection, norm, router, experts
 *     after the last group: RECORD(GPU, freed[slot(l)]) and, when l+2 < L,
 *       stream layer l+2 into slot(l) (else, with MLENS_PIPE_PREFETCH,
 *       layer l mod 2 for the next step)
 *     when G = 1: GA(item i+1), RECORD(GPU, qkv[0])
 *   TAIL                                    GPU: final norm, lm_head, sampling
 * "stream layer m into slot s" = WAIT(COPY, freed[s]), COPY of each piece
 * of layer m, RECORD(COPY, ready[s]). So GB(l) runs only after all of
 * layer l's pieces arrived, a slot is overwritten only after every GB of
 * the layer it held, each layer crosses PCIe once per step however many
 * groups use it, and the CPU attention of item i runs while the GPU does
 * GA of item i+a and GB of item i-1 (with a = 2, GA(i+1) and GB(i-2)
 * before them too: the copies down, C and its upload have two items of
 * GPU work to hide in rather than one). A set is rewritten by GA(i+a+1),
 * issued in item i+1, only after GB(i) (queue order) and after C(i) read
 * its host copies (C(i) ran before it was issued). Without
 * streamed experts (all resident) there are no COPY, ready or freed
 * commands.
 *
 * Driven from a thread per queue (host, GPU, copy: the mover), each
 * taking its commands in program order and waiting only for each
 * command's dep, C(i) runs while the GPU side issues (and, where an op
 * waits for the GPU, waits through) GB(i-1) and GA(i+1), and the mover
 * queues a layer's pieces as soon as the slot's freed record is issued. */
#ifndef MLENS_PIPEPROG_H
#define MLENS_PIPEPROG_H

#include <stddef.h>
#include <stdint.h>

/* Piece size of the weight stream (DESIGN §1: ~100 MB). */
#define MLENS_PIPE_PIECE (100ull << 20)
/* Groups per step: each holds at most the plan's group rows, so a large
 * step has many; two or three activation sets serve them all. */
#define MLENS_PIPE_MAX_GROUPS 512
#define MLENS_PIPE_SETS 2
#define MLENS_PIPE_SETS_MAX 3

enum mlens_pipe_queue {
	MLENS_PIPE_Q_GPU = 0,	/* compute stream (also activation copies) */
	MLENS_PIPE_Q_COPY,	/* weight stream */
	MLENS_PIPE_Q_HOST,	/* the driving thread */
	MLENS_PIPE_Q_N
};

enum mlens_pipe_kind {
	MLENS_PIPE_HEAD,
	MLENS_PIPE_GA,
	MLENS_PIPE_C,
	MLENS_PIPE_GB,
	MLENS_PIPE_TAIL,
	MLENS_PIPE_COPY,	/* piece of layer's experts into slot */
	MLENS_PIPE_RECORD,	/* queue records event */
	MLENS_PIPE_WAIT,	/* queue (GPU or COPY) waits for event */
	MLENS_PIPE_HOST_WAIT,	/* host waits for event */
};

/* Events: ready[s] and freed[s] per slot, qkv[x] per activation set. */
enum {
	MLENS_PIPE_EV_READY = 0,
	MLENS_PIPE_EV_FREED = 2,
	MLENS_PIPE_EV_QKV = 4,
	MLENS_PIPE_EV_N = MLENS_PIPE_EV_QKV + MLENS_PIPE_SETS_MAX
};

struct mlens_pipe_cmd {
	enum mlens_pipe_kind kind;
	enum mlens_pipe_queue queue;
	int layer;		/* -1 when none */
	int group;		/* -1 when none */
	int set;		/* GA, C, GB: activation set of the item; -1 otherwise */
	int slot;		/* COPY; -1 otherwise */
	int piece;		/* COPY: index into the layer's pieces */
	int event;		/* RECORD, WAIT, HOST_WAIT; -1 otherwise */
	/* COPY: for the next step (MLENS_PIPE_PREFETCH), not this one */
	bool next_step;
	/* Index of the command of another queue that must have been issued
	 * or run before this one, for an executor that drives each queue from
	 * a thread of its own: HOST_WAIT and WAIT depend on the RECORD they
	 * wait for (when another queue records it), GB on the C of its item;
	 * -1 for none. Program order satisfies every dep. */
	int dep;
};

struct mlens_pipe_prog {
	struct mlens_pipe_cmd *cmd;
	int n, cap;
};

/* Build the program of a step. n_pieces[l] is the number of pieces of
 * layer l (NULL or all 0: nothing streams). groups is 1 to
 * MLENS_PIPE_MAX_GROUPS.
 * -EINVAL, -ENOMEM. */
int mlens_pipe_prog_build(struct mlens_pipe_prog *p, int layers, int groups,
			  const int *n_pieces);
/* Flags of mlens_pipe_prog_build_ex. PREFETCH: once the last layer using a
 * slot is done with it, stream the first layer that needs it next step
 * (layers 0 and 1), so the next step starts with its first two layers in
 * place instead of waiting for them; RESIDENT01: the previous step did
 * that (its copies and ready events stand), so this step streams only
 * layers 2 and up. Each layer still crosses PCIe once per step. */
#define MLENS_PIPE_PREFETCH 1u
#define MLENS_PIPE_RESIDENT01 2u
/* Three activation sets rather than two, GA two items ahead of GB where a
 * layer has three groups or more (see the program above). */
#define MLENS_PIPE_THREE_SETS 4u
/* The activation sets a program built with flags uses. */
static inline int mlens_pipe_sets(unsigned flags)
{
	return flags & MLENS_PIPE_THREE_SETS ? 3 : MLENS_PIPE_SETS;
}
int mlens_pipe_prog_build_ex(struct mlens_pipe_prog *p, int layers, int groups,
			     const int *n_pieces, unsigned flags);
void mlens_pipe_prog_free(struct mlens_pipe_prog *p);

/* One streamed tensor of a layer: host bytes and where they go in the slot. */
struct mlens_pipe_src {
	const void *host;
	uint64_t dst_off;
	uint64_t bytes;
};

/* One copy: host [host, host + bytes) to slot [dst_off, dst_off + bytes). */
struct mlens_pipe_piece {
	const void *host;
	uint64_t dst_off;
	uint64_t bytes;
};

/* Split a layer's tensors into pieces of at most piece bytes: tensors
 * adjacent both in host memory and in the slot are merged first, so that a
 * layer stored contiguously moves in ceil(bytes / piece) copies. Writes at
 * most cap pieces; returns the count needed (call with cap 0 to size), or
 * -EINVAL for piece 0. */
int mlens_pipe_pieces(const struct mlens_pipe_src *src, int n, uint64_t piece,
		      struct mlens_pipe_piece *out, int cap);

const char *mlens_pipe_kind_name(enum mlens_pipe_kind k);

#endif
