"""Shared fixtures. Keep this small: a fixture belongs here only when several test packages use it."""
from __future__ import annotations

import os
import sys

import pytest

# The console scripts (`tieredkv`) are installed beside the interpreter that runs the tests
# (.venv/bin); put that folder first on PATH so subprocesses find them even when the venv was
# not activated (the README runs `.venv/bin/python -m pytest`).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct), loaded once per session on the 'auto' device.

    Uses the real user cache (storage.config.default_cache_root()), so the one-time GGUF
    conversion (~25 s on 2 cores) is shared with later sessions, the demo and the server;
    later sessions load the cached safetensors in about a second.
    """
    from engine.model import load_model
    return load_model()
