/* A stored block's checks, compiled: storage/codec/_block_batch.c's work on each block of a batch.
 *
 * Knows: the BlockMeta record's layout (storage/codec/stored_block.py) and a version-4 raw (whole)
 * or nibble payload's header (storage/codec/header.py), and every check verify_and_decode makes of
 * such a block, in its order: the metadata record against the key (version and length, token ids,
 * namespace, parent), its stored size against the record's, the header (its fields, then its crc32
 * before any field is used), its plane table, its raw size against the metadata's, its dtype and
 * shape against the layout's, its binding against hash || namespace, the payload's length against
 * the plane table, and the data's xxh3_64. A raw block's hash is fused with the one copy into the
 * destination: each 64 KiB chunk is copied, then hashed from the cache it was just written to (in a
 * batch of STREAM_FROM bytes or more, copied with streaming stores and its stored bytes, which the
 * copy just loaded, hashed), so the stored bytes are read from memory once. A nibble block's planes
 * are hashed first and decoded into the destination only once the hash holds
 * (storage/codec/nibble_kernel.h, the kernel nibble.decode runs). A block that fails is a verdict (a
 * code, below), never an exception; its destination may hold part of its bytes (a miss: the caller
 * never reads it). Anything else (zstd planes, version 3, unknown flags) is NOT_RAW: the Python path
 * decides it, so it gives the same verdict it always did.
 * Doesn't know: threads, LMDB, torch, or what becomes of a verdict (the disk tier counts and deletes).
 *
 * check_meta reads Python objects (the key's fields) and needs the GIL; check_block touches only
 * the job's buffers and runs on any thread without it.
 *
 * xxh3_64 comes from storage/codec/xxhash.h, vendored verbatim from the `xxhash` package's sdist
 * (4.1.0: xxHash 0.8.4, BSD 2-Clause, storage/codec/xxhash.LICENSE), the library that package
 * binds: the same digest the Python code computes (tests/storage/test_raw_batch.py).
 * Included once, by storage/codec/_block_batch.c (every function static).
 */
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "nibble_kernel.h"

/* xxh3's AVX2 kernels beside the baseline's (SSE2 on x86-64), chosen at import by what the CPU
   has -- as the `xxhash` package's build does (xxHash's xxh_x86dispatch.c), from the one header:
   ~2x the hash rate on a block in cache, and every kernel gives the same digest. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__AVX2__)
#include <immintrin.h>
#define RAW_AVX2 1
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#endif
#define XXH_INLINE_ALL
#include "xxhash.h"

#ifdef RAW_AVX2
static int has_avx2;

__attribute__((noinline, __target__("avx2"))) static void update_avx2(XXH3_state_t *s, const uint8_t *p, size_t n) {
    XXH3_update(s, p, n, XXH3_accumulate_avx2, XXH3_scrambleAcc_avx2);
}
#endif

static inline void hash_update(XXH3_state_t *s, const uint8_t *p, size_t n, int baseline) {
#ifdef RAW_AVX2
    if (has_avx2 && !baseline) {
        update_avx2(s, p, n);
        return;
    }
#endif
    XXH3_64bits_update(s, p, n);
}

/* Verdicts: storage/codec/block_batch.py's REASONS says each one in words. Append only. */
enum {
    OK = 0,
    NOT_RAW,             /* not a v4 raw or nibble payload, or a key the C code does not read: Python decides */
    PAYLOAD_MISSING,
    META_MISSING,
    META_DAMAGED,
    TOKENS_DIFFER,
    NAMESPACE_DIFFERS,
    PARENT_DIFFERS,
    RECORD_SIZE,         /* the record's length against the metadata's stored size */
    TRUNCATED,
    BAD_MAGIC,
    BAD_DTYPE,
    BAD_NDIM,
    HEADER_CRC,
    RAW_SIZE_SHAPE,      /* header: raw size against shape and dtype */
    PLANE_TABLE,         /* header: the whole payload's one entry */
    RAW_SIZE_META,       /* header raw size against the metadata's */
    LAYOUT,              /* dtype or shape against the layout's */
    BINDING,
    PAYLOAD_LENGTH,
    DATA_XXH3,
    NIBBLE_PLANES,       /* header: a nibble plane's mode or length */
    MALFORMED,           /* a nibble block's coded plane, intact under its hash, that no encoder writes */
    PLANE_MODE,          /* zstd planes: a plane table entry of an unknown mode */
    DIM1_MAJOR,          /* zstd planes: dim-1-major flagged for a shape that has no dims 0 and 1 to swap */
    CODED_CRC,           /* zstd planes: the coded frames' crc32 */
    STORED_CHECKSUM,     /* zstd planes: a stored plane's raw blocks against their XXH64 */
    ZSTD_FRAME,          /* zstd planes: a frame zstd or decompress_frame's checks refuse */
};

/* BlockMeta: "<B32sQQdQQHI" then the namespace, then the token ids as u32. */
#define META_FIXED 79
#define META_VERSION 1
/* The header: "<4sBBBbB" then dims, u64 raw size, binding, plane table, u64 xxh3, u32 crc. */
#define FIXED 9
#define FLAG_DIM1_MAJOR 0x02
#define FLAG_WHOLE 0x04
#define FLAG_NIBBLE 0x08
#define MAX_NDIM 8
#define MAX_BINDING 255
#define CHUNK (64 * 1024)   /* copied then hashed while it is in L1/L2 */
#define NIBBLE_PART (16 * 1024)   /* elements a nibble block's pass takes at a time: their plane 0 stays in L1 */
#define MIN_SHARE (4 << 20)  /* bytes a thread is started for, at least */
#define STREAM_FROM (8 << 20)  /* a batch's bytes from which its copies stream past the cache */

typedef struct {
    const uint8_t *src;          /* the payload */
    Py_ssize_t len;
    uint8_t *dst;                /* the destination, `nbytes` long */
    uint64_t meta_raw;           /* the metadata's raw size */
    uint8_t binding[32 + MAX_BINDING];   /* the key's hash || namespace */
    Py_ssize_t binding_len;      /* > MAX_BINDING: no payload can be bound to it */
    uint8_t verdict;
} Job;

/* What every block of the batch must be (the layout's, or the first header's guess). */
typedef struct {
    Py_ssize_t nbytes;
    int dtype_code;
    int strict;                  /* the layout's (a mismatch is damage), or a guess (Python decides) */
    int stream;                  /* a batch past STREAM_FROM bytes: streaming stores (x86-64) */
    int ndim;
    uint32_t shape[MAX_NDIM];
} Expect;

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

/* zlib's CRC-32 (what header.py's crc32 is): a header is ~100 bytes, so a table is plenty. */
static uint32_t crc32_of(const uint8_t *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    while (n--)
        c = crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>
#define RAW_STREAM 1
/* memcpy with streaming (non-temporal) stores: a large batch's destinations are not read back
   soon (a restore of tens of MB passes any cache), so their lines are not fetched before being
   written -- one read and one write of memory a byte instead of two reads and a write. */
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i)), b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32)), d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}
#endif

static inline uint32_t le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t le64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint16_t le16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

static const int ITEMSIZE[4] = {0, 4, 2, 2};    /* dtype codes: float32, float16, bfloat16 */

#include "zstd_planes.h"

/* A raw block's data: copied into the destination and hashed, 64 KiB at a time. */
static uint8_t copy_whole(const Expect *b, Job *j, const uint8_t *data, Py_ssize_t raw_size, uint64_t xxh3) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (Py_ssize_t at = 0; at < raw_size; at += CHUNK) {
        size_t m = (size_t)(raw_size - at < CHUNK ? raw_size - at : CHUNK);
#ifdef RAW_STREAM
        if (b->stream) {
            /* The chunk's stored bytes, just loaded by the copy, hashed from the cache: the
               destination's lines were never brought in (streaming stores). */
            stream_copy(j->dst + at, data + at, m);
            hash_update(&state, data + at, m, 0);
            continue;
        }
#endif
        memcpy(j->dst + at, data + at, m);
        hash_update(&state, j->dst + at, m, 0);
    }
#ifdef RAW_STREAM
    if (b->stream)
        _mm_sfence();                /* the streamed stores ordered before the verdict is read */
#endif
    return XXH3_64bits_digest(&state) == xxh3 ? OK : DATA_XXH3;
}

/* A nibble block's data (its planes, `len` bytes, the plane table's sum) hashed and decoded into
   the destination in one pass: NIBBLE_PART elements at a time, plane 0's bytes of them hashed (in
   the hash's order: plane 0 comes first) and then decoded from the cache, the other planes hashed
   after. The verdicts are verify_and_decode's, the hash's first: a block whose hash fails is
   DATA_XXH3 whatever its decode found (which reads no byte outside the planes, damaged or not). */
static uint8_t decode_nibble(const Expect *b, Job *j, const uint8_t *data, Py_ssize_t len, int itemsize,
                             Py_ssize_t n, int top_coded, uint64_t xxh3) {
    const uint8_t *low[3] = {data, data + n, data + 2 * n}, *top = data + (itemsize - 1) * n;
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    NibbleDecode d;
    int bad = nibble_begin(&d, top_coded ? top : NULL, len - (itemsize - 1) * n, top_coded ? NULL : top, low,
                           itemsize, j->dst, n, b->stream) < 0;
    for (Py_ssize_t at = 0; at < n; at += NIBBLE_PART) {
        Py_ssize_t to = n - at < NIBBLE_PART ? n : at + NIBBLE_PART;
        hash_update(&state, data + at, (size_t)(to - at), 0);
        if (!bad)
            bad = nibble_part(&d, at, to) < 0;
    }
    bad = nibble_end(&d) < 0 || bad;
    for (Py_ssize_t at = n; at < len; at += CHUNK)
        hash_update(&state, data + at, (size_t)(len - at < CHUNK ? len - at : CHUNK), 0);
    if (XXH3_64bits_digest(&state) != xxh3)
        return DATA_XXH3;
    return bad ? MALFORMED : OK;   /* MALFORMED: intact bytes (the hash held) no encoder of ours writes */
}

/* The header, the binding, the payload's length and the data (a raw block's copied and hashed, a
   nibble block's hashed and decoded): no GIL. The checks in verify_and_decode's order. */
static uint8_t check_block(const Expect *b, Job *j, Scratch *s) {
    const uint8_t *p = j->src;
    Py_ssize_t len = j->len;
    if (len < FIXED)
        return TRUNCATED;
    if (memcmp(p, "TKVB", 4) != 0)
        return BAD_MAGIC;
    int version = p[4], flags = p[5], code = p[6], ndim = p[8];
    /* zstd planes (flags 0 or dim-1-major) where libzstd was loaded; version 3 and flags header.py
       refuses: Python's words. */
    int planes_zstd = zstd.ok && (flags == 0 || flags == FLAG_DIM1_MAJOR);
    if (version != 4 || (flags != FLAG_WHOLE && flags != FLAG_NIBBLE && !planes_zstd))
        return NOT_RAW;
    if (code < 1 || code > 3)
        return BAD_DTYPE;
    if (ndim > MAX_NDIM)
        return BAD_NDIM;
    int whole = flags == FLAG_WHOLE, itemsize = ITEMSIZE[code], planes = whole ? 1 : itemsize;
    Py_ssize_t binding_at = FIXED + 4 * ndim + 8;
    if (len < binding_at + 1)
        return TRUNCATED;
    Py_ssize_t binding_end = binding_at + 1 + p[binding_at];
    Py_ssize_t table_end = binding_end + 5 * planes;
    Py_ssize_t size = table_end + (planes_zstd ? 4 : 8) + 4;    /* the coded crc32, or the data xxh3 */
    if (len < size)
        return TRUNCATED;
    /* NOTE invariant: the crc32 is checked before any field past the fixed part is used. */
    if (crc32_of(p, (size_t)(size - 4)) != le32(p + size - 4))
        return HEADER_CRC;
    uint64_t raw_size = le64(p + FIXED + 4 * ndim), numel = 1;
    for (int d = 0; d < ndim; d++)
        numel *= le32(p + FIXED + 4 * d);
    if (numel * (uint64_t)itemsize != raw_size)
        return RAW_SIZE_SHAPE;
    uint64_t stored = 0;         /* the plane table's bytes after the header */
    int top_coded = 0;
    if (whole) {
        if (p[binding_end] != 0 || le32(p + binding_end + 1) != raw_size)
            return PLANE_TABLE;
        stored = raw_size;
    } else if (planes_zstd) {
        for (int k = 0; k < planes; k++) {
            if (p[binding_end + 5 * k] > 1)
                return PLANE_MODE;
            stored += le32(p + binding_end + 5 * k + 1);
        }
        if ((flags & FLAG_DIM1_MAJOR) && !(ndim >= 3 && le32(p + FIXED) > 1 && le32(p + FIXED + 4) > 1))
            return DIM1_MAJOR;           /* byte_planes.can_swap */
    } else {
        /* Every plane stored (numel bytes) but the top one, which may be coded: a length within
           nibble.coded_bounds(numel) (header.py's _check_nibble_planes). */
        for (int k = 0; k < planes; k++) {
            int mode = p[binding_end + 5 * k];
            uint64_t length = le32(p + binding_end + 5 * k + 1);
            uint64_t least = NIBBLE_TABLE + (numel + 1) / 2;
            if (mode > 1 || (mode == 1 ? k != planes - 1 || length < least || length > least + numel : length != numel))
                return NIBBLE_PLANES;
            top_coded = mode == 1;
            stored += length;
        }
    }
    if (raw_size != j->meta_raw)
        return RAW_SIZE_META;
    /* Not strict (no layout: the batch's first header's, a guess): another shape is Python's. */
    uint8_t other = b->strict ? LAYOUT : NOT_RAW;
    if (code != b->dtype_code || ndim != b->ndim || raw_size != (uint64_t)b->nbytes)
        return other;
    for (int d = 0; d < ndim; d++)
        if (le32(p + FIXED + 4 * d) != b->shape[d])
            return other;
    /* NOTE invariant: a payload is served only under the binding it was written with. */
    if (j->binding_len != p[binding_at] || memcmp(p + binding_at + 1, j->binding, (size_t)j->binding_len) != 0)
        return BINDING;
    if ((uint64_t)(len - size) != stored)
        return PAYLOAD_LENGTH;
    /* raw_size == the layout's bytes == the destination's (block_batch.py checked each one). */
    if (planes_zstd) {
        static const uint8_t VERDICT[] = {OK, CODED_CRC, STORED_CHECKSUM, ZSTD_FRAME, NOT_RAW};
        return VERDICT[decode_zstd(s, p + binding_end, p + size, itemsize, (size_t)numel, le32(p + table_end),
                                   (flags & FLAG_DIM1_MAJOR) != 0, b->shape[0], b->shape[1], j->dst, b->stream)];
    }
    uint64_t xxh3 = le64(p + table_end);
    if (whole)
        return copy_whole(b, j, p + size, (Py_ssize_t)raw_size, xxh3);
    return decode_nibble(b, j, p + size, len - size, itemsize, (Py_ssize_t)numel, top_coded, xxh3);
}

/* The metadata record against the key (GIL held: the key's fields are Python objects). */
static uint8_t check_meta(const uint8_t *m, Py_ssize_t mlen, PyObject *key, Py_ssize_t payload_len, Job *j) {
    if (mlen < META_FIXED || m[0] != META_VERSION)
        return META_DAMAGED;
    uint16_t ns_len = le16(m + 73);
    uint32_t n_tok = le32(m + 75);
    if (mlen != META_FIXED + (Py_ssize_t)ns_len + 4 * (Py_ssize_t)n_tok)
        return META_DAMAGED;
    uint8_t verdict = NOT_RAW;
    PyObject *tokens = PyObject_GetAttrString(key, "token_ids");
    PyObject *ns = PyObject_GetAttrString(key, "namespace");
    PyObject *parent = PyObject_GetAttrString(key, "parent");
    PyObject *hash = PyObject_GetAttrString(key, "hash");
    if (!tokens || !ns || !parent || !hash || !PyTuple_CheckExact(tokens) || !PyBytes_CheckExact(ns)
        || !PyBytes_CheckExact(parent) || !PyBytes_CheckExact(hash))
        goto done;                       /* not a BlockKey as hashing.py makes them: Python decides */
    Py_ssize_t n = PyTuple_GET_SIZE(tokens);
    if (n != (Py_ssize_t)n_tok) {
        verdict = TOKENS_DIFFER;
        goto done;
    }
    const uint8_t *stored = m + META_FIXED + ns_len;
    for (Py_ssize_t t = 0; t < n; t++) {
        PyObject *v = PyTuple_GET_ITEM(tokens, t);
        if (!PyLong_CheckExact(v))
            goto done;
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || x < 0 || x > 0xFFFFFFFFLL || (uint32_t)x != le32(stored + 4 * t)) {
            verdict = TOKENS_DIFFER;
            goto done;
        }
    }
    if (PyBytes_GET_SIZE(ns) != ns_len || memcmp(PyBytes_AS_STRING(ns), m + META_FIXED, ns_len) != 0) {
        verdict = NAMESPACE_DIFFERS;
        goto done;
    }
    if (PyBytes_GET_SIZE(parent) != 32 || memcmp(PyBytes_AS_STRING(parent), m + 1, 32) != 0) {
        verdict = PARENT_DIFFERS;
        goto done;
    }
    if (le64(m + 41) != (uint64_t)payload_len) {
        verdict = RECORD_SIZE;
        goto done;
    }
    j->meta_raw = le64(m + 33);
    j->binding_len = PyBytes_GET_SIZE(hash) + ns_len;
    if (j->binding_len <= MAX_BINDING) {
        memcpy(j->binding, PyBytes_AS_STRING(hash), (size_t)PyBytes_GET_SIZE(hash));
        memcpy(j->binding + PyBytes_GET_SIZE(hash), m + META_FIXED, ns_len);
    }
    verdict = OK;
done:
    Py_XDECREF(tokens);
    Py_XDECREF(ns);
    Py_XDECREF(parent);
    Py_XDECREF(hash);
    return verdict;
}
