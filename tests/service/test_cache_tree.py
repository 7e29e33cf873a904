"""/v1/cache/tree: the cached prefixes of a running server, with their text and the tier of each
block, tenant by tenant (TieredKVCache.cached_blocks -> storage/prefix_tree.py)."""
from __future__ import annotations

from tests.service.tiny_engine import BLOCK_SIZE

PROMPT = "The prefix tree of a live server folds a chain of blocks into one node and says where each block is. "


def complete(c, engine, prompt: str, user: str) -> dict:
    r = c.post("/v1/completions", json={"model": engine.model_name, "prompt": prompt, "max_tokens": 1,
                                        "temperature": 0, "user": user})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_the_tree_shows_each_tenants_prefixes_and_the_tier_of_each_block(server, engine) -> None:
    with server.client() as c:
        usage = complete(c, engine, PROMPT, "treetop")
        full = (usage["prompt_tokens"] + usage["completion_tokens"]) // BLOCK_SIZE
        tree = c.get("/v1/cache/tree").json()
        mine = tree["tenants"]["treetop"]
        assert tree["block_size"] == BLOCK_SIZE and not tree["truncated"]
        root = mine["tree"][0]
        assert root["first_block"] == 0 and not root["orphan"]
        assert root["preview"].startswith("The prefix tree of a live server")
        assert mine["blocks"] >= full - 1 and root["tiers"] == {"device": root["blocks"]}

        engine.demote("device")                  # every unused block one tier down: the host slab
        tree = c.get("/v1/cache/tree").json()
        assert tree["tenants"]["treetop"]["tree"][0]["tiers"] == {"host": root["blocks"]}
        assert c.post("/v1/cache/flush", json={}).status_code == 200     # ... and to disk
        engine.drop_tier("host")
        root = c.get("/v1/cache/tree").json()["tenants"]["treetop"]["tree"][0]
        assert root["tiers"] == {"disk": root["blocks"]}

        # Another tenant's blocks are its own tree; a server without keys shows every tenant.
        complete(c, engine, PROMPT, "other")
        tenants = c.get("/v1/cache/tree").json()["tenants"]
        assert {"treetop", "other"} <= set(tenants)
        assert tenants["treetop"]["namespace"] != tenants["other"]["namespace"]

        shallow = c.get("/v1/cache/tree", params={"depth": 1, "width": 1}).json()["tenants"]["treetop"]
        assert all(n["children"] == [] for n in shallow["tree"]) and len(shallow["tree"]) <= 1
        for bad in ({"depth": 0}, {"width": 65}, {"depth": "x"}):
            r = c.get("/v1/cache/tree", params=bad)
            assert r.status_code == 400, (bad, r.text)
