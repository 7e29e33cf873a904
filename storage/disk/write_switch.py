"""The disk tier's writes turned off while its directory cannot be written, and back on (issue 41).

Knows: when a write failure means the filesystem takes no writes at all -- read-only (remounted
so after an error, an aborted ext4), EIO, a vanished or unwritable directory: `stops_writes` --
and what the tier does then: a smaller cache (it still serves what it holds, it writes nothing:
puts are refused and counted, not queued, encoded and dropped batch by batch), one log line when
the writes stop and one when they come back, and the probe that brings them back: every PROBE_S
a small file made and removed in the directory, then one transaction committed (the writer's)
before it takes blocks again.
Doesn't know: LMDB or the writer's batches (storage/disk/writer.py turns the switch and probes).

Threads: the writer's thread turns it off and on and probes; `off` (a str or None) is read by any
thread (a put, stats) without a lock.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from typing import Callable

log = logging.getLogger(__name__)

PROBE_S = 5.0           # how often a tier whose writes are off tries its directory again
PROBE_FILE = ".tieredkv-write-probe"
_STOPS = (errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.ESTALE)
_STOP_WORDS = ("Read-only file system", "Input/output error", "Permission denied", "No such file or directory",
               "Stale file handle")


def stops_writes(e: BaseException) -> bool:
    """Whether a failed write means the directory takes no writes now (not a full disk, not
    damage: storage/disk/verdicts.py decides those first)."""
    if isinstance(e, OSError) and e.errno in _STOPS:
        return True
    return any(words in str(e) for words in _STOP_WORDS)


def unwritable(path: str) -> OSError | None:
    """Why nothing can be written in the directory now (a probe file made and removed), or None.
    NOTE: the only true test -- an aborted ext4 still says "rw" to statvfs and access(). A full
    filesystem (ENOSPC) is not this: it is written again once the store has made room."""
    name = os.path.join(path, f"{PROBE_FILE}-{os.getpid()}")    # processes may share the directory
    try:
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        os.unlink(name)
    except OSError as e:
        return e if stops_writes(e) else None
    return None


class WriteSwitch:
    def __init__(self, path: str) -> None:
        self.path = path
        self.off: str | None = None        # why the writes are off; None: on
        self.since: float | None = None    # wall time they went off
        self._probe_at = 0.0               # writer thread: monotonic time of the next probe

    def turn_off(self, e: BaseException, dropped: int) -> None:
        if self.off is None:
            log.warning("disk tier %s: writes off (%s: %s): a smaller cache -- it serves what it holds and writes "
                        "nothing (%d blocks dropped) until its directory can be written again (tried every %.0f s)",
                        self.path, type(e).__name__, e, dropped, PROBE_S)
            self.since = time.time()
        self.off = f"{type(e).__name__}: {e}"
        self._probe_at = time.monotonic() + PROBE_S

    def turn_on(self) -> None:
        log.warning("disk tier %s: its directory can be written again; writes on", self.path)
        self.off, self.since = None, None

    def due(self) -> bool:
        return self.off is not None and time.monotonic() >= self._probe_at

    def wait(self) -> float | None:
        """Seconds until the next probe while off (None: on)."""
        return None if self.off is None else max(0.0, self._probe_at - time.monotonic())

    def try_on(self, resume: Callable[[], object]) -> bool:
        """The probe: once a file can be made and removed in the directory (`unwritable`),
        `resume()` (the store's own write, committed and fsynced); both done, the writes are on.
        Else the next try in PROBE_S."""
        try:
            why = unwritable(self.path)
            if why is not None:
                raise why
            resume()
        except Exception as e:          # noqa: BLE001 -- still off
            log.debug("disk tier %s: still no writes: %s", self.path, e)
            self._probe_at = time.monotonic() + PROBE_S
            return False
        self.turn_on()
        return True
