"""The `tieredkv` command line, run as a user runs it: a subprocess, its output, its exit status.

The cache the commands read is made by a real tiny engine (random-weight Llama, block size 4)
whose requests are known exactly, so block counts, tree shape and bills are asserted exactly.
One test serves the real default model (`tieredkv serve`) and reads it with `status` and
`billing --url`; one runs `tieredkv demo --json` on it (about a minute on 2 cores).
The remote tier's commands run against real valkey servers (tools/valkey_servers.py): `serve`
with a password-protected store on a tiny random-weight model, `inspect --remote-url` on a
standalone store and the 3-node cluster, and the demo's remote phase on the tiny model.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import lmdb
import pytest
from transformers import LlamaConfig

from engine.model import model_from_config
from tieredkv import CacheConfig, Engine, SamplingParams

REPO = Path(__file__).resolve().parents[1]
BLOCK = 4
ENV = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}

# alice asks A, then A2 (A's first 8 blocks + 16 new tokens); bob asks A. max_tokens=1, so
# only prompt tokens have KV: A -> 10 blocks, A2 -> 12 blocks of which 8 are A's.
A = [(7 * i + 3) % 128 for i in range(40)]
A2 = A[:32] + [(11 * i + 5) % 128 for i in range(16)]


def tkv(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tieredkv.cli", *args], cwd=REPO, env={**ENV, **env},
                          capture_output=True, text=True, timeout=timeout)


def tkv_json(*args: str) -> dict:
    r = tkv(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def is_progress(line: str) -> bool:
    """A progress line a pipe gets while a step runs (tieredkv/cli_common.spinner): `tieredkv:
    Loading X ...` when it starts, `tieredkv: Loading X: done in 4.4 s` when it ends."""
    return re.match(r"tieredkv: .*( \.\.\.|: done in \d+\.\d s)$", line) is not None


def assert_one_line_error(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not is_progress(ln)]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict:
    """<root>/kv and <root>/billing written by a closed tiny engine; namespaces by tenant."""
    root = tmp_path_factory.mktemp("cache")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = CacheConfig(block_size=BLOCK, device_memory="256KiB", host_memory="256KiB",
                      disk_dir=str(root / "kv"), disk_capacity="64MiB")
    with Engine.from_loaded(model_from_config(config, seed=0), cfg) as eng:
        one = SamplingParams(max_tokens=1)
        usages = [eng.generate(A, one, tenant="alice").usage, eng.generate(A2, one, tenant="alice").usage,
                  eng.generate(A, one, tenant="bob").usage]
        ns = {t: eng.namespace(t).hex() for t in ("alice", "bob")}
        # Exact hits (storage/exact_entry.py): each computed prompt (all three) also keeps its raw
        # logits as blocks of no tokens after its last block; A and A2 fill their last block, so
        # no tail block. Every count below adds these logits blocks.
        chains = [eng.exact_keys(ids, eng.namespace("alice")) for ids in (A, A2)]
        assert all(c is not None and c.tail is None for c in chains)
        logits = len(chains[0].logits)
    # The bills asserted below follow from these (A2 hits A's 8 shared blocks in the device pool).
    assert [u.hit_tokens_by_tier["device"] for u in usages] == [0, 32, 0]
    return {"root": root, "ns": ns, "logits": logits}


def copy_of(cache: dict, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(cache["root"], dst)
    return dst


def damage_one_payload(kv: Path) -> bytes:
    """Flip a byte in the middle of the first stored payload, behind the tier's back."""
    env = lmdb.open(str(kv), max_dbs=4)
    try:
        db = env.open_db(b"payload")
        with env.begin(write=True) as txn:
            h, v = next(iter(txn.cursor(db=db)))
            b = bytearray(v)
            b[len(b) // 2] ^= 0x01
            txn.put(h, bytes(b), db=db)
    finally:
        env.close()
    return bytes(h)


# ---- help and bad input --------------------------------------------------------------------

def test_help_lists_every_command_without_importing_torch() -> None:
    r = tkv("--help")
    assert r.returncode == 0
    for cmd in ("serve", "demo", "status", "inspect", "verify", "billing"):
        assert re.search(rf"^\W*{cmd}\s", r.stdout, re.M), cmd
    script = shutil.which("tieredkv")        # the console script pyproject.toml declares
    assert script is not None and subprocess.run([script, "--help"], capture_output=True).returncode == 0
    r = tkv("verify", "--help")
    assert r.returncode == 0 and "--repair" in r.stdout and "Exit status" in r.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys, tieredkv.cli; print('torch' in sys.modules)"],
                           cwd=REPO, env=ENV, capture_output=True, text=True)
    assert probe.stdout.strip() == "False"


def test_version_and_h_work_everywhere() -> None:
    import tieredkv
    r = tkv("--version")
    assert (r.returncode, r.stdout) == (0, f"tieredkv {tieredkv.__version__}\n"), r.stderr
    for cmd in ((), ("serve",), ("demo",), ("status",), ("inspect",), ("verify",), ("billing",)):
        r = tkv(*cmd, "-h")
        assert r.returncode == 0 and "Usage:" in r.stdout and "--help" in r.stdout, (cmd, r.stderr)
    # --version is a flag: no value type after it (issue 40 saw `--version <bool>`).
    assert re.search(r"^\s+--version\s+Print the version", tkv("--help").stdout, re.M), tkv("--help").stdout
    serve_help = tkv("serve", "-h").stdout
    for flag in ("MODEL", "--model", "--served-model-name", "--max-model-len", "--access-log"):
        assert flag in serve_help, flag


def test_serve_options_are_checked_before_the_model_loads(tmp_path: Path) -> None:
    root = str(tmp_path / "srv")
    assert_one_line_error(tkv("serve", "model-a", "--model", "model-b", "--cache-dir", root), 2,
                          "give the model once", "'model-a'", "'model-b'")
    assert_one_line_error(tkv("serve", "--max-model-len", "1", "--cache-dir", root), 2, "--max-model-len", ">= 2")
    assert_one_line_error(tkv("serve", "--served-model-name", " ", "--cache-dir", root), 2, "--served-model-name")
    assert_one_line_error(tkv("serve", "--log-level", "loud", "--cache-dir", root), 2, "--log-level", "'loud'")
    assert not os.path.exists(root)


def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    assert_one_line_error(tkv("verify", "--cache-dir", missing), 2, "nowhere")
    assert_one_line_error(tkv("inspect", "--cache-dir", missing), 2, "nowhere")
    assert_one_line_error(tkv("billing", "--cache-dir", missing), 2, "no billing ledger")
    assert_one_line_error(tkv("billing", "--cache-dir", missing, "--url", "http://127.0.0.1:1"), 2, "not both")
    assert_one_line_error(tkv("serve", "--cache-dir", missing, "--device-memory", "12XB"), 2, "--device-memory", "12XB")
    assert_one_line_error(tkv("serve", "--cache-dir", missing, "--codec", "lz4"), 2, "--codec", "lz4")
    assert_one_line_error(tkv("status", "--url", "ftp://example"), 2, "--url")
    with socket.socket() as s:              # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert_one_line_error(tkv("status", "--url", f"http://127.0.0.1:{port}"), 1, "cannot reach", str(port))
    assert not os.path.exists(missing)      # nothing was created on the way


# ---- inspect, verify, billing on a prepared cache --------------------------------------------

def test_inspect_counts_blocks_per_namespace_and_draws_the_prefix_tree(cache: dict) -> None:
    report = tkv_json("inspect", "--cache-dir", str(cache["root"]), "--tree")
    # 24 KV blocks (alice 14, bob 10) and each of the three computed prompts' logits blocks,
    # which hold no tokens.
    L = cache["logits"]
    assert report["blocks"] == 24 + 3 * L
    assert {n["namespace"]: (n["blocks"], n["tokens"]) for n in report["namespaces"]} == {
        cache["ns"]["alice"]: (14 + 2 * L, 14 * BLOCK), cache["ns"]["bob"]: (10 + L, 10 * BLOCK)}
    assert all(n["model"] is None for n in report["namespaces"])
    # A logits block is a page like any: layers, K/V, tokens, heads, dim, fp32
    assert report["raw_bytes"] == (24 + 3 * L) * 2 * 2 * BLOCK * 2 * 16 * 4

    def shape(n: dict) -> tuple:
        return (n["first_block"], n["blocks"], tuple(shape(c) for c in n["children"]))
    # alice: A and A2 share 8 blocks, then A has 2 more and A2 4 more, each chain ending in its
    # prompt's logits blocks; chains are folded.
    tree = report["tree"]
    assert [shape(n) for n in tree[cache["ns"]["alice"]]] == [(0, 8, ((8, 4 + L, ()), (8, 2 + L, ())))]
    assert [shape(n) for n in tree[cache["ns"]["bob"]]] == [(0, 10 + L, ())]
    # No tokenizer belongs to a random model: previews are the token ids.
    assert tree[cache["ns"]["bob"]][0]["preview"].startswith("ids " + " ".join(map(str, A[:4])))

    r = tkv("inspect", "--cache-dir", str(cache["root"]), "--tree")
    assert r.returncode == 0 and f"{24 + 3 * L} blocks" in r.stdout and cache["ns"]["alice"][:10] in r.stdout
    # Labels add up: a node's KV blocks and their tokens, then the prompt's exact entry (its logits
    # blocks hold no tokens: not counted as blocks of the prompt, issue 40).
    logits = f"logits: {L} block{'s' if L != 1 else ''}"
    for label in ("blocks 0-7 (32 tok) (reads", f"blocks 8-11 (16 tok) + exact entry ({logits})",
                  f"blocks 8-9 (8 tok) + exact entry ({logits})", f"blocks 0-9 (40 tok) + exact entry ({logits})",
                  f"{14 + 2 * L} blocks (14 of KV, {2 * L} of exact entries)"):
        assert label in r.stdout, (label, r.stdout)


def test_prefix_tree_keeps_blocks_whose_parent_is_gone_as_orphan_trees() -> None:
    from storage.disk.tier import DiskBlockInfo
    from storage.hashing import block_keys
    from tieredkv.inspect_tree import build_forest
    ns = b"n" * 32
    keys = block_keys(ns, list(range(24)), BLOCK)             # one chain of 6 blocks
    stored = [DiskBlockInfo(k.hash, k.parent, ns, k.token_ids, 64, 32, 0, 0, 0.0) for i, k in enumerate(keys) if i != 2]
    nodes = build_forest(stored)[ns]
    assert [(n.depth, n.orphan, n.hashes) for n in nodes] == [
        (0, False, [keys[0].hash, keys[1].hash]),
        (None, True, [k.hash for k in keys[3:]])]
    assert nodes[1].token_ids == list(range(12, 24))


def test_tree_labels_count_an_exact_entrys_tail_and_logits_apart_from_the_prompts_blocks() -> None:
    """Issue 40: a prompt ending in a partial block keeps a 1-token tail block and its logits
    (blocks of no tokens); beside a longer prompt that branch read `blocks 2-3 (1 tok)`."""
    from rich.console import Console

    from storage.disk.tier import DiskBlockInfo
    from storage.hashing import block_keys, hash_block, root_hash
    from tieredkv.inspect_tree import Survey, build_forest, forest_tree
    ns = b"m" * 32
    keys = block_keys(ns, list(range(16)), BLOCK)                 # a 16-token prompt: blocks 0-3
    tail = hash_block(keys[1].hash, (99,))                         # a 9-token prompt: blocks 0-1 + 1 tail token
    logits = hash_block(tail, ())
    assert keys[0].parent == root_hash(ns)
    stored = [DiskBlockInfo(k.hash, k.parent, ns, k.token_ids, 64, 32, 0, 0, 0.0) for k in keys]
    stored += [DiskBlockInfo(tail, keys[1].hash, ns, (99,), 64, 32, 0, 0, 0.0),
               DiskBlockInfo(logits, tail, ns, (), 64, 32, 0, 0, 0.0)]
    s = Survey({}, build_forest(stored), {}, {}, {b.hash: len(b.token_ids) for b in stored})
    console = Console(width=200, record=True)
    console.print(forest_tree(s, 5, 5))
    text = console.export_text()
    assert "6 blocks (4 of KV, 2 of exact entries)" in text, text
    assert "blocks 0-1 (8 tok)" in text and "blocks 2-3 (8 tok)" in text, text
    assert "exact entry after block 1 (1 tail tok + logits: 1 block)" in text, text
    assert "(1 tok)" not in text, text


def test_billing_from_the_ledger_file(cache: dict) -> None:
    body = tkv_json("billing", "--cache-dir", str(cache["root"]))
    alice, bob = body["tenants"]["alice"], body["tenants"]["bob"]
    assert (alice["requests"], alice["prompt_tokens"], alice["hit_tokens_by_tier"], alice["miss_tokens"],
            alice["completion_tokens"]) == (2, 88, {"device": 32, "host": 0, "disk": 0, "remote": 0}, 56, 2)
    assert (bob["requests"], bob["prompt_tokens"], bob["miss_tokens"], bob["completion_tokens"]) == (1, 40, 40, 1)
    # Default prices in pico-dollars per token: miss 270_000, hit 27_000, output 1_100_000.
    assert alice["cost_pico"] == 56 * 270_000 + 32 * 27_000 + 2 * 1_100_000
    assert body["total"]["requests"] == 3
    assert tkv_json("billing", "--cache-dir", str(cache["root"]), "--tenant", "bob")["requests"] == 1
    r = tkv("billing", "--cache-dir", str(cache["root"]))
    assert r.returncode == 0
    rows = {cells[0]: cells[1:] for cells in map(str.split, r.stdout.splitlines()) if cells[:1] in (["alice"], ["bob"])}
    assert rows == {"alice": ["2", "88", "32", "0", "0", "0", "56", "2", "18.184"],
                    "bob": ["1", "40", "0", "0", "0", "0", "40", "1", "11.900"]}


def test_verify_finds_damage_exits_1_and_repair_deletes_it(cache: dict, tmp_path: Path) -> None:
    root = copy_of(cache, tmp_path)
    stored = 24 + 3 * cache["logits"]        # KV blocks and the three prompts' logits blocks
    r = tkv("verify", "--cache-dir", str(root))
    assert r.returncode == 0 and f"checked {stored} blocks" in r.stdout and "0 damaged" in r.stdout
    h = damage_one_payload(root / "kv")
    r = tkv("verify", "--cache-dir", str(root))
    assert r.returncode == 1 and "1 damaged" in r.stdout and h.hex()[:16] in r.stdout and "--repair" in r.stdout
    assert r.stderr == ""       # damage is a finding, reported on stdout; not an error of the command
    r = tkv("verify", "--cache-dir", str(root), "--json")
    assert r.returncode == 1
    assert [(d["hash"], d["reason"].split(":")[0]) for d in json.loads(r.stdout)["blocks"]] == [(h.hex(), "codec")]
    r = tkv("verify", "--cache-dir", str(root), "--repair")
    assert r.returncode == 0 and "1 damaged, 1 deleted" in r.stdout
    assert tkv_json("verify", "--cache-dir", str(root)) == {"path": str(root / "kv"), "checked": stored - 1, "damaged": 0,
                                                            "repaired": 0, "blocks": [], "store": [],
                                                            "store_repaired": []}


def test_verify_of_a_sealed_disk_tier_checks_seals_with_its_secret_only(tmp_path: Path) -> None:
    """serve --seal-disk's store (storage/disk/seal.py): verify needs the fleet secret and checks
    each seal; without it, or on an unsealed store with one, a one-line error (exit 2)."""
    from storage.disk.seal import DiskSeal
    from storage.disk.tier import DiskTier
    from storage.fleet_secret import load_fleet_secret
    from tests.storage.conftest import block_data, keys
    secret_file = tmp_path / "fleet.secret"
    seal = DiskSeal(load_fleet_secret(str(secret_file)))
    ks = keys(5, ns=os.urandom(32))
    for name, sealed in (("sealed", seal), ("plain", None)):
        with DiskTier(str(tmp_path / name / "kv"), 1 << 22, seal=sealed) as t:
            assert all(t.put(k, block_data(k)) for k in ks) and t.drain(10)
    sealed_root, plain_root = str(tmp_path / "sealed"), str(tmp_path / "plain")
    assert_one_line_error(tkv("verify", "--cache-dir", sealed_root), 2, "sealed", "--cache-secret-file")
    r = tkv("verify", "--cache-dir", sealed_root, "--cache-secret-file", str(secret_file))
    assert r.returncode == 0 and "checked 5 blocks" in r.stdout and "0 damaged" in r.stdout, r.stdout + r.stderr
    assert_one_line_error(tkv("verify", "--cache-dir", plain_root, "--cache-secret-file", str(secret_file)), 2,
                          "not sealed")


# ---- the real default model: serve + status/billing over HTTP, and the demo ------------------

class Lines:
    """Reads a pipe on a thread (so the child never blocks on a full pipe); wait() for a pattern."""

    def __init__(self, pipe) -> None:
        import threading
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: [self.lines.append(ln) for ln in pipe], daemon=True)
        self._thread.start()

    def wait(self, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ln in list(self.lines):
                if m := re.search(pattern, ln):
                    return m
            assert proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in {timeout}s: {''.join(self.lines)}")


def test_serve_then_status_and_billing_over_http(tmp_path: Path, default_model_converted: None) -> None:
    root = tmp_path / "srv"
    prices = tmp_path / "prices.toml"
    prices.write_text("miss = 1_000_000\n")       # $1 per 1M missed tokens; the other prices stay default
    proc = subprocess.Popen([sys.executable, "-m", "tieredkv.cli", "serve", "--port", "0", "--cache-dir", str(root),
                             "--device-memory", "64MiB", "--host-memory", "32MiB", "--log-level", "warning",
                             "--prices", str(prices)],
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = Lines(proc.stderr).wait(r"serving SmolLM2-135M-Instruct on (http://127\.0\.0\.1:\d+)", proc, 180)[1]
        prompt = "A home battery stores solar energy during the day so that the house can use it at night. " * 3
        r = httpx.post(f"{url}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt,
                                                     "max_tokens": 2, "user": "carol"}, timeout=120)
        assert r.status_code == 200, r.text
        p, c = r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]
        status = tkv_json("status", "--url", url)
        # Full blocks: KV exists for the prompt and the first generated token. Then the prompt's
        # exact entry (storage/exact_entry.py): its partial tail block, when it has one (the first
        # generated token is written into a copy of it), and its raw logits (the lm_head's width,
        # in the model's dtype) padded to whole blocks.
        from tests.service.tiny_engine import default_tokenizer_dir
        vocab = json.loads((Path(default_tokenizer_dir()) / "config.json").read_text())["vocab_size"]
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[status["dtype"]]
        logits = -(-vocab * itemsize // status["block_bytes"])
        blocks = (p + 1) // 16 + (p % 16 != 0) + logits
        assert set(status["tiers"]) == {"device", "host", "disk", "remote"} and status["tiers"]["device"]["blocks"] == blocks
        r = tkv("status", "--url", url)
        assert r.returncode == 0 and "SmolLM2-135M-Instruct" in r.stdout
        assert "compute or load (auto): " in r.stdout and "hit tokens recomputed by choice" in r.stdout
        assert all(re.search(rf"^\W*{t}\s", r.stdout, re.M) for t in ("device", "host", "disk", "remote"))
        bill = tkv_json("billing", "--url", url)["tenants"]["carol"]
        assert (bill["requests"], bill["prompt_tokens"], bill["miss_tokens"]) == (1, p, p)
        assert bill["cost_pico"] == p * 1_000_000 + c * 1_100_000     # --prices took effect (output: default)
        assert tkv_json("billing", "--url", url, "--tenant", "carol")["requests"] == 1
        # Issue 7, item 12: 80 columns lose no column and cut no number; an OpenAI-style base URL
        # (.../v1) and $TIEREDKV_URL reach the same server.
        narrow = tkv("status", "--url", url, COLUMNS="80")
        assert narrow.returncode == 0 and "…" not in narrow.stdout, narrow.stdout
        assert all(h in narrow.stdout for h in ("Tier", "Capacity", "Used", "Blocks", "Hit tok", "Evicted"))
        narrow = tkv("billing", "--url", url, COLUMNS="80")
        assert "…" not in narrow.stdout and "Tenant" in narrow.stdout and "carol" in narrow.stdout, narrow.stdout
        assert tkv_json("status", "--url", f"{url}/v1")["tiers"]["device"]["blocks"] == blocks
        r = tkv("billing", "--json", TIEREDKV_URL=url, TIEREDKV_HOME=str(tmp_path / "nothing-here"))
        assert r.returncode == 0 and json.loads(r.stdout)["tenants"]["carol"]["requests"] == 1, r.stderr
        # The server's own error message comes through, in one line.
        assert_one_line_error(tkv("billing", "--url", url, "--tenant", "x\ty"), 1, "HTTP 400", "tenant")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    # Shut down cleanly: the ledger and the flushed blocks are on disk, readable without a server.
    assert tkv_json("billing", "--cache-dir", str(root))["tenants"]["carol"]["requests"] == 1
    report = tkv_json("inspect", "--cache-dir", str(root))
    assert report["blocks"] == blocks
    from engine.model import resolve_dtype        # bfloat16 on a CPU with native bf16, else float32
    dtype = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    assert [n["label"] for n in report["namespaces"]] == [f"SmolLM2-135M-Instruct ({dtype}), tenant carol"]


def test_demo_json_hits_every_tier_and_matches_the_ledger(tmp_path: Path, default_model_converted: None) -> None:
    demo_dir = tmp_path / "demo"
    r = tkv("demo", "--json", "--cache-dir", str(demo_dir), timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    phases = {p["name"]: p["rows"] for p in report["phases"]}
    assert list(phases) == ["document", "chat", "host", "restart"]
    assert [r["request"] for r in phases["restart"]] == ["Q1 again", "Q3 again", "turn 3 again"]
    rows = [row for p in report["phases"] for row in p["rows"]]
    for row in rows:
        assert row["hit_tokens"] + row["miss_tokens"] == row["prompt_tokens"], row
        assert sum(row["hit_tokens_by_tier"].values()) == row["hit_tokens"], row
        assert 0 < row["cost_pico"] <= row["recompute_cost_pico"], row
    doc = phases["document"]
    assert doc[0]["hit_tokens"] == 0 and all(r["hit_tokens_by_tier"]["device"] > 1000 for r in doc[1:])
    chat = phases["chat"]
    # Each turn hits the previous turn's prompt *and* the model's answer to it.
    assert chat[1]["hit_tokens"] > chat[0]["prompt_tokens"] and chat[2]["hit_tokens"] > chat[1]["prompt_tokens"]
    assert phases["host"][0]["hit_tokens_by_tier"]["host"] > 1000
    restart = phases["restart"]
    assert restart[0]["hit_tokens_by_tier"]["disk"] > 1000 and restart[0]["hit_tokens_by_tier"]["device"] == 0
    assert all(r["hit_tokens_by_tier"]["disk"] > 0 for r in restart)
    # The cost column is the ledger's: the demo's cache dir holds the same bill.
    bill = tkv_json("billing", "--cache-dir", str(demo_dir))["tenants"]["demo"]
    assert bill["requests"] == len(rows) == report["totals"]["requests"]
    assert bill["cost_pico"] == sum(r["cost_pico"] for r in rows) == report["totals"]["cost_pico"]
    assert bill["hit_tokens_by_tier"] == report["totals"]["hit_tokens_by_tier"]


def test_verify_and_inspect_refuse_a_truncated_disk_tier_and_repair_moves_it_aside(tmp_path: Path) -> None:
    # Issue 7, item 6: mapping a truncated data.mdb was a SIGBUS in verify and inspect.
    from storage.disk.tier import DiskTier
    from tests.storage.disk_tier_child import make_block, make_key
    kv = tmp_path / "kv"
    with DiskTier(str(kv), 64 << 20) as t:
        for i in range(20):
            t.put(make_key(i), make_block(i))
    os.truncate(kv / "data.mdb", os.path.getsize(kv / "data.mdb") // 2)
    r = tkv("verify", "--cache-dir", str(tmp_path))
    assert r.returncode == 1 and "damaged disk tier" in r.stdout + r.stderr and "truncated" in r.stdout + r.stderr
    r = tkv("inspect", "--cache-dir", str(tmp_path))
    assert r.returncode == 1 and "truncated" in r.stderr, (r.returncode, r.stderr)
    r = tkv("verify", "--cache-dir", str(tmp_path), "--repair")
    assert r.returncode == 0 and "moved aside" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert not kv.exists() and len(list(tmp_path.glob("kv.damaged-*"))) == 1


def test_demo_on_a_short_context_model_says_what_it_needs(tmp_path: Path, default_model_converted: None) -> None:
    # Issue 7, item 12: a 1k-context model used to fail deep inside with "prompt: ... no room".
    from tests.service.tiny_engine import default_tokenizer_dir, load_tokenizer, tiny_config
    from transformers import LlamaForCausalLM
    tokenizer = load_tokenizer(default_tokenizer_dir())
    model_dir = tmp_path / "tiny-1k"
    LlamaForCausalLM(tiny_config(len(tokenizer))).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    r = tkv("demo", "--model", str(model_dir), "--cache-dir", str(tmp_path / "demo"), timeout=300)
    assert_one_line_error(r, 2, "--model", "context", "1,024")


# ---- the remote tier: serve --remote-url, status, inspect --remote-url -----------------------

def test_serve_with_a_remote_store_never_shows_its_password(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tools.valkey_servers import ValkeyServer
    password = "hunter2-not-for-logs"
    store = ValkeyServer("--requirepass", password)
    store.start()
    proc = None
    try:
        url = f"valkey://:{password}@127.0.0.1:{store.port}"
        # The URL from the environment (keeps the password out of `ps`), the other options as flags.
        proc = subprocess.Popen([sys.executable, "-m", "tieredkv.cli", "serve", "--model", str(tiny_model_dir),
                                 "--port", "0", "--cache-dir", str(tmp_path / "srv"), "--device-memory", "8MiB",
                                 "--host-memory", "8MiB", "--log-level", "warning", "--remote-write", "write_through",
                                 "--remote-timeout", "2", "--remote-ttl", "3600"],
                                cwd=REPO, env={**ENV, "TIEREDKV_REMOTE_URL": url}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        lines = Lines(proc.stderr)
        server = lines.wait(r"serving \S+ on (http://127\.0\.0\.1:\d+)", proc, 180)[1]
        lines.wait(rf"remote tier valkey://:\*\*\*@127\.0\.0\.1:{store.port} \(write_through\): reachable", proc, 30)
        r = httpx.post(f"{server}/v1/completions", json={"model": tiny_model_dir.name, "prompt": "Shared caches " * 20,
                                                         "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        status = tkv_json("status", "--url", server)["tiers"]["remote"]
        assert status["url"] == f"valkey://:***@127.0.0.1:{store.port}" and status["write_policy"] == "write_through"
        table = tkv("status", "--url", server)
        assert table.returncode == 0 and re.search(r"^\W*remote\s+shared\s", table.stdout, re.M), table.stdout
        assert "breaker closed" in table.stdout and f":***@127.0.0.1:{store.port}" in table.stdout
        for text in (table.stdout, json.dumps(status), httpx.get(f"{server}/metrics").text):
            assert password not in text
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            assert password not in "".join(lines.lines)
        store.cleanup()


def test_serve_like_vllm_serve_summary_request_lines_and_the_flush_at_exit(tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:
    """Issue 20, item 3: `tieredkv serve MODEL` with vLLM's flags; what it prints at start, per
    request and at shutdown."""
    root = tmp_path / "srv"
    too_long = tkv("serve", str(tiny_model_dir), "--port", "0", "--cache-dir", str(root), "--device-memory", "64KiB",
                   "--max-model-len", "4096", "--dtype", "float32")
    # float32 (auto would be bf16 on a CPU with native bf16, halving every page's bytes):
    # 64 KiB holds 8 pages of 16 tokens of the tiny model (8 KiB each): 128 tokens, not 4,096.
    assert_one_line_error(too_long, 2, "--max-model-len", "do not fit the device pool", "holds 128",
                          "--device-memory is 64KiB")
    proc = subprocess.Popen([sys.executable, "-m", "tieredkv.cli", "serve", str(tiny_model_dir), "--model",
                             str(tiny_model_dir), "--port", "0", "--cache-dir", str(root), "--device-memory", "8MiB",
                             "--host-memory", "8MiB", "--served-model-name", "tiny", "--max-model-len", "512",
                             "--dtype", "float32"],
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc.stderr)
        url = lines.wait(r"serving \S+ on (http://127\.0\.0\.1:\d+)", proc, 180)[1]
        lines.wait(r"Uvicorn running|Application startup complete", proc, 60)
        summary = "".join(lines.lines)
        # The start-up heap is frozen before the first request (tieredkv/startup_heap.py), said only
        # at DEBUG (tests/test_cli_flags.py's server runs at debug and finds the count).
        assert "start-up objects frozen" not in summary
        for row in (r"model\s+tiny-4k\w*, served as 'tiny'", r"device\s+cpu, float32, attention gather_sdpa",
                    r"context\s+512 tokens \(max model len\), set by max_model_len; the model allows 4,096",
                    r"device pool\s+8\.0MiB: 1,024 pages of 16 tokens \(8\.0KiB each\)", r"host tier\s+8\.0MiB",
                    rf"disk tier\s+{re.escape(str(root / 'kv'))}, capacity 50\.0GiB", r"remote tier\s+off",
                    rf"listen\s+{re.escape(url)}"):
            assert re.search(row, summary), (row, summary)
        assert httpx.get(f"{url}/v1/models").json()["data"][0] == {**httpx.get(f"{url}/v1/models").json()["data"][0],
                                                                   "id": "tiny", "max_model_len": 512}
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Shared caches " * 20,
                                                      "max_tokens": 2, "user": "carol"}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
        p = r.json()["usage"]["prompt_tokens"]
        lines.wait(rf"tieredkv.requests: id={r.headers['x-request-id']} tenant=carol POST /v1/completions 200 "
                   rf"prompt_tokens={p} completion_tokens=2 hit_tokens=device:0,host:0,disk:0,remote:0 ttft_ms=",
                   proc, 30)
        assert httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "Shared caches " * 20}).json()["count"] == p
        bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": "hot"})
        assert bad.status_code == 400
        lines.wait(r"POST /v1/completions 400 .*reason=\"temperature: ", proc, 30)
        assert httpx.get(f"{url}/docs").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    text = "".join(lines.lines)
    flushed = int(re.search(r"engine closed: flushed (\d+) blocks", text)[1])
    assert flushed == tkv_json("inspect", "--cache-dir", str(root))["blocks"] > 0
    assert '"POST /v1/completions HTTP/1.1"' not in text       # uvicorn's access line: off by default


def test_remote_options_are_checked_before_anything_loads(tmp_path: Path) -> None:
    root = str(tmp_path / "srv")
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--remote-ttl", "60"), 2, "--remote-ttl", "--remote-url")
    r = tkv("serve", "--cache-dir", root, "--remote-url", "valkey://:pw-secret@host:6379?bogus=1")
    assert_one_line_error(r, 2, "remote_url", "bogus")
    assert "pw-secret" not in r.stderr and ":***@host" in r.stderr
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--remote-url", "valkey://h:1", "--remote-write", "later"),
                          2, "remote_write")
    assert_one_line_error(tkv("inspect", "--remote-url", "valkey://h:1", "--tree"), 2, "--tree")
    loose = tmp_path / "loose.secret"                   # a fleet secret any local user could read
    loose.write_text(os.urandom(32).hex())
    loose.chmod(0o644)
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--remote-url", "valkey://h:1", "--cache-secret-file",
                              str(loose)), 2, "--cache-secret-file", "chmod 600")
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--cache-secret-file", str(loose)), 2,
                          "--cache-secret-file", "--remote-url")
    assert_one_line_error(tkv("inspect", "--cache-dir", root, "--verify"), 2, "--verify", "--remote-url")
    assert_one_line_error(tkv("inspect", "--remote-url", "valkey://h:1", "--namespace", "abc"), 2, "--namespace")
    with socket.socket() as s:              # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert_one_line_error(tkv("inspect", "--remote-url", f"valkey://127.0.0.1:{port}"), 1, "remote store",
                          str(port))


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_inspect_remote_lists_verifies_and_repairs_the_store(where: str, request, tmp_path: Path) -> None:
    from storage.remote.value import remote_key
    from tests.storage.test_remote_tier import raw_client
    from tools.valkey_servers import ValkeyServer
    from storage.hashing import block_keys
    own = None
    if where == "standalone":
        own = ValkeyServer().start()        # a store of its own: the whole listing is this test's
        url = own.url
    else:
        url = request.getfixturevalue("valkey_cluster").url
    try:
        tenant = f"remote-inspect-{os.urandom(4).hex()}"
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
                             bos_token_id=None, eos_token_id=None, pad_token_id=None)
        cfg = CacheConfig(block_size=BLOCK, device_memory="256KiB", host_memory="256KiB",
                          disk_dir=str(tmp_path / "kv"), disk_capacity="64MiB", remote_url=url)
        with Engine.from_loaded(model_from_config(config, seed=0), cfg) as eng:
            eng.generate(A, SamplingParams(max_tokens=1), tenant=tenant)      # 10 blocks; close() sends them
            ns = eng.namespace(tenant)
            # + A's logits blocks (an exact entry, storage/exact_entry.py; no tail: A fills its last block)
            chain = eng.exact_keys(A, ns)
        assert chain is not None and chain.tail is None
        stored = 10 + len(chain.logits)
        args = ("inspect", "--remote-url", url) + (() if own else ("--namespace", ns.hex()))
        report = tkv_json(*args)
        assert [(n["namespace"], n["blocks"], n["tokens"]) for n in report["namespaces"]] == [(ns.hex(), stored, 40)]
        assert report["cluster"] == (where == "cluster") and len(report["nodes"]) == (3 if where == "cluster" else 1)
        assert sum(n["tieredkv_keys"] for n in report["nodes"]) == stored     # a cluster: every primary scanned
        if where == "cluster":
            return      # verify and repair on a cluster: tests/storage/test_remote_inspect.py (each CLI run ~5 s)

        raw = raw_client(url)
        damaged = remote_key(block_keys(ns, A, BLOCK)[4])
        raw.set(damaged, raw.get(damaged)[:-100])           # a truncated value, SET behind the tier's back
        r = tkv(*args, "--verify")
        assert r.returncode == 1 and f"{stored} blocks" in r.stdout and ns.hex()[:10] in r.stdout, r.stdout
        assert f"checked {stored} values" in r.stdout and "1 damaged" in r.stdout and damaged.decode() in r.stdout
        assert "--repair" in r.stdout and all(is_progress(ln) for ln in r.stderr.splitlines()), r.stderr
        r = tkv(*args, "--repair", "--json")
        assert r.returncode == 0, r.stderr
        v = json.loads(r.stdout)["verify"]
        assert (v["checked"], v["damaged"], v["repaired"]) == (stored, 1, 1) and v["values"][0]["key"] == damaged.decode()
        assert raw.exists(damaged) == 0 and raw.exists(remote_key(block_keys(ns, A, BLOCK)[5])) == 1
        # Under a secret that is not the fleet's, nothing verifies and nothing is deleted (exit 1);
        # without the secret file, verify cannot start (exit 2).
        other = tmp_path / "other.secret"
        other.write_text(os.urandom(32).hex())
        other.chmod(0o600)
        r = tkv(*args, "--repair", "--cache-secret-file", str(other))
        assert r.returncode == 1 and f"{stored - 1} sealed under another fleet secret" in r.stdout, r.stdout
        assert raw.exists(remote_key(block_keys(ns, A, BLOCK)[5])) == 1
        assert_one_line_error(tkv(*args, "--verify", "--cache-secret-file", str(tmp_path / "absent")), 2,
                              "no such file", "--cache-secret-file")
    finally:
        if own is not None:
            own.cleanup()


def test_demo_with_a_remote_store_ends_with_a_second_server_hitting_it(tmp_path: Path, tiny_model_dir: Path,
                                                                       valkey) -> None:
    """The demo's remote phase, on the tiny model (the real model's run of the other phases is
    test_demo_json_hits_every_tier_and_matches_the_ledger): a second engine with an empty disk
    gets the first one's blocks from the store, billed as remote hits in the demo's one ledger."""
    demo_dir = tmp_path / "demo"
    r = tkv("demo", "--json", "--model", str(tiny_model_dir), "--cache-dir", str(demo_dir), "--remote-url", valkey.url,
            "--max-tokens", "4", timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    phases = {p["name"]: p["rows"] for p in report["phases"]}
    assert list(phases) == ["document", "chat", "host", "restart", "remote"]
    # A namespace of this run's own: the shared store's earlier runs cannot make the first question a hit.
    assert report["tenant"].startswith("demo-") and report["remote"] == valkey.url
    assert phases["document"][0]["hit_tokens"] == 0
    q2, turn2 = phases["remote"]
    assert (q2["request"], turn2["request"]) == ("Q2 again", "turn 2 again")
    for row in (q2, turn2):
        tiers = row["hit_tokens_by_tier"]
        assert tiers["remote"] > 0 and tiers["device"] == tiers["host"] == tiers["disk"] == 0, row
        assert row["hit_tokens"] + row["miss_tokens"] == row["prompt_tokens"]
    assert q2["hit_tokens_by_tier"]["remote"] > 1000                 # the shared manual, from the store
    bill = tkv_json("billing", "--cache-dir", str(demo_dir))["tenants"][report["tenant"]]
    assert bill["requests"] == report["totals"]["requests"] == sum(len(rows) for rows in phases.values())
    assert bill["hit_tokens_by_tier"] == report["totals"]["hit_tokens_by_tier"]
    assert bill["cost_pico"] == report["totals"]["cost_pico"]


def test_demo_runs_again_and_again_on_one_cache_dir(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Issue 17, item 5: a second `tieredkv demo` on the same dir was refused for the disk tier's
    own lock file (kv.open-lock). Two runs in a row each tell the whole story from an empty
    cache, the second beside the first's lock file and its store that `verify --repair` moved aside
    (the demo's too); a foreign file is refused. (A third run repeated the second's case.)"""
    demo_dir = tmp_path / "demo"
    for run in range(2):
        if run == 1:        # the kv of run 0, damaged and moved aside (kv.damaged-<stamp>-<pid>)
            data = demo_dir / "kv" / "data.mdb"
            os.truncate(data, os.path.getsize(data) // 2)
            r = tkv("verify", "--cache-dir", str(demo_dir), "--repair")
            assert r.returncode == 0 and len(list(demo_dir.glob("kv.damaged-*"))) == 1, (r.stdout, r.stderr)
        r = tkv("demo", "--json", "--model", str(tiny_model_dir), "--cache-dir", str(demo_dir), "--max-tokens", "2",
                timeout=600)
        assert r.returncode == 0, (run, r.stderr)
        report = json.loads(r.stdout)
        phases = {p["name"]: p["rows"] for p in report["phases"]}
        # Cleared at start: the first question misses, the restart hits what this run wrote to disk.
        assert phases["document"][0]["hit_tokens"] == 0, run
        assert phases["restart"][0]["hit_tokens_by_tier"]["disk"] > 1000, run
        assert sorted(os.listdir(demo_dir)) == ["billing", "kv", "kv.open-lock"], run
        bill = tkv_json("billing", "--cache-dir", str(demo_dir))["tenants"]["demo"]
        assert bill["requests"] == report["totals"]["requests"], run      # this run's ledger only
    (demo_dir / "notes.txt").write_text("mine")
    r = tkv("demo", "--model", str(tiny_model_dir), "--cache-dir", str(demo_dir))
    assert_one_line_error(r, 2, "notes.txt", "did not make")
    assert sorted(os.listdir(demo_dir)) == ["billing", "kv", "kv.open-lock", "notes.txt"]


def test_demo_cache_dir_reset_knows_what_the_demo_and_its_tiers_make(tmp_path: Path) -> None:
    from storage.disk.preflight import move_aside, opening
    from tieredkv.demo import reset_cache_dir
    d = tmp_path / "demo"
    for sub in ("kv", "billing", "server2/kv", "old"):
        (d / sub).mkdir(parents=True)
        (d / sub / "data.mdb").write_bytes(b"x")
    for kv in (d / "kv", d / "server2" / "kv"):
        with opening(str(kv)):
            pass
    aside = move_aside(str(d / "old"), "test")                 # as the disk tier names a moved-aside store
    os.rename(aside, d / ("kv" + aside[len(str(d / "old")):]))
    assert len(os.listdir(d)) == 5 and len(list(d.glob("kv.damaged-*"))) == 1
    reset_cache_dir(d)
    assert sorted(os.listdir(d)) == ["kv.open-lock"]
    for foreign in ("kv.damaged-", "kvx.open-lock", "server2.open-lock", "notes.txt"):
        (d / "billing").mkdir()
        (d / foreign).write_text("not the demo's")
        with pytest.raises(ValueError, match=re.escape(foreign)):
            reset_cache_dir(d)
        assert (d / "billing").is_dir()          # nothing deleted
        (d / foreign).unlink()
        (d / "billing").rmdir()


def test_small_mistakes_get_an_error_that_names_what_the_user_typed(cache: dict) -> None:
    """Issue 20's small things: a bad size names its flag, --cache-dir given the disk tier itself
    names its parent, an unknown tenant is said to be unknown (it used to print a row of zeros)."""
    root = cache["root"]
    assert_one_line_error(tkv("serve", "--device-memory", "1XB"), 2, "--device-memory", "'1XB'")
    assert_one_line_error(tkv("inspect", "--cache-dir", str(root / "kv")), 2,
                          "is a disk tier, not a cache dir", f"--cache-dir {root}")
    assert_one_line_error(tkv("billing", "--cache-dir", str(root), "--tenant", "nope"), 1,
                          "no such tenant 'nope'", "alice", "bob")
    assert tkv_json("billing", "--cache-dir", str(root), "--tenant", "alice")["requests"] == 2


# ---- the first hour (issue 20, items 1-2): an empty disk tier and a slow hit explained ----------

def test_inspect_says_why_the_disk_tier_is_empty_and_how_to_fill_it(tmp_path: Path, cache: dict) -> None:
    from storage.disk.tier import DiskTier
    DiskTier(str(tmp_path / "kv"), 64 << 20).close()           # as a server leaves it before any flush
    r = tkv("inspect", "--cache-dir", str(tmp_path), "--tree", TIEREDKV_URL="http://127.0.0.1:8123")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "0 blocks" in text
    for words in ("written back", "evict", "on a flush", "when the server shuts down", "tieredkv status",
                  "curl -s -X POST http://127.0.0.1:8123/v1/cache/flush -H 'content-type: application/json' -d '{}'",
                  "Ctrl-C flushes"):
        assert words in text, words
    assert "Cached prefixes" not in text                        # no empty tree under it
    full = tkv("inspect", "--cache-dir", str(cache["root"]))
    assert full.returncode == 0 and "written back" not in full.stdout


def test_demo_says_why_a_hit_is_slower_than_recomputing() -> None:
    from rich.console import Console

    from engine.model import DEFAULT_MODEL_NAME
    from tieredkv.demo import DEFAULT_MODEL, Phase, Row, phase_view, slow_hit_note
    assert DEFAULT_MODEL == DEFAULT_MODEL_NAME

    def row(label: str, hits: dict[str, int], ttft: float, recompute: float) -> Row:
        hit = sum(hits.values())
        return Row("chat", label, "q?", "a.", 40, {"device": 0, "host": 0, "disk": 0, "remote": 0, **hits}, hit, 40 - hit,
                   4, ttft, 1.0, recompute, round(recompute / ttft, 2), 1, 2)
    slow = row("turn 1", {"disk": 16}, ttft=50.0, recompute=40.0)          # 0.8x
    rows = [slow, row("turn 2", {"device": 32}, ttft=10.0, recompute=40.0),   # 4.0x
            row("turn 3", {}, ttft=38.0, recompute=40.0),                     # a miss: nothing to explain
            row("turn 4", {"host": 16}, ttft=41.0, recompute=40.0)]           # 0.98x: shown as 1.0x
    assert [slow_hit_note(r) is not None for r in rows] == [True, False, False, False]
    console = Console(record=True, width=400)
    console.print(phase_view(Phase("chat", "A chat", rows)))
    lines = [ln for ln in console.export_text().splitlines() if "0.8x:" in ln]
    assert len(lines) == 1, console.export_text()
    assert ("turn 1, 0.8x: recomputing all 40 tokens takes only 40 ms here, about what reading 16 back from disk "
            "costs") in lines[0]


# ---- route ---------------------------------------------------------------------------------

def test_route_is_listed_and_its_options_are_checked_before_it_binds() -> None:
    assert re.search(r"^\W*route\s", tkv("--help").stdout, re.M)
    r = tkv("route", "-h")
    assert r.returncode == 0 and "--backend" in r.stdout and "--in-flight-tokens" in r.stdout
    assert tkv("route").returncode == 2                      # --backend is required
    assert_one_line_error(tkv("route", "--backend", "ftp://127.0.0.1:1"), 2, "--backend", "ftp://")
    assert_one_line_error(tkv("route", "--backend", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:1/"), 2,
                          "given twice")
    assert_one_line_error(tkv("route", "--backend", "http://127.0.0.1:1", "--health-interval", "0"), 2,
                          "health_interval")


def test_kv_events_keys_and_the_flags_that_take_them_are_checked_before_anything_loads(tmp_path: Path) -> None:
    """`tieredkv kv-events-keys DIR` writes a router's keypair (the secret 0600); serve refuses a tcp
    endpoint without subscribers' keys, an ipc socket others could reach, both token flags; route
    refuses a key file that is not a secret certificate. Token ids are off unless asked for."""
    import stat

    from tieredkv.cli_serve import kv_events_options
    keys = tmp_path / "keys"
    r = tkv("kv-events-keys", str(keys))
    assert r.returncode == 0 and "router.key_secret" in r.stderr, r.stderr
    assert stat.S_IMODE((keys / "router.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert_one_line_error(tkv("kv-events-keys", str(keys)), 2, "router.key", "exists")
    root = str(tmp_path / "srv")
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--kv-events", "tcp://127.0.0.1:0"), 2,
                          "tcp://127.0.0.1:0", "any local user", "--kv-events-allow-keys", "kv-events-keys")
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--kv-events"), 2, "tcp://127.0.0.1:5557",
                          "any local user")
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--kv-events", f"ipc://{tmp_path}/open/e.sock"), 2,
                          "open to other users")
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--kv-events-tokens", "--kv-events-no-tokens"), 2,
                          "--kv-events-tokens", "--kv-events-no-tokens")
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--kv-events-allow-keys", str(keys)), 2,
                          "--kv-events-allow-keys", "needs --kv-events")
    assert_one_line_error(tkv("serve", "--cache-dir", root, "--kv-events", "tcp://127.0.0.1:0",
                              "--kv-events-allow-keys", str(tmp_path / "none")), 2, "kv_events_allow_keys", "none")
    assert not os.path.exists(root)
    assert_one_line_error(tkv("route", "--backend", "http://127.0.0.1:1", "--kv-events-key", str(keys / "router.key")),
                          2, "--kv-events-key", "public key only")
    # the flags as CacheConfig fields: tokens off by default, the server's secret under the cache root
    opts = kv_events_options(tmp_path, "tcp://127.0.0.1:0", None, str(keys), None, False, False, 300.0)
    assert opts["kv_events_tokens"] is False and opts["kv_events_secret_file"] == str(tmp_path / "kv-events" /
                                                                                      "server.key_secret")
    assert CacheConfig(disk_dir=None, **opts).kv_events_tokens is False
    tokens = kv_events_options(tmp_path, "tcp://127.0.0.1:0", None, str(keys), None, True, False, 300.0)
    no_tokens = kv_events_options(tmp_path, "tcp://127.0.0.1:0", None, str(keys), None, False, True, 300.0)
    assert tokens["kv_events_tokens"] is True
    assert no_tokens["kv_events_tokens"] is False       # --kv-events-no-tokens: the default, said aloud
    ipc = kv_events_options(tmp_path, "ipc:///x/e.sock", None, None, None, False, False, 300.0)
    assert ipc["kv_events_secret_file"] is None and ipc["kv_events_allow_keys"] is None


def test_route_in_front_of_two_served_models_follows_the_prefix_and_exits_cleanly(tmp_path: Path,
                                                                                  tiny_model_dir: Path) -> None:
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, Lines]:
        p = subprocess.Popen([sys.executable, "-m", "tieredkv.cli", *args], cwd=REPO, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        return p, Lines(p.stderr)
    try:
        # The events take CURVE keys: the router's keypair made by `tieredkv kv-events-keys`, its
        # public half allowed by both servers (each makes its own keypair under its cache dir).
        assert tkv("kv-events-keys", str(tmp_path / "keys")).returncode == 0
        urls = []
        for name in ("a", "b"):
            p, lines = start("serve", "--model", str(tiny_model_dir), "--port", "0", "--cache-dir", str(tmp_path / name),
                             "--device-memory", "8MiB", "--host-memory", "8MiB", "--log-level", "warning",
                             "--kv-events", "tcp://127.0.0.1:0", "--kv-events-allow-keys", str(tmp_path / "keys"))
            urls.append(lines.wait(r"serving \S+ on (http://127\.0\.0\.1:\d+)", p, 180)[1])
        assert (tmp_path / "a" / "kv-events" / "server.key_secret").exists()
        # The router at its default log level: its health probes of the backends (every 2 s) must
        # not each log a line (httpx's INFO lines only come with --log-level debug).
        router, lines = start("route", "--port", "0", "--backend", urls[0], "--backend", urls[1],
                              "--kv-events-key", str(tmp_path / "keys" / "router.key_secret"))
        url = lines.wait(r"routing on (http://127\.0\.0\.1:\d+) over 2 backends", router, 60)[1]
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert health["backends_up"] == 2
        assert all(b["events"] is not None and b["events"]["replays"] >= 1 for b in health["backends"]), health
        prefix = "A long shared system prompt that one server computes and the other never sees. " * 6
        homes = []
        for q in ("First?", "Second?", "Third?"):
            r = httpx.post(f"{url}/v1/completions", json={"model": tiny_model_dir.name, "prompt": prefix + q,
                                                          "max_tokens": 2, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            homes.append(r.headers["x-tieredkv-backend"])
        assert homes[0] in urls and homes == [homes[0]] * 3
        assert r.json()["usage"]["prompt_cache_hit_tokens"] > 0
        deadline = time.monotonic() + 20
        while True:                      # the index learns the prefix from the server's own events
            home = next(b for b in httpx.get(f"{url}/health", timeout=30).json()["backends"] if b["url"] == homes[0])
            if home["index_blocks"] > 0 and home["events"]["batches"] > 0:
                break
            assert time.monotonic() < deadline, home
            time.sleep(0.1)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert f'tieredkv_router_requests_total{{backend="{homes[0]}",status="200"}} 3.0' in metrics
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=60) == 0
        logged = "".join(lines.lines)
        assert "HTTP Request:" not in logged, logged
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
