/* The compiled decoders of gatehouse.codecs._compile, in C: one interpreter of a
 * "program" per struct and version, made once from the same tables.
 *
 * A program says, field by field in wire order, what to read and into which slot of the
 * struct's record (a tuple subclass); slots of fields absent from the version and of
 * tagged fields not sent get the field's default.  decode() builds exactly the records
 * the generated Python decoder builds (tests/test_codec_native.py holds the two to each
 * other on every message and version, on random, cut and mutated frames), or returns
 * None where the bytes are not a valid message: the caller then runs the Python decoder,
 * which raises the error with its field path and offset.  So this file never explains
 * an error; it only has to refuse every frame the Python decoder refuses.
 *
 * Differences by design: an array of three or more elements of a struct the compiler
 * reads in bulk (Metadata's partitions) is a FlatRecords whose records are already
 * built (the Python decoder builds them when first read); both are equal to the tuple of
 * their records and both encode back as their bytes.
 *
 * Everything made here is a tree: records, tuples, UUIDs, views of the frame, FlatRecords;
 * each refers only to objects made here, to constants of the tables, or to the frame's
 * buffer, never back.  No cycle can pass through them, so they are left out of the cyclic
 * collector's lists (reference counting frees them): a 10,000-partition Metadata answer
 * adds little work to the collector's full passes.  Views of the frame stay in the lists
 * (memoryview's deallocator expects to be tracked).
 *
 * Every read is bounds-checked against the end of what it may read (the frame, or a
 * tagged field's own bytes); counts are checked against the bytes left before anything
 * is allocated for them.  Pure: no I/O, no state but the constants set by configure().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

enum {
    K_NUM = 0, K_UUID = 1, K_STRING = 2, K_BYTES = 3, K_RECORDS = 4, K_ARRAY = 5, K_STRUCT = 6,
};

typedef struct Program Program;

typedef struct {
    Py_ssize_t slot;
    int kind;
    int nullable;
    int compact;        /* a varint length (flexible versions) */
    int elem;           /* K_ARRAY: the elements' kind (K_NUM..K_RECORDS, K_STRUCT) */
    char code;          /* K_NUM (or an array of them): the struct module's format code */
    Py_ssize_t size;    /* its size in bytes */
    Program *sub;       /* K_STRUCT, or an array of structs */
    PyObject *flat;     /* an array of a bulk-read struct: its FlatRecords kind, else NULL */
    int64_t tag;        /* a tagged field's tag */
} Op;

struct Program {
    PyTypeObject *cls;
    Py_ssize_t nslots;      /* the struct's fields; the record has one more: unknown tags */
    PyObject *defaults;     /* tuple: each field's default */
    char *from_default;     /* per slot: 1 where no regular field fills it */
    int flexible;
    Py_ssize_t nops, ntags;
    Op *ops, *tags;
    PyObject *refs;         /* keeps sub-programs and kinds alive */
};

#define CAPSULE_NAME "gatehouse.codecs._decoder.program"

/* configure(): what the records hold, and where the slots of a UUID and of a
 * FlatRecords lie in their objects (Python-level __slots__: member descriptors). */
static PyObject *uuid_cls, *safe_unknown, *zero_uuid, *flat_cls, *empty_tuple;
static Py_ssize_t at_int, at_is_safe, at_raw, at_n, at_shape, at_kind, at_items;

/* Arrays of numbers repeat (replica sets over a few brokers): within one decode, an
 * array whose bytes were seen is the same tuple again.  A small direct-mapped table. */
#define SEEN_SLOTS 64
#define SEEN_MAX_BYTES 64
typedef struct {
    const unsigned char *at;    /* the array's numbers in the frame */
    Py_ssize_t len;
    char code;
    PyObject *tuple;            /* owned */
} Seen;

typedef struct {
    const unsigned char *p;     /* the frame */
    Py_ssize_t end;             /* what may be read: [0, end) */
    PyObject *view;             /* the frame's memoryview (records are views of it) */
    Seen *seen;                 /* SEEN_SLOTS entries */
} Src;

/* ---------------------------------------------------------------------------------- */

static void
program_free(PyObject *capsule)
{
    Program *pg = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (pg == NULL)
        return;
    Py_XDECREF(pg->cls);
    Py_XDECREF(pg->defaults);
    Py_XDECREF(pg->refs);
    PyMem_Free(pg->from_default);
    PyMem_Free(pg->ops);
    PyMem_Free(pg->tags);
    PyMem_Free(pg);
}

static Program *
as_program(PyObject *obj)
{
    if (!PyCapsule_IsValid(obj, CAPSULE_NAME)) {
        PyErr_SetString(PyExc_TypeError, "not a decoder program");
        return NULL;
    }
    return PyCapsule_GetPointer(obj, CAPSULE_NAME);
}

static Py_ssize_t
number_size(char code)
{
    switch (code) {
    case 'b': case '?': return 1;
    case 'h': case 'H': return 2;
    case 'i': case 'I': return 4;
    case 'q': case 'd': return 8;
    default: return -1;
    }
}

/* One op from (slot, kind, nullable, compact, elem, arg, flat[, tag]): arg is a format
 * code (numbers), a program (structs) or None. */
static int
parse_op(PyObject *item, Op *op, int tagged, PyObject *refs, Py_ssize_t nslots)
{
    Py_ssize_t want = tagged ? 8 : 7;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != want) {
        PyErr_SetString(PyExc_ValueError, "decoder program: a bad op");
        return -1;
    }
    memset(op, 0, sizeof *op);
    op->slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0));
    op->kind = (int)PyLong_AsLong(PyTuple_GET_ITEM(item, 1));
    op->nullable = PyObject_IsTrue(PyTuple_GET_ITEM(item, 2));
    op->compact = PyObject_IsTrue(PyTuple_GET_ITEM(item, 3));
    op->elem = (int)PyLong_AsLong(PyTuple_GET_ITEM(item, 4));
    if (tagged)
        op->tag = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 7));
    if (PyErr_Occurred())
        return -1;
    PyObject *arg = PyTuple_GET_ITEM(item, 5), *flat = PyTuple_GET_ITEM(item, 6);
    int value_kind = op->kind == K_ARRAY ? op->elem : op->kind;
    if (op->slot < 0 || op->slot >= nslots || op->kind < K_NUM || op->kind > K_STRUCT
            || value_kind < K_NUM || value_kind > K_STRUCT || value_kind == K_ARRAY) {
        PyErr_SetString(PyExc_ValueError, "decoder program: a bad op");
        return -1;
    }
    if (value_kind == K_NUM) {
        const char *code = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
        if (code == NULL || strlen(code) != 1 || number_size(code[0]) < 0) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "decoder program: a bad number code");
            return -1;
        }
        op->code = code[0];
        op->size = number_size(code[0]);
    } else if (value_kind == K_STRUCT) {
        if ((op->sub = as_program(arg)) == NULL || PyList_Append(refs, arg) < 0)
            return -1;
    }
    if (flat != Py_None) {
        if (op->kind != K_ARRAY || op->elem != K_STRUCT || flat_cls == NULL) {
            PyErr_SetString(PyExc_ValueError, "decoder program: a bulk kind off a struct array");
            return -1;
        }
        if (PyList_Append(refs, flat) < 0)
            return -1;
        op->flat = flat;
    }
    return 0;
}

static PyObject *
make_program(PyObject *self, PyObject *args)
{
    PyObject *cls, *defaults, *ops, *tags;
    int flexible;
    if (!PyArg_ParseTuple(args, "O!O!pO!O!", &PyType_Type, &cls, &PyTuple_Type, &defaults,
                          &flexible, &PyTuple_Type, &ops, &PyTuple_Type, &tags))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "decoder program: records must be tuples");
        return NULL;
    }
    Program *pg = PyMem_Calloc(1, sizeof *pg);
    if (pg == NULL)
        return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(pg, CAPSULE_NAME, program_free);
    if (capsule == NULL) {
        PyMem_Free(pg);
        return NULL;
    }
    pg->cls = (PyTypeObject *)Py_NewRef(cls);
    pg->defaults = Py_NewRef(defaults);
    pg->nslots = PyTuple_GET_SIZE(defaults);
    pg->flexible = flexible;
    pg->nops = PyTuple_GET_SIZE(ops);
    pg->ntags = PyTuple_GET_SIZE(tags);
    pg->refs = PyList_New(0);
    pg->from_default = PyMem_Calloc(pg->nslots + 1, 1);
    pg->ops = PyMem_Calloc(pg->nops + 1, sizeof(Op));
    pg->tags = PyMem_Calloc(pg->ntags + 1, sizeof(Op));
    if (pg->refs == NULL || pg->from_default == NULL || pg->ops == NULL || pg->tags == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    memset(pg->from_default, 1, pg->nslots);
    for (Py_ssize_t i = 0; i < pg->nops; i++) {
        if (parse_op(PyTuple_GET_ITEM(ops, i), &pg->ops[i], 0, pg->refs, pg->nslots) < 0)
            goto fail;
        if (!pg->from_default[pg->ops[i].slot]) {
            PyErr_SetString(PyExc_ValueError, "decoder program: a slot filled twice");
            goto fail;
        }
        pg->from_default[pg->ops[i].slot] = 0;
    }
    for (Py_ssize_t i = 0; i < pg->ntags; i++) {
        if (parse_op(PyTuple_GET_ITEM(tags, i), &pg->tags[i], 1, pg->refs, pg->nslots) < 0)
            goto fail;
        if (!pg->from_default[pg->tags[i].slot]) {
            PyErr_SetString(PyExc_ValueError, "decoder program: a tagged field in a regular slot");
            goto fail;
        }
    }
    if (pg->ntags && !flexible) {
        PyErr_SetString(PyExc_ValueError, "decoder program: tagged fields in a fixed version");
        goto fail;
    }
    return capsule;
fail:
    Py_DECREF(capsule);
    return NULL;
}

/* ---------------------------------------------------------------------------------- */
/* Reading.  A reader returns a new reference, or NULL: with an exception set (memory),
 * or without one (the bytes are not valid: the caller answers None). */

#define BAD() (NULL)

static inline int
has(const Src *s, Py_ssize_t pos, Py_ssize_t n)
{
    return pos >= 0 && n >= 0 && pos <= s->end && n <= s->end - pos;
}

/* An unsigned varint of at most five bytes (primitives.read_uvarint). */
static int
uvarint(const Src *s, Py_ssize_t *pos, int64_t *value)
{
    Py_ssize_t at = *pos;
    int64_t v = 0;
    for (int shift = 0; shift <= 28; shift += 7) {
        if (at >= s->end)
            return -1;
        unsigned char c = s->p[at++];
        v |= (int64_t)(c & 0x7F) << shift;
        if (c < 0x80) {
            *pos = at;
            *value = v;
            return 0;
        }
    }
    return -1;
}

static inline uint16_t
be16(const unsigned char *p)
{
    return (uint16_t)(((unsigned)p[0] << 8) | p[1]);
}

static inline uint32_t
be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline uint64_t
be64(const unsigned char *p)
{
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}

/* A length prefix: a varint minus one (compact), else an int16 (strings) or int32. */
static int
length(const Src *s, Py_ssize_t *pos, int compact, int wide, int64_t *n)
{
    if (compact) {
        if (uvarint(s, pos, n) < 0)
            return -1;
        *n -= 1;
        return 0;
    }
    Py_ssize_t size = wide ? 4 : 2;
    if (!has(s, *pos, size))
        return -1;
    *n = wide ? (int32_t)be32(s->p + *pos) : (int16_t)be16(s->p + *pos);
    *pos += size;
    return 0;
}

static PyObject *
number(const unsigned char *p, char code)
{
    switch (code) {
    case 'b': return PyLong_FromLong((int8_t)p[0]);
    case '?': return Py_NewRef(p[0] ? Py_True : Py_False);
    case 'h': return PyLong_FromLong((int16_t)be16(p));
    case 'H': return PyLong_FromLong(be16(p));
    case 'i': return PyLong_FromLong((int32_t)be32(p));
    case 'I': return PyLong_FromUnsignedLong(be32(p));
    case 'q': return PyLong_FromLongLong((int64_t)be64(p));
    case 'd': return PyFloat_FromDouble(PyFloat_Unpack8((const char *)p, 0));
    default:
        PyErr_SetString(PyExc_SystemError, "decoder: a bad number code");
        return NULL;
    }
}

static inline PyObject *
untracked(PyObject *obj)
{
    if (obj != NULL && PyObject_GC_IsTracked(obj))
        PyObject_GC_UnTrack(obj);
    return obj;
}

/* A slot of an object just allocated (so empty) takes a new reference to value. */
static inline void
set_slot(PyObject *obj, Py_ssize_t offset, PyObject *value)
{
    PyObject **slot = (PyObject **)((char *)obj + offset);
    Py_XSETREF(*slot, Py_NewRef(value));
}

/* As _compile._uuid_from_bytes: ZERO_UUID for zeros, else a UUID made without checks. */
static PyObject *
read_uuid(const Src *s, Py_ssize_t *pos)
{
    if (!has(s, *pos, 16))
        return BAD();
    const unsigned char *p = s->p + *pos;
    *pos += 16;
    static const unsigned char zeros[16];
    if (memcmp(p, zeros, 16) == 0)
        return Py_NewRef(zero_uuid);
    PyObject *value = _PyLong_FromByteArray(p, 16, 0, 0);
    if (value == NULL)
        return NULL;
    PyTypeObject *type = (PyTypeObject *)uuid_cls;
    PyObject *u = type->tp_alloc(type, 0);
    if (u == NULL) {
        Py_DECREF(value);
        return NULL;
    }
    set_slot(u, at_int, value);
    set_slot(u, at_is_safe, safe_unknown);
    Py_DECREF(value);
    return untracked(u);
}

/* A string, bytes or records value (not an array element: see read_value). */
static PyObject *
read_sized(const Src *s, Py_ssize_t *pos, int kind, int nullable, int compact)
{
    int64_t n;
    if (length(s, pos, compact, kind != K_STRING, &n) < 0)
        return BAD();
    if (n < 0)
        return nullable ? Py_NewRef(Py_None) : BAD();
    if (n > s->end - *pos)
        return BAD();
    Py_ssize_t at = *pos;
    *pos += (Py_ssize_t)n;
    if (kind == K_STRING) {
        PyObject *text = PyUnicode_DecodeUTF8((const char *)s->p + at, (Py_ssize_t)n, NULL);
        if (text == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            PyErr_Clear();  /* not UTF-8: invalid, as for the Python decoder */
        return text;
    }
    if (kind == K_BYTES)
        return PyBytes_FromStringAndSize((const char *)s->p + at, (Py_ssize_t)n);
    return PySequence_GetSlice(s->view, at, at + (Py_ssize_t)n);
}

static PyObject *decode_struct(const Program *pg, const Src *s, Py_ssize_t *pos,
                               Py_ssize_t *spans);

/* One value of a kind other than an array. */
static PyObject *
read_value(const Src *s, Py_ssize_t *pos, int kind, const Op *op, int nullable, int compact)
{
    switch (kind) {
    case K_NUM: {
        if (!has(s, *pos, op->size))
            return BAD();
        PyObject *v = number(s->p + *pos, op->code);
        *pos += op->size;
        return v;
    }
    case K_UUID:
        return read_uuid(s, pos);
    case K_STRING: case K_BYTES: case K_RECORDS:
        return read_sized(s, pos, kind, nullable, compact);
    case K_STRUCT:
        if (nullable) {  /* an int8 marker: negative is null */
            if (*pos >= s->end)
                return BAD();
            if (s->p[*pos] > 127) {
                *pos += 1;
                return Py_NewRef(Py_None);
            }
            *pos += 1;
        }
        return decode_struct(op->sub, s, pos, NULL);
    default:
        PyErr_SetString(PyExc_SystemError, "decoder: a bad kind");
        return NULL;
    }
}

/* A FlatRecords of the elements' bytes whose records are built already. */
static PyObject *
flat_records(const Src *s, Py_ssize_t start, Py_ssize_t stop, PyObject *items, PyObject *kind)
{
    PyTypeObject *type = (PyTypeObject *)flat_cls;
    PyObject *n = PyLong_FromSsize_t(PyTuple_GET_SIZE(items));
    /* Its bytes copied, not a view of the frame: bytes are no work for the collector,
     * and these are small (tens of bytes an element). */
    PyObject *raw = PyBytes_FromStringAndSize((const char *)s->p + start, stop - start);
    PyObject *obj = (n == NULL || raw == NULL) ? NULL : type->tp_alloc(type, 0);
    if (obj != NULL) {
        set_slot(obj, at_raw, raw);
        set_slot(obj, at_n, n);
        set_slot(obj, at_shape, Py_None);
        set_slot(obj, at_kind, kind);
        set_slot(obj, at_items, items);
    }
    Py_XDECREF(n);
    Py_XDECREF(raw);
    return untracked(obj);
}

/* A hash of an array's bytes, eight at a time. */
static inline uint64_t
seen_hash(const unsigned char *at, Py_ssize_t len, char code)
{
    uint64_t h = 0x9E3779B97F4A7C15u ^ ((uint64_t)(unsigned char)code << 8) ^ (uint64_t)len;
    uint64_t word;
    for (; len >= 8; at += 8, len -= 8) {
        memcpy(&word, at, 8);
        h = (h ^ word) * 0xFF51AFD7ED558CCDu;
    }
    if (len > 0) {  /* the tail in a register (a short copy to memory stalls the load) */
        word = 0;
        for (Py_ssize_t i = 0; i < len; i++)
            word |= (uint64_t)at[i] << (8 * i);
        h = (h ^ word) * 0xFF51AFD7ED558CCDu;
    }
    return h ^ (h >> 29);
}

static PyObject *
read_array(const Src *s, Py_ssize_t *pos, const Op *op, int compact)
{
    int64_t n;
    if (length(s, pos, compact, 1, &n) < 0)
        return BAD();
    if (n < 0)
        return op->nullable ? Py_NewRef(Py_None) : BAD();
    /* Checked before anything is allocated: a count is never more than the bytes left. */
    if (n > s->end - *pos)
        return BAD();
    if (n == 0)
        return Py_NewRef(empty_tuple);
    Py_ssize_t start = *pos;
    Seen *seen = NULL;
    if (op->elem == K_NUM) {
        Py_ssize_t len = (Py_ssize_t)n * op->size;
        if (len > s->end - *pos)
            return BAD();
        if (len <= SEEN_MAX_BYTES) {
            const unsigned char *at = s->p + *pos;
            seen = &s->seen[seen_hash(at, len, op->code) % SEEN_SLOTS];
            if (seen->tuple != NULL && seen->code == op->code && seen->len == len
                    && memcmp(seen->at, at, len) == 0) {
                *pos += len;
                return Py_NewRef(seen->tuple);
            }
        }
    }
    PyObject *items = PyTuple_New((Py_ssize_t)n);
    if (items == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* Elements are not nullable: a null string in an array is an error. */
        PyObject *item = read_value(s, pos, op->elem, op, 0, compact);
        if (item == NULL) {
            Py_DECREF(items);
            return NULL;
        }
        PyTuple_SET_ITEM(items, i, item);
    }
    untracked(items);
    if (seen != NULL) {
        seen->at = s->p + start;
        seen->len = *pos - start;
        seen->code = op->code;
        Py_XSETREF(seen->tuple, Py_NewRef(items));
    }
    if (op->flat != NULL && n > 2) {
        PyObject *flat = flat_records(s, start, *pos, items, op->flat);
        Py_DECREF(items);
        return flat;
    }
    return items;
}

static PyObject *
read_op(const Src *s, Py_ssize_t *pos, const Op *op, int compact)
{
    if (op->kind == K_ARRAY)
        return read_array(s, pos, op, compact);
    return read_value(s, pos, op->kind, op, op->nullable, compact);
}

/* The tag section after a flexible struct's fields: known tags into their slots, the
 * others kept as ((tag, bytes), ...) in the last slot. */
static int
read_tags(const Program *pg, const Src *s, Py_ssize_t *pos, PyObject *record)
{
    int64_t count;
    if (uvarint(s, pos, &count) < 0)
        return -1;
    if (count == 0) {
        PyTuple_SET_ITEM(record, pg->nslots, Py_NewRef(empty_tuple));
        return 0;
    }
    PyObject *unknown = PyList_New(0);
    if (unknown == NULL)
        return -1;
    int64_t last = -1;
    for (int64_t i = 0; i < count; i++) {
        int64_t tag, size;
        if (uvarint(s, pos, &tag) < 0 || tag <= last || uvarint(s, pos, &size) < 0
                || size > s->end - *pos)
            goto fail;
        last = tag;
        Py_ssize_t stop = *pos + (Py_ssize_t)size;
        const Op *op = NULL;
        for (Py_ssize_t k = 0; k < pg->ntags; k++) {
            if (pg->tags[k].tag == tag) {
                op = &pg->tags[k];
                break;
            }
        }
        if (op == NULL) {
            PyObject *pair = Py_BuildValue(
                "(Ly#)", (long long)tag, (const char *)s->p + *pos, (Py_ssize_t)size);
            if (pair == NULL || PyList_Append(unknown, untracked(pair)) < 0) {
                Py_XDECREF(pair);
                goto fail;
            }
            Py_DECREF(pair);
            *pos = stop;
            continue;
        }
        /* The value from exactly its own bytes (a varint length inside, as flexible). */
        Src inner = {s->p, stop, s->view, s->seen};
        PyObject *value = read_op(&inner, pos, op, 1);
        if (value == NULL)
            goto fail;
        if (*pos != stop) {
            Py_DECREF(value);
            goto fail;
        }
        PyObject *old = PyTuple_GET_ITEM(record, op->slot);
        PyTuple_SET_ITEM(record, op->slot, value);
        Py_XDECREF(old);
    }
    PyObject *tuple = PyList_AsTuple(unknown);
    Py_DECREF(unknown);
    if (tuple == NULL)
        return -1;
    PyTuple_SET_ITEM(record, pg->nslots, untracked(tuple));
    return 0;
fail:
    Py_DECREF(unknown);
    return -1;
}

/* A struct at *pos.  spans (the root only): the start of each regular field, then of
 * the tag section (flexible versions), then the end. */
static PyObject *
decode_struct(const Program *pg, const Src *s, Py_ssize_t *pos, Py_ssize_t *spans)
{
    /* Made outside the collector's lists (PyType_GenericAlloc would add it to them), its
     * slots empty until filled. */
    PyObject *record = (PyObject *)PyObject_GC_NewVar(PyTupleObject, pg->cls, pg->nslots + 1);
    if (record == NULL)
        return NULL;
    memset(((PyTupleObject *)record)->ob_item, 0, (pg->nslots + 1) * sizeof(PyObject *));
    for (Py_ssize_t i = 0; i < pg->nslots; i++) {
        if (pg->from_default[i])
            PyTuple_SET_ITEM(record, i, Py_NewRef(PyTuple_GET_ITEM(pg->defaults, i)));
    }
    for (Py_ssize_t i = 0; i < pg->nops; i++) {
        const Op *op = &pg->ops[i];
        if (spans != NULL)
            *spans++ = *pos;
        PyObject *value = read_op(s, pos, op, op->compact);
        if (value == NULL)
            goto fail;
        PyTuple_SET_ITEM(record, op->slot, value);
    }
    if (spans != NULL && pg->flexible)
        *spans++ = *pos;
    if (!pg->flexible) {
        PyTuple_SET_ITEM(record, pg->nslots, Py_NewRef(empty_tuple));
    } else {
        if (*pos >= s->end)
            goto fail;
        if (read_tags(pg, s, pos, record) < 0)
            goto fail;
    }
    if (spans != NULL)
        *spans = *pos;
    return record;
fail:
    Py_DECREF(record);
    return NULL;
}

/* decode(program, view) -> (record, end, spans) | None */
static PyObject *
decode(PyObject *self, PyObject *args)
{
    PyObject *capsule, *view;
    if (!PyArg_ParseTuple(args, "OO!", &capsule, &PyMemoryView_Type, &view))
        return NULL;
    Program *pg = as_program(capsule);
    if (pg == NULL)
        return NULL;
    if (uuid_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "decoder: configure() first");
        return NULL;
    }
    Py_buffer *buf = PyMemoryView_GET_BUFFER(view);
    if (!PyBuffer_IsContiguous(buf, 'C') || buf->itemsize != 1) {
        PyErr_SetString(PyExc_ValueError, "decoder: a contiguous byte view is needed");
        return NULL;
    }
    Seen seen[SEEN_SLOTS];
    memset(seen, 0, sizeof seen);
    Src s = {(const unsigned char *)buf->buf, buf->len, view, seen};
    Py_ssize_t nspans = pg->nops + (pg->flexible ? 1 : 0) + 1;
    Py_ssize_t stack[64], *spans = stack;
    if (nspans > 64 && (spans = PyMem_Malloc(nspans * sizeof *spans)) == NULL)
        return PyErr_NoMemory();
    Py_ssize_t pos = 0;
    PyObject *result = NULL, *record = decode_struct(pg, &s, &pos, spans);
    if (record == NULL) {
        if (!PyErr_Occurred())
            result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *marks = PyTuple_New(nspans);
    if (marks == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < nspans; i++) {
        PyObject *at = PyLong_FromSsize_t(spans[i]);
        if (at == NULL) {
            Py_DECREF(marks);
            goto done;
        }
        PyTuple_SET_ITEM(marks, i, at);
    }
    result = Py_BuildValue("(NnN)", Py_NewRef(record), pos, marks);
done:
    Py_XDECREF(record);
    for (int i = 0; i < SEEN_SLOTS; i++)
        Py_XDECREF(seen[i].tuple);
    if (spans != stack)
        PyMem_Free(spans);
    return result;
}

/* Where the object slot `name` of instances of `type` lies (a __slots__ member). */
static int
slot_offset(PyObject *type, const char *name, Py_ssize_t *offset)
{
    PyObject *descr = PyObject_GetAttrString(type, name);
    if (descr == NULL)
        return -1;
    int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type)
             && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX
             && !(((PyMemberDescrObject *)descr)->d_member->flags & READONLY);
    if (ok)
        *offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    if (!ok)
        PyErr_Format(PyExc_TypeError, "decoder: %s is not a writable slot", name);
    return ok ? 0 : -1;
}

static PyObject *
configure(PyObject *self, PyObject *args)
{
    PyObject *u, *safe, *zero, *flat;
    if (!PyArg_ParseTuple(args, "O!OOO!", &PyType_Type, &u, &safe, &zero, &PyType_Type, &flat))
        return NULL;
    if (slot_offset(u, "int", &at_int) < 0 || slot_offset(u, "is_safe", &at_is_safe) < 0
            || slot_offset(flat, "raw", &at_raw) < 0 || slot_offset(flat, "_n", &at_n) < 0
            || slot_offset(flat, "_shape", &at_shape) < 0
            || slot_offset(flat, "kind", &at_kind) < 0
            || slot_offset(flat, "_items", &at_items) < 0)
        return NULL;
    Py_XSETREF(uuid_cls, Py_NewRef(u));
    Py_XSETREF(safe_unknown, Py_NewRef(safe));
    Py_XSETREF(zero_uuid, Py_NewRef(zero));
    Py_XSETREF(flat_cls, Py_NewRef(flat));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"program", make_program, METH_VARARGS,
     "program(cls, defaults, flexible, ops, tags) -> a struct's decoder program"},
    {"decode", decode, METH_VARARGS,
     "decode(program, view) -> (record, end, spans) | None (not valid: ask the Python decoder)"},
    {"configure", configure, METH_VARARGS,
     "configure(uuid_cls, safe_unknown, zero_uuid, flat_records_cls)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gatehouse.codecs._decoder",
    "The compiled decoders in C (see gatehouse/codecs/_decoder.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__decoder(void)
{
    if ((empty_tuple = PyTuple_New(0)) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
