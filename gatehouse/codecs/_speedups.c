/* The byte readers of the proxy's hot path, in C: what gatehouse.codecs.produce,
 * gatehouse.codecs.fetch and gatehouse.codecs.records read from every Produce request and
 * every Produce and Fetch answer for the metrics and the observation log.
 *
 * Each function here is a second implementation of a Python reader that stays the
 * reference (and runs where this module is not built, or GATEHOUSE_PURE_PYTHON=1 is set):
 * it gives the same result for every input, None where the Python reader gives None
 * (bytes not as expected: the caller falls back to the full decoder, which reports the
 * error), or NotImplemented for the rare valid inputs it leaves to the Python reader
 * (tests/test_speedups.py holds the two to each other on generated, mutated and real
 * frames).  Every read is bounds-checked against the buffer; nothing is allocated from
 * a length the bytes declare.  No I/O, no state of their own (produce_walk_feed moves
 * the RequestWalk it is given, as its Python steps would), the GIL held throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_wire.h"
#include "_opener.h"

/* What a reader step can end in besides success. */
#define BAD (-1)        /* not the layout the reader expects: the result is None */
#define ERROR (-2)      /* a Python exception is set (memory) */
#define NOT_TAKEN (-3)  /* valid, but left to the Python reader: NotImplemented */

#define EMPTY_TAIL 3        /* produce.EMPTY_TAIL: three empty tag sections end a request */
#define MAX_CODES 32        /* distinct error codes counted here; more: NOT_TAKEN */

typedef struct {
    const unsigned char *p;
    Py_ssize_t len;
} Bytes;

static inline int32_t
be32(const unsigned char *p)
{
    return (int32_t)wire_u32(p);
}

static inline int16_t
be16(const unsigned char *p)
{
    return (int16_t)wire_u16(p);
}

/* Is [pos, pos + n) inside the buffer?  pos may already be past its end. */
static inline int
has(const Bytes *b, Py_ssize_t pos, Py_ssize_t n)
{
    return wire_has(b->len, pos, n);
}

/* An unsigned varint of at most five bytes, as _scan.uvarint reads it. */
static int
uvarint(const Bytes *b, Py_ssize_t *pos, int64_t *value)
{
    return wire_uvarint(b->p, b->len, pos, value) < 0 ? BAD : 0;
}

/* Skips a tag section (_scan.skip_tags). */
static int
skip_tags(const Bytes *b, Py_ssize_t *pos)
{
    int64_t count, tag, size;
    if (uvarint(b, pos, &count) < 0)
        return BAD;
    for (int64_t i = 0; i < count; i++) {
        if (uvarint(b, pos, &tag) < 0 || uvarint(b, pos, &size) < 0)
            return BAD;
        if (size > b->len)
            return BAD;  /* past the end whatever follows */
        *pos += (Py_ssize_t)size;
    }
    return *pos > b->len ? BAD : 0;
}

/* A tag section, nearly always empty (one zero byte). */
static inline int
skip_tags_fast(const Bytes *b, Py_ssize_t *pos)
{
    if (!has(b, *pos, 1))
        return BAD;
    if (b->p[*pos] == 0) {
        *pos += 1;
        return 0;
    }
    return skip_tags(b, pos);
}

/* An array's length, not null (_scan.array). */
static int
array_length(const Bytes *b, Py_ssize_t *pos, int flexible, int64_t *n)
{
    if (flexible) {
        if (uvarint(b, pos, n) < 0)
            return BAD;
        *n -= 1;
    } else {
        if (!has(b, *pos, 4))
            return BAD;
        *n = be32(b->p + *pos);
        *pos += 4;
    }
    return *n < 0 ? BAD : 0;
}

/* Skips a nullable string (_scan.skip_string); the end may lie past the buffer. */
static int
skip_string(const Bytes *b, Py_ssize_t *pos, int flexible)
{
    if (flexible) {
        int64_t n;
        if (uvarint(b, pos, &n) < 0)
            return BAD;
        if (n - 1 > b->len)
            return BAD;
        if (n > 1)
            *pos += (Py_ssize_t)(n - 1);
        return 0;
    }
    if (!has(b, *pos, 2))
        return BAD;
    int16_t n = be16(b->p + *pos);
    *pos += 2 + (n > 0 ? n : 0);
    return 0;
}

/* (records, bytes of complete batches) in [start, end): records.count_records. */
static int
count_records(const Bytes *b, Py_ssize_t start, Py_ssize_t end, int64_t *records,
              int64_t *bytes)
{
    Py_ssize_t pos = start;
    int64_t count = 0;
    while (end - pos >= BATCH_OVERHEAD) {
        const unsigned char *head = b->p + pos;
        int64_t length = be32(head + 8);
        if (head[MAGIC_AT] != 2)
            break;
        int64_t size = LOG_OVERHEAD + length;
        if (pos + size > end) {
            if (length < 0)
                return BAD;
            goto done;
        }
        if (size < BATCH_OVERHEAD)
            return BAD;
        count += be32(head + COUNT_AT);
        pos += (Py_ssize_t)size;
        if (pos == end)
            goto done;
    }
    while (end - pos >= LOG_OVERHEAD + 5) {
        const unsigned char *head = b->p + pos;
        int64_t length = be32(head + 8);
        int64_t size = LOG_OVERHEAD + length;
        if (length < 0)
            return BAD;
        if (pos + size > end)
            break;
        unsigned char magic = head[MAGIC_AT];
        if (magic == 2) {
            if (size < BATCH_OVERHEAD)
                return BAD;
            count += be32(head + COUNT_AT);
        } else if (magic == 0 || magic == 1) {
            if (length < (magic == 0 ? 14 : 22))
                return BAD;
            count += 1;
        } else {
            return BAD;
        }
        pos += (Py_ssize_t)size;
    }
done:
    *records = count;
    *bytes = pos - start;
    return 0;
}

/* Error code -> how often, in the order first seen (the dict the Python readers make). */
typedef struct {
    int n;
    int16_t code[MAX_CODES];
    int64_t count[MAX_CODES];
} Codes;

static inline int
count_code(Codes *codes, int16_t code)
{
    for (int i = 0; i < codes->n; i++) {
        if (codes->code[i] == code) {
            codes->count[i] += 1;
            return 0;
        }
    }
    if (codes->n == MAX_CODES)
        return NOT_TAKEN;
    codes->code[codes->n] = code;
    codes->count[codes->n] = 1;
    codes->n += 1;
    return 0;
}

static PyObject *
codes_dict(const Codes *codes)
{
    PyObject *dict = PyDict_New();
    if (dict == NULL)
        return NULL;
    for (int i = 0; i < codes->n; i++) {
        PyObject *key = PyLong_FromLong(codes->code[i]);
        PyObject *value = key == NULL ? NULL : PyLong_FromLongLong(codes->count[i]);
        if (value == NULL || PyDict_SetItem(dict, key, value) < 0) {
            Py_XDECREF(key);
            Py_XDECREF(value);
            Py_DECREF(dict);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    return dict;
}

/* A topic's key: its 16 id bytes, or its name (not null, strict UTF-8). */
static int
topic_key(const Bytes *b, Py_ssize_t *pos, int ids, int flexible, PyObject **key)
{
    if (ids) {
        if (!has(b, *pos, 16))
            return BAD;
        *key = PyBytes_FromStringAndSize((const char *)b->p + *pos, 16);
        if (*key == NULL)
            return ERROR;
        *pos += 16;
        return 0;
    }
    int64_t n;
    if (flexible) {
        if (uvarint(b, pos, &n) < 0)
            return BAD;
        n -= 1;
    } else {
        if (!has(b, *pos, 2))
            return BAD;
        n = be16(b->p + *pos);
        *pos += 2;
    }
    if (n < 0 || !has(b, *pos, (Py_ssize_t)n))
        return BAD;
    *key = PyUnicode_DecodeUTF8((const char *)b->p + *pos, (Py_ssize_t)n, NULL);
    if (*key == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            return ERROR;
        PyErr_Clear();
        return BAD;
    }
    *pos += (Py_ssize_t)n;
    return 0;
}

/* Appends ``value`` to the list ``out``. */
static int
append_long(PyObject *out, long long value)
{
    PyObject *number = PyLong_FromLongLong(value);
    if (number == NULL)
        return ERROR;
    int failed = PyList_Append(out, number);
    Py_DECREF(number);
    return failed ? ERROR : 0;
}

/* One topic of a reader's TopicCounts, while its partitions are read. */
typedef struct {
    PyObject *key;      /* its name, or its 16 id bytes */
    PyObject *indexes;  /* its partitions' indexes */
    int64_t records;
    int64_t bytes;
} Topic;

/* Reads a topic's key at ``pos`` and starts its counts; nothing to release on failure. */
static int
topic_begin(const Bytes *b, Py_ssize_t *pos, int ids, int flexible, Topic *topic)
{
    int status = topic_key(b, pos, ids, flexible, &topic->key);
    if (status < 0)
        return status;
    topic->indexes = PyList_New(0);
    if (topic->indexes == NULL) {
        Py_DECREF(topic->key);
        return ERROR;
    }
    topic->records = topic->bytes = 0;
    return 0;
}

/* Ends a topic begun by ``topic_begin``: with ``status`` 0, appends (key, [indexes],
 * records, bytes) to ``out``; either way its references are given up. */
static int
topic_end(PyObject *out, Topic *topic, int status)
{
    if (status < 0) {
        Py_DECREF(topic->key);
        Py_DECREF(topic->indexes);
        return status;
    }
    PyObject *item = Py_BuildValue("(NNLL)", topic->key, topic->indexes,
                                   (long long)topic->records, (long long)topic->bytes);
    if (item == NULL)
        return ERROR;
    int failed = PyList_Append(out, item);
    Py_DECREF(item);
    return failed ? ERROR : 0;
}

static PyObject *
result_of(int status, PyObject *made)
{
    if (status == 0)
        return made;
    Py_XDECREF(made);
    if (status == ERROR)
        return NULL;
    if (status == NOT_TAKEN)
        Py_RETURN_NOTIMPLEMENTED;
    Py_RETURN_NONE;
}

#define STEP(call)                                  \
    do {                                            \
        status = (call);                            \
        if (status < 0)                             \
            goto end;                               \
    } while (0)
#define NEED(cond)                                  \
    do {                                            \
        if (!(cond)) {                              \
            status = BAD;                           \
            goto end;                               \
        }                                           \
    } while (0)

/* Appends (start, end) or (start, end, name) to ``out``. */
static int
append_span(PyObject *out, Py_ssize_t start, Py_ssize_t end, PyObject *name)
{
    PyObject *item = name == NULL ? Py_BuildValue("(nn)", start, end)
                                  : Py_BuildValue("(nnO)", start, end, name);
    if (item == NULL)
        return ERROR;
    int failed = PyList_Append(out, item);
    Py_DECREF(item);
    return failed ? ERROR : 0;
}

/* produce.request_topics(frame, version, spans, count): ``spans`` a list or None. */
static PyObject *
produce_request_topics(PyObject *module, PyObject *args)
{
    Py_buffer view;
    int flexible, ids, count = 1;
    PyObject *spans = Py_None;
    if (!PyArg_ParseTuple(args, "y*pp|pO", &view, &flexible, &ids, &count, &spans))
        return NULL;
    if (spans != Py_None && !PyList_Check(spans)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "spans must be a list or None");
        return NULL;
    }
    Bytes buf = {view.buf, view.len};
    const Bytes *b = &buf;
    PyObject *out = NULL;
    int status = 0, tail = 0;  /* tail: the last three bytes taken as read */
    Py_ssize_t pos;
    int64_t topics;

    NEED(has(b, 8, 2));
    int16_t client_id = be16(b->p + 8);
    pos = 10 + (client_id > 0 ? client_id : 0);
    if (flexible)
        STEP(skip_tags_fast(b, &pos));
    /* TransactionalId, then Acks and TimeoutMs */
    STEP(skip_string(b, &pos, flexible));
    pos += 6;
    STEP(array_length(b, &pos, flexible, &topics));
    out = PyList_New(0);
    if (out == NULL) {
        status = ERROR;
        goto end;
    }
    for (int64_t t = 0; t < topics; t++) {
        Topic topic;
        int64_t partitions;
        Py_ssize_t start = pos;
        STEP(topic_begin(b, &pos, ids, flexible, &topic));
        if (!ids && spans != Py_None)
            status = append_span(spans, start, pos, NULL);
        if (status == 0)
            status = array_length(b, &pos, flexible, &partitions);
        for (int64_t i = 0; status == 0 && i < partitions; i++) {
            int64_t n;
            if (!has(b, pos, 4)) {
                status = BAD;
                break;
            }
            int32_t index = be32(b->p + pos);
            pos += 4;
            if (flexible) {
                if ((status = uvarint(b, &pos, &n)) < 0)
                    break;
                n -= 1;
            } else {
                if (!has(b, pos, 4)) {
                    status = BAD;
                    break;
                }
                n = be32(b->p + pos);
                pos += 4;
            }
            if (n > 0) {
                int64_t counted, sized;
                if (pos + n > b->len) {
                    status = BAD;
                    break;
                }
                if (count) {
                    status = count_records(b, pos, pos + (Py_ssize_t)n, &counted, &sized);
                    if (status < 0)
                        break;
                    topic.records += counted;
                    topic.bytes += sized;
                }
                pos += (Py_ssize_t)n;
            }
            if (flexible && pos + EMPTY_TAIL == b->len && t == topics - 1
                    && i == partitions - 1) {
                pos = b->len;  /* taken as read (produce.EMPTY_TAIL) */
                tail = 1;
            } else if (flexible && (status = skip_tags_fast(b, &pos)) < 0) {
                break;
            }
            status = append_long(topic.indexes, index);
        }
        if (status == 0 && flexible && !tail)
            status = skip_tags_fast(b, &pos);
        STEP(topic_end(out, &topic, status));
    }
    if (flexible && !tail)
        STEP(skip_tags_fast(b, &pos));
    NEED(pos == b->len);
end:
    PyBuffer_Release(&view);
    return result_of(status, out);
}

/* The numbers of the top-level tag section at ``pos``, which must end the frame
 * (_scan.last_tags). */
static int
last_tags(const Bytes *b, Py_ssize_t pos, PyObject **tags)
{
    int64_t count, tag, size;
    if (!has(b, pos, 1))
        return BAD;
    if (b->p[pos] == 0) {
        if (pos + 1 != b->len)
            return BAD;
        *tags = PyTuple_New(0);
        return *tags == NULL ? ERROR : 0;
    }
    if (uvarint(b, &pos, &count) < 0)
        return BAD;
    if (count > b->len)
        return BAD;  /* each tag takes two bytes at least */
    PyObject *numbers = PyList_New(0);
    if (numbers == NULL)
        return ERROR;
    for (int64_t i = 0; i < count; i++) {
        if (uvarint(b, &pos, &tag) < 0 || uvarint(b, &pos, &size) < 0 || size > b->len) {
            Py_DECREF(numbers);
            return BAD;
        }
        pos += (Py_ssize_t)size;
        if (append_long(numbers, tag) < 0) {
            Py_DECREF(numbers);
            return ERROR;
        }
    }
    if (pos != b->len) {
        Py_DECREF(numbers);
        return BAD;
    }
    *tags = PyList_AsTuple(numbers);
    Py_DECREF(numbers);
    return *tags == NULL ? ERROR : 0;
}

/* produce.response_scan(frame, version, names): (codes, tags, messages); ``names`` a
 * list (it gets each topic name before v13, where it is) or None. */
static PyObject *
produce_response_scan(PyObject *module, PyObject *args)
{
    Py_buffer view;
    int version;
    PyObject *names = Py_None;
    if (!PyArg_ParseTuple(args, "y*i|O", &view, &version, &names))
        return NULL;
    if (names != Py_None && !PyList_Check(names)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "names must be a list or None");
        return NULL;
    }
    Bytes buf = {view.buf, view.len};
    const Bytes *b = &buf;
    int flexible = version >= 9;
    int ids = version >= 13;
    int status = 0;
    int messages = 0;
    Codes codes = {0};
    PyObject *tags = NULL, *made = NULL;
    Py_ssize_t pos = 4;  /* CorrelationId */
    Py_ssize_t fixed = 4 + 2 + 8 + 8 + (version >= 5 ? 8 : 0);  /* Index .. LogStartOffset */
    int64_t topics;

    if (flexible)
        STEP(skip_tags_fast(b, &pos));
    STEP(array_length(b, &pos, flexible, &topics));
    for (int64_t t = 0; t < topics; t++) {
        int64_t partitions;
        if (ids) {
            pos += 16;
        } else if (names == Py_None) {
            STEP(skip_string(b, &pos, flexible));
        } else {
            PyObject *name = NULL;
            Py_ssize_t start = pos;
            STEP(topic_key(b, &pos, 0, flexible, &name));
            status = append_span(names, start, pos, name);
            Py_DECREF(name);
            if (status < 0)
                goto end;
        }
        STEP(array_length(b, &pos, flexible, &partitions));
        for (int64_t i = 0; i < partitions; i++) {
            NEED(has(b, pos + 4, 2));
            STEP(count_code(&codes, be16(b->p + pos + 4)));
            pos += fixed;
            if (flexible && has(b, pos, 2) && b->p[pos] == 1 && b->p[pos + 1] == 0) {
                pos += 2;  /* no RecordErrors, a null ErrorMessage: the usual case */
            } else if (version >= 8) {
                int64_t errors;
                int null;
                STEP(array_length(b, &pos, flexible, &errors));  /* RecordErrors */
                for (int64_t e = 0; e < errors; e++) {
                    pos += 4;
                    STEP(skip_string(b, &pos, flexible));
                    if (flexible)
                        STEP(skip_tags(b, &pos));
                }
                if (flexible) {
                    NEED(has(b, pos, 1));
                    null = b->p[pos] == 0;
                } else {
                    NEED(has(b, pos, 2));
                    null = be16(b->p + pos) < 0;
                }
                messages = messages || errors > 0 || !null;
                STEP(skip_string(b, &pos, flexible));  /* ErrorMessage */
            }
            if (flexible)
                STEP(skip_tags_fast(b, &pos));
        }
        if (flexible)
            STEP(skip_tags_fast(b, &pos));
    }
    pos += 4;  /* ThrottleTimeMs */
    if (flexible) {
        STEP(last_tags(b, pos, &tags));
    } else {
        NEED(pos == b->len);
        tags = PyTuple_New(0);
        if (tags == NULL) {
            status = ERROR;
            goto end;
        }
    }
    PyObject *dict = codes_dict(&codes);
    if (dict == NULL) {
        status = ERROR;
        goto end;
    }
    made = Py_BuildValue("(NNO)", dict, tags, messages ? Py_True : Py_False);
    tags = NULL;
    if (made == NULL)
        status = ERROR;
end:
    Py_XDECREF(tags);
    PyBuffer_Release(&view);
    return result_of(status, made);
}

/* fetch._walk(frame, version, count): (codes, where the top-level tags are, topics). */
static PyObject *
fetch_walk(PyObject *module, PyObject *args)
{
    Py_buffer view;
    int ids, count;
    if (!PyArg_ParseTuple(args, "y*pp", &view, &ids, &count))
        return NULL;
    Bytes buf = {view.buf, view.len};
    const Bytes *b = &buf;
    int status = 0;
    Codes codes = {0};
    PyObject *topics = NULL, *made = NULL;
    Py_ssize_t pos = 4;  /* CorrelationId */
    int64_t n_topics;

    STEP(skip_tags_fast(b, &pos));
    pos += 4 + 2 + 4;  /* ThrottleTimeMs, ErrorCode, SessionId */
    NEED(has(b, pos - 6, 2));
    STEP(count_code(&codes, be16(b->p + pos - 6)));
    STEP(uvarint(b, &pos, &n_topics));
    NEED(n_topics >= 1);  /* a null array: not in a broker's answer */
    topics = PyList_New(0);
    if (topics == NULL) {
        status = ERROR;
        goto end;
    }
    for (int64_t t = 0; t < n_topics - 1; t++) {
        Topic topic;
        int64_t n_partitions;
        STEP(topic_begin(b, &pos, ids, 1, &topic));
        status = uvarint(b, &pos, &n_partitions);
        if (status == 0 && n_partitions < 1)
            status = BAD;
        for (int64_t i = 0; status == 0 && i < n_partitions - 1; i++) {
            int64_t n;
            if (!has(b, pos, 6)) {
                status = BAD;
                break;
            }
            int32_t index = be32(b->p + pos);
            if ((status = count_code(&codes, be16(b->p + pos + 4))) < 0)
                break;
            if (count && (status = append_long(topic.indexes, index)) < 0)
                break;
            pos += 4 + 2 + 8 + 8 + 8;  /* .. LogStartOffset */
            if ((status = uvarint(b, &pos, &n)) < 0)  /* AbortedTransactions, nullable */
                break;
            if (n - 1 > b->len) {
                status = BAD;
                break;
            }
            for (int64_t a = 0; status == 0 && a < n - 1; a++) {
                pos += 8 + 8;  /* ProducerId, FirstOffset */
                status = skip_tags_fast(b, &pos);
            }
            if (status < 0)
                break;
            pos += 4;  /* PreferredReadReplica */
            if ((status = uvarint(b, &pos, &n)) < 0)  /* Records, nullable */
                break;
            n -= 1;
            if (n > 0) {
                if (pos + n > b->len) {
                    status = BAD;
                    break;
                }
                if (count) {
                    int64_t counted, sized;
                    status = count_records(b, pos, pos + (Py_ssize_t)n, &counted, &sized);
                    if (status < 0)
                        break;
                    topic.records += counted;
                    topic.bytes += sized;
                }
                pos += (Py_ssize_t)n;
            }
            status = skip_tags_fast(b, &pos);  /* DivergingEpoch, CurrentLeader, ... */
        }
        if (status == 0)
            status = skip_tags_fast(b, &pos);
        STEP(topic_end(topics, &topic, status));
    }
    PyObject *dict = codes_dict(&codes);
    if (dict == NULL) {
        status = ERROR;
        goto end;
    }
    made = Py_BuildValue("(NnN)", dict, pos, topics);
    topics = NULL;
    if (made == NULL)
        status = ERROR;
end:
    Py_XDECREF(topics);
    PyBuffer_Release(&view);
    return result_of(status, made);
}

/* records.count_records(view, start, end); None where it raises Uncounted. */
static PyObject *
records_count(PyObject *module, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &start, &end))
        return NULL;
    Bytes buf = {view.buf, view.len};
    int64_t records, bytes;
    int status;
    if (start < 0 || end < start || end > buf.len)
        status = BAD;
    else
        status = count_records(&buf, start, end, &records, &bytes);
    PyBuffer_Release(&view);
    if (status < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(LL)", (long long)records, (long long)bytes);
}

/* ---- Records: iter_records' reading in C ---------------------------------------------
 *
 * Up to ``n`` records of a v2 batch's records section, from ``pos`` (record ``index``
 * on), as records.iter_records reads them: (list of ``cls`` records, pos after them);
 * None at the first record that is not as the Python reader takes it without complaint
 * (that reader then goes on from there and says why).  Every field is read inside its
 * record's length, which the Python reader checks only at the record's end: where that
 * reader would take a record, so does this, and with the same bytes. */

/* A zig-zag varint of at most five bytes (primitives.read_varint) inside [0, stop). */
static int
record_varint(const unsigned char *p, Py_ssize_t stop, Py_ssize_t *pos, int64_t *value)
{
    int64_t raw;
    if (wire_uvarint(p, stop, pos, &raw) < 0)
        return BAD;
    *value = (raw >> 1) ^ -(raw & 1);
    return 0;
}

/* Past a varlong of at most ten bytes (primitives.read_varlong) inside [0, stop). */
static int
record_skip_varlong(const unsigned char *p, Py_ssize_t stop, Py_ssize_t *pos)
{
    for (int i = 0; i < 10; i++) {
        if (*pos >= stop)
            return BAD;
        if (p[(*pos)++] < 0x80)
            return 0;
    }
    return BAD;
}

/* A key, value or header field: bytes, or None for a negative length; NULL with no
 * exception set where it runs past ``stop``. */
static PyObject *
record_bytes(const unsigned char *p, Py_ssize_t stop, Py_ssize_t *pos)
{
    int64_t length;
    if (record_varint(p, stop, pos, &length) < 0)
        return NULL;
    if (length < 0)
        Py_RETURN_NONE;
    if (length > stop - *pos)
        return NULL;
    PyObject *field = PyBytes_FromStringAndSize((const char *)p + *pos, (Py_ssize_t)length);
    *pos += (Py_ssize_t)length;
    return field;
}

static PyObject *
record_headers(const unsigned char *p, Py_ssize_t stop, Py_ssize_t *pos)
{
    int64_t count;
    if (record_varint(p, stop, pos, &count) < 0 || count < 0 || count > stop - *pos)
        return NULL;
    PyObject *headers = PyTuple_New((Py_ssize_t)count);
    if (headers == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < (Py_ssize_t)count; i++) {
        PyObject *name = record_bytes(p, stop, pos), *key = NULL, *value = NULL;
        if (name != NULL && name != Py_None)
            key = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name),
                                       "strict");
        Py_XDECREF(name);
        if (key == NULL || (value = record_bytes(p, stop, pos)) == NULL) {
            Py_XDECREF(key);
            Py_DECREF(headers);
            return NULL;
        }
        PyObject *pair = PyTuple_Pack(2, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (pair == NULL) {
            Py_DECREF(headers);
            return NULL;
        }
        PyTuple_SET_ITEM(headers, i, pair);
    }
    return headers;
}

static PyObject *
records_read(PyObject *module, PyObject *args)
{
    PyObject *data, *cls;
    Py_ssize_t pos, index, n;
    if (!PyArg_ParseTuple(args, "O!nnnO!", &PyBytes_Type, &data, &pos, &index, &n,
                          &PyType_Type, &cls))
        return NULL;
    PyTypeObject *type = (PyTypeObject *)cls;
    if (!PyType_IsSubtype(type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "read_records: cls is not a named tuple");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t end = PyBytes_GET_SIZE(data);
    if (pos < 0 || pos > end)
        Py_RETURN_NONE;
    PyObject *list = PyList_New(0);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at = pos;
        int64_t length, skipped;
        if (record_varint(p, end, &at, &length) < 0 || length < 1 || length > end - at)
            break;
        Py_ssize_t stop = at + (Py_ssize_t)length;
        at += 1;  /* attributes: unused */
        if (record_skip_varlong(p, stop, &at) < 0          /* timestamp delta */
                || record_varint(p, stop, &at, &skipped) < 0)  /* offset delta */
            break;
        PyObject *key = record_bytes(p, stop, &at), *value = NULL, *headers = NULL;
        if (key != NULL)
            value = record_bytes(p, stop, &at);
        if (value != NULL)
            headers = record_headers(p, stop, &at);
        PyObject *number = NULL, *record = NULL;
        if (headers != NULL && at == stop && (number = PyLong_FromSsize_t(index + i)) != NULL)
            record = type->tp_alloc(type, 4);
        if (record == NULL) {
            Py_XDECREF(key);
            Py_XDECREF(value);
            Py_XDECREF(headers);
            Py_XDECREF(number);
            break;
        }
        PyTuple_SET_ITEM(record, 0, number);
        PyTuple_SET_ITEM(record, 1, key);
        PyTuple_SET_ITEM(record, 2, value);
        PyTuple_SET_ITEM(record, 3, headers);
        int appended = PyList_Append(list, record);
        Py_DECREF(record);
        if (appended < 0)
            break;
        pos = stop;
    }
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            Py_DECREF(list);
            return NULL;  /* memory */
        }
        PyErr_Clear();  /* a header key that is not UTF-8: the Python reader says so */
    }
    if (PyList_GET_SIZE(list) == 0 && n > 0) {
        Py_DECREF(list);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Nn)", list, pos);
}

/* records.batch_step over as many batches of a records field as ``data`` holds, the
 * rest of each batch (``opaque``) skipped where it lies in ``data``: the walk of a Fetch
 * answer's records (fetch.AnswerWalk with count), one batch's header per call as the
 * proxy peeks at it.  (taken, records, bytes, left, opaque); it stops, having taken
 * what it read, at the field's end or where batch_step would do more than read a
 * header (the field's last bytes, a legacy message, a length it refuses): the Python
 * step goes on from there. */
static PyObject *
batches_feed(PyObject *module, PyObject *args)
{
    Py_buffer view;
    long long left, opaque;
    if (!PyArg_ParseTuple(args, "y*LL", &view, &left, &opaque))
        return NULL;
    const unsigned char *p = view.buf;
    Py_ssize_t len = view.len, pos = 0;
    long long records = 0, bytes = 0;
    if (left < 0 || opaque < 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "negative left or opaque");
        return NULL;
    }
    for (;;) {
        if (opaque) {
            long long n = len - pos < opaque ? len - pos : opaque;
            opaque -= n;
            pos += (Py_ssize_t)n;
            if (opaque)
                break;  /* the data ends inside the batch */
            continue;
        }
        if (left < BATCH_OVERHEAD || len - pos < BATCH_OVERHEAD)
            break;
        long long size, counted;
        int batch = wire_batch(p + pos, left, &size, &counted);
        if (batch == WIRE_NOT_BATCH)
            break;  /* a legacy message, or Uncounted: the Python step says which */
        if (batch == WIRE_BATCH_CUT) {
            opaque = left - BATCH_OVERHEAD;  /* a batch cut short ends the count */
            left = 0;
        } else {
            records += counted;
            bytes += size;
            opaque = size - BATCH_OVERHEAD;
            left -= size;
        }
        pos += BATCH_OVERHEAD;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(nLLLL)", pos, records, bytes, left, opaque);
}

/* ---- Flat records: FlatRecords.records() in C ----------------------------------------
 *
 * The records of an array of flat structs (gatehouse/codecs/_flat.py: Metadata's
 * partitions), from its bytes, which the decoder has already checked element by element
 * (every length byte and tag count), so nothing here can meet a surprise but a bad plan.
 * ``plan`` says, field by field: (0, code, size) a number, (1, code, size, prefix bytes,
 * count) an array of numbers (a tuple), (2, value) a constant (absent or tagged: the
 * default); then the element's tag count byte when ``tagged``.  The records hold only
 * numbers and tuples of numbers, so they cannot be part of a cycle: they are left out of
 * the cyclic collector's lists (Python untracks such tuples itself, but only exact tuples
 * and only once a collection has looked at them), which is most of what building 10,000
 * partitions cost with the collector on. */

static PyObject *
flat_number(const unsigned char *p, char code)
{
    switch (code) {
    case '?': return PyBool_FromLong(p[0] != 0);
    case 'b': return PyLong_FromLong((int8_t)p[0]);
    case 'h': return PyLong_FromLong((int16_t)((p[0] << 8) | p[1]));
    case 'H': return PyLong_FromLong((p[0] << 8) | p[1]);
    case 'i': return PyLong_FromLong((int32_t)(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16)
                                               | ((uint32_t)p[2] << 8) | p[3]));
    case 'I': return PyLong_FromUnsignedLong(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16)
                                             | ((uint32_t)p[2] << 8) | p[3]);
    case 'q':
    case 'd': {
        uint64_t v = 0;
        for (int i = 0; i < 8; i++)
            v = (v << 8) | p[i];
        if (code == 'q')
            return PyLong_FromLongLong((long long)v);
        double d;
        memcpy(&d, &v, 8);
        return PyFloat_FromDouble(d);
    }
    }
    PyErr_Format(PyExc_ValueError, "flat_records: no number type %c", code);
    return NULL;
}

typedef struct {
    int kind;  /* 0 number, 1 array, 2 constant */
    char code;
    Py_ssize_t size, prefix, count;
    PyObject *value;  /* borrowed from the plan */
} FlatStep;

#define MAX_FLAT_FIELDS 32

static PyObject *
flat_records(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t n, size;
    PyObject *plan, *cls;
    int tagged;
    if (!PyArg_ParseTuple(args, "y*nnO!pO!", &view, &n, &size, &PyTuple_Type, &plan, &tagged,
                          &PyType_Type, &cls))
        return NULL;
    PyObject *result = NULL, *arrays = NULL;
    FlatStep steps[MAX_FLAT_FIELDS];
    Py_ssize_t fields = PyTuple_GET_SIZE(plan), width = tagged ? 1 : 0;
    if (!PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type) || fields > MAX_FLAT_FIELDS
            || n < 0 || size <= 0 || n > view.len / size) {
        PyErr_SetString(PyExc_ValueError, "flat_records: not a plan for these bytes");
        goto done;
    }
    for (Py_ssize_t f = 0; f < fields; f++) {
        PyObject *item = PyTuple_GET_ITEM(plan, f);
        FlatStep *st = &steps[f];
        st->kind = -1;
        if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) >= 2)
            st->kind = (int)PyLong_AsLong(PyTuple_GET_ITEM(item, 0));
        if (st->kind == 2) {
            st->value = PyTuple_GET_ITEM(item, 1);
            continue;
        }
        Py_ssize_t want = st->kind == 0 ? 3 : 5;
        const char *code;
        if ((st->kind != 0 && st->kind != 1) || PyTuple_GET_SIZE(item) != want
                || (code = PyUnicode_AsUTF8(PyTuple_GET_ITEM(item, 1))) == NULL) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "flat_records: a bad plan");
            goto done;
        }
        st->code = code[0];
        st->size = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 2));
        st->prefix = st->kind == 1 ? PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 3)) : 0;
        st->count = st->kind == 1 ? PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 4)) : 1;
        if (PyErr_Occurred())
            goto done;
        width += st->prefix + st->count * st->size;
    }
    if (width != size) {
        PyErr_SetString(PyExc_ValueError, "flat_records: the plan is not the element's size");
        goto done;
    }
    PyTypeObject *type = (PyTypeObject *)cls;
    arrays = PyDict_New();
    result = PyTuple_New(n);
    if (result == NULL || arrays == NULL)
        goto fail;
    const unsigned char *p = (const unsigned char *)view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *record = type->tp_alloc(type, fields + 1);  /* + the unknown tags: () */
        if (record == NULL)
            goto fail;
        PyTuple_SET_ITEM(result, i, record);
        for (Py_ssize_t f = 0; f < fields; f++) {
            FlatStep *st = &steps[f];
            PyObject *value;
            if (st->kind == 2) {
                value = Py_NewRef(st->value);
            } else if (st->kind == 0) {
                value = flat_number(p, st->code);
                p += st->size;
            } else {
                /* Arrays repeat (replica sets over a few brokers): one tuple for each
                 * distinct array of a field, which also spares the collector's
                 * allocation count that many objects. */
                p += st->prefix;
                Py_ssize_t bytes = st->count * st->size;
                char key[1 + 127 * 8];
                PyObject *known = NULL, *raw = NULL;
                if (bytes < (Py_ssize_t)sizeof key) {
                    key[0] = (char)f;
                    memcpy(key + 1, p, bytes);
                    raw = PyBytes_FromStringAndSize(key, bytes + 1);
                    if (raw == NULL)
                        goto fail;
                    known = PyDict_GetItemWithError(arrays, raw);
                    if (known == NULL && PyErr_Occurred()) {
                        Py_DECREF(raw);
                        goto fail;
                    }
                }
                if (known != NULL) {
                    value = Py_NewRef(known);
                    p += bytes;
                } else {
                    value = PyTuple_New(st->count);
                    for (Py_ssize_t k = 0; value != NULL && k < st->count; k++) {
                        PyObject *number = flat_number(p, st->code);
                        if (number == NULL)
                            Py_CLEAR(value);
                        else
                            PyTuple_SET_ITEM(value, k, number);
                        p += st->size;
                    }
                    if (value != NULL && PyObject_GC_IsTracked(value))
                        PyObject_GC_UnTrack(value);
                    if (value != NULL && raw != NULL && PyDict_SetItem(arrays, raw, value) < 0)
                        Py_CLEAR(value);
                }
                Py_XDECREF(raw);
            }
            if (value == NULL)
                goto fail;
            PyTuple_SET_ITEM(record, f, value);
        }
        PyObject *none = PyTuple_New(0);
        if (none == NULL)
            goto fail;
        PyTuple_SET_ITEM(record, fields, none);
        if (tagged)
            p += 1;
        if (PyObject_GC_IsTracked(record))
            PyObject_GC_UnTrack(record);
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    Py_XDECREF(arrays);
    PyBuffer_Release(&view);
    return result;
}

/* produce.RequestWalk's usual parts read in C: the request's head, topic keys,
 * partitions whose records are one v2 batch, and empty tag sections, each changing the
 * walk as RequestWalk._parts does; the records after a batch's header skipped as
 * StepWalk.feed skips them.  Stops at the first part it does not take (any other
 * layout, a part not all in ``data``, bytes RequestWalk would refuse): RequestWalk.feed
 * gives the rest to the Python walk, which holds a short part or raises.  Returns how
 * many bytes of ``data`` it took.  The walk's states, as produce.py numbers them: */
enum { W_HEAD, W_TOPIC, W_PARTITION, W_BATCH, W_PARTITION_TAGS, W_TOPIC_TAGS, W_TOP };

typedef struct {
    long long opaque, at, size, topics, partitions, left, records, bytes;
    int state, finished, flexible, ids;
    PyObject *key, *indexes, *out;  /* new references while the walk is read here */
} Walk;

static PyObject *walk_names[15];
static const char *const walk_fields[15] = {
    "opaque", "_at", "_size", "_topics", "_partitions", "_left", "_records", "_bytes",
    "_state", "finished", "_flexible", "_ids", "_key", "_indexes", "_out",
};

static int
walk_load(PyObject *obj, Walk *w)
{
    long long *numbers[] = {&w->opaque, &w->at, &w->size, &w->topics, &w->partitions,
                            &w->left, &w->records, &w->bytes};
    int *flags[] = {NULL, &w->finished, &w->flexible, &w->ids};
    PyObject **refs[] = {&w->key, &w->indexes, &w->out};
    w->key = w->indexes = w->out = NULL;
    for (int i = 0; i < 15; i++) {
        if (walk_names[i] == NULL
                && (walk_names[i] = PyUnicode_InternFromString(walk_fields[i])) == NULL)
            return ERROR;
        PyObject *value = PyObject_GetAttr(obj, walk_names[i]);
        if (value == NULL)
            return ERROR;
        if (i >= 12) {
            *refs[i - 12] = value;
            continue;
        }
        long long number = PyLong_AsLongLong(value);  /* a bool is an int too */
        Py_DECREF(value);
        if (number == -1 && PyErr_Occurred())
            return ERROR;
        if (i < 8)
            *numbers[i] = number;
        else if (i == 8)
            w->state = (int)number;
        else
            *flags[i - 8] = number != 0;
    }
    return PyList_Check(w->indexes) && PyList_Check(w->out) ? 0 : BAD;
}

static int
walk_store(PyObject *obj, const Walk *w)
{
    long long numbers[] = {w->opaque, w->at, w->size, w->topics, w->partitions, w->left,
                           w->records, w->bytes, w->state};
    for (int i = 0; i < 9; i++) {
        if (i == 2)
            continue;  /* the size does not change */
        PyObject *value = PyLong_FromLongLong(numbers[i]);
        if (value == NULL || PyObject_SetAttr(obj, walk_names[i], value) < 0) {
            Py_XDECREF(value);
            return ERROR;
        }
        Py_DECREF(value);
    }
    if (PyObject_SetAttr(obj, walk_names[9], w->finished ? Py_True : Py_False) < 0
            || PyObject_SetAttr(obj, walk_names[12], w->key) < 0
            || PyObject_SetAttr(obj, walk_names[13], w->indexes) < 0)
        return ERROR;
    return 0;
}

/* The transitions of RequestWalk's _records_done and what follows it. */
static int
walk_topic_done(Walk *w)
{
    PyObject *item = Py_BuildValue("(OOLL)", w->key, w->indexes, w->records, w->bytes);
    if (item == NULL)
        return ERROR;
    int failed = PyList_Append(w->out, item);
    Py_DECREF(item);
    if (failed)
        return ERROR;
    if (w->flexible) {
        w->state = W_TOPIC_TAGS;
    } else if (--w->topics) {
        w->state = W_TOPIC;
    } else {
        w->finished = 1;
    }
    return 0;
}

static int
walk_partition_done(Walk *w)
{
    if (--w->partitions) {
        w->state = W_PARTITION;
        return 0;
    }
    return walk_topic_done(w);
}

/* ``end``: where the records field ends in the frame.  The frame's last three bytes
 * after the last one are skipped with its records and end the walk (produce.EMPTY_TAIL). */
static int
walk_records_done(Walk *w, long long end)
{
    w->left = 0;
    if (!w->flexible)
        return walk_partition_done(w);
    if (w->partitions == 1 && w->topics == 1 && end + EMPTY_TAIL == w->size) {
        w->opaque += EMPTY_TAIL;
        if (walk_partition_done(w) < 0)  /* the topic's counts appended */
            return ERROR;
        w->topics = 0;
        w->state = W_TOP;
        w->finished = 1;
        return 0;
    }
    w->state = W_PARTITION_TAGS;
    return 0;
}

/* One part at ``pos``: 0 and its end in *end, BAD where it is left to the Python walk. */
static int
walk_part(Walk *w, const Bytes *b, Py_ssize_t pos, Py_ssize_t *end)
{
    int flexible = w->flexible;
    Py_ssize_t p = pos;
    int64_t n;
    switch (w->state) {
    case W_HEAD:
        if (!has(b, 8, 2) || pos != 0)
            return BAD;
        n = be16(b->p + 8);
        p = 10 + (n > 0 ? (Py_ssize_t)n : 0);
        if (flexible && skip_tags_fast(b, &p) < 0)
            return BAD;
        if (skip_string(b, &p, flexible) < 0)  /* TransactionalId */
            return BAD;
        p += 6;  /* Acks, TimeoutMs */
        if (array_length(b, &p, flexible, &n) < 0 || p > w->size)
            return BAD;
        w->topics = n;
        if (n) {
            w->state = W_TOPIC;
        } else if (flexible) {
            w->state = W_TOP;
        } else {
            w->finished = 1;
        }
        break;
    case W_TOPIC: {
        PyObject *key = NULL, *indexes;
        int status = topic_key(b, &p, w->ids, flexible, &key);
        if (status < 0)
            return status;
        if (array_length(b, &p, flexible, &n) < 0 || w->at + (p - pos) > w->size) {
            Py_DECREF(key);
            return BAD;
        }
        indexes = PyList_New(0);
        if (indexes == NULL) {
            Py_DECREF(key);
            return ERROR;
        }
        Py_SETREF(w->key, key);
        Py_SETREF(w->indexes, indexes);
        w->partitions = n;
        w->records = w->bytes = 0;
        if (n) {
            w->state = W_PARTITION;
        } else if (walk_topic_done(w) < 0) {
            return ERROR;
        }
        break;
    }
    case W_PARTITION: {
        if (!has(b, p, 4))
            return BAD;
        int32_t index = be32(b->p + p);
        p += 4;
        if (flexible) {
            if (uvarint(b, &p, &n) < 0)
                return BAD;
            n -= 1;
        } else {
            if (!has(b, p, 4))
                return BAD;
            n = be32(b->p + p);
            p += 4;
        }
        /* One v2 batch, all the records field, its header here. */
        if (n < BATCH_OVERHEAD || !has(b, p, BATCH_OVERHEAD) || b->p[p + MAGIC_AT] != 2
                || be32(b->p + p + 8) + (int64_t)LOG_OVERHEAD != n
                || w->at + (p - pos) + n > w->size)
            return BAD;
        if (append_long(w->indexes, index) < 0)
            return ERROR;
        w->records += be32(b->p + p + COUNT_AT);
        w->bytes += n;
        w->opaque = n - BATCH_OVERHEAD;
        long long records_end = w->at + (p - pos) + n;
        p += BATCH_OVERHEAD;
        if (walk_records_done(w, records_end) < 0)
            return ERROR;
        break;
    }
    case W_PARTITION_TAGS:
    case W_TOPIC_TAGS:
    case W_TOP:
        if (!has(b, p, 1) || b->p[p] != 0 || w->at + 1 > w->size)
            return BAD;
        p += 1;
        if (w->state == W_PARTITION_TAGS) {
            if (walk_partition_done(w) < 0)
                return ERROR;
        } else if (w->state == W_TOPIC_TAGS) {
            if (--w->topics) {
                w->state = W_TOPIC;
            } else {
                w->state = W_TOP;
            }
        } else {
            w->finished = 1;
        }
        break;
    default:  /* W_BATCH: a records field that is not one v2 batch */
        return BAD;
    }
    *end = p;
    return 0;
}

static PyObject *
produce_walk_feed(PyObject *module, PyObject *args)
{
    PyObject *obj, *held;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "Oy*", &obj, &view))
        return NULL;
    Bytes whole = {view.buf, view.len};
    Walk w;
    Py_ssize_t taken = 0;
    int status = walk_load(obj, &w), changed = 0;
    if (status == 0) {
        held = PyObject_GetAttrString(obj, "_held");
        if (held == NULL) {
            status = ERROR;
        } else {
            if (PyObject_Length(held) != 0)
                status = BAD;  /* a short part is the Python walk's to finish */
            Py_DECREF(held);
            if (PyErr_Occurred())
                status = ERROR;
        }
    }
    while (status == 0 && taken < whole.len && (w.opaque || !w.finished)) {
        if (w.opaque) {
            Py_ssize_t n = whole.len - taken;
            if (w.opaque < n)
                n = (Py_ssize_t)w.opaque;
            w.opaque -= n;
            w.at += n;
            taken += n;
            changed = 1;
            continue;
        }
        /* The part is read from its own start, as the Python walk reads it. */
        Bytes part = {whole.p + taken, whole.len - taken};
        Py_ssize_t end;
        status = walk_part(&w, &part, 0, &end);  /* BAD: w as it was */
        if (status < 0)
            break;
        w.at += end;
        taken += end;
        changed = 1;
    }
    if (status == BAD)
        status = 0;
    if (status == 0 && changed)
        status = walk_store(obj, &w);
    Py_XDECREF(w.key);
    Py_XDECREF(w.indexes);
    Py_XDECREF(w.out);
    PyBuffer_Release(&view);
    if (status < 0)
        return NULL;
    return PyLong_FromSsize_t(taken);
}

/* -- record values rewritten (record encryption) -----------------------------------
 * rewrite_values(section, count, fn, add_key, add_value, strip_key)
 *     -> (records section, records changed) | None
 *
 * records.rewrite_values' C version: each record of a batch's (uncompressed) records
 * section whose value ``fn`` rewrites, written again around its new value, everything
 * else of it copied as it was.  Adding (add_key not None): every record with a value
 * gets fn(value) and a last header (add_key, add_value).  Stripping (strip_key not
 * None): every record with a value whose last header's key is strip_key gets
 * fn(value) and loses that header, again while the next last header is strip_key (at
 * most four times).  fn returning None leaves the record (or what is left of it) as
 * it is.  None: records that do not parse (the Python version says what is wrong).
 *
 * With an opener or a sealer (the AES of record encryption), the GIL is let go while
 * only C runs, so that the event loop (and another thread opening another partition)
 * goes on meanwhile; it is taken back for Python (fn, the errors) and kept from the
 * first record that needs it (a round trip a record would wait on the loop each time).
 * The buffers are the raw allocator's for that; an allocation that fails ends the call
 * with MemoryError once the GIL is back. */

/* A section this small is done with the GIL held: letting it go costs more than the
 * overlap gives. */
#define RV_RELEASE_MIN 4096

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
    /* A buffer not the raw allocator's (a bytes object's, made large enough): never
     * grown; what would pass its end is refused, ``overflow`` set. */
    int fixed, overflow;
} rv_out;

static int
rv_reserve(rv_out *o, Py_ssize_t n)
{
    if (o->len + n <= o->cap)
        return 0;
    if (o->fixed) {
        o->overflow = 1;
        return -1;
    }
    Py_ssize_t cap = o->cap ? o->cap : 4096;
    while (cap < o->len + n) {
        if (cap > PY_SSIZE_T_MAX / 2)
            return -1;
        cap *= 2;
    }
    char *grown = realloc(o->buf, (size_t)cap);  /* the raw allocator: no GIL needed */
    if (grown == NULL)
        return -1;
    o->buf = grown;
    o->cap = cap;
    return 0;
}

static int
rv_put(rv_out *o, const void *data, Py_ssize_t n)
{
    if (rv_reserve(o, n) < 0)
        return -1;
    memcpy(o->buf + o->len, data, (size_t)n);
    o->len += n;
    return 0;
}

/* A zig-zag varint (primitives.varint_bytes). */
static int
rv_varint(rv_out *o, int64_t v)
{
    uint64_t u = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    unsigned char tmp[10];
    int n = 0;
    while (u >= 0x80) {
        tmp[n++] = (unsigned char)(u | 0x80);
        u >>= 7;
    }
    tmp[n++] = (unsigned char)u;
    return rv_put(o, tmp, n);
}

/* How many bytes rv_varint writes for v. */
static Py_ssize_t
rv_varint_size(int64_t v)
{
    uint64_t u = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    Py_ssize_t n = 1;
    while (u >= 0x80) {
        u >>= 7;
        n++;
    }
    return n;
}

/* Past a key or value field (zig-zag length, then the bytes) inside [0, stop);
 * *length gets the length (-1: null). */
static int
rv_skip_field(const unsigned char *p, Py_ssize_t stop, Py_ssize_t *pos, int64_t *length)
{
    if (record_varint(p, stop, pos, length) < 0 || *length > stop - *pos)
        return BAD;
    if (*length > 0)
        *pos += (Py_ssize_t)*length;
    return 0;
}

/* Whether the header at ``at`` (inside [0, stop)) has the key ``key``. */
static int
rv_header_is(const unsigned char *p, Py_ssize_t stop, Py_ssize_t at, const char *key,
             Py_ssize_t key_len)
{
    int64_t length;
    if (record_varint(p, stop, &at, &length) < 0 || length != key_len || length > stop - at)
        return 0;
    return memcmp(p + at, key, (size_t)key_len) == 0;
}

/* A record of a records section, as rewrite_values and open_batches read it. */
typedef struct {
    Py_ssize_t record_at;    /* its length */
    Py_ssize_t start, stop;  /* its body: attributes on */
    Py_ssize_t value_field;  /* the value's length */
    Py_ssize_t value_at;
    Py_ssize_t headers_at;   /* past the header count */
    int64_t value_length, header_count;
} rv_record;

enum { RV_MALFORMED = -1, RV_NO_MEMORY = -2 };

/* The record at ``pos`` (inside [0, end)) read into *r, where each of its headers
 * starts into *starts (grown to *cap as needed): 0, RV_MALFORMED or RV_NO_MEMORY. */
static int
rv_read_record(const unsigned char *p, Py_ssize_t end, Py_ssize_t pos, rv_record *r,
               Py_ssize_t **starts, Py_ssize_t *cap)
{
    Py_ssize_t at = pos;
    int64_t length, skipped, key_length;
    r->record_at = pos;
    if (record_varint(p, end, &at, &length) < 0 || length < 1 || length > end - at)
        return RV_MALFORMED;
    r->start = at;
    r->stop = at + (Py_ssize_t)length;
    at += 1;  /* attributes */
    if (record_skip_varlong(p, r->stop, &at) < 0
            || record_varint(p, r->stop, &at, &skipped) < 0
            || rv_skip_field(p, r->stop, &at, &key_length) < 0)
        return RV_MALFORMED;
    r->value_field = at;
    if (rv_skip_field(p, r->stop, &at, &r->value_length) < 0)
        return RV_MALFORMED;
    r->value_at = at - (r->value_length > 0 ? (Py_ssize_t)r->value_length : 0);
    if (record_varint(p, r->stop, &at, &r->header_count) < 0 || r->header_count < 0
            || r->header_count > r->stop - at)
        return RV_MALFORMED;
    r->headers_at = at;
    if (r->header_count > *cap) {
        Py_ssize_t grown_cap = r->header_count < 16 ? 16 : (Py_ssize_t)r->header_count;
        Py_ssize_t *grown = realloc(*starts, (size_t)grown_cap * sizeof(Py_ssize_t));
        if (grown == NULL)
            return RV_NO_MEMORY;
        *starts = grown;
        *cap = grown_cap;
    }
    for (int64_t h = 0; h < r->header_count; h++) {
        int64_t field;
        (*starts)[h] = at;
        if (rv_skip_field(p, r->stop, &at, &field) < 0 || field < 0
                || rv_skip_field(p, r->stop, &at, &field) < 0)
            return RV_MALFORMED;
    }
    return at == r->stop ? 0 : RV_MALFORMED;
}

/* The fast opener's work on record ``r``, whose last header has the strip mark: its
 * value, sealed once under the fast head (the header before the mark is not one too),
 * opened in C straight into the record rebuilt at the end of *out (its length known
 * first: no copy of the record).  1 done; 0 not one for it (another head, sealed
 * twice, a tag that fails: the caller takes it another way; *out as it was);
 * RV_NO_MEMORY. */
static int
rv_open_fast(rv_out *out, const unsigned char *p, const rv_record *r,
             const Py_ssize_t *starts, const gatehouse_opener *opener, const char *head,
             Py_ssize_t head_len, Py_ssize_t split, const char *mark, Py_ssize_t mark_len)
{
    int64_t kept = r->header_count;
    if (r->value_length < head_len + split + GATEHOUSE_OPENER_TAG
            || memcmp(p + r->value_at, head, (size_t)head_len) != 0
            || (kept > 1 && rv_header_is(p, r->stop, starts[kept - 2], mark, mark_len)))
        return 0;
    const unsigned char *v = p + r->value_at;
    Py_ssize_t sealed_len = (Py_ssize_t)r->value_length - head_len - split;
    Py_ssize_t plain_len = sealed_len - GATEHOUSE_OPENER_TAG;
    Py_ssize_t before = r->value_field - r->start, headers = starts[kept - 1] - r->headers_at;
    Py_ssize_t length = before + rv_varint_size(plain_len) + plain_len
        + rv_varint_size(kept - 1) + headers;
    Py_ssize_t was = out->len;
    if (rv_varint(out, length) < 0 || rv_put(out, p + r->start, before) < 0
            || rv_varint(out, plain_len) < 0 || rv_reserve(out, plain_len) < 0)
        return RV_NO_MEMORY;
    if (!opener->open(opener->ctx, v + head_len, v, head_len, v + head_len + split,
                      sealed_len, (unsigned char *)out->buf + out->len)) {
        out->len = was;
        return 0;
    }
    out->len += plain_len;
    if (rv_varint(out, kept - 1) < 0 || rv_put(out, p + r->headers_at, headers) < 0)
        return RV_NO_MEMORY;
    return 1;
}

/* The sealer's work on record ``r`` (a value, not null): the value sealed in C
 * straight into the record rebuilt at the end of *out as head, nonce, ciphertext and tag
 * (what rewrite_values' fn would give, by the same nonces), the header (mark,
 * mark_value) added last.  1 done; 0 the sealer has no nonce left or failed;
 * RV_NO_MEMORY (or *out's end: overflow). */
static int
rv_seal(rv_out *out, const unsigned char *p, const rv_record *r, const gatehouse_sealer *sealer,
        const char *head, Py_ssize_t head_len, const char *mark, Py_ssize_t mark_len,
        const char *mark_value, Py_ssize_t mark_value_len)
{
    Py_ssize_t plain_len = (Py_ssize_t)r->value_length;
    Py_ssize_t sealed_len = head_len + GATEHOUSE_SEALER_GROWTH + plain_len;
    Py_ssize_t before = r->value_field - r->start, headers = r->stop - r->headers_at;
    Py_ssize_t length = before + rv_varint_size(sealed_len) + sealed_len
        + rv_varint_size(r->header_count + 1) + headers + rv_varint_size(mark_len) + mark_len
        + rv_varint_size(mark_value_len) + mark_value_len;
    if (rv_varint(out, length) < 0 || rv_put(out, p + r->start, before) < 0
            || rv_varint(out, sealed_len) < 0 || rv_put(out, head, head_len) < 0
            || rv_reserve(out, GATEHOUSE_SEALER_GROWTH + plain_len) < 0)
        return RV_NO_MEMORY;
    if (!sealer->seal(sealer->ctx, (const unsigned char *)head, head_len, p + r->value_at,
                      plain_len, (unsigned char *)out->buf + out->len))
        return 0;
    out->len += GATEHOUSE_SEALER_GROWTH + plain_len;
    if (rv_varint(out, r->header_count + 1) < 0 || rv_put(out, p + r->headers_at, headers) < 0
            || rv_varint(out, mark_len) < 0 || rv_put(out, mark, mark_len) < 0
            || rv_varint(out, mark_value_len) < 0 || rv_put(out, mark_value, mark_value_len) < 0)
        return RV_NO_MEMORY;
    return 1;
}

/* fast (head, split, call): a value that begins with head is given to
 * call(value[h:h + split], value[h + split:], head) instead of to fn (h = len(head));
 * if that raises, to fn after all.  A new reference, or NULL with an exception set. */
static PyObject *
rv_call(PyObject *fn, PyObject *value, const char *head, Py_ssize_t head_len,
        Py_ssize_t split, PyObject *call, PyObject *head_obj)
{
    Py_ssize_t n = PyBytes_GET_SIZE(value);
    if (call != NULL && n >= head_len + split
            && memcmp(PyBytes_AS_STRING(value), head, (size_t)head_len) == 0) {
        const char *v = PyBytes_AS_STRING(value);
        PyObject *first = PyBytes_FromStringAndSize(v + head_len, split);
        PyObject *rest = first == NULL ? NULL
            : PyBytes_FromStringAndSize(v + head_len + split, n - head_len - split);
        PyObject *out = NULL;
        if (rest != NULL) {
            PyObject *call_args[3] = {first, rest, head_obj};
            out = PyObject_Vectorcall(call, call_args, 3, NULL);
        }
        Py_XDECREF(first);
        Py_XDECREF(rest);
        if (out != NULL)
            return out;
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return NULL;  /* KeyboardInterrupt and the like go on */
        PyErr_Clear();
    }
    return PyObject_CallOneArg(fn, value);
}

static PyObject *
rewrite_values(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t count;
    PyObject *fn, *add_key, *add_value, *strip_key, *fast = Py_None, *seal = Py_None;
    if (!PyArg_ParseTuple(args, "y*nOOOO|OO", &data, &count, &fn, &add_key, &add_value,
                          &strip_key, &fast, &seal))
        return NULL;
    gatehouse_sealer *sealer = NULL;
    const char *seal_head = NULL;
    Py_ssize_t seal_head_len = 0;
    if (seal != Py_None) {
        if (!PyTuple_Check(seal) || PyTuple_GET_SIZE(seal) != 2
                || !PyBytes_Check(PyTuple_GET_ITEM(seal, 0))) {
            PyBuffer_Release(&data);
            PyErr_SetString(PyExc_TypeError, "rewrite_values: sealer is (head, capsule)");
            return NULL;
        }
        sealer = PyCapsule_GetPointer(PyTuple_GET_ITEM(seal, 1), GATEHOUSE_SEALER_CAPSULE);
        if (sealer == NULL) {
            PyBuffer_Release(&data);
            return NULL;
        }
        seal_head = PyBytes_AS_STRING(PyTuple_GET_ITEM(seal, 0));
        seal_head_len = PyBytes_GET_SIZE(PyTuple_GET_ITEM(seal, 0));
    }
    PyObject *head_obj = NULL, *call = NULL;
    gatehouse_opener *opener = NULL;
    Py_ssize_t split = 0;
    if (fast != Py_None) {
        if (!PyTuple_Check(fast) || PyTuple_GET_SIZE(fast) < 3 || PyTuple_GET_SIZE(fast) > 4
                || !PyBytes_Check(PyTuple_GET_ITEM(fast, 0))
                || !PyLong_Check(PyTuple_GET_ITEM(fast, 1))) {
            PyBuffer_Release(&data);
            PyErr_SetString(PyExc_TypeError,
                            "rewrite_values: fast is (head, split, call[, opener])");
            return NULL;
        }
        head_obj = PyTuple_GET_ITEM(fast, 0);
        split = PyLong_AsSsize_t(PyTuple_GET_ITEM(fast, 1));
        call = PyTuple_GET_ITEM(fast, 2);
        if (PyTuple_GET_SIZE(fast) == 4 && PyTuple_GET_ITEM(fast, 3) != Py_None) {
            opener = PyCapsule_GetPointer(PyTuple_GET_ITEM(fast, 3), GATEHOUSE_OPENER_CAPSULE);
            if (opener == NULL) {
                PyBuffer_Release(&data);
                return NULL;
            }
        }
        if (split < 0) {
            PyBuffer_Release(&data);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "rewrite_values: a negative split");
            return NULL;
        }
    }
    const char *fast_head = head_obj == NULL ? NULL : PyBytes_AS_STRING(head_obj);
    Py_ssize_t fast_head_len = head_obj == NULL ? 0 : PyBytes_GET_SIZE(head_obj);
    PyObject *result = NULL;
    rv_out out = {NULL, 0, 0, 0, 0}, body = {NULL, 0, 0, 0, 0};
    Py_ssize_t *starts = NULL, starts_cap = 0;
    /* Not NULL: the GIL let go (see above); only where C alone may do a batch's work. */
    PyThreadState *released = NULL;
    int may_release = (opener != NULL || sealer != NULL) && data.len >= RV_RELEASE_MIN;
#define RV_GIL_DROP() do { \
        if (released == NULL && may_release) released = PyEval_SaveThread(); \
    } while (0)
#define RV_GIL_TAKE() do { \
        if (released != NULL) { PyEval_RestoreThread(released); released = NULL; } \
    } while (0)
    const char *mark = NULL, *mark_value = NULL;
    Py_ssize_t mark_len = 0, mark_value_len = 0;
    int adding = add_key != Py_None;
    if (adding) {
        if (!PyBytes_Check(add_key) || !PyBytes_Check(add_value)) {
            PyErr_SetString(PyExc_TypeError, "rewrite_values: add_key and add_value are bytes");
            goto done;
        }
        mark = PyBytes_AS_STRING(add_key);
        mark_len = PyBytes_GET_SIZE(add_key);
        mark_value = PyBytes_AS_STRING(add_value);
        mark_value_len = PyBytes_GET_SIZE(add_value);
    } else {
        if (!PyBytes_Check(strip_key)) {
            PyErr_SetString(PyExc_TypeError, "rewrite_values: strip_key is bytes");
            goto done;
        }
        mark = PyBytes_AS_STRING(strip_key);
        mark_len = PyBytes_GET_SIZE(strip_key);
    }
    const unsigned char *p = (const unsigned char *)data.buf;
    Py_ssize_t end = data.len, pos = 0, changed = 0;
    /* About as long as what comes (opened values are shorter, sealed ones a little
     * longer): grown once at most, not from 4 KiB by doubling. */
    if (rv_reserve(&out, data.len) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        RV_GIL_DROP();
        rv_record r;
        int read = rv_read_record(p, end, pos, &r, &starts, &starts_cap);
        if (read == RV_MALFORMED)
            goto malformed;
        if (read == RV_NO_MEMORY)
            goto done;
        Py_ssize_t record_at = r.record_at, start = r.start, stop = r.stop;
        Py_ssize_t value_field = r.value_field, value_at = r.value_at;
        Py_ssize_t headers_at = r.headers_at;
        int64_t value_length = r.value_length, header_count = r.header_count;
        int64_t kept = header_count;  /* headers of the original kept */
        int applies = value_length >= 0 && (adding || (
            kept > 0 && rv_header_is(p, stop, starts[kept - 1], mark, mark_len)));
        if (!applies) {
            if (rv_put(&out, p + record_at, stop - record_at) < 0)
                goto done;
            pos = stop;
            continue;
        }
        /* The sealer: the value sealed in C straight into the record rebuilt. */
        if (sealer != NULL && adding) {
            int sealed = rv_seal(&out, p, &r, sealer, seal_head, seal_head_len, mark,
                                 mark_len, mark_value, mark_value_len);
            if (sealed == RV_NO_MEMORY)
                goto done;
            if (!sealed) {
                RV_GIL_TAKE();
                PyErr_SetString(PyExc_RuntimeError,
                                "rewrite_values: the sealer has no nonce left, or failed");
                goto done;
            }
            changed++;
            pos = stop;
            continue;
        }
        /* The opener: a value under the fast head, sealed once, opened in C straight
         * into the record rebuilt; a value whose tag fails goes the way of the others
         * below (fn says why). */
        if (opener != NULL && !adding) {
            int opened = rv_open_fast(&out, p, &r, starts, opener, fast_head,
                                      fast_head_len, split, mark, mark_len);
            if (opened == RV_NO_MEMORY)
                goto done;
            if (opened) {
                changed++;
                pos = stop;
                continue;
            }
        }
        RV_GIL_TAKE();  /* Python from here: kept for the rest of the call */
        may_release = 0;
        PyObject *value = PyBytes_FromStringAndSize((const char *)p + value_at,
                                                    (Py_ssize_t)value_length);
        if (value == NULL)
            goto done;
        int layers = 0;
        for (;;) {
            PyObject *next = rv_call(fn, value, fast_head, fast_head_len, split, call,
                                     head_obj);
            if (next == NULL) {
                Py_DECREF(value);
                goto done;
            }
            if (next == Py_None) {
                Py_DECREF(next);
                break;
            }
            if (!PyBytes_Check(next)) {
                Py_DECREF(next);
                Py_DECREF(value);
                PyErr_SetString(PyExc_TypeError, "rewrite_values: fn returns bytes or None");
                goto done;
            }
            Py_DECREF(value);
            value = next;
            layers++;
            if (adding)
                break;
            kept--;
            if (layers >= 4 || kept == 0
                    || !rv_header_is(p, stop, starts[kept - 1], mark, mark_len))
                break;
        }
        if (layers == 0) {  /* not rewritten: as it was */
            Py_DECREF(value);
            if (rv_put(&out, p + record_at, stop - record_at) < 0)
                goto done;
            pos = stop;
            continue;
        }
        body.len = 0;
        Py_ssize_t new_length = PyBytes_GET_SIZE(value);
        int failed = rv_put(&body, p + start, value_field - start) < 0
            || rv_varint(&body, new_length) < 0
            || rv_put(&body, PyBytes_AS_STRING(value), new_length) < 0;
        Py_DECREF(value);
        if (failed)
            goto done;
        Py_ssize_t headers_end = kept == header_count ? stop : starts[kept];
        if (adding) {
            if (rv_varint(&body, header_count + 1) < 0
                    || rv_put(&body, p + headers_at, stop - headers_at) < 0
                    || rv_varint(&body, mark_len) < 0 || rv_put(&body, mark, mark_len) < 0
                    || rv_varint(&body, mark_value_len) < 0
                    || rv_put(&body, mark_value, mark_value_len) < 0)
                goto done;
        } else if (rv_varint(&body, kept) < 0
                   || rv_put(&body, p + headers_at, headers_end - headers_at) < 0) {
            goto done;
        }
        if (rv_varint(&out, body.len) < 0 || rv_put(&out, body.buf, body.len) < 0)
            goto done;
        changed++;
        pos = stop;
    }
    RV_GIL_TAKE();
    if (pos != end)
        goto malformed;
    {
        PyObject *section = PyBytes_FromStringAndSize(NULL, out.len);
        if (section != NULL) {
            /* The copy out too (a large answer's: megabytes) without the GIL: no one
             * else holds the new bytes yet. */
            RV_GIL_DROP();
            if (out.len)
                memcpy(PyBytes_AS_STRING(section), out.buf, (size_t)out.len);
            RV_GIL_TAKE();
            result = Py_BuildValue("(Nn)", section, changed);
        }
    }
    goto done;
malformed:
    RV_GIL_TAKE();
    result = Py_None;
    Py_INCREF(result);
done:
    RV_GIL_TAKE();
    if (result == NULL && !PyErr_Occurred())
        PyErr_NoMemory();  /* the raw allocator's refusal */
    free(out.buf);
    free(body.buf);
    free(starts);
    PyBuffer_Release(&data);
    return result;
#undef RV_GIL_DROP
#undef RV_GIL_TAKE
}

/* -- CRC-32C (Castagnoli) of record batches v2 -------------------------------------
 * Slicing by 8: eight tables, eight bytes a step.  What ``records.crc32c`` computes in
 * Python, for batches the proxy writes (record encryption) and checks. */

static uint32_t crc32c_tables[8][256];
static int crc32c_ready = 0;

static void crc32c_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_tables[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc32c_tables[0][n];
        for (int t = 1; t < 8; t++) {
            c = crc32c_tables[0][c & 0xFF] ^ (c >> 8);
            crc32c_tables[t][n] = c;
        }
    }
    crc32c_ready = 1;
}

static uint32_t crc32c_update(uint32_t crc, const unsigned char *p, Py_ssize_t n) {
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16
                             | (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16
                      | (uint32_t)p[7] << 24;
        crc = crc32c_tables[7][lo & 0xFF] ^ crc32c_tables[6][(lo >> 8) & 0xFF]
              ^ crc32c_tables[5][(lo >> 16) & 0xFF] ^ crc32c_tables[4][lo >> 24]
              ^ crc32c_tables[3][hi & 0xFF] ^ crc32c_tables[2][(hi >> 8) & 0xFF]
              ^ crc32c_tables[1][(hi >> 16) & 0xFF] ^ crc32c_tables[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n-- > 0)
        crc = crc32c_tables[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* SSE 4.2's crc32 instruction computes CRC-32C itself: eight bytes an instruction. */
#define CRC32C_HARDWARE 1
__attribute__((target("sse4.2")))
static uint32_t crc32c_hardware(uint32_t crc, const unsigned char *p, Py_ssize_t n) {
    uint64_t c = (uint32_t)~crc;
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = __builtin_ia32_crc32di(c, word);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n-- > 0)
        c32 = __builtin_ia32_crc32qi(c32, *p++);
    return ~c32;
}
#endif

static int crc32c_hardware_ok = 0;

/* The tables made and the CPU asked, once (the GIL held). */
static void crc32c_prepare(void) {
    if (!crc32c_ready) {
        crc32c_init();
#ifdef CRC32C_HARDWARE
        __builtin_cpu_init();
        crc32c_hardware_ok = __builtin_cpu_supports("sse4.2");
#endif
    }
}

/* CRC-32C of n bytes at p, on from crc, by the fastest way here (after crc32c_prepare). */
static uint32_t crc32c_of(uint32_t crc, const unsigned char *p, Py_ssize_t n) {
#ifdef CRC32C_HARDWARE
    if (crc32c_hardware_ok)
        return crc32c_hardware(crc, p, n);
#endif
    return crc32c_update(crc, p, n);
}

static PyObject *crc32c(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &data, &crc))
        return NULL;
    crc32c_prepare();
    uint32_t out;
    Py_BEGIN_ALLOW_THREADS
    out = crc32c_of((uint32_t)crc, (const unsigned char *)data.buf, data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(out);
}

/* -- whole batches opened or sealed (record encryption) -----------------------------
 * open_batches(records, at, fast, strip_key) -> (bytes, next_at, opened)
 * seal_batches(records, at, sealer, add_key, add_value) -> (bytes, next_at, sealed)
 *
 * encryption.open_records' and seal_records' usual case in one call, without the GIL:
 * from offset ``at`` of a records field, each whole v2 batch, uncompressed and not a
 * control batch, written again with its values opened (those under strip_key, all of
 * them by the fast opener: ``fast`` is rewrite_values' (head, split, call, capsule)) or
 * sealed (every value, by the sealer: (head, capsule), the header (add_key, add_value)
 * added), as rewrite_values and records.rebuilt_batch_parts write it: the header as it
 * came but for its length and CRC; a batch with none to change as it came.  Stops
 * before the first batch that is none of those (the caller's own loop takes it:
 * another data key to learn, a compressed batch, a value that does not open, a sealer
 * out of nonces, records that do not read): next_at is where, ``bytes`` what came
 * before it, the count how many values changed.  open_batches keeps the batch the
 * broker cut at the end of a Fetch answer's field as it came (as open_records does);
 * seal_batches stops before it (seal_records refuses it). */

#define ATTRIBUTES_AT 21
#define CRC_AT 17

static void
put_u32(unsigned char *at, uint32_t v)
{
    at[0] = (unsigned char)(v >> 24);
    at[1] = (unsigned char)(v >> 16);
    at[2] = (unsigned char)(v >> 8);
    at[3] = (unsigned char)v;
}

/* What a run of batches gets done to its values: opened (opener) or sealed (sealer). */
typedef struct {
    const gatehouse_opener *opener;
    const gatehouse_sealer *sealer;
    const char *head;  /* the opener's fast head, or what the sealer puts first */
    Py_ssize_t head_len, split;
    const char *mark, *mark_value;  /* the header stripped, or added (with its value) */
    Py_ssize_t mark_len, mark_value_len;
    /* Opening a Fetch answer's field: the batch the broker cut at its end kept as it
     * came (iter_batches stops there quietly), so the caller has no tail to join. */
    int keep_cut_tail;
} rv_batch_work;

/* The batches from ``pos`` rewritten into *out while each takes ``w`` whole (the GIL
 * not needed): where it stopped; *changed counts the values; *no_memory. */
static Py_ssize_t
rv_batches(const unsigned char *p, Py_ssize_t end, Py_ssize_t pos, rv_out *out,
           const rv_batch_work *w, Py_ssize_t *changed_all, int *no_memory)
{
    Py_ssize_t *starts = NULL, starts_cap = 0;
    while (end - pos >= BATCH_OVERHEAD) {
        const unsigned char *h = p + pos;
        long long size, count;
        if (wire_batch(h, end - pos, &size, &count) != WIRE_BATCH
                || (h[ATTRIBUTES_AT + 1] & 0x27) != 0)  /* compressed, or control */
            break;
        Py_ssize_t batch_at = out->len, rpos = pos + BATCH_OVERHEAD;
        Py_ssize_t rend = pos + (Py_ssize_t)size, changed = 0;
        int taken = rv_put(out, h, BATCH_OVERHEAD) == 0;
        for (long long i = 0; taken && i < count; i++) {
            rv_record r;
            int read = rv_read_record(p, rend, rpos, &r, &starts, &starts_cap);
            if (read < 0) {
                *no_memory = read == RV_NO_MEMORY;
                taken = 0;
                break;
            }
            int done = -1;  /* -1: the record as it came */
            if (w->sealer != NULL) {
                if (r.value_length >= 0)
                    done = rv_seal(out, p, &r, w->sealer, w->head, w->head_len, w->mark,
                                   w->mark_len, w->mark_value, w->mark_value_len);
            } else if (r.value_length >= 0 && r.header_count > 0
                       && rv_header_is(p, r.stop, starts[r.header_count - 1], w->mark,
                                       w->mark_len)) {
                done = rv_open_fast(out, p, &r, starts, w->opener, w->head, w->head_len,
                                    w->split, w->mark, w->mark_len);
            }
            if (done == -1)
                taken = rv_put(out, p + r.record_at, r.stop - r.record_at) == 0;
            else
                taken = done == 1;
            changed += done == 1;
            rpos = r.stop;
        }
        /* Not one for here (or, never seen, past the end of the bytes made for it:
         * out->overflow): the caller's loop takes it. */
        if (*no_memory || !taken || rpos != rend) {
            out->len = batch_at;
            break;
        }
        if (changed == 0) {  /* none changed: as it came */
            out->len = batch_at;
            if (rv_put(out, h, rend - pos) < 0)
                break;
        } else {
            unsigned char *rebuilt = (unsigned char *)out->buf + batch_at;
            put_u32(rebuilt + LENGTH_AT, (uint32_t)(out->len - batch_at - LOG_OVERHEAD));
            put_u32(rebuilt + CRC_AT, crc32c_of(0, rebuilt + ATTRIBUTES_AT,
                                                out->len - batch_at - ATTRIBUTES_AT));
        }
        *changed_all += changed;
        pos = rend;
    }
    free(starts);
    if (w->keep_cut_tail && !*no_memory && pos < end) {
        /* As records.iter_batches tells a cut batch: too short for its length and magic,
         * or a length past the end. */
        int cut = end - pos < LOG_OVERHEAD + 5;
        if (!cut) {
            int32_t length = (int32_t)wire_u32(p + pos + LENGTH_AT);
            cut = length >= 0 && (long long)length > (long long)(end - pos) - LOG_OVERHEAD;
        }
        if (cut && rv_put(out, p + pos, end - pos) == 0)
            pos = end;
    }
    return pos;
}

/* ``w`` done to the batches of ``data`` from ``at`` into new bytes at most ``room``
 * long, without the GIL: (bytes, next_at, changed). */
static PyObject *
rv_batches_result(Py_buffer *data, Py_ssize_t at, Py_ssize_t room, const rv_batch_work *w)
{
    crc32c_prepare();
    PyObject *written = PyBytes_FromStringAndSize(NULL, room);
    if (written == NULL)
        return NULL;
    rv_out out = {PyBytes_AS_STRING(written), 0, room, 1, 0};
    Py_ssize_t changed = 0, pos;
    int no_memory = 0;
    Py_BEGIN_ALLOW_THREADS
    pos = rv_batches((const unsigned char *)data->buf, data->len, at, &out, w, &changed,
                     &no_memory);
    Py_END_ALLOW_THREADS
    if (no_memory) {
        Py_DECREF(written);
        return PyErr_NoMemory();
    }
    if (_PyBytes_Resize(&written, out.len) < 0)
        return NULL;
    return Py_BuildValue("(Nnn)", written, pos, changed);
}

static PyObject *
open_batches(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t at;
    PyObject *fast, *strip_key;
    if (!PyArg_ParseTuple(args, "y*nOO", &data, &at, &fast, &strip_key))
        return NULL;
    PyObject *result = NULL;
    rv_batch_work w = {0};
    if (!PyTuple_Check(fast) || PyTuple_GET_SIZE(fast) != 4
            || !PyBytes_Check(PyTuple_GET_ITEM(fast, 0))
            || !PyLong_Check(PyTuple_GET_ITEM(fast, 1)) || !PyBytes_Check(strip_key)
            || at < 0 || at > data.len) {
        PyErr_SetString(PyExc_TypeError,
                        "open_batches: fast is (head, split, call, opener), strip_key bytes");
        goto done;
    }
    w.opener = PyCapsule_GetPointer(PyTuple_GET_ITEM(fast, 3), GATEHOUSE_OPENER_CAPSULE);
    w.split = PyLong_AsSsize_t(PyTuple_GET_ITEM(fast, 1));
    if (w.opener == NULL || w.split < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "open_batches: a negative split");
        goto done;
    }
    w.head = PyBytes_AS_STRING(PyTuple_GET_ITEM(fast, 0));
    w.head_len = PyBytes_GET_SIZE(PyTuple_GET_ITEM(fast, 0));
    w.mark = PyBytes_AS_STRING(strip_key);
    w.mark_len = PyBytes_GET_SIZE(strip_key);
    w.keep_cut_tail = 1;
    /* What is opened is never longer than what came (values lose their envelope,
     * records a header, lengths shrink or stay): the rest of the field's length. */
    result = rv_batches_result(&data, at, data.len - at, &w);
done:
    PyBuffer_Release(&data);
    return result;
}

static PyObject *
seal_batches(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t at;
    PyObject *seal, *add_key, *add_value;
    if (!PyArg_ParseTuple(args, "y*nOOO", &data, &at, &seal, &add_key, &add_value))
        return NULL;
    PyObject *result = NULL;
    rv_batch_work w = {0};
    if (!PyTuple_Check(seal) || PyTuple_GET_SIZE(seal) != 2
            || !PyBytes_Check(PyTuple_GET_ITEM(seal, 0)) || !PyBytes_Check(add_key)
            || !PyBytes_Check(add_value) || at < 0 || at > data.len) {
        PyErr_SetString(PyExc_TypeError, "seal_batches: sealer is (head, capsule), "
                        "add_key and add_value bytes");
        goto done;
    }
    w.sealer = PyCapsule_GetPointer(PyTuple_GET_ITEM(seal, 1), GATEHOUSE_SEALER_CAPSULE);
    if (w.sealer == NULL)
        goto done;
    w.head = PyBytes_AS_STRING(PyTuple_GET_ITEM(seal, 0));
    w.head_len = PyBytes_GET_SIZE(PyTuple_GET_ITEM(seal, 0));
    w.mark = PyBytes_AS_STRING(add_key);
    w.mark_len = PyBytes_GET_SIZE(add_key);
    w.mark_value = PyBytes_AS_STRING(add_value);
    w.mark_value_len = PyBytes_GET_SIZE(add_value);
    /* Each record grows by its envelope, the header added and at most 4 bytes in each
     * of three lengths: room for the records of the batches it may take, counted from
     * their headers. */
    Py_ssize_t growth = w.head_len + GATEHOUSE_SEALER_GROWTH + w.mark_len + w.mark_value_len
        + 2 * 5 + 3 * 4;
    Py_ssize_t records = 0, pos = at;
    const unsigned char *p = (const unsigned char *)data.buf;
    while (data.len - pos >= BATCH_OVERHEAD) {
        long long size, count;
        if (wire_batch(p + pos, data.len - pos, &size, &count) != WIRE_BATCH
                || (p[pos + ATTRIBUTES_AT + 1] & 0x27) != 0)
            break;
        if (count > 0) {
            /* A record has two bytes at least: a count past that is not read (the
             * batch is handed back at its records). */
            records += count < size / 2 ? (Py_ssize_t)count : (Py_ssize_t)(size / 2);
        }
        pos += (Py_ssize_t)size;
    }
    if (records > (PY_SSIZE_T_MAX - data.len) / growth) {
        PyErr_NoMemory();
        goto done;
    }
    result = rv_batches_result(&data, at, data.len - at + records * growth, &w);
done:
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"produce_request_topics", produce_request_topics, METH_VARARGS,
     "produce_request_topics(frame, flexible, ids, count=True, spans=None)"
     " -> TopicCounts | None | NotImplemented"},
    {"produce_response_scan", produce_response_scan, METH_VARARGS,
     "produce_response_scan(frame, version, names=None)"
     " -> (codes, tags, messages) | None | NotImplemented"},
    {"fetch_walk", fetch_walk, METH_VARARGS,
     "fetch_walk(frame, ids, count) -> (codes, tags_at, topics) | None | NotImplemented"},
    {"produce_walk_feed", produce_walk_feed, METH_VARARGS,
     "produce_walk_feed(walk, data) -> bytes of data taken (RequestWalk.feed's usual parts)"},
    {"batches_feed", batches_feed, METH_VARARGS,
     "batches_feed(data, left, opaque) -> (taken, records, bytes, left, opaque)"},
    {"count_records", records_count, METH_VARARGS,
     "count_records(view, start, end) -> (records, bytes) | None"},
    {"read_records", records_read, METH_VARARGS,
     "read_records(data, pos, index, n, cls) -> ([record, ...], pos) | None"},
    {"crc32c", crc32c, METH_VARARGS, "crc32c(data, crc=0) -> CRC-32C of data"},
    {"open_batches", open_batches, METH_VARARGS,
     "open_batches(records, at, fast, strip_key) -> (bytes, next_at, opened)"},
    {"seal_batches", seal_batches, METH_VARARGS,
     "seal_batches(records, at, sealer, add_key, add_value) -> (bytes, next_at, sealed)"},
    {"rewrite_values", rewrite_values, METH_VARARGS,
     "rewrite_values(section, count, fn, add_key, add_value, strip_key, fast=None)"
     " -> (section, changed) | None"},
    {"flat_records", flat_records, METH_VARARGS,
     "flat_records(raw, n, size, plan, tagged, cls) -> tuple of n records"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gatehouse.codecs._speedups",
    "C versions of the hot-path byte readers (see gatehouse/codecs/_speedups.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModule_Create(&module);
}
