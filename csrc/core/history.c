/*
 * history.c -- a ring buffer of allocator events.
 *
 * Fixed capacity, chosen by gm_history_enable: once full, each new event
 * overwrites the oldest and bumps `dropped`, so memory stays bounded however
 * long the program runs.  Entries carry an opaque context id; the extension
 * module maps ids to Python stacks.  An event carries the context of its block
 * (or none), unless the thread that records it has set an event context.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "heap_internal.h"

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Set by gm_history_event_context around a call: the context its events carry. */
static _Thread_local uint64_t event_context;

uint64_t gm_history_event_context(uint64_t context) {
    uint64_t old = event_context;
    event_context = context;
    return old;
}

void h_hist_push(gm_heap *h, uint32_t action, uintptr_t addr, size_t size, size_t requested, gm_stream stream,
                 uint64_t context) {
    if (event_context) context = event_context;
    size_t slot = (h->hist_head + h->hist_len) % h->hist_cap;
    if (h->hist_len == h->hist_cap) {
        h->hist_head = (h->hist_head + 1) % h->hist_cap;
        h->hist_dropped++;
    } else {
        h->hist_len++;
    }
    gm_hist_entry *e = &h->hist[slot];
    e->time_ns = now_ns();
    e->addr = addr;
    e->size = size;
    e->requested = requested;
    e->stream = stream;
    e->context = context;
    e->action = action;
}

void h_hist_free(gm_heap *h) {
    free(h->hist);
    h->hist = NULL;
    h->hist_cap = h->hist_head = h->hist_len = 0;
    h->hist_dropped = 0;
}

/* A new ring keeps the newest events of the old one that fit (the rest count as
 * dropped), as torch keeps its trace when recording is asked for again; 0 turns
 * recording off and forgets every event. */
int gm_history_enable(gm_heap *h, size_t max_entries) {
    if (max_entries > ((size_t)1 << 32)) return GM_EINVAL;
    gm_hist_entry *ring = NULL;
    if (max_entries && !(ring = calloc(max_entries, sizeof *ring))) return GM_ENOMEM;
    pthread_mutex_lock(&h->lock);
    size_t keep = h->hist_len < max_entries ? h->hist_len : max_entries;
    uint64_t dropped = h->hist_dropped + (h->hist_len - keep);
    for (size_t i = 0; i < keep; i++) ring[i] = h->hist[(h->hist_head + h->hist_len - keep + i) % h->hist_cap];
    h_hist_free(h);
    h->hist = ring;
    h->hist_cap = max_entries;
    h->hist_len = keep;
    h->hist_dropped = max_entries ? dropped : 0;
    pthread_mutex_unlock(&h->lock);
    return GM_OK;
}

size_t gm_history_read(gm_heap *h, gm_hist_entry *out, size_t cap, uint64_t *dropped) {
    pthread_mutex_lock(&h->lock);
    size_t n = h->hist_len < cap ? h->hist_len : cap;
    /* Keep the newest n when the caller's buffer is short. */
    size_t skip = h->hist_len - n;
    for (size_t i = 0; i < n; i++) out[i] = h->hist[(h->hist_head + skip + i) % h->hist_cap];
    if (dropped) *dropped = h->hist_dropped + skip;
    pthread_mutex_unlock(&h->lock);
    return n;
}

size_t gm_history_len(gm_heap *h) { return h_locked_read(h, &h->hist_len); }
