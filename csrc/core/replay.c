/*
 * replay.c -- run an allocation trace against a heap from C, so that the
 * per-operation time measures the core and not the caller's interpreter.
 */
#include <time.h>

#include "heap_internal.h"

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int gm_replay(gm_heap *h, const gm_replay_event *ev, size_t n, uintptr_t *slots, uint64_t *op_ns, uint64_t stop_at,
              gm_replay_result *res) {
    gm_replay_result r = {0};
    r.first_oom_event = UINT64_MAX;
    uint64_t live = res->live_bytes; /* a chunk of a trace: what the chunks before left live */
    r.peak_live_bytes = live;
    for (size_t i = 0; i < n; i++) {
        const gm_replay_event *e = &ev[i];
        /* A free's size is the block's, looked up before the clock starts. */
        size_t freed = (e->op == GM_R_FREE && slots[e->slot]) ? gm_block_size(h, slots[e->slot]) : 0;
        uint64_t t0 = op_ns ? now_ns() : 0;
        int rc = GM_OK;
        if (e->op == GM_R_ALLOC) {
            uintptr_t p = 0;
            rc = gm_malloc(h, (size_t)e->size, e->stream, 0, &p);
            if (op_ns) op_ns[i] = now_ns() - t0;
            if (rc == GM_OK) {
                slots[e->slot] = p;
                r.allocs++;
                live += e->size ? (e->size + GM_ALIGN - 1) / GM_ALIGN * GM_ALIGN : GM_ALIGN;
                if (live > r.peak_live_bytes) {
                    r.peak_live_bytes = live;
                    r.peak_event = i;
                }
            } else if (rc == GM_ENOMEM) {
                slots[e->slot] = 0; /* its free is skipped */
                r.ooms++;
                if (r.first_oom_event == UINT64_MAX) r.first_oom_event = i;
            }
        } else if (e->op == GM_R_FREE) {
            uintptr_t p = slots[e->slot];
            if (p) {
                rc = gm_free(h, p);
                if (op_ns) op_ns[i] = now_ns() - t0;
                slots[e->slot] = 0;
                r.frees++;
                live -= freed < live ? freed : live; /* never below 0, whatever the caller said */
            } else if (op_ns) {
                op_ns[i] = 0;
            }
        } else {
            rc = GM_EINVAL;
        }
        r.events = (uint64_t)i + 1;
        if (rc != GM_OK && rc != GM_ENOMEM) {
            r.error = rc;
            break;
        }
        if ((uint64_t)i == stop_at) break;
    }
    gm_stats st;
    gm_get_stats(h, &st);
    r.peak_reserved_bytes = (uint64_t)st.reserved_bytes[GM_POOL_ALL].peak;
    r.live_bytes = live;
    *res = r;
    return r.error;
}
