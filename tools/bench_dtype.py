"""float32 against bfloat16 on the CPU, and llama.cpp on the same GGUF beside them.

Knows: three figures of one model, each measured in float32 and in bfloat16 (two Engines,
`Engine.from_pretrained(dtype=...)`, in one process) and by llama.cpp (llama-cpp-python in its
own virtual environment, driven in a subprocess: tools/llamacpp_peer.py), interleaved in the
same run; the ratios between them. Doesn't know: why a dtype is faster (torch's kernels), nor
how a prefix gets into a lower tier (tools/bench_ttft.py's subject).

    figure      ours (each dtype)                              llama.cpp (the GGUF as it is)
    decode      a 16-token prose prompt, max_tokens=32,        the same prompt, a fresh context,
                ignore_eos, greedy: (total_s - ttft_s) / 31    32 greedy tokens: the median
                (RequestMetrics), median over requests         over requests of each one's
                                                               mean gap between tokens 2..32
    prefill     TTFT (RequestMetrics.ttft_s, max_tokens=1) of  a fresh context (reset()), the
                512 prose tokens for a tenant never used       same 512 tokens, time to the
                (isolate_tenants): every token a miss          first token of generate()
    hit         TTFT of a 2048-token prose prefix already in   in-context reuse: the 2048-token
                device pages + a 16-token suffix that differs  prefix evaluated once, then each
                every request (each request checked: exactly   prefix + new 16-token suffix
                2048 hit tokens, all from the device)          through generate(), which keeps
                                                               the KV of the longest common
                                                               prefix with the previous call,
                                                               in a context of its own that
                                                               decode and prefill never touch
                                                               (each call checked: >= 2048
                                                               tokens kept; the median below a
                                                               quarter of that context's first
                                                               call: a full 2064-token prefill)

Every prompt is token ids of real prose (bench_ttft's PROSE), the same ids for all three (the
peer gets our tokenizer's ids; the script checks the GGUF's vocabulary has the same size).
Each round runs decode, prefill and hit, and within each the three systems, in an order that
rotates every round, so outside load on this shared machine hits all alike; medians over
--repeat rounds (decode: one request per round; prefill: one; hit: --hits-per-round).

Ratios: "bf16 speedup" = float32 time / bfloat16 time, per figure; "vs llama.cpp" = our time /
llama.cpp's, per dtype and figure. Target (issue 20): our device-hit TTFT, in the dtype
`dtype="auto"` picks on this machine, within 1.5x of llama.cpp's in-context reuse.

The peer: --peer-python, else $TMPDIR/llamacpp-venv/bin/python. It needs llama-cpp-python,
which has no prebuilt wheel on the index this project uses: --build-peer builds it there from
source for the CPU (10-25 min on 2 cores); without it the script runs our two dtypes and
says why the peer was skipped. llama.cpp runs the GGUF as stored (the default model's is Q4_1
weights; its KV cache is f16), we run it converted to float32 or bfloat16: the comparison is of
what each system does with the same file.

llama.cpp's threads: it runs as two peers, one thread and as many as torch's intra-op threads
(--peer-threads), and each figure is compared with the faster of them. On this 2-core machine
shared with other jobs, ggml's spinning barriers make 2 threads slower than 1 whenever another
process holds a core (a 512-token prefill: 7.3-9.0 s with 2 threads against 3.3 s with 1, run
one after the other), so "the peer" is its best configuration here, not a fixed one.

    python tools/bench_dtype.py [--repeat 5] [--hits-per-round 3] [--json]
                                [--model PATH] [--peer-gguf X.gguf] [--peer-python PY | --no-peer]
                                [--build-peer] [--peer-threads 1,2]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_report import emit, machine_note, stop_peer  # noqa: E402  (sibling scripts)
from bench_prompts import prose_ids  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.model import default_gguf_path, resolve_dtype  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from storage.config import CacheConfig  # noqa: E402

DTYPES = ("float32", "bfloat16")
FIGURES = ("decode", "prefill", "hit")
DECODE_PROMPT, DECODE_TOKENS = 16, 32
PREFILL_TOKENS = 512
PREFIX_TOKENS, SUFFIX_TOKENS = 2048, 16
TARGET = 1.5                  # our device-hit TTFT / llama.cpp's in-context reuse TTFT
REUSE_CHECK = 0.25            # the peer's reuse TTFT must stay below this fraction of a full prefill
PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_peer.py")
PEER_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF '
              '-DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF '
              '-DLLAMA_BUILD_SERVER=OFF" {py} -m pip install llama-cpp-python')


def default_peer_venv() -> str:
    return os.path.join(tempfile.gettempdir(), "llamacpp-venv")


class Prompts:
    """Token ids of the prose: a fixed 2048-token prefix, and windows that never repeat."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.prefix = prose_ids(tokenizer, PREFIX_TOKENS)
        self._n = 0

    def window(self, n: int) -> list[int]:
        self._n += 1
        return prose_ids(self.tok, n, offset=37 * self._n + 5)


class Ours:
    """One Engine in one dtype, and its three figures."""

    def __init__(self, model: str | None, dtype: str) -> None:
        # No host or disk tier: every figure is device-pool work. 1 GiB holds the 2064-token
        # prompt, every round's 512-token misses and the decodes without an eviction.
        cfg = CacheConfig(device_memory="1GiB", host_memory=0, disk_dir=None, isolate_tenants=True)
        self.engine = Engine.from_pretrained(model, cache=cfg, dtype=dtype)
        self.name = dtype
        self.run = uuid.uuid4().hex[:8]
        self._fresh = 0

    def fresh_tenant(self) -> str:
        self._fresh += 1
        return f"dtype-{self.run}-fresh-{self._fresh}"

    def decode(self, ids: list[int]) -> float:
        out = self.engine.generate(ids, SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True),
                                   tenant=self.fresh_tenant())
        n = out.usage.completion_tokens
        if n != DECODE_TOKENS:
            raise RuntimeError(f"{self.name}: decode produced {n} tokens, expected {DECODE_TOKENS}")
        return (out.metrics.total_s - out.metrics.ttft_s) / (n - 1)

    def prefill(self, ids: list[int]) -> float:
        out = self.engine.generate(ids, SamplingParams(max_tokens=1), tenant=self.fresh_tenant())
        if out.usage.prompt_cache_miss_tokens != len(ids):
            raise RuntimeError(f"{self.name}: the 512-token prefill hit the cache: {out.usage}")
        return out.metrics.ttft_s

    def hit(self, ids: list[int], expect: int | None = PREFIX_TOKENS) -> float:
        out = self.engine.generate(ids, SamplingParams(max_tokens=1), tenant=f"dtype-{self.run}-hit")
        got = out.usage.hit_tokens_by_tier
        if expect is not None and (got["device"] != expect or sum(got.values()) != expect):
            raise RuntimeError(f"{self.name}: expected {expect} hit tokens from the device, got {got}")
        return out.metrics.ttft_s

    def close(self) -> None:
        self.engine.close()


class Peer:
    """llama.cpp (tools/llamacpp_peer.py) in a subprocess; one request at a time, so it idles
    while our engines run."""

    def __init__(self, python: str, gguf: str, threads: int) -> None:
        self.name = f"llama.cpp {threads}t"
        self.proc = subprocess.Popen([python, PEER_SCRIPT, "--model", gguf, "--threads", str(threads),
                                      "--n-ctx", "4096"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.info = self._read()
        if "error" in self.info:
            self.close()
            raise RuntimeError(self.info["error"])

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("PEER "):
                return json.loads(line[5:])
        err = self.proc.stderr.read()[-2000:]
        raise RuntimeError(f"the llama.cpp peer exited ({self.proc.wait()}) without an answer: {err.strip()}")

    def ask(self, op: str, ids: list[int], **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, "ids": ids, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def decode(self, ids: list[int]) -> float:
        steps = self.ask("decode", ids, tokens=DECODE_TOKENS)["step_s"]
        return sum(steps) / len(steps)

    def prefill(self, ids: list[int]) -> float:
        return self.ask("prefill", ids)["ttft_s"]

    def hit(self, ids: list[int], expect: int | None = PREFIX_TOKENS) -> float:
        r = self.ask("ttft", ids)
        if expect is not None and r["reused"] < expect:
            raise RuntimeError(f"llama.cpp kept only {r['reused']} tokens of the {expect}-token prefix")
        return r["ttft_s"]

    def close(self) -> None:
        stop_peer(self.proc)


def peer_python(args) -> tuple[str | None, str]:
    """(the peer's python, '') or (None, why it is skipped); builds it with --build-peer."""
    py = args.peer_python or os.path.join(default_peer_venv(), "bin", "python")
    has = os.path.exists(py) and subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    if has:
        return py, ""
    venv = default_peer_venv()
    build = f"{sys.executable} -m venv {venv} && " + PEER_BUILD.format(py=os.path.join(venv, "bin", "python"))
    if not args.build_peer or args.peer_python:
        return None, (f"{py} cannot import llama_cpp; build the peer with --build-peer (10-25 min on 2 cores), "
                      f"i.e. `{build}`, or pass --peer-python")
    print(f"bench_dtype: building llama-cpp-python from source in {default_peer_venv()} (about 10 min)",
          file=sys.stderr)
    proc = subprocess.run(build, shell=True, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        return None, f"building llama-cpp-python failed (exit {proc.returncode}): `{build}`"
    return py, ""


def peer_gguf(args) -> str | None:
    if args.peer_gguf:
        return args.peer_gguf
    if args.model is None:
        return default_gguf_path()
    return args.model if str(args.model).endswith(".gguf") else None


class Bench:
    def __init__(self, systems: dict, prompts: Prompts) -> None:
        self.systems = systems            # name -> Ours | Peer
        self.prompts = prompts
        self.samples: dict[tuple[str, str], list[float]] = {(s, f): [] for s in systems for f in FIGURES}
        self.peers = [name for name, s in systems.items() if isinstance(s, Peer)]
        self.peer_full_prefill_s: dict[str, float] = {}
        self.hits_per_round = 1

    def warm_up(self) -> None:
        """First-call costs, untimed; then the prefix goes into every system's KV (our device
        pages, llama.cpp's context)."""
        for system in self.systems.values():
            system.decode(self.prompts.window(DECODE_PROMPT))
            system.prefill(self.prompts.window(PREFILL_TOKENS))
        for name, system in self.systems.items():
            t = system.hit(self.prompts.prefix + self.prompts.window(SUFFIX_TOKENS), expect=None)
            if name in self.peers:
                # The reuse context's first call had nothing to reuse: a full prefill of a whole
                # hit-sized prompt, what its reuse must stay far below.
                self.peer_full_prefill_s[name] = t

    def round(self, r: int, hits: int) -> None:
        self.hits_per_round = hits
        names = list(self.systems)
        order = names[r % len(names):] + names[:r % len(names)]     # rotates every round
        for name in order:
            self.samples[(name, "decode")].append(self.systems[name].decode(self.prompts.window(DECODE_PROMPT)))
        for name in order:
            self.samples[(name, "prefill")].append(self.systems[name].prefill(self.prompts.window(PREFILL_TOKENS)))
        for _ in range(hits):
            for name in order:
                ids = self.prompts.prefix + self.prompts.window(SUFFIX_TOKENS)
                self.samples[(name, "hit")].append(self.systems[name].hit(ids))

    def result(self, auto_dtype: str, peer_note: str, peer_info: dict | None) -> dict:
        med = {s: {f: statistics.median(self.samples[(s, f)]) for f in FIGURES} for s in self.systems}
        res: dict = {
            "figures_s": {s: {f: round(v, 5) for f, v in d.items()} for s, d in med.items()},
            "samples_s": {s: {f: [round(x, 5) for x in self.samples[(s, f)]] for f in FIGURES} for s in self.systems},
            "bf16_speedup": {f: round(med["float32"][f] / med["bfloat16"][f], 3) for f in FIGURES},
            "auto_dtype": auto_dtype,
        }
        if self.peers:
            for name in self.peers:
                full = self.peer_full_prefill_s[name]
                if med[name]["hit"] > REUSE_CHECK * full:
                    raise RuntimeError(f"{name}'s reuse TTFT {med[name]['hit'] * 1e3:.1f} ms is not far below its "
                                       f"full prefill of {full * 1e3:.1f} ms: it did not reuse")
            # Judged against the faster llama.cpp configuration of each figure (its best thread count here).
            best = {f: min(self.peers, key=lambda name: med[name][f]) for f in FIGURES}
            res["llama_cpp_best"] = best
            res["vs_llama_cpp"] = {d: {f: round(med[d][f] / med[best[f]][f], 3) for f in FIGURES} for d in DTYPES}
            ratio = med[auto_dtype]["hit"] / med[best["hit"]]["hit"]
            # The same ratio within each round (ours against the faster peer of that round), which
            # load that drifts between rounds moves less than the ratio of whole-run medians.
            hits = self.hits_per_round
            per_round = []
            for i in range(0, len(self.samples[(auto_dtype, "hit")]), hits):
                ours = statistics.median(self.samples[(auto_dtype, "hit")][i:i + hits])
                peer = min(statistics.median(self.samples[(n, "hit")][i:i + hits]) for n in self.peers)
                per_round.append(round(ours / peer, 3))
            res["target"] = {"what": f"device-hit TTFT ({auto_dtype}, dtype='auto') / llama.cpp in-context reuse "
                                     f"({best['hit']})",
                             "ratio": round(ratio, 3), "limit": TARGET, "met": ratio <= TARGET,
                             "per_round_ratios": per_round}
            res["peer_full_prefill_s"] = {n: round(v, 5) for n, v in self.peer_full_prefill_s.items()}
            res["peer"] = peer_info
        else:
            res["peer_skipped"] = peer_note
        return res


def print_table(res: dict) -> None:
    f, systems = res["figures_s"], list(res["figures_s"])
    print(f"{res['model']}: float32 vs bfloat16 (ours) beside llama.cpp on the same GGUF; medians of {res['repeat']} "
          f"rounds ({res['repeat'] * res['hits_per_round']} hits)")
    rows = (("decode", f"decode step ms ({DECODE_TOKENS} tokens after {DECODE_PROMPT})"),
            ("prefill", f"{PREFILL_TOKENS}-token prefill TTFT ms"),
            ("hit", f"hit TTFT ms ({PREFIX_TOKENS} cached + {SUFFIX_TOKENS})"))
    peer = "vs_llama_cpp" in res
    head = f"{'figure':<42}" + "".join(f"{s:>14}" for s in systems) + f"{'bf16 x':>9}"
    if peer:
        head += f"{'fp32/llama':>12}{'bf16/llama':>12}"
    print(head)
    for key, label in rows:
        line = (f"{label:<42}" + "".join(f"{f[s][key] * 1e3:>14.1f}" for s in systems)
                + f"{res['bf16_speedup'][key]:>8.2f}x")
        if peer:
            line += "".join(f"{res['vs_llama_cpp'][d][key]:>11.2f}x" for d in DTYPES)
        print(line)
    print("bf16 x = float32 time / bfloat16 time")
    if peer:
        print("x/llama = our time / the faster llama.cpp's (Nt: its threads); hit: ours is a device hit, "
              "llama.cpp's an in-context reuse of the prefix")
        t = res["target"]
        print(f"target: {t['what']} <= {t['limit']}x: {'met' if t['met'] else 'MISSED'} ({t['ratio']:.2f}x; "
              f"round by round against that round's faster peer: {', '.join(f'{x:.2f}' for x in t['per_round_ratios'])})")
        print("llama.cpp reuse check: full prefill of the 2064-token prompt " + ", ".join(
            f"{n} {v * 1e3:.0f} ms (reuse {f[n]['hit'] * 1e3:.1f})" for n, v in res["peer_full_prefill_s"].items()))
        p = res["peer"]
        print(f"peer: llama-cpp-python {p['llama_cpp_python']}, {p['system_info'].strip()}")
    else:
        print(f"llama.cpp peer skipped: {res['peer_skipped']}")
    print(f"machine: {res['machine']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="measured rounds (median)")
    ap.add_argument("--hits-per-round", type=int, default=3, help="hit TTFTs per system per round")
    ap.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--peer-gguf", default=None, help="the GGUF llama.cpp runs (default: the model, when a GGUF)")
    ap.add_argument("--peer-python", default=None,
                    help="a python with llama_cpp (default: $TMPDIR/llamacpp-venv/bin/python)")
    ap.add_argument("--build-peer", action="store_true",
                    help="build llama-cpp-python from source into $TMPDIR/llamacpp-venv if it is not there")
    ap.add_argument("--no-peer", action="store_true", help="only our two dtypes")
    ap.add_argument("--peer-threads", default=None,
                    help="llama.cpp thread counts, each a peer of its own (default: 1 and torch's intra-op threads)")
    ap.add_argument("--json", action="store_true", help="print only the JSON line, not the table above it")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.hits_per_round < 1:
        ap.error("--repeat, --hits-per-round: expected >= 1")
    try:
        args.peer_threads = ([int(x) for x in args.peer_threads.split(",") if x.strip()] if args.peer_threads
                             else [1, torch.get_num_threads()])
    except ValueError:
        ap.error("--peer-threads: expected comma-separated ints")
    if not args.peer_threads or min(args.peer_threads) < 1:
        ap.error("--peer-threads: expected ints >= 1")
    logging.basicConfig(level=logging.WARNING)

    systems: dict = {}
    peer_note, peer_info = "--no-peer", None
    try:
        for dtype in DTYPES:
            systems[dtype] = Ours(args.model, dtype)
        engine = systems["float32"].engine
        if PREFIX_TOKENS + SUFFIX_TOKENS + DECODE_TOKENS >= engine.loaded.max_context:
            raise SystemExit(f"the model's {engine.loaded.max_context}-token context cannot hold the hit prompt")
        if not args.no_peer:
            gguf = peer_gguf(args)
            py, peer_note = peer_python(args) if gguf else (None, "--model is not a GGUF; pass --peer-gguf")
            for threads in sorted(set(args.peer_threads)) if py is not None else ():
                try:
                    peer = Peer(py, gguf, threads)
                except RuntimeError as e:
                    peer_note = str(e)
                    break
                systems[peer.name] = peer
                peer_info = peer.info
                if peer.info["n_vocab"] != engine.vocab_size:
                    raise SystemExit(f"the GGUF's vocabulary ({peer.info['n_vocab']}) is not the model's "
                                     f"({engine.vocab_size}): the same token ids would mean different text")
            if not any(isinstance(s, Peer) for s in systems.values()):
                print(f"bench_dtype: llama.cpp peer skipped: {peer_note}", file=sys.stderr)
        bench = Bench(systems, Prompts(engine.tokenizer))
        bench.warm_up()
        for r in range(args.repeat):
            bench.round(r, args.hits_per_round)
            print(f"round {r + 1}/{args.repeat}: " + "; ".join(
                f"{s} " + " ".join(f"{f} {bench.samples[(s, f)][-1] * 1e3:.0f}" for f in FIGURES) for s in systems)
                + " (ms)", file=sys.stderr)
        auto = str(resolve_dtype("auto", engine.loaded.device)).removeprefix("torch.")
        auto = auto if auto in DTYPES else "bfloat16"     # float16 (a GPU without bf16) is not measured
        res = bench.result(auto, peer_note, peer_info)
        res.update(repeat=args.repeat, hits_per_round=args.hits_per_round, model=engine.model_name,
                   machine=machine_note())
    finally:
        for system in systems.values():
            system.close()
    # The table, then the same figures as one JSON line (--json: the JSON line alone).
    emit(res, args.json, lambda r: (print_table(r), print(json.dumps(r))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
