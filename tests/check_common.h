/* What the Check suites share: byte units and the runner every
 * tests/check_<part>.c ends with (exit 0 when every test passed). */
#ifndef MLENS_CHECK_COMMON_H
#define MLENS_CHECK_COMMON_H

#include <check.h>
#include <stdlib.h>

#define GIB (1024ull * 1024ull * 1024ull)

/* Runs the suite (its tcases as added), frees it; the exit status. */
static inline int mlens_check_run(Suite *s)
{
	SRunner *sr = srunner_create(s);
	int failed;
	srunner_run_all(sr, CK_NORMAL);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

#endif
