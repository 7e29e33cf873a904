"""An attacker with write access to the shared store, and the project's own code, but not the fleet
secret (issue 44): server A computes prompts into a real Valkey (an ACL user with a password, as
the README sets it up); the attacker reads every block, decodes it, negates its KV, encodes it
again under the same binding and frames it with the project's pack_value under a secret of their
own, copying our key id into the frame so it does not look foreign; a fresh server B then answers
the same prompts. Every forged block is a miss, counted and deleted, and B's greedy tokens are a
cold run's. Blocks sealed under another fleet's secret are misses left alone."""
from __future__ import annotations

import os
import secrets

import pytest
import redis
import torch

from storage.codec.payload import Codec
from storage.codec.stored_block import BlockMeta, payload_binding
from storage.fleet_secret import FleetSecret
from storage.remote.inspect import RemoteInspector
from storage.remote.url import parse_remote_url
from storage.remote.value import HEAD_SIZE, KEY_PREFIX, pack_value
from storage.hashing import BlockKey
from tests.engine.conftest import reference_greedy
from tests.engine.test_remote_engine import GREEDY, MAX_TOKENS, PROMPTS, check_billed, engine, run_child
from tools.valkey_servers import ValkeyServer


@pytest.fixture
def acl_store():
    """A Valkey whose default user is off: the fleet reaches it as an ACL user with a password."""
    server = ValkeyServer().start()
    password = secrets.token_hex(8)
    admin = redis.Redis(host="127.0.0.1", port=server.port)
    admin.execute_command("ACL", "SETUSER", "tkv", "on", f">{password}", "~tkv:*", "+@all")
    admin.execute_command("ACL", "SETUSER", "default", "off")
    admin.close()
    try:
        yield server, f"valkey://tkv:{password}@127.0.0.1:{server.port}", password
    finally:
        server.stop()


def forge_every_block(port: int, password: str, *, keep_key_id: bool) -> int:
    """What the attacker does with the store's address, its password and our code: every block's
    KV negated, re-encoded and framed anew under a secret that is not the fleet's. Returns the
    number of blocks rewritten."""
    store = redis.Redis(host="127.0.0.1", port=port, username="tkv", password=password)
    ours = FleetSecret.random()          # the attacker's: they never saw the fleet's
    n = 0
    for rk in store.scan_iter(match=KEY_PREFIX + b"*"):
        value = store.get(rk)
        ns_hex, _, h_hex = rk[len(KEY_PREFIX):].decode().partition(":")
        meta_len = int.from_bytes(value[HEAD_SIZE - 4:HEAD_SIZE], "little")
        meta = BlockMeta.unpack(value[HEAD_SIZE:HEAD_SIZE + meta_len])
        payload = value[HEAD_SIZE + meta_len:]
        key = BlockKey(bytes.fromhex(h_hex), meta.parent, meta.token_ids, bytes.fromhex(ns_hex))
        binding = payload_binding(key.hash, key.namespace)
        codec = Codec()
        header = codec.peek_header(payload)
        kv = torch.empty(header.shape, dtype=getattr(torch, header.dtype))
        codec.decode(payload, binding, kv)
        forged = pack_value(key, codec.encode(-kv, binding), meta.raw_size, ours)
        if keep_key_id:
            forged = forged[:4] + value[4:12] + forged[12:]
        store.set(rk, forged)
        n += 1
    store.close()
    return n


@pytest.mark.parametrize("keep_key_id", [True, False], ids=["forged", "foreign"])
def test_blocks_forged_without_the_fleet_secret_are_misses_and_tokens_equal_a_cold_run(tmp_path, acl_store,
                                                                                       keep_key_id) -> None:
    server, url, password = acl_store
    a = run_child(tmp_path / "a" / "kv", url, PROMPTS)
    assert a["remote"]["demotions"] > 0 and a["remote"]["errors"] == 0
    forged = forge_every_block(server.port, password, keep_key_id=keep_key_id)
    assert forged == a["remote"]["demotions"] > 0

    # restore_policy "load": every block the store holds is read (auto may recompute a tiny model's
    # prefix instead, and bill it from the tier that held it, never reading it).
    with engine(tmp_path / "b" / "kv", url, restore_policy="load") as b:
        outs = b.generate(PROMPTS, GREEDY, tenant="acme")
        for out, ids in zip(outs, PROMPTS):
            assert out.token_ids == reference_greedy(None, ids, MAX_TOKENS)     # a cold run's tokens
            check_billed(out, "remote", 0)
            assert out.usage.prompt_cache_miss_tokens == len(ids)
        extra = b.cache.stats()["remote"].extra
        secret = b.cache.remote.secret
    if keep_key_id:
        # Forged under our key id: each a counted miss, deleted.
        assert extra["corrupt"] > 0 and extra["foreign"] == 0 and extra["store_hits"] == 0
    else:
        # Under another secret: misses counted apart, not deleted by the read.
        assert extra["foreign"] > 0 and extra["corrupt"] == 0 and extra["store_hits"] == 0
    # B wrote what it computed back, sealed: the store now holds only values that verify.
    with RemoteInspector(parse_remote_url(url)) as ri:
        report = ri.verify(secret)
    assert report.checked > 0 and (report.damaged, report.foreign) == ((), 0)


def test_the_default_user_cannot_reach_the_store(acl_store) -> None:
    """The README's setup: without the fleet's ACL user, no read and no write."""
    server, _, _ = acl_store
    anon = redis.Redis(host="127.0.0.1", port=server.port)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anon.get(KEY_PREFIX + os.urandom(4).hex().encode())
    anon.close()
