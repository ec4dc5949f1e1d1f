/*
 * fuzz.c -- random-operation stress driver for the gpumem core on the sim device.
 *
 *   fuzz [--threads N] [--capacity BYTES] [--history N] [--chunk-pages N] [--page-size BYTES] [--quiet]
 *        [ops=1000000] [seed=1]
 *
 * Single-threaded mode drives one heap with a random mix of gm_malloc (sizes
 * log-uniform from 1 B to 256 MiB on 3 streams), gm_free, gm_record_stream,
 * stream holds, gm_empty_cache, gm_set_cap, private pools (retain/release,
 * allocations in a pool, checkpoint and restore with gm_pool_live/set_live,
 * pause and resume with and without a backup, whose contents are checked),
 * stream captures (gm_capture_begin/end with the sim in capture mode, which
 * refuses and counts every call a capture forbids) and phases of random fault
 * injection, and checks every result against a shadow model kept here,
 * independently of the core.  Threaded mode hammers one heap from N pthreads (each on its own
 * stream) and checks overlap through a shared shadow; each thread keeps a
 * private pool for part of its blocks, and pauses and resumes it now and then.
 * Both first check gm_array_grow (doubling, and refusing sizes past size_t) and
 * fork() with a lock handed to the core by gm_fork_also (the order fork takes
 * the locks in, and a forked child's heap).
 *
 * Physical allocations: without --chunk-pages, a single-threaded run does its
 * first half of the ops on a heap with chunk_pages 1 and the second half on a
 * fresh one with chunk_pages 2..16 (from the seed); a threaded run uses 1 for
 * even seeds, 16 for odd ones.  A single-threaded run on an odd seed lets
 * the heap split chunks (split_chunks 1).  --page-size runs the heap on pages of that
 * size (a power of two; default the simulated device's 2 MiB), as
 * Heap(page_size=...) does.
 *
 * Exit status 0 on success; on the first violation it prints the op index and
 * seed (enough to reproduce: the run is deterministic for a given seed in
 * single-threaded mode) and exits 1.
 */
#include "fuzz.h"

#include "args.h"

/* ---- single-threaded run ----------------------------------------------------- */

static void open_world(world *w, size_t capacity, size_t chunk_pages) {
    memset(w, 0, sizeof *w);
    w->capacity = capacity;
    w->dev = gm_sim_create(capacity, g_page_size);
    if (!w->dev) fail("gm_sim_create failed");
    w->page = w->dev->page_size;
    gm_config cfg;
    gm_config_default(&cfg);
    cfg.chunk_pages = chunk_pages;
    cfg.spill = g_seed % 3 ? 0 : capacity / 4; /* every third seed spills, "old", "new" and "lasting" in turn */
    cfg.spill_choice = g_seed / 3 % 3;
    cfg.split_chunks = g_seed % 2; /* odd seeds split chunks under pressure (one thread: no one else writes) */
    int rc = gm_heap_create(w->dev, &cfg, &w->heap);
    if (rc != GM_OK) fail("gm_heap_create returned %d (%s)", rc, gm_strerror(rc));
    gm_snapshot *snap;
    if (gm_snapshot_take(w->heap, &snap) != GM_OK) fail("gm_snapshot_take failed");
    w->va_base = snap->va_base;
    w->va_size = snap->va_size;
    gm_snapshot_free(snap);
    g_heap = w->heap;
    if (g_history) gm_history_enable(w->heap, g_history);
    if (w->va_size < capacity) fail("heap reserved only %zu bytes of VA for %zu of memory", w->va_size, capacity);
}

/* Release every use the fuzzer holds of pool i (the pool ends). */
static void release_pool_uses(world *w, int i) {
    while (w->pool_uses[i]) {
        if (gm_pool_release(w->heap, pool_id(i)) != GM_OK) fail("teardown gm_pool_release(%d) failed", i);
        if (!--w->pool_uses[i]) pf_drop_pool(w, i);
    }
}

/* Let go of the streams the fuzzer holds, completing what waits on them. */
static void unhold_streams(world *w) {
    for (int s = 0; s < NSTREAMS; s++)
        if (w->held[s]) {
            gm_sim_hold_stream(w->dev, STREAMS[s], 0);
            w->held[s] = 0;
            q_release_stream(w, s);
        }
}

/* Free everything, release everything, and check that nothing is left. */
void close_world(world *w) {
    g_phase = "teardown";
    set_faults(w, NULL, 0);
    if (w->capturing) op_capture(w);
    /* Everything freed (in a paused pool that is bookkeeping), then the paused
     * pools can come back: their memory may have gone to others meanwhile. */
    unhold_streams(w);
    while (w->live.n) {
        blk b = sh_remove(&w->live, w->live.n - 1);
        if (gm_free(w->heap, b.addr) != GM_OK) fail("teardown gm_free(%#" PRIxPTR ") failed", b.addr);
    }
    /* Other pools' free memory is theirs until they end. */
    for (int i = 0; i < NPOOLS; i++)
        if (!w->paused[i]) release_pool_uses(w, i);
    gm_set_cap(w->heap, 0); /* a cap below the paused pages would refuse them */
    w->cap = 0;
    /* Paused pools may together need more than the device has: one at a
     * time.  The free pages of a chunk of several pages (growth's, or an
     * earlier resume's) that another paused pool's kept pages share cannot go
     * until that pool ends, so a resume refused for lack of memory is tried
     * again after the others; only a round in which none comes back fails. */
    for (int progress = 1, left = 1; left && progress;) {
        progress = left = 0;
        for (int i = 0; i < NPOOLS; i++) {
            if (!w->paused[i]) continue;
            int rc = gm_pool_resume(w->heap, pool_id(i), NULL);
            if (rc == GM_ENOMEM) {
                left = 1;
                continue;
            }
            if (rc != GM_OK) fail("teardown gm_pool_resume(%d) returned %d (%s)", i, rc, gm_strerror(rc));
            w->paused[i] = 0;
            progress = 1;
            /* Its memory turns general for the next: a chunk it shares with
             * another pool's blocks could not go otherwise. */
            release_pool_uses(w, i);
        }
        if (left && !progress) fail("teardown: no paused pool could be resumed");
    }
    for (int i = 0; i < NPOOLS; i++) release_pool_uses(w, i);
    unhold_streams(w);
    while (w->live.n) {
        blk b = sh_remove(&w->live, w->live.n - 1);
        int rc = gm_free(w->heap, b.addr);
        if (rc != GM_OK) fail("teardown gm_free(%#" PRIxPTR ") returned %d", b.addr, rc);
    }
    int rc = gm_empty_cache(w->heap);
    if (rc != GM_OK) fail("teardown gm_empty_cache returned %d", rc);
    run_check(w, "teardown");
    gm_stats st;
    gm_get_stats(w->heap, &st);
    if (st.reserved_bytes[GM_POOL_ALL].current || st.segment[GM_POOL_ALL].current || st.active[GM_POOL_ALL].current ||
        st.active_bytes[GM_POOL_ALL].current)
        fail("teardown: reserved %" PRId64 ", segments %" PRId64 ", active %" PRId64 "/%" PRId64 " bytes left",
             st.reserved_bytes[GM_POOL_ALL].current, st.segment[GM_POOL_ALL].current, st.active[GM_POOL_ALL].current,
             st.active_bytes[GM_POOL_ALL].current);
    gm_sim_info si;
    gm_sim_info_get(w->dev, &si);
    if (si.pages_created || si.pages_mapped)
        fail("teardown: the sim still holds %zu created and %zu mapped pages", si.pages_created, si.pages_mapped);
    g_heap = NULL;
    gm_heap_destroy(w->heap);
    free(w->live.v);
    free(w->q);
    free(w->pf);
}

static int run_single(uint64_t ops, uint64_t seed, size_t capacity, int quiet) {
    rng_t r = {seed};
    rng_t delay_rng = {seed ^ 0x5eed0fde1a7ull}; /* its own stream: the op sequence is the same */
    world w;
    size_t chunks = g_chunk_pages ? g_chunk_pages : 1, later = 2 + seed % 15;
    open_world(&w, capacity, chunks);
    uint64_t phase_end = 0;
    g_phase = "normal";
    for (g_op = 0; g_op < ops; g_op++) {
        if (!g_chunk_pages && g_op == ops / 2 && g_op) {
            /* The second half on a heap that makes chunks of several pages. */
            run_check(&w, "half");
            close_world(&w);
            open_world(&w, capacity, chunks = later);
            phase_end = g_op;
        }
        if (g_op == phase_end) {
            /* Phases of a few thousand ops: a third with faults injected. */
            int faults = chance(&r, 330000);
            set_faults(&w, &r, faults);
            g_phase = faults ? "faults" : "normal";
            w.n_fault_phases += faults;
            phase_end = g_op + 2000 + rnd_below(&r, 8000);
            /* Events that complete late in half of the phases. */
            static const uint64_t delays[] = {0, 0, 0, 0, 1, 3, 20, 200};
            gm_sim_set_event_delay(w.dev, delays[rnd_below(&delay_rng, 8)]);
            if (faults) {
                /* Faults leave the heap in states a clean run never reaches;
                 * check it before and after each such phase. */
                run_check(&w, "phase start");
            }
        }
        unsigned x = (unsigned)rnd_below(&r, 1000000);
        /* Keep the live set bounded: with a full device, lean to frees. */
        unsigned p_malloc = w.live.n > 3000 ? 400000 : 520000;
        if (x < p_malloc) {
            op_malloc(&w, &r);
        } else {
            op_drawn(&w, &r, x);
        }
        if (g_op % 4096 == 4095) run_check(&w, "periodic");
    }
    run_check(&w, "end");
    gm_stats st;
    gm_get_stats(w.heap, &st);
    close_world(&w);
    if (!quiet)
        printf("fuzz: OK %" PRIu64 " ops seed %" PRIu64 " cap %zu MiB page %zu KiB chunk_pages %zu%s: %" PRIu64
               " mallocs (%" PRIu64 " ok, %" PRIu64 " oom, %" PRIu64 " device errors), %" PRIu64 " frees, %" PRIu64
               " bad frees, %" PRIu64 " record_stream, %" PRIu64 " holds, %" PRIu64 " empty_cache, %" PRIu64
               " set_cap, %" PRIu64 " in pools, %" PRIu64 " pool retain/release, %" PRIu64 " set_live, %" PRIu64
               " pauses, %" PRIu64 " resumes (%" PRIu64 " pages restored), %" PRIu64 " captures, %" PRIu64
               " fault phases, %" PRIu64 " checks, %" PRIu64 " quarantine hits (%" PRIu64 " handed off); core: %" PRId64
               " remaps, %" PRId64 " pages created, %" PRId64 " retries, %" PRId64 " syncs, %" PRId64
               " hand-offs, %" PRId64 " spills, %" PRId64 " unspills, %" PRId64 " chunk splits\n",
               ops, seed, capacity >> 20, w.page >> 10, chunks,
               g_chunk_pages ? "" : " (1 in the first half; counts: the second)", w.n_malloc, w.n_malloc_ok, w.n_oom,
               w.n_devfail, w.n_free, w.n_bad_free, w.n_record, w.n_hold, w.n_empty, w.n_setcap, w.n_pool_malloc,
               w.n_pool_ops, w.n_set_live, w.n_pauses, w.n_resumes, w.n_restored, w.n_captures, w.n_fault_phases,
               w.n_check, w.n_quar_checked, w.n_handed, st.num_remaps, st.num_device_alloc, st.num_alloc_retries,
               st.num_sync_all_streams, st.num_stream_handoffs, st.num_spills, st.num_unspills, st.num_chunk_splits);
    return 0;
}

/* ---- main ------------------------------------------------------------------- */

/* ---- fork(): locks handed to the core with gm_fork_also -------------------------
 * As the torch boundary does, a lock of our own is held while calling into the
 * core.  fork() must take it before any heap lock (or the call below, made
 * from inside the prepare step, would wait for a heap lock fork already holds:
 * SIGALRM then ends the run), release it in the parent and in the child, and
 * leave the heaps usable in the child. */
static pthread_mutex_t also_mu = PTHREAD_MUTEX_INITIALIZER;
static gm_heap *also_heap; /* the heap the lock's holder calls into; NULL after the check */
static int also_locks, also_unlocks;

static void also_lock(void) {
    pthread_mutex_lock(&also_mu);
    if (also_heap) {
        gm_oom_info info;
        gm_memory_report(also_heap, 0, &info);
    }
    also_locks++;
}

static void also_unlock(void) {
    also_unlocks++;
    pthread_mutex_unlock(&also_mu);
}

/* gm_array_grow: starts at `first`, doubles, keeps the contents; a size past
 * size_t fails with the array and its capacity untouched. */
static void check_array_grow(void) {
    g_phase = "array_grow";
    size_t cap = 0;
    uint64_t *a = gm_array_grow(NULL, &cap, 3, sizeof *a);
    if (!a || cap != 3) fail("gm_array_grow from empty: %p, capacity %zu (want 3)", (void *)a, cap);
    for (size_t i = 0; i < cap; i++) a[i] = i + 7;
    uint64_t *b = gm_array_grow(a, &cap, 3, sizeof *b);
    if (!b || cap != 6) fail("gm_array_grow doubling: %p, capacity %zu (want 6)", (void *)b, cap);
    for (size_t i = 0; i < 3; i++)
        if (b[i] != i + 7) fail("gm_array_grow lost element %zu", i);
    size_t huge[] = {SIZE_MAX / 2 + 1, SIZE_MAX / (2 * sizeof *b) + 1, SIZE_MAX};
    for (size_t k = 0; k < sizeof huge / sizeof *huge; k++) {
        size_t c = huge[k];
        if (gm_array_grow(b, &c, 3, sizeof *b) || c != huge[k])
            fail("gm_array_grow accepted capacity %zu * 2 elements of %zu bytes", huge[k], sizeof *b);
    }
    if (b[2] != 9) fail("gm_array_grow changed the array it refused to grow");
    free(b);
}

static void check_fork_also(void) {
    g_phase = "fork";
    if (gm_fork_also(also_lock, NULL) != GM_EINVAL) fail("gm_fork_also accepted a NULL unlock");
    if (gm_fork_also(also_lock, also_unlock) != GM_OK || gm_fork_also(also_lock, also_unlock) != GM_OK)
        fail("gm_fork_also refused a pair");
    gm_device *dev = gm_sim_create(256 * MiB, 0);
    gm_config cfg;
    gm_config_default(&cfg);
    if (!dev || gm_heap_create(dev, &cfg, &also_heap) != GM_OK) fail("gm_heap_create failed");
    uintptr_t p;
    if (gm_malloc(also_heap, 3 * MiB, 0, 0, &p) != GM_OK) fail("gm_malloc failed");
    alarm(60);
    pid_t pid = fork();
    if (pid < 0) fail("fork: %s", strerror(errno));
    if (pid == 0) {
        /* One pair counted once; our lock free again; the heap still works. */
        uintptr_t q;
        char why[256];
        int ok = also_locks == 1 && also_unlocks == 1 && pthread_mutex_trylock(&also_mu) == 0 &&
                 gm_free(also_heap, p) == GM_OK && gm_malloc(also_heap, MiB, 0, 0, &q) == GM_OK &&
                 gm_free(also_heap, q) == GM_OK && gm_check(also_heap, why, sizeof why) == GM_OK;
        _exit(ok ? 0 : 1);
    }
    int status;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail("forked child: status %#x (locks %d, unlocks %d in the parent)", status, also_locks, also_unlocks);
    alarm(0);
    if (also_locks != 1 || also_unlocks != 1 || pthread_mutex_trylock(&also_mu) != 0)
        fail("parent after fork: locks %d, unlocks %d, or our lock still held", also_locks, also_unlocks);
    pthread_mutex_unlock(&also_mu);
    if (gm_free(also_heap, p) != GM_OK) fail("gm_free after fork failed");
    gm_heap *h = also_heap;
    also_heap = NULL;
    gm_heap_destroy(h);
    g_phase = "setup";
}

static uint64_t parse_u64(const char *s, const char *what) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s) {
        fprintf(stderr, "fuzz: bad %s '%s'\n", what, s);
        exit(2);
    }
    /* Allow a size suffix for --capacity. */
    if (*end == 'G')
        v <<= 30;
    else if (*end == 'M')
        v <<= 20;
    else if (*end) {
        fprintf(stderr, "fuzz: bad %s '%s'\n", what, s);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv) {
    uint64_t ops = 1000000, seed = 1;
    int threads = 0, quiet = 0, npos = 0;
    size_t capacity = 4 * GiB;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = (int)parse_u64(argv[++i], "thread count");
        else if (!strcmp(argv[i], "--capacity") && i + 1 < argc)
            capacity = parse_u64(argv[++i], "capacity");
        else if (!strcmp(argv[i], "--quiet"))
            quiet = 1;
        else if (!strcmp(argv[i], "--history") && i + 1 < argc)
            g_history = (size_t)parse_u64(argv[++i], "history size");
        else if (!strcmp(argv[i], "--chunk-pages") && i + 1 < argc)
            g_chunk_pages = (size_t)parse_u64(argv[++i], "chunk pages");
        else if (!strcmp(argv[i], "--page-size") && i + 1 < argc)
            g_page_size = (size_t)parse_u64(argv[++i], "page size");
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: %s [--threads N] [--capacity BYTES|NG|NM] [--history N] [--chunk-pages N] "
                   "[--page-size BYTES|NM] [--quiet] [ops=1000000] [seed=1]\n",
                   argv[0]);
            return 0;
        } else if (!take_ops_or_seed(argv[i], &npos, &ops, &seed, parse_u64,
                                     (const char *const[]){"op count", "seed"})) {
            fprintf(stderr, "fuzz: unknown argument '%s' (try --help)\n", argv[i]);
            return 2;
        }
    }
    if (capacity < 256 * MiB) {
        fprintf(stderr, "fuzz: capacity must be at least 256 MiB\n");
        return 2;
    }
    if (g_page_size & (g_page_size - 1) || (g_page_size && (g_page_size < 4096 || g_page_size > 64 * MiB))) {
        fprintf(stderr, "fuzz: page size must be a power of two from 4 KiB to 64 MiB\n");
        return 2;
    }
    g_seed = seed;
    check_array_grow();
    check_fork_also();
    if (threads > 0) return run_threads(threads, ops, seed, capacity, quiet);
    return run_single(ops, seed, capacity, quiet);
}
