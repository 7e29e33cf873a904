"""Issue 40: the demo leaves no silence of seconds -- between the model's `Loading ...: done`
and `Warming up ...` it says what it builds (two engines: the baseline and the tiered one).

The real demo on the tiny random-weight model, stopped at its warm-up (the steps after it are
test_cli.py's demo tests)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from tieredkv.demo import BUILD_STEP, Demo


class Stop(Exception):
    pass


def test_the_demo_says_what_it_builds_before_warming_up(tmp_path: Path, tiny_model_dir: Path) -> None:
    steps: list[str] = []

    @contextlib.contextmanager
    def step(label: str):
        steps.append(label)
        if label == "Warming up":
            raise Stop
        yield

    demo = Demo(tmp_path / "demo", model=str(tiny_model_dir), device="cpu", step=step)
    with pytest.raises(Stop):
        demo.run()
    assert steps[0].startswith("Loading ") and steps[1:] == [BUILD_STEP, "Warming up"], steps
    assert demo.engine is not None and demo.baseline is not None     # built inside that step
