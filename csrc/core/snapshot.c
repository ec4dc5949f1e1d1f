/*
 * snapshot.c -- a consistent copy of the heap's layout, taken under the lock,
 * for pictures, torch-format snapshots and explanations made elsewhere.
 */
#include <stdlib.h>
#include <string.h>

#include "heap_internal.h"

int gm_snapshot_take(gm_heap *h, gm_snapshot **out) {
    *out = NULL;
    gm_snapshot *s = calloc(1, sizeof *s);
    if (!s) return GM_ENOMEM;
    pthread_mutex_lock(&h->lock);
    /* The trailing unmapped block is address space never used: leave it out. */
    const gm_block *end = h->head;
    size_t n = 0;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (b->next || b->state != GM_BLOCK_UNMAPPED) {
            n++;
            end = b->next;
        } else {
            end = b;
        }
    }
    s->va_base = h->base;
    s->va_size = h->va_size;
    s->page_size = h->page;
    s->top = end ? end->addr - h->base : h->va_size;
    s->n_blocks = n;
    s->n_pages = (s->top + h->page - 1) / h->page;
    s->spare_pages = h->n_spare;
    s->cap_bytes = h->cap_pages * h->page;
    s->stats = h->st;
    s->blocks = calloc(n ? n : 1, sizeof *s->blocks);
    s->pages = calloc(s->n_pages ? s->n_pages : 1, 1);
    s->growth = calloc(s->n_pages ? s->n_pages : 1, sizeof *s->growth);
    s->host = calloc(s->n_pages ? s->n_pages : 1, 1);
    if (!s->blocks || !s->pages || !s->growth || !s->host) {
        pthread_mutex_unlock(&h->lock);
        gm_snapshot_free(s);
        return GM_ENOMEM;
    }
    for (size_t p = 0; p < s->n_pages; p++) s->pages[p] = h->page_handle[p] ? GM_PAGE_CACHED : GM_PAGE_UNMAPPED;
    memcpy(s->growth, h->page_growth, s->n_pages * sizeof *s->growth);
    memcpy(s->host, h->host, s->n_pages);
    size_t i = 0;
    for (const gm_block *b = h->head; b != end; b = b->next, i++) {
        s->blocks[i] =
            (gm_block_info){b->addr,      b->size,
                            b->requested, b->state == GM_BLOCK_FREE ? h_free_owner(h, b) : b->stream,
                            b->context,   b->state == GM_BLOCK_LIVE || b->state == GM_BLOCK_PENDING ? b->seq : 0,
                            b->state,     b->pool ? b->pool->id : (gm_pool_id){0, 0}};
        /* Pages kept for a living pool are in use too: empty_cache leaves them. */
        if (b->state == GM_BLOCK_LIVE || b->state == GM_BLOCK_PENDING || (b->state == GM_BLOCK_FREE && h_pinned(b)))
            for (size_t p = h_page_floor(h, b->addr); p < h_page_ceil(h, b->addr + b->size); p++)
                s->pages[p] = GM_PAGE_USED;
    }
    /* A paused pool's released pages keep its blocks but no memory. */
    for (size_t i = 0; i < h->n_pools; i++)
        for (size_t k = 0; k < h->pools[i]->n_paused; k++)
            if (h->pools[i]->paused_list[k].page < s->n_pages)
                s->pages[h->pools[i]->paused_list[k].page] = GM_PAGE_PAUSED;
    pthread_mutex_unlock(&h->lock);
    *out = s;
    return GM_OK;
}

void gm_snapshot_free(gm_snapshot *s) {
    if (!s) return;
    free(s->blocks);
    free(s->pages);
    free(s->growth);
    free(s->host);
    free(s);
}
