"""An encode process child that misbehaves on purpose (tests/storage/test_encode_process.py):
storage/codec/encode_worker.py with one thing wrong, chosen by $LYING_ENCODE_WORKER --

    header   a byte of every payload's header flipped after it was written
    binding  every block encoded under another binding of the same length
    digest   the input's xxh3 reported wrong
    length   every payload's length reported one byte short
    outside  every payload reported at offset 0 (the batch's input region)
    malformed  every answer's offset reported as None (not an int)
    stall    on its first batch: $LYING_MARKER written (its pid), then asleep until killed;
             a child that finds the marker there already behaves (a restart after the kill)

Imports no torch, as the real one.
"""
from __future__ import annotations

import os
import sys
import time

from storage.codec import encode_worker

MODE = os.environ.get("LYING_ENCODE_WORKER", "")
_real_encode = encode_worker._Batch.encode
_real_read = encode_worker.read_message


def _encode(self, j: int) -> None:
    if MODE == "binding":
        in_at, nbytes, dtype, shape, binding = self.jobs[j]
        self.jobs[j] = (in_at, nbytes, dtype, shape, bytes(b ^ 1 for b in binding))
    _real_encode(self, j)
    at, length, digest = self.results[j]
    if at < 0:
        return
    if MODE == "header":
        self.arena[at + 5] ^= 0x10
    elif MODE == "digest":
        digest ^= 1
    elif MODE == "length":
        length -= 1
    elif MODE == "outside":
        at = 0
    elif MODE == "malformed":
        at = None
    self.results[j] = (at, length, digest)


def _read(fd: int):
    req = _real_read(fd)
    marker = os.environ.get("LYING_MARKER", "")
    if MODE == "stall" and req is not None and marker and not os.path.exists(marker):
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(marker + ".tmp", marker)
        while True:
            time.sleep(60)
    return req


encode_worker._Batch.encode = _encode
encode_worker.read_message = _read

if __name__ == "__main__":
    encode_worker.main(sys.argv[1:])
