"""Shared fixtures. Keep this small: a fixture belongs here only when several test packages use it."""
from __future__ import annotations

import os
import sys

import pytest

# The console scripts (`tieredkv`) are installed beside the interpreter that runs the tests
# (.venv/bin); put that folder first on PATH so subprocesses find them even when the venv was
# not activated (the README runs `.venv/bin/python -m pytest`).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# Load deadlines (engine/load_deadline.py) give a load up once recomputing would have finished:
# for the tests' tiny models that is milliseconds, and a busy CI machine can take longer than that
# to schedule a loader thread at nice +10, so a test asserting a tier's hit (in this process or in
# a `tieredkv serve`/`demo` subprocess, which inherit this) would see it computed instead. Every
# test is patient; the deadline's own tests move the scheduler's clock past any slack.
os.environ.setdefault("TIEREDKV_LOAD_DEADLINE_SLACK_S", "60")
os.environ.setdefault("TIEREDKV_PROBE_WAIT_SLACK_S", "60")     # a remote probe's wait likewise
# The disk writer's encode process runs at SCHED_IDLE while sequences decode (storage/codec/
# encode_process.py): it gets a CPU only when no other process wants one, and with `-n 2` the other
# test worker keeps both busy, so a flush behind it waits for seconds. The suite runs the child at
# nice +10 (the same process, the same checks); tests/storage/test_encode_process.py runs both.
os.environ.setdefault("TIEREDKV_ENCODE_PROCESS", "nice")


def pytest_collection(session: pytest.Session) -> None:
    """Say what the seconds before pytest's first line are (issue 40): collecting imports torch,
    transformers and the engine. Not under -qq, nor in an xdist worker (the controller says it)."""
    if hasattr(session.config, "workerinput") or session.config.get_verbosity() < -1:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("tieredkv: collecting the tests (importing torch, transformers and the engine takes "
                            "a few seconds) ...")


# The suite writes only into pytest's temporary directories (tests/sandbox.py): HOME,
# TIEREDKV_HOME and TMPDIR point into the session's basetemp from configure on (xdist's workers
# and every child process inherit them), and the session fails if the user's real cache root
# (less models/, whose existing conversions the sandbox reads) or the real /tmp gained files of ours.
@pytest.hookimpl(trylast=True)      # after pytest's tmpdir plugin has set up the basetemp
def pytest_configure(config: pytest.Config) -> None:
    from tests import sandbox
    if hasattr(config, "workerinput"):
        return                           # an xdist worker: the controller set the sandbox
    base = config._tmp_path_factory.getbasetemp() / "sandbox"
    config.stash[_SNAPSHOT] = sandbox.enter(base)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    snapshot = session.config.stash.get(_SNAPSHOT, None)
    if snapshot is None:
        return
    from tests import sandbox
    leaked = sandbox.leaks(snapshot)
    session.config.stash[_LEAKED] = leaked
    if leaked and session.exitstatus == pytest.ExitCode.OK and os.environ.get(sandbox.LEAKS) != "warn":
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    leaked = config.stash.get(_LEAKED, [])
    if leaked:
        from tests import sandbox
        terminalreporter.section("written outside the suite's temporary directories", red=True)
        for path in leaked:
            terminalreporter.write_line(path)
        terminalreporter.write_line("(the suite must write only under pytest's basetemp: tests/sandbox.py. A "
                                    "tieredkv or another checkout's suite run meanwhile shows here too: "
                                    f"{sandbox.LEAKS}=warn reports without failing)")


_SNAPSHOT = pytest.StashKey["object"]()
_LEAKED = pytest.StashKey[list]()


@pytest.fixture(scope="session", autouse=True)
def billing_spill_dir(tmp_path_factory):
    """Bills a closing server could write nowhere beside its ledger go to the fallback directory
    (engine/billing_spill.py): the session's own, never the user's ~/.local/state (subprocess
    servers inherit it)."""
    path = tmp_path_factory.mktemp("billing-spill")
    old = os.environ.get("TIEREDKV_BILLING_SPILL_DIR")
    os.environ["TIEREDKV_BILLING_SPILL_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TIEREDKV_BILLING_SPILL_DIR", None)
    else:
        os.environ["TIEREDKV_BILLING_SPILL_DIR"] = old


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct), loaded once per session on the 'auto' device.

    Loaded through the sandbox's cache root (tests/sandbox.py), where the user's real cache's
    conversion is linked when there is one: the one-time GGUF conversion (~25 s on 2 cores) made
    by the demo or the server is read, never made again, and later loads take ~4 s. Without
    one, the session converts once into the sandbox (its xdist workers share it).
    """
    from engine.model import load_model
    return load_model()


@pytest.fixture(scope="session")
def default_model_converted(request) -> None:
    """The default model's one-time conversion exists (done here, once, if it does not)."""
    from tests.service.tiny_engine import default_tokenizer_dir
    if default_tokenizer_dir() is None:
        request.getfixturevalue("default_model")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_converted: None):
    """A random-weight Llama saved as a transformers directory with the real tokenizer and a 4k
    context (the demo's document fits): `serve --model`, `demo --model` and the benchmarks'
    `--model` load it in seconds."""
    import torch
    from transformers import LlamaForCausalLM

    from tests.service.tiny_engine import default_tokenizer_dir, load_tokenizer, tiny_config
    tokenizer = load_tokenizer(default_tokenizer_dir())
    config = tiny_config(len(tokenizer))
    config.max_position_embeddings = 4096
    path = tmp_path_factory.mktemp("tiny-4k")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Real Valkey servers (tools/valkey_servers.py), shared by the storage and engine tests of the
# remote tier. Session-scoped: starting a cluster takes ~2 s. Tests share them safely because each
# uses its own namespace (keys are namespaced: storage/remote/tier.py). A test that stops or
# restarts a server starts its own.
@pytest.fixture(scope="session")
def valkey():
    """A standalone valkey-server on a free loopback port."""
    from tools.valkey_servers import ValkeyServer
    server = ValkeyServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def valkey_cluster():
    """A 3-node valkey cluster (cluster-enabled, no replicas) on free loopback ports."""
    from tools.valkey_servers import ValkeyCluster
    cluster = ValkeyCluster()
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()


@pytest.fixture
def tmpfs(tmp_path):
    """Mount real, small tmpfs filesystems (`tmpfs("16m")` -> its path), unmounted after the test:
    what a full disk is, for the tests that need one. Needs root, as our machines and CI have."""
    import subprocess
    mounted = []

    def mount(size: str):
        mnt = tmp_path / f"fs{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"mounting a tmpfs needs root (CI and our machines have it): {r.stderr}"
        mounted.append(mnt)
        return mnt
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.fixture
def ext4(tmp_path):
    """A real ext4 in a loop-mounted image (tests/ext4_image.py), at `ext4.path`, that the test can
    abort under a live process (`abort()`) and bring back (`recover()`). Skipped, saying why,
    where it cannot be made (not root, no loop devices)."""
    from tests.ext4_image import Ext4Image
    where = tmp_path / "ext4"
    where.mkdir()
    fs = Ext4Image.make(where)
    if isinstance(fs, str):
        pytest.skip(fs)
    yield fs
    fs.cleanup()
