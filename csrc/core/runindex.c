/* runindex.c -- see runindex.h for the structures and their invariants. */
#include "runindex.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "block.h"

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
    h_assert(b->run_len > 0);
    unsigned sl, fl = ri_fl_sl(b->run_len, &sl);
    gm_block **slot = &ri->bins[fl][sl];
    b->rprev = NULL;
    b->rnext = *slot;
    if (*slot) (*slot)->rprev = b;
    *slot = b;
    fi_bin_filled(&ri->fl_bitmap, ri->sl_bitmap, fl, sl);
    ri->count++;
    ri->bytes += b->run_len;
}

void ri_remove(gm_runindex *ri, gm_block *b) {
    unsigned sl, fl = ri_fl_sl(b->run_len, &sl);
    h_assert(ri->count > 0 && (b->rprev ? b->rprev->rnext == b : ri->bins[fl][sl] == b));
    if (b->rprev)
        b->rprev->rnext = b->rnext;
    else
        ri->bins[fl][sl] = b->rnext;
    if (b->rnext) b->rnext->rprev = b->rprev;
    b->rprev = b->rnext = NULL;
    if (!ri->bins[fl][sl]) fi_bin_emptied(&ri->fl_bitmap, ri->sl_bitmap, fl, sl);
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

void ri_index(gm_runindex *ri, gm_block *head, size_t len) {
    head->run_len = len;
    ri_insert(ri, head);
}

void ri_unindex(gm_runindex *ri, gm_block *head) {
    ri_remove(ri, head);
    head->run_len = 0;
}

/* ---- the checker's part ---- */

static int bad(char *why, size_t len, const char *msg, const gm_block *b) {
    if (why && len) snprintf(why, len, "run index: %s (block %#lx)", msg, b ? (unsigned long)b->addr : 0ul);
    return GM_ECORRUPT;
}

int ri_check(const gm_runindex *ri, char *why, size_t whylen) {
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
                if (!b->run_len) return bad(why, whylen, "a bin holds a block that heads no indexed run", b);
                if (ri_bin(b->run_len) != fl * FI_SL + sl) return bad(why, whylen, "a run sits in the wrong bin", b);
                listed++;
                listed_bytes += b->run_len;
            }
        }
    }
    if (listed != ri->count || listed_bytes != ri->bytes) {
        if (why && whylen)
            snprintf(why, whylen, "run index: the bins hold %zu runs / %zu bytes, the counters say %zu / %zu", listed,
                     listed_bytes, ri->count, ri->bytes);
        return GM_ECORRUPT;
    }
    return GM_OK;
}

int ri_check_pages(const gm_runindex *ri, const uint32_t *ep, size_t n_pages, size_t pages, char *why, size_t whylen) {
    for (size_t p = 0; p < n_pages; p++) {
        if (ep[p] != ri->live_ep[p]) {
            if (why && whylen)
                snprintf(why, whylen, "page use: page %zu starts or ends %u blocks that keep pages, the count says %u",
                         p, ep[p], ri->live_ep[p]);
            return GM_ECORRUPT;
        }
    }
    if (pages != ri->live_pages) {
        if (why && whylen)
            snprintf(why, whylen, "page use: blocks that keep pages touch %zu pages, the counter says %zu", pages,
                     ri->live_pages);
        return GM_ECORRUPT;
    }
    return GM_OK;
}
