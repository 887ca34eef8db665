# client: see top-level Makefile.am
