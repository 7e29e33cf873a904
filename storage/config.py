"""Cache configuration: one frozen dataclass, validated on construction.

Knows: the knobs a user sets for the four tiers (device, host, disk, and the optional shared
remote store), how sizes are written ("4GiB", "512MiB",
ints), and which values are allowed. Doesn't know: models, page counts or block bytes --
those follow from the model's layout (storage.layout) and are computed where it is known.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from dataclasses import dataclass, field

from storage.kv_events.endpoints import check_endpoint, curve_advice, default_replay, needs_curve
from storage.remote.url import RemoteURL, parse_remote_url

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

WRITE_POLICIES = ("write_back", "write_through")
REMOTE_WRITES = ("write_back", "write_through")
RESTORE_POLICIES = ("auto", "load", "recompute")
CODECS = ("zstd", "raw", "nibble", "auto")   # storage/codec/payload.py's Codec.kind, or auto (storage/codec_choice.py)


def _env_seconds(name: str, default: float) -> float:
    """A number of seconds from the environment (unset or empty: `default`); a bad one is a clear
    error naming the variable."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"${name}: expected seconds (a number), got {raw!r}") from None


def default_cache_root() -> Path:
    """$TIEREDKV_HOME, else $XDG_CACHE_HOME/tieredkv, else ~/.cache/tieredkv."""
    if os.environ.get("TIEREDKV_HOME"):
        return Path(os.environ["TIEREDKV_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tieredkv"
    return Path.home() / ".cache" / "tieredkv"


def parse_size(value: int | str, field_name: str = "size") -> int:
    """Bytes from an int or a string like "4GiB", "512MiB", "1.5GB". Raises ValueError naming the field."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name}: expected a size like '4GiB', '512MiB' or an int of bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field_name}: must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(
        f"{field_name}: expected a size like '4GiB', '512MiB', '1GB' or an int of bytes, got {value!r}")


def format_size(n: int) -> str:
    """Human-readable bytes with binary units: 1536 -> '1.5KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class CacheConfig:
    """How much of each tier the cache may use, and how it writes to disk.

    host_memory=0 disables the host tier; disk_dir=None disables the disk tier; remote_url=None
    (the default) disables the remote tier (storage/remote/url.py lists the URL forms).
    """
    block_size: int = 16
    device_memory: int | str = "1GiB"
    host_memory: int | str = "4GiB"
    disk_dir: str | None = "~/.cache/tieredkv/kv"
    disk_capacity: int | str = "50GiB"
    # The free space the disk tier leaves on its filesystem (at most a tenth of the filesystem),
    # whatever disk_capacity says: on a filling disk the tier shrinks (LRU first) instead of taking
    # the last bytes the billing ledger and the rest of the machine need (storage/disk/writer.py
    # fit_to_space).
    disk_reserve: int | str = "256MiB"
    # A storage call of the disk tier waiting on its filesystem longer than this (frozen, hung) makes
    # the tier a miss, refusing writes, until the call returns (storage/disk/stall.py; issue 44).
    disk_stall_s: float = 2.0
    # zstd level of each block's coded byte plane (sign + exponent, storage/codec/payload.py); on real
    # KV levels 1-4 code alike, higher ones are slower for ~0.5%, negative ones store it as is.
    zstd_level: int = 3
    # How the disk and remote tiers encode a block (storage/codec/payload.py): "zstd" compresses its
    # sign/exponent byte plane (1.15-1.45x fewer bytes on KV); "raw" stores its bytes as they are
    # under an xxh3_64 (same header crc and binding), and decodes ~9x faster per core (a bf16
    # block: 33 us against 284, a hash and one copy): it wins where the drive or network
    # moves bytes faster than zstd decodes them. "nibble" codes the sign/exponent plane as 4-bit
    # codes into a per-block table (storage/codec/nibble.py): 1.33x fewer bytes on bf16 KV (1.14x
    # fp32, none fp16), decoded by a table lookup at ~10 GB/s a core, ~5x zstd. Each reads what
    # the others wrote. "auto" picks the disk's at start from rates measured there (each kind's
    # decode rate and ratio, the drive's read rate: storage/codec_choice.py); the store takes the
    # disk's choice (it stores the disk's payloads), zstd without a disk.
    codec: str = "zstd"
    write_policy: str = "write_back"
    isolate_tenants: bool = True
    # vLLM's --no-enable-prefix-caching: False keeps no block for another request -- no hit from
    # any tier (match finds nothing), and computed blocks are not registered in the device pool
    # (its pages are freed, not kept evictable), so every prompt token is computed and billed as
    # computed. Every tier below the device must be off too (host_memory=0, disk_dir=None,
    # remote_url=None): a tier that can never be read is refused rather than filled.
    prefix_caching: bool = True
    # The shared remote tier (storage/remote/tier.py): a Valkey/Redis URL -- valkey://, redis://,
    # rediss:// (TLS), with a password, a comma list of nodes or ?cluster=1 for a cluster. Not in
    # repr (it may hold a password): `remote` is, redacted.
    remote_url: str | None = field(default=None, repr=False)
    # The fleet secret every value in the remote store is sealed under (storage/fleet_secret.py): a
    # block that does not verify is a miss, never served. Every server sharing a store must read the
    # same file. None: <cache root>/fleet.secret, made (0600) on first start.
    cache_secret_file: str | None = None
    # Seal every disk block under the fleet secret too (storage/disk/seal.py): for a cache directory
    # others can write (shared between users or containers), which is refused unsealed. Costs a
    # keyed BLAKE3 pass per block written and read (~2.3 GB/s a core here).
    seal_disk: bool = False
    # Retention (issue 39): what clients may keep past LRU (cache_control ttl, prompt_cache_retention
    # "24h") in the lowest local tier (the disk, else the host slab). None: half of that tier; it
    # must stay below it, so unretained traffic always has room. Per tenant, None: the whole bound.
    max_retained: int | str | None = None
    max_retained_per_tenant: int | str | None = None
    # Every call to the store is bounded by this (connect and read). Short: a lookup waits for
    # it, and a slow store must cost less than recomputing (a 16-token block takes ~ms).
    remote_timeout_s: float = 0.5
    # A TTL set on every block written (None: none; the store's maxmemory + LRU bound it).
    remote_ttl_s: float | None = None
    # write_back: a block reaches the remote when it reaches the disk (the disk writer forwards
    # each commit) or falls out of the lowest local tier, and on flush(). write_through: also
    # every block as soon as it is computed (registered), in the background.
    remote_write: str = "write_back"
    # The circuit breaker's cooldown: after a few failures in a row the remote tier is skipped
    # for this long, then one call probes it.
    remote_retry_s: float = 5.0
    # Compute or load a hit held below the device (engine/restore_planner.py): "auto" recomputes
    # the front of the prefix while it loads the back, split where the measured restore rates
    # and prefill time predict the earliest finish; "load" always loads; "recompute" never does.
    # Either way a block the cache held is billed as a hit from the tier that held it.
    restore_policy: str = "auto"
    # A deadline on every load (engine/load_deadline.py): a request stops waiting for blocks it
    # loads once recomputing them would have finished -- planned at t, by t + margin x their
    # predicted prefill time + slack -- keeps the leading blocks that arrived and computes the
    # rest. margin >= 1 covers the prediction's error, slack a scheduling hiccup.
    load_deadline_margin: float = 1.25
    # Default: $TIEREDKV_LOAD_DEADLINE_SLACK_S, else 0.1 (a deployment on a busy or slow host, or
    # a test suite on a loaded machine, raises it without touching code; an explicit value wins).
    load_deadline_slack_s: float = field(default_factory=lambda: _env_seconds("TIEREDKV_LOAD_DEADLINE_SLACK_S", 0.1))
    # A request's wait for its remote probe (engine/probe_wait.py): min(3 round trips of the store,
    # a tenth of its predicted recompute) + this slack; past it the request computes from the front
    # and a late answer loads the rest from the back. Default: $TIEREDKV_PROBE_WAIT_SLACK_S, else 0.02.
    probe_wait_slack_s: float = field(default_factory=lambda: _env_seconds("TIEREDKV_PROBE_WAIT_SLACK_S", 0.02))
    # At start, measure what "auto" decides from before the first request (engine/calibration.py):
    # one prefill chunk and one decode step of the model, and a remote tier's link (a round trip
    # and a block-sized read of the store). False: the figures come from the first requests only
    # (their first hits load, "no figures").
    calibrate: bool = True
    # KV events (storage/kv_events/): every block that becomes or stops being findable in a tier,
    # published in vLLM's wire format for routers (llm-d, Dynamo, `tieredkv route`). None: off.
    # An endpoint like tcp://127.0.0.1:5557 (the default of `serve --kv-events`; loopback unless
    # the operator writes another host or *; port 0 or * binds a free port), ipc:// or inproc://.
    kv_events: str | None = None
    # The replay socket (a subscriber that sees a gap asks for the batches it missed); None: the
    # events' host at port + 1.
    kv_events_replay: str | None = None
    # The events name every tenant's prefixes, so who may subscribe is the operator's list
    # (storage/kv_events/access.py): a tcp:// endpoint takes CURVE keys -- the subscribers' public
    # certificates (a NAME.key file, or a directory of them) and the server's secret certificate
    # (made 0600 where absent) -- and an ipc:// socket binds in a directory other users cannot enter.
    kv_events_allow_keys: str | None = None
    kv_events_secret_file: str | None = None
    kv_events_tokens: bool = False       # True: BlockStored carries the blocks' token ids (tenants' prompt text)
    kv_events_topic: str = ""            # the first frame of every batch (ZMQ subscription filter)
    kv_events_replay_s: float = 300.0    # the replay buffer keeps no batch older than this (and 10,000 at most)
    # Parsed sizes in bytes; filled in by __post_init__.
    device_bytes: int = field(init=False, repr=False, compare=False)
    host_bytes: int = field(init=False, repr=False, compare=False)
    disk_bytes: int = field(init=False, repr=False, compare=False)
    disk_reserve_bytes: int = field(init=False, repr=False, compare=False)
    remote: RemoteURL | None = field(init=False, compare=False)   # remote_url parsed (password redacted in repr)
    max_retained_bytes: int | None = field(init=False, repr=False, compare=False)
    max_retained_per_tenant_bytes: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or not 1 <= self.block_size <= 4096:
            raise ValueError(f"block_size: expected an int in [1, 4096], got {self.block_size!r}")
        object.__setattr__(self, "device_bytes", parse_size(self.device_memory, "device_memory"))
        object.__setattr__(self, "host_bytes", parse_size(self.host_memory, "host_memory"))
        object.__setattr__(self, "disk_bytes", parse_size(self.disk_capacity, "disk_capacity"))
        object.__setattr__(self, "disk_reserve_bytes", parse_size(self.disk_reserve, "disk_reserve"))
        for name in ("max_retained", "max_retained_per_tenant"):
            v = getattr(self, name)
            object.__setattr__(self, f"{name}_bytes", None if v is None else parse_size(v, name))
        lowest = ("disk_capacity", self.disk_bytes) if self.disk_dir is not None else ("host_memory", self.host_bytes)
        if self.max_retained_bytes is not None and self.max_retained_bytes and self.max_retained_bytes >= lowest[1]:
            raise ValueError(f"max_retained: {self.max_retained_bytes} bytes must stay below {lowest[0]} "
                             f"({lowest[1]} bytes), the tier retained blocks are kept in, so unretained "
                             "traffic always has room (0: no retention)")
        if self.device_bytes == 0:
            raise ValueError("device_memory: must be > 0 (the device pool holds the running sequences)")
        if self.disk_dir is not None and (not isinstance(self.disk_dir, (str, os.PathLike)) or not str(self.disk_dir)):
            raise ValueError(f"disk_dir: expected a directory path or None (no disk tier), got {self.disk_dir!r}")
        if self.disk_dir is not None and self.disk_bytes == 0:
            raise ValueError("disk_capacity: must be > 0 when disk_dir is set (use disk_dir=None to disable the disk tier)")
        if isinstance(self.zstd_level, bool) or not isinstance(self.zstd_level, int) or not -7 <= self.zstd_level <= 22:
            raise ValueError(f"zstd_level: expected an int in [-7, 22], got {self.zstd_level!r}")
        if self.codec not in CODECS:
            raise ValueError(f"codec: expected one of {CODECS}, got {self.codec!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy: expected one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if not isinstance(self.seal_disk, bool):
            raise ValueError(f"seal_disk: expected True or False, got {self.seal_disk!r}")
        if not isinstance(self.isolate_tenants, bool):
            raise ValueError(f"isolate_tenants: expected True or False, got {self.isolate_tenants!r}")
        object.__setattr__(self, "remote", None if self.remote_url is None else parse_remote_url(self.remote_url))
        for name in ("remote_timeout_s", "remote_retry_s", "disk_stall_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
                raise ValueError(f"{name}: expected seconds in (0, 3600], got {v!r}")
        v = self.remote_ttl_s
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0.001):
            raise ValueError(f"remote_ttl_s: expected seconds >= 0.001 or None (no TTL), got {v!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching: expected True or False, got {self.prefix_caching!r}")
        if not self.prefix_caching:
            on = [name for name, v in (("host_memory", self.host_bytes), ("disk_dir", self.disk_dir),
                                       ("remote_url", self.remote_url)) if v]
            if on:
                raise ValueError(f"prefix_caching=False keeps no block for reuse, so no tier below the device: "
                                 f"set {', '.join(on)} off too (host_memory=0, disk_dir=None, remote_url=None)")
        if not isinstance(self.calibrate, bool):
            raise ValueError(f"calibrate: expected True or False, got {self.calibrate!r}")
        if self.restore_policy not in RESTORE_POLICIES:
            raise ValueError(f"restore_policy: expected one of {RESTORE_POLICIES}, got {self.restore_policy!r}")
        v = self.load_deadline_margin
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v <= 100:
            raise ValueError(f"load_deadline_margin: expected a factor in [1, 100], got {v!r}")
        for name in ("load_deadline_slack_s", "probe_wait_slack_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 3600:
                raise ValueError(f"{name}: expected seconds in [0, 3600], got {v!r}")
        if self.remote_write not in REMOTE_WRITES:
            raise ValueError(f"remote_write: expected one of {REMOTE_WRITES}, got {self.remote_write!r}")
        if self.kv_events is not None:
            check_endpoint(self.kv_events, "kv_events")
            if self.kv_events_replay is None:
                default_replay(self.kv_events)         # port 65535 has no port + 1: say so now
        if self.kv_events_replay is not None:
            if self.kv_events is None:
                raise ValueError("kv_events_replay: needs kv_events (the events' endpoint)")
            check_endpoint(self.kv_events_replay, "kv_events_replay")
            if self.kv_events_replay == self.kv_events and not self.kv_events.endswith((":0", ":*")):
                raise ValueError(f"kv_events_replay: must differ from kv_events ({self.kv_events})")
        for name in ("kv_events_allow_keys", "kv_events_secret_file"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (str, os.PathLike)) or not str(v)):
                raise ValueError(f"{name}: expected a path or None, got {v!r}")
        if (self.kv_events_allow_keys is None) != (self.kv_events_secret_file is None):
            raise ValueError("kv_events_secret_file: CURVE takes both the subscribers' keys (kv_events_allow_keys) "
                             "and the server's secret certificate (kv_events_secret_file, made where absent)")
        if self.kv_events_allow_keys is not None and self.kv_events is None:
            raise ValueError("kv_events_allow_keys: needs kv_events (the events' endpoint)")
        for endpoint, name in ((self.kv_events, "kv_events"), (self.kv_events_replay_endpoint, "kv_events_replay")):
            if endpoint is not None and needs_curve(endpoint) and self.kv_events_allow_keys is None:
                raise ValueError(curve_advice(endpoint, name))
        v = self.kv_events_replay_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
            raise ValueError(f"kv_events_replay_s: expected seconds in (0, 86400], got {v!r}")
        if not isinstance(self.kv_events_tokens, bool):
            raise ValueError(f"kv_events_tokens: expected True or False, got {self.kv_events_tokens!r}")
        if not isinstance(self.kv_events_topic, str):
            raise ValueError(f"kv_events_topic: expected a string, got {self.kv_events_topic!r}")

    @property
    def kv_events_replay_endpoint(self) -> str | None:
        """Where the replay socket binds: kv_events_replay, else beside kv_events (None: events off)."""
        if self.kv_events is None:
            return None
        return self.kv_events_replay or default_replay(self.kv_events)

    @property
    def disk_path(self) -> str | None:
        """disk_dir with ~ and variables expanded, or None when the disk tier is off."""
        return None if self.disk_dir is None else os.path.abspath(os.path.expandvars(os.path.expanduser(str(self.disk_dir))))
