/* mlens-bench ring: the real SPSC ring in a MAP_SHARED memfd between two
 * processes pinned to different CPUs. Measures one-way entries/s with both
 * sides polling, and the round-trip latency of a ping-pong in which each
 * side sleeps on an eventfd behind the needs-wake-up flag. */
#include <errno.h>
#include <getopt.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include "shm/barrier.h"
#include "shm/ring.h"
#include "tests/bench/bench.h"

#define RING_ENTRIES 4096u
#define MAX_BATCH 256u

struct bench_item {
	uint64_t seq;
	uint64_t payload;
};

/* Control words shared by the two processes, on their own page. */
struct bench_ctl {
	uint32_t go;		/* parent -> child: start */
	uint32_t ready;		/* child -> parent: attached and pinned */
};

struct shared {
	void *mem;
	size_t size;
	struct bench_ctl *ctl;
	void *ring_mem[2];
	size_t ring_size;
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

/* Spinning politely: after a while without progress, give the CPU away,
 * since this machine is shared and the peer may need it. */
static void backoff(unsigned *spins)
{
	if (++*spins < 256) {
		cpu_relax();
	} else {
		*spins = 0;
		sched_yield();
	}
}

static int shared_map(struct shared *sh)
{
	ssize_t rsz = mlens_ring_memsize(RING_ENTRIES, sizeof(struct bench_item));
	int fd;

	if (rsz < 0)
		return (int)rsz;
	sh->ring_size = ((size_t)rsz + 4095) & ~(size_t)4095;
	sh->size = 4096 + 2 * sh->ring_size;
	fd = memfd_create("mlens-bench-ring", MFD_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)sh->size)) {
		close(fd);
		return -errno;
	}
	sh->mem = mmap(NULL, sh->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (sh->mem == MAP_FAILED)
		return -errno;
	sh->ctl = sh->mem;
	sh->ring_mem[0] = (char *)sh->mem + 4096;
	sh->ring_mem[1] = (char *)sh->mem + 4096 + sh->ring_size;
	return 0;
}

/* CPUs for the two sides: two distinct ones from our affinity mask, or -1
 * (no pinning) if there is only one. */
static void pick_cpus(int cpu[2])
{
	cpu_set_t set;
	int n = 0;

	cpu[0] = cpu[1] = -1;
	if (sched_getaffinity(0, sizeof(set), &set))
		return;
	for (int c = 0; c < CPU_SETSIZE && n < 2; c++)
		if (CPU_ISSET(c, &set))
			cpu[n++] = c;
	if (n < 2)
		cpu[0] = cpu[1] = -1;
}

static int reap(pid_t pid)
{
	int st;

	if (waitpid(pid, &st, 0) != pid)
		return -errno;
	return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -ECHILD;
}

/* ==== Throughput ==== */

static int tput_producer(struct shared *sh, int cpu, uint64_t n, uint32_t batch)
{
	struct mlens_ring r;
	struct bench_item buf[MAX_BATCH];
	uint64_t seq = 0;
	unsigned spins = 0;

	if (cpu >= 0)
		mlens_bench_pin(cpu);
	if (mlens_ring_attach(&r, sh->ring_mem[0], sh->ring_size))
		return 1;
	/* Release: pairs with the parent's load-acquire of ready. */
	mlens_store_release(&sh->ctl->ready, 1u);
	/* Acquire: pairs with the parent's store-release of go. */
	while (!mlens_load_acquire(&sh->ctl->go))
		backoff(&spins);
	while (seq < n) {
		uint32_t k = n - seq < batch ? (uint32_t)(n - seq) : batch;
		int got;

		for (uint32_t i = 0; i < k; i++)
			buf[i] = (struct bench_item){ seq + i, ~(seq + i) };
		got = mlens_ring_enqueue_burst(&r, buf, k);
		if (got < 0)
			return 2;
		if (got == 0) {
			backoff(&spins);
			continue;
		}
		spins = 0;
		seq += (uint64_t)got;
	}
	return 0;
}

/* Entries/s from the moment the producer may start until the consumer has
 * checked the last entry; negative errno on failure. */
static double tput_run(struct shared *sh, const int cpu[2], uint64_t n, uint32_t batch)
{
	struct mlens_ring r;
	struct bench_item buf[MAX_BATCH];
	uint64_t expect = 0, t0, t1;
	unsigned spins = 0;
	pid_t pid;
	int err;

	if (mlens_ring_init(&r, sh->ring_mem[0], sh->ring_size, RING_ENTRIES,
			    sizeof(struct bench_item)))
		return -EINVAL;
	mlens_store_relaxed(&sh->ctl->go, 0u);
	mlens_store_relaxed(&sh->ctl->ready, 0u);
	pid = fork();
	if (pid < 0)
		return -errno;
	if (pid == 0)
		_exit(tput_producer(sh, cpu[1], n, batch));
	/* Acquire: pairs with the child's store-release of ready. */
	while (!mlens_load_acquire(&sh->ctl->ready))
		backoff(&spins);
	t0 = mlens_bench_now_ns();
	/* Release: pairs with the child's load-acquire of go. */
	mlens_store_release(&sh->ctl->go, 1u);
	while (expect < n) {
		int got = mlens_ring_dequeue_burst(&r, buf, batch);

		if (got < 0)
			goto bad;
		if (got == 0) {
			backoff(&spins);
			continue;
		}
		spins = 0;
		for (int i = 0; i < got; i++)
			if (buf[i].seq != expect + (uint64_t)i || buf[i].payload != ~buf[i].seq)
				goto bad;
		expect += (uint64_t)got;
	}
	t1 = mlens_bench_now_ns();
	err = reap(pid);
	if (err)
		return err;
	return (double)n / ((double)(t1 - t0) / 1e9);
bad:
	fprintf(stderr, "mlens-bench ring: entry %llu lost, duplicated or out of order\n",
		(unsigned long long)expect);
	kill(pid, SIGKILL);
	reap(pid);
	return -EPROTO;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

struct tput_result {
	double median, best;	/* entries/s over the repeats */
};

/* The machine is shared: repeat and report the median and the best run. */
static int tput_repeat(struct shared *sh, const int cpu[2], uint64_t n, uint32_t batch,
		       int repeat, struct tput_result *res)
{
	double rate[16];

	for (int i = 0; i < repeat; i++) {
		rate[i] = tput_run(sh, cpu, n, batch);
		if (rate[i] < 0)
			return (int)rate[i];
	}
	qsort(rate, (size_t)repeat, sizeof(rate[0]), cmp_double);
	res->median = rate[repeat / 2];
	res->best = rate[repeat - 1];
	return 0;
}

/* ==== Doorbell round trip ==== */

/* The child: answer each ping with a pong, sleeping between them. */
static int rtt_child(struct shared *sh, int cpu, int efd_ping, int efd_pong, long rounds)
{
	struct mlens_ring ping, pong;
	struct bench_item it;

	if (cpu >= 0)
		mlens_bench_pin(cpu);
	if (mlens_ring_attach(&ping, sh->ring_mem[0], sh->ring_size) ||
	    mlens_ring_attach(&pong, sh->ring_mem[1], sh->ring_size))
		return 1;
	for (long i = 0; i < rounds; i++) {
		if (mlens_ring_wait_cons(&ping, efd_ping, 10000) <= 0)
			return 2;
		if (mlens_ring_dequeue_bulk(&ping, &it, 1) != 1)
			return 3;
		if (mlens_ring_enqueue_bulk(&pong, &it, 1) != 1)
			return 4;
		if (mlens_ring_wake_cons(&pong, efd_pong) < 0)
			return 5;
	}
	return 0;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

struct rtt_result {
	double median_us, p99_us, min_us, max_us;
	long doorbells;		/* how many pings found the child asleep */
};

static int rtt_run(struct shared *sh, const int cpu[2], long rounds, long warmup,
		   struct rtt_result *res)
{
	struct mlens_ring ping, pong;
	struct bench_item it;
	uint64_t *lat = NULL;
	int efd_ping = -1, efd_pong = -1, err = -ENOMEM;
	long total = rounds + warmup;
	pid_t pid;

	if (mlens_ring_init(&ping, sh->ring_mem[0], sh->ring_size, RING_ENTRIES,
			    sizeof(struct bench_item)) ||
	    mlens_ring_init(&pong, sh->ring_mem[1], sh->ring_size, RING_ENTRIES,
			    sizeof(struct bench_item)))
		return -EINVAL;
	lat = malloc((size_t)rounds * sizeof(*lat));
	if (!lat)
		goto out;
	efd_ping = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	efd_pong = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (efd_ping < 0 || efd_pong < 0) {
		err = -errno;
		goto out;
	}
	pid = fork();
	if (pid < 0) {
		err = -errno;
		goto out;
	}
	if (pid == 0)
		_exit(rtt_child(sh, cpu[1], efd_ping, efd_pong, total));
	res->doorbells = 0;
	for (long i = 0; i < total; i++) {
		uint64_t t0 = mlens_bench_now_ns(), t1;
		int rang;

		it = (struct bench_item){ (uint64_t)i, 0 };
		if (mlens_ring_enqueue_bulk(&ping, &it, 1) != 1)
			goto bad;
		rang = mlens_ring_wake_cons(&ping, efd_ping);
		if (rang < 0)
			goto bad;
		if (mlens_ring_wait_cons(&pong, efd_pong, 10000) <= 0)
			goto bad;
		if (mlens_ring_dequeue_bulk(&pong, &it, 1) != 1 || it.seq != (uint64_t)i)
			goto bad;
		t1 = mlens_bench_now_ns();
		if (i >= warmup) {
			lat[i - warmup] = t1 - t0;
			res->doorbells += rang;
		}
	}
	err = reap(pid);
	if (err)
		goto out;
	qsort(lat, (size_t)rounds, sizeof(*lat), cmp_u64);
	res->min_us = (double)lat[0] / 1e3;
	res->median_us = (double)lat[rounds / 2] / 1e3;
	res->p99_us = (double)lat[(size_t)((double)rounds * 0.99)] / 1e3;
	res->max_us = (double)lat[rounds - 1] / 1e3;
	err = 0;
	goto out;
bad:
	fprintf(stderr, "mlens-bench ring: ping-pong failed\n");
	kill(pid, SIGKILL);
	reap(pid);
	err = -EPROTO;
out:
	if (efd_ping >= 0)
		close(efd_ping);
	if (efd_pong >= 0)
		close(efd_pong);
	free(lat);
	return err;
}

/* ==== Command ==== */

static void ring_usage(FILE *f)
{
	fprintf(f, "usage: mlens-bench ring [--json] [--entries N] [--batch B] [--repeat K]\n"
		"                         [--round-trips R]\n"
		"  --entries N      entries pushed one way per throughput run (default 10M)\n"
		"  --repeat K       throughput runs per batch size, 1..16; the median and the\n"
		"                   best are reported (default 3)\n"
		"  --batch B        entries per enqueue/dequeue call, 1..%u (default 32);\n"
		"                   a run with batch 1 is always made as well\n"
		"  --round-trips R  doorbell ping-pongs timed (default 20000)\n"
		"  --json           print JSON instead of a table\n", MAX_BATCH);
}

int mlens_bench_ring(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "json", no_argument, NULL, 'j' },
		{ "entries", required_argument, NULL, 'n' },
		{ "batch", required_argument, NULL, 'b' },
		{ "round-trips", required_argument, NULL, 'r' },
		{ "repeat", required_argument, NULL, 'k' },
		{ "help", no_argument, NULL, 'h' },
		{ 0 },
	};
	long long entries = 10000000, batch = 32, rounds = 20000, repeat = 3, v;
	int json = 0, c, cpu[2];
	struct tput_result t1, tb;
	double load[3] = { -1, -1, -1 };
	struct rtt_result rtt = { 0 };
	struct shared sh;
	int err;

	optind = 1;
	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'j':
			json = 1;
			break;
		case 'n': case 'b': case 'r': case 'k':
			v = mlens_bench_parse_count(optarg);
			if (v <= 0 || (c == 'b' && v > MAX_BATCH) || (c == 'k' && v > 16)) {
				fprintf(stderr, "mlens-bench ring: bad value '%s' for --%s\n",
					optarg, c == 'n' ? "entries" : c == 'b' ? "batch" :
					c == 'k' ? "repeat" : "round-trips");
				return 2;
			}
			if (c == 'n')
				entries = v;
			else if (c == 'b')
				batch = v;
			else if (c == 'k')
				repeat = v;
			else
				rounds = v;
			break;
		case 'h':
			ring_usage(stdout);
			return 0;
		default:
			ring_usage(stderr);
			return 2;
		}
	}
	err = shared_map(&sh);
	if (err) {
		fprintf(stderr, "mlens-bench ring: shared memory: %s\n", strerror(-err));
		return 1;
	}
	pick_cpus(cpu);
	if (cpu[0] >= 0)
		mlens_bench_pin(cpu[0]);

	/* The load average is context: the box is shared by several people. */
	if (getloadavg(load, 3) < 0)
		load[0] = load[1] = load[2] = -1;
	err = tput_repeat(&sh, cpu, (uint64_t)entries, 1, (int)repeat, &t1);
	if (!err)
		err = tput_repeat(&sh, cpu, (uint64_t)entries, (uint32_t)batch, (int)repeat, &tb);
	if (!err)
		err = rtt_run(&sh, cpu, rounds, rounds / 10 + 1, &rtt);
	munmap(sh.mem, sh.size);
	if (err) {
		fprintf(stderr, "mlens-bench ring: %s\n", strerror(-err));
		return 1;
	}
	if (json) {
		printf("{\"bench\": \"ring\", \"entry_bytes\": %zu, \"ring_entries\": %u, "
		       "\"cpus\": [%d, %d], \"loadavg_1m\": %.2f,\n", sizeof(struct bench_item),
		       RING_ENTRIES, cpu[0], cpu[1], load[0]);
		printf(" \"throughput\": [{\"batch\": 1, \"entries\": %lld, \"runs\": %lld, "
		       "\"entries_per_s\": %.0f, \"best_entries_per_s\": %.0f},\n",
		       entries, repeat, t1.median, t1.best);
		printf("  {\"batch\": %lld, \"entries\": %lld, \"runs\": %lld, "
		       "\"entries_per_s\": %.0f, \"best_entries_per_s\": %.0f}],\n",
		       batch, entries, repeat, tb.median, tb.best);
		printf(" \"doorbell_rtt_us\": {\"round_trips\": %lld, \"median\": %.2f, "
		       "\"p99\": %.2f, \"min\": %.2f, \"max\": %.2f, \"doorbells\": %ld}}\n",
		       rounds, rtt.median_us, rtt.p99_us, rtt.min_us, rtt.max_us, rtt.doorbells);
	} else {
		printf("ring: %zu-byte entries, %u-entry ring, CPUs %d and %d, load %.2f\n",
		       sizeof(struct bench_item), RING_ENTRIES, cpu[0], cpu[1], load[0]);
		printf("  one way, polling, batch 1     %8.2f M entries/s (best of %lld: %.2f)\n",
		       t1.median / 1e6, repeat, t1.best / 1e6);
		printf("  one way, polling, batch %-4lld  %8.2f M entries/s (best of %lld: %.2f)\n",
		       batch, tb.median / 1e6, repeat, tb.best / 1e6);
		printf("  doorbell round trip           median %.1f us, p99 %.1f us "
		       "(%lld trips, %ld doorbells)\n", rtt.median_us, rtt.p99_us, rounds,
		       rtt.doorbells);
	}
	return 0;
}
