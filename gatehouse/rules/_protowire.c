/* The Protobuf walk of gatehouse/rules/protobuf.py in C: whether a message's bytes read
 * as the message a table names (tables built by protobuf._native_tables).
 *
 * It only ever says "it reads" (True) or "look again" (False): on False the Python walk
 * runs and says what is wrong (or, for the few cases this one is stricter about, that
 * nothing is).  So True here must mean the Python walk finds nothing; the tests hold
 * the two to that over hypothesis' mutants (tests/test_rules_protobuf.py).
 *
 * The tables are one bytes object of uint32s, built once per schema: the number of
 * messages, then each message's table as (where it starts, its length), then the
 * tables: an action per tag (field number << 3 | wire type) up to the message's largest
 * declared number, the action's low 4 bits saying what the tag calls for, the rest the
 * index of the message a nested message or group is.  A call looks its tables up in
 * place: nothing is built per record.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The codes of protobuf.py's _native_tables. */
enum {
    A_NONE = 0,          /* no declared field has that number: skipped by wire type */
    A_VARINT = 1,
    A_BYTES = 2,
    A_STRING = 3,        /* length-delimited, UTF-8 checked */
    A_MESSAGE = 4,
    A_PACKED_VARINT = 5,
    A_PACKED_8 = 6,
    A_PACKED_4 = 7,
    A_I64 = 8,
    A_I32 = 9,
    A_GROUP = 10,
    A_MISMATCH = 15,     /* a declared number in a wire type its type never uses */
};

#define MAX_DEPTH 64

typedef struct {
    const uint8_t *data;
    Py_ssize_t pos;
    const uint32_t *tables;  /* the directory and the tables (see the top) */
    Py_ssize_t words;        /* how many uint32s there are */
} walk_t;

/* A varint of at most 10 bytes into *out; 0 when it runs past end or is longer. */
static int varint(walk_t *w, Py_ssize_t end, uint64_t *out)
{
    uint64_t result = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (w->pos >= end)
            return 0;
        uint8_t byte = w->data[w->pos++];
        if (shift < 64)
            result |= (uint64_t)(byte & 0x7F) << shift;
        if (byte < 0x80) {
            *out = result;
            return 1;
        }
    }
    return 0;
}

static int skip(walk_t *w, Py_ssize_t end, uint64_t wire, uint64_t number, int depth);

/* Through a group's end tag for ``number``. */
static int skip_group(walk_t *w, Py_ssize_t end, uint64_t number, int depth)
{
    if (depth >= MAX_DEPTH)
        return 0;
    for (;;) {
        uint64_t key;
        if (!varint(w, end, &key) || key >> 32 || key >> 3 == 0)
            return 0;
        if ((key & 7) == 4)
            return key >> 3 == number;
        if (!skip(w, end, key & 7, key >> 3, depth + 1))
            return 0;
    }
}

static int skip(walk_t *w, Py_ssize_t end, uint64_t wire, uint64_t number, int depth)
{
    uint64_t value;
    switch (wire) {
    case 0:
        return varint(w, end, &value);
    case 1:
        if (end - w->pos < 8)
            return 0;
        w->pos += 8;
        return 1;
    case 5:
        if (end - w->pos < 4)
            return 0;
        w->pos += 4;
        return 1;
    case 2:
        if (!varint(w, end, &value) || value > (uint64_t)(end - w->pos))
            return 0;
        w->pos += (Py_ssize_t)value;
        return 1;
    case 3:
        return skip_group(w, end, number, depth);
    default:
        return 0;
    }
}

static int utf8(const uint8_t *text, Py_ssize_t length)
{
    Py_ssize_t i = 0;
    while (i < length && text[i] < 0x80)
        i++;
    if (i == length)
        return 1;
    /* Not all ASCII: Python's own decoder decides, as the Python walk's does. */
    PyObject *decoded = PyUnicode_DecodeUTF8((const char *)text, length, "strict");
    if (decoded == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(decoded);
    return 1;
}

/* The message of ``table`` in data[pos:end]; ``group``: the group number it ends with
 * (or -1: it ends at end). */
static int walk(walk_t *w, Py_ssize_t end, Py_ssize_t message, int depth, int64_t group)
{
    if (depth > MAX_DEPTH || message < 0 || message >= (Py_ssize_t)w->tables[0]
            || 2 + 2 * message >= w->words)
        return 0;
    Py_ssize_t at = w->tables[1 + 2 * message], size = w->tables[2 + 2 * message];
    if (at > w->words || size > w->words - at)
        return 0;
    const uint32_t *actions = w->tables + at;
    while (w->pos < end) {
        uint64_t key;
        uint8_t first = w->data[w->pos];
        if (first < 0x80) {
            key = first;
            w->pos++;
        } else if (!varint(w, end, &key) || key >> 32) {
            return 0;
        }
        uint64_t number = key >> 3, wire = key & 7;
        if (number == 0)
            return 0;
        if (wire == 4)
            return group >= 0 && number == (uint64_t)group;
        uint32_t action = key < (uint64_t)size ? actions[key] : A_NONE;
        uint64_t length;
        Py_ssize_t stop;
        switch (action & 15) {
        case A_NONE:
            if (!skip(w, end, wire, number, depth))
                return 0;
            break;
        case A_VARINT:
            if (!varint(w, end, &length))
                return 0;
            break;
        case A_BYTES:
        case A_STRING:
        case A_MESSAGE:
        case A_PACKED_VARINT:
        case A_PACKED_8:
        case A_PACKED_4:
            if (!varint(w, end, &length) || length > (uint64_t)(end - w->pos))
                return 0;
            stop = w->pos + (Py_ssize_t)length;
            switch (action & 15) {
            case A_STRING:
                if (!utf8(w->data + w->pos, (Py_ssize_t)length))
                    return 0;
                break;
            case A_MESSAGE:
                if (!walk(w, stop, (Py_ssize_t)(action >> 4), depth + 1, -1))
                    return 0;
                break;
            case A_PACKED_VARINT:
                while (w->pos < stop)
                    if (!varint(w, stop, &length))
                        return 0;
                break;
            case A_PACKED_8:
                if (length % 8)
                    return 0;
                break;
            case A_PACKED_4:
                if (length % 4)
                    return 0;
                break;
            }
            w->pos = stop;
            break;
        case A_I64:
            if (end - w->pos < 8)
                return 0;
            w->pos += 8;
            break;
        case A_I32:
            if (end - w->pos < 4)
                return 0;
            w->pos += 4;
            break;
        case A_GROUP:
            if (!walk(w, end, (Py_ssize_t)(action >> 4), depth + 1, (int64_t)number))
                return 0;
            break;
        default: /* A_MISMATCH */
            return 0;
        }
    }
    return group < 0;
}

static PyObject *reads(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t start, message;
    PyObject *tables;
    if (!PyArg_ParseTuple(args, "y*nO!n", &data, &start, &PyBytes_Type, &tables, &message))
        return NULL;
    Py_ssize_t words = PyBytes_GET_SIZE(tables) / 4;
    int ok = 0;
    if (PyBytes_GET_SIZE(tables) % 4 || words < 1) {
        PyErr_SetString(PyExc_TypeError, "tables are bytes of uint32s");
        ok = -1;
    } else if (start >= 0 && start <= data.len) {
        walk_t w = {(const uint8_t *)data.buf, start,
                    (const uint32_t *)PyBytes_AS_STRING(tables), words};
        ok = walk(&w, data.len, message, 0, -1);
    }
    PyBuffer_Release(&data);
    if (ok < 0)
        return NULL;
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"reads", reads, METH_VARARGS,
     "reads(data, start, tables, message) -> bool: whether data[start:] reads as the "
     "message of tables[message] (False: let the Python walk say)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_protowire", "The Protobuf walk of protobuf.py, in C.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__protowire(void)
{
    return PyModule_Create(&module);
}
