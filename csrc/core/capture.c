/*
 * capture.c -- stream capture: whether the heap must avoid synchronising
 * calls now, and the events of frees deferred while a capture was on
 * (heap.c, CAPTURE).
 *
 * Calls: stream.c (events), place.c (unparking pages once no capture is on).
 */
#include "heap_internal.h"

/* ---- stream capture -------------------------------------------------------------------- */

/* Whether stream s is capturing by the device's word; `if_unknown` when the
 * device cannot say (a stream destroyed since, a failing driver). */
static int device_capturing(gm_heap *h, gm_stream s, int if_unknown) {
    int (*status)(gm_device *, gm_stream, int *) = h->dev->ops->capture_status;
    if (!status || s == ANY) return 0;
    int c = 0;
    return status(h->dev, s, &c) != GM_OK ? if_unknown : c;
}

/* Whether a call on behalf of stream s now could invalidate a capture: the
 * heap was told so, or the device says s is capturing (or cannot say). */
int h_capture_on(gm_heap *h, gm_stream s) { return h->capture_count > 0 || device_capturing(h, s, 1); }

/* Record the events of a pending block, one per record_stream use; if one
 * cannot be recorded, the block waits for the next device synchronisation. */
void h_record_uses(gm_heap *h, gm_block *b) {
    b->wait_sync = 0;
    for (uint32_t i = 0; i < b->n_uses; i++) {
        b->events[i] = 0;
        if (!b->wait_sync && !h_event_record(h, b->uses[i], &b->events[i])) b->wait_sync = 1;
    }
}

/* Record the events of blocks freed during a capture, once no stream they
 * name is capturing (torch: "events deferred until no capture"). */
static void record_deferred(gm_heap *h) {
    for (gm_block *b = h->pending_head; b && h->n_deferred; b = b->lnext) {
        if (!b->deferred) continue;
        /* A stream that cannot answer is taken as done capturing: its event
         * record may fail, and then the block waits for a device sync. */
        int busy = h->capture_count > 0 || device_capturing(h, b->stream, 0);
        for (uint32_t i = 0; i < b->n_uses && !busy; i++) busy = device_capturing(h, b->uses[i], 0);
        if (busy) continue;
        b->deferred = 0;
        h->n_deferred--;
        h_record_uses(h, b);
    }
}

/* A capture the heap only knows from the device, on a stream other than the
 * requester's, still under way: a block freed during it is still deferred
 * once those whose captures ended have their events.  Then a device-wide call
 * (synchronize, unmap) would invalidate that capture too. */
int h_other_capture(gm_heap *h) {
    if (!h->n_deferred) return 0;
    record_deferred(h);
    return h->n_deferred > 0;
}

void gm_capture_begin(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    /* The last moment a query may run: what idle streams freed in pools goes to everyone. */
    if (!h->capture_count && !h_other_capture(h)) h_release_idle(h);
    h->capture_count++;
    pthread_mutex_unlock(&h->lock);
}

void gm_capture_end(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    if (h->capture_count > 0 && --h->capture_count == 0) {
        if (h->n_deferred) record_deferred(h);
        if (h->n_parked && !h_other_capture(h)) h_unpark(h);
    }
    pthread_mutex_unlock(&h->lock);
}

int gm_capturing(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    int c = h->capture_count;
    pthread_mutex_unlock(&h->lock);
    return c;
}
