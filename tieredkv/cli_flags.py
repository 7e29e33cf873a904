"""The flags vLLM and llama-server users type, and what `tieredkv serve` makes of them.

Knows: which of their flags `serve` takes under the same name (declared in tieredkv/cli_serve.py),
which it takes under another (`ALIASES`: rewritten before typer parses), which it cannot honour
(`REFUSED`: a clear error naming what to use instead, never "No such option" and never silently
ignored), and the two that need work of their own: `--gpu-memory-utilization` (the device pool as
a fraction of the GPU's free memory) and `--chat-template` (a file or the template itself).
`FLAG_TABLE` is README's table (tests/test_readme.py checks that README lists every row).
Doesn't know: the commands themselves.
"""
from __future__ import annotations

import os

from tieredkv.cli_common import CLIError, cache_default

# llama-server's names for options serve has under vLLM's (typer cannot give an option a name
# that is a prefix-style short flag of two letters, so they are rewritten here).
ALIASES = {"-np": "--max-num-seqs", "--parallel": "--max-num-seqs", "-ub": "--max-num-batched-tokens",
           "--ubatch-size": "--max-num-batched-tokens"}

# What serve cannot do, and what to use instead.
REFUSED = {
    "--tensor-parallel-size": "one device per server: run one server per GPU behind `tieredkv route`",
    "-tp": "one device per server: run one server per GPU behind `tieredkv route`",
    "--pipeline-parallel-size": "one device per server: run one server per GPU behind `tieredkv route`",
    "-pp": "one device per server: run one server per GPU behind `tieredkv route`",
    "--swap-space": "KV blocks leave the device pool for the host tier: size it with --host-memory",
    "--cpu-offload-gb": "no weight offload: --device cpu runs the whole model on the CPU",
    "--kv-cache-dtype": "the KV cache is in the model's dtype: --dtype",
    "--quantization": "no quantized weights: a .gguf is converted to --dtype once",
    "-q": "no quantized weights: a .gguf is converted to --dtype once",
    "--enable-lora": "no LoRA adapters",
    "--trust-remote-code": "Llama-family architectures only (Llama, Mistral, Qwen2, Qwen3, SmolLM), no remote code",
    "-ngl": "the whole model runs on --device (cpu, cuda, cuda:N)",
    "--n-gpu-layers": "the whole model runs on --device (cpu, cuda, cuda:N)",
    "--gpu-layers": "the whole model runs on --device (cpu, cuda, cuda:N)",
    "-fa": "the attention backend is chosen at start (flex_paged on CUDA, gather_sdpa on CPU; "
           "$TIEREDKV_ATTENTION picks one)",
    "--flash-attn": "the attention backend is chosen at start (flex_paged on CUDA, gather_sdpa on CPU; "
                    "$TIEREDKV_ATTENTION picks one)",
    "--kv-events-config": "--kv-events [ENDPOINT] publishes vLLM's KV events (the config's endpoint); "
                          "--kv-events-replay, --kv-events-tokens, --kv-events-allow-keys",
    "--mlock": "the host tier is pinned memory under CUDA already; weights are not locked",
}

# README's table: (their flag, from, what serve does with it).
FLAG_TABLE = (
    ("MODEL, --model, -m", "vLLM, llama-server", "the same: a .gguf, a transformers directory, a hub id in the local "
     "cache; the default model also by its names, `SmolLM2-135M-Instruct` and `HuggingFaceTB/SmolLM2-135M-Instruct` "
     "(served under the name given)"),
    ("--host, --port", "vLLM, llama-server", "the same"),
    ("--served-model-name", "vLLM", "the same"),
    ("--max-model-len, -c, --ctx-size", "vLLM, llama-server", "the context length (`--max-model-len`)"),
    ("--max-num-seqs, -np, --parallel", "vLLM, llama-server", "sequences in one batch (default 64)"),
    ("--max-num-batched-tokens, -ub, --ubatch-size", "vLLM, llama-server", "tokens one engine step computes (default 512 on a CPU, 8192 on a GPU)"),
    ("--enforce-eager", "vLLM", "the same: decode steps run eagerly, no CUDA graphs"),
    ("--gpu-memory-utilization F", "vLLM", "the device pool is F of the GPU's free memory at start (CUDA only; "
     "else `--device-memory`)"),
    ("--enable-prefix-caching", "vLLM", "on (the default)"),
    ("--no-enable-prefix-caching", "vLLM", "no request reuses another's blocks: the device pool shares none, the "
     "host, disk and remote tiers are off"),
    ("--block-size", "vLLM", "the same (tokens per cached block, default 16)"),
    ("--dtype", "vLLM", "the same: auto, float32, bfloat16, float16"),
    ("--device", "vLLM", "the same: auto, cpu, cuda, cuda:N"),
    ("--chat-template", "vLLM", "the same: a file, or the template itself"),
    ("--seed", "vLLM", "the same: seeds the engine once; a sampled request without a seed takes the next of its "
     "stream (requests differ; the same requests in the same order sample the same)"),
    ("--api-key KEY", "vLLM, llama-server", "the same: any non-empty key; repeat for several (each an admin of "
     "tenant `default`); `--api-keys FILE` gives tenants and roles"),
    ("--disable-log-requests", "vLLM", "no line per request (a 5xx still logs)"),
    ("--disable-log-stats", "vLLM", "accepted: there are no periodic stats lines to turn off (`/metrics`, "
     "`/v1/cache/status`)"),
    ("--threads, -t", "llama-server", "CPU threads for the model (`torch.set_num_threads`)"),
    ("--kv-events-config", "vLLM", "refused: `--kv-events [ENDPOINT]` (the same wire format; `--kv-events-tokens` "
     "for `token_ids`)"),
    ("--tensor-parallel-size, --pipeline-parallel-size", "vLLM", "refused: one server per GPU behind `tieredkv route`"),
    ("--swap-space", "vLLM", "refused: `--host-memory` (the host tier)"),
    ("--kv-cache-dtype, --quantization, --cpu-offload-gb", "vLLM", "refused: `--dtype`, `--device cpu`"),
    ("-ngl, --n-gpu-layers, -fa, --flash-attn, --mlock", "llama-server", "refused: `--device`; the attention "
     "backend is chosen at start"),
)


def translate(argv: list[str]) -> list[str]:
    """`serve`'s command line with llama-server's aliases rewritten; a flag serve cannot honour
    is a CLIError (exit 2) naming what to use instead. Other commands' lines pass unchanged."""
    if "serve" not in argv:
        return argv
    at = argv.index("serve")
    head, tail = argv[:at + 1], []
    for arg in argv[at + 1:]:
        name, eq, value = arg.partition("=")
        if name in REFUSED:
            raise CLIError(f"{name}: not supported by tieredkv serve: {REFUSED[name]}", code=2)
        tail.append(ALIASES[name] + eq + value if name in ALIASES else arg)
    return head + tail


def pool_size(device_memory: str | None, fraction: float | None, device: str) -> str:
    """The device pool's size: --device-memory, or --gpu-memory-utilization of the GPU's free memory now."""
    if fraction is None:
        return device_memory or cache_default("device_memory")
    if device_memory is not None:
        raise CLIError("give one of --device-memory and --gpu-memory-utilization", code=2)
    if not 0 < fraction <= 1:
        raise CLIError(f"--gpu-memory-utilization: expected a fraction in (0, 1], got {fraction}", code=2)
    import torch
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not on_cuda:
        raise CLIError("--gpu-memory-utilization: this server runs on the CPU (no CUDA device); size the device "
                       "pool with --device-memory (e.g. --device-memory 4GiB)", code=2)
    free, _total = torch.cuda.mem_get_info(torch.device("cuda" if device == "auto" else device))
    return str(int(free * fraction))


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is a Jinja template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise CLIError(f"--chat-template: no such file {value!r} (and not a Jinja template)", code=2)
