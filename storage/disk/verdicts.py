"""What an error from LMDB or the filesystem says about the disk tier's store: damaged (move it
aside, start a fresh one), full (a smaller cache, or none), or not writable (no tier at all).

Knows: LMDB's error classes and messages, errno values, and the filesystem's free space.
Doesn't know: what the tier does with a verdict (storage/disk/environment.py's EnvGate reports
damage, storage/disk/replacement.py replaces the store, the writer evicts when full).

NOTE invariant (issues 17 and 28): every error that means "this environment is unusable" is
damage, a verdict on the store -- never a loop, a dead tier or a dead process. That includes what
LMDB says when the file changed under it while serving: garbage meta pages make it adopt an
absurd map size (lmdb.MemoryError from mdb_env_set_mapsize), zeroed meta pages make every
transaction MDB_BAD_TXN, and an environment py-lmdb gave up on answers "Attempt to operate on
closed/deleted/dropped object".
"""
from __future__ import annotations

import errno
import os

import lmdb

from storage.disk.preflight import DamagedEnvironment

__all__ = ["DAMAGE_ERRORS", "LOW_SPACE_BYTES", "free_bytes", "is_damage", "is_no_space", "is_unwritable"]

# Below this much free space, an EIO at commit is taken as "disk full".
LOW_SPACE_BYTES = 1 << 20

# The errors that mean the store itself is damaged: LMDB's MDB_CORRUPTED, MDB_PAGE_NOTFOUND,
# MDB_PANIC (the environment had a fatal error and must be reopened), MDB_INVALID, MDB_INCOMPATIBLE
# (our databases never change their flags: a node flag flipped says "dup-sorted" -- fault drill),
# MDB_BAD_TXN (a transaction LMDB invalidated: zeroed meta pages), MDB_BAD_DBI (a database handle
# the file no longer has), MDB_BAD_RSLOT, MDB_VERSION_MISMATCH, MDB_PROBLEM, ENOMEM from
# mdb_env_set_mapsize (a meta page claiming an absurd map size), and ours.
DAMAGE_ERRORS: tuple[type[BaseException], ...] = (
    lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError, lmdb.IncompatibleError,
    lmdb.BadTxnError, lmdb.BadDbiError, lmdb.BadRslotError, lmdb.VersionMismatchError, lmdb.ProblemError,
    lmdb.MemoryError, DamagedEnvironment)

# py-lmdb's words for an environment (or a handle in it) it invalidated: nothing in it works again.
_DEAD_OBJECT = "closed/deleted/dropped object"


def is_damage(e: BaseException) -> bool:
    return isinstance(e, DAMAGE_ERRORS) or (type(e) is lmdb.Error and _DEAD_OBJECT in str(e))


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (or its
    nearest existing parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def is_no_space(e: BaseException, path: str) -> bool:
    """Whether an error means the filesystem (or the map) is full. lmdb.DiskError is LMDB's
    ENOSPC; an OSError may carry it too. A full filesystem can also show up as EIO from a short
    write at commit: then the filesystem's free space decides."""
    if isinstance(e, (lmdb.MapFullError, lmdb.DiskError)) or getattr(e, "errno", None) == errno.ENOSPC:
        return True
    if isinstance(e, (lmdb.Error, OSError)) and ("Input/output error" in str(e) or "No space" in str(e)):
        try:
            return free_bytes(path) < LOW_SPACE_BYTES
        except OSError:
            return False
    return False


_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def is_unwritable(e: BaseException) -> bool:
    """Whether an error means the directory cannot be written at all (a read-only filesystem,
    permissions): no tier, never damage -- the store there is not moved aside."""
    if getattr(e, "errno", None) in _UNWRITABLE or isinstance(e, lmdb.ReadonlyError):
        return True
    return isinstance(e, lmdb.Error) and ("Read-only file system" in str(e) or "Permission denied" in str(e))
