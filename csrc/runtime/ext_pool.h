/*
 * ext_pool.h -- private pools over another allocator: torch.cuda.MemPool(allocator)
 * under gpumem.
 *
 * torch lets a MemPool take its memory from another allocator (a
 * CUDAPluggableAllocator: ncclMemAlloc, cudaMallocManaged, ...), caching it
 * as it caches cudaMalloc's segments.  gpumem's heap cannot map someone
 * else's memory, so such a pool is kept here, beside the heap: segments
 * asked of the pool's allocator (sized as torch sizes its segments), blocks
 * carved from them for the pool's requests and reused only by the pool, on
 * the stream they were made for.  Its segments count against the device's cap
 * (the heap registry's "outside" bytes), and go back to the allocator when the
 * pool ends with nothing live in it, or else at the empty_cache after its last
 * block is freed.  A pool marked use_on_oom lends
 * its free blocks to an allocation that would otherwise run out of memory.
 *
 * Plain C, one lock per device; the allocator's functions are called with no
 * lock held.
 */
#ifndef GPUMEM_EXT_POOL_H
#define GPUMEM_EXT_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem/gpumem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CUDAPluggableAllocator's two functions, by address. */
typedef void *(*gm_ext_alloc_fn)(size_t size, int device, void *stream);
typedef void (*gm_ext_free_fn)(void *ptr, size_t size, int device, void *stream);

/* One segment of a pool, for snapshots: its blocks' (addr, size, used). */
typedef struct {
    uintptr_t addr;
    size_t size;
    int used;
} gm_ext_block_info;

/* Pool `id` of `device` takes its memory from alloc/free.  GM_EINVAL: a bad
 * device or function, or the pool already has an allocator. */
int gm_ext_attach(int device, gm_pool_id id, gm_ext_alloc_fn alloc, gm_ext_free_fn release, int use_on_oom);
/* The pool has ended: nothing more is allocated from it.  With nothing live
 * in it its segments go back now; else at gm_ext_release_ended once nothing
 * lives in them.  Neither gives anything back while the device's heap may be
 * capturing a CUDA graph (the next call after the capture does).  GM_EINVAL
 * when it has no allocator. */
int gm_ext_detach(int device, gm_pool_id id);
/* Gives the wholly free segments of ended pools back to their allocators
 * (torch's empty_cache, and before an out-of-memory retry). */
void gm_ext_release_ended(int device);
/* Whether pool `id` takes its memory from another allocator. */
int gm_ext_owns(int device, gm_pool_id id);
/* A block of the pool for a request of `size` on `stream`: GM_OK and *out;
 * GM_ENOMEM when the cap or the allocator refuses; GM_EINVAL for no such pool. */
int gm_ext_alloc(int device, gm_pool_id id, size_t size, void *stream, uintptr_t *out);
/* A free block of a living use_on_oom pool, on `stream`: GM_OK or GM_ENOMEM. */
int gm_ext_alloc_on_oom(int device, size_t size, void *stream, uintptr_t *out);
/* Frees a block of one of the device's pools: GM_OK, or GM_EUNKNOWN_PTR. */
int gm_ext_free(int device, uintptr_t ptr);
/* Whether ptr is a live block of one of the device's pools. */
int gm_ext_is_live(int device, uintptr_t ptr);
/* The pool's segments: fills up to cap_blocks blocks in address order and,
 * per segment, its block count in seg_blocks (up to cap_segs); returns the
 * number of segments (more than cap_segs when they did not fit). */
size_t gm_ext_segments(int device, gm_pool_id id, gm_ext_block_info *blocks, size_t cap_blocks, size_t *seg_blocks,
                       size_t cap_segs);

#ifdef __cplusplus
}
#endif

#endif
