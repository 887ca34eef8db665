/* Description: libFuzzer target for what a hostile tenant controls in its
 * region. Mode 0 (first byte even): the input overwrites the region header
 * and the submission ring's head, then the client-side attach runs. Mode 1:
 * the input supplies the submission ring's tail, the prompt ring's tail and
 * the bytes of both rings, then the daemon takes entries until none are
 * left. Neither may crash, and whatever is accepted must obey the limits.
 * Also linked into check_shm, which feeds it random inputs. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "shm/proto.h"
#include "shm/region.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Requests and headers accepted so far: check_shm reads these to know its
 * inputs reached the checks past validation. */
unsigned long fuzz_shm_accepted_subs, fuzz_shm_accepted_headers;

static const struct mlens_region_params fz_params = { 16, 16, 4096 };
static const struct mlens_region_limits fz_limits = {
	.max_prompt_tokens = 256, .max_tokens = 64, .max_context = 300, .vocab_size = 1000,
};

/* A failed invariant: abort so that libFuzzer (or Check) reports it. */
#define FZ_REQUIRE(cond) do { if (!(cond)) abort(); } while (0)

static void fuzz_attach(struct mlens_region *d, const uint8_t *data, size_t size)
{
	struct mlens_region a;
	unsigned char *base = d->base;
	size_t n = size < sizeof(struct mlens_region_hdr) ? size : sizeof(struct mlens_region_hdr);
	const struct mlens_region_hdr *h = d->base;
	int err;

	memcpy(base, data, n);
	data += n;
	size -= n;
	/* What is left lands on the submission ring's head, when the header
	 * still points at one inside the region. */
	if (size && h->sub.offset <= d->size - sizeof(struct mlens_ring_shm))
		memcpy(base + h->sub.offset, data,
		       size < sizeof(struct mlens_ring_shm) ? size : sizeof(struct mlens_ring_shm));
	err = mlens_region_attach(&a, base, d->size, NULL, 0);
	FZ_REQUIRE(err == 0 || err == -EPROTO || err == -EINVAL);
	if (err)
		return;
	fuzz_shm_accepted_headers++;
	/* Accepted: every ring lies inside the region, and works. */
	FZ_REQUIRE(a.size <= d->size);
	FZ_REQUIRE((unsigned char *)a.sub.shm >= base && (unsigned char *)a.sub.data +
		   (size_t)a.sub.entries * a.sub.esize <= base + a.size);
	FZ_REQUIRE((unsigned char *)a.cmpl.data + (size_t)a.cmpl.entries * a.cmpl.esize <=
		   base + a.size);
	FZ_REQUIRE(a.prompt.ring.data + a.prompt.ring.entries <= base + a.size);
	FZ_REQUIRE(mlens_ring_count(&a.cmpl) >= -EPROTO);
}

static void fuzz_take(struct mlens_region *d, const uint8_t *data, size_t size)
{
	int32_t tokens[256];
	uint32_t tail;
	size_t n;

	if (size < 8)
		return;
	/* The tenant's indexes: tails of the two rings it produces into. */
	memcpy(&tail, data, 4);
	d->sub.shm->tail = tail;
	memcpy(&tail, data + 4, 4);
	d->prompt.ring.shm->tail = tail;
	data += 8;
	size -= 8;
	n = size < (size_t)16 * sizeof(struct mlens_sub) ? size : (size_t)16 * sizeof(struct mlens_sub);
	memcpy(d->sub.data, data, n);
	data += n;
	size -= n;
	memcpy(d->prompt.ring.data, data, size < 4096 ? size : 4096);

	for (int i = 0; i < 64; i++) {
		struct mlens_sub s;
		int status = 1, got;

		got = mlens_region_take(d, &s, tokens, &status, NULL, 0);
		FZ_REQUIRE(got == 0 || got == 1 || got == -EPROTO);
		if (got != 1)
			break;
		FZ_REQUIRE(status == 0 || status == -EINVAL || status == -E2BIG ||
			   status == -EFAULT || status == -ERANGE);
		if (status || s.op != MLENS_OP_GENERATE)
			continue;
		FZ_REQUIRE(s.prompt_len >= 1 && s.prompt_len <= fz_limits.max_prompt_tokens);
		FZ_REQUIRE(s.max_tokens >= 1 && s.prompt_len + s.max_tokens <= fz_limits.max_context);
		FZ_REQUIRE(s.temperature >= 0 && s.temperature <= MLENS_TEMPERATURE_MAX);
		FZ_REQUIRE(s.top_p > 0 && s.top_p <= 1);
		for (uint32_t k = 0; k < s.prompt_len; k++)
			FZ_REQUIRE(tokens[k] >= 0 && tokens[k] < (int32_t)fz_limits.vocab_size);
		fuzz_shm_accepted_subs++;
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static void *mem;
	static size_t mem_size;
	struct mlens_region d;

	if (size < 1)
		return 0;
	if (!mem) {
		if (mlens_region_size(&fz_params, &mem_size))
			abort();
		mem = aligned_alloc(MLENS_REGION_PAGE, mem_size);
		if (!mem)
			abort();
	}
	/* A fresh region each time, as the daemon makes it. */
	if (mlens_region_format(&d, mem, mem_size, &fz_params, &fz_limits, NULL, 0))
		abort();
	if (data[0] % 2)
		fuzz_take(&d, data + 1, size - 1);
	else
		fuzz_attach(&d, data + 1, size - 1);
	return 0;
}
