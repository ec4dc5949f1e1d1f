/*
 * block.h -- the block record: one range of the reserved address space, in
 * one of four states (heap.c, THE PICTURE).  The free index (freeindex.h) and
 * the run index (runindex.h) link blocks through the fields named for them
 * and see nothing else of the heap; the heap's structures are in
 * heap_internal.h.
 */
#ifndef GPUMEM_BLOCK_H
#define GPUMEM_BLOCK_H

#include <stdint.h>

#include "debug.h"
#include "gpumem/gpumem.h"

typedef struct gm_block gm_block;
typedef struct gm_pool gm_pool;

struct gm_block {
    uintptr_t addr;
    size_t size;
    gm_block *prev, *next;   /* address-order neighbours; together they tile the range */
    gm_block *lprev, *lnext; /* bin list (free), pending list (pending) or slab free list */
    gm_block *hnext;         /* live-table chain (live) */
    /* live/pending: the bytes asked for.  free: those of the request freed into
     * it last (0: none since mapped), as torch reports an inactive block's. */
    size_t requested;
    /* live/pending: the allocation stream.  free: the owner, the stream that may
     * reuse it at once (GM_STREAM_ANY: every stream). */
    gm_stream stream;
    uint64_t context;
    /* live/pending: allocation number.  free: the free-sequence number of the
     * latest free merged into it (owner releases compare against it). */
    uint64_t seq;
    /* free: the stream whose free gave `seq` (the newest free merged in).  The
     * checker holds a block that every stream may reuse to the proof for that
     * free (gm_owner.safe_seq). */
    gm_stream origin;
    /* free, owned by a stream: the heap's epoch when it last became that
     * stream's (see h_free_owner). */
    uint64_t epoch;
    uint8_t state;     /* gm_block_state */
    uint8_t wait_sync; /* pending, but an event could not be recorded: wait for a device sync */
    uint8_t deferred;  /* pending, freed during a capture: its events are not recorded yet */
    uint8_t mark;      /* scratch for one operation under the lock (pool_set_live, owner releases); 0 between them */
    uint8_t small;     /* free, indexed: it lies in a small page (small.c), its index's small side */
    gm_pool *pool;     /* the private pool it belongs to, NULL: the general heap */
    uint32_t n_uses, cap_uses;
    gm_stream *uses;         /* streams named by record_stream */
    gm_event *events;        /* pending: one event per use, recorded at free */
    size_t run_len;          /* head of a run of general space: the run's length (runindex.h); else 0 */
    gm_block *rprev, *rnext; /* head of a run: its bin in the run index */
};

#endif
