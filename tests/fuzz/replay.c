/* Description: replay every file of the committed fuzz corpus through
 * LLVMFuzzerTestOneInput, so make check (and its ASan/UBSan build) proves
 * the parsers survive known-bad inputs without needing clang. */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The corpus under the source tree, unless argv[1] names one; each
 * target's replay program sets its own. */
#ifndef REPLAY_CORPUS
#define REPLAY_CORPUS "tests/fuzz/corpus"
#endif

/* Exactly sized heap copy, so an overread trips ASan. */
static int replay(const char *path)
{
	FILE *f = fopen(path, "rb");
	uint8_t *buf = NULL;
	long n;

	if (!f || fseek(f, 0, SEEK_END) || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET)) {
		fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
		if (f)
			fclose(f);
		return -1;
	}
	buf = malloc(n ? (size_t)n : 1);
	if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
		fprintf(stderr, "replay: %s: read failed\n", path);
		free(buf);
		fclose(f);
		return -1;
	}
	fclose(f);
	LLVMFuzzerTestOneInput(buf, (size_t)n);
	free(buf);
	return 0;
}

int main(int argc, char **argv)
{
	const char *src = getenv("MLENS_SRCDIR");
	char dir[4096], path[8192];
	struct dirent *e;
	DIR *d;
	int n = 0, bad = 0;

	if (argc > 1)
		snprintf(dir, sizeof(dir), "%s", argv[1]);
	else
		snprintf(dir, sizeof(dir), "%s/" REPLAY_CORPUS, src ? src : ".");
	d = opendir(dir);
	if (!d) {
		fprintf(stderr, "replay: %s: %s\n", dir, strerror(errno));
		return 1;
	}
	while ((e = readdir(d))) {
		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		if (replay(path))
			bad++;
		else
			n++;
	}
	closedir(d);
	printf("replay: %d corpus files from %s, %d unreadable\n", n, dir, bad);
	return n == 0 || bad ? 1 : 0;
}
