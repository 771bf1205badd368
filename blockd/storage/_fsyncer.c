/* blockd.storage._fsyncer: a thread of its own that fdatasyncs a file and says so on a pipe.
 *
 * Why C: the step lane's loop (blockd/service/lane_loop.py) hands each batch's
 * wait for durability to another thread. A Python thread there takes the GIL
 * to start each fsync and again after it, and every handover makes the loop
 * give the GIL up and wait for it back: on the 2-core VM that was a tenth of
 * the daemon's CPU with four durable schedulers (futex waits and wakes,
 * perf record) and it held durable steps/s to 1.4-1.6x one scheduler's.
 * This thread never touches Python: the loop asks with request(fd, lsn) (a
 * dup of fd is taken here, so the log may close or rotate its segment
 * meanwhile), and polls fileno() for 24-byte records (int64 lsn, errno,
 * nanoseconds the fdatasync took), all little-endian host order.
 *
 * Requests coalesce: one asked while a sync runs replaces any other waiting
 * (its LSN is the higher, so its sync covers theirs); the next sync starts as
 * soon as the last ends (group commit). blockd/storage/fsyncer.py is the
 * Python front and the fallback where this was not compiled; setup.py
 * builds it with the source's SHA-256 (SOURCE_SHA256) so a stale build is
 * never used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#ifndef BLOCKD_SOURCE_SHA256
#define BLOCKD_SOURCE_SHA256 ""
#endif

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int started;  /* the thread runs and must be joined */
    int stop;     /* under mu: the thread ends once it sees this */
    int fd;       /* under mu: a dup of the file to sync next; -1: nothing asked */
    int64_t lsn;  /* under mu: what that sync covers */
    int read_fd, write_fd;  /* the pipe of completions; -1 once closed */
} Fsyncer;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void *run(void *arg) {
    Fsyncer *self = (Fsyncer *)arg;
#ifdef __linux__
    /* what top -H, perf and bench/daemon_cost.py's per-thread rows call it */
    pthread_setname_np(pthread_self(), "blockd-fsync");
#endif
    for (;;) {
        pthread_mutex_lock(&self->mu);
        while (self->fd < 0 && !self->stop)
            pthread_cond_wait(&self->cv, &self->mu);
        if (self->stop) {
            pthread_mutex_unlock(&self->mu);
            return NULL;
        }
        int fd = self->fd;
        int64_t record[3] = {self->lsn, 0, 0};
        self->fd = -1;
        pthread_mutex_unlock(&self->mu);
        int64_t began = now_ns();
        if (fdatasync(fd) != 0)
            record[1] = errno;
        record[2] = now_ns() - began;
        close(fd);
        /* 24 bytes into a pipe are written whole (under PIPE_BUF); a full
           pipe (a loop that stopped reading) blocks only this thread */
        const char *out = (const char *)record;
        size_t left = sizeof record;
        while (left) {
            ssize_t n = write(self->write_fd, out, left);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                break; /* the read end is gone: nobody waits for this any more */
            }
            out += n;
            left -= (size_t)n;
        }
    }
}

static int Fsyncer_init(Fsyncer *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":Fsyncer", kwlist))
        return -1;
    if (self->started) {
        PyErr_SetString(PyExc_RuntimeError, "Fsyncer is started already");
        return -1;
    }
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (fcntl(fds[0], F_SETFL, O_NONBLOCK) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    self->read_fd = fds[0];
    self->write_fd = fds[1];
    self->fd = -1;
    self->stop = 0;
    /* signals go to Python's threads, never to this one */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int err = pthread_create(&self->thread, NULL, run, self);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        close(fds[0]);
        close(fds[1]);
        self->read_fd = self->write_fd = -1;
        return -1;
    }
    self->started = 1;
    return 0;
}

static PyObject *Fsyncer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Fsyncer *self = (Fsyncer *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cv, NULL);
    self->fd = -1;
    self->read_fd = self->write_fd = -1;
    return (PyObject *)self;
}

static void stop_thread(Fsyncer *self) {
    if (!self->started)
        return;
    pthread_mutex_lock(&self->mu);
    self->stop = 1;
    pthread_cond_signal(&self->cv);
    pthread_mutex_unlock(&self->mu);
    /* the thread may be inside an fdatasync: wait without the GIL */
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->started = 0;
    if (self->fd >= 0) {
        close(self->fd);
        self->fd = -1;
    }
    close(self->read_fd);
    close(self->write_fd);
    self->read_fd = self->write_fd = -1;
}

static void Fsyncer_dealloc(Fsyncer *self) {
    stop_thread(self);
    pthread_mutex_destroy(&self->mu);
    pthread_cond_destroy(&self->cv);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Fsyncer_request(Fsyncer *self, PyObject *args) {
    int fd;
    long long lsn;
    if (!PyArg_ParseTuple(args, "iL:request", &fd, &lsn))
        return NULL;
    if (!self->started) {
        PyErr_SetString(PyExc_ValueError, "the Fsyncer is closed");
        return NULL;
    }
    int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (copy < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    pthread_mutex_lock(&self->mu);
    int older = self->fd;
    self->fd = copy;
    self->lsn = lsn;
    pthread_cond_signal(&self->cv);
    pthread_mutex_unlock(&self->mu);
    if (older >= 0)
        close(older);
    Py_RETURN_NONE;
}

static PyObject *Fsyncer_fileno(Fsyncer *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->started) {
        PyErr_SetString(PyExc_ValueError, "the Fsyncer is closed");
        return NULL;
    }
    return PyLong_FromLong(self->read_fd);
}

static PyObject *Fsyncer_close(Fsyncer *self, PyObject *Py_UNUSED(ignored)) {
    stop_thread(self);
    Py_RETURN_NONE;
}

static PyMethodDef Fsyncer_methods[] = {
    {"request", (PyCFunction)Fsyncer_request, METH_VARARGS,
     "request(fd, lsn): fdatasync fd's file (a dup of fd, taken now) and then write a record of lsn"},
    {"fileno", (PyCFunction)Fsyncer_fileno, METH_NOARGS,
     "the read end of the pipe of 24-byte records (lsn, errno, ns), non-blocking"},
    {"close", (PyCFunction)Fsyncer_close, METH_NOARGS,
     "end the thread (after the sync under way) and close the pipe"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FsyncerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "blockd.storage._fsyncer.Fsyncer",
    .tp_doc = "a thread that fdatasyncs files on request and writes what it synced to a pipe",
    .tp_basicsize = sizeof(Fsyncer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Fsyncer_new,
    .tp_init = (initproc)Fsyncer_init,
    .tp_dealloc = (destructor)Fsyncer_dealloc,
    .tp_methods = Fsyncer_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "blockd.storage._fsyncer",
    .m_doc = "a background fdatasync thread that never takes the GIL (see blockd/storage/fsyncer.py)",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__fsyncer(void) {
    if (PyType_Ready(&FsyncerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FsyncerType);
    if (PyModule_AddObject(m, "Fsyncer", (PyObject *)&FsyncerType) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_SHA256", BLOCKD_SOURCE_SHA256) < 0) {
        Py_DECREF(&FsyncerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
