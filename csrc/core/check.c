/*
 * check.c -- the invariant checker.  Tests and fuzzers call it after every
 * operation they care about; it walks everything and trusts nothing.
 *
 *   C1 blocks tile [base, base+va_size): sorted, no overlap, no gap, 512-aligned,
 *      prev/next consistent; unmapped blocks are whole pages.
 *   C2 every page a live, pending or free block touches is mapped; every page
 *      wholly inside unmapped space is not; mapped_pages is the count.  Where
 *      the device can tell (its ops->verify, e.g. the simulated device), it
 *      agrees that those blocks are accessible, holds exactly the pages the heap
 *      thinks it holds, and has the same physical page behind every address.
 *   C3 no two neighbours that may merge are left apart.
 *   C4 each owner's index holds exactly its free blocks (fi_check for the rest).
 *   C5 the live table holds exactly the live blocks; the pending list exactly
 *      the pending ones.
 *   C6 every statistic with a "current" equals a recount.
 *   C7 no physical page is held twice.
 *   C8 private pools: every block's pool is a known record; a free block's
 *      pool lives (an ended pool keeps only live and pending blocks); each
 *      pool's owners, counters and the heap's pool_free_bytes equal a recount;
 *      an ended record still has blocks; the pages a living pool's blocks touch
 *      are mapped (C2) and counted as used by h_used_pages (a recount).
 *   C9 capture: the deferred count equals the pending blocks marked deferred;
 *      a deferred block has no event recorded and is pending.
 *   C10 the run index and the page-use counts equal a recount (runindex.h R1, R2,
 *       P1, P2).
 *   C11 stream safety: owners' release bookkeeping is coherent,
 *      and a free block that every stream may reuse holds only frees proven
 *      done -- the newest free in it is at or below the proven sequence of the
 *      stream that made it (a completed event or a device sync).  Pending
 *      blocks wait for at least one use.  Who may reuse a free block is
 *      h_free_owner's answer.
 *   C12 paused pools: a paused pool lives; its list of released pages is
 *      ascending, in range, with distinct backup slots, and the pages have no
 *      physical page behind them (C2's device check agrees); every block that
 *      touches one is a live, pending or free block of that pool -- nothing
 *      else was placed there, and no unmapped space covers it; the heap's
 *      paused_pages is the sum; a pool that is not paused keeps no list or
 *      backup.  C2 exempts exactly those pages from being mapped.
 *   C13 a synchronisation's hand-over left in place (gm_heap.lazy_stream):
 *      no free block's epoch is past the heap's; with lazy_stream ANY no free
 *      block of a stream is from an earlier epoch (none is everyone's but
 *      in a stream's index); otherwise every free block is lazy_stream's or
 *      everyone's by its owner field, so that lazy_stream alone can be
 *      allocating (and settle_release need merge nothing).
 *   C14 chunks: every mapped page's chunk metadata is consistent -- the pages
 *      of a chunk of k are k mapped neighbours with offsets 0..k-1, length k
 *      and one handle, k <= GM_CHUNK_PAGES_MAX (growth makes at most
 *      chunk_pages, a resume up to the maximum); no chunk straddles an
 *      unmapped page;
 *      multi_chunks counts the chunks of more than one page; spares are single
 *      pages (so are loose chunks' pages, counted apart: more than one page
 *      each); where the device can tell, one handle is behind every page of a
 *      chunk (C2's per-page check) and the device's pages are the heap's held
 *      pages.  Parked pages (mapped during a capture, access refused) are
 *      whole mapped chunks inside unmapped space, as many as the heap counts;
 *      nothing else mapped lies in unmapped space.
 *   C15 a page that a block of a living pool touches holds only that pool's
 *      blocks; a pool's free neighbours are apart only across a no_split
 *      pool's growth seam.
 *   C16 spill: host pages are mapped pages flagged host, whole chunks of
 *      them, counted in host_pages (never in mapped_pages, held pages or the
 *      cap) and in spilled_bytes; no block of a living pool touches one; the
 *      device agrees, page by page, which pages lie in host memory, and that
 *      it holds the heap's device pages plus its host ones (loose ones too).
 *   C17 small pages (small.c): a small page holds small_held live or pending
 *      blocks, at least one, each inside the page and of no pool, and its
 *      free blocks are flagged small; no free block elsewhere is; a page that
 *      is not small counts none.
 *
 * Each rule is one function, check_cN_..., its rule stated at its top;
 * gm_check, the entry point that tests and the fuzz driver call, runs them
 * in the order of `rules` (the layout first, what is built on it after) and
 * stops at the first that fails, its reason in `why`.  C12's page lists are
 * read first (paused_pages): the other rules exempt paused pages.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "heap_internal.h"

/* A broken invariant: GM_ECORRUPT, with the reason in why. */
#define fail(why, len, ...) gm_errorf(GM_ECORRUPT, why, len, __VA_ARGS__)

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

/* C1: blocks tile [base, base+va_size) in address order, 512-aligned, linked
 * both ways, each in a known state; unmapped blocks are whole pages. */
static int check_c1_tiling(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    if (!h->head || h->head->addr != h->base || h->head->prev)
        return fail(why, len, "the first block does not start the reserved range");
    const gm_block *last = NULL;
    for (const gm_block *b = h->head; b; last = b, b = b->next) {
        if (b->prev != last) return fail(why, len, "block %#lx: prev link is wrong", (unsigned long)b->addr);
        if (last && last->addr + last->size != b->addr)
            return fail(why, len, "blocks %#lx+%zu and %#lx overlap or leave a gap", (unsigned long)last->addr,
                        last->size, (unsigned long)b->addr);
        if (!b->size || b->size % GM_ALIGN || b->addr % GM_ALIGN)
            return fail(why, len, "block %#lx+%zu is empty or not 512-aligned", (unsigned long)b->addr, b->size);
        if (b->state == GM_BLOCK_UNMAPPED && ((b->addr - h->base) % h->page || b->size % h->page))
            return fail(why, len, "unmapped block %#lx+%zu is not whole pages", (unsigned long)b->addr, b->size);
        if (b->state != GM_BLOCK_UNMAPPED && b->state != GM_BLOCK_LIVE && b->state != GM_BLOCK_PENDING &&
            b->state != GM_BLOCK_FREE)
            return fail(why, len, "block %#lx has bad state %d", (unsigned long)b->addr, b->state);
    }
    if (last->addr + last->size != h->base + h->va_size) return fail(why, len, "blocks do not reach the range's end");
    return GM_OK;
}

/* C3: no two neighbours that may merge are left apart. */
static int check_c3_merged(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    for (const gm_block *last = h->head, *b = last->next; b; last = b, b = b->next) {
        if (b->state == GM_BLOCK_UNMAPPED && last->state == GM_BLOCK_UNMAPPED)
            return fail(why, len, "two unmapped neighbours at %#lx were not merged", (unsigned long)b->addr);
        if (b->state != GM_BLOCK_FREE || last->state != GM_BLOCK_FREE || last->pool != b->pool ||
            h_pool_seam(h, last, b) || h_small_seam(h, last, b))
            continue;
        gm_stream lo = h_free_owner(h, last), bo = h_free_owner(h, b);
        if (lo == bo || lo == GM_STREAM_ANY || bo == GM_STREAM_ANY)
            return fail(why, len, "free neighbours at %#lx could merge but did not", (unsigned long)b->addr);
    }
    return GM_OK;
}

/* C2, the device's side: it holds the pages the heap holds, the same
 * physical page behind every address, and the blocks are accessible. */
static int check_c2_device(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    const gm_device_verify *verify = h->dev->ops->verify;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (b->state == GM_BLOCK_UNMAPPED) continue;
        size_t p0 = h_page_floor(h, b->addr), p1 = h_page_ceil(h, b->addr + b->size);
        int touches_paused = 0;
        for (size_t p = p0; paused && p < p1; p++) touches_paused |= paused[p] != NULL;
        /* Free blocks too: they are handed out without another device call. */
        if (!touches_paused && !verify->accessible(h->dev, b->addr, b->size))
            return fail(why, len, "the device says block %#lx+%zu is not accessible", (unsigned long)b->addr, b->size);
        for (size_t p = p0; touches_paused && p < p1; p++)
            if (!paused[p] && !verify->accessible(h->dev, h_page_addr(h, p), h->page))
                return fail(why, len, "the device says page %zu under block %#lx is not accessible", p,
                            (unsigned long)b->addr);
    }
    size_t created = 0, dev_mapped = 0;
    verify->pages(h->dev, &created, &dev_mapped);
    size_t held = h->mapped_pages + h->n_spare + h->loose_pages + h->host_pages + h->host_loose_pages;
    if (dev_mapped != h->mapped_pages + h->host_pages || created != held)
        return fail(why, len, "the device holds %zu pages (%zu mapped) but the heap %zu (%zu mapped)", created,
                    dev_mapped, held, h->mapped_pages + h->host_pages);
    /* Not only how many: which physical page sits at each address. */
    for (size_t p = 0; p < h->n_pages; p++) {
        gm_handle at = verify->handle_at(h->dev, h_page_addr(h, p));
        if (at != h->page_handle[p])
            return fail(why, len, "page %zu: the heap has physical page %llu there, the device %llu", p,
                        (unsigned long long)h->page_handle[p], (unsigned long long)at);
    }
    return GM_OK;
}

/* C2: every page a live, pending or free block touches is mapped (a paused
 * one aside), no page wholly inside unmapped space is (a parked one aside),
 * mapped_pages counts them, and the device agrees where it can tell. */
static int check_c2_mapped(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    for (const gm_block *b = h->head; b; b = b->next) {
        size_t p0 = h_page_floor(h, b->addr), p1 = h_page_ceil(h, b->addr + b->size);
        for (size_t p = p0; p < p1; p++) {
            if (b->state == GM_BLOCK_UNMAPPED) {
                if (h->page_handle[p] && !h->parked[p])
                    return fail(why, len, "page %zu is mapped inside unmapped space", p);
            } else if (!h->page_handle[p] && !(paused && paused[p])) {
                return fail(why, len, "page %zu under %s block %#lx+%zu is not mapped", p,
                            b->state == GM_BLOCK_FREE ? "free" : "live/pending", (unsigned long)b->addr, b->size);
            }
        }
    }
    size_t mapped = 0;
    for (size_t p = 0; p < h->n_pages; p++) mapped += h->page_handle[p] != 0 && !h->host[p];
    if (mapped != h->mapped_pages)
        return fail(why, len, "%zu device pages mapped but the heap counts %zu", mapped, h->mapped_pages);
    return h->dev->ops->verify ? check_c2_device(h, paused, why, len) : GM_OK;
}

/* C14: chunks are whole runs of mapped pages with consistent metadata, at
 * most GM_CHUNK_PAGES_MAX long; multi_chunks, loose and parked pages are
 * counted right; parked pages are whole mapped chunks. */
static int check_c14_chunks(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    size_t multi = 0, loose = 0, parked = 0;
    for (size_t p = 0; p < h->n_pages; p++) {
        if (!h->parked[p]) continue;
        parked++;
        if (!h->page_handle[p] || (h->chunk_off[p] && !h->parked[p - 1]) ||
            (!h->chunk_off[p] && h->chunk_len[p] > h->n_pages - p) ||
            (!h->chunk_off[p] && memchr(h->parked + p, 0, h->chunk_len[p])))
            return fail(why, len, "parked page %zu is not part of a wholly parked, mapped chunk", p);
    }
    if (parked != h->n_parked) return fail(why, len, "%zu pages parked but the heap counts %zu", parked, h->n_parked);
    for (size_t p = 0; p < h->n_pages;) {
        if (!h->page_handle[p]) {
            if (h->chunk_len[p] || h->chunk_off[p])
                return fail(why, len, "unmapped page %zu has chunk data (length %u, offset %u)", p,
                            (unsigned)h->chunk_len[p], (unsigned)h->chunk_off[p]);
            p++;
            continue;
        }
        size_t k = h->chunk_len[p];
        if (h->chunk_off[p] || !k || k > GM_CHUNK_PAGES_MAX || k > h->n_pages - p)
            return fail(why, len, "page %zu starts a chunk of %zu pages at offset %u (at most %d)", p, k,
                        (unsigned)h->chunk_off[p], GM_CHUNK_PAGES_MAX);
        for (size_t i = 1; i < k; i++)
            if (h->page_handle[p + i] != h->page_handle[p] || h->chunk_off[p + i] != i || h->chunk_len[p + i] != k)
                return fail(why, len,
                            "chunk of %zu pages at page %zu: page %zu is not part of it (handle %llu, offset %u, "
                            "length %u)",
                            k, p, p + i, (unsigned long long)h->page_handle[p + i], (unsigned)h->chunk_off[p + i],
                            (unsigned)h->chunk_len[p + i]);
        multi += k > 1;
        p += k;
    }
    if (multi != h->multi_chunks)
        return fail(why, len, "%zu chunks of several pages are mapped but the heap counts %zu", multi, h->multi_chunks);
    for (size_t i = 0; i < h->n_loose; i++) {
        if (h->loose[i].pages < 2) return fail(why, len, "a loose chunk has %zu pages", h->loose[i].pages);
        loose += h->loose[i].pages;
    }
    if (loose != h->loose_pages)
        return fail(why, len, "loose chunks hold %zu pages but the heap counts %zu", loose, h->loose_pages);
    return GM_OK;
}

/* C7: no physical page is held twice (mapped, spare or loose). */
static int check_c7_held_once(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    gm_handle *all =
        malloc((h->mapped_pages + h->host_pages + h->n_spare + h->n_loose + h->n_host_loose + 1) * sizeof *all);
    if (!all) return GM_OK; /* no host memory: nothing to say */
    size_t k = 0;
    for (size_t p = 0; p < h->n_pages; p++)
        if (h->page_handle[p] && !h->chunk_off[p]) all[k++] = h->page_handle[p];
    for (size_t i = 0; i < h->n_spare; i++) all[k++] = h->spare[i];
    for (size_t i = 0; i < h->n_loose; i++) all[k++] = h->loose[i].handle;
    for (size_t i = 0; i < h->n_host_loose; i++) all[k++] = h->host_loose[i];
    qsort(all, k, sizeof *all, cmp_handle);
    for (size_t i = 1; i < k; i++)
        if (all[i] == all[i - 1]) {
            unsigned long long dup = (unsigned long long)all[i];
            free(all);
            return fail(why, len, "physical page %llu is held twice", dup);
        }
    free(all);
    return GM_OK;
}

/* C4: each owner's index holds exactly its free blocks, and every free block
 * has its owner (fi_check for the index's own invariants). */
static int check_c4_indexes(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    size_t n_free = 0, b_free = 0, indexed = 0, indexed_bytes = 0;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (b->state != GM_BLOCK_FREE) continue;
        if (!h_owner_find(h, b->pool, b->stream))
            return fail(why, len, "free block %#lx names an unknown owner", (unsigned long)b->addr);
        n_free++, b_free += b->size;
    }
    for (size_t i = 0; i < h->n_owners; i++) {
        const gm_owner *o = h->owners[i];
        if (fi_check(&o->idx, why, len)) return GM_ECORRUPT;
        for (unsigned k = 0; k < 2; k++)
            for (unsigned fl = 0; fl < FI_FL; fl++)
                for (unsigned sl = 0; sl < FI_SL; sl++)
                    for (const gm_block *b = o->idx.side[k].bins[fl][sl]; b; b = b->lnext)
                        if (b->state != GM_BLOCK_FREE || b->stream != o->stream || b->pool != o->pool)
                            return fail(why, len, "index of stream %llu holds block %#lx that is not its free block",
                                        (unsigned long long)o->stream, (unsigned long)b->addr);
        indexed += o->idx.count;
        indexed_bytes += o->idx.bytes;
    }
    if (indexed != n_free || indexed_bytes != b_free)
        return fail(why, len, "indexes hold %zu free blocks / %zu bytes but %lld / %lld exist", indexed, indexed_bytes,
                    (long long)n_free, (long long)b_free);
    return GM_OK;
}

/* C5: the live table holds exactly the live blocks; the pending list exactly
 * the pending ones. */
static int check_c5_live_pending(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    size_t n_live = 0, pending = 0, in_list = 0;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (b->state == GM_BLOCK_PENDING) pending++;
        if (b->state != GM_BLOCK_LIVE) continue;
        if (h_live_find(h, b->addr) != b)
            return fail(why, len, "live block %#lx is missing from the live table", (unsigned long)b->addr);
        n_live++;
    }
    if (h->n_live != n_live) return fail(why, len, "live table counts %zu, blocks %lld", h->n_live, (long long)n_live);
    for (const gm_block *b = h->pending_head; b; b = b->lnext, in_list++)
        if (b->state != GM_BLOCK_PENDING) return fail(why, len, "pending list holds a non-pending block");
    if (in_list != pending || in_list != h->n_pending)
        return fail(why, len, "pending list holds %zu, counter %zu, blocks %zu", in_list, h->n_pending, pending);
    return GM_OK;
}

/* Recounts of the statistics that have a "current", all blocks and small ones. */
struct stat_recount {
    int64_t n_live, n_live_s, b_live, b_live_s, req, req_s;
    int64_t n_act, n_act_s, b_act, b_act_s, n_free, n_free_s, b_free, b_free_s;
};

/* C6: every statistic with a "current" equals a recount; a live block's
 * requested size fits in it. */
static int check_c6_stats(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    struct stat_recount c = {0};
    for (const gm_block *b = h->head; b; b = b->next) {
        int sm = b->size <= GM_SMALL_SIZE;
        int64_t sz = (int64_t)b->size, sz_s = sm ? sz : 0;
        if (b->state == GM_BLOCK_LIVE) {
            if (b->requested > b->size) return fail(why, len, "block %#lx: requested > size", (unsigned long)b->addr);
            c.n_live++, c.n_live_s += sm, c.b_live += sz, c.b_live_s += sz_s;
            c.req += (int64_t)b->requested, c.req_s += sm ? (int64_t)b->requested : 0;
        }
        if (b->state == GM_BLOCK_LIVE || b->state == GM_BLOCK_PENDING)
            c.n_act++, c.n_act_s += sm, c.b_act += sz, c.b_act_s += sz_s;
        if (b->state == GM_BLOCK_FREE) c.n_free++, c.n_free_s += sm, c.b_free += sz, c.b_free_s += sz_s;
    }
    const gm_stats *st = &h->st;
    int rc;
    int64_t held = (int64_t)(h->mapped_pages + h->n_spare + h->loose_pages);
#define STAT_IS(name, all, small) (rc = stat_is(st->name, all, small, #name, why, len))
    if (STAT_IS(allocation, c.n_live, c.n_live_s) || STAT_IS(allocated_bytes, c.b_live, c.b_live_s) ||
        STAT_IS(requested_bytes, c.req, c.req_s) || STAT_IS(active, c.n_act, c.n_act_s) ||
        STAT_IS(active_bytes, c.b_act, c.b_act_s) || STAT_IS(inactive_split, c.n_free, c.n_free_s) ||
        STAT_IS(inactive_split_bytes, c.b_free, c.b_free_s) || STAT_IS(segment, held, 0) ||
        STAT_IS(reserved_bytes, held * (int64_t)h->page, 0))
#undef STAT_IS
        return rc;
    if ((int64_t)h->live_bytes != c.b_live) return fail(why, len, "live_bytes disagrees with a recount");
    return GM_OK;
}

/* C12, the lists' half, run first: each page a paused pool released, mapped
 * to that pool (*owner, calloc'd over every page; NULL when no page is
 * paused), with the lists checked on the way. */
static int paused_pages(gm_heap *h, const gm_pool ***owner, char *why, size_t len) {
    *owner = NULL;
    size_t total = 0;
    for (size_t i = 0; i < h->n_pools; i++) {
        const gm_pool *p = h->pools[i];
        if (!p->paused) {
            if (p->n_paused || p->paused_list || p->backup || p->shared_pages)
                return fail(why, len, "pool (%llu, %llu) is not paused but keeps paused pages",
                            (unsigned long long)p->id.first, (unsigned long long)p->id.second);
            continue;
        }
        if (p->use_count <= 0) return fail(why, len, "an ended pool is paused");
        total += p->n_paused;
    }
    if (total != h->paused_pages)
        return fail(why, len, "pools list %zu paused pages but the heap counts %zu", total, h->paused_pages);
    if (!total) return GM_OK;
    const gm_pool **own = calloc(h->n_pages, sizeof *own);
    if (!own) return GM_OK; /* no host memory: nothing to say */
    for (size_t i = 0; i < h->n_pools; i++) {
        const gm_pool *p = h->pools[i];
        for (size_t k = 0; k < p->n_paused; k++) {
            const gm_paused_page *e = &p->paused_list[k];
            if (e->page >= h->n_pages || (k && (e->page <= e[-1].page || e->slot <= e[-1].slot)) || own[e->page]) {
                free(own);
                return fail(why, len, "paused pool (%llu, %llu): its page list is out of order or repeats a page",
                            (unsigned long long)p->id.first, (unsigned long long)p->id.second);
            }
            if (h->page_handle[e->page]) {
                free(own);
                return fail(why, len, "page %zu of paused pool (%llu, %llu) is mapped", e->page,
                            (unsigned long long)p->id.first, (unsigned long long)p->id.second);
            }
            own[e->page] = p;
        }
    }
    *owner = own;
    return GM_OK;
}

/* C12, the blocks' half: every block on a paused page is a live, pending or
 * free block of the pool that paused it. */
static int check_c12_paused(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    if (!paused) return GM_OK; /* no page paused (paused_pages checked the lists) */
    for (const gm_block *b = h->head; b; b = b->next) {
        for (size_t p = h_page_floor(h, b->addr); p < h_page_ceil(h, b->addr + b->size); p++) {
            if (!paused[p]) continue;
            if (b->state == GM_BLOCK_UNMAPPED) return fail(why, len, "paused page %zu lies in unmapped space", p);
            if (paused[p] != b->pool)
                return fail(why, len, "block %#lx+%zu lies on page %zu, paused by a pool it is not in",
                            (unsigned long)b->addr, b->size, p);
        }
    }
    return GM_OK;
}

/* C11: stream safety: owners' release bookkeeping is coherent, and a free
 * block every stream may reuse holds only frees proven done (h_free_owner
 * says who may). */
static int check_c11_streams(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    if (!h->n_owners || h->owners[0]->stream != GM_STREAM_ANY)
        return fail(why, len, "owner 0 is not the every-stream owner");
    for (size_t i = 0; i < h->n_owners; i++) {
        const gm_owner *o = h->owners[i];
        for (size_t j = 0; j < i; j++)
            if (h->owners[j]->stream == o->stream && h->owners[j]->pool == o->pool)
                return fail(why, len, "stream %llu has two owner records", (unsigned long long)o->stream);
        if (o->safe_seq > h->free_seq)
            return fail(why, len, "stream %llu: proven free sequence %llu is past the last free %llu",
                        (unsigned long long)o->stream, (unsigned long long)o->safe_seq,
                        (unsigned long long)h->free_seq);
        if (o->releasing) {
            if (o->stream == GM_STREAM_ANY) return fail(why, len, "an every-stream owner has a release in flight");
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
            if (!b->n_uses) return fail(why, len, "pending block %#lx waits for no stream", (unsigned long)b->addr);
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
        if (h_free_owner(h, b) != GM_STREAM_ANY || b->seq == 0) continue; /* seq 0: fresh pages, never used */
        /* What a completed event or a sync proved of a stream holds in every
         * pool: the proof is the best any owner of that stream keeps. */
        int known = 0;
        uint64_t proven = 0;
        for (size_t i = 0; b->origin != GM_STREAM_ANY && i < h->n_owners; i++) {
            if (h->owners[i]->stream != b->origin) continue;
            known = 1;
            if (h->owners[i]->safe_seq > proven) proven = h->owners[i]->safe_seq;
        }
        /* Owners dropped once their stream had no block left (owners_trim)
         * take their proofs along: what they proved is up to retired_safe_seq. */
        if (b->seq <= h->retired_safe_seq) continue;
        if (!known)
            return fail(why, len, "free block %#lx (every stream) holds free %llu of no known stream",
                        (unsigned long)b->addr, (unsigned long long)b->seq);
        if (b->seq > proven)
            return fail(why, len,
                        "free block %#lx is reusable by every stream, but its free %llu on stream %llu is not "
                        "proven done (proven up to %llu)",
                        (unsigned long)b->addr, (unsigned long long)b->seq, (unsigned long long)b->origin,
                        (unsigned long long)proven);
    }
    return GM_OK;
}

/* C13: a device wait's hand-over left in place (gm_heap.lazy_stream) hides no
 * block from a stream that allocates. */
static int check_c13_hand_over(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (b->state != GM_BLOCK_FREE || b->stream == GM_STREAM_ANY) continue;
        if (b->epoch > h->epoch)
            return fail(why, len, "free block %#lx is from epoch %llu, past the heap's %llu", (unsigned long)b->addr,
                        (unsigned long long)b->epoch, (unsigned long long)h->epoch);
        if (h->lazy_stream == GM_STREAM_ANY && b->epoch < h->epoch)
            return fail(why, len,
                        "free block %#lx of stream %llu is from an earlier epoch (everyone's) but no hand-over is "
                        "left in place",
                        (unsigned long)b->addr, (unsigned long long)b->stream);
        if (h->lazy_stream != GM_STREAM_ANY && b->stream != h->lazy_stream)
            return fail(why, len,
                        "free block %#lx belongs to stream %llu while a hand-over of stream %llu's blocks is left in "
                        "place",
                        (unsigned long)b->addr, (unsigned long long)b->stream, (unsigned long long)h->lazy_stream);
    }
    return GM_OK;
}

/* R1's left side, from the blocks: b is general space, heads its run, and is
 * not a lone free block. */
static int heads_indexed_run(const gm_block *b) {
    if (!h_general_space(b) || (b->prev && h_general_space(b->prev))) return 0;
    return !(b->state == GM_BLOCK_FREE && !(b->next && h_general_space(b->next)));
}

static int listed_heads_run(gm_block *b, void *arg) {
    (void)arg;
    return !heads_indexed_run(b);
}

/* C10: the run index and the page-use counts equal a recount (runindex.h R1,
 * R2, P1, P2). */
static int check_c10_runs(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    const gm_runindex *ri = &h->runs;
    /* R1: recount every run from the blocks. */
    size_t runs = 0, bytes = 0;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (!heads_indexed_run(b)) {
            if (b->run_len)
                return fail(why, len, "run index: a block that heads no indexed run has a run length (block %#lx)",
                            (unsigned long)b->addr);
            continue;
        }
        size_t n = 0;
        for (const gm_block *c = b; c && h_general_space(c); c = c->next) n += c->size;
        if (b->run_len != n)
            return fail(why, len, "run index: run at %#lx is %zu bytes long but its head says %zu",
                        (unsigned long)b->addr, n, b->run_len);
        runs++;
        bytes += n;
    }
    /* R2: the bins hold exactly those heads. */
    if (ri_check(ri, why, len)) return GM_ECORRUPT;
    if (ri_each_at_least(ri, 0, listed_heads_run, NULL))
        return fail(why, len, "run index: a bin holds a block that heads no indexed run");
    if (ri->count != runs || ri->bytes != bytes)
        return fail(why, len, "run index: %zu runs / %zu bytes exist, the bins and counters say %zu / %zu", runs, bytes,
                    ri->count, ri->bytes);
    /* P1, P2: recount page use. */
    uint32_t *ep = calloc(h->n_pages ? h->n_pages : 1, sizeof *ep);
    if (!ep) return GM_OK; /* no memory to check with: nothing proven wrong */
    size_t pages = 0;
    for (const gm_block *b = h->head; b; b = b->next)
        if (h_keeps_pages(b))
            ri_ep_block(ep, h_page_floor(h, b->addr), h_page_floor(h, b->addr + b->size - 1), 1, &pages);
    int rc = ri_check_pages(ri, ep, h->n_pages, pages, why, len);
    free(ep);
    return rc;
}

static int known_pool(const gm_heap *h, const gm_pool *p) {
    for (size_t i = 0; i < h->n_pools; i++)
        if (h->pools[i] == p) return 1;
    return 0;
}

/* C8, the blocks' side: pools known, free blocks only in living pools, and
 * every pool's counters equal a recount. */
static int check_pool_blocks(gm_heap *h, char *why, size_t len) {
    size_t n = h->n_pools;
    size_t *live_n = calloc(n + 1, sizeof *live_n), *live_b = calloc(n + 1, sizeof *live_b);
    size_t *free_n = calloc(n + 1, sizeof *free_n), *free_b = calloc(n + 1, sizeof *free_b);
    int rc = GM_OK;
    if (!live_n || !live_b || !free_n || !free_b) goto out; /* no host memory: nothing to say */
    size_t pinned_free = 0;
    for (const gm_block *b = h->head; b && !rc; b = b->next) {
        if (!b->pool) continue;
        size_t i = 0;
        while (i < n && h->pools[i] != b->pool) i++;
        if (i == n) {
            rc = fail(why, len, "block %#lx names a pool the heap does not know", (unsigned long)b->addr);
            break;
        }
        if (b->state == GM_BLOCK_LIVE || b->state == GM_BLOCK_PENDING) {
            live_n[i]++, live_b[i] += b->size;
        } else if (b->state == GM_BLOCK_FREE && b->pool->use_count > 0) {
            free_n[i]++, free_b[i] += b->size, pinned_free += b->size;
        } else {
            rc = fail(why, len, "%s block %#lx belongs to %s pool (%llu, %llu)",
                      b->state == GM_BLOCK_FREE ? "free" : "unmapped", (unsigned long)b->addr,
                      b->pool->use_count > 0 ? "a living" : "an ended", (unsigned long long)b->pool->id.first,
                      (unsigned long long)b->pool->id.second);
        }
    }
    for (size_t i = 0; i < n && !rc; i++) {
        const gm_pool *p = h->pools[i];
        if (p->use_count < 0 || (p->use_count == 0 && !live_n[i]))
            rc = fail(why, len, "pool (%llu, %llu) has use count %lld and %zu live blocks",
                      (unsigned long long)p->id.first, (unsigned long long)p->id.second, (long long)p->use_count,
                      live_n[i]);
        else if (!p->id.first && !p->id.second)
            rc = fail(why, len, "a pool is named (0, 0)");
        else if (p->live_blocks != live_n[i] || p->live_bytes != live_b[i] || p->free_blocks != free_n[i] ||
                 p->free_bytes != free_b[i])
            rc = fail(why, len,
                      "pool (%llu, %llu) counts %zu live blocks / %zu bytes and %zu free / %zu, a recount gives "
                      "%zu / %zu and %zu / %zu",
                      (unsigned long long)p->id.first, (unsigned long long)p->id.second, p->live_blocks, p->live_bytes,
                      p->free_blocks, p->free_bytes, live_n[i], live_b[i], free_n[i], free_b[i]);
        for (size_t j = 0; j < i && !rc; j++)
            if (h->pools[j]->use_count > 0 && p->use_count > 0 && h->pools[j]->id.first == p->id.first &&
                h->pools[j]->id.second == p->id.second)
                rc = fail(why, len, "two living pools are named (%llu, %llu)", (unsigned long long)p->id.first,
                          (unsigned long long)p->id.second);
    }
    if (!rc && pinned_free != h->pool_free_bytes)
        rc = fail(why, len, "pools hold %zu free bytes but the heap counts %zu", pinned_free, h->pool_free_bytes);
out:
    free(live_n), free(live_b), free(free_n), free(free_b);
    return rc;
}

/* C8, the owners' side: a pool's owners belong to a living pool, and each
 * living pool has its everyone-owner. */
static int check_pool_owners(gm_heap *h, char *why, size_t len) {
    if (h->n_owners == 0 || h->owners[0]->pool || h->owners[0]->stream != GM_STREAM_ANY)
        return fail(why, len, "owners[0] is not the general heap's GM_STREAM_ANY");
    for (size_t i = 0; i < h->n_owners; i++) {
        const gm_owner *o = h->owners[i];
        if (o->pool && (!known_pool(h, o->pool) || o->pool->use_count <= 0))
            return fail(why, len, "an owner of stream %llu belongs to an ended or unknown pool",
                        (unsigned long long)o->stream);
        for (size_t j = 0; j < i; j++)
            if (h->owners[j]->pool == o->pool && h->owners[j]->stream == o->stream)
                return fail(why, len, "stream %llu has two owners in one pool", (unsigned long long)o->stream);
    }
    for (size_t i = 0; i < h->n_pools; i++) {
        gm_pool *p = h->pools[i];
        if (p->use_count > 0 && (!p->any || p->any->pool != p || p->any->stream != GM_STREAM_ANY ||
                                 h_owner_find(h, p, GM_STREAM_ANY) != p->any))
            return fail(why, len, "pool (%llu, %llu) lacks its everyone-owner", (unsigned long long)p->id.first,
                        (unsigned long long)p->id.second);
        if (p->use_count == 0 && p->any) return fail(why, len, "an ended pool keeps an owner");
    }
    return GM_OK;
}

/* C8, the pages' side: pages under a living pool's blocks are counted as used
 * (so nothing reclaims them), checked against a recount by page. */
static int check_pinned_pages(gm_heap *h, char *why, size_t len) {
    size_t top = 0;
    for (const gm_block *b = h->head; b; b = b->next)
        if (b->state != GM_BLOCK_UNMAPPED) top = h_page_ceil(h, b->addr + b->size);
    uint8_t *used = calloc(top ? top : 1, 1);
    if (!used) return GM_OK;
    size_t n = 0;
    for (const gm_block *b = h->head; b; b = b->next) {
        int holds =
            b->state == GM_BLOCK_LIVE || b->state == GM_BLOCK_PENDING || (b->state == GM_BLOCK_FREE && h_pinned(b));
        if (!holds) continue;
        for (size_t p = h_page_floor(h, b->addr); p < h_page_ceil(h, b->addr + b->size); p++) {
            if (!used[p]) n++;
            used[p] = 1;
        }
    }
    free(used);
    size_t counted = h_used_pages(h);
    if (counted != n)
        return fail(why, len, "%zu pages back live, pending or pool blocks but the heap counts %zu used", n, counted);
    return GM_OK;
}
/* C8: private pools' blocks, owners and pages are accounted for. */
static int check_c8_pools(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    int rc = check_pool_blocks(h, why, len);
    if (!rc) rc = check_pool_owners(h, why, len);
    if (!rc) rc = check_pinned_pages(h, why, len);
    return rc;
}

/* C15: a page that a block of a living pool touches holds blocks of that pool
 * only (a pool's pages are its own, as a native segment is). */
static int check_c15_pool_pages(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    if (!h->n_pools) return GM_OK;
    size_t top = 0;
    for (const gm_block *b = h->head; b; b = b->next)
        if (b->state != GM_BLOCK_UNMAPPED) top = h_page_ceil(h, b->addr + b->size);
    const gm_pool **who = calloc(top ? top : 1, sizeof *who);
    uint8_t *seen = calloc(top ? top : 1, 1);
    int rc = GM_OK;
    for (const gm_block *b = h->head; b && who && seen && !rc; b = b->next) {
        if (b->state == GM_BLOCK_UNMAPPED) continue;
        const gm_pool *o = h_pinned(b) ? b->pool : NULL;
        for (size_t p = h_page_floor(h, b->addr); p < h_page_ceil(h, b->addr + b->size) && !rc; p++) {
            if (seen[p] && who[p] != o)
                rc = fail(why, len, "page %zu holds blocks of a living pool and others (block %#lx)", p,
                          (unsigned long)b->addr);
            seen[p] = 1;
            who[p] = o;
        }
    }
    free(who);
    free(seen);
    return rc;
}

/* C9: capture: the deferred count equals the pending blocks marked deferred;
 * a deferred block is pending with no event recorded. */
static int check_c9_deferred(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    size_t n = 0;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (!b->deferred) continue;
        if (b->state != GM_BLOCK_PENDING)
            return fail(why, len, "block %#lx is deferred but not pending", (unsigned long)b->addr);
        if (b->wait_sync) return fail(why, len, "deferred block %#lx also waits for a sync", (unsigned long)b->addr);
        for (uint32_t i = 0; i < b->n_uses; i++)
            if (b->events[i]) return fail(why, len, "deferred block %#lx has an event", (unsigned long)b->addr);
        n++;
    }
    if (n != h->n_deferred) return fail(why, len, "%zu blocks are deferred but the heap counts %zu", n, h->n_deferred);
    if (h->capture_count < 0) return fail(why, len, "capture count is %d", h->capture_count);
    return GM_OK;
}

/* C16: host pages are mapped, whole chunks, counted apart; no living pool's
 * block touches one; the device agrees which pages are host pages. */
static int check_c16_host(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    size_t n = 0, loose = 0;
    const gm_device_verify *verify = h->dev->ops->verify;
    for (size_t p = 0; p < h->n_pages; p++) {
        if (h->host[p] && (!h->page_handle[p] || h->host[h_chunk_first(h, p)] != 1 ||
                           memchr(h->host + h_chunk_first(h, p), 0, h->chunk_len[p])))
            return fail(why, len, "host page %zu is not part of a mapped chunk of host pages", p);
        n += h->host[p] != 0;
        if (h->host[p] > 1) return fail(why, len, "page %zu has host flag %u", p, (unsigned)h->host[p]);
        if (verify && verify->host_at && h->page_handle[p] &&
            verify->host_at(h->dev, h_page_addr(h, p)) != (h->host[p] != 0))
            return fail(why, len, "page %zu: the heap says it lies in %s memory, the device disagrees", p,
                        h->host[p] ? "host" : "device");
    }
    if (n != h->host_pages)
        return fail(why, len, "%zu host pages are mapped but the heap counts %zu", n, h->host_pages);
    for (size_t i = 0; i < h->n_host_loose; i++) loose += h->host_loose_len[i];
    if (loose != h->host_loose_pages)
        return fail(why, len, "loose host chunks hold %zu pages but the heap counts %zu", loose, h->host_loose_pages);
    int rc = stat_is(h->st.spilled_bytes, (int64_t)(n * h->page), 0, "spilled_bytes", why, len);
    if (rc) return rc;
    for (const gm_block *b = h->head; n && b; b = b->next)
        if (b->state != GM_BLOCK_UNMAPPED && h_pinned(b))
            for (size_t p = h_page_floor(h, b->addr); p < h_page_ceil(h, b->addr + b->size); p++)
                if (h->host[p])
                    return fail(why, len, "block %#lx of a living pool lies on host page %zu", (unsigned long)b->addr,
                                p);
    if (!h->host_kept_stale && h->host_kept != h_host_kept_count(h))
        return fail(why, len, "the heap keeps %zu host pages in use but a recount gives %zu", h->host_kept,
                    h_host_kept_count(h));
    return GM_OK;
}

typedef int check_rule(gm_heap *h, const gm_pool **paused, char *why, size_t len);

/* The rules in the order they are checked: the layout first, what is built
 * on it after. */
/* C17 (see the top): each small page's count, and the free blocks' flags. */
static int check_c17_small(gm_heap *h, const gm_pool **paused, char *why, size_t len) {
    (void)paused;
    uint32_t *seen = calloc(h->n_pages, sizeof *seen);
    if (!seen) return fail(why, len, "C17: no host memory for the recount");
    int rc = GM_OK;
    for (const gm_block *b = h->head; b && !rc; b = b->next) {
        if (b->state == GM_BLOCK_UNMAPPED) continue;
        size_t p0 = h_page_floor(h, b->addr), p1 = h_page_floor(h, b->addr + b->size - 1);
        int small = h->small_page[p0] || h->small_page[p1];
        if (small && (p0 != p1 || b->pool))
            rc = fail(why, len, "C17: block %#lx crosses a small page's edge", (unsigned long)b->addr);
        else if (b->state == GM_BLOCK_FREE && b->small != small)
            rc = fail(why, len, "C17: free block %#lx is flagged %d in a page that is %s", (unsigned long)b->addr,
                      b->small, small ? "small" : "not small");
        else if (small && b->state != GM_BLOCK_FREE)
            seen[p0]++;
    }
    for (size_t p = 0; p < h->n_pages && !rc; p++)
        if (seen[p] != h->small_held[p] || (h->small_page[p] && !seen[p]))
            rc = fail(why, len, "C17: small page %zu holds %u live or pending blocks but counts %u", p, seen[p],
                      h->small_held[p]);
    free(seen);
    return rc;
}

static check_rule *const rules[] = {
    check_c12_paused,    check_c1_tiling,  check_c3_merged,       check_c2_mapped,      check_c14_chunks,
    check_c7_held_once,  check_c4_indexes, check_c5_live_pending, check_c6_stats,       check_c11_streams,
    check_c13_hand_over, check_c10_runs,   check_c8_pools,        check_c15_pool_pages, check_c9_deferred,
    check_c16_host,      check_c17_small,
};

int gm_check(gm_heap *h, char *why, size_t whylen) {
    if (why && whylen) why[0] = 0;
    pthread_mutex_lock(&h->lock);
    const gm_pool **paused = NULL;
    int rc = paused_pages(h, &paused, why, whylen);
    for (size_t i = 0; !rc && i < sizeof rules / sizeof *rules; i++) rc = rules[i](h, paused, why, whylen);
    free(paused);
    pthread_mutex_unlock(&h->lock);
    return rc;
}
