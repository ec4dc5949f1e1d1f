/*
 * pause.c -- pausing and resuming a pool: releasing the pages only its
 * blocks touch (with a host copy if asked) and mapping them back (heap.c,
 * PAUSE).
 *
 * Calls: pool.c, page.c, stream.c (synchronising), capture.c.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "heap_internal.h"

/* ---- pausing a pool ------------------------------------------------------------------------ */

/* The end of the run of list entries that starts at i: consecutive pages with
 * consecutive backup slots, which one device call covers. */
static size_t run_end(const gm_paused_page *l, size_t i, size_t n) {
    size_t j = i + 1;
    while (j < n && l[j].page == l[j - 1].page + 1 && l[j].slot == l[j - 1].slot + 1) j++;
    return j;
}

/* The pages that only blocks of p touch, ascending (*out, malloc'd), and how
 * many pages p's blocks share with other blocks. */
static int pool_own_pages(gm_heap *h, const gm_pool *p, gm_paused_page **out, size_t *n, size_t *shared) {
    size_t top = 0;
    *out = NULL;
    *n = *shared = 0;
    for (const gm_block *b = h->head; b; b = b->next)
        if (b->pool == p) top = h_page_ceil(h, b->addr + b->size);
    if (!top) return GM_OK;
    uint8_t *m = calloc(top, 1);
    gm_paused_page *l = malloc(top * sizeof *l);
    if (!m || !l) {
        free(m);
        free(l);
        return GM_ENOMEM;
    }
    uintptr_t end = h_page_addr(h, top);
    for (const gm_block *b = h->head; b && b->addr < end; b = b->next) {
        if (b->state == GM_BLOCK_UNMAPPED) continue; /* whole pages: never shares one */
        size_t p1 = h_page_ceil(h, b->addr + b->size);
        for (size_t q = h_page_floor(h, b->addr); q < p1 && q < top; q++) m[q] |= b->pool == p ? 1 : 2;
    }
    for (size_t q = 0; q < top; q++) {
        if (m[q] == 1) {
            l[*n] = (gm_paused_page){q, *n};
            (*n)++;
        }
        *shared += m[q] == 3;
    }
    free(m);
    *out = l;
    return GM_OK;
}

/* Keep of the pages list l (ascending, n entries) those whose chunk lies
 * wholly in it: a chunk that also backs other blocks stays, all of it, and
 * its listed pages count as shared.  Slots are renumbered; returns the count. */
static size_t whole_chunks_only(const gm_heap *h, gm_paused_page *l, size_t n, size_t *shared) {
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        size_t q = l[i].page, c = h_chunk_first(h, q), e = h_chunk_end(h, q), len = e - c;
        if (c == q && i + len <= n && l[i + len - 1].page == e - 1) {
            for (size_t t = 0; t < len; t++, k++) l[k] = (gm_paused_page){l[i + t].page, k};
            i += len;
            continue;
        }
        for (; i < n && l[i].page < e; i++) (*shared)++;
    }
    return k;
}

static int pause_refused(gm_heap *h) { return h_capture_on(h, 0) || h_other_capture(h); }

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Copy the n listed pages to pinned host memory, *backup (the device's
 * host_alloc), run by run. */
static int backup_pages(gm_heap *h, const gm_paused_page *l, size_t n, void **backup) {
    const gm_device_ops *ops = h->dev->ops;
    int rc;
    if ((rc = ops->host_alloc(h->dev, n * h->page, backup))) {
        h->st.num_device_errors++;
        return rc;
    }
    for (size_t i = 0, j; i < n && !rc; i = j) {
        j = run_end(l, i, n);
        rc = ops->copy_dtoh(h->dev, (char *)*backup + i * h->page, h_page_addr(h, l[i].page), (j - i) * h->page);
    }
    if (rc) {
        h->st.num_device_errors++;
        ops->host_free(h->dev, *backup);
        *backup = NULL;
        return GM_EDEVICE;
    }
    return GM_OK;
}

/* Unmap the n listed pages run by run (whole chunks, one call a run),
 * releasing each chunk (a single page that will not go is kept as a spare, a
 * larger chunk waits in h->loose).  A failed unmap stops there (*rc
 * GM_EDEVICE): the pages released so far, the list's first ones, are
 * counted. */
static size_t unmap_listed(gm_heap *h, const gm_paused_page *l, size_t n, int *rc) {
    size_t done = 0;
    for (size_t i = 0, j; i < n; i = j) {
        j = run_end(l, i, n);
        uintptr_t a = h_page_addr(h, l[i].page);
        if (h->dev->ops->unmap(h->dev, a, (j - i) * h->page)) {
            h->st.num_device_errors++;
            *rc = GM_EDEVICE;
            break;
        }
        h->st.num_unmaps++; /* calls, as everywhere */
        for (size_t q = l[i].page, end = l[j - 1].page + 1; q < end;) {
            size_t k = h->chunk_len[q];
            gm_handle hd = h->page_handle[q];
            h_chunk_clear(h, q, k);
            h->paused_pages += k;
            q += k;
            h->multi_chunks -= k > 1;
            h_release_chunk(h, hd, k);
        }
        h_hist(h, GM_H_UNMAP, a, (j - i) * h->page, ANY, 0);
        done = j;
    }
    return done;
}

int gm_pool_pause(gm_heap *h, gm_pool_id id, unsigned flags, gm_pause_info *out) {
    gm_pause_info info = {0};
    uint64_t t0 = mono_ns(), t1 = t0, t2 = t0;
    const gm_device_ops *ops = h->dev->ops;
    if (flags & ~(unsigned)GM_PAUSE_BACKUP) return GM_EINVAL;
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK;
    gm_pool *p = h_valid_id(&id) ? h_pool_find(h, &id) : NULL;
    gm_paused_page *l = NULL;
    void *backup = NULL;
    size_t n = 0, shared = 0, done = 0;
    if (!p)
        rc = GM_EINVAL;
    else if (p->paused)
        rc = GM_EPAUSED;
    else if (pause_refused(h))
        rc = GM_ECAPTURING;
    else if ((flags & GM_PAUSE_BACKUP) && (!ops->host_alloc || !ops->host_free || !ops->copy_dtoh || !ops->copy_htod))
        rc = GM_ENOTSUP;
    if (rc) goto out;
    /* Nothing may still be running on the pages, and pending frees complete. */
    if ((rc = h_synchronize(h, ANY)) || (rc = pool_own_pages(h, p, &l, &n, &shared))) goto out;
    n = whole_chunks_only(h, l, n, &shared);
    t1 = t2 = mono_ns();
    if (n && (flags & GM_PAUSE_BACKUP) && (rc = backup_pages(h, l, n, &backup))) goto out;
    t2 = mono_ns();
    done = unmap_listed(h, l, n, &rc);
    if (!done && n) goto out; /* nothing changed */
    p->paused = 1;
    p->paused_list = l;
    p->n_paused = done;
    p->shared_pages = shared;
    p->backup = backup;
    l = NULL;
    backup = NULL;
    info = (gm_pause_info){done, shared, p->backup ? done * h->page : 0, t1 - t0, 0, t2 - t1, mono_ns() - t2};
out:
    if (backup) ops->host_free(h->dev, backup);
    free(l);
    pthread_mutex_unlock(&h->lock);
    if (out) *out = info;
    return rc;
}

/* Unmap the first `n` entries of p's list again (a resume that failed), a
 * whole chunk a call: single pages become spares, larger chunks are
 * released.  A chunk that will not unmap stays mapped and its pages leave
 * the list (their contents are then undefined). */
static void unresume(gm_heap *h, gm_pool *p, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < p->n_paused;) {
        gm_paused_page e = p->paused_list[i];
        if (i >= n) {
            p->paused_list[k++] = e;
            i++;
            continue;
        }
        size_t c = h->chunk_len[e.page]; /* mapped from this entry on: its pages are the next c entries */
        uintptr_t a = h_page_addr(h, e.page);
        int rc = GM_EDEVICE;
        for (int attempt = 0; attempt < 8 && rc; attempt++) rc = h_unmap_chunk(h, e.page, 0);
        if (rc) {
            for (int attempt = 0; attempt < 8; attempt++)
                if (h->dev->ops->set_access(h->dev, a, c * h->page) == GM_OK) break;
            i += c;
            continue;
        }
        h->paused_pages += c;
        for (size_t t = 0; t < c; t++) p->paused_list[k++] = p->paused_list[i + t];
        i += c;
    }
    p->n_paused = k;
}

/* Copy p's backup (if any) back behind its n listed pages, now mapped, and
 * note the maps in the history. */
static int restore_contents(gm_heap *h, const gm_pool *p, size_t n) {
    const gm_paused_page *l = p->paused_list;
    for (size_t i = 0, j; p->backup && i < n; i = j) {
        j = run_end(l, i, n);
        if (h->dev->ops->copy_htod(h->dev, h_page_addr(h, l[i].page), (const char *)p->backup + l[i].slot * h->page,
                                   (j - i) * h->page)) {
            h->st.num_device_errors++;
            return GM_EDEVICE;
        }
    }
    for (size_t i = 0, j; i < n; i = j) {
        j = run_end(l, i, n);
        h_hist(h, GM_H_MAP, h_page_addr(h, l[i].page), (j - i) * h->page, ANY, 0);
    }
    return GM_OK;
}

int gm_pool_resume(gm_heap *h, gm_pool_id id, gm_pause_info *out) {
    gm_pause_info info = {0};
    uint64_t t0 = mono_ns(), t1 = t0, t2 = t0;
    const gm_device_ops *ops = h->dev->ops;
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK, dev_err = GM_OK;
    gm_pool *p = h_valid_id(&id) ? h_pool_find(h, &id) : NULL;
    if (!p || !p->paused)
        rc = GM_EINVAL;
    else if (pause_refused(h))
        rc = GM_ECAPTURING;
    if (rc) goto out;
    size_t n = p->n_paused, mapped = 0, grant = 0, *g = &grant;
    gm_paused_page *l = p->paused_list;
again:
    /* 1. The pages: spares, new ones up to the cap (with chunks: promised,
     * made run by run below), then cached ones taken back. */
    grant = 0;
    n = p->n_paused;
    if (n > h->n_spare) h_grow(h, n - h->n_spare, h->cap_pages, g, &dev_err);
    if (n > h->n_spare + grant && h_cached_pages(h, 0, 0) && h_synchronize(h, ANY) == GM_OK)
        h_recycle(h, n - h->n_spare - grant, 0, 0, 1);
    if (n > h->n_spare + grant) {
        rc = dev_err ? GM_EDEVICE : GM_ENOMEM;
        goto fail;
    }
    t1 = mono_ns();
    /* 2. Map each run at its addresses: spares, then chunks as large as
     * GM_CHUNK_PAGES_MAX allows, whatever chunk_pages says -- a living pool's
     * pages never move, so chunks cost nothing until the pool ends -- and
     * grant access once per run. */
    for (size_t i = 0, j; i < n; i = j) {
        j = run_end(l, i, n);
        size_t p0 = l[i].page, p1 = l[j - 1].page + 1, got;
        int err = GM_OK;
        got = h_map_fresh(h, p0, p1, GM_CHUNK_PAGES_MAX, g, &err) - p0;
        h->paused_pages -= got;
        mapped = i + got;
        if (got < p1 - p0 && err == GM_ENOMEM && g) {
            /* The device is nearly full: start over with single pages. */
            unresume(h, p, mapped);
            mapped = 0;
            g = NULL;
            goto again;
        }
        if (got < p1 - p0) {
            rc = err == GM_ENOMEM ? GM_ENOMEM : GM_EDEVICE;
            goto fail;
        }
        if (ops->set_access(h->dev, h_page_addr(h, l[i].page), (j - i) * h->page)) {
            h->st.num_device_errors++;
            rc = GM_EDEVICE;
            goto fail;
        }
    }
    t2 = mono_ns();
    /* 3. The contents. */
    if ((rc = restore_contents(h, p, n))) goto fail;
    info = (gm_pause_info){n, p->shared_pages, p->backup ? n * h->page : 0, 0, t1 - t0, 0, t2 - t1};
    if (p->backup && ops->host_free(h->dev, p->backup)) h->st.num_device_errors++;
    info.copy_ns = mono_ns() - t2;
    free(p->paused_list);
    p->paused_list = NULL;
    p->backup = NULL;
    p->n_paused = p->shared_pages = 0;
    p->paused = 0;
    goto out;
fail:
    /* Back to fully paused; the pages gathered go back to the device. */
    unresume(h, p, mapped);
    h_release_spares(h, h->mapped_pages);
out:
    pthread_mutex_unlock(&h->lock);
    if (out) *out = info;
    return rc;
}
