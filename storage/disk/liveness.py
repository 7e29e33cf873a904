"""Whether the files an open LMDB environment maps are still the ones it opened, whole: checked
before every transaction, so no page past the end of a file that shrank is ever touched.

Knows: the store's two files as this process opened them -- data.mdb and lock.mdb, each held by a
file descriptor of its own from open, with data.mdb's (device, inode) -- and what makes touching
their maps unsafe or pointless: data.mdb unlinked (writes would go to a file nobody will open
again), shrunk (LMDB maps the file: a page past the new end is a SIGBUS on first touch, which
Python cannot catch), or its meta pages no longer sound (garbage, zeroes: LMDB would adopt an absurd
map size or invalidate every transaction); lock.mdb unlinked or shrunk (LMDB's reader table lives
in a map of it: the same SIGBUS).

"Shrunk" is against the largest size this process saw: LMDB never shrinks data.mdb (it only grows
it, writing pages before the meta page that names them), and the size at open was checked against
the newest meta page's last page (storage/disk/preflight.py). Not against that last page while
serving: a commit landing between the check's fstat and its read of the meta pages names pages the
fstat did not see yet (seen: 2 pages short, a sound store taken for a truncated one).
Doesn't know: what the caller does about it (storage/disk/environment.py's EnvGate reports it as
damage, storage/disk/replacement.py moves the store aside and opens a fresh one).

The check is an fstat of each file and one pread of the two meta pages (never through the map):
about 7 us on this shared 2-core machine (measured under load), against a get of one block's
~280 us; a get_many of many blocks pays it once.

NOTE the window this check cannot close (issue 28): a truncate that lands after the check and before
the transaction's last touch of a page past the new end. LMDB maps the file and another process may
truncate it at any instant, so no check before a transaction covers it: storage/disk/map_faults.py
does (the touch reads zeros, the transaction's results are thrown away, the store is damage). This
check still finds almost every change first, with no fault at all.
"""
from __future__ import annotations

import os
import struct

from storage.disk.preflight import _META_BYTES, DamagedEnvironment, parse_meta

__all__ = ["FileChanged", "StoreFiles"]

# A meta page's fields this check needs, in one unpack (storage/disk/preflight.py has the layout):
# pgno @0, flags @10, magic @16, version @20, page size @40, last page @136, txnid @144.
_META = struct.Struct("<Q2xH4xII16xI92xQQ")
_MAGIC, _P_META = 0xBEEFC0DE, 0x08


class FileChanged(DamagedEnvironment):
    """The store's files changed under the open environment (unlinked, shrunk, meta pages no
    longer sound): damage, the store is replaced (storage/disk/verdicts.py)."""


def _open(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class StoreFiles:
    """The files of one open environment, held open by this process. Thread-safe: check() only
    reads (fstat, pread on descriptors nobody closes while a transaction may begin: EnvGate
    closes them with no transaction open)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._data_path = os.path.join(path, "data.mdb")
        self._data = _open(self._data_path)
        self._lock = _open(os.path.join(path, "lock.mdb"))
        self.identity: tuple[int, int] | None = None    # (device, inode) of the data.mdb opened
        self._page_size = os.sysconf("SC_PAGESIZE")
        self._lock_bytes = 0
        self._data_bytes = 0        # the largest size seen (a lower bound: updates may race, never wrongly)
        if self._data is not None:
            st = os.fstat(self._data)
            self.identity, self._data_bytes = (st.st_dev, st.st_ino), st.st_size
            meta = parse_meta(os.pread(self._data, _META_BYTES, 0), 0)
            if meta is not None:
                self._page_size = meta.page_size
        if self._lock is not None:
            self._lock_bytes = os.fstat(self._lock).st_size

    def check(self) -> None:
        """Raise FileChanged when touching the environment's maps is unsafe or pointless now."""
        if self._data is not None:
            seen = self._data_bytes         # NOTE: read before the fstat, so a sound file is never smaller
            st = os.fstat(self._data)
            if st.st_size < seen:
                raise FileChanged(f"{self._data_path} shrank while in use: {st.st_size} bytes, it had {seen}")
            if st.st_size > seen:
                self._data_bytes = st.st_size
            if st.st_nlink == 0:
                raise FileChanged(f"{self._data_path} was deleted while in use")
            if st.st_size:      # an environment never committed to has no pages to check yet
                ps = self._page_size
                raw = os.pread(self._data, ps + _META_BYTES, 0)
                if len(raw) < ps + _META_BYTES:
                    raise FileChanged(f"{self._data_path} shrank while in use: {st.st_size} bytes")
                for index, offset in ((0, 0), (1, ps)):
                    pgno, flags, magic, version, page_size, _, _ = _META.unpack_from(raw, offset)
                    if pgno != index or not flags & _P_META or magic != _MAGIC or version != 1 or page_size != ps:
                        raise FileChanged(f"{self._data_path}: its meta page {index} is no longer sound "
                                          "(overwritten while in use)")
        if self._lock is not None:
            st = os.fstat(self._lock)
            if st.st_nlink == 0 or st.st_size < self._lock_bytes:
                raise FileChanged(f"{self.path}/lock.mdb was deleted or shrank while in use")

    def replaced(self) -> bool:
        """Whether data.mdb at the path is now another file than the one opened (another process
        sharing the directory moved the store aside and started a fresh one): one stat."""
        try:
            st = os.stat(self._data_path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != self.identity

    def close(self) -> None:
        for fd in (self._data, self._lock):
            if fd is not None:
                os.close(fd)
        self._data = self._lock = None
