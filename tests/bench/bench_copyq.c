/* How long a small host-to-GPU copy of the compute stream waits while a
 * layer of weights streams on a copy stream of its own (the hybrid
 * pipeline's activation copies against its weight pieces). For each way of
 * queueing the weights (all pieces at once, or at most D pieces queued;
 * piece size; compute stream priority) it streams one layer of pieces,
 * queues an activation copy a few milliseconds in, and reports the copy's
 * time from its queueing to its end, against its time alone, and the
 * weight stream's rate. Prints one JSON object on stdout and a table on
 * stderr. Not a test: it asserts nothing.
 * Usage: bench_copyq [layer_MB [act_MB]] (default 2688 and 64: an 8x7B
 * layer's experts and a 4096-token group's attention output).
 * Environment: COPYQ_REGISTER=1 streams the weights from registered
 * anonymous memory (as mlensd's weight pages) instead of cudaHostAlloc;
 * COPYQ_CPU_THREADS=N keeps N threads reading host memory meanwhile (as
 * the CPU attention does next to the weight stream) and reports their
 * read rate; COPYQ_GEMM=1 puts a bf16 GEMM (4096 x 4096 x 14336, an expert
 * matrix of a group) on the compute stream before the activation copy, as
 * GA and GB have kernels before their copies (act_ms then includes it;
 * gemm_alone_ms is printed); COPYQ_BEFORE=1 queues the activation copy
 * (behind the GEMM with COPYQ_GEMM) just before the first weight piece
 * instead of 5 ms in, the daemon's order: a GA's copies are queued behind
 * its kernels while the previous GB still runs, and the layer's pieces
 * follow as soon as that GB frees the slot.
 * Queued before the pieces behind a GEMM (COPYQ_BEFORE=1 COPYQ_GEMM=1), a
 * host-to-GPU copy waits for the whole layer of pieces queued on the same
 * copy engine (tests/bench/RESULTS.md has the numbers): the hybrid
 * pipeline's per-layer stall, which mlensd's gpu_copy = sm avoids by
 * moving the compute stream's copies with the SMs. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <sys/mman.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
	fprintf(stderr, "bench_copyq: %s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct res {
	double act_ms, weights_gbs;
};

/* Host memory readers (COPYQ_CPU_THREADS). */
struct reader {
	pthread_t th;
	uint64_t *buf;
	size_t words;
	volatile bool *stop;
	uint64_t bytes, sink;
};

static void *reader_thread(void *arg)
{
	struct reader *r = arg;
	uint64_t sum = 0;
	while (!*r->stop) {
		for (size_t i = 0; i < r->words; i += 8)
			sum += r->buf[i] + r->buf[i + 1] + r->buf[i + 2] + r->buf[i + 3] +
			       r->buf[i + 4] + r->buf[i + 5] + r->buf[i + 6] + r->buf[i + 7];
		r->bytes += r->words * 8;
	}
	r->sink = sum;
	return NULL;
}

/* The activation copy, queued from a thread of its own when asked (the
 * pipeline queues it from its host thread, the weights from its mover). */
struct act {
	char *ha, *da;
	size_t bytes;
	bool d2h;
	cudaStream_t cs;
	cudaEvent_t a0, a1;
	double at;	/* host time to queue it */
};

/* COPYQ_GEMM: the GEMM queued before each activation copy */
static struct {
	cublasHandle_t h;
	void *a, *b, *c;
	int m, n, k;
} gemm;

static void gemm_queue(cudaStream_t s)
{
	const float one = 1.0f, zero = 0.0f;
	cublasStatus_t st;
	if (!gemm.h)
		return;
	if ((st = cublasSetStream(gemm.h, s)) != CUBLAS_STATUS_SUCCESS ||
	    (st = cublasGemmEx(gemm.h, CUBLAS_OP_T, CUBLAS_OP_N, gemm.n, gemm.m, gemm.k, &one, gemm.b,
			       CUDA_R_16BF, gemm.k, gemm.a, CUDA_R_16BF, gemm.k, &zero, gemm.c,
			       CUDA_R_32F, gemm.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)) !=
		    CUBLAS_STATUS_SUCCESS) {
		fprintf(stderr, "bench_copyq: cuBLAS error %d\n", (int)st);
		exit(1);
	}
}

static void act_issue(struct act *a)
{
	CK(cudaEventRecord(a->a0, a->cs));
	gemm_queue(a->cs);
	CK(a->d2h ? cudaMemcpyAsync(a->ha, a->da, a->bytes, cudaMemcpyDeviceToHost, a->cs)
		  : cudaMemcpyAsync(a->da, a->ha, a->bytes, cudaMemcpyHostToDevice, a->cs));
	CK(cudaEventRecord(a->a1, a->cs));
}

static void *act_thread(void *arg)
{
	struct act *a = arg;
	CK(cudaSetDevice(0));
	while (now() < a->at)
		;
	act_issue(a);
	return NULL;
}

#define MAX_PIECES 4096

/* One layer of pieces of piece bytes, at most depth queued (0: all),
 * and the activation copy queued at 5 ms on stream cs (from another
 * thread when threaded). */
static struct res run(char *hw, char *dw, size_t layer, size_t piece, int depth, char *ha,
		      char *da, size_t act, bool d2h, bool threaded, bool before,
		      cudaStream_t ws, cudaStream_t cs)
{
	static cudaEvent_t pev[MAX_PIECES];
	struct act a = { ha, da, act, d2h, cs, NULL, NULL, 0 };
	cudaEvent_t w0, w1;
	pthread_t th;
	int n = (int)((layer + piece - 1) / piece);
	double t0;
	bool issued = false;
	struct res r;
	float ms;

	for (int i = 0; i < n; i++)
		if (!pev[i])
			CK(cudaEventCreateWithFlags(&pev[i], cudaEventDisableTiming));
	CK(cudaEventCreate(&a.a0));
	CK(cudaEventCreate(&a.a1));
	CK(cudaEventCreate(&w0));
	CK(cudaEventCreate(&w1));
	CK(cudaDeviceSynchronize());
	t0 = now();
	a.at = t0 + 0.005;
	if (before) {
		a.at = t0;
		act_issue(&a);
		issued = true;
		threaded = false;
	}
	if (threaded && pthread_create(&th, NULL, act_thread, &a)) {
		fprintf(stderr, "bench_copyq: cannot start a thread\n");
		exit(1);
	}
	CK(cudaEventRecord(w0, ws));
	for (int i = 0; i < n; i++) {
		size_t off = (size_t)i * piece, b = layer - off < piece ? layer - off : piece;
		if (depth > 0 && i >= depth)
			CK(cudaEventSynchronize(pev[i - depth]));
		if (!threaded && !issued && now() >= a.at) {
			act_issue(&a);
			issued = true;
		}
		CK(cudaMemcpyAsync(dw + off, hw + off, b, cudaMemcpyHostToDevice, ws));
		CK(cudaEventRecord(pev[i], ws));
	}
	CK(cudaEventRecord(w1, ws));
	if (threaded) {
		pthread_join(th, NULL);
	} else if (!issued) {
		while (now() < a.at)
			;
		act_issue(&a);
	}
	CK(cudaDeviceSynchronize());
	CK(cudaEventElapsedTime(&ms, a.a0, a.a1));
	r.act_ms = ms;
	CK(cudaEventElapsedTime(&ms, w0, w1));
	r.weights_gbs = (double)layer / (ms * 1e-3) / 1e9;
	cudaEventDestroy(a.a0);
	cudaEventDestroy(a.a1);
	cudaEventDestroy(w0);
	cudaEventDestroy(w1);
	return r;
}

int main(int argc, char **argv)
{
	size_t layer = (size_t)(argc > 1 ? atol(argv[1]) : 2688) << 20;
	size_t act = (size_t)(argc > 2 ? atol(argv[2]) : 64) << 20;
	static const size_t pieces[] = { 100u << 20, 25u << 20 };
	static const int depths[] = { 0, 2, 1 };
	static const size_t acts[] = { 0, 32 };	/* 0: act_MB */
	char *hw, *dw, *ha, *da;
	cudaStream_t ws, cs[2];
	int lo, hi, first = 1;
	float ms;
	cudaEvent_t e0, e1;
	int n_read = getenv("COPYQ_CPU_THREADS") ? atoi(getenv("COPYQ_CPU_THREADS")) : 0;
	struct reader *rd = NULL;
	volatile bool stop = false;
	double r0, gemm_ms = 0, act_ms0;
	bool before = getenv("COPYQ_BEFORE") != NULL;

	if (layer == 0 || act == 0 || n_read < 0 || n_read > 1024) {
		fprintf(stderr, "usage: bench_copyq [layer_MB [act_MB]]\n");
		return 2;
	}
	CK(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));
	if (getenv("COPYQ_REGISTER")) {
		/* like mlensd's weight pages: anonymous memory, registered */
		hw = mmap(NULL, layer, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (hw == MAP_FAILED) {
			perror("bench_copyq: mmap");
			return 1;
		}
		memset(hw, 1, layer);
		CK(cudaHostRegister(hw, layer, cudaHostRegisterDefault));
	} else {
		CK(cudaHostAlloc((void **)&hw, layer, cudaHostAllocDefault));
	}
	CK(cudaHostAlloc((void **)&ha, act, cudaHostAllocDefault));
	memset(hw, 1, layer);
	memset(ha, 2, act);
	CK(cudaMalloc((void **)&dw, layer));
	CK(cudaMalloc((void **)&da, act));
	CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
	CK(cudaStreamCreateWithFlags(&ws, cudaStreamNonBlocking));
	CK(cudaStreamCreateWithPriority(&cs[0], cudaStreamNonBlocking, lo));
	CK(cudaStreamCreateWithPriority(&cs[1], cudaStreamNonBlocking, hi));
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	/* the activation copy alone */
	for (int k = 0; k < 3; k++) {
		CK(cudaEventRecord(e0, cs[0]));
		CK(cudaMemcpyAsync(da, ha, act, cudaMemcpyHostToDevice, cs[0]));
		CK(cudaEventRecord(e1, cs[0]));
		CK(cudaEventSynchronize(e1));
	}
	CK(cudaEventElapsedTime(&ms, e0, e1));
	act_ms0 = ms;
	if (getenv("COPYQ_GEMM")) {
		gemm.m = 4096;
		gemm.k = 4096;
		gemm.n = 14336;
		CK(cudaMalloc(&gemm.a, (size_t)gemm.m * gemm.k * 2));
		CK(cudaMalloc(&gemm.b, (size_t)gemm.n * gemm.k * 2));
		CK(cudaMalloc(&gemm.c, (size_t)gemm.m * gemm.n * 4));
		CK(cudaMemset(gemm.a, 0, (size_t)gemm.m * gemm.k * 2));
		CK(cudaMemset(gemm.b, 0, (size_t)gemm.n * gemm.k * 2));
		if (cublasCreate(&gemm.h) != CUBLAS_STATUS_SUCCESS) {
			fprintf(stderr, "bench_copyq: cannot start cuBLAS\n");
			return 1;
		}
		for (int k = 0; k < 3; k++) {
			CK(cudaEventRecord(e0, cs[0]));
			gemm_queue(cs[0]);
			CK(cudaEventRecord(e1, cs[0]));
			CK(cudaEventSynchronize(e1));
		}
		CK(cudaEventElapsedTime(&ms, e0, e1));
		fprintf(stderr, "the GEMM alone: %.3f ms\n", ms);
		gemm_ms = ms;
	}
	if (n_read) {
		rd = calloc((size_t)n_read, sizeof(*rd));
		if (!rd) {
			fprintf(stderr, "bench_copyq: no memory\n");
			return 1;
		}
		for (int i = 0; i < n_read; i++) {
			rd[i].words = (256u << 20) / 8;	/* 256 MiB each: far past the caches */
			rd[i].buf = malloc(rd[i].words * 8);
			rd[i].stop = &stop;
			if (!rd[i].buf) {
				fprintf(stderr, "bench_copyq: no memory\n");
				return 1;
			}
			memset(rd[i].buf, 3, rd[i].words * 8);
			if (pthread_create(&rd[i].th, NULL, reader_thread, &rd[i])) {
				fprintf(stderr, "bench_copyq: cannot start a reader\n");
				return 1;
			}
		}
	}
	r0 = now();
	printf("{\"bench\": \"copyq\", \"layer_bytes\": %zu, \"act_bytes\": %zu, \"act_alone_ms\": %.3f, "
	       "\"cpu_threads\": %d, \"gemm_alone_ms\": %.3f, \"before\": %s, \"results\": [", layer,
	       act, act_ms0, n_read, gemm_ms, before ? "true" : "false");
	fprintf(stderr, "activation copy of %zu MB alone: %.3f ms\n", act >> 20, act_ms0);
	fprintf(stderr, "%-4s %-10s %-9s %-6s %-9s %-8s %12s %12s\n", "dir", "act bytes",
		"piece MB", "depth", "priority", "thread", "act ms", "weights GB/s");
	for (int dir = 0; dir < 2; dir++)
	for (int ai = 0; ai < 2; ai++)
	for (int pi = 0; pi < 2; pi++)
		for (int di = 0; di < 3; di++)
			for (int pr = 0; pr < 2; pr++)
			for (int th = 0; th < 2; th++) {
				struct res r = { 0, 0 };
				size_t ab = acts[ai] ? acts[ai] : act;
				if ((pr && th) || (before && th))
					continue;	/* before: queued from the weights' thread */
				for (int k = 0; k < 2; k++)	/* the second of two */
					r = run(hw, dw, layer, pieces[pi], depths[di], ha, da, ab, dir,
						th, before, ws, cs[pr]);
				printf("%s{\"dir\": \"%s\", \"act_bytes\": %zu, \"piece_mb\": %zu, "
				       "\"depth\": %d, \"high_priority\": %s, \"threaded\": %s, "
				       "\"act_ms\": %.3f, \"weights_gbs\": %.2f}", first ? "" : ", ",
				       dir ? "d2h" : "h2d", ab, pieces[pi] >> 20, depths[di],
				       pr ? "true" : "false", th ? "true" : "false", r.act_ms,
				       r.weights_gbs);
				first = 0;
				fprintf(stderr, "%-4s %-10zu %-9zu %-6s %-9s %-8s %12.3f %12.2f\n",
					dir ? "d2h" : "h2d", ab, pieces[pi] >> 20,
					depths[di] == 1 ? "1" : depths[di] ? "2" : "all", pr ? "high" : "normal",
					th ? "other" : "same", r.act_ms, r.weights_gbs);
			}
	if (n_read) {
		uint64_t bytes = 0;
		double t = now() - r0;
		stop = true;
		for (int i = 0; i < n_read; i++) {
			pthread_join(rd[i].th, NULL);
			bytes += rd[i].bytes;
		}
		printf("], \"cpu_read_gbs\": %.2f}\n", (double)bytes / t / 1e9);
		fprintf(stderr, "%d reader threads meanwhile: %.2f GB/s\n", n_read, (double)bytes / t / 1e9);
		return 0;
	}
	printf("]}\n");
	return 0;
}
