/* Reads of the Kafka wire's numbers shared by the C modules of gatehouse.codecs
 * (_speedups.c, _decoder.c) and the proxy's peek loop (gatehouse/proxy/_peeking.c):
 * big-endian integers and KIP-482 unsigned varints, each bounds-checked by its caller
 * against what it may read, and where a record batch's header keeps its numbers.
 * Include after Python.h. */
#ifndef GATEHOUSE_CODECS_WIRE_H
#define GATEHOUSE_CODECS_WIRE_H

#include <stdint.h>

/* A v2 record batch's header (gatehouse.codecs.records): its base offset and length
 * fields, all of it, and where its length, magic byte and record count lie. */
#define LOG_OVERHEAD 12
#define BATCH_OVERHEAD 61
#define LENGTH_AT 8
#define MAGIC_AT 16
#define COUNT_AT 57

static inline uint16_t
wire_u16(const unsigned char *p)
{
    return (uint16_t)(((unsigned)p[0] << 8) | p[1]);
}

static inline uint32_t
wire_u32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline uint64_t
wire_u64(const unsigned char *p)
{
    return ((uint64_t)wire_u32(p) << 32) | wire_u32(p + 4);
}

/* Is [pos, pos + n) inside [0, len)?  pos may already be past the end. */
static inline int
wire_has(Py_ssize_t len, Py_ssize_t pos, Py_ssize_t n)
{
    return pos >= 0 && n >= 0 && pos <= len && n <= len - pos;
}

/* An unsigned varint of at most five bytes (primitives.read_uvarint) at *pos of the
 * len bytes at p: 0 and *pos past it, or -1 (cut short, or longer than five bytes). */
static inline int
wire_uvarint(const unsigned char *p, Py_ssize_t len, Py_ssize_t *pos, int64_t *value)
{
    Py_ssize_t at = *pos;
    int64_t v = 0;
    for (int shift = 0; shift <= 28; shift += 7) {
        if (!wire_has(len, at, 1))
            return -1;
        unsigned char c = p[at++];
        v |= (int64_t)(c & 0x7F) << shift;
        if (c < 0x80) {
            *pos = at;
            *value = v;
            return 0;
        }
    }
    return -1;
}

/* What the v2 batch header at ``h`` is, ``left`` bytes of its records field to go (as
 * records.batch_step reads it): a whole batch inside the field (*size, *records), one
 * the field ends inside, or none it counts (another magic, a length it refuses). */
enum { WIRE_BATCH, WIRE_BATCH_CUT, WIRE_NOT_BATCH };

static inline int
wire_batch(const unsigned char *h, long long left, long long *size, long long *records)
{
    if (h[MAGIC_AT] != 2)
        return WIRE_NOT_BATCH;
    int32_t length = (int32_t)wire_u32(h + LENGTH_AT);
    *size = LOG_OVERHEAD + (long long)length;
    if (*size > left)
        return length < 0 ? WIRE_NOT_BATCH : WIRE_BATCH_CUT;
    if (*size < BATCH_OVERHEAD)
        return WIRE_NOT_BATCH;
    *records = (int32_t)wire_u32(h + COUNT_AT);
    return WIRE_BATCH;
}

#endif
