/*
 * Native decode of fp8_e4m3_ue8m0 rows (SPEC row formats), with the GIL released for
 * large batches.
 *
 * decode_fp8(raw, head_dim, table, out[, index])
 *   raw    uint8 [m, head_dim + head_dim / 32]: 32-value blocks of float8_e4m3fn bytes, then
 *          one ue8m0 scale byte per block
 *   table  2- or 4-byte elements [65536]: the decoded value of (scale << 8) | fp8 byte, as
 *          the reference dequantizer computes it (rows._fp8_table), so a lookup is bit-exact
 *   out    [n, head_dim] of the table's element size (written): row i decodes raw row
 *          index[i] (int64 [n], bounds-checked before anything is written), or raw row i
 *          without an index (n = m)
 *
 * Each block reads one 256-entry slice of the table (its scale's), which stays in L1: a
 * lookup per value, no float arithmetic.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define NOGIL_MIN_ROWS 4096 /* release the GIL from this many rows on (about 0.3 ms of work): a let-go
                              * with another thread waiting costs a thread switch */

/* One clone per instruction set, picked when the module loads (gcc on x86-64): with AVX2
 * a block's 32 lookups vectorize to gathers, about twice the scalar loop's speed. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* decode16 and decode32: the same loop over 2- and 4-byte values (the table's element). */
#define DEFINE_DECODE(NAME, T)                                                                          \
    VECTOR_CLONES                                                                                       \
    static void NAME(const uint8_t *raw, const int64_t *index, Py_ssize_t n, Py_ssize_t d, Py_ssize_t rb, \
                     const T *restrict table, T *restrict out) {                                        \
        Py_ssize_t blocks = d / BLOCK;                                                                  \
        for (Py_ssize_t r = 0; r < n; r++) {                                                            \
            const uint8_t *restrict row = raw + (index ? index[r] : r) * rb;                            \
            T *restrict o = out + r * d;                                                                \
            for (Py_ssize_t b = 0; b < blocks; b++) {                                                   \
                const T *restrict slice = table + ((Py_ssize_t)row[d + b] << 8);                        \
                const uint8_t *restrict v = row + b * BLOCK;                                            \
                for (int i = 0; i < BLOCK; i++) o[b * BLOCK + i] = slice[v[i]];                         \
            }                                                                                           \
        }                                                                                               \
    }

DEFINE_DECODE(decode16, uint16_t)
DEFINE_DECODE(decode32, uint32_t)

static PyObject *decode_fp8(PyObject *module, PyObject *args) {
    PyObject *raw_o, *table_o, *out_o, *index_o = Py_None;
    Py_ssize_t d;
    if (!PyArg_ParseTuple(args, "OnOO|O", &raw_o, &d, &table_o, &out_o, &index_o)) return NULL;
    if (d <= 0 || d % BLOCK) {
        PyErr_Format(PyExc_ValueError, "decode_fp8: head_dim must be a positive multiple of %d, got %zd", BLOCK, d);
        return NULL;
    }
    Py_buffer raw, table, out, index;
    int have_index = index_o != Py_None;
    if (PyObject_GetBuffer(raw_o, &raw, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(table_o, &table, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&raw);
        return NULL;
    }
    if (PyObject_GetBuffer(out_o, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&raw);
        PyBuffer_Release(&table);
        return NULL;
    }
    if (have_index && PyObject_GetBuffer(index_o, &index, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&raw);
        PyBuffer_Release(&table);
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t rb = d + d / BLOCK;
    Py_ssize_t m = raw.len / rb;
    Py_ssize_t esize = table.len / 65536;
    Py_ssize_t n = m;
    const int64_t *idx = NULL;
    if (raw.len != m * rb) {
        PyErr_Format(PyExc_ValueError, "decode_fp8: raw holds %zd bytes, not whole %zd-byte rows", raw.len, rb);
        goto done;
    }
    if (table.len != 65536 * esize || (esize != 2 && esize != 4)) {
        PyErr_SetString(PyExc_ValueError, "decode_fp8: table must hold 65536 values of 2 or 4 bytes");
        goto done;
    }
    if (have_index) {
        if (index.itemsize != 8 || index.ndim != 1 || index.format == NULL || strchr("qlQL", index.format[strlen(index.format) - 1]) == NULL) {
            PyErr_SetString(PyExc_TypeError, "decode_fp8: index must be a 1-d contiguous int64 array");
            goto done;
        }
        idx = (const int64_t *)index.buf;
        n = index.len / 8;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (idx[i] < 0 || idx[i] >= m) {
                PyErr_Format(PyExc_IndexError, "decode_fp8: index %lld (position %zd) outside the %zd raw rows",
                             (long long)idx[i], i, m);
                goto done;
            }
        }
    }
    if (out.len != n * d * esize) {
        PyErr_Format(PyExc_ValueError, "decode_fp8: out holds %zd bytes, expected %zd (%zd rows of %zd values)",
                     out.len, n * d * esize, n, d);
        goto done;
    }
    {
        PyThreadState *ts = n >= NOGIL_MIN_ROWS ? PyEval_SaveThread() : NULL;
        if (esize == 2)
            decode16((const uint8_t *)raw.buf, idx, n, d, rb, (const uint16_t *)table.buf, (uint16_t *)out.buf);
        else
            decode32((const uint8_t *)raw.buf, idx, n, d, rb, (const uint32_t *)table.buf, (uint32_t *)out.buf);
        if (ts) PyEval_RestoreThread(ts);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&raw);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    if (have_index) PyBuffer_Release(&index);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_fp8", decode_fp8, METH_VARARGS,
     "decode_fp8(raw, head_dim, table, out[, index]): fp8_e4m3_ue8m0 rows (raw[index]) -> values by table lookup."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowdecode", "Native decode of fp8 rows.", -1, methods};

PyMODINIT_FUNC PyInit__rowdecode(void) { return PyModule_Create(&module); }
