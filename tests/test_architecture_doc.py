"""docs/ARCHITECTURE.md stays a map a newcomer can trust: short (at most 150 lines), every path it
names real, and every product module and every tool named in it (a new module gets its place in
the map, a removed one leaves it). Paths are written in full from the repository root."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
MAX_LINES = 150
PACKAGES = ("tieredkv", "storage", "engine", "service")

_BACKTICKED = re.compile(r"`([^`\s]+)`")
_BARE_FILE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w.-]+\.(?:py|c|sh|md|json))\b")


def named_paths(text: str) -> set[str]:
    """Every repository path the text names: backticked tokens with a slash (not a route such as
    `/metrics` or a URL scheme such as `valkey://`), and bare file paths such as docs/BENCHMARKS.md."""
    paths = {t for t in _BACKTICKED.findall(text) if "/" in t and not t.startswith("/") and ":" not in t}
    return paths | set(_BARE_FILE.findall(text))


def test_the_doc_is_at_most_150_lines() -> None:
    n = len(DOC.read_text().splitlines())
    assert n <= MAX_LINES, f"docs/ARCHITECTURE.md has {n} lines, more than {MAX_LINES}"


def test_every_path_the_doc_names_exists() -> None:
    missing = sorted(p for p in named_paths(DOC.read_text()) if not (ROOT / p).exists())
    assert missing == [], f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_module_and_tool_is_named() -> None:
    named = named_paths(DOC.read_text())
    modules = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*")
               if p.suffix in (".py", ".c") and p.name != "__init__.py" and "__pycache__" not in p.parts}
    tools = {str(p.relative_to(ROOT)) + ("/" if p.is_dir() else "") for p in (ROOT / "tools").iterdir()
             if p.name != "__pycache__" and not p.name.startswith(".")}
    assert sorted(modules - named) == [], "modules missing from docs/ARCHITECTURE.md's map"
    assert sorted(tools - named) == [], "tools missing from docs/ARCHITECTURE.md's tools/ section"


def test_the_path_reader_reads_what_the_doc_writes() -> None:
    text = ("`storage/disk/tier.py`, `/metrics`, `valkey://` and `--json`; see docs/BENCHMARKS.md and "
            "`storage/codec/`; `[layers, 2]`")
    assert named_paths(text) == {"storage/disk/tier.py", "docs/BENCHMARKS.md", "storage/codec/"}
