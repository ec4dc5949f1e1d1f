/*
 * array.h -- growing a dynamic array by doubling its capacity, shared by the
 * core, the devices and the extension module (plain C, no other dependency).
 */
#ifndef GPUMEM_ARRAY_H
#define GPUMEM_ARRAY_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* Resize `arr` (capacity *cap elements of elem_size bytes each) to twice *cap,
 * or to `first` elements when *cap is 0. Returns the resized array and stores
 * its capacity in *cap. On failure (out of host memory, or a size that does
 * not fit in size_t) returns NULL and leaves `arr` and *cap as they were. */
static inline void *gm_array_grow(void *arr, size_t *cap, size_t first, size_t elem_size) {
    if (*cap > SIZE_MAX / 2) return NULL;
    size_t n = *cap ? 2 * *cap : first;
    if (!elem_size || n > SIZE_MAX / elem_size) return NULL;
    void *a = realloc(arr, n * elem_size);
    if (a) *cap = n;
    return a;
}

#endif
