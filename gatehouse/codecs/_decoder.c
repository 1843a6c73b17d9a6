/* The compiled decoders (and encoders) of gatehouse.codecs._compile, in C: one
 * interpreter of a "program" per struct and version, made once from the same tables.
 * Encoding is at the end of this file; what follows first is about decoding.
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

#include "_wire.h"

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
    char *must_default;     /* per slot: absent from the version, not ignorable: encoding
                             * anything but the default is an error */
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
    PyMem_Free(pg->must_default);
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
    PyObject *cls, *defaults, *ops, *tags, *must = NULL;
    int flexible;
    if (!PyArg_ParseTuple(args, "O!O!pO!O!|O!", &PyType_Type, &cls, &PyTuple_Type, &defaults,
                          &flexible, &PyTuple_Type, &ops, &PyTuple_Type, &tags,
                          &PyTuple_Type, &must))
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
    pg->must_default = PyMem_Calloc(pg->nslots + 1, 1);
    pg->ops = PyMem_Calloc(pg->nops + 1, sizeof(Op));
    pg->tags = PyMem_Calloc(pg->ntags + 1, sizeof(Op));
    if (pg->refs == NULL || pg->from_default == NULL || pg->must_default == NULL
            || pg->ops == NULL || pg->tags == NULL) {
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
    for (Py_ssize_t i = 0; must != NULL && i < PyTuple_GET_SIZE(must); i++) {
        Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(must, i));
        if (slot < 0 || slot >= pg->nslots || !pg->from_default[slot]) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "decoder program: a bad absent slot");
            goto fail;
        }
        pg->must_default[slot] = 1;
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
    return wire_has(s->end, pos, n);
}

static inline int
uvarint(const Src *s, Py_ssize_t *pos, int64_t *value)
{
    return wire_uvarint(s->p, s->end, pos, value);
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
    *n = wide ? (int32_t)wire_u32(s->p + *pos) : (int16_t)wire_u16(s->p + *pos);
    *pos += size;
    return 0;
}

static PyObject *
number(const unsigned char *p, char code)
{
    switch (code) {
    case 'b': return PyLong_FromLong((int8_t)p[0]);
    case '?': return Py_NewRef(p[0] ? Py_True : Py_False);
    case 'h': return PyLong_FromLong((int16_t)wire_u16(p));
    case 'H': return PyLong_FromLong(wire_u16(p));
    case 'i': return PyLong_FromLong((int32_t)wire_u32(p));
    case 'I': return PyLong_FromUnsignedLong(wire_u32(p));
    case 'q': return PyLong_FromLongLong((int64_t)wire_u64(p));
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

/* ---------------------------------------------------------------------------------- */
/* Encoding: MessageCodec.encode in C, from the same programs.  It writes what the
 * generated Python encoder writes for the values it knows (exact ints, floats, bools,
 * str, bytes-likes, UUIDs, tuples, FlatRecords and the struct's own records), record
 * sets of 16 KiB or more kept by reference in an _Out's holes as the Python encoder
 * keeps them; anything else (a value out of range, of another type, a field absent from
 * the version set, tagged fields not at their defaults, unknown tags) is NOT_TAKEN: the
 * output is put back as it was and the Python encoder runs, which writes it or says
 * what is wrong. */

#define NOT_TAKEN (-2)
#define HOLE_MIN (16 * 1024)

static PyObject *out_cls;       /* _compile._Out */
static Py_ssize_t at_holes;

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
    PyObject *out;      /* the bytearray it all goes to: on a hole, and at the end */
    PyObject *holes;    /* out's holes (a list), or NULL when out is not an _Out */
} Sink;

static int
reserve(Sink *k, Py_ssize_t n)
{
    if (n <= k->cap - k->len)
        return 0;
    Py_ssize_t cap = k->cap ? k->cap : 4096;
    while (cap - k->len < n) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    char *buf = PyMem_Realloc(k->buf, cap);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    k->buf = buf;
    k->cap = cap;
    return 0;
}

static inline int
put(Sink *k, const void *p, Py_ssize_t n)
{
    if (reserve(k, n) < 0)
        return -1;
    memcpy(k->buf + k->len, p, n);
    k->len += n;
    return 0;
}

static inline int
put_byte(Sink *k, unsigned char c)
{
    return put(k, &c, 1);
}

static int
put_uvarint(Sink *k, uint64_t v)
{
    unsigned char b[10];
    int n = 0;
    while (v >= 0x80) {
        b[n++] = (unsigned char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    b[n++] = (unsigned char)v;
    return put(k, b, n);
}

static int
put_be(Sink *k, uint64_t v, int size)
{
    unsigned char b[8];
    for (int i = size - 1; i >= 0; i--, v >>= 8)
        b[i] = (unsigned char)v;
    return put(k, b, size);
}

static int
flush(Sink *k)
{
    if (k->len == 0)
        return 0;
    Py_ssize_t old = PyByteArray_GET_SIZE(k->out);
    if (PyByteArray_Resize(k->out, old + k->len) < 0)
        return -1;
    memcpy(PyByteArray_AS_STRING(k->out) + old, k->buf, k->len);
    k->len = 0;
    return 0;
}

/* A length prefix (-1: null), as _Compiler.write_length. */
static int
put_length(Sink *k, Py_ssize_t n, int compact, int wide)
{
    if (compact)
        return put_uvarint(k, (uint64_t)(n + 1));
    if (wide)
        return n > INT32_MAX ? NOT_TAKEN : put_be(k, (uint32_t)(int32_t)n, 4);
    return n > 32767 ? NOT_TAKEN : put_be(k, (uint16_t)(int16_t)n, 2);
}

static int
put_number(Sink *k, PyObject *v, char code)
{
    if (code == '?') {
        if (v != Py_True && v != Py_False)
            return NOT_TAKEN;
        return put_byte(k, v == Py_True);
    }
    if (code == 'd') {
        if (!PyFloat_CheckExact(v))
            return NOT_TAKEN;
        unsigned char b[8];
        if (PyFloat_Pack8(PyFloat_AS_DOUBLE(v), (char *)b, 0) < 0)
            return -1;
        return put(k, b, 8);
    }
    if (!PyLong_Check(v))
        return NOT_TAKEN;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return NOT_TAKEN;
    }
    switch (code) {
    case 'b': return x < -128 || x > 127 ? NOT_TAKEN : put_be(k, (uint64_t)x, 1);
    case 'h': return x < -32768 || x > 32767 ? NOT_TAKEN : put_be(k, (uint64_t)x, 2);
    case 'H': return x < 0 || x > 65535 ? NOT_TAKEN : put_be(k, (uint64_t)x, 2);
    case 'i': return x < INT32_MIN || x > INT32_MAX ? NOT_TAKEN : put_be(k, (uint64_t)x, 4);
    case 'I': return x < 0 || x > (long long)UINT32_MAX ? NOT_TAKEN : put_be(k, (uint64_t)x, 4);
    case 'q': return put_be(k, (uint64_t)x, 8);
    default: return NOT_TAKEN;
    }
}

/* The bytes of a bytes-like value the Python encoder would write as they are. */
static int
bytes_of(PyObject *v, const char **p, Py_ssize_t *n)
{
    if (PyBytes_CheckExact(v)) {
        *p = PyBytes_AS_STRING(v);
        *n = PyBytes_GET_SIZE(v);
    } else if (PyByteArray_CheckExact(v)) {
        *p = PyByteArray_AS_STRING(v);
        *n = PyByteArray_GET_SIZE(v);
    } else if (PyMemoryView_Check(v)) {
        Py_buffer *b = PyMemoryView_GET_BUFFER(v);
        if (b->ndim != 1 || b->itemsize != 1 || !PyBuffer_IsContiguous(b, 'C'))
            return NOT_TAKEN;  /* len() would not be its bytes */
        *p = b->buf;
        *n = b->len;
    } else {
        return NOT_TAKEN;
    }
    return 0;
}

static int
put_sized(Sink *k, PyObject *v, int kind, int nullable, int compact)
{
    if (v == Py_None)
        return nullable ? put_length(k, -1, compact, kind != K_STRING) : NOT_TAKEN;
    const char *p;
    Py_ssize_t n;
    int r;
    if (kind == K_STRING) {
        if (!PyUnicode_CheckExact(v))
            return NOT_TAKEN;
        if ((p = PyUnicode_AsUTF8AndSize(v, &n)) == NULL) {
            PyErr_Clear();  /* not encodable (a lone surrogate): the Python encoder says so */
            return NOT_TAKEN;
        }
    } else if ((r = bytes_of(v, &p, &n)) != 0) {
        return r;
    }
    if ((r = put_length(k, n, compact, kind != K_STRING)) != 0)
        return r;
    if (kind == K_RECORDS && n >= HOLE_MIN && k->holes != NULL) {
        /* Referenced, not copied: _Out.finish joins it once. */
        if (flush(k) < 0)
            return -1;
        PyObject *hole = Py_BuildValue("(nO)", PyByteArray_GET_SIZE(k->out), v);
        if (hole == NULL)
            return -1;
        r = PyList_Append(k->holes, hole);
        Py_DECREF(hole);
        return r;
    }
    return put(k, p, n);
}

static int
put_uuid(Sink *k, PyObject *v)
{
    if (Py_TYPE(v) != (PyTypeObject *)uuid_cls)
        return NOT_TAKEN;
    PyObject *number = *(PyObject **)((char *)v + at_int);
    unsigned char b[16];
    if (number == NULL || !PyLong_CheckExact(number))
        return NOT_TAKEN;
#if PY_VERSION_HEX >= 0x030D0000  /* 3.13 added "with_exceptions" */
    if (_PyLong_AsByteArray((PyLongObject *)number, b, 16, 0, 0, 1) < 0) {
#else
    if (_PyLong_AsByteArray((PyLongObject *)number, b, 16, 0, 0) < 0) {
#endif
        PyErr_Clear();
        return NOT_TAKEN;
    }
    return put(k, b, 16);
}

static int put_struct(const Program *pg, Sink *k, PyObject *r);

static int
put_value(Sink *k, PyObject *v, int kind, const Op *op, int nullable, int compact)
{
    switch (kind) {
    case K_NUM:
        return put_number(k, v, op->code);
    case K_UUID:
        return put_uuid(k, v);
    case K_STRING: case K_BYTES: case K_RECORDS:
        return put_sized(k, v, kind, nullable, compact);
    case K_STRUCT:
        if (nullable) {
            if (v == Py_None)
                return put_byte(k, 255);
            if (put_byte(k, 1) < 0)
                return -1;
        }
        return put_struct(op->sub, k, v);
    default:
        return NOT_TAKEN;
    }
}

static int
put_array(Sink *k, PyObject *v, const Op *op, int compact)
{
    if (v == Py_None)
        return op->nullable ? put_length(k, -1, compact, 1) : NOT_TAKEN;
    PyObject *items = v;
    if (flat_cls != NULL && Py_TYPE(v) == (PyTypeObject *)flat_cls) {
        PyObject *n = *(PyObject **)((char *)v + at_n);
        PyObject *kind = *(PyObject **)((char *)v + at_kind);
        if (n == NULL || !PyLong_CheckExact(n))
            return NOT_TAKEN;
        if (op->flat != NULL && kind == op->flat) {  /* its bytes, as they came */
            const char *p;
            Py_ssize_t len;
            PyObject *raw = *(PyObject **)((char *)v + at_raw);
            int r;
            if (raw == NULL || (r = bytes_of(raw, &p, &len)) != 0)
                return raw == NULL ? NOT_TAKEN : r;
            if ((r = put_length(k, PyLong_AsSsize_t(n), compact, 1)) != 0)
                return r;
            return put(k, p, len);
        }
        items = *(PyObject **)((char *)v + at_items);
        if (items == NULL || !PyTuple_CheckExact(items))
            return NOT_TAKEN;  /* not built yet: the Python encoder builds them */
    } else if (!PyTuple_CheckExact(v)) {
        return NOT_TAKEN;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    int r = put_length(k, n, compact, 1);
    for (Py_ssize_t i = 0; r == 0 && i < n; i++)
        r = put_value(k, PyTuple_GET_ITEM(items, i), op->elem, op, 0, compact);
    return r;
}

static int
put_op(Sink *k, PyObject *v, const Op *op, int compact)
{
    if (op->kind == K_ARRAY)
        return put_array(k, v, op, compact);
    return put_value(k, v, op->kind, op, op->nullable, compact);
}

/* 1 when v is (or equals) the default, 0 when not, NOT_TAKEN when the comparison fails. */
static int
is_default(PyObject *v, PyObject *dflt)
{
    if (v == dflt)
        return 1;
    int same = PyObject_RichCompareBool(v, dflt, Py_EQ);
    if (same < 0) {
        PyErr_Clear();
        return NOT_TAKEN;
    }
    return same;
}

static int
put_struct(const Program *pg, Sink *k, PyObject *r)
{
    if (Py_TYPE(r) != pg->cls || PyTuple_GET_SIZE(r) != pg->nslots + 1)
        return NOT_TAKEN;
    for (Py_ssize_t i = 0; i < pg->nslots; i++) {
        if (pg->must_default[i]
                && is_default(PyTuple_GET_ITEM(r, i), PyTuple_GET_ITEM(pg->defaults, i)) != 1)
            return NOT_TAKEN;
    }
    for (Py_ssize_t i = 0; i < pg->nops; i++) {
        const Op *op = &pg->ops[i];
        int res = put_op(k, PyTuple_GET_ITEM(r, op->slot), op, op->compact);
        if (res != 0)
            return res;
    }
    PyObject *unknown = PyTuple_GET_ITEM(r, pg->nslots);
    if (!PyTuple_CheckExact(unknown) || PyTuple_GET_SIZE(unknown) != 0)
        return NOT_TAKEN;
    if (!pg->flexible)
        return 0;
    for (Py_ssize_t i = 0; i < pg->ntags; i++) {
        Py_ssize_t slot = pg->tags[i].slot;
        if (is_default(PyTuple_GET_ITEM(r, slot), PyTuple_GET_ITEM(pg->defaults, slot)) != 1)
            return NOT_TAKEN;
    }
    return put_byte(k, 0);  /* no tagged fields */
}

/* encode(program, out, record) -> None | NotImplemented (out as it was: ask Python) */
static PyObject *
encode(PyObject *self, PyObject *args)
{
    PyObject *capsule, *out, *record;
    if (!PyArg_ParseTuple(args, "OO!O", &capsule, &PyByteArray_Type, &out, &record))
        return NULL;
    Program *pg = as_program(capsule);
    if (pg == NULL)
        return NULL;
    if (uuid_cls == NULL || out_cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "decoder: configure() first");
        return NULL;
    }
    Sink k = {NULL, 0, 0, out, NULL};
    if (Py_TYPE(out) == (PyTypeObject *)out_cls) {
        k.holes = *(PyObject **)((char *)out + at_holes);
        if (k.holes == NULL || !PyList_CheckExact(k.holes))
            Py_RETURN_NOTIMPLEMENTED;
    }
    Py_ssize_t start = PyByteArray_GET_SIZE(out);
    Py_ssize_t holes = k.holes != NULL ? PyList_GET_SIZE(k.holes) : 0;
    int r = put_struct(pg, &k, record);
    if (r == 0)
        r = flush(&k);
    PyMem_Free(k.buf);
    if (r == 0)
        Py_RETURN_NONE;
    /* Put out back as it was (the Python encoder starts again, or the error stands). */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int undone = PyByteArray_Resize(out, start);
    if (undone == 0 && k.holes != NULL)
        undone = PyList_SetSlice(k.holes, holes, PyList_GET_SIZE(k.holes), NULL);
    if (undone < 0) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return NULL;
    }
    PyErr_Restore(type, value, tb);
    if (r == NOT_TAKEN)
        Py_RETURN_NOTIMPLEMENTED;
    return NULL;
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
    PyObject *u, *safe, *zero, *flat, *outc;
    if (!PyArg_ParseTuple(args, "O!OOO!O!", &PyType_Type, &u, &safe, &zero, &PyType_Type, &flat,
                          &PyType_Type, &outc))
        return NULL;
    if (slot_offset(outc, "holes", &at_holes) < 0)
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
    Py_XSETREF(out_cls, Py_NewRef(outc));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"program", make_program, METH_VARARGS,
     "program(cls, defaults, flexible, ops, tags, absent=()) -> a struct's program"},
    {"decode", decode, METH_VARARGS,
     "decode(program, view) -> (record, end, spans) | None (not valid: ask the Python decoder)"},
    {"encode", encode, METH_VARARGS,
     "encode(program, out, record) -> None | NotImplemented (out unchanged: ask the Python encoder)"},
    {"configure", configure, METH_VARARGS,
     "configure(uuid_cls, safe_unknown, zero_uuid, flat_records_cls, out_cls)"},
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
