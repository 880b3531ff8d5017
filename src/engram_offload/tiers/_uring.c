/*
 * _uring.c - batched, asynchronous positional reads through io_uring.
 *
 * A tiny CPython extension that performs many pread()-like requests into one
 * destination buffer with a bounded number of reads in flight.  It talks to
 * the kernel through the raw io_uring syscalls and <linux/io_uring.h>; no
 * liburing is needed.
 *
 * Exposed objects:
 *
 *   probe() -> None
 *       Creates and destroys a one-entry ring.  Raises OSError when io_uring
 *       is unusable (old kernel, seccomp filter, kernel.io_uring_disabled).
 *
 *   Ring(queue_depth=128, setup_flags=-1, transient=())
 *       One submission/completion ring.  setup_flags=-1 picks the best flag
 *       set the kernel accepts (see ring_setup()).  transient: the errnos a
 *       failed read is retried for (the caller's retry policy; others fail
 *       at once).
 *
 *   Ring.read(fd, offsets, lengths, dest, dest_offsets, retries=3) -> None
 *       offsets, dest_offsets: contiguous int64 buffers of n items.
 *       lengths: an int (same length for every read) or an int64 buffer.
 *       dest: a writable C-contiguous buffer.
 *       Reads lengths[i] bytes at file offset offsets[i] into
 *       dest[dest_offsets[i]:dest_offsets[i] + lengths[i]].
 *       The GIL is released for the whole batch.
 *
 *       Semantics of failures:
 *         - every destination range is bounds-checked before any I/O is
 *           issued (ValueError, nothing read);
 *         - a short read is resubmitted for the remainder;
 *         - a read that returns 0 bytes before its length is complete hit
 *           end of file: OSError(EIO, "... end of file ...");
 *         - an error in the ring's `transient` set is retried up to
 *           `retries` times, then raised as OSError(errno, ...) naming the
 *           file offset; any other error is raised at once;
 *         - on any failure, reads already in flight are drained before the
 *           call returns, so the kernel never writes into dest afterwards.
 *
 *   Ring.read_rows(fd, ids, out, data_offset, page_bytes, rows_per_page, row_bytes,
 *                  num_rows, page_sums=None, retries=3, wait_batch=-1, damage=0)
 *       -> (reads, pages_checked, page_rereads, bad_page)
 *       Rows `ids` (int64 [n], any order) of a paged table (format version 3:
 *       row i at data_offset + (i / rows_per_page) * page_bytes
 *       + (i % rows_per_page) * row_bytes) into `out` (n * row_bytes bytes,
 *       C-contiguous), in id order.  Each distinct page is read whole into
 *       one of the ring's page slots (page-aligned, one per read in flight),
 *       with the failure semantics of read(); when page_sums (uint32 per page)
 *       is given, the page's XXH3-64 low 32 bits are compared with it (as
 *       table/_pagesum.c) and a page that differs is read once more; a page
 *       that differs twice halts the batch (bad_page; its rows are not
 *       copied; the caller raises).  Ids out of range (IndexError) and an
 *       `out` too small (ValueError) are refused before any I/O.  damage: a
 *       test hook flipping a byte of the first `damage` pages read.
 *
 *       The page slots are registered with the ring (IORING_REGISTER_BUFFERS)
 *       where RLIMIT_MEMLOCK allows, and read with READ_FIXED (Ring.fixed_pages);
 *       from 256 KiB of slots up they lie on transparent huge pages where the
 *       huge page can be registered (Ring.huge_pages).  Each page is checked as
 *       its read completes, while the page of the next completion is loaded.
 *
 *   Ring.close(), Ring.queue_depth, Ring.setup_flags, Ring.features,
 *   Ring.n_enter, Ring.n_retries (reads reissued), Ring.broken, Ring.fixed_pages,
 *   Ring.huge_pages, Ring.fixed_file (the descriptor read is registered with the ring,
 *   again whenever it names another file than the one registered)
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "xxhash.h"
#include "pagesum_dispatch.h"

#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif

/* Flags newer than some installed headers; the kernel rejects unknown ones
 * with EINVAL, and ring_setup() then falls back to a smaller set. */
#ifndef IORING_SETUP_COOP_TASKRUN
#define IORING_SETUP_COOP_TASKRUN (1U << 8)
#endif
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif
#ifndef IORING_FEAT_SINGLE_MMAP
#define IORING_FEAT_SINGLE_MMAP (1U << 0)
#endif

/* Largest single request; io_uring's sqe->len is 32 bits and the kernel caps
 * one read at MAX_RW_COUNT (INT_MAX & PAGE_MASK) anyway. */
#define MAX_READ_LEN ((int64_t)1 << 30)
#define MAX_QUEUE_DEPTH 4096
/* errnos below this bound can be marked transient */
#define MAX_ERRNO 512

/* ------------------------------------------------------------------------ */
/* Raw syscalls                                                              */
/* ------------------------------------------------------------------------ */

static int sys_io_uring_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_io_uring_register(int fd, unsigned opcode, const void *arg, unsigned nr_args)
{
    return (int)syscall(__NR_io_uring_register, fd, opcode, arg, nr_args);
}

static int sys_io_uring_enter(int fd, unsigned to_submit, unsigned min_complete,
                              unsigned flags)
{
    return (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags,
                        NULL, (size_t)0);
}

/* ------------------------------------------------------------------------ */
/* Ring memory                                                               */
/* ------------------------------------------------------------------------ */

/* Per-request bookkeeping for a read in flight.  user_data carries the slot
 * number, so completions can be matched without any search. */
typedef struct {
    int64_t index;   /* which of the n reads this is */
    int64_t done;    /* bytes already transferred (short reads) */
    char *buf;       /* where the read lands */
    int32_t tries;   /* error retries spent */
} slot_t;

typedef struct {
    int ring_fd;
    unsigned setup_flags;
    unsigned features;
    unsigned queue_depth; /* max reads in flight */

    /* mmapped regions */
    void *sq_ptr;
    size_t sq_len;
    void *cq_ptr; /* == sq_ptr with IORING_FEAT_SINGLE_MMAP */
    size_t cq_len;
    struct io_uring_sqe *sqes;
    size_t sqes_len;

    /* submission ring */
    unsigned *sq_head;
    unsigned *sq_tail;
    unsigned sq_mask;
    unsigned sq_entries;
    unsigned *sq_array;

    /* completion ring */
    unsigned *cq_head;
    unsigned *cq_tail;
    unsigned cq_mask;
    struct io_uring_cqe *cqes;

    /* request slots and a stack of free slot numbers */
    slot_t *slots;
    unsigned *free_slots;
    unsigned n_free;
    int broken; /* io_uring_enter failed mid-batch; the ring is unusable */
    char *pages;       /* read_rows: one page-aligned buffer per slot (allocated on first use) */
    size_t page_bytes; /* the size of each */
    int pages_fixed;   /* `pages` is registered with the ring: reads into it use READ_FIXED */
    int pages_huge;    /* `pages` was allocated on transparent huge pages (MADV_HUGEPAGE) */
    int file_registered; /* file_fd (the file dev/ino) is registered with the ring as file 0 */
    int file_fd;
    dev_t file_dev;
    ino_t file_ino;
    uint64_t transient[MAX_ERRNO / 64]; /* bit e: retry a read failing with errno e */
} ring_t;

static void ring_destroy(ring_t *r)
{
    if (r->sqes && r->sqes != MAP_FAILED)
        munmap(r->sqes, r->sqes_len);
    if (r->cq_ptr && r->cq_ptr != MAP_FAILED && r->cq_ptr != r->sq_ptr)
        munmap(r->cq_ptr, r->cq_len);
    if (r->sq_ptr && r->sq_ptr != MAP_FAILED)
        munmap(r->sq_ptr, r->sq_len);
    if (r->ring_fd >= 0)
        close(r->ring_fd);
    free(r->slots);
    free(r->free_slots);
    free(r->pages);
    memset(r, 0, sizeof(*r));
    r->ring_fd = -1;
}

/* Creates the ring with exactly `flags`.  Returns 0 or a negative errno. */
static int ring_init_flags(ring_t *r, unsigned queue_depth, unsigned flags)
{
    struct io_uring_params p;
    int err;

    memset(r, 0, sizeof(*r));
    r->ring_fd = -1;
    memset(&p, 0, sizeof(p));
    p.flags = flags;

    r->ring_fd = sys_io_uring_setup(queue_depth, &p);
    if (r->ring_fd < 0) {
        err = -errno;
        r->ring_fd = -1;
        return err;
    }
    r->setup_flags = flags;
    r->features = p.features;
    r->sq_entries = p.sq_entries;
    /* Never more reads in flight than SQ entries: every prepared SQE then
     * finds room, and the CQ (2x the SQ by default) cannot overflow. */
    r->queue_depth = queue_depth < p.sq_entries ? queue_depth : p.sq_entries;

    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_len > r->sq_len)
            r->sq_len = r->cq_len;
        r->cq_len = r->sq_len;
    }

    r->sq_ptr = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_POPULATE, r->ring_fd, IORING_OFF_SQ_RING);
    if (r->sq_ptr == MAP_FAILED)
        goto fail;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        r->cq_ptr = r->sq_ptr;
    } else {
        r->cq_ptr = mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_POPULATE, r->ring_fd, IORING_OFF_CQ_RING);
        if (r->cq_ptr == MAP_FAILED)
            goto fail;
    }
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, r->ring_fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED)
        goto fail;

    r->sq_head = (unsigned *)((char *)r->sq_ptr + p.sq_off.head);
    r->sq_tail = (unsigned *)((char *)r->sq_ptr + p.sq_off.tail);
    r->sq_mask = *(unsigned *)((char *)r->sq_ptr + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)((char *)r->sq_ptr + p.sq_off.array);
    r->cq_head = (unsigned *)((char *)r->cq_ptr + p.cq_off.head);
    r->cq_tail = (unsigned *)((char *)r->cq_ptr + p.cq_off.tail);
    r->cq_mask = *(unsigned *)((char *)r->cq_ptr + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)((char *)r->cq_ptr + p.cq_off.cqes);

    /* Identity map: SQ ring slot i always points at SQE i. */
    for (unsigned i = 0; i < p.sq_entries; i++)
        r->sq_array[i] = i;

    r->slots = calloc(r->queue_depth, sizeof(slot_t));
    r->free_slots = calloc(r->queue_depth, sizeof(unsigned));
    if (!r->slots || !r->free_slots) {
        ring_destroy(r);
        return -ENOMEM;
    }
    for (unsigned i = 0; i < r->queue_depth; i++)
        r->free_slots[i] = r->queue_depth - 1 - i;
    r->n_free = r->queue_depth;
    return 0;

fail:
    err = -errno;
    ring_destroy(r);
    return err;
}

/* Flag sets tried in order when the caller asks for automatic selection.
 * COOP_TASKRUN avoids interrupting the task for every completion; the reads
 * are reaped from inside io_uring_enter anyway.  DEFER_TASKRUN (which needs
 * SINGLE_ISSUER) is not used automatically: it ties the ring to the thread
 * that created it. */
static const unsigned auto_flag_sets[] = {
    IORING_SETUP_COOP_TASKRUN,
    0,
};

static int ring_setup(ring_t *r, unsigned queue_depth, long long flags)
{
    int err = -EINVAL;
    if (flags >= 0)
        return ring_init_flags(r, queue_depth, (unsigned)flags);
    for (size_t i = 0; i < sizeof(auto_flag_sets) / sizeof(auto_flag_sets[0]); i++) {
        err = ring_init_flags(r, queue_depth, auto_flag_sets[i]);
        if (err != -EINVAL)
            return err;
    }
    return err;
}

/* ------------------------------------------------------------------------ */
/* The batch read loop (runs without the GIL)                                */
/* ------------------------------------------------------------------------ */

typedef struct batch batch_t;

/* Called (without the GIL) when a read of a batch is complete, unless the batch is
 * failing.  Returns 1 to read the same range again from the start, 0 to free its slot;
 * it may halt the batch (no new reads issued; those in flight are drained). */
typedef int (*done_fn)(batch_t *b, const slot_t *s);

struct batch {
    int fd;
    int64_t n;
    const int64_t *offsets;
    const int64_t *lengths; /* NULL: every read is `length` bytes */
    int64_t length;
    char *dest;
    const int64_t *dest_offsets;
    char *slot_bufs;    /* instead of dest: read into slot_bufs + slot * length */
    int fixed;          /* slot_bufs is the ring's registered buffer 0 */
    int fixed_file;     /* fd is the ring's registered file 0 */
    done_fn on_done;    /* optional */
    void *ctx;          /* on_done's state */
    int retries;
    unsigned wait_batch; /* completions to wait for per io_uring_enter */

    /* outcome */
    int err;            /* 0, or a positive errno */
    int halted;         /* on_done stopped the batch (not an I/O error) */
    int eof;            /* the failure was a read returning 0 (end of file) */
    int64_t err_index;  /* which read failed */
    int64_t err_done;   /* bytes it had transferred */
    int err_tries;      /* retries it had spent */
    int enter_failed;   /* the failure came from io_uring_enter itself */
    int64_t n_enter;    /* statistics: io_uring_enter calls */
    int64_t n_retries;  /* statistics: reads reissued (short reads, retried errors) */
};

static inline int64_t batch_len(const batch_t *b, int64_t i)
{
    return b->lengths ? b->lengths[i] : b->length;
}

/* Whether the caller's policy retries a read failing with errno e. */
static int is_transient(const ring_t *r, int e)
{
    return e > 0 && e < MAX_ERRNO && ((r->transient[e / 64] >> (e % 64)) & 1);
}

/* Writes an SQE for the (remaining part of the) read held by `slot`. */
static inline void prep_read(ring_t *r, const batch_t *b, unsigned slot)
{
    const slot_t *s = &r->slots[slot];
    unsigned tail = *r->sq_tail; /* only this thread writes the tail */
    struct io_uring_sqe *sqe = &r->sqes[tail & r->sq_mask];
    int64_t i = s->index;

    memset(sqe, 0, sizeof(*sqe));
    /* A registered buffer (index 0) spares the kernel pinning the pages of every read. */
    sqe->opcode = b->fixed ? IORING_OP_READ_FIXED : IORING_OP_READ;
    /* A registered file spares the kernel looking the descriptor up for every read. */
    sqe->fd = b->fixed_file ? 0 : b->fd;
    sqe->flags = b->fixed_file ? IOSQE_FIXED_FILE : 0;
    sqe->off = (uint64_t)(b->offsets[i] + s->done);
    sqe->addr = (uint64_t)(uintptr_t)(s->buf + s->done);
    sqe->len = (uint32_t)(batch_len(b, i) - s->done);
    sqe->user_data = slot;
    /* Publish the SQE before the tail moves. */
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* Registers `fd` with the ring as its file 0 (once: again only when the descriptor now
 * names another file, e.g. a number closed and reused).  Returns 1 when reads may use the
 * registered file, 0 for plain descriptors (registration refused, or fstat failed: the
 * read then fails with the descriptor's own error). */
static int ring_file(ring_t *r, int fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0)
        return 0;
    if (r->file_registered && r->file_fd == fd && r->file_dev == st.st_dev && r->file_ino == st.st_ino)
        return 1;
    if (r->file_registered) {
        sys_io_uring_register(r->ring_fd, IORING_UNREGISTER_FILES, NULL, 0);
        r->file_registered = 0;
    }
    if (sys_io_uring_register(r->ring_fd, IORING_REGISTER_FILES, &fd, 1) != 0)
        return 0;
    r->file_registered = 1;
    r->file_fd = fd;
    r->file_dev = st.st_dev;
    r->file_ino = st.st_ino;
    return 1;
}

/* Validates every request; returns the first bad index or -1. */
static int64_t batch_check(const batch_t *b, int64_t dest_len)
{
    for (int64_t i = 0; i < b->n; i++) {
        int64_t len = batch_len(b, i), off = b->offsets[i], doff = b->dest_offsets[i];
        if (len < 0 || len > MAX_READ_LEN || off < 0 || doff < 0 ||
            doff > dest_len || len > dest_len - doff || off > INT64_MAX - len)
            return i;
    }
    return -1;
}

static inline int batch_failing(const batch_t *b)
{
    return b->err || b->halted;
}

static void batch_fail(batch_t *b, const slot_t *s, int err, int eof)
{
    if (b->err)
        return; /* keep the first failure */
    b->err = err;
    b->eof = eof;
    b->err_index = s->index;
    b->err_done = s->done;
    b->err_tries = s->tries > b->retries ? b->retries : s->tries;
}

/* Starts loading the page in `slot` into the cache.  A page the device has just written is
 * in no cache: the check of the page before it costs the time this load takes, instead of
 * the check of this one waiting on each of its lines in turn. */
static inline __attribute__((always_inline)) void prefetch_slot(const batch_t *b, unsigned slot)
{
    const char *page = b->slot_bufs + (size_t)slot * (size_t)b->length;
    for (int64_t off = 0; off < b->length; off += 64)
        __builtin_prefetch(page + off, 0, 3);
}

static void batch_run(ring_t *r, batch_t *b)
{
    int64_t next = 0;        /* next request not yet issued */
    unsigned inflight = 0;   /* SQEs prepared and not yet completed */
    unsigned unsubmitted = 0;/* SQEs prepared but not yet taken by the kernel */

    for (;;) {
        /* 1. Reap every completion already posted (no syscall needed). */
        unsigned head = *r->cq_head;
        unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        while (head != tail) {
            const struct io_uring_cqe *cqe = &r->cqes[head & r->cq_mask];
            unsigned slot = (unsigned)cqe->user_data;
            int res = cqe->res;
            slot_t *s = &r->slots[slot];
            int resubmit = 0, again = 0;
            head++;
            if (b->slot_bufs && head != tail)
                prefetch_slot(b, (unsigned)r->cqes[head & r->cq_mask].user_data);
            inflight--;

            if (res > 0) {
                s->done += res;
                /* Short read: ask for the rest (unless we are failing). */
                resubmit = s->done < batch_len(b, s->index);
                if (!resubmit && b->on_done && !batch_failing(b))
                    again = b->on_done(b, s);
            } else if (res == 0) {
                /* Zero bytes before the length was complete: end of file. */
                batch_fail(b, s, EIO, 1);
            } else {
                int e = -res;
                if (!is_transient(r, e) || ++s->tries > b->retries)
                    batch_fail(b, s, e, 0);
                else
                    resubmit = 1;
            }
            if (again && !batch_failing(b)) {
                s->done = 0; /* the whole range once more (not a retry of a failure) */
                prep_read(r, b, slot);
                inflight++;
                unsubmitted++;
            } else if (resubmit && !batch_failing(b)) {
                b->n_retries++;
                prep_read(r, b, slot);
                inflight++;
                unsubmitted++;
            } else {
                r->free_slots[r->n_free++] = slot;
            }
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);

        /* 2. Fill free slots with new requests. */
        while (!batch_failing(b) && r->n_free > 0 && next < b->n) {
            int64_t i = next++;
            unsigned slot;
            if (batch_len(b, i) == 0)
                continue; /* nothing to read */
            slot = r->free_slots[--r->n_free];
            r->slots[slot].index = i;
            r->slots[slot].done = 0;
            r->slots[slot].tries = 0;
            r->slots[slot].buf = b->slot_bufs ? b->slot_bufs + (size_t)slot * (size_t)b->length
                                              : b->dest + b->dest_offsets[i];
            prep_read(r, b, slot);
            inflight++;
            unsubmitted++;
        }

        if (inflight == 0)
            break;

        /* 3. One syscall: submit what was prepared and wait for a batch of
         * completions.  Waiting for several at once amortises the syscall
         * and wakeup cost; the device still has the rest in flight. */
        {
            unsigned want = b->wait_batch;
            int ret;
            if (want > inflight)
                want = inflight;
            if (want == 0)
                want = 1;
            ret = sys_io_uring_enter(r->ring_fd, unsubmitted, want,
                                     IORING_ENTER_GETEVENTS);
            b->n_enter++;
            if (ret < 0) {
                int e = errno;
                if (e == EINTR || e == EAGAIN || e == EBUSY)
                    continue; /* reap and try again */
                /* The ring itself failed.  Take back the SQEs the kernel
                 * never saw, so a later call cannot submit them, then wait
                 * out the submitted ones: the kernel may still write into
                 * dest until they complete.  The ring is not reused. */
                if (!b->err) {
                    b->err = e;
                    b->err_index = next > 0 ? next - 1 : 0;
                    b->enter_failed = 1;
                }
                __atomic_store_n(r->sq_tail, *r->sq_tail - unsubmitted, __ATOMIC_RELEASE);
                inflight -= unsubmitted;
                while (inflight > 0) {
                    unsigned h = *r->cq_head;
                    unsigned t = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
                    if (h != t) {
                        inflight -= (t - h) < inflight ? (t - h) : inflight;
                        __atomic_store_n(r->cq_head, t, __ATOMIC_RELEASE);
                        continue;
                    }
                    if (sys_io_uring_enter(r->ring_fd, 0, 1, IORING_ENTER_GETEVENTS) < 0 &&
                        errno != EINTR && errno != EAGAIN)
                        break;
                }
                r->broken = 1;
                return;
            }
            unsubmitted -= (unsigned)ret;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* Python type                                                               */
/* ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    ring_t ring;
    int open;
    int busy; /* a read() is running (with the GIL released) */
    int64_t n_enter; /* statistics: syscalls made by read() so far */
    int64_t n_retries; /* statistics: reads reissued by read() so far */
} RingObject;

static int get_int64_buffer(PyObject *obj, Py_buffer *view, const char *name)
{
    const char *f;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    /* Accept native or little-endian 8-byte signed integers ('q' or 'l'). */
    f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (view->itemsize != 8 || !(f[0] == 'q' || f[0] == 'l') || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", name);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

static int Ring_init(RingObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"queue_depth", "setup_flags", "transient", NULL};
    int queue_depth = 128;
    long long flags = -1;
    PyObject *transient = NULL;
    uint64_t mask[MAX_ERRNO / 64] = {0};
    int err;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|iLO", kwlist, &queue_depth, &flags, &transient))
        return -1;
    if (transient != NULL) {
        PyObject *seq = PySequence_Fast(transient, "transient must be a sequence of errnos");
        if (!seq)
            return -1;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
            long e = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
            if (e == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
            if (e <= 0 || e >= MAX_ERRNO) {
                Py_DECREF(seq);
                PyErr_Format(PyExc_ValueError, "transient errno %ld out of range [1, %d)", e, MAX_ERRNO);
                return -1;
            }
            mask[e / 64] |= (uint64_t)1 << (e % 64);
        }
        Py_DECREF(seq);
    }
    if (queue_depth < 1 || queue_depth > MAX_QUEUE_DEPTH) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be in [1, %d]", MAX_QUEUE_DEPTH);
        return -1;
    }
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "Ring already initialised");
        return -1;
    }
    err = ring_setup(&self->ring, (unsigned)queue_depth, flags);
    if (err < 0) {
        errno = -err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    memcpy(self->ring.transient, mask, sizeof(mask));
    self->open = 1;
    return 0;
}

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    RingObject *self = (RingObject *)type->tp_alloc(type, 0);
    if (self) {
        self->ring.ring_fd = -1;
        self->open = 0;
        self->busy = 0;
    }
    return (PyObject *)self;
}

static void Ring_dealloc(RingObject *self)
{
    /* busy cannot be set here: read() holds a reference to self. */
    if (self->open) {
        ring_destroy(&self->ring);
        self->open = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "cannot close a Ring while a read is running");
        return NULL;
    }
    if (self->open) {
        ring_destroy(&self->ring);
        self->open = 0;
    }
    Py_RETURN_NONE;
}

/* Whether a batch may start on this ring; sets the Python error when not. */
static int ring_usable(RingObject *self, const char *what)
{
    if (!self->open) {
        PyErr_Format(PyExc_ValueError, "%s on a closed Ring", what);
        return 0;
    }
    if (self->ring.broken) {
        PyErr_SetString(PyExc_OSError, "the ring failed earlier; create a new one");
        return 0;
    }
    if (self->busy) {
        PyErr_Format(PyExc_RuntimeError, "Ring.%s is not reentrant: one call at a time per Ring", what);
        return 0;
    }
    return 1;
}

static unsigned default_wait_batch(const RingObject *self, int wait_batch)
{
    if (wait_batch > 0)
        return (unsigned)wait_batch;
    /* Default: wait for a quarter of the queue per syscall. */
    return self->ring.queue_depth / 4 > 0 ? self->ring.queue_depth / 4 : 1;
}

/* Runs a prepared batch with the GIL released and adds up its statistics. */
static void ring_run(RingObject *self, batch_t *b)
{
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    batch_run(&self->ring, b);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    self->n_enter += b->n_enter;
    self->n_retries += b->n_retries;
}

/* Sets OSError for a batch that failed with an errno (b->err != 0). */
static void raise_batch_error(const batch_t *b)
{
    PyObject *exc_args;
    const char *what = b->enter_failed ? "io_uring_enter failed during batch"
                                       : (b->eof ? "end of file" : strerror(b->err));
    int64_t i = b->err_index;
    if (b->enter_failed) {
        exc_args = Py_BuildValue("(is)", b->err, what);
    } else {
        /* The sentence of tiers.policy.failure_message. */
        PyObject *msg = PyUnicode_FromFormat(
            "read of %lld bytes at file offset %lld failed after %lld bytes "
            "and %d retries: %s",
            (long long)batch_len(b, i), (long long)b->offsets[i],
            (long long)b->err_done, b->err_tries, what);
        exc_args = msg ? Py_BuildValue("(iN)", b->err, msg) : NULL;
    }
    if (exc_args) {
        PyErr_SetObject(PyExc_OSError, exc_args);
        Py_DECREF(exc_args);
    }
}

static PyObject *Ring_read(RingObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "offsets", "lengths", "dest", "dest_offsets",
                             "retries", "wait_batch", NULL};
    int fd, retries = 3, wait_batch = -1;
    PyObject *offsets_obj, *lengths_obj, *dest_obj, *doffs_obj;
    Py_buffer offs = {0}, lens = {0}, dest = {0}, doffs = {0};
    int have_lens = 0;
    batch_t b;
    int64_t bad;
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOO|ii", kwlist, &fd, &offsets_obj,
                                     &lengths_obj, &dest_obj, &doffs_obj, &retries,
                                     &wait_batch))
        return NULL;
    if (!ring_usable(self, "read"))
        return NULL;
    if (retries < 0)
        retries = 0;

    memset(&b, 0, sizeof(b));
    b.fd = fd;
    b.fixed_file = ring_file(&self->ring, fd);
    b.retries = retries;

    if (get_int64_buffer(offsets_obj, &offs, "offsets") < 0)
        goto done;
    if (get_int64_buffer(doffs_obj, &doffs, "dest_offsets") < 0)
        goto done;
    if (PyLong_Check(lengths_obj)) {
        b.length = PyLong_AsLongLong(lengths_obj);
        if (b.length == -1 && PyErr_Occurred())
            goto done;
        b.lengths = NULL;
    } else {
        if (get_int64_buffer(lengths_obj, &lens, "lengths") < 0)
            goto done;
        have_lens = 1;
        b.lengths = (const int64_t *)lens.buf;
    }
    if (PyObject_GetBuffer(dest_obj, &dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        dest.obj = NULL;
        goto done;
    }

    b.n = offs.len / 8;
    if (doffs.len / 8 != b.n || (have_lens && lens.len / 8 != b.n)) {
        PyErr_Format(PyExc_ValueError,
                     "offsets, lengths and dest_offsets must have the same length "
                     "(%zd, %zd, %zd)", offs.len / 8,
                     have_lens ? lens.len / 8 : offs.len / 8, doffs.len / 8);
        goto done;
    }
    b.offsets = (const int64_t *)offs.buf;
    b.dest_offsets = (const int64_t *)doffs.buf;
    b.dest = (char *)dest.buf;
    b.wait_batch = default_wait_batch(self, wait_batch);

    bad = batch_check(&b, (int64_t)dest.len);
    if (bad >= 0) {
        int64_t len = batch_len(&b, bad);
        PyErr_Format(PyExc_ValueError,
                     "read %lld out of range: file offset %lld, length %lld, "
                     "dest offset %lld, dest size %lld",
                     (long long)bad, (long long)b.offsets[bad], (long long)len,
                     (long long)b.dest_offsets[bad], (long long)dest.len);
        goto done;
    }

    ring_run(self, &b);
    if (b.err) {
        raise_batch_error(&b);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);

done:
    if (offs.obj) PyBuffer_Release(&offs);
    if (doffs.obj) PyBuffer_Release(&doffs);
    if (lens.obj) PyBuffer_Release(&lens);
    if (dest.obj) PyBuffer_Release(&dest);
    return result;
}

/* ------------------------------------------------------------------------ */
/* Rows of a paged table: read whole pages, check them, copy rows out        */
/* ------------------------------------------------------------------------ */

/* The table's page checksum (table/pagesum_dispatch.h, _pagesum_avx2.c compiled in). */
static uint32_t page_sum(const uint8_t *page, size_t len)
{
    uint32_t sum;
    pagesum_pages(page, len, 1, &sum, 0);
    return sum;
}

typedef struct {
    const int64_t *ids;       /* [n] requested rows, in the caller's order */
    const int64_t *order;     /* [n] positions grouped by page; NULL: ids are already */
    const int64_t *first;     /* [m + 1] page j serves order[first[j] .. first[j+1]) */
    const int64_t *pages;     /* [m] distinct data pages, ascending */
    const uint32_t *sums;     /* the table's page checksums; NULL: no check */
    char *out;                /* [n, row_bytes] */
    int64_t row_bytes, rows_per_page;
    int damage;               /* test hook: flip a byte of this many pages as they arrive */
    uint8_t *reread;          /* [m] page j was read again */

    /* outcome */
    int64_t checked, rereads, bad_page;
} rows_t;

/* A page arrived: check it (once more from the medium if it differs), then copy its rows. */
static int rows_page_done(batch_t *b, const slot_t *s)
{
    rows_t *c = (rows_t *)b->ctx;
    int64_t j = s->index;
    uint8_t *page = (uint8_t *)s->buf;

    if (c->damage > 0) {
        c->damage--;
        page[5] ^= 0xFF;
    }
    if (c->sums) {
        if (!c->reread[j])
            c->checked++;
        if (page_sum(page, (size_t)b->length) != c->sums[c->pages[j]]) {
            if (!c->reread[j]) {
                c->reread[j] = 1;
                c->rereads++;
                return 1;
            }
            c->bad_page = c->pages[j];
            b->halted = 1;
            return 0;
        }
    }
    for (int64_t k = c->first[j]; k < c->first[j + 1]; k++) {
        int64_t pos = c->order ? c->order[k] : k;
        memcpy(c->out + pos * c->row_bytes,
               page + (c->ids[pos] % c->rows_per_page) * c->row_bytes, (size_t)c->row_bytes);
    }
    return 0;
}

typedef struct {
    int64_t page, pos;
} page_pos_t;

static int page_pos_cmp(const void *a, const void *b)
{
    const page_pos_t *x = a, *y = b;
    if (x->page != y->page)
        return x->page < y->page ? -1 : 1;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

/* Groups the rows by page: fills c->pages, c->first, c->order (kept NULL when the ids
 * never go back to an earlier page) and file offsets[m]; returns m, or -1 (no memory).
 * Arrays are malloc'ed into *mem (freed by the caller). */
static int64_t rows_plan(rows_t *c, int64_t n, int64_t data_offset, int64_t page_bytes,
                         int64_t **offsets, void **mem)
{
    const int64_t *ids = c->ids, rpp = c->rows_per_page;
    int sorted = 1;
    int64_t m = 0, *pages, *first, *order = NULL;
    char *block;

    for (int64_t i = 1; i < n && sorted; i++)
        sorted = ids[i] / rpp >= ids[i - 1] / rpp;
    /* pages[n], first[n + 1], offsets[n], order[n] (unsorted only), reread[n] */
    block = malloc((size_t)n * 8 * (sorted ? 3 : 4) + 8 + (size_t)n);
    if (!block)
        return -1;
    *mem = block;
    pages = (int64_t *)block;
    first = pages + n;
    *offsets = first + n + 1;
    if (!sorted) {
        page_pos_t *pp = malloc((size_t)n * sizeof(page_pos_t));
        if (!pp)
            return -1;
        order = *offsets + n;
        for (int64_t i = 0; i < n; i++) {
            pp[i].page = ids[i] / rpp;
            pp[i].pos = i;
        }
        qsort(pp, (size_t)n, sizeof(page_pos_t), page_pos_cmp);
        for (int64_t k = 0; k < n; k++)
            order[k] = pp[k].pos;
        free(pp);
    }
    for (int64_t k = 0; k < n; k++) {
        int64_t p = ids[order ? order[k] : k] / rpp;
        if (m == 0 || pages[m - 1] != p) {
            pages[m] = p;
            first[m] = k;
            (*offsets)[m] = data_offset + p * page_bytes;
            m++;
        }
    }
    first[m] = n;
    c->pages = pages;
    c->first = first;
    c->order = order;
    c->reread = (uint8_t *)(*offsets + (sorted ? n : 2 * n));
    memset(c->reread, 0, (size_t)n);
    return m;
}

#define HUGE_PAGE_BYTES ((size_t)2 << 20)
/* Slots of at least this many bytes go on transparent huge pages. */
#define HUGE_SLOTS_MIN ((size_t)256 << 10)

/* Allocates `bytes` of page slots, on a transparent huge page when `huge` (aligned to it and
 * rounded up to whole huge pages: a check of a slot then takes no TLB miss, which in a
 * virtual machine costs a two-level page walk), and registers them with the ring.
 * Returns 0, or -1 (no memory); r->pages_fixed says whether the registration took. */
static int ring_pages_alloc(ring_t *r, size_t bytes, int huge)
{
    struct iovec iov;
    size_t align = huge ? HUGE_PAGE_BYTES : 4096;
    size_t len = huge ? (bytes + HUGE_PAGE_BYTES - 1) & ~(HUGE_PAGE_BYTES - 1) : bytes;
    if (posix_memalign((void **)&r->pages, align, len)) {
        r->pages = NULL;
        return -1;
    }
    /* Advice only: the kernel may still use 4 KiB pages (THP off, no free huge page). */
    r->pages_huge = huge && madvise(r->pages, len, MADV_HUGEPAGE) == 0;
    iov.iov_base = r->pages;
    iov.iov_len = bytes;
    r->pages_fixed = sys_io_uring_register(r->ring_fd, IORING_REGISTER_BUFFERS, &iov, 1) == 0;
    return 0;
}

/* The ring's page slots (one page per read in flight), page-aligned for O_DIRECT, and
 * registered with the ring where the kernel allows.  A huge page pins 2 MiB: when
 * RLIMIT_MEMLOCK refuses that, 4 KiB pages are registered instead; when it refuses those
 * too, reads are plain (not READ_FIXED). */
static char *ring_pages(ring_t *r, int64_t page_bytes)
{
    size_t bytes = (size_t)r->queue_depth * (size_t)page_bytes;
    if (r->pages && r->page_bytes == (size_t)page_bytes)
        return r->pages;
    if (r->pages_fixed)
        sys_io_uring_register(r->ring_fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
    free(r->pages);
    r->pages = NULL;
    r->pages_fixed = r->pages_huge = 0;
    if (bytes >= HUGE_SLOTS_MIN && ring_pages_alloc(r, bytes, 1) == 0 && !r->pages_fixed) {
        free(r->pages); /* the huge page could not be pinned: try 4 KiB pages */
        r->pages = NULL;
        r->pages_huge = 0;
    }
    if (!r->pages)
        ring_pages_alloc(r, bytes, 0);
    r->page_bytes = r->pages ? (size_t)page_bytes : 0;
    return r->pages;
}

static PyObject *Ring_read_rows(RingObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "ids", "out", "data_offset", "page_bytes", "rows_per_page",
                             "row_bytes", "num_rows", "page_sums", "retries", "wait_batch",
                             "damage", NULL};
    int fd, retries = 3, wait_batch = -1, damage = 0;
    long long data_offset, page_bytes, rows_per_page, row_bytes, num_rows;
    PyObject *ids_obj, *out_obj, *sums_obj = Py_None;
    Py_buffer ids = {0}, out = {0}, sums = {0};
    rows_t c;
    batch_t b;
    int64_t n, num_pages, *offsets = NULL;
    void *mem = NULL;
    PyObject *result = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOLLLLL|Oiii", kwlist, &fd, &ids_obj, &out_obj,
                                     &data_offset, &page_bytes, &rows_per_page, &row_bytes,
                                     &num_rows, &sums_obj, &retries, &wait_batch, &damage))
        return NULL;
    if (!ring_usable(self, "read_rows"))
        return NULL;
    if (data_offset < 0 || page_bytes <= 0 || page_bytes > MAX_READ_LEN || rows_per_page < 1 ||
        row_bytes < 1 || row_bytes > page_bytes / rows_per_page || num_rows < 0) {
        PyErr_Format(PyExc_ValueError,
                     "bad page layout: data_offset %lld, page_bytes %lld, rows_per_page %lld, "
                     "row_bytes %lld, num_rows %lld", data_offset, page_bytes, rows_per_page,
                     row_bytes, num_rows);
        return NULL;
    }
    memset(&c, 0, sizeof(c));
    memset(&b, 0, sizeof(b));
    c.bad_page = -1;
    num_pages = (num_rows + rows_per_page - 1) / rows_per_page;

    if (get_int64_buffer(ids_obj, &ids, "ids") < 0)
        goto done;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        out.obj = NULL;
        goto done;
    }
    n = ids.len / 8;
    if (out.len / row_bytes < n) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes: %lld rows of %lld bytes need %lld",
                     out.len, (long long)n, row_bytes, (long long)n * row_bytes);
        goto done;
    }
    if (sums_obj != Py_None) {
        if (PyObject_GetBuffer(sums_obj, &sums, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            sums.obj = NULL;
            goto done;
        }
        if (sums.itemsize != 4 || sums.len / 4 < num_pages) {
            PyErr_Format(PyExc_ValueError, "page_sums must hold a uint32 for each of the %lld pages",
                         (long long)num_pages);
            goto done;
        }
        c.sums = (const uint32_t *)sums.buf;
    }
    c.ids = (const int64_t *)ids.buf;
    for (int64_t i = 0; i < n; i++) {
        if (c.ids[i] < 0 || c.ids[i] >= num_rows) {
            PyErr_Format(PyExc_IndexError,
                         "row id %lld (at position %lld) is out of range: the table has %lld rows",
                         (long long)c.ids[i], (long long)i, num_rows);
            goto done;
        }
    }
    if (n == 0) {
        result = Py_BuildValue("(iiii)", 0, 0, 0, -1);
        goto done;
    }
    c.out = (char *)out.buf;
    c.row_bytes = row_bytes;
    c.rows_per_page = rows_per_page;
    c.damage = damage;

    b.fd = fd;
    b.fixed_file = ring_file(&self->ring, fd);
    b.retries = retries < 0 ? 0 : retries;
    b.length = page_bytes;
    b.n = rows_plan(&c, n, data_offset, page_bytes, &offsets, &mem);
    b.slot_bufs = b.n >= 0 ? ring_pages(&self->ring, page_bytes) : NULL;
    if (!b.slot_bufs) {
        PyErr_NoMemory();
        goto done;
    }
    b.fixed = self->ring.pages_fixed;
    b.offsets = offsets;
    b.on_done = rows_page_done;
    b.ctx = &c;
    b.wait_batch = default_wait_batch(self, wait_batch);

    ring_run(self, &b);
    if (b.err) {
        raise_batch_error(&b);
        goto done;
    }
    /* reads issued (rereads included), pages checked, pages read again, the bad page or -1 */
    result = Py_BuildValue("(LLLL)", (long long)(b.n + c.rereads), (long long)c.checked,
                           (long long)c.rereads, (long long)c.bad_page);

done:
    free(mem);
    if (ids.obj) PyBuffer_Release(&ids);
    if (out.obj) PyBuffer_Release(&out);
    if (sums.obj) PyBuffer_Release(&sums);
    return result;
}

static PyObject *Ring_get_queue_depth(RingObject *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->open ? self->ring.queue_depth : 0);
}

static PyObject *Ring_get_setup_flags(RingObject *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->open ? self->ring.setup_flags : 0);
}

static PyObject *Ring_get_features(RingObject *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->open ? self->ring.features : 0);
}

static PyObject *Ring_get_closed(RingObject *self, void *closure)
{
    return PyBool_FromLong(!self->open);
}

static PyObject *Ring_get_n_enter(RingObject *self, void *closure)
{
    return PyLong_FromLongLong(self->n_enter);
}

static PyObject *Ring_get_n_retries(RingObject *self, void *closure)
{
    return PyLong_FromLongLong(self->n_retries);
}

static PyObject *Ring_get_fixed_pages(RingObject *self, void *closure)
{
    return PyBool_FromLong(self->open && self->ring.pages_fixed);
}

static PyObject *Ring_get_fixed_file(RingObject *self, void *closure)
{
    return PyBool_FromLong(self->open && self->ring.file_registered);
}

static PyObject *Ring_get_huge_pages(RingObject *self, void *closure)
{
    return PyBool_FromLong(self->open && self->ring.pages && self->ring.pages_huge);
}

static PyObject *Ring_get_broken(RingObject *self, void *closure)
{
    return PyBool_FromLong(self->open && self->ring.broken);
}

static PyMethodDef Ring_methods[] = {
    {"read", (PyCFunction)(void (*)(void))Ring_read, METH_VARARGS | METH_KEYWORDS,
     "read(fd, offsets, lengths, dest, dest_offsets, retries=3, wait_batch=-1)\n"
     "Reads lengths[i] bytes at offsets[i] into dest[dest_offsets[i]:]."},
    {"read_rows", (PyCFunction)(void (*)(void))Ring_read_rows, METH_VARARGS | METH_KEYWORDS,
     "read_rows(fd, ids, out, data_offset, page_bytes, rows_per_page, row_bytes, num_rows,\n"
     "          page_sums=None, retries=3, wait_batch=-1, damage=0)\n"
     "Rows ids of a paged table into out [n, row_bytes]: whole pages read, checked against\n"
     "page_sums, rows copied out. -> (reads, pages_checked, page_rereads, bad_page or -1)."},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "Unmaps the ring and closes it."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"queue_depth", (getter)Ring_get_queue_depth, NULL, "reads kept in flight", NULL},
    {"setup_flags", (getter)Ring_get_setup_flags, NULL, "IORING_SETUP_* flags in use", NULL},
    {"features", (getter)Ring_get_features, NULL, "IORING_FEAT_* reported by the kernel", NULL},
    {"closed", (getter)Ring_get_closed, NULL, "whether close() was called", NULL},
    {"n_enter", (getter)Ring_get_n_enter, NULL, "io_uring_enter calls made by read()", NULL},
    {"n_retries", (getter)Ring_get_n_retries, NULL, "reads reissued by read()", NULL},
    {"fixed_pages", (getter)Ring_get_fixed_pages, NULL,
     "read_rows reads into page slots registered with the ring (READ_FIXED)", NULL},
    {"fixed_file", (getter)Ring_get_fixed_file, NULL,
     "the file last read is registered with the ring (reads name it by index)", NULL},
    {"huge_pages", (getter)Ring_get_huge_pages, NULL,
     "read_rows's page slots lie on memory advised for transparent huge pages", NULL},
    {"broken", (getter)Ring_get_broken, NULL, "io_uring_enter failed: make a new Ring", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "engram_offload.tiers._uring.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(queue_depth=128, setup_flags=-1, transient=()): an io_uring for batched reads.",
    .tp_new = Ring_new,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
};

/* ------------------------------------------------------------------------ */
/* Module                                                                    */
/* ------------------------------------------------------------------------ */

static PyObject *mod_probe(PyObject *mod, PyObject *Py_UNUSED(ignored))
{
    ring_t r;
    int err = ring_setup(&r, 1, -1);
    if (err < 0) {
        errno = -err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    ring_destroy(&r);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"probe", (PyCFunction)mod_probe, METH_NOARGS,
     "Creates and destroys a small ring; raises OSError if io_uring is unusable."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef uring_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "engram_offload.tiers._uring",
    .m_doc = "Batched positional reads through io_uring (raw syscalls).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__uring(void)
{
    PyObject *m;
    pagesum_init();
    if (PyType_Ready(&RingType) < 0)
        return NULL;
    m = PyModule_Create(&uring_module);
    if (!m)
        return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "SETUP_COOP_TASKRUN", IORING_SETUP_COOP_TASKRUN);
    PyModule_AddIntConstant(m, "SETUP_SINGLE_ISSUER", IORING_SETUP_SINGLE_ISSUER);
    PyModule_AddIntConstant(m, "SETUP_DEFER_TASKRUN", IORING_SETUP_DEFER_TASKRUN);
    return m;
}
