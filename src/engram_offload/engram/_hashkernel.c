/*
 * Native kernel for the Engram n-gram hash (SPEC section 3), with the GIL released for
 * large batches (a decode step's few windows hold it: a let-go with another thread waiting
 * costs a thread switch, more than hashing them).
 *
 * hash_windows(windows, multipliers, primes, magic, offsets, out, P, N, L, H)
 *   windows      int64 [P, N]      compressed id at lookback k of each position
 *   multipliers  int64 [L, N]      per layer, per lookback
 *   primes       int64 [L, N-1, H] head row counts
 *   magic        uint64 [L, N-1, H] floor(2**64 / prime)
 *   offsets      int64 [L, (N-1)*H] head offsets within the layer
 *   out          int64 [L, (N-1)*H, P] global-in-layer row ids (written)
 *
 * mix_n = XOR_{k<n} windows[p, k] * m[k] in wrapping int64 arithmetic (as NumPy does);
 * row = floor-mod(mix_n, prime) + offset. For mix >= 0 the quotient comes from one 64x64->128
 * multiply by the reciprocal `magic`, which is at most one below the true quotient, so a single
 * correction gives the exact remainder; negative mixes (negative ids pass through
 * uncompressed, as in the demo) take the plain division path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define NOGIL_MIN_WINDOWS 2048 /* release the GIL from this many windows on (about 0.5 ms of work) */
#include <stdlib.h>

static inline int64_t floor_mod(int64_t x, int64_t prime, uint64_t magic) {
    if (x >= 0) {
        uint64_t ux = (uint64_t)x;
        uint64_t q = (uint64_t)(((unsigned __int128)ux * magic) >> 64);
        uint64_t r = ux - q * (uint64_t)prime;
        if (r >= (uint64_t)prime) r -= (uint64_t)prime;
        return (int64_t)r;
    }
    int64_t r = x % prime;
    return r < 0 ? r + prime : r;
}

static int check_len(Py_buffer *b, Py_ssize_t items, const char *name) {
    if (b->len != items * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd", name, b->len,
                     items * (Py_ssize_t)sizeof(int64_t));
        return -1;
    }
    return 0;
}

static PyObject *hash_windows(PyObject *self, PyObject *args) {
    Py_buffer win, mult, primes, magic, offsets, out;
    Py_ssize_t P, N, L, H;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*w*nnnn", &win, &mult, &primes, &magic, &offsets, &out,
                          &P, &N, &L, &H))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t O = N - 1, C = O * H;
    int64_t *rolling = NULL;
    if (P < 0 || N < 2 || L < 1 || H < 1) {
        PyErr_SetString(PyExc_ValueError, "bad dimensions");
        goto done;
    }
    if (check_len(&win, P * N, "windows") || check_len(&mult, L * N, "multipliers") ||
        check_len(&primes, L * C, "primes") || check_len(&magic, L * C, "magic") ||
        check_len(&offsets, L * C, "offsets") || check_len(&out, L * C * P, "out"))
        goto done;
    rolling = (int64_t *)malloc((size_t)(P > 0 ? P : 1) * sizeof(int64_t));
    if (!rolling) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *w = (const int64_t *)win.buf, *m = (const int64_t *)mult.buf;
    const int64_t *pr = (const int64_t *)primes.buf, *off = (const int64_t *)offsets.buf;
    const uint64_t *mg = (const uint64_t *)magic.buf;
    int64_t *o = (int64_t *)out.buf;
    PyThreadState *ts = P >= NOGIL_MIN_WINDOWS ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t l = 0; l < L; l++) {
        const int64_t *ml = m + l * N;
        for (Py_ssize_t p = 0; p < P; p++)
            rolling[p] = (int64_t)((uint64_t)w[p * N] * (uint64_t)ml[0]);
        for (Py_ssize_t k = 1; k < N; k++) {
            for (Py_ssize_t p = 0; p < P; p++)
                rolling[p] ^= (int64_t)((uint64_t)w[p * N + k] * (uint64_t)ml[k]);
            for (Py_ssize_t h = 0; h < H; h++) {
                Py_ssize_t col = (k - 1) * H + h;
                int64_t prime = pr[l * C + col], shift = off[l * C + col];
                uint64_t mag = mg[l * C + col];
                int64_t *dst = o + (l * C + col) * P;
                for (Py_ssize_t p = 0; p < P; p++)
                    dst[p] = floor_mod(rolling[p], prime, mag) + shift;
            }
        }
    }
    if (ts) PyEval_RestoreThread(ts);
    result = Py_None;
    Py_INCREF(result);
done:
    free(rolling);
    PyBuffer_Release(&win);
    PyBuffer_Release(&mult);
    PyBuffer_Release(&primes);
    PyBuffer_Release(&magic);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *decode_windows(PyObject *self, PyObject *args) {
    Py_buffer hist, slots, comp, win;
    if (!PyArg_ParseTuple(args, "w*y*y*w*", &hist, &slots, &comp, &win)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t S = slots.len / (Py_ssize_t)sizeof(int64_t), N = S ? win.len / (S * (Py_ssize_t)sizeof(int64_t)) : 0;
    Py_ssize_t h = N - 1, rows = h > 0 ? hist.len / (h * (Py_ssize_t)sizeof(int64_t)) : 0;
    if (S && (N < 2 || check_len(&win, S * N, "windows") || check_len(&comp, S, "comp") ||
              check_len(&hist, rows * h, "history")))
        goto done;
    const int64_t *sl = (const int64_t *)slots.buf, *c = (const int64_t *)comp.buf;
    int64_t *hs = (int64_t *)hist.buf, *w = (int64_t *)win.buf;
    for (Py_ssize_t i = 0; i < S; i++) {
        if (sl[i] < 0 || sl[i] >= rows) {
            PyErr_Format(PyExc_IndexError, "slot %lld outside the history's %zd rows", (long long)sl[i], rows);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < S; i++) {
        int64_t *row = hs + sl[i] * h, *wi = w + i * N;
        wi[0] = c[i];
        for (Py_ssize_t k = 1; k < N; k++) wi[k] = row[h - k];
        for (Py_ssize_t k = 0; k + 1 < h; k++) row[k] = row[k + 1];
        row[h - 1] = c[i];
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&hist);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&comp);
    PyBuffer_Release(&win);
    return result;
}

static PyMethodDef methods[] = {
    {"hash_windows", hash_windows, METH_VARARGS,
     "hash_windows(windows, multipliers, primes, magic, offsets, out, P, N, L, H): Engram row ids."},
    {"decode_windows", decode_windows, METH_VARARGS,
     "decode_windows(history, slots, comp, windows): a decode step's windows; each slot's history moves on."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hashkernel",
                                    "Native Engram n-gram hash kernel.", -1, methods};

PyMODINIT_FUNC PyInit__hashkernel(void) { return PyModule_Create(&module); }
