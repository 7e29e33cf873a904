"""The encode process (storage/codec/encode_process.py, storage/codec/encode_worker.py): payloads
byte for byte those of Codec.encode, every failure of the child a block encoded here instead (none
lost, none wrong), and the child's lifetime tied to its writer's and its parent's.

Real children, real LMDB, real zstd; a misbehaving child is tests/storage/lying_encode_worker.py.
No wall-clock asserts: waits are for events (a marker file, a pid gone) under generous deadlines.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from storage.codec import encode_process
from storage.codec.encode_process import EncodeJob, EncodeProcess, encode_process_policy
from storage.codec.payload import Codec, tensor_bytes
from storage.disk.stats import DiskStats
from storage.disk.tier import DiskTier
from storage.foreground import FOREGROUND
from storage.layout import BlockLayout, dtype_name
from tests.storage.conftest import block_data, keys
from tests.storage.test_tiered_cache import same_bits

DEADLINE_S = 120.0
MID = BlockLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
CAP = 64 << 20
LIAR = "tests.storage.lying_encode_worker"


def blocks() -> list[torch.Tensor]:
    """fp32/fp16/bf16 blocks, dim-1-major (a KV block's 5 dims) and not (2 dims; dim 0 of 1), and
    fp32 values that came from bf16 (zero low planes: the stored planes' zstd path)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for shape in ((4, 2, 16, 2, 8), (64, 24), (1, 2, 16, 8)):
            out.append(torch.randn(shape, generator=g).to(dt))
    out.append(torch.randn((4, 2, 16, 2, 8), generator=g).to(torch.bfloat16).to(torch.float32))
    return out


def job(block: torch.Tensor, i: int) -> EncodeJob:
    return EncodeJob(tensor_bytes(block), dtype_name(block.dtype), tuple(block.shape), bytes([i]) * 64)


def written(t: DiskTier, ks) -> DiskStats:
    """Each block of `ks` put into the tier and the writes drained; the tier's stats after."""
    for k in ks:
        assert t.put(k, block_data(k, MID))
    assert t.drain(timeout=DEADLINE_S)
    return t.stats()


def read_back(t: DiskTier, ks) -> bool:
    """Every block of `ks` reads back bit-identical to what was put."""
    return all(same_bits(t.get(k), block_data(k, MID)) for k in ks)


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def decoding():
    """Sequences decode in this process (the engine's foreground signal, as an engine with running
    sequences holds it): the disk writer hands its batches to the encode process only then."""
    owner = object()
    FOREGROUND.hold(owner, True)
    yield
    FOREGROUND.hold(owner, False)


def gone(pid: int) -> bool:
    """The process exited (reaped, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("kind", ["zstd", "raw", "nibble"])
def test_the_childs_payloads_are_codec_encodes_byte_for_byte(kind: str) -> None:
    bs = blocks()
    p = EncodeProcess(kind, 3)
    try:
        for width in (1, 3):          # one encode thread in the child, and several
            got = p.collect(p.submit([job(b, i) for i, b in enumerate(bs)], width))
            for i, (b, payload) in enumerate(zip(bs, got)):
                assert payload is not None
                assert bytes(payload) == Codec(3, kind).encode(b, bytes([i]) * 64), (b.dtype, tuple(b.shape))
        s = p.stats()
        assert (s.starts, s.deaths, s.fallbacks, s.refused) == (1, 0, 0, 0)
        with open(f"/proc/{p.pid}/maps") as f:
            assert "libtorch" not in f.read()       # the child never imported torch
    finally:
        p.close()


def test_a_disk_tier_writes_through_the_child_and_reads_back_bit_identical(tmp_path: Path, decoding) -> None:
    ks = keys(24, layout=MID)
    with DiskTier(str(tmp_path), CAP, batch_blocks=5, encode_process="nice") as t:
        s = written(t, ks)
        assert s.write_errors == 0 and s.blocks == 24
        assert s.encode_process is not None and (s.encode_process.starts, s.encode_process.fallbacks) == (1, 0)
        assert read_back(t, ks)
        assert t.check() == []


def test_with_nothing_decoding_the_pool_encodes_and_no_child_starts(tmp_path: Path) -> None:
    """The child (SCHED_IDLE) is for batches written while sequences decode; a flush with nothing
    decoding -- a shutdown, a busy machine's other work -- is encoded here, at full width."""
    assert not FOREGROUND.active()
    ks = keys(12, layout=MID)
    with DiskTier(str(tmp_path), CAP, batch_blocks=4, encode_process="idle") as t:
        s = written(t, ks)
        assert (s.write_errors, s.blocks) == (0, 12)
        assert s.encode_process is None                   # never built: no child started
        assert read_back(t, ks)


def test_off_by_env_or_argument_encodes_in_this_process(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(encode_process.ENV, "0")
    assert encode_process_policy() is None and encode_process_policy("nice") == "nice"
    assert encode_process_policy("") == encode_process_policy("1") == "idle"      # the default
    ks = keys(6, layout=MID)
    with DiskTier(str(tmp_path), CAP, batch_blocks=4) as t:
        written(t, ks)
        assert t.stats().encode_process is None and t.stats().blocks == 6


def test_a_child_killed_mid_batch_loses_nothing_and_is_restarted(tmp_path: Path, monkeypatch, decoding) -> None:
    marker = tmp_path / "stalled"
    monkeypatch.setattr(encode_process, "WORKER_MODULE", LIAR)
    monkeypatch.setenv("LYING_ENCODE_WORKER", "stall")     # the first child stalls holding its batch
    monkeypatch.setenv("LYING_MARKER", str(marker))
    ks = keys(16, layout=MID)
    with DiskTier(str(tmp_path / "store"), CAP, batch_blocks=8, encode_process="nice") as t:
        with t._writer._cond:            # (re-entrant) the writer takes the eight as one batch
            for k in ks[:8]:
                assert t.put(k, block_data(k, MID))
        wait_until(marker.exists, "the child to take its batch")
        pid = int(marker.read_text())
        os.kill(pid, signal.SIGKILL)
        assert t.drain(timeout=DEADLINE_S)                  # encoded here instead
        s = t.stats()
        assert (s.write_errors, s.blocks) == (0, 8)
        assert (s.encode_process.deaths, s.encode_process.fallbacks) == (1, 8)
        assert gone(pid)
        s = written(t, ks[8:])                              # a new child (the marker is there: it behaves)
        assert (s.encode_process.starts, s.encode_process.fallbacks, s.blocks) == (2, 8, 16)
        assert read_back(t, ks)
        assert t.check() == []


def test_a_child_that_cannot_start_means_encoding_here_logged_once(tmp_path: Path, monkeypatch, caplog, decoding) -> None:
    monkeypatch.setattr(encode_process, "PYTHON", str(tmp_path / "no-such-python"))
    ks = keys(20, layout=MID)
    with DiskTier(str(tmp_path / "store"), CAP, batch_blocks=4, encode_process="nice") as t:
        s = written(t, ks)
        assert (s.write_errors, s.blocks) == (0, 20)
        assert s.encode_process.starts == 0 and s.encode_process.fallbacks == 20
        assert s.encode_process.given_up and s.encode_process.start_failures == encode_process.MAX_FAILURES
        assert read_back(t, ks)
    assert sum("cannot start" in r.getMessage() for r in caplog.records) == 1


def test_a_child_that_dies_before_answering_counts_as_a_failed_start() -> None:
    bs = blocks()[:3]
    p = EncodeProcess()
    encode_process.PYTHON, real = "/bin/false", encode_process.PYTHON
    try:
        # /bin/false may be gone before the batch is written (the pipe refuses it: submit says
        # None) or after (collect finds no answer): a failed start either way.
        ticket = p.submit([job(b, i) for i, b in enumerate(bs)])
        got = [None] * 3 if ticket is None else p.collect(ticket)
    finally:
        encode_process.PYTHON = real
    s = p.stats()
    assert got == [None] * 3 and (s.start_failures, s.deaths, s.fallbacks) == (1, 0, 3)
    got = p.collect(p.submit([job(b, i) for i, b in enumerate(bs)]))     # the next starts the real one
    assert [bytes(x) for x in got] == [Codec().encode(b, bytes([i]) * 64) for i, b in enumerate(bs)]
    p.close()


def test_a_child_whose_codec_files_changed_since_start_up_refuses_to_start(tmp_path: Path, monkeypatch, decoding) -> None:
    """A child runs the codec's files as they are on disk when it starts; the parent decodes with
    what it loaded at start-up. Told another fingerprint (the files changed under a running
    server), the child says so and exits: a failed start, every block encoded here, none wrong."""
    monkeypatch.setattr(encode_process, "FINGERPRINT", "0" * 16)
    ks = keys(6, layout=MID)
    with DiskTier(str(tmp_path), CAP, batch_blocks=3, encode_process="nice") as t:
        s = written(t, ks)
        assert (s.write_errors, s.blocks) == (0, 6)
        assert s.encode_process.start_failures >= 1 and s.encode_process.deaths == 0
        assert s.encode_process.fallbacks == 6
        assert read_back(t, ks)


def test_the_child_answers_only_payloads_that_decode_to_their_block(monkeypatch) -> None:
    """The parent checks a payload's header and that the child read its bytes, not what its
    frames decode to: the child decodes each payload before it answers. An encode that goes wrong
    in the child (here: one bit of the coded plane's input flipped) is not answered."""
    from storage.codec import encode_worker
    block = blocks()[6]                       # bf16, a KV block's 5 dims
    data = tensor_bytes(block)
    arena = np.zeros(4 * data.size, dtype=np.uint8)
    arena[:data.size] = data
    real = encode_worker.encode_bytes

    def skewed(d, *args, **kw):
        d = d.copy()
        d[1] ^= 0x01                          # the top byte of element 0: the coded plane
        return real(d, *args, **kw)
    job = (0, data.size, dtype_name(block.dtype), tuple(block.shape), b"x" * 64)
    honest = encode_worker._Batch(arena, data.size, arena.size, "zstd", 3, [job])
    honest.encode(0)
    assert honest.results[0][0] >= 0
    monkeypatch.setattr(encode_worker, "encode_bytes", skewed)
    lying = encode_worker._Batch(arena, data.size, arena.size, "zstd", 3, [job])
    lying.encode(0)
    assert lying.results[0] == (-1, 0, 0)


def test_a_payload_whose_planes_are_laid_out_otherwise_is_refused(monkeypatch) -> None:
    """dim-1-major order is the header's word, which the child's own checksums cannot contradict:
    a payload in the other order, for the same bytes and binding, is refused by the parent."""
    from storage.codec import byte_planes
    block = blocks()[6]
    j = job(block, 3)
    digest = xxhash.xxh3_64_intdigest(j.data)
    good = b"".join(bytes(p) for p in Codec().encode_parts(block, j.binding))
    assert encode_process._check(memoryview(good), j, digest, digest, "zstd") is None
    monkeypatch.setattr(byte_planes, "can_swap", lambda shape: False)
    other = b"".join(bytes(p) for p in Codec().encode_parts(block, j.binding))
    monkeypatch.undo()
    assert other != good
    assert "laid out" in encode_process._check(memoryview(other), j, digest, digest, "zstd")


@pytest.mark.parametrize("mode", ["header", "binding", "digest", "length", "outside", "malformed"])
def test_a_payload_that_fails_its_check_is_never_stored(tmp_path: Path, monkeypatch, mode: str, decoding) -> None:
    monkeypatch.setattr(encode_process, "WORKER_MODULE", LIAR)
    monkeypatch.setenv("LYING_ENCODE_WORKER", mode)
    ks = keys(6, layout=MID)
    with DiskTier(str(tmp_path), CAP, batch_blocks=3, encode_process="nice") as t:
        s = written(t, ks)
        assert (s.write_errors, s.blocks) == (0, 6)
        assert s.encode_process.refused == 6 and s.encode_process.fallbacks == 6
        assert read_back(t, ks)
        assert t.verify().damaged == ()


def test_closing_the_writer_ends_the_child_by_eof_and_reaps_it(tmp_path: Path, decoding) -> None:
    k = keys(1, layout=MID)[0]
    t = DiskTier(str(tmp_path), CAP, encode_process="nice")
    t.put(k, block_data(k, MID))
    assert t.drain(timeout=DEADLINE_S)
    proc = t._writer._encoding._process._proc
    t.close()
    assert proc.returncode == 0             # it exited on EOF (a kill would read -9), and was reaped
    assert not os.path.exists(f"/proc/{proc.pid}")


_PARENT = """
import sys, time, torch
from storage.codec.encode_process import EncodeJob, EncodeProcess
from storage.codec.payload import tensor_bytes
p = EncodeProcess()
b = torch.randn(4, 2, 16, 2, 8)
p.collect(p.submit([EncodeJob(tensor_bytes(b), "float32", tuple(b.shape), b"x")]))
print(p.pid, flush=True)
time.sleep(600)
"""


def test_a_child_whose_parent_is_killed_exits() -> None:
    root = str(Path(__file__).resolve().parents[2])
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, cwd=root,
                              env={**os.environ, "PYTHONPATH": root})
    try:
        child = int(parent.stdout.readline())
        assert not gone(child)
        parent.kill()
        parent.wait()
        wait_until(lambda: gone(child), "the orphaned child to exit")
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux: /proc says a process's priority")
@pytest.mark.parametrize("policy", ["nice", "idle"])
def test_the_child_runs_at_background_priority(policy: str) -> None:
    p = EncodeProcess(policy=policy)
    try:
        p.collect(p.submit([job(blocks()[0], 0)]))
        with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        nice, sched = int(fields[16]), int(fields[38])      # proc(5): fields 19 and 41
        assert (nice, sched) == ((10, 0) if policy == "nice" else (nice, 5))   # 5: SCHED_IDLE
    finally:
        p.close()
