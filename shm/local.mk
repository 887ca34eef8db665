# shm: see top-level Makefile.am
