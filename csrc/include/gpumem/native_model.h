/*
 * native_model.h -- a model of PyTorch's native CUDA caching allocator, to
 * replay traces on (csrc/model/native_model.c): the engine of
 * gpumem/native_model.py, whose module docstring states the rules it follows.
 *
 * Plain C11 with no dependency on Python or on gpumem's core.  One model is
 * used by one thread at a time.
 */
#ifndef GPUMEM_NATIVE_MODEL_H
#define GPUMEM_NATIVE_MODEL_H

#include <stddef.h>
#include <stdint.h>

/* No memory limit, and no max_split_size.  Larger limits count as this one:
 * no device comes near 4 EiB. */
#define GM_NATIVE_UNLIMITED     (1ull << 62)
/* max_split_size must be more than this (torch refuses max_split_size_mb <= 20). */
#define GM_NATIVE_MIN_MAX_SPLIT (20ull << 20)

enum gm_native_rc {
    GM_NATIVE_OK = 0,
    GM_NATIVE_OOM,            /* the request does not fit under the limit (torch's out-of-memory) */
    GM_NATIVE_NOT_HANDED_OUT, /* free of an address the model did not hand out, or already freed */
    GM_NATIVE_NO_HOST_MEMORY, /* the model's own bookkeeping could not grow; the model is unchanged */
    GM_NATIVE_NO_ADDRESSES,   /* no gap among the segments held fits a new one (the limit keeps them apart) */
};

/* The counters torch keeps (torch.cuda.memory_stats's names in parentheses). */
typedef struct gm_native_stats {
    uint64_t reserved;          /* bytes of segments held (reserved_bytes) */
    uint64_t peak_reserved;     /* the most reserved ever */
    uint64_t allocated;         /* bytes of the blocks handed out, whole blocks (allocated_bytes) */
    uint64_t peak_allocated;    /* the most allocated ever (max_memory_allocated) */
    uint64_t segments;          /* segments held */
    uint64_t num_device_alloc;  /* segments asked of the device */
    uint64_t num_device_free;   /* segments given back */
    uint64_t num_alloc_retries; /* requests that found the limit in the way and released memory */
    uint64_t ooms;              /* requests that failed */
} gm_native_stats;

typedef struct gm_native gm_native;

/* A model with memory limit `capacity` (0 < capacity; GM_NATIVE_UNLIMITED: none)
 * and `max_split` (0: none, else more than GM_NATIVE_MIN_MAX_SPLIT: the caller
 * checks).  NULL when out of host memory. */
gm_native *gm_native_new(uint64_t capacity, uint64_t max_split);
void gm_native_destroy(gm_native *m);

/* A block for `size` bytes on `stream`: GM_NATIVE_OK with its address in
 * *addr, or GM_NATIVE_OOM (counted in ooms), or an error. */
int gm_native_malloc(gm_native *m, uint64_t size, uint64_t stream, int64_t *addr);
/* Free the block at `addr`: GM_NATIVE_OK, GM_NATIVE_NOT_HANDED_OUT or
 * GM_NATIVE_NO_HOST_MEMORY. */
int gm_native_free(gm_native *m, int64_t addr);
/* Release every wholly free segment (torch.cuda.empty_cache()); the bytes released. */
uint64_t gm_native_empty_cache(gm_native *m);
const gm_native_stats *gm_native_stats_of(const gm_native *m);

/* One block as gm_native_blocks lists it. */
typedef struct gm_native_block {
    int64_t segment; /* the address of its segment (of the segment's first block) */
    int64_t addr;
    uint64_t size;
    uint64_t stream;
    int small; /* in the small pool */
    int free;  /* cached, not handed out */
} gm_native_block;

/* Every block, segment by segment, each segment's from its lowest address up:
 * writes at most `max` into out and returns how many there are. */
size_t gm_native_blocks(const gm_native *m, gm_native_block *out, size_t max);

/* What a replay reports. */
typedef struct gm_native_replay_result {
    gm_native_stats stats;   /* at the end (peaks over the whole replay) */
    int64_t first_oom_event; /* the index of the first request that failed, -1 if none */
} gm_native_replay_result;

/* The op of a packed trace event that allocates (gpumem/trace.py's R_ALLOC);
 * every other op frees. */
#define GM_NATIVE_OP_ALLOC 0u

/* Replay n_events packed trace events (3 words each: op | slot << 32, size,
 * stream) through a new model.  A request that fails counts as an OOM and its
 * slot keeps what it held (in a well-formed trace nothing, so that its free is
 * skipped); with stop_at_oom the replay stops there.  A free of a slot that
 * holds nothing is skipped.  GM_NATIVE_OK, or GM_NATIVE_NO_HOST_MEMORY or
 * GM_NATIVE_NO_ADDRESSES (*res then says nothing). */
int gm_native_replay(const uint64_t *words, size_t n_events, uint64_t capacity, uint64_t max_split, int stop_at_oom,
                     gm_native_replay_result *res);

#endif
