"""The fault drill's attacks outside the damaged-store trials: kill -9 of a writer (acknowledged
blocks must survive), a full disk (a small tmpfs), and every disk read failing under an engine
serving concurrent requests. Each returns its counts as a dict; knows nothing of the trials.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lmdb  # noqa: E402

from drill_store import CAP, REPO, child, make_block, make_key, same  # noqa: E402
from storage.disk.tier import DiskTier  # noqa: E402

WRITER = """
    import sys
    sys.path.insert(0, "tools")
    from drill_store import make_block, make_key
    from storage.disk.tier import DiskTier
    t = DiskTier(sys.argv[1], 256 << 20, batch_blocks=8)
    i = int(sys.argv[2])
    while True:
        t.put(make_key(i), make_block(i))
        i += 1
        if i % 16 == 0:
            if t.drain():
                print(f"acked {i}", flush=True)
"""


def attack_kill9(kills: int, rng: random.Random) -> dict:
    out = {"kills": kills, "reopen_failures": 0, "audit_problems": 0, "verify_damage": 0,
           "acknowledged_blocks_lost": 0, "acknowledged_blocks": 0}
    work = Path(tempfile.mkdtemp(prefix="drill-kill9-"))
    try:
        acked = 0
        for k in range(kills):
            p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(work), str(acked)], cwd=REPO,
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
            deadline = time.monotonic() + rng.uniform(0.3, 1.5)
            last = acked
            while time.monotonic() < deadline:
                line = p.stdout.readline()
                if line.startswith("acked"):
                    last = int(line.split()[1])
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            acked = last
            try:
                with DiskTier(str(work), CAP) as t:
                    out["audit_problems"] += len(t.check())
                    out["verify_damage"] += len(t.verify().damaged)
                    lost = sum(not same(t.get(make_key(i)), make_block(i)) for i in range(acked))
                    out["acknowledged_blocks_lost"] += lost
            except Exception:
                out["reopen_failures"] += 1
        out["acknowledged_blocks"] = acked
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def attack_full_disk() -> dict:
    mnt = Path(tempfile.mkdtemp(prefix="drill-tmpfs-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(mnt, ignore_errors=True)
        return {"skipped": f"cannot mount a tmpfs here: {r.stderr.strip()[:120]}"}
    out = {"crashes": 0, "flush_said_complete_after_loss": 0, "reopened": False, "audit_problems": 0}
    try:
        res = child("""
            import json, sys
            sys.path.insert(0, "tools")
            from drill_store import make_block, make_key
            from storage.disk.tier import DiskTier
            t = DiskTier(sys.argv[1], 64 << 20, map_size=64 << 20)     # the map is larger than the disk
            for i in range(1500):                   # ~9 MiB of blocks into a 4 MiB filesystem
                t.put(make_key(i), make_block(i))
            complete = t.drain()
            s = t.stats()
            t.close()
            print(json.dumps({"complete": complete, "write_errors": s.write_errors, "evictions": s.evictions}))
        """, mnt / "kv")
        if r.returncode != 0 and res.returncode != 0:
            out["crashes"] += 1
        elif res.returncode != 0:
            out["crashes"] += 1
            out["why"] = res.stderr[-300:]
        else:
            got = json.loads(res.stdout)
            out.update(got)
            out["flush_said_complete_after_loss"] = int(got["complete"] and got["write_errors"] > 0)
        with DiskTier(str(mnt / "kv"), 64 << 20) as t:
            out["reopened"] = True
            out["audit_problems"] = len(t.check())
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)
    return out


def attack_read_errors(requests: int) -> dict:
    """Concurrent requests on a real tiny engine while every disk read fails."""
    import threading
    from transformers import LlamaConfig
    from engine.model import model_from_config
    from tieredkv import CacheConfig, Engine, SamplingParams

    class ReadsFail:
        def __init__(self, env):
            self._env = env

        def begin(self, *a, write=False, **kw):
            if not write:
                raise lmdb.ReadersFullError("MDB_READERS_FULL (injected)")
            return self._env.begin(*a, write=write, **kw)

        def __getattr__(self, name):
            return getattr(self._env, name)

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
    prompts = [[(7 * i + j) % 128 for j in range(40)] for i in range(requests)]
    greedy = SamplingParams(max_tokens=8)
    with tempfile.TemporaryDirectory() as tmp:
        cache = CacheConfig(block_size=4, device_memory="256KiB", host_memory="256KiB", disk_dir=f"{tmp}/kv",
                            disk_capacity="64MiB")
        with Engine(model_from_config(config, seed=0), cache) as eng:
            expected = [eng.generate(p, greedy).token_ids for p in prompts]
            eng.cache.demote("device")
            eng.cache.demote("host")
            eng.cache.disk.drain()
            healthy = eng.cache.disk._gate._env
            eng.cache.disk._gate._env = ReadsFail(healthy)
            results: list = [None] * requests

            def one(i):
                try:
                    results[i] = eng.generate(prompts[i], greedy).token_ids
                except Exception as e:
                    results[i] = e
            threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            eng.cache.disk._gate._env = healthy
            read_errors = eng.cache.disk.stats().read_errors
    return {"requests": requests, "failed": sum(isinstance(r, Exception) for r in results),
            "wrong_tokens": sum(r != e for r, e in zip(results, expected) if not isinstance(r, Exception)),
            "read_errors_counted": read_errors}

