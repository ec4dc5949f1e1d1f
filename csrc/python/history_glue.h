/*
 * history_glue.h -- Python call stacks for gpumem's allocation history (the
 * out-of-memory message hook is oom_glue.h's).
 *
 * Allocations carry an opaque 64-bit context id (gm_malloc's `context`).  While
 * stack capture is on, gm_py_capture_context() turns the calling thread's Python
 * stack into such an id, interning each distinct stack once, so a million
 * allocations from one line cost one stack record.  Ids made here have the top
 * bit set (GM_PYCTX_TAG); ids a caller passes itself are left alone.
 */
#ifndef GPUMEM_HISTORY_GLUE_H
#define GPUMEM_HISTORY_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define GM_PYCTX_TAG (UINT64_C(1) << 63)

/* Bits 55..62 of a context name the framework that made the allocation when it
 * was not the one the heap serves by default (torch): see GM_FRAMEWORK_*.  Ids
 * made here keep those bits clear (the generation has 23 bits, bits 32..54), so
 * a framework tag can be or'ed into any context. */
#define GM_CTX_FRAMEWORK_SHIFT 55
#define GM_CTX_FRAMEWORK_MASK  (UINT64_C(0xff) << GM_CTX_FRAMEWORK_SHIFT)
#define GM_FRAMEWORK_DEFAULT   0 /* the heap's own user: torch on the per-device heaps */
#define GM_FRAMEWORK_CUPY      1
#define GM_FRAMEWORK_NUMBA     2

/* The context id of the calling thread's Python stack, or 0 when capture is
 * off, the thread does not hold the GIL (an autograd or C++ thread), or there
 * is no Python frame.  Safe to call from any thread; never raises.  Exported
 * (default visibility) so that hooks -- torch's context hook, or ctypes in the
 * tests, which calls it without the GIL -- can take its address. */
#if defined(__GNUC__)
__attribute__((visibility("default")))
#endif
uint64_t
gm_py_capture_context(void);

/* The same for allocator hooks called where the GIL was given up on purpose:
 * torch's op bindings release it before dispatching, so the allocation runs in
 * a Python thread that does not hold it.  Such a thread (one Python has a
 * thread state for) takes the GIL back for the capture, as torch's own
 * _record_memory_history does; a thread Python never saw (a C++ worker) still
 * gets 0 without Python being touched, and so does any thread while the
 * interpreter is finalizing.  Exported for the same reasons. */
#if defined(__GNUC__)
__attribute__((visibility("default")))
#endif
uint64_t
gm_py_capture_context_reacquire(void);

/* Nonzero while Python is shutting down: no thread may take the GIL then. */
int gm_py_finalizing(void);

/* Adds the module-level functions (_stacks_enable, _stack_frames, ...) to
 * gpumem._C.  Returns 0, or -1 with an exception set. */
int gm_history_glue_add(PyObject *module);

#endif /* GPUMEM_HISTORY_GLUE_H */
