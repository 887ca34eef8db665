/* Layout and attachment of a tenant region. The daemon derives everything
 * from its own parameters; the client reads the header once into a private
 * copy and checks it before touching any ring. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "shm/barrier.h"
#include "shm/region.h"
#include "shm/shm_int.h"

/* Short local name: most checks below end in one. */
#define fail mlens_shm_reason

static size_t round_up(size_t x, size_t a)
{
	return (x + a - 1) & ~(a - 1);
}

/* The three rings in layout order: descriptors computed from params. */
static int layout(const struct mlens_region_params *p, struct mlens_region_ringdesc d[3],
		  size_t *total)
{
	const uint32_t entries[3] = { p->sub_entries, p->cmpl_entries, p->prompt_bytes };
	const uint32_t esize[3] = { sizeof(struct mlens_sub), sizeof(struct mlens_cmpl), 1 };
	size_t off = sizeof(struct mlens_region_hdr);

	if (p->prompt_bytes < MLENS_BYTERING_MIN_SIZE)
		return -EINVAL;
	for (int i = 0; i < 3; i++) {
		ssize_t sz = mlens_ring_memsize(entries[i], esize[i]);

		if (sz < 0)
			return (int)sz;
		off = round_up(off, MLENS_REGION_RING_ALIGN);
		d[i].offset = off;
		d[i].size = (uint64_t)sz;
		d[i].entries = entries[i];
		d[i].esize = esize[i];
		if (__builtin_add_overflow(off, (size_t)sz, &off))
			return -EINVAL;
	}
	if (off > SIZE_MAX - MLENS_REGION_PAGE)
		return -EINVAL;
	*total = round_up(off, MLENS_REGION_PAGE);
	return 0;
}

int mlens_region_size(const struct mlens_region_params *p, size_t *size)
{
	struct mlens_region_ringdesc d[3];

	return layout(p, d, size);
}

int mlens_region_format(struct mlens_region *rg, void *mem, size_t size,
			const struct mlens_region_params *p,
			const struct mlens_region_limits *lim, char *why, size_t why_len)
{
	struct mlens_region_hdr *h = mem;
	struct mlens_region_ringdesc d[3];
	struct mlens_region_limits l = *lim;
	unsigned char *base = mem;
	size_t total;
	int err;

	if (layout(p, d, &total))
		return fail(-EINVAL, why, why_len,
			    "region: ring sizes %u/%u/%u must be powers of two (prompt ring "
			    "at least %u bytes)", p->sub_entries, p->cmpl_entries,
			    p->prompt_bytes, MLENS_BYTERING_MIN_SIZE);
	if (!mem || (uintptr_t)mem % MLENS_REGION_PAGE || size < total)
		return fail(-EINVAL, why, why_len,
			    "region: memory must be page-aligned and at least %zu bytes", total);
	l.prompt_bytes = p->prompt_bytes;
	err = mlens_limits_validate(&l, why, why_len);
	if (err)
		return err;

	memset(h, 0, sizeof(*h));
	h->version = MLENS_PROTO_VERSION;
	h->hdr_size = sizeof(*h);
	h->total_size = total;
	h->sub = d[0];
	h->cmpl = d[1];
	h->prompt = d[2];
	h->limits = l;
	if (mlens_ring_init(&rg->sub, base + d[0].offset, d[0].size, d[0].entries, d[0].esize) ||
	    mlens_ring_init(&rg->cmpl, base + d[1].offset, d[1].size, d[1].entries, d[1].esize) ||
	    mlens_bytering_init(&rg->prompt, base + d[2].offset, d[2].size, d[2].entries))
		return fail(-EINVAL, why, why_len, "region: ring layout rejected");
	/* Release: the magic goes last, so that a region is never seen with a
	 * good magic and a half-written header. Pairs with the load-acquire of
	 * the magic in mlens_region_attach(). */
	mlens_store_release(&h->magic, MLENS_REGION_MAGIC);
	rg->base = mem;
	rg->size = total;
	rg->map_size = 0;
	rg->limits = l;
	return 0;
}

/* Check one ring descriptor of a header copy against the region's size and
 * the entry size this protocol version uses. */
static int check_desc(const struct mlens_region_ringdesc *d, const char *name,
		      uint32_t want_esize, uint64_t total, char *why, size_t why_len)
{
	ssize_t sz;

	if (d->esize != want_esize)
		return fail(-EPROTO, why, why_len,
			    "region: %s ring entries are %u bytes, this library uses %u", name,
			    d->esize, want_esize);
	sz = mlens_ring_memsize(d->entries, d->esize);
	if (sz < 0 || (want_esize == 1 && d->entries < MLENS_BYTERING_MIN_SIZE))
		return fail(-EINVAL, why, why_len, "region: %s ring has %u entries, not a "
			    "power of two in range", name, d->entries);
	if (d->size != (uint64_t)sz)
		return fail(-EINVAL, why, why_len,
			    "region: %s ring size %llu bytes, its entries need %zd", name,
			    (unsigned long long)d->size, sz);
	if (d->offset % MLENS_REGION_RING_ALIGN || d->offset < sizeof(struct mlens_region_hdr))
		return fail(-EINVAL, why, why_len,
			    "region: %s ring offset %llu misaligned or inside the header", name,
			    (unsigned long long)d->offset);
	if (d->offset > total || d->size > total - d->offset)
		return fail(-EINVAL, why, why_len,
			    "region: %s ring [%llu, +%llu) past the region's %llu bytes", name,
			    (unsigned long long)d->offset, (unsigned long long)d->size,
			    (unsigned long long)total);
	return 0;
}

static int overlap(const struct mlens_region_ringdesc *a, const struct mlens_region_ringdesc *b)
{
	return a->offset < b->offset + b->size && b->offset < a->offset + a->size;
}

int mlens_region_attach(struct mlens_region *rg, void *mem, size_t size, char *why,
			size_t why_len)
{
	const struct mlens_region_ringdesc *d[3];
	static const char *const names[3] = { "submission", "completion", "prompt" };
	struct mlens_region_hdr h;
	unsigned char *base = mem;
	int err;

	if (!mem || (uintptr_t)mem % MLENS_CACHELINE)
		return fail(-EINVAL, why, why_len, "region: mapping misaligned");
	if (size < sizeof(h))
		return fail(-EINVAL, why, why_len,
			    "region: %zu bytes, smaller than its %zu-byte header", size, sizeof(h));
	/* Acquire: pairs with the store-release of the magic in
	 * mlens_region_format(); the rest of the header is written. */
	h.magic = mlens_load_acquire(&((struct mlens_region_hdr *)mem)->magic);
	if (h.magic != MLENS_REGION_MAGIC)
		return fail(-EPROTO, why, why_len,
			    "region: magic 0x%08x, not an mlens region (want 0x%08x)", h.magic,
			    MLENS_REGION_MAGIC);
	/* One copy of the header, checked and used from here on. */
	memcpy(&h, mem, sizeof(h));
	h.magic = MLENS_REGION_MAGIC;
	if (h.version != MLENS_PROTO_VERSION)
		return fail(-EPROTO, why, why_len,
			    "region: protocol version %u, this library speaks %u: update "
			    "libmlens or mlensd", h.version, MLENS_PROTO_VERSION);
	if (h.hdr_size != sizeof(h))
		return fail(-EPROTO, why, why_len, "region: header of %u bytes, want %zu",
			    h.hdr_size, sizeof(h));
	if (h.flags)
		return fail(-EPROTO, why, why_len, "region: unknown header flags 0x%x", h.flags);
	for (size_t i = 0; i < sizeof(h.reserved) / sizeof(h.reserved[0]); i++)
		if (h.reserved[i])
			return fail(-EPROTO, why, why_len, "region: reserved header bytes set");
	if (h.total_size > size || h.total_size % MLENS_REGION_PAGE)
		return fail(-EINVAL, why, why_len,
			    "region: header says %llu bytes, mapping has %zu (want a whole "
			    "number of pages, no more than mapped)",
			    (unsigned long long)h.total_size, size);

	d[0] = &h.sub;
	d[1] = &h.cmpl;
	d[2] = &h.prompt;
	err = check_desc(d[0], names[0], sizeof(struct mlens_sub), h.total_size, why, why_len);
	if (!err)
		err = check_desc(d[1], names[1], sizeof(struct mlens_cmpl), h.total_size, why,
				 why_len);
	if (!err)
		err = check_desc(d[2], names[2], 1, h.total_size, why, why_len);
	if (err)
		return err;
	for (int i = 0; i < 3; i++)
		for (int j = i + 1; j < 3; j++)
			if (overlap(d[i], d[j]))
				return fail(-EINVAL, why, why_len,
					    "region: %s and %s rings overlap", names[i],
					    names[j]);

	err = mlens_limits_validate(&h.limits, why, why_len);
	if (err)
		return err;
	if (h.limits.prompt_bytes != h.prompt.entries)
		return fail(-EINVAL, why, why_len,
			    "region: limits name a %u-byte prompt ring, the ring has %u",
			    h.limits.prompt_bytes, h.prompt.entries);

	err = mlens_ring_attach(&rg->sub, base + h.sub.offset, h.sub.size);
	if (!err && (rg->sub.entries != h.sub.entries || rg->sub.esize != h.sub.esize))
		err = -EINVAL;
	if (err)
		return fail(err, why, why_len, "region: submission ring header %s",
			    err == -EPROTO ? "has a bad magic" :
			    "disagrees with the region or has corrupt indexes");
	err = mlens_ring_attach(&rg->cmpl, base + h.cmpl.offset, h.cmpl.size);
	if (!err && (rg->cmpl.entries != h.cmpl.entries || rg->cmpl.esize != h.cmpl.esize))
		err = -EINVAL;
	if (err)
		return fail(err, why, why_len, "region: completion ring header %s",
			    err == -EPROTO ? "has a bad magic" :
			    "disagrees with the region or has corrupt indexes");
	err = mlens_bytering_attach(&rg->prompt, base + h.prompt.offset, h.prompt.size);
	if (!err && rg->prompt.ring.entries != h.prompt.entries)
		err = -EINVAL;
	if (err)
		return fail(err, why, why_len, "region: prompt ring header %s",
			    err == -EPROTO ? "has a bad magic" :
			    "disagrees with the region or has corrupt indexes");

	rg->base = mem;
	rg->size = h.total_size;
	rg->map_size = 0;
	rg->limits = h.limits;
	return 0;
}

/* ==== memfd ==== */

int mlens_region_create(struct mlens_region *rg, int *fd, const struct mlens_region_params *p,
			const struct mlens_region_limits *lim, char *why, size_t why_len)
{
	size_t size;
	void *mem;
	int mfd, err;

	if (mlens_region_size(p, &size))
		return fail(-EINVAL, why, why_len,
			    "region: ring sizes %u/%u/%u must be powers of two (prompt ring "
			    "at least %u bytes)", p->sub_entries, p->cmpl_entries,
			    p->prompt_bytes, MLENS_BYTERING_MIN_SIZE);
	mfd = memfd_create("mlens-tenant", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (mfd < 0)
		return fail(-errno, why, why_len, "region: memfd_create: %s", strerror(errno));
	if (ftruncate(mfd, (off_t)size)) {
		err = fail(-errno, why, why_len, "region: sizing the memfd to %zu bytes: %s",
			   size, strerror(errno));
		goto close_fd;
	}
	/* Sealed before the tenant ever sees it: a shrink would turn the
	 * daemon's next access into SIGBUS. */
	if (fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) {
		err = fail(-errno, why, why_len, "region: sealing the memfd: %s", strerror(errno));
		goto close_fd;
	}
	mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
	if (mem == MAP_FAILED) {
		err = fail(-errno, why, why_len, "region: mapping %zu bytes: %s", size,
			   strerror(errno));
		goto close_fd;
	}
	err = mlens_region_format(rg, mem, size, p, lim, why, why_len);
	if (err)
		goto unmap;
	rg->map_size = size;
	*fd = mfd;
	return 0;
unmap:
	munmap(mem, size);
close_fd:
	close(mfd);
	return err;
}

int mlens_region_map(struct mlens_region *rg, int fd, char *why, size_t why_len)
{
	struct stat st;
	void *mem;
	int seals, err;

	if (fstat(fd, &st))
		return fail(-errno, why, why_len, "region: fstat: %s", strerror(errno));
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0 || !(seals & F_SEAL_SHRINK))
		return fail(-EPERM, why, why_len,
			    "region: the memfd is not sealed against shrinking; is the peer "
			    "really mlensd?");
	if (st.st_size < (off_t)sizeof(struct mlens_region_hdr) || (uint64_t)st.st_size > SIZE_MAX)
		return fail(-EINVAL, why, why_len, "region: memfd of %lld bytes",
			    (long long)st.st_size);
	mem = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (mem == MAP_FAILED)
		return fail(-errno, why, why_len, "region: mapping %lld bytes: %s",
			    (long long)st.st_size, strerror(errno));
	err = mlens_region_attach(rg, mem, (size_t)st.st_size, why, why_len);
	if (err) {
		munmap(mem, (size_t)st.st_size);
		return err;
	}
	rg->map_size = (size_t)st.st_size;
	return 0;
}

void mlens_region_unmap(struct mlens_region *rg)
{
	if (rg->map_size)
		munmap(rg->base, rg->map_size);
	rg->base = NULL;
	rg->map_size = 0;
}

/* ==== Submitting and taking requests ==== */

int mlens_region_submit(struct mlens_region *rg, struct mlens_sub *s, const int32_t *tokens,
			int daemon_efd)
{
	int free_, err;

	free_ = mlens_ring_free_count(&rg->sub);
	if (free_ < 0)
		return free_;
	if (free_ == 0)
		return -EAGAIN;
	if (s->op == MLENS_OP_GENERATE) {
		uint32_t off;
		void *dst;

		if (s->prompt_len == 0)
			return -EINVAL;
		if (s->prompt_len > rg->limits.max_prompt_tokens)
			return -EMSGSIZE;
		/* The submission slot is known free first, so a prompt is
		 * never left reserved without the entry that names it. */
		err = mlens_bytering_reserve(&rg->prompt, s->prompt_len * (uint32_t)sizeof(int32_t),
					     &off, &dst);
		if (err)
			return err;
		memcpy(dst, tokens, (size_t)s->prompt_len * sizeof(int32_t));
		mlens_bytering_commit(&rg->prompt);
		s->prompt_off = off;
	}
	if (mlens_ring_enqueue_bulk(&rg->sub, s, 1) != 1)
		return -EPROTO;	/* we saw a free slot and are the only producer */
	if (daemon_efd >= 0) {
		err = mlens_ring_wake_cons(&rg->sub, daemon_efd);
		if (err < 0)
			return err;
	}
	return 0;
}

int mlens_region_wait_submit(struct mlens_region *rg, int client_efd, uint32_t prompt_len,
			     int timeout_ms)
{
	int n;

	if (prompt_len > rg->limits.max_prompt_tokens)
		return -EMSGSIZE;
	/* Free space only grows while we wait (we are the only producer), so
	 * after the second wait the first still holds. */
	n = mlens_ring_wait_prod(&rg->sub, client_efd, 1, timeout_ms);
	if (n <= 0 || prompt_len == 0)
		return n > 0 ? 1 : n;
	return mlens_bytering_wait_reserve(&rg->prompt, client_efd,
					   prompt_len * (uint32_t)sizeof(int32_t), timeout_ms);
}

int mlens_region_take(struct mlens_region *rg, struct mlens_sub *s, int32_t *tokens,
		      int *status, char *why, size_t why_len)
{
	uint64_t bytes;
	int n, err;

	n = mlens_ring_dequeue_bulk(&rg->sub, s, 1);
	if (n <= 0)
		return n;
	*status = mlens_sub_validate(s, &rg->limits, why, why_len);
	if (s->op != MLENS_OP_GENERATE)
		return 1;
	bytes = (uint64_t)s->prompt_len * sizeof(int32_t);
	if (*status == 0) {
		err = mlens_bytering_read(&rg->prompt, s->prompt_off, (uint32_t)bytes, tokens);
		if (err == -EPROTO)
			return err;
		if (err) {
			*status = fail(err, why, why_len,
				       "prompt record at %u (%u tokens) is not the next one "
				       "committed in the prompt ring", s->prompt_off, s->prompt_len);
			return 1;
		}
		*status = mlens_prompt_validate(tokens, s->prompt_len, &rg->limits, why, why_len);
	}
	/* Free the record even for a rejected request, when it can be found,
	 * so the tenant's prompt ring does not fill up with dead records. */
	if (bytes && bytes <= UINT32_MAX) {
		err = mlens_bytering_release(&rg->prompt, s->prompt_off, (uint32_t)bytes);
		if (err == -EPROTO)
			return err;
	}
	return 1;
}
