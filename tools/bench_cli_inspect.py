"""`tieredkv inspect` and `tieredkv verify` on a 1,000-block disk tier, beside their floor and a peer.

    python tools/bench_cli_inspect.py [--blocks 1000] [--runs 5] [--json]

Builds a disk tier of --blocks real blocks (bfloat16, the default model's KV shape per block:
30 layers, K and V, 16 tokens, 3 heads of 64) in a temp dir, then times each command as a user
runs it (a fresh process, wall clock, median of --runs), in the same run:
- floor: `python -c "import tieredkv.cli"`, the interpreter and the CLI's own imports -- what
  any tieredkv command costs before it reads a byte;
- peer: `python -m lmdb -e <kv> stat`, py-lmdb's own command line opening the same store;
- old floor: `python -c "import torch, transformers"`, what both commands imported before issue 31.
The limit they are judged against is the issue's: under 1 s for 1,000 blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(root: Path, blocks: int) -> None:
    import torch

    from storage.codec.payload import Codec
    from storage.disk.tier import DiskTier
    from storage.hashing import block_keys
    g = torch.Generator().manual_seed(0)
    tokens = [(7 * i) % 49152 for i in range(16 * blocks)]
    with DiskTier(str(root / "kv"), 4 << 30, Codec()) as tier:
        for key in block_keys(bytes(32), tokens, 16):
            tier.put(key, torch.randn((30, 2, 16, 3, 64), generator=g).to(torch.bfloat16))


def timed(cmd: list[str], runs: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-2000:]}")
    return {"median_s": statistics.median(times), "min_s": min(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as tmp:
        root = Path(tmp)
        build(root, args.blocks)
        rows = {
            "tieredkv inspect": timed([py, "-m", "tieredkv.cli", "inspect", "--cache-dir", str(root)], args.runs),
            "tieredkv verify": timed([py, "-m", "tieredkv.cli", "verify", "--cache-dir", str(root)], args.runs),
            "floor: import tieredkv.cli": timed([py, "-c", "import tieredkv.cli"], args.runs),
            "peer: python -m lmdb stat": timed([py, "-m", "lmdb", "-e", str(root / "kv"), "stat"], args.runs),
            "old floor: import torch, transformers": timed([py, "-c", "import torch, transformers"], args.runs),
        }
    report = {"blocks": args.blocks, "runs": args.runs, "limit_s": 1.0, "load_avg_1m": os.getloadavg()[0],
              "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.blocks} blocks, median of {args.runs} runs (load average {report['load_avg_1m']:.1f}); limit 1.0 s")
    print(f"{'command':40} {'median s':>9} {'min s':>7}")
    for name, r in rows.items():
        print(f"{name:40} {r['median_s']:9.2f} {r['min_s']:7.2f}")


if __name__ == "__main__":
    main()
