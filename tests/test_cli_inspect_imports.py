"""`tieredkv inspect` and `verify` on a real 1,000-block disk tier import neither torch nor
transformers (issue 31, item 6: importing them was most of the 23.5 s and 11.4 s they took), and
inspect still names the model of each namespace -- from the identity a real load of a converted
GGUF recorded beside its conversion, not by loading transformers.

Checked by the child's own import log (`python -X importtime`), not by a clock: the times are in
docs/BENCHMARKS.md ("CLI inspect and verify").
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from storage.codec.payload import Codec
from storage.disk.tier import DiskTier
from storage.hashing import block_keys, namespace_digest, tenant_salt

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
BLOCKS = 1000
CHAINS = 10                        # of 100 blocks each, half in the shared namespace, half the default tenant's


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict:
    """<root>/models/<tiny GGUF's conversion> (a real conversion and load, which records the
    identity) and <root>/kv: 1,000 blocks in the two namespaces the engine derives for it."""
    from engine.model import load_model
    from tests.engine.test_model import write_tiny_gguf
    root = tmp_path_factory.mktemp("inspect1000")
    gguf = root / "tiny.gguf"
    write_tiny_gguf(gguf)
    loaded = load_model(str(gguf), device="cpu", dtype="float32", cache_dir=str(root))
    ns = {"default": namespace_digest(loaded.identity, BLOCK, tenant_salt("default")),
          None: namespace_digest(loaded.identity, BLOCK, tenant_salt("default", isolate_tenants=False))}
    g = torch.Generator().manual_seed(0)
    with DiskTier(str(root / "kv"), 256 << 20, Codec()) as tier:
        for c in range(CHAINS):
            tokens = [(7 * i + 131 * c) % 50 for i in range(BLOCK * BLOCKS // CHAINS)]
            for key in block_keys(ns["default" if c % 2 else None], tokens, BLOCK):
                tier.put(key, (torch.randn((2, 2, BLOCK, 2, 8), generator=g)).to(torch.bfloat16))
    return {"root": root, "ns": {t: n.hex() for t, n in ns.items()}}


def run_cli(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The command in a child with -X importtime; its output and every module it imported."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "tieredkv.cli", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    imported = {m.group(1).strip() for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", r.stderr, re.M)}
    assert {"tieredkv.cli_common", "storage.disk.tier"} <= imported, r.stderr[-2000:]     # the log was read
    return r, imported


def loaded_heavy(imported: set[str]) -> list[str]:
    return sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers"))


def test_inspect_of_1000_blocks_names_the_model_without_torch_or_transformers(cache: dict) -> None:
    r, imported = run_cli("inspect", "--cache-dir", str(cache["root"]), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert loaded_heavy(imported) == []
    report = json.loads(r.stdout)
    assert report["blocks"] == BLOCKS
    by_ns = {n["namespace"]: n for n in report["namespaces"]}
    assert set(by_ns) == {cache["ns"]["default"], cache["ns"][None]}
    for tenant in ("default", None):
        n = by_ns[cache["ns"][tenant]]
        assert (n["model"], n["dtype"], n["tenant"], n["blocks"], n["tokens"]) == (
            "tiny", "float32", tenant, BLOCKS // 2, BLOCKS // 2 * BLOCK)

    r, imported = run_cli("inspect", "--cache-dir", str(cache["root"]))      # the tables, drawn by rich
    assert r.returncode == 0 and "1,000 blocks" in r.stdout and "tiny (float32)" in r.stdout, r.stdout
    assert loaded_heavy(imported) == []


def test_verify_of_1000_blocks_decodes_every_block_without_torch(cache: dict) -> None:
    r, imported = run_cli("verify", "--cache-dir", str(cache["root"]), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["checked"] == BLOCKS
    assert loaded_heavy(imported) == []


def test_inspect_tree_previews_text_without_torch_or_transformers(cache: dict) -> None:
    """--tree's previews decode through `tokenizers` alone (issue 40 item 5: 8.3 s for 120 blocks,
    7.7 of them transformers' import and AutoTokenizer's load; 0.65 s after), to the same text."""
    r, imported = run_cli("inspect", "--cache-dir", str(cache["root"]), "--tree")
    assert r.returncode == 0 and "Cached prefixes" in r.stdout and "tiny (float32)" in r.stdout, r.stdout
    assert loaded_heavy(imported) == []
    from transformers import AutoTokenizer

    from tieredkv.inspect_tree import _tokenizers_decoder, load_decoder
    (model_dir,) = [p for p in (cache["root"] / "models").iterdir() if (p / "tokenizer.json").is_file()]
    fast, slow = load_decoder(str(model_dir)), AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert _tokenizers_decoder(str(model_dir)) is not None
    for ids in ([0, 1, 2, 3], list(range(5, 40)), [(7 * i) % 50 for i in range(64)]):
        assert fast(ids) == slow.decode(ids, skip_special_tokens=False)
