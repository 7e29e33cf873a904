"""Codec: bit-identical round trips, and every kind of damage raises CodecError."""
from __future__ import annotations

import struct
import threading
import zlib
from pathlib import Path

import pytest
import torch

from storage.codec import MAGIC, Codec, CodecError
from storage.layout import dtype_from_name

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SHAPES = [(2, 2, 16, 3, 8), (1,), (7, 5), (3, 2, 4, 1, 16), ()]
B = bytes(range(64))          # a binding, as the disk tier's (block hash || namespace)


def every_bit_pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns, so NaNs with payloads, infinities, -0.0 and subnormals all occur."""
    g = torch.Generator().manual_seed(seed)
    it = _INT[dtype]
    info = torch.iinfo(it)
    return torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=g).to(it).view(dtype)


def kv_like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(shape, generator=g) * torch.linspace(0.1, 4, shape[-1])).to(dtype)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(_INT[a.dtype]), b.view(_INT[b.dtype]))


def fields_end(payload: bytes) -> int:
    """Where the header crc32 starts: fixed fields, dims, raw size, binding (see storage/codec.py)."""
    at = 9 + 4 * payload[8] + 8
    return at + 1 + payload[at]


def with_crc(payload: bytes) -> bytes:
    """A payload whose header crc32 is made to match a tampered header."""
    fields_end = globals()["fields_end"](payload)
    return payload[:fields_end] + struct.pack("<I", zlib.crc32(payload[:fields_end])) + payload[fields_end + 4:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_is_bit_identical(dtype: torch.dtype, shuffle: bool, shape: tuple[int, ...]) -> None:
    codec = Codec(level=3, shuffle=shuffle)
    for x in (every_bit_pattern(shape, dtype), kv_like(shape or (1,), dtype).reshape(shape)):
        payload = codec.encode(x, B)
        assert_same_bits(codec.decode(payload, B), x)
        assert_same_bits(codec.decode(memoryview(payload), B), x)


def test_header_describes_the_block() -> None:
    x = kv_like((2, 2, 16, 3, 8), torch.bfloat16)
    h = Codec(level=5, shuffle=True).peek_header(Codec(level=5, shuffle=True).encode(x, B))
    assert (h.version, h.dtype, h.shape, h.raw_size, h.shuffled, h.level) == (
        3, "bfloat16", (2, 2, 16, 3, 8), 1536 * 2, True, 5)
    assert h.binding == B
    h = Codec(shuffle=False).peek_header(Codec(shuffle=False).encode(x.float(), B))
    assert (h.dtype, h.raw_size, h.shuffled, h.level) == ("float32", 1536 * 4, False, 3)


def test_shuffle_is_decoded_from_the_header_not_the_codec() -> None:
    x = kv_like((4, 16, 8), torch.float16)
    assert_same_bits(Codec(shuffle=False).decode(Codec(shuffle=True).encode(x, B), B), x)
    assert_same_bits(Codec(shuffle=True).decode(Codec(shuffle=False).encode(x, B), B), x)


def test_kv_like_data_compresses() -> None:
    x = kv_like((2, 2, 16, 3, 8), torch.bfloat16)
    assert len(Codec().encode(x, B)) < x.numel() * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_into_out(dtype: torch.dtype) -> None:
    x = every_bit_pattern((2, 2, 16, 3, 8), dtype, seed=3)
    out = torch.empty(x.numel(), dtype=dtype)   # flat buffer: the result takes the header's shape
    got = Codec().decode(Codec().encode(x, B), B, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_same_bits(got, x)


def test_out_that_does_not_fit_is_a_value_error() -> None:
    payload = Codec().encode(kv_like((4, 8), torch.float16), B)
    with pytest.raises(ValueError, match="out"):
        Codec().decode(payload, B, out=torch.empty(32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out"):
        Codec().decode(payload, B, out=torch.empty(31, dtype=torch.float16))
    with pytest.raises(ValueError, match="out"):
        Codec().decode(payload, B, out=torch.empty(64, dtype=torch.float16)[::2])


def test_encode_rejects_what_it_cannot_store() -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        Codec().encode(torch.zeros(4, dtype=torch.int32), B)
    with pytest.raises(ValueError, match="contiguous"):
        Codec().encode(torch.zeros(4, 4).t(), B)
    with pytest.raises(ValueError, match="level"):
        Codec(level=23)


@pytest.fixture(scope="module")
def payload() -> bytes:
    return Codec().encode(kv_like((2, 2, 16, 3, 8), torch.float16), B)


@pytest.mark.parametrize("where", ["magic", "version", "dims", "raw_size", "binding_len", "binding", "frame_start",
                                   "frame_mid", "crc", "frame_end"])
def test_flipped_byte_anywhere_raises(payload: bytes, where: str) -> None:
    header_size = Codec().peek_header(payload).header_size
    binding_at = fields_end(payload) - 1 - len(B)
    offset = {"magic": 0, "version": 4, "dims": 12, "raw_size": binding_at - 3, "binding_len": binding_at,
              "binding": binding_at + 5, "frame_start": header_size,
              "frame_mid": (header_size + len(payload)) // 2, "crc": header_size - 1,
              "frame_end": len(payload) - 1}[where]
    damaged = bytearray(payload)
    damaged[offset] ^= 0x10
    with pytest.raises(CodecError):
        Codec().decode(bytes(damaged), B)


def test_damaged_frame_is_caught_by_zstd_with_an_intact_header(payload: bytes) -> None:
    header_size = Codec().peek_header(payload).header_size
    body = bytearray(payload)
    body[(header_size + len(body)) // 2] ^= 0x01
    with pytest.raises(CodecError, match="zstd"):
        Codec().decode(bytes(body), B)


@pytest.mark.parametrize("keep", [0, 3, 8, 20, "header", "half", "minus1"])
def test_truncated_payload_raises(payload: bytes, keep: int | str) -> None:
    header_size = Codec().peek_header(payload).header_size
    n = {"header": header_size, "half": len(payload) // 2, "minus1": len(payload) - 1}.get(keep, keep)
    with pytest.raises(CodecError):
        Codec().decode(payload[:n], B)


def test_wrong_magic_raises(payload: bytes) -> None:
    body = b"XKVB" + payload[4:]
    with pytest.raises(CodecError, match="magic"):
        Codec().decode(with_crc(body), B)
    with pytest.raises(CodecError, match="magic"):
        Codec().peek_header(body)


def test_wrong_version_raises(payload: bytes) -> None:
    body = payload[:4] + bytes([9]) + payload[5:]
    assert body[:4] == MAGIC
    with pytest.raises(CodecError, match="version"):
        Codec().decode(with_crc(body), B)


def test_header_size_lies_raise(payload: bytes) -> None:
    # A header whose raw size disagrees with its shape, even with a valid crc.
    header_size = Codec().peek_header(payload).header_size
    body = bytearray(payload)
    struct.pack_into("<Q", body, fields_end(payload) - 1 - len(B) - 8, 999)
    with pytest.raises(CodecError, match="raw size"):
        Codec().decode(with_crc(bytes(body)), B)
    with pytest.raises(CodecError):
        Codec().decode(b"", B)


def test_parallel_decodes_in_threads_are_correct() -> None:
    blocks = [every_bit_pattern((4, 2, 16, 2, 16), DTYPES[i % 3], seed=i) for i in range(24)]
    payloads = [Codec(shuffle=i % 2 == 0).encode(b, B) for i, b in enumerate(blocks)]
    results: dict[int, torch.Tensor] = {}

    def work(k: int) -> None:
        for i in range(k, len(blocks), 4):
            results[i] = Codec().decode(payloads[i], B)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, b in enumerate(blocks):
        assert_same_bits(results[i], b)


# ---- a payload is bound to what it was stored for (issue 7, item 1) -------------------------

def test_an_intact_payload_under_another_binding_is_refused(payload: bytes) -> None:
    other = bytes(reversed(B))
    with pytest.raises(CodecError, match="bound to another block"):
        Codec().decode(payload, other)
    with pytest.raises(CodecError, match="bound to another block"):
        Codec().decode(payload, B[:32])
    assert Codec().check_header(payload).binding == B


def test_a_frame_without_its_content_checksum_is_refused(payload: bytes) -> None:
    # Clear zstd's Content_Checksum_flag (bit 2 of the frame header descriptor) and drop the 4
    # checksum bytes: zstd decodes such a frame without complaint, and one changed byte in its
    # literals would then be served as KV (seen in the attack that filed issue 7).
    import zstandard
    header_size = Codec().peek_header(payload).header_size
    frame = bytearray(payload[header_size:-4])
    frame[4] &= ~0x04
    assert not zstandard.get_frame_parameters(bytes(frame)).has_checksum
    with pytest.raises(CodecError, match="checksum"):
        Codec().decode(payload[:header_size] + bytes(frame), B)


def test_trailing_bytes_after_the_frame_are_refused(payload: bytes) -> None:
    for junk in (b"\0", b"junk", payload[-40:]):
        with pytest.raises(CodecError, match="unused data|extra"):
            Codec().decode(payload + junk, B)


def test_binding_longer_than_the_header_holds_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="binding"):
        Codec().encode(kv_like((4, 8), torch.float16), b"x" * 256)


# ---- payloads already on disk stay readable ---------------------------------------------------

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.parametrize("stem", ["codec_v3_bfloat16_shuffled", "codec_v3_float16", "codec_v3_float32_shuffled"])
def test_golden_v3_payloads_decode_to_their_exact_bytes(stem: str) -> None:
    # Written by the format-3 codec (tests/fixtures/README.md): a later build must serve what an
    # earlier one stored, bit for bit.
    payload = (FIXTURES / f"{stem}.tkvb").read_bytes()
    expected = (FIXTURES / f"{stem}.raw").read_bytes()
    header = Codec().check_header(payload)
    assert header.version == 3 and header.shape == (2, 2, 4, 2, 8)
    got = Codec().decode(payload, B)
    assert got.shape == (2, 2, 4, 2, 8) and got.dtype == dtype_from_name(header.dtype)
    assert got.reshape(-1).view(torch.uint8).numpy().tobytes() == expected
    with pytest.raises(CodecError, match="bound to another block"):
        Codec().decode(payload, bytes(64))
