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
 * unpacks interleave them with the lower planes), and a step holding an escape goes element by
 * element; elsewhere, the same in plain C.
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

/* Elements [0, n - n % 32) in steps of 32; a step with an escape goes through nibble_scalar; `top`
   the stored top plane, or NULL (coded); `stream`: streaming stores (`dst` 16-aligned). Returns -1
   when the escapes run out. */
__attribute__((target("ssse3")))
static int nibble_ssse3(const uint8_t *codes, const uint8_t *table, const uint8_t *esc, ptrdiff_t nesc,
                        ptrdiff_t *e, const uint8_t *top, const uint8_t *const *low, int itemsize, uint8_t *dst,
                        ptrdiff_t n, int stream) {
    const __m128i tab = table ? _mm_loadu_si128((const __m128i *)table) : _mm_setzero_si128();
    const __m128i mask = _mm_set1_epi8(0x0f), fifteen = _mm_set1_epi8(NIBBLE_ESCAPE);
    for (ptrdiff_t i = 0; i + 32 <= n; i += 32) {
        if (top) {
            nibble_put16(low, itemsize, dst, i, _mm_loadu_si128((const __m128i *)(top + i)), stream);
            nibble_put16(low, itemsize, dst, i + 16, _mm_loadu_si128((const __m128i *)(top + i + 16)), stream);
            continue;
        }
        __m128i c = _mm_loadu_si128((const __m128i *)(codes + i / 2));
        __m128i lo = _mm_and_si128(c, mask), hi = _mm_and_si128(_mm_srli_epi16(c, 4), mask);
        if (_mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(lo, fifteen), _mm_cmpeq_epi8(hi, fifteen)))) {
            if (nibble_scalar(codes, table, esc, nesc, e, NULL, low, itemsize, dst, i, i + 32) < 0)
                return -1;
            continue;
        }
        __m128i a = _mm_shuffle_epi8(tab, lo), b = _mm_shuffle_epi8(tab, hi);
        nibble_put16(low, itemsize, dst, i, _mm_unpacklo_epi8(a, b), stream);       /* elements i.. */
        nibble_put16(low, itemsize, dst, i + 16, _mm_unpackhi_epi8(a, b), stream);  /* elements i+16.. */
    }
    return 0;
}
#endif

/* The block of n elements of `itemsize` (2 or 4) bytes into `dst` (itemsize * n bytes): from its
   coded top plane `coded` (`coded_len` bytes, within 16 + (n + 1) / 2 .. that + n: the caller's
   check) or, when `coded` is NULL, its stored top plane `top` (n bytes), and its itemsize - 1
   lower planes `low` (n bytes each). `stream`: with streaming stores where `dst` allows (a batch
   too large for any cache: its lines are not fetched before they are written). Returns 0, or -1
   for a malformed coded plane (table[15] not 0, a padding nibble not 0, escapes not exactly the
   codes' 15s): `dst` is then partly written. */
static int nibble_decode_into(const uint8_t *coded, ptrdiff_t coded_len, const uint8_t *top,
                              const uint8_t *const *low, int itemsize, uint8_t *dst, ptrdiff_t n, int stream) {
    ptrdiff_t ncodes = (n + 1) / 2, nesc = 0, e = 0, from = 0;
    const uint8_t *table = NULL, *codes = NULL, *esc = NULL;
    if (coded) {
        table = coded;
        codes = table + NIBBLE_TABLE;
        esc = codes + ncodes;
        nesc = coded_len - NIBBLE_TABLE - ncodes;
        if (table[NIBBLE_ESCAPE] != 0 || ((n & 1) && (codes[ncodes - 1] >> 4) != 0))
            return -1;
    }
#ifdef NIBBLE_SIMD
    if (__builtin_cpu_supports("ssse3")) {
        stream = stream && ((uintptr_t)dst & 15) == 0;
        int bad = nibble_ssse3(codes, table, esc, nesc, &e, top, low, itemsize, dst, n, stream) < 0;
        if (stream)
            _mm_sfence();            /* the streamed stores ordered before the verdict is read */
        if (bad)
            return -1;
        from = n - n % 32;
    }
#endif
    if (nibble_scalar(codes, table, esc, nesc, &e, top, low, itemsize, dst, from, n) < 0)
        return -1;
    return e == nesc ? 0 : -1;
}
