/*
 * A strided int64 array read in C order, for the C helpers that take a NumPy view in place
 * (_dedupkernel.c's ids, _rowdecode.c's index) rather than a contiguous copy NumPy would
 * make (and let go of the GIL for).
 *
 * Request the buffer with PyBUF_STRIDES | PyBUF_FORMAT and check it with strided_int64_ok.
 */
#ifndef ENGRAM_STRIDED_H
#define ENGRAM_STRIDED_H

#include <Python.h>
#include <stdint.h>

#define STRIDED_MAX_DIMS 32

/* Whether b holds 8-byte signed integers, has no suboffsets, and at most STRIDED_MAX_DIMS dimensions. */
static int strided_int64_ok(const Py_buffer *b) {
    if (b->itemsize != 8 || b->format == NULL || b->suboffsets != NULL || b->ndim > STRIDED_MAX_DIMS) return 0;
    const char *f = b->format;
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return (*f == 'l' || *f == 'q') && f[1] == '\0';
}

/* The len / 8 values of b (any shape and strides) into dst, in C order. */
static void strided_int64_copy(const Py_buffer *b, int64_t *dst) {
    Py_ssize_t n = b->len / 8, at[STRIDED_MAX_DIMS] = {0};
    const char *base = (const char *)b->buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off = 0;
        for (int d = 0; d < b->ndim; d++) off += at[d] * b->strides[d];
        dst[i] = *(const int64_t *)(base + off);
        for (int d = b->ndim - 1; d >= 0; d--) { /* the next index in C order */
            if (++at[d] < b->shape[d]) break;
            at[d] = 0;
        }
    }
}

#endif
