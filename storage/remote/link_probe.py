"""The link to the store, measured at start: so the remote tier's first restore rate is the link's.

Knows: one probe of the real store through the tier's own client and breaker -- round trips
(PING, the median of a few) and a block-sized read: a value of one block (random bytes, encoded
by the tier's codec and framed as any block) written under a reserved key, read back through the
read path's own pieces (the MGET reader into the tier's receive buffers, then verification and
decode), and deleted. The reserved key is a block key in a namespace no model derives (the
sha256 of a fixed label), so nothing but this probe reads or writes it, and it carries a TTL
(a process killed mid-probe leaves nothing behind for long).
Doesn't know: what the figures are for (storage/restore_rates.py keeps them). Counts no hit,
miss or write in the tier's counters; a failed call counts as any failure (errors, the breaker).

Runs on the caller's thread; every call is bounded by the tier's timeout. The engine runs it
off its own thread at start (engine/calibration.py).
"""
from __future__ import annotations

import hashlib
import os
import statistics
import time
from dataclasses import dataclass

import torch

from storage.codec.stored_block import payload_binding
from storage.hashing import BlockKey
from storage.remote.client import mget_one
from storage.remote.value import pack_value, remote_key

PROBE_NAMESPACE = hashlib.sha256(b"tieredkv link probe").digest()
PINGS = 3
TTL_MS = 60_000


@dataclass(frozen=True, slots=True)
class LinkFigures:
    """What the probe measured: a round trip, and a block read (value bytes, raw bytes, seconds)."""
    rtt_s: float
    read_s: float
    value_bytes: int
    block_bytes: int

    @property
    def bytes_per_s(self) -> float:
        """The bandwidth term: the read's time past one round trip."""
        return self.block_bytes / max(self.read_s - self.rtt_s, 1e-7)

    def points(self) -> list[tuple[float, float]]:
        """(bytes restored, seconds) for the fit: an empty restore costs a round trip."""
        return [(0.0, self.rtt_s), (float(self.block_bytes), self.read_s)]


def probe_link(tier) -> LinkFigures | None:
    """Measure `tier`'s (storage/remote/tier.RemoteTier) link; None when the store did not answer
    every step (down, breaker open, refused) or the tier has no layout."""
    layout = tier.layout
    if layout is None:
        return None
    rtts = []
    for _ in range(PINGS):
        t0 = time.perf_counter()
        status, _ = tier._call("ping", lambda c: c.ping())
        if status != "ok":
            return None
        rtts.append(time.perf_counter() - t0)
    block = torch.randn(layout.shape).to(layout.dtype)
    h = os.urandom(32)
    key = BlockKey(hash=h, parent=b"\0" * 32, token_ids=(0,) * layout.block_size, namespace=PROBE_NAMESPACE)
    rk = remote_key(key)
    value = pack_value(key, tier.codec.encode_parts(block, payload_binding(key.hash, key.namespace)), layout.nbytes,
                       tier.secret)
    status, _ = tier._call("set", lambda c: c.set(rk, value, px=TTL_MS))
    if status != "ok":
        return None
    try:
        out = torch.empty(layout.shape, dtype=layout.dtype)
        t0 = time.perf_counter()
        status, got = tier._call("get", lambda c: mget_one(c, [rk], tier._recv.take))
        if status != "ok" or not got or got[0] is None:
            return None
        tensor, reason, _, _ = tier._check(key, out, got[0])     # verify + decode; gives the buffer back
        read_s = time.perf_counter() - t0
        if tensor is None or not torch.equal(out.view(torch.uint8), block.view(torch.uint8)):
            return None
    finally:
        tier._call("delete", lambda c: c.unlink(rk))
    return LinkFigures(statistics.median(rtts), read_s, len(value), layout.nbytes)
