/*
 * args.h -- the fuzz drivers' positional arguments, [ops] [seed], read alike by
 * both (fuzz.c, fuzz_native.c).
 */
#ifndef GPUMEM_TESTS_ARGS_H
#define GPUMEM_TESTS_ARGS_H

#include <stdint.h>

/* arg as the op count (the first positional argument) or the seed (the
 * second), read with parse(arg, names[0 or 1]), which exits on a bad one.
 * *npos counts those read.  1 when arg was one, 0 when it is an option or one
 * too many. */
static inline int take_ops_or_seed(const char *arg, int *npos, uint64_t *ops, uint64_t *seed,
                                   uint64_t (*parse)(const char *, const char *), const char *const names[2]) {
    if (arg[0] == '-' || *npos > 1) return 0;
    *(*npos == 0 ? ops : seed) = parse(arg, names[*npos]);
    (*npos)++;
    return 1;
}

#endif /* GPUMEM_TESTS_ARGS_H */
