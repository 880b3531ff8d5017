/*
 * Native hit path of one row cache level: the bookkeeping of a lookup in one call.
 *
 * HitPath(kind, index_keys, index_values, bits, ready, pins, stamp, count, max_count)
 *   binds the arrays of one RowCache once (they are only ever modified in place):
 *   kind         0: DirectIndex (index_values int32 or int64 [num_keys], index_keys None)
 *                1: RowIndex    (index_keys int64 [2**bits], index_values int64 [2**bits])
 *   ready        bool  [capacity + 1]  (the last entry stays False)
 *   pins         int32 [capacity]
 *   stamp        int64 [capacity]      the policy's clock at each slot's last access
 *   count        int64 [capacity] or None: LFU counts (None: LRU, stamps only)
 *   pins, stamp and count may be strided (fields of one record per slot, as RowCache lays
 *   them out, so that a hit dirties one cache line rather than three).
 *
 * acquire(ids, slots, clock[, rows, out, pin]) -> hits
 *   ids int64 [n] (distinct), slots int64 [n] (written: slot of each id, -1 for a miss).
 *   Every hit slot is pinned (pins += 1) and touched like the NumPy policies do:
 *   stamp = clock, and for LFU count = min(count + 1, max_count). The caller advances the
 *   policy's clock and ages its counts (both once per call that hit, as the policies do).
 *   An id outside a direct index raises IndexError and changes nothing.
 *   With rows (the cache's bytes, [capacity, row_bytes]) and out ([n, row_bytes]): when
 *   every id hits, their rows are copied into out while the caller's lock is still held, so
 *   the slots need no pin for the copy; pin=0 then leaves them unpinned. When some id
 *   misses, out is not written and the hits are pinned as usual.
 * victims(count, slot_id, out[, upper]) -> k
 *   The k = min(count, evictable) evictable slots (slot_id >= 0, not pinned) with the lowest
 *   scores into out (int64 [count]): with v the count-th lowest score, every slot scoring
 *   below v, then slots scoring v up to count, each group in slot order (the same slots, in
 *   the same order, as EvictionPolicy.victims). Scores are the policies' (cache/policy.py):
 *   LRU the stamp, LFU (count << 40) | (stamp & (2**40 - 1)). Without the GIL. In a cache of
 *   16,384 slots or more, one pass over the slots where a sample of 4,096 of them bounds the
 *   scores to keep (victims_sampled: the sample decides the speed, never the victims); else,
 *   or where the sample does not settle it, two passes (a histogram of 65,536 score buckets;
 *   the slots below the bucket where `count` is reached, and that bucket's, whose scores give
 *   v by a radix select), three without `upper` (an upper bound on every score: the
 *   policy's score_bound()).
 * release(slots) -> released
 *   Unpins slots (-1 entries skipped). When a slot is not pinned, nothing changes and -1 is
 *   returned (the caller raises, naming its cache).
 * split_slots(ids, slots, row_bytes, hit_slots, hit_src, hit_dst, miss_ids, miss_dst) -> hits
 *   A lookup's result taken apart for the copies that follow it: for each hit (slots[i] >= 0),
 *   in order, its slot, its byte offset in the cache's rows (slot * row_bytes) and in the
 *   fetch's rows (i * row_bytes); for each miss its id and byte offset in the fetch's rows.
 *   All int64 [n] (the first `hits`, resp. n - hits, entries written). NumPy's masks and
 *   products would let go of the GIL half a dozen times (a thread switch each while
 *   another thread waits for it).
 * sorted_in_range(ids, limit) -> bool
 *   Whether ids (a 1-d contiguous int64 array) are strictly increasing within [0, limit):
 *   the check a fetch of sorted distinct ids needs. False for anything else (no error).
 *
 * Not thread-safe: the owning cache holds its lock around every call. The GIL is released
 * for large batches only; for a few thousand ids the call takes microseconds, less than
 * handing the GIL to another thread and waiting to get it back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "int_arrays.h"

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define EMPTY_KEY (-1)
#define AHEAD 8               /* rows looked ahead when prefetching row copies */
#define NOGIL_MIN_IDS 16384   /* release the GIL from this many ids on */

typedef struct {
    PyObject_HEAD
    Py_buffer keys, values, ready, pins, stamp, count;
    int kind, have_keys, have_count, values32, bits;
    Py_ssize_t num_values, capacity, pins_stride, stamp_stride, count_stride;
    uint64_t mask;
    int64_t max_count;
} HitPath;

/* A 1-d array of `itemsize`-byte integers with any stride (writable). */
static int get_strided(PyObject *obj, Py_buffer *b, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, b, PyBUF_RECORDS) < 0) return -1;
    if (b->ndim != 1 || !int_format(b, itemsize) || b->strides == NULL || b->strides[0] < itemsize ||
        b->suboffsets != NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-d array of %zd-byte integers with a positive stride",
                     name, itemsize);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

#define AT(buf, stride, i, T) (*(T *)((char *)(buf) + (i) * (stride)))

static void hp_dealloc(HitPath *self) {
    if (self->have_keys) PyBuffer_Release(&self->keys);
    if (self->values.obj) PyBuffer_Release(&self->values);
    if (self->ready.obj) PyBuffer_Release(&self->ready);
    if (self->pins.obj) PyBuffer_Release(&self->pins);
    if (self->stamp.obj) PyBuffer_Release(&self->stamp);
    if (self->have_count) PyBuffer_Release(&self->count);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int hp_init(HitPath *self, PyObject *args, PyObject *kw) {
    int kind, bits;
    PyObject *keys, *values, *ready, *pins, *stamp, *count;
    long long max_count;
    if (self->values.obj) {
        PyErr_SetString(PyExc_RuntimeError, "HitPath is already bound");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "iOOiOOOOL", &kind, &keys, &values, &bits, &ready, &pins, &stamp, &count,
                          &max_count))
        return -1;
    if (kind != 0 && kind != 1) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (direct) or 1 (hash)");
        return -1;
    }
    self->kind = kind;
    if (kind == 0) {
        Py_buffer probe;
        if (PyObject_GetBuffer(values, &probe, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
        Py_ssize_t isz = probe.itemsize;
        PyBuffer_Release(&probe);
        if (get_array(values, &self->values, isz == 4 ? 4 : 8, 0, "index values") < 0) return -1;
        self->values32 = isz == 4;
    } else {
        if (bits < 1 || bits > 62) {
            PyErr_SetString(PyExc_ValueError, "bad hash table bits");
            return -1;
        }
        if (get_array(keys, &self->keys, 8, 0, "index keys") < 0) return -1;
        self->have_keys = 1;
        if (get_array(values, &self->values, 8, 0, "index values") < 0) return -1;
        if (self->keys.len != ((Py_ssize_t)8 << bits) || self->values.len != self->keys.len) {
            PyErr_SetString(PyExc_ValueError, "hash index arrays do not match its bits");
            return -1;
        }
        self->bits = bits;
        self->mask = ((uint64_t)1 << bits) - 1;
    }
    self->num_values = self->values.len / self->values.itemsize;
    if (get_strided(pins, &self->pins, 4, "pins") < 0) return -1;
    self->capacity = self->pins.shape[0];
    self->pins_stride = self->pins.strides[0];
    if (get_array(ready, &self->ready, 1, 0, "ready") < 0) return -1;
    if (get_strided(stamp, &self->stamp, 8, "stamp") < 0) return -1;
    self->stamp_stride = self->stamp.strides[0];
    if (self->ready.len != self->capacity + 1 || self->stamp.shape[0] != self->capacity) {
        PyErr_SetString(PyExc_ValueError, "ready must hold capacity + 1 entries and stamp capacity");
        return -1;
    }
    if (count != Py_None) {
        if (get_strided(count, &self->count, 8, "count") < 0) return -1;
        self->have_count = 1;
        self->count_stride = self->count.strides[0];
        if (self->count.shape[0] != self->capacity) {
            PyErr_SetString(PyExc_ValueError, "count must hold capacity entries");
            return -1;
        }
    }
    self->max_count = max_count;
    return 0;
}

static inline int64_t hash_find(const HitPath *self, int64_t key) {
    if (key < 0) return -1;  /* keys are never negative; -1 and -2 mark empty and removed cells */
    const int64_t *k = (const int64_t *)self->keys.buf;
    const int64_t *v = (const int64_t *)self->values.buf;
    uint64_t pos = ((uint64_t)key * GOLDEN) >> (64 - self->bits);
    for (;;) {
        int64_t at = k[pos];
        if (at == key) return v[pos];
        if (at == EMPTY_KEY) return -1;
        pos = (pos + 1) & self->mask;
    }
}

/* dst[i] = rows[slots[i]], rb bytes each; prefetching a few rows ahead */
static void copy_rows(const char *rows, const int64_t *slots, Py_ssize_t k, Py_ssize_t rb, char *dst) {
    for (Py_ssize_t i = 0; i < k; i++) {
        if (i + AHEAD < k) {
            const char *p = rows + slots[i + AHEAD] * rb;
            for (Py_ssize_t off = 0; off < rb; off += 64) __builtin_prefetch(p + off);
        }
        memcpy(dst + i * rb, rows + slots[i] * rb, (size_t)rb);
    }
}

static PyObject *hp_acquire(HitPath *self, PyObject *args) {
    PyObject *ids_o, *slots_o, *rows_o = Py_None, *out_o = Py_None;
    long long clock;
    int pin = 1;
    if (!PyArg_ParseTuple(args, "OOL|OOp", &ids_o, &slots_o, &clock, &rows_o, &out_o, &pin)) return NULL;
    if (!self->values.obj) {
        PyErr_SetString(PyExc_RuntimeError, "HitPath is not bound");
        return NULL;
    }
    Py_buffer ib, sb, rb_buf = {0}, ob = {0};
    if (get_array(ids_o, &ib, 8, 0, "ids") < 0) return NULL;
    if (get_array(slots_o, &sb, 8, 1, "slots") < 0) {
        PyBuffer_Release(&ib);
        return NULL;
    }
    Py_ssize_t n = ib.len / 8, row_bytes = 0;
    if (sb.len != ib.len) {
        PyBuffer_Release(&ib);
        PyBuffer_Release(&sb);
        PyErr_SetString(PyExc_ValueError, "slots must have one entry per id");
        return NULL;
    }
    if (rows_o != Py_None && out_o != Py_None) {
        if (PyObject_GetBuffer(rows_o, &rb_buf, PyBUF_C_CONTIGUOUS) < 0) goto fail;
        if (PyObject_GetBuffer(out_o, &ob, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto fail;
        row_bytes = self->capacity ? rb_buf.len / self->capacity : 0;
        if (row_bytes < 1 || rb_buf.len != row_bytes * self->capacity || ob.len != row_bytes * n) {
            PyErr_SetString(PyExc_ValueError, "rows must be [capacity, row_bytes] and out [len(ids), row_bytes]");
            goto fail;
        }
    } else {
        pin = 1;
    }
    const int64_t *ids = (const int64_t *)ib.buf;
    int64_t *slots = (int64_t *)sb.buf;
    const unsigned char *ready = (const unsigned char *)self->ready.buf;
    char *pins = (char *)self->pins.buf, *stamp = (char *)self->stamp.buf;
    char *count = self->have_count ? (char *)self->count.buf : NULL;
    const Py_ssize_t ps = self->pins_stride, ss = self->stamp_stride, cs = self->count_stride;
    const int32_t *v32 = (const int32_t *)self->values.buf;
    const int64_t *v64 = (const int64_t *)self->values.buf;
    const Py_ssize_t nv = self->num_values, cap = self->capacity;
    const int64_t maxc = self->max_count;
    Py_ssize_t hits = 0, bad = -1;
    PyThreadState *ts = n >= NOGIL_MIN_IDS ? PyEval_SaveThread() : NULL;

    /* pass 1: slot and readiness of every id; nothing is modified until all ids are valid */
    /* Each id touches a random index entry, then a random ready flag and slot record: the
     * index entries are prefetched 2 * AHEAD ids ahead, the flags AHEAD ahead (their index
     * entries are in cache by then), the records in pass 2: the loads overlap instead of
     * waiting for memory one after another. */
    if (self->kind == 0) {
        const Py_ssize_t isz = self->values32 ? 4 : 8;
        const char *vbase = (const char *)self->values.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t id = ids[i];
            if (i + 2 * AHEAD < n && ids[i + 2 * AHEAD] >= 0 && ids[i + 2 * AHEAD] < nv)
                __builtin_prefetch(vbase + ids[i + 2 * AHEAD] * isz);
            if (i + AHEAD < n && ids[i + AHEAD] >= 0 && ids[i + AHEAD] < nv) {
                int64_t ahead = self->values32 ? (int64_t)v32[ids[i + AHEAD]] : v64[ids[i + AHEAD]];
                if (ahead >= 0 && ahead < cap) __builtin_prefetch(ready + ahead);
            }
            if (id < 0 || id >= nv) {
                bad = i;
                break;
            }
            int64_t s = self->values32 ? (int64_t)v32[id] : v64[id];
            if (s >= 0 && s < cap && ready[s]) {
                hits++;
            } else {
                s = -1;
            }
            slots[i] = s;
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = hash_find(self, ids[i]);
            if (s >= 0 && s < cap && ready[s]) {
                hits++;
            } else {
                s = -1;
            }
            slots[i] = s;
        }
    }
    /* pass 2: pin and touch the hits; pass 3: all hit and asked to, copy their rows */
    int copy = bad < 0 && row_bytes && hits == n;
    int add = (copy && !pin) ? 0 : 1;
    if (bad < 0 && hits) {
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = slots[i];
            if (i + AHEAD < n && slots[i + AHEAD] >= 0) {
                __builtin_prefetch(pins + slots[i + AHEAD] * ps, 1);
                __builtin_prefetch(stamp + slots[i + AHEAD] * ss, 1);
            }
            if (s < 0) continue;
            AT(pins, ps, s, int32_t) += add;
            AT(stamp, ss, s, int64_t) = clock;
            if (count) {
                int64_t c = AT(count, cs, s, int64_t) + 1;
                AT(count, cs, s, int64_t) = c < maxc ? c : maxc;
            }
        }
    }
    if (copy) copy_rows((const char *)rb_buf.buf, slots, n, row_bytes, (char *)ob.buf);
    if (ts) PyEval_RestoreThread(ts);
    PyObject *result = NULL;
    if (bad >= 0)
        PyErr_Format(PyExc_IndexError, "row id %lld is outside the index (0..%zd)", (long long)ids[bad], nv - 1);
    else
        result = PyLong_FromSsize_t(hits);
    if (rb_buf.obj) PyBuffer_Release(&rb_buf);
    if (ob.obj) PyBuffer_Release(&ob);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&sb);
    return result;
fail:
    if (rb_buf.obj) PyBuffer_Release(&rb_buf);
    if (ob.obj) PyBuffer_Release(&ob);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&sb);
    return NULL;
}

static PyObject *hp_release(HitPath *self, PyObject *arg) {
    if (!self->values.obj) {
        PyErr_SetString(PyExc_RuntimeError, "HitPath is not bound");
        return NULL;
    }
    Py_buffer sb;
    if (get_array(arg, &sb, 8, 0, "slots") < 0) return NULL;
    const int64_t *slots = (const int64_t *)sb.buf;
    Py_ssize_t n = sb.len / 8, done = 0, i;
    char *pins = (char *)self->pins.buf;
    const Py_ssize_t cap = self->capacity, ps = self->pins_stride;
    int out_of_range = 0, under = 0;
    PyThreadState *ts = n >= NOGIL_MIN_IDS ? PyEval_SaveThread() : NULL;
    for (i = 0; i < n; i++) {
        int64_t s = slots[i];
        if (s < 0) continue;
        if (s >= cap) {
            out_of_range = 1;
            break;
        }
        if (AT(pins, ps, s, int32_t) <= 0) {
            under = 1;
            break;
        }
        AT(pins, ps, s, int32_t) -= 1;
        done++;
    }
    if (out_of_range || under) { /* undo: the call changes nothing */
        for (Py_ssize_t j = 0; j < i; j++)
            if (slots[j] >= 0) AT(pins, ps, slots[j], int32_t) += 1;
    }
    if (ts) PyEval_RestoreThread(ts);
    PyBuffer_Release(&sb);
    if (out_of_range) {
        PyErr_SetString(PyExc_IndexError, "slot outside the cache");
        return NULL;
    }
    return PyLong_FromSsize_t(under ? -1 : done);
}

#define LFU_STAMP_BITS 40 /* policy.LFUPolicy._STAMP_BITS */
#define SCORE_BUCKETS 65536

static inline int evictable(const HitPath *self, const int64_t *slot_id, Py_ssize_t id_stride, Py_ssize_t s) {
    return AT(slot_id, id_stride, s, int64_t) >= 0 && AT(self->pins.buf, self->pins_stride, s, int32_t) == 0;
}

static inline uint64_t score_of(const HitPath *self, Py_ssize_t s) {
    uint64_t stamp = (uint64_t)AT(self->stamp.buf, self->stamp_stride, s, int64_t);
    if (!self->have_count) return stamp;
    uint64_t count = (uint64_t)AT(self->count.buf, self->count_stride, s, int64_t);
    return (count << LFU_STAMP_BITS) | (stamp & ((1ULL << LFU_STAMP_BITS) - 1));
}

static inline Py_ssize_t bucket_of(uint64_t score, uint64_t lo, int shift) {
    uint64_t b = (score - lo) >> shift; /* monotone in the score, clamped: the order within a bucket is sorted */
    return b < SCORE_BUCKETS ? (Py_ssize_t)b : SCORE_BUCKETS - 1;
}

/* The k-th lowest (0-based) of vals[0..n), by radix select: each round counts the values in
 * SCORE_BUCKETS buckets over their range and keeps only the bucket holding the k-th, so the
 * range shrinks 65,536-fold a round (at most 4 rounds for 64-bit scores) and the work is linear,
 * where a sort of a bucket of many ties (LFU slots of one count: most of a cache) is not.
 * Reorders vals; hist: SCORE_BUCKETS counters of scratch. */
static uint64_t kth_lowest(uint64_t *vals, Py_ssize_t n, Py_ssize_t k, Py_ssize_t *hist) {
    for (;;) {
        uint64_t lo = vals[0], hi = vals[0];
        for (Py_ssize_t i = 1; i < n; i++) {
            if (vals[i] < lo) lo = vals[i];
            if (vals[i] > hi) hi = vals[i];
        }
        if (lo == hi) return lo;
        int shift = 0;
        while (((hi - lo) >> shift) >= SCORE_BUCKETS) shift++;
        memset(hist, 0, SCORE_BUCKETS * sizeof(Py_ssize_t));
        for (Py_ssize_t i = 0; i < n; i++) hist[(vals[i] - lo) >> shift]++;
        Py_ssize_t edge = 0;
        while (k >= hist[edge]) k -= hist[edge++];
        Py_ssize_t m = 0; /* keep the edge bucket's values */
        for (Py_ssize_t i = 0; i < n; i++)
            if ((Py_ssize_t)((vals[i] - lo) >> shift) == edge) vals[m++] = vals[i];
        n = m;
    }
}

#define SAMPLE_SLOTS 4096
#define SAMPLE_MIN_EVICTABLE 256 /* fewer evictable slots among the samples: the exact passes */

static inline uint64_t mix64(uint64_t x) { /* splitmix64's finalizer: sample positions */
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* The victims in one pass over the slots, where a sample of them bounds the scores to keep:
 * t, a sampled score above the count-th lowest with a margin of several standard deviations,
 * then every evictable slot scoring at most t kept, in slot order. With at least `count` kept,
 * the count-th lowest score v of all slots is among them, and so is every slot scoring at
 * most v: the same victims, in the same order, as the exact passes. Returns how many were
 * written to out, or -1 where the sample does not settle it (too few evictable slots sampled,
 * a large share to evict, fewer than `count` kept, or more than the room for them): the
 * caller then makes the exact passes. The sample only decides the speed, never the victims. */
static Py_ssize_t victims_sampled(const HitPath *self, const int64_t *sid, Py_ssize_t is, Py_ssize_t count,
                                  int64_t *out, Py_ssize_t *hist) {
    const Py_ssize_t cap = self->capacity;
    if (cap < 4 * SAMPLE_SLOTS || count <= 0) return -1;
    uint64_t *sample = PyMem_RawMalloc(SAMPLE_SLOTS * sizeof(uint64_t));
    if (sample == NULL) return -1;
    Py_ssize_t m = 0;
    for (Py_ssize_t j = 0; j < SAMPLE_SLOTS; j++) {
        Py_ssize_t s = (Py_ssize_t)(mix64((uint64_t)j + (uint64_t)count * 0x9e3779b97f4a7c15ULL) % (uint64_t)cap);
        if (evictable(self, sid, is, s)) sample[m++] = score_of(self, s);
    }
    double share = (double)count * SAMPLE_SLOTS / ((double)m * (double)cap); /* of the evictable slots */
    if (m < SAMPLE_MIN_EVICTABLE || share > 0.25) {
        PyMem_RawFree(sample);
        return -1;
    }
    Py_ssize_t expect = (Py_ssize_t)(share * (double)m) + 1, root = 1; /* samples expected below v */
    while (root * root < expect) root++;                                 /* ~ its standard deviation */
    Py_ssize_t rank = expect + 6 * root + 16;
    if (rank >= m) {
        PyMem_RawFree(sample);
        return -1;
    }
    uint64_t t = kth_lowest(sample, m, rank, hist);
    PyMem_RawFree(sample);
    /* room for kept slots: several times what the margin leads to expect, else the exact passes */
    Py_ssize_t room = 4 * (Py_ssize_t)((double)(rank + 1) / (double)m * (double)cap) + 4 * count + 1024;
    if (room > cap) room = cap;
    uint64_t *kept_score = PyMem_RawMalloc((size_t)room * sizeof(uint64_t));
    uint64_t *scratch = PyMem_RawMalloc((size_t)room * sizeof(uint64_t));
    int64_t *kept_slot = PyMem_RawMalloc((size_t)room * sizeof(int64_t));
    Py_ssize_t n = 0, k = -1;
    if (kept_score != NULL && scratch != NULL && kept_slot != NULL) {
        for (Py_ssize_t s = 0; s < cap && n <= room; s++) {
            if (!evictable(self, sid, is, s)) continue;
            uint64_t sc = score_of(self, s);
            if (sc > t) continue;
            if (n == room) { /* more kept than there is room for */
                n = room + 1;
                break;
            }
            kept_score[n] = sc;
            kept_slot[n++] = s;
        }
        if (n >= count && n <= room) {
            memcpy(scratch, kept_score, (size_t)n * sizeof(uint64_t));
            uint64_t v = kth_lowest(scratch, n, count - 1, hist);
            k = 0;
            for (Py_ssize_t i = 0; i < n; i++) /* below v, in slot order */
                if (kept_score[i] < v) out[k++] = kept_slot[i];
            for (Py_ssize_t i = 0; i < n && k < count; i++) /* then v's, in slot order */
                if (kept_score[i] == v) out[k++] = kept_slot[i];
        }
    }
    PyMem_RawFree(kept_score);
    PyMem_RawFree(scratch);
    PyMem_RawFree(kept_slot);
    return k;
}

static PyObject *hp_victims(HitPath *self, PyObject *args) {
    Py_ssize_t count;
    PyObject *ids_o, *out_o;
    long long upper = -1;
    if (!PyArg_ParseTuple(args, "nOO|L", &count, &ids_o, &out_o, &upper)) return NULL;
    Py_buffer ib, ob;
    if (get_strided(ids_o, &ib, 8, "slot_id") < 0) return NULL;
    if (get_array(out_o, &ob, 8, 1, "out") < 0) {
        PyBuffer_Release(&ib);
        return NULL;
    }
    const Py_ssize_t cap = self->capacity;
    if (ib.shape[0] != cap || ob.len / 8 < count || count < 0) {
        PyBuffer_Release(&ib);
        PyBuffer_Release(&ob);
        PyErr_SetString(PyExc_ValueError, "victims: slot_id must have one entry per slot and out room for count");
        return NULL;
    }
    const int64_t *sid = (const int64_t *)ib.buf;
    const Py_ssize_t is = ib.strides[0];
    int64_t *out = (int64_t *)ob.buf;
    Py_ssize_t *hist = PyMem_RawCalloc(SCORE_BUCKETS, sizeof(Py_ssize_t));
    uint64_t *tie_score = NULL, *scratch = NULL;
    int64_t *tie_slot = NULL;
    Py_ssize_t k = 0, n = 0;
    int nomem = hist == NULL;
    PyThreadState *ts = PyEval_SaveThread();
    Py_ssize_t sampled = nomem ? -1 : victims_sampled(self, sid, is, count, out, hist);
    if (sampled >= 0) {
        PyEval_RestoreThread(ts);
        PyMem_RawFree(hist);
        PyBuffer_Release(&ib);
        PyBuffer_Release(&ob);
        return PyLong_FromSsize_t(sampled);
    }
    if (!nomem) memset(hist, 0, SCORE_BUCKETS * sizeof(Py_ssize_t)); /* the sample's selection used it */
    uint64_t lo = 0, hi = (uint64_t)upper;
    if (upper < 0) /* pass 0 (no bound given): the evictable slots' score range */
        for (Py_ssize_t s = 0, first = 1; s < cap && !nomem; s++) {
            if (!evictable(self, sid, is, s)) continue;
            uint64_t sc = score_of(self, s);
            if (first || sc < lo) lo = sc;
            if (first || sc > hi) hi = sc;
            first = 0;
        }
    int shift = 0;
    while (((hi - lo) >> shift) >= SCORE_BUCKETS) shift++;
    for (Py_ssize_t s = 0; s < cap && !nomem; s++) /* pass 1: how many slots in each score bucket */
        if (evictable(self, sid, is, s)) {
            hist[bucket_of(score_of(self, s), lo, shift)]++;
            n++;
        }
    if (!nomem && count > 0 && n <= count) { /* every evictable slot goes, in slot order */
        for (Py_ssize_t s = 0; s < cap; s++)
            if (evictable(self, sid, is, s)) out[k++] = s;
    } else if (!nomem && count > 0) {
        Py_ssize_t below = 0, edge = 0; /* edge: the bucket where `count` is reached */
        while (below + hist[edge] < count) below += hist[edge++];
        Py_ssize_t ties = hist[edge], t = 0;
        tie_score = PyMem_RawMalloc((size_t)ties * sizeof(uint64_t));
        scratch = PyMem_RawMalloc((size_t)ties * sizeof(uint64_t));
        tie_slot = PyMem_RawMalloc((size_t)ties * sizeof(int64_t));
        nomem = tie_score == NULL || scratch == NULL || tie_slot == NULL;
        /* pass 2: the slots of the buckets below the edge, and the edge bucket's, in slot order */
        for (Py_ssize_t s = 0; s < cap && !nomem; s++) {
            if (!evictable(self, sid, is, s)) continue;
            uint64_t sc = score_of(self, s);
            Py_ssize_t b = bucket_of(sc, lo, shift);
            if (b < edge) {
                out[k++] = s;
            } else if (b == edge) {
                tie_score[t] = sc;
                tie_slot[t++] = s;
            }
        }
        if (!nomem) {
            /* v: the count-th lowest score. The victims, as EvictionPolicy.victims picks them (so
             * both paths leave the same cache): every slot scoring below v in slot order (the
             * edge bucket's merged into those below it, from the back), then those scoring v. */
            memcpy(scratch, tie_score, (size_t)ties * sizeof(uint64_t));
            uint64_t v = kth_lowest(scratch, ties, count - below - 1, hist);
            Py_ssize_t lower = 0;
            for (Py_ssize_t i = 0; i < ties; i++) lower += tie_score[i] < v;
            Py_ssize_t w = below + lower, i = below - 1, j = ties - 1;
            while (w > 0) {
                while (j >= 0 && tie_score[j] >= v) j--;
                if (j >= 0 && (i < 0 || tie_slot[j] > out[i])) out[--w] = tie_slot[j--];
                else out[--w] = out[i--];
            }
            k = below + lower;
            for (Py_ssize_t q = 0; q < ties && k < count; q++)
                if (tie_score[q] == v) out[k++] = tie_slot[q];
        }
    }
    PyEval_RestoreThread(ts);
    PyMem_RawFree(hist);
    PyMem_RawFree(tie_score);
    PyMem_RawFree(scratch);
    PyMem_RawFree(tie_slot);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&ob);
    if (nomem) return PyErr_NoMemory();
    return PyLong_FromSsize_t(k);
}

static PyMethodDef hp_methods[] = {
    {"victims", (PyCFunction)hp_victims, METH_VARARGS,
     "victims(count, slot_id, out[, upper]) -> k: the k lowest-scoring evictable slots into out (upper: a "
     "bound on every score, saving a pass)."},
    {"acquire", (PyCFunction)hp_acquire, METH_VARARGS,
     "acquire(ids, slots, clock[, rows, out, pin]) -> hits: look up, pin and touch distinct int64 ids."},
    {"release", (PyCFunction)hp_release, METH_O,
     "release(slots) -> released, or -1 (nothing changed) when a slot is not pinned."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HitPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "engram_offload.cache._hitpath.HitPath",
    .tp_basicsize = sizeof(HitPath),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The hit-path bookkeeping of one row cache, over its arrays.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hp_init,
    .tp_dealloc = (destructor)hp_dealloc,
    .tp_methods = hp_methods,
};

static PyObject *sorted_in_range(PyObject *module, PyObject *args) {
    PyObject *ids_o;
    long long limit;
    if (!PyArg_ParseTuple(args, "OL", &ids_o, &limit)) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(ids_o, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    int ok = b.ndim == 1 && int_format(&b, 8);
    if (ok) {
        const int64_t *ids = (const int64_t *)b.buf;
        Py_ssize_t n = b.len / 8;
        if (n && (ids[0] < 0 || ids[n - 1] >= limit)) ok = 0;
        for (Py_ssize_t i = 1; ok && i < n; i++)
            if (ids[i] <= ids[i - 1]) ok = 0;
    }
    PyBuffer_Release(&b);
    return PyBool_FromLong(ok);
}

static PyObject *split_slots(PyObject *module, PyObject *args) {
    PyObject *o[7];
    Py_ssize_t rb;
    if (!PyArg_ParseTuple(args, "OOnOOOOO", &o[0], &o[1], &rb, &o[2], &o[3], &o[4], &o[5], &o[6])) return NULL;
    static const char *names[7] = {"ids", "slots", "hit_slots", "hit_src", "hit_dst", "miss_ids", "miss_dst"};
    Py_buffer b[7];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 7; got++)
        if (get_array(o[got], &b[got], 8, got >= 2, names[got]) < 0) goto done;
    Py_ssize_t n = b[0].len / 8;
    for (int k = 1; k < 7; k++)
        if (b[k].len != n * 8) {
            PyErr_Format(PyExc_ValueError, "split_slots: %s must hold %zd entries like ids", names[k], n);
            goto done;
        }
    {
        const int64_t *ids = b[0].buf, *slots = b[1].buf;
        int64_t *hs = b[2].buf, *src = b[3].buf, *dst = b[4].buf, *mid = b[5].buf, *mdst = b[6].buf;
        Py_ssize_t h = 0, m = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (slots[i] >= 0) {
                hs[h] = slots[i];
                src[h] = slots[i] * rb;
                dst[h++] = i * rb;
            } else {
                mid[m] = ids[i];
                mdst[m++] = i * rb;
            }
        }
        result = PyLong_FromSsize_t(h);
    }
done:
    for (int k = 0; k < got; k++) PyBuffer_Release(&b[k]);
    return result;
}

static PyMethodDef module_methods[] = {
    {"split_slots", split_slots, METH_VARARGS,
     "split_slots(ids, slots, row_bytes, hit_slots, hit_src, hit_dst, miss_ids, miss_dst) -> hits: a lookup "
     "taken apart into the hits' slots and byte offsets and the misses' ids and byte offsets."},
    {"sorted_in_range", sorted_in_range, METH_VARARGS,
     "sorted_in_range(ids, limit) -> bool: int64 ids strictly increasing within [0, limit)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hitpath",
                                    "Native hit path of the row caches.", -1, module_methods};

PyMODINIT_FUNC PyInit__hitpath(void) {
    if (PyType_Ready(&HitPathType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&HitPathType);
    if (PyModule_AddObject(m, "HitPath", (PyObject *)&HitPathType) < 0) {
        Py_DECREF(&HitPathType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
