/*
 * stats.c -- statistics with torch's names and meanings.
 *
 * Each gm_stat is torch's Stat: current, peak, and the running totals of
 * increases (allocated) and decreases (freed).  Arrays are indexed by pool:
 * all, small_pool (blocks of at most 1 MiB), large_pool.  The mapping to
 * torch's keys is "<field name>.<pool>.<current|peak|allocated|freed>", e.g.
 * allocated_bytes.all.current; the extension module spells them out.
 *
 * gpumem has one address space, not two pools, so pools are decided by block
 * size; physical pages (segment, reserved_bytes) all count under large_pool.
 */
#include "heap_internal.h"

#define GM_EACH_STAT(X)                                                                  \
    X(allocation) X(segment) X(active) X(inactive_split) X(allocated_bytes) X(reserved_bytes) \
    X(active_bytes) X(inactive_split_bytes) X(requested_bytes)

void gm_stats_reset_peaks(gm_stats *st) {
#define RESET_PEAK(name) \
    for (int p = 0; p < GM_POOL__COUNT; p++) st->name[p].peak = st->name[p].current;
    GM_EACH_STAT(RESET_PEAK)
#undef RESET_PEAK
}

void gm_stats_reset_accumulated(gm_stats *st) {
#define RESET_ACC(name) \
    for (int p = 0; p < GM_POOL__COUNT; p++) st->name[p].allocated = st->name[p].freed = 0;
    GM_EACH_STAT(RESET_ACC)
#undef RESET_ACC
    st->num_alloc_retries = st->num_ooms = st->num_sync_all_streams = 0;
    st->num_device_alloc = st->num_device_free = st->num_maps = st->num_unmaps = 0;
    st->num_remaps = st->num_pages_remapped = st->num_device_errors = 0;
}
