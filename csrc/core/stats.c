/*
 * stats.c -- statistics with torch's names and meanings.
 *
 * Each gm_stat is torch's Stat: current, peak, and the running totals of
 * increases (allocated) and decreases (freed).  Arrays are indexed by pool:
 * all, small_pool (blocks of at most 1 MiB), large_pool.  The mapping to
 * torch's keys is "<field name>.<pool>.<current|peak|allocated|freed>", e.g.
 * allocated_bytes.all.current.  The lists are GM_EACH_POOLED_STAT and
 * GM_EACH_COUNTER in gpumem.h.
 *
 * gpumem has one address space, not two pools, so pools are decided by block
 * size; physical pages (segment, reserved_bytes) all count under large_pool.
 */
#include "heap_internal.h"

void h_stats_reset_peaks(gm_stats *st) {
#define RESET_PEAK(name)                                                                                               \
    for (int p = 0; p < GM_POOL__COUNT; p++) st->name[p].peak = st->name[p].current;
    GM_EACH_POOLED_STAT(RESET_PEAK)
#undef RESET_PEAK
}

void h_stats_reset_accumulated(gm_stats *st) {
#define RESET_ACC(name)                                                                                                \
    for (int p = 0; p < GM_POOL__COUNT; p++) st->name[p].allocated = st->name[p].freed = 0;
    GM_EACH_POOLED_STAT(RESET_ACC)
#undef RESET_ACC
#define RESET_COUNTER(name) st->name = 0;
    GM_EACH_COUNTER(RESET_COUNTER)
#undef RESET_COUNTER
}
