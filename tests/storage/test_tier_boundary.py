"""The tier contract is the boundary (issue 32, item 1): the modules that place and move blocks walk
`Tiers.lower` through storage/lower_tier.py's verbs and never name a tier below the host.

Read from the source with `ast`: in storage/tiered_cache.py, storage/cascade.py and
storage/loader.py no attribute called `disk` or `remote` is reached (`tiers.disk`,
`self.remote`, `prefetch.remote`), and nothing is imported from the rooms storage/disk/ and
storage/remote/. Only the wiring that builds the tiers from CacheConfig (storage/tier_wiring.py)
names them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLACEMENT = ["storage/tiered_cache.py", "storage/kv_blocks.py", "storage/cascade.py", "storage/loader.py",
             "storage/prefetch.py"]
NAMES = {"disk", "remote"}
ROOMS = {"storage.disk", "storage.remote"}


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in NAMES:
            found.append(f"line {node.lineno}: .{node.attr}")
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        for mod in mods:
            if any(mod == room or mod.startswith(room + ".") for room in ROOMS):
                found.append(f"line {node.lineno}: import {mod}")
    return found


@pytest.mark.parametrize("module", PLACEMENT)
def test_placement_names_no_tier_below_the_host(module: str) -> None:
    assert _offences(ROOT / module) == [], f"{module} reaches a tier by name; ask storage/lower_tier.py's verbs"


def test_the_check_sees_a_named_tier(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from storage.disk.tier import DiskTier\nimport storage.remote.tier\n"
                   "def f(t):\n    return t.disk.get(1) or t.tiers.remote\n")
    assert len(_offences(src)) == 4


def test_the_wiring_is_where_the_tiers_are_named() -> None:
    # The names have to live somewhere: in the wiring, built from CacheConfig.
    assert _offences(ROOT / "storage/tier_wiring.py") != []
