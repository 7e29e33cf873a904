"""Where the engine's steps synchronise with the GPU: every implicit host sync, by call site.

Runs a mixed workload (prefill chunks, decodes, cache hits, sampled requests with logprobs) on
CUDA with the engine's device section under torch.cuda.set_sync_debug_mode("warn") and counts
the warnings by the innermost frame of our code that led to them. Issue 9's target: none.

    python tools/cuda_sync_report.py [--model DIR] [--json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine.engine import Engine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from storage.config import CacheConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--attention", default=None)
    ap.add_argument("--device-memory", default="2GiB", help="the device pool (the host tier is half of it)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if f.filename.startswith(ROOT) and "cuda_sync_report" not in f.filename]
        where = f"{os.path.relpath(ours[-1].filename, ROOT)}:{ours[-1].lineno} {ours[-1].line}" if ours else f"{filename}:{lineno}"
        if ours and stack[-1] is not ours[-1]:       # inside a library: say where
            where += f" -> {stack[-1].filename.split('site-packages/')[-1]}:{stack[-1].lineno} {stack[-1].line}"
        sites[where] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    # The disk tier (and the ledger beside it) in a temporary directory: never the user's cache.
    tmp = tempfile.TemporaryDirectory(prefix="tieredkv-sync-")
    eng = Engine.from_pretrained(args.model, CacheConfig(device_memory=args.device_memory, host_memory=args.device_memory,
                                                         disk_dir=os.path.join(tmp.name, "kv")),
                                 max_batch_tokens=512, sync_debug="warn", attention=args.attention)
    base = list(range(1000, 1000 + 700))
    prompts = [base[:n] + [7, n] for n in (50, 300, 700)]
    eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))            # hits
    eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9,
                                         top_k=40, seed=1, logprobs=3))
    eng.close()
    tmp.cleanup()
    report = {"syncs": sum(sites.values()), "sites": dict(sites.most_common()),
              "attention": eng.runner.backend.name}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['syncs']} implicit syncs inside steps (attention {report['attention']})")
        for where, n in sites.most_common():
            print(f"{n:6d}  {where}")


if __name__ == "__main__":
    main()
