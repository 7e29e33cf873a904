"""What `serve` and `demo` say while the model loads (issue 31, item 2): the first-load estimate
only when the load converts the default model's GGUF, a GGUF of the user's said to convert once
on its first load, and the check itself imports neither torch nor transformers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tieredkv.cli_common import FIRST_LOAD, load_description

REPO = Path(__file__).resolve().parents[1]


def test_the_estimate_is_given_only_before_the_default_models_first_conversion(tmp_path: Path,
                                                                                default_model_converted: None) -> None:
    # The default root holds the conversion (the fixture made it, or found it): no estimate.
    assert load_description(None, None) == "Loading SmolLM2-135M-Instruct"
    assert load_description(None, tmp_path / "elsewhere") == "Loading SmolLM2-135M-Instruct"   # a load finds it there too
    # An empty default root and cache dir: this load converts, so the estimate is given -- decided
    # in a child that imports neither torch nor transformers.
    probe = ("import sys; from tieredkv.cli_common import load_description; "
             "print(load_description(None, sys.argv[1])); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "cache")], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(REPO), "TIEREDKV_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"Loading SmolLM2-135M-Instruct ({FIRST_LOAD})", "[]"]


def test_a_gguf_of_the_users_is_said_to_convert_until_it_has_been(tmp_path: Path) -> None:
    from engine.model import load_model
    from tests.engine.test_model import write_tiny_gguf
    gguf, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_tiny_gguf(gguf)
    assert load_description(str(gguf), cache) == f"Loading {gguf} (its first load converts the GGUF once)"
    load_model(str(gguf), device="cpu", dtype="float32", cache_dir=str(cache))
    assert load_description(str(gguf), cache) == f"Loading {gguf}"
    assert load_description(str(tmp_path), cache) == f"Loading {tmp_path}"       # a directory: nothing to convert
