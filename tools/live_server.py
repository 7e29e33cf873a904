"""A real `tieredkv serve` process for tools/live_drill.py, and what one of the drill's rows counts.

Knows: the server's command line (loopback, --port 0, its own cache dir, small device and host
pools so blocks reach the disk tier), its log, SIGTERM and what a shutdown says; the tiny
random-weight model (tests/conftest.py's tiny_model_dir) and the prompts (long shared prefixes).
Doesn't know: any attack (tools/live_drill.py, tools/live_drill_rows.py).
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
TIMEOUT = 180.0                  # per request: the machine is shared, a slow answer is not a failure
WORDS = ("cache tier block page disk host device token prefix model store ledger tenant flush "
         "restore evict write read commit latency batch stream server request").split()


def tiny_model(dst: Path) -> str:
    """tests/conftest.py's tiny_model_dir: a random-weight Llama, the real tokenizer, a 4k context."""
    import torch
    from transformers import LlamaForCausalLM
    from tests.service.tiny_engine import default_tokenizer_dir, load_tokenizer, tiny_config
    if default_tokenizer_dir() is None:
        from engine.model import load_model
        load_model()                                     # the one-time conversion of the default model
    tok = load_tokenizer(default_tokenizer_dir())
    config = tiny_config(len(tok))
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(dst)
    tok.save_pretrained(dst)
    return str(dst)


def prompts(docs: int = 10, questions: int = 5) -> list[str]:
    rng = random.Random(28)
    out = []
    for d in range(docs):           # ~330 tokens of shared prefix each: ~20 blocks of 16
        doc = " ".join(rng.choice(WORDS) for _ in range(300))
        out += [f"Document {d}: {doc}\nQuestion {q}: what does it say about {WORDS[q]}?" for q in range(questions)]
    return out


class Server:
    """`tieredkv serve` in a subprocess; its stderr read on a thread (the log is kept)."""

    def __init__(self, model: str, cache_dir: Path, *extra: str) -> None:
        args = ["serve", "--model", model, "--port", "0", "--cache-dir", str(cache_dir), "--dtype", "float32",
                "--device-memory", "1MiB", "--host-memory", "256KiB", "--disk-reserve", "1MiB",
                "--log-level", "warning", *extra]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}   # a SIGBUS leaves every stack
        self.proc = subprocess.Popen([sys.executable, "-m", "tieredkv.cli", *args], cwd=REPO, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(ln) for ln in self.proc.stderr], daemon=True).start()
        deadline, self.url = time.monotonic() + 600, None
        while self.url is None:
            m = next((re.search(r"serving \S+ on (http://\S+) ", ln) for ln in list(self.lines) if "serving" in ln), None)
            if m:
                self.url = m[1]
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the server did not start: {self.log()[-2000:]}")
            else:
                time.sleep(0.1)

    def log(self) -> str:
        return "".join(self.lines)

    def errors(self) -> list[str]:
        """The log's error lines and each traceback's last line, and a fatal error's stacks (faulthandler)."""
        text = self.log()
        fatal = text[text.index("Fatal Python error"):] if "Fatal Python error" in text else ""
        if fatal:                    # the first line, and the stack of the thread that touched the bad page
            fatal = fatal.split("\n", 1)[0] + "\n" + fatal[fatal.find("Current thread"):].split("\n\n", 1)[0][:4000]
        lines = text.splitlines()
        last = [lines[i] for i in range(1, len(lines)) if lines[i - 1].startswith(" ") and not lines[i].startswith(" ")
                and re.match(r"\w+(\.\w+)*(Error|Exception|Changed|Damaged)\b", lines[i])]
        return [ln for ln in lines if ln.startswith("ERROR")][:20] + last[:20] + ([fatal] if fatal else [])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def sigterm(self) -> dict:
        """SIGTERM; the exit status and whether the log says the shutdown failed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = "timeout (killed)"
        time.sleep(0.5)                                   # the reader thread drains the last lines
        return {"rc": rc, "shutdown_failed": "Application shutdown failed" in self.log(),
                "tracebacks": self.log().count("Traceback")}

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = TIMEOUT) -> httpx.Response:
        return httpx.request(method, self.url + path, json=body, timeout=timeout)


class Tally:
    """One row's counts. Written by the load threads and the drill's thread: under its lock."""

    def __init__(self, attack: str) -> None:
        self.lock = threading.Lock()
        self.row = {"attack": attack, "trials": 0, "crashes": 0, "wrong": 0, "ok": 0, "failed": Counter(),
                    "timeouts": 0, "health_5xx": Counter(), "ready_503": 0, "came_back": 0, "other": []}

    def add(self, key: str, n: int = 1, sub: str | None = None) -> None:
        with self.lock:
            if sub is None:
                self.row[key] += n
            else:
                self.row[key][sub] += n
