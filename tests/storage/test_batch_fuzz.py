"""Forged and damaged blocks of every codec, drawn at random, get the same verdict from the compiled
batch (storage/codec/block_batch.py, _block_batch.c, block_checks.h, zstd_planes.h, nibble_kernel.h)
as from the Python path (verify_and_decode), never an exception, and a served block is the block
that was stored wherever its hash was not re-made by the forger.

The mutations land past the outer checks -- the header crc32, the coded crc32 and the nibble codec's
xxh3 are re-made after the edit, as a writer with this code and no secret could -- so the parsers of
the plane table, the zstd frames, the raw-block frames and the nibble stream run on hostile bytes.
tools/fuzz_batch_asan.sh runs the same cases, many more of them, against a build of the compiled
batch under AddressSanitizer and UBSan (a read past a buffer is a crash there, a wrong verdict here).
FUZZ_SEEDS and FUZZ_CASES widen a run (the suite's: 3 seeds of 60 cases).
"""
from __future__ import annotations

import os
import random
import struct
import zlib

import pytest
import torch

from storage.codec import block_batch
from storage.codec.payload import Codec
from storage.codec.stored_block import verify_and_decode
from tests.storage.test_nibble import forge
from tests.storage.test_nibble_batch import kv_block, record as coded_record, resized
from tests.storage.test_raw_batch import Record, layout_of
from tests.storage.test_zstd_batch import frames_of, rebuilt, record as zstd_record

SEEDS = [int(s) for s in os.environ.get("FUZZ_SEEDS", "1,2,3").split(",")]
CASES = int(os.environ.get("FUZZ_CASES", "60"))
SHAPES = [(2, 2, 16, 3, 8), (8, 2, 16, 8, 128), (3, 2, 16, 1, 5)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ANY = Codec()            # a tier reads every codec it ever wrote, whatever it writes now


def mutate(rng: random.Random, data: bytes) -> bytes:
    """A few edits: bit flips, bytes set, truncation, bytes appended, garbage spliced, a 32-bit field set."""
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3, 8])):
        op = rng.randrange(6)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2 and b:
            del b[rng.randrange(len(b)):]
        elif op == 3:
            b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        elif op == 4 and len(b) > 8:
            at, n = rng.randrange(len(b)), rng.randrange(1, 32)
            b[at:at + n] = rng.randbytes(n)
        elif op == 5 and len(b) > 4:
            value = rng.choice([0, 1, 0xFFFF, 0xFFFFFFFF, rng.randrange(1 << 32)])
            struct.pack_into("<I", b, rng.randrange(len(b) - 4), value)
    return bytes(b)


def header_forged(rng: random.Random, payload: bytes) -> bytes:
    """The header's fields edited under a re-made header crc32."""
    size = ANY.check_header(payload).header_size
    head = mutate(rng, payload[:size - 4])[:size - 4].ljust(size - 4, b"\0")
    return head + struct.pack("<I", zlib.crc32(head)) + payload[size:]


def forged_case(rng: random.Random, i: int) -> tuple[Record, torch.Tensor | None, str]:
    """A forged record, the block it was made from when a served block must still be that block
    (its hashes were not re-made), and what was forged."""
    dtype, shape = rng.choice(DTYPES), rng.choice(SHAPES)
    kind = rng.choice(["zstd frames", "zstd frames", "nibble stream", "raw bytes", "header"])
    if kind == "zstd frames":        # the coded crc32 re-made; each frame's own checksum kept
        r = zstd_record(i, dtype, shape)
        frames, coded = frames_of(r.payload)
        k = rng.randrange(len(frames))
        frames[k] = mutate(rng, frames[k])
        if rng.random() < 0.2:
            coded = [rng.random() < 0.5 for _ in coded]
        return resized(r, rebuilt(r.payload, frames, coded)), kv_block(i, dtype, shape), kind
    if kind == "nibble stream":      # the data xxh3 re-made: a served block may differ
        r = coded_record(i, dtype, Codec(kind="nibble"), shape)
        h = ANY.check_header(r.payload)
        data = mutate(rng, r.payload[h.header_size:])
        last = h.planes[-1].length + len(data) - (len(r.payload) - h.header_size)
        last = max(0, last) if rng.random() < 0.8 else rng.randrange(1 << 20)
        return resized(r, forge(r.payload, data, last)), None, kind
    if kind == "raw bytes":          # nothing re-made
        r = coded_record(i, dtype, Codec(kind="raw"), shape)
        return resized(r, mutate(rng, r.payload)), kv_block(i, dtype, shape), kind
    codec = rng.choice(["zstd", "nibble", "raw"])
    r = zstd_record(i, dtype, shape) if codec == "zstd" else coded_record(i, dtype, Codec(kind=codec), shape)
    return resized(r, header_forged(rng, r.payload)), None, f"{codec} header"


def decided_alike(layout, r: Record, stored: torch.Tensor | None, what: str) -> bool:
    """Both paths' verdicts on r, on 1 and 2 threads; True when served."""
    py_tensor, py_reason = verify_and_decode(ANY, layout, r.key, None, r.payload, r.meta)
    if py_tensor is not None and stored is not None:
        assert torch.equal(py_tensor.view(torch.uint8), stored.view(torch.uint8)), f"{what}: another block served"
    for threads in (1, 2):
        verdicts = block_batch.verify_batch(layout, [r.key] * 2, [None] * 2, [r.payload] * 2, [r.meta] * 2, threads)
        for verdict in verdicts:
            if verdict is None:
                continue              # left to verify_and_decode: its verdict by construction
            tensor, reason = verdict
            assert (tensor is None) == (py_tensor is None), (what, reason, py_reason)
            if tensor is not None:
                assert torch.equal(tensor.view(torch.uint8), py_tensor.view(torch.uint8)), what
    return py_tensor is not None


@pytest.fixture(autouse=True)
def compiled() -> None:
    assert block_batch.AVAILABLE and block_batch.ZSTD, "storage/codec/_block_batch.c not built or libzstd.so.1 missing"


@pytest.mark.parametrize("seed", SEEDS)
def test_forged_blocks_get_the_same_verdict_on_both_paths(seed: int) -> None:
    rng = random.Random(seed)
    refused = 0
    for i in range(CASES):
        r, stored, what = forged_case(rng, i % 7)
        dtype, shape = (stored.dtype, tuple(stored.shape)) if stored is not None else (None, None)
        layout = layout_of(dtype, shape) if stored is not None and rng.random() < 0.7 else None
        refused += not decided_alike(layout, r, stored, f"case {i}: {what}")
    assert refused > CASES // 2           # the forgeries reached the checks (most are refused)


def test_a_header_of_no_elements_is_a_verdict_not_an_exception_without_a_layout() -> None:
    """Found by the fuzz above: a raw block's header forged to a dim of 0, a raw size of 0 and a
    table entry of 0 bytes under a re-made header crc32. Without a layout the batch sized itself by
    the first header, made an empty destination and raised on its null address (a ValueError out of
    get_many: `tieredkv verify` crashed); that header is now verify_and_decode's, a miss."""
    r = coded_record(0, torch.bfloat16, Codec(kind="raw"))
    size = ANY.check_header(r.payload).header_size
    head = bytearray(r.payload[:size - 4])
    ndim = head[8]
    struct.pack_into("<I", head, 9, 0)                          # dims[0] = 0
    struct.pack_into("<Q", head, 9 + 4 * ndim, 0)               # a raw size that agrees
    struct.pack_into("<I", head, size - 4 - 8 - 4, 0)           # and the one table entry's length
    forged = resized(r, bytes(head) + struct.pack("<I", zlib.crc32(bytes(head))) + r.payload[size:])
    good = coded_record(1, torch.bfloat16, Codec(kind="raw"))
    verdicts = block_batch.verify_batch(None, [forged.key, good.key], [None, None], [forged.payload, good.payload],
                                        [forged.meta, good.meta], 2)
    py_tensor, py_reason = verify_and_decode(ANY, None, forged.key, None, forged.payload, forged.meta)
    assert py_tensor is None and py_reason
    assert verdicts[0] is None or verdicts[0][0] is None
    served = verdicts[1][0] if verdicts[1] is not None else \
        verify_and_decode(ANY, None, good.key, None, good.payload, good.meta)[0]
    assert torch.equal(served.view(torch.uint8), kv_block(1, torch.bfloat16).view(torch.uint8))
