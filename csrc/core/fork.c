/*
 * fork.c -- heaps across fork().
 *
 * A process that forks while another thread is inside the heap (its lock
 * held, its lists half updated) would hand the child a lock nobody will ever
 * release: the child hangs the first time it frees a tensor or exits through
 * a heap's destructor.  DataLoader workers are such children.  So, as the C
 * library does for malloc, fork waits for every heap to be between operations:
 *
 *   prepare  lock the registry, then every heap (in creation order);
 *   parent   unlock them all;
 *   child    unlock them all, and mark each heap as inherited.
 *
 * No code path holds a heap lock while it waits for anything but the device,
 * so prepare waits at most for one operation per heap.
 *
 * An inherited heap still works for everything that is bookkeeping (stats,
 * snapshots, frees of blocks the child inherited).  Its device, when it is a
 * GPU, belongs to the parent: CUDA cannot be used in a forked child, so
 * destroying an inherited heap frees host memory only and leaves the device
 * alone.  The simulated device is plain memory and is copied with the process.
 */
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "heap_internal.h"

static pthread_mutex_t registry = PTHREAD_MUTEX_INITIALIZER;
static gm_heap *heaps; /* newest first, through fork_next */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void prepare(void) {
    pthread_mutex_lock(&registry);
    for (gm_heap *h = heaps; h; h = h->fork_next) pthread_mutex_lock(&h->lock);
}

static void parent(void) {
    for (gm_heap *h = heaps; h; h = h->fork_next) pthread_mutex_unlock(&h->lock);
    pthread_mutex_unlock(&registry);
}

static void child(void) {
    for (gm_heap *h = heaps; h; h = h->fork_next) {
        h->inherited = 1;
        pthread_mutex_unlock(&h->lock);
    }
    pthread_mutex_unlock(&registry);
}

static void install(void) { pthread_atfork(prepare, parent, child); }

void gm_fork_register(gm_heap *h) {
    pthread_once(&once, install);
    pthread_mutex_lock(&registry);
    h->fork_next = heaps;
    heaps = h;
    pthread_mutex_unlock(&registry);
}

void gm_fork_unregister(gm_heap *h) {
    pthread_mutex_lock(&registry);
    for (gm_heap **p = &heaps; *p; p = &(*p)->fork_next)
        if (*p == h) {
            *p = h->fork_next;
            break;
        }
    pthread_mutex_unlock(&registry);
}

int gm_heap_inherited(const gm_heap *h) { return h->inherited; }
