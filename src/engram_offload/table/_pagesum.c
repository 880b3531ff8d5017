/*
 * The page checksums of table files: the low 32 bits of XXH3-64 (seed 0) of
 * every page of a buffer, computed with the GIL released.
 *
 * page_sums(data, page_bytes, out)
 *   data   bytes-like, len = pages * page_bytes
 *   out    writable uint32 [pages] (written)
 *
 * XXH3 comes from the vendored single-header xxHash (xxhash.h beside this file, BSD
 * 2-clause), inlined; it is the same function the xxhash Python package computes, which
 * is the fallback when this helper is not built. On x86-64 CPUs with AVX2 the loop of
 * _pagesum_avx2.c runs instead (the same values, about 1.5x faster).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "pagesum_dispatch.h"

/* Whether `out` holds one uint32 per item (`what`: "page" or "row"); raises if not. */
static int holds_sums(Py_buffer *out, Py_ssize_t items, const char *what) {
    if (out->len == items * (Py_ssize_t)sizeof(uint32_t)) return 1;
    PyErr_Format(PyExc_ValueError, "out holds %zd bytes, expected %zd (uint32 per %s)", out->len,
                 items * (Py_ssize_t)sizeof(uint32_t), what);
    return 0;
}

static PyObject *page_sums(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    Py_ssize_t page;
    int portable = 0;
    if (!PyArg_ParseTuple(args, "y*nw*|p", &data, &page, &out, &portable)) return NULL;
    PyObject *result = NULL;
    if (page <= 0 || data.len % page) {
        PyErr_Format(PyExc_ValueError, "data of %zd bytes is not a whole number of %zd-byte pages", data.len, page);
        goto done;
    }
    Py_ssize_t pages = data.len / page;
    if (!holds_sums(&out, pages, "page")) goto done;
    const uint8_t *src = data.buf;
    uint32_t *dst = out.buf;
    Py_BEGIN_ALLOW_THREADS
    pagesum_pages(src, (size_t)page, (size_t)pages, dst, portable);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

/* The rows of a buffer of n rows of `length` bytes at `stride`: checks the arguments. */
static PyObject *uses_avx2(PyObject *self, PyObject *unused) { return PyBool_FromLong(pagesum_avx2); }

static PyMethodDef methods[] = {
    {"page_sums", page_sums, METH_VARARGS,
     "page_sums(data, page_bytes, out, portable=False): low 32 bits of XXH3-64 of each page into out "
     "(uint32); portable skips the AVX2 loop."},
    {"uses_avx2", uses_avx2, METH_NOARGS, "Whether the AVX2 loop is used."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pagesum", "Checksums of data pages.", -1, methods};

PyMODINIT_FUNC PyInit__pagesum(void) {
    pagesum_init();
    return PyModule_Create(&module);
}
