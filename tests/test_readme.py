"""The README's Python example runs as printed and shows what it says it shows.

Its ```python blocks under "## Python API" run verbatim, in order, in one fresh process on the real
default model (SmolLM2-135M-Instruct; ~15 s on 2 cores once the model is converted): a prompt
computed, hit in the device pool, then hit from disk after a restart, with `lookup()` saying
so beforehand each time. Also: the first-load estimate the CLI prints is the README's, and the
quick test subset the README suggests names files that exist.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path


from tieredkv.cli_common import FIRST_LOAD

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCK = 16


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def python_blocks(title: str) -> list[str]:
    return re.findall(r"```python\n(.+?)\n```", section(title), re.S)


def test_python_example_hits_the_device_pool_then_disk_after_a_restart(tmp_path: Path,
                                                                       default_model_converted: None) -> None:
    blocks = python_blocks("Python API")
    assert len(blocks) == 2, "expected the example and its continuation"
    # TMPDIR: the example's tempfile.mkdtemp() cache lands in this test's directory.
    r = subprocess.run([sys.executable, "-c", "\n\n".join(blocks)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    steps = re.findall(r"^(.+): lookup (\{.*?\})\n  usage: (\d+) of (\d+) prompt tokens hit (\{.*?\}), (\d+) computed",
                       r.stdout, re.M)
    assert [s[0] for s in steps] == ["first run", "second run", "after restart"], r.stdout
    n = int(steps[0][3])
    full = (n - 1) // BLOCK * BLOCK          # a prefix hit stops short of the last token
    assert full >= 6 * BLOCK, f"the example's prompt ({n} tokens) should span several blocks"
    none = {"device": 0, "host": 0, "disk": 0, "remote": 0}
    # The example repeats its prompt exactly: every token hits (its tail and logits kept too).
    expected = [(none, none), ({**none, "device": n}, {**none, "device": n}),
                ({**none, "disk": n}, {**none, "disk": n})]
    for (label, lookup, hit, prompt, by_tier, miss), (want_lookup, want_hit) in zip(steps, expected):
        assert int(prompt) == n, label
        assert ast.literal_eval(lookup) == want_lookup, label
        assert ast.literal_eval(by_tier) == want_hit, label
        assert int(hit) == sum(want_hit.values()) and int(hit) + int(miss) == n, label
    # The comments in the example say what the run shows.
    assert (f"this one is {n} tokens, of which {full // BLOCK} blocks ({full} tokens) can hit a prompt that "
            f"shares them, and all {n} its repeat") in " ".join(l.lstrip("# ") for l in blocks[0].split("\n"))
    # The printed output in the README is this run's, TTFTs and answers aside.
    shown = section("Python API").split("```text\n", 1)[1].split("\n```", 1)[0]
    strip = lambda text: re.sub(r"TTFT \d+ ms; .*", "", text)        # noqa: E731
    assert strip(shown).splitlines() == strip(r.stdout).splitlines()[:len(shown.splitlines())]


def test_the_first_load_estimate_is_the_same_in_the_cli_and_the_readme() -> None:
    assert FIRST_LOAD in " ".join(section("Quickstart").split())
    for path in ("tieredkv/demo.py", "tieredkv/cli.py"):
        assert "~30 s" not in (REPO / path).read_text(), path


def test_the_quick_subset_names_test_files_that_exist() -> None:
    quick = re.findall(r"`\.venv/bin/python -m pytest -q ([^`]+)`", section("Quickstart"))
    assert len(quick) == 1, quick
    files = quick[0].split()
    assert files and all((REPO / f).is_file() for f in files), files
