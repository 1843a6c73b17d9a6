/* What rewrite_values (gatehouse/codecs/_speedups.c) calls to open (or seal) a value in C, given
 * in a capsule named "gatehouse.opener" as the fourth item of its ``fast`` tuple: an
 * AEAD's open, kept out of the codecs (gatehouse/rules/_aead.c makes it).
 *
 * open(ctx, nonce, aad, aad_len, sealed, sealed_len, out): writes sealed_len - 16 bytes
 * of plaintext to out and returns 1 when the tag (the last 16 bytes of sealed) holds;
 * else 0, and out holds nothing to use.  Called without the GIL (rewrite_values and
 * open_batches let it go while only C runs), so a capsule belongs to one thread at a
 * time: each opening and each batch's sealing makes its own. */
#ifndef GATEHOUSE_OPENER_H
#define GATEHOUSE_OPENER_H

#define GATEHOUSE_OPENER_CAPSULE "gatehouse.opener"
#define GATEHOUSE_OPENER_TAG 16

typedef int (*gatehouse_open_fn)(void *ctx, const unsigned char *nonce,
                                 const unsigned char *aad, Py_ssize_t aad_len,
                                 const unsigned char *sealed, Py_ssize_t sealed_len,
                                 unsigned char *out);

typedef struct {
    gatehouse_open_fn open;
    void *ctx;
} gatehouse_opener;

/* The other way, for rewrite_values' add mode: a capsule named "gatehouse.sealer", as
 * the second item of its ``sealer`` tuple (head, capsule).
 *
 * seal(ctx, aad, aad_len, plain, plain_len, out): writes the nonce it takes (its own
 * sequence: never one twice), the ciphertext and the tag, GATEHOUSE_SEALER_GROWTH bytes
 * more than plain_len, to out and returns 1; 0 when it has no nonce left or fails. */
#define GATEHOUSE_SEALER_CAPSULE "gatehouse.sealer"
#define GATEHOUSE_SEALER_NONCE 12
#define GATEHOUSE_SEALER_GROWTH (GATEHOUSE_SEALER_NONCE + GATEHOUSE_OPENER_TAG)

typedef int (*gatehouse_seal_fn)(void *ctx, const unsigned char *aad, Py_ssize_t aad_len,
                                 const unsigned char *plain, Py_ssize_t plain_len,
                                 unsigned char *out);

typedef struct {
    gatehouse_seal_fn seal;
    void *ctx;
} gatehouse_sealer;

#endif
