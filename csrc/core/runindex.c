/* runindex.c -- see runindex.h for the structures and their invariants. */
#include "runindex.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "heap_internal.h"

int ri_init(gm_runindex *ri, size_t n_pages) {
    memset(ri, 0, sizeof *ri);
    ri->live_ep = calloc(n_pages ? n_pages : 1, sizeof *ri->live_ep);
    return ri->live_ep ? GM_OK : GM_ENOMEM;
}

void ri_free(gm_runindex *ri) {
    free(ri->live_ep);
    ri->live_ep = NULL;
}

/* Lengths in 512-byte units, binned as freeindex.h bins sizes. */
static inline unsigned ri_fl_sl(size_t len, unsigned *sl) { return fi_fl_sl(len / GM_ALIGN, sl); }

unsigned ri_bin(size_t len) {
    unsigned sl, fl = ri_fl_sl(len, &sl);
    return fl * FI_SL + sl;
}

void ri_insert(gm_runindex *ri, gm_block *b) {
    unsigned sl, fl = ri_fl_sl(b->run_len, &sl);
    gm_block **slot = &ri->bins[fl][sl];
    b->rprev = NULL;
    b->rnext = *slot;
    if (*slot) (*slot)->rprev = b;
    *slot = b;
    ri->sl_bitmap[fl] |= 1u << sl;
    ri->fl_bitmap |= 1ull << fl;
    ri->count++;
    ri->bytes += b->run_len;
}

void ri_remove(gm_runindex *ri, gm_block *b) {
    unsigned sl, fl = ri_fl_sl(b->run_len, &sl);
    if (b->rprev)
        b->rprev->rnext = b->rnext;
    else
        ri->bins[fl][sl] = b->rnext;
    if (b->rnext) b->rnext->rprev = b->rprev;
    b->rprev = b->rnext = NULL;
    if (!ri->bins[fl][sl]) {
        ri->sl_bitmap[fl] &= ~(1u << sl);
        if (!ri->sl_bitmap[fl]) ri->fl_bitmap &= ~(1ull << fl);
    }
    ri->count--;
    ri->bytes -= b->run_len;
}

void ri_move_head(gm_runindex *ri, gm_block *old, gm_block *head, size_t len) {
    if (ri_bin(len) != ri_bin(old->run_len)) {
        ri_remove(ri, old);
        old->run_len = 0;
        head->run_len = len;
        ri_insert(ri, head);
        return;
    }
    /* Same bin: the new head takes the old one's place in the list. */
    head->rprev = old->rprev;
    head->rnext = old->rnext;
    if (head->rprev)
        head->rprev->rnext = head;
    else {
        unsigned sl, fl = ri_fl_sl(len, &sl);
        ri->bins[fl][sl] = head;
    }
    if (head->rnext) head->rnext->rprev = head;
    ri->bytes += len - old->run_len;
    old->rprev = old->rnext = NULL;
    old->run_len = 0;
    head->run_len = len;
}

int ri_each_at_least(const gm_runindex *ri, size_t len, int (*fn)(gm_block *head, void *arg), void *arg) {
    unsigned sl0, fl0 = ri_fl_sl(len, &sl0);
    if (fl0 >= FI_FL) return 0;
    /* The request's own bin holds shorter runs too; the bins above hold none. */
    for (gm_block *b = ri->bins[fl0][sl0]; b; b = b->rnext) {
        if (b->run_len < len) continue;
        int rc = fn(b, arg);
        if (rc) return rc;
    }
    for (unsigned fl = fl0, sl = sl0 + 1u; (fl = fi_first_bin(ri->fl_bitmap, ri->sl_bitmap, fl, &sl)) < FI_FL; sl++) {
        for (gm_block *b = ri->bins[fl][sl]; b; b = b->rnext) {
            int rc = fn(b, arg);
            if (rc) return rc;
        }
    }
    return 0;
}

void gm_run_unindex(gm_heap *h, gm_block *head) {
    ri_remove(&h->runs, head);
    head->run_len = 0;
}

void gm_run_index(gm_heap *h, gm_block *head) {
    size_t len = 0;
    for (const gm_block *c = head; c && gm_general_space(c); c = c->next) len += c->size;
    head->run_len = len;
    ri_insert(&h->runs, head);
}

/* ---- the checker's part ---- */

static int bad(char *why, size_t len, const char *msg, const gm_block *b) {
    if (why && len) snprintf(why, len, "run index: %s (block %#lx)", msg, b ? (unsigned long)b->addr : 0ul);
    return GM_ECORRUPT;
}

/* R1's left side, from the blocks: b is general space, heads its run, and is
 * not a lone free block. */
static int heads_indexed_run(const gm_block *b) {
    if (!gm_general_space(b) || (b->prev && gm_general_space(b->prev))) return 0;
    return !(b->state == GM_BLOCK_FREE && !(b->next && gm_general_space(b->next)));
}

int gm_runs_check(gm_heap *h, char *why, size_t whylen) {
    const gm_runindex *ri = &h->runs;
    /* R1: recount every run from the blocks. */
    size_t runs = 0, bytes = 0;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (!heads_indexed_run(b)) {
            if (b->run_len) return bad(why, whylen, "a block that heads no indexed run has a run length", b);
            continue;
        }
        size_t len = 0;
        for (const gm_block *c = b; c && gm_general_space(c); c = c->next) len += c->size;
        if (b->run_len != len) {
            if (why && whylen)
                snprintf(why, whylen, "run index: run at %#lx is %zu bytes long but its head says %zu",
                         (unsigned long)b->addr, len, b->run_len);
            return GM_ECORRUPT;
        }
        runs++;
        bytes += len;
    }
    /* R2: the bins hold exactly those heads. */
    size_t listed = 0, listed_bytes = 0;
    for (unsigned fl = 0; fl < FI_FL; fl++) {
        if (((ri->fl_bitmap >> fl) & 1u) != (ri->sl_bitmap[fl] != 0))
            return bad(why, whylen, "a first-level bit disagrees with its bins", NULL);
        for (unsigned sl = 0; sl < FI_SL; sl++) {
            const gm_block *b = ri->bins[fl][sl], *prev = NULL;
            if (((ri->sl_bitmap[fl] >> sl) & 1u) != (b != NULL))
                return bad(why, whylen, "a bitmap bit disagrees with its bin", NULL);
            for (; b; prev = b, b = b->rnext) {
                if (b->rprev != prev) return bad(why, whylen, "a bin is not a doubly linked list", b);
                if (!b->run_len || !heads_indexed_run(b))
                    return bad(why, whylen, "a bin holds a block that heads no indexed run", b);
                if (ri_bin(b->run_len) != fl * FI_SL + sl) return bad(why, whylen, "a run sits in the wrong bin", b);
                listed++;
                listed_bytes += b->run_len;
            }
        }
    }
    if (listed != runs || listed_bytes != bytes || ri->count != runs || ri->bytes != bytes) {
        if (why && whylen)
            snprintf(why, whylen,
                     "run index: %zu runs / %zu bytes exist, the bins hold %zu / %zu, the counters say %zu / %zu", runs,
                     bytes, listed, listed_bytes, ri->count, ri->bytes);
        return GM_ECORRUPT;
    }
    /* P1, P2: recount page use. */
    uint32_t *live = calloc(h->n_pages ? h->n_pages : 1, sizeof *live);
    if (!live) return GM_OK; /* no memory to check with: nothing proven wrong */
    size_t live_pages = 0;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (!gm_keeps_pages(b)) continue;
        size_t p0 = gm_page_floor(h, b->addr), p1 = gm_page_floor(h, b->addr + b->size - 1);
        live[p0]++;
        if (p1 != p0) live[p1]++;
        if (p1 > p0 + 1) live_pages += p1 - p0 - 1;
    }
    int rc = GM_OK;
    for (size_t p = 0; p < h->n_pages; p++) {
        if (live[p] != ri->live_ep[p]) {
            if (why && whylen)
                snprintf(why, whylen, "page use: page %zu starts or ends %u blocks that keep pages, the count says %u",
                         p, live[p], ri->live_ep[p]);
            rc = GM_ECORRUPT;
            break;
        }
        live_pages += live[p] != 0;
    }
    free(live);
    if (!rc && live_pages != ri->live_pages) {
        if (why && whylen)
            snprintf(why, whylen, "page use: blocks that keep pages touch %zu pages, the counter says %zu", live_pages,
                     ri->live_pages);
        rc = GM_ECORRUPT;
    }
    return rc;
}
