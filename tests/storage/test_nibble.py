"""The nibble coding (storage/codec/nibble.py and its compiled kernel): bytes the same from the C
kernel and the numpy reference, decodes bit-identical on both and in torch ops, and every
malformed coded plane refused -- by the kernels, and by the codec under a valid hash (a payload
forged with the project's own code), never decoded to other bytes."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
import xxhash

from storage.codec import nibble
from storage.codec.codec_error import CodecError
from storage.codec.payload import Codec

B = bytes(range(64))


def kv_bytes(n: int, itemsize: int, seed: int = 0, spread: float = 0.5) -> np.ndarray:
    """n KV-like elements: magnitudes log-normal with `spread` (0.5: most top bytes in the table,
    some escapes; 3: many escapes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(spread * torch.randn(n, generator=g))
    x = x.to(torch.bfloat16 if itemsize == 2 else torch.float32)
    return x.view(torch.uint8).numpy().copy()


def random_bytes(n: int, itemsize: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n * itemsize, dtype=np.uint8)


def numpy_encode(src: np.ndarray, itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    n = src.size // itemsize
    low = np.empty((itemsize - 1) * n, dtype=np.uint8)
    coded = np.empty(nibble.coded_bounds(n)[1] + 1, dtype=np.uint8)
    length = nibble._encode_numpy(src.reshape(n, itemsize), low.reshape(itemsize - 1, n), coded)
    return low, coded[:length]


def split_low(low: np.ndarray, itemsize: int) -> list[np.ndarray]:
    n = low.size // (itemsize - 1)
    return [low[b * n:(b + 1) * n] for b in range(itemsize - 1)]


CASES = [(n, itemsize, make) for itemsize in (2, 4) for make in (kv_bytes, random_bytes)
         for n in (1, 2, 31, 32, 33, 64, 1000, 4096 + 17)]


def test_the_compiled_kernel_is_built() -> None:
    # Without a C compiler at install the numpy reference runs (5-10x slower): say so.
    assert nibble.KERNEL == "c"


@pytest.mark.parametrize("n,itemsize,make", CASES)
def test_the_kernel_codes_as_the_reference_and_both_decode_bit_identical(n: int, itemsize: int, make) -> None:
    src = make(n, itemsize)
    low, coded = nibble.encode(src, itemsize)
    ref_low, ref_coded = numpy_encode(src, itemsize)
    assert np.array_equal(low, ref_low)
    if coded is not None:
        assert np.array_equal(coded, ref_coded)       # the same block codes to the same bytes
    else:                                             # stored only when coding would not shrink it
        assert ref_coded.size >= n
        coded = ref_coded                             # decode the coded form anyway
    lows = split_low(low, itemsize)
    out = np.full(src.size, 0xAA, dtype=np.uint8)
    nibble.decode(coded, lows, None, out, itemsize)
    assert np.array_equal(out, src)
    ref = nibble._top_numpy(coded, n)
    assert np.array_equal(ref, src.reshape(n, itemsize)[:, -1])
    t = nibble.decode_torch(torch.from_numpy(coded.copy()), torch.from_numpy(low.copy()).view(itemsize - 1, n),
                            None, itemsize)
    assert np.array_equal(t.numpy(), src)
    stored = np.full(src.size, 0x55, dtype=np.uint8)
    nibble.decode(None, lows, nibble.top_plane(src, itemsize), stored, itemsize)
    assert np.array_equal(stored, src)


def test_escapes_inside_and_outside_the_vector_steps_land_on_their_elements() -> None:
    # 20 common values and a rare one at chosen places: elements 0, 31, 32 (a step's edges), 63,
    # 64, the tail past the last full step: each escape must land on its own element.
    n = 100
    top = np.arange(n, dtype=np.uint8) % 15 + 100
    for i, v in zip((0, 31, 32, 63, 64, 97, 99), (1, 2, 3, 4, 5, 6, 7)):
        top[i] = v
    src = np.stack([np.arange(n, dtype=np.uint8), top], axis=1).reshape(-1).copy()
    low, coded = nibble.encode(src, 2)
    assert coded is not None and coded.size == nibble.TABLE + 50 + 7
    out = np.empty_like(src)
    nibble.decode(coded, split_low(low, 2), None, out, 2)
    assert np.array_equal(out, src)


def malformed(coded: np.ndarray, n: int) -> dict[str, np.ndarray]:
    ncodes = (n + 1) // 2
    cut = coded[:-1] if coded.size > nibble.TABLE + ncodes else coded
    extra = np.concatenate([coded, [7]]).astype(np.uint8)
    table15 = coded.copy()
    table15[nibble.ESCAPE] = 9
    one_more = coded.copy()
    first = nibble.TABLE
    one_more[first] |= 0x0F                          # element 0 now an escape the stream lacks
    out = {"an escape short": cut, "an escape too many": extra, "a table entry 15": table15,
           "a code turned escape": one_more}
    if n % 2:
        pad = coded.copy()
        pad[nibble.TABLE + ncodes - 1] |= 0x30
        out["a padding nibble"] = pad
    return out


@pytest.mark.parametrize("n", [101, 4096 + 33])
def test_a_malformed_coded_plane_is_refused_by_every_kernel(n: int) -> None:
    src = kv_bytes(n, 2, spread=3.0)        # wide: escapes present
    low, coded = nibble.encode(src, 2)
    assert coded is not None and coded.size > nibble.TABLE + (n + 1) // 2
    lows = split_low(low, 2)
    for name, bad in malformed(coded, n).items():
        if bad.size < nibble.TABLE + (n + 1) // 2:
            continue
        with pytest.raises(ValueError, match="malformed|coded plane of"):
            nibble.decode(bad, lows, None, np.empty_like(src), 2)
        with pytest.raises(ValueError, match="malformed"):
            nibble._top_numpy(bad, n)
        with pytest.raises(ValueError, match="malformed"):
            nibble.decode_torch(torch.from_numpy(bad), torch.from_numpy(low).view(1, n), None, 2)


def forge(payload: bytes, data: bytes, coded_length: int) -> bytes:
    """The payload with other data after its header, its table's last length, data xxh3 and header
    crc made to match: what a writer with this code and no secret could store."""
    h = Codec().check_header(payload)
    header = bytearray(payload[:h.header_size])
    table_end = h.header_size - 4 - 8
    struct.pack_into("<I", header, table_end - 4, coded_length)
    struct.pack_into("<Q", header, table_end, xxhash.xxh3_64_intdigest(data))
    struct.pack_into("<I", header, h.header_size - 4, zlib.crc32(bytes(header[:h.header_size - 4])))
    return bytes(header) + data


def test_a_forged_nibble_payload_with_a_valid_hash_is_refused_not_decoded() -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 2, 16, 2, 16, generator=g) * torch.exp(3 * torch.randn(2, 2, 16, 2, 16, generator=g)))
    x = x.to(torch.bfloat16)
    payload = Codec(kind="nibble").encode(x, B)
    h = Codec().check_header(payload)
    assert h.nibble and h.planes[-1].coded
    n = x.numel()
    assert h.planes[-1].length > nibble.TABLE + n // 2      # escapes present
    data = np.frombuffer(payload[h.header_size:], dtype=np.uint8)
    low, coded = data[:n], data[n:]
    assert torch.equal(Codec().decode(forge(payload, payload[h.header_size:], coded.size), B), x)
    for name, bad in malformed(coded.copy(), n).items():
        if bad.size < nibble.TABLE + (n + 1) // 2:
            continue
        with pytest.raises(CodecError):
            Codec().decode(forge(payload, low.tobytes() + bad.tobytes(), bad.size), B)
    flipped = bytearray(payload)
    flipped[-1] ^= 1                                  # damage without a forger: the hash fails
    with pytest.raises(CodecError, match="xxh3"):
        Codec().decode(bytes(flipped), B)


def test_a_nibble_plane_table_out_of_its_shape_is_refused() -> None:
    x = torch.randn(4, 64).to(torch.float32)
    payload = Codec(kind="nibble").encode(x, B)
    h = Codec().check_header(payload)
    table_at = h.header_size - 4 - 8 - 5 * 4
    for plane, mode, length in ((0, 0, x.numel() - 1), (1, 1, 200), (3, 1, 5)):
        bad = bytearray(payload)
        struct.pack_into("<BI", bad, table_at + 5 * plane, mode, length)
        struct.pack_into("<I", bad, h.header_size - 4, zlib.crc32(bytes(bad[:h.header_size - 4])))
        with pytest.raises(CodecError, match="plane table"):
            Codec().check_header(bytes(bad))
