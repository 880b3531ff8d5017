/*
 * Row copies of the fetch path, one C call for a batch of rows.
 *
 * move_rows(src, src_offsets, dst, dst_offsets, row_bytes)
 *   For every i: row_bytes bytes at byte src_offsets[i] of src -> byte dst_offsets[i] of dst
 *   (either offsets None: i * row_bytes; at least one given, both the same length). Every
 *   range is bounds-checked before any byte moves (IndexError, nothing copied). The copies
 *   of the fetch path (rows into caches, out of page buffers, into a result's positions):
 *   one thread, no interpreter per row, unlike a multi-threaded tensor op whose idle
 *   workers spin on the other cores after each call.
 *
 * The GIL is released for large batches only (NOGIL_MIN_IDS rows and more).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "int_arrays.h"

#define AHEAD 8               /* rows looked ahead when prefetching source and destination rows */
#define NOGIL_MIN_IDS 16384   /* release the GIL from this many rows on */

/* Starts loading the lines of a row (its last one too, when the row is not line-aligned),
 * for reading or (`write`) for writing.  Inlined: a call to a function that only
 * prefetches is dropped by gcc as having no effect. */
static inline __attribute__((always_inline)) void prefetch_row(const char *row, Py_ssize_t rb, int write) {
    for (Py_ssize_t off = 0; off < rb; off += 64) {
        if (write) __builtin_prefetch(row + off, 1);
        else __builtin_prefetch(row + off, 0);
    }
    if (write) __builtin_prefetch(row + rb - 1, 1);
    else __builtin_prefetch(row + rb - 1, 0);
}

/* One side of move_rows: a buffer and its byte offsets (NULL: i * row_bytes). */
typedef struct {
    Py_buffer buf, offsets;
    int have_offsets;
} RowSide;

static void side_release(RowSide *side) {
    if (side->buf.obj) PyBuffer_Release(&side->buf);
    if (side->have_offsets) PyBuffer_Release(&side->offsets);
}

static int side_get(RowSide *side, PyObject *buf_o, PyObject *offsets_o, int writable, const char *name) {
    memset(side, 0, sizeof(*side));
    if (PyObject_GetBuffer(buf_o, &side->buf, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (offsets_o != Py_None) {
        if (get_array(offsets_o, &side->offsets, 8, 0, name) < 0) {
            PyBuffer_Release(&side->buf);
            side->buf.obj = NULL;
            return -1;
        }
        side->have_offsets = 1;
    }
    return 0;
}

/* Whether every row of a side lies within its buffer (sets IndexError if not). */
static int side_in_bounds(const RowSide *side, Py_ssize_t k, Py_ssize_t rb, const char *name) {
    if (!side->have_offsets) {
        if (k * rb > side->buf.len) {
            PyErr_Format(PyExc_IndexError, "move_rows: %zd rows of %zd bytes overrun the %zd-byte %s", k, rb,
                         side->buf.len, name);
            return 0;
        }
        return 1;
    }
    const int64_t *off = (const int64_t *)side->offsets.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (off[i] < 0 || off[i] > side->buf.len - rb) {
            PyErr_Format(PyExc_IndexError, "move_rows: %s offset %lld (row %zd) outside 0..%zd", name,
                         (long long)off[i], i, side->buf.len - rb);
            return 0;
        }
    }
    return 1;
}

static PyObject *move_rows(PyObject *module, PyObject *args) {
    PyObject *src_o, *soff_o, *dst_o, *doff_o;
    Py_ssize_t rb;
    if (!PyArg_ParseTuple(args, "OOOOn", &src_o, &soff_o, &dst_o, &doff_o, &rb)) return NULL;
    if (rb <= 0) {
        PyErr_SetString(PyExc_ValueError, "move_rows: row_bytes must be > 0");
        return NULL;
    }
    if (soff_o == Py_None && doff_o == Py_None) {
        PyErr_SetString(PyExc_ValueError, "move_rows: give src_offsets, dst_offsets or both");
        return NULL;
    }
    RowSide src, dst;
    if (side_get(&src, src_o, soff_o, 0, "src_offsets") < 0) return NULL;
    if (side_get(&dst, dst_o, doff_o, 1, "dst_offsets") < 0) {
        side_release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t k = src.have_offsets ? src.offsets.len / 8 : dst.offsets.len / 8;
    if (src.have_offsets && dst.have_offsets && src.offsets.len != dst.offsets.len) {
        PyErr_SetString(PyExc_ValueError, "move_rows: src_offsets and dst_offsets differ in length");
        goto done;
    }
    if (!side_in_bounds(&src, k, rb, "src") || !side_in_bounds(&dst, k, rb, "dst")) goto done;
    {
        const char *s = (const char *)src.buf.buf;
        char *d = (char *)dst.buf.buf;
        const int64_t *so = src.have_offsets ? (const int64_t *)src.offsets.buf : NULL;
        const int64_t *dof = dst.have_offsets ? (const int64_t *)dst.offsets.buf : NULL;
        PyThreadState *ts = k >= NOGIL_MIN_IDS ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t i = 0; i < k; i++) {
            if (so && i + AHEAD < k)
                prefetch_row(s + so[i + AHEAD], rb, 0);
            if (dof && i + AHEAD < k) /* a cache's slots: a store into a line not in cache waits for it */
                prefetch_row(d + dof[i + AHEAD], rb, 1);
            memcpy(d + (dof ? dof[i] : i * rb), s + (so ? so[i] : i * rb), (size_t)rb);
        }
        if (ts) PyEval_RestoreThread(ts);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    side_release(&src);
    side_release(&dst);
    return result;
}

static PyMethodDef module_methods[] = {
    {"move_rows", move_rows, METH_VARARGS,
     "move_rows(src, src_offsets, dst, dst_offsets, row_bytes): row_bytes bytes at each src offset "
     "-> the matching dst offset (None: i * row_bytes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy",
                                    "Row copies between host buffers.", -1, module_methods};

PyMODINIT_FUNC PyInit__rowcopy(void) { return PyModule_Create(&module); }
