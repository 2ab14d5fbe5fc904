/* Batched file reads for the posix backend, run with the GIL released.
 *
 * run() reads one batch phase on the calling thread and `workers - 1` helper threads;
 * each takes tasks from a shared counter until none are left, so one GIL release covers
 * a whole batch's opens, preads and closes, instead of three GIL round trips per file.
 * The helpers are C threads of a pool kept for the process: they need no GIL to start
 * or to finish, so Python running on other threads (a Loader's consumer) does not hold
 * back a batch's copy.
 *
 * Phase 1 (nowait = 1, one thread per core) reads with RWF_NOWAIT: what the page
 * cache holds is copied at once, and a task that would wait for the disk is appended
 * to `pending` with the bytes it got so far in `done`. Phase 2 (nowait = 0, io_threads
 * threads) does the pending reads, blocking, so that cold data gets many reads in
 * flight while cached data is not copied by more threads than there are cores.
 *
 * File f's path is root + blob[starts[f]:ends[f]] (a PathTable's packed paths, so that no
 * Python string is made per file). Task k reads lengths[k] bytes of file file[k] at offsets[k] into base +
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
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0 /* no non-blocking reads here: phase 1 then reads everything */
#endif

enum { OK = 0, OPEN_FAILED = 1, READ_FAILED = 2, SHORT_READ = 3 };

typedef struct {
    const char *root, *blob; /* root_len bytes of root, then a path of blob, make a file path */
    size_t root_len;
    const int64_t *starts, *ends;
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

/* open(2) of file f; -1 with errno set where it fails (ENAMETOOLONG past PATH_MAX). */
static int open_file(const Batch *b, int32_t f) {
    char path[PATH_MAX];
    size_t n = (size_t)(b->ends[f] - b->starts[f]);
    if (b->root_len + n >= sizeof path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(path, b->root, b->root_len);
    memcpy(path + b->root_len, b->blob + b->starts[f], n);
    path[b->root_len + n] = '\0';
    return open(path, b->flags);
}

static int open_shared(Batch *b, int32_t f, int *err) {
    for (;;) {
        int32_t fd = __atomic_load_n(&b->fds[f], __ATOMIC_ACQUIRE);
        if (fd >= 0) return fd;
        int32_t expected = -1;
        if (fd == -1 && __atomic_compare_exchange_n(&b->fds[f], &expected, -2, 0,
                                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            fd = open_file(b, f);
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

typedef struct {
    int status, err;
    int64_t task, got;
} Result;

/* Take tasks until none are left, a task fails, or another thread failed (b->stop). */
static void work(Batch *b, Result *r) {
    int status = OK, err = 0;
    int64_t task = -1, got = 0;
    for (;;) {
        if (__atomic_load_n(b->stop, __ATOMIC_RELAXED)) break;
        int64_t i = __atomic_fetch_add(b->counter, 1, __ATOMIC_RELAXED);
        if (i >= b->n) break;
        int64_t k = b->todo[i];
        int32_t f = b->file[k];
        int own = !b->shared[f];
        int fd = own ? open_file(b, f) : open_shared(b, f, &err);
        if (fd < 0) {
            if (own) err = errno;
            status = OPEN_FAILED, task = k;
            break;
        }
        char *out = b->base + b->dests[k];
        int64_t length = b->lengths[k], off = b->offsets[k];
        got = b->done[k];
        if (b->nowait) {
            while (got < length) {
                struct iovec iov = {out + got, (size_t)(length - got)};
                ssize_t n = preadv2(fd, &iov, 1, off + got, RWF_NOWAIT);
                if (n <= 0) break; /* would block, unsupported, EOF or error: phase 2 decides */
                got += n;
            }
            if (got < length) {
                b->done[k] = got;
                b->pending[__atomic_fetch_add(b->npending, 1, __ATOMIC_RELAXED)] = k;
                if (own) close(fd);
                continue;
            }
        }
        while (got < length) {
            ssize_t n = pread(fd, out + got, (size_t)(length - got), off + got);
            if (n < 0) {
                if (errno == EINTR) continue;
                if (errno == EINVAL && got && (b->flags & O_DIRECT)) break; /* partial block at EOF */
                err = errno, status = READ_FAILED, task = k;
                break;
            }
            if (n == 0) break;
            got += n;
        }
        if (own) close(fd);
        if (status != OK) break;
        if (got < b->needs[k]) {
            status = SHORT_READ, task = k;
            break;
        }
    }
    if (status != OK) __atomic_store_n(b->stop, 1, __ATOMIC_RELAXED);
    *r = (Result){status, err, task, got};
}

/* ---- the helper pool ------------------------------------------------------------------
 * A job is posted with the number of helpers it wants; idle helpers join it (each with a
 * result slot) until it has them all or its caller, done with its own share, withdraws
 * it; the caller then waits for the helpers that joined. Several callers (readers on
 * different threads) may post jobs at once. The pool only grows, up to MAX_HELPERS. */
#define MAX_HELPERS 63

typedef struct Job {
    Batch *batch;
    Result *results; /* [0]: the caller's; [1..]: one per helper that joined */
    int want, joined, active;
    struct Job *next;
} Job;

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_work = PTHREAD_COND_INITIALIZER, pool_idle = PTHREAD_COND_INITIALIZER;
static Job *pool_jobs; /* jobs that still take helpers, oldest first */
static int pool_threads, pool_sleeping;
static int pool_forksafe; /* pool_after_fork is registered: only then are helpers started */

static void unlink_job(Job *j) {
    for (Job **p = &pool_jobs; *p; p = &(*p)->next)
        if (*p == j) {
            *p = j->next;
            return;
        }
}

static void *helper(void *unused) {
    (void)unused;
    pthread_mutex_lock(&pool_mu);
    for (;;) {
        Job *j = pool_jobs;
        if (!j) {
            pool_sleeping++;
            pthread_cond_wait(&pool_work, &pool_mu);
            pool_sleeping--;
            continue;
        }
        int slot = ++j->joined;
        j->active++;
        if (j->joined == j->want) unlink_job(j);
        pthread_mutex_unlock(&pool_mu);
        work(j->batch, &j->results[slot]);
        pthread_mutex_lock(&pool_mu);
        if (--j->active == 0) pthread_cond_broadcast(&pool_idle);
    }
    return NULL;
}

/* In a forked child the helpers do not exist and the lock may have been held: start over. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&pool_work, NULL);
    pthread_cond_init(&pool_idle, NULL);
    pool_jobs = NULL;
    pool_threads = pool_sleeping = 0;
}

/* Read the batch on this thread and up to `want` helpers; returns how many joined. */
static int pool_run(Batch *b, int want, Result *results) {
    Job j = {b, results, pool_forksafe ? want : 0, 0, 0, NULL};
    want = j.want;
    if (want > 0) {
        pthread_mutex_lock(&pool_mu);
        while (pool_threads < want) {
            pthread_t t;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&attr, 256 << 10);
            int failed = pthread_create(&t, &attr, helper, NULL);
            pthread_attr_destroy(&attr);
            if (failed) break; /* fewer helpers: the tasks still all get done */
            pool_threads++;
        }
        Job **tail = &pool_jobs;
        while (*tail) tail = &(*tail)->next;
        *tail = &j;
        for (int i = 0; i < want && i < pool_sleeping; i++) pthread_cond_signal(&pool_work); /* not all 63 */
        pthread_mutex_unlock(&pool_mu);
    }
    work(b, &results[0]);
    if (want > 0) {
        pthread_mutex_lock(&pool_mu);
        if (j.joined < want) unlink_job(&j);
        while (j.active) pthread_cond_wait(&pool_idle, &pool_mu);
        pthread_mutex_unlock(&pool_mu);
    }
    return j.joined;
}

static PyObject *run(PyObject *self, PyObject *args) {
    (void)self;
    const char *root;
    Py_ssize_t root_len;
    Py_buffer bufs[16];
    unsigned long long base;
    int flags, nowait, workers;
    if (!PyArg_ParseTuple(args, "y#y*y*y*y*y*y*y*y*y*w*w*w*y*w*w*w*Kiii", &root, &root_len, &bufs[13], &bufs[14],
                          &bufs[15], &bufs[0], &bufs[1], &bufs[2], &bufs[3], &bufs[4], &bufs[5], &bufs[6],
                          &bufs[7], &bufs[8], &bufs[9], &bufs[10], &bufs[11], &bufs[12], &base, &flags, &nowait,
                          &workers))
        return NULL;
    /* blob, starts, ends | file, offsets, lengths, dests, needs, shared | fds, counter, stop (writable) |
       todo | pending, npending, done (writable) */
    PyObject *result = NULL;
    Batch b = {root, bufs[13].buf, (size_t)root_len, bufs[14].buf, bufs[15].buf, bufs[0].buf, bufs[1].buf,
               bufs[2].buf, bufs[3].buf, bufs[4].buf, bufs[5].buf, bufs[6].buf, bufs[7].buf,
               (int64_t)(bufs[9].len / 8), bufs[8].buf, bufs[9].buf, bufs[10].buf, bufs[11].buf, bufs[12].buf,
               (char *)base, flags, nowait && RWF_NOWAIT};
    int want = workers < 1 ? 0 : (workers - 1 > MAX_HELPERS ? MAX_HELPERS : workers - 1);
    Result results[MAX_HELPERS + 1];
    int joined;
    Py_BEGIN_ALLOW_THREADS
    joined = pool_run(&b, want, results);
    Py_END_ALLOW_THREADS
    result = PyList_New(joined + 1);
    for (int i = 0; result && i <= joined; i++) {
        PyObject *r = Py_BuildValue("(iLiL)", results[i].status, (long long)results[i].task, results[i].err,
                                    (long long)results[i].got);
        if (!r) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, r);
    }
    for (int i = 0; i < 16; i++) PyBuffer_Release(&bufs[i]);
    return result;
}

/* sizes(): stat(2) of files root + blob[starts[f]:ends[f]], the GIL released; out[f] is
 * the size in bytes, or -errno where the file cannot be stat'ed. */
static PyObject *sizes(PyObject *self, PyObject *args) {
    (void)self;
    const char *root;
    Py_ssize_t root_len;
    Py_buffer bufs[4]; /* blob, starts, ends | out (writable) */
    if (!PyArg_ParseTuple(args, "y#y*y*y*w*", &root, &root_len, &bufs[0], &bufs[1], &bufs[2], &bufs[3]))
        return NULL;
    const char *blob = bufs[0].buf;
    const int64_t *starts = bufs[1].buf, *ends = bufs[2].buf;
    int64_t *out = bufs[3].buf;
    Py_ssize_t n = bufs[1].len / 8;
    if (bufs[2].len / 8 < n || bufs[3].len / 8 < n) {
        for (int i = 0; i < 4; i++) PyBuffer_Release(&bufs[i]);
        PyErr_SetString(PyExc_ValueError, "sizes: starts, ends and out differ in length");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    char path[PATH_MAX];
    for (Py_ssize_t f = 0; f < n; f++) {
        size_t len = (size_t)(ends[f] - starts[f]);
        struct stat st;
        if ((size_t)root_len + len >= sizeof path) {
            out[f] = -ENAMETOOLONG;
            continue;
        }
        memcpy(path, root, (size_t)root_len);
        memcpy(path + root_len, blob + starts[f], len);
        path[root_len + len] = '\0';
        out[f] = stat(path, &st) ? -(int64_t)errno : (int64_t)st.st_size;
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 4; i++) PyBuffer_Release(&bufs[i]);
    Py_RETURN_NONE;
}

static PyObject *helpers(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    pthread_mutex_lock(&pool_mu);
    int n = pool_threads;
    pthread_mutex_unlock(&pool_mu);
    return PyLong_FromLong(n);
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS,
     "run(root, blob, starts, ends, file, offsets, lengths, dests, needs, shared, fds, counter, stop, todo, pending,"
     " npending, done, base, flags, nowait, workers) -> [(status, task, errno, bytes read), ...]:"
     " read tasks on this thread and workers - 1 pool threads until none are left, GIL released;"
     " one result per thread that took part."},
    {"helpers", helpers, METH_NOARGS, "helpers() -> the helper threads run() has started in this process"},
    {"sizes", sizes, METH_VARARGS,
     "sizes(root, blob, starts, ends, out) -> None: out[f] = the size of file f, or -errno; GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio.storage._readloop",
                                    "Batched preads with the GIL released.", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__readloop(void) {
    if (!pool_forksafe && pthread_atfork(NULL, NULL, pool_after_fork) == 0) pool_forksafe = 1;
    return PyModule_Create(&module);
}
