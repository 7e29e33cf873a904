"""Byte planes: plane b is byte b of every element, in either order, and join undoes split bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from storage.codec import byte_planes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SHAPES = [(), (1,), (0,), (7, 5), (3, 5, 7), (2, 2, 4, 2, 8), (5, 3, 1, 3), (1, 2, 3), (2, 1, 3), (2, 3, 0, 4)]


@pytest.fixture(autouse=True, params=["c", "numpy"])
def kernel(request, monkeypatch) -> str:
    """Every test here runs against both implementations: the compiled one the package uses, and
    the numpy one it falls back to (and that defines the transform independently of the C)."""
    if request.param == "numpy":
        monkeypatch.setattr(byte_planes, "_compiled", None)
    else:
        assert byte_planes._compiled is not None, (
            "storage/codec/_byte_planes.c was not built (no C compiler at `pip install -e .`?): "
            "byte planes run on numpy, ~4-6x slower")
    return request.param


def test_the_package_runs_the_compiled_kernel() -> None:
    assert byte_planes.KERNEL == "c"


def every_bit_pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns, so NaNs with payloads, infinities, -0.0 and subnormals all occur."""
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(_INT[dtype])
    return torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=g).to(_INT[dtype]).view(dtype)


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_join_undoes_split_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = every_bit_pattern(shape, dtype)
    for swapped in (False, True) if byte_planes.can_swap(shape) else (False,):
        planes = byte_planes.split(x, swapped)
        assert planes.shape == (x.element_size(), x.numel()) and planes.dtype == np.uint8
        listed = raw_bytes(x.transpose(0, 1).contiguous() if swapped else x)
        for b in range(x.element_size()):                 # plane b is byte b, by a strided slice
            assert planes[b].tobytes() == listed[b::x.element_size()].tobytes()
        out = torch.full_like(x, 7)
        byte_planes.join(list(planes), out, swapped)
        assert torch.equal(out.view(_INT[dtype]), x.view(_INT[dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_plane_b_is_byte_b_of_every_element(dtype: torch.dtype) -> None:
    x = every_bit_pattern((3, 4, 5), dtype, seed=1)
    size = x.element_size()
    planes = byte_planes.split(x)
    for b in range(size):
        assert planes[b].tobytes() == raw_bytes(x)[b::size].tobytes()
    # Dim-1-major: the same bytes, listed as if dims 0 and 1 were swapped.
    swapped = byte_planes.split(x, swapped=True)
    t = x.transpose(0, 1).contiguous()
    for b in range(size):
        assert swapped[b].tobytes() == raw_bytes(t)[b::size].tobytes()


def test_the_top_plane_of_kv_like_values_holds_the_exponent() -> None:
    # Sign and exponent take few values, the low byte looks random: why only the top plane is coded.
    x = (torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    low, top = byte_planes.split(x)
    assert len(np.unique(top)) < 40 and len(np.unique(low)) > 200


def test_join_writes_into_out_in_place_from_any_buffer() -> None:
    x = every_bit_pattern((2, 3, 8), torch.bfloat16, seed=3)
    planes = byte_planes.split(x, swapped=True)
    out = torch.empty_like(x)
    ptr = out.data_ptr()
    byte_planes.join([bytes(planes[0]), memoryview(planes[1].tobytes())], out, swapped=True)
    assert out.data_ptr() == ptr and torch.equal(out.view(torch.int16), x.view(torch.int16))


def test_can_swap_needs_two_leading_dims_and_a_tail() -> None:
    assert byte_planes.can_swap((30, 2, 16, 3, 64)) and byte_planes.can_swap((2, 2, 1))
    for shape in [(), (5,), (7, 5), (1, 2, 3), (2, 1, 3)]:
        assert not byte_planes.can_swap(shape)


def test_what_cannot_be_split_or_joined_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="2- or 4-byte"):
        byte_planes.split(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        byte_planes.split(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="swap"):
        byte_planes.split(torch.zeros(4, 4), swapped=True)
    x = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="2 planes"):
        byte_planes.join([bytes(8)] * 3, x)
    with pytest.raises(ValueError, match="8 bytes per plane"):
        byte_planes.join([bytes(8), bytes(7)], x)


def test_split_into_a_warm_buffer_is_the_same_split_and_checks_the_buffer() -> None:
    t = torch.randn(4, 2, 16, 3, 8).to(torch.bfloat16)
    buf = np.full(t.numel() * 2 + 10, 0xAB, dtype=np.uint8)
    planes = byte_planes.split(t, True, out=buf)
    assert np.shares_memory(planes, buf) and np.array_equal(planes, byte_planes.split(t, True))
    assert (buf[t.numel() * 2:] == 0xAB).all()          # only its front is written
    with pytest.raises(ValueError, match="out"):
        byte_planes.split(t, True, out=np.empty(t.numel() * 2 - 1, dtype=np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_kv_block_shape_splits_and_joins_the_same_in_both_orders(dtype: torch.dtype) -> None:
    # The default model's block shape, [layers, K/V, tokens, heads, head_dim]: runs of 3072
    # elements, long enough for the compiled loops' vector bodies and their scalar tails.
    x = every_bit_pattern((30, 2, 16, 3, 64), dtype, seed=4)
    size = x.element_size()
    for swapped in (False, True):
        planes = byte_planes.split(x, swapped)
        listed = raw_bytes(x.transpose(0, 1).contiguous() if swapped else x)
        for b in range(size):
            assert planes[b].tobytes() == listed[b::size].tobytes()
        out = torch.full_like(x, 3)
        byte_planes.join(list(planes), out, swapped)
        assert torch.equal(out.view(_INT[dtype]), x.view(_INT[dtype]))


def test_odd_run_lengths_and_unaligned_planes() -> None:
    # Runs whose length is no multiple of any vector width, and planes that start at odd
    # addresses (views into one payload, as format 3's planes are): bytes only, no alignment.
    x = every_bit_pattern((3, 2, 37), torch.float32, seed=5)
    planes = byte_planes.split(x, True)
    blob = b"?" + b"".join(p.tobytes() for p in planes)
    n = x.numel()
    views = [memoryview(blob)[1 + b * n:1 + (b + 1) * n] for b in range(4)]
    out = torch.empty_like(x)
    byte_planes.join(views, out, True)
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_plane_given_as_segments_joins_like_the_whole_plane(dtype: torch.dtype) -> None:
    # A stored plane read in place from its zstd frame comes as raw blocks of up to 128 KiB: cut
    # at places unrelated to the runs of the swapped order, empty pieces included.
    x = every_bit_pattern((6, 2, 4, 3, 37), dtype, seed=6)
    n = x.numel()
    planes = byte_planes.split(x, True)
    g = torch.Generator().manual_seed(7)
    for trial in range(20):
        given = []
        for b in range(x.element_size()):
            cuts = sorted(torch.randint(0, n + 1, (trial % 5,), generator=g).tolist() + [0, 0, n])
            pieces = [memoryview(planes[b].tobytes())[a:z] for a, z in zip(cuts, cuts[1:])]
            given.append(pieces if (trial + b) % 3 else bytes(planes[b]))    # mixed with whole planes
        out = torch.full_like(x, 5)
        byte_planes.join(given, out, True)
        assert torch.equal(out.view(_INT[dtype]), x.view(_INT[dtype]))


def test_segments_that_do_not_add_up_to_a_plane_are_a_value_error() -> None:
    x = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="8 bytes per plane"):
        byte_planes.join([[bytes(3), bytes(4)], bytes(8)], x)
    with pytest.raises(ValueError, match="8 bytes per plane"):
        byte_planes.join([[bytes(8), bytes(1)], bytes(8)], x)
