"""tools/bench_peers.py runs and reports every field: its quick mode (random blocks, one round,
no LMCache) end to end against a real valkey-server, as a user would run it, in both shapes and
with the peer's chunking reported; bad chunking is refused; the peer's chunk (tools/lmcache_peer.py)
is its blocks' bytes in LMCache's order. Speed is not checked here (docs/BENCHMARKS.md has the
figures); nothing is installed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import bench_peers  # noqa: E402  (tools/ is not a package)
import lmcache_peer  # noqa: E402  (imports no lmcache until a Peer is built)


def quick(tmp_path, *extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_peers.py"), "--synthetic", "--rounds", "1",
                          "--no-peer", "--json", *extra],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_quick_mode_reports_every_field(tmp_path):
    res = quick(tmp_path, "--blocks", "4")

    assert res["peer"]["available"] is False and res["peer"]["reason"] == "--no-peer"
    assert set(res["peer"]["gbps"]) == {"disk_put", "disk_put_fsync", "disk_get", "remote_put", "remote_get"}
    assert all(v is None for v in res["peer"]["gbps"].values())
    cfg = res["config"]
    assert cfg["blocks"] == 4 and cfg["rounds"] == 1 and cfg["dtype"] == "bfloat16"
    assert cfg["block_shape"] == [30, 2, 16, 3, 64] and cfg["remote"] == "valkey-server on loopback"
    assert cfg["shape"] == "smollm2" and cfg["model"] == "synthetic (random values)"
    # Ours per 16-token block; LMCache (not run here) would have had LMCache's default 256-token chunks.
    assert cfg["chunking"]["ours_tokens"] == 16 and cfg["chunking"]["peer_tokens"] == 256
    assert "256-token chunks (16 blocks" in cfg["chunking"]["peer"]
    assert res["peer"]["chunk_tokens"] == 256
    assert set(res["edges"]) == set(cfg["codecs"]) and "zstd" in cfg["codecs"]
    for kind, rows in res["edges"].items():
        assert set(rows) == {"disk_put", "disk_get", "remote_put", "remote_get"}, kind
        for edge, row in rows.items():
            assert row["gbps"] > 0 and row["limit_gbps"] > 0, (kind, edge)
            assert row["x_limit_best"] == round(row["gbps"] / row["limit_gbps"], 3)
            assert len(row["x_limit_paired"]) == 3 and row["x_limit"] == row["x_limit_paired"][1]
            assert row["x_peer"] is None and row["x_peer_paired"] is None and row["x_peer_best"] is None
            assert all(v is None or v > 0 for v in row["limit_parts_gbps"].values())
        assert cfg["ratio"][kind] > 0
    names = [t["name"] for t in res["targets"]]
    assert [n for n in names if n.startswith("zstd")] == [f"zstd {e} >= 0.8 of its limit"
                                                         for e in ("disk_put", "disk_get", "remote_put", "remote_get")]
    for t in res["targets"]:
        if t["name"].startswith("zstd"):
            assert t["met"] == (t["value"] >= 0.8)
        elif "fewer bytes" in t["name"]:     # the nibble codec's ratio: measured without a peer
            assert t["met"] == (t["value"] >= 1.25) and t["value"] == cfg["ratio"]["nibble"]
        else:
            assert t["met"] is None          # a raw-codec target needs the peer (or the raw codec)
    assert "CPU threads" in res["machine"]
    assert not list(tmp_path.glob("tieredkv-lmcache-*"))       # --no-peer built no venv



def test_llama8b_shape_and_peer_chunking_are_reported(tmp_path, capsys):
    res = quick(tmp_path, "--shape", "llama8b", "--blocks", "4", "--edges", "disk", "--codec", "raw",
                "--peer-chunk-tokens", "32")
    cfg = res["config"]
    assert cfg["shape"] == "llama8b" and cfg["block_shape"] == [32, 2, 16, 8, 128]
    assert cfg["block_bytes"] == 2 << 20 and cfg["blocks"] == 4             # 2 MiB a bf16 block
    assert cfg["chunking"]["ours_tokens"] == 16 and cfg["chunking"]["peer_tokens"] == 32
    assert res["peer"]["chunk_tokens"] == 32 and res["peer"]["chunks"] == 2
    assert set(res["edges"]["raw"]) == {"disk_put", "disk_get"}
    bench_peers.print_table(res)
    table = capsys.readouterr().out
    assert "chunking: ours 16-token blocks" in table and "LMCache 32-token chunks (2 blocks" in table
    assert "LMCache: not measured (--no-peer)" in table


@pytest.mark.parametrize("argv", [
    ["--peer-chunk-tokens", "24"],                  # not a multiple of our 16-token block
    ["--peer-chunk-tokens", "0"],
    ["--blocks", "20", "--peer-chunk-tokens", "256"],   # LMCache stores whole chunks only
])
def test_bad_chunking_is_refused_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench_peers.main(argv)
    assert e.value.code == 2 and "--" in capsys.readouterr().err


def test_the_peers_chunk_is_its_blocks_bytes_in_kv_2ltd_order():
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randn((3, 4, 2, 16, 2, 8), generator=gen).to(torch.bfloat16)   # [k, layers, 2, tokens, heads, d]
    chunk = lmcache_peer.to_chunk(blocks)
    assert chunk.shape == (2, 4, 48, 16) and chunk.is_contiguous()
    for j, layer, kv, t, h in ((0, 0, 0, 0, 0), (2, 3, 1, 15, 1), (1, 2, 0, 7, 1)):
        assert torch.equal(chunk[kv, layer, j * 16 + t, h * 8:(h + 1) * 8], blocks[j, layer, kv, t, h])
    assert torch.equal(lmcache_peer.from_chunk(chunk, 16, 2), blocks)
    assert torch.equal(chunk.flatten().view(torch.int16).sort().values,
                       blocks.flatten().view(torch.int16).sort().values)       # the same bytes, reordered


def test_cold_mode_drops_our_store_from_the_page_cache_before_each_get(tmp_path):
    """--cold: our disk tier's files leave the page cache before every get (none left resident,
    though this process maps data.mdb), and the get's limit is the drive's read."""
    import page_cache
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(1 << 20))
    if page_cache.drop([str(probe)])[2] == probe.stat().st_size:
        pytest.skip(f"the filesystem under {tmp_path} keeps dropped pages (tmpfs): no cold reads to measure")
    res = quick(tmp_path, "--blocks", "4", "--edges", "disk", "--codec", "raw", "--cold")
    assert res["config"]["page_cache"] == {"cold": True, "left_resident_bytes": {"ours": 0, "peer": 0}}
    measured = {e: {k for k, v in row["limit_parts_gbps"].items() if v is not None}
                for e, row in res["edges"]["raw"].items()}
    assert measured == {"disk_get": {"drive", "memcpy"}, "disk_put": {"memcpy", "lmdb_put"}}


def test_page_cache_drop_empties_this_processs_own_map_of_the_file(tmp_path):
    """A page this process maps is not dropped by posix_fadvise alone: drop() unmaps it first,
    and the map still reads the file's bytes after (nothing lost)."""
    import mmap

    import page_cache
    path = tmp_path / "mapped.bin"
    data = os.urandom(4 << 20)
    path.write_bytes(data)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        assert m[:] == data                                   # every page mapped and resident
        assert page_cache.resident(str(path)) == len(data)
        files, size, left = page_cache.drop([str(tmp_path)])
        assert (files, size) == (1, len(data))
        if left == len(data):
            pytest.skip(f"the filesystem under {tmp_path} keeps dropped pages (tmpfs)")
        assert left == 0 and page_cache.resident(str(path)) == 0
        assert m[:] == data                                   # read back through the same map
    finally:
        m.close()
