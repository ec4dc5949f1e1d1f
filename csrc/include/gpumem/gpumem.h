/*
 * gpumem.h -- the allocator core's public interface.
 *
 * One gm_heap per device.  Every function is thread-safe (one lock per heap).
 * The design is drawn at the top of core/heap.c.
 */
#ifndef GPUMEM_GPUMEM_H
#define GPUMEM_GPUMEM_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem/device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- error codes ---------------------------------------------------------
 * The one list of them: X(name, value, sentence).  gm_strerror and the Python
 * module (which exports the names as gpumem._C.ERROR_NAMES) expand it. */
#define GM_EACH_ERROR(X)                                                                                               \
    X(GM_OK, 0, "success")                                                                                             \
    /* no room even after releasing the cache and defragmenting */                                                     \
    X(GM_ENOMEM, 1, "out of memory")                                                                                   \
    /* bad argument (size too large, bad cap, ...) */                                                                  \
    X(GM_EINVAL, 2, "invalid argument")                                                                                \
    /* pointer was never handed out by this heap */                                                                    \
    X(GM_EUNKNOWN_PTR, 3, "pointer was not allocated by this heap")                                                    \
    /* pointer lies in this heap but is not live: freed twice, or not the start of an allocation */                    \
    X(GM_EDOUBLE_FREE, 4, "pointer is not a live allocation (double free, or not the start of a block)")               \
    /* a device call failed; dev->last_error says why */                                                               \
    X(GM_EDEVICE, 5, "a device call failed")                                                                           \
    /* an event has not completed yet (device level) */                                                                \
    X(GM_ENOTREADY, 6, "event not complete")                                                                           \
    /* the device cannot do this (no NVML, ...) */                                                                     \
    X(GM_ENOTSUP, 7, "not supported by this device")                                                                   \
    /* libcuda could not be loaded */                                                                                  \
    X(GM_ENODRIVER, 8, "CUDA driver library could not be loaded")                                                      \
    /* the invariant checker found a broken invariant */                                                               \
    X(GM_ECORRUPT, 9, "heap invariant broken")                                                                         \
    /* the pool's physical memory is paused (gm_pool_pause): resume it first */                                        \
    X(GM_EPAUSED, 10, "the pool is paused (resume it first)")                                                          \
    /* the call may not run while a CUDA graph is being captured */                                                    \
    X(GM_ECAPTURING, 11, "not allowed while a CUDA graph is being captured")

enum {
#define GM_ERROR_ENUM(name, value, text) name = value,
    GM_EACH_ERROR(GM_ERROR_ENUM)
#undef GM_ERROR_ENUM
};
const char *gm_strerror(int code);
/* Write a reason into err (when err and errlen are not 0) and return rc: for
 * calls that answer a code and say why in a caller's buffer. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
int gm_errorf(int rc, char *err, size_t errlen, const char *fmt, ...);

#define GM_ALIGN      512u       /* every block starts and ends on 512 B */
#define GM_SMALL_SIZE (1u << 20) /* torch's small pool: blocks <= 1 MiB */
#define GM_STREAM_ANY UINT64_MAX /* owner of free memory any stream may use */

/* The largest page a heap takes: its page tables index at least 64 pages, and
 * 64 pages of 4 TiB fill the 256 TiB a GPU can address.  A page must also be
 * no larger than the device's memory. */
#define GM_PAGE_SIZE_MAX ((size_t)1 << 42)

/* ---- configuration ------------------------------------------------------- */
/* gm_config.chunk_pages: the default, and the most allowed. */
#define GM_CHUNK_PAGES_DEFAULT 1
#define GM_CHUNK_PAGES_MAX     1024
/* gm_config.pressure's default: see heap.c, POLICY. */
#define GM_PRESSURE_DEFAULT    0.875
/* The most gm_config.growth_slack and gm_config.va_size (the 256 TiB of
 * address space a GPU has) may be. */
#define GM_GROWTH_SLACK_MAX    100.0
#define GM_VA_SIZE_MAX         ((size_t)1 << 48)

typedef struct gm_config {
    /* Virtual address space to reserve; 0 picks 4 x the device's total memory. */
    size_t va_size;
    /* Most physical memory the heap may hold; 0 means the whole device. */
    size_t cap_bytes;
    /* How far reserved memory may grow above the peak of live memory before the
     * heap recycles fully free pages instead of creating new ones: a fraction
     * of peak live, plus `growth_slack_pages` pages. */
    double growth_slack;
    size_t growth_slack_pages;
    /* The most pages one physical allocation holds, in [1, GM_CHUNK_PAGES_MAX]
     * (1: every page its own allocation).  Growth maps the new pages of a request with
     * as few allocations as this allows; see README.md. */
    size_t chunk_pages;
    /* Where pressure starts, as a fraction of the heap's limit: the cap, or
     * what the heap holds plus what the device reports free (other processes
     * included), whichever is less.  Below it the heap has room: growth takes
     * new pages past the growth limit, freed pages stay cached, and nothing is
     * recycled or defragmented.  Above it the heap is tight: the growth limit,
     * then recycling and defragmentation.  0 keeps it tight always; in [0, 1]. */
    double pressure;
    /* Spill: bytes of host memory the heap may map behind its addresses when
     * the device has no room left for a request (0, the default: off); see
     * gm_unspill.  spill_choice says what goes to the host: GM_SPILL_OLD (the
     * default) the pages of the oldest live blocks, GM_SPILL_NEW the request,
     * GM_SPILL_LASTING the pages of the blocks live at the last low point of
     * live memory (a loop's lasting state), the most recently made first. */
    size_t spill;
    size_t spill_choice;
    /* 1 (the default): under pressure, before waiting for the whole device, an
     * allocation may take memory other streams freed while their work still
     * runs, its stream made to wait for that work on the device (stream.c,
     * HAND-OFF).  0: it waits for the device as before. */
    size_t stream_handoff;
    /* 1: under pressure, when defragmentation still lacks pages, a physical
     * allocation of several pages that live blocks still use may be split:
     * the pages they use are copied to single pages behind the same addresses,
     * after a device wait, and the allocation goes back with its free pages
     * (core/split.c).  It moves live data, so a kernel another thread launches
     * on it while the allocation runs would lose its writes or fault: for a
     * process whose only thread using the device is the allocating one.  0
     * (the default): such free pages stay locked. */
    size_t split_chunks;
} gm_config;
enum {
    GM_SPILL_OLD = 0,
    GM_SPILL_NEW = 1,
    GM_SPILL_LASTING = 2
};
/* Every field its default. */
void gm_config_default(gm_config *cfg);
/* Check every option's range (core/config.c; gpumem/config.h checks them one
 * by one): GM_OK, or GM_EINVAL with the first bad option's message in err. */
int gm_config_check(const gm_config *cfg, char *err, size_t errlen);

typedef struct gm_heap gm_heap;

/* Create a heap over `dev`.  The heap owns dev from then on, also on failure. */
int gm_heap_create(gm_device *dev, const gm_config *cfg, gm_heap **out);
/* Why the calling thread's last failed gm_heap_create failed, in words
 * (the device's own reason where it gave one). */
const char *gm_create_error(void);
/* Return every page and reservation to the device and free the heap.  Live
 * blocks are dropped: call it when no tensor is left. */
void gm_heap_destroy(gm_heap *heap);
gm_device *gm_heap_device(gm_heap *heap);

/* ---- fork() ----------------------------------------------------------------
 * fork() waits until every heap is between operations and the child gets
 * every heap's lock released (core/fork.c).  Code that holds locks of its own
 * around calls into the core hands them here, so that fork holds them too:
 * lock() is called in the fork's prepare step before any heap lock is taken
 * (such locks are taken before heap locks in normal code), unlock() in the
 * parent and in the child after the heaps' locks are released.  Neither may
 * wait for anything a thread may hold while it waits for fork (the Python
 * GIL, say).  Call it before any thread can hold those locks (at load time);
 * at most GM_FORK_MAX_ALSO pairs, each counted once.  GM_OK or GM_EINVAL. */
#define GM_FORK_MAX_ALSO 4
int gm_fork_also(void (*lock)(void), void (*unlock)(void));

/* ---- allocation ---------------------------------------------------------- */

/* Allocate `size` bytes (rounded up to 512) for use on `stream`.  `context` is
 * an opaque allocation-site id kept with the block and in the history (0 if
 * none).  Never returns a NULL pointer with GM_OK. */
int gm_malloc(gm_heap *heap, size_t size, gm_stream stream, uint64_t context, uintptr_t *out);
/* Free a pointer returned by gm_malloc.  Reusable at once on the allocation's
 * stream; on any other stream only once the work queued before the free has
 * finished, and after the streams named with gm_record_stream have finished. */
int gm_free(gm_heap *heap, uintptr_t ptr);
/* Mark a live block as used on `stream` (torch's Tensor.record_stream). */
int gm_record_stream(gm_heap *heap, uintptr_t ptr, gm_stream stream);
/* Size of the live block at ptr (0 if ptr is not live). */
size_t gm_block_size(gm_heap *heap, uintptr_t ptr);

/* Unmap and release every physical page that backs no live block. */
int gm_empty_cache(gm_heap *heap);
/* Cap physical memory (0 = no cap but the device).  Lowering the cap below what
 * is held releases free pages at once. */
int gm_set_cap(gm_heap *heap, size_t cap_bytes);
size_t gm_get_cap(gm_heap *heap);

/* ---- spill ------------------------------------------------------------------
 * With gm_config.spill, a request that the device cannot serve even after the
 * cache is released and the heap defragmented is served with host-located
 * pages mapped behind the heap's own addresses (the device's create_host):
 * either the request itself (GM_SPILL_NEW) or the pages of the oldest live
 * blocks, moved to the host behind the same addresses (GM_SPILL_OLD), up to
 * gm_config.spill bytes; past that, out of memory as before.  Never during a
 * capture, and never the pages of a living private pool.  Host pages hold
 * only what is live or pending on them: the rest is unmapped at once.
 * gm_unspill moves every live host page back to device pages behind the same
 * addresses (a device wait, then a copy per chunk); empty_cache calls it, and
 * so does gm_free when the device has room for all of them.  GM_OK when
 * nothing is left on the host; GM_ENOMEM when the device had no room for some
 * (they stay, intact); GM_ECAPTURING during a capture; GM_EDEVICE when a
 * device call failed (what was not moved stays on the host, intact). */
int gm_unspill(gm_heap *heap);

/* ---- statistics (torch's key names; core/stats.c explains the mapping) --- */
typedef struct gm_stat {
    int64_t current, peak, allocated, freed;
} gm_stat;
enum {
    GM_POOL_ALL = 0,
    GM_POOL_SMALL = 1,
    GM_POOL_LARGE = 2,
    GM_POOL__COUNT = 3
};

/* The one list of statistics.  Pooled ones are torch Stats per pool, named
 * "<name>.<all|small_pool|large_pool>.<current|peak|allocated|freed>"; counters
 * are plain integers under their own name.  stats.c, the checker and the Python
 * module (gpumem._C.POOLED_STAT_NAMES / COUNTER_NAMES) expand these lists. */
#define GM_EACH_POOLED_STAT(X)                                                                                         \
    X(allocation)     /* live blocks */                                                                                \
    X(segment)        /* physical pages held */                                                                        \
    X(active)         /* live + freed-but-pending blocks */                                                            \
    X(inactive_split) /* free blocks in mapped memory */                                                               \
    X(allocated_bytes)                                                                                                 \
    X(reserved_bytes)                                                                                                  \
    X(active_bytes)                                                                                                    \
    X(inactive_split_bytes)                                                                                            \
    X(requested_bytes)                                                                                                 \
    X(spilled_bytes) /* host-located pages mapped behind the heap's addresses (spill) */
#define GM_EACH_COUNTER(X)                                                                                             \
    X(num_alloc_retries)    /* torch's: allocations that met the cap or the device, released cached memory, retried */ \
    X(num_ooms)             /* allocations that failed (torch's path counts each exception once) */                    \
    X(num_slow_allocs)      /* allocations no free block served: they took the slow path */                            \
    X(num_sync_all_streams) /* device synchronisations before unmapping */                                             \
    X(num_device_alloc)     /* physical pages created */                                                               \
    X(num_device_free)      /* physical pages released */                                                              \
    X(num_maps)             /* page map calls */                                                                       \
    X(num_unmaps)           /* page unmap calls */                                                                     \
    X(num_remaps)           /* defragmentations: pages moved behind a new address */                                   \
    X(num_pages_remapped)                                                                                              \
    X(num_device_errors)                                                                                               \
    X(num_spills)          /* spills: a request, or blocks moved, put on host pages */                                 \
    X(num_unspills)        /* host pages moved back to the device (each chunk once) */                                 \
    X(num_chunk_splits)    /* chunks split: kept pages copied to single pages, the free ones unmapped */               \
    X(num_stream_handoffs) /* allocations served by their stream waiting on the device for others' work */
/* Counters that reset_accumulated leaves alone. */
#define GM_EACH_SETTING(X) X(max_split_size) /* torch compat: -1 (no limit) */

typedef struct gm_stats {
#define GM_STAT_POOLED_FIELD(name)  gm_stat name[GM_POOL__COUNT];
#define GM_STAT_COUNTER_FIELD(name) int64_t name;
    GM_EACH_POOLED_STAT(GM_STAT_POOLED_FIELD)
    GM_EACH_COUNTER(GM_STAT_COUNTER_FIELD)
    GM_EACH_SETTING(GM_STAT_COUNTER_FIELD)
#undef GM_STAT_POOLED_FIELD
#undef GM_STAT_COUNTER_FIELD
} gm_stats;

void gm_get_stats(gm_heap *heap, gm_stats *out);
/* Set every peak to its current value. */
void gm_reset_peak_stats(gm_heap *heap);
/* Zero the allocated/freed counters and the event counters. */
void gm_reset_accumulated_stats(gm_heap *heap);

/* ---- invariant checker ----------------------------------------------------
 * Walks every structure and checks: blocks tile the reserved range in address
 * order with no overlap and no gap; every byte of a live or pending block lies
 * in a mapped page (and, on the simulated device, the device agrees); adjacent
 * free blocks that could merge have merged; the free index holds exactly the
 * free blocks; the live table holds exactly the live blocks; every statistic
 * equals a recount; private pools' blocks, owners and counters agree, and
 * their pages count as used; blocks freed during a capture wait consistently;
 * a paused pool's released pages are unmapped (the device agrees) and hold
 * only that pool's blocks.
 * Returns GM_OK or GM_ECORRUPT with a reason. */
int gm_check(gm_heap *heap, char *why, size_t whylen);

/* torch's MempoolId_t: a private pool's name (see "private pools" below). */
typedef struct gm_pool_id {
    uint64_t first, second; /* {0, 0} is no pool */
} gm_pool_id;

/* ---- snapshots ------------------------------------------------------------ */
enum gm_block_state {
    GM_BLOCK_LIVE = 0,    /* handed out */
    GM_BLOCK_FREE = 1,    /* free, backed by mapped pages */
    GM_BLOCK_PENDING = 2, /* freed, waiting for stream events */
    GM_BLOCK_UNMAPPED = 3 /* free address space with no physical memory behind */
};
enum gm_page_state {
    GM_PAGE_UNMAPPED = 0,
    GM_PAGE_USED = 1,   /* mapped, touched by a live or pending block */
    GM_PAGE_CACHED = 2, /* mapped, wholly free: what empty_cache would release */
    GM_PAGE_PAUSED = 3  /* released by gm_pool_pause: the pool's blocks stay, no memory behind them */
};
typedef struct gm_block_info {
    uintptr_t addr;
    size_t size;
    size_t requested;   /* bytes asked for (live/pending) */
    gm_stream stream;   /* allocation stream, or owner of free memory */
    uint64_t context;   /* allocation site id */
    uint64_t alloc_seq; /* allocation number */
    int state;          /* gm_block_state */
    gm_pool_id pool;    /* the private pool it belongs to; {0, 0}: none */
} gm_block_info;

typedef struct gm_snapshot {
    uintptr_t va_base;
    size_t va_size;
    size_t page_size;
    size_t top; /* bytes of the range in use; blocks tile [base, base+top) */
    size_t n_blocks;
    gm_block_info *blocks; /* address order, tiling [base, base+top) */
    size_t n_pages;        /* pages in [base, base+top) */
    uint8_t *pages;        /* gm_page_state per page */
    uint32_t *growth;      /* per page: the growth that mapped it, or gave it to its pool (0: none); a
                            * segment as torch counts them is a run of one growth */
    size_t spare_pages;    /* physical pages held but not mapped */
    size_t cap_bytes;      /* effective cap */
    gm_stats stats;
    uint8_t *host; /* per page: 1 if a host-located page is mapped there (spill) */
} gm_snapshot;
int gm_snapshot_take(gm_heap *heap, gm_snapshot **out);
void gm_snapshot_free(gm_snapshot *snap);

/* ---- history --------------------------------------------------------------- */
enum gm_hist_action {
    GM_H_ALLOC = 0,
    GM_H_FREE_REQUESTED = 1, /* gm_free called */
    GM_H_FREE_COMPLETED = 2, /* reusable (at once, or when events completed) */
    GM_H_MAP = 3,            /* pages mapped behind addr */
    GM_H_UNMAP = 4,          /* pages unmapped (empty_cache, cap) */
    GM_H_REMAP = 5,          /* defragmentation: pages moved to addr */
    GM_H_OOM = 6,
    GM_H_EMPTY_CACHE = 7,
    GM_H_SPILL = 8,   /* pages at addr now lie in host memory (spill) */
    GM_H_UNSPILL = 9, /* host pages at addr left: moved back to the device, or unmapped (nothing lived there) */
    GM_H_HANDOFF = 10 /* freed memory at addr went to `stream`, made to wait on the device for its freer's work */
};
typedef struct gm_hist_entry {
    uint64_t time_ns; /* CLOCK_MONOTONIC */
    uint64_t addr;
    uint64_t size;
    gm_stream stream;
    uint64_t context;
    uint32_t action;    /* gm_hist_action */
    uint64_t requested; /* alloc and frees: the bytes asked for (size is the block's); else size */
} gm_hist_entry;
/* Keep the last `max_entries` events (0 turns history off and drops it).  Called
 * again with a new size, the newest events recorded so far that fit are kept. */
int gm_history_enable(gm_heap *heap, size_t max_entries);
/* Copy up to `cap` entries, oldest first; returns how many were copied.
 * *dropped (if not NULL) gets how many older entries the ring overwrote. */
size_t gm_history_read(gm_heap *heap, gm_hist_entry *out, size_t cap, uint64_t *dropped);
size_t gm_history_len(gm_heap *heap);
/* The context of the events this thread records from now on, in place of the
 * blocks' own (0: the blocks' own again); returns the one it replaces.  A
 * caller sets it around a call (a free, an empty_cache) to say where that call
 * came from: the events the call records then carry its context. */
uint64_t gm_history_event_context(uint64_t context);

/* ---- out-of-memory report -------------------------------------------------- */
typedef struct gm_oom_info {
    size_t request; /* bytes asked for (rounded) */
    gm_stream stream;
    size_t device_total, device_free; /* mem_info at the time (0 if unknown) */
    size_t cap_bytes;                 /* effective cap (device total if none) */
    size_t live_bytes;                /* allocated_bytes current */
    size_t pending_bytes;             /* freed, waiting for stream events */
    size_t reserved_bytes;            /* physical memory held by the heap */
    size_t cached_bytes;              /* reserved and backing no live/pending block */
    size_t free_mapped_bytes;         /* free bytes inside mapped pages */
    size_t largest_free_mapped;       /* largest free range already backed */
    size_t largest_possible;          /* largest block defragmentation could make now */
    size_t pages_needed;              /* physical pages the request still lacked */
    int device_error;                 /* GM_OK, or the device call that failed */
    size_t pool_live_bytes;           /* live and pending bytes of living private pools */
    size_t pool_free_bytes;           /* free bytes kept for living private pools (not in
                                  free_mapped_bytes: no other request can have them) */
    size_t chunk_locked_bytes;        /* free pages inside physical allocations that other
                                  blocks still use: cached, but not movable */
    size_t spilled_bytes;             /* host pages mapped now (spill) */
    size_t spill_limit;               /* gm_config.spill (0: spill is off) */
    int spill_error;                  /* with spill on, why it did not serve the request: GM_ENOMEM
                                  (the limit, or the host refused), GM_EINVAL (no unmapped
                                  room that large in the address range), GM_ECAPTURING (never
                                  during a capture), GM_ENOTSUP (the device has no host
                                  pages), GM_EDEVICE; GM_OK when spill is off */
} gm_oom_info;
/* The report of the last failed allocation; GM_EINVAL if there was none. */
int gm_last_oom(gm_heap *heap, gm_oom_info *out);
/* Fill the same report for a hypothetical request of `size` bytes now. */
void gm_memory_report(gm_heap *heap, size_t size, gm_oom_info *out);

/* ---- private pools (torch's graph pools and MemPool) -------------------------
 * A pool is named by torch's MempoolId_t, a pair of integers, and holds a set of
 * blocks on this heap's device.  An allocation made "in" a pool is served from
 * the pool's own free blocks, else from whole pages the pool takes for itself
 * (no page holds a living pool's blocks and anything else); when freed it goes back to the pool, never to the general heap or another
 * pool, for as long as the pool lives.  Every page that backs a block of a
 * living pool -- live, pending or free -- stays mapped at its address: a CUDA
 * graph has those addresses baked in.  Defragmentation and empty_cache leave
 * those pages alone and keep working on everything else.
 *
 * A pool lives while its use count is above zero.  When the last use is
 * released the pool ends: its free blocks join the general heap at once (and
 * their pages may then be unmapped or moved); its live blocks join it when they
 * are freed. */
typedef struct gm_pool_info {
    gm_pool_id id;
    int64_t use_count;              /* 0 once ended (then it is no longer listed) */
    size_t live_blocks, live_bytes; /* live and pending blocks of the pool */
    size_t free_blocks, free_bytes; /* free blocks kept for the pool */
    size_t pinned_pages;            /* pages that back any block of the pool */
    int paused;                     /* gm_pool_pause'd: its own pages are released */
    size_t paused_pages;            /* pages released by the pause (0 unless paused) */
    size_t shared_pages;            /* pages the pause kept: other blocks share them */
    size_t backup_bytes;            /* host bytes holding the paused pages' contents */
} gm_pool_info;
/* Create the pool with use count 1, or add one use to it. */
int gm_pool_retain(gm_heap *heap, gm_pool_id id);
/* torch's MemPool(no_split=True): a block of the living pool is never split --
 * a request takes whole pages, or a whole free block of the pool (which it
 * then holds entirely).  GM_EINVAL for an unknown pool. */
int gm_pool_set_no_split(gm_heap *heap, gm_pool_id id, int no_split);
/* Drop one use; at zero the pool ends (above).  GM_EINVAL for an unknown pool,
 * GM_EPAUSED (nothing changes) for the last use of a paused pool. */
int gm_pool_release(gm_heap *heap, gm_pool_id id);
/* gm_malloc, in `pool` (NULL: the general heap).  GM_EINVAL for an unknown pool. */
int gm_malloc_pool(gm_heap *heap, size_t size, gm_stream stream, uint64_t context, const gm_pool_id *pool,
                   uintptr_t *out);
/* gm_malloc_flags' flags, for a caller that tries again itself after a failure
 * (torch's path: empty the cache, try once more, then raise):
 * GM_MALLOC_OOM_UNCOUNTED: a failure is not counted in num_ooms nor recorded
 *   in the history; the caller does that with gm_count_oom once it gives up.
 * GM_MALLOC_RETRY: this call repeats one that failed, which counted the
 *   allocation's retry already: it counts none. */
enum {
    GM_MALLOC_OOM_UNCOUNTED = 1,
    GM_MALLOC_RETRY = 2
};
int gm_malloc_flags(gm_heap *heap, size_t size, gm_stream stream, uint64_t context, const gm_pool_id *pool,
                    unsigned flags, uintptr_t *out);
/* Count one out-of-memory failure of `size` bytes on `stream` that the caller
 * decided (num_ooms, and the history's OOM event). */
void gm_count_oom(gm_heap *heap, size_t size, gm_stream stream);
int gm_pool_info_get(gm_heap *heap, gm_pool_id id, gm_pool_info *out);
/* The living pools: writes up to `cap`, returns how many there are. */
size_t gm_pool_list(gm_heap *heap, gm_pool_info *out, size_t cap);
/* The live blocks of a pool in address order: writes up to `cap`, returns how
 * many there are (torch's checkpoint of a graph pool). */
size_t gm_pool_live(gm_heap *heap, gm_pool_id id, uintptr_t *addrs, size_t *sizes, size_t cap);
/* Make exactly these blocks the pool's live blocks (torch's cudagraph trees
 * restoring a checkpoint): live blocks of the pool not listed are freed into the
 * pool; listed blocks that are not live are allocated again at that address and
 * size, out of the pool's free blocks, for `stream`.  GM_EINVAL, with nothing
 * changed, when a listed block is not inside the pool's free memory (which
 * includes the live blocks this call frees, unless a record_stream use keeps
 * them pending), or the list is not 512-aligned, disjoint ranges.  The caller
 * vouches that the listed memory's earlier uses are ordered before `stream`
 * (as torch's checkpoint restore does); free memory around a listed range
 * keeps its owner. */
int gm_pool_set_live(gm_heap *heap, gm_pool_id id, const uintptr_t *addrs, const size_t *sizes, size_t n,
                     gm_stream stream);

/* ---- pausing a pool's physical memory ------------------------------------------
 * gm_pool_pause waits for the device, then unmaps and releases every page that
 * only blocks of the pool touch (live, pending or free); the address range stays
 * reserved and every block keeps its address.  Pages that blocks outside the
 * pool share stay mapped (shared_pages).  With GM_PAUSE_BACKUP the released
 * pages' contents are first copied to pinned host memory (the device's
 * host_alloc / copy ops; GM_ENOTSUP without them).  While paused:
 *   - an allocation in the pool, gm_pool_set_live and releasing the pool's last
 *     use fail with GM_EPAUSED and change nothing (other uses come and go);
 *     freeing a block of the pool works (the block goes back to the pool's
 *     free memory; no device call but a record_stream use's event record);
 *   - no other request, defragmentation, empty_cache or cap ever maps, moves
 *     or counts those pages: they are not free space;
 *   - touching the memory is the caller's error (on CUDA, an illegal-address
 *     fault that ends the CUDA context).
 * gm_pool_resume maps a page behind each released address again (spare pages
 * first, then new ones, then cached pages taken back from the heap; the cap
 * applies), grants access once per contiguous run, and copies the backup back
 * (without one the contents are undefined).  Neither may run during a capture
 * (GM_ECAPTURING).  A device failure during pause leaves the pool paused with
 * the pages released so far (the error is returned; resume maps those back); a
 * failure during resume unwinds to fully paused, backup kept.  GM_EPAUSED:
 * pausing a paused pool; GM_EINVAL: resuming one that is not, or an unknown
 * pool. */
enum {
    GM_PAUSE_BACKUP = 1
};
typedef struct gm_pause_info {
    size_t pages;        /* pages released (pause) or mapped again (resume) */
    size_t shared_pages; /* pages kept mapped because blocks outside the pool share them */
    size_t backup_bytes; /* bytes copied to (pause) or back from (resume) host memory */
    /* Where the time went, in ns: waiting for the device (pause), getting the
     * physical pages (resume: spares, new ones, taken back), the copies and
     * the host allocation or free, and the mapping work (pause: unmap and
     * release; resume: map and set_access). */
    uint64_t sync_ns, pages_ns, copy_ns, map_ns;
} gm_pause_info;
int gm_pool_pause(gm_heap *heap, gm_pool_id id, unsigned flags, gm_pause_info *out);
int gm_pool_resume(gm_heap *heap, gm_pool_id id, gm_pause_info *out);

/* ---- stream capture ------------------------------------------------------------
 * While a CUDA graph is being captured on any stream of the device, the heap
 * makes no call that would invalidate it: no device synchronisation, no event
 * query, no event record, no unmap or release.  It may still create and map
 * pages.  Calls nest; the device is also asked per stream (the driver knows). */
void gm_capture_begin(gm_heap *heap);
void gm_capture_end(gm_heap *heap);
int gm_capturing(gm_heap *heap);
/* Nothing is unmapped or released while a capture is under way: gm_empty_cache
 * and a lowered gm_set_cap do their trimming at a later call.  A block freed
 * with record_stream uses during a capture stays pending with no event until
 * the capture ends; then its events are recorded. */

/* ---- trace replay (runs in C so that timing measures the core) ------------ */
enum gm_replay_op {
    GM_R_ALLOC = 0,
    GM_R_FREE = 1
};
typedef struct gm_replay_event {
    uint32_t op;   /* gm_replay_op */
    uint32_t slot; /* which allocation: frees name the slot of their alloc */
    uint64_t size; /* alloc only */
    gm_stream stream;
} gm_replay_event;
typedef struct gm_replay_result {
    uint64_t allocs, frees, ooms;
    uint64_t peak_live_bytes; /* largest sum of live sizes that were served */
    uint64_t peak_reserved_bytes;
    uint64_t first_oom_event; /* index of the first failed alloc, or UINT64_MAX */
    uint64_t peak_event;      /* index of the event at which live peaked */
    int error;                /* GM_OK, or a non-OOM error that stopped the replay */
    uint64_t events;          /* events that ran: op_ns[events..n) were not written */
    uint64_t live_bytes;      /* in: the bytes live in `slots` at the start; out: at the end */
} gm_replay_result;
/* Replay `n` events.  `slots` must hold one uintptr_t per distinct slot: zeroed,
 * or as an earlier call on the same heap left them (a trace replayed in chunks),
 * with res->live_bytes then set to the bytes those blocks hold (what that call
 * left in it), so that live bytes carry over.
 * If op_ns is not NULL, each event's wall time in ns is stored there.
 * If stop_at is not UINT64_MAX, replay stops after that event index. */
int gm_replay(gm_heap *heap, const gm_replay_event *ev, size_t n, uintptr_t *slots, uint64_t *op_ns, uint64_t stop_at,
              gm_replay_result *res);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_GPUMEM_H */
