"""A disk tier whose directory others can write: its payloads sealed under the fleet secret.

Knows: when a cache directory is shared -- group or others may write it, or another user owns it
(then anyone who can write it can write LMDB records we would serve) --, the sealed record
(`key id (8) | seal (32) | codec payload`, the seal the fleet secret's keyed BLAKE3 of the block's
hash || namespace and the payload: storage/fleet_secret.py), and how one is opened: the payload
(a view, never a copy) when the seal holds, else why not. A store that was written unsealed, or
sealed under another secret, reads as misses record by record (each deleted as damaged), never
as KV.
Doesn't know: LMDB, the writer or the reads (storage/disk/writer.py seals at commit,
storage/disk/reads.py opens before it decodes), or the codec inside the payload.

Cost: a keyed BLAKE3 pass over every payload written and read (~2.3 GB/s a core here), which is
why a directory only this user can write is not sealed: there, whoever could forge a record could
as well rewrite our code.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from storage.fleet_secret import FOREIGN, SEAL_SIZE, FleetSecret   # SEAL_SIZE: bytes before a record's payload


def shared_directory(path: str) -> str | None:
    """Why the directory at `path` is shared -- others can write records into it -- or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None                    # not there yet: made 0700 by the tier
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this process's {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "others" if st.st_mode & stat.S_IWOTH else "its group"
        return f"mode {stat.S_IMODE(st.st_mode):04o} lets {who} write it"
    return None


@dataclass(frozen=True, slots=True)
class DiskSeal:
    """Seals and opens one store's records. Immutable: any thread."""
    secret: FleetSecret

    def record(self, block_hash: bytes, namespace: bytes, payload: bytes | memoryview) -> bytes:
        """The stored record: the seal's head, then the payload."""
        return b"".join((self.secret.head(block_hash + namespace, (payload,)), payload))

    def open(self, block_hash: bytes, namespace: bytes, stored: bytes | memoryview
             ) -> tuple[memoryview | None, str | None]:
        """(payload view, None) when the record's seal holds for this block, else (None, why)."""
        mv = memoryview(stored)
        if len(mv) < SEAL_SIZE:
            return None, "sealed record too short"
        payload, problem = self.secret.open(block_hash + namespace, mv)
        if problem == FOREIGN:      # here, not another fleet's to leave alone: a record we cannot vouch for
            return None, "record not sealed under this fleet secret (written unsealed, or under another secret)"
        return payload, problem


def settle(path: str, seal: DiskSeal | None, begin, dbs, readonly: bool) -> None:
    """At open: a shared directory is refused unless sealed, and a store sealed before is refused
    without its secret (DiskUnavailable: the server runs without its disk tier, and says why).
    A writable store opened sealed records the secret's key id (`tieredkv verify` then asks for
    it). `begin`: the tier's transactions; `dbs()`: its handles."""
    from storage.disk.environment import DiskUnavailable
    from storage.disk.records import load_sealed, store_sealed
    if seal is None and not readonly:
        why = shared_directory(path)
        if why is not None:
            raise DiskUnavailable(f"disk tier {path}: the directory is shared ({why}): whoever can write it could "
                                  f"write blocks this server would serve. `chmod 700` it, or seal its blocks under the "
                                  f"fleet secret (seal_disk=True; serve --seal-disk)")
    with begin() as txn:
        sealed = load_sealed(txn, dbs())
    if seal is None:
        if sealed is not None and not readonly:
            raise DiskUnavailable(f"disk tier {path}: its blocks are sealed under a fleet secret; open it sealed "
                                  f"(seal_disk=True; serve --seal-disk, with that secret's --cache-secret-file)")
        return
    if sealed != seal.secret.key_id and not readonly:
        with begin(write=True) as txn:
            store_sealed(txn, dbs(), seal.secret.key_id)


def verifiable(path: str, seal: DiskSeal | None, begin, dbs) -> None:
    """Before a verify: a sealed store is checked only under its secret -- without it every record
    would read as damaged and a repair would delete them all (ValueError)."""
    from storage.disk.records import load_sealed
    with begin() as txn:
        sealed = load_sealed(txn, dbs())
    if sealed is not None and (seal is None or seal.secret.key_id != sealed):
        raise ValueError(f"disk tier {path}: its blocks are sealed under a fleet secret"
                         f"{'' if seal is None else ' other than the one given'}: verify with that secret "
                         f"(tieredkv verify --cache-secret-file FILE)")
