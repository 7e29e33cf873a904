/* A version-4 zstd-planes payload's frames checked and decoded, compiled: the default codec's part
 * of storage/codec/_block_batch.c's work, so a zstd block is read with the GIL released on every
 * core, as the raw and nibble ones are (issue 38: ~40-60 us of Python a block held the GIL, and two
 * decode threads read at 1.2-1.4x one).
 *
 * Knows: what follows a zstd-planes header (storage/codec/payload.py: one zstd frame per byte plane,
 * plane 0 first; the coded planes under the header's coded crc32; a stored plane a frame of raw
 * blocks read where it lies under its XXH64, or any other frame zstd decodes) and every check
 * `_decode_into` makes of them, in its order: the coded crc32, then plane by plane a stored plane's
 * raw-block frame and its checksum (storage/codec/zstd_frames.py raw_block_segments) or a frame
 * decoded by zstd with decompress_frame's checks (the unused header bit clear, the content size the
 * plane's, a content checksum present, exactly one frame), then the planes joined into the
 * destination (storage/codec/_byte_planes.c's geometry, dim-1-major or not). Each plane is checked
 * before the join writes anything.
 * Doesn't know: the header, the verdicts' codes or the batch (block_checks.h includes this and maps
 * its answers), threads, Python: plain C on the caller's buffers.
 *
 * libzstd and the crc32 are loaded when the module is imported (dlopen), not linked: the build needs
 * no zstd headers or -dev package. zstd is the system's libzstd.so.1 (every Linux with systemd has
 * it); without it zstd blocks are NOT_RAW (the Python path decides them, as before). The crc32 is
 * ISA-L's crc32_gzip_refl from the isal package's module (block_batch.py passes its path: zlib's
 * CRC-32 at ~20 GB/s), else zlib's crc32 from libz.so.1; with neither, zstd blocks are NOT_RAW too.
 * A scratch (zstd's context, the decoded planes) belongs to the one thread that made it.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include "xxhash.h"                  /* XXH64 (the includer may have included it already, with its dispatch) */

#define ZSTD_MAGIC 0xFD2FB528u
#define ZSTD_FHD_UNUSED 0x10
#define ZSTD_FHD_RESERVED 0x08
#define ZSTD_FHD_CHECKSUM 0x04
#define ZSTD_FHD_SINGLE 0x20
#define ZSTD_BLOCK_MAX (128 * 1024)
#define ZSTD_CONTENTSIZE_ERROR (0ULL - 2)
#define MAX_SEGMENTS 64       /* a stored plane's raw blocks read in place; more: copied out */

static struct {
    void *(*create)(void);
    size_t (*release)(void *);
    size_t (*decompress)(void *, void *, size_t, const void *, size_t);
    unsigned (*is_error)(size_t);
    unsigned long long (*content_size)(const void *, size_t);
    size_t (*frame_size)(const void *, size_t);
    int ok;
} zstd;

typedef unsigned long (*zlib_crc_fn)(unsigned long, const unsigned char *, unsigned);
typedef uint32_t (*isal_crc_fn)(uint32_t, const unsigned char *, uint64_t);
static zlib_crc_fn zlib_crc;
static isal_crc_fn isal_crc;

/* What decode_zstd answers (block_checks.h maps each to its verdict). */
enum { ZP_OK = 0, ZP_CODED_CRC, ZP_STORED_CHECKSUM, ZP_FRAME, ZP_NO_MEMORY };

static inline uint32_t zp_le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* libzstd and a fast crc32, once, at import (GIL held). `isal_path`: the isal module's file or NULL.
   Returns which crc32 is in use ("isal", "zlib"; "none": zstd blocks stay Python's). */
static const char *zstd_load(const char *isal_path) {
    void *h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == NULL)
        h = dlopen("libzstd.so", RTLD_NOW | RTLD_LOCAL);
    if (h != NULL) {
        *(void **)&zstd.create = dlsym(h, "ZSTD_createDCtx");
        *(void **)&zstd.release = dlsym(h, "ZSTD_freeDCtx");
        *(void **)&zstd.decompress = dlsym(h, "ZSTD_decompressDCtx");
        *(void **)&zstd.is_error = dlsym(h, "ZSTD_isError");
        *(void **)&zstd.content_size = dlsym(h, "ZSTD_getFrameContentSize");
        *(void **)&zstd.frame_size = dlsym(h, "ZSTD_findFrameCompressedSize");
        zstd.ok = zstd.create && zstd.release && zstd.decompress && zstd.is_error && zstd.content_size
                  && zstd.frame_size;
    }
    if (isal_path != NULL) {
        void *i = dlopen(isal_path, RTLD_NOW | RTLD_NOLOAD);
        if (i == NULL)
            i = dlopen(isal_path, RTLD_NOW | RTLD_LOCAL);
        if (i != NULL)
            *(void **)&isal_crc = dlsym(i, "crc32_gzip_refl");
    }
    if (isal_crc != NULL)
        return "isal";
    void *z = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
    if (z != NULL)
        *(void **)&zlib_crc = dlsym(z, "crc32");
    if (zlib_crc == NULL)
        zstd.ok = 0;                     /* no crc32 to check the coded frames with */
    return zlib_crc != NULL ? "zlib" : "none";
}

/* zlib's CRC-32 of p[0:n] continued from `crc` (0 to start), as header.py's crc32(data, crc). */
static uint32_t crc32_more(uint32_t crc, const uint8_t *p, size_t n) {
    if (isal_crc != NULL)
        return isal_crc(crc, p, n);
    while (n > 0) {                      /* zlib's (zstd.ok only with one of the two) */
        unsigned m = n > (1u << 30) ? 1u << 30 : (unsigned)n;
        crc = (uint32_t)zlib_crc(crc, p, m);
        p += m;
        n -= m;
    }
    return crc;
}

typedef struct {
    void *dctx;                  /* zstd's decompression context, this thread's */
    uint8_t *planes;             /* room for every plane a frame is decoded into */
    size_t cap;
} Scratch;

static void scratch_free(Scratch *s) {
    if (s->dctx != NULL)
        zstd.release(s->dctx);
    free(s->planes);
    memset(s, 0, sizeof *s);
}

/* A plane as the join reads it: its segments (a raw-block frame's blocks where they lie, or one
   decoded buffer) and the cursor through them. */
typedef struct {
    const uint8_t *ptr[MAX_SEGMENTS];
    size_t len[MAX_SEGMENTS];
    int n, seg;
    size_t off;
} Segs;

/* A stored plane's frame when it is a frame of raw blocks with its checksum (raw_block_segments'
   rules): 1 with its segments filled, 0 when it is any other frame (zstd decides), -1 when its
   checksum does not match. */
static int raw_blocks(const uint8_t *f, size_t n, size_t size, Segs *s) {
    if (n < 6 || zp_le32(f) != ZSTD_MAGIC)
        return 0;
    uint8_t fhd = f[4];
    if (fhd & (ZSTD_FHD_UNUSED | ZSTD_FHD_RESERVED | 0x03) || !(fhd & ZSTD_FHD_CHECKSUM))
        return 0;
    int single = (fhd & ZSTD_FHD_SINGLE) != 0;
    size_t at = 5, window = 0;
    if (!single) {
        uint8_t wd = f[at++];
        size_t base = (size_t)1 << (10 + (wd >> 3));
        window = base + (base >> 3) * (wd & 7);
    }
    static const int FCS[4] = {0, 2, 4, 8};
    int fcs = (fhd >> 6) ? FCS[fhd >> 6] : (single ? 1 : 0);
    if (fcs == 0 || at + (size_t)fcs > n)
        return 0;
    uint64_t content = 0;
    for (int k = 0; k < fcs; k++)
        content |= (uint64_t)f[at + k] << (8 * k);
    content += fcs == 2 ? 256 : 0;
    at += (size_t)fcs;
    if (content != size)
        return 0;
    size_t block_max = single ? (content < ZSTD_BLOCK_MAX ? content : ZSTD_BLOCK_MAX)
                              : (window < ZSTD_BLOCK_MAX ? window : ZSTD_BLOCK_MAX);
    size_t total = 0;
    s->n = 0;
    for (;;) {
        if (at + 3 > n)
            return 0;
        uint32_t bh = (uint32_t)f[at] | (uint32_t)f[at + 1] << 8 | (uint32_t)f[at + 2] << 16;
        at += 3;
        size_t length = bh >> 3;
        if (((bh >> 1) & 3) != 0 || length > block_max || at + length > n)
            return 0;
        if (length) {
            if (s->n == MAX_SEGMENTS)
                return 0;                /* zstd decodes it (a copy) */
            s->ptr[s->n] = f + at;
            s->len[s->n++] = length;
        }
        at += length;
        total += length;
        if (bh & 1)
            break;
    }
    if (total != size || at + 4 != n)
        return 0;
    XXH64_state_t h;
    XXH64_reset(&h, 0);
    for (int k = 0; k < s->n; k++)
        XXH64_update(&h, s->ptr[k], s->len[k]);
    return (uint32_t)(XXH64_digest(&h) & 0xFFFFFFFFu) == zp_le32(f + n - 4) ? 1 : -1;
}

/* decompress_frame's checks and zstd's decode of exactly one frame of `size` bytes into `dst`:
   0, or -1 for any frame it refuses. */
static int zstd_frame(Scratch *s, const uint8_t *f, size_t n, uint8_t *dst, size_t size) {
    if (n > 4 && (f[4] & ZSTD_FHD_UNUSED))
        return -1;                   /* zstd ignores this bit: flipped, it would still decode */
    if (n < 5 || zp_le32(f) != ZSTD_MAGIC || !(f[4] & ZSTD_FHD_CHECKSUM))
        return -1;                   /* not a frame, or one without a content checksum */
    unsigned long long content = zstd.content_size(f, n);
    if (content >= ZSTD_CONTENTSIZE_ERROR || content != size)
        return -1;
    size_t whole = zstd.frame_size(f, n);
    if (zstd.is_error(whole) || whole != n)
        return -1;                   /* bytes after it (another frame): refused */
    if (s->dctx == NULL && (s->dctx = zstd.create()) == NULL)
        return -1;
    size_t got = zstd.decompress(s->dctx, dst, size, f, n);
    return zstd.is_error(got) || got != size ? -1 : 0;
}

/* Elements [from, to) of the planes' bytes (one pointer a plane, `itemsize` of them: 2 or 4) written
   in element order at `row`, one at a time. */
static void interleave_scalar(const uint8_t *const *q, int itemsize, uint8_t *row, size_t from, size_t to) {
    if (itemsize == 2)
        for (size_t k = from; k < to; k++) {
            row[2 * k] = q[0][k];
            row[2 * k + 1] = q[1][k];
        }
    else
        for (size_t k = from; k < to; k++) {
            row[4 * k] = q[0][k];
            row[4 * k + 1] = q[1][k];
            row[4 * k + 2] = q[2][k];
            row[4 * k + 3] = q[3][k];
        }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>
#define ZP_SIMD 1
/* m elements' bytes, one pointer a plane (`itemsize` of them: 2 or 4), interleaved into element order
   at `row`, 16 elements a step with SSE2 (every x86-64 has it): where `stream`, a streaming store (the
   line not fetched before it is written: a large batch's destinations pass any cache) once `row` is
   16-aligned, the few elements before that written as they are. Returns the elements written. */
static size_t interleave_sse2(const uint8_t *const *q, int itemsize, uint8_t *row, size_t m, int stream) {
    size_t k = 0;
    uintptr_t mis = (uintptr_t)row & 15;
    if (!stream || mis % (uintptr_t)itemsize)
        stream = 0;
    else
        k = ((16 - mis) & 15) / (size_t)itemsize;      /* scalar elements until row + k * itemsize is aligned */
    if (k > m)
        k = m;
    interleave_scalar(q, itemsize, row, 0, k);
#define ZP_STORE(at, v) (stream ? _mm_stream_si128((__m128i *)(at), (v)) : _mm_storeu_si128((__m128i *)(at), (v)))
    for (; k + 16 <= m; k += 16) {
        uint8_t *d = row + k * (size_t)itemsize;
        __m128i a = _mm_loadu_si128((const __m128i *)(q[0] + k)), b = _mm_loadu_si128((const __m128i *)(q[1] + k));
        if (itemsize == 2) {
            ZP_STORE(d, _mm_unpacklo_epi8(a, b));
            ZP_STORE(d + 16, _mm_unpackhi_epi8(a, b));
            continue;
        }
        __m128i c = _mm_loadu_si128((const __m128i *)(q[2] + k)), e = _mm_loadu_si128((const __m128i *)(q[3] + k));
        __m128i l01 = _mm_unpacklo_epi8(a, b), h01 = _mm_unpackhi_epi8(a, b);
        __m128i l23 = _mm_unpacklo_epi8(c, e), h23 = _mm_unpackhi_epi8(c, e);
        ZP_STORE(d, _mm_unpacklo_epi16(l01, l23));
        ZP_STORE(d + 16, _mm_unpackhi_epi16(l01, l23));
        ZP_STORE(d + 32, _mm_unpacklo_epi16(h01, h23));
        ZP_STORE(d + 48, _mm_unpackhi_epi16(h01, h23));
    }
#undef ZP_STORE
    return k;
}
#endif

/* Plane rows joined into element order: row (i, j) of `rest` elements sits at (i*d1 + j)*rest in
   the destination and at (j*d0 + i)*rest (swapped) or its own index in each plane. `stream`:
   streaming stores where SSE2 is compiled in (the caller's batch is large: block_checks.h's
   STREAM_FROM), fenced before this returns so the verdict is read after them. */
static void join_planes(Segs *pl, int itemsize, uint8_t *dst, size_t d0, size_t d1, size_t rest, int swapped,
                        int stream) {
    size_t outer = swapped ? d1 : d0, inner = swapped ? d0 : d1;
    for (size_t a = 0; a < outer; a++)
        for (size_t b = 0; b < inner; b++) {
            size_t i = swapped ? b : a, j = swapped ? a : b, left = rest;
            uint8_t *row = dst + (i * d1 + j) * rest * (size_t)itemsize;
            while (left > 0) {
                size_t m = left;
                for (int p = 0; p < itemsize; p++)
                    if (pl[p].len[pl[p].seg] - pl[p].off < m)
                        m = pl[p].len[pl[p].seg] - pl[p].off;
                const uint8_t *q[4];
                for (int p = 0; p < itemsize; p++)
                    q[p] = pl[p].ptr[pl[p].seg] + pl[p].off;
                size_t k = 0;
#ifdef ZP_SIMD
                k = interleave_sse2(q, itemsize, row, m, stream);
#endif
                interleave_scalar(q, itemsize, row, k, m);
                for (int p = 0; p < itemsize; p++) {
                    pl[p].off += m;
                    while (pl[p].seg < pl[p].n - 1 && pl[p].off == pl[p].len[pl[p].seg]) {
                        pl[p].seg++;
                        pl[p].off = 0;
                    }
                }
                row += m * (size_t)itemsize;
                left -= m;
            }
        }
#ifdef ZP_SIMD
    if (stream)
        _mm_sfence();                /* the streamed stores ordered before the verdict is read */
#endif
}

/* The planes after a zstd-planes header (`table`: the plane table, `itemsize` entries; the
   payload's length already the table's sum) checked and joined into `dst`: _decode_into's checks,
   in its order. `d0`, `d1`: the shape's first two dims (dim-1-major planes). */
static int decode_zstd(Scratch *s, const uint8_t *table, const uint8_t *data, int itemsize, size_t numel,
                       uint32_t coded_crc, int swapped, size_t d0, size_t d1, uint8_t *dst, int stream) {
    const uint8_t *frame[4];
    size_t flen[4];
    uint32_t crc = 0;
    size_t at = 0;
    for (int p = 0; p < itemsize; p++) {
        frame[p] = data + at;
        flen[p] = zp_le32(table + 5 * p + 1);
        if (table[5 * p] == 1)
            crc = crc32_more(crc, frame[p], flen[p]);
        at += flen[p];
    }
    if (crc != coded_crc)
        return ZP_CODED_CRC;
    if (s->cap < (size_t)itemsize * numel) {
        uint8_t *room = realloc(s->planes, (size_t)itemsize * numel);
        if (room == NULL)
            return ZP_NO_MEMORY;         /* the Python path tries */
        s->planes = room;
        s->cap = (size_t)itemsize * numel;
    }
    Segs pl[4];
    for (int p = 0; p < itemsize; p++) {
        pl[p].seg = 0;
        pl[p].off = 0;
        if (table[5 * p] == 0) {
            int r = raw_blocks(frame[p], flen[p], numel, &pl[p]);
            if (r < 0)
                return ZP_STORED_CHECKSUM;
            if (r > 0)
                continue;
        }
        uint8_t *room = s->planes + (size_t)p * numel;
        if (zstd_frame(s, frame[p], flen[p], room, numel) < 0)
            return ZP_FRAME;
        pl[p].n = 1;
        pl[p].ptr[0] = room;
        pl[p].len[0] = numel;
    }
    if (numel == 0)
        return ZP_OK;
    if (!swapped)
        d0 = d1 = 1;
    join_planes(pl, itemsize, dst, d0, d1, numel / (d0 * d1), swapped, stream);
    return ZP_OK;
}
