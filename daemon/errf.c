/* mlens_errf: see errf.h. */
#include <stdarg.h>
#include <stdio.h>
#include "daemon/errf.h"

void mlens_errf(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (!err || !errlen)
		return;
	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
}
