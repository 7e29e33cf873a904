/* The nibble coding of storage/codec/nibble.py, compiled: a block's top byte plane as 4-bit codes
 * into a table of its 15 commonest values, the rest as escapes, and the lower planes as they are.
 *
 * Knows: the coded plane's layout (below) and how to write it from a block's element bytes, and
 * read it back, fused with the join of the planes, straight into the destination in element
 * order. Doesn't know: dtypes, headers, checksums or what a block is -- nibble.py checks the
 * sizes, hashes the data and calls these two functions with flat buffers.
 *
 * The coded plane of n elements:
 *     table     16 bytes: the values of codes 0..14; byte 15 is 0 (code 15 is the escape)
 *     codes     (n + 1) / 2 bytes: element 2k's code in byte k's low nibble, 2k+1's in its high
 *               nibble (0 past the last element when n is odd)
 *     escapes   one byte per element coded 15, its top byte, in element order
 *
 * decode is one pass over the codes and the stored planes: on x86-64 with SSSE3, 32 elements a
 * step (pshufb looks up 16 nibbles in the table at once, unpacks interleave them with the lower
 * planes), and a step holding an escape goes element by element; elsewhere, the same in plain C.
 * Both functions release the GIL; the caller must not write to the buffers meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define NIBBLE_SIMD 1
#endif

#define ESCAPE 15

/* One element, scalar: its top byte from its code (an escape from the stream); -1 when the
   stream is exhausted. */
static inline int top_of(const uint8_t *codes, const uint8_t *table, const uint8_t *esc, Py_ssize_t nesc,
                         Py_ssize_t *e, Py_ssize_t i) {
    uint8_t c = (codes[i >> 1] >> ((i & 1) * 4)) & 15;
    if (c != ESCAPE)
        return table[c];
    if (*e >= nesc)
        return -1;
    return esc[(*e)++];
}

/* Elements [from, to) element by element. Returns -1 when the escapes run out. */
static int decode_scalar(const uint8_t *codes, const uint8_t *table, const uint8_t *esc, Py_ssize_t nesc,
                         Py_ssize_t *e, const uint8_t *const *low, int itemsize, uint8_t *dst,
                         Py_ssize_t from, Py_ssize_t to) {
    for (Py_ssize_t i = from; i < to; i++) {
        int t = top_of(codes, table, esc, nesc, e, i);
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
/* Elements [0, n - n % 32) in steps of 32; a step with an escape goes through decode_scalar.
   Returns -1 when the escapes run out. */
__attribute__((target("ssse3")))
static int decode_ssse3(const uint8_t *codes, const uint8_t *table, const uint8_t *esc, Py_ssize_t nesc,
                        Py_ssize_t *e, const uint8_t *const *low, int itemsize, uint8_t *dst, Py_ssize_t n) {
    const __m128i tab = _mm_loadu_si128((const __m128i *)table);
    const __m128i mask = _mm_set1_epi8(0x0f), fifteen = _mm_set1_epi8(ESCAPE);
    for (Py_ssize_t i = 0; i + 32 <= n; i += 32) {
        __m128i c = _mm_loadu_si128((const __m128i *)(codes + i / 2));
        __m128i lo = _mm_and_si128(c, mask), hi = _mm_and_si128(_mm_srli_epi16(c, 4), mask);
        if (_mm_movemask_epi8(_mm_or_si128(_mm_cmpeq_epi8(lo, fifteen), _mm_cmpeq_epi8(hi, fifteen)))) {
            if (decode_scalar(codes, table, esc, nesc, e, low, itemsize, dst, i, i + 32) < 0)
                return -1;
            continue;
        }
        __m128i a = _mm_shuffle_epi8(tab, lo), b = _mm_shuffle_epi8(tab, hi);
        __m128i top[2] = {_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)};   /* elements i.., i+16.. */
        for (int h = 0; h < 2; h++) {
            Py_ssize_t at = i + 16 * h;
            uint8_t *d = dst + at * itemsize;
            if (itemsize == 2) {
                __m128i m0 = _mm_loadu_si128((const __m128i *)(low[0] + at));
                _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi8(m0, top[h]));
                _mm_storeu_si128((__m128i *)(d + 16), _mm_unpackhi_epi8(m0, top[h]));
            } else {
                __m128i m0 = _mm_loadu_si128((const __m128i *)(low[0] + at));
                __m128i m1 = _mm_loadu_si128((const __m128i *)(low[1] + at));
                __m128i m2 = _mm_loadu_si128((const __m128i *)(low[2] + at));
                __m128i l01 = _mm_unpacklo_epi8(m0, m1), h01 = _mm_unpackhi_epi8(m0, m1);
                __m128i l23 = _mm_unpacklo_epi8(m2, top[h]), h23 = _mm_unpackhi_epi8(m2, top[h]);
                _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi16(l01, l23));
                _mm_storeu_si128((__m128i *)(d + 16), _mm_unpackhi_epi16(l01, l23));
                _mm_storeu_si128((__m128i *)(d + 32), _mm_unpacklo_epi16(h01, h23));
                _mm_storeu_si128((__m128i *)(d + 48), _mm_unpackhi_epi16(h01, h23));
            }
        }
    }
    return 0;
}
#endif

static int check_itemsize(int itemsize) {
    if (itemsize != 2 && itemsize != 4) {
        PyErr_Format(PyExc_ValueError, "nibble: itemsize must be 2 or 4, got %d", itemsize);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(decode_doc,
"decode(coded, low, dst, itemsize) -> None\n\n"
"The block from its coded top plane `coded` (table, codes, escapes) and its `itemsize - 1` lower\n"
"planes `low` (a sequence of buffers of numel bytes each, plane 0 first), written into `dst`\n"
"(writable, itemsize * numel bytes) in element order. ValueError when the escapes are not\n"
"exactly the codes' count of 15, or a padding nibble is not 0; `dst` is then partly written.");

static PyObject *nibble_decode(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer coded, dst, low[3];
    PyObject *low_seq;
    int itemsize, held = 0;
    if (!PyArg_ParseTuple(args, "y*Ow*i", &coded, &low_seq, &dst, &itemsize))
        return NULL;
    PyObject *result = NULL, *fast = NULL;
    if (check_itemsize(itemsize) < 0)
        goto done;
    Py_ssize_t n = dst.len / itemsize;
    Py_ssize_t ncodes = (n + 1) / 2;
    if (dst.len % itemsize || coded.len < 16 + ncodes || coded.len > 16 + ncodes + n) {
        PyErr_Format(PyExc_ValueError, "nibble: a coded plane of %zd bytes for %zd elements", coded.len, n);
        goto done;
    }
    fast = PySequence_Fast(low_seq, "nibble: low must be a sequence of buffers");
    if (fast == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(fast) != itemsize - 1) {
        PyErr_Format(PyExc_ValueError, "nibble: %d lower planes expected", itemsize - 1);
        goto done;
    }
    const uint8_t *lows[3];
    for (; held < itemsize - 1; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, held), &low[held], PyBUF_SIMPLE) < 0)
            goto done;
        if (low[held].len != n) {
            PyErr_Format(PyExc_ValueError, "nibble: lower plane %d is %zd bytes, not %zd", held, low[held].len, n);
            held++;
            goto done;
        }
        lows[held] = (const uint8_t *)low[held].buf;
    }
    const uint8_t *table = (const uint8_t *)coded.buf, *codes = table + 16, *esc = codes + ncodes;
    Py_ssize_t nesc = coded.len - 16 - ncodes, e = 0;
    int bad = table[ESCAPE] != 0 || ((n & 1) && (codes[ncodes - 1] >> 4) != 0);
    uint8_t *d = (uint8_t *)dst.buf;
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t from = 0;
#ifdef NIBBLE_SIMD
        if (__builtin_cpu_supports("ssse3")) {
            bad = decode_ssse3(codes, table, esc, nesc, &e, lows, itemsize, d, n) < 0;
            from = n - n % 32;
        }
#endif
        if (!bad)
            bad = decode_scalar(codes, table, esc, nesc, &e, lows, itemsize, d, from, n) < 0;
        Py_END_ALLOW_THREADS
    }
    if (bad || e != nesc) {
        PyErr_Format(PyExc_ValueError, "nibble: the coded plane is malformed (%zd escapes stored, %zd used)", nesc, e);
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (int b = 0; b < held; b++)
        PyBuffer_Release(&low[b]);
    Py_XDECREF(fast);
    PyBuffer_Release(&coded);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(encode_doc,
"encode(src, itemsize, low, coded) -> int\n\n"
"Code the block `src` (numel elements of `itemsize` bytes, element order): its lower planes into\n"
"`low` (writable, (itemsize - 1) * numel bytes: plane 0 first), its top plane into `coded`\n"
"(writable, at least 16 + (numel + 1) / 2 + numel + 1 bytes: one of slack) as table, codes and\n"
"escapes. Returns the coded plane's length. The table holds the 15 commonest top bytes, most frequent first (ties:\n"
"the smaller value first), so the same block always codes to the same bytes.");

static PyObject *nibble_encode(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, low, coded;
    int itemsize;
    if (!PyArg_ParseTuple(args, "y*iw*w*", &src, &itemsize, &low, &coded))
        return NULL;
    PyObject *result = NULL;
    if (check_itemsize(itemsize) < 0)
        goto done;
    Py_ssize_t n = src.len / itemsize, ncodes = (n + 1) / 2, length = 0;
    if (src.len % itemsize || low.len < (itemsize - 1) * n || coded.len < 16 + ncodes + n + 1) {
        PyErr_SetString(PyExc_ValueError, "nibble: buffers too small for the block");
        goto done;
    }
    const uint8_t *s = (const uint8_t *)src.buf;
    uint8_t *l = (uint8_t *)low.buf, *table = (uint8_t *)coded.buf, *codes = table + 16, *esc = codes + ncodes;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t count[256] = {0};
    for (Py_ssize_t i = 0; i < n; i++)
        count[s[i * itemsize + itemsize - 1]]++;
    uint8_t code_of[256];
    memset(code_of, ESCAPE, sizeof code_of);
    memset(table, 0, 16);
    for (int k = 0; k < ESCAPE; k++) {          /* the 15 commonest, by count then value */
        int best = -1;
        for (int v = 0; v < 256; v++)
            if (count[v] > 0 && code_of[v] == ESCAPE && (best < 0 || count[v] > count[best]))
                best = v;
        if (best < 0)
            break;
        code_of[best] = (uint8_t)k;
        table[k] = (uint8_t)best;
    }
    if (itemsize == 2) {
        for (Py_ssize_t i = 0; i < n; i++)
            l[i] = s[2 * i];
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            l[i] = s[4 * i];
            l[n + i] = s[4 * i + 1];
            l[2 * n + i] = s[4 * i + 2];
        }
    }
    /* Two elements a code byte; an escape's byte is written unconditionally and kept only when
       it is one (e advances), so the loop has no branch: `coded` has a byte of slack for it. */
    const uint8_t *top = s + itemsize - 1;
    Py_ssize_t e = 0, k = 0;
    for (; 2 * k + 1 < n; k++) {
        uint8_t t0 = top[2 * k * itemsize], t1 = top[(2 * k + 1) * itemsize];
        uint8_t c0 = code_of[t0], c1 = code_of[t1];
        codes[k] = (uint8_t)(c0 | (c1 << 4));
        esc[e] = t0;
        e += c0 == ESCAPE;
        esc[e] = t1;
        e += c1 == ESCAPE;
    }
    if (n & 1) {
        uint8_t t0 = top[(n - 1) * itemsize], c0 = code_of[t0];
        codes[k] = c0;
        esc[e] = t0;
        e += c0 == ESCAPE;
    }
    length = 16 + ncodes + e;
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(length);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&low);
    PyBuffer_Release(&coded);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", nibble_decode, METH_VARARGS, decode_doc},
    {"encode", nibble_encode, METH_VARARGS, encode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nibble", "The nibble coding, compiled.", -1, methods};

PyMODINIT_FUNC PyInit__nibble(void) { return PyModule_Create(&module); }
