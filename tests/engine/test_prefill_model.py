"""Issue 18, item 1 (the compute half): the engine's prefill time, fitted from its own steps."""
from __future__ import annotations

import pytest

from engine.prefill_model import MIN_STEPS, PrefillModel
from tests.engine.conftest import make_engine, random_prompt
from tieredkv import SamplingParams


def test_the_fit_recovers_a_known_linear_cost() -> None:
    m = PrefillModel()
    assert m.predict(100, 100) is None and m.snapshot() == {"steps": 0, "fitted": False}
    a, b, c = 0.002, 1e-4, 2e-8
    for n, ctx in [(16, 16), (64, 128), (256, 512), (1, 900), (512, 512), (128, 2048), (32, 64), (300, 1200),
                   (8, 4000), (200, 200)]:
        m.observe([(n, ctx)], a + b * n + c * n * ctx)
    assert m.predict(1000, 3000) == pytest.approx(a + b * 1000 + c * 1000 * 3000, rel=1e-6)
    snap = m.snapshot()
    assert snap["fitted"] and snap["per_token_s"] == pytest.approx(b, rel=1e-6)


def test_an_engine_fits_its_prefill_from_its_steps(tmp_path) -> None:
    eng = make_engine(tmp_path)
    try:
        for seed in range(MIN_STEPS + 2):
            eng.generate(random_prompt(20 + 7 * seed, seed), SamplingParams(max_tokens=2))
        pre = eng.cache_status()["cost_model"]["prefill"]
        assert pre["fitted"] and pre["steps"] >= MIN_STEPS and pre["prefill_2048_s"] > 0
    finally:
        eng.close()
