/* The observation log's per-exchange work in C: its records (below, after the JSON) and
 * their JSON lines.
 *
 * JSON lines: the bytes json.JSONEncoder(separators=(",", ":"),
 * check_circular=False).encode gives (ensure_ascii, NaN/Infinity allowed), for the plain
 * trees the observation log's records are (dict, list, tuple, str, int, float, bool,
 * None).
 *
 * Why: the capture writer's thread encodes every exchange's record, and holds the GIL
 * while it does: ~9 us a record with the json module (its C encoder still goes through
 * a generic path per value: a repr call per number, a list of chunks joined at the end),
 * time the proxy's event loop waits for.  Here a record is one pass into one buffer.
 *
 * A record holding anything else (a str subclass, a non-str key, a tree deeper than
 * MAX_DEPTH) is handed whole to ``fallback`` (the json encoder), whose text goes in its
 * place: the output is always what the json module would write
 * (tests/test_capture_records.py holds the two to the same bytes).  The GIL is held
 * throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <time.h>

#define MAX_DEPTH 16

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Out;

/* Room for ``n`` more bytes; -1 (MemoryError set) when there is none. */
static int
reserve(Out *out, Py_ssize_t n)
{
    if (out->len + n <= out->cap)
        return 0;
    Py_ssize_t cap = out->cap ? out->cap : 4096;
    while (cap < out->len + n) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    char *data = PyMem_Realloc(out->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    out->data = data;
    out->cap = cap;
    return 0;
}

static int
put(Out *out, const char *text, Py_ssize_t n)
{
    if (reserve(out, n) < 0)
        return -1;
    memcpy(out->data + out->len, text, n);
    out->len += n;
    return 0;
}

static const char HEX[] = "0123456789abcdef";

/* ``c`` as json's ensure_ascii writes it inside a string; at most 12 bytes. */
static Py_ssize_t
escape_char(char *p, Py_UCS4 c)
{
    switch (c) {
    case '"': p[0] = '\\'; p[1] = '"'; return 2;
    case '\\': p[0] = '\\'; p[1] = '\\'; return 2;
    case '\b': p[0] = '\\'; p[1] = 'b'; return 2;
    case '\f': p[0] = '\\'; p[1] = 'f'; return 2;
    case '\n': p[0] = '\\'; p[1] = 'n'; return 2;
    case '\r': p[0] = '\\'; p[1] = 'r'; return 2;
    case '\t': p[0] = '\\'; p[1] = 't'; return 2;
    }
    if (c >= 0x10000) {  /* a surrogate pair */
        Py_UCS4 v = c - 0x10000;
        Py_UCS4 high = 0xd800 | ((v >> 10) & 0x3ff), low = 0xdc00 | (v & 0x3ff);
        Py_ssize_t n = escape_char(p, high);
        return n + escape_char(p + n, low);
    }
    p[0] = '\\'; p[1] = 'u';
    p[2] = HEX[(c >> 12) & 0xf]; p[3] = HEX[(c >> 8) & 0xf];
    p[4] = HEX[(c >> 4) & 0xf]; p[5] = HEX[c & 0xf];
    return 6;
}

static inline int
plain_char(Py_UCS4 c)
{
    return c >= ' ' && c <= '~' && c != '"' && c != '\\';
}

static int
put_string(Out *out, PyObject *text)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    if (PyUnicode_IS_ASCII(text)) {
        const char *s = (const char *)PyUnicode_DATA(text);
        Py_ssize_t i = 0;
        while (i < n && plain_char((unsigned char)s[i]))
            i++;
        if (i == n) {  /* the usual string: nothing to escape */
            if (reserve(out, n + 2) < 0)
                return -1;
            char *p = out->data + out->len;
            p[0] = '"';
            memcpy(p + 1, s, n);
            p[n + 1] = '"';
            out->len += n + 2;
            return 0;
        }
    }
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    if (n > (PY_SSIZE_T_MAX - 2) / 12 || reserve(out, 12 * n + 2) < 0) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    char *p = out->data + out->len;
    *p++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (plain_char(c))
            *p++ = (char)c;
        else
            p += escape_char(p, c);
    }
    *p++ = '"';
    out->len = p - out->data;
    return 0;
}

static int
put_int(Out *out, PyObject *number)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow) {  /* beyond 64 bits: int's own repr */
        PyObject *text = PyLong_Type.tp_repr(number);
        if (text == NULL)
            return -1;
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(text, &n);
        int r = s == NULL ? -1 : put(out, s, n);
        Py_DECREF(text);
        return r;
    }
    char digits[24];
    char *end = digits + sizeof digits, *p = end;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        *--p = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--p = '-';
    return put(out, p, end - p);
}

static int
put_float(Out *out, PyObject *number)
{
    double v = PyFloat_AS_DOUBLE(number);
    if (!isfinite(v)) {
        if (isnan(v))
            return put(out, "NaN", 3);
        return v > 0 ? put(out, "Infinity", 8) : put(out, "-Infinity", 9);
    }
    /* float.__repr__, as the json module writes a float */
    char *text = PyOS_double_to_string(v, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (text == NULL)
        return -1;
    int r = put(out, text, (Py_ssize_t)strlen(text));
    PyMem_Free(text);
    return r;
}

/* 1: written; 0: ``value`` (or something in it) is not one this encoder writes (the
 * caller hands the record to the fallback); -1: an error (set). */
static int put_value(Out *out, PyObject *value, int depth);

static int
put_items(Out *out, PyObject *const *items, Py_ssize_t n, int depth)
{
    if (put(out, "[", 1) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i && put(out, ",", 1) < 0)
            return -1;
        int r = put_value(out, items[i], depth + 1);
        if (r <= 0)
            return r;
    }
    return put(out, "]", 1) < 0 ? -1 : 1;
}

static int
put_dict(Out *out, PyObject *dict, int depth)
{
    if (put(out, "{", 1) < 0)
        return -1;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key))
            return 0;  /* json turns numbers, bools and None into key text: its own job */
        if (i++ && put(out, ",", 1) < 0)
            return -1;
        if (put_string(out, key) < 0 || put(out, ":", 1) < 0)
            return -1;
        /* The value is borrowed from the dict, which nothing changes meanwhile: the GIL
         * is held and nothing here runs Python code. */
        int r = put_value(out, value, depth + 1);
        if (r <= 0)
            return r;
    }
    return put(out, "}", 1) < 0 ? -1 : 1;
}

static int
put_value(Out *out, PyObject *value, int depth)
{
    if (depth > MAX_DEPTH)
        return 0;
    if (value == Py_None)
        return put(out, "null", 4) < 0 ? -1 : 1;
    if (value == Py_True)
        return put(out, "true", 4) < 0 ? -1 : 1;
    if (value == Py_False)
        return put(out, "false", 5) < 0 ? -1 : 1;
    PyTypeObject *type = Py_TYPE(value);
    if (type == &PyUnicode_Type)
        return put_string(out, value) < 0 ? -1 : 1;
    if (type == &PyLong_Type)
        return put_int(out, value) < 0 ? -1 : 1;
    if (type == &PyFloat_Type)
        return put_float(out, value) < 0 ? -1 : 1;
    if (type == &PyDict_Type)
        return put_dict(out, value, depth);
    if (type == &PyList_Type)
        return put_items(out, ((PyListObject *)value)->ob_item, PyList_GET_SIZE(value), depth);
    if (type == &PyTuple_Type)
        return put_items(out, ((PyTupleObject *)value)->ob_item, PyTuple_GET_SIZE(value), depth);
    return 0;
}

/* One record into ``out``: in C, or (anything this encoder does not write) as
 * ``fallback(record)``'s text. */
static int
put_record(Out *out, PyObject *record, PyObject *fallback)
{
    Py_ssize_t start = out->len;
    int r = put_value(out, record, 0);
    if (r != 0)
        return r < 0 ? -1 : 0;
    out->len = start;
    PyObject *text = PyObject_CallOneArg(fallback, record);
    if (text == NULL)
        return -1;
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "the fallback encoder returned %.100s, not str",
                     Py_TYPE(text)->tp_name);
        Py_DECREF(text);
        return -1;
    }
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    r = s == NULL ? -1 : put(out, s, n);
    Py_DECREF(text);
    return r;
}

static PyObject *
finish(Out *out)
{
    PyObject *result = PyBytes_FromStringAndSize(out->data ? out->data : "", out->len);
    PyMem_Free(out->data);
    return result;
}

static PyObject *
encode_lines(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "encode_lines(records: list, fallback)");
        return NULL;
    }
    PyObject *records = args[0], *fallback = args[1];
    Out out = {NULL, 0, 0};
    /* Indexed each time: the fallback runs Python code, which could change the list. */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records); i++) {
        PyObject *record = PyList_GET_ITEM(records, i);
        Py_INCREF(record);
        int r = put_record(&out, record, fallback);
        Py_DECREF(record);
        if (r < 0 || put(&out, "\n", 1) < 0) {
            PyMem_Free(out.data);
            return NULL;
        }
    }
    return finish(&out);
}

static PyObject *
encode_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encode_record(record, fallback)");
        return NULL;
    }
    Out out = {NULL, 0, 0};
    if (put_record(&out, args[0], args[1]) < 0) {
        PyMem_Free(out.data);
        return NULL;
    }
    return finish(&out);
}

/* ---- Records: CaptureObserver.request and .response for the usual exchange ---------
 *
 * What the two methods do for a Produce request (acks not 0) whose topics were read from
 * its bytes, a Fetch request, and their answers as read from their bytes (``scan``): a
 * copy of the blank record with the exchange's fields set, then, with the answer, the
 * rest set and the record offered to the sinks.  Why: in the proxy each exchange moves
 * tens of KiB through the caches between two calls, and the methods' bytecode took three
 * to four times as long there as in a loop (bench/RESULTS.md, "Observation log").  Anything else (another API,
 * sampling, a record held for an acks=0 request, a rename's topic map, an answer the
 * proxy made or decoded) goes to the Python methods, which stay the reference: every
 * lookup is done before the record is touched, so an exchange is handled by one or the
 * other (tests/test_capture_records.py holds the two to the same records). */

#define PRODUCE 0
#define FETCH 1

static PyObject *k_time, *k_conn, *k_client, *k_listener, *k_client_id, *k_software_name,
    *k_software_version, *k_principal, *k_api, *k_api_key, *k_api_version,
    *k_correlation_id, *k_request_bytes, *k_errors, *k_topics, *k_rules, *k_sample,
    *k_response_bytes, *k_latency_ms, *k_outcome, *k_error_count, *k_maps, *k_name,
    *k_broker, *k_id, *k_partitions, *k_records, *k_bytes, *a_held, *a_current, *a_header,
    *a_body, *a_local, *a_decoded, *v_answered;

/* request(state, conn, req, size): ``state`` is the tuple CaptureObserver._build_in_c
 * makes, in this order. */
enum {
    Q_OBSERVER, Q_IN_FLIGHT, Q_BLANK, Q_RATES, Q_RATE_DEFAULT, Q_NAMES, Q_VERSIONS, Q_UNSET,
    Q_REQUEST_TOPICS, Q_ACKS, Q_ID_TEXTS, Q_TOPIC_NAMES, Q_NAMED_ID, Q_PYTHON, Q_SIZE
};
/* response(state, conn, pending, size, elapsed, frame=None) */
enum {
    P_OBSERVER, P_IN_FLIGHT, P_SCAN, P_ID_TEXTS, P_TOPIC_NAMES, P_NAMED_ID, P_OFFERS,
    P_PYTHON, P_SIZE
};

/* The topics of a Produce request or Fetch answer read from its bytes ((topic, indexes,
 * records, bytes) each: a name, or a topic id's 16 bytes) as the record's topic dicts
 * (CaptureObserver._counted_topics).  1: *out set; 0: not a shape expected here; -1:
 * an error. */
static int
counted_topics(PyObject *counted, PyObject *id_texts, PyObject *topic_names,
               PyObject *named_id, PyObject **out)
{
    if (!PyList_CheckExact(counted) || !PyDict_CheckExact(id_texts)
            || !PyDict_CheckExact(topic_names))
        return 0;
    Py_ssize_t n = PyList_GET_SIZE(counted);
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return -1;
    /* Python code runs below (a UUID's hash, the id helper): what is read is held. */
    Py_INCREF(counted);
    int result = 1;
    for (Py_ssize_t i = 0; i < n && result == 1; i++) {
        if (i >= PyList_GET_SIZE(counted)) {
            result = 0;
            break;
        }
        PyObject *item = PyList_GET_ITEM(counted, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 4) {
            result = 0;
            break;
        }
        Py_INCREF(item);
        PyObject *topic = PyTuple_GET_ITEM(item, 0), *name = NULL, *id_text = NULL;
        if (PyUnicode_Check(topic)) {
            name = Py_NewRef(PyUnicode_GET_LENGTH(topic) ? topic : Py_None);
            id_text = Py_NewRef(Py_None);
        } else {
            PyObject *known = PyDict_GetItemWithError(id_texts, topic);
            if (known == NULL && PyErr_Occurred()) {
                result = -1;
            } else if (known == NULL) {  /* a topic id not seen yet: the Python helper */
                PyObject *pair = PyObject_CallOneArg(named_id, topic);
                if (pair == NULL)
                    result = -1;
                else if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2)
                    result = 0;
                else {
                    name = Py_NewRef(PyTuple_GET_ITEM(pair, 0));
                    id_text = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
                }
                Py_XDECREF(pair);
            } else if (!PyTuple_CheckExact(known) || PyTuple_GET_SIZE(known) != 2) {
                result = 0;
            } else {  /* (id, its text): the name as learned from Metadata answers, if */
                Py_INCREF(known);
                PyObject *found = PyDict_GetItemWithError(topic_names, PyTuple_GET_ITEM(known, 0));
                if (found == NULL && PyErr_Occurred())
                    result = -1;
                else {
                    name = Py_NewRef(found ? found : Py_None);
                    id_text = Py_NewRef(PyTuple_GET_ITEM(known, 1));
                }
                Py_DECREF(known);
            }
        }
        if (result == 1) {
            PyObject *entry = PyDict_New();
            if (entry == NULL
                    || PyDict_SetItem(entry, k_name, name) < 0
                    || PyDict_SetItem(entry, k_broker, Py_None) < 0
                    || PyDict_SetItem(entry, k_id, id_text) < 0
                    || PyDict_SetItem(entry, k_partitions, PyTuple_GET_ITEM(item, 1)) < 0
                    || PyDict_SetItem(entry, k_records, PyTuple_GET_ITEM(item, 2)) < 0
                    || PyDict_SetItem(entry, k_bytes, PyTuple_GET_ITEM(item, 3)) < 0) {
                Py_XDECREF(entry);
                result = -1;
            } else {
                PyList_SET_ITEM(list, i, entry);
            }
        }
        Py_XDECREF(name);
        Py_XDECREF(id_text);
        Py_DECREF(item);
    }
    Py_DECREF(counted);
    if (result != 1) {
        Py_DECREF(list);  /* unset items are NULL: list_dealloc skips them */
        return result;
    }
    *out = list;
    return 1;
}

static double
wall_clock(void)
{
    /* time.time(): nanoseconds as one integer, then seconds. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    return ns % 1000000000LL == 0 ? (double)(ns / 1000000000LL) : (double)ns / 1e9;
}

/* record[key] = value, a new reference (NULL: the error of making it), given away. */
static int
set_new(PyObject *record, PyObject *key, PyObject *value)
{
    if (value == NULL)
        return -1;
    int r = PyDict_SetItem(record, key, value);
    Py_DECREF(value);
    return r;
}

static int
set_attr(PyObject *record, PyObject *key, PyObject *source, PyObject *name)
{
    return set_new(record, key, PyObject_GetAttr(source, name));
}

/* The error of a failed call, kept while the record the policy decides is reset (as the
 * Python methods reset it first). */
static void
forget_current(PyObject *observer)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (PyObject_SetAttr(observer, a_current, Py_None) < 0)
        PyErr_Clear();
    PyErr_Restore(type, value, traceback);
}

static PyObject *
record_request(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != Q_SIZE) {
        PyErr_SetString(PyExc_TypeError, "request(state, conn, req, size)");
        return NULL;
    }
    PyObject *state = args[0], *conn = args[1], *req = args[2], *size = args[3];
    PyObject *observer = PyTuple_GET_ITEM(state, Q_OBSERVER);
    PyObject *held = NULL, *header = NULL, *rate = NULL, *body = NULL, *counted = NULL;
    PyObject *acks = NULL, *topics = NULL, *record = NULL, *conn_id = NULL, *result = NULL;

    held = PyObject_GetAttr(observer, a_held);
    if (held == NULL)
        goto done;
    if (held != Py_None)
        goto slow_path;  /* an acks=0 request's record waits to go out first */
    header = PyObject_GetAttr(req, a_header);
    if (header == NULL)
        goto done;
    if (!PyTuple_Check(header) || PyTuple_GET_SIZE(header) < 4)
        goto slow_path;
    PyObject *key = PyTuple_GET_ITEM(header, 0), *version = PyTuple_GET_ITEM(header, 1);
    long api_key = PyLong_CheckExact(key) ? PyLong_AsLong(key) : -1;
    if (api_key == -1 && PyErr_Occurred())
        goto done;
    if (api_key != PRODUCE && api_key != FETCH)
        goto slow_path;
    rate = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, Q_RATES), key);
    if (rate == NULL && PyErr_Occurred())
        goto done;
    rate = Py_NewRef(rate ? rate : PyTuple_GET_ITEM(state, Q_RATE_DEFAULT));
    if (!PyFloat_CheckExact(rate) || PyFloat_AS_DOUBLE(rate) < 1.0)
        goto slow_path;  /* sampled: the Python method draws */
    int known = PySequence_Contains(PyTuple_GET_ITEM(PyTuple_GET_ITEM(state, Q_VERSIONS), api_key),
                                    version);
    if (known < 0)
        goto done;
    if (!known)
        goto slow_path;
    if (api_key == PRODUCE) {
        body = PyObject_GetAttr(req, a_body);
        if (body == NULL)
            goto done;
        if (body != PyTuple_GET_ITEM(state, Q_UNSET))
            goto slow_path;  /* decoded (a rule read it): the Python method reads that */
        counted = PyObject_CallOneArg(PyTuple_GET_ITEM(state, Q_REQUEST_TOPICS), req);
        if (counted == NULL)
            goto done;
        if (counted == Py_None)
            goto slow_path;
        acks = PyObject_CallOneArg(PyTuple_GET_ITEM(state, Q_ACKS), req);
        if (acks == NULL)
            goto done;
        if (!PyLong_CheckExact(acks))
            goto slow_path;
        long value = PyLong_AsLong(acks);
        if (value == -1 && PyErr_Occurred())
            goto done;
        if (value == 0)
            goto slow_path;  /* no answer coming: held, then written */
        int r = counted_topics(counted, PyTuple_GET_ITEM(state, Q_ID_TEXTS),
                               PyTuple_GET_ITEM(state, Q_TOPIC_NAMES),
                               PyTuple_GET_ITEM(state, Q_NAMED_ID), &topics);
        if (r < 0)
            goto done;
        if (r == 0)
            goto slow_path;
    } else {
        topics = PyList_New(0);  /* Fetch: its answer says what moved */
        if (topics == NULL)
            goto done;
    }
    conn_id = PyObject_GetAttr(conn, k_id);
    if (conn_id == NULL)
        goto done;
    PyObject *waiting = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, Q_IN_FLIGHT), conn_id);
    if (waiting == NULL && PyErr_Occurred())
        goto done;
    if (waiting != NULL && !PyDict_CheckExact(waiting))
        goto slow_path;
    record = PyDict_Copy(PyTuple_GET_ITEM(state, Q_BLANK));
    if (record == NULL
            || set_new(record, k_time, PyFloat_FromDouble(wall_clock())) < 0
            || PyDict_SetItem(record, k_conn, conn_id) < 0
            || set_attr(record, k_client, conn, k_client) < 0
            || set_attr(record, k_listener, conn, k_listener) < 0
            || PyDict_SetItem(record, k_client_id, PyTuple_GET_ITEM(header, 3)) < 0
            || set_attr(record, k_software_name, conn, k_software_name) < 0
            || set_attr(record, k_software_version, conn, k_software_version) < 0
            || set_attr(record, k_principal, conn, k_principal) < 0
            || PyDict_SetItem(record, k_api, PyTuple_GET_ITEM(PyTuple_GET_ITEM(state, Q_NAMES),
                                                               api_key)) < 0
            || PyDict_SetItem(record, k_api_key, key) < 0
            || PyDict_SetItem(record, k_api_version, version) < 0
            || PyDict_SetItem(record, k_correlation_id, PyTuple_GET_ITEM(header, 2)) < 0
            || PyDict_SetItem(record, k_request_bytes, size) < 0
            || set_new(record, k_errors, PyList_New(0)) < 0
            || PyDict_SetItem(record, k_topics, topics) < 0
            || set_new(record, k_rules, PyList_New(0)) < 0
            || PyDict_SetItem(record, k_sample, rate) < 0)
        goto done;
    /* The connection's records in flight (looked up again: attribute reads ran code). */
    waiting = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, Q_IN_FLIGHT), conn_id);
    if (waiting == NULL) {
        if (PyErr_Occurred())
            goto done;
        waiting = PyDict_New();
        if (waiting == NULL)
            goto done;
        int r = PyDict_SetItem(PyTuple_GET_ITEM(state, Q_IN_FLIGHT), conn_id, waiting);
        Py_DECREF(waiting);  /* the dict of connections holds it */
        if (r < 0)
            goto done;
    }
    if (PyDict_SetItem(waiting, PyTuple_GET_ITEM(header, 2), record) < 0
            || PyObject_SetAttr(observer, a_current, record) < 0)
        goto done;
    result = Py_NewRef(Py_None);
    goto done;

slow_path:
    {
        PyObject *call[3] = {conn, req, size};
        result = PyObject_Vectorcall(PyTuple_GET_ITEM(state, Q_PYTHON), call, 3, NULL);
    }
done:
    if (result == NULL)
        forget_current(observer);
    Py_XDECREF(held);
    Py_XDECREF(header);
    Py_XDECREF(rate);
    Py_XDECREF(body);
    Py_XDECREF(counted);
    Py_XDECREF(acks);
    Py_XDECREF(topics);
    Py_XDECREF(record);
    Py_XDECREF(conn_id);
    return result;
}

/* The non-zero codes of a scan's {code: count}, sorted, and how many times they came.
 * 1: done; 0: not the shape expected; -1: an error. */
static int
error_codes(PyObject *codes, PyObject **sorted, long long *count)
{
    if (!PyDict_CheckExact(codes))
        return 0;
    PyObject *list = PyList_New(0), *code, *times;
    if (list == NULL)
        return -1;
    long long total = 0;
    Py_ssize_t pos = 0;
    while (PyDict_Next(codes, &pos, &code, &times)) {
        if (!PyLong_CheckExact(code) || !PyLong_CheckExact(times)) {
            Py_DECREF(list);
            return 0;
        }
        int zero = PyObject_Not(code);
        if (zero < 0) {
            Py_DECREF(list);
            return -1;
        }
        if (zero)
            continue;
        long long n = PyLong_AsLongLong(times);
        if ((n == -1 && PyErr_Occurred()) || n < 0 || total > LLONG_MAX - n) {
            PyErr_Clear();
            Py_DECREF(list);
            return 0;
        }
        total += n;
        if (PyList_Append(list, code) < 0) {
            Py_DECREF(list);
            return -1;
        }
    }
    if (PyList_Sort(list) < 0) {
        Py_DECREF(list);
        return -1;
    }
    *sorted = list;
    *count = total;
    return 1;
}

/* round(value, 3), as float.__round__ does it (correctly rounded decimal digits). */
static PyObject *
rounded_3(double value)
{
    char *text = PyOS_double_to_string(value, 'f', 3, 0, NULL);
    if (text == NULL)
        return NULL;
    double back = PyOS_string_to_double(text, NULL, NULL);
    PyMem_Free(text);
    if (back == -1.0 && PyErr_Occurred())
        return NULL;
    return PyFloat_FromDouble(back);
}

static PyObject *
record_response(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if ((nargs != 5 && nargs != 6) || !PyTuple_CheckExact(args[0])
            || PyTuple_GET_SIZE(args[0]) != P_SIZE) {
        PyErr_SetString(PyExc_TypeError, "response(state, conn, pending, size, elapsed, frame=None)");
        return NULL;
    }
    PyObject *state = args[0], *conn = args[1], *pending = args[2], *size = args[3];
    PyObject *elapsed = args[4], *frame = nargs == 6 ? args[5] : Py_None;
    PyObject *observer = PyTuple_GET_ITEM(state, P_OBSERVER);
    PyObject *held = NULL, *local = NULL, *key = NULL, *decoded = NULL, *conn_id = NULL;
    PyObject *waiting = NULL, *corr = NULL, *record = NULL, *scan = NULL, *errors = NULL;
    PyObject *topics = NULL, *latency = NULL, *listed = NULL, *result = NULL;
    long long error_count = 0;

    held = PyObject_GetAttr(observer, a_held);
    if (held == NULL)
        goto done;
    if (held != Py_None)  /* with no frame (a spliced answer), the scan made on the way */
        goto slow_path;
    local = PyObject_GetAttr(pending, a_local);
    if (local == NULL)
        goto done;
    if (local != Py_None)
        goto slow_path;  /* the proxy's own answer: refused or by_proxy */
    key = PyObject_GetAttr(pending, k_api_key);
    if (key == NULL)
        goto done;
    long api_key = PyLong_CheckExact(key) ? PyLong_AsLong(key) : -1;
    if (api_key == -1 && PyErr_Occurred())
        goto done;
    if (api_key != PRODUCE && api_key != FETCH)
        goto slow_path;
    decoded = PyObject_GetAttr(pending, a_decoded);
    if (decoded == NULL)
        goto done;
    if (decoded != Py_None)
        goto slow_path;
    double seconds = PyFloat_AsDouble(elapsed);
    if (seconds == -1.0 && PyErr_Occurred())
        goto done;
    if (!isfinite(seconds))
        goto slow_path;
    conn_id = PyObject_GetAttr(conn, k_id);
    if (conn_id == NULL)
        goto done;
    corr = PyObject_GetAttr(pending, k_correlation_id);
    if (corr == NULL)
        goto done;
    waiting = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, P_IN_FLIGHT), conn_id);
    if (waiting == NULL) {
        if (PyErr_Occurred())
            goto done;
        goto slow_path;
    }
    Py_INCREF(waiting);
    if (!PyDict_CheckExact(waiting))
        goto slow_path;
    record = PyDict_GetItemWithError(waiting, corr);
    if (record == NULL) {
        if (PyErr_Occurred())
            goto done;
        goto slow_path;  /* sampled out, or not recorded: the Python method says so */
    }
    Py_INCREF(record);
    if (!PyDict_CheckExact(record))
        goto slow_path;
    int mapped = PyDict_Contains(record, k_maps);
    if (mapped < 0)
        goto done;
    if (mapped)
        goto slow_path;  /* a rename's topic map gives the broker-side names */
    {
        PyObject *call[2] = {pending, frame};
        scan = PyObject_Vectorcall(PyTuple_GET_ITEM(state, P_SCAN), call, 2, NULL);
    }
    if (scan == NULL)
        goto done;
    if (!PyTuple_CheckExact(scan) || PyTuple_GET_SIZE(scan) < 3)
        goto slow_path;
    int r = error_codes(PyTuple_GET_ITEM(scan, 0), &errors, &error_count);
    if (r < 0)
        goto done;
    if (r == 0)
        goto slow_path;
    if (api_key == FETCH) {
        r = counted_topics(PyTuple_GET_ITEM(scan, 2), PyTuple_GET_ITEM(state, P_ID_TEXTS),
                           PyTuple_GET_ITEM(state, P_TOPIC_NAMES),
                           PyTuple_GET_ITEM(state, P_NAMED_ID), &topics);
        if (r < 0)
            goto done;
        if (r == 0)
            goto slow_path;
    } else {
        topics = PyDict_GetItemWithError(record, k_topics);
        if (topics == NULL) {
            if (PyErr_Occurred())
                goto done;
            goto slow_path;
        }
        Py_INCREF(topics);
    }
    if (!PyList_CheckExact(topics))
        goto slow_path;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(topics); i++) {
        PyObject *topic = PyList_GET_ITEM(topics, i);
        if (!PyDict_CheckExact(topic))
            goto slow_path;
        int named = PyDict_Contains(topic, k_name);
        if (named <= 0) {
            if (named < 0)
                goto done;
            goto slow_path;
        }
    }
    latency = rounded_3(seconds * 1000.0);
    if (latency == NULL)
        goto done;
    /* Everything found: the record is finished and goes out. */
    if (PyDict_DelItem(waiting, corr) < 0
            || PyObject_SetAttr(observer, a_current, Py_None) < 0
            || PyDict_SetItem(record, k_response_bytes, size) < 0
            || PyDict_SetItem(record, k_latency_ms, latency) < 0
            || PyDict_SetItem(record, k_outcome, v_answered) < 0)
        goto done;
    if (PyList_GET_SIZE(errors)
            && (PyDict_SetItem(record, k_errors, errors) < 0
                || set_new(record, k_error_count, PyLong_FromLongLong(error_count)) < 0))
        goto done;
    if (api_key == FETCH && PyDict_SetItem(record, k_topics, topics) < 0)
        goto done;
    /* No topic map: each topic's broker-side name is its name (CaptureObserver._emit). */
    listed = PyList_GetSlice(topics, 0, PyList_GET_SIZE(topics));
    if (listed == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(listed); i++) {
        PyObject *topic = PyList_GET_ITEM(listed, i);
        PyObject *name = PyDict_GetItemWithError(topic, k_name);
        if (name == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, k_name);
            goto done;
        }
        if (PyDict_SetItem(topic, k_broker, name) < 0)
            goto done;
    }
    PyObject *offers = PyTuple_GET_ITEM(state, P_OFFERS);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(offers); i++) {
        PyObject *offered = PyObject_CallOneArg(PyTuple_GET_ITEM(offers, i), record);
        if (offered == NULL)
            goto done;
        Py_DECREF(offered);
    }
    result = Py_NewRef(Py_None);
    goto done;

slow_path:
    {
        PyObject *call[5] = {conn, pending, size, elapsed, frame};
        result = PyObject_Vectorcall(PyTuple_GET_ITEM(state, P_PYTHON), call, 5, NULL);
    }
done:
    if (result == NULL)
        forget_current(observer);
    Py_XDECREF(held);
    Py_XDECREF(local);
    Py_XDECREF(key);
    Py_XDECREF(decoded);
    Py_XDECREF(conn_id);
    Py_XDECREF(waiting);
    Py_XDECREF(corr);
    Py_XDECREF(record);
    Py_XDECREF(scan);
    Py_XDECREF(errors);
    Py_XDECREF(topics);
    Py_XDECREF(latency);
    Py_XDECREF(listed);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_lines", (PyCFunction)(void (*)(void))encode_lines, METH_FASTCALL,
     "encode_lines(records, fallback) -> bytes: each record as one compact JSON line "
     "(ensure_ascii), each ending in a line feed; a record holding what this encoder does "
     "not write is fallback(record)'s text."},
    {"encode_record", (PyCFunction)(void (*)(void))encode_record, METH_FASTCALL,
     "encode_record(record, fallback) -> bytes: one record as compact JSON, no line feed."},
    {"request", (PyCFunction)(void (*)(void))record_request, METH_FASTCALL,
     "request(state, conn, req, size): CaptureObserver.request for the usual exchange."},
    {"response", (PyCFunction)(void (*)(void))record_response, METH_FASTCALL,
     "response(state, conn, pending, size, elapsed, frame=None): CaptureObserver.response "
     "for the usual exchange."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gatehouse.capture._records",
    "The observation log's records and their JSON lines, in C (see gatehouse/capture/_records.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__records(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&k_time, "time"}, {&k_conn, "conn"}, {&k_client, "client"},
        {&k_listener, "listener"}, {&k_client_id, "client_id"},
        {&k_software_name, "software_name"}, {&k_software_version, "software_version"},
        {&k_principal, "principal"}, {&k_api, "api"}, {&k_api_key, "api_key"},
        {&k_api_version, "api_version"}, {&k_correlation_id, "correlation_id"},
        {&k_request_bytes, "request_bytes"}, {&k_errors, "errors"}, {&k_topics, "topics"},
        {&k_rules, "rules"}, {&k_sample, "sample"}, {&k_response_bytes, "response_bytes"},
        {&k_latency_ms, "latency_ms"}, {&k_outcome, "outcome"},
        {&k_error_count, "error_count"}, {&k_maps, "_maps"}, {&k_name, "name"},
        {&k_broker, "broker"}, {&k_id, "id"}, {&k_partitions, "partitions"},
        {&k_records, "records"}, {&k_bytes, "bytes"}, {&a_held, "_held"},
        {&a_current, "_current"}, {&a_header, "header"}, {&a_body, "_body"},
        {&a_local, "local"}, {&a_decoded, "decoded"}, {&v_answered, "answered"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].slot == NULL && (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    }
    return PyModule_Create(&module);
}
