"""Retention through the service (issue 39, item 5): real servers on loopback with tiny tiers (a
disk of DISK_BLOCKS blocks), driven by the official `openai` and `anthropic` clients.

- A prefix kept with prompt_cache_retention "24h" survives a flood of distinct unretained prompts
  5x the disk's capacity and a restart, and is read from the disk after both; an unretained
  control sent after it (so more recent in LRU) is gone.
- A deadline passes (the engine's injected wall clock): the 5m prefix is ordinary LRU again
  (the status forgets it, a flood evicts it) while the 1h one beside it is kept.
- One tenant's retention never exceeds its bound (the rest refused, said in the usage) nor
  evicts another tenant's retained prefix.
- A cold stream of a 4-breakpoint conversation (the client's stream helpers) bills creation by
  ttl, adding up to count_tokens, with the same greedy text as /v1/chat/completions.
The storage-level cases (the book, the disk's rows, the host slab) are tests/storage/test_retention.py.
"""
from __future__ import annotations

import random
from pathlib import Path

import anthropic
import openai
import pytest

from engine.model import kv_layout, model_from_config
from service.settings import ServiceSettings
from tests.service.conftest import ServerThread, write_keys
from tests.service.router.harness import wait_for
from tests.service.test_messages_api import (DOC_A, DOC_B, FOLLOW_UP, QUESTION, REPLY, SYSTEM, created,
                                             four_breakpoints, greedy, marked)
from tests.service.tiny_engine import BLOCK_SIZE, tiny_config
from tieredkv import CacheConfig, Engine

DISK_BLOCKS, HOST_SLOTS, DEVICE_PAGES = 40, 16, 48
FLOOD_PROMPT_BLOCKS = 16
# Enough distinct blocks that 5x the disk's capacity passes through it (it fills, then evicts 4x
# over) after the pool and the slab above it are full of flood too.
FLOOD_BLOCKS = 5 * DISK_BLOCKS + DEVICE_PAGES + HOST_SLOTS + 2 * FLOOD_PROMPT_BLOCKS
RETAIN_24H = {"prompt_cache_retention": "24h"}


class Clock:
    """The wall clock retention deadlines are read from: it moves only when the test moves it."""

    def __init__(self, t: float = 2_000_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def small_engine(root: Path, tokenizer, clock: Clock | None = None, **cache_kw) -> Engine:
    """The tiny model (same seed: a restarted engine reads what an earlier one stored) over small
    tiers: DEVICE_PAGES pages, HOST_SLOTS slots and a disk of DISK_BLOCKS raw blocks."""
    loaded = model_from_config(tiny_config(len(tokenizer)), tokenizer=tokenizer, seed=0)
    block = kv_layout(loaded, BLOCK_SIZE).nbytes
    cache = CacheConfig(block_size=BLOCK_SIZE, device_memory=DEVICE_PAGES * block, host_memory=HOST_SLOTS * block,
                        disk_dir=str(root / "kv"), disk_capacity=DISK_BLOCKS * block, codec="raw", disk_reserve=0,
                        **cache_kw)
    return Engine.from_loaded(loaded, cache, cache_clock=clock)


def usage(r) -> dict:
    return r.usage.model_dump()


def full_blocks(tokens: int) -> int:
    """The prompt tokens a hit can cover: its full blocks, one token always left to compute."""
    return (tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def ids_prompt(rng: random.Random, blocks: int, extra: int = 3) -> list[int]:
    """A prompt of token ids no other prompt shares a first block with."""
    return [rng.randrange(100, 40_000) for _ in range(blocks * BLOCK_SIZE + extra)]


def flood(oai: openai.OpenAI, model: str, seed: int, user: str | None = "t-flood") -> None:
    """FLOOD_BLOCKS blocks of distinct unretained prompts, each computed (no hit) and cached."""
    rng = random.Random(seed)
    for _ in range(-(-FLOOD_BLOCKS // FLOOD_PROMPT_BLOCKS)):
        r = oai.completions.create(model=model, prompt=ids_prompt(rng, FLOOD_PROMPT_BLOCKS, 0), max_tokens=1,
                                   **({} if user is None else {"user": user}))
        assert usage(r)["prompt_cache_hit_tokens"] == 0 and "cache_write_tokens" not in usage(r)


def disk_evictions(admin) -> int:
    """The disk's evictions once its writer has written what it was handed."""
    wait_for(lambda: admin.get("/v1/cache/status").json()["tiers"]["disk"]["pending_writes"] == 0,
             timeout=120, what="the disk writer drained")
    return admin.get("/v1/cache/status").json()["tiers"]["disk"]["evictions"]


def conversation(topic: str) -> list[dict]:
    """A chat whose first block (the template's opening and the topic) no other topic's shares."""
    return [{"role": "system", "content": f"{topic}: you keep notes about this and answer in one line."},
            {"role": "user", "content": f"Summarize what we know about {topic} so far, briefly please."}]


# -- a retained prefix survives a flood 5x the disk and a restart ------------------------------------
def test_a_24h_prefix_survives_a_flood_5x_the_disk_and_a_restart(tmp_path, tokenizer) -> None:
    kept, control = conversation("Lighthouse keeper"), conversation("Harbour master")
    with ServerThread(small_engine(tmp_path, tokenizer)) as s, s.client() as admin, \
            openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0) as oai:
        model = s.engine.model_name
        first = oai.chat.completions.create(model=model, messages=kept, max_tokens=1, user="t-keep",
                                            extra_body=RETAIN_24H)
        u = usage(first)
        prompt = u["prompt_tokens"]
        assert u["cache_write_tokens"] == {"24h": prompt} and u["retention_refused_tokens"] == 0
        assert u["retained_token_seconds"] == full_blocks(prompt + 1) * 86400
        # Sent after the kept one, unretained: more recent in LRU, so only retention can tell them apart.
        oai.chat.completions.create(model=model, messages=control, max_tokens=1, user="t-keep")
        evicted = disk_evictions(admin)
        flood(oai, model, seed=1)
        assert disk_evictions(admin) - evicted >= 4 * DISK_BLOCKS, "the flood did not pass through the disk"

        gone = oai.chat.completions.create(model=model, messages=control, max_tokens=1, user="t-keep")
        assert usage(gone)["prompt_cache_hit_tokens"] == 0, "the flood did not evict the unretained control"
        hit = usage(oai.chat.completions.create(model=model, messages=kept, max_tokens=1, user="t-keep"))
        assert hit["prompt_cache_hit_tokens"] >= full_blocks(prompt)
        assert hit["prompt_cache_hit_tokens_by_tier"]["disk"] >= full_blocks(prompt) - BLOCK_SIZE
        flood(oai, model, seed=2)           # the hit moved it up the tiers: flood it down again

    # A restart: a new engine and server on the same cache directory.
    with ServerThread(small_engine(tmp_path, tokenizer)) as s, \
            openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0) as oai:
        model = s.engine.model_name
        assert s.engine.cache.retention_status()["tenants"]["t-keep"]["blocks"] == full_blocks(prompt + 1) // BLOCK_SIZE
        flood(oai, model, seed=3)           # and a flood after the restart too
        hit = usage(oai.chat.completions.create(model=model, messages=kept, max_tokens=1, user="t-keep"))
        assert hit["prompt_cache_hit_tokens"] == hit["prompt_cache_hit_tokens_by_tier"]["disk"] >= full_blocks(prompt)
        gone = usage(oai.chat.completions.create(model=model, messages=control, max_tokens=1, user="t-keep"))
        assert gone["prompt_cache_hit_tokens"] == 0


# -- a deadline passes: the blocks are ordinary LRU again ---------------------------------------------
def test_a_passed_deadline_makes_the_prefix_ordinary_lru(tmp_path, tokenizer) -> None:
    clock = Clock()
    short = {"system": [marked(SYSTEM + " Short-lived.", "5m")], "messages": [{"role": "user", "content": QUESTION}]}
    long = {"system": [marked(SYSTEM + " Long-lived.", "1h")], "messages": [{"role": "user", "content": QUESTION}]}
    with ServerThread(small_engine(tmp_path, tokenizer, clock)) as s, \
            anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0) as anth, \
            openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0) as oai:
        model = s.engine.model_name

        def ask(tenant: str, convo: dict):
            return anth.messages.create(model=model, max_tokens=1, metadata={"user_id": tenant}, **convo,
                                        **greedy()).usage
        u5, u1 = ask("t-5m", short), ask("t-1h", long)
        assert created(u5)["ephemeral_5m_input_tokens"] > 0 and created(u1)["ephemeral_1h_input_tokens"] > 0
        tenants = s.engine.cache.retention_status()["tenants"]
        assert set(tenants["t-5m"]["blocks_by_class"]) == {"5m"} and set(tenants["t-1h"]["blocks_by_class"]) == {"1h"}

        clock.t += 10 * 60                  # past the 5m deadline, well before the 1h one
        tenants = s.engine.cache.retention_status()["tenants"]
        assert "t-5m" not in tenants and tenants["t-1h"]["blocks"] > 0
        flood(oai, model, seed=4)
        again5, again1 = ask("t-5m", short), ask("t-1h", long)
        assert again5.cache_read_input_tokens == 0, "an expired prefix outlived a flood 5x the disk"
        assert again5.cache_creation_input_tokens == u5.cache_creation_input_tokens     # kept anew, billed anew
        # The 1h segment's full blocks are read (from the disk, where the flood pushed them); a
        # partial block at its end was not kept, so its few tokens are written again.
        made = u1.cache_creation_input_tokens
        assert again1.cache_read_input_tokens == made // BLOCK_SIZE * BLOCK_SIZE > 0
        assert again1.model_extra["cache_read_input_tokens_by_tier"]["disk"] == again1.cache_read_input_tokens
        assert again1.cache_creation_input_tokens == made % BLOCK_SIZE


# -- one tenant's retention: bounded, and never at another's expense ---------------------------------
ACME, BETA, OPS = "sk-acme-ret-0001", "sk-beta-ret-0001", "sk-ops-ret-0001"
PER_TENANT_BLOCKS = 4


def test_a_tenant_past_its_bound_is_refused_and_cannot_evict_anothers(tmp_path, tokenizer) -> None:
    keys = write_keys(tmp_path / "keys.json", {ACME: {"tenant": "acme"}, BETA: {"tenant": "beta"},
                                               OPS: {"tenant": "ops", "role": "admin"}})
    probe = model_from_config(tiny_config(len(tokenizer)), tokenizer=tokenizer, seed=0)
    bound = PER_TENANT_BLOCKS * kv_layout(probe, BLOCK_SIZE).nbytes
    engine = small_engine(tmp_path, tokenizer, max_retained_per_tenant=bound)
    rng = random.Random(5)
    a_prompt, a_control = ids_prompt(rng, 3), ids_prompt(rng, 3)
    b_prompts = [ids_prompt(rng, 10) for _ in range(3)]
    with ServerThread(engine, ServiceSettings(api_keys_file=keys)) as s, \
            s.client(headers={"Authorization": f"Bearer {OPS}"}) as admin, \
            openai.OpenAI(base_url=s.url + "/v1", api_key=ACME, max_retries=0) as acme, \
            openai.OpenAI(base_url=s.url + "/v1", api_key=BETA, max_retries=0) as beta:
        model = s.engine.model_name
        a = usage(acme.completions.create(model=model, prompt=a_prompt, max_tokens=1, extra_body=RETAIN_24H))
        assert a["cache_write_tokens"] == {"24h": len(a_prompt)} and a["retention_refused_tokens"] == 0
        acme.completions.create(model=model, prompt=a_control, max_tokens=1)        # unretained, more recent

        # beta asks for 10 blocks: its bound keeps 4, the rest is refused (still served and cached).
        b = usage(beta.completions.create(model=model, prompt=b_prompts[0], max_tokens=1, extra_body=RETAIN_24H))
        kept = PER_TENANT_BLOCKS * BLOCK_SIZE
        assert b["cache_write_tokens"] == {"24h": kept}
        assert b["retention_refused_tokens"] == len(b_prompts[0]) - kept > 0
        for p in b_prompts[1:]:             # at its bound: nothing more is kept
            b = usage(beta.completions.create(model=model, prompt=p, max_tokens=1, extra_body=RETAIN_24H))
            assert b["retention_refused_tokens"] == len(p) and "24h" not in b["cache_write_tokens"]
        tenants = s.engine.cache.retention_status()["tenants"]
        assert tenants["beta"]["blocks"] == PER_TENANT_BLOCKS and tenants["beta"]["bytes"] <= bound
        assert tenants["acme"]["blocks"] == 3

        evicted = disk_evictions(admin)
        flood(beta, model, seed=6, user=None)       # beta's own unretained traffic
        assert disk_evictions(admin) - evicted >= 4 * DISK_BLOCKS
        assert usage(acme.completions.create(model=model, prompt=a_control, max_tokens=1))["prompt_cache_hit_tokens"] == 0
        again = usage(acme.completions.create(model=model, prompt=a_prompt, max_tokens=1))
        assert again["prompt_cache_hit_tokens"] == 3 * BLOCK_SIZE
        # beta's kept blocks are kept too, and only those.
        b0 = usage(beta.completions.create(model=model, prompt=b_prompts[0], max_tokens=1))
        assert b0["prompt_cache_hit_tokens"] == kept


# -- a cold stream through the client's helpers; its text is chat's ----------------------------------
def test_a_cold_stream_bills_creation_by_ttl_and_its_text_is_chats(server, engine, tokenizer) -> None:
    convo = four_breakpoints()
    kw = dict(model=engine.model_name, max_tokens=8, metadata={"user_id": "t-ret-stream"}, **convo, **greedy())
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as anth:
        prompt = anth.messages.count_tokens(model=engine.model_name, **convo).input_tokens
        with anth.messages.stream(**kw) as s:
            events = list(s)
            final = s.get_final_message()
    assert [e.type for e in events[:2]] == ["message_start", "content_block_start"]
    assert events[-1].type == "message_stop"
    u = final.usage
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > 0 and u.input_tokens > 0
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == prompt
    split = created(u)
    assert split["ephemeral_1h_input_tokens"] > 0 and split["ephemeral_5m_input_tokens"] > 0
    assert split["ephemeral_1h_input_tokens"] + split["ephemeral_5m_input_tokens"] == u.cache_creation_input_tokens
    assert engine.cache.retention_status()["tenants"]["t-ret-stream"]["blocks_by_class"].keys() == {"1h", "5m"}
    # The same conversation through chat, greedy: the same text (cache_control changes nothing of it).
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": DOC_A + DOC_B + " " + QUESTION},
                {"role": "assistant", "content": REPLY}, {"role": "user", "content": FOLLOW_UP}]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as oai:
        chat = oai.chat.completions.create(model=engine.model_name, max_tokens=8, temperature=0,
                                           user="t-ret-stream-chat", messages=messages)
    assert final.content[0].text == chat.choices[0].message.content
    assert chat.usage.prompt_tokens == prompt and final.usage.output_tokens == chat.usage.completion_tokens
