/* Description: the hybrid pipeline's step program (daemon/exec/pipeprog.c) on
 * a simulated device (queues with clocks, events with times, the host
 * blocking on events): GB(l) starts after every piece of layer l arrived,
 * a slot is overwritten only after every GB of the layer it held, each
 * layer's pieces cross once, the CPU attention of one group overlaps GPU
 * work of the other, and the weight stream hides behind compute. The
 * weight pieces: merged when adjacent, at most the piece size, covering
 * every byte once. */
#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include "daemon/exec/pipeprog.h"
#include "tests/check_common.h"

/* ==== the program on a simulated device ==== */

struct span {
	double start, end;
	bool done;
};

struct sim {
	int layers, groups;
	const int *pieces;
	double t_ga, t_gb, t_c, t_piece;
	/* the link: a C starts t_lat after its GA's record (the copies
	 * down), a GB t_lat after its C ended (the upload) */
	double t_lat;
	/* results */
	struct span ga[16][8], gb[16][8], c[16][8];
	int set_ga[16][8], set_c[16][8], set_gb[16][8];
	struct span copy[16][64];
	int copies[16][64];
	struct span pre[2][64];		/* next-step copies of layers 0, 1 */
	int pre_n[2];
	int copy_slot[16][64];
	double makespan;
};

/* A simulated device for a program of `layers` layers in `groups` groups
 * whose layers move in pieces[l] copies: GA, GB, C and one piece take the
 * given times. */
static struct sim *sim_new(int layers, int groups, const int *pieces, double t_ga, double t_gb,
			   double t_c, double t_piece)
{
	struct sim *s = calloc(1, sizeof(*s));
	ck_assert_ptr_nonnull(s);
	s->layers = layers;
	s->groups = groups;
	s->pieces = pieces;
	s->t_ga = t_ga;
	s->t_gb = t_gb;
	s->t_c = t_c;
	s->t_piece = t_piece;
	return s;
}

/* Queues run their commands in order; an enqueued command starts no
 * earlier than the host reached it; RECORD stamps the queue's time at that
 * point; WAIT moves a queue's clock to the event's stamp (an event never
 * recorded is already complete, as in CUDA). */
static void simulate(struct sim *s, const struct mlens_pipe_prog *p)
{
	double q[MLENS_PIPE_Q_N] = { 0 }, ev[MLENS_PIPE_EV_N] = { 0 };
	double host = 0;

	for (int i = 0; i < p->n; i++) {
		const struct mlens_pipe_cmd *c = &p->cmd[i];
		double dur = 0, start;
		struct span *sp = NULL;
		switch (c->kind) {
		case MLENS_PIPE_RECORD:
			ev[c->event] = q[c->queue] > host ? q[c->queue] : host;
			continue;
		case MLENS_PIPE_WAIT:
			ck_assert_int_ne(c->queue, MLENS_PIPE_Q_HOST);
			if (ev[c->event] > q[c->queue])
				q[c->queue] = ev[c->event];
			continue;
		case MLENS_PIPE_HOST_WAIT:
			if (ev[c->event] + s->t_lat > host)
				host = ev[c->event] + s->t_lat;
			continue;
		case MLENS_PIPE_HEAD:
		case MLENS_PIPE_TAIL:
			dur = 1;
			break;
		case MLENS_PIPE_GA:
			dur = s->t_ga;
			sp = &s->ga[c->layer][c->group];
			s->set_ga[c->layer][c->group] = c->set;
			break;
		case MLENS_PIPE_GB:
			dur = s->t_gb;
			sp = &s->gb[c->layer][c->group];
			s->set_gb[c->layer][c->group] = c->set;
			break;
		case MLENS_PIPE_C:
			dur = s->t_c;
			sp = &s->c[c->layer][c->group];
			s->set_c[c->layer][c->group] = c->set;
			break;
		case MLENS_PIPE_COPY:
			ck_assert_int_lt(c->piece, s->pieces[c->layer]);
			dur = s->t_piece;
			if (c->next_step) {
				ck_assert_int_lt(c->layer, 2);
				ck_assert_int_eq(c->slot, c->layer % 2);
				sp = &s->pre[c->layer][c->piece];
				s->pre_n[c->layer]++;
				break;
			}
			sp = &s->copy[c->layer][c->piece];
			s->copies[c->layer][c->piece]++;
			s->copy_slot[c->layer][c->piece] = c->slot;
			break;
		}
		if (c->queue == MLENS_PIPE_Q_HOST) {
			start = host;
			host += dur;
		} else {
			start = q[c->queue] > host ? q[c->queue] : host;
			if (c->kind == MLENS_PIPE_GB && s->c[c->layer][c->group].end + s->t_lat > start)
				start = s->c[c->layer][c->group].end + s->t_lat;
			q[c->queue] = start + dur;
		}
		if (sp) {
			ck_assert_msg(!sp->done, "%s layer %d group %d runs twice",
				      mlens_pipe_kind_name(c->kind), c->layer, c->group);
			sp->start = start;
			sp->end = start + dur;
			sp->done = true;
		}
		if (start + dur > s->makespan)
			s->makespan = start + dur;
	}
}

static void check_order(const struct sim *s)
{
	int L = s->layers, G = s->groups;
	for (int l = 0; l < L; l++) {
		for (int x = 0; x < G; x++) {
			ck_assert(s->ga[l][x].done && s->gb[l][x].done && s->c[l][x].done);
			ck_assert_msg(s->c[l][x].start >= s->ga[l][x].end, "C(%d,%d) before its GA", l, x);
			ck_assert_msg(s->gb[l][x].start >= s->c[l][x].end, "GB(%d,%d) before its C", l, x);
			if (l + 1 < L)
				ck_assert(s->ga[l + 1][x].start >= s->gb[l][x].end);
			for (int i = 0; i < s->pieces[l]; i++)
				ck_assert_msg(s->gb[l][x].start >= s->copy[l][i].end,
					      "GB(%d,%d) starts before piece %d of its experts arrived", l,
					      x, i);
			/* an item keeps its activation set through GA, C and GB */
			ck_assert_int_eq(s->set_c[l][x], s->set_ga[l][x]);
			ck_assert_int_eq(s->set_gb[l][x], s->set_ga[l][x]);
			ck_assert(s->set_ga[l][x] >= 0 && s->set_ga[l][x] < MLENS_PIPE_SETS_MAX);
			/* the set is rewritten (GA of a later item) only after this
			 * item finished with it: its C read the host copies, its GB
			 * the GPU buffers */
			for (int j = l * G + x + 1; j < L * G; j++) {
				int lj = j / G, xj = j % G;
				if (s->set_ga[lj][xj] != s->set_ga[l][x])
					continue;
				ck_assert_msg(s->ga[lj][xj].start >= s->gb[l][x].end &&
					      s->ga[lj][xj].start >= s->c[l][x].end,
					      "GA(%d,%d) rewrites set %d before item (%d,%d) is done", lj,
					      xj, s->set_ga[l][x], l, x);
				break;
			}
		}
		for (int i = 0; i < s->pieces[l]; i++) {
			ck_assert_int_eq(s->copies[l][i], 1);
			ck_assert_int_eq(s->copy_slot[l][i], l % 2);
			/* the slot's previous layer is finished with it */
			for (int x = 0; l >= 2 && x < G; x++)
				ck_assert_msg(s->copy[l][i].start >= s->gb[l - 2][x].end,
					      "layer %d piece %d overwrites slot %d before GB(%d,%d) ended",
					      l, i, l % 2, l - 2, x);
		}
	}
}

START_TEST(prog_two_groups)
{
	static const int pieces[6] = { 3, 3, 3, 3, 3, 3 };
	struct mlens_pipe_prog p = { 0 };
	/* a piece takes 3: 9 per layer, the stream binds (GPU 10 per layer) */
	struct sim *s = sim_new(6, 2, pieces, 1, 4, 3, 3);
	bool overlap = false;

	ck_assert_int_eq(mlens_pipe_prog_build(&p, 6, 2, pieces), 0);
	simulate(s, &p);
	check_order(s);
	/* CPU attention of one group overlaps GPU work of the other */
	for (int l = 0; l < 6; l++) {
		const struct span *c = &s->c[l][1];
		const struct span *g = &s->gb[l][0];
		overlap |= c->start < g->end && g->start < c->end;
	}
	ck_assert(overlap);
	/* nothing serialises: far below the sum of all work (6 x (10 + 6 + 9)) */
	ck_assert_msg(s->makespan < 0.75 * 6 * (10 + 6 + 9), "makespan %.1f", s->makespan);
	mlens_pipe_prog_free(&p);
	free(s);
}
END_TEST

/* Many groups: two activation sets serve them all, CPU attention of each
 * group overlaps GPU work of its neighbours, and the stream still moves
 * each layer once. */
START_TEST(prog_many_groups)
{
	static const int pieces[4] = { 2, 2, 2, 2 };
	struct mlens_pipe_prog p = { 0 };
	int overlaps = 0, ga = 0;

	for (int G = 1; G <= 8; G++) {
		struct sim *s = sim_new(4, G, pieces, 1, 2, 2, 1);
		ck_assert_int_eq(mlens_pipe_prog_build(&p, 4, G, pieces), 0);
		simulate(s, &p);
		check_order(s);
		for (int l = 0; G > 1 && l < 4; l++)
			for (int x = 1; x < G; x++) {
				const struct span *c = &s->c[l][x], *g = &s->gb[l][x - 1];
				overlaps += c->start < g->end && g->start < c->end;
			}
		if (G == 5) {
			for (int i = 0; i < p.n; i++)
				ga += p.cmd[i].kind == MLENS_PIPE_GA;
			ck_assert_int_eq(ga, 4 * 5);
		}
		free(s);
	}
	ck_assert_int_gt(overlaps, 0);
	mlens_pipe_prog_free(&p);
}
END_TEST

/* Two commands alike field by field (memcmp would read their padding,
 * which the builder leaves as realloc gave it). */
static bool cmd_eq(const struct mlens_pipe_cmd *a, const struct mlens_pipe_cmd *b)
{
	return a->kind == b->kind && a->queue == b->queue && a->layer == b->layer &&
	       a->group == b->group && a->set == b->set && a->slot == b->slot &&
	       a->piece == b->piece && a->event == b->event && a->next_step == b->next_step &&
	       a->dep == b->dep;
}

/* Three activation sets (MLENS_PIPE_THREE_SETS): with three groups or
 * more GA runs two items ahead of GB (GA(i+2) comes before GB(i) in the
 * program), each set is rewritten only after the item before finished
 * with it (check_order), all three are used; with two groups or one the
 * program is the two-set one. And what it is for: where the copies down
 * and the upload take time (t_lat), C and its links hide behind two items
 * of GPU work: a step of 8 groups ends sooner than with two sets, and
 * no later anywhere. */
START_TEST(prog_three_sets)
{
	static const int pieces[4] = { 2, 2, 2, 2 };
	struct mlens_pipe_prog p = { 0 }, q = { 0 };

	for (int G = 1; G <= 8; G++) {
		int ga_at[4][8], used[3] = { 0, 0, 0 };
		for (int lat = 0; lat < 2; lat++) {
			struct sim *s3 = sim_new(4, G, pieces, 1, 4, 4, 1);
			struct sim *s2 = sim_new(4, G, pieces, 1, 4, 4, 1);
			s3->t_lat = s2->t_lat = lat;
			ck_assert_int_eq(mlens_pipe_prog_build_ex(&p, 4, G, pieces,
								  MLENS_PIPE_THREE_SETS), 0);
			ck_assert_int_eq(mlens_pipe_prog_build_ex(&q, 4, G, pieces, 0), 0);
			simulate(s3, &p);
			check_order(s3);
			simulate(s2, &q);
			check_order(s2);
			ck_assert_msg(s3->makespan <= s2->makespan + 1e-9, "G %d lat %d: %.1f vs %.1f", G,
				      lat, s3->makespan, s2->makespan);
			if (G == 8 && lat)
				ck_assert_msg(s3->makespan < 0.95 * s2->makespan, "8 groups: %.1f vs %.1f",
					      s3->makespan, s2->makespan);
			if (G <= 2) {	/* nothing to look ahead into: the same program */
				ck_assert_int_eq(p.n, q.n);
				for (int i = 0; i < p.n; i++)
					ck_assert_msg(cmd_eq(&p.cmd[i], &q.cmd[i]), "G %d: command %d differs",
						      G, i);
			}
			free(s3);
			free(s2);
		}
		for (int i = 0; i < p.n; i++) {
			const struct mlens_pipe_cmd *c = &p.cmd[i];
			if (c->kind == MLENS_PIPE_GA) {
				ga_at[c->layer][c->group] = i;
				used[c->set]++;
			} else if (c->kind == MLENS_PIPE_GB && G >= 3) {
				int j = c->layer * G + c->group + 2;
				if (j < 4 * G)
					ck_assert_msg(ga_at[j / G][j % G] < i, "G %d: GA of item %d after GB(%d,%d)",
						      G, j, c->layer, c->group);
			}
		}
		for (int k = 0; k < 3; k++)
			ck_assert_int_eq(used[k] > 0, G >= 3 || (G == 2 && k < 2) || k == 0);
	}
	mlens_pipe_prog_free(&p);
	mlens_pipe_prog_free(&q);
}
END_TEST

/* Prefetch for the next step: layers 0 and 1 stream once their slot's
 * last user of this step is done, and a step built with RESIDENT01 streams
 * only layers 2 and up; chained steps keep every slot hazard-free. */
START_TEST(prog_prefetch_next_step)
{
	static const int pieces[5] = { 2, 3, 2, 3, 2 };
	struct mlens_pipe_prog p = { 0 };

	for (int L = 1; L <= 5; L++) {
		for (int G = 1; G <= 3; G++) {
			struct sim *s = sim_new(L, G, pieces, 1, 1, 1, 1);
			ck_assert_int_eq(mlens_pipe_prog_build_ex(&p, L, G, pieces, MLENS_PIPE_PREFETCH |
								  MLENS_PIPE_RESIDENT01), 0);
			/* layers 0 and 1 are in place: mark them arrived at time 0 */
			for (int m = 0; m < 2 && m < L; m++)
				for (int i = 0; i < pieces[m]; i++) {
					s->copies[m][i] = 1;
					s->copy_slot[m][i] = m;
					s->copy[m][i].done = true;
				}
			simulate(s, &p);
			check_order(s);
			for (int m = 0; m < 2; m++) {
				int last = -1;	/* the last layer of this step in slot m */
				for (int l = 0; l < L; l++)
					if (l % 2 == m)
						last = l;
				ck_assert_int_eq(s->pre_n[m], last >= 0 ? pieces[m] : 0);
				for (int i = 0; i < s->pre_n[m]; i++)
					for (int x = 0; x < G; x++)
						ck_assert_msg(s->pre[m][i].start >= s->gb[last][x].end,
							      "L %d G %d: next step's layer %d overwrites "
							      "slot %d before GB(%d,%d)", L, G, m, m, last, x);
			}
			free(s);
		}
	}
	/* without RESIDENT01 the step streams its own 0 and 1 first */
	ck_assert_int_eq(mlens_pipe_prog_build_ex(&p, 3, 2, pieces, MLENS_PIPE_PREFETCH), 0);
	{
		int own = 0, next = 0;
		for (int i = 0; i < p.n; i++)
			if (p.cmd[i].kind == MLENS_PIPE_COPY && p.cmd[i].layer < 2)
				p.cmd[i].next_step ? next++ : own++;
		ck_assert_int_eq(own, pieces[0] + pieces[1]);
		ck_assert_int_eq(next, pieces[0] + pieces[1]);
	}
	mlens_pipe_prog_free(&p);
}
END_TEST

/* The deps that let two threads drive the program: HOST_WAIT on the last
 * RECORD of its event before it, GB on the C of its item; and a set's
 * GPU buffers are rewritten by C(i)'s copy only after GB(i-2) was issued
 * (it precedes the record C(i) waits for). */
START_TEST(prog_deps_for_two_threads)
{
	static const int pieces[5] = { 1, 2, 1, 2, 1 };
	struct mlens_pipe_prog p = { 0 };

	for (int G = 1; G <= 6; G++) {
		int gb_at[5][6], rec_dep[5][6], waits = 0;
		ck_assert_int_eq(mlens_pipe_prog_build(&p, 5, G, pieces), 0);
		for (int i = 0; i < p.n; i++) {
			const struct mlens_pipe_cmd *c = &p.cmd[i];
			if (c->kind == MLENS_PIPE_HOST_WAIT) {
				const struct mlens_pipe_cmd *r = &p.cmd[c->dep];
				ck_assert_int_ge(c->dep, 0);
				ck_assert_int_lt(c->dep, i);
				ck_assert_int_eq(r->kind, MLENS_PIPE_RECORD);
				ck_assert_int_eq(r->event, c->event);
				ck_assert_int_eq(r->layer, c->layer);
				ck_assert_int_eq(r->group, c->group);
				for (int k = c->dep + 1; k < i; k++)
					ck_assert(!(p.cmd[k].kind == MLENS_PIPE_RECORD &&
						    p.cmd[k].event == c->event));
				rec_dep[c->layer][c->group] = c->dep;
			} else if (c->kind == MLENS_PIPE_GB) {
				const struct mlens_pipe_cmd *d = &p.cmd[c->dep];
				ck_assert_int_eq(d->kind, MLENS_PIPE_C);
				ck_assert_int_eq(d->layer, c->layer);
				ck_assert_int_eq(d->group, c->group);
				gb_at[c->layer][c->group] = i;
			} else if (c->kind == MLENS_PIPE_WAIT && c->dep >= 0) {
				/* the mover's and the GPU side's waits on each other */
				const struct mlens_pipe_cmd *r = &p.cmd[c->dep];
				ck_assert_int_lt(c->dep, i);
				ck_assert_int_eq(r->kind, MLENS_PIPE_RECORD);
				ck_assert_int_eq(r->event, c->event);
				ck_assert_int_ne(r->queue, c->queue);
				for (int k = c->dep + 1; k < i; k++)
					ck_assert(!(p.cmd[k].kind == MLENS_PIPE_RECORD &&
						    p.cmd[k].event == c->event));
				waits++;
			} else {
				ck_assert_int_eq(c->dep, -1);
			}
		}
		for (int i = 2; G > 1 && i < 5 * G; i++)
			ck_assert_int_gt(rec_dep[i / G][i % G], gb_at[(i - 2) / G][(i - 2) % G]);
		for (int i = 1; G == 1 && i < 5; i++)
			ck_assert_int_gt(rec_dep[i][0], gb_at[i - 1][0]);
		/* every layer's ready wait and every refill's freed wait */
		ck_assert_int_ge(waits, 5 + 3);
	}
	mlens_pipe_prog_free(&p);
}
END_TEST

START_TEST(prog_copy_bound_hides_compute)
{
	static const int pieces[8] = { 10, 10, 10, 10, 10, 10, 10, 10 };
	struct mlens_pipe_prog p = { 0 };
	/* a piece takes 1: 10 per layer against 3 of GPU */
	struct sim *s = sim_new(8, 2, pieces, 0.5, 1, 1, 1);

	ck_assert_int_eq(mlens_pipe_prog_build(&p, 8, 2, pieces), 0);
	simulate(s, &p);
	check_order(s);
	/* copy-bound: the stream of 80 runs back to back but for the first
	 * refill, which waits for GB(0) (two layers of the pipe's depth) */
	ck_assert_msg(s->makespan <= 80 + 2 * 3 + 2, "makespan %.1f", s->makespan);
	mlens_pipe_prog_free(&p);
	free(s);
}
END_TEST

START_TEST(prog_one_group_and_resident)
{
	static const int pieces[3] = { 2, 1, 4 };
	static const int none[3] = { 0, 0, 0 };
	struct mlens_pipe_prog p = { 0 };
	struct sim *s = sim_new(3, 1, pieces, 1, 1, 1, 1);

	ck_assert_int_eq(mlens_pipe_prog_build(&p, 3, 1, pieces), 0);
	simulate(s, &p);
	check_order(s);
	/* all resident: no copies, no slot events */
	ck_assert_int_eq(mlens_pipe_prog_build(&p, 3, 2, none), 0);
	for (int i = 0; i < p.n; i++) {
		ck_assert_int_ne(p.cmd[i].kind, MLENS_PIPE_COPY);
		ck_assert_int_ne(p.cmd[i].queue, MLENS_PIPE_Q_COPY);
	}
	ck_assert_int_eq(mlens_pipe_prog_build(&p, 3, 2, NULL), 0);
	ck_assert_int_eq(p.cmd[0].kind, MLENS_PIPE_HEAD);
	ck_assert_int_eq(p.cmd[p.n - 1].kind, MLENS_PIPE_TAIL);
	ck_assert_int_eq(mlens_pipe_prog_build(&p, 0, 1, NULL), -EINVAL);
	ck_assert_int_eq(mlens_pipe_prog_build(&p, 2, MLENS_PIPE_MAX_GROUPS + 1, NULL), -EINVAL);
	ck_assert_int_eq(mlens_pipe_prog_build(&p, 2, 0, NULL), -EINVAL);
	mlens_pipe_prog_free(&p);
	free(s);
}
END_TEST

START_TEST(pieces_split_and_merge)
{
	static char host[1000];
	/* t0, t1 adjacent in host and slot (merged); t2 not adjacent in host */
	struct mlens_pipe_src src[3] = {
		{ host, 0, 300 }, { host + 300, 300, 250 }, { host + 600, 550, 400 },
	};
	struct mlens_pipe_piece out[16];
	uint64_t covered = 0;
	int n = mlens_pipe_pieces(src, 3, 200, NULL, 0);

	ck_assert_int_eq(n, 3 + 2);	/* 550 -> 200,200,150; 400 -> 200,200 */
	ck_assert_int_eq(mlens_pipe_pieces(src, 3, 200, out, 16), n);
	for (int i = 0; i < n; i++) {
		ck_assert_uint_le(out[i].bytes, 200);
		ck_assert_uint_gt(out[i].bytes, 0);
		/* host and slot offsets stay paired */
		if ((const char *)out[i].host < host + 550)
			ck_assert_uint_eq((uint64_t)((const char *)out[i].host - host), out[i].dst_off);
		else
			ck_assert_uint_eq((uint64_t)((const char *)out[i].host - host), out[i].dst_off + 50);
		covered += out[i].bytes;
	}
	ck_assert_uint_eq(covered, 950);
	ck_assert_uint_eq(out[2].bytes, 150);
	ck_assert_uint_eq(out[3].dst_off, 550);
	ck_assert_int_eq(mlens_pipe_pieces(src, 3, 0, out, 16), -EINVAL);
	ck_assert_int_eq(mlens_pipe_pieces(src, 3, 1000, out, 16), 2);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("stepprog");
	TCase *t = tcase_create("program");
	tcase_add_test(t, prog_two_groups);
	tcase_add_test(t, prog_many_groups);
	tcase_add_test(t, prog_three_sets);
	tcase_add_test(t, prog_deps_for_two_threads);
	tcase_add_test(t, prog_prefetch_next_step);
	tcase_add_test(t, prog_copy_bound_hides_compute);
	tcase_add_test(t, prog_one_group_and_resident);
	tcase_add_test(t, pieces_split_and_merge);
	suite_add_tcase(s, t);
	return mlens_check_run(s);
}
