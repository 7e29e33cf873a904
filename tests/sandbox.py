"""Where the test suite writes: a sandbox HOME and cache root, and the check that it wrote nowhere else.

Knows: the sandbox's layout (`<dir>/home` is HOME, `<dir>/home/.cache/tieredkv` is TIEREDKV_HOME,
`<dir>/tmp` is TMPDIR, for the session and every child process, xdist's workers included), how the
default model's existing conversion is read from the user's real cache (each complete conversion
under the real `models/` linked into the sandbox's: read there, never made again, so the suite
does not pay the ~25 s conversion per session; a conversion the real cache lacks is made in the
sandbox), and what counts as a file written outside the sandbox: a new path under the real cache
root other than its `models/`, or a new entry in the real temp directory named as this project's
code and tests name theirs (`tieredkv*`, `tkv-*`, `*.open-lock`, ...; other programs share /tmp,
so a name of theirs is not the suite's doing).
Doesn't know: pytest (tests/conftest.py calls `enter` at configure and `leaks` at the session's end).
"""
from __future__ import annotations

import fnmatch
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from storage.config import default_cache_root

MARK = "TIEREDKV_TESTS_SANDBOX"           # set once; xdist workers and child processes inherit it
REAL_ROOT = "TIEREDKV_TESTS_REAL_CACHE"   # the user's cache root, whose models/ the sandbox reads
# "warn": report files written outside without failing the session (another checkout's suite or a
# tieredkv run at the same time on this machine writes where this session's check looks).
LEAKS = "TIEREDKV_TESTS_LEAKS"
# Names this project's code and tests give what they put in a temp directory (tempfile prefixes,
# a disk tier's `<dir>.open-lock` beside its directory): one of these new in the real temp
# directory was written by the suite.
OUR_TMP_NAMES = ("tieredkv*", "tkv-*", "*.open-lock", "bench-*", "drill-*", "peer-*", "truncate-race-*",
                 "live-drill-*", "kv", "kv.*", "billing", "torchinductor_*")


@dataclass(frozen=True)
class Snapshot:
    """What the real cache root (less models/) and the real temp directory held before the session."""
    cache_root: Path
    cache_paths: frozenset[str]
    tmp_dir: Path
    tmp_names: frozenset[str]


def enter(base: Path) -> Snapshot | None:
    """Point HOME, TIEREDKV_HOME and TMPDIR into `base` (made here), and link the real cache's
    finished conversions into the sandbox's models/. Returns the real locations' snapshot; None
    when a sandbox is already set (an xdist worker, or a child pytest: the first one checks)."""
    if os.environ.get(MARK):
        return None
    real_root = default_cache_root().expanduser().absolute()
    real_tmp = Path(tempfile.gettempdir()).resolve()
    snapshot = Snapshot(real_root, frozenset(_paths(real_root)), real_tmp, frozenset(_names(real_tmp)))
    home, tmp = base / "home", base / "tmp"
    root = home / ".cache" / "tieredkv"
    (root / "models").mkdir(parents=True)
    tmp.mkdir()
    _link_conversions(real_root / "models", root / "models")
    if "PYENV_ROOT" not in os.environ and (Path.home() / ".pyenv").is_dir():
        os.environ["PYENV_ROOT"] = str(Path.home() / ".pyenv")     # pyenv's shims find it under the real HOME
    os.environ.pop("XDG_CACHE_HOME", None)
    os.environ.update({MARK: str(base), REAL_ROOT: str(real_root), "HOME": str(home), "TIEREDKV_HOME": str(root),
                       "TMPDIR": str(tmp)})
    tempfile.tempdir = None              # gettempdir() reads TMPDIR again
    return snapshot


def _link_conversions(real: Path, sandbox: Path) -> None:
    """Each finished conversion of the real cache, linked (read, not copied): its files are the
    real ones, so a load finds it complete and converts nothing."""
    from engine.conversion_path import is_complete
    try:
        found = sorted(real.iterdir())
    except OSError:
        return
    for d in found:
        if not d.name.startswith(".") and d.is_dir() and is_complete(d):
            (sandbox / d.name).symlink_to(d, target_is_directory=True)


def leaks(snapshot: Snapshot) -> list[str]:
    """What the session wrote outside the sandbox: new paths under the real cache root (its
    models/ aside) and new entries of ours in the real temp directory, each as a full path. An
    entry in /tmp that a live process outside this session works in (another checkout's suite
    or benchmark on the same machine: its cwd, an open file, its command line) is not counted."""
    new_cache = sorted(set(_paths(snapshot.cache_root)) - snapshot.cache_paths)
    new_tmp = sorted(n for n in set(_names(snapshot.tmp_dir)) - snapshot.tmp_names
                     if any(fnmatch.fnmatch(n, p) for p in OUR_TMP_NAMES))
    if new_tmp:
        elsewhere = _used_by_others()
        new_tmp = [n for n in new_tmp if not any(str(snapshot.tmp_dir / n) in u for u in elsewhere)]
    return [str(snapshot.cache_root / p) for p in new_cache] + [str(snapshot.tmp_dir / n) for n in new_tmp]


def _used_by_others() -> list[str]:
    """Paths live processes outside this session use (cwd, open files) and their command lines
    (Linux /proc; a process of this session carries MARK in its environment)."""
    mine = f"{MARK}={os.environ.get(MARK, '')}".encode()
    found: list[str] = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
        if pid == str(os.getpid()):      # pytest itself, which set MARK after it started
            continue
        try:
            if mine in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            found.append(os.readlink(f"/proc/{pid}/cwd"))
            found.extend(os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return found


def _paths(root: Path) -> set[str]:
    """Every file and directory under `root` (relative), models/ left out."""
    found: set[str] = set()
    for here, dirs, files in os.walk(root):
        rel = os.path.relpath(here, root)
        if rel == ".":
            dirs[:] = [d for d in dirs if d != "models"]
        found.update(os.path.normpath(os.path.join(rel, n)) for n in dirs + files)
    return found


def _names(tmp: Path) -> set[str]:
    try:
        return set(os.listdir(tmp))
    except OSError:
        return set()
