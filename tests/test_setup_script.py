"""Issue 40: tools/setup.sh run again on a set-up checkout installs nothing (seconds, not a
minute of pip), and installs again once pyproject.toml or a C source changes.

The real script on a copy of the checkout's pyproject.toml and C sources, its `.venv/bin/python`
a wrapper around this interpreter that records every `pip` call instead of running it (so
nothing is installed anywhere), with `chromium` on PATH (step 5 installs nothing either)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def checkout(tmp_path: Path) -> tuple[Path, Path, dict]:
    root = tmp_path / "checkout"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "setup.sh", root / "tools" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "storage" / "codec").mkdir(parents=True)
    shutil.copy(REPO / "storage" / "codec" / "_nibble.c", root / "storage" / "codec" / "_nibble.c")
    log = tmp_path / "pip.log"
    (root / ".venv" / "bin").mkdir(parents=True)
    wrapper = root / ".venv" / "bin" / "python"
    wrapper.write_text(f'#!/bin/bash\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$*" >> {log}; exit 0; fi\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "chromium").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "chromium").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VIRTUAL_ENV", None)
    env.pop("CONDA_PREFIX", None)
    return root, log, env


def run(root: Path, env: dict) -> str:
    r = subprocess.run(["bash", str(root / "tools" / "setup.sh")], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def pip_installs(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if " install " in f" {line} "] if log.exists() else []


def test_a_second_run_installs_nothing_until_the_sources_change(tmp_path: Path) -> None:
    root, log, env = checkout(tmp_path)
    first = run(root, env)
    assert any("-e .[dev]" in line for line in pip_installs(log)), (first, pip_installs(log))
    assert (root / ".venv" / ".tieredkv-setup-stamp").is_file()

    log.unlink()
    second = run(root, env)
    assert pip_installs(log) == [], second
    assert "up to date" in second and "not reinstalled" in second

    with open(root / "storage" / "codec" / "_nibble.c", "a") as f:
        f.write("\n/* changed */\n")
    third = run(root, env)
    assert any("-e .[dev]" in line for line in pip_installs(log)), third
    log.unlink()
    assert pip_installs(log) == [] and "up to date" in run(root, env)
