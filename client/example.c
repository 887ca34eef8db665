/* Description: the smallest complete libmlens program, through the public
 * API only: attach, print the limits, submit one greedy request of the
 * token ids given as arguments, print its tokens as they arrive, detach.
 *   usage: example SOCKET TOKEN... */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <mlens.h>

int main(int argc, char **argv)
{
	struct mlens_limits lim = { .size = sizeof(lim) };
	struct mlens_request req = { .size = sizeof(req) };
	struct mlens_event ev[16];
	struct mlens *m;
	int32_t *prompt;
	uint64_t id;
	int n, err, done = 0, status = 1;

	if (argc < 3) {
		fprintf(stderr, "usage: %s SOCKET TOKEN...\n", argv[0]);
		return 2;
	}
	prompt = calloc((size_t)argc - 2, sizeof(*prompt));
	if (!prompt)
		return 1;
	for (int i = 2; i < argc; i++)
		prompt[i - 2] = (int32_t)strtol(argv[i], NULL, 10);

	err = mlens_open(argv[1], "example", &m);
	if (err) {
		fprintf(stderr, "cannot attach to %s: %s\n", argv[1], mlens_strerror(err));
		goto out;
	}
	mlens_limits(m, &lim);
	printf("vocabulary %u, context %u, at most %u prompt and %u generated tokens\n",
	       lim.vocab_size, lim.max_context, lim.max_prompt_tokens, lim.max_tokens);

	req.prompt = prompt;
	req.n_prompt = (uint32_t)argc - 2;
	req.max_tokens = 16;
	req.timeout_ms = -1;		/* wait for room in the rings */
	err = mlens_submit(m, &req, &id);
	if (err) {
		fprintf(stderr, "submit: %s\n", mlens_strerror(err));
		goto close;
	}
	while (!done) {
		n = mlens_wait(m, ev, 16, -1);
		if (n < 0) {
			fprintf(stderr, "wait: %s\n", mlens_strerror(n));
			goto close;
		}
		for (int i = 0; i < n; i++) {
			if (ev[i].id != id)
				continue;
			if (ev[i].flags & MLENS_EV_TOKEN)
				printf("%d ", ev[i].token);
			if (ev[i].flags & MLENS_EV_LAST) {
				done = 1;
				if (ev[i].finish == MLENS_REASON_ERROR)
					fprintf(stderr, "\nrequest failed: %s\n",
						mlens_strerror(ev[i].status));
				else
					status = 0;
			}
		}
	}
	printf("\n");
close:
	mlens_close(m);
out:
	free(prompt);
	return status;
}
