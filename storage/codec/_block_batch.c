/* A get_many's stored blocks checked, hashed and copied by compiled threads while the rest are
 * still being fetched: the `Batch` behind storage/codec/block_batch.py, one per get_many, instead
 * of ~40 us of Python a block holding the GIL.
 *
 * Knows: one batch's jobs (a block each: its payload, its metadata's facts, its destination; what
 * is checked of it is storage/codec/block_checks.h), the helper threads that take them as they are
 * added, and when every one is done. Doesn't know: LMDB, torch, or what becomes of a verdict.
 *
 * Threads: a Batch is used by one Python thread (the get_many's), holding the GIL. add() reads the
 * block's metadata record against its key holding it (a few hundred bytes; the key's token ids are
 * Python ints) and publishes the job; up to threads - 1 pthreads, started at the first job that has a
 * copy to make, take each published job with no GIL (the header, the hash, the copy) and wait on a
 * condition variable when they have caught up -- so the blocks' copies run while the caller is still
 * fetching the next ones from LMDB, instead of after all of them. finish() releases the GIL, takes
 * what is left on the calling thread beside the helpers and joins them; abandon() stops them after
 * the job each holds. The helpers touch only the buffers the caller holds (payloads added from its
 * read transaction, destinations it owns) and every one is joined before finish() or abandon()
 * returns: the caller calls one of them inside its read transaction, so every read of the map is
 * inside it, and a fault there (a truncated data.mdb) is absorbed as zeros by
 * storage/disk/_map_faults.c's handler on whichever thread faults (a new thread inherits the
 * caller's signal mask, and the handler runs on its own stack). A Batch freed without either
 * abandons its jobs the same way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>

#include "block_checks.h"

#define MAX_HELPERS 63

typedef struct {
    PyObject_HEAD
    Expect e;
    Job *jobs;
    Py_buffer *views;            /* each job's payload, held until the jobs are joined */
    Py_ssize_t cap;              /* jobs allocated: the most add() takes */
    Py_ssize_t added;            /* jobs published (under mu) */
    Py_ssize_t next;             /* the next job a thread takes (under mu) */
    int closed;                  /* no job will be added: a thread that caught up leaves (under mu) */
    int abandoned;               /* leave at once, jobs left undone (under mu) */
    int waiting;                 /* helpers waiting for a job (under mu) */
    int helpers;                 /* helpers to start */
    int started;                 /* helpers started */
    int done;                    /* finished or abandoned: every helper joined, every view released */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t threads[MAX_HELPERS];
} Batch;

/* Take jobs until none is left and none will come (or the batch is abandoned). No GIL. */
static void take_jobs(Batch *b) {
    Scratch scratch = {0};           /* this thread's zstd context and decoded planes */
    pthread_mutex_lock(&b->mu);
    for (;;) {
        while (b->next >= b->added && !b->closed && !b->abandoned) {
            b->waiting++;
            pthread_cond_wait(&b->cv, &b->mu);
            b->waiting--;
        }
        if (b->abandoned || b->next >= b->added)
            break;
        Job *j = &b->jobs[b->next++];
        pthread_mutex_unlock(&b->mu);
        if (j->verdict == OK)            /* the metadata passed (read holding the GIL) */
            j->verdict = check_block(&b->e, j, &scratch);
        pthread_mutex_lock(&b->mu);
    }
    pthread_mutex_unlock(&b->mu);
    scratch_free(&scratch);
}

static void *helper(void *arg) {
    take_jobs(arg);
    return NULL;
}

/* Every helper joined and every payload view released (the GIL held for the releases). */
static void end_jobs(Batch *b, int abandon) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&b->mu);
    b->closed = 1;
    b->abandoned = abandon;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    if (!abandon)
        take_jobs(b);
    for (int t = 0; t < b->started; t++)
        pthread_join(b->threads[t], NULL);
    Py_END_ALLOW_THREADS
    b->started = 0;
    for (Py_ssize_t i = 0; i < b->cap; i++)
        if (b->views[i].obj)
            PyBuffer_Release(&b->views[i]);
    b->done = 1;
}

static PyObject *batch_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Py_ssize_t cap, nbytes;
    int dtype_code, strict, threads;
    PyObject *shape;
    static char *names[] = {"n", "nbytes", "dtype_code", "shape", "strict", "threads", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nniO!pi", names, &cap, &nbytes, &dtype_code, &PyTuple_Type, &shape,
                                     &strict, &threads))
        return NULL;
    if (cap < 0 || nbytes < 0 || PyTuple_GET_SIZE(shape) > MAX_NDIM) {
        PyErr_SetString(PyExc_ValueError, "Batch: n and nbytes >= 0, at most 8 dims");
        return NULL;
    }
    Expect e = {.nbytes = nbytes, .dtype_code = dtype_code, .strict = strict, .ndim = (int)PyTuple_GET_SIZE(shape)};
    for (int d = 0; d < e.ndim; d++)
        e.shape[d] = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(shape, d));
    if (PyErr_Occurred())
        return NULL;
    /* A thread per MIN_SHARE bytes at most: starting one costs ~20-50 us, a share that small is
       copied in ~1 ms. */
    Py_ssize_t total = cap * nbytes, by_bytes = (total + MIN_SHARE - 1) / MIN_SHARE;
    e.stream = total >= STREAM_FROM;
    if (threads > by_bytes)
        threads = (int)by_bytes;
    if (threads > cap)
        threads = (int)cap;
    if (threads > MAX_HELPERS + 1)
        threads = MAX_HELPERS + 1;
    Batch *b = (Batch *)type->tp_alloc(type, 0);
    if (b == NULL)
        return NULL;
    b->e = e;
    b->cap = cap;
    b->helpers = threads > 1 ? threads - 1 : 0;
    b->jobs = PyMem_Calloc(cap > 0 ? cap : 1, sizeof(Job));
    b->views = PyMem_Calloc(cap > 0 ? cap : 1, sizeof(Py_buffer));
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    if (!b->jobs || !b->views) {
        b->done = 1;
        Py_DECREF(b);
        return PyErr_NoMemory();
    }
    return (PyObject *)b;
}

/* add(key, payload, meta, dst): the block's metadata checked against `key` now (GIL held), the
   rest on the batch's threads; `dst` the address its bytes go to (nbytes long). */
static PyObject *batch_add(Batch *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "add(key, payload, meta, dst)");
        return NULL;
    }
    if (b->done || b->added >= b->cap) {
        PyErr_SetString(PyExc_ValueError, b->done ? "Batch: already finished" : "Batch: more blocks than it was made for");
        return NULL;
    }
    Py_ssize_t i = b->added;         /* not yet published: no helper reads it */
    Job *j = &b->jobs[i];
    PyObject *payload = args[1], *meta = args[2];
    if (payload == Py_None) {
        j->verdict = PAYLOAD_MISSING;
    } else {
        if (PyObject_GetBuffer(payload, &b->views[i], PyBUF_SIMPLE) < 0)
            return NULL;
        j->src = b->views[i].buf;
        j->len = b->views[i].len;
        if (meta == Py_None) {
            j->verdict = META_MISSING;
        } else {
            Py_buffer mv;
            if (PyObject_GetBuffer(meta, &mv, PyBUF_SIMPLE) < 0)
                goto fail;
            j->verdict = check_meta(mv.buf, mv.len, args[0], j->len, j);
            PyBuffer_Release(&mv);
            if (PyErr_Occurred())
                goto fail;
            if (j->verdict == OK) {
                j->dst = PyLong_AsVoidPtr(args[3]);
                if (j->dst == NULL) {
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_ValueError, "dst: a null address");
                    goto fail;
                }
            }
        }
    }
    if (j->verdict == OK)
        for (; b->started < b->helpers; b->started++)
            if (pthread_create(&b->threads[b->started], NULL, helper, b) != 0) {
                b->helpers = b->started;     /* fewer helpers: the jobs are taken all the same */
                break;
            }
    pthread_mutex_lock(&b->mu);
    b->added++;
    if (b->waiting)
        pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
    Py_RETURN_NONE;
fail:
    if (b->views[i].obj)
        PyBuffer_Release(&b->views[i]);
    memset(j, 0, sizeof *j);
    return NULL;
}

static PyObject *batch_finish(Batch *b, PyObject *unused) {
    if (b->done) {
        PyErr_SetString(PyExc_ValueError, "Batch: already finished");
        return NULL;
    }
    end_jobs(b, 0);
    PyObject *verdicts = PyBytes_FromStringAndSize(NULL, b->added);
    if (verdicts == NULL)
        return NULL;
    char *out = PyBytes_AS_STRING(verdicts);
    for (Py_ssize_t i = 0; i < b->added; i++)
        out[i] = (char)b->jobs[i].verdict;
    return verdicts;
}

static PyObject *batch_abandon(Batch *b, PyObject *unused) {
    if (!b->done)
        end_jobs(b, 1);
    Py_RETURN_NONE;
}

static void batch_dealloc(Batch *b) {
    if (!b->done && b->views)
        end_jobs(b, 1);
    PyMem_Free(b->jobs);
    PyMem_Free(b->views);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyMethodDef batch_methods[] = {
    {"add", (PyCFunction)(void (*)(void))batch_add, METH_FASTCALL,
     "add(key, payload, meta, dst) -> None: the block's metadata checked against key now, its header, "
     "binding, hash and copy to the address dst on the batch's threads, GIL released."},
    {"finish", (PyCFunction)batch_finish, METH_NOARGS,
     "finish() -> bytes: every job done (this thread helps), the threads joined; each block's verdict "
     "in add order (0: verified and copied to its dst)."},
    {"abandon", (PyCFunction)batch_abandon, METH_NOARGS,
     "abandon() -> None: the threads stopped after their current job and joined; verdicts are lost."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "storage.codec._block_batch.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Batch(n, nbytes, dtype_code, shape, strict, threads): up to n stored blocks of nbytes each, "
              "checked and copied on up to `threads` threads as they are added.",
    .tp_new = batch_new,
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_methods = batch_methods,
};

static PyObject *xxh3(PyObject *self, PyObject *args) {
    Py_buffer v;
    int baseline = 0;
    if (!PyArg_ParseTuple(args, "y*|p", &v, &baseline))
        return NULL;
    XXH3_state_t state;              /* the very path a block's data takes: streamed, in CHUNKs */
    XXH3_64bits_reset(&state);
    for (Py_ssize_t at = 0; at < v.len; at += CHUNK)
        hash_update(&state, (const uint8_t *)v.buf + at, (size_t)(v.len - at < CHUNK ? v.len - at : CHUNK), baseline);
    XXH64_hash_t h = XXH3_64bits_digest(&state);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLongLong(h);
}

static const char *crc_kind = "table";

/* load(isal_path) -> (zstd, crc): libzstd and the fastest crc32 found (zstd_planes.h), once. */
static PyObject *load(PyObject *self, PyObject *args) {
    const char *isal_path = NULL;
    if (!PyArg_ParseTuple(args, "|z", &isal_path))
        return NULL;
    if (!zstd.ok)
        crc_kind = zstd_load(isal_path);
    return Py_BuildValue("(Os)", zstd.ok ? Py_True : Py_False, crc_kind);
}

static PyObject *kernel(PyObject *self, PyObject *unused) {
#ifdef RAW_AVX2
    return PyUnicode_FromString(has_avx2 ? "avx2" : "sse2");
#else
    return PyUnicode_FromString("baseline");
#endif
}

static PyMethodDef methods[] = {
    {"xxh3", xxh3, METH_VARARGS, "xxh3(buffer, baseline=False) -> int: the vendored xxh3_64 (seed 0) as a block's "
     "data is hashed; baseline: with the baseline kernel even where AVX2's is used."},
    {"load", load, METH_VARARGS, "load(isal_path=None) -> (zstd_loaded, crc32_kind): libzstd.so.1 and a crc32 "
     "(ISA-L's from the isal module at isal_path, else zlib's, else a table) loaded for zstd-planes blocks."},
    {"kernel", kernel, METH_NOARGS, "kernel() -> str: the xxh3 kernel in use (avx2, sse2 or baseline)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_batch", NULL, -1, methods};

PyMODINIT_FUNC PyInit__block_batch(void) {
    crc_init();
#ifdef RAW_AVX2
    __builtin_cpu_init();
    has_avx2 = __builtin_cpu_supports("avx2");
#endif
    if (PyType_Ready(&BatchType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BatchType);
    if (PyModule_AddObject(m, "Batch", (PyObject *)&BatchType) < 0) {
        Py_DECREF(&BatchType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
