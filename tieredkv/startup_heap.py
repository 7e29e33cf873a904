"""The start-up heap, frozen out of the garbage collector's full passes once a server is built.

Knows: why. A built `tieredkv serve` process holds ~415,000 objects the cyclic collector tracks
(torch, transformers, the tokenizer, the model's modules: measured with the default model), none of
which will ever be garbage. Python's full (generation 2) collection walks all of them, holding the
GIL: 270-290 ms at load average 3 on the 2-core CPU, 0.66-0.80 s at load 9 (issue 27, run 5). One
that lands during a request stalls the engine thread and every decode with it -- a hit slower than
a miss, a latency spike for every stream. `gc.freeze()` moves them to the permanent generation, so a
full pass walks only what the server allocated since (0 ms just after), as vLLM's engine core does
after its start-up (`freeze_gc_heap`).
Doesn't know: engines. It is called once per serving process by `tieredkv serve`, after the engine
is built and before the first request; never from a library call (a process that builds and drops
engines, a test run, would keep every frozen cycle of a dropped engine for its life).
Main thread, once.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once (what start-up left as garbage goes), then freeze every object still tracked.
    Returns how many objects the permanent generation holds now."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
