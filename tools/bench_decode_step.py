"""One decode step of a full batch against its floor: the bytes a step must read, over the memory
bandwidth a copy reaches in the same run.

Knows: issue 30's decode target -- 32 sequences at 4k context (Llama-3.1-8B shape) within 2x of
the floor, where floor = (weight bytes + every sequence's KV bytes) / copy bandwidth (bytes read +
written by a device-to-device copy of 1 GiB, the same way tools/gpu_check.sh's env step counts).
How a step is isolated: the prompts are served once (prefill, untimed), then served again with
max_tokens=1 (every block a device hit: the suffix-free rerun costs one step of the last
token plus the first sample) and with max_tokens=1+M; the difference over M is one decode step
of the whole batch, wall time, the engine's own scheduling and sampling included.
Doesn't know: which kernels run (tools/cuda_sync_report.py says where a step syncs).

    python tools/bench_decode_step.py --model tools/model_shapes/llama-3.1-8b --n 32 --context 4096 [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import emit, machine_note  # noqa: E402

from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from storage.config import CacheConfig  # noqa: E402


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by a copy of `nbytes` on `device` (best of 5)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def timed(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    bad = [len(o.token_ids) for o in outs if len(o.token_ids) != max_tokens]
    if bad:
        raise RuntimeError(f"expected {max_tokens} tokens per sequence, got {bad}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model or shape directory (tools/model_shapes/)")
    ap.add_argument("--n", type=int, default=32, help="sequences in the batch")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode steps M timed per round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (median)")
    ap.add_argument("--device-memory", default="24GiB")
    ap.add_argument("--copy-bytes", default=2**30, type=int, help="the bandwidth probe's copy size")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = CacheConfig(device_memory=args.device_memory, host_memory=0, disk_dir=None)
    with Engine.from_pretrained(args.model, cache=cfg, max_seqs=max(args.n, 1)) as engine:
        device = engine.loaded.device
        vocab = engine.loaded.model.config.vocab_size
        # distinct first tokens: no two sequences share a block, so each reads its own KV
        prompts = [[(i * 7919 + j * 104729) % (vocab - 1) + 1 for j in range(args.context)] for i in range(args.n)]
        timed(engine, prompts, 1)                                   # prefill, untimed
        steps = []
        for _ in range(args.repeat):
            base = timed(engine, prompts, 1)
            full = timed(engine, prompts, 1 + args.steps)
            steps.append(max(full - base, 0.0) / args.steps)
        step_s = statistics.median(steps)
        weights = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
        kv = args.n * (args.context + args.steps // 2) * engine.layout.nbytes // engine.block_size
        attention = engine.runner.backend.name
    bw = copy_bandwidth(device, args.copy_bytes)
    floor = (weights + kv) / bw
    result = {"model": engine.model_name, "device": str(device), "attention": attention, "n": args.n,
              "context": args.context, "decode_step_s": round(step_s, 6), "samples_s": [round(s, 6) for s in steps],
              "weight_bytes": weights, "kv_bytes": kv, "copy_gbps": round(bw / 1e9, 1),
              "floor_s": round(floor, 6), "ratio": round(step_s / floor, 2), "target_ratio": 2.0,
              "tokens_per_s": round(args.n / step_s, 1), "machine": machine_note()}

    def table(r: dict) -> None:
        print(f"{r['model']} on {r['device']} ({r['attention']}): {r['n']} sequences x {r['context']} context")
        print(f"  decode step {r['decode_step_s'] * 1e3:.2f} ms ({r['tokens_per_s']:.0f} tokens/s)")
        print(f"  floor       {r['floor_s'] * 1e3:.2f} ms = ({r['weight_bytes'] / 1e9:.2f} GB weights + "
              f"{r['kv_bytes'] / 1e9:.2f} GB KV) / {r['copy_gbps']} GB/s copy")
        print(f"  ratio       {r['ratio']}x (target <= {r['target_ratio']}x)")
    emit(result, args.json, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
