/*
 * stream.c -- streams: the event pool, pending blocks (freed with
 * record_stream uses, waiting for their events), and handing owners' free
 * memory to every stream once an event or a device synchronisation proves
 * their work done (heap.c, STREAMS).
 *
 * Calls: block.c (owners, merging), pool.c (an ended pool's record goes with
 * its last block).
 */
#include <stdlib.h>

#include "gpumem/array.h"
#include "heap_internal.h"

/* ---- events ---------------------------------------------------------------- */

static int event_get(gm_heap *h, gm_event *ev) {
    *ev = 0;
    if (h->n_event_pool) {
        *ev = h->event_pool[--h->n_event_pool];
        return GM_OK;
    }
    int rc = h->dev->ops->event_create(h->dev, ev);
    if (rc) h->st.num_device_errors++;
    return rc;
}

void h_event_put(gm_heap *h, gm_event ev) {
    if (h->n_event_pool == h->cap_event_pool) {
        gm_event *p = gm_array_grow(h->event_pool, &h->cap_event_pool, 16, sizeof *p);
        if (!p) {
            h->dev->ops->event_destroy(h->dev, ev);
            return;
        }
        h->event_pool = p;
    }
    h->event_pool[h->n_event_pool++] = ev;
}

/* Record an event on `s`; 0 if that failed (the caller then falls back to
 * waiting for the whole device). */
int h_event_record(gm_heap *h, gm_stream s, gm_event *ev) {
    *ev = 0;
    if (h->no_sync || event_get(h, ev)) return 0;
    if (h->dev->ops->event_record(h->dev, *ev, s)) {
        h->st.num_device_errors++;
        h_event_put(h, *ev);
        *ev = 0; /* the pool owns it again */
        return 0;
    }
    return 1;
}

/* 1 when done.  A failing query counts as not done: the block waits for the
 * next device synchronisation instead. */
static int event_done(gm_heap *h, gm_event ev) {
    if (h->no_sync) return 0;
    int rc = h->dev->ops->event_query(h->dev, ev);
    if (rc == GM_OK) return 1;
    if (rc != GM_ENOTREADY) h->st.num_device_errors++;
    return 0;
}

/* ---- pending blocks ----------------------------------------------------------- */

static void pending_unlink(gm_heap *h, gm_block *b) {
    h_assert(b->state == GM_BLOCK_PENDING && h->n_pending > 0);
    if (b->lprev)
        b->lprev->lnext = b->lnext;
    else
        h->pending_head = b->lnext;
    if (b->lnext)
        b->lnext->lprev = b->lprev;
    else
        h->pending_tail = b->lprev;
    b->lprev = b->lnext = NULL;
    h->n_pending--;
}

void h_pending_append(gm_heap *h, gm_block *b) {
    h_assert(b->state == GM_BLOCK_PENDING && b->n_uses > 0);
    b->lnext = NULL;
    b->lprev = h->pending_tail;
    if (h->pending_tail)
        h->pending_tail->lnext = b;
    else
        h->pending_head = b;
    h->pending_tail = b;
    h->n_pending++;
}

/* A pending or live block leaves "active" and becomes free for `owner`, in
 * its pool if that still lives, else in the general heap. */
static void complete_free_for(gm_heap *h, gm_block *b, gm_stream owner) {
    h_assert(b->state == GM_BLOCK_LIVE || b->state == GM_BLOCK_PENDING);
    gm_pool *pl = b->pool;
    h_assert(!pl || (pl->live_blocks > 0 && pl->live_bytes >= b->size));
    if (pl) {
        pl->live_blocks--;
        pl->live_bytes -= b->size;
        if (!pl->use_count) {
            b->pool = NULL;
            if (!pl->live_blocks) h_pool_delete(h, pl);
        }
    }
    int pool = h_pool_of(b->size);
    h_stat_down(h->st.active, pool, 1);
    h_stat_down(h->st.active_bytes, pool, (int64_t)b->size);
    h_hist_block(h, GM_H_FREE_COMPLETED, b->addr, b->size, b->requested, b->stream, b->context);
    b->n_uses = 0;
    b->wait_sync = 0;
    h_make_free(h, b, owner, ++h->free_seq);
}

/* ... for its own stream. */
void h_complete_free(gm_heap *h, gm_block *b) { complete_free_for(h, b, b->stream); }

/* Free pending blocks whose events have completed (all of them if `synced`,
 * i.e. right after the whole device was waited for).  Returns how many. */
size_t h_process_pending(gm_heap *h, int synced) {
    size_t done = 0;
    for (gm_block *b = h->pending_head, *next; b; b = next) {
        next = b->lnext;
        if (b->deferred) {
            if (!synced) continue;
            b->deferred = 0;
            h->n_deferred--;
        }
        int all = 1;
        for (uint32_t i = 0; i < b->n_uses; i++) {
            if (!b->events[i]) continue;
            if (synced || event_done(h, b->events[i])) {
                h_event_put(h, b->events[i]);
                b->events[i] = 0;
            } else {
                all = 0;
            }
        }
        if (all && (synced || !b->wait_sync)) {
            pending_unlink(h, b);
            h->host_idle |= h->host_pages && h_on_host(h, b); /* spill.c unmaps what it leaves idle */
            h_complete_free(h, b);
            done++;
        }
    }
    return done;
}

/* ---- handing owners' memory to every stream ------------------------------------ */

/* A device synchronisation proved every free on o's stream done: a proof in
 * flight is moot. */
static void owner_synced(gm_heap *h, gm_owner *o) {
    if (o->releasing) {
        h_event_put(h, o->release_event);
        o->releasing = 0;
    }
    o->safe_seq = h->free_seq;
}

struct release_ctx {
    gm_heap *h;
    uint64_t threshold;
    size_t n;
    gm_block **chains; /* first blocks of the runs of free blocks that changed, each marked */
    size_t n_chains, cap_chains;
    int all; /* no memory to list them: coalesce the whole heap */
};

/* b now belongs to everyone: a free neighbour may merge with it, so remember
 * the run of free blocks it is in (coalesced once every owner is done).  The
 * blocks walked to find the run's first are marked (2), so a later block of
 * the same run stops there: a run of n blocks of n streams costs O(n), not
 * O(n^2); coalesce_chain (or, with `all`, coalesce_released) clears them. */
static void released(struct release_ctx *c, gm_block *b) {
    c->n++;
    if (!(b->prev && b->prev->state == GM_BLOCK_FREE) && !(b->next && b->next->state == GM_BLOCK_FREE)) return;
    gm_block *first = b;
    while (!first->mark && first->prev && first->prev->state == GM_BLOCK_FREE) {
        first->mark = 2;
        first = first->prev;
    }
    if (first->mark || c->all) return;
    if (c->n_chains == c->cap_chains) {
        gm_block **a = gm_array_grow(c->chains, &c->cap_chains, 16, sizeof *a);
        if (!a) {
            c->all = 1;
            return;
        }
        c->chains = a;
    }
    first->mark = 1;
    c->chains[c->n_chains++] = first;
}

static int release_one(gm_block *b, void *arg) {
    struct release_ctx *c = arg;
    if (b->seq > c->threshold) return 0;
    h_index_remove(c->h, b);
    b->stream = ANY;
    h_index_insert(c->h, b);
    released(c, b);
    return 0;
}

/* The same for a block that fi_move_all has moved already; the statistics
 * count it out of one index and into the other, as index_remove and
 * index_insert would. */
static void release_moved(gm_block *b, void *arg) {
    struct release_ctx *c = arg;
    int pool = h_pool_of(b->size);
    h_stat_down(c->h->st.inactive_split, pool, 1);
    h_stat_down(c->h->st.inactive_split_bytes, pool, (int64_t)b->size);
    h_stat_up(c->h->st.inactive_split, pool, 1);
    h_stat_up(c->h->st.inactive_split_bytes, pool, (int64_t)b->size);
    b->stream = ANY;
    released(c, b);
}

static size_t release_blocks(struct release_ctx *c, gm_owner *o, uint64_t threshold) {
    size_t before = c->n;
    c->threshold = threshold;
    if (threshold == UINT64_MAX) {
        /* Everything goes: merge the sorted bins instead of inserting one by one. */
        fi_move_all(&h_everyones(c->h, o->pool)->idx, &o->idx, release_moved, c);
    } else {
        /* fi_each tolerates moving the visited block out of the index it walks. */
        fi_each(&o->idx, release_one, c);
    }
    return c->n - before;
}

/* Merge what may merge in the run of free blocks that starts at b, left to
 * right, as coalesce_all does: merges keep the lower record, so b stays.
 * Blocks of different pools (or of a pool and the general heap) never merge;
 * a run of general space that changes is out of the run index meanwhile
 * (`out`: a block of it, whose record survives the merges). */
static void coalesce_chain(gm_heap *h, gm_block *b) {
    gm_block *out = NULL;
    while (b->next && b->next->state == GM_BLOCK_FREE) {
        gm_block *n = b->next;
        gm_stream o;
        n->mark = 0; /* released() may have walked it */
        if (h_may_merge_free(h, b, n, &o)) {
            if (!b->pool && !out) h_run_detach(h, out = b);
            h_merge_free(h, b, n, o);
        } else {
            if (out && n->pool) {
                h_run_attach(h, out);
                out = NULL;
            }
            b = n;
        }
    }
    if (out) h_run_attach(h, out);
}

/* After owners changed: the runs of free blocks that hold a changed block are
 * the only places where neighbours may now merge. */
static void coalesce_released(gm_heap *h, struct release_ctx *c) {
    for (size_t i = 0; i < c->n_chains; i++) {
        c->chains[i]->mark = 0;
        if (!c->all) coalesce_chain(h, c->chains[i]);
    }
    if (c->all) {
        for (gm_block *b = h->head; b; b = b->next) b->mark = 0; /* released()'s walks */
        h_coalesce_all(h);
    }
    free(c->chains);
}

/* Give other streams' freed memory to everyone where an event proves it safe
 * (all of it if `synced`).  Returns how many blocks changed hands. */
size_t h_release_owners(gm_heap *h, gm_stream requester, int synced) {
    size_t moved = 0;
    struct release_ctx c = {h, 0, 0, NULL, 0, 0, 0};
    for (size_t i = 1; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (o->stream == ANY) continue; /* a pool's: everyone's already */
        if (synced) {
            owner_synced(h, o);
            moved += release_blocks(&c, o, UINT64_MAX);
            continue;
        }
        if (o->stream == requester || !o->idx.count) continue;
        if (!o->releasing) {
            if (!h_event_record(h, o->stream, &o->release_event)) continue;
            o->release_seq = h->free_seq;
            o->releasing = 1;
        }
        if (event_done(h, o->release_event)) {
            h_event_put(h, o->release_event);
            o->releasing = 0;
            o->safe_seq = o->release_seq;
            moved += release_blocks(&c, o, o->release_seq);
        }
    }
    coalesce_released(h, &c);
    return moved;
}

/* ---- handing memory to a stream before the work that freed it is done ------------ */

/* HAND-OFF
 *
 *   Memory another stream freed is the requester's only once that stream's
 *   work on it is done: an event proves it (h_release_owners,
 *   h_process_pending), or a device synchronisation.  Under pressure -- the
 *   slow path found no fit and growth under the limit did not cover the
 *   request -- waiting on the host is the dear way: the device can order the
 *   streams itself.  The requester's stream waits on the device for the work
 *   the other streams have queued so far (an event recorded on each now, and
 *   a pending block's own events), and the memory becomes the requester's at
 *   once, with no host wait and no new pages.  Its later work, on these
 *   blocks or any other, runs after that wait.  The smallest single block
 *   that holds the request alone with less than a page to spare goes, so
 *   that the requester waits for one stream's work; when none does, all of
 *   it, for placement to join and pack as tightly as after a device-wide
 *   wait (a block with more to spare would leave its rest scattered).  The
 *   blocks are the requester's (not everyone's): a third stream gets them
 *   only as any of the requester's frees, through its own proof, so each
 *   free counts as the requester's, made now (a new free number, the
 *   requester as its origin).
 *
 *   Not during a capture (the slow path never gets here then: a capture must
 *   not wait on an event recorded outside it), not where the device cannot
 *   make a stream wait, and never across devices: a heap serves one device,
 *   and every event it records is on that device's streams.  Only memory of
 *   the request's own pool (or the general heap) changes hands, and only
 *   pending blocks whose events were recorded (a block freed during a capture,
 *   or one whose event failed, waits for a synchronisation as before). */

/* s's later work waits for what `ev` stands for; 1 on success. */
static int wait_event(gm_heap *h, gm_stream s, gm_event ev) {
    if (h->dev->ops->stream_wait(h->dev, s, ev) == GM_OK) return 1;
    h->st.num_device_errors++;
    return 0;
}

/* s's later work waits for the work queued on stream a so far; 1 on success. */
static int wait_stream(gm_heap *h, gm_stream s, gm_stream a) {
    gm_event ev;
    if (!h_event_record(h, a, &ev)) return 0;
    int ok = wait_event(h, s, ev);
    h_event_put(h, ev); /* the wait holds what the record stood for; the event may be recorded again */
    return ok;
}

/* Pending block b, of the requesting pool, waits for the work of other
 * streams: s waits for it (its use events, and its own stream's work when
 * that is another), and b becomes s's free block.  1 if it did. */
static int handoff_pending(gm_heap *h, gm_block *b, gm_stream s) {
    if (b->stream != s && !wait_stream(h, s, b->stream)) return 0;
    for (uint32_t i = 0; i < b->n_uses; i++)
        if (b->events[i] && b->uses[i] != s && !wait_event(h, s, b->events[i])) return 0;
    for (uint32_t i = 0; i < b->n_uses; i++) {
        if (b->events[i]) h_event_put(h, b->events[i]);
        b->events[i] = 0;
    }
    pending_unlink(h, b);
    h->host_idle |= h->host_pages && h_on_host(h, b);
    uintptr_t addr = b->addr;
    size_t size = b->size;
    complete_free_for(h, b, s);
    h_hist(h, GM_H_HANDOFF, addr, size, s, 0);
    return 1;
}

struct handoff_ctx {
    struct release_ctx rc;
    gm_stream to;
};

/* A free block of another stream becomes `to`'s, as if `to` had freed it now. */
static int handoff_free(gm_block *b, void *arg) {
    struct handoff_ctx *c = arg;
    gm_heap *h = c->rc.h;
    h_hist(h, GM_H_HANDOFF, b->addr, b->size, c->to, 0);
    h_index_remove(h, b);
    b->stream = b->origin = c->to;
    b->seq = ++h->free_seq;
    b->epoch = h->epoch;
    h_index_insert(h, b);
    released(&c->rc, b);
    return 0;
}

/* A pending block s may be handed: of `pool` (NULL: the general heap), its
 * events recorded. */
static int pending_handable(const gm_block *b, const gm_pool *pool) {
    return !b->deferred && !b->wait_sync && (h_pinned(b) ? b->pool : NULL) == pool;
}

/* An owner whose free blocks s may be handed: another stream's, of `pool`. */
static int owner_handable(const gm_owner *o, gm_stream s, const gm_pool *pool) {
    return o->stream != ANY && o->stream != s && o->pool == pool && o->idx.count;
}

/* The smallest single block other streams freed that holds `size` bytes
 * alone: pending (*from NULL) or free in owner *from.  NULL if none does. */
static gm_block *fitting_one(gm_heap *h, gm_stream s, gm_pool *pool, size_t size, gm_owner **from) {
    gm_block *best = NULL;
    *from = NULL;
    for (gm_block *b = h->pending_head; b; b = b->lnext)
        if (pending_handable(b, pool) && b->size >= size && (!best || b->size < best->size)) best = b;
    for (size_t i = 1; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        gm_block *b = owner_handable(o, s, pool) ? fi_best_fit(&o->idx, size) : NULL;
        if (b && (!best || b->size < best->size)) best = b, *from = o;
    }
    return best;
}

/* Hand s every block other streams freed in `pool` whose work may still run:
 * no single one holds the request, placement may join them. */
static size_t handoff_all(gm_heap *h, gm_stream s, gm_pool *pool) {
    size_t n = 0;
    for (gm_block *b = h->pending_head, *next; b; b = next) {
        next = b->lnext;
        if (pending_handable(b, pool)) n += (size_t)handoff_pending(h, b, s);
    }
    struct handoff_ctx c = {{h, 0, 0, NULL, 0, 0, 0}, s};
    for (size_t i = 1; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (!owner_handable(o, s, pool) || !wait_stream(h, s, o->stream)) continue;
        size_t before = c.rc.n;
        fi_each(&o->idx, handoff_free, &c);
        n += c.rc.n - before;
    }
    coalesce_released(h, &c.rc);
    return n;
}

/* Hand s the memory other streams freed in `pool` (NULL: the general heap)
 * whose work may still run, for a request of `size` bytes (HAND-OFF above):
 * the smallest block that holds it alone with less than a page to spare, so
 * that s waits for one stream's work only; else all of it.  Returns how many
 * blocks changed hands; the caller counts the hand-off. */
size_t h_stream_handoff(gm_heap *h, gm_stream s, gm_pool *pool, size_t size) {
    h_assert(!h->no_sync && (h->lazy_stream == ANY || h->lazy_stream == s));
    if (!h->dev->ops->stream_wait) return 0;
    gm_owner *o;
    gm_block *one = fitting_one(h, s, pool, size, &o);
    if (!one || one->size - size >= h->page) return handoff_all(h, s, pool);
    if (!o) return (size_t)handoff_pending(h, one, s);
    if (!wait_stream(h, s, o->stream)) return 0;
    struct handoff_ctx c = {{h, 0, 0, NULL, 0, 0, 0}, s};
    handoff_free(one, &c);
    coalesce_released(h, &c.rc);
    return 1;
}

/* Give every stream what streams that have finished all their work freed in
 * private pools, as the device's stream query tells (nothing where it cannot
 * tell).  Only while no capture is on: a query would invalidate it.  Torch
 * waits for the device before a graph's capture begins, so there the capture
 * stream may reuse what other streams freed in the graphs' pool.  The general
 * heap's blocks stay with their streams, so a capture's new pool takes new
 * pages, as a native capture's new pool takes new segments, not pages other
 * streams cached.  Returns how many blocks changed hands. */
size_t h_release_idle(gm_heap *h) {
    int (*query)(gm_device *, gm_stream) = h->dev->ops->stream_query;
    h_assert(!h->no_sync && !h->capture_count);
    if (!query) return 0;
    h_process_pending(h, 0);
    struct release_ctx c = {h, 0, 0, NULL, 0, 0, 0};
    for (size_t i = 1; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (!o->pool || o->stream == ANY || !o->idx.count || h_capture_on(h, o->stream)) continue;
        int rc = query(h->dev, o->stream);
        if (rc == GM_ENOTREADY) continue;
        if (rc != GM_OK) {
            h->st.num_device_errors++;
            continue;
        }
        owner_synced(h, o);
        release_blocks(&c, o, UINT64_MAX);
    }
    coalesce_released(h, &c);
    return c.n;
}

/* After a device synchronisation every free block is everyone's.  When all
 * that are not everyone's already belong to one stream (in any pools), that
 * hands nothing new to the stream itself, and no neighbours can merge that
 * have not (owners_merge lets a stream's blocks merge with everyone's): the
 * blocks stay in their indexes, and a new epoch makes them everyone's
 * (gm_heap.lazy_stream).  The proofs and releases in flight are settled
 * here, as release_owners does.  0 when more than one stream owns blocks, or
 * when one does but `requester` (ANY: none) is another: it goes on to look
 * for memory, and would not see them. */
static int release_lazily(gm_heap *h, gm_stream requester) {
    gm_stream s = ANY;
    for (size_t i = 1; i < h->n_owners; i++) {
        const gm_owner *o = h->owners[i];
        if (o->stream == ANY || !o->idx.count) continue;
        if (s != ANY && o->stream != s) return 0;
        s = o->stream;
    }
    if (s != ANY && ((requester != ANY && s != requester) || (h->lazy_stream != ANY && s != h->lazy_stream))) return 0;
    for (size_t i = 1; i < h->n_owners; i++)
        if (h->owners[i]->stream != ANY) owner_synced(h, h->owners[i]);
    if (s != ANY) h->epoch++;
    h->lazy_stream = s;
    return 1;
}

/* Wait for the device: every free block becomes everyone's.  `requester`:
 * the stream whose allocation goes on after it, or ANY. */
int h_synchronize(gm_heap *h, gm_stream requester) {
    if (h->no_sync) return GM_EDEVICE; /* callers never get here during a capture */
    if (h->dev->ops->synchronize(h->dev)) {
        h->st.num_device_errors++;
        return GM_EDEVICE;
    }
    h->st.num_sync_all_streams++;
    h_process_pending(h, 1);
    if (!release_lazily(h, requester)) {
        h_release_owners(h, ANY, 1); /* merges what the new owners allow; frees merged as they completed */
        h->lazy_stream = ANY;        /* it moved every block */
    }
    return GM_OK;
}

/* Unmap pages [p0, p1), all inside the free block b and made of whole chunks,
 * one call per chunk: single pages become spares, larger chunks go back to
 * the device (unmap_chunk; `restock`: replaced by single spares).  The range
 * becomes unmapped address space. */
