/*
 * debug.h -- h_assert(cond): a cheap check at a state change, compiled in
 * only when GM_DEBUG is defined (the sanitizer and fuzz builds: Makefile,
 * .ci/run); the release extension compiles it out, condition and all.  A
 * failing assertion prints its file, line and condition and aborts.
 *
 * The whole-heap invariants are checked by gm_check (check.c); these are the
 * local facts a state change relies on, checked where it happens.
 */
#ifndef GPUMEM_DEBUG_H
#define GPUMEM_DEBUG_H

#ifdef GM_DEBUG
#include <stdio.h>
#include <stdlib.h>

static inline void h_assert_failed(const char *file, int line, const char *cond) {
    fprintf(stderr, "%s:%d: gpumem assertion failed: %s\n", file, line, cond);
    fflush(stderr);
    abort();
}
#define h_assert(cond) ((cond) ? (void)0 : h_assert_failed(__FILE__, __LINE__, #cond))
#else
/* Not evaluated, but still compiled: a condition that stops compiling, or a
 * variable only an assertion reads, shows in every build. */
#define h_assert(cond) ((void)sizeof(!(cond)))
#endif

#endif
