"""Issue 44, item 3, through a real server: the filesystem holding only the cache's kv/ (a
loop-mounted ext4, tests/ext4_image.py; billing/ beside it elsewhere) frozen with `fsfreeze -f`
while it serves. /health answers (a load balancer's probe, 10 s deadline), completions are
answered (what the disk holds served as misses), /v1/cache/status says the disk stalled, and once
the filesystem thaws the tier writes and hits again by itself. The server runs in its own process,
so a server that stands still fails the probe instead of stopping the test. Skipped where the image
cannot be mounted (not root) or fsfreeze is missing.
"""
from __future__ import annotations

import shutil
import time

import httpx
import pytest

from tests.service.conftest import ServerProcess, check_usage
from tests.service.test_billing_aborted_fs import COMPL, until


def complete(c: httpx.Client, model: str, prompt: str) -> dict:
    r = c.post(COMPL, json={"model": model, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    check_usage(r.json()["usage"])
    return r.json()["usage"]


def disk_hits(c: httpx.Client, model: str, prompt: str) -> int:
    return complete(c, model, prompt)["prompt_cache_hit_tokens_by_tier"]["disk"]


def only_on_disk(c: httpx.Client) -> None:
    """Every cached block pushed down to disk, and the device and host tiers emptied."""
    for body in ({}, {"tier": "device"}, {"tier": "host"}):
        assert c.post("/v1/cache/flush", json=body).status_code == 200


def disk_state(c: httpx.Client) -> dict:
    r = c.get("/v1/cache/status")
    assert r.status_code == 200, r.text
    return r.json()["tiers"]["disk"]


def test_a_frozen_cache_filesystem_leaves_health_and_completions_answering(ext4, tokenizer_dir, tmp_path) -> None:
    if shutil.which("fsfreeze") is None:
        pytest.skip("fsfreeze is not installed")
    root = tmp_path / "cache"
    root.mkdir()
    (root / "kv").symlink_to(ext4.path)            # only kv/ on the filesystem that freezes
    srv = ServerProcess(root, tokenizer_dir)
    try:
        with srv.client() as c:
            model = c.get("/health").json()["model"]
            stored = "a prompt the disk tier holds when its filesystem freezes " * 3
            complete(c, model, stored)
            only_on_disk(c)
            assert disk_hits(c, model, stored) > 0
            only_on_disk(c)
            health: list[float] = []
            ext4.freeze(guard_s=180)
            try:
                with httpx.Client(base_url=srv.url, timeout=10) as probe:     # a load balancer's deadline

                    def healthy() -> None:
                        start = time.monotonic()
                        assert probe.get("/health").status_code == 200
                        health.append(time.monotonic() - start)

                    for _ in range(3):
                        healthy()
                    complete(probe, model, stored)                     # computed (the disk held it)
                    until(lambda: disk_state(probe)["writes_off"] is not None, "the disk tier stalled")
                    assert "frozen or hung" in disk_state(probe)["writes_off"]
                    for i in range(3):
                        healthy()
                        assert disk_hits(probe, model, stored) == 0
                        complete(probe, model, f"a new prompt while frozen {i} " * 4)
                    assert probe.get("/ready").json()["tiers"]["disk"] == "writes off"
                assert not ext4.thawed_by_guard.exists()
            finally:
                ext4.thaw()
            print(f"\n/health while frozen: {len(health)} answers, slowest {max(health):.3f} s")
            until(lambda: disk_state(c)["writes_off"] is None, "the disk tier back after the thaw")
            fresh = "a prompt written once the filesystem thawed " * 3
            complete(c, model, fresh)
            only_on_disk(c)
            assert disk_hits(c, model, fresh) > 0                          # written, and read back
            only_on_disk(c)
            assert disk_hits(c, model, stored) > 0                         # what it held before
            assert disk_state(c)["read_errors"] == 0
    finally:
        srv.stop()
