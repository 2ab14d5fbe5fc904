/* Batched file reads for the posix backend, run with the GIL released.
 *
 * Each of the backend's reader threads calls run() once per batch phase; run() takes
 * tasks from a shared counter until none are left, so one GIL release covers a whole
 * batch's opens, preads and closes, instead of three GIL round trips per file.
 *
 * Phase 1 (nowait = 1, one thread per core) reads with RWF_NOWAIT: what the page
 * cache holds is copied at once, and a task that would wait for the disk is appended
 * to `pending` with the bytes it got so far in `done`. Phase 2 (nowait = 0, io_threads
 * threads) does the pending reads, blocking, so that cold data gets many reads in
 * flight while cached data is not copied by more threads than there are cores.
 *
 * Task k reads lengths[k] bytes of file paths[file[k]] at offsets[k] into base +
 * dests[k] and needs at least needs[k] of them. A file read by several tasks is
 * opened once: fds[file] holds its descriptor (-1 until the first task opens it,
 * -2 while it is being opened); the caller closes those afterwards. A file read by
 * one task (shared[file] == 0) is opened and closed by that task.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0 /* no non-blocking reads here: phase 1 then reads everything */
#endif

enum { OK = 0, OPEN_FAILED = 1, READ_FAILED = 2, SHORT_READ = 3 };

typedef struct {
    const char **paths;
    const int32_t *file;
    const int64_t *offsets, *lengths, *dests, *needs;
    const int8_t *shared;
    int32_t *fds;
    int64_t *counter, n;
    int32_t *stop;
    const int64_t *todo;           /* task ids of this phase */
    int64_t *pending, *npending;   /* phase 1 appends here the tasks it left */
    int64_t *done;                 /* bytes of each task already read */
    char *base;
    int flags, nowait;
} Batch;

static int open_shared(Batch *b, int32_t f, int *err) {
    for (;;) {
        int32_t fd = __atomic_load_n(&b->fds[f], __ATOMIC_ACQUIRE);
        if (fd >= 0) return fd;
        int32_t expected = -1;
        if (fd == -1 && __atomic_compare_exchange_n(&b->fds[f], &expected, -2, 0,
                                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            fd = open(b->paths[f], b->flags);
            if (fd < 0) {
                *err = errno;
                __atomic_store_n(&b->fds[f], -1, __ATOMIC_RELEASE);
                return -1;
            }
            __atomic_store_n(&b->fds[f], fd, __ATOMIC_RELEASE);
            return fd;
        }
        sched_yield(); /* another thread is opening it */
    }
}

static PyObject *run(PyObject *self, PyObject *args) {
    PyObject *paths;
    Py_buffer bufs[13];
    unsigned long long base;
    int flags, nowait;
    if (!PyArg_ParseTuple(args, "O!y*y*y*y*y*y*w*w*w*y*w*w*w*Kii", &PyTuple_Type, &paths, &bufs[0],
                          &bufs[1], &bufs[2], &bufs[3], &bufs[4], &bufs[5], &bufs[6], &bufs[7], &bufs[8],
                          &bufs[9], &bufs[10], &bufs[11], &bufs[12], &base, &flags, &nowait))
        return NULL;
    /* file, offsets, lengths, dests, needs, shared | fds, counter, stop (writable) |
       todo | pending, npending, done (writable) */
    Py_ssize_t npaths = PyTuple_GET_SIZE(paths);
    const char **cpaths = PyMem_Malloc(sizeof(char *) * (npaths ? npaths : 1));
    PyObject *result = NULL;
    if (!cpaths) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < npaths; i++) {
        PyObject *p = PyTuple_GET_ITEM(paths, i);
        if (!PyBytes_Check(p)) {
            PyErr_SetString(PyExc_TypeError, "paths must be bytes");
            goto done;
        }
        cpaths[i] = PyBytes_AS_STRING(p);
    }
    Batch b = {cpaths, bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, bufs[4].buf, bufs[5].buf,
               bufs[6].buf, bufs[7].buf, (int64_t)(bufs[9].len / 8), bufs[8].buf, bufs[9].buf,
               bufs[10].buf, bufs[11].buf, bufs[12].buf, (char *)base, flags, nowait && RWF_NOWAIT};
    int status = OK, err = 0;
    int64_t task = -1, got = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (__atomic_load_n(b.stop, __ATOMIC_RELAXED)) break;
        int64_t i = __atomic_fetch_add(b.counter, 1, __ATOMIC_RELAXED);
        if (i >= b.n) break;
        int64_t k = b.todo[i];
        int32_t f = b.file[k];
        int own = !b.shared[f];
        int fd = own ? open(b.paths[f], b.flags) : open_shared(&b, f, &err);
        if (fd < 0) {
            if (own) err = errno;
            status = OPEN_FAILED, task = k;
            break;
        }
        char *out = b.base + b.dests[k];
        int64_t length = b.lengths[k], off = b.offsets[k];
        got = b.done[k];
        if (b.nowait) {
            while (got < length) {
                struct iovec iov = {out + got, (size_t)(length - got)};
                ssize_t r = preadv2(fd, &iov, 1, off + got, RWF_NOWAIT);
                if (r <= 0) break; /* would block, unsupported, EOF or error: phase 2 decides */
                got += r;
            }
            if (got < length) {
                b.done[k] = got;
                b.pending[__atomic_fetch_add(b.npending, 1, __ATOMIC_RELAXED)] = k;
                if (own) close(fd);
                continue;
            }
        }
        while (got < length) {
            ssize_t r = pread(fd, out + got, (size_t)(length - got), off + got);
            if (r < 0) {
                if (errno == EINTR) continue;
                if (errno == EINVAL && got && (b.flags & O_DIRECT)) break; /* partial block at EOF */
                err = errno, status = READ_FAILED, task = k;
                break;
            }
            if (r == 0) break;
            got += r;
        }
        if (own) close(fd);
        if (status != OK) break;
        if (got < b.needs[k]) {
            status = SHORT_READ, task = k;
            break;
        }
    }
    if (status != OK) __atomic_store_n(b.stop, 1, __ATOMIC_RELAXED);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(iLiL)", status, (long long)task, err, (long long)got);
done:
    PyMem_Free(cpaths);
    for (int i = 0; i < 13; i++) PyBuffer_Release(&bufs[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS,
     "run(paths, file, offsets, lengths, dests, needs, shared, fds, counter, stop, todo, pending,"
     " npending, done, base, flags, nowait) -> (status, task, errno, bytes read): read tasks until"
     " none are left, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio._native",
                                    "Batched preads with the GIL released.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
