/* errors.c -- one sentence per error code (the list is GM_EACH_ERROR in gpumem.h). */
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
