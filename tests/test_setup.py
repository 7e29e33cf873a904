"""The README's two commands are what CI and a new user run: keep them and .ci/run in step."""
from __future__ import annotations

import re
from pathlib import Path

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
