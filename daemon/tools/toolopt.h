/* What the tools' command lines share: an integer option held to a range,
 * or exit status 2 with a message naming the program, the option and the
 * range. */
#ifndef MLENS_TOOLOPT_H
#define MLENS_TOOLOPT_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

static inline long mlens_tool_num(const char *prog, const char *opt, const char *s, long lo,
				  long hi)
{
	char *end;
	long v;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || *end || v < lo || v > hi) {
		fprintf(stderr, "%s: %s wants an integer in [%ld, %ld], got '%s'\n", prog, opt, lo, hi, s);
		exit(2);
	}
	return v;
}

#endif
