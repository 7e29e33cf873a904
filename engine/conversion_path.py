"""Where a GGUF's conversion lives and what it records, known without torch or transformers.

Knows: a conversion's directory (`<cache root>/models/<stem>-<digest>[-bf16]`, keyed by the file's
content, CONVERSION_VERSION and the stored dtype), what a complete one holds, where a lookup
looks (the given cache root, then the default one), and the identity file a load writes into it
(`tieredkv_identity.json`: the model's identity name(s) and config digest -- what `tieredkv
inspect` names a namespace by, without loading transformers to rebuild the identity). So the CLI
can tell "this is the first conversion" (`serve`/`demo` give their load estimate only then) and
name a cache's model while importing neither torch nor transformers.
Doesn't know: how a GGUF is converted (engine/gguf_cache.py), which dtype a model runs in, or how
an identity is computed (engine/model.py).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from storage.config import default_cache_root

# Bump when what a converted cache directory holds changes: old conversions are then ignored.
CONVERSION_VERSION = 1
# Files a finished conversion always holds (the atomic rename makes a partial one impossible;
# this only guards against someone deleting files by hand), plus the weights: one
# model.safetensors, or an index of shards for a big model.
CONVERTED_FILES = ("config.json", "tokenizer_config.json")
CONVERTED_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
SOURCE_FILE = "tieredkv_source.json"          # the GGUF a conversion came from (engine/gguf_cache.py writes it)
IDENTITY_FILE = "tieredkv_identity.json"


@dataclass(frozen=True, slots=True)
class RecordedIdentity:
    """A model identity a load recorded in its conversion directory (ModelIdentity less its
    dtype, which the namespace adds), and that directory (its config and tokenizer)."""
    name: str
    config_digest: str
    model_dir: Path


def file_digest(path: str | os.PathLike) -> str:
    """A content hash of the whole file (sha256, ~0.15 s for the default 98 MB file), computed
    once per process for a file that has not changed since (size and mtime).

    Content rather than size+mtime, so a reinstall of the same file reuses its conversion
    and a different file of the same size never does."""
    st = os.stat(path)
    return _digest(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def conversion_name(gguf_path: str | os.PathLike) -> str:
    """<stem>-<digest>: the part of a conversion's directory name that costs a read of the whole
    file (once per process: file_digest)."""
    path = Path(gguf_path)
    digest = hashlib.sha256(f"v{CONVERSION_VERSION}:{file_digest(path)}".encode()).hexdigest()[:16]
    return f"{path.stem}-{digest}"


def models_dir(cache_dir: str | os.PathLike | None) -> Path:
    """<cache_dir>/models (None: the default cache root's): where conversions live."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / "models"


def conversion_dir(name: str, cache_dir: str | os.PathLike | None, bf16: bool) -> Path:
    """models/<name> under `cache_dir` (None: the default cache root), -bf16 for the bfloat16 one."""
    return models_dir(cache_dir) / f"{name}{'-bf16' if bf16 else ''}"


def is_complete(target: Path) -> bool:
    return (all((target / f).is_file() for f in CONVERTED_FILES)
            and any((target / f).is_file() for f in CONVERTED_WEIGHTS))


def find_conversion(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """An existing complete conversion of `gguf_path` in any dtype (under `cache_dir`, then the
    default root: where a load looks), for readers of its config and tokenizer, and for "is this
    the first conversion?"; never converts."""
    name = conversion_name(gguf_path)
    for root in dict.fromkeys((cache_dir, None)):
        for bf16 in (False, True):
            d = conversion_dir(name, root, bf16)
            if is_complete(d):
                return d
    return None


def is_conversion(model_dir: str | os.PathLike) -> bool:
    """Whether a checkpoint directory is a GGUF's conversion (where a load records its identity)."""
    return (Path(model_dir) / SOURCE_FILE).is_file()


def record_identity(model_dir: str | os.PathLike, name: str, config_digest: str) -> None:
    """Add `name` -> `config_digest` to the conversion's identity file (written whole to a temp
    file and renamed: a reader sees the old file or the new one). Best effort: a directory this
    process cannot write is left as it is (inspect then names the namespace "unknown")."""
    path = Path(model_dir) / IDENTITY_FILE
    names = _read_names(path)
    if names.get(name) == config_digest:
        return
    names[name] = config_digest
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(prefix=f".{IDENTITY_FILE}.", dir=model_dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"names": names}, f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def recorded_identities(cache_dir: str | os.PathLike | None = None) -> list[RecordedIdentity]:
    """Every identity recorded in a complete conversion under `cache_dir`'s models/ and the
    default root's (a file that cannot be read or parsed is skipped)."""
    found: list[RecordedIdentity] = []
    for root in dict.fromkeys((cache_dir, None)):
        with contextlib.suppress(OSError):
            for d in sorted(models_dir(root).iterdir()):
                if d.name.startswith(".") or not (d / IDENTITY_FILE).is_file() or not is_complete(d):
                    continue
                found.extend(RecordedIdentity(n, c, d) for n, c in sorted(_read_names(d / IDENTITY_FILE).items()))
    return found


def _read_names(path: Path) -> dict[str, str]:
    try:
        names = json.loads(path.read_text()).get("names", {})
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(names, dict):
        return {}
    return {n: c for n, c in names.items() if isinstance(n, str) and isinstance(c, str)}
