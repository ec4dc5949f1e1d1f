/*
 * pool.c -- private pools: their records, retain and release, the end of
 * a pool (its free blocks turn general), their figures, and set_live's
 * checkpoint restore (heap.c, POOLS).
 *
 * Calls: block.c, stream.c, heap.c (making a block live, freeing one).
 */
#include <stdlib.h>
#include <string.h>

#include "gpumem/array.h"
#include "heap_internal.h"

/* ---- private pools ----------------------------------------------------------------------- */

/* The living pool named id, or NULL. */
gm_pool *h_pool_find(const gm_heap *h, const gm_pool_id *id) {
    for (size_t i = 0; i < h->n_pools; i++) {
        gm_pool *p = h->pools[i];
        if (p->use_count > 0 && p->id.first == id->first && p->id.second == id->second) return p;
    }
    return NULL;
}

void h_pool_delete(gm_heap *h, gm_pool *p) {
    h_assert(p->use_count == 0 && !p->live_blocks && !p->free_blocks && !p->any);
    for (size_t i = 0; i < h->n_pools; i++) {
        if (h->pools[i] != p) continue;
        h->pools[i] = h->pools[--h->n_pools];
        break;
    }
    free(p);
}

int h_valid_id(const gm_pool_id *id) { return id->first || id->second; }

int gm_pool_retain(gm_heap *h, gm_pool_id id) {
    if (!h_valid_id(&id)) return GM_EINVAL;
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK;
    gm_pool *p = h_pool_find(h, &id);
    if (p) {
        p->use_count++;
        goto done;
    }
    if (h->n_pools == h->cap_pools) {
        gm_pool **a = gm_array_grow(h->pools, &h->cap_pools, 8, sizeof *a);
        if (!a) {
            rc = GM_ENOMEM;
            goto done;
        }
        h->pools = a;
    }
    if (!(p = calloc(1, sizeof *p))) {
        rc = GM_ENOMEM;
        goto done;
    }
    p->id = id;
    p->use_count = 1;
    if (!(p->any = h_owner_get(h, p, ANY))) {
        free(p);
        rc = GM_ENOMEM;
        goto done;
    }
    h->pools[h->n_pools++] = p;
done:
    pthread_mutex_unlock(&h->lock);
    return rc;
}

int gm_pool_set_no_split(gm_heap *h, gm_pool_id id, int no_split) {
    pthread_mutex_lock(&h->lock);
    gm_pool *p = h_valid_id(&id) ? h_pool_find(h, &id) : NULL;
    if (p) p->no_split = no_split != 0;
    pthread_mutex_unlock(&h->lock);
    return p ? GM_OK : GM_EINVAL;
}

struct to_general_ctx {
    gm_heap *h;
    gm_owner *from;
};

/* A free block of an ending pool joins the general heap, same owner: it stops
 * keeping its pages and joins the runs of general space beside it. */
static int to_general(gm_block *b, void *arg) {
    struct to_general_ctx *c = arg;
    gm_heap *h = c->h;
    h_index_remove(h, b);
    h_pages_use(h, b, -1);
    if (b->prev) h_run_detach(h, b->prev);
    if (b->next) h_run_detach(h, b->next);
    b->pool = NULL;
    h_index_insert(h, b);
    h_run_attach(h, b);
    return 0;
}

/* The pool's last use is gone: its free blocks join the general heap now (and
 * merge with their neighbours), its owners go, and the record stays only while
 * blocks of it are live or pending. */
static void pool_end(gm_heap *h, gm_pool *p) {
    if (h->lazy_stream != ANY) h_settle_release(h); /* owners change below: settle who owns what first */
    p->use_count = 0;
    /* Its pending blocks will complete into the general heap. */
    for (gm_block *b = h->head; b; b = b->next)
        if (b->pool == p && b->state == GM_BLOCK_PENDING) h_pages_use(h, b, -1);
    for (size_t i = 0; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (o->pool != p) continue;
        if (o->releasing) {
            h_event_put(h, o->release_event);
            o->releasing = 0;
        }
        /* What was proven done on this stream stays proven: the general
         * owner of the stream inherits the proof with the blocks. */
        gm_owner *g = o->stream == ANY ? NULL : h_owner_get(h, NULL, o->stream);
        if (g && g->safe_seq < o->safe_seq) g->safe_seq = o->safe_seq;
        /* A release in flight on g then covers at least what is proven. */
        if (g && g->releasing && g->release_seq < g->safe_seq) g->release_seq = g->safe_seq;
        struct to_general_ctx c = {h, o};
        fi_each(&o->idx, to_general, &c);
    }
    size_t k = 0;
    for (size_t i = 0; i < h->n_owners; i++) {
        if (h->owners[i]->pool == p)
            free(h->owners[i]);
        else
            h->owners[k++] = h->owners[i];
    }
    h->n_owners = k;
    h_owners_removed(h);
    p->any = NULL;
    h_coalesce_all(h);
    if (!p->live_blocks) h_pool_delete(h, p);
}

int gm_pool_release(gm_heap *h, gm_pool_id id) {
    pthread_mutex_lock(&h->lock);
    gm_pool *p = h_valid_id(&id) ? h_pool_find(h, &id) : NULL;
    /* A paused pool cannot end: its blocks' pages are gone, and ending would
     * hand its free memory to the general heap.  Resume it first.  Other uses
     * (a use_mem_pool around a refused allocation) come and go. */
    int rc = !p ? GM_EINVAL : (p->paused && p->use_count == 1) ? GM_EPAUSED : GM_OK;
    if (!rc && --p->use_count == 0) pool_end(h, p);
    pthread_mutex_unlock(&h->lock);
    return rc;
}

/* Pages any block of p touches, each counted once. */
static size_t pool_pages(gm_heap *h, const gm_pool *p) {
    size_t n = 0, last = SIZE_MAX;
    for (gm_block *b = h->head; b; b = b->next) {
        if (b->pool != p) continue;
        size_t p0 = h_page_floor(h, b->addr), p1 = h_page_ceil(h, b->addr + b->size);
        if (last != SIZE_MAX && p0 <= last) p0 = last + 1;
        if (p1 > p0) n += p1 - p0;
        if (p1 > 0) last = p1 - 1;
    }
    return n;
}

static void pool_fill(gm_heap *h, const gm_pool *p, gm_pool_info *out) {
    memset(out, 0, sizeof *out);
    out->id = p->id;
    out->use_count = p->use_count;
    out->live_blocks = p->live_blocks;
    out->live_bytes = p->live_bytes;
    out->free_blocks = p->free_blocks;
    out->free_bytes = p->free_bytes;
    out->pinned_pages = pool_pages(h, p);
    out->paused = p->paused;
    out->paused_pages = p->n_paused;
    out->shared_pages = p->shared_pages;
    out->backup_bytes = p->backup ? p->n_paused * h->page : 0;
}

int gm_pool_info_get(gm_heap *h, gm_pool_id id, gm_pool_info *out) {
    pthread_mutex_lock(&h->lock);
    gm_pool *p = h_valid_id(&id) ? h_pool_find(h, &id) : NULL;
    if (p) pool_fill(h, p, out);
    pthread_mutex_unlock(&h->lock);
    return p ? GM_OK : GM_EINVAL;
}

size_t gm_pool_list(gm_heap *h, gm_pool_info *out, size_t cap) {
    pthread_mutex_lock(&h->lock);
    size_t n = 0;
    for (size_t i = 0; i < h->n_pools; i++) {
        if (h->pools[i]->use_count <= 0) continue;
        if (n < cap) pool_fill(h, h->pools[i], &out[n]);
        n++;
    }
    pthread_mutex_unlock(&h->lock);
    return n;
}

size_t gm_pool_live(gm_heap *h, gm_pool_id id, uintptr_t *addrs, size_t *sizes, size_t cap) {
    pthread_mutex_lock(&h->lock);
    size_t n = 0;
    gm_pool *p = h_valid_id(&id) ? h_pool_find(h, &id) : NULL;
    for (gm_block *b = p ? h->head : NULL; b; b = b->next) {
        if (b->pool != p || b->state != GM_BLOCK_LIVE) continue;
        if (n < cap) {
            if (addrs) addrs[n] = b->addr;
            if (sizes) sizes[n] = b->size;
        }
        n++;
    }
    pthread_mutex_unlock(&h->lock);
    return n;
}

typedef struct listed {
    uintptr_t addr;
    size_t size;
} listed;

static int cmp_listed(const void *x, const void *y) {
    uintptr_t u = ((const listed *)x)->addr, v = ((const listed *)y)->addr;
    return u < v ? -1 : u > v;
}

/* The block that holds address a (a inside the reserved range). */
static gm_block *block_at(gm_heap *h, uintptr_t a) {
    gm_block *b = h->head;
    while (b && b->addr + b->size <= a) b = b->next;
    return b;
}

/* Free memory of p for the listed range [a, a+size) once the live blocks of p
 * marked for freeing are free: every block under it is a free block of p or
 * a live one of p that is to be freed and has no other stream's use. */
static int range_in_pool(gm_heap *h, const gm_pool *p, uintptr_t a, size_t size) {
    uintptr_t end = a + size;
    for (gm_block *b = block_at(h, a); b && b->addr < end; b = b->next) {
        if (b->pool != p) return 0;
        if (b->state == GM_BLOCK_FREE) continue;
        if (b->state == GM_BLOCK_LIVE && b->mark == 2 && !b->n_uses) continue;
        return 0;
    }
    return 1;
}

/* The list (sorted by address) is disjoint, inside the range, 512-aligned. */
static int listed_valid(const gm_heap *h, const listed *l, size_t n) {
    for (size_t k = 0; k < n; k++) {
        uintptr_t a = l[k].addr;
        size_t sz = l[k].size;
        if (!sz || a % GM_ALIGN || sz % GM_ALIGN || a < h->base || sz > h->va_size || a - h->base > h->va_size - sz)
            return 0;
        if (k && l[k - 1].addr + l[k - 1].size > a) return 0;
    }
    return 1;
}

/* Free the live blocks marked to free (2), into their pool. */
static void free_marked(gm_heap *h) {
    for (gm_block *b = h->head, *next; b; b = next) {
        next = b->next;
        if (b->mark != 2) continue;
        b->mark = 0;
        /* Freeing merges b with its free neighbours: go on after the result. */
        gm_block *prev = b->prev;
        h_live_remove(h, b->addr);
        h_free_block(h, b);
        next = prev ? prev->next : h->head;
    }
}

/* Make [a, a+sz), free memory of pool p (range_in_pool), one live block of
 * p for `stream`; what lies outside the range keeps its owner. */
static void carve_listed(gm_heap *h, gm_pool *p, uintptr_t a, size_t sz, gm_stream stream) {
    gm_block *b = block_at(h, a);
    h_index_remove(h, b);
    if (b->addr < a) {
        gm_block *r = h_split(h, b, a - b->addr);
        h_index_insert(h, b);
        b = r;
    }
    gm_stream last = b->stream;
    uint64_t last_seq = b->seq, last_epoch = b->epoch;
    while (b->addr + b->size < a + sz) {
        gm_block *nx = b->next;
        h_index_remove(h, nx);
        last = nx->stream;
        last_seq = nx->seq;
        last_epoch = nx->epoch;
        h_absorb(h, b, nx);
    }
    if (b->addr + b->size > a + sz) {
        gm_block *r = h_split(h, b, sz);
        r->stream = last;
        r->seq = last_seq;
        r->epoch = last_epoch;
        h_index_insert(h, r);
    }
    h_make_live(h, b, sz, sz, stream, 0, p);
}

int gm_pool_set_live(gm_heap *h, gm_pool_id id, const uintptr_t *addrs, const size_t *sizes, size_t n,
                     gm_stream stream) {
    if (stream == ANY || (n && (!addrs || !sizes))) return GM_EINVAL;
    listed *l = malloc((n ? n : 1) * sizeof *l);
    if (!l) return GM_ENOMEM;
    for (size_t i = 0; i < n; i++) l[i] = (listed){addrs[i], sizes[i]};
    qsort(l, n, sizeof *l, cmp_listed);
    pthread_mutex_lock(&h->lock);
    int rc = GM_EINVAL;
    gm_pool *p = h_valid_id(&id) ? h_pool_find(h, &id) : NULL;
    if (!p) goto out;
    if (p->paused) {
        rc = GM_EPAUSED;
        goto out;
    }
    if (h->lazy_stream != ANY) h_settle_release(h); /* blocks change owners below */
    /* 1. Validate, changing nothing: the list is disjoint, inside the range,
     * 512-aligned; the pool's live blocks are marked kept (1) or to free (2);
     * every other listed range lies in free memory of the pool once the blocks
     * to free are free. */
    if (!listed_valid(h, l, n)) goto out;
    for (gm_block *b = h->head; b; b = b->next) b->mark = (b->pool == p && b->state == GM_BLOCK_LIVE) ? 2 : 0;
    size_t to_alloc = 0;
    for (size_t k = 0; k < n; k++) {
        gm_block *b = h_live_find(h, l[k].addr);
        if (b && b->pool == p && b->size == l[k].size)
            b->mark = 1;
        else
            to_alloc++;
    }
    for (size_t k = 0; k < n; k++) {
        gm_block *b = h_live_find(h, l[k].addr);
        if (b && b->mark == 1 && b->size == l[k].size) continue;
        if (!range_in_pool(h, p, l[k].addr, l[k].size)) goto out;
    }
    rc = GM_ENOMEM;
    if (h_slab_reserve(h, 2 * to_alloc + 4) || !h_owner_get(h, NULL, stream) || !h_owner_get(h, p, stream)) goto out;
    while (h->n_live + to_alloc >= h->live_mask)
        if (h_live_grow(h)) goto out;
    /* 2. Free the pool's live blocks that are not listed (into the pool). */
    h->no_sync = h->capture_count > 0;
    free_marked(h);
    /* 3. Allocate the listed blocks that are not live out of the pool's free
     * blocks: those under each range become one for `stream` (the caller
     * orders their earlier uses before it, as torch does); what lies outside
     * the range keeps its owner. */
    for (size_t k = 0; k < n; k++) {
        gm_block *b = h_live_find(h, l[k].addr);
        if (!(b && b->mark == 1)) carve_listed(h, p, l[k].addr, l[k].size, stream);
    }
    h_coalesce_all(h); /* what the new owners let merge */
    rc = GM_OK;
out:
    h->no_sync = 0;
    for (gm_block *b = h->head; b; b = b->next) b->mark = 0;
    pthread_mutex_unlock(&h->lock);
    free(l);
    return rc;
}
