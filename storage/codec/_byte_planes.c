/* The byte-plane split and join of storage/codec/byte_planes.py, compiled.
 *
 * Knows: how to move the bytes of 2- or 4-byte elements into planes (plane b = byte b of every
 * element) and back, optionally in "dim-1-major" order, at memory speed. Doesn't know: dtypes,
 * tensors, compression or formats -- byte_planes.py checks shapes and dtypes, decides the order
 * and calls these two functions with flat buffers.
 *
 * The geometry: the elements are a [d0, d1, rest] array in element order. Element (i, j, k) sits
 * at ((i * d1 + j) * rest + k) in the tensor and at plane position
 *     swapped:      (j * d0 + i) * rest + k      (dims 0 and 1 exchanged)
 *     not swapped:  (i * d1 + j) * rest + k      (the element's own index)
 * so each (i, j) row of `rest` elements is one contiguous run on both sides, and the inner loops
 * below are plain strided byte loops over one run, which gcc and clang vectorize (-O3: byte
 * shuffles on x86-64's SSE2, ld2/st2 and ld4/st4 on arm64). They read and write bytes, never a
 * wider type, so no buffer needs more than byte alignment.
 *
 * Both functions release the GIL while they copy: the disk tier decodes, and the writers encode,
 * on several threads at once. The buffers are held (PyObject_GetBuffer) for the whole call, so
 * none can be freed or resized under it; the caller must not write to them meanwhile (nothing in
 * this package shares a block's buffers between threads while one is coded).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static void split_run2(const uint8_t *restrict src, uint8_t *restrict p0, uint8_t *restrict p1, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        p0[k] = src[2 * k];
        p1[k] = src[2 * k + 1];
    }
}

static void split_run4(const uint8_t *restrict src, uint8_t *restrict p0, uint8_t *restrict p1,
                       uint8_t *restrict p2, uint8_t *restrict p3, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        p0[k] = src[4 * k];
        p1[k] = src[4 * k + 1];
        p2[k] = src[4 * k + 2];
        p3[k] = src[4 * k + 3];
    }
}

static void join_run2(const uint8_t *restrict p0, const uint8_t *restrict p1, uint8_t *restrict dst, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        dst[2 * k] = p0[k];
        dst[2 * k + 1] = p1[k];
    }
}

static void join_run4(const uint8_t *restrict p0, const uint8_t *restrict p1, const uint8_t *restrict p2,
                      const uint8_t *restrict p3, uint8_t *restrict dst, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        dst[4 * k] = p0[k];
        dst[4 * k + 1] = p1[k];
        dst[4 * k + 2] = p2[k];
        dst[4 * k + 3] = p3[k];
    }
}

/* Checks the geometry shared by both functions; sets a ValueError and returns -1 when wrong. */
static int check_geometry(int itemsize, Py_ssize_t d0, Py_ssize_t d1, Py_ssize_t rest, Py_ssize_t *numel) {
    if (itemsize != 2 && itemsize != 4) {
        PyErr_Format(PyExc_ValueError, "byte planes: itemsize must be 2 or 4, got %d", itemsize);
        return -1;
    }
    if (d0 < 1 || d1 < 1 || rest < 0) {
        PyErr_SetString(PyExc_ValueError, "byte planes: d0 and d1 must be >= 1 and rest >= 0");
        return -1;
    }
    /* d0 * d1 * rest * itemsize must not overflow: check against the largest object size. */
    if (rest > 0 && (d0 > PY_SSIZE_T_MAX / d1 || d0 * d1 > PY_SSIZE_T_MAX / rest / itemsize)) {
        PyErr_SetString(PyExc_ValueError, "byte planes: geometry too large");
        return -1;
    }
    *numel = d0 * d1 * rest;
    return 0;
}

/* The run of row (i, j) on the plane side: where it starts in each plane. */
static inline Py_ssize_t plane_at(int swapped, Py_ssize_t i, Py_ssize_t j, Py_ssize_t d0, Py_ssize_t d1, Py_ssize_t rest) {
    return (swapped ? (j * d0 + i) : (i * d1 + j)) * rest;
}

PyDoc_STRVAR(split_doc,
"split(src, dst, itemsize, d0, d1, rest, swapped) -> None\n\n"
"Write the byte planes of `src` (d0*d1*rest elements of `itemsize` bytes, element order) into the\n"
"front of `dst` (writable, at least itemsize*numel bytes): plane b at dst[b*numel:(b+1)*numel].");

static PyObject *planes_split(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, dst;
    int itemsize, swapped;
    Py_ssize_t d0, d1, rest, numel;
    if (!PyArg_ParseTuple(args, "y*w*innnp", &src, &dst, &itemsize, &d0, &d1, &rest, &swapped))
        return NULL;
    PyObject *result = NULL;
    if (check_geometry(itemsize, d0, d1, rest, &numel) < 0)
        goto done;
    if (src.len != numel * itemsize || dst.len < numel * itemsize) {
        PyErr_Format(PyExc_ValueError, "byte planes: src must be %zd bytes and dst at least that, got %zd and %zd",
                     numel * itemsize, src.len, dst.len);
        goto done;
    }
    const uint8_t *s = (const uint8_t *)src.buf;
    uint8_t *d = (uint8_t *)dst.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < d0; i++) {
        for (Py_ssize_t j = 0; j < d1; j++) {
            const uint8_t *row = s + (i * d1 + j) * rest * itemsize;
            Py_ssize_t at = plane_at(swapped, i, j, d0, d1, rest);
            if (itemsize == 2)
                split_run2(row, d + at, d + numel + at, rest);
            else
                split_run4(row, d + at, d + numel + at, d + 2 * numel + at, d + 3 * numel + at, rest);
        }
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(join_doc,
"join(planes, dst, itemsize, d0, d1, rest, swapped) -> None\n\n"
"Inverse of split: `planes` is a sequence of `itemsize` planes (plane 0 first), each a buffer of\n"
"numel bytes or a sequence of buffers (its segments, in order) whose lengths add up to numel;\n"
"`dst` (writable, exactly itemsize*numel bytes) receives the elements in element order.");

/* A plane's segments, and where the walk through them is. */
typedef struct {
    Py_buffer *segs;      /* held buffers */
    Py_ssize_t nsegs, held;
    Py_ssize_t seg, off;  /* the cursor: segment index, offset inside it */
} Plane;

static void release_plane(Plane *pl) {
    for (Py_ssize_t s = 0; s < pl->held; s++)
        PyBuffer_Release(&pl->segs[s]);
    PyMem_Free(pl->segs);
    pl->segs = NULL;
    pl->held = pl->nsegs = 0;
}

/* Holds the buffers of one plane (a buffer, or a sequence of them) and checks they add up to
   numel bytes. Returns -1 with an exception set. */
static int hold_plane(PyObject *obj, int b, Py_ssize_t numel, Plane *pl) {
    memset(pl, 0, sizeof(*pl));
    PyObject *fast = NULL;
    Py_ssize_t n = 1;
    if (!PyObject_CheckBuffer(obj)) {
        fast = PySequence_Fast(obj, "byte planes: a plane must be a buffer or a sequence of buffers");
        if (fast == NULL)
            return -1;
        n = PySequence_Fast_GET_SIZE(fast);
    }
    pl->segs = PyMem_Calloc(n > 0 ? n : 1, sizeof(Py_buffer));
    if (pl->segs == NULL) {
        Py_XDECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    pl->nsegs = n;
    Py_ssize_t total = 0;
    for (Py_ssize_t s = 0; s < n; s++) {
        PyObject *item = fast ? PySequence_Fast_GET_ITEM(fast, s) : obj;
        if (PyObject_GetBuffer(item, &pl->segs[s], PyBUF_SIMPLE) < 0) {
            Py_XDECREF(fast);
            return -1;
        }
        pl->held++;
        total += pl->segs[s].len;
    }
    Py_XDECREF(fast);
    if (total != numel) {
        PyErr_Format(PyExc_ValueError, "byte planes: plane %d is %zd bytes, expected %zd", b, total, numel);
        return -1;
    }
    /* Empty segments are skipped by the walk: start it at the first non-empty one. */
    while (pl->seg < pl->nsegs && pl->segs[pl->seg].len == 0)
        pl->seg++;
    return 0;
}

/* Bytes left in the cursor's segment. */
static inline Py_ssize_t seg_left(const Plane *pl) {
    return pl->segs[pl->seg].len - pl->off;
}

static inline const uint8_t *seg_ptr(const Plane *pl) {
    return (const uint8_t *)pl->segs[pl->seg].buf + pl->off;
}

static inline void advance(Plane *pl, Py_ssize_t n) {
    pl->off += n;
    while (pl->seg < pl->nsegs && pl->off == pl->segs[pl->seg].len) {
        pl->seg++;
        pl->off = 0;
    }
}

static PyObject *planes_join(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    Py_buffer dst;
    int itemsize, swapped;
    Py_ssize_t d0, d1, rest, numel;
    if (!PyArg_ParseTuple(args, "Ow*innnp", &seq, &dst, &itemsize, &d0, &d1, &rest, &swapped))
        return NULL;
    Plane planes[4];
    int held = 0;
    PyObject *result = NULL, *fast = NULL;
    if (check_geometry(itemsize, d0, d1, rest, &numel) < 0)
        goto done;
    if (dst.len != numel * itemsize) {
        PyErr_Format(PyExc_ValueError, "byte planes: dst must be %zd bytes, got %zd", numel * itemsize, dst.len);
        goto done;
    }
    fast = PySequence_Fast(seq, "byte planes: planes must be a sequence");
    if (fast == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(fast) != itemsize) {
        PyErr_Format(PyExc_ValueError, "byte planes: expected %d planes, got %zd", itemsize, PySequence_Fast_GET_SIZE(fast));
        goto done;
    }
    for (; held < itemsize; held++) {
        if (hold_plane(PySequence_Fast_GET_ITEM(fast, held), held, numel, &planes[held]) < 0) {
            held++;            /* released below: hold_plane leaves what it holds in planes[held] */
            goto done;
        }
    }
    uint8_t *d = (uint8_t *)dst.buf;
    Py_BEGIN_ALLOW_THREADS
    /* Plane order: j outer, i inner when swapped (plane position (j * d0 + i) * rest + k rises
       by one run at a time), so each plane's cursor only moves forward. A run is cut where any
       plane's segment ends. */
    Py_ssize_t outer = swapped ? d1 : d0, inner = swapped ? d0 : d1;
    for (Py_ssize_t a = 0; a < outer; a++) {
        for (Py_ssize_t b = 0; b < inner; b++) {
            Py_ssize_t i = swapped ? b : a, j = swapped ? a : b;
            uint8_t *row = d + (i * d1 + j) * rest * itemsize;
            Py_ssize_t left = rest;
            while (left > 0) {
                Py_ssize_t n = left;
                for (int p = 0; p < itemsize; p++) {
                    Py_ssize_t s = seg_left(&planes[p]);
                    if (s < n)
                        n = s;
                }
                if (itemsize == 2)
                    join_run2(seg_ptr(&planes[0]), seg_ptr(&planes[1]), row, n);
                else
                    join_run4(seg_ptr(&planes[0]), seg_ptr(&planes[1]), seg_ptr(&planes[2]), seg_ptr(&planes[3]), row, n);
                for (int p = 0; p < itemsize; p++)
                    advance(&planes[p], n);
                row += n * itemsize;
                left -= n;
            }
        }
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (int b = 0; b < held; b++)
        release_plane(&planes[b]);
    Py_XDECREF(fast);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"split", planes_split, METH_VARARGS, split_doc},
    {"join", planes_join, METH_VARARGS, join_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "storage.codec._byte_planes",
    "The byte-plane split and join, compiled (see _byte_planes.c and storage/codec/byte_planes.py).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__byte_planes(void) {
    return PyModule_Create(&module);
}
