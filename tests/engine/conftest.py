"""Tiny random-weight models for engine tests: fp32 on CPU, built from a transformers config."""
import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from engine.model import model_from_config
from tieredkv import CacheConfig, Engine

VOCAB = 128


def tiny_llama_config(**kw) -> LlamaConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_qwen2_config() -> Qwen2Config:
    return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def make_engine(tmp_path=None, config=None, *, block_size=4, device_memory="256KiB", host_memory="256KiB",
                disk=True, **kw) -> Engine:
    loaded = model_from_config(config or tiny_llama_config(), seed=0)
    cache = CacheConfig(block_size=block_size, device_memory=device_memory, host_memory=host_memory,
                        disk_dir=str(tmp_path / "kv") if (disk and tmp_path is not None) else None,
                        disk_capacity="64MiB",
                        **{k: kw.pop(k) for k in list(kw) if k in ("write_policy", "isolate_tenants", "restore_policy", "calibrate",
                                                                       "load_deadline_slack_s", "prefix_caching",
                                                                       "max_retained", "max_retained_per_tenant")})
    return Engine(loaded, cache, **kw)


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def reference_greedy(config, ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain transformers generate (its own SDPA attention, its own KV cache) on the same weights."""
    model = model_from_config(config or tiny_llama_config(), seed=0).model
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture
def engine(tmp_path):
    eng = make_engine(tmp_path)
    yield eng
    eng.close()
