/*
 * fork.c -- heaps across fork().
 *
 * A process that forks while another thread is inside the heap (its lock
 * held, its lists half updated) would hand the child a lock nobody will ever
 * release: the child hangs the first time it frees a tensor or exits through
 * a heap's destructor.  DataLoader workers are such children.  So, as the C
 * library does for malloc, fork waits for every heap to be between operations:
 *
 *   prepare  take the locks handed to gm_fork_also (in the order handed),
 *            then the registry, then every heap (newest first);
 *   parent   release them all, in the reverse order;
 *   child    the same, marking each heap as inherited.
 *
 * One pthread_atfork registration does it all (installed by the first heap or
 * the first gm_fork_also), so the order does not hang on the order in which
 * handlers were registered.  The locks of gm_fork_also come first because
 * their owners (the torch boundary, csrc/python/torch_alloc.cpp) call into
 * the core while holding them: a heap lock is never held while one of those is
 * taken, and the registry lock is taken under them when they create a heap.
 *
 * No code path holds a heap lock, or one of the locks handed here, while it
 * waits for anything but the device -- in particular never for Python's GIL,
 * which the thread calling os.fork() holds while these handlers run -- so
 * prepare waits at most for one operation per lock.
 *
 * An inherited heap still works for everything that is bookkeeping (stats,
 * snapshots, frees of blocks the child inherited).  Its device, when it is a
 * GPU, belongs to the parent: CUDA cannot be used in a forked child, so
 * destroying an inherited heap frees host memory only and leaves the device
 * alone.  The simulated device is plain memory and is copied with the process.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "heap_internal.h"

static pthread_mutex_t registry = PTHREAD_MUTEX_INITIALIZER;
static gm_heap *heaps; /* newest first, through fork_next */
static pthread_once_t once = PTHREAD_ONCE_INIT;

/* Other code's locks (gm_fork_also): entries below n_also are complete. */
static struct {
    void (*lock)(void);
    void (*unlock)(void);
} also[GM_FORK_MAX_ALSO];
static atomic_size_t n_also;
static size_t n_taken; /* how many of them prepare took: the ones to release */

static void prepare(void) {
    n_taken = atomic_load_explicit(&n_also, memory_order_acquire);
    for (size_t i = 0; i < n_taken; i++) also[i].lock();
    pthread_mutex_lock(&registry);
    for (gm_heap *h = heaps; h; h = h->fork_next) pthread_mutex_lock(&h->lock);
}

static void release_also(void) {
    for (size_t i = n_taken; i-- > 0;) also[i].unlock();
}

static void parent(void) {
    for (gm_heap *h = heaps; h; h = h->fork_next) pthread_mutex_unlock(&h->lock);
    pthread_mutex_unlock(&registry);
    release_also();
}

static void child(void) {
    for (gm_heap *h = heaps; h; h = h->fork_next) {
        h->inherited = 1;
        pthread_mutex_unlock(&h->lock);
    }
    pthread_mutex_unlock(&registry);
    release_also();
}

static void install(void) { pthread_atfork(prepare, parent, child); }

int gm_fork_also(void (*lock)(void), void (*unlock)(void)) {
    if (!lock || !unlock) return GM_EINVAL;
    pthread_once(&once, install);
    int rc = GM_OK;
    pthread_mutex_lock(&registry);
    size_t n = atomic_load_explicit(&n_also, memory_order_relaxed), i;
    for (i = 0; i < n && !(also[i].lock == lock && also[i].unlock == unlock); i++) {}
    if (i == n) {
        if (n == GM_FORK_MAX_ALSO) {
            rc = GM_EINVAL;
        } else {
            also[n].lock = lock;
            also[n].unlock = unlock;
            atomic_store_explicit(&n_also, n + 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&registry);
    return rc;
}

void h_fork_register(gm_heap *h) {
    pthread_once(&once, install);
    pthread_mutex_lock(&registry);
    h->fork_next = heaps;
    heaps = h;
    pthread_mutex_unlock(&registry);
}

void h_fork_unregister(gm_heap *h) {
    pthread_mutex_lock(&registry);
    for (gm_heap **p = &heaps; *p; p = &(*p)->fork_next)
        if (*p == h) {
            *p = h->fork_next;
            break;
        }
    pthread_mutex_unlock(&registry);
}

int h_heap_inherited(const gm_heap *h) { return h->inherited; }
