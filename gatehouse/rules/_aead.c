/* AES-256-GCM opening (and sealing) in C for encrypt_records (gatehouse/rules/encryption.py), with
 * the system's OpenSSL (libcrypto): ``gcm_opener(key)`` gives a capsule that
 * rewrite_values (gatehouse/codecs/_speedups.c) calls for each value under one data key,
 * writing the plaintext straight into the batch it builds; the key schedule is made once
 * per capsule, not per value as a Python call to cryptography's AESGCM does.  Optional:
 * without it (no OpenSSL headers) the values are opened by AESGCM, with the same result.
 * A capsule is used by one thread at a time (each opening makes its own). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <string.h>
#include <openssl/evp.h>

#include "../codecs/_opener.h"

#define KEY_BYTES 32
#define NONCE_BYTES 12

static int
gcm_open(void *ctx, const unsigned char *nonce, const unsigned char *aad,
         Py_ssize_t aad_len, const unsigned char *sealed, Py_ssize_t sealed_len,
         unsigned char *out)
{
    EVP_CIPHER_CTX *c = (EVP_CIPHER_CTX *)ctx;
    int len = 0, last = 0;
    Py_ssize_t text_len = sealed_len - GATEHOUSE_OPENER_TAG;
    if (text_len < 0 || text_len > INT_MAX || aad_len > INT_MAX)
        return 0;
    if (EVP_DecryptInit_ex(c, NULL, NULL, NULL, nonce) != 1
            || EVP_DecryptUpdate(c, NULL, &len, aad, (int)aad_len) != 1
            || EVP_DecryptUpdate(c, out, &len, sealed, (int)text_len) != 1
            || EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_TAG, GATEHOUSE_OPENER_TAG,
                                   (void *)(sealed + text_len)) != 1)
        return 0;
    return EVP_DecryptFinal_ex(c, out + len, &last) == 1;
}

/* An AES-256-GCM context with ``key`` set (its schedule made once), 12-byte nonces, for
 * encrypting (encrypt 1) or decrypting; NULL with an exception set. */
static EVP_CIPHER_CTX *
gcm_context(const Py_buffer *key, int encrypt, const char *who)
{
    if (key->len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "%s: an AES-256 key is 32 bytes", who);
        return NULL;
    }
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    if (c == NULL
            || EVP_CipherInit_ex(c, EVP_aes_256_gcm(), NULL, NULL, NULL, encrypt) != 1
            || EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_IVLEN, NONCE_BYTES, NULL) != 1
            || EVP_CipherInit_ex(c, NULL, NULL, (const unsigned char *)key->buf, NULL,
                                 encrypt) != 1) {
        EVP_CIPHER_CTX_free(c);
        PyErr_Format(PyExc_RuntimeError, "%s: OpenSSL refused AES-256-GCM", who);
        return NULL;
    }
    return c;
}

static void
opener_free(PyObject *capsule)
{
    gatehouse_opener *o = PyCapsule_GetPointer(capsule, GATEHOUSE_OPENER_CAPSULE);
    if (o != NULL) {
        EVP_CIPHER_CTX_free((EVP_CIPHER_CTX *)o->ctx);  /* cleanses the key schedule */
        PyMem_Free(o);
    }
}

static PyObject *
gcm_opener(PyObject *module, PyObject *arg)
{
    Py_buffer key;
    if (PyObject_GetBuffer(arg, &key, PyBUF_SIMPLE) < 0)
        return NULL;
    EVP_CIPHER_CTX *c = gcm_context(&key, 0, "gcm_opener");
    PyBuffer_Release(&key);
    if (c == NULL)
        return NULL;
    gatehouse_opener *o = PyMem_Malloc(sizeof(gatehouse_opener));
    if (o == NULL) {
        EVP_CIPHER_CTX_free(c);
        return PyErr_NoMemory();
    }
    o->open = gcm_open;
    o->ctx = c;
    PyObject *capsule = PyCapsule_New(o, GATEHOUSE_OPENER_CAPSULE, opener_free);
    if (capsule == NULL) {
        EVP_CIPHER_CTX_free(c);
        PyMem_Free(o);
    }
    return capsule;
}

typedef struct {
    EVP_CIPHER_CTX *c;
    unsigned char salt[4];
    unsigned long long next, last;  /* the nonces' counts left: [next, last) */
} sealing;

static int
gcm_seal(void *ctx, const unsigned char *aad, Py_ssize_t aad_len,
         const unsigned char *plain, Py_ssize_t plain_len, unsigned char *out)
{
    sealing *s = (sealing *)ctx;
    int len = 0, last = 0;
    if (s->next >= s->last || plain_len > INT_MAX - 32 || aad_len > INT_MAX)
        return 0;
    unsigned char *nonce = out;
    memcpy(nonce, s->salt, 4);
    for (int i = 0; i < 8; i++)
        nonce[4 + i] = (unsigned char)(s->next >> (8 * (7 - i)));
    s->next++;
    unsigned char *text = out + NONCE_BYTES;
    if (EVP_EncryptInit_ex(s->c, NULL, NULL, NULL, nonce) != 1
            || EVP_EncryptUpdate(s->c, NULL, &len, aad, (int)aad_len) != 1
            || EVP_EncryptUpdate(s->c, text, &len, plain, (int)plain_len) != 1
            || EVP_EncryptFinal_ex(s->c, text + len, &last) != 1
            || EVP_CIPHER_CTX_ctrl(s->c, EVP_CTRL_GCM_GET_TAG, GATEHOUSE_OPENER_TAG,
                                   text + plain_len) != 1)
        return 0;
    return 1;
}

static void
sealer_free(PyObject *capsule)
{
    gatehouse_sealer *o = PyCapsule_GetPointer(capsule, GATEHOUSE_SEALER_CAPSULE);
    if (o != NULL) {
        sealing *s = (sealing *)o->ctx;
        EVP_CIPHER_CTX_free(s->c);
        PyMem_Free(s);
        PyMem_Free(o);
    }
}

static PyObject *
gcm_sealer(PyObject *module, PyObject *args)
{
    Py_buffer key, salt;
    unsigned long long first, count;
    if (!PyArg_ParseTuple(args, "y*y*KK", &key, &salt, &first, &count))
        return NULL;
    EVP_CIPHER_CTX *c = NULL;
    if (salt.len != 4 || first + count < first)
        PyErr_SetString(PyExc_ValueError, "gcm_sealer: a 4-byte salt, nonces to 2^64");
    else
        c = gcm_context(&key, 1, "gcm_sealer");
    sealing *s = c != NULL ? PyMem_Malloc(sizeof(sealing)) : NULL;
    gatehouse_sealer *o = s != NULL ? PyMem_Malloc(sizeof(gatehouse_sealer)) : NULL;
    if (o == NULL) {
        PyBuffer_Release(&key);
        PyBuffer_Release(&salt);
        EVP_CIPHER_CTX_free(c);
        PyMem_Free(s);
        if (c != NULL)
            PyErr_NoMemory();
        return NULL;
    }
    memcpy(s->salt, salt.buf, 4);
    PyBuffer_Release(&key);
    PyBuffer_Release(&salt);
    s->c = c;
    s->next = first;
    s->last = first + count;
    o->seal = gcm_seal;
    o->ctx = s;
    PyObject *capsule = PyCapsule_New(o, GATEHOUSE_SEALER_CAPSULE, sealer_free);
    if (capsule == NULL) {
        EVP_CIPHER_CTX_free(c);
        PyMem_Free(s);
        PyMem_Free(o);
    }
    return capsule;
}

static PyMethodDef methods[] = {
    {"gcm_opener", gcm_opener, METH_O,
     "gcm_opener(key): a capsule that opens AES-256-GCM values (12-byte nonces) under "
     "key for rewrite_values' fast path."},
    {"gcm_sealer", gcm_sealer, METH_VARARGS,
     "gcm_sealer(key, salt, first, count): a capsule that seals values under key with "
     "AES-256-GCM for rewrite_values' add mode, each under the nonce salt + a count "
     "from first (big-endian, 8 bytes), at most count of them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_aead", "AES-256-GCM opening for rewrite_values.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__aead(void)
{
    return PyModule_Create(&module);
}
