/* The nibble codec's decode kernel: a block's element bytes from its coded top plane (or its stored
 * one) and its lower planes, in one pass, straight into the destination in element order. Shared by
 * storage/codec/_nibble.c (nibble.decode) and storage/codec/block_checks.h (a disk read's batch).
 *
 * Knows: the coded plane's layout (storage/codec/_nibble.c's docstring: a 16-byte table, the codes
 * two a byte, the escapes) and when one is malformed (table[15] not 0, a padding nibble not 0, the
 * escapes not exactly the codes' 15s). Doesn't know: headers, checksums or Python: every function
 * is plain C on the caller's buffers, safe on any thread without the GIL, and reads no byte outside
 * them whatever they hold (the escapes are counted, the codes' length is the element count's).
 *
 * On x86-64 with SSSE3, 32 elements a step (pshufb looks up 16 nibbles in the table at once,
 * unpacks interleave them with the lower planes; a step holding an escape patches its looked-up
 * bytes from the stream before they are interleaved); elsewhere, the same in plain C.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define NIBBLE_SIMD 1
#endif

#define NIBBLE_ESCAPE 15
#define NIBBLE_TABLE 16

/* One element, scalar: its top byte from its code (an escape from the stream); -1 when the
   stream is exhausted. */
static inline int nibble_top_of(const uint8_t *codes, const uint8_t *table, const uint8_t *esc, ptrdiff_t nesc,
                                ptrdiff_t *e, ptrdiff_t i) {
    uint8_t c = (codes[i >> 1] >> ((i & 1) * 4)) & 15;
    if (c != NIBBLE_ESCAPE)
        return table[c];
    if (*e >= nesc)
        return -1;
    return esc[(*e)++];
}

/* Elements [from, to) element by element; `top` the stored top plane, or NULL (coded). Returns -1
   when the escapes run out. */
static int nibble_scalar(const uint8_t *codes, const uint8_t *table, const uint8_t *esc, ptrdiff_t nesc,
                         ptrdiff_t *e, const uint8_t *top, const uint8_t *const *low, int itemsize, uint8_t *dst,
                         ptrdiff_t from, ptrdiff_t to) {
    for (ptrdiff_t i = from; i < to; i++) {
        int t = top ? top[i] : nibble_top_of(codes, table, esc, nesc, e, i);
        if (t < 0)
            return -1;
        uint8_t *d = dst + i * itemsize;
        for (int b = 0; b < itemsize - 1; b++)
            d[b] = low[b][i];
        d[itemsize - 1] = (uint8_t)t;
    }
    return 0;
}

#ifdef NIBBLE_SIMD
/* One 16-byte store: streaming (past the cache, `d` 16-aligned) or not. */
__attribute__((target("ssse3")))
static inline void nibble_store(uint8_t *d, __m128i v, int stream) {
    if (stream)
        _mm_stream_si128((__m128i *)d, v);
    else
        _mm_storeu_si128((__m128i *)d, v);
}

/* 16 elements from `at` written in element order: their top bytes `top`, the lower planes' own. */
__attribute__((target("ssse3")))
static inline void nibble_put16(const uint8_t *const *low, int itemsize, uint8_t *dst, ptrdiff_t at, __m128i top,
                                int stream) {
    uint8_t *d = dst + at * itemsize;
    __m128i m0 = _mm_loadu_si128((const __m128i *)(low[0] + at));
    if (itemsize == 2) {
        nibble_store(d, _mm_unpacklo_epi8(m0, top), stream);
        nibble_store(d + 16, _mm_unpackhi_epi8(m0, top), stream);
        return;
    }
    __m128i m1 = _mm_loadu_si128((const __m128i *)(low[1] + at));
    __m128i m2 = _mm_loadu_si128((const __m128i *)(low[2] + at));
    __m128i l01 = _mm_unpacklo_epi8(m0, m1), h01 = _mm_unpackhi_epi8(m0, m1);
    __m128i l23 = _mm_unpacklo_epi8(m2, top), h23 = _mm_unpackhi_epi8(m2, top);
    nibble_store(d, _mm_unpacklo_epi16(l01, l23), stream);
    nibble_store(d + 16, _mm_unpackhi_epi16(l01, l23), stream);
    nibble_store(d + 32, _mm_unpacklo_epi16(h01, h23), stream);
    nibble_store(d + 48, _mm_unpackhi_epi16(h01, h23), stream);
}

/* Elements [from, to) in steps of 32 (both multiples of 32); a step with an escape takes them from
   the stream; `top` the stored top plane, or NULL (coded); `stream`: streaming stores (`dst`
   16-aligned). Returns -1 when the escapes run out. */
__attribute__((target("ssse3")))
static int nibble_ssse3(const uint8_t *codes, const uint8_t *table, const uint8_t *esc, ptrdiff_t nesc,
                        ptrdiff_t *e, const uint8_t *top, const uint8_t *const *low, int itemsize, uint8_t *dst,
                        ptrdiff_t from, ptrdiff_t to, int stream) {
    const __m128i tab = table ? _mm_loadu_si128((const __m128i *)table) : _mm_setzero_si128();
    const __m128i mask = _mm_set1_epi8(0x0f), fifteen = _mm_set1_epi8(NIBBLE_ESCAPE);
    for (ptrdiff_t i = from; i + 32 <= to; i += 32) {
        if (top) {
            nibble_put16(low, itemsize, dst, i, _mm_loadu_si128((const __m128i *)(top + i)), stream);
            nibble_put16(low, itemsize, dst, i + 16, _mm_loadu_si128((const __m128i *)(top + i + 16)), stream);
            continue;
        }
        __m128i c = _mm_loadu_si128((const __m128i *)(codes + i / 2));
        __m128i lo = _mm_and_si128(c, mask), hi = _mm_and_si128(_mm_srli_epi16(c, 4), mask);
        __m128i a = _mm_shuffle_epi8(tab, lo), b = _mm_shuffle_epi8(tab, hi);
        __m128i t0 = _mm_unpacklo_epi8(a, b), t1 = _mm_unpackhi_epi8(a, b);    /* elements i.., i+16.. */
        if (_mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(lo, fifteen), _mm_cmpeq_epi8(hi, fifteen)))) {
            /* Escapes (~6% of steps on real KV): the looked-up bytes patched in place, in element
               order, from the escape stream (code byte k holds elements 2k and 2k + 1). */
            uint32_t m = (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_unpacklo_epi8(lo, hi), fifteen))
                         | (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_unpackhi_epi8(lo, hi), fifteen)) << 16;
            uint8_t t[32];
            _mm_storeu_si128((__m128i *)t, t0);
            _mm_storeu_si128((__m128i *)(t + 16), t1);
            for (; m; m &= m - 1) {
                if (*e >= nesc)
                    return -1;
                t[__builtin_ctz(m)] = esc[(*e)++];
            }
            t0 = _mm_loadu_si128((const __m128i *)t);
            t1 = _mm_loadu_si128((const __m128i *)(t + 16));
        }
        nibble_put16(low, itemsize, dst, i, t0, stream);
        nibble_put16(low, itemsize, dst, i + 16, t1, stream);
    }
    return 0;
}
#endif

/* One block's decode, element range by element range (a caller may hash each part's stored bytes
   while they are in the cache): nibble_begin, nibble_part over [0, n) in order, nibble_end. */
typedef struct {
    const uint8_t *table, *codes, *esc;   /* the coded top plane's parts, or NULL */
    const uint8_t *top;                   /* the stored top plane, or NULL */
    const uint8_t *low[3];
    uint8_t *dst;
    ptrdiff_t n, nesc, e;                 /* elements, escapes stored, escapes used */
    int itemsize, stream, simd;
} NibbleDecode;

/* The block of n elements of `itemsize` (2 or 4) bytes into `dst` (itemsize * n bytes): from its
   coded top plane `coded` (`coded_len` bytes, within 16 + (n + 1) / 2 .. that + n: the caller's
   check) or, when `coded` is NULL, its stored top plane `top` (n bytes), and its itemsize - 1
   lower planes `low` (n bytes each). `stream`: with streaming stores where `dst` allows (a batch
   too large for any cache: its lines are not fetched before they are written). Returns -1 for a
   malformed table (entry 15 not 0) or padding nibble (not 0). */
static int nibble_begin(NibbleDecode *d, const uint8_t *coded, ptrdiff_t coded_len, const uint8_t *top,
                        const uint8_t *const *low, int itemsize, uint8_t *dst, ptrdiff_t n, int stream) {
    ptrdiff_t ncodes = (n + 1) / 2;
    memset(d, 0, sizeof *d);
    d->top = top;
    for (int b = 0; b < itemsize - 1; b++)
        d->low[b] = low[b];
    d->dst = dst;
    d->n = n;
    d->itemsize = itemsize;
#ifdef NIBBLE_SIMD
    d->simd = __builtin_cpu_supports("ssse3");
    d->stream = d->simd && stream && ((uintptr_t)dst & 15) == 0;
#endif
    if (coded) {
        d->table = coded;
        d->codes = coded + NIBBLE_TABLE;
        d->esc = d->codes + ncodes;
        d->nesc = coded_len - NIBBLE_TABLE - ncodes;
        if (d->table[NIBBLE_ESCAPE] != 0 || ((n & 1) && (d->codes[ncodes - 1] >> 4) != 0))
            return -1;
    }
    return 0;
}

/* Elements [from, to): `from` a multiple of 32, `to` one too or n. Returns -1 when the escapes run out. */
static int nibble_part(NibbleDecode *d, ptrdiff_t from, ptrdiff_t to) {
#ifdef NIBBLE_SIMD
    if (d->simd) {
        ptrdiff_t whole = to - (to - from) % 32;
        if (nibble_ssse3(d->codes, d->table, d->esc, d->nesc, &d->e, d->top, d->low, d->itemsize, d->dst, from, whole,
                         d->stream) < 0)
            return -1;
        from = whole;
    }
#endif
    return nibble_scalar(d->codes, d->table, d->esc, d->nesc, &d->e, d->top, d->low, d->itemsize, d->dst, from, to);
}

/* After the parts (or a failed one): the streamed stores ordered before the verdict is read. Returns
   -1 when the escapes stored are not exactly the ones the codes used. */
static int nibble_end(NibbleDecode *d) {
#ifdef NIBBLE_SIMD
    if (d->stream)
        _mm_sfence();
#endif
    return d->e == d->nesc ? 0 : -1;
}

/* The whole block at once (nibble_begin's arguments). Returns 0, or -1 for a malformed coded plane
   (table[15] not 0, a padding nibble not 0, escapes not exactly the codes' 15s): `dst` is then
   partly written. */
static inline int nibble_decode_into(const uint8_t *coded, ptrdiff_t coded_len, const uint8_t *top,
                              const uint8_t *const *low, int itemsize, uint8_t *dst, ptrdiff_t n, int stream) {
    NibbleDecode d;
    if (nibble_begin(&d, coded, coded_len, top, low, itemsize, dst, n, stream) < 0)
        return -1;
    int bad = nibble_part(&d, 0, n) < 0;
    return nibble_end(&d) < 0 || bad ? -1 : 0;
}
