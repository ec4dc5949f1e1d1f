/*
 * fuzz.h -- what the parts of the fuzz driver share (fuzz.c says what the
 * driver does): the shadow model of the heap (fuzz_model.c), the operations
 * (fuzz_ops.c) and the threaded run (fuzz_threads.c).
 */
#ifndef GPUMEM_FUZZ_H
#define GPUMEM_FUZZ_H

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpumem/array.h"
#include "gpumem/gpumem.h"
#include "gpumem/sim.h"
#include "rng.h"

#define MiB        ((size_t)1 << 20)
#define GiB        ((size_t)1 << 30)
#define NSTREAMS   3
#define FREED_RING 64
#define NPOOLS     3

/* Streams are arbitrary handle values; 0 is the legacy default stream. */
static const gm_stream STREAMS[NSTREAMS] = {0, 0x7f0000001000ull, 0x7f0000002000ull};

extern uint64_t g_seed;
extern size_t g_chunk_pages; /* --chunk-pages; 0: chosen per run (see the top) */
extern size_t g_page_size;   /* --page-size; 0: the simulated device's default */
extern gm_heap *g_heap;      /* for the history dump on failure */
extern uintptr_t g_addr;     /* address the failure is about (0 if none) */
extern size_t g_history;     /* --history N: entries to keep */
extern uint64_t g_op;        /* op index, for messages (single-thread mode) */
extern const char *g_phase;

typedef struct blk {
    uintptr_t addr;
    size_t size;       /* gm_block_size at allocation */
    size_t req;        /* bytes asked for */
    int stream;        /* index into STREAMS */
    unsigned recorded; /* bitmask of streams named with gm_record_stream */
    int pool;          /* index of the private pool, -1: the general heap */
    uint32_t gen;      /* which life of that pool */
} blk;

typedef struct shadow {
    blk *v;
    size_t n, cap;
    uint64_t bytes, req_bytes;
} shadow;

typedef struct quar {
    uintptr_t addr;
    size_t size;
    int stream;
    unsigned all_mask, other_mask;
    uint64_t freed_at;
} quar;

/* Memory freed into a living pool: no one but that pool may get it, and the
 * pages behind it never change (h0/h1: the physical pages at its two ends). */
typedef struct prange {
    uintptr_t addr;
    size_t size;
    int pool;
    gm_handle h0, h1;
} prange;

typedef struct world {
    gm_heap *heap;
    gm_device *dev;
    size_t capacity, page;
    uintptr_t va_base;
    size_t va_size;
    shadow live;
    uintptr_t freed[FREED_RING];
    size_t nfreed;
    quar *q;
    size_t nq, qcap;
    int held[NSTREAMS];
    int faults_on;
    size_t cap;            /* what we last set */
    int pool_uses[NPOOLS]; /* 0: not living */
    uint32_t pool_gen[NPOOLS];
    prange *pf; /* freed into living pools */
    size_t npf, pfcap;
    int capturing;
    int paused[NPOOLS]; /* gm_pool_pause'd (as the heap says after each call) */
    /* With a backup: the content of each page under the pool's live blocks at
     * the pause, which a resume must give back. */
    struct {
        uintptr_t addr;
        uint64_t value;
    } saved[NPOOLS][64];
    size_t nsaved[NPOOLS];
    int backed[NPOOLS];
    uint64_t n_pauses, n_resumes, n_restored;
    /* counters for the summary */
    uint64_t n_malloc, n_malloc_ok, n_oom, n_devfail, n_free, n_bad_free, n_record, n_empty, n_setcap, n_hold, n_check,
        n_fault_phases, n_quar_checked, n_handed, n_pool_malloc, n_pool_ops, n_set_live, n_captures;
} world;

void fail(const char *fmt, ...);
void *room_for_one(void *v, size_t n, size_t *cap, size_t size, size_t first);
size_t round_up(size_t x, size_t a);
const blk *sh_overlap(const shadow *s, uintptr_t a, size_t size);
long sh_find(const shadow *s, uintptr_t a);
void sh_insert(shadow *s, blk b);
blk sh_remove(shadow *s, size_t i);
gm_pool_id pool_id(int i);
void pf_push(world *w, uintptr_t a, size_t size, int pool);
void pf_take(world *w, uintptr_t a, size_t size, int pool);
void pf_learn_reach(world *w, uintptr_t a, size_t size, int pool);
void pf_drop_pool(world *w, int pool);
void q_add(world *w, const blk *b, unsigned all_mask, unsigned other_mask);
void q_release_stream(world *w, int si);
void q_check_alloc(world *w, uintptr_t a, size_t size, int si);
size_t paused_pages(world *w);
void check_stats(world *w, const char *after);
void run_check(world *w, const char *where);
size_t kept_pages(const world *w, int whole);
size_t device_locked_pages(const world *w);
void op_malloc(world *w, rng_t *r);
void op_drawn(world *w, rng_t *r, unsigned x);
int blk_paused(const world *w, const blk *b);
void op_capture(world *w);
void set_faults(world *w, rng_t *r, int on);
void close_world(world *w);
int run_threads(int nthreads, uint64_t ops, uint64_t seed, size_t capacity, int quiet);

#endif /* GPUMEM_FUZZ_H */
