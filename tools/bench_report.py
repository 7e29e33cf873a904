"""What every benchmark reports the same way: the machine it ran on, and its result as a table or JSON.

Knows: one machine note (CPU, threads, GPU, the versions of every library a figure depends on), so
figures from two runs can be told apart, and the table-or-JSON choice each benchmark's --json flag
makes, and the thread limits and peers are timed on (`on_limit_thread`). Doesn't know: any
benchmark's rows or limits (each prints its own table).
Imported by the benchmarks as a sibling script (tools/ is not a package: they put tools/ on sys.path).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
from typing import Callable


def machine_note(extra: str = "") -> str:
    """The machine and library versions a benchmark's figures came from (+ `extra`, the run's own)."""
    import lmdb
    import numpy as np
    import torch
    import zstandard
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (device tier = CPU)"
    note = (f"{platform.machine()}, {os.cpu_count()} CPU threads, {gpu}, torch {torch.__version__} "
            f"({torch.get_num_threads()} intra-op threads), numpy {np.__version__}, zstandard {zstandard.__version__} "
            f"(libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))}), lmdb {lmdb.__version__}, "
            f"python {platform.python_version()}")
    return f"{note}; {extra}" if extra else note


def stop_peer(proc: subprocess.Popen) -> None:
    """End a peer driver that reads JSON commands on its stdin (tools/lmcache_peer.py,
    tools/llamacpp_peer.py): ask it to quit, and kill it if it does not within 30 s."""
    if proc.poll() is not None:
        return
    try:
        proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


def emit(result: dict, as_json: bool, print_table: Callable[[dict], None]) -> None:
    """One benchmark's result: JSON on one line (for scripts and docs/BENCHMARKS.md), else its table."""
    if as_json:
        print(json.dumps(result))
    else:
        print_table(result)


_limits_pool = None


def on_limit_thread(fn: Callable) -> Callable:
    """Run the decorated limit or peer measurement on one long-lived worker thread, as the engine
    runs its steps on its own thread. A torch op timed on a process's main thread ran 3-9x
    slower than the same op on another thread on this busy 2-core machine (OpenMP's spinning team
    of the main thread contends with the load; issue 27, run 3): a peer timed there would read
    too slow, and our ratio to it too good."""
    import functools
    from concurrent.futures import ThreadPoolExecutor

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _limits_pool
        if _limits_pool is None:
            _limits_pool = ThreadPoolExecutor(1, thread_name_prefix="bench-limits")
        return _limits_pool.submit(fn, *args, **kwargs).result()
    return wrapper
