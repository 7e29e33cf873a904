"""CURVE keys for tests that publish or subscribe to KV events over tcp (a tcp endpoint takes them:
storage/kv_events/access.py). One client keypair per test process, written as `tieredkv
kv-events-keys` writes one (storage/kv_events/keys.py), and the server's secret certificate
beside it, made by the first server that starts; `events_options()` are the CacheConfig fields
that allow that client."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from storage.kv_events.keys import CurveKeypair, read_keypair, write_keypair

_dir: Path | None = None


def key_dir() -> Path:
    """A 0700 directory with router.key, router.key_secret (and server.key_secret once a server started)."""
    global _dir
    if _dir is None:
        _dir = Path(tempfile.mkdtemp(prefix="tkv-keys-"))
        atexit.register(shutil.rmtree, _dir, True)
        write_keypair(_dir, "router")
    return _dir


def client_keypair() -> CurveKeypair:
    return read_keypair(key_dir() / "router.key_secret", "test")


def client_secret_file() -> str:
    return str(key_dir() / "router.key_secret")


def events_options(endpoint: str = "tcp://127.0.0.1:0") -> dict:
    """CacheConfig fields: events on `endpoint`, the test client's key allowed."""
    return {"kv_events": endpoint, "kv_events_allow_keys": str(key_dir() / "router.key"),
            "kv_events_secret_file": str(key_dir() / "server.key_secret")}
