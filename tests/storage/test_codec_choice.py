"""codec="auto" (storage/codec_choice.py): the rule that picks a codec from measured figures, the
figures themselves on a real layout, the drive's read rate leaving nothing behind, and a cache
built with auto writing its disk in the chosen kind, read back bit-identical."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from storage.codec.header import KINDS
from storage.codec_choice import CodecFigures, choose, drive_read_rate, measure_codecs
from storage.config import CacheConfig
from storage.layout import BlockLayout
from storage.tiered_cache import TieredKVCache

FIGURES = (CodecFigures("zstd", 1.45, 2e9), CodecFigures("raw", 1.0, 20e9), CodecFigures("nibble", 1.33, 10e9))


def test_a_fast_medium_takes_the_fastest_decode_and_a_slow_one_the_smallest_payload() -> None:
    assert choose(FIGURES, 100e9, 2).kind == "raw"          # memory speed: decoding is the cost
    assert choose(FIGURES, 3e9, 2).kind == "nibble"         # an NVMe drive: both count
    assert choose(FIGURES, 0.1e9, 2).kind == "zstd"         # a slow drive: bytes are the cost
    assert choose(FIGURES, None, 2).kind == "zstd"          # nothing measured: the fewest bytes
    # The seconds it compares are what the docstring says: read + decode on every thread.
    c = choose(FIGURES, 3e9, 2)
    assert c.seconds_per_byte(FIGURES[2]) == pytest.approx(1 / (1.33 * 3e9) + 1 / (10e9 * 2))
    assert min(FIGURES, key=c.seconds_per_byte).kind == c.kind


def test_more_decode_threads_move_the_choice_toward_the_smaller_payload() -> None:
    one, many = choose(FIGURES, 4e9, 1), choose(FIGURES, 4e9, 64)
    ratio = {f.kind: f.ratio for f in FIGURES}
    assert ratio[many.kind] >= ratio[one.kind] and one.kind != many.kind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_every_kind_is_measured_on_the_layout(dtype: torch.dtype) -> None:
    figures = {f.kind: f for f in measure_codecs(BlockLayout(4, 16, 2, 32, dtype))}
    assert set(figures) == set(KINDS)
    assert all(f.decode_bytes_per_s > 0 for f in figures.values())
    assert figures["raw"].ratio < 1.0 < figures["zstd"].ratio          # raw: the header only
    assert (figures["nibble"].ratio > 1.05) == (dtype != torch.float16)  # fp16's top byte: stored


def test_the_drive_read_rate_leaves_nothing_behind(tmp_path: Path) -> None:
    rate = drive_read_rate(str(tmp_path), nbytes=4 << 20)
    assert rate is not None and rate > 0
    assert os.listdir(tmp_path) == []
    blocked = tmp_path / "a-file"
    blocked.write_bytes(b"x")
    assert drive_read_rate(str(blocked / "kv")) is None       # not a directory: unmeasured, no error


def test_a_cache_built_with_auto_writes_its_disk_in_the_chosen_kind(tmp_path: Path) -> None:
    layout = BlockLayout(2, 4, 2, 8, torch.bfloat16)
    config = CacheConfig(block_size=4, device_memory=4 * layout.nbytes, host_memory=0,
                         disk_dir=str(tmp_path / "kv"), disk_capacity="64MiB", codec="auto")
    cache = TieredKVCache(layout, config, num_pages=4)
    try:
        kind = cache.disk.codec.kind
        assert kind in KINDS
        choice = cache.stats()["disk"].extra["codec_choice"]
        assert choice.startswith(kind + " (medium ")
        assert not [p for p in tmp_path.rglob("*") if "read-rate" in p.name]     # the scratch file is gone
    finally:
        cache.close()
