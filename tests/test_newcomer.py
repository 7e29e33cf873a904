"""Issue 40: a newcomer's first hour, as they meet it -- the suite leaves their cache alone, vLLM's
commands mean what they mean in vLLM, and help never cuts a flag.

- The suite runs in a sandbox (tests/sandbox.py): HOME, TIEREDKV_HOME and TMPDIR inside pytest's
  basetemp, the real cache's conversions read in place, and anything new in the real cache root
  (less models/) or of ours in /tmp reported and failing the session.
- `tieredkv serve HuggingFaceTB/SmolLM2-135M-Instruct --seed 42 --api-key sk-test
  --disable-log-stats` (a vLLM user's command) serves the default model under that name, repeated
  unseeded sampled requests differ, and /tokenize takes vLLM's fields.
- `COLUMNS=80 tieredkv serve --help | grep -- --served-model-name` finds it; no command's help cuts
  an option's name at any width.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests import sandbox
from tests.test_cli import ENV, REPO, Lines


# ---- 1. the suite writes only into its temporary directories ---------------------------------

def test_the_session_runs_in_a_sandbox_under_pytests_basetemp(tmp_path_factory) -> None:
    base = Path(os.environ[sandbox.MARK])
    basetemp = tmp_path_factory.getbasetemp().resolve()
    # An xdist worker's basetemp is a folder of the controller's, which holds the sandbox.
    assert base.resolve().parent in (basetemp, basetemp.parent), (base, basetemp)
    home = Path(os.environ["HOME"])
    assert home == base / "home" and Path.home() == home
    assert Path(os.environ["TIEREDKV_HOME"]) == home / ".cache" / "tieredkv"
    assert Path(tempfile.gettempdir()) == base / "tmp"
    from storage.config import CacheConfig, default_cache_root
    assert default_cache_root() == home / ".cache" / "tieredkv"
    assert Path(CacheConfig().disk_path).is_relative_to(home)        # the default disk_dir: ~/.cache/tieredkv/kv
    # The real cache's finished conversions are read where they are: links, not copies.
    from engine.conversion_path import is_complete
    real = Path(os.environ[sandbox.REAL_ROOT]) / "models"
    finished = sorted(d.name for d in (real.iterdir() if real.is_dir() else ()) if not d.name.startswith(".")
                      and is_complete(d))
    models = home / ".cache" / "tieredkv" / "models"
    for name in finished:
        if (models / name).exists():     # a conversion finished during this session is not linked
            assert (models / name).is_symlink() and (models / name).resolve() == (real / name).resolve(), name


def test_the_leak_check_reports_what_a_session_wrote_outside_and_only_that(tmp_path: Path) -> None:
    root, tmp = tmp_path / "real-cache", tmp_path / "real-tmp"
    (root / "models" / "old").mkdir(parents=True)
    (root / "kv").mkdir()
    tmp.mkdir()
    (tmp / "tieredkv-old").mkdir()
    snap = sandbox.Snapshot(root, frozenset(sandbox._paths(root)), tmp, frozenset(sandbox._names(tmp)))
    assert sandbox.leaks(snap) == []
    (root / "models" / "new-conversion").mkdir()          # models/: the one place shared on purpose
    (root / "kv" / "data.mdb").write_bytes(b"")
    (root / "billing").mkdir()
    (tmp / "tieredkv-prop-abc.open-lock").write_bytes(b"")
    (tmp / "ssh-XXXX").mkdir()                            # another program's: not the suite's doing
    assert sandbox.leaks(snap) == [str(root / "billing"), str(root / "kv" / "data.mdb"),
                                   str(tmp / "tieredkv-prop-abc.open-lock")]
    # Another program on the machine working in a directory of that name (another checkout's
    # valkey-server, say: not of this session, so without its sandbox mark) is its own doing.
    (tmp / "tkv-valkey-1-abc").mkdir()
    other = {k: v for k, v in os.environ.items() if k != sandbox.MARK}
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], cwd=tmp / "tkv-valkey-1-abc",
                          env=other, stdin=subprocess.PIPE) as elsewhere:
        assert str(tmp / "tkv-valkey-1-abc") not in sandbox.leaks(snap)
        elsewhere.stdin.close()
    assert str(tmp / "tkv-valkey-1-abc") in sandbox.leaks(snap)         # once it is gone, nobody else's


def test_passed_tests_leave_no_temporary_data_behind() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^tmp_path_retention_policy = "failed"$', text, re.M)


# ---- 2. vLLM's commands with vLLM's meanings --------------------------------------------------

def test_the_default_model_answers_to_its_names_without_loading_anything() -> None:
    from engine.default_model import DEFAULT_HUB_ID, DEFAULT_MODEL_NAME, names_default
    from tieredkv.cli_common import load_description
    assert names_default(None) and names_default(DEFAULT_MODEL_NAME) and names_default(DEFAULT_HUB_ID)
    assert not names_default("HuggingFaceTB/SmolLM2-360M-Instruct") and not names_default("./SmolLM2-135M-Instruct")
    assert load_description(DEFAULT_HUB_ID, None) == load_description(None, None)
    assert load_description(DEFAULT_MODEL_NAME, None).startswith(f"Loading {DEFAULT_MODEL_NAME}")


def test_a_vllm_users_serve_command_means_what_it_means_in_vllm(tmp_path: Path,
                                                                default_model_converted: None) -> None:
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    proc = subprocess.Popen(["tieredkv", "serve", hub_id, "--seed", "42", "--api-key", "sk-test",
                             "--disable-log-stats", "--port", "0", "--cache-dir", str(tmp_path / "srv"),
                             "--device-memory", "64MiB", "--host-memory", "32MiB"],
                            cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc.stderr)
        url = lines.wait(r"serving SmolLM2-135M-Instruct on (http://127\.0\.0\.1:\d+)", proc, 240)[1]
        lines.wait(r"Uvicorn running|Application startup complete", proc, 60)
        auth = {"Authorization": "Bearer sk-test"}           # a 7-character key, as vLLM takes any
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]] == [hub_id]    # served under the name given, as vLLM does
        texts = []
        for name in (hub_id, "SmolLM2-135M-Instruct", hub_id):   # either name reaches the model
            r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=120,
                           json={"model": name, "prompt": "Write one word:", "max_tokens": 6, "temperature": 1.0})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == hub_id
            texts.append(r.json()["choices"][0]["text"])
        assert len(set(texts)) > 1, texts        # --seed seeds the engine once: unseeded requests differ
        chat = {"messages": [{"role": "user", "content": "Hello"}]}
        opened = httpx.post(f"{url}/tokenize", headers=auth, json=chat, timeout=30).json()
        closed = httpx.post(f"{url}/tokenize", headers=auth, timeout=30,
                            json={**chat, "add_generation_prompt": False, "add_special_tokens": False,
                                  "return_token_strs": True}).json()
        assert opened["count"] > closed["count"] and opened["tokens"][:closed["count"]] == closed["tokens"]
        assert "token_strs" not in opened and len(closed["token_strs"]) == closed["count"]
        prompt = httpx.post(f"{url}/tokenize", headers=auth, timeout=30,
                            json={"prompt": "Hello", "add_special_tokens": True, "return_token_strs": True}).json()
        assert prompt["token_strs"] == ["Hello"], prompt
        bad = httpx.post(f"{url}/tokenize", headers=auth, json={"prompt": "Hello", "add_generation_prompt": True})
        assert bad.status_code == 400 and "add_generation_prompt" in bad.text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(lines.lines)


# ---- 3. help never cuts a flag's name -------------------------------------------------------

def test_the_issues_help_command_finds_the_flag() -> None:
    r = subprocess.run(["bash", "-c", "COLUMNS=80 tieredkv serve --help | grep -- --served-model-name"],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--served-model-name" in r.stdout, (r.stdout, r.stderr)
    top = subprocess.run(["tieredkv", "--help"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert re.search(r"^  --version\s+Print the version", top.stdout, re.M) and "<bool>" not in top.stdout, top.stdout


@pytest.mark.parametrize("columns", ["40", "80", "200"])
def test_no_help_cuts_an_option_name_at_any_width(columns: str) -> None:
    import typer.main

    from tieredkv.cli import app
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        r = subprocess.run([sys.executable, "-m", "tieredkv.cli", name, "--help"], cwd=REPO,
                           env={**ENV, "COLUMNS": columns}, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        flags = [f for p in command.params for f in (*p.opts, *p.secondary_opts) if f.startswith("-")]
        for flag in flags:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", r.stdout), (name, columns, flag)
        assert "…" not in r.stdout, (name, columns)
