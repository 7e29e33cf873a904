"""The GGUF conversion cache: a .gguf file turned once into a plain transformers checkpoint.

Knows: which conversion a load uses or makes (the one under its cache root in its dtype, else the
default root's; a bfloat16 one cast from a float32 one), how to dequantize a GGUF into
float32 safetensors -- or bfloat16 ones, half the size, for a model that runs in bfloat16 -- plus
its tokenizer, how to tell a damaged or truncated GGUF from an unsupported one, how to publish
that atomically (temp dir + rename) so concurrent processes and crashes never leave a
half-written checkpoint in place, and how to clean up after a crash. Where a conversion lives
(`<cache root>/models/<stem>-<digest>[-bf16]`) is engine/conversion_path.py's, which needs no torch.
Doesn't know: which architectures tieredkv supports (the caller passes that check in), how a
model is found, which device or dtype it runs in, or its KV identity -- that is engine/model.py.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.conversion_path import (CONVERSION_VERSION, SOURCE_FILE, conversion_dir, conversion_name, file_digest,
                                    is_complete)

log = logging.getLogger(__name__)

# A temp dir older than this is a crashed conversion's leftover (a conversion takes < 1 min).
_STALE_TMP_S = 3600.0

ConfigCheck = Callable[[transformers.PretrainedConfig], None]


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a conversion is saved in for a model running in `dtype`: bfloat16 for a
    bfloat16 model (a cast of the float32 dequantization: the weights it runs with, at half
    the bytes), float32 otherwise (float16 from bfloat16 would lose bits it has)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def converted_dir(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  dtype: torch.dtype = torch.float32) -> Path:
    """Where the conversion of `gguf_path` is (or will be) cached: models/<stem>-<digest>, with
    a -bf16 suffix for the bfloat16 one."""
    return _dir(conversion_name(gguf_path), cache_dir, dtype)


def _dir(name: str, cache_dir: str | os.PathLike | None, dtype: torch.dtype) -> Path:
    return conversion_dir(name, cache_dir, stored_dtype(dtype) == torch.bfloat16)


def gguf_checkpoint(gguf_path: Path, cache_dir: str | os.PathLike | None, check_config: ConfigCheck,
                    dtype: torch.dtype = torch.float32) -> Path:
    """The cached conversion of `gguf_path` for a model running in `dtype`, converting it first
    if there is none: under `cache_dir` (the user's choice), unless the default cache root
    already holds one (read, never written: a second copy of the same weights helps no one).
    A bfloat16 conversion is cast from a float32 one when that exists (seconds, not a parse).

    `check_config` raises for a model that must not be converted (before the weights load).
    """
    name = conversion_name(gguf_path)
    target = _dir(name, cache_dir, dtype)
    if target.exists() and not is_complete(target):
        log.warning("cached conversion %s is missing files; converting again", target)
        shutil.rmtree(target)
    if target.exists():
        return target
    shared = _dir(name, None, dtype)
    if cache_dir is not None and shared != target and is_complete(shared):
        return shared
    log.info("converting %s to a %s transformers checkpoint (once; later loads use %s)", gguf_path,
             str(stored_dtype(dtype)).removeprefix("torch."), target)
    source = next((d for d in (_dir(name, cache_dir, torch.float32), _dir(name, None, torch.float32))
                   if d != target and is_complete(d)), None)
    _convert_gguf(gguf_path, target, check_config, stored_dtype(dtype), from_checkpoint=source)
    return target


def _convert_gguf(gguf_path: Path, target: Path, check_config: ConfigCheck, dtype: torch.dtype = torch.float32,
                  from_checkpoint: Path | None = None) -> None:
    """Dequantize a GGUF into a transformers checkpoint (safetensors in `dtype` + tokenizer) at
    `target`, or cast `from_checkpoint` (the same GGUF's float32 conversion) when given.

    NOTE: written to a temp dir beside `target` and renamed into place, so `target` either
    does not exist or is complete; a crash mid-write leaves only a temp dir, removed later.
    Two processes converting at once: the first rename wins, the second discards its copy.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        start = time.perf_counter()
        if from_checkpoint is not None:
            tokenizer = AutoTokenizer.from_pretrained(from_checkpoint, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(from_checkpoint, dtype=torch.float32, local_files_only=True)
        else:
            model, tokenizer = _dequantize(gguf_path, check_config)
        model.to(dtype)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"gguf_file": str(gguf_path), "gguf_sha256": file_digest(gguf_path),
                  "conversion_version": CONVERSION_VERSION, "transformers_version": transformers.__version__}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        del model
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):
                raise
            log.info("another process finished converting %s first; using its copy", gguf_path.name)
        else:
            log.info("converted %s in %.1fs -> %s", gguf_path.name, time.perf_counter() - start, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dequantize(gguf_path: Path, check_config: ConfigCheck) -> tuple[Any, Any]:
    """The GGUF's model (dense float32 weights) and tokenizer. A file the GGUF reader cannot
    parse -- truncated by a failed download, or damaged -- is named as such (the reader's own
    error is a reshape or struct message that names neither the file nor the cause)."""
    kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "dtype": torch.float32}
    gguf_config_cls = getattr(transformers, "GgufConfig", None)
    if gguf_config_cls is not None:
        # transformers >= 5.2x keeps GGUF weights packed (and swaps in its own attention)
        # when a GGUF kernel is available; we want plain dense weights the paged attention
        # can use, so ask for the dequantized model explicitly.
        kwargs["quantization_config"] = gguf_config_cls(dequantize=True)
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as e:
        raise DamagedGGUF(gguf_path, e) from e
    check_config(config)          # an unsupported model is its own error, not "damaged"
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # Handing over the config saves parsing the GGUF's metadata a second time (~3 s).
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, config=config, **kwargs)
    except Exception as e:
        raise DamagedGGUF(gguf_path, e) from e
    # The weights are dense now; drop the GGUF quantizer so save_pretrained accepts the
    # model and the saved config does not ask for GGUF loading again.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model, tokenizer


class DamagedGGUF(ValueError):
    def __init__(self, path: Path, cause: Exception) -> None:
        size = path.stat().st_size if path.exists() else 0
        super().__init__(f"model: {path} is damaged or incomplete ({size:,} bytes; the GGUF reader failed: "
                         f"{type(cause).__name__}: {str(cause)[:200]}); download or reinstall it")
        self.path = path


def _remove_stale_temp_dirs(target: Path) -> None:
    now = time.time()
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        with contextlib.suppress(OSError):
            if now - leftover.stat().st_mtime > _STALE_TMP_S:
                log.warning("removing a crashed conversion's leftover %s", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
