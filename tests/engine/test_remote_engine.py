"""Two servers sharing one remote store: engine A in a child process (tests/engine/remote_engine_child.py)
computes prompts and closes; engine B here, with its own disk directory, gets them as remote hits --
the same greedy tokens as A and as plain transformers, billed as remote (hit + miss == prompt).
On a standalone server and on a 3-node cluster. Then the store killed mid-run: requests still succeed,
the breaker opens; restarted, the breaker closes and hits resume."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from engine.model import model_from_config
from storage.config import CacheConfig
from tests.engine.conftest import random_prompt, reference_greedy, tiny_llama_config
from tools.valkey_servers import ValkeyServer
from tieredkv import Engine, SamplingParams

BS = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)
PROMPTS = [random_prompt(n, seed=100 + n) for n in (37, 22, 50)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_child(disk_dir, url: str, prompts, tenant: str = "acme") -> dict:
    args = {"url": url, "disk_dir": str(disk_dir), "prompts": prompts, "tenant": tenant, "max_tokens": MAX_TOKENS}
    proc = subprocess.run([sys.executable, "-m", "tests.engine.remote_engine_child", json.dumps(args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engine(disk_dir, url: str, **kw) -> Engine:
    cache = CacheConfig(block_size=BS, device_memory="256KiB", host_memory="256KiB", disk_dir=str(disk_dir),
                        disk_capacity="64MiB", remote_url=url, **kw)
    return Engine(model_from_config(tiny_llama_config(), seed=0), cache, exact_hits=False)   # counts prefix blocks


def hit(ids) -> int:
    return ((len(ids) - 1) // BS) * BS


def check_billed(out, tier: str, n: int) -> None:
    u = out.usage
    assert u.hit_tokens_by_tier == {**dict.fromkeys(("device", "host", "disk", "remote"), 0), tier: n}
    assert u.prompt_cache_hit_tokens + u.prompt_cache_miss_tokens == u.prompt_tokens


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_a_second_server_hits_what_the_first_computed(tmp_path, where, request) -> None:
    url = request.getfixturevalue("valkey" if where == "standalone" else "valkey_cluster").url
    tenant = f"acme-{where}"       # the session's store is shared: a namespace of this test's own
    a = run_child(tmp_path / "a" / "kv", url, PROMPTS, tenant)
    for o, ids in zip(a["outputs"], PROMPTS):
        assert o["miss"] == len(ids) and o["tokens"] == reference_greedy(None, ids, MAX_TOKENS)
    assert a["remote"]["demotions"] > 0 and a["remote"]["errors"] == 0

    with engine(tmp_path / "b" / "kv", url) as b:
        outs = b.generate(PROMPTS, GREEDY, tenant=tenant)
        for out, o, ids in zip(outs, a["outputs"], PROMPTS):
            assert out.token_ids == o["tokens"]
            check_billed(out, "remote", hit(ids))
        bill = b.ledger.tenant(tenant)
        assert bill.hit_tokens_by_tier["remote"] == sum(hit(ids) for ids in PROMPTS)
        status = b.cache_status()["tiers"]["remote"]
        assert status["hit_tokens"] == sum(hit(ids) for ids in PROMPTS) and status["breaker"] == "closed"
        # Another tenant (another cache salt) never hits them, on any server.
        other = b.generate(PROMPTS[0], GREEDY, tenant=f"globex-{where}")
        assert other.token_ids == outs[0].token_ids
        check_billed(other, "remote", 0)
        assert other.usage.prompt_cache_miss_tokens == len(PROMPTS[0])
        # B kept what it restored: the next request is a device hit, no remote read.
        again = b.generate(PROMPTS[1], GREEDY, tenant=tenant)
        check_billed(again, "device", hit(PROMPTS[1]))


def test_the_store_killed_mid_run_costs_hits_not_requests(tmp_path) -> None:
    server = ValkeyServer()
    try:
        server.start()
        # A stopped server refuses connections at once: the timeout is never waited for, and a
        # generous one keeps a loaded machine's slow answer (server up) from counting as an outage.
        kw = dict(remote_timeout_s=10, remote_retry_s=0.5, remote_write="write_through")
        # (Seeds whose greedy tokens are no near-tie: seed 201's differ between any paged attention
        # and transformers' own, with or without a cache.)
        p = [random_prompt(21, seed=300 + i) for i in range(6)]
        with engine(tmp_path / "one" / "kv", server.url, **kw) as one, engine(tmp_path / "two" / "kv", server.url, **kw) as two:
            # One's breaker runs on the test's clock: it stays open until the test lets the cooldown
            # pass, however long a loaded machine takes between the requests below.
            now = [0.0]
            one.cache.remote.breaker._clock = lambda: now[0]
            first = one.generate(p[0], GREEDY)
            assert one.cache.disk.drain(10) and one.cache.remote.drain(10)   # the disk commits, then forwards
            check_billed(two.generate(p[0], GREEDY), "remote", hit(p[0]))

            server.stop()
            for ids in p[1:4]:                          # each request's probe and writes fail
                out = one.generate(ids, GREEDY)
                assert out.token_ids == reference_greedy(None, ids, MAX_TOKENS)
                check_billed(out, "remote", 0)
            status = one.cache_status()["tiers"]["remote"]
            assert status["breaker"] == "open" and status["errors"] >= 3
            errors = status["errors"]
            out = one.generate(p[1], GREEDY)            # open: nothing waits for the store...
            assert out.token_ids == reference_greedy(None, p[1], MAX_TOKENS)
            # ...nothing is sent to it (a call would fail: counted, not timed)
            assert one.cache_status()["tiers"]["remote"]["errors"] == errors
            lost = one.cache_status()["tiers"]["remote"]
            assert lost["write_drops"] + lost["write_errors"] > 0     # the writes it could not send, counted
            assert first.token_ids == two.generate(p[0], GREEDY).token_ids

            server.start()                              # back, empty
            now[0] += one.cache.remote.breaker.config.cooldown_s    # past the cooldown: the next call probes it
            out = one.generate(p[4], GREEDY)
            assert one.cache.disk.drain(10) and one.cache.remote.drain(10)   # the disk commits, then forwards
            assert one.cache_status()["tiers"]["remote"]["breaker"] == "closed"
            resumed = two.generate(p[4], GREEDY)        # hits resume
            assert resumed.token_ids == out.token_ids
            check_billed(resumed, "remote", hit(p[4]))
    finally:
        server.cleanup()


def test_a_hung_store_delays_only_the_request_that_asks_it(tmp_path) -> None:
    """A store that accepts connections and never answers: a request's probe waits its timeout in
    the queue while another request keeps decoding (the engine thread never waits for the store)."""
    import socket
    import threading
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        url = f"valkey://127.0.0.1:{listener.getsockname()[1]}"
        # A 3 s timeout, so "while the other kept decoding" has room on a loaded machine (20
        # tokens of a tiny model in 2.8 s).
        # A patient probe deadline ($TIEREDKV_LOAD_DEADLINE_SLACK_S, tests/conftest.py): this test is
        # about the engine thread never waiting (the deadline that stops a request waiting for a
        # stalled probe: test_load_deadline.py).
        with engine(tmp_path / "kv", url, remote_timeout_s=3.0) as eng:
            first = random_prompt(9, seed=400)
            times: list[float] = []
            done = threading.Event()

            def decode() -> None:
                for chunk in eng.stream(first, SamplingParams(max_tokens=400, ignore_eos=True)):
                    times.extend([time.monotonic()] * len(chunk.token_ids))
                done.set()
            t = threading.Thread(target=decode)
            t.start()
            while len(times) < 5:                        # its own probe timed out; it decodes now
                assert t.is_alive() or done.is_set()
                time.sleep(0.005)
            t0 = time.monotonic()
            second = eng.generate(random_prompt(13, seed=401), GREEDY)
            waited = time.monotonic() - t0
            t.join(60)
            assert waited >= 2.9                         # its probe waited for the store's timeout...
            during = [x for x in times if t0 + 0.1 <= x <= t0 + 2.9]
            assert len(during) >= 20, len(during)        # ...while the other request kept decoding
            assert second.token_ids == reference_greedy(None, random_prompt(13, seed=401), MAX_TOKENS)
            check_billed(second, "remote", 0)
            assert eng.cache_status()["tiers"]["remote"]["errors"] >= 2
    finally:
        listener.close()
