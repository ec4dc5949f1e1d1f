/* errors.c -- one sentence per error code (the list is GM_EACH_ERROR in gpumem.h),
 * and the reason a call writes into its caller's buffer. */
#include <stdarg.h>
#include <stdio.h>

#include "gpumem/gpumem.h"

const char *gm_strerror(int code) {
    switch (code) {
#define GM_ERROR_CASE(name, value, text)                                                                               \
    case name:                                                                                                         \
        return text;
        GM_EACH_ERROR(GM_ERROR_CASE)
#undef GM_ERROR_CASE
    default:
        return "unknown error";
    }
}

int gm_errorf(int rc, char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return rc;
}
