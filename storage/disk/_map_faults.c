/* storage/disk/map_faults.py's signal handler: a page of a watched file's shared map that the file
 * no longer backs (it was truncated under the map) reads as zeros instead of killing the process.
 *
 * Knows: which files are watched -- (major, minor, inode) as /proc/self/maps prints them, in a
 * fixed table of slots --, how many faults each absorbed, and how to absorb one: on a SIGBUS the
 * kernel raised for an address (si_code BUS_ADRERR: past the end of the file; BUS_MCEERR_AR: a
 * poisoned page), the handler reads /proc/self/maps to find the mapping that holds the address;
 * when that mapping is of a watched file, it counts the fault and maps anonymous zero pages
 * (MAP_FIXED, the mapping's own protection) from the faulting page to the mapping's end, and
 * returns: the faulting instruction runs again and reads zeros. Nothing is unwound: no longjmp
 * through LMDB or the interpreter, no lock taken, no memory allocated -- the handler makes only
 * open/read/close/mmap syscalls and atomic increments, on the faulting thread's own stack.
 * Doesn't know: LMDB, what the zeros mean, or what is done about them: map_faults.py's watchers
 * see the count move and the disk tier takes the store as damaged (storage/disk/gate.py) -- the
 * zeros are never served (payload checksums), and the store is moved aside.
 *
 * Any other SIGBUS (another file's map, a kill(2), no mapping found, a mapping that cannot be
 * replaced) is passed on: the handler that was there before is put back and the signal delivered
 * to it again (the faulting instruction re-runs; a sent signal is raised again), so a real crash
 * still dumps its stacks (faulthandler) and ends the process as before.
 *
 * Why /proc/self/maps and not a table of address ranges: the kernel's own list of mappings, read
 * at the fault, is never stale -- an LMDB map that was unmapped (a close, a resize) and whose
 * addresses now hold something else can never be mistaken for a watched one.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SLOTS 64

typedef struct {
    _Atomic unsigned long major, minor, ino;
    _Atomic long refs;               /* > 0: watched */
    _Atomic unsigned long faults;    /* faults absorbed in this slot's file's maps, ever */
} Slot;

static Slot slots[SLOTS];
static struct sigaction previous;    /* the SIGBUS action before ours: what any other fault gets */
static _Atomic int installed;
static _Atomic unsigned long passed_on;
static uintptr_t page_size = 4096;

typedef struct {
    uintptr_t start, end;
    int prot, shared;
    unsigned long major, minor, ino;
} Vma;

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One line's head ("start-end perms offset major:minor inode ...") into a Vma; 0 if malformed. */
static int parse_line(const char *s, size_t n, Vma *v) {
    size_t i = 0;
    unsigned long vals[7] = {0};
    /* fields: start '-' end ' ' perms ' ' offset ' ' major ':' minor ' ' inode */
    int d;
    for (int f = 0; f < 2; f++) {
        int any = 0;
        while (i < n && (d = hex_digit(s[i])) >= 0) { vals[f] = vals[f] * 16 + d; i++; any = 1; }
        if (!any || i >= n || s[i] != (f == 0 ? '-' : ' ')) return 0;
        i++;
    }
    if (i + 5 > n) return 0;
    v->prot = (s[i] == 'r' ? PROT_READ : 0) | (s[i + 1] == 'w' ? PROT_WRITE : 0) | (s[i + 2] == 'x' ? PROT_EXEC : 0);
    v->shared = s[i + 3] == 's';
    i += 4;
    if (s[i++] != ' ') return 0;
    while (i < n && hex_digit(s[i]) >= 0) i++;            /* offset */
    if (i >= n || s[i++] != ' ') return 0;
    for (int f = 2; f < 4; f++) {
        int any = 0;
        while (i < n && (d = hex_digit(s[i])) >= 0) { vals[f] = vals[f] * 16 + d; i++; any = 1; }
        if (!any || i >= n || s[i] != (f == 2 ? ':' : ' ')) return 0;
        i++;
    }
    int any = 0;
    while (i < n && s[i] >= '0' && s[i] <= '9') { vals[4] = vals[4] * 10 + (s[i] - '0'); i++; any = 1; }
    if (!any) return 0;
    v->start = vals[0]; v->end = vals[1]; v->major = vals[2]; v->minor = vals[3]; v->ino = vals[4];
    return 1;
}

/* The mapping holding `addr`, from /proc/self/maps, with only async-signal-safe calls and no
 * allocation: read in chunks, each line's first 127 bytes kept (the fields before the path). */
static int find_vma(uintptr_t addr, Vma *out) {
    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    char chunk[1024], line[128];
    size_t len = 0;
    int found = 0;
    for (;;) {
        ssize_t got = read(fd, chunk, sizeof chunk);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        for (ssize_t k = 0; k < got && !found; k++) {
            if (chunk[k] != '\n') {
                if (len < sizeof line) line[len++] = chunk[k];
                continue;
            }
            Vma v;
            if (parse_line(line, len, &v) && v.start <= addr && addr < v.end) {
                *out = v;
                found = 1;
            }
            len = 0;
        }
        if (found) break;
    }
    close(fd);
    return found;
}

static void pass_on(int sig, siginfo_t *info) {
    /* Not ours: the previous action back, and the signal delivered to it. A fault re-runs its
     * instruction on return; a sent signal (blocked while we run) is raised again. */
    atomic_fetch_add(&passed_on, 1);
    sigaction(sig, &previous, NULL);
    atomic_store(&installed, 0);
    if (info == NULL || info->si_code <= 0)
        raise(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    int saved_errno = errno;
    if (info != NULL && (info->si_code == BUS_ADRERR
#ifdef BUS_MCEERR_AR
                         || info->si_code == BUS_MCEERR_AR
#endif
                         )) {
        uintptr_t addr = (uintptr_t)info->si_addr;
        Vma v;
        if (find_vma(addr, &v) && v.shared && v.ino != 0) {
            for (int i = 0; i < SLOTS; i++) {
                if (atomic_load(&slots[i].refs) <= 0) continue;
                if (atomic_load(&slots[i].ino) != v.ino || atomic_load(&slots[i].major) != v.major
                    || atomic_load(&slots[i].minor) != v.minor) continue;
                uintptr_t page = addr & ~(page_size - 1);
                atomic_fetch_add(&slots[i].faults, 1);      /* NOTE: before the zeros can be seen */
                void *r = mmap((void *)page, v.end - page, v.prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED
                               | MAP_NORESERVE, -1, 0);
                if (r != MAP_FAILED) {
                    errno = saved_errno;
                    return;
                }
                break;
            }
        }
    }
    pass_on(sig, info);
    errno = saved_errno;
}

static PyObject *py_install(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) {
        atomic_store(&installed, 1);
        Py_RETURN_FALSE;
    }
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO;          /* no SA_ONSTACK: our buffers want the thread's own stack */
    sigemptyset(&ours.sa_mask);
    previous = now;                      /* whoever installed a handler after us is chained to */
    if (sigaction(SIGBUS, &ours, NULL) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    atomic_store(&installed, 1);
    Py_RETURN_TRUE;
}

static PyObject *py_installed(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus);
}

/* watch(major, minor, ino) -> slot (-1: the table is full). The same file watched twice shares
 * its slot (refs counted). Called with the GIL held: watch/unwatch never race each other. */
static PyObject *py_watch(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long major, minor, ino;
    if (!PyArg_ParseTuple(args, "kkk", &major, &minor, &ino))
        return NULL;
    int free_slot = -1;
    for (int i = 0; i < SLOTS; i++) {
        if (atomic_load(&slots[i].refs) > 0) {
            if (atomic_load(&slots[i].ino) == ino && atomic_load(&slots[i].major) == major
                && atomic_load(&slots[i].minor) == minor) {
                atomic_fetch_add(&slots[i].refs, 1);
                return PyLong_FromLong(i);
            }
        } else if (free_slot < 0) {
            free_slot = i;
        }
    }
    if (free_slot >= 0) {
        Slot *s = &slots[free_slot];
        atomic_store(&s->major, major);
        atomic_store(&s->minor, minor);
        atomic_store(&s->ino, ino);
        atomic_store(&s->refs, 1);       /* NOTE: last, so the handler never sees a half-written file */
    }
    return PyLong_FromLong(free_slot);
}

static PyObject *py_unwatch(PyObject *self, PyObject *args) {
    (void)self;
    int i;
    if (!PyArg_ParseTuple(args, "i", &i))
        return NULL;
    if (i < 0 || i >= SLOTS || atomic_load(&slots[i].refs) <= 0) {
        PyErr_Format(PyExc_ValueError, "slot %d is not watched", i);
        return NULL;
    }
    atomic_fetch_sub(&slots[i].refs, 1);
    Py_RETURN_NONE;
}

static PyObject *py_faults(PyObject *self, PyObject *args) {
    (void)self;
    int i;
    if (!PyArg_ParseTuple(args, "i", &i))
        return NULL;
    if (i < 0 || i >= SLOTS) {
        PyErr_Format(PyExc_ValueError, "no slot %d", i);
        return NULL;
    }
    return PyLong_FromUnsignedLong(atomic_load(&slots[i].faults));
}

static PyObject *py_absorbed(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    unsigned long n = 0;
    for (int i = 0; i < SLOTS; i++)
        n += atomic_load(&slots[i].faults);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *py_passed_on(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    return PyLong_FromUnsignedLong(atomic_load(&passed_on));
}

static PyMethodDef methods[] = {
    {"install", py_install, METH_NOARGS, "Install the handler (again, if another replaced it). True if it was not."},
    {"installed", py_installed, METH_NOARGS, "Whether the SIGBUS action now is ours."},
    {"watch", py_watch, METH_VARARGS, "watch(major, minor, inode) -> slot, or -1 when the table is full."},
    {"unwatch", py_unwatch, METH_VARARGS, "unwatch(slot): one watch fewer."},
    {"faults", py_faults, METH_VARARGS, "faults(slot): faults absorbed in the slot's file's maps, ever."},
    {"absorbed", py_absorbed, METH_NOARGS, "Faults absorbed in this process, every slot together."},
    {"passed_on", py_passed_on, METH_NOARGS, "SIGBUS signals passed on to the previous action."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "storage.disk._map_faults",
    "SIGBUS in a watched file's map absorbed as zero pages (see storage/disk/map_faults.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__map_faults(void) {
    long ps = sysconf(_SC_PAGESIZE);
    if (ps > 0)
        page_size = (uintptr_t)ps;
    return PyModule_Create(&module);
}
