"""Issue 18, item 1 (the measured half): each tier's restore rate, from the loader's own fills."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from storage.codec.payload import Codec
from storage.layout import BlockLayout
from storage.restore_rates import ALPHA, RestoreRates
from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams


def test_a_seed_is_replaced_by_the_first_measurement_then_averaged() -> None:
    r = RestoreRates()
    r.seed("disk", 1000.0)
    r.seed("disk", 5.0)                                   # a second seed changes nothing
    assert r.snapshot()["disk"] == {"bytes_per_s": 1000, "samples": 0, "source": "calibration"}
    r.observe("disk", 4000, 2.0)                          # 2000 B/s replaces the seed
    r.observe("disk", 8000, 2.0)                          # 4000 B/s moves the average by ALPHA
    assert r.get("disk") == pytest.approx(2000 + ALPHA * (4000 - 2000))
    assert r.snapshot()["disk"]["samples"] == 2 and r.snapshot()["disk"]["source"] == "measured"
    r.observe("host", 0, 1.0)                             # nothing restored: nothing learned
    assert r.get("host") is None


def test_calibration_seeds_host_and_disk() -> None:
    layout = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    r = RestoreRates()
    r.calibrate(layout, Codec(), torch.device("cpu"))
    snap = r.snapshot()
    assert set(snap) == {"host", "disk"} and all(v["bytes_per_s"] > 0 and v["samples"] == 0 for v in snap.values())


def test_the_engines_fills_measure_host_and_disk(tmp_path: Path) -> None:
    # restore_policy="load": every hit is read (under "auto" the planner may recompute a tiny
    # model's hit: billed as a disk hit, nothing read). The disk hit's blocks are read either by
    # its fill or, when the request's prefetch wins the race, by the prefetch into the host (the
    # fill then copies from there): both record the disk's rate. On a loaded CI machine the
    # prefetch won, and before prefetches recorded it this test failed.
    eng = make_engine(tmp_path, restore_policy="load")
    try:
        prompt = random_prompt(40, seed=3)
        eng.generate(prompt, SamplingParams(max_tokens=2))
        eng.demote("device")
        eng.generate(prompt, SamplingParams(max_tokens=2))          # a host hit
        eng.demote("device")
        eng.demote("host")
        eng.flush()
        out = eng.generate(prompt, SamplingParams(max_tokens=2))    # a disk hit
        assert out.usage.hit_tokens_by_tier["disk"] == 36 and out.metrics.recomputed_hit_tokens == 0
        rates = eng.cache_status()["cost_model"]["restore_bytes_per_s"]
        assert rates["host"]["source"] == "measured" and rates["host"]["samples"] >= 1
        assert rates["disk"]["source"] == "measured" and rates["disk"]["samples"] >= 1
    finally:
        eng.close()
