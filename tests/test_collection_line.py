"""Issue 40: a newcomer's `pytest` says what it does in the seconds its collection takes
(tests/conftest.py's pytest_collection hook), before pytest's own `collected N items`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_collection_says_what_it_is_doing_before_it_ends() -> None:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        "tests/test_architecture_doc.py"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("tieredkv: collecting the tests")]
    assert said and said[0] == 0, r.stdout                 # the first line, before any test id
    assert "importing torch" in lines[0]
