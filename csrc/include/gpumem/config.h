/*
 * config.h -- the heap's options (core/config.c): each option's name, its one
 * range check and its one message, built from the limits in gpumem.h.  Every
 * layer -- gpumem.Heap(...), the torch allocator's options, GPUMEM_CONF --
 * passes options through to these checks and reports their message unchanged.
 *
 * Defaults: gm_config_default fills every field with the core's default; a
 * layer that lets a user leave an option unset starts from it and sets only
 * what was given.  No field has an "unset" value.
 */
#ifndef GPUMEM_CONFIG_H
#define GPUMEM_CONFIG_H

#include <stddef.h>

#include "gpumem/gpumem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The options of gm_config, X(ENUM_SUFFIX, field, kind): kind is `count`
 * (bytes or pages, a size_t field) or `fraction` (a double field). */
#define GM_EACH_OPTION(X)                                                                                              \
    X(VA_SIZE, va_size, count)                                                                                         \
    X(CAP_BYTES, cap_bytes, count)                                                                                     \
    X(GROWTH_SLACK, growth_slack, fraction)                                                                            \
    X(GROWTH_SLACK_PAGES, growth_slack_pages, count)                                                                   \
    X(CHUNK_PAGES, chunk_pages, count)                                                                                 \
    X(PRESSURE, pressure, fraction)                                                                                    \
    X(SPILL, spill, count)                                                                                             \
    X(SPILL_CHOICE, spill_choice, count)                                                                               \
    X(STREAM_HANDOFF, stream_handoff, count)                                                                           \
    X(SPLIT_CHUNKS, split_chunks, count)

typedef enum gm_option {
#define GM_OPTION_ENUM(upper, lower, kind) GM_OPT_##upper,
    GM_EACH_OPTION(GM_OPTION_ENUM)
#undef GM_OPTION_ENUM
    GM_OPT__COUNT
} gm_option;

/* "chunk_pages" for GM_OPT_CHUNK_PAGES; "?" for anything else. */
const char *gm_option_name(gm_option opt);
/* The option called `name`, or -1. */
int gm_option_find(const char *name);
/* 1 if the option is a fraction (a double field), 0 if a count of bytes or pages. */
int gm_option_is_fraction(gm_option opt);

/* Set one option of cfg from a number, as a user gave it: a fraction option
 * takes `fraction`, any other `count`.  GM_OK, or GM_EINVAL with the option's
 * one message in err (cfg unchanged). */
int gm_config_set(gm_config *cfg, gm_option opt, size_t count, double fraction, char *err, size_t errlen);
/* Read one option of cfg: into *fraction for a fraction option, else *count
 * (the other is 0). */
void gm_config_get(const gm_config *cfg, gm_option opt, size_t *count, double *fraction);
/* Check one option of cfg: GM_OK, or GM_EINVAL with its message in err. */
int gm_config_check_one(const gm_config *cfg, gm_option opt, char *err, size_t errlen);

/* GPUMEM_CONF's text, "key:value,key:value": each item split at its first
 * ':', spaces around items, keys and values ignored, empty items skipped.
 * Calls item(key, value, ctx) for each, in order.  GM_EINVAL, with a message
 * in err that starts with `source` ("GPUMEM_CONF"), for a text longer than
 * GM_CONF_MAX_CHARS, an item that is not key:value, a key not among the
 * n_known names of `known`, or one given twice; else what item() returned
 * first that was not GM_OK (its message, if any, in err). */
#define GM_CONF_MAX_CHARS 4096
int gm_conf_parse(const char *text, const char *source, const char *const *known, size_t n_known,
                  int (*item)(const char *key, const char *value, void *ctx), void *ctx, char *err, size_t errlen);

/* A heap page size a user asks for: 0 (the device's own) or a power of two.
 * GM_OK, or GM_EINVAL with the message in err. */
int gm_check_page_size(size_t page_size, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_CONFIG_H */
