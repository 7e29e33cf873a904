"""One decode step's time: the engine's eager path, the graph-safe step eager, compiled, and (CUDA)
replayed as a CUDA graph, beside transformers' own decode step and the step's floor.

Knows: a SmolLM2-135M-shaped model (random weights from its config: time depends on shapes, not
values; or --model DIR), a pool of random KV, N sequences of C tokens of context each on their own
pages, and four ways to run the step that gives each its next token:
    eager        ModelRunner's PagedBatch path (what every step ran before issue 30)
    static       engine/decode_graph.py's step over its persistent buffers, run eagerly
    compile      the same step under torch.compile(fullgraph=True) (inductor), one graph per bucket
    cuda_graph   the same step captured as a CUDA graph and replayed (CUDA only)
and the peer: transformers' forward of one token per sequence over its DynamicCache of C tokens
(SDPA). The floor: the bytes a step must read (weights + the sequences' KV) over the memory
bandwidth a copy measures in the same run. Each figure is the median of --steps timed steps after
warm-up (a device sync after each).
--sample none,greedy,top_p: besides the logits alone (none: `<mode>_ms`), each mode timed to the
token ids on the host (`<mode>_<kind>_ms`; greedy, or seeded temperature 0.8 + top-p 0.9 rows):
the eager path with engine/sampler.py's sample_batch, the graph-safe step with its tokens chosen in
the step (issue 42) and, paired in the same run, with sample_batch over its logits as before
(`<mode>_<kind>_sampler_ms`).

    python tools/bench_decode_step.py [--batch 1,8,32] [--context 512] [--steps 20]
        [--modes eager,static,compile,cuda_graph] [--attention auto] [--sample none] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig  # noqa: E402

from engine.attention_backends import pool_by_layer  # noqa: E402
from engine.decode_graph import DecodeGraphs, DecodeRow  # noqa: E402
from engine.model import load_model, model_from_config, resolve_device  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.sampler import draw_knobs, make_generator, packed_step, sample_batch  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.paged_attention import ATTN_NAME, register  # noqa: E402
from storage.device_pool import DevicePool  # noqa: E402
from storage.layout import BlockLayout  # noqa: E402

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, steps: int, device) -> float:
    for _ in range(2):
        fn()
    _sync(device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device, nbytes: int = 256 << 20) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / _time(lambda: b.copy_(a), 5, device)        # read + write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: SmolLM2-135M's shape, random)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default=None, help="default: eager,static,compile (+cuda_graph on CUDA)")
    ap.add_argument("--attention", default=None)
    ap.add_argument("--sample", default="none", help="none,greedy,top_p: what each mode is timed to (see above)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    register()
    device = resolve_device(args.device)
    if args.model:
        loaded = load_model(args.model, device=device, dtype=args.dtype, attn_implementation=ATTN_NAME)
    else:
        loaded = model_from_config(LlamaConfig(**SMOLLM2_135M), device=device, dtype=args.dtype,
                                   attn_implementation=ATTN_NAME)
    model, cfg = loaded.model, loaded.model.config
    modes = (args.modes or "eager,static,compile" + (",cuda_graph" if device.type == "cuda" else "")).split(",")
    batches = [int(b) for b in args.batch.split(",")]
    sample = args.sample.split(",")
    if not set(sample) <= {"none", "greedy", "top_p"}:
        ap.error(f"--sample: expected none, greedy or top_p, got {args.sample!r}")
    B, C = args.block_size, args.context
    L, H_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    blocks = -(-(C + args.steps + 8) // B)
    pages = max(batches) * blocks + 1
    # Laid out as the engine would (layer-major past flex's 32-bit offsets: 8.7G elements at 8B x 32 x 4k).
    layout = BlockLayout(L, B, H_kv, D, loaded.dtype)
    by_layer = pool_by_layer(args.attention, device, B, layout, pages)
    kv = DevicePool(layout, pages, device, by_layer=by_layer).kv.normal_()   # in place: no fp32 copy (16 GiB)
    sink = pages - 1
    bw = copy_bandwidth(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows_out = []
    for N in batches:
        rows = [DecodeRow(7, C, tuple(range(i * blocks, (i + 1) * blocks))) for i in range(N)]
        kv_bytes = N * C * L * 2 * H_kv * D * kv.element_size()
        row = {"batch": N, "context": C, "floor_ms": 1e3 * (weight_bytes + kv_bytes) / bw}
        runner = ModelRunner(model, kv, B, args.attention, max_query=1)
        kinds = {"greedy": SamplingParams(), "top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=1)}
        for mode in modes:
            if mode == "eager":
                sched = [SimpleNamespace(num_tokens=1, seq=SimpleNamespace(tokens=[7] * C, num_computed=C - 1,
                                                                            pages=list(r.pages))) for r in rows]
                for kind in sample:
                    if kind == "none":
                        row["eager_ms"] = 1e3 * _time(lambda: runner.forward(sched), args.steps, device)
                        continue
                    params = [kinds[kind]] * N
                    gens = [make_generator(p, device) for p in params]
                    row[f"eager_{kind}_ms"] = 1e3 * _time(
                        lambda: sample_batch(runner.forward(sched), params, gens).read(), args.steps, device)
                continue
            if mode == "cuda_graph" and device.type != "cuda":
                continue
            step = DecodeGraphs(model, kv, B, runner.backend, max_seqs=N, max_context=blocks * B, sink=sink, mode=mode)
            if mode == "cuda_graph":
                step.buckets = [N]
                step.capture()
            t = time.perf_counter()
            step.run(rows)                        # compile: this bucket's graph now
            _sync(device)
            if mode == "compile":
                row["compile_s"] = time.perf_counter() - t
            for kind in sample:
                if kind == "none":
                    row[f"{mode}_ms"] = 1e3 * _time(lambda: step.run(rows), args.steps, device)
                    continue
                params = [kinds[kind]] * N
                gens = [make_generator(p, device) for p in params]
                drawn = [DecodeRow(r.token, r.context_len, r.pages, None if kind == "greedy"
                                   else (draw_knobs(p, step.vocab), g)) for r, p, g in zip(rows, params, gens)]
                row[f"{mode}_{kind}_sampler_ms"] = 1e3 * _time(
                    lambda: sample_batch(step.run(rows), params, gens).read(), args.steps, device)

                def in_step():                    # tokens chosen in the step, one packed copy back
                    step.run(drawn)
                    return packed_step(step.tokens, step.nan, None, [0] * N).read()
                row[f"{mode}_{kind}_ms"] = 1e3 * _time(in_step, args.steps, device)
        # The peer: transformers' own step over a DynamicCache of C tokens per sequence (SDPA).
        peer = model_from_config(cfg, device=device, dtype=loaded.dtype, attn_implementation="sdpa").model \
            if not args.model else load_model(args.model, device=device, dtype=args.dtype).model
        with torch.inference_mode():
            cache = DynamicCache()
            ids = torch.randint(0, cfg.vocab_size, (N, C), device=device)
            peer(input_ids=ids, past_key_values=cache, use_cache=True)
            one = torch.randint(0, cfg.vocab_size, (N, 1), device=device)

            def peer_step():
                peer(input_ids=one, past_key_values=cache, use_cache=True)
                cache.crop(-1)                    # the same context every step
            row["transformers_ms"] = 1e3 * _time(peer_step, args.steps, device)
        rows_out.append(row)
    result = {"device": str(device), "dtype": str(loaded.dtype), "bandwidth_GBs": bw / 1e9,
              "weights_MB": weight_bytes / 1e6, "attention": runner.backend.name,
              "pool_layout": "layer" if by_layer else "page", "rows": rows_out}
    if args.json:
        print(json.dumps(result))
        return
    print(f"decode step, {result['device']} {result['dtype']}, attention {result['attention']} "
          f"(pool {result['pool_layout']}-major), copy {result['bandwidth_GBs']:.1f} GB/s, "
          f"weights {result['weights_MB']:.0f} MB")
    cols = ["floor_ms"] + [c for m in modes for k in sample for c in
                           ([f"{m}_ms"] if k == "none" else [f"{m}_{k}_ms", f"{m}_{k}_sampler_ms"])
                           if c in rows_out[0]] + ["transformers_ms"]
    w = {c: max(15, len(c)) for c in cols}
    print("batch context " + " ".join(f"{c:>{w[c]}}" for c in cols))
    for r in rows_out:
        print(f"{r['batch']:5d} {r['context']:7d} " + " ".join(
            f"{r[c]:{w[c]}.2f}" if c in r else f"{'-':>{w[c]}}" for c in cols))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
