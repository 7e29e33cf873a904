"""The llama.cpp peer of tools/bench_dtype.py: llama-cpp-python on a GGUF, driven over stdin/stdout.

Knows: llama-cpp-python's `Llama` (its `generate` keeps the KV of the longest common prefix of
the previous call's tokens and the new ones, and evaluates only the rest), and how to time its
first token and its decode steps. Doesn't know: tieredkv (it runs in the peer's own virtual
environment, which has llama_cpp and numpy but neither torch nor this project).

Run by bench_dtype.py as `PEER_PYTHON tools/llamacpp_peer.py --model X.gguf --threads N`. One
JSON object per line each way; every answer line starts with "PEER " (so a stray line of the
library's on stdout cannot be taken for one). Requests, all on token ids (the caller's
tokenizer's; bench_dtype checks the vocabularies match):

    {"op": "decode", "ids": [...], "tokens": 32}  a fresh context (no reuse): prompt, then
                                                  `tokens` greedy tokens -> ttft_s, step_s (each
                                                  later token: eval of the previous one + sample)
    {"op": "prefill", "ids": [...]}               a fresh context, one token -> ttft_s
    {"op": "ttft", "ids": [...]}                  one token, reusing the KV of the longest common
                                                  prefix with the previous "ttft" call -> ttft_s,
                                                  reused (tokens of that prefix the call kept)

A `Llama` holds one sequence: a decode or prefill in it would evict the prefix a "ttft" call
reuses. So "ttft" has a context of its own (a second `Llama` on the same file), which holds
the shared prefix across the other requests, as our device pages do.
    {"op": "quit"}
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def answer(obj: dict) -> None:
    sys.stdout.write("PEER " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-ctx", type=int, default=4096)
    args = ap.parse_args()
    try:
        import llama_cpp
        from llama_cpp import Llama
    except ImportError as e:
        answer({"error": f"llama_cpp does not import in {sys.executable}: {e}"})
        return 1
    def context() -> Llama:
        return Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                     n_batch=512, verbose=False)

    try:
        llm, reuse_llm = context(), context()
    except Exception as e:      # noqa: BLE001  (any load failure is the answer)
        answer({"error": f"llama.cpp could not load {args.model}: {e}"})
        return 1
    system = llama_cpp.llama_print_system_info()
    answer({"ready": True, "llama_cpp_python": llama_cpp.__version__, "n_vocab": llm.n_vocab(),
            "threads": args.threads, "n_ctx": llm.n_ctx(), "python": platform.python_version(),
            "system_info": system.decode() if isinstance(system, bytes) else str(system)})

    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        if op == "quit":
            break
        ids = req["ids"]
        if op in ("decode", "prefill"):
            ctx = llm
            ctx.reset()                     # n_tokens = 0: nothing of the previous call is reused
        else:
            ctx = reuse_llm
        reused = Llama.longest_token_prefix(ctx.input_ids[:ctx.n_tokens].tolist(), ids)
        # temp=0: greedy (the sampler chain is a plain argmax); reset=True: generate's own
        # longest-common-prefix reuse (after reset() above there is nothing to reuse).
        gen = ctx.generate(ids, temp=0.0, reset=True)
        t0 = time.perf_counter()
        next(gen)
        t1 = time.perf_counter()
        out = {"ttft_s": t1 - t0, "reused": min(reused, len(ids) - 1)}
        if op == "decode":
            steps, last = [], t1
            for _ in range(req["tokens"] - 1):
                next(gen)
                now = time.perf_counter()
                steps.append(now - last)
                last = now
            out["step_s"] = steps
        gen.close()
        # What the context holds now: the prompt (the last sampled token was never evaluated,
        # except in decode, where every token but the last was).
        out["n_tokens"] = ctx.n_tokens
        answer(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
