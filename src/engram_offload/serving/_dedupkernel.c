/*
 * Native dedup of a step's row ids: the sorted distinct ids and the inverse, in one call that
 * keeps the GIL for a step's few thousand ids.
 *
 * dedup(ids, unique, inverse) -> u, or -1
 *   ids      int64, any shape and strides (read in C order: a transposed view needs no copy)
 *   unique   int64 [n] contiguous (written): unique[:u] the sorted distinct ids
 *   inverse  int64 [n] contiguous (written): ids.reshape(-1)[i] == unique[inverse[i]]
 *   Returns -1 (nothing written) when the ids span more than 2**64 / n values: the caller
 *   then takes its NumPy path.
 *
 * Each id and its position pack into one 64-bit key ((id - min) << bits | position), sorted by
 * an LSD radix sort on the id part only: the sort is stable and the keys start in position
 * order, so the positions need no pass of their own. Digits are bytes, or up to 12 bits where
 * the ids outnumber the buckets (a step's 12,288 ids of an 8.5M-row table: 2 passes, where
 * bytes over the whole key took 5); a digit that is the same in every key is skipped. The
 * inverse falls out of the positions. The point is less the sort's speed than the GIL: NumPy's sort
 * and its ufuncs over a step's ids each let go of the GIL, and while the prefetch worker waits
 * for it, each let-go costs a thread switch (tens of microseconds on a virtual CPU), more
 * than the whole dedup. Large batches (a prefill's ids) release the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "strided.h"

#define NOGIL_MIN_IDS 65536 /* release the GIL from this many ids on (about 1 ms of work) */
static int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

#define MAX_DIGIT_BITS 12 /* up to 4,096 buckets a pass: the counts stay in the L2 cache */

/* The digit width of a sort of n keys by `bits` bits: bytes, or wider digits (fewer passes)
 * where n keys outnumber the buckets enough to pay for their counts. */
static int digit_bits(Py_ssize_t n, int bits) {
    int passes = (bits + MAX_DIGIT_BITS - 1) / MAX_DIGIT_BITS, d = passes ? (bits + passes - 1) / passes : 8;
    return d > 8 && ((Py_ssize_t)1 << d) * 2 <= n ? d : 8;
}

/* Bytes of the counts radix_sort needs: one bucket array a pass. */
static size_t counts_bytes(Py_ssize_t n, int bits) {
    int d = digit_bits(n, bits);
    return sizeof(Py_ssize_t) * (size_t)((bits + d - 1) / d) << d;
}

/* The most counts_bytes(n, bits) of any key width: the scratch to set aside before the ids'
 * span is known. */
static size_t counts_bytes_max(Py_ssize_t n) {
    size_t most = 0;
    for (int bits = 0; bits <= 64; bits++)
        if (counts_bytes(n, bits) > most) most = counts_bytes(n, bits);
    return most;
}

/* keys [n] sorted in place (tmp [n] scratch) by bits [shift, shift + bits), stably (keys equal
 * there keep their order); counts: counts_bytes(n, bits) of scratch. */
static void radix_sort(uint64_t *keys, uint64_t *tmp, Py_ssize_t *counts, Py_ssize_t n, int shift, int bits) {
    int d = digit_bits(n, bits), passes = (bits + d - 1) / d;
    uint64_t digit = ((uint64_t)1 << d) - 1;
    memset(counts, 0, counts_bytes(n, bits));
    for (Py_ssize_t i = 0; i < n; i++)
        for (int p = 0; p < passes; p++) counts[((Py_ssize_t)p << d) + (Py_ssize_t)((keys[i] >> (shift + d * p)) & digit)]++;
    uint64_t *src = keys, *dst = tmp;
    for (int p = 0; p < passes; p++) {
        Py_ssize_t *c = counts + ((Py_ssize_t)p << d), sum = 0;
        int at = shift + d * p;
        if (c[(src[0] >> at) & digit] == n) continue; /* one digit value everywhere */
        for (uint64_t b = 0; b <= digit; b++) {
            Py_ssize_t k = c[b];
            c[b] = sum;
            sum += k;
        }
        for (Py_ssize_t i = 0; i < n; i++) dst[c[(src[i] >> at) & digit]++] = src[i];
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != keys) memcpy(keys, src, (size_t)n * sizeof(uint64_t));
}

static PyObject *dedup(PyObject *module, PyObject *args) {
    PyObject *ids_o, *unique_o, *inverse_o;
    if (!PyArg_ParseTuple(args, "OOO", &ids_o, &unique_o, &inverse_o)) return NULL;
    Py_buffer ids, unique, inverse;
    if (PyObject_GetBuffer(ids_o, &ids, PyBUF_STRIDES | PyBUF_FORMAT) < 0) return NULL;
    if (PyObject_GetBuffer(unique_o, &unique, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    if (PyObject_GetBuffer(inverse_o, &inverse, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&ids);
        PyBuffer_Release(&unique);
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t *keys = NULL;
    Py_ssize_t n = ids.len / 8;
    if (!strided_int64_ok(&ids) || !strided_int64_ok(&unique) || !strided_int64_ok(&inverse)) {
        PyErr_Format(PyExc_TypeError, "dedup: ids (at most %d dimensions), unique and inverse must be int64 arrays",
                     STRIDED_MAX_DIMS);
        goto done;
    }
    if (unique.len != n * 8 || inverse.len != n * 8) {
        PyErr_Format(PyExc_ValueError, "dedup: unique and inverse must hold %zd ids each", n);
        goto done;
    }
    if (n == 0) {
        result = PyLong_FromLong(0);
        goto done;
    }
    /* keys [n], their sort's scratch [n], and its counts (for the widest keys it may sort) */
    keys = PyMem_RawMalloc((size_t)n * 2 * sizeof(uint64_t) + counts_bytes_max(n));
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    {
        PyThreadState *ts = n >= NOGIL_MIN_IDS ? PyEval_SaveThread() : NULL;
        int64_t lo = INT64_MAX, hi = INT64_MIN, *u = (int64_t *)unique.buf, *inv = (int64_t *)inverse.buf;
        strided_int64_copy(&ids, (int64_t *)keys);
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t v = (int64_t)keys[i];
            if (v < lo) lo = v;
            if (v > hi) hi = v;
        }
        int pos_bits = bit_length((uint64_t)(n - 1)), val_bits = bit_length((uint64_t)hi - (uint64_t)lo);
        Py_ssize_t count = -1;
        if (val_bits + pos_bits <= 64) {
            for (Py_ssize_t i = 0; i < n; i++) keys[i] = (((uint64_t)keys[i] - (uint64_t)lo) << pos_bits) | (uint64_t)i;
            /* keys in position order: stable on the ids */
            radix_sort(keys, keys + n, (Py_ssize_t *)(keys + 2 * n), n, pos_bits, val_bits);
            uint64_t mask = pos_bits ? (~0ULL >> (64 - pos_bits)) : 0, prev = keys[0] >> pos_bits;
            count = 0;
            u[0] = (int64_t)(prev + (uint64_t)lo);
            for (Py_ssize_t i = 0; i < n; i++) {
                uint64_t value = keys[i] >> pos_bits;
                if (value != prev) {
                    u[++count] = (int64_t)(value + (uint64_t)lo);
                    prev = value;
                }
                inv[keys[i] & mask] = count;
            }
            count++;
        }
        if (ts) PyEval_RestoreThread(ts);
        result = PyLong_FromSsize_t(count);
    }
done:
    PyMem_RawFree(keys);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&unique);
    PyBuffer_Release(&inverse);
    return result;
}

static PyMethodDef methods[] = {
    {"dedup", dedup, METH_VARARGS,
     "dedup(ids, unique, inverse) -> u: sorted distinct ids and the inverse (-1: ids span too wide a range)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dedupkernel", "Native dedup of row ids.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__dedupkernel(void) { return PyModule_Create(&module); }
