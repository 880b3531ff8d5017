/*
 * Copies out of a file mapping that survive the file shrinking under them.
 *
 * copy_spans(src_address, src_len, offsets, lengths, dest, dest_offsets) -> 0 or errno
 *   src_address, src_len   a live mapping (its address as an int, its length)
 *   offsets, lengths       int64 [n]: byte ranges of the mapping
 *   dest                   writable buffer; dest_offsets int64 [n]: where each range goes
 *
 * Touching a mapped page past the end of a truncated file raises SIGBUS. Around the copy
 * a thread-local jump buffer is armed; the process-wide SIGBUS handler jumps back to it
 * when the fault happened inside a guarded copy of that thread, and otherwise hands the
 * signal to the handler that was installed before (so faulthandler and default crashes
 * still work). The copy then returns EFAULT and the caller raises a clean error. The GIL
 * is released for the copy. The handler is (re)installed when another one replaced it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

/* volatile: the stores around the copy must happen in order (memcpy does not read it, so
 * the compiler would otherwise drop the store that arms the guard). */
static __thread sigjmp_buf *volatile guard;
static struct sigaction previous;
static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    sigjmp_buf *jb = guard;
    if (jb != NULL) {
        guard = NULL;
        siglongjmp(*jb, 1);
    }
    /* Not ours: behave as the handler before us would have. */
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction) { previous.sa_sigaction(sig, info, context); return; }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    signal(sig, SIG_DFL); /* the faulting access repeats on return and kills the process */
}

static int ensure_handler(void) {
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0) return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return 0;
    pthread_mutex_lock(&install_lock);
    int rc = 0;
    if (sigaction(SIGBUS, NULL, &now) == 0 && !((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus)) {
        struct sigaction mine;
        memset(&mine, 0, sizeof mine);
        mine.sa_sigaction = on_sigbus;
        mine.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&mine.sa_mask);
        previous = now;
        rc = sigaction(SIGBUS, &mine, NULL);
    }
    pthread_mutex_unlock(&install_lock);
    return rc;
}

static int guarded_copy(const uint8_t *src, uint8_t *dst, const int64_t *offs, const int64_t *lens,
                        const int64_t *doffs, Py_ssize_t n) {
    sigjmp_buf jb;
    /* savemask=1: the handler's blocked SIGBUS is unblocked again by the jump. */
    if (sigsetjmp(jb, 1) != 0) return EFAULT;
    guard = &jb;
    __asm__ volatile("" ::: "memory");
    for (Py_ssize_t i = 0; i < n; i++) memcpy(dst + doffs[i], src + offs[i], (size_t)lens[i]);
    __asm__ volatile("" ::: "memory");
    guard = NULL;
    return 0;
}

static int as_int64s(Py_buffer *b, Py_ssize_t n, const char *name) {
    if (b->len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd int64", name, b->len, n);
        return -1;
    }
    return 0;
}

static PyObject *copy_spans(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t src_len;
    Py_buffer offs, lens, dest, doffs;
    if (!PyArg_ParseTuple(args, "Kny*y*w*y*", &address, &src_len, &offs, &lens, &dest, &doffs)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = offs.len / (Py_ssize_t)sizeof(int64_t);
    if (as_int64s(&offs, n, "offsets") || as_int64s(&lens, n, "lengths") || as_int64s(&doffs, n, "dest_offsets"))
        goto done;
    const int64_t *o = offs.buf, *l = lens.buf, *d = doffs.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (o[i] < 0 || l[i] < 0 || o[i] + l[i] > src_len || d[i] < 0 || d[i] + l[i] > dest.len) {
            PyErr_Format(PyExc_ValueError, "span %zd (offset %lld, length %lld, to %lld) is out of bounds", i,
                         (long long)o[i], (long long)l[i], (long long)d[i]);
            goto done;
        }
    }
    if (ensure_handler() != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = guarded_copy((const uint8_t *)(uintptr_t)address, dest.buf, o, l, d, n);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(rc);
done:
    PyBuffer_Release(&offs);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&dest);
    PyBuffer_Release(&doffs);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_spans", copy_spans, METH_VARARGS,
     "copy_spans(address, length, offsets, lengths, dest, dest_offsets) -> 0, or EFAULT on SIGBUS."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_safecopy", "SIGBUS-guarded copies from a mapping.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__safecopy(void) { return PyModule_Create(&module); }
