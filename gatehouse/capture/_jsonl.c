/* Capture records as JSON lines, in C: the bytes json.JSONEncoder(separators=(",", ":"),
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
 * (tests/test_capture_jsonl.py holds the two to the same bytes).  The GIL is held
 * throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

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

static PyMethodDef methods[] = {
    {"encode_lines", (PyCFunction)(void (*)(void))encode_lines, METH_FASTCALL,
     "encode_lines(records, fallback) -> bytes: each record as one compact JSON line "
     "(ensure_ascii), each ending in a line feed; a record holding what this encoder does "
     "not write is fallback(record)'s text."},
    {"encode_record", (PyCFunction)(void (*)(void))encode_record, METH_FASTCALL,
     "encode_record(record, fallback) -> bytes: one record as compact JSON, no line feed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gatehouse.capture._jsonl",
    "Capture records as JSON lines, in C (see gatehouse/capture/_jsonl.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__jsonl(void)
{
    return PyModule_Create(&module);
}
