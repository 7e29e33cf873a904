"""Write a random-weight copy of a model: same config and tokenizer, weights from a seed.

For timing where the real weights cannot travel (a GPU machine with no network; the default
model's package is 92 MB): compute and memory traffic depend on the shapes, not the values, so
tokens/s and TTFT are the real model's. Texts are not.

    python tools/random_model.py SRC_DIR DST_DIR [--seed 0]
SRC_DIR holds config.json and the tokenizer files (e.g. the default model's cached conversion
under ~/.cache/tieredkv/models/); DST_DIR gets those plus model.safetensors.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    src, dst = Path(args.src), Path(args.dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
    model.save_pretrained(dst)
    print(f"random_model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {dst}")


if __name__ == "__main__":
    main()
