/*
 * fuzz_threads.c -- the fuzz driver's threaded run (fuzz.h): N threads on one heap,
 * overlap checked through a shared shadow.
 */
#include "fuzz.h"

/* ---- multi-threaded run -------------------------------------------------------
 * N threads share one heap.  The shared shadow is updated so that it never
 * claims less than the core: a block enters it right after gm_malloc returns and
 * leaves it right before gm_free is called, so an overlap found at insertion is
 * a real double hand-out. */

typedef struct tworld {
    gm_heap *heap;
    gm_device *dev;
    pthread_mutex_t mu;
    shadow live;
    uint64_t ops_per_thread;
    size_t capacity;
    uint64_t seed;
    int nthreads;
    uint64_t freed_for_resume; /* blocks run_threads freed to resume pools left paused */
} tworld;

typedef struct targ {
    tworld *tw;
    int id;
    int paused; /* its pool is still paused at the end (run_threads resumes it) */
    uint64_t mallocs, ooms, frees;
    uintptr_t *mine;
    size_t nmine, capmine;
} targ;

static void tfail(targ *a, uint64_t op, const char *msg, uintptr_t p, size_t size) {
    fprintf(stderr, "FUZZ FAILURE thread %d op %" PRIu64 " (seed %" PRIu64 "): %s (%#" PRIxPTR "+%zu)\n", a->id, op,
            a->tw->seed, msg, p, size);
    exit(1);
}

/* A thread's allocation (in its pool a quarter of the time), checked against the shared shadow. */
static void t_malloc(targ *a, rng_t *rp, uint64_t op, gm_stream stream, const gm_pool_id *pid, int paused) {
    tworld *tw = a->tw;
    /* Smaller sizes than single mode: threads should contend on the lock,
     * not wait on one another's OOMs. */
    size_t size = rnd_size(rp) >> (rnd_below(rp, 2) ? 0 : 6);
    if (!size) size = 1;
    uintptr_t p = 0;
    int in_pool = !rnd_below(rp, 4);
    int rc = gm_malloc_pool(tw->heap, size, stream, (uint64_t)a->id, in_pool ? pid : NULL, &p);
    a->mallocs++;
    if ((rc == GM_EPAUSED) != (in_pool && paused)) tfail(a, op, "gm_malloc_pool: paused pool mismatch", 0, size);
    if (rc == GM_EPAUSED) return;
    if (rc == GM_ENOMEM) {
        a->ooms++;
        return;
    }
    if (rc != GM_OK) tfail(a, op, "gm_malloc failed", 0, size);
    size_t bs = gm_block_size(tw->heap, p);
    if (p % GM_ALIGN || bs < round_up(size, GM_ALIGN)) tfail(a, op, "bad block", p, bs);
    pthread_mutex_lock(&tw->mu);
    const blk *o = sh_overlap(&tw->live, p, bs);
    if (o) tfail(a, op, "new block overlaps a live block of another thread", p, bs);
    sh_insert(&tw->live, (blk){p, bs, size, a->id, 0, -1, 0});
    pthread_mutex_unlock(&tw->mu);
    a->mine = room_for_one(a->mine, a->nmine, &a->capmine, sizeof *a->mine, 256);
    a->mine[a->nmine++] = p;
}

/* A thread frees one of its blocks, handed to another thread's stream first now and then. */
static void t_free(targ *a, rng_t *rp, uint64_t op) {
    tworld *tw = a->tw;
    size_t i = (size_t)rnd_below(rp, a->nmine);
    uintptr_t p = a->mine[i];
    a->mine[i] = a->mine[--a->nmine];
    if (rnd_below(rp, 8) == 0) {
        /* Hand the block to another thread's stream before freeing. */
        gm_stream other = 0x1000u * (gm_stream)(1 + rnd_below(rp, (uint64_t)tw->nthreads));
        if (gm_record_stream(tw->heap, p, other) != GM_OK) tfail(a, op, "record_stream failed", p, 0);
    }
    pthread_mutex_lock(&tw->mu);
    long k = sh_find(&tw->live, p);
    if (k < 0) tfail(a, op, "own block missing from shadow", p, 0);
    sh_remove(&tw->live, (size_t)k);
    pthread_mutex_unlock(&tw->mu);
    int rc = gm_free(tw->heap, p);
    a->frees++;
    if (rc != GM_OK) tfail(a, op, "gm_free of own live block failed", p, 0);
}

static void *thread_main(void *arg) {
    targ *a = arg;
    tworld *tw = a->tw;
    rng_t r = {tw->seed * 1000003u + (uint64_t)a->id};
    gm_stream stream = 0x1000u * (gm_stream)(a->id + 1);
    gm_pool_id pid = {0x200u + (uint64_t)a->id, 1};
    if (gm_pool_retain(tw->heap, pid) != GM_OK) tfail(a, 0, "gm_pool_retain failed", 0, 0);
    int paused = 0;
    for (uint64_t op = 0; op < tw->ops_per_thread; op++) {
        unsigned x = (unsigned)rnd_below(&r, 1000);
        if (x < 500 && a->nmine < 4096) {
            t_malloc(a, &r, op, stream, &pid, paused);
        } else if (x < 960 && a->nmine) {
            t_free(a, &r, op);
        } else if (x < 975) {
            if (gm_empty_cache(tw->heap) != GM_OK) tfail(a, op, "gm_empty_cache failed", 0, 0);
        } else if (x < 980) {
            size_t cap = rnd_below(&r, 3) ? 0 : round_up(tw->capacity / 2 + rnd_below(&r, tw->capacity / 2), 2 * MiB);
            if (gm_set_cap(tw->heap, cap) != GM_OK) tfail(a, op, "gm_set_cap failed", 0, cap);
        } else if (x < 982) {
            char why[256] = "";
            if (gm_check(tw->heap, why, sizeof why) != GM_OK) {
                fprintf(stderr, "gm_check: %s\n", why);
                tfail(a, op, "gm_check failed under concurrency", 0, 0);
            }
        } else if (x < 985) {
            /* Readers run beside the writers: what the Python side and the
             * OOM report call from other threads. */
            gm_snapshot *snap = NULL;
            if (gm_snapshot_take(tw->heap, &snap) != GM_OK) tfail(a, op, "gm_snapshot_take failed", 0, 0);
            gm_snapshot_free(snap);
        } else if (x < 988) {
            gm_hist_entry e[16];
            uint64_t dropped = 0;
            if (gm_history_read(tw->heap, e, 16, &dropped) > 16) tfail(a, op, "history read past its buffer", 0, 0);
        } else if (x < 990) {
            gm_oom_info info;
            gm_memory_report(tw->heap, 4 * MiB, &info);
            (void)gm_last_oom(tw->heap, &info);
        } else if (x < 993) {
            /* Pause or resume this thread's pool while the others work. */
            int rc = paused ? gm_pool_resume(tw->heap, pid, NULL)
                            : gm_pool_pause(tw->heap, pid, rnd_below(&r, 2) ? GM_PAUSE_BACKUP : 0, NULL);
            if (rc == GM_OK)
                paused = !paused;
            else if (!(paused && rc == GM_ENOMEM))
                tfail(a, op, paused ? "gm_pool_resume failed" : "gm_pool_pause failed", 0, (size_t)rc);
        } else {
            gm_stats st;
            gm_get_stats(tw->heap, &st);
            if (st.allocated_bytes[GM_POOL_ALL].current < 0 || st.reserved_bytes[GM_POOL_ALL].current < 0)
                tfail(a, op, "negative statistic", 0, 0);
        }
    }
    /* A paused pool cannot end: bring it back if the memory is there now.  It
     * may not be, for as long as anyone likes: every thread keeps its blocks to
     * the end, so once the others have finished nothing frees memory any more.
     * Then run_threads, alone on the heap, frees blocks until it fits. */
    if (paused && gm_pool_resume(tw->heap, pid, NULL) == GM_OK) paused = 0;
    a->paused = paused;
    /* The pool ends; its live blocks join the heap when freed at teardown. */
    if (!paused && gm_pool_release(tw->heap, pid) != GM_OK) tfail(a, 0, "gm_pool_release failed", 0, 0);
    return NULL;
}

/* After the threads: resume thread `a`'s pool, freeing live blocks (highest
 * address first) while the device is too full for it.  With nothing live and no cap
 * the pool's own pages must fit: failing then is the core's fault. */
static void resume_left_paused(tworld *tw, targ *a) {
    gm_pool_id pid = {0x200u + (uint64_t)a->id, 1};
    for (;;) {
        int rc = gm_pool_resume(tw->heap, pid, NULL);
        if (rc == GM_OK) break;
        if (rc != GM_ENOMEM) tfail(a, 0, "gm_pool_resume after the threads failed", 0, (size_t)rc);
        if (tw->live.n) {
            size_t k = tw->live.n - 1;
            uintptr_t p = tw->live.v[k].addr;
            sh_remove(&tw->live, k);
            if (gm_free(tw->heap, p) != GM_OK) tfail(a, 0, "gm_free after the threads failed", p, 0);
            tw->freed_for_resume++;
        } else if (gm_get_cap(tw->heap)) {
            if (gm_set_cap(tw->heap, 0) != GM_OK) tfail(a, 0, "gm_set_cap(0) failed", 0, 0);
        } else {
            tfail(a, 0, "gm_pool_resume is out of memory with nothing live and no cap", 0, 0);
        }
    }
    a->paused = 0;
    if (gm_pool_release(tw->heap, pid) != GM_OK) tfail(a, 0, "gm_pool_release failed", 0, 0);
}

int run_threads(int nthreads, uint64_t ops, uint64_t seed, size_t capacity, int quiet) {
    tworld tw;
    memset(&tw, 0, sizeof tw);
    pthread_mutex_init(&tw.mu, NULL);
    tw.capacity = capacity;
    tw.seed = seed;
    tw.nthreads = nthreads;
    tw.ops_per_thread = ops / (uint64_t)nthreads;
    tw.dev = gm_sim_create(capacity, g_page_size);
    if (!tw.dev) fail("gm_sim_create failed");
    gm_config cfg;
    gm_config_default(&cfg);
    cfg.chunk_pages = g_chunk_pages ? g_chunk_pages : seed % 2 ? 16 : 1;
    int rc = gm_heap_create(tw.dev, &cfg, &tw.heap);
    if (rc != GM_OK) fail("gm_heap_create returned %d", rc);
    if (g_history) gm_history_enable(tw.heap, g_history); /* history writes under the threads too */
    targ *args = calloc((size_t)nthreads, sizeof *args);
    pthread_t *th = calloc((size_t)nthreads, sizeof *th);
    if (!args || !th) {
        perror("calloc");
        exit(2);
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    g_phase = "threads";
    for (int i = 0; i < nthreads; i++) {
        args[i].tw = &tw;
        args[i].id = i;
        if (pthread_create(&th[i], NULL, thread_main, &args[i]) != 0) {
            perror("pthread_create");
            exit(2);
        }
    }
    for (int i = 0; i < nthreads; i++) pthread_join(th[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int left_paused = 0;
    for (int i = 0; i < nthreads; i++)
        if (args[i].paused) {
            left_paused++;
            resume_left_paused(&tw, &args[i]);
        }
    g_op = ops;

    /* Quiescent again: the whole-heap checks hold exactly now. */
    world w;
    memset(&w, 0, sizeof w);
    w.heap = tw.heap;
    w.dev = tw.dev;
    w.capacity = capacity;
    w.page = tw.dev->page_size;
    w.live = tw.live;
    for (size_t i = 0; i < w.live.n; i++) w.live.v[i].stream = 0; /* thread ids are not stream indices */
    char why[512] = "";
    if (gm_check(w.heap, why, sizeof why) != GM_OK) fail("gm_check after threads: %s", why);
    for (size_t i = 0; i < w.live.n; i++)
        if (!gm_sim_is_accessible(w.dev, w.live.v[i].addr, w.live.v[i].size))
            fail("live block %#" PRIxPTR " not accessible after threads", w.live.v[i].addr);
    check_stats(&w, "threads");
    uint64_t mallocs = 0, ooms = 0, frees = 0;
    for (int i = 0; i < nthreads; i++) {
        mallocs += args[i].mallocs;
        ooms += args[i].ooms;
        frees += args[i].frees;
        free(args[i].mine);
    }
    gm_stats st;
    gm_get_stats(w.heap, &st);
    close_world(&w); /* frees w.live.v (== tw.live.v) */
    if (!quiet)
        printf("fuzz: OK %d threads x %" PRIu64 " ops seed %" PRIu64 " cap %zu MiB in %.2f s: %" PRIu64
               " mallocs (%" PRIu64 " oom), %" PRIu64 " frees, %d pool(s) resumed after the threads (%" PRIu64
               " blocks freed for them); core: %" PRId64 " remaps, %" PRId64 " pages created\n",
               nthreads, tw.ops_per_thread, seed, capacity >> 20,
               (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9, mallocs, ooms, frees,
               left_paused, tw.freed_for_resume, st.num_remaps, st.num_device_alloc);
    free(args);
    free(th);
    pthread_mutex_destroy(&tw.mu);
    return 0;
}
