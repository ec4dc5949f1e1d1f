/*
 * config.c -- the heap's options: the one range check and the one message of
 * each, built from the limits gpumem.h defines (see gpumem/config.h).
 * gm_heap_create calls gm_config_check; the layers above call the same checks
 * before they get that far, so a user sees one message whichever way the
 * option came in.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
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
    case GM_OPT_SPILL_CHOICE:
        if (cfg->spill_choice != GM_SPILL_OLD && cfg->spill_choice != GM_SPILL_NEW &&
            cfg->spill_choice != GM_SPILL_LASTING)
            return gm_errorf(GM_EINVAL, err, errlen, "spill_choice must be \"old\", \"new\" or \"lasting\", got %zu",
                             cfg->spill_choice);
        return GM_OK;
    case GM_OPT_STREAM_HANDOFF:
        if (cfg->stream_handoff > 1)
            return gm_errorf(GM_EINVAL, err, errlen, "stream_handoff must be 0 or 1, got %zu", cfg->stream_handoff);
        return GM_OK;
    case GM_OPT_SPLIT_CHUNKS:
        if (cfg->split_chunks > 1)
            return gm_errorf(GM_EINVAL, err, errlen, "split_chunks must be 0 or 1, got %zu", cfg->split_chunks);
        return GM_OK;
    case GM_OPT_SPILL:              /* any: 0 is off */
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

/* [*s, *e) without the spaces around it. */
static void trim(char **s, char **e) {
    while (*s < *e && isspace((unsigned char)**s)) (*s)++;
    while (*e > *s && isspace((unsigned char)(*e)[-1])) (*e)--;
}

/* The names of `known`, ", "-separated, into buf. */
static void list_names(char *buf, size_t len, const char *const *known, size_t n_known) {
    size_t at = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < n_known && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s", i ? ", " : "", known[i]);
}

/* The index in `known` of the key [key, end), or -1. */
static int find_known(const char *key, const char *end, const char *const *known, size_t n_known) {
    size_t n = (size_t)(end - key);
    for (size_t k = 0; k < n_known; k++)
        if (strlen(known[k]) == n && !strncmp(known[k], key, n)) return (int)k;
    return -1;
}

/* One trimmed item: the index in `known` of its key, which must be new, with
 * the key and the value made strings in place; -1 with a message otherwise. */
static int conf_item(char *item, const char *source, const char *const *known, size_t n_known, const char **given,
                     char **key, char **value, char *err, size_t errlen) {
    char *colon = strchr(item, ':');
    char *key_end = colon, *value_end = item + strlen(item);
    *key = item;
    *value = colon ? colon + 1 : NULL;
    if (colon) {
        trim(key, &key_end);
        trim(value, &value_end);
    }
    if (!colon || key_end == *key || value_end == *value)
        return gm_errorf(-1, err, errlen, "%s: expected key:value, got '%s'", source, item);
    int k = find_known(*key, key_end, known, n_known);
    char names[512];
    list_names(names, sizeof names, known, n_known);
    if (k < 0)
        return gm_errorf(-1, err, errlen, "%s: unknown option '%.*s' in '%s' (known: %s)", source,
                         (int)(key_end - *key), *key, item, names);
    if (given[k])
        return gm_errorf(-1, err, errlen, "%s: option %s given twice (%s:%s and %s)", source, known[k], known[k],
                         given[k], item);
    *key_end = '\0';
    *value_end = '\0';
    given[k] = *value;
    return k;
}

int gm_conf_parse(const char *text, const char *source, const char *const *known, size_t n_known,
                  int (*item)(const char *key, const char *value, void *ctx), void *ctx, char *err, size_t errlen) {
    size_t len = text ? strlen(text) : 0;
    if (len > GM_CONF_MAX_CHARS)
        return gm_errorf(GM_EINVAL, err, errlen, "%s: %zu characters, more than the %d gpumem reads", source, len,
                         GM_CONF_MAX_CHARS);
    char *copy = malloc(len + 1);
    const char **given = calloc(n_known ? n_known : 1, sizeof *given);
    int rc = copy && given ? GM_OK : gm_errorf(GM_ENOMEM, err, errlen, "%s: out of host memory", source);
    if (copy) memcpy(copy, text ? text : "", len + 1);
    for (char *at = copy; rc == GM_OK && at && *at;) {
        char *end = strchr(at, ',');
        char *next = end ? end + 1 : NULL;
        char *it = at;
        if (!end) end = at + strlen(at);
        trim(&it, &end);
        *end = '\0';
        at = next;
        if (!*it) continue;
        char *key, *value;
        if (conf_item(it, source, known, n_known, given, &key, &value, err, errlen) < 0)
            rc = GM_EINVAL;
        else
            rc = item(key, value, ctx);
    }
    free(copy);
    free(given);
    return rc;
}
