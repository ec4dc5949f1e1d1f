/*
 * check.c -- the invariant checker.  Tests and fuzzers call it after every
 * operation they care about; it walks everything and trusts nothing.
 *
 *   C1 blocks tile [base, base+va_size): sorted, no overlap, no gap, 512-aligned,
 *      prev/next consistent; unmapped blocks are whole pages.
 *   C2 every page a live, pending or free block touches is mapped; every page
 *      wholly inside unmapped space is not; mapped_pages is the count.  On the
 *      simulated device, the device agrees byte for byte for those blocks, and holds exactly the pages the heap thinks it holds.
 *   C3 no two neighbours that may merge are left apart.
 *   C4 each owner's index holds exactly its free blocks (fi_check for the rest).
 *   C5 the live table holds exactly the live blocks; the pending list exactly
 *      the pending ones.
 *   C6 every statistic with a "current" equals a recount.
 *   C7 no physical page is held twice.
 *   C8 (check_page_identity) on the simulated device, the physical page at each
 *      page of the range is the one the heap's page table names, and no page
 *      the heap thinks unmapped has one.
 *   C9 (check_streams) stream safety: owners' release bookkeeping is coherent,
 *      and a free block that every stream may reuse holds only frees proven
 *      done -- the newest free in it is at or below the proven sequence of the
 *      stream that made it (a completed event or a device sync).  Pending
 *      blocks wait for at least one use.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "heap_internal.h"

static int fail(char *why, size_t len, const char *fmt, ...) {
    if (why && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, len, fmt, ap);
        va_end(ap);
    }
    return GM_ECORRUPT;
}

static int cmp_handle(const void *a, const void *b) {
    gm_handle x = *(const gm_handle *)a, y = *(const gm_handle *)b;
    return x < y ? -1 : x > y;
}

static int stat_is(const gm_stat *arr, int64_t all, int64_t small, const char *name, char *why, size_t len) {
    if (arr[GM_POOL_ALL].current != all || arr[GM_POOL_SMALL].current != small ||
        arr[GM_POOL_LARGE].current != all - small)
        return fail(why, len, "stat %s is %lld (small %lld, large %lld) but a recount gives %lld (small %lld)", name,
                    (long long)arr[GM_POOL_ALL].current, (long long)arr[GM_POOL_SMALL].current,
                    (long long)arr[GM_POOL_LARGE].current, (long long)all, (long long)small);
    return GM_OK;
}

/* C8: the device's own page table against the heap's, page by page. */
static int check_page_identity(gm_heap *h, char *why, size_t len) {
    if (strcmp(h->dev->kind, "sim")) return GM_OK;
    for (size_t p = 0; p < h->n_pages; p++) {
        gm_handle dev_page = gm_sim_page_at(h->dev, gm_page_addr(h, p));
        if (dev_page != h->page_handle[p])
            return fail(why, len, "page %zu (%#lx): the heap says physical page %llu, the device has %llu", p,
                        (unsigned long)gm_page_addr(h, p), (unsigned long long)h->page_handle[p],
                        (unsigned long long)dev_page);
    }
    return GM_OK;
}

/* C9: stream safety. */
static int check_streams(gm_heap *h, char *why, size_t len) {
    if (!h->n_owners || h->owners[0]->stream != GM_STREAM_ANY)
        return fail(why, len, "owner 0 is not the every-stream owner");
    for (size_t i = 0; i < h->n_owners; i++) {
        const gm_owner *o = h->owners[i];
        for (size_t j = 0; j < i; j++)
            if (h->owners[j]->stream == o->stream)
                return fail(why, len, "stream %llu has two owner records", (unsigned long long)o->stream);
        if (o->safe_seq > h->free_seq)
            return fail(why, len, "stream %llu: proven free sequence %llu is past the last free %llu",
                        (unsigned long long)o->stream, (unsigned long long)o->safe_seq,
                        (unsigned long long)h->free_seq);
        if (o->releasing) {
            if (i == 0) return fail(why, len, "the every-stream owner has a release in flight");
            if (!o->release_event)
                return fail(why, len, "stream %llu has a release in flight without an event",
                            (unsigned long long)o->stream);
            if (o->release_seq > h->free_seq || o->release_seq < o->safe_seq)
                return fail(why, len, "stream %llu: release sequence %llu outside [%llu, %llu]",
                            (unsigned long long)o->stream, (unsigned long long)o->release_seq,
                            (unsigned long long)o->safe_seq, (unsigned long long)h->free_seq);
        }
    }
    for (const gm_block *b = h->head; b; b = b->next) {
        if (b->state == GM_BLOCK_PENDING) {
            if (!b->n_uses)
                return fail(why, len, "pending block %#lx waits for no stream", (unsigned long)b->addr);
            if (b->stream == GM_STREAM_ANY)
                return fail(why, len, "pending block %#lx was allocated on no stream", (unsigned long)b->addr);
            continue;
        }
        if (b->state == GM_BLOCK_LIVE) {
            if (b->stream == GM_STREAM_ANY || b->seq == 0 || b->seq > h->alloc_seq)
                return fail(why, len, "live block %#lx: stream or allocation number is wrong", (unsigned long)b->addr);
            continue;
        }
        if (b->state != GM_BLOCK_FREE) continue;
        if (b->seq > h->free_seq)
            return fail(why, len, "free block %#lx: free sequence %llu is past the last free %llu",
                        (unsigned long)b->addr, (unsigned long long)b->seq, (unsigned long long)h->free_seq);
        if (b->stream != GM_STREAM_ANY || b->seq == 0) continue; /* seq 0: fresh pages, never used */
        gm_owner *src = b->origin == GM_STREAM_ANY ? NULL : gm_owner_find(h, b->origin);
        if (!src)
            return fail(why, len, "free block %#lx (every stream) holds free %llu of no known stream",
                        (unsigned long)b->addr, (unsigned long long)b->seq);
        if (b->seq > src->safe_seq)
            return fail(why, len,
                        "free block %#lx is reusable by every stream, but its free %llu on stream %llu is not "
                        "proven done (proven up to %llu)",
                        (unsigned long)b->addr, (unsigned long long)b->seq, (unsigned long long)b->origin,
                        (unsigned long long)src->safe_seq);
    }
    return GM_OK;
}

static int check_locked(gm_heap *h, char *why, size_t len) {
    const size_t P = h->page;
    /* C1, C2, C3 in one walk. */
    if (!h->head || h->head->addr != h->base || h->head->prev)
        return fail(why, len, "the first block does not start the reserved range");
    int64_t n_live = 0, n_live_s = 0, b_live = 0, b_live_s = 0, req = 0, req_s = 0;
    int64_t n_act = 0, n_act_s = 0, b_act = 0, b_act_s = 0;
    int64_t n_free = 0, n_free_s = 0, b_free = 0, b_free_s = 0;
    size_t pending = 0;
    const gm_block *last = NULL;
    for (const gm_block *b = h->head; b; last = b, b = b->next) {
        if (b->prev != last) return fail(why, len, "block %#lx: prev link is wrong", (unsigned long)b->addr);
        if (last && last->addr + last->size != b->addr)
            return fail(why, len, "blocks %#lx+%zu and %#lx overlap or leave a gap", (unsigned long)last->addr,
                        last->size, (unsigned long)b->addr);
        if (!b->size || b->size % GM_ALIGN || b->addr % GM_ALIGN)
            return fail(why, len, "block %#lx+%zu is empty or not 512-aligned", (unsigned long)b->addr, b->size);
        size_t p0 = gm_page_floor(h, b->addr), p1 = gm_page_ceil(h, b->addr + b->size);
        int sm = b->size <= GM_SMALL_SIZE;
        switch (b->state) {
        case GM_BLOCK_UNMAPPED:
            if ((b->addr - h->base) % P || b->size % P)
                return fail(why, len, "unmapped block %#lx+%zu is not whole pages", (unsigned long)b->addr, b->size);
            for (size_t p = p0; p < p1; p++)
                if (h->page_handle[p]) return fail(why, len, "page %zu is mapped inside unmapped space", p);
            if (last && last->state == GM_BLOCK_UNMAPPED)
                return fail(why, len, "two unmapped neighbours at %#lx were not merged", (unsigned long)b->addr);
            continue;
        case GM_BLOCK_LIVE:
            if (gm_live_find(h, b->addr) != b)
                return fail(why, len, "live block %#lx is missing from the live table", (unsigned long)b->addr);
            n_live++, n_live_s += sm, b_live += (int64_t)b->size, b_live_s += sm ? (int64_t)b->size : 0;
            req += (int64_t)b->requested, req_s += sm ? (int64_t)b->requested : 0;
            if (b->requested > b->size) return fail(why, len, "block %#lx: requested > size", (unsigned long)b->addr);
            n_act++, n_act_s += sm, b_act += (int64_t)b->size, b_act_s += sm ? (int64_t)b->size : 0;
            break;
        case GM_BLOCK_PENDING:
            pending++;
            n_act++, n_act_s += sm, b_act += (int64_t)b->size, b_act_s += sm ? (int64_t)b->size : 0;
            break;
        case GM_BLOCK_FREE: {
            if (last && last->state == GM_BLOCK_FREE && (last->stream == b->stream || last->stream == GM_STREAM_ANY ||
                                                         b->stream == GM_STREAM_ANY))
                return fail(why, len, "free neighbours at %#lx could merge but did not", (unsigned long)b->addr);
            if (!gm_owner_find(h, b->stream))
                return fail(why, len, "free block %#lx names an unknown owner", (unsigned long)b->addr);
            n_free++, n_free_s += sm, b_free += (int64_t)b->size, b_free_s += sm ? (int64_t)b->size : 0;
            break;
        }
        default:
            return fail(why, len, "block %#lx has bad state %d", (unsigned long)b->addr, b->state);
        }
        for (size_t p = p0; p < p1; p++)
            if (!h->page_handle[p])
                return fail(why, len, "page %zu under %s block %#lx+%zu is not mapped", p,
                            b->state == GM_BLOCK_FREE ? "free" : "live/pending", (unsigned long)b->addr, b->size);
        /* Free blocks too: they are handed out without another device call. */
        if (!strcmp(h->dev->kind, "sim") && !gm_sim_is_accessible(h->dev, b->addr, b->size))
            return fail(why, len, "the device says block %#lx+%zu is not accessible", (unsigned long)b->addr, b->size);
    }
    if (last->addr + last->size != h->base + h->va_size) return fail(why, len, "blocks do not reach the range's end");

    /* C2 counts, C7. */
    size_t mapped = 0;
    for (size_t p = 0; p < h->n_pages; p++) mapped += h->page_handle[p] != 0;
    if (mapped != h->mapped_pages) return fail(why, len, "%zu pages mapped but the heap counts %zu", mapped, h->mapped_pages);
    gm_handle *all = malloc((mapped + h->n_spare + 1) * sizeof *all);
    if (all) {
        size_t k = 0;
        for (size_t p = 0; p < h->n_pages; p++)
            if (h->page_handle[p]) all[k++] = h->page_handle[p];
        for (size_t i = 0; i < h->n_spare; i++) all[k++] = h->spare[i];
        qsort(all, k, sizeof *all, cmp_handle);
        for (size_t i = 1; i < k; i++)
            if (all[i] == all[i - 1]) {
                unsigned long long dup = (unsigned long long)all[i];
                free(all);
                return fail(why, len, "physical page %llu is held twice", dup);
            }
        free(all);
    }
    if (!strcmp(h->dev->kind, "sim")) {
        gm_sim_info si;
        gm_sim_info_get(h->dev, &si);
        if (si.pages_mapped != h->mapped_pages || si.pages_created != h->mapped_pages + h->n_spare)
            return fail(why, len, "the device holds %zu pages (%zu mapped) but the heap %zu (%zu mapped)",
                        si.pages_created, si.pages_mapped, h->mapped_pages + h->n_spare, h->mapped_pages);
    }

    /* C4 */
    size_t indexed = 0, indexed_bytes = 0;
    for (size_t i = 0; i < h->n_owners; i++) {
        const gm_owner *o = h->owners[i];
        if (fi_check(&o->idx, why, len)) return GM_ECORRUPT;
        for (unsigned fl = 0; fl < FI_FL; fl++)
            for (unsigned sl = 0; sl < FI_SL; sl++)
                for (const gm_block *b = o->idx.bins[fl][sl]; b; b = b->lnext)
                    if (b->state != GM_BLOCK_FREE || b->stream != o->stream)
                        return fail(why, len, "index of stream %llu holds block %#lx that is not its free block",
                                    (unsigned long long)o->stream, (unsigned long)b->addr);
        indexed += o->idx.count;
        indexed_bytes += o->idx.bytes;
    }
    if (indexed != (size_t)n_free || indexed_bytes != (size_t)b_free)
        return fail(why, len, "indexes hold %zu free blocks / %zu bytes but %lld / %lld exist", indexed, indexed_bytes,
                    (long long)n_free, (long long)b_free);

    /* C5 */
    if (h->n_live != (size_t)n_live) return fail(why, len, "live table counts %zu, blocks %lld", h->n_live, (long long)n_live);
    size_t in_list = 0;
    for (const gm_block *b = h->pending_head; b; b = b->lnext, in_list++)
        if (b->state != GM_BLOCK_PENDING) return fail(why, len, "pending list holds a non-pending block");
    if (in_list != pending || in_list != h->n_pending)
        return fail(why, len, "pending list holds %zu, counter %zu, blocks %zu", in_list, h->n_pending, pending);

    /* C6 */
    const gm_stats *st = &h->st;
    int rc;
    int64_t held = (int64_t)(h->mapped_pages + h->n_spare);
    if ((rc = stat_is(st->allocation, n_live, n_live_s, "allocation", why, len)) ||
        (rc = stat_is(st->allocated_bytes, b_live, b_live_s, "allocated_bytes", why, len)) ||
        (rc = stat_is(st->requested_bytes, req, req_s, "requested_bytes", why, len)) ||
        (rc = stat_is(st->active, n_act, n_act_s, "active", why, len)) ||
        (rc = stat_is(st->active_bytes, b_act, b_act_s, "active_bytes", why, len)) ||
        (rc = stat_is(st->inactive_split, n_free, n_free_s, "inactive_split", why, len)) ||
        (rc = stat_is(st->inactive_split_bytes, b_free, b_free_s, "inactive_split_bytes", why, len)) ||
        (rc = stat_is(st->segment, held, 0, "segment", why, len)) ||
        (rc = stat_is(st->reserved_bytes, held * (int64_t)P, 0, "reserved_bytes", why, len)))
        return rc;
    if ((int64_t)h->live_bytes != b_live) return fail(why, len, "live_bytes disagrees with a recount");
    if ((rc = check_page_identity(h, why, len)) || (rc = check_streams(h, why, len))) return rc;
    return GM_OK;
}

int gm_check(gm_heap *h, char *why, size_t whylen) {
    if (why && whylen) why[0] = 0;
    pthread_mutex_lock(&h->lock);
    int rc = check_locked(h, why, whylen);
    pthread_mutex_unlock(&h->lock);
    return rc;
}
