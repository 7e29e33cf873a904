"""The floors of the house: dependencies point one way, and a test keeps them there.

    tieredkv (CLI, demo, re-exports)  ->  service  ->  engine  ->  storage

storage owns the block vocabulary (hashing) and the cache config; engine owns the billing
ledger (it records usage); tieredkv/ only faces the user. A module may import its own package
and any package below it, never one above it. Read from the source with `ast`, so a lazy
import inside a function counts too.

Inside storage, the tiers below the host are rooms of their own:

    storage/disk/, storage/remote/  ->  storage/codec/  ->  storage's shared vocabulary

A room imports itself, the rooms below it and the shared modules named in SHARED, never a
sibling room (disk and remote share what they share through codec/) and never the modules that
place and move blocks (tiered_cache, cascade, loader), which import the rooms.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ["storage", "engine", "service", "tieredkv"]  # bottom to top


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(FLOORS)


@pytest.mark.parametrize("package", FLOORS)
def test_no_import_points_up(package: str) -> None:
    above = set(FLOORS[FLOORS.index(package) + 1:])
    offenders = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_packages(path) & above
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}, f"imports pointing up from {package}/: {offenders}"


ROOMS = {"codec": set(), "disk": {"codec"}, "remote": {"codec"}}
# kv_events: the event sink every tier calls (storage/kv_events/sink.py; no zmq behind it).
# pool_drain: spreading a batch over a thread pool (knows no tier).
# malloc_tuning: glibc told to keep block-sized memory (knows no tier; the tiers call it when built).
# foreground: whether sequences run, which the writers' encode pools narrow to (knows no tier).
# cancellation: a read its caller gave up on (the loader cancels, the remote reader drops its socket).
# fleet_secret: the secret shared tiers seal blocks under, and the seal (knows no tier).
SHARED = {"hashing", "layout", "priority", "pinned", "background_writer", "lower_tier", "kv_events", "pool_drain",
          "malloc_tuning", "foreground", "cancellation", "fleet_secret", "retention",
          "tier_kinds", "tier_health"}


def _storage_imports(path: Path) -> set[str]:
    """What `path` imports from storage: "disk", "remote", "codec" for a room, else the module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        for mod in mods:
            parts = mod.split(".")
            if parts[0] == "storage" and len(parts) > 1:
                names.add(parts[1])
    return names


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_storage_room_imports_only_rooms_below_it_and_the_shared_vocabulary(room: str) -> None:
    allowed = {room} | ROOMS[room] | SHARED
    offenders = {}
    for path in sorted((ROOT / "storage" / room).rglob("*.py")):
        bad = _storage_imports(path) - allowed
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}, f"imports leaving storage/{room}/ sideways or up: {offenders}"


def test_user_facing_names_still_importable_from_tieredkv() -> None:
    import tieredkv
    from storage.config import CacheConfig
    assert tieredkv.CacheConfig is CacheConfig
    assert set(tieredkv.__all__) == {"CacheConfig", "Engine", "SamplingParams"}
