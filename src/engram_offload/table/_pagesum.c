/*
 * The page checksums of table format version 2: the low 32 bits of XXH3-64 (seed 0) of
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

#if defined(__x86_64__) && defined(__GNUC__)
void engram_page_sums_avx2(const uint8_t *src, size_t page, size_t pages, uint32_t *dst);
static int use_avx2(void) { return __builtin_cpu_supports("avx2"); }
#else
static void engram_page_sums_avx2(const uint8_t *src, size_t page, size_t pages, uint32_t *dst) {}
static int use_avx2(void) { return 0; }
#endif

static int avx2;

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
    if (out.len != pages * (Py_ssize_t)sizeof(uint32_t)) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, expected %zd (uint32 per page)", out.len,
                     pages * (Py_ssize_t)sizeof(uint32_t));
        goto done;
    }
    const uint8_t *src = data.buf;
    uint32_t *dst = out.buf;
    Py_BEGIN_ALLOW_THREADS
    if (avx2 && !portable)
        engram_page_sums_avx2(src, (size_t)page, (size_t)pages, dst);
    else
        for (Py_ssize_t i = 0; i < pages; i++) dst[i] = (uint32_t)XXH3_64bits(src + i * page, (size_t)page);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *uses_avx2(PyObject *self, PyObject *unused) { return PyBool_FromLong(avx2); }

static PyMethodDef methods[] = {
    {"page_sums", page_sums, METH_VARARGS,
     "page_sums(data, page_bytes, out, portable=False): low 32 bits of XXH3-64 of each page into out "
     "(uint32); portable skips the AVX2 loop."},
    {"uses_avx2", uses_avx2, METH_NOARGS, "Whether the AVX2 loop is used."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pagesum", "Checksums of data pages.", -1, methods};

PyMODINIT_FUNC PyInit__pagesum(void) {
    avx2 = use_avx2();
    return PyModule_Create(&module);
}
