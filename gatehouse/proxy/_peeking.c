/* The proxy's walk of a large frame through a socket (a Produce request's through the
 * client's, a Fetch answer's through the broker's), in C: the loop of
 * fastio.FastStream.peek_walk, which stays the reference (and runs where this
 * module is not built, where the system cannot peek at an offset, or with
 * GATEHOUSE_PURE_PYTHON=1).  It peeks at the parts around the records where they lie in
 * the socket (SO_PEEK_OFF, Linux 6.10+ for TCP), feeds them to the walk and skips the
 * records, all in one call: in Python each peek was a trip through a dozen bytecode
 * calls.  The bytes are read by the walk (gatehouse.codecs), not here, but for one
 * thing: in a records field a counting walk reads batch by batch (a Fetch answer's of
 * 16 KiB batches: 63 a MiB), the headers of its whole v2 batches are read here (length,
 * magic, record count), the walk told once per run (``batches_walked``) rather than fed
 * each header through a call into Python.  Non-blocking:
 * it answers "nothing there yet" rather than wait; the GIL is held throughout (each
 * call is two short system calls). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sys/socket.h>

#include "../codecs/_wire.h"

#ifndef SO_PEEK_OFF
#error "no SO_PEEK_OFF here: the Python loop runs (the module is optional)"
#endif

/* What a walk through the socket stopped at (fastio's WALKED, EMPTY, EOF, PAST_END). */
enum { WALKED, EMPTY, AT_EOF, PAST_END };

static PyObject *name_finished, *name_opaque, *name_holding, *name_skip, *name_feed;
static PyObject *name_left, *name_batches_walked;

static int
long_attr(PyObject *obj, PyObject *name, long long *value)
{
    PyObject *got = PyObject_GetAttr(obj, name);
    if (got == NULL)
        return -1;
    *value = PyLong_AsLongLong(got);  /* a bool is an int too */
    Py_DECREF(got);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *
reached(long long at, int where)
{
    return Py_BuildValue("(Li)", at, where);
}

/* One peek of up to ``want`` bytes at frame offset ``at`` into ``buf``: how many came, 0
 * at EOF, -1 with errno EAGAIN when none are there yet, -2 with an exception set. */
static ssize_t
peek(int fd, long long at, long long moved, char *buf, long long want)
{
    int offset = (int)(at - moved);
    if (at - moved > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "peek offset past 2 GiB");
        return -2;
    }
    if (setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &offset, sizeof offset) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -2;
    }
    ssize_t got;
    do {
        got = recv(fd, buf, (size_t)want, MSG_PEEK | MSG_DONTWAIT);
    } while (got < 0 && errno == EINTR && PyErr_CheckSignals() == 0);
    if (got >= 0)
        return got;
    int error = errno;
    if (PyErr_Occurred())  /* a signal handler raised */
        return -2;
    if (error == EAGAIN || error == EWOULDBLOCK)
        return -1;
    errno = error;
    PyErr_SetFromErrno(PyExc_OSError);
    return -2;
}

/* A run of whole v2 batches in a records field the walk counts (a walk with
 * ``batches_walked``, ``_left`` bytes of the field to go, nothing held, no records
 * pending): each batch's header peeked at, its records skipped, with no call into the
 * walk per batch; the walk told once (``batches_walked``) what went by.  Stops at the
 * first batch that is not a whole v2 one inside the field (the walk's own step reads it)
 * or not all there yet.  Returns how far it got (0: not a batch it takes, or no bytes
 * there: *empty then says which), -1 with an exception set. */
static long long
walk_batches(int fd, PyObject *batches_walked, long long at, long long moved,
             long long total, long long left, int *empty)
{
    unsigned char header[BATCH_OVERHEAD];
    long long walked = 0, records = 0, bytes = 0;
    *empty = 0;
    while (left >= BATCH_OVERHEAD && at + walked + BATCH_OVERHEAD <= total) {
        ssize_t got = peek(fd, at + walked, moved, (char *)header, BATCH_OVERHEAD);
        if (got == -2)
            return -1;
        if (got < BATCH_OVERHEAD) {
            *empty = got == -1;
            break;  /* EOF or a header not all there: the general loop says which */
        }
        long long size, counted;
        if (wire_batch(header, left, &size, &counted) != WIRE_BATCH)
            break;
        records += counted;
        bytes += size;
        walked += size;
        left -= size;
    }
    if (walked) {
        PyObject *done = PyObject_CallFunction(batches_walked, "LLLL", walked, records,
                                               bytes, left);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return walked;
}

/* peek_walk's loop; ``batches_walked``: the walk's method of that name, or NULL. */
static PyObject *
walk_through(int fd, PyObject *walk, PyObject *batches_walked, long long at,
             long long moved, long long total, long long read)
{
    for (;;) {
        long long finished, opaque, holding;
        if (long_attr(walk, name_finished, &finished) < 0)
            return NULL;
        if (finished)
            return reached(at, WALKED);
        if (at >= total)
            return reached(at, PAST_END);  /* the frame ends inside a part */
        if (long_attr(walk, name_opaque, &opaque) < 0)
            return NULL;
        if (opaque) {  /* records: looked past, moved later */
            PyObject *n = PyLong_FromLongLong(opaque);
            if (n == NULL)
                return NULL;
            PyObject *done = PyObject_CallMethodOneArg(walk, name_skip, n);
            Py_DECREF(n);
            if (done == NULL)
                return NULL;
            Py_DECREF(done);
            at += opaque;
            continue;
        }
        if (long_attr(walk, name_holding, &holding) < 0)
            return NULL;
        if (batches_walked != NULL && !holding) {
            long long left;
            if (long_attr(walk, name_left, &left) < 0)
                return NULL;
            if (left) {
                int empty;
                long long walked = walk_batches(fd, batches_walked, at, moved, total, left,
                                                &empty);
                if (walked < 0)
                    return NULL;
                if (walked) {
                    at += walked;
                    continue;
                }
                if (empty)
                    return reached(at, EMPTY);
            }
        }
        /* A long part (records that are no v2 batch, read whole) in ever larger peeks. */
        long long want = holding > read ? holding : read;
        if (want > total - at)
            want = total - at;
        PyObject *data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)want);
        if (data == NULL)
            return NULL;
        ssize_t got = peek(fd, at, moved, PyBytes_AS_STRING(data), want);
        if (got <= 0) {
            Py_DECREF(data);
            if (got == 0)
                return reached(at, AT_EOF);
            return got == -1 ? reached(at, EMPTY) : NULL;
        }
        if (got < want && _PyBytes_Resize(&data, (Py_ssize_t)got) < 0)
            return NULL;
        PyObject *fed = PyObject_CallMethodOneArg(walk, name_feed, data);
        Py_DECREF(data);
        if (fed == NULL)
            return NULL;  /* the walk's refusal (Unexpected), for the caller */
        /* All it was given, but where the walk ends before the frame does (a Fetch
         * answer's walk stops at its top-level tag section). */
        long long taken = PyLong_AsLongLong(fed);
        Py_DECREF(fed);
        if (taken == -1 && PyErr_Occurred())
            return NULL;
        at += taken;
    }
}

/* peek_walk(fd, walk, at, moved, total, read) -> (at, WALKED | EMPTY | EOF | PAST_END) */
static PyObject *
peek_walk(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *walk;
    long long at, moved, total, read;
    if (!PyArg_ParseTuple(args, "iOLLLL", &fd, &walk, &at, &moved, &total, &read))
        return NULL;
    /* A walk that counts batches (fetch.AnswerWalk) takes whole runs of them at once. */
    PyObject *batches_walked = PyObject_GetAttr(walk, name_batches_walked);
    if (batches_walked == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
    }
    PyObject *result = walk_through(fd, walk, batches_walked, at, moved, total, read);
    Py_XDECREF(batches_walked);
    return result;
}

static PyMethodDef methods[] = {
    {"peek_walk", peek_walk, METH_VARARGS,
     "peek_walk(fd, walk, at, moved, total, read) -> (at, reached)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gatehouse.proxy._peeking",
    "FastStream.peek_walk's loop in C (see gatehouse/proxy/_peeking.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__peeking(void)
{
    if ((name_finished = PyUnicode_InternFromString("finished")) == NULL
            || (name_opaque = PyUnicode_InternFromString("opaque")) == NULL
            || (name_holding = PyUnicode_InternFromString("holding")) == NULL
            || (name_skip = PyUnicode_InternFromString("skip")) == NULL
            || (name_feed = PyUnicode_InternFromString("feed")) == NULL
            || (name_left = PyUnicode_InternFromString("_left")) == NULL
            || (name_batches_walked = PyUnicode_InternFromString("batches_walked")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
