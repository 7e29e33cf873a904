"""Where bills go when the ledger cannot take them: the reserve (a journal) and spill files.

Knows: billing/reserve.bin -- space written once (zeros, fsynced) while the filesystem has room,
so that on a full filesystem the bills the ledger cannot commit still land somewhere durable:
in the reserve's own blocks, written in place (a write into blocks a file already holds needs no
new space on tmpfs, ext4 or xfs). Its format: JSON lines {"request_id", "record"} from offset 0,
ended by a NUL byte; a NUL at offset 0 is an empty journal. A bill is written there (pwrite +
fdatasync) before its request is answered, so a kill -9, a full disk at shutdown or both lose
nothing; the next open of the ledger commits what it finds (idempotent: request ids). The
reserve's size is what it really is on disk (`Reserve.size`; 0 when it could not be made, and
`Reserve.error` says why), never the size asked for.
Also the spill files (unwritten-*.jsonl): written at close for bills held in memory only (there
was no reserve, it was full, or it could not be written); read back the same way. `spill` puts
them wherever something can be written: the reserve, a file beside the ledger, else a file in
the fallback directory (`fallback_dir`: $TIEREDKV_BILLING_SPILL_DIR, or ~/.local/state/tieredkv/
unwritten, under a digest of the ledger's path), which the ledger's open reads too.
Doesn't know: LMDB, prices or the writer's policy. Rows are (request_id, record) as bytes;
engine/billing.py makes ledger entries of them.

Threads: a Reserve is used by one thread (the billing writer's) after its constructor; other
threads only read its ints (size, used) for status.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from datetime import datetime, timezone

from storage.disk.environment import free_bytes

log = logging.getLogger("tieredkv.billing")

RESERVE_FILE = "reserve.bin"
SPILL_PREFIX = "unwritten-"       # bills a closing process held in memory only
# 16 MiB holds some 50,000 bills' lines. On a smaller filesystem the reserve takes at most a
# quarter of the free space, and not less than MIN_RESERVE_BYTES (else there is none).
DEFAULT_RESERVE_BYTES = 16 << 20
MIN_RESERVE_BYTES = 64 << 10
_CHUNK = 1 << 20

Row = tuple[bytes, bytes]          # (request_id, the ledger's record of it)


class ReserveFull(OSError):
    """The reserve has no room for these bills (or there is no reserve)."""


def encode(rows: list[Row]) -> bytes:
    """The journal's lines for these rows (what they take in the reserve)."""
    return b"".join(json.dumps({"request_id": rid.decode(), "record": rec.decode()}, separators=(",", ":")).encode()
                    + b"\n" for rid, rec in rows)


def _decode(data: bytes, where: str) -> list[Row]:
    rows = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((row["request_id"].encode(), row["record"].encode()))
        except (ValueError, KeyError, TypeError, AttributeError):
            # A torn write: its request was never answered (a bill is answered after its fsync).
            log.warning("billing: skipping an unreadable line in %s (%d bytes)", where, len(line))
    return rows


def _journal(data: bytes) -> bytes:
    end = data.find(b"\0")
    return data if end < 0 else data[:end]


def fallback_dir(path: str) -> str:
    """Where bills go at close when nothing beside the ledger at `path` can be written: a folder
    of its own per ledger (a digest of its absolute path), read by that ledger's open."""
    root = os.environ.get("TIEREDKV_BILLING_SPILL_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state"),
        "tieredkv", "unwritten")
    return os.path.join(root, hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16])


def read_pending(path: str) -> tuple[list[Row], list[str]]:
    """The bills an earlier process wrote beside the ledger and never committed: the reserve's
    journal and every spill file (beside it and in its fallback directory). Returns the rows and
    the spill files' paths."""
    rows: list[Row] = []
    reserve = os.path.join(path, RESERVE_FILE)
    with contextlib.suppress(FileNotFoundError):
        with open(reserve, "rb") as f:
            rows += _decode(_journal(f.read()), reserve)
    files = []
    for folder in (path, fallback_dir(path)):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for name in sorted(os.listdir(folder)):
                if name.startswith(SPILL_PREFIX) and name.endswith(".jsonl"):
                    files.append(os.path.join(folder, name))
                    with open(files[-1], "rb") as f:
                        rows += _decode(f.read(), files[-1])
    return rows, files


def forget_pending(path: str, files: list[str]) -> None:
    """Once the rows read_pending returned are committed: empty the journal, delete the files."""
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(os.path.join(path, RESERVE_FILE), os.O_WRONLY)
        try:
            os.pwrite(fd, b"\0", 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)
    for name in files:
        os.unlink(name)


def spill(path: str, rows: list[Row], reserve: "Reserve | None" = None) -> str:
    """Bills held in memory, written wherever they can be (the reserve, a spill file beside the
    ledger, a spill file in the fallback directory), durably. Returns where; raises the last
    OSError when nowhere could take them."""
    if reserve is not None and reserve.ready:
        with contextlib.suppress(OSError):
            reserve.append(rows)
            return reserve.file
    try:
        return write_spill_file(path, rows)
    except OSError as e:
        log.warning("billing: a spill file beside the ledger cannot be written (%s); trying %s", e,
                    fallback_dir(path))
    folder = fallback_dir(path)
    os.makedirs(folder, exist_ok=True)
    return write_spill_file(folder, rows)


def write_spill_file(path: str, rows: list[Row]) -> str:
    """Bills held in memory only, to a new file beside the ledger (fsynced); raises OSError when
    it cannot be written. Returns its path."""
    name = os.path.join(path, f"{SPILL_PREFIX}{datetime.now(timezone.utc):%Y%m%dT%H%M%S%f}-{os.getpid()}.jsonl")
    try:
        with open(name + ".tmp", "wb") as f:
            f.write(encode(rows))
            f.flush()
            os.fsync(f.fileno())
        os.replace(name + ".tmp", name)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(name + ".tmp")
        raise
    return name


class Reserve:
    """billing/reserve.bin, open: its real size, how much of it holds bills, and the rows an
    earlier process left in it (`pending`, read at open; the ledger commits them when it opens)."""

    def __init__(self, path: str, wanted: int = DEFAULT_RESERVE_BYTES) -> None:
        self.path = path
        self.file = os.path.join(path, RESERVE_FILE)
        self.wanted = wanted
        self.size = 0                  # bytes it really has on disk (0: none)
        self.used = 0                  # bytes of journal written (the NUL that ends it is at `used`)
        self.error: str | None = None  # why there is no reserve, or a smaller one than wanted
        self.pending: list[Row] = []
        self._fd: int | None = None
        if wanted <= 0:
            return
        try:
            fd = os.open(self.file, os.O_RDWR)
        except FileNotFoundError:
            self.make()
            return
        except OSError as e:
            self.error = f"{self.file}: cannot open ({e.strerror or e})"
            return
        self._fd = fd
        self.size = os.fstat(fd).st_size
        data = os.pread(fd, self.size, 0)
        journal = _journal(data)
        self.used = len(journal)
        self.pending = _decode(journal, self.file)
        if self.size < wanted:
            self.error = f"{self.size} bytes, not the {wanted} asked for (the filesystem had less room)"

    @property
    def ready(self) -> bool:
        return self._fd is not None

    def room(self) -> int:
        """Bytes of bills it can still take (0 without a reserve)."""
        return max(0, self.size - self.used - 1) if self._fd is not None else 0

    def make(self) -> bool:
        """Make the reserve when there is none: zeros written and fsynced (real blocks, not a hole
        nor an unwritten extent), `wanted` bytes or a quarter of the free space, whichever is
        less. True when it exists."""
        if self._fd is not None or self.wanted <= 0:
            return self._fd is not None
        try:
            os.makedirs(self.path, exist_ok=True)
            free = free_bytes(self.path)
            size = min(self.wanted, free // 4) // MIN_RESERVE_BYTES * MIN_RESERVE_BYTES
            if size < MIN_RESERVE_BYTES:
                self.error = f"no room for one ({free} bytes free; it needs {4 * MIN_RESERVE_BYTES})"
                return False
            fd = os.open(self.file + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                zeros = bytes(_CHUNK)
                for off in range(0, size, _CHUNK):
                    os.pwrite(fd, zeros[:min(_CHUNK, size - off)], off)
                os.fsync(fd)
                os.replace(self.file + ".tmp", self.file)
            except BaseException:
                os.close(fd)
                raise
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(self.file + ".tmp")
            self.error = f"cannot make {self.file} ({e.strerror or e})"
            return False
        self._fd, self.size, self.used = fd, size, 0
        self.error = None if size >= self.wanted else (f"{size} bytes, not the {self.wanted} asked for (the "
                                                      "filesystem had less room)")
        return True

    def append(self, rows: list[Row]) -> None:
        """Write these bills into the reserve, durably, before their requests are answered.
        Raises ReserveFull when they do not fit, OSError when the write fails (then none of them
        count as written: a torn line is skipped at read)."""
        data = encode(rows)
        if len(data) > self.room():
            raise ReserveFull(f"the reserve has room for {self.room()} more bytes of bills, these need {len(data)}")
        os.pwrite(self._fd, data + b"\0", self.used)
        os.fdatasync(self._fd)
        self.used += len(data)

    def clear(self) -> None:
        """Every bill in it is committed (or the ledger's open read them): empty the journal."""
        if self._fd is None or self.used == 0:
            self.used = 0
            return
        os.pwrite(self._fd, b"\0", 0)
        os.fdatasync(self._fd)
        self.used = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
