/* errors.c -- one sentence per error code. */
#include "gpumem/gpumem.h"

const char *gm_strerror(int code) {
    switch (code) {
    case GM_OK: return "success";
    case GM_ENOMEM: return "out of memory";
    case GM_EINVAL: return "invalid argument";
    case GM_EUNKNOWN_PTR: return "pointer was not allocated by this heap";
    case GM_EDOUBLE_FREE: return "pointer is not a live allocation (double free, or not the start of a block)";
    case GM_EDEVICE: return "a device call failed";
    case GM_ENOTREADY: return "event not complete";
    case GM_ENOTSUP: return "not supported by this device";
    case GM_ENODRIVER: return "CUDA driver library could not be loaded";
    case GM_ECORRUPT: return "heap invariant broken";
    default: return "unknown error";
    }
}
