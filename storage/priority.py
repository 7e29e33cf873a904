"""Background threads yield the CPU to the engine's forward passes.

Knows: how a thread lowers its own scheduling priority (Linux: a thread's niceness is its own,
set through setpriority on its native id). Doesn't know: which threads are background -- the
disk and remote writers and their encode pools, the disk decode pool and the loader (restores)
call it as they start. Niceness alone did not keep a pool as wide as the machine off the decoders
(it holds the GIL for part of every block): storage/foreground.py narrows it while they run.

Why: on a CPU-only host every restore and every compression competes with the decoders for the
same cores; at nice +10 they get what the forward passes leave (tools/bench_interference.py). A
restore then waits longer under load (its own request's TTFT), a running request's next token
does not; a writer that falls behind fills its queue (a flush waits longer, the cascade drops,
counted), it never stalls a step. Elsewhere, or without permission, threads keep their priority.
"""
from __future__ import annotations

import os
import threading

BACKGROUND_NICE = 10


def background_priority() -> None:
    """Lower the calling thread's priority (best effort)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass
