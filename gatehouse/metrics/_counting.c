/* The metrics' per-request and per-answer counting, in C: what ProxyMetrics.request and
 * ProxyMetrics.response do for the usual exchange (a request whose counters exist, a
 * Produce or Fetch answer the proxy has read from its bytes), with no Python frame.
 *
 * Why: in the proxy those two methods ran about four times slower than in a loop (each
 * exchange moves ~100 KiB through the caches between two calls), and their bytecode, not
 * the byte readers they call, was most of what the metrics cost a proxy-bound Produce
 * load.  Here the same work is a few dictionary lookups and additions.
 *
 * Anything else goes to the Python methods, which stay the reference and run alone where
 * this module is not built or GATEHOUSE_PURE_PYTHON=1 is set: a counter not made yet, an
 * API whose requests the census reads (ApiVersions, the group APIs), an answer the proxy
 * made or decoded, a topic seen for the first time (by the proxy, or by the connection:
 * its own tally of records and bytes per topic, ConnectionInfo.produced and .fetched),
 * an answer carrying an error code (rare; the connection's tally of errors is Python's).  Every lookup is done before the
 * first addition, so a call either counts all of an exchange or hands all of it over:
 * nothing is counted twice (tests/test_metrics_counting.py holds the two to the same
 * samples).  Counters are the Tally and HistogramTally objects of gatehouse/metrics/
 * tally.py, changed through their attributes.  The GIL is held throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define PRODUCE 0
#define FETCH 1
#define FLEXIBLE_SINCE 9
#define PRODUCE_READ_SINCE 3  /* produce.FIRST_VERSION: the byte reader's first */
#define TOPIC_IDS_SINCE 13
#define MAX_TOPICS 64         /* topics counted here at once; more: the Python method */

static PyObject *s_value, *s_header, *s_id, *s_frame, *s_body,
    *s_api_key, *s_local, *s_raw, *s_decoded, *s_scan, *s_read, *s_produced, *s_fetched;

/* request(state, conn, req, size) and response(state, ...): ``state`` is the tuple
 * ProxyMetrics builds (see _counting_state there), in this order. */
enum {
    R_CONN_REQUESTS, R_BYTES_UP, R_PRODUCED, R_READER, R_PRODUCE_VERSIONS, R_SLOW_KEYS,
    R_UNSET, R_SLOW_REQUEST, R_READ_KEY, R_STATE_SIZE
};
enum {
    A_BYTES_OUT, A_BYTES_DOWN, A_DURATIONS, A_RESPONSE_COUNTERS, A_FETCHED,
    A_SLOW_RESPONSE, A_STATE_SIZE
};

/* obj.<name> += amount (a float attribute) */
static int
add_to(PyObject *obj, PyObject *name, double amount)
{
    PyObject *old = PyObject_GetAttr(obj, name);
    if (old == NULL)
        return -1;
    double value = PyFloat_AsDouble(old);
    Py_DECREF(old);
    if (value == -1.0 && PyErr_Occurred())
        return -1;
    PyObject *new = PyFloat_FromDouble(value + amount);
    if (new == NULL)
        return -1;
    int status = PyObject_SetAttr(obj, name, new);
    Py_DECREF(new);
    return status;
}

/* A counter child: a float ``value`` that only goes up (tally.py's Tally, in C: the
 * additions here are then a store, not an attribute lookup and a new float object). */
typedef struct {
    PyObject_HEAD
    double value;
} TallyObject;

static PyTypeObject TallyType;

static PyObject *
tally_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Tally() takes no arguments");
        return NULL;
    }
    TallyObject *self = (TallyObject *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->value = 0.0;
    return (PyObject *)self;
}

static PyObject *
tally_inc(TallyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double amount = 1.0;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "inc(amount=1.0)");
        return NULL;
    }
    if (nargs == 1) {
        amount = PyFloat_AsDouble(args[0]);
        if (amount == -1.0 && PyErr_Occurred())
            return NULL;
    }
    if (amount < 0) {
        PyErr_SetString(PyExc_ValueError, "counters only go up");
        return NULL;
    }
    self->value += amount;
    Py_RETURN_NONE;
}

static PyMethodDef tally_methods[] = {
    {"inc", (PyCFunction)(void (*)(void))tally_inc, METH_FASTCALL, "inc(amount=1.0): add"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef tally_members[] = {
    {"value", T_DOUBLE, offsetof(TallyObject, value), 0, "the count"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject TallyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gatehouse.metrics._counting.Tally",
    .tp_doc = "One counter child: inc adds, nothing else.",
    .tp_basicsize = sizeof(TallyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = tally_new,
    .tp_methods = tally_methods,
    .tp_members = tally_members,
};

/* tally.value += amount */
static inline int
add(PyObject *tally, double amount)
{
    if (Py_IS_TYPE(tally, &TallyType)) {
        ((TallyObject *)tally)->value += amount;
        return 0;
    }
    return add_to(tally, s_value, amount);
}

/* An int attribute of ``obj``, or -1 with an exception set (or for a value that is not
 * a small non-negative int: ``*ok`` says which). */
static long
int_attr(PyObject *obj, PyObject *name, int *ok)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    *ok = 0;
    if (value == NULL)
        return -1;
    long n = PyLong_Check(value) ? PyLong_AsLong(value) : -1;
    Py_DECREF(value);
    if (n == -1 && PyErr_Occurred())
        return -1;
    *ok = 1;
    return n;
}

/* Per topic of a reader's result (key, partitions, records, bytes): the (records tally,
 * bytes tally, name) in ``table``, into ``pairs``, and the connection's [records,
 * bytes] of that name in ``mine`` (its ``produced`` or ``fetched``), into ``lists``; 1
 * when every topic with records has them, 0 when one does not (or too many topics, or
 * a shape not expected), -1 on error. */
static int
find_topics(PyObject *topics, PyObject *table, PyObject *mine, PyObject **pairs,
            PyObject **lists, long long *amounts, Py_ssize_t *found)
{
    *found = 0;
    if (!PyList_CheckExact(topics) || !PyDict_CheckExact(table) || !PyDict_CheckExact(mine))
        return 0;
    Py_ssize_t n = PyList_GET_SIZE(topics);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *topic = PyList_GET_ITEM(topics, i);
        if (!PyTuple_CheckExact(topic) || PyTuple_GET_SIZE(topic) != 4)
            return 0;
        long long records = PyLong_AsLongLong(PyTuple_GET_ITEM(topic, 2));
        long long bytes = PyLong_AsLongLong(PyTuple_GET_ITEM(topic, 3));
        if ((records == -1 || bytes == -1) && PyErr_Occurred())
            return -1;
        if (records <= 0)  /* nothing (or a nonsense count from a bad header) */
            continue;
        if (*found == MAX_TOPICS)
            return 0;
        PyObject *pair = PyDict_GetItemWithError(table, PyTuple_GET_ITEM(topic, 0));
        if (pair == NULL)
            return PyErr_Occurred() ? -1 : 0;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 3)
            return 0;
        PyObject *counts = PyDict_GetItemWithError(mine, PyTuple_GET_ITEM(pair, 2));
        if (counts == NULL)
            return PyErr_Occurred() ? -1 : 0;  /* the connection's first of this topic */
        if (!PyList_CheckExact(counts) || PyList_GET_SIZE(counts) != 2
                || !PyLong_CheckExact(PyList_GET_ITEM(counts, 0))
                || !PyLong_CheckExact(PyList_GET_ITEM(counts, 1)))
            return 0;
        pairs[*found] = Py_NewRef(pair);  /* held: the additions may run the collector */
        lists[*found] = Py_NewRef(counts);
        amounts[2 * *found] = records;
        amounts[2 * *found + 1] = bytes;
        (*found)++;
    }
    return 1;
}

static void
release(PyObject **objects, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(objects[i]);
}

/* list[i] += amount (an int, checked by find_topics) */
static int
add_int(PyObject *list, Py_ssize_t i, long long amount)
{
    PyObject *old = PyList_GET_ITEM(list, i);
    long long value = PyLong_AsLongLong(old);
    if (value == -1 && PyErr_Occurred())
        return -1;
    PyObject *sum = PyLong_FromLongLong(value + amount);
    if (sum == NULL)
        return -1;
    PyList_SET_ITEM(list, i, sum);
    Py_DECREF(old);
    return 0;
}

static int
add_topics(PyObject **pairs, PyObject **lists, long long *amounts, Py_ssize_t found)
{
    for (Py_ssize_t i = 0; i < found; i++) {
        if (add(PyTuple_GET_ITEM(pairs[i], 0), (double)amounts[2 * i]) < 0
                || add(PyTuple_GET_ITEM(pairs[i], 1), (double)amounts[2 * i + 1]) < 0
                || add_int(lists[i], 0, amounts[2 * i]) < 0
                || add_int(lists[i], 1, amounts[2 * i + 1]) < 0)
            return -1;
    }
    return 0;
}

static PyObject *
call3(PyObject *fn, PyObject *a, PyObject *b, PyObject *c)
{
    PyObject *args[3] = {a, b, c};
    return PyObject_Vectorcall(fn, args, 3, NULL);
}

static PyObject *
request(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != R_STATE_SIZE) {
        PyErr_SetString(PyExc_TypeError, "request(state, conn, req, size)");
        return NULL;
    }
    PyObject *state = args[0], *conn = args[1], *req = args[2], *size = args[3];
    PyObject *slow = PyTuple_GET_ITEM(state, R_SLOW_REQUEST);
    PyObject *header = NULL, *conn_id = NULL, *slot = NULL, *frame = NULL, *body = NULL;
    PyObject *topics = NULL, *counter = NULL, *result = NULL, *mine = NULL;
    PyObject *pairs[MAX_TOPICS], *lists[MAX_TOPICS];
    long long amounts[2 * MAX_TOPICS];
    Py_ssize_t found = 0;

    long nbytes = PyLong_Check(size) ? PyLong_AsLong(size) : -1;
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    header = PyObject_GetAttr(req, s_header);
    if (header == NULL)
        return NULL;
    if (!PyTuple_Check(header) || PyTuple_GET_SIZE(header) < 2 || nbytes < 0)
        goto slow_path;
    long key = PyLong_AsLong(PyTuple_GET_ITEM(header, 0));
    long version = PyLong_AsLong(PyTuple_GET_ITEM(header, 1));
    if ((key == -1 || version == -1) && PyErr_Occurred())
        goto done;
    if (key < 0 || key > 0x7FFF)
        goto slow_path;  /* not an API key: the Python method says so */
    int slow_key = PySet_Contains(PyTuple_GET_ITEM(state, R_SLOW_KEYS), PyTuple_GET_ITEM(header, 0));
    if (slow_key < 0)
        goto done;
    if (slow_key)
        goto slow_path;
    conn_id = PyObject_GetAttr(conn, s_id);
    if (conn_id == NULL)
        goto done;
    PyObject *counters = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, R_CONN_REQUESTS), conn_id);
    if (counters == NULL) {
        if (PyErr_Occurred())
            goto done;
        goto slow_path;  /* the connection's first request */
    }
    if (!PyDict_CheckExact(counters))
        goto slow_path;
    slot = PyLong_FromLong((key << 16) | (version & 0xFFFF));
    if (slot == NULL)
        goto done;
    counter = PyDict_GetItemWithError(counters, slot);
    if (counter == NULL) {
        if (PyErr_Occurred())
            goto done;
        goto slow_path;  /* a version this connection has not sent before */
    }
    Py_INCREF(counter);  /* held: the reader below allocates, and so may run the collector */
    if (key == PRODUCE && version < PRODUCE_READ_SINCE)
        goto slow_path;  /* Produce v0-2 (3.x brokers): no transactional id, read in Python */
    PyObject *produce_versions = PyTuple_GET_ITEM(state, R_PRODUCE_VERSIONS);
    int readable = key == PRODUCE ? PySequence_Contains(produce_versions, PyTuple_GET_ITEM(header, 1)) : 0;
    if (readable < 0)
        goto done;
    if (readable) {
        body = PyObject_GetAttr(req, s_body);
        if (body == NULL)
            goto done;
        frame = PyObject_GetAttr(req, s_frame);
        if (frame == NULL)
            goto done;
        PyObject *reader = PyTuple_GET_ITEM(state, R_READER);
        if (body != PyTuple_GET_ITEM(state, R_UNSET) || frame == Py_None || reader == Py_None)
            goto slow_path;  /* decoded by a rule, built in code: as the Python method */
        /* Read already (produce.request_topics_of's memory): a request whose records
         * went by unread, counted by the proxy's walk, holds only its first bytes. */
        PyObject *read = PyObject_GetAttr(req, s_read);
        if (read == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                goto done;
            PyErr_Clear();
        }
        else if (PyDict_CheckExact(read)) {
            topics = PyDict_GetItemWithError(read, PyTuple_GET_ITEM(state, R_READ_KEY));
            Py_XINCREF(topics);
            if (topics == NULL && PyErr_Occurred()) {
                Py_DECREF(read);
                goto done;
            }
        }
        Py_XDECREF(read);
        if (topics == NULL) {
            PyObject *read_args[5] = {frame, version >= FLEXIBLE_SINCE ? Py_True : Py_False,
                                      version >= TOPIC_IDS_SINCE ? Py_True : Py_False, Py_True,
                                      Py_None};
            topics = PyObject_Vectorcall(reader, read_args, 5, NULL);
            if (topics == NULL)
                goto done;
        }
        if ((mine = PyObject_GetAttr(conn, s_produced)) == NULL)
            goto done;
        int ok = find_topics(topics, PyTuple_GET_ITEM(state, R_PRODUCED), mine, pairs, lists,
                             amounts, &found);
        if (ok < 0)
            goto done;
        if (ok == 0)
            goto slow_path;  /* a new topic, or bytes the reader did not take */
    }
    /* Everything found: count it all. */
    if (add(PyTuple_GET_ITEM(state, R_BYTES_UP), (double)(nbytes + 4)) < 0
            || add(counter, 1.0) < 0 || add_topics(pairs, lists, amounts, found) < 0)
        goto done;
    result = Py_NewRef(Py_None);
    goto done;

slow_path:
    result = call3(slow, conn, req, size);
done:
    Py_XDECREF(header);
    Py_XDECREF(conn_id);
    Py_XDECREF(slot);
    Py_XDECREF(frame);
    Py_XDECREF(body);
    Py_XDECREF(topics);
    Py_XDECREF(counter);
    Py_XDECREF(mine);
    release(pairs, found);
    release(lists, found);
    return result;
}

/* A histogram child: a count per bucket (upper bounds, ``le``; the last above every
 * bound) and the sum (tally.py's HistogramTally, in C: observing is a search of a few
 * doubles and two additions, with nothing allocated). */
#define MAX_BOUNDS 64

typedef struct {
    PyObject_HEAD
    PyObject *bounds;  /* the tuple it was made with, for Python */
    Py_ssize_t n;      /* bounds */
    double sum;
    double bound[MAX_BOUNDS];
    unsigned long long count[MAX_BOUNDS + 1];
} HistogramObject;

static PyTypeObject HistogramType;

static PyObject *
histogram_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *bounds;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)
            || !PyArg_ParseTuple(args, "O!:HistogramTally", &PyTuple_Type, &bounds))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(bounds);
    if (n > MAX_BOUNDS) {
        PyErr_Format(PyExc_ValueError, "at most %d bounds", MAX_BOUNDS);
        return NULL;
    }
    HistogramObject *self = (HistogramObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        self->bound[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(bounds, i));
        if (self->bound[i] == -1.0 && PyErr_Occurred()) {
            Py_DECREF(self);
            return NULL;
        }
        if (i > 0 && !(self->bound[i] > self->bound[i - 1])) {
            PyErr_SetString(PyExc_ValueError, "bounds must increase");
            Py_DECREF(self);
            return NULL;
        }
    }
    self->n = n;
    self->bounds = Py_NewRef(bounds);
    return (PyObject *)self;
}

static void
histogram_dealloc(HistogramObject *self)
{
    Py_XDECREF(self->bounds);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* counts[bisect_left(bounds, value)] += 1; sum += value */
static inline void
histogram_add(HistogramObject *self, double value)
{
    Py_ssize_t lo = 0, hi = self->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (self->bound[mid] < value)
            lo = mid + 1;
        else
            hi = mid;
    }
    self->count[lo]++;
    self->sum += value;
}

static PyObject *
histogram_observe(HistogramObject *self, PyObject *arg)
{
    double value = PyFloat_AsDouble(arg);
    if (value == -1.0 && PyErr_Occurred())
        return NULL;
    histogram_add(self, value);
    Py_RETURN_NONE;
}

static PyObject *
histogram_counts(HistogramObject *self, void *closure)
{
    PyObject *counts = PyList_New(self->n + 1);
    if (counts == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i <= self->n; i++) {
        PyObject *count = PyLong_FromUnsignedLongLong(self->count[i]);
        if (count == NULL) {
            Py_DECREF(counts);
            return NULL;
        }
        PyList_SET_ITEM(counts, i, count);
    }
    return counts;
}

static PyObject *
histogram_bounds(HistogramObject *self, void *closure)
{
    return Py_NewRef(self->bounds);
}

static PyMethodDef histogram_methods[] = {
    {"observe", (PyCFunction)histogram_observe, METH_O, "observe(value): count it"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef histogram_getset[] = {
    {"counts", (getter)histogram_counts, NULL, "a copy of the count per bucket", NULL},
    {"bounds", (getter)histogram_bounds, NULL, "the buckets' upper bounds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef histogram_members[] = {
    {"sum", T_DOUBLE, offsetof(HistogramObject, sum), READONLY, "the sum observed"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject HistogramType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gatehouse.metrics._counting.HistogramTally",
    .tp_doc = "One histogram child: a count per bucket and the sum.",
    .tp_basicsize = sizeof(HistogramObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = histogram_new,
    .tp_dealloc = (destructor)histogram_dealloc,
    .tp_methods = histogram_methods,
    .tp_getset = histogram_getset,
    .tp_members = histogram_members,
};

static PyObject *
response(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 5 || nargs > 6 || !PyTuple_CheckExact(args[0])
            || PyTuple_GET_SIZE(args[0]) != A_STATE_SIZE) {
        PyErr_SetString(PyExc_TypeError, "response(state, conn, pending, size, elapsed, frame=None)");
        return NULL;
    }
    /* The frame is not read: the scan the proxy made is (of the frame, or on the way
     * where the answer went socket to socket and there is no frame). */
    PyObject *state = args[0], *pending = args[2];
    PyObject *local = NULL, *raw = NULL, *decoded = NULL, *scan = NULL, *result = NULL;
    PyObject *histogram = NULL, *mine = NULL;
    PyObject *code_counters[32];
    long long code_amounts[32];
    Py_ssize_t codes_found = 0, found = 0;
    PyObject *pairs[MAX_TOPICS], *lists[MAX_TOPICS];
    long long amounts[2 * MAX_TOPICS];

    int ok;
    long key = int_attr(pending, s_api_key, &ok);
    if (!ok)
        return NULL;
    long nbytes = PyLong_Check(args[3]) ? PyLong_AsLong(args[3]) : -1;
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    double elapsed = PyFloat_Check(args[4]) ? PyFloat_AS_DOUBLE(args[4]) : -1.0;
    if ((key != PRODUCE && key != FETCH) || nbytes < 0 || elapsed < 0)
        goto slow_path;
    if ((local = PyObject_GetAttr(pending, s_local)) == NULL
            || (raw = PyObject_GetAttr(pending, s_raw)) == NULL
            || (decoded = PyObject_GetAttr(pending, s_decoded)) == NULL
            || (scan = PyObject_GetAttr(pending, s_scan)) == NULL)
        goto done;
    /* The proxy's own answer, a SASL token, a decoded answer, an unread one: Python. */
    if (local != Py_None || raw != Py_False || decoded != Py_None || !PyTuple_CheckExact(scan)
            || PyTuple_GET_SIZE(scan) != 3)
        goto slow_path;
    PyObject *key_obj = PyLong_FromLong(key);
    if (key_obj == NULL)
        goto done;
    histogram = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, A_DURATIONS), key_obj);
    Py_DECREF(key_obj);
    if (histogram == NULL) {
        if (PyErr_Occurred())
            goto done;
        goto slow_path;
    }
    if (!Py_IS_TYPE(histogram, &HistogramType)) {
        histogram = NULL;
        goto slow_path;
    }
    Py_INCREF(histogram);  /* held, as the counters below */
    /* The codes: one counter per (key, code), code 0 for an answer with none. */
    PyObject *codes = PyTuple_GET_ITEM(scan, 0);
    PyObject *table = PyTuple_GET_ITEM(state, A_RESPONSE_COUNTERS);
    if (!PyDict_CheckExact(codes) || !PyDict_CheckExact(table))
        goto slow_path;
    PyObject *code, *n;
    Py_ssize_t pos = 0;
    long long none_answer = PyDict_GET_SIZE(codes) == 0;
    while (none_answer || PyDict_Next(codes, &pos, &code, &n)) {
        long c = 0;
        long long amount = 1;
        if (!none_answer) {
            c = PyLong_AsLong(code);
            amount = PyLong_AsLongLong(n);
            if ((c == -1 || amount == -1) && PyErr_Occurred())
                goto done;
            if (c != 0)
                goto slow_path;  /* an error: the connection's tally too, in Python */
        }
        if (codes_found == 32)
            goto slow_path;
        PyObject *slot = PyLong_FromLong((key << 16) | (c & 0xFFFF));
        if (slot == NULL)
            goto done;
        PyObject *counter = PyDict_GetItemWithError(table, slot);
        Py_DECREF(slot);
        if (counter == NULL) {
            if (PyErr_Occurred())
                goto done;
            goto slow_path;
        }
        code_counters[codes_found] = Py_NewRef(counter);
        code_amounts[codes_found++] = amount;
        if (none_answer)
            break;
    }
    if (key == FETCH) {
        if ((mine = PyObject_GetAttr(args[1], s_fetched)) == NULL)
            goto done;
        int got = find_topics(PyTuple_GET_ITEM(scan, 2), PyTuple_GET_ITEM(state, A_FETCHED),
                              mine, pairs, lists, amounts, &found);
        if (got < 0)
            goto done;
        if (got == 0)
            goto slow_path;
    }
    /* Everything found: count it all. */
    if (add(PyTuple_GET_ITEM(state, A_BYTES_OUT), (double)(nbytes + 4)) < 0
            || add(PyTuple_GET_ITEM(state, A_BYTES_DOWN), (double)(nbytes + 4)) < 0)
        goto done;
    histogram_add((HistogramObject *)histogram, elapsed);
    for (Py_ssize_t i = 0; i < codes_found; i++) {
        if (add(code_counters[i], (double)code_amounts[i]) < 0)
            goto done;
    }
    if (add_topics(pairs, lists, amounts, found) < 0)
        goto done;
    result = Py_NewRef(Py_None);
    goto done;

slow_path:
    result = PyObject_Vectorcall(PyTuple_GET_ITEM(state, A_SLOW_RESPONSE), args + 1, nargs - 1, NULL);
done:
    Py_XDECREF(local);
    Py_XDECREF(raw);
    Py_XDECREF(decoded);
    Py_XDECREF(scan);
    Py_XDECREF(histogram);
    Py_XDECREF(mine);
    release(code_counters, codes_found);
    release(pairs, found);
    release(lists, found);
    return result;
}

static PyMethodDef methods[] = {
    {"request", (PyCFunction)(void (*)(void))request, METH_FASTCALL,
     "request(state, conn, req, size): ProxyMetrics.request for the usual request"},
    {"response", (PyCFunction)(void (*)(void))response, METH_FASTCALL,
     "response(state, conn, pending, size, elapsed, frame): ProxyMetrics.response for "
     "the usual Produce or Fetch answer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gatehouse.metrics._counting",
    "The metrics' per-exchange counting in C (see gatehouse/metrics/_counting.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__counting(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_value, "value"},
        {&s_header, "header"}, {&s_id, "id"}, {&s_frame, "_frame"}, {&s_body, "_body"}, {&s_read, "_read"},
        {&s_api_key, "api_key"}, {&s_local, "local"}, {&s_raw, "raw"},
        {&s_decoded, "decoded"}, {&s_scan, "scan"}, {&s_produced, "produced"},
        {&s_fetched, "fetched"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    }
    if (PyType_Ready(&TallyType) < 0 || PyType_Ready(&HistogramType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Tally", (PyObject *)&TallyType) < 0
            || PyModule_AddObjectRef(m, "HistogramTally", (PyObject *)&HistogramType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
