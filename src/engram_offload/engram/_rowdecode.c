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
 *          index[i] - index_base (index: int64 of any shape and strides, read in C order and
 *          bounds-checked before anything is written, so a strided view of a step's inverse
 *          needs no copy), or raw row i without an index (n = m)
 *
 * Each block reads one 256-entry slice of the table (its scale's), which stays in L1: a
 * lookup per value, no float arithmetic.
 *
 * decode_fp8(..., stores, slots): row position p (index - index_base, or p < n without an
 *   index) is raw row slots[p] (int64 [u], each checked): rows left in a cache's arena.
 *
 * decode_fp8(..., stores) -> streamed: stores 0 (auto) streams a float32 arithmetic decode's
 *   stores from STREAM_MIN_BYTES of out on, 1 never, 2 always (each only when out is
 *   STREAM_ALIGN-aligned); the result says whether it did.
 *
 * decode_fp8(..., index, arithmetic=1) with the float32 table computes float32 values instead
 * of looking them up (no gathers: up to 4x as fast, less where memory bounds it), bit for bit
 * the table's, with AVX-512 or else AVX2 (arithmetic=2: AVX2 even where AVX-512 is there;
 * arithmetic_path(mode) names the path a mode takes on this CPU). The fp8
 * value is built exactly as a normal float32 first: a normal byte's 7 low bits shifted into a
 * float32's exponent and mantissa fields, plus 120 in the exponent (fp8's bias 7 against
 * float32's 127), and a subnormal byte's mantissa m as m * 2**-9. One multiply by
 * 2**(scale - 127) then rounds once, as the reference's fp8 * 2**(scale - 127) does. No
 * operand is ever a float32 subnormal: on Intel cores each vector multiply with one takes a
 * microcode assist (about a hundred cycles), which made this decode 4x slower there than on
 * AMD cores. Blocks the arithmetic does not cover take the table: a NaN byte, scale byte 0
 * (0.0) or 255 (inf), and every block when the CPU flushes subnormals (MXCSR's FTZ or DAZ
 * set: a product can still be subnormal, and must be kept).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "strided.h"

#define BLOCK 32
#define NOGIL_MIN_ROWS 4096 /* release the GIL from this many rows on (about 0.3 ms of work): a let-go
                              * with another thread waiting costs a thread switch */

/* Rows picked by an index lie anywhere in a large arena (a row cache): the row this many
 * picks ahead is asked into the cache while this one decodes, which would otherwise wait on
 * memory line by line (a row on a 200 MB arena decoded in 0.21 us, 0.08 with this). Always
 * inlined: a call gcc did not inline into the per-target clones was dropped as having no
 * effect (a prefetch has none it can see). */
#define PREFETCH_ROWS 8

enum { ARITH_TABLE = 0, ARITH_AVX2 = 1, ARITH_AVX512 = 2 };

/* Streaming (non-temporal) stores write the float32 rows to memory without reading their
 * cache lines first, and leave the caches to what is read again. An output this large
 * is not read again from the caches anyway (a step's rows are consumed after the next
 * step's are decoded, or copied to a GPU): on an AMD EPYC (Zen 3) VM, filling 12 MB took
 * half the time this way, 1 MB a third longer (it stays in the caches otherwise). The
 * stores need `out` aligned to STREAM_ALIGN bytes (a row is a multiple of 128). */
#define STREAM_MIN_BYTES (4 << 20)
#define STREAM_ALIGN 64
enum { STORES_AUTO = 0, STORES_CACHED = 1, STORES_STREAMING = 2 };
static const char *const ARITH_NAMES[] = {"table", "avx2", "avx512"};

static inline __attribute__((always_inline)) void prefetch_row(const uint8_t *raw, const int64_t *index, Py_ssize_t r, Py_ssize_t n,
                                Py_ssize_t rb) {
    if (!index || r + PREFETCH_ROWS >= n) return;
    const uint8_t *row = raw + index[r + PREFETCH_ROWS] * rb;
    for (Py_ssize_t off = 0; off < rb; off += 64) __builtin_prefetch(row + off, 0, 3);
    __builtin_prefetch(row + rb - 1, 0, 3);
}

/* One clone per instruction set, picked when the module loads (gcc on x86-64): with AVX2
 * a block's 32 lookups vectorize to gathers, about twice the scalar loop's speed. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* One loop over the rows for every decode: ATTR (the function's target attribute), T (the
 * table's element, 2 or 4 bytes), and the block functions COVERED(v, scale) (the block is
 * computed by DECODE_BLOCK(v, scale, o)) and DECODE_BLOCK; a block not covered is looked up,
 * 32 values in a 256-entry slice of the table (its scale's). */
#define DEFINE_ROWS(NAME, ATTR, T, COVERED, DECODE_BLOCK)                                               \
    ATTR static void NAME(const uint8_t *raw, const int64_t *index, Py_ssize_t n, Py_ssize_t d,         \
                          Py_ssize_t rb, const T *restrict table, T *restrict out) {                    \
        Py_ssize_t blocks = d / BLOCK;                                                                  \
        for (Py_ssize_t r = 0; r < n; r++) {                                                            \
            prefetch_row(raw, index, r, n, rb);                                                         \
            const uint8_t *restrict row = raw + (index ? index[r] : r) * rb;                            \
            T *restrict o = out + r * d;                                                                \
            for (Py_ssize_t b = 0; b < blocks; b++) {                                                   \
                const uint8_t *restrict v = row + b * BLOCK;                                            \
                uint32_t scale = row[d + b];                                                            \
                if (COVERED(v, scale)) {                                                                \
                    DECODE_BLOCK(v, scale, o + b * BLOCK);                                              \
                } else {                                                                                \
                    const T *restrict slice = table + ((Py_ssize_t)scale << 8);                         \
                    for (int i = 0; i < BLOCK; i++) o[b * BLOCK + i] = slice[v[i]];                     \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

/* decode16 and decode32: every block looked up. */
#define NO_BLOCK(v, scale) 0
#define NOTHING(v, scale, o) ((void)0)
#define DEFINE_DECODE(NAME, T) DEFINE_ROWS(NAME, VECTOR_CLONES, T, NO_BLOCK, NOTHING)

DEFINE_DECODE(decode16, uint16_t)
DEFINE_DECODE(decode32, uint32_t)

static inline float float_of_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>

#define AVX512 "avx512f,avx512bw,avx512vl"

/* The float32 rows by arithmetic (see the header comment): per block one multiply by
 * 2**(scale - 127), the fp8 values built as normal float32s before it. Blocks it does not
 * cover take the table: a NaN byte, scale 0 or 255. */
#define ARITHMETIC_COVERS(NAN_IN_BLOCK, v, scale) ((scale) != 0 && (scale) != 255 && !NAN_IN_BLOCK(v))
#define COVERED_AVX512(v, scale) ARITHMETIC_COVERS(nan_in_block_avx512, v, scale)
#define COVERED_AVX2(v, scale) ARITHMETIC_COVERS(nan_in_block_avx2, v, scale)

/* AVX-512: 16 values an instruction, the subnormal bytes' lanes multiplied under a mask. */
__attribute__((target(AVX512), always_inline)) static inline int nan_in_block_avx512(const uint8_t *v) {
    __m256i bytes = _mm256_loadu_si256((const __m256i *)v), nan_byte = _mm256_set1_epi8(0x7F);
    return _mm256_cmpeq_epi8_mask(_mm256_and_si256(bytes, nan_byte), nan_byte) != 0;
}

__attribute__((target(AVX512), always_inline)) static inline void block_avx512(const uint8_t *v, uint32_t scale, uint32_t *o, int stream) {
    const __m512i low7 = _mm512_set1_epi32(0x7F), sign_bit = _mm512_set1_epi32(0x80);
    const __m512i exponent = _mm512_set1_epi32(0x78), mantissa = _mm512_set1_epi32(0x07);
    const __m512i rebias = _mm512_set1_epi32(120 << 23);
    const __m512 subnormal_unit = _mm512_set1_ps(0x1p-9f);
    __m512 k = _mm512_set1_ps(float_of_bits(scale << 23)); /* 2**(scale - 127), normal for 1..254 */
    for (int half = 0; half < 2; half++) {
        __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(v + 16 * half)));
        /* |fp8| of a normal byte: 2**(e - 7) * (1 + m / 8), its float32 exponent e + 120 */
        __m512 value = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(x, low7), 20), rebias));
        /* a subnormal byte (exponent 0): m * 2**-9, exact (zero for m = 0) */
        __mmask16 subnormal = _mm512_testn_epi32_mask(x, exponent);
        value = _mm512_mask_mul_ps(value, subnormal, _mm512_cvtepi32_ps(_mm512_and_si512(x, mantissa)), subnormal_unit);
        __m512 f = _mm512_mul_ps(value, k);
        __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, sign_bit), 24);
        __m512i bits = _mm512_or_si512(_mm512_castps_si512(f), sign);
        if (stream)
            _mm512_stream_si512((void *)(o + 16 * half), bits);
        else
            _mm512_storeu_si512((void *)(o + 16 * half), bits);
    }
}

/* AVX2: 8 values an instruction, no mask registers: the subnormal bytes' values are computed
 * for every lane and blended in; no multiply sees a subnormal operand either. Without it an
 * AVX2-only CPU took the table's gathers: on an AMD EPYC (Zen 3) VM a row took 0.70-0.80x
 * the table's time this way (0.14 against 0.20 us from a 2 MB block, 0.33 against 0.42 from a
 * 200 MB one, 12,288 random rows a call: the writes of the float32 rows bound both). */
__attribute__((target("avx2"), always_inline)) static inline int nan_in_block_avx2(const uint8_t *v) {
    __m256i bytes = _mm256_loadu_si256((const __m256i *)v), nan_byte = _mm256_set1_epi8(0x7F);
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, nan_byte), nan_byte)) != 0;
}

__attribute__((target("avx2"), always_inline)) static inline void block_avx2(const uint8_t *v, uint32_t scale, uint32_t *o, int stream) {
    const __m256i low7 = _mm256_set1_epi32(0x7F), sign_bit = _mm256_set1_epi32(0x80);
    const __m256i exponent = _mm256_set1_epi32(0x78), mantissa = _mm256_set1_epi32(0x07);
    const __m256i rebias = _mm256_set1_epi32(120 << 23), zero = _mm256_setzero_si256();
    const __m256 subnormal_unit = _mm256_set1_ps(0x1p-9f);
    __m256 k = _mm256_set1_ps(float_of_bits(scale << 23));
    for (int part = 0; part < 4; part++) {
        __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(v + 8 * part)));
        __m256 value = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(x, low7), 20), rebias));
        __m256 small = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(x, mantissa)), subnormal_unit);
        __m256i subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(x, exponent), zero);
        value = _mm256_blendv_ps(value, small, _mm256_castsi256_ps(subnormal));
        __m256 f = _mm256_mul_ps(value, k);
        __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, sign_bit), 24);
        __m256i bits = _mm256_or_si256(_mm256_castps_si256(f), sign);
        if (stream)
            _mm256_stream_si256((__m256i *)(o + 8 * part), bits);
        else
            _mm256_storeu_si256((__m256i *)(o + 8 * part), bits);
    }
}

/* Each with cached stores, and with streaming ones (out 64-byte aligned: see STREAM_MIN_BYTES). */
#define BLOCK_AVX512(v, scale, o) block_avx512(v, scale, o, 0)
#define BLOCK_AVX512_STREAM(v, scale, o) block_avx512(v, scale, o, 1)
#define BLOCK_AVX2(v, scale, o) block_avx2(v, scale, o, 0)
#define BLOCK_AVX2_STREAM(v, scale, o) block_avx2(v, scale, o, 1)
DEFINE_ROWS(decode32_arithmetic, __attribute__((target(AVX512))), uint32_t, COVERED_AVX512, BLOCK_AVX512)
DEFINE_ROWS(decode32_arithmetic_stream, __attribute__((target(AVX512))), uint32_t, COVERED_AVX512, BLOCK_AVX512_STREAM)
DEFINE_ROWS(decode32_arithmetic_avx2, __attribute__((target("avx2"))), uint32_t, COVERED_AVX2, BLOCK_AVX2)
DEFINE_ROWS(decode32_arithmetic_avx2_stream, __attribute__((target("avx2"))), uint32_t, COVERED_AVX2, BLOCK_AVX2_STREAM)

/* The vector unit a decode asking for `mode` may use on this CPU: ARITH_TABLE (none: the
 * table's lookups), ARITH_AVX2 or ARITH_AVX512. Mode 1 takes the widest the CPU has, mode 2
 * AVX2 even where AVX-512 is there (so that both are tested on one machine). */
static int vector_path(int mode) {
    if (mode <= 0) return ARITH_TABLE;
    if (mode == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return ARITH_AVX512;
    return __builtin_cpu_supports("avx2") ? ARITH_AVX2 : ARITH_TABLE;
}

/* Streaming stores are weakly ordered: fenced before the rows are handed on. */
static void store_fence(void) { _mm_sfence(); }
#else
static void decode32_arithmetic(const uint8_t *raw, const int64_t *index, Py_ssize_t n, Py_ssize_t d,
                                Py_ssize_t rb, const uint32_t *restrict table, uint32_t *restrict out) {
    decode32(raw, index, n, d, rb, table, out);
}
static void decode32_arithmetic_avx2(const uint8_t *raw, const int64_t *index, Py_ssize_t n, Py_ssize_t d,
                                     Py_ssize_t rb, const uint32_t *restrict table, uint32_t *restrict out) {
    decode32(raw, index, n, d, rb, table, out);
}
#define decode32_arithmetic_stream decode32_arithmetic
#define decode32_arithmetic_avx2_stream decode32_arithmetic_avx2
static void store_fence(void) {}
static int vector_path(int mode) { (void)mode; return ARITH_TABLE; }
#endif

/* Whether the CPU keeps subnormals (the arithmetic path needs them as IEEE has them). */
static int keeps_subnormals(void) {
#if defined(__x86_64__)
    return (_mm_getcsr() & 0x8040) == 0; /* FTZ (bit 15) and DAZ (bit 6) clear */
#else
    return 0;
#endif
}

/* The path a float32 decode asking for `mode` takes now: the CPU's vector unit for it, or the
 * table's lookups while the CPU flushes subnormals. */
static int arithmetic_path(int mode) { return keeps_subnormals() ? vector_path(mode) : ARITH_TABLE; }

/* Whether a float32 arithmetic decode into `out` (`nbytes` of it) streams its stores. */
static int streams(int stores, const void *out, Py_ssize_t nbytes) {
    if (stores == STORES_CACHED || ((uintptr_t)out % STREAM_ALIGN) != 0) return 0;
    return stores == STORES_STREAMING || nbytes >= STREAM_MIN_BYTES;
}

static PyObject *decode_fp8(PyObject *module, PyObject *args) {
    PyObject *raw_o, *table_o, *out_o, *index_o = Py_None, *slots_o = Py_None;
    Py_ssize_t d;
    int arithmetic = 0, stores = STORES_AUTO;
    long long index_base = 0;
    if (!PyArg_ParseTuple(args, "OnOO|OiLiO", &raw_o, &d, &table_o, &out_o, &index_o, &arithmetic, &index_base,
                          &stores, &slots_o))
        return NULL;
    if (stores < STORES_AUTO || stores > STORES_STREAMING) {
        PyErr_Format(PyExc_ValueError, "decode_fp8: stores must be 0 (auto), 1 (cached) or 2 (streaming), got %d",
                     stores);
        return NULL;
    }
    if (d <= 0 || d % BLOCK) {
        PyErr_Format(PyExc_ValueError, "decode_fp8: head_dim must be a positive multiple of %d, got %zd", BLOCK, d);
        return NULL;
    }
    Py_buffer raw, table, out, index, slots;
    int have_index = index_o != Py_None, have_slots = slots_o != Py_None;
    int path = arithmetic_path(arithmetic);
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
    if (have_index && PyObject_GetBuffer(index_o, &index, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&raw);
        PyBuffer_Release(&table);
        PyBuffer_Release(&out);
        return NULL;
    }
    if (have_slots && PyObject_GetBuffer(slots_o, &slots, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&raw);
        PyBuffer_Release(&table);
        PyBuffer_Release(&out);
        if (have_index) PyBuffer_Release(&index);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t rb = d + d / BLOCK;
    Py_ssize_t m = raw.len / rb;
    Py_ssize_t esize = table.len / 65536;
    Py_ssize_t n = m;
    const int64_t *idx = NULL;
    int64_t *picks = NULL;
    if (raw.len != m * rb) {
        PyErr_Format(PyExc_ValueError, "decode_fp8: raw holds %zd bytes, not whole %zd-byte rows", raw.len, rb);
        goto done;
    }
    if (table.len != 65536 * esize || (esize != 2 && esize != 4)) {
        PyErr_SetString(PyExc_ValueError, "decode_fp8: table must hold 65536 values of 2 or 4 bytes");
        goto done;
    }
    if (path != ARITH_TABLE && esize != 4) {
        PyErr_SetString(PyExc_ValueError, "decode_fp8: arithmetic decodes to float32 only (a 4-byte table)");
        goto done;
    }
    if (have_slots && (!strided_int64_ok(&slots) || slots.ndim != 1)) {
        PyErr_SetString(PyExc_TypeError, "decode_fp8: slots must be a 1-d int64 array");
        goto done;
    }
    if (have_index || have_slots) {
        if (have_index && !strided_int64_ok(&index)) {
            PyErr_Format(PyExc_TypeError, "decode_fp8: index must be a strided int64 array of at most %d dimensions",
                         STRIDED_MAX_DIMS);
            goto done;
        }
        /* positions: index - index_base, or 0..len(slots) - 1; each a raw row, or a slot's */
        Py_ssize_t positions = have_slots ? slots.len / 8 : m;
        n = have_index ? index.len / 8 : positions;
        picks = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
        if (picks == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        if (have_index) {
            strided_int64_copy(&index, picks);
        } else {
            for (Py_ssize_t i = 0; i < n; i++) picks[i] = (int64_t)i + (int64_t)index_base;
        }
        for (Py_ssize_t i = 0; i < n; i++) { /* less the base, through the slots, checked */
            picks[i] -= (int64_t)index_base;
            if (picks[i] < 0 || picks[i] >= positions) {
                PyErr_Format(PyExc_IndexError, "decode_fp8: index %lld (position %zd) outside the %zd %s",
                             (long long)(picks[i] + index_base), i, positions, have_slots ? "slots" : "raw rows");
                goto done;
            }
            if (have_slots) {
                int64_t slot = *(const int64_t *)((const char *)slots.buf + picks[i] * slots.strides[0]);
                if (slot < 0 || slot >= m) {
                    PyErr_Format(PyExc_IndexError, "decode_fp8: slot %lld (position %zd) outside the %zd raw rows",
                                 (long long)slot, (Py_ssize_t)picks[i], m);
                    goto done;
                }
                picks[i] = slot;
            }
        }
        idx = picks;
    }
    if (out.len != n * d * esize) {
        PyErr_Format(PyExc_ValueError, "decode_fp8: out holds %zd bytes, expected %zd (%zd rows of %zd values)",
                     out.len, n * d * esize, n, d);
        goto done;
    }
    int stream = esize == 4 && path != ARITH_TABLE && streams(stores, out.buf, out.len);
    {
        PyThreadState *ts = n >= NOGIL_MIN_ROWS ? PyEval_SaveThread() : NULL;
        const uint8_t *r = (const uint8_t *)raw.buf;
        const uint32_t *t32 = (const uint32_t *)table.buf;
        uint32_t *o32 = (uint32_t *)out.buf;
        if (esize == 2)
            decode16(r, idx, n, d, rb, (const uint16_t *)table.buf, (uint16_t *)out.buf);
        else if (path == ARITH_AVX512)
            (stream ? decode32_arithmetic_stream : decode32_arithmetic)(r, idx, n, d, rb, t32, o32);
        else if (path == ARITH_AVX2)
            (stream ? decode32_arithmetic_avx2_stream : decode32_arithmetic_avx2)(r, idx, n, d, rb, t32, o32);
        else
            decode32(r, idx, n, d, rb, t32, o32);
        if (stream) store_fence();
        if (ts) PyEval_RestoreThread(ts);
    }
    result = PyBool_FromLong(stream);
done:
    PyMem_Free(picks);
    PyBuffer_Release(&raw);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    if (have_index) PyBuffer_Release(&index);
    if (have_slots) PyBuffer_Release(&slots);
    return result;
}

static PyObject *arithmetic_path_name(PyObject *module, PyObject *args) {
    int mode = 1;
    if (!PyArg_ParseTuple(args, "|i", &mode)) return NULL;
    return PyUnicode_FromString(ARITH_NAMES[arithmetic_path(mode)]);
}

static PyMethodDef methods[] = {
    {"arithmetic_path", arithmetic_path_name, METH_VARARGS,
     "arithmetic_path(mode=1) -> 'avx512', 'avx2' or 'table': how a float32 decode_fp8 with this "
     "arithmetic mode runs now (the CPU's vector units, and 'table' while it flushes subnormals)."},
    {"decode_fp8", decode_fp8, METH_VARARGS,
     "decode_fp8(raw, head_dim, table, out[, index[, arithmetic[, index_base[, stores[, slots]]]]]) -> streamed: "
     "fp8_e4m3_ue8m0 rows (raw[index - index_base], or raw[slots[index - index_base]]) -> "
     "values by table lookup (arithmetic: float32 values computed, bit for bit the float32 table's; "
     "stores 0 auto, 1 cached, 2 streaming: whether those are written by streaming stores)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowdecode", "Native decode of fp8 rows.", -1, methods};

PyMODINIT_FUNC PyInit__rowdecode(void) { return PyModule_Create(&module); }
