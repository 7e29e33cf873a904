"""A tiny engine (random weights, CPU) publishing KV events: cache_status names the bound
endpoints (what a router reads from GET /v1/cache/status), a prompt's blocks arrive as BlockStored
GPU with their tokens and the tenant's namespaced hashes, and /metrics counts what was published."""
from __future__ import annotations

import re

from engine.model import model_from_config
from service.metrics import ServiceMetrics
from storage.hashing import block_keys
from tests.engine.conftest import random_prompt, tiny_llama_config
from tests.kv_event_keys import events_options
from tests.storage.test_kv_events import BlockStored, Subscriber, flat, held, wait_for
from tieredkv import CacheConfig, Engine, SamplingParams


def test_an_engine_publishes_its_prompts_blocks_and_says_where(tmp_path) -> None:
    cache = CacheConfig(block_size=4, device_memory="256KiB", host_memory="256KiB", disk_dir=str(tmp_path / "kv"),
                        disk_capacity="64MiB", kv_events_topic="kv@test", kv_events_tokens=True, **events_options())
    engine = Engine(model_from_config(tiny_llama_config(), seed=0), cache)
    sub = None
    try:
        st = engine.cache_status()["kv_events"]
        assert set(st) == {"enabled", "endpoint", "replay_endpoint", "topic", "seq", "published", "dropped", "tokens",
                           "server_key", "replay_s"}
        assert st["enabled"] is True and st["topic"] == "kv@test" and st["tokens"] is True and st["dropped"] == 0
        assert st["endpoint"].startswith("tcp://127.0.0.1:") and st["replay_endpoint"].startswith("tcp://127.0.0.1:")
        sub = Subscriber(st, "kv@test")
        # A SUB joins late (its connection and subscription race the first publishes: ZMQ's slow
        # joiner; seen once beside two busy loops, every batch of the prompt published before it
        # joined): another tenant's prompts until a batch arrives live, then the prompt's come live.
        warmups = iter(range(100, 10_000))

        def joined() -> bool:
            engine.generate(random_prompt(13, seed=next(warmups)), SamplingParams(max_tokens=1), tenant="warmup")
            sub.poll(50)
            return bool(sub.batches)
        wait_for(joined, "a first batch live")
        prompt = random_prompt(13, seed=1)
        engine.generate(prompt, SamplingParams(max_tokens=2), tenant="alice")
        ks = block_keys(engine.namespace("alice"), prompt, 4)        # 3 full blocks of the prompt
        want = {k.hash for k in ks}

        def seen() -> bool:
            sub.poll(20)
            return bool(sub.batches) and want <= held(flat(sub.all_batches(-1))).get("GPU", set())
        wait_for(seen, "the prompt's blocks on the stream")
        stored = [e for b in sub.all_batches(-1) for e in b.events if isinstance(e, BlockStored)]
        first = next(e for e in stored if e.block_hashes[0] == ks[0].hash)
        assert first.parent_block_hash is None and first.medium == "GPU" and first.block_size == 4
        assert first.token_ids == prompt[:4 * len(first.block_hashes)]
        st = engine.cache_status()["kv_events"]
        assert st["seq"] >= 0 and st["published"] >= 2
        text = ServiceMetrics(engine.cache_status, lambda: 0).render().decode()
        published = re.search(r"^tieredkv_kv_events_published_total (\S+)$", text, re.M)
        assert published and float(published.group(1)) >= st["published"]
        assert "tieredkv_kv_events_dropped_total 0.0" in text
    finally:
        if sub is not None:
            sub.close()
        engine.close()


def test_events_off_by_default(tmp_path) -> None:
    cache = CacheConfig(block_size=4, device_memory="256KiB", host_memory="256KiB", disk_dir=None)
    engine = Engine(model_from_config(tiny_llama_config(), seed=0), cache)
    try:
        assert engine.cache_status()["kv_events"] == {"enabled": False}
        assert "tieredkv_kv_events" not in ServiceMetrics(engine.cache_status, lambda: 0).render().decode()
    finally:
        engine.close()
