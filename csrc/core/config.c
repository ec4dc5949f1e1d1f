/*
 * config.c -- the heap's options: the one range check and the one message of
 * each, built from the limits gpumem.h defines (see gpumem/config.h).
 * gm_heap_create calls gm_config_check; the layers above call the same checks
 * before they get that far, so a user sees one message whichever way the
 * option came in.
 */
#include <string.h>

#include "gpumem/config.h"

static const char *const option_names[GM_OPT__COUNT] = {
#define GM_OPTION_NAME(upper, lower, kind) #lower,
    GM_EACH_OPTION(GM_OPTION_NAME)
#undef GM_OPTION_NAME
};

const char *gm_option_name(gm_option opt) { return (unsigned)opt < GM_OPT__COUNT ? option_names[opt] : "?"; }

int gm_option_find(const char *name) {
    for (int i = 0; name && i < GM_OPT__COUNT; i++)
        if (!strcmp(name, option_names[i])) return i;
    return -1;
}

#define IS_count    0
#define IS_fraction 1
static const char option_is_fraction[GM_OPT__COUNT] = {
#define GM_OPTION_KIND(upper, lower, kind) IS_##kind,
    GM_EACH_OPTION(GM_OPTION_KIND)
#undef GM_OPTION_KIND
};

int gm_option_is_fraction(gm_option opt) { return (unsigned)opt < GM_OPT__COUNT && option_is_fraction[opt]; }

int gm_config_check_one(const gm_config *cfg, gm_option opt, char *err, size_t errlen) {
    switch (opt) {
    case GM_OPT_VA_SIZE:
        if (cfg->va_size > GM_VA_SIZE_MAX)
            return gm_errorf(GM_EINVAL, err, errlen,
                             "va_size must be at most %zu bytes (the 256 TiB of address space a GPU has), got %zu",
                             GM_VA_SIZE_MAX, cfg->va_size);
        return GM_OK;
    case GM_OPT_GROWTH_SLACK:
        if (!(cfg->growth_slack >= 0 && cfg->growth_slack <= GM_GROWTH_SLACK_MAX))
            return gm_errorf(GM_EINVAL, err, errlen, "growth_slack must be in [0, %g], got %g", GM_GROWTH_SLACK_MAX,
                             cfg->growth_slack);
        return GM_OK;
    case GM_OPT_CHUNK_PAGES:
        if (cfg->chunk_pages < 1 || cfg->chunk_pages > GM_CHUNK_PAGES_MAX)
            return gm_errorf(GM_EINVAL, err, errlen, "chunk_pages must be in [1, %d], got %zu", GM_CHUNK_PAGES_MAX,
                             cfg->chunk_pages);
        return GM_OK;
    case GM_OPT_PRESSURE:
        if (!(cfg->pressure >= 0 && cfg->pressure <= 1))
            return gm_errorf(GM_EINVAL, err, errlen, "pressure must be in [0, 1] (0: always tight), got %g",
                             cfg->pressure);
        return GM_OK;
    case GM_OPT_CAP_BYTES:          /* any: 0 is none */
    case GM_OPT_GROWTH_SLACK_PAGES: /* any */
        return GM_OK;
    default:
        return gm_errorf(GM_EINVAL, err, errlen, "unknown option %d", (int)opt);
    }
}

int gm_config_check(const gm_config *cfg, char *err, size_t errlen) {
    if (!cfg) return gm_errorf(GM_EINVAL, err, errlen, "no configuration");
    for (int opt = 0; opt < GM_OPT__COUNT; opt++) {
        int rc = gm_config_check_one(cfg, (gm_option)opt, err, errlen);
        if (rc != GM_OK) return rc;
    }
    return GM_OK;
}

int gm_config_set(gm_config *cfg, gm_option opt, size_t count, double fraction, char *err, size_t errlen) {
    gm_config next = *cfg;
    switch (opt) {
#define GM_OPTION_SET(upper, lower, kind)                                                                              \
    case GM_OPT_##upper:                                                                                               \
        next.lower = kind;                                                                                             \
        break;
        GM_EACH_OPTION(GM_OPTION_SET)
#undef GM_OPTION_SET
    default:
        return gm_errorf(GM_EINVAL, err, errlen, "unknown option %d", (int)opt);
    }
    int rc = gm_config_check_one(&next, opt, err, errlen);
    if (rc == GM_OK) *cfg = next;
    return rc;
}

void gm_config_get(const gm_config *cfg, gm_option opt, size_t *count, double *fraction) {
    *count = 0;
    *fraction = 0.0;
    switch (opt) {
#define GM_OPTION_GET(upper, lower, kind)                                                                              \
    case GM_OPT_##upper:                                                                                               \
        *kind = cfg->lower;                                                                                            \
        break;
        GM_EACH_OPTION(GM_OPTION_GET)
#undef GM_OPTION_GET
    default:
        break;
    }
}

int gm_check_page_size(size_t page_size, char *err, size_t errlen) {
    if (page_size & (page_size - 1))
        return gm_errorf(GM_EINVAL, err, errlen, "page_size must be a power of two, got %zu", page_size);
    return GM_OK;
}
