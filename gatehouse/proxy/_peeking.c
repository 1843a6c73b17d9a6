/* The proxy's walk of a large frame through a socket (a Produce request's through the
 * client's, a Fetch answer's through the broker's), in C: the loop of
 * fastio.FastStream.peek_walk, which stays the reference (and runs where this
 * module is not built, where the system cannot peek at an offset, or with
 * GATEHOUSE_PURE_PYTHON=1).  It peeks at the parts around the records where they lie in
 * the socket (SO_PEEK_OFF, Linux 6.10+ for TCP), feeds them to the walk and skips the
 * records, all in one call: in Python each peek was a trip through a dozen bytecode
 * calls.  The bytes are read by the walk (gatehouse.codecs), not here.  Non-blocking:
 * it answers "nothing there yet" rather than wait; the GIL is held throughout (each
 * call is two short system calls). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sys/socket.h>

#ifndef SO_PEEK_OFF
#error "no SO_PEEK_OFF here: the Python loop runs (the module is optional)"
#endif

/* What a walk through the socket stopped at (fastio's WALKED, EMPTY, EOF, PAST_END). */
enum { WALKED, EMPTY, AT_EOF, PAST_END };

static PyObject *name_finished, *name_opaque, *name_holding, *name_skip, *name_feed;

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

/* peek_walk(fd, walk, at, moved, total, read) -> (at, WALKED | EMPTY | EOF | PAST_END) */
static PyObject *
peek_walk(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *walk;
    long long at, moved, total, read;
    if (!PyArg_ParseTuple(args, "iOLLLL", &fd, &walk, &at, &moved, &total, &read))
        return NULL;
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
        /* A long part (records that are no v2 batch, read whole) in ever larger peeks. */
        long long want = holding > read ? holding : read;
        if (want > total - at)
            want = total - at;
        int offset = (int)(at - moved);
        if (at - moved > INT_MAX) {
            PyErr_SetString(PyExc_OverflowError, "peek offset past 2 GiB");
            return NULL;
        }
        if (setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &offset, sizeof offset) < 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        PyObject *data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)want);
        if (data == NULL)
            return NULL;
        ssize_t got;
        do {
            got = recv(fd, PyBytes_AS_STRING(data), (size_t)want, MSG_PEEK | MSG_DONTWAIT);
        } while (got < 0 && errno == EINTR && PyErr_CheckSignals() == 0);
        if (got <= 0) {
            int error = errno;
            Py_DECREF(data);
            if (got == 0)
                return reached(at, AT_EOF);
            if (error == EAGAIN || error == EWOULDBLOCK)
                return reached(at, EMPTY);
            if (PyErr_Occurred())  /* a signal handler raised */
                return NULL;
            errno = error;
            return PyErr_SetFromErrno(PyExc_OSError);
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
            || (name_feed = PyUnicode_InternFromString("feed")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
