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
 * decode is one pass over the codes and the stored planes (storage/codec/nibble_kernel.h, which a
 * disk read's batch shares: storage/codec/block_checks.h). Both functions release the GIL; the
 * caller must not write to the buffers meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "nibble_kernel.h"

#define ESCAPE NIBBLE_ESCAPE

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
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = nibble_decode_into((const uint8_t *)coded.buf, coded.len, NULL, lows, itemsize, (uint8_t *)dst.buf, n, 0) < 0;
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_Format(PyExc_ValueError, "nibble: the coded plane is malformed (table, padding or %zd escapes stored)",
                     coded.len - 16 - ncodes);
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
