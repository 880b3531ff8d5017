/*
 * 1-d contiguous integer arrays taken from Python buffers, for the C helpers that check their
 * arguments' types the same way (cache/_hitpath.c, buffers/_rowcopy.c).
 */
#ifndef ENGRAM_INT_ARRAYS_H
#define ENGRAM_INT_ARRAYS_H

#include <Python.h>

/* Whether b holds integers of `itemsize` bytes (1: bool or bytes; 4: int32; 8: int64). */
static int int_format(const Py_buffer *b, Py_ssize_t itemsize) {
    if (b->itemsize != itemsize || b->format == NULL) return 0;
    const char *f = b->format;
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (f[1] != '\0') return 0;
    if (itemsize == 8) return *f == 'l' || *f == 'q';
    if (itemsize == 4) return *f == 'i' || (sizeof(long) == 4 && *f == 'l');
    if (itemsize == 1) return *f == '?' || *f == 'B' || *f == 'b';
    return 0;
}

static int get_array(PyObject *obj, Py_buffer *b, Py_ssize_t itemsize, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, b, flags) < 0) return -1;
    if (b->ndim != 1 || !int_format(b, itemsize)) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-d contiguous array of %zd-byte integers", name, itemsize);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

#endif
