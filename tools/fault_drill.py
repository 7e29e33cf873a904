"""Fault drill: attack the disk tier and the engine as an adversary and a careless operator would,
and count what matters: wrong bytes served (must be 0), crashes (must be 0), acknowledged blocks
lost after kill -9 (must be 0), and requests failed that did not cause the fault (must be 0).

    python tools/fault_drill.py            # the default size runs in about a minute or two
    python tools/fault_drill.py --json --kills 20 --flips 300

Attacks (each on real LMDB files and real processes):
  kill9        a writer process killed with SIGKILL at a random moment, again and again; after each,
               the store must open, pass check() and verify(), and hold every block the writer had
               acknowledged (flush() returned) before it died.
  byte_flip    one random byte of data.mdb flipped (anywhere: meta pages, branch pages, payloads),
               then a fresh process opens the store and reads every block. A block served must be
               bit-identical to what was stored; anything else must be a miss. Runs in a child
               process, so a crash (e.g. SIGBUS) is counted rather than fatal to the drill.
  truncate     data.mdb cut at a random length: the same rules.
  swap         payloads rotated among keys (what a damaged page pointer does): nothing served.
  full_disk    writes into a small tmpfs until it is full: no crash, flush() False, the store
               opens afterwards (skipped, and said so, where tmpfs cannot be mounted).
  read_errors  an engine serving concurrent requests while every disk read fails: every request
               completes with the same greedy tokens as without the fault.
Prints a table, and with --json one JSON object.
"""
from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lmdb  # noqa: E402
import torch  # noqa: E402

from storage.disk.tier import DiskTier  # noqa: E402
from storage.hashing import BlockKey, hash_block, root_hash  # noqa: E402

NAMESPACE = b"\x07" * 32
SHAPE = (2, 2, 16, 3, 8)
CAP = 256 << 20

# The child scripts below import these helpers from this module (tools/ on their path).


def make_key(i: int) -> BlockKey:
    parent = root_hash(NAMESPACE)
    tokens = tuple(range(16 * i, 16 * i + 16))
    return BlockKey(hash_block(parent, tokens), parent, tokens, NAMESPACE)


def make_block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(SHAPE, generator=g)


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and torch.equal(a.view(torch.int32), b.view(torch.int32))


def child(code: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


READ_ALL = """
    import json, sys
    sys.path.insert(0, "tools")
    from fault_drill import make_block, make_key, same
    from storage.disk.tier import DiskTier
    path, n = sys.argv[1], int(sys.argv[2])
    try:
        t = DiskTier(path, 256 << 20)
    except Exception as e:
        print(json.dumps({"opened": False, "why": f"{type(e).__name__}: {e}"[:200]}))
        sys.exit(0)
    right = wrong = missed = 0
    for i in range(n):
        got = t.get(make_key(i))
        if got is None:
            missed += 1
        elif same(got, make_block(i)):
            right += 1
        else:
            wrong += 1
    problems = t.check()
    t.close()
    print(json.dumps({"opened": True, "right": right, "wrong": wrong, "missed": missed,
                      "recovered": t.recovered is not None, "audit_problems": len(problems)}))
"""


def populate(path: Path, n: int) -> None:
    with DiskTier(str(path), CAP) as t:
        for i in range(n):
            t.put(make_key(i), make_block(i))


def read_all(path: Path, n: int) -> dict:
    r = child(READ_ALL, path, n)
    if r.returncode != 0:
        return {"opened": False, "crash": r.returncode, "why": r.stderr[-300:]}
    return json.loads(r.stdout)


def attack_damage(base: Path, n: int, trials: int, damage, rng: random.Random) -> dict:
    """Copy the populated store, damage the copy, read everything in a child; count outcomes."""
    out = {"trials": trials, "wrong_bytes_served": 0, "crashes": 0, "blocks_served": 0, "blocks_missed": 0,
           "moved_aside": 0, "audit_problems": 0}
    for trial in range(trials):
        work = Path(tempfile.mkdtemp(prefix="drill-"))
        try:
            shutil.copytree(base, work / "kv")
            damage(work / "kv", rng)
            res = read_all(work / "kv", n)
            if "crash" in res:
                out["crashes"] += 1
                continue
            if not res["opened"]:
                continue                # refused with a reason: fine, nothing served
            out["wrong_bytes_served"] += res["wrong"]
            out["blocks_served"] += res["right"]
            out["blocks_missed"] += res["missed"]
            out["moved_aside"] += res["recovered"]
            out["audit_problems"] += res["audit_problems"]
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def flip_byte(path: Path, rng: random.Random) -> None:
    data = path / "data.mdb"
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        at = rng.randrange(size)
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))


def truncate(path: Path, rng: random.Random) -> None:
    data = path / "data.mdb"
    os.truncate(data, rng.randrange(os.path.getsize(data)))


def swap_payloads(path: Path, rng: random.Random) -> None:
    env = lmdb.open(str(path), max_dbs=4)
    try:
        db = env.open_db(b"payload")
        with env.begin(write=True) as txn:
            keys = [k for k, _ in txn.cursor(db=db)]
            picked = rng.sample(keys, min(len(keys), 8))
            vals = [bytes(txn.get(k, db=db)) for k in picked]
            for k, v in zip(picked, vals[1:] + vals[:1]):
                txn.put(k, v, db=db)
    finally:
        env.close()


WRITER = """
    import sys
    sys.path.insert(0, "tools")
    from fault_drill import make_block, make_key
    from storage.disk.tier import DiskTier
    t = DiskTier(sys.argv[1], 256 << 20, batch_blocks=8)
    i = int(sys.argv[2])
    while True:
        t.put(make_key(i), make_block(i))
        i += 1
        if i % 16 == 0:
            if t.flush():
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
            from fault_drill import make_block, make_key
            from storage.disk.tier import DiskTier
            t = DiskTier(sys.argv[1], 64 << 20, map_size=64 << 20)     # the map is larger than the disk
            for i in range(1500):                   # ~9 MiB of blocks into a 4 MiB filesystem
                t.put(make_key(i), make_block(i))
            complete = t.flush()
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
            eng.cache.disk.flush()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=64, help="blocks in the attacked store")
    ap.add_argument("--flips", type=int, default=40, help="byte-flip trials")
    ap.add_argument("--truncations", type=int, default=10)
    ap.add_argument("--swaps", type=int, default=5)
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    started = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="drill-base-"))
    try:
        populate(base / "kv", args.blocks)
        results = {
            "byte_flip": attack_damage(base / "kv", args.blocks, args.flips, flip_byte, rng),
            "truncate": attack_damage(base / "kv", args.blocks, args.truncations, truncate, rng),
            "swap": attack_damage(base / "kv", args.blocks, args.swaps, swap_payloads, rng),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["kill9"] = attack_kill9(args.kills, rng)
    results["full_disk"] = attack_full_disk()
    results["read_errors"] = attack_read_errors(args.requests)
    wrong = sum(r.get("wrong_bytes_served", 0) for r in results.values())
    crashes = sum(r.get("crashes", 0) for r in results.values())
    summary = {"wrong_bytes_served": wrong, "crashes": crashes,
               "acknowledged_blocks_lost": results["kill9"]["acknowledged_blocks_lost"],
               "requests_failed_not_causing_the_fault": results["read_errors"]["failed"],
               "elapsed_s": round(time.perf_counter() - started, 1)}
    report = {"attacks": results, "summary": summary, "args": vars(args)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'attack':<12} result")
    for name, r in results.items():
        print(f"{name:<12} " + ", ".join(f"{k}={v}" for k, v in r.items()))
    print("summary      " + ", ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
