"""The attention backends: which one starts, and flex_paged's greedy parity on the CPU.

flex_paged is the CUDA default; its CPU path (flex_attention unfused, eager) is slow but runs the
same block mask and the same flat-pool view as on a GPU, so a wrong page index, a wrong causal
offset or a wrong context length shows up here as a different greedy token.
"""
import pytest
import torch

from engine.attention_backends import BACKENDS, make_backend
from tests.engine.conftest import (make_engine, random_prompt, reference_greedy, tiny_llama_config,
                                   tiny_qwen2_config)
from tieredkv import SamplingParams

GREEDY = SamplingParams(max_tokens=8)
CPU = torch.device("cpu")


def test_auto_is_gather_sdpa_on_cpu_and_the_environment_overrides_it(monkeypatch):
    monkeypatch.delenv("TIEREDKV_ATTENTION", raising=False)
    assert make_backend(None, CPU).name == "gather_sdpa"
    assert make_backend("auto", CPU).name == "gather_sdpa"
    monkeypatch.setenv("TIEREDKV_ATTENTION", "flex_paged")
    assert make_backend("auto", CPU).name == "flex_paged"
    assert make_backend("gather_sdpa", CPU).name == "gather_sdpa"   # an explicit name wins
    assert set(BACKENDS) == {"gather_sdpa", "flex_paged"}


def test_an_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="attention: expected one of"):
        make_backend("flash", CPU)


@pytest.mark.parametrize("config", [None, tiny_qwen2_config()], ids=["llama", "qwen2"])
def test_flex_paged_greedy_equals_transformers_with_hits_from_every_tier(tmp_path, config):
    """Block size 16 (flex's kernel block on CUDA): a batch of three prompts, then each again
    from the device pool, the host tier and the disk tier, every output equal to plain
    transformers."""
    prompts = [random_prompt(n, seed=n) for n in (21, 40, 57)]
    want = [reference_greedy(config, ids, GREEDY.max_tokens) for ids in prompts]
    with make_engine(tmp_path, config, block_size=16, attention="flex_paged") as eng:
        assert eng.cache_status()["engine"]["attention"] == "flex_paged"
        assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want      # batched, cold
        for tier in ("device", "host", "disk"):
            if tier != "device":
                eng.cache.demote("device")
            if tier == "disk":
                eng.cache.demote("host")
                eng.cache.disk.flush()
            outs = eng.generate(prompts, GREEDY)
            assert [o.token_ids for o in outs] == want, tier
            hits = [o.usage.hit_tokens_by_tier[tier] for o in outs]
            assert hits == [16, 32, 48], tier        # every full block but the last token's
        eng.cache.audit()


def test_flex_paged_and_gather_sdpa_agree_on_chunked_prefill_and_small_blocks(tmp_path):
    """Block size 4 and 16-token prefill chunks: many pages per sequence, queries that start
    mid-context; both backends give the same tokens as transformers."""
    ids = random_prompt(45, seed=3)
    want = reference_greedy(None, ids, GREEDY.max_tokens)
    for name in ("gather_sdpa", "flex_paged"):
        with make_engine(tmp_path / name, attention=name, max_batch_tokens=16) as eng:
            assert eng.generate(ids, GREEDY).token_ids == want, name
            assert eng.generate(ids, GREEDY).token_ids == want, name     # from the cache
