/* storage/disk/lock_pages.py's store: every page of a shared map made writable in this process by
 * a store from user space that changes nothing, with the GIL released.
 *
 * Knows: how to take the kernel's write fault on a page without changing a byte -- a compare-and-
 * swap of a 4-byte word with the value it holds (retried until it lands; any store LMDB makes to
 * the word meanwhile is kept, since the swap only succeeds on the value it read) -- and that it
 * must be a real store from user space: madvise(MADV_POPULATE_WRITE) takes the same fault but
 * holds the process's mmap lock while a frozen filesystem keeps it waiting, and then every
 * mmap/munmap of the process (a malloc holding the GIL) waits too (seen: the event loop in `D` state
 * in vm_mmap_pgoff). A store's fault holds only its map's lock (Linux 6.7+: page_mkwrite under the
 * per-VMA lock).
 * Doesn't know: LMDB, which map it is, or when to touch (lock_pages.py: a thread of its own, so the
 * wait for a frozen filesystem holds that thread and nothing else).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <unistd.h>

static uintptr_t page_size = 4096;

static PyObject *py_touch(PyObject *self, PyObject *args) {
    unsigned long long addr, length;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK", &addr, &length))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (uintptr_t p = (uintptr_t)addr & ~(page_size - 1); p < (uintptr_t)(addr + length); p += page_size) {
        uint32_t *word = (uint32_t *)p;
        uint32_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
        while (!__atomic_compare_exchange_n(word, &seen, seen, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            ;    /* `seen` now holds the word's value: swap that in */
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"touch", py_touch, METH_VARARGS, "touch(addr, length): every page of the range written (nothing changed), GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "storage.disk._lock_touch",
    "Pages of a shared map made writable by a store that changes nothing (see storage/disk/lock_pages.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__lock_touch(void) {
    long ps = sysconf(_SC_PAGESIZE);
    if (ps > 0)
        page_size = (uintptr_t)ps;
    return PyModule_Create(&module);
}
