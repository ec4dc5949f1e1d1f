/*
 * rng.h -- the fuzz drivers' random numbers: splitmix64, tiny, good enough, and
 * identical on every platform, so that a seed reproduces a run anywhere.
 */
#ifndef GPUMEM_TESTS_RNG_H
#define GPUMEM_TESTS_RNG_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t s;
} rng_t;

static inline uint64_t rnd(rng_t *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline uint64_t rnd_below(rng_t *r, uint64_t n) { return n ? rnd(r) % n : 0; }
static inline int chance(rng_t *r, unsigned per_million) { return rnd_below(r, 1000000) < per_million; }

/* Log-uniform over [1, 2^28): pick an octave, then a point inside it (no libm). */
static inline size_t rnd_size(rng_t *r) {
    unsigned e = (unsigned)rnd_below(r, 28);
    size_t lo = (size_t)1 << e;
    return lo + (size_t)rnd_below(r, lo);
}

#endif
